"""The cupy backend's backward launches (the backend module re-exports `backward` and ATOMIC_BACKWARD):
the D pre-pass, dK/dV, dQ or the conversion of the dQ added by atomics, and dbias, on the path
backward_path chooses; _backward_launches serves a packed batch too (packed.backward_varlen). The
backend's helpers are looked up at call time (backend._tensor, ...), so that the emulator's Runtime and
the tests' switches reach them.
"""

from __future__ import annotations

import numpy as np

import flashcupy.backends.cupy_backend as backend

from . import launch, specs


ATOMIC_BACKWARD = True  # backward(..., deterministic=False) may add with atomics (the interface passes it)


def _backward_module(p, path: str, deterministic: bool, like, varlen: bool = False) -> specs.ModuleSpec:
    """The backward's ModuleSpec on `path` (backward_path's) for this call, its tiles those of like's device."""
    if path == "hopper":
        mods = backend._mods(p)
        dim = backend._tile_head_dim(p)
        tile = specs.sm90_backward_tile(dim, mods, backend.SM90_TALL_BACKWARD)
        return specs.sm90_backward_module(p.dtype, dim, mods, varlen, deterministic, tile)
    if path == "tensor-core":
        return backend._tc_backward_module(p, like, deterministic, varlen)
    return specs.backward_module(p.dtype, backend._tile_head_dim(p), backend._mods(p), varlen)


def backward(p, dout, q, k, v, out, lse, deterministic=False, into=None, dlse=None):
    """dq, dk, dv (and dbias with a bias), written into `into` when given; dlse: the gradient of lse,
    or None (_backward_launches). On tensor cores, unless
    deterministic, the dK/dV kernel also adds dQ into an fp32 workspace with atomics (five GEMMs,
    not seven; the sums' order, so the rounding, varies from run to run); the Hopper dK/dV kernel adds
    it by bulk reduce-adds, deterministic or not (deterministic: in key-block order); the SIMT kernels
    are deterministic either way. p.dq_only: (dq,) alone, from the D pre-pass and the deterministic dQ
    kernel of the mma.sync or SIMT kernels (no dK/dV launch)."""
    rt = backend._runtime()
    deterministic = deterministic or p.dq_only  # the kernels with a dQ kernel of its own
    path = backend.backward_path(p, dout, q, k, v, out, deterministic, dq_only=p.dq_only)
    with rt.device_of(q):
        if into is None:
            dq = rt.xp.empty(q.shape, dtype=p.carrier)
            dk, dv = (None, None) if p.dq_only else (rt.xp.empty(x.shape, dtype=p.carrier) for x in (k, v))
        else:
            dq, dk, dv = into[0], *((None, None) if p.dq_only else into[1:3])
        D = _backward_launches(rt, p, path, _backward_module(p, path, deterministic, q), dout, q, k, v, out, lse,
                               dq, dk, dv, dlse=dlse)
        if p.dq_only:
            return (dq,)
        if not p.dbias:
            return dq, dk, dv
        # dbias (flash_pairs.cu, SIMT whichever path ran above): its own arguments are natural-unit ones
        module = specs.dbias_module(p.dtype, backend._tile_head_dim(p), backend._mods(p))
        (dbias_kernel,) = module.kernels
        (bwd_dbias,) = backend._functions(rt, module, q)
        dbias = rt.xp.empty(p.bias.shape, dtype=p.bias.dtype) if into is None or len(into) < 4 else into[3]
        bwd_dbias(
            (dbias_kernel.blocks(p),), (specs.NUM_THREADS,),
            (*backend._tensor(q), *backend._tensor(k), *backend._tensor(v), *backend._tensor(dout), *backend._tensor(lse), D, *backend._tensor(dbias),
             np.int32(p.batch), *(np.int32(n) for n in p.bias.shape),
             *backend._problem_args(rt, p, q, False)))
    return dq, dk, dv, dbias


def _backward_launches(rt, p, path: str, module, dout, q, k, v, out, lse, dq, dk, dv, varlen=None, dlse=None):
    """The backward's launches (module: _backward_module's for `path`) into dq, dk, dv; returns D. varlen:
    (cu_seqlens_q, cu_seqlens_k, num_seqs) for a packed batch (backward_varlen: every tensor a batch of
    one, passed with batch stride 0, and the dK/dV and dQ grids varlen_blocks'). dlse, the gradient of
    lse (lse's shape), or None: D - dlse, in one array operation after the pre-pass (the kernels' dS =
    P (dP - D) is then the gradient of both). Call with q's device current."""
    tensor_cores = path != "simt"  # the units of the score modifiers' arguments
    prep_kernel, dkdv, dq_kernel = module.kernels
    preprocess, bwd_dkdv, bwd_dq = backend._functions(rt, module, q)
    if varlen is None:
        arg, tail, blocks = backend._tensor, backend._no_varlen(rt, q), lambda kernel: kernel.blocks(p)
    else:
        # batch strides 0: each CTA moves the tensors to its sequence's rows itself (mask.cuh's Sequence)
        arg = lambda x: (x, np.int64(0), *backend._tensor(x)[2:])  # noqa: E731
        tail = (varlen[0], varlen[1], np.int32(varlen[2]), backend._int32_stand_in(rt, q), np.int32(0), np.int32(0))
        blocks = lambda kernel: launch.varlen_blocks(kernel, p, varlen[2])  # noqa: E731
    D = rt.xp.empty(p.lse_shape, dtype=p.acc_dtype)  # workspace: rowsum(dO ∘ O), contiguous
    # workspace for dQ's atomics: zeros, q's shape, contiguous (the tensor-core dK/dV kernel takes
    # a never-read stand-in otherwise); the Hopper kernel's: zeros, a tile of block_m rows x its
    # head_dim bucket and padding per (batch, query head, query block) (flash_bwd_sm90.cu)
    # (a packed batch's: a tile per query head and slot, launch.varlen_blocks' of block_m rows)
    tiles = (0 if not dkdv.wgmma else launch.varlen_blocks(dq_kernel, p, varlen[2]) if varlen is not None
             else p.batch * p.heads_q * -(-p.seqlen_q // dkdv.block_m))
    dqa = (rt.xp.zeros((tiles, dkdv.block_m, dkdv.head_dim + specs.SM90_DQ_ROW_PAD), dtype=np.float32)
           if dkdv.wgmma else rt.xp.zeros(q.shape, dtype=np.float32) if dkdv.dq_atomic else None)

    block = (specs.NUM_THREADS,)
    preprocess(  # a packed batch's rows are those of one sequence of its total length here
        (prep_kernel.blocks(p),), block,
        (*backend._tensor(dout), *backend._tensor(out), D,
         np.int32(p.batch), np.int32(p.seqlen_q), np.int32(p.heads_q), np.int32(p.head_dim_v)))
    if dlse is not None:  # a row that sees no key: every kernel selects dS = 0 for a hidden pair, whatever D holds
        D -= dlse
    shared = (*arg(q), *arg(k), *arg(v), *arg(dout), *arg(lse), D)
    flags = backend._problem_args(rt, p, q, tensor_cores)
    # the Hopper kernel's count of the key blocks that have added into each dQ tile (deterministic: zeros;
    # otherwise never read)
    turns = (rt.xp.zeros(tiles, dtype=np.int32) if dkdv.deterministic else backend._int32_stand_in(rt, q))
    atomic = ((dqa, turns) if dkdv.wgmma else (*arg(dqa),) if dqa is not None
              else (D, *(np.int64(0),) * 4) if tensor_cores else ())
    if path == "hopper":  # q, dO_i: a pass's BLOCK_M rows; k, v: the key block's BLOCK_N
        maps = backend._sm90_maps(rt, p, (q, dkdv.block_m), (k, dkdv.block_n), (v, dkdv.block_n), (dout, dkdv.block_m))
        shared = (*maps, *arg(lse), D)
    assert dk is not None or dqa is None, "dq_only needs a module with a dQ kernel of its own"
    if dk is not None:  # None: p.dq_only, the dQ kernel alone (dqa is None: a module with one)
        bwd_dkdv(  # a second grid dimension where CTAs share a key block's columns (tensor cores above head_dim 128)
            (blocks(dkdv), dkdv.column_parts), (dkdv.threads,),
            (*shared, *arg(dk), *arg(dv), *flags, *atomic, *tail), shared_mem=dkdv.dynamic_smem)
    if dqa is None:
        bwd_dq(
            (blocks(dq_kernel), dq_kernel.column_parts), block,
            (*shared, *arg(dq), *flags, *tail), shared_mem=dq_kernel.dynamic_smem)
    else:
        # the convert kernel writes dq element by element in q's shape, contiguous: a given dq of
        # other strides (a view of a larger one: flashcupy/_batch.py) takes a copy
        flat = dq if dq.flags.c_contiguous else rt.xp.empty(q.shape, dtype=p.carrier)
        shape = (np.int32(p.seqlen_q), np.int32(p.heads_q), np.int32(p.head_dim))
        if dq_kernel.varlen:  # a CTA a workspace tile; the rows of no sequence keep dq's zeros
            bwd_dq((tiles,), block, (dqa, flat, np.float32(p.scale), *shape, *tail))
        else:
            bwd_dq((dq_kernel.blocks(p),), block,
                   (dqa, flat, np.int64(flat.size), np.float32(p.scale), *(shape if dkdv.wgmma else ())))
        if flat is not dq:
            dq[...] = flat
    return D
