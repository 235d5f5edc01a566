"""Registers and spills of the cupy kernels specialised for dropout (MOD_DROPOUT), under NVRTC 12 and 13
for sm_80 and sm_90 (the Hopper ones for sm_90a), beside the same kernels without it: the figures behind
specs.DROPOUT_TILES, the forward's tile variant with dropout (specs.tc_tile), philox_word's ROLLED
(mask.cuh) and the Hopper kernels' dropout (specs.sm90_eligible). No GPU needed.

    python benchmarks/dropout_registers.py > benchmarks/results/dropout_registers.md   # a few minutes
    python benchmarks/dropout_registers.py --every-hopper-set   # every set of modifiers: 15 minutes

The catalog (tests/test_nvrtc.py's kernels) has no dropout specialisation: this script is their check.
"""

from __future__ import annotations

import subprocess
import sys
import time

from flashcupy.backends.cupy_backend import specs
from flashcupy.tools import nvrtc

BIAS = specs.MOD_BITS["bias"]


def modules(dropout: bool) -> list:
    """Every kind of kernel a dropout call takes, alone and with every score modifier: the SIMT forward,
    backward and dbias (each dtype and bucket), the tensor-core forward and both backwards (float16 and
    bfloat16, every bucket), split-KV and packed batches' forwards and backwards."""
    extra = specs.MOD_DROPOUT if dropout else 0
    out = []
    for base in (0, specs.ALL_MODS):
        m = base | extra
        for dtype in ("float16", "float32", "float64"):
            for bucket in specs.HEAD_DIM_BUCKETS:
                out += [specs.forward_module(dtype, bucket, m), specs.backward_module(dtype, bucket, m),
                        specs.dbias_module(dtype, bucket, m | BIAS), specs.forward_module(dtype, bucket, m, split=True)]
        for dtype in specs.TC_DTYPES:
            for bucket in specs.TC_HEAD_DIM_BUCKETS:  # those the backend takes to tensor cores
                out.append(specs.tc_forward_module(dtype, bucket, m))
                if specs.tensor_core_eligible(dtype, bucket, m, backward=True):
                    out += [specs.tc_backward_module(dtype, bucket, m),
                            specs.deterministic_tc_backward_module(dtype, bucket, m)]
                if specs.tensor_core_eligible(dtype, bucket, m, split=True):
                    out.append(specs.tc_forward_module(dtype, bucket, m, split=True))
    varlen = specs.MOD_BITS["window"] | specs.MOD_BITS["softcap"] | specs.MOD_BITS["alibi_slopes"] | extra
    for m in (extra, varlen):
        out += [specs.forward_module("float32", b, m, varlen=True) for b in specs.HEAD_DIM_BUCKETS]
        out += [specs.backward_module("float32", b, m, varlen=True) for b in specs.HEAD_DIM_BUCKETS]
        out += [specs.tc_forward_module("float16", b, m, varlen=True) for b in specs.TC_HEAD_DIM_BUCKETS]
        out += [specs.tc_backward_module("float16", b, m, varlen=True) for b in specs.TC_HEAD_DIM_BUCKETS]
    return list(dict.fromkeys(out))


def hopper_modules(dropout: bool) -> list:
    """The Hopper forward and both backwards (float16; sm_90a), one batch's and a packed batch's, at every
    bucket, plain, with every modifier each takes, and with all but the softcap (the forward), the window
    or a bias and the mask (the backward), of those sets the ones sm90_eligible takes (SM90_BACKWARD_SPILLS,
    SM90_DROPOUT_SPILLS), at the tiles sm90_forward_tile and sm90_backward_tile give such calls."""
    extra = specs.MOD_DROPOUT if dropout else 0
    out = []
    for varlen in (False, True):
        for bucket in specs.SM90_FORWARD_TILES:
            allowed = (specs.SM90_VARLEN_FORWARD_MODS if varlen else specs.SM90_FORWARD_MODS)[bucket]
            for m in dict.fromkeys((extra, allowed | extra, (allowed & ~specs.MOD_BITS["softcap"]) | extra)):
                if specs.sm90_eligible("float16", bucket, m, varlen=varlen):
                    out.append(specs.sm90_forward_module("float16", bucket, m, varlen,
                                                         specs.sm90_forward_tile(bucket, m, varlen=varlen)))
        for bucket in specs.SM90_BACKWARD_TILES:
            allowed = specs.SM90_VARLEN_BACKWARD_MODS if varlen else specs.SM90_BACKWARD_MODS
            for m in dict.fromkeys((extra, allowed | extra, (allowed & ~specs.MOD_BITS["window"]) | extra,
                                    (allowed & ~specs.MOD_PAIRS) | extra)):
                if specs.sm90_eligible("float16", bucket, m, backward=True, varlen=varlen):
                    out += [specs.sm90_backward_module("float16", bucket, m, varlen, deterministic,
                                                       specs.sm90_backward_tile(bucket, m))
                            for deterministic in (False, True)]
    return list(dict.fromkeys(out))


def report(modules, name: str, title: str, hopper=None) -> None:
    """For NVRTC 12 and 13, sm_80 and sm_90: the kernels of modules(False) and modules(True) (those with
    the `name` bit in their modifiers, and the helpers both share), a line of counts each and a row for
    each kernel that spills or takes more than 247 registers; then hopper's likewise, for sm_90a. Prints
    markdown, title first."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"# {title} ({time.strftime('%Y-%m-%d')}, commit {commit})\n\n`python {sys.argv[0]}`: every kind of "
          f"kernel (modules()), compiled with CuPy's options; a row for each kernel that spills or takes more than "
          f"247 registers (the catalog's margin, tests/test_nvrtc.py), with or without {name}.\n")
    for major in ("12", "13"):
        toolkit = next((t for t in nvrtc.toolkits() if t.version.startswith(major)), None)
        if toolkit is None:
            print(f"NVRTC {major}: not installed\n")
            continue
        for arch, build in (("sm_80", modules), ("sm_90", modules), ("sm_90a", hopper)):
            for on in (False, True) if build is not None else ():
                rows = nvrtc.kernel_report(arch, toolkit=toolkit, modules=build(on))
                rows = [r for r in rows if (name in (r["mods"] or "")) == on
                        or r["kernel"] in ("flash_bwd_preprocess", "flash_bwd_dq_convert", "flash_merge",
                                           "flash_bwd_dq_convert_sm90", "flash_bwd_dq_convert_sm90_varlen")]
                near = [r for r in rows if r["spill_bytes"] or r["registers"] > 247]
                spills = sum(1 for r in rows if r["spill_bytes"])
                print(f"NVRTC {toolkit.version} {arch}, {'with' if on else 'without'} {name}: {len(rows)} "
                      f"kernels, {spills} spill, {len(near) - spills} more above 247 registers")
                for r in near:
                    print(f"    {r['kernel']} {r['dtype']} {r['head_dim']} {r['mods'] or ''} {r.get('tile') or ''}: "
                          f"{r['registers']} registers, {r['spill_bytes']} spill bytes")
                print()
                sys.stdout.flush()


def every_hopper_set() -> list:
    """The Hopper kernels with dropout (float16) in every set of modifiers sm90_eligible lets them take with
    it, each bucket, one batch and a packed one, both backwards: where SM90_DROPOUT_SPILLS comes from."""
    out = []
    for varlen in (False, True):
        for bucket in specs.SM90_FORWARD_TILES:
            allowed = (specs.SM90_VARLEN_FORWARD_MODS if varlen else specs.SM90_FORWARD_MODS)[bucket]
            out += [specs.sm90_forward_module("float16", bucket, m | specs.MOD_DROPOUT, varlen,
                                              specs.sm90_forward_tile(bucket, m | specs.MOD_DROPOUT, varlen=varlen))
                    for m in range(specs.ALL_MODS + 1) if m & ~allowed == 0
                    and specs.sm90_eligible("float16", bucket, m | specs.MOD_DROPOUT, varlen=varlen)]
        for bucket in specs.SM90_BACKWARD_TILES:
            out += [specs.sm90_backward_module("float16", bucket, m | specs.MOD_DROPOUT, varlen, deterministic,
                                               specs.sm90_backward_tile(bucket, m | specs.MOD_DROPOUT))
                    for m in range(specs.ALL_MODS + 1) for deterministic in (False, True)
                    if specs.sm90_eligible("float16", bucket, m | specs.MOD_DROPOUT, backward=True, varlen=varlen)]
    return out


def sm90_spills(modules, title: str, keep=lambda row: True) -> int:
    """`modules` compiled for sm_90a under NVRTC 12 and 13: per toolkit the kernels (those `keep` takes),
    how many spill, the most registers and the seconds, then each kernel that spills. Returns how many
    spilled, over both toolkits."""
    spilled = 0
    for major in ("12", "13"):
        start = time.time()
        toolkit = next(t for t in nvrtc.toolkits() if t.version.startswith(major))
        rows = [r for r in nvrtc.kernel_report("sm_90a", toolkit=toolkit, modules=modules) if keep(r)]
        spills = [r for r in rows if r["spill_bytes"]]
        spilled += len(spills)
        print(f"NVRTC {toolkit.version} sm_90a, {title}: {len(rows)} kernels, {len(spills)} spill, max registers "
              f"{max(r['registers'] for r in rows)}, {time.time() - start:.0f} s", flush=True)
        for r in spills:
            print(f"    {r['kernel']} {r['head_dim']} {r['mods']} {r.get('tile') or ''}: {r['spill_bytes']} bytes")
    return spilled


def main() -> int:
    if sys.argv[1:] == ["--every-hopper-set"]:  # python benchmarks/dropout_registers.py --every-hopper-set
        sm90_spills(every_hopper_set(), "every set the Hopper kernels take with dropout",
                    lambda r: "dropout" in (r["mods"] or ""))
        return 0
    report(modules, "dropout", "Registers and spills of the kernels specialised for dropout", hopper_modules)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
