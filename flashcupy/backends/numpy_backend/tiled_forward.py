"""The NumPy backend's tiled forward: per (batch, stack of kv heads, query block) a task runs the
block's tile plan (tiling.forward_tiles) through softmax.ForwardBlock, reading each stack's Kᵀ and
[V | 1], made once and shared by its tasks."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from . import modifiers, plan, pool, softmax, stacks, tiling


@dataclass
class ForwardPlan:
    """What a tiled forward call does: its query blocks (heaviest first when causal), each block's
    tiles, the stacks of kv heads each task takes, and the keys some query sees (below end)."""
    blocks: list
    tiles: dict  # (i0, i1) -> the block's tiles (tiling.forward_tiles)
    kv_groups: list  # (h0, h1) of each stack
    end: int
    in_place: bool  # K and V read where they lie (decoding), the eager softmax


def plan_forward(p, k, v) -> ForwardPlan:
    acc = p.acc_dtype
    block_m, block_n = plan.tile_sizes(p)
    blocks = tiling.blocks(0, p.seqlen_q, block_m)
    if p.causal:
        blocks.reverse()  # the heaviest first, so the last tasks of a call are short
    unit_flops = p.flops() / (p.batch * p.heads_kv * len(blocks))
    unit_volume = p.group * min(block_m, p.seqlen_q) * min(block_n, p.seqlen_k)
    stacked = plan.heads_per_task(p, p.batch * p.heads_kv * len(blocks), unit_flops, unit_volume,
                                  plan.TILE_VOLUME[acc.itemsize])
    step = plan.staircase_step(block_m, stacked * p.group, p.head_dim)
    masks = {}
    tiles = {(i0, i1): tiling.forward_tiles(p, i0, i1, step, masks) for i0, i1 in blocks}
    kv_groups = tiling.blocks(0, p.heads_kv, stacked)
    end = p.band.key_range(0, p.seqlen_q)[1]  # every key some query sees lies below this
    in_place = plan.decoding(p) and k.dtype == acc and v.dtype == acc and not p.dropout  # eager_tile: no dropout
    return ForwardPlan(blocks, tiles, kv_groups, end, in_place)


def kv_operands(p, k, v, b, h0, h1, fplan) -> tuple:
    """(Kt, V1, l_max) of kv heads h0..h1: Kᵀ (kv heads, head_dim, keys) and [V | 1] (kv heads,
    keys, head_dim_v + 1) from key 0, in the accumulation dtype, and the largest row sum |v| allows
    (softmax.largest_l). With few query rows per key (decoding: a copy would cost more than the
    matmuls it speeds up), views of K and V where they lie."""
    acc, end = p.acc_dtype, fplan.end
    if fplan.in_place:  # the eager softmax needs no bound on |v| (see softmax.eager_tile)
        return k[b, :end, h0:h1, :].transpose(1, 2, 0), v[b, :end, h0:h1, :].transpose(1, 0, 2), None
    # K copied as (kv heads, keys, D), which keeps D's rows whole (a copy straight into (kv heads,
    # D, keys) gathers 4-byte elements across rows, several times slower), Kᵀ a view of it: BLAS
    # runs QKᵀ a little faster from a contiguous Kᵀ, but making one costs more than that. The copy
    # carries scale log2(e), so that Q can be read where it lies (query_stack)
    K = np.empty((h1 - h0, end, p.head_dim), dtype=acc)
    np.multiply(k[b, :end, h0:h1, :].transpose(1, 0, 2), softmax.base2_scale(p), out=K, dtype=acc)
    Kt = K.transpose(0, 2, 1)
    V1 = np.empty((h1 - h0, end, p.head_dim_v + 1), dtype=acc)
    V1[:, :, :-1] = v[b, :end, h0:h1, :].transpose(1, 0, 2)
    V1[:, :, -1] = 1
    # max |v| (the ones never matter: largest_l only lowers its bound for |v| far above 1)
    v_max = max(float(np.maximum.reduce(V1, axis=None)), -float(np.minimum.reduce(V1, axis=None)))
    return Kt, V1, softmax.largest_l(acc, v_max)


def query_stack(p, q, heads, b, i0, i1, h0, h1, in_place, scratch):
    """Q_i of kv heads h0..h1 as the stack (kv heads, rows x group, D) in the accumulation dtype.
    Kᵀ carries scale log2(e), so the stack is q's rows where they lie when it can be a view (one
    query head per kv head, or a single kv head: BLAS reads rows any distance apart), else a copy;
    with K read in place the copy takes the scale instead."""
    acc = p.acc_dtype
    rows = heads.read(q[b, i0:i1], h0, h1)  # (kv heads, rows, group, D)
    if not in_place and q.dtype == acc and (p.group == 1 or p.heads_kv == 1):
        return rows[:, :, 0] if p.group == 1 else rows.reshape(h1 - h0, (i1 - i0) * p.group, p.head_dim)
    Q = scratch.take("Q", (h1 - h0, (i1 - i0) * p.group, p.head_dim), acc)
    if in_place:
        np.multiply(rows, softmax.base2_scale(p), out=Q.reshape(rows.shape), dtype=acc)
    else:
        Q.reshape(rows.shape)[...] = rows
    return Q


def forward(p, q, k, v, out, lse):
    """out and lse of q, k, v (views in the value dtype) by the tile plans."""
    fplan = plan_forward(p, k, v)
    heads = stacks.HeadMap(p)
    mods = modifiers.Modifiers(p, heads) if p.modifiers - {"window"} else None
    drop = modifiers.Dropout(p, heads) if p.dropout else None
    shared = {(b, h0): pool.Shared(functools.partial(kv_operands, p, k, v, b, h0, h1, fplan), len(fplan.blocks))
              for b in range(p.batch) for h0, h1 in fplan.kv_groups}

    def task(b, h0, h1, i0, i1):
        def run(scratch):
            Kt, V1, l_max = shared[b, h0].take()
            try:
                Q = query_stack(p, q, heads, b, i0, i1, h0, h1, fplan.in_place, scratch)
                modify = None if mods is None else functools.partial(mods.apply, b=b, h0=h0, h1=h1, scratch=scratch)
                dropout = None if drop is None else functools.partial(drop.tile, b=b, h0=h0, h1=h1)
                block = softmax.ForwardBlock(p, Q, Kt, V1, i0, l_max, scratch, modify, dropout)
                if out.dtype == p.acc_dtype:  # O / l written straight into out, a view
                    _, L = block.run(fplan.tiles[i0, i1], heads.read(out[b, i0:i1], h0, h1))
                else:
                    O, L = block.run(fplan.tiles[i0, i1])
                    heads.unstack_into(out[b, i0:i1], h0, h1, O)
                heads.unstack_into(lse[b].T[i0:i1], h0, h1, L)
            finally:
                shared[b, h0].release()
        return run

    # tasks of the same kv heads run one after another, so few kv heads' operands exist at a time
    pool.run([task(b, h0, h1, i0, i1)
              for b in range(p.batch) for h0, h1 in fplan.kv_groups for i0, i1 in fplan.blocks])
