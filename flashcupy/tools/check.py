"""Every backend against the float64 oracle on the shared battery (`check`, the GPU report)."""

from __future__ import annotations

import os
import sys

import numpy as np

import flashcupy
from flashcupy import backends


def oracle():
    """The float64 oracle from the source tree's reference/ (it is not installed)."""
    try:
        import reference
        import reference.compare
        return reference
    except ImportError:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        if os.path.isdir(os.path.join(root, "reference")):
            sys.path.insert(0, root)
            import reference
            import reference.compare
            return reference
    return None


def _to_backend_arrays(name, arrays):
    """The arrays as the backend's users hold them: cupy's through its runtime (device arrays, or
    NumPy where the tests' emulator stands in for the GPU); CuPy arrays for numba where CuPy has a
    GPU, else NumPy (which numba copies to the device and back)."""
    from flashcupy.backends import cupy_backend
    if name == "cupy":
        xp = cupy_backend._runtime().xp
        return [xp.asarray(a) for a in arrays]
    if name == "numba" and cupy_backend.runtime is None and backends.unavailable_reason("cupy") is None:
        import cupy
        return [cupy.asarray(a) for a in arrays]
    return arrays


def _to_numpy(x):
    return x.get() if hasattr(x, "get") else (x.copy_to_host() if hasattr(x, "copy_to_host") else x)


def default_check_dtypes() -> tuple:
    """Every dtype; bfloat16 only where ml_dtypes is installed (extra `bf16`)."""
    try:
        import ml_dtypes  # noqa: F401
    except ImportError:
        return ("float16", "float32", "float64")
    return ("float16", "bfloat16", "float32", "float64")


def _inputs(rng, dtype: str, shapes):
    """Random arrays of `dtype`; bfloat16 as ml_dtypes arrays (the oracle reads them directly)."""
    dt = backends.bfloat16_dtype() if dtype == "bfloat16" else np.dtype(dtype)
    return [rng.standard_normal(s).astype(dt) for s in shapes]


# Cases past the battery's plain attention, for what a GPU runs on code paths of its own: (battery-style
# case, options) with v's head dim apart from q's and k's (MLA's 192 and 128 scaled down: the tensor-core
# kernels pad the smaller one), dropout (the keep mask drawn on the device), and a window with the
# softcap and ALiBi.
FEATURE_CASES = (
    ((1, 17, 33, 4, 2, 48, True), dict(head_dim_v=32)),
    ((2, 19, 19, 2, 1, 64, False), dict(dropout_p=0.2, dropout_seed=2**40 + 7)),
    ((1, 24, 40, 2, 2, 32, False), dict(window=(5, 3), softcap=4.0, alibi_slopes=(0.5, 0.25))),
)


def check_case(ref, name, dtype, case, rng, options=None):
    """One backend on one battery case in one dtype against the oracle: a dict with `worst`
    (the largest error / tolerance over out, lse, dq, dk, dv) and `ok`, or `error` where a
    -inf / NaN pattern differs. Other exceptions (a CUDA error, say) propagate to the caller.
    options: FEATURE_CASES' keywords (head_dim_v: v's own; alibi_slopes as a tuple).

    bfloat16 reaches the cupy backend as uint16 bits with dtype="bfloat16", as CuPy users pass it.
    """
    B, Sq, Sk, Hq, Hkv, D, causal = case
    options = dict(options or {})
    Dv = options.pop("head_dim_v", D)
    q, k, v, dout = _inputs(rng, dtype, ((B, Sq, Hq, D), (B, Sk, Hkv, D), (B, Sk, Hkv, Dv), (B, Sq, Hq, Dv)))
    if "alibi_slopes" in options:
        options["alibi_slopes"] = np.asarray(options["alibi_slopes"], np.float32)
    want = ref.compare.expected(q, k, v, dout, causal=causal, **options)
    bits = dtype == "bfloat16" and name == "cupy"
    if "alibi_slopes" in options:
        options["alibi_slopes"] = _to_backend_arrays(name, [options["alibi_slopes"]])[0]
    kw = dict(causal=causal, backend=name, dtype="bfloat16" if bits else None, **options)
    dq_, dk_, dv_, ddout = _to_backend_arrays(name, [x.view(np.uint16) if bits else x for x in (q, k, v, dout)])
    row = {"backend": name, "dtype": dtype, "case": case, "options": _label(Dv, D, options)}
    try:
        out, lse = flashcupy.attention(dq_, dk_, dv_, return_lse=True, **kw)
        grads = flashcupy.attention_backward(ddout, dq_, dk_, dv_, out, lse, **kw)
        got = [_to_numpy(x) for x in (out, lse, *grads)]
        row["worst"] = max(ref.compare.error_ratio(g, want, name)
                           for name, g in zip(("out", "lse", "dq", "dk", "dv"), got))
        row["ok"] = row["worst"] <= 1.0
    except AssertionError as e:  # -inf / NaN pattern mismatch
        row.update(worst=float("inf"), ok=False, error=str(e))
    return row


def _label(Dv, D, options) -> str:
    """A feature case's options, as the row shows them."""
    shown = ([f"Dv={Dv}"] if Dv != D else []) + [f"{key}={value}" for key, value in options.items()
                                                  if key not in ("dropout_seed", "alibi_slopes")]
    return " ".join(shown + (["alibi"] if "alibi_slopes" in options else []))


def check_rows(ref, names, dtypes, battery, seed=0, features=FEATURE_CASES):
    """check_case for each backend, each dtype it supports, each case of the battery and each of
    the feature cases."""
    rng = np.random.default_rng(seed)
    for name in names:
        for dtype in (d for d in dtypes if d in backends.module(name).DTYPES):
            for case in battery:
                yield check_case(ref, name, dtype, case, rng)
            for case, options in features:
                yield check_case(ref, name, dtype, case, rng, options)


def format_check_row(row) -> str:
    detail = f"{row['worst']:>14.3f}" if "error" not in row else f"  {row['error']}"
    return (f"{row['backend']:<7} {row['dtype']:<8} {str(row['case']):<34} {detail}  "
            f"{'ok' if row['ok'] else 'FAIL'}" + (f"  {row['options']}" if row.get("options") else ""))


CHECK_HEADER = (f"{'backend':<7} {'dtype':<8} {'case (B,Sq,Sk,Hq,Hkv,D,causal)':<34} {'worst err/tol':>14}  result"
                "  (options)")
