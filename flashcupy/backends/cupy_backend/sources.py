"""The kernel sources as NVRTC compiles them, and the options it compiles them with.

Shared by the backend (which hands them to cupy.RawModule), the NVRTC report (flashcupy/tools/nvrtc.py)
and the CPU emulator (flashcupy/tools/emulator/cupy.py), so all three compile the same text with the
same options. Needs nothing but the standard library.
"""

from __future__ import annotations

import os
import re

KERNEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels")

_INCLUDE = re.compile(r'^#include "([^"]+)"[^\n]*$', re.MULTILINE)


def read_source(source_file: str, _seen=None) -> str:
    """The text of a kernel file with its local `#include "..."` lines inlined, each header once
    (where it is first included: the inlined text keeps no file boundaries for #pragma once).

    Inlining (rather than passing -I) makes the source text the whole input of a compilation,
    so a compile cache keyed on the text can never pick up a stale header.
    """
    seen = set() if _seen is None else _seen
    seen.add(source_file)
    with open(os.path.join(KERNEL_DIR, source_file), encoding="utf-8") as f:
        text = f.read()

    def inline(m):
        name = m.group(1)
        return "" if name in seen else read_source(name, seen)

    return _INCLUDE.sub(inline, text)


# The backend's NVRTC options; cupy.RawModule adds CuPy's own (below) before NVRTC sees them.
COMPILE_OPTIONS = ("-std=c++17",)

# What CuPy (>= 14.1) adds to COMPILE_OPTIONS for every RawModule, beyond -arch and -I, in
# cupy/cuda/compiler.py: `_compile_with_cache_cuda` appends -ftz=true and
# `_compile_using_nvrtc_no_warning` --device-as-default-execution-space (with -arch=sm_XY for the
# device). `assemble_cupy_compiler_options` in cupy/_core/core.pyx adds the -I options: the CUDA
# headers cuda-pathfinder finds (`find_nvidia_header_directory("cudart")`), CuPy's own headers and
# its copy of CCCL, and --std=c++17 only where no -std is given. The NVRTC report
# (flashcupy/tools/nvrtc.py) and the CPU emulator (flashcupy/tools/emulator/cupy.py) compile with these
# too, so what they check is what runs.
CUPY_NVRTC_OPTIONS = ("-ftz=true", "--device-as-default-execution-space")


def arch_options(arch: str) -> tuple:
    """The whole NVRTC option list of a module compiled for `arch` by the backend itself (a module
    that needs sm_90a: cupy.RawModule(code=) appends its own -arch=sm_XY, which cannot name it): ours,
    CuPy's, and -arch; the CUDA headers' -I is added where NVRTC runs (cubin.py)."""
    return COMPILE_OPTIONS + CUPY_NVRTC_OPTIONS + (f"-arch={arch}",)
