"""NumPy backend: the tiled FlashAttention algorithm on the CPU, BLAS matmuls per tile.

It runs the CUDA kernels' tile loop: query blocks of BLOCK_M rows against key
blocks of BLOCK_N keys, the key blocks no row of a query block can see skipped,
the same backward pre-pass and formulas. Names follow the FlashAttention-2
paper: Q_i, K_j, V_j the blocks, m and l the per-row reference and row sum, O
the unnormalised output accumulator. Its forward takes CPU liberties, so its m
and l after a tile are not the kernels' and only the results agree, to
rounding: the row sum comes out of the PV matmul (V carries an extra column of
ones), m is raised lazily, as in FlashAttention-4 (see softmax.L_MAX), not to the
running max of every tile, and the scores are scaled by log2(e) so that P is
an exp2 (NumPy's float32 exp2 runs much faster than its exp). A tile then costs
two matmuls and one elementwise pass.

Forward, per (batch, kv heads, query block i), the query heads of those kv heads stacked:
    for each key tile j that rows of block i see (tiling.forward_tiles):
        S = (Q_i scale log2 e) K_jᵀ - m             BLAS: [Q_i | -m] [K_j | 1]ᵀ once some m moved
        P = exp2(S);   [P V_j | rowsum P] = P [V_j | 1]    BLAS
        rows whose rowsum P overflows, or whose l + rowsum P stays below L_MIN:
            raise their m by d, redo their P, scale their O and l by 2^-d   (softmax.redo_rows)
        [O | l] += [P V_j | rowsum P]
    out_i = O / l;   lse_i = ln 2 m + ln l

Backward (FlashAttention-2), after the pre-pass D = rowsum(dO ∘ O):
    per (batch, kv heads, key block j), over the query heads sharing them and the
    query rows that see key block j (tiling.backward_tiles):
        P = exp2([Q_i scale log2 e | -lse_i log2 e] [K_j | 1]ᵀ);   dV_j += Pᵀ dO_i
        dS = P ∘ ([dO_i | -D_i] [V_j | 1]ᵀ);   dQ_i += dS (scale K_j);   dK_j += scale dSᵀ Q_i
    the subtractions of lse and D happen inside the matmuls, so a tile costs five
    matmuls and two elementwise passes. Unlike the kernels, which give dQ a pass of
    its own, dQ is accumulated here per worker partition and summed in a fixed
    order, so results are bitwise reproducible for a given thread count.

Python-level overhead is what a NumPy loop loses on short sequences, so a task
stacks several kv heads (and a kv head's query heads, row by row) into each
matmul and elementwise call, tiles are large, and causal diagonals are cut into
a staircase of shorter tiles so the masked half of a diagonal tile costs little.
Nothing of size seqlen_q x seqlen_k is ever allocated: the largest temporaries
are score tiles, one set per worker thread, reused from tile to tile and kept from call to call
up to SCRATCH_KEEP_BYTES each (pool.Scratch).

Score modifiers (README, Semantics): a window narrows the band the tile plans
come from (p.band), so key blocks outside it are
never visited; softcap, ALiBi, bias and mask act on each tile's scores
(modifiers.Modifiers), which then have m subtracted in a pass of their own (in the
backward lse comes off in the matmul unless there is a softcap); dbias is dS
summed to the bias's shape (tiled_backward). A window alone, at most NARROW_BAND
keys wide, takes tiles of a few rows that hold every key their rows see, many
to a matmul (band_forward, band_backward): its cost grows with seqlen x
window. Calls without modifiers run the code above unchanged. Work is
spread over a thread pool kept between calls; NumPy releases the GIL in BLAS and
in the elementwise loops.

The rooms, one job each, the lower ones knowing nothing of the higher:
    settings        Config and configure: the tunables a user sets
    pool            the worker pool, BLAS pinned per worker, scratch buffers kept between calls
    plan            how big: tile sizes, staircase and band steps, which path, heads per task,
                    the backward's partitions
    tiling          which tiles: blocks, the tile plans over the band, their masks
    stacks          how arrays lie for the matmuls: head stacking, dtype views
    softmax         the lazily rescaled forward block, THE row redo, the eager step, O / l and lse
    modifiers       softcap, ALiBi, bias and mask on a tile's scores, and dbias
    tiled_forward   the forward over tile plans
    tiled_backward  the backward over tile plans, with the pre-pass D = rowsum(dO ∘ O)
    band_forward    the narrow band's forward (tiles that hold all their rows' keys)
    band_backward   the narrow band's backward (P and dS skewed so that a key chunk is one matrix)
    weights         attention_probs
This package's __init__ is the backend's contract (backends/__init__.py) and its three entry
points, which choose the path. The split follows what changes together: a new score modifier
touches modifiers and the paths that call it, a tiling change touches plan and tiling, the two
narrow-band passes share their strided views of K and V, and the forward block and the band's
tiles share the one rule for redoing rows that overflowed.

One vocabulary throughout: b a batch, h0 .. h1 the kv heads of a stack (g = group query heads
each, interleaved row by row), i0 .. i1 query rows, j0 .. j1 keys, s0 .. s1 rows of a stack, D the
head dim; m, l, O, P, S, dS, dQ, dK, dV, lse and D_i as in the FlashAttention papers. Measured
figures behind the choices: benchmarks/results/numpy_backend_choices.md.
"""

from __future__ import annotations

import numpy as np

from . import band_backward, band_forward, packed, plan, pool, stacks, tiled_backward, tiled_forward, weights
from .plan import describe_tiles, tile_sizes  # noqa: F401
from .pool import worker_count  # noqa: F401
from .pool import blas_controller as _blas_controller  # noqa: F401  (python -m flashcupy info)
from .settings import Config, config, configure  # noqa: F401

NAME = "numpy"
ARRAY_LIBRARIES = ("numpy",)
DTYPES = ("float16", "float32", "float64", "bfloat16")
MAX_HEAD_DIM = None
MODIFIERS = frozenset({"window", "softcap", "alibi_slopes", "bias", "mask"})  # every score modifier
HEAD_DIM_V = True  # v's head_dim may differ from q's and k's
DROPOUT = True  # dropout_p (README, Semantics: the keep mask of flashcupy/_dropout.py)


def grid_axes(p, backward):
    return []  # no CUDA grid on the CPU


def unavailable_reason():
    return None


def allocate(like, shape, dtype, fill):
    return np.full(shape, fill, dtype=dtype)


WRITES_INTO = True  # forward, backward and probs write into given arrays (into=): XLA's buffers for flashcupy.jax
DQ_ONLY = True  # backward skips dk and dv where p.dq_only (the tiled and grouped paths; the band's drops them)


@pool.one_call
def forward(p, q, k, v, into=None):
    q, k, v = stacks.values(p, q, k, v)
    if into is None:
        out, lse = np.empty(p.out_shape, dtype=q.dtype), np.empty(p.lse_shape, dtype=p.lse_dtype)
    else:
        out, lse = stacks.values(p, into[0])[0], into[1]
    width = plan.narrow_band(p)
    if packed.dense(p):  # short sequences: the batch in groups (packed.py)
        packed.forward_dense(p, q, k, v, out, lse)
    elif width is not None:
        band_forward.forward(p, q, k, v, out, lse, width)
    else:
        tiled_forward.forward(p, q, k, v, out, lse)
    return out.view(p.carrier), lse


@pool.one_call
def backward(p, dout, q, k, v, out, lse, into=None, dlse=None):
    dout, q, k, v, out = stacks.values(p, dout, q, k, v, out)
    if into is None:
        dq = np.empty(q.shape, dtype=q.dtype)
    else:
        (dq,) = stacks.values(p, into[0])
    width = plan.narrow_band(p, backward=True)
    if p.dq_only and width is not None:  # the band backward makes them all: dk and dv in scratch
        dk, dv = (pool.call_scratch.take(name, x.shape, x.dtype) for name, x in (("dk", k), ("dv", v)))
    elif p.dq_only:
        dk = dv = None
    elif into is None:
        dk, dv = (np.empty(x.shape, dtype=x.dtype) for x in (k, v))
    else:
        dk, dv = stacks.values(p, *into[1:3])
    # dbias summed straight into `into` where it is given in the accumulation dtype
    given = into[3] if into is not None and len(into) > 3 and into[3].dtype == p.acc_dtype else None
    if packed.dense(p):  # short sequences: the batch in groups (packed.py)
        dB = None if not p.dbias else given if given is not None else np.empty(p.bias.shape, p.acc_dtype)
        packed.backward_dense(p, dout, q, k, v, out, lse, dq, dk, dv, dlse, dB)
    elif width is not None:
        band_backward.backward(p, dout, q, k, v, out, lse, dq, dk, dv, width, dlse)
        dB = None
    else:
        dB = tiled_backward.backward(p, dout, q, k, v, out, lse, dq, dk, dv, dB=given, dlse=dlse)
    if p.dq_only:
        return (dq.view(p.carrier),)
    grads = dq.view(p.carrier), dk.view(p.carrier), dv.view(p.carrier)
    if dB is None:
        return grads
    # no copy where dbias's dtype is the accumulation dtype: the backward's extra memory is dbias itself
    if p.bias.dtype == p.carrier:  # q's dtype (bfloat16 bits included), else float32
        dbias = dB.astype(dq.dtype, copy=False).view(p.carrier)
    else:
        dbias = dB.astype(p.bias.dtype, copy=False)
    if into is not None and len(into) > 3 and dbias is not into[3]:
        into[3][...] = dbias  # rounded from the accumulation dtype: a copy of dbias's size
        dbias = into[3]
    return grads + (dbias,)


# a packed batch's short sequences in groups (packed.py), the rest one call each (flashcupy/_varlen.py)
sequences_together = packed.together
forward_sequences = packed.forward
backward_sequences = packed.backward


@pool.one_call
def probs(p, q, k, lse, rows, into=None):
    """P = exp(s - lse) (batch, heads_q, len(rows), seqlen_k) in the accumulation dtype, for the
    query rows `rows` (an index array), written into `into` where given; see weights.probs."""
    q, k = stacks.values(p, q, k)
    if packed.dense(p):  # short sequences: the batch in groups (packed.py)
        P = np.empty((p.batch, p.heads_q, rows.size, p.seqlen_k), dtype=p.acc_dtype) if into is None else into
        packed.probs_dense(p, q, k, lse, rows, P)
        return P
    return weights.probs(p, q, k, lse, rows, into)
