"""Registers and spills of the mma.sync backward specialised for a v of a head dim of its own
(MOD_HEAD_DIM_V: flash_bwd_tc.cu's V_HEAD_DIM), under NVRTC 12 and 13 for sm_80 and sm_90, beside the same
kernels without it: the figures behind specs.TC_HEAD_DIM_V_BACKWARD_BUCKETS. No GPU needed.

    python benchmarks/head_dim_v_registers.py > benchmarks/results/head_dim_v_registers.md   # a few minutes
    python benchmarks/head_dim_v_registers.py --hopper   # every Hopper set (sm_90a), spills: 20 minutes

The Hopper kernels take such calls with no specialisation of their own (their tiles at the larger head
dim): --hopper compiles every set they take, with and without dropout (benchmarks/results/sm90_head_dim_v.md).

The catalog (tests/test_nvrtc.py's kernels) has no such specialisation: this script is their check.
"""

from __future__ import annotations

import sys

from dropout_registers import every_hopper_set, report, sm90_spills

from flashcupy.backends.cupy_backend import catalog, specs

VARLEN_MODS = specs.MOD_BITS["window"] | specs.MOD_BITS["softcap"] | specs.MOD_BITS["alibi_slopes"]


def modules(own: bool) -> list:
    """Both backwards (dQ by atomics, and deterministic) in float16 and bfloat16 at every bucket, alone,
    with every score modifier and with dropout, and a packed batch's with its modifiers; own: with
    MOD_HEAD_DIM_V. Every bucket, whether or not TC_HEAD_DIM_V_BACKWARD_BUCKETS takes it."""
    extra = specs.MOD_HEAD_DIM_V if own else 0
    out = []
    for dtype in specs.TC_DTYPES:
        for bucket in specs.TC_HEAD_DIM_BUCKETS:
            for base in (0, specs.ALL_MODS, specs.MOD_DROPOUT):
                if specs.tensor_core_eligible(dtype, bucket, base, backward=True):
                    out += [specs.tc_backward_module(dtype, bucket, base | extra),
                            specs.deterministic_tc_backward_module(dtype, bucket, base | extra)]
    for bucket in specs.TC_HEAD_DIM_BUCKETS:
        out += [specs.tc_backward_module("float16", bucket, m | extra, varlen=True) for m in (0, VARLEN_MODS)]
    return list(dict.fromkeys(out))


def hopper() -> int:
    """Every Hopper module (float16): `python -m flashcupy kernels --arch sm_90 --every-modifier-set`'s and
    the dropout sets' (dropout_registers.every_hopper_set), under NVRTC 12 and 13: kernels, spills, the most
    registers. Returns the kernels that spill."""
    mods = list(dict.fromkeys(catalog.sm90_modules(dtypes=("float16",), every_modifier_set=True)
                              + every_hopper_set()))
    print(f"{len(mods)} Hopper modules (float16, sm_90a)", flush=True)
    return sm90_spills(mods, "every Hopper set")


def main() -> int:
    if sys.argv[1:] == ["--hopper"]:
        return min(hopper(), 100)
    report(modules, "head_dim_v", "Registers and spills of the mma.sync backward specialised for head_dim_v")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
