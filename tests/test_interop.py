"""torch and JAX arrays in, torch and JAX arrays out, viewed through DLPack without a copy, checked
against the oracle."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from conftest import assert_matches_oracle, bf16_bits, make_qkv

import flashcupy
from flashcupy.backends import bfloat16_dtype, numpy_backend

torch = pytest.importorskip("torch", reason="torch CPU is installed by the README's test command")


def _torch(x):
    return torch.from_numpy(np.ascontiguousarray(x))


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "bfloat16"])
def test_torch_tensors_in_and_out(rng, dtype):
    values = bfloat16_dtype() if dtype == "bfloat16" else np.dtype(dtype)
    q, k, v = make_qkv(rng, 2, 7, 9, 4, 2, 8, values)
    dout = rng.standard_normal(q.shape).astype(values)
    as_torch = (lambda x: _torch(x.view(np.int16)).view(torch.bfloat16)) if dtype == "bfloat16" else _torch
    tq, tk, tv, tdout = (as_torch(x) for x in (q, k, v, dout))
    out, lse = flashcupy.attention(tq, tk, tv, causal=True, return_lse=True)
    grads = flashcupy.attention_backward(tdout, tq, tk, tv, out, lse, causal=True)
    assert all(isinstance(x, torch.Tensor) for x in (out, lse, *grads))
    assert out.dtype == tq.dtype and [g.dtype for g in grads] == [tq.dtype] * 3
    if dtype == "bfloat16":  # the oracle reads the bits
        got = [x.view(torch.int16).numpy().view(np.uint16) if x.dtype == torch.bfloat16 else x.numpy()
               for x in (out, lse, *grads)]
        assert_matches_oracle(got, *(bf16_bits(x) for x in (q, k, v, dout)), causal=True, dtype="bfloat16",
                              backend="numpy")
    else:
        assert_matches_oracle([x.numpy() for x in (out, lse, *grads)], q, k, v, dout, causal=True, backend="numpy")


def test_inputs_are_viewed_not_copied(rng):
    q, k, v = make_qkv(rng, 1, 6, 6, 2, 2, 8, np.float32)
    tq, tk, tv = (_torch(x) for x in (q, k, v))
    tk_strided = tk.transpose(1, 2).contiguous().transpose(1, 2)  # BHSD memory, BSHD shape
    seen = {}
    real = numpy_backend.forward

    def spy(p, q, k, v):
        seen.update(q=q.ctypes.data, k=k.ctypes.data, v=v.ctypes.data)
        return real(p, q, k, v)

    with mock.patch.object(numpy_backend, "forward", spy):
        out = flashcupy.attention(tq, tk_strided, tv.requires_grad_(True))
    assert seen == dict(q=tq.data_ptr(), k=tk_strided.data_ptr(), v=tv.data_ptr())
    np.testing.assert_array_equal(out.detach().numpy(), flashcupy.attention(q, k, v))  # v requires grad


def test_vjp_and_merge_take_and_give_torch(rng):
    q, k, v = make_qkv(rng, 1, 5, 8, 2, 1, 8, np.float64)
    dout = rng.standard_normal(q.shape)
    tq, tk, tv = (_torch(x) for x in (q, k, v))
    out, vjp = flashcupy.attention_vjp(tq, tk, tv)
    grads = vjp(_torch(dout))
    assert isinstance(out, torch.Tensor) and all(isinstance(g, torch.Tensor) for g in grads)
    parts = [flashcupy.attention(tq, tk[:, a:b], tv[:, a:b], return_lse=True) for a, b in ((0, 3), (3, 8))]
    merged, lse = flashcupy.merge([o for o, _ in parts], [l for _, l in parts])
    assert isinstance(merged, torch.Tensor)
    # backend None: a merge of parts stored in the dtype (conftest.assert_matches_oracle)
    assert_matches_oracle((merged.numpy(), lse.numpy(), *(g.numpy() for g in grads)), q, k, v, dout, backend=None)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_results_that_are_lists_come_back_as_torch_tensors(rng, dtype):
    # merge_backward returns (douts, dlses), two lists: each of their arrays goes back as a torch
    # tensor, bfloat16 viewed back from its bits, with the values of the same call on NumPy arrays
    values = bfloat16_dtype() if dtype == "bfloat16" else np.dtype(dtype)
    q, k, v = make_qkv(rng, 1, 5, 8, 2, 1, 8, values)
    cuts = ((0, 3), (3, 8))
    parts = [flashcupy.attention(q, k[:, a:b], v[:, a:b], return_lse=True) for a, b in cuts]
    outs, lses = [o for o, _ in parts], [l for _, l in parts]
    out, lse = flashcupy.merge(outs, lses)
    dout = rng.standard_normal(q.shape).astype(values)
    dlse = rng.standard_normal(lse.shape).astype(np.float32)
    as_torch = (lambda x: _torch(x.view(np.int16)).view(torch.bfloat16)) if dtype == "bfloat16" else _torch
    douts, dlses = flashcupy.merge_backward(as_torch(dout), [as_torch(o) for o in outs], [_torch(l) for l in lses],
                                            as_torch(out), _torch(lse), _torch(dlse))
    want_douts, want_dlses = flashcupy.merge_backward(dout, outs, lses, out, lse, dlse)
    assert isinstance(douts, list) and isinstance(dlses, list) and len(douts) == len(dlses) == 2
    assert all(isinstance(x, torch.Tensor) for x in douts + dlses)
    assert [x.dtype for x in douts] == [as_torch(dout).dtype] * 2 and [x.dtype for x in dlses] == [torch.float32] * 2
    def as_numpy(x):
        return x.view(torch.int16).numpy().view(values) if x.dtype == torch.bfloat16 else x.numpy()

    for got, want in zip(douts + dlses, want_douts + want_dlses):
        np.testing.assert_array_equal(as_numpy(got), want)
    # and merge's own results, checked against the oracle on the whole keys
    merged, merged_lse = flashcupy.merge([as_torch(o) for o in outs], [_torch(l) for l in lses])
    assert_matches_oracle((as_numpy(merged), merged_lse.numpy()), q, k, v, backend=None)  # a merge of stored parts


def test_jax_arrays_in_and_out(rng):
    jnp = pytest.importorskip("jax.numpy", reason="jax[cpu] is in the test extra")
    q, k, v = make_qkv(rng, 1, 6, 10, 4, 2, 8, np.float32)
    out, lse = flashcupy.attention(*(jnp.asarray(x) for x in (q, k, v)), causal=True, return_lse=True)
    assert type(out).__module__.split(".")[0] in ("jax", "jaxlib")
    assert_matches_oracle((np.asarray(out), np.asarray(lse)), q, k, v, causal=True, backend="numpy")
    with pytest.raises(TypeError, match="bfloat16 jax array.*bitcast_convert_type"):
        flashcupy.attention(*(jnp.asarray(x, dtype=jnp.bfloat16) for x in (q, k, v)))
    with pytest.raises(TypeError, match="one array library: q is jax, k is torch, v is torch"):
        flashcupy.attention(jnp.asarray(q), _torch(k), _torch(v))


def test_a_jax_tracer_is_a_type_error_pointing_to_flashcupy_jax(rng):
    # the core entry points read memory, which a JAX tracer (inside jit, grad, vmap) has none of: a
    # TypeError naming the argument and flashcupy.jax, rather than an AttributeError from DLPack; outside
    # a transformation the same jax.Array is read through a view, and matches the oracle
    jax = pytest.importorskip("jax", reason="jax[cpu] is in the test extra")
    import flashcupy.jax  # noqa: F401

    q, k, v = (jax.numpy.asarray(x) for x in make_qkv(rng, 1, 4, 6, 2, 1, 8, np.float32))
    with pytest.raises(TypeError, match=r"q is a JAX tracer .* call flashcupy.jax.attention there"):
        jax.jit(lambda q: flashcupy.attention(q, k, v))(q)
    with pytest.raises(TypeError, match=r"k is a JAX tracer .* flashcupy.jax's attention and attention_varlen run"):
        jax.grad(lambda k: flashcupy.attention_probs(q, k, None).sum())(k)
    out = flashcupy.attention(q, k, v, causal=True)
    assert_matches_oracle([np.asarray(out)], *(np.asarray(x) for x in (q, k, v)), backend="numpy", causal=True)
