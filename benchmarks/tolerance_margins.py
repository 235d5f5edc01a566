"""How close each backend comes to the tolerance rule (reference/compare.py), per dtype and output.

Runs every kernel family on the oracle battery, with the default scale and with a larger one,
and prints the worst error / tolerance seen, each family charged only its own liberties
(reference.compare.kernel_family): the margin a correct kernel keeps (a ratio far below
1 everywhere) and how much room a wrong one has to hide. The CuPy kernels run on the CPU
emulator (flashcupy/tools/emulator/), Numba's on its simulator; nothing needs a GPU.

    python benchmarks/tolerance_margins.py            # a markdown table, a few minutes on 2 cores
    python benchmarks/tolerance_margins.py --family numba
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")  # before numba is imported
sys.path.insert(0, ROOT)  # flashcupy and the oracle (reference/, not installed) of this checkout

import numpy as np  # noqa: E402

import flashcupy  # noqa: E402
from flashcupy.backends import bfloat16_dtype, cupy_backend  # noqa: E402
from reference.compare import BATTERY, error_ratio, expected, kernel_family  # noqa: E402

OUTPUTS = ("out", "lse", "dq", "dk", "dv")
FAMILIES = {  # name: (backend, dtypes, context)
    "numpy": ("numpy", ("float16", "bfloat16", "float32", "float64"), contextlib.nullcontext),
    "cupy SIMT": ("cupy", ("float16", "bfloat16", "float32", "float64"), None),
    "cupy tensor cores": ("cupy", ("float16", "bfloat16"), None),
    "numba": ("numba", ("float16", "float32", "float64"), contextlib.nullcontext),
}


@contextlib.contextmanager
def _cupy(tensor_cores: bool):
    from flashcupy.tools.emulator.cupy import emulated
    saved = cupy_backend.USE_TENSOR_CORES
    cupy_backend.USE_TENSOR_CORES = tensor_cores
    try:
        with emulated():
            yield
    finally:
        cupy_backend.USE_TENSOR_CORES = saved


def worst_ratios(family: str, dtype: str, rng) -> dict:
    backend, _, context = FAMILIES[family]
    context = context or (lambda: _cupy(family.endswith("tensor cores")))
    worst = dict.fromkeys(OUTPUTS, 0.0)
    with context():
        for case in BATTERY:
            B, Sq, Sk, Hq, Hkv, D, causal = case
            for scale in (None, 0.5):
                values = bfloat16_dtype() if dtype == "bfloat16" else np.dtype(dtype)
                q, k, v, dout = (rng.standard_normal(s).astype(values) for s in
                                 ((B, Sq, Hq, D), (B, Sk, Hkv, D), (B, Sk, Hkv, D), (B, Sq, Hq, D)))
                bits = dtype == "bfloat16" and backend != "numpy"
                args = [x.view(np.uint16) if bits else x for x in (q, k, v, dout)]
                kw = dict(causal=causal, scale=scale, backend=backend, dtype="bfloat16" if bits else None)
                out, lse = flashcupy.attention(*args[:3], return_lse=True, **kw)
                grads = flashcupy.attention_backward(args[3], *args[:3], out, lse, **kw)
                family = kernel_family(backend, dtype, D)  # inside the context: USE_TENSOR_CORES as set
                want = expected(q, k, v, dout, causal=causal, scale=scale, dtype=dtype, family=family)
                for name, got in zip(OUTPUTS, (out, lse, *grads)):
                    worst[name] = max(worst[name], error_ratio(got, want, name))
    return worst


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=tuple(FAMILIES), action="append",
                        help="only this kernel family (repeatable; default: all)")
    families = parser.parse_args(argv).family or tuple(FAMILIES)
    rng = np.random.default_rng(0)
    print("| family | dtype | " + " | ".join(OUTPUTS) + " |")
    print("|---|---|" + "---|" * len(OUTPUTS))
    for family in families:
        dtypes = FAMILIES[family][1]
        for dtype in dtypes:
            worst = worst_ratios(family, dtype, rng)
            print(f"| {family} | {dtype} | " + " | ".join(f"{worst[n]:.3f}" for n in OUTPUTS) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
