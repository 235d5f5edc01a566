"""Modules that CuPy cannot compile: NVRTC through cuda-bindings to a cubin for the architecture the
options name (sm_90a: cupy.RawModule(code=) appends its own -arch=sm_XY, which cannot), loaded
through CuPy (cupy.RawModule(path=)), so CuPy stays the array library and the stream.

The cupy Runtime's compile_module sends here every module whose options name an -arch
(sources.arch_options); the CPU emulator compiles the same source and options itself. Not yet run on
a GPU: **[verify]** on the first one (benchmarks/gpu_session.sh).
"""

from __future__ import annotations

import hashlib
import os
import tempfile


class CompileError(RuntimeError):
    pass


def _check(result, what: str):
    from cuda.bindings import nvrtc

    err, *value = result
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CompileError(f"{what} failed: {err}")
    return value[0] if len(value) == 1 else value


def cuda_headers() -> str | None:
    """The directory of the CUDA runtime headers (cuda_fp16.h) that cuda-pathfinder finds, as CuPy does,
    or None."""
    try:
        from cuda.pathfinder import find_nvidia_header_directory
    except ImportError:
        return None
    return find_nvidia_header_directory("cudart")


def compile_cubin(source: str, name_expressions, options) -> tuple:
    """(cubin bytes, {name expression: lowered name}) of `source` by the NVRTC that cuda-pathfinder
    finds, with the CUDA headers' directory added to `options`."""
    from cuda.bindings import nvrtc

    include = cuda_headers()
    opts = [o.encode() for o in (*options, *((f"-I{include}",) if include else ()))]
    prog = _check(nvrtc.nvrtcCreateProgram(source.encode(), b"flashcupy.cu", 0, [], []), "nvrtcCreateProgram")
    try:
        for name in name_expressions:
            _check(nvrtc.nvrtcAddNameExpression(prog, name.encode()), "nvrtcAddNameExpression")
        (status,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            log = b" " * _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
            _check(nvrtc.nvrtcGetProgramLog(prog, log), "nvrtcGetProgramLog")
            raise CompileError(f"NVRTC failed:\n{log.rstrip(b' ').decode(errors='replace')}")
        lowered = {name: _check(nvrtc.nvrtcGetLoweredName(prog, name.encode()), "nvrtcGetLoweredName").decode()
                   for name in name_expressions}
        cubin = b" " * _check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        _check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return cubin, lowered
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _cache_path(source: str, name_expressions, options) -> str:
    key = hashlib.sha256(repr((source, tuple(name_expressions), tuple(options))).encode()).hexdigest()[:32]
    folder = os.environ.get("FLASHCUPY_CUBIN_CACHE") or os.path.join(
        tempfile.gettempdir(), f"flashcupy-cubin-{os.getuid() if hasattr(os, 'getuid') else 'user'}")
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, f"{key}.cubin")


class CubinModule:
    """A compiled module whose kernels are got by name expression, like cupy.RawModule's."""

    def __init__(self, cupy, source: str, name_expressions, options):
        path = _cache_path(source, name_expressions, options)
        cubin, self.lowered = compile_cubin(source, name_expressions, options)
        with open(path + ".part", "wb") as f:  # written whole, then renamed: other processes share it
            f.write(cubin)
        os.replace(path + ".part", path)
        self.module = cupy.RawModule(path=path)

    def get_function(self, name: str):
        return self.module.get_function(self.lowered[name])
