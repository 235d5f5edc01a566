"""Do the bfloat16 tensor-core kernels compile to their float16 twins' registers and spills in every
NVRTC report? The evidence behind tests/test_nvrtc.py and tests/test_hopper_nvrtc.py compiling the
bfloat16 tensor-core and Hopper kernels under CuPy's own NVRTC for Hopper (13, sm_90) only.

For each report CI compiles (tests/test_nvrtc.py's REPORTS) and for the Hopper kernels (sm_90a) under
NVRTC 12 and 13: the tensor-core modules of the report (catalog.all_modules, catalog.varlen_modules; for
sm_90a catalog.sm90_modules), float16 and bfloat16 compiled apart and timed; then, per kernel, head_dim
and modifier set, whether the bfloat16 row equals the float16 one (registers, spill bytes, shared
memory, HMMA/HGMMA counts). Prints a Markdown table and writes its rows as JSON.

    python benchmarks/nvrtc_twins.py [--out benchmarks/results/nvrtc_twins.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time

from flashcupy.backends.cupy_backend import catalog
from flashcupy.tools import nvrtc

REPORTS = (("sm_90", 13), ("sm_90", 12), ("sm_80", 12))  # tests/test_nvrtc.py's
HOPPER = (("sm_90a", 13), ("sm_90a", 12))
COLUMNS = ("registers", "spill_bytes", "static_smem", "dynamic_smem", "hmma")


def toolkit_of(major: int) -> nvrtc.Toolkit:
    return next(t for t in nvrtc.toolkits() if t.version.split(".")[0] == str(major))


def tensor_core_modules(arch: str, dtype: str) -> list:
    if arch == "sm_90a":
        return catalog.sm90_modules(dtypes=(dtype,))
    modules = catalog.all_modules() + catalog.varlen_modules()
    return [m for m in modules if any(k.tensor_cores for k in m.kernels) and m.kernels[0].dtype == dtype]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/nvrtc_twins.json")
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    summary, differing = [], []
    for arch, major in REPORTS + HOPPER:
        toolkit = toolkit_of(major)
        rows, seconds = {}, {}
        for dtype in ("float16", "bfloat16"):
            start = time.perf_counter()
            report = nvrtc.kernel_report(arch, toolkit, tensor_core_modules(arch, dtype))
            seconds[dtype] = time.perf_counter() - start
            rows[dtype] = {(r["kernel"], r["mods"], r["head_dim"], r.get("tile")): {c: r.get(c) for c in COLUMNS}
                           for r in report if r["dtype"] == dtype}
        half, brain = rows["float16"], rows["bfloat16"]
        assert half.keys() == brain.keys(), (arch, major, half.keys() ^ brain.keys())
        diff = [(key, half[key], brain[key]) for key in half if half[key] != brain[key]]
        differing += [dict(arch=arch, nvrtc=toolkit.version, kernel=k[0], mods=k[1], head_dim=k[2], tile=k[3],
                           float16=a, bfloat16=b) for k, a, b in diff]
        summary.append(dict(arch=arch, nvrtc=toolkit.version, kernels=len(half), differ=len(diff),
                            most_registers=max(r["registers"] for r in half.values()),
                            seconds_float16=round(seconds["float16"], 1), seconds_bfloat16=round(seconds["bfloat16"], 1)))
        print(summary[-1], flush=True)
    print(f"\nAt {commit}: tensor-core kernels (mma.sync; sm_90a: the Hopper ones), float16 against bfloat16\n")
    print("| arch | NVRTC | kernels per dtype | bfloat16 rows unlike float16 | most registers | seconds, float16 | seconds, bfloat16 |")
    print("|---|---|---|---|---|---|---|")
    for s in summary:
        print(f"| {s['arch']} | {s['nvrtc']} | {s['kernels']} | {s['differ']} | {s['most_registers']} | "
              f"{s['seconds_float16']} | {s['seconds_bfloat16']} |")
    for d in differing:
        print(f"- {d['arch']} NVRTC {d['nvrtc']}: {d['kernel']} {d['head_dim']} {d['mods']} {d['tile']}: "
              f"float16 {d['float16']}, bfloat16 {d['bfloat16']}")
    with open(args.out, "w") as f:
        json.dump(dict(commit=commit, summary=summary, differing=differing), f, indent=1)


if __name__ == "__main__":
    main()
