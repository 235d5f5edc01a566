"""The modifier cases and the oracle checks that more than one backend's test file runs.

modifier_cases: every score modifier alone, the broadcast shapes of bias and mask, and
combinations (tests/test_modifiers.py runs them on NumPy, tests/test_cupy_modifiers.py on the
emulated cupy backend, tests/test_numba_backend.py on numba). check: forward, backward and
attention_probs of one backend against the float64 oracle through the one tolerance rule
(conftest.assert_matches_oracle). large_scores_check: scores that dwarf the accumulation dtype's
roundoff (issue 31), for the numpy, cupy, tensor-core and numba test files.
"""

import numpy as np

import flashcupy
from flashcupy import _api
from conftest import BF16, assert_matches_oracle, bf16_bits
from reference.compare import error_ratio, expected, kernel_family


def modifier_cases(rng, shape, dtype):
    """{name: keyword arguments}: every modifier alone, the broadcast shapes of bias and mask, and
    combinations, causal among them. Bias in q's dtype unless named float32."""
    B, Sq, Sk, Hq, Hkv, D = shape
    bias_dtype = np.float32 if dtype == np.float64 else dtype

    def bias(*dims, dt=bias_dtype):
        return rng.standard_normal(dims).astype(dt)

    key_padding = rng.random((B, 1, 1, Sk)) < 0.8
    key_padding[0, 0, 0, :] = B == 1  # batch 0 has no key at all (with one batch, it has them all)
    mask = rng.random((B, Hq, Sq, Sk)) < 0.7
    mask[-1, -1, 5, :] = False  # a row that sees no key
    slopes = rng.uniform(0.05, 0.5, (Hq,)).astype(np.float32)
    return {
        "window": dict(window=(5, 3)),
        "window-diagonal-only": dict(window=(0, 0)),
        "window-right-only": dict(window=(None, 4)),
        "window-left-only": dict(window=(6, None)),
        "causal-window": dict(causal=True, window=(7, None)),
        "causal-window-right-ignored": dict(causal=True, window=(3, 9)),
        "softcap": dict(softcap=1.5),
        "softcap-causal": dict(softcap=0.5, causal=True),
        "alibi": dict(alibi_slopes=slopes),
        "alibi-per-batch": dict(alibi_slopes=rng.uniform(0.05, 0.5, (B, Hq)).astype(np.float32)),
        "bias": dict(bias=bias(B, Hq, Sq, Sk)),
        "bias-1HSS": dict(bias=bias(1, Hq, Sq, Sk)),
        "bias-B11S": dict(bias=bias(B, 1, 1, Sk)),
        "bias-11S1-float32": dict(bias=bias(1, 1, Sq, 1, dt=np.float32)),
        "bias-1111": dict(bias=bias(1, 1, 1, 1)),
        "bias-SS": dict(bias=bias(Sq, Sk)),  # fewer dimensions: lined up with (B, Hq, Sq, Sk) from the right
        "mask": dict(mask=mask),
        "mask-key-padding": dict(mask=key_padding),
        "all": dict(window=(9, 2), softcap=2.0, alibi_slopes=slopes, bias=bias(1, Hq, Sq, Sk), mask=key_padding),
        "all-causal": dict(causal=True, window=(11, None), softcap=2.0, alibi_slopes=slopes,
                           bias=bias(B, 1, Sq, Sk), mask=mask),
    }


def named_modifiers(rng, names, B, Sq, Sk, Hq, window=(40, 9)):
    """Keyword arguments of the modifiers `names` names ("softcap", "alibi", "bias", "mask", "window"): a
    float32 (1, heads_q, Sq, Sk) bias, per-(batch, head) slopes, a (batch, 1, Sq, Sk) mask that leaves
    row 3 of batch 0 no key."""
    kw = {}
    if "softcap" in names:
        kw["softcap"] = 2.5
    if "alibi" in names:
        kw["alibi_slopes"] = rng.uniform(0.05, 0.5, (B, Hq)).astype(np.float32)
    if "bias" in names:
        kw["bias"] = rng.standard_normal((1, Hq, Sq, Sk)).astype(np.float32)
    if "mask" in names:
        kw["mask"] = rng.random((B, 1, Sq, Sk)) < 0.7
        kw["mask"][0, 0, 3] = False
    if "window" in names:
        kw["window"] = window
    return kw


# Scales inside the accumulation dtype's range, so accepted, at which the scores of inputs of magnitude
# 0.5 dwarf 1 / the dtype's roundoff: the s - lse that the backward and attention_probs recompute is then
# off by far more than 1, either way (issue 31: P = inf, and NaN gradients, before P was clamped to 1).
# (float16 would hold no gradient of such scales; bfloat16, of float32's range, would.)
LARGE_SCALES = [(np.float32, 1e11), (np.float32, 1e30), (np.float32, 1e38), (np.float64, 1e200),
                (np.float64, 1e300)]


def large_scores_check(backend, dtype, scale, head_dim=4, seeds=range(4), bits=False, batch=1, **kw):
    """The shapes issue 31 found it with, q (1, 6, 1, D) against k, v (1, 7, 1, D) (batch: a batch of
    them, such as the NumPy backend runs in groups from 8 on), inputs of magnitude
    0.5, a few seeds (which way each score's rounding goes depends on the data): out, lse, dq, dk, dv
    (and dbias with kw's bias=True) against the oracle, whose gradients are finite there, and
    attention_probs against it and within [0, 1]. (Its rows need not sum to 1: a P of 1 can come out 0.)
    bits: bfloat16 (dtype BF16) passed as uint16 bit patterns, as CuPy holds it."""
    for seed in seeds:
        rng = np.random.default_rng(seed)
        q, dout = ((0.5 * rng.standard_normal((batch, 6, 1, head_dim))).astype(dtype) for _ in range(2))
        k, v = ((0.5 * rng.standard_normal((batch, 7, 1, head_dim))).astype(dtype) for _ in range(2))
        call = dict(kw, scale=scale)
        if call.get("bias") is True:
            call["bias"] = (0.5 * rng.standard_normal((1, 1, 6, 7))).astype(dtype)
        if bits:
            q, k, v, dout = (bf16_bits(x) for x in (q, k, v, dout))
            call = dict(call, dtype="bfloat16", **({"bias": bf16_bits(call["bias"])} if "bias" in call else {}))
        out, lse = flashcupy.attention(q, k, v, return_lse=True, backend=backend, **call)
        grads = flashcupy.attention_backward(dout, q, k, v, out, lse, backend=backend, **call)
        assert_matches_oracle((out, lse, *grads), q, k, v, dout, backend=backend, **call)
        P = flashcupy.attention_probs(q, k, lse, backend=backend, **call)
        assert np.all((P >= 0) & (P <= 1)), (seed, P)
        family = kernel_family(backend, call.get("dtype", dtype), head_dim)
        assert error_ratio(P, expected(q, k, v, probs=True, family=family, **call), "P") <= 1


def check(q, k, v, dout, rng=None, bits=False, rows=None, backend="numpy", **kw):
    """Forward, backward and attention_probs of `backend` against the oracle (the one tolerance
    rule); returns the ratios. bits: bfloat16 as uint16 bit patterns (bias too, when in bfloat16)."""
    call = dict(kw)
    ref = dict(kw)
    if bits:
        q, k, v, dout = (bf16_bits(x) for x in (q, k, v, dout))
        if "bias" in kw and kw["bias"].dtype == BF16:
            call["bias"] = bf16_bits(kw["bias"])
        call["dtype"] = ref["dtype"] = "bfloat16"
    out, lse = flashcupy.attention(q, k, v, return_lse=True, backend=backend, **call)
    assert out.dtype == q.dtype and out.shape == q.shape
    grads = flashcupy.attention_backward(dout, q, k, v, out, lse, backend=backend, **call)
    assert len(grads) == (4 if "bias" in kw else 3)
    for g, x in zip(grads, (q, k, v, call.get("bias"))):
        assert g.dtype == x.dtype and g.shape == x.shape
    ratios = assert_matches_oracle((out, lse, *grads), q, k, v, dout, backend=backend, **ref)
    P = flashcupy.attention_probs(q, k, lse, rows=rows, backend=backend, **call)
    want = expected(q, k, v, probs=True, family=kernel_family(backend, ref.get("dtype", q.dtype), q.shape[-1]), **ref)
    ratios["P"] = error_ratio(P, want, "P", rows=rows)
    assert ratios["P"] <= 1, f"P: error {ratios['P']:.3g} times the tolerance"
    # into= (flashcupy.jax's XLA buffer): written in place, a strided view, the same numbers
    wide = np.full(P.shape[:-1] + (2 * P.shape[-1],), np.nan, P.dtype)
    into = wide[..., ::2]
    assert _api.probs(q, k, lse, rows=rows, backend=backend, into=into, **call) is into
    np.testing.assert_array_equal(into, P)
    assert np.isnan(wide[..., 1::2]).all()
    sums = P.sum(axis=-1)
    seen = np.isfinite(lse if rows is None else lse[:, :, rows])
    np.testing.assert_allclose(sums[seen], 1, rtol=1e-3 if q.dtype != np.float64 else 1e-12)
    assert np.all(sums[~seen] == 0)
    return ratios


def rows_that_see_no_key_ignore_dlse(rng, backend, dtype=np.float16, shape=(70, 64)):
    """A bool mask that hides every key of two rows (one in each of two query blocks of 64), whose dlse
    (the gradient of lse) is NaN, the others' random: no NaN reaches dq, dk or dv, and every output
    is the oracle's (the NumPy backend zeroes those rows' dlse; the kernels select dS = 0 for a hidden
    pair, whatever D holds)."""
    S, D = shape
    q, k, v = (rng.standard_normal((1, S, 2, D)).astype(dtype) for _ in range(3))
    dout = rng.standard_normal(q.shape).astype(dtype)
    mask = np.ones((1, 1, S, S), bool)
    mask[..., 1, :] = mask[..., S - 2, :] = False
    out, lse = flashcupy.attention(q, k, v, mask=mask, return_lse=True, backend=backend)
    dlse = np.where(np.isneginf(lse), np.nan, rng.standard_normal(lse.shape)).astype(lse.dtype)
    assert np.isnan(dlse).sum() == 4
    grads = flashcupy.attention_backward(dout, q, k, v, out, lse, mask=mask, dlse=dlse, backend=backend)
    assert not any(np.isnan(g).any() for g in grads)
    assert_matches_oracle((out, lse, *grads), q, k, v, dout, mask=mask, dlse=dlse, backend=backend)
