"""Score modifiers (issue 13): window, softcap, ALiBi, bias (with dbias) and bool masks.

Each alone and combined, forward, backward and attention_probs, on the NumPy backend against the
float64 oracle, through the one tolerance rule (tests/modifier_checks.py's check); the interface's
refusals; the band the window adds to the tile plans; deliberate bugs the battery must catch.
"""

import math
import sys

import numpy as np
import pytest

import flashcupy
from conftest import BF16, assert_matches_oracle, make_qkv, mutate_band, mutated_package, reference
from flashcupy.backends import numpy_backend
from modifier_checks import check, modifier_cases, rows_that_see_no_key_ignore_dlse


# GQA (2 query heads per kv head), lengths no tile divides, Sq < Sk
SHAPE = (2, 37, 45, 4, 2, 16)


CASE_NAMES = list(modifier_cases(np.random.default_rng(0), SHAPE, np.float32))


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("name", CASE_NAMES)
def test_modifier_matches_the_oracle(rng, small_tiles, name, dtype):
    q, k, v = make_qkv(rng, *SHAPE, dtype)
    dout = rng.standard_normal(q.shape).astype(dtype)
    kw = modifier_cases(rng, SHAPE, dtype)[name]
    check(q, k, v, dout, rows=np.array([36, 0, 5, -1, 20]), **kw)


@pytest.mark.parametrize("bits", [False, True], ids=["ml_dtypes", "uint16-bits"])
@pytest.mark.parametrize("name", ["all", "all-causal", "bias-B11S", "bias-11S1-float32"])
def test_modifiers_in_bfloat16(rng, small_tiles, name, bits):
    q, k, v = make_qkv(rng, *SHAPE, BF16)
    dout = rng.standard_normal(q.shape).astype(BF16)
    check(q, k, v, dout, bits=bits, rows=slice(3, 30, 2), **modifier_cases(rng, SHAPE, BF16)[name])


@pytest.mark.parametrize("Sq, Sk", [(30, 9), (9, 30), (1, 1), (17, 17)])
@pytest.mark.parametrize("window", [(0, 0), (3, 1), (None, 0), (2, None)])
@pytest.mark.parametrize("causal", [False, True])
def test_windows_past_the_ends(rng, small_tiles, Sq, Sk, window, causal):
    # Sq > Sk and Sq < Sk put whole blocks of rows outside the band: out 0, lse -inf, zero grads
    q, k, v = make_qkv(rng, 1, Sq, Sk, 2, 1, 8, np.float32)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    check(q, k, v, dout, window=window, causal=causal)


def test_rows_that_see_no_key_give_zeros_and_keep_nan_in_dout_to_themselves(rng, small_tiles):
    B, Sq, Sk, Hq, Hkv, D = SHAPE
    q, k, v = make_qkv(rng, *SHAPE, np.float32)
    mask = np.ones((B, Hq, Sq, Sk), bool)
    mask[0, 1, 3] = False          # masked out entirely
    mask[1, :, 20:24, 30:] = False  # partly: these rows still see keys 0..29
    bias = rng.standard_normal((1, Hq, Sq, Sk)).astype(np.float32)
    kw = dict(mask=mask, bias=bias, window=(30, None))  # rows 0..? see keys from i + 8 - 30
    out, lse = flashcupy.attention(q, k, v, return_lse=True, **kw)
    assert np.all(out[0, 3, 1] == 0) and np.isneginf(lse[0, 1, 3])
    dout = rng.standard_normal(q.shape).astype(np.float32)
    dout[0, 3, 1] = np.nan
    grads = flashcupy.attention_backward(dout, q, k, v, out, lse, **kw)
    assert not any(np.isnan(g).any() for g in grads)
    assert np.all(grads[0][0, 3, 1] == 0)
    assert_matches_oracle((out, lse, *grads), q, k, v, dout, backend="numpy", **kw)
    # a row a window leaves no key (Sq > Sk, window (0, 0)): nothing reaches dbias either
    q, k, v = make_qkv(rng, 1, 20, 6, 2, 1, 8, np.float32)
    bias = rng.standard_normal((1, 2, 20, 6)).astype(np.float32)
    out, lse = flashcupy.attention(q, k, v, window=(0, 0), bias=bias, return_lse=True)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    dout[:, :14] = np.nan
    dq, dk, dv, dbias = flashcupy.attention_backward(dout, q, k, v, out, lse, window=(0, 0), bias=bias)
    assert np.all(out[:, :14] == 0) and np.all(np.isneginf(lse[:, :, :14]))
    assert np.all(dq[:, :14] == 0) and np.all(dbias[:, :, :14] == 0)
    assert not any(np.isnan(g).any() for g in (dq, dk, dv, dbias))


@pytest.mark.parametrize("view", ["zero-strides", "transposed", "reversed"])
def test_bias_and_mask_views_are_read_as_they_are(rng, small_tiles, view):
    B, Sq, Sk, Hq, Hkv, D = SHAPE
    q, k, v = make_qkv(rng, *SHAPE, np.float32)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    if view == "zero-strides":  # full shape, no memory behind the broadcast dimensions
        bias = np.broadcast_to(rng.standard_normal((1, Hq, 1, Sk)).astype(np.float32), (B, Hq, Sq, Sk))
        mask = np.broadcast_to(rng.random((B, 1, 1, Sk)) < 0.8, (B, Hq, Sq, Sk))
        assert 0 in bias.strides and 0 in mask.strides
    elif view == "transposed":
        bias = rng.standard_normal((B, Sk, Sq, Hq)).astype(np.float32).transpose(0, 3, 2, 1)
        mask = (rng.random((Sk, Sq, 1, B)) < 0.8).transpose(3, 2, 1, 0)
    else:
        bias = rng.standard_normal((1, Hq, Sq, Sk)).astype(np.float32)[:, ::-1, :, ::-1]
        mask = (rng.random((B, 1, Sq, Sk)) < 0.8)[::-1, :, ::-1]
    check(q, k, v, dout, bias=bias, mask=mask, softcap=3.0)


def test_dbias_is_reproducible_and_right_however_its_items_share_it(rng, monkeypatch):
    """Several kv-head groups and key blocks per batch (tasks of one kv head each), so that items of
    the backward meet in dbias: a bias broadcast over heads (items of one key block together),
    over keys (per-partition sums), over both, and not at all; each twice, bit for bit."""
    monkeypatch.setattr(numpy_backend.plan, "MIN_TASK_FLOPS", 1)
    old = (numpy_backend.config.BLOCK_M, numpy_backend.config.BLOCK_N, numpy_backend.config.NUM_THREADS)
    numpy_backend.configure(block_m=16, block_n=8, num_threads=8)  # 8 partitions of 4 kv groups x 9 key blocks
    groups = []
    balanced = numpy_backend.plan.balanced_parts
    monkeypatch.setattr(numpy_backend.plan, "balanced_parts",
                        lambda costs, n, together=None: groups.append(together) or balanced(costs, n, together))
    try:
        B, Sq, Sk, Hq, Hkv, D = 2, 33, 70, 8, 4, 8
        q, k, v = make_qkv(rng, B, Sq, Sk, Hq, Hkv, D, np.float32)
        dout = rng.standard_normal(q.shape).astype(np.float32)
        for shape in [(B, Hq, Sq, Sk), (1, 1, Sq, Sk), (B, Hq, Sq, 1), (1, 1, 1, Sk), (B, 1, Sq, 1), (1, 1, 1, 1)]:
            bias = rng.standard_normal(shape).astype(np.float32)
            kw = dict(bias=bias, causal=True, window=(40, None))
            out, lse = flashcupy.attention(q, k, v, return_lse=True, **kw)
            first = flashcupy.attention_backward(dout, q, k, v, out, lse, **kw)
            assert_matches_oracle((out, lse, *first), q, k, v, dout, backend="numpy", **kw)
            again = flashcupy.attention_backward(dout, q, k, v, out, lse, **kw)
            for a, b in zip(first, again):
                np.testing.assert_array_equal(a, b)
        assert any(g is not None for g in groups)  # the items of a key block were kept together
    finally:
        numpy_backend.config.BLOCK_M, numpy_backend.config.BLOCK_N, numpy_backend.config.NUM_THREADS = old


@pytest.mark.parametrize("kw", [dict(alibi_slopes=np.array([0.1, 0.2], np.float32)), dict(bias="big"),
                                dict(mask="half"), dict(window=(4, 2), softcap=500.0), dict(window=(4, 2))],
                         ids=["alibi", "bias", "mask", "window-softcap", "window"])
def test_modified_scores_far_from_zero_keep_full_precision(rng, small_tiles, kw):
    # scores near +400: the lazily raised reference m must be subtracted from modified scores too,
    # and every row a tile shows a key must be redone where its sum overflows (a row only the
    # mask or the band hides from the whole tile needs none)
    q = np.ones((1, 40, 2, 16), np.float32)
    k = (10 + rng.standard_normal((1, 50, 1, 16))).astype(np.float32)
    v = rng.standard_normal((1, 50, 1, 16)).astype(np.float32)
    if kw.get("bias") == "big":
        kw = dict(bias=(50 * rng.standard_normal((1, 2, 40, 50))).astype(np.float32))
    if kw.get("mask") == "half":
        kw = dict(mask=rng.random((1, 1, 40, 50)) < 0.5)
    out, lse = flashcupy.attention(q, k, v, scale=2.5, return_lse=True, **kw)
    assert_matches_oracle((out, lse), q, k, v, scale=2.5, backend="numpy", **kw)


def test_no_modifier_means_no_modifier(rng):
    # window (None, None) restricts nothing, and a window's right never narrows causal: such calls
    # are the plain ones, bit for bit, and need no backend that computes modifiers
    q, k, v = make_qkv(rng, 1, 50, 60, 2, 1, 16, np.float32)
    for kw, plain in [(dict(window=(None, None)), {}), (dict(window=[None, 5], causal=True), dict(causal=True))]:
        np.testing.assert_array_equal(flashcupy.attention(q, k, v, **kw), flashcupy.attention(q, k, v, **plain))
        p = flashcupy._checks.problem(q, k, v, kw.get("causal", False), None, None, "numpy", kw["window"])
        assert p.modifiers == frozenset()


def test_a_window_visits_only_the_band(small_tiles):
    """Key blocks outside the band are never visited: the tile plans of a window of w keys cover
    O(seqlen x (w + tile)) pairs, forward and backward, not O(seqlen^2)."""
    from flashcupy._problem import Problem
    S, w = 4096, 64
    numpy_backend.configure(block_m=256, block_n=128)
    p = Problem(batch=1, seqlen_q=S, seqlen_k=S, heads_q=1, heads_kv=1, head_dim=64, dtype="float32",
                causal=True, scale=1.0, carrier=np.dtype(np.float32), window_left=w - 1)
    step = numpy_backend.plan.staircase_step(256, 1, 64)
    fwd = sum((r1 - r0) * (j1 - j0) for i0, i1 in numpy_backend.tiling.blocks(0, S, 256)
              for r0, r1, j0, j1, _ in numpy_backend.tiling.forward_tiles(p, i0, i1, step))
    bwd = sum((i1 - i0) * (y1 - y0) for j0, j1 in numpy_backend.tiling.blocks(0, S, 128)
              for i0, i1, y0, y1, _ in numpy_backend.tiling.backward_tiles(p, j0, j1, step))
    visible = p.band.pairs
    assert visible == S * w - w * (w - 1) // 2
    assert fwd <= S * (w + 2 * step) and bwd <= S * (w + 2 * step), (fwd, bwd, visible)
    assert p.flops() == 4.0 * 64 * visible


def test_the_backward_with_a_bias_needs_little_beyond_dbias(rng):
    """dbias is the backward's extra memory (issue 13): no copy of it, no O(seqlen^2) workspace,
    only tile-sized scratch per worker (a bias tile); and with return_dbias=False nothing for it: the
    peak is the unbiased backward's, within a tile per worker."""
    import tracemalloc
    S, H = 2048, 2
    q, k, v = make_qkv(rng, 1, S, S, H, H, 16, np.float32)
    bias = rng.standard_normal((1, H, S, S)).astype(np.float32)
    out, lse = flashcupy.attention(q, k, v, return_lse=True, bias=bias)
    peaks = []
    for kw in ({}, dict(bias=bias), dict(bias=bias, return_dbias=False)):
        flashcupy.attention_backward(out, q, k, v, out, lse, **kw)  # the workers' scratch, made once
        tracemalloc.start()
        tracemalloc.reset_peak()
        flashcupy.attention_backward(out, q, k, v, out, lse, **kw)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    scratch = numpy_backend.worker_count() * numpy_backend.plan.TILE_VOLUME[4] * 4  # bytes of one tile per worker
    assert bias.nbytes <= peaks[1] - peaks[0] < bias.nbytes + scratch, (peaks, bias.nbytes)
    assert peaks[2] - peaks[0] < scratch < bias.nbytes, (peaks, scratch, bias.nbytes)


# ----------------------------------------------------------------------------
# the interface


def test_backward_and_vjp_return_dbias_only_with_a_bias(rng):
    q, k, v = make_qkv(rng, 1, 9, 11, 2, 1, 8, np.float32)
    bias = rng.standard_normal((1, 1, 9, 11)).astype(np.float16)  # q is float32: a float16 bias is refused
    with pytest.raises(TypeError, match="bias must have q's dtype float32, got float16"):
        flashcupy.attention(q, k, v, bias=bias)
    bias = bias.astype(np.float32)
    out, vjp = flashcupy.attention_vjp(q, k, v, bias=bias, softcap=5.0)
    grads = vjp(np.ones_like(out))
    assert len(grads) == 4 and grads[3].shape == bias.shape and grads[3].dtype == np.float32
    want = reference.attention_backward(np.ones_like(out), q, k, v, bias=bias, softcap=5.0)
    np.testing.assert_allclose(grads[3], want[3], rtol=1e-4, atol=1e-5)
    _, vjp = flashcupy.attention_vjp(q, k, v, mask=np.ones((1, 1, 1, 11), bool))
    assert len(vjp(np.ones_like(out))) == 3


@pytest.mark.parametrize("name", [n for n in CASE_NAMES if "bias" in n or n.startswith("all")])
def test_return_dbias_false_gives_the_same_dq_dk_dv_and_no_dbias(rng, small_tiles, monkeypatch, name):
    """attention_backward(..., return_dbias=False): (dq, dk, dv) bit for bit those of the call that
    returns dbias, and the backend told to spend nothing on it (Problem.dbias); on every bias shape,
    with leading dimensions, and on the groups of short sequences (numpy_backend/packed.py)."""
    seen = []
    backward = numpy_backend.backward

    def spy(p, *args, **kw):
        seen.append(p.dbias)
        return backward(p, *args, **kw)
    monkeypatch.setattr(numpy_backend, "backward", spy)
    kw = modifier_cases(rng, SHAPE, np.float32)[name]
    for batch in ((2,), (9,), (3, 3)):  # the tiled path; the groups; leading dimensions
        q, k, v = (x.reshape(batch + x.shape[1:]) for x in make_qkv(rng, math.prod(batch), *SHAPE[1:], np.float32))
        dout = rng.standard_normal(q.shape).astype(np.float32)
        # the cases' per-batch bias and mask (batch 2) as one that the batch shares
        call = {n: x[:1] if np.ndim(x) == 4 and batch != (2,) else x for n, x in kw.items()}
        out, lse = flashcupy.attention(q, k, v, return_lse=True, **call)
        seen.clear()
        whole = flashcupy.attention_backward(dout, q, k, v, out, lse, **call)
        without = flashcupy.attention_backward(dout, q, k, v, out, lse, return_dbias=False, **call)
        assert len(whole) == 4 and len(without) == 3
        assert seen and all(seen[:len(seen) // 2]) and not any(seen[len(seen) // 2:]), seen
        for a, b in zip(whole, without):
            np.testing.assert_array_equal(a, b)
    with pytest.raises(TypeError, match="return_dbias must be a bool, got int"):
        flashcupy.attention_backward(dout, q, k, v, out, lse, return_dbias=0, **call)


@pytest.mark.parametrize("Sq, Sk", [(0, 5), (5, 0)])
def test_empty_sequences_with_a_bias(Sq, Sk):
    q, k, v = (np.zeros((1, S, 2, 8), np.float32) for S in (Sq, Sk, Sk))
    bias = np.zeros((1, 2, Sq, Sk), np.float32)
    out, lse = flashcupy.attention(q, k, v, bias=bias, window=(1, 1), return_lse=True)
    dq, dk, dv, dbias = flashcupy.attention_backward(out, q, k, v, out, lse, bias=bias)
    assert dbias.shape == bias.shape and dbias.dtype == bias.dtype and not dbias.any()
    assert len(flashcupy.attention_backward(out, q, k, v, out, lse, bias=bias, return_dbias=False)) == 3
    assert flashcupy.attention_probs(q, k, lse, bias=bias).shape == (1, 2, Sq, Sk)


def test_every_backend_computes_every_modifier():
    for name in flashcupy.backends.NAMES:
        assert flashcupy.backends.module(name).MODIFIERS == frozenset(flashcupy._problem.MODIFIERS), name


# A backend that declares only window, softcap and ALiBi (as cupy and numba did before they computed
# bias and mask): how the interface refuses, and how "auto" looks elsewhere
PARTIAL = frozenset({"window", "softcap", "alibi_slopes"})


def test_a_backend_refuses_the_modifiers_it_does_not_declare_by_name(monkeypatch):
    from flashcupy.tools.emulator.cupy import emulated
    monkeypatch.setattr(flashcupy.backends.module("cupy"), "MODIFIERS", PARTIAL)
    q, k, v = make_qkv(np.random.default_rng(0), 1, 8, 8, 2, 1, 8, np.float32)
    with emulated():
        refused = r"^mask is not yet supported by backend 'cupy' \(backend 'numpy' or 'numba' supports it\)"
        with pytest.raises(ValueError, match=refused):
            flashcupy.attention(q, k, v, window=(2, 0), mask=np.ones((1, 1, 8, 8), bool), backend="cupy")
        with pytest.raises(ValueError, match="bias, mask are not yet supported by backend 'cupy'"):
            flashcupy.attention_backward(q, q, k, v, q, np.zeros((1, 2, 8), np.float32), softcap=1.0,
                                         bias=np.zeros((1, 1, 1, 8), np.float32), mask=np.ones((1, 1, 8, 8), bool),
                                         backend="cupy")
        # no modifier: the same backend takes the call (a window that restricts nothing is none)
        flashcupy.attention(q, k, v, window=(None, None), backend="cupy")


def test_auto_picks_a_backend_that_computes_the_modifiers(monkeypatch):
    # a stand-in for CuPy arrays whose default backend lacks the modifier while another has it
    checks = flashcupy._checks
    monkeypatch.setitem(flashcupy.backends.DEFAULT_FOR_LIBRARY, "numpy", "cupy")
    monkeypatch.setattr(flashcupy.backends, "unavailable_reason", lambda name: None)
    monkeypatch.setattr(flashcupy.backends.module("cupy"), "MODIFIERS", PARTIAL)
    from flashcupy.tools.emulator.cupy import emulated
    q, k, v = make_qkv(np.random.default_rng(0), 1, 8, 8, 2, 1, 8, np.float32)
    with emulated():
        p = checks.problem(q, k, v, False, None, None, "numpy", mask=np.ones((1, 1, 8, 8), bool))
        assert checks.select_backend("auto", "numpy", p).NAME == "numpy"
        windowed = checks.problem(q, k, v, False, None, None, "numpy", (1, 1))  # cupy computes windows
        assert checks.select_backend("auto", "numpy", windowed).NAME == "cupy"
        plain = checks.problem(q, k, v, False, None, None, "numpy")
        assert checks.select_backend("auto", "numpy", plain).NAME == "cupy"


def test_attention_probs_refuses_bad_rows_and_lse(rng):
    q, k, v = make_qkv(rng, 1, 6, 7, 2, 1, 8, np.float32)
    out, lse = flashcupy.attention(q, k, v, return_lse=True)
    for rows, exc, words in [(np.array([0, 6]), ValueError, ["rows", "[-6, 6)", "6"]),
                             (np.array([-7]), ValueError, ["rows", "-7"]),
                             (np.array([[0, 1]]), TypeError, ["rows", "1-D", "2-D"]),
                             (np.array([0.5]), TypeError, ["rows", "ints", "float64"]),
                             (np.array([True]), TypeError, ["rows", "bool"]),
                             (3, TypeError, ["rows", "slice", "int"]),
                             ("0:3", TypeError, ["rows", "str"])]:
        with pytest.raises(exc) as info:
            flashcupy.attention_probs(q, k, lse, rows=rows)
        for w in words:
            assert w in str(info.value), f"message {str(info.value)!r} lacks {w!r}"
    with pytest.raises(ValueError, match=r"lse must have shape .* \(1, 2, 6\), got \(1, 2, 5\)"):
        flashcupy.attention_probs(q, k, lse[:, :, :5])
    assert flashcupy.attention_probs(q, k, lse, rows=[]).shape == (1, 2, 0, 7)
    P = flashcupy.attention_probs(q, k, lse, rows=range(6))
    np.testing.assert_allclose(P, reference.attention_probs(q, k), rtol=2e-6, atol=1e-7)


# ----------------------------------------------------------------------------
# deliberate bugs in the modifier code, each caught by a small battery


DBIAS_THEN_SOFTCAP = """        if dbias is not None:
            dbias(dS, slice(i0, i1), slice(j0, j1))
        if T is not None:  # the gradient of q.k scale, before the softcap: dS (1 - tanh²)
            np.square(T, out=T)
            np.subtract(1, T, out=T)
            np.multiply(dS, T, out=dS)
"""

MODIFIER_MUTATIONS = {
    "softcap derivative dropped": ("np.subtract(1, T, out=T)", "np.subtract(1, 0 * T, out=T)"),
    "alibi sign": ("np.subtract(S4, alibi, out=S4)", "np.add(S4, alibi, out=S4)"),
    "alibi distance off by one": ("(i + self.p.diagonal)[:, None]", "(i + self.p.diagonal + 1)[:, None]"),
    "bias not in base 2": ("self._heads(self.bias, b, h0, h1, rows, cols), acc.type(LOG2E)",
                           "self._heads(self.bias, b, h0, h1, rows, cols), acc.type(1.0)"),
    "mask ignored": ("np.copyto(S4, -np.inf, where=hide)", "hide"),
    "dbias not summed over heads": ("t[0, rows, cols] += x.sum(axis=(0, 2))", "t[0, rows, cols] += x[0, :, 0]"),
    "dbias after the softcap": (DBIAS_THEN_SOFTCAP,
                                DBIAS_THEN_SOFTCAP.replace("dbias(dS, slice(i0, i1), slice(j0, j1))", "pass")
                                + "        if dbias is not None:\n            dbias(dS, slice(i0, i1), slice(j0, j1))\n"),
}
# ... and in the band rule (flashcupy/_problem.py, Band), which the NumPy backend's tile plans ask
BAND_MUTATIONS = {
    "window left off by one": ("max(0, i0 + self.diagonal - self.left))", "max(0, i0 + self.diagonal - self.left + 1))"),
}

# (shape, keyword arguments): GQA with every modifier, a bias broadcast over heads, a causal window
MODIFIER_BATTERY = [
    ((1, 21, 26, 4, 2, 8), dict(window=(6, 2), softcap=1.0, alibi_slopes=np.array([0.3, 0.1, 0.5, 0.2], np.float32),
                               bias="1H", mask="keys")),
    ((2, 19, 15, 2, 1, 8), dict(causal=True, window=(4, None), bias="11", mask="rows")),
]


def modifier_battery_fails() -> bool:
    rng = np.random.default_rng(0)
    for shape, kw in MODIFIER_BATTERY:
        B, Sq, Sk, Hq, Hkv, D = shape
        q, k, v = make_qkv(rng, *shape, np.float32)
        dout = rng.standard_normal(q.shape).astype(np.float32)
        kw = dict(kw)
        kw["bias"] = rng.standard_normal((1, Hq if kw["bias"] == "1H" else 1, Sq, Sk)).astype(np.float32)
        kw["mask"] = (rng.random((B, 1, 1, Sk)) < 0.8) if kw["mask"] == "keys" else (rng.random((1, Hq, Sq, Sk)) < 0.8)
        try:
            out, lse = flashcupy.attention(q, k, v, return_lse=True, **kw)
            grads = flashcupy.attention_backward(dout, q, k, v, out, lse, **kw)
            assert_matches_oracle((out, lse, *grads), q, k, v, dout, backend="numpy", **kw)
        except Exception:
            return True
    return False


def test_the_modifier_battery_passes_unmutated(small_tiles):
    assert not modifier_battery_fails()


@pytest.mark.parametrize("name", MODIFIER_MUTATIONS)
def test_a_modifier_mutation_is_caught(monkeypatch, name):
    mutant = mutated_package(numpy_backend, *MODIFIER_MUTATIONS[name])
    mutant.configure(block_m=16, block_n=8, num_threads=2)
    monkeypatch.setitem(sys.modules, numpy_backend.__name__, mutant)
    assert modifier_battery_fails(), f"the battery missed: {name}"


@pytest.mark.parametrize("name", BAND_MUTATIONS)
def test_a_band_mutation_is_caught(monkeypatch, small_tiles, name):
    mutate_band(monkeypatch, *BAND_MUTATIONS[name])
    assert modifier_battery_fails(), f"the battery missed: {name}"


# ----------------------------------------------------------------------------
# property test: random shapes, tiles, layouts and modifier combinations


from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

side = st.one_of(st.none(), st.integers(0, 20))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(B=st.integers(1, 2), Sq=st.integers(1, 30), Sk=st.integers(1, 30), Hkv=st.integers(1, 2),
       group=st.integers(1, 3), D=st.sampled_from([1, 8, 24]), causal=st.booleans(),
       window=st.one_of(st.none(), st.tuples(side, side)), softcap=st.one_of(st.none(), st.floats(0.3, 5.0)),
       alibi=st.sampled_from([None, "H", "BH"]), bias=st.sampled_from([None, "full", "1H", "B11S", "11S1", "1111"]),
       mask=st.sampled_from([None, "full", "keys", "rows"]),
       dtype=st.sampled_from([np.float16, np.float32, np.float64]),
       block_m=st.sampled_from([1, 5, 16]), block_n=st.sampled_from([1, 3, 8]), seed=st.integers(0, 2**16))
def test_property_modifiers_match_the_oracle(B, Sq, Sk, Hkv, group, D, causal, window, softcap, alibi, bias, mask,
                                             dtype, block_m, block_n, seed):
    old = (numpy_backend.config.BLOCK_M, numpy_backend.config.BLOCK_N)
    numpy_backend.configure(block_m=block_m, block_n=block_n)
    try:
        rng = np.random.default_rng(seed)
        Hq = Hkv * group
        q, k, v = make_qkv(rng, B, Sq, Sk, Hq, Hkv, D, dtype)
        dout = rng.standard_normal(q.shape).astype(dtype)
        kw = dict(causal=causal, window=window, softcap=softcap)
        if alibi:
            kw["alibi_slopes"] = rng.uniform(0, 1, (Hq,) if alibi == "H" else (B, Hq)).astype(np.float32)
        dims = {"full": (B, Hq, Sq, Sk), "1H": (1, Hq, Sq, Sk), "B11S": (B, 1, 1, Sk), "11S1": (1, 1, Sq, 1),
                "1111": (1, 1, 1, 1), "keys": (B, 1, 1, Sk), "rows": (1, Hq, Sq, 1)}
        if bias:
            kw["bias"] = rng.standard_normal(dims[bias]).astype(dtype)
        if mask:
            kw["mask"] = rng.random(dims[mask]) < 0.7
        check(q, k, v, dout, rows=rng.integers(-Sq, Sq, 3), **kw)
    finally:
        numpy_backend.config.BLOCK_M, numpy_backend.config.BLOCK_N = old


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_rows_that_see_no_key_ignore_their_dlse(rng, small_tiles, dtype):
    # dlse NaN in the rows a mask hides wholly: the NumPy backend's tiles hold those rows, so their dlse
    # must be zeroed before it meets P = 0
    rows_that_see_no_key_ignore_dlse(rng, "numpy", dtype)
