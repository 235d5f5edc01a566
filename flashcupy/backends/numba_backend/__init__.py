"""numba backend: the tiled FlashAttention-2 algorithm as numba.cuda kernels.

The kernels live in `kernels.py` (tile sizes, shared-memory budget, barriers);
this module is the host side: it turns arrays into kernel arguments, launches
the kernels and hands results back. The kernels follow the CuPy backend's SIMT
kernels (flash_fwd.cu, flash_bwd.cu): the same online-softmax forward, D
pre-pass, dK/dV kernel over the query heads of a GQA group and separate dQ
kernel, so an idea tried here ports to them. Their threads are laid out
differently (one score per thread, head_dim streamed in chunks; see kernels.py).

Arrays in and out:
- CuPy arrays are read in place through `__cuda_array_interface__`; results
  are CuPy arrays. Kernels run on CuPy's current stream (wrapped as a numba
  external stream), in order with the CuPy work before and after them, with no
  host synchronisation; results and workspaces come from CuPy's memory pool.
- numba device arrays are read in place; results are numba device arrays,
  allocated by numba. Kernels run on numba's default stream; an array bound
  to another stream is synchronised as the CUDA Array Interface asks.
- NumPy arrays are copied to the device (the memory span each one covers, so
  its strides are kept) and the results are copied back as NumPy arrays. This
  is the one place where flashcupy copies between host and device: you asked
  for a GPU backend with host arrays. numba's default stream and allocator.
Any strides work, negative ones included: every array reaches the kernels as
a flat 1-D buffer plus (offset, strides) in elements. Limits: heads_q and
batch at most 65535 (CUDA grid y and z), seqlen at most 2^31 - 1 blocks of
rows (grid x), checked before anything is allocated or launched; head_dim at
most kernels.HEAD_DIM_MAX.

Availability (`unavailable_reason()`, decided once per process): numba and
numba-cuda installed (`pip install flashcupy[numba]`) and
`numba.cuda.is_available()`: a CUDA GPU with its driver, or the CUDA simulator
(`NUMBA_ENABLE_CUDASIM=1` in the environment before numba is first imported),
which runs the very same kernels on the CPU, one Python thread per CUDA
thread, with smaller tiles (see kernels.py). On a GPU numba-cuda must also be
able to compile: libNVVM present, and a numba-cuda release that works with the
installed NumPy. A one-line probe kernel is compiled to PTX to find out, so a
broken toolchain refuses the backend with its cause and fix instead of failing
at the first call.

Fast iteration loop:
1. edit kernels.py (tunables are the UPPERCASE constants at its top);
2. run the kernels on the simulator against the float64 oracle, no GPU needed
   (a minute or two):
       NUMBA_ENABLE_CUDASIM=1 python -m pytest tests/test_numba_backend.py -q
   (one of those tests runs the GPU's tile sizes on the simulator, through
   FLASHCUPY_NUMBA_TILES=gpu; see kernels.py);
3. compile them for a real GPU, still without one (catches typing mistakes
   the simulator cannot see: float64 creeping into the float32 path, float16
   casts; needs NVVM, e.g. `pip install nvidia-cuda-nvcc-cu12`):
       python -m flashcupy.backends.numba_backend.tools ptx
4. on a machine with a GPU: the same tests on the device, then the benchmark:
       NUMBA_ENABLE_CUDASIM=0 python -m pytest tests/test_numba_backend.py -q -m gpu
       python -m flashcupy bench --device cuda --impl numba --dtype float16
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from ... import _dropout

NAME = "numba"
ARRAY_LIBRARIES = ("numpy", "cupy", "numba")
DTYPES = ("float16", "float32", "float64")  # numba has no bfloat16 arithmetic type
MAX_HEAD_DIM = 256  # kernels.HEAD_DIM_MAX: the register accumulators are sized for it
DQ_ONLY = True  # backward launches the D pre-pass and the dQ kernel alone where p.dq_only
MODIFIERS = frozenset({"window", "softcap", "alibi_slopes", "bias", "mask"})  # every score modifier
HEAD_DIM_V = True  # v's head_dim may differ from q's and k's
DROPOUT = True  # dropout_p (kernels._dropout_factor)


@functools.cache
def unavailable_reason():
    """None when the backend can run here, else why not and what to install; decided once per process.

    Cached: the registry asks on every call, and on a GPU the answer costs a probe compile.
    """
    try:
        from numba import cuda
    except ImportError as e:
        return f"numba.cuda cannot be imported ({e}); pip install flashcupy[numba]"
    try:
        if not cuda.is_available():
            return ("numba.cuda finds no CUDA GPU or driver "
                    "(to run on the CPU simulator, set NUMBA_ENABLE_CUDASIM=1 before numba is imported)")
    except Exception as e:  # a broken driver install can raise instead of answering False
        return f"numba.cuda cannot use the GPU: {e}"
    if _kernels().SIMULATOR:
        return None  # the simulator interprets the kernels' Python: nothing is compiled
    return _compiler_reason(cuda.get_current_device().compute_capability)


def _compiler_reason(cc):
    """None when numba-cuda can compile a kernel for compute capability cc, else the cause and the fix."""
    from numba.cuda.cudadrv import nvvm
    if not nvvm.is_available():
        return ('numba-cuda cannot find libNVVM, which compiles its kernels: pip install "numba-cuda[cu12]" '
                '(or "numba-cuda[cu13]", matching the CUDA version the driver supports), '
                "or set CUDA_HOME to a CUDA toolkit")
    try:
        _compile_probe(cc)
    except Exception as e:  # whatever breaks the first compile, say so now rather than at the first call
        return _compile_failure(e)
    return None


def _compile_probe(cc):
    """Compile a one-line kernel to PTX.

    The first compile in a process builds numba-cuda's typing tables, which
    import all its NumPy overloads (where a NumPy that removed a function
    breaks it), then runs NVVM: the same path the backend's kernels take.
    """
    from numba import cuda, types

    def probe(x):
        x[0] = 1

    cuda.compile_ptx(probe, (types.float32[::1],), cc=cc)


def _compile_failure(e: Exception) -> str:
    """The probe's exception as a reason: the cause, and the fix where it is known."""
    from importlib.metadata import version
    numba_cuda = f"numba-cuda {version('numba-cuda')}"
    # numba-cuda registers overloads of NumPy functions by attribute at its first
    # compile; a NumPy that removed one fails there ("module 'numpy' has no
    # attribute ..." or NumPy's own "`np.x` was removed ...").
    if isinstance(e, AttributeError) and ("'numpy'" in str(e) or "`np." in str(e)):
        major_minor = ".".join(np.__version__.split(".")[:2])
        return (f"{numba_cuda} does not work with numpy {np.__version__}: its first compile fails with "
                f"AttributeError: {e}. Install an older numpy (pip install \"numpy<{major_minor}\") "
                f"or a numba-cuda release that supports numpy {major_minor}")
    return f"{numba_cuda} cannot compile a kernel here: {type(e).__name__}: {e}"


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
    from .. import array_library
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


class _Placement:
    """Where one call's kernels run and where its device memory comes from, by the inputs' library.

    CuPy: CuPy's current stream and memory pool, as a CuPy operation in its
    place would use. NumPy and numba arrays: numba's default stream (0) and
    numba's allocator.
    """

    def __init__(self, lib):
        from numba import cuda
        self.lib = lib
        self.stream = 0
        if lib == "cupy":
            import cupy
            self.cupy = cupy
            self.stream = cuda.external_stream(cupy.cuda.get_current_stream().ptr)

    def read(self, x):
        """x as (flat 1-D device array, (offset, strides...)), reading x in place where it lives on the device."""
        from numba import cuda
        st, n = _span(x)
        if self.lib == "numpy":
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
        # sync=False for CuPy: its interface names CuPy's current stream, the
        # stream CuPy orders the work that produced x on, and self.stream is
        # that very stream, so our kernels already queue behind that work; the
        # host synchronisation the interface asks for by default, once per
        # argument, would only stall the CPU. numba arrays keep sync=True: they
        # launch on the default stream, not on a stream they may be bound to.
        return cuda.from_cuda_array_interface(desc, owner=x, sync=self.lib != "cupy"), st

    def empty(self, shape, dtype):
        """A fresh C-contiguous result or workspace: (array of the inputs' library, its flat view for the kernels).

        For NumPy inputs the array is None: the flat device array is copied back.
        """
        from numba import cuda
        if self.lib == "cupy":
            # CuPy's pool hands a freed block out again on the stream it was
            # allocated on, this one: reuse after we drop it queues behind our kernels.
            array = self.cupy.empty(shape, dtype=dtype)
            return array, self.read(array)[0]
        flat = cuda.device_array(int(np.prod(shape)), dtype=dtype)
        return (flat.reshape(shape) if self.lib == "numba" else None), flat


class _Buffer:
    """A fresh contiguous device buffer: the array handed back, and its flat view and strides for the kernels."""

    def __init__(self, place, shape, dtype):
        self.lib = place.lib
        self.shape = tuple(shape)
        self.array, self.flat = place.empty(self.shape, dtype)
        self.st = (0,) + tuple(int(np.prod(self.shape[a + 1:])) for a in range(len(self.shape)))

    def result(self):
        if self.lib == "numpy":
            return self.flat.copy_to_host().reshape(self.shape)
        return self.array


def _cdiv(a, b):
    return -(-a // b)


def _grids(p):
    """The forward / dQ grid (query blocks, query heads, batch) and the dK/dV grid (key blocks, kv
    heads, batch); the D pre-pass takes PREP_THREADS >= BLOCK_M rows a block, so it fits where dQ's does."""
    K = _kernels()
    return ((_cdiv(p.seqlen_q, K.BLOCK_M), p.heads_q, p.batch),
            (_cdiv(p.seqlen_k, K.BLOCK_N), p.heads_kv, p.batch))


def grid_axes(p, backward):
    (queries, heads, batch), (keys, _, _) = _grids(p)
    K = _kernels()
    axes = [(f"seqlen_q ({K.BLOCK_M} rows a block)", queries, 0), ("heads_q", heads, 1), ("batch", batch, 2)]
    if not backward:
        return axes
    axes.append((f"seqlen_k ({K.BLOCK_N} keys a block)", keys, 0))
    if p.dbias:
        axes.append((f"dbias ({K.PREP_THREADS} elements a block)", _dbias_blocks(p.bias.shape), 0))
    return axes


def _dbias_blocks(shape):
    return _cdiv(int(np.prod(shape)), _kernels().PREP_THREADS)


def _mask(p):
    """The kernels' `mask`: (diagonal, left, right) of the Problem's band, -1 for an unbounded side."""
    band = p.band
    return band.diagonal, -1 if band.left is None else band.left, -1 if band.right is None else band.right


def _broadcast(place, x):
    """A rank-4 bias or mask as (flat device array, (offset, strides)), stride 0 along each
    dimension of size 1: the kernels index it with the full (b, h, i, j)."""
    flat, st = place.read(x)
    return flat, st[:1] + tuple(0 if n == 1 else s for n, s in zip(x.shape, st[1:]))


def _common(p, place, spare):
    """Launch arguments every kernel that computes scores shares, after its arrays: group, (head_dim,
    head_dim_v) (q's and k's, v's), scale, then the kernels' `mask` (diagonal, left, right; -1
    unbounded), which only their visibility helpers read, and `mods`, `slopes`, `bias` and `allow`
    (softcap, ALiBi, bias, mask), which only kernels._modify reads. bias and the mask are read in
    place, their broadcast dimensions as zero strides. Each array the call lacks is `spare`, a flat
    device array of the call's own in ACC, never read: no allocation for nothing."""
    mask = _mask(p)
    acc = p.acc_dtype.type
    slopes = bias = allow = spare
    slopes_st, bias_st, allow_st = (0, 0, 0), (0,) * 5, (0,) * 5
    if p.alibi_slopes is not None:
        slopes, st = place.read(p.alibi_slopes)
        slopes_st = (st[0], 0, st[1]) if p.alibi_slopes.ndim == 1 else st  # (offset, batch, head)
    if p.bias is not None:
        bias, bias_st = _broadcast(place, p.bias)
    if p.mask is not None:
        allow, allow_st = _broadcast(place, p.mask)
    drop = (int(p.dropout), _dropout.threshold(p.dropout_p), p.dropout_seed & 0xFFFFFFFF, p.dropout_seed >> 32,
            *p.dropout_origin)  # kernels._dropout_factor
    mods = (acc(p.softcap or 0), int(p.alibi_slopes is not None), slopes_st,
            int(p.bias is not None), bias_st, int(p.mask is not None), allow_st, drop, acc(p.dropout_scale))
    return p.group, (p.head_dim, p.head_dim_v), acc(p.scale), mask, mods, slopes, bias, allow


# ----------------------------------------------------------------------------
# forward and backward
# The interface has checked the grids (grid_axes) and head_dim before anything is allocated.


def _no_offsets(flat):
    """The offsets' arguments of a launch that is not a packed batch's: num_seqs 0, and for the tables a
    view of `flat`, a fresh float workspace of the call, as int32 (never read; no allocation for it)."""
    stand_in = flat.view(np.int32)
    return stand_in, (0, 1), stand_in, (0, 1), 0


def forward(p, q, k, v, _packed=None):
    """out, lse. _packed: forward_varlen's (given out and lse, the offsets' arguments, the slots)."""
    K = _kernels()
    grid, _ = _grids(p)
    place = _Placement(_library(q))
    (qf, qst), (kf, kst), (vf, vst) = (place.read(x) for x in (q, k, v))
    if _packed is None:
        out = _Buffer(place, p.out_shape, p.carrier)
        lse = _Buffer(place, p.lse_shape, p.acc_dtype)  # the kernel computes in lse's dtype (p.lse_dtype is the same)
        offsets = _no_offsets(lse.flat)
    else:
        out, lse, offsets, slots = _packed
        grid = (slots, p.heads_q, 1)
    common = _common(p, place, lse.flat)

    K._flash_fwd[grid, (K.BLOCK_N, K.BLOCK_M), place.stream](
        qf, qst, kf, kst, vf, vst, out.flat, out.st, lse.flat, lse.st,
        p.seqlen_q, p.seqlen_k, *common, *offsets)
    return out.result(), lse.result()


def backward(p, dout, q, k, v, out, lse, _packed=None, dlse=None):
    """dq, dk, dv (and dbias with a bias); (dq,) alone where p.dq_only (no dK/dV launch). _packed:
    backward_varlen's (given dq, dk, dv, the offsets' arguments, the query and the key slots). dlse:
    the gradient of lse, or None (the pre-pass subtracts it from D)."""
    K = _kernels()
    dq_grid, dkdv_grid = _grids(p)
    prep_grid = (_cdiv(p.seqlen_q, K.PREP_THREADS),) + dq_grid[1:]
    place = _Placement(_library(q))
    (qf, qst), (kf, kst), (vf, vst), (dof, dost), (of, ost), (lf, lst) = (
        place.read(x) for x in (q, k, v, dout, out, lse))
    if _packed is None:
        dq = _Buffer(place, q.shape, p.carrier)
        dk, dv = (None, None) if p.dq_only else (_Buffer(place, x.shape, p.carrier) for x in (k, v))
    else:
        dq, dk, dv, offsets, (query_slots, key_slots) = _packed
        dq_grid, dkdv_grid = (query_slots, p.heads_q, 1), (key_slots, p.heads_kv, 1)
    # workspace: D = rowsum(dO ∘ O), laid out as lse; the backward kernels compute in its dtype
    D = _Buffer(place, p.lse_shape, p.acc_dtype)
    if _packed is None:
        offsets = _no_offsets(D.flat)
    common = _common(p, place, D.flat)

    dlf, dlst = (lf, None) if dlse is None else place.read(dlse)  # lse: a stand-in never read
    K._flash_bwd_preprocess[prep_grid, K.PREP_THREADS, place.stream](
        dof, dost, of, ost, dlf, dlst, D.flat, D.st, p.seqlen_q, p.head_dim_v)
    # dK, dV: one block per (key block, kv head, batch), over the query heads of its group
    if not p.dq_only:
        K._flash_bwd_dkdv[dkdv_grid, (K.BLOCK_M, K.BLOCK_N), place.stream](
            qf, qst, kf, kst, vf, vst, dof, dost, lf, lst, D.flat, D.st, dk.flat, dk.st, dv.flat, dv.st,
            p.seqlen_q, p.seqlen_k, *common, *offsets)
    # dQ: one block per (query block, query head, batch)
    K._flash_bwd_dq[dq_grid, (K.BLOCK_N, K.BLOCK_M), place.stream](
        qf, qst, kf, kst, vf, vst, dof, dost, lf, lst, D.flat, D.st, dq.flat, dq.st,
        p.seqlen_q, p.seqlen_k, *common, *offsets)
    if p.dq_only:
        return (dq.result(),)
    grads = dq.result(), dk.result(), dv.result()
    if not p.dbias:
        return grads
    # dbias in the bias's shape and dtype, one thread per element summing in registers (ACC): the
    # backward's extra memory is dbias itself
    dbias = _Buffer(place, p.bias.shape, p.bias.dtype)
    K._flash_bwd_dbias[_dbias_blocks(p.bias.shape), K.PREP_THREADS, place.stream](
        qf, qst, kf, kst, vf, vst, dof, dost, lf, lst, D.flat, D.st, dbias.flat, dbias.shape,
        p.batch, p.heads_q, p.seqlen_q, p.seqlen_k, *common)
    return grads + (dbias.result(),)


# ----------------------------------------------------------------------------
# packed batches: one launch per kernel, the offsets read by the kernels (kernels._sequence_of)


class _Given:
    """An output the interface allocated (a packed batch's out, lse, dq, dk, dv), written by the kernels:
    in place where it lives on the device; for NumPy a device copy of its span, copied back by result()."""

    def __init__(self, place, x):
        self.x, self.lib = x, place.lib
        self.flat, st = place.read(x)
        # the kernels index (b, s, h, d) and (b, h, s): a packed array as a batch of one
        self.st = (st[0], 0) + tuple(st[1:])

    def result(self):
        if self.lib == "numpy":
            st, n = _span(self.x)
            lowest = self.x[tuple(slice(m - 1, m) if s < 0 else slice(0, 1) for m, s in zip(self.x.shape, st[1:]))]
            np.lib.stride_tricks.as_strided(lowest, shape=(n,), strides=(self.x.itemsize,))[...] = \
                self.flat.copy_to_host()
        return self.x


def _offsets(place, cu_seqlens_q, cu_seqlens_k):
    """The kernels' offsets' arguments: each table as (flat device array, (offset, stride)), num_seqs."""
    (fq, sq), (fk, sk) = (place.read(x) for x in (cu_seqlens_q, cu_seqlens_k))
    return fq, sq, fk, sk, int(cu_seqlens_q.shape[0]) - 1


def forward_varlen(p, q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse, alibi_slopes=None) -> None:
    """A packed batch's forward in one launch (attention_varlen), as cupy_backend.forward_varlen: q
    (total_q, heads_q, head_dim), k, v (total_k, heads_kv, head_dim), out and lse (heads_q, total_q)
    allocated with 0 and -inf and written in place; cu_seqlens_q, cu_seqlens_k int32 (sequences + 1,)
    arrays of q's library, read by the kernels (whatever they hold, no row outside the arrays is
    touched). p is the packed problem (batch 1, seqlen_q and seqlen_k the totals); alibi_slopes
    (heads_q,) or (sequences, heads_q)."""
    num_seqs = int(cu_seqlens_q.shape[0]) - 1
    if num_seqs <= 0 or p.seqlen_q == 0 or p.seqlen_k == 0:
        return  # no sequence, no query or no key: out 0, lse -inf, as allocated
    if alibi_slopes is not None:
        p = dataclasses.replace(p, alibi_slopes=alibi_slopes)
    place = _Placement(_library(q))
    given = [_Given(place, x) for x in (out, lse)]
    slots = p.seqlen_q // _kernels().BLOCK_M + num_seqs
    forward(p, q[None], k[None], v[None], _packed=(*given, _offsets(place, cu_seqlens_q, cu_seqlens_k), slots))


def backward_varlen(p, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, dq, dk, dv, alibi_slopes=None,
                    deterministic=False, dlse=None) -> None:
    """A packed batch's backward in one launch per kernel (attention_varlen_backward), as
    cupy_backend.backward_varlen: dq, dk, dv allocated with zeros, written in place (rows of no sequence,
    and sequences without a query or a key, keep them). Deterministic whatever `deterministic` says."""
    num_seqs = int(cu_seqlens_q.shape[0]) - 1
    if num_seqs <= 0 or p.seqlen_q == 0 or p.seqlen_k == 0:
        return
    if alibi_slopes is not None:
        p = dataclasses.replace(p, alibi_slopes=alibi_slopes)
    K = _kernels()
    place = _Placement(_library(q))
    given = [_Given(place, x) for x in (dq, dk, dv)]
    slots = (p.seqlen_q // K.BLOCK_M + num_seqs, p.seqlen_k // K.BLOCK_N + num_seqs)
    backward(p, dout[None], q[None], k[None], v[None], out[None], lse[None],
             _packed=(*given, _offsets(place, cu_seqlens_q, cu_seqlens_k), slots),
             dlse=None if dlse is None else dlse[None])


# ----------------------------------------------------------------------------
# attention_probs


def probs(p, q, k, lse, rows):
    """P = exp(s - lse), (batch, heads_q, len(rows), seqlen_k) in lse's dtype (ACC), for the query
    rows `rows` (a host index array): the forward's scores, band and modifiers.

    The grid's x axis is len(rows) x seqlen_k / PREP_THREADS blocks, which exceeds CUDA's 2^31 - 1
    only for a P of more than 2^31 x PREP_THREADS elements a head: more memory than a GPU has.
    """
    K = _kernels()
    place = _Placement(_library(q))
    (qf, qst), (kf, kst), (lf, lst) = (place.read(x) for x in (q, k, lse))
    P = _Buffer(place, (p.batch, p.heads_q, rows.size, p.seqlen_k), p.acc_dtype)
    index = np.ascontiguousarray(rows, dtype=np.int64)
    if place.lib == "cupy":  # CuPy's stream and pool, as every array of the call
        rows_flat = place.read(place.cupy.asarray(index))[0]
    else:
        from numba import cuda
        rows_flat = cuda.to_device(index)
    grid = (_cdiv(rows.size * p.seqlen_k, K.PREP_THREADS), p.heads_q, p.batch)
    K._flash_probs[grid, K.PREP_THREADS, place.stream](
        qf, qst, kf, kst, lf, lst, P.flat, P.st, rows_flat, p.seqlen_q, p.seqlen_k, *_common(p, place, lf))
    return P.result()
