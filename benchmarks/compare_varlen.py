"""Packed batches and KV-cache decoding on the NumPy backend, side by side in one run (issue 14).

    python benchmarks/compare_varlen.py              # both targets, a few minutes on 2 cores
    python benchmarks/compare_varlen.py --quick      # smaller shapes
    python benchmarks/compare_varlen.py --launches   # the cupy backend's launches, on the emulator (issue 28)
    python benchmarks/compare_varlen.py --gpu        # issue 28's GPU timings (benchmarks/gpu_session.sh runs them)
    python benchmarks/compare_varlen.py --short      # many short sequences, grouped against a call each

1. Varlen: 64 sequences of random length 1..2048 (float32, H=8, D=64, causal), packed, against
   padding every sequence to the longest and masking the padded keys (a bool key-padding mask)
   and against the sum of the separate per-sequence calls. Targets: >= 3x faster than padding,
   within 1.3x of the separate calls.
2. Decode: B=1, heads_q=32, heads_kv=8, D=128, one query over 64k cached keys, float32, through
   attention_with_kvcache, against the time to read K and V once (a NumPy sum over both, the
   machine's memory bandwidth as this process sees it) and torch's CPU SDPA on the same call.
   Targets: >= 50 % of that bandwidth; faster than torch.
3. --short: 2,000 sequences of random length 16..128 (graphs, point-cloud patches; float32, H=8,
   D=32, not causal), forward and forward + backward: the NumPy backend's groups of short sequences
   (numpy_backend/packed.py, the default), the same backend with one call per sequence
   (configure(short=0)), and torch's CPU SDPA on the batch padded to the longest with a key-padding
   mask (its autograd for the backward); then rank-4 batches of short sequences (DENSE_SHORT), and their
   attention weights (attention_probs; torch: softmax(scale q k^T)), through
   flashcupy.attention, the groups against the tiled path and torch's SDPA; NumPy's sgemm rate beside
   them.
Each contender keeps its best of several calls, taken in alternating blocks.

--launches (a checkout: it needs the emulator, flashcupy/tools/emulator): the kernel launches of a
packed forward and backward on the cupy backend, counted by the emulator's runtime with the kernels
recorded, not run (launch_records), for batches of 1 to 1,000 sequences of 17-300 tokens: the
per-sequence path (_varlen.forward_packed and backward_packed without device offsets: the cupy
backend's, and JAX's, before issue 28; the NumPy backend's still for sequences longer than
numpy_backend.packed.SHORT) and attention_varlen, attention_varlen_backward (one launch per kernel),
with the share of the CTAs of each kernel that reads the offsets that find no work (past their
sequence's blocks: mask.cuh's Sequence); and the launches of a decode step over a KV cache,
contiguous or paged (the append and attention_with_kvcache's attention).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import numpy as np

import flashcupy
from flashcupy.tools import bench


def varlen(n_seq, max_len, heads, head_dim, seed=0) -> dict:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, max_len + 1, n_seq)
    total = int(lengths.sum())
    q, k, v = (rng.standard_normal((total, heads, head_dim), dtype=np.float32) for _ in range(3))
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    longest = int(lengths.max())
    pad = [np.zeros((n_seq, longest, heads, head_dim), np.float32) for _ in range(3)]
    for b in range(n_seq):
        for padded, packed in zip(pad, (q, k, v)):
            padded[b, :lengths[b]] = packed[cu[b]:cu[b + 1]]
    keys = np.arange(longest)[None, :] < lengths[:, None]
    # key-padding mask, bottom-right causal per padded sequence would misalign: mask both the
    # padded keys and the causal pairs explicitly (row i sees keys j <= i of its own sequence)
    mask = keys[:, None, None, :] & (np.arange(longest)[None, None, :, None] >= np.arange(longest)[None, None, None, :])
    separate = [(q[None, a:b], k[None, a:b], v[None, a:b]) for a, b in zip(cu[:-1], cu[1:])]
    times = bench.best_alternating({
        "packed": lambda: flashcupy.attention_varlen(q, k, v, cu, cu, causal=True),
        "padded + mask": lambda: flashcupy.attention(*pad, mask=mask),
        "separate calls": lambda: [flashcupy.attention(*x, causal=True) for x in separate],
    }, repeat=3)
    return dict(sequences=n_seq, max_len=max_len, total=total, longest=longest, heads=heads, head_dim=head_dim,
                times=times)


@contextlib.contextmanager
def _grouping(short: int):
    """The NumPy backend's config.SHORT set to `short` (0: no groups) for the block, restored after."""
    from flashcupy.backends import numpy_backend
    saved = numpy_backend.config.SHORT
    numpy_backend.configure(short=short)
    try:
        yield
    finally:
        numpy_backend.config.SHORT = saved


def short_sequences(n_seq=2000, shortest=16, longest=128, heads=8, head_dim=32, seed=0) -> dict:
    """Section 3's times: {contender: best seconds}, and the problem's figures."""
    from flashcupy.backends import numpy_backend
    rng = np.random.default_rng(seed)
    lengths = rng.integers(shortest, longest + 1, n_seq)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    q, k, v, dout = (rng.standard_normal((int(cu[-1]), heads, head_dim), dtype=np.float32) for _ in range(4))

    def ours(short, backward):
        with _grouping(short):
            if not backward:
                return flashcupy.attention_varlen(q, k, v, cu, cu, backend="numpy")
            o, l = flashcupy.attention_varlen(q, k, v, cu, cu, return_lse=True, backend="numpy")
            return flashcupy.attention_varlen_backward(dout, q, k, v, o, l, cu, cu, backend="numpy")

    default = numpy_backend.packed.SHORT
    fns = {"grouped forward": lambda: ours(default, False), "a call each forward": lambda: ours(0, False),
           "grouped forward + backward": lambda: ours(default, True),
           "a call each forward + backward": lambda: ours(0, True)}
    try:
        import torch
        L = int(lengths.max())
        padded = [np.zeros((n_seq, L, heads, head_dim), np.float32) for _ in range(3)]
        for b in range(n_seq):
            for x, packed in zip(padded, (q, k, v)):
                x[b, :lengths[b]] = packed[cu[b]:cu[b + 1]]
        mask = torch.from_numpy(np.arange(L)[None, None, None, :] < lengths[:, None, None, None])
        tq, tk, tv = (torch.from_numpy(x).transpose(1, 2).requires_grad_() for x in padded)
        tdout = torch.zeros(n_seq, heads, L, head_dim)

        def sdpa(backward):
            if not backward:
                with torch.no_grad():
                    return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask)
            torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask).backward(tdout)

        fns["torch SDPA padded forward"] = lambda: sdpa(False)
        fns["torch SDPA padded forward + backward"] = lambda: sdpa(True)
    except ImportError:
        pass
    times = bench.best_alternating(fns, repeat=3)
    flops = 4.0 * heads * head_dim * float(np.sum(lengths.astype(float) ** 2))  # the forward's, no padding
    return dict(sequences=n_seq, shortest=shortest, longest=longest, total=int(cu[-1]), heads=heads,
                head_dim=head_dim, times=times, flops=flops)


# rank-4 batches of short sequences (numpy_backend/packed.py's dense groups): (batch, seqlen, heads,
# head_dim, dtype), a graph or point-cloud batch in float32 and neural-quantum-state sizes in float64
DENSE_SHORT = [(4000, 32, 4, 16, "float32"), (1000, 64, 8, 32, "float32"), (2000, 16, 4, 32, "float64"),
               (1000, 64, 2, 64, "float64"), (200, 128, 8, 64, "float32")]


def dense_short(shape, seed=0) -> dict:
    """{contender: best seconds} of flashcupy.attention on a rank-4 batch, forward and forward + backward,
    and attention_probs (every row, from the forward's lse): groups (the default), the tiled path
    (configure(short=0)), torch's CPU SDPA (for the weights, softmax(scale q k^T) in torch)."""
    from flashcupy.backends import numpy_backend
    B, S, H, D, dtype = shape
    rng = np.random.default_rng(seed)
    q, k, v, dout = (rng.standard_normal((B, S, H, D)).astype(dtype) for _ in range(4))

    lse = flashcupy.attention(q, k, v, backend="numpy", return_lse=True)[1]

    def ours(short, backward):
        with _grouping(short):
            if backward == "probs":
                return flashcupy.attention_probs(q, k, lse, backend="numpy")
            if not backward:
                return flashcupy.attention(q, k, v, backend="numpy")
            out, vjp = flashcupy.attention_vjp(q, k, v, backend="numpy")
            return vjp(dout)

    default = numpy_backend.packed.SHORT
    fns = {"grouped forward": lambda: ours(default, False), "tiled forward": lambda: ours(0, False),
           "grouped forward + backward": lambda: ours(default, True), "tiled forward + backward": lambda: ours(0, True),
           "grouped attention_probs": lambda: ours(default, "probs"), "tiled attention_probs": lambda: ours(0, "probs")}
    try:
        import torch
        tq, tk, tv = (torch.from_numpy(x).transpose(1, 2).requires_grad_() for x in (q, k, v))
        tdout = torch.from_numpy(dout).transpose(1, 2)

        def sdpa(backward):
            if not backward:
                with torch.no_grad():
                    return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv)
            torch.nn.functional.scaled_dot_product_attention(tq, tk, tv).backward(tdout)

        def weights():
            with torch.no_grad():
                return torch.softmax(tq @ tk.transpose(-1, -2) * D**-0.5, dim=-1)

        fns["torch forward"] = lambda: sdpa(False)
        fns["torch forward + backward"] = lambda: sdpa(True)
        fns["torch attention_probs"] = weights
    except ImportError:
        pass
    return bench.best_alternating(fns, repeat=3)


def bandwidth_seconds(k, v, repeat=5) -> float:
    """The best time to read k and v once (a sum: every byte read, nothing written)."""
    return min(bench.best_alternating({"read": lambda: (k.sum(dtype=np.float32), v.sum(dtype=np.float32))}, repeat).values())


def decode(cache, heads_q, heads_kv, head_dim, seed=0) -> dict:
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, 1, heads_q, head_dim), dtype=np.float32)
    k_cache, v_cache = (rng.standard_normal((1, cache, heads_kv, head_dim), dtype=np.float32) for _ in range(2))
    fns = {"flashcupy": lambda: flashcupy.attention_with_kvcache(q, k_cache, v_cache, causal=True)}
    try:
        import torch
        tq = torch.from_numpy(q).transpose(1, 2)
        tk, tv = (torch.from_numpy(x).transpose(1, 2) for x in (k_cache, v_cache))
        fns["torch SDPA"] = lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)
    except ImportError:
        pass
    times = bench.best_alternating(fns)
    read = bandwidth_seconds(k_cache, v_cache)
    nbytes = k_cache.nbytes + v_cache.nbytes
    return dict(cache=cache, heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim, times=times,
                read_seconds=read, bytes=nbytes)


def _working_blocks(lengths, name: str) -> int:
    """The blocks of a packed batch's sequences that kernel `name`'s CTAs work on, per head: query blocks
    (forward, dQ), key blocks (dK/dV), for its tile (the name expression's BLOCK_M, BLOCK_N)."""
    template, fields = name.split("<")[0], name.split("<")[1].split(", ")
    block_m = 3 if template in ("flash_fwd", "flash_bwd_dkdv", "flash_bwd_dq") else 2  # after T (, Acc), HEAD_DIM
    block = int(fields[block_m + template.startswith("flash_bwd_dkdv")])
    return int(sum(-(-lengths // block)))


def launches(batches=(1, 7, 40, 256, 1000), heads=8, head_dim=64, seed=0) -> list:
    """Rows (dtype, sequences, pass, launches per sequence, launches in one, [(kernel, CTAs, idle
    share)]) of a causal packed forward and backward on the emulated cupy backend (an sm_80, and for
    float16 an sm_90 too: the Hopper kernels), the kernels recorded and not run; the idle share for the
    kernels that read the offsets (the others run over the packed rows)."""
    from flashcupy import _varlen
    from flashcupy.tools.emulator.cupy import emulated, launch_records
    rng = np.random.default_rng(seed)
    rows = []
    for dtype, device in ((np.float16, 80), (np.float32, 80), (np.float16, 90)):
        for n in batches:
            lengths = rng.integers(17, 301, n)
            cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
            q, k, v = (np.zeros((int(cu[-1]), heads, head_dim), dtype) for _ in range(3))
            out, lse = np.zeros_like(q), np.full((heads, q.shape[0]), -np.inf, np.float32)
            grads = [np.zeros_like(x) for x in (q, k, v)]
            records = {name: [] for name in ("forward before", "forward after", "backward before", "backward after")}
            host = dict(causal=True, backend="cupy")
            with emulated(compile=launch_records(records["forward before"], run=False), compute_capability=device):
                _varlen.forward_packed(q, k, v, cu.astype(np.int64), cu.astype(np.int64), out, lse, **host)
            with emulated(compile=launch_records(records["forward after"], run=False), compute_capability=device):
                flashcupy.attention_varlen(q, k, v, cu, cu, check_offsets=False, **host)
            with emulated(compile=launch_records(records["backward before"], run=False), compute_capability=device):
                _varlen.backward_packed(q, q, k, v, out, lse, cu.astype(np.int64), cu.astype(np.int64), *grads, **host)
            with emulated(compile=launch_records(records["backward after"], run=False), compute_capability=device):
                flashcupy.attention_varlen_backward(q, q, k, v, out, lse, cu, cu, check_offsets=False, **host)
            for pass_ in ("forward", "backward"):
                after = records[f"{pass_} after"]
                kernels = [(name, ctas, 1 - _working_blocks(lengths, name) * heads / ctas) for name, ctas in after
                           if name.endswith(", true>")]
                label = np.dtype(dtype).name + (" (sm_90)" if device == 90 else "")
                rows.append((label, n, pass_, len(records[f"{pass_} before"]), len(after), kernels))
    return rows


def cache_steps(batches=(1, 7, 40, 256, 1000), heads_q=8, heads_kv=2, head_dim=64, cache=512, page=16,
                seed=0) -> list:
    """Rows (dtype, cache, sequences, launches, kernels) of one decode step over a KV cache, contiguous or
    paged (blocks of `page` positions, a shuffled block table), on the emulated cupy backend
    (attention_with_kvcache: one new token a sequence appended, then one query over the cache, causal,
    num_splits=None), the kernels recorded and not run."""
    from flashcupy.tools.emulator.cupy import emulated, launch_records
    rng = np.random.default_rng(seed)
    rows = []
    for dtype in (np.float16, np.float32):
        for layout in ("contiguous", f"paged, page {page}"):
            for n in batches:
                paged = layout != "contiguous"
                per = cache // page  # blocks a sequence
                shape = (n * per, page) if paged else (n, cache)
                # zeros never touched (the kernels are not run): no memory is written
                k_cache, v_cache = (np.zeros(shape + (heads_kv, head_dim), dtype) for _ in range(2))
                table = rng.permutation(n * per).reshape(n, per).astype(np.int32) if paged else None
                q = np.zeros((n, 1, heads_q, head_dim), dtype)
                k_new = np.zeros((n, 1, heads_kv, head_dim), dtype)
                lengths = rng.integers(0, cache, n).astype(np.int32)
                grids = []
                with emulated(compile=launch_records(grids, run=False)):
                    flashcupy.attention_with_kvcache(q, k_cache, v_cache, k=k_new, v=k_new, cache_seqlens=lengths,
                                                     block_table=table, causal=True, backend="cupy")
                names = [name.split("<")[0] for name, _ in grids]
                rows.append((np.dtype(dtype).name, layout, n, len(grids),
                             ", ".join(f"{names.count(x)} {x}" for x in dict.fromkeys(names))))
    return rows


# ----------------------------------------------------------------------------
# issue 28's GPU targets: --gpu here, and benchmarks/gpu_session.py's varlen stage on a lent GPU

GPU_SHAPES = dict(sequences=1000, lengths=(100, 500), heads=8, head_dim=64,
                  decode=dict(batch=64, cache=8192, heads_q=16, heads_kv=2, head_dim=128, page=16))
# the dry run's (the emulator: tiny, its times mean nothing)
DRY_SHAPES = dict(sequences=5, lengths=(3, 20), heads=2, head_dim=64,
                  decode=dict(batch=3, cache=48, heads_q=4, heads_kv=2, head_dim=64, page=16))


def _bf16_normal(xp, rng, shape):
    """Random normal bfloat16 values as uint16 bits (nearest even), made by xp (cupy: on the device)."""
    bits = rng.standard_normal(shape, dtype=xp.float32).view(xp.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(xp.uint16)


def gpu_timings(median, xp, shapes=GPU_SHAPES, seed=0):
    """Records {"type": "varlen", case, path, pass, seconds} of issue 28's GPU targets on the cupy
    backend, bfloat16: a causal packed batch of shapes' sequences forward and backward in one launch per
    kernel (checked offsets, and check_offsets=False), per sequence (the path before issue 28,
    _varlen._forward_loop), and the same tokens as one dense batch of equal lengths; a decode step over
    a paged cache (append and attention, and attention alone) beside torch SDPA over a dense cache of
    the same length (enable_gqa). median(fn): seconds a call (gpu_session's CUDA-event timing); xp: the
    array library (cupy; numpy under the emulator)."""
    import flashcupy
    from flashcupy import _varlen
    host = np.random.default_rng(seed)
    rng = xp.random.default_rng(seed)
    n, (lo, hi), H, D = shapes["sequences"], shapes["lengths"], shapes["heads"], shapes["head_dim"]
    cu = np.concatenate([[0], np.cumsum(host.integers(lo, hi + 1, n))]).astype(np.int32)
    total, S = int(cu[-1]), int(cu[-1]) // n
    q, k, v, dout = (_bf16_normal(xp, rng, (total, H, D)) for _ in range(4))
    cu_dev, cu_host = xp.asarray(cu), cu.astype(np.int64)
    kw = dict(causal=True, dtype="bfloat16", backend="cupy")
    out, lse = flashcupy.attention_varlen(q, k, v, cu_dev, cu_dev, return_lse=True, **kw)
    out2, lse2, *grads = (xp.empty_like(x) for x in (out, lse, q, k, v))
    dense = [x[:n * S].reshape(n, S, H, D) for x in (q, k, v, dout)]
    dense_out, dense_lse = flashcupy.attention(*dense[:3], return_lse=True, **kw)
    unchecked = dict(kw, check_offsets=False)
    paths = {
        "one launch": (lambda: flashcupy.attention_varlen(q, k, v, cu_dev, cu_dev, **kw),
                       lambda: flashcupy.attention_varlen_backward(dout, q, k, v, out, lse, cu_dev, cu_dev, **kw)),
        "one launch, check_offsets=False": (
            lambda: flashcupy.attention_varlen(q, k, v, cu_dev, cu_dev, **unchecked),
            lambda: flashcupy.attention_varlen_backward(dout, q, k, v, out, lse, cu_dev, cu_dev, **unchecked)),
        "per sequence (before issue 28)": (
            lambda: _varlen._forward_loop(q, k, v, cu_host, cu_host, out2, lse2, **kw),
            lambda: _varlen._backward_loop(dout, q, k, v, out, lse, cu_host, cu_host, *grads, **kw)),
        f"dense batch {n} x {S}": (
            lambda: flashcupy.attention(*dense[:3], **kw),
            lambda: flashcupy.attention_backward(dense[3], *dense[:3], dense_out, dense_lse, **kw)),
    }
    case = f"packed: {n} sequences of {lo}-{hi} tokens ({total} in all), H={H}, D={D}, causal"
    for path, fns in paths.items():
        for pass_, fn in zip(("forward", "backward"), fns):
            yield {"type": "varlen", "case": case, "path": path, "pass": pass_, "seconds": median(fn)}

    d = shapes["decode"]
    B, C, page = d["batch"], d["cache"], d["page"]
    per = C // page
    k_cache, v_cache = (_bf16_normal(xp, rng, (B * per, page, d["heads_kv"], d["head_dim"])) for _ in range(2))
    table = xp.asarray(host.permutation(B * per).reshape(B, per).astype(np.int32))
    q1 = _bf16_normal(xp, rng, (B, 1, d["heads_q"], d["head_dim"]))
    k1, v1 = (_bf16_normal(xp, rng, (B, 1, d["heads_kv"], d["head_dim"])) for _ in range(2))
    before, full = xp.full(B, C - 1, dtype=xp.int32), xp.full(B, C, dtype=xp.int32)
    step = dict(k=k1, v=v1, cache_seqlens=before, block_table=table, **kw)
    fns = {"append + attention": lambda: flashcupy.attention_with_kvcache(q1, k_cache, v_cache, **step),
           "append + attention, check_offsets=False": lambda: flashcupy.attention_with_kvcache(
               q1, k_cache, v_cache, check_offsets=False, **step),
           "attention alone": lambda: flashcupy.attention_with_kvcache(q1, k_cache, v_cache, cache_seqlens=full,
                                                                       block_table=table, **kw)}
    try:
        import torch
        device = "cpu" if xp is np else "cuda"
        tq = torch.randn(B, d["heads_q"], 1, d["head_dim"], dtype=torch.bfloat16, device=device)
        tk, tv = (torch.randn(B, d["heads_kv"], C, d["head_dim"], dtype=torch.bfloat16, device=device)
                  for _ in range(2))
        fns["torch SDPA, dense cache (attention alone)"] = (
            lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True))
    except ImportError:
        pass
    case = (f"decode step: {B} sequences, {C} cached keys, heads {d['heads_q']}/{d['heads_kv']}, D={d['head_dim']}, "
            f"paged (page {page})")
    for path, fn in fns.items():
        yield {"type": "varlen", "case": case, "path": path, "pass": "forward", "seconds": median(fn)}


def timing_table(records) -> list:
    """Markdown lines of gpu_timings' records, with the ratios the issue's targets name."""
    if not records:
        return []
    lines = ["## Packed batches and KV-cache decoding (issue 28)", "",
             "bfloat16, cupy backend, median of timed calls after a warm-up.", ""]
    for case in dict.fromkeys(r["case"] for r in records):
        rows = [r for r in records if r["case"] == case]
        t = {(r["path"], r["pass"]): r["seconds"] for r in rows}
        lines += [f"### {case}", "", "| path | forward ms | backward ms |", "|---|---|---|"]
        for path in dict.fromkeys(r["path"] for r in rows):
            cells = [f"{t[path, p] * 1e3:.3f}" if (path, p) in t else "" for p in ("forward", "backward")]
            lines.append(f"| {path} | {' | '.join(cells)} |")
        ratios = []
        dense = next((path for path, _ in t if path.startswith("dense batch")), None)
        for p in ("forward", "backward"):
            one = t.get(("one launch", p))
            if one and ("per sequence (before issue 28)", p) in t:
                ratios.append(f"{p}: per sequence / one launch {t['per sequence (before issue 28)', p] / one:.1f}x "
                              f"(target >= 10x)")
            if one and dense and (dense, p) in t:
                ratios.append(f"{p}: one launch / dense batch {one / t[dense, p]:.2f}x (target <= 1.2x)")
        torch_t = t.get(("torch SDPA, dense cache (attention alone)", "forward"))
        if torch_t and ("append + attention", "forward") in t:
            ratios.append(f"decode: torch / flashcupy's step {torch_t / t['append + attention', 'forward']:.2f}x "
                          f"(target >= 1.0x)")
        lines += [""] + [f"- {x}" for x in ratios] + [""]
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--launches", action="store_true", help="the cupy backend's launches (emulated), only")
    ap.add_argument("--gpu", action="store_true", help="issue 28's GPU timings (cupy on a GPU), only")
    ap.add_argument("--short", action="store_true", help="many short sequences (section 3), only")
    args = ap.parse_args(argv)
    if args.short:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from compare_cpu import sgemm_rate
        before = sgemm_rate()
        r = short_sequences()
        after = sgemm_rate()
        t = r["times"]
        print(f"# NumPy backend: {r['sequences']} sequences of {r['shortest']}..{r['longest']} tokens ({r['total']} in "
              f"all), float32, H={r['heads']}, D={r['head_dim']}, not causal ({time.strftime('%Y-%m-%d %H:%M')}, "
              f"{os.cpu_count()} cores, numpy {np.__version__}, load average {os.getloadavg()[0]:.2f}; NumPy sgemm "
              f"4096^3 {before:.0f} GFLOP/s before, {after:.0f} after)\n")
        print("| pass | grouped | a call each | torch SDPA, padded + key-padding mask | a call each / grouped | "
              "torch / grouped |")
        print("|---|---|---|---|---|---|")
        for pass_ in ("forward", "forward + backward"):
            ours, each = t[f"grouped {pass_}"], t[f"a call each {pass_}"]
            theirs = t.get(f"torch SDPA padded {pass_}")
            rate = r["flops"] * (1 if pass_ == "forward" else 3.5) / ours / 1e9
            print(f"| {pass_} | {ours * 1e3:.0f} ms ({rate:.0f} GFLOP/s) | {each * 1e3:.0f} ms | "
                  f"{'n/a' if theirs is None else f'{theirs * 1e3:.0f} ms'} | {each / ours:.2f}x | "
                  f"{'n/a' if theirs is None else f'{theirs / ours:.2f}x'} |")
        print("\n## Rank-4 batches of short sequences (not causal): flashcupy.attention, the groups against the tiled "
              "path (configure(short=0)) and torch's CPU SDPA\n")
        print("| batch | S | H | D | dtype | pass | grouped | tiled | torch SDPA | tiled / grouped | torch / grouped |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for shape in DENSE_SHORT:
            t = dense_short(shape)
            for pass_ in ("forward", "forward + backward", "attention_probs"):
                ours, tiled, theirs = t[f"grouped {pass_}"], t[f"tiled {pass_}"], t.get(f"torch {pass_}")
                print(f"| {' | '.join(map(str, shape))} | {pass_} | {ours * 1e3:.0f} ms | {tiled * 1e3:.0f} ms | "
                      f"{'n/a' if theirs is None else f'{theirs * 1e3:.0f} ms'} | {tiled / ours:.2f}x | "
                      f"{'n/a' if theirs is None else f'{theirs / ours:.2f}x'} |")
        print(f"\nNumPy sgemm 4096^3 after: {sgemm_rate():.0f} GFLOP/s")
        return 0
    if args.gpu:
        import cupy
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from gpu_session import GPU, _median_seconds
        print("\n".join(timing_table(list(gpu_timings(lambda fn: _median_seconds(fn, False, GPU), cupy)))))
        return 0
    if args.launches:
        print("# cupy backend, emulated: launches of a causal packed forward and backward, sequences of 17-300 "
              "tokens, H=8, D=64\n")
        print("| dtype | sequences | pass | per-sequence path | one launch per kernel | kernels reading the offsets: "
              "CTAs, idle share |")
        print("|---|---|---|---|---|---|")
        for dtype, n, pass_, before, after, kernels in launches():
            cells = "; ".join(f"`{name}` {ctas}, {idle * 100:.0f} %" for name, ctas, idle in kernels)
            print(f"| {dtype} | {n} | {pass_} | {before} | {after} | {cells} |")
        print("\n# cupy backend, emulated (132 SMs): launches of a decode step over a KV cache, one new "
              "token a sequence, heads 8/2, D=64, 512 cached positions\n\nThe backend's own kernels; where "
              "split-KV runs (a batch too small to fill the device) its merge is one launch more "
              "(flash_split_merge).\n")
        print("| dtype | cache | sequences | launches | kernels |")
        print("|---|---|---|---|---|")
        for dtype, layout, n, count, kernels in cache_steps():
            print(f"| {dtype} | {layout} | {n} | {count} | {kernels} |")
        return 0
    print(f"# NumPy backend: packed batches and KV-cache decoding ({time.strftime('%Y-%m-%d %H:%M')}, "
          f"{os.cpu_count()} cores, numpy {np.__version__}, load average {os.getloadavg()[0]:.2f})\n")
    r = varlen(16 if args.quick else 64, 512 if args.quick else 2048, 8, 64)
    t = r["times"]
    print(f"## {r['sequences']} sequences of 1..{r['max_len']} tokens ({r['total']} in all, longest {r['longest']}), "
          f"float32, H={r['heads']}, D={r['head_dim']}, causal\n")
    print("| packed | padded + mask | separate calls | padded / packed (target >= 3x) | packed / separate (target <= 1.3x) |")
    print("|---|---|---|---|---|")
    print(f"| {t['packed'] * 1e3:.0f} ms | {t['padded + mask'] * 1e3:.0f} ms | {t['separate calls'] * 1e3:.0f} ms | "
          f"{t['padded + mask'] / t['packed']:.2f}x | {t['packed'] / t['separate calls']:.2f}x |\n")
    d = decode(8192 if args.quick else 65536, 32, 8, 128)
    t = d["times"]
    rate = d["bytes"] / t["flashcupy"] / 1e9
    print(f"## Decode: one query, {d['cache']} cached keys, heads_q={d['heads_q']}, heads_kv={d['heads_kv']}, "
          f"D={d['head_dim']}, float32\n")
    print("| flashcupy | torch SDPA | reading K and V once | flashcupy's share of that bandwidth (target >= 50 %) "
          "| torch / flashcupy (target > 1) |")
    print("|---|---|---|---|---|")
    torch_t = t.get("torch SDPA")
    torch_cell = "n/a" if torch_t is None else f"{torch_t * 1e3:.1f} ms"
    ratio_cell = "n/a" if torch_t is None else f"{torch_t / t['flashcupy']:.2f}x"
    print(f"| {t['flashcupy'] * 1e3:.1f} ms ({rate:.1f} GB/s) | {torch_cell} | {d['read_seconds'] * 1e3:.1f} ms "
          f"({d['bytes'] / d['read_seconds'] / 1e9:.1f} GB/s) | {d['read_seconds'] / t['flashcupy'] * 100:.0f} % | "
          f"{ratio_cell} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
