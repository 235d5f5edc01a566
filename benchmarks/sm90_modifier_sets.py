"""Every set of score modifiers the Hopper forward and backward take (specs.SM90_FORWARD_MODS,
SM90_BACKWARD_MODS, and a packed batch's: SM90_VARLEN_FORWARD_MODS, SM90_VARLEN_BACKWARD_MODS), at every
head-dim bucket and its tile (specs.sm90_forward_tile, sm90_backward_tile), the backward deterministic or
not, compiled for sm_90a by each NVRTC found: registers, spills and HGMMA, then the kernels that spill.
CPU only; about five minutes an NVRTC.

    python benchmarks/sm90_modifier_sets.py [OUT.md] [--dtype float16]

The NVRTC report (`python -m flashcupy kernels --every-modifier-set`) compiles the same and every
tensor-core kernel besides; CI compiles three sets a bucket (catalog.sm90_modules). Writes OUT.md
(the table, with the command and commit) when given.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's flashcupy

from flashcupy.backends.cupy_backend import catalog, specs
from flashcupy.tools import nvrtc


def _default_tile(module) -> bool:
    """Whether a Hopper module's kernel has the tile the rule gives (not the wide or tall blocks of the
    switches)."""
    if module.source_file == "flash_fwd_sm90.cu":
        k = module.kernels[0]
        return (k.block_m, k.block_n) == specs.sm90_forward_tile(k.head_dim, k.mods, varlen=k.varlen)
    k = module.kernels[1]  # the dK/dV kernel
    return (k.block_m, k.block_n) == specs.sm90_backward_tile(k.head_dim, k.mods)


def modifier_modules(dtype: str) -> list:
    """The Hopper forwards and backwards of one batch and of a packed one, every set of modifiers each
    bucket takes, at the tiles the rule gives."""
    return [m for m in catalog.sm90_modules((dtype,), every_modifier_set=True) if _default_tile(m)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", help="write the table here too (markdown)")
    ap.add_argument("--dtype", default="float16", choices=specs.TC_DTYPES)
    args = ap.parse_args(argv)
    modules = modifier_modules(args.dtype)
    reports = {f"NVRTC {t.version}, {specs.SM90_ARCH}": nvrtc.kernel_report(specs.SM90_ARCH, t, modules)
               for t in nvrtc.toolkits()}
    table = nvrtc.format_kernel_report(reports)
    exceeded = [f"{heading}: {line}" for heading, rows in reports.items() for line in nvrtc.limits_exceeded(rows)]
    verdict = "\n".join(["over the limits:"] + exceeded) if exceeded else (
        f"{len(modules)} kernels an NVRTC: none spills or takes more than "
        f"{nvrtc.MAX_REGISTERS - nvrtc.REGISTER_MARGIN} registers")
    print(table + "\n\n" + verdict)
    if args.out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(f"# The Hopper forward and backward with every set of modifiers they take\n\nCommand: `python "
                    f"benchmarks/sm90_modifier_sets.py {args.out} --dtype {args.dtype}` at commit {commit} "
                    f"(CPU only: NVRTC, sm_90a).\n\n```\n{table}\n```\n\n{verdict}\n")
    return 1 if exceeded else 0


if __name__ == "__main__":
    sys.exit(main())
