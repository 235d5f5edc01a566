"""A call's fixed cost and its kernels' rate, fitted to the TFLOP/s an H200 session measured.

The Hopper check scripts (hopper_forward_check.py, hopper_backward_check.py) time each call with CUDA
events around it (bench.median_gpu_time), so a call's host work before its launch is inside each
figure. With 16k tokens a batch, a call at sequence length S does FLOPs proportional to S: if it costs a
fixed H seconds besides work at R FLOP/s, its time is t(S) = H + F(S) / R. This script fits H and R by
least squares to the non-causal rows of each implementation (causal rows are left out: their short
tiles make R itself depend on S) and prints them with the worst relative residual. A fit to measured
figures, not a measurement of either part: the GPU session's `host` and `kernel` columns measure them.

    python benchmarks/overhead_fit.py [forward_rows.txt] [backward_rows.txt]
    (default: benchmarks/results/h200_session3/forward_persistent.txt and backward_key_block_order.txt)
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from flashcupy.tools import bench  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "h200_session3")


def rows(path: str) -> tuple:
    """(column names, rows) of a check script's output: the raw rows it prints first (dtype, D, causal, S,
    then a figure per column), and the names of the TFLOP/s columns from its table's header (those after S,
    up to the first ratio)."""
    found, names = [], []
    with open(path) as f:
        for line in f:
            fields = line.split()
            if len(fields) > 5 and fields[0] in ("float16", "bfloat16") and fields[2] in ("True", "False"):
                if not names:  # the raw rows, before the table (the same figures, rounded)
                    found.append((fields[0], int(fields[1]), fields[2] == "True", int(fields[3]),
                                  [float(x) for x in fields[4:]]))
            elif fields[:4] == ["dtype", "D", "causal", "S"]:
                for name in fields[4:]:
                    if "/" in name or name == "vs":
                        break
                    names.append(name)
    return names, found


def fit(sizes, gflops, tflops):
    """(H in us, R in TFLOP/s, worst |residual| / t) of t = H + F / R over the given points."""
    t = np.array(gflops) / np.array(tflops) * 1e-3  # seconds: GFLOP / (TFLOP/s) = ms
    A = np.stack([np.ones_like(t), np.array(gflops) * 1e9], axis=1)
    (h, inv_r), *_ = np.linalg.lstsq(A, t, rcond=None)
    worst = float(np.max(np.abs(A @ np.array([h, inv_r]) - t) / t))
    return h * 1e6, 1.0 / inv_r / 1e12, worst


def report(path: str, pass_: str) -> None:
    names, table = rows(path)
    if not table:
        print(f"no rows in {path}")
        return
    print(f"\n{pass_}: {os.path.relpath(path)} (non-causal rows; 16k tokens a batch, hidden 2048)")
    print(f"{'dtype':<9} {'D':>4}  {'column':<12} {'S':<26} {'H (us)':>7} {'R (TFLOP/s)':>12} {'worst':>7}")
    for dtype in ("bfloat16", "float16"):
        for D in (128, 64):
            group = [r for r in table if r[0] == dtype and r[1] == D and not r[2]]
            if len(group) < 3:
                continue
            sizes = [r[3] for r in group]
            gflops = [bench.flops(16384 // S, 2048 // D, S, D, False, pass_) / 1e9 for S in sizes]
            for c, name in enumerate(names):
                tflops = [row[4][c] for row in group]
                if any(np.isnan(tflops)):  # a column measured only where its kernel applies (wide: nan)
                    continue
                h, r, worst = fit(sizes, gflops, tflops)
                print(f"{dtype:<9} {D:>4}  {name:<12} {','.join(map(str, sizes)):<26} {h:7.0f} {r:12.0f} "
                      f"{worst:7.1%}")


def main(argv) -> int:
    forward = argv[1] if len(argv) > 1 else os.path.join(RESULTS, "forward_persistent.txt")
    backward = argv[2] if len(argv) > 2 else os.path.join(RESULTS, "backward_key_block_order.txt")
    report(forward, "forward")
    report(backward, "backward")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
