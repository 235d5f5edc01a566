"""The cupy backend's kernels, run by the CPU CUDA emulator and compared with the oracle: what is
the backend's own (layouts, head dims, kernel handles, specialisation tables, barriers, deliberate
bugs); the shared battery over every dtype, kernel path and shape is tests/test_contract_cupy.py's.

No GPU is needed: flashcupy/tools/emulator/cupy.py swaps NumPy and the emulator in for CuPy and
NVRTC, and every test goes through the public API with backend="cupy", so dispatch, grid sizes,
strides, argument packing and workspaces are exercised along with the .cu files.
The last tests check that the emulator catches the bugs it is there to catch, in these kernels:
every __syncthreads() and cp.async wait is needed, and an off-by-one in a bound is an
out-of-bounds access.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import flashcupy
from conftest import (BF16, DTYPES, LAYOUTS, MASK_CUH_MUTATIONS, MUTATION_BATTERY, TILE_EDGE_CASE, assert_matches_oracle, bf16_bits, make_qkv,
                      mutated_compile, mutation_tests, reference, strided_empty)
from flashcupy.backends import cupy_backend
from flashcupy.backends.cupy_backend import catalog, sources, specs

# Core tests: no skip. Without g++ the emulator cannot build and these fail loudly.
from flashcupy.tools import emulator  # noqa: E402
from flashcupy.tools.emulator.cupy import compile_module, emulated  # noqa: E402
from modifier_checks import LARGE_SCALES, large_scores_check  # noqa: E402
from modifier_checks import check as check_modifiers  # noqa: E402
import sync_mutants  # noqa: E402

ORDERS = ("ascending", "descending")


def run(q, k, v, dout, *, causal, scale=None, out_layout=None, deterministic=False):
    """(out, lse, dq, dk, dv) from the emulated cupy backend; out and lse go back strided if asked."""
    out, lse = flashcupy.attention(q, k, v, causal=causal, scale=scale, return_lse=True, backend="cupy")
    if out_layout is not None:  # hand the backward an out and an lse in unusual layouts
        out2 = strided_empty(out.shape, out.dtype, out_layout)
        out2[...] = out
        lse2 = np.empty(lse.shape[::-1], lse.dtype).T  # (B, H, S) with the batch stride smallest
        lse2[...] = lse
        out, lse = out2, lse2
    grads = flashcupy.attention_backward(dout, q, k, v, out, lse, causal=causal, scale=scale, backend="cupy",
                                         deterministic=deterministic)
    return (out, lse, *grads)


def check(got, q, k, v, dout, *, causal, scale=None):
    out, lse, *grads = got
    assert out.dtype == q.dtype and lse.dtype == (np.float64 if q.dtype == np.float64 else np.float32)
    for g, x in zip(grads, (q, k, v)):
        assert g.dtype == x.dtype and g.shape == x.shape
    assert_matches_oracle(got, q, k, v, dout, causal=causal, scale=scale, backend="cupy")


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_layouts(rng, order, layout, dtype):
    """Transposed, sliced and negative-stride inputs (and out, lse) under a shuffled thread order."""
    q, k, v = make_qkv(rng, 2, 19, 37, 4, 2, 24, dtype, layout)
    dout = strided_empty(q.shape, dtype, layout)
    dout[...] = rng.standard_normal(q.shape)
    with emulated(order, seed=7):
        got = run(q, k, v, dout, causal=True, out_layout=layout)
    check(got, q, k, v, dout, causal=True)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("head_dim", [31, 33, 64, 129, 200])
def test_head_dims(rng, order, head_dim):
    """Head dims at and around the bucket edges (32, 64, 128, 256), with an explicit scale."""
    q, k, v = make_qkv(rng, 1, 9, 40, 2, 1, head_dim, np.float32)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    with emulated(order):
        got = run(q, k, v, dout, causal=False, scale=0.3)
    check(got, q, k, v, dout, causal=False, scale=0.3)


@pytest.mark.parametrize("order", ORDERS)
def test_fully_masked_rows_are_zero_not_nan(rng, order):
    # causal with seqlen_q > seqlen_k: rows 0..Sq-Sk-1 see no key
    q, k, v = make_qkv(rng, 1, 70, 5, 2, 2, 8, np.float16, magnitude=30.0)
    dout = rng.standard_normal(q.shape).astype(np.float16)
    with emulated(order):
        out, lse, dq, dk, dv = run(q, k, v, dout, causal=True)
    hidden = slice(0, 65)
    assert not np.isnan(out).any() and not np.isnan(dq).any()
    assert (out[:, hidden] == 0).all() and np.isneginf(lse[:, :, hidden]).all() and (dq[:, hidden] == 0).all()
    check((out, lse, dq, dk, dv), q, k, v, dout, causal=True)


def test_head_dim_beyond_256_is_refused(rng):
    q, k, v = make_qkv(rng, 1, 3, 3, 1, 1, 257, np.float32)
    with emulated(), pytest.raises(ValueError, match="head_dim must be at most 256 for the cupy backend"):
        flashcupy.attention(q, k, v, backend="cupy")


class _CountingModule:
    """A compiled module that counts the driver calls the backend makes through it."""

    def __init__(self, module, calls):
        self.module, self.calls = module, calls

    def get_function(self, name):
        self.calls.append(("get_function", name))
        function = self.module.get_function(name)
        calls = self.calls

        class Counted:
            def __call__(self, *args, **kwargs):
                return function(*args, **kwargs)

            @property
            def max_dynamic_shared_size_bytes(self):
                return function.max_dynamic_shared_size_bytes

            @max_dynamic_shared_size_bytes.setter
            def max_dynamic_shared_size_bytes(self, value):
                calls.append(("set_smem", name))
                function.max_dynamic_shared_size_bytes = value

        return Counted()


@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=["tensor-cores", "simt"])
def test_kernel_handles_are_fetched_once_per_module(rng, dtype):
    # fetching a function and raising its shared-memory limit are driver calls: once per
    # (device, module), not per launch
    calls = []

    def counting_compile(*args):
        return _CountingModule(compile_module(*args), calls)

    q, k, v = make_qkv(rng, 1, 70, 70, 2, 1, 64, dtype)
    dout = rng.standard_normal(q.shape).astype(dtype)
    with emulated(compile=counting_compile):
        for _ in range(3):
            check(run(q, k, v, dout, causal=True), q, k, v, dout, causal=True)
    modules = (specs.tc_forward_module, specs.tc_backward_module) if dtype == np.float16 else \
        (specs.forward_module, specs.backward_module)
    kernels = [kernel for build in modules for kernel in build(dtype, 64).kernels]
    assert sorted(n for what, n in calls if what == "get_function") == sorted(k.name_expression for k in kernels)
    assert sorted(n for what, n in calls if what == "set_smem") == sorted(
        k.name_expression for k in kernels if k.dynamic_smem > specs.SMEM_DEFAULT_LIMIT)


def test_import_does_not_need_cupy():
    code = ("import sys, flashcupy.backends.cupy_backend as b; "
            "assert 'cupy' not in sys.modules; print(b.unavailable_reason())")
    reason = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    try:
        import cupy  # noqa: F401
    except ImportError:
        assert "pip install flashcupy[cuda12]" in reason


def test_tensor_cores_compute_head_dim_rounded_up_to_16_on_the_tiles_of_its_bucket():
    # 72 computes 80 columns, not 128: a quarter of the mma on zeros saved at 96
    for head_dim, computed, bucket in ((8, 16, 64), (40, 48, 64), (64, 64, 64), (72, 80, 128), (96, 96, 128),
                                       (128, 128, 128)):
        for build, tiles in ((specs.tc_forward_module, specs.TC_TILES["forward", "plain"]),
                             (specs.tc_backward_module, specs.TC_TILES["dkdv", "dq_atomic"])):
            kernel = build("float16", head_dim).kernels[-1 if build is specs.tc_forward_module else 1]
            assert kernel.head_dim == computed and (kernel.block_m, kernel.block_n) == tiles[bucket]
            # shared-memory rows of 64 or 128 elements, what the bucket's kernel takes
            assert kernel.dynamic_smem == dataclasses.replace(kernel, head_dim=bucket).dynamic_smem


def test_every_specialization_is_in_the_tables():
    for module in catalog.all_modules():
        assert module.name_expressions
    for d in range(1, specs.MAX_HEAD_DIM + 1):
        assert specs.head_dim_bucket(d) >= d


# ----------------------------------------------------------------------------
# the emulator bites on these kernels


# Every barrier and cp.async wait in the kernels and their headers, found in the source: each removed
# in turn must make some test below give a wrong answer or an emulator error. The Hopper forward's
# (flash_*_sm90.cu, with their mbarriers, wgmma waits and fences) are test_hopper_kernels.py's.
KERNEL_FILES = sorted(f for f in os.listdir(sources.KERNEL_DIR) if not f.endswith("_sm90.cu"))
SYNC = re.compile(r"\b(?:__syncthreads|cp_async_wait<\d+>)\(\);")


def _sync_points():
    """(file, line number) of every __syncthreads() and cp_async_wait call in the kernel sources."""
    points = []
    for name in KERNEL_FILES:
        with open(os.path.join(sources.KERNEL_DIR, name), encoding="utf-8") as f:
            points += [(name, n) for n, line in enumerate(f, 1) if SYNC.search(line.split("//")[0])]
    return points


SYNC_POINTS = tuple(_sync_points())


def _guarded(name, lineno) -> dict:
    """{top-level kernel file: (its source, its guarded source)} of every non-Hopper kernel file whose text
    (headers inlined, as the backend compiles it) the call on line `lineno` of kernels/`name` reaches. Every
    sync point is guarded (sync_mutants.py); a test leaves this one out by its place in SYNC_POINTS."""
    pairs = sync_mutants.guarded(SYNC_POINTS, SYNC)
    return {f: pair for f, pair in sync_mutants.reached(pairs, SYNC_POINTS.index((name, lineno)) + 1).items()
            if f in KERNEL_FILES}


# What runs each kernel family, and the (thread order, cp.async mode) schedules to try. The
# tensor-core kernels' warps meet at warp collectives and move in lockstep under the plain orders:
# a missing end-of-pass barrier, which lets the next prefetch overwrite a stage still being read,
# shows only with the warps drifting apart (warp_skew) and the copies landing at issue (eager).
SYNC_PROBLEMS = {
    "simt": (np.float32, (1, 45, 70, 2, 1, 40, False), tuple((order, "deferred") for order in emulator.THREAD_ORDERS)),
    "tensor-core": (np.float16, (1, 70, 130, 2, 1, 64, True),  # GQA, causal: 3 key blocks, stages reused
                    (("ascending", "deferred"), ("descending", "deferred"), ("warp_skew", "deferred"),
                     ("warp_skew", "eager"))),
}
# flash_fwd_tc.cu's body also runs as the wide forward (head_dim 128: 8 warps, 32-key blocks): a sync point
# there must break it too, forward only
WIDE_SYNC_PROBLEM = (1, 70, 130, 2, 1, 128, True)


def _run_sync_problem(rng, path, order, cp_async, compile):
    """The sync problem of `path` ("simt", "tensor-core", "pairs" or "wide") in one schedule, the kernel
    sources compiled by `compile`: an AssertionError or the emulator's KernelError where it goes wrong."""
    if path == "wide":  # the wide forward, forward only
        B, Sq, Sk, Hq, Hkv, D, causal = WIDE_SYNC_PROBLEM
        q, k, v = make_qkv(rng, B, Sq, Sk, Hq, Hkv, D, np.float16)
        with emulated(order, cp_async=cp_async, compile=compile):
            got = flashcupy.attention(q, k, v, causal=causal, return_lse=True, backend="cupy")
            assert_matches_oracle(got, q, k, v, causal=causal, backend="cupy")
        return
    dtype, (B, Sq, Sk, Hq, Hkv, D, causal), _ = SYNC_PROBLEMS["simt" if path == "pairs" else path]
    q, k, v = make_qkv(rng, B, Sq, Sk, Hq, Hkv, D, dtype)
    dout = rng.standard_normal(q.shape).astype(dtype)
    bias = rng.standard_normal((1, 1, 1, Sk)).astype(dtype)
    with emulated(order, cp_async=cp_async, compile=compile):
        if path == "pairs":
            check_modifiers(q, k, v, dout, rows=np.arange(Sq), backend="cupy", causal=causal, bias=bias)
        else:
            check(run(q, k, v, dout, causal=causal), q, k, v, dout, causal=causal)
        if path == "tensor-core":  # and the deterministic backward's own dQ kernel
            check(run(q, k, v, dout, causal=causal, deterministic=True), q, k, v, dout, causal=causal)


def _compiling(mutants: dict):
    def compile(source, names, options, thread_order, seed, cp_async):
        return compile_module(mutants.get(source, source), names, options, thread_order, seed, cp_async)
    return compile


def test_the_guarded_kernels_pass_with_no_call_left_out(rng, monkeypatch):
    # every kernel file's guarded source (sync_mutants.py) with no call chosen, on every path's problem
    monkeypatch.delenv(sync_mutants.ENV, raising=False)
    pairs = {f: pair for f, pair in sync_mutants.guarded(SYNC_POINTS, SYNC).items() if f in KERNEL_FILES}
    assert set(pairs) == {"flash_fwd.cu", "flash_bwd.cu", "flash_pairs.cu", "flash_fwd_tc.cu", "flash_bwd_tc.cu"}
    compile = _compiling(dict(pairs.values()))
    for path in ("simt", "pairs", "tensor-core", "wide"):
        _run_sync_problem(rng, path, "warp_skew", "eager", compile)


@pytest.mark.parametrize("name, lineno", SYNC_POINTS, ids=[f"{n}:{i}" for n, i in SYNC_POINTS])
def test_each_barrier_and_wait_is_needed(rng, monkeypatch, name, lineno):
    """Without any one of the barriers and cp.async waits, some schedule gives a wrong answer (or the
    emulator reports copies left in flight at exit)."""
    changed = _guarded(name, lineno)
    assert changed, f"{name}:{lineno} is in no kernel file"
    monkeypatch.setenv(sync_mutants.ENV, str(SYNC_POINTS.index((name, lineno)) + 1))
    compile = _compiling(dict(changed.values()))
    # flash_pairs.cu runs only for attention_probs and a bias's gradient: a bias broadcast over
    # everything makes each dbias CTA take many passes and sum over its rows through shared memory
    paths = {"tensor-core" if f.endswith("_tc.cu") else "pairs" if f == "flash_pairs.cu" else "simt"
             for f in changed}
    wrong = []
    for path in sorted(paths):
        for order, cp_async in SYNC_PROBLEMS["simt" if path == "pairs" else path][2]:
            try:
                _run_sync_problem(rng, path, order, cp_async, compile)
            except (AssertionError, emulator.KernelError) as e:
                wrong.append((path, order, cp_async, e))
                break
    assert wrong, f"removing the call on {name}:{lineno} went unnoticed under every schedule"
    if "flash_fwd_tc.cu" in changed:
        for order, cp_async in SYNC_PROBLEMS["tensor-core"][2]:
            try:
                _run_sync_problem(rng, "wide", order, cp_async, compile)
            except (AssertionError, emulator.KernelError):
                break
        else:
            pytest.fail(f"removing the call on {name}:{lineno} went unnoticed by the wide forward")


@pytest.mark.parametrize("old, new, argument", [
    # the tile loader reads one row past seqlen
    ("(row0 + r < seqlen && d < head_dim) ? scale", "(row0 + r <= seqlen && d < head_dim) ? scale", "read"),
    # the output writer writes one row past seqlen
    ("if (row0 + r < seqlen && d < head_dim) store", "if (row0 + r <= seqlen && d < head_dim) store", "write"),
])
def test_off_by_one_is_out_of_bounds(rng, old, new, argument):
    q, k, v = make_qkv(rng, 1, 17, 17, 1, 1, 32, np.float32)
    with emulated(compile=mutated_compile(old, new)), pytest.raises(emulator.OutOfBoundsError) as info:
        flashcupy.attention(q, k, v, backend="cupy")
    assert info.value.access == argument


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=["tensor-cores", "simt"])
def test_nan_in_a_query_row_stays_in_that_row(rng, order, dtype):
    q, k, v = make_qkv(rng, 1, 20, 30, 2, 1, 64, dtype)
    q[0, 5, 1, 3] = np.nan
    with emulated(order):
        out, lse = flashcupy.attention(q, k, v, return_lse=True, backend="cupy")
    np.testing.assert_array_equal(np.isnan(out), np.isnan(reference.attention(q, k, v)))
    assert np.isnan(out[0, 5, 1]).all() and np.isnan(lse[0, 1, 5])
    assert np.isfinite(np.delete(out, 5, axis=1)).all() and np.isfinite(out[0, 5, 0]).all()


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=["tensor-cores", "simt"])
def test_nan_in_dout_of_a_row_that_sees_no_key_goes_nowhere(rng, dtype, order):
    # causal, 100 queries and 40 keys: rows 0..59 see no key, and the query block holding row 59
    # also holds rows that do, so its dS must be 0 there by selection, not by P = 0 times NaN
    q, k, v = make_qkv(rng, 1, 100, 40, 2, 1, 64, dtype)
    dout = rng.standard_normal(q.shape).astype(dtype)
    dout[:, :60] = np.nan
    with emulated(order):
        out, lse = flashcupy.attention(q, k, v, causal=True, return_lse=True, backend="cupy")
        grads = flashcupy.attention_backward(dout, q, k, v, out, lse, causal=True, backend="cupy")
    assert np.all(grads[0][:, :60] == 0)
    check((out, lse, *grads), q, k, v, dout, causal=True)


# ----------------------------------------------------------------------------
# random problems through both kernel paths


@settings(max_examples=25, deadline=None)
@given(
    B=st.integers(1, 2), Sq=st.integers(1, 70), Sk=st.integers(1, 70), Hkv=st.integers(1, 2),
    group=st.integers(1, 2), D=st.sampled_from([1, 8, 40, 64, 72, 128, 200]), causal=st.booleans(),
    dtype=st.sampled_from(["float16", "bfloat16", "float32", "float64"]), layout=st.sampled_from(LAYOUTS),
    order=st.sampled_from(emulator.THREAD_ORDERS), seed=st.integers(0, 2**16),
)
def test_property_matches_oracle(B, Sq, Sk, Hkv, group, D, causal, dtype, layout, order, seed):
    """Any shape, dtype and layout, on whichever path the backend picks (tensor cores or SIMT)."""
    rng = np.random.default_rng(seed)
    value_dtype = BF16 if dtype == "bfloat16" else np.dtype(dtype)
    q, k, v = make_qkv(rng, B, Sq, Sk, Hkv * group, Hkv, D, value_dtype, layout)
    dout = strided_empty(q.shape, value_dtype, layout)
    dout[...] = rng.standard_normal(q.shape)
    values = q, k, v, dout
    kw = dict(causal=causal, backend="cupy")
    if dtype == "bfloat16":  # as CuPy users pass it
        q, k, v, dout = (bf16_bits(x) for x in (q, k, v, dout))
        kw["dtype"] = "bfloat16"
    with emulated(order, seed=seed):
        out, lse = flashcupy.attention(q, k, v, return_lse=True, **kw)
        grads = flashcupy.attention_backward(dout, q, k, v, out, lse, **kw)
    assert_matches_oracle((out, lse, *grads), *values, causal=causal, backend="cupy")


@pytest.mark.parametrize("kw", [{}, dict(bias=True), dict(window=(2, 3))], ids=["plain", "bias", "window"])
@pytest.mark.parametrize("dtype, scale", LARGE_SCALES, ids=lambda x: np.dtype(x).name if isinstance(x, type) else f"{x:g}")
def test_scores_whose_rounding_exceeds_one_keep_the_gradients_finite(dtype, scale, kw, monkeypatch):
    """The SIMT kernels at scales inside the accumulation dtype's range that make scores of inputs of
    0.5 far larger than 1 / its roundoff (issue 31): the dK/dV kernel's Sᵀ = K Qᵀ, summed in another
    order than the forward's S, put s - lse far above 0, P at inf and dk, dv at NaN or inf."""
    monkeypatch.setattr(cupy_backend, "USE_TENSOR_CORES", False)
    with emulated():
        large_scores_check("cupy", dtype, scale, **kw)


# Deliberate bugs in the SIMT kernels (conftest.MUTATION_BATTERY, float32): each must fail the battery.
# mask.cuh's (conftest.MASK_CUH_MUTATIONS) are shared with the tensor-core kernels' battery.
SIMT_MUTATIONS = {
    **MASK_CUH_MUTATIONS,
    "scale ignored": ("blk.i0, seqlen_q, head_dim, scale);", "blk.i0, seqlen_q, head_dim, Acc(1) / sqrt(Acc(head_dim)));"),
    "D not subtracted": ("dP[r] = ds(score, S[r], drop.times(dP[r], z), D_i, t);",
                         "dP[r] = ds(score, S[r], drop.times(dP[r], z), Acc(0), t);"),
    "lse base": ("m[r] + acc_log(l[r]);", "m[r] + acc_log(l[r]) / acc_log(Acc(2));"),
}


test_the_mutation_battery_passes_unmutated, test_a_mutation_is_caught = mutation_tests(
    SIMT_MUTATIONS, "cupy", lambda old, new: emulated(compile=mutated_compile(old, new)), plain=emulated,
    cases=MUTATION_BATTERY + (TILE_EDGE_CASE,))
