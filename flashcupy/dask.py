"""Attention on Dask arrays: one task per pair of a query chunk and a key chunk that it can see.

    import dask.array as da, flashcupy.dask
    q = da.from_array(q_np, chunks=(1, 4096, 8, -1))          # (batch, seqlen_q, heads_q, head_dim)
    out, lse = flashcupy.dask.attention(q, k, v, causal=True, return_lse=True)   # lazy
    out, vjp = flashcupy.dask.attention_vjp(q, k, v, causal=True)
    dq, dk, dv = vjp(dout)                                    # lazy too
    dask.compute(out, dq, dk, dv)                             # any scheduler, any cluster
    P = flashcupy.dask.attention_probs(q, k, lse, causal=True)    # the weights, a block per pair

The graph (extra `dask`): for each (batch chunk, head chunk, query chunk), one task per key chunk
that some of its queries see under causal and window; pairs outside the band are not in the graph.
Each pair is an ordinary `flashcupy.attention` call on the chunks (NumPy or CuPy: the backend
follows the chunk type), told the chunks' global positions as its diagonal offset, so causal,
window and ALiBi mean what they mean on the whole arrays; a bias or mask, on the grid of the
pairs, gives each pair its own block. The pairs' (out, lse) are combined by the lse rule of
`flashcupy.merge` in a tree, in the accumulation dtype, and stored once.

The backward runs every pair again with the global out and lse (P = exp(s - lse) and
D = rowsum(dout ∘ out) are then exactly the whole call's), and sums dq over key chunks and dk, dv
over query chunks, and dbias over the pairs that share a bias block (every chunk along a dimension
the bias broadcasts), each in a tree of fixed shape: the bits do not depend on the scheduler (nor,
with deterministic=True, on the CuPy tensor-core kernels' atomics).

attention_probs: P (*batch, heads_q, seqlen_q, seqlen_k) in blocks of q's and k's chunks, each block
one attention_probs call on its pair with the whole row's lse (so exactly the whole call's P), and
zeros for a pair outside the band; rows asked for are Dask's own indexing of that array, which
computes only the query chunks it keeps.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from . import _api, _batch, _checks, _merge, backends
from ._problem import accumulation_dtype, out_shape

SPLIT_EVERY = 2  # parts per merge or sum task: a binary tree frees pair results soonest (fan-in 8: 2x the memory)


def _dask():
    try:
        import dask.array as da
        from dask.base import tokenize
        from dask.highlevelgraph import HighLevelGraph
    except ImportError:
        raise ImportError("flashcupy.dask needs Dask: pip install 'flashcupy[dask]'") from None
    return da, tokenize, HighLevelGraph


# ----------------------------------------------------------------------------
# validation and the plan


def _offsets(chunks) -> list:
    return list(itertools.accumulate(chunks, initial=0))


class _Plan:
    """The validated call: the Problem of the whole arrays, the chunk grids, and which pairs of a
    query chunk and a key chunk some query sees."""

    def __init__(self, q, k, v, causal, window, softcap, alibi_slopes, scale, backend, dtype, bias=None, mask=None,
                 dropout_p=0.0, dropout_seed=None):
        da, _, _ = _dask()
        for name, x in (("q", q), ("k", k), ("v", v)):
            if not isinstance(x, da.Array):
                raise TypeError(f"{name} must be a dask.array.Array (use flashcupy.attention for "
                                f"{_checks.describe(x)}), got {_checks.describe(x)}")
        self.lib = backends.array_library(q._meta)
        if self.lib not in ("numpy", "cupy"):
            raise TypeError(f"q's chunks must be numpy or cupy arrays, got {_checks.describe(q._meta)}")
        for name, x in (("k", k), ("v", v)):
            if backends.array_library(x._meta) != self.lib:
                raise TypeError(f"{name}'s chunks must be of q's array library {self.lib}, "
                                f"got {_checks.describe(x._meta)}")
        backend = _checks.check_backend_name(backend)
        # the whole arrays' checks, on stand-ins of their shape and dtype that hold no memory (their
        # leading dimensions folded into one: the Problem of the whole call)
        stand_in = {n: np.broadcast_to(np.empty((), x.dtype), x.shape) for n, x in (("q", q), ("k", k), ("v", v))}
        self.batch = _checks.check_leading(self.lib, stand_in["q"], stand_in["k"], stand_in["v"], alibi_slopes)
        L = self.lead = len(self.batch)
        # (the product, not -1, which cannot be solved for where a dimension is 0)
        folded = {n: x.reshape((math.prod(x.shape[:L]),) + x.shape[L:]) for n, x in stand_in.items()}
        slopes = alibi_slopes
        if slopes is not None and slopes.ndim > 1:
            slopes = slopes.reshape(math.prod(slopes.shape[:-1]), slopes.shape[-1])
        self.p = _checks.problem(folded["q"], folded["k"], folded["v"], causal, scale, dtype, self.lib,
                                 window, softcap, slopes, dropout_p=dropout_p, dropout_seed=dropout_seed)
        _checks.select_backend(backend, self.lib, self.p)
        # dropout: a pair's calls number their batches from the block's first (_batch folds them in
        # row-major order), which is the whole call's numbering only where no leading dimension but the
        # first is cut into several chunks
        self.dropout = (self.p.dropout_p, self.p.dropout_seed) if self.p.dropout else None
        cut = [d for d in range(1, L) if len(q.chunks[d]) > 1]
        if self.dropout and cut:
            raise ValueError(f"with dropout, q's leading dimensions but the first must each be one chunk (the keep "
                             f"mask numbers the batches of the whole call), got chunks {q.chunks[:L]} "
                             f"(q.rechunk({{{cut[0]}: -1}}))")
        if k.chunks[:-1] != v.chunks[:-1]:
            raise ValueError(f"k and v must have the same chunks, got k {k.chunks} and v {v.chunks} "
                             f"(v.rechunk(k.chunks))")
        if (q.chunks[L + 2] != (self.p.head_dim,) or k.chunks[L + 2] != (self.p.head_dim,)
                or v.chunks[L + 2] != (self.p.head_dim_v,)):
            raise ValueError(f"q, k and v must hold head_dim in one chunk, got q {q.chunks[L + 2]}, k "
                             f"{k.chunks[L + 2]} and v {v.chunks[L + 2]} (x.rechunk({{{L + 2}: -1}}))")
        if q.chunks[:L] != k.chunks[:L]:
            raise ValueError(f"q, k and v must have the same batch chunks, got q {q.chunks[:L]} and k "
                             f"{k.chunks[:L]} (k.rechunk({dict(enumerate(q.chunks[:L]))}))")
        g = self.p.group
        if q.chunks[L + 1] != tuple(g * c for c in k.chunks[L + 1]):
            raise ValueError(
                f"q's head chunks must be k's and v's times the group size {g} (each query head chunk "
                f"holds the query heads of one kv head chunk), got q {q.chunks[L + 1]} and k {k.chunks[L + 1]} "
                f"(q.rechunk({{{L + 1}: {tuple(g * c for c in k.chunks[L + 1])}}}))")
        # bias and mask: the whole arrays' checks here, then one block per pair (_on_grid, block)
        full = self.batch + (q.shape[-2], q.shape[-3], k.shape[-3])
        grid = q.chunks[:L] + (q.chunks[L + 1], q.chunks[L], k.chunks[L])
        if bias is not None:
            self._check_modifier("bias", bias, full)
            _checks.check_bias_dtype(bias.dtype, self.p.carrier)
        if mask is not None:
            self._check_modifier("mask", mask, full)
            _checks.check_mask_dtype(mask.dtype)
        self.given_bias = bias
        self.bias, self.mask = _on_grid(bias, full, grid), _on_grid(mask, full, grid)
        self.window, self.softcap, self.alibi = window, softcap, alibi_slopes
        self.causal, self.scale, self.backend, self.dtype = causal, scale, backend, dtype
        self.q_chunks, self.k_chunks = q.chunks[L:], k.chunks[L:]  # (sequence, heads, head_dim)
        self.out_chunks = q.chunks[:-1] + ((self.p.head_dim_v,),)  # out's and dout's: v's head_dim
        self.out_shape = out_shape(q.shape, v.shape)
        self.batch_chunks = q.chunks[:L]
        self.q_off, self.k_off = _offsets(q.chunks[L]), _offsets(k.chunks[L])
        self.b_off, self.h_off = [_offsets(c) for c in q.chunks[:L]], _offsets(q.chunks[L + 1])

    def _check_modifier(self, name, x, full):
        da, _, _ = _dask()
        if isinstance(x, da.Array):
            lib = backends.array_library(x._meta)
            if lib != self.lib:
                raise TypeError(f"{name}'s chunks must be of q's array library {self.lib}, "
                                f"got {_checks.describe(x._meta)}")
            if not np.dtype(x.dtype).isnative:
                raise TypeError(f"{name} must have native byte order, got {np.dtype(x.dtype).str}")
        else:  # an array of the chunks' library, as attention takes it (made a dask array in _on_grid)
            _checks.check_modifier_array(name, x, self.lib)
        _checks.check_broadcastable(name, x, full)

    def block(self, x, b: tuple, h: int, i: int, j: int):
        """The key of x's (the bias's or the mask's, on the grid) block for the pair of query chunk i
        and key chunk j of batch block b and head chunk h; None without x."""
        if x is None:
            return None
        return (x.name, *(0 if len(c) == 1 else n for c, n in zip(x.chunks, (*b, h, i, j))))

    def as_given(self, dbias):
        """dbias on the grid in the bias's own shape, and chunks where it came as a dask array."""
        da, _, _ = _dask()
        given = self.given_bias
        dbias = dbias[(0,) * (dbias.ndim - given.ndim)]
        return dbias.rechunk(given.chunks) if isinstance(given, da.Array) else dbias

    def modifiers(self) -> list:
        """The bias and mask on the grid, those given."""
        return [x for x in (self.bias, self.mask) if x is not None]

    def batch_blocks(self):
        """The chunk indices along the leading dimensions, one tuple per batch block."""
        return itertools.product(*(range(len(c)) for c in self.batch_chunks))

    def sees(self, i: int, j: int) -> bool:
        """Whether some query of query chunk i sees some key of key chunk j (the band of p)."""
        return self.p.band.sees_block(*self.q_off[i:i + 2], *self.k_off[j:j + 2])

    def pairs(self) -> dict:
        """{query chunk: [key chunks it sees]}, for every query chunk."""
        return {i: [j for j in range(len(self.k_chunks[0])) if self.sees(i, j)]
                for i in range(len(self.q_chunks[0]))}

    def diagonal(self, i: int, j: int) -> int:
        """The pair's own diagonal: query r of chunk i is global query q_off[i] + r, key c of chunk
        j global key k_off[j] + c, and j_global <= i_global + diagonal becomes c <= r + this."""
        return self.q_off[i] + self.p.diagonal - self.k_off[j]

    def pair_keywords(self, kw: dict, b: tuple, h: int, i: int, j: int) -> dict:
        """keywords(b, h) of the pair of query chunk i and key chunk j: with dropout, the pair's origin in
        the whole call's keep mask (its first batch, head, query and key)."""
        if self.dropout is None:
            return kw
        first = 0
        for off, n, size in zip(self.b_off, b, self.batch):
            first = first * size + off[n]
        return dict(kw, dropout_p=self.dropout[0], dropout_seed=self.dropout[1],
                    dropout_origin=(first, self.h_off[h], self.q_off[i], self.k_off[j]))

    def keywords(self, b: tuple, h: int) -> dict:
        """attention's keywords for the chunks of batch block b (a chunk index per leading dimension)
        and head chunk h."""
        slopes = self.alibi
        if slopes is not None:
            hs = slice(self.h_off[h], self.h_off[h + 1])
            lead = tuple(slice(off[n], off[n + 1]) for off, n in zip(self.b_off, b))
            slopes = slopes[hs] if slopes.ndim == 1 else slopes[lead + (hs,)]
        return dict(causal=self.causal, window=self.window, softcap=self.softcap, alibi_slopes=slopes,
                    scale=self.scale, backend=self.backend, dtype=self.dtype)


# ----------------------------------------------------------------------------
# the tasks (plain functions of chunks: they run on whichever worker the scheduler picks)


def _on_grid(x, full: tuple, grid: tuple):
    """x (bias or mask: a dask array, or an array of the chunks' library, wrapped without a copy or
    a hash of its contents) as a dask array of full rank, chunked as the pairs are: q's chunks along
    the batch dimensions, heads_q and seqlen_q, k's along seqlen_k, and one chunk of 1 along each
    dimension it broadcasts (each pair's block is then a view the kernels broadcast themselves)."""
    if x is None:
        return None
    da, _, _ = _dask()
    rank = len(full)
    chunks = tuple(g if n == f else (1,) for n, f, g in zip((1,) * (rank - x.ndim) + tuple(x.shape), full, grid))
    if not isinstance(x, da.Array):
        return da.from_array(_batch.padded(x, rank), chunks=chunks, name=False)
    return x[(None,) * (rank - x.ndim)].rechunk(chunks)


def _pair_forward(q, k, v, bias, mask, diagonal, kw):
    """One pair: (out, lse) with out in the accumulation dtype, ready to merge."""
    out, lse = _api.forward(q, k, v, bias=bias, mask=mask, diagonal=diagonal, **kw)
    value, _ = _checks.check_dtypes({"q": q}, kw["dtype"])
    xp = _merge.library(q)
    return _merge.widen(xp, out, value, accumulation_dtype(value)), lse


def _no_keys(q, head_dim_v, kw):
    """A query chunk that sees no key chunk: out 0 (of v's head_dim) and lse -inf (the rule of attention)."""
    value, _ = _checks.check_dtypes({"q": q}, kw["dtype"])
    acc = accumulation_dtype(value)
    xp = _merge.library(q)
    B, S, H, _ = q.shape
    return xp.zeros((B, S, H, head_dim_v), acc), xp.full((B, H, S), -np.inf, acc)


def _merge_parts(*parts):
    """(out, lse) of several parts, out kept in the accumulation dtype."""
    outs, lses = [o for o, _ in parts], [lse for _, lse in parts]
    xp = _merge.library(lses[0])
    lse, weights = _merge.part_weights(xp, lses, np.dtype(lses[0].dtype))
    out = _add(*(_merge.per_row(w) * o for o, w in zip(outs, weights)))
    return out, lse


def _store_out(part, q, kw):
    value, carrier = _checks.check_dtypes({"q": q}, kw["dtype"])
    return _merge.store(_merge.library(q), part[0], value, carrier)


def _lse(part):
    return part[1]


def _pair_backward(dout, q, k, v, out, lse, dlse, bias, mask, diagonal, kw, deterministic, dbias=True):
    """One pair's (dq, dk, dv), and dbias with a bias (where dbias), in the accumulation dtype, ready
    to sum (dlse, the gradient of lse, or None: each pair adds P dlse over its own keys, P from the
    whole row's lse)."""
    value, _ = _checks.check_dtypes({"q": q}, kw["dtype"])
    acc = accumulation_dtype(value)
    xp = _merge.library(q)
    if bias is not None and dbias and bias.dtype != acc:
        # the same values (widened exactly: a dtype bias may hold), so the pair's dbias comes in the
        # accumulation dtype and is rounded once, after the sum over pairs
        bias = _merge.widen(xp, bias, value, acc)
    grads = _api.backward(dout, q, k, v, out, lse, bias=bias, mask=mask, dlse=dlse, diagonal=diagonal,
                          deterministic=deterministic, return_dbias=dbias, **kw)
    return tuple(_merge.widen(xp, g, value, acc) for g in grads[:3]) + grads[3:]


def _add(*xs):
    """The sum of arrays, left to right (a new array: parts other tasks own are never written)."""
    total = xs[0]
    for x in xs[1:]:
        total = total + x
    return total


def _gradient(which, grads):
    """One gradient (0: dq, 1: dk, 2: dv, 3: dbias) of a pair's: its own task, so a sum on another
    worker fetches that gradient alone, not the pair's tuple (with a bias, mostly dbias)."""
    return grads[which]


def _zeros_like(x, kw):
    value, _ = _checks.check_dtypes({"x": x}, kw["dtype"])
    return _merge.library(x).zeros(x.shape, accumulation_dtype(value))


def _store_grad(total, like, kw):
    value, carrier = _checks.check_dtypes({"x": like}, kw["dtype"])
    return _merge.store(_merge.library(like), total, value, carrier)


def _store_dbias(total, value, carrier):
    """dbias summed over pairs, rounded once to the bias's dtype (q's values' or float32)."""
    return _merge.store(_merge.library(total), total, value, carrier)


def _zeros(like, dtype):
    return _merge.library(like).zeros(like.shape, dtype)


# ----------------------------------------------------------------------------
# the graph


def _tree(graph: dict, name: str, index: tuple, parts: list, combine) -> tuple:
    """Key of a task combining `parts` (keys) by `combine(*values)`, in a tree of at most
    SPLIT_EVERY inputs per task, deterministic in shape and order."""
    level = 0
    while len(parts) > 1:
        groups = [parts[n:n + SPLIT_EVERY] for n in range(0, len(parts), SPLIT_EVERY)]
        parts = []
        for n, group in enumerate(groups):
            if len(group) == 1:
                parts.append(group[0])
                continue
            graph[(name, level, n) + index] = (combine, *group)
            parts.append((name, level, n) + index)
        level += 1
    return parts[0]


def _forward_graph(plan: _Plan, q, k, v, token: str):
    """(graph, lse graph, out name, lse name) of the forward: lse's tasks read keys of the first."""
    graph, lse_graph = {}, {}
    out_name, lse_name = f"flashcupy-attention-out-{token}", f"flashcupy-attention-lse-{token}"
    part_name, merged_name = f"flashcupy-pair-{token}", f"flashcupy-merged-{token}"
    nh = len(plan.q_chunks[1])
    for (i, js), b, h in itertools.product(plan.pairs().items(), list(plan.batch_blocks()), range(nh)):
        kw = plan.keywords(b, h)
        qk = (q.name, *b, i, h, 0)
        if js:
            parts = []
            for j in js:
                key = (part_name, *b, i, h, j)
                graph[key] = (_pair_forward, qk, (k.name, *b, j, h, 0), (v.name, *b, j, h, 0),
                              plan.block(plan.bias, b, h, i, j), plan.block(plan.mask, b, h, i, j),
                              plan.diagonal(i, j), plan.pair_keywords(kw, b, h, i, j))
                parts.append(key)
            merged = _tree(graph, merged_name, (*b, i, h), parts, _merge_parts)
        else:
            merged = (merged_name, "empty", *b, i, h)
            graph[merged] = (_no_keys, qk, plan.p.head_dim_v, kw)
        graph[(out_name, *b, i, h, 0)] = (_store_out, merged, qk, kw)
        lse_graph[(lse_name, *b, h, i)] = (_lse, merged)
    return graph, lse_graph, out_name, lse_name


def _meta(x, shape_rank, dtype):
    xp = _merge.library(x._meta)
    return xp.empty((0,) * shape_rank, dtype)


def _lse_chunks(q):
    L = q.ndim - 3
    return q.chunks[:L] + (q.chunks[L + 1], q.chunks[L])


def _forward(plan: _Plan, q, k, v):
    da, tokenize, HighLevelGraph = _dask()
    token = tokenize(q, k, v, plan.dropout, plan.causal, plan.window, plan.softcap, plan.alibi, plan.bias, plan.mask,
                     plan.scale, plan.backend, plan.dtype)
    graph, lse_graph, out_name, lse_name = _forward_graph(plan, q, k, v, token)
    # one layer per output array, as dask wants; lse's layer reads the merged parts in out's
    inputs = [q, k, v] + plan.modifiers()
    out = da.Array(HighLevelGraph.from_collections(out_name, graph, dependencies=inputs), out_name,
                   plan.out_chunks, meta=_meta(q, q.ndim, plan.p.carrier))
    lse = da.Array(HighLevelGraph.from_collections(lse_name, lse_graph, dependencies=[out]), lse_name,
                   _lse_chunks(q), meta=_meta(q, q.ndim - 1, plan.p.lse_dtype))
    return out, lse


def attention(q, k, v, *, causal=False, window=None, softcap=None, alibi_slopes=None, bias=None, mask=None,
              scale=None, return_lse=False, backend="auto", dtype=None, dropout_p=0.0, dropout_seed=None):
    """flashcupy.attention on dask arrays (BSHD, chunked along batch, sequence and heads; head_dim
    in one chunk; q's head chunks the kv head chunks times the group size; v's head_dim may differ
    from q's and k's). Returns lazy out (q's chunks but v's head_dim), and lse (batch, heads_q,
    seqlen_q) with return_lse=True. alibi_slopes is an array of
    the chunks' library, not a dask array. bias and mask (as attention's, broadcastable to
    (*batch, heads_q, seqlen_q, seqlen_k)) are dask arrays, rechunked to q's and k's chunks
    (one chunk along a dimension they broadcast), or arrays of the chunks' library. dropout_p,
    dropout_seed: as attention's, the keep mask that of the whole arrays (the leading dimensions
    but the first then in one chunk each)."""
    return_lse = _checks.check_bool("return_lse", return_lse)
    plan = _Plan(q, k, v, causal, window, softcap, alibi_slopes, scale, backend, dtype, bias, mask, dropout_p,
                 dropout_seed)
    out, lse = _forward(plan, q, k, v)
    return (out, lse) if return_lse else out


def _backward(plan: _Plan, dout, q, k, v, out, lse, dlse, deterministic, dbias=True):
    """(dq, dk, dv), and dbias with a bias where dbias is True (False: no pair spends work on it)."""
    da, tokenize, HighLevelGraph = _dask()
    token = tokenize(dout, q, k, v, out, lse, dlse, plan.dropout, plan.causal, plan.window, plan.softcap, plan.alibi,
                     plan.bias, plan.mask, plan.scale, plan.backend, plan.dtype, deterministic, dbias)
    dbias = dbias and plan.bias is not None
    outputs = ("dq", "dk", "dv") + (("dbias",) if dbias else ())
    graph = {g: {} for g in outputs}  # one layer per output; dk's, dv's and dbias's read dq's pairs
    pair_name, part_name = f"flashcupy-pair-grad-{token}", f"flashcupy-grad-part-{token}"
    names = {g: f"flashcupy-attention-{g}-{token}" for g in outputs}
    nh, nk = len(plan.q_chunks[1]), len(plan.k_chunks[0])
    pairs = plan.pairs()
    by_bias = {}  # {bias block: pairs that add to its dbias}, in the fixed order of the loops
    for b, h in itertools.product(list(plan.batch_blocks()), range(nh)):
        kw = plan.keywords(b, h)
        by_key = {j: [] for j in range(nk)}
        for i, js in pairs.items():
            qk = (q.name, *b, i, h, 0)
            parts = []
            for j in js:
                key = (pair_name, *b, i, h, j)
                bias = plan.block(plan.bias, b, h, i, j)
                graph["dq"][key] = (_pair_backward, (dout.name, *b, i, h, 0), qk, (k.name, *b, j, h, 0),
                                    (v.name, *b, j, h, 0), (out.name, *b, i, h, 0), (lse.name, *b, h, i),
                                    None if dlse is None else (dlse.name, *b, h, i), bias,
                                    plan.block(plan.mask, b, h, i, j), plan.diagonal(i, j),
                                    plan.pair_keywords(kw, b, h, i, j), deterministic, dbias)
                part = {}  # each gradient of the pair a task of its own (_gradient)
                for which, g in enumerate(outputs):
                    part[g] = (f"{part_name}-{g}", *b, i, h, j)
                    graph["dq"][part[g]] = (_gradient, which, key)
                parts.append(part["dq"])
                by_key[j].append(part)
                if dbias and bias is not None:
                    by_bias.setdefault(bias, []).append(part["dbias"])
            graph["dq"][(names["dq"], *b, i, h, 0)] = _summed(graph["dq"], f"{names['dq']}-sum", (*b, i, h), parts,
                                                              qk, kw)
        for j, parts in by_key.items():
            for g, x in (("dk", k), ("dv", v)):  # (x's block: the zeros of a key chunk no query sees)
                graph[g][(names[g], *b, j, h, 0)] = _summed(graph[g], f"{names[g]}-sum", (*b, j, h),
                                                            [part[g] for part in parts], (x.name, *b, j, h, 0), kw)
    if dbias:
        # every block of the bias on the grid: the sum of its pairs' dbias (a bias broadcast along a
        # dimension sums the pairs of every chunk along it), or zeros where no pair sees its keys
        carrier = np.dtype(plan.bias.dtype)
        for index in itertools.product(*(range(len(c)) for c in plan.bias.chunks)):
            block = (plan.bias.name, *index)
            parts = by_bias.get(block, [])
            if parts:
                total = _tree(graph["dbias"], f"{names['dbias']}-sum", index, parts, _add)
                graph["dbias"][(names["dbias"], *index)] = (_store_dbias, total, plan.p.dtype, carrier)
            else:
                graph["dbias"][(names["dbias"], *index)] = (_zeros, block, carrier)
    meta = _meta(q, q.ndim, plan.p.carrier)
    inputs = [dout, q, k, v, out, lse] + ([] if dlse is None else [dlse]) + plan.modifiers()
    dq = da.Array(HighLevelGraph.from_collections(names["dq"], graph["dq"], dependencies=inputs),
                  names["dq"], q.chunks, meta=meta)
    dk, dv = (da.Array(HighLevelGraph.from_collections(names[g], graph[g], dependencies=[dq, x]), names[g],
                       x.chunks, meta=meta) for g, x in (("dk", k), ("dv", v)))
    if not dbias:
        return dq, dk, dv
    dbias = da.Array(HighLevelGraph.from_collections(names["dbias"], graph["dbias"], dependencies=[dq, plan.bias]),
                     names["dbias"], plan.bias.chunks, meta=_meta(q, plan.bias.ndim, plan.bias.dtype))
    return dq, dk, dv, plan.as_given(dbias)


def _summed(graph, name, index, parts, like, kw):
    """The task storing the sum of the gradients `parts` (keys), in `like`'s dtype (zeros when no
    pair reaches it)."""
    if not parts:
        return (_store_grad, (_zeros_like, like, kw), like, kw)
    total = _tree(graph, name, index, parts, _add)
    return (_store_grad, total, like, kw)


def _check_like(name, x, shape, dtype):
    da, _, _ = _dask()
    if not isinstance(x, da.Array):
        raise TypeError(f"{name} must be a dask.array.Array, got {_checks.describe(x)}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")
    if np.dtype(x.dtype) != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {np.dtype(x.dtype)}")


def attention_backward(dout, q, k, v, out, lse, *, causal=False, window=None, softcap=None, alibi_slopes=None,
                       bias=None, mask=None, scale=None, backend="auto", dtype=None, deterministic=False, dlse=None,
                       dropout_p=0.0, dropout_seed=None, return_dbias=True):
    """flashcupy.attention_backward on dask arrays: lazy (dq, dk, dv), chunked like q, k and v, and
    with a bias dbias (unless return_dbias is False: then no task spends work on it), of the bias's
    shape and dtype (and chunks, for a dask bias), from the
    forward's out and lse (dask arrays; dout, out, lse and dlse, the gradient of lse or None, are
    rechunked to q's chunks if they differ). deterministic: each pair's, as attention_backward's
    (CuPy chunks' tensor-core kernels add dq with atomics unless it is True); the sums over pairs
    are of fixed order either way. dropout_p, dropout_seed: the forward's."""
    deterministic = _checks.check_bool("deterministic", deterministic)
    return_dbias = _checks.check_bool("return_dbias", return_dbias)
    plan = _Plan(q, k, v, causal, window, softcap, alibi_slopes, scale, backend, dtype, bias, mask, dropout_p,
                 dropout_seed)
    _check_like("dout", dout, plan.out_shape, plan.p.carrier)
    _check_like("out", out, plan.out_shape, plan.p.carrier)
    _check_like("lse", lse, plan.batch + (q.shape[-2], q.shape[-3]), plan.p.lse_dtype)
    if dlse is not None:
        _check_like("dlse", dlse, plan.batch + (q.shape[-2], q.shape[-3]), plan.p.lse_dtype)
        dlse = dlse.rechunk(_lse_chunks(q))
    return _backward(plan, dout.rechunk(plan.out_chunks), q, k, v, out.rechunk(plan.out_chunks),
                     lse.rechunk(_lse_chunks(q)), dlse, deterministic, return_dbias)


def attention_vjp(q, k, v, *, causal=False, window=None, softcap=None, alibi_slopes=None, bias=None, mask=None,
                  scale=None, backend="auto", dtype=None, deterministic=False, dropout_p=0.0, dropout_seed=None):
    """Lazy forward plus its backward: returns (out, vjp), vjp(dout, dlse=None) -> lazy (dq, dk, dv),
    or (dq, dk, dv, dbias) with a bias, chunked like q, k, v and the bias. dout (and dlse, the
    gradient of lse) is rechunked to q's chunks if it differs. Computing out and the gradients in
    one dask.compute shares the forward. deterministic: as attention_backward's; dropout_p, dropout_seed:
    as attention's."""
    deterministic = _checks.check_bool("deterministic", deterministic)
    plan = _Plan(q, k, v, causal, window, softcap, alibi_slopes, scale, backend, dtype, bias, mask, dropout_p,
                 dropout_seed)
    out, lse = _forward(plan, q, k, v)

    def vjp(dout, dlse=None):
        _check_like("dout", dout, plan.out_shape, plan.p.carrier)
        if dlse is not None:
            _check_like("dlse", dlse, lse.shape, plan.p.lse_dtype)
            dlse = dlse.rechunk(lse.chunks)
        return _backward(plan, dout.rechunk(plan.out_chunks), q, k, v, out, lse, dlse, deterministic)

    return out, vjp


# ----------------------------------------------------------------------------
# attention_probs


def _pair_probs(q, k, lse, bias, mask, diagonal, kw):
    return _api.probs(q, k, lse, bias=bias, mask=mask, diagonal=diagonal, **kw)


def _hidden_block(q, shape, dtype):
    """The block of a pair that no query sees: P = 0."""
    return _merge.library(q).zeros(shape, dtype)


def attention_probs(q, k, lse, *, rows=None, causal=False, window=None, softcap=None, alibi_slopes=None, bias=None,
                    mask=None, scale=None, backend="auto", dtype=None):
    """flashcupy.attention_probs on dask arrays: lazy P = exp(s - lse) (*batch, heads_q, len(rows),
    seqlen_k) in lse's dtype, chunked as q along the batch, heads and (all rows) the sequence and as k
    along the keys, from q, k (chunked as attention takes them) and the forward's lse (rechunked to q's
    chunks if it differs). One attention_probs call per pair of a query and a key chunk, with the whole
    row's lse, so each block is exactly the whole call's; a pair outside the band is zeros, no call.
    rows: None (all; P holds seqlen_q x seqlen_k per head: compute it in parts, or store it with
    dask.array.to_zarr), a slice or a 1-D array of ints, Dask's indexing of P (only the query chunks
    holding them are computed)."""
    da, tokenize, HighLevelGraph = _dask()
    plan = _Plan(q, k, k, causal, window, softcap, alibi_slopes, scale, backend, dtype, bias, mask)
    L = plan.lead
    _check_like("lse", lse, plan.batch + (q.shape[-2], q.shape[-3]), plan.p.lse_dtype)
    index = _checks.check_rows(rows, q.shape[-3])
    lse = lse.rechunk(_lse_chunks(q))
    token = tokenize(q, k, lse, plan.causal, plan.window, plan.softcap, plan.alibi, plan.bias, plan.mask, plan.scale,
                     plan.backend, plan.dtype)
    name = f"flashcupy-attention-probs-{token}"
    chunks = q.chunks[:L] + (q.chunks[L + 1], q.chunks[L], k.chunks[L])
    graph = {}
    for b, h in itertools.product(list(plan.batch_blocks()), range(len(plan.q_chunks[1]))):
        kw = plan.keywords(b, h)
        for i, j in itertools.product(range(len(plan.q_chunks[0])), range(len(plan.k_chunks[0]))):
            qk = (q.name, *b, i, h, 0)
            if plan.sees(i, j):
                graph[(name, *b, h, i, j)] = (_pair_probs, qk, (k.name, *b, j, h, 0), (lse.name, *b, h, i),
                                              plan.block(plan.bias, b, h, i, j), plan.block(plan.mask, b, h, i, j),
                                              plan.diagonal(i, j), kw)
            else:
                shape = tuple(c[n] for c, n in zip(chunks, (*b, h, i, j)))
                graph[(name, *b, h, i, j)] = (_hidden_block, qk, shape, plan.p.lse_dtype)
    P = da.Array(HighLevelGraph.from_collections(name, graph, dependencies=[q, k, lse] + plan.modifiers()), name,
                 chunks, meta=_meta(q, q.ndim + 1, plan.p.lse_dtype))
    if rows is None:
        return P
    if isinstance(rows, slice):
        return P[..., rows, :]
    return P[..., index, :]
