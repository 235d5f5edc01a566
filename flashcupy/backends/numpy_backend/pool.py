"""Where the NumPy backend's work runs: a thread pool kept between calls, BLAS pinned to one thread
per worker (threadpoolctl), one call's workers at a time, and the scratch buffers each worker
keeps from tile to tile and call to call. NumPy releases the GIL in BLAS and in the elementwise
loops, so the workers' arithmetic overlaps; their Python does not."""

from __future__ import annotations

import functools
import math
import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .settings import config


@functools.lru_cache(maxsize=1)
def blas_controller():
    """threadpoolctl's controller (a dependency, but a vendored install may lack it), else None."""
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:
        return None
    return ThreadpoolController()


def threads_from_environment() -> int:
    text = os.environ.get("FLASHCUPY_NUM_THREADS", "").strip()
    if not text:
        return os.cpu_count() or 1
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"FLASHCUPY_NUM_THREADS must be a positive whole number of worker threads, "
                         f"got {text!r}")
    return int(text)


def worker_count() -> int:
    """Python worker threads used per call.

    Each worker's BLAS calls must run single-threaded, or the BLAS pool and ours oversubscribe the
    cores (several times slower: benchmarks/results/numpy_backend_choices.md). Pinning BLAS needs
    threadpoolctl (a dependency); without it one worker runs and BLAS uses its own threads.
    """
    if blas_controller() is None:
        return 1
    return config.NUM_THREADS or threads_from_environment()


def aligned_empty(shape, dtype, alignment=64):
    """An uninitialised C-contiguous array whose first element sits on a 64-byte boundary.

    NumPy's vectorised exp treats the elements before the first aligned one with its scalar loop,
    whose last bit can differ: with the buffer's address left to the allocator, results would
    depend on what else the process had allocated (calls from other threads, say).
    """
    dtype = np.dtype(dtype)
    raw = np.empty(int(np.prod(shape)) * dtype.itemsize + alignment, np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start:start + int(np.prod(shape)) * dtype.itemsize].view(dtype).reshape(shape)


class Scratch:
    """Named buffers reused from tile to tile, task to task and call to call instead of allocated
    for each: one per thread that runs tasks (thread_scratch), and one for the arrays a call's
    workers share (call_scratch). Each starts on a 64-byte boundary (see aligned_empty), so the
    bits never depend on which worker ran a task.

    Kept between calls because a fresh buffer of more than glibc's mmap threshold is fresh pages,
    each faulted in and zeroed by the kernel on first touch, which at short sequences made calls
    measurably slower in some runs, as the allocator's thresholds moved. one_call drops what is
    larger than SCRATCH_KEEP_BYTES after each call, so long sequences, whose faults cost little
    next to their work, hold no memory."""

    def __init__(self):
        self._buffers = {}

    def take(self, name, shape, dtype, fill=None):
        """A C-contiguous array of this shape, the same memory each time: uninitialised, or fill."""
        n = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.dtype != dtype or buf.size < n:
            buf = self._buffers[name] = aligned_empty((n,), dtype)
        out = buf[:n].reshape(shape)
        if fill is not None:
            out.fill(fill)
        return out

    def trim(self, keep_bytes: int) -> None:
        self._buffers = {k: b for k, b in self._buffers.items() if b.nbytes <= keep_bytes}


SCRATCH_KEEP_BYTES = 8 << 20  # a scratch buffer up to this size outlives its call (see Scratch)
_scratch_of_thread = threading.local()
scratches = weakref.WeakSet()  # every thread's Scratch: a thread's goes with it
call_scratch = Scratch()  # buffers the workers of a call share; calls take turns (one_call)


def thread_scratch() -> Scratch:
    scratch = getattr(_scratch_of_thread, "scratch", None)
    if scratch is None:
        scratch = _scratch_of_thread.scratch = Scratch()
        scratches.add(scratch)
    return scratch


def one_call(fn):
    """A backend entry point: calls take turns (see _one_call_at_a_time), and the scratch buffers
    larger than SCRATCH_KEEP_BYTES are dropped when the call ends."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        with _one_call_at_a_time:
            try:
                return fn(*args, **kwargs)
            finally:
                for scratch in (call_scratch, *list(scratches)):
                    scratch.trim(SCRATCH_KEEP_BYTES)
    return call


class Shared:
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


# One call's workers at a time, the others wait (one_call). BLAS's thread limit belongs to the
# process (and OpenBLAS's sgemm rounds differently with different thread counts), so calls that
# overlapped would each set and restore it under the others: later calls would find BLAS left
# pinned, and results would depend on what else was running; and the pool's threads keep their
# scratch buffers from call to call. Each call already keeps every core busy. Reentrant: run
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


def run(tasks):
    """Run task(scratch) for each task on the calling thread and the worker pool, results in task
    order; the first exception propagates. Tasks are handed out in order as workers free up (a
    task's result must not depend on which worker runs it), and each worker thread keeps its
    Scratch from call to call. The pool's threads live on between calls: starting one costs a
    noticeable part of a short call."""
    n = min(worker_count(), len(tasks))
    if blas_controller() is None:
        scratch = thread_scratch()
        return [t(scratch) for t in tasks]
    # pinned on one worker too, so that a call's bits do not depend on its task count
    with _one_call_at_a_time, blas_controller().limit(limits=1, user_api="blas"):
        if n <= 1:
            scratch = thread_scratch()
            return [t(scratch) for t in tasks]
        return _run_on_pool(tasks, n)


def _run_on_pool(tasks, n: int) -> list:
    """run's tasks on the calling thread and n - 1 of the pool's, handed out in order."""
    results = [None] * len(tasks)
    pending = iter(range(len(tasks)))
    lock = threading.Lock()
    failed = []

    def worker():
        scratch = thread_scratch()
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
