"""NumPy backend: the tiled FlashAttention algorithm on the CPU, BLAS matmuls per tile.

It runs the CUDA kernels' tile loop: query blocks of BLOCK_M rows against key
blocks of BLOCK_N keys, the key blocks no row of a query block can see skipped,
the same backward pre-pass and formulas. Names follow the FlashAttention-2
paper: Q_i, K_j, V_j the blocks, m and l the per-row reference and row sum, O
the unnormalised output accumulator. Its forward takes CPU liberties, so its m
and l after a tile are not the kernels' and only the results agree, to
rounding: the row sum comes out of the PV matmul (V carries an extra column of
ones), m is raised lazily, as in FlashAttention-4 (see L_MAX), not to the
running max of every tile, and the scores are scaled by log2(e) so that P is
an exp2 (NumPy's float32 exp2 runs twice as fast as its exp). A tile then costs
two matmuls and one elementwise pass.

Forward, per (batch, kv heads, query block i), the query heads of those kv heads stacked:
    for each key tile j that rows of block i see (_forward_tiles):
        S = (Q_i scale log2 e) K_jᵀ - m             BLAS: [Q_i | -m] [K_j | 1]ᵀ once some m moved
        P = exp2(S);   [P V_j | rowsum P] = P [V_j | 1]    BLAS
        rows whose rowsum P overflows, or whose l + rowsum P stays below L_MIN:
            raise their m by d, redo their P, scale their O and l by 2^-d
        [O | l] += [P V_j | rowsum P]
    out_i = O / l;   lse_i = ln 2 m + ln l

Backward (FlashAttention-2), after the pre-pass D = rowsum(dO ∘ O):
    per (batch, kv heads, key block j), over the query heads sharing them and the
    query rows that see key block j (_backward_tiles):
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
up to SCRATCH_KEEP_BYTES each (_Scratch).

Score modifiers (README, Semantics): a window narrows the band the tile plans
come from (p.band), so key blocks outside it are
never visited; softcap, ALiBi, bias and mask act on each tile's scores
(_Modifiers), which then have m subtracted in a pass of their own (in the
backward lse comes off in the matmul unless there is a softcap); dbias is dS
summed to the bias's shape (see backward). A window alone, at most NARROW_BAND
keys wide, takes tiles of a few rows that hold every key their rows see, many
to a matmul (_band_forward, _band_backward): its cost grows with seqlen x
window. Calls without modifiers run the code above unchanged. Work is
spread over a thread pool kept between calls; NumPy releases the GIL in BLAS and
in the elementwise loops.
"""

from __future__ import annotations

import functools
import math
import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from .._problem import LN2, LOG2E
from . import bfloat16_dtype

NAME = "numpy"
ARRAY_LIBRARIES = ("numpy",)
DTYPES = ("float16", "float32", "float64", "bfloat16")
MAX_HEAD_DIM = None
MODIFIERS = frozenset({"window", "softcap", "alibi_slopes", "bias", "mask"})  # every score modifier


def grid_axes(p, backward):
    return []  # no CUDA grid on the CPU


@dataclass
class Config:
    """Tunables. BLOCK_M x BLOCK_N is the tile (None: chosen per call by tile_sizes); NUM_THREADS
    the worker count (None: the environment's FLASHCUPY_NUM_THREADS, else one per core)."""

    BLOCK_M: int | None = None
    BLOCK_N: int | None = None
    NUM_THREADS: int | None = None


config = Config()


def configure(*, block_m=None, block_n=None, num_threads=None) -> Config:
    """Change tile sizes or the thread count for later calls (an argument left out, or None, keeps
    its value; set config.BLOCK_M = None to give the choice back to tile_sizes); returns the config."""
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


def tile_sizes(p, backward=False) -> tuple:
    """(BLOCK_M, BLOCK_N) for problem p: config's where set, else the measured choice.

    512 query rows by 512 keys: measured one core's QKᵀ and PV matmuls at 128 to 768 rows by 256
    to 2048 keys, D = 64 and 128, and they ran within 10 % of each other, best from 384 to 768
    rows by 512 to 768 keys (OpenBLAS packs each key tile once per query block, so more rows
    amortise it); more keys per tile also mean fewer Python-level steps. float64 too: its forward
    took 20 % less time with 512 rows than with 256 at S = 512, 9 % at 1024 and 3 % at 4096 (H = 8,
    D = 64, two threads, the two measured alternately), and its backward within 2 %. Causal
    diagonals are cut finer regardless (_staircase_step). With a handful of query rows per kv
    head (decoding, IN_PLACE_ROWS) a tile holds few scores however many keys it spans, and each
    step's overhead is what remains: 8192 keys (measured at 64k cached keys, D = 128: 168 ms
    against 225 with 512).
    """
    few_rows = not backward and p.seqlen_q * p.group <= IN_PLACE_ROWS
    return config.BLOCK_M or 512, config.BLOCK_N or (8192 if few_rows else 512)


def describe_tiles() -> str:
    """The tiles in words, for `python -m flashcupy info`."""
    if config.BLOCK_M and config.BLOCK_N:
        return f"{config.BLOCK_M}x{config.BLOCK_N} (configured)"
    tiles, decode = (tile_sizes(_SizeOnly(rows)) for rows in (1 << 30, 1))
    return f"{tiles[0]}x{tiles[1]}, diagonals cut finer, {decode[1]} keys a tile when decoding"


@dataclass
class _SizeOnly:
    """What tile_sizes reads of a Problem."""
    seqlen_q: int
    group: int = 1


def _band_step(width: int, group: int) -> int:
    """Query rows per tile of a bounded band `width` keys wide (_band_forward), whose matmuls stack
    `group` query heads: a tile of s rows spans s + width - 1 keys, s - 1 of them hidden from each
    row, so s trades that waste against the BLAS efficiency of matmuls of s x group rows. Measured
    at width 256, D = 64, one thread: 16 to 64 rows within 5 % of each other, 32 in the middle
    (11 % of a tile hidden; BLAS's QKᵀ of 32 rows ran at 120 GFLOP/s, 115 at 512).
    """
    return max(1, 32 // group)


def _staircase_step(block_m: int, heads: int, head_dim: int) -> int:
    """Query rows per tile along a causal diagonal, for tiles that stack `heads` query heads.

    Steps of s rows leave about block_m x s / 2 masked pairs per block and head (4 head_dim
    FLOPs each), and each of the block_m / s tiles costs some 20 us of Python and NumPy call
    overhead, what ~2 MFLOP of BLAS take: s = sqrt(1e6 / (heads x head_dim)) balances the two
    (measured at S = 512 to 4096: steps of 64 rows beat 128 and 256 on one and two threads).
    At least two steps per block, so the staircase is always exercised.
    """
    best = int(math.sqrt(1e6 / (max(1, heads) * max(1, head_dim))))
    return max(1, min(block_m // 2, -(-best // 16) * 16))


def unavailable_reason():
    return None


def allocate(like, shape, dtype, fill):
    return np.full(shape, fill, dtype=dtype)


# ----------------------------------------------------------------------------
# helpers shared by forward and backward


def _blocks(start: int, end: int, size: int):
    """[start, end) cut into (first, one past last) pieces of at most size, of about equal length
    (a last piece of a few rows or keys would cost as many BLAS calls as a full one)."""
    n = end - start
    if n <= 0:
        return []
    step = -(-n // -(-n // size))  # ceil(n / number of pieces)
    if step > 16:
        step = min(size, -(-step // 16) * 16)  # whole SIMD vectors
    return [(s, min(s + step, end)) for s in range(start, end, step)]


# Which keys a query sees is p.band's to say (flashcupy/_problem.py, Band): the loops take both ends
# of their ranges from it and mask tiles through it, so the rule changes there, not here. A user's
# mask is no band: it is applied per tile, on top (_Modifiers).


def _mask_scores(S, p, i0: int, j0: int, fill, group: int = 1, hidden=False) -> None:
    """Set S[..., r * group + h, c] = fill where query i0 + r does not see key j0 + c (S a
    contiguous stack of tiles whose rows interleave `group` heads, as _HeadMap stacks them);
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
    for c0, c1 in ((0, all0), (all1, cols)) if all0 < all1 else ((0, cols),):
        if c0 < c1:
            np.copyto(S4[..., c0:c1], fill, where=hidden[:, None, c0:c1])


def _forward_tiles(p, i0: int, i1: int, step: int, masks=None) -> list:
    """(r0, r1, j0, j1, hidden) tiles that cover every pair of a query row of [i0, i1) and a key
    it sees, each pair once, hidden the tile's mask (p.band.hidden): full-height tiles over the keys
    every row sees, then the rest (the causal diagonal) in a staircase of tiles of `step` rows,
    so that little of their area is masked. Keys every row sees but fewer than a step go to the
    staircase too. masks: a dict shared by the calls of one pass, so equal masks are kept once."""
    block_n = tile_sizes(p)[1]
    start, end = p.band.key_range(i0, i1)
    all0, all1 = p.band.keys_seen_by_all(i0, i1)
    if all1 - all0 < min(step, i1 - i0):
        all0 = all1 = start
    tiles = [(i0, i1, j0, j1) for j0, j1 in _blocks(all0, all1, block_n)]
    for r0, r1 in _blocks(i0, i1, step):
        seen0, seen1 = p.band.key_range(r0, r1)
        for lo, hi in ((max(seen0, start), min(seen1, all0)), (max(seen0, all1), min(seen1, end))):
            tiles += [(r0, r1, j0, j1) for j0, j1 in _blocks(lo, hi, block_n)]
    return [(r0, r1, j0, j1, _tile_mask(p, r0, r1, j0, j1, masks)) for r0, r1, j0, j1 in tiles]


def _backward_tiles(p, j0: int, j1: int, step: int, masks=None) -> list:
    """(i0, i1, c0, c1, hidden) tiles that cover every pair of a key of [j0, j1) and a query row
    that sees it, each pair once: BLOCK_M-row tiles over the rows that see every key of the
    block, then a staircase of `step`-row tiles along the diagonal, each over the keys its rows
    see."""
    block_m = tile_sizes(p, backward=True)[0]
    start, end = p.band.query_range(j0, j1)
    all0, all1 = p.band.queries_seeing_all(j0, j1)
    if all1 - all0 < step:
        all0 = all1 = start
    tiles = [(i0, i1, j0, j1) for i0, i1 in _blocks(all0, all1, block_m)]
    for lo, hi in ((start, all0), (all1, end)):
        for r0, r1 in _blocks(lo, hi, step):
            seen0, seen1 = p.band.key_range(r0, r1)
            if max(seen0, j0) < min(seen1, j1):
                tiles.append((r0, r1, max(seen0, j0), min(seen1, j1)))
    return [(i0, i1, c0, c1, _tile_mask(p, i0, i1, c0, c1, masks)) for i0, i1, c0, c1 in tiles]


def _tile_mask(p, i0: int, i1: int, j0: int, j1: int, masks):
    """p.band.hidden(i0, i1, j0, j1), made once per height, width and j0 - i0 when masks (a dict shared
    by the calls of one pass) is given: the rule depends on j - i alone, so the diagonal tiles of
    every block share a few masks (one per tile would take O(seqlen x BLOCK_M) bytes, and making
    each its own took a tenth of a narrow window's forward)."""
    if masks is None:
        return p.band.hidden(i0, i1, j0, j1)
    key = (i1 - i0, j1 - j0, j0 - i0)
    if key not in masks:
        masks[key] = p.band.hidden(i0, i1, j0, j1)
    return masks[key]


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


class _Scratch:
    """Named buffers reused from tile to tile, task to task and call to call instead of allocated
    for each: one per thread that runs tasks (_thread_scratch), and one for the arrays a call's
    workers share (_call_scratch). Each starts on a 64-byte boundary (see _aligned_empty), so the
    bits never depend on which worker ran a task.

    Kept between calls because a fresh buffer of more than glibc's mmap threshold is fresh pages,
    each faulted in and zeroed by the kernel on first touch: at S = 512 to 1024 (H = 8, D = 64, two
    threads) calls were 10-30 % slower in some runs than with the buffers kept, run to run, as the
    allocator's thresholds moved. _one_call drops what is larger than SCRATCH_KEEP_BYTES after
    each call, so long sequences, whose faults cost little next to their work, hold no memory."""

    def __init__(self):
        self._buffers = {}

    def take(self, name, shape, dtype, fill=None):
        """A C-contiguous array of this shape, the same memory each time: uninitialised, or fill."""
        n = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.dtype != dtype or buf.size < n:
            buf = self._buffers[name] = _aligned_empty((n,), dtype)
        out = buf[:n].reshape(shape)
        if fill is not None:
            out.fill(fill)
        return out

    def trim(self, keep_bytes: int) -> None:
        self._buffers = {k: b for k, b in self._buffers.items() if b.nbytes <= keep_bytes}


SCRATCH_KEEP_BYTES = 8 << 20  # a scratch buffer up to this size outlives its call (see _Scratch)
_scratch_of_thread = threading.local()
_scratches = weakref.WeakSet()  # every thread's _Scratch: a thread's goes with it
_call_scratch = _Scratch()  # buffers the workers of a call share; calls take turns (_one_call)


def _thread_scratch() -> _Scratch:
    scratch = getattr(_scratch_of_thread, "scratch", None)
    if scratch is None:
        scratch = _scratch_of_thread.scratch = _Scratch()
        _scratches.add(scratch)
    return scratch


def _one_call(fn):
    """A backend entry point: calls take turns (see _one_call_at_a_time), and the scratch buffers
    larger than SCRATCH_KEEP_BYTES are dropped when the call ends."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        with _one_call_at_a_time:
            try:
                return fn(*args, **kwargs)
            finally:
                for scratch in (_call_scratch, *list(_scratches)):
                    scratch.trim(SCRATCH_KEEP_BYTES)
    return call


class _Shared:
    """Operands that several tasks read (a kv head's K and V): made by the first that takes them,
    dropped when the last of `users` releases them, so only the heads in flight take memory."""

    def __init__(self, make, users: int):
        self._make, self._users, self._value = make, users, None
        self._lock = threading.Lock()

    def take(self):
        with self._lock:
            if self._value is None:
                self._value = self._make()
            return self._value

    def release(self):
        with self._lock:
            self._users -= 1
            if self._users == 0:
                self._value = None


# One call's workers at a time, the others wait (_one_call). BLAS's thread limit belongs to the
# process (and OpenBLAS's sgemm rounds differently with different thread counts), so calls that
# overlapped would each set and restore it under the others: later calls would find BLAS left
# pinned, and results would depend on what else was running; and the pool's threads keep their
# scratch buffers from call to call. Each call already keeps every core busy. Reentrant: _run
# takes it again for each batch of tasks.
_one_call_at_a_time = threading.RLock()
_pool = None  # (pid, size, ThreadPoolExecutor): kept between calls, started again after a fork


def _executor(size: int) -> ThreadPoolExecutor:
    global _pool
    if _pool is None or _pool[:2] != (os.getpid(), size):
        if _pool is not None and _pool[0] == os.getpid():
            _pool[2].shutdown(wait=False)
        _pool = (os.getpid(), size, ThreadPoolExecutor(max_workers=size, thread_name_prefix="flashcupy-numpy"))
    return _pool[2]


def _run(tasks):
    """Run task(scratch) for each task on the calling thread and the worker pool, results in task
    order; the first exception propagates. Tasks are handed out in order as workers free up (a
    task's result must not depend on which worker runs it), and each worker thread keeps its
    _Scratch from call to call. The pool's threads live on between calls (starting one took
    0.14 ms here, more under load, and a call is a few ms at S = 512)."""
    n = min(worker_count(), len(tasks))
    if _blas_controller() is None:
        scratch = _thread_scratch()
        return [t(scratch) for t in tasks]
    # pinned on one worker too, so that a call's bits do not depend on its task count
    with _one_call_at_a_time, _blas_controller().limit(limits=1, user_api="blas"):
        if n <= 1:
            scratch = _thread_scratch()
            return [t(scratch) for t in tasks]
        results = [None] * len(tasks)
        pending = iter(range(len(tasks)))
        lock = threading.Lock()
        failed = []

        def worker():
            scratch = _thread_scratch()
            while not failed:
                with lock:
                    i = next(pending, None)
                if i is None:
                    return
                try:
                    results[i] = tasks[i](scratch)
                except BaseException:
                    failed.append(True)
                    raise

        pool = _executor(n - 1)
        helpers = [pool.submit(worker) for _ in range(n - 1)]
        try:
            worker()
        finally:
            for h in helpers:
                h.exception()  # wait for every helper before BLAS is unpinned
        for h in helpers:
            h.result()
        return results


# ----------------------------------------------------------------------------
# forward


# Lazy rescaling (as in FlashAttention-4): exp() takes S - m with m a per-row reference that is
# raised only when a tile's row sum would leave [L_MIN, L_MAX], instead of the running max of
# every tile. The values stay far inside the accumulation dtype's range, relative precision is
# the same, and a tile costs one elementwise pass (exp) instead of three (max, subtract, exp).
L_MAX = 2.0**60
L_MIN = 2.0**-60


def _base2_scale(p):
    """scale * log2(e) in the accumulation dtype: what Q or K carries so that scores come out in
    base 2 and P = exp2(S - m)."""
    return p.acc_dtype.type(p.scale * LOG2E)


def _l_max(acc, v_max) -> float:
    """The largest row sum to let accumulate: L_MAX, or less when |v| is so large that
    O = sum_j p_j v_j could overflow the accumulation dtype (O <= l max|v| while l <= this)."""
    room = float(np.finfo(acc).max) / 4
    return min(L_MAX, room / v_max) if np.isfinite(v_max) and v_max * L_MAX > room else L_MAX


def _forward_block(p, Q, Kt, V1, i0, i1, l_max, tiles, scratch, modify=None, out=None) -> tuple:
    """Online softmax of query block [i0, i1) over every key it sees, for a stack of kv heads.

    Q is (kv heads, rows x group, D) and Kt is Kᵀ; one of them (Kt, unless K is read where it
    lies) carries scale * log2(e), so that the scores come out in base 2 and P = exp2(S - m)
    (NumPy's float32 exp2 runs twice as fast as its exp; m counts in base 2 too). A kv head's query heads are interleaved row by row (_HeadMap), so a tile's rows
    are one slice for every kv head and each kv head's K is packed for BLAS once per tile. V1 is
    [V | 1], so the PV matmul returns rowsum(P) as its last column. Kt is a transposed view of
    K copied as (kv heads, keys, D): a contiguous Kᵀ let BLAS run QKᵀ about 10 % faster, but
    making it cost more than that (S = 512 and 4096, D = 64: 5-9 % slower overall). With few query rows per key (decoding) Kt and
    V1 are instead views of K and V where they lie (see forward), and each tile takes the textbook
    eager step (_eager_tile), whose extra passes over S are cheap there. While every row's reference m is 0 the scores
    need no subtraction; once some row's m moves, the scores come from [Q | -m] [K | 1]ᵀ, which
    subtracts m inside the matmul. Either way a tile costs two matmuls
    and one elementwise pass (exp2). Returns (O, lse), stacked as Q, lse in natural log.

    modify(S, rows, keys) (_Modifiers.apply; None without softcap, ALiBi, bias or mask) changes
    the scores before m is subtracted, which then takes an elementwise pass of its own.

    The first tile a row meets writes its [P V_j | rowsum P] straight into [O | l] (nothing came
    before it to add to). out: where O / l goes, as (kv heads, rows, group, D) (a view of the
    caller's output), else into O itself.
    """
    acc = p.acc_dtype
    heads, M, D = Q.shape
    g = p.group
    m = np.zeros((heads, M), dtype=acc)  # the reference
    O1 = scratch.take("O1", (heads, M, D + 1), acc, fill=0)  # [O | l]
    Q1 = K1t = None  # [Q | -m] and [K | 1]ᵀ, made when some m first moves
    plain_v = V1.shape[2] == D  # V itself (a strided view) rather than [V | 1]
    if plain_v:
        m[...] = -np.inf  # the running max itself (eager, below)
    moved = False  # with modify: some m moved, so scores subtract m
    fresh_from = 0  # stack rows from here on have met no tile yet (tiles go down the rows, see _forward_tiles)

    # with modify: the stack rows of the current tile that see none of its keys (mask or band), or
    # None. The tile leaves them as they were, so they need no redo, which would recompute the
    # whole tile: a row a mask hides entirely would otherwise cost every tile of its block twice
    dead_rows = [None]

    def scores(a, z, j0, j1, hidden, out, dead=None, masked=True):
        if modify is not None:
            np.matmul(Q[:, a:z], Kt[:, :, j0:j1], out=out)
            filled = modify(out, slice(i0 + a // g, i0 + z // g), slice(j0, j1), dead=dead)
            if dead is not None:
                if hidden is not None:  # rows the band hides from every key of the tile
                    band = hidden.all(axis=1)[None, :, None]
                    dead[...] = (dead | band) if filled else band
                    filled = True
                dead_rows[0] = dead if filled else None
            if moved:
                np.subtract(out, m[:, a:z, None], out=out)
        elif Q1 is None:
            np.matmul(Q[:, a:z], Kt[:, :, j0:j1], out=out)
        else:
            np.matmul(Q1[:, a:z], K1t[:, :, j0:j1], out=out)
        if masked:
            _mask_scores(out, p, i0 + a // g, j0, -np.inf, group=g, hidden=hidden)
        return out

    # the fast check: an upper bound on every row's l so far, and whether every row's l is known
    # to be at least L_MIN; a tile that might break either takes the exact, per-row check
    l_bound, above_min = 0.0, False
    # exp2() overflowing to inf (or NaN from inf - inf), and log(0), are expected here: those
    # rows are redone
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        for r0, r1, j0, j1, hidden in tiles:
            a, z = (r0 - i0) * g, (r1 - i0) * g  # the tile's rows within the stack
            dead = None if modify is None else scratch.take("dead", (heads, (z - a) // g, g), np.bool_)
            # S - m; the band's hidden pairs are zeroed in P rather than set to -inf in S: NumPy's
            # float32 exp2 takes a scalar path, some 10x slower, for SIMD vectors holding -inf
            S = scores(a, z, j0, j1, hidden, scratch.take("S", (heads, z - a, j1 - j0), acc), dead, masked=plain_v)
            if plain_v:
                _eager_tile(S, V1[:, j0:j1], m[:, a:z], O1[:, a:z], scratch)
                continue
            P = np.exp2(S, out=S)
            _mask_scores(P, p, r0, j0, 0, group=g, hidden=hidden)
            fresh = a >= fresh_from  # these rows' [O | l] is still 0: the tile writes it, not adds to it
            fresh_from = max(fresh_from, z)
            O1_j = O1[:, a:z] if fresh else scratch.take("O1_j", (heads, z - a, D + 1), acc)
            np.matmul(P, V1[:, j0:j1], out=O1_j)
            l_j_max = float(np.maximum.reduce(O1_j[:, :, D], axis=None))
            # every row's l stays at least L_MIN if it was, or if this tile alone brings that much
            # (staircase and band tiles are the first a row meets, so the block's l never is)
            if ((above_min or float(np.minimum.reduce(O1_j[:, :, D], axis=None)) >= L_MIN)
                    and l_bound + l_j_max <= l_max):  # False for NaN
                if not fresh:
                    O1[:, a:z] += O1_j
                l_bound += l_j_max
                continue
            # rows whose sum so far leaves [L_MIN, l_max] (so O could overflow) or is NaN
            l_new = O1_j[:, :, D] if fresh else O1[:, a:z, D] + O1_j[:, :, D]
            redo = ~(l_new <= l_max) | (l_new < L_MIN)
            if dead is not None and dead_rows[0] is not None:
                redo &= ~dead_rows[0].reshape(heads, z - a)
            kk, rr = np.nonzero(redo)
            if kk.size:
                S_r = _aligned_empty((kk.size, j1 - j0), acc)  # exp2's bits depend on alignment
                S_r[...] = scores(a, z, j0, j1, hidden, S)[kk, rr]  # exp2() overwrote them; this is rare
                # the new reference, above m: this tile's max, or what came before if that is
                # larger (log2 l), so the redone row sums to at least 1. NaN stays NaN. (Fresh
                # rows have nothing before: their [O | l] holds this tile's overflowed sums.)
                d = S_r.max(axis=1)
                if not fresh:
                    d = np.maximum(d, np.log2(O1[kk, a + rr, D]))
                d[d == -np.inf] = 0  # no key seen yet: keep m, as the kernels' m_ref (-inf - -inf is NaN)
                np.subtract(S_r, d[:, None], out=S_r)
                np.exp2(S_r, out=S_r)
                for kv in np.unique(kk):
                    this = kk == kv
                    O1_j[kv, rr[this]] = S_r[this] @ V1[kv, j0:j1]
                if not fresh:
                    # rescale what came before (nothing where l was 0: 0 * inf would be NaN); in
                    # float64, where exp2(-d) cannot overflow while the product still fits
                    alpha = np.where(O1[kk, a + rr, D] == 0, 0.0, np.exp2(-d.astype(np.float64)))
                    O1[kk, a + rr] *= alpha[:, None]
                m[kk, a + rr] += d
                if modify is not None:
                    moved = True  # scores() subtracts m: a modified score cannot come out of [Q | -m] [K | 1]ᵀ
                else:
                    if Q1 is None:
                        Q1 = np.concatenate([Q, np.zeros((heads, M, 1), acc)], axis=2)
                        K1t = np.concatenate([Kt, np.ones((heads, 1, Kt.shape[2]), acc)], axis=1)
                    Q1[:, :, D] = -m
            if not fresh:
                O1[:, a:z] += O1_j
            l_all = O1[:, :, D]
            l_bound = float(np.maximum.reduce(l_all, axis=None))
            above_min = float(np.minimum.reduce(l_all, axis=None)) >= L_MIN

    if out is None:
        return _normalised(O1[..., :D], O1[..., D], m)
    shape = out.shape[:3]
    O1 = O1.reshape(*shape, D + 1)
    _, lse = _normalised(O1[..., :D], O1[..., D], m.reshape(shape), out)
    return out, lse.reshape(heads, M)


def _normalised(O, l, m, out=None) -> tuple:
    """(O / l, lse) from O, l and the reference m (base 2): lse = ln 2 m + ln l; a row that saw
    no key (l = 0) gets out 0 and lse -inf, a NaN row stays NaN. O / l goes into out (O's shape),
    else into O."""
    acc = O.dtype
    out = O if out is None else out
    seen = l > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = m * acc.type(LN2) + np.log(l)
        if seen.all():
            return np.divide(O, l[..., None], out=out), lse
        np.divide(O, np.where(seen, l, 1)[..., None], out=out)
        out[~seen & ~np.isnan(l)] = 0  # fully masked rows: out 0 (NaN rows stay NaN)
        return out, np.where(seen | np.isnan(l), lse, -np.inf)


def _eager_tile(S, V_j, m, O1, scratch) -> None:
    """One tile of the textbook online softmax, for V read where it lies (decoding): m (the
    running max, base 2) moves to the tile's max, what came before is rescaled by exp2(m_old -
    m_new), and [O | l] += [P V_j | rowsum P]. With few rows per key its passes over S cost little
    next to reading K and V, and P <= 1 bounds O by seqlen_k max|v| without a pass over V."""
    heads, M, _ = S.shape
    D = V_j.shape[2]
    m_new = np.maximum(m, np.maximum.reduce(S, axis=2))
    m_safe = np.where(m_new == -np.inf, 0, m_new)  # no key seen yet: -inf - -inf would be NaN
    P = np.exp2(np.subtract(S, m_safe[:, :, None], out=S), out=S)
    O1_j = scratch.take("O1_j", (heads, M, D + 1), S.dtype)
    np.matmul(P, V_j, out=O1_j[:, :, :D])
    np.add.reduce(P, axis=2, out=O1_j[:, :, D])
    O1 *= np.exp2(m - m_safe)[:, :, None]  # 0 while m was -inf
    O1 += O1_j
    m[...] = m_new


def _as_acc(x, acc):
    """x in the accumulation dtype: a view when it already is, else a converted copy."""
    return x if x.dtype == acc else x.astype(acc)


def _values(p, *arrays):
    """Views that read as p.dtype: uint16 carriers of bfloat16 bits become ml_dtypes bfloat16, the
    one place flashcupy needs ml_dtypes (a TypeError before any work where it is missing)."""
    values = bfloat16_dtype() if p.dtype == "bfloat16" else np.dtype(p.dtype)
    return [x.view(values) if x.dtype != values else x for x in arrays]


class _HeadMap:
    """Which query heads read which kv head, worked out once per call. Stacks put a kv head's query
    heads row by row: row r of its h-th query head is row r * group + h of the stack."""

    def __init__(self, p):
        groups = [[] for _ in range(p.heads_kv)]
        for h in range(p.heads_q):
            kv_head = h // p.group
            groups[kv_head].append(h)
        self.index = np.array(groups, dtype=np.intp).reshape(p.heads_kv, -1)  # (kv heads, group)
        self.group = self.index.shape[1]
        self.consecutive = self.index.ravel().tolist() == list(range(self.index.size))

    def read(self, x, c0: int, c1: int):
        """x (rows, all query heads, ...) as (kv heads c0..c1, rows, group, ...): a view where the
        heads are consecutive (the usual mapping), else a copy."""
        g = self.group
        picked = x[:, c0 * g:c1 * g] if self.consecutive else x[:, self.index[c0:c1].ravel()]
        split = picked.reshape(x.shape[0], c1 - c0, g, *x.shape[2:])
        return split.transpose(1, 0, *range(2, split.ndim))

    def unstack_into(self, dst, c0: int, c1: int, stacked) -> None:
        """dst (rows, all query heads, ...) takes the values of a stack (kv heads c0..c1, rows x group, ...)."""
        values = stacked.reshape(c1 - c0, -1, self.group, *stacked.shape[2:])
        if self.consecutive:
            self.read(dst, c0, c1)[...] = values
        else:
            dst[:, self.index[c0:c1].ravel()] = np.moveaxis(values, 0, 1).reshape(
                values.shape[1], -1, *stacked.shape[2:])


class _Modifiers:
    """A call's softcap, ALiBi, bias and mask (README, Semantics), applied to a stack of score
    tiles (as _HeadMap stacks them) in the base-2 units the tiles use, scores times log2(e):
    s' = c' tanh(s / c') with c' = softcap log2(e), then - slope log2(e) |i + diagonal - j|, then
    + bias log2(e), then -inf where the mask is False. The window is no modifier here: it is part
    of the band (p.band), so key blocks outside it are never visited. Broadcast
    bias and mask are read through zero-stride views a tile at a time, never materialised whole.
    Made only for calls that have one of these; plain calls never reach this code."""

    def __init__(self, p, heads: _HeadMap):
        self.p, self.heads, acc = p, heads, p.acc_dtype
        self.acc = acc
        full = (p.batch, p.heads_q, p.seqlen_q, p.seqlen_k)
        self.cap = None if p.softcap is None else acc.type(p.softcap * LOG2E)
        self.slopes = None
        if p.alibi_slopes is not None:  # (batch, heads_q), times log2(e), rounded once
            slopes = np.asarray(p.alibi_slopes, dtype=np.float64) * LOG2E
            self.slopes = np.broadcast_to(slopes.astype(acc), (p.batch, p.heads_q))
        self.bias = None
        if p.bias is not None:
            bias = _values(p, p.bias)[0] if p.bias.dtype == p.carrier else p.bias  # else float32
            self.bias = np.broadcast_to(bias, full)
        self.mask = None if p.mask is None else np.broadcast_to(p.mask, full)
        # a bias of the full shape: each element of dbias takes the dS of one pair, from one tile
        # (the tile plans cover each pair once), so add_dbias may write it rather than add to it
        self.dbias_once = p.bias is not None and tuple(p.bias.shape) == full

    def _heads(self, x, b, c0, c1, rows, cols):
        """x (batch, heads_q, seqlen_q, seqlen_k) for kv heads c0..c1, as (kv heads, rows, group,
        keys): the layout of a stack of score tiles seen as 4-D. A view where it can be."""
        g = self.heads.group
        if self.heads.consecutive:
            t = x[b, c0 * g:c1 * g][:, rows, cols]
        else:
            t = x[b][:, rows, cols][self.heads.index[c0:c1].ravel()]
        return t.reshape(c1 - c0, g, t.shape[1], t.shape[2]).transpose(0, 2, 1, 3)

    def apply(self, S, rows, cols, T=None, *, b, c0, c1, scratch, dead=None) -> bool:
        """Modify S (kv heads c0..c1, len(rows) x group, keys cols), the base-2 scores of batch b,
        in place. rows: a slice or an index array of query rows; cols: a slice. T: where to keep
        tanh(s / c) for the backward (softcap only). dead: a bool (kv heads, rows, group) array
        to fill with the rows the mask hides from every key of the tile; returns whether it did
        (False without a mask)."""
        acc, g = self.acc, self.heads.group
        heads, C = S.shape[0], S.shape[2]
        R = S.shape[1] // g
        S4 = S.reshape(heads, R, g, C)
        if self.cap is not None:
            t = S if T is None else T
            np.divide(S, self.cap, out=t)
            np.tanh(t, out=t)
            np.multiply(t, self.cap, out=S)
        if self.slopes is not None:
            i = np.arange(rows.start, rows.stop) if isinstance(rows, slice) else rows
            distance = np.abs((i + self.p.diagonal)[:, None] - np.arange(cols.start, cols.stop)[None, :]).astype(acc)
            slopes = self.slopes[b][self.heads.index[c0:c1]]  # (kv heads, group)
            alibi = np.multiply(slopes[:, None, :, None], distance[None, :, None, :],
                                out=scratch.take("alibi", S4.shape, acc))
            np.subtract(S4, alibi, out=S4)
        if self.bias is not None:
            bias = np.multiply(self._heads(self.bias, b, c0, c1, rows, cols), acc.type(LOG2E),
                               out=scratch.take("bias", S4.shape, acc), dtype=acc)
            np.add(S4, bias, out=S4)
        if self.mask is not None:
            hide = np.logical_not(self._heads(self.mask, b, c0, c1, rows, cols),
                                  out=scratch.take("hide", S4.shape, np.bool_))
            np.copyto(S4, -np.inf, where=hide)
            if dead is not None:
                np.logical_and.reduce(hide, axis=3, out=dead)
                return True
        return False

    def add_dbias(self, target, dS, rows: slice, cols: slice, *, b, c0, c1) -> None:
        """target (the bias's shape, in the accumulation dtype) += dS (kv heads c0..c1, rows x
        group, keys cols: the gradient of the final scores of batch b), summed over the
        dimensions the bias broadcasts."""
        Bb, Hb, Sqb, Skb = target.shape
        g = self.heads.group
        x = dS.reshape(dS.shape[0], -1, g, dS.shape[2])
        t = target[b if Bb > 1 else 0]
        if Sqb == 1:
            x, rows = x.sum(axis=1, keepdims=True), slice(0, 1)
        if Skb == 1:
            x, cols = x.sum(axis=3, keepdims=True), slice(0, 1)
        if Hb == 1:
            t[0, rows, cols] += x.sum(axis=(0, 2))
        elif self.heads.consecutive:
            region = t[c0 * g:c1 * g, rows, cols]
            region = region.reshape(c1 - c0, g, *region.shape[1:]).transpose(0, 2, 1, 3)
            if self.dbias_once:  # nothing else adds here: no read of the zeros (or pages) first
                region[...] = x
            else:
                region += x
        else:
            for kv in range(c1 - c0):
                for h in range(g):
                    t[self.heads.index[c0 + kv, h], rows, cols] += x[kv, :, h]


def _heads_per_task(p, units: int, unit_flops: float, unit_volume: int, volume: int) -> int:
    """kv heads stacked into one task (units: the tasks with one kv head each, of unit_flops and a
    score tile of unit_volume elements): as many as a score tile of about `volume` elements holds,
    in groups of equal size, fewer only where the tasks would not spread evenly over the workers (a
    task count that is a multiple of the worker count, or at least four tasks a worker), and at
    least MIN_TASK_FLOPS of work per task, so that its Python-level overhead (~0.1 ms) stays
    small. Each task also copies its operands and normalises its rows, so fewer, larger tasks win
    wherever they still balance:
    S = 512, H = 8, D = 64 on two threads took 4.55 ms as eight one-head tasks (the old rule, four
    tasks a worker) and 3.77 ms as two four-head ones."""
    top = max(1, min(p.heads_kv, volume // max(1, unit_volume)))
    workers = worker_count()
    per_group = max(1, units // p.heads_kv)  # tasks per group of stacked kv heads
    stacked = 1
    for s in range(top, 0, -1):  # groups of equal size only: one of 5 and one of 3 heads would not balance
        tasks = p.heads_kv // s * per_group
        if p.heads_kv % s == 0 and (workers == 1 or tasks % workers == 0 or tasks >= 4 * workers):
            stacked = s
            break
    by_work = -(-MIN_TASK_FLOPS // max(1.0, unit_flops))
    return int(max(stacked, min(top, by_work)))


MIN_TASK_FLOPS = 5e7

# Query rows per kv head (seqlen_q x group) up to which the forward reads K and V where they lie
# instead of copying them into BLAS-friendly Kᵀ and [V | 1]: a copy reads and writes every key
# once, as much memory traffic as a decoding step's whole work
IN_PLACE_ROWS = 32


# Bounded bands up to this many keys wide take _band_forward, whose tiles each hold every key their
# rows see; wider ones the tile loop above, whose full-height tiles then cover most of the band
NARROW_BAND = 2048


def _band_forward(p, q, k, v, out, lse, width: int):
    """The forward of a band at most NARROW_BAND keys wide (a sliding window), without other modifiers.

    Tiles of `step` query rows by the step + width - 1 keys those rows see (_band_step): every row
    meets all its keys in one tile, so a tile is the whole softmax of its rows and nothing
    accumulates from tile to tile. The tiles of a block are the same shape and lie `step` keys
    apart, so one matmul over strided views of K and V computes many at once, and a tile's
    hidden pairs (its two corner triangles) are the same for every tile: P is multiplied by one 0/1
    mask. The per-tile Python overhead of _forward_block, which took a third of a 256-key window's
    time, is gone, and so is any -inf in exp2's input.

    The tiles are computed transposed, Sᵀ = K_j Q_iᵀ and O = (Pᵀ)ᵀ V_j: BLAS ran those at 153 and
    118 GFLOP/s on one core (32 rows, 287 keys, D = 64) against 130 and 104 for S = Q_i K_jᵀ from a
    contiguous Kᵀ and P [V | 1], and it reads K and V where they lie, rows H x D apart (61 GFLOP/s
    for Q_i K_jᵀ from K's rows as they lie). Nothing is copied but each tile's Q_iᵀ, scaled by
    scale * log2(e) (_band_queries), and K and V of the blocks at the sequence's two ends or of
    another dtype (_band_keys: zeros past the keys, masked out of P). l comes from a matmul of P
    with ones (ten times faster than NumPy's add.reduce along the keys). Each matmul takes up to
    TILE_VOLUME scores, and O / l goes into out from a buffer still in cache.

    Scores are not shifted (m = 0): a row whose sum leaves [L_MIN, l_max], or is NaN (an overflow
    times the mask's 0), is redone exactly: its visible scores, their max as m. Rows that see no key
    at all are left out and keep out 0, lse -inf.
    """
    acc = p.acc_dtype
    g, D, heads_kv = p.group, p.head_dim, p.heads_kv
    left = p.band.left
    step = _band_step(width, g)
    n = step + width - 1  # keys of a tile
    first, last = p.band.query_range(0, p.seqlen_k)  # the rows that see some key
    end = p.band.key_range(0, p.seqlen_q)[1]  # keys at or past it no row sees
    out[:, :first] = 0
    out[:, last:] = 0
    lse[:, :, :first] = -np.inf
    lse[:, :, last:] = -np.inf
    blocks = _blocks(first, last, tile_sizes(p)[0])
    units = p.batch * heads_kv * len(blocks)
    unit_volume = g * step * n
    stacked = _heads_per_task(p, units, p.flops() / max(1, units), unit_volume, TILE_VOLUME[acc.itemsize])
    heads = _HeadMap(p)
    # which pairs of a tile its rows see: the rule depends on j - i alone, so one mask serves every
    # tile (row r of a tile sees its keys r .. r + width - 1), (keys, stack rows) as Sᵀ: its rows
    # repeated for the group, so that the multiply runs along whole stack rows (against a (rows, 1)
    # mask it ran 4 times slower than exp2 at a group of 4)
    keep = np.repeat(p.band.visible(np.arange(step)[None, :], p.diagonal - left + np.arange(n)[:, None]), g, axis=1).astype(acc)
    # tiles per matmul: S up to TILE_VOLUME (its Python-level overhead weighs more than L2 here: at
    # S = 16384, window 256, 8 heads stacked, 10 to 16 tiles a matmul took 71 ms, 3 (S within L2) 77)
    per_call = max(1, TILE_VOLUME[acc.itemsize] // (stacked * unit_volume))
    qk_scale = _base2_scale(p)
    # O straight into out, normalised there, where a tile's stack rows are rows of out a fixed stride apart
    in_out = out.dtype == acc and heads.consecutive and (g == 1 or heads_kv == 1)
    in_place = k.dtype == acc  # K and V read where they lie, (kv heads, keys, D) views

    def task(b, c0, c1, i0, i1):
        def run(scratch):
            T = -(-(i1 - i0) // step)
            Qt = _band_queries(heads.read(q[b, i0:i1], c0, c1), T, step, qk_scale, acc, scratch)
            k0 = i0 + p.diagonal - left  # the first tile's first key; k1: past the last tile's last
            k1 = k0 + (T - 1) * step + n
            lo, hi = min(max(k0, 0), end), min(max(k1, 0), end)  # the keys among them that some row sees
            inside = 0 <= k0 and k1 <= p.seqlen_k  # keys past end, which only padding rows see, are real
            if in_place and inside:
                Kw, Vw = (_windows(x[b, :, c0:c1].transpose(1, 0, 2), k0, T, step, n, axis=1) for x in (k, v))
                v_part = v[b, lo:hi, c0:c1]
            else:  # at the sequence's ends, or of another dtype: copies, zero past the keys
                K, V = (_band_keys(x[b, lo:hi, c0:c1], lo - k0, k1 - k0, name, acc, scratch)
                        for x, name in ((k, "K"), (v, "V")))
                Kw, Vw = (_windows(x, 0, T, step, n, axis=1) for x in (K, V))
                v_part = V[:, lo - k0:hi - k0]  # of the copy: NumPy's float16 max and min crawl
            tile_keep = keep
            if not inside:  # zero keys count in l unless masked: a mask per tile, (tiles, keys, stack rows)
                j = k0 + step * np.arange(T)[:, None] + np.arange(n)[None, :]
                tile_keep = keep * ((j >= lo) & (j < hi)).astype(acc)[:, :, None]
            v_max = max(float(np.maximum.reduce(v_part, axis=None, initial=0)),
                        -float(np.minimum.reduce(v_part, axis=None, initial=0)))

            def finish(u0, u1, O, l, m):  # O / l and lse of tiles u0 .. u1 - 1 into out and lse
                r0, r1 = i0 + u0 * step, i0 + u1 * step
                if in_out and r1 <= i1:  # straight into out, viewed as (kv heads, tiles, stack rows, D)
                    rows = out[b, r0:r1, c0 * g:c1 * g].reshape(u1 - u0, step, c1 - c0, g, D)
                    _, L = _normalised(O, l, m, rows.transpose(2, 0, 1, 3, 4).reshape(O.shape))
                else:
                    r1 = min(r1, i1)
                    O, L = _normalised(O, l, m)
                    heads.unstack_into(out[b, r0:r1], c0, c1, O.reshape(c1 - c0, -1, D)[:, :(r1 - r0) * g])
                heads.unstack_into(lse[b].T[r0:r1], c0, c1, L.reshape(c1 - c0, -1)[:, :(r1 - r0) * g])

            def visible(u, r):  # which keys of tile u stack rows r see
                return _band_visible(p, i0 + u * step, k0 + u * step, r // g, n, end)

            _band_tiles(Qt, Kw, Vw, tile_keep, per_call, _l_max(acc, v_max), scratch, visible, finish)
        return run

    _run([task(b, c0, c1, i0, i1) for b in range(p.batch) for c0, c1 in _blocks(0, heads_kv, stacked) for i0, i1 in blocks])
    return out.view(p.carrier), lse


def _band_queries(Q, T: int, step: int, scale, acc, scratch):
    """Q (kv heads, rows, group, D) times scale as the tiles' Q_iᵀ, (kv heads, T, D, step x group)
    in the accumulation dtype, the stack rows of each tile (row by row, a kv head's query heads
    interleaved as _HeadMap stacks them) along the last axis, zeros past the last row."""
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


def _band_keys(x, a: int, length: int, name: str, acc, scratch, scale=None):
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


def _windows(x, start: int, count: int, step: int, width: int, axis: int):
    """Read-only view of `count` windows of x along `axis`, `width` long, the first at `start` and
    each `step` after the last, stacked on a new axis 1: (kv heads, count, ...) with the window
    in place of `axis`."""
    view = np.moveaxis(x, axis, 1)[:, start:]
    strides = (view.strides[0], step * view.strides[1]) + view.strides[1:]
    shape = (view.shape[0], count, width) + view.shape[2:]
    windows = np.lib.stride_tricks.as_strided(view, shape, strides, writeable=False)
    return np.moveaxis(windows, 2, axis + 1)


def _band_visible(p, i0: int, j0: int, rows, keys: int, end: int):
    """(len(rows), keys) bool: which of the keys j0 .. j0 + keys - 1 the query rows i0 + rows see,
    by the band rule (p.band) and among the keys there are (below end)."""
    j = j0 + np.arange(keys)[None, :]
    return p.band.visible(i0 + np.asarray(rows)[:, None], j) & (j >= 0) & (j < end)


def _band_tiles(Qt, Kw, Vw, keep, per_call, l_max, scratch, visible, finish) -> None:
    """The tiles of a band block, each holding every key its rows see (_band_forward), per_call to a
    matmul: Qt (kv heads, tiles, D, rows) their Q_iᵀ, Kw and Vw their keys' K and V windows
    (kv heads, tiles, keys, D), keep the 0/1 mask of the pairs a tile's rows see, (keys, rows)
    with rows stacked group by group as in Qt, or one such mask per tile. visible(tile, stack
    rows) gives the bool mask of those rows' pairs, for the rows redone. finish(u0, u1, O, l, m)
    takes tiles u0 .. u1 - 1 while they are in cache: O (kv heads, tiles, rows, D), l and the
    reference m (kv heads, tiles, rows), to be normalised (_normalised)."""
    acc = Qt.dtype
    heads, T, D, M = Qt.shape
    n = Kw.shape[2]
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
            np.matmul(ones, St, out=l[:, :, None])  # l = rowsum P: BLAS ran it 10 times faster than add.reduce
            np.matmul(St.swapaxes(2, 3), Vw[:, u0:u1], out=O)
        m = scratch.take("m", (heads, u1 - u0, M), acc, fill=0)
        redo = ~((l >= L_MIN) & (l <= l_max))
        if redo.any():
            kk, uu, rr = np.nonzero(redo)
            for kv, u in sorted(set(zip(kk.tolist(), uu.tolist()))):
                rows = rr[(kk == kv) & (uu == u)]
                S_r = _aligned_empty((rows.size, n), acc)  # exp2's bits depend on alignment
                np.matmul(Qt[kv, u0 + u][:, rows].T, Kw[kv, u0 + u].T, out=S_r)
                S_r[~visible(u0 + u, rows)] = -np.inf
                with np.errstate(invalid="ignore"):
                    d = S_r.max(axis=1)  # the new reference; NaN stays NaN
                d[d == -np.inf] = 0  # no key seen: l stays 0
                np.subtract(S_r, d[:, None], out=S_r)
                np.exp2(S_r, out=S_r)
                O[kv, u, rows] = S_r @ Vw[kv, u0 + u]
                l[kv, u, rows] = S_r.sum(axis=1)
                m[kv, u, rows] = d
        finish(u0, u1, O, l, m)


WRITES_INTO = True  # forward and backward write into given arrays (into=): XLA's buffers for flashcupy.jax


@_one_call
def forward(p, q, k, v, into=None):
    q, k, v = _values(p, q, k, v)
    acc = p.acc_dtype
    if into is None:
        out, lse = np.empty(q.shape, dtype=q.dtype), np.empty(p.lse_shape, dtype=p.lse_dtype)
    else:
        out, lse = _values(p, into[0])[0], into[1]
    width = p.band.width
    if (width is not None and width <= NARROW_BAND and p.modifiers == {"window"}
            and p.seqlen_q * p.group > IN_PLACE_ROWS):
        return _band_forward(p, q, k, v, out, lse, width)
    block_m, block_n = tile_sizes(p)
    blocks = _blocks(0, p.seqlen_q, block_m)
    if p.causal:
        blocks.reverse()  # the heaviest first, so the last tasks of a call are short
    unit_flops = p.flops() / (p.batch * p.heads_kv * len(blocks))
    unit_volume = p.group * min(block_m, p.seqlen_q) * min(block_n, p.seqlen_k)
    stacked = _heads_per_task(p, p.batch * p.heads_kv * len(blocks), unit_flops, unit_volume, TILE_VOLUME[acc.itemsize])
    step = _staircase_step(block_m, stacked * p.group, p.head_dim)
    masks = {}
    tiles = {(i0, i1): _forward_tiles(p, i0, i1, step, masks) for i0, i1 in blocks}
    kv_groups = _blocks(0, p.heads_kv, stacked)
    end = p.band.key_range(0, p.seqlen_q)[1]  # every key some query sees lies below this
    heads = _HeadMap(p)
    mods = _Modifiers(p, heads) if p.modifiers - {"window"} else None
    in_place = p.seqlen_q * p.group <= IN_PLACE_ROWS and k.dtype == acc and v.dtype == acc
    qk_scale = _base2_scale(p)  # carried by Kᵀ, or by Q where K is read in place

    def kv_operands(b, c0, c1):
        # Kᵀ (kv heads, D, keys) and [V | 1] (kv heads, keys, D + 1) from key 0, in the
        # accumulation dtype; made by the first task of these kv heads to run. With few query
        # rows per key (decoding: a copy would cost more than the matmuls it speeds up), views of
        # K and V where they lie, and max |v| from V itself
        if in_place:  # the eager softmax needs no bound on |v| (see _eager_tile)
            return k[b, :end, c0:c1, :].transpose(1, 2, 0), v[b, :end, c0:c1, :].transpose(1, 0, 2), None
        # K copied as (kv heads, keys, D), which keeps D's rows whole (a copy straight into
        # (kv heads, D, keys) gathers 4-byte elements across rows: 5x slower), Kᵀ a view of it.
        # The copy carries scale log2(e), so that Q can be read where it lies (see task)
        K = np.empty((c1 - c0, end, p.head_dim), dtype=acc)
        np.multiply(k[b, :end, c0:c1, :].transpose(1, 0, 2), qk_scale, out=K, dtype=acc)
        Kt = K.transpose(0, 2, 1)
        V1 = np.empty((c1 - c0, end, p.head_dim + 1), dtype=acc)
        V1[:, :, :-1] = v[b, :end, c0:c1, :].transpose(1, 0, 2)
        V1[:, :, -1] = 1
        # max |v| (the ones never matter: _l_max only lowers its bound for |v| far above 1)
        v_max = max(float(np.maximum.reduce(V1, axis=None)), -float(np.minimum.reduce(V1, axis=None)))
        return Kt, V1, _l_max(acc, v_max)

    def query_stack(b, i0, i1, c0, c1, scratch):
        # Q_i of kv heads c0..c1 as the stack (kv heads, rows x group, D) in the accumulation
        # dtype. Kᵀ carries scale log2(e), so the stack is q's rows where they lie when it can be
        # a view (one query head per kv head, or a single kv head: BLAS reads rows any distance
        # apart), else a copy; with K read in place the copy takes the scale instead
        rows = heads.read(q[b, i0:i1], c0, c1)  # (kv heads, rows, group, D)
        if not in_place and q.dtype == acc and (p.group == 1 or p.heads_kv == 1):
            return rows[:, :, 0] if p.group == 1 else rows.reshape(c1 - c0, (i1 - i0) * p.group, p.head_dim)
        Q = scratch.take("Q", (c1 - c0, (i1 - i0) * p.group, p.head_dim), acc)
        if in_place:
            np.multiply(rows, qk_scale, out=Q.reshape(rows.shape), dtype=acc)
        else:
            Q.reshape(rows.shape)[...] = rows
        return Q

    shared = {(b, c0): _Shared(functools.partial(kv_operands, b, c0, c1), len(blocks))
              for b in range(p.batch) for c0, c1 in kv_groups}

    def task(b, c0, c1, i0, i1):
        def run(scratch):
            Kt, V1, l_max = shared[b, c0].take()
            try:
                Q = query_stack(b, i0, i1, c0, c1, scratch)
                modify = None if mods is None else functools.partial(mods.apply, b=b, c0=c0, c1=c1, scratch=scratch)
                if out.dtype == acc:  # O / l written straight into out, a view
                    _, L = _forward_block(p, Q, Kt, V1, i0, i1, l_max, tiles[i0, i1], scratch, modify,
                                          heads.read(out[b, i0:i1], c0, c1))
                else:
                    O, L = _forward_block(p, Q, Kt, V1, i0, i1, l_max, tiles[i0, i1], scratch, modify)
                    heads.unstack_into(out[b, i0:i1], c0, c1, O)
                heads.unstack_into(lse[b].T[i0:i1], c0, c1, L)
            finally:
                shared[b, c0].release()
        return run

    # tasks of the same kv heads run one after another, so few kv heads' operands exist at a time
    _run([task(b, c0, c1, i0, i1)
          for b in range(p.batch) for c0, c1 in kv_groups for i0, i1 in blocks])
    return out.view(p.carrier), lse


# Elements of a score tile with all the heads of a task stacked: 4 MiB, past a core's L2 but
# measured no slower than a tile that fits, and it amortises the per-call overhead of small heads
TILE_VOLUME = {4: 1 << 20, 8: 1 << 19}
# The backward's, for each of P and dS: a quarter of the forward's, so both fit a 2 MiB L2 together
# (S = 512 to 4096, H = 8, D = 64, two threads, buffers kept between calls: 0-4 % faster than half
# of it, which held two heads of 512 x 512 in the 4 MiB of the pair)
BACKWARD_TILE_VOLUME = {4: 1 << 18, 8: 1 << 17}


# ----------------------------------------------------------------------------
# backward


def _backward_item(p, j0, j1, tiles, K, V, Q1, dO1, dQ, scratch, modify=None, dbias=None) -> tuple:
    """Key block [j0, j1) of a stack of kv heads (K, V: (kv heads, keys, D)) against their query
    heads: returns (dK_j, dV_j) and adds into dQ. Everything is stacked as in _forward_block.

    Q1 = [scale log2(e) Q | -log2(e) lse] and dO1 = [dO | -D] against [K_j | 1] and [V_j | 1] give
    (S - lse) in base 2 and dP - D out of the matmuls, and P = exp2 of the first; scale K_j carries
    the scale into dQ, and Q1 carries scale log2(e) into dK (corrected once per item). A tile costs
    five matmuls and two elementwise passes (exp2, P ∘ (dP - D)).

    With modify (_Modifiers.apply, for softcap, ALiBi, bias or mask), S - lse comes out of the
    matmul as above and is modified (ALiBi, bias and mask only add), or with a softcap S comes
    from Q_i K_jᵀ, is modified, then has lse subtracted; dbias(dS, rows, keys) takes dS, the
    gradient of the final score; a softcap then multiplies dS by 1 - tanh² before dQ and dK.
    """
    acc = p.acc_dtype
    heads, w, D = K.shape
    g = p.group
    scale = acc.type(p.scale)
    # [K_j | 1]ᵀ and [V_j | 1]ᵀ, transposed views of copies that keep the rows: BLAS ran S from a
    # contiguous Kᵀ 4 % faster, but gathering one took 5x the row-preserving copy (0.04 ms against
    # 0.007 at 512 keys, D = 64), more than the matmul gained
    K1t = scratch.take("K1", (heads, w, D + 1), acc).transpose(0, 2, 1)
    K1t[:, :D] = K.transpose(0, 2, 1)
    K1t[:, D] = 1
    V1t = scratch.take("V1", (heads, w, D + 1), acc).transpose(0, 2, 1)
    V1t[:, :D] = V.transpose(0, 2, 1)
    V1t[:, D] = 1
    K_scaled = np.multiply(K, scale, out=scratch.take("K_scaled", K.shape, acc))
    dK_j = scratch.take("dK_j", (heads, w, D), acc, fill=0)
    dV_j = scratch.take("dV_j", (heads, w, D), acc, fill=0)
    for i0, i1, c0, c1, hidden in tiles:
        a, z = i0 * g, i1 * g  # the tile's rows within the stacks
        x, y = c0 - j0, c1 - j0  # its keys within the block
        Q1_i, dO1_i = Q1[:, a:z], dO1[:, a:z]
        T = None
        if modify is None:
            S = np.matmul(Q1_i, K1t[:, :, x:y], out=scratch.take("S", (heads, z - a, y - x), acc))
        elif p.softcap is None:  # ALiBi, bias and mask add to the score: lse can come off first, in the matmul
            with np.errstate(invalid="ignore"):  # -lse is -inf in a row a mask leaves no key (0 x inf in BLAS's padding)
                S = np.matmul(Q1_i, K1t[:, :, x:y], out=scratch.take("S", (heads, z - a, y - x), acc))
            modify(S, slice(i0, i1), slice(c0, c1), T)
        else:
            S = np.matmul(Q1_i[:, :, :D], K1t[:, :D, x:y], out=scratch.take("S", (heads, z - a, y - x), acc))
            if p.softcap is not None:
                T = scratch.take("T", S.shape, acc)
            modify(S, slice(i0, i1), slice(c0, c1), T)
            np.add(S, Q1_i[:, :, D:], out=S)  # - lse log2(e)
        with np.errstate(over="ignore"):  # a hidden pair may overflow: it is zeroed next
            P = np.exp2(S, out=S)  # hidden pairs zeroed after it, not -inf before it: see _forward_block
        _mask_scores(P, p, i0, c0, 0, group=g, hidden=hidden)
        kd = scratch.take("kd", (heads, y - x, D), acc)
        dV_j[:, x:y] += np.matmul(P.transpose(0, 2, 1), dO1_i[:, :, :D], out=kd)
        dS = np.matmul(dO1_i, V1t[:, :, x:y], out=scratch.take("dS", (heads, z - a, y - x), acc))
        np.multiply(P, dS, out=dS)
        if dbias is not None:
            dbias(dS, slice(i0, i1), slice(c0, c1))
        if T is not None:  # the gradient of q.k scale, before the softcap: dS (1 - tanh²)
            np.square(T, out=T)
            np.subtract(1, T, out=T)
            np.multiply(dS, T, out=dS)
        dQ[:, a:z] += np.matmul(dS, K_scaled[:, x:y], out=scratch.take("qd", (heads, z - a, D), acc))
        dK_j[:, x:y] += np.matmul(dS.transpose(0, 2, 1), Q1_i[:, :, :D], out=kd)
    dK_j *= acc.type(LN2)  # Q1 holds scale log2(e) Q
    return dK_j, dV_j


def _band_backward(p, dout, q, k, v, out, lse, dq, dk, dv, width: int):
    """The backward of a band at most NARROW_BAND keys wide, without other modifiers: the tiles of
    _band_forward (step query rows by the NW chunks of step keys their rows see), many per matmul.

    A query tile holds every key its rows see, so its dQ comes whole out of one matmul. A chunk of
    keys is seen by the rows of NW consecutive tiles, and their P and dS are laid out so that the
    chunk's columns of those NW tiles form one matrix: tile u starts step elements further than its
    rows would put it (`skew`), which cancels the chunk's shift of step keys from tile to tile, so
    dV and dK of a chunk also come whole out of one matmul each, with the NW tiles' rows as the
    inner dimension (no accumulation from tile to tile, nothing added twice). A task takes the
    query tiles [u0, u1) of some kv heads, owns their dQ and the dK, dV of the chunks whose last
    tile is among them, and recomputes the NW - 1 tiles before u0 (tasks span many tiles), so
    tasks write disjoint parts of dq, dk and dv and the result does not depend on their order.
    """
    acc = p.acc_dtype
    g, D, heads_kv = p.group, p.head_dim, p.heads_kv
    left = p.band.left
    step = _band_step(width, g)
    M = step * g  # stack rows of a tile
    first, last = p.band.query_range(0, p.seqlen_k)  # the rows that see some key; the others get dq 0
    end = p.band.key_range(0, p.seqlen_q)[1]
    dq[:, :first] = 0
    dq[:, last:] = 0
    T = -(-(last - first) // step)  # query tiles
    if T <= 0:
        dk[...] = 0
        dv[...] = 0
        return
    A = -(-left // step)  # tile u sees key chunks u - A .. u - A + NW - 1
    NW = A + 1 + -(-(width - 1 - left) // step)
    L = NW * step  # keys of a tile
    columns = (T - 1 + NW) * step  # key chunks -A .. T - A + NW - 2; key j in column base + j
    base = A * step - first - p.diagonal
    j0, j1 = max(0, -base), min(end, columns - base)  # the keys in columns
    dk[:, :j0] = 0
    dk[:, j1:] = 0
    dv[:, :j0] = 0
    dv[:, j1:] = 0
    heads = _HeadMap(p)
    hidden = ~p.band.visible(np.arange(step)[:, None], p.diagonal - A * step + np.arange(L)[None, :])
    some = np.flatnonzero(hidden.any(axis=0))  # the columns some row does not see: a prefix and a suffix
    pieces = [(int(x[0]), int(x[-1]) + 1) for x in np.split(some, np.flatnonzero(np.diff(some) > 1) + 1) if x.size]
    hidden = hidden[:, None, :]  # against (rows, group, keys)
    workers = worker_count()
    stacked = max(1, min(heads_kv, TILE_VOLUME[acc.itemsize] // 2 // (2 * 2 * NW * M * L)))  # P, dS of 2 NW tiles: L2
    kv_groups = _blocks(0, heads_kv, stacked)
    # tasks per kv group: enough to spread, few enough that recomputing the NW - 1 tiles before each
    # stays small, and each task's operands within SCRATCH_KEEP_BYTES, so that they are kept from
    # task to task and call to call (fresh, they cost a page fault per page: 13 of 208 ms at S = 16384)
    most = max(4 * NW, SCRATCH_KEEP_BYTES // (stacked * M * (D + 1) * acc.itemsize) - NW)
    ranges = max(1, min(-(-4 * workers // len(kv_groups)), T // (4 * NW)), -(-T // most))
    tile_ranges = _blocks(0, T, -(-T // ranges))
    U = 2 * NW  # tiles computed per matmul: at S = 16384, window 256, NW took 192 ms, 2 NW to 4 NW 183-185

    def task(b, c0, c1, u0, u1):
        def run(scratch):
            h = c1 - c0
            w1 = u1 if u1 < T else T + NW - 1  # the last task also owns the chunks past the last tile
            f0 = u0 - (NW - 1)  # the first tile it computes: the NW - 1 before u0 only for their P and dS
            nt = w1 - f0
            Q_tiles, dO_tiles, K_tiles, V_tiles, Ks_tiles, Q_chunks, dO_chunks = _band_backward_operands(
                p, scratch, b, c0, c1, f0, nt, first, last, base, (j0, j1), (step, M, NW, L), heads, dout, q, k, v, out, lse)
            capacity = NW - 1 + U
            size = capacity * (M * L + step) + NW * step
            P_buf = scratch.take("P", (h, size), acc)
            dS_buf = scratch.take("dS", (h, size), acc)
            P_all, dS_all = (_skewed(x, capacity, M, L, step) for x in (P_buf, dS_buf))
            # the same as (heads, tiles, M L), for the elementwise passes: NumPy ran them 2 to 4
            # times slower over the 4-D view (it did not merge a tile's rows into one loop)
            P_flat, dS_flat = (x.reshape(h, capacity, M * L) for x in (P_all, dS_all))
            dQ = scratch.take("dQ", (h, (u1 - u0) * M, D), acc)
            dK = scratch.take("dK", (h, (w1 - u0) * step, D), acc)
            dV = scratch.take("dV", (h, (w1 - u0) * step, D), acc)
            # the key chunks of the tiles at places x .. x + NW - 1 (_chunks), what they meet, where they go
            chunks = [(_chunks(P_buf, capacity - NW + 1, NW, M, L, step), dO_chunks, dV),
                      (_chunks(dS_buf, capacity - NW + 1, NW, M, L, step), Q_chunks, dK)]
            t = f0  # the next tile to compute; the operands count tiles from f0, chunks from u0
            t0, filled = t, 0  # the tile at the buffers' first place, and how many are there
            while t < w1:
                n = min(U, capacity - filled, w1 - t)
                Pt, dSt = P_all[:, filled:filled + n], dS_all[:, filled:filled + n]
                a, z = max(t, 0), min(t + n, T)  # tiles outside [0, T) hold no rows: P and dS 0
                if a > t:
                    Pt[:, :a - t] = 0
                    dSt[:, :a - t] = 0
                if z < t + n:
                    Pt[:, max(z, a) - t:] = 0
                    dSt[:, max(z, a) - t:] = 0
                if a < z:
                    Pa, dSa = Pt[:, a - t:z - t], dSt[:, a - t:z - t]
                    span = slice(filled + a - t, filled + z - t)  # the same tiles in P_flat, dS_flat
                    np.matmul(Q_tiles[:, a - f0:z - f0], K_tiles[:, a - f0:z - f0], out=Pa)
                    with np.errstate(over="ignore"):  # a hidden pair may overflow: it is zeroed next
                        np.exp2(P_flat[:, span], out=P_flat[:, span])
                    P5 = Pa.reshape(h, z - a, step, g, L)
                    for x0, x1 in pieces:
                        np.copyto(P5[..., x0:x1], 0, where=hidden[..., x0:x1])
                    np.matmul(dO_tiles[:, a - f0:z - f0], V_tiles[:, a - f0:z - f0], out=dSa)
                    np.multiply(dS_flat[:, span], P_flat[:, span], out=dS_flat[:, span])
                    o0 = max(a, u0)  # dQ of the tiles this task owns
                    if o0 < z:
                        np.matmul(dSa[:, o0 - a:], Ks_tiles[:, o0 - f0:z - f0],
                                  out=dQ[:, (o0 - u0) * M:(z - u0) * M].reshape(h, z - o0, M, D))
                # the key chunks whose last tile came now and that this task owns: chunk of tile
                # w is w - A, its NW tiles w - NW + 1 .. w, here from place w - NW + 1 - t0 on
                o0, o1 = max(t, u0), t + n
                if o0 < o1:
                    x = o0 - NW + 1 - t0
                    for view, operand, grad in chunks:
                        np.matmul(view[:, x:x + o1 - o0].transpose(0, 1, 3, 2), operand[:, o0 - u0:o1 - u0],
                                  out=grad[:, (o0 - u0) * step:(o1 - u0) * step].reshape(h, o1 - o0, step, D))
                t += n
                filled += n
                if filled == capacity:  # keep the last NW - 1 tiles, at the first places (one block)
                    kept = (NW - 1) * (M * L + step)
                    for x in (P_buf, dS_buf):
                        np.copyto(x[:, :kept], x[:, U * (M * L + step):U * (M * L + step) + kept])
                    t0 += capacity - (NW - 1)
                    filled = NW - 1
            # dQ rows of the tiles u0 .. u1 (query rows from first + u0 step), dK and dV of
            # the chunks u0 - A .. w1 - A - 1 (keys from column u0 step, key column - base)
            r0, r1 = first + u0 * step, min(last, first + u1 * step)
            heads.unstack_into(dq[b, r0:r1], c0, c1, dQ[:, :(r1 - r0) * g])
            k0, k1 = u0 * step - base, w1 * step - base
            y0, y1 = max(k0, j0), min(k1, j1)
            if y0 < y1:
                np.multiply(dK[:, y0 - k0:y1 - k0].transpose(1, 0, 2), acc.type(LN2), out=dk[b, y0:y1, c0:c1])  # Q1 holds scale log2(e) Q
                dv[b, y0:y1, c0:c1] = dV[:, y0 - k0:y1 - k0].transpose(1, 0, 2)
        return run

    _run([task(b, c0, c1, u0, u1) for b in range(p.batch) for c0, c1 in kv_groups for u0, u1 in tile_ranges])


def _band_backward_operands(p, scratch, b, c0, c1, f0, nt, first, last, base, keys, shape, heads, dout, q, k, v,
                            out, lse):
    """A _band_backward task's operands, for kv heads c0 .. c1 of batch b and the nt tiles from f0 on
    (tiles before 0 or past the last are zero rows): views of tile t at t - f0 of Q1 = [scale
    log2(e) Q | -log2(e) lse] and dO1 = [dO | -D] (its rows), K1t = [K | 1]ᵀ and V1t = [V | 1]ᵀ and Ks
    = scale K (its keys), and at w - u0 the NW tiles' Q and dO rows that meet the key chunk of tile w
    (u0 = f0 + NW - 1), all in the task's scratch buffers, zero outside the rows and keys: made per
    task, they stay within SCRATCH_KEEP_BYTES and are reused rather than page-faulted in each call.
    Key j lies in column base + j, tile t's keys are columns t step .. t step + L - 1; keys =
    (j0, j1), the keys that some row sees."""
    acc, g, D = p.acc_dtype, p.group, p.head_dim
    step, M, NW, L = shape
    h = c1 - c0
    T = -(-(last - first) // step)
    pitch = -(-(D + 1) // 16) * 16  # rows padded to whole 64-byte lines: 2-3 % faster than D + 1 at D = 64
    Q1 = scratch.take("Q1", (h, nt * M, pitch), acc)[:, :, :D + 1]
    dO1 = scratch.take("dO1", (h, nt * M, pitch), acc)[:, :, :D + 1]
    a, z = max(f0, 0), min(f0 + nt, T)  # the tiles with rows
    r0, r1 = first + a * step, min(last, first + z * step)  # their query rows
    x0, x1 = (a - f0) * M, (a - f0) * M + (r1 - r0) * g  # those rows' places
    for x in (Q1, dO1):
        x[:, :x0] = 0
        x[:, x1:] = 0
    if r0 < r1:
        shape3 = (h, r1 - r0, g)
        np.multiply(heads.read(q[b, r0:r1], c0, c1), _base2_scale(p), out=Q1[:, x0:x1, :D].reshape(*shape3, D),
                    dtype=acc)
        Q1[:, x0:x1, D].reshape(shape3)[...] = heads.read(lse[b].T[r0:r1], c0, c1) * acc.type(-LOG2E)
        dO = dO1[:, x0:x1, :D].reshape(*shape3, D)
        dO[...] = heads.read(dout[b, r0:r1], c0, c1)
        O = _as_acc(heads.read(out[b, r0:r1], c0, c1), acc)
        np.negative(np.einsum("csgd,csgd->csg", dO, O), out=dO1[:, x0:x1, D].reshape(shape3))
    columns = (nt - 1) * step + L  # from column f0 step on
    ld = -(-columns // 64) * 64 + 16  # rows not a multiple of 4 KiB apart (see _band_forward)
    K1t = scratch.take("K1t", (h, D + 1, ld), acc)[:, :, :columns]
    V1t = scratch.take("V1t", (h, D + 1, ld), acc)[:, :, :columns]
    origin = f0 * step - base  # the key in the first column
    y0, y1 = max(origin, keys[0]), min(origin + columns, keys[1])
    if y0 >= y1:  # none of the keys
        y0 = y1 = origin
    for z0, z1 in ((0, y0 - origin), (y1 - origin, columns)):  # the zeros around the keys
        if z0 < z1:
            for x in (K1t, V1t):
                x[:, :, z0:z1] = 0
    for w0, w1 in _blocks(y0, y1, 128):  # NumPy's gather ran fastest 64 to 128 keys at a time (32: 20 % slower here)
        K1t[:, :D, w0 - origin:w1 - origin] = k[b, w0:w1, c0:c1].transpose(1, 2, 0)
        V1t[:, :D, w0 - origin:w1 - origin] = v[b, w0:w1, c0:c1].transpose(1, 2, 0)
    K1t[:, D, y0 - origin:y1 - origin] = 1
    V1t[:, D, y0 - origin:y1 - origin] = 1
    # scale K in rows for dQ: BLAS ran dS Kᵀᵀ from the transposed view at half the speed
    Ks = _band_keys(k[b, y0:y1, c0:c1], y0 - origin, columns, "Ks", acc, scratch, acc.type(p.scale))
    return (_windows(Q1, 0, nt, M, M, axis=1), _windows(dO1, 0, nt, M, M, axis=1),
            _windows(K1t, 0, nt, step, L, axis=2), _windows(V1t, 0, nt, step, L, axis=2),
            _windows(Ks, 0, nt, step, L, axis=1),
            _windows(Q1[:, :, :D], 0, nt - NW + 1, M, NW * M, axis=1),
            _windows(dO1[:, :, :D], 0, nt - NW + 1, M, NW * M, axis=1))


def _skewed(buf, count: int, M: int, L: int, step: int):
    """(heads, count, M, L) view of count tiles in buf (heads, size), tile u at u (M L + step): the
    layout of _band_backward's P and dS."""
    s0, s1 = buf.strides
    return np.lib.stride_tricks.as_strided(buf, (buf.shape[0], count, M, L), (s0, (M * L + step) * s1, L * s1, s1))


def _chunks(buf, count: int, NW: int, M: int, L: int, step: int):
    """(heads, count, NW M, step) view of the key chunks of the tiles in buf (laid out as _skewed):
    its x-th is the last chunk of the tile at place x, the last but one of the next, ... the first
    of the tile at place x + NW - 1, which are the same keys."""
    s0, s1 = buf.strides
    return np.lib.stride_tricks.as_strided(buf[:, (NW - 1) * step:], (buf.shape[0], count, NW * M, step),
                                           (s0, (M * L + step) * s1, L * s1, s1), writeable=False)


def _balanced_parts(costs, n, together=None):
    """Indices of costs split into n lists of about equal sum (largest first onto the least loaded,
    ties to the lowest part), each in ascending order. A function of its arguments only, so a
    given thread count always sums dQ in the same order. together: a key per index; indices of
    equal key go to the same list (items that add into the same elements of dbias)."""
    if together is not None:
        groups = {}
        for i, key in enumerate(together):
            groups.setdefault(key, []).append(i)
        members = list(groups.values())
        parts = _balanced_parts([sum(costs[i] for i in m) for m in members], n)
        return [sorted(i for group in part for i in members[group]) for part in parts]
    loads, parts = [0] * n, [[] for _ in range(n)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        least = min(range(n), key=lambda x: (loads[x], x))
        loads[least] += costs[i]
        parts[least].append(i)
    return [sorted(part) for part in parts if part]


@_one_call
def backward(p, dout, q, k, v, out, lse, into=None):
    dout, q, k, v, out = _values(p, dout, q, k, v, out)
    acc = p.acc_dtype
    D = p.head_dim
    if into is None:
        dq, dk, dv = (np.empty(x.shape, dtype=x.dtype) for x in (q, k, v))
    else:
        dq, dk, dv = _values(p, *into[:3])
    width = p.band.width
    if width is not None and width <= NARROW_BAND and p.modifiers == {"window"}:
        _band_backward(p, dout, q, k, v, out, lse, dq, dk, dv, width)
        return dq.view(p.carrier), dk.view(p.carrier), dv.view(p.carrier)
    block_m, block_n = tile_sizes(p, backward=True)
    key_blocks = _blocks(0, p.seqlen_k, block_n)
    unit_flops = p.flops(backward=True) / (p.batch * p.heads_kv * len(key_blocks))
    # a tile's P and dS together within about a core's L2 (BACKWARD_TILE_VOLUME), sized by the
    # largest tile of the plan: where every tile is a narrow step of a causal diagonal (S = 512),
    # more heads stack and spare Python-level steps. (Sized by the median tile instead, S = 1024
    # causal at D = 128 stacked all 8 heads onto its 512 x 512 tiles: 1.5x slower than one.)
    step, masks = _staircase_step(block_m, p.group, D), {}
    tiles = {(j0, j1): _backward_tiles(p, j0, j1, step, masks) for j0, j1 in key_blocks}
    unit_volume = p.group * max([(i1 - i0) * (y - x) for t in tiles.values() for i0, i1, x, y, _ in t] or [1])
    stacked = _heads_per_task(p, p.heads_kv * len(key_blocks), unit_flops, unit_volume,
                              BACKWARD_TILE_VOLUME[acc.itemsize])
    kv_groups = _blocks(0, p.heads_kv, stacked)
    heads = _HeadMap(p)
    if _staircase_step(block_m, stacked * p.group, D) != step:  # the plan above serves unless the step moved
        step = _staircase_step(block_m, stacked * p.group, D)
        tiles = {(j0, j1): _backward_tiles(p, j0, j1, step, masks) for j0, j1 in key_blocks}
    work = [(c0, c1, j0, j1) for c0, c1 in kv_groups for j0, j1 in key_blocks]
    # the (query, key) pairs each item computes: what its work is proportional to
    costs = [(c1 - c0) * sum((i1 - i0) * (y - x) for i0, i1, x, y, _ in tiles[j0, j1]) for c0, c1, j0, j1 in work]
    mods = _Modifiers(p, heads) if p.modifiers - {"window"} else None
    # dbias, in the bias's shape and the accumulation dtype, without atomics and in a fixed order:
    # items write disjoint parts of it, unless the bias broadcasts over keys (then each partition
    # sums into its own copy, at most batch x heads_q x seqlen_q, added in a fixed order) or over
    # heads (then the items of one key block, which share elements, run in one partition, in order)
    dB = None
    if p.bias is not None:  # summed into where it is given in the accumulation dtype
        dB = into[3] if into is not None and into[3].dtype == acc else np.empty(p.bias.shape, dtype=acc)
        dB.fill(0)
    per_partition = dB is not None and dB.shape[3] == 1
    together = None
    if dB is not None and not per_partition and dB.shape[1] == 1 and len(kv_groups) > 1:
        together = [j0 for c0, c1, j0, j1 in work]
    parts = _balanced_parts(costs, max(1, min(worker_count(), len(work))), together)

    for b in range(p.batch):
        # Q1 = [scale log2(e) Q | -log2(e) lse] (a row that sees no key has lse -inf: -inf there
        # gives it P = 0) and dO1 = [dO | -D], D_i = rowsum(dO_i ∘ O_i) the pre-pass, for every kv
        # head, made in one task a worker (its few elementwise passes are mostly call overhead)
        Q1_all = _call_scratch.take("Q1", (p.heads_kv, p.seqlen_q * p.group, D + 1), acc)
        dO1_all = _call_scratch.take("dO1", Q1_all.shape, acc)

        def operands(c0, c1):
            def run(scratch):
                Q1 = Q1_all[c0:c1]
                shape = (c1 - c0, p.seqlen_q, p.group)
                Q = Q1[:, :, :D].reshape(*shape, D)  # views: splitting an axis needs no copy
                np.multiply(heads.read(q[b], c0, c1), _base2_scale(p), out=Q, dtype=acc)
                L = heads.read(lse[b].T, c0, c1)
                Q1[:, :, D].reshape(shape)[...] = np.where(L == -np.inf, np.inf, L) * acc.type(-LOG2E)
                dO1 = dO1_all[c0:c1]
                dO = dO1[:, :, :D].reshape(*shape, D)
                dO[...] = heads.read(dout[b], c0, c1)
                if mods is not None:  # a row a mask leaves no key lies inside tiles: its dO goes nowhere
                    dO[L == -np.inf] = 0
                O = heads.read(out[b], c0, c1)
                dO1[:, :, D].reshape(shape)[...] = -np.einsum("csgd,csgd->csg", dO, _as_acc(O, acc))
            return run

        _run([operands(c0, c1) for c0, c1 in _blocks(0, p.heads_kv, -(-p.heads_kv // worker_count()))])
        prepared = {(c0, c1): (Q1_all[c0:c1], dO1_all[c0:c1]) for c0, c1 in kv_groups}

        def partition(index, items):
            def run(scratch):
                # named by the partition's place (at most one a worker), so calls of other shapes
                # reuse the same few buffers rather than keep one for every name they ever used
                dQ = _call_scratch.take(("dQ", index), (p.heads_kv, p.seqlen_q * p.group, D), acc, fill=0)
                dB_own = None if dB is None else np.zeros(dB.shape, acc) if per_partition else dB
                for i in items:
                    c0, c1, j0, j1 = work[i]
                    K = _as_acc(k[b, j0:j1, c0:c1, :].transpose(1, 0, 2), acc)
                    V = _as_acc(v[b, j0:j1, c0:c1, :].transpose(1, 0, 2), acc)
                    Q1, dO1 = prepared[c0, c1]
                    modify = dbias = None
                    if mods is not None:
                        modify = functools.partial(mods.apply, b=b, c0=c0, c1=c1, scratch=scratch)
                    if dB is not None:
                        dbias = functools.partial(mods.add_dbias, dB_own, b=b, c0=c0, c1=c1)
                    dK_j, dV_j = _backward_item(p, j0, j1, tiles[j0, j1], K, V, Q1, dO1, dQ[c0:c1], scratch,
                                                modify, dbias)
                    dk[b, j0:j1, c0:c1, :] = dK_j.transpose(1, 0, 2)
                    dv[b, j0:j1, c0:c1, :] = dV_j.transpose(1, 0, 2)
                return dQ if not per_partition else (dQ, dB_own)
            return run

        partial = _run([partition(index, part) for index, part in enumerate(parts)])
        if per_partition:
            dB += functools.reduce(np.add, [x[1] for x in partial])
            partial = [x[0] for x in partial]
        heads.unstack_into(dq[b], 0, p.heads_kv, functools.reduce(np.add, partial))  # fixed order: reproducible
    grads = dq.view(p.carrier), dk.view(p.carrier), dv.view(p.carrier)
    if dB is None:
        return grads
    # no copy where dbias's dtype is the accumulation dtype: the backward's extra memory is dbias itself
    if p.bias.dtype == p.carrier:  # q's dtype (bfloat16 bits included), else float32
        dbias = dB.astype(dq.dtype, copy=False).view(p.carrier)
    else:
        dbias = dB.astype(p.bias.dtype, copy=False)
    if into is not None and dbias is not into[3]:
        into[3][...] = dbias  # rounded from the accumulation dtype: a copy of dbias's size
        dbias = into[3]
    return grads + (dbias,)


# ----------------------------------------------------------------------------
# attention_probs


@_one_call
def probs(p, q, k, lse, rows):
    """P = exp(s - lse) (batch, heads_q, len(rows), seqlen_k) in the accumulation dtype, for the
    query rows `rows` (an index array): the forward's scores, band and modifiers, in base 2 as
    there, with the saved lse subtracted. A row that sees no key (lse -inf) gets 0."""
    q, k = _values(p, q, k)
    acc = p.acc_dtype
    heads = _HeadMap(p)
    mods = _Modifiers(p, heads) if p.modifiers - {"window"} else None
    P = np.empty((p.batch, p.heads_q, rows.size, p.seqlen_k), dtype=acc)
    chunks = _blocks(0, rows.size, tile_sizes(p)[0])
    keys = np.arange(p.seqlen_k)

    def task(b, c):
        def run(scratch):
            Kt = np.ascontiguousarray(k[b, :, c:c + 1, :].transpose(1, 2, 0), dtype=acc)  # (1, D, keys)
            for r0, r1 in chunks:
                index = rows[r0:r1]
                Q = heads.read(q[b, index], c, c + 1)  # (1, rows, group, D)
                Q = np.multiply(Q.reshape(1, -1, p.head_dim), _base2_scale(p), dtype=acc)
                S = np.matmul(Q, Kt)
                if mods is not None:
                    mods.apply(S, index, slice(0, p.seqlen_k), b=b, c0=c, c1=c + 1, scratch=scratch)
                S4 = S.reshape(1, r1 - r0, p.group, p.seqlen_k)
                hidden = ~p.band.visible(index[:, None], keys[None, :])
                if hidden.any():
                    np.copyto(S4, -np.inf, where=hidden[None, :, None, :])
                L = heads.read(lse[b].T[index], c, c + 1)  # (1, rows, group)
                np.subtract(S4, (np.where(L == -np.inf, np.inf, L) * acc.type(LOG2E))[..., None], out=S4)
                heads.unstack_into(P[b].transpose(1, 0, 2)[r0:r1], c, c + 1, np.exp2(S, out=S))
        return run

    _run([task(b, c) for b in range(p.batch) for c in range(p.heads_kv)])
    return P
