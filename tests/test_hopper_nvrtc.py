"""hopper.cuh's inline PTX is accepted for sm_90a by every NVRTC installed (CuPy's, and each CUDA
major's wheels), and compiles to the SASS instructions it names; plain sm_90 rejects setmaxnreg.

Needs no GPU (flashcupy/tools/nvrtc.py finds and runs each NVRTC). The kernels are the emulator's
test kernels, tests/emulator_kernels/hopper.cu, so the code the emulator runs is the code ptxas
accepts.
"""

from __future__ import annotations

import os
import re

import pytest

from flashcupy.backends.cupy_backend import sources
from flashcupy.tools import nvrtc

HERE = os.path.dirname(os.path.abspath(__file__))
TEST_KERNELS = os.path.join(HERE, "emulator_kernels", "hopper.cu")

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


def toolkits():
    try:
        return nvrtc.toolkits()
    except nvrtc.NvrtcError as e:
        pytest.skip(f"no NVRTC: {e}")


def compile_for(arch, toolkit):
    with open(TEST_KERNELS) as f:
        source = f.read()
    return nvrtc.compile_cubin(source, (), nvrtc.compile_options(arch, toolkit) + (f"-I{sources.KERNEL_DIR}",),
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
