"""Registers and spills of the mma.sync backward specialised for a v of a head dim of its own
(MOD_HEAD_DIM_V: flash_bwd_tc.cu's V_HEAD_DIM), under NVRTC 12 and 13 for sm_80 and sm_90, beside the same
kernels without it: the figures behind specs.TC_HEAD_DIM_V_BACKWARD_BUCKETS. No GPU needed.

    python benchmarks/head_dim_v_registers.py > benchmarks/results/head_dim_v_registers.md   # a few minutes

The catalog (tests/test_nvrtc.py's kernels) has no such specialisation: this script is their check.
"""

from __future__ import annotations

from dropout_registers import report

from flashcupy.backends.cupy_backend import specs

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


def main() -> int:
    report(modules, "head_dim_v", "Registers and spills of the mma.sync backward specialised for head_dim_v")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
