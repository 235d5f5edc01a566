"""A performance model that runs without a GPU: `python -m flashcupy kernels --counters`.

The CPU emulator (flashcupy/tools/emulator/, in a checkout only) runs a small launch of each kernel
built to count what its warps ask of memory (its counters.py has the model): shared-memory bytes
and wavefronts (bank conflicts included), global-memory sectors per request, barriers and mma.sync.
Each kernel runs at two sizes that differ only along its loop (specs.Kernel.loop; forward, dQ: more
keys; dK/dV: more queries), and the difference divided by the added (query block, key block) pairs
is the cost of one pass of the loop, free of the prologue and the epilogue.

From a pass's mma count and shared-memory wavefronts, and the GPU figures of tools/hardware.py, a
roofline gives the rate each resource would allow with every SM busy. It is a model, not a
measurement: it knows nothing of latency, issue slots, occupancy or caches, and the tensor peak is
the dense figure of the datasheet (on Hopper, wgmma's; mma.sync reaches well below it). Against the
one silicon figure (the mma.sync D=128 forward at cfbc799: 202-227 TFLOP/s on an H200, the model 396)
it overestimates the mma.sync kernels about 1.8x.

The Hopper kernels (flash_fwd_sm90.cu, flash_bwd_sm90.cu) are counted on an emulated sm_90 device
(SM90_CASES) and have a roofline of their own (wgmma_roofline): per pass, the time of each resource on one SM, from the
counters: wgmma's FLOPs at the tensor peak; shared memory at 128 B/clk for wgmma's operand reads, the
TMA boxes' (and bulk reduce-adds') shared side and any ld/st wavefronts; the softmax's ex2 at the
MUFU's rate; HBM, as if every TMA sector came from it. With two consumer warpgroups (taking turns at
the tensor cores in the forward, FA3's pingpong) the element-wise work of one runs under the GEMMs of
the other, so the pass takes the longest of those times ("overlapped"); "not overlapped" adds the
ex2 time to the GEMMs' instead, the bound if no exponential were hidden. Both are models, not
measurements.
"""

from __future__ import annotations

import functools
import importlib
import math

import numpy as np

import flashcupy
from flashcupy.backends.cupy_backend import specs
from flashcupy.tools import nvrtc
from flashcupy.tools.hardware import GPUS, Gpu


MMA_FLOPS = 2 * 16 * 8 * 16  # one mma.sync m16n8k16
# (dtype, head_dim) of the representative launches: float16 takes the tensor-core kernels, float32
# the SIMT ones (which no other dtype changes in structure)
CASES = (("float16", 64), ("float16", 128), ("float32", 64), ("float32", 128))
# the same on an emulated sm_90 device, where the forward and backward run on flash_fwd_sm90.cu and
# flash_bwd_sm90.cu (at head_dim 256 the backward's SPLIT_D, which head_dim 136..192 takes too)
SM90_CASES = (("float16", 64), ("float16", 128), ("float16", 256))
SM90 = 90  # the compute capability of SM90_CASES (specs.SM90_COMPUTE_CAPABILITY)
# the smaller launch: seqlen_q = seqlen_k = BASE (or one block of the loop's side, if larger: the
# Hopper forward's 128 keys); the larger one doubles the loop's side
BASE = 64


EMULATOR = "flashcupy.tools.emulator"


def emulator_missing() -> str | None:
    """Why the CPU emulator cannot be imported here, or None when it can: a checkout has it
    (flashcupy/tools/emulator/), an installed wheel leaves it out (setup.cfg)."""
    try:
        importlib.import_module(EMULATOR)
    except ModuleNotFoundError as e:
        if e.name != EMULATOR:  # the emulator is here, something it imports is not
            raise
        return f"{EMULATOR} is not importable ({e}): it ships with the source tree, not the wheel"
    return None


@functools.lru_cache(maxsize=None)
def _counting_module(source, names, options, thread_order="ascending", seed=0, cp_async="deferred"):
    from flashcupy.tools.emulator import EmulatedModule
    return EmulatedModule(source, names, options, thread_order=thread_order, seed=seed, cp_async=cp_async,
                          counters=True)


def count_launches(dtype: str, head_dim: int, seqlen_q: int, seqlen_k: int, backward: bool = True,
                   transform=None, compute_capability: int = 80) -> list:
    """LaunchCounters of every kernel that a forward (and a backward) call launches, B = H = 1,
    non-causal, on an emulated device of `compute_capability` (80: the mma.sync kernels; 90: the
    Hopper kernels). `transform(source)`, if given, rewrites each kernel source before
    it is compiled (the tests' deliberate bugs)."""
    from flashcupy.tools.emulator import counters
    from flashcupy.tools.emulator.cupy import emulated

    def compile_module(source, names, options, *rest):
        return _counting_module(transform(source) if transform else source, names, options, *rest)

    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, seqlen_q, 1, head_dim)).astype(dtype)
    k = rng.standard_normal((1, seqlen_k, 1, head_dim)).astype(dtype)
    v = rng.standard_normal((1, seqlen_k, 1, head_dim)).astype(dtype)
    with emulated(compile=compile_module, compute_capability=compute_capability), counters.recording() as log:
        out, lse = flashcupy.attention(q, k, v, return_lse=True, backend="cupy")
        if backward:
            flashcupy.attention_backward(np.ones_like(out), q, k, v, out, lse, backend="cupy")
    return log


def _kernels(dtype: str, head_dim: int, compute_capability: int = 80) -> dict:
    """{template: specs.Kernel} of the kernels the backend launches for this dtype and head_dim, non-causal
    (on compute capability 9.0: the Hopper kernels, of the tiles cupy_backend's SM90_WIDE,
    SM90_TALL_FORWARD and SM90_TALL_BACKWARD ask for; the backward at head_dim 136..192 the 256 kernel's,
    specs.sm90_backward_bucket)."""
    if compute_capability == specs.SM90_COMPUTE_CAPABILITY:
        if not specs.sm90_eligible(dtype, head_dim, 0):
            raise ValueError(f"{dtype} head_dim={head_dim} does not run on the Hopper kernels")
        from flashcupy.backends import cupy_backend
        forward = specs.sm90_forward_tile(head_dim, wide=cupy_backend.SM90_WIDE, tall=cupy_backend.SM90_TALL_FORWARD)
        modules = (specs.sm90_forward_module(dtype, head_dim, tile=forward),)
        if specs.sm90_eligible(dtype, head_dim, 0, backward=True):
            backward = specs.sm90_backward_tile(head_dim, tall=cupy_backend.SM90_TALL_BACKWARD)
            modules += (specs.sm90_backward_module(dtype, head_dim, tile=backward),)
    elif specs.tensor_core_eligible(dtype, head_dim):
        modules = (specs.tc_forward_module(dtype, head_dim), specs.tc_backward_module(dtype, head_dim))
    else:
        modules = (specs.forward_module(dtype, head_dim), specs.backward_module(dtype, head_dim))
    return {k.template: k for m in modules for k in m.kernels}


def _pairs(kernel, seqlen_q: int, seqlen_k: int) -> int:
    return math.ceil(seqlen_q / kernel.block_m) * math.ceil(seqlen_k / kernel.block_n)


def kernel_counters(cases=None, progress=None, transform=None, templates=None, compute_capability=80) -> list:
    """One row per kernel launched by each case: its spec (`kernel`), the smaller launch's Counters
    (`launch`, at `launch_shape` = (seqlen_q, seqlen_k)), and `per_pass`: (Counters, pairs), the
    difference that `pairs` more passes of its loop make (None for a kernel without a loop).
    `templates` limits the rows (and skips the backward when no backward kernel is asked for).
    compute_capability: of the emulated device (SM90: the Hopper kernels; cases default to SM90_CASES)."""
    sm90 = compute_capability == SM90
    backward = templates is None or any(t not in (*specs.TC_FORWARD_TEMPLATES, "flash_fwd", "flash_fwd_sm90")
                                        for t in templates)
    rows = []
    for dtype, head_dim in cases or (SM90_CASES if sm90 else CASES):
        if progress:
            progress(f"counting {dtype} head_dim={head_dim} on the emulator (sm_{compute_capability}) ...")
        kernels = {t: k for t, k in _kernels(dtype, head_dim, compute_capability).items()
                   if templates is None or t in templates}
        side = max([BASE] + [k.block_n if k.loop == "keys" else k.block_m for k in kernels.values() if k.loop])
        sizes = {"base": (side, side), "keys": (side, 2 * side), "queries": (2 * side, side)}
        needed = {"base"} | {k.loop for k in kernels.values() if k.loop}
        logs = {name: {launch.kernel: launch
                       for launch in count_launches(dtype, head_dim, *size, backward, transform, compute_capability)}
                for name, size in sizes.items() if name in needed}
        for kernel in kernels.values():
            base = logs["base"][kernel.name_expression].counters
            loop = kernel.loop
            per_pass = None
            if loop:
                more = logs[loop][kernel.name_expression].counters
                added = _pairs(kernel, *sizes[loop]) - _pairs(kernel, *sizes["base"])
                per_pass = ((more - base), added)
            rows.append(dict(kernel=kernel, dtype=dtype, head_dim=head_dim, launch=base,
                             launch_shape=sizes["base"], per_pass=per_pass, compute_capability=compute_capability))
    return rows


def pass_figures(row: dict) -> dict:
    """The figures of one pass of the kernel's loop (or of the whole launch without a loop)."""
    if row["per_pass"] is None:
        c, n, unit = row["launch"], 1, "launch"
    else:
        (c, n), unit = row["per_pass"], "pass"
    from flashcupy.tools.emulator import counters
    shared, glob = counters.SHARED, counters.GLOBAL
    loads = ("global_load", "cp_async_global")
    mma = c.mma / n
    return dict(
        unit=unit,
        mma=mma,
        barriers=c.barriers / n,
        shared_bytes=c.shared_bytes / n,
        ldmatrix_bytes=c.get("ldmatrix", "bytes") / n,
        cp_async_bytes=c.get("cp_async_shared", "bytes") / n,
        wavefronts=c.wavefronts / n,
        conflicts=c.conflicts(shared) / n,
        load_sectors_per_request=c.sectors_per_request(loads),
        load_excess_sectors=c.excess_sectors(loads) / n,
        # stores: of the whole launch (the loops store nothing; the epilogue stores the tiles)
        store_sectors_per_request=row["launch"].sectors_per_request("global_store"),
        store_excess_sectors=row["launch"].excess_sectors("global_store"),
        store_sectors=row["launch"].total(("global_store",), "cost"),
        global_bytes=c.total(glob, "cost") * 32 / n,
        # the sm_90 instructions (counters.py, "The sm_90 instructions")
        wgmma=c.wgmma / n,
        wgmma_rs=c.wgmma_rs / n,
        wgmma_flops=c.wgmma_flops / n,
        wgmma_shared_bytes=c.wgmma_shared_bytes / n,
        tma_load_bytes=c.get("tma_load_shared", "bytes") / n,
        tma_load_excess_sectors=c.excess_sectors("tma_load_global") / n,
        tma_global_bytes=c.total(counters.TMA_GLOBAL, "cost") * 32 / n,
        tma_shared_bytes=c.total(counters.TMA_SHARED, "bytes") / n,
        # TMA stores: of the whole launch (the epilogue's)
        tma_store_bytes=row["launch"].get("tma_store_shared", "bytes"),
        tma_store_excess_sectors=row["launch"].excess_sectors("tma_store_global"),
        mbarrier_waits=c.mbarrier_waits / n,
        mbarrier_blocked=c.mbarrier_blocked / n,
        named_barriers=c.named_barriers / n,
        ex2=c.ex2 / n,
    )


def roofline(figures: dict, gpu: Gpu) -> dict | None:
    """TFLOP/s each resource allows for a pass repeated on every SM: tensor cores, shared memory
    (its wavefronts at one a clock), and HBM if every global sector came from it (no L2 reuse: a
    pessimistic bound). `model` is the least of tensor and shared memory. None without mma."""
    if not figures["mma"]:
        return None
    flops = figures["mma"] * MMA_FLOPS
    smem_clocks = figures["wavefronts"] * 128 / gpu.smem_bytes_per_clk  # on the pass's SM
    shared = flops / smem_clocks * gpu.sms * gpu.clock_ghz * 1e9 / 1e12 if smem_clocks else math.inf
    hbm = flops / figures["global_bytes"] * gpu.hbm_tbs if figures["global_bytes"] else math.inf
    return dict(tensor=gpu.tensor_tflops, shared=shared, hbm_no_reuse=hbm, model=min(gpu.tensor_tflops, shared))


def wgmma_roofline(figures: dict, gpu: Gpu, tensor_tflops: float | None = None) -> dict | None:
    """The Hopper forward's roofline, TFLOP/s for a pass repeated on every SM: the time on one SM of
    each resource, from the pass's counters. `tensor`: wgmma's FLOPs at `tensor_tflops` (the datasheet's
    dense peak unless given: gpu.gemm_tflops is the GEMM measured here); `shared`: wgmma's operand
    reads, the TMA boxes' shared side and any ld/st wavefronts (128 bytes each) at
    gpu.smem_bytes_per_clk; `ex2`: the softmax's exponentials at gpu.ex2_per_clk; `hbm_no_reuse`: as if
    every global and TMA sector came from HBM. `overlapped` takes the longest of the on-chip times (the
    pingpong of two consumer warpgroups hides one's softmax under the other's GEMMs, FA3's design);
    `not_overlapped` adds the ex2 time to the GEMMs' (no exponential hidden). None without wgmma or
    on a GPU without it."""
    if not figures["wgmma"] or gpu.arch != "sm_90":
        return None
    flops = figures["wgmma_flops"]
    per_clock = gpu.sms * gpu.clock_ghz * 1e9 / 1e12  # TFLOP/s of one FLOP per SM per clock

    def rate(clocks):
        return flops / clocks * per_clock if clocks else math.inf

    tensor_clocks = flops / ((tensor_tflops or gpu.tensor_tflops) / per_clock)
    shared_bytes = figures["wgmma_shared_bytes"] + figures["tma_shared_bytes"] + figures["wavefronts"] * 128
    shared_clocks = shared_bytes / gpu.smem_bytes_per_clk
    ex2_clocks = figures["ex2"] / gpu.ex2_per_clk
    global_bytes = figures["global_bytes"] + figures["tma_global_bytes"]
    return dict(tensor=rate(tensor_clocks), shared=rate(shared_clocks), ex2=rate(ex2_clocks),
                hbm_no_reuse=flops / global_bytes * gpu.hbm_tbs if global_bytes else math.inf,
                overlapped=rate(max(tensor_clocks, shared_clocks, ex2_clocks)),
                not_overlapped=rate(max(tensor_clocks, shared_clocks) + ex2_clocks))


def _registers(nvrtc_rows) -> dict:
    """The NVRTC report's rows by (template, dtype, head_dim, variant): each counted kernel takes its own
    specialization's, not another's of the same template."""
    return {(r["kernel"], r["dtype"], r["head_dim"], r["mods"]): r for r in nvrtc_rows or ()}


def _fmt(x, spec="{:.0f}") -> str:
    if x is None:
        return "-"
    return spec.format(x)


def format_counters(rows: list, nvrtc_rows=None, nvrtc_heading: str = "") -> str:
    """The counters table, then the roofline table; registers and occupancy from `nvrtc_rows`. The
    Hopper forward's rows (kernel.wgmma) get tables of their own (format_sm90_counters)."""
    mma_rows = [row for row in rows if not row["kernel"].wgmma]
    sm90_rows = [row for row in rows if row["kernel"].wgmma]
    parts = [format_mma_counters(mma_rows, nvrtc_rows, nvrtc_heading)] if mma_rows else []
    if sm90_rows:
        parts.append(format_sm90_counters(sm90_rows, nvrtc_rows, nvrtc_heading))
    return "\n\n".join(parts)


def _registers_cells(regs: dict, k) -> list:
    """The regs and occ cells of kernel k's row, from the NVRTC report's row of its specialization."""
    r = regs.get((k.template, k.dtype, k.head_dim or None, nvrtc.variant(k)))
    registers = _fmt(r and r["registers"]) + ("!" if r and nvrtc._over(r, "registers") else "")
    return [registers, _fmt(r and r["occupancy"], "{:.0%}")]


def format_mma_counters(rows: list, nvrtc_rows=None, nvrtc_heading: str = "") -> str:
    """The mma.sync and SIMT kernels: the counters table, then the roofline table."""
    regs = _registers(nvrtc_rows)
    head = ["kernel", "dtype", "D", "tile", "regs", "occ", "per", "mma", "smem B", "smem B/mma", "ldsm B/mma",
            "cp.async B/mma", "wavefronts", "conflicts", "ld sect/req", "ld excess", "st sect/req*",
            "st excess*", "barriers"]
    table = [head]
    for row in rows:
        k = row["kernel"]
        f = pass_figures(row)
        per_mma = (lambda b: _fmt(b / f["mma"])) if f["mma"] else (lambda b: "-")
        ld = f["load_sectors_per_request"] or None
        st = f["store_sectors_per_request"] or None
        table.append([k.template, k.dtype, str(k.head_dim or "-"), f"{k.block_m}x{k.block_n}" if k.head_dim else "-",
                      *_registers_cells(regs, k), f["unit"],
                      _fmt(f["mma"]), _fmt(f["shared_bytes"]), per_mma(f["shared_bytes"]),
                      per_mma(f["ldmatrix_bytes"]), per_mma(f["cp_async_bytes"]), _fmt(f["wavefronts"], "{:g}"),
                      _fmt(f["conflicts"], "{:g}"), _fmt(ld, "{:.1f}"), _fmt(ld and f["load_excess_sectors"], "{:g}"),
                      _fmt(st, "{:.1f}"), _fmt(st and f"{f['store_excess_sectors']:g} of {f['store_sectors']:g}", "{}"),
                      _fmt(f["barriers"], "{:g}")])
    lines = [_align(table)]
    lines.append(
        "per: 'pass' = one (query block, key block) pass of the loop (difference of two launches that differ\n"
        "only along it), 'launch' = the whole launch; smem B: shared bytes moved (ld/st, ldmatrix, cp.async\n"
        "writes), also per mma.sync; wavefronts: shared-memory cycles, conflicts: the extra ones (0: conflict-\n"
        "free); sect/req: 32-byte sectors per warp request, excess: sectors beyond what the bytes need\n"
        "(0: fully coalesced; loads include cp.async's reads); *stores: of the whole launch, the loops\n"
        "store nothing; barriers: __syncthreads() per CTA. regs/occ: " + (nvrtc_heading or "no NVRTC here")
        + (" (! as in the table above)" if nvrtc_heading else "") + ".")
    gpus = GPUS
    table = [["kernel", "dtype", "D"] + [f"{g.name} {what}" for g in gpus for what in ("smem", "model")]
             + ["HBM bound (no L2 reuse)"]]
    for row in rows:
        f = pass_figures(row)
        lines_gpu = [roofline(f, g) for g in gpus]
        if lines_gpu[0] is None:
            continue
        k = row["kernel"]
        table.append([k.template, k.dtype, str(k.head_dim)]
                     + [_fmt(r[what]) for r in lines_gpu for what in ("shared", "model")]
                     + [" / ".join(f"{g.name} {_fmt(r['hbm_no_reuse'])}" for g, r in zip(gpus, lines_gpu))])
    lines.append("\nRoofline, TFLOP/s: a model, not a measurement. Per pass, with every SM busy: 'smem' is the rate\n"
                 "shared memory allows at one wavefront (128 B) per clock per SM; 'model' is the least of that and\n"
                 "the tensor peak; HBM as if every global sector came from HBM. Hardware (one table,\n"
                 "flashcupy/tools/hardware.py):")
    for g in gpus:
        lines.append(f"  {g.name} ({g.part}): {g.sms} SMs at {g.clock_ghz} GHz, {g.tensor_tflops:g} TFLOP/s dense "
                     f"fp16/bf16, HBM {g.hbm_tbs:g} TB/s, shared {g.smem_bytes_per_clk} B/clk/SM")
    lines.append("  (on Hopper the tensor peak is wgmma's; these kernels use mma.sync, which reaches well below it)")
    lines.append(_align(table))
    return "\n".join(lines)


# Issue 26's and 27's targets for the Hopper forward and backward: TFLOP/s predicted by the model at
# D=128, non-causal, H200
SM90_TARGET = dict(tflops=600.0, head_dim=128, gpu="H200")
SM90_BACKWARD_TARGET = dict(tflops=450.0, head_dim=128, gpu="H200")


def hidden_fraction_needed(figures: dict, gpu: Gpu, tflops: float, tensor_tflops: float) -> float:
    """The least fraction of the ex2 time that must run under the GEMMs (pingpong) for a pass to reach
    `tflops` with the GEMMs at `tensor_tflops`: 0 if even none hidden does, above 1 if all do not."""
    per_clock = gpu.sms * gpu.clock_ghz * 1e9 / 1e12
    flops = figures["wgmma_flops"]
    budget = flops / (tflops / per_clock)
    on_chip = max(flops / (tensor_tflops / per_clock),
                  (figures["wgmma_shared_bytes"] + figures["tma_shared_bytes"] + figures["wavefronts"] * 128)
                  / gpu.smem_bytes_per_clk)
    ex2 = figures["ex2"] / gpu.ex2_per_clk
    return max(0.0, 1 - (budget - on_chip) / ex2) if ex2 else (0.0 if on_chip <= budget else math.inf)


def format_sm90_counters(rows: list, nvrtc_rows=None, nvrtc_heading: str = "") -> str:
    """The Hopper kernels (wgmma, TMA): their counters per pass, then their roofline for the sm_90 GPUs."""
    regs = _registers(nvrtc_rows)
    table = [["kernel", "dtype", "D", "tile", "regs", "occ", "per", "wgmma", "of them RS", "FLOP/wgmma",
              "smem B/wgmma", "TMA ld B", "TMA ld B/wgmma", "TMA ld excess", "TMA st B*", "ex2", "mbar waits",
              "blocked", "named bars", "barriers"]]
    for row in rows:
        k, f = row["kernel"], pass_figures(row)
        table.append([k.template, k.dtype, str(k.head_dim), f"{k.block_m}x{k.block_n}", *_registers_cells(regs, k),
                      f["unit"], _fmt(f["wgmma"], "{:g}"), _fmt(f["wgmma_rs"], "{:g}"),
                      _fmt(f["wgmma_flops"] / f["wgmma"]), _fmt(f["wgmma_shared_bytes"] / f["wgmma"]),
                      _fmt(f["tma_load_bytes"]), _fmt(f["tma_load_bytes"] / f["wgmma"]),
                      _fmt(f["tma_load_excess_sectors"], "{:g}"),
                      f"{f['tma_store_bytes']:g} ({f['tma_store_excess_sectors']:g} excess)",
                      _fmt(f["ex2"], "{:g}"), _fmt(f["mbarrier_waits"], "{:g}"), _fmt(f["mbarrier_blocked"], "{:g}"),
                      _fmt(f["named_barriers"], "{:g}"), _fmt(f["barriers"], "{:g}")])
    lines = [f"The Hopper kernels (flash_fwd_sm90.cu, flash_bwd_sm90.cu, sm_90a), counted on an emulated sm_90 "
             f"device, B = H = 1, non-causal, seqlen {rows[0]['launch_shape'][0]}, then twice the keys (forward) or "
             f"the queries (backward):", _align(table)]
    lines.append(
        "per pass (forward: a query block x a key block; backward: a query block past a key block: the tiles;\n"
        "the difference of two launches): wgmma issued (per\n"
        "warpgroup; RS: A from registers, P V), FLOP/wgmma = 2 x 64 x N x 16; smem B/wgmma: operand bytes\n"
        "wgmma reads from shared memory (SS: A 64x16 + B Nx16, RS: B, 16-bit); TMA ld B: bytes the boxes write\n"
        "to shared memory (K_j, V_j), excess: global sectors beyond what their bytes need; *TMA st B: the\n"
        "launch's TMA stores of out; ex2: ex2.approx per thread (the softmax's P, and alpha per row in each of\n"
        "the 4 lanes that hold it); mbar waits: mbarrier.try_wait per thread, blocked: of them, those that\n"
        "waited in the emulator's schedule (not a GPU's); named bars: bar.sync/arrive instances completed\n"
        "(the pingpong's turns); barriers: __syncthreads() per CTA. regs/occ: "
        + (nvrtc_heading or "no NVRTC here") + ".")
    gpus = [g for g in GPUS if g.arch == "sm_90"]
    table = [["kernel", "D", "GPU", "tensor", "smem", "ex2", "HBM (no L2 reuse)", "overlapped", "not overlapped"]]
    for row in rows:
        k, f = row["kernel"], pass_figures(row)
        for g in gpus:
            for label, peak in [(g.name, None)] + ([(f"{g.name} at {g.gemm_tflops:g}", g.gemm_tflops)]
                                                    if g.gemm_tflops else []):
                r = wgmma_roofline(f, g, peak)
                table.append([k.template, str(k.head_dim), label, _fmt(r["tensor"]), _fmt(r["shared"]),
                              _fmt(r["ex2"]), _fmt(r["hbm_no_reuse"]), _fmt(r["overlapped"]),
                              _fmt(r["not_overlapped"])])
    lines.append(
        "\nRoofline of the Hopper kernels, TFLOP/s: a model, not a measurement (silicon: the target lines\n"
        "below). Per pass on one SM, with every SM busy: 'tensor' wgmma's FLOPs at the dense peak (989: wgmma's\n"
        "rate; 'at 790': a bf16 GEMM measured on this workplace's H200); 'smem' wgmma's operand reads plus the\n"
        f"TMA boxes' shared bytes at {gpus[0].smem_bytes_per_clk} B/clk; 'ex2' the softmax's exponentials at "
        f"{gpus[0].ex2_per_clk}/clk/SM (the MUFU;\n"
        "FA3: 3.9 TFLOPS of special functions on an H100); HBM as if every TMA sector came from HBM. With\n"
        "pingpong the softmax of one consumer warpgroup overlaps the GEMMs of the other (FA3's design, this\n"
        "kernel's), so a pass takes the longest of those times: 'overlapped'; 'not overlapped' adds the ex2\n"
        "time to the GEMMs', the bound if no exponential were hidden (FA3 section 3.1: at D=128 the\n"
        "exponentials take about half the GEMMs' cycles).")
    lines.append(_align(table))
    for row in rows:
        k, f = row["kernel"], pass_figures(row)
        if k.template == "flash_bwd_dkdv_sm90":
            lines += _backward_target_lines(k, f, gpus)
            continue
        g = next((g for g in gpus if g.name == SM90_TARGET["gpu"]), None)
        if k.template != "flash_fwd_sm90" or k.head_dim != SM90_TARGET["head_dim"] or g is None:
            continue
        datasheet, measured = wgmma_roofline(f, g), wgmma_roofline(f, g, g.gemm_tflops)
        target = SM90_TARGET["tflops"]
        need = hidden_fraction_needed(f, g, target, g.gemm_tflops or g.tensor_tflops)
        lines += [
            f"\nIssue 26's target, >= {target:g} TFLOP/s by the model at D={k.head_dim}, {g.name}, non-causal: "
            f"{datasheet['overlapped']:.0f} overlapped, {datasheet['not_overlapped']:.0f} not",
            f"overlapped; with the GEMMs at the {g.gemm_tflops:g} measured here, {measured['overlapped']:.0f} and "
            f"{measured['not_overlapped']:.0f}: >= {target:g} if at least {need:.0%} of the ex2 time runs",
            "under the other warpgroup's GEMMs. Against silicon: FA3, this design, measured 638-648 at D=128 and",
            "476-497 at D=64 (H100, S >= 4k; 661 at D=128 in its ablation, ../shared/SM90.md), within 3% of",
            "'not overlapped' at the datasheet rates at both head dims: a fit, not an explanation (FA3 hides",
            "exponentials and pays for what this model leaves out). This kernel on an H200: 475-500 at S=16k",
            "(benchmarks/results/h200_sm90/, h200_session3/). Left out: the softmax's other instructions (max,",
            "FMA, conversion to 16 bit, O's rescale: issue slots, not counted), wgmma and TMA latency and the",
            "2-stage ring's bubbles, the barriers' cost, clocks under load, the prologue and epilogue (S >= 4k:",
            "32+ passes a CTA), waves over the 132 SMs, L2.",
        ]
    return "\n".join(lines)


def _backward_target_lines(k, f: dict, gpus) -> list:
    """Issue 27's target lines for the Hopper backward's dK/dV kernel, at the target's head_dim."""
    g = next((g for g in gpus if g.name == SM90_BACKWARD_TARGET["gpu"]), None)
    if k.head_dim != SM90_BACKWARD_TARGET["head_dim"] or g is None:
        return []
    datasheet, measured = wgmma_roofline(f, g), wgmma_roofline(f, g, g.gemm_tflops)
    target = SM90_BACKWARD_TARGET["tflops"]
    return [
        f"\nIssue 27's target, >= {target:g} TFLOP/s by the model at D={k.head_dim}, {g.name}, non-causal "
        f"(the backward's 2.5 x 4 S^2 D): {datasheet['overlapped']:.0f} overlapped,",
        f"{datasheet['not_overlapped']:.0f} not; with the GEMMs at {g.gemm_tflops:g}, {measured['overlapped']:.0f} "
        f"and {measured['not_overlapped']:.0f}. A pass: five GEMMs (S, dP, dV, dK by each consumer",
        "over its 64 keys, dQ by the pass's owner over all 128), P's exponentials, dQ's bulk reduce-add. Left",
        "out as for the forward, and the consumers' waits for each other (DS_READY, DQ_DONE). Silicon at",
        "cf03c04: 423-427 at S=16k (benchmarks/results/h200_session3/).",
    ]


def _align(table) -> str:
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(c.rjust(w) if i >= 3 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
                     for r in table)
