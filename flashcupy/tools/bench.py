"""Side-by-side timing and memory of every available implementation.

Implementations: each available flashcupy backend, a naive NumPy attention
that materialises the full score matrix (the baseline the O(S) memory claim is
measured against), and torch's scaled_dot_product_attention when torch is
installed. All run in one process, one after another, on the same inputs.

TFLOP/s use the FlashAttention papers' count: forward 4·B·H·Sq·Sk·D, halved
when causal, or 4·B·H·D per visible pair with a sliding window; backward 2.5x
the forward.

Score modifiers: a sliding window (`window=(left, right)`) and a (1, H, S, S)
additive bias (whose gradient the backward then computes too) run on the
flashcupy backends and the naive baseline; torch's kernels are left out.

Peak memory is the extra memory a call needs beyond its inputs:
- on the CPU, in a fresh process for each measurement (so no allocator
  history hides anything), the rise of its peak resident set (VmHWM, reset
  through /proc/self/clear_refs) over its resident set during one call, after
  one warm-up call;
- on the GPU, CuPy's or torch's allocator peak.
"""

from __future__ import annotations

import gc
import math
import time
from dataclasses import asdict, dataclass

import numpy as np

import flashcupy
from flashcupy import backends
from flashcupy._problem import Band, attention_flops, default_scale


@dataclass
class Result:
    impl: str
    pass_: str  # "forward" or "backward"
    batch: int
    heads: int
    seqlen: int
    head_dim: int
    causal: bool
    dtype: str
    seconds: float
    tflops: float
    peak_bytes: int | None
    modifiers: str = ""  # e.g. "window=(255, None) bias=(1, H, S, S)"; empty for plain calls

    def as_dict(self):
        return asdict(self)


def flops(batch, heads, seqlen, head_dim, causal, pass_, window=None, head_dim_v=None) -> float:
    """The standard FLOP count (flashcupy._problem.attention_flops) of seqlen queries and keys (v of
    head_dim_v where given)."""
    windowed = window is not None and window != (None, None)
    band = Band.of(seqlen, seqlen, causal, window if windowed else None)
    return attention_flops(batch, heads, head_dim, band, windowed=windowed, backward=pass_ == "backward",
                           head_dim_v=head_dim_v)


def describe_modifiers(window=None, bias=False) -> str:
    parts = ([] if window is None else [f"window=({window[0]}, {window[1]})"]) + (["bias=(1, H, S, S)"] if bias else [])
    return " ".join(parts)


# ----------------------------------------------------------------------------
# memory probes


def _proc_status() -> dict:
    with open("/proc/self/status") as f:
        return {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f)
                if k in ("VmRSS", "VmHWM")}


class HostPeak:
    """Extra resident memory of the process during a block (Linux)."""

    available = True

    def __enter__(self):
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current VmRSS
        self.base = _proc_status()["VmRSS"]
        return self

    def __exit__(self, *exc):
        self.peak = max(0, _proc_status()["VmHWM"] - self.base)


def _fresh_pages_allocator():
    """glibc: allocations of 64 KiB and more get fresh pages, and freed memory goes back at once.

    Without this a call that reuses pages freed by an earlier call would read as
    using no memory at all.
    """
    import ctypes
    libc = ctypes.CDLL("libc.so.6")
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    libc.mallopt(M_MMAP_THRESHOLD, 64 * 1024)
    libc.mallopt(M_TRIM_THRESHOLD, 0)


try:
    _proc_status()
    open("/proc/self/clear_refs", "w").close()
except OSError:
    HostPeak.available = False


# ----------------------------------------------------------------------------
# implementations: each returns (forward(), backward()) closures over fixed inputs


def naive_numpy(q, k, v, dout, causal, scale, window=None, bias=None):
    """Full-matrix attention in the inputs' dtype: the textbook version users write. window and
    bias as flashcupy takes them."""
    Q, K, V, dO = (x.transpose(0, 2, 1, 3) for x in (q, k, v, dout))
    Sq, Sk = Q.shape[2], K.shape[2]
    left, right = (None, None) if window is None else window
    right = 0 if causal else right
    i, j = np.arange(Sq)[:, None] + (Sk - Sq), np.arange(Sk)[None, :]
    mask = None  # the pairs hidden
    if right is not None:
        mask = j > i + right
    if left is not None:
        mask = (j < i - left) if mask is None else mask | (j < i - left)

    def probs():
        S = Q @ K.transpose(0, 1, 3, 2) * scale
        if bias is not None:
            S += bias
        if mask is not None:
            S[..., mask] = -np.inf
        S -= S.max(axis=-1, keepdims=True)
        np.exp(S, out=S)
        S /= S.sum(axis=-1, keepdims=True)
        return S

    def forward():
        return probs() @ V

    def backward():
        P = probs()
        dV = P.transpose(0, 1, 3, 2) @ dO
        dP = dO @ V.transpose(0, 1, 3, 2)
        dP -= np.sum(dP * P, axis=-1, keepdims=True)
        dP *= P  # the gradient of the scores: dbias, summed over the batch
        dbias = () if bias is None else (dP.sum(axis=0, keepdims=True),)
        dP *= scale
        return (dP @ K, dP.transpose(0, 1, 3, 2) @ Q, dV) + dbias

    return forward, backward


TORCH_KERNELS = {"torch-sdpa": None, "torch-flash": "FLASH_ATTENTION", "torch-cudnn": "CUDNN_ATTENTION",
                 "torch-efficient": "EFFICIENT_ATTENTION", "torch-math": "MATH"}


def _torch_sdpa(q, k, v, dout, causal, scale, device, kernel=None, bf16_bits=False, dropout_p=0.0):
    """torch's scaled_dot_product_attention; `kernel` pins one of its backends (SDPBackend name).
    With bf16_bits the arrays hold bfloat16 bit patterns (uint16), viewed as torch.bfloat16. dropout_p:
    torch's own dropout (its generator's mask, not flashcupy's)."""
    import contextlib

    import torch

    def to(x):
        t = torch.from_dlpack(x) if device == "cuda" else torch.from_numpy(np.ascontiguousarray(x))
        if bf16_bits:
            t = t.view(torch.bfloat16)
        return t.permute(0, 2, 1, 3)

    def pinned():
        if kernel is None:
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel
        return sdpa_kernel(getattr(SDPBackend, kernel))

    Q, K, V, dO = (to(x) for x in (q, k, v, dout))
    Q, K, V = (t.detach().requires_grad_() for t in (Q, K, V))

    def forward():
        # torch's is_causal is top-left aligned; our benchmarks use Sq == Sk, where both agree
        with pinned():
            return torch.nn.functional.scaled_dot_product_attention(Q, K, V, is_causal=causal, scale=scale,
                                                                    dropout_p=dropout_p)

    out = forward()

    def backward():
        with pinned():
            return torch.autograd.grad(out, (Q, K, V), dO, retain_graph=True)

    return forward, backward


DROPOUT_SEED = 0x5EED  # closures' flashcupy calls with dropout: any fixed seed (the mask's cost is the same)


def _flashcupy(name, q, k, v, dout, causal, scale, dtype=None, window=None, bias=None, deterministic=False,
               dropout_p=0.0):
    kw = dict(causal=causal, scale=scale, backend=name, dtype=dtype, window=window, bias=bias)
    if dropout_p:
        kw.update(dropout_p=dropout_p, dropout_seed=DROPOUT_SEED)
    out, lse = flashcupy.attention(q, k, v, return_lse=True, **kw)

    def forward():
        return flashcupy.attention(q, k, v, **kw)

    def backward():
        return flashcupy.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic, **kw)

    return forward, backward


def torch_available() -> str | None:
    try:
        import torch  # noqa: F401
    except ImportError:
        return "torch is not installed (pip install torch)"
    return None


def implementations(device: str) -> list[str]:
    """Names runnable here, for 'cpu' or 'cuda' inputs."""
    names = []
    if device == "cpu":
        names.append("numpy")
        if backends.unavailable_reason("numba") is None:
            names.append("numba")
        names.append("naive-numpy")
        if torch_available() is None:
            names.append("torch-sdpa")
    else:
        names += [n for n in ("cupy", "numba") if backends.unavailable_reason(n) is None]
        if torch_available() is None:
            names += ["torch-flash", "torch-cudnn"]
    return names


# ----------------------------------------------------------------------------
# measurement


def sync(device):
    if device == "cuda":
        import cupy
        cupy.cuda.get_current_stream().synchronize()


def best_time(fn, device, repeat: int, min_time: float) -> float:
    """Best time of up to `repeat` calls after one warm-up (which excludes NVRTC compile
    time), stopping once min_time is spent. On the GPU, CUDA events bracket each call."""
    fn()
    sync(device)
    best, spent = math.inf, 0.0
    for _ in range(repeat):
        if device == "cuda":
            import cupy
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            fn()
            end.record()
            end.synchronize()
            dt = cupy.cuda.get_elapsed_time(start, end) / 1e3
        else:
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
        best, spent = min(best, dt), spent + dt
        if spent > min_time:
            break
    return best


def median_gpu_time(fn, repeat: int = 10) -> float:
    """Median seconds of `repeat` calls on the GPU, CUDA events bracketing each, after one warm-up call
    (which excludes NVRTC compile time): the Hopper check scripts' timing (benchmarks/hopper_*_check.py)."""
    import cupy
    fn()
    cupy.cuda.get_current_stream().synchronize()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(repeat):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) / 1e3)
    return sorted(times)[len(times) // 2]


def host_and_back_to_back(fn, calls: int = 8, warm_up: bool = True) -> tuple:
    """(host seconds a call, seconds a call back to back) on the GPU of `calls` calls issued one after
    another, the device idle at the start, after one warm-up call (warm_up). The host's part: the host clock around
    the calls, which return once their launches are queued. Back to back: CUDA events around them all,
    over `calls`: the device's time a call where it outruns the host (the first call's host part
    amortised), the host's where not. Events around each call alone (median_gpu_time, best_time) hold
    both parts."""
    import cupy
    if warm_up:
        fn()
    cupy.cuda.get_current_stream().synchronize()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls
    end.record()
    end.synchronize()
    return host, cupy.cuda.get_elapsed_time(start, end) / 1e3 / calls


def best_alternating(fns: dict, repeat: int = 5) -> dict:
    """{name: best time} of each contender over `repeat` rounds that call them in turn, after one
    warm-up call each: side by side in one run, so that a machine whose speed drifts slows all of
    them alike (CPU timings; a GPU call must synchronise inside fn)."""
    for fn in fns.values():
        fn()
    times = {name: float("inf") for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name] = min(times[name], time.perf_counter() - t0)
    return times


def supports(impl, window=None, bias=False) -> bool:
    """Whether closures() can run impl with these modifiers (torch's kernels are run without)."""
    return impl not in TORCH_KERNELS or (window is None and not bias)


def closures(impl, q, k, v, dout, causal, scale, device, bf16_bits=False, *, window=None, bias=None,
             deterministic=False, dropout_p=0.0):
    """(forward, backward) callables of one implementation over fixed inputs; bf16_bits says the
    arrays hold bfloat16 bit patterns (uint16), as flashcupy's CuPy users pass them. window and
    bias (an array, or None) as flashcupy.attention takes them (see supports); deterministic as
    flashcupy.attention_backward takes it (flashcupy's backends only); dropout_p: flashcupy's dropout
    (seed DROPOUT_SEED) or torch's (naive-numpy has none)."""
    if not supports(impl, window, bias is not None):
        raise ValueError(f"{impl} is timed without score modifiers (window, bias)")
    if impl == "naive-numpy":
        if dropout_p:
            raise ValueError("naive-numpy is timed without dropout")
        return naive_numpy(q, k, v, dout, causal, scale, window, bias)
    if impl in TORCH_KERNELS:
        return _torch_sdpa(q, k, v, dout, causal, scale, device, TORCH_KERNELS[impl], bf16_bits, dropout_p)
    return _flashcupy(impl, q, k, v, dout, causal, scale, "bfloat16" if bf16_bits else None, window, bias,
                      deterministic, dropout_p)


def gpu_peak(fn, impl):
    """Device memory one call adds: torch's allocator peak for torch, CuPy's pool otherwise."""
    if impl in TORCH_KERNELS:
        import torch
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    import cupy
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    base = pool.total_bytes()
    # the pool keeps every block it allocates until free_all_blocks, so its total
    # after the call is its peak during the call
    fn()
    sync("cuda")
    return pool.total_bytes() - base


def _host_peak_child(impl, batch, heads, seqlen, head_dim, causal, dtype, pass_, window=None, bias=False):
    _fresh_pages_allocator()
    q, k, v, dout = make_inputs(batch, heads, seqlen, head_dim, np.dtype(dtype), "cpu")
    b = make_bias(heads, seqlen, np.dtype(dtype), "cpu") if bias else None
    fn = dict(zip(("forward", "backward"), closures(impl, q, k, v, dout, causal, default_scale(head_dim), "cpu",
                                                    window=window, bias=b)))[pass_]
    fn()
    with HostPeak() as probe:
        fn()
    return probe.peak


def peak_bytes(impl, batch, heads, seqlen, head_dim, causal=False, dtype="float32", device="cpu",
               pass_="forward", window=None, bias=False):
    """Memory one call needs beyond its inputs (a bias among them); None where it cannot be measured."""
    if device == "cuda":
        q, k, v, dout = make_inputs(batch, heads, seqlen, head_dim, np.dtype(dtype), device)
        b = make_bias(heads, seqlen, np.dtype(dtype), device) if bias else None
        fn = dict(zip(("forward", "backward"), closures(impl, q, k, v, dout, causal, default_scale(head_dim), device,
                                                        window=window, bias=b)))[pass_]
        fn()
        return gpu_peak(fn, impl)
    if not HostPeak.available:
        return None
    import multiprocessing
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_host_peak_child, (impl, batch, heads, seqlen, head_dim, causal, dtype, pass_, window, bias))


def make_inputs(batch, heads, seqlen, head_dim, dtype, device, seed=0):
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal((batch, seqlen, heads, head_dim)).astype(dtype) for _ in range(4)]
    if device == "cuda":
        import cupy
        arrays = [cupy.asarray(a) for a in arrays]
    return arrays


def make_bias(heads, seqlen, dtype, device, seed=1):
    """A random normal (1, heads, seqlen, seqlen) bias: one per head, shared by the batch."""
    bias = np.random.default_rng(seed).standard_normal((1, heads, seqlen, seqlen)).astype(dtype)
    if device == "cuda":
        import cupy
        bias = cupy.asarray(bias)
    return bias


def run_one(impl, batch, heads, seqlen, head_dim, causal=False, dtype="float32", device="cpu",
            passes=("forward", "backward"), repeat=3, min_time=1.0, memory=True, window=None, bias=False):
    """window: (left, right) or None; bias: whether to add a (1, heads, S, S) bias (make_bias)."""
    q, k, v, dout = make_inputs(batch, heads, seqlen, head_dim, np.dtype(dtype), device)
    b = make_bias(heads, seqlen, np.dtype(dtype), device) if bias else None
    fns = closures(impl, q, k, v, dout, causal, default_scale(head_dim), device, window=window, bias=b)
    results = []
    for pass_, fn in zip(("forward", "backward"), fns):
        if pass_ not in passes:
            continue
        seconds = best_time(fn, device, repeat, min_time)
        peak = peak_bytes(impl, batch, heads, seqlen, head_dim, causal, dtype, device, pass_, window, bias) \
            if memory else None
        tf = flops(batch, heads, seqlen, head_dim, causal, pass_, window) / seconds / 1e12
        results.append(Result(impl, pass_, batch, heads, seqlen, head_dim, causal, str(np.dtype(dtype)),
                              seconds, tf, peak, describe_modifiers(window, bias)))
    return results


def progress(items, desc):
    """tqdm's progress bar when installed, else the plain iterable."""
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=desc, leave=False)


def format_table(results) -> str:
    head = f"{'impl':<12} {'pass':<8} {'B':>2} {'H':>3} {'S':>6} {'D':>4} {'causal':>6} {'dtype':>8} " \
           f"{'ms':>9} {'TFLOP/s':>8} {'peak MiB':>9}"
    mods = any(r.modifiers for r in results)
    if mods:
        head += "  modifiers"
    lines = [head, "-" * len(head)]
    for r in results:
        mem = "n/a" if r.peak_bytes is None else f"{r.peak_bytes / 2**20:.1f}"
        lines.append(f"{r.impl:<12} {r.pass_:<8} {r.batch:>2} {r.heads:>3} {r.seqlen:>6} {r.head_dim:>4} "
                     f"{str(r.causal):>6} {r.dtype:>8} {r.seconds * 1e3:>9.2f} {r.tflops:>8.4f} {mem:>9}"
                     + (f"  {r.modifiers}" if mods else ""))
    return "\n".join(lines)


def plot(results, path):
    """Two panels in the FlashAttention papers' style: TFLOP/s and peak memory against seqlen."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_speed, ax_mem) = plt.subplots(1, 2, figsize=(11, 4.2))
    impls = sorted({r.impl for r in results}, key=lambda i: (i not in backends.NAMES, i))
    colors = dict(zip(impls, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for impl in impls:
        name = f"flashcupy {impl}" if impl in backends.NAMES else impl
        for pass_, style in (("forward", "-o"), ("backward", "--s")):
            rs = sorted((r for r in results if (r.impl, r.pass_) == (impl, pass_)), key=lambda r: r.seqlen)
            if not rs:
                continue
            kw = dict(color=colors[impl], label=f"{name} {pass_}")
            ax_speed.plot([r.seqlen for r in rs], [r.tflops for r in rs], style, **kw)
            mem = [(r.seqlen, r.peak_bytes / 2**20) for r in rs if r.peak_bytes]
            if mem:
                ax_mem.plot(*zip(*mem), style, **kw)
    r0 = results[0]
    title = f"B={r0.batch} H={r0.heads} D={r0.head_dim} {r0.dtype}{' causal' if r0.causal else ''}"
    for ax, ylabel in ((ax_speed, "TFLOP/s"), (ax_mem, "peak extra memory (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    ax_mem.set_yscale("log")
    ax_speed.set_title(f"Speed ({title})")
    ax_mem.set_title("Memory beyond the inputs")
    ax_speed.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
