"""Shared test tables: input generators, and the oracle comparison.

The tolerance rule (one per dtype) lives in reference/compare.py, so the
tests and `python -m flashcupy check` judge results the same way.
"""

from __future__ import annotations

import contextlib
import os
import sys
import types
import zlib

import ml_dtypes
import numpy as np
import pytest
from hypothesis import settings

# Property tests draw the same examples on every run (and no example database carries over between
# runs), so a failure in CI reproduces here; HYPOTHESIS_PROFILE=explore draws fresh ones.
settings.register_profile("reproducible", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", database=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "reproducible"))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # the oracle lives in reference/, which is not installed
    sys.path.insert(0, ROOT)

import flashcupy  # noqa: E402
import reference  # noqa: E402
from reference.compare import BATTERY as CASES, error_ratio, expected, kernel_family  # noqa: E402

DTYPES = (np.float16, np.float32, np.float64)
BF16 = np.dtype(ml_dtypes.bfloat16)  # NumPy's bfloat16 (ml_dtypes); uint16 bits with dtype="bfloat16"


# The files that keep one worker busy longest (the NVRTC reports, the Hopper kernels' emulated runs and
# compiles, Numba's), collected first, longest first (a clean-clone CI at b6ec79b: each over 100
# worker-seconds). Under --dist loadfile a worker takes whole files in collection order (setup.cfg:
# --no-loadscope-reorder), the next when two tests of its own are left; xdist's own order, most tests
# first, started test_gpu_session.py's four tests, some five minutes, last, the other worker idle meanwhile
# (a clean-clone CI at fb89a23: 1,583 s, 1,500 allowed).
SLOW_FIRST = ("test_nvrtc.py", "test_hopper_kernels.py", "test_hopper_nvrtc.py", "test_numba_backend.py",
              "test_tensor_core.py", "test_varlen.py", "test_cupy_modifiers.py", "test_gpu_session.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: n for n, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FIRST)))  # stable: each file's order kept


def bf16_bits(x):
    """A bfloat16 array's bit patterns as uint16, with the same strides (what CuPy users pass)."""
    return x.view(np.uint16)


def bf16_ties(rng, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim):
    """(q, k, v, want): bfloat16 bit patterns (uint16) whose exact attention lies halfway between two
    bfloat16 values in every element, and the oracle's out rounded to nearest even (ml_dtypes), as
    bits. k is zero, so every key weighs the same; v holds a on the first half of the keys and
    b = a + one ulp on the second (a random per kv head and head_dim element, either sign, a's
    last bit even or odd, the first three fixed: see below): out = (a + b) / 2, exact in float32,
    and with two halves' (out, lse) merged, each part's weight is exactly 1/2. A store that rounds
    ties away from zero, or toward it, gets half of these wrong by one ulp, within the oracle's
    tolerance: compare bits."""
    assert seqlen_k % 2 == 0
    q = bf16_bits(rng.standard_normal((batch, seqlen_q, heads_q, head_dim)).astype(BF16))
    k = np.zeros((batch, seqlen_k, heads_kv, head_dim), np.uint16)
    a = rng.integers(0x3F00, 0x4100, (batch, 1, heads_kv, head_dim)).astype(np.uint16)
    a |= rng.choice(np.array([0, 0x8000], np.uint16), a.shape)  # a negative half
    # 0x3F81 and 0x3F82 round up to 0x3F82, 0x3F82 and 0x3F83 down to it, 0x3FFF and 0x4000 into the next binade
    a[..., :3] = 0x3F81, 0x3F82, 0x3FFF
    v = np.empty_like(k)
    v[:, :seqlen_k // 2], v[:, seqlen_k // 2:] = a, a + 1
    out = reference.attention(q, k, v, dtype="bfloat16")
    exact = out.astype(np.float32)
    assert np.all(exact == out) and np.all(exact.view(np.uint32) & 0xFFFF == 0x8000)  # every element a tie
    return q, k, v, bf16_bits(exact.astype(BF16))


def assert_matches_oracle(got, q, k, v, dout=None, *, backend, causal=False, scale=None, dtype=None, **modifiers):
    """Check a backend's (out, lse) or (out, lse, dq, dk, dv), or (out, lse, dq, dk, dv, dbias) with
    a bias, against the oracle, element by element, with the tolerance of reference/compare.py; q,
    k, v, dout as the backend got them (NumPy arrays; bfloat16 as ml_dtypes arrays, or uint16 bits
    with dtype="bfloat16"); modifiers: window, softcap, alibi_slopes, bias, mask as the backend got
    them. backend (required): the backend that computed `got`; the tolerance charges only its kernel
    family's liberties (reference.compare.kernel_family, decided while the test's settings, such as
    cupy_backend.USE_TENSOR_CORES, still hold). None, said explicitly: results that are no one
    kernel's (flashcupy.merge of parts each stored in the storage dtype), charged every family's
    liberties. Returns {output: err/tol}."""
    family = None if backend is None else kernel_family(backend, dtype if dtype is not None else q.dtype,
                                                          np.shape(q)[-1])
    want = expected(q, k, v, dout, causal=causal, scale=scale, dtype=dtype, family=family, **modifiers)
    ratios = {}
    for name, x in zip(("out", "lse", "dq", "dk", "dv", "dbias"), got):
        ratios[name] = error_ratio(x, want, name)
        assert ratios[name] <= 1, f"{name}: error {ratios[name]:.3g} times the tolerance ({want.dtype})"
    return ratios


def assert_tangent_matches_oracle(out_t, lse_t, q, k, v, tangents, *, backend, **keywords):
    """out_t and lse_t (forward mode: flashcupy.jax's jvp) against the oracle's derivatives along
    tangents (q_t, k_t, v_t, any None), with reference/compare.py's tolerance (its forward-mode terms);
    backend None charges every family's liberties. Returns {output: err/tol}."""
    family = None if backend is None else kernel_family(backend, keywords.get("dtype") or q.dtype, np.shape(q)[-1])
    want = expected(q, k, v, family=family, tangents=tangents, **keywords)
    ratios = {}
    for name, x in (("out_t", out_t), ("lse_t", lse_t)):
        ratios[name] = error_ratio(np.asarray(x), want, name)
        assert ratios[name] <= 1, f"{name}: error {ratios[name]:.3g} times the tolerance ({want.dtype})"
    return ratios


def assert_probs_match_oracle(P, P_t, q, k, tangents, rows, *, backend, **keywords):
    """P and P_t (flashcupy.jax.attention_probs and its jvp, lse the forward's) of the query rows `rows`
    against the oracle (reference.attention_probs_jvp), with reference/compare.py's tolerance; tangents
    (q_t, k_t, v_t[, bias_t]). Returns {output: err/tol}."""
    family = None if backend is None else kernel_family(backend, keywords.get("dtype") or q.dtype, np.shape(q)[-1])
    want = expected(q, k, k, family=family, probs=True, tangents=tangents, **keywords)
    ratios = {}
    for name, x in (("P", P), ("P_t", P_t)):
        ratios[name] = error_ratio(np.asarray(x), want, name, rows)
        assert ratios[name] <= 1, f"{name}: error {ratios[name]:.3g} times the tolerance ({want.dtype})"
    return ratios


# Deliberate bugs: each kernel family's tests apply one-line mutations of the kind a kernel change
# introduces (the scale ignored, the wrong kv head, D not subtracted, the causal key range off by
# one, lse in base 2) to its own source, and this fast battery, the same oracle check as every
# test, must fail. A tolerance loose enough to let one through fails there.
# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal, scale): GQA, Sq < Sk and Sq > Sk
# under causal (a partial diagonal, rows that see nothing), a scale other than the default. A
# family's own battery may add cases that end with modifiers: a function of the rng that returns
# the keyword arguments (bias and mask arrays of the case's shapes, ...).
MUTATION_BATTERY = (
    (1, 9, 14, 4, 2, 8, True, None),
    (1, 13, 6, 2, 1, 8, True, 0.7),
    (2, 7, 7, 2, 2, 8, False, 0.3),
)


# Kernels that step over keys a whole tile at a time only notice a loop bound off by one where the
# bound falls one key into a tile: causal with 65 rows and 65 keys puts the last row's last key
# alone at the start of a 64-, 32- or 16-key tile.
TILE_EDGE_CASE = (1, 65, 65, 2, 1, 16, True, None)

# Deliberate bugs in mask.cuh, which the SIMT and the tensor-core kernels share: each family's
# battery (tests/test_cupy_backend.py, tests/test_tensor_core.py) runs them against its own kernels.
MASK_CUH_MUTATIONS = {
    "GQA head mapping": ("h, h / group};", "h, h % (heads_q / group)};"),
    "key_end off by one": ("last_row + 1 + diagonal", "last_row + diagonal"),
}


def battery_fails(backend: str, dtype=np.float32, cases=MUTATION_BATTERY) -> bool:
    """True when some case of `cases` disagrees with the oracle (or cannot run)."""
    rng = np.random.default_rng(0)
    for B, Sq, Sk, Hq, Hkv, D, causal, scale, *modifiers in cases:
        q, k, v = make_qkv(rng, B, Sq, Sk, Hq, Hkv, D, dtype)
        dout = rng.standard_normal(q.shape).astype(dtype)
        kw = modifiers[0](rng) if modifiers else {}
        try:
            out, lse = flashcupy.attention(q, k, v, causal=causal, scale=scale, return_lse=True, backend=backend,
                                           **kw)
            grads = flashcupy.attention_backward(dout, q, k, v, out, lse, causal=causal, scale=scale,
                                                 backend=backend, **kw)
            assert_matches_oracle((out, lse, *grads), q, k, v, dout, backend=backend, causal=causal, scale=scale,
                                  **kw)
        except Exception:  # the oracle check failed, or the mutant could not run
            return True
    return False


def mutation_tests(mutations: dict, backend: str, mutant, plain=contextlib.nullcontext, dtype=np.float32,
                   cases=MUTATION_BATTERY, require=lambda: None):
    """The two tests of a kernel family's deliberate bugs: the battery passes on the family's own
    code (run inside `plain()`), and fails with each mutation {name: (old, new)} applied (run
    inside `mutant(old, new)`); `require()` skips where the family cannot run."""
    def test_the_mutation_battery_passes_unmutated():
        require()
        with plain():
            assert not battery_fails(backend, dtype, cases)

    @pytest.mark.parametrize("name", list(mutations))
    def test_a_mutation_is_caught(name):
        require()
        with mutant(*mutations[name]):
            assert battery_fails(backend, dtype, cases), f"the battery missed: {name}"

    return test_the_mutation_battery_passes_unmutated, test_a_mutation_is_caught


def mutated_module(module, old: str, new: str):
    """A fresh copy of a Python module with `old` (exactly once in its source) replaced by `new`."""
    with open(module.__file__, encoding="utf-8") as f:
        source = f.read()
    assert source.count(old) == 1, f"{old!r} is not in {module.__name__} exactly once"
    copy = types.ModuleType(module.__name__)
    copy.__dict__.update(__file__=module.__file__, __package__=module.__package__)
    exec(compile(source.replace(old, new), module.__file__, "exec"), copy.__dict__)
    return copy


def mutated_compile(old: str, new: str):
    """A compile function for the emulator's emulated(compile=...): each module's source with `old`
    (exactly once, where it occurs at all) replaced by `new`. A slip in a kernel or header that no
    module's source holds leaves every module as it is: the test that expects it caught then fails."""
    from flashcupy.tools.emulator.cupy import compile_module

    def compile(source, names, options, *rest):
        if old in source:
            assert source.count(old) == 1, f"{old!r} occurs {source.count(old)} times"
            source = source.replace(old, new)
        return compile_module(source, names, options, *rest)
    return compile


def mutated_package(package, old: str, new: str):
    """A fresh import of a package, its __init__ and every submodule beside it, with `old` (exactly
    once in all their source) replaced by `new` in the file that holds it. The copy's modules
    import one another, so the mutated line runs wherever the package's code reaches it, however
    the other modules imported it (`from .x import f` included). The package itself, its modules
    in sys.modules and its parent's attribute are left as they were: a test puts the copy in
    sys.modules under the package's name for as long as it needs it, as with mutated_module."""
    import glob
    import importlib
    import importlib.abc
    import importlib.util

    root = os.path.dirname(package.__file__)
    sources = {}
    for path in sorted(glob.glob(os.path.join(root, "*.py"))):
        stem = os.path.splitext(os.path.basename(path))[0]
        with open(path, encoding="utf-8") as f:
            sources[package.__name__ if stem == "__init__" else f"{package.__name__}.{stem}"] = (path, f.read())
    hits = [name for name, (_, text) in sources.items() if old in text]
    assert len(hits) == 1 and sources[hits[0]][1].count(old) == 1, \
        f"{old!r} is not in {package.__name__}'s source exactly once (found in {hits})"
    path, text = sources[hits[0]]
    sources[hits[0]] = (path, text.replace(old, new))

    class Loader(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, search_path=None, target=None):
            if name not in sources:
                return None
            is_package = name == package.__name__
            spec = importlib.util.spec_from_loader(name, self, origin=sources[name][0], is_package=is_package)
            if is_package:
                spec.submodule_search_locations = [root]
            return spec

        def create_module(self, spec):
            return None

        def exec_module(self, module):
            path, text = sources[module.__name__]
            module.__file__ = path
            exec(compile(text, path, "exec"), module.__dict__)

    ours = [name for name in sys.modules if name == package.__name__ or name.startswith(package.__name__ + ".")]
    saved = {name: sys.modules.pop(name) for name in ours}
    parent_name, _, child = package.__name__.rpartition(".")
    parent = sys.modules[parent_name]
    finder = Loader()
    sys.meta_path.insert(0, finder)
    try:
        copy = importlib.import_module(package.__name__)
        for name in sources:
            importlib.import_module(name)  # a submodule the __init__ does not import runs mutated too
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if n == package.__name__ or n.startswith(package.__name__ + ".")]:
            del sys.modules[name]
        sys.modules.update(saved)
        setattr(parent, child, package)
    return copy


def mutate_band(monkeypatch, old: str, new: str) -> None:
    """Apply a deliberate bug to the band rule (flashcupy._problem.Band) for the rest of the test:
    the methods of a copy of the module with `old` replaced by `new` take the place of Band's own,
    so every Problem's band, made before or after, runs the mutant."""
    from flashcupy import _problem
    mutant = mutated_module(_problem, old, new).Band
    for name, attr in vars(mutant).items():
        if callable(attr) and not name.startswith("__"):
            monkeypatch.setattr(_problem.Band, name, attr)


def case_id(case) -> str:
    """A battery case's test id: 1x17x129x4x2x72-causal (1x17x129x4x2x72v40-causal where an eighth
    element, v's head_dim, differs from q's and k's)."""
    value = f"v{case[7]}" if len(case) > 7 and case[7] != case[5] else ""
    return "x".join(map(str, case[:6])) + value + ("-causal" if case[6] else "")


LAYOUTS = ("bshd", "bhsd", "sliced", "reversed")


def strided_empty(shape, dtype, layout="bshd"):
    """An uninitialised (B, S, H, D) array in one of LAYOUTS.

    "bshd" is contiguous; "bhsd" is a transposed view of a contiguous
    (B, H, S, D) array, as users holding that layout pass it; "sliced" takes
    every other element of a larger array, so no stride is contiguous;
    "reversed" has a negative seqlen stride.
    """
    B, S, H, D = shape
    if layout == "bshd":
        return np.empty(shape, dtype)
    if layout == "bhsd":
        return np.empty((B, H, S, D), dtype).transpose(0, 2, 1, 3)
    if layout == "sliced":
        return np.empty((B, 2 * S, H, 2 * D), dtype)[:, ::2, :, ::2]
    if layout == "reversed":
        return np.empty(shape, dtype)[:, ::-1]
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def make_qkv(rng, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype,
             layout="bshd", magnitude=1.0, head_dim_v=None):
    """Random normal q, k, v (times `magnitude`) in the requested layout; v of head_dim_v (None:
    head_dim)."""
    def one(seqlen, heads, dim=head_dim):
        x = strided_empty((batch, seqlen, heads, dim), dtype, layout)
        x[...] = rng.standard_normal(x.shape) * magnitude
        return x

    return one(seqlen_q, heads_q), one(seqlen_k, heads_kv), one(seqlen_k, heads_kv, head_dim_v or head_dim)


@pytest.fixture
def rng(request):
    # one stream per test, reproducible from its id
    seed = zlib.crc32(request.node.nodeid.encode())
    return np.random.default_rng(seed)


# (causal, window) pairs for the visibility helpers of every backend: each side bounded or not,
# windows of 0, causal with and without a left side
BANDS = [(False, None), (True, None), (False, (1, 2)), (False, (0, 0)), (False, (None, 1)), (False, (2, None)),
         (True, (1, None)), (True, (0, 3))]


def band_problem(Sq, Sk, causal, window):
    """A one-head Problem with this band (for the visibility helpers)."""
    from flashcupy._problem import Problem
    left, right = window or (None, None)
    return Problem(batch=1, seqlen_q=Sq, seqlen_k=Sk, heads_q=1, heads_kv=1, head_dim=1, dtype="float32",
                   causal=causal, scale=1.0, carrier=np.dtype(np.float32), window_left=left,
                   window_right=None if causal else right)


@pytest.fixture
def small_tiles():
    """NumPy-backend tiles much smaller than the test lengths, so every path of the tile loop runs."""
    from flashcupy.backends import numpy_backend
    old = (numpy_backend.config.BLOCK_M, numpy_backend.config.BLOCK_N, numpy_backend.config.NUM_THREADS)
    numpy_backend.configure(block_m=16, block_n=8, num_threads=2)
    yield
    numpy_backend.config.BLOCK_M, numpy_backend.config.BLOCK_N, numpy_backend.config.NUM_THREADS = old


class DeviceFunction:
    """A cupy kernel called like the emulator's: NumPy arguments in, NumPy arrays updated in place."""

    def __init__(self, function):
        self.function = function

    def __call__(self, grid, block, args, shared_mem=0):
        import cupy
        on_device = [cupy.asarray(a) if isinstance(a, np.ndarray) else a for a in args]
        if shared_mem:  # opt in: with a kernel's static shared memory the two may pass the default 48 KiB
            self.function.max_dynamic_shared_size_bytes = shared_mem
        self.function(grid, block, on_device, shared_mem=shared_mem)
        cupy.cuda.get_current_stream().synchronize()
        for host, device in zip(args, on_device):
            if isinstance(host, np.ndarray):
                host[...] = device.get()


__all__ = ["DeviceFunction", "BANDS", "BF16", "band_problem", "CASES", "DTYPES", "MUTATION_BATTERY", "TILE_EDGE_CASE", "bf16_bits",
           "bf16_ties", "LAYOUTS", "assert_matches_oracle", "battery_fails", "case_id", "mutate_band", "mutated_module",
           "mutated_package", "mutation_tests", "make_qkv", "reference", "strided_empty"]
