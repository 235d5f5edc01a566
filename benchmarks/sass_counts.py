"""Registers, spills, shared memory and SASS instructions of the cupy backend's kernels, for comparing
two versions of the kernel sources: a refactor that should not change the code must leave every row
the same.

    python benchmarks/sass_counts.py OUT.md [--all-mods | --hopper] [--against BEFORE.json]

Compiles for sm_90 with NVRTC 12.9 only (one toolkit and one arch, to stay within minutes; the full
report, `python -m flashcupy kernels`, compiles both NVRTCs and every modifier set): the plain
specialisations (MODS 0: forward, backward, attention_probs, split-KV forward, tensor-core forward and
both backwards) for every dtype and head-dim bucket, and the tensor-core kernels with the window
alone; with --all-mods also every kernel with all score modifiers on; with --hopper instead the Hopper
kernels (catalog.sm90_modules: every specialisation the backend launches on sm_90a, compiled for sm_90a).
Writes OUT.md (a table, with the
command and commit) and OUT.json (the rows); with --against, the rows that differ from BEFORE.json.
The digest is nvrtc.sass_instructions': equal digests are the same instructions.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's flashcupy

from flashcupy.backends.cupy_backend import catalog, specs
from flashcupy.tools import nvrtc

COLUMNS = ("kernel", "mods", "dtype", "head_dim", "tile", "registers", "spill_bytes", "static_smem",
           "dynamic_smem", "threads", "instructions", "sass_digest")


def modules(all_mods: bool) -> list:
    mods = (0, specs.ALL_MODS) if all_mods else (0,)
    tc_mods = (0, specs.MOD_BITS["window"], specs.ALL_MODS) if all_mods else (0, specs.MOD_BITS["window"])
    return catalog.all_modules(mods, tc_mods)


# Kernels that results committed before a rename name as they were then (635338e: one naming scheme)
RENAMED = {"attn_fwd_tc": "flash_fwd_tc", "attn_fwd_tc_wide": "flash_fwd_tc_wide",
           "attn_bwd_dkdv_tc": "flash_bwd_dkdv_tc", "attn_bwd_dq_tc": "flash_bwd_dq_tc",
           "attn_bwd_dq_convert": "flash_bwd_dq_convert"}
FIELDS = ("registers", "spill_bytes", "static_smem", "dynamic_smem", "threads", "instructions", "sass_digest")


def key(row: dict) -> str:
    """A kernel's identity across versions: template (today's name), variant, dtype, head_dim; not its
    name expression, whose tile and bounds arguments a refactor may respell."""
    kernel = RENAMED.get(row["kernel"], row["kernel"])
    return f"{kernel}[{row['mods'] or ''}] {row['dtype']} {row['head_dim']}"


def differences(before_rows, rows) -> list:
    """A line for each kernel of `rows` that is new or differs from `before_rows` in FIELDS."""
    before, after = {key(r): r for r in before_rows}, {key(r): r for r in rows}
    lines = []
    for name in sorted(after):
        a, b = before.get(name), after[name]  # a subset of BEFORE's kernels may be compiled
        if a is None:
            lines.append(f"{name}: new")
        elif any(a[c] != b[c] for c in FIELDS):
            lines.append(f"{name}: " + ", ".join(f"{c} {a[c]} -> {b[c]}" for c in FIELDS if a[c] != b[c]))
    return lines


def markdown(rows, title: str) -> str:
    lines = [title, "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join("-" if r.get(c) is None else str(r[c]) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="OUT.md (OUT.json is written beside it)")
    parser.add_argument("--all-mods", action="store_true", help="also every kernel with all modifiers on")
    parser.add_argument("--hopper", action="store_true", help="the Hopper kernels (sm_90a) instead")
    parser.add_argument("--against", help="a JSON of an earlier run: print the rows that differ")
    args = parser.parse_args(argv)
    arch = specs.SM90_ARCH if args.hopper else "sm_90"

    toolkit = next((t for t in nvrtc.toolkits() if t.version == "12.9"), None)
    if toolkit is None:
        sys.exit("NVRTC 12.9 is not installed (pip install nvidia-cuda-nvrtc-cu12==12.9.* nvidia-cuda-runtime-cu12)")
    rows = nvrtc.kernel_report(arch, toolkit, catalog.sm90_modules() if args.hopper else modules(args.all_mods),
                               instructions=True)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    commit = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "flashcupy"], capture_output=True,
                           text=True).stdout.strip()
    command = "python benchmarks/sass_counts.py " + " ".join(argv if argv is not None else sys.argv[1:])
    title = (f"# SASS of the cupy backend's kernels, {arch}, NVRTC {toolkit.version}\n\n"
             f"`{command}` at commit {commit}{' (with uncommitted changes)' if dirty else ''}.")
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(markdown(rows, title))
    with open(os.path.splitext(args.out)[0] + ".json", "w", encoding="utf-8") as f:
        json.dump({"command": command, "commit": commit, "rows": rows}, f, indent=1)
    print(f"{len(rows)} kernels -> {args.out}")
    if args.against:
        with open(args.against, encoding="utf-8") as f:
            lines = differences(json.load(f)["rows"], rows)
        print("\n".join(lines) if lines else f"every kernel as in {args.against}")


if __name__ == "__main__":
    main()
