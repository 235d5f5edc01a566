"""Run the cupy backend without a GPU: NumPy arrays, and the CPU CUDA emulator in place of NVRTC.

`emulated(thread_order)` swaps exactly what the backend takes from CUDA (its `Runtime`: the array
module and the module compiler) and lets the public API hand NumPy arrays to backend="cupy".
Everything else is the production code path: dispatch, specialization choice, grid sizes, strides,
argument packing, workspace allocation, and the .cu files themselves.

    with emulated("descending"):
        out = flashcupy.attention(q, k, v, causal=True, backend="cupy")
"""

from __future__ import annotations

import contextlib
import functools

import numpy as np
from emulator import EmulatedModule

from flashcupy.backends import cupy_backend


def _emulator_options(options) -> tuple:
    # -I options point at the CUDA toolkit's headers; the emulator brings its own cuda_fp16.h
    return tuple(o for o in options if not o.startswith("-I"))


@functools.lru_cache(maxsize=None)
def compile_module(source, name_expressions, options, thread_order="ascending", seed=0, cp_async="deferred"):
    return EmulatedModule(source, name_expressions, _emulator_options(options),
                          thread_order=thread_order, seed=seed, cp_async=cp_async)


@contextlib.contextmanager
def emulated(thread_order="ascending", seed=0, compile=compile_module, cp_async="deferred",
             compute_capability=90):
    """Make backend="cupy" run on NumPy arrays through the emulator, inside the block.

    `compile(source, name_expressions, options, thread_order, seed, cp_async)` builds the modules;
    tests that alter the kernel source pass their own. cp_async="eager" lands copies at issue
    (see tests/emulator/__init__.py); compute_capability is what the device reports (below 80
    the backend never picks the tensor-core kernels).
    """
    runtime = cupy_backend.Runtime(
        np, lambda source, names, options: compile(source, tuple(names), tuple(options), thread_order, seed,
                                                   cp_async),
        compute_capability=lambda x: compute_capability)
    saved = cupy_backend.runtime, cupy_backend.ARRAY_LIBRARIES
    cupy_backend.runtime, cupy_backend.ARRAY_LIBRARIES = runtime, ("numpy",)
    try:
        yield runtime
    finally:
        cupy_backend.runtime, cupy_backend.ARRAY_LIBRARIES = saved
