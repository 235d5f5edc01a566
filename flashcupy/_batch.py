"""Leading batch dimensions: q of shape (*batch, seqlen_q, heads_q, head_dim), folded into the one batch
axis every backend takes, without a copy.

Structural biology lays attention out over several batch-like dimensions (MSA row attention: q
(batch, rows, residues, heads, head_dim) with a pair bias (batch, 1, heads, residues, residues)
shared by every row; triangle attention along the rows or, as a transposed view, the columns of a
pair representation). The backends and their kernels address one batch index b per array (a stride
for it, 0 where a bias or mask broadcasts); so a call is cut here into calls on rank-4 views:

- the leading dimensions split into the folded ones, G, whose indices become the views' one batch
  axis, and the looped ones, whose every index is a call of its own;
- G is the set of dimensions with the largest product (the fewest calls) that every input can
  fold: for each array, walking G's dimensions in order (row-major, so that b means the same
  multi-index for every array), each dimension's stride is the next one's times its size (dimensions
  of size 1 aside), and a bias or mask is either broadcast (size 1) or full along all of G; among
  sets of equal product, those that loop over no dimension a bias broadcasts over come first;
- the outputs are allocated whole, contiguous (or given: flashcupy.jax's XLA buffers), and each
  call writes its own views of them (into=, flashcupy/_api.py);
- dbias: a call's dbias is the bias's view over G, summed by the backend over G where the bias
  broadcasts; where it broadcasts over a looped dimension too, the calls' dbias are added in the
  accumulation dtype, in a fixed order (the looped indices in row-major order), and rounded once.

In the common layouts every dimension folds: contiguous q, k, v fold all their leading dimensions,
MSA row attention's pair bias (batch, 1, ...) folds with batch 1, and triangle attention around the
ending node (a transposed view of the pair representation) folds too when batch is 1. A layout that
does not fold costs one call (one set of launches on a GPU) per looped index, never a copy.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from ._problem import out_shape


def _folds(shape, strides, dims) -> bool:
    """Whether dimensions `dims` (in order) of an array of this shape and these strides (in elements
    or bytes, alike) are one dimension: each stride the next one's times the next size."""
    live = [d for d in dims if shape[d] != 1]
    return all(strides[a] == shape[b] * strides[b] for a, b in zip(live[:-1], live[1:]))


class Fold:
    """How the leading dimensions of one call split into folded (G) and looped ones.

    full: the inputs that have every leading dimension (q, k, v, out, dout, lse, per-batch slopes);
    broadcast: the inputs broadcastable to the leading dimensions (bias, mask), already given every
    leading dimension (size 1 where they broadcast)."""

    def __init__(self, batch: tuple, full: list, broadcast: list, suffix: bool = False):
        self.batch = tuple(batch)
        n = len(batch)
        best = None
        for size in range(n, -1, -1):
            # suffix (dropout): G only the last dimensions, so that b of a view plus its call's first
            # is b of the whole (dropout_origin)
            for dims in [tuple(range(n - size, n))] if suffix else itertools.combinations(range(n), size):
                if not all(_folds(x.shape, x.strides, dims) for x in full):
                    continue
                if not all(self._broadcast_folds(x, dims) for x in broadcast):
                    continue
                looped = [d for d in range(n) if d not in dims]
                key = (math.prod(batch[d] for d in dims),
                       not any(x.shape[d] == 1 and batch[d] > 1 for x in broadcast for d in looped))
                if best is None or key > best[0]:
                    best = key, dims
        self.folded = best[1]
        self.looped = tuple(d for d in range(n) if d not in self.folded)
        self.size = math.prod(batch[d] for d in self.folded)  # the views' batch

    @staticmethod
    def _broadcast_folds(x, dims) -> bool:
        sizes = {x.shape[d] == 1 for d in dims}
        return len(sizes) <= 1 and (True in sizes or _folds(x.shape, x.strides, dims))

    def calls(self):
        """The looped indices, one tuple (over self.looped) per call, in row-major order."""
        return itertools.product(*(range(self.batch[d]) for d in self.looped))

    def first(self, index) -> int:
        """The flattened batch index, over every leading dimension, of the first batch of the call at
        `index`: where its views start in dropout's keep mask (G a suffix of the dimensions)."""
        flat = 0
        for d, i in zip(self.looped, index):
            flat = flat * self.batch[d] + i
        return flat * self.size

    def view(self, x, index):
        """x's rank-4 (lse's rank-3) view for the call at `index` (over self.looped): the looped
        dimensions taken at index (at 0 where x broadcasts), the folded ones as one axis (of size 1
        where x broadcasts along them)."""
        n = len(self.batch)
        picks = dict(zip(self.looped, index))
        part = x[tuple((0 if x.shape[d] == 1 else picks[d]) if d in picks else slice(None) for d in range(n))]
        live = [i for i, d in enumerate(self.folded) if x.shape[d] != 1]  # part's dimensions that count
        size = math.prod(part.shape[i] for i in live)
        step = part.strides[live[-1]] if live else 0
        return _strided(part, (size,) + tuple(part.shape[len(self.folded):]),
                        (step,) + tuple(part.strides[len(self.folded):]))


def _strided(x, shape, strides):
    """A view of x's memory with this shape and these strides (bytes), for NumPy, CuPy and Numba."""
    if isinstance(x, np.ndarray):
        return np.lib.stride_tricks.as_strided(x, shape, strides)
    if type(x).__module__.split(".")[0] == "cupy":
        import cupy
        return cupy.lib.stride_tricks.as_strided(x, shape, strides)
    from numba.cuda.cudadrv.devicearray import DeviceNDArray
    return DeviceNDArray(shape, strides, x.dtype, stream=x.stream, gpu_data=x.gpu_data)


# ----------------------------------------------------------------------------
# the whole call's checks (before any work), and the calls on views


def leading(q, k, v) -> tuple:
    """The leading (batch) dimensions q, k and v share: q (*batch, seqlen_q, heads_q, head_dim), k and
    v (*batch, seqlen_k, heads_kv, head_dim), at least one of them."""
    for name, x, what in (("q", q, "seqlen_q, heads_q"), ("k", k, "seqlen_k, heads_kv"), ("v", v, "seqlen_k, heads_kv")):
        if x.ndim < 4:
            raise ValueError(f"{name} must have rank at least 4 (*batch, {what}, head_dim), got shape {tuple(x.shape)}")
    batch = tuple(q.shape[:-3])
    for name, x in (("k", k), ("v", v)):
        if tuple(x.shape[:-3]) != batch:
            raise ValueError(f"{name} must have q's leading (batch) dimensions {batch}, got {tuple(x.shape[:-3])} "
                             f"(shape {tuple(x.shape)})")
    return batch


def stand_in(x):
    """An empty rank-4 view of x with its last three dimensions, dtype and strides: what the checks of
    a rank-4 call read (dtypes, strides, head counts), before any work."""
    return _strided(x, (0,) + tuple(x.shape[-3:]), (0,) + tuple(x.strides[-3:]))


def padded(x, rank: int):
    """x with size-1 dimensions in front up to `rank` (a view; None stays None)."""
    if x is None or x.ndim == rank:
        return x
    extra = rank - x.ndim
    return _strided(x, (1,) * extra + tuple(x.shape), (0,) * extra + tuple(x.strides))


def _calls(fold: Fold, full: dict, broadcast: dict, kw: dict):
    """(looped index, {name: view}) per call: the views of every input of the call, and with dropout
    its origin in the keep mask (dropout_origin)."""
    origin = kw.get("dropout_origin") or (0, 0, 0, 0)
    for index in fold.calls():
        views = {n: fold.view(x, index) for n, x in full.items()}
        views.update({n: None if x is None else fold.view(x, index) for n, x in broadcast.items()})
        if kw.get("dropout_p"):
            views["dropout_origin"] = (origin[0] + fold.first(index), *origin[1:])
        yield index, views


def plan(batch: tuple, full: dict, broadcast: dict, kw: dict) -> Fold:
    """The fold of a call whose inputs are `full` (every leading dimension) and `broadcast` (bias,
    mask: padded to every leading dimension, or None); with dropout, of a suffix of the dimensions."""
    if math.prod(batch) == 0:  # nothing to compute: one call on empty views, which any layout folds
        fold = Fold((), [], [])
        fold.batch, fold.folded, fold.looped, fold.size = tuple(batch), tuple(range(len(batch))), (), 0
        return fold
    return Fold(batch, list(full.values()), [x for x in broadcast.values() if x is not None],
                suffix=bool(kw.get("dropout_p")))


def _empty(like, shape, dtype, calls: int):
    """An uninitialised array of like's library (NumPy, CuPy; Numba for a call that folds whole)."""
    if isinstance(like, np.ndarray):
        return np.empty(shape, dtype)
    if type(like).__module__.split(".")[0] == "cupy":
        import cupy
        return cupy.empty(shape, dtype)
    if calls > 1:
        raise ValueError("Numba device arrays whose leading (batch) dimensions do not fold into one (see "
                         "flashcupy/_batch.py) are not supported: pass them contiguous, or as CuPy arrays")
    from numba import cuda
    return cuda.device_array(shape, dtype)


class Sum:
    """dbias of a bias that broadcasts over a looped dimension: the calls' dbias added into a whole
    dbias (of the bias padded to every leading dimension) in the accumulation dtype, in the calls'
    order, and rounded once to the bias's dtype."""

    def __init__(self, fold: Fold, bias, value: str, acc):
        from . import _merge
        self.fold, self.value, self.carrier = fold, value, np.dtype(bias.dtype)
        self.xp = _merge.library(bias)
        self.total = self.xp.zeros(bias.shape, acc)

    def add(self, index, x) -> None:
        from . import _merge
        place = self.fold.view(self.total, index)
        place += _merge.widen(self.xp, x, self.value, self.total.dtype)

    def result(self, shape):
        from . import _merge
        return _merge.store(self.xp, self.total, self.value, self.carrier).reshape(shape)


def _inputs(batch, named: dict, kw: dict) -> tuple:
    """(full, broadcast) inputs of a call: the named arrays and per-batch slopes, then the bias and
    mask padded to every leading dimension."""
    full = dict(named)
    slopes = kw.get("alibi_slopes")
    if slopes is not None and slopes.ndim > 1:
        full["alibi_slopes"] = slopes
    rank = len(batch) + 3
    return full, {n: padded(kw.get(n), rank) for n in ("bias", "mask")}


def forward(fn, q, k, v, kw: dict, carrier, lse_dtype, into=None) -> tuple:
    """fn (the rank-4 forward) over the folded views of q, k, v and the modifiers, each call writing
    its views of the whole out and lse (`into`, or new ones)."""
    batch = tuple(q.shape[:-3])
    full, broadcast = _inputs(batch, {"q": q, "k": k, "v": v}, kw)
    fold = plan(batch, full, broadcast, kw)
    calls = math.prod(batch[d] for d in fold.looped)
    out, lse = into or (_empty(q, out_shape(q.shape, v.shape), carrier, calls),
                        _empty(q, batch + (q.shape[-2], q.shape[-3]), lse_dtype, calls))
    for index, views in _calls(fold, full, broadcast, kw):
        q4, k4, v4 = views.pop("q"), views.pop("k"), views.pop("v")
        fn(q4, k4, v4, into=(fold.view(out, index), fold.view(lse, index)), **(kw | views))
    return out, lse


def backward(fn, dout, q, k, v, out, lse, kw: dict, carrier, acc, into=None) -> tuple:
    """fn (the rank-4 backward) over the folded views, each call writing its views of the whole dq,
    dk, dv and (unless the bias broadcasts over a looped dimension: Sum) dbias, of the bias's shape."""
    batch = tuple(q.shape[:-3])
    named = {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse}
    if kw.get("dlse") is not None:  # the gradient of lse, folded as lse
        named["dlse"] = kw["dlse"]
    full, broadcast = _inputs(batch, named, kw)
    fold = plan(batch, full, broadcast, kw)
    calls = math.prod(batch[d] for d in fold.looped)
    bias = broadcast["bias"] if kw.get("return_dbias", True) and not kw.get("dq_only") else None  # None: no dbias
    wanted = (q,) if kw.get("dq_only") else (q, k, v)
    whole = list(into or [_empty(q, x.shape, carrier, calls) for x in wanted])
    if bias is not None and len(whole) == 3:
        whole.append(_empty(bias, kw["bias"].shape, bias.dtype, calls))
    dbias = None if bias is None else padded(whole[3], len(batch) + 3)
    summed = None
    if bias is not None and any(bias.shape[d] == 1 and batch[d] > 1 for d in fold.looped):
        value = "float32" if np.dtype(bias.dtype) == np.float32 else (kw.get("dtype") or np.dtype(bias.dtype).name)
        summed = Sum(fold, bias, value, acc)
    for index, views in _calls(fold, full, broadcast, kw):
        args = [views.pop(n) for n in ("dout", "q", "k", "v", "out", "lse")]
        places = [fold.view(x, index) for x in whole[:len(wanted)]]
        if dbias is not None and summed is None:
            places.append(fold.view(dbias, index))
        grads = fn(*args, into=tuple(places), **(kw | views))
        if summed is not None:
            summed.add(index, grads[3])
    if summed is not None:
        dbias[...] = summed.result(dbias.shape)
    return tuple(whole)


def probs(fn, q, k, lse, rows, kw: dict, lse_dtype, into=None):
    """fn (the rank-4 probs) over the folded views: (*batch, heads_q, len(rows), seqlen_k), each call
    writing its view of the whole (`into`, or a new one)."""
    batch = tuple(q.shape[:-3])
    full, broadcast = _inputs(batch, {"q": q, "k": k, "lse": lse}, kw)
    fold = plan(batch, full, broadcast, kw)
    shape = batch + (q.shape[-2], rows.size, k.shape[-3])
    P = into if into is not None else _empty(q, shape, lse_dtype, math.prod(batch[d] for d in fold.looped))
    for index, views in _calls(fold, full, broadcast, kw):
        q4, k4, lse4 = views.pop("q"), views.pop("k"), views.pop("lse")
        fn(q4, k4, lse4, rows=rows, into=fold.view(P, index), **(kw | views))
    return P
