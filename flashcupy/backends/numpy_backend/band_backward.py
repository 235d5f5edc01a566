"""The NumPy backend's backward of a narrow band (a window alone, at most plan.NARROW_BAND keys
wide): band_forward's tiles (step query rows by the `span` chunks of step keys their rows see),
many per matmul.

A query tile holds every key its rows see, so its dQ comes whole out of one matmul. A chunk of keys
is seen by the rows of `span` consecutive tiles, and their P and dS are laid out so that the
chunk's columns of those tiles form one matrix: tile u starts step elements further than its rows
would put it (skewed), which cancels the chunk's shift of step keys from tile to tile, so dV and dK
of a chunk also come whole out of one matmul each, with the tiles' rows as the inner dimension (no
accumulation from tile to tile, nothing added twice). A task owns the query tiles [u0, u1) of some
kv heads: their dQ and the dK, dV of the chunks whose last tile is among them; it recomputes the
span - 1 tiles before u0 (tasks span many tiles), so tasks write disjoint parts of dq, dk and dv
and the result does not depend on their order.

Vocabulary: u a query tile (u0, u1 a task's own), T_r the query tiles, step = B_r = B_c the rows of
a tile and the keys of a chunk, M = step x group a tile's stack rows, tile u sees chunks u - lead ..
u - lead + span - 1, tile_keys = span x step keys; "places" are the tiles' slots in the buffers.
The measurements behind its choices: benchmarks/results/numpy_backend_choices.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..._problem import LN2, LOG2E
from . import plan, pool, softmax, stacks, tiling
from .band_forward import band_keys, windows
from .tiled_backward import delta_into


@dataclass
class BandGrid:
    """Where a narrow band's backward tiles and chunks lie, and how tasks split them."""
    step: int
    M: int  # stack rows of a tile
    span: int  # key chunks a tile sees
    lead: int  # chunks of a tile before its own (tile u's first chunk is u - lead)
    tile_keys: int  # span x step
    T_r: int  # query tiles, from query row `first`
    first: int  # the rows that see some key, [first, last); the others get dq 0
    last: int
    base: int  # key j lies in column base + j, the columns counting from chunk -lead
    j0: int  # the keys in the columns that some row sees, [j0, j1)
    j1: int
    hidden: np.ndarray  # (step, 1, tile_keys): the pairs a tile's rows do not see
    pieces: list  # the columns some row does not see: a prefix and a suffix
    kv_groups: list
    tile_ranges: list  # (u0, u1) of each task
    per_matmul: int  # tiles computed per matmul
    clamp: bool = False  # s - lse clamped to 0 before exp2 (softmax.recomputed_p_may_pass_one)


def band_grid(p, width: int) -> BandGrid:
    acc, g = p.acc_dtype, p.group
    step = plan.band_step(width, g)
    first, last = p.band.query_range(0, p.seqlen_k)
    end = p.band.key_range(0, p.seqlen_q)[1]
    T_r = -(-(last - first) // step)
    lead = -(-p.band.left // step)
    span = lead + 1 + -(-(width - 1 - p.band.left) // step)
    L = span * step
    columns = (T_r - 1 + span) * step  # chunks -lead .. T_r - lead + span - 2
    base = lead * step - first - p.diagonal
    hidden = ~p.band.visible(np.arange(step)[:, None], p.diagonal - lead * step + np.arange(L)[None, :])
    some = np.flatnonzero(hidden.any(axis=0))
    pieces = [(int(x[0]), int(x[-1]) + 1) for x in np.split(some, np.flatnonzero(np.diff(some) > 1) + 1) if x.size]
    M = step * g
    # P and dS of 2 span tiles within L2
    stacked = max(1, min(p.heads_kv, plan.TILE_VOLUME[acc.itemsize] // 2 // (2 * 2 * span * M * L)))
    kv_groups = tiling.blocks(0, p.heads_kv, stacked)
    # tasks per kv group: enough to spread, few enough that recomputing the span - 1 tiles before
    # each stays small, and each task's operands within SCRATCH_KEEP_BYTES, so that they are kept
    # from task to task and call to call (fresh, they cost a page fault per page)
    most = max(4 * span,
               pool.SCRATCH_KEEP_BYTES // (stacked * M * (max(p.head_dim, p.head_dim_v) + 1) * acc.itemsize) - span)
    ranges = max(1, min(-(-4 * pool.worker_count() // len(kv_groups)), T_r // (4 * span)), -(-T_r // most))
    tile_ranges = tiling.blocks(0, T_r, -(-T_r // ranges)) if T_r > 0 else []
    # 2 span tiles per matmul: fewer leave Python-level overhead, more gain nothing
    return BandGrid(step, M, span, lead, L, T_r, first, last, base, max(0, -base), min(end, columns - base),
                    hidden[:, None, :], pieces, kv_groups, tile_ranges, 2 * span)


def backward(p, dout, q, k, v, out, lse, dq, dk, dv, width: int, dlse=None) -> None:
    """dq, dk, dv of the views in the value dtype, for a band `width` keys wide; dlse: the gradient
    of lse, or None."""
    grid = band_grid(p, width)
    grid.clamp = softmax.recomputed_p_may_pass_one(p, q, k)
    dq[:, :grid.first] = 0
    dq[:, grid.last:] = 0
    if grid.T_r <= 0:
        dk[...] = 0
        dv[...] = 0
        return
    heads = stacks.HeadMap(p)
    dk[:, :grid.j0] = 0
    dk[:, grid.j1:] = 0
    dv[:, :grid.j0] = 0
    dv[:, grid.j1:] = 0
    arrays = (dout, q, k, v, out, lse, dlse)

    def task(b, h0, h1, u0, u1):
        def run(scratch):
            BandTask(p, grid, heads, arrays, b, h0, h1, u0, u1, scratch).run(dq, dk, dv)
        return run

    pool.run([task(b, h0, h1, u0, u1) for b in range(p.batch) for h0, h1 in grid.kv_groups
              for u0, u1 in grid.tile_ranges])


class BandOperands(NamedTuple):
    """A task's operands as views of tile t at t - first_tile (the tiles it computes): Q1 = [scale
    log2(e) Q | -log2(e) lse] and dO1 = [dO | -D] (its rows), K1t = [K | 1]ᵀ, V1t = [V | 1]ᵀ and
    Ks = scale K (its keys); and at w - u0 the span tiles' Q and dO rows that meet the key chunk
    of tile w."""
    Q1: np.ndarray
    dO1: np.ndarray
    K1t: np.ndarray
    V1t: np.ndarray
    Ks: np.ndarray
    Q_chunks: np.ndarray
    dO_chunks: np.ndarray


class BandTask:
    """One task of backward: the query tiles [u0, u1) of kv heads h0..h1 of batch b. It computes P
    and dS of the tiles first_tile .. end_tile - 1 (the span - 1 before u0 only for their chunks),
    per_matmul at a time, into skewed buffers that hold `capacity` tiles; dQ of each tile it owns
    as the tile is computed, dK and dV of each chunk it owns once the chunk's last tile is."""

    def __init__(self, p, grid, heads, arrays, b, h0, h1, u0, u1, scratch):
        acc, span, M, L, step = p.acc_dtype, grid.span, grid.M, grid.tile_keys, grid.step
        self.p, self.grid, self.heads, self.b, self.h0, self.h1, self.u0, self.u1 = p, grid, heads, b, h0, h1, u0, u1
        h = h1 - h0
        # the last task also owns the chunks past the last tile
        self.end_tile = u1 if u1 < grid.T_r else grid.T_r + span - 1
        self.first_tile = u0 - (span - 1)
        self.ops = band_operands(p, grid, heads, arrays, b, h0, h1, self.first_tile, self.end_tile, scratch)
        self.capacity = span - 1 + grid.per_matmul
        self.place = M * L + step  # from a tile's place to the next, in the skewed buffers
        size = self.capacity * self.place + span * step
        self.P_buf, self.dS_buf = (scratch.take(name, (h, size), acc) for name in ("P", "dS"))
        self.P_all, self.dS_all = (skewed(x, self.capacity, M, L, step) for x in (self.P_buf, self.dS_buf))
        # the same as (heads, tiles, M L), for the elementwise passes: NumPy ran them several times
        # slower over the 4-D view (it did not merge a tile's rows into one loop)
        self.P_flat, self.dS_flat = (x.reshape(h, self.capacity, M * L) for x in (self.P_all, self.dS_all))
        self.dQ = scratch.take("dQ", (h, (u1 - u0) * M, p.head_dim), acc)
        self.dK = scratch.take("dK", (h, (self.end_tile - u0) * step, p.head_dim), acc)
        self.dV = scratch.take("dV", (h, (self.end_tile - u0) * step, p.head_dim_v), acc)
        # the key chunks of the tiles at places x .. x + span - 1 (chunks), what they meet, where they go
        self.chunks = [(chunks(self.P_buf, self.capacity - span + 1, span, M, L, step), self.ops.dO_chunks, self.dV),
                       (chunks(self.dS_buf, self.capacity - span + 1, span, M, L, step), self.ops.Q_chunks, self.dK)]

    def run(self, dq, dk, dv) -> None:
        u = self.first_tile  # the next tile to compute
        self.place0_tile, self.filled = u, 0  # the tile at the buffers' first place, and how many are there
        while u < self.end_tile:
            count = min(self.grid.per_matmul, self.capacity - self.filled, self.end_tile - u)
            self.tiles(u, count)
            self.chunk_gradients(u, count)
            u += count
            self.filled += count
            if self.filled == self.capacity:  # keep the last span - 1 tiles, at the first places (one block)
                kept = (self.grid.span - 1) * self.place
                start = self.grid.per_matmul * self.place
                for x in (self.P_buf, self.dS_buf):
                    np.copyto(x[:, :kept], x[:, start:start + kept])
                self.place0_tile += self.capacity - (self.grid.span - 1)
                self.filled = self.grid.span - 1
        self.write(dq, dk, dv)

    def tiles(self, u: int, count: int) -> None:
        """P and dS of tiles u .. u + count - 1 at the next places (0 for tiles outside [0, T_r),
        which hold no rows), and dQ of those among them that the task owns."""
        grid, ops, f0, g = self.grid, self.ops, self.first_tile, self.p.group
        h, step, M, D = self.h1 - self.h0, grid.step, grid.M, self.p.head_dim
        Pt, dSt = self.P_all[:, self.filled:self.filled + count], self.dS_all[:, self.filled:self.filled + count]
        a, z = max(u, 0), min(u + count, grid.T_r)  # the tiles with rows
        if a > u:
            Pt[:, :a - u] = 0
            dSt[:, :a - u] = 0
        if z < u + count:
            Pt[:, max(z, a) - u:] = 0
            dSt[:, max(z, a) - u:] = 0
        if a >= z:
            return
        Pa, dSa = Pt[:, a - u:z - u], dSt[:, a - u:z - u]
        flat = slice(self.filled + a - u, self.filled + z - u)  # the same tiles in P_flat, dS_flat
        np.matmul(ops.Q1[:, a - f0:z - f0], ops.K1t[:, a - f0:z - f0], out=Pa)
        if grid.clamp:  # softmax.recomputed_p_may_pass_one
            np.minimum(self.P_flat[:, flat], 0, out=self.P_flat[:, flat])
        with np.errstate(over="ignore"):  # a hidden pair may overflow: it is zeroed next
            np.exp2(self.P_flat[:, flat], out=self.P_flat[:, flat])
        P5 = Pa.reshape(h, z - a, step, g, grid.tile_keys)
        for x0, x1 in grid.pieces:
            np.copyto(P5[..., x0:x1], 0, where=grid.hidden[..., x0:x1])
        np.matmul(ops.dO1[:, a - f0:z - f0], ops.V1t[:, a - f0:z - f0], out=dSa)
        np.multiply(self.dS_flat[:, flat], self.P_flat[:, flat], out=self.dS_flat[:, flat])
        o0 = max(a, self.u0)  # dQ of the tiles this task owns
        if o0 < z:
            np.matmul(dSa[:, o0 - a:], ops.Ks[:, o0 - f0:z - f0],
                      out=self.dQ[:, (o0 - self.u0) * M:(z - self.u0) * M].reshape(h, z - o0, M, D))

    def chunk_gradients(self, u: int, count: int) -> None:
        """dV and dK of the key chunks whose last tile is among u .. u + count - 1 and that this task
        owns: the chunk of tile w is w - lead, its tiles w - span + 1 .. w, at places from
        w - span + 1 - place0_tile on."""
        o0, o1 = max(u, self.u0), u + count
        if o0 >= o1:
            return
        h, step, u0 = self.h1 - self.h0, self.grid.step, self.u0
        x = o0 - self.grid.span + 1 - self.place0_tile
        for view, operand, grad in self.chunks:
            np.matmul(view[:, x:x + o1 - o0].transpose(0, 1, 3, 2), operand[:, o0 - u0:o1 - u0],
                      out=grad[:, (o0 - u0) * step:(o1 - u0) * step].reshape(h, o1 - o0, step, grad.shape[-1]))

    def write(self, dq, dk, dv) -> None:
        """dQ rows of the tiles u0 .. u1 (query rows from first + u0 step), dK and dV of the chunks
        u0 - lead .. end_tile - lead - 1 (keys from column u0 step, key column - base) into the
        call's outputs."""
        grid, b, h0, h1, u0 = self.grid, self.b, self.h0, self.h1, self.u0
        r0, r1 = grid.first + u0 * grid.step, min(grid.last, grid.first + self.u1 * grid.step)
        self.heads.unstack_into(dq[b, r0:r1], h0, h1, self.dQ[:, :(r1 - r0) * self.p.group])
        j0, j1 = u0 * grid.step - grid.base, self.end_tile * grid.step - grid.base
        y0, y1 = max(j0, grid.j0), min(j1, grid.j1)
        if y0 < y1:
            np.multiply(self.dK[:, y0 - j0:y1 - j0].transpose(1, 0, 2), self.p.acc_dtype.type(LN2),
                        out=dk[b, y0:y1, h0:h1])  # Q1 holds scale log2(e) Q
            dv[b, y0:y1, h0:h1] = self.dV[:, y0 - j0:y1 - j0].transpose(1, 0, 2)


def band_operands(p, grid, heads, arrays, b, h0, h1, first_tile, end_tile, scratch) -> BandOperands:
    """A BandTask's operands, for kv heads h0..h1 of batch b and its tiles first_tile .. end_tile - 1
    (tiles before 0 or past the last are zero rows), in the task's scratch buffers, zero outside
    the rows and keys: made per task, they stay within SCRATCH_KEEP_BYTES and are reused rather
    than page-faulted in each call."""
    nt, D, M, step, L, span = end_tile - first_tile, p.head_dim, grid.M, grid.step, grid.tile_keys, grid.span
    Dv = p.head_dim_v
    dout, q, k, v, out, lse, dlse = arrays
    Q1, dO1 = query_operands(p, grid, heads, dout, q, out, lse, dlse, b, h0, h1, first_tile, nt, scratch)
    K1t, V1t, Ks = key_operands(p, grid, k, v, b, h0, h1, first_tile, nt, scratch)
    return BandOperands(windows(Q1, 0, nt, M, M, axis=1), windows(dO1, 0, nt, M, M, axis=1),
                        windows(K1t, 0, nt, step, L, axis=2), windows(V1t, 0, nt, step, L, axis=2),
                        windows(Ks, 0, nt, step, L, axis=1),
                        windows(Q1[:, :, :D], 0, nt - span + 1, M, span * M, axis=1),
                        windows(dO1[:, :, :Dv], 0, nt - span + 1, M, span * M, axis=1))


def query_operands(p, grid, heads, dout, q, out, lse, dlse, b, h0, h1, first_tile, nt, scratch) -> tuple:
    """Q1 = [scale log2(e) Q | -log2(e) lse] and dO1 = [dO | -D] (D - dlse with dlse, the gradient of
    lse) of the nt tiles from first_tile on, (kv heads, nt M, head_dim + 1 and head_dim_v + 1), zero
    rows outside the query rows."""
    acc, g, D, Dv, M, step = p.acc_dtype, p.group, p.head_dim, p.head_dim_v, grid.M, grid.step
    h = h1 - h0

    def pitch(n):  # rows padded to whole 64-byte lines (a little faster than n)
        return -(-n // 16) * 16
    Q1 = scratch.take("Q1", (h, nt * M, pitch(D + 1)), acc)[:, :, :D + 1]
    dO1 = scratch.take("dO1", (h, nt * M, pitch(Dv + 1)), acc)[:, :, :Dv + 1]
    a, z = max(first_tile, 0), min(first_tile + nt, grid.T_r)  # the tiles with rows
    r0, r1 = grid.first + a * step, min(grid.last, grid.first + z * step)  # their query rows
    x0, x1 = (a - first_tile) * M, (a - first_tile) * M + (r1 - r0) * g  # those rows' places
    for x in (Q1, dO1):
        x[:, :x0] = 0
        x[:, x1:] = 0
    if r0 < r1:
        shape3 = (h, r1 - r0, g)
        np.multiply(heads.read(q[b, r0:r1], h0, h1), softmax.base2_scale(p), out=Q1[:, x0:x1, :D].reshape(*shape3, D),
                    dtype=acc)
        L = heads.read(lse[b].T[r0:r1], h0, h1)
        Q1[:, x0:x1, D].reshape(shape3)[...] = L * acc.type(-LOG2E)
        dO = dO1[:, x0:x1, :Dv].reshape(*shape3, Dv)
        dO[...] = heads.read(dout[b, r0:r1], h0, h1)
        O = stacks.as_acc(heads.read(out[b, r0:r1], h0, h1), acc)
        delta_into(dO, O, dO1[:, x0:x1, Dv].reshape(shape3), L,
                   None if dlse is None else heads.read(dlse[b].T[r0:r1], h0, h1))
    return Q1, dO1


def key_operands(p, grid, k, v, b, h0, h1, first_tile, nt, scratch) -> tuple:
    """K1t = [K | 1]ᵀ and V1t = [V | 1]ᵀ (kv heads, head_dim + 1 and head_dim_v + 1, columns) and
    Ks = scale K (kv heads, columns, head_dim) of the nt tiles from first_tile on, from column
    first_tile step on, zero outside the keys some row sees."""
    acc, D, Dv, step = p.acc_dtype, p.head_dim, p.head_dim_v, grid.step
    h = h1 - h0
    columns = (nt - 1) * step + grid.tile_keys  # from column first_tile step on
    ld = -(-columns // 64) * 64 + 16  # rows not a multiple of 4 KiB apart, which share cache sets
    K1t = scratch.take("K1t", (h, D + 1, ld), acc)[:, :, :columns]
    V1t = scratch.take("V1t", (h, Dv + 1, ld), acc)[:, :, :columns]
    origin = first_tile * step - grid.base  # the key in the first column
    y0, y1 = max(origin, grid.j0), min(origin + columns, grid.j1)
    if y0 >= y1:  # none of the keys
        y0 = y1 = origin
    for z0, z1 in ((0, y0 - origin), (y1 - origin, columns)):  # the zeros around the keys
        if z0 < z1:
            for x in (K1t, V1t):
                x[:, :, z0:z1] = 0
    for w0, w1 in tiling.blocks(y0, y1, 128):  # NumPy's gather runs fastest 64 to 128 keys at a time
        K1t[:, :D, w0 - origin:w1 - origin] = k[b, w0:w1, h0:h1].transpose(1, 2, 0)
        V1t[:, :Dv, w0 - origin:w1 - origin] = v[b, w0:w1, h0:h1].transpose(1, 2, 0)
    K1t[:, D, y0 - origin:y1 - origin] = 1
    V1t[:, Dv, y0 - origin:y1 - origin] = 1
    # scale K in rows for dQ: BLAS runs dS Kᵀᵀ much slower from the transposed view
    Ks = band_keys(k[b, y0:y1, h0:h1], y0 - origin, columns, "Ks", acc, scratch, acc.type(p.scale))
    return K1t, V1t, Ks


def skewed(buf, count: int, M: int, L: int, step: int):
    """(heads, count, M, L) view of count tiles in buf (heads, size), tile u at u (M L + step): the
    layout of the band backward's P and dS."""
    s0, s1 = buf.strides
    return np.lib.stride_tricks.as_strided(buf, (buf.shape[0], count, M, L), (s0, (M * L + step) * s1, L * s1, s1))


def chunks(buf, count: int, span: int, M: int, L: int, step: int):
    """(heads, count, span M, step) view of the key chunks of the tiles in buf (laid out as
    skewed): its x-th is the last chunk of the tile at place x, the last but one of the next, ...
    the first of the tile at place x + span - 1, which are the same keys."""
    s0, s1 = buf.strides
    return np.lib.stride_tricks.as_strided(buf[:, (span - 1) * step:], (buf.shape[0], count, span * M, step),
                                           (s0, (M * L + step) * s1, L * s1, s1), writeable=False)
