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
the dense figure of the datasheet (on Hopper, wgmma's; mma.sync reaches well below it).
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
BASE = 64  # the smaller launch: seqlen_q = seqlen_k = BASE; the larger one doubles the loop's side


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
                   transform=None) -> list:
    """LaunchCounters of every kernel that a forward (and a backward) call launches, B = H = 1,
    non-causal. `transform(source)`, if given, rewrites each kernel source before it is compiled
    (the tests' deliberate bugs)."""
    from flashcupy.tools.emulator import counters
    from flashcupy.tools.emulator.cupy import emulated

    def compile_module(source, names, options, *rest):
        return _counting_module(transform(source) if transform else source, names, options, *rest)

    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, seqlen_q, 1, head_dim)).astype(dtype)
    k = rng.standard_normal((1, seqlen_k, 1, head_dim)).astype(dtype)
    v = rng.standard_normal((1, seqlen_k, 1, head_dim)).astype(dtype)
    with emulated(compile=compile_module), counters.recording() as log:
        out, lse = flashcupy.attention(q, k, v, return_lse=True, backend="cupy")
        if backward:
            flashcupy.attention_backward(np.ones_like(out), q, k, v, out, lse, backend="cupy")
    return log


def _kernels(dtype: str, head_dim: int) -> dict:
    """{template: specs.Kernel} of the kernels the backend launches for this dtype and head_dim."""
    if specs.tensor_core_eligible(dtype, head_dim):
        modules = (specs.tc_forward_module(dtype, head_dim), specs.tc_backward_module(dtype, head_dim))
    else:
        modules = (specs.forward_module(dtype, head_dim), specs.backward_module(dtype, head_dim))
    return {k.template: k for m in modules for k in m.kernels}


def _pairs(kernel, seqlen_q: int, seqlen_k: int) -> int:
    return math.ceil(seqlen_q / kernel.block_m) * math.ceil(seqlen_k / kernel.block_n)


def kernel_counters(cases=None, progress=None, transform=None, templates=None) -> list:
    """One row per kernel launched by each case: its spec (`kernel`), the smaller launch's Counters
    (`launch`, at `launch_shape` = (seqlen_q, seqlen_k)), and `per_pass`: (Counters, pairs), the
    difference that `pairs` more passes of its loop make (None for a kernel without a loop).
    `templates` limits the rows (and skips the backward when no backward kernel is asked for)."""
    backward = templates is None or any(t not in (*specs.TC_FORWARD_TEMPLATES, "flash_fwd") for t in templates)
    rows = []
    for dtype, head_dim in cases or CASES:
        if progress:
            progress(f"counting {dtype} head_dim={head_dim} on the emulator ...")
        sizes = {"base": (BASE, BASE), "keys": (BASE, 2 * BASE), "queries": (2 * BASE, BASE)}
        logs = {name: {launch.kernel: launch
                       for launch in count_launches(dtype, head_dim, *size, backward, transform)}
                for name, size in sizes.items()}
        for template, kernel in _kernels(dtype, head_dim).items():
            if templates is not None and template not in templates:
                continue
            base = logs["base"][kernel.name_expression].counters
            loop = kernel.loop
            per_pass = None
            if loop:
                more = logs[loop][kernel.name_expression].counters
                added = _pairs(kernel, *sizes[loop]) - _pairs(kernel, *sizes["base"])
                per_pass = ((more - base), added)
            rows.append(dict(kernel=kernel, dtype=dtype, head_dim=head_dim, launch=base,
                             launch_shape=sizes["base"], per_pass=per_pass))
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


def _registers(nvrtc_rows) -> dict:
    """The NVRTC report's rows by (template, dtype, head_dim, variant): each counted kernel takes its own
    specialization's, not another's of the same template."""
    return {(r["kernel"], r["dtype"], r["head_dim"], r["mods"]): r for r in nvrtc_rows or ()}


def _fmt(x, spec="{:.0f}") -> str:
    if x is None:
        return "-"
    return spec.format(x)


def format_counters(rows: list, nvrtc_rows=None, nvrtc_heading: str = "") -> str:
    """The counters table, then the roofline table; registers and occupancy from `nvrtc_rows`."""
    regs = _registers(nvrtc_rows)
    head = ["kernel", "dtype", "D", "tile", "regs", "occ", "per", "mma", "smem B", "smem B/mma", "ldsm B/mma",
            "cp.async B/mma", "wavefronts", "conflicts", "ld sect/req", "ld excess", "st sect/req*",
            "st excess*", "barriers"]
    table = [head]
    for row in rows:
        k = row["kernel"]
        f = pass_figures(row)
        r = regs.get((k.template, k.dtype, k.head_dim or None, nvrtc.variant(k)))
        per_mma = (lambda b: _fmt(b / f["mma"])) if f["mma"] else (lambda b: "-")
        ld = f["load_sectors_per_request"] or None
        st = f["store_sectors_per_request"] or None
        registers = _fmt(r and r["registers"]) + ("!" if r and nvrtc._over(r, "registers") else "")
        table.append([k.template, k.dtype, str(k.head_dim or "-"), f"{k.block_m}x{k.block_n}" if k.head_dim else "-",
                      registers, _fmt(r and r["occupancy"], "{:.0%}"), f["unit"],
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


def _align(table) -> str:
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(c.rjust(w) if i >= 3 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
                     for r in table)
