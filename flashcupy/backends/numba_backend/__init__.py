"""numba backend: the tiled FlashAttention-2 algorithm as numba.cuda kernels.

The kernels live in `kernels.py` (tile sizes, shared-memory budget, barriers);
this module is the host side: it turns arrays into kernel arguments, launches
the kernels and hands results back. It mirrors the NumPy backend's tile loop,
so a kernel bug can be bisected against it stage by stage.

Arrays in and out:
- CuPy arrays are read in place through `__cuda_array_interface__`; results
  are CuPy arrays. Launches use numba's default stream.
- numba device arrays are read in place; results are numba device arrays.
- NumPy arrays are copied to the device (the memory span each one covers, so
  its strides are kept) and the results are copied back as NumPy arrays. This
  is the one place where flashcupy copies between host and device: you asked
  for a GPU backend with host arrays.
Any strides work, negative ones included: every array reaches the kernels as
a flat 1-D buffer plus (offset, strides) in elements. Limits: heads_q and
batch at most 65535 (grid y and z); head_dim at most kernels.HEAD_DIM_MAX.

Availability: numba and numba-cuda installed (`pip install flashcupy[numba]`)
and `numba.cuda.is_available()`: a CUDA GPU with its driver, or the CUDA
simulator (`NUMBA_ENABLE_CUDASIM=1` in the environment before numba is first
imported), which runs the very same kernels on the CPU, one Python thread per
CUDA thread, with smaller tiles (see kernels.py).

Fast iteration loop:
1. edit kernels.py (tunables are the UPPERCASE constants at its top);
2. run the kernels on the simulator against the float64 oracle, no GPU needed
   (a minute or two):
       NUMBA_ENABLE_CUDASIM=1 python -m pytest tests/test_numba_backend.py -q
3. compile them for a real GPU, still without one (catches typing mistakes
   the simulator cannot see: float64 creeping into the float32 path, float16
   casts; needs NVVM, e.g. `pip install nvidia-cuda-nvcc-cu12`):
       python -m flashcupy.backends.numba_backend.tools ptx
4. on a machine with a GPU: the same tests on the device, then the benchmark:
       NUMBA_ENABLE_CUDASIM=0 python -m pytest tests/test_numba_backend.py -q -m gpu
       python -m flashcupy bench --device cuda --impl numba --dtype float16
"""

from __future__ import annotations

import numpy as np

NAME = "numba"
ARRAY_LIBRARIES = ("numpy", "cupy", "numba")
DTYPES = ("float16", "float32", "float64")  # numba has no bfloat16 arithmetic type
MAX_HEAD_DIM = 256  # kernels.HEAD_DIM_MAX: the register accumulators are sized for it


def unavailable_reason():
    try:
        from numba import cuda
    except ImportError as e:
        return f"numba.cuda cannot be imported ({e}); pip install flashcupy[numba]"
    try:
        if cuda.is_available():
            return None
    except Exception as e:  # a broken driver install can raise instead of answering False
        return f"numba.cuda cannot use the GPU: {e}"
    return ("numba.cuda finds no CUDA GPU or driver "
            "(to run on the CPU simulator, set NUMBA_ENABLE_CUDASIM=1 before numba is imported)")


def simulated() -> bool:
    """True when numba.cuda is the CUDA simulator: correct results, at CPU-interpreter speed.

    Callers that pick backends by availability (benchmarks, `check` over every
    backend) should pass over a simulated numba backend unless asked for it.
    """
    return unavailable_reason() is None and _kernels().SIMULATOR


def _kernels():
    from . import kernels
    return kernels


def _library(x) -> str:
    from ..._api import array_library
    return array_library(x)


def allocate(like, shape, dtype, fill):
    lib = _library(like)
    if lib == "numpy":
        return np.full(shape, fill, dtype=dtype)
    if lib == "cupy":
        import cupy
        return cupy.full(shape, fill, dtype=dtype)
    from numba import cuda
    return cuda.to_device(np.full(shape, fill, dtype=dtype))


# ----------------------------------------------------------------------------
# arrays -> kernel arguments


def _span(x):
    """(offset, strides) in elements, and the element span [lowest, highest] x covers.

    offset is where x[0, ..., 0] sits in a flat buffer that starts at x's
    lowest element; strides may be negative or zero.
    """
    itemsize = np.dtype(x.dtype).itemsize
    strides = tuple(int(s) // itemsize for s in x.strides)
    lo = sum((n - 1) * s for n, s in zip(x.shape, strides) if s < 0)
    hi = sum((n - 1) * s for n, s in zip(x.shape, strides) if s > 0)
    return (-lo,) + strides, hi - lo + 1


def _device_flat(x, lib):
    """x as (flat 1-D device array, (offset, strides...)), reading x in place where it lives on the device."""
    from numba import cuda
    st, n = _span(x)
    if lib == "numpy":
        lowest = x[tuple(slice(m - 1, m) if s < 0 else slice(0, 1) for m, s in zip(x.shape, st[1:]))]
        flat = np.lib.stride_tricks.as_strided(lowest, shape=(n,), strides=(x.itemsize,))
        return cuda.to_device(flat), st
    cai = x.__cuda_array_interface__
    desc = {
        "shape": (n,),
        "strides": None,
        "typestr": cai["typestr"],
        "data": (cai["data"][0] - st[0] * np.dtype(x.dtype).itemsize, False),
        "version": 3,
    }
    if "stream" in cai:
        desc["stream"] = cai["stream"]
    return cuda.from_cuda_array_interface(desc, owner=x), st


class _Output:
    """A fresh contiguous result: the array handed back, and its flat view for the kernels."""

    def __init__(self, lib, shape, dtype):
        from numba import cuda
        self.lib = lib
        self.shape = tuple(shape)
        size = int(np.prod(self.shape))
        strides = tuple(int(np.prod(self.shape[a + 1:])) for a in range(len(self.shape)))
        self.st = (0,) + strides
        if lib == "cupy":
            import cupy
            self.array = cupy.empty(self.shape, dtype=dtype)
            self.flat = self.array.reshape(size)
        else:
            self.flat = cuda.device_array(size, dtype=dtype)
            self.array = self.flat.reshape(self.shape) if lib == "numba" else None

    def result(self):
        if self.lib == "numpy":
            return self.flat.copy_to_host().reshape(self.shape)
        return self.array


def _cdiv(a, b):
    return -(-a // b)


def _check_head_dim(p):
    if p.head_dim > MAX_HEAD_DIM:
        raise ValueError(f"the numba backend supports head_dim up to {MAX_HEAD_DIM}, got {p.head_dim}")


def _common(p):
    """Launch arguments every tile kernel shares, after its arrays."""
    return p.group, p.head_dim, p.acc_dtype.type(p.scale), p.causal, p.causal_offset


# ----------------------------------------------------------------------------
# forward and backward


def forward(p, q, k, v):
    _check_head_dim(p)
    K = _kernels()
    lib = _library(q)
    (qf, qst), (kf, kst), (vf, vst) = (_device_flat(x, lib) for x in (q, k, v))
    out = _Output(lib, q.shape, p.dtype)
    lse = _Output(lib, p.lse_shape, p.lse_dtype)

    grid = (_cdiv(p.seqlen_q, K.BLOCK_Q), p.heads_q, p.batch)
    K._attn_fwd[grid, (K.BLOCK_K, K.BLOCK_Q)](
        qf, qst, kf, kst, vf, vst, out.flat, out.st, lse.flat, lse.st,
        p.seqlen_q, p.seqlen_k, *_common(p))
    return out.result(), lse.result()


def backward(p, dout, q, k, v, out, lse):
    from numba import cuda
    _check_head_dim(p)
    K = _kernels()
    lib = _library(q)
    (qf, qst), (kf, kst), (vf, vst), (dof, dost), (of, ost), (lf, lst) = (
        _device_flat(x, lib) for x in (q, k, v, dout, out, lse))
    dq = _Output(lib, q.shape, p.dtype)
    dk = _Output(lib, k.shape, p.dtype)
    dv = _Output(lib, v.shape, p.dtype)
    D = cuda.device_array(p.batch * p.heads_q * p.seqlen_q, dtype=p.acc_dtype)
    Dst = (0, p.heads_q * p.seqlen_q, p.seqlen_q, 1)

    # pre-pass: D = rowsum(dO ∘ O)
    K._attn_bwd_preprocess[(_cdiv(p.seqlen_q, K.PREP_THREADS), p.heads_q, p.batch), K.PREP_THREADS](
        dof, dost, of, ost, D, Dst, lf, p.seqlen_q, p.head_dim)
    # dK, dV: one block per (key block, kv head, batch), over the query heads of its group
    K._attn_bwd_dkdv[(_cdiv(p.seqlen_k, K.BLOCK_K), p.heads_kv, p.batch), (K.BLOCK_Q, K.BLOCK_K)](
        qf, qst, kf, kst, vf, vst, dof, dost, lf, lst, D, Dst, dk.flat, dk.st, dv.flat, dv.st,
        p.seqlen_q, p.seqlen_k, *_common(p))
    # dQ: one block per (query block, query head, batch)
    K._attn_bwd_dq[(_cdiv(p.seqlen_q, K.BLOCK_Q), p.heads_q, p.batch), (K.BLOCK_K, K.BLOCK_Q)](
        qf, qst, kf, kst, vf, vst, dof, dost, lf, lst, D, Dst, dq.flat, dq.st,
        p.seqlen_q, p.seqlen_k, *_common(p))
    return dq.result(), dk.result(), dv.result()
