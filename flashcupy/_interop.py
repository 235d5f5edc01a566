"""Arrays of other libraries (torch, JAX, PyCUDA, ...), viewed without a copy, results given back
in the caller's library; and the one rule on libraries that every entry point follows.

One library a call: every array argument of an entry point (q, k, v, dout, out, lse, bias, mask,
alibi_slopes, offsets, caches, outs and lses) comes from one array library, and for a DLPack
library from one side (host or CUDA), or the call is a TypeError that names each argument's
library as the caller knows it ("q is torch, k is numpy, v is numpy"). Numbers are not array
arguments: scale and softcap take a Python number or a 0-d array of any library (_checks.real), the
window, rows and lengths take ints, and none of them is viewed.

An argument that is not a NumPy, CuPy or Numba array but exposes `__dlpack__` is viewed as a NumPy
array when it lives in host memory and as a CuPy array when it lives on a CUDA device (DLPack
shares the memory; nothing is copied); one that exposes only `__cuda_array_interface__` (PyCUDA)
is viewed as a CuPy array. The entry point then runs on those views, and its array results are
handed back through DLPack to the library of the arguments: torch tensors in, torch tensors out;
JAX in, JAX out (CuPy for PyCUDA, which has no DLPack import).

torch: with grad mode on and a tensor that requires grad, attention and attention_varlen record
autograd (flashcupy._torch, imported only when torch tensors arrive), and the other entry points,
which record none, refuse such a tensor rather than detach it silently. CUDA tensors run on
torch's current stream. Tensors read outside autograd are read through `detach()` (the same memory).

bfloat16: NumPy and CuPy have no bfloat16 in DLPack, so a torch bfloat16 tensor is viewed as the
int16 bit patterns it holds (`Tensor.view(torch.int16)`, no copy) and the call reads them as
bfloat16 (dtype="bfloat16"); bfloat16 results are viewed back the same way. JAX has no such view
without a copy (`bitcast_convert_type` makes a new array), so JAX bfloat16 is refused with the
way to pass it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys

import numpy as np

from . import backends

# DLPack device types (dlpack.h): host memory that NumPy can view, and CUDA memory for CuPy
_HOST = {1, 3}   # kDLCPU, kDLCUDAHost
_CUDA = {2, 13}  # kDLCUDA, kDLCUDAManaged

# keywords that take numbers or indices, never arrays of the call's library: not viewed, and not
# held to the one-library rule (a 0-d tensor scale is a number; rows is read with np.asarray)
NOT_ARRAYS = frozenset({"scale", "softcap", "window", "rows", "max_seqlen_q", "max_seqlen_k", "num_splits",
                        "dtype", "backend"})


def _root(x) -> str:
    root = type(x).__module__.split(".")[0]
    return "jax" if root == "jaxlib" else root


def is_foreign(x) -> bool:
    """An array of a library the backends do not take directly, but one that can be viewed."""
    if backends.array_library(x) is not None or isinstance(x, (str, bytes)):
        return False
    return hasattr(x, "__dlpack__") or hasattr(x, "__cuda_array_interface__")


def library(x) -> str | None:
    """x's array library as its caller knows it ('numpy', 'cupy', 'numba', 'torch', 'jax', ...),
    one on a device marked so ('torch (CUDA)'); None for what is no array."""
    lib = backends.array_library(x)
    if lib is not None or not is_foreign(x):
        return lib
    if _root(x) == "torch":  # its device, without a DLPack query (the slower way to the same answer)
        return "torch" if x.device.type == "cpu" else f"torch ({x.device.type.upper()})"
    device = int(x.__dlpack_device__()[0]) if hasattr(x, "__dlpack__") else 2  # CUDA array interface: CUDA
    if device in _HOST:
        return _root(x)
    return f"{_root(x)} (CUDA)" if device in _CUDA else f"{_root(x)} (DLPack device type {device})"


def mixed_libraries(libraries: dict) -> TypeError:
    """The one error for arguments of different libraries: {name: library} -> a TypeError naming each."""
    which = ", ".join(f"{name} is {lib}" for name, lib in libraries.items())
    return TypeError(f"{', '.join(libraries)} must come from one array library: {which}")


def check_one_library(named: dict) -> None:
    """The rule of the module docstring, over {name: argument}; non-arrays are left to the entry point."""
    libraries = {name: lib for name, lib in ((name, library(x)) for name, x in named.items()) if lib is not None}
    if len(set(libraries.values())) > 1:
        raise mixed_libraries(libraries)


def tracked_by_autograd(x) -> bool:
    """A torch tensor that requires grad, with grad mode on: autograd would want its gradient."""
    return _root(x) == "torch" and bool(getattr(x, "requires_grad", False)) and sys.modules["torch"].is_grad_enabled()


def _is_bfloat16(x) -> bool:
    return str(getattr(x, "dtype", "")).endswith("bfloat16")


def _view(name: str, x):
    """x as a NumPy or CuPy array over the same memory; (view, read as bfloat16 bits?)."""
    bits = False
    if _root(x) == "torch" and x.requires_grad:
        x = x.detach()  # the same memory; DLPack refuses tensors that autograd tracks
    if _is_bfloat16(x):
        if _root(x) != "torch":
            raise TypeError(f"{name} is a bfloat16 {_root(x)} array, which DLPack cannot hand to NumPy or CuPy "
                            f"without a copy: pass its bits (for JAX, jax.lax.bitcast_convert_type({name}, "
                            f"jnp.uint16)) with dtype='bfloat16'")
        x, bits = x.view(importlib.import_module("torch").int16), True
    if hasattr(x, "__dlpack__"):
        device = int(x.__dlpack_device__()[0])
        if device in _HOST:
            return np.from_dlpack(x), bits
        if device in _CUDA:
            return _cupy(name).from_dlpack(x), bits
        raise TypeError(f"{name} lives on DLPack device type {device}; flashcupy takes host memory "
                        f"(NumPy) and CUDA memory (CuPy)")
    return _cupy(name).asarray(x), bits  # __cuda_array_interface__: a view, no copy


def _cupy(name):
    try:
        return importlib.import_module("cupy")
    except ImportError:
        raise TypeError(f"{name} is on a CUDA device, which needs CuPy: pip install 'flashcupy[cuda12]' "
                        f"(or [cuda13])") from None


def _exporter(root: str):
    """The caller's library's DLPack import: results go back through it."""
    if root == "torch":
        return importlib.import_module("torch").from_dlpack
    if root == "jax":
        return importlib.import_module("jax.numpy").from_dlpack
    module = importlib.import_module(root)
    return getattr(module, "from_dlpack", None)


def _items(value):
    """(display name suffix, item) of an argument: itself, or each entry of a list or tuple."""
    if isinstance(value, (list, tuple)):
        return [(f"[{i}]", x) for i, x in enumerate(value)]
    return [("", value)]


def _is_array(x) -> bool:
    return backends.array_library(x) is not None or is_foreign(x)


def array_arguments(fn, args, kwargs) -> dict:
    """{where (position or keyword): value} of the arguments that hold arrays, numbers excluded."""
    names = fn.__code__.co_varnames
    found = {}
    for where, value in list(enumerate(args)) + list(kwargs.items()):
        name = names[where] if isinstance(where, int) else where
        if name not in NOT_ARRAYS and any(_is_array(x) for _, x in _items(value)):
            found[where] = value
    return found


def _named(fn, arrays: dict) -> dict:
    names = fn.__code__.co_varnames
    return {(names[w] if isinstance(w, int) else w) + suffix: x
            for w, value in arrays.items() for suffix, x in _items(value) if _is_array(x)}


_PLAIN = frozenset({bool, int, float, str, type(None)})  # arguments that are no array of any library


def _native_of_one_library(args, kwargs) -> bool:
    """Whether every argument is a plain value (_PLAIN) or a NumPy, CuPy or Numba array, the arrays all of
    one library: a call the rule lets through as it is (anything else takes the whole check)."""
    library = None
    for x in (*args, *kwargs.values()):
        if type(x) in _PLAIN:
            continue
        lib = backends.array_library(x)
        if lib is None or (library is not None and lib != library):
            return False
        library = lib
    return True


def _torch_compiling() -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and torch.compiler.is_compiling()


def accepts_foreign_arrays(fn):
    """Let entry point fn take torch, JAX, PyCUDA (any DLPack or CUDA array interface) arrays: the
    arguments are viewed as NumPy or CuPy arrays, and array results viewed back (see the module);
    every call is held to the one-library rule first."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _torch_compiling():  # torch.compile is tracing this call (torch was imported by then)
            from . import _torch
            return _torch.compiled(fn, wrapper, args, kwargs)
        if _native_of_one_library(args, kwargs):  # the common call: nothing to view, the rule holds
            return fn(*args, **kwargs)
        arrays = array_arguments(fn, args, kwargs)
        named = _named(fn, arrays)
        _refuse_jax_tracers(fn.__name__, named)
        check_one_library(named)
        if not any(is_foreign(x) for x in named.values()):
            return fn(*args, **kwargs)
        if _root(next(iter(named.values()))) == "torch":
            from . import _torch
            _torch.refuse_transforms(fn.__name__, named)
            if _torch.records_autograd(fn.__name__, named):
                return _torch.ENTRY_POINTS[fn.__name__](*args, **kwargs)
        return through_views(fn, args, kwargs, arrays)

    return wrapper


def _refuse_jax_tracers(name: str, named: dict) -> None:
    """A TypeError for a JAX tracer (an argument inside jax.jit, grad or vmap), which holds no memory to
    view: flashcupy.jax's entry points are the ones that run inside JAX's transformations."""
    jax = sys.modules.get("jax")
    if jax is None:
        return
    for arg, x in named.items():
        if isinstance(x, jax.core.Tracer):
            inside = (f"call flashcupy.jax.{name} there" if name in ("attention", "attention_varlen") else
                      "flashcupy.jax's attention and attention_varlen run there")
            raise TypeError(f"{arg} is a JAX tracer (inside jax.jit, grad, vmap or another transformation), which "
                            f"flashcupy.{name} cannot read: {inside}")


def through_views(fn, args, kwargs, arrays=None):
    """fn run on NumPy/CuPy views of its foreign arguments (all of one library: the caller checks),
    its results given back in that library (torch CUDA tensors on torch's current stream)."""
    arrays = array_arguments(fn, args, kwargs) if arrays is None else arrays
    names = fn.__code__.co_varnames
    args, kwargs, bits, first = list(args), dict(kwargs), set(), []

    def view(name, x):
        if not is_foreign(x):
            return x
        v, is_bits = _view(name, x)
        bits.add(is_bits)
        first.append(x)
        return v

    for where, value in arrays.items():
        name = names[where] if isinstance(where, int) else where
        if isinstance(value, (list, tuple)):
            value = type(value)(view(f"{name}[{i}]", x) for i, x in enumerate(value))
        else:
            value = view(name, value)
        if isinstance(where, int):
            args[where] = value
        else:
            kwargs[where] = value
    if not first:
        return fn(*args, **kwargs)
    code = fn.__code__
    bits = True in bits
    if bits and "dtype" in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]:
        if kwargs.get("dtype") not in (None, "bfloat16"):
            raise ValueError(f"dtype must be None or 'bfloat16', got {kwargs['dtype']!r}")
        kwargs["dtype"] = "bfloat16"
    like = first[0]
    stream = contextlib.nullcontext()
    if _root(like) == "torch" and library(like) != "torch":
        from . import _torch
        stream = _torch.current_stream(like)
    with stream:
        return _give_back(fn(*args, **kwargs), like, bits)


def _give_back(result, like, bits):
    """Array results in the library of `like` (an argument of the call); a closure (attention_vjp's
    vjp) made to take and give arrays of that library too."""
    if isinstance(result, tuple):
        return tuple(_give_back(r, like, bits) for r in result)
    if isinstance(result, list):
        return [_give_back(r, like, bits) for r in result]
    if callable(result) and backends.array_library(result) is None:
        return _closure(result, like)
    back = _exporter(_root(like))
    if back is None or backends.array_library(result) not in ("numpy", "cupy"):
        return result  # no DLPack import to go back through (PyCUDA: CuPy arrays)
    out = back(result)
    if bits and np.dtype(result.dtype) == np.int16:
        out = out.view(importlib.import_module("torch").bfloat16)
    return out


def _closure(vjp, like):
    """vjp(dout) for dout of like's library, as the entry point that made it was called."""

    @functools.wraps(vjp)
    def foreign_vjp(dout):
        check_one_library({"q": like, "dout": dout})
        if _root(like) == "torch":
            from . import _torch
            _torch.records_autograd("attention_vjp", {"dout": dout})
        return through_views(vjp, (dout,), {})

    return foreign_vjp
