"""hopper.cuh's inline PTX is accepted for sm_90a by every NVRTC installed (CuPy's, and each CUDA
major's wheels), and compiles to the SASS instructions it names; plain sm_90 rejects setmaxnreg and
wgmma.

Needs no GPU (flashcupy/tools/nvrtc.py finds and runs each NVRTC). The kernels are the emulator's
test kernels, tests/emulator_kernels/hopper.cu and wgmma.cu, so the code the emulator runs is the
code ptxas accepts.
"""

from __future__ import annotations

import os
import re

import pytest

from flashcupy.backends.cupy_backend import sources
from flashcupy.tools import nvrtc

HERE = os.path.dirname(os.path.abspath(__file__))
TEST_KERNELS = os.path.join(HERE, "emulator_kernels", "hopper.cu")
WGMMA_KERNELS = os.path.join(HERE, "emulator_kernels", "wgmma.cu")
WGMMA_NAMES = tuple(f"wgmma_gemm<{t}, {n}>" for t in ("__half", "__nv_bfloat16") for n in (64, 128))

# SASS of each wrapper (mbarrier: SYNCS.*; the empty-barrier arrive, the expect_tx and the
# complete_tx are flavours of SYNCS.ARRIVE.TRANS64; setmaxnreg only with a register cap at entry)
SASS = {
    "mbarrier_init": "SYNCS.EXCH.64",
    "mbarrier_arrive / expect_tx / complete_tx": "SYNCS.ARRIVE.TRANS64",
    "mbarrier_try_wait_parity": "SYNCS.PHASECHK.TRANS64.TRYWAIT",
    "named_barrier_sync": "BAR.SYNC",
    "named_barrier_arrive": "BAR.ARV",
    "elect_one_sync": "ELECT",
    "setmaxnreg_dec": "USETMAXREG.DEALLOC",
    "setmaxnreg_inc": "USETMAXREG.TRY",
}


# SASS of the wgmma wrappers (f16 inputs print no type suffix; the N of each instantiation is in the
# name). A warning (ptxas C7510-C7515: the wgmma pipeline serialised) fails the test as any other.
WGMMA_SASS = {
    "wgmma_ss / wgmma_rs f16, N = 64": "HGMMA.64x64x16.F32 ",
    "wgmma_ss / wgmma_rs bf16, N = 64": "HGMMA.64x64x16.F32.BF16",
    "wgmma_ss / wgmma_rs f16, N = 128": "HGMMA.64x128x16.F32 ",
    "wgmma_ss / wgmma_rs bf16, N = 128": "HGMMA.64x128x16.F32.BF16",
    "wgmma_fence": "WARPGROUP.ARRIVE",
    "wgmma_wait_group": "WARPGROUP.DEPBAR.LE",
    "fence_proxy_async": "FENCE.VIEW.ASYNC.S",
}


def toolkits():
    try:
        return nvrtc.toolkits()
    except nvrtc.NvrtcError as e:
        pytest.skip(f"no NVRTC: {e}")


def compile_for(arch, toolkit, path=TEST_KERNELS, names=()):
    with open(path) as f:
        source = f.read()
    return nvrtc.compile_cubin(source, names, nvrtc.compile_options(arch, toolkit) + (f"-I{sources.KERNEL_DIR}",),
                               toolkit)


def test_hopper_instructions_compile_for_sm_90a():
    for toolkit in toolkits():
        log, _, cubin = compile_for("sm_90a", toolkit)
        warnings = [line for line in log.splitlines() if "warning" in line.lower()]
        assert not warnings, f"NVRTC {toolkit.version}: {warnings}"
        if nvrtc.nvdisasm_path() is None:
            continue
        sass = nvrtc.sass(cubin)
        missing = {wrapper: op for wrapper, op in SASS.items() if not re.search(rf"\b{re.escape(op)}", sass)}
        assert not missing, f"NVRTC {toolkit.version}: no SASS for {missing}"


def test_plain_sm_90_rejects_setmaxnreg():
    for toolkit in toolkits():
        with pytest.raises(nvrtc.NvrtcError, match="setmaxnreg.* not supported on .target 'sm_90'"):
            compile_for("sm_90", toolkit)


def test_wgmma_compiles_for_sm_90a():
    for toolkit in toolkits():
        log, lowered, cubin = compile_for("sm_90a", toolkit, WGMMA_KERNELS, WGMMA_NAMES)
        warnings = [line for line in log.splitlines() if "warning" in line.lower()]
        assert not warnings, f"NVRTC {toolkit.version}: {warnings}"
        assert set(lowered) == set(WGMMA_NAMES)
        if nvrtc.nvdisasm_path() is None:
            continue
        sass = nvrtc.sass(cubin)
        missing = {wrapper: op for wrapper, op in WGMMA_SASS.items() if op not in sass}
        assert not missing, f"NVRTC {toolkit.version}: no SASS for {missing}"


def test_plain_sm_90_rejects_wgmma():
    for toolkit in toolkits():
        with pytest.raises(nvrtc.NvrtcError, match="wgmma.* not supported on .target 'sm_90'"):
            compile_for("sm_90", toolkit, WGMMA_KERNELS, WGMMA_NAMES[:1])
