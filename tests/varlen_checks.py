"""Packed variable-length batches and KV caches: the inputs, and the checks every backend runs.

tests/test_varlen.py runs these checks on NumPy and the emulated cupy backend,
tests/test_numba_backend.py on numba; each takes the backend's name.
"""

from __future__ import annotations

import numpy as np
from conftest import BF16, assert_matches_oracle, bf16_bits

import flashcupy


def packed_inputs(rng, lengths_q, lengths_k, Hq, Hkv, D, dtype=np.float32, Dv=None):
    """(q, k, v, cu_q, cu_k): random sequences packed along the tokens, and their int32 offsets; v of
    head_dim Dv (None: D)."""
    q = rng.standard_normal((sum(lengths_q), Hq, D)).astype(dtype)
    k, v = (rng.standard_normal((sum(lengths_k), Hkv, d)).astype(dtype) for d in (D, Dv or D))
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (lengths_q, lengths_k))
    return q, k, v, cu_q, cu_k


def packed_batch_matches_the_oracle(rng, backend, lengths=([3, 6], [7, 2]), dtype=np.float32, head_dim=8,
                                    heads=(2, 1), mods=None, backward=False, deterministic=False, head_dim_v=None):
    """A packed batch (by default causal, with GQA, Sq < Sk and Sq > Sk), each sequence's out and lse
    against the oracle, the same bits whether the offsets are checked on the host or not
    (check_offsets); mods: attention_varlen's keywords, alibi_slopes="per-seq" for (batch, heads_q)
    random slopes. dtype BF16: the inputs passed as bits with dtype="bfloat16". backward: dq, dk, dv
    too (attention_varlen_backward, `deterministic` passed on, with a gradient of lse: NaN in the rows
    that see no key, which must add nothing), checked and unchecked the same bits (on the emulator: its
    thread order is the same from run to run, so are the atomics' sums). head_dim_v: v's (None: head_dim)."""
    lengths_q, lengths_k = lengths
    q, k, v, cu_q, cu_k = packed_inputs(rng, lengths_q, lengths_k, *heads, head_dim, dtype, head_dim_v)
    mods = dict(causal=True) if mods is None else dict(mods)
    if dtype == BF16:
        q, k, v = map(bf16_bits, (q, k, v))
        mods["dtype"] = "bfloat16"
    if isinstance(mods.get("alibi_slopes"), str) and mods["alibi_slopes"] == "per-seq":
        mods["alibi_slopes"] = rng.uniform(0.1, 1, (len(lengths_q), heads[0])).astype(np.float32)
    out, lse = flashcupy.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, backend=backend, **mods)
    unchecked = flashcupy.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, backend=backend,
                                           check_offsets=False, **mods)
    got = [out, lse]
    if backward:
        dout = rng.standard_normal(out.shape).astype(np.float32)
        dout = bf16_bits(dout.astype(BF16)) if dtype == BF16 else dout.astype(dtype)
        dlse = np.where(np.isneginf(lse), np.nan, rng.standard_normal(lse.shape)).astype(lse.dtype)
        keywords = dict(backend=backend, deterministic=deterministic, dlse=dlse, **mods)
        got += flashcupy.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, **keywords)
        unchecked += flashcupy.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, check_offsets=False,
                                                         **keywords)
    for a, b in zip(got, unchecked):
        np.testing.assert_array_equal(a, b)
    for b in range(len(lengths_q)):
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        one = dict(mods)
        if one.get("alibi_slopes") is not None and one["alibi_slopes"].ndim == 2:
            one["alibi_slopes"] = one["alibi_slopes"][b]
        mine = (out[None, sq], lse[None, :, sq])
        if backward:
            mine += (got[2][None, sq], got[3][None, sk], got[4][None, sk])
            one["dlse"] = dlse[None, :, sq]
        assert_matches_oracle(mine, q[None, sq], k[None, sk], v[None, sk], *((dout[None, sq],) if backward else ()),
                              backend=backend, **one)


def dropped_sequences_match_the_oracle(got, q, k, v, dout, cu_q, cu_k, backend, **keywords) -> None:
    """A packed batch's (out, lse, dq, dk, dv) with dropout against the oracle, each sequence b on its own
    with the keep mask's origin (b, 0, 0, 0): a packed batch draws sequence b as batch b."""
    out, lse, dq, dk, dv = got
    for b in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if rows.start == rows.stop:
            continue
        parts = (out[rows], lse[:, rows], dq[rows], dk[keys], dv[keys])
        assert_matches_oracle(tuple(x[None] for x in parts), q[None, rows], k[None, keys], v[None, keys],
                              dout[None, rows], backend=backend, dropout_origin=(b, 0, 0, 0), **keywords)


def cache_inputs(rng, batch, capacity, Hkv, D, dtype=np.float32):
    """A random (k_cache, v_cache), each (batch, capacity, Hkv, D)."""
    return (rng.standard_normal((batch, capacity, Hkv, D)).astype(dtype) for _ in range(2))


def appended_rows(k_cache, v_cache, table, lengths, k_new, v_new) -> list:
    """Each sequence's (keys, values) as attention_with_kvcache should leave them: its rows of the cache
    (through the block table where paged; copies), with k_new, v_new (or None) written after its
    lengths[b] cached tokens."""
    Hkv, D = k_cache.shape[2:]
    rows = [(k_cache[table[b]].reshape(-1, Hkv, D), v_cache[table[b]].reshape(-1, Hkv, D)) if table is not None
            else (k_cache[b].copy(), v_cache[b].copy()) for b in range(len(lengths))]
    for b, (keys, values) in enumerate(rows):
        if k_new is not None:
            n = k_new.shape[1]
            keys[lengths[b]:lengths[b] + n], values[lengths[b]:lengths[b] + n] = k_new[b], v_new[b]
    return rows


def appends_across_a_block_boundary(rng, backend):
    """Two new tokens after 7 (and 15) cached ones in blocks of 8, through a block table whose blocks
    are neither in order nor back to back: each token lands in the block its position names (and
    nothing else moves), and attention, causal over the new queries, reads it."""
    B, bs, Hq, Hkv, D, new = 2, 8, 2, 1, 8, 2
    table = np.array([[5, 2, 7], [0, 6, 3]], np.int32)
    lengths = np.array([7, 15], np.int32)
    k_pages, v_pages = cache_inputs(rng, 8, bs, Hkv, D)
    q = rng.standard_normal((B, new, Hq, D)).astype(np.float32)
    k_new, v_new = (rng.standard_normal((B, new, Hkv, D)).astype(np.float32) for _ in range(2))
    want_k, want_v = k_pages.copy(), v_pages.copy()
    for b in range(B):
        for j in range(new):
            at = lengths[b] + j
            want_k[table[b, at // bs], at % bs], want_v[table[b, at // bs], at % bs] = k_new[b, j], v_new[b, j]
    out, lse = flashcupy.attention_with_kvcache(q, k_pages, v_pages, k=k_new, v=v_new, cache_seqlens=lengths,
                                                block_table=table, causal=True, return_lse=True, backend=backend)
    np.testing.assert_array_equal(k_pages, want_k)
    np.testing.assert_array_equal(v_pages, want_v)
    for b in range(B):
        n = lengths[b] + new
        keys, values = (x[table[b]].reshape(1, -1, Hkv, D)[:, :n] for x in (want_k, want_v))
        assert_matches_oracle((out[b:b + 1], lse[b:b + 1]), q[b:b + 1], keys, values, causal=True, backend=backend)


def kv_cache_with_its_own_value_head_dim(rng, backend, dtype=np.float32, paged=True, shared=False, capacity=144):
    """attention_with_kvcache with v of head dim 8 and q, k of 16: 3 sequences (one with no cached token),
    2 new tokens each, GQA, causal, num_splits 2; paged: blocks of 8 in shuffled order through a table;
    shared: v_cache the view of k_cache's first 8 columns and v_new of k_new's (MLA's latent), read and
    appended through the one memory. The append writes each of k and v at its own width (the cache
    after it against one written on the host) and out (head dim 8) and lse match the oracle over each
    sequence's keys."""
    B, Hq, Hkv, D, Dv, new, bs = 3, 4, 2, 16, 8, 2, 8
    blocks = B * capacity // bs + 2 if paged else B
    k_cache = rng.standard_normal((blocks, bs if paged else capacity, Hkv, D)).astype(dtype)
    v_cache = (k_cache[..., :Dv] if shared
               else rng.standard_normal(k_cache.shape[:3] + (Dv,)).astype(dtype))
    table = (rng.permutation(blocks)[:B * capacity // bs].reshape(B, capacity // bs).astype(np.int32) if paged
             else None)
    lengths = np.array([5, 0, capacity - new], np.int32)
    q = rng.standard_normal((B, 3, Hq, D)).astype(dtype)
    k_new = rng.standard_normal((B, new, Hkv, D)).astype(dtype)
    v_new = k_new[..., :Dv] if shared else rng.standard_normal((B, new, Hkv, Dv)).astype(dtype)
    want_k, want_v = k_cache.copy(), v_cache.copy()
    for b in range(B):
        for j in range(new):
            n = lengths[b] + j
            at = (table[b, n // bs], n % bs) if paged else (b, n)
            want_k[at], want_v[at] = k_new[b, j], v_new[b, j]
    out, lse = flashcupy.attention_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=lengths,
                                                block_table=table, causal=True, num_splits=2, return_lse=True,
                                                backend=backend)
    np.testing.assert_array_equal(k_cache, want_k)
    np.testing.assert_array_equal(v_cache, want_v)
    assert out.shape == (B, 3, Hq, Dv)
    for b in range(B):
        keys, values = ((x[table[b]] if paged else x[b]).reshape(1, capacity, Hkv, -1)[:, :lengths[b] + new]
                        for x in (want_k, want_v))
        assert_matches_oracle((out[b:b + 1], lse[b:b + 1]), q[b:b + 1], keys, values, causal=True, backend=backend)


def per_sequence_alibi_in_a_kvcache(rng, backend):
    """ALiBi slopes of shape (batch, heads_q) over a cache: each sequence uses its own row, as
    `attention` on that sequence alone does (the same bits) and as the oracle says."""
    B, C, Hq, Hkv, D = 3, 16, 4, 2, 8
    k_cache, v_cache = cache_inputs(rng, B, C, Hkv, D)
    lengths = np.array([9, 16, 4], np.int32)
    slopes = rng.uniform(0.1, 1, (B, Hq)).astype(np.float32)
    q = rng.standard_normal((B, 2, Hq, D)).astype(np.float32)
    out, lse = flashcupy.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, alibi_slopes=slopes,
                                                causal=True, return_lse=True, backend=backend)
    for b in range(B):
        one = (q[b:b + 1], k_cache[b:b + 1, :lengths[b]], v_cache[b:b + 1, :lengths[b]])
        assert_matches_oracle((out[b:b + 1], lse[b:b + 1]), *one, causal=True, alibi_slopes=slopes[b], backend=backend)
        alone = flashcupy.attention(*one, causal=True, alibi_slopes=slopes[b], return_lse=True, backend=backend)
        np.testing.assert_array_equal(out[b:b + 1], alone[0])
        np.testing.assert_array_equal(lse[b:b + 1], alone[1])


def split_cache_parts_round_once(rng, backend):
    """A float16 cache whose keys come in parts (num_splits=2 on a contiguous cache; a paged one whose
    two blocks lie apart, merged by the lse rule on the backends that loop on the host): out is rounded
    to float16 once, after the merge, as one call's is, within the one tolerance rule. The values are
    about +100 in one part and -100 in the other, with the parts' weights about equal, so that out is
    small beside each part's: a part's out rounded to float16 first errs by ~0.05 (6 times the rule)."""
    B, bs, Hq, Hkv, D = 1, 16, 2, 1, 8
    q = (0.01 * rng.standard_normal((B, 1, Hq, D))).astype(np.float16)
    k = rng.standard_normal((B, 2 * bs, Hkv, D)).astype(np.float16)
    v = (100 * np.sign(np.arange(2 * bs) - bs + 0.5)[None, :, None, None]
         + rng.standard_normal((B, 2 * bs, Hkv, D))).astype(np.float16)
    out, lse = flashcupy.attention_with_kvcache(q, k, v, num_splits=2, return_lse=True, backend=backend)
    assert_matches_oracle((out, lse), q, k, v, backend=backend)
    pages = [np.zeros((3, bs, Hkv, D), np.float16) for _ in range(2)]
    table = np.array([[2, 0]], np.int32)
    for x, page in zip((k, v), pages):
        page[table[0]] = x.reshape(2, bs, Hkv, D)
    out, lse = flashcupy.attention_with_kvcache(q, *pages, block_table=table, return_lse=True, backend=backend)
    assert_matches_oracle((out, lse), q, k, v, backend=backend)
