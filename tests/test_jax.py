"""flashcupy.jax: attention and attention_varlen on jax.Arrays under jit, grad and vmap, checked
against the oracle (and against jax.nn.dot_product_attention where it computes the same thing),
XLA's buffers used without copies, and the checks raised when JAX traces."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="jax[cpu] is in the test extra")
jnp = pytest.importorskip("jax.numpy")

import flashcupy.jax as fj  # noqa: E402
from flashcupy.backends import numpy_backend  # noqa: E402
from conftest import (BF16, assert_matches_oracle, bf16_bits, assert_probs_match_oracle, assert_tangent_matches_oracle,  # noqa: E402
                      expected)
from reference.compare import error_ratio  # noqa: E402


def to_jax(x):
    return jnp.asarray(x, dtype=x.dtype)


def arrays(rng, B, Sq, Sk, Hq, Hkv, D, dtype):
    q, k, v, dout = (rng.standard_normal(shape).astype(dtype) for shape in
                     ((B, Sq, Hq, D), (B, Sk, Hkv, D), (B, Sk, Hkv, D), (B, Sq, Hq, D)))
    return q, k, v, dout


@jax.jit
def _dot(x, y):
    """<x, y>: its gradient with respect to x is y exactly, so jax.grad of it gives the vjp of dout = y."""
    return jnp.vdot(x, y)


def _jitted(**static):
    """A jitted (out, lse, dq, dk, dv[, dbias]) of flashcupy.jax.attention: the forward with lse,
    and the gradient of <out, dout> (+ <lse, dlse> where dlse is given: through lse too) by jax.grad."""
    def run(q, k, v, dout, bias, mask, slopes, dlse=None):
        kw = dict(static, bias=bias, mask=mask, alibi_slopes=slopes)
        out, lse = fj.attention(q, k, v, return_lse=True, **kw)
        wrt = (0, 1, 2) if bias is None else (0, 1, 2, 3)

        def loss(q, k, v, bias):
            o, lse = fj.attention(q, k, v, return_lse=True, **dict(kw, bias=bias))
            return _dot(o, dout) + (0 if dlse is None else _dot(lse, dlse))
        return (out, lse) + jax.grad(loss, argnums=wrt)(q, k, v, bias)
    return jax.jit(run)


# (B, Sq, Sk, Hq, Hkv, D, keywords, modifier arrays): GQA and MQA, causal with Sq < Sk and Sq > Sk
# (rows that see no key), windows, a broadcast bias (dbias summed over batch), a mask, ALiBi, softcap
CASES = {
    "causal_gqa": (2, 9, 14, 4, 2, 8, dict(causal=True), {}),
    "causal_sq_gt_sk_mqa": (1, 13, 6, 2, 1, 8, dict(causal=True, scale=0.7), {}),
    "window": (1, 20, 20, 2, 2, 16, dict(window=(3, 2)), {}),
    "bias_broadcast": (2, 7, 11, 2, 1, 8, dict(causal=True), {"bias": (1, 2, 7, 11)}),
    "mask_alibi_softcap": (2, 8, 8, 2, 2, 8, dict(softcap=3.0), {"mask": (2, 1, 8, 8), "alibi_slopes": (2,)}),
}


def modifier_arrays(rng, shapes: dict, dtype):
    made = {}
    for name, shape in shapes.items():
        if name == "mask":
            m = rng.random(shape) < 0.7
            m[..., 0] = True
            made[name] = m
        elif name == "alibi_slopes":
            made[name] = rng.random(shape).astype(np.float32)
        else:
            made[name] = rng.standard_normal(shape).astype(dtype)
    return made


def check_case(rng, case, dtype, **extra):
    """A case's jitted forward and gradients, through out and lse (jax_enable_x64 decides lse's dtype)."""
    B, Sq, Sk, Hq, Hkv, D, kw, shapes = CASES[case]
    q, k, v, dout = arrays(rng, B, Sq, Sk, Hq, Hkv, D, dtype)
    mods = modifier_arrays(rng, shapes, dtype)
    dlse = rng.standard_normal((B, Hq, Sq)).astype(np.float64 if dtype == np.float64 else np.float32)
    run = _jitted(**kw, **extra)
    got = run(*map(to_jax, (q, k, v, dout)), *(None if mods.get(n) is None else to_jax(mods[n])
                                                 for n in ("bias", "mask", "alibi_slopes")), to_jax(dlse))
    got = [np.asarray(x) for x in got]
    assert got[0].dtype == q.dtype and got[2].dtype == q.dtype
    assert_matches_oracle(got, q, k, v, dout, backend="numpy", dlse=dlse, **kw, **mods)
    return got


@pytest.mark.parametrize("case", list(CASES))
def test_jit_and_grad_match_the_oracle_float32(rng, case):
    check_case(rng, case, np.float32)


@pytest.mark.parametrize("case", ["causal_gqa", "bias_broadcast"])
def test_float64_under_x64(rng, case):
    with jax.enable_x64(True):
        got = check_case(rng, case, np.float64)
    assert got[1].dtype == np.float64  # lse in the accumulation dtype


@pytest.mark.parametrize("case", ["causal_gqa", "bias_broadcast"])
def test_bfloat16_and_float16(rng, case):
    check_case(rng, case, BF16)
    check_case(rng, case, np.float16)


def test_bfloat16_bits_with_dtype_bfloat16_forward(rng):
    # the NumPy/CuPy way of passing bfloat16 (uint16 bits, dtype="bfloat16") works here too, forward
    q, k, v, _ = arrays(rng, 1, 6, 9, 2, 1, 8, BF16)
    bits = fj.attention(*(to_jax(x.view(np.uint16)) for x in (q, k, v)), causal=True, dtype="bfloat16")
    assert bits.dtype == jnp.uint16
    values = fj.attention(*map(to_jax, (q, k, v)), causal=True)
    np.testing.assert_array_equal(np.asarray(bits), np.asarray(values).view(np.uint16))
    assert_matches_oracle([np.asarray(bits)], q.view(np.uint16), k.view(np.uint16), v.view(np.uint16),
                          causal=True, dtype="bfloat16", backend="numpy")


# ----------------------------------------------------------------------------
# against jax.nn.dot_product_attention (XLA): both within the oracle's tolerance of each other


def close_to_xla(ours, theirs, want, name):
    """|ours - XLA's| within twice the oracle's tolerance for a correct kernel (each may be off by one)."""
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    tol = want.tol[name]
    assert np.all(np.abs(ours - theirs) <= 2 * tol), f"{name}: {np.max(np.abs(ours - theirs) / (2 * tol))}"


@pytest.mark.parametrize("what", ["causal_gqa_bias", "window_mask"])
def test_matches_jax_dot_product_attention(rng, what):
    B, S, Hq, Hkv, D = 2, 16, 4, 2, 8
    q, k, v, dout = arrays(rng, B, S, S, Hq, Hkv, D, np.float32)
    if what == "causal_gqa_bias":
        ours_kw, xla_kw = dict(causal=True), dict(is_causal=True)
        bias, mask = rng.standard_normal((1, Hq, S, S)).astype(np.float32), None
    else:
        ours_kw, xla_kw = dict(window=(4, 1)), dict(local_window_size=(4, 1))
        bias, mask = None, rng.random((B, 1, S, S)) < 0.8
        mask[..., :, :] |= np.eye(S, dtype=bool)  # every row sees its own key (in the window too)

    def grads(fn, bias):
        def loss(q, k, v, bias):
            return _dot(fn(q, k, v, bias), to_jax(dout))
        argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
        return jax.jit(jax.value_and_grad(loss, argnums=argnums))(*map(to_jax, (q, k, v)), bias)

    m = None if mask is None else to_jax(mask)
    b = None if bias is None else to_jax(bias)
    ours = grads(lambda q, k, v, bias: fj.attention(q, k, v, bias=bias, mask=m, **ours_kw), b)
    theirs = grads(lambda q, k, v, bias: jax.nn.dot_product_attention(q, k, v, bias=bias, mask=m,
                                                                      implementation="xla", **xla_kw), b)
    out_ours = fj.attention(*map(to_jax, (q, k, v)), bias=b, mask=m, **ours_kw)
    out_theirs = jax.nn.dot_product_attention(*map(to_jax, (q, k, v)), bias=b, mask=m, **xla_kw)
    want = expected(q, k, v, dout, family="numpy", bias=bias, mask=mask, **ours_kw)
    close_to_xla(out_ours, out_theirs, want, "out")
    for name, x, y in zip(("dq", "dk", "dv", "dbias"), ours[1], theirs[1]):
        close_to_xla(x, y, want, name)


# ----------------------------------------------------------------------------
# vmap


def test_vmap_folds_into_the_batch_and_grad_goes_through_jit_vmap(rng, monkeypatch):
    # q mapped (axis 1), k and v shared, a bias shared with a batch of 1: per element, the oracle's
    # answer; the gradient of the sum over elements through jit(vmap(...)), dbias summed over them
    N, B, S, Hq, Hkv, D = 3, 2, 10, 2, 1, 8
    q = rng.standard_normal((B, N, S, Hq, D)).astype(np.float32)
    _, k, v, _ = arrays(rng, B, S, S, Hq, Hkv, D, np.float32)
    dout = rng.standard_normal((N, B, S, Hq, D)).astype(np.float32)
    bias = rng.standard_normal((1, Hq, S, S)).astype(np.float32)
    calls = []
    forward = numpy_backend.forward
    monkeypatch.setattr(numpy_backend, "forward", lambda p, *a, **kw: calls.append(p.batch) or forward(p, *a, **kw))

    def per_element(q, k, v, bias):
        return fj.attention(q, k, v, bias=bias, causal=True)

    mapped = jax.vmap(per_element, in_axes=(1, None, None, None))
    loss = jax.jit(jax.value_and_grad(lambda q, k, v, bias: _dot(mapped(q, k, v, bias), to_jax(dout)),
                                      argnums=(0, 1, 2, 3)))
    out = jax.jit(mapped)(*map(to_jax, (q, k, v, bias)))
    assert calls == [N * B]  # one call, the mapped axis folded into the batch
    _, (dq, dk, dv, dbias) = loss(*map(to_jax, (q, k, v, bias)))
    sums = [np.zeros_like(x) for x in (k, v, bias)]
    for n in range(N):
        want = expected(q[:, n], k, v, dout[n], causal=True, bias=bias, family="numpy")
        got = [np.asarray(out[n]), None, np.asarray(dq[:, n])]
        for name, x in zip(("out", "dq"), (got[0], got[2])):
            assert error_ratio(x, want, name) <= 1, name
        for s, name in zip(sums, ("dk", "dv", "dbias")):
            s += want.want[name]
    # dk, dv and dbias are sums over the mapped elements: compare with the sum of the oracle's, to
    # the tolerance of each part added up
    for got, s, name in zip((dk, dv, dbias), sums, ("dk", "dv", "dbias")):
        tol = sum(expected(q[:, n], k, v, dout[n], causal=True, bias=bias, family="numpy").tol[name]
                  for n in range(N))
        assert np.all(np.abs(np.asarray(got) - s) <= tol), name


def test_per_example_dbias_through_vmap_of_grad(rng):
    # vmap(grad): each mapped element's own dbias, though the bias itself is not mapped
    N, B, S, H, D = 2, 2, 6, 2, 8
    q = rng.standard_normal((N, B, S, H, D)).astype(np.float32)
    _, k, v, _ = arrays(rng, B, S, S, H, H, D, np.float32)
    bias = rng.standard_normal((1, H, S, S)).astype(np.float32)
    dout = rng.standard_normal((N, B, S, H, D)).astype(np.float32)

    def dbias(q, dout, bias):
        return jax.grad(lambda bias: _dot(fj.attention(q, to_jax(k), to_jax(v), bias=bias), dout))(bias)

    got = jax.jit(jax.vmap(dbias, in_axes=(0, 0, None)))(to_jax(q), to_jax(dout), to_jax(bias))
    assert got.shape == (N,) + bias.shape
    for n in range(N):
        want = expected(q[n], k, v, dout[n], family="numpy", bias=bias)
        assert error_ratio(np.asarray(got[n]), want, "dbias") <= 1


def test_vmap_of_every_argument_with_modifiers(rng):
    # q, k, v, a bias with a batch of 1 (broadcast over the batch of 2 in the fold), a mask and
    # per-head ALiBi slopes all mapped: each element's out and gradients (its own dbias) are the
    # oracle's for that element
    N, B, S, Hq, Hkv, D = 2, 2, 7, 2, 1, 8
    q, k, v, dout = (rng.standard_normal((N,) + shape).astype(np.float32)
                     for shape in ((B, S, Hq, D), (B, S, Hkv, D), (B, S, Hkv, D), (B, S, Hq, D)))
    bias = rng.standard_normal((N, 1, Hq, S, S)).astype(np.float32)
    mask = rng.random((N, B, 1, S, S)) < 0.7
    mask[..., 0] = True
    slopes = rng.random((N, Hq)).astype(np.float32)

    def element(q, k, v, dout, bias, mask, slopes):
        def loss(q, k, v, bias):
            return _dot(fj.attention(q, k, v, bias=bias, mask=mask, alibi_slopes=slopes, causal=True), dout)
        out = fj.attention(q, k, v, bias=bias, mask=mask, alibi_slopes=slopes, causal=True, return_lse=True)
        return out + jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, bias)

    got = jax.jit(jax.vmap(element))(*map(to_jax, (q, k, v, dout, bias, mask, slopes)))
    for n in range(N):
        assert_matches_oracle([np.asarray(x[n]) for x in got], q[n], k[n], v[n], dout[n], causal=True,
                              bias=bias[n], mask=mask[n], alibi_slopes=slopes[n], backend="numpy")


def test_nested_vmap_all_mapped(rng):
    N1, N2, B, S, H, D = 2, 2, 1, 5, 1, 8
    q, k, v = (rng.standard_normal((N1, N2, B, S, H, D)).astype(np.float32) for _ in range(3))
    out = jax.jit(jax.vmap(jax.vmap(lambda q, k, v: fj.attention(q, k, v, causal=True))))(*map(to_jax, (q, k, v)))
    for i in range(N1):
        for j in range(N2):
            assert_matches_oracle([np.asarray(out[i, j])], q[i, j], k[i, j], v[i, j], causal=True, backend="numpy")


# ----------------------------------------------------------------------------
# varlen


def test_varlen_jit_grad_vmap(rng):
    lengths_q, lengths_k = [5, 0, 9, 3], [7, 4, 9, 0]
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    Hq, Hkv, D = 2, 1, 8
    q = rng.standard_normal((cu_q[-1], Hq, D)).astype(np.float32)
    k, v = (rng.standard_normal((cu_k[-1], Hkv, D)).astype(np.float32) for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(np.float32)
    dlse = rng.standard_normal((Hq, cu_q[-1])).astype(np.float32)
    kw = dict(causal=True, window=(4, None))

    def attend(q, k, v):
        return fj.attention_varlen(q, k, v, cu_q, cu_k, **kw)

    def loss(q, k, v, dout, dlse):  # through out and lse
        out, lse = fj.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **kw)
        return _dot(out, dout) + _dot(lse, dlse)

    run = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    out, lse = jax.jit(lambda q, k, v: fj.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **kw))(
        *map(to_jax, (q, k, v)))
    _, (dq, dk, dv) = run(*map(to_jax, (q, k, v, dout, dlse)))
    for b in range(len(lengths_q)):
        (qa, qb), (ka, kb) = cu_q[b:b + 2], cu_k[b:b + 2]
        got = [np.asarray(x)[None, qa:qb] for x in (out,)] + [np.asarray(lse)[None, :, qa:qb]]
        got += [np.asarray(dq)[None, qa:qb], np.asarray(dk)[None, ka:kb], np.asarray(dv)[None, ka:kb]]
        assert_matches_oracle(got, q[None, qa:qb], k[None, ka:kb], v[None, ka:kb], dout[None, qa:qb], backend="numpy",
                              dlse=dlse[None, :, qa:qb], **kw)
    # vmap: the mapped packings concatenated into one call; per element the unmapped answer
    qs = np.stack([q, -q])
    mapped = jax.jit(jax.vmap(attend, in_axes=(0, None, None)))(to_jax(qs), to_jax(k), to_jax(v))
    np.testing.assert_array_equal(np.asarray(mapped[0]), np.asarray(out))
    np.testing.assert_array_equal(np.asarray(mapped[1]), np.asarray(attend(to_jax(-q), to_jax(k), to_jax(v))))


# ----------------------------------------------------------------------------
# XLA's buffers, no copies


def test_the_backend_reads_and_writes_xla_buffers_in_place(rng, monkeypatch):
    # the arrays the NumPy backend gets are XLA's input buffers (same address as the jax.Arrays
    # passed in) and the arrays it writes are XLA's output buffers (same address as the results);
    # bfloat16 goes as the same memory read as uint16 bits
    seen = {}
    forward, backward = numpy_backend.forward, numpy_backend.backward

    def spy_forward(p, q, k, v, into=None):
        result = forward(p, q, k, v, into=into)
        seen["forward"] = (q, result, into, p.dtype)
        return result

    def spy_backward(p, dout, q, k, v, out, lse, into=None):
        result = backward(p, dout, q, k, v, out, lse, into=into)
        seen["backward"] = (dout, result, into)
        return result

    monkeypatch.setattr(numpy_backend, "forward", spy_forward)
    monkeypatch.setattr(numpy_backend, "backward", spy_backward)
    address = lambda x: x.__array_interface__["data"][0]  # noqa: E731
    for dtype in (np.float32, BF16):
        q, k, v, dout = map(to_jax, arrays(rng, 1, 8, 8, 2, 2, 8, dtype))
        bias = to_jax(rng.standard_normal((1, 2, 8, 8)).astype(np.float32))
        out, lse = jax.jit(lambda q, k, v: fj.attention(q, k, v, causal=True, return_lse=True))(q, k, v)
        q_seen, result, into, value = seen["forward"]
        assert value == np.dtype(dtype).name and q_seen.dtype == (np.uint16 if dtype is BF16 else dtype)
        assert address(q_seen) == q.unsafe_buffer_pointer()
        assert [address(x) for x in into] == [address(x) for x in result]
        assert [address(x) for x in into] == [out.unsafe_buffer_pointer(), lse.unsafe_buffer_pointer()]

        grads = jax.jit(jax.vjp(lambda q, k, v, bias: fj.attention(q, k, v, bias=bias), q, k, v, bias)[1])(dout)
        dout_seen, result, into = seen["backward"]
        assert address(dout_seen) == dout.unsafe_buffer_pointer()
        assert [address(x) for x in into] == [address(x) for x in result]
        assert [address(x) for x in into] == [g.unsafe_buffer_pointer() for g in grads]


def test_cupy_backend_writes_into_xla_buffers_on_the_emulator(rng):
    # the GPU path's backend side (the cupy backend's into=, dbias included) on the CPU CUDA
    # emulator, with XLA's host buffers standing in for device ones
    from flashcupy.tools.emulator.cupy import emulated

    B, S, H, D = 1, 9, 2, 8
    q, k, v, dout = arrays(rng, B, S, S, H, H, D, np.float32)
    bias = rng.standard_normal((1, H, S, S)).astype(np.float32)
    with emulated():
        got = _jitted(causal=True, backend="cupy")(*map(to_jax, (q, k, v, dout, bias)), None, None)
    assert_matches_oracle([np.asarray(x) for x in got], q, k, v, dout, causal=True, bias=bias, backend="cupy")


def test_cupy_packed_batch_is_one_launch_per_kernel_through_jax_on_the_emulator(rng):
    # attention_varlen under jit and grad on the cupy backend (emulated, XLA's host buffers standing in for
    # device ones): the offsets are constants of the program, and the kernels read them (forward 1 launch,
    # backward 3: the D pre-pass, dK/dV, dQ), whatever the number of sequences; empty sequences included
    from flashcupy.tools.emulator.cupy import emulated, launch_records
    lengths_q, lengths_k = [5, 0, 9, 3, 1], [7, 4, 9, 0, 2]
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (lengths_q, lengths_k))
    q = rng.standard_normal((cu_q[-1], 2, 8)).astype(np.float32)
    k, v = (rng.standard_normal((cu_k[-1], 1, 8)).astype(np.float32) for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(np.float32)
    kw = dict(causal=True, backend="cupy")
    grids = []
    with emulated(compile=launch_records(grids)):
        out, lse = jax.jit(lambda q, k, v: fj.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **kw))(
            *map(to_jax, (q, k, v)))
        forward = [name for name, _ in grids]
        grads = jax.jit(jax.grad(lambda q, k, v: _dot(fj.attention_varlen(q, k, v, cu_q, cu_k, **kw), to_jax(dout)),
                                 argnums=(0, 1, 2)))(*map(to_jax, (q, k, v)))
    assert [name.split("<")[0] for name in forward] == ["flash_fwd"] and forward[0].endswith(", true>"), forward
    backward = [name.split("<")[0] for name, _ in grids[2:]]  # the grad's own forward first
    assert backward == ["flash_bwd_preprocess", "flash_bwd_dkdv", "flash_bwd_dq"], grids
    for b in range(len(lengths_q)):
        (qa, qb), (ka, kb) = cu_q[b:b + 2], cu_k[b:b + 2]
        got = [np.asarray(out)[None, qa:qb], np.asarray(lse)[None, :, qa:qb], np.asarray(grads[0])[None, qa:qb],
               np.asarray(grads[1])[None, ka:kb], np.asarray(grads[2])[None, ka:kb]]
        assert_matches_oracle(got, q[None, qa:qb], k[None, ka:kb], v[None, ka:kb], dout[None, qa:qb], causal=True,
                              backend="cupy")


# ----------------------------------------------------------------------------
# errors, raised when JAX traces


def traced(fn, *args):
    """fn's abstract evaluation: only tracing runs, never the callback."""
    return jax.eval_shape(fn, *args)


def test_errors_are_raised_at_trace_time(rng):
    q, k, v, _ = map(to_jax, arrays(rng, 1, 8, 8, 2, 2, 8, np.float32))
    s = jax.ShapeDtypeStruct
    with pytest.raises(ValueError, match="k must have q's head_dim 8, got 4"):
        traced(fj.attention, q, s((1, 8, 2, 4), np.float32), s((1, 8, 2, 4), np.float32))
    with pytest.raises(ValueError, match="heads_q must be a multiple of heads_kv"):
        traced(fj.attention, s((1, 8, 3, 8), np.float32), k, v)
    with pytest.raises(TypeError, match="must share one dtype"):
        traced(fj.attention, q.astype(jnp.float16), k, v)
    with pytest.raises(ValueError, match="bias must be broadcastable"):
        traced(lambda q, b: fj.attention(q, k, v, bias=b), q, s((1, 2, 8, 7), np.float32))
    with pytest.raises(TypeError, match="mask must have dtype bool"):
        traced(lambda q, m: fj.attention(q, k, v, mask=m), q, s((1, 2, 8, 8), np.float32))
    with pytest.raises(TypeError, match="window must be"):
        traced(lambda q: fj.attention(q, k, v, window=3), q)
    with pytest.raises(TypeError, match="scale must be a real number"):
        traced(lambda q, scale: fj.attention(q, k, v, scale=scale), q, s((), np.float32))
    with pytest.raises(TypeError, match="q must be a jax.Array, got numpy.ndarray"):
        fj.attention(np.asarray(q), k, v)
    with pytest.raises(ValueError, match="backend must be 'auto' or one of"):
        traced(lambda q: fj.attention(q, k, v, backend="torch"), q)



def test_varlen_errors_at_trace_time(rng):
    q = jax.ShapeDtypeStruct((10, 2, 8), np.float32)
    cu = np.array([0, 4, 10], np.int32)
    with pytest.raises(ValueError, match="cu_seqlens_k must start at 0, never decrease and end at 10"):
        traced(lambda q: fj.attention_varlen(q, q, q, cu, np.array([0, 6, 9], np.int32)), q)
    with pytest.raises(TypeError, match="cu_seqlens_q must have dtype int32"):
        traced(lambda q: fj.attention_varlen(q, q, q, cu.astype(np.int64), cu), q)
    with pytest.raises(TypeError, match="cu_seqlens_q must be known when JAX traces"):
        traced(lambda q, cu: fj.attention_varlen(q, q, q, cu, np.array([0, 4, 10], np.int32)), q, jax.ShapeDtypeStruct((3,), np.int32))
    with pytest.raises(ValueError, match="q must have rank 3"):
        traced(lambda q: fj.attention_varlen(q[None], q, q, cu, cu), q)


def test_leading_batch_dimensions(rng):
    """q (2, 3, S, H, D) with a pair bias (2, 1, H, S, S) shared over the second leading dimension and a
    mask with fewer leading dimensions (flashcupy/_batch.py), under jit, grad (dbias of the bias's own
    shape) and vmap over a further axis."""
    q, k, v, dout = (rng.standard_normal((2, 3, 9, 4, 8)).astype(np.float32) for _ in range(4))
    k, v = k[..., :2, :], v[..., :2, :]
    bias = rng.standard_normal((2, 1, 4, 9, 9)).astype(np.float32)
    mask = rng.random((9, 9)) < 0.8
    mask[:, 0] = True

    def loss(q, k, v, bias):
        return jnp.sum(fj.attention(q, k, v, bias=bias, mask=jnp.asarray(mask), causal=True) * jnp.asarray(dout))

    out, lse = jax.jit(lambda *a: fj.attention(*a, bias=jnp.asarray(bias), mask=jnp.asarray(mask), causal=True,
                                                return_lse=True))(*map(jnp.asarray, (q, k, v)))
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*map(jnp.asarray, (q, k, v, bias)))
    assert grads[3].shape == bias.shape
    assert_matches_oracle((out, lse, *grads), q, k, v, dout, bias=bias, mask=mask, causal=True, backend="numpy")
    stacked = jax.vmap(jax.grad(loss, argnums=3), in_axes=(0, None, None, None))(
        jnp.asarray(np.stack([q, q[::-1]])), *map(jnp.asarray, (k, v, bias)))
    np.testing.assert_allclose(np.asarray(stacked[0]), np.asarray(grads[3]), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("Sq, Sk", [(0, 5), (4, 0), (0, 0)])
def test_leading_batch_dimensions_with_an_empty_sequence(rng, Sq, Sk):
    # out 0, lse -inf and zero gradients, as the NumPy entry point gives (the stand-ins' fold of the
    # leading dimensions once failed where a sequence was empty)
    q, dout = (rng.standard_normal((2, 3, Sq, 2, 8)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((2, 3, Sk, 2, 8)).astype(np.float32) for _ in range(2))
    bias = rng.standard_normal((1, 1, 2, Sq, Sk)).astype(np.float32)

    def loss(q, k, v, bias):
        return jnp.sum(fj.attention(q, k, v, bias=bias, causal=True) * jnp.asarray(dout))

    out, lse = jax.jit(lambda q, k, v, b: fj.attention(q, k, v, bias=b, causal=True, return_lse=True))(
        *map(jnp.asarray, (q, k, v, bias)))
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*map(jnp.asarray, (q, k, v, bias)))
    assert [x.shape for x in grads] == [q.shape, k.shape, v.shape, bias.shape]
    assert_matches_oracle((out, lse, *grads), q, k, v, dout, bias=bias, causal=True, backend="numpy")
    # forward mode through q, k, v and the bias: zeros of out's and lse's shapes
    tangents = tangents_of(rng, q, k, v, bias)
    _, (out_t, lse_t) = jitted_bias_jvp(causal=True)(*map(to_jax, (q, k, v, bias)), list(map(to_jax, tangents)))
    assert out_t.shape == out.shape and lse_t.shape == lse.shape
    assert not np.asarray(out_t).any() and not np.asarray(lse_t).any()


@pytest.mark.parametrize("head_dim_v", [3, 20])
def test_a_value_head_dim_of_its_own(rng, head_dim_v):
    """v's head_dim unlike q's: out's and dout's avals follow v's, under jit, grad (with dbias) and vmap,
    and in a packed batch."""
    B, Sq, Sk, Hq, Hkv, D = 2, 7, 11, 2, 1, 8
    q, k, _, _ = arrays(rng, B, Sq, Sk, Hq, Hkv, D, np.float32)
    v = rng.standard_normal((B, Sk, Hkv, head_dim_v)).astype(np.float32)
    dout = rng.standard_normal((B, Sq, Hq, head_dim_v)).astype(np.float32)
    bias = rng.standard_normal((1, Hq, Sq, Sk)).astype(np.float32)
    dlse = rng.standard_normal((B, Hq, Sq)).astype(np.float32)
    got = _jitted(causal=True)(*map(to_jax, (q, k, v, dout)), to_jax(bias), None, None, to_jax(dlse))
    got = [np.asarray(x) for x in got]
    assert got[0].shape == (B, Sq, Hq, head_dim_v)
    assert_matches_oracle(got, q, k, v, dout, backend="numpy", dlse=dlse, causal=True, bias=bias)
    def attend(q, v):
        return fj.attention(q, to_jax(k), v, causal=True)
    mapped = jax.jit(jax.vmap(attend))(to_jax(np.stack([q, -q])), to_jax(np.stack([v, 2 * v])))
    for x, (qx, vx) in zip(mapped, ((q, v), (-q, 2 * v))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(attend(to_jax(qx), to_jax(vx))))
    cu = np.array([0, 3, 7], np.int32)
    packed = [np.ascontiguousarray(x[0, :7]) for x in (q, k, v)]
    out = np.asarray(jax.jit(lambda q, k, v: fj.attention_varlen(q, k, v, cu, cu, causal=True))(*map(to_jax, packed)))
    for a, b in ((0, 3), (3, 7)):
        assert_matches_oracle((out[None, a:b],), *(x[None, a:b] for x in packed), backend="numpy", causal=True)


def _seed_of(words) -> int:
    words = np.asarray(words)
    return int(words[0]) | int(words[1]) << 32


def test_dropout_with_a_traced_key_under_jit_grad_and_vmap(rng):
    """dropout_seed as a PRNG key passed through jax.jit (an operand: a new key, no new trace), the
    gradients through out and lse with a bias; as a static int; under vmap one seed serves the folded
    batch, whose elements draw their own parts of the mask (the oracle's batch of the fold); a mapped
    seed is refused; and a packed batch draws sequence b as batch b."""
    B, Sq, Sk, Hq, Hkv, D = 2, 7, 11, 2, 1, 8
    q, k, v, dout = arrays(rng, B, Sq, Sk, Hq, Hkv, D, np.float32)
    bias = rng.standard_normal((1, Hq, Sq, Sk)).astype(np.float32)
    dlse = rng.standard_normal((B, Hq, Sq)).astype(np.float32)
    traces = []

    @jax.jit
    def run(q, k, v, dout, bias, dlse, key):
        traces.append(1)
        kw = dict(causal=True, dropout_p=0.3, dropout_seed=key)

        def loss(q, k, v, bias):
            o, lse = fj.attention(q, k, v, bias=bias, return_lse=True, **kw)
            return _dot(o, dout) + _dot(lse, dlse)
        return fj.attention(q, k, v, bias=bias, return_lse=True, **kw) + jax.grad(loss, argnums=(0, 1, 2, 3))(
            q, k, v, bias)

    for n in (0, 1):
        key = jax.random.key(n)
        got = [np.asarray(x) for x in run(*map(to_jax, (q, k, v, dout, bias, dlse)), key)]
        assert_matches_oracle(got, q, k, v, dout, backend="numpy", dlse=dlse, causal=True, bias=bias, dropout_p=0.3,
                              dropout_seed=_seed_of(jax.random.key_data(key)))
    assert len(traces) == 1
    static = np.asarray(fj.attention(*map(to_jax, (q, k, v)), dropout_p=0.5, dropout_seed=2**63 + 1))
    assert_matches_oracle((static,), q, k, v, backend="numpy", dropout_p=0.5, dropout_seed=2**63 + 1)
    words = jnp.array([5, 6], jnp.uint32)
    mapped = jax.jit(jax.vmap(lambda q: fj.attention(q, to_jax(k), to_jax(v), dropout_p=0.5, dropout_seed=words)))(
        to_jax(np.stack([q, -q])))
    folded = np.concatenate([q, -q])
    assert_matches_oracle((np.asarray(mapped).reshape(folded.shape),), folded, np.concatenate([k, k]),
                          np.concatenate([v, v]), backend="numpy", dropout_p=0.5, dropout_seed=5 | 6 << 32)
    with pytest.raises(ValueError, match="under jax.vmap, dropout_seed must not be mapped"):
        jax.vmap(lambda w: fj.attention(*map(to_jax, (q, k, v)), dropout_p=0.5, dropout_seed=w))(
            jnp.ones((2, 2), jnp.uint32))
    with pytest.raises(ValueError, match="dropout_seed must be an int, a PRNG key or a uint32 array of shape"):
        fj.attention(*map(to_jax, (q, k, v)), dropout_p=0.5, dropout_seed=jnp.ones(3, jnp.uint32))
    cu = np.array([0, 3, 7], np.int32)
    packed = [np.ascontiguousarray(x[0, :7]) for x in (q, k, v)]
    out = np.asarray(jax.jit(lambda q, k, v, w: fj.attention_varlen(q, k, v, cu, cu, causal=True, dropout_p=0.4,
                                                                    dropout_seed=w))(*map(to_jax, packed), words))
    for b, (a, e) in enumerate(((0, 3), (3, 7))):
        assert_matches_oracle((out[None, a:e],), *(x[None, a:e] for x in packed), backend="numpy", causal=True,
                              dropout_p=0.4, dropout_seed=5 | 6 << 32, dropout_origin=(b, 0, 0, 0))


# ----------------------------------------------------------------------------
# forward mode: jax.jvp, jax.jacfwd, jax.linearize


def tangents_of(rng, *arrays_):
    return [rng.standard_normal(x.shape).astype(x.dtype) for x in arrays_]


def jitted_jvp(**keywords):
    """jit(jvp) of (out, lse) of flashcupy.jax.attention in q, k and v; the modifiers' arrays held constant."""
    def run(q, k, v, q_t, k_t, v_t, bias=None, mask=None, slopes=None):
        def f(q, k, v):
            return fj.attention(q, k, v, bias=bias, mask=mask, alibi_slopes=slopes, return_lse=True, **keywords)
        return jax.jvp(f, (q, k, v), (q_t, k_t, v_t))
    return jax.jit(run)


def check_tangent_case(rng, case, dtype):
    B, Sq, Sk, Hq, Hkv, D, kw, shapes = CASES[case]
    q, k, v, _ = arrays(rng, B, Sq, Sk, Hq, Hkv, D, dtype)
    tangents = tangents_of(rng, q, k, v)
    mods = modifier_arrays(rng, shapes, dtype)
    (out, lse), (out_t, lse_t) = jitted_jvp(**kw)(*map(to_jax, (q, k, v, *tangents)), *(
        None if mods.get(n) is None else to_jax(mods[n]) for n in ("bias", "mask", "alibi_slopes")))
    assert out_t.dtype == q.dtype and lse_t.dtype == lse.dtype
    assert_matches_oracle([np.asarray(out), np.asarray(lse)], q, k, v, backend="numpy", **kw, **mods)
    assert_tangent_matches_oracle(out_t, lse_t, q, k, v, tangents, backend="numpy", **kw, **mods)


@pytest.mark.parametrize("case", list(CASES))
def test_jvp_matches_the_oracle_float32(rng, case):
    # causal with rows that see no key (their tangents 0), GQA and MQA, a window, a constant bias,
    # a mask, ALiBi and the softcap, through out and lse
    check_tangent_case(rng, case, np.float32)


def test_jvp_float64_bfloat16_and_float16(rng):
    with jax.enable_x64(True):
        check_tangent_case(rng, "causal_gqa", np.float64)
    check_tangent_case(rng, "mask_alibi_softcap", BF16)
    check_tangent_case(rng, "causal_sq_gt_sk_mqa", np.float16)


def test_jvp_of_some_operands_linearize_and_a_head_dim_of_its_own(rng):
    # tangents of q alone, k alone, v alone (the others symbolic zeros: their work skipped), v's head
    # dim 5 against q's 8, and jax.linearize's linear function, evaluated twice
    q, k, v, _ = arrays(rng, 2, 6, 9, 2, 1, 8, np.float32)
    v = rng.standard_normal((2, 9, 1, 5)).astype(np.float32)
    q_t, k_t, v_t = tangents_of(rng, q, k, v)
    kw = dict(causal=True, window=(3, None))

    def f(q, k, v):
        return fj.attention(q, k, v, return_lse=True, **kw)
    Q, K, V = map(to_jax, (q, k, v))
    for which, tangents in (("q", (q_t, None, None)), ("k", (None, k_t, None)), ("v", (None, None, v_t))):
        index = "qkv".index(which)
        _, (out_t, lse_t) = jax.jvp(lambda x: f(*(x if i == index else y for i, y in enumerate((Q, K, V)))),
                                    ((Q, K, V)[index],), (to_jax(tangents[index]),))
        assert_tangent_matches_oracle(out_t, lse_t, q, k, v, tangents, backend="numpy", **kw)
    _, linear = jax.linearize(f, Q, K, V)
    for scale in (1.0, -2.0):
        out_t, lse_t = linear(*(to_jax(scale * x) for x in (q_t, k_t, v_t)))
        assert_tangent_matches_oracle(out_t, lse_t, q, k, v, [scale * x for x in (q_t, k_t, v_t)], backend="numpy",
                                      **kw)
    # its transpose (NetKet's J^T J v: linearize, then linear_transpose) is the package's backward
    dout = rng.standard_normal(out_t.shape).astype(np.float32)
    dlse = rng.standard_normal(lse_t.shape).astype(np.float32)
    grads = jax.linear_transpose(linear, Q, K, V)((to_jax(dout), to_jax(dlse)))
    assert_matches_oracle([np.asarray(f(Q, K, V)[0]), np.asarray(f(Q, K, V)[1]), *map(np.asarray, grads)], q, k, v,
                          dout, backend="numpy", dlse=dlse, **kw)


def test_jacfwd_jacrev_and_xla_agree(rng):
    # the whole Jacobian, forward (jacfwd: vmap of jvp, the basis folded into the batch) and reverse,
    # against XLA's attention's, within twice the oracle's tolerance of the jvp along each basis vector
    # (Sq = Sk: XLA's is_causal is top-left aligned, ours bottom-right)
    q, k, v, _ = arrays(rng, 1, 4, 4, 2, 1, 4, np.float32)
    Q, K, V = map(to_jax, (q, k, v))
    for index in range(3):
        def ours(x):
            return fj.attention(*(x if i == index else y for i, y in enumerate((Q, K, V))), causal=True)

        def xla(x):
            return jax.nn.dot_product_attention(*(x if i == index else y for i, y in enumerate((Q, K, V))),
                                                is_causal=True, implementation="xla")
        forward, reverse, theirs = (np.asarray(jax.jit(how(fn))((Q, K, V)[index]))
                                    for how, fn in ((jax.jacfwd, ours), (jax.jacrev, ours), (jax.jacfwd, xla)))
        x = (q, k, v)[index]
        for e in range(x.size):
            basis = np.zeros(x.size, np.float32)
            basis[e] = 1
            tangents = [basis.reshape(x.shape) if i == index else None for i in range(3)]
            tol = 2 * expected(q, k, v, family="numpy", causal=True, tangents=tangents).tol["out_t"]
            column = (Ellipsis,) + np.unravel_index(e, x.shape)
            for got in (forward[column], reverse[column]):
                assert np.all(np.abs(got - theirs[column]) <= tol), (index, e)


def test_jvp_under_vmap_and_vmap_under_jvp(rng):
    # vmap(jvp): tangents mapped, primals shared (broadcast in the fold); jvp(vmap): everything mapped;
    # both one folded call each, checked element by element
    N, B, S, Hq, Hkv, D = 3, 1, 7, 2, 1, 8
    q, k, v, _ = arrays(rng, B, S, S, Hq, Hkv, D, np.float32)
    q_t, k_t, v_t = (rng.standard_normal((N,) + x.shape).astype(np.float32) for x in (q, k, v))

    def f(q, k, v):
        return fj.attention(q, k, v, causal=True, return_lse=True)
    _, (out_t, lse_t) = jax.jit(jax.vmap(lambda a, b, c: jax.jvp(f, tuple(map(to_jax, (q, k, v))), (a, b, c))))(
        *map(to_jax, (q_t, k_t, v_t)))
    for n in range(N):
        assert_tangent_matches_oracle(out_t[n], lse_t[n], q, k, v, (q_t[n], k_t[n], v_t[n]), backend="numpy",
                                      causal=True)
    Q, K, V = (np.stack([x, 0.5 * x, -x]) for x in (q, k, v))
    _, (out_t, lse_t) = jax.jit(lambda *a: jax.jvp(jax.vmap(f), a[:3], a[3:]))(*map(to_jax, (Q, K, V, q_t, k_t, v_t)))
    for n in range(N):
        assert_tangent_matches_oracle(out_t[n], lse_t[n], Q[n], K[n], V[n], (q_t[n], k_t[n], v_t[n]),
                                      backend="numpy", causal=True)


def test_jvp_with_dropout_and_of_a_packed_batch(rng):
    # dropout: A and E from the dropped weights, mu (lse's tangent) from the undropped ones; a packed
    # batch (an empty sequence among them) through jit and through vmap (tangents mapped)
    q, k, v, _ = arrays(rng, 2, 7, 11, 2, 1, 8, np.float32)
    tangents = tangents_of(rng, q, k, v)
    kw = dict(causal=True, dropout_p=0.3, dropout_seed=11)
    _, (out_t, lse_t) = jitted_jvp(**kw)(*map(to_jax, (q, k, v, *tangents)))
    assert_tangent_matches_oracle(out_t, lse_t, q, k, v, tangents, backend="numpy", **kw)

    lengths_q, lengths_k = [5, 0, 9], [7, 4, 6]
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lengths_q, lengths_k))
    q = rng.standard_normal((cu_q[-1], 4, 8)).astype(np.float32)
    k, v = (rng.standard_normal((cu_k[-1], 2, 8)).astype(np.float32) for _ in range(2))
    tangents = tangents_of(rng, q, k, v)

    def f(q, k, v):
        return fj.attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True)
    _, (out_t, lse_t) = jax.jit(lambda *a: jax.jvp(f, a[:3], a[3:]))(*map(to_jax, (q, k, v, *tangents)))
    twice = jax.jit(jax.vmap(lambda *t: jax.jvp(f, tuple(map(to_jax, (q, k, v))), t)[1]))(
        *(to_jax(np.stack([x, -2 * x])) for x in tangents))
    for b in range(len(lengths_q)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        part = [None if x is None else x[None] for x in (q[rows], k[keys], v[keys])]
        part_t = [x[None] for x in (tangents[0][rows], tangents[1][keys], tangents[2][keys])]
        for scale, (o, lse) in ((1, (out_t, lse_t)), (-2, (twice[0][1], twice[1][1]))):
            assert_tangent_matches_oracle(np.asarray(o)[None, rows] / scale, np.asarray(lse)[None, :, rows] / scale,
                                          *part, part_t, backend="numpy", causal=True)


def test_reverse_mode_through_jvp_of_grad_and_forward_mode_refusals(rng):
    # grad still runs the package's backward (the tangent's transpose); a bias's tangent with dropout, a
    # second derivative and a head dim the widened backward cannot take are refused when JAX traces
    q, k, v, _ = map(to_jax, arrays(rng, 1, 6, 6, 2, 1, 8, np.float32))
    bias = to_jax(rng.standard_normal((1, 2, 6, 6)).astype(np.float32))
    with pytest.raises(ValueError, match="bias: flashcupy.jax has no forward mode .* with dropout_p > 0"):
        jax.jit(lambda b, t: jax.jvp(lambda b: fj.attention(q, k, v, bias=b, dropout_p=0.1, dropout_seed=1),
                                     (b,), (t,))).lower(bias, bias)
    with pytest.raises(NotImplementedError, match="differentiates once"):
        jax.hessian(lambda q: jnp.sum(fj.attention(q, k, v)))(q)
    with pytest.raises(NotImplementedError, match="differentiates once"):
        jax.jacfwd(jax.grad(lambda q: jnp.sum(fj.attention(q, k, v))))(q)
    dbias = jax.grad(lambda b: jnp.sum(fj.attention(q, k, v, bias=b) ** 2))(bias)  # reverse mode takes it
    assert dbias.shape == bias.shape and np.all(np.isfinite(np.asarray(dbias)))


def test_cupy_jvp_on_the_emulator(rng, monkeypatch):
    # the GPU path's forward mode on the CPU CUDA emulator: float16 at head dim 192, whose widened
    # backward (k with v's 192 columns and the ones) goes in four slices of 64 columns under the 256
    # limit, each twice (dO = (q_t, q) would be 384 wide: the two parts one at a time), on the
    # tensor-core kernels; float32 with dropout on the SIMT kernels (A's call and mu's); a packed
    # batch (the packed kernels, their offsets on the device); 256 is refused at trace time
    from flashcupy.tools.emulator.cupy import emulated, launch_records

    for D, dtype, kw, calls in ((192, np.float16, dict(causal=True), 8),
                                (24, np.float32, dict(dropout_p=0.25, dropout_seed=3), 2)):
        q, k, v, _ = arrays(rng, 1, 9, 13, 2, 1, D, dtype)
        tangents = tangents_of(rng, q, k, v)
        launches = []
        with emulated(compile=launch_records(launches)):
            _, (out_t, lse_t) = jitted_jvp(backend="cupy", **kw)(*map(to_jax, (q, k, v, *tangents)))
        assert_tangent_matches_oracle(out_t, lse_t, q, k, v, tangents, backend=None, **kw)
        preprocesses = sum("flash_bwd_preprocess" in str(r) for r in launches)
        assert preprocesses == calls
    cu_q, cu_k = np.array([0, 5, 5, 12], np.int32), np.array([0, 9, 13, 20], np.int32)  # an empty sequence
    q = rng.standard_normal((12, 4, 64)).astype(np.float16)
    k, v = (rng.standard_normal((20, 2, 64)).astype(np.float16) for _ in range(2))
    tangents = tangents_of(rng, q, k, v)
    with emulated():
        _, (out_t, lse_t) = jax.jit(lambda *a: jax.jvp(
            lambda q, k, v: fj.attention_varlen(q, k, v, cu_q, cu_k, causal=True, backend="cupy", return_lse=True),
            a[:3], a[3:]))(*map(to_jax, (q, k, v, *tangents)))
    for b in range(3):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        assert_tangent_matches_oracle(np.asarray(out_t)[None, rows], np.asarray(lse_t)[None, :, rows], q[None, rows],
                                      k[None, keys], v[None, keys],
                                      (tangents[0][None, rows], tangents[1][None, keys], tangents[2][None, keys]),
                                      backend=None, causal=True)
    # through a bias alone: its sums from flash_probs's P (float16, GQA, a (1, 1, Sq, Sk) bias), in
    # slices of 2 rows, each call after the last slice's sums (operands the callback does not read)
    q, k, v, _ = arrays(rng, 1, 6, 10, 4, 2, 16, np.float16)
    bias, b_t = (rng.standard_normal((1, 1, 6, 10)).astype(np.float16) for _ in range(2))
    monkeypatch.setattr(fj, "_BIAS_TANGENT_ELEMENTS", 2 * 4 * 10)
    launches = []
    with emulated(compile=launch_records(launches)):
        _, (out_t, lse_t) = jitted_bias_jvp(causal=True, backend="cupy")(*map(to_jax, (q, k, v, bias)),
                                                                         [None, None, None, to_jax(b_t)])
    assert sum("flash_probs" in str(r) for r in launches) == 3
    assert_tangent_matches_oracle(out_t, lse_t, q, k, v, (None, None, None, b_t), backend=None, causal=True,
                                  bias=bias)
    q = to_jax(rng.standard_normal((1, 4, 1, 256)).astype(np.float16))
    with emulated(), pytest.raises(ValueError, match="head_dim 256: flashcupy.jax's forward mode"):
        jax.jit(lambda q, t: jax.jvp(lambda q: fj.attention(q, q, q, backend="cupy"), (q,), (t,))).lower(q, q)


def test_jvp_with_leading_batch_dimensions(rng):
    # q (2, 3, S, H, D): the package's leading dimensions, a bias (S, S) broadcast over all of them
    # and held constant
    q, k, v = (rng.standard_normal((2, 3, 5, 2, 4)).astype(np.float32) for _ in range(3))
    bias = rng.standard_normal((5, 5)).astype(np.float32)
    tangents = tangents_of(rng, q, k, v)
    (out, lse), (out_t, lse_t) = jitted_jvp(causal=True)(*map(to_jax, (q, k, v, *tangents)), to_jax(bias))
    assert out_t.shape == q.shape and lse_t.shape == (2, 3, 2, 5)
    assert_tangent_matches_oracle(out_t, lse_t, q, k, v, tangents, backend="numpy", causal=True, bias=bias)


def jitted_bias_jvp(**keywords):
    """jit(jvp) of (out, lse) of flashcupy.jax.attention in q, k, v and the bias (tangents None: zeros
    that JAX knows as such, so that their work is skipped); mask and slopes held constant."""
    def run(q, k, v, bias, tangents, mask=None, slopes=None):
        def f(*x):
            given = iter(x)
            q_, k_, v_, b = (y if t is None else next(given) for y, t in zip((q, k, v, bias), tangents))
            return fj.attention(q_, k_, v_, bias=b, mask=mask, alibi_slopes=slopes, return_lse=True, **keywords)
        primals = tuple(y for y, t in zip((q, k, v, bias), tangents) if t is not None)
        return jax.jvp(f, primals, tuple(t for t in tangents if t is not None))
    return jax.jit(run)


@pytest.mark.parametrize("bias_shape", [(1, 6, 9, 13), (2, 1, 1, 13), (9, 13)])
def test_jvp_through_a_bias(rng, bias_shape):
    # forward mode through the bias (its sums taken by XLA from the package's P): a pair bias broadcast
    # over the batch, a key bias (B, 1, 1, Sk) and a (Sq, Sk) bias lined up from the right, with GQA (3
    # query heads a kv head), causal Sq < Sk, a mask that leaves a row no key, ALiBi and the softcap;
    # along (q, k, v, bias) and along the bias alone
    q, k, v, _ = arrays(rng, 2, 9, 13, 6, 2, 8, np.float32)
    v = rng.standard_normal((2, 13, 2, 5)).astype(np.float32)  # v's head dim its own
    bias = rng.standard_normal(bias_shape).astype(np.float32)
    mask = rng.random((2, 1, 9, 13)) < 0.8
    mask[1, 0, 4] = False
    slopes = rng.random(6).astype(np.float32)
    kw = dict(causal=True, softcap=2.5)
    mods = dict(bias=bias, mask=mask, alibi_slopes=slopes)
    run = jitted_bias_jvp(**kw)
    for tangents in (tangents_of(rng, q, k, v, bias), [None, None, None, rng.standard_normal(bias.shape)]):
        tangents = [None if t is None else t.astype(np.float32) for t in tangents]
        (out, lse), (out_t, lse_t) = run(*map(to_jax, (q, k, v, bias)), [None if t is None else to_jax(t)
                                                                           for t in tangents],
                                         to_jax(mask), to_jax(slopes))
        assert np.all(np.asarray(lse_t)[1, :, 4] == 0) and np.all(np.asarray(out_t)[1, 4] == 0)  # no key
        assert_tangent_matches_oracle(out_t, lse_t, q, k, v, tangents, backend="numpy", **kw, **mods)


def test_dbias_only_where_the_bias_has_a_gradient(rng, monkeypatch):
    # the backward spends nothing on dbias (Problem.dbias False, no dbias buffer in XLA) where the bias
    # has no tangent: grad in q alone, jvp in q (its widened backward, which wants dq alone:
    # Problem.dq_only, no dk or dv buffers either); grad in the bias does
    q, k, v, dout = arrays(rng, 1, 16, 16, 2, 1, 8, np.float32)
    bias = rng.standard_normal((1, 2, 16, 16)).astype(np.float32)
    seen = []
    backward = numpy_backend.backward

    def spy(p, *args, **kw):
        seen.append(p.dbias)
        assert p.dq_only == (len(kw["into"]) == 1)
        return backward(p, *args, **kw)
    monkeypatch.setattr(numpy_backend, "backward", spy)
    Q, K, V, B, dO = map(to_jax, (q, k, v, bias, dout))

    def loss(q, b):
        return _dot(fj.attention(q, K, V, bias=b, causal=True), dO)
    for argnums, want in ((0, [False]), ((0, 1), [True])):
        seen.clear()
        grads = jax.jit(jax.grad(loss, argnums=argnums))(Q, B)
        assert seen == want
        dq = grads if argnums == 0 else grads[0]
        got = [np.asarray(x) for x in fj.attention(Q, K, V, bias=B, causal=True, return_lse=True)]
        assert_matches_oracle(got + [np.asarray(dq)], q, k, v, dout, backend="numpy", causal=True, bias=bias)
    seen.clear()
    temporaries = []
    for b in (B, None):  # XLA's temporaries: no dbias among them, as many as without a bias
        jvp = jax.jit(lambda q, t: jax.jvp(lambda q: fj.attention(q, K, V, bias=b, causal=True), (q,), (t,)))
        temporaries.append(jvp.lower(Q, Q).compile().memory_analysis().temp_size_in_bytes)
        dq_only = []
        monkeypatch.setattr(numpy_backend, "backward",
                            lambda p, *a, **kw: dq_only.append(p.dq_only) or spy(p, *a, **kw))
        jvp(Q, Q)
        assert dq_only == [True]
    assert seen == [False, False] and temporaries[0] == temporaries[1], (seen, temporaries)


def test_jvp_through_a_bias_in_slices_of_rows_dtypes_vmap_and_jacfwd(rng, monkeypatch):
    # P in slices of 4 rows of 9 (the last one short): several attention_probs calls, the same result;
    # float64, bfloat16 and float16 (a float32 bias beside them); vmap of the jvp with the bias's tangent
    # mapped; jacfwd in the bias against jacrev (the package's dbias) column by column
    q, k, v, _ = arrays(rng, 2, 9, 9, 2, 1, 8, np.float32)
    bias = rng.standard_normal((1, 2, 9, 9)).astype(np.float32)
    tangents = tangents_of(rng, q, k, v, bias)
    calls = []
    probs = numpy_backend.probs

    def spy(p, q, k, lse, rows, into=None):
        calls.append(None if rows is None else len(rows))
        return probs(p, q, k, lse, rows, into=into)
    monkeypatch.setattr(numpy_backend, "probs", spy)
    monkeypatch.setattr(fj, "_BIAS_TANGENT_ELEMENTS", 4 * 2 * 2 * 9)  # 4 rows of (B, Hq, Sk) = (2, 2, 9)
    _, (out_t, lse_t) = jitted_bias_jvp(causal=True)(*map(to_jax, (q, k, v, bias)), list(map(to_jax, tangents)))
    assert sorted(calls) == [1, 4, 4]  # in the order XLA runs them
    assert_tangent_matches_oracle(out_t, lse_t, q, k, v, tangents, backend="numpy", causal=True, bias=bias)
    # XLA's temporaries hold about two slices of P (P's and its product with b), not every slice: each
    # call waits for the last slice's sums (S = 256 in 8 slices of 32 rows)
    Q, K, V, b, b_t = (to_jax(rng.standard_normal(shape).astype(np.float32))
                       for shape in [(1, 256, 2, 8)] * 3 + [(1, 2, 256, 256)] * 2)
    monkeypatch.setattr(fj, "_BIAS_TANGENT_ELEMENTS", 32 * 2 * 256)
    run = jax.jit(lambda b, t: jax.jvp(lambda b: fj.attention(Q, K, V, bias=b, causal=True), (b,), (t,)))
    piece = 32 * 2 * 256 * 4  # bytes of a slice of P
    assert run.lower(b, b_t).compile().memory_analysis().temp_size_in_bytes < 3 * piece
    monkeypatch.undo()

    for dtype, bias_dtype in ((np.float64, np.float64), (BF16, np.float32), (np.float16, np.float16)):
        with jax.enable_x64(dtype == np.float64):
            q, k, v, _ = arrays(rng, 2, 6, 9, 2, 2, 8, dtype)
            bias = rng.standard_normal((2, 2, 6, 9)).astype(bias_dtype)
            tangents = tangents_of(rng, q, k, v, bias)
            _, (out_t, lse_t) = jitted_bias_jvp(window=(2, 3))(*map(to_jax, (q, k, v, bias)),
                                                               list(map(to_jax, tangents)))
            assert out_t.dtype == q.dtype
            assert_tangent_matches_oracle(out_t, lse_t, q, k, v, tangents, backend="numpy", window=(2, 3), bias=bias)

    q, k, v, _ = arrays(rng, 1, 5, 5, 2, 1, 4, np.float32)
    bias = rng.standard_normal((1, 2, 5, 5)).astype(np.float32)
    b_t = rng.standard_normal((3,) + bias.shape).astype(np.float32)

    def f(b):
        return fj.attention(*map(to_jax, (q, k, v)), bias=b, causal=True, return_lse=True)
    _, (out_t, lse_t) = jax.jit(jax.vmap(lambda t: jax.jvp(f, (to_jax(bias),), (t,))))(to_jax(b_t))
    for n in range(3):
        assert_tangent_matches_oracle(out_t[n], lse_t[n], q, k, v, (None, None, None, b_t[n]), backend="numpy",
                                      causal=True, bias=bias)
    forward, reverse = (np.asarray(jax.jit(how(lambda b: f(b)[0]))(to_jax(bias))) for how in (jax.jacfwd, jax.jacrev))
    for e in range(bias.size):
        basis = np.zeros(bias.size, np.float32)
        basis[e] = 1
        want = expected(q, k, v, family="numpy", causal=True, bias=bias,
                        tangents=(None, None, None, basis.reshape(bias.shape)))
        column = (Ellipsis,) + np.unravel_index(e, bias.shape)
        for got in (forward, reverse):
            assert error_ratio(got[column], want, "out_t") <= 2, e


def test_grad_and_jvp_under_checkpoint_and_scan(rng):
    # what model code wraps layers in: jax.checkpoint (remat: the forward again in the backward) and
    # jax.lax.scan over layers; both give bit for bit what the unrolled loop gives, in reverse and
    # forward mode, and the loop's one layer is the oracle's
    x, t, dout = (to_jax(rng.standard_normal((2, 8, 2, 8)).astype(np.float32)) for _ in range(3))

    def layer(x):
        return fj.attention(x, x, x, causal=True)

    def unrolled(x):
        for _ in range(3):
            x = layer(x)
        return x

    def scanned(x):
        return jax.lax.scan(lambda c, _: (jax.checkpoint(layer)(c), None), x, None, length=3)[0]

    for fn in (unrolled, scanned):
        got = jax.jit(lambda x: (jax.grad(lambda y: _dot(fn(y), dout))(x), jax.jvp(fn, (x,), (t,))[1]))(x)
        if fn is unrolled:
            want = got
        else:
            for a, b in zip(got, want):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    x1, t1 = np.asarray(x), np.asarray(t)
    _, out_t = jax.jvp(layer, (x,), (t,))
    assert_tangent_matches_oracle(out_t, jax.jvp(lambda y: fj.attention(y, y, y, causal=True, return_lse=True)[1],
                                                 (x,), (t,))[1], x1, x1, x1, (t1, t1, t1), backend="numpy", causal=True)


SHARDED = r"""
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P
import flashcupy.jax as fj
q, k, v, dout, t, bias = (jnp.asarray(x) for x in np.load(sys.argv[1]).values())
mesh = Mesh(np.array(jax.devices()), ("b",))
f = jax.shard_map(lambda q, k, v, b: fj.attention(q, k, v, bias=b, causal=True, return_lse=True), mesh=mesh,
                  in_specs=(P("b"),) * 3 + (P(),), out_specs=(P("b"), P("b")))
out, lse = jax.jit(f)(q, k, v, bias)
grads = jax.jit(jax.grad(lambda *a: jnp.vdot(f(*a)[0], dout), argnums=(0, 1, 2, 3)))(q, k, v, bias)
_, (out_t, lse_t) = jax.jit(lambda q, t: jax.jvp(lambda q: f(q, k, v, bias), (q,), (t,)))(q, t)
lse_of = lambda q, k, b: fj.attention(q, k, k, bias=b, causal=True, return_lse=True)[1]
g = jax.shard_map(lambda q, k, b: fj.attention_probs(q, k, lse_of(q, k, b), bias=b, causal=True, rows=[7, 2]),
                  mesh=mesh, in_specs=(P("b"),) * 2 + (P(),), out_specs=P("b"))
probs, probs_t = jax.jit(lambda q, t: jax.jvp(lambda q: g(q, k, bias), (q,), (t,)))(q, t)
np.savez(sys.argv[2], *(np.asarray(x) for x in (out, lse, *grads, out_t, lse_t, probs, probs_t)))
"""


def test_under_shard_map_with_a_shared_bias(rng, tmp_path):
    # jax.shard_map over the batch on two (CPU) devices, its type check on: q, k, v sharded, the bias
    # shared by every shard, whose gradient is the sum of the devices' parts (the transpose of the cast
    # to varying); forward, grad and jvp against the oracle, and attention_probs with its jvp. A process
    # of its own: the devices are set before JAX starts.
    import subprocess
    import sys

    q, k, v, dout = arrays(rng, 4, 8, 8, 2, 2, 8, np.float32)
    t = rng.standard_normal(q.shape).astype(np.float32)
    bias = rng.standard_normal((1, 2, 8, 8)).astype(np.float32)
    np.savez(tmp_path / "in.npz", q, k, v, dout, t, bias)
    run = subprocess.run([sys.executable, "-c", SHARDED, str(tmp_path / "in.npz"), str(tmp_path / "out.npz")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = list(np.load(tmp_path / "out.npz").values())
    assert_matches_oracle(got[:6], q, k, v, dout, backend="numpy", causal=True, bias=bias)
    assert_tangent_matches_oracle(got[6], got[7], q, k, v, (t, None, None), backend="numpy", causal=True, bias=bias)
    assert_probs_match_oracle(got[8], got[9], q, k, (t, None, None), np.array([7, 2]), backend="numpy", causal=True,
                              bias=bias)


# ----------------------------------------------------------------------------
# attention_probs: P from the package, its derivative P (St - lse_t) in JAX's own operations


def jitted_probs_jvp(rows, **keywords):
    """jit(jvp) of flashcupy.jax.attention_probs in q and k, lse from flashcupy.jax.attention (so its
    tangent is lse's own); the modifiers' arrays held constant."""
    def run(q, k, q_t, k_t, bias=None, mask=None, slopes=None):
        def f(q, k):
            mods = dict(bias=bias, mask=mask, alibi_slopes=slopes, **keywords)
            _, lse = fj.attention(q, k, k, return_lse=True, **mods)
            return fj.attention_probs(q, k, lse, rows=rows, **mods)
        return jax.jvp(f, (q, k), (q_t, k_t))
    return jax.jit(run)


def check_probs_case(rng, case, dtype, rows):
    B, Sq, Sk, Hq, Hkv, D, kw, shapes = CASES[case]
    q, k, _, _ = arrays(rng, B, Sq, Sk, Hq, Hkv, D, dtype)
    tangents = tangents_of(rng, q, k)
    mods = modifier_arrays(rng, shapes, dtype)
    P, P_t = jitted_probs_jvp(rows, **kw)(*map(to_jax, (q, k, *tangents)), *(
        None if mods.get(n) is None else to_jax(mods[n]) for n in ("bias", "mask", "alibi_slopes")))
    index = np.arange(Sq)[slice(None) if rows is None else rows]
    assert P.shape == P_t.shape == (B, Hq, index.size, Sk) and P.dtype == P_t.dtype == np.dtype(_lse_dtype(dtype))
    return assert_probs_match_oracle(P, P_t, q, k, (*tangents, None), index, backend="numpy", **kw, **mods)


def _lse_dtype(dtype):
    return np.float64 if dtype == np.float64 else np.float32


@pytest.mark.parametrize("case", list(CASES))
def test_probs_and_their_jvp_match_the_oracle(rng, case):
    # every case: GQA and MQA, rows that see no key (P 0, P_t 0), a window, a constant bias, a mask,
    # ALiBi and the softcap (P_t through 1 - t^2); all rows, and some rows with a negative one
    check_probs_case(rng, case, np.float32, None)
    check_probs_case(rng, case, np.float32, [-1, 0, 3])


def test_probs_jvp_float64_bfloat16_and_float16(rng):
    with jax.enable_x64(True):
        check_probs_case(rng, "causal_gqa", np.float64, slice(1, None, 2))
    check_probs_case(rng, "mask_alibi_softcap", BF16, None)
    check_probs_case(rng, "causal_sq_gt_sk_mqa", np.float16, [2, 12])


def test_probs_of_bfloat16_bits(rng):
    # uint16 bits with dtype="bfloat16", as on NumPy and CuPy: P in float32, and the bits have no tangent
    q, k, _, _ = arrays(rng, 1, 6, 9, 2, 1, 8, BF16)
    bits = [to_jax(bf16_bits(x)) for x in (q, k)]
    _, lse = fj.attention(*bits, bits[1], return_lse=True, dtype="bfloat16", causal=True)
    P = jax.jit(lambda q, k, lse: fj.attention_probs(q, k, lse, dtype="bfloat16", causal=True, rows=[5, 1]))(*bits, lse)
    assert P.dtype == np.float32
    assert error_ratio(np.asarray(P), expected(q, k, k, family="numpy", probs=True, causal=True), "P", [5, 1]) <= 1
    P_t = jax.jvp(lambda lse: fj.attention_probs(*bits, lse, dtype="bfloat16", causal=True), (lse,), (lse,))[1]
    np.testing.assert_array_equal(np.asarray(P_t), -np.asarray(lse)[..., None] * fj.attention_probs(
        *bits, lse, dtype="bfloat16", causal=True))  # P (0 - lse_t), lse_t = lse here


def test_probs_reverse_mode_vmap_and_leading_dimensions(rng):
    # the Jacobian of P (two rows) in q, k and the bias by jacrev (JAX transposes P_t; lse's part is the
    # package's backward with dlse) and by jacfwd, each column within twice the oracle's tolerance of the
    # jvp along that basis vector; then vmap over a mapped q and a bias broadcast over leading dimensions
    B, S, Hq, Hkv, D = 1, 4, 2, 1, 4
    q, k, _, _ = arrays(rng, B, S, S, Hq, Hkv, D, np.float32)
    bias = rng.standard_normal((1, Hq, S, S)).astype(np.float32)
    rows, kw = [3, 1], dict(causal=True, softcap=2.0)
    primals = tuple(map(to_jax, (q, k, bias)))

    def probs(q, k, bias):
        _, lse = fj.attention(q, k, k, bias=bias, return_lse=True, **kw)
        return fj.attention_probs(q, k, lse, bias=bias, rows=rows, **kw)
    for index, x in enumerate((q, k, bias)):
        def of(x):
            return probs(*(x if i == index else y for i, y in enumerate(primals)))
        jacobians = [np.asarray(jax.jit(how(of))(primals[index])) for how in (jax.jacrev, jax.jacfwd)]
        for e in range(x.size):
            basis = np.zeros(x.size, np.float32)
            basis[e] = 1
            tangents = [basis.reshape(x.shape) if i == index else None for i in range(3)]
            tangents.insert(2, None)  # (q_t, k_t, v_t, bias_t)
            want = expected(q, k, k, family="numpy", probs=True, tangents=tangents, bias=bias, **kw)
            column = (Ellipsis,) + np.unravel_index(e, x.shape)
            for got in jacobians:
                assert error_ratio(got[column], want, "P_t", rows) <= 2, (index, e)

    # vmap: q mapped (the fold), k shared, a (S, S) bias broadcast over the leading dimensions (2, 3)
    q = rng.standard_normal((2, 3, S, Hq, D)).astype(np.float32)
    k = rng.standard_normal((2, 3, S, Hkv, D)).astype(np.float32)
    q_t, k_t = tangents_of(rng, q, k)
    bias = rng.standard_normal((S, S)).astype(np.float32)
    Q = np.stack([q, -0.5 * q])
    run = jax.jit(jax.vmap(lambda q, k, q_t, k_t: jax.jvp(lambda q, k: probs(q, k, to_jax(bias)), (q, k), (q_t, k_t)),
                           in_axes=(0, None, 0, None)))
    P, P_t = run(*map(to_jax, (Q, k, np.stack([q_t, q_t]), k_t)))
    assert P.shape == (2, 2, 3, Hq, 2, S)
    for n in range(2):
        assert_probs_match_oracle(P[n], P_t[n], Q[n], k, (q_t, k_t, None), np.array(rows), backend="numpy",
                                  bias=bias, **kw)


def test_probs_errors_at_trace_time_and_the_buffer_written_in_place(rng, monkeypatch):
    q, k, _, _ = map(to_jax, arrays(rng, 1, 8, 8, 2, 2, 8, np.float32))
    lse = jnp.zeros((1, 2, 8), jnp.float32)
    with pytest.raises(TypeError, match="rows must be known when JAX traces"):
        jax.jit(lambda q, r: fj.attention_probs(q, k, lse, rows=r)).lower(q, jnp.arange(3))
    with pytest.raises(ValueError, match=r"rows must lie in \[-seqlen_q, seqlen_q\)"):
        traced(lambda q: fj.attention_probs(q, k, lse, rows=[8]), q)
    with pytest.raises(ValueError, match=r"lse must have shape \(\*batch, heads_q, seqlen_q\) = \(1, 2, 8\)"):
        traced(lambda q: fj.attention_probs(q, k, lse[..., :7]), q)
    with pytest.raises(TypeError, match="lse must have dtype float32"):
        traced(lambda q: fj.attention_probs(q, k, lse.astype(jnp.float16)), q)
    with pytest.raises(TypeError, match="lse must be a jax.Array, got numpy.ndarray"):
        fj.attention_probs(q, k, np.asarray(lse))
    # the backend writes P straight into XLA's output buffer
    seen = {}
    probs = numpy_backend.probs

    def spy(p, q, k, lse, rows, into=None):
        seen["into"] = into
        return probs(p, q, k, lse, rows, into=into)
    monkeypatch.setattr(numpy_backend, "probs", spy)
    P = jax.jit(lambda q, lse: fj.attention_probs(q, k, lse, rows=slice(2, 5)))(q, lse)
    assert seen["into"].__array_interface__["data"][0] == P.unsafe_buffer_pointer() and P.shape == (1, 2, 3, 8)


def test_cupy_probs_and_their_jvp_on_the_emulator(rng):
    # the GPU path on the CPU CUDA emulator: flash_probs writes into XLA's buffer (float16, GQA, causal,
    # a bias and some rows), the lse and its tangent from the cupy forward and forward mode
    from flashcupy.tools.emulator.cupy import emulated

    q, k, _, _ = arrays(rng, 1, 9, 12, 4, 2, 16, np.float16)
    tangents = tangents_of(rng, q, k)
    bias = rng.standard_normal((1, 1, 9, 12)).astype(np.float16)
    rows, kw = [8, 0, 5], dict(causal=True, backend="cupy")
    with emulated():
        P, P_t = jitted_probs_jvp(rows, **kw)(*map(to_jax, (q, k, *tangents)), to_jax(bias))
    assert_probs_match_oracle(P, P_t, q, k, (*tangents, None), np.array(rows), backend=None, causal=True, bias=bias)


def test_a_big_batch_of_short_sequences_with_a_pair_bias_writes_dbias_into_xla(rng):
    # a batch the NumPy backend runs in groups (numpy_backend/packed.py: at least 8 short sequences), a
    # float32 pair bias shared by the batch: its dbias summed over the groups straight into XLA's buffer
    q, k, v, dout = arrays(rng, 10, 12, 12, 2, 1, 8, np.float32)
    bias = rng.standard_normal((1, 2, 12, 12)).astype(np.float32)
    run = _jitted(causal=True)
    got = [np.asarray(x) for x in run(*map(to_jax, (q, k, v, dout, bias)), None, None)]
    assert got[-1].shape == bias.shape
    assert_matches_oracle(got, q, k, v, dout, causal=True, bias=bias, backend="numpy")
