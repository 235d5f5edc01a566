"""What recording torch autograd costs, side by side in one run (issue 32), on the CPU.

    python benchmarks/compare_torch_autograd.py            # a markdown report on stdout

For each shape (float32, causal, GQA 8/2 heads, D=64; S=1 shows the fixed cost of a call): flashcupy on NumPy arrays, on torch tensors
outside autograd (DLPack views), and on tensors that require grad (the custom op, autograd and
its backward op), forward alone and forward + backward, beside torch SDPA on the same tensors.
Then the time of torch.autograd.gradcheck (float64) for each case of tests/test_torch_autograd.py.
Each contender keeps its best of several calls, taken in alternating rounds.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import flashcupy  # noqa: E402
from flashcupy.tools import bench  # noqa: E402

F = torch.nn.functional


def shape_row(S: int, repeat: int) -> dict:
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, S, 8, 64), dtype=np.float32)
    k, v = (rng.standard_normal((1, S, 2, 64), dtype=np.float32) for _ in range(2))
    dout = rng.standard_normal(q.shape, dtype=np.float32)
    tq, tk, tv, tdout = (torch.from_numpy(x) for x in (q, k, v, dout))
    gq, gk, gv = (x.clone().requires_grad_(True) for x in (tq, tk, tv))
    sq, sk, sv = (x.transpose(1, 2).clone().requires_grad_(True) for x in (tq, tk, tv))  # SDPA's layout
    sdout = tdout.transpose(1, 2)

    def numpy_both():
        out, lse = flashcupy.attention(q, k, v, causal=True, return_lse=True)
        flashcupy.attention_backward(dout, q, k, v, out, lse, causal=True)

    def views_both():
        out, lse = flashcupy.attention(tq, tk, tv, causal=True, return_lse=True)
        flashcupy.attention_backward(tdout, tq, tk, tv, out, lse, causal=True)

    def autograd_both():
        gq.grad = gk.grad = gv.grad = None  # as a training step zeroes them: no accumulation timed
        flashcupy.attention(gq, gk, gv, causal=True).backward(tdout)

    def sdpa_both():
        sq.grad = sk.grad = sv.grad = None
        F.scaled_dot_product_attention(sq, sk, sv, is_causal=True, enable_gqa=True).backward(sdout)

    times = bench.best_alternating({
        "numpy forward": lambda: flashcupy.attention(q, k, v, causal=True),
        "torch views forward": lambda: flashcupy.attention(tq, tk, tv, causal=True),
        "torch autograd forward": lambda: flashcupy.attention(gq, gk, gv, causal=True),
        "SDPA forward": lambda: F.scaled_dot_product_attention(sq, sk, sv, is_causal=True, enable_gqa=True),
        "numpy forward + backward": numpy_both,
        "torch views forward + backward": views_both,
        "torch autograd forward + backward": autograd_both,
        "SDPA forward + backward": sdpa_both,
    }, repeat)
    return times


def gradcheck_times() -> dict:
    import test_torch_autograd as t

    times = {}
    for name, (B, Sq, Sk, Hq, Hkv, D), make in t.GRADCHECK:
        rng = np.random.default_rng(0)
        q, k, v = t._qkv64(rng, B, Sq, Sk, Hq, Hkv, D)
        kw = make(rng)
        bias = kw.pop("bias", None)
        inputs = (q, k, v) if bias is None else (q, k, v, bias)
        t0 = time.perf_counter()
        ok = torch.autograd.gradcheck(lambda q, k, v, bias=None: flashcupy.attention(q, k, v, bias=bias, **kw), inputs)
        times[name] = (time.perf_counter() - t0, ok, sum(x.numel() for x in inputs))
    return times


def main():
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"# torch autograd through flashcupy: overhead, side by side (CPU, {os.cpu_count()} cores, torch "
          f"{torch.__version__}, numpy {np.__version__}, commit {commit}, load average "
          f"{os.getloadavg()[0]:.2f})\n")
    print("float32, causal, heads 8/2, D=64, best of alternating rounds; NumPy backend under every flashcupy row.\n")
    names = None
    for S, repeat in ((1, 200), (128, 50), (1024, 5)):
        times = shape_row(S, repeat)
        if names is None:
            names = list(times)
            print("| S | " + " | ".join(names) + " |")
            print("|---" * (len(names) + 1) + "|")
        print(f"| {S} | " + " | ".join(f"{times[n] * 1e3:.2f} ms" for n in names) + " |")
        fw = times["torch autograd forward"] - times["torch views forward"]
        both = times["torch autograd forward + backward"] - times["torch views forward + backward"]
        print(f"\nS={S}: autograd over the views: forward {fw * 1e6:+.0f} us, forward + backward {both * 1e6:+.0f} us"
              f" ({times['torch autograd forward + backward'] / times['torch views forward + backward']:.2f}x)\n")
    print("## torch.autograd.gradcheck, float64 (tests/test_torch_autograd.py's cases)\n")
    print("| case | inputs' elements | time | passes |\n|---|---|---|---|")
    for name, (seconds, ok, n) in gradcheck_times().items():
        print(f"| {name} | {n} | {seconds:.2f} s | {ok} |")


if __name__ == "__main__":
    main()
