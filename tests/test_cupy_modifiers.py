"""Score modifiers (issue 13) in the cupy backend's kernels, SIMT and tensor-core, under the emulator.

Window, softcap, ALiBi, bias (with dbias) and bool masks, alone and together, forward, backward and
attention_probs, through backend="cupy" on NumPy arrays (flashcupy/tools/emulator/cupy.py), against the
float64 oracle by the one tolerance rule (modifier_checks.check, conftest.assert_matches_oracle),
under two thread orders. The cases are modifier_checks.py's (the NumPy backend's too): window edges inside
tiles and across them, GQA, causal with a window, rows that see no key, every broadcast shape of a
bias; each asserts the kernel path it meant to take. The last tests make deliberate off-by-one bugs
in the window's bounds (mask.cuh) and bugs in the bias and mask paths, and check that the cases here
catch each of them.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from conftest import BF16, assert_matches_oracle, bf16_bits, make_qkv, mutated_compile
from modifier_checks import check, modifier_cases, rows_that_see_no_key_ignore_dlse

import flashcupy
from flashcupy import _api
from flashcupy._problem import MODIFIERS
from flashcupy.backends import cupy_backend
from flashcupy.backends.cupy_backend import specs
from flashcupy.tools.emulator.cupy import compile_module, emulated, launch_records, recording
from flashcupy.tools.emulator.driver import CompileError

ORDERS = ("ascending", "descending")


def cases(rng, shape, dtype):
    """modifier_checks' cases, and a softcap far above the scores (acc_tanh's polynomial)."""
    return dict(modifier_cases(rng, shape, dtype), **{"softcap-far-above-the-scores": dict(softcap=1e3)})


# The NumPy backend's cases but three that add nothing here (the window's right side under causal is
# the interface's, softcap with causal and a (1, H, S, S) bias are covered by "all" and "bias")
CASE_NAMES = [name for name in cases(np.random.default_rng(0), (2, 9, 9, 2, 1, 8), np.float32)
              if name not in ("causal-window-right-ignored", "softcap-causal", "bias-1HSS")]


def assert_path(q, k, v, path, dtype=None, **kw):
    p = flashcupy._checks.problem(q, k, v, kw.get("causal", False), None, dtype, "numpy",
                                **{m: kw.get(m) for m in MODIFIERS})
    assert cupy_backend.forward_path(p, q, k, v) == path


def run_cupy(q, k, v, dout, path, order, bits=False, compile=compile_module, **kw):
    """(out, lse, dq, dk, dv[, dbias]) from the emulated cupy backend, asserting the kernel path taken."""
    call = dict(kw, dtype="bfloat16") if bits else kw
    if bits:
        q, k, v, dout = (bf16_bits(x) for x in (q, k, v, dout))
    with emulated(order, compile=compile, compute_capability=DEVICE[path]):
        assert_path(q, k, v, path, call.get("dtype"), **kw)
        out, lse = flashcupy.attention(q, k, v, return_lse=True, backend="cupy", **call)
        grads = flashcupy.attention_backward(dout, q, k, v, out, lse, backend="cupy", **call)
    return out, lse, *grads


def check_cupy(q, k, v, dout, path, order, bits=False, **kw):
    """modifier_checks.check on the emulated cupy backend (attention_probs of a few rows included)."""
    with emulated(order, compute_capability=DEVICE[path]):
        assert_path(*((bf16_bits(x) for x in (q, k, v)) if bits else (q, k, v)), path, "bfloat16" if bits else None,
                    **(dict(kw, bias=bf16_bits(kw["bias"])) if bits and "bias" in kw and kw["bias"].dtype == BF16 else kw))
        rows = np.array([q.shape[1] - 1, 0, 5, -1, 20])
        return check(q, k, v, dout, bits=bits, rows=rows, backend="cupy", **kw)


def deterministic_backward(monkeypatch):
    """Make the cupy backend's backward take deterministic=True whatever the call says."""
    backward = cupy_backend.backward
    monkeypatch.setattr(cupy_backend, "backward", lambda *a, **kw: backward(*a, **dict(kw, deterministic=True)))


# "hopper": the Hopper forward and backward (every modifier in one batch, specs.SM90_FORWARD_MODS,
# SM90_BACKWARD_MODS) on an emulated sm_90
DEVICE = {"hopper": specs.SM90_COMPUTE_CAPABILITY, "tensor-core": 80, "simt": 80}


@pytest.fixture(params=["hopper", "tensor-core", "simt"])
def path(request, monkeypatch):
    monkeypatch.setattr(cupy_backend, "USE_TENSOR_CORES", request.param != "simt")
    return request.param


# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim): GQA, lengths no tile divides, Sq < Sk.
# The SIMT tiles are 32 to 64 rows: a window of a few keys starts and ends inside tiles, and with 45
# keys crosses a tile edge. The tensor-core tiles are 64: 80 x 100 makes two query blocks and two key
# blocks, and the narrow windows leave some tiles wholly outside the band.
SIMT_SHAPE = (2, 37, 45, 4, 2, 16)
TC_SHAPE = (1, 80, 100, 4, 2, 64)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("name", CASE_NAMES)
def test_modifier_matches_the_oracle(rng, path, name, order):
    shape, dtype = (TC_SHAPE, np.float16) if path != "simt" else (SIMT_SHAPE, np.float32)
    q, k, v = make_qkv(rng, *shape, dtype)
    dout = rng.standard_normal(q.shape).astype(dtype)
    check_cupy(q, k, v, dout, path, order, **cases(rng, shape, dtype)[name])


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("name", ["all", "all-causal"])
def test_modifiers_in_bfloat16_bits(rng, path, name, order):
    shape = TC_SHAPE if path != "simt" else SIMT_SHAPE[:5] + (64,)
    q, k, v = make_qkv(rng, *shape, BF16)
    dout = rng.standard_normal(q.shape).astype(BF16)
    check_cupy(q, k, v, dout, path, order, bits=True, **cases(rng, shape, BF16)[name])


def test_return_dbias_false_launches_no_dbias_kernel(rng, path):
    # a bias held constant (attention_backward(..., return_dbias=False), what torch autograd and
    # flashcupy.jax ask for where the bias has no gradient): dq, dk, dv as the oracle's, and no
    # flash_bwd_dbias launch, which would compute S and dP once more
    shape, dtype = (TC_SHAPE, np.float16) if path != "simt" else (SIMT_SHAPE, np.float32)
    q, k, v = make_qkv(rng, *shape, dtype)
    dout = rng.standard_normal(q.shape).astype(dtype)
    kw = cases(rng, shape, dtype)["all-causal"]
    launches = []
    with emulated(compute_capability=DEVICE[path], compile=launch_records(launches)):
        out, lse = flashcupy.attention(q, k, v, return_lse=True, backend="cupy", **kw)
        launches.clear()
        grads = flashcupy.attention_backward(dout, q, k, v, out, lse, backend="cupy", return_dbias=False, **kw)
    names = [name for name, _ in launches]
    assert len(grads) == 3 and names and not any("dbias" in name for name in names), names
    assert_matches_oracle((out, lse, *grads), q, k, v, dout, backend="cupy", **kw)
    # dq alone (flashcupy.jax's forward mode): the D pre-pass and the deterministic dQ kernel of the
    # mma.sync or SIMT kernels (on Hopper too), no dK/dV kernel
    launches.clear()
    with emulated(compute_capability=DEVICE[path], compile=launch_records(launches)):
        (dq,) = _api.backward(dout, q, k, v, out, lse, backend="cupy", dq_only=True, **kw)
    names = [name for name, _ in launches]
    assert len(names) == 2 and "preprocess" in names[0] and "dq" in names[1] and "sm90" not in names[1], names
    assert_matches_oracle((out, lse, dq), q, k, v, dout, backend="cupy", **kw)


def test_rows_that_see_no_key_ignore_their_dlse(rng, path):
    # dlse NaN in the rows a mask hides wholly: D is NaN there, and every kernel selects dS = 0
    with emulated(compute_capability=DEVICE[path]):
        rows_that_see_no_key_ignore_dlse(rng, "cupy", np.float16 if path != "simt" else np.float32)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("dtype", [np.float64, np.float16], ids=["float64", "float16-simt"])
def test_modifiers_in_other_simt_dtypes(rng, dtype, order, monkeypatch):
    # float64: a float32 bias, and slopes in the accumulation dtype, per (batch, head)
    monkeypatch.setattr(cupy_backend, "USE_TENSOR_CORES", False)
    q, k, v = make_qkv(rng, *SIMT_SHAPE, dtype)
    dout = rng.standard_normal(q.shape).astype(dtype)
    kw = cases(rng, SIMT_SHAPE, dtype)["all"]
    if dtype == np.float64:
        kw["alibi_slopes"] = rng.uniform(0.05, 0.5, (SIMT_SHAPE[0], SIMT_SHAPE[3]))
    check_cupy(q, k, v, dout, "simt", order, **kw)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("dtype, head_dim, path, tiles", [
    (np.float64, 64, "simt", {"flash_bwd_dq": (16, 16)}),  # specs.MODIFIED_TILES
    (np.float32, 128, "simt", {"flash_bwd_dkdv": (16, 16)}),  # specs.MODIFIED_TILES
    (np.float16, 128, "tensor-core", {"flash_bwd_dkdv_tc": (16, 64)}),  # specs.TC_TILES["dkdv", "score"]
    (np.float16, 64, "tensor-core", {"flash_bwd_dq_tc": (64, 32)}),  # specs.TC_TILES["dq", "score"]
])
def test_the_tiles_modifiers_take_where_the_plain_ones_spill(rng, dtype, head_dim, path, tiles, order,
                                                               monkeypatch):
    monkeypatch.setattr(cupy_backend, "USE_TENSOR_CORES", path == "tensor-core")
    # the tensor-core dQ kernel runs in the deterministic backward
    build = specs.deterministic_tc_backward_module if path == "tensor-core" else specs.backward_module
    if path == "tensor-core":
        deterministic_backward(monkeypatch)
    got_tiles = {k.template: (k.block_m, k.block_n) for k in build(dtype, head_dim, specs.ALL_MODS).kernels}
    assert tiles.items() <= got_tiles.items()
    # SIMT tiles for any modifier, the window alone included (the tensor-core ones for softcap or ALiBi)
    if path == "simt":
        assert tiles.items() <= {k.template: (k.block_m, k.block_n) for k in build(dtype, head_dim, 1).kernels}.items()
    shape = (1, 70, 75, 2, 1, head_dim)
    q, k, v = make_qkv(rng, *shape, dtype)
    dout = rng.standard_normal(q.shape).astype(dtype)
    check_cupy(q, k, v, dout, path, order, **cases(rng, shape, dtype)["all"])


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("Sq, Sk, window, causal", [
    (70, 9, (0, 0), False),     # Sq > Sk: rows 0..60 see no key (and neither do whole query blocks)
    (9, 70, (2, 1), False),     # Sq < Sk: keys 0..58 are seen by no row (whole key blocks skipped)
    (70, 70, (0, None), True),  # the diagonal only
    (70, 30, (3, None), True),  # causal, Sq > Sk: a window below the diagonal, rows before it see nothing
])
def test_windows_past_the_ends_and_rows_that_see_no_key(rng, path, Sq, Sk, window, causal, order):
    dtype = np.float16 if path != "simt" else np.float32
    q, k, v = make_qkv(rng, 1, Sq, Sk, 2, 1, 64, dtype)
    dout = rng.standard_normal(q.shape).astype(dtype)
    dout[:, :Sq - Sk] = np.nan  # where a row sees no key, its dout reaches nothing
    kw = dict(window=window, causal=causal, softcap=3.0)
    out, lse, dq, dk, dv = run_cupy(q, k, v, dout, path, order, **kw)
    hidden = ~np.isfinite(lse)
    assert hidden.any() or Sq <= Sk
    assert (out.transpose(0, 2, 1, 3)[hidden] == 0).all() and (dq.transpose(0, 2, 1, 3)[hidden] == 0).all()
    assert not any(np.isnan(g).any() for g in (dq, dk, dv))
    dout = np.nan_to_num(dout)  # the oracle's own dout: the NaN rows see no key, so this changes nothing
    assert_matches_oracle((out, lse, dq, dk, dv), q, k, v, dout, backend="cupy", **kw)


@pytest.mark.parametrize("path, deterministic, kernel", [
    ("hopper", False, "flash_bwd_dkdv_sm90"),  # dO_i's rows zeroed in shared memory, D 0 (dead_rows)
    ("hopper", True, "flash_bwd_dkdv_sm90"),
    ("tensor-core", False, "flash_bwd_dq_convert"),  # dQ added with atomics inside the dK/dV kernel
    ("tensor-core", True, "flash_bwd_dq_tc"),
    ("simt", True, "flash_bwd_dq"),
])
def test_rows_the_mask_hides_add_nothing_whatever_their_dout_holds(rng, monkeypatch, path, deterministic, kernel):
    """A row the bool mask leaves no key lies inside tiles of rows that see keys: its dq is 0 and it adds
    nothing to dk, dv or dbias, whatever its dout holds (README, Semantics: fully masked rows), on every
    kernel path, the tensor-core backward with dq by atomics and without. (The mask is the one
    modifier that hides a whole row inside the query blocks the mma.sync and SIMT kernels' key blocks
    visit: causal and windows start them at the first row that sees it. The Hopper backward's start at
    a multiple of 64: test_hopper_kernels.py's test_rows_that_see_no_key_add_nothing_...)"""
    monkeypatch.setattr(cupy_backend, "USE_TENSOR_CORES", path != "simt")
    dtype = np.float16 if path != "simt" else np.float32
    B, Sq, Sk, Hq = 2, 20, 70, 2  # two key blocks on both paths; GQA
    q, k, v = make_qkv(rng, B, Sq, Sk, Hq, 1, 64, dtype)
    mask = rng.random((B, Hq, Sq, Sk)) < 0.8
    mask[1, 1, 5] = mask[0, 0, 19] = False
    bias = rng.standard_normal((1, Hq, Sq, Sk)).astype(np.float32)  # dbias sums the hidden row with one that sees
    dout = rng.standard_normal(q.shape).astype(dtype)
    dout[1, 5, 1, 7] = dout[0, 19, 0] = np.nan
    names = []
    with emulated(compile=recording(names), compute_capability=DEVICE[path]):
        out, lse = flashcupy.attention(q, k, v, mask=mask, bias=bias, return_lse=True, backend="cupy")
        grads = flashcupy.attention_backward(dout, q, k, v, out, lse, mask=mask, bias=bias, backend="cupy",
                                             deterministic=deterministic)
    assert any(name.startswith(kernel + "<") for name in names), names
    assert np.isneginf(lse[1, 1, 5]) and np.isneginf(lse[0, 0, 19])
    assert [int(np.isnan(g).sum()) for g in grads] == [0, 0, 0, 0]
    assert np.all(grads[0][1, 5, 1] == 0) and np.all(grads[0][0, 19, 0] == 0)
    assert_matches_oracle((out, lse, *grads), q, k, v, dout, mask=mask, bias=bias, backend="cupy")


def test_modifiers_choose_their_own_specialisation(rng):
    # a call without modifiers launches the kernels it launched before modifiers existed (MODS left
    # out); each set of modifiers launches its own (the MODS template argument, after the tile and
    # MIN_CTAS, launch.Bounds)
    names = []
    q, k, v = make_qkv(rng, 1, 9, 9, 1, 1, 16, np.float32)
    with emulated(compile=recording(names)):
        flashcupy.attention(q, k, v, causal=True, backend="cupy")
        flashcupy.attention(q, k, v, window=(2, 0), softcap=1.0, backend="cupy")
    assert names == ["flash_fwd<float, float, 32, 64, 32, 3>", "flash_fwd<float, float, 32, 64, 32, 3, 3>"]
    assert specs.mods_of(MODIFIERS) == specs.ALL_MODS == 31


# ----------------------------------------------------------------------------
# deliberate bugs in the window's bounds (mask.cuh): each must fail some case here

WINDOW_MUTATIONS = {
    "visible: left bound off by one": ("j >= i + diagonal - left &&", "j > i + diagonal - left &&"),
    "visible: right bound off by one": ("j <= i + diagonal + right;", "j < i + diagonal + right;"),
    "key_start one key late": ("return max(0, i0 + diagonal - left);", "return max(0, i0 + diagonal - left + 1);"),
    "key_end one key early": ("last_row + diagonal + right + 1", "last_row + diagonal + right"),
    "query_start one row late": ("return max(0, j0 - diagonal - right);", "return max(0, j0 - diagonal - right + 1);"),
    "query_end one row early": ("- diagonal + left);", "- diagonal + left - 1);"),
    "partial misses the left edge": ("j0 < i0 + BLOCK_M - 1 + diagonal - left",
                                     "j0 < i0 + BLOCK_M - 2 + diagonal - left"),
}


# (path, dtype, shape, window): the band's edges fall inside tiles, one key or row into a tile, and
# across tile edges, for every bound; the tensor-core kernels mask only the tiles partial() names.
# A key range off by one at its end shows only where the range ends one key into a tile, in a query
# block before the last (the last one's range ends at seqlen_k): 70 x 70 with right = 1 gives the
# SIMT forward's first block (64 rows, 32-key tiles) 65 keys, and 130 x 130 the tensor-core one's
# (64 x 64 tiles) 65 keys with right = 1.
MUTATION_CASES = (
    ("simt", np.float32, (1, 40, 45, 2, 1, 16), (5, 3)),
    ("simt", np.float32, (1, 45, 40, 2, 1, 16), (1, 0)),
    ("simt", np.float32, (1, 70, 70, 2, 1, 16), (40, 1)),
    ("tensor-core", np.float16, (1, 130, 130, 2, 1, 64), (63, 1)),
    # the first query block's last row alone does not see key 0: partial() must name that tile
    ("tensor-core", np.float16, (1, 130, 130, 2, 1, 64), (62, 64)),
    ("tensor-core", np.float16, (1, 130, 130, 2, 1, 64), (64, 0)),
    ("tensor-core", np.float16, (1, 130, 130, 2, 1, 64), (1, 64)),
    ("tensor-core", np.float16, (1, 100, 80, 2, 1, 64), (3, 17)),
)


def any_fails(attempts) -> bool:
    """Whether some attempt of `attempts` (callables that run a case and check it) raises: a wrong
    answer, or a read outside the arrays (the emulator's guards). A mutation that does not compile
    catches nothing: its CompileError propagates."""
    for attempt in attempts:
        try:
            attempt()
        except CompileError:
            raise
        except Exception:
            return True
    return False


def mutation_battery_fails(compile, monkeypatch) -> bool:
    rng = np.random.default_rng(1)

    def attempt(path, dtype, shape, window):
        monkeypatch.setattr(cupy_backend, "USE_TENSOR_CORES", path == "tensor-core")
        q, k, v = make_qkv(rng, *shape, dtype)
        dout = rng.standard_normal(q.shape).astype(dtype)
        got = run_cupy(q, k, v, dout, path, "ascending", compile=compile, window=window)
        assert_matches_oracle(got, q, k, v, dout, window=window, backend="cupy")

    return any_fails(functools.partial(attempt, *case) for case in MUTATION_CASES)


def battery_tests(fails, mutations):
    """The two tests of a battery of deliberate bugs, `fails(compile, monkeypatch)`: it passes on the
    kernels as they are, and fails with each mutation {name: (old, new)} applied."""
    def passes_unmutated(monkeypatch):
        assert not fails(compile_module, monkeypatch)

    @pytest.mark.parametrize("name", list(mutations))
    def catches(name, monkeypatch):
        assert fails(mutated_compile(*mutations[name]), monkeypatch), f"missed: {name}"

    return passes_unmutated, catches


test_the_window_battery_passes_unmutated, test_a_window_bug_is_caught = battery_tests(
    mutation_battery_fails, WINDOW_MUTATIONS)


# ----------------------------------------------------------------------------
# deliberate bugs in the bias, mask and attention_probs paths (and the tensor-core dQ kernel's
# softcap): each must fail some case here

PAIR_MUTATIONS = {
    "bias read with its strides swapped": ("min(i, last_q) * s_q + min(j, last_k) * s_k",
                                           "min(i, last_q) * s_k + min(j, last_k) * s_q"),
    "bias not in base 2 on tensor cores": ("s += unit * (bias_f32", "s += (bias_f32"),
    # tc_final_scores (tc_tile.cuh): the mma.sync and Hopper forwards'
    "tensor-core forward masks only partial tiles": ("if (TILE_MASKED(MODS, i0, j0))", "if (mask.partial(i0, j0))"),
    "tensor-core dQ masks only partial tiles": ("const bool partial = TILE_MASKED(MODS, blk.i0, j0);",
                                                "const bool partial = mask.partial(blk.i0, j0);"),
    "dbias not summed over keys": ("acc[r] = group_sum<BLOCK_N>(acc[r]);", "acc[r] = acc[r];"),
    "dbias row sum misses a warp": ("for (int w = 0; w < NUM_WARPS; ++w)", "for (int w = 1; w < NUM_WARPS; ++w)"),
    "probs subtract the lse of the asked index": ("prob(s - lse_for_p(lse_row, i,",
                                                  "prob(s - lse_for_p(lse_row, n,"),
    "tensor-core dQ drops the softcap's derivative": (
        "dp = hidden ? 0.0f : ds(score, P, drop(dp, row_w + r, j0 + c), D_r[r / 8], t);",
        "dp = hidden ? 0.0f : P * (drop(dp, row_w + r, j0 + c) - D_r[r / 8]);"),
}

# (path, case of modifier_checks.modifier_cases): a full bias, one summed over rows, one over keys, masks;
# the tensor-core backward both ways (its dQ kernel runs only when deterministic), and that dQ kernel
# with a softcap (the other kernels' softcap derivative fails test_modifier_matches_the_oracle)
PAIR_CASES = (("simt", "bias"), ("simt", "bias-B11S"), ("simt", "bias-11S1-float32"),
              ("tensor-core", "mask"), ("tensor-core", "bias"), ("tensor-core-deterministic", "mask"),
              ("tensor-core-deterministic", "softcap"))


def pair_battery_fails(compile, monkeypatch) -> bool:
    rng = np.random.default_rng(2)

    def attempt(path, name):
        monkeypatch.setattr(cupy_backend, "USE_TENSOR_CORES", path.startswith("tensor-core"))
        if path == "tensor-core-deterministic":
            deterministic_backward(monkeypatch)
        shape, dtype = (TC_SHAPE, np.float16) if path.startswith("tensor-core") else (SIMT_SHAPE, np.float32)
        q, k, v = make_qkv(rng, *shape, dtype)
        dout = rng.standard_normal(q.shape).astype(dtype)
        with emulated("ascending", compile=compile):
            check(q, k, v, dout, rows=np.array([shape[1] - 1, 0, 5]), backend="cupy", **cases(rng, shape, dtype)[name])

    return any_fails(functools.partial(attempt, *case) for case in PAIR_CASES)


test_the_bias_and_mask_battery_passes_unmutated, test_a_bias_or_mask_bug_is_caught = battery_tests(
    pair_battery_fails, PAIR_MUTATIONS)
