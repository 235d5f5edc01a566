"""flashcupy inside JAX: attention, attention_varlen and attention_probs on jax.Arrays, under jit, grad, jvp
and vmap.

Each call is a `jax.experimental.buffer_callback`: XLA hands the callback its own buffers, which
are viewed without a copy (NumPy views on a CPU, CuPy views on a GPU; bfloat16 as its uint16 bits,
dtype="bfloat16"), and the package's entry points (flashcupy._api.forward and backward) write
their results straight into XLA's output buffers (into=). On a GPU the kernels run on XLA's stream
(cupy.cuda.ExternalStream(ctx.stream)): no host round trip, no synchronisation.

Derivatives: a jax.custom_jvp whose tangent is one primitive (_tangent_p), linear in the tangents
of q, k, v and a bias. Reverse mode (grad, vjp, jacrev) transposes it: the package's backward on
the saved out and lse (no recomputation of the forward), dbias when a bias is given; mask, ALiBi
slopes and offsets get none (zero, as flash-attn's). Forward mode (jvp, jacfwd, linearize)
evaluates it with a forward and a backward of the package on widened operands (_tangent; the README
has the algebra), and a bias's tangent with XLA's sums over P, which the package's attention_probs
writes a slice of query rows at a time (_bias_tangent_sums). Both flow through out and through the lse of
return_lse=True (the backward's dlse; none is passed where the loss does not read lse).
attention_probs's derivative is JAX's own operations on P (_probs_tangent), which JAX transposes.

vmap: the mapped axis is folded into the batch axis (varlen: into the packing) of one call, by
jax.custom_batching.custom_vmap; operands that are not mapped are broadcast to the mapped size
first (an XLA copy) where the fold needs them whole.

jax.shard_map: each device calls the package on its shard; the results are typed as varying along the
mesh axes their operands vary along, and an operand the same on every device (a shared bias) is cast to
varying first, so that its gradient is summed over the devices (_vary_together).

Every argument check runs when JAX traces the call, on stand-ins of the arrays' shapes and
dtypes that hold no memory (flashcupy/_checks.py, as flashcupy.dask does), so a bad call raises
its TypeError or ValueError at trace time; the callback runs the same checks on the real views.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap
from jax.custom_derivatives import SymbolicZero
from jax.experimental.buffer_callback import buffer_callback
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from . import _api, _checks, _varlen
from ._problem import accumulation_dtype, default_scale, out_shape

__all__ = ["attention", "attention_probs", "attention_varlen"]

_CPU = 1  # kDLCPU, the DLPack device type of XLA's host buffers


# ----------------------------------------------------------------------------
# XLA's buffers as NumPy or CuPy arrays


def _view(buf):
    """A NumPy (host) or CuPy (CUDA) array over XLA's buffer, no copy; bfloat16 as uint16 bits."""
    if buf is None:
        return None
    value = np.dtype(buf.dtype)
    carrier = np.dtype(np.uint16) if value.name == "bfloat16" else value
    device_type, ordinal = buf.__dlpack_device__()
    if device_type == _CPU:
        return np.asarray(buf).view(carrier)
    import cupy
    # XLA's buffers are dense, row-major; built from the pointer, since CuPy reads no bfloat16 typestr
    nbytes = math.prod(buf.shape) * carrier.itemsize
    memory = cupy.cuda.UnownedMemory(buf.__cuda_array_interface__["data"][0], nbytes, buf, device_id=ordinal)
    return cupy.ndarray(tuple(buf.shape), carrier, cupy.cuda.MemoryPointer(memory, 0))


@contextlib.contextmanager
def _stream(ctx, buf):
    """On a GPU, XLA's device and stream made CuPy's current (every launch goes on XLA's stream)."""
    device_type, ordinal = buf.__dlpack_device__()
    if device_type == _CPU:
        yield
        return
    import cupy
    with cupy.cuda.Device(ordinal), cupy.cuda.ExternalStream(ctx.stream, ordinal):
        yield


def _platform_library() -> str:
    """The array library the callback will see: NumPy on a CPU, CuPy on a GPU."""
    return "numpy" if jax.default_backend() == "cpu" else "cupy"


# ----------------------------------------------------------------------------
# trace-time checks, on stand-ins


def _check_jax(named: dict) -> None:
    for name, x in named.items():
        if x is not None and not isinstance(x, jax.Array):
            raise TypeError(f"{name} must be a jax.Array{'' if name in ('q', 'k', 'v', 'lse') else ' or None'}, "
                            f"got {_checks.describe(x)}")


def _stand_in(x):
    """x's shape and dtype (JAX's bfloat16 is ml_dtypes'), as a NumPy array that holds no memory."""
    return None if x is None else np.broadcast_to(np.empty((), np.dtype(x.dtype)), tuple(x.shape))


@dataclasses.dataclass(frozen=True)
class _Call:
    """A call's static options, as the callback passes them to flashcupy._api (hashable: one
    compiled function per set of them)."""

    causal: bool
    window: tuple | None
    softcap: float | None
    scale: float | None
    backend: str
    dtype: str | None        # "bfloat16" where the buffers go as uint16 bits, else None
    bits: bool = False       # q, k, v are JAX uint16/int16 arrays of bfloat16 bits (dtype="bfloat16")
    cu_q: tuple | None = None  # varlen: the host offsets
    cu_k: tuple | None = None
    dropout_p: float = 0.0
    seed: int | None = None  # dropout's seed where a Python int (static); None: an operand, a uint32 (2,) array

    @classmethod
    def of(cls, p, window, softcap, scale, backend, seed=None, **varlen) -> _Call:
        """The options of a checked call, p its Problem (made from stand-ins of JAX's dtypes); seed: a
        static dropout seed."""
        return cls(p.causal, None if window is None else tuple(window), softcap, scale, backend,
                   "bfloat16" if p.dtype == "bfloat16" else None, bits=p.carrier.kind in "iu", **varlen,
                   dropout_p=p.dropout_p, seed=seed)

    def keywords(self, seed=None) -> dict:
        """The package's keywords; seed: the view of the seed operand (None for a static seed)."""
        kw = dict(causal=self.causal, window=self.window, softcap=self.softcap, scale=self.scale,
                  backend=self.backend, dtype=self.dtype)
        if not self.dropout_p:
            return kw
        kw["dropout_p"] = self.dropout_p
        if seed is None:
            kw["dropout_seed"] = self.seed
        elif isinstance(seed, np.ndarray):  # a CPU's: read where it lies
            kw["dropout_seed"] = int(seed[0]) | int(seed[1]) << 32
        elif self.backend in ("auto", "cupy"):  # the kernels read it on the device: no copy, no sync
            kw.update(dropout_seed=0, dropout_seed_words=seed)
        else:  # a backend that takes host ints only: a copy that waits for XLA's stream
            words = seed.get()
            kw["dropout_seed"] = int(words[0]) | int(words[1]) << 32
        return kw


def _rank4(q, k, v, alibi_slopes=None, bias=None, mask=None):
    """Stand-ins of a call's arrays with their leading dimensions checked (flashcupy/_batch.py) and
    folded into one: what the checks of the call's rank-4 parts read."""
    arrays = [_stand_in(x) for x in (q, k, v, alibi_slopes, bias, mask)]
    batch = _checks.check_leading("numpy", *arrays[:3], *arrays[3:])
    if len(batch) == 1:
        return arrays
    q, k, v, slopes, bias, mask = arrays
    # the product, not -1, which cannot be solved for where a dimension is 0
    folded = [x.reshape((math.prod(x.shape[:-3]),) + x.shape[-3:]) for x in (q, k, v)]
    if slopes is not None and slopes.ndim > 1:
        slopes = slopes.reshape(math.prod(slopes.shape[:-1]), slopes.shape[-1])
    return folded + [slopes] + [None if x is None else x[(0,) * (x.ndim - 3)][None] for x in (bias, mask)]


def _seed(dropout_p, dropout_seed) -> tuple:
    """(static seed, seed operand) of dropout: a Python int is static (each new one traces anew); a JAX
    PRNG key, or a uint32 array of shape (2,) (low word, high word), is an operand, traced or not (a
    key's data: jax.random.key_data, whose two words make the seed). Either is None where unused."""
    if not isinstance(dropout_seed, jax.Array):
        _checks.check_dropout(dropout_p, dropout_seed)
        return dropout_seed, None
    if jax.dtypes.issubdtype(dropout_seed.dtype, jax.dtypes.prng_key):
        words = jax.random.key_data(dropout_seed)
        if words.shape != (2,) or words.dtype != jnp.uint32:
            raise ValueError(f"dropout_seed: a PRNG key whose data is uint32 of shape (2,) (threefry2x32's), got "
                             f"data {words.dtype} of shape {tuple(words.shape)}: pass jax.random.bits(key, (2,), "
                             f"jnp.uint32)")
        return None, words
    if dropout_seed.shape != (2,) or dropout_seed.dtype != jnp.uint32:
        raise ValueError(f"dropout_seed must be an int, a PRNG key or a uint32 array of shape (2,), got a "
                         f"{dropout_seed.dtype} array of shape {tuple(dropout_seed.shape)}")
    return None, dropout_seed


def _plan(q, k, v, causal, window, softcap, alibi_slopes, bias, mask, scale, backend, dtype, dropout_p=0.0, seed=None):
    """(the Problem, _Call) of a call, every argument checked on stand-ins; seed: dropout's static seed
    (0 stands in for an operand's)."""
    backend = _checks.check_backend_name(backend)
    q4, k4, v4, slopes, bias4, mask4 = _rank4(q, k, v, alibi_slopes, bias, mask)
    p = _checks.problem(q4, k4, v4, causal, scale, dtype, "numpy", window, softcap, slopes, bias4, mask4,
                        dropout_p=dropout_p, dropout_seed=0 if seed is None else seed)
    _checks.select_backend(backend, _platform_library(), p)
    return p, _Call.of(p, window, softcap, scale, backend, seed)


def _aval(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype))


def _varying(x) -> frozenset:
    """The mesh axes along which x varies inside jax.shard_map (empty outside)."""
    kind = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset() if kind is None else frozenset(kind.varying)


def _callback(callback, avals, *operands) -> tuple:
    """buffer_callback(callback, avals)(*operands), its results typed as varying along every mesh axis
    that an operand varies along (inside jax.shard_map, whose type check would otherwise take them as
    the same on every device, and refuse them as the cotangents of operands that vary)."""
    results = buffer_callback(callback, avals)(*operands)
    return _vary_together(*results, axes=frozenset().union(*(_varying(x) for x in operands if x is not None)))


def _vary_together(*arrays, axes=None) -> tuple:
    """The arrays typed as varying along `axes` (default: every mesh axis one of them varies along), as
    jax.shard_map's own operations make their operands: the transpose of that cast sums an operand
    the same on every device (a bias shared by the shards of q, say) over the devices, as its
    cotangent must be."""
    if axes is None:
        axes = frozenset().union(*(_varying(x) for x in arrays if x is not None))
    return tuple(x if x is None or axes <= _varying(x) else
                 jax.lax.pcast(x, tuple(sorted(axes - _varying(x))), to="varying") for x in arrays)


def _lse_dtype(q) -> np.dtype:
    return accumulation_dtype(np.dtype(q.dtype).name)  # bfloat16 bits (uint16): float32


def _check_backward(call: _Call, q, k, v):
    """The backend's limits for the backward (checked when JAX traces the gradient); returns the
    backend's module. q, k, v: a packed batch's (total, heads, head_dim) where call is varlen's."""
    if call.cu_q is not None:
        q, k, v = q[None], k[None], v[None]
    p = _checks.problem(*_rank4(q, k, v)[:3], call.causal, call.scale, "bfloat16" if call.bits else None)
    return _checks.select_backend(call.backend, _platform_library(), p, backward=True)


# ----------------------------------------------------------------------------
# vmap: the mapped axis folded into the batch axis


def _fold(x, batched: bool, n: int, batch: int, kind: str):
    """x of a mapped call as the argument of one call over n x batch: 'bshd' arrays (q, k, v, out,
    dout) and lse have the batch axis first; 'slopes' are (heads,) or (batch, heads); 'pair' (bias,
    mask) are (1 or batch, ...), and unmapped ones with a batch of 1 are left as they are, since
    they broadcast over the folded batch too ('pair_each': every element its own, for dbias)."""
    if x is None or kind == "after":  # "after": an operand read for its order alone (_probs_call)
        return x
    if kind == "seed":  # one seed for the folded call: its batches draw their own parts of the mask
        if batched:
            raise ValueError("under jax.vmap, dropout_seed must not be mapped (the mapped axis is folded into "
                             "the batch, whose elements draw different parts of one seed's mask)")
        return x
    if kind == "slopes" and not batched and x.ndim == 1:
        return x
    if kind == "pair" and not batched and x.shape[0] == 1:
        return x
    if not batched:
        x = jnp.broadcast_to(x, (n,) + x.shape)
    if kind == "slopes" and x.ndim == 2:  # (n, heads): every batch element's
        x = jnp.broadcast_to(x[:, None], (n, batch) + x.shape[1:])
    if kind in ("pair", "pair_each") and x.shape[1] != batch:
        x = jnp.broadcast_to(x, (n, batch) + x.shape[2:])
    return x.reshape((n * x.shape[1],) + x.shape[2:])


def _unfold(y, n: int, like=None):
    """A result of the folded call as n results; dbias summed back over the batch it was broadcast to."""
    y = y.reshape((n, y.shape[0] // n) + y.shape[1:])
    if like is not None and y.shape[1] != like:  # summed in the accumulation dtype, rounded once
        y = y.sum(axis=1, keepdims=True, dtype=_lse_dtype(y)).astype(y.dtype)
    return y


def _folded(fn, kinds: tuple, dbias_of=None):
    """fn (arrays -> tuple of arrays, each with the batch axis first) under custom_vmap: a mapped
    call is one call of fn over the mapped axis folded into the batch axis. dbias_of: the index of
    the bias argument whose gradient is fn's last result (its shape is restored)."""
    fn = custom_vmap(fn)

    @fn.def_vmap
    def rule(n, in_batched, *args):
        main = next(i for i, kind in enumerate(kinds) if kind == "bshd")
        batch = args[main].shape[1 if in_batched[main] else 0]
        folded = [_fold(x, b, n, batch, kind) for x, b, kind in zip(args, in_batched, kinds)]
        results = fn(*folded)
        unfolded = [_unfold(y, n) for y in results]
        if dbias_of is not None and args[dbias_of] is not None:
            bias, mapped = args[dbias_of], in_batched[dbias_of]
            unfolded[-1] = _unfold(results[-1], n, bias.shape[1 if mapped else 0])
        return tuple(unfolded), tuple(True for _ in unfolded)

    return fn


# ----------------------------------------------------------------------------
# attention


@functools.lru_cache(maxsize=None)
def _forward_call(call: _Call):
    def callback(ctx, outs, q, k, v, alibi_slopes, bias, mask, seed):
        with _stream(ctx, q):
            _api.forward(*map(_view, (q, k, v)), alibi_slopes=_view(alibi_slopes), bias=_view(bias),
                         mask=_view(mask), into=tuple(map(_view, outs)), **call.keywords(_view(seed)))

    def run(q, k, v, alibi_slopes, bias, mask, seed):
        Sq, Hq = q.shape[-3:-1]
        avals = (_aval(out_shape(q.shape, v.shape), q.dtype), _aval(q.shape[:-3] + (Hq, Sq), _lse_dtype(q)))
        return _callback(callback, avals, q, k, v, alibi_slopes, bias, mask, seed)

    return _folded(run, ("bshd",) * 3 + ("slopes", "pair", "pair", "seed"))


@functools.lru_cache(maxsize=None)
def _backward_call(call: _Call, dbias: bool = True, dq_only: bool = False):
    """(dq, dk, dv), and dbias with a bias where dbias is True; False: the bias only shapes the scores,
    and no work goes into its gradient (a bias without a tangent). dq_only: (dq,) alone, no work on dk,
    dv or dbias where the backend takes it (forward mode's widened backward, _score_tangent_sums)."""
    dbias = dbias and not dq_only

    def callback(ctx, grads, dout, q, k, v, out, lse, dlse, alibi_slopes, bias, mask, seed):
        with _stream(ctx, q):
            _api.backward(*map(_view, (dout, q, k, v, out, lse)), dlse=_view(dlse), alibi_slopes=_view(alibi_slopes),
                          bias=_view(bias), mask=_view(mask), into=tuple(map(_view, grads)), return_dbias=dbias,
                          dq_only=dq_only, **call.keywords(_view(seed)))

    def run(dout, q, k, v, out, lse, dlse, alibi_slopes, bias, mask, seed):
        wanted = (q,) if dq_only else (q, k, v) + ((bias,) if dbias and bias is not None else ())
        avals = tuple(_aval(x.shape, x.dtype) for x in wanted)
        return _callback(callback, avals, dout, q, k, v, out, lse, dlse, alibi_slopes, bias, mask, seed)

    kinds = ("bshd",) * 5 + ("bshd", "bshd", "slopes", "pair_each" if dbias else "pair", "pair", "seed")
    return _folded(run, kinds, dbias_of=8 if dbias else None)


@functools.lru_cache(maxsize=None)
def _differentiable(call: _Call):
    """attention's forward under jax.custom_jvp (_jvp_rule): forward and reverse mode."""
    forward = _forward_call(call)

    @jax.custom_jvp
    def attend(q, k, v, alibi_slopes, bias, mask, seed):
        return forward(q, k, v, alibi_slopes, bias, mask, seed)

    attend.defjvp(_jvp_rule(call, forward), symbolic_zeros=True)
    return attend


def attention(q, k, v, *, causal=False, window=None, softcap=None, alibi_slopes=None, bias=None, mask=None,
              scale=None, return_lse=False, backend="auto", dtype=None, dropout_p=0.0, dropout_seed=None):
    """flashcupy.attention on jax.Arrays, inside or outside jax.jit, differentiable (jax.grad,
    jax.vjp, jax.jvp, jax.jacfwd) and batchable (jax.vmap): the same keywords, shapes and
    semantics (README, "Semantics"). q (*batch, seqlen_q, heads_q, head_dim), k (*batch,
    seqlen_k, heads_kv, head_dim), v (*batch, seqlen_k, heads_kv, head_dim_v); returns out (q's
    shape with head_dim_v), or (out, lse) with return_lse=True. float16, float32, float64 (under
    jax_enable_x64) and bfloat16 (jnp.bfloat16 arrays, passed as their bits without a copy).

    Gradients: dq, dk, dv, and dbias for a bias, through out and lse; none for mask and alibi_slopes
    (zero cotangents). Forward mode: tangents of q, k, v and a bias (a bias's with dropout is a
    ValueError); once only.
    Options (causal, window, softcap, scale, backend, dropout_p) are static: Python values.
    dropout_seed: a Python int (static: each new seed traces anew), or a JAX PRNG key or
    uint32 array of shape (2,) (low and high words of the seed), traced or not: on a GPU the kernels
    read it from device memory, no copy to the host. Under jax.vmap one seed serves the folded batch.
    """
    return_lse = _checks.check_bool("return_lse", return_lse)
    _check_jax({"q": q, "k": k, "v": v, "alibi_slopes": alibi_slopes, "bias": bias, "mask": mask})
    static, seed = _seed(dropout_p, dropout_seed)
    _, call = _plan(q, k, v, causal, window, softcap, alibi_slopes, bias, mask, scale, backend, dtype, dropout_p,
                    static)
    seed = seed if call.dropout_p else None
    # a bias or mask with fewer leading dimensions than q, given all of them (size 1), so that the
    # vmap rule lines up its first one with q's
    bias, mask = (None if x is None else x.reshape((1,) * (q.ndim - x.ndim) + x.shape) for x in (bias, mask))
    out, lse = _differentiable(call)(*_vary_together(q, k, v, alibi_slopes, bias, mask, seed))
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------
# attention_probs


@functools.lru_cache(maxsize=None)
def _probs_call(call: _Call, rows: tuple | None):
    """P of the query rows `rows` (None: all) into XLA's buffer, under the vmap rule. after: arrays the
    call is not to start before (read by no one: XLA runs it after the operations that make them)."""
    index = None if rows is None else np.asarray(rows, np.intp)

    def callback(ctx, outs, q, k, lse, alibi_slopes, bias, mask, *after):
        with _stream(ctx, q):
            _api.probs(*map(_view, (q, k, lse)), rows=index, alibi_slopes=_view(alibi_slopes), bias=_view(bias),
                       mask=_view(mask), into=_view(outs[0]), **call.keywords())

    def run(q, k, lse, alibi_slopes, bias, mask, *after):
        R = q.shape[-3] if rows is None else len(rows)
        avals = (_aval(q.shape[:-3] + (q.shape[-2], R, k.shape[-3]), lse.dtype),)
        return _callback(callback, avals, q, k, lse, alibi_slopes, bias, mask, *after)

    return _folded(run, ("bshd",) * 3 + ("slopes", "pair", "pair", "after", "after"))


@functools.lru_cache(maxsize=None)
def _differentiable_probs(call: _Call, rows: tuple | None):
    """attention_probs under jax.custom_jvp: P's tangent in JAX's own operations (_probs_tangent), which
    JAX also transposes for reverse mode; P, a result already in memory, is all the rule keeps."""
    probs = _probs_call(call, rows)

    @jax.custom_jvp
    def weights(q, k, lse, alibi_slopes, bias, mask):
        return probs(q, k, lse, alibi_slopes, bias, mask)[0]

    def rule(primals, tangents):
        q, k, lse, _, bias, _ = primals
        P = weights(*primals)
        q_t, k_t, lse_t, _, bias_t, _ = (None if isinstance(t, SymbolicZero) else t for t in tangents)
        if call.bits:  # integer bits have no tangent
            q_t = k_t = None
        return P, _probs_tangent(call, rows, P, q, k, q_t, k_t, lse_t, bias_t)

    weights.defjvp(rule, symbolic_zeros=True)
    return weights


def _probs_tangent(call: _Call, rows, P, q, k, q_t, k_t, lse_t, bias_t):
    """P_t = P (St - lse_t), P = exp(s - lse) with St the score's derivative along (q_t, k_t, bias_t):
    scale (q_t.k + q.k_t), times 1 - t^2 under the softcap (t = tanh(scale q.k / softcap)), plus bias_t
    (ALiBi slopes and mask have none, as in attention). In the accumulation dtype (XLA's einsums at
    HIGHEST precision: no TF32); O(rows x seqlen_k) memory, as P's. A pair that is hidden has P = 0."""
    acc = P.dtype
    select = (lambda x, axis: x) if rows is None else (lambda x, axis: jnp.take(x, np.asarray(rows), axis=axis))
    St = jnp.zeros((), acc)
    if q_t is not None or k_t is not None:
        group = q.shape[-2] // k.shape[-2]
        scale = call.scale if call.scale is not None else default_scale(q.shape[-1])

        def scores(a, b):  # (*batch, R, Hq, D) . (*batch, Sk, Hkv, D) -> (*batch, Hq, R, Sk)
            a = select(a, -3).astype(acc)
            a = a.reshape(a.shape[:-2] + (k.shape[-2], group, a.shape[-1]))
            s = jnp.einsum("...rhgd,...khd->...hgrk", a, b.astype(acc), precision=jax.lax.Precision.HIGHEST)
            return s.reshape(s.shape[:-4] + (q.shape[-2],) + s.shape[-2:])

        St = scale * sum(scores(a, b) for a, b in ((q_t, k), (q, k_t)) if a is not None and b is not None)
        if call.softcap is not None:
            St = St * (1 - jnp.tanh(scale * scores(q, k) / call.softcap) ** 2)
    if bias_t is not None:
        St = St + (bias_t if bias_t.shape[-2] == 1 else select(bias_t, -2)).astype(acc)
    if lse_t is not None:
        St = St - select(lse_t, -1).astype(acc)[..., None]
    return (P * St).astype(acc)


def attention_probs(q, k, lse, *, rows=None, causal=False, window=None, softcap=None, alibi_slopes=None, bias=None,
                    mask=None, scale=None, backend="auto", dtype=None):
    """flashcupy.attention_probs on jax.Arrays, inside or outside jax.jit, differentiable (forward and
    reverse mode, through q, k, lse and a bias) and batchable (jax.vmap): P = exp(s - lse) of the query
    rows asked for, (*batch, heads_q, len(rows), seqlen_k) in lse's dtype, recomputed from q, k and the
    lse of attention(..., return_lse=True) with the same keywords. rows: None (all), a slice or a 1-D
    array of ints, known when JAX traces (static: each new set traces anew). Its derivative P (St - lse_t)
    (St the score's) is computed by XLA from P, q and k: O(rows x seqlen_k) memory, as P itself.
    """
    _check_jax({"q": q, "k": k, "lse": lse, "alibi_slopes": alibi_slopes, "bias": bias, "mask": mask})
    if isinstance(rows, jax.core.Tracer):
        raise TypeError(f"rows must be known when JAX traces the call (None, a slice, or a NumPy array or concrete "
                        f"jax.Array of ints, closed over rather than passed through jax.jit), got a traced "
                        f"{rows.dtype} array: the rows decide P's shape")
    p, call = _plan(q, k, k, causal, window, softcap, alibi_slopes, bias, mask, scale, backend, dtype)
    _checks.check_lse(p, _stand_in(lse), q.shape[:-3] + (q.shape[-2], q.shape[-3]))
    index = _checks.check_rows(rows, q.shape[-3])
    rows = None if rows is None else tuple(index.tolist())
    bias, mask = (None if x is None else x.reshape((1,) * (q.ndim - x.ndim) + x.shape) for x in (bias, mask))
    return _differentiable_probs(call, rows)(*_vary_together(q, k, lse, alibi_slopes, bias, mask))


# ----------------------------------------------------------------------------
# attention_varlen


def _host_offsets(name: str, cu) -> np.ndarray:
    """cu_seqlens as a NumPy array: known when JAX traces, since they decide which memory each
    sequence reads (on a GPU, reading them at run time would be a device-to-host copy and a sync)."""
    if not isinstance(cu, jax.Array):
        return cu  # checked by _varlen_plan as NumPy's attention_varlen checks it
    try:
        return np.asarray(cu)
    except jax.errors.TracerArrayConversionError:
        raise TypeError(f"{name} must be known when JAX traces the call (a NumPy array or a concrete jax.Array, "
                        f"closed over rather than passed through jax.jit), got a traced {cu.dtype} array: "
                        f"each sequence's offsets decide which memory its attention reads") from None


def _fold_packed(x, batched: bool, n: int, kind: str):
    """x of a mapped varlen call as the argument of one call over n copies of the packing: 'packed'
    (total, ...) arrays are concatenated along total, lse (heads, total) too, 'slopes' (heads,) are
    shared and (batch, heads) ones repeated."""
    if x is None or (kind == "slopes" and not batched and x.ndim == 1):
        return x
    if kind == "seed":
        return _fold(x, batched, n, 0, kind)
    if not batched:
        x = jnp.broadcast_to(x, (n,) + x.shape)
    if kind == "lse":  # (n, heads, total) -> (heads, n x total): a small transposed copy
        return jnp.moveaxis(x, 0, 1).reshape(x.shape[1], -1)
    if kind == "slopes" and x.ndim == 2:  # (n, heads): every sequence's
        raise ValueError("under jax.vmap, attention_varlen's alibi_slopes must be (heads_q,) or (batch, heads_q) "
                         "slopes for every mapped element (a mapped (heads_q,) is not supported)")
    return x.reshape((-1,) + x.shape[2:])


def _folded_packed(make, call: _Call, kinds: tuple, out_kinds: tuple):
    """make(call) (arrays -> tuple of arrays) under custom_vmap: a mapped call is one call over the
    n packings concatenated, its offsets shifted (the same sequences, n times)."""
    fn = custom_vmap(make(call))

    @fn.def_vmap
    def rule(n, in_batched, *args):
        folded = [_fold_packed(x, b, n, kind) for x, b, kind in zip(args, in_batched, kinds)]
        results = _folded_packed(make, _shifted(call, n), kinds, out_kinds)(*folded)
        unfolded = [_unfold_packed(y, n, kind) for y, kind in zip(results, out_kinds)]
        return tuple(unfolded), tuple(True for _ in unfolded)

    return fn


def _shifted(call: _Call, n: int) -> _Call:
    """A varlen call over its packing n times over: the same sequences, their offsets shifted."""
    cu_q, cu_k = np.asarray(call.cu_q), np.asarray(call.cu_k)
    total_q, total_k = int(cu_q[-1]), int(cu_k[-1])
    return dataclasses.replace(
        call, cu_q=tuple(np.concatenate([cu_q[:1]] + [cu_q[1:] + i * total_q for i in range(n)]).tolist()),
        cu_k=tuple(np.concatenate([cu_k[:1]] + [cu_k[1:] + i * total_k for i in range(n)]).tolist()))


def _unfold_packed(y, n: int, kind: str):
    """A result of the call over n packings as n results: 'lse' (heads, n x total), else (n x total, ...)."""
    if kind == "lse":
        return jnp.moveaxis(y.reshape(y.shape[0], n, -1), 1, 0)
    return y.reshape((n, -1) + y.shape[1:])


def _offset_constants(cu_q, cu_k) -> tuple:
    """A packed call's offsets (host arrays, static when JAX traces) as int32 constants of the traced
    program: XLA keeps them on the device, so that a backend whose kernels read the offsets there (cupy:
    one launch per kernel, _varlen.forward_packed) gets them without a copy per call."""
    return tuple(jnp.asarray(cu.astype(np.int32)) for cu in (cu_q, cu_k))


def _packed_forward(call: _Call):
    cu_q, cu_k = np.asarray(call.cu_q, np.int64), np.asarray(call.cu_k, np.int64)

    def callback(ctx, outs, q, k, v, alibi_slopes, seed, device_q, device_k):
        with _stream(ctx, q):
            _varlen.forward_packed(*map(_view, (q, k, v)), cu_q, cu_k, *map(_view, outs),
                                   alibi_slopes=_view(alibi_slopes), device_offsets=(_view(device_q), _view(device_k)),
                                   **call.keywords(_view(seed)))

    def run(q, k, v, alibi_slopes, seed):
        avals = (_aval(out_shape(q.shape, v.shape), q.dtype), _aval((q.shape[1], q.shape[0]), _lse_dtype(q)))
        return _callback(callback, avals, q, k, v, alibi_slopes, seed, *_offset_constants(cu_q, cu_k))

    return run


def _packed_backward(call: _Call):
    cu_q, cu_k = np.asarray(call.cu_q, np.int64), np.asarray(call.cu_k, np.int64)

    def callback(ctx, grads, dout, q, k, v, out, lse, dlse, alibi_slopes, seed, device_q, device_k):
        with _stream(ctx, q):
            _varlen.backward_packed(*map(_view, (dout, q, k, v, out, lse)), cu_q, cu_k, *map(_view, grads),
                                    alibi_slopes=_view(alibi_slopes), device_offsets=(_view(device_q), _view(device_k)),
                                    dlse=_view(dlse), **call.keywords(_view(seed)))

    def run(dout, q, k, v, out, lse, dlse, alibi_slopes, seed):
        avals = tuple(_aval(x.shape, x.dtype) for x in (q, k, v))
        return _callback(callback, avals, dout, q, k, v, out, lse, dlse, alibi_slopes, seed,
                         *_offset_constants(cu_q, cu_k))

    return run


@functools.lru_cache(maxsize=None)
def _packed_ops(call: _Call) -> tuple:
    """(forward, backward) of a packed batch, each under its vmap rule."""
    return (_folded_packed(_packed_forward, call, ("packed",) * 3 + ("slopes", "seed"), ("packed", "lse")),
            _folded_packed(_packed_backward, call, ("packed",) * 5 + ("lse", "lse", "slopes", "seed"),
                           ("packed",) * 3))


@functools.lru_cache(maxsize=None)
def _differentiable_packed(call: _Call):
    """attention_varlen's forward under jax.custom_jvp (_jvp_rule): forward and reverse mode."""
    forward = _packed_ops(call)[0]

    @jax.custom_jvp
    def attend(q, k, v, alibi_slopes, seed):
        return forward(q, k, v, alibi_slopes, seed)

    attend.defjvp(_jvp_rule(call, forward), symbolic_zeros=True)
    return attend


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None, causal=False,
                     window=None, softcap=None, alibi_slopes=None, scale=None, return_lse=False, backend="auto",
                     dtype=None, dropout_p=0.0, dropout_seed=None):
    """flashcupy.attention_varlen on jax.Arrays (jit, grad, jvp, vmap as attention): q (total_q,
    heads_q, head_dim), k, v (total_k, heads_kv, head_dim); cu_seqlens_q, cu_seqlens_k int32
    (batch + 1,) known when JAX traces (NumPy arrays or concrete jax.Arrays: each new set of
    offsets traces anew). dropout_p, dropout_seed: as attention's (sequence b drawn as batch b; under
    vmap, the n packings concatenated draw their sequences as the folded one's). Returns out, or (out,
    lse (heads_q, total_q)) with return_lse=True."""
    return_lse = _checks.check_bool("return_lse", return_lse)
    _check_jax({"q": q, "k": k, "v": v, "alibi_slopes": alibi_slopes})
    cu_q, cu_k = _host_offsets("cu_seqlens_q", cu_seqlens_q), _host_offsets("cu_seqlens_k", cu_seqlens_k)
    backend = _checks.check_backend_name(backend)
    static, seed = _seed(dropout_p, dropout_seed)
    mods = dict(window=window, softcap=softcap, alibi_slopes=_stand_in(alibi_slopes), dropout_p=dropout_p,
                dropout_seed=0 if static is None else static)
    # the checks of NumPy's attention_varlen on stand-ins (the NumPy backend takes every option),
    # then the limits of the backend that will run
    p, cu_q, cu_k, _ = _varlen._varlen_plan(*map(_stand_in, (q, k, v)), cu_q, cu_k, max_seqlen_q, max_seqlen_k,
                                            causal, scale, dtype, mods, "numpy")
    _checks.select_backend(backend, _platform_library(), p)
    call = _Call.of(p, window, softcap, scale, backend, static, cu_q=tuple(cu_q.tolist()), cu_k=tuple(cu_k.tolist()))
    out, lse = _differentiable_packed(call)(*_vary_together(q, k, v, alibi_slopes, seed if call.dropout_p else None))
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------
# differentiation: a custom_jvp whose tangent is one primitive, linear in the tangents. Reverse mode
# transposes it, which is the package's backward on the saved out and lse (no recomputation of the
# forward); forward mode evaluates it, which is a forward and one or two backwards of the package
# on widened operands (_tangent): no new kernel, and the score matrix is never in memory (but for a
# bias's tangent, whose sums XLA takes from P, a slice of query rows at a time).

_EXTRAS = {False: ("alibi_slopes", "bias", "mask", "seed"), True: ("alibi_slopes", "seed")}  # varlen: True


def _jvp_rule(call: _Call, forward):
    """The custom_jvp rule of attend(q, k, v, *extras) (extras: _EXTRAS): the primal forward, and
    the tangent as _tangent_p of the tangents that are not symbolic zeros (those of q, k, v and of
    attention's bias; ALiBi slopes and mask have none, as they get no gradient)."""
    varlen = call.cu_q is not None
    forward = _once(forward)  # what reverse mode of a rule traced by an outer forward mode meets

    def rule(primals, tangents):
        q, k, v, *extras = primals
        out, lse = forward(q, k, v, *extras)
        given = [None if isinstance(t, SymbolicZero) else t for t in tangents[:3]]
        given.append(None if varlen or isinstance(tangents[4], SymbolicZero) else tangents[4])
        if call.bits or all(t is None for t in given):  # integer bits have no tangent
            zero = np.zeros(out.shape, jax.dtypes.float0) if call.bits else jnp.zeros(out.shape, out.dtype)
            return (out, lse), (zero, jnp.zeros(lse.shape, lse.dtype))
        operands = [t for t in given if t is not None] + [q, k, v, out, lse] + [x for x in extras if x is not None]
        out_t, lse_t = _tangent_p.bind(*operands, call=call, tangents=tuple(t is not None for t in given),
                                       extras=tuple(x is not None for x in extras))
        return (out, lse), (out_t, lse_t)

    return rule


def _unpack(operands, tangents: tuple, extras: tuple):
    """_tangent_p's operands as ([q_t, k_t, v_t, bias_t], (q, k, v, out, lse), extras), None where absent."""
    it = iter(operands)
    given = [next(it) if present else None for present in tangents]
    primals = tuple(next(it) for _ in range(5))
    return given, primals, [next(it) if present else None for present in extras]


def _ops(call: _Call, dbias: bool = True, dq_only: bool = False) -> tuple:
    """(forward, backward) of the call: attention's or a packed batch's (dbias, dq_only: _backward_call's)."""
    if call.cu_q is not None:
        return _packed_ops(call)
    return _forward_call(call), _backward_call(call, dbias, dq_only)


def _tangent(*operands, call: _Call, tangents: tuple, extras: tuple):
    """(out_t, lse_t), the derivatives of out and lse along the tangents (README, "Inside JAX"). With St_ij
    the score's derivative (scale (q_t.k + q.k_t), times 1 - t^2 under the softcap), P's is
    P (St - mu) with mu_i = sum_j p_ij St_ij, which is lse's, so out_t = A - mu out + E:
    A = sum_j p_ij z_ij St_ij v_j and mu are _score_tangent_sums, E = (P Z) v_t a forward on v_t; a
    bias's tangent b adds sum_j p_ij b_ij v_j to A and sum_j p_ij b_ij to mu (_bias_tangent_sums)."""
    (q_t, k_t, v_t, bias_t), (q, k, v, out, lse), extras = _unpack(operands, tangents, extras)
    if bias_t is not None and call.dropout_p:
        raise ValueError("bias: flashcupy.jax has no forward mode (jax.jvp, jax.jacfwd, jax.linearize) through the "
                         "bias with dropout_p > 0 (its term would need the dropout's keep mask in JAX); hold the "
                         "bias constant (close over it or wrap it in jax.lax.stop_gradient), or use reverse mode")
    acc = _lse_dtype(q)
    scale = call.scale if call.scale is not None else default_scale(q.shape[-1])
    scaled = dataclasses.replace(call, scale=scale)  # the widened operands' head dim is not q's
    plain = dataclasses.replace(scaled, dropout_p=0.0, seed=None)  # mu and lse are of the undropped P
    plain_extras = extras[:-1] + [None]
    mu = jnp.zeros(out.shape[:-1], acc)
    out_t = jnp.zeros(out.shape, acc)
    parts = [(a, b) for a, b in ((q_t, k), (q, k_t)) if a is not None and b is not None]
    if parts:
        ones = jnp.ones(k.shape[:-1] + (1,), k.dtype)
        if call.dropout_p:
            A = _score_tangent_sums(scaled, parts, q, k, v, lse, extras)
            mu = _score_tangent_sums(plain, parts, q, k, ones, lse, plain_extras)[..., 0]
        else:
            sums = _score_tangent_sums(plain, parts, q, k, jnp.concatenate([v, ones], axis=-1), lse, plain_extras)
            A, mu = sums[..., :-1], sums[..., -1]
        out_t = A - mu[..., None] * out.astype(acc)
    if bias_t is not None:
        A, mu_b = _bias_tangent_sums(plain, q, k, v, lse, bias_t, extras)
        out_t = out_t + A - mu_b[..., None] * out.astype(acc)
        mu = mu + mu_b
    if v_t is not None:
        out_t = out_t + _ops(call)[0](q, k, v_t, *extras)[0].astype(acc)
    return out_t.astype(out.dtype), jnp.swapaxes(mu, -1, -2).astype(lse.dtype)  # lse: heads before rows


def _score_tangent_sums(call: _Call, parts, q, k, cols, lse, extras):
    """sum_j p_ij z_ij St_ij cols_j (accumulation dtype) for every query row, as the dq of the package's
    backward on widened operands: q' = (q, 0), k' = (k, cols), v' and dO' the parts side by side
    (dO' = (q_t, q), v' = (k, k_t): dP = dO' v'^T = St / scale, before the softcap) and out' = 0, so
    that D = rowsum(dO' out') = 0 and dS = P Z dP (times 1 - t^2 under the softcap): dq' = scale
    sum_j dS_ij k'_j, whose columns past q's are the sums. The lse given makes P the call's own. Where
    the backend's head dim limit is too small, cols go in slices, and the parts one at a time."""
    D = q.shape[-1]
    backend = _check_backward(call, q, k, k)
    limit = backend.MAX_HEAD_DIM or math.inf
    if D >= limit:
        raise ValueError(f"head_dim {D}: flashcupy.jax's forward mode runs the backward with k widened by at least "
                         f"one column, past the {backend.NAME} backend's head_dim limit of {limit}")
    room = int(min(limit - D, cols.shape[-1]))
    groups = [parts] if sum(a.shape[-1] for a, _ in parts) <= limit else [[part] for part in parts]
    backward, sums = _ops(call, dq_only=True)[1], []
    for start in range(0, cols.shape[-1], room):
        piece = cols[..., start:start + room]
        width = D + piece.shape[-1]
        padded = int(min(-(-width // 8) * 8, limit))  # a multiple of 8, the tensor-core kernels' head dims
        k_wide = jnp.concatenate([k, piece, jnp.zeros(k.shape[:-1] + (padded - width,), k.dtype)], axis=-1)
        q_wide = jnp.concatenate([q, jnp.zeros(q.shape[:-1] + (padded - D,), q.dtype)], axis=-1)
        total = 0.0
        for group in groups:
            dout = jnp.concatenate([a for a, _ in group], axis=-1)
            v_wide = jnp.concatenate([b for _, b in group], axis=-1)
            _check_backward(call, q_wide, k_wide, v_wide)
            dq = backward(dout, q_wide, k_wide, v_wide, jnp.zeros_like(dout), lse, None, *extras)[0]
            total = total + dq[..., D:width].astype(_lse_dtype(q))
        sums.append(total)
    return jnp.concatenate(sums, axis=-1)


# rows of P that _bias_tangent_sums holds at once: those of about this many elements (16 MiB of float32;
# P's slice and its product with the bias's tangent are XLA's temporaries, two at a time)
_BIAS_TANGENT_ELEMENTS = 1 << 22


def _bias_tangent_sums(call: _Call, q, k, v, lse, bias_t, extras):
    """(A, mu) of a bias's tangent b in the accumulation dtype: A_i = sum_j p_ij b_ij v_j (*batch, Sq,
    Hq, Dv) and mu_i = sum_j p_ij b_ij (*batch, Sq, Hq), lse's tangent. b is any matrix, not a product
    of two thin ones as St is, so no backward computes these sums: XLA does, from P (the package's
    attention_probs, from the forward's lse) in slices of query rows of about _BIAS_TANGENT_ELEMENTS
    elements each (one row at least)."""
    acc = _lse_dtype(q)
    *batch, Sq, Hq, _ = q.shape
    if Sq == 0:  # no row, no slice
        return jnp.zeros(q.shape[:-1] + (v.shape[-1],), acc), jnp.zeros(q.shape[:-1], acc)
    Sk, Hkv = k.shape[-3], k.shape[-2]
    alibi_slopes, bias, mask = extras[:3]
    step = max(1, _BIAS_TANGENT_ELEMENTS // max(1, math.prod(batch) * Hq * Sk))  # rows a slice
    b = bias_t.astype(acc)
    A, mu = [], []
    for start in range(0, Sq, step):
        rows = tuple(range(start, min(Sq, start + step)))
        # after the last slice's sums: one slice of P alive at a time (left to itself, XLA writes every
        # slice before it sums any)
        P = _probs_call(call, None if len(rows) == Sq else rows)(q, k, lse, alibi_slopes, bias, mask,
                                                                 *(A[-1:] + mu[-1:]))[0]
        Pb = P * (b if b.shape[-2] == 1 else b[..., rows[0]:rows[-1] + 1, :])  # (*batch, Hq, R, Sk)
        mu.append(jnp.swapaxes(jnp.sum(Pb, axis=-1), -1, -2))
        Pb = Pb.reshape(Pb.shape[:-3] + (Hkv, Hq // Hkv) + Pb.shape[-2:])
        a = jnp.einsum("...hgrk,...khd->...rhgd", Pb, v.astype(acc), precision=jax.lax.Precision.HIGHEST)
        A.append(a.reshape(a.shape[:-3] + (Hq, a.shape[-1])))
    return jnp.concatenate(A, axis=-3), jnp.concatenate(mu, axis=-2)


def _abstract_tangent(*operands, call: _Call, tangents: tuple, extras: tuple):
    _, (q, k, v, out, lse), _ = _unpack(operands, tangents, extras)
    return [out, lse]  # out_t and lse_t: out's and lse's shapes and dtypes


def _transpose_tangent(cotangents, *operands, call: _Call, tangents: tuple, extras: tuple):
    """The tangent's transpose, reverse mode: the package's backward (dbias where the bias has a tangent);
    a symbolic-zero cotangent of lse is no dlse (no work for it), of out a zero dout."""
    dout, dlse = cotangents
    _, (q, k, v, out, lse), given_extras = _unpack(operands, tangents, extras)
    _check_backward(call, q, k, v)
    dout = jnp.zeros(out.shape, out.dtype) if isinstance(dout, ad.Zero) else dout
    dlse = None if isinstance(dlse, ad.Zero) else dlse
    grads = _once(_ops(call, dbias=tangents[3])[1])(dout, q, k, v, out, lse, dlse, *given_extras)
    wanted = tuple(grads[:3]) + (grads[3] if len(grads) > 3 else None,)
    return [g for g, present in zip(wanted, tangents) if present] + [None] * (len(operands) - sum(tangents))


def _batch_tangent(operands, dims, *, call: _Call, tangents: tuple, extras: tuple):
    """vmap of the tangent: the mapped axis folded into the batch (varlen: the packing) of one
    _tangent_p, as the forward's and backward's vmap rules fold theirs, so that it stays one
    primitive that reverse mode can transpose."""
    n = next(x.shape[d] for x, d in zip(operands, dims) if d is not None)
    operands = [x if d is None else jnp.moveaxis(x, d, 0) for x, d in zip(operands, dims)]
    mapped = [d is not None for d in dims]
    varlen = call.cu_q is not None
    names = [name for name, present in zip(("q", "k", "v", "bias"), tangents) if present]
    names += ["q", "k", "v", "out", "lse"] + [name for name, present in zip(_EXTRAS[varlen], extras) if present]
    if varlen:
        kinds = {"lse": "lse", "alibi_slopes": "slopes", "seed": "seed"}
        folded = [_fold_packed(x, b, n, kinds.get(name, "packed")) for x, b, name in zip(operands, mapped, names)]
        out_t, lse_t = _tangent_p.bind(*folded, call=_shifted(call, n), tangents=tangents, extras=extras)
        return (_unfold_packed(out_t, n, "packed"), _unfold_packed(lse_t, n, "lse")), (0, 0)
    kinds = {"bias": "pair", "mask": "pair", "alibi_slopes": "slopes", "seed": "seed"}
    main = names.index("q", sum(tangents))  # q itself, after the tangents
    batch = operands[main].shape[1 if mapped[main] else 0]
    folded = [_fold(x, b, n, batch, kinds.get(name, "bshd")) for x, b, name in zip(operands, mapped, names)]
    out_t, lse_t = _tangent_p.bind(*folded, call=call, tangents=tangents, extras=extras)
    return (_unfold(out_t, n), _unfold(lse_t, n)), (0, 0)


def _no_second_derivative(*_, **__):
    raise NotImplementedError("flashcupy.jax differentiates once (jax.grad, jax.vjp, jax.jvp, jax.jacfwd, "
                              "jax.jacrev, jax.linearize), not twice (jax.hessian, a jvp or grad of a gradient)")


def _once(backward):
    """The backward, which has no derivative of its own, saying so where something asks for one."""
    once = jax.custom_jvp(lambda *args: backward(*args))
    once.defjvp(_no_second_derivative)
    return once


_tangent_p = Primitive("flashcupy_attention_tangent")
_tangent_p.multiple_results = True
_tangent_p.def_impl(_tangent)
_tangent_p.def_abstract_eval(_abstract_tangent)
mlir.register_lowering(_tangent_p, mlir.lower_fun(_tangent, multiple_results=True))
ad.primitive_transposes[_tangent_p] = _transpose_tangent
ad.primitive_jvps[_tangent_p] = _no_second_derivative
batching.primitive_batchers[_tangent_p] = _batch_tangent
