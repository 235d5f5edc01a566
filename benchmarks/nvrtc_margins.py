"""How far apart do the NVRTC reports CI compiles put the same kernel's registers? The evidence behind
tests/test_nvrtc.py compiling, outside CuPy's own NVRTC for Hopper (PRIMARY, tests/nvrtc_rules.py), only
the kernels that came near the register limit there.

Every kernel specialization the cupy backend launches on mma.sync or SIMT code (catalog.all_modules and
catalog.varlen_modules, every dtype) compiled and timed under each of tests/test_nvrtc.py's REPORTS; then,
per kernel row, its registers and spills in each report beside PRIMARY's. Prints Markdown tables and writes
every row as JSON.

    python benchmarks/nvrtc_margins.py [--out benchmarks/results/nvrtc_margins.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time

from flashcupy.backends.cupy_backend import catalog
from flashcupy.tools import nvrtc

REPORTS = (("sm_90", 13), ("sm_90", 12), ("sm_80", 12))  # tests/test_nvrtc.py's; the first is PRIMARY
COLUMNS = ("registers", "spill_bytes", "hmma")
LIMIT = nvrtc.MAX_REGISTERS - nvrtc.REGISTER_MARGIN


def toolkit_of(major: int) -> nvrtc.Toolkit:
    return next(t for t in nvrtc.toolkits() if t.version.split(".")[0] == str(major))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/nvrtc_margins.json")
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    modules = {"report": catalog.all_modules(), "packed": catalog.varlen_modules()}
    rows, seconds = {}, {}
    for arch, major in REPORTS:
        toolkit = toolkit_of(major)
        report = f"{arch}, NVRTC {toolkit.version}"
        for part, members in modules.items():
            start = time.perf_counter()
            got = nvrtc.kernel_report(arch, toolkit, members)
            seconds[report, part] = time.perf_counter() - start
            for r in got:
                key = (r["kernel"], r["mods"], r["dtype"], r["head_dim"])
                rows.setdefault(key, {"part": part, "tensor_cores": r["kernel"].endswith("_tc") or "_tc_" in r["kernel"]})
                rows[key][report] = {c: r.get(c) for c in COLUMNS}
            print(report, part, len(got), "rows", round(seconds[report, part], 1), "s", flush=True)
    reports = [f"{arch}, NVRTC {toolkit_of(major).version}" for arch, major in REPORTS]
    primary, others = reports[0], reports[1:]
    print(f"\nAt {commit}; the limit: {LIMIT} registers\n")
    print("| report | rows | most registers | spilling | seconds (all modules, packed-batch modules) |")
    print("|---|---|---|---|---|")
    for report in reports:
        regs = [r[report]["registers"] for r in rows.values()]
        spills = sum(1 for r in rows.values() if r[report]["spill_bytes"])
        print(f"| {report} | {len(regs)} | {max(regs)} | {spills} | "
              f"{seconds[report, 'report']:.0f}, {seconds[report, 'packed']:.0f} |")
    print("\n| report | most registers above PRIMARY's | most below | rows above PRIMARY's | "
          "highest PRIMARY figure of a row above it by 8+ |")
    print("|---|---|---|---|---|")
    for report in others:
        deltas = [(r[report]["registers"] - r[primary]["registers"], r[primary]["registers"]) for r in rows.values()]
        above = [d for d in deltas if d[0] > 0]
        far = [p for d, p in deltas if d >= 8]
        print(f"| {report} | {max(d for d, _ in deltas)} | {min(d for d, _ in deltas)} | {len(above)} | "
              f"{max(far) if far else '-'} |")
    print("\nRows PRIMARY puts at or below a threshold, and the most any other report put them at:\n")
    print("| PRIMARY registers at most | rows | most registers elsewhere | spilling elsewhere |")
    print("|---|---|---|---|")
    for threshold in (128, 160, 192, 200, 208, 216, 224, 232):
        low = [r for r in rows.values() if r[primary]["registers"] <= threshold and not r[primary]["spill_bytes"]]
        print(f"| {threshold} | {len(low)} | {max(r[o]['registers'] for r in low for o in others)} | "
              f"{sum(1 for r in low for o in others if r[o]['spill_bytes'])} |")
    with open(args.out, "w") as f:
        json.dump(dict(commit=commit, limit=LIMIT, reports=reports,
                       seconds={f"{k[0]} / {k[1]}": round(v, 1) for k, v in seconds.items()},
                       rows=[dict(kernel=k[0], mods=k[1], dtype=k[2], head_dim=k[3], **v) for k, v in rows.items()]),
                  f, indent=1)


if __name__ == "__main__":
    main()
