"""NumPy backend: the tiled FlashAttention algorithm on the CPU, BLAS matmuls per tile.

It runs the CUDA kernels' tile loop: query blocks of BLOCK_M rows against key
blocks of BLOCK_N keys, the key blocks no row of a query block can see skipped,
the same backward pre-pass and formulas. Names follow the FlashAttention-2
paper: Q_i, K_j, V_j the blocks, m and l the per-row reference and row sum, O
the unnormalised output accumulator. Its forward takes two CPU liberties, so
its m and l after a tile are not the kernels' and only the results agree, to
rounding: the row sum comes out of the PV matmul (V carries an extra column of
ones), and m is raised lazily, as in FlashAttention-4 (see L_MAX), not to the
running max of every tile. A tile then costs two matmuls and one elementwise
pass (exp).

Forward, per (batch, head, query block i):
    for each key block j that query block i can see:
        S = (Q_i * scale) K_jᵀ - m                  BLAS: [Q_i | -m] [K_j | 1]ᵀ once some m moved
        P = exp(S);   [P V_j | rowsum P] = P [V_j | 1]    BLAS
        rows whose rowsum P overflows, or whose l + rowsum P stays below L_MIN:
            raise their m by d, redo their P, scale their O and l by exp(-d)
        [O | l] += [P V_j | rowsum P]
    out_i = O / l;   lse_i = m + log l

Backward (FlashAttention-2), after the pre-pass D = rowsum(dO ∘ O):
    per (batch, kv head, key block j), over the query heads sharing it and the
    query blocks that can see key block j:
        P = exp(S - lse_i);   dV_j += Pᵀ dO_i;   dP = dO_i V_jᵀ
        dS = P ∘ (dP - D_i);  dQ_i += scale dS K_j;  dK_j += scale dSᵀ Q_i
    Unlike the kernels, which give dQ a pass of its own, dQ is accumulated
    here per worker partition and summed in a fixed order, so results are
    bitwise reproducible for a given thread count.

Nothing of size seqlen_q x seqlen_k is ever allocated: the largest temporaries
are BLOCK_M x BLOCK_N tiles, one set per worker thread. Work is spread over
(batch, head, query block) with a thread pool; NumPy releases the GIL in BLAS
and in the elementwise loops.
"""

from __future__ import annotations

import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from . import bfloat16_dtype

NAME = "numpy"
ARRAY_LIBRARIES = ("numpy",)
DTYPES = ("float16", "float32", "float64", "bfloat16")
MAX_HEAD_DIM = None


def grid_axes(p, backward):
    return []  # no CUDA grid on the CPU


@dataclass
class Config:
    """Tunables. BLOCK_M x BLOCK_N is the tile; NUM_THREADS the worker count (None: the
    environment's FLASHCUPY_NUM_THREADS, else one per core)."""

    BLOCK_M: int = 512
    BLOCK_N: int = 1024
    NUM_THREADS: int | None = None


config = Config()


def configure(*, block_m=None, block_n=None, num_threads=None) -> Config:
    """Change tile sizes or the thread count for later calls; returns the config."""
    for name, value in (("block_m", block_m), ("block_n", block_n), ("num_threads", num_threads)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if block_m is not None:
        config.BLOCK_M = block_m
    if block_n is not None:
        config.BLOCK_N = block_n
    if num_threads is not None:
        config.NUM_THREADS = num_threads
    return config


def unavailable_reason():
    return None


def allocate(like, shape, dtype, fill):
    return np.full(shape, fill, dtype=dtype)


# ----------------------------------------------------------------------------
# helpers shared by forward and backward


def _blocks(start: int, end: int, size: int):
    """[start, end) cut into (first, one past last) pieces of at most size."""
    return [(s, min(s + size, end)) for s in range(start, end, size)]


# Which keys a query sees, from p.causal and p.diagonal: query i sees key j iff not causal, or
# j <= i + diagonal. The loops take both ends of their ranges from these helpers and mask tiles
# through _visible, so a rule with more terms (a sliding window) changes these three, not the loops.


def _key_range(p, i0: int, i1: int) -> tuple:
    """Keys [start, end) that some query row of [i0, i1) sees."""
    if not p.causal:
        return 0, p.seqlen_k
    return 0, max(0, min(p.seqlen_k, i1 + p.diagonal))


def _query_range(p, j0: int, j1: int) -> tuple:
    """Query rows [start, end) that see some key of [j0, j1)."""
    if not p.causal:
        return 0, p.seqlen_q
    return max(0, min(p.seqlen_q, j0 - p.diagonal)), p.seqlen_q


def _visible(p, i, j):
    """Query i sees key j; i and j are numbers or index arrays that broadcast."""
    if not p.causal:
        return np.ones(np.broadcast(i, j).shape, dtype=bool)
    return j <= i + p.diagonal


def _mask_scores(S, p, i0: int, j0: int, fill) -> None:
    """Set S[r, c] = fill where query i0 + r does not see key j0 + c."""
    rows, cols = S.shape
    # the rule bounds j - i, which is largest at the tile's top-right corner and smallest at its
    # bottom-left one: both visible, every element is
    if _visible(p, i0, j0 + cols - 1) and _visible(p, i0 + rows - 1, j0):
        return
    S[~_visible(p, np.arange(i0, i0 + rows)[:, None], np.arange(j0, j0 + cols)[None, :])] = fill


@functools.lru_cache(maxsize=1)
def _blas_controller():
    """threadpoolctl's controller (a dependency, but a vendored install may lack it), else None."""
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:
        return None
    return ThreadpoolController()


def _threads_from_environment() -> int:
    text = os.environ.get("FLASHCUPY_NUM_THREADS", "").strip()
    if not text:
        return os.cpu_count() or 1
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"FLASHCUPY_NUM_THREADS must be a positive whole number of worker threads, "
                         f"got {text!r}")
    return int(text)


def worker_count() -> int:
    """Python worker threads used per call.

    Each worker's BLAS calls must run single-threaded, or the BLAS pool and
    ours oversubscribe the cores (measured here: 2.8x slower). Pinning BLAS
    needs threadpoolctl (a dependency); without it one worker runs and BLAS uses its own threads.
    """
    if _blas_controller() is None:
        return 1
    return config.NUM_THREADS or _threads_from_environment()


# One call's workers at a time, the others wait. BLAS's thread limit belongs to the process (and
# OpenBLAS's sgemm rounds differently with different thread counts), so calls that overlapped
# would each set and restore it under the others: later calls would find BLAS left pinned, and
# results would depend on what else was running. Each call already keeps every core busy.
_one_call_at_a_time = threading.Lock()


def _run(tasks):
    """Run callables on the worker pool; the first exception propagates."""
    n = min(worker_count(), len(tasks))
    if _blas_controller() is None:
        return [t() for t in tasks]
    # pinned on one worker too, so that a call's bits do not depend on its task count
    with _one_call_at_a_time, _blas_controller().limit(limits=1, user_api="blas"):
        if n <= 1:
            return [t() for t in tasks]
        with ThreadPoolExecutor(max_workers=n) as pool:
            return list(pool.map(lambda t: t(), tasks))


# ----------------------------------------------------------------------------
# forward


# Lazy rescaling (as in FlashAttention-4): exp() takes S - m with m a per-row reference that is
# raised only when a tile's row sum would leave [L_MIN, L_MAX], instead of the running max of
# every tile. The values stay far inside the accumulation dtype's range, relative precision is
# the same, and a tile costs one elementwise pass (exp) instead of three (max, subtract, exp).
L_MAX = 2.0**60
L_MIN = 2.0**-60


def _l_max(acc, v_max) -> float:
    """The largest row sum to let accumulate: L_MAX, or less when |v| is so large that
    O = sum_j p_j v_j could overflow the accumulation dtype (O <= l max|v| while l <= this)."""
    room = float(np.finfo(acc).max) / 4
    return min(L_MAX, room / v_max) if np.isfinite(v_max) and v_max * L_MAX > room else L_MAX


def _aligned_empty(shape, dtype, alignment=64):
    """An uninitialised C-contiguous array whose first element sits on a 64-byte boundary.

    NumPy's vectorised exp treats the elements before the first aligned one with its scalar loop,
    whose last bit can differ: with the buffer's address left to the allocator, results would
    depend on what else the process had allocated (calls from other threads, say).
    """
    dtype = np.dtype(dtype)
    raw = np.empty(int(np.prod(shape)) * dtype.itemsize + alignment, np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start:start + int(np.prod(shape)) * dtype.itemsize].view(dtype).reshape(shape)


def _forward_tile_loop(p, Q_i, K, V1, i0, out_i, lse_i) -> None:
    """Online softmax over the key blocks visible to query block Q_i (already scaled).

    V1 is [V | 1], so the PV matmul returns rowsum(P) as its last column. While every row's
    reference m is 0 the scores need no subtraction; once some row's m moves, the scores come
    from [Q_i | -m] [K | 1]ᵀ, which subtracts m inside the matmul. Either way a tile costs two
    matmuls and one elementwise pass (exp).
    """
    acc = p.acc_dtype
    rows, D = Q_i.shape
    l_max = _l_max(acc, float(np.abs(V1[:, :D]).max(initial=0.0)))
    m = np.zeros(rows, dtype=acc)  # the reference
    O1 = np.zeros((rows, D + 1), dtype=acc)  # [O | l]
    S_buf = _aligned_empty((rows, config.BLOCK_N), acc)
    Q1 = K1 = None  # [Q_i | -m] and [K | 1], made when some m first moves

    def scores(j0, j1, out):
        if Q1 is None:
            np.matmul(Q_i, K[j0:j1].T, out=out)
        else:
            np.matmul(Q1, K1[j0:j1].T, out=out)
        _mask_scores(out, p, i0, j0, -np.inf)
        return out

    # exp() overflowing to inf (or NaN from inf - inf), and log(0), are expected here: those
    # rows are redone
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        for j0, j1 in _blocks(*_key_range(p, i0, i0 + rows), config.BLOCK_N):
            S = scores(j0, j1, S_buf[:, : j1 - j0])  # S - m
            P = np.exp(S, out=S)
            O1_j = P @ V1[j0:j1]  # [P V_j | rowsum P]
            l_j = O1_j[:, D]
            # rows whose sum so far leaves [L_MIN, l_max] (so O could overflow) or is NaN
            l_new = O1[:, D] + l_j
            redo = np.nonzero(~(l_new <= l_max) | (l_new < L_MIN))[0]
            if redo.size:
                S_r = scores(j0, j1, S)[redo]  # exp() overwrote them; this is rare
                # the new reference, above m: this tile's max, or what came before if that is
                # larger (log l), so the redone row sums to at least 1. NaN stays NaN.
                d = np.maximum(S_r.max(axis=1), np.log(O1[redo, D]))
                d[d == -np.inf] = 0  # no key seen yet: keep m, as the kernels' m_ref (-inf - -inf is NaN)
                np.subtract(S_r, d[:, None], out=S_r)
                O1_j[redo] = np.exp(S_r, out=S_r) @ V1[j0:j1]
                # rescale what came before (nothing where l was 0: 0 * inf would be NaN); in
                # float64, where exp(-d) cannot overflow while the product still fits
                alpha = np.where(O1[redo, D] == 0, 0.0, np.exp(-d.astype(np.float64)))
                O1[redo] *= alpha[:, None]
                m[redo] += d
                if Q1 is None:
                    Q1 = np.hstack([Q_i, np.zeros((rows, 1), acc)])
                    K1 = np.hstack([K, np.ones((K.shape[0], 1), acc)])
                Q1[:, D] = -m
            O1 += O1_j

    O, l = O1[:, :-1], O1[:, -1]
    seen = l > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        np.divide(O, np.where(seen, l, 1)[:, None], out=O)
        O[~seen & ~np.isnan(l)] = 0  # fully masked rows: out 0 (NaN rows stay NaN)
        out_i[...] = O
        lse_i[...] = np.where(seen | np.isnan(l), m + np.log(l), -np.inf)


def _as_acc(x, acc):
    """x in the accumulation dtype: a view when it already is, else a converted copy."""
    return x if x.dtype == acc else x.astype(acc)


def _values(p, *arrays):
    """Views that read as p.dtype: uint16 carriers of bfloat16 bits become ml_dtypes bfloat16, the
    one place flashcupy needs ml_dtypes (a TypeError before any work where it is missing)."""
    values = bfloat16_dtype() if p.dtype == "bfloat16" else np.dtype(p.dtype)
    return [x.view(values) if x.dtype != values else x for x in arrays]


def forward(p, q, k, v):
    q, k, v = _values(p, q, k, v)
    acc = p.acc_dtype
    out = np.empty(q.shape, dtype=q.dtype)
    lse = np.empty(p.lse_shape, dtype=p.lse_dtype)

    def task(b, h, i0, i1):
        def run():
            kv_head = h // p.group
            end = _key_range(p, i0, i1)[1]  # K and V from key 0: the tile loop indexes them by key
            K = np.ascontiguousarray(k[b, :end, kv_head, :], dtype=acc)
            V1 = np.ones((end, p.head_dim + 1), dtype=acc)
            V1[:, :-1] = v[b, :end, kv_head, :]
            Q_i = q[b, i0:i1, h, :].astype(acc) * acc.type(p.scale)
            _forward_tile_loop(p, Q_i, K, V1, i0, out[b, i0:i1, h, :], lse[b, h, i0:i1])
        return run

    _run([task(b, h, i0, i1)
          for b in range(p.batch) for h in range(p.heads_q)
          for i0, i1 in _blocks(0, p.seqlen_q, config.BLOCK_M)])
    return out.view(p.carrier), lse


# ----------------------------------------------------------------------------
# backward


def _backward_tile_loop(p, j0, j1, K_j, V_j, heads, Q, dO, lse, D, dQ) -> tuple:
    """dK_j, dV_j for key block j over the given query heads; adds into dQ."""
    acc = p.acc_dtype
    scale = acc.type(p.scale)
    dK_j = np.zeros((j1 - j0, p.head_dim), dtype=acc)
    dV_j = np.zeros((j1 - j0, p.head_dim), dtype=acc)
    query_blocks = _blocks(*_query_range(p, j0, j1), config.BLOCK_M)
    for h in heads:
        for i0, i1 in query_blocks:
            Q_i, dO_i = Q[h][i0:i1], dO[h][i0:i1]
            # fully masked rows have lse = -inf; exp(S - inf) = 0 gives them P = 0
            lse_i = np.where(lse[h][i0:i1] == -np.inf, np.inf, lse[h][i0:i1])
            S = (Q_i * scale) @ K_j.T
            _mask_scores(S, p, i0, j0, -np.inf)
            np.subtract(S, lse_i[:, None], out=S)
            P = np.exp(S, out=S)
            dV_j += P.T @ dO_i
            dP = dO_i @ V_j.T
            dP -= D[h][i0:i1, None]
            dS = np.multiply(P, dP, out=dP)
            dS *= scale
            dQ[h][i0:i1] += dS @ K_j
            dK_j += dS.T @ Q_i
    return dK_j, dV_j


def backward(p, dout, q, k, v, out, lse):
    dout, q, k, v, out = _values(p, dout, q, k, v, out)
    acc = p.acc_dtype
    dq, dk, dv = (np.empty(x.shape, dtype=x.dtype) for x in (q, k, v))
    n_parts = max(1, min(worker_count(), p.batch * p.heads_kv * len(_blocks(0, p.seqlen_k, config.BLOCK_N))))

    for b in range(p.batch):
        # per-batch operands in the accumulation dtype, indexed by query head
        Q = [_as_acc(q[b, :, h, :], acc) for h in range(p.heads_q)]
        dO = [_as_acc(dout[b, :, h, :], acc) for h in range(p.heads_q)]
        # pre-pass: D_i = rowsum(dO_i ∘ O_i)
        D = [np.einsum("sd,sd->s", dO[h], _as_acc(out[b, :, h, :], acc)) for h in range(p.heads_q)]
        L = [lse[b, h] for h in range(p.heads_q)]
        work = [(kv_head, j0, j1) for kv_head in range(p.heads_kv)
                for j0, j1 in _blocks(0, p.seqlen_k, config.BLOCK_N)]

        def partition(part):
            def run():
                dQ = [np.zeros((p.seqlen_q, p.head_dim), dtype=acc) for _ in range(p.heads_q)]
                for kv_head, j0, j1 in work[part::n_parts]:
                    heads = range(kv_head * p.group, (kv_head + 1) * p.group)
                    K_j = _as_acc(k[b, j0:j1, kv_head, :], acc)
                    V_j = _as_acc(v[b, j0:j1, kv_head, :], acc)
                    dK_j, dV_j = _backward_tile_loop(p, j0, j1, K_j, V_j, heads, Q, dO, L, D, dQ)
                    dk[b, j0:j1, kv_head, :] = dK_j
                    dv[b, j0:j1, kv_head, :] = dV_j
                return dQ
            return run

        partial = _run([partition(i) for i in range(min(n_parts, len(work)))])
        for h in range(p.heads_q):  # fixed summation order: reproducible
            dq[b, :, h, :] = functools.reduce(np.add, (part[h] for part in partial))
    return dq.view(p.carrier), dk.view(p.carrier), dv.view(p.carrier)
