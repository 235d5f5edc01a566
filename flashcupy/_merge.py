"""Exact combination of attention over disjoint key sets, from each part's (out, lse).

Attention over keys K = K_1 ∪ ... ∪ K_n (disjoint) is a weighted mean of the attentions over each
part: with lse_i the logsumexp of a row's scores over K_i,

    lse = log sum_i exp(lse_i)                       (the logsumexp over all of K)
    out = sum_i w_i out_i,   w_i = exp(lse_i - lse)  (each part's share of the softmax mass)

A row that sees no key of part i has lse_i = -inf and weight 0; a row that sees no key at all has
lse = -inf and out = 0, the rule of `attention`. Split-KV decoding, chunked sequences and the Dask
graph (flashcupy.dask) all combine partial results this way.

Backward, given dout and dlse (d lse may be absent: zero):

    d out_i = w_i dout
    d lse_i = w_i (dlse + rowsum(dout ∘ (out_i - out)))     (0 where w_i = 0, whatever dout holds)

from d lse / d lse_i = w_i and d w_j / d lse_i = w_j (δ_ij - w_i).

Arithmetic is in the accumulation dtype (float32, float64 for float64 values), as in the kernels;
outs are read as the values they hold (dtype="bfloat16" reads uint16/int16 bit patterns) and out
is stored back in their dtype.
"""

from __future__ import annotations

import numpy as np

from . import _checks, _interop, backends
from ._problem import accumulation_dtype


def library(x):
    lib = backends.array_library(x)
    if lib == "numpy":
        return np
    if lib == "cupy":
        import cupy
        return cupy
    raise TypeError(f"merge takes numpy or cupy arrays, got {_checks.describe(x)}")


def _check(outs, lses, dtype) -> tuple:
    """(xp, value dtype name, carrier, acc dtype): validated before any work."""
    for name, seq in (("outs", outs), ("lses", lses)):
        if not isinstance(seq, (list, tuple)) or not seq:
            raise TypeError(f"{name} must be a non-empty list or tuple of arrays, got {_checks.describe(seq)}")
    if len(outs) != len(lses):
        raise ValueError(f"outs and lses must have one entry per part, got {len(outs)} outs and {len(lses)} lses")
    named = {f"outs[{i}]": x for i, x in enumerate(outs)} | {f"lses[{i}]": x for i, x in enumerate(lses)}
    _checks.check_arrays(named)
    xp = library(outs[0])
    value, carrier = _checks.check_dtypes({f"outs[{i}]": x for i, x in enumerate(outs)}, dtype)
    acc = accumulation_dtype(value)
    shape = tuple(outs[0].shape)
    if len(shape) != 4:
        raise ValueError(f"outs[0] must have rank 4 (batch, seqlen_q, heads_q, head_dim), got shape {shape}")
    B, S, H, _ = shape
    for i, (o, lse) in enumerate(zip(outs, lses)):
        if tuple(o.shape) != shape:
            raise ValueError(f"outs[{i}] must have outs[0]'s shape {shape}, got {tuple(o.shape)}")
        if tuple(lse.shape) != (B, H, S):
            raise ValueError(f"lses[{i}] must have shape (batch, heads_q, seqlen_q) = {(B, H, S)}, "
                             f"got {tuple(lse.shape)}")
        if np.dtype(lse.dtype) != acc:
            raise TypeError(f"lses[{i}] must have dtype {acc} (the accumulation dtype of {value} values), "
                            f"got {np.dtype(lse.dtype)}")
    return xp, value, carrier, acc


def widen(xp, x, value, acc=None):
    """x's values in the accumulation dtype (`acc`, by default value's): bfloat16 bit patterns
    widened exactly; x itself where it already holds them (read it, never write it)."""
    acc = accumulation_dtype(value) if acc is None else acc
    if value == "bfloat16" and x.dtype.kind in "iu":
        return (x.view(xp.uint16).astype(xp.uint32) << 16).view(xp.float32)
    return x.astype(acc, copy=False)


def store(xp, x, value, carrier):
    """float32/float64 x rounded to the values' dtype (to nearest even), in the carrier dtype."""
    if value == "bfloat16" and carrier.kind in "iu":
        bits = x.astype(xp.float32).view(xp.uint32)
        rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
        rounded = xp.where(xp.isnan(x), xp.uint32(0x7FC0), rounded)
        return rounded.astype(xp.uint16).view(carrier)
    return x.astype(carrier, copy=False)  # a float32 or float64 result is its own: no copy


def part_weights(xp, lses, acc):
    """(lse, [w_i]): the merged lse (B, H, S) and each part's weight, 0 where lse_i = -inf."""
    m = lses[0]
    for lse in lses[1:]:
        m = xp.maximum(m, lse)
    m_safe = xp.where(m == -xp.inf, acc.type(0), m)  # all parts empty: no shift, sum 0, lse -inf
    total = xp.zeros_like(m_safe)
    for lse in lses:
        total += xp.exp(lse - m_safe)
    with np.errstate(divide="ignore"):  # log(0) = -inf for rows that see no key
        lse = m_safe + xp.log(total)
    lse_safe = xp.where(lse == -xp.inf, acc.type(0), lse)
    return lse, [xp.exp(x - lse_safe) for x in lses]


def per_row(w):
    """(*batch, H, S) per-row factor as (*batch, S, H, 1), to scale (*batch, S, H, D) arrays."""
    return w.swapaxes(-1, -2)[..., None]


@_interop.accepts_foreign_arrays
def merge(outs, lses, *, dtype=None):
    """Combine the (out, lse) of attention over disjoint key sets into the (out, lse) over their
    union, exactly (to rounding): out = sum_i exp(lse_i - lse) out_i, lse = logsumexp_i lse_i.

    outs: arrays (batch, seqlen_q, heads_q, head_dim), all one dtype; lses: arrays
    (batch, heads_q, seqlen_q) in the accumulation dtype, as `attention(..., return_lse=True)`
    gives them. A row whose every lse_i is -inf gets out 0 and lse -inf. dtype="bfloat16" reads
    uint16/int16 outs as bfloat16 bit patterns. Returns (out, lse).
    """
    xp, value, carrier, acc = _check(outs, lses, dtype)
    lse, weights = part_weights(xp, lses, acc)
    out = None
    for o, w in zip(outs, weights):
        term = per_row(w) * widen(xp, o, value, acc)
        out = term if out is None else out + term
    return store(xp, out, value, carrier), lse


@_interop.accepts_foreign_arrays
def merge_backward(dout, outs, lses, out, lse, dlse=None, *, dtype=None):
    """Gradients (douts, dlses) of merge, given dout (out's shape and dtype) and, optionally, dlse
    (lse's shape and dtype; None: zero). out and lse are merge's results; douts come back in
    out's dtype, dlses in the accumulation dtype."""
    xp, value, carrier, acc = _check(outs, lses, dtype)
    named = {"dout": (dout, outs[0].shape, carrier), "out": (out, outs[0].shape, carrier),
             "lse": (lse, lses[0].shape, acc), "dlse": (dlse, lses[0].shape, acc)}
    for name, (x, shape, want) in named.items():
        if x is None and name == "dlse":
            continue
        _checks.check_arrays({"outs[0]": outs[0], name: x})
        if tuple(x.shape) != tuple(shape) or np.dtype(x.dtype) != want:
            raise ValueError(f"{name} must have shape {tuple(shape)} and dtype {want}, got "
                             f"{tuple(x.shape)} and {np.dtype(x.dtype)}")
    _, weights = part_weights(xp, lses, acc)
    g = widen(xp, dout, value, acc)
    o = widen(xp, out, value, acc)
    douts, dlses = [], []
    for o_i, w in zip(outs, weights):
        douts.append(store(xp, per_row(w) * g, value, carrier))
        dot = (g * (widen(xp, o_i, value, acc) - o)).sum(axis=-1).transpose(0, 2, 1)
        dlses.append(xp.where(w == 0, acc.type(0), w * (dot if dlse is None else dlse + dot)))
    return douts, dlses
