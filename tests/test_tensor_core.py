"""The tensor-core kernels (kernels/flash_fwd_tc.cu, kernels/flash_bwd_tc.cu) under the CPU emulator.

Through the cupy backend's own dispatch and launch code (flashcupy/tools/emulator/cupy.py), against the
float64 oracle, in float16 and bfloat16, under thread orders that drift the warps apart and with
cp.async copies landing late or at once. Removing any one of their barriers or cp.async waits
makes a test fail (tests/test_cupy_backend.py); the emulator's model of the instructions they use
is checked in tests/test_emulator_tensor_core.py, their compiled code in tests/test_nvrtc.py.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from conftest import BF16, MASK_CUH_MUTATIONS, MUTATION_BATTERY, TILE_EDGE_CASE, assert_matches_oracle, case_id, make_qkv, mutation_tests
from modifier_checks import large_scores_check
from tensor_core_blocks import NARROW, narrow

import flashcupy
from flashcupy.backends import cupy_backend
from flashcupy.tools.emulator import KernelError
from flashcupy.tools.emulator.cupy import compile_module, emulated, recording

# ----------------------------------------------------------------------------
# the tensor-core forward kernel (kernels/flash_fwd_tc.cu), through the cupy backend's own
# dispatch and launch code under the emulator (flashcupy/tools/emulator/cupy.py)

# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal): lengths not a multiple of
# the 64-row tiles, Sq > Sk (fully masked rows) and Sq < Sk with causal, MQA and GQA (two kv heads
# of two query heads each), head_dims that are not a multiple of 64 (40: the kernels compute 48, on
# the tiles of 64; 96, on those of 128; both in rows of shared memory padded to 64 or 128), five key
# blocks (more than the double buffer holds)
TC_CASES = (
    (1, 17, 17, 1, 1, 64, False),
    (1, 70, 130, 2, 1, 96, True),
    (1, 80, 33, 1, 1, 40, True),
    (2, 33, 70, 1, 1, 128, False),
    (1, 100, 300, 4, 2, 64, True),
)

# (thread order, cp.async mode): the two orders of every emulated test, and warps drifting apart
# with copies landing as soon as they are issued (see flashcupy/tools/emulator/__init__.py)
SCHEDULES = (("ascending", "deferred"), ("descending", "deferred"), ("warp_skew", "eager"))


def tc_inputs(rng, case, fmt):
    """q, k, v as the user passes them: float16 arrays, or bfloat16 bit patterns in uint16."""
    B, Sq, Sk, Hq, Hkv, D, causal = case
    q, k, v = make_qkv(rng, B, Sq, Sk, Hq, Hkv, D, np.float32)
    return tuple(narrow(x, fmt) for x in (q, k, v))


def tc_forward(q, k, v, fmt, causal, schedule, compile=compile_module, scale=None):
    """(out, lse) from backend="cupy", asserting that it took the tensor-core path."""
    dtype = "bfloat16" if fmt == "bfloat16" else None
    order, cp_async = schedule
    with emulated(order, cp_async=cp_async, compile=compile):
        p = flashcupy._checks.problem(q, k, v, causal, None, dtype)
        assert cupy_backend.forward_path(p, q, k, v) == "tensor-core"
        return flashcupy.attention(q, k, v, causal=causal, scale=scale, return_lse=True, backend="cupy",
                                   dtype=dtype)


@pytest.mark.parametrize("schedule", SCHEDULES, ids="-".join)
@pytest.mark.parametrize("fmt", NARROW)
@pytest.mark.parametrize("case", TC_CASES, ids=case_id)
def test_flash_fwd_tc_matches_oracle(case, fmt, schedule, rng):
    q, k, v = tc_inputs(rng, case, fmt)
    causal = case[6]
    out, lse = tc_forward(q, k, v, fmt, causal, schedule)
    assert_matches_oracle((out, lse), q, k, v, causal=causal, dtype=fmt, backend="cupy")


# The wide forward (flash_fwd_tc_wide, head_dim 72-128: query blocks of 256 rows on 8 warps, key blocks of
# 32): two query blocks, GQA; causal with Sq < Sk, so the diagonal crosses the second block's tiles; and
# a window narrower than a query block, whose band leaves whole key blocks out of either block. Every
# thread order of the emulator, and cp.async both ways
@pytest.mark.parametrize("schedule", SCHEDULES + (("shuffled", "eager"),), ids="-".join)
@pytest.mark.parametrize("causal, window", [(True, None), (False, (40, 3))], ids=["causal", "window"])
def test_the_wide_forward_across_query_blocks(causal, window, schedule, rng):
    q, k, v = tc_inputs(rng, (1, 300, 330, 2, 1, 128, causal), "float16")
    launched, (order, cp_async) = [], schedule
    with emulated(order, cp_async=cp_async, compile=recording(launched)):
        out, lse = flashcupy.attention(q, k, v, causal=causal, window=window, return_lse=True, backend="cupy")
    assert launched == [f"flash_fwd_tc_wide<__half, 128, 256, 32, 1, {240 if window else 247}{', 1' if window else ''}>"]
    assert_matches_oracle((out, lse), q, k, v, causal=causal, window=window, backend="cupy")


@pytest.mark.parametrize("case, why", [
    ((1, 20, 20, 1, 1, 100, False), "head_dim not a multiple of 8"),
])
@pytest.mark.parametrize("order", ("ascending", "descending"))
def test_uncovered_shapes_fall_back_to_simt(case, why, order, rng):
    q, k, v = tc_inputs(rng, case, "float16")
    with emulated(order):
        p = flashcupy._checks.problem(q, k, v, False, None, None)
        assert cupy_backend.forward_path(p, q, k, v) == "simt", why
        out = flashcupy.attention(q, k, v, backend="cupy")
    assert_matches_oracle((out,), q, k, v, backend="cupy")


# Head dims 136..256 (specs.TC_HEAD_DIM_BUCKETS' 192 and 256). The forward: one row tile a warp, Q_i read
# from shared memory at every pass (flash_fwd_tc.cu's Q_KEPT 0), 64 x 32 at 192 and 64 x 16 at 256. The
# backward: two CTAs a block (the grid's y, specs.tc_column_parts), each computing S and dP whole and half
# the columns of dK, dV (dQ), head_dim rounded up to 32 (200: 224, whose halves are 112). Head dims between
# the buckets (200, 176, 160: the forward computes 208, 176 and 160, in shared-memory rows of 256 and 192);
# every modifier (the pairs tiles, the deterministic backward: a bias is not added by atomics there; the
# mask up to 192 only); GQA (dK, dV summed over a group), causal with Sq > Sk and Sq < Sk; the deterministic
# backward at 256; a split-KV decode and a packed batch below
WIDE_HEAD_CASES = [  # (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal, modifiers, deterministic,
    #                    forward, dK/dV, dQ)
    (1, 70, 90, 2, 1, 256, True, (), False, "flash_fwd_tc<__half, 256, 64, 16, 1>",
     "flash_bwd_dkdv_tc<__half, 256, 16, 64, 1, 0, true>", "flash_bwd_dq_convert<__half>"),
    (1, 90, 40, 1, 1, 200, True, ("softcap", "alibi", "bias", "window"), False,
     "flash_fwd_tc<__half, 208, 64, 16, 2, 15>", "flash_bwd_dkdv_tc<__half, 224, 16, 64, 1, 15>",
     "flash_bwd_dq_tc<__half, 224, 64, 16, 2, 15>"),
    (1, 50, 70, 2, 1, 176, False, ("mask", "softcap"), False,  # the mask up to 192 (TC_BACKWARD_MASK_BUCKETS)
     "flash_fwd_tc<__half, 176, 64, 16, 2, 18>", "flash_bwd_dkdv_tc<__half, 192, 16, 64, 1, 18>",
     "flash_bwd_dq_tc<__half, 192, 64, 32, 2, 18>"),
    (2, 33, 70, 2, 2, 160, False, ("window",), False, "flash_fwd_tc<__half, 160, 64, 32, 1, 1>",
     "flash_bwd_dkdv_tc<__half, 160, 16, 64, 1, 1, true>", "flash_bwd_dq_convert<__half>"),
    (1, 40, 70, 4, 2, 256, False, ("softcap",), True, "flash_fwd_tc<__half, 256, 64, 16, 1, 2>",
     "flash_bwd_dkdv_tc<__half, 256, 16, 64, 1, 2>", "flash_bwd_dq_tc<__half, 256, 64, 16, 2, 2>"),
]


@pytest.mark.parametrize("order", ("ascending", "warp_skew"))
@pytest.mark.parametrize("case", WIDE_HEAD_CASES,
                         ids=lambda c: f"D{c[5]}-" + ("+".join(c[7]) or "plain") + "-det" * c[8])
def test_head_dims_up_to_256_take_the_tensor_core_kernels(case, order, rng):
    from modifier_checks import named_modifiers
    *shape, causal, modifiers, deterministic = case[:9]
    B, Sq, Sk, Hq = shape[:4]
    q, k, v = make_qkv(rng, *shape, np.float16)
    dout = rng.standard_normal(q.shape).astype(np.float16)
    kw = dict(causal=causal, **named_modifiers(rng, modifiers, B, Sq, Sk, Hq))
    names = []
    with emulated(order, compile=recording(names)):
        p = flashcupy._checks.problem(q, k, v, causal, None, None)
        assert cupy_backend.forward_path(p, q, k, v) == "tensor-core"
        assert cupy_backend.backward_path(p, dout, q, k, v, q, deterministic) == "tensor-core"
        out, lse = flashcupy.attention(q, k, v, return_lse=True, backend="cupy", **kw)
        grads = flashcupy.attention_backward(dout, q, k, v, out, lse, backend="cupy", deterministic=deterministic,
                                             **kw)
    assert [n for n in names if n.split("<")[0] not in ("flash_bwd_preprocess", "flash_bwd_dbias")] == list(case[9:])
    assert_matches_oracle((out, lse, *grads), q, k, v, dout, backend="cupy", **kw)


def test_the_backward_with_the_mask_at_head_dim_256_runs_on_simt(rng):
    """specs.TC_BACKWARD_MASK_BUCKETS: its dK/dV kernel went past the register limit there, and spilled; the
    forward stays on tensor cores, a bias without the mask too, and the gradients are the oracle's."""
    from modifier_checks import named_modifiers
    q, k, v = make_qkv(rng, 1, 20, 30, 2, 1, 256, np.float16)
    dout = rng.standard_normal(q.shape).astype(np.float16)
    for modifiers, path in ((("mask", "softcap"), "simt"), (("bias",), "tensor-core")):
        kw = named_modifiers(rng, modifiers, 1, 20, 30, 2)
        with emulated():
            p = flashcupy._checks.problem(q, k, v, False, None, None, lib="numpy", **kw)
            assert cupy_backend.forward_path(p, q, k, v) == "tensor-core"
            assert cupy_backend.backward_path(p, dout, q, k, v, q) == path
            out, lse = flashcupy.attention(q, k, v, return_lse=True, backend="cupy", **kw)
            grads = flashcupy.attention_backward(dout, q, k, v, out, lse, backend="cupy", **kw)
        assert_matches_oracle((out, lse, *grads), q, k, v, dout, backend="cupy", **kw)


def test_the_backward_above_head_dim_192_needs_the_shared_memory_of_an_sm_80_or_sm_90(rng):
    """Its tiles ask for up to 128.5 KiB (launch.LAUNCH); an sm_86, sm_89 or sm_120 lets a CTA have 99: the
    SIMT kernels take those calls, which end as the oracle's. At 192 (96.5 KiB at most) the tensor cores do."""
    for head_dim, path in ((256, "simt"), (192, "tensor-core")):
        q, k, v = make_qkv(rng, 1, 20, 30, 1, 1, head_dim, np.float16)
        dout = rng.standard_normal(q.shape).astype(np.float16)
        names = []
        with emulated(compute_capability=86, compile=recording(names)):
            p = flashcupy._checks.problem(q, k, v, False, None, None)
            for deterministic in (False, True):
                assert cupy_backend.backward_path(p, dout, q, k, v, q, deterministic) == path
            out, lse = flashcupy.attention(q, k, v, return_lse=True, backend="cupy")
            grads = flashcupy.attention_backward(dout, q, k, v, out, lse, backend="cupy")
        assert ("flash_bwd_dkdv_tc" in " ".join(names)) == (path == "tensor-core")
        assert_matches_oracle((out, lse, *grads), q, k, v, dout, backend="cupy")


def test_a_split_decode_and_a_packed_batch_take_the_tensor_cores_at_head_dim_256(rng):
    from varlen_checks import packed_batch_matches_the_oracle
    q, k, v = make_qkv(rng, 2, 1, 300, 2, 1, 256, np.float16)  # 300 keys: splits of 256 and 44
    names = []
    with emulated(compile=recording(names)):
        got = flashcupy.attention_with_kvcache(q, k, v, num_splits=2, return_lse=True, backend="cupy")
    assert names == ["flash_fwd_tc<__half, 256, 64, 16, 1, 0, true, true>", "flash_split_merge<__half, float>"]
    assert_matches_oracle(got, q, k, v, backend="cupy")
    names = []
    with emulated(compile=recording(names)):
        packed_batch_matches_the_oracle(rng, "cupy", ([20, 70], [30, 9]), np.float16, 256, (2, 1),
                                        dict(causal=True, softcap=3.0, alibi_slopes="per-seq"), backward=True)
    # the backward's CTAs find their sequence's key block and their part of its columns (specs.tc_column_parts)
    assert set(names) == {"flash_fwd_tc<__half, 256, 64, 16, 1, 6, false, true>", "flash_bwd_preprocess<__half, float>",
                          "flash_bwd_dkdv_tc<__half, 256, 16, 64, 1, 6, true, true>", "flash_bwd_dq_convert<__half>"}


def test_strided_head_dim_and_old_gpus_fall_back_to_simt(rng):
    q, k, v = tc_inputs(rng, (1, 20, 20, 1, 1, 64, False), "float16")
    with emulated():
        p = flashcupy._checks.problem(q, k, v, False, None, None)
        assert cupy_backend.forward_path(p, q[..., ::-1], k, v) == "simt"
    with emulated(compute_capability=61):
        assert cupy_backend.forward_path(p, q, k, v) == "simt"
    bf16 = tuple(narrow(x.astype(np.float32), "bfloat16") for x in (q, k, v))
    wide = tuple(np.zeros((1, 20, 1, 136), np.float16) for _ in range(3))
    with emulated(compute_capability=75):  # Turing: float16 on tensor cores up to head_dim 128; bfloat16 (no
        assert cupy_backend.forward_path(p, q, k, v) == "tensor-core"  # mma there) and above 128 not
        p16 = flashcupy._checks.problem(*bf16, False, None, "bfloat16")
        assert cupy_backend.forward_path(p16, *bf16) == "simt"
        p136 = flashcupy._checks.problem(*wide, False, None, None)
        assert cupy_backend.forward_path(p136, *wide) == "simt"
        assert cupy_backend.backward_path(p136, wide[0], *wide, wide[0]) == "simt"
    with emulated() as runtime:  # a forward tile past the device's opt-in (48 KiB at 64) falls back too
        runtime.smem_optin = lambda x: 40 * 1024
        assert cupy_backend.forward_path(p, q, k, v) == "simt"


def test_a_pascal_gpu_runs_every_16_bit_call_on_the_simt_kernels(rng):
    # a Pascal device (below every specs.TC_COMPUTE_CAPABILITY, 48 KiB of shared memory a CTA): the forward,
    # backward (deterministic or not) and a split decode compile no tensor-core kernel, and end as the
    # oracle's
    from flashcupy.backends.cupy_backend import specs
    q, k, v = make_qkv(rng, 1, 20, 30, 2, 1, 64, np.float16)
    dout = rng.standard_normal(q.shape).astype(np.float16)
    names = []
    with emulated(compute_capability=61, compile=recording(names)) as runtime:
        assert runtime.smem_optin(q) == specs.smem_optin(61) == 48 * 1024
        out, lse = flashcupy.attention(q, k, v, causal=True, return_lse=True, backend="cupy")
        for deterministic in (False, True):
            grads = flashcupy.attention_backward(dout, q, k, v, out, lse, causal=True, backend="cupy",
                                                 deterministic=deterministic)
            assert_matches_oracle((out, lse, *grads), q, k, v, dout, causal=True, backend="cupy")
        decode = flashcupy.attention_with_kvcache(q[:, :1], k, v, num_splits=2, return_lse=True, backend="cupy")
    assert_matches_oracle(decode, q[:, :1], k, v, backend="cupy")
    assert names and not [name for name in names if "_tc" in name or "sm90" in name]


@pytest.mark.parametrize("head_dim,softcap", [(64, None), (128, None), (128, 30.0)], ids=["64", "128", "128-softcap"])
def test_a_turing_gpu_runs_float16_on_the_tensor_cores(rng, head_dim, softcap):
    # Turing (cc 7.5): the mma.sync kernels built for sm_75 (tensor_core.cuh's stand-ins: two m16n8k8 an mma,
    # plain copies for cp.async) with Turing's tiles (specs.TC_TURING_TILES): the forward, backward (by
    # atomics and deterministic) and a split decode end as the oracle's, in two thread orders. With softcap
    # at 128 the default backward keeps the deterministic kernels there (TC_TURING_ATOMIC_BUCKETS_SCORE)
    from flashcupy.backends.cupy_backend import specs
    q, k, v = make_qkv(rng, 1, 70, 100, 2, 1, head_dim - 8, np.float16)
    dout = rng.standard_normal(q.shape).astype(np.float16)
    kw = {} if softcap is None else {"softcap": softcap}
    for order in ("descending", "warp_skew")[:1 if softcap else 2]:
        names = []
        with emulated(order, compute_capability=75, compile=recording(names)):
            p = flashcupy._checks.problem(q, k, v, True, None, None, **kw)
            split = flashcupy._checks.problem(q[:, :1], k, v, False, None, None)
            assert (cupy_backend.forward_path(p, q, k, v), cupy_backend.backward_path(p, dout, q, k, v, q),
                    cupy_backend.forward_path(split, q[:, :1], k, v, split=True)) == ("tensor-core",) * 3
            out, lse = flashcupy.attention(q, k, v, causal=True, return_lse=True, backend="cupy", **kw)
            for deterministic in (False, True)[:1 if softcap else 2]:
                grads = flashcupy.attention_backward(dout, q, k, v, out, lse, causal=True, backend="cupy",
                                                     deterministic=deterministic, **kw)
                assert_matches_oracle((out, lse, *grads), q, k, v, dout, causal=True, backend="cupy", **kw)
            if not softcap:
                decode = flashcupy.attention_with_kvcache(q[:, :1], k, v, num_splits=2, return_lse=True,
                                                          backend="cupy")
        if not softcap:
            assert_matches_oracle(decode, q[:, :1], k, v, backend="cupy")
        bm, bn = specs.TC_TURING_TILES["forward"][head_dim]
        assert f"flash_fwd_tc<__half, {specs.tc_head_dim(head_dim)}, {bm}, {bn}," in " ".join(names)
        assert not [name for name in names if "sm90" in name or "wide" in name]
        if softcap:  # the default backward ran the deterministic dQ kernel
            assert any("flash_bwd_dq_tc" in name for name in names)


# causal with seqlen_q - seqlen_k = 130: the rows of the first two 64-row query blocks see no key, so
# the forward and dQ CTAs of those blocks have no key block to visit
NO_KEY_CASE = (1, 150, 20, 1, 1, 64, True)


@pytest.mark.parametrize("schedule", SCHEDULES, ids="-".join)
def test_ctas_without_a_key_block_write_zeros_and_leave_no_copy_in_flight(schedule, rng):
    # the emulator fails the launch if a thread exits with cp.async copies in flight
    q, k, v, dout, grads = tc_gradients(rng, NO_KEY_CASE, "float16", schedule)
    out, lse = tc_forward(q, k, v, "float16", True, schedule)
    unseen = NO_KEY_CASE[1] - NO_KEY_CASE[2]
    assert (out[:, :unseen] == 0).all() and np.isneginf(lse[..., :unseen]).all()
    assert_matches_oracle((out, lse, *grads), q, k, v, dout, causal=True, backend="cupy")


def test_a_cta_leaving_a_copy_in_flight_is_caught(rng):
    # flash_fwd_tc.cu as it was: the Q tile's cp.async issued even where there is no key block to visit
    def q_copy_always(source, names, options, thread_order, seed, cp_async):
        if any(name.startswith("flash_fwd_tc<") for name in names):
            guard, q_load = r"(    if \(kv\.blocks > 0\) \{\n)", r"(\s*load_tile_async<BLOCK_M, HEAD_DIM, THREADS>\(Q_s[^\n]*\n)"
            source, count = re.subn(guard + q_load, r"\2\1", source)
            assert count == 1, "the guarded Q tile load is not in flash_fwd_tc.cu"
        return compile_module(source, names, options, thread_order, seed, cp_async)

    q, k, v = tc_inputs(rng, NO_KEY_CASE, "float16")
    with pytest.raises(KernelError, match=r"exited with \d+ cp\.async copies not waited for") as caught:
        tc_forward(q, k, v, "float16", True, SCHEDULES[0], compile=q_copy_always)
    # blocks 1 and 2 are query blocks 1 and 0 (the grid runs the last query block first)
    assert caught.value.block in ((1, 0, 0), (2, 0, 0))


# ----------------------------------------------------------------------------
# the tensor-core backward (kernels/flash_bwd_tc.cu): flash_bwd_preprocess, flash_bwd_dkdv_tc and
# flash_bwd_dq_tc, through the backend's dispatch and launch code under the emulator, on the out
# and lse of the tensor-core forward


def tc_backward(dout, q, k, v, out, lse, fmt, causal, schedule, compile=compile_module, scale=None):
    """(dq, dk, dv) from backend="cupy", asserting that it took the tensor-core path."""
    dtype = "bfloat16" if fmt == "bfloat16" else None
    order, cp_async = schedule
    with emulated(order, cp_async=cp_async, compile=compile):
        p = flashcupy._checks.problem(q, k, v, causal, None, dtype)
        assert cupy_backend.backward_path(p, dout, q, k, v, out) == "tensor-core"
        return flashcupy.attention_backward(dout, q, k, v, out, lse, causal=causal, scale=scale, backend="cupy",
                                            dtype=dtype)


def tc_gradients(rng, case, fmt, schedule=SCHEDULES[0], compile=compile_module):
    """(q, k, v, dout, (dq, dk, dv)): the forward and backward on tensor cores, the forward under
    the default schedule, the backward under `schedule` and `compile`."""
    q, k, v = tc_inputs(rng, case, fmt)
    dout = narrow(rng.standard_normal(q.shape), fmt)
    causal = case[6]
    out, lse = tc_forward(q, k, v, fmt, causal, SCHEDULES[0])
    return q, k, v, dout, tc_backward(dout, q, k, v, out, lse, fmt, causal, schedule, compile)


@pytest.mark.parametrize("schedule", SCHEDULES, ids="-".join)
@pytest.mark.parametrize("fmt", NARROW)
@pytest.mark.parametrize("case", TC_CASES, ids=case_id)
def test_flash_bwd_tc_matches_oracle(case, fmt, schedule, rng):
    q, k, v, dout, grads = tc_gradients(rng, case, fmt, schedule)
    B, Sq, Sk, Hq, Hkv, D, causal = case
    for got, x in zip(grads, (q, k, v)):
        assert got.dtype == x.dtype and got.shape == x.shape
    out, lse = tc_forward(q, k, v, fmt, causal, SCHEDULES[0])
    assert_matches_oracle((out, lse, *grads), q, k, v, dout, causal=causal, dtype=fmt, backend="cupy")
    if causal and Sq > Sk:  # the first Sq - Sk rows see no key: their dq is exactly 0
        assert (grads[0][:, :Sq - Sk] == 0).all()


@pytest.mark.parametrize("order", ("ascending", "descending"))
def test_backward_with_strided_dout_or_out_falls_back_to_simt(order, rng):
    case = (1, 20, 20, 1, 1, 64, False)
    q, k, v = tc_inputs(rng, case, "float16")
    dout = narrow(rng.standard_normal(q.shape), "float16")
    with emulated(order):
        out, lse = flashcupy.attention(q, k, v, return_lse=True, backend="cupy")
        p = flashcupy._checks.problem(q, k, v, False, None, None)
        assert cupy_backend.backward_path(p, dout, q, k, v, out) == "tensor-core"
        assert cupy_backend.backward_path(p, dout, q, k, v, out[..., ::-1]) == "simt"
        strided = np.empty(dout.shape[:3] + (2 * dout.shape[3],), dout.dtype)[..., ::2]
        strided[...] = dout
        assert cupy_backend.backward_path(p, strided, q, k, v, out) == "simt"
        grads = flashcupy.attention_backward(strided, q, k, v, out, lse, backend="cupy")
    assert_matches_oracle((out, lse, *grads), q, k, v, dout, backend="cupy")


@pytest.mark.parametrize("schedule", SCHEDULES[::2], ids="-".join)
@pytest.mark.parametrize("fmt", NARROW)
def test_a_scale_other_than_the_default_reaches_both_passes(fmt, schedule, rng):
    # a kernel that used 1/sqrt(head_dim) whatever the scale would pass every other test
    case = (2, 65, 200, 4, 2, 128, True)
    q, k, v = tc_inputs(rng, case, fmt)
    dout = narrow(rng.standard_normal(q.shape), fmt)
    out, lse = tc_forward(q, k, v, fmt, True, schedule, scale=0.3)
    grads = tc_backward(dout, q, k, v, out, lse, fmt, True, schedule, scale=0.3)
    assert_matches_oracle((out, lse, *grads), q, k, v, dout, causal=True, scale=0.3, dtype=fmt, backend="cupy")


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic-dq", "deterministic"])
@pytest.mark.parametrize("kw", [{}, dict(bias=True), dict(window=(2, 3))], ids=["plain", "bias", "window"])
@pytest.mark.parametrize("scale", [1e11, 1e30, 1e37])  # 1e38 takes scores of head_dim 16 past float32's range
def test_scores_whose_rounding_exceeds_one_keep_the_gradients_finite(scale, kw, deterministic, monkeypatch):
    """bfloat16 (float32's range) at scales that make scores of inputs of 0.5 far larger than 1 /
    float32's roundoff (issue 31): the backward's products, rounded otherwise than the forward's, put
    s - lse far above 0 and P at inf; so did dbias and attention_probs, SIMT kernels of the SIMT
    kernels' S against the tensor-core forward's lse. The kernel path is asserted."""
    monkeypatch.setattr(cupy_backend, "USE_TENSOR_CORES", True)
    backward = cupy_backend.backward
    monkeypatch.setattr(cupy_backend, "backward",
                        lambda *a, **k: backward(*a, **dict(k, deterministic=deterministic)))
    names = []
    with emulated(compile=recording(names)):
        large_scores_check("cupy", BF16, scale, head_dim=16, bits=True, **kw)
    assert {"flash_fwd_tc", "flash_bwd_dkdv_tc"} <= {n.split("<")[0] for n in names}, names


# Deliberate bugs in the tensor-core kernels (conftest.MUTATION_BATTERY, float16): each must fail the
# battery. mask.cuh's (conftest.MASK_CUH_MUTATIONS) are shared with the SIMT kernels' battery.
TC_MUTATIONS = {
    **MASK_CUH_MUTATIONS,
    "scale ignored": ("const float scale_log2 = scale * LOG2E;", "const float scale_log2 = LOG2E / sqrtf(float(head_dim));"),
    "D not subtracted": ("return P * (dp - D);", "return P * dp;"),
    "lse base": ("m[mt][r] * LN2 + logf(l[mt][r])", "m[mt][r] * LN2 + log2f(l[mt][r])"),
}


def _tc_mutant(old, new):
    """The emulator, with `old` replaced by `new` in the tensor-core modules only."""
    def compile(source, names, options, thread_order, seed, cp_async):
        if any(n.split("<")[0].endswith(("_tc", "_tc_wide")) for n in names):
            source = source.replace(old, new)
        return compile_module(source, names, options, thread_order, seed, cp_async)
    return emulated(compile=compile)


test_the_mutation_battery_passes_unmutated, test_a_mutation_is_caught = mutation_tests(
    TC_MUTATIONS, "cupy", _tc_mutant, plain=emulated, dtype=np.float16, cases=MUTATION_BATTERY + (TILE_EDGE_CASE,))


# ----------------------------------------------------------------------------
# the backward's two forms: dQ by atomics inside the dK/dV kernel (five GEMMs, the default), and the
# deterministic one (a dQ kernel of its own, every element written once: seven GEMMs)


class _CapturingDqSums:
    """A compiled module whose flash_bwd_dq_convert launches first append a copy of their float32
    workspace to `sums`: dQ as the dK/dV kernel's atomics summed it, before rounding. A wrapper, so
    the emulator's module (which may be shared) stays as it was."""

    def __init__(self, module, sums: list):
        self.module, self.sums = module, sums

    def get_function(self, name):
        function = self.module.get_function(name)
        if not name.startswith("flash_bwd_dq_convert"):
            return function

        def launch(grid, block, arguments, **kw):
            self.sums.append(np.array(arguments[0], copy=True))
            return function(grid, block, arguments, **kw)
        return launch


def capturing_dq_sums(sums: list):
    """A compile function for emulated() whose modules capture the atomics' sums (_CapturingDqSums)."""
    return lambda *args: _CapturingDqSums(compile_module(*args), sums)


@pytest.mark.parametrize("head_dim", [64, 128, 256])  # 256: two CTAs a block (specs.tc_column_parts)
def test_the_deterministic_backward_is_bitwise_the_same_under_every_schedule(rng, head_dim):
    q, k, v = make_qkv(rng, 1, 70, 130, *((4, 2) if head_dim <= 128 else (2, 1)), head_dim, np.float16)
    dout = rng.standard_normal(q.shape).astype(np.float16)
    got, sums = {}, []
    for order in ("ascending", "descending", "warp_skew"):
        with emulated(order, compile=capturing_dq_sums(sums)):
            out, lse = flashcupy.attention(q, k, v, causal=True, return_lse=True, backend="cupy")
            grads = flashcupy.attention_backward(dout, q, k, v, out, lse, causal=True, backend="cupy",
                                                 deterministic=True)
            atomic = flashcupy.attention_backward(dout, q, k, v, out, lse, causal=True, backend="cupy")
        assert_matches_oracle((out, lse, *grads), q, k, v, dout, causal=True, backend="cupy")
        assert_matches_oracle((out, lse, *atomic), q, k, v, dout, causal=True, backend="cupy")
        got[order] = grads
    for grads in got.values():
        for a, b in zip(grads, got["ascending"]):
            np.testing.assert_array_equal(a, b)
    # what makes the check above bite: these schedules add the atomics' terms in other orders, so the
    # default backward's float32 sums differ in their last bits (rounding to float16 mostly hides it)
    assert len(sums) == 3 and any(not np.array_equal(x, sums[0]) for x in sums[1:])


def test_each_backward_launches_its_own_kernels(rng):
    launched = []
    q, k, v = make_qkv(rng, 1, 20, 20, 2, 1, 64, np.float16)
    with emulated(compile=recording(launched)):
        out, lse = flashcupy.attention(q, k, v, return_lse=True, backend="cupy")
        flashcupy.attention_backward(out, q, k, v, out, lse, backend="cupy")
        flashcupy.attention_backward(out, q, k, v, out, lse, backend="cupy", deterministic=True)
    backward = [n for n in launched if "bwd" in n]
    assert backward == ["flash_bwd_preprocess<__half, float>", "flash_bwd_dkdv_tc<__half, 64, 64, 64, 0, 0, true>",
                        "flash_bwd_dq_convert<__half>", "flash_bwd_preprocess<__half, float>",
                        "flash_bwd_dkdv_tc<__half, 64, 64, 64, 0>", "flash_bwd_dq_tc<__half, 64, 64, 64, 0>"]


def test_a_split_forward_with_a_bias_above_head_dim_192_takes_the_simt_forward(rng):
    # specs.TC_SPLIT_PAIRS_BUCKETS: the split-KV forward with a bias or mask went past the register limit at 256
    bias = rng.standard_normal((1, 2, 1, 300)).astype(np.float32)
    for head_dim, split_path in ((256, "simt"), (192, "tensor-core")):
        q, k, v = make_qkv(rng, 1, 1, 300, 2, 1, head_dim, np.float16)
        with emulated():
            p = flashcupy._checks.problem(q, k, v, False, None, None, "numpy", bias=bias)
            assert cupy_backend.forward_path(p, q, k, v, split=True) == split_path
            assert cupy_backend.forward_path(p, q, k, v) == "tensor-core"
            # (no public call splits with a bias: the package's own forward with num_splits does)
            out, lse = flashcupy._api.forward(q, k, v, bias=bias, num_splits=2, backend="cupy")
        assert_matches_oracle((out, lse), q, k, v, bias=bias, backend="cupy")
