"""The score modifiers other than the window, on the NumPy backend's tiles (README, Semantics).
The window is no modifier here: it is part of the band (p.band), so the tile plans never visit key
blocks outside it."""

from __future__ import annotations

import numpy as np

from ..._problem import LOG2E
from . import stacks


class Modifiers:
    """A call's softcap, ALiBi, bias and mask (README, Semantics), applied to a stack of score
    tiles (as stacks.HeadMap stacks them) in the base-2 units the tiles use, scores times log2(e):
    s' = c' tanh(s / c') with c' = softcap log2(e), then - slope log2(e) |i + diagonal - j|, then
    + bias log2(e), then -inf where the mask is False. The window is no modifier here: it is part
    of the band (p.band), so key blocks outside it are never visited. Broadcast
    bias and mask are read through zero-stride views a tile at a time, never materialised whole.
    Made only for calls that have one of these; plain calls never reach this code."""

    def __init__(self, p, heads: stacks.HeadMap):
        self.p, self.heads, acc = p, heads, p.acc_dtype
        self.acc = acc
        full = (p.batch, p.heads_q, p.seqlen_q, p.seqlen_k)
        self.cap = None if p.softcap is None else acc.type(p.softcap * LOG2E)
        self.slopes = None
        if p.alibi_slopes is not None:  # (batch, heads_q), times log2(e), rounded once
            slopes = np.asarray(p.alibi_slopes, dtype=np.float64) * LOG2E
            self.slopes = np.broadcast_to(slopes.astype(acc), (p.batch, p.heads_q))
        self.bias = None
        if p.bias is not None:
            bias = stacks.values(p, p.bias)[0] if p.bias.dtype == p.carrier else p.bias  # else float32
            self.bias = np.broadcast_to(bias, full)
        self.mask = None if p.mask is None else np.broadcast_to(p.mask, full)
        # a bias of the full shape: each element of dbias takes the dS of one pair, from one tile
        # (the tile plans cover each pair once), so add_dbias may write it rather than add to it
        self.dbias_once = p.bias is not None and tuple(p.bias.shape) == full

    def _heads(self, x, b, h0, h1, rows, cols):
        """x (batch, heads_q, seqlen_q, seqlen_k) for kv heads h0..h1, as (kv heads, rows, group,
        keys): the layout of a stack of score tiles seen as 4-D. A view where it can be."""
        g = self.heads.group
        if self.heads.consecutive:
            t = x[b, h0 * g:h1 * g][:, rows, cols]
        else:
            t = x[b][:, rows, cols][self.heads.index[h0:h1].ravel()]
        return t.reshape(h1 - h0, g, t.shape[1], t.shape[2]).transpose(0, 2, 1, 3)

    def apply(self, S, rows, cols, T=None, *, b, h0, h1, scratch, dead=None) -> bool:
        """Modify S (kv heads h0..h1, len(rows) x group, keys cols), the base-2 scores of batch b,
        in place. rows: a slice or an index array of query rows; cols: a slice. T: where to keep
        tanh(s / c) for the backward (softcap only). dead: a bool (kv heads, rows, group) array
        to fill with the rows the mask hides from every key of the tile; returns whether it did
        (False without a mask)."""
        acc, g = self.acc, self.heads.group
        heads, C = S.shape[0], S.shape[2]
        R = S.shape[1] // g
        S4 = S.reshape(heads, R, g, C)
        if self.cap is not None:
            t = S if T is None else T
            np.divide(S, self.cap, out=t)
            np.tanh(t, out=t)
            np.multiply(t, self.cap, out=S)
        if self.slopes is not None:
            i = np.arange(rows.start, rows.stop) if isinstance(rows, slice) else rows
            distance = np.abs((i + self.p.diagonal)[:, None] - np.arange(cols.start, cols.stop)[None, :]).astype(acc)
            slopes = self.slopes[b][self.heads.index[h0:h1]]  # (kv heads, group)
            alibi = np.multiply(slopes[:, None, :, None], distance[None, :, None, :],
                                out=scratch.take("alibi", S4.shape, acc))
            np.subtract(S4, alibi, out=S4)
        if self.bias is not None:
            bias = np.multiply(self._heads(self.bias, b, h0, h1, rows, cols), acc.type(LOG2E),
                               out=scratch.take("bias", S4.shape, acc), dtype=acc)
            np.add(S4, bias, out=S4)
        if self.mask is not None:
            hide = np.logical_not(self._heads(self.mask, b, h0, h1, rows, cols),
                                  out=scratch.take("hide", S4.shape, np.bool_))
            np.copyto(S4, -np.inf, where=hide)
            if dead is not None:
                np.logical_and.reduce(hide, axis=3, out=dead)
                return True
        return False

    def add_dbias(self, target, dS, rows: slice, cols: slice, *, b, h0, h1) -> None:
        """target (the bias's shape, in the accumulation dtype) += dS (kv heads h0..h1, rows x
        group, keys cols: the gradient of the final scores of batch b), summed over the
        dimensions the bias broadcasts."""
        Bb, Hb, Sqb, Skb = target.shape
        g = self.heads.group
        x = dS.reshape(dS.shape[0], -1, g, dS.shape[2])
        t = target[b if Bb > 1 else 0]
        if Sqb == 1:
            x, rows = x.sum(axis=1, keepdims=True), slice(0, 1)
        if Skb == 1:
            x, cols = x.sum(axis=3, keepdims=True), slice(0, 1)
        if Hb == 1:
            t[0, rows, cols] += x.sum(axis=(0, 2))
        elif self.heads.consecutive:
            region = t[h0 * g:h1 * g, rows, cols]
            region = region.reshape(h1 - h0, g, *region.shape[1:]).transpose(0, 2, 1, 3)
            if self.dbias_once:  # nothing else adds here: no read of the zeros (or pages) first
                region[...] = x
            else:
                region += x
        else:
            for kv in range(h1 - h0):
                for h in range(g):
                    t[self.heads.index[h0 + kv, h], rows, cols] += x[kv, :, h]


class Dropout:
    """Dropout's weights Z / (1 - p) of a call (flashcupy/_dropout.py, the rule's home), a tile of a
    stack at a time: (kv heads, rows x group, keys) as stacks.HeadMap stacks the query heads, in the
    accumulation dtype. The forward multiplies P by it before P V (its row sum stays undropped), the
    backward P before dV and dP before dS."""

    def __init__(self, p, heads: stacks.HeadMap):
        self.p, self.heads = p, heads
        self.kept = p.acc_dtype.type(p.dropout_scale)

    def tile(self, out, b: int, h0: int, h1: int, rows: slice, cols: slice):
        """out (kv heads h0..h1, rows x group, keys) = the weights of batch b, query rows `rows` and
        keys `cols`."""
        from ... import _dropout
        p = self.p
        index = self.heads.index[h0:h1]  # (kv heads, group): the query heads
        keep = _dropout.block(p.dropout_seed, p.dropout_p, p.dropout_origin, b, index[:, :, None, None],
                              rows.start, rows.stop, cols.start, cols.stop)  # (kv heads, group, rows, keys)
        stacked = out.reshape(h1 - h0, rows.stop - rows.start, self.heads.group, cols.stop - cols.start)
        np.multiply(keep.transpose(0, 2, 1, 3), self.kept, out=stacked)
        return out
