"""The cupy backend's launches for packed batches and KV caches (flashcupy/_varlen.py calls them through
the backend module, which re-exports them): a packed batch's forward and backward in one launch per
kernel (the kernels read the offsets: mask.cuh's Sequence), and the KV-cache append (flash_append.cu).
They pack arguments as the backend's own launches do, through its helpers (backend._tensor, ...),
looked up at call time so that the emulator's Runtime and the tests' switches reach them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

import flashcupy.backends.cupy_backend as backend

from .. import MAX_GRID
from . import launch, specs
from .backward import _backward_launches, _backward_module


def forward_varlen(p, q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse, alibi_slopes=None, seqused_k=None,
                   split=(1, 0), seqused_add: int = 0, block_table=None) -> None:
    """A packed batch's forward in one launch (attention_varlen): q (total_q, heads_q, head_dim), k, v
    (total_k, heads_kv, head_dim), out like q and lse (heads_q, total_q) allocated with 0 and -inf,
    written in place; cu_seqlens_q, cu_seqlens_k int32 (sequences + 1,) device arrays, read by the
    kernel (mask.cuh's Sequence), never on the host: whatever they hold, no row outside the arrays is
    touched. p is the packed problem (q[None], k[None], v[None]: batch 1, seqlen_q the total;
    Problem.diagonal unused, each sequence's is its own), alibi_slopes (heads_q,) or (sequences,
    heads_q). On the kernel forward_path picks, as for a batch of the sequences: on compute capability
    9.0 the Hopper one (a CTA a query block, the last key block's rows past the sequence zeroed in
    shared memory, out stored row by row) unless split-KV, a paged cache or a modifier keeps the
    mma.sync one.
    seqused_k: int32 (sequences,) device array, sequence b's keys the first seqused_k[b] + seqused_add rows
    from cu_seqlens_k[b] on (a contiguous KV cache: attention_with_kvcache, its lengths before the new
    tokens, and their count), clamped into k as the offsets are.
    split: (splits, keys per split) of split-KV in the same launch (cache_plan's), (1, 0) for none: a
    copy of the grid per split, each CTA over its split of its sequence's keys, the partial outs merged
    by flashcupy.merge's rule in a second launch (flash_merge.cu; every query row must belong to a
    sequence: the workspaces are not filled).
    block_table: int32 (sequences, max_blocks) device array, a paged KV cache's (with seqused_k): k and v
    are then the cache, (num_blocks, block_size, heads_kv, head_dim), sequence b's key n at row n %
    block_size of block block_table[b, n // block_size], read by the kernel through the table (CacheRows
    in flash_common.cuh: a block index clamped into the cache); cu_seqlens_k all zeros and p.seqlen_k
    max_blocks x block_size, the rows a sequence can address, which its lengths are clamped to."""
    rt = backend._runtime()
    num_seqs = int(cu_seqlens_q.shape[0]) - 1
    if num_seqs <= 0 or p.seqlen_q == 0 or p.seqlen_k == 0:
        return  # no sequence, no query or no key: out 0, lse -inf, as allocated
    splits, key_split = split
    paged = block_table is not None
    packed = (q[None], k, v) if paged else (q[None], k[None], v[None])
    # out too: the Hopper kernel stores it 16 bytes at a time, which _tma_describable's alignment allows
    path, module = backend._forward_module(p, *packed, splits > 1, out[None], varlen=True, paged=paged)
    (kernel,) = module.kernels
    blocks = launch.varlen_blocks(kernel, p, num_seqs) * splits
    if blocks > MAX_GRID[0]:
        raise ValueError(f"a packed batch of {num_seqs} sequences and {p.seqlen_q} query rows needs {blocks} thread "
                         f"blocks, more than CUDA's grid holds ({MAX_GRID[0]})")
    if alibi_slopes is not None:
        p = dataclasses.replace(p, alibi_slopes=alibi_slopes)
    with rt.device_of(q):
        (fwd,) = backend._functions(rt, module, q)
        if splits > 1:  # workspaces: (splits, *out's shape) and (splits, *lse's shape); the kernel adds a split's offset
            outs = rt.xp.empty((splits,) + tuple(out.shape), dtype=p.acc_dtype)
            lses = rt.xp.empty((splits,) + tuple(lse.shape), dtype=p.lse_dtype)
            # the whole workspaces, with one split's strides: the kernel adds the split's offset
            parts = [(x, np.int64(0), *backend._tensor(x[0])[1:]) for x in (outs, lses)]
            split_args = (np.int32(key_split), np.int64(outs.strides[0] // outs.itemsize),
                          np.int64(lses.strides[0] // lses.itemsize))
        else:
            parts = [(x, np.int64(0), *backend._tensor(x)[1:]) for x in (out, lse)]
            split_args = (np.int32(0), np.int64(0), np.int64(0))
        # batch strides 0: the kernel moves each tensor to its sequence's rows itself (TAKE_SEQUENCE); a
        # paged cache's k and v keep theirs, the blocks' strides
        tensors = [backend._tensor(x) if paged and i else (x, np.int64(0), *backend._tensor(x)[2:])
                   for i, x in enumerate(packed)] + parts
        pages = ((block_table, *(np.int64(n // 4) for n in block_table.strides), np.int32(k.shape[1]),
                  np.int32(k.shape[0])) if paged else backend._no_pages(rt, q))
        offsets = (cu_seqlens_q, cu_seqlens_k, np.int32(num_seqs),
                   *((backend._int32_stand_in(rt, q), np.int32(0), np.int32(0)) if seqused_k is None
                     else (seqused_k, np.int32(1), np.int32(seqused_add))))
        scalars = backend._problem_args(rt, p, q, path != "simt")
        if path == "hopper":  # tensor maps over the packed tensors (a batch of one); out by pointer: row by row
            maps = backend._sm90_maps(rt, p, (packed[0], kernel.block_m), (packed[1], kernel.block_n),
                                      (packed[2], kernel.block_n), (out[None], specs.SM90_CONSUMER_ROWS))
            fwd((blocks,), (kernel.threads,), (*maps, *parts[1], *scalars, np.int32(blocks),
                                                backend._int32_stand_in(rt, q), *parts[0], *offsets),
                shared_mem=kernel.dynamic_smem)
            return
        fwd(
            (blocks,), (kernel.threads,),
            (*(a for t in tensors for a in t), *scalars, *split_args, *offsets, *pages),
            shared_mem=kernel.dynamic_smem)
        if splits > 1:  # into out and lse, batch strides 0 as the forward's
            merged = [(x, np.int64(0), *backend._tensor(x)[1:]) for x in (out, lse)]
            backend._merge_splits(rt, p, q, splits, *parts, split_args, *merged, 1, p.seqlen_q)


def cache_plan(p, q, k, v, num_seqs: int, capacity: int, num_splits=None) -> tuple:
    """attention_with_kvcache's split of a cache run as a packed batch (forward_varlen's split; k, v its
    packed rows, or a paged cache's blocks): (1, 0), none, where its grid holds more than two CTAs an SM (split_plan's rule) or num_splits
    is 1; else (splits, keys per split), a multiple of specs.SPLIT_ALIGN, enough splits of the cache's
    capacity to fill the device (num_splits None) or at most num_splits of about equal length."""
    if num_splits == 1:
        return 1, 0
    paged = k.ndim == 4
    k, v = (x if paged else x[None] for x in (k, v))  # a paged cache as it is, else packed rows
    (kernel,) = backend._forward_module(p, q[None], k, v, False, varlen=True, paged=paged)[1].kernels
    ctas = launch.varlen_blocks(kernel, p, num_seqs)
    return backend._split_rule(capacity, ctas, ctas, num_splits, q)


def even_offsets(like, count: int, step: int):
    """int32 offsets 0, step, .., count step on like's device: the cu_seqlens of a packed batch of `count`
    parts of `step` rows each (attention_with_kvcache's queries, a contiguous cache's rows). Kept in the
    Runtime by (device, count, step): the kernels only read them, and a decode step would otherwise fill
    two arrays and copy them from the host every call."""
    rt = backend._runtime()
    with rt.device_of(like):
        return backend._remember(rt.plans, ("offsets", rt.device_id(like), count, step),
                                 lambda: rt.xp.asarray(np.arange(count + 1, dtype=np.int32) * step))


def backward_varlen(p, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, dq, dk, dv, alibi_slopes=None,
                    deterministic=False, dlse=None) -> None:
    """A packed batch's backward (attention_varlen_backward) in forward_varlen's manner: the preprocess,
    dK/dV and dQ (or the dQ conversion) each one launch whatever the number of sequences, the offsets
    read by the kernels (mask.cuh's Sequence) and never on the host. dout, q, out (total_q, heads_q,
    head_dim), k, v (total_k, heads_kv, head_dim), lse (heads_q, total_q); dq, dk, dv allocated with
    zeros, written in place (rows of no sequence, and the sequences without a query or a key, keep
    them). On the kernels backward_path chooses, the Hopper ones included (their boxes reach past a
    sequence into the next one's rows: the kernel zeros those rows in shared memory, so that no value
    of one sequence reaches another's gradients); deterministic and dlse (lse's shape) as backward's."""
    rt = backend._runtime()
    num_seqs = int(cu_seqlens_q.shape[0]) - 1
    if num_seqs <= 0 or p.seqlen_q == 0 or p.seqlen_k == 0:
        return  # no sequence, no query or no key: zero gradients, as allocated
    packed = [x[None] for x in (dout, q, k, v, out, lse, dq, dk, dv)]
    path = backend.backward_path(p, *packed[:5], deterministic, varlen=True)
    module = _backward_module(p, path, deterministic, q, varlen=True)
    for kernel in module.kernels[1:]:
        if kernel.varlen and launch.varlen_blocks(kernel, p, num_seqs) > MAX_GRID[0]:
            raise ValueError(f"a packed batch of {num_seqs} sequences, {p.seqlen_q} query rows and {p.seqlen_k} keys "
                             f"needs more thread blocks than CUDA's grid holds ({MAX_GRID[0]})")
    if alibi_slopes is not None:
        p = dataclasses.replace(p, alibi_slopes=alibi_slopes)
    with rt.device_of(q):
        _backward_launches(rt, p, path, module, *packed, varlen=(cu_seqlens_q, cu_seqlens_k, num_seqs),
                           dlse=None if dlse is None else dlse[None])


def append_kv(dtype, k_cache, v_cache, k, v, cache_seqlens, block_table=None) -> None:
    """attention_with_kvcache's append in one launch (flash_kv_append, flash_append.cu): k (batch,
    seqlen_new, heads_kv, head_dim) and v (..., head_dim_v) written into k_cache, v_cache (contiguous, or
    paged through block_table) from position cache_seqlens[b] of each sequence on. cache_seqlens int32 (batch,) and
    block_table int32 (batch, max_blocks) or None: device arrays the kernel reads and clamps into the
    cache itself; dtype the values' (a key of specs.CUDA_TYPES; bfloat16 as uint16 bits). The shapes are
    the interface's to check (capacity at least seqlen_new)."""
    rt = backend._runtime()
    if k.size == 0:
        return
    batch, new, heads_kv, head_dim = k.shape
    width = max(head_dim, v.shape[3])  # a thread an element of the wider
    module = specs.append_module(dtype)
    (kernel,) = module.kernels
    paged = block_table is not None
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    threads = batch * new * heads_kv * width
    blocks = backend._cdiv(threads, specs.NUM_THREADS)
    if blocks > MAX_GRID[0]:
        raise ValueError(f"appending {threads} elements needs {blocks} thread blocks, more than CUDA's grid holds "
                         f"({MAX_GRID[0]})")
    with rt.device_of(k_cache):
        (fn,) = backend._functions(rt, module, k_cache)
        table = block_table if paged else backend._int32_stand_in(rt, k_cache)
        table_strides = (np.int64(s // 4) for s in table.strides) if paged else (np.int64(0), np.int64(0))
        fn((blocks,), (kernel.threads,),
           (*backend._tensor(k), *backend._tensor(v), *backend._tensor(k_cache), *backend._tensor(v_cache), cache_seqlens, table, *table_strides,
            np.int32(paged), np.int32(batch), np.int32(new), np.int32(heads_kv), np.int32(head_dim),
            np.int32(v.shape[3]), np.int32(capacity), np.int32(k_cache.shape[1] if paged else 0),
            np.int32(k_cache.shape[0])))
