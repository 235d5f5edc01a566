"""`python -m flashcupy bench --gpu-report DIR`: one command for a lent GPU.

It runs, in this order, and writes DIR/report.md and DIR/report.json:
1. every GPU backend (cupy, numba) against the float64 oracle on the battery,
   in every dtype it supports (bfloat16 too where ml_dtypes is installed);
2. forward and backward timings (CUDA events, compile time excluded by a
   warm-up call) of flashcupy against torch SDPA's flash and cuDNN backends when
   torch is present: float16, 16k tokens per batch (B = 16384 / S) for
   S in {512, ..., 16384}, hidden size 2048 (H = 2048 / D) for D in {64, 128},
   causal or not; TFLOP/s by the standard count.

A time budget (default 7.5 minutes) stops the timing sweep early rather than
overrun a device lease; the report says what was skipped. On a machine
without a GPU it says so and exits 2.
"""

from __future__ import annotations

import json
import os
import platform
import time

import numpy as np

import flashcupy
from flashcupy import _bench, backends
from flashcupy._check import CHECK_HEADER, check_rows, default_check_dtypes, format_check_row, oracle

SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128)
TOKENS, HIDDEN = 16384, 2048


def _environment() -> dict:
    import cupy
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    env = {"gpu": props["name"].decode(), "sm": f"{props['major']}{props['minor']}",
           "cupy": cupy.__version__, "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
           "flashcupy": flashcupy.__version__, "numpy": np.__version__, "python": platform.python_version(),
           "date": time.strftime("%Y-%m-%d %H:%M")}
    if _bench.torch_available() is None:
        import torch
        env["torch"] = torch.__version__
    return env


def main(out_dir: str, budget_s: float = 450.0) -> int:
    reason = backends.unavailable_reason("cupy")
    if reason is not None:
        print(f"the GPU report needs a CUDA GPU with CuPy: {reason}")
        return 2
    t_start = time.perf_counter()
    os.makedirs(out_dir, exist_ok=True)
    env = _environment()
    ref = oracle()
    gpu_backends = [n for n in ("cupy", "numba") if backends.unavailable_reason(n) is None]
    checks = list(check_rows(ref, gpu_backends, default_check_dtypes(), ref.compare.BATTERY))
    for row in checks:
        print(format_check_row(row))

    impls = _bench.implementations("cuda")
    results, skipped = [], []
    for D in HEAD_DIMS:
        for causal in (False, True):
            for S in SEQLENS:
                for impl in impls:
                    if time.perf_counter() - t_start > budget_s:
                        skipped.append((impl, S, D, causal))
                        continue
                    try:
                        results += _bench.run_one(impl, TOKENS // S, HIDDEN // D, S, D, causal=causal,
                                                  dtype="float16", device="cuda", repeat=5, min_time=0.3,
                                                  memory=False)
                    except Exception as e:  # e.g. a torch backend that refuses this shape
                        skipped.append((impl, S, D, causal, f"{type(e).__name__}: {e}"))
                    print(f"timed {impl} S={S} D={D} causal={causal}", flush=True)

    report = {"environment": env, "checks": [{**r, "case": list(r["case"])} for r in checks],
              "timings": [r.as_dict() for r in results], "skipped": [list(map(str, s)) for s in skipped],
              "seconds": time.perf_counter() - t_start}
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write(_markdown(report, checks, results, skipped))
    failures = sum(not r["ok"] for r in checks)
    print(f"report written to {out_dir} in {report['seconds']:.0f} s; {failures} check failures")
    return 1 if failures else 0


def _markdown(report, checks, results, skipped) -> str:
    env = report["environment"]
    lines = [f"# flashcupy GPU report: {env['gpu']} (sm_{env['sm']}), {env['date']}", "",
             ", ".join(f"{k} {v}" for k, v in env.items() if k not in ("gpu", "sm", "date")), "",
             "## Correctness against the float64 oracle", "", "```", CHECK_HEADER]
    lines += [format_check_row(r) for r in checks]
    lines += ["```", "", f"{sum(r['ok'] for r in checks)} of {len(checks)} passed.", "",
              "## Speed (float16, TFLOP/s; forward 4·B·H·S²·D, halved when causal; backward 2.5x)", ""]
    impls = sorted({r.impl for r in results})
    for pass_ in ("forward", "backward"):
        lines += [f"### {pass_}", "", "| D | causal | S | B x H | " + " | ".join(impls)
                  + " | cupy / torch-flash |", "|---" * (4 + len(impls) + 1) + "|"]
        keys = sorted({(r.head_dim, r.causal, r.seqlen) for r in results if r.pass_ == pass_})
        for D, causal, S in keys:
            cell = {r.impl: r.tflops for r in results
                    if (r.pass_, r.head_dim, r.causal, r.seqlen) == (pass_, D, causal, S)}
            ratio = (f"{cell['cupy'] / cell['torch-flash']:.2f}x"
                     if "cupy" in cell and "torch-flash" in cell else "")
            lines.append(f"| {D} | {causal} | {S} | {TOKENS // S} x {HIDDEN // D} | "
                         + " | ".join(f"{cell[i]:.1f}" if i in cell else "" for i in impls) + f" | {ratio} |")
        lines.append("")
    if skipped:
        lines += ["## Skipped", ""] + [f"- {' '.join(map(str, s))}" for s in skipped] + [""]
    lines.append(f"Total {report['seconds']:.0f} s.")
    return "\n".join(lines) + "\n"
