"""numba.cuda kernels of the "numba" backend: FlashAttention-2 forward and backward.

Four kernels, names after the FlashAttention-2 paper:

    _attn_fwd            out, lse                  grid (Sq blocks, heads_q, batch)
    _attn_bwd_preprocess D = rowsum(dO ∘ O)        grid (Sq / PREP_THREADS, heads_q, batch)
    _attn_bwd_dkdv       dK, dV                    grid (Sk blocks, heads_kv, batch)
    _attn_bwd_dq         dQ                        grid (Sq blocks, heads_q, batch)

Every array is passed as a flat 1-D buffer plus a tuple `st` = (offset, stride0,
stride1, ...) in elements, so any layout (transposed, sliced, negative strides)
is read in place; `_at` turns (b, s, h, d) into a flat index.

Tiles. A thread block is BLOCK_Q x BLOCK_K threads. In the query-major kernels
(forward, dQ) thread (c, r) = (threadIdx.x, threadIdx.y) owns score S[r, c] of
the BLOCK_Q x BLOCK_K tile and the head-dim columns d = c, c + BLOCK_K, ... of
its query row's accumulator (O or dQ, in registers). In the key-major kernel
(dK/dV) the roles swap: thread (r, c) owns S[r, c] and the columns
d = r, r + BLOCK_Q, ... of key row c's dK and dV. The head dim is streamed
through shared memory in chunks of D_TILE columns, so one compiled kernel
serves every head_dim up to HEAD_DIM_MAX with the same shared-memory budget.

Arithmetic is in the accumulation dtype ACC: float32 for float16/float32
inputs, float64 for float64. Kernels read ACC from the dtype of their lse
argument (`lse.dtype`), which the host allocates (or checks) as ACC; numba
compiles one specialisation per dtype. Literals go through `acc(...)` so no
float64 sneaks into the float32 path.

Row reductions (max, sum over a tile row) are plain loops over shared memory:
no warp shuffles, so the CUDA simulator runs every line of these kernels.

Shared memory, per block (tiles padded by PAD column against bank conflicts):
    forward:  Q_i, K_j, V_j  3 x BLOCK x (D_TILE + PAD) x ACC
              S, P           2 x BLOCK_Q x BLOCK_K x ACC
    dK/dV:    Q_i, K_j, dO_i, V_j  4 x BLOCK x (D_TILE + PAD) x ACC
              P, dS                 2 x BLOCK_Q x BLOCK_K x ACC
    dQ:       Q_i, K_j, dO_i, V_j  4 x BLOCK x (D_TILE + PAD) x ACC
              dS                    1 x BLOCK_Q x BLOCK_K x ACC
GPU sizes (16, 16, 32, PAD 1): forward 8.4 KB (float32) / 16.7 KB (float64);
dK/dV and dQ at most 10.5 KB / 21 KB. All under the 48 KB static limit.
Per-thread accumulators: O (or dQ) is HEAD_DIM_MAX / BLOCK_K = 16 ACC values;
dK, dV 2 x HEAD_DIM_MAX / BLOCK_Q = 32. They are indexed by a runtime column,
so they live in local memory (L1-cached), not registers.

Performance: scalar FMA (numba has no tensor-core API) with one score per
thread; each FMA reads two shared values. This is the floor the CUDA C
backend starts from, not a competitor to it: the backend exists so that an
idea about tiling, masking or the backward can be tried here in Python, on the
simulator, and then ported.
"""

from __future__ import annotations

import math
import os

from numba import cuda

SIMULATOR = cuda.jit.__module__.startswith("numba.cuda.simulator")

# Tile tables: (BLOCK_Q, BLOCK_K, D_TILE, PREP_THREADS), PREP_THREADS being the
# rows per block of the D pre-pass. Under the simulator every CUDA thread is a
# Python thread: small blocks keep the tests fast, and BLOCK_Q != BLOCK_K
# catches a swapped row/column index. FLASHCUPY_NUMBA_TILES, read once here,
# overrides the choice: "gpu" runs the GPU's tiles on the simulator (slow:
# BLOCK_Q x BLOCK_K Python threads a block), "simulator" the small ones on a GPU.
TILE_TABLES = {
    "gpu": (16, 16, 32, 128),
    "simulator": (4, 2, 8, 4),
}
TILES = os.environ.get("FLASHCUPY_NUMBA_TILES") or ("simulator" if SIMULATOR else "gpu")
if TILES not in TILE_TABLES:
    raise ValueError(f"FLASHCUPY_NUMBA_TILES must be one of {', '.join(map(repr, TILE_TABLES))} "
                     f"(or unset), got {TILES!r}")
BLOCK_Q, BLOCK_K, D_TILE, PREP_THREADS = TILE_TABLES[TILES]
PAD = 1                        # extra shared column: row-wise reads by neighbouring threads hit different banks
TILE_COLS = D_TILE + PAD       # shared tiles are (rows, TILE_COLS); numba needs the sum as one constant
HEAD_DIM_MAX = 256             # the largest head_dim the register accumulators hold
NTHREADS = BLOCK_Q * BLOCK_K   # threads per block of the three tile kernels

O_PER_THREAD = -(-HEAD_DIM_MAX // BLOCK_K)    # O / dQ columns each thread accumulates
DKV_PER_THREAD = -(-HEAD_DIM_MAX // BLOCK_Q)  # dK / dV columns each thread accumulates

assert HEAD_DIM_MAX == 256, "numba_backend.MAX_HEAD_DIM states this limit to users"
# A column d = d0 + dd of a chunk starting at d0 (a multiple of D_TILE) belongs to
# lane d % BLOCK; this needs every chunk start to be a multiple of both BLOCKs.
assert D_TILE % BLOCK_K == 0 and D_TILE % BLOCK_Q == 0, "D_TILE must be a multiple of BLOCK_Q and BLOCK_K"
# The host checks the query-block grid against CUDA's limits; the pre-pass grid must not be larger.
assert PREP_THREADS >= BLOCK_Q, "PREP_THREADS must be at least BLOCK_Q"


# ----------------------------------------------------------------------------
# device helpers


@cuda.jit(device=True)
def _at(st, b, s, h, d):
    """Flat index of element (b, s, h, d) of a rank-4 array described by st."""
    return st[0] + b * st[1] + s * st[2] + h * st[3] + d * st[4]


@cuda.jit(device=True)
def _at3(st, b, h, s):
    """Flat index of element (b, h, s) of a rank-3 array (lse, D) described by st."""
    return st[0] + b * st[1] + h * st[2] + s * st[3]


@cuda.jit(device=True)
def _load_tile(tile, x, st, b, row0, nrows, h, d0, head_dim, tid):
    """tile[rr, dd] = x[b, row0 + rr, h, d0 + dd] in ACC, 0 outside the array.

    All NTHREADS threads of the block share the copy; consecutive threads take
    consecutive head-dim columns, so a contiguous head_dim is read coalesced.
    Zero fill matters: P = 0 there, and 0 * uninitialised memory could be NaN.
    """
    rows = tile.shape[0]
    for idx in range(tid, rows * D_TILE, NTHREADS):
        rr = idx // D_TILE
        dd = idx - rr * D_TILE
        row = row0 + rr
        d = d0 + dd
        if row < nrows and d < head_dim:
            tile[rr, dd] = x[_at(st, b, row, h, d)]
        else:
            tile[rr, dd] = 0


@cuda.jit(device=True)
def _key_end(seqlen_k, i_end, causal, diagonal):
    """One past the last key that query rows [.., i_end) see: later key blocks are skipped."""
    if not causal:
        return seqlen_k
    return max(0, min(seqlen_k, i_end + diagonal))


@cuda.jit(device=True)
def _query_start(seqlen_q, j0, causal, diagonal):
    """First query row that sees key j0: earlier query blocks are skipped."""
    if not causal:
        return 0
    return max(0, min(seqlen_q, j0 - diagonal))


@cuda.jit(device=True)
def _visible(i, j, seqlen_q, seqlen_k, causal, diagonal):
    """Query i sees key j (bottom-right causal alignment), both inside the arrays."""
    return i < seqlen_q and j < seqlen_k and (not causal or j <= i + diagonal)


# ----------------------------------------------------------------------------
# forward


@cuda.jit
def _attn_fwd(q, qst, k, kst, v, vst, out, ost, lse, lst,
              seqlen_q, seqlen_k, group, head_dim, scale, causal, diagonal):
    """out_i = softmax(Q_i K^T scale) V and lse_i, for one block of BLOCK_Q query rows.

    Block: (BLOCK_K, BLOCK_Q) threads; thread (c, r) owns S[r, c] and O[r, c::BLOCK_K].
    Online softmax over the key blocks j this query block can see:
        S = scale Q_i K_jᵀ;  m_new = max(m, rowmax S);  P = exp(S - m_new)
        l = exp(m - m_new) l + rowsum P;  O = exp(m - m_new) O + P V_j
    then out_i = O / l, lse_i = m + log l; a row that saw no key: out 0, lse -inf.
    Shared: Q_i, K_j, V_j chunks + S, P tiles (8.4 KB float32, 16.7 KB float64 on the GPU).
    """
    acc = lse.dtype.type
    Q_i = cuda.shared.array((BLOCK_Q, TILE_COLS), lse.dtype)
    K_j = cuda.shared.array((BLOCK_K, TILE_COLS), lse.dtype)
    V_j = cuda.shared.array((BLOCK_K, TILE_COLS), lse.dtype)
    S = cuda.shared.array((BLOCK_Q, BLOCK_K), lse.dtype)
    P = cuda.shared.array((BLOCK_Q, BLOCK_K), lse.dtype)
    O = cuda.local.array(O_PER_THREAD, lse.dtype)

    c = cuda.threadIdx.x
    r = cuda.threadIdx.y
    tid = r * BLOCK_K + c
    i0 = cuda.blockIdx.x * BLOCK_Q
    h = cuda.blockIdx.y
    b = cuda.blockIdx.z
    g = h // group
    i = i0 + r

    for t in range(O_PER_THREAD):
        O[t] = 0
    m = acc(-math.inf)
    l = acc(0)

    # the bound is the same for every thread, so every thread meets every barrier
    for j0 in range(0, _key_end(seqlen_k, min(i0 + BLOCK_Q, seqlen_q), causal, diagonal), BLOCK_K):
        # S[r, c] = scale * Q_i[r, :] . K_j[c, :], head_dim in chunks of D_TILE
        s = acc(0)
        for d0 in range(0, head_dim, D_TILE):
            _load_tile(Q_i, q, qst, b, i0, seqlen_q, h, d0, head_dim, tid)
            _load_tile(K_j, k, kst, b, j0, seqlen_k, g, d0, head_dim, tid)
            cuda.syncthreads()  # Q_i, K_j chunks loaded by all threads
            for dd in range(D_TILE):
                s += Q_i[r, dd] * K_j[c, dd]
            cuda.syncthreads()  # everyone done reading before the next chunk overwrites them
        s *= scale
        if not _visible(i, j0 + c, seqlen_q, seqlen_k, causal, diagonal):
            s = acc(-math.inf)
        S[r, c] = s
        cuda.syncthreads()  # the whole row of S is written

        m_new = m
        for cc in range(BLOCK_K):
            m_new = max(m_new, S[r, cc])
        # a row that has seen no key yet keeps m = -inf: subtract 0 so exp gives 0, not NaN
        m_safe = acc(0) if m_new == -math.inf else m_new
        alpha = math.exp(m - m_safe)
        P[r, c] = math.exp(s - m_safe)
        cuda.syncthreads()  # the whole row of P is written

        rowsum = acc(0)
        for cc in range(BLOCK_K):
            rowsum += P[r, cc]
        l = alpha * l + rowsum
        m = m_new
        for t in range(O_PER_THREAD):
            O[t] *= alpha
        # O[r, d] += P[r, :] . V_j[:, d] for this thread's columns d = c, c + BLOCK_K, ...
        for d0 in range(0, head_dim, D_TILE):
            _load_tile(V_j, v, vst, b, j0, seqlen_k, g, d0, head_dim, tid)
            cuda.syncthreads()  # V_j chunk loaded
            for dd in range(c, D_TILE, BLOCK_K):
                pv = acc(0)
                for cc in range(BLOCK_K):
                    pv += P[r, cc] * V_j[cc, dd]
                O[(d0 + dd) // BLOCK_K] += pv
            cuda.syncthreads()  # done reading V_j (and P) before they are overwritten

    if i < seqlen_q:
        seen = l != 0  # l >= 1 once a key was seen; NaN inputs keep NaN
        inv_l = acc(1) / l if seen else acc(0)
        for t in range(O_PER_THREAD):
            d = c + t * BLOCK_K
            if d < head_dim:
                out[_at(ost, b, i, h, d)] = O[t] * inv_l
        if c == 0:
            lse[_at3(lst, b, h, i)] = m + math.log(l) if seen else acc(-math.inf)


# ----------------------------------------------------------------------------
# backward


@cuda.jit
def _attn_bwd_preprocess(dout, dost, out, ost, D, Dst, lse, seqlen_q, head_dim):
    """D[b, h, i] = rowsum(dO_i ∘ O_i) in ACC; one thread per query row, no shared memory.

    lse is passed only for its dtype (ACC); no barrier, no tile.
    """
    acc = lse.dtype.type
    i = cuda.blockIdx.x * PREP_THREADS + cuda.threadIdx.x
    h = cuda.blockIdx.y
    b = cuda.blockIdx.z
    if i < seqlen_q:
        total = acc(0)
        for d in range(head_dim):
            total += acc(dout[_at(dost, b, i, h, d)]) * acc(out[_at(ost, b, i, h, d)])
        D[_at3(Dst, b, h, i)] = total


@cuda.jit(device=True)
def _row_lse(lse, lst, b, h, i, seqlen_q):
    """lse of row i as the subtrahend of exp(S - lse): +inf for a fully masked row (P = 0)."""
    acc = lse.dtype.type
    if i >= seqlen_q:
        return acc(math.inf)
    x = lse[_at3(lst, b, h, i)]
    return acc(math.inf) if x == -math.inf else x


@cuda.jit
def _attn_bwd_dkdv(q, qst, k, kst, v, vst, dout, dost, lse, lst, D, Dst, dk, dkst, dv, dvst,
                   seqlen_q, seqlen_k, group, head_dim, scale, causal, diagonal):
    """dK_j, dV_j for one block of BLOCK_K keys, summed over the query heads of its GQA group.

    Block: (BLOCK_Q, BLOCK_K) threads; thread (r, c) owns S[r, c] and dK, dV[c, r::BLOCK_Q].
    For each query head sharing kv head g and each query block i that sees key block j:
        P = exp(scale Q_i K_jᵀ - lse_i);  dP = dO_i V_jᵀ;  dS = P ∘ (dP - D_i) scale
        dV_j += Pᵀ dO_i;  dK_j += dSᵀ Q_i
    Shared: Q_i, K_j, dO_i, V_j chunks + P, dS tiles (10.5 KB float32, 21 KB float64 on the GPU).
    """
    acc = lse.dtype.type
    Q_i = cuda.shared.array((BLOCK_Q, TILE_COLS), lse.dtype)
    K_j = cuda.shared.array((BLOCK_K, TILE_COLS), lse.dtype)
    dO_i = cuda.shared.array((BLOCK_Q, TILE_COLS), lse.dtype)
    V_j = cuda.shared.array((BLOCK_K, TILE_COLS), lse.dtype)
    P = cuda.shared.array((BLOCK_Q, BLOCK_K), lse.dtype)
    dS = cuda.shared.array((BLOCK_Q, BLOCK_K), lse.dtype)
    dK = cuda.local.array(DKV_PER_THREAD, lse.dtype)
    dV = cuda.local.array(DKV_PER_THREAD, lse.dtype)

    r = cuda.threadIdx.x
    c = cuda.threadIdx.y
    tid = c * BLOCK_Q + r
    j0 = cuda.blockIdx.x * BLOCK_K
    g = cuda.blockIdx.y
    b = cuda.blockIdx.z
    j = j0 + c

    for t in range(DKV_PER_THREAD):
        dK[t] = 0
        dV[t] = 0

    for h in range(g * group, (g + 1) * group):
        for i0 in range(_query_start(seqlen_q, j0, causal, diagonal), seqlen_q, BLOCK_Q):
            i = i0 + r
            # S[r, c] = Q_i[r, :] . K_j[c, :] and dP[r, c] = dO_i[r, :] . V_j[c, :], in chunks
            s = acc(0)
            dp = acc(0)
            for d0 in range(0, head_dim, D_TILE):
                _load_tile(Q_i, q, qst, b, i0, seqlen_q, h, d0, head_dim, tid)
                _load_tile(K_j, k, kst, b, j0, seqlen_k, g, d0, head_dim, tid)
                _load_tile(dO_i, dout, dost, b, i0, seqlen_q, h, d0, head_dim, tid)
                _load_tile(V_j, v, vst, b, j0, seqlen_k, g, d0, head_dim, tid)
                cuda.syncthreads()  # the four chunks loaded by all threads
                for dd in range(D_TILE):
                    s += Q_i[r, dd] * K_j[c, dd]
                    dp += dO_i[r, dd] * V_j[c, dd]
                cuda.syncthreads()  # done reading before the next chunk overwrites them
            p = acc(0)
            if _visible(i, j, seqlen_q, seqlen_k, causal, diagonal):
                p = math.exp(s * scale - _row_lse(lse, lst, b, h, i, seqlen_q))
            D_r = D[_at3(Dst, b, h, i)] if i < seqlen_q else acc(0)
            P[r, c] = p
            dS[r, c] = p * (dp - D_r) * scale
            cuda.syncthreads()  # P and dS complete: every column c is read by BLOCK_Q threads

            # dV[c, d] += P[:, c] . dO_i[:, d];  dK[c, d] += dS[:, c] . Q_i[:, d]
            for d0 in range(0, head_dim, D_TILE):
                _load_tile(Q_i, q, qst, b, i0, seqlen_q, h, d0, head_dim, tid)
                _load_tile(dO_i, dout, dost, b, i0, seqlen_q, h, d0, head_dim, tid)
                cuda.syncthreads()  # Q_i, dO_i chunks loaded
                for dd in range(r, D_TILE, BLOCK_Q):
                    pdo = acc(0)
                    dsq = acc(0)
                    for rr in range(BLOCK_Q):
                        pdo += P[rr, c] * dO_i[rr, dd]
                        dsq += dS[rr, c] * Q_i[rr, dd]
                    dV[(d0 + dd) // BLOCK_Q] += pdo
                    dK[(d0 + dd) // BLOCK_Q] += dsq
                cuda.syncthreads()  # done reading Q_i, dO_i, P, dS before they are overwritten

    if j < seqlen_k:
        for t in range(DKV_PER_THREAD):
            d = r + t * BLOCK_Q
            if d < head_dim:
                dk[_at(dkst, b, j, g, d)] = dK[t]
                dv[_at(dvst, b, j, g, d)] = dV[t]


@cuda.jit
def _attn_bwd_dq(q, qst, k, kst, v, vst, dout, dost, lse, lst, D, Dst, dq, dqst,
                 seqlen_q, seqlen_k, group, head_dim, scale, causal, diagonal):
    """dQ_i for one block of BLOCK_Q query rows; a separate pass, so no atomics.

    Block: (BLOCK_K, BLOCK_Q) threads; thread (c, r) owns S[r, c] and dQ[r, c::BLOCK_K].
    For each key block j the query block sees:
        P = exp(scale Q_i K_jᵀ - lse_i);  dP = dO_i V_jᵀ;  dS = P ∘ (dP - D_i) scale
        dQ_i += dS K_j
    Shared: Q_i, K_j, dO_i, V_j chunks + dS tile (9.5 KB float32, 19 KB float64 on the GPU).
    """
    acc = lse.dtype.type
    Q_i = cuda.shared.array((BLOCK_Q, TILE_COLS), lse.dtype)
    K_j = cuda.shared.array((BLOCK_K, TILE_COLS), lse.dtype)
    dO_i = cuda.shared.array((BLOCK_Q, TILE_COLS), lse.dtype)
    V_j = cuda.shared.array((BLOCK_K, TILE_COLS), lse.dtype)
    dS = cuda.shared.array((BLOCK_Q, BLOCK_K), lse.dtype)
    dQ = cuda.local.array(O_PER_THREAD, lse.dtype)

    c = cuda.threadIdx.x
    r = cuda.threadIdx.y
    tid = r * BLOCK_K + c
    i0 = cuda.blockIdx.x * BLOCK_Q
    h = cuda.blockIdx.y
    b = cuda.blockIdx.z
    g = h // group
    i = i0 + r

    for t in range(O_PER_THREAD):
        dQ[t] = 0
    lse_r = _row_lse(lse, lst, b, h, i, seqlen_q)
    D_r = D[_at3(Dst, b, h, i)] if i < seqlen_q else acc(0)

    for j0 in range(0, _key_end(seqlen_k, min(i0 + BLOCK_Q, seqlen_q), causal, diagonal), BLOCK_K):
        s = acc(0)
        dp = acc(0)
        for d0 in range(0, head_dim, D_TILE):
            _load_tile(Q_i, q, qst, b, i0, seqlen_q, h, d0, head_dim, tid)
            _load_tile(K_j, k, kst, b, j0, seqlen_k, g, d0, head_dim, tid)
            _load_tile(dO_i, dout, dost, b, i0, seqlen_q, h, d0, head_dim, tid)
            _load_tile(V_j, v, vst, b, j0, seqlen_k, g, d0, head_dim, tid)
            cuda.syncthreads()  # the four chunks loaded by all threads
            for dd in range(D_TILE):
                s += Q_i[r, dd] * K_j[c, dd]
                dp += dO_i[r, dd] * V_j[c, dd]
            cuda.syncthreads()  # done reading before the next chunk overwrites them
        p = acc(0)
        if _visible(i, j0 + c, seqlen_q, seqlen_k, causal, diagonal):
            p = math.exp(s * scale - lse_r)
        dS[r, c] = p * (dp - D_r) * scale
        cuda.syncthreads()  # the whole row of dS is written

        # dQ[r, d] += dS[r, :] . K_j[:, d] for this thread's columns d = c, c + BLOCK_K, ...
        for d0 in range(0, head_dim, D_TILE):
            _load_tile(K_j, k, kst, b, j0, seqlen_k, g, d0, head_dim, tid)
            cuda.syncthreads()  # K_j chunk loaded
            for dd in range(c, D_TILE, BLOCK_K):
                dsk = acc(0)
                for cc in range(BLOCK_K):
                    dsk += dS[r, cc] * K_j[cc, dd]
                dQ[(d0 + dd) // BLOCK_K] += dsk
            cuda.syncthreads()  # done reading K_j (and dS) before they are overwritten

    if i < seqlen_q:
        for t in range(O_PER_THREAD):
            d = c + t * BLOCK_K
            if d < head_dim:
                dq[_at(dqst, b, i, h, d)] = dQ[t]
