"""The NumPy backend's forward of a narrow band (a window alone, at most plan.NARROW_BAND keys
wide), and the strided views of K and V that it and band_backward share.

Tiles of `step` query rows by the step + width - 1 keys those rows see (plan.band_step): every row
meets all its keys in one tile, so a tile is the whole softmax of its rows and nothing accumulates
from tile to tile. The tiles of a block are the same shape and lie `step` keys apart, so one matmul
over strided views of K and V computes many at once, and a tile's hidden pairs (its two corner
triangles) are the same for every tile: P is multiplied by one 0/1 mask. The per-tile Python
overhead of the tiled forward, a large part of a narrow window's time there, is gone, and so is
any -inf in exp2's input.

The tiles are computed transposed, Sᵀ = K_j Q_iᵀ and O = (Pᵀ)ᵀ V_j: BLAS runs those faster on these
shapes than S = Q_i K_jᵀ from a contiguous Kᵀ and P [V | 1], and it reads K and V where they lie,
rows H x D apart (much faster than Q_i K_jᵀ from K's rows as they lie). Nothing is copied but each
tile's Q_iᵀ, scaled by scale * log2(e) (band_queries), and K and V of the blocks at the sequence's
two ends or of another dtype (band_keys: zeros past the keys, masked out of P). l comes from a
matmul of P with ones (much faster than NumPy's add.reduce along the keys). Each matmul takes up to
TILE_VOLUME scores, and O / l goes into out from a buffer still in cache.

Scores are not shifted (m = 0): a row whose sum leaves [L_MIN, l_max], or is NaN (an overflow times
the mask's 0), is redone exactly (softmax.redo_rows): its visible scores, their max as m. Rows that
see no key at all are left out and keep out 0, lse -inf.

The measurements behind these choices: benchmarks/results/numpy_backend_choices.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import plan, pool, softmax, stacks, tiling


@dataclass
class BandForwardPlan:
    """The tiles of a narrow-band forward call: `step` query rows by `n` keys, the rows that see
    some key [first, last) in query blocks, the keys below end that some row sees, the stacks of
    kv heads, tiles per matmul, and the one mask of the pairs a tile's rows see."""
    step: int
    n: int
    first: int
    last: int
    end: int
    blocks: list
    kv_groups: list
    per_call: int
    # (keys, stack rows) as Sᵀ: row r of a tile sees its keys r .. r + width - 1, the rule depends on
    # j - i alone so one mask serves every tile; its rows repeated for the group, so that the
    # multiply runs along whole stack rows (against a (rows, 1) mask it ran much slower)
    keep: np.ndarray
    in_out: bool  # O straight into out, normalised there (a tile's stack rows are rows of out a fixed stride apart)
    in_place: bool  # K and V read where they lie, (kv heads, keys, D) views
    qk_scale: object  # softmax.base2_scale, which the tiles' Q_iᵀ carry
    key_offset: int  # query row i's tile starts at key i + key_offset (diagonal - left)


def plan_band_forward(p, k, out, heads, width: int) -> BandForwardPlan:
    acc, g = p.acc_dtype, p.group
    step = plan.band_step(width, g)
    n = step + width - 1  # keys of a tile
    first, last = p.band.query_range(0, p.seqlen_k)  # the rows that see some key
    end = p.band.key_range(0, p.seqlen_q)[1]  # keys at or past it no row sees
    blocks = tiling.blocks(first, last, plan.tile_sizes(p)[0])
    units = p.batch * p.heads_kv * len(blocks)
    unit_volume = g * step * n
    stacked = plan.heads_per_task(p, units, p.flops() / max(1, units), unit_volume, plan.TILE_VOLUME[acc.itemsize])
    keep = np.repeat(p.band.visible(np.arange(step)[None, :], p.diagonal - p.band.left + np.arange(n)[:, None]), g,
                     axis=1).astype(acc)
    # tiles per matmul: S up to TILE_VOLUME (its Python-level overhead weighs more than L2 here:
    # more tiles a matmul beat fewer that keep S within L2)
    per_call = max(1, plan.TILE_VOLUME[acc.itemsize] // (stacked * unit_volume))
    in_out = out.dtype == acc and heads.consecutive and (g == 1 or p.heads_kv == 1)
    return BandForwardPlan(step, n, first, last, end, blocks, tiling.blocks(0, p.heads_kv, stacked), per_call, keep,
                           in_out, k.dtype == acc, softmax.base2_scale(p), p.diagonal - p.band.left)


def forward(p, q, k, v, out, lse, width: int) -> None:
    """out and lse of q, k, v (views in the value dtype) for a band `width` keys wide."""
    heads = stacks.HeadMap(p)
    bp = plan_band_forward(p, k, out, heads, width)
    out[:, :bp.first] = 0
    out[:, bp.last:] = 0
    lse[:, :, :bp.first] = -np.inf
    lse[:, :, bp.last:] = -np.inf

    def task(b, h0, h1, i0, i1):
        return lambda scratch: block(p, q, k, v, out, lse, bp, heads, b, h0, h1, i0, i1, scratch)

    pool.run([task(b, h0, h1, i0, i1) for b in range(p.batch) for h0, h1 in bp.kv_groups for i0, i1 in bp.blocks])


def block(p, q, k, v, out, lse, bp, heads, b, h0, h1, i0, i1, scratch) -> None:
    """Query rows [i0, i1) of kv heads h0..h1 of batch b: their tiles, band_tiles per_call at a time."""
    acc, step, n, end = bp.keep.dtype, bp.step, bp.n, bp.end
    T = -(-(i1 - i0) // step)
    Qt = band_queries(heads.read(q[b, i0:i1], h0, h1), T, step, bp.qk_scale, acc, scratch)
    j0 = i0 + bp.key_offset  # the first tile's first key; j1: past the last tile's last
    j1 = j0 + (T - 1) * step + n
    lo, hi = min(max(j0, 0), end), min(max(j1, 0), end)  # the keys among them that some row sees
    inside = 0 <= j0 and j1 <= p.seqlen_k  # keys past end, which only padding rows see, are real
    if bp.in_place and inside:
        Kw, Vw = (windows(x[b, :, h0:h1].transpose(1, 0, 2), j0, T, step, n, axis=1) for x in (k, v))
        v_part = v[b, lo:hi, h0:h1]
    else:  # at the sequence's ends, or of another dtype: copies, zero past the keys
        K, V = (band_keys(x[b, lo:hi, h0:h1], lo - j0, j1 - j0, name, acc, scratch) for x, name in ((k, "K"), (v, "V")))
        Kw, Vw = (windows(x, 0, T, step, n, axis=1) for x in (K, V))
        v_part = V[:, lo - j0:hi - j0]  # of the copy: NumPy's float16 max and min crawl
    tile_keep = bp.keep
    if not inside:  # zero keys count in l unless masked: a mask per tile, (tiles, keys, stack rows)
        keys = j0 + step * np.arange(T)[:, None] + np.arange(n)[None, :]
        tile_keep = bp.keep * ((keys >= lo) & (keys < hi)).astype(acc)[:, :, None]
    v_max = max(float(np.maximum.reduce(v_part, axis=None, initial=0)),
                -float(np.minimum.reduce(v_part, axis=None, initial=0)))

    def finish(u0, u1, O, l, m):  # O / l and lse of tiles u0 .. u1 - 1 into out and lse
        write_tiles(out[b], lse[b], bp, heads, h0, h1, i0, i1, u0, u1, O, l, m)

    def visible(u, r):  # which keys of tile u stack rows r see
        return band_visible(p, i0 + u * step, j0 + u * step, r // p.group, n, end)

    band_tiles(Qt, Kw, Vw, tile_keep, bp.per_call, softmax.largest_l(acc, v_max), scratch, visible, finish)


def write_tiles(out_b, lse_b, bp, heads, h0, h1, i0, i1, u0, u1, O, l, m) -> None:
    """O / l and lse of tiles u0 .. u1 - 1 (of the block from query row i0, up to i1) into batch b's
    out and lse: straight into out where bp.in_out, viewed as (kv heads, tiles, stack rows, D)."""
    g, D = heads.group, O.shape[-1]
    r0, r1 = i0 + u0 * bp.step, i0 + u1 * bp.step
    if bp.in_out and r1 <= i1:
        rows = out_b[r0:r1, h0 * g:h1 * g].reshape(u1 - u0, bp.step, h1 - h0, g, D)
        _, L = softmax.normalised(O, l, m, rows.transpose(2, 0, 1, 3, 4).reshape(O.shape))
    else:
        r1 = min(r1, i1)
        O, L = softmax.normalised(O, l, m)
        heads.unstack_into(out_b[r0:r1], h0, h1, O.reshape(h1 - h0, -1, D)[:, :(r1 - r0) * g])
    heads.unstack_into(lse_b.T[r0:r1], h0, h1, L.reshape(h1 - h0, -1)[:, :(r1 - r0) * g])


def band_queries(Q, T: int, step: int, scale, acc, scratch):
    """Q (kv heads, rows, group, D) times scale as the tiles' Q_iᵀ, (kv heads, T, D, step x group)
    in the accumulation dtype, the stack rows of each tile (row by row, a kv head's query heads
    interleaved as stacks.HeadMap stacks them) along the last axis, zeros past the last row."""
    heads, rows, g, D = Q.shape
    Qt = scratch.take("Qt", (heads, T, D, step * g), acc)
    Q6 = Qt.reshape(heads, T, D, step, g)
    whole = rows // step
    np.multiply(Q[:, :whole * step].reshape(heads, whole, step, g, D).transpose(0, 1, 4, 2, 3), scale,
                out=Q6[:, :whole], dtype=acc)
    if whole < T:  # the last tile, part filled
        Q6[:, whole] = 0
        np.multiply(Q[:, whole * step:].transpose(0, 3, 1, 2), scale, out=Q6[:, whole, :, :rows - whole * step],
                    dtype=acc)
    return Qt


def band_keys(x, a: int, length: int, name: str, acc, scratch, scale=None):
    """x (keys, kv heads, D) as (kv heads, keys, D) in the accumulation dtype, times scale if given,
    at keys a .. a + len(x) - 1 of a scratch buffer `length` keys long, zeros around them."""
    heads, D = x.shape[1:]
    z = a + x.shape[0]
    buf = scratch.take(name, (heads, length, D), acc)
    buf[:, :a] = 0
    buf[:, z:] = 0
    if scale is None:
        buf[:, a:z] = x.transpose(1, 0, 2)
    else:
        np.multiply(x.transpose(1, 0, 2), scale, out=buf[:, a:z], dtype=acc)
    return buf


def windows(x, start: int, count: int, step: int, width: int, axis: int):
    """Read-only view of `count` windows of x along `axis`, `width` long, the first at `start` and
    each `step` after the last, stacked on a new axis 1: (kv heads, count, ...) with the window
    in place of `axis`."""
    view = np.moveaxis(x, axis, 1)[:, start:]
    strides = (view.strides[0], step * view.strides[1]) + view.strides[1:]
    shape = (view.shape[0], count, width) + view.shape[2:]
    view = np.lib.stride_tricks.as_strided(view, shape, strides, writeable=False)
    return np.moveaxis(view, 2, axis + 1)


def band_visible(p, i0: int, j0: int, rows, keys: int, end: int):
    """(len(rows), keys) bool: which of the keys j0 .. j0 + keys - 1 the query rows i0 + rows see,
    by the band rule (p.band) and among the keys there are (below end)."""
    j = j0 + np.arange(keys)[None, :]
    return p.band.visible(i0 + np.asarray(rows)[:, None], j) & (j >= 0) & (j < end)


def band_tiles(Qt, Kw, Vw, keep, per_call, l_max, scratch, visible, finish) -> None:
    """The tiles of a band block, each holding every key its rows see, per_call to a matmul: Qt
    (kv heads, tiles, head_dim, rows) their Q_iᵀ, Kw and Vw their keys' K and V windows (kv heads,
    tiles, keys, head_dim and head_dim_v), keep the 0/1 mask of the pairs a tile's rows see, (keys,
    rows) with rows stacked group by group as in Qt, or one such mask per tile. visible(tile, stack
    rows) gives the bool mask of those rows' pairs, for the rows redone. finish(u0, u1, O, l, m)
    takes tiles u0 .. u1 - 1 while they are in cache: O (kv heads, tiles, rows, head_dim_v), l and
    the reference m (kv heads, tiles, rows), to be normalised (softmax.normalised)."""
    acc = Qt.dtype
    heads, T, _, M = Qt.shape
    n, D = Kw.shape[2], Vw.shape[3]  # D: v's head dim (O's), perhaps not q's and k's
    ones = np.ones((1, n), dtype=acc)
    per_call = -(-T // -(-T // per_call))  # chunks of equal size: 16 tiles as 8 + 8, not 14 + 2
    for u0 in range(0, T, per_call):
        u1 = min(T, u0 + per_call)
        tile_keep = keep if keep.ndim == 2 else keep[u0:u1]
        St = np.matmul(Kw[:, u0:u1], Qt[:, u0:u1], out=scratch.take("S", (heads, u1 - u0, n, M), acc))  # Sᵀ
        O = scratch.take("O", (heads, u1 - u0, M, D), acc)  # in cache: O / l goes out from here (finish)
        l = scratch.take("l", (heads, u1 - u0, M), acc)
        with np.errstate(over="ignore", invalid="ignore"):  # overflows and inf x 0 are redone below
            np.exp2(St, out=St)
            np.multiply(St, tile_keep, out=St)
            np.matmul(ones, St, out=l[:, :, None])  # l = rowsum P: from BLAS, not add.reduce (see above)
            np.matmul(St.swapaxes(2, 3), Vw[:, u0:u1], out=O)
        m = scratch.take("m", (heads, u1 - u0, M), acc, fill=0)
        redo = softmax.rows_to_redo(l, l_max)
        if redo.any():
            kk, uu, rr = np.nonzero(redo)
            for kv, u in sorted(set(zip(kk.tolist(), uu.tolist()))):
                rows = rr[(kk == kv) & (uu == u)]
                S_r = pool.aligned_empty((rows.size, n), acc)  # exp2's bits depend on alignment
                np.matmul(Qt[kv, u0 + u][:, rows].T, Kw[kv, u0 + u].T, out=S_r)
                S_r[~visible(u0 + u, rows)] = -np.inf
                m[kv, u, rows] = softmax.redo_rows(S_r)
                O[kv, u, rows] = S_r @ Vw[kv, u0 + u]
                l[kv, u, rows] = S_r.sum(axis=1)
        finish(u0, u1, O, l, m)
