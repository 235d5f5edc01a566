"""Leading batch dimensions (issue 30): q (*batch, seqlen_q, heads_q, head_dim), k and v alike, a bias or
mask broadcast over them the NumPy way, dbias of the bias's own shape; folded into rank-4 calls on
views (flashcupy/_batch.py), never a copy.

Against the float64 oracle (reference/compare.py folds the leading dimensions itself), on every
backend; the layouts structural biology uses (MSA row attention, triangle attention around the
starting and the ending node, the latter a transposed view) against a plain float64 transcription of
the AlphaFold formula; the fold's choice of calls; the refusals.
"""

import itertools

import numpy as np
import pytest

import flashcupy
from conftest import assert_matches_oracle
from flashcupy import _batch
from reference.compare import error_ratio, expected

F32 = np.float32


def make(rng, batch, Sq, Sk, Hq, Hkv, D, dtype=F32):
    q = rng.standard_normal(batch + (Sq, Hq, D)).astype(dtype)
    k = rng.standard_normal(batch + (Sk, Hkv, D)).astype(dtype)
    v = rng.standard_normal(batch + (Sk, Hkv, D)).astype(dtype)
    return q, k, v, rng.standard_normal(q.shape).astype(dtype)


def run(q, k, v, dout, **kw):
    out, lse = flashcupy.attention(q, k, v, return_lse=True, **kw)
    return (out, lse, *flashcupy.attention_backward(dout, q, k, v, out, lse, **kw))


def check(q, k, v, dout, **kw):
    """Forward and backward (dbias with a bias; a gradient of lse too, folded as lse) against the
    oracle; the results' shapes."""
    out, lse = flashcupy.attention(q, k, v, return_lse=True, **kw)
    dlse = np.random.default_rng(lse.size).standard_normal(lse.shape).astype(lse.dtype)
    got = (out, lse, *flashcupy.attention_backward(dout, q, k, v, out, lse, dlse=dlse, **kw))
    batch = q.shape[:-3]
    assert got[0].shape == q.shape and got[1].shape == batch + (q.shape[-2], q.shape[-3])
    assert got[3].shape == k.shape and got[4].shape == v.shape
    if kw.get("bias") is not None:
        assert got[5].shape == kw["bias"].shape and got[5].dtype == kw["bias"].dtype
    assert_matches_oracle(got, q, k, v, dout, **{n: x for n, x in kw.items() if n != "backend"},
                          backend=kw.get("backend", "numpy"), dlse=dlse)
    return got


# every combination of full and broadcast leading dimensions of a bias (and of a mask), with fewer
# leading dimensions too, for q (2, 3, ...): (leading shape of the bias, its last three dimensions)
BATCH = (2, 3)
SHAPES = [lead + tail for lead in [(2, 3), (1, 3), (2, 1), (1, 1), (3,), (1,), ()]
          for tail in [(4, 5, 6), (1, 5, 6), (4, 1, 6)]]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_a_bias_over_every_combination_of_leading_dimensions(rng, shape):
    q, k, v, dout = make(rng, BATCH, 5, 6, 4, 2, 8)
    bias = rng.standard_normal(shape).astype(F32)
    check(q, k, v, dout, bias=bias, causal=True)


@pytest.mark.parametrize("shape", [(2, 3, 4, 5, 6), (2, 1, 1, 5, 6), (1, 3, 1, 1, 6), (5, 6), (6,)],
                         ids=lambda s: "x".join(map(str, s)))
def test_a_mask_over_leading_dimensions(rng, shape):
    q, k, v, dout = make(rng, BATCH, 5, 6, 4, 2, 8)
    mask = rng.random(shape) < 0.7
    check(q, k, v, dout, mask=mask, window=(3, 1))


def test_six_dimensions_with_slopes_per_batch_element(rng):
    q, k, v, dout = make(rng, (2, 2, 3), 7, 9, 2, 1, 8)
    slopes = rng.uniform(0.05, 0.5, (2, 2, 3, 2)).astype(F32)
    bias = rng.standard_normal((2, 1, 3, 1, 7, 9)).astype(F32)
    check(q, k, v, dout, alibi_slopes=slopes, bias=bias, softcap=2.0)
    check(q, k, v, dout, alibi_slopes=slopes[0, 0, 0], causal=True)


@pytest.mark.parametrize("dtype", [np.float16, np.float64], ids=["float16", "float64"])
def test_other_dtypes(rng, dtype):
    q, k, v, dout = make(rng, BATCH, 5, 6, 2, 2, 8, dtype)
    check(q, k, v, dout, bias=rng.standard_normal((2, 1, 2, 5, 6)).astype(dtype), causal=True)


def test_bfloat16_bits(rng):
    import ml_dtypes
    q, k, v, dout = (x.astype(ml_dtypes.bfloat16).view(np.uint16) for x in make(rng, BATCH, 5, 6, 2, 1, 8))
    bias = rng.standard_normal((1, 3, 2, 5, 6)).astype(ml_dtypes.bfloat16).view(np.uint16)
    check(q, k, v, dout, bias=bias, dtype="bfloat16")


# ----------------------------------------------------------------------------
# strides: views that fold and views that do not


def test_strided_leading_dimensions_and_zero_stride_biases(rng):
    """q, k, v whose leading dimensions are a transposed view (they fold apart: one call per index of
    the outer one), a bias broadcast with zero strides at its full shape, a reversed one."""
    base = [rng.standard_normal((3, 2, S, 2, 8)).astype(F32) for S in (5, 6, 6)]
    q, k, v = (x.transpose(1, 0, 2, 3, 4) for x in base)  # (2, 3, ...) whose strides do not fold
    dout = rng.standard_normal(q.shape).astype(F32)
    for bias in (np.broadcast_to(rng.standard_normal((1, 1, 2, 5, 6)).astype(F32), (2, 3, 2, 5, 6)),
                 rng.standard_normal((2, 3, 2, 5, 6)).astype(F32)[:, ::-1],
                 rng.standard_normal((3, 2, 2, 5, 6)).astype(F32).transpose(1, 0, 2, 3, 4)):
        check(q, k, v, dout, bias=bias)


def test_a_bias_broadcast_over_a_looped_dimension_sums_in_a_fixed_order(rng):
    """A bias broadcast over a dimension q cannot fold: the calls' dbias are added in the accumulation
    dtype and rounded once; bitwise the same on every call."""
    q, k, v = (x.transpose(1, 0, 2, 3, 4) for x in
               (rng.standard_normal((3, 2, S, 2, 8)).astype(np.float16) for S in (5, 6, 6)))
    dout = rng.standard_normal(q.shape).astype(np.float16)
    bias = rng.standard_normal((1, 3, 2, 5, 6)).astype(np.float16)
    fold = _batch.Fold((2, 3), [q, k, v], [bias])
    assert fold.looped == (0,), fold.looped  # the bias broadcasts over a looped dimension
    first = check(q, k, v, dout, bias=bias)
    np.testing.assert_array_equal(check(q, k, v, dout, bias=bias)[5], first[5])  # the same dlse, the same bits


@pytest.mark.parametrize("layout, calls", [
    ("contiguous", 1),
    ("ending node, batch 1", 1),
    ("ending node, batch 2", 2),
    ("bias (B, 1, ...), batch 2", 2),
    ("bias (1, 1, ...), batch 2", 1),
])
def test_the_fold_makes_few_calls(layout, calls):
    """How many rank-4 calls a layout costs: every leading dimension folds in the common layouts."""
    B = 2 if "batch 2" in layout else 1
    x = np.zeros((B, 6, 6, 2, 8), F32)
    q = x.transpose(0, 2, 1, 3, 4) if "ending" in layout else x
    bias = None
    if "bias" in layout:
        bias = _batch.padded(np.zeros((B, 1, 2, 6, 6) if "(B, 1" in layout else (1, 1, 2, 6, 6), F32), 5)
    fold = _batch.Fold((B, 6), [q, q, q], [] if bias is None else [bias])
    assert len(list(fold.calls())) == calls


def test_no_input_is_copied(rng, monkeypatch):
    """Each rank-4 call gets views of the caller's q, k, v and bias (a transposed one included)."""
    from flashcupy import _api
    x = rng.standard_normal((1, 6, 6, 2, 8)).astype(F32)
    q = k = v = x.transpose(0, 2, 1, 3, 4)
    bias = rng.standard_normal((1, 2, 6, 6)).astype(F32).transpose(0, 1, 3, 2)[:, None]
    seen = []
    forward = _api.forward

    def spy(q4, k4, v4, **kw):
        if q4.ndim == 4:
            seen.append(all(np.shares_memory(a, b) for a, b in ((q4, x), (k4, x), (v4, x), (kw["bias"], bias))))
        return forward(q4, k4, v4, **kw)

    monkeypatch.setattr(_api, "forward", spy)
    flashcupy.attention(q, k, v, bias=bias)
    assert seen == [True]


# ----------------------------------------------------------------------------
# structural biology: MSA row attention and triangle attention, as AlphaFold writes them


def test_msa_row_attention_with_a_pair_bias_shared_by_every_row(rng):
    """q (batch, rows, residues, heads, head_dim), pair bias (batch, 1, heads, residues, residues)."""
    q, k, v, dout = make(rng, (1, 6), 17, 17, 4, 4, 8)
    pair = rng.standard_normal((1, 1, 4, 17, 17)).astype(F32)
    mask = rng.random((1, 6, 1, 1, 17)) < 0.9  # a residue mask per MSA row
    check(q, k, v, dout, bias=pair, mask=mask)


def _alphafold_triangle(q, k, v, b, ending: bool):
    """AlphaFold 2's triangle attention (supplement, algorithms 13 and 14), in float64, over the pair
    representation's projections q, k, v (B, N, N, H, c) and the bias b (B, N, N, H), one i at a time:
    around the starting node o_ij = sum_k softmax_k(q_ij . k_ik / sqrt(c) + b_jk) v_ik; around the
    ending node o_ij = sum_k softmax_k(q_ij . k_kj / sqrt(c) + b_ki) v_kj."""
    q, k, v, b = (np.asarray(x, np.float64) for x in (q, k, v, b))
    c = q.shape[-1]
    out = np.empty(q.shape)
    for i in range(q.shape[1]):
        if ending:   # s[b, j, h, k] = q_ij . k_kj + b_ki
            s = np.einsum("bjhc,bkjhc->bjhk", q[:, i], k) / np.sqrt(c) + b[:, :, i].transpose(0, 2, 1)[:, None]
        else:        # s[b, j, h, k] = q_ij . k_ik + b_jk
            s = np.einsum("bjhc,bkhc->bjhk", q[:, i], k[:, i]) / np.sqrt(c) + b.transpose(0, 1, 3, 2)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[:, i] = (np.einsum("bjhk,bkjhc->bjhc", p, v) if ending else np.einsum("bjhk,bkhc->bjhc", p, v[:, i]))
    return out


@pytest.mark.parametrize("ending", [False, True], ids=["starting", "ending"])
def test_triangle_attention(rng, ending):
    """The pair representation's projections (1, N, N, heads, c) and a bias (1, N, N, heads) from it, as
    views: around the ending node q, k, v are transposed views (attention runs down the columns) and
    so is the bias. Checked against the AlphaFold formula and to the oracle's tolerance, forward and
    (dbias of the bias view) backward. N = 256: benchmarks/compare_batch_dims.py."""
    for N, backward in ((32, False), (24, True)):
        x = [rng.standard_normal((1, N, N, 4, 8)).astype(F32) for _ in range(3)]
        pair_bias = rng.standard_normal((1, N, N, 4)).astype(F32)
        if ending:
            q, k, v = (t.transpose(0, 2, 1, 3, 4) for t in x)     # (1, j, i, H, c): batch (1, j), sequence i
            bias = pair_bias.transpose(0, 3, 2, 1)[:, None]       # bias[b, 0, h, i, k] = b_ki
        else:
            q, k, v = x                                           # batch (1, i), sequence j
            bias = pair_bias.transpose(0, 3, 1, 2)[:, None]       # bias[b, 0, h, j, k] = b_jk
        formula = _alphafold_triangle(*x, pair_bias, ending)
        out, lse = flashcupy.attention(q, k, v, bias=bias, return_lse=True)
        mine = out.transpose(0, 2, 1, 3, 4) if ending else out
        if not backward:
            want = expected(q, k, v, family="numpy", bias=bias)
            np.testing.assert_allclose(want.want["out"].transpose(0, 2, 1, 3, 4) if ending else want.want["out"],
                                       formula, rtol=1e-12, atol=1e-12)  # the oracle is the formula
            assert error_ratio(out, want, "out") <= 1 and error_ratio(lse, want, "lse") <= 1
            assert abs(mine - formula).max() < 1e-4
        else:
            check(q, k, v, rng.standard_normal(q.shape).astype(F32), bias=bias)


# ----------------------------------------------------------------------------
# every backend


@pytest.mark.parametrize("path", ["tensor-core", "simt"])
def test_the_cupy_backend_on_both_kernel_paths(rng, path):
    """Emulated: float16 with head_dim 16 takes the tensor-core kernels, float32 the SIMT ones."""
    from flashcupy.tools.emulator.cupy import compile_module, emulated, recording
    dtype = np.float16 if path == "tensor-core" else F32
    q, k, v, dout = make(rng, (2, 2), 9, 11, 2, 1, 16, dtype)
    bias = rng.standard_normal((2, 1, 2, 9, 11)).astype(dtype)
    mask = rng.random((1, 2, 1, 1, 11)) < 0.8
    names = []
    with emulated(compile=recording(names, compile_module)):
        check(q, k, v, dout, bias=bias, mask=mask, causal=True, backend="cupy")
        q2, k2, v2 = (x.transpose(1, 0, 2, 3, 4) for x in (q, k, v))  # leading dimensions that do not fold
        check(q2, k2, v2, dout.transpose(1, 0, 2, 3, 4).copy(), bias=bias.transpose(1, 0, 2, 3, 4), backend="cupy")
    assert any(name.startswith("flash_fwd_tc") for name in names) == (path == "tensor-core"), names


def test_attention_probs_and_vjp(rng):
    q, k, v, dout = make(rng, BATCH, 5, 6, 2, 1, 8)
    bias = rng.standard_normal((1, 3, 2, 5, 6)).astype(F32)
    out, lse = flashcupy.attention(q, k, v, bias=bias, return_lse=True)
    P = flashcupy.attention_probs(q, k, lse, rows=[0, 4], bias=bias)
    want = expected(q, k, v, family="numpy", bias=bias, probs=True)
    assert P.shape == BATCH + (2, 2, 6) and error_ratio(P, want, "P", rows=[0, 4]) <= 1
    out2, vjp = flashcupy.attention_vjp(q, k, v, bias=bias)
    np.testing.assert_array_equal(out2, out)
    assert_matches_oracle((out, lse, *vjp(dout)), q, k, v, dout, bias=bias, backend="numpy")


@pytest.mark.parametrize("Sq, Sk", [(0, 6), (5, 0), (0, 0)])
def test_empty_sequences_under_leading_dimensions(rng, Sq, Sk):
    # against the oracle, whose own fold of the leading dimensions failed at size 0 until it
    # multiplied them out (reshape cannot solve -1 there)
    check(*make(rng, BATCH, Sq, Sk, 4, 2, 8), bias=rng.standard_normal((1, 1, 4, Sq, Sk)).astype(F32), causal=True)


def test_empty_leading_dimensions(rng):
    q, k, v, dout = make(rng, (2, 0), 5, 6, 2, 1, 8)
    out, lse, dq, dk, dv, dbias = run(q, k, v, dout, bias=np.zeros((1, 1, 2, 5, 6), F32))
    assert out.shape == q.shape and lse.shape == (2, 0, 2, 5) and dbias.shape == (1, 1, 2, 5, 6)
    assert not dbias.any()


# ----------------------------------------------------------------------------
# refusals, before any work


BAD = [
    ("k's leading dimensions", dict(k=(2, 4)), {}, ValueError, ["k", "leading", "(2, 3)", "(2, 4)"]),
    ("bias batch dimension", {}, dict(bias=(2, 2, 4, 5, 6)), ValueError,
     ["bias", "batch dimension 1", "2, not 3 or 1", "(2, 2, 4, 5, 6)"]),
    ("bias heads", {}, dict(bias=(2, 3, 3, 5, 6)), ValueError, ["bias", "heads_q", "3, not 4 or 1"]),
    ("bias rank", {}, dict(bias=(1, 2, 3, 4, 5, 6)), ValueError, ["bias", "rank at most 5", "(1, 2, 3, 4, 5, 6)"]),
    ("mask keys", {}, dict(mask=(5, 7)), ValueError, ["mask", "seqlen_k", "7, not 6 or 1"]),
    ("slopes", {}, dict(alibi_slopes=(3, 4)), ValueError, ["alibi_slopes", "(heads_q,) = (4,)", "(2, 3, 4)", "(3, 4)"]),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_refusals(rng, case):
    _, shapes, modifiers, exc, words = case
    q, k, v, _ = make(rng, BATCH, 5, 6, 4, 2, 8)
    if "k" in shapes:
        k = np.zeros(shapes["k"] + k.shape[2:], F32)
    kw = {n: (np.ones(s, bool) if n == "mask" else np.ones(s, F32)) for n, s in modifiers.items()}
    with pytest.raises(exc) as e:
        flashcupy.attention(q, k, v, **kw)
    for word in words:
        assert word in str(e.value), (word, str(e.value))


def test_backward_refuses_an_lse_of_other_leading_dimensions(rng):
    q, k, v, dout = make(rng, BATCH, 5, 6, 4, 2, 8)
    out, lse = flashcupy.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match=r"lse must have shape \(\*batch, heads_q, seqlen_q\) = \(2, 3, 4, 5\)"):
        flashcupy.attention_backward(dout, q, k, v, out, lse[:, :2])
    with pytest.raises(ValueError, match="dout must have q's shape"):
        flashcupy.attention_backward(dout[:1], q, k, v, out, lse)


def test_folded_layouts_are_exactly_the_rank_4_calls(rng):
    """Contiguous leading dimensions: bit for bit the rank-4 call on the reshaped arrays."""
    q, k, v, dout = make(rng, BATCH, 5, 6, 4, 2, 8)
    bias = rng.standard_normal((1, 1, 4, 5, 6)).astype(F32)
    got = run(q, k, v, dout, bias=bias, causal=True)
    flat = [x.reshape((6,) + x.shape[2:]) for x in (q, k, v, dout)]
    want = run(*flat, bias=bias[0], causal=True)
    for a, b in itertools.zip_longest(got, want):
        np.testing.assert_array_equal(a.reshape(b.shape), b)
