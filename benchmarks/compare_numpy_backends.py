"""This checkout's NumPy backend against another checkout's, loaded side by side in one process.

    git worktree add --detach /tmp/base 79107ba
    python benchmarks/compare_numpy_backends.py /tmp/base                # both at the default shapes
    python benchmarks/compare_numpy_backends.py /tmp/base --swap         # the other loaded first
    python benchmarks/compare_numpy_backends.py /tmp/base --threads 1 --rounds 40 S512 S1024

The other checkout's flashcupy/backends/numpy_backend (a module file or a package) is imported
under another name beside this one's, sharing this checkout's flashcupy (Problem, Band), so the
two must agree on those. Both are called alternately on the same Problem and arrays, each keeping
its best wall and CPU time per pass, so load from other processes hits both alike; NumPy's sgemm
rate prints beside each case. On a busy machine the contender in the second place tended to run a
few per cent slower whichever code it was: --swap (the places exchanged) and --against-itself (a
copy of this checkout's backend in the other's place) show how large that is.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)

from flashcupy import _checks  # noqa: E402
from flashcupy.backends import numpy_backend as ours  # noqa: E402

# name: (seqlen_q, seqlen_k, keyword arguments); H = 8, D = 64, float32, B = 1
CASES = {
    "S512": (512, 512, {}), "S512c": (512, 512, dict(causal=True)),
    "S1024": (1024, 1024, {}), "S1024c": (1024, 1024, dict(causal=True)),
    "S4096": (4096, 4096, {}), "S4096c": (4096, 4096, dict(causal=True)),
    "S16384w256": (16384, 16384, dict(causal=True, window=(255, None))),
    "S1024bias": (1024, 1024, dict(bias=True)), "decode64k": (1, 65536, {}),
}


def load(checkout: str, name: str):
    """The NumPy backend of another checkout, as module `name` (a package keeps its submodules)."""
    root = os.path.join(checkout, "flashcupy", "backends", "numpy_backend")
    if os.path.isdir(root):
        spec = importlib.util.spec_from_file_location(name, os.path.join(root, "__init__.py"),
                                                      submodule_search_locations=[root])
    else:
        spec = importlib.util.spec_from_file_location(name, root + ".py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def sgemm_rate() -> float:
    a = np.ones((2048, 2048), np.float32)
    a @ a
    t = time.perf_counter()
    a @ a
    return 2 * 2048**3 / (time.perf_counter() - t) / 1e9


def compare(name, contenders, rounds, rng) -> str:
    Sq, Sk, kw = CASES[name]
    q = rng.standard_normal((1, Sq, 8, 64)).astype(np.float32)
    k, v = (rng.standard_normal((1, Sk, 8, 64)).astype(np.float32) for _ in range(2))
    bias = rng.standard_normal((1, 8, Sq, Sk)).astype(np.float32) if kw.get("bias") else None
    p = _checks.problem(q, k, v, kw.get("causal", False), None, None, "numpy", kw.get("window"), None, None, bias)
    best = {}
    for r in range(max(2, rounds // 3) if Sq >= 4096 else rounds):
        for label, mod in contenders if r % 2 == 0 else contenders[::-1]:
            passes = [("fwd", lambda: mod.forward(p, q, k, v))]
            if Sq > 1:
                out, lse = mod.forward(p, q, k, v)
                passes.append(("bwd", lambda: mod.backward(p, out, q, k, v, out, lse)))
            for what, call in passes:
                c, t = time.process_time(), time.perf_counter()
                call()
                wall, cpu = time.perf_counter() - t, time.process_time() - c
                w, u = best.get((label, what), (1e9, 1e9))
                best[label, what] = (min(w, wall), min(u, cpu))
    (a, _), (b, _) = contenders
    parts = [f"{name:11s} sgemm {sgemm_rate():4.0f} GFLOP/s"]
    for what in ("fwd", "bwd"):
        if (a, what) in best:
            (wa, ua), (wb, ub) = best[a, what], best[b, what]
            parts.append(f"{what} {a} {wa * 1e3:8.2f} {b} {wb * 1e3:8.2f} ms ({wb / wa - 1:+6.1%}; "
                         f"CPU {ua * 1e3:8.2f} {ub * 1e3:8.2f}, {ub / ua - 1:+6.1%})")
    return "  ".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("against", help="the other checkout's root (a git worktree, say)")
    ap.add_argument("cases", nargs="*", help=f"of {', '.join(CASES)} (default: all)")
    ap.add_argument("--rounds", type=int, default=12, help="calls of each per pass (a third at S >= 4096)")
    ap.add_argument("--threads", type=int, help="worker threads of both (default: theirs)")
    ap.add_argument("--swap", action="store_true", help="this checkout's backend in the first place")
    ap.add_argument("--against-itself", action="store_true", help="two copies of this checkout's backend")
    args = ap.parse_intermixed_args()
    unknown = set(args.cases) - set(CASES)
    if unknown:
        ap.error(f"unknown cases {sorted(unknown)}; the cases are {', '.join(CASES)}")
    other = load(HERE if args.against_itself else args.against, "flashcupy.backends.numpy_backend_other")
    contenders = [("other", other), ("this", ours)]
    if args.swap:
        contenders.reverse()
    for _, mod in contenders:
        if args.threads:
            mod.configure(num_threads=args.threads)
    print(f"places {[label for label, _ in contenders]}; other: {other.__file__}; workers "
          f"{[m.worker_count() for _, m in contenders]}; load average {os.getloadavg()[0]:.2f}", flush=True)
    rng = np.random.default_rng(0)
    for name in args.cases or CASES:
        print(compare(name, contenders, args.rounds, rng), flush=True)


if __name__ == "__main__":
    main()
