"""v's head_dim unlike q's and k's (flash-attn #753, #914; MLA-style attention): out and dout take v's
head_dim, the scale stays 1/sqrt(q's head_dim), the FLOP count 2 (head_dim + head_dim_v) per pair.

The contract's rows (tests/contract.py, HEAD_DIM_V_CASES) run the plain and causal forward and backward
on both NumPy paths, the emulated cupy SIMT and tensor-core paths and Numba's simulator; here, against
the float64 oracle, what they do not:
each score modifier with its own code path in the NumPy backend (the narrow band, the modified
scores, dbias), leading batch dimensions, attention_vjp, empty inputs; and the refusals.
"""

import numpy as np
import pytest

import flashcupy
from conftest import assert_matches_oracle, make_qkv
from flashcupy import _checks
from flashcupy._problem import Band, attention_flops
from modifier_checks import modifier_cases

F32 = np.float32
SHAPE = (2, 11, 13, 4, 2, 16)  # (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim): GQA


def run(q, k, v, dout, **kw):
    out, lse = flashcupy.attention(q, k, v, return_lse=True, **kw)
    dlse = np.random.default_rng(7).standard_normal(lse.shape).astype(lse.dtype)
    return dlse, (out, lse, *flashcupy.attention_backward(dout, q, k, v, out, lse, dlse=dlse, **kw))


@pytest.mark.parametrize("head_dim_v", [8, 40])
@pytest.mark.parametrize("name", ["window", "causal-window", "softcap-causal", "alibi", "bias", "bias-B11S",
                                  "mask", "all", "all-causal"])
def test_each_modifier_with_its_own_value_head_dim(rng, name, head_dim_v):
    B, Sq, Sk, Hq, Hkv, D = SHAPE
    q, k, v = make_qkv(rng, B, Sq, Sk, Hq, Hkv, D, F32, head_dim_v=head_dim_v)
    dout = rng.standard_normal((B, Sq, Hq, head_dim_v)).astype(F32)
    kw = modifier_cases(rng, SHAPE, F32)[name]
    dlse, got = run(q, k, v, dout, backend="numpy", **kw)
    assert got[0].shape == (B, Sq, Hq, head_dim_v) and got[4].shape == v.shape
    assert_matches_oracle(got, q, k, v, dout, backend="numpy", dlse=dlse, **kw)


@pytest.mark.parametrize("head_dim, head_dim_v", [(48, 16), (16, 40)])
@pytest.mark.parametrize("causal", [False, True])
def test_the_narrow_band_path(rng, head_dim, head_dim_v, causal):
    """A window alone, a few keys wide, over more rows than a tile: band_forward and band_backward."""
    q, k, v = make_qkv(rng, 2, 200, 200, 4, 2, head_dim, F32, head_dim_v=head_dim_v)
    dout = rng.standard_normal(q.shape[:3] + (head_dim_v,)).astype(F32)
    kw = dict(window=(5, 3), causal=causal)
    from flashcupy.backends.numpy_backend import plan
    assert plan.narrow_band(_checks.problem(q, k, v, causal, None, None, "numpy", window=(5, 3))) is not None
    dlse, got = run(q, k, v, dout, **kw)
    assert_matches_oracle(got, q, k, v, dout, backend="numpy", dlse=dlse, **kw)


def test_leading_batch_dimensions_and_a_broadcast_bias(rng):
    q = rng.standard_normal((2, 3, 9, 2, 8)).astype(F32)
    k = rng.standard_normal((2, 3, 10, 1, 8)).astype(F32)
    v = rng.standard_normal((2, 3, 10, 1, 24)).astype(F32)
    dout = rng.standard_normal((2, 3, 9, 2, 24)).astype(F32)
    bias = rng.standard_normal((3, 1, 9, 10)).astype(F32)
    dlse, got = run(q, k, v, dout, bias=bias, causal=True)
    assert got[0].shape == (2, 3, 9, 2, 24) and got[5].shape == bias.shape
    assert_matches_oracle(got, q, k, v, dout, backend="numpy", dlse=dlse, bias=bias, causal=True)


def test_attention_vjp(rng):
    q, k, v = make_qkv(rng, 1, 6, 9, 2, 2, 8, np.float64, head_dim_v=3)
    dout = rng.standard_normal((1, 6, 2, 3))
    out, vjp = flashcupy.attention_vjp(q, k, v)
    _, lse = flashcupy.attention(q, k, v, return_lse=True)
    assert_matches_oracle((out, lse, *vjp(dout)), q, k, v, dout, backend="numpy")


@pytest.mark.parametrize("shape", [(0, 5, 7, 2, 1), (1, 0, 7, 2, 1), (1, 5, 0, 2, 1), (2, 3, 0, 5, 7, 2, 1)])
def test_empty_inputs_give_results_of_v_s_head_dim(shape):
    *batch, Sq, Sk, Hq, Hkv = shape
    q = np.ones((*batch, Sq, Hq, 4), F32)
    k = np.ones((*batch, Sk, Hkv, 4), F32)
    v = np.ones((*batch, Sk, Hkv, 6), F32)
    out, lse = flashcupy.attention(q, k, v, return_lse=True)
    assert out.shape == (*batch, Sq, Hq, 6) and np.all(out == 0) and np.all(np.isneginf(lse))
    dq, dk, dv = flashcupy.attention_backward(np.ones(out.shape, F32), q, k, v, out, lse)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert not (dq.any() or dk.any() or dv.any())


def test_the_scale_and_the_flop_count_follow_q_s_head_dim(rng):
    q, k, v = make_qkv(rng, 1, 4, 4, 1, 1, 16, np.float64, head_dim_v=4)
    p = _checks.problem(q, k, v, False, None, None, "numpy")
    assert (p.head_dim, p.head_dim_v, p.out_shape) == (16, 4, (1, 4, 1, 4))
    assert p.scale == 1 / 4  # 1/sqrt(16), q's head_dim
    assert p.flops() == 2 * (16 + 4) * 16  # 2 D + 2 Dv per pair, 16 pairs
    assert attention_flops(1, 1, 16, Band.of(4, 4), windowed=False) == 4 * 16 * 16


def test_bad_shapes_are_refused(rng):
    q, k, v = make_qkv(rng, 1, 4, 5, 2, 1, 8, F32, head_dim_v=6)
    with pytest.raises(ValueError, match=r"k and v must have the same \(batch, seqlen_k, heads_kv\)"):
        flashcupy.attention(q, k, v[:, :4])
    with pytest.raises(ValueError, match="k must have q's head_dim 8, got 6"):
        flashcupy.attention(q, v, v)
    with pytest.raises(ValueError, match="head_dim must be at least 1"):
        flashcupy.attention(q, k, v[..., :0])
    out, lse = flashcupy.attention(q, k, v, return_lse=True)
    wrong = np.ones(q.shape, F32)  # q's shape, not out's
    for name, dout, o in (("dout", wrong, out), ("out", np.ones(out.shape, F32), wrong)):
        with pytest.raises(ValueError, match=fr"{name} must have q's shape with v's head_dim \(1, 4, 2, 6\)"):
            flashcupy.attention_backward(dout, q, k, v, o, lse)


# ----------------------------------------------------------------------------
# cupy, on the CPU emulator: the SIMT and mma.sync kernels pad their tiles to the larger head dim; the
# Hopper kernels assume one, so such calls run on the mma.sync kernels on an sm_90 too


@pytest.mark.parametrize("compute_capability", [80, 90])
def test_cupy_tensor_core_forward_and_backward(rng, compute_capability):
    """float16 at head dims the tensor-core and Hopper kernels take (64 for q and k, 32 for v), on an
    sm_80 and an sm_90 device: the mma.sync forward and backward (the Hopper ones on the sm_90; their
    tiles padded to the larger head dim, as the SIMT kernels'), dQ by atomics (Hopper: bulk reduce-adds)
    and deterministic, with a bias (dbias from flash_pairs.cu) and a mask; split-KV's mma.sync forward
    too."""
    from flashcupy import _api
    from flashcupy.backends import cupy_backend
    from flashcupy.tools.emulator.cupy import emulated
    q, k, v = make_qkv(rng, 1, 20, 33, 2, 1, 64, np.float16, head_dim_v=32)
    dout = rng.standard_normal((1, 20, 2, 32)).astype(np.float16)
    kw = dict(bias=rng.standard_normal((1, 2, 20, 33)).astype(np.float16), mask=rng.random((1, 1, 20, 33)) < 0.8,
              causal=True)
    with emulated(compute_capability=compute_capability):
        p = _checks.problem(q, k, v, True, None, None, "numpy")
        path = "hopper" if compute_capability == 90 else "tensor-core"
        assert cupy_backend.forward_path(p, q, k, v) == path
        assert cupy_backend.backward_path(p, dout, q, k, v, dout) == path
        dlse, got = run(q, k, v, dout, backend="cupy", **kw)
        assert_matches_oracle(got, q, k, v, dout, backend="cupy", dlse=dlse, **kw)
        exact = flashcupy.attention_backward(dout, q, k, v, got[0], got[1], backend="cupy", deterministic=True, **kw)
        assert_matches_oracle((*got[:2], *exact), q, k, v, dout, backend="cupy", **kw)
        # split-KV (decoding): each split's partial out of v's width, merged
        q1, k, v = make_qkv(rng, 1, 1, 300, 2, 1, 64, np.float16, head_dim_v=32)
        p = _checks.problem(q1, k, v, False, None, None, "numpy")
        assert cupy_backend.forward_path(p, q1, k, v, split=True) == "tensor-core"
        assert cupy_backend.split_plan(p, q1, k, v, 2)[0] == 2
        out, lse = _api.forward(q1, k, v, backend="cupy", num_splits=2)
    assert_matches_oracle((out, lse), q1, k, v, backend="cupy")


@pytest.mark.parametrize("head_dim, head_dim_v", [(192, 128), (64, 128), (128, 64)])
def test_the_hopper_kernels(rng, head_dim, head_dim_v):
    """The Hopper forward and backward (flash_fwd_sm90.cu, flash_bwd_sm90.cu) with v of its own head dim,
    their tiles at the larger: MLA's 192 and 128 (the backward's SPLIT_D kernel, V_j's and dO_i's third
    atom zeroed, not loaded), 64 and 128 (Q_i's and K_j's second atom zero), 128 and 64; one batch (out
    by TMA store) with GQA, causal rows that see no key and ALiBi, dQ by bulk reduce-adds and
    deterministic, and a packed batch (out row by row), each against the oracle."""
    from flashcupy.backends import cupy_backend
    from flashcupy.tools.emulator.cupy import emulated, launch_records
    from varlen_checks import packed_batch_matches_the_oracle
    q, k, v = make_qkv(rng, 2, 70, 50, 2, 1, head_dim, np.float16, head_dim_v=head_dim_v)
    dout = rng.standard_normal((2, 70, 2, head_dim_v)).astype(np.float16)
    kw = dict(causal=True, alibi_slopes=np.array([0.5, 0.25], np.float32))
    launches = []
    with emulated(compute_capability=90, compile=launch_records(launches)):
        p = _checks.problem(q, k, v, True, None, None, "numpy")
        assert cupy_backend.forward_path(p, q, k, v) == "hopper"
        assert cupy_backend.backward_path(p, dout, q, k, v, dout) == "hopper"
        dlse, got = run(q, k, v, dout, backend="cupy", **kw)
        exact = flashcupy.attention_backward(dout, q, k, v, got[0], got[1], backend="cupy", deterministic=True, **kw)
        packed_batch_matches_the_oracle(rng, "cupy", lengths=([70, 0, 9], [30, 4, 80]), dtype=np.float16,
                                        head_dim=head_dim, head_dim_v=head_dim_v, backward=True)
    assert_matches_oracle(got, q, k, v, dout, backend="cupy", dlse=dlse, **kw)
    assert_matches_oracle((*got[:2], *exact), q, k, v, dout, backend="cupy", **kw)
    kernels = {name.split("<")[0] for name, _ in launches}
    assert {"flash_fwd_sm90", "flash_bwd_dkdv_sm90"} <= kernels and not {"flash_fwd_tc", "flash_bwd_dkdv_tc"} & kernels


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("head_dim, head_dim_v", [(192, 128), (64, 256)])
def test_cupy_tensor_core_backward_in_column_parts(rng, head_dim, head_dim_v, deterministic):
    """Above a tile head dim of 128 two CTAs share each block's columns of dK, dV and dQ (flash_bwd_tc.cu,
    TC_COLUMN_PARTS): MLA's 192 and 128 (v's second part partly past its head dim), and 64 and 256 (q's
    and k's second part wholly past theirs: it writes no dK or dQ, nor adds to dQ's atomics), with GQA
    and causal rows that see no key."""
    from flashcupy.backends import cupy_backend
    from flashcupy.tools.emulator.cupy import emulated
    q, k, v = make_qkv(rng, 1, 21, 17, 2, 1, head_dim, np.float16, head_dim_v=head_dim_v)
    dout = rng.standard_normal((1, 21, 2, head_dim_v)).astype(np.float16)
    with emulated(compute_capability=80):
        p = _checks.problem(q, k, v, True, None, None, "numpy")
        assert cupy_backend.backward_path(p, dout, q, k, v, dout, deterministic) == "tensor-core"
        out, lse = flashcupy.attention(q, k, v, causal=True, backend="cupy", return_lse=True)
        grads = flashcupy.attention_backward(dout, q, k, v, out, lse, causal=True, backend="cupy",
                                             deterministic=deterministic)
    assert np.all(grads[0][:, :4] == 0)  # rows that see no key
    assert_matches_oracle((out, lse, *grads), q, k, v, dout, causal=True, backend="cupy")


def test_cupy_head_dims_not_multiples_of_8_stay_on_the_simt_kernels(rng):
    """The mma.sync kernels read rows 16 bytes at a time: v's head_dim 12 keeps the forward on SIMT."""
    from flashcupy.backends import cupy_backend
    from flashcupy.tools.emulator.cupy import emulated
    q, k, v = make_qkv(rng, 1, 9, 9, 2, 2, 16, np.float16, head_dim_v=12)
    with emulated(compute_capability=80):
        assert cupy_backend.forward_path(_checks.problem(q, k, v, False, None, None, "numpy"), q, k, v) == "simt"
        out, lse = flashcupy.attention(q, k, v, backend="cupy", return_lse=True)
    assert_matches_oracle((out, lse), q, k, v, backend="cupy")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cupy_split_kv(rng, dtype):
    """Split-KV's partial outs of v's head dim, merged (flash_merge.cu)."""
    from flashcupy import _api
    from flashcupy.tools.emulator.cupy import emulated
    q, k, v = make_qkv(rng, 2, 3, 300, 4, 2, 16, dtype, head_dim_v=40)
    with emulated():
        out, lse = _api.forward(q, k, v, backend="cupy", num_splits=3)
    assert_matches_oracle((out, lse), q, k, v, backend="cupy")


@pytest.mark.parametrize("backend, dtype", [("numpy", np.float32), ("cupy", np.float32), ("cupy", np.float16)])
def test_a_packed_batch(rng, backend, dtype):
    """attention_varlen and its backward, on cupy one launch over the packed batch (float16: the
    mma.sync forward's packed kernel)."""
    import contextlib

    from flashcupy.tools.emulator.cupy import emulated
    from varlen_checks import packed_batch_matches_the_oracle
    with emulated() if backend == "cupy" else contextlib.nullcontext():
        packed_batch_matches_the_oracle(rng, backend, lengths=([3, 0, 9], [7, 4, 2]), dtype=dtype, head_dim=8,
                                        head_dim_v=24, backward=True)


@pytest.mark.parametrize("shared", [False, True], ids=["own-v", "v-a-view-of-k"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("backend, dtype", [("numpy", F32), ("cupy", F32), ("cupy", np.float16)])
def test_a_kv_cache(rng, backend, dtype, paged, shared):
    """attention_with_kvcache with v of its own head dim (varlen_checks.kv_cache_with_its_own_value_head_dim;
    Numba's in test_numba_backend.py's VARLEN_CHECKS). On cupy: the append (flash_kv_append, a thread an
    element of the wider of k and v), then one attention launch over the cache (float16 on the mma.sync
    kernels) split in two, and the merge of the splits."""
    import contextlib

    from flashcupy.tools.emulator.cupy import emulated, launch_records
    from varlen_checks import kv_cache_with_its_own_value_head_dim
    launches = []
    with emulated(compile=launch_records(launches)) if backend == "cupy" else contextlib.nullcontext():
        kv_cache_with_its_own_value_head_dim(rng, backend, dtype, paged, shared)
    if backend == "cupy":
        want = ["flash_kv_append", "flash_fwd_tc" if dtype == np.float16 else "flash_fwd", "flash_split_merge"]
        assert [name.split("<")[0] for name, _ in launches] == want


def test_a_kv_cache_refuses_caches_and_new_tokens_that_disagree(rng):
    q = np.ones((1, 1, 2, 8), F32)
    with pytest.raises(ValueError, match=r"k_cache and v_cache must have the same shape but for the last dimension "
                                         r"\(head_dim, head_dim_v\), got \(1, 5, 1, 8\) and \(1, 5, 2, 4\)"):
        flashcupy.attention_with_kvcache(q, np.ones((1, 5, 1, 8), F32), np.ones((1, 5, 2, 4), F32))
    k_cache, v_cache = np.zeros((1, 5, 1, 8), F32), np.zeros((1, 5, 1, 4), F32)
    with pytest.raises(ValueError, match=r"v must have shape \(batch, seqlen_new, heads_kv, head_dim_v\) = "
                                         r"\(1, 2, 1, 4\), got \(1, 2, 1, 8\)"):
        flashcupy.attention_with_kvcache(q, k_cache, v_cache, k=np.ones((1, 2, 1, 8), F32),
                                         v=np.ones((1, 2, 1, 8), F32), cache_seqlens=0)
    assert not k_cache.any() and not v_cache.any()  # refused before anything was written


def test_a_backend_without_it_refuses(rng, monkeypatch):
    """Every backend declares HEAD_DIM_V today; one that did not would refuse the call, naming those that
    take it, before any work."""
    from flashcupy.backends import numpy_backend
    q, k, v = make_qkv(rng, 1, 4, 5, 2, 1, 8, F32, head_dim_v=6)
    monkeypatch.setattr(numpy_backend, "HEAD_DIM_V", False)
    with pytest.raises(ValueError, match=r"v's head_dim 6, unlike q's and k's 8, is not yet supported by backend "
                                         r"'numpy' \(backend 'cupy' or 'numba' supports it\)"):
        flashcupy.attention(q, k, v, backend="numpy")
