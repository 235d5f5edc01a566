"""flashcupy.merge: attention over disjoint key sets combined by the lse rule equals attention over
their union (checked against the oracle), and merge_backward is merge's derivative."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import DTYPES, assert_matches_oracle, bf16_bits, bf16_ties, make_qkv

import flashcupy
from flashcupy.backends import bfloat16_dtype


def _parts(q, k, v, cuts, causal=False, **kw):
    """(outs, lses) of attention over the key ranges between cuts, each told its own diagonal."""
    outs, lses = [], []
    Sq, Sk = q.shape[1], k.shape[1]
    for a, b in zip(cuts[:-1], cuts[1:]):
        out, lse = flashcupy._api.forward(q, k[:, a:b], v[:, a:b], causal=causal, diagonal=Sk - Sq - a, **kw)
        outs.append(out)
        lses.append(lse)
    return outs, lses


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("causal", [False, True])
def test_merged_parts_match_the_oracle(rng, dtype, causal):
    # Sq > Sk under causal: the first rows see no key of any part (out 0, lse -inf)
    q, k, v = make_qkv(rng, 2, 13, 11, 4, 2, 8, dtype)
    out, lse = flashcupy.merge(*_parts(q, k, v, [0, 3, 4, 11], causal))
    assert out.dtype == q.dtype and lse.dtype == (np.float64 if dtype == np.float64 else np.float32)
    # backend None: each part's out was stored in the dtype before the merge, a rounding of out's terms
    # that only the tensor-core liberty (16-bit P) allows for
    assert_matches_oracle((out, lse), q, k, v, causal=causal, backend=None)
    if causal:
        assert np.all(lse[:, :, :2] == -np.inf) and np.all(out[:, :2] == 0)


def test_bfloat16_bits(rng):
    q, k, v = make_qkv(rng, 1, 5, 9, 2, 1, 8, bfloat16_dtype())
    bits = [bf16_bits(x) for x in (q, k, v)]
    outs, lses = _parts(*bits, [0, 4, 9], dtype="bfloat16")
    out, lse = flashcupy.merge(outs, lses, dtype="bfloat16")
    assert out.dtype == np.uint16
    assert_matches_oracle((out, lse), *bits, dtype="bfloat16", backend=None)
    # the bit path rounds as ml_dtypes does
    want, _ = flashcupy.merge([o.view(bfloat16_dtype()) for o in outs], lses)
    np.testing.assert_array_equal(out, want.view(np.uint16))


def test_bfloat16_bits_round_ties_to_even(rng):
    # two halves of the keys whose outs are adjacent bfloat16 values, with equal lse: every merged
    # element lies halfway between two bfloat16 values, and is stored as the even one
    q, k, v, want = bf16_ties(rng, 1, 3, 16, 4, 2, 8)
    outs, lses = _parts(q, k, v, [0, 8, 16], dtype="bfloat16")
    np.testing.assert_array_equal(lses[0], lses[1])
    out, lse = flashcupy.merge(outs, lses, dtype="bfloat16")
    np.testing.assert_array_equal(out, want)
    assert_matches_oracle((out, lse), q, k, v, dtype="bfloat16", backend=None)


def test_one_part_is_the_identity_and_empty_parts_weigh_nothing(rng):
    q, k, v = make_qkv(rng, 1, 4, 6, 1, 1, 8, np.float64)
    out, lse = flashcupy.attention(q, k, v, return_lse=True)
    empty_out, empty_lse = np.zeros_like(out), np.full_like(lse, -np.inf)
    for outs, lses in (([out], [lse]), ([empty_out, out, empty_out], [empty_lse, lse, empty_lse])):
        merged, merged_lse = flashcupy.merge(outs, lses)
        np.testing.assert_array_equal(merged, out)
        np.testing.assert_array_equal(merged_lse, lse)
    merged, merged_lse = flashcupy.merge([empty_out, empty_out], [empty_lse, empty_lse])
    assert np.all(merged == 0) and np.all(merged_lse == -np.inf)


def test_backward_is_the_derivative(rng):
    """merge_backward against central differences of a scalar loss of merge, in float64."""
    B, S, H, D, n = 1, 3, 2, 4, 3
    outs = [rng.standard_normal((B, S, H, D)) for _ in range(n)]
    lses = [rng.standard_normal((B, H, S)) for _ in range(n)]
    lses[1][0, 0, 1] = -np.inf  # a part a row does not see: zero gradient there
    g_out, g_lse = rng.standard_normal((B, S, H, D)), rng.standard_normal((B, H, S))

    def loss(outs, lses):
        out, lse = flashcupy.merge(outs, lses)
        return float((g_out * out).sum() + (g_lse * np.where(np.isinf(lse), 0, lse)).sum())

    out, lse = flashcupy.merge(outs, lses)
    douts, dlses = flashcupy.merge_backward(g_out, outs, lses, out, lse, g_lse)
    eps = 1e-6
    for which, xs, grads in (("outs", outs, douts), ("lses", lses, dlses)):
        for i, (x, grad) in enumerate(zip(xs, grads)):
            numeric = np.zeros_like(x)
            for idx in np.ndindex(x.shape):
                if np.isinf(x[idx]):
                    continue
                saved = x[idx]
                x[idx] = saved + eps
                up = loss(outs, lses)
                x[idx] = saved - eps
                down = loss(outs, lses)
                x[idx] = saved
                numeric[idx] = (up - down) / (2 * eps)
            np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-8, err_msg=f"{which}[{i}]")
    assert dlses[1][0, 0, 1] == 0 and np.all(douts[1][0, 1, 0] == 0)


BAD = [
    ("not a list", lambda o, l: (o[0], l), TypeError, "outs must be a non-empty list"),
    ("empty", lambda o, l: ([], []), TypeError, "outs must be a non-empty list"),
    ("counts", lambda o, l: (o, l[:1]), ValueError, "one entry per part"),
    ("shapes", lambda o, l: ([o[0], o[1][:, :2]], l), ValueError, r"outs\[1\] must have outs\[0\]'s shape"),
    ("lse shape", lambda o, l: (o, [l[0], l[1][..., :2]]), ValueError, r"lses\[1\] must have shape"),
    ("lse dtype", lambda o, l: (o, [l[0], l[1].astype(np.float64)]), TypeError, r"lses\[1\] must have dtype float32"),
    ("out dtypes", lambda o, l: ([o[0], o[1].astype(np.float64)], l), TypeError, "must share one dtype"),
    ("library", lambda o, l: ([o[0].tolist(), o[1]], l), TypeError, r"outs\[0\] must be a numpy.ndarray"),
]


@pytest.mark.parametrize("what, change, error, message", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_refused(rng, what, change, error, message):
    q, k, v = make_qkv(rng, 1, 4, 6, 2, 1, 8, np.float32)
    outs, lses = _parts(q, k, v, [0, 3, 6])
    with pytest.raises(error, match=message):
        flashcupy.merge(*change(outs, lses))


def test_bad_backward_arguments_are_named(rng):
    q, k, v = make_qkv(rng, 1, 4, 6, 2, 1, 8, np.float32)
    outs, lses = _parts(q, k, v, [0, 3, 6])
    out, lse = flashcupy.merge(outs, lses)
    with pytest.raises(ValueError, match=r"dout must have shape \(1, 4, 2, 8\) and dtype float32"):
        flashcupy.merge_backward(out[:, :2], outs, lses, out, lse)
    with pytest.raises(ValueError, match="dlse must have shape"):
        flashcupy.merge_backward(out, outs, lses, out, lse, lse.astype(np.float64))
