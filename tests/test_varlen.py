"""Packed variable-length batches and KV caches: each sequence against the oracle on it alone, and
hostile offsets and block tables refused before anything is read or written."""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from conftest import BF16, assert_matches_oracle, bf16_bits, bf16_ties
from modifier_checks import LARGE_SCALES
from varlen_checks import (appended_rows, appends_across_a_block_boundary, cache_inputs,
                           packed_batch_matches_the_oracle, packed_inputs, per_sequence_alibi_in_a_kvcache,
                           split_cache_parts_round_once)

import flashcupy


# (query lengths, key lengths): empty sequences, Sq > Sk and Sq < Sk under causal, a single token
LENGTHS = [([5, 0, 9, 1, 13], [5, 3, 4, 7, 20]), ([1, 1, 1], [17, 1, 0])]


MODS = {"plain": dict(), "causal": dict(causal=True),
        "causal-window-alibi": dict(causal=True, window=(3, None), alibi_slopes="per-seq"),
        "window-softcap": dict(window=(2, 1), softcap=3.0)}


@pytest.fixture(params=[None, 6, 0], ids=["grouped", "grouped-and-one-call-each", "one-call-each"])
def short(request):
    """The NumPy backend's packed.SHORT for the test: the default (every sequence here in a group), 6
    (the longer ones a call each) and 0 (no groups)."""
    from flashcupy.backends.numpy_backend import config
    saved, config.SHORT = config.SHORT, request.param
    yield request.param
    config.SHORT = saved


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("mods", MODS.values(), ids=MODS.keys())
@pytest.mark.parametrize("lengths", LENGTHS, ids=["mixed", "decode-like"])
def test_each_sequence_is_attention_on_it_alone(rng, lengths, mods, dtype, short):
    lengths_q, lengths_k = lengths
    q, k, v, cu_q, cu_k = packed_inputs(rng, lengths_q, lengths_k, 4, 2, 8, dtype)
    mods = dict(mods)
    batch = len(lengths_q)
    if mods.get("alibi_slopes") == "per-seq":
        mods["alibi_slopes"] = rng.uniform(0.1, 1, (batch, 4)).astype(np.float32)
    dout = rng.standard_normal(q.shape).astype(dtype)
    out, vjp = flashcupy.attention_varlen_vjp(q, k, v, cu_q, cu_k, **mods)
    _, lse = flashcupy.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **mods)
    dq, dk, dv = vjp(dout)
    assert lse.shape == (4, q.shape[0])
    for b in range(batch):
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        one = dict(mods)
        if one.get("alibi_slopes") is not None:
            one["alibi_slopes"] = one["alibi_slopes"][b]
        got = (out[None, sq], lse[None, :, sq], dq[None, sq], dk[None, sk], dv[None, sk])
        assert_matches_oracle(got, q[None, sq], k[None, sk], v[None, sk], dout[None, sq], backend="numpy", **one)


def test_short_sequences_run_in_groups_not_calls(rng, monkeypatch):
    # many short sequences (empty ones too) on the NumPy backend: no call of their own, forward or
    # backward (packed.py's groups), each against the oracle with GQA, a window, the softcap, ALiBi
    # per sequence, dropout drawn as batch b's, bfloat16 bits, and a gradient of lse that is NaN in the
    # rows that see no key (their dout too); the groups' padded scores within WASTE and GROUP_SCORES
    from flashcupy import _api
    from flashcupy.backends.numpy_backend import packed
    lengths_q, lengths_k = (rng.integers(0, 24, 60) for _ in range(2))
    q, k, v, cu_q, cu_k = packed_inputs(rng, lengths_q, lengths_k, 4, 2, 8, BF16)
    q, k, v = map(bf16_bits, (q, k, v))
    kw = dict(causal=True, window=(5, None), softcap=2.5, alibi_slopes=rng.uniform(0.1, 1, (60, 4)).astype(np.float32),
              dropout_p=0.2, dropout_seed=11, dtype="bfloat16")
    calls = []
    for name in ("forward", "backward"):
        monkeypatch.setattr(_api, name, lambda *a, _fn=getattr(_api, name), **k: calls.append(1) or _fn(*a, **k))
    out, lse = flashcupy.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, backend="numpy", **kw)
    dout = bf16_bits(rng.standard_normal(out.shape).astype(BF16))
    dout[np.isneginf(lse).T] = bf16_bits(np.array(np.nan, BF16))  # rows that see no key: NaN dout and dlse
    dlse = np.where(np.isneginf(lse), np.nan, rng.standard_normal(lse.shape)).astype(np.float32)
    grads = flashcupy.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, backend="numpy", dlse=dlse, **kw)
    together = packed.together(cu_q, cu_k)
    # a sequence without keys: the forward's call (out 0, lse -inf, no backend work); the backward's zeros
    assert len(calls) == int(np.sum((lengths_q > 0) & (lengths_k == 0)))
    assert set(together.tolist()) == set(np.flatnonzero((lengths_q > 0) & (lengths_k > 0)).tolist())
    for group in packed.groups(together, cu_q, cu_k, 4):
        Sq, Sk = lengths_q[group], lengths_k[group]
        padded = len(group) * Sq.max() * Sk.max()
        assert len(group) == 1 or (padded <= packed.WASTE * np.sum(Sq * Sk) and padded * 4 <= packed.GROUP_SCORES)
    for b in range(60):
        one = dict(kw, alibi_slopes=kw["alibi_slopes"][b])
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if rows.start == rows.stop:
            continue
        got = (out[rows], lse[:, rows], grads[0][rows], grads[1][keys], grads[2][keys])
        assert_matches_oracle(tuple(x[None] for x in got), q[None, rows], k[None, keys], v[None, keys],
                              dout[None, rows], backend="numpy", dlse=dlse[None, :, rows], dropout_origin=(b, 0, 0, 0),
                              **{n: x for n, x in one.items() if n != "dropout_origin"})


@pytest.mark.parametrize("dtype, scale", LARGE_SCALES, ids=[f"{np.dtype(d).name}-{s:g}" for d, s in LARGE_SCALES])
def test_large_scores_in_a_packed_batch(dtype, scale):
    # issue 31's shapes (inputs of 0.5, a scale that puts the scores' rounding past 1) as three sequences of
    # a packed batch, which the NumPy backend runs in a group: P recomputed from lse clamped to at most 1,
    # so the gradients stay finite and within the tolerance, as on every other path
    for seed in range(4):
        rng = np.random.default_rng(seed)
        lengths_q, lengths_k = [6, 3, 6], [7, 7, 2]
        q, k, v, cu_q, cu_k = packed_inputs(rng, lengths_q, lengths_k, 1, 1, 4, dtype)
        q, k, v = (0.5 * x for x in (q, k, v))
        dout = (0.5 * rng.standard_normal(q.shape)).astype(dtype)
        out, lse = flashcupy.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, backend="numpy", scale=scale)
        grads = flashcupy.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, backend="numpy",
                                                    scale=scale)
        for b in range(3):
            rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
            got = (out[rows], lse[:, rows], grads[0][rows], grads[1][keys], grads[2][keys])
            assert_matches_oracle(tuple(x[None] for x in got), q[None, rows], k[None, keys], v[None, keys],
                                  dout[None, rows], backend="numpy", scale=scale)


def test_the_emulated_cupy_backend_takes_packed_batches_too(rng):
    from flashcupy.tools.emulator.cupy import emulated
    with emulated():
        packed_batch_matches_the_oracle(rng, "cupy")


def test_a_turing_gpu_takes_packed_float16_batches_on_the_tensor_cores(rng):
    # Turing's tiles and tensor_core.cuh's stand-ins (tests/test_tensor_core.py's Turing test) for a packed
    # batch with the window, softcap and ALiBi: the forward and the backward by atomics against the oracle
    from flashcupy.tools.emulator.cupy import emulated, recording
    names = []
    with emulated(compute_capability=75, compile=recording(names)):
        packed_batch_matches_the_oracle(rng, "cupy", ([30, 70], [90, 20]), np.float16, 64, (2, 1), backward=True,
                                        mods=dict(causal=True, window=(40, None), softcap=20.0, alibi_slopes="per-seq"))
    assert {name.split("<")[0] for name in names} >= {"flash_fwd_tc", "flash_bwd_dkdv_tc"}


def test_unchecked_offsets_are_checked_anyway_where_the_sequences_loop_on_the_host(rng):
    # NumPy reads the offsets on the host to loop over the sequences: it checks them whatever
    # check_offsets says (and gives the same bits either way: packed_batch_matches_the_oracle)
    packed_batch_matches_the_oracle(rng, "numpy")
    q, k, v, cu_q, cu_k = packed_inputs(rng, [2, 3], [2, 3], 2, 2, 8)
    with pytest.raises(ValueError, match="never decrease"):
        bad = np.array([0, 4, 3, 5], np.int32)
        flashcupy.attention_varlen(q, k, v, bad, bad, check_offsets=False)
    # the backward takes the keyword too (attention_varlen_vjp passes its keywords to both)
    out, vjp = flashcupy.attention_varlen_vjp(q, k, v, cu_q, cu_k, causal=True, check_offsets=False)
    assert [g.shape for g in vjp(np.ones_like(out))] == [q.shape, k.shape, v.shape]


BAD_OFFSETS = [
    ("not from 0", [1, 3, 5], ValueError, "must start at 0"),
    ("decreasing", [0, 4, 3, 5], ValueError, "never decrease"),
    ("past the end", [0, 3, 6], ValueError, "end at 5"),
    ("int64", np.array([0, 5], np.int64), TypeError, "must have dtype int32"),
    ("rank 2", np.array([[0, 5]], np.int32), ValueError, r"must have shape \(batch \+ 1,\)"),
    ("a list", "list", TypeError, "must be an int32 array"),
]


@pytest.mark.parametrize("what, cu, error, message", BAD_OFFSETS, ids=[b[0] for b in BAD_OFFSETS])
def test_hostile_offsets_are_refused(rng, what, cu, error, message):
    q, k, v, cu_q, cu_k = packed_inputs(rng, [2, 3], [2, 3], 2, 2, 8)
    cu = [0, 5] if isinstance(cu, str) else np.asarray(cu, np.int32) if isinstance(cu, list) else cu
    for args in ((cu, cu_k), (cu_q, cu)):
        with pytest.raises(error, match=message):
            flashcupy.attention_varlen(q, k, v, *args)
    with pytest.raises(ValueError, match="max_seqlen_q must be at least the longest sequence, 3"):
        flashcupy.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=2)


@pytest.mark.parametrize("what, cu, error, message", [b for b in BAD_OFFSETS if b[1] is not None and not
                                                      isinstance(b[1], list)], ids=["int64", "rank 2", "a list"])
def test_unchecked_offsets_keep_the_checks_that_read_no_value(rng, what, cu, error, message):
    # check_offsets=False (the emulated cupy backend, which reads the offsets on the device) still
    # refuses what their library, dtype and shape show, before any launch
    from flashcupy.tools.emulator.cupy import emulated
    q, k, v, cu_q, cu_k = packed_inputs(rng, [2, 3], [2, 3], 2, 2, 8)
    cu = [0, 5] if isinstance(cu, str) else cu
    grids = []
    with emulated(compile=_recording(grids)):
        for args in ((cu, cu_k), (cu_q, cu)):
            with pytest.raises(error, match=message):
                flashcupy.attention_varlen(q, k, v, *args, backend="cupy", check_offsets=False)
        with pytest.raises(ValueError, match="must describe the same number of sequences, got 2 and 1"):
            flashcupy.attention_varlen(q, k, v, cu_q, np.array([0, 5], np.int32), backend="cupy",
                                       check_offsets=False)
        with pytest.raises(TypeError, match="check_offsets must be a bool, got"):
            flashcupy.attention_varlen(q, k, v, cu_q, cu_k, backend="cupy", check_offsets="no")
    assert grids == []


def _paged(k_cache, v_cache, block_size, rng):
    """The same cache as shuffled physical blocks (two spare ones), and its block table."""
    B, C, H, D = k_cache.shape
    per = C // block_size
    order = rng.permutation(B * per + 2)
    if order[0] + 1 < order.size:  # a run of two consecutive blocks, read as one view
        at = int(np.flatnonzero(order == order[0] + 1)[0])
        order[[1, at]] = order[[at, 1]]
    order = order[:B * per]
    table = order.reshape(B, per).astype(np.int32)
    pages = [np.zeros((B * per + 2, block_size, H, D), k_cache.dtype) for _ in range(2)]
    for b in range(B):
        for n in range(per):
            for page, cache in zip(pages, (k_cache, v_cache)):
                page[table[b, n]] = cache[b, n * block_size:(n + 1) * block_size]
    return pages[0], pages[1], table


@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_appends_and_attends(rng, paged, num_splits):
    B, C, Hq, Hkv, D, new = 3, 32, 4, 2, 8, 2
    k_cache, v_cache = cache_inputs(rng, B, C, Hkv, D)
    lengths = np.array([5, 0, 30], np.int32)
    q = rng.standard_normal((B, 3, Hq, D)).astype(np.float32)
    k_new, v_new = (rng.standard_normal((B, new, Hkv, D)).astype(np.float32) for _ in range(2))
    want_k, want_v = k_cache.copy(), v_cache.copy()
    for b in range(B):
        want_k[b, lengths[b]:lengths[b] + new], want_v[b, lengths[b]:lengths[b] + new] = k_new[b], v_new[b]
    if paged:
        kc, vc, table = _paged(k_cache, v_cache, 8, rng)
    else:
        kc, vc, table = k_cache, v_cache, None
    out, lse = flashcupy.attention_with_kvcache(q, kc, vc, k=k_new, v=v_new, cache_seqlens=lengths, block_table=table,
                                                causal=True, return_lse=True, num_splits=num_splits)
    for b in range(B):
        n = lengths[b] + new
        assert_matches_oracle((out[b:b + 1], lse[b:b + 1]), q[b:b + 1], want_k[b:b + 1, :n], want_v[b:b + 1, :n],
                              causal=True, backend="numpy")
        # the new tokens landed where they should, and nothing else moved
        got_k = kc[b] if table is None else kc[table[b]].reshape(C, Hkv, D)
        np.testing.assert_array_equal(got_k, want_k[b])


@pytest.mark.parametrize("backend", ["numpy", "cupy"], ids=["numpy", "cupy-emulated"])
def test_appends_across_a_block_boundary_land_where_their_positions_say(rng, backend):
    from flashcupy.tools.emulator.cupy import emulated
    with emulated() if backend == "cupy" else contextlib.nullcontext():
        appends_across_a_block_boundary(rng, backend)


@pytest.mark.parametrize("backend", ["numpy", "cupy"], ids=["numpy", "cupy-emulated"])
def test_per_sequence_alibi_slopes_in_a_kvcache(rng, backend):
    from flashcupy.tools.emulator.cupy import emulated
    with emulated() if backend == "cupy" else contextlib.nullcontext():
        per_sequence_alibi_in_a_kvcache(rng, backend)


@settings(max_examples=30, deadline=None)
@given(batch=st.integers(1, 3), heads=st.sampled_from([(1, 1), (2, 1), (4, 2)]), D=st.sampled_from([3, 8, 40]),
       dtype=st.sampled_from([np.float16, BF16, np.float32]), block_size=st.sampled_from([None, 1, 5, 16]),
       new=st.integers(0, 3), splits=st.sampled_from([None, 1, 3]), causal=st.booleans(),
       window=st.sampled_from([None, (7, None), (0, 2)]), seed=st.integers(0, 2**16))
def test_random_caches_match_the_oracle(batch, heads, D, dtype, block_size, new, splits, causal, window, seed):
    # random lengths, appends, paged caches whose blocks lie anywhere (shuffled, spare ones unused),
    # splits: every sequence's out and lse against the oracle on its keys, the caches as appended
    rng = np.random.default_rng(seed)
    (Hq, Hkv), Sq = heads, max(new, 1)
    lengths = rng.integers(0, 40, batch).astype(np.int32)
    need = int(lengths.max()) + new
    if block_size is None:
        table, (kc, vc) = None, cache_inputs(rng, batch, need + 3, Hkv, D, dtype)
    else:
        per = -(-max(need, 1) // block_size)
        table = rng.permutation(batch * per + 2)[:batch * per].astype(np.int32).reshape(batch, per)
        kc, vc = cache_inputs(rng, batch * per + 2, block_size, Hkv, D, dtype)
    q = rng.standard_normal((batch, Sq, Hq, D)).astype(dtype)
    kn, vn = (rng.standard_normal((batch, new, Hkv, D)).astype(dtype) if new else None for _ in range(2))
    rows = appended_rows(kc, vc, table, lengths, kn, vn)
    out, lse = flashcupy.attention_with_kvcache(q, kc, vc, k=kn, v=vn, cache_seqlens=lengths, block_table=table,
                                                num_splits=splits, causal=causal, window=window, return_lse=True,
                                                backend="numpy")
    for b in range(batch):
        n = lengths[b] + new
        if table is None:
            np.testing.assert_array_equal(kc[b], rows[b][0])
        keys, values = (x[None, :n] for x in rows[b])
        assert_matches_oracle((out[b:b + 1], lse[b:b + 1]), q[b:b + 1], keys, values, causal=causal, window=window,
                              backend="numpy")


@pytest.mark.parametrize("backend", ["numpy", "cupy"], ids=["numpy", "cupy-emulated"])
def test_a_cache_in_parts_rounds_out_once(rng, backend):
    from flashcupy.tools.emulator.cupy import emulated
    with emulated() if backend == "cupy" else contextlib.nullcontext():
        split_cache_parts_round_once(rng, backend)


def test_hostile_block_tables_and_lengths_are_refused_before_anything_is_written(rng):
    k_cache, v_cache = cache_inputs(rng, 2, 16, 1, 8)
    kc, vc, table = _paged(k_cache, v_cache, 4, rng)
    q = rng.standard_normal((2, 1, 1, 8)).astype(np.float32)
    k_new = rng.standard_normal((2, 1, 1, 8)).astype(np.float32)
    before = kc.copy()
    for bad_table, lengths, message in (
            (np.where(table == table[1, 0], 99, table).astype(np.int32), 8,
             r"block_table\[1\] must hold block indices in \[0, 10\)"),
            (np.where(table == table[0, 0], -1, table).astype(np.int32), 8, r"block_table\[0\] must hold"),
            (table, np.array([3, 16], np.int32), r"cache_seqlens must lie in \[0, 15\]"),
            (table, -1, r"cache_seqlens must lie in \[0, 15\]"),
            (table[:, :2], 8, r"cache_seqlens must lie in \[0, 7\]")):
        with pytest.raises(ValueError, match=message):
            flashcupy.attention_with_kvcache(q, kc, vc, k=k_new, v=k_new, cache_seqlens=lengths, block_table=bad_table)
    np.testing.assert_array_equal(kc, before)
    # a bad table entry past the blocks a sequence uses is never read, so it is allowed
    short = table.copy()
    short[:, 3] = 99
    flashcupy.attention_with_kvcache(q, kc, vc, cache_seqlens=np.array([5, 12], np.int32), block_table=short)
    with pytest.raises(TypeError, match="block_table must have dtype int32"):
        flashcupy.attention_with_kvcache(q, kc, vc, block_table=table.astype(np.int64))
    # two sequences appending into one physical block (where sequence 0 appends, at length 5: its logical
    # block 1) is refused, before anything is written; the same shared block only read is allowed
    clash = table.copy()
    clash[1, 2] = clash[0, 1]
    with pytest.raises(ValueError, match=rf"sequences 0 and 1 into the same physical block {clash[0, 1]}"):
        flashcupy.attention_with_kvcache(q, kc, vc, k=k_new, v=k_new, cache_seqlens=np.array([5, 9], np.int32),
                                         block_table=clash)
    np.testing.assert_array_equal(kc, before)
    shared = table.copy()
    shared[1, 0] = shared[0, 0]  # a common first block, read by both; each appends into its own
    flashcupy.attention_with_kvcache(q, kc, vc, k=k_new, v=k_new, cache_seqlens=np.array([5, 9], np.int32),
                                     block_table=shared)
    with pytest.raises(ValueError, match="k and v must be given together"):
        flashcupy.attention_with_kvcache(q, kc, vc, k=k_new, block_table=table)
    with pytest.raises(ValueError, match="num_splits must be None or an int >= 1"):
        flashcupy.attention_with_kvcache(q, k_cache, v_cache, num_splits=0)


def test_paged_runs_are_consecutive_physical_blocks():
    from flashcupy._varlen import _runs
    assert _runs([5, 6, 2, 3, 4, 9], True) == [(0, 2), (2, 5), (5, 6)]
    assert _runs([5, 6, 7], False) == [(0, 1), (1, 2), (2, 3)]  # blocks not back to back in memory
    assert _runs([], True) == []


# ----------------------------------------------------------------------------
# split-KV inside one launch (the cupy backend, emulated): decoding fills the device


def _recording(grids, mutate=None):
    """An emulator compile function that records (kernel, CTAs) of every launch; `mutate` (old, new)
    edits the kernel source first."""
    from flashcupy.tools.emulator.cupy import compile_module, launch_records

    def compile(source, names, options, *rest):
        if mutate is not None and mutate[0] in source:
            source = source.replace(*mutate)
        return compile_module(source, names, options, *rest)
    return launch_records(grids, compile=compile)


def _split_kv_case(rng, dtype, paged, num_splits, order="ascending", mutate=None, window=None):
    """Decode on the emulated cupy backend (GQA, one cached sequence longer than several splits, one
    empty, a new token appended; causal, with `window` if given) against the oracle; returns the
    recorded launches."""
    from flashcupy.tools.emulator.cupy import emulated
    B, C, Hq, Hkv, D = 3, 640, 4, 2, 64
    k_cache, v_cache = cache_inputs(rng, B, C, Hkv, D, dtype)
    lengths = np.array([600, 0, 250], np.int32)
    q = rng.standard_normal((B, 1, Hq, D)).astype(dtype)
    k_new, v_new = (rng.standard_normal((B, 1, Hkv, D)).astype(dtype) for _ in range(2))
    want_k, want_v = k_cache.copy(), v_cache.copy()
    for b in range(B):
        want_k[b, lengths[b]], want_v[b, lengths[b]] = k_new[b, 0], v_new[b, 0]
    kc, vc, table = _paged(k_cache, v_cache, 64, rng) if paged else (k_cache, v_cache, None)
    grids = []
    with emulated(order, compile=_recording(grids, mutate)):
        out, lse = flashcupy.attention_with_kvcache(q, kc, vc, k=k_new, v=v_new, cache_seqlens=lengths,
                                                    block_table=table, causal=True, window=window,
                                                    return_lse=True, num_splits=num_splits, backend="cupy")
    for b in range(B):
        n = lengths[b] + 1
        assert_matches_oracle((out[b:b + 1], lse[b:b + 1]), q[b:b + 1], want_k[b:b + 1, :n], want_v[b:b + 1, :n],
                              causal=True, window=window, backend="cupy")
    return grids


@pytest.mark.parametrize("order", ["ascending", "descending"])
@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=["tensor-cores", "simt"])
def test_cupy_splits_the_keys_inside_one_launch(rng, dtype, paged, num_splits, order):
    grids = _split_kv_case(rng, dtype, paged, num_splits, order)
    want = "flash_fwd_tc<" if dtype == np.float16 else "flash_fwd<"
    # the new tokens appended in one launch first (flash_append.cu), the splits merged in one after
    append, *grids, merge = grids
    assert append[0].startswith("flash_kv_append<") and merge[0].startswith("flash_split_merge<")
    assert all(name.startswith(want) for name, _ in grids)
    # the three sequences as one packed batch (cupy_backend.cache_plan), in one launch, paged or not: a
    # copy of the packed grid (3 query blocks + 3 slots, x 4 query heads, the flash_fwd.cu Sequence rule:
    # here 12 CTAs) per split of the cache's 640 positions: 3 of 256 (forced), or 5 of 128 (the smallest,
    # as 12 CTAs fill no device); the 251-key and the empty sequence's CTAs find no key in the later ones
    assert [(name.endswith(", true, true>"), ctas) for name, ctas in grids] == [(True, 12 * (3 if num_splits == 3
                                                                                         else 5))]


@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=["tensor-cores", "simt"])
def test_cupy_split_kv_with_a_window_that_starts_inside_a_later_split(rng, dtype):
    # 601 keys in 3 splits of 256, the last query's window (100, 0) from key 500 on: split 0 sees no
    # key, split 1's loop starts inside it (on a tile aligned from the split's start), split 2 whole;
    # the 251-key sequence's window starts inside its first split
    grids = _split_kv_case(rng, dtype, False, 3, window=(100, 0))
    assert [ctas for name, ctas in grids if name.endswith(", 1, true, true>")] == [12 * 3]  # one packed launch


# deliberate bugs in split-KV's key ranges (mask.cuh's split_range), each caught by a case above
SPLIT_MUTATIONS = {
    # the key loop of a split runs one tile past its end: those keys are counted twice
    "a split reaches into the next": ((np.float32, None), ("end = min(end, s0 + len);",
                                                           "end = min(end, s0 + len + BLOCK_N);")),
    # a window's first key, not a tile from the split's start: the last tile reaches into the next split
    "a split's start not aligned": ((np.float32, (100, 0)), ("start = s0 + max(0, start - s0) / BLOCK_N * BLOCK_N;",
                                                             "start = s0 + max(0, start - s0);")),
    "a split's start not aligned on tensor cores": (
        (np.float16, (100, 0)), ("start = s0 + max(0, start - s0) / BLOCK_N * BLOCK_N;", "start = max(start, s0);")),
}


@pytest.mark.parametrize("name", list(SPLIT_MUTATIONS))
def test_a_split_kv_bug_is_caught(rng, name):
    (dtype, window), mutate = SPLIT_MUTATIONS[name]
    with pytest.raises(AssertionError):
        _split_kv_case(rng, dtype, False, None if window is None else 3, mutate=mutate, window=window)


def test_cupy_split_kv_rounds_bfloat16_ties_to_even(rng):
    # the splits' partial outs (float32) are merged and stored as bfloat16 by flash_merge.cu: two
    # splits whose outs are adjacent bfloat16 values, with equal lse, make every element a tie
    from flashcupy.tools.emulator.cupy import emulated
    q, k, v, want = bf16_ties(rng, 1, 1, 256, 4, 2, 64)
    grids = []
    with emulated(compile=_recording(grids)):
        out, lse = flashcupy.attention_with_kvcache(q, k, v, num_splits=2, return_lse=True, dtype="bfloat16",
                                                    backend="cupy")
    # the split forward, then the merge: a thread an element of out (256 of them, two CTAs)
    assert [(name.split("<")[0], name.endswith(", true>"), ctas) for name, ctas in grids] == [
        ("flash_fwd_tc", True, 8), ("flash_split_merge", False, 2)]
    np.testing.assert_array_equal(out, want)
    assert_matches_oracle((out, lse), q, k, v, dtype="bfloat16", backend="cupy")


MERGE_MUTATIONS = {"no shift by the largest lse": ("const Acc m_safe = m == -INFINITY ? Acc(0) : m;", "const Acc m_safe = 0;"),
                   "a row that saw no key": ("const Acc merged_safe = merged == -INFINITY ? Acc(0) : merged;",
                                             "const Acc merged_safe = merged;")}


@pytest.mark.parametrize("mutation", [None] + list(MERGE_MUTATIONS), ids=lambda m: m or "as written")
@pytest.mark.parametrize("dtype", [np.float16, np.float64], ids=["float16", "float64"])
def test_the_merge_kernel_is_flashcupy_merge(rng, dtype, mutation):
    # flash_merge.cu against flashcupy.merge on the same workspaces: 5 splits, lses far from 0 (exp overflows
    # without the shift by the largest), splits that saw no key (-inf), a row that saw none at all (out 0,
    # lse -inf), a NaN lse (the row NaN, as the rule's array form); each deliberate bug fails the comparison
    from flashcupy._checks import problem
    from flashcupy.backends import cupy_backend
    from flashcupy.tools.emulator.cupy import emulated
    splits, B, S, H, D = 5, 2, 7, 3, 16
    acc = np.float64 if dtype == np.float64 else np.float32
    outs = rng.standard_normal((splits, B, S, H, D)).astype(acc)
    lses = (rng.uniform(-3, 3, (splits, B, H, S)) + (800 if acc is np.float64 else 200)).astype(acc)
    lses[1:3, 0] = -np.inf
    lses[:, 1, 2, 4] = -np.inf
    lses[2, 1, 0, 6] = np.nan
    q = np.zeros((B, S, H, D), dtype)
    p = problem(q, q, q, False, None, None, "numpy")
    out, lse = np.zeros_like(q), np.zeros((B, H, S), acc)
    args = [cupy_backend._tensor(x)[:1] + cupy_backend._tensor(x[0])[1:] for x in (outs, lses)]
    split_args = (np.int32(0), np.int64(outs[0].size), np.int64(lses[0].size))
    with emulated(compile=_recording([], MERGE_MUTATIONS.get(mutation))):
        cupy_backend._merge_splits(cupy_backend._runtime(), p, q, splits, *args, split_args, cupy_backend._tensor(out),
                                   cupy_backend._tensor(lse), B, S)
    want_out, want_lse = flashcupy.merge(list(outs), list(lses))
    with pytest.raises(AssertionError) if mutation else contextlib.nullcontext():
        np.testing.assert_allclose(lse, want_lse, rtol=4 * np.finfo(acc).eps, atol=0)
        np.testing.assert_allclose(out, want_out.astype(dtype), rtol=np.finfo(dtype).eps, atol=4 * np.finfo(acc).eps)
    if not mutation:
        assert np.all(out[1, 4, 2] == 0) and lse[1, 2, 4] == -np.inf and np.all(np.isnan(out[1, 6, 0]))


def test_the_split_plan_fills_the_device_when_decoding():
    # the decode call (B=1, 32 query heads, 8 kv heads, D=128, one query, 64k cached keys) on
    # an H200's 132 SMs: one query block per head is 32 CTAs; the plan makes more than 2 per SM
    from flashcupy.tools.emulator.cupy import emulated
    from flashcupy.backends import cupy_backend
    from flashcupy.backends.cupy_backend import specs
    for dtype in (np.float16, np.float32):
        q = np.zeros((1, 1, 32, 128), dtype)
        kv = np.zeros((1, 65536, 8, 128), dtype)
        with emulated() as runtime:
            runtime.sm_count = lambda x: 132
            p = flashcupy._checks.problem(q, kv, kv, True, None, None, "numpy")
            splits, key_split = cupy_backend.split_plan(p, q, kv, kv)
            assert key_split % specs.SPLIT_ALIGN == 0 and splits == -(-65536 // key_split)
            assert 32 * splits > 2 * 132, (splits, key_split)
            # a grid that fills the device already is not split; a forced count is at most that many
            assert cupy_backend.split_plan(p, q, kv, kv, 5)[0] <= 5
            runtime.sm_count = lambda x: 8
            assert cupy_backend.split_plan(p, q, kv, kv) == (1, 0)


# ----------------------------------------------------------------------------
# a packed batch in one launch per kernel (the cupy backend, emulated): the kernels read the offsets


ONE_LAUNCH_PATHS = {"simt": (np.float32, 32), "simt-float64": (np.float64, 32), "tensor-cores": (np.float16, 64),
                    "tensor-cores-128": (np.float16, 128), "tensor-cores-bfloat16": (BF16, 64)}
# the kernels of each path's forward and backward, in launch order (the default backward: dQ added by
# the tensor-core dK/dV kernel, then converted)
ONE_LAUNCH_KERNELS = {"simt": ["flash_fwd", "flash_bwd_preprocess", "flash_bwd_dkdv", "flash_bwd_dq"],
                      "tensor-cores": ["flash_fwd_tc", "flash_bwd_preprocess", "flash_bwd_dkdv_tc",
                                       "flash_bwd_dq_convert"]}
PACKED_LENGTHS = ([5, 0, 9, 1, 150, 13, 0], [5, 3, 4, 7, 140, 0, 0])


@pytest.mark.parametrize("mods", MODS.values(), ids=MODS.keys())
@pytest.mark.parametrize("path", ONE_LAUNCH_PATHS, ids=ONE_LAUNCH_PATHS.keys())
def test_cupy_packed_batch_in_one_launch_per_kernel_matches_the_oracle(rng, path, mods):
    # empty sequences (no query, no key), Sq > Sk and Sq < Sk under causal, sequences of several query
    # and key blocks; forward and backward; checked and unchecked offsets give the same bits
    # (packed_batch_matches_the_oracle), each call one launch per kernel
    from flashcupy.tools.emulator.cupy import emulated
    dtype, head_dim = ONE_LAUNCH_PATHS[path]
    grids = []
    with emulated(compile=_recording(grids)):
        packed_batch_matches_the_oracle(rng, "cupy", PACKED_LENGTHS, dtype, head_dim, (4, 2), mods, backward=True)
    kernels = ONE_LAUNCH_KERNELS["simt" if path.startswith("simt") else "tensor-cores"]
    assert [name.split("<")[0] for name, _ in grids] == kernels[:1] * 2 + kernels[1:] * 2
    assert all(name.endswith(", true>") for name, _ in grids if name.split("<")[0] in ("flash_fwd", "flash_fwd_tc",
                                                                                     "flash_bwd_dkdv", "flash_bwd_dq",
                                                                                     "flash_bwd_dkdv_tc")), grids


@pytest.mark.parametrize("head_dim", [64, 128])
def test_cupy_packed_deterministic_backward_in_one_launch_per_kernel(rng, head_dim):
    # deterministic=True: the tensor-core dK/dV and dQ kernels, each reading the offsets
    from flashcupy.tools.emulator.cupy import emulated
    grids = []
    with emulated(compile=_recording(grids)):
        packed_batch_matches_the_oracle(rng, "cupy", PACKED_LENGTHS, np.float16, head_dim, (4, 2),
                                        MODS["causal-window-alibi"], backward=True, deterministic=True)
    backward = [name for name, _ in grids][2:]
    assert [name.split("<")[0] for name in backward] == ["flash_bwd_preprocess", "flash_bwd_dkdv_tc",
                                                         "flash_bwd_dq_tc"] * 2
    assert all(name.endswith(", true>") for name in backward[1::3] + backward[2::3]), backward


def test_cupy_packed_forward_reads_any_strides(rng):
    # q, k, v as views of head-major arrays (still tensor cores) and with every other element along
    # head_dim (the SIMT kernel) give the bits of contiguous copies on their kernels
    from flashcupy.tools.emulator.cupy import emulated
    q, k, v, cu_q, cu_k = packed_inputs(rng, [7, 0, 70], [9, 4, 65], 4, 2, 64, np.float16)
    head_major = [np.ascontiguousarray(x.transpose(1, 0, 2)).transpose(1, 0, 2) for x in (q, k, v)]
    every_other = [np.stack([x, x], axis=-1)[..., 0] for x in (q, k, v)]
    grids = []
    call = dict(causal=True, return_lse=True, backend="cupy")
    with emulated(compile=_recording(grids)):
        tc = flashcupy.attention_varlen(q, k, v, cu_q, cu_k, **call)
        flashcupy.backends.cupy_backend.USE_TENSOR_CORES = False
        try:
            simt = flashcupy.attention_varlen(q, k, v, cu_q, cu_k, **call)
        finally:
            flashcupy.backends.cupy_backend.USE_TENSOR_CORES = True
        got = [flashcupy.attention_varlen(*x, cu_q, cu_k, **call) for x in (head_major, every_other)]
    for want, other in ((tc, got[0]), (simt, got[1])):
        for a, b in zip(want, other):
            np.testing.assert_array_equal(a, b)
    assert [name.split("<")[0] for name, _ in grids] == ["flash_fwd_tc", "flash_fwd", "flash_fwd_tc", "flash_fwd"]


HOPPER_PACKED = {"float16-64-causal": (np.float16, 64, dict(causal=True)),
                 "bfloat16-128-window": (BF16, 128, dict(causal=True, window=(40, 3))),
                 "float16-72": (np.float16, 72, dict()),
                 # head_dim 136..256: the backward's SPLIT_D (64 x 64, one stage); the forward's 128 x 64
                 "bfloat16-248-window": (BF16, 248, dict(causal=True, window=(90, 2)))}


@pytest.mark.parametrize("case", HOPPER_PACKED.values(), ids=HOPPER_PACKED.keys())
def test_on_sm90_a_packed_batch_is_one_launch_of_each_hopper_kernel(rng, case):
    # compute capability 9.0: the forward is one launch of flash_fwd_sm90.cu, the backward's dK/dV and dQ
    # conversion are flash_bwd_sm90.cu's, each reading the offsets; sequences empty, of one row, shorter
    # and longer than a box (128 queries and keys in the forward, 64 queries and 128 keys in the
    # backward, 64 and 64 at head_dim 248), GQA; checked and unchecked offsets give the same bits, and the
    # oracle's numbers
    from flashcupy.tools.emulator.cupy import emulated
    dtype, head_dim, mods = case
    grids = []
    with emulated(compile=_recording(grids), compute_capability=90):
        packed_batch_matches_the_oracle(rng, "cupy", ([7, 0, 70, 130, 1], [9, 4, 65, 150, 0]), dtype, head_dim,
                                        (4, 2), mods, backward=True)
    assert [name.split("<")[0] for name, _ in grids] == ["flash_fwd_sm90"] * 2 + [
        "flash_bwd_preprocess", "flash_bwd_dkdv_sm90", "flash_bwd_dq_convert_sm90_varlen"] * 2
    assert all(name.endswith(", true>") for name, _ in grids if name.startswith(("flash_fwd_sm90", "flash_bwd_dkdv"))), grids


def test_on_sm90_a_packed_batch_at_head_dim_256_takes_the_hopper_forward(rng):
    # the one tensor-core forward above head_dim 128 (specs.SM90_VARLEN_FORWARD_TILES: 128 x 64, O_s in
    # Q_s): sequences empty, of one row, shorter and longer than its 64-key boxes, GQA, causal and the
    # window (its backward: test_on_sm90_a_packed_batch_is_one_launch_of_each_hopper_kernel)
    from flashcupy.tools.emulator.cupy import emulated
    grids = []
    with emulated(compile=_recording(grids), compute_capability=90):
        packed_batch_matches_the_oracle(rng, "cupy", ([7, 0, 70, 130, 1], [9, 4, 65, 150, 0]), BF16, 248,
                                        (2, 1), dict(causal=True, window=(90, 2)))
    assert [name for name, _ in grids] == ["flash_fwd_sm90<__nv_bfloat16, 256, 128, 64, 1, true>"] * 2


@pytest.mark.parametrize("head_dim, tile", [(64, (128, 128)), (120, (128, 64)), (192, (128, 64)), (248, None)])
def test_on_sm90_a_packed_batch_with_softcap_and_alibi_takes_the_hopper_kernels(rng, head_dim, tile):
    # attention_varlen's modifiers on the Hopper forward (specs.SM90_VARLEN_FORWARD_MODS; 64 keys at 128 and
    # 192, where 128 and 80 spilled; at 256 the window alone: the mma.sync forward, tile None), slopes per
    # sequence and head; and on the Hopper backward (SM90_VARLEN_BACKWARD_MODS; each sequence's slopes: the
    # kernel's seq_index), at 192 in the 256 kernel (specs.sm90_backward_bucket)
    from flashcupy.tools.emulator.cupy import emulated
    grids = []
    with emulated(compile=_recording(grids), compute_capability=90):
        packed_batch_matches_the_oracle(rng, "cupy", ([7, 0, 70, 130, 1], [9, 4, 65, 150, 0]), np.float16, head_dim,
                                        (2, 1), dict(causal=True, window=(90, 2), softcap=2.0, alibi_slopes="per-seq"),
                                        backward=True)
    bucket = -(-head_dim // 64) * 64
    forwards = [name for name, _ in grids if name.startswith("flash_fwd")]
    if tile is None:
        assert [name.split("<")[0] for name in forwards] == ["flash_fwd_tc"] * 2
    else:
        assert forwards == [f"flash_fwd_sm90<__half, {bucket}, {tile[0]}, {tile[1]}, 7, true>"] * 2
    backward = [name for name, _ in grids if name.startswith("flash_bwd_dkdv_sm90")]
    bucket, keys = (256, 64) if bucket > 128 else (bucket, 128)  # SPLIT_D's key block above 128
    assert backward == [f"flash_bwd_dkdv_sm90<__half, {bucket}, 64, {keys}, 7, true>"] * 2


def test_on_sm90_a_contiguous_kv_cache_step_is_one_launch_of_the_hopper_forward(rng):
    # a decode step over a contiguous cache without split-KV: the append, then flash_fwd_sm90.cu reading
    # the cached lengths (seqused_k) as the other packed forwards do, against the oracle
    from flashcupy.tools.emulator.cupy import emulated
    batch, C, Hq, Hkv, D, Sq = 3, 200, 4, 2, 64, 2
    k_cache, v_cache = cache_inputs(rng, batch, C, Hkv, D, np.float16)
    lengths = np.array([C - Sq, 0, 131], np.int32)
    q = rng.standard_normal((batch, Sq, Hq, D)).astype(np.float16)
    k_new, v_new = (rng.standard_normal((batch, Sq, Hkv, D)).astype(np.float16) for _ in range(2))
    grids = []
    with emulated(compile=_recording(grids), compute_capability=90):
        out, lse = flashcupy.attention_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=lengths,
                                                    causal=True, return_lse=True, num_splits=1, backend="cupy")
    assert [name.split("<")[0] for name, _ in grids] == ["flash_kv_append", "flash_fwd_sm90"]
    for b in range(batch):
        n = lengths[b] + Sq
        assert_matches_oracle((out[b:b + 1], lse[b:b + 1]), q[b:b + 1], k_cache[b:b + 1, :n], v_cache[b:b + 1, :n],
                              causal=True, backend="cupy")


# zero_rows (sm90_tile.cuh) zeroing nothing: a box's rows past its sequence keep the next sequence's values
NO_ZEROS = ("const int chunks = (ROWS - r0) * 8;", "const int chunks = 0;")


@pytest.mark.parametrize("unzeroed", [False, True], ids=["zeroed", "unzeroed"])
def test_on_sm90_no_value_of_one_packed_sequence_reaches_anothers_gradients(rng, unzeroed):
    # NaN and inf in every row of the middle sequence, which the Hopper kernels' boxes of the first
    # sequence reach into (its queries past 64, its keys past 128); the other sequences' out, lse and
    # gradients are still the oracle's, as on the mma.sync kernels, which never load those rows. Without
    # the zeros in shared memory, P = 0 times those values makes the first sequence's NaN
    from flashcupy.tools.emulator.cupy import emulated
    q, k, v, cu_q, cu_k = packed_inputs(rng, [70, 30, 50], [150, 20, 40], 2, 1, 64, np.float16)
    dout = rng.standard_normal(q.shape).astype(np.float16)
    q[70:100, 0, 0], dout[70:100, 1, 5], k[150:170, 0, 3], v[150:170, 0, :] = np.nan, np.inf, -np.inf, np.nan
    grids = []
    with emulated(compile=_recording(grids, NO_ZEROS if unzeroed else None), compute_capability=90):
        out, lse = flashcupy.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, backend="cupy")
        dq, dk, dv = flashcupy.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, backend="cupy")
    assert {"flash_fwd_sm90", "flash_bwd_dkdv_sm90"} <= {name.split("<")[0] for name, _ in grids}
    assert np.isnan(dk[150:170]).all() and np.isnan(dv[150:170]).any()  # the middle sequence's own
    for b in (0, 2):
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        try:
            assert_matches_oracle((out[None, sq], lse[None, :, sq], dq[None, sq], dk[None, sk], dv[None, sk]),
                                  q[None, sq], k[None, sk], v[None, sk], dout[None, sq], backend="cupy")
        except AssertionError:
            assert unzeroed and b == 0, f"sequence {b}"
        else:
            assert not unzeroed or b == 2, "the first sequence's gradients stayed finite without the zeros"


VARLEN_KERNELS = ("flash_fwd", "flash_fwd_tc", "flash_bwd_dkdv", "flash_bwd_dkdv_tc", "flash_bwd_dq", "flash_bwd_dq_tc",
                  "flash_fwd_sm90", "flash_bwd_dkdv_sm90", "flash_bwd_dq_convert_sm90_varlen")


def _working_blocks(cu_q, cu_k, kernel_name) -> int:
    """The blocks of a packed batch's sequences that the launched kernel's CTAs work on, per head, for
    its tile: query blocks (forward, dQ), key blocks (dK/dV)."""
    template, args = kernel_name.split("<")[0], kernel_name.split("<")[1].split(", ")
    block_m = 3 if template in ("flash_fwd", "flash_bwd_dkdv", "flash_bwd_dq") else 2  # after T (, Acc), HEAD_DIM
    keys = template.startswith("flash_bwd_dkdv")
    return int(sum(-(-np.diff(cu_k if keys else cu_q) // int(args[block_m + keys]))))


@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=["tensor-cores", "simt"])
def test_cupy_packed_batch_is_one_launch_per_kernel_whatever_the_batch(rng, dtype):
    # the per-sequence path made a launch per kernel and sequence with queries and keys; now 1, 7 or 40
    # sequences (some empty) take one forward launch and three backward ones, whose idle CTAs (past
    # their sequence's blocks) are at most one a sequence and head
    from flashcupy.tools.emulator.cupy import emulated
    launches = {}
    for batch in (1, 7, 40):
        lengths_q = rng.integers(0, 40, batch)
        lengths_k = np.where(rng.random(batch) < 0.2, 0, rng.integers(1, 40, batch))
        lengths_q[0], lengths_k[0] = 33, 20  # one sequence with work at least
        q, k, v, cu_q, cu_k = packed_inputs(rng, lengths_q, lengths_k, 2, 1, 32, dtype)
        dout = rng.standard_normal(q.shape).astype(dtype)
        grids = []
        with emulated(compile=_recording(grids)):
            out, lse = flashcupy.attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True, backend="cupy")
            dq, dk, dv = flashcupy.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal=True,
                                                             backend="cupy")
        launches[batch] = len(grids)
        for name, ctas in grids:
            if name.split("<")[0] in VARLEN_KERNELS:
                heads = 1 if name.startswith("flash_bwd_dkdv") else 2
                assert 0 <= ctas - heads * _working_blocks(cu_q, cu_k, name) <= heads * batch, (name, ctas)
        for b in range(batch):
            sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
            assert_matches_oracle((out[None, sq], lse[None, :, sq], dq[None, sq], dk[None, sk], dv[None, sk]),
                                  q[None, sq], k[None, sk], v[None, sk], dout[None, sq], causal=True, backend="cupy")
    assert launches == {1: 4, 7: 4, 40: 4}


@pytest.mark.parametrize("dtype, head_dim, compute_capability", [(np.float16, 64, 80), (np.float16, 128, 80),
                                                                 (np.float32, 64, 80), (np.float64, 64, 80),
                                                                 (np.float16, 64, 90), (np.float16, 128, 90)])
def test_few_ctas_of_a_packed_batch_find_no_work(rng, dtype, head_dim, compute_capability):
    # issue 28's target: for 256 sequences of 17-300 tokens, at most 25 % of the CTAs each forward and
    # backward kernel launches exit without work (on sm_90 the Hopper kernels' and their dQ conversion's).
    # The launches are recorded, not run: which CTAs work is the grid's rule (mask.cuh's Sequence), which
    # the tests above run
    from flashcupy.tools.emulator.cupy import emulated, launch_records
    lengths = rng.integers(17, 301, 256)
    q, k, v, cu_q, cu_k = packed_inputs(rng, lengths, lengths, 1, 1, head_dim, dtype)
    grids = []
    with emulated(compile=launch_records(grids, run=False), compute_capability=compute_capability):
        out, lse = flashcupy.attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True, backend="cupy",
                                              check_offsets=False)
        flashcupy.attention_varlen_backward(q, q, k, v, out, lse, cu_q, cu_k, causal=True, backend="cupy",
                                            check_offsets=False)
    idle = {name: 1 - _working_blocks(cu_q, cu_k, name) / ctas for name, ctas in grids
            if name.split("<")[0] in VARLEN_KERNELS}
    assert len(idle) == (3 if compute_capability == 90 or dtype != np.float16 else 2), idle
    assert max(idle.values()) <= 0.25, idle


HOSTILE_OFFSETS = {"decreasing": [0, 30, 10, 40], "negative": [0, -50, 5, 40], "past the end": [0, 10, 80, 40],
                   "huge": [0, 2 ** 31 - 1, -2 ** 31, 2 ** 31 - 1], "wrapping": [2 ** 31 - 6, -2 ** 31, 3, 40],
                   "short of the end": [0, 10, 20, 30]}


def _hostile_calls(rng, dtype, mutate=None, deterministic=False, compute_capability=80):
    """attention_varlen and its backward over unchecked hostile offsets (each table for q, for k, for
    both) on the emulated cupy backend, whose guard pages fail any access outside the arguments;
    `mutate` edits the kernels. Returns the kernels launched."""
    from flashcupy.tools.emulator.cupy import emulated
    q, k, v, cu_q, cu_k = packed_inputs(rng, [10, 20, 10], [15, 5, 20], 2, 1, 64, dtype)
    dout = rng.standard_normal(q.shape).astype(dtype)
    grids = []
    for name, bad in HOSTILE_OFFSETS.items():
        bad = np.array(bad, np.int32)
        for args in ((bad, cu_k), (cu_q, bad), (bad, bad)):
            with emulated(compile=_recording(grids, mutate), compute_capability=compute_capability):
                out, lse = flashcupy.attention_varlen(q, k, v, *args, causal=True, return_lse=True, backend="cupy",
                                                      check_offsets=False)
                grads = flashcupy.attention_varlen_backward(dout, q, k, v, out, lse, *args, causal=True,
                                                            backend="cupy", check_offsets=False,
                                                            deterministic=deterministic)
            assert out.shape == q.shape and lse.shape == (2, q.shape[0])
            assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    return {name.split("<")[0] for name, _ in grids}


HOSTILE_PATHS = {"simt": (np.float32, False, 80), "tensor-cores": (np.float16, False, 80),
                 "tensor-cores-deterministic": (np.float16, True, 80), "hopper": (np.float16, False, 90)}


@pytest.mark.parametrize("path", HOSTILE_PATHS)
def test_unchecked_hostile_offsets_stay_inside_the_arrays(rng, path):
    # the forward and every backward kernel that reads the offsets (dK/dV, dQ, the dQ added by atomics,
    # the Hopper forward, dK/dV and its dQ conversion)
    dtype, deterministic, compute_capability = HOSTILE_PATHS[path]
    kernels = _hostile_calls(rng, dtype, deterministic=deterministic, compute_capability=compute_capability)
    want = ({"flash_fwd", "flash_bwd_dkdv", "flash_bwd_dq"} if dtype == np.float32
            else {"flash_fwd_sm90", "flash_bwd_dkdv_sm90", "flash_bwd_dq_convert_sm90_varlen"} if path == "hopper"
            else {"flash_fwd_tc", "flash_bwd_dkdv_tc", "flash_bwd_dq_tc" if deterministic else "flash_bwd_dq_convert"})
    assert kernels >= want


UNCLAMPED = ("return min(max(cu[s], 0), total);", "return cu[s];")


@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=["tensor-cores", "simt"])
def test_unclamped_offsets_would_reach_outside_the_arrays(rng, dtype):
    # the deliberate bug: the offsets read as they are, unclamped; the guard pages catch it (in the
    # forward, the first kernel launched)
    from flashcupy.tools.emulator.errors import KernelError
    with pytest.raises(KernelError, match="flash_fwd"):
        _hostile_calls(rng, dtype, UNCLAMPED)


@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=["tensor-cores", "simt"])
def test_unclamped_offsets_in_the_backward_would_reach_outside_the_arrays(rng, dtype):
    # the same bug in the backward's module only (the forward's offsets still clamped): the guard pages
    # catch its first kernel that reads them, dK/dV
    from flashcupy.tools.emulator.cupy import compile_module, emulated
    from flashcupy.tools.emulator.errors import KernelError

    def compile(source, names, options, *rest):
        if any(name.startswith("flash_bwd_dkdv") for name in names):
            source = source.replace(*UNCLAMPED)
        return compile_module(source, names, options, *rest)

    q, k, v, cu_q, cu_k = packed_inputs(rng, [10, 20, 10], [15, 5, 20], 2, 1, 64, dtype)
    bad = np.array(HOSTILE_OFFSETS["past the end"], np.int32)
    with emulated(compile=compile):
        out, lse = flashcupy.attention_varlen(q, k, v, bad, bad, causal=True, return_lse=True, backend="cupy",
                                              check_offsets=False)
        with pytest.raises(KernelError, match="flash_bwd_dkdv"):
            flashcupy.attention_varlen_backward(q, q, k, v, out, lse, bad, bad, causal=True, backend="cupy",
                                                check_offsets=False)


# ----------------------------------------------------------------------------
# the KV-cache append in one launch (the cupy backend, emulated): flash_append.cu


def _append_case(rng, block_size, dtype=np.float32):
    """(k_cache, v_cache, block_table, lengths, k_new, v_new, want_k, want_v): a cache of 96 positions a
    sequence for 5 sequences, contiguous (block_size None) or paged through a shuffled table, and 3 new
    tokens a sequence at random lengths, with the caches the append must leave."""
    B, C, Hkv, D, new = 5, 96, 2, 8, 3
    lengths = rng.integers(0, C - new + 1, B).astype(np.int32)
    k_new, v_new = (rng.standard_normal((B, new, Hkv, D)).astype(dtype) for _ in range(2))
    if block_size is None:
        k_cache, v_cache = cache_inputs(rng, B, C, Hkv, D, dtype)
        table = None
    else:
        per_seq = C // block_size
        k_cache, v_cache = cache_inputs(rng, B * per_seq, block_size, Hkv, D, dtype)
        table = rng.permutation(B * per_seq).reshape(B, per_seq).astype(np.int32)
    want_k, want_v = k_cache.copy(), v_cache.copy()
    for b in range(B):
        for j in range(new):
            n = lengths[b] + j
            at = (b, n) if table is None else (table[b, n // block_size], n % block_size)
            want_k[at], want_v[at] = k_new[b, j], v_new[b, j]
    return k_cache, v_cache, table, lengths, k_new, v_new, want_k, want_v


@pytest.mark.parametrize("block_size", [None, 1, 16, 48], ids=["contiguous", "page-1", "page-16", "page-48"])
def test_cupy_appends_every_new_token_in_one_launch(rng, block_size):
    # the append was one assignment per sequence (per token of a paged cache, a launch each on CuPy)
    from flashcupy.tools.emulator.cupy import emulated
    k_cache, v_cache, table, lengths, k_new, v_new, want_k, want_v = _append_case(rng, block_size)
    q = rng.standard_normal((5, 3, 4, 8)).astype(np.float32)
    grids = []
    with emulated(compile=_recording(grids)):
        out, lse = flashcupy.attention_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=lengths,
                                                    block_table=table, causal=True, return_lse=True, backend="cupy")
    np.testing.assert_array_equal(k_cache, want_k)
    np.testing.assert_array_equal(v_cache, want_v)
    names = [name for name, _ in grids]
    assert names[0] == "flash_kv_append<float>" and names.count(names[0]) == 1, names
    for b in range(5):  # attention reads what was appended
        n = lengths[b] + 3
        keys, values = ((x[b:b + 1] if table is None else x[table[b]].reshape(1, -1, 2, 8))[:, :n]
                        for x in (want_k, want_v))
        assert_matches_oracle((out[b:b + 1], lse[b:b + 1]), q[b:b + 1], keys, values, causal=True, backend="cupy")


HOSTILE_APPENDS = {"negative length": ([-7, 5, 0, 2, 1], None), "length past the cache": ([2 ** 31 - 1, 90, 3, 0, 1], None),
                   "table entries outside the cache": ([5, 40, 93, 0, 60], [-1, 10 ** 6, 2 ** 31 - 1])}


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("unclamped", [False, True], ids=["clamped", "unclamped (a deliberate bug)"])
def test_append_kernel_keeps_hostile_lengths_and_tables_inside_the_cache(rng, paged, unclamped):
    # cupy_backend.append_kv reads the lengths and the table on the device (the interface checks them
    # first; the kernel must not depend on it): whatever they hold it writes inside the cache, where the
    # emulator's guard pages stay silent; with the clamps removed they catch it
    from flashcupy.backends import cupy_backend
    from flashcupy.tools.emulator.cupy import emulated
    k_cache, v_cache, table, _, k_new, v_new, _, _ = _append_case(rng, 16 if paged else None)
    mutate = ("const int n = min(max(cache_seqlens[b], 0), capacity - seqlen_new) + j;",
              "const int n = cache_seqlens[b] + j;") if not paged else (
              "slot = min(max(block_table[b * table_sb + logical * table_sn], 0), num_blocks - 1);",
              "slot = block_table[b * table_sb + logical * table_sn];")
    for name, (lengths, entries) in HOSTILE_APPENDS.items():
        if paged != (entries is not None):
            continue
        bad_table = None
        if paged:
            bad_table = table.copy()
            bad_table[:, :len(entries)] = entries[0]
            bad_table[1::2, :len(entries)] = entries[1]
            bad_table[4, :] = entries[2]
        with emulated(compile=_recording([], mutate if unclamped else None)):
            _fails_only_if(unclamped, "flash_kv_append", lambda: cupy_backend.append_kv(
                "float32", k_cache, v_cache, k_new, v_new, np.array(lengths, np.int32), bad_table))


def _fails_only_if(bug: bool, kernel: str, call) -> None:
    """call() under the emulator: a KernelError naming `kernel` where `bug` (a deliberate one), else none."""
    from flashcupy.tools.emulator.errors import KernelError
    if bug:
        with pytest.raises(KernelError, match=kernel):
            call()
    else:
        call()


# ----------------------------------------------------------------------------
# a contiguous cache's decode in one launch (the cupy backend, emulated): forward_varlen with seqused_k


@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=["tensor-cores", "simt"])
def test_cupy_contiguous_cache_step_is_two_launches_whatever_the_batch_and_splits(rng, dtype):
    # append and attention: two launches (three with split-KV's merge) for 1, 7 or 40 sequences (an empty one, one full, GQA, causal
    # bottom-right per sequence, per-sequence ALiBi), whatever num_splits: split-KV runs inside the one
    # attention launch where the grid leaves the emulated device's 132 SMs idle (cupy_backend.cache_plan:
    # 3 sequences x 4 query heads over 384 positions, 3 splits of 128)
    from flashcupy.tools.emulator.cupy import emulated
    launches = {}
    for batch, heads_q, num_splits, C in ((1, 4, 1, 24), (7, 4, 1, 24), (40, 8, None, 24), (7, 4, None, 24),
                                          (3, 4, None, 384), (3, 4, 2, 384)):
        Hkv, D, Sq = 2, 32, 2
        k_cache, v_cache = cache_inputs(rng, batch, C, Hkv, D, dtype)
        lengths = rng.integers(0, C - Sq + 1, batch).astype(np.int32)
        lengths[0] = C - Sq
        q = rng.standard_normal((batch, Sq, heads_q, D)).astype(dtype)
        k_new, v_new = (rng.standard_normal((batch, Sq, Hkv, D)).astype(dtype) for _ in range(2))
        slopes = rng.uniform(0.1, 1, (batch, heads_q)).astype(np.float32)
        grids = []
        with emulated(compile=_recording(grids)):
            out, lse = flashcupy.attention_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=lengths,
                                                        causal=True, alibi_slopes=slopes, return_lse=True,
                                                        num_splits=num_splits, backend="cupy")
        launches[batch, num_splits, C] = [name for name, _ in grids]
        for b in range(batch):
            n = lengths[b] + Sq
            assert_matches_oracle((out[b:b + 1], lse[b:b + 1]), q[b:b + 1], k_cache[b:b + 1, :n],
                                  v_cache[b:b + 1, :n], causal=True, alibi_slopes=slopes[b], backend="cupy")
    forward = "flash_fwd_tc<" if dtype == np.float16 else "flash_fwd<"
    for case, names in launches.items():
        split = case[2] == 384  # the cache longer than one split: the packed forward split (SPLIT), then the merge
        assert len(names) == 2 + split and names[0].startswith("flash_kv_append<") and names[1].startswith(forward), case
        assert names[1].endswith(", true, true>" if split else ", false, true>"), case
        assert names[2:] == (["flash_split_merge<__half, float>" if dtype == np.float16 else "flash_split_merge<float, float>"]
                             if split else []), case


SEQUSED_CLAMP = ("? int(min(max(index_t(seqused_k[s]) + seqused_add, index_t(0)), index_t(total_k - k_start)))",
                 "? seqused_k[s] + seqused_add")


@pytest.mark.parametrize("unclamped", [False, True], ids=["clamped", "unclamped (a deliberate bug)"])
def test_cached_lengths_read_on_the_device_stay_inside_the_cache(rng, unclamped):
    # forward_varlen's seqused_k (a contiguous cache's lengths, checked by the interface before): whatever
    # they hold, the kernel reads inside k and v, where the guard pages stay silent; unclamped, they catch it
    from flashcupy._checks import problem
    from flashcupy.backends import cupy_backend
    from flashcupy.tools.emulator.cupy import emulated
    q, k, v = (rng.standard_normal((3 * n, 2, 32)).astype(np.float32) for n in (2, 8, 8))
    cu_q, cu_k = np.arange(4, dtype=np.int32) * 2, np.arange(4, dtype=np.int32) * 8
    p = problem(q[None], k[None], v[None], True, None, None, "numpy")
    for used in ([-5, 8, 2 ** 31 - 1], [9, 100, 3]):
        out, lse = np.zeros_like(q), np.full((2, 6), -np.inf, np.float32)
        with emulated(compile=_recording([], SEQUSED_CLAMP if unclamped else None)):
            _fails_only_if(unclamped, "flash_fwd", lambda: cupy_backend.forward_varlen(
                p, q, k, v, cu_q, cu_k, out, lse, seqused_k=np.array(used, np.int32)))


@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=["tensor-cores", "simt"])
def test_unchecked_cache_lengths_are_never_read_on_the_host(rng, dtype, monkeypatch):
    # check_offsets=False over a contiguous cache: the lengths go to the kernels only (the append and the
    # one-launch attention), the same bits and cache as checked; hostile ones stay inside the arrays
    # (the guard pages). A paged cache's: test_cupy_paged_cache_step_is_two_launches_in_both_checking_modes
    from flashcupy import _varlen
    from flashcupy.tools.emulator.cupy import emulated
    B, C, Hq, Hkv, D, new = 3, 200, 4, 2, 32, 2
    k_cache, v_cache = cache_inputs(rng, B, C, Hkv, D, dtype)
    q = rng.standard_normal((B, new, Hq, D)).astype(dtype)
    k_new, v_new = (rng.standard_normal((B, new, Hkv, D)).astype(dtype) for _ in range(2))
    lengths = np.array([150, 0, 30], np.int32)
    call = dict(k=k_new, v=v_new, causal=True, return_lse=True, backend="cupy")
    results = {}
    for checked in (True, False):
        kc, vc = k_cache.copy(), v_cache.copy()
        with emulated(compile=_recording([])), monkeypatch.context() as m:
            if not checked:
                m.setattr(_varlen, "_host_ints", lambda *a: pytest.fail("the lengths were read on the host"))
            out, lse = flashcupy.attention_with_kvcache(q, kc, vc, cache_seqlens=lengths, check_offsets=checked,
                                                        **call)
        results[checked] = (out, lse, kc, vc)
    for a, b in zip(results[True], results[False]):
        np.testing.assert_array_equal(a, b)
    for bad in ([-5, 2 ** 31 - 1, C], [C + 10, C - 1, -2 ** 31]):
        with emulated(compile=_recording([])):
            out, lse = flashcupy.attention_with_kvcache(q, k_cache.copy(), v_cache.copy(), check_offsets=False,
                                                        cache_seqlens=np.array(bad, np.int32), **call)
        assert out.shape == q.shape and lse.shape == (B, Hq, new)



def test_unchecked_cache_lengths_keep_the_checks_that_read_no_value(rng):
    # check_offsets=False still refuses lengths of the wrong library, dtype or shape, before any work
    k_cache, v_cache = cache_inputs(rng, 2, 8, 1, 8)
    q = rng.standard_normal((2, 1, 1, 8)).astype(np.float32)
    for bad, error, message in ((np.zeros(3, np.int32), ValueError, r"cache_seqlens must have shape \(batch,\) = \(2,\)"),
                                (np.zeros(2, np.int64), TypeError, "cache_seqlens must have dtype int32"),
                                ([0, 0], TypeError, "cache_seqlens must be an int32 array of q's library")):
        with pytest.raises(error, match=message):
            flashcupy.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=bad, check_offsets=False)


# ----------------------------------------------------------------------------
# a paged cache's decode in one launch (the cupy backend, emulated): forward_varlen with a block table


def _paged_step_case(rng, dtype, block_size):
    """(q, k_cache, v_cache, block_table, lengths, k_new, v_new, keys): a paged cache of 4 sequences, 2 new
    tokens each, GQA; sequence 1 shares sequence 0's first blocks (a common prefix it only reads), sequence 2
    has no cached token, sequence 0 fills its blocks; keys[b] the (keys, values) sequence b attends to once
    the new tokens are in, gathered on the host from the table."""
    B, Hq, Hkv, D, new = 4, 4, 2, 32, 2
    per = max(2, -(-40 // block_size))  # blocks a sequence
    C = per * block_size
    k_cache, v_cache = cache_inputs(rng, per * B + 3, block_size, Hkv, D, dtype)
    table = rng.permutation(per * B + 3)[:per * B].reshape(B, per).astype(np.int32)
    shared = per // 2
    table[1, :shared] = table[0, :shared]
    lengths = np.array([C - new, shared * block_size + 1, 0, rng.integers(0, C - new + 1)], np.int32)
    q = rng.standard_normal((B, new, Hq, D)).astype(dtype)
    k_new, v_new = (rng.standard_normal((B, new, Hkv, D)).astype(dtype) for _ in range(2))
    want_k, want_v = k_cache.copy(), v_cache.copy()
    for b in range(B):
        for j in range(new):
            n = lengths[b] + j
            want_k[table[b, n // block_size], n % block_size] = k_new[b, j]
            want_v[table[b, n // block_size], n % block_size] = v_new[b, j]
    keys = [tuple(x[table[b]].reshape(1, C, Hkv, D)[:, :lengths[b] + new] for x in (want_k, want_v)) for b in range(B)]
    return q, k_cache, v_cache, table, lengths, k_new, v_new, keys


@pytest.mark.parametrize("block_size", [1, 16, 48, 256], ids=lambda n: f"page-{n}")
@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=["tensor-cores", "simt"])
def test_cupy_paged_cache_step_is_two_launches_in_both_checking_modes(rng, dtype, block_size, monkeypatch):
    # append and attention over a paged cache, two launches (three with split-KV's merge): the forward reads
    # every key through the block
    # table (CacheRows), for pages that divide no tile (1, 48), match one (16) or hold several (256),
    # blocks shared between sequences, split-KV where the cache is longer than a split; check_offsets=False
    # reads neither the lengths nor the table on the host and gives the same bits and cache
    from flashcupy import _varlen
    from flashcupy.tools.emulator.cupy import emulated
    q, k_cache, v_cache, table, lengths, k_new, v_new, keys = _paged_step_case(rng, dtype, block_size)
    results = {}
    for checked in (True, False):
        kc, vc, grids = k_cache.copy(), v_cache.copy(), []
        with emulated(compile=_recording(grids)), monkeypatch.context() as m:
            if not checked:
                m.setattr(_varlen, "_host_ints", lambda *a: pytest.fail("the lengths or the table were read on the host"))
            out, lse = flashcupy.attention_with_kvcache(q, kc, vc, k=k_new, v=v_new, cache_seqlens=lengths,
                                                        block_table=table, causal=True, return_lse=True,
                                                        backend="cupy", check_offsets=checked)
        names = [name for name, _ in grids]
        forward = "flash_fwd_tc<" if dtype == np.float16 else "flash_fwd<"
        # the packed forward (VARLEN), split (SPLIT, then the merge) where the cache is longer than one split
        split = table.shape[1] * block_size > 128
        assert len(names) == 2 + split and names[0].startswith("flash_kv_append<") and names[1].startswith(forward)
        assert names[1].endswith(", true, true>" if split else ", false, true>"), names
        assert [name.split("<")[0] for name in names[2:]] == (["flash_split_merge"] if split else []), names
        results[checked] = (out, lse, kc, vc)
    for a, b in zip(results[True], results[False]):
        np.testing.assert_array_equal(a, b)
    out, lse, kc, vc = results[True]
    for b, (keys_b, values_b) in enumerate(keys):
        assert_matches_oracle((out[b:b + 1], lse[b:b + 1]), q[b:b + 1], keys_b, values_b, causal=True, backend="cupy")


PAGE_CLAMP = ("const int page = min(max(table[(i / page_size) * table_stride], 0), last_page);",
              "const int page = table[(i / page_size) * table_stride];")


@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=["tensor-cores", "simt"])
@pytest.mark.parametrize("unclamped", [False, True], ids=["clamped", "unclamped (a deliberate bug)"])
def test_paged_attention_keeps_hostile_tables_inside_the_cache(rng, dtype, unclamped):
    # forward_varlen through a block table (checked by the interface before; the kernel must not depend on
    # it): table entries and lengths outside the cache read inside it, where the guard pages stay silent;
    # with the clamp of the table's entries removed they catch it
    from flashcupy._checks import problem
    from flashcupy.backends import cupy_backend
    from flashcupy.tools.emulator.cupy import emulated
    q, k_cache, v_cache, table, _, _, _, _ = _paged_step_case(rng, dtype, 16)
    B, Sq, Hq, D = q.shape
    pq = q.reshape(B * Sq, Hq, D)
    p = problem(pq[None], k_cache[None, 0], v_cache[None, 0], True, None, None, "numpy")
    p = dataclasses.replace(p, seqlen_k=table.shape[1] * 16)
    cu_q, cu_k = np.arange(B + 1, dtype=np.int32) * Sq, np.zeros(B + 1, np.int32)
    bad = table.copy()
    bad[0, :2], bad[1, 1:], bad[3, :] = -1, 10 ** 6, 2 ** 31 - 1
    for used in ([40, 2, 64, 2 ** 31 - 1], [-5, 30, 17, 50]):
        out, lse = np.zeros_like(pq), np.full((Hq, B * Sq), -np.inf, np.float32)
        with emulated(compile=_recording([], PAGE_CLAMP if unclamped else None)):
            _fails_only_if(unclamped, "flash_fwd", lambda: cupy_backend.forward_varlen(
                p, pq, k_cache, v_cache, cu_q, cu_k, out, lse, seqused_k=np.array(used, np.int32), block_table=bad))
