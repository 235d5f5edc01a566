"""The oracle itself: its backward against central finite differences of its forward."""

import numpy as np
import pytest

from conftest import CASES, case_id, make_qkv, reference
from reference.compare import error_ratio, expected


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(1, 3, 5, 2, 1, 4), (2, 5, 3, 2, 2, 3)])
def test_oracle_backward_matches_finite_differences(rng, shape, causal):
    B, Sq, Sk, Hq, Hkv, D = shape
    q, k, v = make_qkv(rng, B, Sq, Sk, Hq, Hkv, D, np.float64)
    w = rng.standard_normal(q.shape)  # loss = sum(w * out), so dout = w

    def loss(q_, k_, v_):
        return float(np.sum(w * reference.attention(q_, k_, v_, causal=causal)))

    grads = reference.attention_backward(w, q, k, v, causal=causal)
    h = 1e-6
    for x, g in zip((q, k, v), grads):
        numeric = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            old = x[idx]
            x[idx] = old + h
            up = loss(q, k, v)
            x[idx] = old - h
            down = loss(q, k, v)
            x[idx] = old
            numeric[idx] = (up - down) / (2 * h)
        np.testing.assert_allclose(g, numeric, rtol=1e-6, atol=1e-8)


def test_oracle_fully_masked_rows_are_zero_with_lse_minus_inf(rng):
    # Sq > Sk with causal: rows 0 .. Sq-Sk-1 see no key
    q, k, v = make_qkv(rng, 1, 5, 2, 1, 1, 3, np.float64)
    out, lse = reference.attention(q, k, v, causal=True, return_lse=True)
    assert np.all(out[:, :3] == 0) and np.all(np.isneginf(lse[:, :, :3]))
    assert np.all(np.isfinite(lse[:, :, 3:]))
    dq, dk, dv = reference.attention_backward(np.ones_like(q), q, k, v, causal=True)
    assert np.all(dq[:, :3] == 0)


def test_oracle_lse_is_natural_log_of_the_softmax_denominator(rng):
    q, k, v = make_qkv(rng, 1, 4, 6, 1, 1, 5, np.float64)
    _, lse = reference.attention(q, k, v, return_lse=True)
    s = q[0, :, 0] @ k[0, :, 0].T / np.sqrt(5)
    np.testing.assert_allclose(lse[0, 0], np.log(np.exp(s).sum(axis=1)), rtol=1e-13)


def test_visible_is_the_readmes_causal_rule():
    """Bottom-right by default (the last query sees every key), the top-left of torch's is_causal
    with diagonal=0, everything without causal."""
    np.testing.assert_array_equal(reference.visible(2, 4, True), [[1, 1, 1, 0], [1, 1, 1, 1]])
    np.testing.assert_array_equal(reference.visible(4, 2, True), [[0, 0], [0, 0], [1, 0], [1, 1]])
    np.testing.assert_array_equal(reference.visible(3, 3, True, diagonal=0), np.tril(np.ones((3, 3), bool)))
    np.testing.assert_array_equal(reference.visible(2, 3, False), np.ones((2, 3), bool))


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("case", [c for c in CASES if c[5] <= 128], ids=case_id)
def test_the_tolerance_fails_an_lse_off_by_a_thousandth(rng, case, dtype):
    # the issue that rewrote the rule: 0.004 of lse bias used to pass; the oracle's own answer passes
    B, Sq, Sk, Hq, Hkv, D, causal = case
    q, k, v = make_qkv(rng, B, Sq, Sk, Hq, Hkv, D, dtype)
    want = expected(q, k, v, causal=causal)
    lse = want.want["lse"]
    assert error_ratio(lse, want, "lse") == 0
    if np.isfinite(lse).any():
        assert error_ratio(lse + 1e-3, want, "lse") > 1
