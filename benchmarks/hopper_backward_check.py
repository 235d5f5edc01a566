"""On a GPU: the Hopper backward (flash_bwd_sm90.cu) beside the mma.sync one it replaces, and
cuDNN, in one run; then the Hopper building blocks again. bash benchmarks/gpu_session.sh times
the forwards; its sweep has no mma.sync backward.

    PYTHONPATH=. python3 benchmarks/hopper_backward_check.py      (on the device machine; a table last)
"""

from __future__ import annotations

import sys

import cupy

import flashcupy
from flashcupy.backends import cupy_backend
from flashcupy.tools import bench

ROWS = []


def timed(fn, repeat=10):
    fn()
    cupy.cuda.get_current_stream().synchronize()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(repeat):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) / 1e3)
    return sorted(times)[len(times) // 2]


def main() -> int:
    import torch
    import torch.nn.functional as F
    for dtype in ("bfloat16", "float16"):
        for D in (128, 64):
            for causal in (False, True):
                for S in (1024, 4096, 16384):
                    B, H = 16384 // S, 2048 // D
                    tq = [torch.randn(B, S, H, D, device="cuda", dtype=getattr(torch, dtype)) for _ in range(4)]
                    q, k, v, do = (cupy.asarray(x.view(torch.int16)).view(cupy.uint16) if dtype == "bfloat16"
                                   else cupy.asarray(x) for x in tq)
                    kw = dict(causal=causal, dtype="bfloat16" if dtype == "bfloat16" else None)
                    out, lse = flashcupy.attention(q, k, v, return_lse=True, **kw)
                    flops = bench.flops(B, H, S, D, causal, "backward")
                    row = [dtype, D, causal, S]
                    for wgmma in (True, False):
                        cupy_backend.USE_WGMMA = wgmma
                        row.append(flops / timed(lambda: flashcupy.attention_backward(do, q, k, v, out, lse, **kw)) / 1e12)
                    cupy_backend.USE_WGMMA = True
                    a, b, c, g = (x.transpose(1, 2).requires_grad_() for x in tq)
                    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                        o = F.scaled_dot_product_attention(a, b, c, is_causal=causal)
                        row.append(flops / timed(lambda: torch.autograd.grad(o, (a, b, c), g, retain_graph=True)) / 1e12)
                    ROWS.append(row)
                    print(*row, flush=True)
    print("\ndtype     D   causal  S      hopper  mma.sync  cudnn  (backward TFLOP/s)")
    for r in ROWS:
        print(f"{r[0]:<9} {r[1]:<3} {str(r[2]):<7} {r[3]:<6} {r[4]:6.1f}  {r[5]:6.1f}  {r[6]:6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
