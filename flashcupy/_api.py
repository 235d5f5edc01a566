"""The public interface: argument checks, degenerate shapes, and dispatch.

Every call goes through here once. All validation happens before any backend
is touched, and backends never re-validate: they receive a `Problem` that
describes shapes and options, plus arrays that are known to be consistent.

Semantics (documented once, in README.md, "Semantics"):
- q is (batch, seqlen_q, heads_q, head_dim); k, v are (batch, seqlen_k, heads_kv, head_dim).
- GQA/MQA: query head h reads kv head h // (heads_q // heads_kv).
- causal is bottom-right aligned: query i sees key j iff j <= i + seqlen_k - seqlen_q.
- a query row that sees no key gets out 0, lse -inf and zero gradients.
- lse is the natural-log logsumexp of the scaled scores, shape (batch, heads_q, seqlen_q).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from . import backends

FLOAT_DTYPES = ("float16", "float32", "float64", "bfloat16")
BIT_CARRIERS = (np.dtype(np.uint16), np.dtype(np.int16))  # what dtype="bfloat16" reads


@dataclass(frozen=True)
class Problem:
    """Everything a backend needs to know besides the arrays themselves."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    dtype: str          # the values' dtype, by name: float16, float32, float64 or bfloat16
    causal: bool
    scale: float
    carrier: np.dtype   # the arrays' own dtype: dtype, or uint16/int16 holding bfloat16 bits

    @property
    def group(self) -> int:
        """Query heads per kv head (1 for plain multi-head attention)."""
        return self.heads_q // self.heads_kv

    @property
    def acc_dtype(self) -> np.dtype:
        return backends.accumulation_dtype(self.dtype)

    @property
    def lse_dtype(self) -> np.dtype:
        return self.acc_dtype

    @property
    def lse_shape(self) -> tuple:
        return (self.batch, self.heads_q, self.seqlen_q)

    @property
    def diagonal(self) -> int:
        """Query i sees key j iff j <= i + diagonal (bottom-right alignment)."""
        return self.seqlen_k - self.seqlen_q

    def flops_forward(self) -> float:
        """Standard count (FlashAttention papers): 4*B*H*Sq*Sk*D, halved when causal."""
        f = 4.0 * self.batch * self.heads_q * self.seqlen_q * self.seqlen_k * self.head_dim
        return f / 2 if self.causal else f


# ----------------------------------------------------------------------------
# validation


def _describe(x) -> str:
    t = type(x)
    return f"{t.__module__}.{t.__qualname__}" if t.__module__ != "builtins" else t.__qualname__


def _check_arrays(named: dict) -> str:
    """Every argument is an array of one supported library; returns that library."""
    libs = {}
    for name, x in named.items():
        lib = backends.array_library(x)
        if lib is None:
            raise TypeError(
                f"{name} must be a numpy.ndarray, cupy.ndarray or numba device array, "
                f"got {_describe(x)}")
        if isinstance(x, np.ma.MaskedArray):
            raise TypeError(f"{name} must not be a numpy.ma.MaskedArray: attention would ignore its mask "
                            f"(pass {name}.filled(0) or {name}.data if that is what you mean)")
        libs[name] = lib
    if len(set(libs.values())) > 1:
        which = ", ".join(f"{n} is {lib}" for n, lib in libs.items())
        raise TypeError(f"q, k, v (and dout, out, lse) must come from one array library: {which}")
    return next(iter(libs.values()))


def _check_dtypes(named: dict, dtype) -> tuple:
    """(value dtype name, carrier dtype) shared by every array in `named`."""
    if dtype is not None and dtype != "bfloat16":
        raise ValueError(f"dtype must be None or 'bfloat16', got {dtype!r}")
    carriers = {name: np.dtype(x.dtype) for name, x in named.items()}
    for name, carrier in carriers.items():
        if not carrier.isnative:
            raise TypeError(f"{name} must have native byte order, got {carrier.str} "
                            f"(convert with {name}.astype({name}.dtype.newbyteorder('=')))")
        if dtype == "bfloat16" and carrier.name != "bfloat16" and carrier not in BIT_CARRIERS:
            raise TypeError(f"with dtype='bfloat16', {name} must hold bfloat16 bit patterns as uint16 or "
                            f"int16 (CuPy has no bfloat16 dtype), got {carrier}")
        if dtype is None and carrier.name not in FLOAT_DTYPES:
            hint = " (bfloat16 bits in uint16? pass dtype='bfloat16')" if carrier in BIT_CARRIERS else ""
            raise TypeError(f"{name} must have dtype float16, float32, float64 or bfloat16, got {carrier}{hint}")
    if len(set(carriers.values())) > 1:
        which = ", ".join(f"{n} is {dt}" for n, dt in carriers.items())
        raise TypeError(f"{', '.join(named)} must share one dtype: {which}")
    carrier = next(iter(carriers.values()))
    return (dtype or carrier.name), carrier


def _check_strides(name: str, x) -> None:
    """Strides, and on a device the address, whole multiples of the itemsize: kernels read elements."""
    itemsize = np.dtype(x.dtype).itemsize
    strides = x.strides if x.strides is not None else ()
    if any(s % itemsize for s in strides):
        raise ValueError(
            f"{name} must have strides that are whole multiples of its itemsize {itemsize}, "
            f"got strides {tuple(strides)} (bytes)")
    interface = getattr(x, "__cuda_array_interface__", None)
    if interface is not None and interface["data"][0] % itemsize:
        raise ValueError(f"{name} must start at an address aligned to its itemsize {itemsize} (a GPU faults "
                         f"on misaligned loads), got address {interface['data'][0]:#x}")


def default_scale(head_dim: int) -> float:
    """The scale when none is given: 1/sqrt(head_dim), as in "Attention Is All You Need"."""
    return 1.0 / math.sqrt(head_dim)


LOG2E = math.log2(math.e)  # the kernels scale by scale * log2(e) and use exp2


def _check_scale(scale, head_dim: int, acc_dtype: np.dtype) -> float:
    if scale is None:
        return default_scale(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None, got {_describe(scale)}")
    s = float(scale)
    if not math.isfinite(s) or s <= 0:
        raise ValueError(f"scale must be finite and positive, got {s!r}")
    with np.errstate(over="ignore", under="ignore"):
        in_acc = acc_dtype.type(s), acc_dtype.type(s * LOG2E)
    if not all(np.isfinite(x) and x > 0 for x in in_acc):
        info = np.finfo(acc_dtype)
        raise ValueError(f"scale must be finite and positive in {acc_dtype}, the accumulation dtype "
                         f"(between {info.tiny:.3g} and {float(info.max) / LOG2E:.3g}), got {s!r}")
    return s


def _check_bool(name: str, x) -> bool:
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {_describe(x)}")
    return bool(x)


def _check_backend_name(backend) -> str:
    if not isinstance(backend, str) or (backend != "auto" and backend not in backends.NAMES):
        raise ValueError(
            f"backend must be 'auto' or one of {', '.join(map(repr, backends.NAMES))}, "
            f"got {backend!r}")
    return backend


def _problem(q, k, v, causal, scale, dtype) -> Problem:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(
                f"{name} must have rank 4 ({'batch, seqlen_q, heads_q' if name == 'q' else 'batch, seqlen_k, heads_kv'}"
                f", head_dim), got shape {tuple(x.shape)}")
        _check_strides(name, x)
    causal = _check_bool("causal", causal)
    B, Sq, Hq, D = q.shape
    Bk, Sk, Hkv, Dk = k.shape
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape (batch, seqlen_k, heads_kv, head_dim), "
            f"got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if Bk != B:
        raise ValueError(f"k and v must have q's batch size {B}, got {Bk}")
    if Dk != D:
        raise ValueError(f"k and v must have q's head_dim {D}, got {Dk}")
    if D < 1:
        raise ValueError(f"head_dim must be at least 1, got {D}")
    if Hq < 1 or Hkv < 1:
        raise ValueError(f"heads_q and heads_kv must be at least 1, got heads_q={Hq}, heads_kv={Hkv}")
    if Hq % Hkv:
        raise ValueError(
            f"heads_q must be a multiple of heads_kv (GQA/MQA), got heads_q={Hq}, heads_kv={Hkv}")
    value_dtype, carrier = _check_dtypes({"q": q, "k": k, "v": v}, dtype)
    scale = _check_scale(scale, D, backends.accumulation_dtype(value_dtype))
    return Problem(B, Sq, Sk, Hq, Hkv, D, value_dtype, causal, scale, carrier)


def _select(backend: str, lib: str, p: Problem, backward: bool = False):
    """The backend module for this call: TypeError if it cannot take these arrays or this dtype,
    ValueError if the problem passes one of its limits (head_dim, CUDA's grid)."""
    name = backends.DEFAULT_FOR_LIBRARY[lib] if backend == "auto" else backend
    mod = backends.load(name)
    if lib not in mod.ARRAY_LIBRARIES:
        takes = " or ".join(mod.ARRAY_LIBRARIES)
        raise TypeError(
            f"backend {name!r} takes {takes} arrays, got {lib} arrays "
            f"(flashcupy never copies between host and device behind your back)")
    if p.dtype not in mod.DTYPES:
        raise TypeError(f"backend {name!r} supports {', '.join(mod.DTYPES)}, got {p.dtype}")
    if mod.MAX_HEAD_DIM is not None and p.head_dim > mod.MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be at most {mod.MAX_HEAD_DIM} for the {name} backend, got {p.head_dim}")
    for what, blocks, axis in mod.grid_axes(p, backward):
        if blocks > backends.MAX_GRID[axis]:
            raise ValueError(f"too large for the {name} backend: {what} needs {blocks} thread blocks along "
                             f"CUDA grid {'xyz'[axis]}, which holds at most {backends.MAX_GRID[axis]}")
    return mod


# ----------------------------------------------------------------------------
# public API


def attention(q, k, v, *, causal=False, scale=None, return_lse=False, backend="auto", dtype=None):
    """Exact softmax(q kᵀ · scale) v, computed tile by tile (FlashAttention).

    q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim),
    heads_q a multiple of heads_kv. Returns out (q's shape and dtype), and with
    return_lse=True also lse, the natural-log logsumexp, (batch, heads_q, seqlen_q),
    float32 (float64 for float64 inputs).

    dtype=None reads the arrays as their own dtype (float16, float32, float64, or
    ml_dtypes.bfloat16 on NumPy); dtype="bfloat16" reads uint16/int16 arrays as
    bfloat16 bit patterns (CuPy has no bfloat16 dtype), and out comes back the same way.
    """
    backend = _check_backend_name(backend)
    return_lse = _check_bool("return_lse", return_lse)
    lib = _check_arrays({"q": q, "k": k, "v": v})
    p = _problem(q, k, v, causal, scale, dtype)
    mod = _select(backend, lib, p)

    if p.batch * p.seqlen_q * p.heads_q == 0 or p.seqlen_k == 0:
        # Nothing to attend to: every query row is fully masked (out 0, lse -inf).
        out = mod.allocate(q, q.shape, p.carrier, 0)
        lse = mod.allocate(q, p.lse_shape, p.lse_dtype, -np.inf)
    else:
        out, lse = mod.forward(p, q, k, v)
    return (out, lse) if return_lse else out


def attention_backward(dout, q, k, v, out, lse, *, causal=False, scale=None, backend="auto", dtype=None):
    """Gradients (dq, dk, dv) of attention, given dout and the forward's out and lse.

    dk and dv sum over the query heads that share a kv head. P is recomputed
    from q, k and lse, so memory stays O(seqlen).
    """
    backend = _check_backend_name(backend)
    named = {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse}
    lib = _check_arrays(named)
    p = _problem(q, k, v, causal, scale, dtype)
    for name, x in (("dout", dout), ("out", out)):
        if tuple(x.shape) != tuple(q.shape):
            raise ValueError(f"{name} must have q's shape {tuple(q.shape)}, got {tuple(x.shape)}")
        if np.dtype(x.dtype) != p.carrier:
            raise TypeError(f"{name} must have q's dtype {p.carrier}, got {np.dtype(x.dtype)}")
        _check_strides(name, x)
    if tuple(lse.shape) != p.lse_shape:
        raise ValueError(
            f"lse must have shape (batch, heads_q, seqlen_q) = {p.lse_shape}, got {tuple(lse.shape)}")
    if np.dtype(lse.dtype) != p.lse_dtype:
        raise TypeError(f"lse must have dtype {p.lse_dtype} for {p.dtype} inputs, got {np.dtype(lse.dtype)}")
    _check_strides("lse", lse)
    mod = _select(backend, lib, p, backward=True)

    if p.batch * p.seqlen_q * p.heads_q == 0 or p.seqlen_k == 0:
        return tuple(mod.allocate(q, x.shape, p.carrier, 0) for x in (q, k, v))
    return mod.backward(p, dout, q, k, v, out, lse)


def attention_vjp(q, k, v, *, causal=False, scale=None, backend="auto", dtype=None):
    """Forward pass plus a closure for the backward: returns (out, vjp), vjp(dout) -> (dq, dk, dv)."""
    out, lse = attention(q, k, v, causal=causal, scale=scale, return_lse=True, backend=backend, dtype=dtype)

    def vjp(dout):
        return attention_backward(dout, q, k, v, out, lse, causal=causal, scale=scale, backend=backend,
                                  dtype=dtype)

    return out, vjp
