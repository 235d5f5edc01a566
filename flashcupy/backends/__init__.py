"""Backend registry.

A backend is a module with:

    NAME: str
    ARRAY_LIBRARIES: tuple[str, ...]   # array libraries it takes ('numpy', 'cupy', 'numba')
    DTYPES: tuple[str, ...]            # value dtypes it computes on ('float16', ..., 'bfloat16')
    MAX_HEAD_DIM: int | None           # the largest head_dim it takes (None: any)
    MODIFIERS: frozenset[str]          # the score modifiers it computes ("window", "softcap", ...)
    grid_axes(p, backward) -> list of (what, blocks, axis): every CUDA grid axis its launches
                                       # for p would use (none on the CPU); checked against MAX_GRID
    unavailable_reason() -> str | None # None when usable on this machine
    allocate(like, shape, dtype, fill) -> array of like's library filled with `fill`
    forward(p, q, k, v) -> (out, lse)
    backward(p, dout, q, k, v, out, lse) -> (dq, dk, dv), and dbias after them when p.bias is set
    probs(p, q, k, lse, rows) -> P      # optional: attention_probs, rows an index array
    ATOMIC_BACKWARD: bool              # optional: backward takes deterministic= (False may use atomics)
    split_plan(p, q, k, v, num_splits) # optional: forward takes num_splits= (split-KV in one launch)
    WRITES_INTO: bool                  # optional: forward and backward take into=, the arrays to
                                       # write their results into, probs into=, the array P (else the
                                       # interface copies them there)
    DQ_ONLY: bool                      # optional: backward returns (dq,) alone, spending nothing on
                                       # dk and dv, where p.dq_only (else the interface drops them)

The interface checks every limit a backend declares before it runs (backends never re-validate);
`p` is a validated `flashcupy._problem.Problem`. Arrays hold p.dtype values in
p.carrier storage (uint16 bits for dtype="bfloat16"); outputs use p.carrier too. Modules are imported lazily, so a
backend whose library is missing costs nothing until it is asked for.
"""

from __future__ import annotations

import importlib

import numpy as np

_MODULES = {
    "numpy": "flashcupy.backends.numpy_backend",
    "cupy": "flashcupy.backends.cupy_backend",
    "numba": "flashcupy.backends.numba_backend",
}

NAMES = tuple(_MODULES)

MAX_GRID = (2**31 - 1, 65535, 65535)  # CUDA's limit on thread blocks along grid x, y, z (sm_30 and later)

# backend="auto": the backend that takes each array library without a copy.
DEFAULT_FOR_LIBRARY = {"numpy": "numpy", "cupy": "cupy", "numba": "numba"}


_DEVICE_ARRAY_TYPES = {}  # type -> 'cupy', 'numba' or None: asked once a type (CuPy builds the interface's dict)


def array_library(x) -> str | None:
    """'numpy', 'cupy' or 'numba' for arrays of those libraries, else None."""
    if isinstance(x, np.ndarray):
        return "numpy"
    t = type(x)
    try:
        return _DEVICE_ARRAY_TYPES[t]
    except KeyError:
        pass
    root = t.__module__.split(".")[0]
    # a class's arrays all have the interface or none does (cupy.ndarray, numba's DeviceNDArray)
    lib = root if root in ("cupy", "numba") and hasattr(x, "__cuda_array_interface__") else None
    if lib is not None:
        _DEVICE_ARRAY_TYPES[t] = lib
    return lib


def bfloat16_dtype() -> np.dtype:
    """NumPy's bfloat16 dtype, from ml_dtypes (the one JAX uses): for computing on bfloat16
    values with NumPy. The interface itself never needs it: it names the value dtype."""
    try:
        import ml_dtypes
    except ImportError:
        raise TypeError("computing on bfloat16 values with NumPy needs the ml_dtypes package "
                        "(pip install 'flashcupy[bf16]')") from None
    return np.dtype(ml_dtypes.bfloat16)


class BackendUnavailableError(RuntimeError):
    """The backend exists but cannot run here (library, driver or GPU missing)."""


def module(name: str):
    """The backend's module, imported but not checked for availability."""
    if name not in _MODULES:
        raise ValueError(f"backend must be one of {', '.join(map(repr, NAMES))}, got {name!r}")
    return importlib.import_module(_MODULES[name])


def unavailable_reason(name: str) -> str | None:
    try:
        mod = module(name)
    except ImportError as e:  # the backend module itself failed to import
        return f"import failed: {e}"
    return mod.unavailable_reason()


def load(name: str):
    """The backend's module, ready to run; BackendUnavailableError if it cannot run here."""
    reason = unavailable_reason(name)
    if reason is not None:
        raise BackendUnavailableError(f"backend {name!r} is not available: {reason}")
    return module(name)
