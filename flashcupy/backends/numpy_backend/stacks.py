"""How the NumPy backend lays arrays out for its matmuls: the stacks of query heads (HeadMap), and
the views that read the inputs in their value dtype or the accumulation dtype."""

from __future__ import annotations

import numpy as np

from .. import bfloat16_dtype


def as_acc(x, acc):
    """x in the accumulation dtype: a view when it already is, else a converted copy."""
    return x if x.dtype == acc else x.astype(acc)


def values(p, *arrays):
    """Views that read as p.dtype: uint16 carriers of bfloat16 bits become ml_dtypes bfloat16, the
    one place flashcupy needs ml_dtypes (a TypeError before any work where it is missing)."""
    value_dtype = bfloat16_dtype() if p.dtype == "bfloat16" else np.dtype(p.dtype)
    return [x.view(value_dtype) if x.dtype != value_dtype else x for x in arrays]


class HeadMap:
    """Which query heads read which kv head, worked out once per call. Stacks put a kv head's query
    heads row by row: row r of its h-th query head is row r * group + h of the stack, and a stack
    holds kv heads h0 .. h1 - 1."""

    def __init__(self, p):
        groups = [[] for _ in range(p.heads_kv)]
        for h in range(p.heads_q):
            kv_head = h // p.group
            groups[kv_head].append(h)
        self.index = np.array(groups, dtype=np.intp).reshape(p.heads_kv, -1)  # (kv heads, group)
        self.group = self.index.shape[1]
        self.consecutive = self.index.ravel().tolist() == list(range(self.index.size))

    def read(self, x, h0: int, h1: int):
        """x (rows, all query heads, ...) as (kv heads h0..h1, rows, group, ...): a view where the
        heads are consecutive (the usual mapping), else a copy."""
        g = self.group
        picked = x[:, h0 * g:h1 * g] if self.consecutive else x[:, self.index[h0:h1].ravel()]
        split = picked.reshape(x.shape[0], h1 - h0, g, *x.shape[2:])
        return split.transpose(1, 0, *range(2, split.ndim))

    def unstack_into(self, dst, h0: int, h1: int, stacked) -> None:
        """dst (rows, all query heads, ...) takes the values of a stack (kv heads h0..h1, rows x group, ...)."""
        values = stacked.reshape(h1 - h0, -1, self.group, *stacked.shape[2:])
        if self.consecutive:
            self.read(dst, h0, h1)[...] = values
        else:
            dst[:, self.index[h0:h1].ravel()] = np.moveaxis(values, 0, 1).reshape(
                values.shape[1], -1, *stacked.shape[2:])
