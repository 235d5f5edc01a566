"""The NumPy backend against torch's CPU scaled_dot_product_attention, side by side in one run.

    python benchmarks/compare_cpu.py                          # the quick subset (minutes)
    python benchmarks/compare_cpu.py --full                   # issue 16's whole grid (hours)
    python benchmarks/compare_cpu.py --full --max-gflop 300   # the grid without its largest cases
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/compare_cpu.py   # native BLAS
    python benchmarks/compare_cpu.py --json run.json          # keep the results
    python benchmarks/compare_cpu.py --report a.json b.json --out report.md --plot ratios.png

The grid (issue 16): float32 and float64; S in 512, 1024, 4096, 16384; causal and not; B = 1 and
8; H = 8; D = 64 and 128; forward and backward; at each thread count of --threads. The quick
subset: B = 1, D = 64, S up to 4096, both dtypes, causal and not. --dtype, --seqlen, --batch,
--head-dim and --causal narrow either.

Each case runs flashcupy and torch on the same inputs in alternating blocks of `rounds` calls
(twice), and each keeps its best time, so load from other processes hits both alike; the first
call of each is a warm-up, kept as a sample only when a call takes longer than --budget allows
repeating. ratio = torch's time / flashcupy's (above 1: flashcupy is faster); the target is
>= 1.2x. The run also measures NumPy's sgemm rate (the practical ceiling of this formulation: the
target is >= 70 % of it for the non-causal forward at S >= 4096), the forward's peak extra memory
at S = 16384 in a fresh process (target < 2 % of one score matrix), and float16 / bfloat16 inputs
against the float32 path plus the conversions. Timings print as they come; --json keeps them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import sys
import time

import numpy as np

from flashcupy._problem import default_scale
from flashcupy.tools import bench
from flashcupy.backends import numpy_backend

FULL = dict(dtype=["float32", "float64"], seqlen=[512, 1024, 4096, 16384], causal=[False, True],
            batch=[1, 8], head_dim=[64, 128])
QUICK = dict(dtype=["float32", "float64"], seqlen=[512, 1024, 4096], causal=[False, True],
             batch=[1], head_dim=[64])
HEADS = 8
TARGET_RATIO = 1.2
TARGET_SGEMM = 0.7
TARGET_MEMORY = 0.02


# ----------------------------------------------------------------------------
# measuring


def side_by_side(fns: dict, rounds: int, budget: float, blocks: int = 2) -> dict:
    """Best time per contender over `blocks` alternating blocks of up to `rounds` calls each.

    Blocks rather than single alternating calls: torch's OpenMP workers spin for a while after
    each call and would slow whatever runs right after them. Calls too long for `budget` to
    repeat are timed fewer times, the warm-up call then counting as one.
    """
    first = {}
    for name, fn in fns.items():
        t0 = time.perf_counter()
        fn()
        first[name] = time.perf_counter() - t0
    per_round = sum(first.values())
    rounds = max(1, min(rounds, int(budget / (blocks * per_round))))
    best = {name: float("inf") for name in fns}
    if blocks * rounds * per_round > budget:  # long calls: one timed block, the warm-up counts
        best, blocks, rounds = dict(first), 1, 1
    for _ in range(blocks):
        for name, fn in fns.items():
            for _ in range(rounds):
                t0 = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - t0)
    return best


def sgemm_rate(dtype="float32", n=4096, repeat=3) -> float:
    """NumPy's matmul of two n x n matrices in GFLOP/s, BLAS threads as the environment sets them."""
    a = np.random.default_rng(0).standard_normal((n, n)).astype(dtype)
    a @ a
    best = min(_timed(lambda: a @ a) for _ in range(repeat))
    return 2 * n**3 / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def idle_fraction(seconds: float = 3.0) -> float | None:
    """The fraction of the machine's CPU time left idle over the next `seconds` (Linux), else None."""
    def sample():
        with open("/proc/stat") as f:
            values = [int(x) for x in f.readline().split()[1:]]
        return values[3] + values[4], sum(values)  # idle + iowait, total
    try:
        idle0, total0 = sample()
        time.sleep(seconds)
        idle1, total1 = sample()
    except OSError:
        return None
    return (idle1 - idle0) / max(1, total1 - total0)


def wait_for_idle(min_idle: float, timeout: float) -> float | None:
    """Wait (up to timeout seconds) until other processes leave at least min_idle of the CPU idle;
    returns the last idle fraction seen. On a shared machine this keeps each case's measurement
    to the quieter moments; both contenders are hit alike either way."""
    deadline = time.time() + timeout
    while True:
        idle = idle_fraction()
        if idle is None or idle >= min_idle or time.time() > deadline:
            return idle
        time.sleep(2)


def set_threads(n: int) -> None:
    import torch
    torch.set_num_threads(n)
    numpy_backend.configure(num_threads=n)


def run_case(dtype, batch, seqlen, head_dim, causal, threads, rounds, budget) -> dict:
    set_threads(threads)
    q, k, v, dout = bench.make_inputs(batch, HEADS, seqlen, head_dim, np.dtype(dtype), "cpu")
    scale = default_scale(head_dim)
    ours = bench.closures("numpy", q, k, v, dout, causal, scale, "cpu")
    theirs = bench.closures("torch-sdpa", q, k, v, dout, causal, scale, "cpu")
    row = dict(dtype=dtype, batch=batch, heads=HEADS, seqlen=seqlen, head_dim=head_dim, causal=causal,
               threads=threads, load_average=os.getloadavg()[0])
    for i, pass_ in enumerate(("forward", "backward")):
        t = side_by_side({"ours": ours[i], "torch": theirs[i]}, rounds, budget)
        fl = bench.flops(batch, HEADS, seqlen, head_dim, causal, pass_)
        row[pass_] = dict(ours_s=t["ours"], torch_s=t["torch"], ours_gflops=fl / t["ours"] / 1e9,
                          torch_gflops=fl / t["torch"] / 1e9, ratio=t["torch"] / t["ours"])
    return row


def low_precision_case(dtype, seqlen, head_dim, threads, rounds, budget) -> dict:
    """A float16 or bfloat16 call against the float32 call plus converting its inputs to float32
    and its outputs back: what a user converting by hand would pay."""
    set_threads(threads)
    carrier = "uint16" if dtype == "bfloat16" else dtype
    q, k, v, dout = bench.make_inputs(1, HEADS, seqlen, head_dim, np.float32, "cpu")
    scale = default_scale(head_dim)
    if dtype == "bfloat16":
        low = [bench_bf16_bits(x) for x in (q, k, v, dout)]
        to32 = lambda x: (x.astype(np.uint32) << 16).view(np.float32)  # noqa: E731
        from32 = bench_bf16_bits
    else:
        low = [x.astype(dtype) for x in (q, k, v, dout)]
        to32 = lambda x: x.astype(np.float32)  # noqa: E731
        from32 = lambda x: x.astype(dtype)  # noqa: E731
    fwd_low, bwd_low = bench.closures("numpy", *low, False, scale, "cpu", bf16_bits=dtype == "bfloat16")
    import flashcupy
    out32, lse32 = flashcupy.attention(*(to32(x) for x in low[:3]), scale=scale, return_lse=True)
    out_low = from32(out32)

    def fwd_32():
        return from32(flashcupy.attention(*(to32(x) for x in low[:3]), scale=scale))

    def bwd_32():
        grads = flashcupy.attention_backward(*(to32(x) for x in (low[3], *low[:3], out_low)), lse32, scale=scale)
        return [from32(g) for g in grads]

    row = dict(dtype=dtype, carrier=carrier, batch=1, heads=HEADS, seqlen=seqlen, head_dim=head_dim, threads=threads)
    for pass_, fns in (("forward", {"low": fwd_low, "f32": fwd_32}), ("backward", {"low": bwd_low, "f32": bwd_32})):
        t = side_by_side(fns, rounds, budget)
        row[pass_] = dict(low_s=t["low"], f32_convert_s=t["f32"], ratio=t["f32"] / t["low"])
    return row


def bench_bf16_bits(x):
    """float32 -> bfloat16 bit patterns (uint16), rounded to nearest even."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def _git_commit() -> str:
    """The commit of the flashcupy being measured, marked when its numpy_backend/ differs."""
    import subprocess
    here = os.path.dirname(os.path.abspath(numpy_backend.__file__))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "."],
                               cwd=here, capture_output=True, text=True)
        return head.stdout.strip() + (" + uncommitted numpy_backend/" if dirty.stdout.strip() else "")
    except OSError:
        return ""


def environment(threads) -> dict:
    import torch
    from threadpoolctl import threadpool_info
    blas = [i for i in threadpool_info() if i.get("user_api") == "blas"]
    return dict(
        date=time.strftime("%Y-%m-%d %H:%M"), machine=platform.processor() or platform.machine(),
        cores=os.cpu_count(), numpy=np.__version__, torch=torch.__version__,
        blas=", ".join(f"{i.get('internal_api')} {i.get('version')} ({i.get('architecture')})" for i in blas),
        OPENBLAS_CORETYPE=os.environ.get("OPENBLAS_CORETYPE"), OPENBLAS_L2_SIZE=os.environ.get("OPENBLAS_L2_SIZE"),
        threads=threads, load_average=os.getloadavg(),
        tiles=numpy_backend.describe_tiles(),
        commit=_git_commit())


# ----------------------------------------------------------------------------
# reporting


def _ms(s):
    return f"{s * 1e3:.1f}" if s < 1 else f"{s * 1e3:.0f}"


def case_table(rows) -> list:
    lines = ["| dtype | B | S | D | causal | threads | forward ours / torch ms | fwd GFLOP/s | fwd ratio | "
             "backward ours / torch ms | bwd GFLOP/s | bwd ratio |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f, b = r["forward"], r["backward"]
        mark = lambda x: f"**{x:.2f}x**" if x >= TARGET_RATIO else f"{x:.2f}x"  # noqa: E731
        lines.append(
            f"| {r['dtype']} | {r['batch']} | {r['seqlen']} | {r['head_dim']} | {'yes' if r['causal'] else 'no'} | "
            f"{r['threads']} | {_ms(f['ours_s'])} / {_ms(f['torch_s'])} | {f['ours_gflops']:.0f} / {f['torch_gflops']:.0f} | "
            f"{mark(f['ratio'])} | {_ms(b['ours_s'])} / {_ms(b['torch_s'])} | "
            f"{b['ours_gflops']:.0f} / {b['torch_gflops']:.0f} | {mark(b['ratio'])} |")
    return lines


def report(runs: dict) -> str:
    """Markdown for runs {label: results}, one section each."""
    out = ["# flashcupy's NumPy backend vs torch SDPA on the CPU", "",
           f"`python benchmarks/compare_cpu.py` (see its docstring). ratio = torch's time / flashcupy's, "
           f"best of alternating blocks; bold: at least the {TARGET_RATIO}x target. GFLOP/s count "
           "4·B·H·S²·D for the forward, halved when causal, and 2.5x that for the backward; H = 8.", ""]
    for label, res in runs.items():
        env = res["environment"]
        out += [f"## {label}", "",
                f"{env['date']}; {env['machine']}, {env['cores']} cores; numpy {env['numpy']}, torch {env['torch']}; "
                f"BLAS {env['blas']}; OPENBLAS_CORETYPE={env['OPENBLAS_CORETYPE']}, "
                f"OPENBLAS_L2_SIZE={env['OPENBLAS_L2_SIZE']}; load average before the run "
                f"{', '.join(f'{x:.2f}' for x in env['load_average'])}"
                + (f"; flashcupy {env['commit']}" if env.get("commit") else "")
                + (f"; tiles {env['tiles']}" if env.get("tiles") else "") + ".", ""]
        if res.get("sgemm_gflops"):
            out.append(f"NumPy sgemm (4096³, default BLAS threads): {res['sgemm_gflops']:.0f} GFLOP/s.")
            sg = [r for r in res["cases"] if r["dtype"] == "float32" and not r["causal"] and r["seqlen"] >= 4096
                  and r["threads"] == max(env["threads"])]
            if sg:
                fr = [r["forward"]["ours_gflops"] / res["sgemm_gflops"] for r in sg]
                out.append(f"Non-causal float32 forward at S >= 4096: {100 * min(fr):.0f}-{100 * max(fr):.0f} % of it "
                           f"(target >= {100 * TARGET_SGEMM:.0f} %).")
            out.append("")
        rows = res["cases"]
        if rows:
            ratios = [r[p]["ratio"] for r in rows for p in ("forward", "backward")]
            met = sum(x >= TARGET_RATIO for x in ratios)
            out += [f"{len(rows)} cases; ratios {min(ratios):.2f}x to {max(ratios):.2f}x; {met} of {len(ratios)} "
                    f"passes at >= {TARGET_RATIO}x.", ""]
            idle = sorted(r["idle_before"] for r in rows if r.get("idle_before") is not None)
            if idle:
                out += [f"CPU left idle by other processes just before each case: median {100 * idle[len(idle) // 2]:.0f} %, "
                        f"lowest {100 * idle[0]:.0f} %.", ""]
            out += case_table(rows) + [""]
        if res.get("memory"):
            m = res["memory"]
            out += [f"Forward peak extra memory, float32, B=1 H=1 S={m['seqlen']} D={m['head_dim']}"
                    f"{' causal' if m.get('causal') else ''}: {m['peak_bytes'] / 2**20:.1f} MiB, "
                    f"{100 * m['fraction']:.2f} % of one score matrix ({m['score_bytes'] / 2**20:.0f} MiB; "
                    f"target < {100 * TARGET_MEMORY:.0f} %).", ""]
        if res.get("low_precision"):
            out += ["| dtype | S | D | threads | forward: low / f32 + conversions ms | ratio | "
                    "backward: low / f32 + conversions ms | ratio |", "|---|---|---|---|---|---|---|---|"]
            for r in res["low_precision"]:
                f, b = r["forward"], r["backward"]
                out.append(f"| {r['dtype']} | {r['seqlen']} | {r['head_dim']} | {r['threads']} | "
                           f"{_ms(f['low_s'])} / {_ms(f['f32_convert_s'])} | {f['ratio']:.2f}x | "
                           f"{_ms(b['low_s'])} / {_ms(b['f32_convert_s'])} | {b['ratio']:.2f}x |")
            out += ["", "(ratio above 1: the float16/bfloat16 call is faster than converting by hand.)", ""]
    return "\n".join(out) + "\n"


def plot(runs: dict, path: str) -> None:
    """flashcupy's speed relative to torch against S: one panel per run, a line per dtype,
    causality and pass at B=1, D=64, the other cases as points."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(5.5 * len(runs), 4.2), squeeze=False, sharey=True)
    for ax, (label, res) in zip(axes[0], runs.items()):
        threads = max(res["environment"]["threads"])
        rows = [r for r in res["cases"] if r["threads"] == threads]
        colors = iter(plt.rcParams["axes.prop_cycle"].by_key()["color"])
        for dtype, causal in itertools.product(("float32", "float64"), (False, True)):
            color = next(colors)
            for pass_, style in (("forward", "-o"), ("backward", "--s")):
                main = sorted((r for r in rows if (r["dtype"], r["causal"], r["batch"], r["head_dim"])
                               == (dtype, causal, 1, 64)), key=lambda r: r["seqlen"])
                if main:
                    ax.plot([r["seqlen"] for r in main], [r[pass_]["ratio"] for r in main], style, color=color,
                            label=f"{dtype}{' causal' if causal else ''} {pass_}")
                other = [r for r in rows if (r["dtype"], r["causal"]) == (dtype, causal)
                         and (r["batch"], r["head_dim"]) != (1, 64)]
                ax.plot([r["seqlen"] for r in other], [r[pass_]["ratio"] for r in other], style[-1], color=color,
                        alpha=0.35, linestyle="none")
        ax.axhline(TARGET_RATIO, color="grey", linestyle=":", label=f"target {TARGET_RATIO}x")
        ax.axhline(1.0, color="black", linewidth=0.6)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length")
        ax.set_title(f"{label} ({threads} threads)", fontsize=9)
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("torch time / flashcupy time")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("flashcupy numpy vs torch SDPA, CPU: H=8; lines B=1 D=64; faint points B=8 or D=128",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="issue 16's whole grid instead of the quick subset")
    ap.add_argument("--dtype", nargs="+", choices=["float32", "float64"])
    ap.add_argument("--seqlen", nargs="+", type=int)
    ap.add_argument("--batch", nargs="+", type=int)
    ap.add_argument("--head-dim", nargs="+", type=int)
    ap.add_argument("--causal", nargs="+", choices=["no", "yes"])
    ap.add_argument("--threads", nargs="+", type=int, help="thread counts, each case at each (default: all cores)")
    ap.add_argument("--max-gflop", type=float, help="skip cases whose forward needs more GFLOP than this")
    ap.add_argument("--rounds", type=int, default=3, help="calls per block (default 3)")
    ap.add_argument("--budget", type=float, default=60.0, help="seconds per case and pass, about (default 60)")
    ap.add_argument("--no-extras", action="store_true", help="skip the sgemm rate, memory and float16/bfloat16 runs")
    ap.add_argument("--wait-idle", type=float, metavar="FRACTION",
                    help="before each case, wait (up to --wait-timeout s) until at least this fraction of the "
                         "CPU is idle (a shared machine)")
    ap.add_argument("--wait-timeout", type=float, default=600.0)
    ap.add_argument("--json", help="write the results here (rewritten after each case)")
    ap.add_argument("--report", nargs="+", metavar="[LABEL=]FILE.json",
                    help="no measuring: build the report (--out) and plot (--plot) from saved runs")
    ap.add_argument("--out", help="write the Markdown report here")
    ap.add_argument("--plot", help="write the ratio plot here (needs matplotlib)")
    ap.add_argument("--label", help="the run's name in reports (default: its BLAS kernels)")
    args = ap.parse_args(argv)

    if args.report:
        runs = {}
        for item in args.report:
            label, _, path = item.rpartition("=")
            with open(path) as f:
                res = json.load(f)
            runs[label or res.get("label") or path] = res
        _write(runs, args)
        return 0

    import torch  # noqa: F401  (refuse early: this script compares against it)
    grid = dict(FULL if args.full else QUICK)
    for key, value in (("dtype", args.dtype), ("seqlen", args.seqlen), ("batch", args.batch),
                       ("head_dim", args.head_dim), ("causal", args.causal and [c == "yes" for c in args.causal])):
        if value:
            grid[key] = value
    threads = args.threads or [os.cpu_count() or 1]
    env = environment(threads)
    label = args.label or f"{env['blas']}"
    res = dict(label=label, environment=env, grid=grid, cases=[], skipped=[])
    print(f"# {label}: {json.dumps(env)}", flush=True)

    def save():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)

    if not args.no_extras:
        if args.wait_idle:
            wait_for_idle(args.wait_idle, args.wait_timeout)
        res["sgemm_gflops"] = sgemm_rate()
        print(f"sgemm {res['sgemm_gflops']:.0f} GFLOP/s", flush=True)
        if bench.HostPeak.available:
            Sm, Dm = 16384, 64
            peak = bench.peak_bytes("numpy", 1, 1, Sm, Dm)
            res["memory"] = dict(seqlen=Sm, head_dim=Dm, peak_bytes=peak, score_bytes=Sm * Sm * 4,
                                 fraction=peak / (Sm * Sm * 4))
            print(f"memory {peak / 2**20:.1f} MiB = {100 * res['memory']['fraction']:.2f} % of a score matrix",
                  flush=True)
        save()

    cases = list(itertools.product(grid["dtype"], grid["batch"], grid["seqlen"], grid["head_dim"], grid["causal"],
                                   threads))
    for dtype, batch, seqlen, head_dim, causal, n in cases:
        gflop = bench.flops(batch, HEADS, seqlen, head_dim, causal, "forward") / 1e9
        if args.max_gflop and gflop > args.max_gflop:
            res["skipped"].append(dict(dtype=dtype, batch=batch, seqlen=seqlen, head_dim=head_dim, causal=causal,
                                       threads=n, gflop=gflop))
            continue
        idle = wait_for_idle(args.wait_idle, args.wait_timeout) if args.wait_idle else None
        row = run_case(dtype, batch, seqlen, head_dim, causal, n, args.rounds, args.budget)
        row["idle_before"] = idle
        res["cases"].append(row)
        print(case_table([row])[-1], flush=True)
        save()

    if not args.no_extras:
        res["low_precision"] = []
        for dtype in ("float16", "bfloat16"):
            row = low_precision_case(dtype, 2048, 64, max(threads), args.rounds, args.budget)
            res["low_precision"].append(row)
            print(f"{dtype}: forward {row['forward']['ratio']:.2f}x, backward {row['backward']['ratio']:.2f}x "
                  f"of float32 + conversions", flush=True)
        save()
    if res["skipped"]:
        print(f"skipped (above --max-gflop): {len(res['skipped'])} cases", flush=True)
    _write({label: res}, args)
    return 0


def _write(runs, args):
    text = report(runs)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    if args.plot:
        plot(runs, args.plot)


if __name__ == "__main__":
    sys.exit(main())
