"""flashcupy.dask on a LocalCluster beside one NumPy-backend call on the whole arrays, in one run.

    python benchmarks/compare_dask.py                      # issue 15's targets (minutes on 2 cores)
    python benchmarks/compare_dask.py --seqlen 8192        # a quicker look
    python benchmarks/compare_dask.py --long 262144 --long-heads 1   # the long causal forward too
    python benchmarks/compare_dask.py --seqlen 8192 --bias  # with a pair bias (1, 1, S, S) and its dbias

1. One NumPy-backend call (forward, then backward) on the whole float32 arrays, B=1, H=8, D=64,
   causal, against flashcupy.dask on a `distributed.LocalCluster` of 2 worker processes with one
   thread each (and the NumPy backend told to use one thread in each), sequence chunks of 4096.
   ratio = dask's time / the single call's (target: at most 1.5). Each side's best of --repeat
   runs (3) after a warm-up, dask's results persisted on the workers (not gathered); the
   cluster's start-up is not counted.
2. Peak memory per worker: tracemalloc's peak inside each worker (NumPy reports its buffers to
   tracemalloc) during a forward and backward before the timed ones (tracing slows Python, so it is
   off while timing), against one pair's working set measured the same way in this process: one
   pair's forward and backward on chunks of the same size (target: under 4x).
   --bias: both with a float32 pair bias (1, 1, S, S) shared by the heads (AlphaFold's), made on
   the cluster in chunk x chunk blocks (the same values as the single call's), and its dbias.
3. --long S: a causal forward of S tokens through Dask's threaded scheduler, with a progress bar
   (the whole score matrix would be S^2 x 4 bytes per head), checked on sampled rows against the
   oracle's formula in float64.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import tracemalloc

import numpy as np

import flashcupy
import flashcupy.dask as fdask
from flashcupy._problem import default_scale
from flashcupy.backends import numpy_backend

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_cpu import sgemm_rate  # noqa: E402


def _inputs(seqlen, heads, head_dim, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, seqlen, heads, head_dim), dtype=np.float32) for _ in range(4)]


def _bias(seqlen, chunk, seed=0):
    """A pair bias shared by every head, as AlphaFold's: a dask array of chunk x chunk blocks, each made
    by a task of its own (on a cluster, spread over the workers as a model's own bias would be: blocks
    from one array made by da.from_array would all start on the worker that holds the array, and every
    pair would run there); .compute() gives the same values as one NumPy array."""
    import dask.array as da
    rng = da.random.default_rng(seed + 7)
    return rng.standard_normal((1, 1, seqlen, seqlen), chunks=(1, 1, chunk, chunk), dtype=np.float32)


def _timed(fn):
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def _worker_setup():
    numpy_backend.configure(num_threads=1)
    tracemalloc.start()


def _worker_peak_reset():
    tracemalloc.reset_peak()
    return tracemalloc.get_traced_memory()[0]


def _worker_peak():
    return tracemalloc.get_traced_memory()[1]


def pair_working_set(chunk, heads, head_dim, bias=False) -> int:
    """Peak traced bytes of one pair's forward and backward on chunk x chunk, inputs included."""
    tracemalloc.start()
    q, k, v, dout = _inputs(chunk, heads, head_dim, seed=1)
    kw = {"bias": np.random.default_rng(1).standard_normal((1, 1, chunk, chunk), dtype=np.float32)} if bias else {}
    out, lse = flashcupy.attention(q, k, v, causal=True, return_lse=True, **kw)
    flashcupy.attention_backward(dout, q, k, v, out, lse, causal=True, **kw)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def cluster_case(seqlen, heads, head_dim, chunk, workers, bias=False, repeat=3) -> dict:
    import dask.array as da
    import distributed

    q, k, v, dout = _inputs(seqlen, heads, head_dim)
    kw = {"bias": _bias(seqlen, chunk).compute(scheduler="threads")} if bias else {}
    flashcupy.attention(q, k, v, causal=True, **kw)  # warm-up
    single = []
    for _ in range(repeat):
        fwd, (out, lse) = _timed(lambda: flashcupy.attention(q, k, v, causal=True, return_lse=True, **kw))
        bwd, grads = _timed(lambda: flashcupy.attention_backward(dout, q, k, v, out, lse, causal=True, **kw))
        single.append((fwd, bwd))
    single_fwd, single_bwd = (min(t[n] for t in single) for n in (0, 1))

    chunks = (1, chunk, heads, -1)
    with distributed.LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                                  dashboard_address=None) as cluster, distributed.Client(cluster) as client:
        client.run(_worker_setup)
        Q, K, V, G = client.persist([da.from_array(x, chunks=chunks) for x in (q, k, v, dout)])
        distributed.wait([f for x in (Q, K, V, G) for f in distributed.futures_of(x)])
        mods = {}
        if bias:
            mods["bias"] = client.persist(_bias(seqlen, chunk))
            distributed.wait(distributed.futures_of(mods["bias"]))

        def forward():
            o, l = client.persist(list(fdask.attention(Q, K, V, causal=True, return_lse=True, **mods)))
            distributed.wait(distributed.futures_of(o) + distributed.futures_of(l))
            return o, l

        def backward(o, l):  # persisted, as the forward: a dbias gathered would be S^2 x 4 bytes sent
            grads = client.persist(list(fdask.attention_backward(G, Q, K, V, o, l, causal=True, **mods)))
            distributed.wait([f for g in grads for f in distributed.futures_of(g)])
            return grads

        def run_and_forget(times=None):
            """A forward and backward whose results the workers then drop, so the next run computes
            its tasks (the same keys) again; with `times`, each pass's seconds appended to it."""
            t0 = time.perf_counter()
            results = [*forward()]
            t1 = time.perf_counter()
            results += backward(*results)
            if times is not None:
                times.append((t1 - t0, time.perf_counter() - t1))
            keys = {f.key for x in results for f in distributed.futures_of(x)}
            del results
            while client.run_on_scheduler(lambda dask_scheduler: any(k in dask_scheduler.tasks for k in keys)):
                time.sleep(0.05)

        run_and_forget()  # warm-up (imports, first-call costs in the workers), traced since _worker_setup
        baseline = client.run(_worker_peak_reset)  # the memory: a run under tracemalloc, not timed
        run_and_forget()
        peaks = client.run(_worker_peak)
        client.run(tracemalloc.stop)  # tracing slows the workers' Python: off while timing
        times = []
        for _ in range(repeat):
            run_and_forget(times)
        dask_fwd, dask_bwd = (min(t[n] for t in times) for n in (0, 1))
        o, l = forward()
        grads_dask = backward(o, l)
        got_out = o.compute()
        dq, *rest = client.gather(client.compute(grads_dask))
    err = float(np.abs(got_out - out).max())
    err_dq = float(np.abs(dq - grads[0]).max())
    err_dbias = float(np.abs(rest[2] - grads[3]).max()) if bias else None
    return dict(seqlen=seqlen, heads=heads, head_dim=head_dim, chunk=chunk, workers=workers, bias=bias, repeat=repeat,
                single_runs_s=single, dask_runs_s=times,
                max_abs_diff_dbias=err_dbias,
                single_forward_s=single_fwd, single_backward_s=single_bwd, dask_forward_s=dask_fwd,
                dask_backward_s=dask_bwd, worker_peak_bytes=[peaks[w] for w in sorted(peaks)],
                worker_baseline_bytes=[baseline[w] for w in sorted(peaks)], max_abs_diff_out=err, max_abs_diff_dq=err_dq)


def long_forward(seqlen, heads, head_dim, chunk) -> dict:
    import dask
    import dask.array as da
    from dask.diagnostics import ProgressBar

    q, k, v, _ = _inputs(seqlen, heads, head_dim)
    Q, K, V = (da.from_array(x, chunks=(1, chunk, heads, -1)) for x in (q, k, v))
    out, lse = fdask.attention(Q, K, V, causal=True, return_lse=True)
    tasks = len(dict(out.__dask_graph__()))
    with ProgressBar(dt=1):
        seconds, (out, lse) = _timed(lambda: dask.compute(out, lse, scheduler="threads", num_workers=2))
    # a few rows against the formula in float64: row i sees keys 0..i
    worst = 0.0
    scale = default_scale(head_dim)
    for i in (0, 1, chunk - 1, chunk, seqlen // 2 + 3, seqlen - 1):
        s = np.einsum("hd,jhd->hj", q[0, i].astype(np.float64), k[0, :i + 1].astype(np.float64)) * scale
        m = s.max(1, keepdims=True)
        p = np.exp(s - m)
        want = np.einsum("hj,jhd->hd", p / p.sum(1, keepdims=True), v[0, :i + 1].astype(np.float64))
        worst = max(worst, float(np.abs(out[0, i] - want).max()))
    flops = 4 * heads * seqlen * seqlen * head_dim / 2
    return dict(seqlen=seqlen, heads=heads, head_dim=head_dim, chunk=chunk, seconds=seconds, tasks=tasks,
                gflops=flops / seconds / 1e9, score_matrix_bytes=4 * heads * seqlen**2, max_abs_err_sampled=worst)


def report(result) -> str:
    env = result["environment"]
    lines = ["# flashcupy.dask on a LocalCluster vs one NumPy-backend call", "",
             f"`python benchmarks/compare_dask.py` ({env['date']}; {env['machine']}, {env['cores']} cores; numpy "
             f"{env['numpy']}, dask {env['dask']}; flashcupy {env['commit']}). float32, B=1, causal. NumPy sgemm "
             f"(4096³, default BLAS threads) before the run: {env.get('sgemm_gflops', float('nan')):.0f} GFLOP/s.", ""]
    for c in result["cluster"]:
        ws = result["pair_working_set_bytes"]
        extra = [p - b for p, b in zip(c["worker_peak_bytes"], c["worker_baseline_bytes"])]
        with_bias = f", pair bias (1, 1, {c['seqlen']}, {c['seqlen']}) and dbias" if c.get("bias") else ""
        lines += [f"## S={c['seqlen']}, H={c['heads']}, D={c['head_dim']}, chunks of {c['chunk']}, "
                  f"{c['workers']} worker processes x 1 thread{with_bias}", "",
                  f"Best of {c.get('repeat', 1)} timed runs each.", "",
                  "| pass | one call (2 threads) | dask | dask / one call | target |", "|---|---|---|---|---|",
                  f"| forward | {c['single_forward_s']:.2f} s | {c['dask_forward_s']:.2f} s | "
                  f"{c['dask_forward_s'] / c['single_forward_s']:.2f}x | <= 1.5x |",
                  f"| backward | {c['single_backward_s']:.2f} s | {c['dask_backward_s']:.2f} s | "
                  f"{c['dask_backward_s'] / c['single_backward_s']:.2f}x | <= 1.5x |", "",
                  f"Peak traced memory per worker during a forward and backward before the timed ones, above what "
                  f"it held before (its share of the persisted inputs"
                  f"{'; the run persists its own dbias, S^2 x 4 bytes over the workers, counted here' if c.get('bias') else ''}): "
                  f"{', '.join(f'{b / 2**20:.0f} MiB' for b in extra)} (with that share: "
                  f"{', '.join(f'{b / 2**20:.0f} MiB' for b in c['worker_peak_bytes'])}); one pair's working set "
                  f"(its forward and backward on {c['chunk']} x {c['chunk']}, inputs included): {ws / 2**20:.0f} MiB, "
                  f"so {max(extra) / ws:.2f}x (target < 4x). The whole score matrix: "
                  f"{4 * c['heads'] * c['seqlen']**2 / 2**30:.0f} GiB.", "",
                  f"Largest difference from the single call: out {c['max_abs_diff_out']:.2g}, dq {c['max_abs_diff_dq']:.2g}"
                  + (f", dbias {c['max_abs_diff_dbias']:.2g}." if c.get("bias") else "."), ""]
    if result.get("long"):
        lg = result["long"]
        lines += [f"## S={lg['seqlen']} causal forward, H={lg['heads']}, D={lg['head_dim']}, chunks of {lg['chunk']}", "",
                  f"Dask threaded scheduler: {lg['seconds']:.0f} s ({lg['gflops']:.0f} GFLOP/s), {lg['tasks']} tasks; "
                  f"the score matrix would be {lg['score_matrix_bytes'] / 2**30:.0f} GiB. Sampled rows against a float64 "
                  f"formula: largest error {lg['max_abs_err_sampled']:.2g}.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlen", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3, help="timed runs of each side (the best is kept)")
    ap.add_argument("--bias", action="store_true", help="with a pair bias (1, 1, S, S) and its dbias")
    ap.add_argument("--long", type=int, default=0, help="also a causal forward of this many tokens (0: skip)")
    ap.add_argument("--long-heads", type=int, default=8)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--out", help="write the Markdown report here")
    args = ap.parse_args(argv)

    import subprocess

    import dask
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        commit = ""
    result = dict(environment=dict(date=time.strftime("%Y-%m-%d %H:%M"), machine=platform.machine(),
                                   cores=os.cpu_count(), numpy=np.__version__, dask=dask.__version__,
                                   commit=commit, load_average=os.getloadavg()))
    result["environment"]["sgemm_gflops"] = sgemm_rate()
    result["pair_working_set_bytes"] = pair_working_set(args.chunk, args.heads, args.head_dim, args.bias)
    result["cluster"] = [cluster_case(args.seqlen, args.heads, args.head_dim, args.chunk, args.workers, args.bias,
                                    args.repeat)]
    if args.long:
        result["long"] = long_forward(args.long, args.long_heads, args.head_dim, args.chunk)
    text = report(result)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
