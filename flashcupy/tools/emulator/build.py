"""Build and cache: NVRTC-style options, the g++ command lines, the compiled runtime and modules.

Room: building. A module's source, name expressions, options and the emulator's own sources
(include/, runtime.cpp and its parts in runtime/) key a shared library in cache_dir(); _build
returns its path, compiling it only when it is not there. abi.py loads it, driver.py launches it.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile

from .errors import CompileError

HERE = os.path.dirname(os.path.abspath(__file__))
INCLUDE = os.path.join(HERE, "include")
RUNTIME = os.path.join(HERE, "runtime.cpp")
RUNTIME_PARTS = os.path.join(HERE, "runtime")  # runtime.cpp's parts, which it #includes (a unity build)

ARCH_DEFAULT = 900                 # __CUDA_ARCH__ unless an -arch option says otherwise

CXX = os.environ.get("CXX", "g++")
# -O1: it compiles no slower than -O0 (headers and linking dominate) and ran the barrier-heavy
# test kernels fastest of -O0/-O1/-O2 (benchmarks/results/emulator_optimisation.md).
CXXFLAGS = (
    "-std=c++20", "-O1", "-fPIC",
    "-fno-strict-aliasing",            # kernels reinterpret shared memory freely, as CUDA allows
    "-ftrivial-auto-var-init=pattern",  # uninitialised locals hold garbage, like registers
    "-fstack-clash-protection",        # a huge local array hits the stack's guard page
    "-U_FORTIFY_SOURCE",               # siglongjmp between fiber stacks is intended
    # a template kernel's static __shared__ objects are function-local statics, which g++ otherwise makes
    # STB_GNU_UNIQUE: the dynamic linker then binds every module that instantiates the same kernel (a
    # test's mutant beside the original) to the first one loaded's objects, outside the later one's
    # shared memory
    "-fno-gnu-unique",
)
# The runtime, compiled once per toolchain: -O2, which inlines its small helpers (the wgmma operand
# reads, the async proxy's checks) where -O1 called them for every element
RUNTIME_CXXFLAGS = tuple("-O2" if flag == "-O1" else flag for flag in CXXFLAGS)
# A counting build (EmulatedModule(counters=True)): g++ calls the runtime before every load and
# store the kernel makes (-fsanitize=kernel-address's callbacks, no shadow memory, no stack or
# global instrumentation), so runtime.cpp can cost the warp's shared and global memory requests.
# An ordinary build has none of it: counting costs nothing when it is off.
COUNTING_CXXFLAGS = (
    "-fsanitize=kernel-address", "--param", "asan-instrumentation-with-call-threshold=0",
    "--param", "asan-stack=0", "--param", "asan-globals=0", "-fno-sanitize-address-use-after-scope",
    "-DEMU_COUNTERS=1",
)
# A module whose source includes hopper.cuh (wgmma, TMA): g++ calls the runtime before every
# store the kernel makes, so runtime/proxy.h can tell which thread's ordinary shared-memory writes
# are fenced (fence.proxy.async) when wgmma or a TMA store reads them. Stores only: loads are not
# instrumented. Every other module is built without it and pays nothing.
PROXY_CXXFLAGS = (
    "-fsanitize=kernel-address", "--param", "asan-instrumentation-with-call-threshold=0",
    "--param", "asan-stack=0", "--param", "asan-globals=0", "-fno-sanitize-address-use-after-scope",
    "--param", "asan-instrument-reads=0",
)
_INCLUDE = re.compile(r'#\s*include\s*[<"]([^<>"]+)[>"]')


def _includes_hopper(source: str, include_dirs, seen=None) -> bool:
    """Whether `source` includes hopper.cuh, itself or through headers found in include_dirs."""
    seen = set() if seen is None else seen
    for name in _INCLUDE.findall(source):
        if os.path.basename(name) in ("hopper.cuh", "emu_hopper.h"):  # the header, or its text inlined
            return True
        for d in include_dirs:
            path = os.path.join(d, name)
            if path in seen or not os.path.isfile(path):
                continue
            seen.add(path)
            with open(path, errors="replace") as f:
                if _includes_hopper(f.read(), include_dirs, seen):
                    return True
    return False


def _instrumentation(source: str, include_dirs, counters: bool) -> tuple:
    """The extra g++ flags of a module: counting's, the async proxy's, both, or none."""
    proxy = _includes_hopper(source, include_dirs)
    if counters:
        return (*COUNTING_CXXFLAGS, *(("-DEMU_PROXY=1",) if proxy else ()))
    return (*PROXY_CXXFLAGS, "-DEMU_PROXY=1") if proxy else ()

# ----------------------------------------------------------------------------
# cache

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


def _toolchain() -> tuple:
    """The compiler's identity and the emulator's own sources: any change rebuilds everything."""
    if "toolchain" not in _memo:
        version = subprocess.run([CXX, "--version"], capture_output=True, text=True, check=True).stdout
        sources = []
        files = [os.path.join(INCLUDE, n) for n in sorted(os.listdir(INCLUDE))] + [RUNTIME]
        files += [os.path.join(RUNTIME_PARTS, n) for n in sorted(os.listdir(RUNTIME_PARTS))]
        for path in files:
            with open(path, "rb") as f:
                sources.append((os.path.relpath(path, HERE), f.read()))
        _memo["toolchain"] = (shutil.which(CXX), version, CXXFLAGS, RUNTIME_CXXFLAGS, tuple(sources))
    return _memo["toolchain"]


def _compile(command: list, what: str) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise CompileError(f"g++ failed to compile {what}:\n{result.stderr[-8000:]}")


def _runtime_object(ucontext: bool) -> str:
    path = os.path.join(cache_dir(), f"runtime-{_digest(_toolchain(), ucontext)}.o")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.tmp"
        _compile([CXX, *RUNTIME_CXXFLAGS, "-fvisibility=hidden", *(["-DEMU_USE_UCONTEXT"] if ucontext else []),
                  "-I", INCLUDE, "-c", RUNTIME, "-o", tmp], "the emulator runtime")
        os.replace(tmp, path)
    return path


def _precompiled_header(flags: list) -> str:
    """The cuda_emu.h to force-include for a module compiled with `flags`: a link to it beside its
    precompiled header (cuda_emu.h.gch, built once per set of flags and toolchain). The header and the
    standard headers it includes were some 26,000 lines, 0.21 s of a module's 0.25 s in g++'s front end;
    with the PCH a module builds some 30 % faster (benchmarks/results/emulator_optimisation.md).
    -Werror=invalid-pch in the module's command makes a PCH that g++ finds but may not use an error."""
    folder = os.path.join(cache_dir(), f"pch-{_digest(_toolchain(), flags)}")
    header = os.path.join(folder, "cuda_emu.h")
    if not os.path.exists(header + ".gch"):
        os.makedirs(folder, exist_ok=True)
        if not os.path.lexists(header):  # a link, not a copy: #pragma once sees the same file
            tmp = f"{header}.{os.getpid()}.tmp"
            os.symlink(os.path.join(INCLUDE, "cuda_emu.h"), tmp)
            os.replace(tmp, header)
        tmp = f"{header}.gch.{os.getpid()}.tmp"
        _compile([CXX, *flags, "-x", "c++-header", header, "-o", tmp], "cuda_emu.h's precompiled header")
        os.replace(tmp, header + ".gch")
    return header


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
    extra = _instrumentation(source, include_dirs, counters)
    key = _digest(_toolchain(), source, names, defines, include_dirs, arch, ucontext,
                  _include_dir_contents(include_dirs), *((extra,) if extra else ()))
    stem = os.path.join(cache_dir(), f"module-{key}")
    if os.path.exists(stem + ".so"):
        return stem + ".so"
    runtime = _runtime_object(ucontext)
    _write_atomically(stem + ".cu", _rewrite_dynamic_shared(source))
    lines = [f'#include "{stem}.cu"', '#include "emu_trampoline.h"']
    if "-DEMU_PROXY=1" in extra:  # runtime/proxy.h records stores only in modules that define it
        lines.append('extern "C" __attribute__((visibility("hidden"))) const int emu_proxy_tracking = 1;')
    for i, name in enumerate(names):
        lines += [f'#line 1 "<name expression {i}: {name}>"',
                  f"EMU_EXPORT void emu_entry_{i}(void** argv) {{ emu::invoke(&{name}, argv); }}",
                  f"EMU_EXPORT int emu_params_{i}(emu::ParamInfo* out, int capacity) "
                  f"{{ return emu::describe(&{name}, out, capacity); }}"]
    _write_atomically(stem + ".cpp", "\n".join(lines) + "\n")
    flags = [*CXXFLAGS, *extra, "-I", INCLUDE, "-D__CUDACC__", "-D__CUDACC_RTC__", f"-D__CUDA_ARCH__={arch}",
             *(f"-D{d}" for d in defines), *(f"-I{d}" for d in include_dirs)]
    command = [CXX, *flags, "-shared", "-include", _precompiled_header(flags), "-Werror=invalid-pch",
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
