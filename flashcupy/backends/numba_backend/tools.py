"""Developer tools for the numba kernels.

    python -m flashcupy.backends.numba_backend.tools ptx [--cc 9.0]
        Compile every specialisation the backend launches (signatures(): each kernel
        for each input dtype and each kind of slopes, bias and mask array) to PTX,
        without a GPU (needs NVVM, e.g. pip install nvidia-cuda-nvcc-cu12). Fails on
        typing errors the simulator cannot see, and reports any float64 instruction
        in a float32 kernel and each kernel's shared memory.

On a GPU, time it with the common benchmark:
    python -m flashcupy bench --device cuda --impl numba --impl cupy --dtype float16
"""

from __future__ import annotations

import argparse
import itertools
import re
import sys
import time


def signatures():
    """[(kernel, label, numba signature)]: every specialisation the backend launches (numba compiles
    one per set of argument types). For each input dtype: the D pre-pass (with and without the
    gradient of lse), and the forward, dK/dV,
    dQ and attention_probs kernels for each kind of array a call can pass as the ALiBi slopes (the
    accumulation dtype ACC, or float32 where ACC is float64), the bias (q's dtype or float32) and
    the mask (bool), each the spare ACC array where the call has none (numba_backend._common); the
    dbias kernel for each of those with a bias, writing dbias in the bias's dtype.
    tests/test_numba_backend.py checks that this is what the backend launches."""
    from numba import types
    from numba.np import numpy_support

    from ..._problem import accumulation_dtype
    i64 = types.int64
    st4, st3 = types.UniTuple(i64, 5), types.UniTuple(i64, 4)
    mask = types.UniTuple(i64, 3)  # (diagonal, left, right), as numba_backend._mask builds it
    # cu_seqlens_q, its (offset, stride), cu_seqlens_k, its, num_seqs (0: stand-ins, not a packed batch)
    cu = (types.int32[::1], types.UniTuple(i64, 2))
    offsets = cu + cu + (i64,)
    out = []
    for dtype in (types.float16, types.float32, types.float64):
        acc = numpy_support.from_dtype(accumulation_dtype(numpy_support.as_dtype(dtype).name))  # p.acc_dtype
        x, a, f32 = dtype[::1], acc[::1], types.float32[::1]
        # softcap, alibi, slopes' (offset, batch, head) strides, biased, bias_st, masked, allow_st, dropout's
        # (on, threshold, seed_lo, seed_hi, origin), 1 / (1 - p)
        mods = types.Tuple((acc, i64, types.UniTuple(i64, 3), i64, st4, i64, st4, types.UniTuple(i64, 8), acc))
        # group, (head_dim, head_dim_v), scale, mask, mods; then slopes, bias, allow
        head = (i64, types.UniTuple(i64, 2), acc, mask, mods)
        fwd = (x, st4, x, st4, x, st4, x, st4, a, st3, i64, i64)
        dkdv = (x, st4, x, st4, x, st4, x, st4, a, st3, a, st3, x, st4, x, st4, i64, i64)
        dq = (x, st4, x, st4, x, st4, x, st4, a, st3, a, st3, x, st4, i64, i64)
        probs = (x, st4, x, st4, a, st3, a, st4, i64[::1], i64, i64)
        for dlst in (types.none, st3):  # without and with the gradient of lse
            out.append(("_flash_bwd_preprocess", f"[{dtype}]" + (" dlse" if dlst != types.none else ""),
                        (x, st4, x, st4, a, dlst, a, st3, i64, i64)))
        kinds = {"slopes": [None] + ([f32] if acc == types.float64 else []),
                 "bias": [None] + list(dict.fromkeys((x, f32))),
                 "mask": [None, types.boolean[::1]]}
        for slopes, bias, allow in itertools.product(*kinds.values()):
            arrays = tuple(t or a for t in (slopes, bias, allow))
            label = f"[{dtype}]" + "".join(f" {name} {t.dtype}" for name, t in zip(kinds, (slopes, bias, allow)) if t)
            for name, args in (("_flash_fwd", fwd), ("_flash_bwd_dkdv", dkdv), ("_flash_bwd_dq", dq),
                               ("_flash_probs", probs)):
                out.append((name, label, args + head + arrays + (() if name == "_flash_probs" else offsets)))
            if bias is not None:
                dbias = (x, st4, x, st4, x, st4, x, st4, a, st3, a, st3, bias, types.UniTuple(i64, 4), i64, i64, i64, i64)
                out.append(("_flash_bwd_dbias", label, dbias + head + arrays))
    unique = {}
    for name, label, sig in out:  # types that coincide (float64's bias and its spare): once, named by the first
        unique.setdefault((name, sig), (name, label, sig))
    return list(unique.values())


def ptx(cc=(9, 0)) -> int:
    from numba import cuda

    from . import kernels as K

    if K.SIMULATOR:
        print("ptx: numba.cuda is the simulator in this process; unset NUMBA_ENABLE_CUDASIM", file=sys.stderr)
        return 2
    from numba.cuda.cudadrv import nvvm
    if not nvvm.is_available():
        print("ptx: NVVM not found (pip install nvidia-cuda-nvcc-cu12, or a CUDA toolkit)", file=sys.stderr)
        return 3
    if not cuda.is_available():
        # device functions are compiled for "the current device"; with no GPU, name the target
        from numba.cuda import dispatcher
        dispatcher.get_current_device = lambda: argparse.Namespace(compute_capability=cc)
    print(f"tiles {K.TILES!r}: BLOCK_M {K.BLOCK_M}, BLOCK_N {K.BLOCK_N}, D_TILE {K.D_TILE}, "
          f"PREP_THREADS {K.PREP_THREADS}")
    failures = 0
    for name, label, sig in signatures():
        fn = getattr(K, name).py_func
        t = time.perf_counter()
        try:
            code, _ = cuda.compile_ptx(fn, sig, cc=cc)
        except Exception as e:  # report every kernel, then fail
            failures += 1
            print(f"FAIL {name}{label}: {type(e).__name__}: {e}")
            continue
        shared = sum(int(n) * int(w) // 8 for w, n in
                     re.findall(r"\.shared \.align \d+ \.b(\d+) \S+\[(\d+)\]", code))
        f64 = len(re.findall(r"\.f64\b", code)) if not label.startswith("[float64]") else 0  # ACC float32
        note = f"  {f64} f64 instructions in a float32 kernel" if f64 else ""
        print(f"ok   {name}{label}  shared {shared} B  {time.perf_counter() - t:.1f} s{note}")
        failures += bool(f64)
    return 1 if failures else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashcupy.backends.numba_backend.tools")
    sub = parser.add_subparsers(dest="command", required=True)
    p_ptx = sub.add_parser("ptx", help="compile every kernel to PTX (no GPU needed)")
    p_ptx.add_argument("--cc", default="9.0", help="compute capability, e.g. 8.0 or 9.0")
    args = parser.parse_args(argv)
    return ptx(tuple(int(x) for x in args.cc.split(".")))


if __name__ == "__main__":
    sys.exit(main())
