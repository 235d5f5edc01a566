"""numba.cuda kernels of the "numba" backend: FlashAttention-2 forward and backward.

Four kernels, names after the FlashAttention-2 paper:

    _flash_fwd            out, lse                  grid (Sq blocks, heads_q, batch)
    _flash_bwd_preprocess D = rowsum(dO ∘ O) - dlse grid (Sq / PREP_THREADS, heads_q, batch)
    _flash_bwd_dkdv       dK, dV                    grid (Sk blocks, heads_kv, batch)
    _flash_bwd_dq         dQ                        grid (Sq blocks, heads_q, batch)

A packed batch (attention_varlen) is one launch of each: the forward, dK/dV and dQ kernels take
cu_seqlens (num_seqs > 0) and a grid of (slots, heads, 1), each block finding its sequence
(_sequence_of, as mask.cuh's Sequence), the pre-pass runs over the packed rows as one sequence.

and two element-wise ones, PREP_THREADS threads a block, for what a bias adds and for
attention_probs:

    _flash_bwd_dbias      dbias (with a bias)       grid (dbias elements / PREP_THREADS)
    _flash_probs          P = exp(S - lse)          grid (rows x Sk / PREP_THREADS, heads_q, batch)

Every score goes through one helper, `_modify`: softcap, ALiBi, bias, then -inf where
the band (causal, window) or the user's mask hides the pair.

Every array is passed as a flat 1-D buffer plus a tuple `st` = (offset, stride0,
stride1, ...) in elements, so any layout (transposed, sliced, negative strides)
is read in place; `_at` turns (b, s, h, d) into a flat index.

Tiles. A thread block is BLOCK_M x BLOCK_N threads: BLOCK_M query rows by
BLOCK_N keys, as in the CUDA kernels and the FlashAttention papers. In the
query-major kernels (forward, dQ) thread (c, r) = (threadIdx.x, threadIdx.y)
owns score S[r, c] of the BLOCK_M x BLOCK_N tile and the head-dim columns
d = c, c + BLOCK_N, ... of its query row's accumulator (O or dQ, in registers).
In the key-major kernel (dK/dV) the roles swap: thread (r, c) owns S[r, c] and
the columns d = r, r + BLOCK_M, ... of key row c's dK and dV. The head dim is
streamed through shared memory in chunks of D_TILE columns, so one compiled
kernel serves every head_dim up to HEAD_DIM_MAX with the same shared-memory budget.

Arithmetic is in the accumulation dtype ACC, the Problem's acc_dtype (float32
for float16/float32 inputs, float64 for float64). numba types a shared or local
array only from a dtype it knows when it compiles, and a kernel argument cannot
be a dtype, so each kernel reads ACC from an array the host allocated in
p.acc_dtype: lse in the forward, the workspace D in the backward. numba
compiles one specialisation per dtype. Literals go through `acc(...)` so no
float64 sneaks into the float32 path.

Row reductions (max, sum over a tile row) are plain loops over shared memory:
no warp shuffles, so the CUDA simulator runs every line of these kernels.

Shared memory, per block (tiles padded by PAD column against bank conflicts):
    forward:  Q_i, K_j, V_j  (BLOCK_M + 2 BLOCK_N) x (D_TILE + PAD) x ACC
              S, P           2 x BLOCK_M x BLOCK_N x ACC
    dK/dV:    Q_i, K_j, dO_i, V_j  2 (BLOCK_M + BLOCK_N) x (D_TILE + PAD) x ACC
              P, dS                 2 x BLOCK_M x BLOCK_N x ACC
    dQ:       Q_i, K_j, dO_i, V_j  2 (BLOCK_M + BLOCK_N) x (D_TILE + PAD) x ACC
              dS                    1 x BLOCK_M x BLOCK_N x ACC
which must stay under the 48 KB static limit; `python -m
flashcupy.backends.numba_backend.tools ptx` prints each kernel's figure.
Per-thread accumulators: O (or dQ) is O_PER_THREAD ACC values, dK and dV
DKV_PER_THREAD each. They are indexed by a runtime column, so they live in
local memory (L1-cached), not registers.

Performance: scalar FMA (numba has no tensor-core API) with one score per
thread; each FMA reads two shared values. This is the floor the CUDA C
backend starts from, not a competitor to it: the backend exists so that an
idea about tiling, masking or the backward can be tried here in Python, on the
simulator, and then ported.
"""

from __future__ import annotations

import math
import os
import sys
import threading

from numba import cuda, uint64

SIMULATOR = cuda.jit.__module__.startswith("numba.cuda.simulator")


def _shared_array_under_a_lock():
    """Make the simulator's cuda.shared.array one array per block, as on a GPU.

    The simulator (numba-cuda 0.30) runs each CUDA thread as a Python thread and
    finds a block's shared array by its call site with an unlocked
    get-then-insert: two threads can both miss and each get a private array, so
    one thread's writes never reach the others and they read uninitialised
    memory. It failed one CI run of the whole suite, and 1 backward call in 6
    with sys.setswitchinterval(1e-6). This is the same
    lookup, keyed the same way (file and line of the caller), made atomic.
    """
    import numpy as np
    from numba.cuda.simulator import kernelapi

    original = kernelapi.FakeCUDAShared.array
    if getattr(original, "flashcupy_locked", False):
        return
    lock = threading.Lock()

    def array(self, shape, dtype, alignment=None):
        if alignment is not None or shape == 0:
            return original(self, shape, dtype, alignment)  # refusal / dynamic shared: no lookup
        caller = sys._getframe(1)
        key = (caller.f_code.co_filename, caller.f_lineno)
        if isinstance(dtype, kernelapi.types.Type):
            dtype = kernelapi.numpy_support.as_dtype(dtype)
        with lock:
            if key not in self._allocations:
                self._allocations[key] = np.empty(shape, dtype)
            return self._allocations[key]

    array.flashcupy_locked = True
    kernelapi.FakeCUDAShared.array = array


if SIMULATOR:
    _shared_array_under_a_lock()

# Tile tables: (BLOCK_M, BLOCK_N, D_TILE, PREP_THREADS), PREP_THREADS being the
# rows per block of the D pre-pass. Under the simulator every CUDA thread is a
# Python thread: small blocks keep the tests fast, and BLOCK_M != BLOCK_N
# catches a swapped row/column index. FLASHCUPY_NUMBA_TILES, read once here,
# overrides the choice: "gpu" runs the GPU's tiles on the simulator (slow:
# BLOCK_M x BLOCK_N Python threads a block), "simulator" the small ones on a GPU.
TILE_TABLES = {
    "gpu": (16, 16, 32, 128),
    "simulator": (4, 2, 8, 4),
}
TILES = os.environ.get("FLASHCUPY_NUMBA_TILES") or ("simulator" if SIMULATOR else "gpu")
if TILES not in TILE_TABLES:
    raise ValueError(f"FLASHCUPY_NUMBA_TILES must be one of {', '.join(map(repr, TILE_TABLES))} "
                     f"(or unset), got {TILES!r}")
BLOCK_M, BLOCK_N, D_TILE, PREP_THREADS = TILE_TABLES[TILES]
PAD = 1                        # extra shared column: row-wise reads by neighbouring threads hit different banks
TILE_COLS = D_TILE + PAD       # shared tiles are (rows, TILE_COLS); numba needs the sum as one constant
HEAD_DIM_MAX = 256             # the largest head_dim the register accumulators hold
NTHREADS = BLOCK_M * BLOCK_N   # threads per block of the three tile kernels

O_PER_THREAD = -(-HEAD_DIM_MAX // BLOCK_N)    # O / dQ columns each thread accumulates
DKV_PER_THREAD = -(-HEAD_DIM_MAX // BLOCK_M)  # dK / dV columns each thread accumulates

assert HEAD_DIM_MAX == 256, "numba_backend.MAX_HEAD_DIM states this limit to users"
# A column d = d0 + dd of a chunk starting at d0 (a multiple of D_TILE) belongs to
# lane d % BLOCK; this needs every chunk start to be a multiple of both BLOCKs.
assert D_TILE % BLOCK_N == 0 and D_TILE % BLOCK_M == 0, "D_TILE must be a multiple of BLOCK_M and BLOCK_N"
# The host checks the query-block grid against CUDA's limits; the pre-pass grid must not be larger.
assert PREP_THREADS >= BLOCK_M, "PREP_THREADS must be at least BLOCK_M"


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


# ----------------------------------------------------------------------------
# packed batches: the forward, dK/dV and dQ kernels take cu_seqlens (num_seqs > 0) and find their
# sequence themselves, as the CUDA kernels do (mask.cuh's Sequence): the grid's x is a slot of
# total // block + num_seqs, sequence s owning slots cu[s] // block + s onwards; every offset read is
# clamped to [0, total] and a sequence's end to at least its start, so no offsets make a kernel index
# outside the arrays. A block past its sequence's blocks returns at once (the whole block, before any
# barrier).


@cuda.jit(device=True)
def _offset(cu, cust, s, total):
    """cu[s] clamped to [0, total]."""
    return min(max(cu[cust[0] + s * cust[1]], 0), total)


@cuda.jit(device=True)
def _sequence_of(cu, cust, cu_other, cuost, num_seqs, total, total_other, block, slot):
    """(sequence s, its first row and length on the side whose blocks the grid holds (cu: cu_seqlens_q
    for the forward and dQ, cu_seqlens_k for dK/dV), the same on the other side, the first row of the
    slot's block in the sequence or -1 for none) of slot `slot`: a binary search over the first slots,
    increasing for valid offsets, and ending on some sequence for others."""
    s = 0
    last = num_seqs - 1
    while s < last:
        mid = (s + last + 1) // 2
        if _offset(cu, cust, mid, total) // block + mid <= slot:
            s = mid
        else:
            last = mid - 1
    start = _offset(cu, cust, s, total)
    length = max(start, _offset(cu, cust, s + 1, total)) - start
    other = _offset(cu_other, cuost, s, total_other)
    other_length = max(other, _offset(cu_other, cuost, s + 1, total_other)) - other
    first = (slot - (start // block + s)) * block
    if first < 0 or first >= length:
        first = -1
    return s, start, length, other, other_length, first


@cuda.jit(device=True)
def _from_row(st, row):
    """A rank-4 array's `st` moved to row `row` (axis 1) with batch stride 0: its sequence's rows."""
    return (st[0] + row * st[2], st[1] * 0, st[2], st[3], st[4])


@cuda.jit(device=True)
def _from_row3(st, row):
    """The same for a (batch, head, row) array: lse, D."""
    return (st[0] + row * st[3], st[1] * 0, st[2], st[3])


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
def _query_block(group):
    """The forward and dQ kernels' coordinates: thread (c, r) of block (query block, query head,
    batch) owns column c of row r. Returns c, r, tid, i0, i (its query row), h, kv_head, b."""
    c = cuda.threadIdx.x
    r = cuda.threadIdx.y
    i0 = cuda.blockIdx.x * BLOCK_M
    h = cuda.blockIdx.y
    return c, r, r * BLOCK_N + c, i0, i0 + r, h, h // group, cuda.blockIdx.z


@cuda.jit(device=True)
def _start_query_block(total, group):
    """A query-major kernel's start (forward, dQ): its thread's accumulator `total` (O or dQ, in
    registers) zeroed, and _query_block's coordinates returned."""
    for t in range(O_PER_THREAD):
        total[t] = 0
    return _query_block(group)


@cuda.jit(device=True)
def _store_query_row(x, xst, total, factor, b, i, h, head_dim, c):
    """Row i of x (forward's out, dQ's dq) from the columns c, c + BLOCK_N, ... of `total` that its
    thread accumulated, times `factor` (the forward's 1 / l; 1 for dQ, exact)."""
    for t in range(O_PER_THREAD):
        d = c + t * BLOCK_N
        if d < head_dim:
            x[_at(xst, b, i, h, d)] = total[t] * factor


@cuda.jit(device=True)
def _chunk_tiles(like):
    """The shared tiles every tile kernel streams head_dim through, D_TILE columns at a time (plus PAD):
    Q_i (BLOCK_M rows), K_j and V_j (BLOCK_N rows each), in the dtype of the array `like` (ACC).
    Shared memory is static: each kernel that calls this gets its own three tiles."""
    Q_i = cuda.shared.array((BLOCK_M, TILE_COLS), like.dtype)
    K_j = cuda.shared.array((BLOCK_N, TILE_COLS), like.dtype)
    V_j = cuda.shared.array((BLOCK_N, TILE_COLS), like.dtype)
    return Q_i, K_j, V_j


@cuda.jit(device=True)
def _scores_and_dP(Q_i, K_j, dO_i, V_j, q, qst, k, kst, dout, dost, v, vst,
                   b, h, kv_head, i0, j0, seqlen_q, seqlen_k, head_dim, head_dim_v, tid, r, c, acc):
    """(S[r, c], dP[r, c]) = (Q_i[r, :] . K_j[c, :], dO_i[r, :] . V_j[c, :]) over head_dim (q's and
    k's) and head_dim_v (dO's and v's) in chunks of D_TILE, every thread of the block taking part in
    the loads (a chunk past one of them loads zeros for it)."""
    s = acc(0)
    dp = acc(0)
    for d0 in range(0, max(head_dim, head_dim_v), D_TILE):
        _load_tile(Q_i, q, qst, b, i0, seqlen_q, h, d0, head_dim, tid)
        _load_tile(K_j, k, kst, b, j0, seqlen_k, kv_head, d0, head_dim, tid)
        _load_tile(dO_i, dout, dost, b, i0, seqlen_q, h, d0, head_dim_v, tid)
        _load_tile(V_j, v, vst, b, j0, seqlen_k, kv_head, d0, head_dim_v, tid)
        cuda.syncthreads()  # the four chunks loaded by all threads
        for dd in range(D_TILE):
            s += Q_i[r, dd] * K_j[c, dd]
            dp += dO_i[r, dd] * V_j[c, dd]
        cuda.syncthreads()  # done reading before the next chunk overwrites them
    return s, dp


@cuda.jit(device=True)
def _add_row_times_tile(total, W, tile, x, xst, b, row0, nrows, h, head_dim, tid, r, c, acc):
    """total[d // BLOCK_N] += W[r, :] . x[b, row0:row0 + BLOCK_N, h, d] for this thread's columns
    d = c, c + BLOCK_N, ...: O += P V_j in the forward, dQ += dS K_j in the dQ kernel."""
    for d0 in range(0, head_dim, D_TILE):
        _load_tile(tile, x, xst, b, row0, nrows, h, d0, head_dim, tid)
        cuda.syncthreads()  # the chunk loaded
        for dd in range(c, D_TILE, BLOCK_N):
            wx = acc(0)
            for cc in range(BLOCK_N):
                wx += W[r, cc] * tile[cc, dd]
            total[(d0 + dd) // BLOCK_N] += wx
        cuda.syncthreads()  # done reading the chunk (and W) before they are overwritten


# ----------------------------------------------------------------------------
# visibility: which keys a query sees
#
# `mask` is the host's (diagonal, left, right) from the Problem's band, -1 for an
# unbounded side (causal is right = 0): query i sees key j iff
# i + diagonal - left <= j <= i + diagonal + right. Only these three helpers open
# it, and the loops take both ends of their ranges from them, so key blocks
# outside the band are never visited.


@cuda.jit(device=True)
def _key_range(mask, i0, i_end, seqlen_k):
    """Keys [start, end) that some query row of [i0, i_end) sees: what a query block visits."""
    diagonal, left, right = mask
    start = 0 if left < 0 else max(0, min(seqlen_k, i0 + diagonal - left))
    end = seqlen_k if right < 0 else max(0, min(seqlen_k, i_end + diagonal + right))
    return start, end


@cuda.jit(device=True)
def _query_range(mask, j0, j_end, seqlen_q):
    """Query rows [start, end) that see some key of [j0, j_end): what a key block visits."""
    diagonal, left, right = mask
    start = 0 if right < 0 else max(0, min(seqlen_q, j0 - diagonal - right))
    end = seqlen_q if left < 0 else max(0, min(seqlen_q, j_end - diagonal + left))
    return start, end


@cuda.jit(device=True)
def _visible(mask, i, j, seqlen_q, seqlen_k):
    """Query i sees key j, both inside the arrays."""
    diagonal, left, right = mask
    return (i < seqlen_q and j < seqlen_k and (left < 0 or j >= i + diagonal - left)
            and (right < 0 or j <= i + diagonal + right))


# dropout (README, Semantics; flashcupy/_dropout.py is the rule's Python home, mask.cuh's Dropout the
# CUDA one): `drop` is the host's (on, threshold, seed_lo, seed_hi, b0, h0, i0, j0), on 0 for none, the
# origin added to (b, h, i, j); `drop_scale` 1 / (1 - p) in ACC. Everything in uint64, whose 32 x 32-bit
# products are exact (int64 ones overflow, and numba makes mixed int64 and uint64 float64).


@cuda.jit(device=True)
def _philox_word(c0, c1, c2, c3, k0, k1, word):
    """Word `word` of Philox4x32-10 of the counter (c0, c1, c2, c3) under the key (k0, k1), all uint64
    holding 32-bit values."""
    low = uint64(0xFFFFFFFF)
    for rnd in range(10):
        if rnd > 0:
            k0 = (k0 + uint64(0x9E3779B9)) & low
            k1 = (k1 + uint64(0xBB67AE85)) & low
        p0 = uint64(0xD2511F53) * c0
        p2 = uint64(0xCD9E8D57) * c2
        c0, c1, c2, c3 = (p2 >> uint64(32)) ^ c1 ^ k0, p2 & low, (p0 >> uint64(32)) ^ c3 ^ k1, p0 & low
    if word == uint64(0):
        return c0
    if word == uint64(1):
        return c1
    return c2 if word == uint64(2) else c3


@cuda.jit(device=True)
def _dropout_factor(drop, drop_scale, b, h, i, j, acc):
    """What pair (i, j) of batch b, query head h multiplies its weight by: 1 / (1 - p) where kept, 0
    where dropped; 1 without dropout."""
    on, threshold, seed_lo, seed_hi, b0, h0, i0, j0 = drop
    if on == 0:
        return acc(1)
    key = uint64(j + j0)
    word = _philox_word(key >> uint64(2), uint64(i + i0), uint64(h + h0), uint64(b + b0), uint64(seed_lo),
                        uint64(seed_hi), key & uint64(3))
    return drop_scale if word >= uint64(threshold) else acc(0)


# `mods` is the host's (softcap, alibi, slopes_st, biased, bias_st, masked, allow_st, drop, drop_scale): softcap 0
# for none; alibi 0 for none, else slopes[slopes_st[0] + b slopes_st[1] + h slopes_st[2]] is query
# head h's slope (batch stride 0 for slopes shared by the batch); biased (masked) 0 for none, else
# bias[_at(bias_st, b, h, i, j)] is the pair's bias (allow[...] whether it may attend), the rank-4
# bias and mask read in place, a zero stride for each dimension they broadcast. Without one, its
# array is a spare the host passes and nothing reads. Only _modify opens `mods`.


@cuda.jit(device=True)
def _modify(s, mods, slopes, bias, allow, mask, b, h, i, j, seqlen_q, seqlen_k, acc):
    """(s, t, seen) for query i and key j of batch b, query head h, from the scaled score s:
    s after softcap (c tanh(s / c)), ALiBi (- slope |i + diagonal - j|) and the bias, or -inf
    where the band or the mask hides the pair (seen False then); t = tanh(s / c) for the
    backward's dS *= 1 - tanh² (0 without a softcap). Visibility first, so a pair outside the
    arrays reads no bias or mask element."""
    softcap, alibi, slopes_st, biased, bias_st, masked, allow_st, _, _ = mods
    t = acc(0)
    if not _visible(mask, i, j, seqlen_q, seqlen_k):
        return acc(-math.inf), t, False
    if masked:
        if not allow[_at(allow_st, b, h, i, j)]:  # _at: any rank-4 index, here (b, h, i, j)
            return acc(-math.inf), t, False
    if softcap > acc(0):  # literals in ACC: an int would make these float64 in a float32 kernel
        t = math.tanh(s / softcap)
        s = softcap * t
    if alibi:
        distance = i + mask[0] - j
        slope = slopes[slopes_st[0] + b * slopes_st[1] + h * slopes_st[2]]
        s -= acc(slope) * acc(abs(distance))  # float32 slopes too
    if biased:
        s += acc(bias[_at(bias_st, b, h, i, j)])  # a float32 bias, or q's dtype
    return s, t, True


# ----------------------------------------------------------------------------
# forward


@cuda.jit
def _flash_fwd(q, qst, k, kst, v, vst, out, ost, lse, lst,
              seqlen_q, seqlen_k, group, dims, scale, mask, mods, slopes, bias, allow,
              cu_q, cuqst, cu_k, cukst, num_seqs):
    """out_i = softmax(Q_i K^T scale) V and lse_i, for one block of BLOCK_M query rows.

    Block: (BLOCK_N, BLOCK_M) threads; thread (c, r) owns S[r, c] and O[r, c::BLOCK_N].
    Online softmax over the key blocks j this query block can see:
        S = scale Q_i K_jᵀ;  m_new = max(m, rowmax S);  P = exp(S - m_new)
        l = exp(m - m_new) l + rowsum P;  O = exp(m - m_new) O + P V_j
    then out_i = O / l, lse_i = m + log l; a row that saw no key: out 0, lse -inf.
    Shared: Q_i, K_j, V_j chunks + S, P tiles.
    """
    acc = lse.dtype.type  # ACC: the host allocates lse in p.acc_dtype
    head_dim, head_dim_v = dims
    Q_i, K_j, V_j = _chunk_tiles(lse)
    S = cuda.shared.array((BLOCK_M, BLOCK_N), lse.dtype)
    P = cuda.shared.array((BLOCK_M, BLOCK_N), lse.dtype)
    O = cuda.local.array(O_PER_THREAD, lse.dtype)
    c, r, tid, i0, i, h, kv_head, b = _start_query_block(O, group)
    if num_seqs > 0:  # a packed batch: the slot's sequence, the tensors from its first rows
        b, q_start, seqlen_q, k_start, seqlen_k, i0 = _sequence_of(cu_q, cuqst, cu_k, cukst, num_seqs, seqlen_q,
                                                                   seqlen_k, BLOCK_M, cuda.blockIdx.x)
        if i0 < 0:
            return
        i = i0 + r
        qst, ost, lst = _from_row(qst, q_start), _from_row(ost, q_start), _from_row3(lst, q_start)
        kst, vst = _from_row(kst, k_start), _from_row(vst, k_start)
        mask = (seqlen_k - seqlen_q, mask[1], mask[2])  # causal bottom-right in the sequence
    m = acc(-math.inf)
    l = acc(0)

    # the bounds are the same for every thread, so every thread meets every barrier
    key_start, key_end = _key_range(mask, i0, min(i0 + BLOCK_M, seqlen_q), seqlen_k)
    for j0 in range(key_start, key_end, BLOCK_N):
        # S[r, c] = scale * Q_i[r, :] . K_j[c, :], head_dim in chunks of D_TILE
        s = acc(0)
        for d0 in range(0, head_dim, D_TILE):
            _load_tile(Q_i, q, qst, b, i0, seqlen_q, h, d0, head_dim, tid)
            _load_tile(K_j, k, kst, b, j0, seqlen_k, kv_head, d0, head_dim, tid)
            cuda.syncthreads()  # Q_i, K_j chunks loaded by all threads
            for dd in range(D_TILE):
                s += Q_i[r, dd] * K_j[c, dd]
            cuda.syncthreads()  # everyone done reading before the next chunk overwrites them
        s, _, _ = _modify(s * scale, mods, slopes, bias, allow, mask, b, h, i, j0 + c, seqlen_q, seqlen_k, acc)
        S[r, c] = s
        cuda.syncthreads()  # the whole row of S is written

        m_new = m
        for cc in range(BLOCK_N):
            m_new = max(m_new, S[r, cc])
        m_ref = acc(0) if m_new == -math.inf else m_new  # no key seen yet: exp(-inf) = 0, not NaN
        alpha = math.exp(m - m_ref)
        p = math.exp(s - m_ref)
        P[r, c] = p
        cuda.syncthreads()  # the whole row of P is written

        rowsum = acc(0)
        for cc in range(BLOCK_N):
            rowsum += P[r, cc]
        l = alpha * l + rowsum
        if mods[7][0] != 0:  # dropout: P V_j of the dropped weights, once every thread has its row sum
            cuda.syncthreads()  # every row sum read P before it changes (the next read waits at a barrier)
            P[r, c] = p * _dropout_factor(mods[7], mods[8], b, h, i, j0 + c, acc)
        m = m_new
        for t in range(O_PER_THREAD):
            O[t] *= alpha
        _add_row_times_tile(O, P, V_j, v, vst, b, j0, seqlen_k, kv_head, head_dim_v, tid, r, c, acc)

    if i < seqlen_q:
        seen = l != 0  # l >= 1 once a key was seen; NaN inputs keep NaN
        inv_l = acc(1) / l if seen else acc(0)
        _store_query_row(out, ost, O, inv_l, b, i, h, head_dim_v, c)
        if c == 0:
            lse[_at3(lst, b, h, i)] = m + math.log(l) if seen else acc(-math.inf)


# ----------------------------------------------------------------------------
# backward: ACC is the dtype of the workspace D, which the host allocates in p.acc_dtype


@cuda.jit
def _flash_bwd_preprocess(dout, dost, out, ost, dlse, dlst, D, Dst, seqlen_q, head_dim):
    """D[b, h, i] = rowsum(dO_i ∘ O_i) - dlse_i in ACC (dlse, the gradient of lse; dlst None: 0; in a
    row that sees no key the kernels select dS = 0 whatever D holds); one thread per query row, no
    shared memory."""
    acc = D.dtype.type
    i = cuda.blockIdx.x * PREP_THREADS + cuda.threadIdx.x
    h = cuda.blockIdx.y
    b = cuda.blockIdx.z
    if i < seqlen_q:
        total = acc(0)
        for d in range(head_dim):
            total += acc(dout[_at(dost, b, i, h, d)]) * acc(out[_at(ost, b, i, h, d)])
        if dlst is not None:
            total -= dlse[_at3(dlst, b, h, i)]
        D[_at3(Dst, b, h, i)] = total


@cuda.jit(device=True)
def _row_lse(lse, lst, b, h, i, seqlen_q):
    """lse of row i as the subtrahend of exp(S - lse): +inf for a fully masked row (P = 0)."""
    acc = lse.dtype.type
    if i >= seqlen_q:
        return acc(math.inf)
    x = lse[_at3(lst, b, h, i)]
    return acc(math.inf) if x == -math.inf else x


@cuda.jit(device=True)
def _recomputed_p(x, acc):
    """P = exp(x) of a recomputed x = s - lse, x clamped to at most 0 as it is by definition (P at
    most 1): where scores are so large that their rounding passes 1 (about 2^22 / head_dim in
    float32), a score summed otherwise than the forward's can put x far above 0 and P at inf, then
    NaN gradients (README, Semantics: large scores). A NaN stays NaN."""
    return math.exp(acc(0) if x > 0 else x)


@cuda.jit(device=True)
def _zero_rows_that_see_nothing(tile, lse, lst, b, h, row0, seqlen_q, tid):
    """0 in the rows of a tile this thread has just loaded (_load_tile's elements, so no barrier
    between) whose query row sees no key (lse -inf): dO_i in the dK/dV kernel, where P = 0 times a
    NaN in such a row's dout would still be NaN in dV. Query blocks start at the first row that
    sees the key block, but a mask can hide any row inside them. Costs one cached lse read per
    element loaded, against 2 BLOCK_N FMAs on it."""
    for idx in range(tid, tile.shape[0] * D_TILE, NTHREADS):
        rr = idx // D_TILE
        if _row_lse(lse, lst, b, h, row0 + rr, seqlen_q) == math.inf:
            tile[rr, idx - rr * D_TILE] = 0


@cuda.jit
def _flash_bwd_dkdv(q, qst, k, kst, v, vst, dout, dost, lse, lst, D, Dst, dk, dkst, dv, dvst,
                   seqlen_q, seqlen_k, group, dims, scale, mask, mods, slopes, bias, allow,
                   cu_q, cuqst, cu_k, cukst, num_seqs):
    """dK_j, dV_j for one block of BLOCK_N keys, summed over the query heads of its GQA group.

    Block: (BLOCK_M, BLOCK_N) threads; thread (r, c) owns S[r, c] and dK, dV[c, r::BLOCK_M].
    For each query head sharing kv_head and each query block i that sees key block j:
        P = exp(scale Q_i K_jᵀ - lse_i);  dP = dO_i V_jᵀ;  dS = P ∘ (dP - D_i) scale
        dV_j += Pᵀ dO_i;  dK_j += dSᵀ Q_i
    Shared: Q_i, K_j, dO_i, V_j chunks + P, dS tiles.
    """
    acc = D.dtype.type
    head_dim, head_dim_v = dims
    Q_i, K_j, V_j = _chunk_tiles(D)
    dO_i = cuda.shared.array((BLOCK_M, TILE_COLS), D.dtype)
    P = cuda.shared.array((BLOCK_M, BLOCK_N), D.dtype)
    dS = cuda.shared.array((BLOCK_M, BLOCK_N), D.dtype)
    dK = cuda.local.array(DKV_PER_THREAD, D.dtype)
    dV = cuda.local.array(DKV_PER_THREAD, D.dtype)

    r = cuda.threadIdx.x
    c = cuda.threadIdx.y
    tid = c * BLOCK_M + r
    j0 = cuda.blockIdx.x * BLOCK_N
    kv_head = cuda.blockIdx.y
    b = cuda.blockIdx.z
    if num_seqs > 0:  # a packed batch: the slot's sequence (over cu_seqlens_k), the tensors from its first rows
        b, k_start, seqlen_k, q_start, seqlen_q, j0 = _sequence_of(cu_k, cukst, cu_q, cuqst, num_seqs, seqlen_k,
                                                                   seqlen_q, BLOCK_N, cuda.blockIdx.x)
        if j0 < 0:
            return
        qst, dost, lst, Dst = _from_row(qst, q_start), _from_row(dost, q_start), _from_row3(lst, q_start), \
            _from_row3(Dst, q_start)
        kst, vst, dkst, dvst = _from_row(kst, k_start), _from_row(vst, k_start), _from_row(dkst, k_start), \
            _from_row(dvst, k_start)
        mask = (seqlen_k - seqlen_q, mask[1], mask[2])
    j = j0 + c

    for t in range(DKV_PER_THREAD):
        dK[t] = 0
        dV[t] = 0

    # the bounds are the same for every thread, so every thread meets every barrier
    query_start, query_end = _query_range(mask, j0, min(j0 + BLOCK_N, seqlen_k), seqlen_q)
    for h in range(kv_head * group, (kv_head + 1) * group):
        for i0 in range(query_start, query_end, BLOCK_M):
            i = i0 + r
            s, dp = _scores_and_dP(Q_i, K_j, dO_i, V_j, q, qst, k, kst, dout, dost, v, vst,
                                   b, h, kv_head, i0, j0, seqlen_q, seqlen_k, head_dim, head_dim_v, tid, r, c,
                                   acc)
            # hidden pairs get P = dS = 0 by selection, not by a product with P = 0: a NaN in a
            # row's dout must not reach keys the row does not see
            p = acc(0)
            ds = acc(0)
            s, t, seen = _modify(s * scale, mods, slopes, bias, allow, mask, b, h, i, j, seqlen_q, seqlen_k, acc)
            if seen:
                p = _recomputed_p(s - _row_lse(lse, lst, b, h, i, seqlen_q), acc)
                z = _dropout_factor(mods[7], mods[8], b, h, i, j, acc)  # dV and dP take the dropped weights
                ds = p * (dp * z - D[_at3(Dst, b, h, i)]) * (acc(1) - t * t) * scale
                p *= z
            P[r, c] = p
            dS[r, c] = ds
            cuda.syncthreads()  # P and dS complete: every column c is read by BLOCK_M threads

            # dV[c, d] += P[:, c] . dO_i[:, d];  dK[c, d] += dS[:, c] . Q_i[:, d]
            for d0 in range(0, max(head_dim, head_dim_v), D_TILE):
                _load_tile(Q_i, q, qst, b, i0, seqlen_q, h, d0, head_dim, tid)
                _load_tile(dO_i, dout, dost, b, i0, seqlen_q, h, d0, head_dim_v, tid)
                _zero_rows_that_see_nothing(dO_i, lse, lst, b, h, i0, seqlen_q, tid)
                cuda.syncthreads()  # Q_i, dO_i chunks loaded
                for dd in range(r, D_TILE, BLOCK_M):
                    pdo = acc(0)
                    dsq = acc(0)
                    for rr in range(BLOCK_M):
                        pdo += P[rr, c] * dO_i[rr, dd]
                        dsq += dS[rr, c] * Q_i[rr, dd]
                    dV[(d0 + dd) // BLOCK_M] += pdo
                    dK[(d0 + dd) // BLOCK_M] += dsq
                cuda.syncthreads()  # done reading Q_i, dO_i, P, dS before they are overwritten

    if j < seqlen_k:
        for t in range(DKV_PER_THREAD):
            d = r + t * BLOCK_M
            if d < head_dim:
                dk[_at(dkst, b, j, kv_head, d)] = dK[t]
            if d < head_dim_v:
                dv[_at(dvst, b, j, kv_head, d)] = dV[t]


@cuda.jit
def _flash_bwd_dq(q, qst, k, kst, v, vst, dout, dost, lse, lst, D, Dst, dq, dqst,
                 seqlen_q, seqlen_k, group, dims, scale, mask, mods, slopes, bias, allow,
                 cu_q, cuqst, cu_k, cukst, num_seqs):
    """dQ_i for one block of BLOCK_M query rows; a separate pass, so no atomics.

    Block: (BLOCK_N, BLOCK_M) threads; thread (c, r) owns S[r, c] and dQ[r, c::BLOCK_N].
    For each key block j the query block sees:
        P = exp(scale Q_i K_jᵀ - lse_i);  dP = dO_i V_jᵀ;  dS = P ∘ (dP - D_i) scale
        dQ_i += dS K_j
    Shared: Q_i, K_j, dO_i, V_j chunks + dS tile.
    """
    acc = D.dtype.type
    head_dim, head_dim_v = dims
    Q_i, K_j, V_j = _chunk_tiles(D)
    dO_i = cuda.shared.array((BLOCK_M, TILE_COLS), D.dtype)
    dS = cuda.shared.array((BLOCK_M, BLOCK_N), D.dtype)
    dQ = cuda.local.array(O_PER_THREAD, D.dtype)
    c, r, tid, i0, i, h, kv_head, b = _start_query_block(dQ, group)
    if num_seqs > 0:  # a packed batch, as the forward's
        b, q_start, seqlen_q, k_start, seqlen_k, i0 = _sequence_of(cu_q, cuqst, cu_k, cukst, num_seqs, seqlen_q,
                                                                   seqlen_k, BLOCK_M, cuda.blockIdx.x)
        if i0 < 0:
            return
        i = i0 + r
        qst, dost, lst, Dst, dqst = _from_row(qst, q_start), _from_row(dost, q_start), _from_row3(lst, q_start), \
            _from_row3(Dst, q_start), _from_row(dqst, q_start)
        kst, vst = _from_row(kst, k_start), _from_row(vst, k_start)
        mask = (seqlen_k - seqlen_q, mask[1], mask[2])
    lse_r = _row_lse(lse, lst, b, h, i, seqlen_q)
    D_r = D[_at3(Dst, b, h, i)] if i < seqlen_q else acc(0)

    # the bounds are the same for every thread, so every thread meets every barrier
    key_start, key_end = _key_range(mask, i0, min(i0 + BLOCK_M, seqlen_q), seqlen_k)
    for j0 in range(key_start, key_end, BLOCK_N):
        s, dp = _scores_and_dP(Q_i, K_j, dO_i, V_j, q, qst, k, kst, dout, dost, v, vst,
                               b, h, kv_head, i0, j0, seqlen_q, seqlen_k, head_dim, head_dim_v, tid, r, c, acc)
        ds = acc(0)  # selected, not multiplied by P = 0: a row that sees no key gets dq 0 whatever its dout
        s, t, seen = _modify(s * scale, mods, slopes, bias, allow, mask, b, h, i, j0 + c, seqlen_q, seqlen_k, acc)
        if seen:
            z = _dropout_factor(mods[7], mods[8], b, h, i, j0 + c, acc)
            ds = _recomputed_p(s - lse_r, acc) * (dp * z - D_r) * (acc(1) - t * t) * scale
        dS[r, c] = ds
        cuda.syncthreads()  # the whole row of dS is written

        _add_row_times_tile(dQ, dS, K_j, k, kst, b, j0, seqlen_k, kv_head, head_dim, tid, r, c, acc)

    if i < seqlen_q:
        _store_query_row(dq, dqst, dQ, acc(1), b, i, h, head_dim, c)


# ----------------------------------------------------------------------------
# element-wise kernels: dbias, and attention_probs


@cuda.jit(device=True)
def _score_and_dP(q, qst, k, kst, dout, dost, v, vst, b, i, h, j, kv_head, head_dim, head_dim_v, acc):
    """(q_i . k_j, dO_i . v_j) in ACC, read straight from global memory (no tiles)."""
    s = acc(0)
    dp = acc(0)
    for d in range(head_dim):
        s += acc(q[_at(qst, b, i, h, d)]) * acc(k[_at(kst, b, j, kv_head, d)])
    for d in range(head_dim_v):
        dp += acc(dout[_at(dost, b, i, h, d)]) * acc(v[_at(vst, b, j, kv_head, d)])
    return s, dp


@cuda.jit
def _flash_bwd_dbias(q, qst, k, kst, v, vst, dout, dost, lse, lst, D, Dst, dbias, shape, batch, heads_q,
                    seqlen_q, seqlen_k, group, dims, scale, mask, mods, slopes, bias, allow):
    """dbias = dS = P ∘ (dP - D), the gradient of the final score (before the softcap's
    1 - tanh²), summed over the dimensions the bias broadcasts: one thread per element of the
    contiguous dbias (of `shape`, the bias's), which sums the pairs (b, h, i, j) its bias element
    is added to in a fixed order: no atomics, so the result does not depend on scheduling.
    A pair the band or the mask hides adds nothing, by selection (a NaN in the dout of a row that
    sees no key reaches no element); the loops over broadcast rows or keys take their ranges from
    the band helpers, so they visit only the band.

    Cost: every pair recomputes q_i . k_j and dO_i . v_j from global memory (2 head_dim FMAs, no
    tiles, no reuse through shared memory): as many FMAs as the dQ kernel's S and dP, less well
    fed. And a thread's pairs run one after another: a bias broadcast over most dimensions, e.g.
    (1, 1, 1, seqlen_k), gives each thread batch x heads_q x seqlen_q pairs and leaves the GPU
    mostly idle. Correct and deterministic first; a block per element (or tile) reducing its pairs
    in shared memory in a fixed order is the faster design.
    """
    acc = D.dtype.type
    head_dim, head_dim_v = dims
    nb, nh, nq, nk = shape
    e = cuda.blockIdx.x * PREP_THREADS + cuda.threadIdx.x
    if e < nb * nh * nq * nk:
        jb = e % nk
        ib = (e // nk) % nq
        hb = (e // (nk * nq)) % nh
        bb = e // (nk * nq * nh)
        # a dimension of size 1 is summed over; bb, hb, ib, jb are 0 there
        b_end = bb + 1 if nb > 1 else batch
        h_end = hb + 1 if nh > 1 else heads_q
        if nq > 1:
            i_start, i_end = ib, ib + 1
        elif nk > 1:
            i_start, i_end = _query_range(mask, jb, jb + 1, seqlen_q)
        else:
            i_start, i_end = _query_range(mask, 0, seqlen_k, seqlen_q)
        total = acc(0)
        for b in range(bb, b_end):
            for h in range(hb, h_end):
                kv_head = h // group
                for i in range(i_start, i_end):
                    lse_r = _row_lse(lse, lst, b, h, i, seqlen_q)
                    D_r = D[_at3(Dst, b, h, i)]
                    if nk > 1:
                        j_start, j_end = jb, jb + 1
                    else:
                        j_start, j_end = _key_range(mask, i, i + 1, seqlen_k)
                    for j in range(j_start, j_end):
                        s, dp = _score_and_dP(q, qst, k, kst, dout, dost, v, vst, b, i, h, j, kv_head,
                                              head_dim, head_dim_v, acc)
                        s, _, seen = _modify(s * scale, mods, slopes, bias, allow, mask, b, h, i, j,
                                             seqlen_q, seqlen_k, acc)
                        if seen:
                            z = _dropout_factor(mods[7], mods[8], b, h, i, j, acc)
                            total += _recomputed_p(s - lse_r, acc) * (dp * z - D_r)
        dbias[e] = total


@cuda.jit
def _flash_probs(q, qst, k, kst, lse, lst, P, Pst, rows,
                seqlen_q, seqlen_k, group, dims, scale, mask, mods, slopes, bias, allow):
    """P[b, h, r, j] = exp(S - lse) for query row rows[r] and key j: the forward's final score
    (_modify) against the forward's lse, 0 where the pair is hidden and in a row that sees no key
    (lse -inf). One thread per element of P, grid (len(rows) x seqlen_k / PREP_THREADS, heads_q,
    batch); q_i . k_j read straight from global memory, as attention_probs is for inspection.
    """
    acc = lse.dtype.type
    head_dim = dims[0]
    e = cuda.blockIdx.x * PREP_THREADS + cuda.threadIdx.x
    h = cuda.blockIdx.y
    b = cuda.blockIdx.z
    if e < rows.shape[0] * seqlen_k:
        r = e // seqlen_k
        j = e - r * seqlen_k
        i = rows[r]
        kv_head = h // group
        s = acc(0)
        for d in range(head_dim):
            s += acc(q[_at(qst, b, i, h, d)]) * acc(k[_at(kst, b, j, kv_head, d)])
        s, _, _ = _modify(s * scale, mods, slopes, bias, allow, mask, b, h, i, j, seqlen_q, seqlen_k, acc)
        P[_at(Pst, b, h, r, j)] = _recomputed_p(s - _row_lse(lse, lst, b, h, i, seqlen_q), acc)
