"""Short sequences computed in groups: a packed batch's (attention_varlen on the NumPy backend) and a
big rank-4 batch's (dense()).

Looping over the sequences costs one whole call each (the interface's checks, the plan, the pool,
a few dozen small NumPy calls): a few hundred microseconds, far more than the arithmetic of a
sequence of a hundred tokens; the tiled path's tasks per batch element and kv head cost alike. So
sequences at most SHORT long on both sides are taken in groups instead: a packed batch's of similar
lengths (_Packed: rows and keys gathered, padded to the group's longest by repeating a sequence's
last row, so every value read is one of its own), or whole elements of a batch of at least
DENSE_BATCH (_Dense: slices, the call's own band, bias and mask). Each group's scores are computed
whole, in the base-2 units of the tiled path, with the same modifiers in the same order (softcap,
ALiBi, bias, then the band and mask), each sequence's band (causal bottom-right, the window) its own
and the padding hidden, so that each sequence's results are exactly attention on it alone. With the
whole row in hand the softmax is the textbook one (the row's max, no rescaling); dbias is each
group's dS summed over what the bias broadcasts, the groups' parts then summed in their order. Longer
sequences, and smaller batches, take the tiled path. Every array of a group is a scratch buffer of
the worker (pool.Scratch): fresh pages cost more than these groups' arithmetic, and an aligned
buffer keeps exp2's bits the same whatever ran before.

The groups of a packed batch: sequences sorted by length (keys, then queries), cut where padding
would take more than WASTE of a group's scores or the group's scores pass GROUP_SCORES elements; a
batch's: runs of whole elements within GROUP_SCORES. Groups run on the pool's workers.
"""

from __future__ import annotations

import numpy as np

from ..._problem import LN2, LOG2E, Band
from . import pool, softmax, stacks
from .settings import config

SHORT = 128  # the longest sequence (queries or keys) taken in a group; a longer one is a call of its own
GROUP_SCORES = 1 << 18  # a group's padded scores (sequences x heads_q x rows x keys), at most
WASTE = 1.3  # a group's padded scores over its sequences' own, at most
DENSE_BATCH = 8  # the smallest batch of a rank-4 call run in groups (dense())


def short_limit() -> int:
    """The longest sequence taken in a group: config.SHORT where set, else SHORT."""
    return SHORT if config.SHORT is None else config.SHORT


def together(cu_q, cu_k) -> np.ndarray:
    """The sequences this module takes (both lengths at most short_limit(), neither 0), longest keys
    last."""
    limit = short_limit()
    Sq, Sk = np.diff(cu_q), np.diff(cu_k)
    short = np.flatnonzero((Sq > 0) & (Sk > 0) & (Sq <= limit) & (Sk <= limit))
    return short[np.lexsort((Sq[short], Sk[short]))]


def groups(sequences, cu_q, cu_k, heads_q: int) -> list:
    """sequences (as together() orders them) cut into groups: lists of sequence indices."""
    Sq, Sk = np.diff(cu_q), np.diff(cu_k)
    cut, current, own, rows, keys = [], [], 0, 0, 0
    for b in sequences.tolist():
        r, c = max(rows, int(Sq[b])), max(keys, int(Sk[b]))
        padded = (len(current) + 1) * r * c
        if current and (padded > WASTE * (own + Sq[b] * Sk[b]) or padded * heads_q > GROUP_SCORES):
            cut.append(current)
            current, own, r, c = [], 0, int(Sq[b]), int(Sk[b])
        current.append(b)
        own, rows, keys = own + int(Sq[b] * Sk[b]), r, c
    if current:
        cut.append(current)
    return cut


class _Group:
    """Sequences computed together: n of them, each of at most `rows` queries and `keys` keys, their
    indices `seqs` in the call's batch (ALiBi's slopes and dropout's draws are batch b's), `hidden`
    (broadcasting to (n, 1, rows, keys): pairs outside a sequence's band, or padding) and each one's
    `diagonal`. Subclasses say where the rows lie: _Packed (a packed batch), _Dense (a batch)."""

    p: object
    seqs: np.ndarray
    n: int
    rows: int
    keys: int

    def pair_arrays(self):
        """(bias, mask) of the group's batch elements, each broadcasting to (n, heads_q, rows, keys) (a
        bias in the values it holds), or None: a packed batch has neither."""
        return None, None

    def heads(self, x):
        """x (n, L, heads, D) as (n, heads_kv, group, L, D) (a kv head's query heads; group 1 on the
        key side): a view, whose matrices (L, D) BLAS reads with their row stride."""
        n, L, H, D = x.shape
        return x.reshape(n, L, self.p.heads_kv, H // self.p.heads_kv, D).transpose(0, 2, 3, 1, 4)

    def empty(self, scratch, name, side: str, H: int, D: int):
        """A scratch buffer (n, L, H, D) in the accumulation dtype, for results gathered as heads() views."""
        return scratch.take(name, (self.n, self.rows if side == "q" else self.keys, H, D), self.p.acc_dtype)

    def _into(self, scratch, name, src, H: int, D: int, L: int, scale, ones: bool):
        """src (n, L, H, D) copied into a scratch buffer in the accumulation dtype (times scale; ones: a
        column of ones after D)."""
        acc = self.p.acc_dtype
        dst = scratch.take(name, (self.n, L, H, D + ones), acc)
        if scale is None:
            np.copyto(dst[..., :D], src)
        else:
            np.multiply(src, scale, out=dst[..., :D], dtype=acc)
        if ones:
            dst[..., D] = 1
        return dst


class _Packed(_Group):
    """Sequences of a packed batch: where their rows and keys lie in the packed arrays (clamped into
    each sequence: every value read is one of its own), and which are padding."""

    def __init__(self, p, seqs, cu_q, cu_k):
        self.p, self.seqs = p, np.asarray(seqs)
        start_q, start_k = cu_q[self.seqs], cu_k[self.seqs]
        Sq, Sk = cu_q[self.seqs + 1] - start_q, cu_k[self.seqs + 1] - start_k
        self.n, self.rows, self.keys = len(self.seqs), int(Sq.max()), int(Sk.max())
        i, j = np.arange(self.rows), np.arange(self.keys)
        self.row_index = start_q[:, None] + np.minimum(i, Sq[:, None] - 1)  # (n, rows)
        self.key_index = start_k[:, None] + np.minimum(j, Sk[:, None] - 1)  # (n, keys)
        self.real_rows = np.flatnonzero(i < Sq[:, None])  # in the flattened (n x rows)
        self.real_keys = np.flatnonzero(j < Sk[:, None])
        # each sequence's own band (diagonal Sk - Sq) with p.band's sides (the packed call's options);
        # padding rows see nothing
        band = Band(self.rows, self.keys, (Sk - Sq)[:, None, None], p.band.left, p.band.right)
        seen = band.visible(i[None, :, None], j[None, None, :]) & (j < Sk[:, None])[:, None, :]
        self.hidden = ~(seen & (i < Sq[:, None])[:, :, None])[:, None]  # (n, 1, rows, keys)
        self.diagonal = Sk - Sq

    def gather(self, scratch, name, x, side: str, scale=None, ones=False):
        """x's rows (packed, heads, D) of the group (side "q": its query rows, "k": its keys) as (n, L,
        heads, D) in the accumulation dtype, times scale where given; ones: a column of ones after D
        (the row sums of a matmul by it). The packed layout, so no transposing copy: heads() views it."""
        index = self.row_index if side == "q" else self.key_index
        n, L = index.shape
        H, D = x.shape[1], x.shape[2]
        direct = x.dtype == self.p.acc_dtype and not ones
        raw = scratch.take(name if direct else f"{name}_raw", (n, L, H, D), x.dtype)
        np.take(x, index, axis=0, out=raw, mode="clip")  # (in range; "raise" would buffer out)
        if direct:  # raw is ours: scaled in place
            return raw if scale is None else np.multiply(raw, scale, out=raw)
        return self._into(scratch, name, raw, H, D, L, scale, ones)

    def scatter(self, scratch, name, dst, x, side: str):
        """dst (packed, heads, D) takes x's (n, L, heads, D or more) real rows."""
        index, real = (self.row_index, self.real_rows) if side == "q" else (self.key_index, self.real_keys)
        n, L = index.shape
        H, D = dst.shape[1], dst.shape[2]
        picked = scratch.take(f"{name}_picked", (real.size, H, D), x.dtype)
        np.take(x.reshape(n * L, H, x.shape[-1])[..., :D], real, axis=0, out=picked, mode="clip")
        dst[index.ravel()[real]] = picked

    def rows_of(self, x):
        """x (heads_q, packed) at the group's rows: (n, heads_q, rows)."""
        return x[:, self.row_index].transpose(1, 0, 2)

    def write_rows(self, dst, values):
        """dst (heads_q, packed) takes values (n, rows, heads_q) at the group's real rows."""
        dst[:, self.row_index.ravel()[self.real_rows]] = values.reshape(-1, values.shape[-1])[self.real_rows].T


class _Dense(_Group):
    """Batch elements b0 .. b1 - 1 of a rank-4 call: all of its lengths, p.band's band, no padding."""

    def __init__(self, p, b0: int, b1: int):
        self.p, self.b = p, slice(b0, b1)
        self.seqs, self.n, self.rows, self.keys = np.arange(b0, b1), b1 - b0, p.seqlen_q, p.seqlen_k
        i, j = np.arange(self.rows), np.arange(self.keys)
        self.hidden = ~p.band.visible(i[:, None], j[None, :])  # (rows, keys)
        self.diagonal = np.array([p.diagonal])  # as Modifiers

    def pair_arrays(self):
        p = self.p

        def rows(x):
            return None if x is None else x[self.b] if x.shape[0] > 1 else x
        bias = None if p.bias is None else stacks.values(p, p.bias)[0] if p.bias.dtype == p.carrier else p.bias
        return rows(bias), rows(p.mask)

    def gather(self, scratch, name, x, side: str, scale=None, ones=False):
        """gather()'s of _Packed: x (batch, L, heads, D), any strides, copied (never written)."""
        src = x[self.b]
        return self._into(scratch, name, src, x.shape[2], x.shape[3], x.shape[1], scale, ones)

    def scatter(self, scratch, name, dst, x, side: str):
        dst[self.b] = x[..., :dst.shape[-1]]

    def rows_of(self, x):
        """x (batch, heads_q, seqlen_q) at the group's batch elements."""
        return x[self.b]

    def write_rows(self, dst, values):
        dst[self.b] = values.transpose(0, 2, 1)


def _scores(p, g: _Group, scratch, Qs, K, alibi_slopes, batch: int):
    """(S, T): the group's base-2 scores (Qs: q times softmax.base2_scale; both gather()'s) as (n,
    heads_kv, group, rows, keys), -inf where hidden, and tanh(s / c) under the softcap (else None), in
    the order of modifiers.Modifiers (softcap, ALiBi, bias, then the band and mask), in scratch buffers."""
    acc = p.acc_dtype
    S = scratch.take("S", (g.n, p.heads_kv, p.group, g.rows, g.keys), acc)
    np.matmul(g.heads(Qs), g.heads(K).swapaxes(-1, -2), out=S)
    S4 = S.reshape(g.n, p.heads_q, g.rows, g.keys)
    T = None
    if p.softcap is not None:
        cap = acc.type(p.softcap * LOG2E)
        T = np.divide(S, cap, out=scratch.take("T", S.shape, acc))
        np.multiply(np.tanh(T, out=T), cap, out=S)
    if alibi_slopes is not None:
        slopes = np.asarray(alibi_slopes, dtype=np.float64) * LOG2E  # rounded once, as Modifiers
        slopes = np.broadcast_to(slopes.astype(acc), (batch, p.heads_q))[g.seqs]  # (n, heads_q)
        i, j = np.arange(g.rows), np.arange(g.keys)
        distance = np.abs(i[None, :, None] + g.diagonal[:, None, None] - j[None, None, :]).astype(acc)
        S4 -= np.multiply(distance[:, None], slopes[:, :, None, None], out=scratch.take("alibi", S4.shape, acc))
    bias, mask = g.pair_arrays()
    if bias is not None:  # times log2(e), rounded once, as Modifiers
        S4 += np.multiply(bias, acc.type(LOG2E), out=scratch.take("bias", bias.shape, acc), dtype=acc)
    np.copyto(S4, -np.inf, where=g.hidden)
    if mask is not None:
        np.copyto(S4, -np.inf, where=~mask)
    return S, T


def _dropout_weights(p, g: _Group):
    """Dropout's Z / (1 - p) of the group's pairs (sequence b's drawn as batch b's), or None without it."""
    if not p.dropout:
        return None
    from ... import _dropout
    keep = _dropout.block(p.dropout_seed, p.dropout_p, p.dropout_origin, g.seqs[:, None, None, None],
                          np.arange(p.heads_q)[None, :, None, None], 0, g.rows, 0, g.keys)
    acc = p.acc_dtype
    return np.where(keep, acc.type(p.dropout_scale), acc.type(0))


@np.errstate(over="ignore", invalid="ignore")  # scores past the range: as the tiled path
def _forward_group(p, g: _Group, scratch, q, k, v, out, lse, alibi_slopes, batch: int) -> None:
    """out and lse (values views) of the group's rows."""
    Dv = v.shape[-1]
    S, _ = _scores(p, g, scratch, g.gather(scratch, "Q", q, "q", softmax.base2_scale(p)),
                   g.gather(scratch, "K", k, "k"), alibi_slopes, batch)
    m = np.maximum.reduce(S, axis=-1)
    m[m == -np.inf] = 0  # no key seen: -inf - -inf would be NaN
    P = np.exp2(np.subtract(S, m[..., None], out=S), out=S)
    Z = _dropout_weights(p, g)
    # [O | l] = P [V | 1] (the row sum from the same matmul, as the tiled path's V1) without dropout;
    # with it, O of the dropped P and l of P
    V1 = g.gather(scratch, "V", v, "k", ones=Z is None)
    O1 = g.empty(scratch, "O1", "q", p.heads_q, V1.shape[-1])
    np.matmul(P if Z is None else P * Z.reshape(P.shape), g.heads(V1), out=g.heads(O1))
    by_row = (g.n, p.heads_q, g.rows)
    l = O1[..., Dv] if Z is None else P.sum(axis=-1).reshape(by_row).transpose(0, 2, 1)
    O, L = softmax.normalised(O1[..., :Dv], l, m.reshape(by_row).transpose(0, 2, 1))
    g.scatter(scratch, "out", out, O, "q")
    g.write_rows(lse, L)


@np.errstate(over="ignore", invalid="ignore")  # scores past the range: as the tiled path
def _probs_group(p, g: _Group, scratch, q, k, lse, rows, P, alibi_slopes, batch: int) -> None:
    """P (attention_probs: the group's elements, the query rows `rows`) recomputed from lse, s - lse
    clamped to at most 0 as the backward's; a row that sees no key gets 0."""
    acc = p.acc_dtype
    S, _ = _scores(p, g, scratch, g.gather(scratch, "Q", q, "q", softmax.base2_scale(p)),
                   g.gather(scratch, "K", k, "k"), alibi_slopes, batch)
    S4 = S.reshape(g.n, p.heads_q, g.rows, g.keys)
    L = g.rows_of(lse).astype(acc)
    np.subtract(S4, np.where(L > -np.inf, L * acc.type(LOG2E), 0)[..., None], out=S4)  # unseen rows: all -inf
    np.exp2(np.minimum(S4, 0, out=S4), out=S4)
    P[g.b] = S4[:, :, rows]


def _summed_over_group(p, g: _Group, scratch, name, product, width: int):
    """product (n, heads_kv, group, keys, width), a kv head's terms from each of its query heads, summed
    into a scratch (n, keys, heads_kv, width) buffer (gather()'s layout)."""
    total = g.empty(scratch, name, "k", p.heads_kv, width)
    np.sum(product, axis=2, out=g.heads(total)[:, :, 0])
    return total


@np.errstate(over="ignore", invalid="ignore")
def _backward_group(p, g: _Group, scratch, dout, q, k, v, out, lse, dq, dk, dv, alibi_slopes, batch: int,
                    dlse) -> None:
    """dq, dk, dv (values views) of the group's rows and keys: P recomputed from lse (s - lse clamped to
    at most 0, as every backward), rows that see no key adding nothing whatever their dout and dlse hold."""
    acc = p.acc_dtype
    D, Dv = q.shape[-1], v.shape[-1]
    Qs, K = g.gather(scratch, "Q", q, "q", softmax.base2_scale(p)), g.gather(scratch, "K", k, "k")
    S, T = _scores(p, g, scratch, Qs, K, alibi_slopes, batch)
    shape = S.shape[:-1]  # (n, heads_kv, group, rows)
    L = g.rows_of(lse).astype(acc).reshape(shape)
    seen = L > -np.inf  # (padding rows see no key: g.hidden)
    np.subtract(S, np.where(seen, L * acc.type(LOG2E), 0)[..., None], out=S)
    P = np.exp2(np.minimum(S, 0, out=S), out=S)  # NaN stays NaN
    dO = g.heads(g.gather(scratch, "dO", dout, "q"))
    np.copyto(dO, 0, where=~seen[..., None])
    Dsum = np.einsum("...d,...d->...", dO, g.heads(g.gather(scratch, "O", out, "q")))
    if dlse is not None:
        Dsum -= np.where(seen, g.rows_of(dlse).reshape(shape), 0)
    Z = _dropout_weights(p, g)
    V = g.heads(g.gather(scratch, "V", v, "k"))
    dS = np.matmul(dO, V.swapaxes(-1, -2), out=scratch.take("dS", S.shape, acc))  # dP
    if Z is not None:  # out read P Z / (1 - p)
        dS *= Z.reshape(S.shape)
    dS -= Dsum[..., None]
    dS *= P
    bias = g.pair_arrays()[0] if p.dbias else None
    dbias = None
    if bias is not None:  # dS summed over what the bias broadcasts within the group (the caller sums groups)
        axes = tuple(a for a, n in enumerate(bias.shape) if n == 1)
        dbias = dS.reshape(g.n, p.heads_q, g.rows, g.keys).sum(axis=axes, keepdims=True)
    if T is not None:
        np.subtract(1, np.multiply(T, T, out=T), out=T)
        dS *= T
    grads = g.empty(scratch, "dQ", "q", p.heads_q, D)
    np.multiply(np.matmul(dS, g.heads(K), out=g.heads(grads)), acc.type(p.scale), out=g.heads(grads))
    g.scatter(scratch, "dq", dq, grads, "q")
    if p.dq_only:
        return dbias
    product = scratch.take("dK_g", S.shape[:3] + (g.keys, D), acc)  # Qs is q scale log2(e): times ln 2
    np.matmul(dS.swapaxes(-1, -2), g.heads(Qs), out=product)
    grads = _summed_over_group(p, g, scratch, "dK", product, D)
    g.scatter(scratch, "dk", dk, np.multiply(grads, acc.type(LN2), out=grads), "k")
    product = scratch.take("dV_g", S.shape[:3] + (g.keys, Dv), acc)
    np.matmul((P if Z is None else P * Z.reshape(S.shape)).swapaxes(-1, -2), dO, out=product)
    g.scatter(scratch, "dv", dv, _summed_over_group(p, g, scratch, "dV", product, Dv), "k")
    return dbias


def _task(fn, make_group, *args):
    return lambda scratch: fn(args[0], make_group(), scratch, *args[1:])


@pool.one_call
def forward(p, q, k, v, cu_q, cu_k, sequences, out, lse, alibi_slopes=None) -> None:
    """out and lse (the packed call's: (total_q, heads_q, head_dim_v) and (heads_q, total_q)) of the
    sequences `sequences` (together()'s), written at their rows."""
    q, k, v, out = stacks.values(p, q, k, v, out)
    pool.run([_task(_forward_group, lambda seqs=seqs: _Packed(p, seqs, cu_q, cu_k), p, q, k, v, out, lse,
                    alibi_slopes, cu_q.size - 1) for seqs in groups(sequences, cu_q, cu_k, p.heads_q)])


@pool.one_call
def backward(p, dout, q, k, v, out, lse, cu_q, cu_k, sequences, dq, dk, dv, alibi_slopes=None, dlse=None) -> None:
    """dq, dk, dv of the sequences `sequences` (together()'s), written at their rows and keys."""
    dout, q, k, v, out, dq, dk, dv = stacks.values(p, dout, q, k, v, out, dq, dk, dv)
    pool.run([_task(_backward_group, lambda seqs=seqs: _Packed(p, seqs, cu_q, cu_k), p, dout, q, k, v, out, lse, dq,
                    dk, dv, alibi_slopes, cu_q.size - 1, dlse) for seqs in groups(sequences, cu_q, cu_k, p.heads_q)])


# ----------------------------------------------------------------------------
# a batch of short sequences (rank-4 calls: the backend's forward and backward ask dense())


def dense(p) -> bool:
    """Whether a rank-4 call runs as groups of its batch elements: a batch of at least DENSE_BATCH, both
    lengths at most short_limit(), neither 0. A smaller batch takes the tiled path's few tasks, whose
    fixed costs are then small."""
    limit = short_limit()
    return p.batch >= DENSE_BATCH and 0 < p.seqlen_q <= limit and 0 < p.seqlen_k <= limit


def _batch_ranges(p) -> list:
    """The batch cut into ranges of whole elements whose scores stay within GROUP_SCORES."""
    per = max(1, GROUP_SCORES // (p.heads_q * p.seqlen_q * p.seqlen_k))
    return [(b, min(p.batch, b + per)) for b in range(0, p.batch, per)]


def forward_dense(p, q, k, v, out, lse) -> None:
    """out and lse of a rank-4 call that dense() takes (values views, the backend's forward's)."""
    pool.run([_task(_forward_group, lambda r=r: _Dense(p, *r), p, q, k, v, out, lse, p.alibi_slopes, p.batch)
              for r in _batch_ranges(p)])


def probs_dense(p, q, k, lse, rows, P) -> None:
    """P (batch, heads_q, len(rows), seqlen_k) of a rank-4 call that dense() takes (q, k values views;
    rows an index array)."""
    pool.run([_task(_probs_group, lambda r=r: _Dense(p, *r), p, q, k, lse, rows, P, p.alibi_slopes, p.batch)
              for r in _batch_ranges(p)])


def backward_dense(p, dout, q, k, v, out, lse, dq, dk, dv, dlse=None, dB=None) -> None:
    """dq, dk, dv of a rank-4 call that dense() takes (values views, the backend's backward's); with a
    bias, dB (its shape, the accumulation dtype) becomes dbias: the groups' parts summed in their order,
    so the bits do not depend on which worker ran which group."""
    ranges = _batch_ranges(p)
    parts = pool.run([_task(_backward_group, lambda r=r: _Dense(p, *r), p, dout, q, k, v, out, lse, dq, dk, dv,
                            p.alibi_slopes, p.batch, dlse) for r in ranges])
    if dB is None:
        return
    dB.fill(0)
    for (b0, b1), part in zip(ranges, parts):
        if dB.shape[0] > 1:
            dB[b0:b1] += part
        else:
            dB += part
