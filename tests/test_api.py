"""Argument checking: every bad input is refused before any work, with a message
that names the argument, what was expected and what was got."""

import types

import numpy as np
import pytest

import flashcupy
from flashcupy.backends import BackendUnavailableError

F32 = np.float32


def qkv(B=1, Sq=4, Sk=4, Hq=2, Hkv=2, D=8, dtype=F32):
    return (np.zeros((B, Sq, Hq, D), dtype), np.zeros((B, Sk, Hkv, D), dtype),
            np.zeros((B, Sk, Hkv, D), dtype))


def fake_cupy(shape, dtype=F32):
    """Something the library check takes for a cupy.ndarray of this shape."""
    class FakeCupyArray:
        __cuda_array_interface__ = {"data": (0, False)}

    FakeCupyArray.__module__ = "cupy._core.core"
    x = FakeCupyArray()
    x.shape, x.ndim, x.dtype = shape, len(shape), np.dtype(dtype)
    x.strides = tuple(int(np.prod(shape[i + 1:])) * x.dtype.itemsize for i in range(len(shape)))
    return x


BAD_FORWARD = [
    # (description, args, kwargs, exception, words the message must contain)
    ("rank", lambda: (np.zeros((4, 2, 8), F32),) + qkv()[1:], {}, ValueError, ["q", "rank at least 4", "(4, 2, 8)"]),
    ("batch", lambda: (qkv(B=2)[0],) + qkv(B=3)[1:], {}, ValueError, ["batch", "2", "3"]),
    ("head_dim", lambda: (qkv(D=8)[0],) + qkv(D=16)[1:], {}, ValueError, ["head_dim", "8", "16"]),
    ("gqa", lambda: (qkv(Hq=3)[0],) + qkv(Hkv=2)[1:], {}, ValueError, ["multiple", "heads_q=3", "heads_kv=2"]),
    ("kv length", lambda: qkv(Sk=4)[:2] + (qkv(Sk=5)[2],), {}, ValueError, ["k and v", "(1, 4, 2, 8)", "(1, 5, 2, 8)"]),
    ("scale nan", lambda: qkv(), {"scale": float("nan")}, ValueError, ["scale", "nan"]),
    ("scale inf", lambda: qkv(), {"scale": float("inf")}, ValueError, ["scale", "inf"]),
    ("scale zero", lambda: qkv(), {"scale": 0.0}, ValueError, ["scale", "positive", "0.0"]),
    ("scale negative", lambda: qkv(), {"scale": -1}, ValueError, ["scale", "-1"]),
    ("scale string", lambda: qkv(), {"scale": "0.1"}, TypeError, ["scale", "str"]),
    ("backend", lambda: qkv(), {"backend": "torch"}, ValueError, ["backend", "'torch'", "'numpy'"]),
    ("list input", lambda: ([[1.0]],) + qkv()[1:], {}, TypeError, ["q", "numpy.ndarray", "list"]),
    ("int dtype", lambda: (np.zeros((1, 4, 2, 8), np.int32),) + qkv()[1:], {}, TypeError, ["q", "float16, float32, float64 or bfloat16", "int32"]),
    ("mixed dtype", lambda: qkv(dtype=F32)[:2] + (qkv(dtype=np.float64)[2],), {}, TypeError, ["v is float64", "q is float32"]),
    ("causal type", lambda: qkv(), {"causal": "yes"}, TypeError, ["causal", "bool", "str"]),
    ("bf16 bits without dtype", lambda: qkv(dtype=np.uint16), {}, TypeError, ["q", "uint16", "dtype='bfloat16'"]),
    ("bf16 dtype on floats", lambda: qkv(), {"dtype": "bfloat16"}, TypeError, ["q", "uint16 or int16", "float32"]),
    ("unknown dtype", lambda: qkv(), {"dtype": "float8"}, ValueError, ["dtype", "'bfloat16'", "'float8'"]),
    ("head_dim 0", lambda: qkv(D=0), {}, ValueError, ["head_dim", "at least 1", "0"]),
    ("scale overflows float32", lambda: qkv(), {"scale": 1e39}, ValueError, ["scale", "float32", "1e+39"]),
    ("scale overflows in exp2", lambda: qkv(), {"scale": 3e38}, ValueError, ["scale", "float32", "3e+38"]),
    ("scale underflows float32", lambda: qkv(), {"scale": 1e-50}, ValueError, ["scale", "float32", "1e-50"]),
    ("return_lse type", lambda: qkv(), {"return_lse": "no"}, TypeError, ["return_lse", "bool", "str"]),
    ("masked array", lambda: (np.ma.masked_array(qkv()[0]),) + qkv()[1:], {}, TypeError, ["q", "MaskedArray", "mask"]),
    ("big-endian", lambda: qkv(dtype=">f8"), {}, TypeError, ["q", "native byte order", ">f8"]),
    # score modifiers (README, Semantics), for q (1, 4, 2, 8): full bias shape (1, 2, 4, 4)
    ("window negative", lambda: qkv(), {"window": (-1, 2)}, ValueError, ["window", "int >= 0", "-1", "left"]),
    ("window past int64", lambda: qkv(), {"window": (2, 2 ** 70)}, ValueError, ["window", "2**63", "right"]),
    ("window bool", lambda: qkv(), {"window": (3, True)}, TypeError, ["window", "bool", "right"]),
    ("window float", lambda: qkv(), {"window": (1.5, None)}, TypeError, ["window", "float", "1.5"]),
    ("window not a pair", lambda: qkv(), {"window": 3}, TypeError, ["window", "(left, right)", "int"]),
    ("window of three", lambda: qkv(), {"window": (1, 2, 3)}, TypeError, ["window", "(left, right)", "(1, 2, 3)"]),
    ("softcap zero", lambda: qkv(), {"softcap": 0.0}, ValueError, ["softcap", "positive", "0.0"]),
    ("softcap negative", lambda: qkv(), {"softcap": -2}, ValueError, ["softcap", "positive", "-2"]),
    ("softcap inf", lambda: qkv(), {"softcap": float("inf")}, ValueError, ["softcap", "finite", "inf"]),
    ("softcap nan", lambda: qkv(), {"softcap": float("nan")}, ValueError, ["softcap", "finite", "nan"]),
    ("softcap string", lambda: qkv(), {"softcap": "30"}, TypeError, ["softcap", "real number", "str"]),
    ("softcap bool", lambda: qkv(), {"softcap": True}, TypeError, ["softcap", "real number", "bool"]),
    ("softcap overflows float32", lambda: qkv(), {"softcap": 1e39}, ValueError, ["softcap", "float32", "1e+39"]),
    ("alibi shape", lambda: qkv(), {"alibi_slopes": np.ones(3, F32)}, ValueError,
     ["alibi_slopes", "(heads_q,) = (2,)", "(batch, heads_q) = (1, 2)", "(3,)"]),
    ("alibi dtype", lambda: qkv(), {"alibi_slopes": np.ones(2, np.float64)}, TypeError,
     ["alibi_slopes", "float32", "float64"]),
    ("alibi list", lambda: qkv(), {"alibi_slopes": [0.5, 0.25]}, TypeError, ["alibi_slopes", "numpy", "list"]),
    ("alibi other library", lambda: qkv(), {"alibi_slopes": fake_cupy((2,))}, TypeError,
     ["alibi_slopes is cupy", "q is numpy", "one array library"]),
    ("bias rank", lambda: qkv(), {"bias": np.zeros((1, 1, 2, 4, 4), F32)}, ValueError,
     ["bias", "rank at most 4", "(1, 2, 4, 4)", "(1, 1, 2, 4, 4)"]),
    ("bias not broadcastable", lambda: qkv(), {"bias": np.zeros((1, 3, 4, 4), F32)}, ValueError,
     ["bias", "broadcastable", "(1, 2, 4, 4)", "(1, 3, 4, 4)"]),
    ("bias dtype", lambda: qkv(), {"bias": np.zeros((1, 2, 4, 4), np.float64)}, TypeError,
     ["bias", "q's dtype float32", "float64"]),
    ("bias dtype float16 q", lambda: qkv(dtype=np.float16), {"bias": np.zeros((1, 2, 4, 4), np.float64)}, TypeError,
     ["bias", "q's dtype float16 or float32", "float64"]),
    ("bias other library", lambda: qkv(), {"bias": fake_cupy((1, 2, 4, 4))}, TypeError,
     ["bias is cupy", "q is numpy", "one array library"]),
    ("bias list", lambda: qkv(), {"bias": [[[[0.0]]]]}, TypeError, ["bias", "numpy", "list"]),
    ("mask dtype", lambda: qkv(), {"mask": np.ones((1, 1, 4, 4), np.int8)}, TypeError, ["mask", "bool", "int8"]),
    ("mask float", lambda: qkv(), {"mask": np.ones((1, 1, 4, 4), F32)}, TypeError, ["mask", "bool", "float32"]),
    ("mask rank", lambda: qkv(), {"mask": np.ones((2, 1, 1, 4, 4), bool)}, ValueError,
     ["mask", "rank at most 4", "(2, 1, 1, 4, 4)"]),
    ("mask not broadcastable", lambda: qkv(), {"mask": np.ones((1, 1, 4, 5), bool)}, ValueError,
     ["mask", "broadcastable", "(1, 2, 4, 4)", "(1, 1, 4, 5)"]),
    ("mask other library", lambda: qkv(), {"mask": fake_cupy((1, 1, 4, 4), bool)}, TypeError,
     ["mask is cupy", "q is numpy", "one array library"]),
]


@pytest.mark.parametrize("case", BAD_FORWARD, ids=[c[0] for c in BAD_FORWARD])
def test_forward_refuses_bad_input(case):
    _, make, kwargs, exc, words = case
    with pytest.raises(exc) as info:
        flashcupy.attention(*make(), **kwargs)
    for w in words:
        assert w in str(info.value), f"message {str(info.value)!r} lacks {w!r}"


def test_backward_refuses_bad_input():
    q, k, v = qkv()
    out, lse = flashcupy.attention(q, k, v, return_lse=True)
    cases = [
        ((out[:, :2], q, k, v, out, lse), ValueError, ["dout", "shape", "(1, 4, 2, 8)", "(1, 2, 2, 8)"]),
        ((out.astype(np.float64), q, k, v, out, lse), TypeError, ["dout", "float32", "float64"]),
        ((out, q, k, v, out, lse[:, :1]), ValueError, ["lse", "(1, 2, 4)", "(1, 1, 4)"]),
        ((out, q, k, v, out, lse.astype(np.float64)), TypeError, ["lse", "float32", "float64"]),
        ((out.tolist(), q, k, v, out, lse), TypeError, ["dout", "list"]),
        ((out, q, k, v, out, lse, lse[:, :1]), ValueError, ["dlse", "(1, 2, 4)", "(1, 1, 4)"]),
        ((out, q, k, v, out, lse, lse.astype(np.float64)), TypeError, ["dlse", "float32", "float64"]),
        ((out, q, k, v, out, lse, lse.tolist()), TypeError, ["dlse", "list"]),
    ]
    for args, exc, words in cases:
        with pytest.raises(exc) as info:
            flashcupy.attention_backward(*args[:6], dlse=args[6] if len(args) > 6 else None)
        for w in words:
            assert w in str(info.value), f"message {str(info.value)!r} lacks {w!r}"


def test_unavailable_backend_is_named_with_the_reason():
    # no GPU on this machine or in CI: asking for cupy by name must say why it cannot run
    reason = flashcupy.backends.unavailable_reason("cupy")
    if reason is None:
        pytest.skip("a CUDA device is present")
    with pytest.raises(BackendUnavailableError, match="cupy"):
        flashcupy.attention(*qkv(), backend="cupy")


def test_numpy_arrays_are_not_silently_sent_to_a_device_backend(monkeypatch):
    class DeviceOnly:
        ARRAY_LIBRARIES = ("cupy",)

    monkeypatch.setattr(flashcupy.backends, "load", lambda name: DeviceOnly)
    with pytest.raises(TypeError, match="backend 'cupy' takes cupy arrays, got numpy arrays"):
        flashcupy.attention(*qkv(), backend="cupy")


def test_arrays_of_different_libraries_are_named():
    class FakeCupyArray:  # looks like a cupy.ndarray to the library check
        __cuda_array_interface__ = {}

    FakeCupyArray.__module__ = "cupy._core.core"
    q, k, _ = qkv()
    with pytest.raises(TypeError, match="q is numpy, k is numpy, v is cupy"):
        flashcupy.attention(q, k, FakeCupyArray())


def test_bad_input_is_refused_before_any_backend_work(monkeypatch):
    from flashcupy.backends import numpy_backend

    def boom(*a, **k):
        raise AssertionError("backend ran")

    monkeypatch.setattr(numpy_backend, "forward", boom)
    with pytest.raises(ValueError):
        flashcupy.attention(*qkv(), scale=-1.0)


def test_inputs_are_not_modified(rng):
    q, k, v = (rng.standard_normal((1, 9, 2, 8)).astype(F32) for _ in range(3))
    before = [x.copy() for x in (q, k, v)]
    out, vjp = flashcupy.attention_vjp(q, k, v, causal=True)
    vjp(np.ones_like(out))
    for x, b in zip((q, k, v), before):
        np.testing.assert_array_equal(x, b)


@pytest.mark.parametrize("Sq,Sk", [(0, 5), (5, 0), (0, 0)])
def test_empty_sequences_give_empty_or_fully_masked_results(Sq, Sk):
    q, k, v = qkv(Sq=Sq, Sk=Sk)
    out, lse = flashcupy.attention(q, k, v, return_lse=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (1, 2, Sq) and lse.dtype == np.float32
    assert np.all(out == 0) and np.all(np.isneginf(lse))
    dq, dk, dv = flashcupy.attention_backward(out, q, k, v, out, lse)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert not (dq.any() or dk.any() or dv.any())


def test_numba_refuses_bfloat16_before_any_work(monkeypatch):
    mod = flashcupy.backends.module("numba")
    monkeypatch.setattr(mod, "unavailable_reason", lambda: None)
    with pytest.raises(TypeError, match="backend 'numba' supports float16, float32, float64, got bfloat16"):
        flashcupy.attention(*qkv(dtype=np.uint16), backend="numba", dtype="bfloat16")


def test_float64_scale_range_is_float64s():
    q, k, v = (np.ones((1, 2, 1, 4)) for _ in range(3))
    out = flashcupy.attention(q, k, v, scale=1e39)  # fine in float64 accumulation
    np.testing.assert_allclose(out, 1.0)


def test_misaligned_device_array_is_refused_before_any_work():
    class FakeCupyArray:  # a cupy.ndarray whose first element sits 2 bytes into a float32
        ndim, shape, strides, dtype = 4, (1, 4, 2, 8), (256, 64, 32, 4), np.dtype(np.float32)
        __cuda_array_interface__ = {"data": (0x1002, False)}
        data = types.SimpleNamespace(ptr=0x1002)  # cupy's MemoryPointer: the address the checks read

    FakeCupyArray.__module__ = "cupy._core.core"
    with pytest.raises(ValueError, match=r"q must start at an address aligned to its itemsize 4 .* 0x1002"):
        flashcupy.attention(FakeCupyArray(), FakeCupyArray(), FakeCupyArray())


def test_float64_lse_is_float64():
    _, lse = flashcupy.attention(*qkv(dtype=np.float64), return_lse=True)
    assert lse.dtype == np.float64


@pytest.mark.parametrize("backward", [False, True])
def test_cupy_grid_limit_is_checked_before_any_work(backward):
    # broadcast views: a seqlen_q whose query blocks alone overflow CUDA's grid x, nothing allocated
    from flashcupy.tools.emulator.cupy import emulated
    from flashcupy.backends import MAX_GRID
    q = np.broadcast_to(F32(1), (1, 64 * MAX_GRID[0] + 1, 1, 8))
    k = v = np.broadcast_to(F32(1), (1, 4, 1, 8))
    lse = np.broadcast_to(F32(0), (1, 1, q.shape[1]))
    with emulated(), pytest.raises(ValueError, match=r"too large for the cupy backend: seqlen_q / \d+ x batch x "
                                                     r"heads_q needs \d+ thread blocks along CUDA grid x"):
        if backward:
            flashcupy.attention_backward(q, q, k, v, q, lse, backend="cupy")
        else:
            flashcupy.attention(q, k, v, backend="cupy")


def test_cupy_grids_kept_between_calls_are_the_grids_made_again(rng):
    # grid_axes keeps its grids by dtype, head_dim, modifiers, shapes and the bias's shape: for problems
    # that differ in one of them each, what it keeps is what _grid_axes makes; a grid too large after a
    # smaller one of the same shapes otherwise is still refused
    from flashcupy.backends import MAX_GRID, cupy_backend
    from flashcupy.tools.emulator.cupy import emulated
    q = rng.standard_normal((2, 70, 4, 64)).astype(np.float16)
    k, v = (rng.standard_normal((2, 90, 2, 64)).astype(np.float16) for _ in range(2))
    variants = [dict(), dict(causal=True), dict(window=(5, 3)), dict(softcap=5.0),
                dict(bias=np.zeros((1, 4, 70, 90), np.float32)), dict(bias=np.zeros((2, 1, 1, 90), np.float32))]
    for kw in variants:
        for x in [(q, k, v), (q[:1], k[:1], v[:1]), (q[..., :40], k[..., :40], v[..., :40]),
                  (q.astype(np.float32), k.astype(np.float32), v.astype(np.float32))]:
            if "bias" in kw and x[0].shape[0] == 1 and kw["bias"].shape[0] == 2:
                continue
            p = flashcupy._checks.problem(*x, kw.get("causal", False), None, None, "numpy", **{
                name: value for name, value in kw.items() if name != "causal"})
            for backward in (False, True):
                assert cupy_backend.grid_axes(p, backward) == cupy_backend._grid_axes(p, backward)
    wide = np.broadcast_to(np.float32(1), (1, 64 * MAX_GRID[0] + 1, 1, 8))
    keys = np.broadcast_to(np.float32(1), (1, 4, 1, 8))
    with emulated():
        flashcupy.attention(wide[:, :64], keys, keys, backend="cupy")
        with pytest.raises(ValueError, match="too large for the cupy backend"):
            flashcupy.attention(wide, keys, keys, backend="cupy")


def test_cupy_kernel_paths_kept_between_calls_are_the_paths_chosen_again(rng):
    # forward_path and backward_path keep their choice in the Runtime by the switches, the problem's dtype,
    # head_dim and modifiers, the device, and each array's shape, strides and alignment: arrays that differ
    # from the others in one of those get what a choice made afresh (CACHE_HOST_WORK off) gives, in
    # whichever order they come
    from unittest import mock
    from flashcupy.backends import cupy_backend
    from flashcupy.tools.emulator.cupy import emulated
    shape = (2, 40, 4, 64)
    flat = rng.standard_normal(int(np.prod(shape)) + 8).astype(np.float16)
    wide = rng.standard_normal((2, 40, 4, 68)).astype(np.float16)
    layouts = {"contiguous": flat[:-8].reshape(shape),
               "2 bytes past 16": flat[1:-7].reshape(shape),             # tensor cores need 16-byte rows
               "rows 136 bytes apart": wide[..., :64],                    # neither tensor cores nor maps
               "heads first": flat[:-8].reshape(2, 4, 40, 64).transpose(0, 2, 1, 3),
               "keys reversed": flat[:-8].reshape(shape)[:, ::-1]}      # no map: negative strides
    paths = set()
    with emulated(compute_capability=90):
        for wgmma in (True, False, True):
            for name in [*layouts, *reversed(layouts)]:
                q = layouts["contiguous"]
                k = v = layouts[name]
                for window in (None, (3, 5)):
                    p = flashcupy._checks.problem(q, k, v, False, None, None, "numpy", window)
                    with mock.patch.object(cupy_backend, "USE_WGMMA", wgmma):
                        kept = (cupy_backend.forward_path(p, q, k, v), cupy_backend.backward_path(p, q, q, k, v, q))
                        with mock.patch.object(cupy_backend, "CACHE_HOST_WORK", False):
                            afresh = (cupy_backend.forward_path(p, q, k, v),
                                      cupy_backend.backward_path(p, q, q, k, v, q))
                    assert kept == afresh, (name, window, wgmma)
                    paths.add(kept)
    assert paths == {("hopper", "hopper"), ("tensor-core", "tensor-core"), ("simt", "simt")}


def test_cupy_problem_arguments_kept_between_calls_are_the_arguments_made_again(rng):
    # _problem_args keeps the kernels' scalar arguments by Problem (one without modifier arrays): problems
    # that differ in one field each get what is made afresh, on either kernel path's units
    from unittest import mock
    from flashcupy.backends import cupy_backend
    from flashcupy.tools.emulator.cupy import emulated
    q = rng.standard_normal((2, 40, 4, 64)).astype(np.float16)
    k = rng.standard_normal((2, 50, 2, 64)).astype(np.float16)
    variants = [dict(), dict(causal=True), dict(scale=0.3), dict(window=(5, 3)), dict(window=(None, 0)),
                dict(softcap=5.0), dict(softcap=5.0, scale=0.3), dict(diagonal=7), dict(causal=True, diagonal=-3),
                dict(dropout_p=0.3, dropout_seed=5), dict(dropout_p=0.3, dropout_seed=2**40 + 5),
                dict(dropout_p=0.5, dropout_seed=5), dict(dropout_p=0.3, dropout_seed=5, dropout_origin=(1, 0, 2, 3))]

    def same(a, b):
        return len(a) == len(b) and all(x is y if isinstance(x, np.ndarray) else (type(x) is type(y) and x == y)
                                        for x, y in zip(a, b))
    with emulated() as rt:
        for kw in [*variants, *reversed(variants)]:
            drop = {name: kw[name] for name in ("dropout_p", "dropout_seed", "dropout_origin") if name in kw}
            p = flashcupy._checks.problem(q, k, k, kw.get("causal", False), kw.get("scale"), None, "numpy",
                                          kw.get("window"), kw.get("softcap"), diagonal=kw.get("diagonal"), **drop)
            for tensor_cores in (True, False):
                kept = cupy_backend._problem_args(rt, p, q, tensor_cores)
                with mock.patch.object(cupy_backend, "CACHE_HOST_WORK", False):
                    afresh = cupy_backend._problem_args(rt, p, q, tensor_cores)
                assert same(kept, afresh), (kw, tensor_cores)
    assert len(rt.plans) == 2 * len(variants)


def test_problems_kept_between_calls_are_the_problems_made_again_and_bad_options_still_refused(rng):
    # problem() keeps a call's Problem by its arrays' types, shapes, strides, dtypes and alignment and its
    # options with their types: calls that differ in one of those get what is made afresh (CACHE_PROBLEMS
    # off), in either order, and an option equal to a kept one but of a refused type (causal=1 after
    # causal=True, a bool window side after an int) is refused still
    from unittest import mock
    from flashcupy import _checks
    q = rng.standard_normal((2, 40, 4, 64)).astype(np.float16)
    k = rng.standard_normal((2, 50, 2, 64)).astype(np.float16)
    wide = rng.standard_normal((2, 50, 2, 72)).astype(np.float16)[..., :64]
    arrays = [(q, k, k), (q, wide, wide), (q[:1], k[:1], k[:1]), (q.astype(np.float32),) + (k.astype(np.float32),) * 2,
              (q.view(np.uint16), k.view(np.uint16), k.view(np.uint16))]
    options = [dict(), dict(causal=True), dict(scale=1), dict(scale=1.0), dict(scale=0.25), dict(window=(3, None)),
               dict(window=(3, 0)), dict(softcap=5), dict(softcap=5.0), dict(diagonal=4), dict(dtype="bfloat16")]
    calls = [(x, kw) for x in arrays for kw in options if ("dtype" in kw) == (x[0].dtype == np.uint16)]
    _checks._PROBLEMS.clear()
    for x, kw in [*calls, *reversed(calls)]:
        args = (*x, kw.get("causal", False), kw.get("scale"), kw.get("dtype"), "numpy", kw.get("window"),
                kw.get("softcap"))
        kept = _checks.problem(*args, diagonal=kw.get("diagonal"))
        with mock.patch.object(_checks, "CACHE_PROBLEMS", False):
            afresh = _checks.problem(*args, diagonal=kw.get("diagonal"))
        assert kept == afresh and kept.scale == afresh.scale and type(kept.scale) is type(afresh.scale), kw
        assert (kept.band, kept.modifiers, kept.carrier) == (afresh.band, afresh.modifiers, afresh.carrier), kw
    assert len(_checks._PROBLEMS) == len(calls)
    # q's shape and dtype, its elements 3 bytes apart along head_dim: refused though q's Problem is kept
    odd = np.ndarray(q.shape, np.float16, np.zeros(q.size * 3, np.uint8), strides=(*q.strides[:3], 3))
    for bad, error in ((dict(causal=1), TypeError), (dict(window=(True, None)), TypeError),
                       (dict(causal=np.int64(1)), TypeError), (dict(window=(3, -1)), ValueError),
                       (dict(scale=float("nan")), ValueError), (dict(dtype="float16"), ValueError),
                       (dict(q=odd), ValueError)):
        with pytest.raises(error):
            _checks.problem(bad.get("q", q), k, k, bad.get("causal", False), bad.get("scale"), bad.get("dtype"),
                            "numpy", bad.get("window"))


def test_bfloat16_bits_need_no_ml_dtypes_until_numpy_computes_on_them(monkeypatch, rng):
    # CuPy users hold bfloat16 as uint16 bits and may not have ml_dtypes (the cuda extras do not bring it)
    import sys
    from flashcupy.tools.emulator.cupy import emulated
    from conftest import BF16, assert_matches_oracle, bf16_bits, make_qkv
    q, k, v = make_qkv(rng, 1, 9, 12, 2, 1, 16, BF16)
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)  # import ml_dtypes now fails
    bits = [bf16_bits(x) for x in (q, k, v)]
    with emulated():
        out, lse = flashcupy.attention(*bits, causal=True, return_lse=True, backend="cupy", dtype="bfloat16")
    assert_matches_oracle((out, lse), q, k, v, causal=True, backend="cupy")
    with pytest.raises(TypeError, match="bfloat16 values with NumPy needs the ml_dtypes package"):
        flashcupy.attention(*bits, causal=True, backend="numpy", dtype="bfloat16")


def test_deterministic_must_be_a_bool_and_changes_nothing_on_the_cpu(rng):
    q, k, v = qkv()
    out, lse = flashcupy.attention(q, k, v, return_lse=True)
    with pytest.raises(TypeError, match="deterministic must be a bool, got str"):
        flashcupy.attention_backward(out, q, k, v, out, lse, deterministic="yes")
    with pytest.raises(TypeError, match="deterministic must be a bool, got int"):
        flashcupy.attention_vjp(q, k, v, deterministic=1)
    # the NumPy backend is deterministic either way: the same bits
    for a, b in zip(flashcupy.attention_backward(out, q, k, v, out, lse, deterministic=True),
                    flashcupy.attention_backward(out, q, k, v, out, lse)):
        np.testing.assert_array_equal(a, b)
