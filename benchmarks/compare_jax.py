"""flashcupy.jax on JAX's CPU beside the direct NumPy calls and jax.nn.dot_product_attention (XLA), in one run.

    python benchmarks/compare_jax.py                 # issue 29's case: float32, B=1, H=8, D=64, S=2048, causal
    python benchmarks/compare_jax.py --rounds 9 --markdown benchmarks/results/jax.md
    python benchmarks/compare_jax.py --bias-jvp      # forward mode through a bias (section 3)

1. Time, in alternated rounds (each round runs every candidate once, the rounds going through every
   order of them, each call after a pause of PAUSE seconds, all after a warm-up call of each; the
   median and the best over rounds are reported):
   - forward: jax.jit(flashcupy.jax.attention) vs flashcupy.attention on the same NumPy data vs
     jax.jit(jax.nn.dot_product_attention(implementation="xla"));
   - value and grad: jax.jit(jax.value_and_grad(<attention(q, k, v), dout>)) with respect to q, k, v
     through flashcupy.jax vs flashcupy.attention + attention_backward vs XLA's;
   - forward mode: jax.jit(jax.jvp(attention, (q, k, v), tangents)) through flashcupy.jax vs XLA's (the
     package has no forward mode of its own to call directly).
   Targets: flashcupy.jax within 1.2x of the direct NumPy calls, and at least as fast as XLA's; the
   ratios are the medians of each round's ratio (the candidates of a round run back to back, so a
   change in the machine's load between rounds cancels).
   Each round also times a 1024^3 float32 matmul (the sgemm rate printed beside: the machine is
   shared, and the rate shows how much of it a round had), and each call's CPU time (all threads).
2. Memory, per seqlen (compiled, not run): XLA's temporary buffers for the jitted function
   (Compiled.memory_analysis()), and for flashcupy.jax also the NumPy backend's own peak during a
   call (tracemalloc: NumPy reports its buffers to it), against XLA's attention, whose temporaries
   hold the score matrix.
3. --bias-jvp: forward mode through a bias, jax.jit(jax.jvp) in (q, k, v, bias) and in the bias alone,
   beside the jvp in (q, k, v) with the bias held constant, flashcupy.jax vs XLA's attention, timed
   as in 1, with XLA's temporaries: BIAS_CASES, a (1, H, S, S) bias shared by the batch.
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import statistics
import subprocess
import sys
import time
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np

import flashcupy
import flashcupy.jax as fj
from flashcupy._problem import Band, attention_flops
from flashcupy.backends.numpy_backend import pool


PAUSE = 0.1  # seconds before each timed call


def inputs(seqlen, heads, head_dim, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, seqlen, heads, head_dim), dtype=np.float32) for _ in range(4)]


PASSES = ("forward", "value_and_grad", "jvp")


def jitted_passes(attend) -> tuple:
    """attend's jitted forward, value_and_grad (<out, dout> in q, k, v) and jvp (in q, k, v, the
    tangents (dout, dout, dout): q, k, v share a shape here)."""
    vg = jax.value_and_grad(lambda q, k, v, dout: jnp.vdot(attend(q, k, v), dout), argnums=(0, 1, 2))
    return (jax.jit(attend), jax.jit(vg),
            jax.jit(lambda q, k, v, dout: jax.jvp(attend, (q, k, v), (dout, dout, dout))))


def candidates(q, k, v, dout):
    """{name: (forward, value_and_grad, jvp)}, each a no-argument function that blocks until done (None
    where the candidate has no such pass)."""
    jq, jk, jv, jdout = map(jnp.asarray, (q, k, v, dout))

    def jitted(attend):
        fwd, vg, jvp = jitted_passes(attend)
        return (lambda: fwd(jq, jk, jv).block_until_ready(),
                lambda: jax.block_until_ready(vg(jq, jk, jv, jdout)),
                lambda: jax.block_until_ready(jvp(jq, jk, jv, jdout)))

    def numpy_vg():
        out, lse = flashcupy.attention(q, k, v, causal=True, return_lse=True)
        grads = flashcupy.attention_backward(dout, q, k, v, out, lse, causal=True)
        return np.vdot(out, dout), grads

    return {
        "flashcupy.jax": jitted(lambda q, k, v: fj.attention(q, k, v, causal=True)),
        "NumPy direct": (lambda: flashcupy.attention(q, k, v, causal=True), numpy_vg, None),
        "XLA": jitted(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")),
    }


def sgemm_rate(n=1024) -> float:
    a, b = np.ones((n, n), np.float32), np.ones((n, n), np.float32)
    t0 = time.perf_counter()
    a @ b
    return 2 * n**3 / (time.perf_counter() - t0) / 1e9


def timing(seqlen, heads, head_dim, rounds) -> dict:
    q, k, v, dout = inputs(seqlen, heads, head_dim)
    cands = candidates(q, k, v, dout)
    names = list(cands)
    passes = [(n, w) for n in names for w in range(len(PASSES)) if cands[n][w] is not None]
    times = {key: [] for key in passes}
    cpu = {key: [] for key in passes}  # the process's CPU time, every thread's
    for n, w in passes:  # warm-up: compiles and first-call buffers
        cands[n][w]()
    rates = []
    # every order of the candidates in turn (a rotation would keep each one's predecessor), and a
    # pause before each call: XLA's CPU thread pool spins on for a while after its own work, which
    # the call after it pays for (see benchmarks/results/jax.md)
    orders = list(itertools.permutations(names))
    for r in range(rounds):
        rates.append(sgemm_rate())
        for which in range(len(PASSES)):
            for n in orders[r % len(orders)]:
                if cands[n][which] is None:
                    continue
                time.sleep(PAUSE)
                t0, c0 = time.perf_counter(), time.process_time()
                cands[n][which]()
                times[n, which].append(time.perf_counter() - t0)
                cpu[n, which].append(time.process_time() - c0)
    flops = attention_flops(1, heads, head_dim, Band.of(seqlen, seqlen, causal=True), windowed=False)
    return dict(times=times, cpu=cpu, rates=rates, names=names, flops=(flops, flops * 3.5, None))


def after_xla(seqlen, heads, head_dim, rounds) -> dict:
    """Median CPU time (ms) of a forward through flashcupy.jax and of the direct NumPy call, each
    run right after XLA's attention and after it plus a pause: what the pause above is for."""
    q, k, v, dout = inputs(seqlen, heads, head_dim)
    cands = candidates(q, k, v, dout)
    xla = cands["XLA"][0]
    found = {}
    for name in ("flashcupy.jax", "NumPy direct"):
        for pause in (0, PAUSE):
            cpu = []
            for _ in range(rounds):
                xla()
                time.sleep(pause)
                c0 = time.process_time()
                cands[name][0]()
                cpu.append(time.process_time() - c0)
            found[name, pause] = statistics.median(cpu) * 1e3
    return found


def memory(seqlen, heads, head_dim) -> dict:
    """Bytes: XLA's temporaries for the jitted forward, value-and-grad and jvp of each JAX candidate,
    and the NumPy backend's traced peak inside flashcupy.jax's calls."""
    q, k, v, dout = map(jnp.asarray, inputs(seqlen, heads, head_dim))
    found = {}
    for name, attend in (("flashcupy.jax", lambda q, k, v: fj.attention(q, k, v, causal=True)),
                         ("XLA", lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                                              implementation="xla"))):
        row = {}
        for which, fn in zip(PASSES, jitted_passes(attend)):
            args = (q, k, v) if which == "forward" else (q, k, v, dout)
            row[which] = fn.lower(*args).compile().memory_analysis().temp_size_in_bytes
            if name == "flashcupy.jax":
                jax.block_until_ready(fn(*args))  # compiled and warm: the peak below is one call's
                # the backend keeps scratch buffers between calls (pool.SCRATCH_KEEP_BYTES): dropped
                # first, so that the peak counts them
                for scratch in (pool.call_scratch, *list(pool.scratches)):
                    scratch.trim(0)
                tracemalloc.start()
                jax.block_until_ready(fn(*args))
                row[which + " (NumPy backend)"] = tracemalloc.get_traced_memory()[1]
                tracemalloc.stop()
        found[name] = row
    return found


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__)), check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def report(args, t, mem) -> str:
    med = {key: statistics.median(v) for key, v in t["times"].items()}
    best = {key: min(v) for key, v in t["times"].items()}
    lines = [
        "# flashcupy.jax on JAX's CPU vs the direct NumPy calls and jax.nn.dot_product_attention (XLA)",
        "",
        f"`python benchmarks/compare_jax.py {' '.join(sys.argv[1:])}`".replace(" `", "`"),
        f"({time.strftime('%Y-%m-%d %H:%M')}; {platform.machine()}, {os.cpu_count()} cores; numpy {np.__version__}, "
        f"jax {jax.__version__}; flashcupy {commit()}). float32, B=1, H={args.heads}, D={args.head_dim}, "
        f"S={args.seqlen}, causal; {args.rounds} alternated rounds, median (best).",
        "",
        f"sgemm (1024^3 float32 matmul) per round: {', '.join(f'{r:.0f}' for r in t['rates'])} GFLOP/s.",
        "",
        "| pass | " + " | ".join(t["names"]) + " | flashcupy.jax / NumPy direct, median of the rounds' ratios "
        "(target <= 1.2) | flashcupy.jax / XLA (target <= 1) |",
        "|---|" + "---|" * (len(t["names"]) + 2),
    ]
    def cell(n, which):
        if (n, which) not in med:
            return "-"
        flops = t["flops"][which]
        rate = "" if flops is None else f", {flops / med[n, which] / 1e9:.0f} GFLOP/s"
        return (f"{med[n, which] * 1e3:.0f} ms ({best[n, which] * 1e3:.0f}){rate}; "
                f"CPU {statistics.median(t['cpu'][n, which]) * 1e3:.0f} ms")

    def ratio(which, other):
        if (other, which) not in med:
            return "-"
        pairs = zip(t["times"]["flashcupy.jax", which], t["times"][other, which])
        return f"{statistics.median(a / b for a, b in pairs):.2f}"

    for which, label in enumerate(("jitted forward", "jitted value_and_grad", "jitted jvp")):
        lines.append(f"| {label} | " + " | ".join(cell(n, which) for n in t["names"])
                     + f" | {ratio(which, 'NumPy direct')} | {ratio(which, 'XLA')} |")
    lines += ["", "FLOPs: the FlashAttention papers' count (causal S^2 / 2); value_and_grad is forward + backward "
              "(3.5x the forward's); the jvp has no such count (flashcupy.jax's is a forward, a backward with k "
              "widened by v's columns and one, and a forward on v's tangent). CPU: the median CPU time of the "
              "process (every thread) per call: the work done, which the machine's other load does not change.", "",
              "## Memory (XLA's temporary buffers of the compiled function; flashcupy.jax also the NumPy "
              "backend's own traced peak during one call)", "",
              "| S | pass | flashcupy.jax: XLA temporaries | flashcupy.jax: NumPy backend peak | XLA: temporaries |",
              "|---|---|---|---|---|"]
    for S, m in mem.items():
        for which in PASSES:
            lines.append(f"| {S} | {which} | {m['flashcupy.jax'][which] / 2**20:.1f} MiB | "
                         f"{m['flashcupy.jax'][which + ' (NumPy backend)'] / 2**20:.1f} MiB | "
                         f"{m['XLA'][which] / 2**20:.1f} MiB |")
    lines += ["", "## Why each call waits PAUSE = %.1f s" % PAUSE, "",
              "Median CPU time of one jitted forward, right after a call of XLA's attention and after it plus the "
              "pause (XLA's CPU thread pool spins on after its own work, on the same cores):", "",
              "| | right after XLA | after XLA and the pause |", "|---|---|---|"]
    for name in ("flashcupy.jax", "NumPy direct"):
        lines.append(f"| {name} | {t['after'][name, 0]:.0f} ms | {t['after'][name, PAUSE]:.0f} ms |")
    return "\n".join(lines) + "\n"


# (name, B, S, H, D, causal): a long sequence; a NetKet-like batch of many short ones (a ViT's
# positional bias shared by the samples)
BIAS_CASES = (("B=1 S=2048 H=8 D=64 causal", 1, 2048, 8, 64, True),
              ("B=256 S=64 H=4 D=16", 256, 64, 4, 16, False))
BIAS_TANGENTS = ("q, k, v (bias constant)", "q, k, v, bias", "bias alone")


def bias_jvp_candidates(B, S, H, D, causal):
    """{(name, tangents): (no-argument function that blocks, its jitted function and arguments)}."""
    rng = np.random.default_rng(0)
    q, k, v, t = (jnp.asarray(rng.standard_normal((B, S, H, D), dtype=np.float32)) for _ in range(4))
    bias, b_t = (jnp.asarray(rng.standard_normal((1, H, S, S), dtype=np.float32)) for _ in range(2))
    found = {}
    for name, attend in (("flashcupy.jax", lambda q, k, v, b: fj.attention(q, k, v, bias=b, causal=causal)),
                         ("XLA", lambda q, k, v, b: jax.nn.dot_product_attention(
                             q, k, v, bias=b, is_causal=causal, implementation="xla"))):
        jitted = (jax.jit(lambda q, k, v, b, t, b_t, f=attend: jax.jvp(lambda *x: f(*x, b), (q, k, v), (t, t, t))),
                  jax.jit(lambda q, k, v, b, t, b_t, f=attend: jax.jvp(f, (q, k, v, b), (t, t, t, b_t))),
                  jax.jit(lambda q, k, v, b, t, b_t, f=attend: jax.jvp(lambda b: f(q, k, v, b), (b,), (b_t,))))
        for which, fn in zip(BIAS_TANGENTS, jitted):
            args = (q, k, v, bias, t, b_t)
            found[name, which] = ((lambda fn=fn, args=args: jax.block_until_ready(fn(*args))), fn, args)
    return found


def bias_jvp(rounds) -> str:
    """Section 3's report."""
    lines = ["# flashcupy.jax: forward mode through a bias, on JAX's CPU, vs XLA's attention", "",
             f"`python benchmarks/compare_jax.py {' '.join(sys.argv[1:])}`".replace(" `", "`"),
             f"({time.strftime('%Y-%m-%d %H:%M')}; {platform.machine()}, {os.cpu_count()} cores; numpy "
             f"{np.__version__}, jax {jax.__version__}; flashcupy {commit()}). float32, a (1, H, S, S) bias; "
             f"jax.jit(jax.jvp) along the tangents named; {rounds} alternated rounds (every order of the two, a "
             f"pause of {PAUSE} s before each call), median (best) time, and the median of the rounds' ratios; "
             f"XLA's temporaries of the compiled function.", ""]
    for label, B, S, H, D, causal in BIAS_CASES:
        cands = bias_jvp_candidates(B, S, H, D, causal)
        times = {key: [] for key in cands}
        for run, _, _ in cands.values():
            run()
        rates = []
        for r in range(rounds):
            rates.append(sgemm_rate())
            for which in BIAS_TANGENTS:
                for name in (("flashcupy.jax", "XLA"), ("XLA", "flashcupy.jax"))[r % 2]:
                    time.sleep(PAUSE)
                    t0 = time.perf_counter()
                    cands[name, which][0]()
                    times[name, which].append(time.perf_counter() - t0)
        lines += [f"## {label}", "", f"sgemm (1024^3) per round: {', '.join(f'{x:.0f}' for x in rates)} GFLOP/s.",
                  "", "| tangents | flashcupy.jax | XLA | flashcupy.jax / XLA | temporaries: flashcupy.jax | XLA |",
                  "|---|---|---|---|---|---|"]
        for which in BIAS_TANGENTS:
            cells, temps = [], []
            for name in ("flashcupy.jax", "XLA"):
                t = times[name, which]
                cells.append(f"{statistics.median(t) * 1e3:.1f} ms ({min(t) * 1e3:.1f})")
                _, fn, args = cands[name, which]
                temps.append(f"{fn.lower(*args).compile().memory_analysis().temp_size_in_bytes / 2**20:.1f} MiB")
            ratio = statistics.median(a / b for a, b in zip(times["flashcupy.jax", which], times["XLA", which]))
            lines.append(f"| {which} | {cells[0]} | {cells[1]} | {ratio:.2f} | {temps[0]} | {temps[1]} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--memory-seqlens", type=int, nargs="*", default=[1024, 2048, 4096])
    parser.add_argument("--markdown", help="write the report here too")
    parser.add_argument("--bias-jvp", action="store_true", help="section 3 only: forward mode through a bias")
    args = parser.parse_args(argv)
    if jax.default_backend() != "cpu":
        sys.exit("compare_jax.py times JAX's CPU backend (JAX_PLATFORMS=cpu)")
    if args.bias_jvp:
        text = bias_jvp(args.rounds)
        print(text)
        if args.markdown:
            with open(args.markdown, "w") as f:
                f.write(text)
        return
    t = timing(args.seqlen, args.heads, args.head_dim, args.rounds)
    t["after"] = after_xla(args.seqlen, args.heads, args.head_dim, args.rounds)
    mem = {S: memory(S, args.heads, args.head_dim) for S in args.memory_seqlens}
    text = report(args, t, mem)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
