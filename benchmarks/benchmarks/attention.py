"""asv suites: forward and backward of every backend, with naive NumPy and torch SDPA
as reference lines where installed.

Conventions as in numpy's and scipy's suites: `params`/`param_names`, `setup`
raising NotImplementedError to skip a combination (backend unavailable, torch
missing, a size too big for the naive baseline), `time_*` and `peakmem_*`, and
`track_*` for TFLOP/s and for the memory a call needs beyond its inputs.
GPU timings synchronise the stream inside the timed call; the warm-up call in
`setup` keeps NVRTC compile time out of every measurement.
"""

import numpy as np

from flashcupy import backends
from flashcupy._problem import default_scale
from flashcupy.tools import bench

IMPLS = ["numpy", "naive-numpy", "torch-sdpa", "cupy", "numba"]
GPU_IMPLS = {"cupy", "numba"}  # numba reads CuPy arrays in place


def _device(impl):
    return "cuda" if impl in GPU_IMPLS else "cpu"


def _skip_unless_runnable(impl, seqlen, heads):
    if impl in backends.NAMES and backends.unavailable_reason(impl) is not None:
        raise NotImplementedError(backends.unavailable_reason(impl))
    if impl == "torch-sdpa" and bench.torch_available() is not None:
        raise NotImplementedError(bench.torch_available())
    if impl == "naive-numpy" and heads * seqlen * seqlen * 4 > 2**30:
        raise NotImplementedError("the naive baseline's score matrix would exceed 1 GiB")


class _Attention:
    """Shared setup: inputs, closures for both passes, one warm-up call each."""

    params = (IMPLS, [512, 1024, 2048], [64], ["float32"], [False, True])
    param_names = ["impl", "seqlen", "head_dim", "dtype", "causal"]
    batch, heads = 1, 4
    timeout = 300

    def setup(self, impl, seqlen, head_dim, dtype, causal):
        _skip_unless_runnable(impl, seqlen, self.heads)
        device = _device(impl)
        q, k, v, dout = bench.make_inputs(self.batch, self.heads, seqlen, head_dim, np.dtype(dtype), device)
        fwd, bwd = bench.closures(impl, q, k, v, dout, causal, default_scale(head_dim), device)
        self.device = device
        self.fns = {"forward": fwd, "backward": bwd}
        for fn in self.fns.values():
            fn()
        bench.sync(device)

    def _call(self, pass_):
        self.fns[pass_]()
        bench.sync(self.device)

    def _tflops(self, pass_, seqlen, head_dim, causal):
        seconds = bench.best_time(self.fns[pass_], self.device, repeat=3, min_time=0.5)
        return bench.flops(self.batch, self.heads, seqlen, head_dim, causal, pass_) / seconds / 1e12


class _Pass(_Attention):
    """One pass (PASS) of every impl: time_<PASS>, peakmem_<PASS> and track_tflops.

    A subclass names its pass; the time_ and peakmem_ benchmarks, which only differ in what asv
    measures of the same call, are made here under the names asv has always reported
    (Forward.time_forward, Backward.peakmem_backward, ...).
    """

    PASS = None  # "forward" or "backward"

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for kind in ("time", "peakmem"):
            def run(self, *args):
                self._call(self.PASS)

            run.__name__ = f"{kind}_{cls.PASS}"
            run.__qualname__ = f"{cls.__qualname__}.{run.__name__}"
            setattr(cls, run.__name__, run)

    def track_tflops(self, impl, seqlen, head_dim, dtype, causal):
        return self._tflops(self.PASS, seqlen, head_dim, causal)

    track_tflops.unit = "TFLOP/s"


class Forward(_Pass):
    PASS = "forward"

    def track_extra_memory(self, impl, seqlen, head_dim, dtype, causal):
        return bench.peak_bytes(impl, self.batch, self.heads, seqlen, head_dim, causal, dtype,
                                 self.device) / 2**20

    track_extra_memory.unit = "MiB"


class Backward(_Pass):
    PASS = "backward"


class SmallAndCausal(_Attention):
    """The NumPy backend beside torch's CPU SDPA where Python-level overhead and the causal
    diagonal weigh most (issue 16): short sequences, causal masks, both dtypes and head dims, H=8."""

    params = (["numpy", "torch-sdpa"], [256, 512, 1024], [64, 128], ["float32", "float64"], [False, True])
    batch, heads = 1, 8

    def time_forward(self, *args):
        self._call("forward")

    def time_backward(self, *args):
        self._call("backward")

    def track_gflops_forward(self, impl, seqlen, head_dim, dtype, causal):
        return 1e3 * self._tflops("forward", seqlen, head_dim, causal)

    track_gflops_forward.unit = "GFLOP/s"

    def track_gflops_backward(self, impl, seqlen, head_dim, dtype, causal):
        return 1e3 * self._tflops("backward", seqlen, head_dim, causal)

    track_gflops_backward.unit = "GFLOP/s"


class Modifiers:
    """The NumPy backend with a score modifier beside the same call without one (issue 13): a
    causal sliding window (cost should grow with seqlen x window, not seqlen^2), an additive
    bias of shape (1, H, S, S) (target: at most 1.5x the plain call), and the same bias held constant
    (the backward with return_dbias=False: no work on dbias)."""

    params = ([1024, 4096], ["none", "causal", "causal-window-255", "bias", "bias-held"])
    param_names = ["seqlen", "modifier"]
    heads, head_dim = 8, 64
    timeout = 300

    def setup(self, seqlen, modifier):
        import flashcupy
        rng = np.random.default_rng(0)
        q, k, v, dout = (rng.standard_normal((1, seqlen, self.heads, self.head_dim), dtype=np.float32)
                         for _ in range(4))
        bias = (rng.standard_normal((1, self.heads, seqlen, seqlen), dtype=np.float32) if modifier.startswith("bias")
                else None)
        kw = {"none": {}, "causal": dict(causal=True), "causal-window-255": dict(causal=True, window=(255, None)),
              "bias": dict(bias=bias), "bias-held": dict(bias=bias)}[modifier]
        held = {"return_dbias": False} if modifier == "bias-held" else {}
        out, lse = flashcupy.attention(q, k, v, return_lse=True, backend="numpy", **kw)
        self.forward = lambda: flashcupy.attention(q, k, v, backend="numpy", **kw)
        self.backward = lambda: flashcupy.attention_backward(dout, q, k, v, out, lse, backend="numpy", **kw, **held)

    def time_forward(self, seqlen, modifier):
        self.forward()

    def time_backward(self, seqlen, modifier):
        self.backward()


class ShortSequences:
    """A batch of many short sequences on the NumPy backend, which runs it in groups of whole batch
    elements (numpy_backend/packed.py): forward, backward and attention_probs (graph and
    neural-quantum-state sizes)."""

    params = ([(1000, 64, 8, 32), (2000, 16, 4, 32)], ["float32", "float64"])
    param_names = ["batch_seqlen_heads_head_dim", "dtype"]
    timeout = 120

    def setup(self, shape, dtype):
        import flashcupy
        B, S, H, D = shape
        rng = np.random.default_rng(0)
        q, k, v, dout = (rng.standard_normal((B, S, H, D)).astype(dtype) for _ in range(4))
        out, lse = flashcupy.attention(q, k, v, return_lse=True, backend="numpy")
        self.forward = lambda: flashcupy.attention(q, k, v, backend="numpy")
        self.backward = lambda: flashcupy.attention_backward(dout, q, k, v, out, lse, backend="numpy")
        self.probs = lambda: flashcupy.attention_probs(q, k, lse, backend="numpy")

    def time_forward(self, *args):
        self.forward()

    def time_backward(self, *args):
        self.backward()

    def time_attention_probs(self, *args):
        self.probs()


class MemoryGrowth:
    """Extra forward memory against seqlen: flat tiles for flashcupy, S^2 for the naive baseline."""

    params = (["numpy", "naive-numpy", "cupy"], [1024, 2048, 4096, 8192])
    param_names = ["impl", "seqlen"]
    timeout = 300

    def setup(self, impl, seqlen):
        _skip_unless_runnable(impl, seqlen, 1)

    def track_extra_memory(self, impl, seqlen):
        return bench.peak_bytes(impl, 1, 1, seqlen, 64, device=_device(impl)) / 2**20

    track_extra_memory.unit = "MiB"
