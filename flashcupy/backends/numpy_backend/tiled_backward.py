"""The NumPy backend's tiled backward (FlashAttention-2): per batch, the pre-pass builds
Q1 = [scale log2(e) Q | -log2(e) lse] and dO1 = [dO | -D] for every kv head, then each worker
takes a partition of the (stack of kv heads, key block) items, runs each item's tile plan
(tiling.backward_tiles) and sums its own dQ; the partitions' dQ are added in a fixed order, so the
bits depend on the thread count only."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ..._problem import LN2, LOG2E
from . import modifiers, plan, pool, softmax, stacks, tiling


def delta_into(dO, O, out, L, dlse=None) -> None:
    """out = -D, D = rowsum(dO ∘ O) (FlashAttention-2's pre-pass), for dO and O as (kv heads, rows,
    group, D) in the accumulation dtype: the last column of dO1 = [dO | -D]. dlse (as L, the rows'
    lse: (kv heads, rows, group)), the gradient of lse, or None: D - dlse (dS = P (dP - D + dlse)),
    0 in a row that sees no key (lse -inf: its P is 0, and so must its dS be, whatever dlse holds)."""
    np.negative(np.einsum("hsgd,hsgd->hsg", dO, O), out=out)
    if dlse is not None:
        out += np.where(L == -np.inf, 0, dlse)


def item(p, block_j0, tiles, K, V, Q1, dO1, dQ, scratch, modify=None, dbias=None, clamp=False, dropout=None) -> tuple:
    """The key block from block_j0 on of a stack of kv heads (K: (kv heads, keys, head_dim), V:
    (kv heads, keys, head_dim_v)) against
    their query heads: returns (dK_j, dV_j) and adds into dQ. Everything is stacked as in
    softmax.ForwardBlock.

    Q1 = [scale log2(e) Q | -log2(e) lse] and dO1 = [dO | -D] against [K_j | 1] and [V_j | 1] give
    (S - lse) in base 2 and dP - D out of the matmuls, and P = exp2 of the first; scale K_j carries
    the scale into dQ, and Q1 carries scale log2(e) into dK (corrected once per item). A tile costs
    five matmuls and two elementwise passes (exp2, P ∘ (dP - D)).

    With modify (Modifiers.apply, for softcap, ALiBi, bias or mask), S - lse comes out of the
    matmul as above and is modified (ALiBi, bias and mask only add), or with a softcap S comes
    from Q_i K_jᵀ, is modified, then has lse subtracted; dbias(dS, rows, keys) takes dS, the
    gradient of the final score; a softcap then multiplies dS by 1 - tanh² before dQ and dK.

    dropout(out, rows, keys) (modifiers.Dropout.tile, partial), or None: dV takes P times its
    weights Z / (1 - p), and dP (then apart from -D, one more matmul's worth of passes) times them.
    """
    acc = p.acc_dtype
    heads, w, D = K.shape
    Dv = V.shape[2]  # v's head dim, dO's too
    g = p.group
    scale = acc.type(p.scale)
    # [K_j | 1]ᵀ and [V_j | 1]ᵀ, transposed views of copies that keep the rows: BLAS runs S a
    # little faster from a contiguous Kᵀ, but gathering one takes several times the
    # row-preserving copy, more than the matmul gains
    K1t = scratch.take("K1", (heads, w, D + 1), acc).transpose(0, 2, 1)
    K1t[:, :D] = K.transpose(0, 2, 1)
    K1t[:, D] = 1
    V1t = scratch.take("V1", (heads, w, Dv + 1), acc).transpose(0, 2, 1)
    V1t[:, :Dv] = V.transpose(0, 2, 1)
    V1t[:, Dv] = 1
    K_scaled = np.multiply(K, scale, out=scratch.take("K_scaled", K.shape, acc))
    kv = not p.dq_only  # dK_j and dV_j wanted
    dK_j = scratch.take("dK_j", (heads, w, D), acc, fill=0) if kv else None
    dV_j = scratch.take("dV_j", (heads, w, Dv), acc, fill=0) if kv else None
    for i0, i1, j0, j1, hidden in tiles:
        s0, s1 = i0 * g, i1 * g  # the tile's rows within the stacks
        x0, x1 = j0 - block_j0, j1 - block_j0  # its keys within the block
        Q1_i, dO1_i = Q1[:, s0:s1], dO1[:, s0:s1]
        T = None
        if modify is None:
            S = np.matmul(Q1_i, K1t[:, :, x0:x1], out=scratch.take("S", (heads, s1 - s0, x1 - x0), acc))
        elif p.softcap is None:  # ALiBi, bias and mask add to the score: lse can come off first, in the matmul
            # -lse is -inf in a row a mask leaves no key (0 x inf in BLAS's padding)
            with np.errstate(invalid="ignore"):
                S = np.matmul(Q1_i, K1t[:, :, x0:x1], out=scratch.take("S", (heads, s1 - s0, x1 - x0), acc))
            modify(S, slice(i0, i1), slice(j0, j1), T)
        else:
            S = np.matmul(Q1_i[:, :, :D], K1t[:, :D, x0:x1], out=scratch.take("S", (heads, s1 - s0, x1 - x0), acc))
            T = scratch.take("T", S.shape, acc)
            modify(S, slice(i0, i1), slice(j0, j1), T)
            np.add(S, Q1_i[:, :, D:], out=S)  # - lse log2(e)
        if clamp:  # softmax.recomputed_p_may_pass_one
            np.minimum(S, 0, out=S)
        with np.errstate(over="ignore"):  # a hidden pair may overflow: it is zeroed next
            P = np.exp2(S, out=S)  # hidden pairs zeroed after it, not -inf before it: see ForwardBlock.tile
        tiling.mask_scores(P, p, i0, j0, 0, group=g, hidden=hidden)
        kd = scratch.take("kd", (heads, x1 - x0, D), acc)
        kdv = kd if Dv == D else scratch.take("kdv", (heads, x1 - x0, Dv), acc)
        dS = scratch.take("dS", (heads, s1 - s0, x1 - x0), acc)
        if dropout is None:
            if kv:
                dV_j[:, x0:x1] += np.matmul(P.transpose(0, 2, 1), dO1_i[:, :, :Dv], out=kdv)
            np.matmul(dO1_i, V1t[:, :, x0:x1], out=dS)
        else:
            Z = dropout(scratch.take("Z", P.shape, acc), rows=slice(i0, i1), cols=slice(j0, j1))
            np.matmul(dO1_i[:, :, :Dv], V1t[:, :Dv, x0:x1], out=dS)
            np.multiply(dS, Z, out=dS)
            np.add(dS, dO1_i[:, :, Dv:], out=dS)  # - D
            if kv:
                np.multiply(P, Z, out=Z)
                dV_j[:, x0:x1] += np.matmul(Z.transpose(0, 2, 1), dO1_i[:, :, :Dv], out=kdv)
        np.multiply(P, dS, out=dS)
        if dbias is not None:
            dbias(dS, slice(i0, i1), slice(j0, j1))
        if T is not None:  # the gradient of q.k scale, before the softcap: dS (1 - tanh²)
            np.square(T, out=T)
            np.subtract(1, T, out=T)
            np.multiply(dS, T, out=dS)
        dQ[:, s0:s1] += np.matmul(dS, K_scaled[:, x0:x1], out=scratch.take("qd", (heads, s1 - s0, D), acc))
        if kv:
            dK_j[:, x0:x1] += np.matmul(dS.transpose(0, 2, 1), Q1_i[:, :, :D], out=kd)
    if kv:
        dK_j *= acc.type(LN2)  # Q1 holds scale log2(e) Q
    return dK_j, dV_j


@dataclass
class BackwardPlan:
    """What a tiled backward call does: its key blocks and their tiles, the stacks of kv heads, the
    (h0, h1, j0, j1) items and which worker partition takes which, and whether each partition
    sums dbias into its own copy (a bias broadcast over keys)."""
    key_blocks: list
    tiles: dict  # (j0, j1) -> the block's tiles (tiling.backward_tiles)
    kv_groups: list
    work: list
    parts: list
    per_partition: bool


def plan_backward(p) -> BackwardPlan:
    block_m, block_n = plan.tile_sizes(p, backward=True)
    key_blocks = tiling.blocks(0, p.seqlen_k, block_n)
    unit_flops = p.flops(backward=True) / (p.batch * p.heads_kv * len(key_blocks))
    # a tile's P and dS together within about a core's L2 (BACKWARD_TILE_VOLUME), sized by the
    # largest tile of the plan: where every tile is a narrow step of a causal diagonal, more heads
    # stack and spare Python-level steps. (Sized by the median tile instead, causal calls with few
    # large tiles stacked every head onto them, much slower than one.)
    step, masks = plan.staircase_step(block_m, p.group, p.head_dim), {}
    tiles = {(j0, j1): tiling.backward_tiles(p, j0, j1, step, masks) for j0, j1 in key_blocks}
    unit_volume = p.group * max([(i1 - i0) * (y1 - y0) for t in tiles.values() for i0, i1, y0, y1, _ in t] or [1])
    stacked = plan.heads_per_task(p, p.heads_kv * len(key_blocks), unit_flops, unit_volume,
                                  plan.BACKWARD_TILE_VOLUME[p.acc_dtype.itemsize])
    kv_groups = tiling.blocks(0, p.heads_kv, stacked)
    # the plan above serves unless the stacked heads moved the step
    if plan.staircase_step(block_m, stacked * p.group, p.head_dim) != step:
        step = plan.staircase_step(block_m, stacked * p.group, p.head_dim)
        tiles = {(j0, j1): tiling.backward_tiles(p, j0, j1, step, masks) for j0, j1 in key_blocks}
    work = [(h0, h1, j0, j1) for h0, h1 in kv_groups for j0, j1 in key_blocks]
    # the (query, key) pairs each item computes: what its work is proportional to
    costs = [(h1 - h0) * sum((i1 - i0) * (y1 - y0) for i0, i1, y0, y1, _ in tiles[j0, j1]) for h0, h1, j0, j1 in work]
    # dbias without atomics and in a fixed order: items write disjoint parts of it, unless the bias
    # broadcasts over keys (then each partition sums into its own copy, at most batch x heads_q x
    # seqlen_q, added in a fixed order) or over heads (then the items of one key block, which share
    # elements, run in one partition, in order)
    per_partition = p.dbias and p.bias.shape[3] == 1
    together = None
    if p.dbias and not per_partition and p.bias.shape[1] == 1 and len(kv_groups) > 1:
        together = [j0 for h0, h1, j0, j1 in work]
    parts = plan.balanced_parts(costs, max(1, min(pool.worker_count(), len(work))), together)
    return BackwardPlan(key_blocks, tiles, kv_groups, work, parts, per_partition)


def prepare(p, b, dout, q, out, lse, heads, mods, dlse=None) -> tuple:
    """The pre-pass of batch b: Q1 = [scale log2(e) Q | -log2(e) lse] (a row that sees no key has
    lse -inf: -inf there gives it P = 0) and dO1 = [dO | -D], D_i = rowsum(dO_i ∘ O_i), for every
    kv head (D - dlse_i with the gradient of lse), as stacks (kv heads, seqlen_q x group, head_dim
    + 1 and head_dim_v + 1) in the call's scratch; made in one task
    a worker (its few elementwise passes are mostly call overhead)."""
    acc, D, Dv = p.acc_dtype, p.head_dim, p.head_dim_v
    Q1_all = pool.call_scratch.take("Q1", (p.heads_kv, p.seqlen_q * p.group, D + 1), acc)
    dO1_all = pool.call_scratch.take("dO1", (p.heads_kv, p.seqlen_q * p.group, Dv + 1), acc)

    def operands(h0, h1):
        def run(scratch):
            Q1 = Q1_all[h0:h1]
            shape = (h1 - h0, p.seqlen_q, p.group)
            Q = Q1[:, :, :D].reshape(*shape, D)  # views: splitting an axis needs no copy
            np.multiply(heads.read(q[b], h0, h1), softmax.base2_scale(p), out=Q, dtype=acc)
            L = heads.read(lse[b].T, h0, h1)
            Q1[:, :, D].reshape(shape)[...] = np.where(L == -np.inf, np.inf, L) * acc.type(-LOG2E)
            dO1 = dO1_all[h0:h1]
            dO = dO1[:, :, :Dv].reshape(*shape, Dv)
            dO[...] = heads.read(dout[b], h0, h1)
            if mods is not None:  # a row a mask leaves no key lies inside tiles: its dO goes nowhere
                dO[L == -np.inf] = 0
            delta_into(dO, stacks.as_acc(heads.read(out[b], h0, h1), acc), dO1[:, :, Dv].reshape(shape), L,
                       None if dlse is None else heads.read(dlse[b].T, h0, h1))
        return run

    pool.run([operands(h0, h1) for h0, h1 in tiling.blocks(0, p.heads_kv, -(-p.heads_kv // pool.worker_count()))])
    return Q1_all, dO1_all


def backward(p, dout, q, k, v, out, lse, dq, dk, dv, dB=None, dlse=None):
    """dq, dk, dv of the views in the value dtype by the tile plans; returns dbias (the bias's
    shape, the accumulation dtype; summed into dB where given) or None. dlse: the gradient of lse,
    or None."""
    acc = p.acc_dtype
    clamp = softmax.recomputed_p_may_pass_one(p, q, k)
    bplan = plan_backward(p)
    heads = stacks.HeadMap(p)
    mods = modifiers.Modifiers(p, heads) if p.modifiers - {"window"} else None
    drop = modifiers.Dropout(p, heads) if p.dropout else None
    if not p.dbias:
        dB = None
    elif dB is None:
        dB = np.zeros(p.bias.shape, dtype=acc)  # in the accumulation dtype
    else:
        dB.fill(0)
    for b in range(p.batch):
        Q1_all, dO1_all = prepare(p, b, dout, q, out, lse, heads, mods, dlse)
        prepared = {(h0, h1): (Q1_all[h0:h1], dO1_all[h0:h1]) for h0, h1 in bplan.kv_groups}

        def partition(index, items):
            def run(scratch):
                # named by the partition's place (at most one a worker), so calls of other shapes
                # reuse the same few buffers rather than keep one for every name they ever used
                dQ = pool.call_scratch.take(("dQ", index), (p.heads_kv, p.seqlen_q * p.group, p.head_dim), acc, fill=0)
                dB_own = None if dB is None else np.zeros(dB.shape, acc) if bplan.per_partition else dB
                for i in items:
                    h0, h1, j0, j1 = bplan.work[i]
                    K = stacks.as_acc(k[b, j0:j1, h0:h1, :].transpose(1, 0, 2), acc)
                    V = stacks.as_acc(v[b, j0:j1, h0:h1, :].transpose(1, 0, 2), acc)
                    Q1, dO1 = prepared[h0, h1]
                    modify = dbias = None
                    if mods is not None:
                        modify = functools.partial(mods.apply, b=b, h0=h0, h1=h1, scratch=scratch)
                    if dB is not None:
                        dbias = functools.partial(mods.add_dbias, dB_own, b=b, h0=h0, h1=h1)
                    dropout = None if drop is None else functools.partial(drop.tile, b=b, h0=h0, h1=h1)
                    dK_j, dV_j = item(p, j0, bplan.tiles[j0, j1], K, V, Q1, dO1, dQ[h0:h1], scratch, modify, dbias,
                                      clamp, dropout)
                    if not p.dq_only:
                        dk[b, j0:j1, h0:h1, :] = dK_j.transpose(1, 0, 2)
                        dv[b, j0:j1, h0:h1, :] = dV_j.transpose(1, 0, 2)
                return dQ if not bplan.per_partition else (dQ, dB_own)
            return run

        partial = pool.run([partition(index, part) for index, part in enumerate(bplan.parts)])
        if bplan.per_partition:
            dB += functools.reduce(np.add, [x[1] for x in partial])
            partial = [x[0] for x in partial]
        heads.unstack_into(dq[b], 0, p.heads_kv, functools.reduce(np.add, partial))  # fixed order: reproducible
    return dB
