"""The emulator's model of the tensor-core instructions (kernels/tensor_core.cuh), against the PTX ISA.

The emulator implements each PTX instruction of tensor_core.cuh as the PTX ISA defines it
(flashcupy/tools/emulator/include/emu_tensor_core.h). These tests check it against the ISA's fragment
layouts computed in NumPy (tests/tensor_core_blocks.py), independently: mma's A, B and C/D layouts element by element,
every ldmatrix variant, and the whole cp.async -> ldmatrix -> mma pipeline against NumPy's
matmul; that a missing cp.async wait gives a wrong answer, as on a GPU; and that misuse is
reported. The test kernels are tests/emulator_kernels/tensor_core.cu; tests/test_nvrtc.py
compiles them for real GPUs, and tests/test_tensor_core_gpu.py runs these same checks on one.
"""

from __future__ import annotations

import numpy as np
import pytest

import tensor_core_blocks as blocks
from flashcupy.tools.emulator import CP_ASYNC_MODES, EmulatedModule, KernelError
from tensor_core_blocks import INCLUDE, LDMATRIX, NARROW, narrow, source, tile_matmul

ORDERS = ("ascending", "descending")


# ----------------------------------------------------------------------------
# mma.m16n8k16: each operand's layout, element by element


@pytest.mark.parametrize("fmt", NARROW)
def test_mma_c_and_d_layout(fmt):
    blocks.check_mma_c_and_d_layout(fmt)


@pytest.mark.parametrize("fmt", NARROW)
def test_mma_a_layout(fmt, rng):
    blocks.check_mma_a_layout(fmt, rng)


@pytest.mark.parametrize("fmt", NARROW)
def test_mma_b_layout(fmt, rng):
    blocks.check_mma_b_layout(fmt, rng)


@pytest.mark.parametrize("fmt", NARROW)
def test_mma_random(fmt, rng):
    blocks.check_mma_random(fmt, rng)


def test_mma_k8(rng):
    blocks.check_mma_k8(rng)


# ----------------------------------------------------------------------------
# Turing: the float16 kernels built for sm_75 (tensor_core.cuh's stand-ins for sm_80's instructions)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("a_rows", [16, 11])
def test_turing_stand_ins(order, a_rows, rng):
    blocks.check_turing(order, a_rows, rng)


def test_a_turing_build_has_no_sm_80_instruction():
    # as ptxas refuses bfloat16's mma and cvt below sm_80, the emulator's sm_75 build does not define them
    # (cp.async, m16n8k16 and pack_f16x2 have stand-ins there: test_turing_stand_ins)
    for call in ("pack_bf16x2(1.0f, 2.0f)", "mma_m16n8k16_bf16f32(nullptr, nullptr, nullptr, nullptr), 0u",
                 "mma_m16n8k16<__nv_bfloat16>(nullptr, nullptr, nullptr, nullptr), 0u"):
        code = f'#include "tensor_core.cuh"\nextern "C" __global__ void k(unsigned* x) {{ x[0] = ({call}); }}\n'
        with pytest.raises(Exception, match="not declared|undefined symbol"):
            EmulatedModule(code, ["k"], (INCLUDE, "-arch=sm_75")).get_function("k")


# ----------------------------------------------------------------------------
# ldmatrix: every variant against the ISA's thread mapping


@pytest.mark.parametrize("num,trans", LDMATRIX, ids=[f"x{n}{'.trans' if t else ''}" for n, t in LDMATRIX])
def test_ldmatrix(num, trans, rng):
    blocks.check_ldmatrix(num, trans, rng)


# ----------------------------------------------------------------------------
# the whole pipeline: cp.async -> ldmatrix -> mma


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("fmt", NARROW)
@pytest.mark.parametrize("a_rows", [16, 11])
def test_tile_matmul_matches_numpy(fmt, order, a_rows, rng):
    blocks.check_tile_matmul_matches_numpy(fmt, order, a_rows, rng)


@pytest.mark.parametrize("wait_mode", [1, 2], ids=["no-wait", "wait-for-a-only"])
def test_missing_cp_async_wait_gives_a_wrong_answer(wait_mode, rng):
    fmt = "float16"
    A, B = narrow(rng.standard_normal((16, 16)), fmt), narrow(rng.standard_normal((16, 8)), fmt)
    got = tile_matmul(fmt, A, B, wait_mode=wait_mode)
    # B never landed: shared memory still holds the 0xFF bytes every block starts with (NaN)
    assert np.isnan(got).all()


def test_pack_and_exp(rng):
    blocks.check_pack_and_exp(rng)


@pytest.mark.parametrize("mode,message,thread", [
    (0, r"mma\.sync needs all 32 lanes of the warp, but lanes 0x80000000 have exited", None),
    (1, r"ldmatrix row address: address .* is not aligned", None),
    (2, r"cp\.async destination: address .* is not in shared memory", None),
    (3, r"exited with 1 cp\.async copy not waited for \(0 not even committed\)", (0, 0, 0)),
    (4, r"exited with 1 cp\.async copy not waited for \(1 not even committed\)", (0, 0, 0)),
])
@pytest.mark.parametrize("cp_async", CP_ASYNC_MODES)
def test_misuse_is_reported(mode, message, thread, cp_async):
    module = EmulatedModule(source(), ["tensor_core_misuse"], (INCLUDE,), cp_async=cp_async)
    with pytest.raises(KernelError, match=message) as caught:
        module.get_function("tensor_core_misuse")((1,), (32,), (np.int32(mode), np.zeros(32, np.uint32)))
    if thread is not None:
        assert caught.value.thread == thread
