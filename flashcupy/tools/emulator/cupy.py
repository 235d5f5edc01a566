"""Run the cupy backend without a GPU: NumPy arrays, and the CPU CUDA emulator in place of NVRTC.

`emulated(thread_order)` swaps exactly what the backend takes from CUDA (its `Runtime`: the array
module and the module compiler) and lets the public API hand NumPy arrays to backend="cupy".
Everything else is the production code path: dispatch, specialization choice, grid sizes, strides,
argument packing, workspace allocation, and the .cu files themselves.

    from flashcupy.tools.emulator.cupy import emulated

    with emulated("descending"):
        out = flashcupy.attention(q, k, v, causal=True, backend="cupy")

The tests, `python -m flashcupy kernels --counters` (tools/perfmodel.py) and the GPU session's dry
run (benchmarks/gpu_session.py) all run the backend this way.
"""

from __future__ import annotations

import contextlib
import functools

import numpy as np

from flashcupy.backends import cupy_backend
from flashcupy.backends.cupy_backend import sources, specs

from .driver import EmulatedModule
from .tma import TensorMap


@functools.lru_cache(maxsize=None)
def compile_module(source, name_expressions, options, thread_order="ascending", seed=0, cp_async="deferred"):
    return EmulatedModule(source, name_expressions, options, thread_order=thread_order, seed=seed, cp_async=cp_async)


@contextlib.contextmanager
def emulated(thread_order="ascending", seed=0, compile=compile_module, cp_async="deferred",
             compute_capability=80, sm_count=132):
    """Make backend="cupy" run on NumPy arrays through the emulator, inside the block.

    `compile(source, name_expressions, options, thread_order, seed, cp_async)` builds the modules,
    from the options cupy.RawModule passes NVRTC: the backend's, then CuPy's own
    (sources.CUPY_NVRTC_OPTIONS: the emulator flushes subnormals for its -ftz=true) and -arch for the
    device (CuPy's -I for the CUDA headers has no use here: the emulator brings its own). Tests that
    alter the kernel source pass their own `compile`. cp_async="eager" lands copies at issue (see
    the package's docstring); compute_capability is what the device reports: 80 by default, an A100,
    where the forward runs on the mma.sync kernels; 90 (an H100) sends the calls it covers to the
    Hopper forward (flash_fwd_sm90.cu); below 80 the backend never picks the tensor-core kernels.
    sm_count: the device's multiprocessors (split-KV's plan, the persistent Hopper forward's grid: a
    small one makes each CTA walk several tiles). The device's shared-memory opt-in limit is its compute
    capability's (specs.smem_optin).
    """
    def compile_as_cupy(source, names, options):
        if not any(option.startswith("-arch") for option in options):  # else the backend's own arch (sm_90a)
            options = tuple(options) + sources.CUPY_NVRTC_OPTIONS + (f"-arch=sm_{compute_capability}",)
        return compile(source, tuple(names), tuple(options), thread_order, seed, cp_async)

    optin = specs.smem_optin(compute_capability)
    runtime = cupy_backend.Runtime(np, compile_as_cupy, compute_capability=lambda x: compute_capability,
                                   sm_count=lambda x: sm_count, smem_optin=lambda x: optin,
                                   tensor_map=lambda x, arguments, dtype_name: TensorMap(x, arguments))
    saved = cupy_backend.runtime, cupy_backend.ARRAY_LIBRARIES
    cupy_backend.runtime, cupy_backend.ARRAY_LIBRARIES = runtime, ("numpy",)
    try:
        yield runtime
    finally:
        cupy_backend.runtime, cupy_backend.ARRAY_LIBRARIES = saved


def recording(names: list, compile=compile_module):
    """A compile function for emulated() that appends the name expressions of every module it builds
    to `names`: which specialisations a call launched."""
    def record(source, name_expressions, options, *rest):
        names.extend(name_expressions)
        return compile(source, name_expressions, options, *rest)
    return record


def launch_records(records: list, run: bool = True, compile=compile_module):
    """A compile function for emulated() whose kernels append (name expression, CTAs) to `records` at
    every launch: how many launches a call makes, and of what grid. run=False records each launch
    without running it (no result, no cost: what the grids hold); `compile` builds the modules
    (compile_module, or a test's that alters the source)."""
    class Launch:  # one kernel, its launches recorded; its attributes (the shared-memory opt-in) are its own
        def __init__(self, module, name):
            self.__dict__.update(name=name, function=module.get_function(name) if run else None)

        def __call__(self, grid, block, args, **kw):
            records.append((self.name, grid[0]))
            return self.function(grid, block, args, **kw) if run else None

        def __getattr__(self, attribute):
            return getattr(self.function, attribute)

        def __setattr__(self, attribute, value):
            if run:
                setattr(self.function, attribute, value)

    class Module:
        def __init__(self, *arguments):
            self.module = compile(*arguments) if run else None

        def get_function(self, name):
            return Launch(self.module, name)

    return Module
