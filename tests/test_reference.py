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


# Score modifiers (README, Semantics): the oracle's backward, dbias included, against central
# differences of its own forward, for each modifier alone and all together.
def modifier_cases(rng, B, Sq, Sk, Hq):
    bias = rng.standard_normal((1, Hq, Sq, Sk))  # broadcast over the batch: dbias sums over it
    mask = rng.random((B, 1, Sq, Sk)) < 0.7
    mask[0, 0, 1] = False  # a row that sees no key
    slopes = rng.uniform(0.1, 1.0, (Hq,)).astype(np.float32)
    return {
        "window": dict(window=(1, 1)),
        "causal window": dict(window=(2, None), causal=True),
        "softcap": dict(softcap=0.8),
        "alibi": dict(alibi_slopes=slopes),
        "bias": dict(bias=bias),
        "bias (B, 1, 1, Sk)": dict(bias=rng.standard_normal((B, 1, 1, Sk))),
        "mask": dict(mask=mask),
        "all": dict(window=(2, 1), softcap=1.5, alibi_slopes=slopes, bias=bias, mask=mask),
    }


MODIFIER_NAMES = list(modifier_cases(np.random.default_rng(0), 2, 3, 5, 2))


def numeric_gradient(loss, x, h=1e-6):
    numeric = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        old = x[idx]
        x[idx] = old + h
        up = loss()
        x[idx] = old - h
        down = loss()
        x[idx] = old
        numeric[idx] = (up - down) / (2 * h)
    return numeric


@pytest.mark.parametrize("name", MODIFIER_NAMES)
def test_oracle_backward_with_modifiers_matches_finite_differences(rng, name):
    B, Sq, Sk, Hq, Hkv, D = 2, 3, 5, 2, 1, 3
    q, k, v = make_qkv(rng, B, Sq, Sk, Hq, Hkv, D, np.float64)
    kw = modifier_cases(rng, B, Sq, Sk, Hq)[name]
    w = rng.standard_normal(q.shape)  # loss = sum(w * out), so dout = w

    def loss():
        return float(np.sum(w * reference.attention(q, k, v, **kw)))

    grads = reference.attention_backward(w, q, k, v, **kw)
    assert len(grads) == (4 if "bias" in kw else 3)
    inputs = (q, k, v) + ((kw["bias"],) if "bias" in kw else ())
    for x, g in zip(inputs, grads):
        assert g.shape == x.shape
        np.testing.assert_allclose(g, numeric_gradient(loss, x), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("name", MODIFIER_NAMES + ["dropout"])
def test_oracle_jvp_matches_central_differences(rng, name):
    # forward mode: (out, lse) along a tangent of q, k and v (v's head dim its own) and of the bias where
    # there is one, against the central difference of the forward along it; a row that sees no key has
    # lse -inf and tangents 0
    B, Sq, Sk, Hq, Hkv, D = 2, 3, 5, 2, 1, 3
    q, k, v = make_qkv(rng, B, Sq, Sk, Hq, Hkv, D, np.float64)
    v = rng.standard_normal((B, Sk, Hkv, 4))
    kw = dict(dropout_p=0.4, dropout_seed=9, causal=True) if name == "dropout" else \
        modifier_cases(rng, B, Sq, Sk, Hq)[name]
    tangents = [rng.standard_normal(x.shape) for x in (q, k, v)]
    bias_t = rng.standard_normal(np.shape(kw["bias"])) if "bias" in kw else None
    out_t, lse_t = reference.attention_jvp(q, k, v, *tangents, bias_t, **kw)
    h = 1e-6

    def moved(sign):
        given = dict(kw, bias=kw["bias"] + sign * h * bias_t) if bias_t is not None else kw
        return reference.attention(*(x + sign * h * t for x, t in zip((q, k, v), tangents)), return_lse=True,
                                   **given)
    up, down = moved(1), moved(-1)
    np.testing.assert_allclose(out_t, (up[0] - down[0]) / (2 * h), rtol=1e-6, atol=1e-8)
    seen = np.isfinite(up[1])
    np.testing.assert_allclose(lse_t[seen], (up[1][seen] - down[1][seen]) / (2 * h), rtol=1e-6, atol=1e-8)
    assert np.all(lse_t[~seen] == 0) and np.all(out_t.transpose(0, 2, 1, 3)[~seen] == 0)


@pytest.mark.parametrize("name", MODIFIER_NAMES)
def test_oracle_probs_jvp_matches_central_differences(rng, name):
    # attention_probs along a tangent of q, k (and the bias's, where there is one), lse the forward's own:
    # against the central difference of the recomputed P along it, some rows; hidden pairs get 0
    B, Sq, Sk, Hq, Hkv, D = 2, 3, 5, 2, 1, 3
    q, k, _ = make_qkv(rng, B, Sq, Sk, Hq, Hkv, D, np.float64)
    kw = modifier_cases(rng, B, Sq, Sk, Hq)[name]
    tangents = [rng.standard_normal(x.shape) for x in (q, k)]
    bias_t = rng.standard_normal(np.shape(kw["bias"])) if "bias" in kw else None
    rows = [2, 0]
    P_t = reference.attention_probs_jvp(q, k, *tangents, bias_t, rows=rows, **kw)
    h = 1e-6

    def moved(sign):
        given = dict(kw, bias=kw["bias"] + sign * h * bias_t) if bias_t is not None else kw
        return reference.attention_probs(*(x + sign * h * t for x, t in zip((q, k), tangents)), rows=rows, **given)
    np.testing.assert_allclose(P_t, (moved(1) - moved(-1)) / (2 * h), rtol=1e-6, atol=1e-8)
    assert np.all(P_t[reference.attention_probs(q, k, rows=rows, **kw) == 0] == 0)


def test_oracle_modifiers_are_applied_in_the_readmes_order(rng):
    # s = scale q.k -> softcap -> + alibi -> + bias -> hidden -inf -> softmax, written out for one head
    q, k, v = make_qkv(rng, 1, 4, 6, 1, 1, 3, np.float64)
    bias = rng.standard_normal((1, 1, 4, 6))
    mask = rng.random((1, 1, 4, 6)) < 0.8
    slopes = np.array([0.3], np.float32)
    kw = dict(window=(3, 0), softcap=0.7, alibi_slopes=slopes, bias=bias, mask=mask, scale=0.9)
    out, lse = reference.attention(q, k, v, return_lse=True, **kw)
    i, j = np.arange(4)[:, None] + 2, np.arange(6)[None, :]
    s = 0.7 * np.tanh(0.9 * q[0, :, 0] @ k[0, :, 0].T / 0.7) - float(slopes[0]) * abs(i - j) + bias[0, 0]
    s = np.where((j <= i) & (j >= i - 3) & mask[0, 0], s, -np.inf)
    with np.errstate(divide="ignore"):
        want_lse = np.log(np.exp(s).sum(axis=1))
    np.testing.assert_allclose(lse[0, 0], want_lse, rtol=1e-13)
    p = np.nan_to_num(np.exp(s - want_lse[:, None]))
    np.testing.assert_allclose(out[0, :, 0], p @ v[0, :, 0], rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(reference.attention_probs(q, k, lse, **kw)[0, 0], p, rtol=1e-12, atol=1e-15)


def test_visible_takes_the_window():
    # window (1, 0) bottom-right: each query sees its diagonal key and the one before
    np.testing.assert_array_equal(reference.visible(3, 4, False, window=(1, 0)),
                                  [[1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]])
    # causal narrows a window's right to 0; (None, None) restricts nothing
    np.testing.assert_array_equal(reference.visible(3, 3, True, window=(1, 2)), reference.visible(3, 3, False, window=(1, 0)))
    np.testing.assert_array_equal(reference.visible(2, 3, False, window=(None, None)), np.ones((2, 3), bool))
    # windows past the ends: with 3 queries and 1 key, (0, 0) leaves rows 0 and 1 nothing, (0, 1) row 0
    np.testing.assert_array_equal(reference.visible(3, 1, False, window=(0, 0)), [[0], [0], [1]])
    np.testing.assert_array_equal(reference.visible(3, 1, False, window=(0, 1)), [[0], [1], [1]])


def test_oracle_rows_that_see_no_key_with_a_mask_give_zero_everything(rng):
    q, k, v = make_qkv(rng, 1, 4, 5, 2, 1, 3, np.float64)
    mask = np.ones((1, 1, 4, 5), bool)
    mask[..., 2, :] = False
    bias = rng.standard_normal((1, 2, 4, 5))
    out, lse = reference.attention(q, k, v, mask=mask, bias=bias, return_lse=True)
    assert np.all(out[:, 2] == 0) and np.all(np.isneginf(lse[:, :, 2]))
    dout = rng.standard_normal(q.shape)
    dout[:, 2] = np.nan
    dq, dk, dv, dbias = reference.attention_backward(dout, q, k, v, mask=mask, bias=bias)
    assert np.all(dq[:, 2] == 0) and np.all(dbias[:, :, 2] == 0)
    assert not any(np.isnan(g).any() for g in (dq, dk, dv, dbias))


def test_the_kernel_family_of_a_call_is_the_kernels_it_ran(monkeypatch):
    from flashcupy.backends import cupy_backend
    from reference.compare import kernel_family
    assert [kernel_family("numpy", t, 64) for t in ("float16", "bfloat16", "float32")] == ["numpy"] * 3
    assert [kernel_family("numba", t, 64) for t in ("float16", "float64")] == ["simt"] * 2
    assert kernel_family("cupy", np.float16, 64) == kernel_family("cupy", "bfloat16", 128) == "tensor_core"
    assert kernel_family("cupy", np.float16, 100) == kernel_family("cupy", np.float32, 64) == "simt"  # not taken
    assert kernel_family("cupy", np.float16, 256) == "tensor_core"  # the forward's, mma.sync or Hopper
    monkeypatch.setattr(cupy_backend, "USE_WGMMA", False)
    assert kernel_family("cupy", np.float16, 256) == kernel_family("cupy", np.float16, 128) == "tensor_core"
    assert kernel_family("cupy", np.float16, 264) == "simt"
    monkeypatch.setattr(cupy_backend, "USE_TENSOR_CORES", False)
    assert kernel_family("cupy", np.float16, 64) == "simt"
    with pytest.raises(ValueError, match="no kernel family known for backend 'torch'"):
        kernel_family("torch", np.float32, 64)
    with pytest.raises(ValueError, match="family must be one of"):
        expected(*make_qkv(np.random.default_rng(0), 1, 2, 2, 1, 1, 4, np.float32), family="cuda")


@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=lambda d: np.dtype(d).name)
def test_each_family_is_charged_only_its_own_liberties(rng, dtype):
    # SIMT takes neither liberty: the tightest everywhere; numpy's lazy maximum and the tensor cores'
    # 16-bit P/dS each widen some tolerance; None, every family's liberties, is the widest
    B, Sq, Sk, Hq, Hkv, D, causal = 1, 17, 129, 4, 2, 72, True
    q, k, v = make_qkv(rng, B, Sq, Sk, Hq, Hkv, D, dtype)
    dout = rng.standard_normal(q.shape).astype(dtype)
    tol = {f: expected(q, k, v, dout, causal=causal, family=f).tol for f in ("simt", "numpy", "tensor_core", None)}
    for name in tol[None]:
        for family in ("numpy", "tensor_core"):
            assert np.all(tol["simt"][name] <= tol[family][name]) and np.all(tol[family][name] <= tol[None][name])
        assert np.any(tol["simt"][name] < tol["numpy"][name]), name  # LAZY_MAX is in every output's bound
    sixteen = any(np.any(tol["simt"][n] < tol["tensor_core"][n]) for n in tol[None])
    assert sixteen == (dtype == np.float16)  # u_p and round16 exist for 16-bit storage only
