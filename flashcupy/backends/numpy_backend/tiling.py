"""Which tiles the NumPy backend's loops visit: blocks of rows or keys, and the tile plans that
cover every (query, key) pair of the band once, each tile with the band's mask of it.

A tile is a tuple (i0, i1, j0, j1, hidden): query rows [i0, i1) against keys [j0, j1), hidden
the band's bool (rows, keys) mask of the pairs it hides, None where the rows see every key of the
tile (p.band.hidden). (Plain tuples: a plan holds hundreds, made per call.)

Which keys a query sees is p.band's to say (flashcupy/_problem.py, Band): the plans take both ends
of their ranges from it and mask tiles through it, so the rule changes there, not here. A user's
mask is no band: it is applied per tile, on top (modifiers.py).
"""

from __future__ import annotations

import numpy as np

from . import plan


def blocks(start: int, end: int, size: int):
    """[start, end) cut into (first, one past last) pieces of at most size, of about equal length
    (a last piece of a few rows or keys would cost as many BLAS calls as a full one)."""
    n = end - start
    if n <= 0:
        return []
    step = -(-n // -(-n // size))  # ceil(n / number of pieces)
    if step > 16:
        step = min(size, -(-step // 16) * 16)  # whole SIMD vectors
    return [(s, min(s + step, end)) for s in range(start, end, step)]


def mask_scores(S, p, i0: int, j0: int, fill, group: int = 1, hidden=False) -> None:
    """Set S[..., r * group + h, c] = fill where query i0 + r does not see key j0 + c (S a
    contiguous stack of tiles whose rows interleave `group` heads, as stacks.HeadMap stacks them);
    hidden: the tile's p.band.hidden mask when already known."""
    rows, cols = S.shape[-2] // group, S.shape[-1]
    if hidden is False:
        hidden = p.band.hidden(i0, i0 + rows, j0, j0 + cols)
    if hidden is None:
        return
    S4 = S.reshape(-1, rows, group, cols)
    # only the columns some row does not see: a band tile's hidden pairs lie in its first and last
    # columns (two triangles), and the keys between are seen by every row
    all0, all1 = (min(max(x - j0, 0), cols) for x in p.band.keys_seen_by_all(i0, i0 + rows))
    for x0, x1 in ((0, all0), (all1, cols)) if all0 < all1 else ((0, cols),):
        if x0 < x1:
            np.copyto(S4[..., x0:x1], fill, where=hidden[:, None, x0:x1])


def forward_tiles(p, i0: int, i1: int, step: int, masks=None) -> list:
    """The tiles that cover every pair of a query row of [i0, i1) and a key it sees, each pair
    once: full-height tiles over the keys every row sees, then the rest (the causal diagonal) in a
    staircase of tiles of `step` rows, so that little of their area is masked. Keys every row sees
    but fewer than a step go to the staircase too. masks: a dict shared by the calls of one pass,
    so equal masks are kept once (tile_mask)."""
    block_n = plan.tile_sizes(p)[1]
    start, end = p.band.key_range(i0, i1)
    all0, all1 = p.band.keys_seen_by_all(i0, i1)
    if all1 - all0 < min(step, i1 - i0):
        all0 = all1 = start
    tiles = [(i0, i1, j0, j1) for j0, j1 in blocks(all0, all1, block_n)]
    for r0, r1 in blocks(i0, i1, step):
        seen0, seen1 = p.band.key_range(r0, r1)
        for lo, hi in ((max(seen0, start), min(seen1, all0)), (max(seen0, all1), min(seen1, end))):
            tiles += [(r0, r1, j0, j1) for j0, j1 in blocks(lo, hi, block_n)]
    return [(r0, r1, j0, j1, tile_mask(p, r0, r1, j0, j1, masks)) for r0, r1, j0, j1 in tiles]


def backward_tiles(p, j0: int, j1: int, step: int, masks=None) -> list:
    """The tiles that cover every pair of a key of [j0, j1) and a query row that sees it, each pair
    once: BLOCK_M-row tiles over the rows that see every key of the block, then a staircase of
    `step`-row tiles along the diagonal, each over the keys of the block its rows see."""
    block_m = plan.tile_sizes(p, backward=True)[0]
    start, end = p.band.query_range(j0, j1)
    all0, all1 = p.band.queries_seeing_all(j0, j1)
    if all1 - all0 < step:
        all0 = all1 = start
    tiles = [(i0, i1, j0, j1) for i0, i1 in blocks(all0, all1, block_m)]
    for lo, hi in ((start, all0), (all1, end)):
        for r0, r1 in blocks(lo, hi, step):
            seen0, seen1 = p.band.key_range(r0, r1)
            if max(seen0, j0) < min(seen1, j1):
                tiles.append((r0, r1, max(seen0, j0), min(seen1, j1)))
    return [(i0, i1, y0, y1, tile_mask(p, i0, i1, y0, y1, masks)) for i0, i1, y0, y1 in tiles]


def tile_mask(p, i0: int, i1: int, j0: int, j1: int, masks):
    """p.band.hidden(i0, i1, j0, j1), made once per height, width and j0 - i0 when masks (a dict shared
    by the calls of one pass) is given: the rule depends on j - i alone, so the diagonal tiles of
    every block share a few masks (one per tile would take O(seqlen x BLOCK_M) bytes, and making
    each its own took a noticeable part of a narrow window's forward)."""
    if masks is None:
        return p.band.hidden(i0, i1, j0, j1)
    key = (i1 - i0, j1 - j0, j0 - i0)
    if key not in masks:
        masks[key] = p.band.hidden(i0, i1, j0, j1)
    return masks[key]
