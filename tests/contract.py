"""The contract every backend keeps: one table over backends x kernel paths x dtypes x shapes x
modifiers, and one helper that checks a row against the float64 oracle.

`table(backend)` gives the rows of one backend as pytest params; `check(row, rng)` runs the row's
forward and backward through the public API (flashcupy.attention, attention_backward, the backward
with a gradient of lse too: dlse) and checks the results' dtypes and shapes, that rows which see no
key give out 0, lse -inf and dq 0 (never NaN, though their dlse is NaN), and every output against
the oracle through conftest.assert_matches_oracle, whose tolerance
charges the backend's own kernel family only. test_contract_numpy.py, test_contract_cupy.py and
test_contract_numba.py each run one backend's rows (a file each: pytest-xdist puts a file's tests
on one worker, and the emulator and simulator rows are the slow ones); the context a row needs
(the emulator, the NumPy backend's K/V path, tensor cores on or off) is entered by `check` itself.

A new backend adds its entries to BACKENDS and CONTEXTS and a test_contract_<name>.py of a few lines.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import pytest

import flashcupy
from conftest import BF16, CASES, assert_matches_oracle, bf16_bits, case_id, make_qkv
from modifier_checks import modifier_cases

# Shapes the simulators afford (Numba's runs every CUDA thread as a Python thread), chosen against
# the numba kernels' simulator tiles (BLOCK_M 4, BLOCK_N 2, D_TILE 8): lengths 1, 5, 17 leave
# partial tiles; head_dim 1, 3, 40 (40: five D_TILE chunks, partial register lanes).
# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal)
SIMULATOR_CASES = (
    (1, 1, 1, 1, 1, 1, False),
    (2, 5, 5, 2, 2, 3, True),
    (1, 5, 17, 2, 1, 40, True),      # Sq < Sk, MQA, several head-dim chunks
    (1, 17, 5, 4, 2, 3, True),       # Sq > Sk: rows 0..11 see no key, GQA
    (2, 5, 17, 3, 3, 1, False),
)

# The modifiers column: none on every shape; every modifier at once (window, softcap, ALiBi, a bias
# with its gradient, a mask; modifier_checks.modifier_cases' "all-causal", and "all" where rows are
# cheap) on one shape per backend, kernel path and dtype, with MQA, Sq < Sk and a head_dim the
# tensor-core kernels take. Each modifier alone, and attention_probs, are in the modifier files.
# cupy has no modifier rows here: each is a kernel specialisation the emulator builds with g++ (5-16 s
# a row, 50 s in all on a cold cache), and test_cupy_modifiers.py runs "all" and "all-causal" on both
# kernel paths in every dtype already.
MODIFIED_CASE = (1, 7, 9, 2, 1, 8, False)  # causal comes from the modifiers; small for the simulator

# v's head_dim unlike q's and k's (an eighth element), larger and smaller, on the paths of a backend
# that takes it (Backend.head_dim_v): GQA with Sq < Sk, and Sq > Sk under causal (rows that see no key);
# the simulator's with a head dim of several D_TILE chunks against one of a partial chunk.
HEAD_DIM_V_CASES = (
    (1, 9, 14, 4, 2, 16, True, 40),
    (2, 13, 6, 2, 1, 40, True, 8),
    (1, 7, 7, 2, 2, 8, False, 24),
)
SIMULATOR_HEAD_DIM_V_CASES = (
    (1, 5, 17, 2, 1, 3, True, 17),
    (1, 17, 5, 4, 2, 40, True, 3),
)


# Dropout (README, Semantics): its rows run MODIFIED_CASE with dropout_p and a seed of two words, alone
# ("dropout") and with every modifier ("dropout+all-causal"), on the paths and dtypes of Backend.dropout;
# tests/test_dropout.py has the rule's own tests, the kernels' slips, split-KV and packed batches.
DROPOUT = dict(dropout_p=0.25, dropout_seed=2**33 + 17)


@dataclass(frozen=True)
class Backend:
    """One backend's columns: its kernel paths ({name: dtypes}), shapes, and the context a path runs in."""

    paths: dict
    cases: tuple
    orders: tuple = (None,)  # the emulator's thread orders (cupy): each plain row runs under each
    modified: tuple = ("all-causal",)  # modifier_cases' combinations run on MODIFIED_CASE
    head_dim_v: tuple = ()  # the paths that run value_cases, with the first order alone
    value_cases: tuple = HEAD_DIM_V_CASES
    dropout: tuple = ()  # (path, dtype, rows: names of check's dropout rows), with the first order alone


@contextlib.contextmanager
def _numpy_path(path):
    """The NumPy backend's two ways of reading K and V (tiles smaller than the shapes either way):
    copied into Kᵀ and [V | 1] with the lazy softmax, or read where they lie with the eager one."""
    from flashcupy.backends import numpy_backend
    saved = (numpy_backend.config.BLOCK_M, numpy_backend.config.BLOCK_N, numpy_backend.config.NUM_THREADS,
             numpy_backend.plan.IN_PLACE_ROWS)
    numpy_backend.configure(block_m=16, block_n=8, num_threads=2)
    numpy_backend.plan.IN_PLACE_ROWS = 0 if path == "copied" else 10**9
    try:
        yield
    finally:
        (numpy_backend.config.BLOCK_M, numpy_backend.config.BLOCK_N, numpy_backend.config.NUM_THREADS,
         numpy_backend.plan.IN_PLACE_ROWS) = saved


@contextlib.contextmanager
def _cupy_path(path, order):
    """The cupy kernels on the CPU emulator, threads in `order`: "simt" (tensor cores off), "tensor-core"
    (the mma.sync kernels, on an sm_80 device) or "hopper" (on an sm_90 device: the Hopper forward and
    backward)."""
    from flashcupy.backends import cupy_backend
    from flashcupy.backends.cupy_backend import specs
    from flashcupy.tools.emulator.cupy import emulated
    saved = cupy_backend.USE_TENSOR_CORES
    cupy_backend.USE_TENSOR_CORES = path != "simt"
    try:
        with emulated(order, compute_capability=specs.SM90_COMPUTE_CAPABILITY if path == "hopper" else 80):
            yield
    finally:
        cupy_backend.USE_TENSOR_CORES = saved


CONTEXTS = {
    "numpy": lambda path, order: _numpy_path(path),
    "cupy": _cupy_path,
    "numba": lambda path, order: contextlib.nullcontext(),  # the simulator or a GPU: numba_device.py decides
}

# dtypes: "bfloat16" as ml_dtypes arrays, "bfloat16-bits" as uint16 bit patterns with dtype="bfloat16"
# (what CuPy users pass). The in-place K/V path of the NumPy backend serves float16 to float64.
BACKENDS = {
    "numpy": Backend({"copied": ("float16", "bfloat16", "bfloat16-bits", "float32", "float64"),
                      "in-place": ("float16", "float32", "float64")}, CASES, modified=("all", "all-causal"),
                     head_dim_v=("copied", "in-place"),
                     dropout=tuple((path, dtype, ("dropout", "dropout+all-causal")) for path, dtype in (
                         ("copied", "float16"), ("copied", "bfloat16-bits"), ("copied", "float32"),
                         ("copied", "float64"), ("in-place", "float32")))),
    # cupy's dropout rows are plain ones (each modifier set is a specialisation the emulator builds: see
    # MODIFIED_CASE); an sm_90 device sends them to the Hopper kernels
    "cupy": Backend({"hopper": ("float16", "bfloat16-bits"), "tensor-core": ("float16", "bfloat16-bits"),
                     "simt": ("float16", "bfloat16-bits", "float32", "float64")}, CASES,
                    orders=("ascending", "descending"), modified=(), head_dim_v=("tensor-core", "simt"),
                    dropout=tuple((path, dtype, ("dropout",)) for path, dtype in (
                        ("hopper", "float16"), ("tensor-core", "bfloat16-bits"), ("simt", "float32"),
                        ("simt", "float64")))),
    "numba": Backend({"simt": ("float16", "float32", "float64")}, SIMULATOR_CASES, head_dim_v=("simt",),
                     value_cases=SIMULATOR_HEAD_DIM_V_CASES,
                     dropout=(("simt", "float32", ("dropout", "dropout+all-causal")),
                              ("simt", "float64", ("dropout",)))),
}


@dataclass(frozen=True)
class Row:
    backend: str
    path: str
    order: str | None
    dtype: str
    case: tuple
    modifiers: str | None

    def __str__(self):
        return "-".join(str(x) for x in (self.path, self.order, self.dtype, case_id(self.case), self.modifiers)
                        if x is not None)


def table(backend: str, cases=None, modified=True, marks=(), prefix="") -> list:
    """The rows of one backend, as pytest params (id: [prefix-]path-order-dtype-shape[-modifiers]);
    cases: other shapes than the backend's own (a GPU's numba runs CASES too); modified=False: no
    modifier rows."""
    b = BACKENDS[backend]
    rows = [Row(backend, path, order, dtype, case, None) for path, dtypes in b.paths.items()
            for order in b.orders for dtype in dtypes for case in (b.cases if cases is None else cases)]
    rows += [Row(backend, path, order, dtype, MODIFIED_CASE, name)
             for path, dtypes in b.paths.items() for order in b.orders[:1] for dtype in dtypes
             for name in (b.modified if modified else ())]
    rows += [Row(backend, path, b.orders[0], dtype, case, None) for path in b.head_dim_v for dtype in b.paths[path]
             for case in (b.value_cases if cases is None else ())]
    rows += [Row(backend, path, b.orders[0], dtype, MODIFIED_CASE, name) for path, dtype, names in b.dropout
             for name in (names if modified and cases is None else ())]
    return [pytest.param(row, id=prefix + str(row), marks=marks) for row in rows]


def check(row: Row, rng) -> None:
    """Forward and backward of one row against the oracle (module docstring)."""
    B, Sq, Sk, Hq, Hkv, D, causal = row.case[:7]
    Dv = row.case[7] if len(row.case) > 7 else D
    bits = row.dtype == "bfloat16-bits"
    values = BF16 if row.dtype.startswith("bfloat16") else np.dtype(row.dtype)
    q, k, v = make_qkv(rng, B, Sq, Sk, Hq, Hkv, D, values, head_dim_v=Dv)
    dout = rng.standard_normal((B, Sq, Hq, Dv)).astype(values)
    kw = dict(causal=causal)
    name = row.modifiers
    if name is not None and name.startswith("dropout"):  # "dropout", or "dropout+" modifier_cases' name
        kw.update(DROPOUT)
        name = name.partition("+")[2] or None
    if name is not None:
        kw.update(modifier_cases(rng, (B, Sq, Sk, Hq, Hkv, D), values)[name])
    ref = dict(kw)
    args = q, k, v, dout
    if bits:
        args = tuple(bf16_bits(x) for x in args)
        kw["dtype"] = ref["dtype"] = "bfloat16"
        if kw.get("bias") is not None and kw["bias"].dtype == BF16:
            kw["bias"] = bf16_bits(kw["bias"])
    with CONTEXTS[row.backend](row.path, row.order):
        out, lse = flashcupy.attention(*args[:3], return_lse=True, backend=row.backend, **kw)
        dlse = np.where(np.isneginf(lse), np.nan, rng.standard_normal(lse.shape)).astype(lse.dtype)
        grads = flashcupy.attention_backward(args[3], *args[:3], out, lse, backend=row.backend, dlse=dlse, **kw)
        got = (out, lse, *grads)
        assert out.dtype == args[0].dtype and out.shape == (B, Sq, Hq, Dv)
        assert lse.dtype == (np.float64 if row.dtype == "float64" else np.float32) and lse.shape == (B, Hq, Sq)
        for g, x in zip(grads, (*args[:3], kw.get("bias"))):
            assert g.dtype == x.dtype and g.shape == x.shape
        if causal and Sq > Sk and row.modifiers is None:  # rows that see no key: out 0, lse -inf, dq 0
            hidden = slice(0, Sq - Sk)
            assert np.all(out[:, hidden] == 0) and np.all(np.isneginf(lse[:, :, hidden]))
            assert np.all(grads[0][:, hidden] == 0) and not any(np.isnan(x).any() for x in got)
        # inside the context: the kernel family is decided with the row's settings (tensor cores on or off)
        assert_matches_oracle(got, q, k, v, dout, backend=row.backend, dlse=dlse, **ref)
