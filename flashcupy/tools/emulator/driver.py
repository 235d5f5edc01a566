"""Compile .cu sources with g++ against the shim, load them, launch kernels.

See the package docstring (flashcupy/tools/emulator/__init__.py) for the API and what is
and is not faithful. Room: launching, and the public classes (EmulatedModule, EmulatedFunction).
The other rooms: errors.py (the exceptions), build.py (options, g++, the cache), abi.py (the
ctypes mirror of runtime.cpp's interface, loading a module), arguments.py (guarded buffers,
scalars). Their public names are importable from here too, as before the split.
"""

from __future__ import annotations

import ctypes
import signal
import threading

import numpy as np

from flashcupy.backends.cupy_backend.specs import SM90_SMEM_OPTIN

from .abi import (
    _DEADLOCK,
    _DYNAMIC_SHARED,
    _OK,
    _RESOURCES,
    _SHARED_OVERRUN,
    _STACK,
    _TIMEOUT,
    _TRAP,
    _WARP_MISUSE,
    _Counters,
    _LaunchConfig,
    _LaunchReport,
    _load,
    _ParamInfo,
)
from .arguments import _describe_array, _dim3, marshal
from .build import (  # noqa: F401  (re-exported: driver.py held them before the split)
    ARCH_DEFAULT,
    COUNTING_CXXFLAGS,
    CXX,
    CXXFLAGS,
    INCLUDE,
    RUNTIME,
    _build,
    _parse_options,
    cache_dir,
)
from .counters import CATEGORIES, SCALARS, Counters, LaunchCounters, _record
from .errors import (  # noqa: F401  (re-exported: tests import CompileError from here)
    CompileError,
    DeadlockError,
    EmulatorError,
    KernelError,
    LaunchError,
    OutOfBoundsError,
)

THREAD_ORDERS = ("ascending", "descending", "shuffled", "warp_skew")
CP_ASYNC_MODES = ("deferred", "eager")
SHARED_MEM_DEFAULT = 48 * 1024     # what a launch may request without opting in
SHARED_MEM_OPTIN_MAX = SM90_SMEM_OPTIN  # the most a kernel may opt in to (sm_90): specs' one figure
STACK_SIZE_DEFAULT = 256 * 1024    # per CUDA thread; pages are only touched as used
TIME_LIMIT_DEFAULT = 600.0         # seconds of CPU time per launch: a spinning kernel is reported, not hung
MAX_THREADS_PER_BLOCK = 1024


_launch_lock = threading.Lock()  # the runtime is single-threaded: one launch at a time
_stacks_held = [None]  # the library whose fiber stacks are mapped (runtime.cpp's emu_release_stacks)


def _launch(lib, entry, argv, config, report) -> int:
    with _launch_lock:
        held = _stacks_held[0]
        if held is not None and held is not lib:
            held.emu_release_stacks()
        _stacks_held[0] = lib
        return lib.emu_launch(entry, argv, ctypes.byref(config), ctypes.byref(report))


class EmulatedFunction:
    """One kernel of an EmulatedModule; call it like cupy.RawKernel."""

    def __init__(self, module: "EmulatedModule", name: str, lib, index: int):
        self.name = name
        self._module = module
        self._lib = lib
        self._entry = ctypes.cast(getattr(lib, f"emu_entry_{index}"), ctypes.c_void_p).value
        describe = getattr(lib, f"emu_params_{index}")
        describe.restype = ctypes.c_int
        capacity = 64
        while True:
            infos = (_ParamInfo * capacity)()
            arity = describe(infos, capacity)
            if arity <= capacity:
                break
            capacity = arity
        self.params = tuple((p.kind, p.size, p.pointee_size) for p in infos[:arity])
        self._max_dynamic_shared = module.shared_mem_limit
        self.last_counters = None  # Counters of the last launch, if the module counts

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        """The most dynamic shared memory a launch may request (CuPy's attribute of that name)."""
        return self._max_dynamic_shared

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, value: int) -> None:
        if not 0 <= value <= SHARED_MEM_OPTIN_MAX:
            raise LaunchError(f"max_dynamic_shared_size_bytes must be at most {SHARED_MEM_OPTIN_MAX}, got {value}")
        self._max_dynamic_shared = int(value)

    def __repr__(self) -> str:
        return f"<EmulatedFunction {self.name!r}>"

    def _where(self, report) -> str:
        if not report.has_thread:
            return ""
        return f" in block {tuple(report.block)} thread {tuple(report.thread)}"

    def _check_launch(self, grid, block, args, shared_mem) -> None:
        prefix = f"kernel {self.name!r}:"
        threads = block[0] * block[1] * block[2]
        if min(grid + block) < 1:
            raise LaunchError(f"{prefix} grid {grid} and block {block} must be positive in every dimension")
        if threads > MAX_THREADS_PER_BLOCK or block[2] > 64:
            raise LaunchError(f"{prefix} block {block} has {threads} threads; a block holds at most "
                              f"{MAX_THREADS_PER_BLOCK} threads, and blockDim.z at most 64")
        if grid[0] >= 2**31 or grid[1] > 65535 or grid[2] > 65535:
            raise LaunchError(f"{prefix} grid {grid} exceeds (2**31 - 1, 65535, 65535)")
        if not 0 <= shared_mem <= self._max_dynamic_shared:
            raise LaunchError(
                f"{prefix} shared_mem={shared_mem} bytes exceeds the limit of {self._max_dynamic_shared} bytes "
                f"(raise it up to {SHARED_MEM_OPTIN_MAX} with max_dynamic_shared_size_bytes, as on a GPU)")
        if len(args) != len(self.params):
            raise LaunchError(f"{prefix} takes {len(self.params)} arguments, got {len(args)}")


    def __call__(self, grid, block, args, *, shared_mem=0, stream=None, enable_cooperative_groups=False):
        if enable_cooperative_groups:
            raise NotImplementedError("the emulator does not implement cooperative launches")
        grid, block = _dim3(grid, "grid"), _dim3(block, "block")
        args = tuple(args)
        shared_mem = int(shared_mem)
        self._check_launch(grid, block, args, shared_mem)
        module = self._module
        regions, storage = marshal(self._lib, self.name, self.params, args, module.oob_guard == "end")
        try:
            argv = (ctypes.c_void_p * max(1, len(args)))(*(ctypes.addressof(s) for s in storage))
            config = _LaunchConfig((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), shared_mem,
                                   module.stack_size, module.seed, THREAD_ORDERS.index(module.thread_order),
                                   int(module.cp_async == "eager"), int(module.ftz), int(module.counters),
                                   float(module.time_limit or 0))
            report = _LaunchReport()
            status = _launch(self._lib, self._entry, argv, config, report)
            if status != _OK:
                raise self._error(report, regions, storage, shared_mem)
            if module.counters:
                raw = _Counters()
                self._lib.emu_counters(ctypes.byref(raw))
                self.last_counters = Counters(
                    access={c: tuple(int(x) for x in raw.access[i]) for i, c in enumerate(CATEGORIES)},
                    **{name: int(getattr(raw, name)) for name in SCALARS})
                _record(LaunchCounters(self.name, grid, block, shared_mem, self.last_counters))
            for region in regions:
                side = region.slack_written()
                if side is not None:
                    index, array = region.members[0][:2]
                    raise OutOfBoundsError(
                        f"kernel {self.name!r}: out-of-bounds write {side} the bytes of argument {index} "
                        f"({_describe_array(array)}), found after the launch (the {'other' if side == 'after' else 'lower'} "
                        f"side is guarded exactly; oob_guard={module.oob_guard!r})",
                        self.name, argument=index, access="write")
            for region in regions:
                region.copy_back(self.name)
        finally:
            for region in regions:
                region.release()

    def _error(self, report, regions, storage, shared_mem) -> KernelError:
        name = self.name
        where = self._where(report)
        block = tuple(report.block) if report.has_thread else None
        thread = tuple(report.thread) if report.has_thread else None
        message = report.message.decode(errors="replace")
        status = report.status
        if status == _DEADLOCK:
            return DeadlockError(f"kernel {name!r}: {message}", name, block, thread)
        if status == _SHARED_OVERRUN:
            return OutOfBoundsError(f"kernel {name!r}: {message}", name, block, thread, access="write")
        if status in (_WARP_MISUSE, _TRAP, _RESOURCES, _TIMEOUT):
            return KernelError(f"kernel {name!r}{where}: {message}", name, block, thread)
        access = {1: "read", 2: "write"}.get(report.access, "access")
        address = report.fault_address
        if report.signal in (signal.SIGSEGV, signal.SIGBUS):
            if report.where == _DYNAMIC_SHARED:
                return OutOfBoundsError(
                    f"kernel {name!r}{where}: out-of-bounds {access} of dynamic shared memory "
                    f"(the launch requested shared_mem={shared_mem} bytes)", name, block, thread, access=access)
            if report.where == _STACK:
                return KernelError(
                    f"kernel {name!r}{where}: stack overflow: a thread used more than "
                    f"{self._module.stack_size} bytes of local memory (raise EmulatedModule's stack_size)",
                    name, block, thread)
            for region in regions:
                side = region.guard_side(address)
                if side is None:
                    continue
                index, array, lo, hi, first = region.members[0]
                pointer = region.pointer(first)  # what the kernel got (for a TensorMap: inside it)
                others = [m[0] for m in region.members[1:]]
                shared = f", sharing memory with arguments {others}" if others else ""
                edge = "before the first" if side == "before" else "past the last"
                return OutOfBoundsError(
                    f"kernel {name!r}{where}: out-of-bounds {access} of argument {index} "
                    f"({_describe_array(array)}{shared}) at element offset {(address - pointer) // array.itemsize} "
                    f"from the pointer passed, {edge} byte the array spans",
                    name, block, thread, argument=index, access=access)
            return KernelError(f"kernel {name!r}{where}: invalid {access} at address {address:#x}, not beside any "
                               f"argument (a null, wild or misaligned pointer)", name, block, thread)
        reasons = {signal.SIGFPE: "arithmetic exception (an integer division by zero?)",
                   signal.SIGILL: "illegal instruction (code g++ proved unreachable, e.g. falling off "
                                  "the end of a function that returns a value)",
                   signal.SIGABRT: "abort() (a failed assert(); its message is on stderr)"}
        return KernelError(f"kernel {name!r}{where}: {reasons.get(report.signal, f'signal {report.signal}')}",
                           name, block, thread)


class EmulatedModule:
    """Drop-in for cupy.RawModule that compiles with g++ and runs on the CPU.

    EmulatedModule(code, name_expressions, options, *, thread_order='ascending',
    seed=0, shared_mem_limit=48 KiB, stack_size=256 KiB, oob_guard='end', cp_async='deferred',
    counters=False, time_limit=600). With counters=True the module is built to count its memory
    traffic, and each launch sets the function's `last_counters` (emulator/counters.py). time_limit:
    the seconds of CPU time a launch may use before it is reported as a KernelError (None: no limit).
    """

    def __init__(self, code: str, name_expressions=(), options=(), *, thread_order: str = "ascending",
                 seed: int = 0, shared_mem_limit: int = SHARED_MEM_DEFAULT, stack_size: int = STACK_SIZE_DEFAULT,
                 oob_guard: str = "end", ucontext: bool = False, cp_async: str = "deferred",
                 counters: bool = False, time_limit: float | None = TIME_LIMIT_DEFAULT):
        if thread_order not in THREAD_ORDERS:
            raise ValueError(f"thread_order must be one of {THREAD_ORDERS}, got {thread_order!r}")
        if cp_async not in CP_ASYNC_MODES:
            raise ValueError(f"cp_async must be one of {CP_ASYNC_MODES}, got {cp_async!r}")
        if oob_guard not in ("end", "start"):
            raise ValueError(f"oob_guard must be 'end' or 'start', got {oob_guard!r}")
        if not 0 <= shared_mem_limit <= SHARED_MEM_OPTIN_MAX:
            raise ValueError(f"shared_mem_limit must be between 0 and {SHARED_MEM_OPTIN_MAX}, got {shared_mem_limit}")
        self.code = code
        self.options = tuple(options)
        self.ftz = _parse_options(self.options)[3]
        self.thread_order = thread_order
        self.seed = int(seed)
        self.shared_mem_limit = int(shared_mem_limit)
        self.stack_size = int(stack_size)
        self.oob_guard = oob_guard
        self.cp_async = cp_async
        self._ucontext = ucontext
        self.counters = bool(counters)
        if time_limit is not None and not time_limit > 0:
            raise ValueError(f"time_limit must be a positive number of seconds or None, got {time_limit!r}")
        self.time_limit = time_limit
        self._names = list(name_expressions or ())
        self._lib = self._compile() if self._names else None
        self._functions = {}

    def _compile(self):
        return _load(_build(self.code, tuple(self._names), self.options, self._ucontext, self.counters))

    def get_function(self, name: str) -> EmulatedFunction:
        if name not in self._functions:
            if name not in self._names:  # a plain extern "C" name not listed up front: rebuild with it
                self._names.append(name)
                self._lib = None
            if self._lib is None:
                self._lib = self._compile()
            self._functions[name] = EmulatedFunction(self, name, self._lib, self._names.index(name))
        return self._functions[name]


def garbage(shape, dtype) -> np.ndarray:
    """An array filled with 0xFF bytes (NaN for floats, -1 for ints), like fresh GPU memory at its worst."""
    out = np.empty(shape, dtype)
    out.reshape(-1).view(np.uint8).fill(0xFF)
    return out
