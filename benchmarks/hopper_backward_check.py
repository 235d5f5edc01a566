"""On a GPU: the Hopper backward (flash_bwd_sm90.cu) beside the mma.sync one it replaces, its
deterministic mode (deterministic=True: dQ's adds in key-block order, flash_bwd_sm90.cu's DETERMINISTIC)
and the mma.sync deterministic kernels it replaces, its tall pass at head_dim 64
(cupy_backend.SM90_TALL_BACKWARD: FA3's 128 x 128; nan at 128), cuDNN and torch's flash
(FA2), in one run, with how far the Hopper dq, dk, dv lie from cuDNN's (the largest difference over
the largest magnitude). bash benchmarks/gpu_session.sh times the forwards; its sweep has no mma.sync
backward.

    PYTHONPATH=. python3 benchmarks/hopper_backward_check.py      (on the device machine; a table last)
"""

from __future__ import annotations

import math
import sys

import cupy

import flashcupy
from flashcupy.backends import cupy_backend
from flashcupy.backends.cupy_backend import specs
from flashcupy.tools import bench
from flashcupy.tools.bench import median_gpu_time as timed

ROWS = []


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
                    for wgmma, deterministic in ((True, False), (False, False), (True, True), (False, True)):
                        cupy_backend.USE_WGMMA = wgmma
                        row.append(flops / timed(lambda: flashcupy.attention_backward(
                            do, q, k, v, out, lse, deterministic=deterministic, **kw)) / 1e12)
                    cupy_backend.USE_WGMMA = True
                    grads = flashcupy.attention_backward(do, q, k, v, out, lse, **kw)
                    a, b, c, g = (x.transpose(1, 2).requires_grad_() for x in tq)
                    for backend in (torch.nn.attention.SDPBackend.CUDNN_ATTENTION,
                                    torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                        with torch.nn.attention.sdpa_kernel(backend):
                            o = F.scaled_dot_product_attention(a, b, c, is_causal=causal)
                            row.append(flops / timed(lambda: torch.autograd.grad(o, (a, b, c), g, retain_graph=True))
                                       / 1e12)
                            if backend == torch.nn.attention.SDPBackend.CUDNN_ATTENTION:
                                want = torch.autograd.grad(o, (a, b, c), g, retain_graph=True)
                    worst = 0.0
                    for got, ref in zip(grads, want):
                        ref = ref.transpose(1, 2).float()
                        got = torch.as_tensor(got.view(cupy.int16) if dtype == "bfloat16" else got, device="cuda")
                        got = got.view(torch.bfloat16).float() if dtype == "bfloat16" else got.float()
                        worst = max(worst, float((got - ref).abs().max() / ref.abs().max()))
                    row.append(worst)
                    # the Hopper default's host part of a call and back-to-back rate, and cuDNN's
                    host, b2b = bench.host_and_back_to_back(lambda: flashcupy.attention_backward(do, q, k, v, out, lse,
                                                                                                **kw))
                    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                        o = F.scaled_dot_product_attention(a, b, c, is_causal=causal)
                        _, cudnn_b2b = bench.host_and_back_to_back(lambda: torch.autograd.grad(o, (a, b, c), g,
                                                                                               retain_graph=True))
                    row += [host * 1e6, flops / b2b / 1e12, flops / cudnn_b2b / 1e12]
                    tall = math.nan  # the tall pass, where it applies (specs.SM90_TALL_BACKWARD_TILES)
                    if D in specs.SM90_TALL_BACKWARD_TILES:
                        cupy_backend.SM90_TALL_BACKWARD = True
                        tall = flops / timed(lambda: flashcupy.attention_backward(do, q, k, v, out, lse, **kw)) / 1e12
                        cupy_backend.SM90_TALL_BACKWARD = False
                    row.append(tall)
                    ROWS.append(row)
                    print(*row, flush=True)
    print("\nbackward TFLOP/s (median of 10); vs cudnn: max |hopper - cudnn| / max |cudnn| over dq, dk, dv")
    print("determ.: the Hopper deterministic backward; its / hopper: the ratio the issue asks >= 0.85 of")
    print("host: us of the host's part of a Hopper call; hop.b2b, cudnn.b2b: TFLOP/s of calls back to back "
          "(bench.host_and_back_to_back); tall: TFLOP/s with SM90_TALL_BACKWARD (nan where it does not apply)")
    print("dtype     D   causal  S      hopper  mma.sync  determ.  mma.det  cudnn  flash  hop/cudnn  hop/flash  "
          "det/hop  vs cudnn  host  hop.b2b  cudnn.b2b  b2b/cudnn   tall  tall/hop")
    for r in ROWS:
        print(f"{r[0]:<9} {r[1]:<3} {str(r[2]):<7} {r[3]:<6} {r[4]:6.1f}  {r[5]:6.1f}  {r[6]:7.1f}  {r[7]:7.1f} "
              f"{r[8]:6.1f} {r[9]:6.1f}  {r[4] / r[8]:8.2f}  {r[4] / r[9]:8.2f}  {r[6] / r[4]:7.2f}  {r[10]:.2e}"
              f"  {r[11]:4.0f}  {r[12]:7.1f}  {r[13]:9.1f}  {r[12] / r[13]:9.2f}  {r[14]:5.1f}  {r[14] / r[4]:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
