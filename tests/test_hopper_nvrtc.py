"""hopper.cuh's inline PTX is accepted for sm_90a by every NVRTC installed (CuPy's, and each CUDA
major's wheels), and compiles to the SASS instructions it names; plain sm_90 rejects setmaxnreg and
wgmma, and TMA compiles to its UTMA* instructions.

Needs no GPU (flashcupy/tools/nvrtc.py finds and runs each NVRTC). The kernels are the emulator's
test kernels, tests/emulator_kernels/hopper.cu, wgmma.cu and tma.cu, so the code the emulator runs is the
code ptxas accepts.
"""

from __future__ import annotations

import dataclasses
import os
import re

import pytest

from flashcupy.backends.cupy_backend import sources
from flashcupy.tools import nvrtc
from nvrtc_rules import PRIMARY, TWIN_SLACK

HERE = os.path.dirname(os.path.abspath(__file__))
TEST_KERNELS = os.path.join(HERE, "emulator_kernels", "hopper.cu")
WGMMA_KERNELS = os.path.join(HERE, "emulator_kernels", "wgmma.cu")
TMA_KERNELS = os.path.join(HERE, "emulator_kernels", "tma.cu")
WGMMA_NAMES = tuple(f"wgmma_gemm<{t}, {n}>" for t in ("__half", "__nv_bfloat16") for n in (64, 128))

# SASS of each wrapper (mbarrier: SYNCS.*; the empty-barrier arrive, the expect_tx and the
# complete_tx are flavours of SYNCS.ARRIVE.TRANS64; setmaxnreg only with a register cap at entry)
SASS = {
    "mbarrier_init": "SYNCS.EXCH.64",
    "mbarrier_arrive / expect_tx / complete_tx": "SYNCS.ARRIVE.TRANS64",
    "mbarrier_try_wait_parity": "SYNCS.PHASECHK.TRANS64.TRYWAIT",
    "named_barrier_sync": "BAR.SYNC",
    "named_barrier_arrive": "BAR.ARV",
    "elect_one_sync": "ELECT",
    "setmaxnreg_dec": "USETMAXREG.DEALLOC",
    "setmaxnreg_inc": "USETMAXREG.TRY",
}


# SASS of the wgmma wrappers (f16 inputs print no type suffix; the N of each instantiation is in the
# name). A warning (ptxas C7510-C7515: the wgmma pipeline serialised) fails the test as any other.
WGMMA_SASS = {
    "wgmma_ss / wgmma_rs f16, N = 64": "HGMMA.64x64x16.F32 ",
    "wgmma_ss / wgmma_rs bf16, N = 64": "HGMMA.64x64x16.F32.BF16",
    "wgmma_ss / wgmma_rs f16, N = 128": "HGMMA.64x128x16.F32 ",
    "wgmma_ss / wgmma_rs bf16, N = 128": "HGMMA.64x128x16.F32.BF16",
    "wgmma_fence": "WARPGROUP.ARRIVE",
    "wgmma_wait_group": "WARPGROUP.DEPBAR.LE",
    "fence_proxy_async": "FENCE.VIEW.ASYNC.S",
}


def toolkits():
    try:
        return nvrtc.toolkits()
    except nvrtc.NvrtcError as e:
        pytest.skip(f"no NVRTC: {e}")


def compile_for(arch, toolkit, path=TEST_KERNELS, names=()):
    with open(path) as f:
        source = f.read()
    return nvrtc.compile_cubin(source, names, nvrtc.compile_options(arch, toolkit) + (f"-I{sources.KERNEL_DIR}",),
                               toolkit)


def test_hopper_instructions_compile_for_sm_90a():
    for toolkit in toolkits():
        log, _, cubin = compile_for("sm_90a", toolkit)
        warnings = [line for line in log.splitlines() if "warning" in line.lower()]
        assert not warnings, f"NVRTC {toolkit.version}: {warnings}"
        if nvrtc.nvdisasm_path() is None:
            continue
        sass = nvrtc.sass(cubin)
        missing = {wrapper: op for wrapper, op in SASS.items() if not re.search(rf"\b{re.escape(op)}", sass)}
        assert not missing, f"NVRTC {toolkit.version}: no SASS for {missing}"


def test_plain_sm_90_rejects_setmaxnreg():
    for toolkit in toolkits():
        with pytest.raises(nvrtc.NvrtcError, match="setmaxnreg.* not supported on .target 'sm_90'"):
            compile_for("sm_90", toolkit)


def test_wgmma_compiles_for_sm_90a():
    for toolkit in toolkits():
        log, lowered, cubin = compile_for("sm_90a", toolkit, WGMMA_KERNELS, WGMMA_NAMES)
        warnings = [line for line in log.splitlines() if "warning" in line.lower()]
        assert not warnings, f"NVRTC {toolkit.version}: {warnings}"
        assert set(lowered) == set(WGMMA_NAMES)
        if nvrtc.nvdisasm_path() is None:
            continue
        sass = nvrtc.sass(cubin)
        missing = {wrapper: op for wrapper, op in WGMMA_SASS.items() if op not in sass}
        assert not missing, f"NVRTC {toolkit.version}: no SASS for {missing}"


def test_plain_sm_90_rejects_wgmma():
    for toolkit in toolkits():
        with pytest.raises(nvrtc.NvrtcError, match="wgmma.* not supported on .target 'sm_90'"):
            compile_for("sm_90", toolkit, WGMMA_KERNELS, WGMMA_NAMES[:1])


# SASS of the TMA wrappers (the tensor map's address is a param-space generic address: no copy of it)
TMA_SASS = {
    "tma_load_2d / 3d / 4d": "UTMALDG",
    "tma_store_2d / 3d / 4d": "UTMASTG",
    "tma_store_commit_group": "UTMACMDFLUSH",
    "tma_store_wait_group_read": "DEPBAR",
    "bulk_reduce_add_f32": "UBLKRED.G.S.ADD.F32",
    "fence_proxy_async_global": "FENCE.VIEW.ASYNC.G",
    "flag_wait_at_least": "LDG.E.STRONG.GPU",
    "flag_release_add": "REDG.E.ADD.S32.STRONG.GPU",
}


def test_tma_compiles_for_sm_90a():
    for toolkit in toolkits():
        log, _, cubin = compile_for("sm_90a", toolkit, TMA_KERNELS)
        warnings = [line for line in log.splitlines() if "warning" in line.lower()]
        assert not warnings, f"NVRTC {toolkit.version}: {warnings}"
        if nvrtc.nvdisasm_path() is None:
            continue
        sass = nvrtc.sass(cubin)
        missing = {wrapper: op for wrapper, op in TMA_SASS.items() if op not in sass}
        assert not missing, f"NVRTC {toolkit.version}: no SASS for {missing}"
        ranks = set(re.findall(r"UTMA(?:LDG|STG)\.\dD", sass))
        want = {f"UTMA{op}.{r}D" for op in ("LDG", "STG") for r in (2, 3, 4)}
        assert want <= ranks, f"NVRTC {toolkit.version}: no SASS for {sorted(want - ranks)}"


@pytest.mark.parametrize("major", (PRIMARY[1], 12), ids=lambda major: f"nvrtc{major}")
@pytest.mark.parametrize("source_file", ["flash_fwd_sm90.cu", "flash_bwd_sm90.cu"])
def test_the_hopper_kernels_compile_for_sm_90a_without_spills_or_serialised_wgmma(source_file, major):
    """The Hopper forward and backward, every specialisation the backend launches (catalog.sm90_modules),
    with the options the backend compiles them with (sources.arch_options): no ptxas warning (C7508:
    setmaxnreg ignored; C7510-C7520: the wgmma pipeline serialised, or a warpgroup.arrive injected), no
    spills, and the SASS of each warp-specialised kernel holds HGMMA, the TMA loads (and the forward's
    stores), each role's register reallocation, mbarrier waits and named barriers. The reallocation is
    specs.SM90_REGISTERS' for the kernel's consumer warpgroups, within the registers its launch takes (a
    setmaxnreg.inc past them would wait for ever on a GPU; the emulator does not count registers).
    The bfloat16 kernels under the PRIMARY NVRTC only, where each must take its float16 twin's spills and
    registers, fewer than TWIN_SLACK apart (nvrtc_rules.py; all 70 pairs were the same under both NVRTCs:
    benchmarks/results/nvrtc_twins.md)."""
    from flashcupy.backends.cupy_backend import catalog, specs

    modules = [m for m in catalog.sm90_modules(dtypes=specs.TC_DTYPES if major == PRIMARY[1] else ("float16",))
               if m.source_file == source_file]
    assert modules and {m.arch for m in modules} == {specs.SM90_ARCH}
    source = sources.read_source(source_file)
    names = list(dict.fromkeys(k.name_expression for m in modules for k in m.kernels))
    wgmma = [k for m in modules for k in m.kernels if k.wgmma]
    ops = ["HGMMA.64x", "UTMALDG", "USETMAXREG.DEALLOC", "USETMAXREG.TRY", "SYNCS.PHASECHK.TRANS64.TRYWAIT",
           "BAR.SYNC"]
    # the forward's out by TMA store, but a packed batch's (a box would reach into the next sequence); the
    # backward's dQ by bulk reduce-add
    stores = (lambda k: [] if k.varlen else ["UTMASTG"]) if source_file == "flash_fwd_sm90.cu" else lambda k: ["UBLKRED"]
    (toolkit,) = [t for t in toolkits() if t.version.split(".")[0] == str(major)]
    options = sources.arch_options(specs.SM90_ARCH) + (f"-I{toolkit.include}", "-Xptxas=-v")
    log, lowered, cubin = nvrtc.compile_cubin(source, names, options, toolkit)
    # ptxas' warnings and performance remarks (the front end's "declared but never referenced" of the
    # shared headers' constants are no concern here)
    warnings = [line for line in log.splitlines() if re.search(r"ptxas.*warning|C75\d\d", line, re.I)]
    assert not warnings, f"NVRTC {toolkit.version}: {warnings}"
    resources = nvrtc.parse_ptxas(log)
    for name in names:
        used = resources[lowered[name]]
        assert used["spill_stores"] == used["spill_loads"] == 0, f"NVRTC {toolkit.version}: {name} spills"
    twins = [(k, dataclasses.replace(k, dtype="float16")) for k in wgmma if k.dtype == "bfloat16"]
    assert len(twins) == (len(wgmma) // 2 if major == PRIMARY[1] else 0)
    for brain, half in twins:
        a, b = resources[lowered[half.name_expression]], resources[lowered[brain.name_expression]]
        assert abs(a["registers"] - b["registers"]) < TWIN_SLACK, (brain.name_expression, a, b)
    if nvrtc.nvdisasm_path() is None:
        return
    sass = nvrtc.sass(cubin)
    for kernel in wgmma:
        name = kernel.name_expression
        code = nvrtc.function_sass(sass, lowered[name])
        for op in ops + stores(kernel):
            assert op in code, f"NVRTC {toolkit.version}: no {op} in {name}"
        consumers = kernel.threads // 128 - 1
        producer, consumer = specs.SM90_REGISTERS[consumers]
        assert re.findall(r"USETMAXREG\.DEALLOC\S* (0x[0-9a-f]+)", code) == [hex(producer)], name
        assert re.findall(r"USETMAXREG\.TRY_ALLOC\S* \w+, (0x[0-9a-f]+)", code) == [hex(consumer)], name
        launch = resources[lowered[name]]["registers"] * kernel.threads
        assert 128 * (producer + consumers * consumer) <= launch, f"NVRTC {toolkit.version}: {name}"


def _backward_ops(tile):
    """The wgmma, wgmma waits and named barriers of the Hopper dK/dV kernel (float16, head_dim 64, `tile`) in
    SASS order, compiled by CuPy's NVRTC as the backend compiles it."""
    from flashcupy.backends.cupy_backend import specs

    if nvrtc.nvdisasm_path() is None:
        pytest.skip("no nvdisasm")
    kernel = specs.sm90_backward_module("float16", 64, tile=tile).kernels[1]
    toolkit = nvrtc.cupy_toolkit()
    options = sources.arch_options(specs.SM90_ARCH) + (f"-I{toolkit.include}",)
    _, lowered, cubin = nvrtc.compile_cubin(sources.read_source("flash_bwd_sm90.cu"), [kernel.name_expression],
                                            options, toolkit)
    code = nvrtc.function_sass(nvrtc.sass(cubin), lowered[kernel.name_expression])
    ops = re.findall(r"HGMMA\.64x64x16|WARPGROUP\.DEPBAR\.LE gsb0, 0x\d|BAR\.SYNC\.DEFER_BLOCKING 0x3|MUFU\.EX2", code)
    return [op for i, op in enumerate(ops) if op != "MUFU.EX2" or ops[i - 1] != "MUFU.EX2"]  # a run of ex2 as one


def test_the_backwards_wgmma_overlap_what_their_registers_allow():
    """The pipelining in flash_bwd_sm90.cu that ptxas could undo without a word. At head_dim 64 with 64 rows
    a pass: Pᵀ's exponentials between the wait for Sᵀ's wgmma (4 k-steps) and the wait for dPᵀ's
    (P_UNDER_DP), and the owner's dQ wgmma (8 k-steps over the key block) issued after the DS_READY
    barrier (named barrier 3) and before any wait, under its dV and dK wgmma (4 k-steps each: DQ_UNDER_DK).
    With the tall pass's two wgmma Ms of dQ, a wait that leaves one group in flight (the second M) before
    the first's stores."""
    hgmma, ds_ready, ex2 = "HGMMA.64x64x16", "BAR.SYNC.DEFER_BLOCKING 0x3", "MUFU.EX2"
    wait = {n: f"WARPGROUP.DEPBAR.LE gsb0, 0x{n}" for n in (0, 1)}
    ops = _backward_ops((64, 128))
    for pattern in ([hgmma] * 8 + [wait[1], ex2, wait[0]], [hgmma] * 8 + [ds_ready] + [hgmma] * 8 + [wait[0]]):
        assert any(ops[i:i + len(pattern)] == pattern for i in range(len(ops))), (pattern, ops)
    tall = [ds_ready] + [hgmma] * 16 + [wait[1], wait[0]]
    ops = _backward_ops((128, 128))
    assert any(ops[i:i + len(tall)] == tall for i in range(len(ops))), ops
