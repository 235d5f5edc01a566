"""How a backend's result is compared with the oracle: one tolerance rule, per output and per element.

`expected(q, k, v, dout, ...)` gives the oracle's out, lse, dq, dk, dv and, for every element, the
error a correct backend may show: a worst-case forward-error model of what the kernels compute in
the input dtype and the accumulation dtype (the terms are listed on `expected`), times SAFETY.
`error_ratio(got, expected, name)` is the largest |got - want| / tolerance of one output: 1 or
less passes. Positions where the oracle gives -inf, NaN or +inf must match exactly, and where the
tolerance is 0 (rows that see no key) only the exact answer passes.

The margins it leaves to correct kernels, and that a wrong one would have to hide in, are measured by
`python benchmarks/tolerance_margins.py` (a table in the README).

Used by the tests (conftest.assert_matches_oracle) and by `python -m flashcupy check`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from flashcupy._problem import accumulation_dtype  # what the backends accumulate in: the model's u_a

from . import (_backward_terms, _dropout, _dropped, _forward_terms, _gradients, _heads_first, _modifiers, _per_kv_head,
               reduce_to, values)

# The battery every backend runs, in the tests and in `python -m flashcupy check`:
# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal).
# Lengths are chosen to be 1 or not a multiple of any tile; Sq < Sk and Sq > Sk with causal
# (bottom-right alignment leaves the first Sq - Sk rows fully masked); GQA and MQA.
BATTERY = (
    (1, 1, 1, 1, 1, 1, False),
    (2, 17, 17, 2, 2, 40, False),
    (1, 17, 129, 4, 2, 72, True),     # Sq < Sk, GQA
    (1, 129, 17, 3, 1, 16, True),     # Sq > Sk: rows 0..111 see no key, MQA
    (1, 33, 65, 2, 2, 100, False),
    (1, 20, 20, 1, 1, 256, True),
)

# (u_out, u_acc) per input dtype
ROUNDOFF = {
    "float16": (2.0**-11, 2.0**-24),
    "bfloat16": (2.0**-8, 2.0**-24),
    "float32": (2.0**-24, 2.0**-24),
    "float64": (2.0**-53, 2.0**-53),
}


def dtype_name(dtype) -> str:
    """'float16', 'bfloat16', ... for a dtype, a type or a name."""
    return dtype if isinstance(dtype, str) else np.dtype(dtype).name
# The tolerance covers the model's bound SAFETY times: the model is a worst-case bound for each
# rounding the kernels do, and only the final rounding into the storage dtype can come near it.
SAFETY = 1.5
# The NumPy backend subtracts a reference max that trails the row max by up to 60 ln 2 inside its
# score matmul (lazy rescaling), so |m| joins the terms whose rounding reaches s - m; and its row sum
# may sink to 2^-60 before the reference moves, so a p that small times the smallest normal may be
# flushed (softmax.py's L_MIN, L_MAX).
LAZY_MAX = 60 * math.log(2)
LAZY_RANGE = 2.0**60

# The kernel families, each charged only its own liberties on top of the roundings every kernel does:
# "numpy": the lazy maximum (LAZY_MAX, LAZY_RANGE); "simt" (the cupy SIMT kernels, numba): none, P and
# dS stay in the accumulation dtype and m is the exact running max; "tensor_core": P and dS rounded
# to the 16-bit storage dtype before their matmuls (u_p, and float16's subnormal floor round16).
# None (a caller that cannot say which kernels ran) charges every family's liberties.
FAMILIES = ("numpy", "simt", "tensor_core")


def kernel_family(backend: str, dtype, head_dim: int) -> str:
    """The kernel family a call of `backend` on `dtype` and `head_dim` runs, for expected(family=):
    the one place the tests and the margins script decide it (`python -m flashcupy check` still uses family=None).

    numpy -> "numpy"; cupy -> "tensor_core" where its tensor-core forward takes the dtype and
    head_dim (cupy_backend.USE_TENSOR_CORES and specs.tensor_core_eligible: head_dim up to 256; the
    Hopper forward, which rounds P to 16 bits as the mma.sync kernels do, takes a part of those), else
    "simt"; numba -> "simt". A call whose device or strides send it to the SIMT kernels after all is
    still judged as tensor-core, the looser of the two."""
    if backend == "numpy":
        return "numpy"
    if backend == "numba":
        return "simt"
    if backend == "cupy":
        from flashcupy.backends import cupy_backend
        from flashcupy.backends.cupy_backend import specs
        name = dtype_name(dtype)
        eligible = cupy_backend.USE_TENSOR_CORES and specs.tensor_core_eligible(name, head_dim)
        return "tensor_core" if eligible else "simt"
    raise ValueError(f"no kernel family known for backend {backend!r}")


@dataclass
class Expected:
    """The oracle's out, lse, dq, dk, dv (float64) and, element by element, how far a correct
    backend may be from each."""

    want: dict
    tol: dict
    dtype: str


def expected(q, k, v, dout=None, *, causal=False, scale=None, dtype=None, window=None, softcap=None,
             alibi_slopes=None, bias=None, mask=None, probs=False, family=None, dlse=None, dropout_p=0.0,
             dropout_seed=None, dropout_origin=(0, 0, 0, 0), tangents=None, _dbias_shape=None) -> Expected:
    """Oracle results and tolerances for these inputs (dout None: forward only), with the score
    modifiers of the README (dbias too when bias and dout are given; P, the attention weights of
    attention_probs, too with probs=True).

    A forward-error model of what the kernels compute, worst case per element, with u_s the
    storage dtype's unit roundoff, u_a the accumulation dtype's, gamma(n) = n u_a (a sum of n
    products), |.| products of absolute values, D q's and k's head dim and Dv v's:
    - scores: s_ij - m is off by at most ds_i = gamma(D + 2) (scale |q_i|.|k_j| + |m|), |m| up to
      max_j scale |q_i|.|k_j| (+ LAZY_MAX for the "numpy" family); each p_ij = exp(s_ij - lse_i) is
      then off by a relative eps_i = 2 ds_i + gamma(Sk) + 4 u_a (the row sum, exp2 and the
      division), plus u_p (u_s for float16 and bfloat16 in the "tensor_core" family, which rounds
      P and dS to the storage dtype; u_a otherwise), and absolutely by p_floor (a p below it may be
      flushed: the accumulation dtype's smallest normal, times 2^60 for "numpy", the lazy
      rescaling's range; for float16 on "tensor_core", half float16's smallest subnormal, round16,
      once rounded to float16);
    - lse_i: ds_i + gamma(Sk) + u_a |lse_i|;
    - out_i: (eps_i + u_p + gamma(Sk)) sum_j p_ij |v_j|;
    - dv_j: sum_i p_ij (eps_i + u_p + gamma(Sq group)) |dO_i|;
    - D_i = dO_i . O_i reads the backend's own out, rounded: (u_s + gamma(Dv)) |dO_i|.|O_i| plus
      |dO_i| . (out_i's bound); with dlse (the gradient of lse: dS_ij = p_ij (dP_ij - D_i + dlse_i)),
      D_i - dlse_i is one more rounding, u_a (|D_i| + |dlse_i|); dP_ij = dO_i . v_j: gamma(Dv)
      |dO_i|.|v_j|; dS_ij = p_ij (dP_ij - D_i): |dS_ij| (eps_i + u_p) + p_ij (the dP and D bounds);
    - dq_i, dk_j: scale sum (dS's bound + gamma(n) |dS|) |k_j| or |q_i|;
    - every result is then rounded to the storage dtype: u_s |x|, and absolutely half float16's
      smallest subnormal, or float32's smallest normal (flushed under -ftz) for bfloat16 and
      float32, float64's for float64.
    With modifiers (none of these terms exists without them):
    - ds_i grows by gamma(D + 2) max_j (|alibi_ij| + |bias_ij|) (|m| grows by as much) and by
      gamma(8) max_j (|s'_ij| + |alibi_ij| + |bias_ij|), s' the softcapped score: the roundings of
      the softcap (division, tanh, product), of the alibi and bias terms (and of their scaling to
      base 2) and of a subtraction of m done outside the matmul;
    - softcap: dq and dk take dS (1 - t^2), t = tanh(s / c), off by (1 - t^2) (dS's bound)
      + |dS| (2 (1 - t^2) ds_i / c + 8 u_a) (t's error from the score's, and the roundings);
    - dbias = dS summed over the bias's broadcast dimensions: the sum of dS's bound plus
      gamma(n) |dS|, n the number of terms summed;
    - P_ij (attention_probs, from the backend's own lse): p_ij (eps_i + lse's bound) + p_floor.
    With dropout, out, dv and dP read the dropped weights p_ij z_ij, z_ij = Z_ij / (1 - p): their
    terms in p_ij and p_floor, and dP's bound, are times z_ij, and eps_i grows by 2 u_a there (the
    rounding of 1 / (1 - p) to the accumulation dtype and of the product); P itself is undropped.
    Forward mode, tangents=(q_t, k_t, v_t[, bias_t]) (any None: zero): out_t and lse_t (reference.attention_jvp)
    as flashcupy.jax computes them, out_t = A - mu out + E in the accumulation dtype (u_a (|A| +
    |mu||out| + |E|), twice, then stored: u_s |out_t|), each term the package's own result:
    - A = sum_j p_ij z_ij St_ij v_j and mu = sum_j p_ij St_ij (lse_t) are a backward's dq (out 0, so
      D = 0) with dO = (q_t, q) and v = (k, k_t) side by side, so dP = St / scale, of W = 2 D terms:
      dS's bound with dP's gamma(W) |q_t|.|k| + |q|.|k_t| and D's 0 (the softcap's terms as for dq),
      then dq's sum over Sk keys, and u_s twice (stored, and two parts added where the backend's head
      dim takes them apart);
    - E = sum_j p_ij z_ij v_t_j is a forward's out with v_t: out's bound on |v_t|; |out|'s own bound
      enters through mu out;
    - a fourth tangent, bias_t, adds sum_j p_ij b_ij (z_ij v_j) to mu (and A), b = bias_t, summed by XLA
      from the package's P (attention_probs, its bound below) in the accumulation dtype: P's bound times
      |b|, plus gamma(Sk + 1) p_ij |b_ij|, summed alike.
    With probs=True too, P_t = P (St - mu) (reference.attention_probs_jvp) as flashcupy.jax's
    attention_probs computes it: St by XLA in the accumulation dtype, gamma(D) scale (|q_t|.|k| +
    |q|.|k_t|) (under the softcap, times 1 - t^2, with t's error from the score's, gamma(D) scale
    |q|.|k|, and gamma(8) for the roundings of t), plus u_a |St| where bias_t is added; mu as lse_t
    above; P's bound on |St - mu| and both bounds on P; the subtraction and product, 2 u_a P (|St| + |mu|).
    The tolerance is SAFETY times the bound.

    family: the kernel family that computed the results (FAMILIES, from kernel_family): only its
    own liberties are charged; None charges all of them (LAZY_MAX, 2^60, u_p, round16).

    q of rank above 4, (*batch, seqlen_q, heads_q, head_dim) with k and v alike, and a bias or mask
    broadcastable to (*batch, heads_q, seqlen_q, seqlen_k) (README): the same model on the leading
    dimensions folded into one (_expected_leading), dbias summed over every dimension the bias
    broadcasts.
    """
    if np.ndim(q) > 4:
        return _expected_leading(q, k, v, dout, causal=causal, scale=scale, dtype=dtype, window=window,
                                 softcap=softcap, alibi_slopes=alibi_slopes, bias=bias, mask=mask, probs=probs,
                                 family=family, dlse=dlse, dropout_p=dropout_p, dropout_seed=dropout_seed,
                                 dropout_origin=dropout_origin, tangents=tangents)
    if family not in FAMILIES + (None,):
        raise ValueError(f"family must be one of {FAMILIES} or None, got {family!r}")
    lazy = family in ("numpy", None)
    sixteen_bit_p = family in ("tensor_core", None)
    dtype = dtype_name(dtype if dtype is not None else q.dtype)
    u_s, u_a = ROUNDOFF[dtype]
    u_p = u_s if sixteen_bit_p and dtype in ("float16", "bfloat16") else u_a
    acc = accumulation_dtype(dtype).type
    round16 = 2.0**-25 if sixteen_bit_p and dtype == "float16" else 0.0
    p_floor = max(float(np.finfo(acc).tiny) * (LAZY_RANGE if lazy else 1.0), round16)
    lazy_max = LAZY_MAX if lazy else 0.0
    store_floor = 2.0**-25 if dtype == "float16" else float(np.finfo(acc).tiny)

    mods = _modifiers(window, softcap, alibi_slopes, bias, mask)
    modified = any(x is not None for x in mods.values())
    q, k, v = (values(x, dtype) for x in (q, k, v))
    B, Sq, Hq, D = q.shape
    Dv = v.shape[3]  # v's head dim: the length of dO.v and dO.O (D, q's and k's, that of q.k)
    Sk, group = k.shape[1], Hq // k.shape[2]
    f = _forward_terms(q, k, causal, scale, mods, dtype)
    P, lse, Q, K, scale, T = f["P"], f["lse"], f["Q"], f["K"], f["scale"], f["T"]
    V = _heads_first(v, group)
    seen = f["seen"].astype(np.float64)

    def gamma(n):
        return n * u_a

    Sabs = np.einsum("bhqd,bhkd->bhqk", abs(Q), abs(K)) * scale * seen
    ds = gamma(D + 2) * (Sabs.max(axis=-1, initial=0.0) + lazy_max) * seen.max(axis=-1, initial=0.0)
    if modified:
        _, added = _added_terms(q.shape, k.shape, alibi_slopes, bias, dtype)
        capped = Sabs if T is None else abs(softcap * T) * seen
        added = np.where((seen > 0) & np.isfinite(added), added, 0.0)  # a -inf bias hides
        ds = ds + (gamma(D + 2) * added.max(axis=-1, initial=0.0)
                   + gamma(8) * (capped + added).max(axis=-1, initial=0.0))
    eps = (2 * ds + gamma(Sk) + 4 * u_a)[..., None] + u_p
    dropout = _dropout(dropout_p, dropout_seed, dropout_origin)
    z = _dropped(np.ones_like(P), dropout)  # Z / (1 - p), 1 without dropout
    eps_z = 0.0 if dropout is None else 2 * u_a
    out = np.einsum("bhqk,bhkd->bhqd", P * z, V)
    with np.errstate(invalid="ignore"):
        tol = {"lse": ds + gamma(Sk) + u_a * np.where(np.isfinite(lse), abs(lse), 0.0),
               "out": (np.einsum("bhqk,bhkd->bhqd", (P * (eps + eps_z + gamma(Sk)) + p_floor * seen) * z, abs(V))
                       + u_s * abs(out) + store_floor)}
        P_bound = P * (eps + tol["lse"][..., None]) + p_floor * seen  # P recomputed from the backend's lse
    want = {"out": out, "lse": lse}
    if tangents is not None:
        _tangent_tolerance(want, tol, f, V, z, eps, eps_z, ds, p_floor, round16, store_floor, seen, tangents,
                           softcap, dtype, u_s, gamma, P_bound)
    if dout is not None:
        t = _backward_terms(values(dout, dtype), q, k, v, causal, scale, mods, dtype, dlse, dropout)
        dO, dP, Di, dS = t["dO"], t["dP"], t["D"], t["dS"]
        dP_bound = (gamma(Dv) + eps_z) * z * np.einsum("bhqd,bhkd->bhqk", abs(dO), abs(V))
        D_bound = ((u_s + gamma(Dv)) * np.sum(abs(dO) * abs(out), axis=-1, keepdims=True)
                   + np.sum(abs(dO) * tol["out"], axis=-1, keepdims=True))
        if dlse is not None:
            given = np.where(seen.max(axis=-1, initial=0.0) > 0, abs(values(dlse)), 0.0)[..., None]
            D_bound = D_bound + u_a * (abs(Di) + 2 * given)
        dS_bound = abs(dS) * eps + P * (dP_bound + D_bound) + (p_floor * (abs(dP) + abs(Di)) + round16) * seen
        if bias is not None:
            # _dbias_shape (from _expected_leading): (leading dimensions, the bias's shape padded to
            # them); dS's batch is then their product, and dbias sums over the ones it broadcasts
            # (a bias of fewer than 4 dimensions lines up with (B, Hq, Sq, Sk) from the right)
            leading, target = _dbias_shape or ((B,), (1,) * (4 - np.ndim(bias)) + np.shape(bias))
            n = max(1, (B * Hq * Sq * Sk) // max(1, math.prod(target)))  # terms per element

            def gather(x):
                return reduce_to(x.reshape(tuple(leading) + x.shape[1:]), target)

            want["dbias"] = gather(dS)
            stored = "float32" if np.asarray(bias).dtype == np.float32 else dtype  # dbias has the bias's dtype
            u_b = ROUNDOFF[stored][0]
            wide = accumulation_dtype(stored).type
            floor_b = 2.0**-25 if stored == "float16" else float(np.finfo(wide).tiny)
            tol["dbias"] = gather(dS_bound + gamma(n) * abs(dS)) + u_b * abs(want["dbias"]) + floor_b
            if _dbias_shape is None:  # dbias has the bias's own shape
                want["dbias"], tol["dbias"] = (x.reshape(np.shape(bias)) for x in (want["dbias"], tol["dbias"]))
        if T is not None:  # dq and dk read dS (1 - t^2), the gradient of the score before the softcap
            squeeze = 1 - T**2
            dS_bound = dS_bound * squeeze + abs(dS) * (2 * squeeze * ds[..., None] / softcap + gamma(8))
            dS = t["dSs"]
        want.update(zip(("dq", "dk", "dv"), _gradients(t)))
        tol.update(dq=scale * np.einsum("bhqk,bhkd->bhqd", dS_bound + gamma(Sk) * abs(dS), abs(K)),
                   dk=scale * np.einsum("bhqk,bhqd->bhkd", dS_bound + gamma(Sq * group) * abs(dS), abs(Q)),
                   dv=np.einsum("bhqk,bhqd->bhkd", (P * (eps + eps_z + gamma(Sq * group)) + p_floor * seen) * z,
                                abs(dO)))
        for name in ("dk", "dv"):  # sum over the query heads that share a kv head
            tol[name] = _per_kv_head(tol[name], group)
        for name in ("dq", "dk", "dv"):
            tol[name] = tol[name] + u_s * abs(want[name]) + store_floor
    if probs:
        want["P"] = P
        tol["P"] = P_bound
        if tangents is not None:
            _probs_tangent_tolerance(want, tol, f, tangents, dtype, softcap, gamma)
    for name in ("out", "out_t", "dq", "dk", "dv"):
        if name in want:
            want[name], tol[name] = (x.transpose(0, 2, 1, 3) for x in (want[name], tol[name]))
    return Expected(want, {name: SAFETY * t for name, t in tol.items()}, dtype)


def _score_products(f, q_t, k_t, dtype) -> tuple:
    """(q_t.k + q.k_t, |q_t|.|k| + |q|.|k_t|), heads first, 0 where a pair is hidden: the score's
    derivative before the scale and softcap, and the sum of its 2 D products' sizes."""
    P, Q, K, group = f["P"], f["Q"], f["K"], f["group"]
    dP, dP_abs = np.zeros(P.shape), np.zeros(P.shape)
    for x, y in ((None if q_t is None else _heads_first(values(q_t, dtype), 1), K),
                 (Q, None if k_t is None else _heads_first(values(k_t, dtype), group))):
        if x is not None and y is not None:
            dP = dP + np.einsum("bhqd,bhkd->bhqk", x, y)
            dP_abs = dP_abs + np.einsum("bhqd,bhkd->bhqk", abs(x), abs(y))
    return np.where(f["seen"], dP, 0.0), dP_abs


def _probs_tangent_tolerance(want, tol, f, tangents, dtype, softcap, gamma):
    """want and tol (before SAFETY) of P_t: expected()'s attention_probs terms in forward mode, after
    _tangent_tolerance's lse_t (mu, bias_t's part included)."""
    q_t, k_t = tangents[:2]
    bias_t = tangents[3] if len(tangents) > 3 else None
    P, Q, K, T, scale, seen = f["P"], f["Q"], f["K"], f["T"], f["scale"], f["seen"]
    D = Q.shape[-1]
    u_a = gamma(1)
    dP, dP_abs = _score_products(f, q_t, k_t, dtype)
    squeeze = 1.0 if T is None else 1 - T**2
    St = scale * dP * squeeze
    St_bound = scale * gamma(D) * dP_abs * squeeze
    if T is not None:
        Sabs = scale * np.einsum("bhqd,bhkd->bhqk", abs(Q), abs(K))
        St_bound = St_bound + abs(St) * (2 * squeeze * gamma(D) * Sabs / softcap + gamma(8))
    if bias_t is not None:  # lse_t (mu) has its part already (_tangent_tolerance)
        St = St + np.where(seen, values(bias_t, dtype), 0.0)
        St_bound = St_bound + u_a * abs(St)
    mu, mu_bound = want["lse_t"][..., None], tol["lse_t"][..., None]
    want["P_t"] = P * (St - mu)
    tol["P_t"] = (tol["P"] * (abs(St - mu) + St_bound + mu_bound) + P * (St_bound + mu_bound)
                  + 2 * u_a * P * (abs(St) + abs(mu)) + u_a * abs(want["P_t"]))


def _tangent_tolerance(want, tol, f, V, z, eps, eps_z, ds, p_floor, round16, store_floor, seen, tangents, softcap,
                       dtype, u_s, gamma, P_bound):
    """want and tol (before SAFETY, heads first) of out_t and lse_t: expected()'s forward-mode terms
    (P_bound: that of P recomputed from the backend's lse, as expected()'s probs)."""
    q_t, k_t, v_t = tangents[:3]
    bias_t = tangents[3] if len(tangents) > 3 else None
    P, Q, K, T, scale, group = f["P"], f["Q"], f["K"], f["T"], f["scale"], f["group"]
    D, Sk = Q.shape[-1], K.shape[2]
    dP, dP_abs = _score_products(f, q_t, k_t, dtype)  # W = 2 D products
    squeeze = 1.0 if T is None else 1 - T**2
    St = scale * dP * squeeze  # the score's derivative
    def sum_bound(zz, eps_zz, cols):
        """A's (zz = z, eps_zz = eps_z) or mu's (the undropped: 1, 0; cols 1) bound: dS = P zz dP's,
        through the softcap, summed."""
        dS = P * zz * dP
        bound = abs(dS) * eps + P * (gamma(2 * D) + eps_zz) * zz * dP_abs + (p_floor * abs(dP) + round16) * seen
        if T is not None:
            bound = bound * squeeze + abs(dS) * (2 * squeeze * ds[..., None] / softcap + gamma(8))
        dS = dS * squeeze
        return scale * np.einsum("bhqk,bhkd->bhqd", bound + gamma(Sk) * abs(dS), cols)

    mu = np.sum(P * St, axis=-1)
    A = np.einsum("bhqk,bhkd->bhqd", P * z * St, V)
    mu_bound = sum_bound(1.0, 0.0, np.ones(V.shape[:-1] + (1,)))[..., 0] + 2 * u_s * abs(mu) + store_floor
    A_bound = sum_bound(z, eps_z, abs(V)) + 2 * u_s * abs(A) + store_floor
    out, out_bound = want["out"], tol["out"]
    E, E_bound = 0.0, 0.0
    if v_t is not None:
        Vt = _heads_first(values(v_t, dtype), group)
        E = np.einsum("bhqk,bhkd->bhqd", P * z, Vt)
        E_bound = (np.einsum("bhqk,bhkd->bhqd", (P * (eps + eps_z + gamma(Sk)) + p_floor * seen) * z, abs(Vt))
                   + u_s * abs(E) + store_floor)
    if bias_t is not None:
        # mu and A have bias_t's part too, which XLA sums from P in the accumulation dtype: P from the
        # package's attention_probs (its bound as expected()'s P), times b (u_a), summed over Sk keys
        b = np.where(seen, values(bias_t, dtype), 0.0)
        Pb, Pb_bound = P * b, P_bound * abs(b) + gamma(Sk + 1) * P * abs(b)
        mu = mu + np.sum(Pb, axis=-1)
        mu_bound = mu_bound + np.sum(Pb_bound, axis=-1)
        A = A + np.einsum("bhqk,bhkd->bhqd", Pb * z, V)
        A_bound = A_bound + np.einsum("bhqk,bhkd->bhqd", Pb_bound * z, abs(V))
    out_t = A - mu[..., None] * out + E
    terms = abs(A) + abs(mu[..., None]) * (abs(out) + out_bound) + abs(E)
    want.update(out_t=out_t, lse_t=mu)
    tol.update(lse_t=mu_bound,
               out_t=(A_bound + abs(mu[..., None]) * out_bound + (abs(out) + out_bound) * mu_bound[..., None]
                      + E_bound + 2 * gamma(1) * terms + u_s * abs(out_t) + store_floor))


def _expected_leading(q, k, v, dout, *, bias, mask, alibi_slopes, dlse=None, tangents=None, **keywords) -> Expected:
    """expected() of a call with leading dimensions: q, k, v, dout with them folded into one (copies:
    this is the oracle), the bias and mask expanded over them only (their last three dimensions as
    given), per-batch slopes flattened; the results unfolded again, dbias of the bias's own shape."""
    batch = tuple(np.shape(q)[:-3])
    rank, calls = len(batch) + 3, math.prod(batch)  # calls, not -1: reshape cannot solve -1 at size 0

    def fold(x):
        return None if x is None else np.asarray(x).reshape((calls,) + np.shape(x)[-3:])

    def expand(x):
        if x is None:
            return None
        x = np.asarray(x).reshape((1,) * (rank - np.ndim(x)) + np.shape(x))
        return np.broadcast_to(x, batch + x.shape[-3:]).reshape((calls,) + x.shape[-3:])

    slopes = alibi_slopes
    if slopes is not None and np.ndim(slopes) > 1:
        slopes = np.asarray(slopes).reshape(calls, np.shape(slopes)[-1])
    padded = None if bias is None else (1,) * (rank - np.ndim(bias)) + tuple(np.shape(bias))
    dlse = None if dlse is None else np.asarray(dlse).reshape((calls,) + np.shape(dlse)[-2:])
    e = expected(fold(q), fold(k), fold(v), fold(dout), bias=expand(bias), mask=expand(mask), alibi_slopes=slopes,
                 dlse=dlse, tangents=None if tangents is None else tuple(map(fold, tangents[:3])) + tuple(
                     map(expand, tangents[3:])),
                 _dbias_shape=None if bias is None else (batch, padded), **keywords)
    for name, x in list(e.want.items()):
        shape = np.shape(bias) if name == "dbias" else batch + x.shape[1:]
        e.want[name], e.tol[name] = x.reshape(shape), e.tol[name].reshape(shape)
    return e


def _added_terms(q_shape, k_shape, alibi_slopes, bias, dtype):
    """(alibi + bias, |alibi| + |bias|) as float64 arrays broadcastable to (B, H, Sq, Sk)."""
    Sq, Sk = q_shape[1], k_shape[1]
    total, size = np.zeros((1, 1, 1, 1)), np.zeros((1, 1, 1, 1))
    if alibi_slopes is not None:
        slopes = values(alibi_slopes)
        slopes = slopes[None, :] if slopes.ndim == 1 else slopes
        alibi = -slopes[:, :, None, None] * abs(np.arange(Sq)[:, None] + (Sk - Sq) - np.arange(Sk)[None, :])
        total, size = total + alibi, size + abs(alibi)
    if bias is not None:
        b = values(bias, dtype)
        total, size = total + b, size + abs(b)
    return total, size


def error_ratio(got, expect: Expected, name: str, rows=None) -> float:
    """max |got - want| / tol over the elements of output `name` (<= 1 passes); AssertionError when
    the shape or the -inf / NaN / +inf pattern differs from the oracle's. Where the tolerance is 0
    (a row that sees no key) only an exact answer passes. rows: for "P", the query rows asked of
    attention_probs (a slice or an index array).

    `got` may hold bfloat16 bit patterns (uint16) when the dtype is bfloat16.
    """
    got = values(got, expect.dtype)
    want, tol = expect.want[name], expect.tol[name]
    if rows is not None:
        want, tol = want[..., rows, :], tol[..., rows, :]
    if got.shape != want.shape:
        raise AssertionError(f"{name}: shape {got.shape} != {want.shape}")
    for what, test in (("-inf", np.isneginf), ("NaN", np.isnan), ("+inf", np.isposinf)):
        bad = test(got) != test(want)
        if bad.any():
            where = tuple(int(i[0]) for i in np.nonzero(bad))
            raise AssertionError(f"{name}: {what} pattern differs from the oracle, first at {where}")
    finite = np.isfinite(want)
    err, tol = abs(got[finite] - want[finite]), tol[finite]
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(tol > 0, err / np.where(tol > 0, tol, 1.0), np.where(err > 0, np.inf, 0.0))
    return float(ratio.max(initial=0.0))
