"""Every CUDA kernel specialization compiles for sm_80 and sm_90 under NVRTC 12 and NVRTC 13, with
CuPy's options, without spilling and at least REGISTER_MARGIN registers below the limit.

Needs no GPU: NVRTC and the CUDA headers of both CUDA majors come from NVIDIA's wheels (the test
extra installs both), ptxas reports registers, spills and shared memory through NVRTC's log
(-Xptxas=-v), nvdisasm gives the SASS. See flashcupy/nvrtc.py for how each NVRTC is found and run.
"""

from __future__ import annotations

import re

import pytest

from flashcupy.backends.cupy_backend import nvrtc, sources, specs

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
    cells = [line.split()[7:] for line in lines[2:]]  # registers, spill_bytes, occupancy, hmma per NVRTC
    assert [c[:2] + c[4:6] for c in cells] == [[str(limit), "0", "100", "8!"],
                                                [f"{limit + 1}!", "0", f"{limit + 1}!", "0"],
                                                ["100", "8!", str(limit), "0"]]


@pytest.fixture(scope="module", params=[(arch, major) for major in CUDA_MAJORS for arch in ARCHS],
                ids=lambda p: f"{p[0]}-nvrtc{p[1]}")
def report(request):
    arch, major = request.param
    toolkit = toolkit_of(major)
    return f"{arch}, NVRTC {toolkit.version}", nvrtc.kernel_report(arch, toolkit)


def test_every_specialization_compiles(report):
    what, rows = report
    kernels_per_dtype = 1 + 3 * len(specs.HEAD_DIM_BUCKETS)  # preprocess, then fwd, dkdv, dq per bucket
    # attn_fwd_tc, attn_bwd_dkdv_tc, attn_bwd_dq_tc per bucket (their preprocess is the SIMT one)
    tensor_core = len(specs.TC_DTYPES) * len(specs.TC_HEAD_DIM_BUCKETS) * len(specs.TC_TEMPLATES)
    assert len(rows) == len(specs.CUDA_TYPES) * kernels_per_dtype + tensor_core
    print(f"\n{what}\n{nvrtc.format_kernel_report({what: rows})}")


def test_no_spills_and_registers_to_spare(report):
    what, rows = report
    limit = nvrtc.MAX_REGISTERS - nvrtc.REGISTER_MARGIN
    over = [f"{r['kernel']} {r['dtype']} head_dim={r['head_dim']}: {r['registers']} registers, "
            f"{r['spill_bytes']} spill bytes" for r in rows if r["spill_bytes"] or r["registers"] > limit]
    assert not over, f"{what}: more than {limit} registers, or spills: " + "; ".join(over)


def test_resources_fit(report):
    what, rows = report
    for r in rows:
        # the SIMT kernels stay within 48 KiB of static shared memory; the tensor-core kernels
        # opt in to more dynamic shared memory (up to 227 KiB on sm_90, 163 KiB on sm_80)
        assert r["static_smem"] <= 48 * 1024 and r["static_smem"] + r["dynamic_smem"] <= 163 * 1024
        assert r["registers"] > 0 and r["occupancy"] > 0
        assert r["threads"] == specs.NUM_THREADS


def test_tensor_core_kernels_run_on_tensor_cores(report):
    what, rows = report
    tc = [r for r in rows if r["kernel"] in specs.TC_TEMPLATES]
    assert {r["kernel"] for r in tc} == set(specs.TC_TEMPLATES)
    assert all(r["hmma"] for r in tc), f"{what}: no HMMA in {[r for r in tc if not r['hmma']]}"
    assert all(r["hmma"] is None for r in rows if r["kernel"] not in specs.TC_TEMPLATES)
