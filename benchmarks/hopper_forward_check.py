"""On a GPU: the Hopper forward (flash_fwd_sm90.cu) persistent (a CTA an SM walking its tiles:
cupy_backend.SM90_PERSISTENT = True) beside the same kernel launched a CTA a tile (the default), with
FA3's wider key blocks (SM90_WIDE = True; without causal, where they apply, else nan), its 192 query
rows at head_dim 64 (SM90_TALL_FORWARD = True: three consumer warpgroups; nan at 128), the
mma.sync forward (USE_WGMMA = False), cuDNN and torch's flash (FA2), in one run, with how
far the Hopper out lies from cuDNN's (the largest difference over the largest magnitude), and the
default's host part of a call and back-to-back rate beside cuDNN's (bench.host_and_back_to_back).

    PYTHONPATH=. python3 benchmarks/hopper_forward_check.py      (on the device machine; a table last)
"""

from __future__ import annotations

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
    dtype = "bfloat16"
    for D in (128, 64):
        for causal in (False, True):
            for S in (512, 1024, 2048, 4096, 16384):
                B, H = 16384 // S, 2048 // D
                tq = [torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
                q, k, v = (cupy.asarray(x.view(torch.int16)).view(cupy.uint16) for x in tq)
                kw = dict(causal=causal, dtype="bfloat16")
                flops = bench.flops(B, H, S, D, causal, "forward")
                row = [dtype, D, causal, S]
                for wgmma, persistent in ((True, True), (True, False), (False, True)):
                    cupy_backend.USE_WGMMA, cupy_backend.SM90_PERSISTENT = wgmma, persistent
                    row.append(flops / timed(lambda: flashcupy.attention(q, k, v, **kw)) / 1e12)
                    if not persistent:  # the wide key block, a CTA a tile, after the default
                        cupy_backend.SM90_WIDE = True
                        row.append(flops / timed(lambda: flashcupy.attention(q, k, v, **kw)) / 1e12
                                   if not causal else float("nan"))
                        cupy_backend.SM90_WIDE = False
                        cupy_backend.SM90_TALL_FORWARD = True  # the 192-row tile, where it applies
                        row.append(flops / timed(lambda: flashcupy.attention(q, k, v, **kw)) / 1e12
                                   if D in specs.SM90_TALL_FORWARD_TILES else float("nan"))
                        cupy_backend.SM90_TALL_FORWARD = False
                cupy_backend.USE_WGMMA = cupy_backend.SM90_PERSISTENT = True
                out = flashcupy.attention(q, k, v, **kw)
                a, b, c = (x.transpose(1, 2) for x in tq)
                for backend in (torch.nn.attention.SDPBackend.CUDNN_ATTENTION,
                                torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                    with torch.nn.attention.sdpa_kernel(backend):
                        row.append(flops / timed(lambda: F.scaled_dot_product_attention(a, b, c, is_causal=causal))
                                   / 1e12)
                        if backend == torch.nn.attention.SDPBackend.CUDNN_ATTENTION:
                            want = F.scaled_dot_product_attention(a, b, c, is_causal=causal).transpose(1, 2).float()
                got = torch.as_tensor(out.view(cupy.int16), device="cuda").view(torch.bfloat16).float()
                row.append(float((got - want).abs().max() / want.abs().max()))
                cupy_backend.SM90_PERSISTENT = False  # the default
                host, b2b = bench.host_and_back_to_back(lambda: flashcupy.attention(q, k, v, **kw))
                with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                    _, cudnn_b2b = bench.host_and_back_to_back(lambda: F.scaled_dot_product_attention(a, b, c,
                                                                                                      is_causal=causal))
                row += [host * 1e6, flops / b2b / 1e12, flops / cudnn_b2b / 1e12]
                ROWS.append(row)
                print(*row, flush=True)
    print("\nforward TFLOP/s (median of 10); vs cudnn: max |hopper - cudnn| / max |cudnn| of out")
    print("host: us of the host's part of a call (a CTA a tile); tile.b2b, cudnn.b2b: TFLOP/s of calls back to back")
    print("dtype     D   causal  S      persist  a-tile  wide    tall    mma.sync  cudnn  flash  pers/tile  wide/tile  "
          "tall/tile  pers/cudnn  wide/cudnn  tall/cudnn  pers/flash  vs cudnn  host  tile.b2b  cudnn.b2b  b2b/cudnn")
    for r in ROWS:
        (dtype, D, causal, S, persist, tile, wide, tall, mma, cudnn, flash, error, host, tile_b2b, cudnn_b2b) = r
        print(f"{dtype:<9} {D:<3} {str(causal):<7} {S:<6} {persist:7.1f} {tile:7.1f} {wide:7.1f} {tall:7.1f}  "
              f"{mma:7.1f}  {cudnn:6.1f} {flash:6.1f}  {persist / tile:8.2f}  {wide / tile:9.2f}  {tall / tile:9.2f}  "
              f"{persist / cudnn:9.2f}  {wide / cudnn:10.2f}  {tall / cudnn:10.2f}  {persist / flash:9.2f}  "
              f"{error:.2e}  {host:4.0f}  {tile_b2b:8.1f}  {cudnn_b2b:9.1f}  {tile_b2b / cudnn_b2b:9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
