"""The oracle: deliberately naive attention in float64, with flashcupy's signatures.

Every backend is tested against this module. It is not installed with the
package; tests import it from the repository root.

It materialises the full (seqlen_q x seqlen_k) score matrix, applies a plain
softmax and the analytic backward, all in float64 on NumPy arrays, and
returns float64 results whatever the input dtype (inputs are upcast exactly).
`attention_backward` ignores the `out` and `lse` it is given and recomputes
everything from q, k and v, so it checks a backend's backward against the
true gradient rather than against the backend's own forward.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["attention", "attention_backward", "attention_vjp", "values", "visible"]


def values(x, dtype=None):
    """x as float64. dtype="bfloat16" reads uint16/int16 arrays as bfloat16 bit patterns."""
    x = np.asarray(x)
    if x.dtype.itemsize == 2 and x.dtype.kind in "ui" and dtype == "bfloat16":
        x = (x.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return np.asarray(x, dtype=np.float64)


def _heads_first(x, group: int):
    """(B, S, H, D) -> float64 (B, H*group, S, D), each kv head repeated for its query heads."""
    x = np.asarray(x, dtype=np.float64).transpose(0, 2, 1, 3)
    return np.repeat(x, group, axis=1) if group > 1 else x


def visible(seqlen_q: int, seqlen_k: int, causal: bool, diagonal: int | None = None):
    """(seqlen_q, seqlen_k) bool matrix, True where query i sees key j.

    Without causal every query sees every key. With causal, query i sees key j iff
    j <= i + diagonal; the default diagonal aligns the last query with the last key
    (bottom-right, as flash-attn >= 2.1), and 0 is the top-left alignment of torch's
    is_causal.
    """
    if not causal:
        return np.ones((seqlen_q, seqlen_k), dtype=bool)
    if diagonal is None:
        diagonal = seqlen_k - seqlen_q
    i = np.arange(seqlen_q)[:, None]
    j = np.arange(seqlen_k)[None, :]
    return j <= i + diagonal


def _probabilities(q, k, causal, scale):
    """P (B, H, Sq, Sk), lse (B, H, Sq) and the float64 head-first q, k."""
    q, k = values(q), values(k)
    group = q.shape[2] // k.shape[2]
    Q, K = _heads_first(q, 1), _heads_first(k, group)
    # the README's default, written here rather than imported so that the oracle checks flashcupy's
    scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else float(scale)
    S = np.einsum("bhqd,bhkd->bhqk", Q, K) * scale
    S = np.where(visible(q.shape[1], k.shape[1], causal), S, -np.inf)
    with np.errstate(invalid="ignore", divide="ignore"):
        m = S.max(axis=-1, initial=-np.inf, keepdims=True)
        m_ref = np.where(np.isneginf(m), 0.0, m)  # no key seen: exp(-inf) = 0, not NaN
        E = np.exp(S - m_ref)
        l = E.sum(axis=-1, keepdims=True)
        P = np.where(l > 0, E / np.where(l > 0, l, 1.0), 0.0)
        P = np.where(np.isnan(l), np.nan, P)
        lse = (m_ref + np.log(l))[..., 0]
    return P, lse, Q, K, scale, group


def attention(q, k, v, *, causal=False, scale=None, return_lse=False, backend=None, dtype=None):
    """out (B, Sq, Hq, D) float64 and, with return_lse, lse (B, Hq, Sq) float64.

    `backend` is accepted for signature compatibility and ignored.
    """
    q, k, v = (values(x, dtype) for x in (q, k, v))
    P, lse, _, _, _, group = _probabilities(q, k, causal, scale)
    V = _heads_first(v, group)
    out = np.einsum("bhqk,bhkd->bhqd", P, V).transpose(0, 2, 1, 3)
    return (out, lse) if return_lse else out


def _backward_terms(dout, q, k, v, causal, scale):
    """The backward's float64 intermediates, heads first: a dict of P, Q, K, V, dO, O, dP, D, dS
    and the scale and group. A pair (i, j) that is hidden gets dS = 0 by selection, and a row that
    sees no key has its dO taken as 0: such rows add nothing to any gradient, whatever their dout
    holds (a NaN included), as the README says."""
    P, _, Q, K, scale, group = _probabilities(q, k, causal, scale)
    seen = visible(q.shape[1], k.shape[1], causal)
    V = _heads_first(v, group)
    dO = np.where(seen.any(axis=1)[:, None], _heads_first(dout, 1), 0.0)
    O = np.einsum("bhqk,bhkd->bhqd", P, V)
    dP = np.einsum("bhqd,bhkd->bhqk", dO, V)
    D = np.sum(dO * O, axis=-1, keepdims=True)
    dS = np.where(seen, P * (dP - D), 0.0)
    return dict(P=P, Q=Q, K=K, V=V, dO=dO, O=O, dP=dP, D=D, dS=dS, scale=scale, group=group)


def _per_kv_head(x, group: int):
    """(B, Hq, S, D) -> (B, Hkv, S, D): the sum over the query heads that share a kv head."""
    B, H, S, Dh = x.shape
    return x.reshape(B, H // group, group, S, Dh).sum(axis=2) if group > 1 else x


def attention_backward(dout, q, k, v, out=None, lse=None, *, causal=False, scale=None, backend=None,
                       dtype=None):
    """(dq, dk, dv) in float64, recomputed from q, k, v; dk and dv summed over each GQA group."""
    t = _backward_terms(*(values(x, dtype) for x in (dout, q, k, v)), causal, scale)
    return tuple(x.transpose(0, 2, 1, 3) for x in _gradients(t))


def _gradients(t):
    """(dQ, dK, dV) heads first from _backward_terms; dK and dV per kv head."""
    dQ = np.einsum("bhqk,bhkd->bhqd", t["dS"], t["K"]) * t["scale"]
    dK = _per_kv_head(np.einsum("bhqk,bhqd->bhkd", t["dS"], t["Q"]) * t["scale"], t["group"])
    dV = _per_kv_head(np.einsum("bhqk,bhqd->bhkd", t["P"], t["dO"]), t["group"])
    return dQ, dK, dV


def attention_vjp(q, k, v, *, causal=False, scale=None, backend=None, dtype=None):
    out = attention(q, k, v, causal=causal, scale=scale, dtype=dtype)

    def vjp(dout):
        return attention_backward(dout, q, k, v, causal=causal, scale=scale, dtype=dtype)

    return out, vjp
