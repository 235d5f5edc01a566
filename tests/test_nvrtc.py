"""Every CUDA kernel specialization compiles for sm_80 and sm_90 under NVRTC 12 and NVRTC 13, with
CuPy's options, without spilling and at least REGISTER_MARGIN registers below the limit; the
tensor-core kernels, and the emulator's tensor-core test kernels, compile to HMMA, LDSM and LDGSTS.

Needs no GPU: NVRTC and the CUDA headers of both CUDA majors come from NVIDIA's wheels (the test
extra installs both), ptxas reports registers, spills and shared memory through NVRTC's log
(-Xptxas=-v), nvdisasm gives the SASS. See flashcupy/tools/nvrtc.py for how each NVRTC is found and run.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import pytest
import tensor_core_blocks as blocks

from flashcupy.backends.cupy_backend import catalog, sources, specs
from flashcupy.tools import hardware, nvrtc
from nvrtc_rules import PRIMARY, REPORT_SLACK, TWIN_SLACK

ARCHS = ("sm_80", "sm_90")
CUDA_MAJORS = (12, 13)


def toolkit_of(major: int) -> nvrtc.Toolkit:
    found = [t for t in nvrtc.toolkits() if t.version.split(".")[0] == str(major)]
    assert found, f"no NVRTC {major} among {[t.version for t in nvrtc.toolkits()]}: pip install -e '.[test]'"
    return found[0]


PTXAS_LOG = """\
ptxas info    : 20 bytes gmem
ptxas info    : Compiling entry function '_Z9flash_fwdIffLi64ELi64ELi32EEvPKT_' for 'sm_90'
ptxas info    : Function properties for _Z9flash_fwdIffLi64ELi64ELi32EEvPKT_
ptxas         .     8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 128 registers, used 1 barriers, 8 bytes cumulative stack size, 32768 bytes smem
ptxas info    : Compiling entry function '_Z20flash_bwd_preprocessIffEvPKT_' for 'sm_90'
ptxas info    : Function properties for _Z20flash_bwd_preprocessIffEvPKT_
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 32 registers, used 0 barriers
"""


def test_parse_ptxas():
    info = nvrtc.parse_ptxas(PTXAS_LOG)
    assert info["_Z9flash_fwdIffLi64ELi64ELi32EEvPKT_"] == dict(
        registers=128, spill_stores=4, spill_loads=12, stack=8, static_smem=32768)
    assert info["_Z20flash_bwd_preprocessIffEvPKT_"] == dict(
        registers=32, spill_stores=0, spill_loads=0, stack=0, static_smem=0)


def test_occupancy():
    # 128 threads, 64 registers, no shared memory: 8 CTAs by registers = 32 of 64 warps
    assert nvrtc.occupancy("sm_80", 64, 0, 128) == 0.5
    # 48 KiB (+1 KiB reserved) per CTA: 3 CTAs on an A100 SM, 4 on an H100 SM
    assert nvrtc.occupancy("sm_80", 32, 48 * 1024, 128) == 12 / 64
    assert nvrtc.occupancy("sm_90", 32, 48 * 1024, 128) == 16 / 64
    # the roofline's GPUs name their architectures in the same table
    assert [(gpu.name, gpu.sm) for gpu in hardware.GPUS] == [
        ("A100", hardware.SMS["sm_80"]), ("H100", hardware.SMS["sm_90"]), ("H200", hardware.SMS["sm_90"])]


def test_both_cuda_majors_are_checked():
    toolkits = nvrtc.toolkits()
    majors = [int(t.version.split(".")[0]) for t in toolkits]  # as each worker's NVRTC reports it
    assert majors == list(CUDA_MAJORS), f"NVRTC {[t.version for t in toolkits]}: pip install -e '.[test]'"
    assert nvrtc.cupy_toolkit() in toolkits
    for toolkit, major in zip(toolkits, majors):
        if toolkit.found_by != "cuda-pathfinder":
            nvrtc_wheel, headers_wheel = nvrtc.WHEELS[major]
            assert re.fullmatch(rf"{nvrtc_wheel} {major}\.[\d.]+, {headers_wheel} {major}\.[\d.]+", toolkit.found_by)
        # each NVRTC compiles against the headers of its own CUDA
        with open(f"{toolkit.include}/cuda_runtime_api.h") as f:
            assert re.search(rf"#define CUDART_VERSION\s+{major}\d{{3}}\b", f.read()), toolkit


@pytest.mark.parametrize("major", CUDA_MAJORS, ids=lambda major: f"nvrtc{major}")
def test_cupy_options_reach_nvrtc(major):
    # -ftz=true, which CuPy always passes: ptxas then multiplies with FMUL.FTZ
    toolkit = toolkit_of(major)
    source = 'extern "C" __global__ void mul(float* x) { x[0] = x[1] * x[2]; }'
    options = nvrtc.compile_options("sm_90", toolkit)
    cupys = sources.COMPILE_OPTIONS + sources.CUPY_NVRTC_OPTIONS
    assert options[:len(cupys)] == cupys
    _, lowered, cubin = nvrtc.compile_cubin(source, ["mul"], options, toolkit)
    assert "FMUL.FTZ" in nvrtc.function_sass(nvrtc.sass(cubin), lowered["mul"])
    without = tuple(o for o in options if o != "-ftz=true")
    _, _, cubin = nvrtc.compile_cubin(source, ["mul"], without, toolkit)
    assert "FMUL" in nvrtc.sass(cubin) and "FMUL.FTZ" not in nvrtc.sass(cubin)


def test_limits_exceeded_and_their_marks():
    row = dict(kernel="k", dtype="float16", head_dim=64, tile="64x64", static_smem=0, dynamic_smem=0, threads=128,
               occupancy=0.25, hmma=None)
    limit = nvrtc.MAX_REGISTERS - nvrtc.REGISTER_MARGIN
    rows = [dict(row, registers=limit, spill_bytes=0), dict(row, registers=limit + 1, spill_bytes=0),
            dict(row, registers=100, spill_bytes=8)]
    assert nvrtc.limits_exceeded(rows) == [f"k float16 head_dim=64: {limit + 1} registers, 0 spill bytes",
                                              "k float16 head_dim=64: 100 registers, 8 spill bytes"]
    lines = nvrtc.format_kernel_report({"NVRTC 12.9": rows, "NVRTC 13.0": rows[::-1]}).splitlines()
    assert lines[0].split() == ["NVRTC", "12.9", "NVRTC", "13.0"]
    cells = [line.split()[8:] for line in lines[2:]]  # registers, spill_bytes, occupancy, hmma per NVRTC
    assert [c[:2] + c[4:6] for c in cells] == [[str(limit), "0", "100", "8!"],
                                                [f"{limit + 1}!", "0", f"{limit + 1}!", "0"],
                                                ["100", "8!", str(limit), "0"]]
    # reports of other kernels (kernels --arch sm_90 adds the sm_90a Hopper ones): a table each, whole
    other = [dict(row, kernel="hopper", registers=168, spill_bytes=0)]
    tables = nvrtc.format_kernel_report({"NVRTC 12.9": rows, "NVRTC 13.0": rows, "NVRTC 12.9, sm_90a": other,
                                         "NVRTC 13.0, sm_90a": other}).split("\n\n")
    assert [t.splitlines()[0].split() for t in tables] == [["NVRTC", "12.9", "NVRTC", "13.0"],
                                                           ["NVRTC", "12.9,", "sm_90a", "NVRTC", "13.0,", "sm_90a"]]
    assert [len(t.splitlines()) for t in tables] == [2 + len(rows), 2 + len(other)]


# the reports (REPORTS: minutes of NVRTC each) one after another on this file's worker: each compiles on
# a process per CPU. CuPy's own NVRTC for the Hopper GPUs (PRIMARY) compiles every specialization; the
# others only those near the register limit there, and a sample (compiled_rows, nvrtc_rules.REPORT_SLACK).
# The (arch, NVRTC major) reports CI compiles: three of the four. sm_80 under NVRTC 13 saw no kernel closer
# to the register limit than the others did, neither in the whole report (benchmarks/results/
# nvrtc_bfloat16_simt.md: it bound no row) nor among the packed-batch kernels (benchmarks/results/
# nvrtc_reports.md: every row within 8 registers of the limit there stood as high or higher in sm_80
# under NVRTC 12, but one row two registers above it and below the sm_90 NVRTC 13 figure), and it cost some
# 200 worker-seconds of CI; `python -m flashcupy kernels --arch sm_80` still compiles its whole report
REPORTS = (("sm_90", 13), ("sm_90", 12), ("sm_80", 12))
MODULES = {"all": catalog.all_modules, "packed": catalog.varlen_modules}


def row_key(kernel) -> tuple:
    """A kernel's row in a report, as kernel_report tells rows apart."""
    return kernel.template, nvrtc.variant(kernel), kernel.dtype, kernel.head_dim or None


def key_of(row) -> tuple:
    """A report row's key, as row_key gives a kernel's."""
    return row["kernel"], row["mods"], row["dtype"], row["head_dim"]


def sample(modules) -> list:
    """Each kernel template's first module, and its first with every score modifier: what a report but
    PRIMARY compiles of the kernels far from the limit, so that its NVRTC parses every source and
    instantiates each modifier's code at least once."""
    first = {}
    for m in modules:
        for k in m.kernels:
            first.setdefault((k.template, False), m)
            if k.mods == specs.ALL_MODS:
                first.setdefault((k.template, True), m)
    return list({id(m): m for m in first.values()}.values())


def float16_twin(module):
    """The float16 twin of a tensor-core module in bfloat16, else None."""
    if not any(k.tensor_cores for k in module.kernels) or module.kernels[0].dtype != "bfloat16":
        return None
    return dataclasses.replace(module, kernels=tuple(dataclasses.replace(k, dtype="float16") for k in module.kernels))


@functools.lru_cache(maxsize=None)
def compiled_rows(arch, major, kind) -> tuple:
    """(rows, left out): kernel_report of MODULES[kind] for (arch, major), and the row keys of the kernels
    it left out. PRIMARY compiles them all. Another report the modules holding a kernel whose PRIMARY row
    took more than limit - REPORT_SLACK registers, or spilled, and sample()'s; of those, a bfloat16
    tensor-core module only where its float16 twin took more than limit - TWIN_SLACK there, or spilled."""
    toolkit = toolkit_of(major)
    modules = MODULES[kind]()
    if (arch, major) == PRIMARY:
        return nvrtc.kernel_report(arch, toolkit, modules), frozenset()
    primary = {key_of(r): r for r in compiled_rows(*PRIMARY, kind)[0]}
    limit = nvrtc.MAX_REGISTERS - nvrtc.REGISTER_MARGIN

    def near(module, rows, slack):  # (a row the report lacks counts as near)
        return any(row is None or row["registers"] > limit - slack or row["spill_bytes"]
                   for row in (rows.get(row_key(k)) for k in module.kernels))
    chosen = {id(m) for m in sample(modules)} | {id(m) for m in modules if near(m, primary, REPORT_SLACK)}
    chosen = [m for m in modules if id(m) in chosen]
    rows = nvrtc.kernel_report(arch, toolkit, [m for m in chosen if float16_twin(m) is None])
    got = {key_of(r): r for r in rows}
    rows += nvrtc.kernel_report(arch, toolkit, [m for m in chosen if float16_twin(m) is not None
                                                and near(float16_twin(m), got, TWIN_SLACK)])
    return rows, frozenset({row_key(k) for m in modules for k in m.kernels} - {key_of(r) for r in rows})


def above_primary(what, rows, kind) -> list:
    """The rows of a report (of MODULES[kind]) REPORT_SLACK or more registers above PRIMARY's, as messages:
    were there any, a kernel a report but PRIMARY leaves out could be over the limit there."""
    primary = {key_of(r): r for r in compiled_rows(*PRIMARY, kind)[0]}
    pairs = [(primary[key_of(r)], r) for r in rows]
    return [f"{what}: {b['kernel']}[{b['mods']}] {b['dtype']} {b['head_dim']}: {b['registers']} registers, "
            f"{a['registers']} in PRIMARY's" for a, b in pairs if b["registers"] - a["registers"] >= REPORT_SLACK]


@pytest.fixture(scope="module", params=REPORTS, ids=lambda p: f"{p[0]}-nvrtc{p[1]}")
def report(request):
    arch, major = request.param
    rows, left_out = compiled_rows(arch, major, "all")
    return f"{arch}, NVRTC {toolkit_of(major).version}", rows, left_out


def test_every_specialization_compiles(report):
    what, rows, left_out = report
    simt_dtypes = len(specs.CUDA_TYPES)
    kernels_per_dtype = 1 + 3 * len(specs.HEAD_DIM_BUCKETS)  # preprocess, then fwd, dkdv, dq per bucket
    # each SIMT attention kernel twice (catalog.all_modules): plain and with every score modifier (the
    # preprocess has none); each tensor-core kernel three times, with a window alone as well: a forward
    # (flash_fwd_tc or flash_fwd_tc_wide), flash_bwd_dkdv_tc and flash_bwd_dq_tc per bucket (head_dim 192 and
    # 256 too; their preprocess is the SIMT one), but no backward with the mask where a call never takes one
    # (specs.TC_BACKWARD_MASK_BUCKETS)
    simt, tc = len(catalog.REPORT_MODS), len(catalog.REPORT_TC_MODS)
    masked = sum(m & specs.MOD_BITS["mask"] != 0 for m in catalog.REPORT_TC_MODS)
    unmasked = len(specs.TC_HEAD_DIM_BUCKETS) - len(specs.TC_BACKWARD_MASK_BUCKETS)
    tensor_core = len(specs.TC_DTYPES) * (3 * tc * len(specs.TC_HEAD_DIM_BUCKETS) - 2 * masked * unmasked)
    attention = simt * simt_dtypes * (kernels_per_dtype - 1) + tensor_core
    # flash_pairs.cu: attention_probs per dtype and bucket, as often; dbias with the bias only
    pairs = simt_dtypes * len(specs.HEAD_DIM_BUCKETS) * (simt + 1)
    # the split-KV forwards, plain and with every modifier
    # (on tensor cores with every modifier up to 192 only: specs.TC_SPLIT_PAIRS_BUCKETS)
    split = 2 * simt_dtypes * len(specs.HEAD_DIM_BUCKETS) + len(specs.TC_DTYPES) * (
        len(specs.TC_HEAD_DIM_BUCKETS) + len(specs.TC_SPLIT_PAIRS_BUCKETS))
    # the tensor-core dK/dV kernel that adds dQ by atomics (the default backward), where a call can
    # take it (not with a bias or mask above head_dim 64), and the kernel that converts dQ, per dtype
    atomic = sum(specs.tc_backward_module(dtype, bucket, mods).kernels[1].dq_atomic
                 for mods in catalog.REPORT_TC_MODS for dtype in specs.TC_DTYPES
                 for bucket in specs.TC_HEAD_DIM_BUCKETS)
    assert atomic == len(specs.TC_DTYPES) * (tc * len(specs.TC_HEAD_DIM_BUCKETS) - len(specs.TC_HEAD_DIM_BUCKETS)
                                             + len(specs.TC_ATOMIC_BUCKETS_PAIRS))
    # the preprocess (the tensor-core backwards' too), the KV-cache append and split-KV's merge per dtype, the
    # dQ conversion per tensor-core dtype; each compiled, or left out far from the limit (compiled_rows)
    want = 3 * len(specs.CUDA_TYPES) + attention + pairs + split + atomic + len(specs.TC_DTYPES)
    assert len(rows) + len(left_out) == want
    every = "+".join(specs.MOD_BITS)
    mods = {r["mods"] for r in rows}
    assert mods <= {None, "window", every, "split", every + "+split", "dq_atomic", "window+dq_atomic",
                    every + "+dq_atomic"} and (left_out or len(mods) == 8)
    print(f"\n{what}\n{nvrtc.format_kernel_report({what: rows})}")


def twins_apart(rows) -> list:
    """The bfloat16 tensor-core rows TWIN_SLACK or more registers from their float16 twin's, or with other
    spills, as messages (the pairs `rows` holds)."""
    half = {(r["kernel"], r["mods"], r["head_dim"]): r for r in rows if r["dtype"] == "float16"}
    twins = [(half[key], r) for r in rows if r["dtype"] == "bfloat16" and r["kernel"] in specs.TC_TEMPLATES
             and (key := (r["kernel"], r["mods"], r["head_dim"])) in half]
    return [f"{b['kernel']}[{b['mods']}] {b['head_dim']}: {a['registers']} and {b['registers']} registers, "
            f"{a['spill_bytes']} and {b['spill_bytes']} spill bytes" for a, b in twins
            if abs(a["registers"] - b["registers"]) >= TWIN_SLACK or a["spill_bytes"] != b["spill_bytes"]]


def test_bfloat16_kernels_compile_like_their_float16_twins(report):
    # what lets the reports but PRIMARY leave out most bfloat16 tensor-core kernels (TWIN_SLACK), for every
    # twin the report compiled, all of them in PRIMARY's
    what, rows, _ = report
    apart = twins_apart(rows)
    assert not apart, f"{what}: float16 and bfloat16 apart: " + "; ".join(apart)
    if what.startswith(f"{PRIMARY[0]}, NVRTC {PRIMARY[1]}."):
        tensor_cores = [r for r in rows if r["kernel"] in specs.TC_TEMPLATES]
        assert 2 * len([r for r in tensor_cores if r["dtype"] == "bfloat16"]) == len(tensor_cores)


def test_no_kernel_takes_far_more_registers_than_under_primary(report):
    # what lets the reports but PRIMARY leave out the kernels far from the limit (REPORT_SLACK), for every
    # kernel the report compiled; PRIMARY's compiles them all
    what, rows, left_out = report
    far = above_primary(what, rows, "all")
    assert not far, "; ".join(far)
    if what.startswith(f"{PRIMARY[0]}, NVRTC {PRIMARY[1]}."):
        assert not left_out
    else:  # the kernels near the limit, and the sample
        assert 0 < len(rows) < len(left_out)


def test_no_spills_and_registers_to_spare(report):
    what, rows, _ = report
    limit = nvrtc.MAX_REGISTERS - nvrtc.REGISTER_MARGIN
    over = [f"{r['kernel']}[{r['mods']}] {r['dtype']} head_dim={r['head_dim']}: {r['registers']} registers, "
            f"{r['spill_bytes']} spill bytes" for r in rows if r["spill_bytes"] or r["registers"] > limit]
    assert not over, f"{what}: more than {limit} registers, or spills: " + "; ".join(over)


def test_resources_fit(report):
    what, rows, _ = report
    for r in rows:
        # the SIMT kernels stay within 48 KiB of static shared memory; the tensor-core kernels
        # opt in to more dynamic shared memory (up to 227 KiB on sm_90, 163 KiB on sm_80)
        assert r["static_smem"] <= 48 * 1024 and r["static_smem"] + r["dynamic_smem"] <= 163 * 1024
        assert r["registers"] > 0 and r["occupancy"] > 0
        assert r["threads"] == (32 * specs.WIDE_WARPS if r["kernel"] == "flash_fwd_tc_wide" else specs.NUM_THREADS)


def test_tensor_core_head_dims_between_the_buckets_fit(monkeypatch):
    # a head_dim that is not a multiple of 64 compiles for itself (specs.tc_head_dim: 48, 96), in
    # shared-memory rows of 64 or 128, and asks ptxas for one CTA an SM; the reports cover 64 and 128.
    # Checked where they came closest to the limit: sm_80 under NVRTC 12 (48 with every modifier). And the
    # backward at 200, which computes 224 (two parts of 112 columns) in rows of 256
    modules = [build("float16", d, m) for d in (48, 96) for m in catalog.REPORT_TC_MODS
               for build in (specs.tc_forward_module, specs.tc_backward_module, specs.deterministic_tc_backward_module)]
    modules += [build("float16", 200, m) for m in catalog.REPORT_TC_MODS
                for build in (specs.tc_backward_module, specs.deterministic_tc_backward_module)]
    monkeypatch.setattr(catalog, "all_modules", lambda **_: modules)
    rows = nvrtc.kernel_report("sm_80", toolkit_of(12))
    assert {r["head_dim"] for r in rows if r["kernel"] in specs.TC_TEMPLATES} == {48, 96, 224}
    assert not nvrtc.limits_exceeded(rows), nvrtc.limits_exceeded(rows)


def test_every_forward_with_a_bias_or_mask_fits(monkeypatch):
    # the reports compile a bias and a mask only beside every other modifier; the forward with each of
    # the 24 sets of modifiers that hold one spilled in some under ptxas' own heuristic
    # (specs.TC_TILES["forward", "pairs"]). On sm_80 (where most of them did) under NVRTC 12, in float16
    # (bfloat16 compiled alike): 45 s of CI; `python -m flashcupy kernels --every-modifier-set` does all
    # (at 64 and 128; at 192 and 256 their smaller tiles left room: tile_choices.md)
    modules = [specs.tc_forward_module("float16", d, m) for d in (64, 128)
               for m in range(specs.ALL_MODS + 1) if m & specs.MOD_PAIRS]
    monkeypatch.setattr(catalog, "all_modules", lambda **_: modules)
    rows = nvrtc.kernel_report("sm_80", toolkit_of(12))
    assert len(rows) == len(modules) == 48 and not nvrtc.limits_exceeded(rows), nvrtc.limits_exceeded(rows)


@pytest.mark.parametrize("arch, major", REPORTS, ids=lambda x: str(x))
def test_every_packed_batch_kernel_fits(arch, major):
    # the forward (and split-KV forward: a contiguous KV cache's), dK/dV and dQ kernels for a packed batch
    # (VARLEN: the offsets read and clamped, a binary search per CTA), SIMT and tensor-core (the default and
    # the deterministic backward), without modifiers and with every one attention_varlen takes; as in the
    # reports, all of them in PRIMARY's and those near the limit there in the others' (compiled_rows)
    rows, left_out = compiled_rows(arch, major, "packed")
    # forward, split-KV forward, dK/dV, dQ: 4 SIMT kernels per dtype, bucket and MODS; on tensor cores the two
    # forwards and three backward kernels (two dK/dV kernels) per bucket
    want = 2 * (4 * len(specs.CUDA_TYPES) * len(specs.HEAD_DIM_BUCKETS)
                + len(specs.TC_DTYPES) * 5 * len(specs.TC_HEAD_DIM_BUCKETS))
    packed = [r for r in rows if "varlen" in (r["mods"] or "")]
    assert len(packed) + len([key for key in left_out if "varlen" in (key[1] or "")]) == want
    assert not nvrtc.limits_exceeded(rows), nvrtc.limits_exceeded(rows)
    far = above_primary(f"{arch}, NVRTC {major}", rows, "packed")
    assert not far, "; ".join(far)
    apart = twins_apart(rows)
    assert not apart, f"{arch}, NVRTC {major}: float16 and bfloat16 apart: " + "; ".join(apart)
    assert (not left_out) == ((arch, major) == PRIMARY)


def mmas_per_pass(kernel: str, head_dim: int, block_m: int, block_n: int, rolled: bool = False) -> int:
    """The m16n8k16 mmas one warp issues in one pass of the kernel's loop, its products as in the kernel
    headers: a (16 x n) (n x k) product takes (n / 16) (k / 8) of them. rolled: the backward's S and dP
    products run their k-steps as a loop (with a score modifier, two_mma_abt's ROLLED, and above head_dim
    128), so the code holds one k-step of them; there its other products have head_dim / 2 columns (a CTA
    computes one of two parts, specs.tc_column_parts)."""
    def product(n, k):
        return n // 16 * k // 8
    k_steps = 16 if rolled or head_dim > 128 else head_dim
    if kernel in specs.TC_FORWARD_TEMPLATES:  # S = Q_i K_jᵀ; O += P V_j
        # above head_dim 128 Q_i's k-steps are read from shared memory in a loop (Q_KEPT 0): one in the code
        return product(head_dim if head_dim <= 128 else 16, block_n) + product(block_n, head_dim)
    columns = head_dim // specs.tc_column_parts(head_dim)
    if kernel == "flash_bwd_dkdv_tc":  # Sᵀ, dPᵀ; dV += Pᵀ dO_i, dK += dSᵀ Q_i
        return 2 * product(k_steps, block_m) + 2 * product(block_m, columns)
    return 2 * product(k_steps, block_n) + product(block_n, columns)  # dQ: S, dP; dQ += dS K_j


def test_tensor_core_kernels_run_on_tensor_cores(report):
    # the loops over tiles are unrolled: every mma of a pass is an HMMA of its own in the SASS (but the
    # k-steps of rolled products)
    what, rows, _ = report
    tc = [r for r in rows if r["kernel"] in specs.TC_TEMPLATES]
    assert {r["kernel"] for r in tc} == set(specs.TC_TEMPLATES)
    for r in tc:
        block_m, block_n = map(int, r["tile"].split("x"))
        modified = any(name in (r["mods"] or "").split("+") for name in specs.MOD_BITS)
        want = mmas_per_pass(r["kernel"], r["head_dim"], block_m, block_n, rolled=modified)
        assert r["hmma"] >= want, f"{what}: {r['kernel']} {r['dtype']} {r['head_dim']}: {r['hmma']} HMMA < {want}"
    assert all(r["hmma"] is None for r in rows if r["kernel"] not in specs.TC_TEMPLATES)


# ----------------------------------------------------------------------------
# the tensor-core instructions in the SASS, under CuPy's NVRTC


def compile_for(arch, source_text, names, options=()):
    """{name expression: (ptxas info, SASS text of that function)} from NVRTC and nvdisasm."""
    log, lowered, cubin = nvrtc.compile_cubin(source_text, names, nvrtc.compile_options(arch) + tuple(options))
    info = nvrtc.parse_ptxas(log)
    text = nvrtc.sass(cubin)
    return {name: (info[lowered[name]], nvrtc.function_sass(text, lowered[name])) for name in names}


@pytest.mark.parametrize("arch", ARCHS)
def test_emulator_test_kernels_compile_without_spills(arch):
    for name, (info, _) in compile_for(arch, blocks.source(), blocks.NAMES, (blocks.INCLUDE,)).items():
        assert info["spill_stores"] + info["spill_loads"] == 0, f"{arch} {name}: {info}"


@pytest.mark.parametrize("arch", ARCHS)
def test_tile_matmul_is_cp_async_ldmatrix_and_hmma(arch):
    names = [f"tile_matmul<{t}>" for t in blocks.CUDA_NAME.values()]
    for (name, (_, sass)), dtype in zip(compile_for(arch, blocks.source(), names, (blocks.INCLUDE,)).items(),
                                        ("", ".BF16")):
        assert sass is not None, f"{arch} {name}: not in the disassembly"
        assert re.search(rf"\bHMMA\.16816\.F32{re.escape(dtype)} ", sass), f"{arch} {name}: no HMMA.16816"
        assert "LDSM.16.M88.4" in sass and "LDSM.16.MT88.2" in sass, f"{arch} {name}: no LDSM"
        assert "LDGSTS" in sass, f"{arch} {name}: no LDGSTS (cp.async)"


@pytest.mark.parametrize("build", [specs.tc_forward_module, specs.tc_backward_module],
                         ids=["flash_fwd_tc", "flash_bwd_tc"])
@pytest.mark.parametrize("arch", ARCHS)
def test_tensor_core_kernels_use_ldmatrix_and_cp_async(arch, build):
    modules = [build(fmt, d) for fmt in specs.TC_DTYPES for d in specs.TC_HEAD_DIM_BUCKETS]
    kernels = [kernel for module in modules for kernel in module.kernels if kernel.tensor_cores]
    compiled = compile_for(arch, sources.read_source(modules[0].source_file), [k.name_expression for k in kernels])
    for kernel in kernels:
        _, sass = compiled[kernel.name_expression]
        name = f"{arch} {kernel.name_expression}"
        dtype = ".BF16" if kernel.dtype == "bfloat16" else ""
        assert re.search(rf"\bHMMA\.16816\.F32{re.escape(dtype)} ", sass), f"{name}: no HMMA.16816{dtype}"
        # ldmatrix of tiles as stored (the B operand of a product with a transposed tile) and
        # transposed (of a product with the tile itself), cp.async for every tile
        assert "LDSM.16.M88.4" in sass and "LDSM.16.MT88.4" in sass and "LDGSTS" in sass, name


def test_the_cli_compiles_every_set_of_modifiers_when_asked(monkeypatch, capsys):
    # `kernels --every-modifier-set` hands the report the tensor-core modules of all 32 sets
    from flashcupy import __main__ as cli
    asked, toolkit = [], toolkit_of(12)
    monkeypatch.setattr(nvrtc, "toolkits", lambda: (toolkit,))
    hopper = []  # `kernels` at sm_90 reports the Hopper modules too, for sm_90a
    monkeypatch.setattr(nvrtc, "kernel_report", lambda arch, toolkit, modules=None: (
        hopper if arch == specs.SM90_ARCH else asked).append(modules) or [])
    assert cli.main(["kernels", "--every-modifier-set"]) == 0
    (modules,) = asked
    assert hopper == [catalog.sm90_modules(every_modifier_set=True)]
    forwards = [k for m in hopper[0] for k in m.kernels if k.template == "flash_fwd_sm90" and not k.varlen]
    assert {k.mods for k in forwards if k.head_dim == 128} == set(range(specs.ALL_MODS + 1))
    kernels = [k for m in modules for k in m.kernels if k.tensor_cores]
    assert {k.mods for k in kernels} == set(range(specs.ALL_MODS + 1))
    assert {k.template for k in kernels} == set(specs.TC_TEMPLATES) and any(k.split for k in kernels)
    assert cli.main(["kernels"]) == 0 and asked[1] is None and hopper[1] == catalog.sm90_modules()


def simt_modules(compute_capability) -> list:
    """The SIMT modules a device of `compute_capability` compiles: catalog.modules_for's, and the packed
    batch's."""
    return [m for m in catalog.modules_for(compute_capability) + catalog.varlen_modules()
            if not any(k.tensor_cores for k in m.kernels)]


def oldest_gpu_sample(compute_capability) -> list:
    """simt_modules at the smallest head-dim bucket, each kernel with the most score modifiers it takes:
    every SIMT kernel template in every dtype, with the instructions each modifier adds."""
    modules = simt_modules(compute_capability)
    most = {}
    for k in (k for m in modules for k in m.kernels):
        most[k.template] = max(most.get(k.template, 0), k.mods)
    return [m for m in modules
            if all(k.head_dim in (0, specs.HEAD_DIM_BUCKETS[0]) and k.mods == most[k.template] for k in m.kernels)]


@pytest.mark.parametrize("major", CUDA_MAJORS, ids=lambda major: f"nvrtc{major}")
def test_the_simt_kernels_compile_for_the_oldest_gpu_each_nvrtc_targets(major):
    # below sm_80 every bfloat16 call, and below sm_75 every call, takes the SIMT kernels
    # (specs.TC_COMPUTE_CAPABILITY): they must not reach for a newer instruction (cp.async,
    # __reduce_max_sync: sm_80's); sm_50 under NVRTC 12, sm_75 under 13
    toolkit = toolkit_of(major)
    oldest = toolkit.archs[0]
    assert oldest < specs.TC_COMPUTE_CAPABILITY["bfloat16"]
    modules = oldest_gpu_sample(oldest)
    kernels = [k for m in modules for k in m.kernels]
    assert not any(k.tensor_cores or k.wgmma for k in kernels)
    assert {k.dtype for k in kernels} == set(specs.CUDA_TYPES)
    assert {k.template for k in kernels} == {k.template for m in simt_modules(oldest) for k in m.kernels}
    rows = nvrtc.kernel_report(f"sm_{oldest}", toolkit, modules)
    assert len(rows) == len({row_key(k) for k in kernels})
    for r in rows:  # 48 KiB of static shared memory is every architecture's limit without an opt-in
        assert r["static_smem"] <= 48 * 1024 and r["dynamic_smem"] == 0 and r["occupancy"] > 0, r


def test_the_turing_tensor_core_kernels_fit():
    # float16 on sm_75 (specs.TC_COMPUTE_CAPABILITY): every tensor-core module a Turing GPU takes
    # (catalog.modules_for: Turing's tiles, in its 64 KiB a CTA), and the packed batch's, compiled for sm_75
    # with tensor_core.cuh's stand-ins (two m16n8k8 an mma): no spills, the registers to spare of
    # test_no_spills_and_registers_to_spare, an HMMA for every mma of a pass or more. Under PRIMARY's NVRTC
    # only (35 s of CI a major); NVRTC 12.9's, with every set of modifiers: benchmarks/results/other_archs.md
    toolkit = toolkit_of(PRIMARY[1])
    modules = [m for m in catalog.taken_on(catalog.modules_for(75) + catalog.varlen_modules(turing=True), 75)
               if any(k.tensor_cores for k in m.kernels)]
    assert {k.dtype for m in modules for k in m.kernels if k.tensor_cores} == {"float16"}
    rows = [r for r in nvrtc.kernel_report("sm_75", toolkit, modules) if r["kernel"] in specs.TC_TEMPLATES]
    assert {r["kernel"] for r in rows} == {"flash_fwd_tc", "flash_bwd_dkdv_tc", "flash_bwd_dq_tc"}
    assert not nvrtc.limits_exceeded(rows), nvrtc.limits_exceeded(rows)
    for r in rows:
        assert r["static_smem"] + r["dynamic_smem"] <= specs.smem_optin(75), r
        block_m, block_n = map(int, r["tile"].split("x"))
        assert r["hmma"] >= mmas_per_pass(r["kernel"], r["head_dim"], block_m, block_n, rolled=True), r


def test_turing_builds_take_hmma_1688_and_plain_copies():
    # sm_75 has no cp.async (LDGSTS) and no m16n8k16 (HMMA.16816): the building blocks' tile_matmul and the
    # forward run two HMMA.1688 an mma, LDSM, and their copies as loads and stores
    names = ["tile_matmul<__half>"]
    compiled = compile_for("sm_75", blocks.source(), names, (blocks.INCLUDE,))
    forward = specs.tc_forward_module("float16", 64, turing=True)
    compiled.update(compile_for("sm_75", sources.read_source(forward.source_file), forward.name_expressions))
    for name, (_, sass) in compiled.items():
        assert sass is not None, name
        assert re.search(r"\bHMMA\.1688\.F32 ", sass) and "LDSM" in sass, f"{name}: no HMMA.1688 or LDSM"
        assert "LDGSTS" not in sass and "HMMA.16816" not in sass, f"{name}: an sm_80 instruction"
    assert len(re.findall(r"\bHMMA\.1688\.F32 ", compiled["tile_matmul<__half>"][1])) == 2
    # and the stand-ins as tests/test_tensor_core_gpu.py builds them on a newer GPU (blocks.TURING_OPTIONS)
    on_hopper = compile_for("sm_90", blocks.source(), blocks.TURING_NAMES,
                            (blocks.INCLUDE, *blocks.TURING_OPTIONS["gpu"]))
    sass = on_hopper["tile_matmul<__half>"][1]
    assert len(re.findall(r"\bHMMA\.1688\.F32 ", sass)) == 2 and "LDGSTS" not in sass


def test_the_cli_compiles_for_an_old_gpu_with_the_nvrtcs_that_target_it(monkeypatch, capsys):
    # `kernels --arch sm_70`: NVRTC 13 has no sm_70 (it says so and is left out), and the report's default
    # modules there are the SIMT ones alone
    from flashcupy import __main__ as cli
    asked = []
    monkeypatch.setattr(nvrtc, "kernel_report", lambda arch, toolkit, modules=None: asked.append(
        (arch, toolkit.version.split(".")[0], modules)) or [])
    assert cli.main(["kernels", "--arch", "sm_70"]) == 0
    assert asked == [("sm_70", "12", None)]
    assert "does not compile for sm_70" in capsys.readouterr().err
    assert not any(k.tensor_cores for m in catalog.modules_for(70) for k in m.kernels)
    assert any(k.tensor_cores for m in catalog.modules_for(80) for k in m.kernels)
    with pytest.raises(SystemExit):
        cli.main(["kernels", "--arch", "70"])
    assert "arch must look like sm_80" in capsys.readouterr().err
