"""Dropout on the NumPy backend beside the same call without it, in one run.

    python benchmarks/compare_dropout.py            # S = 2048 and 4096 (a minute or two on 2 cores)
    python benchmarks/compare_dropout.py --quick    # S = 1024

float32, B=1, H=8, D=64, not causal, dropout_p=0.1: forward and backward, each pair alternating calls
and keeping each side's best, and the keep mask alone (flashcupy/_dropout.py's Philox4x32-10 over
every pair, one call for four keys) for the forward's share. The GPU kernels' cost is unmeasured.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import flashcupy
from compare_cpu import sgemm_rate
from compare_modifiers import best_pair
from flashcupy import _dropout

DROP = dict(dropout_p=0.1, dropout_seed=2**40 + 1)


def case(S, H=8, D=64):
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((1, S, H, D), dtype=np.float32) for _ in range(4))
    o_p, l_p = flashcupy.attention(q, k, v, return_lse=True)
    o_d, l_d = flashcupy.attention(q, k, v, return_lse=True, **DROP)
    fwd = best_pair(lambda: flashcupy.attention(q, k, v), lambda: flashcupy.attention(q, k, v, **DROP))
    bwd = best_pair(lambda: flashcupy.attention_backward(dout, q, k, v, o_p, l_p),
                    lambda: flashcupy.attention_backward(dout, q, k, v, o_d, l_d, **DROP), repeat=2)
    t0 = time.perf_counter()
    _dropout.block(DROP["dropout_seed"], DROP["dropout_p"], (0, 0, 0, 0), 0, np.arange(H)[:, None, None], 0, S, 0, S)
    return fwd, bwd, time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    print(f"# NumPy backend: dropout beside the plain call ({time.strftime('%Y-%m-%d %H:%M')}, "
          f"sgemm {sgemm_rate():.0f} GFLOP/s)")
    print("| S | forward plain | forward dropout | ratio | backward plain | backward dropout | ratio | mask alone |")
    print("|---|---|---|---|---|---|---|---|")
    for S in (1024,) if args.quick else (2048, 4096):
        (fp, fd), (bp, bd), mask = case(S)
        print(f"| {S} | {fp:.3f} s | {fd:.3f} s | {fd / fp:.2f}x | {bp:.3f} s | {bd:.3f} s | {bd / bp:.2f}x | "
              f"{mask:.3f} s |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
