"""The numba backend against the float64 oracle: on the CUDA simulator here, on a GPU when present.

numba_device.py decides which numba.cuda this process gets. The shared battery (every dtype and
shape) is tests/test_contract_numba.py's; this file holds the numba backend's own checks: strided
views, modifiers and varlen on the simulator ("simulator" parameters, tiny shapes: every simulated
CUDA thread is a Python thread) and on a real device ("gpu", @pytest.mark.gpu: CuPy and numba
device arrays, a CuPy stream of their own), each skipping cleanly where its device is absent; its
deliberate bugs. Tests that need numba.cuda in another mode run it in a subprocess, wherever this
module runs: the kernels at the GPU's tile sizes on the simulator, and the availability checks of
a real numba.cuda.
"""

import functools
import itertools
import json
import os
import subprocess
import sys
from unittest import mock
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import (BANDS, CASES, DTYPES, LAYOUTS, MUTATION_BATTERY, assert_matches_oracle, band_problem, case_id, make_qkv,
                      mutated_module, mutation_tests, reference, strided_empty)
from numba_device import GPU, SIMULATOR, cuda, gpu_present, quick_thread_switches, require  # noqa: F401 (autouse)

import flashcupy  # noqa: E402
from flashcupy import _api  # noqa: E402
from contract import SIMULATOR_CASES  # noqa: E402
from flashcupy.backends import MAX_GRID, numba_backend  # noqa: E402
from flashcupy.backends.numba_backend import kernels  # noqa: E402
from modifier_checks import (LARGE_SCALES, check, large_scores_check, modifier_cases,  # noqa: E402
                             rows_that_see_no_key_ignore_dlse)
from varlen_checks import (appends_across_a_block_boundary, dropped_sequences_match_the_oracle,  # noqa: E402
                           kv_cache_with_its_own_value_head_dim, packed_batch_matches_the_oracle, packed_inputs,
                           per_sequence_alibi_in_a_kvcache, split_cache_parts_round_once)


def _forward_and_backward(q, k, v, dtype, causal, rng, to_device=lambda x: x, to_host=np.asarray):
    """Forward and backward through the public API, each result against the oracle; returns them."""
    out, lse = flashcupy.attention(to_device(q), to_device(k), to_device(v), causal=causal,
                                   return_lse=True, backend="numba")
    out, lse = to_host(out), to_host(lse)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == (np.float64 if dtype == np.float64 else np.float32)
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1])

    dout = rng.standard_normal(q.shape).astype(dtype)
    grads = flashcupy.attention_backward(*map(to_device, (dout, q, k, v, out, lse)), causal=causal, backend="numba")
    grads = tuple(map(to_host, grads))
    for g, x in zip(grads, (q, k, v)):
        assert g.dtype == x.dtype and g.shape == x.shape
    assert_matches_oracle((out, lse, *grads), q, k, v, dout, causal=causal, backend="numba")
    return out, lse, grads


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("device", ["simulator", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_strided_views_are_read_in_place(rng, device, layout):
    """Transposed, sliced and reversed q/k/v, and strided dout, out and lse in the backward."""
    require(device)
    dtype = np.float32
    B, Sq, Sk, Hq, Hkv, D = (1, 5, 7, 2, 1, 10) if device == "simulator" else (2, 67, 45, 4, 2, 72)
    q, k, v = make_qkv(rng, B, Sq, Sk, Hq, Hkv, D, dtype, layout=layout)
    out, lse = flashcupy.attention(q, k, v, causal=True, return_lse=True, backend="numba")

    dout, out_s = strided_empty(q.shape, dtype, layout), strided_empty(q.shape, dtype, layout)
    dout[...] = rng.standard_normal(q.shape)
    out_s[...] = out
    lse_s = np.empty((B, Sq, Hq), lse.dtype).transpose(0, 2, 1)  # (B, H, S) view of a (B, S, H) array
    lse_s[...] = lse
    grads = flashcupy.attention_backward(dout, q, k, v, out_s, lse_s, causal=True, backend="numba")
    assert_matches_oracle((out, lse, *grads), q, k, v, dout, causal=True, backend="numba")


@pytest.mark.parametrize("device", ["simulator", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_nan_in_dout_of_a_row_that_sees_no_key_goes_nowhere(rng, device):
    """Rows that see no key share a query tile with rows that do: dS there is 0 by selection."""
    require(device)
    Sq = 10 if device == "simulator" else 90
    q, k, v = make_qkv(rng, 1, Sq, 4, 2, 1, 8, np.float32)  # causal: rows 0 .. Sq - 5 see no key
    out, lse = flashcupy.attention(q, k, v, causal=True, return_lse=True, backend="numba")
    dout = rng.standard_normal(q.shape).astype(np.float32)
    dout[:, :Sq - 4] = np.nan
    grads = flashcupy.attention_backward(dout, q, k, v, out, lse, causal=True, backend="numba")
    assert np.all(grads[0][:, :Sq - 4] == 0)
    assert_matches_oracle((out, lse, *grads), q, k, v, dout, causal=True, backend="numba")


# score modifiers: window, softcap and ALiBi here, bias, mask and attention_probs below
MODIFIED = {
    "causal-window": dict(causal=True, window=(2, None)),
    "window-both-sides": dict(window=(1, 2)),
    "softcap": dict(softcap=1.5),
    "alibi-per-batch": dict(causal=True, alibi_slopes=(2, 2)),
}  # all of them at once: tests/contract.py's modified rows


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("device", ["simulator", pytest.param("gpu", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("mods", MODIFIED.values(), ids=MODIFIED.keys())
def test_modifiers_match_the_oracle(rng, device, mods, dtype):
    require(device)
    mods = dict(mods)
    if "alibi_slopes" in mods:
        mods["alibi_slopes"] = rng.uniform(0.2, 1.0, mods["alibi_slopes"]).astype(np.float32)
    # Sq > Sk with a window: rows that see no key; GQA; a scale that is not the default
    q, k, v = make_qkv(rng, 2, 7, 5, 2, 1, 3, dtype)
    dout = rng.standard_normal(q.shape).astype(dtype)
    out, lse = flashcupy.attention(q, k, v, scale=0.8, return_lse=True, backend="numba", **mods)
    grads = flashcupy.attention_backward(dout, q, k, v, out, lse, scale=0.8, backend="numba", **mods)
    assert_matches_oracle((out, lse, *grads), q, k, v, dout, scale=0.8, backend="numba", **mods)


# bias (with dbias), mask and attention_probs: modifier_checks' cases and check (forward, backward
# with dbias, attention_probs and its row sums against the oracle) at a shape the simulator runs in
# a second or two: two batches (batch 0 of the key-padding mask sees no key), GQA, Sq < Sk, lengths
# no tile divides. Each case in one dtype or two, float16 among them (a float32 bias with float16 q
# in bias-11S1-float32), to keep the simulator's time down.
ARRAY_SHAPE = (2, 7, 9, 4, 2, 5)
ARRAY_CASES = [("bias", np.float32), ("bias", np.float64), ("bias-1HSS", np.float16), ("bias-B11S", np.float32),
               ("bias-11S1-float32", np.float16), ("bias-1111", np.float64), ("bias-SS", np.float32),
               ("mask", np.float32), ("mask-key-padding", np.float16), ("all", np.float32), ("all", np.float16),
               ("all-causal", np.float32)]  # all-causal's forward and backward in each dtype: tests/contract.py


@pytest.mark.parametrize("device", ["simulator", pytest.param("gpu", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("name, dtype", ARRAY_CASES, ids=[f"{n}-{np.dtype(d).name}" for n, d in ARRAY_CASES])
def test_bias_mask_and_probs_match_the_oracle(rng, device, name, dtype):
    require(device)
    q, k, v = make_qkv(rng, *ARRAY_SHAPE, dtype)
    dout = rng.standard_normal(q.shape).astype(dtype)
    check(q, k, v, dout, backend="numba", rows=np.array([6, 0, -1, 3, 3]),
          **modifier_cases(rng, ARRAY_SHAPE, dtype)[name])


@pytest.mark.parametrize("device", ["simulator", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_return_dbias_false_runs_no_dbias_kernel(rng, device, monkeypatch):
    """A bias held constant (return_dbias=False): dq, dk, dv as the oracle's, _flash_bwd_dbias never run."""
    require(device)
    q, k, v = make_qkv(rng, *ARRAY_SHAPE, np.float32)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    kw = modifier_cases(rng, ARRAY_SHAPE, np.float32)["all-causal"]
    out, lse = flashcupy.attention(q, k, v, return_lse=True, backend="numba", **kw)
    # a launch would fail: None is not subscriptable
    monkeypatch.setattr(numba_backend._kernels(), "_flash_bwd_dbias", None)
    grads = flashcupy.attention_backward(dout, q, k, v, out, lse, backend="numba", return_dbias=False, **kw)
    assert len(grads) == 3
    assert_matches_oracle((out, lse, *grads), q, k, v, dout, backend="numba", **kw)
    # dq alone (flashcupy.jax's forward mode): the D pre-pass and the dQ kernel, no dK/dV launch
    monkeypatch.setattr(numba_backend._kernels(), "_flash_bwd_dkdv", None)
    dq = _api.backward(dout, q, k, v, out, lse, backend="numba", dq_only=True, **kw)
    assert len(dq) == 1
    np.testing.assert_array_equal(dq[0], grads[0])


@pytest.mark.parametrize("device", ["simulator", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_bias_and_mask_views_are_read_in_place(rng, device):
    """Zero strides (a broadcast view of the full shape), reversed and transposed views."""
    require(device)
    B, Sq, Sk, Hq, Hkv, D = ARRAY_SHAPE
    q, k, v = make_qkv(rng, *ARRAY_SHAPE, np.float32)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    bias = np.broadcast_to(rng.standard_normal((1, Hq, 1, Sk)).astype(np.float32), (B, Hq, Sq, Sk))
    mask = (rng.random((Sk, Sq, 1, B)) < 0.8).transpose(3, 2, 1, 0)[::-1, :, ::-1]
    assert 0 in bias.strides and mask.strides[0] < 0
    check(q, k, v, dout, backend="numba", softcap=3.0, bias=bias, mask=mask)


@pytest.mark.parametrize("device", ["simulator", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_rows_that_see_no_key_ignore_their_dlse(rng, device):
    require(device)
    rows_that_see_no_key_ignore_dlse(rng, "numba", np.float32, shape=(9, 3))


VARLEN_CHECKS = {"packed-batches": functools.partial(packed_batch_matches_the_oracle, backward=True),
                 "kvcache-appends-across-a-block-boundary": appends_across_a_block_boundary,
                 "kvcache-per-sequence-alibi-slopes": per_sequence_alibi_in_a_kvcache,
                 "kvcache-in-parts-rounds-once": split_cache_parts_round_once,
                 "kvcache-value-head-dim": functools.partial(kv_cache_with_its_own_value_head_dim, capacity=24)}


@pytest.mark.parametrize("device", ["simulator", pytest.param("gpu", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("name", VARLEN_CHECKS)
def test_varlen_and_kvcache_match_the_oracle(rng, device, name):
    require(device)
    VARLEN_CHECKS[name](rng, "numba")


# offsets check_offsets=False lets through (total_q 11, total_k 9): decreasing, negative, past the
# end, near 2^31
NUMBA_HOSTILE_OFFSETS = ([0, 8, 3, 11], [0, -5, 4, 9], [0, 4, 30, 11], [0, 2 ** 31 - 1, -2 ** 31, 2 ** 31 - 1])


@cuda.jit(device=True)
def _unclamped_offset(cu, cust, s, total):
    return cu[cust[0] + s * cust[1]]


@pytest.mark.parametrize("unclamped", [False, pytest.param(True, id="unclamped (a deliberate bug)")],
                         ids=["clamped", "unclamped"])
@pytest.mark.parametrize("device", ["simulator", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_a_packed_batch_is_one_launch_per_kernel_and_hostile_offsets_stay_inside(rng, device, unclamped):
    """The kernels read the offsets (numba_backend.forward_varlen, backward_varlen): no host loop, and
    unchecked hostile tables (for q, for k, both) index nothing outside the arrays (the simulator's
    arrays raise IndexError at any index outside them; a negative one would wrap, which the clamp to
    [0, total] forbids before any index is formed). Without the clamp an index leaves the arrays."""
    require(device)
    if unclamped and device != "simulator":
        pytest.skip("the deliberate bug runs where an index outside the arrays raises: the simulator")
    from flashcupy import _varlen
    if unclamped:
        with mock.patch.object(kernels, "_offset", _unclamped_offset), pytest.raises(IndexError):
            test_a_packed_batch_is_one_launch_per_kernel_and_hostile_offsets_stay_inside(rng, device, False)
        return
    q, k, v, cu_q, cu_k = packed_inputs(rng, [3, 6, 2], [4, 3, 2], 2, 1, 8, np.float32)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    loops = []
    with mock.patch.object(_varlen, "_forward_loop", side_effect=loops.append), \
            mock.patch.object(_varlen, "_backward_loop", side_effect=loops.append):
        for bad in NUMBA_HOSTILE_OFFSETS:
            bad = np.array(bad, np.int32)
            for args in ((bad, cu_k), (cu_q, bad), (bad, bad)):
                out, lse = flashcupy.attention_varlen(q, k, v, *args, causal=True, return_lse=True, backend="numba",
                                                      check_offsets=False)
                grads = flashcupy.attention_varlen_backward(dout, q, k, v, out, lse, *args, causal=True,
                                                            backend="numba", check_offsets=False)
                assert out.shape == q.shape and [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert loops == []


@pytest.mark.parametrize("device", ["simulator", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_rows_the_mask_hides_give_zeros_and_keep_nan_in_dout_to_themselves(rng, device):
    """A row the mask leaves no key shares its tiles with rows that see keys: dq and dbias are 0
    there by selection, whatever its dout holds; dbias, summed in a fixed order, is the same bits twice."""
    require(device)
    B, Sq, Sk, Hq, Hkv, D = ARRAY_SHAPE
    q, k, v = make_qkv(rng, *ARRAY_SHAPE, np.float32)
    mask = rng.random((B, Hq, Sq, Sk)) < 0.8
    mask[1, 2, 4] = False
    kw = dict(mask=mask, bias=rng.standard_normal((1, Hq, Sq, 1)).astype(np.float32), window=(6, None))
    out, lse = flashcupy.attention(q, k, v, return_lse=True, backend="numba", **kw)
    assert np.all(out[1, 4, 2] == 0) and np.isneginf(lse[1, 2, 4])
    dout = rng.standard_normal(q.shape).astype(np.float32)
    dout[1, 4, 2] = np.nan
    grads = flashcupy.attention_backward(dout, q, k, v, out, lse, backend="numba", **kw)
    assert not any(np.isnan(g).any() for g in grads)
    assert np.all(grads[0][1, 4, 2] == 0)
    assert_matches_oracle((out, lse, *grads), q, k, v, dout, backend="numba", **kw)
    again = flashcupy.attention_backward(dout, q, k, v, out, lse, backend="numba", **kw)
    np.testing.assert_array_equal(again[3], grads[3])


@pytest.mark.parametrize("kw", [{}, dict(bias=True)], ids=["plain", "bias"])
@pytest.mark.parametrize("dtype, scale", LARGE_SCALES, ids=lambda x: np.dtype(x).name if isinstance(x, type) else f"{x:g}")
@pytest.mark.parametrize("device", ["simulator", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_scores_whose_rounding_exceeds_one_keep_the_gradients_finite(device, dtype, scale, kw):
    """Scales that make scores of inputs of 0.5 far larger than 1 / the accumulation dtype's roundoff
    (issue 31: the NumPy backend and the CuPy kernels gave NaN gradients there): every kernel here sums
    a score as the forward does, and clamps the recomputed s - lse to 0 besides (_recomputed_p)."""
    require(device)
    large_scores_check("numba", dtype, scale, seeds=range(2), **kw)


# ----------------------------------------------------------------------------
# device arrays: the simulator's arrays have no __cuda_array_interface__, so GPU only


@pytest.mark.gpu
@pytest.mark.parametrize("case", SIMULATOR_CASES + CASES, ids=case_id)
def test_numba_device_arrays_in_and_out(rng, case):
    require("gpu")
    B, Sq, Sk, Hq, Hkv, D, causal = case
    q, k, v = make_qkv(rng, B, Sq, Sk, Hq, Hkv, D, np.float16)
    out = flashcupy.attention(cuda.to_device(q), cuda.to_device(k), cuda.to_device(v), causal=causal,
                              backend="numba")
    assert cuda.is_cuda_array(out) and not isinstance(out, np.ndarray)
    _forward_and_backward(q, k, v, np.float16, causal, rng, cuda.to_device, lambda x: x.copy_to_host())


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_cupy_arrays_in_and_out(rng, layout, dtype):
    require("gpu")
    cupy = pytest.importorskip("cupy")
    q, k, v = make_qkv(rng, 2, 67, 45, 4, 2, 72, dtype, layout=layout)

    def to_device(x):  # the same strides on the device: a view of a copy of x's whole base
        base = x.base if x.base is not None else x
        dev = cupy.asarray(base)
        offset = x.__array_interface__["data"][0] - base.__array_interface__["data"][0]
        return cupy.ndarray(x.shape, x.dtype, dev.data + offset, strides=x.strides)

    out = flashcupy.attention(to_device(q), to_device(k), to_device(v), backend="numba")
    assert isinstance(out, cupy.ndarray)
    _forward_and_backward(q, k, v, dtype, True, rng, to_device, cupy.asnumpy)


# ----------------------------------------------------------------------------
# which keys a query sees


@pytest.mark.parametrize("causal, window", BANDS)
def test_visibility_helpers_are_the_oracles_rule(causal, window):
    """The kernels' three helpers, run as Python, with the mask the host passes: _visible is the
    oracle's rule (and False outside the arrays), and a block's range holds exactly the keys
    (queries) that some row (key) of the block sees, so the kernels skip no visible pair and visit
    no block that sees nothing."""
    key_range, query_range, visible = (kernels._key_range.py_func, kernels._query_range.py_func,
                                       kernels._visible.py_func)
    for Sq, Sk in itertools.product(range(1, 7), repeat=2):
        mask = numba_backend._mask(band_problem(Sq, Sk, causal, window))
        want = np.zeros((Sq + 1, Sk + 1), bool)  # one row and one column past the arrays
        want[:Sq, :Sk] = reference.visible(Sq, Sk, causal, window=window)
        got = [[visible(mask, i, j, Sq, Sk) for j in range(Sk + 1)] for i in range(Sq + 1)]
        np.testing.assert_array_equal(got, want)
        for i0, i1 in itertools.combinations(range(Sq + 1), 2):
            assert list(range(*key_range(mask, i0, i1, Sk))) == list(np.flatnonzero(want[i0:i1].any(0)))
        for j0, j1 in itertools.combinations(range(Sk + 1), 2):
            assert list(range(*query_range(mask, j0, j1, Sq))) == list(np.flatnonzero(want[:, j0:j1].any(1)))


# ----------------------------------------------------------------------------
# availability, imports, compilation


def test_nan_in_a_query_row_stays_in_that_row(rng):
    q, k, v = make_qkv(rng, 1, 5, 6, 1, 1, 3, np.float32)
    q[0, 2, 0, 1] = np.nan
    out, lse = flashcupy.attention(q, k, v, return_lse=True, backend="numba")
    np.testing.assert_array_equal(np.isnan(out), np.isnan(reference.attention(q, k, v)))
    assert np.isnan(out[0, 2]).all() and np.isnan(lse[0, 0, 2])
    assert np.isfinite(np.delete(out, 2, axis=1)).all()


def test_available_exactly_where_a_device_or_the_simulator_is():
    assert (numba_backend.unavailable_reason() is None) == (SIMULATOR or GPU)
    assert numba_backend.simulated() == SIMULATOR


def test_head_dim_above_the_register_tiles_is_refused(rng):
    if not (SIMULATOR or GPU):
        pytest.skip("neither the simulator nor a GPU in this process")
    q, k, v = make_qkv(rng, 1, 1, 1, 1, 1, numba_backend.MAX_HEAD_DIM + 1, np.float32)
    with pytest.raises(ValueError, match=f"head_dim must be at most {numba_backend.MAX_HEAD_DIM} for the numba backend"):
        flashcupy.attention(q, k, v, backend="numba")


def _python(code, *args, **env):
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **env})


def test_flashcupy_import_does_not_import_numba():
    r = _python("import sys, flashcupy; flashcupy.attention; assert 'numba' not in sys.modules, 'numba imported'")
    assert r.returncode == 0, r.stderr


def test_unavailable_reason_without_a_device():
    if gpu_present():
        pytest.skip("a GPU is present")
    r = _python("from flashcupy.backends import unavailable_reason; print(unavailable_reason('numba'))",
                NUMBA_ENABLE_CUDASIM="0")
    assert r.returncode == 0, r.stderr
    assert "no CUDA GPU" in r.stdout and "NUMBA_ENABLE_CUDASIM=1" in r.stdout


def test_kernels_compile_for_a_real_gpu():
    """Every specialisation the backend launches (tools.signatures(): each kernel x dtype x kind of slopes,
    bias and mask array; the next test checks that list) through NVVM to PTX: the typing the simulator
    never does (no GPU needed)."""
    r = subprocess.run([sys.executable, "-m", "flashcupy.backends.numba_backend.tools", "ptx"],
                       capture_output=True, text=True, timeout=300,
                       env={k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"})
    assert r.returncode == 0, r.stdout + r.stderr  # 3: NVVM missing, which the test extra installs


def _argument_kinds(args):
    """What numba specialises a launch on, as comparable tuples: arrays by dtype, tuples by length,
    floats by dtype, integers; from a launch's arguments or from a numba signature's types."""
    from numba import types

    def kind(a):
        if a is None or isinstance(a, types.NoneType):  # an optional argument left out (the pre-pass's dlse)
            return ("none",)
        if isinstance(a, types.Array) or (hasattr(a, "dtype") and len(getattr(a, "shape", ())) == 1):
            return ("array", np.dtype(str(a.dtype) if isinstance(a, types.Array) else a.dtype).name)
        if isinstance(a, (tuple, types.BaseTuple)):
            return ("tuple", len(a))
        if isinstance(a, (np.floating, types.Float)):
            return ("float", np.dtype(str(a) if isinstance(a, types.Float) else type(a)).name)
        assert isinstance(a, (int, np.integer, types.Integer)), a
        return ("int",)
    return tuple(kind(a) for a in args)


def test_the_ptx_compile_covers_every_specialisation_the_backend_launches(rng, monkeypatch):
    """tools.signatures(), the list the previous test compiles, is exactly what the backend launches:
    every kernel, recorded on the simulator over every input dtype and every kind of array a call
    passes as the ALiBi slopes (float32, or float64 with float64 inputs), the bias (q's dtype or
    float32) and the mask, forward, backward (dbias with a bias) and attention_probs."""
    require("simulator")
    from flashcupy.backends.numba_backend import tools
    launched = set()

    class Recorder:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, config):
            def launch(*args):
                launched.add((self.name, _argument_kinds(args)))
                return self.kernel[config](*args)
            return launch

    names = {name for name, _, _ in tools.signatures()}
    for name in names:
        monkeypatch.setattr(kernels, name, Recorder(name, getattr(kernels, name)))
    for dtype in DTYPES:
        q, k, v = make_qkv(rng, 1, 2, 3, 1, 1, 2, dtype)
        slopes = [None, np.float32] + ([np.float64] if dtype == np.float64 else [])
        for slope, bias, mask in itertools.product(slopes, [None, dtype, np.float32], [None, bool]):
            kw = dict(alibi_slopes=None if slope is None else np.full(1, 0.5, slope),
                      bias=None if bias is None else np.zeros((1, 1, 2, 3), bias),
                      mask=None if mask is None else np.ones((1, 1, 2, 3), bool))
            out, lse = flashcupy.attention(q, k, v, return_lse=True, backend="numba", **kw)
            flashcupy.attention_backward(q, q, k, v, out, lse, backend="numba", **kw)
            flashcupy.attention_probs(q, k, lse, backend="numba", **kw)
        flashcupy.attention_backward(q, q, k, v, out, lse, backend="numba", dlse=lse)  # the pre-pass's other kind
    assert {name for name, _ in launched} == names == set(kernels.__dict__) & {n for n in dir(kernels) if n.startswith("_flash")}
    assert launched == {(name, _argument_kinds(sig)) for name, _, sig in tools.signatures()}


# ----------------------------------------------------------------------------
# the GPU's tile sizes, on the simulator

_RUN_AT_GPU_TILES = """
import sys
import numpy as np
sys.setswitchinterval(2e-4)  # as numba_device.quick_thread_switches
import flashcupy
from flashcupy.backends.numba_backend import kernels
a = np.load(sys.argv[1])
out, lse = flashcupy.attention(a["q"], a["k"], a["v"], causal=True, return_lse=True, backend="numba")
dq, dk, dv = flashcupy.attention_backward(a["dout"], a["q"], a["k"], a["v"], out, lse, causal=True,
                                          backend="numba")
np.savez(sys.argv[2], out=out, lse=lse, dq=dq, dk=dk, dv=dv, simulator=kernels.SIMULATOR,
         tiles=(kernels.BLOCK_M, kernels.BLOCK_N, kernels.D_TILE, kernels.PREP_THREADS))
"""


def test_gpu_tile_sizes_on_the_simulator(rng, tmp_path):
    """The kernels as a GPU compiles them (FLASHCUPY_NUMBA_TILES=gpu), run by the simulator, against the oracle.

    The tile table is read once, at import, so this runs in a process of its own. One query block,
    two key blocks (the second partial), head_dim = one full D_TILE chunk plus a partial one, MQA,
    causal with seqlen_q < seqlen_k: kept tiny, as each block is BLOCK_M x BLOCK_N Python threads.
    """
    dtype = np.float32
    q, k, v = make_qkv(rng, 1, 5, 17, 2, 1, 40, dtype)
    dout = rng.standard_normal(q.shape).astype(dtype)
    np.savez(tmp_path / "in.npz", q=q, k=k, v=v, dout=dout)
    r = _python(_RUN_AT_GPU_TILES, tmp_path / "in.npz", tmp_path / "out.npz",
                NUMBA_ENABLE_CUDASIM="1", FLASHCUPY_NUMBA_TILES="gpu")
    assert r.returncode == 0, r.stderr
    got = np.load(tmp_path / "out.npz")
    assert got["simulator"] and tuple(got["tiles"]) == kernels.TILE_TABLES["gpu"]
    assert_matches_oracle([got[name] for name in ("out", "lse", "dq", "dk", "dv")], q, k, v, dout, causal=True,
                          backend="numba")


def test_an_unknown_tile_table_is_refused_by_name():
    r = _python("from flashcupy.backends.numba_backend import kernels", NUMBA_ENABLE_CUDASIM="1",
                FLASHCUPY_NUMBA_TILES="huge")
    assert r.returncode != 0
    assert "ValueError: FLASHCUPY_NUMBA_TILES must be one of 'gpu', 'simulator' (or unset), got 'huge'" in r.stderr


# ----------------------------------------------------------------------------
# CuPy inputs: CuPy's current stream and memory pool, no host synchronisation


class _FakeCupyArray:
    """What the backend reads of a cupy.ndarray (its module, __cuda_array_interface__ and data.ptr), over host
    memory."""

    __module__ = "cupy"

    def __init__(self, host, stream_ptr):
        self.host = host
        self.shape, self.strides, self.dtype, self.ndim = host.shape, host.strides, host.dtype, host.ndim
        self.stream_ptr = stream_ptr

    @property
    def data(self):  # cupy's MemoryPointer: the address the interface's checks read
        return SimpleNamespace(ptr=self.host.__array_interface__["data"][0])

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "strides": self.strides, "typestr": self.dtype.str,
                "data": (self.host.__array_interface__["data"][0], False), "version": 3,
                "stream": self.stream_ptr}


class _LaunchRecorder:
    """Stands in for a kernel: records the stream of each launch, then runs the kernel."""

    def __init__(self, kernel, streams):
        self.kernel, self.streams = kernel, streams

    def __getitem__(self, config):
        grid, block, stream = config
        self.streams.append(stream)
        return self.kernel[grid, block, stream]


def test_cupy_inputs_run_on_cupys_stream_with_cupys_memory(rng, monkeypatch):
    """The CuPy host path on the simulator, through a fake CuPy whose device memory is host memory.

    Checks what a GPU run cannot show without a profiler: kernels are launched on numba's wrapper
    of CuPy's current stream, arrays are read without a host synchronisation, every output and
    workspace comes from cupy.empty (numba's allocator is never called), and the pointer
    arithmetic that reads a view in place (negative strides here) gives the oracle's numbers.
    """
    require("simulator")
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    stream_ptr = 0x5EED
    allocated, wrapped, syncs, launches = [], [], [], []

    def cupy_empty(shape, dtype):
        a = _FakeCupyArray(np.full(shape, np.nan, dtype), stream_ptr)  # NaN: an unwritten element shows
        allocated.append((tuple(shape), np.dtype(dtype)))
        return a

    def external_stream(ptr):
        wrapped.append(SimpleNamespace(ptr=ptr))
        return wrapped[-1]

    def from_cuda_array_interface(desc, owner, sync):
        syncs.append(sync)
        memory = SimpleNamespace(owner=owner, __array_interface__={
            "shape": desc["shape"], "strides": desc["strides"], "typestr": desc["typestr"],
            "data": desc["data"], "version": 3})
        return FakeCUDAArray(np.asarray(memory))

    def numba_allocator(*args, **kwargs):
        raise AssertionError("numba's allocator was used for CuPy inputs")

    fake_cupy = SimpleNamespace(empty=cupy_empty,
                                cuda=SimpleNamespace(get_current_stream=lambda: SimpleNamespace(ptr=stream_ptr)))
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    monkeypatch.setattr(cuda, "external_stream", external_stream)
    monkeypatch.setattr(cuda, "from_cuda_array_interface", from_cuda_array_interface, raising=False)
    monkeypatch.setattr(cuda, "device_array", numba_allocator)
    monkeypatch.setattr(cuda, "to_device", numba_allocator)
    for name in ("_flash_fwd", "_flash_bwd_preprocess", "_flash_bwd_dkdv", "_flash_bwd_dq"):
        monkeypatch.setattr(kernels, name, _LaunchRecorder(getattr(kernels, name), launches))

    dtype = np.float32
    q, k, v = make_qkv(rng, 1, 5, 7, 2, 1, 10, dtype, layout="reversed")
    dout = strided_empty(q.shape, dtype, "reversed")
    dout[...] = rng.standard_normal(q.shape)
    dev = {name: _FakeCupyArray(x, stream_ptr) for name, x in (("q", q), ("k", k), ("v", v), ("dout", dout))}

    out, lse = flashcupy.attention(dev["q"], dev["k"], dev["v"], causal=True, return_lse=True, backend="numba")
    assert isinstance(out, _FakeCupyArray) and isinstance(lse, _FakeCupyArray)
    grads = flashcupy.attention_backward(dev["dout"], dev["q"], dev["k"], dev["v"], out, lse, causal=True,
                                         backend="numba")
    assert all(isinstance(g, _FakeCupyArray) for g in grads)
    assert_matches_oracle([x.host for x in (out, lse, *grads)], q, k, v, dout, causal=True, backend="numba")

    assert [w.ptr for w in wrapped] == [stream_ptr, stream_ptr]  # one wrapper per call
    assert launches == [wrapped[0]] + [wrapped[1]] * 3  # forward; D pre-pass, dK/dV, dQ
    assert syncs and not any(syncs)
    lse_shape = (1, 2, 5)
    assert allocated == [(q.shape, q.dtype), (lse_shape, lse.dtype),  # forward: out, lse
                         (q.shape, q.dtype), (k.shape, k.dtype), (v.shape, v.dtype),  # dq, dk, dv
                         (lse_shape, lse.dtype)]  # the workspace D


# ----------------------------------------------------------------------------
# CUDA's grid limits, checked on the host


def _over_the_grid_limit(name):
    """(argument value one past what the grid holds, q, k, v shapes): broadcast views, so nothing is allocated."""
    n = {"seqlen_q": MAX_GRID[0] * kernels.BLOCK_M + 1,
         "seqlen_k": MAX_GRID[0] * kernels.BLOCK_N + 1,
         "heads_q": MAX_GRID[1] + 1,
         "batch": MAX_GRID[2] + 1}[name]
    B, Sq, Sk, Hq = (n if name == arg else 1 for arg in ("batch", "seqlen_q", "seqlen_k", "heads_q"))
    return n, (B, Sq, Hq, 1), (B, Sk, 1, 1)


def test_the_simulators_shared_arrays_are_one_per_call_site_however_threads_interleave(monkeypatch):
    """Every thread of a block gets the same array from one cuda.shared.array line, and different
    lines get different arrays. A slow allocation holds all the threads inside the lookup at once:
    the simulator's own unlocked lookup hands each a private array here (a CI run saw the same
    race leave dk uninitialised)."""
    if not SIMULATOR:
        pytest.skip("numba.cuda is the real device in this process; the race is the simulator's")
    import threading
    import time
    from numba.cuda.simulator import kernelapi

    empty = np.empty
    monkeypatch.setattr(np, "empty", lambda *a, **kw: (time.sleep(0.02), empty(*a, **kw))[1])
    shared = kernelapi.FakeCUDAShared(0)
    start = threading.Barrier(8)
    got = []

    def thread():
        start.wait()
        first = shared.array((4,), np.float64)
        second = shared.array((4,), np.float64)
        got.append((first, second))

    threads = [threading.Thread(target=thread) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8
    assert len({id(first) for first, _ in got}) == 1 and len({id(second) for _, second in got}) == 1
    assert got[0][0] is not got[0][1]


@pytest.mark.parametrize("name", ["seqlen_q", "seqlen_k", "heads_q", "batch"])
def test_grid_limits_are_checked_before_anything_is_allocated_or_launched(monkeypatch, name):
    if not (SIMULATOR or GPU):
        pytest.skip("neither the simulator nor a GPU in this process")

    def no_work(*args, **kwargs):
        raise AssertionError("device memory was touched or a kernel launched before the grid check")

    monkeypatch.setattr(numba_backend, "_Placement", no_work)
    n, q_shape, kv_shape = _over_the_grid_limit(name)
    q = np.broadcast_to(np.float32(1), q_shape)
    k = v = np.broadcast_to(np.float32(1), kv_shape)
    lse = np.broadcast_to(np.float32(0), (q_shape[0], q_shape[2], q_shape[1]))
    axis = {"seqlen_q": 0, "seqlen_k": 0, "heads_q": 1, "batch": 2}[name]
    message = (f"^too large for the numba backend: {name}.* needs {MAX_GRID[axis] + 1} thread blocks along "
               f"CUDA grid {'xyz'[axis]}, which holds at most {MAX_GRID[axis]}$")
    if name != "seqlen_k":  # the forward has no grid over keys
        with pytest.raises(ValueError, match=message):
            flashcupy.attention(q, k, v, backend="numba")
    with pytest.raises(ValueError, match=message):
        flashcupy.attention_backward(q, q, k, v, q, lse, backend="numba")


# ----------------------------------------------------------------------------
# availability: every reason reported, and the backend refused before any work

_REASONS = """
import json
import numpy as np
from numba import cuda
from numba.cuda.cudadrv import nvvm
import flashcupy
from flashcupy.backends import BackendUnavailableError, numba_backend as nb

# pretend a GPU, so that the compiler checks run
cuda.is_available = lambda: True
cuda.get_current_device = lambda: type("Device", (), {"compute_capability": (9, 0)})()

def ran(*args):
    raise AssertionError("the backend ran")

nb.forward = nb.backward = ran
real_probe, probes = nb._compile_probe, []

def raising(e):
    def probe(cc):
        probes.append(cc)
        raise e
    return probe

def counted(cc):
    probes.append(cc)
    real_probe(cc)

scenarios = {
    "nvvm missing": (lambda: False, counted),
    "numpy attribute": (nvvm.is_available, raising(AttributeError("module 'numpy' has no attribute 'row_stack'"))),
    "numpy expired": (nvvm.is_available, raising(AttributeError(
        "`np.row_stack` was removed in the NumPy 2.5 release. Use `np.vstack` instead."))),
    "other": (nvvm.is_available, raising(RuntimeError("libdevice not found"))),
    "working": (nvvm.is_available, counted),
}
q, lse = np.ones((1, 2, 1, 4), np.float32), np.zeros((1, 1, 2), np.float32)
results = {}
for name, (nvvm_is_available, probe) in scenarios.items():
    nvvm.is_available, nb._compile_probe, probes[:] = nvvm_is_available, probe, []
    nb.unavailable_reason.cache_clear()
    reason, again = nb.unavailable_reason(), nb.unavailable_reason()
    refused = []
    if reason is not None:
        for call in (lambda: flashcupy.attention(q, q, q, backend="numba"),
                     lambda: flashcupy.attention_backward(q, q, q, q, q, lse, backend="numba")):
            try:
                call()
            except BackendUnavailableError as e:
                refused.append(str(e))
    results[name] = {"reason": reason, "same": again == reason, "probes": list(probes), "refused": refused}
print(json.dumps(results))
"""


def test_each_unavailability_reason_is_reported_and_refuses_the_backend_before_any_work():
    """libNVVM missing, numba-cuda broken by the installed NumPy (both of NumPy's error forms), any other
    compile failure: each is named with its fix, decided once (cached), and attention() and
    attention_backward() then raise BackendUnavailableError with it before the backend runs.

    Real numba.cuda (not the simulator) in a process of its own, told a GPU is present; the probe is
    made to raise as each failure does. The real probe compiles here (NVVM from the test extra).
    """
    r = _python(_REASONS, NUMBA_ENABLE_CUDASIM="0")
    assert r.returncode == 0, r.stderr
    results = json.loads(r.stdout)
    from importlib.metadata import version
    numba_cuda = f"numba-cuda {version('numba-cuda')}"
    major_minor = ".".join(np.__version__.split(".")[:2])
    expected = {
        "nvvm missing": ("cannot find libNVVM", 'pip install "numba-cuda[cu12]"'),
        "numpy attribute": (f"{numba_cuda} does not work with numpy {np.__version__}", "'row_stack'",
                            f'pip install "numpy<{major_minor}"'),
        "numpy expired": (f"{numba_cuda} does not work with numpy {np.__version__}", "`np.row_stack` was removed",
                          f'pip install "numpy<{major_minor}"'),
        "other": (f"{numba_cuda} cannot compile a kernel here: RuntimeError: libdevice not found",),
    }
    for name, parts in expected.items():
        got = results[name]
        assert got["reason"] is not None and all(p in got["reason"] for p in parts), (name, got["reason"])
        assert got["same"]
        assert got["probes"] == ([] if name == "nvvm missing" else [[9, 0]])  # once, however often asked
        assert got["refused"] == [f"backend 'numba' is not available: {got['reason']}"] * 2
    assert results["working"] == {"reason": None, "same": True, "probes": [[9, 0]], "refused": []}


_INFO_UNDER_NUMPY_2_5 = """
import numpy as np
from numba import cuda
del np.row_stack  # what NumPy 2.5 removed, and numba-cuda 0.30.4 still registers an overload of
cuda.is_available = lambda: True  # the device image's GPU
cuda.get_current_device = lambda: type("Device", (), {"compute_capability": (9, 0)})()
from flashcupy.__main__ import main
main(["info"])
"""


def test_info_says_what_breaks_numba_cuda_and_how_to_fix_it():
    """`python -m flashcupy info` on the H200 image of the first GPU session (numpy 2.5.2 with numba-cuda
    0.30.4, whose first compile failed on np.row_stack): NumPy 2.5 made here by removing np.row_stack,
    and numba-cuda's real first compile (the availability probe) meeting it. The numba line says the
    cause and the fix."""
    r = _python(_INFO_UNDER_NUMPY_2_5, NUMBA_ENABLE_CUDASIM="0")
    assert r.returncode == 0, r.stderr
    (line,) = [x for x in r.stdout.splitlines() if x.strip().startswith("numba ")]
    from importlib.metadata import version
    major_minor = ".".join(np.__version__.split(".")[:2])
    for part in (f"unavailable: numba-cuda {version('numba-cuda')} does not work with numpy {np.__version__}",
                 "row_stack", f'pip install "numpy<{major_minor}"', "a numba-cuda release that supports"):
        assert part in line, (part, line)


# ----------------------------------------------------------------------------
# CuPy's current stream, on a GPU

_LATE_COPY = r"""
extern "C" __global__ void late_copy(const unsigned char* src, unsigned char* dst, long long nbytes,
                                     long long spin_cycles) {
    long long start = clock64();
    while (clock64() - start < spin_cycles) { }
    for (long long i = threadIdx.x; i < nbytes; i += blockDim.x) dst[i] = src[i];
}
"""


@pytest.mark.gpu
def test_kernels_queue_behind_cupy_work_on_a_non_blocking_stream(rng):
    """q and dout are written by a kernel that first spins on the GPU for a while, on a non-blocking
    stream (no implicit order with the default stream): only kernels launched on that same stream
    read them after they are written, which the oracle then checks."""
    require("gpu")
    cupy = pytest.importorskip("cupy")
    dtype = np.float32
    q, k, v = make_qkv(rng, 1, 67, 45, 2, 1, 64, dtype)
    dout = rng.standard_normal(q.shape).astype(dtype)
    late_copy = cupy.RawKernel(_LATE_COPY, "late_copy")
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        qd, kd, vd, dd = (cupy.asarray(x) for x in (q, k, v, dout))
        flashcupy.attention_backward(dd, qd, kd, vd, *flashcupy.attention(qd, kd, vd, causal=True, return_lse=True,
                                                                          backend="numba"),
                                     causal=True, backend="numba")  # compile first: the spin must outlast a launch
        stream.synchronize()

        def late(src):
            dst = cupy.full_like(src, cupy.nan)
            late_copy((1,), (256,), (src, dst, cupy.int64(src.nbytes), cupy.int64(2**28)))
            return dst

        out, lse = flashcupy.attention(late(qd), kd, vd, causal=True, return_lse=True, backend="numba")
        grads = flashcupy.attention_backward(late(dd), qd, kd, vd, out, lse, causal=True, backend="numba")
        stream.synchronize()
    assert_matches_oracle([cupy.asnumpy(x) for x in (out, lse, *grads)], q, k, v, dout, causal=True, backend="numba")


@pytest.mark.gpu
def test_a_call_on_cupys_stream_captures_into_a_cuda_graph(rng):
    """Stream capture fails on work sent to another stream and on a host synchronisation, so a
    forward + backward that captures on CuPy's current stream does neither; the graph, replayed
    into outputs overwritten with NaN, gives the oracle's numbers."""
    require("gpu")
    cupy = pytest.importorskip("cupy")
    dtype = np.float32
    q, k, v = make_qkv(rng, 1, 67, 45, 2, 1, 64, dtype)
    dout = rng.standard_normal(q.shape).astype(dtype)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        qd, kd, vd, dd = (cupy.asarray(x) for x in (q, k, v, dout))

        def call():
            out, lse = flashcupy.attention(qd, kd, vd, causal=True, return_lse=True, backend="numba")
            return (out, lse) + flashcupy.attention_backward(dd, qd, kd, vd, out, lse, causal=True,
                                                             backend="numba")

        call()  # compile (module loading has no place in a capture) and fill CuPy's pool
        stream.synchronize()
        stream.begin_capture()
        results = call()
        graph = stream.end_capture()
        # The backward's workspace went back to CuPy's pool during the capture and the graph still
        # writes it: nothing is allocated on this stream until the graph has run.
        for x in results:
            x.fill(cupy.nan)
        graph.launch(stream)
        stream.synchronize()
    assert_matches_oracle([cupy.asnumpy(x) for x in results], q, k, v, dout, causal=True, backend="numba")


# ----------------------------------------------------------------------------
# deliberate bugs (conftest.MUTATION_BATTERY), in the kernels as the simulator runs them

def _bias_and_mask(rng):
    """A bias broadcast over batch and heads (dbias sums 8 pairs an element) and a key-padding mask,
    for the battery's case (2, 7, 6, 4, 2, 5)."""
    return dict(bias=rng.standard_normal((1, 1, 7, 6)).astype(np.float32), mask=rng.random((2, 1, 1, 6)) < 0.7)


def _row_bias_and_window(rng):
    """A bias broadcast along the query rows (dbias sums each key's column over the rows that see it)
    and a window bounded on both sides, for the battery's case (1, 7, 6, 2, 1, 5)."""
    return dict(bias=rng.standard_normal((1, 1, 1, 6)).astype(np.float32), window=(1, 2))


NUMBA_BATTERY = MUTATION_BATTERY + ((2, 7, 6, 4, 2, 5, True, None, _bias_and_mask),
                                    (1, 7, 6, 2, 1, 5, False, None, _row_bias_and_window))

NUMBA_MUTATIONS = {
    "scale ignored": ("s, _, _ = _modify(s * scale, mods, slopes, bias, allow, mask, b, h, i, j0 + c,",
                      "s, _, _ = _modify(s / math.sqrt(head_dim), mods, slopes, bias, allow, mask, b, h, i, j0 + c,"),
    "GQA head mapping": ("for h in range(kv_head * group, (kv_head + 1) * group):",
                         "for h in range(kv_head, kv_head + group):"),
    "D not subtracted": ("ds = p * (dp * z - D[_at3(Dst, b, h, i)]) *", "ds = p * dp * z *"),
    "key_end off by one": ("min(seqlen_k, i_end + diagonal + right))", "min(seqlen_k, i_end + diagonal + right - 1))"),
    "lse base": ("m + math.log(l) if seen", "m + math.log2(l) if seen"),
    "dbias not summed over heads": ("h_end = hb + 1 if nh > 1 else heads_q", "h_end = hb + 1"),
    "dbias rows of a key one short": ("i_start, i_end = _query_range(mask, jb, jb + 1, seqlen_q)",
                                      "i_start, i_end = _query_range(mask, jb, jb, seqlen_q)"),
    "mask ignored": ("if not allow[_at(allow_st, b, h, i, j)]:", "if False:"),
}


def _numba_mutant(old, new):
    """The backend running a copy of kernels.py with `old` replaced by `new` (on the simulator)."""
    mutant = mutated_module(kernels, old, new)
    return mock.patch.object(numba_backend, "_kernels", lambda: mutant)


test_the_mutation_battery_passes_unmutated, test_a_mutation_is_caught = mutation_tests(
    NUMBA_MUTATIONS, "numba", _numba_mutant, cases=NUMBA_BATTERY, require=lambda: require("simulator"))


# ----------------------------------------------------------------------------
# leading batch dimensions (issue 30; tests/test_batch_dims.py has the rest)


def test_leading_batch_dimensions(rng):
    """q (2, 2, Sq, heads, head_dim): folded into one call, and (transposed) into one call per outer
    index; a bias broadcast over a leading dimension, a mask over another."""
    base = [rng.standard_normal((2, 2, S, H, 8)).astype(np.float32) for S, H in ((5, 2), (6, 1), (6, 1))]
    dout = rng.standard_normal(base[0].shape).astype(np.float32)
    for q, k, v in (base, [x.transpose(1, 0, 2, 3, 4) for x in base]):
        kw = dict(bias=rng.standard_normal((2, 1, 2, 5, 6)).astype(np.float32), mask=rng.random((1, 2, 1, 1, 6)) < 0.8,
                  window=(2, 1))
        out, lse = flashcupy.attention(q, k, v, return_lse=True, backend="numba", **kw)
        grads = flashcupy.attention_backward(dout, q, k, v, out, lse, backend="numba", **kw)
        assert_matches_oracle((out, lse, *grads), q, k, v, dout, backend="numba", **kw)


def test_a_value_head_dim_of_its_own_with_every_modifier_and_in_a_packed_batch(rng):
    """v's head_dim unlike q's (tests/test_head_dim_v.py has the other backends'): every modifier at
    once (dbias from the kernel of a thread per element), then a packed batch in one launch, with v's
    head dim of several D_TILE chunks against q's of a partial one. The contract's
    SIMULATOR_HEAD_DIM_V_CASES cover the plain and causal calls."""
    B, Sq, Sk, Hq, Hkv, D = 1, 7, 9, 2, 1, 3
    q, k, v = make_qkv(rng, B, Sq, Sk, Hq, Hkv, D, np.float32, head_dim_v=17)
    dout = rng.standard_normal((B, Sq, Hq, 17)).astype(np.float32)
    kw = modifier_cases(rng, (B, Sq, Sk, Hq, Hkv, D), np.float32)["all-causal"]
    out, lse = flashcupy.attention(q, k, v, return_lse=True, backend="numba", **kw)
    dlse = rng.standard_normal(lse.shape).astype(lse.dtype)
    grads = flashcupy.attention_backward(dout, q, k, v, out, lse, backend="numba", dlse=dlse, **kw)
    assert out.shape == (B, Sq, Hq, 17) and grads[2].shape == v.shape
    assert_matches_oracle((out, lse, *grads), q, k, v, dout, backend="numba", dlse=dlse, **kw)
    packed_batch_matches_the_oracle(rng, "numba", lengths=([3, 0, 5], [4, 2, 1]), head_dim=3, head_dim_v=10,
                                    backward=True)


def test_dropout_with_a_broadcast_bias_and_in_a_packed_batch(rng):
    """Dropout (tests/test_dropout.py has the other backends' and the rule's own tests): causal, GQA
    and a bias broadcast over rows (its dbias from the kernel of a thread per element), then a packed
    batch in one launch, sequence b drawn as batch b."""
    q, k, v = make_qkv(rng, 1, 9, 13, 2, 1, 8, np.float32)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    kw = dict(causal=True, bias=rng.standard_normal((1, 1, 1, 13)).astype(np.float32), dropout_p=0.3,
              dropout_seed=2**40 + 5)
    out, lse = flashcupy.attention(q, k, v, return_lse=True, backend="numba", **kw)
    grads = flashcupy.attention_backward(dout, q, k, v, out, lse, backend="numba", **kw)
    assert_matches_oracle((out, lse, *grads), q, k, v, dout, backend="numba", **kw)
    cu_q, cu_k = np.array([0, 3, 3, 8], np.int32), np.array([0, 4, 6, 11], np.int32)
    q, k, v = (rng.standard_normal((n, 2, 4)).astype(np.float32) for n in (8, 11, 11))
    dout = rng.standard_normal(q.shape).astype(np.float32)
    drop = dict(dropout_p=0.4, dropout_seed=7)
    out, lse = flashcupy.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, backend="numba", **drop)
    grads = flashcupy.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, backend="numba", **drop)
    dropped_sequences_match_the_oracle((out, lse, *grads), q, k, v, dout, cu_q, cu_k, "numba", **drop)
