"""Compile .cu sources with g++ against the shim, load them, launch kernels.

See the package docstring (flashcupy/tools/emulator/__init__.py) for the API and what is
and is not faithful. Layout of this file: errors, build and cache, argument
marshalling, launch and fault reports, the public classes.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading

import numpy as np

from .counters import CATEGORIES, Counters, LaunchCounters, _record

HERE = os.path.dirname(os.path.abspath(__file__))
INCLUDE = os.path.join(HERE, "include")
RUNTIME = os.path.join(HERE, "runtime.cpp")

THREAD_ORDERS = ("ascending", "descending", "shuffled", "warp_skew")
CP_ASYNC_MODES = ("deferred", "eager")
SHARED_MEM_DEFAULT = 48 * 1024     # what a launch may request without opting in
SHARED_MEM_OPTIN_MAX = 227 * 1024  # the most a kernel may opt in to (sm_90)
STACK_SIZE_DEFAULT = 256 * 1024    # per CUDA thread; pages are only touched as used
TIME_LIMIT_DEFAULT = 600.0         # seconds of CPU time per launch: a spinning kernel is reported, not hung
MAX_THREADS_PER_BLOCK = 1024
ARCH_DEFAULT = 900                 # __CUDA_ARCH__ unless an -arch option says otherwise

CXX = os.environ.get("CXX", "g++")
# Measured on the test kernels (2-core CI box): compile time is ~0.6 s per module at
# -O0, -O1 and -O2 alike (mostly headers and linking); -O1 ran the 20-barrier
# benchmark fastest (10.6 ms vs 22 ms at -O0 and 13 ms at -O2).
CXXFLAGS = (
    "-std=c++20", "-O1", "-fPIC",
    "-fno-strict-aliasing",            # kernels reinterpret shared memory freely, as CUDA allows
    "-ftrivial-auto-var-init=pattern",  # uninitialised locals hold garbage, like registers
    "-fstack-clash-protection",        # a huge local array hits the stack's guard page
    "-U_FORTIFY_SOURCE",               # siglongjmp between fiber stacks is intended
)
# A counting build (EmulatedModule(counters=True)): g++ calls the runtime before every load and
# store the kernel makes (-fsanitize=kernel-address's callbacks, no shadow memory, no stack or
# global instrumentation), so runtime.cpp can cost the warp's shared and global memory requests.
# An ordinary build has none of it: counting costs nothing when it is off.
COUNTING_CXXFLAGS = (
    "-fsanitize=kernel-address", "--param", "asan-instrumentation-with-call-threshold=0",
    "--param", "asan-stack=0", "--param", "asan-globals=0", "-fno-sanitize-address-use-after-scope",
    "-DEMU_COUNTERS=1",
)


# ----------------------------------------------------------------------------
# errors


class EmulatorError(RuntimeError):
    """Base class of every error the emulator raises."""


class CompileError(EmulatorError):
    """g++ rejected the kernel source (the message carries its diagnostics)."""


class LaunchError(EmulatorError, ValueError):
    """The launch itself is invalid: grid, block, shared memory or arguments."""


class KernelError(EmulatorError):
    """The kernel failed while running. `kernel`, `block` and `thread` say where (None if unknown)."""

    def __init__(self, message, kernel, block=None, thread=None):
        super().__init__(message)
        self.kernel = kernel
        self.block = block
        self.thread = thread


class OutOfBoundsError(KernelError):
    """An access outside an argument's array or outside the dynamic shared memory requested.

    `argument` is the index of the argument (None for shared memory), `access`
    is 'read', 'write' or 'access' (unknown).
    """

    def __init__(self, message, kernel, block=None, thread=None, argument=None, access="access"):
        super().__init__(message, kernel, block, thread)
        self.argument = argument
        self.access = access


class DeadlockError(KernelError):
    """Threads of a block wait for one another forever (divergent barriers or warp collectives)."""


# ----------------------------------------------------------------------------
# build and cache


def cache_dir() -> str:
    """Where compiled modules live: $FLASHCUPY_EMULATOR_CACHE, else a per-user temp folder."""
    path = os.environ.get("FLASHCUPY_EMULATOR_CACHE") or os.path.join(
        tempfile.gettempdir(), f"flashcupy-emulator-{os.getuid()}")
    os.makedirs(path, exist_ok=True)
    return path


def _digest(*parts) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part if isinstance(part, bytes) else repr(part).encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


_memo: dict = {}
_build_lock = threading.Lock()


def _toolchain() -> tuple:
    """The compiler's identity and the emulator's own sources: any change rebuilds everything."""
    if "toolchain" not in _memo:
        version = subprocess.run([CXX, "--version"], capture_output=True, text=True, check=True).stdout
        sources = []
        for name in sorted(os.listdir(INCLUDE)) + ["../runtime.cpp"]:
            with open(os.path.join(INCLUDE, name), "rb") as f:
                sources.append((name, f.read()))
        _memo["toolchain"] = (shutil.which(CXX), version, CXXFLAGS, tuple(sources))
    return _memo["toolchain"]


def _compile(command: list, what: str) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise CompileError(f"g++ failed to compile {what}:\n{result.stderr[-8000:]}")


def _runtime_object(ucontext: bool) -> str:
    path = os.path.join(cache_dir(), f"runtime-{_digest(_toolchain(), ucontext)}.o")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.tmp"
        _compile([CXX, *CXXFLAGS, "-fvisibility=hidden", *(["-DEMU_USE_UCONTEXT"] if ucontext else []),
                  "-I", INCLUDE, "-c", RUNTIME, "-o", tmp], "the emulator runtime")
        os.replace(tmp, path)
    return path


_FTZ = re.compile(r"--?ftz=(.*)")
_FAST_MATH = ("--use_fast_math", "-use_fast_math")


def _parse_options(options) -> tuple:
    """(defines, include_dirs, arch, ftz) from NVRTC-style options; NVRTC-only flags are ignored.

    ftz: whether float32 subnormals are flushed to zero: -ftz=true|false (--ftz=), else whether
    --use_fast_math (which implies -ftz=true) is given.
    """
    defines, include_dirs, arch, ftz = [], [], ARCH_DEFAULT, None
    options = list(options)
    fast_math = any(str(o) in _FAST_MATH for o in options)
    i = 0
    while i < len(options):
        opt = str(options[i])
        value = None
        if m := _FTZ.fullmatch(opt):
            if m.group(1) not in ("true", "false"):
                raise ValueError(f"options: {opt!r} must be -ftz=true or -ftz=false")
            ftz = m.group(1) == "true"
        for flag, long_flag in (("-D", "--define-macro"), ("-I", "--include-path"),
                                ("-arch", "--gpu-architecture")):
            if opt in (flag, long_flag):
                i += 1
                value = str(options[i])
            elif opt.startswith(long_flag + "="):
                value = opt[len(long_flag) + 1:]
            elif opt.startswith(flag + ("=" if flag == "-arch" else "")) and opt != flag:
                value = opt[len(flag) + (1 if flag == "-arch" else 0):]
            else:
                continue
            if flag == "-D":
                defines.append(value)
            elif flag == "-I":
                include_dirs.append(os.path.abspath(value))
            else:
                m = re.fullmatch(r"(?:sm|compute)_(\d+)[a-z]?", value)
                if m:
                    arch = int(m.group(1)) * 10
            break
        i += 1
    return tuple(defines), tuple(include_dirs), arch, fast_math if ftz is None else ftz


def _include_dir_contents(include_dirs) -> tuple:
    """Headers the source may include: part of the cache key, so editing one rebuilds."""
    contents = []
    for d in include_dirs:
        if not os.path.isdir(d):
            continue
        for name in sorted(os.listdir(d)):
            if name.endswith((".h", ".cuh", ".hpp", ".inc", ".cu")):
                with open(os.path.join(d, name), "rb") as f:
                    contents.append((d, name, f.read()))
    return tuple(contents)


# `extern __shared__ [align] T name[];` (dynamic shared memory) cannot be spelt in
# C++ with a macro, so it is rewritten to EMU_DYNAMIC_SHARED(name, T); before
# compilation, keeping the line count.
_EXTERN_SHARED = re.compile(
    r"extern\s+__shared__\s+(?P<decl>[^;\[\]{}]*?)\s*\b(?P<name>[A-Za-z_]\w*)\s*\[\s*\]\s*;")
_ALIGNMENT = re.compile(r"__align__\s*\(\s*\w+\s*\)|alignas\s*\([^)]*\)|__attribute__\s*\(\(.*?\)\)")


def _rewrite_dynamic_shared(source: str) -> str:
    def replace(m):
        decl = " ".join(_ALIGNMENT.sub(" ", m.group("decl")).split())
        return f"EMU_DYNAMIC_SHARED({m.group('name')}, {decl});" + "\n" * m.group(0).count("\n")

    return _EXTERN_SHARED.sub(replace, source)


def _write_atomically(path: str, text: str) -> None:
    """Concurrent test processes may build the same module: readers see a whole file or none."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _build(source: str, names: tuple, options: tuple, ucontext: bool = False, counters: bool = False) -> str:
    """Path of the shared library for (source, names, options), compiling it if not cached."""
    defines, include_dirs, arch, _ = _parse_options(options)  # ftz is set per launch, not built in
    key = _digest(_toolchain(), source, names, defines, include_dirs, arch, ucontext,
                  _include_dir_contents(include_dirs), *((COUNTING_CXXFLAGS,) if counters else ()))
    stem = os.path.join(cache_dir(), f"module-{key}")
    if os.path.exists(stem + ".so"):
        return stem + ".so"
    runtime = _runtime_object(ucontext)
    _write_atomically(stem + ".cu", _rewrite_dynamic_shared(source))
    lines = [f'#include "{stem}.cu"', '#include "emu_trampoline.h"']
    for i, name in enumerate(names):
        lines += [f'#line 1 "<name expression {i}: {name}>"',
                  f"EMU_EXPORT void emu_entry_{i}(void** argv) {{ emu::invoke(&{name}, argv); }}",
                  f"EMU_EXPORT int emu_params_{i}(emu::ParamInfo* out, int capacity) "
                  f"{{ return emu::describe(&{name}, out, capacity); }}"]
    _write_atomically(stem + ".cpp", "\n".join(lines) + "\n")
    command = [CXX, *CXXFLAGS, *(COUNTING_CXXFLAGS if counters else ()), "-shared", "-I", INCLUDE,
               "-include", os.path.join(INCLUDE, "cuda_emu.h"),
               "-D__CUDACC__", "-D__CUDACC_RTC__", f"-D__CUDA_ARCH__={arch}",
               *(f"-D{d}" for d in defines), *(f"-I{d}" for d in include_dirs),
               stem + ".cpp", runtime, f"-Wl,-T,{os.path.join(INCLUDE, 'emu_shared.ld')}",
               "-o", f"{stem}.so.{os.getpid()}.tmp"]
    try:
        _compile(command, f"kernels {', '.join(names)}")
    except CompileError as e:
        if re.search(r"extern\s+__shared__", _rewrite_dynamic_shared(source)):
            raise CompileError(f"{e}\n(note: the emulator only understands dynamic shared memory declared "
                               f"as `extern __shared__ [__align__(n)] T name[];`, one name per declaration)") from None
        raise
    os.replace(f"{stem}.so.{os.getpid()}.tmp", stem + ".so")
    return stem + ".so"


class _ParamInfo(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int), ("size", ctypes.c_int), ("pointee_size", ctypes.c_int)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("dynamic_shared_bytes", ctypes.c_uint64), ("stack_bytes", ctypes.c_uint64),
                ("seed", ctypes.c_uint64), ("order", ctypes.c_int), ("cp_async_eager", ctypes.c_int),
                ("flush_denormals", ctypes.c_int), ("count", ctypes.c_int), ("time_limit", ctypes.c_double)]


class _Counters(ctypes.Structure):  # runtime.cpp's EmuCounters
    _fields_ = [("access", (ctypes.c_uint64 * 4) * len(CATEGORIES)), ("barriers", ctypes.c_uint64),
                ("mma", ctypes.c_uint64), ("ctas", ctypes.c_uint64), ("warps", ctypes.c_uint64)]


class _LaunchReport(ctypes.Structure):
    _fields_ = [("status", ctypes.c_int), ("signal", ctypes.c_int), ("access", ctypes.c_int),
                ("where", ctypes.c_int), ("fault_address", ctypes.c_uint64), ("has_thread", ctypes.c_int),
                ("block", ctypes.c_uint * 3), ("thread", ctypes.c_uint * 3), ("message", ctypes.c_char * 2048)]


# runtime.cpp's enums
_OK, _FAULT, _DEADLOCK, _WARP_MISUSE, _TRAP, _SHARED_OVERRUN, _RESOURCES, _TIMEOUT = range(8)
_ELSEWHERE, _DYNAMIC_SHARED, _STACK = range(3)
_POINTER, _SIGNED, _UNSIGNED, _FLOATING, _BOOL, _OTHER = range(6)
_PARAM_KIND_NAMES = {_POINTER: "pointer", _SIGNED: "signed integer", _UNSIGNED: "unsigned integer",
                     _FLOATING: "floating-point", _BOOL: "bool", _OTHER: "class-type"}


def _load(path: str):
    with _build_lock:
        if path not in _memo:
            lib = ctypes.CDLL(path)
            lib.emu_launch.restype = ctypes.c_int
            lib.emu_launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(_LaunchConfig),
                                       ctypes.POINTER(_LaunchReport)]
            lib.emu_map_guarded.restype = ctypes.c_uint64
            lib.emu_map_guarded.argtypes = [ctypes.c_uint64, ctypes.c_int, ctypes.POINTER(ctypes.c_uint64),
                                            ctypes.POINTER(ctypes.c_uint64)]
            lib.emu_unmap.restype = None
            lib.emu_unmap.argtypes = [ctypes.c_uint64, ctypes.c_uint64]
            lib.emu_page_size.restype = ctypes.c_uint64
            lib.emu_counters.restype = None
            lib.emu_counters.argtypes = [ctypes.POINTER(_Counters)]
            lib.emu_release_stacks.restype = None
            lib.emu_release_stacks.argtypes = []
            _memo[path] = lib
        return _memo[path]


# ----------------------------------------------------------------------------
# arguments


def _byte_span(a: np.ndarray) -> tuple:
    """(lo, hi, first): the bytes [lo, hi) the view can touch, and its first element's address."""
    first = a.__array_interface__["data"][0]
    if a.size == 0:
        return first, first, first
    lo = hi = first
    for n, stride in zip(a.shape, a.strides):
        if stride < 0:
            lo += (n - 1) * stride
        else:
            hi += (n - 1) * stride
    return lo, hi + a.itemsize, first


def _describe_array(a: np.ndarray) -> str:
    return f"{a.dtype} array of shape {a.shape}"


class _Region:
    """One guarded copy of the bytes a group of overlapping array arguments covers.

    Arguments whose spans overlap share one region, so aliasing (the same array
    passed twice, or in-place kernels) behaves as on a GPU.
    """

    def __init__(self, lib, members, at_end: bool):
        self.lib = lib
        self.members = members  # [(argument index, array, lo, hi, first)]
        self.lo = min(m[2] for m in members)
        self.hi = max(m[3] for m in members)
        self.bytes = self.hi - self.lo
        mapping, mapping_bytes = ctypes.c_uint64(), ctypes.c_uint64()
        # Flush against the guard page, so one element past the end faults. The copy keeps the
        # host address's alignment whenever the span ends on an aligned address (a contiguous
        # float16 array with head_dim % 8 == 0 does); otherwise cp.async/ldmatrix report a
        # misaligned row rather than run on an alignment the GPU would not see.
        self.data = lib.emu_map_guarded(self.bytes, int(at_end), ctypes.byref(mapping), ctypes.byref(mapping_bytes))
        if not self.data:
            raise MemoryError(f"could not map a guarded buffer of {self.bytes} bytes")
        self.mapping, self.mapping_bytes = mapping.value, mapping_bytes.value
        self.page = lib.emu_page_size()
        if self.bytes:
            ctypes.memmove(self.data, self.lo, self.bytes)

    def pointer(self, first: int) -> int:
        return self.data + (first - self.lo)

    def guard_side(self, address: int):
        """'before' or 'after' if `address` lies in one of this region's guard pages, else None."""
        if self.mapping <= address < self.mapping + self.page:
            return "before"
        end = self.mapping + self.mapping_bytes
        if end - self.page <= address < end:
            return "after"
        return None

    def _view(self, address: int, n: int) -> np.ndarray:
        return np.ctypeslib.as_array((ctypes.c_ubyte * n).from_address(address)) if n else np.empty(0, np.uint8)

    def slack_written(self) -> str | None:
        """'before'/'after' if the kernel wrote into the unguarded slack beside the data."""
        data_lo = self.mapping + self.page
        data_hi = self.mapping + self.mapping_bytes - self.page
        if (self._view(data_lo, self.data - data_lo) != 0xFF).any():
            return "before"
        if (self._view(self.data + self.bytes, data_hi - self.data - self.bytes) != 0xFF).any():
            return "after"
        return None

    def copy_back(self, kernel: str) -> None:
        new = self._view(self.data, self.bytes)
        old = self._view(self.lo, self.bytes)
        changed = new != old
        if not changed.any():
            return
        for index, array, lo, hi, _ in self.members:
            if not array.flags.writeable and changed[lo - self.lo:hi - self.lo].any():
                raise LaunchError(f"kernel {kernel!r} wrote into argument {index}, a read-only "
                                  f"{_describe_array(array)}")
        ctypes.memmove(self.lo, self.data, self.bytes)

    def release(self) -> None:
        self.lib.emu_unmap(self.mapping, self.mapping_bytes)


def _scalar(value):
    """A NumPy scalar for a by-value argument; Python numbers convert as CuPy converts them."""
    if isinstance(value, (bool, np.bool_)):
        return np.bool_(value)
    if isinstance(value, np.generic):
        return value
    if isinstance(value, int):
        return np.int64(value)
    if isinstance(value, float):
        return np.float64(value)
    return None


_SCALAR_KINDS = {_SIGNED: "iu", _UNSIGNED: "iu", _FLOATING: "f", _BOOL: "b"}


# ----------------------------------------------------------------------------
# the public classes

_launch_lock = threading.Lock()  # the runtime is single-threaded: one launch at a time
_stacks_held = [None]  # the library whose fiber stacks are mapped (runtime.cpp's emu_release_stacks)


def _launch(lib, entry, argv, config, report) -> int:
    with _launch_lock:
        held = _stacks_held[0]
        if held is not None and held is not lib:
            held.emu_release_stacks()
        _stacks_held[0] = lib
        return lib.emu_launch(entry, argv, ctypes.byref(config), ctypes.byref(report))


def _dim3(value, what: str) -> tuple:
    dims = (value,) if isinstance(value, (int, np.integer)) else tuple(value)
    if not 1 <= len(dims) <= 3 or not all(isinstance(d, (int, np.integer)) for d in dims):
        raise LaunchError(f"{what} must be an int or a tuple of 1 to 3 ints, got {value!r}")
    return tuple(int(d) for d in dims) + (1,) * (3 - len(dims))


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

    def _marshal(self, args, at_end: bool):
        """Guarded regions, and per argument the ctypes object whose address goes into argv."""
        prefix = f"kernel {self.name!r}:"
        arrays, storage = [], [None] * len(args)
        for i, (arg, (kind, size, pointee)) in enumerate(zip(args, self.params)):
            if kind == _POINTER:
                if arg is None:
                    storage[i] = ctypes.c_uint64(0)
                    continue
                if not isinstance(arg, np.ndarray):
                    raise LaunchError(f"{prefix} argument {i} is a pointer parameter; pass a numpy.ndarray, "
                                      f"got {type(arg).__name__}")
                if pointee not in (0, 1, arg.itemsize):
                    raise LaunchError(f"{prefix} argument {i} points to {pointee}-byte elements, got a "
                                      f"{_describe_array(arg)} ({arg.itemsize}-byte elements)")
                arrays.append((i, arg, *_byte_span(arg)))
                continue
            value = _scalar(arg)
            if value is None:
                raise LaunchError(f"{prefix} argument {i} is a {size}-byte {_PARAM_KIND_NAMES[kind]} parameter; "
                                  f"pass a NumPy scalar, got {type(arg).__name__}")
            if value.dtype.itemsize != size or (kind in _SCALAR_KINDS and value.dtype.kind not in _SCALAR_KINDS[kind]):
                raise LaunchError(f"{prefix} argument {i} is a {size}-byte {_PARAM_KIND_NAMES[kind]} parameter, "
                                  f"got {value.dtype} ({value.dtype.itemsize} bytes)")
            storage[i] = ctypes.create_string_buffer(value.tobytes(), size)

        # group arrays whose byte spans overlap into one region each
        groups = []
        for member in sorted(arrays, key=lambda m: m[2]):
            if groups and member[2] < max(m[3] for m in groups[-1]) and member[3] > member[2]:
                groups[-1].append(member)
            else:
                groups.append([member])
        regions = []
        try:
            for members in groups:
                region = _Region(self._lib, members, at_end)
                regions.append(region)
                for index, _, _, _, first in members:
                    storage[index] = ctypes.c_uint64(region.pointer(first))
        except BaseException:
            for region in regions:
                region.release()
            raise
        return regions, storage

    def __call__(self, grid, block, args, *, shared_mem=0, stream=None, enable_cooperative_groups=False):
        if enable_cooperative_groups:
            raise NotImplementedError("the emulator does not implement cooperative launches")
        grid, block = _dim3(grid, "grid"), _dim3(block, "block")
        args = tuple(args)
        shared_mem = int(shared_mem)
        self._check_launch(grid, block, args, shared_mem)
        module = self._module
        regions, storage = self._marshal(args, module.oob_guard == "end")
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
                    barriers=raw.barriers, mma=raw.mma, ctas=raw.ctas, warps=raw.warps)
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
                pointer = storage[index].value
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
