"""Dropout (README, Semantics, "dropout"): the keep mask's rule, held to Random123's known answers
through the oracle's own Philox, and every entry point and backend against the oracle.

The emulated cupy kernels (SIMT and tensor-core, sm_80) and Numba's simulator have their cases here
and in their own files; the wrappers (jax, torch, dask) in theirs."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_matches_oracle, make_qkv, mutated_compile
from varlen_checks import dropped_sequences_match_the_oracle

import flashcupy
import reference
from flashcupy import _dropout

# Random123's kat_vectors for philox4x32 10: counter (4 words), key (2 words), the four words out
KNOWN_ANSWERS = (
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
)
SEED = 2**40 + 12345  # both key words matter


@pytest.mark.parametrize("philox", [reference.philox, _dropout.philox], ids=["oracle", "flashcupy"])
def test_philox_gives_random123s_known_answers(philox):
    for counter, key, want in KNOWN_ANSWERS:
        assert [int(x) for x in philox(counter, key)] == list(want)


def test_the_keep_mask_is_the_oracles_over_any_origin_and_key_range():
    b, h = np.arange(2)[:, None, None, None], np.arange(3)[None, :, None, None]
    for origin, (i0, i1, j0, j1) in (((0, 0, 0, 0), (0, 5, 0, 9)), ((3, 1, 7, 5), (2, 9, 1, 14)),
                                     ((0, 0, 0, 3), (0, 3, 6, 7))):
        got = _dropout.block(SEED, 0.3, origin, b, h, i0, i1, j0, j1)
        whole = reference.dropout_keep(SEED, 0.3, (2, 3, i1, j1), origin)
        np.testing.assert_array_equal(got, whole[:, :, i0:, j0:])


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_the_keep_fraction_is_one_minus_p(p):
    keep = reference.dropout_keep(7, p, (2, 4, 128, 128))
    n = keep.size
    assert abs(keep.mean() - (1 - p)) < 5 * np.sqrt(p * (1 - p) / n)  # five standard deviations
    # and neither the rows nor the four words of one Philox call share a pattern
    assert abs(keep[..., 0::4].mean() - keep[..., 1::4].mean()) < 10 * np.sqrt(p * (1 - p) / (n / 4))
    assert not (keep[:, :, 0] == keep[:, :, 1]).all()


# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, head_dim_v, dtype, keywords)
NUMPY_CASES = (
    (2, 37, 53, 4, 2, 16, 16, np.float32, {}),
    (1, 70, 70, 2, 1, 32, 24, np.float64, {"causal": True}),
    (2, 3, 300, 8, 2, 16, 16, np.float32, {}),  # decoding: the forward's eager path is not taken
    (1, 33, 47, 2, 2, 8, 8, np.float32, {"scale": 40.0}),  # rows overflow and are redone
    (1, 40, 40, 2, 2, 16, 16, np.float16, {"window": (4, 3)}),  # the narrow band is not taken
)


@pytest.mark.parametrize("case", NUMPY_CASES, ids=lambda c: f"{c[1]}x{c[2]}-{np.dtype(c[7]).name}-{c[8]}")
def test_numpy_matches_the_oracle(rng, case):
    B, Sq, Sk, Hq, Hkv, D, Dv, dtype, kw = case
    q, k, v = make_qkv(rng, B, Sq, Sk, Hq, Hkv, D, dtype, head_dim_v=Dv)
    dout = rng.standard_normal((B, Sq, Hq, Dv)).astype(dtype)
    drop = dict(dropout_p=0.25, dropout_seed=SEED)
    out, lse = flashcupy.attention(q, k, v, return_lse=True, backend="numpy", **drop, **kw)
    grads = flashcupy.attention_backward(dout, q, k, v, out, lse, backend="numpy", **drop, **kw)
    assert_matches_oracle((out, lse, *grads), q, k, v, dout, backend="numpy", **drop, **kw)


def test_numpy_with_a_bias_its_gradient_and_dlse(rng):
    q, k, v = make_qkv(rng, 2, 21, 34, 4, 2, 16, np.float32)
    bias = rng.standard_normal((1, 4, 21, 34)).astype(np.float32)
    mask = rng.random((2, 1, 1, 34)) > 0.2
    dout, dlse = rng.standard_normal(q.shape).astype(np.float32), rng.standard_normal((2, 4, 21)).astype(np.float32)
    kw = dict(bias=bias, mask=mask, softcap=3.0, dropout_p=0.5, dropout_seed=SEED)
    out, vjp = flashcupy.attention_vjp(q, k, v, backend="numpy", **kw)
    _, lse = flashcupy.attention(q, k, v, return_lse=True, backend="numpy", **kw)
    assert_matches_oracle((out, lse, *vjp(dout, dlse)), q, k, v, dout, backend="numpy", dlse=dlse, **kw)


def test_leading_dimensions_number_the_batches_of_the_whole_call(rng):
    # q (2, 3, ...) as a transposed view: its leading dimensions do not fold, so each index of one is
    # a call of its own, whose batches must still be numbered as the whole call's
    q, k, v = (np.swapaxes(x.reshape(3, 2, *x.shape[1:]), 0, 1) for x in make_qkv(rng, 6, 9, 12, 2, 2, 8, np.float32))
    dout = rng.standard_normal(q.shape).astype(np.float32)
    drop = dict(dropout_p=0.4, dropout_seed=SEED)
    out, lse = flashcupy.attention(q, k, v, return_lse=True, backend="numpy", **drop)
    grads = flashcupy.attention_backward(dout, q, k, v, out, lse, backend="numpy", **drop)
    assert_matches_oracle((out, lse, *grads), q, k, v, dout, backend="numpy", **drop)


def test_a_packed_batch_draws_sequence_b_as_batch_b(rng):
    lengths_q, lengths_k = [5, 0, 9], [7, 4, 11]
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (lengths_q, lengths_k))
    q = rng.standard_normal((cu_q[-1], 2, 8)).astype(np.float32)
    k, v = (rng.standard_normal((cu_k[-1], 1, 8)).astype(np.float32) for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(np.float32)
    drop = dict(dropout_p=0.3, dropout_seed=SEED)
    out, lse = flashcupy.attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True, backend="numpy", **drop)
    grads = flashcupy.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal=True, backend="numpy",
                                                **drop)
    dropped_sequences_match_the_oracle((out, lse, *grads), q, k, v, dout, cu_q, cu_k, "numpy", causal=True, **drop)


def test_the_seed_fixes_the_mask_and_p_zero_is_no_dropout(rng):
    q, k, v = make_qkv(rng, 1, 16, 16, 2, 2, 8, np.float32)
    plain = flashcupy.attention(q, k, v, backend="numpy")
    np.testing.assert_array_equal(flashcupy.attention(q, k, v, dropout_p=0.0, dropout_seed=5, backend="numpy"), plain)
    one = flashcupy.attention(q, k, v, dropout_p=0.5, dropout_seed=5, backend="numpy")
    np.testing.assert_array_equal(flashcupy.attention(q, k, v, dropout_p=0.5, dropout_seed=5, backend="numpy"), one)
    assert not np.allclose(flashcupy.attention(q, k, v, dropout_p=0.5, dropout_seed=6, backend="numpy"), one)
    assert not np.allclose(one, plain)


BAD_DROPOUT = (
    (dict(dropout_p=1.0, dropout_seed=1), ValueError, "dropout_p must be in [0, 1), got 1.0"),
    (dict(dropout_p=-0.1, dropout_seed=1), ValueError, "dropout_p must be in [0, 1)"),
    (dict(dropout_p=float("nan"), dropout_seed=1), ValueError, "dropout_p must be in [0, 1), got nan"),
    (dict(dropout_p="0.5", dropout_seed=1), TypeError, "dropout_p must be a real number"),
    (dict(dropout_p=True, dropout_seed=1), TypeError, "dropout_p must be a real number"),
    (dict(dropout_p=0.5), ValueError, "dropout_seed must be given with dropout_p > 0"),
    (dict(dropout_p=0.5, dropout_seed=1.5), TypeError, "dropout_seed must be an int or None, got float"),
    (dict(dropout_p=0.5, dropout_seed=True), TypeError, "dropout_seed must be an int or None, got bool"),
    (dict(dropout_p=0.5, dropout_seed=-1), ValueError, "dropout_seed must be in [0, 2**64), got -1"),
    (dict(dropout_p=0.5, dropout_seed=2**64), ValueError, "dropout_seed must be in [0, 2**64)"),
)


@pytest.mark.parametrize("kw, error, message", BAD_DROPOUT, ids=lambda x: str(x)[:30])
def test_bad_dropout_is_refused_before_any_work(rng, kw, error, message):
    q, k, v = make_qkv(rng, 1, 4, 4, 1, 1, 8, np.float32)
    with pytest.raises(error, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")
                       .replace("*", r"\*")):
        flashcupy.attention(q, k, v, backend="numpy", **kw)
    out, lse = flashcupy.attention(q, k, v, return_lse=True, backend="numpy")
    with pytest.raises(error):
        flashcupy.attention_backward(q, q, k, v, out, lse, backend="numpy", **kw)


def test_a_backend_without_dropout_is_refused_naming_those_with_it(rng, monkeypatch):
    from flashcupy.backends import numpy_backend
    monkeypatch.setattr(numpy_backend, "DROPOUT", False)
    q, k, v = make_qkv(rng, 1, 4, 4, 1, 1, 8, np.float32)
    with pytest.raises(ValueError, match="dropout is not yet supported by backend .numpy. \\(backend .cupy."):
        flashcupy.attention(q, k, v, backend="numpy", dropout_p=0.5, dropout_seed=1)


# The cupy backend on emulated devices: (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype,
# compute capability, keywords of the case made of the rng). float32 runs the SIMT kernels, float16
# the mma.sync ones, or on sm_90 the Hopper ones (more of them below); a bias
# broadcast over rows takes flash_pairs.cu's dbias kernel; the tensor-core dQ kernel runs only when
# deterministic.
CUPY_CASES = (
    (1, 33, 47, 4, 2, 32, np.float32, 80, lambda rng: {"causal": True}),
    (1, 33, 47, 4, 2, 32, np.float16, 80, lambda rng: {"causal": True}),
    (2, 20, 70, 2, 1, 64, np.float16, 80, lambda rng: {"bias": rng.standard_normal((1, 1, 20, 70)).astype(np.float16)}),
    (2, 20, 40, 2, 2, 32, np.float32, 80, lambda rng: {"bias": rng.standard_normal((2, 1, 1, 40)).astype(np.float32)}),
    (1, 24, 24, 2, 2, 64, np.float16, 90, lambda rng: {}),
    (1, 40, 40, 2, 1, 32, np.float16, 80, lambda rng: {"deterministic": True}),
    # the tiles dropout changes (specs.DROPOUT_TILES, the tensor-core forward's at 128: tc_tile)
    (1, 21, 37, 2, 1, 128, np.float16, 80, lambda rng: {}),
    (1, 21, 37, 2, 1, 100, np.float32, 80, lambda rng: {"causal": True}),
    (1, 21, 37, 2, 1, 64, np.float64, 80, lambda rng: {"bias": rng.standard_normal((1, 2, 1, 37))}),
)


def run_cupy(rng, case, compile=None):
    """A CUPY_CASES case on its emulated device: (results, inputs, keywords)."""
    from flashcupy.tools.emulator.cupy import emulated
    B, Sq, Sk, Hq, Hkv, D, dtype, cc, keywords = case
    kw = keywords(rng) | dict(dropout_p=0.3, dropout_seed=SEED)
    deterministic = kw.pop("deterministic", False)
    q, k, v = make_qkv(rng, B, Sq, Sk, Hq, Hkv, D, dtype)
    dout = rng.standard_normal(q.shape).astype(dtype)
    with emulated(compute_capability=cc, **({} if compile is None else {"compile": compile})):
        out, lse = flashcupy.attention(q, k, v, return_lse=True, backend="cupy", **kw)
        grads = flashcupy.attention_backward(dout, q, k, v, out, lse, backend="cupy", deterministic=deterministic, **kw)
    return (out, lse, *grads), (q, k, v, dout), kw


@pytest.mark.parametrize("case", CUPY_CASES, ids=lambda c: f"{np.dtype(c[6]).name}-sm{c[7]}-{c[1]}x{c[2]}")
def test_cupy_matches_the_oracle(rng, case):
    got, inputs, kw = run_cupy(rng, case)
    assert_matches_oracle(got, *inputs, backend="cupy", **kw)


# Deliberate slips in the kernels' dropout, each of which the cases above must catch
DROPOUT_MUTATIONS = {
    "SIMT forward keeps every weight": ("S[r] = drop(S[r], row0 + r, j0 + key);", ""),
    "SIMT dV of the undropped P": ("S[r] = drop.times(S[r], z);", ""),
    "SIMT dQ of the undropped dP": ("ds(score, P, drop(dP[r], i, j0 + key),", "ds(score, P, dP[r],"),
    "tensor-core forward keeps every weight": ("tc_dropout<MODS>(S[mt], drop, row_w + 16 * mt, j0);", ""),
    "Hopper forward keeps every weight": ("tc_dropout<MODS>(S, drop, row_w, j0);", ""),
    "tensor-core and Hopper dV of the undropped P": ("s = drop.times(P_, z_);", "s = P_;"),
    "tensor-core dK of the undropped dP": ("ds(score, P_, drop.times(dp, z_), D, t_)", "ds(score, P_, dp, D, t_)"),
    "tensor-core dQ of the undropped dP": ("ds(score, P, drop(dp, row_w + r, j0 + c),", "ds(score, P, dp,"),
    "dbias of the undropped dP": ("drop(dP[r], i, j),", "dP[r],"),
    "Philox's word of the next key": ("key & 3u) >= threshold", "(key + 1) & 3u) >= threshold"),
}


@pytest.mark.parametrize("name", list(DROPOUT_MUTATIONS))
def test_a_dropout_slip_in_the_kernels_is_caught(name):
    rng = np.random.default_rng(3)
    compile = mutated_compile(*DROPOUT_MUTATIONS[name])
    for case in CUPY_CASES:
        got, inputs, kw = run_cupy(rng, case, compile)
        try:
            assert_matches_oracle(got, *inputs, backend="cupy", **kw)
        except AssertionError:
            return
    pytest.fail(f"no case caught: {name}")


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_cupy_split_kv_drops_each_splits_keys(rng, dtype):
    from flashcupy import _api
    from flashcupy.backends import cupy_backend
    from flashcupy.tools.emulator.cupy import emulated
    q, k, v = make_qkv(rng, 1, 5, 300, 4, 2, 32, dtype)
    drop = dict(dropout_p=0.3, dropout_seed=SEED)
    with emulated(compute_capability=80):
        p = flashcupy._checks.problem(q, k, v, False, None, None, "numpy", **drop)
        assert cupy_backend.split_plan(p, q, k, v, 3)[0] > 1  # the call below does split
        out, lse = _api.forward(q, k, v, backend="cupy", num_splits=3, **drop)
    assert_matches_oracle((out, lse), q, k, v, backend="cupy", **drop)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_cupy_draws_from_a_chunks_origin(rng, dtype):
    # a part of a larger call (a Dask chunk, a view of leading dimensions) draws from its origin in the whole
    # call's mask; an odd key origin splits the mma.sync forward's pairs of adjacent keys (Dropout::pair)
    from flashcupy import _api
    from flashcupy.tools.emulator.cupy import emulated
    q, k, v = make_qkv(rng, 1, 19, 45, 2, 1, 32, dtype)
    dout = rng.standard_normal(q.shape).astype(dtype)
    drop = dict(dropout_p=0.3, dropout_seed=SEED, dropout_origin=(3, 2, 7, 5))
    with emulated(compute_capability=80):
        out, lse = _api.forward(q, k, v, backend="cupy", **drop)
        grads = _api.backward(dout, q, k, v, out, lse, backend="cupy", **drop)
    assert_matches_oracle((out, lse, *grads), q, k, v, dout, backend="cupy", **drop)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_cupy_packed_batch_in_one_launch_draws_sequence_b_as_batch_b(rng, dtype):
    from flashcupy.tools.emulator.cupy import emulated
    cu_q, cu_k = np.array([0, 5, 5, 24], np.int32), np.array([0, 7, 11, 44], np.int32)
    q = rng.standard_normal((24, 2, 32)).astype(dtype)
    k, v = (rng.standard_normal((44, 1, 32)).astype(dtype) for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(dtype)
    drop = dict(dropout_p=0.3, dropout_seed=SEED, causal=True)
    with emulated(compute_capability=80):
        out, lse = flashcupy.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, backend="cupy", **drop)
        grads = flashcupy.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, backend="cupy", **drop)
    dropped_sequences_match_the_oracle((out, lse, *grads), q, k, v, dout, cu_q, cu_k, "cupy", **drop)


@pytest.mark.parametrize("deterministic", [False, True])
def test_the_hopper_kernels_draw_the_same_mask(rng, deterministic):
    # on an sm_90 the Hopper forward (tc_dropout on the wgmma accumulators) and backward (TC_P_DS), with a
    # bias broadcast over rows, causal rows that see no key, an odd key origin (Dropout::pair's two calls)
    # and the seed read from device memory; dQ by reduce-adds, or in key-block order
    from flashcupy import _api
    from flashcupy.backends import cupy_backend
    from flashcupy.tools.emulator.cupy import emulated
    q, k, v = make_qkv(rng, 2, 70, 45, 4, 2, 64, np.float16)
    dout = rng.standard_normal(q.shape).astype(np.float16)
    kw = dict(causal=True, bias=rng.standard_normal((1, 4, 1, 45)).astype(np.float16))
    words = np.array([SEED & 0xFFFFFFFF, SEED >> 32], np.uint32)
    drop = dict(dropout_p=0.3, dropout_origin=(1, 0, 4, 3))
    with emulated(compute_capability=90):
        p = flashcupy._checks.problem(q, k, v, True, None, None, "numpy", dropout_p=0.3, dropout_seed=SEED)
        assert cupy_backend.forward_path(p, q, k, v) == "hopper"
        assert cupy_backend.backward_path(p, dout, q, k, v, dout, deterministic) == "hopper"
        out, lse = _api.forward(q, k, v, backend="cupy", dropout_seed=0, dropout_seed_words=words, **kw, **drop)
        grads = _api.backward(dout, q, k, v, out, lse, backend="cupy", deterministic=deterministic,
                              dropout_seed=0, dropout_seed_words=words, **kw, **drop)
    assert_matches_oracle((out, lse, *grads), q, k, v, dout, backend="cupy", dropout_seed=SEED, **kw, **drop)


def test_the_hopper_sets_that_spilled_take_the_mma_sync_kernels(rng):
    # specs.SM90_DROPOUT_SPILLS: with dropout, the Hopper backward at head_dim 128 takes no bias (its forward
    # does); without dropout the same call's backward is the Hopper one
    from flashcupy.backends import cupy_backend
    from flashcupy.tools.emulator.cupy import emulated
    q, k, v = make_qkv(rng, 1, 70, 70, 2, 1, 128, np.float16)
    bias = rng.standard_normal((1, 2, 70, 70)).astype(np.float16)
    with emulated(compute_capability=90):
        for p, backward in ((0.3, "tensor-core"), (0.0, "hopper")):
            problem = flashcupy._checks.problem(q, k, v, False, None, None, "numpy", bias=bias, dropout_p=p,
                                                dropout_seed=SEED)
            assert cupy_backend.forward_path(problem, q, k, v) == "hopper"
            assert cupy_backend.backward_path(problem, q, q, k, v, q) == backward


def test_a_packed_batch_on_the_hopper_kernels(rng):
    # a packed batch's Hopper forward and backward draw sequence b as batch b (their seq_index)
    from flashcupy.backends import cupy_backend
    from flashcupy.tools.emulator.cupy import emulated
    cu_q, cu_k = np.array([0, 5, 5, 84], np.int32), np.array([0, 7, 11, 74], np.int32)
    q = rng.standard_normal((84, 2, 64)).astype(np.float16)
    k, v = (rng.standard_normal((74, 1, 64)).astype(np.float16) for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(np.float16)
    drop = dict(dropout_p=0.3, dropout_seed=SEED, causal=True)
    with emulated(compute_capability=90):
        p = flashcupy._checks.problem(q[None], k[None], v[None], True, None, None, "numpy", dropout_p=0.3,
                                      dropout_seed=SEED)
        assert cupy_backend.forward_path(p, q[None], k[None], v[None], varlen=True) == "hopper"
        out, lse = flashcupy.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, backend="cupy", **drop)
        grads = flashcupy.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, backend="cupy", **drop)
    dropped_sequences_match_the_oracle((out, lse, *grads), q, k, v, dout, cu_q, cu_k, "cupy", **drop)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_cupy_reads_a_seed_held_in_device_memory(rng, dtype):
    # flashcupy.jax's traced seeds on a GPU reach the kernels as a device array of two uint32 words
    # (dropout_seed_words), which they read themselves: the int seed the call carries (0) is not read
    from flashcupy import _api
    from flashcupy.tools.emulator.cupy import emulated
    q, k, v = make_qkv(rng, 2, 21, 30, 2, 1, 32, dtype)
    dout = rng.standard_normal(q.shape).astype(dtype)
    words = np.array([SEED & 0xFFFFFFFF, SEED >> 32], np.uint32)
    drop = dict(dropout_p=0.3, dropout_seed=0, dropout_seed_words=words)
    with emulated(compute_capability=80):
        out, lse = _api.forward(q, k, v, backend="cupy", causal=True, **drop)
        grads = _api.backward(dout, q, k, v, out, lse, backend="cupy", causal=True, **drop)
    assert_matches_oracle((out, lse, *grads), q, k, v, dout, backend="cupy", causal=True, dropout_p=0.3,
                          dropout_seed=SEED)
    with pytest.raises(ValueError, match="backend 'numpy' cannot read dropout's seed from device memory"):
        _api.forward(q, k, v, backend="numpy", **drop)
