"""flashcupy.dask against the oracle: every chunking gives the whole call's answer, forward and
backward, and pairs outside the causal band are not in the graph."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import BF16, DTYPES, assert_matches_oracle, bf16_bits, bf16_ties, make_qkv
from reference.compare import error_ratio, expected

import flashcupy
import flashcupy.dask as fdask

da = pytest.importorskip("dask.array", reason="flashcupy.dask needs the dask extra (in the test extra)")
import dask  # noqa: E402

# flashcupy.dask merges the outs of key chunks, each stored in the dtype first: no one kernel
# family's results (conftest.assert_matches_oracle's backend None, every family's liberties)
MERGED = None


def _chunked(q, k, v, q_seq, k_seq, heads_kv=1, batch=1):
    group = q.shape[2] // k.shape[2]
    Q = da.from_array(q, chunks=(batch, q_seq, heads_kv * group, -1))
    K = da.from_array(k, chunks=(batch, k_seq, heads_kv, -1))
    return Q, K, da.from_array(v, chunks=K.chunks)


# (B, Sq, Sk, Hq, Hkv, D, causal, q chunks, k chunks): uneven chunks, a chunk of one, causal with
# Sq < Sk and Sq > Sk (query chunks that see no key chunk), GQA with head chunks
CASES = [
    (2, 37, 53, 4, 2, 16, False, (10, 1, 26), (20, 13, 20)),
    (2, 37, 53, 4, 2, 16, True, (10, 1, 26), (20, 13, 20)),
    (1, 40, 17, 2, 1, 8, True, (7, 7, 7, 7, 12), (1, 16)),
    (1, 33, 33, 6, 3, 8, True, 8, 5),
    (1, 1, 9, 2, 2, 8, False, 1, (4, 5)),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[1]}x{c[2]}{'-causal' if c[6] else ''}-{c[7]}-{c[8]}")
def test_every_chunking_matches_the_oracle(rng, case, dtype):
    B, Sq, Sk, Hq, Hkv, D, causal, q_seq, k_seq = case
    q, k, v = make_qkv(rng, B, Sq, Sk, Hq, Hkv, D, dtype)
    dout = rng.standard_normal(q.shape).astype(dtype)
    Q, K, V = _chunked(q, k, v, q_seq, k_seq)
    out, vjp = fdask.attention_vjp(Q, K, V, causal=causal)
    lse = fdask.attention(Q, K, V, causal=causal, return_lse=True)[1]
    got = dask.compute(out, lse, *vjp(da.from_array(dout, chunks=(1, 3, 1, -1))), scheduler="sync")
    assert [x.dtype for x in got] == [q.dtype, np.float64 if dtype == np.float64 else np.float32] + [q.dtype] * 3
    assert_matches_oracle(got, q, k, v, dout, causal=causal, backend=MERGED)


MODIFIED = [  # keywords (ALiBi slopes made per case): windows, softcap and ALiBi mean on a chunk what
    # they mean on the whole arrays, because each pair is told its global diagonal
    dict(window=(5, 2)),
    dict(causal=True, window=(6, None)),
    dict(window=(None, 0), softcap=2.0),
    dict(causal=True, alibi_slopes=(4,)),
    dict(alibi_slopes=(2, 4), window=(3, 3)),
]


@pytest.mark.parametrize("mods", MODIFIED, ids=lambda m: "-".join(sorted(m)))
def test_modifiers_match_the_oracle(rng, mods):
    mods = dict(mods)
    q, k, v = make_qkv(rng, 2, 23, 29, 4, 2, 8, np.float32)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    if "alibi_slopes" in mods:
        mods["alibi_slopes"] = rng.uniform(0.1, 1, mods["alibi_slopes"]).astype(np.float32)
    dlse = rng.standard_normal((2, 4, 23)).astype(np.float32)  # the gradient of lse too, in chunks of its own
    Q, K, V = _chunked(q, k, v, (6, 1, 16), (8, 8, 13))
    out, vjp = fdask.attention_vjp(Q, K, V, **mods)
    lse = fdask.attention(Q, K, V, return_lse=True, **mods)[1]
    got = dask.compute(out, lse, *vjp(da.from_array(dout, chunks=Q.chunks), da.from_array(dlse, chunks=(1, 3, 10))))
    assert_matches_oracle(got, q, k, v, dout, backend="numpy", dlse=dlse, **mods)


def test_bfloat16_bits_round_ties_to_even(rng):
    # two key chunks whose outs are adjacent bfloat16 values, with equal lse: the merged out, stored
    # once as bits, lies halfway between two bfloat16 values in every element
    q, k, v, want = bf16_ties(rng, 1, 6, 16, 4, 2, 8)
    Q, K, V = _chunked(q, k, v, 3, 8)
    out, lse = dask.compute(*fdask.attention(Q, K, V, return_lse=True, dtype="bfloat16"), scheduler="sync")
    assert out.dtype == np.uint16
    np.testing.assert_array_equal(out, want)
    assert_matches_oracle((out, lse), q, k, v, dtype="bfloat16", backend=MERGED)


def test_head_chunks_and_the_threaded_scheduler_give_the_single_calls_bits(rng):
    # float64, one key chunk per query chunk: nothing to merge, so the bits are the single call's;
    # with several key chunks the results agree to rounding
    q, k, v = make_qkv(rng, 2, 24, 24, 4, 2, 8, np.float64)
    Q, K, V = _chunked(q, k, v, 24, 24, heads_kv=1)
    np.testing.assert_array_equal(fdask.attention(Q, K, V, causal=True).compute(scheduler="threads"),
                                  flashcupy.attention(q, k, v, causal=True))
    Q, K, V = _chunked(q, k, v, 5, 7, heads_kv=1)
    np.testing.assert_allclose(fdask.attention(Q, K, V, causal=True).compute(scheduler="threads"),
                               flashcupy.attention(q, k, v, causal=True), rtol=0, atol=1e-14)


def _pair_tasks(x, kind):
    return [key for key in dict(x.__dask_graph__()) if isinstance(key, tuple) and key[0].startswith(kind)]


def test_pairs_outside_the_causal_band_are_not_in_the_graph(rng):
    q, k, v = make_qkv(rng, 1, 64, 64, 1, 1, 8, np.float32)
    Q, K, V = _chunked(q, k, v, 16, 16)
    out, vjp = fdask.attention_vjp(Q, K, V, causal=True)
    assert len(_pair_tasks(out, "flashcupy-pair-")) == 4 + 3 + 2 + 1  # the lower triangle of 4 x 4
    dq, dk, dv = vjp(da.from_array(np.ones_like(q), chunks=Q.chunks))
    assert len(_pair_tasks(dq, "flashcupy-pair-grad-")) == 10
    # without causal every pair is there; a window of 8 keys to the left keeps the diagonal pairs and
    # the ones just below
    assert len(_pair_tasks(fdask.attention(Q, K, V), "flashcupy-pair-")) == 16
    assert len(_pair_tasks(fdask.attention(Q, K, V, causal=True, window=(8, None)), "flashcupy-pair-")) == 4 + 3


def test_merge_tree_of_many_key_chunks(rng):
    # more key chunks than SPLIT_EVERY: the merge and the gradient sums go two levels deep
    q, k, v = make_qkv(rng, 1, 6, 40, 2, 1, 8, np.float32)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    Q, K, V = _chunked(q, k, v, 3, 2)
    assert len(K.chunks[1]) > fdask.SPLIT_EVERY
    out, vjp = fdask.attention_vjp(Q, K, V)
    lse = fdask.attention(Q, K, V, return_lse=True)[1]
    got = dask.compute(out, lse, *vjp(da.from_array(dout, chunks=Q.chunks)))
    assert_matches_oracle(got, q, k, v, dout, backend=MERGED)


def test_backward_from_a_computed_forward_in_other_chunks(rng):
    q, k, v = make_qkv(rng, 1, 20, 12, 2, 1, 8, np.float32)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    Q, K, V = _chunked(q, k, v, 6, 5)
    out, lse = dask.persist(*fdask.attention(Q, K, V, causal=True, return_lse=True))
    grads = fdask.attention_backward(da.from_array(dout, chunks=7), Q, K, V, out.rechunk(4), lse.rechunk(3),
                                     causal=True)
    assert [g.chunks for g in grads] == [Q.chunks, K.chunks, K.chunks]
    assert_matches_oracle(dask.compute(out, lse, *grads), q, k, v, dout, causal=True, backend=MERGED)
    with pytest.raises(ValueError, match="lse must have shape"):
        fdask.attention_backward(out, Q, K, V, out, lse[:, :1], causal=True)


def test_a_local_cluster_of_worker_processes(rng):
    distributed = pytest.importorskip("distributed", reason="in the dask extra")
    q, k, v = make_qkv(rng, 1, 30, 30, 2, 1, 8, np.float32)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    Q, K, V = _chunked(q, k, v, 10, 10)
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=None) as cluster, \
            distributed.Client(cluster) as client:
        out, vjp = fdask.attention_vjp(Q, K, V, causal=True)
        lse = fdask.attention(Q, K, V, causal=True, return_lse=True)[1]
        got = client.compute([out, lse, *vjp(da.from_array(dout, chunks=Q.chunks))], sync=True)
    assert_matches_oracle(got, q, k, v, dout, causal=True, backend=MERGED)


BAD = [  # (what, arrays from (q, k, v) chunked as in _chunked(..., 4, 4), error, message)
    ("a numpy q", lambda Q, K, V, q: (q, K, V), TypeError, "q must be a dask.array.Array"),
    ("head_dim in chunks", lambda Q, K, V, q: (Q.rechunk({3: 4}), K, V), ValueError, "head_dim in one chunk"),
    ("batch chunks", lambda Q, K, V, q: (Q.rechunk({0: 2}), K, V), ValueError, "same batch chunks"),
    ("k and v chunks", lambda Q, K, V, q: (Q, K, V.rechunk({1: 3})), ValueError, "k and v must have the same chunks"),
    ("head chunks", lambda Q, K, V, q: (Q.rechunk({2: 1}), K, V), ValueError, "times the group size 2"),
    ("rank", lambda Q, K, V, q: (Q[0], K, V), ValueError, "q must have rank at least 4"),
    ("dtype", lambda Q, K, V, q: (Q.astype(np.int32), K, V), TypeError, "q must have dtype"),
]


@pytest.mark.parametrize("what, change, error, message", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_refused_before_any_work(rng, what, change, error, message):
    q, k, v = make_qkv(rng, 2, 8, 8, 2, 1, 8, np.float32)
    Q, K, V = _chunked(q, k, v, 4, 4)
    with pytest.raises(error, match=message):
        fdask.attention(*change(Q, K, V, q))


@pytest.mark.parametrize("B, Sq, Sk", [(1, 0, 5), (1, 5, 0), (1, 0, 0), (0, 4, 4)])
def test_empty_inputs_give_results_of_the_right_shapes(rng, B, Sq, Sk):
    # as attention's: out 0, lse -inf, gradients and dbias 0 (the stand-in q of the whole call once
    # failed to fold its leading dimensions at size 0)
    q, k, v = make_qkv(rng, B, Sq, Sk, 2, 1, 8, np.float32)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    bias = rng.standard_normal((1, 2, Sq, Sk)).astype(np.float32)
    Q, K, V = (da.from_array(x) for x in (q, k, v))
    out, vjp = fdask.attention_vjp(Q, K, V, bias=bias, causal=True)
    lse = fdask.attention(Q, K, V, bias=bias, causal=True, return_lse=True)[1]
    got = dask.compute(out, lse, *vjp(da.from_array(dout)), scheduler="sync")
    assert [x.shape for x in got] == [q.shape, (B, 2, Sq), q.shape, k.shape, v.shape, bias.shape]
    assert_matches_oracle(got, q, k, v, dout, bias=bias, causal=True, backend=MERGED)


def test_deterministic_reaches_every_pair(rng, monkeypatch):
    # each pair's backward gets the keyword (CuPy chunks' tensor-core kernels add dq with atomics
    # without it: tests/test_cupy_gpu.py checks the bits there); a non-bool is refused before any work
    q, k, v = make_qkv(rng, 1, 12, 12, 2, 1, 8, np.float32)
    Q, K, V = _chunked(q, k, v, 4, 6)
    seen = []
    backward = fdask._api.backward
    monkeypatch.setattr(fdask._api, "backward", lambda *a, **kw: seen.append(kw["deterministic"]) or backward(*a, **kw))
    dout = da.from_array(np.ones_like(q), chunks=Q.chunks)
    for deterministic in (True, False):
        seen.clear()
        out, vjp = fdask.attention_vjp(Q, K, V, causal=True, deterministic=deterministic)
        dask.compute(*vjp(dout), scheduler="sync")
        out, lse = fdask.attention(Q, K, V, causal=True, return_lse=True)
        dask.compute(*fdask.attention_backward(dout, Q, K, V, out, lse, causal=True, deterministic=deterministic),
                     scheduler="sync")
        assert seen == [deterministic] * 10  # the 5 pairs of the 3 x 2 causal grid, twice
    for call in (lambda: fdask.attention_vjp(Q, K, V, deterministic=1),
                 lambda: fdask.attention_backward(dout, Q, K, V, out, lse, deterministic="yes")):
        with pytest.raises(TypeError, match="deterministic must be a bool"):
            call()


def test_bad_dout_is_refused(rng):
    q, k, v = make_qkv(rng, 1, 8, 8, 1, 1, 8, np.float32)
    _, vjp = fdask.attention_vjp(*_chunked(q, k, v, 4, 4))
    with pytest.raises(TypeError, match="dout must be a dask.array.Array"):
        vjp(q)
    with pytest.raises(TypeError, match="dout must have dtype float32"):
        vjp(da.zeros(q.shape, np.float64))
    with pytest.raises(ValueError, match="dout must have shape"):
        vjp(da.zeros((1, 7, 1, 8), np.float32))


def test_leading_batch_dimensions(rng):
    """q (2, 3, S, H, D) chunked along both leading dimensions, the sequence and the heads; per-element
    ALiBi slopes (2, 3, heads_q) sliced per chunk; a transposed (ending-node) view too."""
    base = [rng.standard_normal((3, 2, S, H, 8)).astype(np.float32) for S, H in ((19, 4), (23, 2), (23, 2))]
    slopes = rng.uniform(0.05, 0.5, (2, 3, 4)).astype(np.float32)
    for q, k, v in ([np.ascontiguousarray(x.transpose(1, 0, 2, 3, 4)) for x in base],
                    [x.transpose(1, 0, 2, 3, 4) for x in base]):
        dout = rng.standard_normal(q.shape).astype(np.float32)
        Q = da.from_array(q, chunks=(1, (2, 1), 7, 2, -1))
        K = da.from_array(k, chunks=(1, (2, 1), 10, 1, -1))
        V = da.from_array(v, chunks=K.chunks)
        out, vjp = fdask.attention_vjp(Q, K, V, causal=True, alibi_slopes=slopes)
        lse = fdask.attention(Q, K, V, causal=True, alibi_slopes=slopes, return_lse=True)[1]
        got = dask.compute(out, lse, *vjp(da.from_array(dout, chunks=Q.chunks)), scheduler="sync")
        assert lse.chunks == ((1, 1), (2, 1), (2, 2), (7, 7, 5))
        assert_matches_oracle(got, q, k, v, dout, causal=True, alibi_slopes=slopes, backend=MERGED)


# (name, q dtype, bias: (shape, dtype, dask chunks or None for an array of the chunks' library),
# mask shape or None, keywords): a pair bias broadcast over the batch (AlphaFold), a rank-2 bias, a
# key-padding mask that hides whole key chunks and the last rows' every key, a float32 bias under
# float16, bfloat16 bits and float64 values (each pair's dbias summed in the accumulation dtype,
# rounded once), a bias in chunks of its own, causal and a window (dbias blocks no pair reaches: 0)
BIASED = [
    ("pair-bias", np.float32, ((1, 4, 23, 29), np.float32, (1, 2, 5, 7)), None, dict(causal=True)),
    ("rank2-mask", np.float32, ((23, 29), np.float32, None), (2, 1, 23, 29), dict(window=(4, 3))),
    ("padding-mask", np.float16, ((2, 4, 23, 29), np.float16, None), (2, 1, 1, 29), {}),
    ("float32-bias", np.float16, ((1, 1, 23, 29), np.float32, (1, 1, 23, 29)), None, dict(causal=True)),
    ("bfloat16-bits", "bfloat16", ((2, 1, 23, 1), "bfloat16", (1, 1, 4, 1)), (1, 4, 23, 1), {}),
    ("float64", np.float64, ((4, 1, 29), np.float32, None), (23, 29), dict(softcap=3.0)),
]


def _array(rng, dtype, shape):
    """A random normal array of dtype; "bfloat16" as uint16 bits (what the call and the oracle get)."""
    x = rng.standard_normal(shape)
    return bf16_bits(x.astype(BF16)) if dtype == "bfloat16" else x.astype(dtype)


@pytest.mark.parametrize("name, dtype, bias_spec, mask_shape, mods", BIASED, ids=[c[0] for c in BIASED])
def test_bias_and_mask_match_the_oracle(rng, name, dtype, bias_spec, mask_shape, mods):
    q, k, v = (_array(rng, dtype, s) for s in ((2, 23, 4, 8), (2, 29, 2, 8), (2, 29, 2, 8)))
    dout = _array(rng, dtype, q.shape)
    shape, bias_dtype, chunks = bias_spec
    bias = _array(rng, bias_dtype, shape)
    mask = None
    if mask_shape is not None:
        mask = rng.random(mask_shape) < 0.8
        if mask.shape[-1] > 1:  # the first slice's last key chunk hidden: pairs that see no key at all
            mask.reshape(-1, *mask.shape[-2:])[0, :, 16:] = False
        if mask.shape[-2] > 1:
            mask[..., -2:, :] = False  # rows that see no key
    kind = "bfloat16" if dtype == "bfloat16" else None
    Q, K, V = _chunked(q, k, v, (6, 1, 16), (8, 8, 13), heads_kv=2)
    Bias = bias if chunks is None else da.from_array(bias, chunks=chunks)
    out, vjp = fdask.attention_vjp(Q, K, V, bias=Bias, mask=mask, dtype=kind, **mods)
    lse = fdask.attention(Q, K, V, bias=Bias, mask=mask, return_lse=True, dtype=kind, **mods)[1]
    grads = vjp(da.from_array(dout, chunks=Q.chunks))
    assert grads[3].shape == bias.shape and grads[3].dtype == bias.dtype
    if chunks is not None:  # a dask bias's dbias comes back in its chunks (a plain one's: the pairs' grid)
        assert grads[3].chunks == Bias.chunks
    got = dask.compute(out, lse, *grads, scheduler="threads")
    assert_matches_oracle(got, q, k, v, dout, bias=bias, mask=mask, dtype=kind, backend=MERGED, **mods)
    # the bias held constant: (dq, dk, dv) alone, and no task in the graph for dbias
    held = fdask.attention_backward(da.from_array(dout, chunks=Q.chunks), Q, K, V, out, lse, bias=Bias, mask=mask,
                                    dtype=kind, return_dbias=False, **mods)
    assert len(held) == 3 and not any("dbias" in str(key) for x in held for key in dict(x.dask))
    assert_matches_oracle(got[:2] + dask.compute(*held, scheduler="threads"), q, k, v, dout, bias=bias, mask=mask,
                          dtype=kind, backend=MERGED, **mods)


def test_a_bias_broadcast_over_leading_dimensions(rng):
    """MSA row attention: q (1, 3, S, H, D) chunked along the rows, the pair bias (1, 1, H, S, S)
    shared by them: dbias sums every row chunk's pairs, in a fixed tree (the same bits under any
    scheduler)."""
    q, k, v = (rng.standard_normal((1, 3, 17, 2, 8)).astype(np.float32) for _ in range(3))
    dout = rng.standard_normal(q.shape).astype(np.float32)
    pair = da.from_array(rng.standard_normal((1, 1, 2, 17, 17)).astype(np.float32), chunks=(1, 1, 1, 9, 17))
    Q, K, V = (da.from_array(x, chunks=(1, 1, 9, 1, -1)) for x in (q, k, v))
    out, vjp = fdask.attention_vjp(Q, K, V, bias=pair)
    grads = vjp(da.from_array(dout, chunks=Q.chunks))
    lse = fdask.attention(Q, K, V, bias=pair, return_lse=True)[1]
    got = dask.compute(out, lse, *grads, scheduler="sync")
    assert grads[3].chunks == pair.chunks
    assert_matches_oracle(got, q, k, v, dout, bias=pair.compute(), backend=MERGED)
    np.testing.assert_array_equal(grads[3].compute(scheduler="threads"), got[-1])


def test_pairs_outside_the_band_are_not_in_the_graph_with_a_bias(rng):
    q, k, v = make_qkv(rng, 1, 32, 32, 1, 1, 8, np.float32)
    Q, K, V = _chunked(q, k, v, 16, 16)
    bias = da.from_array(rng.standard_normal((32, 32)).astype(np.float32), chunks=16)
    out, vjp = fdask.attention_vjp(Q, K, V, causal=True, bias=bias)
    assert len(_pair_tasks(out, "flashcupy-pair-")) == 3
    dbias = vjp(da.from_array(np.ones_like(q), chunks=Q.chunks))[3]
    assert len(_pair_tasks(dbias, "flashcupy-pair-grad-")) == 3
    np.testing.assert_array_equal(dbias[:16, 16:].compute(), 0)  # the block above the diagonal


BAD_MODIFIERS = [  # (what, keywords given q, k, v of (2, 8, 2, 8) float32, error, message)
    ("bias shape", lambda: dict(bias=np.zeros((2, 3, 8, 8), np.float32)), ValueError, "bias must be broadcastable"),
    ("bias dtype", lambda: dict(bias=da.zeros((8, 8), dtype=np.float64)), TypeError,
     "bias must have q's dtype float32"),
    ("bias rank", lambda: dict(bias=da.zeros((1, 2, 2, 8, 8), dtype=np.float32)), ValueError,
     "bias must have rank at most"),
    ("mask dtype", lambda: dict(mask=da.ones((8, 8), dtype=np.int8)), TypeError, "mask must have dtype bool"),
    ("mask library", lambda: dict(mask=[[True] * 8] * 8), TypeError, "mask must be None or an array of q's library"),
    ("bias byte order", lambda: dict(bias=da.from_array(np.zeros((8, 8), ">f4"))), TypeError,
     "bias must have native byte order"),
]


@pytest.mark.parametrize("what, mods, error, message", BAD_MODIFIERS, ids=[b[0] for b in BAD_MODIFIERS])
def test_bad_bias_and_mask_are_refused(rng, what, mods, error, message):
    q, k, v = make_qkv(rng, 2, 8, 8, 2, 1, 8, np.float32)
    Q, K, V = _chunked(q, k, v, 4, 4)
    for call in (fdask.attention, fdask.attention_vjp):
        with pytest.raises(error, match=message):
            call(Q, K, V, **mods())


@pytest.mark.parametrize("head_dim_v", [3, 20])
def test_a_value_head_dim_of_its_own(rng, head_dim_v):
    """v's head_dim unlike q's: out and dout in v's, key chunks no query sees (a window with Sq < Sk:
    dv's zeros of v's shape), query chunks that see no key (Sq > Sk under causal), a pair bias with dbias."""
    for Sq, Sk in ((9, 30), (30, 9)):
        q, k, v = make_qkv(rng, 2, Sq, Sk, 4, 2, 8, np.float32, head_dim_v=head_dim_v)
        dout = rng.standard_normal(q.shape[:3] + (head_dim_v,)).astype(np.float32)
        bias = rng.standard_normal((1, 4, Sq, Sk)).astype(np.float32)
        Q = da.from_array(q, chunks=(1, 5, 2, -1))
        K, V = (da.from_array(x, chunks=(1, 7, 1, -1)) for x in (k, v))
        kw = dict(causal=True, window=(4, None), bias=bias)
        out, vjp = fdask.attention_vjp(Q, K, V, **kw)
        lse = fdask.attention(Q, K, V, return_lse=True, **kw)[1]
        got = dask.compute(out, lse, *vjp(da.from_array(dout, chunks=(1, 3, 1, -1))), scheduler="sync")
        assert out.chunks[-1] == (head_dim_v,) and got[0].shape == dout.shape and got[4].shape == v.shape
        assert_matches_oracle(got, q, k, v, dout, backend=MERGED, **kw)
        with pytest.raises(ValueError, match="dout must have shape"):
            fdask.attention_backward(da.from_array(dout[..., :1]), Q, K, V, out, lse, **kw)


def test_dropout_draws_the_whole_arrays_mask_in_every_pair_of_chunks(rng):
    """Dropout over chunks of batch, heads, queries and keys (leading dimensions too, the first cut):
    each pair's calls draw its part of the whole call's mask (dropout_origin), so the merged out and the
    summed gradients are the oracle's on the whole arrays; a second leading dimension in chunks is
    refused, naming the rechunk."""
    q, k, v = (x.reshape(4, 2, *x.shape[1:]) for x in make_qkv(rng, 8, 13, 17, 4, 2, 8, np.float32))
    dout = rng.standard_normal(q.shape).astype(np.float32)
    Q = da.from_array(q, chunks=(2, -1, 5, 2, -1))
    K, V = (da.from_array(x, chunks=(2, -1, 6, 1, -1)) for x in (k, v))
    kw = dict(causal=True, dropout_p=0.3, dropout_seed=2**40 + 5)
    out, vjp = fdask.attention_vjp(Q, K, V, **kw)
    lse = fdask.attention(Q, K, V, return_lse=True, **kw)[1]
    got = dask.compute(out, lse, *vjp(da.from_array(dout, chunks=(2, -1, 3, 1, -1))), scheduler="sync")
    assert_matches_oracle(got, q, k, v, dout, backend=MERGED, **kw)
    with pytest.raises(ValueError, match=r"with dropout, q's leading dimensions but the first must each be one chunk"):
        fdask.attention(Q.rechunk({1: 1}), K, V, **kw)


# ----------------------------------------------------------------------------
# attention_probs: one block per pair of chunks, with the whole row's lse


def _probs_ratio(P, q, k, rows=None, **keywords):
    want = expected(q, k, k, probs=True, family="numpy", **keywords)
    index = None if rows is None else np.arange(q.shape[-3])[rows]
    return error_ratio(P, want, "P", index)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[1]}x{c[2]}{'-causal' if c[6] else ''}-{c[7]}-{c[8]}")
def test_probs_in_every_chunking_match_the_oracle(rng, case):
    # query chunks that see no key chunk (zeros blocks), GQA head chunks, uneven chunks; all rows, a
    # slice, and indices out of order across chunks
    B, Sq, Sk, Hq, Hkv, D, causal, q_seq, k_seq = case
    q, k, _ = make_qkv(rng, B, Sq, Sk, Hq, Hkv, D, np.float32)
    Q, K, _ = _chunked(q, k, k, q_seq, k_seq)
    lse = fdask.attention(Q, K, K, causal=causal, return_lse=True)[1]
    for rows in (None, slice(1, None, 3), [Sq - 1, 0, Sq // 2]):
        P = fdask.attention_probs(Q, K, lse, rows=rows, causal=causal)
        if rows is None:
            assert P.chunks == (Q.chunks[0], Q.chunks[2], Q.chunks[1], K.chunks[1])
        got = P.compute(scheduler="sync")
        assert got.dtype == np.float32 and _probs_ratio(got, q, k, rows, causal=causal) <= 1


@pytest.mark.parametrize("mods", MODIFIED, ids=lambda m: "-".join(sorted(m)))
def test_probs_with_modifiers_match_the_oracle(rng, mods):
    # windows, the softcap and ALiBi mean in a pair what they mean on the whole arrays (its diagonal);
    # a dask bias in chunks of its own and a mask that hides a key chunk and two rows' every key
    mods = dict(mods)
    q, k, _ = make_qkv(rng, 2, 23, 29, 4, 2, 8, np.float32)
    if "alibi_slopes" in mods:
        mods["alibi_slopes"] = rng.uniform(0.1, 1, mods["alibi_slopes"]).astype(np.float32)
    bias = rng.standard_normal((1, 4, 23, 29)).astype(np.float32)
    mask = rng.random((2, 1, 23, 29)) < 0.8
    mask[0, :, :, 16:] = False
    mask[..., -2:, :] = False
    Q, K, _ = _chunked(q, k, k, (6, 1, 16), (8, 8, 13), heads_kv=2)
    Bias = da.from_array(bias, chunks=(1, 2, 5, 7))
    lse = fdask.attention(Q, K, K, bias=Bias, mask=mask, return_lse=True, **mods)[1]
    P = fdask.attention_probs(Q, K, lse.rechunk((1, 2, 23)), rows=[22, 3, -2], bias=Bias, mask=mask, **mods)
    assert _probs_ratio(P.compute(), q, k, [22, 3, -2], bias=bias, mask=mask, **mods) <= 1


def test_probs_with_leading_dimensions_and_bfloat16_bits(rng):
    # q (2, 3, S, H, D) chunked along both leading dimensions with per-element ALiBi slopes; bfloat16
    # as uint16 bits; pairs outside the causal band are zeros blocks, not calls
    q, k = (rng.standard_normal((2, 3, S, H, 8)).astype(BF16) for S, H in ((19, 4), (23, 2)))
    slopes = rng.uniform(0.05, 0.5, (2, 3, 4)).astype(np.float32)
    Q = da.from_array(bf16_bits(q), chunks=(1, (2, 1), 7, 2, -1))
    K = da.from_array(bf16_bits(k), chunks=(1, (2, 1), 10, 1, -1))
    kw = dict(causal=True, alibi_slopes=slopes, dtype="bfloat16")
    lse = fdask.attention(Q, K, K, return_lse=True, **kw)[1]
    P = fdask.attention_probs(Q, K, lse, **kw)
    assert P.shape == (2, 3, 4, 19, 23) and P.dtype == np.float32
    assert _probs_ratio(P.compute(scheduler="threads"), bf16_bits(q), bf16_bits(k), **kw) <= 1
    q, k, _ = make_qkv(rng, 1, 64, 64, 1, 1, 8, np.float32)
    Q, K, _ = _chunked(q, k, k, 16, 16)
    P = fdask.attention_probs(Q, K, fdask.attention(Q, K, K, causal=True, return_lse=True)[1], causal=True)
    graph = dict(P.__dask_graph__())
    calls = [key for key, task in graph.items()
             if isinstance(key, tuple) and key[0].startswith("flashcupy-attention-probs") and "_pair_probs" in str(task)]
    assert len(calls) == 10  # the lower triangle of 4 x 4
    np.testing.assert_array_equal(P[..., :16, 16:].compute(), 0)


@pytest.mark.parametrize("B, Sq, Sk", [(1, 0, 5), (1, 5, 0), (0, 4, 4)])
def test_probs_of_empty_inputs(rng, B, Sq, Sk):
    q, k, _ = make_qkv(rng, B, Sq, Sk, 2, 1, 8, np.float32)
    Q, K = da.from_array(q), da.from_array(k)
    P = fdask.attention_probs(Q, K, fdask.attention(Q, K, K, return_lse=True)[1]).compute()
    assert P.shape == (B, 2, Sq, Sk) and _probs_ratio(P, q, k) <= 1


def test_bad_probs_input_is_refused_before_any_work(rng):
    q, k, _ = make_qkv(rng, 2, 8, 8, 2, 1, 8, np.float32)
    Q, K, _ = _chunked(q, k, k, 4, 4)
    lse = da.zeros((2, 2, 8), dtype=np.float32)
    with pytest.raises(TypeError, match="lse must be a dask.array.Array"):
        fdask.attention_probs(Q, K, np.zeros((2, 2, 8), np.float32))
    with pytest.raises(ValueError, match=r"lse must have shape \(2, 2, 8\), got \(2, 2, 7\)"):
        fdask.attention_probs(Q, K, lse[..., :7])
    with pytest.raises(TypeError, match="lse must have dtype float32, got float64"):
        fdask.attention_probs(Q, K, lse.astype(np.float64))
    with pytest.raises(ValueError, match=r"rows must lie in \[-seqlen_q, seqlen_q\)"):
        fdask.attention_probs(Q, K, lse, rows=[8])
    with pytest.raises(ValueError, match="head_dim in one chunk"):
        fdask.attention_probs(Q.rechunk({3: 4}), K, lse)
