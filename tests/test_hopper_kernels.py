"""The Hopper kernels (kernels/flash_fwd_sm90.cu, flash_bwd_sm90.cu) on the CPU emulator: which calls
take them, their numbers against the oracle in several thread orders, each of their barriers, waits
and fences removed in turn, and the backward's dQ reduction dropped.

The emulated device is an sm_90 here (compute_capability=90). The contract suite runs its whole table
on these kernels too (tests/contract.py, path "hopper").
"""

from __future__ import annotations

import contextlib
import re
import shutil
from unittest import mock

import numpy as np
import pytest

import flashcupy
from conftest import BF16, assert_matches_oracle, bf16_bits, make_qkv
import sync_mutants
from modifier_checks import named_modifiers
from varlen_checks import packed_batch_matches_the_oracle, packed_inputs
from flashcupy.backends import cupy_backend
from flashcupy.backends.cupy_backend import catalog, sources, specs
from flashcupy.tools import emulator
from flashcupy.tools.emulator.cupy import compile_module, emulated, launch_records, recording

HOPPER = specs.SM90_COMPUTE_CAPABILITY
WINDOW = specs.MOD_BITS["window"]
KERNELS = ("flash_fwd_sm90.cu", "flash_bwd_sm90.cu")


def _templates(names):
    return {name.split("<")[0] for name in names}


# Which kernels a call launches, recorded without building or running them (launch_records' run=False): the
# tests below check where calls go, the oracle tests what each kernel computes


def _forward_templates(q, k, v, compute_capability=HOPPER, **kw):
    records = []
    with emulated(compile=launch_records(records, run=False), compute_capability=compute_capability):
        flashcupy.attention(q, k, v, backend="cupy", **kw)
    return _templates(name for name, _ in records)


def _backward_templates(q, k, v, compute_capability=HOPPER, deterministic=False, **kw):
    """The dK/dV kernel (and dQ's) a backward launched."""
    records = []
    with emulated(compile=launch_records(records, run=False), compute_capability=compute_capability):
        out, lse = flashcupy.attention(q, k, v, return_lse=True, backend="cupy", **kw)
        del records[:]
        flashcupy.attention_backward(q, q, k, v, out, lse, backend="cupy", deterministic=deterministic, **kw)
    return _templates(name for name, _ in records) - {"flash_bwd_preprocess", "flash_bwd_dq_convert",
                                                      "flash_bwd_dq_convert_sm90"}


# ----------------------------------------------------------------------------
# which calls take it


@pytest.mark.parametrize("dtype", [np.float16, "bfloat16"])
@pytest.mark.parametrize("head_dim", [32, 64, 72, 128, 136, 192, 200, 256])
def test_the_hopper_kernels_take_16_bit_calls_up_to_head_dim_256(rng, dtype, head_dim):
    q, k, v = make_qkv(rng, 1, 20, 30, 2, 1, head_dim, np.float32)
    kw = {}
    if dtype == "bfloat16":
        q, k, v = (bf16_bits(x.astype(BF16)) for x in (q, k, v))
        kw["dtype"] = "bfloat16"
    else:
        q, k, v = (x.astype(dtype) for x in (q, k, v))
    assert _forward_templates(q, k, v, causal=True, **kw) == {"flash_fwd_sm90"}
    assert _forward_templates(q, k, v, window=(5, 3), **kw) == {"flash_fwd_sm90"}
    # the backward at 136..192 too, in the 256 kernel (specs.sm90_backward_bucket)
    assert _backward_templates(q, k, v, causal=True, **kw) == {"flash_bwd_dkdv_sm90"}
    assert _backward_templates(q, k, v, causal=True, deterministic=True, **kw) == {"flash_bwd_dkdv_sm90"}
    # and on an sm_80 the mma.sync forward, head_dim 136..256 too (specs.TC_HEAD_DIM_BUCKETS)
    sm80 = _forward_templates(q, k, v, compute_capability=80, **kw)
    assert len(sm80) == 1 and sm80 <= set(specs.TC_FORWARD_TEMPLATES)


def test_other_calls_keep_the_mma_sync_kernels(rng):
    q, k, v = make_qkv(rng, 1, 20, 20, 1, 1, 64, np.float16)
    # another device, the switch, modifiers the backward does not take (SM90_BACKWARD_SPILLS), split-KV
    assert _forward_templates(q, k, v, compute_capability=80) == {"flash_fwd_tc"}
    assert _backward_templates(q, k, v, compute_capability=80) == {"flash_bwd_dkdv_tc"}
    with mock.patch.object(cupy_backend, "USE_WGMMA", False):
        assert _forward_templates(q, k, v) == {"flash_fwd_tc"}
        assert _backward_templates(q, k, v) == {"flash_bwd_dkdv_tc"}
    assert _forward_templates(q, k, v, softcap=5.0) == {"flash_fwd_sm90"}  # every modifier, one batch's forward
    assert _backward_templates(q, k, v, softcap=5.0) == {"flash_bwd_dkdv_sm90"}  # and its backward up to 128
    q1, k1, v1 = make_qkv(rng, 1, 20, 20, 1, 1, 128, np.float16)
    mask = rng.random((1, 1, 20, 20)) < 0.8
    assert _backward_templates(q1, k1, v1, mask=mask) == {"flash_bwd_dkdv_sm90"}
    # (with a mask at 128 the mma.sync backward's dQ is its own kernel: TC_ATOMIC_BUCKETS_PAIRS)
    assert _backward_templates(q1, k1, v1, mask=mask, window=(4, 4)) == {"flash_bwd_dkdv_tc", "flash_bwd_dq_tc"}
    _, k, v = make_qkv(rng, 1, 1, 300, 1, 1, 64, np.float16)  # 300 keys: two splits of 256 and 44
    names = []
    with emulated(compile=recording(names), compute_capability=HOPPER):
        flashcupy.attention_with_kvcache(q[:, :1], k, v, num_splits=2, backend="cupy")
    assert _templates(names) == {"flash_fwd_tc", "flash_split_merge"}  # the split forward, then its merge
    # a packed batch with softcap at head_dim 256 (its kernel spilled), and a bias at head_dim 256 (none above
    # 128): the mma.sync forward
    lengths = ([20, 9], [30, 9])
    names = []
    with emulated(compile=recording(names), compute_capability=HOPPER):
        packed_batch_matches_the_oracle(rng, "cupy", lengths, np.float16, 256, (2, 1), dict(softcap=3.0))
    assert _templates(names) == {"flash_fwd_tc"}
    bias = rng.standard_normal((1, 1, 20, 20)).astype(np.float16)
    q, k, v = make_qkv(rng, 1, 20, 20, 1, 1, 256, np.float16)
    assert _forward_templates(q, k, v, bias=bias) == {"flash_fwd_tc"}
    assert _forward_templates(q, k, v, mask=bias > 0) == {"flash_fwd_sm90"}


def test_strides_a_tensor_map_cannot_describe_fall_back_never_fail(rng):
    q, k, v = make_qkv(rng, 2, 40, 48, 2, 2, 64, np.float16)
    with emulated(compute_capability=HOPPER):
        p = flashcupy._checks.problem(q, k, v, False, None, None)
        assert cupy_backend.forward_path(p, q, k, v) == "hopper"
        # a negative stride: the mma.sync kernel reads it, a tensor map cannot
        assert cupy_backend.forward_path(p, q[:, ::-1], k, v) == "tensor-core"
        # rows 8 elements apart in a wider array: 16-byte rows for cp.async, yet a head stride of
        # 16 bytes is fine for a map too; a given out whose rows are 8 bytes off its alignment is not
        wide = np.zeros((2, 40, 2, 72), np.float16)[..., 4:68]
        assert cupy_backend.forward_path(p, q, k, v, out=wide) == "tensor-core"
        assert cupy_backend.forward_path(p, q, k, v, out=np.empty_like(q)) == "hopper"
        # batch 1 with a negative stride along its batch dimension: never used, so a map takes it
        one = np.lib.stride_tricks.as_strided(q[:1], strides=(-16, *q.strides[1:]))
        assert cupy_backend.forward_path(p, one, k[:1], v[:1]) == "hopper"
        got = flashcupy.attention(q[:, ::-1], k, v, return_lse=True, backend="cupy")
    assert_matches_oracle(got, q[:, ::-1], k, v, backend="cupy")


# ----------------------------------------------------------------------------
# the numbers


CASES = [  # (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal, window); 384 threads a CTA: small
    (1, 1, 1, 1, 1, 64, False, None),
    (2, 130, 70, 2, 1, 64, True, None),        # GQA, causal, batch 2, two forward query blocks, 3 backward passes
    (1, 70, 260, 1, 1, 128, True, None),       # three key blocks: the rings' stages reused; rows that see no key
    (1, 17, 150, 2, 2, 128, False, None),      # two key blocks, a pass of 17 rows
    (1, 90, 300, 1, 1, 96, False, (50, 10)),   # the window: blocks outside the band never loaded
    (1, 65, 70, 2, 1, 40, True, (0, 0)),       # a window of one key a row
    (1, 300, 40, 1, 1, 64, True, None),        # two query blocks that see no key: tiles without a load
]
# The persistent forward's grid (cupy_backend.SM90_PERSISTENT, off by default) is min(tiles, SMs): an
# emulated device of 1 or 2 SMs makes each CTA walk several tiles (Q_s, O_s, the rings and the pingpong
# carried from one tile to the next); ascending: the default grid, a CTA a tile
SM_COUNTS = {"ascending": None, "warp_skew": 1, "descending": 2}


def persistent(sm_count):
    """emulated()'s keywords and a context that launch the Hopper forward persistent on sm_count SMs (None:
    the default grid)."""
    if sm_count is None:
        return {}, contextlib.nullcontext()
    return {"sm_count": sm_count}, mock.patch.object(cupy_backend, "SM90_PERSISTENT", True)


def _problem(rng, dtype, B, Sq, Sk, Hq, Hkv, D, **kw):
    """q, k, v, dout of a random problem in `dtype` (bfloat16: as bits), and the calls' keywords: kw, with
    the dtype for bfloat16."""
    q, k, v = make_qkv(rng, B, Sq, Sk, Hq, Hkv, D, np.float32)
    dout = rng.standard_normal(q.shape)
    if dtype == "bfloat16":
        return (*(bf16_bits(x.astype(BF16)) for x in (q, k, v, dout)), dict(kw, dtype="bfloat16"))
    return (*(x.astype(np.float16) for x in (q, k, v, dout)), kw)


def _forward_case(rng, order, dtype, case, switch=contextlib.nullcontext(), cp_async="deferred"):
    """The forward of a case (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal, window) on the
    emulated sm_90 in `order` (persistent as SM_COUNTS says), under `switch`: the kernels launched,
    (out, lse), (q, k, v), the calls' keywords and the MODS of its window."""
    *shape, causal, window = case
    q, k, v, _, kw = _problem(rng, dtype, *shape, causal=causal, window=window)
    names = []
    grid, launch = persistent(SM_COUNTS[order])
    with switch, launch, emulated(order, compile=recording(names), compute_capability=HOPPER, cp_async=cp_async,
                                  **grid):
        got = flashcupy.attention(q, k, v, return_lse=True, backend="cupy", **kw)
    return names, got, (q, k, v), kw, WINDOW if window else 0


def _case_id(c):
    """A case's test id: its shape, causal, window."""
    return "x".join(str(x) for x in c[:6]) + ("-causal" if c[6] else "") + (f"-w{c[7][0]}_{c[7][1]}" if c[7] else "")


# "eager": TMA loads land at issue (and cp.async copies), so that a ring stage released before a wgmma that
# reads it has landed would give that wgmma the next pass's tile (the default lands them at the wait)
@pytest.mark.parametrize("order, dtype, cp_async", [("ascending", "float16", "deferred"),
                                                    ("warp_skew", "float16", "deferred"),
                                                    ("descending", "bfloat16", "deferred"),
                                                    ("ascending", "bfloat16", "eager")])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_the_hopper_kernels_match_the_oracle(rng, order, dtype, cp_async, case):
    B, Sq, Sk, Hq, Hkv, D, causal, window = case
    q, k, v, dout, kw = _problem(rng, dtype, B, Sq, Sk, Hq, Hkv, D, causal=causal, window=window)
    names = []
    grid, launch = persistent(SM_COUNTS[order])
    with launch, emulated(order, compile=recording(names), compute_capability=HOPPER, cp_async=cp_async, **grid):
        out, lse = flashcupy.attention(q, k, v, return_lse=True, backend="cupy", **kw)
        grads = flashcupy.attention_backward(dout, q, k, v, out, lse, backend="cupy", **kw)
    assert {"flash_fwd_sm90", "flash_bwd_dkdv_sm90"} <= _templates(names)
    assert_matches_oracle((out, lse, *grads), q, k, v, dout, backend="cupy", **kw)


# head_dim 136..256 (the buckets 192 and 256): FA3's 128 x 80 tile, wgmma N = 80 for S and 192 or 256 for
# P V_j, O_s in Q_s at 256 (O_IN_Q); forward only (the backward at 256: below), in the
# default grid and persistent on 1 or 2 SMs, and with TMA landing at issue (eager); the packed batch's
# 128 x 64 at 256: tests/test_varlen.py
HEAD_DIM_256_CASES = [  # (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal, window)
    (1, 70, 200, 2, 1, 256, True, None),        # GQA, causal; key blocks of 80, 80, 40: a stage reused
    (1, 130, 90, 1, 1, 200, False, (40, 7)),    # the window; head_dim 200: columns past it read as zeros
    (2, 17, 300, 1, 1, 160, False, None),       # the bucket 192; batch 2, a tile of 17 rows, four key blocks
]


# the runs of the head_dim-256 cases: three thread orders, and TMA landing at issue (eager)
RUNS_256 = [("ascending", "float16", "deferred"), ("warp_skew", "bfloat16", "deferred"),
            ("descending", "float16", "deferred"), ("ascending", "bfloat16", "eager")]


@pytest.mark.parametrize("order, dtype, cp_async", RUNS_256)
@pytest.mark.parametrize("case", HEAD_DIM_256_CASES, ids=_case_id)
def test_the_head_dim_256_forward_matches_the_oracle(rng, order, dtype, cp_async, case):
    names, got, qkv, kw, mods = _forward_case(rng, order, dtype, case, cp_async=cp_async)
    ctype = "__half" if dtype == "float16" else "__nv_bfloat16"
    assert names == [f"flash_fwd_sm90<{ctype}, {specs.tc_tile_row(case[5])}, 128, 80{f', {mods}' if mods else ''}>"]
    assert_matches_oracle(got, *qkv, backend="cupy", **kw)


# The backward at head_dim 136..256 (SPLIT_D in flash_bwd_sm90.cu): 64 x 64, the consumers splitting the
# columns of dK, dV, dQ_i and the queries of Sᵀ, Pᵀ and dSᵀ through shared memory, one stage; at 136..192 the
# fourth atom is not loaded but zeroed
HEAD_DIM_256_BACKWARD_CASES = [  # (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal, window)
    (1, 70, 150, 2, 1, 256, True, None),        # GQA, causal: up to 4 passes a key block, the stage reused
    (1, 100, 90, 1, 1, 200, False, (40, 7)),    # the window; head_dim 200: columns past it read as zeros
    (2, 17, 100, 1, 1, 136, False, None),       # batch 2, a pass of 17 rows; a key block of 36; three atoms
]


@pytest.mark.parametrize("order, dtype, cp_async", RUNS_256)
@pytest.mark.parametrize("case", HEAD_DIM_256_BACKWARD_CASES, ids=_case_id)
def test_the_head_dim_256_backward_matches_the_oracle(rng, order, dtype, cp_async, case):
    *shape, causal, window = case
    q, k, v, dout, kw = _problem(rng, dtype, *shape, causal=causal, window=window)
    names = []
    with emulated(order, compile=recording(names), compute_capability=HOPPER, cp_async=cp_async):
        out, lse = flashcupy.attention(q, k, v, return_lse=True, backend="cupy", **kw)
        grads = flashcupy.attention_backward(dout, q, k, v, out, lse, backend="cupy", **kw)
    kernel = specs.sm90_backward_module(dtype, shape[-1], WINDOW if window else 0).kernels[1]
    assert (kernel.head_dim, kernel.block_m, kernel.block_n) == (256, 64, 64) and kernel.name_expression in names
    assert_matches_oracle((out, lse, *grads), q, k, v, dout, backend="cupy", **kw)


@pytest.mark.parametrize("head_dim, mods, causal, varlen, tile, o_in_q", [
    (256, 0, False, False, (128, 80), True), (200, 0, True, False, (128, 80), True),
    (256, WINDOW, False, False, (128, 80), True),  # the window
    (256, 0, False, True, (128, 64), True),                 # a packed batch: at 80 keys its kernel spilled
    (136, 0, False, False, (128, 80), False), (192, WINDOW, True, True, (128, 80), False),
])
def test_the_tiles_above_head_dim_128_fit(head_dim, mods, causal, varlen, tile, o_in_q):
    # the wide and tall switches change nothing there (no tile of theirs)
    for wide in (False, True):
        for tall in (False, True):
            assert specs.sm90_forward_tile(head_dim, mods, causal, varlen, wide, tall) == tile
    kernel = specs.sm90_forward_module("float16", head_dim, mods, varlen, tile).kernels[0]
    assert kernel.dynamic_smem <= specs.SM90_SMEM_OPTIN
    # at 256 Q_i, the ring and O_s would not fit: O_s is Q_s (flash_fwd_sm90.cu's O_IN_Q), as launch.py counts
    (bm, bn), d = tile, specs.tc_tile_row(head_dim)
    assert kernel.dynamic_smem == ((1 if o_in_q else 2) * bm + 2 * 2 * bn) * d * 2 + 1024
    # the backward's: SPLIT_D, the 256 kernel, at every head_dim above 128
    assert specs.sm90_eligible("float16", head_dim, mods) and specs.sm90_eligible("float16", head_dim, mods, True)
    assert specs.sm90_backward_bucket(head_dim) == 256


# Score modifiers and the bool mask on the Hopper forward (one batch; specs.SM90_FORWARD_MODS: all but a bias
# at 256), made final in S before the mask as flash_fwd_tc.cu does; a bias or mask takes 64-key blocks
# (SM90_PAIRS_FORWARD_TILES). The backward of these calls runs on Hopper too (but the window with a bias or the mask
# at 128: SM90_BACKWARD_SPILLS), checked too.
# tests/test_cupy_modifiers.py runs every modifier case on this path at head_dim 64.
MODIFIED_CASES = [  # (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal, modifiers, tile)
    (1, 140, 150, 2, 1, 128, True, ("softcap", "alibi", "bias", "mask", "window"), (128, 64)),
    # every one but the window at 128: the Hopper backward too (with the window, the mma.sync one's)
    (2, 100, 150, 2, 1, 120, False, ("softcap", "alibi", "bias", "mask"), (128, 64)),
    # this one and the next: the backward's SPLIT_D with modifiers too
    (2, 70, 200, 2, 2, 256, False, ("softcap", "alibi", "window"), (128, 64)),  # 64 keys at 256 (ALiBi spilled)
    (1, 130, 90, 2, 1, 200, True, ("mask", "softcap"), (128, 64)),     # the mask above 128: no bias there
    (1, 90, 140, 1, 1, 160, False, ("alibi", "softcap"), (128, 80)),   # the bucket 192: the default tile; the
    #                                                                    backward's SPLIT_D with three atoms
]


def test_which_modifiers_the_hopper_kernels_take_and_their_tiles():
    bits = specs.MOD_BITS
    score, pairs = bits["softcap"] | bits["alibi_slopes"], bits["bias"] | bits["mask"]
    for d in (64, 128):
        assert specs.sm90_eligible("float16", d, specs.ALL_MODS)
        assert specs.sm90_forward_tile(d, pairs) == specs.sm90_forward_tile(d, bits["bias"]) == (128, 64)
    for d in (136, 256):  # a bias spilled with softcap or ALiBi besides
        assert not specs.sm90_eligible("float16", d, bits["bias"])
        assert specs.sm90_eligible("float16", d, specs.ALL_MODS & ~bits["bias"])
        assert specs.sm90_forward_tile(d, bits["mask"]) == (128, 64)
    assert specs.sm90_forward_tile(192, score) == (128, 80) and specs.sm90_forward_tile(256, score) == (128, 64)
    # the backward: every modifier up to 128, but the window with a bias or the mask at 128 (they spilled), and
    # a packed batch's three; a packed batch's forward: the window, softcap and ALiBi (attention_varlen's
    # modifiers), but the window alone at 256, and 64 keys with softcap or ALiBi at 128 and 192
    assert specs.sm90_eligible("float16", 64, specs.ALL_MODS, backward=True)
    assert specs.sm90_eligible("float16", 128, specs.ALL_MODS & ~bits["window"], backward=True)
    for extra in (bits["bias"], bits["mask"]):
        assert not specs.sm90_eligible("float16", 128, bits["window"] | extra, backward=True)
    assert specs.sm90_eligible("float16", 128, score | bits["window"], backward=True, varlen=True)
    assert specs.sm90_eligible("float16", 136, bits["window"], backward=True)
    assert specs.sm90_backward_tile(64, bits["softcap"], tall=True) == (64, 128)  # the tall pass: no modifier
    for d, tile in ((64, (128, 128)), (128, (128, 64)), (192, (128, 64))):
        assert specs.sm90_eligible("float16", d, score | bits["window"], varlen=True)
        assert specs.sm90_forward_tile(d, score, varlen=True) == tile
    assert not specs.sm90_eligible("float16", 256, bits["alibi_slopes"], varlen=True)
    assert specs.sm90_eligible("float16", 256, bits["window"], varlen=True)
    # softcap and ALiBi keep the default tile, but neither FA3's wide block nor its 192 rows
    assert specs.sm90_forward_tile(128, score, wide=True) == specs.sm90_forward_tile(64, score, tall=True) == (128, 128)
    assert specs.sm90_forward_tile(64, bits["window"], tall=True) == (192, 128)
    assert specs.sm90_forward_tile(64, bits["mask"], tall=True) == (128, 64)


@pytest.mark.parametrize("order, dtype", [("ascending", "float16"), ("warp_skew", "bfloat16")])
@pytest.mark.parametrize("case", MODIFIED_CASES, ids=lambda c: f"D{c[5]}-" + "+".join(c[7]))
def test_the_hopper_forward_takes_every_modifier(rng, order, dtype, case):
    B, Sq, Sk, Hq, Hkv, D, causal, modifiers, tile = case
    q, k, v, dout, kw = _problem(rng, dtype, B, Sq, Sk, Hq, Hkv, D, causal=causal)
    kw.update(named_modifiers(rng, modifiers, B, Sq, Sk, Hq))
    names = []
    with emulated(order, compile=recording(names), compute_capability=HOPPER):
        out, lse = flashcupy.attention(q, k, v, return_lse=True, backend="cupy", **kw)
        grads = flashcupy.attention_backward(dout, q, k, v, out, lse, backend="cupy", **kw)
    ctype = "__half" if dtype == "float16" else "__nv_bfloat16"
    mods = specs.mods_of(m for m in kw if m in specs.MOD_BITS)
    assert names[0] == f"flash_fwd_sm90<{ctype}, {specs.tc_tile_row(D)}, {tile[0]}, {tile[1]}, {mods}>"
    assert specs.sm90_forward_tile(D, mods, causal) == tile
    assert any(name.startswith("flash_bwd_dkdv_sm90") for name in names) == specs.sm90_eligible(dtype, D, mods, True)
    assert_matches_oracle((out, lse, *grads), q, k, v, dout, backend="cupy", **kw)


# FA3's wide key blocks (cupy_backend.SM90_WIDE, off by default: specs.sm90_forward_tile): 176 keys at
# head_dim 128, out staged in Q_i's shared memory (flash_fwd_sm90.cu's O_IN_Q), 192 at 64; in the default
# grid and persistent on 1 or 2 SMs (a CTA's next Q_i then waits for its out to have left)
def wide():
    return mock.patch.object(cupy_backend, "SM90_WIDE", True)


WIDE_CASES = [  # (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim)
    (1, 200, 400, 2, 1, 128),  # GQA; three key blocks, the last of 48 keys: a stage of the ring reused
    (2, 17, 100, 1, 1, 96),    # one key block, short of 176; head_dim 96 in the 128 bucket
    (1, 300, 190, 1, 1, 128),  # three query tiles of two key blocks each
    (1, 140, 500, 2, 2, 64),   # 192 keys: three key blocks, the last of 116; two query tiles a head
]


@pytest.mark.parametrize("order, dtype", [("ascending", "float16"), ("warp_skew", "bfloat16"),
                                          ("descending", "float16")])
@pytest.mark.parametrize("case", WIDE_CASES, ids=lambda c: "x".join(str(x) for x in c))
def test_the_wide_key_block_matches_the_oracle(rng, order, dtype, case):
    q, k, v, _, kw = _problem(rng, dtype, *case)
    names = []
    grid, launch = persistent(SM_COUNTS[order])
    with wide(), launch, emulated(order, compile=recording(names), compute_capability=HOPPER, **grid):
        out, lse = flashcupy.attention(q, k, v, return_lse=True, backend="cupy", **kw)
    ctype = "__half" if dtype == "float16" else "__nv_bfloat16"
    bucket = specs.tc_tile_row(case[-1])
    assert names == [f"flash_fwd_sm90<{ctype}, {bucket}, 128, {specs.SM90_WIDE_FORWARD_TILES[bucket][1]}>"]
    assert_matches_oracle((out, lse), q, k, v, backend="cupy", **kw)


@pytest.mark.parametrize("head_dim, mods, causal, varlen, tile", [
    (128, 0, False, False, (128, 176)), (96, 0, False, False, (128, 176)),
    (64, 0, False, False, (128, 192)), (40, 0, False, False, (128, 192)),
    (128, 0, True, False, (128, 128)),             # causal
    (128, WINDOW, False, False, (128, 128)),  # the window
    (128, 0, False, True, (128, 128)),             # a packed batch (its kernel spilled at 176)
])
def test_the_wide_key_block_is_taken_where_it_applies(head_dim, mods, causal, varlen, tile):
    assert specs.sm90_forward_tile(head_dim, mods, causal, varlen, wide=True) == tile
    default = specs.SM90_FORWARD_TILES[specs.tc_tile_row(head_dim)]
    assert specs.sm90_forward_tile(head_dim, mods, causal, varlen) == default
    # and the kernel fits: 176 keys only with O_s in Q_s
    kernel = specs.sm90_forward_module("float16", head_dim, mods, varlen, tile).kernels[0]
    assert kernel.dynamic_smem <= specs.SM90_SMEM_OPTIN


# FA3's 192 query rows of the forward at head_dim 64 (cupy_backend.SM90_TALL_FORWARD, off by default:
# specs.sm90_forward_tile): three consumer warpgroups, the pingpong's turns round robin over them; in the
# default grid and persistent on 1 or 2 SMs (the turns carried from one tile to the next)
def tall_forward():
    return mock.patch.object(cupy_backend, "SM90_TALL_FORWARD", True)


TALL_FORWARD_CASES = [  # (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal, window)
    (1, 400, 300, 2, 1, 64, True, None),     # GQA, causal (bottom-right): three query tiles a head, the last of
                                             # 16 rows; tiles of 1 to 3 key blocks, the ring's stages reused
    (2, 17, 140, 1, 1, 40, False, None),     # head_dim 40 in the 64 bucket, batch 2; a tile of 17 rows: one
                                             # consumer's rows, the others' past seqlen_q
    (1, 200, 330, 1, 1, 64, False, (90, 20)),  # the window: key blocks outside the band never loaded
    (1, 130, 20, 1, 1, 64, True, None),      # causal: the first tile's rows before the diagonal see no key
]


@pytest.mark.parametrize("order, dtype", [("ascending", "float16"), ("warp_skew", "bfloat16"),
                                          ("descending", "float16")])
@pytest.mark.parametrize("case", TALL_FORWARD_CASES, ids=lambda c: "x".join(str(x) for x in c[:6])
                         + ("-causal" if c[6] else "") + (f"-w{c[7][0]}_{c[7][1]}" if c[7] else ""))
def test_the_tall_forward_tile_matches_the_oracle(rng, order, dtype, case):
    names, got, qkv, kw, mods = _forward_case(rng, order, dtype, case, tall_forward())
    ctype = "__half" if dtype == "float16" else "__nv_bfloat16"
    assert names == [f"flash_fwd_sm90<{ctype}, 64, 192, 128{f', {mods}' if mods else ''}>"]
    assert_matches_oracle(got, *qkv, backend="cupy", **kw)


@pytest.mark.parametrize("head_dim, mods, causal, varlen, wide, tile", [
    (64, 0, False, False, False, (192, 128)), (40, 0, True, False, False, (192, 128)),
    (64, WINDOW, False, False, False, (192, 128)),  # the window too
    (64, 0, False, False, True, (192, 128)),                 # before the wide block
    (64, 0, False, True, False, (128, 128)),                 # a packed batch: its kernel spilled in 160 registers
    (128, 0, False, False, False, (128, 128)),               # head_dim 128: two consumers
    (128, 0, False, False, True, (128, 176)),
])
def test_the_tall_forward_tile_is_taken_where_it_applies(head_dim, mods, causal, varlen, wide, tile):
    assert specs.sm90_forward_tile(head_dim, mods, causal, varlen, wide, tall=True) == tile
    kernel = specs.sm90_forward_module("float16", head_dim, mods, varlen, tile).kernels[0]
    assert kernel.dynamic_smem <= specs.SM90_SMEM_OPTIN


# FA3's 128-row pass of the backward at head_dim 64 (cupy_backend.SM90_TALL_BACKWARD, off by default:
# specs.sm90_backward_tile): Sᵀ, dPᵀ of 128 query columns, the owner's dQ_i as two wgmma Ms
def tall():
    return mock.patch.object(cupy_backend, "SM90_TALL_BACKWARD", True)


TALL_CASES = [  # (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal)
    (1, 300, 260, 2, 1, 64, True),    # GQA, causal (bottom-right): up to 6 passes a CTA, the ring reused
    (2, 140, 150, 1, 1, 40, False),   # head_dim 40 in the 64 bucket, batch 2; a last pass of 12 rows
    (1, 17, 300, 1, 1, 64, False),    # one pass of 17 rows; three key blocks, the last of 44 keys
]


@pytest.mark.parametrize("order, dtype", [("ascending", "float16"), ("warp_skew", "bfloat16"),
                                          ("descending", "float16")])
@pytest.mark.parametrize("case", TALL_CASES,
                         ids=lambda c: "x".join(str(x) for x in c[:6]) + ("-causal" if c[6] else ""))
def test_the_tall_backward_pass_matches_the_oracle(rng, order, dtype, case):
    *shape, causal = case
    q, k, v, dout, kw = _problem(rng, dtype, *shape, causal=causal)
    names = []
    with tall(), emulated(order, compile=recording(names), compute_capability=HOPPER):
        out, lse = flashcupy.attention(q, k, v, return_lse=True, backend="cupy", **kw)
        grads = flashcupy.attention_backward(dout, q, k, v, out, lse, backend="cupy", **kw)
    tile = specs.SM90_TALL_BACKWARD_TILES[64]
    assert specs.sm90_backward_module(dtype, shape[-1], tile=tile).kernels[1].name_expression in names
    assert_matches_oracle((out, lse, *grads), q, k, v, dout, backend="cupy", **kw)


@pytest.mark.parametrize("head_dim, mods, tile", [
    (64, 0, (128, 128)), (40, 0, (128, 128)),
    (64, WINDOW, (64, 128)),   # the window: at 128 rows its masked passes spilled
    (128, 0, (64, 128)),                # head_dim 128 keeps FA3's 64 x 128
])
def test_the_tall_pass_is_taken_where_it_applies(head_dim, mods, tile):
    assert specs.sm90_backward_tile(head_dim, mods, tall=True) == tile
    assert specs.sm90_backward_tile(head_dim, mods) == specs.SM90_BACKWARD_TILES[specs.tc_tile_row(head_dim)]
    for varlen in (False, True):
        kernel = specs.sm90_backward_module("float16", head_dim, mods, varlen, tile=tile).kernels[1]
        assert kernel.dynamic_smem <= specs.SM90_SMEM_OPTIN


# ----------------------------------------------------------------------------
# each barrier, wait and fence is needed


# The synchronisation of the Hopper kernels, found in their text: each call removed in turn must give a
# wrong answer or an emulator error (KernelError: a proxy, wgmma, mbarrier or bulk-group misuse;
# DeadlockError: a wait that can never end) under some thread order. wgmma_fence_operand is no instruction (it keeps the compiler
# from moving register accesses across a wait), so the emulator cannot miss it and it is not listed.
SYNC = re.compile(r"\b(?:__syncthreads\(\)|mbarrier_wait_parity\([^;]*\)|mbarrier_arrive\([^;]*\)|"
                  r"mbarrier_init_fence\(\)|wgmma_fence\(\)|wgmma_wait_group<\d+>\(\)|wgmma_commit_group\(\)|"
                  r"fence_proxy_async\(\)|named_barrier_sync\([^;]*\)|named_barrier_arrive\([^;]*\)|"
                  r"tma_store_wait_group_read<\d+>\(\)|tma_store_commit_group\(\)|tma_store_wait_group<\d+>\(\)|"
                  r"fence_proxy_async_global\(\)|flag_wait_at_least\([^;]*\)|flag_release_add\([^;]*\));")


def _calls(kernel):
    """(line number, call) of every synchronisation call in kernels/`kernel`."""
    with open(f"{sources.KERNEL_DIR}/{kernel}", encoding="utf-8") as f:
        return [(n, m.group(0)) for n, line in enumerate(f, 1) for m in [SYNC.search(line.split("//")[0])] if m]


def _name(call):
    return re.split(r"[(<]", call)[0]


def _line(kernel, n):
    with open(f"{sources.KERNEL_DIR}/{kernel}", encoding="utf-8") as f:
        return f.read().splitlines()[n - 1]


def _tagged(kernel, n, tag):
    """Whether line n of kernels/`kernel`, or the comment line just above it, carries `tag`."""
    with open(f"{sources.KERNEL_DIR}/{kernel}", encoding="utf-8") as f:
        lines = f.read().splitlines()
    return tag in lines[n - 1] or tag in lines[n - 2]


# "[pingpong]", the consumers' turns, are not about ordering: a schedule for the tensor cores, so removing
# them changes no result and the emulator cannot see it (only a GPU's timing shows it). "[registers]": a
# wgmma commit and wait that free registers before more accumulators are live (removed, ptxas serialises
# the wgmma pipeline: test_a_wait_for_registers_is_needed checks that with NVRTC), and which the stage's
# release follows too: each is also a sync point below. "[deterministic]": the ordered dQ of the
# deterministic backward (DETERMINISTIC), which the runs below do not compile:
# test_each_step_of_the_ordered_dq_is_needed removes each of them.
REGISTERS, PINGPONG, DETERMINISTIC = "[registers]", "[pingpong]", "[deterministic]"
SYNC_POINTS = [(kernel, n) for kernel in KERNELS for n, call in _calls(kernel)
               if not any(_tagged(kernel, n, tag) for tag in (PINGPONG, DETERMINISTIC))]
ORDERED_DQ_POINTS = [n for n, call in _calls("flash_bwd_sm90.cu") if DETERMINISTIC in _line("flash_bwd_sm90.cu", n)]
REGISTER_POINTS = [(kernel, n) for kernel in KERNELS for n, call in _calls(kernel) if _tagged(kernel, n, REGISTERS)]
# forward: 2 query blocks, 3 key blocks; backward: 3 key blocks, 3 passes: both rings' stages reused.
# Then two tiles of one key block each: the producer reaches the second tile's Q_i before the consumers
# wait for the first's (a load lands when its barrier is waited on, with every load pending on it). Then
# a tile that sees keys and two that see none (causal, Sq > Sk), taken after it by the same CTA
SYNC_PROBLEMS = ((1, 130, 260, 1, 1, 64, True), (1, 256, 128, 1, 1, 64, False), (1, 300, 40, 1, 1, 64, True))
# Then the wide key block's (O_IN_Q: out staged in Q_s), three tiles in one CTA: a Q_i loaded before the
# tile before's out has left would be stored in its place. Then the backward's tall pass (128 rows): 3
# passes a key block, the ring's stages reused
WIDE_SYNC_PROBLEM = (1, 300, 190, 1, 1, 128, False)
TALL_SYNC_PROBLEM = (1, 260, 130, 1, 1, 64, False)
# The backward's SPLIT_D (the 256 kernel) runs on its own problem: 3 key blocks, 3 passes each through the one
# stage, at head_dim 192, so that the fourth atom is zeroed (not loaded) too; a call of its loop or of that
# zeroing is checked on it alone (the problems above reach neither)
SPLIT_SYNC_PROBLEM = (1, 150, 140, 1, 1, 192, False)


def _split_lines():
    """The line numbers of flash_bwd_sm90.cu's SPLIT_D loop and of its zeroing of the atoms not loaded."""
    with open(f"{sources.KERNEL_DIR}/flash_bwd_sm90.cu", encoding="utf-8") as f:
        lines = f.read().splitlines()
    first = lines.index("    if constexpr (SPLIT_D)") + 1
    (zeros,) = [n for n, line in enumerate(lines, 1)
                if line.startswith("    if (SPLIT_D && min(atoms_qk, atoms_v) < HEAD_DIM / ATOM)")]
    last = lines.index("    if constexpr (!SPLIT_D)") + 1
    return [*range(zeros, lines.index("    }", zeros) + 1), *range(first, last)]


SPLIT_LINES = _split_lines()


def test_the_sync_points_are_found():
    assert len(REGISTER_POINTS) == 2
    pingpong = [(k, n) for k in KERNELS for n, call in _calls(k) if _tagged(k, n, PINGPONG)]
    assert [_name(call) for k, n in pingpong for m, call in _calls(k) if m == n] == ["named_barrier_sync"]
    for kernel in KERNELS:
        names = [_name(call) for _, call in _calls(kernel)]
        assert {"mbarrier_wait_parity", "mbarrier_arrive", "wgmma_fence", "wgmma_wait_group", "wgmma_commit_group",
                "fence_proxy_async", "named_barrier_sync"} <= set(names), kernel
        assert {"__syncthreads", "mbarrier_init_fence"} <= set(names), kernel
    assert {"tma_store_commit_group", "tma_store_wait_group_read"} <= {_name(call) for _, call in _calls(KERNELS[0])}
    ordered = [_name(call) for n, call in _calls("flash_bwd_sm90.cu") if n in ORDERED_DQ_POINTS]
    assert ordered == ["tma_store_wait_group", "fence_proxy_async_global", "flag_release_add",
                       "flag_wait_at_least", "fence_proxy_async_global"]


def _without(kernel, lineno, tmp_path, pattern=SYNC, replacement=";"):
    """(the call, the kernel's source, the same with the call on line `lineno` of kernels/`kernel` replaced)."""
    mutant_dir = tmp_path / "kernels"
    shutil.copytree(sources.KERNEL_DIR, mutant_dir)
    lines = (mutant_dir / kernel).read_text(encoding="utf-8").splitlines(keepends=True)
    call = pattern.search(lines[lineno - 1]).group(0)
    lines[lineno - 1] = lines[lineno - 1].replace(call, replacement, 1)
    (mutant_dir / kernel).write_text("".join(lines), encoding="utf-8")
    with mock.patch.object(sources, "KERNEL_DIR", str(mutant_dir)):
        mutant = sources.read_source(kernel)
    return call, sources.read_source(kernel), mutant


# and a packed batch's backward (VARLEN: the rows of a box past its sequence zeroed), both sequences'
# last key block and last query block reaching into the next sequence (or past the tensor's end), with
# the default pass and the tall one; the first sequence's first pass without a tail, so that the zeroed
# keys' fence and barrier are the only ones before its wgmma
PACKED_SYNC_PROBLEM = ([140, 50], [150, 40])


def _bitten(rng, mutants, orders=("ascending", "descending", "warp_skew"), eager=("ascending",),
            split=False) -> list:
    """The thread orders (the first, and its error) under which the forward and backward, with the kernel
    sources in `mutants` ({original: mutant}) compiled as their mutants, miss the oracle or make the
    emulator report an error, or a packed batch's (PACKED_SYNC_PROBLEM).
    `orders` with the TMA loads landing at their waits, then `eager` with them landing at issue (and each
    wgmma wait letting the other threads run first: a stage released before its wgmma has landed).
    split: SPLIT_SYNC_PROBLEM's alone. Every problem under the first order, then every problem under the
    next: 80 of the 84 sync points' mutants were caught by the first run of the first problem that reaches
    their line, so going breadth-first reaches the wide, tall and packed problems' lines soonest."""
    runs = [(order, "deferred") for order in orders] + [(order, "eager") for order in eager]
    def compile(source, names, options, thread_order, seed, cp_async):
        return compile_module(mutants.get(source, source), names, options, thread_order, seed, cp_async)

    def dense(problem, tile):
        B, Sq, Sk, Hq, Hkv, D, causal = problem
        q, k, v = make_qkv(rng, B, Sq, Sk, Hq, Hkv, D, np.float16)
        dout = rng.standard_normal(q.shape).astype(np.float16)

        def check(order, cp_async):
            grid, launch = persistent(1)  # both forward tiles in one CTA
            with tile(), launch, emulated(order, compile=compile, compute_capability=HOPPER, cp_async=cp_async,
                                          **grid):
                out, lse = flashcupy.attention(q, k, v, causal=causal, return_lse=True, backend="cupy")
                grads = flashcupy.attention_backward(dout, q, k, v, out, lse, causal=causal, backend="cupy")
                assert_matches_oracle((out, lse, *grads), q, k, v, dout, causal=causal, backend="cupy")
        return check

    def packed(tile):
        def check(order, cp_async):
            with tile(), emulated(order, compile=compile, compute_capability=HOPPER, cp_async=cp_async):
                packed_batch_matches_the_oracle(rng, "cupy", PACKED_SYNC_PROBLEM, np.float16, 64, (1, 1),
                                                dict(causal=False), backward=True)
        return check

    if split:
        checks = [dense(SPLIT_SYNC_PROBLEM, contextlib.nullcontext)]
    else:
        checks = ([dense(problem, contextlib.nullcontext) for problem in SYNC_PROBLEMS]
                  + [dense(WIDE_SYNC_PROBLEM, wide), dense(TALL_SYNC_PROBLEM, tall)]
                  + [packed(contextlib.nullcontext), packed(tall)])
    for order, cp_async in runs:
        for check in checks:
            try:
                check(order, cp_async)
            except (AssertionError, emulator.EmulatorError) as e:
                return [(order, cp_async, type(e).__name__)]
    return []


# Every sync point and step of the ordered dQ in one guarded source a kernel file (sync_mutants.py): a
# point's mutant is the guarded source with $FLASHCUPY_TEST_MUTANT its place in MUTANT_POINTS
MUTANT_POINTS = (*SYNC_POINTS, *(("flash_bwd_sm90.cu", n) for n in ORDERED_DQ_POINTS))


def _mutant(monkeypatch, kernel, lineno) -> dict:
    """{original: guarded} of `kernel`, with the call on its line `lineno` chosen to be left out."""
    n = MUTANT_POINTS.index((kernel, lineno)) + 1
    monkeypatch.setenv(sync_mutants.ENV, str(n))
    reached = sync_mutants.reached(sync_mutants.guarded(MUTANT_POINTS, SYNC), n)
    assert list(reached) == [kernel]
    return dict(reached.values())


def test_the_guarded_kernels_pass_with_no_call_left_out(rng, monkeypatch):
    # each problem of _bitten's, under one order: the guards chose no call, so every kernel is the original
    monkeypatch.delenv(sync_mutants.ENV, raising=False)
    guarded = dict(sync_mutants.guarded(MUTANT_POINTS, SYNC).values())
    assert len(guarded) == len(KERNELS)
    assert _bitten(rng, guarded, orders=("ascending",), eager=()) == []
    assert _bitten(rng, guarded, orders=("ascending",), eager=(), split=True) == []
    # and the ordered dQ's (DETERMINISTIC), which those do not compile: the same bits as the original's
    want, _ = _ordered_backward("ascending", ORDERED_CASES[0])
    got, _ = _ordered_backward("descending", ORDERED_CASES[0],
                               compile=lambda source, *args: compile_module(guarded.get(source, source), *args))
    assert _same_bits(got, want)


@pytest.mark.parametrize("kernel, lineno", SYNC_POINTS, ids=[f"{k}:{n}" for k, n in SYNC_POINTS])
def test_each_barrier_wait_and_fence_is_needed(rng, monkeypatch, kernel, lineno):
    split = kernel == "flash_bwd_sm90.cu" and lineno in SPLIT_LINES
    assert _bitten(rng, _mutant(monkeypatch, kernel, lineno), split=split), \
        f"removing {_line(kernel, lineno).strip()} on {kernel}:{lineno} went unnoticed under every order"


def test_the_wait_for_registers_is_needed(tmp_path):
    # the commit and the wait of the backward's dV, dK wgmma, removed together (one without the other
    # changes nothing): dQ's accumulators are then live beside theirs and ptxas serialises the pipeline
    from flashcupy.tools import nvrtc

    (kernel,) = {k for k, _ in REGISTER_POINTS}
    mutant_dir = tmp_path / "kernels"
    shutil.copytree(sources.KERNEL_DIR, mutant_dir)
    lines = (mutant_dir / kernel).read_text(encoding="utf-8").splitlines(keepends=True)
    for _, n in REGISTER_POINTS:
        lines[n - 1] = lines[n - 1].replace(SYNC.search(lines[n - 1]).group(0), ";", 1)
    (mutant_dir / kernel).write_text("".join(lines), encoding="utf-8")
    with mock.patch.object(sources, "KERNEL_DIR", str(mutant_dir)):
        mutant = sources.read_source(kernel)
    (module,) = [m for m in catalog.sm90_modules() if m.source_file == kernel and m.kernels[1].head_dim == 128
                 and not m.kernels[1].varlen and not m.kernels[1].deterministic
                 and m.kernels[1].dtype == "float16" and not m.kernels[1].mods]
    try:
        toolkit = nvrtc.cupy_toolkit()
    except nvrtc.NvrtcError as e:
        pytest.skip(f"no NVRTC: {e}")
    options = sources.arch_options(specs.SM90_ARCH) + (f"-I{toolkit.include}", "-Xptxas=-v")
    log, _, _ = nvrtc.compile_cubin(mutant, module.name_expressions[1:2], options, toolkit)
    assert re.search(r"C751\d.*serialized", log), "without the wait for registers ptxas still pipelines the wgmma"


def test_a_dropped_dq_reduction_is_caught(rng, tmp_path):
    reduce = re.compile(r"bulk_reduce_add_f32\(tile, dQ_s, DQ_BYTES\);")
    (lineno,) = [n for n, line in enumerate(open(f"{sources.KERNEL_DIR}/flash_bwd_sm90.cu", encoding="utf-8"), 1)
                 if reduce.search(line)]
    # the owner's reduce-add of one pass in two dropped (odd passes: the second consumer's): half of the
    # key blocks' and heads' parts of dQ are lost, the dK, dV and forward are unchanged
    _, original, mutant = _without("flash_bwd_sm90.cu", lineno, tmp_path, reduce,
                                   "if (c == 0) bulk_reduce_add_f32(tile, dQ_s, DQ_BYTES);")
    assert _bitten(rng, {original: mutant}, orders=("ascending",))


def test_a_stage_released_before_its_wgmma_lands_is_caught(rng, tmp_path):
    # the backward's empty[s] arrived on before the wait for the dV and dK wgmma that read Q_i and dO_i:
    # the producer may refill the stage while they run. With the loads landing at their waits nothing
    # overwrites the stage in time (the consumer runs from the arrive to its wait unscheduled); landing at
    # issue, with the wgmma wait letting the producer run first, the dV and dK wgmma read the next tile
    arrive = re.compile(r"mbarrier_arrive\(&empty\[s\]\);  // this thread's wgmma")
    (lineno,) = [n for n, line in enumerate(open(f"{sources.KERNEL_DIR}/flash_bwd_sm90.cu", encoding="utf-8"), 1)
                 if arrive.search(line)]
    _, original, released_late = _without("flash_bwd_sm90.cu", lineno, tmp_path, re.compile(r"mbarrier_arrive[^;]*;"))
    wait = re.compile(r"wgmma_wait_group<0>\(\);  // \[registers\]")
    (lineno,) = [n for n, line in enumerate(released_late.splitlines(), 1) if wait.search(line)]
    lines = released_late.splitlines(keepends=True)
    early = "mbarrier_arrive(&empty[s]); wgmma_wait_group<0>();"
    lines[lineno - 1] = lines[lineno - 1].replace("wgmma_wait_group<0>();", early)
    mutant = "".join(lines)
    assert _bitten(rng, {original: mutant}, orders=(), eager=("ascending",))


def test_the_second_ds_buffer_is_needed(rng, tmp_path):
    # dS_s's two buffers (a pass's by its parity) let pass p's owner store its dSᵀ rows while the other
    # consumer's dQ wgmma of pass p - 1 still reads the other buffer: with one buffer for every pass (and
    # no barrier in its place) those stores overwrite what that wgmma reads (the emulator reports the
    # wgmma's read of a byte stored since its issue without a barrier between)
    store = re.compile(r"dS_s \+ \(owner \? c : 1 - c\) \* SM90_CONSUMERS \* DS_BYTES \+ ")
    (lineno,) = [n for n, line in enumerate(open(f"{sources.KERNEL_DIR}/flash_bwd_sm90.cu", encoding="utf-8"), 1)
                 if store.search(line)]
    _, original, mutant = _without("flash_bwd_sm90.cu", lineno, tmp_path, store, "dS_s + ")
    own = re.compile(r"dS_own = dS_s \+ c \* SM90_CONSUMERS \* DS_BYTES;")
    assert own.search(mutant)
    mutant = own.sub("dS_own = dS_s;", mutant)
    assert _bitten(rng, {original: mutant})


# ----------------------------------------------------------------------------
# deterministic=True: each dQ tile's adds in key-block order (flash_bwd_sm90.cu's DETERMINISTIC)


# Somewhere each sees a query block with three or more key blocks (of 128 keys) adding into its tile:
# float32 sums of three parts or more round differently in another order (two commute, into zeros)
ORDERED_CASES = [
    (1, 200, 400, 2, 1, 64, False, None),       # GQA: a CTA's passes over two query heads' tiles
    (1, 300, 420, 1, 1, 128, True, None),       # causal, bottom-right: the last query blocks see 4 key blocks
    (1, 260, 520, 1, 1, 64, False, (300, 20)),  # the window: the first key block of a band (key_start) not 0
    ([150, 40], [330, 60]),                     # a packed batch: the slots' order, descending key blocks
    (1, 130, 260, 1, 1, 160, True, None),       # SPLIT_D (three atoms loaded): consumer 0's lead adds, 5 key blocks
]


def _ordered_backward(order, case, deterministic=True, compile=compile_module):
    """The backward of `case` (dq, dk, dv) on the emulated H100 in `order`, with what the oracle needs."""
    rng = np.random.default_rng(5)
    with emulated(order, compile=compile, compute_capability=HOPPER):
        if len(case) == 2:  # a packed batch
            q, k, v, cu_q, cu_k = packed_inputs(rng, *case, 1, 1, 64, np.float16)
            dout = rng.standard_normal(q.shape).astype(np.float16)
            out, lse = flashcupy.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, backend="cupy")
            grads = flashcupy.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, backend="cupy",
                                                        deterministic=deterministic)
            return grads, None
        B, Sq, Sk, Hq, Hkv, D, causal, window = case
        q, k, v = make_qkv(rng, B, Sq, Sk, Hq, Hkv, D, np.float16)
        dout = rng.standard_normal(q.shape).astype(np.float16)
        kw = dict(causal=causal, window=window)
        out, lse = flashcupy.attention(q, k, v, return_lse=True, backend="cupy", **kw)
        grads = flashcupy.attention_backward(dout, q, k, v, out, lse, backend="cupy", deterministic=deterministic,
                                             **kw)
    return grads, ((out, lse, *grads), q, k, v, dout, kw)


def _same_bits(a, b):
    return all((x.view(np.uint16) == y.view(np.uint16)).all() for x, y in zip(a, b))


@pytest.mark.parametrize("case", ORDERED_CASES, ids=["gqa", "causal", "window", "packed", "split"])
def test_the_deterministic_hopper_backward_is_the_same_bits_in_every_block_order(case):
    # descending and shuffled: CTAs park at their turn and resume once the key blocks before them added
    names = []
    want, oracle = _ordered_backward("ascending", case, compile=recording(names))
    dkdv = {name for name in names if name.startswith("flash_bwd_dkdv_sm90")}
    # <.., MODS, VARLEN, DETERMINISTIC>: DETERMINISTIC set, whether a packed batch or not
    assert dkdv and all(re.search(r", (true|false), true>$", name) for name in dkdv), dkdv
    if oracle is not None:
        got, q, k, v, dout, kw = oracle
        assert_matches_oracle(got, q, k, v, dout, backend="cupy", **kw)
    else:  # each sequence of the packed batch, deterministic, against the oracle
        with emulated(compute_capability=HOPPER):
            packed_batch_matches_the_oracle(np.random.default_rng(5), "cupy", case, np.float16, 64, (1, 1),
                                            dict(causal=False), backward=True, deterministic=True)
    for order in ("descending", "shuffled", "warp_skew"):
        assert _same_bits(_ordered_backward(order, case)[0], want), order
    # the check can fail: without the order the CTAs add in the order the blocks run
    assert not _same_bits(_ordered_backward("descending", case, deterministic=False)[0][:1], want[:1])


def test_the_tall_deterministic_backward_is_the_same_bits_in_every_block_order():
    names = []
    with tall():
        want, (got, q, k, v, dout, kw) = _ordered_backward("ascending", ORDERED_CASES[0], compile=recording(names))
        assert_matches_oracle(got, q, k, v, dout, backend="cupy", **kw)
        for order in ("descending", "warp_skew"):
            assert _same_bits(_ordered_backward(order, ORDERED_CASES[0])[0], want), order
    tile = specs.SM90_TALL_BACKWARD_TILES[64]
    assert specs.sm90_backward_module("float16", 64, deterministic=True, tile=tile).kernels[1].name_expression in names


@pytest.mark.parametrize("lineno", ORDERED_DQ_POINTS)
def test_each_step_of_the_ordered_dq_is_needed(monkeypatch, lineno):
    # without the wait: dQ in the blocks' order; without a fence or the completion: the emulator's proxy
    # checks of the release and the add; without the release: the later key blocks' turns never come
    mutants = _mutant(monkeypatch, "flash_bwd_sm90.cu", lineno)

    def compile(source, *args):
        return compile_module(mutants.get(source, source), *args)

    want, _ = _ordered_backward("ascending", ORDERED_CASES[0])
    try:
        got, _ = _ordered_backward("descending", ORDERED_CASES[0], compile=compile)
    except (emulator.KernelError, emulator.DeadlockError):
        return
    call = _line("flash_bwd_sm90.cu", lineno).strip()
    assert not _same_bits(got, want), f"removing {call} on flash_bwd_sm90.cu:{lineno} went unnoticed"


# ----------------------------------------------------------------------------
# the tensor maps kept between calls (a GPU's Runtime: tensor_map_cache)


def test_a_tensor_map_is_made_once_an_address_shape_and_box(rng):
    # the emulator's maps hold their array, so its Runtime keeps none; given a cache, the same arrays'
    # maps are made once, and another address, or CACHE_HOST_WORK off, makes them again
    q, k, v = make_qkv(rng, 1, 70, 130, 2, 1, 64, np.float16)
    dout = rng.standard_normal(q.shape).astype(np.float16)
    with emulated(compute_capability=HOPPER) as rt:
        assert rt.tensor_map_cache is None
        out, lse = flashcupy.attention(q, k, v, return_lse=True, backend="cupy")
        made, encode = [], rt.tensor_map
        rt.tensor_map = lambda x, arguments, dtype_name: made.append(x.shape) or encode(x, arguments, dtype_name)
        rt.tensor_map_cache = {}
        grads = [flashcupy.attention_backward(dout, q, k, v, out, lse, backend="cupy")]
        assert len(made) == 4  # q, k, v, dout
        grads.append(flashcupy.attention_backward(dout, q, k, v, out, lse, backend="cupy"))
        assert len(made) == 4
        other = q.copy()  # another address: its map made again, the others kept
        grads.append(flashcupy.attention_backward(dout, other, k, v, out, lse, backend="cupy"))
        assert len(made) == 5
        with mock.patch.object(cupy_backend, "CACHE_HOST_WORK", False):
            grads.append(flashcupy.attention_backward(dout, q, k, v, out, lse, backend="cupy"))
        assert len(made) == 9
    assert_matches_oracle((out, lse, *grads[0]), q, k, v, dout, backend="cupy")
    for again in grads[1:]:
        assert _same_bits(again, grads[0])


# Rows that see no key (lse -inf) inside a pass: the Hopper backward's passes start at a multiple of BLOCK_M,
# before the first row that sees the key block (causal or a window with seqlen_q > seqlen_k), and the bool
# mask can hide any row. Their dout may hold anything (README: fully masked rows): warp 1 gives them D 0 and
# marks the stage (dead_rows), and the consumers zero their rows of dO_i before any wgmma reads it. Each of
# those steps removed in turn must leave a NaN or a wrong gradient under some order.
DEAD_ROW_STEPS = {
    "the mark's reset before the lanes' marks": ("__syncwarp();  // lane 0's reset", ";  //"),
    "dO_i's rows zeroed": ("zero_rows_if<BLOCK_M, HEAD_DIM>(dO_s", "if (0) zero_rows_if<BLOCK_M, HEAD_DIM>(dO_s"),
    "D 0": ("i < seqlen_q && !dead ?", "i < seqlen_q ?"),
}


def _dead_rows_run(rng, order, compile=compile_module):
    """The cases: causal with Sq > Sk (the rows before Sq - Sk see nothing), with and without a window (the
    default kernel's P_UNDER_DP and the window's), and one row the mask hides, in a lane other than 0's;
    each with NaN in those rows' dout: no NaN in dq, dk, dv, dq 0 in those rows, and the oracle's values."""
    mask = rng.random((2, 2, 70, 90)) < 0.9
    mask[1, 0, 5] = False  # row 5 of head 0: lane 5 of warp 1 marks it
    cases = [(1, 150, 40, 64, dict(causal=True)), (1, 150, 40, 64, dict(causal=True, window=(30, 0))),
             (2, 70, 90, 64, dict(mask=mask)), (1, 150, 40, 256, dict(causal=True))]  # and SPLIT_D's
    for B, Sq, Sk, D, kw in cases:
        q, k, v = make_qkv(rng, B, Sq, Sk, 2, 1, D, np.float16)
        dout = rng.standard_normal(q.shape).astype(np.float16)
        names = []
        with emulated(order, compile=recording(names, compile), compute_capability=HOPPER):
            out, lse = flashcupy.attention(q, k, v, return_lse=True, backend="cupy", **kw)
            dead = ~np.isfinite(lse).transpose(0, 2, 1)  # (batch, seqlen_q, heads_q)
            assert dead.any()
            dout[dead] = np.nan
            grads = flashcupy.attention_backward(dout, q, k, v, out, lse, backend="cupy", **kw)
        assert any(name.startswith("flash_bwd_dkdv_sm90") for name in names)
        assert not any(np.isnan(g).any() for g in grads) and (grads[0][dead] == 0).all()
        assert_matches_oracle((out, lse, *grads), q, k, v, np.nan_to_num(dout), backend="cupy", **kw)


def test_rows_that_see_no_key_add_nothing_on_the_hopper_backward(rng):
    for order in ("ascending", "descending"):
        _dead_rows_run(rng, order)


@pytest.mark.parametrize("step", DEAD_ROW_STEPS)
def test_each_step_for_rows_that_see_no_key_is_needed(rng, step):
    text, replacement = DEAD_ROW_STEPS[step]
    original = sources.read_source("flash_bwd_sm90.cu")
    assert original.count(text) == 1
    mutant = original.replace(text, replacement)

    def compile(source, *args):
        return compile_module(mutant if source == original else source, *args)

    failures = []
    for order in ("ascending", "descending"):
        try:
            _dead_rows_run(rng, order, compile)
        except (AssertionError, emulator.EmulatorError) as e:
            failures.append((order, type(e).__name__))
    assert failures, f"without {step} every row's gradients were still right"
