"""Compile every CUDA kernel specialization with NVRTC and report what ptxas says about it.

Used by `python -m flashcupy kernels --arch sm_90` and by tests/test_nvrtc.py. Needs only
libnvrtc (the `nvidia-cuda-nvrtc-cu12` wheel, or a CUDA toolkit) and, for cuda_fp16.h, the
`nvidia-cuda-runtime-cu12` wheel's headers; no GPU, no CuPy. NVRTC is called through ctypes.

For each kernel: registers per thread, spill bytes (stores + loads), static and dynamic shared
memory per CTA, threads per CTA, the theoretical occupancy (resident warps / maximum warps per
SM) on that architecture, and for the tensor-core kernels the count of HMMA.16816.F32
instructions in their SASS (read by nvdisasm from the `nvidia-cuda-nvdisasm` wheel).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor

from .backends.cupy_backend import specs

# Per-SM limits used for occupancy: max threads, max CTAs, registers, shared memory (bytes) and
# the shared memory the driver reserves per CTA. sm_80: A100; sm_86/89: consumer Ampere/Ada.
SM_LIMITS = {
    "sm_80": dict(threads=2048, ctas=32, registers=65536, smem=167936, smem_reserved=1024),
    "sm_86": dict(threads=1536, ctas=16, registers=65536, smem=102400, smem_reserved=1024),
    "sm_89": dict(threads=1536, ctas=24, registers=65536, smem=102400, smem_reserved=1024),
    "sm_90": dict(threads=2048, ctas=32, registers=65536, smem=233472, smem_reserved=1024),
}
REGISTER_GRANULE = 256  # registers are allocated per warp in multiples of this


class NvrtcError(RuntimeError):
    pass


def _find_libnvrtc() -> str:
    candidates = []
    try:
        from nvidia import cuda_nvrtc  # namespace package of the nvidia-cuda-nvrtc-cu12 wheel
        for root in cuda_nvrtc.__path__:
            candidates += sorted(glob.glob(os.path.join(root, "lib", "libnvrtc.so*")))
            candidates += sorted(glob.glob(os.path.join(root, "bin", "nvrtc64_*.dll")))
    except ImportError:
        pass
    found = ctypes.util.find_library("nvrtc")
    if found:
        candidates.append(found)
    for path in candidates:
        if "builtins" not in os.path.basename(path) and "alt" not in os.path.basename(path):
            return path
    raise NvrtcError("libnvrtc not found: pip install nvidia-cuda-nvrtc-cu12 (or install a CUDA toolkit)")


_lib = None


def _nvrtc():
    global _lib
    if _lib is None:
        lib = ctypes.CDLL(_find_libnvrtc())
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        _lib = lib
    return _lib


def _check(status: int, what: str) -> None:
    if status != 0:
        raise NvrtcError(f"{what}: {_nvrtc().nvrtcGetErrorString(status).decode()}")


def nvrtc_version() -> str:
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(_nvrtc().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return f"{major.value}.{minor.value}"


def compile_cubin(source: str, name_expressions, options) -> tuple:
    """Compile with NVRTC; returns (log, {name expression: lowered (mangled) name}, cubin bytes)."""
    lib = _nvrtc()
    prog = ctypes.c_void_p()
    _check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"flashcupy.cu", 0, None, None),
           "nvrtcCreateProgram")
    try:
        for name in name_expressions:
            _check(lib.nvrtcAddNameExpression(prog, name.encode()), "nvrtcAddNameExpression")
        opts = [o.encode() for o in options]
        status = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        _check(lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)), "nvrtcGetProgramLogSize")
        log = ctypes.create_string_buffer(size.value)
        _check(lib.nvrtcGetProgramLog(prog, log), "nvrtcGetProgramLog")
        log = log.value.decode(errors="replace")
        if status != 0:
            raise NvrtcError(f"compilation failed:\n{log}")
        lowered = {}
        for name in name_expressions:
            out = ctypes.c_char_p()
            _check(lib.nvrtcGetLoweredName(prog, name.encode(), ctypes.byref(out)), "nvrtcGetLoweredName")
            lowered[name] = out.value.decode()
        _check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
        cubin = ctypes.create_string_buffer(size.value)
        _check(lib.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return log, lowered, cubin.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def nvdisasm_path() -> str | None:
    """nvdisasm from the nvidia-cuda-nvdisasm wheel (or a CUDA toolkit on PATH), else None."""
    try:
        from nvidia import cu13  # namespace package of the nvidia-cuda-nvdisasm wheel
        for root in cu13.__path__:
            for path in glob.glob(os.path.join(root, "bin", "nvdisasm")):
                return path
    except ImportError:
        pass
    return shutil.which("nvdisasm")


def sass(cubin: bytes) -> str:
    """The SASS text of a cubin, by nvdisasm."""
    tool = nvdisasm_path()
    if tool is None:
        raise NvrtcError("nvdisasm not found: pip install nvidia-cuda-nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-c", f.name], capture_output=True, text=True, check=True).stdout


def function_sass(text: str, mangled: str) -> str | None:
    """The SASS of one function in nvdisasm's output, or None."""
    m = re.search(rf"\.text\.{re.escape(mangled)}:(.*?)(?=\n\s*\.section|\Z)", text, re.S)
    return m.group(1) if m else None


_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USAGE = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas(log: str) -> dict:
    """{mangled name: {registers, spill_stores, spill_loads, stack, static_smem}} from `ptxas -v`."""
    info, current = {}, None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            current = info.setdefault(m.group(1), dict(registers=0, spill_stores=0, spill_loads=0,
                                                        stack=0, static_smem=0))
        elif current is None:
            continue
        elif m := _SPILLS.search(line):
            current.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        elif m := _USAGE.search(line):
            current["registers"] = int(m.group(1))
            if s := _SMEM.search(line):
                current["static_smem"] = int(s.group(1))
    return info


def occupancy(arch: str, registers: int, smem: int, threads: int) -> float:
    """Resident warps / maximum warps per SM, from registers, shared memory and threads."""
    lim = SM_LIMITS.get(arch, SM_LIMITS["sm_80"])
    warps = -(-threads // 32)
    by_threads = lim["threads"] // (warps * 32)
    regs_per_warp = -(-max(registers, 1) * 32 // REGISTER_GRANULE) * REGISTER_GRANULE
    by_registers = (lim["registers"] // regs_per_warp) // warps
    by_smem = lim["smem"] // (smem + lim["smem_reserved"])
    ctas = min(by_threads, by_registers, by_smem, lim["ctas"])
    return ctas * warps / (lim["threads"] // 32)


def compile_options(arch: str) -> tuple:
    return specs.COMPILE_OPTIONS + specs.cuda_include_options() + (f"-arch={arch}", "-Xptxas=-v")


def _module_rows(arch: str, module: specs.ModuleSpec) -> list:
    log, lowered, cubin = compile_cubin(specs.read_source(module.source_file), module.name_expressions,
                                        compile_options(arch))
    info = parse_ptxas(log)
    text = sass(cubin) if any(k.tensor_cores for k in module.kernels) else ""
    rows = []
    for kernel in module.kernels:
        got = info[lowered[kernel.name_expression]]
        code = function_sass(text, lowered[kernel.name_expression]) if kernel.tensor_cores else None
        rows.append(dict(
            kernel=kernel.template,
            dtype=kernel.dtype,
            head_dim=kernel.head_dim or None,
            tile=f"{kernel.block_m}x{kernel.block_n}" if kernel.head_dim else None,
            registers=got["registers"],
            spill_bytes=got["spill_stores"] + got["spill_loads"],
            static_smem=got["static_smem"],
            dynamic_smem=kernel.dynamic_smem,
            threads=specs.NUM_THREADS,
            occupancy=occupancy(arch, got["registers"], got["static_smem"] + kernel.dynamic_smem,
                                specs.NUM_THREADS),
            hmma=len(re.findall(r"\bHMMA\.16816\.F32", code)) if code is not None else None,
        ))
    return rows


def kernel_report(arch: str = "sm_90", workers: int | None = None) -> list:
    """One row per kernel specialization the cupy backend can launch, compiled for `arch`."""
    if not re.fullmatch(r"sm_\d+a?", arch):
        raise ValueError(f"arch must look like sm_80 or sm_90, got {arch!r}")
    modules = specs.all_modules()
    with ThreadPoolExecutor(max_workers=workers or min(4, os.cpu_count() or 1)) as pool:
        per_module = list(pool.map(lambda m: _module_rows(arch, m), modules))
    # the preprocess kernel does not depend on the head-dim bucket: report it once per dtype
    rows, seen = [], set()
    for row in (r for rs in per_module for r in rs):
        key = (row["kernel"], row["dtype"], row["head_dim"])
        if key not in seen:
            seen.add(key)
            rows.append(row)
    return rows


_COLUMNS = (("kernel", "{}"), ("dtype", "{}"), ("head_dim", "{}"), ("tile", "{}"), ("registers", "{}"),
            ("spill_bytes", "{}"), ("static_smem", "{}"), ("dynamic_smem", "{}"), ("threads", "{}"),
            ("occupancy", "{:.0%}"), ("hmma", "{}"))


def format_kernel_report(rows) -> str:
    """The report as an aligned text table."""
    table = [[name for name, _ in _COLUMNS]]
    for row in rows:
        table.append(["-" if row.get(name) is None else fmt.format(row[name]) for name, fmt in _COLUMNS])
    widths = [max(len(r[i]) for r in table) for i in range(len(_COLUMNS))]
    return "\n".join("  ".join(cell.rjust(w) if i >= 2 else cell.ljust(w)
                               for i, (cell, w) in enumerate(zip(r, widths))).rstrip()
                     for r in table)
