"""The NumPy backend's online softmax: the lazily rescaled forward block (ForwardBlock), the one
redo of the rows whose sum overflowed (redo_rows, which the narrow band's tiles call too), the
textbook eager step for K and V read where they lie (eager_tile), and the normalisation O / l,
lse = ln 2 m + ln l.

Lazy rescaling (as in FlashAttention-4): exp() takes S - m with m a per-row reference that is
raised only when a tile's row sum would leave [L_MIN, L_MAX], instead of the running max of every
tile. The values stay far inside the accumulation dtype's range, relative precision is the same,
and a tile costs one elementwise pass (exp) instead of three (max, subtract, exp).
"""

from __future__ import annotations

import math

import numpy as np

from ..._problem import LN2, LOG2E
from . import tiling
from .pool import aligned_empty

L_MAX = 2.0**60
L_MIN = 2.0**-60


def base2_scale(p):
    """scale * log2(e) in the accumulation dtype: what Q or K carries so that scores come out in
    base 2 and P = exp2(S - m)."""
    return p.acc_dtype.type(p.scale * LOG2E)


def recomputed_p_may_pass_one(p, q, k) -> bool:
    """Whether the backward and attention_probs must clamp the s - lse they recompute to 0 (P to 1).

    P = exp2(s - lse) is at most 1, but they recompute s - lse with roundings other than the
    forward's: off by up to some (head_dim + 2) u (|s| + |lse|) (reference/compare.py's ds), which
    passes 1 once scores reach about 2^22 / head_dim in float32 (a scale of 1e30 with inputs of
    0.5), and then exp2 gives P far above 1 or inf, and NaN gradients (issue 31). While a bound of
    it (through head_dim max|q| max|k|) stays below 1/2, P stays below 2^(1/2) and no pass is spent
    on clamping, which costs a pass over every tile; deciding costs a pass or two over q and k. A
    bias's size is not bounded here: with a bias, always."""
    if p.bias is not None:
        return True

    def amax(x):  # max |x|, NaN where some x is NaN
        if x.dtype.itemsize == 2:  # float16, bfloat16: NumPy's max of them runs without SIMD, far slower
            return float(np.array(np.bitwise_and(x.view(np.uint16), 0x7FFF).max(), np.uint16).view(x.dtype))
        return max(float(np.max(x)), -float(np.min(x)))

    top = p.scale * LOG2E * p.head_dim * amax(q) * amax(k)  # |s| and sum_d |q_d k_d| scale in base 2, at most
    if p.alibi_slopes is not None:
        top += LOG2E * amax(np.asarray(p.alibi_slopes)) * (p.seqlen_q + p.seqlen_k)
    u = float(np.finfo(p.acc_dtype).eps) / 2
    return not (p.head_dim + 2) * u * (2 * top + math.log2(p.seqlen_k + 1)) < 0.5  # NaN: clamp


def largest_l(acc, v_max) -> float:
    """The largest row sum to let accumulate: L_MAX, or less when |v| is so large that
    O = sum_j p_j v_j could overflow the accumulation dtype (O <= l max|v| while l <= this)."""
    room = float(np.finfo(acc).max) / 4
    return min(L_MAX, room / v_max) if np.isfinite(v_max) and v_max * L_MAX > room else L_MAX


def rows_to_redo(l, l_max):
    """The rows whose row sum l left [L_MIN, l_max] (so O could overflow, or lose precision), or
    is NaN (an overflow, or inf times a mask's 0): each is redone with a new reference."""
    return ~(l <= l_max) | (l < L_MIN)


def redo_rows(S_r, before=None):
    """Redo the rows that overflowed with a new reference: S_r (rows, keys) holds their scores (base
    2, minus their reference so far, the pairs they do not see -inf) in a buffer of its own on a
    64-byte boundary (exp2's bits depend on alignment), and becomes their P = exp2(S_r - d).

    d, returned, is the reference's rise: the row's max, or what came before if that is larger
    (before: log2 of each row's l so far, None where nothing came before), so the redone row sums
    to at least 1 and what came before, scaled by 2^-d, stays at most 1. A row that sees no key
    keeps its reference (d = 0: -inf - -inf would be NaN, as the kernels' m_ref); NaN stays NaN."""
    with np.errstate(invalid="ignore"):
        d = S_r.max(axis=1)
    if before is not None:
        d = np.maximum(d, before)
    d[d == -np.inf] = 0
    np.subtract(S_r, d[:, None], out=S_r)
    np.exp2(S_r, out=S_r)
    return d


def normalised(O, l, m, out=None) -> tuple:
    """(O / l, lse) from O, l and the reference m (base 2): lse = ln 2 m + ln l; a row that saw
    no key (l = 0) gets out 0 and lse -inf, a NaN row stays NaN. O / l goes into out (O's shape),
    else into O."""
    acc = O.dtype
    out = O if out is None else out
    seen = l > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = m * acc.type(LN2) + np.log(l)
        if seen.all():
            return np.divide(O, l[..., None], out=out), lse
        np.divide(O, np.where(seen, l, 1)[..., None], out=out)
        out[~seen & ~np.isnan(l)] = 0  # fully masked rows: out 0 (NaN rows stay NaN)
        return out, np.where(seen | np.isnan(l), lse, -np.inf)


def eager_tile(S, V_j, m, O1, scratch) -> None:
    """One tile of the textbook online softmax, for V read where it lies (decoding): m (the
    running max, base 2) moves to the tile's max, what came before is rescaled by exp2(m_old -
    m_new), and [O | l] += [P V_j | rowsum P]. With few rows per key its passes over S cost little
    next to reading K and V, and P <= 1 bounds O by seqlen_k max|v| without a pass over V."""
    heads, M, _ = S.shape
    D = V_j.shape[2]
    m_new = np.maximum(m, np.maximum.reduce(S, axis=2))
    m_safe = np.where(m_new == -np.inf, 0, m_new)  # no key seen yet: -inf - -inf would be NaN
    P = np.exp2(np.subtract(S, m_safe[:, :, None], out=S), out=S)
    O1_j = scratch.take("O1_j", (heads, M, D + 1), S.dtype)
    np.matmul(P, V_j, out=O1_j[:, :, :D])
    np.add.reduce(P, axis=2, out=O1_j[:, :, D])
    O1 *= np.exp2(m - m_safe)[:, :, None]  # 0 while m was -inf
    O1 += O1_j
    m[...] = m_new


class ForwardBlock:
    """Online softmax of query block [i0, i1) over every key it sees, for a stack of kv heads: the
    loop state of FlashAttention-2's forward, m and [O | l], through the block's tiles.

    Q is (kv heads, rows x group, head_dim) and Kt is Kᵀ; one of them (Kt, unless K is read where it
    lies) carries scale * log2(e), so that the scores come out in base 2 and P = exp2(S - m) (m
    counts in base 2 too). A kv head's query heads are interleaved row by row (stacks.HeadMap), so
    a tile's rows are one slice for every kv head and each kv head's K is packed for BLAS once per
    tile. V1 is [V | 1], so the PV matmul returns rowsum(P) as its last column. With few query rows
    per key (decoding) Kt and V1 are instead views of K and V where they lie (tiled_forward), and
    each tile takes the textbook eager step (eager_tile), whose extra passes over S are cheap
    there. While every row's reference m is 0 the scores need no subtraction; once some row's m
    moves, the scores come from [Q | -m] [K | 1]ᵀ, which subtracts m inside the matmul. Either way
    a tile costs two matmuls and one elementwise pass (exp2).

    modify(S, rows, keys) (Modifiers.apply; None without softcap, ALiBi, bias or mask) changes the
    scores before m is subtracted, which then takes an elementwise pass of its own.

    The first tile a row meets writes its [P V_j | rowsum P] straight into [O | l] (nothing came
    before it to add to).

    dropout(out, rows, keys) (modifiers.Dropout.tile, partial; None without dropout) gives a tile's
    weights Z / (1 - p): P V_j takes P times them, and l its own row sum, undropped (the eager path
    is not taken with dropout: tiled_forward).
    """

    def __init__(self, p, Q, Kt, V1, i0, l_max, scratch, modify=None, dropout=None):
        self.p, self.Q, self.Kt, self.V1, self.i0, self.l_max = p, Q, Kt, V1, i0, l_max
        self.scratch, self.modify, self.dropout = scratch, modify, dropout
        heads, M, _ = Q.shape
        D = p.head_dim_v  # O's width (v's head dim; Q's may differ)
        self.acc, self.g, self.heads, self.D = p.acc_dtype, p.group, heads, D  # read per tile
        self.m = np.zeros((heads, M), dtype=self.acc)  # the reference
        self.O1 = scratch.take("O1", (heads, M, D + 1), self.acc, fill=0)  # [O | l]
        self.Q1 = self.K1t = None  # [Q | -m] and [K | 1]ᵀ, made when some m first moves
        self.eager = V1.shape[2] == D  # V itself (a strided view) rather than [V | 1]
        if self.eager:
            self.m[...] = -np.inf  # the running max itself (eager_tile)
        self.moved = False  # with modify: some m moved, so scores subtract m
        self.fresh_from = 0  # stack rows from here on have met no tile yet (tiles go down the rows, see forward_tiles)
        # with modify: the stack rows of the current tile that see none of its keys (mask or band), or
        # None. The tile leaves them as they were, so they need no redo, which would recompute the
        # whole tile: a row a mask hides entirely would otherwise cost every tile of its block twice
        self.dead_rows = None
        # the fast check: an upper bound on every row's l so far, and whether every row's l is known
        # to be at least L_MIN; a tile that might break either takes the exact, per-row check
        self.l_bound, self.above_min = 0.0, False

    def run(self, tiles, out=None) -> tuple:
        """Every tile, then (O / l, lse) stacked as Q, lse in natural log. out: where O / l goes, as
        (kv heads, rows, group, head_dim_v) (a view of the caller's output), else into O itself."""
        # exp2() overflowing to inf (or NaN from inf - inf), and log(0), are expected here: those
        # rows are redone
        tile = self.tile
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            for i0, i1, j0, j1, hidden in tiles:
                tile(i0, i1, j0, j1, hidden)
        D = self.D
        if out is None:
            return normalised(self.O1[..., :D], self.O1[..., D], self.m)
        shape = out.shape[:3]
        O1 = self.O1.reshape(*shape, D + 1)
        _, lse = normalised(O1[..., :D], O1[..., D], self.m.reshape(shape), out)
        return out, lse.reshape(self.m.shape)

    def scores(self, s0, s1, j0, j1, hidden, out, dead=None, masked=True):
        """S - m of stack rows [s0, s1) and keys [j0, j1) into out, modified; the pairs the band
        hides -inf where masked. dead: where modify marks the rows it hides from every key."""
        Q, Kt, g, i0 = self.Q, self.Kt, self.g, self.i0
        if self.modify is not None:
            np.matmul(Q[:, s0:s1], Kt[:, :, j0:j1], out=out)
            filled = self.modify(out, slice(i0 + s0 // g, i0 + s1 // g), slice(j0, j1), dead=dead)
            if dead is not None:
                if hidden is not None:  # rows the band hides from every key of the tile
                    band = hidden.all(axis=1)[None, :, None]
                    dead[...] = (dead | band) if filled else band
                    filled = True
                self.dead_rows = dead if filled else None
            if self.moved:
                np.subtract(out, self.m[:, s0:s1, None], out=out)
        elif self.Q1 is None:
            np.matmul(Q[:, s0:s1], Kt[:, :, j0:j1], out=out)
        else:
            np.matmul(self.Q1[:, s0:s1], self.K1t[:, :, j0:j1], out=out)
        if masked:
            tiling.mask_scores(out, self.p, i0 + s0 // g, j0, -np.inf, group=g, hidden=hidden)
        return out

    def tile(self, i0, i1, j0, j1, hidden) -> None:
        """[O | l] += [P V_j | rowsum P] for query rows [i0, i1) and keys [j0, j1), redoing the rows
        whose sum would leave [L_MIN, l_max]."""
        p, O1, scratch, heads, D, acc, g = self.p, self.O1, self.scratch, self.heads, self.D, self.acc, self.g
        s0, s1 = (i0 - self.i0) * g, (i1 - self.i0) * g  # the tile's rows within the stack
        dead = None if self.modify is None else scratch.take("dead", (heads, (s1 - s0) // g, g), np.bool_)
        # S - m; the band's hidden pairs are zeroed in P rather than set to -inf in S: NumPy's
        # float32 exp2 takes a much slower scalar path for SIMD vectors holding -inf
        S = self.scores(s0, s1, j0, j1, hidden, scratch.take("S", (heads, s1 - s0, j1 - j0), acc), dead,
                        masked=self.eager)
        if self.eager:
            eager_tile(S, self.V1[:, j0:j1], self.m[:, s0:s1], O1[:, s0:s1], scratch)
            return
        P = np.exp2(S, out=S)
        tiling.mask_scores(P, p, i0, j0, 0, group=g, hidden=hidden)
        fresh = s0 >= self.fresh_from  # these rows' [O | l] is still 0: the tile writes it, not adds to it
        self.fresh_from = max(self.fresh_from, s1)
        O1_j = O1[:, s0:s1] if fresh else scratch.take("O1_j", (heads, s1 - s0, D + 1), acc)
        self.pv(P, s0, s1, j0, j1, O1_j)
        l_j_max = float(np.maximum.reduce(O1_j[:, :, D], axis=None))
        # every row's l stays at least L_MIN if it was, or if this tile alone brings that much
        # (staircase and band tiles are the first a row meets, so the block's l never is)
        if ((self.above_min or float(np.minimum.reduce(O1_j[:, :, D], axis=None)) >= L_MIN)
                and self.l_bound + l_j_max <= self.l_max):  # False for NaN
            if not fresh:
                O1[:, s0:s1] += O1_j
            self.l_bound += l_j_max
            return
        l_new = O1_j[:, :, D] if fresh else O1[:, s0:s1, D] + O1_j[:, :, D]
        redo = rows_to_redo(l_new, self.l_max)
        if dead is not None and self.dead_rows is not None:
            redo &= ~self.dead_rows.reshape(heads, s1 - s0)
        self.redo(np.nonzero(redo), s0, s1, j0, j1, hidden, S, O1_j, fresh)
        if not fresh:
            O1[:, s0:s1] += O1_j
        l_all = O1[:, :, D]
        self.l_bound = float(np.maximum.reduce(l_all, axis=None))
        self.above_min = float(np.minimum.reduce(l_all, axis=None)) >= L_MIN

    def pv(self, P, s0, s1, j0, j1, O1_j) -> None:
        """O1_j = [P V_j | rowsum P] of stack rows [s0, s1) and keys [j0, j1); with dropout P V_j of the
        dropped P, the row sum of P itself."""
        if self.dropout is None:
            np.matmul(P, self.V1[:, j0:j1], out=O1_j)
            return
        D, g = self.D, self.g
        Z = self.dropout(self.scratch.take("Z", P.shape, self.acc), rows=slice(self.i0 + s0 // g, self.i0 + s1 // g),
                         cols=slice(j0, j1))
        np.add.reduce(P, axis=2, out=O1_j[:, :, D])
        np.multiply(P, Z, out=Z)
        np.matmul(Z, self.V1[:, j0:j1, :D], out=O1_j[:, :, :D])

    def redo(self, where, s0, s1, j0, j1, hidden, S, O1_j, fresh) -> None:
        """Redo the rows `where` (kv heads, stack rows within the tile) of the tile in S (whose
        scores exp2() overwrote) with a new reference (redo_rows): their O1_j anew, what came
        before them rescaled, and their m raised."""
        kk, rr = where
        if not kk.size:
            return
        acc, D, O1, m = self.acc, self.D, self.O1, self.m
        S_r = aligned_empty((kk.size, j1 - j0), acc)  # exp2's bits depend on alignment
        S_r[...] = self.scores(s0, s1, j0, j1, hidden, S)[kk, rr]  # this is rare
        # fresh rows have nothing before: their [O | l] holds this tile's overflowed sums
        d = redo_rows(S_r, None if fresh else np.log2(O1[kk, s0 + rr, D]))
        if self.dropout is not None:  # rather than redo the mask for these rows, the tile's, cut to them
            Z = self.dropout(self.scratch.take("Z", (self.heads, s1 - s0, j1 - j0), acc), rows=slice(
                self.i0 + s0 // self.g, self.i0 + s1 // self.g), cols=slice(j0, j1))[kk, rr]
        for kv in np.unique(kk):
            this = kk == kv
            if self.dropout is None:
                O1_j[kv, rr[this]] = S_r[this] @ self.V1[kv, j0:j1]
            else:
                O1_j[kv, rr[this], :D] = (S_r[this] * Z[this]) @ self.V1[kv, j0:j1, :D]
                O1_j[kv, rr[this], D] = S_r[this].sum(axis=1)
        if not fresh:
            # rescale what came before (nothing where l was 0: 0 * inf would be NaN); in
            # float64, where exp2(-d) cannot overflow while the product still fits
            alpha = np.where(O1[kk, s0 + rr, D] == 0, 0.0, np.exp2(-d.astype(np.float64)))
            O1[kk, s0 + rr] *= alpha[:, None]
        m[kk, s0 + rr] += d
        if self.modify is not None:
            self.moved = True  # scores() subtracts m: a modified score cannot come out of [Q | -m] [K | 1]ᵀ
            return
        if self.Q1 is None:
            heads, M = m.shape
            self.Q1 = np.concatenate([self.Q, np.zeros((heads, M, 1), acc)], axis=2)
            self.K1t = np.concatenate([self.Kt, np.ones((heads, 1, self.Kt.shape[2]), acc)], axis=1)
        self.Q1[:, :, -1] = -m
