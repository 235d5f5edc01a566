"""Developer tools for the numba kernels.

    python -m flashcupy.backends.numba_backend.tools ptx [--cc 9.0]
        Compile every kernel for every input dtype to PTX, without a GPU (needs
        NVVM, e.g. pip install nvidia-cuda-nvcc-cu12). Fails on typing errors the
        simulator cannot see, and reports any float64 instruction in a float32
        kernel and each kernel's shared memory.

On a GPU, time it with the common benchmark:
    python -m flashcupy bench --device cuda --impl numba --impl cupy --dtype float16
"""

from __future__ import annotations

import argparse
import re
import sys
import time


def ptx(cc=(9, 0)) -> int:
    from numba import cuda, types
    from numba.np import numpy_support

    from ..._problem import accumulation_dtype
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
    i64 = types.int64
    st4, st3 = types.UniTuple(i64, 5), types.UniTuple(i64, 4)
    mask = types.UniTuple(i64, 3)  # (diagonal, left, right), as numba_backend._mask builds it
    failures = 0
    for dtype in (types.float16, types.float32, types.float64):
        acc = numpy_support.from_dtype(accumulation_dtype(numpy_support.as_dtype(dtype).name))  # p.acc_dtype
        x, a = dtype[::1], acc[::1]
        # softcap, alibi, slopes' (offset, batch, head) strides, biased, bias_st, masked, allow_st
        mods = types.Tuple((acc, i64, types.UniTuple(i64, 3), i64, st4, i64, st4))
        # group, head_dim, scale, mask, mods, then slopes, bias, allow: a call without a bias or a
        # mask passes a spare ACC array for it (plain), one with both its bias and bool mask
        head = (i64, i64, acc, mask, mods)
        plain, modified = head + (a, a, a), head + (a, x, types.boolean[::1])
        fwd = (x, st4, x, st4, x, st4, x, st4, a, st3, i64, i64)
        dkdv = (x, st4, x, st4, x, st4, x, st4, a, st3, a, st3, x, st4, x, st4, i64, i64)
        dq = (x, st4, x, st4, x, st4, x, st4, a, st3, a, st3, x, st4, i64, i64)
        dbias = (x, st4, x, st4, x, st4, x, st4, a, st3, a, st3, x, types.UniTuple(i64, 4), i64, i64, i64, i64)
        probs = (x, st4, x, st4, a, st3, a, st4, i64[::1], i64, i64)
        sigs = [
            ("_attn_fwd", fwd + plain),
            ("_attn_bwd_preprocess", (x, st4, x, st4, a, st3, i64, i64)),
            ("_attn_bwd_dkdv", dkdv + plain),
            ("_attn_bwd_dq", dq + plain),
            ("_attn_fwd", fwd + modified),
            ("_attn_bwd_dkdv", dkdv + modified),
            ("_attn_bwd_dq", dq + modified),
            ("_attn_bwd_dbias", dbias + modified),
            ("_attn_probs", probs + plain),
            ("_attn_probs", probs + modified),
        ]
        for name, sig in sigs:
            fn = getattr(K, name).py_func
            name += "+bias,mask" if sig[-1] == types.boolean[::1] else ""
            t = time.perf_counter()
            try:
                code, _ = cuda.compile_ptx(fn, sig, cc=cc)
            except Exception as e:  # report every kernel, then fail
                failures += 1
                print(f"FAIL {name}[{dtype}]: {type(e).__name__}: {e}")
                continue
            shared = sum(int(n) * int(w) // 8 for w, n in
                         re.findall(r"\.shared \.align \d+ \.b(\d+) \S+\[(\d+)\]", code))
            f64 = len(re.findall(r"\.f64\b", code)) if acc == types.float32 else 0
            note = f"  {f64} f64 instructions in a float32 kernel" if f64 else ""
            print(f"ok   {name}[{dtype}]  shared {shared} B  {time.perf_counter() - t:.1f} s{note}")
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
