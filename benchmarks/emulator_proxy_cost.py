#!/usr/bin/env python
"""CPU time of emulated launches, to compare the emulator before and after a runtime change.

Run from the repository root of the checkout to measure (its flashcupy is imported):
    nice -n 10 python benchmarks/emulator_proxy_cost.py
block_sum (tests/emulator_kernels/block_reduce.cu) is an ordinary kernel: no instrumentation;
block_sum once more with hopper.cuh included and
wgmma_gemm<__half, 128> include hopper.cuh, so their stores call the async-proxy model
(runtime/proxy.h). The best of 11 launches each (process CPU time; the machine is shared).
"""
import sys
import time

import numpy as np

sys.path.insert(0, "tests")
import wgmma_blocks as blocks  # noqa: E402
from flashcupy.tools.emulator import EmulatedModule  # noqa: E402


def best(f, reps=11):
    f()
    times = []
    for _ in range(reps):
        t = time.process_time()
        f()
        times.append(time.process_time() - t)
    return min(times), sorted(times)[len(times) // 2]


with open("tests/emulator_kernels/block_reduce.cu") as file:
    k = EmulatedModule(file.read(), ["block_sum"]).get_function("block_sum")
x = np.random.default_rng(0).standard_normal(2048 * 128 * 8).astype(np.float32)
out = np.zeros(2048, np.float32)
print("block_sum 2048 blocks x 128 threads: min %.4f s, median %.4f s"
      % best(lambda: k((2048,), (128,), (x, out, np.int32(x.size)))))
# the same kernel in a module that includes hopper.cuh: every store of it goes through the callback
with open("tests/emulator_kernels/block_reduce.cu") as file:
    k = EmulatedModule('#include "hopper.cuh"\n' + file.read(), ["block_sum"], (blocks.INCLUDE,)).get_function("block_sum")
print("block_sum, including hopper.cuh: min %.4f s, median %.4f s"
      % best(lambda: k((2048,), (128,), (x, out, np.int32(x.size)))))
m = EmulatedModule(blocks.source(), blocks.NAMES, (blocks.INCLUDE,))
A, B, _ = blocks.problem("float16", 128, 64, np.random.default_rng(0))
print("wgmma_gemm<__half, 128> K=64 128B swizzle: min %.4f s, median %.4f s"
      % best(lambda: blocks.run(m.get_function, "float16", A, B)))
