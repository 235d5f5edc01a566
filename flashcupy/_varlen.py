"""Packed variable-length batches and KV-cache attention, on every backend.

Each sequence of a packed batch is exactly `attention` on it alone: these entry points validate
the whole call (shapes, dtypes, every offset and block index, on the host) before any work, then
run the ordinary entry points on views of each sequence (no copies of the inputs), so whatever a
backend computes for `attention` (dtypes, modifiers, kernel paths) it computes here too. A KV
cache's keys are visited where they lie: a paged cache as runs of consecutive physical blocks,
each run an ordinary call told its global diagonal, the runs combined by `flashcupy.merge`'s rule
(as are the splits of num_splits).

On the cupy backend a packed batch is one launch per kernel whatever the number of sequences: the
forward one, the backward three (the D pre-pass; dK/dV; dQ, or the conversion of the dQ the dK/dV
kernel added), on the kernels a batch of its sequences would take (on compute capability 9.0 the
Hopper ones, but for a paged cache, split-KV or a modifier they do not take). Its kernels read the offsets from device memory
themselves (cupy_backend.forward_varlen and backward_varlen, mask.cuh's Sequence), clamped into the
arrays, so that no offset can make them touch memory outside them. The offsets are still copied to
the host and checked first unless check_offsets=False, which skips that copy (for serving loops and
CUDA graphs: unchecked offsets give garbage, in bounds, never an access outside the arrays); for
valid offsets the result is the same bits either way. The Numba backend's kernels read them on the
device as well (numba_backend.forward_varlen, backward_varlen). The NumPy backend works on the
host and needs the offsets there, so it reads and checks them whatever check_offsets says: its short
sequences in groups of similar lengths, a call for all of them (numpy_backend/packed.py; a call
each costs more than a hundred-token sequence's arithmetic), each longer one a call of its own. A KV
cache's new tokens are appended in one launch on the cupy backend (cupy_backend.append_kv), and
attention over the cache is one more launch (the cache as a packed batch whose sequences use their
cache_seqlens + seqlen_new first positions: forward_varlen's seqused_k; a paged cache's read through
block_table by the kernel), split-KV inside it as cupy_backend.cache_plan says. Where q (or a contiguous
cache) is no view of packed rows, the cache's attention runs one launch per sequence (per run of a
paged cache), splitting a sequence's keys inside that launch (cupy_backend.split_plan) where one CTA
per query block and head would leave the device idle, as when decoding.
"""

from __future__ import annotations

import dataclasses
import numbers

import numpy as np

from . import _api, _checks, _interop, _merge, backends
from ._problem import out_shape


def _host_ints(name: str, x, lib: str, ndim: int, shape_rule: str) -> np.ndarray:
    """An int32 array of the inputs' library, read on the host (a small device-to-host copy for
    CuPy: its values decide which memory is touched, so they are checked here, before any launch)."""
    if backends.array_library(x) != lib:
        raise TypeError(f"{name} must be an int32 array of q's library ({lib}), got {_checks.describe(x)}")
    if np.dtype(x.dtype) != np.int32:
        raise TypeError(f"{name} must have dtype int32, got {np.dtype(x.dtype)}")
    values = x if lib == "numpy" else x.get()
    if values.ndim != ndim:
        raise ValueError(f"{name} must have shape {shape_rule}, got {tuple(x.shape)}")
    return np.asarray(values, dtype=np.int64)


def _ints_unread(name: str, x, lib: str) -> None:
    """The checks of _host_ints that need no value (library and dtype: no copy to the host)."""
    if backends.array_library(x) != lib:
        raise TypeError(f"{name} must be an int32 array of q's library ({lib}), got {_checks.describe(x)}")
    if np.dtype(x.dtype) != np.int32:
        raise TypeError(f"{name} must have dtype int32, got {np.dtype(x.dtype)}")


def _offsets_unread(name: str, cu, lib: str) -> int:
    """The checks of _host_ints on cu_seqlens that need no value (library, dtype, shape: no copy to the
    host); returns the number of sequences."""
    _ints_unread(name, cu, lib)
    if cu.ndim != 1 or cu.shape[0] < 1:
        raise ValueError(f"{name} must have shape (batch + 1,), got {tuple(cu.shape)}")
    return cu.shape[0] - 1


def _check_cu_seqlens(name: str, cu, lib: str, total: int) -> np.ndarray:
    values = _host_ints(name, cu, lib, 1, "(batch + 1,)")
    if values.size < 1 or values[0] != 0 or values[-1] != total or np.any(np.diff(values) < 0):
        raise ValueError(f"{name} must start at 0, never decrease and end at {total} (the packed length), "
                         f"got {values.tolist() if values.size <= 10 else values[:10].tolist() + ['...']}")
    return values


def _check_packed(q, k, v):
    for name, x, what in (("q", q, "total_q, heads_q"), ("k", k, "total_k, heads_kv"), ("v", v, "total_k, heads_kv")):
        if getattr(x, "ndim", None) != 3:
            raise ValueError(f"{name} must have rank 3 ({what}, head_dim), got shape {tuple(getattr(x, 'shape', ()))}")


def _slopes_for(alibi_slopes, b: int, batch: int):
    """Sequence b's ALiBi slopes: (heads_q,) slopes are shared, (batch, heads_q) ones are per sequence."""
    if alibi_slopes is None or alibi_slopes.ndim == 1:
        return alibi_slopes
    if alibi_slopes.shape[0] != batch:
        raise ValueError(f"alibi_slopes must have shape (heads_q,) or (batch, heads_q) with batch = {batch} "
                         f"sequences, got {tuple(alibi_slopes.shape)}")
    return alibi_slopes[b]


def _one_launch(mod, backward: bool = False) -> bool:
    """Whether backend `mod` runs a packed forward (backward) in launches that read the offsets on the
    device (cupy, numba: forward_varlen, backward_varlen); else the sequences are looped over on the
    host (forward_packed, backward_packed)."""
    return hasattr(mod, "backward_varlen" if backward else "forward_varlen")


def _varlen_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, dtype,
                 modifiers, backend, backward=False, check_offsets=True):
    """Validate the whole packed call; returns (problem of the packed arrays, cu_q, cu_k, backend module),
    cu_q and cu_k the offsets read on the host and checked, or None and None where check_offsets is
    False and the backend reads them on the device (_one_launch: only their library, dtype and shape
    are checked, and the max_seqlen hints' types)."""
    backend = _checks.check_backend_name(backend)
    _check_packed(q, k, v)
    lib = _checks.check_arrays({"q": q, "k": k, "v": v})
    if check_offsets:
        cu_q = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, lib, q.shape[0])
        cu_k = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, lib, k.shape[0])
        batch, batch_k = cu_q.size - 1, cu_k.size - 1
    else:
        cu_q = cu_k = None
        batch = _offsets_unread("cu_seqlens_q", cu_seqlens_q, lib)
        batch_k = _offsets_unread("cu_seqlens_k", cu_seqlens_k, lib)
    if batch != batch_k:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, got "
                         f"{batch} and {batch_k}")
    for name, hint, cu in (("max_seqlen_q", max_seqlen_q, cu_q), ("max_seqlen_k", max_seqlen_k, cu_k)):
        if hint is None:
            continue
        if isinstance(hint, bool) or not isinstance(hint, numbers.Integral) or hint < 0:
            raise TypeError(f"{name} must be None or an int >= 0, got {hint!r}")
        lengths = None if cu is None else np.diff(cu)
        if batch and lengths is not None and hint < lengths.max():
            raise ValueError(f"{name} must be at least the longest sequence, {int(lengths.max())}, got {hint}")
    p, mod = _packed_problem(q, k, v, batch, causal, scale, dtype, lib, modifiers, backend, backward)
    if cu_q is None and not _one_launch(mod, backward):
        # where the sequences are looped over on the host, the offsets are read there: checked, as by default
        return _varlen_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, dtype,
                            modifiers, mod.NAME, backward)
    return p, cu_q, cu_k, mod


@_interop.accepts_foreign_arrays
def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None, causal=False,
                     window=None, softcap=None, alibi_slopes=None, scale=None, return_lse=False, backend="auto",
                     dtype=None, check_offsets=True, dropout_p=0.0, dropout_seed=None):
    """Attention over a packed batch of sequences of different lengths.

    q (total_q, heads_q, head_dim), k and v (total_k, heads_kv, head_dim); cu_seqlens_q and
    cu_seqlens_k int32 (batch + 1,) of the same library: sequence b is rows cu[b]:cu[b + 1]. Each
    sequence is attention on it alone (causal bottom-right per sequence, windows, softcap, ALiBi
    with (heads_q,) or (batch, heads_q) slopes). max_seqlen_* are checked hints. check_offsets=False
    skips the offsets' copy to the host and their checks where the kernels read them themselves (the
    cupy backend: one launch): offsets that break the rule then give garbage rows, never an access
    outside the arrays; the backends that loop on the host check them anyway (the module docstring).
    dropout_p, dropout_seed: as attention's, sequence b's pairs drawn as batch b's.
    Returns out (q's shape with v's head_dim, q's dtype), and lse (heads_q, total_q) with return_lse=True.
    """
    return_lse = _checks.check_bool("return_lse", return_lse)
    check_offsets = _checks.check_bool("check_offsets", check_offsets)
    mods = dict(window=window, softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                dropout_seed=dropout_seed)
    p, cu_q, cu_k, mod = _varlen_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                      scale, dtype, mods, backend, check_offsets=check_offsets)
    out = mod.allocate(q, out_shape(q.shape, v.shape), p.carrier, 0)
    lse = mod.allocate(q, (p.heads_q, q.shape[0]), p.lse_dtype, -np.inf)
    if _one_launch(mod):  # the offsets read on the device (the same bits, checked or not)
        mod.forward_varlen(p, q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse, alibi_slopes=alibi_slopes)
    else:
        _forward_loop(q, k, v, cu_q, cu_k, out, lse, causal=causal, scale=scale, backend=backend, dtype=dtype,
                      **mods)
    return (out, lse) if return_lse else out


def _packed_problem(q, k, v, batch: int, causal, scale, dtype, lib, modifiers: dict, backend, backward=False):
    """(Problem of the packed arrays, backend module): the checks of attention itself on the packed
    arrays as one sequence (shapes, dtypes, scale, modifiers), (batch, heads_q) ALiBi slopes checked
    against batch and sequence 0's taken (each call or kernel takes its sequence's)."""
    mods = dict(modifiers)
    slopes = mods.get("alibi_slopes")
    mods["alibi_slopes"] = None if slopes is None else _slopes_for(slopes, 0, batch)
    p = _checks.problem(q[None], k[None], v[None], causal, scale, dtype, lib, **mods)
    return p, _checks.select_backend(backend, lib, p, backward=backward)


def _packed_backend(q, k, v, batch: int, alibi_slopes, keywords: dict, backward: bool = False) -> tuple:
    """_packed_problem of a call _varlen_plan validated before (the keywords forward_packed and
    backward_packed take)."""
    kw = dict(keywords)
    kw.pop("deterministic", None)
    words = kw.pop("dropout_seed_words", None)  # flashcupy.jax's seed in device memory (cupy)
    backend, causal, scale, dtype = (kw.pop(name, None) for name in ("backend", "causal", "scale", "dtype"))
    p, mod = _packed_problem(q, k, v, batch, bool(causal), scale, dtype, backends.array_library(q),
                             dict(kw, alibi_slopes=alibi_slopes), backend or "auto", backward)
    return _api._seed_words(p, words), mod


def forward_packed(q, k, v, cu_q, cu_k, out, lse, *, alibi_slopes=None, device_offsets=None, **keywords) -> None:
    """attention_varlen of a validated call (flashcupy.jax's), its offsets cu_q, cu_k on the host, every
    row of out and lse written (XLA's buffers: nothing is allocated with zeros for it). device_offsets
    (cu_q, cu_k as int32 arrays of q's library, or None): where the backend reads offsets on the device
    (_one_launch: cupy), one launch over the packed batch; else each sequence a call."""
    batch = cu_q.size - 1
    if device_offsets is not None:
        p, mod = _packed_backend(q, k, v, batch, alibi_slopes, keywords)
        if _one_launch(mod):
            if not (batch and p.seqlen_q and p.seqlen_k):  # forward_varlen then writes nothing: no key seen
                out.fill(0)
                lse.fill(-np.inf)
            mod.forward_varlen(p, q, k, v, *device_offsets, out, lse, alibi_slopes=alibi_slopes)
            return
    _forward_loop(q, k, v, cu_q, cu_k, out, lse, alibi_slopes=alibi_slopes, **keywords)


def _sequence(keywords: dict, b: int) -> dict:
    """The keywords of sequence b's own call: with dropout, its origin in the keep mask is batch b's."""
    return keywords | {"dropout_origin": (b, 0, 0, 0)} if keywords.get("dropout_p") else keywords


def _together(q, k, v, cu_q, cu_k, alibi_slopes, keywords: dict, backward=False) -> tuple:
    """(backend module, Problem of the packed arrays, the sequences it takes together) where the
    backend runs several sequences of a packed batch at once on the host (the NumPy backend's short
    ones: numpy_backend/packed.py), else (None, None, no sequences)."""
    p, mod = _packed_backend(q, k, v, cu_q.size - 1, alibi_slopes, keywords, backward)
    if not hasattr(mod, "sequences_together"):
        return None, None, np.zeros(0, np.intp)
    return mod, p, mod.sequences_together(cu_q, cu_k)


def _forward_loop(q, k, v, cu_q, cu_k, out, lse, *, alibi_slopes=None, **keywords) -> None:
    """forward_packed's, and attention_varlen's on a backend that loops on the host: each sequence's
    (out, lse) written into out and lse; the sequences the backend takes together first, in one call."""
    batch = cu_q.size - 1
    mod, p, together = _together(q, k, v, cu_q, cu_k, alibi_slopes, keywords)
    if together.size:
        mod.forward_sequences(p, q, k, v, cu_q, cu_k, together, out, lse, alibi_slopes=alibi_slopes)
    done = np.zeros(batch, bool)
    done[together] = True
    for b in range(batch):
        (qa, qb), (ka, kb) = cu_q[b:b + 2], cu_k[b:b + 2]
        if qa == qb or done[b]:
            continue
        o, l = _api.forward(q[None, qa:qb], k[None, ka:kb], v[None, ka:kb],
                            alibi_slopes=_slopes_for(alibi_slopes, b, batch), **_sequence(keywords, b))
        out[qa:qb] = o[0]
        lse[:, qa:qb] = l[0]


@_interop.accepts_foreign_arrays
def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None,
                              max_seqlen_k=None, causal=False, window=None, softcap=None, alibi_slopes=None,
                              scale=None, backend="auto", dtype=None, check_offsets=True, deterministic=False,
                              dlse=None, dropout_p=0.0, dropout_seed=None):
    """Gradients (dq, dk, dv) of attention_varlen, shaped like q, k and v; deterministic and dlse (the
    gradient of lse, lse's shape (heads_q, total_q)) as attention_backward's. check_offsets as
    attention_varlen's: the cupy backend's kernels read the offsets themselves (a launch per kernel
    whatever the batch), the other backends loop over the sequences on the host and check them
    whatever it says. dropout_p, dropout_seed: the forward's."""
    check_offsets = _checks.check_bool("check_offsets", check_offsets)
    deterministic = _checks.check_bool("deterministic", deterministic)
    mods = dict(window=window, softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                dropout_seed=dropout_seed)
    p, cu_q, cu_k, mod = _varlen_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                      scale, dtype, mods, backend, backward=True, check_offsets=check_offsets)
    given = {"dout": dout, "q": q, "out": out, "lse": lse}
    _checks.check_arrays(given if dlse is None else given | {"dlse": dlse})
    _checks.check_like_q(p, q, {"dout": dout, "out": out})
    for name, x in (("lse", lse), ("dlse", dlse)):
        if x is None:
            continue
        if tuple(x.shape) != (p.heads_q, q.shape[0]):
            raise ValueError(f"{name} must have shape (heads_q, total_q) = {(p.heads_q, q.shape[0])}, "
                             f"got {tuple(x.shape)}")
        if np.dtype(x.dtype) != p.lse_dtype:
            raise TypeError(f"{name} must have dtype {p.lse_dtype} for {p.dtype} inputs, got {np.dtype(x.dtype)}")
        _checks.check_strides(name, x)
    dq, dk, dv = (mod.allocate(q, x.shape, p.carrier, 0) for x in (q, k, v))
    if _one_launch(mod, backward=True):  # the offsets read on the device (the same bits, checked or not)
        mod.backward_varlen(p, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, dq, dk, dv,
                            alibi_slopes=alibi_slopes, deterministic=deterministic,
                            **({} if dlse is None else {"dlse": dlse}))
    else:
        _backward_loop(dout, q, k, v, out, lse, cu_q, cu_k, dq, dk, dv, causal=causal, scale=scale, backend=backend,
                       dtype=dtype, deterministic=deterministic, dlse=dlse, **mods)
    return dq, dk, dv


def backward_packed(dout, q, k, v, out, lse, cu_q, cu_k, dq, dk, dv, *, alibi_slopes=None, device_offsets=None,
                    dlse=None, **keywords) -> None:
    """attention_varlen_backward of a validated call (flashcupy.jax's), its offsets on the host: every
    row of dq, dk and dv written (zeros for a sequence without queries or keys; XLA's buffers). With
    device_offsets, as forward_packed's: one launch per kernel where the backend reads offsets on the
    device, after zeroing dq, dk, dv (its kernels leave the rows of sequences without queries or keys)."""
    batch = cu_q.size - 1
    if device_offsets is not None:
        p, mod = _packed_backend(q, k, v, batch, alibi_slopes, keywords, backward=True)
        if _one_launch(mod, backward=True):
            for x in (dq, dk, dv):
                x.fill(0)
            mod.backward_varlen(p, dout, q, k, v, out, lse, *device_offsets, dq, dk, dv, alibi_slopes=alibi_slopes,
                                deterministic=bool(keywords.get("deterministic", False)),
                                **({} if dlse is None else {"dlse": dlse}))
            return
    _backward_loop(dout, q, k, v, out, lse, cu_q, cu_k, dq, dk, dv, alibi_slopes=alibi_slopes, dlse=dlse, **keywords)


def _backward_loop(dout, q, k, v, out, lse, cu_q, cu_k, dq, dk, dv, *, alibi_slopes=None, dlse=None,
                   **keywords) -> None:
    """backward_packed's, and attention_varlen_backward's on a backend that loops on the host (the
    sequences it takes together first, in one call)."""
    batch = cu_q.size - 1
    mod, p, together = _together(q, k, v, cu_q, cu_k, alibi_slopes, keywords, backward=True)
    if together.size:
        mod.backward_sequences(p, dout, q, k, v, out, lse, cu_q, cu_k, together, dq, dk, dv, alibi_slopes=alibi_slopes,
                               dlse=dlse)
    done = np.zeros(batch, bool)
    done[together] = True
    for b in range(batch):
        (qa, qb), (ka, kb) = cu_q[b:b + 2], cu_k[b:b + 2]
        if done[b]:
            continue
        if qa == qb or ka == kb:  # no query, or no key: zero gradients
            dq[qa:qb], dk[ka:kb], dv[ka:kb] = 0, 0, 0
            continue
        g = _api.backward(dout[None, qa:qb], q[None, qa:qb], k[None, ka:kb], v[None, ka:kb],
                          out[None, qa:qb], lse[None, :, qa:qb], alibi_slopes=_slopes_for(alibi_slopes, b, batch),
                          dlse=None if dlse is None else dlse[None, :, qa:qb], **_sequence(keywords, b))
        dq[qa:qb], dk[ka:kb], dv[ka:kb] = g[0][0], g[1][0], g[2][0]


@_interop.accepts_foreign_arrays
def attention_varlen_vjp(q, k, v, cu_seqlens_q, cu_seqlens_k, **keywords):
    """attention_varlen plus a closure for its backward: (out, vjp), vjp(dout, dlse=None) -> (dq, dk,
    dv), dlse the gradient of the lse attention_varlen(..., return_lse=True) gives; deterministic
    reaches the backward only."""
    keywords.pop("return_lse", None)
    forward_keywords = {name: x for name, x in keywords.items() if name != "deterministic"}
    out, lse = attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, return_lse=True, **forward_keywords)

    def vjp(dout, dlse=None):
        return attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, dlse=dlse, **keywords)

    return out, vjp


# ----------------------------------------------------------------------------
# KV cache


def _cache_plan(q, k_cache, v_cache, k, v, cache_seqlens, block_table, num_splits, read_lengths=True):
    """Validated (lib, the block table on the host, block_size, lengths before appending, new length,
    splits); the table None for a contiguous cache. Where read_lengths is False (cache_seqlens an array),
    lengths and table are None: cache_seqlens and block_table have their library, dtype and shape checked
    only, no value read."""
    lib = _checks.check_arrays({"q": q, "k_cache": k_cache, "v_cache": v_cache})
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.ndim != 4:
            raise ValueError(f"{name} must have rank 4, got shape {tuple(x.shape)}")
    # v's head dim may differ from k's (MLA; v_cache may even be a view of k_cache's first columns)
    if tuple(k_cache.shape[:3]) != tuple(v_cache.shape[:3]):
        raise ValueError(f"k_cache and v_cache must have the same shape but for the last dimension (head_dim, "
                         f"head_dim_v), got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    batch = q.shape[0]
    paged = block_table is not None
    if paged:
        if read_lengths:
            table = _host_ints("block_table", block_table, lib, 2, "(batch, max_blocks_per_seq)")
        else:
            _ints_unread("block_table", block_table, lib)
            table = None
        if block_table.ndim != 2 or block_table.shape[0] != batch:
            raise ValueError(f"block_table must have shape (batch, max_blocks_per_seq) with batch = {batch}, "
                             f"got {tuple(block_table.shape)}")
        block_size = k_cache.shape[1]
        capacity = block_table.shape[1] * block_size
    else:
        table, block_size = None, None
        if k_cache.shape[0] != batch:
            raise ValueError(f"k_cache must have q's batch size {batch} (a contiguous cache: (batch, seqlen_cache, "
                             f"heads_kv, head_dim)), got {tuple(k_cache.shape)}")
        capacity = k_cache.shape[1]
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (new tokens to append) or both left out")
    new = 0
    if k is not None:
        _checks.check_arrays({"q": q, "k": k, "v": v})
        for name, x, cache, dim in (("k", k, k_cache, "head_dim"), ("v", v, v_cache, "head_dim_v")):
            want = (batch, k.shape[1], cache.shape[2], cache.shape[3]) if k.ndim == 4 else None
            if x.ndim != 4 or tuple(x.shape) != want:
                raise ValueError(f"{name} must have shape (batch, seqlen_new, heads_kv, {dim}) = {want}, "
                                 f"got {tuple(x.shape)}")
            if np.dtype(x.dtype) != np.dtype(k_cache.dtype):
                raise TypeError(f"{name} must have k_cache's dtype {np.dtype(k_cache.dtype)}, got {np.dtype(x.dtype)}")
        for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
            if lib == "numpy" and not x.flags.writeable:
                raise ValueError(f"{name} must be writeable: the new k and v are written into it")
        new = k.shape[1]
    if cache_seqlens is None:
        lengths = np.full(batch, capacity - new, np.int64)
    elif isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        lengths = np.full(batch, int(cache_seqlens), np.int64)
    elif not read_lengths:  # _host_ints' checks that read no value
        _ints_unread("cache_seqlens", cache_seqlens, lib)
        if tuple(cache_seqlens.shape) != (batch,):
            raise ValueError(f"cache_seqlens must have shape (batch,) = ({batch},), got {tuple(cache_seqlens.shape)}")
        lengths = None
    else:
        lengths = _host_ints("cache_seqlens", cache_seqlens, lib, 1, "(batch,)")
        if lengths.shape != (batch,):
            raise ValueError(f"cache_seqlens must have shape (batch,) = ({batch},), got {tuple(cache_seqlens.shape)}")
    if lengths is not None and lengths.size and (lengths.min() < 0 or lengths.max() + new > capacity):
        raise ValueError(f"cache_seqlens must lie in [0, {capacity - new}] (the cache holds {capacity} tokens per "
                         f"sequence and {new} are appended), got {lengths.min()}..{lengths.max()}")
    if table is not None and batch:
        used = -(-(lengths + new) // block_size)  # blocks each sequence reads
        writer = {}  # physical block -> the sequence that appends into it
        for b in range(batch):
            ids = table[b, :used[b]]
            if ids.size and (ids.min() < 0 or ids.max() >= k_cache.shape[0]):
                raise ValueError(f"block_table[{b}] must hold block indices in [0, {k_cache.shape[0]}) for its "
                                 f"{used[b]} used blocks, got {ids.min()}..{ids.max()}")
            # blocks shared between sequences (a common prefix) are read by both; appended into by two
            # in one call, the later write would win in some order: refused
            for block in (table[b, lengths[b] // block_size:used[b]] if new else ()):
                other = writer.setdefault(int(block), b)
                if other != b:
                    raise ValueError(f"block_table maps the tokens appended to sequences {other} and {b} into the "
                                     f"same physical block {int(block)}: each sequence must append into blocks of "
                                     f"its own")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral)
                                   or num_splits < 1):
        raise ValueError(f"num_splits must be None or an int >= 1, got {num_splits!r}")
    return lib, table, block_size, lengths, new, num_splits or 1


def _runs(ids, mergeable: bool) -> list:
    """Logical block ranges [n0, n1) whose physical blocks ids[n0:n1] are consecutive (when the
    cache's blocks lie back to back in memory, `mergeable`): each is one contiguous piece of a
    paged cache, readable as a view."""
    runs, start = [], 0
    for n in range(1, len(ids) + 1):
        if n == len(ids) or not mergeable or ids[n] != ids[n - 1] + 1:
            runs.append((start, n))
            start = n
    return runs


def _pieces(k_cache, v_cache, b, table, block_size, n, splits) -> list:
    """(first key, k piece, v piece): views, no copies, that cover sequence b's first n keys in
    order, cut into `splits` parts of about equal length (and at the paged cache's run ends)."""
    if table is None:
        runs = [(0, n, k_cache[b:b + 1], v_cache[b:b + 1])]
    else:
        # blocks p, p + 1, ... are one (1, m * block_size, heads_kv, head_dim) view only where the
        # cache's block stride is a whole block (a strided cache reads block by block)
        mergeable = all(x.strides[0] == x.shape[1] * x.strides[1] for x in (k_cache, v_cache))
        runs = []
        for n0, n1 in _runs(table[b, :-(-n // block_size)], mergeable):
            p0, rows = int(table[b, n0]), (1, (n1 - n0) * block_size)
            runs.append((n0 * block_size, min(n1 * block_size, n),
                         *(x[p0:p0 + n1 - n0].reshape(rows + tuple(x.shape[2:])) for x in (k_cache, v_cache))))
    step = max(1, -(-n // splits))
    cuts = list(range(0, n, step)) + [n]
    pieces = []
    for j0, j1, kk, vv in runs:
        for c0, c1 in zip(cuts[:-1], cuts[1:]):
            lo, hi = max(j0, c0), min(j1, c1)
            if lo < hi:
                pieces.append((lo, kk[:, lo - j0:hi - j0], vv[:, lo - j0:hi - j0]))
    return pieces


@_interop.accepts_foreign_arrays
def attention_with_kvcache(q, k_cache, v_cache, *, k=None, v=None, cache_seqlens=None, block_table=None,
                           causal=False, window=None, softcap=None, alibi_slopes=None, scale=None,
                           return_lse=False, num_splits=None, backend="auto", dtype=None, check_offsets=True):
    """Attention of q over a KV cache (forward only, as flash-attn's flash_attn_with_kvcache).

    q (batch, seqlen_q, heads_q, head_dim). A contiguous cache: k_cache (batch, seqlen_cache, heads_kv,
    head_dim) and v_cache (..., head_dim_v); a paged one: (num_blocks, block_size, heads_kv, head_dim) and
    (..., head_dim_v) with block_table int32 (batch, max_blocks_per_seq) mapping sequence b's logical
    block n to a physical block. head_dim_v may differ from head_dim (README, "head_dim_v"), and v_cache
    may be a view of k_cache's first head_dim_v columns (MLA's shared latent; where the two share memory,
    v's appended values are the ones that land, so pass v as the same view of k). cache_seqlens: None (the
    whole cache), an int, or int32 (batch,): the tokens cached per sequence. k (batch, seqlen_new,
    heads_kv, head_dim) and v (..., head_dim_v), optional: written into the cache in place at
    cache_seqlens[b] ..., then attention runs over cache_seqlens[b] + seqlen_new keys, causal aligned
    bottom-right per sequence; the caller advances cache_seqlens. A paged cache's blocks may be shared
    between sequences (a common prefix) for reading; two sequences that append into the same physical
    block in one call are refused (ValueError), as the write order between
    them is not defined. num_splits
    splits each sequence's keys into (at most) that many parts, merged by the lse rule: the result
    depends on it only through rounding. None: the cupy backend splits inside one launch when the
    grid would hold at most two CTAs per SM (cupy_backend.split_plan); the others do not split.
    On the cupy backend the attention is one launch for every sequence (split-KV inside it), after one
    for the append (the module docstring); its lse is then a (batch, heads_q, seqlen_q) view of a
    (heads_q, batch x seqlen_q) array.
    check_offsets=False (cache_seqlens an int32 array of q's library) skips the copy of the lengths and
    of block_table to the host, and their checks, where the backend reads them itself (cupy: the append
    and the one-launch attention clamp them into the cache): lengths or blocks that break the rule give
    garbage, in bounds, never an access outside the arrays; valid ones the same bits as checked. Two
    sequences appending into one physical block are then not refused: their write order is undefined.
    Where the backend loops over the sequences on the host they are read and checked anyway.
    Returns out, or (out, lse).
    """
    keywords = dict(k=k, v=v, cache_seqlens=cache_seqlens, block_table=block_table, causal=causal, window=window,
                    softcap=softcap, alibi_slopes=alibi_slopes, scale=scale, return_lse=return_lse,
                    num_splits=num_splits, backend=backend, dtype=dtype)
    return_lse = _checks.check_bool("return_lse", return_lse)
    check_offsets = _checks.check_bool("check_offsets", check_offsets)
    backend = _checks.check_backend_name(backend)
    unread = not check_offsets and hasattr(cache_seqlens, "shape")
    lib, table, block_size, lengths, new, splits = _cache_plan(q, k_cache, v_cache, k, v, cache_seqlens,
                                                               block_table, num_splits, read_lengths=not unread)
    batch, paged = q.shape[0], block_table is not None
    slopes0 = None if alibi_slopes is None else _slopes_for(alibi_slopes, 0, batch)
    p = _checks.problem(q[:1], k_cache[None, 0] if paged else k_cache[:1, :1], v_cache[None, 0] if paged
                        else v_cache[:1, :1], causal, scale, dtype, lib, window, softcap, slopes0)
    mod = _checks.select_backend(backend, lib, p)
    if lengths is None and not (hasattr(mod, "cache_plan") and hasattr(mod, "append_kv") and batch and q.shape[1]
                                and all(_rows(x) is not None for x in ((q,) if paged else (q, k_cache, v_cache)))):
        # the lengths are needed on the host (the sequences looped over there): read and checked, as by default
        return attention_with_kvcache(q, k_cache, v_cache, **keywords)

    # append the new tokens (after every check: nothing is written for a call that is refused): in one
    # launch where the backend has a kernel for it (cupy: append_kv, which reads the lengths and the
    # table on the device), else token by token
    device_lengths = None  # the lengths as the backend's kernels read them
    if batch and hasattr(mod, "append_kv"):
        device_lengths = (cache_seqlens if backends.array_library(cache_seqlens) == lib
                          else mod.allocate(q, (batch,), np.int32, 0))
        if device_lengths is not cache_seqlens:
            device_lengths[...] = lengths.astype(np.int32)
    if new and device_lengths is not None:
        mod.append_kv(p.dtype, k_cache, v_cache, k, v, device_lengths, block_table)
        new_written = True
    else:
        new_written = False
    for b in range(batch if new and not new_written else 0):
        start = int(lengths[b])
        if table is None:
            k_cache[b, start:start + new], v_cache[b, start:start + new] = k[b], v[b]
            continue
        for j in range(new):
            block, at = int(table[b, (start + j) // block_size]), (start + j) % block_size
            k_cache[block, at], v_cache[block, at] = k[b, j], v[b, j]

    if hasattr(mod, "cache_plan") and device_lengths is not None:
        done = _cache_in_one_launch(mod, q, k_cache, v_cache, device_lengths, new, block_table, causal, scale, dtype,
                                    lib, window, softcap, alibi_slopes, num_splits)
        if done is not None:
            return done if return_lse else done[0]
    out = mod.allocate(q, out_shape(q.shape, v_cache.shape), p.carrier, 0)
    lse = mod.allocate(q, (batch,) + p.lse_shape[1:], p.lse_dtype, -np.inf)  # p is of one sequence
    Sq = q.shape[1]
    # a backend that splits the keys inside one launch (cupy: split_plan) gets the splits, None
    # included (its heuristic); the others get one call per split
    in_launch = hasattr(mod, "split_plan")
    xp = _merge.library(q)
    for b in range(batch):
        n = int(lengths[b]) + new
        kw = dict(causal=causal, window=window, softcap=softcap, alibi_slopes=_slopes_for(alibi_slopes, b, batch),
                  scale=scale, backend=mod.NAME, dtype=dtype, num_splits=num_splits if in_launch else 1)
        pieces = _pieces(k_cache, v_cache, b, table, block_size, n, 1 if in_launch else splits)
        qb = q[b:b + 1]
        if len(pieces) > 1 and p.acc_dtype != p.carrier:
            # parts of 16-bit values run on their values widened to float32 (exactly), so that out is
            # rounded to the storage dtype once, after the merge, as one call's is: parts stored in
            # float16 first would add a second rounding (beyond the one tolerance rule)
            qb = _merge.widen(xp, qb, p.dtype)
            pieces = [(j0, _merge.widen(xp, kk, p.dtype), _merge.widen(xp, vv, p.dtype)) for j0, kk, vv in pieces]
            kw["dtype"] = None
        parts = [_api.forward(qb, kk, vv, diagonal=n - Sq - j0, **kw) for j0, kk, vv in pieces]
        if not parts:
            continue  # no key: out 0, lse -inf
        o, l = parts[0] if len(parts) == 1 else _merge.merge([o for o, _ in parts], [l for _, l in parts],
                                                               dtype=kw["dtype"])
        out[b:b + 1], lse[b:b + 1] = (o, l) if o.dtype == p.carrier else (_merge.store(xp, o, p.dtype, p.carrier), l)
    return (out, lse) if return_lse else out


def _rows(x):
    """x (batch, seqlen, heads, head_dim) as a view (batch x seqlen, heads, head_dim), or None where its
    strides allow none (reshape would copy)."""
    if x.shape[0] > 1 and x.strides[0] != x.shape[1] * x.strides[1]:
        return None
    return x.reshape((x.shape[0] * x.shape[1],) + tuple(x.shape[2:]))


def _cache_in_one_launch(mod, q, k_cache, v_cache, lengths, new, block_table, causal, scale, dtype, lib, window,
                         softcap, alibi_slopes, num_splits):
    """attention_with_kvcache as one packed batch in one launch (forward_varlen: sequence b's queries
    q[b], its keys the first lengths[b] + new positions of its cache, lengths the device array the kernel
    reads as seqused_k): a contiguous cache's k_cache[b], packed rows; a paged cache's blocks, read
    through block_table by the kernel. Split-KV inside that launch as the backend's cache_plan says
    (num_splits). Where q (or a contiguous cache) is no view of packed rows, returns None: it ran nothing
    (the per-sequence path runs); else (out, lse), lse a (batch, heads_q, seqlen_q) view of a (heads_q,
    batch x seqlen_q) array."""
    batch, Sq, heads_q, _ = q.shape
    paged = block_table is not None
    packed = [_rows(q)] + ([k_cache, v_cache] if paged else [_rows(x) for x in (k_cache, v_cache)])
    if any(x is None for x in packed) or batch == 0 or Sq == 0:
        return None
    pq, pk, pv = packed
    slopes0 = None if alibi_slopes is None else _slopes_for(alibi_slopes, 0, batch)
    # the keys a sequence can address: its cache row, or its table's blocks (none in a cache of no block)
    if paged:
        capacity = block_table.shape[1] * k_cache.shape[1] if k_cache.shape[0] else 0
    else:
        capacity = k_cache.shape[1]
    p = _checks.problem(pq[None], *((x[None, 0] for x in (k_cache, v_cache)) if paged else (pk[None], pv[None])),
                        causal, scale, dtype, lib, window, softcap, slopes0)
    p = dataclasses.replace(p, seqlen_k=capacity) if paged else p
    split = mod.cache_plan(p, pq, pk, pv, batch, capacity, num_splits)
    # the offsets of equal parts (a paged sequence's keys start at its table's first block: offsets 0),
    # kept by the backend between calls
    cu_q, cu_k = mod.even_offsets(q, batch, Sq), mod.even_offsets(q, batch, 0 if paged else capacity)
    out = mod.allocate(q, out_shape(pq.shape, v_cache.shape), p.carrier, 0)
    lse = mod.allocate(q, (heads_q, batch * Sq), p.lse_dtype, -np.inf)
    mod.forward_varlen(p, pq, pk, pv, cu_q, cu_k, out, lse, alibi_slopes=alibi_slopes, seqused_k=lengths,
                       split=split, seqused_add=new, block_table=block_table)
    return out.reshape(out_shape(q.shape, v_cache.shape)), lse.reshape(heads_q, batch, Sq).transpose(1, 0, 2)
