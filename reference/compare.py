"""How a backend's result is compared with the oracle: one tolerance rule per dtype.

    max |got - want|  <=  (2 u_out + SLACK u_acc (1 + score_bound)) * (1 + max |want|)

u_out is the unit roundoff of the dtype the result is stored in; it counts
twice: the result's own rounding, and the rounded out that the backward reads
back (D = rowsum(dO∘O)). u_acc is the roundoff of the accumulation dtype
(float32 for float16/float32 inputs, float64 for float64). score_bound = max |s_ij| = scale * max |q_i . k_j|: the scores'
rounding error grows with their size, and exp() turns it into a relative
error of P. SLACK absorbs the
sums over head_dim, seqlen_k and seqlen_q of the test shapes (up to a few hundred terms).
Positions where the oracle gives -inf or NaN must match exactly.

Used by the tests and by `python -m flashcupy check`.
"""

from __future__ import annotations

import numpy as np

from flashcupy._api import default_scale

from . import values

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
SLACK = 64.0


def score_bound(q, k, scale=None, dtype=None) -> float:
    """max |s_ij| over every (query, key) pair that shares a head."""
    q64, k64 = values(q, dtype), values(k, dtype)
    B, Sq, Hq, D = q64.shape
    Hkv = k64.shape[2]
    if scale is None:
        scale = default_scale(D)
    S = np.einsum("bqhgd,bkhd->bhgqk", q64.reshape(B, Sq, Hkv, Hq // Hkv, D), k64)
    return scale * float(np.abs(S).max(initial=0.0))


def tolerance(dtype, want, q, k, scale=None) -> float:
    u_out, u_acc = ROUNDOFF[dtype_name(dtype)]
    bound = score_bound(q, k, scale, dtype_name(dtype))
    peak = np.abs(np.asarray(want, dtype=np.float64)).max(initial=0.0)
    return (2.0 * u_out + SLACK * u_acc * (1.0 + bound)) * (1.0 + peak)


def compare(got, want, dtype, q, k, scale=None, what="out"):
    """(max error, tolerance); raises AssertionError on a shape, -inf or NaN mismatch.

    `got` may hold bfloat16 bit patterns (uint16) when dtype is bfloat16.
    """
    got = values(got, dtype_name(dtype))
    want = np.asarray(want, dtype=np.float64)
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {got.shape} != {want.shape}")
    for name, test in (("-inf", np.isneginf), ("NaN", np.isnan), ("+inf", np.isposinf)):
        bad = test(got) != test(want)
        if bad.any():
            where = tuple(int(i[0]) for i in np.nonzero(bad))
            raise AssertionError(f"{what}: {name} pattern differs from the oracle, first at {where}")
    finite = np.isfinite(want)
    err = float(np.abs(got[finite] - want[finite]).max(initial=0.0))
    return err, tolerance(dtype, want[finite], q, k, scale)
