"""Every argument check, in one place: each entry point (flashcupy._api, _varlen, _merge, dask)
runs these before any backend is touched, and backends never re-validate. A check raises a
TypeError or ValueError that names the argument, what was expected and what was got.

`problem` turns validated q, k, v and options into the Problem a backend receives; `select_backend`
picks the backend module for it and refuses a problem past one of the backend's declared limits.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np

from . import _batch, _interop, backends
from ._problem import FLOAT_DTYPES, LOG2E, MODIFIERS, Problem, accumulation_dtype, default_scale, out_shape

BIT_CARRIERS = (np.dtype(np.uint16), np.dtype(np.int16))  # what dtype="bfloat16" reads


def describe(x) -> str:
    t = type(x)
    return f"{t.__module__}.{t.__qualname__}" if t.__module__ != "builtins" else t.__qualname__


def check_arrays(named: dict) -> str:
    """Every argument is an array of one supported library; returns that library."""
    libs = {}
    for name, x in named.items():
        lib = backends.array_library(x)
        if lib is None:
            raise TypeError(
                f"{name} must be a numpy.ndarray, cupy.ndarray or numba device array, "
                f"got {describe(x)}")
        if isinstance(x, np.ma.MaskedArray):
            raise TypeError(f"{name} must not be a numpy.ma.MaskedArray: attention would ignore its mask "
                            f"(pass {name}.filled(0) or {name}.data if that is what you mean)")
        libs[name] = lib
    if len(set(libs.values())) > 1:
        raise _interop.mixed_libraries(libs)
    return next(iter(libs.values()))


def check_dtype_name(dtype) -> None:
    if dtype is not None and dtype != "bfloat16":
        raise ValueError(f"dtype must be None or 'bfloat16', got {dtype!r}")


_DTYPE_NAMES = {}  # np.dtype -> its name: NumPy's dtype.name is slow (microseconds), and every call asks it


def dtype_name(dtype: np.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = dtype.name
    return name


def check_dtypes(named: dict, dtype) -> tuple:
    """(value dtype name, carrier dtype) shared by every array in `named`."""
    check_dtype_name(dtype)
    carriers = {name: np.dtype(x.dtype) for name, x in named.items()}
    if dtype is None and len(set(carriers.values())) == 1:  # the common call: one float dtype
        carrier = next(iter(carriers.values()))
        if carrier.isnative and dtype_name(carrier) in FLOAT_DTYPES:
            return dtype_name(carrier), carrier
    for name, carrier in carriers.items():
        if not carrier.isnative:
            raise TypeError(f"{name} must have native byte order, got {carrier.str} "
                            f"(convert with {name}.astype({name}.dtype.newbyteorder('=')))")
        if dtype == "bfloat16" and dtype_name(carrier) != "bfloat16" and carrier not in BIT_CARRIERS:
            raise TypeError(f"with dtype='bfloat16', {name} must hold bfloat16 bit patterns as uint16 or "
                            f"int16 (CuPy has no bfloat16 dtype), got {carrier}")
        if dtype is None and dtype_name(carrier) not in FLOAT_DTYPES:
            hint = " (bfloat16 bits in uint16? pass dtype='bfloat16')" if carrier in BIT_CARRIERS else ""
            raise TypeError(f"{name} must have dtype float16, float32, float64 or bfloat16, got {carrier}{hint}")
    if len(set(carriers.values())) > 1:
        which = ", ".join(f"{n} is {dt}" for n, dt in carriers.items())
        raise TypeError(f"{', '.join(named)} must share one dtype: {which}")
    carrier = next(iter(carriers.values()))
    return (dtype or dtype_name(carrier)), carrier


def check_strides(name: str, x) -> None:
    """Strides, and on a device the address, whole multiples of the itemsize: kernels read elements."""
    itemsize = np.dtype(x.dtype).itemsize
    strides = x.strides if x.strides is not None else ()
    if any(s % itemsize for s in strides):
        raise ValueError(
            f"{name} must have strides that are whole multiples of its itemsize {itemsize}, "
            f"got strides {tuple(strides)} (bytes)")
    address = _device_address(x)
    if address is not None and address % itemsize:
        raise ValueError(f"{name} must start at an address aligned to its itemsize {itemsize} (a GPU faults "
                         f"on misaligned loads), got address {address:#x}")


def _device_address(x) -> int | None:
    """The address of a device array's first element (CuPy's without building its interface's dict);
    None for a host array."""
    lib = backends.array_library(x)
    if lib == "numpy":
        return None
    if lib == "cupy":
        return x.data.ptr
    interface = getattr(x, "__cuda_array_interface__", None)
    return None if interface is None else interface["data"][0]


def real(name: str, x) -> float:
    """x read as a float: a real number, or a 0-d real array of any library (NumPy, CuPy, torch,
    JAX, ...), which is a number too. Reading a device one copies it to the host and so waits for
    the device (as float(x) does). A torch tensor that requires grad is refused: flashcupy gives
    scale and softcap no gradient, and would drop it silently (under torch.no_grad() it is read)."""
    if isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name} must be a real number, a 0-d array or None, got {describe(x)}")
    if isinstance(x, numbers.Real):
        return float(x)
    shape, kind = getattr(x, "shape", None), str(getattr(x, "dtype", ""))
    if shape is None or tuple(shape) != () or "bool" in kind or "complex" in kind or not kind:
        got = describe(x) if shape is None else f"{describe(x)} of shape {tuple(shape)} and dtype {kind}"
        raise TypeError(f"{name} must be a real number, a 0-d array or None, got {got}")
    if _interop.tracked_by_autograd(x):
        raise ValueError(f"{name} requires grad, but flashcupy gives {name} no gradient: pass "
                         f"{name}.detach() (or float({name})) if it is a constant")
    try:
        return float(x)
    except Exception as e:  # a value that is not known yet: a traced JAX array inside jit
        raise TypeError(f"{name} must be a real number, a 0-d array or None whose value is known, got "
                        f"{describe(x)}, which has none yet ({type(e).__name__}): pass a Python float") from None


def check_positive(name: str, x, acc_dtype: np.dtype) -> float:
    """A real number (or 0-d array: real) that stays finite and positive in the accumulation dtype,
    also times log2(e) (the kernels work in base 2): scale and softcap."""
    value = real(name, x)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be finite and positive, got {value!r}")
    with np.errstate(over="ignore", under="ignore"):
        in_acc = acc_dtype.type(value), acc_dtype.type(value * LOG2E)
    if not all(np.isfinite(y) and y > 0 for y in in_acc):
        info = np.finfo(acc_dtype)
        raise ValueError(f"{name} must be finite and positive in {acc_dtype}, the accumulation dtype "
                         f"(between {info.tiny:.3g} and {float(info.max) / LOG2E:.3g}), got {value!r}")
    return value


def check_scale(scale, head_dim: int, acc_dtype: np.dtype) -> float:
    return default_scale(head_dim) if scale is None else check_positive("scale", scale, acc_dtype)


def check_bool(name: str, x) -> bool:
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {describe(x)}")
    return bool(x)


def check_dropout(dropout_p, dropout_seed) -> tuple:
    """(p, seed) of dropout: p a real number in [0, 1) (0: none, the seed then unread), the seed an int
    in [0, 2^64), required with p > 0 (the backward draws the same keep mask from it)."""
    p = real("dropout_p", dropout_p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {p!r}")
    if dropout_seed is None:
        if p > 0:
            raise ValueError("dropout_seed must be given with dropout_p > 0 (an int in [0, 2**64)): the backward "
                             "draws the same keep mask from it")
        return p, 0
    if isinstance(dropout_seed, (bool, np.bool_)) or not isinstance(dropout_seed, numbers.Integral):
        raise TypeError(f"dropout_seed must be an int or None, got {describe(dropout_seed)}")
    seed = int(dropout_seed)
    if not 0 <= seed < 2**64:
        raise ValueError(f"dropout_seed must be in [0, 2**64), got {seed}")
    return p, seed


def check_backend_name(backend) -> str:
    if not isinstance(backend, str) or (backend != "auto" and backend not in backends.NAMES):
        raise ValueError(
            f"backend must be 'auto' or one of {', '.join(map(repr, backends.NAMES))}, "
            f"got {backend!r}")
    return backend


def check_window(window) -> tuple:
    """(left, right), each None or an int >= 0."""
    expected = "None or a (left, right) pair, each None (unbounded) or an int >= 0"
    if window is None:
        return None, None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window must be {expected}, got {window!r}" if isinstance(window, (tuple, list))
                        else f"window must be {expected}, got {describe(window)}")
    sides = []
    for side, x in zip(("left", "right"), window):
        if x is not None and (isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral)):
            raise TypeError(f"window must be {expected}, got {describe(x)} {x!r} as its {side}")
        if x is not None and not 0 <= x < 2 ** 63:  # past int64 NumPy's index arithmetic overflows
            raise ValueError(f"window must be {expected} and below 2**63, got {int(x)} as its {side}")
        sides.append(None if x is None else int(x))
    return tuple(sides)


def check_softcap(softcap, acc_dtype: np.dtype):
    return None if softcap is None else check_positive("softcap", softcap, acc_dtype)


def check_modifier_array(name: str, x, lib: str) -> None:
    """x is an array of q's library, with native byte order and whole-element strides."""
    x_lib = backends.array_library(x)
    if x_lib is None:
        raise TypeError(f"{name} must be None or an array of q's library ({lib}), got {describe(x)}")
    if isinstance(x, np.ma.MaskedArray):
        raise TypeError(f"{name} must not be a numpy.ma.MaskedArray: its mask would be ignored")
    if x_lib != lib:
        raise _interop.mixed_libraries({"q": lib, name: x_lib})
    if not np.dtype(x.dtype).isnative:
        raise TypeError(f"{name} must have native byte order, got {np.dtype(x.dtype).str}")
    check_strides(name, x)


def check_broadcastable(name: str, x, full: tuple) -> None:
    """x broadcasts to `full` = (*batch, heads_q, seqlen_q, seqlen_k) the NumPy way: each dimension its
    full size or 1, leading dimensions allowed to be missing."""
    what = f"broadcastable to (*batch, heads_q, seqlen_q, seqlen_k) = {full}"
    if x.ndim > len(full):
        raise ValueError(f"{name} must have rank at most {len(full)}, {what}, got shape {tuple(x.shape)}")
    names = [f"batch dimension {d}" for d in range(len(full) - 3)] + ["heads_q", "seqlen_q", "seqlen_k"]
    for d, (n, f) in enumerate(zip(x.shape[::-1], full[::-1])):
        if n not in (1, f):
            raise ValueError(f"{name} must be {what} (each dimension its full size or 1): its {names[-1 - d]} is "
                             f"{n}, not {f} or 1, in shape {tuple(x.shape)}")


def check_bias_dtype(dtype, carrier: np.dtype) -> None:
    """A bias holds q's dtype (its carrier: bits with dtype="bfloat16") or float32."""
    if np.dtype(dtype) not in (carrier, np.dtype(np.float32)):
        also = "" if carrier == np.float32 else " or float32"
        raise TypeError(f"bias must have q's dtype {carrier}{also}, got {np.dtype(dtype)}")


def check_mask_dtype(dtype) -> None:
    if np.dtype(dtype) != np.dtype(bool):
        raise TypeError(f"mask must have dtype bool (True: may attend), got {np.dtype(dtype)}")


def check_leading(lib: str, q, k, v, alibi_slopes=None, bias=None, mask=None) -> tuple:
    """The leading (batch) dimensions q, k and v share; with more than one, the checks its rank-4
    parts cannot make on their views (flashcupy/_batch.py): the modifier arrays' shapes against
    them."""
    batch = _batch.leading(q, k, v)
    if len(batch) == 1:
        return batch  # problem() checks the rest
    Sq, Hq, Sk = q.shape[-3], q.shape[-2], k.shape[-3]
    if alibi_slopes is not None:
        check_modifier_array("alibi_slopes", alibi_slopes, lib)
        shapes = ((Hq,), batch + (Hq,))
        if tuple(alibi_slopes.shape) not in shapes:
            raise ValueError(f"alibi_slopes must have shape (heads_q,) = {shapes[0]} or (*batch, heads_q) = "
                             f"{shapes[1]}, got {tuple(alibi_slopes.shape)}")
    for name, x in (("bias", bias), ("mask", mask)):
        if x is not None:
            check_modifier_array(name, x, lib)
            check_broadcastable(name, x, batch + (Hq, Sq, Sk))
    return batch


def check_modifiers(lib, p: Problem, window, softcap, alibi_slopes, bias, mask) -> dict:
    """The validated modifiers, as Problem's fields."""
    left, right = check_window(window)
    if p.causal:
        right = None  # causal is right = 0, which a window's right (>= 0) never narrows
    found = dict(window_left=left, window_right=right, softcap=check_softcap(softcap, p.acc_dtype))
    full = (p.batch, p.heads_q, p.seqlen_q, p.seqlen_k)
    if alibi_slopes is not None:
        check_modifier_array("alibi_slopes", alibi_slopes, lib)
        shapes = ((p.heads_q,), (p.batch, p.heads_q))
        if tuple(alibi_slopes.shape) not in shapes:
            raise ValueError(f"alibi_slopes must have shape (heads_q,) = {shapes[0]} or (batch, heads_q) = "
                             f"{shapes[1]}, got {tuple(alibi_slopes.shape)}")
        allowed = sorted({np.dtype(np.float32), p.acc_dtype}, key=lambda d: d.itemsize)
        if np.dtype(alibi_slopes.dtype) not in allowed:
            raise TypeError(f"alibi_slopes must have dtype {' or '.join(map(str, allowed))} for {p.dtype} inputs, "
                            f"got {np.dtype(alibi_slopes.dtype)}")
        found["alibi_slopes"] = alibi_slopes
    if bias is not None:
        check_modifier_array("bias", bias, lib)
        check_broadcastable("bias", bias, full)
        check_bias_dtype(bias.dtype, p.carrier)
        found["bias"] = _batch.padded(bias, 4)  # the backends take rank 4: a view
    if mask is not None:
        check_modifier_array("mask", mask, lib)
        check_broadcastable("mask", mask, full)
        check_mask_dtype(mask.dtype)
        found["mask"] = _batch.padded(mask, 4)
    return found


# The Problems of calls without modifier arrays, kept by everything problem() reads (_problem_key): a call
# like one before it gets the same Problem, checked once, and its cached properties already made. Only
# problems that passed every check are kept; False: made again every call.
CACHE_PROBLEMS = True
_PROBLEMS = {}
_PROBLEMS_SIZE = 512  # entries; a full cache starts again empty
_NUMBER = (int, float, type(None))


def _problem_key(q, k, v, causal, scale, dtype, lib, window, softcap, diagonal, dropout):
    """The key of a call's Problem, or None where an option is not of the plain types whose equality
    is their meaning (a bool causal, numbers or None, a tuple of ints or None for the window): 1 and True
    are equal keys, and only one of them passes check_bool."""
    if not (type(causal) is bool and type(scale) in _NUMBER and type(softcap) in _NUMBER
            and type(diagonal) in (int, type(None)) and (dtype is None or type(dtype) is str)
            and type(dropout[0]) in _NUMBER and type(dropout[1]) in (int, type(None))
            and all(type(x) is int for x in dropout[2])
            and (window is None or (type(window) is tuple and len(window) == 2
                                    and all(type(x) in (int, type(None)) for x in window)))):
        return None
    arrays = tuple((type(x), x.shape, x.strides, x.dtype, _alignment(x)) for x in (q, k, v))
    return (lib, causal, type(scale), scale, dtype, window, type(softcap), softcap, diagonal, dropout, arrays)


def _alignment(x) -> int | None:
    """A device array's address modulo 16 (what check_strides reads of it); None for a host array."""
    address = _device_address(x)
    return None if address is None else address % 16


def problem(q, k, v, causal, scale, dtype, lib=None, window=None, softcap=None, alibi_slopes=None, bias=None,
            mask=None, diagonal=None, dropout_p=0.0, dropout_seed=None, dropout_origin=(0, 0, 0, 0)) -> Problem:
    """The Problem of q, k, v (rank 4, BSHD) and the options, every one of them checked; diagonal:
    a chunk's own (flashcupy.dask, KV caches), None for seqlen_k - seqlen_q; dropout_origin, the
    package's own, as Problem's. Kept between calls where no modifier array is given (CACHE_PROBLEMS)."""
    key = None
    dropout = (dropout_p, dropout_seed, tuple(dropout_origin))
    if CACHE_PROBLEMS and alibi_slopes is None and bias is None and mask is None:
        key = _problem_key(q, k, v, causal, scale, dtype, lib, window, softcap, diagonal, dropout)
        kept = _PROBLEMS.get(key) if key is not None else None
        if kept is not None:
            return kept
    p = _problem(q, k, v, causal, scale, dtype, lib, window, softcap, alibi_slopes, bias, mask, diagonal)
    if not (type(dropout_p) in (int, float) and dropout_p == 0 and dropout_seed is None):  # else: no dropout
        rate, seed = check_dropout(dropout_p, dropout_seed)
        if rate > 0:
            p = dataclasses.replace(p, dropout_p=rate, dropout_seed=seed, dropout_origin=tuple(dropout_origin))
    if key is not None:
        if len(_PROBLEMS) >= _PROBLEMS_SIZE:
            _PROBLEMS.clear()
        _PROBLEMS[key] = p
    return p


def _problem(q, k, v, causal, scale, dtype, lib, window, softcap, alibi_slopes, bias, mask, diagonal) -> Problem:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(
                f"{name} must have rank 4 ({'batch, seqlen_q, heads_q' if name == 'q' else 'batch, seqlen_k, heads_kv'}"
                f", head_dim), got shape {tuple(x.shape)}")
        check_strides(name, x)
    causal = check_bool("causal", causal)
    B, Sq, Hq, D = q.shape
    Bk, Sk, Hkv, Dk = k.shape
    Dv = v.shape[3]
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"k and v must have the same (batch, seqlen_k, heads_kv), got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if Bk != B:
        raise ValueError(f"k and v must have q's batch size {B}, got {Bk}")
    if Dk != D:
        raise ValueError(f"k must have q's head_dim {D}, got {Dk}")
    if D < 1 or Dv < 1:
        raise ValueError(f"head_dim must be at least 1, got {D} for q and k, {Dv} for v")
    if Hq < 1 or Hkv < 1:
        raise ValueError(f"heads_q and heads_kv must be at least 1, got heads_q={Hq}, heads_kv={Hkv}")
    if Hq % Hkv:
        raise ValueError(
            f"heads_q must be a multiple of heads_kv (GQA/MQA), got heads_q={Hq}, heads_kv={Hkv}")
    value_dtype, carrier = check_dtypes({"q": q, "k": k, "v": v}, dtype)
    scale = check_scale(scale, D, accumulation_dtype(value_dtype))
    if diagonal is not None and (isinstance(diagonal, bool) or not isinstance(diagonal, numbers.Integral)):
        raise TypeError(f"diagonal must be an int or None, got {describe(diagonal)}")
    p = Problem(B, Sq, Sk, Hq, Hkv, D, value_dtype, causal, scale, carrier,
                offset=None if diagonal is None else int(diagonal), head_dim_v=Dv)
    if window is softcap is alibi_slopes is bias is mask is None:
        return p
    return dataclasses.replace(p, **check_modifiers(lib, p, window, softcap, alibi_slopes, bias, mask))


def select_backend(backend: str, lib: str, p: Problem, backward: bool = False):
    """The backend module for this call: TypeError if it cannot take these arrays or this dtype,
    ValueError if the problem passes one of its limits (head_dim, CUDA's grid)."""
    name = backends.DEFAULT_FOR_LIBRARY[lib] if backend == "auto" else backend
    wanted = p.modifiers
    if backend == "auto" and (wanted or p.head_dim_v != p.head_dim or p.dropout):
        name = _backend_for_modifiers(lib, p, name)
    mod = backends.load(name)
    if lib not in mod.ARRAY_LIBRARIES:
        takes = " or ".join(mod.ARRAY_LIBRARIES)
        raise TypeError(
            f"backend {name!r} takes {takes} arrays, got {lib} arrays "
            f"(flashcupy never copies between host and device behind your back)")
    if p.dtype not in mod.DTYPES:
        raise TypeError(f"backend {name!r} supports {', '.join(mod.DTYPES)}, got {p.dtype}")
    if mod.MAX_HEAD_DIM is not None and max(p.head_dim, p.head_dim_v) > mod.MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be at most {mod.MAX_HEAD_DIM} for the {name} backend, got "
                         + (f"{p.head_dim}" if p.head_dim_v == p.head_dim else
                            f"{p.head_dim} for q and k, {p.head_dim_v} for v"))
    for what, blocks, axis in mod.grid_axes(p, backward):
        if blocks > backends.MAX_GRID[axis]:
            raise ValueError(f"too large for the {name} backend: {what} needs {blocks} thread blocks along "
                             f"CUDA grid {'xyz'[axis]}, which holds at most {backends.MAX_GRID[axis]}")
    if p.head_dim_v != p.head_dim and not _declares(name, "HEAD_DIM_V"):
        others = [n for n in backends.NAMES if n != name and _declares(n, "HEAD_DIM_V")]
        raise ValueError(f"v's head_dim {p.head_dim_v}, unlike q's and k's {p.head_dim}, is not yet supported by "
                         f"backend {name!r}" + (f" (backend {' or '.join(map(repr, others))} supports it)"
                                                if others else ""))
    if p.dropout_seed_words is not None and not _declares(name, "DROPOUT_SEED_ON_DEVICE"):
        raise ValueError(f"backend {name!r} cannot read dropout's seed from device memory (flashcupy.jax's "
                         f"traced seeds on a GPU): pass a Python int seed, or backend='cupy'")
    if p.dropout and not _declares(name, "DROPOUT"):
        others = [n for n in backends.NAMES if n != name and _declares(n, "DROPOUT")]
        raise ValueError(f"dropout is not yet supported by backend {name!r}"
                         + (f" (backend {' or '.join(map(repr, others))} supports it)" if others else ""))
    missing = wanted and [m for m in MODIFIERS if m in wanted and m not in getattr(mod, "MODIFIERS", ())]
    if missing:
        others = [n for n in backends.NAMES if n != name and set(missing) <= _declared_modifiers(n)]
        raise ValueError(f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not yet supported by "
                         f"backend {name!r}" + (f" (backend {' or '.join(map(repr, others))} supports "
                                                f"{'it' if len(missing) == 1 else 'them'})" if others else ""))
    return mod


def _declared_modifiers(name: str) -> frozenset:
    """The modifiers backend `name` declares (none where its module cannot even be imported)."""
    try:
        return frozenset(getattr(backends.module(name), "MODIFIERS", ()))
    except ImportError:
        return frozenset()


def _declares(name: str, flag: str) -> bool:
    """Whether backend `name` declares `flag` true (HEAD_DIM_V: v's head_dim may differ from q's and k's;
    DROPOUT; DROPOUT_SEED_ON_DEVICE); False where its module cannot even be imported."""
    try:
        return bool(getattr(backends.module(name), flag, False))
    except ImportError:
        return False


def _backend_for_modifiers(lib: str, p: Problem, default: str) -> str:
    """backend="auto" with modifiers or v's own head_dim: the default backend for these arrays,
    else the first other that takes them, computes every modifier asked (and a head_dim_v unlike
    head_dim) and can run here; else the default (which select_backend then refuses, naming what
    it lacks)."""
    for name in (default, *backends.NAMES):
        if not p.modifiers <= _declared_modifiers(name):
            continue
        if p.head_dim_v != p.head_dim and not _declares(name, "HEAD_DIM_V"):
            continue
        if p.dropout and not _declares(name, "DROPOUT"):
            continue
        if lib in backends.module(name).ARRAY_LIBRARIES and backends.unavailable_reason(name) is None:
            return name
    return default


def check_like_q(p: Problem, q, named: dict) -> None:
    """dout and out (the `named` arrays) have out's shape (q's, with v's head_dim) and q's dtype, and
    strides a kernel can read."""
    shape = out_shape(q.shape, (p.head_dim_v,))
    for name, x in named.items():
        if tuple(x.shape) != shape:
            what = "q's shape" if p.head_dim_v == p.head_dim else "q's shape with v's head_dim"
            raise ValueError(f"{name} must have {what} {shape}, got {tuple(x.shape)}")
        if np.dtype(x.dtype) != p.carrier:
            raise TypeError(f"{name} must have q's dtype {p.carrier}, got {np.dtype(x.dtype)}")
        check_strides(name, x)


def check_lse(p: Problem, lse, shape=None, name: str = "lse") -> None:
    """lse (or dlse, its gradient: `name`) of the shape (*batch, heads_q, seqlen_q) (p's own by default)
    and dtype the forward gives."""
    shape = p.lse_shape if shape is None else tuple(shape)
    if tuple(lse.shape) != shape:
        raise ValueError(f"{name} must have shape (*batch, heads_q, seqlen_q) = {shape}, got {tuple(lse.shape)}")
    if np.dtype(lse.dtype) != p.lse_dtype:
        raise TypeError(f"{name} must have dtype {p.lse_dtype} for {p.dtype} inputs, got {np.dtype(lse.dtype)}")
    check_strides(name, lse)


def check_rows(rows, seqlen_q: int) -> np.ndarray:
    """The query rows attention_probs is asked for, as an index array into [0, seqlen_q)."""
    expected = "None, a slice or a 1-D array of ints"
    if rows is None:
        return np.arange(seqlen_q)
    if isinstance(rows, slice):
        return np.arange(seqlen_q)[rows]
    if isinstance(rows, (bool, np.bool_)) or isinstance(rows, (numbers.Number, str)):
        raise TypeError(f"rows must be {expected}, got {describe(rows)}")
    try:
        index = np.asarray(rows)
    except Exception:
        raise TypeError(f"rows must be {expected} (NumPy-readable), got {describe(rows)}") from None
    if index.ndim != 1 or (index.dtype.kind not in "iu" and not (index.size == 0 and index.dtype.kind == "f")):
        raise TypeError(f"rows must be {expected}, got {index.ndim}-D {index.dtype}")
    index = index.astype(np.int64)
    bad = index[(index < -seqlen_q) | (index >= seqlen_q)]
    if bad.size:
        raise ValueError(f"rows must lie in [-seqlen_q, seqlen_q) = [{-seqlen_q}, {seqlen_q}), got {int(bad[0])}")
    return np.where(index < 0, index + seqlen_q, index).astype(np.intp)
