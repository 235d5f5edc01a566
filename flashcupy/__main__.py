"""Command line: `python -m flashcupy [info|check|bench|kernels]`.

Bare `python -m flashcupy` runs a short check, then a short benchmark of the
best available backend against the baselines.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys

import numpy as np

import flashcupy
from flashcupy import backends
from flashcupy.tools.check import CHECK_HEADER, check_rows, default_check_dtypes, format_check_row, oracle

DTYPES = ("float16", "bfloat16", "float32", "float64")


# ----------------------------------------------------------------------------
# info


def _hopper_tiles() -> str:
    """The Hopper kernels' tiles (query rows x keys) by head_dim bucket, as specs' rules give them for a
    call without causal or the window, and cupy_backend's switches that change them, with their values."""
    from flashcupy.backends import cupy_backend
    from flashcupy.backends.cupy_backend import specs

    def tiles(rule, buckets, **switch):  # the head_dim buckets the kernel takes
        return ", ".join(f"{d}: {'x'.join(map(str, rule(d, **switch)))}" for d in buckets)

    names = ("SM90_WIDE", "SM90_TALL_FORWARD", "SM90_TALL_BACKWARD", "SM90_PERSISTENT")
    switches = {name: getattr(cupy_backend, name) for name in names}
    forward = tiles(specs.sm90_forward_tile, specs.SM90_FORWARD_TILES, wide=switches["SM90_WIDE"],
                    tall=switches["SM90_TALL_FORWARD"])
    backward = tiles(specs.sm90_backward_tile, specs.SM90_BACKWARD_TILES, tall=switches["SM90_TALL_BACKWARD"])
    return ("  Hopper tiles (query rows x keys) by head_dim bucket, without causal or the window: forward\n"
            f"  {forward}; backward {backward} (specs.sm90_forward_tile,\n"
            "  sm90_backward_tile); cupy_backend's switches:\n  "
            + ", ".join(f"{name} {'on' if on else 'off'}" for name, on in switches.items()))


def cmd_info(args) -> int:
    print(f"flashcupy {flashcupy.__version__}  (python {platform.python_version()}, numpy {np.__version__})")
    print("backends:")
    for name in backends.NAMES:
        reason = backends.unavailable_reason(name)
        print(f"  {name:<6} {'available' if reason is None else 'unavailable: ' + reason}")
    from flashcupy.backends import numpy_backend
    blas = "pinned to 1 thread per worker (threadpoolctl)" if numpy_backend._blas_controller() \
        else "threadpoolctl not installed: 1 worker, BLAS threads its own calls"
    short = numpy_backend.packed.short_limit()
    print(f"numpy backend: {numpy_backend.worker_count()} worker thread(s), "
          f"tiles {numpy_backend.describe_tiles()}; BLAS {blas}; sequences of at most {short} tokens in "
          f"groups (a packed batch's, a batch of at least {numpy_backend.packed.DENSE_BATCH}'s)")
    from flashcupy.backends.cupy_backend import specs
    oldest = specs.TC_COMPUTE_CAPABILITY
    print("cupy kernel paths: forward and backward on tensor cores (mma.sync) for float16/bfloat16 with\n"
          f"  head_dim a multiple of 8 up to 256, on sm_{oldest['bfloat16']}+, q/k/v (and dout/out) "
          "contiguous along head_dim\n"
          "  with 16-byte aligned rows (v's head_dim a multiple of 8 too); on Turing (sm_75) float16\n"
          "  alone, up to head_dim "
          f"{specs.TC_TURING_HEAD_DIM_BUCKETS[-1]},\n"
          "  with smaller tiles and two m16n8k8 an mma (the default backward with softcap or ALiBi at 128\n"
          "  keeps the deterministic kernels there); the SIMT kernels for everything else (every call on\n"
          f"  an older GPU, bfloat16 below sm_{oldest['bfloat16']}, and the backward above head_dim 192 where a "
          "CTA may not have\n"
          "  129 KiB of shared memory: sm_86, sm_89, sm_120).\n"
          "  On compute capability 9.0 those calls run on\n"
          "  the Hopper kernels (TMA, wgmma, warp specialisation; sm_90a) when they have no split-KV,\n"
          "  strides a tensor map describes\n"
          "  (positive, multiples of 16 bytes) and modifiers the kernel takes: one batch's forward every\n"
          "  one but a bias above head_dim 128, packed batches' forward (attention_varlen, contiguous KV\n"
          "  caches) the window, softcap and ALiBi but the last two at 256, the backward up to head_dim\n"
          "  256 (136 to 256 in its 256 kernel; deterministic=True too: dQ added in key-block order)\n"
          "  every one but the window with a bias or mask at 128, packed batches' the window, softcap\n"
          "  and ALiBi; other modifiers, split-KV, paged KV caches, the dropout sets that spilled\n"
          "  (specs.SM90_DROPOUT_SPILLS) stay on mma.sync\n"
          "  (cupy_backend.forward_path / backward_path say which kernel a call takes)")
    print(_hopper_tiles())
    try:
        import cupy
        print(f"cupy {cupy.__version__}")
        try:
            n = cupy.cuda.runtime.getDeviceCount()
            for i in range(n):
                props = cupy.cuda.runtime.getDeviceProperties(i)
                print(f"  GPU {i}: {props['name'].decode()} (sm_{props['major']}{props['minor']})")
        except Exception as e:  # no driver or no device
            print(f"  no GPU: {e}")
        try:
            print(f"  NVRTC {'.'.join(map(str, cupy.cuda.nvrtc.getVersion()))}")
        except Exception as e:
            print(f"  NVRTC not found: {e}")
    except ImportError:
        print("cupy not installed (pip install 'flashcupy[cuda12]' or '[cuda13]')")
    from flashcupy.tools import nvrtc
    try:
        toolkits = nvrtc.toolkits()
        print("NVRTC for `python -m flashcupy kernels` (no GPU needed):")
        for t in toolkits:
            found_by = "cuda-pathfinder, as CuPy finds it" if t.found_by == "cuda-pathfinder" else t.found_by
            print(f"  {t.version} (sm_{t.archs[0]} to sm_{t.archs[-1]}): {t.nvrtc}, CUDA headers {t.include} "
                  f"({found_by})")
    except nvrtc.NvrtcError as e:
        print(f"no NVRTC for `python -m flashcupy kernels`: {e}")
    print(f"nvdisasm: {nvrtc.nvdisasm_path() or 'not found (pip install nvidia-cuda-nvdisasm cuda-pathfinder)'}")
    return 0


# ----------------------------------------------------------------------------
# check


def cmd_check(args) -> int:
    ref = oracle()
    if ref is None:
        print("check needs the float64 oracle in reference/, which ships with the source tree, "
              "not the wheel: run it from a checkout", file=sys.stderr)
        return 2
    names = args.backend or [n for n in backends.NAMES if backends.unavailable_reason(n) is None]
    for name in names:
        if backends.unavailable_reason(name) is not None:
            print(f"backend {name!r} cannot run here: {backends.unavailable_reason(name)}", file=sys.stderr)
            return 2
    battery = ref.compare.BATTERY[: args.cases] if args.cases else ref.compare.BATTERY
    failures = 0
    print(CHECK_HEADER)
    for row in check_rows(ref, names, args.dtype or default_check_dtypes(), battery):
        failures += not row["ok"]
        print(format_check_row(row))
    print(f"{'all passed' if not failures else f'{failures} FAILED'} (err/tol <= 1 passes; "
          "tolerance rule: reference/compare.py)")
    return 1 if failures else 0


# ----------------------------------------------------------------------------
# bench


def cmd_bench(args) -> int:
    from flashcupy.tools import bench

    device = "cuda" if args.device == "cuda" else "cpu"
    impls = args.impl or bench.implementations(device)
    skipped = [impl for impl in impls if not bench.supports(impl, args.window, args.bias)]
    if skipped:
        print(f"timed without score modifiers only, left out: {', '.join(skipped)}", file=sys.stderr)
        impls = [impl for impl in impls if impl not in skipped]
    results = []
    jobs = [(impl, s) for s in args.seqlen for impl in impls]
    for impl, s in bench.progress(jobs, "bench"):
        if impl == "naive-numpy" and 4 * args.batch * args.heads * s * s * 3 > args.naive_limit_gb * 2**30:
            continue  # the full score matrix (and its temporaries) would not fit
        results += bench.run_one(impl, args.batch, args.heads, s, args.head_dim, causal=args.causal,
                                  dtype=args.dtype, device=device, passes=args.passes,
                                  repeat=args.repeat, min_time=args.min_time, window=args.window, bias=args.bias)
    print(bench.format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.as_dict() for r in results], f, indent=1)
    if args.plot:
        bench.plot(results, args.plot)
        print(f"plot written to {args.plot}")
    return 0


# ----------------------------------------------------------------------------
# kernels


def _toolkits_for(arch: str) -> list:
    """The NVRTCs here that compile for `arch`, after a line on stderr for each that does not (CUDA 13 has
    nothing before sm_75), and one for each dtype whose tensor-core kernels the report leaves out (below
    its specs.TC_COMPUTE_CAPABILITY)."""
    from flashcupy.backends.cupy_backend import specs
    from flashcupy.tools import nvrtc
    toolkits = nvrtc.toolkits()
    for t in toolkits:
        if not t.compiles_for(arch):
            print(f"NVRTC {t.version} does not compile for {arch} (it does for sm_{t.archs[0]} to sm_{t.archs[-1]}): "
                  "left out", file=sys.stderr)
    for dtype, oldest in specs.TC_COMPUTE_CAPABILITY.items():
        if nvrtc.arch_number(arch) < oldest:
            print(f"below sm_{oldest} every {dtype} call takes the SIMT kernels: the {dtype} tensor-core ones "
                  "are left out", file=sys.stderr)
    return [t for t in toolkits if t.compiles_for(arch)]


def cmd_kernels(args) -> int:
    from flashcupy.backends.cupy_backend import catalog, sources, specs
    from flashcupy.tools import nvrtc
    if args.counters:
        return cmd_kernels_counters(args)
    toolkits = _toolkits_for(args.arch)
    if not toolkits:
        return 2
    cc = nvrtc.arch_number(args.arch)
    modules = None
    if args.every_modifier_set:  # every tensor-core module a device of that arch takes
        modules = catalog.taken_on(catalog.every_tc_modifier_set_modules(turing=specs.tc_turing(cc)), cc) or None
    reports = {f"NVRTC {t.version}": nvrtc.kernel_report(args.arch, t, modules) for t in toolkits}
    if args.arch.startswith("sm_90"):  # and the Hopper kernels, which are compiled for sm_90a only
        hopper = catalog.sm90_modules(every_modifier_set=args.every_modifier_set)
        reports.update({f"NVRTC {t.version}, {specs.SM90_ARCH}": nvrtc.kernel_report(specs.SM90_ARCH, t, hopper)
                        for t in toolkits})
    for t in toolkits:
        print(f"NVRTC {t.version}: {t.nvrtc}, CUDA headers {t.include}")
    options = " ".join(sources.COMPILE_OPTIONS + sources.CUPY_NVRTC_OPTIONS)
    print(f"options, as CuPy passes them: {options} -arch={args.arch} -I<that NVRTC's CUDA headers>\n")
    print(nvrtc.format_kernel_report(reports))
    exceeded = [f"{heading}: {line}" for heading, rows in reports.items() for line in nvrtc.limits_exceeded(rows)]
    limit = nvrtc.MAX_REGISTERS - nvrtc.REGISTER_MARGIN
    print("\n" + ("\n".join(["over the limits (!):"] + exceeded) if exceeded
                  else f"no kernel spills or takes more than {limit} registers"))
    return 0


def cmd_kernels_counters(args) -> int:
    """The NVRTC table as without --counters (when an NVRTC is here), then the emulator's counters
    of a small launch of each kernel and the roofline model (flashcupy/tools/perfmodel.py): the
    mma.sync and SIMT kernels on an emulated sm_80 device, the Hopper forward on an sm_90 one."""
    from flashcupy.backends.cupy_backend import catalog, specs
    from flashcupy.tools import nvrtc
    from flashcupy.tools import perfmodel
    missing = perfmodel.emulator_missing()
    if missing:
        print(f"--counters needs the CPU emulator (flashcupy/tools/emulator/), and {missing}: run it from a "
              "checkout", file=sys.stderr)
        return 2
    nvrtc_rows, heading = None, ""
    try:
        toolkits = _toolkits_for(args.arch)
        if not toolkits:
            raise nvrtc.NvrtcError(f"none for {args.arch}")
        reports = {f"NVRTC {t.version}": nvrtc.kernel_report(args.arch, t) for t in toolkits}
        if args.arch.startswith("sm_90"):  # and the Hopper kernels, which are compiled for sm_90a only
            reports.update({f"NVRTC {t.version}, {specs.SM90_ARCH}": nvrtc.kernel_report(specs.SM90_ARCH, t,
                                                                                         catalog.sm90_modules())
                            for t in toolkits})
        print(nvrtc.format_kernel_report(reports) + "\n")
        first = f"NVRTC {toolkits[0].version}"
        nvrtc_rows = reports[first] + reports.get(f"{first}, {specs.SM90_ARCH}", [])
        heading = f"{first}, {args.arch}" + (f" ({specs.SM90_ARCH} for the Hopper kernels)"
                                             if args.arch.startswith("sm_90") else "")
    except nvrtc.NvrtcError as e:
        print(f"no NVRTC here ({e}): counters only\n")

    def progress(line):
        print(line, file=sys.stderr, flush=True)

    rows = perfmodel.kernel_counters(progress=progress)
    # on sm_90 the wgmma kernels alone: the pre-pass and dQ's convert are the sm_80 rows' kind
    sm90_rows = [row for row in perfmodel.kernel_counters(progress=progress, compute_capability=perfmodel.SM90)
                 if row["kernel"].wgmma]
    print(f"Counters of the CPU emulator (flashcupy/tools/emulator/counters.py has the model), B = H = 1, "
          f"non-causal, seqlen {perfmodel.BASE}, then {2 * perfmodel.BASE} along each kernel's loop:")
    print(perfmodel.format_counters(rows + sm90_rows, nvrtc_rows, heading))
    return 0


# ----------------------------------------------------------------------------


def _arch(text: str) -> str:
    """--arch sm_XY (or sm_XYa)."""
    from flashcupy.tools import nvrtc
    try:
        nvrtc.arch_number(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _window(text: str) -> tuple:
    """--window LEFT,RIGHT: each side a whole number of keys >= 0 or 'none'."""
    sides = text.split(",")
    if len(sides) != 2:
        raise argparse.ArgumentTypeError(f"--window takes LEFT,RIGHT (e.g. 255,none), got {text!r}")
    try:
        return tuple(None if x.strip().lower() == "none" else int(x) for x in sides)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--window sides are whole numbers or 'none', got {text!r}") from None


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="flashcupy", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd")
    sub.add_parser("info", help="version, backends and why any is unavailable, GPU and compiler")

    c = sub.add_parser("check", help="every available backend against the float64 oracle")
    c.add_argument("--backend", action="append", choices=backends.NAMES)
    c.add_argument("--dtype", action="append", choices=DTYPES)
    c.add_argument("--cases", type=int, default=0, help="run only the first N cases of the battery")

    b = sub.add_parser("bench", help="forward/backward time, TFLOP/s and peak memory, side by side")
    b.add_argument("--impl", action="append", help="numpy, cupy, numba, naive-numpy, torch-sdpa")
    b.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    b.add_argument("--batch", type=int, default=1)
    b.add_argument("--heads", type=int, default=8)
    b.add_argument("--head-dim", type=int, default=64)
    b.add_argument("--seqlen", type=int, nargs="+", default=[1024, 2048, 4096])
    b.add_argument("--causal", action="store_true")
    b.add_argument("--window", type=_window, metavar="LEFT,RIGHT",
                   help="a sliding window: query i sees keys i - LEFT .. i + RIGHT, 'none' for an unbounded side "
                        "(with --causal RIGHT is 0): --causal --window 255,none")
    b.add_argument("--bias", action="store_true",
                   help="add a (1, heads, S, S) bias of the inputs' dtype; the backward computes its gradient too")
    b.add_argument("--dtype", choices=("float16", "float32", "float64"), default="float32")
    b.add_argument("--passes", nargs="+", choices=("forward", "backward"), default=["forward", "backward"])
    b.add_argument("--repeat", type=int, default=3)
    b.add_argument("--min-time", type=float, default=1.0, help="stop repeating once this many seconds are spent")
    b.add_argument("--naive-limit-gb", type=float, default=6.0, help="skip naive-numpy above this score memory")
    b.add_argument("--json", help="also write the results as JSON")
    b.add_argument("--plot", help="draw TFLOP/s and peak memory against seqlen into this PNG")

    k = sub.add_parser("kernels", help="NVRTC resource table of every CUDA kernel (no GPU needed)")
    k.add_argument("--arch", default="sm_90", type=_arch,
                   help="the architecture to compile for, sm_XY (default sm_90: and the Hopper kernels for sm_90a); "
                        "below sm_80 no bfloat16 tensor-core kernel, below sm_75 the SIMT kernels alone: what a call "
                        "takes there")
    k.add_argument("--counters", action="store_true",
                   help="also run a small launch of each kernel on the CPU emulator (a checkout's, not the wheel's) and "
                        "print its memory counters and a roofline model for A100, H100 and H200")
    k.add_argument("--every-modifier-set", action="store_true",
                   help="the tensor-core kernels (and the Hopper forward, at --arch sm_90) with each of the 32 sets "
                        "of score modifiers, not only none, the window and all of them (minutes)")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.cmd is None:  # the main job: a short check, then a short benchmark
        status = cmd_check(parser().parse_args(["check", "--cases", "3"]))
        print()
        bench = parser().parse_args(["bench", "--seqlen", "1024", "2048", "--repeat", "2", "--min-time", "0.5"])
        return status or cmd_bench(bench)
    return {"info": cmd_info, "check": cmd_check, "bench": cmd_bench, "kernels": cmd_kernels}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
