"""The public interface: the entry points, their degenerate shapes, and dispatch.

Every call goes through here once. Its arguments are checked first (flashcupy/_checks.py), before
any backend is touched, and backends never re-validate: they receive a `Problem`
(flashcupy/_problem.py) that describes shapes and options, plus arrays known to be consistent.
The semantics are documented once, in README.md ("Semantics").

`forward` and `backward` are the package's own entry points: the public ones without the knobs
only the package turns (a chunk's diagonal for flashcupy.dask and the KV cache, split-KV, and
`into`, the arrays to write the results into: XLA's own output buffers for flashcupy.jax).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from . import _batch, _interop
from ._checks import (check_arrays, check_backend_name, check_bool, check_leading, check_like_q, check_lse, check_rows,
                      problem, select_backend)


def forward(q, k, v, *, causal=False, window=None, softcap=None, alibi_slopes=None, bias=None, mask=None,
            scale=None, backend="auto", dtype=None, dropout_p=0.0, dropout_seed=None, dropout_origin=(0, 0, 0, 0),
            dropout_seed_words=None, diagonal=None, num_splits=1, into=None) -> tuple:
    """attention's (out, lse) on NumPy or CuPy arrays, with knobs of the package's own:
    diagonal, that of a chunk of a larger problem, its queries' and keys' global positions folded
    in (None: seqlen_k - seqlen_q); num_splits, split-KV inside the backend for backends that have
    it (split_plan): 1 none, None by the backend's heuristic, an int at most that many; into, None
    or (out, lse) arrays of the results' shapes and dtypes (carriers), written and returned;
    dropout_origin, where this call's pairs start in dropout's keep mask (Problem.dropout_origin);
    dropout_seed_words, the seed in device memory instead (Problem.dropout_seed_words; flashcupy.jax's)."""
    drop = dict(dropout_p=dropout_p, dropout_seed=dropout_seed, dropout_origin=dropout_origin)
    backend = check_backend_name(backend)
    lib = check_arrays({"q": q, "k": k, "v": v})
    if len(check_leading(lib, q, k, v, alibi_slopes, bias, mask)) > 1:  # rank-4 calls on views (_batch.py)
        # dtypes, scale, dropout: before any work
        p = problem(*map(_batch.stand_in, (q, k, v)), causal, scale, dtype, lib, **drop)
        kw = dict(causal=causal, window=window, softcap=softcap, alibi_slopes=alibi_slopes, bias=bias, mask=mask,
                  scale=scale, backend=backend, dtype=dtype, diagonal=diagonal, num_splits=num_splits,
                  dropout_seed_words=dropout_seed_words, **drop)
        return _batch.forward(forward, q, k, v, kw, p.carrier, p.lse_dtype, into)
    p = _seed_words(problem(q, k, v, causal, scale, dtype, lib, window, softcap, alibi_slopes, bias, mask, diagonal,
                            **drop), dropout_seed_words)
    mod = select_backend(backend, lib, p)

    if p.batch * p.seqlen_q * p.heads_q == 0 or p.seqlen_k == 0:
        # Nothing to attend to: every query row is fully masked (out 0, lse -inf).
        if into is not None:
            return _filled(into, (0, -np.inf))
        return mod.allocate(q, p.out_shape, p.carrier, 0), mod.allocate(q, p.lse_shape, p.lse_dtype, -np.inf)
    kw = {} if num_splits == 1 else {"num_splits": num_splits}
    return _run_into(mod, mod.forward, into, p, q, k, v, **kw)


def backward(dout, q, k, v, out, lse, *, causal=False, window=None, softcap=None, alibi_slopes=None, bias=None,
             mask=None, scale=None, backend="auto", dtype=None, deterministic=False, dlse=None, dropout_p=0.0,
             dropout_seed=None, dropout_origin=(0, 0, 0, 0), dropout_seed_words=None, diagonal=None,
             return_dbias=True, dq_only=False, into=None) -> tuple:
    """attention_backward on NumPy or CuPy arrays, with forward's diagonal, dropout_origin and
    dropout_seed_words, and into: None or (dq, dk, dv), and dbias with a bias (unless return_dbias is
    False), arrays of the gradients' shapes and dtypes. dq_only: (dq,) alone (into: (dq,)), no dbias,
    and no work on dk and dv where the backend declares DQ_ONLY (flashcupy.jax's forward mode)."""
    drop = dict(dropout_p=dropout_p, dropout_seed=dropout_seed, dropout_origin=dropout_origin)
    backend = check_backend_name(backend)
    deterministic = check_bool("deterministic", deterministic)
    return_dbias = check_bool("return_dbias", return_dbias) and not dq_only
    given_bias = bias
    given = {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse}
    lib = check_arrays(given if dlse is None else given | {"dlse": dlse})
    batch = check_leading(lib, q, k, v, alibi_slopes, bias, mask)
    if len(batch) > 1:  # rank-4 calls on views (flashcupy/_batch.py)
        p = problem(*map(_batch.stand_in, (q, k, v)), causal, scale, dtype, lib, **drop)  # before any work
        check_like_q(p, q, {"dout": dout, "out": out})
        for name, x in (("lse", lse), ("dlse", dlse)):
            if x is not None:
                check_lse(p, x, batch + (q.shape[-2], q.shape[-3]), name)
        kw = dict(causal=causal, window=window, softcap=softcap, alibi_slopes=alibi_slopes, bias=bias, mask=mask,
                  scale=scale, backend=backend, dtype=dtype, deterministic=deterministic, dlse=dlse, diagonal=diagonal,
                  dropout_seed_words=dropout_seed_words, return_dbias=return_dbias, dq_only=dq_only, **drop)
        return _batch.backward(backward, dout, q, k, v, out, lse, kw, p.carrier, p.acc_dtype, into)
    p = _seed_words(problem(q, k, v, causal, scale, dtype, lib, window, softcap, alibi_slopes, bias, mask, diagonal,
                            **drop), dropout_seed_words)
    if bias is not None and not return_dbias:
        p, bias = dataclasses.replace(p, return_dbias=False), None  # bias: from here on, dbias's
    check_like_q(p, q, {"dout": dout, "out": out})
    check_lse(p, lse)
    if dlse is not None:
        check_lse(p, dlse, name="dlse")
    mod = select_backend(backend, lib, p, backward=True)
    if dq_only and not getattr(mod, "DQ_ONLY", False):  # the backend makes them all: dq is the first
        return backward(dout, q, k, v, out, lse, causal=causal, window=window, softcap=softcap,
                        alibi_slopes=alibi_slopes, bias=given_bias, mask=mask, scale=scale,
                        backend=backend, dtype=dtype, deterministic=deterministic, dlse=dlse, diagonal=diagonal,
                        dropout_seed_words=dropout_seed_words, return_dbias=False, into=None if into is None else
                        (into[0], *(mod.allocate(q, x.shape, p.carrier, 0) for x in (k, v))), **drop)[:1]
    if dq_only:
        p = dataclasses.replace(p, dq_only=True)

    if p.batch * p.seqlen_q * p.heads_q == 0 or p.seqlen_k == 0:
        if into is not None:
            return _filled(into, (0,) * len(into))
        grads = tuple(mod.allocate(q, x.shape, p.carrier, 0) for x in ((q,) if dq_only else (q, k, v)))
        return grads if bias is None else grads + (mod.allocate(q, bias.shape, bias.dtype, 0),)
    if bias is not None and bias.ndim != 4:  # the backend's dbias is of the bias padded to rank 4
        into = None if into is None else (*into[:3], *(_batch.padded(x, 4) for x in into[3:]))
    kw = {"deterministic": deterministic} if getattr(mod, "ATOMIC_BACKWARD", False) else {}
    if dlse is not None:
        kw["dlse"] = dlse
    grads = _run_into(mod, mod.backward, into, p, dout, q, k, v, out, lse, **kw)
    if bias is not None and bias.ndim != 4:
        return (*grads[:3], grads[3].reshape(bias.shape))
    return grads


def _seed_words(p, words):
    """p with dropout's seed read from the device array `words` (two uint32: low, high) rather than
    p.dropout_seed, where given (flashcupy.jax on a GPU: only to backends that declare
    DROPOUT_SEED_ON_DEVICE, which select_backend checks)."""
    if words is None or not p.dropout:
        return p
    return dataclasses.replace(p, dropout_seed_words=words)


def _filled(into, values) -> tuple:
    for x, value in zip(into, values):
        x.fill(value)
    return tuple(into)


def _run_into(mod, fn, into, *args, **kw) -> tuple:
    """fn's results, written into `into` when given (some of them: the rest are returned as the
    backend made them): by the backend itself where it declares WRITES_INTO, else copied there."""
    if into is None:
        return fn(*args, **kw)
    if getattr(mod, "WRITES_INTO", False):
        return fn(*args, into=into, **kw)
    results = fn(*args, **kw)
    for x, result in zip(into, results):
        x[...] = result
    return (*into, *results[len(into):])


@_interop.accepts_foreign_arrays
def attention(q, k, v, *, causal=False, window=None, softcap=None, alibi_slopes=None, bias=None, mask=None,
              scale=None, return_lse=False, backend="auto", dtype=None, dropout_p=0.0, dropout_seed=None):
    """Exact softmax(q kᵀ · scale) v, computed tile by tile (FlashAttention).

    q: (batch, seqlen_q, heads_q, head_dim); k: (batch, seqlen_k, heads_kv, head_dim), v: (batch,
    seqlen_k, heads_kv, head_dim_v), heads_q a multiple of heads_kv, head_dim_v head_dim or not (the
    README says which backends take which). Returns out (q's shape with head_dim_v, q's dtype), and with
    return_lse=True also lse, the natural-log logsumexp, (batch, heads_q, seqlen_q),
    float32 (float64 for float64 inputs).

    Score modifiers (README, Semantics): window=(left, right), softcap, alibi_slopes, bias (rank 4,
    broadcastable to (batch, heads_q, seqlen_q, seqlen_k)) and mask (bool, True: may attend).

    dtype=None reads the arrays as their own dtype (float16, float32, float64, or
    ml_dtypes.bfloat16 on NumPy); dtype="bfloat16" reads uint16/int16 arrays as
    bfloat16 bit patterns (CuPy has no bfloat16 dtype), and out comes back the same way.
    """
    return_lse = check_bool("return_lse", return_lse)
    out, lse = forward(q, k, v, causal=causal, window=window, softcap=softcap, alibi_slopes=alibi_slopes, bias=bias,
                       mask=mask, scale=scale, backend=backend, dtype=dtype, dropout_p=dropout_p,
                       dropout_seed=dropout_seed)
    return (out, lse) if return_lse else out


@_interop.accepts_foreign_arrays
def attention_backward(dout, q, k, v, out, lse, *, causal=False, window=None, softcap=None, alibi_slopes=None,
                       bias=None, mask=None, scale=None, backend="auto", dtype=None, deterministic=False, dlse=None,
                       dropout_p=0.0, dropout_seed=None, return_dbias=True):
    """Gradients (dq, dk, dv) of attention, given dout and the forward's out and lse; with bias,
    (dq, dk, dv, dbias), dbias of the bias's own shape and dtype (summed over its broadcast
    dimensions). return_dbias=False: (dq, dk, dv) alone with a bias too, and no work spent on dbias
    (a bias held constant, such as an additive mask).

    dlse: the gradient of lse too (lse's shape and dtype), or None (0): d lse_i / d s_ij is
    P_ij, so it adds P_ij dlse_i to each score's gradient (the backward's D_i becomes
    rowsum(dO_i ∘ O_i) - dlse_i); dout may then be zeros, for a loss of lse alone.

    dk and dv sum over the query heads that share a kv head. P is recomputed
    from q, k and lse, so memory stays O(seqlen).

    deterministic=True: bitwise the same result on every call (for a fixed thread count on the
    CPU). The default, False, lets the cupy backend's tensor-core kernels add dq with atomics (five
    GEMMs instead of seven), whose order, so whose rounding, varies; every other path is
    deterministic either way.

    dropout_p, dropout_seed: the forward's; the backward redraws its keep mask from them.
    """
    return backward(dout, q, k, v, out, lse, causal=causal, window=window, softcap=softcap,
                    alibi_slopes=alibi_slopes, bias=bias, mask=mask, scale=scale, backend=backend, dtype=dtype,
                    deterministic=deterministic, dlse=dlse, dropout_p=dropout_p, dropout_seed=dropout_seed,
                    return_dbias=return_dbias)


@_interop.accepts_foreign_arrays
def attention_vjp(q, k, v, *, causal=False, window=None, softcap=None, alibi_slopes=None, bias=None, mask=None,
                  scale=None, backend="auto", dtype=None, deterministic=False, dropout_p=0.0, dropout_seed=None):
    """Forward pass plus a closure for the backward: returns (out, vjp), vjp(dout, dlse=None) ->
    (dq, dk, dv), or (dq, dk, dv, dbias) with a bias. deterministic, dlse: as attention_backward's
    (dlse, the gradient of the lse attention(..., return_lse=True) gives); dropout_p, dropout_seed:
    as attention's, the backward redrawing the forward's mask."""
    deterministic = check_bool("deterministic", deterministic)
    mods = dict(window=window, softcap=softcap, alibi_slopes=alibi_slopes, bias=bias, mask=mask,
                dropout_p=dropout_p, dropout_seed=dropout_seed)
    out, lse = attention(q, k, v, causal=causal, scale=scale, return_lse=True, backend=backend, dtype=dtype, **mods)

    def vjp(dout, dlse=None):
        return attention_backward(dout, q, k, v, out, lse, causal=causal, scale=scale, backend=backend,
                                  dtype=dtype, deterministic=deterministic, dlse=dlse, **mods)

    return out, vjp


def probs(q, k, lse, *, rows=None, causal=False, window=None, softcap=None, alibi_slopes=None, bias=None,
          mask=None, scale=None, backend="auto", dtype=None, diagonal=None, into=None):
    """attention_probs on NumPy or CuPy arrays, with forward's diagonal (flashcupy.dask's pairs of
    chunks) and into: None or the array P is written into (its shape and dtype, any strides;
    flashcupy.jax's XLA buffer), returned."""
    backend = check_backend_name(backend)
    lib = check_arrays({"q": q, "k": k, "lse": lse})
    batch = check_leading(lib, q, k, k, alibi_slopes, bias, mask)
    kw = dict(causal=causal, window=window, softcap=softcap, alibi_slopes=alibi_slopes, bias=bias, mask=mask,
              scale=scale, backend=backend, dtype=dtype, diagonal=diagonal)
    if len(batch) > 1:  # rank-4 calls on views (flashcupy/_batch.py)
        p = problem(*map(_batch.stand_in, (q, k, k)), causal, scale, dtype, lib)
        check_lse(p, lse, batch + (q.shape[-2], q.shape[-3]))
        index = check_rows(rows, q.shape[-3])
        return _batch.probs(probs, q, k, lse, index, kw, p.lse_dtype, into)
    p = problem(q, k, k, causal, scale, dtype, lib, window, softcap, alibi_slopes, bias, mask, diagonal)
    check_lse(p, lse)
    index = check_rows(rows, p.seqlen_q)
    mod = select_backend(backend, lib, p)
    if not hasattr(mod, "probs"):
        raise ValueError(f"attention_probs is not yet supported by backend {mod.NAME!r}")
    shape = (p.batch, p.heads_q, index.size, p.seqlen_k)
    if math.prod(shape) == 0:
        return into if into is not None else mod.allocate(q, shape, p.lse_dtype, 0)
    if into is None:
        return mod.probs(p, q, k, lse, index)
    if getattr(mod, "WRITES_INTO", False):
        return mod.probs(p, q, k, lse, index, into=into)
    into[...] = mod.probs(p, q, k, lse, index)
    return into


@_interop.accepts_foreign_arrays
def attention_probs(q, k, lse, *, rows=None, causal=False, window=None, softcap=None, alibi_slopes=None,
                    bias=None, mask=None, scale=None, backend="auto", dtype=None):
    """The attention weights P = exp(s - lse) of the query rows asked for, recomputed from q, k and
    the forward's lse with the forward's modifiers: (batch, heads_q, len(rows), seqlen_k), in lse's
    dtype. rows: None (all: O(seqlen_q x seqlen_k) memory), a slice or a 1-D array of ints (negative
    ones count from the end). A row sums to 1, or is 0 where it sees no key.
    """
    return probs(q, k, lse, rows=rows, causal=causal, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                 bias=bias, mask=mask, scale=scale, backend=backend, dtype=dtype)
