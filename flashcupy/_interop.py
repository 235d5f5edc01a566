"""Arrays of other libraries (torch, JAX, PyCUDA, ...), viewed without a copy, results given back
in the caller's library.

An argument that is not a NumPy, CuPy or Numba array but exposes `__dlpack__` is viewed as a NumPy
array when it lives in host memory and as a CuPy array when it lives on a CUDA device (DLPack
shares the memory; nothing is copied); one that exposes only `__cuda_array_interface__` (PyCUDA)
is viewed as a CuPy array. The entry point then runs on those views, and its array results are
handed back through DLPack to the library of the arguments: torch tensors in, torch tensors out;
JAX in, JAX out (CuPy for PyCUDA, which has no DLPack import). Torch tensors that require grad are
read through `detach()` (the same memory): results are plain tensors, outside autograd.

bfloat16: NumPy and CuPy have no bfloat16 in DLPack, so a torch bfloat16 tensor is viewed as the
int16 bit patterns it holds (`Tensor.view(torch.int16)`, no copy) and the call reads them as
bfloat16 (dtype="bfloat16"); bfloat16 results are viewed back the same way. JAX has no such view
without a copy (`bitcast_convert_type` makes a new array), so JAX bfloat16 is refused with the
way to pass it.
"""

from __future__ import annotations

import functools
import importlib

import numpy as np

from . import backends

# DLPack device types (dlpack.h): host memory that NumPy can view, and CUDA memory for CuPy
_HOST = {1, 3}   # kDLCPU, kDLCUDAHost
_CUDA = {2, 13}  # kDLCUDA, kDLCUDAManaged


def _root(x) -> str:
    root = type(x).__module__.split(".")[0]
    return "jax" if root == "jaxlib" else root


def is_foreign(x) -> bool:
    """An array of a library the backends do not take directly, but one that can be viewed."""
    if backends.array_library(x) is not None or isinstance(x, (str, bytes)):
        return False
    return hasattr(x, "__dlpack__") or hasattr(x, "__cuda_array_interface__")


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


def accepts_foreign_arrays(fn):
    """Let entry point fn take torch, JAX, PyCUDA (any DLPack or CUDA array interface) arrays: the
    arguments are viewed as NumPy or CuPy arrays, and array results viewed back (see the module)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        foreign = {}  # where (position or keyword) -> the argument (an array, or a list of them)
        for where, value in list(enumerate(args)) + list(kwargs.items()):
            items = value if isinstance(value, (list, tuple)) else (value,)
            if any(is_foreign(x) for x in items):
                foreign[where] = value
        if not foreign:
            return fn(*args, **kwargs)
        roots = {_root(x) for value in foreign.values()
                 for x in (value if isinstance(value, (list, tuple)) else (value,)) if is_foreign(x)}
        if len(roots) > 1:
            raise TypeError(f"array arguments must come from one library, got {', '.join(sorted(roots))}")
        names = fn.__code__.co_varnames
        args, bits = list(args), set()

        def view(name, x):
            if not is_foreign(x):
                return x
            v, is_bits = _view(name, x)
            bits.add(is_bits)
            return v

        for where, value in foreign.items():
            name = names[where] if isinstance(where, int) else where
            if isinstance(value, (list, tuple)):
                value = type(value)(view(f"{name}[{i}]", x) for i, x in enumerate(value))
            else:
                value = view(name, value)
            if isinstance(where, int):
                args[where] = value
            else:
                kwargs[where] = value
        bits = True in bits
        if bits:
            if kwargs.get("dtype") not in (None, "bfloat16"):
                raise ValueError(f"dtype must be None or 'bfloat16', got {kwargs['dtype']!r}")
            kwargs["dtype"] = "bfloat16"
        back = _exporter(roots.pop())
        return _give_back(fn(*args, **kwargs), back, bits)

    return wrapper


def _give_back(result, back, bits):
    if isinstance(result, tuple):
        return tuple(_give_back(r, back, bits) for r in result)
    if isinstance(result, list):
        return [_give_back(r, back, bits) for r in result]
    if back is None or backends.array_library(result) not in ("numpy", "cupy"):
        return result  # a closure (attention_vjp's vjp), or no DLPack import to go back through
    out = back(result)
    if bits and np.dtype(result.dtype) == np.int16:
        out = out.view(importlib.import_module("torch").bfloat16)
    return out
