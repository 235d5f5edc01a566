"""torch autograd through flashcupy (flashcupy._torch): gradcheck in float64 for every modifier,
gradients against the oracle and a float32 training step against torch SDPA's, bias gradients,
torch.compile, the transformers recipe of the README, and the frictions of issue 32 (numbers as
0-d arrays, one library a call, no silent detach)."""

from __future__ import annotations

import math
import re
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_matches_oracle, make_qkv

import flashcupy
import reference

torch = pytest.importorskip("torch", reason="torch CPU is installed by the README's test command")
F = torch.nn.functional


def _t(x, grad=False):
    return torch.from_numpy(np.ascontiguousarray(x)).requires_grad_(grad)


def _np(x):
    return x.detach().numpy()


def _qkv64(rng, B=1, Sq=5, Sk=7, Hq=4, Hkv=2, D=8):
    return [_t(x, True) for x in make_qkv(rng, B, Sq, Sk, Hq, Hkv, D, np.float64)]


# (name, shapes (B, Sq, Sk, Hq, Hkv, D), keywords as a function of the rng)
GRADCHECK = [
    ("plain", (1, 5, 7, 2, 2, 8), lambda rng: {}),
    ("causal Sq < Sk", (1, 5, 7, 2, 2, 8), lambda rng: dict(causal=True)),
    ("causal Sq > Sk: rows that see no key", (1, 7, 4, 2, 1, 8), lambda rng: dict(causal=True)),
    ("GQA, batch 2", (2, 5, 6, 4, 2, 8), lambda rng: dict(causal=True)),
    ("window", (1, 6, 8, 2, 1, 4), lambda rng: dict(window=(2, 1))),
    ("causal window", (1, 6, 8, 2, 1, 4), lambda rng: dict(causal=True, window=(3, None))),
    ("softcap", (1, 5, 7, 2, 2, 8), lambda rng: dict(softcap=0.8, scale=1.3)),
    ("alibi", (1, 5, 7, 4, 2, 8), lambda rng: dict(alibi_slopes=_t(rng.uniform(0.1, 1, (1, 4))))),
    ("bias", (1, 5, 7, 4, 2, 8), lambda rng: dict(bias=_t(rng.standard_normal((1, 4, 5, 7)), True))),
    ("bias broadcast over heads and queries", (2, 5, 7, 2, 1, 8),
     lambda rng: dict(bias=_t(rng.standard_normal((2, 1, 1, 7)), True))),
    ("mask, a row hidden whole", (1, 5, 7, 2, 2, 8),
     lambda rng: dict(mask=_t(np.concatenate([np.zeros((1, 1, 1, 7), bool), rng.random((1, 1, 4, 7)) < 0.6], 2)))),
    ("everything", (1, 6, 7, 4, 2, 4),
     lambda rng: dict(causal=True, window=(4, None), softcap=1.5, alibi_slopes=_t(rng.uniform(0.1, 1, 4)),
                      bias=_t(rng.standard_normal((1, 4, 6, 7)), True), mask=_t(rng.random((1, 1, 6, 7)) < 0.8))),
]


@pytest.mark.parametrize("case", GRADCHECK, ids=[c[0] for c in GRADCHECK])
def test_gradcheck_float64(rng, case):
    _, (B, Sq, Sk, Hq, Hkv, D), make = case
    q, k, v = _qkv64(rng, B, Sq, Sk, Hq, Hkv, D)
    kw = make(rng)
    bias = kw.pop("bias", None)
    inputs = (q, k, v) if bias is None else (q, k, v, bias)

    def f(q, k, v, bias=None):
        return flashcupy.attention(q, k, v, bias=bias, **kw)

    out = f(*inputs)
    assert out.grad_fn is not None and "flashcupy" in type(out.grad_fn).__name__
    assert torch.autograd.gradcheck(f, inputs)


def test_gradcheck_varlen_float64(rng):
    cu = _t(np.array([0, 3, 3, 8], np.int32))  # the middle sequence is empty
    cu_k = _t(np.array([0, 4, 6, 11], np.int32))
    q = _t(rng.standard_normal((8, 4, 8)), True)
    k, v = (_t(rng.standard_normal((11, 2, 8)), True) for _ in range(2))
    slopes = _t(rng.uniform(0.1, 1, (3, 4)))

    def f(q, k, v):
        return flashcupy.attention_varlen(q, k, v, cu, cu_k, causal=True, softcap=2.0, alibi_slopes=slopes)

    assert f(q, k, v).grad_fn is not None
    assert torch.autograd.gradcheck(f, (q, k, v))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_autograd_gradients_match_the_oracle(rng, dtype):
    """out, lse and the gradients autograd gives (bias included), through out and lse, are the oracle's,
    within its tolerance."""
    import ml_dtypes

    values = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    q, k, v = make_qkv(rng, 2, 9, 12, 4, 2, 16, values)
    dout = rng.standard_normal(q.shape).astype(values)
    bias = rng.standard_normal((2, 1, 9, 12)).astype(np.float32)  # float32 bias with any q
    mask = rng.random((1, 4, 9, 12)) < 0.7
    as_t = (lambda x: _t(x.view(np.int16)).view(torch.bfloat16)) if dtype == "bfloat16" else _t
    tq, tk, tv = (as_t(x).requires_grad_(True) for x in (q, k, v))
    tb = _t(bias, True)
    out, lse = flashcupy.attention(tq, tk, tv, causal=True, bias=tb, mask=_t(mask), return_lse=True)
    assert lse.requires_grad  # unlike torch SDPA's logsumexp
    dlse = rng.standard_normal(lse.shape).astype(np.float32)
    torch.autograd.backward([out, lse], [as_t(dout), _t(dlse)])
    assert [x.grad.dtype for x in (tq, tk, tv, tb)] == [tq.dtype] * 3 + [torch.float32]
    if dtype == "bfloat16":
        bits = lambda x: x.detach().view(torch.int16).numpy().view(np.uint16)  # noqa: E731
        got = [bits(out), _np(lse), *(bits(x.grad) for x in (tq, tk, tv)), _np(tb.grad)]
        assert_matches_oracle(got, *(x.view(np.uint16) for x in (q, k, v, dout)), causal=True, bias=bias,
                              mask=mask, dtype="bfloat16", backend="numpy", dlse=dlse)
    else:
        got = [_np(out), _np(lse), *(_np(x.grad) for x in (tq, tk, tv, tb))]
        assert_matches_oracle(got, q, k, v, dout, causal=True, bias=bias, mask=mask, backend="numpy", dlse=dlse)


def test_a_loss_of_lse_alone(rng, monkeypatch):
    """lse's gradient without out's (autograd passes no dout): the oracle's with dout zero, for attention
    and a packed batch; a loss of out alone passes no dlse (the same bits as the backward without it)."""
    q, k, v = make_qkv(rng, 1, 7, 9, 2, 1, 8, np.float32)
    tq, tk, tv = (_t(x, True) for x in (q, k, v))
    out, lse = flashcupy.attention(tq, tk, tv, causal=True, return_lse=True)
    dlse = rng.standard_normal(lse.shape).astype(np.float32)
    lse.backward(_t(dlse))
    assert_matches_oracle([_np(out), _np(lse), *(_np(x.grad) for x in (tq, tk, tv))], q, k, v, np.zeros_like(q),
                          causal=True, backend="numpy", dlse=dlse)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    pq, pk, pv = (_t(x[0, :7], True) for x in (q, k, v))
    pout, plse = flashcupy.attention_varlen(pq, pk, pv, cu, cu, causal=True, return_lse=True)
    plse.backward(_t(dlse[0, :, :7]))
    for b in range(2):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        one = [_np(x)[None, rows] for x in (pq, pk, pv)]
        assert_matches_oracle([_np(pout)[None, rows], _np(plse)[None, :, rows],
                               *(_np(x.grad)[None, rows] for x in (pq, pk, pv))], *one, np.zeros_like(one[0]),
                              causal=True, backend="numpy", dlse=dlse[:, :, rows])
    # a loss of out alone: the backward gets no dlse (not zeros to subtract), and the loss of lse alone a dout
    # of zeros
    from flashcupy import _api
    given = []
    backward = _api.backward
    monkeypatch.setattr(_api, "backward", lambda *a, **kw: given.append(kw["dlse"]) or backward(*a, **kw))
    tq.grad = None
    out = flashcupy.attention(tq, tk, tv, causal=True)
    out.backward(_t(np.ones_like(q)))
    out_, lse_ = flashcupy.attention(q, k, v, causal=True, return_lse=True)
    np.testing.assert_array_equal(_np(tq.grad), flashcupy.attention_backward(np.ones_like(q), q, k, v, out_, lse_,
                                                                             causal=True)[0])
    assert given[0] is None


def test_bias_gradients(rng, monkeypatch):
    """dbias has the bias's shape and dtype, summed over its broadcast dimensions; a bias that does not
    require grad gets none (and the backward spends nothing on it: Problem.dbias False), and q, k, v's
    gradients do not depend on whether it does."""
    from flashcupy.backends import numpy_backend

    seen = []
    backward = numpy_backend.backward
    monkeypatch.setattr(numpy_backend, "backward", lambda p, *a, **kw: seen.append(p.dbias) or backward(p, *a, **kw))
    q, k, v = make_qkv(rng, 2, 6, 5, 2, 1, 8, np.float32)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    for shape in ((2, 2, 6, 5), (1, 2, 1, 5), (2, 1, 6, 1), (1, 1, 1, 1)):
        bias = rng.standard_normal(shape).astype(np.float32)
        tq, tk, tv = (_t(x, True) for x in (q, k, v))
        tb = _t(bias, True)
        seen.clear()
        flashcupy.attention(tq, tk, tv, bias=tb).backward(_t(dout))
        assert seen == [True]
        assert tb.grad.shape == shape
        assert_matches_oracle([_np(flashcupy.attention(tq, tk, tv, bias=tb)),
                               _np(flashcupy.attention(tq, tk, tv, bias=tb, return_lse=True)[1]),
                               *(_np(x.grad) for x in (tq, tk, tv, tb))], q, k, v, dout, bias=bias, backend="numpy")
        fixed = _t(bias)
        seen.clear()
        grads = torch.autograd.grad(flashcupy.attention(tq, tk, tv, bias=fixed), (tq, tk, tv), _t(dout))
        assert fixed.grad is None and seen == [False]
        for a, b in zip(grads, (tq, tk, tv)):
            assert torch.equal(a, b.grad)
    # the bias alone requires grad: q, k, v are constants
    tb = _t(rng.standard_normal((1, 2, 6, 5)), True)
    out = flashcupy.attention(*(_t(x.astype(np.float64)) for x in (q, k, v)), bias=tb)
    assert torch.autograd.gradcheck(lambda b: flashcupy.attention(*(_t(x.astype(np.float64)) for x in (q, k, v)),
                                                                  bias=b), (tb,))
    assert out.grad_fn is not None


class _Attention(torch.nn.Module):
    """A GQA attention block: projections, attention (flashcupy or torch SDPA), output projection."""

    def __init__(self, dim=32, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wq = torch.nn.Linear(dim, dim)
        self.wkv = torch.nn.Linear(dim, 2 * kv_heads * self.head_dim)
        self.wo = torch.nn.Linear(dim, dim)
        self.seen = {}

    def forward(self, x, keep, use_flashcupy):
        B, S, _ = x.shape
        q = self.wq(x).view(B, S, self.heads, self.head_dim)
        k, v = self.wkv(x).view(B, S, 2, self.kv_heads, self.head_dim).unbind(2)
        mask = keep[:, None, None, :] & torch.ones(S, S, dtype=torch.bool).tril()  # causal, key padding
        if use_flashcupy:
            o = flashcupy.attention(q, k, v, mask=mask)
            self.seen = dict(q=q, k=k, v=v, out=o, mask=mask)
            for t in (q, k, v, o):
                t.retain_grad()
        else:
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               attn_mask=mask, enable_gqa=True).transpose(1, 2)
        return self.wo(o.reshape(B, S, -1))


def test_float32_training_step_matches_torch_sdpa(rng):
    """One SGD step of a small model: the attention inside it is the oracle's (within its tolerance), and
    every parameter's gradient, and the parameters after the step, are torch SDPA's (torch's float32
    tolerance, torch.testing.assert_close)."""
    torch.manual_seed(0)
    ours = _Attention()
    sdpa = _Attention()
    sdpa.load_state_dict(ours.state_dict())
    x = _t(rng.standard_normal((2, 11, 32)).astype(np.float32))
    target = _t(rng.standard_normal((2, 11, 32)).astype(np.float32))
    keep = _t(np.arange(11)[None, :] < np.array([[11], [7]]))  # the second sequence has 4 padded keys
    for model, use in ((ours, True), (sdpa, False)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = F.mse_loss(model(x, keep, use), target)
        loss.backward()
        opt.step()
        if use:  # the attention inside the step, as autograd ran it: q, k, v, out, their gradients
            seen = {name: _np(t) for name, t in ours.seen.items()}
            grads = [_np(ours.seen[n].grad) for n in ("q", "k", "v", "out")]
            lse = flashcupy.attention(seen["q"], seen["k"], seen["v"], mask=seen["mask"], return_lse=True)[1]
            assert_matches_oracle([seen["out"], lse, *grads[:3]], seen["q"], seen["k"], seen["v"], grads[3],
                                  mask=seen["mask"], backend="numpy")
    for (name, a), b in zip(ours.named_parameters(), sdpa.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=lambda m, name=name: f"{name}.grad: {m}")
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"{name} after the step: {m}")


def test_torch_compile_keeps_one_graph_and_eager_gradients(rng, tmp_path, monkeypatch):
    """torch.compile sees flashcupy.attention as one custom op, forward and backward: no graph break
    (fullgraph=True compiles), and the gradients are bit for bit the eager ones."""
    import torch._dynamo

    # torch's compile caches of its own: a backward compiled by an older flashcupy (the op's schema
    # before dlse) would be reused for this one's, as pytorch#144344 says (README)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))

    q, k, v = (_t(x, True) for x in make_qkv(rng, 1, 9, 9, 4, 2, 8, np.float32))
    w = _t(rng.standard_normal(q.shape).astype(np.float32))
    bias = _t(rng.standard_normal((1, 4, 9, 9)).astype(np.float32), True)

    def model(q, k, v, bias):
        return (flashcupy.attention(q, k, v, causal=True, bias=bias, softcap=2.0) * w).sum()

    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(q, k, v, bias)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    model(q, k, v, bias).backward()
    eager = [x.grad.clone() for x in (q, k, v, bias)]
    for x in (q, k, v, bias):
        x.grad = None
    torch.compile(model, fullgraph=True)(q, k, v, bias).backward()
    for a, x in zip(eager, (q, k, v, bias)):
        assert torch.equal(a, x.grad)


def test_custom_ops_pass_torch_opcheck(rng):
    """torch.library.opcheck: schemas, fake (meta) implementations, autograd registration, AOT dispatch."""
    from flashcupy import _torch

    q, k, v = (_t(x, True) for x in make_qkv(rng, 1, 5, 6, 2, 1, 8, np.float64))
    bias = _t(rng.standard_normal((1, 2, 5, 6)), True)
    torch.library.opcheck(torch.ops.flashcupy.attention.default,
                          (q, k, v, bias, None, None, True, None, None, None, None, "auto", None, 0.25, 7, 1))
    out, lse = torch.ops.flashcupy.attention(q, k, v, bias, None, None, True, None, None, None, None, "auto", None,
                                             0.0, 0, 0)
    dout = torch.randn_like(out)
    for return_dbias in (True, False):  # (dq, dk, dv, dbias), or no work on dbias
        torch.library.opcheck(torch.ops.flashcupy.attention_backward.default,
                              tuple(x.detach() for x in (dout, q, k, v, out, lse, torch.randn_like(lse), bias))
                              + (None, None, True, None, None, None, None, "auto", None, 0.0, 0, 0, False,
                                 return_dbias))
    cu = _t(np.array([0, 2, 5], np.int32))
    pq, pk, pv = (x.detach()[0].requires_grad_(True) for x in (q, k[:, :5], v[:, :5]))
    torch.library.opcheck(torch.ops.flashcupy.attention_varlen.default,
                          (pq, pk, pv, cu, cu, None, None, None, True, None, None, None, None, "auto", None, True,
                           0.0, 0, 0))
    assert set(_torch.ENTRY_POINTS) == {"attention", "attention_varlen"}


def test_nothing_requiring_grad_is_detached_silently(rng):
    q, k, v = (_t(x, True) for x in make_qkv(rng, 1, 4, 4, 2, 2, 8, np.float32))
    out, lse = flashcupy.attention(q, k, v, return_lse=True)
    assert out.requires_grad and lse.requires_grad
    dout = torch.ones_like(out)
    refused = [
        ("attention_backward", lambda: flashcupy.attention_backward(dout, q, k, v, out, lse), "q, k, v, out, lse"),
        ("attention_vjp", lambda: flashcupy.attention_vjp(q, k, v), "q, k, v"),
        ("attention_probs", lambda: flashcupy.attention_probs(q, k, lse), "q, k, lse"),
        ("merge", lambda: flashcupy.merge([out, out], [lse, lse]), "outs[0], outs[1], lses[0], lses[1]"),
        ("attention_with_kvcache", lambda: flashcupy.attention_with_kvcache(q, k.detach(), v.detach()), "q"),
    ]
    for name, call, wanting in refused:
        with pytest.raises(ValueError, match=re.escape(f"flashcupy.{name} records no autograd graph, and {wanting} "
                                                       "require")):
            call()
    slopes = _t(np.full(2, 0.5, np.float32), True)
    with pytest.raises(ValueError, match="alibi_slopes requires grad, but flashcupy gives alibi_slopes no gradient"):
        flashcupy.attention(q, k, v, alibi_slopes=slopes)
    with pytest.raises(ValueError, match=r"scale requires grad.*no gradient.*scale.detach\(\)"):
        flashcupy.attention(q, k, v, scale=torch.tensor(0.3, requires_grad=True))
    with torch.no_grad():  # outside grad mode the same calls read the tensors as they are
        grads = flashcupy.attention_backward(dout, q, k, v, out, lse)
        plain = flashcupy.attention(q, k, v, alibi_slopes=slopes, scale=torch.tensor(0.3, requires_grad=True))
    assert not plain.requires_grad and all(not g.requires_grad for g in grads)
    # the vjp closure of plain tensors takes a torch dout, and refuses one that requires grad
    _, vjp = flashcupy.attention_vjp(*(x.detach() for x in (q, k, v)))
    assert isinstance(vjp(dout)[0], torch.Tensor)
    with pytest.raises(ValueError, match="attention_vjp records no autograd graph, and dout requires grad"):
        vjp(dout.clone().requires_grad_(True))


def _zero_d_scales():
    """0-d arrays of every library at hand, and a stand-in for CuPy's (shape (), a dtype, float())."""
    jnp = pytest.importorskip("jax.numpy", reason="jax[cpu] is in the test extra")

    class FakeCupyScalar:
        shape, dtype = (), np.dtype(np.float32)

        def __float__(self):
            return 0.17

    FakeCupyScalar.__module__ = "cupy._core.core"
    return {"numpy": np.array(0.17), "numpy float32": np.float32(0.17), "torch": torch.tensor(0.17),
            "torch float64": torch.tensor(0.17, dtype=torch.float64), "jax": jnp.asarray(0.17),
            "cupy (stand-in)": FakeCupyScalar()}


def test_scale_and_softcap_take_0d_arrays_of_any_library(rng):
    q, k, v = make_qkv(rng, 1, 5, 6, 2, 1, 8, np.float64)
    tq, tk, tv = (_t(x) for x in (q, k, v))
    for name, s in _zero_d_scales().items():
        value = float(s)
        for args in ((q, k, v), (tq, tk, tv)):
            out = flashcupy.attention(*args, scale=s, softcap=s)
            want = flashcupy.attention(*args, scale=value, softcap=value)
            assert np.array_equal(np.asarray(out), np.asarray(want)), name
    assert_matches_oracle((np.asarray(flashcupy.attention(tq, tk, tv, scale=torch.tensor(0.17, dtype=torch.float64))),
                           flashcupy.attention(q, k, v, scale=0.17, return_lse=True)[1]), q, k, v, scale=0.17,
                          backend="numpy")
    # not a number: refused, naming the caller's type and shape, never the converted one
    for bad, words in ((torch.tensor([0.17]), "torch.Tensor of shape (1,)"), (torch.tensor(True), "torch.bool"),
                       (np.array([0.1, 0.2]), "numpy.ndarray of shape (2,)"), ("0.17", "str")):
        for keyword in ("scale", "softcap"):
            with pytest.raises(TypeError, match=re.escape(f"{keyword} must be a real number, a 0-d array or None, "
                                                          f"got ") + ".*" + re.escape(words)):
                flashcupy.attention(tq, tk, tv, **{keyword: bad})


def test_arrays_of_different_libraries_are_one_type_error_naming_each(rng):
    """README: arrays of different libraries are a TypeError that names which is which, at every entry
    point, torch with NumPy included (they were accepted, results in torch)."""
    q, k, v = make_qkv(rng, 1, 4, 4, 2, 2, 8, np.float32)
    tq, tk, tv = (_t(x) for x in (q, k, v))
    out, lse = flashcupy.attention(q, k, v, return_lse=True)
    mask, bias = np.ones((1, 1, 4, 4), bool), np.zeros((1, 2, 4, 4), np.float32)
    cu = np.array([0, 4], np.int32)
    cases = [
        (lambda: flashcupy.attention(tq, k, v), "q is torch, k is numpy, v is numpy"),
        (lambda: flashcupy.attention(q, tk, v), "q is numpy, k is torch, v is numpy"),
        (lambda: flashcupy.attention(tq, tk, tv, mask=mask), "q is torch, k is torch, v is torch, mask is numpy"),
        (lambda: flashcupy.attention(tq, tk, tv, bias=bias), "bias is numpy"),
        (lambda: flashcupy.attention(tq, tk, tv, alibi_slopes=np.ones(2, np.float32)), "alibi_slopes is numpy"),
        (lambda: flashcupy.attention(tq, tk, tv, bias=_t(bias, True), mask=mask), "mask is numpy"),
        (lambda: flashcupy.attention_backward(out, tq, tk, tv, _t(out), _t(lse)), "dout is numpy, q is torch"),
        (lambda: flashcupy.merge([_t(out), out], [_t(lse), lse]), "outs[0] is torch, outs[1] is numpy"),
        (lambda: flashcupy.attention_varlen(tq[0], tk[0], tv[0], cu, _t(cu)), "cu_seqlens_q is numpy"),
        (lambda: flashcupy.attention_varlen(_t(q[0], True), tk[0], tv[0], _t(cu), cu), "cu_seqlens_k is numpy"),
        (lambda: flashcupy.attention_with_kvcache(tq, tk, tv, cache_seqlens=np.zeros(1, np.int32)),
         "cache_seqlens is numpy"),
        (lambda: flashcupy.attention_probs(tq, k, _t(lse)), "k is numpy"),
        (lambda: flashcupy.attention_vjp(tq, tk, tv)[1](out), "q is torch, dout is numpy"),
    ]
    for call, words in cases:
        with pytest.raises(TypeError, match="must come from one array library: .*" + re.escape(words)):
            call()
    jnp = pytest.importorskip("jax.numpy", reason="jax[cpu] is in the test extra")
    with pytest.raises(TypeError, match=re.escape("mask is jax")):
        flashcupy.attention(tq, tk, tv, mask=jnp.asarray(mask))


def _readme_recipe() -> str:
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    found = [b for b in blocks if "AttentionInterface.register" in b]
    assert len(found) == 1, "README must hold one transformers recipe"
    return found[0]


def _fake_transformers(monkeypatch):
    """Just enough of transformers for the README's recipe: the two registries, and sdpa_mask
    (transformers' mask function: bool, True where a query may attend, or None for plain causal)."""
    registries = {"attention": {}, "mask": {}}

    class Registry:
        def __init__(self, which):
            self.which = which

        def register(self, name, fn):
            registries[self.which][name] = fn

    root = types.ModuleType("transformers")
    root.AttentionInterface, root.AttentionMaskInterface = Registry("attention"), Registry("mask")
    masking = types.ModuleType("transformers.masking_utils")
    masking.sdpa_mask = lambda *a, **k: None
    root.masking_utils = masking
    monkeypatch.setitem(sys.modules, "transformers", root)
    monkeypatch.setitem(sys.modules, "transformers.masking_utils", masking)
    return registries


def test_readme_transformers_recipe_matches_torch_sdpa(rng, monkeypatch):
    """The README's recipe, run as written against a stand-in for transformers' registries: registered
    under a name without "flash" (transformers takes such names for hub kernels), and its attention
    function, called as transformers calls one (query, key, value (batch, heads, seqlen, head_dim), a
    bool mask, an additive float mask of finfo.min or -inf, or None with is_causal), gives SDPA's output
    and gradients, in transformers' (batch, seqlen, heads, head_dim) layout."""
    registries = _fake_transformers(monkeypatch)
    exec(compile(_readme_recipe(), "README.md", "exec"), {})
    (name, fn), = registries["attention"].items()
    assert registries["mask"].keys() == {name} and "flash" not in name
    module = torch.nn.Module()
    module.is_causal, module.training = True, True
    B, H, Hkv, S, D = 2, 4, 2, 7, 8
    keep = np.arange(S)[None, :] < np.array([[S], [4]])
    allowed = keep[:, None, None, :] & np.tril(np.ones((S, S), bool))
    masks = {
        "bool": _t(allowed),
        "finfo.min": _t(np.where(allowed, 0, np.finfo(np.float32).min).astype(np.float32)),
        "-inf": _t(np.where(allowed, 0, -np.inf).astype(np.float32)),
        "None, causal": None,
    }
    for what, mask in masks.items():
        q = _t(rng.standard_normal((B, H, S, D)).astype(np.float32), True)
        k, v = (_t(rng.standard_normal((B, Hkv, S, D)).astype(np.float32), True) for _ in range(2))
        out, weights = fn(module, q, k, v, mask, dropout=0.0, scaling=0.4)
        assert weights is None and out.shape == (B, S, H, D)
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=0.4,
                                              enable_gqa=True).transpose(1, 2)
        dout = torch.randn_like(want)
        got_grads = torch.autograd.grad(out, (q, k, v), dout)
        want_grads = torch.autograd.grad(want, (q, k, v), dout)
        torch.testing.assert_close(out, want, msg=lambda m, what=what: f"{what}: {m}")
        for g, w in zip(got_grads, want_grads):
            torch.testing.assert_close(g, w, msg=lambda m, what=what: f"{what}: {m}")
    # in training the recipe drops weights under a seed from torch's generator (torch.manual_seed fixes
    # it), against the oracle's mask of that seed; in evaluation it drops none (SDPA's out, as above)
    torch.manual_seed(11)
    out, _ = fn(module, q, k, v, None, dropout=0.25, scaling=0.4)
    torch.manual_seed(11)
    seed = int(torch.randint(2**62, ()))
    grads = torch.autograd.grad(out, (q, k, v), dout)
    args = [np.ascontiguousarray(_np(x).transpose(0, 2, 1, 3)) for x in (q, k, v)]
    lse = flashcupy.attention(*args, causal=True, scale=0.4, return_lse=True)[1]  # undropped: not the recipe's
    assert_matches_oracle([_np(out), lse, *(_np(g).transpose(0, 2, 1, 3) for g in grads)], *args, _np(dout),
                          causal=True, scale=0.4, dropout_p=0.25, dropout_seed=seed, backend="numpy")
    module.training = False
    torch.testing.assert_close(fn(module, q, k, v, None, dropout=0.25, scaling=0.4)[0], want)


def test_varlen_autograd_is_per_sequence_attention(rng):
    lengths = [3, 1, 5]
    cu = _t(np.cumsum([0] + lengths).astype(np.int32))
    q = _t(rng.standard_normal((9, 2, 8)).astype(np.float32), True)
    k, v = (_t(rng.standard_normal((9, 1, 8)).astype(np.float32), True) for _ in range(2))
    dout = _t(rng.standard_normal((9, 2, 8)).astype(np.float32))
    # check_offsets reaches the custom ops (the NumPy backend, which loops on the host, checks them anyway)
    out, lse = flashcupy.attention_varlen(q, k, v, cu, cu, causal=True, return_lse=True, check_offsets=False)
    assert lse.requires_grad
    out.backward(dout)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        args = [_np(x)[None, a:b] for x in (q, k, v)]
        assert_matches_oracle([_np(out)[None, a:b], _np(lse)[None, :, a:b], *(_np(x.grad)[None, a:b] for x in (q, k, v))],
                              *args, _np(dout)[None, a:b], causal=True, backend="numpy")


@pytest.mark.gpu
def test_cuda_tensors_record_autograd_on_the_cupy_backend(rng):
    """CUDA tensors: the cupy backend on torch's current stream, gradients those of the CPU path."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device for torch")
    pytest.importorskip("cupy")
    q, k, v = make_qkv(rng, 1, 65, 65, 4, 2, 64, np.float32)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        tq, tk, tv = (_t(x).cuda().requires_grad_(True) for x in (q, k, v))
        out = flashcupy.attention(tq, tk, tv, causal=True)
        out.backward(_t(dout).cuda())
    torch.cuda.synchronize()
    lse = flashcupy.attention(q, k, v, causal=True, return_lse=True)[1]
    assert_matches_oracle([out.detach().cpu().numpy(), lse, *(x.grad.cpu().numpy() for x in (tq, tk, tv))],
                          q, k, v, dout, causal=True, backend="cupy")
    assert math.isfinite(float(out.detach().sum()))


def test_a_value_head_dim_of_its_own(rng):
    """v's head_dim unlike q's: gradcheck through out and lse with a bias, and torch.library.opcheck
    of the fake (meta) implementations, whose out takes v's head_dim, plain and packed."""
    q, k = (_t(x, True) for x in make_qkv(rng, 1, 5, 6, 2, 1, 8, np.float64)[:2])
    v = _t(rng.standard_normal((1, 6, 1, 3)), True)
    bias = _t(rng.standard_normal((1, 2, 5, 6)), True)

    def f(q, k, v, bias):
        out, lse = flashcupy.attention(q, k, v, bias=bias, causal=True, return_lse=True)
        return out, lse

    assert f(q, k, v, bias)[0].shape == (1, 5, 2, 3)
    assert torch.autograd.gradcheck(f, (q, k, v, bias))
    torch.library.opcheck(torch.ops.flashcupy.attention.default,
                          (q, k, v, bias, None, None, True, None, None, None, None, "auto", None, 0.0, 0, 0))
    cu = _t(np.array([0, 2, 5], np.int32))
    pq, pk, pv = (x.detach()[0].requires_grad_(True) for x in (q, k[:, :5], v[:, :5]))
    torch.library.opcheck(torch.ops.flashcupy.attention_varlen.default,
                          (pq, pk, pv, cu, cu, None, None, None, True, None, None, None, None, "auto", None, True,
                           0.0, 0, 0))


def test_dropout_gradients_are_of_the_dropped_attention(rng):
    """gradcheck through out and lse with dropout and a bias (the backward redraws the forward's mask:
    a fixed function of q, k, v, bias), out against the oracle, and a seed above 2**63, which torch's
    int64 arguments carry as two halves."""
    q, k, v = (_t(x, True) for x in make_qkv(rng, 1, 5, 6, 2, 1, 8, np.float64))
    bias = _t(rng.standard_normal((1, 2, 5, 6)), True)
    seed = 2**63 + 12345

    def f(q, k, v, bias):
        return flashcupy.attention(q, k, v, bias=bias, causal=True, return_lse=True, dropout_p=0.3, dropout_seed=seed)

    assert torch.autograd.gradcheck(f, (q, k, v, bias))
    want = reference.attention(*(x.detach().numpy() for x in (q, k, v)), bias=bias.detach().numpy(), causal=True,
                               dropout_p=0.3, dropout_seed=seed)
    np.testing.assert_allclose(f(q, k, v, bias)[0].detach().numpy(), want, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="dropout_seed must be given"):
        flashcupy.attention(q, k, v, dropout_p=0.3)


def test_dropout_in_a_packed_batch(rng):
    """attention_varlen with dropout: gradcheck through out and lse (sequence b drawn as batch b), and
    torch.library.opcheck of the ops with dropout's arguments."""
    cu = _t(np.array([0, 2, 5], np.int32))
    q, k, v = (_t(rng.standard_normal((5, 2, 4)), True) for _ in range(3))

    def f(q, k, v):
        return flashcupy.attention_varlen(q, k, v, cu, cu, causal=True, return_lse=True, dropout_p=0.4,
                                          dropout_seed=3)

    assert torch.autograd.gradcheck(f, (q, k, v))
    out = f(q, k, v)[0].detach().numpy()
    for b, (a, e) in enumerate(((0, 2), (2, 5))):
        want = reference.attention(*(x.detach().numpy()[None, a:e] for x in (q, k, v)), causal=True, dropout_p=0.4,
                                   dropout_seed=3, dropout_origin=(b, 0, 0, 0))
        np.testing.assert_allclose(out[a:e], want[0], rtol=1e-12, atol=1e-12)
    torch.library.opcheck(torch.ops.flashcupy.attention_varlen.default,
                          (q, k, v, cu, cu, None, None, None, True, None, None, None, None, "auto", None, True,
                           0.4, 3, 0))


def test_torch_func_transforms_and_forward_ad_are_refused(rng):
    # torch's custom ops take no forward-mode rule and no functorch transform: each is a TypeError naming
    # the argument before any work (they had failed inside on a tensor with no storage, and a forward-mode
    # dual tensor came back as an out with no tangent, as if constant); a plain call inside a dual level
    # still runs, and matches the oracle
    from torch.autograd import forward_ad

    q, k, v = (_t(x) for x in make_qkv(rng, 1, 5, 5, 2, 2, 8, np.float64))
    batched = torch.stack([q, q])
    transforms = {
        "vmap": lambda: torch.func.vmap(lambda q: flashcupy.attention(q, k[0], v[0]))(batched[:, 0]),
        "grad": lambda: torch.func.grad(lambda q: flashcupy.attention(q, k, v).sum())(q),
        "jvp": lambda: torch.func.jvp(lambda k: flashcupy.attention(q, k, v), (k,), (k,)),
        "jacrev": lambda: torch.func.jacrev(lambda v: flashcupy.attention(q, k, v))(v),
    }
    for name, call in transforms.items():
        with pytest.raises(TypeError, match=r"is a tensor of a torch.func transform .* flashcupy.attention does not"):
            call()
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(v, torch.ones_like(v))
        with pytest.raises(TypeError, match=r"v is a forward-mode dual tensor \(torch.autograd.forward_ad\)"):
            flashcupy.attention(q, k, dual)
        out = flashcupy.attention(q, k, v, causal=True)
    assert_matches_oracle([out.numpy()], *(x.numpy() for x in (q, k, v)), backend="numpy", causal=True)
