"""The Hopper forward's key blocks side by side on the emulator's counters: the default 128 x 128 tile
and FA3's wider ones (cupy_backend.SM90_WIDE: 128 x 176 at head_dim 128, 128 x 192 at 64), per pass and
per GFLOP of wgmma.

    python benchmarks/wide_counters.py

Per pass is perfmodel's: the difference of two launches (B = H = 1, non-causal, float16) that differ
only in their keys, divided by the passes added. What the wide block changes is what each pass pays
besides its FLOPs: mbarrier waits, the pingpong's named barriers, the softmax's row work (O's rescale
and alpha's exponentials are per row and key block, not per key), and the Q operand that wgmma reads
again for each key block. The counters and the roofline are a model, not a measurement; the rate on a
GPU is the GPU session's cupy-wide / cupy.
"""

from __future__ import annotations

import os
import sys
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from flashcupy.backends import cupy_backend  # noqa: E402
from flashcupy.backends.cupy_backend import specs  # noqa: E402
from flashcupy.tools import hardware, perfmodel  # noqa: E402

DTYPE = "float16"
FIGURES = ("wgmma", "wgmma_shared_bytes", "tma_load_bytes", "ex2", "mbarrier_waits", "named_barriers")


def counted(head_dim: int, wide: bool) -> dict:
    """perfmodel's row of the forward kernel with the default or the wide tile."""
    tile = specs.sm90_forward_tile(head_dim, wide=wide)
    kernel = specs.sm90_forward_module(DTYPE, head_dim, tile=tile).kernels[0]
    with mock.patch.object(cupy_backend, "SM90_WIDE", wide), \
            mock.patch.object(perfmodel, "_kernels", lambda *a: {kernel.template: kernel}):
        (row,) = perfmodel.kernel_counters([(DTYPE, head_dim)], templates=("flash_fwd_sm90",),
                                           compute_capability=perfmodel.SM90)
    return row


def main() -> int:
    h200 = next(g for g in hardware.GPUS if g.name == "H200")
    for head_dim in sorted(specs.SM90_WIDE_FORWARD_TILES, reverse=True):
        rows = {wide: counted(head_dim, wide) for wide in (False, True)}
        tiles = {wide: "x".join(map(str, specs.sm90_forward_tile(head_dim, wide=wide))) for wide in rows}
        print(f"flash_fwd_sm90, {DTYPE}, head_dim {head_dim}, non-causal; per pass, then per GFLOP of wgmma")
        print(f"{'figure':<20} {tiles[False] + ' /pass':>14} {tiles[True] + ' /pass':>14} "
              f"{tiles[False] + ' /GFLOP':>15} {tiles[True] + ' /GFLOP':>15} {'wide/default per GFLOP':>23}")
        figures = {wide: perfmodel.pass_figures(row) for wide, row in rows.items()}
        for name in FIGURES:
            per = {wide: f[name] for wide, f in figures.items()}
            per_gflop = {wide: f[name] / f["wgmma_flops"] * 1e9 for wide, f in figures.items()}
            print(f"{name:<20} {per[False]:14.0f} {per[True]:14.0f} {per_gflop[False]:15.0f} "
                  f"{per_gflop[True]:15.0f} {per_gflop[True] / per_gflop[False]:23.2f}")
        print("Roofline on the H200, TFLOP/s (perfmodel.wgmma_roofline; a model, not a measurement):")
        for wide, f in figures.items():
            for label, peak in (("datasheet", None), (f"GEMM at {h200.gemm_tflops:g}", h200.gemm_tflops)):
                r = perfmodel.wgmma_roofline(f, h200, peak)
                print(f"  {tiles[wide]:<8} {label:<14} overlapped {r['overlapped']:5.0f}, "
                      f"not overlapped {r['not_overlapped']:5.0f}, smem {r['shared']:5.0f}, ex2 {r['ex2']:5.0f}")
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
