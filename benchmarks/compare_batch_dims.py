"""Leading batch dimensions on the NumPy backend (issue 30), side by side in one run.

    python benchmarks/compare_batch_dims.py            # the issue's shapes (a few minutes on 2 cores)
    python benchmarks/compare_batch_dims.py --quick    # R = 32, N = 128

1. MSA row attention: q, k, v (1, R=128, N=384, 8 heads, 32), a pair bias (1, 1, 8, N, N) shared by
   every row, float32, forward and backward; against the same call with the bias expanded by the
   caller to (R, 8, N, N) (q, k, v folded to rank 4). Targets: the backward's peak traced memory at
   most 1.5x dbias's size plus the O(seqlen) workspaces (never R x the bias), and its time within
   1.3x of the expanded-bias call.
2. Triangle attention around the starting and the ending node, N = 256, 4 heads of 32: the error of
   the forward against a float64 transcription of AlphaFold's formula, as a multiple of the one
   tolerance rule (reference/compare.py), computed chunk by chunk of the batch.
Each pair alternates calls and keeps each side's best; NumPy's sgemm rate is printed beside.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import tracemalloc

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # reference/ (the oracle) is not installed

import flashcupy  # noqa: E402
from compare_cpu import sgemm_rate  # noqa: E402
from compare_modifiers import best_pair  # noqa: E402
from reference.compare import error_ratio, expected  # noqa: E402


def peak(fn) -> int:
    tracemalloc.start()
    fn()
    top = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return top


def msa_case(R, N, H=8, D=32):
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((1, R, N, H, D), dtype=np.float32) for _ in range(4))
    pair = rng.standard_normal((1, 1, H, N, N), dtype=np.float32)
    flat = [x.reshape(R, N, H, D) for x in (q, k, v, dout)]
    expanded = np.ascontiguousarray(np.broadcast_to(pair[0], (R, H, N, N)))  # what a caller does today
    out, lse = flashcupy.attention(q, k, v, bias=pair, return_lse=True)
    out_e, lse_e = flashcupy.attention(*flat[:3], bias=expanded, return_lse=True)
    fwd = best_pair(lambda: flashcupy.attention(q, k, v, bias=pair),
                    lambda: flashcupy.attention(*flat[:3], bias=expanded), repeat=2)
    bwd = best_pair(lambda: flashcupy.attention_backward(dout, q, k, v, out, lse, bias=pair),
                    lambda: flashcupy.attention_backward(flat[3], *flat[:3], out_e, lse_e, bias=expanded), repeat=2)
    mem = peak(lambda: flashcupy.attention_backward(dout, q, k, v, out, lse, bias=pair))
    mem_e = peak(lambda: flashcupy.attention_backward(flat[3], *flat[:3], out_e, lse_e, bias=expanded))
    grads = 3 * q.nbytes  # dq, dk, dv: the outputs, O(seqlen)
    return fwd, bwd, mem, mem_e, pair.nbytes, expanded.nbytes, grads


def triangle_case(N, ending, H=4, c=32, chunk=16):
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from test_batch_dims import _alphafold_triangle
    rng = np.random.default_rng(1)
    x = [rng.standard_normal((1, N, N, H, c)).astype(np.float32) for _ in range(3)]
    pair_bias = rng.standard_normal((1, N, N, H)).astype(np.float32)
    if ending:
        q, k, v = (t.transpose(0, 2, 1, 3, 4) for t in x)
        bias = pair_bias.transpose(0, 3, 2, 1)[:, None]
    else:
        q, k, v = x
        bias = pair_bias.transpose(0, 3, 1, 2)[:, None]
    t0 = time.perf_counter()
    out, lse = flashcupy.attention(q, k, v, bias=bias, return_lse=True)
    seconds = time.perf_counter() - t0
    formula = _alphafold_triangle(*x, pair_bias, ending)
    ratio, gap = 0.0, 0.0
    for a in range(0, N, chunk):  # the batch's rows are independent problems: the oracle a chunk at a time
        part = slice(a, a + chunk)
        e = expected(q[:, part], k[:, part], v[:, part], bias=bias)
        ratio = max(ratio, error_ratio(out[:, part], e, "out"), error_ratio(lse[:, part], e, "lse"))
        want = e.want["out"].transpose(0, 2, 1, 3, 4) if ending else e.want["out"]
        mine = formula[:, :, part] if ending else formula[:, part]
        gap = max(gap, float(abs(want - mine).max()))
    return seconds, ratio, gap


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    R, N, N_tri = (32, 128, 64) if args.quick else (128, 384, 256)
    print(f"# NumPy backend: leading batch dimensions ({time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores, "
          f"numpy {np.__version__}, load average {os.getloadavg()[0]:.2f})\n")
    sgemm_before = sgemm_rate()
    fwd, bwd, mem, mem_e, pair, expanded, grads = msa_case(R, N)
    print(f"MSA row attention, float32, q (1, {R}, {N}, 8, 32), pair bias (1, 1, 8, {N}, {N}) against the bias "
          f"expanded to ({R}, 8, {N}, {N}); best of alternating calls.\n")
    print("| pass | broadcast bias | expanded bias | ratio | target |")
    print("|---|---|---|---|---|")
    print(f"| forward | {fwd[0] * 1e3:.0f} ms | {fwd[1] * 1e3:.0f} ms | {fwd[0] / fwd[1]:.2f}x | |")
    print(f"| backward | {bwd[0] * 1e3:.0f} ms | {bwd[1] * 1e3:.0f} ms | {bwd[0] / bwd[1]:.2f}x | <= 1.3x |")
    extra = mem - grads
    print(f"\nBackward peak traced memory: {mem / 2**20:.1f} MiB with the broadcast bias ({extra / 2**20:.1f} MiB "
          f"beyond dq, dk, dv; dbias is {pair / 2**20:.1f} MiB: {extra / pair:.2f}x dbias, target <= 1.5x plus the "
          f"O(seqlen) workspaces), {mem_e / 2**20:.1f} MiB with the expanded one (which is itself "
          f"{expanded / 2**20:.0f} MiB).\n")
    print(f"Triangle attention, N = {N_tri}, 4 heads of 32, float32, forward:\n")
    print("| node | time | error / tolerance (<= 1 passes) | oracle vs AlphaFold formula (float64) |")
    print("|---|---|---|---|")
    for ending in (False, True):
        seconds, ratio, gap = triangle_case(N_tri, ending)
        print(f"| {'ending' if ending else 'starting'} | {seconds * 1e3:.0f} ms | {ratio:.3f} | {gap:.1e} |")
    print(f"\nNumPy sgemm (4096³) before and after the run: {sgemm_before:.0f} and {sgemm_rate():.0f} GFLOP/s.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
