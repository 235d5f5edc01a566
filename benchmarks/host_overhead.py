"""The cupy backend's host work per call, on the CPU: what a call costs before its kernels run.

On the H200 the Hopper forward at S = 512 (16k tokens a batch) measured 97-99 TFLOP/s, 708 us a call,
against the mma.sync forward's 111 (619 us) and cuDNN's 417 (benchmarks/results/h200_session3/): at
short sequences the host's part of a call, which CUDA events around the call include, weighs. This
script times that part here: the backend's Python (checks, kernel choice, grids, argument packing,
tensor maps) over a Runtime whose kernels do nothing, whose allocations come from a pool (as CuPy's),
and whose tensor maps are made by tensor_maps.tiled_arguments as on a GPU but not encoded by the driver
(cuTensorMapEncodeTiled needs one: its cost is not in these figures, and the map cache skips it too).
Each row: the same call with the host caches (cupy_backend.CACHE_HOST_WORK: the grids, the kernel
path, the kernels' scalar arguments, element strides, the tensor maps) and without, in turn in one run,
and NumPy's sgemm rate beside them: this machine's speed drifts.

    python benchmarks/host_overhead.py
"""

from __future__ import annotations

import importlib
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flashcupy  # noqa: E402
from flashcupy.backends import cupy_backend  # noqa: E402
from compare_cpu import sgemm_rate  # noqa: E402

runtime_module = importlib.import_module("flashcupy.backends.cupy_backend.runtime")


class _Pool:
    """np's allocation functions from a pool, as CuPy's memory pool hands back a freed block."""

    def __init__(self):
        self.arrays = {}

    def _take(self, shape, dtype):
        key = (tuple(np.atleast_1d(shape)), np.dtype(dtype).str)
        if key not in self.arrays:
            self.arrays[key] = np.zeros(shape, dtype)
        return self.arrays[key]

    # zeros: not filled again (on a GPU a memset launched, not host work)
    empty = zeros = _take

    def __getattr__(self, name):
        return getattr(np, name)


class _NoKernels:
    def get_function(self, name):
        function = lambda *args, **kwargs: None  # noqa: E731
        function.max_dynamic_shared_size_bytes = 0
        return function


def runtime(compute_capability: int) -> object:
    """A Runtime whose kernels do nothing, with a GPU's tensor-map cache (maps as 128 zero bytes)."""
    modules = {}

    def compile_module(source, names, options):
        return modules.setdefault((source, names, options), _NoKernels())

    return runtime_module.Runtime(_Pool(), compile_module, compute_capability=lambda x: compute_capability,
                                  data_ptr=lambda x: x.__array_interface__["data"][0],  # CuPy: x.data.ptr
                                  tensor_map=lambda x, arguments, dtype_name: np.zeros(16, np.uint64),
                                  tensor_map_cache={})


def calls(B=32, S=512, H=16, D=128):
    q, k, v, dout = (np.zeros((B, S, H, D), np.float16) for _ in range(4))
    out, lse = flashcupy.attention(q, k, v, return_lse=True, backend="cupy")
    # a decode step over a cache, the shape of flash-attn #1743 (../shared/USERS.md): one new token appended
    q1, k1 = np.zeros((64, 1, 16, 128), np.float16), np.zeros((64, 1, 2, 128), np.float16)
    k_cache, v_cache = (np.zeros((64, 8191, 2, 128), np.float16) for _ in range(2))
    lengths = np.full(64, 8000, np.int32)
    return {"decode step": lambda: flashcupy.attention_with_kvcache(q1, k_cache, v_cache, k=k1, v=k1, causal=True,
                                                                    cache_seqlens=lengths, backend="cupy",
                                                                    check_offsets=False),
            "forward": lambda: flashcupy.attention(q, k, v, backend="cupy"),
            "forward causal": lambda: flashcupy.attention(q, k, v, causal=True, backend="cupy"),
            "backward": lambda: flashcupy.attention_backward(dout, q, k, v, out, lse, backend="cupy"),
            "backward deterministic": lambda: flashcupy.attention_backward(dout, q, k, v, out, lse, backend="cupy",
                                                                           deterministic=True)}


def timed(fn, n=200):
    """Seconds a call: the best of 5 means of n calls."""
    import time
    fn()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def main() -> int:
    saved = cupy_backend.runtime, cupy_backend.ARRAY_LIBRARIES
    cupy_backend.ARRAY_LIBRARIES = ("numpy",)
    rows = []
    sgemm_before = sgemm_rate()
    try:
        for cc, path in ((90, "hopper"), (80, "mma.sync")):
            cupy_backend.runtime = runtime(cc)
            for name, fn in calls().items():
                def cached(fn=fn):
                    cupy_backend.CACHE_HOST_WORK = True
                    return timed(fn)

                def uncached(fn=fn):
                    cupy_backend.CACHE_HOST_WORK = False
                    return timed(fn)
                results = {}
                for _ in range(2):  # in turn, twice: the best of each
                    for label, f in (("cached", cached), ("uncached", uncached)):
                        results[label] = min(results.get(label, float("inf")), f())
                rows.append((path, name, results["uncached"] * 1e6, results["cached"] * 1e6))
    finally:
        cupy_backend.CACHE_HOST_WORK = True
        cupy_backend.runtime, cupy_backend.ARRAY_LIBRARIES = saved
    print("host work a call, us (B=32, S=512, H=16, D=128, float16; the decode step: q (64, 1, 16, 128) over a cache "
          "(64, 8191, 2, 128), a token appended; kernels that do nothing; no driver map encode)")
    print(f"{'path':<9} {'call':<23} {'uncached':>9} {'cached':>8} {'saved':>7}")
    for path, name, before, after in rows:
        print(f"{path:<9} {name:<23} {before:9.0f} {after:8.0f} {before - after:7.0f}")
    print(f"\nNumPy sgemm (4096^3) before and after: {sgemm_before:.0f} and {sgemm_rate():.0f} GFLOP/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
