"""Dropout's keep mask: which (batch, head, query, key) pairs keep their attention weight.

The rule (README, Semantics, "dropout"), the same on every backend, bit for bit: pair (b, h, i, j) is
kept iff word j mod 4 of Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2,
3", SC 2011) of the counter (j div 4, i, h, b) under the key (seed mod 2^32, seed div 2^32) is at
least threshold = floor(p 2^32). b, h, i and j are the whole call's: b over the leading dimensions
and the batch flattened (a packed batch's sequence), h the query head, i and j positions in the
sequence; a chunk of a larger problem (flashcupy.dask, a call on a view) adds its origin
(Problem.dropout_origin). A kept weight is divided by 1 - p.

This module is the rule's one home in Python (the NumPy backend asks it); mask.cuh's Dropout and
the Numba kernels' philox spell it for their devices, and tests hold all three to the oracle's own
Philox (reference/__init__.py), itself held to Random123's known answers. NumPy only.
"""

from __future__ import annotations

import numpy as np

# Philox4x32's multipliers and its key schedule's increments (the golden ratio and sqrt(3) - 1)
M0, M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
W0, W1 = 0x9E3779B9, 0xBB67AE85
ROUNDS = 10
_LOW = np.uint64(0xFFFFFFFF)
_SHIFT = np.uint64(32)


def threshold(p: float) -> int:
    """The uint32 a pair's word must reach to be kept: floor(p 2^32) (p in [0, 1))."""
    return min(int(p * 2.0 ** 32), 2 ** 32 - 1)


def philox(counter: tuple, key: tuple) -> tuple:
    """Philox4x32-10 of four counter words and two key words (uint32 arrays or ints that broadcast):
    its four uint32 words, as uint32 arrays."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) for c in counter)
    k0, k1 = (int(k) for k in key)
    for r in range(ROUNDS):
        if r:
            k0, k1 = (k0 + W0) & 0xFFFFFFFF, (k1 + W1) & 0xFFFFFFFF
        p0, p1 = M0 * c0, M1 * c2  # exact: 32 by 32 bits in 64
        c0, c1, c2, c3 = ((p1 >> _SHIFT) ^ c1 ^ np.uint64(k0), p1 & _LOW,
                          (p0 >> _SHIFT) ^ c3 ^ np.uint64(k1), p0 & _LOW)
    return tuple(c.astype(np.uint32) for c in (c0, c1, c2, c3))


# Pairs (of four keys each) per Philox call of block(): its uint64 temporaries stay in a core's L2 cache
# (whole 512 x 512 tiles of eight heads ran four times slower: benchmarks/results/dropout_numpy.md)
CHUNK = 32768


def block(seed: int, p: float, origin: tuple, b, h, i0: int, i1: int, j0: int, j1: int) -> np.ndarray:
    """The keep mask of query rows [i0, i1) and keys [j0, j1) of batches b and heads h (ints, or
    int arrays of shape (B, H, 1, 1) or that broadcast to it), origin (b0, h0, i0, j0) added:
    (..., i1 - i0, j1 - j0) bool. One Philox call for each group of four keys, cut to [j0, j1); the
    rows in chunks of at most CHUNK groups."""
    b0, h0, r0, c0 = origin
    g0, g1 = (j0 + c0) // 4, -(-(j1 + c0) // 4)  # the groups of four keys that [j0, j1) touches
    b, h = np.asarray(b) + b0, np.asarray(h) + h0
    lead = np.broadcast_shapes(b.shape, h.shape)[:-2]  # the batch and head axes
    limit, key = np.uint32(threshold(p)), _key(seed)
    mask = np.empty(lead + (i1 - i0, g1 - g0, 4), dtype=bool)  # word n of group g: key 4 (g0 + g) + n
    step = max(1, CHUNK // max(1, (g1 - g0) * int(np.prod(lead, dtype=np.int64))))
    for r in range(i0, i1, step):
        rows = np.arange(r, min(i1, r + step))[:, None] + r0
        for n, word in enumerate(philox((np.arange(g0, g1), rows, h, b), key)):
            np.greater_equal(word, limit, out=mask[..., r - i0:r - i0 + rows.shape[0], :, n])
    return mask.reshape(lead + (i1 - i0, 4 * (g1 - g0)))[..., j0 + c0 - 4 * g0:j1 + c0 - 4 * g0]


def _key(seed: int) -> tuple:
    return seed & 0xFFFFFFFF, seed >> 32
