"""The NumPy tiled backend against the float64 oracle: what is its own (layouts, huge values,
narrow bands, tile plans, threads, buffers, deliberate bugs); the shared battery over every dtype
and shape is tests/test_contract_numpy.py's."""

import itertools
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flashcupy
from conftest import (BANDS, BF16, DTYPES, LAYOUTS, assert_matches_oracle, band_problem, battery_fails, expected,
                      make_qkv, mutate_band, mutated_package, reference)
from flashcupy._problem import Problem
from flashcupy.backends import numpy_backend
from modifier_checks import LARGE_SCALES, large_scores_check
from reference.compare import error_ratio


def check_against_oracle(q, k, v, dtype, causal, scale=None, rng=None):
    """Forward and backward of the NumPy backend: dtypes, shapes, and every output against the oracle."""
    dout = rng.standard_normal(q.shape).astype(dtype)
    kw = dict(causal=causal, scale=scale, backend="numpy")
    out, lse = flashcupy.attention(q, k, v, return_lse=True, **kw)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == (np.float64 if dtype == np.float64 else np.float32)
    grads = flashcupy.attention_backward(dout, q, k, v, out, lse, **kw)
    for g, x in zip(grads, (q, k, v)):
        assert g.dtype == x.dtype and g.shape == x.shape
    assert_matches_oracle((out, lse, *grads), q, k, v, dout, causal=causal, scale=scale, backend="numpy")


@pytest.fixture(params=["copied", "in-place"])
def kv_path(request, monkeypatch):
    """Both ways the forward reads K and V: copied into BLAS-friendly Kᵀ and [V | 1] with the lazy
    softmax, or (few query rows, float32/float64) read where they lie with the eager one."""
    monkeypatch.setattr(numpy_backend.plan, "IN_PLACE_ROWS", 0 if request.param == "copied" else 10**9)
    return request.param


@pytest.mark.parametrize("layout", LAYOUTS)
def test_strided_views_are_used_as_they_are(rng, small_tiles, layout):
    q, k, v = make_qkv(rng, 2, 19, 23, 4, 2, 24, np.float32, layout=layout)
    check_against_oracle(q, k, v, np.float32, True, rng=rng)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_default_tiles(rng, dtype):
    # the tiles tile_sizes chooses: two query blocks and three key blocks, the last partial and
    # crossed by the causal diagonal, which both passes cut into a staircase
    assert (numpy_backend.config.BLOCK_M, numpy_backend.config.BLOCK_N) == (None, None)

    def problem(Sq, Sk):
        return Problem(batch=1, seqlen_q=Sq, seqlen_k=Sk, heads_q=2, heads_kv=1, head_dim=32,
                       dtype=np.dtype(dtype).name, causal=True, scale=1.0, carrier=np.dtype(dtype))

    block_m, block_n = numpy_backend.tile_sizes(problem(4096, 1))
    assert numpy_backend.tile_sizes(problem(1, 1))[1] > block_n  # decoding: long key tiles
    if dtype == np.float32:  # what `python -m flashcupy info` says is what tile_sizes chooses
        assert numpy_backend.describe_tiles().startswith(f"{block_m}x{block_n},")
    Sq, Sk = block_m + block_m // 2 + 3, 2 * block_n + 300
    assert numpy_backend.tile_sizes(problem(Sq, Sk), backward=True) == (block_m, block_n)
    assert any(r1 - r0 < block_m for r0, r1, *_ in numpy_backend.tiling.forward_tiles(problem(Sq, Sk), 0, block_m, step=32))
    q, k, v = make_qkv(rng, 1, Sq, Sk, 2, 1, 32, dtype)
    check_against_oracle(q, k, v, dtype, True, rng=rng)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_huge_scale_neither_overflows_nor_gives_nan(rng, small_tiles, dtype):
    # scores of several hundred: exp() of them overflows even float64 without the running max
    q, k, v = make_qkv(rng, 1, 33, 40, 2, 2, 16, dtype, magnitude=0.5)
    out, lse = flashcupy.attention(q, k, v, scale=1e3, return_lse=True)
    dout = np.ones_like(out)
    grads = flashcupy.attention_backward(dout, q, k, v, out, lse, scale=1e3)
    # in float16 the rounding of the stored out reaches dq and dk through D = rowsum(dO∘O), times
    # the scale: the tolerance models it, so the gradients are checked in every dtype
    assert_matches_oracle((out, lse, *grads), q, k, v, dout, scale=1e3, backend="numpy")


@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["scores-far-above-0", "scores-far-below-0"])
def test_scores_far_from_zero_keep_full_precision(rng, kv_path, sign):
    # every score near +-400: exp() of them over- or underflows unless the reference m follows them
    q = np.ones((1, 40, 1, 16), np.float32)
    k = (sign * 10 + rng.standard_normal((1, 50, 1, 16))).astype(np.float32)
    v = rng.standard_normal((1, 50, 1, 16)).astype(np.float32)
    out, lse = flashcupy.attention(q, k, v, scale=2.5, return_lse=True)
    assert_matches_oracle((out, lse), q, k, v, scale=2.5, backend="numpy")


def test_fully_masked_rows_give_zero_output_and_gradients(rng, small_tiles, kv_path):
    q, k, v = make_qkv(rng, 1, 40, 9, 2, 1, 8, np.float32)
    out, lse = flashcupy.attention(q, k, v, causal=True, return_lse=True)
    assert np.all(out[:, :31] == 0) and np.all(np.isneginf(lse[:, :, :31]))
    dout = rng.standard_normal(q.shape).astype(np.float32)
    dq, dk, dv = flashcupy.attention_backward(dout, q, k, v, out, lse, causal=True)
    assert np.all(dq[:, :31] == 0)
    assert_matches_oracle((out, lse, dq, dk, dv), q, k, v, dout, causal=True, backend="numpy")
    # masked rows contribute nothing to dk, dv: the same bits with those rows' dout zeroed
    dout[:, :31] = 0
    _, dk0, dv0 = flashcupy.attention_backward(dout, q, k, v, out, lse, causal=True)
    np.testing.assert_array_equal(dk, dk0)
    np.testing.assert_array_equal(dv, dv0)


def test_nan_in_a_query_row_stays_in_that_row(rng, small_tiles, kv_path):
    q, k, v = make_qkv(rng, 1, 20, 20, 1, 1, 8, np.float32)
    q[0, 5, 0, 3] = np.nan
    out, lse = flashcupy.attention(q, k, v, return_lse=True)
    want = reference.attention(q, k, v)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(want))
    assert np.isnan(out[0, 5]).all() and np.isnan(lse[0, 0, 5])
    assert not np.isnan(np.delete(out, 5, axis=1)).any()


# (causal, window): every shape of band the helpers must state, windows included
@pytest.mark.parametrize("causal, window", BANDS)
def test_visibility_helpers_are_the_oracles_rule(causal, window):
    """On every tile of every small shape: tiling.mask_scores hides exactly what the oracle hides, and a
    block's range holds exactly the keys (queries) that some row (key) of the block sees, so the
    loops skip no visible pair and visit no block that sees nothing."""
    for Sq, Sk in itertools.product(range(1, 7), repeat=2):
        p = band_problem(Sq, Sk, causal, window)
        want = reference.visible(Sq, Sk, causal, window=window)
        for i0, i1 in itertools.combinations(range(Sq + 1), 2):
            assert list(range(*p.band.key_range(i0, i1))) == list(np.flatnonzero(want[i0:i1].any(0)))
            for j0, j1 in itertools.combinations(range(Sk + 1), 2):
                S = np.zeros((i1 - i0, j1 - j0))
                numpy_backend.tiling.mask_scores(S, p, i0, j0, -np.inf)
                np.testing.assert_array_equal(S == 0, want[i0:i1, j0:j1])
        for j0, j1 in itertools.combinations(range(Sk + 1), 2):
            assert list(range(*p.band.query_range(j0, j1))) == list(np.flatnonzero(want[:, j0:j1].any(1)))
            assert list(range(*p.band.queries_seeing_all(j0, j1))) == list(np.flatnonzero(want[:, j0:j1].all(1)))
        for i0, i1 in itertools.combinations(range(Sq + 1), 2):
            assert list(range(*p.band.keys_seen_by_all(i0, i1))) == list(np.flatnonzero(want[i0:i1].all(0)))


@pytest.mark.parametrize("causal, window", BANDS)
@pytest.mark.parametrize("step, block", [(1, 1), (2, 3), (3, 8), (4, 5), (8, 16)])
def test_tiles_cover_every_visible_pair_once(causal, window, step, block):
    """tiling.forward_tiles over all query blocks, and tiling.backward_tiles over all key blocks, each cover
    every (query, key) pair the oracle shows visible exactly once, after their masks, and no tile
    is wholly masked (work that buys nothing)."""
    old = (numpy_backend.config.BLOCK_M, numpy_backend.config.BLOCK_N)
    numpy_backend.configure(block_m=block, block_n=block)
    try:
        for Sq, Sk in itertools.product([1, 2, 5, 9, 17], repeat=2):
            p = band_problem(Sq, Sk, causal, window)
            want = reference.visible(Sq, Sk, causal, window=window)
            for tiles in ([t for i0, i1 in numpy_backend.tiling.blocks(0, Sq, block)
                           for t in numpy_backend.tiling.forward_tiles(p, i0, i1, step)],
                          [t for j0, j1 in numpy_backend.tiling.blocks(0, Sk, block)
                           for t in numpy_backend.tiling.backward_tiles(p, j0, j1, step)]):
                covered = np.zeros((Sq, Sk), int)
                for i0, i1, j0, j1, hidden in tiles:
                    seen = np.ones((i1 - i0, j1 - j0), bool) if hidden is None else ~hidden
                    assert seen.any()
                    covered[i0:i1, j0:j1] += seen
                np.testing.assert_array_equal(covered, want.astype(int))
    finally:
        numpy_backend.config.BLOCK_M, numpy_backend.config.BLOCK_N = old


def test_backward_is_bitwise_reproducible(rng):
    q, k, v = make_qkv(rng, 1, 300, 1100, 4, 2, 32, np.float32)
    out, vjp = flashcupy.attention_vjp(q, k, v, causal=True)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    first = vjp(dout)
    for again in (vjp(dout), vjp(dout)):
        for a, b in zip(first, again):
            np.testing.assert_array_equal(a, b)



@pytest.mark.parametrize("dtype", DTYPES + (BF16,), ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("Sq, Sk, Hq, Hkv, causal, window", [
    (300, 300, 2, 2, True, (40, None)),  # a causal window: several tiles per block, blocks per call
    # a middle block whose keys all lie inside the sequence: K and V read where they lie (float32,
    # float64), O / l straight into out where a tile's rows are evenly spaced rows of it (one kv head)
    (1100, 1100, 4, 2, True, (40, None)),
    (1100, 1060, 2, 1, False, (20, 5)),
    (257, 700, 4, 2, False, (70, 9)),  # GQA, Sk > Sq: the first rows see keys from the middle on
    (700, 90, 3, 1, True, (17, None)),  # Sq > Sk: rows before the keys see none
    (130, 160, 2, 1, False, (0, 0)),  # one key a row
])
def test_narrow_bands_match_the_oracle(rng, dtype, Sq, Sk, Hq, Hkv, causal, window):
    """A window alone takes band_forward and band_backward (tiles that hold all their rows' keys,
    computed many per matmul); default tiles, so that blocks hold many tiles and tasks many chunks."""
    q, k, v = make_qkv(rng, 2, Sq, Sk, Hq, Hkv, 24, dtype)
    dout = rng.standard_normal(q.shape).astype(dtype)
    kw = dict(causal=causal, window=window)
    out, lse = flashcupy.attention(q, k, v, return_lse=True, **kw)
    grads = flashcupy.attention_backward(dout, q, k, v, out, lse, **kw)
    assert_matches_oracle((out, lse, *grads), q, k, v, dout, backend="numpy", **kw)


def _narrow_band_redone_at_the_ends(rng, monkeypatch):
    """Scores far below zero (q around +30, k around -30) leave every row's sum below L_MIN, so every
    row of the band forward is redone with its own max as the reference; the first and last tiles reach
    past the sequence's ends (their copies of K and V hold zeros there, scores of 0), and the redo
    must admit only the keys that exist. The spy proves the band path and its redo ran at both ends."""
    backend = sys.modules[numpy_backend.__name__]  # a mutant's copy, where a test put one there
    S, H, D, window = 64, 2, 8, (2, 3)
    q = (30 + rng.standard_normal((1, S, H, D))).astype(np.float32)
    k = (-30 + rng.standard_normal((1, S, H, D))).astype(np.float32)
    v, dout = (rng.standard_normal((1, S, H, D)).astype(np.float32) for _ in range(2))
    redone = []  # (first key, keys) of each tile a redo asked about
    real = backend.band_forward.band_visible

    def spy(p, i0, j0, rows, keys, end):
        redone.append((j0, keys))
        return real(p, i0, j0, rows, keys, end)

    monkeypatch.setattr(backend.band_forward, "band_visible", spy)
    out, lse = flashcupy.attention(q, k, v, window=window, return_lse=True)
    assert any(j0 < 0 for j0, _ in redone) and any(j0 + n > S for j0, n in redone), redone
    grads = flashcupy.attention_backward(dout, q, k, v, out, lse, window=window)
    assert_matches_oracle((out, lse, *grads), q, k, v, dout, window=window, backend="numpy")


def test_narrow_band_rows_redone_at_the_sequence_ends_see_only_their_keys(rng, monkeypatch):
    _narrow_band_redone_at_the_ends(rng, monkeypatch)


# deliberate bugs in the narrow band's redo, each caught by the test above
NARROW_BAND_MUTATIONS = {
    "redo admits keys past the end": ("j) & (j >= 0) & (j < end)", "j) & (j >= 0)"),
    "redo admits keys before the start": ("j) & (j >= 0) & (j < end)", "j) & (j < end)"),
}


@pytest.mark.parametrize("name", NARROW_BAND_MUTATIONS)
def test_a_narrow_band_redo_bug_is_caught(rng, monkeypatch, name):
    monkeypatch.setitem(sys.modules, numpy_backend.__name__,
                        mutated_package(numpy_backend, *NARROW_BAND_MUTATIONS[name]))
    with pytest.raises(AssertionError, match="times the tolerance"):  # the oracle's check, not the spy's
        _narrow_band_redone_at_the_ends(rng, monkeypatch)


def test_narrow_band_backward_is_bitwise_reproducible(rng):
    q, k, v = make_qkv(rng, 1, 2000, 2000, 4, 2, 32, np.float32)
    out, vjp = flashcupy.attention_vjp(q, k, v, causal=True, window=(100, None))
    dout = rng.standard_normal(q.shape).astype(np.float32)
    first = vjp(dout)
    for again in (vjp(dout), vjp(dout)):
        for a, b in zip(first, again):
            np.testing.assert_array_equal(a, b)


def test_no_score_sized_allocation():
    """Peak traced memory of the forward stays far below one Sq x Sk float32 matrix."""
    S, D = 4096, 16
    q = np.ones((1, S, 1, D), np.float32)
    score_bytes = S * S * 4
    tracemalloc.start()
    tracemalloc.reset_peak()
    flashcupy.attention(q, q, q, causal=True)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 0.25 * score_bytes, f"peak {peak} bytes vs score matrix {score_bytes}"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    B=st.integers(1, 2), Sq=st.integers(1, 40), Sk=st.integers(1, 40),
    Hkv=st.integers(1, 2), group=st.integers(1, 3),
    D=st.sampled_from([1, 3, 40, 72, 100]), causal=st.booleans(),
    dtype=st.sampled_from(DTYPES), layout=st.sampled_from(LAYOUTS),
    block_m=st.sampled_from([1, 7, 16, 64]), block_n=st.sampled_from([1, 5, 16, 64]),
    seed=st.integers(0, 2**16),
)
def test_property_matches_oracle(B, Sq, Sk, Hkv, group, D, causal, dtype, layout, block_m, block_n, seed):
    old = (numpy_backend.config.BLOCK_M, numpy_backend.config.BLOCK_N)
    numpy_backend.configure(block_m=block_m, block_n=block_n)
    try:
        rng = np.random.default_rng(seed)
        q, k, v = make_qkv(rng, B, Sq, Sk, Hkv * group, Hkv, D, dtype, layout=layout)
        check_against_oracle(q, k, v, dtype, causal, rng=rng)
    finally:
        numpy_backend.config.BLOCK_M, numpy_backend.config.BLOCK_N = old


@pytest.mark.parametrize("dtype, v_value, k_value", [(np.float32, 1e30, 5.0), (np.float64, 1e300, 10.0)],
                         ids=["float32", "float64"])
def test_huge_values_do_not_overflow_the_output_accumulator(kv_path, dtype, v_value, k_value):
    # scores of 4 k_value: the lazily rescaled P reaches e^(4 k_value) and P V_j overflowed before,
    # though the answer, v_value itself, fits
    q = np.ones((1, 1, 1, 4), dtype)
    k = np.full((1, 3, 1, 4), k_value, dtype)
    v = np.full((1, 3, 1, 4), v_value, dtype)
    out, lse = flashcupy.attention(q, k, v, scale=1.0, return_lse=True)
    np.testing.assert_allclose(out, v_value, rtol=1e-6)
    assert_matches_oracle((out, lse), q, k, v, scale=1.0, backend="numpy")


def test_calls_from_many_threads_give_the_serial_bits_and_leave_blas_alone(rng):
    from threadpoolctl import threadpool_info
    inputs = [make_qkv(rng, 1, 700, 1500, 2, 1, 32, np.float32) for _ in range(8)]
    serial = [flashcupy.attention(*x, causal=True) for x in inputs]
    before = [(i["internal_api"], i["num_threads"]) for i in threadpool_info()]
    barrier = threading.Barrier(len(inputs))

    def call(x):
        barrier.wait()  # all at once
        return flashcupy.attention(*x, causal=True)

    with ThreadPoolExecutor(len(inputs)) as pool:
        parallel = list(pool.map(call, inputs))
    for a, b in zip(serial, parallel):
        np.testing.assert_array_equal(a, b)
    assert [(i["internal_api"], i["num_threads"]) for i in threadpool_info()] == before


@pytest.mark.parametrize("threads", [1, 2])
def test_buffers_kept_between_calls_carry_nothing_over_and_stay_small(rng, monkeypatch, threads):
    """Scratch buffers outlive their call (pool.Scratch): a call on other data between two on the same
    data changes no bit of the second; a call whose first rows see no key, after one whose rows all
    did, gives those rows 0 (their [O | l] is never written, and on one thread it lies where the
    earlier call's was); and after a call no kept buffer is larger than SCRATCH_KEEP_BYTES."""
    monkeypatch.setattr(numpy_backend.config, "NUM_THREADS", threads)
    shape = (1, 700, 1500, 4, 2, 32, np.float32)
    a, b = make_qkv(rng, *shape), make_qkv(rng, *shape)

    def run(x, dout):
        out, lse = flashcupy.attention(*x, causal=True, return_lse=True)
        got = out, lse, *flashcupy.attention_backward(dout, *x, out, lse, causal=True)
        assert_matches_oracle(got, *x, dout, causal=True, backend="numpy")
        return got

    dout = rng.standard_normal(a[0].shape).astype(np.float32)
    first = run(a, dout)
    run(b, dout)
    for x, y in zip(first, run(a, dout)):
        np.testing.assert_array_equal(x, y)
    c = make_qkv(rng, 1, 700, 300, 4, 2, 32, np.float32)  # rows 0..399 see no key
    run(c, rng.standard_normal(c[0].shape).astype(np.float32))
    # calls of other shapes reuse the same few names (no buffer kept for every name ever used):
    # the backward's per-partition dQ is one a worker at most (from here on: earlier tests in this
    # process may have run with more workers)
    numpy_backend.pool.call_scratch._buffers.clear()
    for S in (300, 450, 1100, 1600):  # shapes whose partitions start at other items
        x = make_qkv(rng, 1, S, S, 4, 2, 32, np.float32)
        out, lse = flashcupy.attention(*x, causal=True, return_lse=True)
        flashcupy.attention_backward(out, *x, out, lse, causal=True)
    numbered = {n for s in (numpy_backend.pool.call_scratch, *numpy_backend.pool.scratches) for n in s._buffers
                if isinstance(n, tuple)}
    assert numbered <= {("dQ", i) for i in range(threads)}
    monkeypatch.setattr(numpy_backend.pool, "SCRATCH_KEEP_BYTES", 4096)
    run(a, dout)
    kept = [buf.nbytes for s in (numpy_backend.pool.call_scratch, *numpy_backend.pool.scratches) for buf in s._buffers.values()]
    assert max(kept, default=0) <= 4096


@pytest.mark.parametrize("value", ["abc", "2.5", "-3", "0"])
def test_a_bad_thread_count_in_the_environment_is_named(monkeypatch, value):
    monkeypatch.setenv("FLASHCUPY_NUM_THREADS", value)
    monkeypatch.setattr(numpy_backend.config, "NUM_THREADS", None)
    with pytest.raises(ValueError, match=f"FLASHCUPY_NUM_THREADS must be a positive whole number .*'{value}'"):
        flashcupy.attention(*make_qkv(np.random.default_rng(0), 1, 4, 4, 1, 1, 8, np.float32))


def test_nan_in_dout_of_a_row_that_sees_no_key_goes_nowhere(rng, small_tiles):
    q, k, v = make_qkv(rng, 1, 30, 9, 2, 1, 8, np.float32)  # causal: rows 0..20 see no key
    out, lse = flashcupy.attention(q, k, v, causal=True, return_lse=True)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    dout[:, :21] = np.nan
    grads = flashcupy.attention_backward(dout, q, k, v, out, lse, causal=True)
    assert not np.isnan(grads[0]).any() and np.all(grads[0][:, :21] == 0)
    assert_matches_oracle((out, lse, *grads), q, k, v, dout, causal=True, backend="numpy")


NUMPY_MUTATIONS = {  # see conftest.MUTATION_BATTERY
    "scale ignored": ("return p.acc_dtype.type(p.scale * LOG2E)", "return p.acc_dtype.type(LOG2E / np.sqrt(p.head_dim))"),
    "GQA head mapping": ("kv_head = h // p.group", "kv_head = h % p.heads_kv"),
    "D not subtracted": ('np.negative(np.einsum("hsgd', 'np.multiply(0, np.einsum("hsgd'),
    "lse base": ("m * acc.type(LN2) + np.log(l)", "m * acc.type(LN2) + np.log2(l)"),
}


def test_the_mutation_battery_passes_unmutated():
    assert not battery_fails("numpy")


# Deliberate bugs in the band rule (flashcupy/_problem.py, Band), which the NumPy backend's tile
# plans ask.
BAND_MUTATIONS = {
    "key_end off by one": ("min(self.seqlen_k, i1 + self.diagonal + self.right))",
                           "min(self.seqlen_k, i1 + self.diagonal + self.right - 1))"),
}


@pytest.mark.parametrize("name", NUMPY_MUTATIONS)
def test_a_mutation_is_caught(monkeypatch, name):
    monkeypatch.setitem(sys.modules, numpy_backend.__name__, mutated_package(numpy_backend, *NUMPY_MUTATIONS[name]))
    assert battery_fails("numpy"), f"the battery missed: {name}"


@pytest.mark.parametrize("name", BAND_MUTATIONS)
def test_a_band_mutation_is_caught(monkeypatch, name):
    mutate_band(monkeypatch, *BAND_MUTATIONS[name])
    assert battery_fails("numpy"), f"the battery missed: {name}"


@pytest.mark.parametrize("kw", [{}, dict(bias=True), dict(window=(2, 3)), dict(softcap=1e30)],
                         ids=["plain", "bias", "narrow-window", "softcap"])
@pytest.mark.parametrize("dtype, scale", LARGE_SCALES, ids=lambda x: np.dtype(x).name if isinstance(x, type) else f"{x:g}")
def test_scores_whose_rounding_exceeds_one_keep_the_gradients_finite(dtype, scale, kw):
    """A scale inside float32's range, 1e30 say, with inputs of magnitude 0.5: the forward is right,
    and the backward, which recomputes P = exp(s - lse) from scores whose rounding is far above 1, must
    not turn it into inf (the NaN and -inf gradients of issue 31). A narrow window takes the band
    backward, the others the tiled one; a batch of 8, the groups of short sequences (packed.py)."""
    large_scores_check("numpy", dtype, scale, **kw)
    large_scores_check("numpy", dtype, scale, seeds=range(1), batch=8, **kw)


def test_the_recomputed_p_is_clamped_only_where_scores_can_round_past_one(rng):
    """The clamp of the previous test costs a pass over every tile, so it is decided per call from q
    and k: off for ordinary inputs (head_dim 64 at a scale of 1, head_dim 256 at the default; float16
    and bfloat16 through their bits), on where rounding can pass 1, with a NaN or a bias (not bounded)."""
    def decide(q, k, scale=None, **kw):
        p = flashcupy._checks.problem(q, k, k, False, scale, None, "numpy", **kw)
        return numpy_backend.softmax.recomputed_p_may_pass_one(p, q, k)

    q, k, _ = make_qkv(rng, 2, 300, 300, 4, 2, 64, np.float32)
    assert not any(decide(q.astype(t), k.astype(t), scale=1.0) for t in (np.float16, BF16, np.float32, np.float64))
    assert not decide(q, k, window=(3, 3)) and not decide(q, k, alibi_slopes=np.full(4, 0.5, np.float32))
    wide, _, _ = make_qkv(rng, 1, 20, 20, 1, 1, 256, np.float32)
    assert not decide(wide, wide)
    assert decide(q, k, scale=1e9) and decide(q.astype(BF16), k.astype(BF16), scale=1e9)
    assert decide(q.astype(np.float64), k.astype(np.float64), scale=1e300)
    assert not decide(q.astype(np.float64), k.astype(np.float64), scale=1e9)
    assert decide(q, k, alibi_slopes=np.full(4, 1e8, np.float32))
    assert decide(q, k, bias=np.zeros((1, 1, 1, 300), np.float32))
    for t in (np.float16, BF16, np.float32):
        x = q.astype(t)
        x[0, 0, 0, 0] = np.nan
        assert decide(x, k.astype(t))
    x = q.astype(np.float16)
    x[1, 2, 3, 4] = -60000.0  # the largest magnitude is a negative one
    assert decide(x, k.astype(np.float16), scale=1.0)


# A batch of short sequences (numpy_backend/packed.py's dense groups): at least DENSE_BATCH elements,
# both lengths at most SHORT. (batch, Sq, Sk, heads_q, heads_kv, D, Dv, keywords):
# causal with Sq > Sk (rows that see no key), GQA, v's own head dim, a window, the softcap and per-element
# ALiBi, dropout (with an origin, as a Dask pair's), and lengths that take several groups (GROUP_SCORES)
SHORT_BATCHES = {
    "causal-gqa": (12, 9, 6, 4, 2, 8, 8, dict(causal=True)),
    "window-softcap-alibi": (9, 97, 103, 8, 2, 16, 5, dict(window=(4, 2), softcap=2.0, alibi_slopes="per-element")),
    "dropout": (10, 90, 90, 4, 2, 8, 8, dict(causal=True, dropout_p=0.3, dropout_seed=5,
                                            dropout_origin=(3, 1, 2, 8))),
    "longest": (8, 128, 120, 8, 8, 4, 4, dict(causal=True)),
    # Graphormer: a bias of every element and head, a key-padding mask; AlphaFold's MSA rows: a pair
    # bias shared by the batch (its dbias summed over the groups), in float32 under 16-bit inputs
    "bias-mask": (10, 20, 20, 4, 4, 8, 8, dict(bias="full", mask="key-padding")),
    "pair-bias": (40, 60, 60, 4, 2, 8, 8, dict(causal=True, bias="pair")),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16, np.float64], ids=["float32", "float16", "bfloat16",
                                                                                "float64"])
@pytest.mark.parametrize("case", SHORT_BATCHES, ids=SHORT_BATCHES.keys())
def test_a_batch_of_short_sequences_runs_in_groups(rng, monkeypatch, case, dtype):
    # forward and backward (with a gradient of lse, NaN with dout in the rows that see no key) and
    # attention_probs of some rows (into a strided view) against the oracle, on the groups and not on
    # the tiled path (spied); leading dimensions folding into the batch
    from flashcupy import _api
    from flashcupy.backends.numpy_backend import packed
    B, Sq, Sk, Hq, Hkv, D, Dv, kw = SHORT_BATCHES[case]
    q, k, v = make_qkv(rng, B, Sq, Sk, Hq, Hkv, D, dtype, head_dim_v=Dv)
    kw = dict(kw)
    if kw.get("alibi_slopes") == "per-element":
        kw["alibi_slopes"] = rng.uniform(0.1, 1, (B, Hq)).astype(np.float32)
    if kw.get("bias") is not None:
        shape = (B, Hq, Sq, Sk) if kw["bias"] == "full" else (1, Hq, Sq, Sk)
        kw["bias"] = rng.standard_normal(shape).astype(np.float32 if kw["bias"] == "pair" else dtype)
    if kw.get("mask") == "key-padding":
        keys = rng.integers(1, Sk + 1, (B, 1, 1, 1))
        keys[3] = 0  # an element whose rows see no key
        kw["mask"] = np.arange(Sk)[None, None, None, :] < keys
    ran = []
    for name in ("forward_dense", "backward_dense", "probs_dense"):
        monkeypatch.setattr(packed, name,
                            lambda *a, _n=name, _f=getattr(packed, name), **k: ran.append(_n) or _f(*a, **k))
    monkeypatch.setattr(numpy_backend.tiled_forward, "forward", lambda *a, **k: pytest.fail("the tiled forward ran"))
    out, lse = _api.forward(q, k, v, backend="numpy", **kw)
    dout = rng.standard_normal(out.shape).astype(dtype)
    unseen = np.isneginf(lse).transpose(0, 2, 1)  # (batch, rows, heads)
    dout[unseen] = np.nan
    dlse = np.where(np.isneginf(lse), np.nan, rng.standard_normal(lse.shape)).astype(lse.dtype)
    grads = _api.backward(dout, q, k, v, out, lse, backend="numpy", dlse=dlse, **kw)
    probs_kw = {name: x for name, x in kw.items() if not name.startswith("dropout")}
    rows = np.array([Sq - 1, 0, 2, -2, 2])
    wide = np.full((B, Hq, rows.size, 2 * Sk), np.nan, lse.dtype)
    P = _api.probs(q, k, lse, rows=rows, backend="numpy", into=wide[..., ::2], **probs_kw)
    assert ran == ["forward_dense", "backward_dense", "probs_dense"]
    assert unseen.any() == ((kw.get("causal", False) and Sq > Sk) or kw.get("mask") is not None)
    assert_matches_oracle((out, lse, *grads), q, k, v, dout, backend="numpy", dlse=dlse, **kw)
    assert error_ratio(P, expected(q, k, v, probs=True, family="numpy", **probs_kw), "P", rows=rows) <= 1
    assert np.isnan(wide[..., 1::2]).all()
    # leading dimensions (3, B/3 ...) fold into the one batch of a rank-4 call: the same bits
    if B % 3 == 0 and not kw.get("dropout_p") and np.ndim(kw.get("alibi_slopes", 0)) < 2 and "bias" not in kw:
        lead = [x.reshape((3, B // 3) + x.shape[1:]) for x in (q, k, v)]
        np.testing.assert_array_equal(flashcupy.attention(*lead, backend="numpy", **kw).reshape(out.shape), out)


@pytest.mark.parametrize("shape, kw", [
    ((2, 40, 50, 4, 2, 16), dict(causal=True, softcap=2.0)),  # the tiled path
    ((9, 20, 20, 4, 2, 8), dict(bias="pair", dropout_p=0.2, dropout_seed=3)),  # the groups, a bias
    ((1, 300, 300, 2, 2, 8), dict(window=(3, 2))),  # the band path (it makes dk and dv, then drops them)
    ((6, 20, 20, 2, 1, 8), dict(causal=True, lead=(2, 3))),  # leading dimensions
    ((2, 0, 5, 2, 1, 8), {}),  # empty
], ids=["tiled", "groups-bias-dropout", "band", "leading", "empty"])
def test_a_dq_only_backward_gives_the_same_dq(rng, monkeypatch, shape, kw):
    """_api.backward(..., dq_only=True), flashcupy.jax's forward mode's widened backward: (dq,) alone, bit
    for bit the full backward's dq, the backend told to skip dk, dv and dbias (Problem.dq_only), into=
    taking dq alone; and the same from a backend that declares no DQ_ONLY."""
    from flashcupy import _api
    kw = dict(kw)
    lead = kw.pop("lead", None)
    q, k, v = make_qkv(rng, *shape, np.float32)
    if lead is not None:
        q, k, v = (x.reshape(lead + x.shape[1:]) for x in (q, k, v))
    if kw.get("bias") == "pair":
        kw["bias"] = rng.standard_normal((1, shape[3], shape[1], shape[2])).astype(np.float32)
    out, lse = flashcupy.attention(q, k, v, return_lse=True, **kw)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    seen = []
    backward = numpy_backend.backward
    monkeypatch.setattr(numpy_backend, "backward", lambda p, *a, **k: seen.append(p.dq_only) or backward(p, *a, **k))
    full = _api.backward(dout, q, k, v, out, lse, **kw)
    assert all(x is False for x in seen)
    seen.clear()
    (dq,) = _api.backward(dout, q, k, v, out, lse, dq_only=True, **kw)
    into = np.full_like(q, np.nan)
    got = _api.backward(dout, q, k, v, out, lse, dq_only=True, into=(into,), **kw)
    assert len(got) == 1 and (q.size == 0 or np.shares_memory(got[0], into))
    assert seen == ([True, True] if shape[1] else [])
    np.testing.assert_array_equal(dq, full[0])
    np.testing.assert_array_equal(into, full[0])
    # a backend that declares no DQ_ONLY: the interface runs its whole backward and keeps dq
    monkeypatch.setattr(numpy_backend, "DQ_ONLY", False)
    seen.clear()
    into = np.full_like(q, np.nan)
    got = _api.backward(dout, q, k, v, out, lse, dq_only=True, into=(into,), **kw)
    assert len(got) == 1 and not any(seen) and len(seen) == (1 if shape[1] else 0)
    np.testing.assert_array_equal(into, full[0])


def test_the_groups_take_big_batches_of_short_sequences_only():
    from flashcupy.backends.numpy_backend import packed

    def problem(B, Sq, Sk, **kw):
        arrays = (np.broadcast_to(np.empty((), np.float32), (B, S, 2, 8)) for S in (Sq, Sk, Sk))
        return flashcupy._checks.problem(*arrays, False, None, None, "numpy", **kw)
    assert packed.dense(problem(8, 128, 128)) and packed.dense(problem(100, 1, 17))
    assert not packed.dense(problem(7, 16, 16))  # a small batch: the tiled path
    assert not packed.dense(problem(8, 129, 16)) and not packed.dense(problem(8, 16, 129))
    assert packed.dense(problem(8, 16, 16, bias=np.zeros((1, 1, 16, 16), np.float32)))
    assert packed.dense(problem(8, 16, 16, mask=np.ones((1, 1, 16, 16), bool)))
    saved = numpy_backend.config.SHORT
    try:
        numpy_backend.configure(short=0)
        assert not packed.dense(problem(8, 16, 16))
    finally:
        numpy_backend.config.SHORT = saved
