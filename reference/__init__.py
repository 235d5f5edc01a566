"""The oracle: deliberately naive attention in float64, with flashcupy's signatures.

Every backend is tested against this module. It is not installed with the
package; tests import it from the repository root.

It materialises the full (seqlen_q x seqlen_k) score matrix, applies a plain
softmax and the analytic backward, all in float64 on NumPy arrays, and
returns float64 results whatever the input dtype (inputs are upcast exactly).
`attention_backward` ignores the `out` and `lse` it is given and recomputes
everything from q, k and v, so it checks a backend's backward against the
true gradient rather than against the backend's own forward.

The score modifiers (README, Semantics) are applied plainly, in the order the README states:
s = scale q.k -> softcap (c tanh(s / c)) -> + alibi (-slope |i + d - j|) -> + bias -> the pairs
hidden by causal, window or mask become -inf -> softmax, d = seqlen_k - seqlen_q.

Dropout (dropout_p > 0) multiplies the softmax's P by Z / (1 - dropout_p), Z the keep mask of the
README's rule, computed here by its own Philox4x32-10 (`philox`, held to Random123's known answers
by the tests); lse stays that of the undropped P, and the backward is that of the dropped out.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["attention", "attention_backward", "attention_jvp", "attention_probs", "attention_probs_jvp",
           "attention_vjp", "dropout_keep", "philox", "values", "visible"]


def values(x, dtype=None):
    """x as float64. dtype="bfloat16" reads uint16/int16 arrays as bfloat16 bit patterns."""
    x = np.asarray(x)
    if x.dtype.itemsize == 2 and x.dtype.kind in "ui" and dtype == "bfloat16":
        x = (x.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return np.asarray(x, dtype=np.float64)


def philox(counter, key):
    """Philox4x32-10 (Salmon et al., SC 2011): four uint32 counter words (arrays that broadcast) and
    two key words (ints) to four uint32 words. Each round multiplies words 0 and 2 by the constants,
    64-bit products split into halves, and the key grows by the Weyl increments between rounds."""
    mask32 = (1 << 32) - 1
    x = [np.asarray(c, dtype=np.uint64) & np.uint64(mask32) for c in counter]
    key = [int(k) & mask32 for k in key]
    for round_ in range(10):
        if round_ > 0:
            key = [(key[0] + 0x9E3779B9) & mask32, (key[1] + 0xBB67AE85) & mask32]
        product0 = np.uint64(0xD2511F53) * x[0]
        product2 = np.uint64(0xCD9E8D57) * x[2]
        hi0, lo0 = product0 >> np.uint64(32), product0 & np.uint64(mask32)
        hi2, lo2 = product2 >> np.uint64(32), product2 & np.uint64(mask32)
        x = [hi2 ^ x[1] ^ np.uint64(key[0]), lo2, hi0 ^ x[3] ^ np.uint64(key[1]), lo0]
    return x


def dropout_keep(seed: int, p: float, shape, origin=(0, 0, 0, 0)):
    """The README's keep mask Z of a (B, H, Sq, Sk) problem (bool), each index plus origin's."""
    B, H, Sq, Sk = shape
    b, h, i, j = (np.arange(n, dtype=np.uint64).reshape([-1 if a == axis else 1 for a in range(4)]) + np.uint64(o)
                  for axis, (n, o) in enumerate(zip(shape, origin)))
    words = philox((j // np.uint64(4), i, h, b), (seed % 2 ** 32, seed // 2 ** 32))
    word = np.choose((j % np.uint64(4)).astype(np.int64), [np.broadcast_to(w, (B, H, Sq, Sk)) for w in words])
    return word >= math.floor(p * 2 ** 32)


def _dropped(P, dropout):
    """P times Z / (1 - p), dropout (p, seed, origin) or None (P itself)."""
    if dropout is None:
        return P
    p, seed, origin = dropout
    return np.where(dropout_keep(seed, p, P.shape, origin), P / (1 - p), 0.0)


def _dropout(p, seed, origin):
    return None if not p else (float(p), int(seed), tuple(origin))


def _heads_first(x, group: int):
    """(B, S, H, D) -> float64 (B, H*group, S, D), each kv head repeated for its query heads."""
    x = np.asarray(x, dtype=np.float64).transpose(0, 2, 1, 3)
    return np.repeat(x, group, axis=1) if group > 1 else x


def visible(seqlen_q: int, seqlen_k: int, causal: bool, diagonal: int | None = None, window=None):
    """(seqlen_q, seqlen_k) bool matrix, True where query i sees key j.

    Without causal or window every query sees every key. window=(left, right), each None
    (unbounded) or an int >= 0: query i sees key j only if i + diagonal - left <= j <= i +
    diagonal + right. causal is right = 0 (combined with a window's right by taking the smaller).
    The default diagonal aligns the last query with the last key (bottom-right, as flash-attn
    >= 2.1), and 0 is the top-left alignment of torch's is_causal.
    """
    if diagonal is None:
        diagonal = seqlen_k - seqlen_q
    left, right = (None, None) if window is None else window
    if causal:
        right = 0 if right is None else min(right, 0)
    i = np.arange(seqlen_q)[:, None]
    j = np.arange(seqlen_k)[None, :]
    seen = np.ones((seqlen_q, seqlen_k), dtype=bool)
    if right is not None:
        seen &= j <= i + diagonal + right
    if left is not None:
        seen &= j >= i + diagonal - left
    return seen


def _scores(Q, K, scale, causal, window=None, softcap=None, alibi_slopes=None, bias=None, mask=None,
            dtype=None):
    """The final scores S (B, H, Sq, Sk), -inf where hidden, with T = tanh(s / softcap) (None
    without softcap) and `seen`, True where a pair is not hidden, broadcast to S's shape."""
    Sq, Sk = Q.shape[2], K.shape[2]
    S = np.einsum("bhqd,bhkd->bhqk", Q, K) * scale
    T = None
    if softcap is not None:
        T = np.tanh(S / softcap)
        S = softcap * T
    if alibi_slopes is not None:
        slopes = values(alibi_slopes)
        slopes = slopes[None, :] if slopes.ndim == 1 else slopes  # (batch or 1, heads_q)
        distance = abs(np.arange(Sq)[:, None] + (Sk - Sq) - np.arange(Sk)[None, :])
        S = S - slopes[:, :, None, None] * distance
    if bias is not None:
        S = S + values(bias, dtype)
    seen = visible(Sq, Sk, causal, window=window)
    if mask is not None:
        seen = seen & np.asarray(mask, dtype=bool)
    seen = np.broadcast_to(seen, S.shape)
    return np.where(seen, S, -np.inf), T, seen


def _forward_terms(q, k, causal, scale, modifiers, dtype=None):
    """A dict: P (B, H, Sq, Sk), lse (B, H, Sq), the float64 head-first Q and K, S, T and seen
    (_scores), scale and group."""
    q, k = values(q, dtype), values(k, dtype)
    group = q.shape[2] // k.shape[2]
    Q, K = _heads_first(q, 1), _heads_first(k, group)
    # the README's default, written here rather than imported so that the oracle checks flashcupy's
    scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else float(scale)
    S, T, seen = _scores(Q, K, scale, causal, dtype=dtype, **modifiers)
    with np.errstate(invalid="ignore", divide="ignore"):
        m = S.max(axis=-1, initial=-np.inf, keepdims=True)
        m_ref = np.where(np.isneginf(m), 0.0, m)  # no key seen: exp(-inf) = 0, not NaN
        E = np.exp(S - m_ref)
        l = E.sum(axis=-1, keepdims=True)
        P = np.where(l > 0, E / np.where(l > 0, l, 1.0), 0.0)
        P = np.where(np.isnan(l), np.nan, P)
        lse = (m_ref + np.log(l))[..., 0]
    return dict(P=P, lse=lse, Q=Q, K=K, S=S, T=T, seen=seen, scale=scale, group=group)


def _modifiers(window=None, softcap=None, alibi_slopes=None, bias=None, mask=None) -> dict:
    return dict(window=window, softcap=softcap, alibi_slopes=alibi_slopes, bias=bias, mask=mask)


def attention(q, k, v, *, causal=False, window=None, softcap=None, alibi_slopes=None, bias=None, mask=None,
              scale=None, return_lse=False, backend=None, dtype=None, dropout_p=0.0, dropout_seed=None,
              dropout_origin=(0, 0, 0, 0)):
    """out (B, Sq, Hq, D) float64 and, with return_lse, lse (B, Hq, Sq) float64.

    `backend` is accepted for signature compatibility and ignored. dropout_origin: (b, h, i, j) of
    this problem's first pair in the keep mask (a sequence of a packed batch: (its index, 0, 0, 0)).
    """
    mods = _modifiers(window, softcap, alibi_slopes, bias, mask)
    q, k, v = (values(x, dtype) for x in (q, k, v))
    f = _forward_terms(q, k, causal, scale, mods, dtype)
    V = _heads_first(v, f["group"])
    P = _dropped(f["P"], _dropout(dropout_p, dropout_seed, dropout_origin))
    out = np.einsum("bhqk,bhkd->bhqd", P, V).transpose(0, 2, 1, 3)
    return (out, f["lse"]) if return_lse else out


def attention_probs(q, k, lse=None, *, rows=None, causal=False, window=None, softcap=None, alibi_slopes=None,
                    bias=None, mask=None, scale=None, backend=None, dtype=None):
    """P (B, Hq, len(rows), Sk) float64, the attention weights of the query rows asked for (None:
    all; a slice or an index array). `lse` and `backend` are ignored: P is recomputed."""
    mods = _modifiers(window, softcap, alibi_slopes, bias, mask)
    P = _forward_terms(q, k, causal, scale, mods, dtype)["P"]
    return P if rows is None else P[:, :, rows]


def _backward_terms(dout, q, k, v, causal, scale, modifiers=None, dtype=None, dlse=None, dropout=None):
    """The backward's float64 intermediates, heads first: a dict of P, Q, K, V, dO, O, dP, D, dS
    (the gradient of the final score, which is dbias), dSs (of the scaled score q.k scale, before
    the softcap: dS (1 - T^2)), T, seen, and the scale and group. A pair (i, j) that is hidden gets
    dS = 0 by selection, and a row that sees no key has its dO taken as 0: such rows add nothing to
    any gradient, whatever their dout holds (a NaN included), as the README says.
    dlse (batch, heads_q, seqlen_q), the gradient of lse, or None (0): d lse_i / d s_ij = p_ij, so
    dS = P (dP - D + dlse); D here is rowsum(dO O) - dlse, what the kernels' pre-pass computes.
    With dropout (p, seed, origin), O = (P Z / (1 - p)) V: dP is of the dropped weights times Z / (1 - p),
    and Pd, the dropped P, is what dV takes."""
    f = _forward_terms(q, k, causal, scale, modifiers or {}, dtype)
    P, seen, group = f["P"], f["seen"], f["group"]
    V = _heads_first(v, group)
    dO = np.where(seen.any(axis=-1)[..., None], _heads_first(dout, 1), 0.0)
    Pd = _dropped(P, dropout)
    O = np.einsum("bhqk,bhkd->bhqd", Pd, V)
    dP = _dropped(np.einsum("bhqd,bhkd->bhqk", dO, V), dropout)
    D = np.sum(dO * O, axis=-1, keepdims=True)
    if dlse is not None:
        D = D - np.where(seen.any(axis=-1), values(dlse), 0.0)[..., None]
    dS = np.where(seen, P * (dP - D), 0.0)
    dSs = dS if f["T"] is None else dS * (1 - f["T"] ** 2)
    return dict(P=P, Pd=Pd, Q=f["Q"], K=f["K"], V=V, dO=dO, O=O, dP=dP, D=D, dS=dS, dSs=dSs, T=f["T"], seen=seen,
                scale=f["scale"], group=group)


def _per_kv_head(x, group: int):
    """(B, Hq, S, D) -> (B, Hkv, S, D): the sum over the query heads that share a kv head."""
    B, H, S, Dh = x.shape
    return x.reshape(B, H // group, group, S, Dh).sum(axis=2) if group > 1 else x


def reduce_to(x, shape):
    """x (B, H, Sq, Sk) summed over the dimensions that `shape` broadcasts (size 1 there, not in
    x), to `shape`: how dbias gathers the gradient of a broadcast bias."""
    axes = tuple(a for a, (n, m) in enumerate(zip(shape, x.shape)) if n == 1 and m != 1)
    return x.sum(axis=axes, keepdims=True).reshape(shape)


def attention_backward(dout, q, k, v, out=None, lse=None, *, causal=False, window=None, softcap=None,
                       alibi_slopes=None, bias=None, mask=None, scale=None, backend=None, dtype=None, dlse=None,
                       dropout_p=0.0, dropout_seed=None, dropout_origin=(0, 0, 0, 0)):
    """(dq, dk, dv) in float64, recomputed from q, k, v; dk and dv summed over each GQA group;
    (dq, dk, dv, dbias) when bias is given, dbias of the bias's shape. dlse: the gradient of lse too."""
    mods = _modifiers(window, softcap, alibi_slopes, bias, mask)
    t = _backward_terms(*(values(x, dtype) for x in (dout, q, k, v)), causal, scale, mods, dtype, dlse,
                        _dropout(dropout_p, dropout_seed, dropout_origin))
    grads = tuple(x.transpose(0, 2, 1, 3) for x in _gradients(t))
    return grads if bias is None else grads + (reduce_to(t["dS"], np.shape(bias)),)


def _gradients(t):
    """(dQ, dK, dV) heads first from _backward_terms; dK and dV per kv head."""
    dQ = np.einsum("bhqk,bhkd->bhqd", t["dSs"], t["K"]) * t["scale"]
    dK = _per_kv_head(np.einsum("bhqk,bhqd->bhkd", t["dSs"], t["Q"]) * t["scale"], t["group"])
    dV = _per_kv_head(np.einsum("bhqk,bhqd->bhkd", t["Pd"], t["dO"]), t["group"])
    return dQ, dK, dV


def _tangent_terms(f, q_t, k_t, dtype):
    """St (B, H, Sq, Sk): the derivative of the final score along (q_t, k_t) (None: zero), which is
    scale (q_t.k + q.k_t) times 1 - T^2 under the softcap; 0 where the pair is hidden."""
    St = np.zeros(f["P"].shape)
    if q_t is not None:
        St = St + np.einsum("bhqd,bhkd->bhqk", _heads_first(values(q_t, dtype), 1), f["K"])
    if k_t is not None:
        St = St + np.einsum("bhqd,bhkd->bhqk", f["Q"], _heads_first(values(k_t, dtype), f["group"]))
    St = f["scale"] * St
    if f["T"] is not None:
        St = St * (1 - f["T"] ** 2)
    return np.where(f["seen"], St, 0.0)


def attention_jvp(q, k, v, q_t=None, k_t=None, v_t=None, bias_t=None, *, causal=False, window=None, softcap=None,
                  alibi_slopes=None, bias=None, mask=None, scale=None, backend=None, dtype=None, dropout_p=0.0,
                  dropout_seed=None, dropout_origin=(0, 0, 0, 0)):
    """(out_t, lse_t) in float64: the derivatives of out and lse along the tangent (q_t, k_t, v_t,
    bias_t), any of them None (zero); ALiBi slopes and mask held constant. With St the final score's
    derivative (_tangent_terms, plus bias_t), P's is P (St - mu), mu = rowsum(P St), which is lse's:
    out_t = (P (St - mu) Z) V + (P Z) v_t, Z the dropout's Z / (1 - p) (lse is of the undropped P).
    A row that sees no key: 0 and 0."""
    mods = _modifiers(window, softcap, alibi_slopes, bias, mask)
    q, k, v = (values(x, dtype) for x in (q, k, v))
    f = _forward_terms(q, k, causal, scale, mods, dtype)
    P, group = f["P"], f["group"]
    St = _tangent_terms(f, q_t, k_t, dtype)
    if bias_t is not None:
        St = St + np.where(f["seen"], values(bias_t, dtype), 0.0)
    mu = np.sum(P * St, axis=-1)
    Z = _dropped(np.ones_like(P), _dropout(dropout_p, dropout_seed, dropout_origin))
    out_t = np.einsum("bhqk,bhkd->bhqd", P * (St - mu[..., None]) * Z, _heads_first(v, group))
    if v_t is not None:
        out_t = out_t + np.einsum("bhqk,bhkd->bhqd", P * Z, _heads_first(values(v_t, dtype), group))
    return out_t.transpose(0, 2, 1, 3), mu


def attention_probs_jvp(q, k, q_t=None, k_t=None, bias_t=None, *, rows=None, causal=False, window=None,
                        softcap=None, alibi_slopes=None, bias=None, mask=None, scale=None, backend=None, dtype=None):
    """P_t (B, Hq, len(rows), Sk) float64: the derivative of attention_probs(q, k, lse) with lse the
    forward's own, along the tangent (q_t, k_t, bias_t), any of them None (zero); ALiBi slopes and mask
    held constant. With St the final score's derivative (_tangent_terms, plus bias_t), lse's is mu =
    rowsum(P St), so P_t = P (St - mu): 0 where a pair is hidden and in a row that sees no key."""
    mods = _modifiers(window, softcap, alibi_slopes, bias, mask)
    q, k = (values(x, dtype) for x in (q, k))
    f = _forward_terms(q, k, causal, scale, mods, dtype)
    St = _tangent_terms(f, q_t, k_t, dtype)
    if bias_t is not None:
        St = St + np.where(f["seen"], values(bias_t, dtype), 0.0)
    P = f["P"]
    P_t = P * (St - np.sum(P * St, axis=-1, keepdims=True))
    return P_t if rows is None else P_t[:, :, rows]


def attention_vjp(q, k, v, *, causal=False, window=None, softcap=None, alibi_slopes=None, bias=None, mask=None,
                  scale=None, backend=None, dtype=None, dropout_p=0.0, dropout_seed=None, dropout_origin=(0, 0, 0, 0)):
    mods = _modifiers(window, softcap, alibi_slopes, bias, mask)
    drop = dict(dropout_p=dropout_p, dropout_seed=dropout_seed, dropout_origin=dropout_origin)
    out = attention(q, k, v, causal=causal, scale=scale, dtype=dtype, **mods, **drop)

    def vjp(dout, dlse=None):
        return attention_backward(dout, q, k, v, causal=causal, scale=scale, dtype=dtype, dlse=dlse, **mods, **drop)

    return out, vjp
