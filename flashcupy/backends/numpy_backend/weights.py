"""attention_probs on the NumPy backend: the attention weights P of some query rows, recomputed
from q, k and the forward's lse."""

from __future__ import annotations

import numpy as np

from ..._problem import LOG2E
from . import modifiers, plan, pool, softmax, stacks, tiling


def probs(p, q, k, lse, rows, into=None):
    """P = exp(s - lse) (batch, heads_q, len(rows), seqlen_k) in the accumulation dtype, for the
    query rows `rows` (an index array) of q, k (views in the value dtype): the forward's scores,
    band and modifiers, in base 2 as there, with the saved lse subtracted. A row that sees no key
    (lse -inf) gets 0. into: None or the array (of P's shape and dtype, any strides) to write."""
    acc = p.acc_dtype
    heads = stacks.HeadMap(p)
    mods = modifiers.Modifiers(p, heads) if p.modifiers - {"window"} else None
    P = np.empty((p.batch, p.heads_q, rows.size, p.seqlen_k), dtype=acc) if into is None else into
    row_blocks = tiling.blocks(0, rows.size, plan.tile_sizes(p)[0])
    keys = np.arange(p.seqlen_k)
    clamp = softmax.recomputed_p_may_pass_one(p, q, k)

    def task(b, h):
        def run(scratch):
            Kt = np.ascontiguousarray(k[b, :, h:h + 1, :].transpose(1, 2, 0), dtype=acc)  # (1, D, keys)
            for r0, r1 in row_blocks:
                index = rows[r0:r1]
                Q = heads.read(q[b, index], h, h + 1)  # (1, rows, group, D)
                Q = np.multiply(Q.reshape(1, -1, p.head_dim), softmax.base2_scale(p), dtype=acc)
                S = np.matmul(Q, Kt)
                if mods is not None:
                    mods.apply(S, index, slice(0, p.seqlen_k), b=b, h0=h, h1=h + 1, scratch=scratch)
                S4 = S.reshape(1, r1 - r0, p.group, p.seqlen_k)
                hidden = ~p.band.visible(index[:, None], keys[None, :])
                if hidden.any():
                    np.copyto(S4, -np.inf, where=hidden[None, :, None, :])
                L = heads.read(lse[b].T[index], h, h + 1)  # (1, rows, group)
                np.subtract(S4, (np.where(L == -np.inf, np.inf, L) * acc.type(LOG2E))[..., None], out=S4)
                if clamp:  # softmax.recomputed_p_may_pass_one
                    np.minimum(S, 0, out=S)
                heads.unstack_into(P[b].transpose(1, 0, 2)[r0:r1], h, h + 1, np.exp2(S, out=S))
        return run

    pool.run([task(b, h) for b in range(p.batch) for h in range(p.heads_kv)])
    return P
