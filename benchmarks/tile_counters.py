"""The Hopper kernels' optional tiles side by side with their defaults on the emulator's counters, per
pass and per GFLOP of wgmma: the forward's FA3 wider key blocks (cupy_backend.SM90_WIDE: 128 x 176 at
head_dim 128, 128 x 192 at 64), its FA3 taller query tile (cupy_backend.SM90_TALL_FORWARD: 192 x 128 at
head_dim 64, three consumer warpgroups) and the backward's FA3 taller pass (cupy_backend.SM90_TALL_BACKWARD:
128 x 128 at head_dim 64).

    python benchmarks/tile_counters.py

Per pass is perfmodel's: the difference of two launches (B = H = 1, non-causal, float16) that differ
only in their keys (forward) or queries (backward), divided by the passes added. What a larger tile
changes is what each pass pays besides its FLOPs: mbarrier waits, named barriers, the softmax's row
work, and the operands that wgmma reads again for each pass. A third consumer warpgroup changes what
the roofline leaves out: how much of one warpgroup's softmax runs under the others' GEMMs (with two,
under one other's; with three, under two others'). The counters and the roofline are a model, not a
measurement; the rates on a GPU are the GPU session's cupy-wide / cupy and cupy-tallfwd / cupy, and
hopper_backward_check.py's tall / hopper.
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


def forward_kernel(head_dim: int, larger: bool) -> specs.Kernel:
    tile = specs.sm90_forward_tile(head_dim, wide=larger)
    return specs.sm90_forward_module(DTYPE, head_dim, tile=tile).kernels[0]


def tall_forward_kernel(head_dim: int, larger: bool) -> specs.Kernel:
    tile = specs.sm90_forward_tile(head_dim, tall=larger)
    return specs.sm90_forward_module(DTYPE, head_dim, tile=tile).kernels[0]


def backward_kernel(head_dim: int, larger: bool) -> specs.Kernel:
    tile = specs.sm90_backward_tile(head_dim, tall=larger)
    return specs.sm90_backward_module(DTYPE, head_dim, tile=tile).kernels[1]


def counted(kernel: specs.Kernel, switch: str, larger: bool) -> dict:
    """perfmodel's row of `kernel`, launched by the backend with its `switch` set to `larger`; the launches'
    smaller side 128 whichever the tile (a side of 64 would leave half of a 128-key block out of bounds)."""
    with mock.patch.object(cupy_backend, switch, larger), mock.patch.object(perfmodel, "BASE", 128):
        (row,) = perfmodel.kernel_counters([(DTYPE, kernel.head_dim)], templates=(kernel.template,),
                                           compute_capability=perfmodel.SM90)
    assert row["kernel"] == kernel, (row["kernel"], kernel)
    return row


def compare(make, switch: str, head_dim: int, what: str, ratio: str) -> None:
    """Prints the default and the larger tile (cupy_backend's `switch`) of `make`'s kernel side by side."""
    h200 = next(g for g in hardware.GPUS if g.name == "H200")
    kernels = {larger: make(head_dim, larger) for larger in (False, True)}
    tiles = {larger: f"{k.block_m}x{k.block_n}" for larger, k in kernels.items()}
    figures = {larger: perfmodel.pass_figures(counted(k, switch, larger)) for larger, k in kernels.items()}
    print(f"{kernels[False].template}, {DTYPE}, head_dim {head_dim}, non-causal; {what}; per pass, then per GFLOP "
          "of wgmma")
    print(f"{'figure':<20} {tiles[False] + ' /pass':>14} {tiles[True] + ' /pass':>14} "
          f"{tiles[False] + ' /GFLOP':>15} {tiles[True] + ' /GFLOP':>15} {ratio + ' per GFLOP':>23}")
    for name in FIGURES:
        per = {larger: f[name] for larger, f in figures.items()}
        per_gflop = {larger: f[name] / f["wgmma_flops"] * 1e9 for larger, f in figures.items()}
        print(f"{name:<20} {per[False]:14.0f} {per[True]:14.0f} {per_gflop[False]:15.0f} "
              f"{per_gflop[True]:15.0f} {per_gflop[True] / per_gflop[False]:23.2f}")
    print("Roofline on the H200, TFLOP/s (perfmodel.wgmma_roofline; a model, not a measurement):")
    for larger, f in figures.items():
        for label, peak in (("datasheet", None), (f"GEMM at {h200.gemm_tflops:g}", h200.gemm_tflops)):
            r = perfmodel.wgmma_roofline(f, h200, peak)
            print(f"  {tiles[larger]:<8} {label:<14} overlapped {r['overlapped']:5.0f}, "
                  f"not overlapped {r['not_overlapped']:5.0f}, smem {r['shared']:5.0f}, ex2 {r['ex2']:5.0f}")
    print()


def main() -> int:
    for head_dim in sorted(specs.SM90_WIDE_FORWARD_TILES, reverse=True):
        compare(forward_kernel, "SM90_WIDE", head_dim, "a pass: a key block", "wide/default")
    for head_dim in sorted(specs.SM90_TALL_FORWARD_TILES, reverse=True):
        compare(tall_forward_kernel, "SM90_TALL_FORWARD", head_dim, "a pass: a key block", "tall/default")
    for head_dim in sorted(specs.SM90_TALL_BACKWARD_TILES, reverse=True):
        compare(backward_kernel, "SM90_TALL_BACKWARD", head_dim, "a pass: a query block", "tall/default")
    return 0


if __name__ == "__main__":
    sys.exit(main())
