"""Every CUDA kernel specialization compiles with NVRTC for sm_80 and sm_90, and none spills.

Needs libnvrtc (the nvidia-cuda-nvrtc-cu12 wheel) and the CUDA headers of the
nvidia-cuda-runtime-cu12 wheel; no GPU. ptxas reports registers, spills and shared memory
through NVRTC's log (-Xptxas=-v).
"""

from __future__ import annotations

import pytest

from flashcupy import _kernels
from flashcupy.backends.cupy_backend import specs

ARCHS = ("sm_80", "sm_90")

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
    info = _kernels.parse_ptxas(PTXAS_LOG)
    assert info["_Z9flash_fwdIffLi64ELi64ELi32EEvPKT_"] == dict(
        registers=128, spill_stores=4, spill_loads=12, stack=8, static_smem=32768)
    assert info["_Z20flash_bwd_preprocessIffEvPKT_"] == dict(
        registers=32, spill_stores=0, spill_loads=0, stack=0, static_smem=0)


def test_occupancy():
    # 128 threads, 64 registers, no shared memory: 8 CTAs by registers = 32 of 64 warps
    assert _kernels.occupancy("sm_80", 64, 0, 128) == 0.5
    # 48 KiB (+1 KiB reserved) per CTA: 3 CTAs on an A100 SM, 4 on an H100 SM
    assert _kernels.occupancy("sm_80", 32, 48 * 1024, 128) == 12 / 64
    assert _kernels.occupancy("sm_90", 32, 48 * 1024, 128) == 16 / 64


@pytest.fixture(scope="module", params=ARCHS)
def report(request):
    return request.param, _kernels.kernel_report(request.param)


def test_every_specialization_compiles(report):
    arch, rows = report
    kernels_per_dtype = 1 + 3 * len(specs.HEAD_DIM_BUCKETS)  # preprocess, then fwd, dkdv, dq per bucket
    # attn_fwd_tc, attn_bwd_dkdv_tc, attn_bwd_dq_tc per bucket (their preprocess is the SIMT one)
    tensor_core = len(specs.TC_DTYPES) * len(specs.TC_HEAD_DIM_BUCKETS) * len(specs.TC_TEMPLATES)
    assert len(rows) == len(specs.CUDA_TYPES) * kernels_per_dtype + tensor_core
    print(f"\n{arch}, NVRTC {_kernels.nvrtc_version()}\n{_kernels.format_kernel_report(rows)}")


def test_no_spills(report):
    arch, rows = report
    spilled = [f"{r['kernel']} {r['dtype']} head_dim={r['head_dim']}: {r['spill_bytes']} bytes"
               for r in rows if r["spill_bytes"]]
    assert not spilled, f"{arch}: " + "; ".join(spilled)


def test_resources_fit(report):
    arch, rows = report
    for r in rows:
        # the SIMT kernels stay within 48 KiB of static shared memory; the tensor-core kernels
        # opt in to more dynamic shared memory (up to 227 KiB on sm_90, 163 KiB on sm_80)
        assert r["static_smem"] <= 48 * 1024 and r["static_smem"] + r["dynamic_smem"] <= 163 * 1024
        assert 0 < r["registers"] <= 255 and r["occupancy"] > 0
        assert r["threads"] == specs.NUM_THREADS


def test_tensor_core_kernels_run_on_tensor_cores(report):
    arch, rows = report
    tc = [r for r in rows if r["kernel"] in specs.TC_TEMPLATES]
    assert {r["kernel"] for r in tc} == set(specs.TC_TEMPLATES)
    assert all(r["hmma"] for r in tc), f"{arch}: no HMMA in {[r for r in tc if not r['hmma']]}"
    assert all(r["hmma"] is None for r in rows if r["kernel"] not in specs.TC_TEMPLATES)
