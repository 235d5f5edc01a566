"""Everything a lent GPU is for, in one command whose stages cannot take each other down.

    bash benchmarks/gpu_session.sh             # on the GPU machine (the device tool): under 7 minutes
    bash benchmarks/gpu_session.sh --dry-run   # on any CPU: the emulator in place of the GPU, tiny shapes

Stages, in this order, each in its own process with its own time limit:
  preflight  versions of everything that compiles or runs a kernel; what is missing, and why
  blocks     the building blocks on the device: the emulator's model of each PTX instruction against
             silicon; first the sm_90 blocks (mbarrier ring and phases, named barriers, elect.sync,
             setmaxnreg, wgmma GEMMs on hand-laid tiles: tests/test_hopper_gpu.py, skipped below
             compute capability 9.0),
             then the tensor-core blocks (mma, ldmatrix, cp.async, pack, ex2:
             tests/test_tensor_core_gpu.py); seconds, and first, because everything rests on it
  pytest     `pytest -m gpu`: the CuPy and Numba batteries on the device
  check      every backend, kernel path and dtype against the float64 oracle, each row on its own
  sanitizer  compute-sanitizer memcheck and racecheck on tiny shapes, where the tool is installed
  varlen     issue 28's targets (benchmarks/compare_varlen.py's gpu_timings): 1,000 packed sequences
             forward and backward in one launch per kernel beside the per-sequence path and a dense
             batch; a paged decode step beside torch SDPA on a dense cache
  sweep      forward and backward time, TFLOP/s and peak memory beside torch SDPA's flash, cuDNN
             and math backends, bfloat16 and float16, the mma.sync forward and backward beside the
             Hopper ones (cupy-mma: cupy_backend.USE_WGMMA off), the backward with deterministic=True
             (cupy-det: its first head_dim and three longest seqlens, issue 27's 0.85x of the default),
             the Hopper forward's wide key blocks and tall query tile and the backward's tall pass
             where they apply (cupy-wide, cupy-tallfwd, cupy-tall: the three longest seqlens), and the
             Numba kernels (float16, up to
             numba_max_seqlen) beside the CuPy ones; inputs made on the device once per shape and shared
             by every implementation; head_dim 128 and causal first, as they matter most; last, head_dim
             256 and 192 (wide_head_configs: the Hopper forward and backward against the mma.sync ones, at
             192 the Hopper backward's 256 kernel with its fourth atom zeroed; cupy-mma
             (64 x 16 there; two CTAs a key block in the backward), and torch's flash and cuDNN both ways; the
             first dtype, the three longest seqlens), then float32 and float64 (precise_configs: the SIMT
             kernels beside torch's memory-efficient and math backends, PRECISE_IMPLS), cut first when time
             runs short
  plot       the sweep as one PNG

The report's "Issue targets" section reads issues 26's and 27's GPU targets (TARGETS) off the sweep: each
ratio over S = 4k..16k in every dtype, met, not met or not measured in this run, and its worst cell.

Every result is appended to OUT/results.jsonl the moment it exists, and OUT/report.md is written
again after every stage, so a crash, a sticky CUDA error or a kill keeps everything before it. A
stage process that dies inside an item (an illegal address poisons its CUDA context) is started
again after that item, which the report lists as crashed. Four files in all: report.md,
results.jsonl, session.log (every stage's output) and speed.png.

The Numba parts of preflight, pytest, check and sweep (items whose key starts with "numba/") run
in processes of their own, after the others, with at least NUMBA_SHARE of the stage's time, and
with FLASHCUPY_NUMBA_SITE first on their path: the folder where gpu_session.sh installed the
wheels carried in .whl/numba/ (benchmarks/gpu_wheels.sh downloads a NumPy that numba-cuda works
with: the H200 image's numpy 2.5 broke numba-cuda 0.30.4 at its first compile). Everything else
runs on the image's own packages, as measured before. Without those wheels the Numba processes
run on the image's NumPy, and the report says so.

The dry run runs the same stages and writes the same report without a GPU: the cupy backend on
the CPU emulator (flashcupy/tools/emulator/cupy.py), Numba on its CUDA simulator, torch on the CPU where it
is installed. CI runs it (tests/test_gpu_session.py), so this script cannot rot between GPUs.
FLASHCUPY_SESSION_INJECT=STAGE:raise or STAGE:crash:N makes STAGE fail on purpose (every process
of the stage raises, or its process dies at its Nth item; numba/STAGE:crash:N, its Numba
process): the tests prove the report survives both.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import importlib.metadata
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
import zlib
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Sizes:
    """What a session measures. check_battery None: reference.compare.BATTERY, every case."""

    seqlens: tuple
    configs: tuple  # (head_dim, causal), the most important first: the sweep may be cut short
    dtypes: tuple
    tokens: int  # batch = tokens // seqlen
    hidden: int  # heads = hidden // head_dim
    check_battery: tuple | None
    math_max_seqlen: int  # torch's math backend holds the whole score matrix
    numba_max_seqlen: int  # the Numba kernels run on CUDA cores, an order of magnitude slower (float16 only)
    numba_configs: tuple  # the configs of `configs` they are timed at
    min_time: float  # seconds of timed calls per measurement, at least MIN_REPEAT calls
    max_repeat: int
    wide_configs: tuple = ((128, False), (64, False))  # where "cupy-wide" is timed (the wide key blocks apply)
    tall_configs: tuple = ((64, False), (64, True))  # where "cupy-tall" is timed (the tall backward pass applies)
    tall_forward_configs: tuple = ((64, False), (64, True))  # where "cupy-tallfwd" is timed (192 query rows apply)
    # (head_dim, causal) timed after `configs` by WIDE_HEAD_IMPLS, the first dtype and the three longest seqlens:
    # head_dim 256 and 192 (the Hopper backward's SPLIT_D at both: at 192 a quarter of its work on zeros)
    wide_head_configs: tuple = ((256, False), (192, False))
    # (head_dim, causal) timed last, in float32 and float64 (PRECISE_IMPLS: the SIMT kernels beside torch's
    # memory-efficient and math backends, the peers that take these dtypes) at precise_seqlens
    precise_configs: tuple = ((128, False), (64, True))
    precise_seqlens: tuple = (1024, 4096)
    # (head_dim, causal) timed very last with dropout (DROPOUT_IMPLS, dropout_p DROPOUT_P), the first dtype and
    # the two longest seqlens: the Hopper kernels' dropout beside the mma.sync kernels' and torch's flash
    dropout_configs: tuple = ((128, True), (128, False))
    # (head_dim, head_dim_v, causal) timed after the dropout cells (MLA_IMPLS), the first dtype and the two
    # longest seqlens: DeepSeek's MLA, v of its own head dim, on the Hopper kernels beside the mma.sync ones
    mla_configs: tuple = ((192, 128, True),)


GPU = Sizes(seqlens=(512, 1024, 2048, 4096, 8192, 16384), configs=((128, True), (128, False), (64, True), (64, False)),
            dtypes=("bfloat16", "float16"), tokens=16384, hidden=2048, check_battery=None, math_max_seqlen=4096,
            numba_max_seqlen=2048, numba_configs=((128, True), (128, False), (64, True), (64, False)), min_time=0.1,
            max_repeat=30)
# the dry run keeps the script working, its figures mean nothing: one config (the causal one, whose masks
# and key ranges the full one lacks), two lengths (a line a series in the plot)
DRY = Sizes(seqlens=(16, 32), configs=((64, True),), dtypes=("bfloat16", "float16"), tokens=32,
            hidden=64, math_max_seqlen=64, min_time=0.0, max_repeat=1,
            # Numba's simulator takes some 5-10 s a causal forward and backward at S = 16 (B = 2, H = 1)
            numba_max_seqlen=16, numba_configs=((64, True),),
            # one query and one key; then GQA, causal with Sq < Sk, head_dim 40 (tensor cores): Numba's
            # simulator runs a Python thread per CUDA thread, so the battery's larger cases take minutes
            check_battery=((1, 1, 1, 1, 1, 1, False), (1, 9, 12, 2, 1, 40, True)),
            # "cupy-wide" at its one config, where the switch changes no kernel: the code path runs
            wide_configs=((64, True),), tall_configs=((64, True),), tall_forward_configs=((64, True),),
            # float32 and float64 at the check battery's head_dim 40: the SIMT modules the check stage built
            wide_head_configs=((64, False),), precise_configs=((40, True),), precise_seqlens=(16,),
            dropout_configs=((64, True),), mla_configs=((64, 32, True),))
MIN_REPEAT = 3

# (stage, time limit in seconds); the sweep takes what the budget leaves after reserving the plot's
STAGES = (("preflight", 60), ("blocks", 90), ("pytest", 180), ("check", 150), ("sanitizer", 100),
          ("varlen", 60), ("sweep", None), ("plot", 30))
STAGE_NAMES = tuple(name for name, _ in STAGES)
MAX_RESTARTS = 4  # fresh processes for a stage whose process keeps dying inside items
# The stages with Numba items ("numba/..." keys), run in processes of their own after the others'
# (FLASHCUPY_NUMBA_SITE first on their path), which stop at 1 - NUMBA_SHARE of the stage's time
NUMBA_STAGES = ("preflight", "pytest", "check", "sweep")
NUMBA_SHARE = 0.25
GROUPS = ("main", "numba")


def group_of(key: str) -> str:
    """The process group an item runs in: "numba" for the Numba backend's items, else "main"."""
    return "numba" if key.startswith("numba/") else "main"

SWEEP_IMPLS = ("cupy", "cupy-mma", "cupy-det", "cupy-wide", "cupy-tallfwd", "cupy-tall", "numba", "torch-flash",
               "torch-cudnn", "torch-efficient", "torch-math")
WIDE_HEAD_IMPLS = ("cupy", "cupy-mma", "torch-flash", "torch-cudnn")
# float32 and float64 (Sizes.precise_configs), the scientific users' dtypes: flashcupy's SIMT kernels beside
# torch SDPA's memory-efficient backend (float32; it has no float64) and its math one (the whole score matrix);
# torch's flash and cuDNN backends take 16-bit dtypes only. Timed in no other cell ("torch-efficient")
PRECISE_IMPLS = {"float32": ("cupy", "torch-efficient", "torch-math"), "float64": ("cupy", "torch-math")}
# Dropout (Sizes.dropout_configs): flashcupy's on the Hopper kernels ("cupy" on an sm_90) and the mma.sync ones,
# beside torch's flash backend with its own; recorded as "<impl>+dropout". Timed in no other cell
DROPOUT_IMPLS = ("cupy", "cupy-mma", "torch-flash")
DROPOUT_P = 0.1
# MLA (Sizes.mla_configs): flashcupy's Hopper kernels ("cupy" on an sm_90, their tiles at the larger head dim)
# and the mma.sync ones, beside cuDNN's (torch's flash backend asks for one head dim); recorded as
# "<impl>+mla", with head_dim_v. Timed in no other cell
MLA_IMPLS = ("cupy", "cupy-mma", "torch-cudnn")
# "cupy-mma" beside "cupy": on compute capability 9.0 "cupy" runs the Hopper forward and backward
# (flash_fwd_sm90.cu, flash_bwd_sm90.cu), "cupy-mma" the mma.sync ones they replace (flash_fwd_tc.cu,
# flash_bwd_tc.cu: USE_WGMMA off), in the same run; below 9.0 they are the same kernels.
# "cupy-wide": the Hopper forward with FA3's wider key blocks (cupy_backend.SM90_WIDE), where they apply
# (not causal), at the three longest seqlens: whether they should be the default. "cupy-tallfwd": the Hopper
# forward with FA3's 192 query rows at head_dim 64, three consumer warpgroups (cupy_backend.SM90_TALL_FORWARD),
# "cupy-tall": the Hopper backward with FA3's 128-row pass at head_dim 64 (cupy_backend.SM90_TALL_BACKWARD),
# the same way

# Issues 26's and 27's GPU targets, one row each: (issue, pass, head_dim, the causal values, mine, other, at
# least): over the sweep's cells of that pass and head_dim at S = 4k..16k (TARGET_SEQLENS), every dtype timed,
# mine's TFLOP/s over other's in the same run. The report's "Issue targets" section says whether each is met
TARGETS = (
    (26, "forward", 128, (False,), "cupy", "torch-cudnn", 1.0),
    (26, "forward", 128, (False,), "cupy", "torch-flash", 1.7),
    (26, "forward", 64, (False,), "cupy", "torch-cudnn", 1.0),
    (26, "forward", 128, (True,), "cupy", "torch-cudnn", 0.9),
    (26, "forward", 64, (True,), "cupy", "torch-cudnn", 0.9),
    (27, "backward", 128, (False, True), "cupy", "torch-cudnn", 1.0),
    (27, "backward", 128, (False, True), "cupy", "torch-flash", 1.6),
    (27, "backward", 128, (False, True), "cupy-det", "cupy", 0.85),  # deterministic=True beside the default
)
TARGET_SEQLENS = (4096, 16384)  # inclusive


# ----------------------------------------------------------------------------
# results: one JSON record a line, appended as it happens


def _plain(value):
    """NumPy scalars as Python numbers (a NumPy bool would otherwise be written as the string 'True')."""
    return value.item() if hasattr(value, "item") else str(value)


class Results:
    def __init__(self, out_dir: str):
        self.path = os.path.join(out_dir, "results.jsonl")

    def add(self, **record) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, default=_plain) + "\n")

    def read(self) -> list:
        if not os.path.exists(self.path):
            return []
        with open(self.path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]


# ----------------------------------------------------------------------------
# the stage processes (`gpu_session.py --worker STAGE`): items, each begun and ended in the record


def _injected(stage: str, group: str = "main"):
    """('raise',) or ('crash', n) when FLASHCUPY_SESSION_INJECT names this stage (and for a crash,
    this process group: numba/STAGE for the Numba process), else None."""
    spec = os.environ.get("FLASHCUPY_SESSION_INJECT", "")
    parts = spec.split(":")
    if parts[0] not in (stage, f"numba/{stage}"):
        return None
    if parts[1:] == ["raise"]:
        return ("raise",)
    if len(parts) == 3 and parts[1] == "crash":
        return ("crash", int(parts[2])) if parts[0] == (stage if group == "main" else f"numba/{stage}") else None
    raise ValueError(f"FLASHCUPY_SESSION_INJECT must be [numba/]STAGE:raise or STAGE:crash:N, got {spec!r}")


def _device_healthy(dry: bool) -> bool:
    """False once the CUDA context is poisoned (a sticky error): the stage must go on in a new process."""
    if dry:
        return True
    try:
        import cupy
        cupy.cuda.runtime.deviceSynchronize()
        return True
    except Exception:
        return False


def _watchdog(deadline: float) -> None:
    """End this process when its driver is gone or its time is well past: a stage process runs
    in a session of its own, so nothing else would stop it."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent and time.time() < deadline + 10:
            time.sleep(1)
        os._exit(124)

    threading.Thread(target=watch, daemon=True).start()


def run_worker(stage: str, args) -> int:
    results = Results(args.out)
    inject = _injected(stage, args.group)
    if inject == ("raise",):
        raise RuntimeError(f"stage {stage!r} failed on purpose (FLASHCUPY_SESSION_INJECT)")
    deadline = float(os.environ.get("FLASHCUPY_SESSION_DEADLINE", "inf"))
    _watchdog(deadline)
    begun = {r["key"] for r in results.read() if r.get("stage") == stage and r["type"] == "begin"}
    if args.dry_run and args.group == "numba":
        sys.setswitchinterval(2e-4)  # 3-4x faster: the simulator's barriers busy-poll its Python threads
    with contextlib.ExitStack() as stack:
        if args.dry_run and stage in ("check", "varlen", "sweep"):
            stack.enter_context(_emulated())
        index = 0
        for key, run in WORKERS[stage](args):
            if group_of(key) != args.group:  # the other process group's
                continue
            index += 1
            if key in begun:  # done, or crashed a process before this one
                continue
            if time.time() > deadline - 3:
                results.add(stage=stage, type="cut", key=key, note="out of time: this item and the rest not run")
                break
            results.add(stage=stage, type="begin", key=key, t=time.time())
            if inject == ("crash", index):
                os._exit(70)  # what an illegal address does to a process, minus the GPU
            try:
                for record in run():
                    results.add(stage=stage, key=key, **record)
            except Exception as e:
                results.add(stage=stage, type="error", key=key, error=f"{type(e).__name__}: {e}",
                            traceback=traceback.format_exc(limit=-4))
                if not _device_healthy(args.dry_run):
                    return 3
            results.add(stage=stage, type="end", key=key, t=time.time())
    return 0


@contextlib.contextmanager
def _emulated():
    """The dry run's device: the cupy backend on the CPU emulator, an sm_90 as the H200 (Numba's
    simulator is chosen by NUMBA_ENABLE_CUDASIM in the environment, before numba is imported)."""
    from flashcupy.tools.emulator.cupy import emulated
    with emulated(compute_capability=90):
        yield


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
        return True
    except ImportError:
        return False


def preflight_items(args):
    def environment():
        import numpy as np

        import flashcupy
        from flashcupy import backends
        from flashcupy.backends.cupy_backend import cubin
        env = {"type": "env", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "dry_run": args.dry_run,
               "python": platform.python_version(), "numpy": np.__version__, "numpy_file": np.__file__,
               "flashcupy": flashcupy.__version__,
               "gpu": "none: dry run on the CPU emulator" if args.dry_run else None}
        for dist in ("cupy-cuda12x", "cupy-cuda13x", "numba", "numba-cuda", "torch", "ml_dtypes", "pytest",
                     "hypothesis", "cuda-pathfinder", "cuda-bindings", "matplotlib"):
            env[dist] = _version(dist)
        env["compute-sanitizer"] = shutil.which("compute-sanitizer")
        env["backends"] = {n: backends.unavailable_reason(n) or "available" for n in backends.NAMES}
        env["cuda_headers"] = cubin.cuda_headers() or "not found"  # for the sm_90a modules; CuPy finds its own
        if not args.dry_run:
            import cupy
            props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
            env.update(gpu=props["name"].decode(), sm=f"{props['major']}{props['minor']}",
                       multiprocessors=props["multiProcessorCount"], memory_gib=round(props["totalGlobalMem"] / 2**30, 1),
                       driver=cupy.cuda.runtime.driverGetVersion(), cuda_runtime=cupy.cuda.runtime.runtimeGetVersion(),
                       cupy_nvrtc=".".join(map(str, cupy.cuda.nvrtc.getVersion())))
            if env["backends"]["numba"] == "available":
                from numba.cuda.cudadrv import nvvm
                env["nvvm"] = ".".join(map(str, nvvm.NVVM().get_version()))
            if _version("torch"):
                import torch
                env.update(torch_cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
        missing = [m for m in ("pytest", "ml_dtypes", "hypothesis") if not _importable(m)]
        if missing and not args.dry_run:  # the session's tests need them; a package mirror may have them
            done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--retries", "0", "--timeout", "10",
                                   *missing], capture_output=True, text=True)
            env["installed"] = {"packages": missing, "returncode": done.returncode, "stderr": done.stderr[-500:]}
        return [env]

    def numba_environment():
        """What the Numba processes import: NumPy from the carried wheels' folder, or the image's."""
        import numpy as np

        from flashcupy import backends
        site = os.environ.get("FLASHCUPY_NUMBA_SITE")
        carried = sorted(n[:-len(".dist-info")] for n in os.listdir(site) if n.endswith(".dist-info")) if site else []
        numpy_from = "the carried wheels" if site and os.path.abspath(np.__file__).startswith(os.path.abspath(site)) \
            else "the image (no wheels carried in .whl/numba/: bash benchmarks/gpu_wheels.sh)" if not site \
            else "the image, not the carried wheels"
        return [{"type": "numba-env", "numpy": np.__version__, "numpy_from": numpy_from, "numpy_file": np.__file__,
                 "carried": carried, "site": site, "numba": _version("numba"), "numba-cuda": _version("numba-cuda"),
                 "backend": backends.unavailable_reason("numba") or "available"}]

    yield "environment", environment
    yield "numba/environment", numba_environment


def check_items(args):
    """Every backend x kernel path x dtype x battery case; each an item of its own."""
    import numpy as np

    from flashcupy import backends
    from flashcupy.tools import check
    from flashcupy.backends import cupy_backend
    from flashcupy.backends.cupy_backend import specs
    ref = check.oracle()
    sizes = DRY if args.dry_run else GPU
    battery = sizes.check_battery or ref.compare.BATTERY
    for backend, path in (("cupy", "hopper"), ("cupy", "tensor-core"), ("cupy", "simt"), ("numba", "simt")):
        if group_of(f"{backend}/") != args.group:  # the other process group's: its availability is not ours
            continue
        reason = backends.unavailable_reason(backend)
        if reason is not None:
            yield f"{backend}/{path}", lambda backend=backend, reason=reason: [
                {"type": "unavailable", "impl": backend, "reason": reason}]
            continue
        for dtype in backends.module(backend).DTYPES:
            for case in battery:
                # the Hopper and tensor-core forwards and backwards also take head_dim 136..256
                eligible = (specs.sm90_eligible(dtype, case[5], 0) if path == "hopper"
                            else specs.tensor_core_eligible(dtype, case[5]))
                if path != "simt" and not eligible:
                    continue  # the SIMT group covers it
                key = f"{backend}/{path}/{dtype}/{case}"

                def run(backend=backend, path=path, dtype=dtype, case=case, key=key):
                    # "hopper": the Hopper forward where the device is an sm_90 (the mma.sync one below it)
                    cupy_backend.USE_TENSOR_CORES = path != "simt"
                    cupy_backend.USE_WGMMA = path == "hopper"
                    rng = np.random.default_rng(zlib.crc32(key.encode()))
                    row = check.check_case(ref, backend, dtype, case, rng)
                    return [{"type": "check", **row, "path": path, "case": list(case)}]

                yield key, run


def _device_inputs(shape_kv, shape_q, dtype, seed, dry, head_dim_v=None):
    """q, k, v, dout, random normal, made where the kernels run: bfloat16 as uint16 bit patterns
    (rounded to nearest even), which is how CuPy holds it; v and dout of head_dim_v where given."""
    if dry:
        import numpy as xp
        rng = xp.random.default_rng(seed)
        normal = lambda shape: rng.standard_normal(shape, dtype=xp.float32)  # noqa: E731
    else:
        import cupy as xp
        rng = xp.random.default_rng(seed)
        normal = lambda shape: rng.standard_normal(shape, dtype=xp.float32)  # noqa: E731
    arrays = []
    v_dim = (lambda shape: shape) if head_dim_v is None else (lambda shape: tuple(shape[:-1]) + (head_dim_v,))
    for shape in (shape_q, shape_kv, v_dim(shape_kv), v_dim(shape_q)):
        x = normal(shape)
        if dtype == "bfloat16":
            bits = x.view(xp.uint32)
            x = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(xp.uint16)
        else:
            x = x.astype(dtype)
        arrays.append(x)
    return arrays


def _median_seconds(fn, dry: bool, sizes: Sizes) -> float:
    """The median of timed calls after one warm-up call (which also compiles): CUDA events on
    the current stream on a GPU; the host clock in the dry run, without the warm-up (its figures
    mean nothing, and a call on Numba's simulator takes seconds)."""
    times = []
    if not dry:
        fn()
        import cupy
        cupy.cuda.get_current_stream().synchronize()
    while len(times) < sizes.max_repeat and (len(times) < min(MIN_REPEAT, sizes.max_repeat)
                                            or sum(times) < sizes.min_time):
        if dry:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        else:
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, end) / 1e3)
    times.sort()
    return times[len(times) // 2]


BACK_TO_BACK_CALLS = 5  # calls issued one after another for the host / back-to-back figures (GPU)
BACK_TO_BACK_IMPLS = ("cupy", "cupy-det", "cupy-wide", "cupy-tallfwd", "torch-flash", "torch-cudnn")  # the targets' (issues 26, 27)


def _host_and_back_to_back(fn, dry: bool) -> tuple:
    """bench.host_and_back_to_back on a GPU; the dry run: one call, the host clock for both."""
    if not dry:
        from flashcupy.tools import bench
        return bench.host_and_back_to_back(fn, BACK_TO_BACK_CALLS, warm_up=False)  # warmed by the median
    t0 = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    return seconds, seconds


def with_switch(call_cupy, switch: str, value: bool):
    """The cupy forward or backward `call_cupy` (a closure of bench.closures) with cupy_backend's `switch`
    set to `value` for the call: USE_WGMMA off, the mma.sync kernels whatever the device; SM90_WIDE on,
    the Hopper forward's wide key block; SM90_TALL_FORWARD on, its 192 query rows; SM90_TALL_BACKWARD on,
    the Hopper backward's tall pass."""
    from flashcupy.backends import cupy_backend

    def call():
        saved = getattr(cupy_backend, switch)
        setattr(cupy_backend, switch, value)
        try:
            return call_cupy()
        finally:
            setattr(cupy_backend, switch, saved)
    return call


def on_mma(call_cupy):
    """`call_cupy` on the mma.sync kernels (cupy_backend.USE_WGMMA off for the call)."""
    return with_switch(call_cupy, "USE_WGMMA", False)


def sweep_items(args):
    from flashcupy import backends
    from flashcupy._problem import default_scale
    from flashcupy.tools import bench
    sizes = DRY if args.dry_run else GPU
    device = "cpu" if args.dry_run else "cuda"
    impls, missing = [], []
    for impl in SWEEP_IMPLS:
        if group_of(f"{impl}/") != args.group:  # the other process group's: its availability is not ours
            continue
        reason = (backends.unavailable_reason(impl.split("-")[0]) if impl.split("-")[0] in backends.NAMES
                  else bench.torch_available())
        if reason is None and impl in ("torch-cudnn", "torch-efficient") and args.dry_run:
            reason = f"torch's {impl.split('-')[1]} attention needs a GPU"
        if reason is None:
            impls.append(impl)
        elif impl == "cupy" or not impl.startswith(("cupy-", "torch-math")):  # the others said by cupy, torch-*
            missing.append((impl, reason))
    inputs = {}  # the current shape's inputs, shared by every implementation

    def measure(impl, dtype, D, causal, S, dropout_p=0.0, Dv=None):
        B, H = sizes.tokens // S, sizes.hidden // D
        shape = (dtype, B, S, H, D) + (() if Dv is None else (Dv,))
        if shape not in inputs:
            inputs.clear()
            inputs[shape] = _device_inputs((B, S, H, D), (B, S, H, D), dtype, zlib.crc32(repr(shape).encode()),
                                           args.dry_run, head_dim_v=Dv)
        q, k, v, dout = inputs[shape]
        forward, backward = bench.closures(impl.split("-")[0] if impl.startswith("cupy") else impl, q, k, v, dout,
                                           causal, default_scale(D), device, bf16_bits=dtype == "bfloat16",
                                           deterministic=impl == "cupy-det", dropout_p=dropout_p)
        if impl == "cupy-mma":
            forward, backward = on_mma(forward), on_mma(backward)
        # cupy-det, cupy-tall: the backward alone (their forward is cupy's); cupy-wide, cupy-tallfwd: the forward
        passes = {"cupy-det": (("backward", backward),),
                  "cupy-wide": (("forward", with_switch(forward, "SM90_WIDE", True)),),
                  "cupy-tallfwd": (("forward", with_switch(forward, "SM90_TALL_FORWARD", True)),),
                  "cupy-tall": (("backward", with_switch(backward, "SM90_TALL_BACKWARD", True)),)}.get(
            impl, (("forward", forward), ("backward", backward)) if backward else (("forward", forward),))
        records = []
        for pass_, fn in passes:
            seconds = _median_seconds(fn, args.dry_run, sizes)
            # (the host table shows the plain calls': none with dropout or MLA's head dims, so none measured)
            host, b2b = (_host_and_back_to_back(fn, args.dry_run)
                         if impl in BACK_TO_BACK_IMPLS and not dropout_p and Dv is None else (None, None))
            peak = None if args.dry_run else bench.gpu_peak(fn, impl)
            flops = bench.flops(B, H, S, D, causal, pass_, head_dim_v=Dv)
            name = f"{impl}+dropout" if dropout_p else f"{impl}+mla" if Dv is not None else impl
            records.append({"type": "timing", "impl": name, "pass": pass_, "dtype": dtype, "head_dim": D,
                            "head_dim_v": Dv,
                            "causal": causal, "seqlen": S, "batch": B, "heads": H, "seconds": seconds,
                            "tflops": flops / seconds / 1e12, "peak_bytes": peak, "host_seconds": host,
                            "b2b_tflops": None if b2b is None else flops / b2b / 1e12})
        return records

    for D, causal in sizes.configs + sizes.wide_head_configs:
        wide_head = (D, causal) in sizes.wide_head_configs
        for dtype in sizes.dtypes[:1] if wide_head else sizes.dtypes:
            for S in sorted(sizes.seqlens)[-3:] if wide_head else sizes.seqlens:
                for impl in impls:
                    if (wide_head and impl not in WIDE_HEAD_IMPLS) or impl == "torch-efficient":
                        continue
                    if impl == "numba" and (dtype == "bfloat16" or S > sizes.numba_max_seqlen
                                            or (D, causal) not in sizes.numba_configs):
                        continue  # numba has no bfloat16 arithmetic
                    if impl == "torch-math" and S > sizes.math_max_seqlen:
                        continue
                    if impl == "cupy-det" and (D != sizes.configs[0][0] or S not in sorted(sizes.seqlens)[-3:]):
                        continue  # issue 27's shapes: head_dim 128, S = 4k .. 16k
                    if impl == "cupy-wide" and ((D, causal) not in sizes.wide_configs
                                                or S not in sorted(sizes.seqlens)[-3:]):
                        continue  # where the wide key block applies (specs.sm90_forward_tile), S = 4k .. 16k
                    if impl == "cupy-tallfwd" and ((D, causal) not in sizes.tall_forward_configs
                                                   or S not in sorted(sizes.seqlens)[-3:]):
                        continue  # where the 192 query rows apply (specs.sm90_forward_tile), S = 4k .. 16k
                    if impl == "cupy-tall" and ((D, causal) not in sizes.tall_configs
                                                or S not in sorted(sizes.seqlens)[-3:]):
                        continue  # where the tall pass applies (specs.sm90_backward_tile), S = 4k .. 16k
                    key = f"{impl}/{dtype}/D{D}/{'causal' if causal else 'full'}/S{S}"
                    yield key, functools.partial(measure, impl, dtype, D, causal, S)
    for D, causal in sizes.precise_configs:
        for dtype, names in PRECISE_IMPLS.items():
            for S in sizes.precise_seqlens:
                for impl in impls:
                    if impl in names and not (impl == "torch-math" and S > sizes.math_max_seqlen):
                        key = f"{impl}/{dtype}/D{D}/{'causal' if causal else 'full'}/S{S}"
                        yield key, functools.partial(measure, impl, dtype, D, causal, S)
    for D, causal in sizes.dropout_configs:
        for S in sorted(sizes.seqlens)[-2:]:
            for impl in impls:
                # torch's flash backend takes dropout on a GPU only (on a CPU: "No available kernel")
                if impl in DROPOUT_IMPLS and not (impl.startswith("torch") and args.dry_run):
                    key = f"{impl}+dropout/{sizes.dtypes[0]}/D{D}/{'causal' if causal else 'full'}/S{S}"
                    yield key, functools.partial(measure, impl, sizes.dtypes[0], D, causal, S, DROPOUT_P)
    for D, Dv, causal in sizes.mla_configs:
        for S in sorted(sizes.seqlens)[-2:]:
            for impl in impls:
                if impl in MLA_IMPLS:
                    key = f"{impl}+mla/{sizes.dtypes[0]}/D{D}v{Dv}/{'causal' if causal else 'full'}/S{S}"
                    yield key, functools.partial(measure, impl, sizes.dtypes[0], D, causal, S, 0.0, Dv)
    for impl, reason in missing:
        yield "numba/unavailable" if impl == "numba" else f"unavailable/{impl}", lambda impl=impl, reason=reason: [
            {"type": "unavailable", "impl": impl, "reason": reason}]


def varlen_items(args):
    """Issue 28's GPU targets (compare_varlen.gpu_timings: a packed batch in one launch per kernel beside
    the per-sequence path and a dense batch, a paged decode step beside torch SDPA), one item."""
    sizes = DRY if args.dry_run else GPU

    def run():
        import compare_varlen
        if args.dry_run:
            import numpy as xp
        else:
            import cupy as xp
        shapes = compare_varlen.DRY_SHAPES if args.dry_run else compare_varlen.GPU_SHAPES
        return list(compare_varlen.gpu_timings(lambda fn: _median_seconds(fn, args.dry_run, sizes), xp, shapes))

    yield "varlen/timings", run


def plot_items(args):
    def draw():
        timings = [r for r in Results(args.out).read() if r["type"] == "timing"]
        if not timings:
            return [{"type": "plot", "file": None, "note": "no timings to draw"}]
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        configs = sorted({(r["head_dim"], r.get("head_dim_v"), r["causal"]) for r in timings},
                         key=lambda c: (-c[0], c[1] is not None, not c[2]))
        impls = sorted({r["impl"] for r in timings}, key=lambda i: (i.startswith("torch"), i))
        # tab20's 20 colours: the default cycle's 10 are fewer than the implementations a GPU session times
        colors = {impl: plt.get_cmap("tab20")(n % 20) for n, impl in enumerate(impls)}
        rows = ("forward", "backward", "memory")
        fig, axes = plt.subplots(len(rows), len(configs), figsize=(4.2 * len(configs), 9.5), squeeze=False)
        for col, (D, Dv, causal) in enumerate(configs):
            for row, what in enumerate(rows):
                ax = axes[row][col]
                for impl in impls:
                    for dtype, style in (("bfloat16", "-o"), ("float16", "--s")):
                        pass_ = "backward" if what == "memory" else what
                        rs = sorted((r for r in timings if (r["impl"], r["dtype"], r["head_dim"], r.get("head_dim_v"),
                                                            r["causal"], r["pass"]) == (impl, dtype, D, Dv, causal,
                                                                                        pass_)),
                                    key=lambda r: r["seqlen"])
                        points = [(r["seqlen"], r["peak_bytes"] / 2**20 if what == "memory" else r["tflops"])
                                  for r in rs if what != "memory" or r["peak_bytes"]]
                        if points:
                            ax.plot(*zip(*points), style, color=colors[impl], markersize=3,
                                    label=f"{'flashcupy ' if not impl.startswith('torch') else ''}{impl} {dtype}")
                ax.set_xscale("log", base=2)
                ax.grid(True, alpha=0.3)
                ax.set_title(f"{what}, D={D}{'' if Dv is None else f', Dv={Dv}'}{' causal' if causal else ''}",
                             fontsize=9)
                ax.set_ylabel("backward peak extra MiB" if what == "memory" else "TFLOP/s")
                if what == "memory":
                    ax.set_yscale("log")
                    ax.set_xlabel("sequence length")
        axes[0][0].legend(fontsize=6)
        fig.tight_layout()
        path = os.path.join(args.out, "speed.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return [{"type": "plot", "file": "speed.png"}]

    yield "plot", draw


WORKERS = {"preflight": preflight_items, "check": check_items, "varlen": varlen_items, "sweep": sweep_items,
           "plot": plot_items}


# ----------------------------------------------------------------------------
# the driver


def _stage_env(args, deadline: float) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", FLASHCUPY_SESSION_DEADLINE=str(deadline))
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    if args.dry_run:
        env.update(NUMBA_ENABLE_CUDASIM="1", FLASHCUPY_BLOCKS_DEVICE="emulator")
    return env


def _group_env(env: dict, group: str) -> dict:
    """A stage's environment for one process group: the Numba processes find the packages of
    FLASHCUPY_NUMBA_SITE (the carried NumPy, gpu_session.sh) before the image's."""
    site = env.get("FLASHCUPY_NUMBA_SITE")
    if group != "numba" or not site:
        return env
    root, *rest = env["PYTHONPATH"].split(os.pathsep)
    return dict(env, PYTHONPATH=os.pathsep.join([root, site, *rest]))


def _groups(stage: str, start: float, limit: float) -> list:
    """(group, deadline) for each process group of a stage, in the order they run: the main one
    stops at 1 - NUMBA_SHARE of the limit where the Numba processes follow, which take the rest."""
    if stage not in NUMBA_STAGES:
        return [("main", start + limit)]
    return [("main", start + limit * (1 - NUMBA_SHARE)), ("numba", start + limit)]


def _combined(statuses: dict) -> str:
    """A stage's status from its process groups' ({group: status}): the main group's alone where
    the Numba processes' is "ok"; a failure or timeout of either first, so that it counts."""
    if set(statuses) == {"main"} or statuses.get("numba") == "ok":
        return statuses["main"]
    label = {"main": "main", "numba": "Numba processes"}
    bad = {g: x for g, x in statuses.items() if not x.startswith("ok")}
    detail = "; ".join(f"{label[g]}: {x}" for g, x in statuses.items() if x != "ok")
    if not bad:
        return f"ok ({detail})"
    return ("timeout" if all(x == "timeout" for x in bad.values()) else "failed") + f" ({detail})"


def _run(command, env, limit: float, log) -> tuple:
    """(returncode or None on timeout, output) of `command` in a session of its own, so a timeout
    kills everything it started."""
    start = log.tell()
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        code = proc.wait(timeout=max(limit, 1))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        code = None
    log.flush()
    with open(log.name, "rb") as f:
        f.seek(start)
        output = f.read().decode(errors="replace")
    return code, output


# the sm_90 synchronisation blocks first: the Hopper kernels' emulator models rest on them
PYTEST_FILES = {"blocks": {"main": ["tests/test_hopper_gpu.py", "tests/test_tensor_core_gpu.py"]},
                "pytest": {"main": ["tests/test_cupy_gpu.py"],
                           "numba": ["tests/test_contract_numba.py", "tests/test_numba_backend.py"]}}


def _pytest_stage(stage, args, env, limit, log, results):
    statuses = {}
    for group, deadline in _groups(stage, time.time(), limit):
        # one process a group, without setup.cfg's addopts: its "-n auto" would start a pytest-xdist
        # worker, and a CUDA context, per CPU of the device machine, and fail where pytest-xdist is missing
        code, output = _run([sys.executable, "-m", "pytest", "-o", "addopts=", "-m", "gpu", "-q", "-p",
                             "no:cacheprovider", *PYTEST_FILES[stage][group]], _group_env(env, group),
                            deadline - time.time(), log)
        lines = output.strip().splitlines()
        summary = lines[-1] if lines else ""
        failed = [line.split(" ", 1)[1].split(" - ")[0] for line in lines if line.startswith(("FAILED ", "ERROR "))]
        results.add(stage=stage, type="pytest", group=group, files=PYTEST_FILES[stage][group], returncode=code,
                    summary=summary, failed=failed[:30],
                    failed_count=len(failed))
        statuses[group] = ("timeout" if code is None else "failed: pytest ran no tests" if code == 5
                           else "ok" if code == 0 else f"failed: {len(failed)} tests")
    return _combined(statuses)


def _sanitizer_stage(stage, args, env, limit, log, results):
    tool = shutil.which("compute-sanitizer")
    if tool is None:
        return "skipped: compute-sanitizer not found" + (" (dry run: no GPU)" if args.dry_run else "")
    status = "ok"
    for check in ("memcheck", "racecheck"):
        # kernels' errors only: cuda-bindings probes driver entry points with cuGetProcAddress, which the
        # default reports as 34 API errors (benchmarks/results/h200_sm90/README.md)
        code, output = _run([tool, "--tool", check, "--report-api-errors", "no", "--error-exitcode", "9",
                             sys.executable, "-m", "flashcupy",
                             "check", "--backend", "cupy", "--cases", "3", "--dtype", "float16",
                             "--dtype", "bfloat16", "--dtype", "float32"], env, limit / 2, log)
        summary = [line for line in output.splitlines() if "SUMMARY" in line]
        results.add(stage=stage, type="sanitizer", tool=check, returncode=code,
                    summary=summary[-1] if summary else output.strip().splitlines()[-1:])
        if code != 0:
            status = "failed: " + ("timeout" if code is None else f"{check} exit {code}")
    return status


def _worker_stage(stage, args, env, limit, log, results):
    """A worker stage: a process for each process group, each restarted in a fresh process after
    each item that killed it."""
    return _combined({group: _worker_group(stage, group, args, _group_env(env, group), deadline, log, results)
                      for group, deadline in _groups(stage, time.time(), limit)})


def _worker_group(stage, group, args, env, deadline, log, results):
    for attempt in range(MAX_RESTARTS + 1):
        command = [sys.executable, os.path.abspath(__file__), "--worker", stage, "--group", group, "--out",
                   args.out] + (["--dry-run"] if args.dry_run else [])
        code, output = _run(command, dict(env, FLASHCUPY_SESSION_DEADLINE=str(deadline)),
                            deadline - time.time(), log)
        records = [r for r in results.read() if r.get("stage") == stage and group_of(r.get("key", "")) == group]
        ended = {r["key"] for r in records if r["type"] == "end"}
        open_items = [r["key"] for r in records if r["type"] == "begin" and r["key"] not in ended]
        for key in open_items:
            if not any(r["type"] == "crash" and r["key"] == key for r in records):
                results.add(stage=stage, type="crash", key=key, returncode=code,
                            output=output.strip().splitlines()[-6:])
        if code == 0:
            return "ok" + (f" after {attempt} restart(s)" if attempt else "")
        if code is None:
            return "timeout"
        if not open_items:  # it failed outside any item: starting again would fail the same way
            tail = "\n".join(output.strip().splitlines()[-3:])
            results.add(stage=stage, type="error", key=stage if group == "main" else f"numba/{stage}", error=tail)
            return f"failed: exit {code}"
        if time.time() > deadline - 5:
            return "timeout"
    return f"failed: {MAX_RESTARTS + 1} processes died"


def main_driver(args) -> int:
    os.makedirs(args.out, exist_ok=True)
    for name in ("results.jsonl", "report.md", "session.log", "speed.png"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(args.out, name))
    results = Results(args.out)
    only = args.only.split(",") if args.only else STAGE_NAMES
    unknown = sorted(set(only) - set(STAGE_NAMES))
    if unknown:
        raise ValueError(f"--only: unknown stages {unknown}; the stages are {', '.join(STAGE_NAMES)}")
    start = time.time()
    end = start + args.budget
    plot_reserve = 30 if "plot" in only else 0
    log = open(os.path.join(args.out, "session.log"), "a+b")
    failures = 0
    for stage, limit in STAGES:
        if stage not in only:
            continue
        remaining = end - time.time() - (plot_reserve if stage != "plot" else 0)
        limit = remaining if limit is None else min(limit, remaining)
        t0 = time.time()
        print(f"[{t0 - start:5.0f} s] {stage} (limit {max(limit, 0):.0f} s)", flush=True)
        log.write(f"\n===== {stage} =====\n".encode())
        log.flush()
        if limit < 5:
            status = "skipped: out of time"
        else:
            env = _stage_env(args, t0 + limit)
            runner = {"blocks": _pytest_stage, "pytest": _pytest_stage, "sanitizer": _sanitizer_stage}.get(
                stage, _worker_stage)
            try:
                status = runner(stage, args, env, limit, log, results)
            except Exception as e:  # the driver itself must go on to the next stage
                status = f"failed: {type(e).__name__}: {e}"
        failures += status.startswith(("failed", "timeout"))
        results.add(stage=stage, type="stage", status=status, seconds=round(time.time() - t0, 1))
        print(f"        {stage}: {status}", flush=True)
        with open(os.path.join(args.out, "report.md"), "w", encoding="utf-8") as f:
            f.write(render(results.read()))
    log.close()
    records = results.read()
    bad = sum(r["type"] in ("error", "crash") or (r["type"] == "check" and not r["ok"]) for r in records)
    print(f"[{time.time() - start:5.0f} s] report: {os.path.join(args.out, 'report.md')}; "
          f"{failures} stage(s) failed, {bad} item(s) failed")
    print(short_table(records))
    return 1 if failures or bad else 0


# ----------------------------------------------------------------------------
# the report, from the records alone


def _fmt_case(case) -> str:
    return "(" + ", ".join(str(c) for c in case) + ")"


def render(records) -> str:
    env = next((r for r in records if r["type"] == "env"), {})
    gpu = env.get("gpu") or "GPU unknown (preflight did not finish)"
    title = f"# flashcupy GPU session: {gpu}" + (f" (sm_{env['sm']})" if env.get("sm") else "")
    lines = [title, "", f"{env.get('date', '')}" + (" · **dry run**: no GPU, every figure below is from the "
                                                     "CPU emulator and means nothing about speed" if env.get("dry_run") else ""), ""]
    if env:
        shown = {k: v for k, v in env.items() if k not in ("type", "stage", "key", "date", "dry_run", "gpu", "backends",
                                                           "numpy_file") and v is not None}
        lines += ["Environment: " + ", ".join(f"{k} {v}" for k, v in shown.items()), "",
                  "Backends: " + ", ".join(f"{k}: {v}" for k, v in env.get("backends", {}).items()), ""]
    numba = next((r for r in records if r["type"] == "numba-env"), None)
    if numba:
        lines += [f"Numba processes: numpy {numba['numpy']} from {numba['numpy_from']}"
                  + (f" ({', '.join(numba['carried'])} in {numba['site']})" if numba["carried"] else "")
                  + f", numba {numba['numba']}, numba-cuda {numba['numba-cuda']}; the numba backend: {numba['backend']}",
                  ""]
    lines += ["## Stages", "", "| stage | status | seconds |", "|---|---|---|"]
    lines += [f"| {r['stage']} | {r['status']} | {r['seconds']} |" for r in records if r["type"] == "stage"]
    lines.append("")
    tests = [r for r in records if r["type"] == "pytest"]
    if tests:
        lines += ["## Tests on the device", ""]
        for r in tests:
            lines.append(f"- {r['stage']}{' (Numba processes)' if r.get('group') == 'numba' else ''}: {r['summary']}"
                         + (f" (exit {r['returncode']})" if r["returncode"] else ""))
            lines += [f"  - FAILED {name}" for name in r["failed"]]
            if r["failed_count"] > len(r["failed"]):
                lines.append(f"  - ... and {r['failed_count'] - len(r['failed'])} more")
        lines.append("")
    checks = [r for r in records if r["type"] == "check"]
    if checks:
        lines += ["## Correctness against the float64 oracle", "",
                  "Worst error / tolerance over out, lse, dq, dk, dv (tolerance rule: reference/compare.py; "
                  "<= 1 passes).", "", "| backend | path | dtype | case (B, Sq, Sk, Hq, Hkv, D, causal) | err/tol | |",
                  "|---|---|---|---|---|---|"]
        for r in checks:
            detail = f"{r['worst']:.3f}" if "error" not in r else r["error"]
            lines.append(f"| {r['backend']} | {r['path']} | {r['dtype']} | {_fmt_case(r['case'])} | {detail} | "
                         f"{'ok' if r['ok'] else '**FAIL**'} |")
        lines += ["", f"{sum(r['ok'] for r in checks)} of {len(checks)} passed.", ""]
    sanitizer = [r for r in records if r["type"] == "sanitizer"]
    if sanitizer:
        lines += ["## compute-sanitizer", ""] + [f"- {r['tool']}: exit {r['returncode']}, {r['summary']}"
                                                 for r in sanitizer] + [""]
    import compare_varlen
    lines += compare_varlen.timing_table([r for r in records if r["type"] == "varlen"])
    lines += _speed_tables([r for r in records if r["type"] == "timing"])
    lines += _target_table([r for r in records if r["type"] == "timing"])
    plots = [r for r in records if r["type"] == "plot"]
    if plots:
        lines += ["![speed and memory](speed.png)" if plots[-1]["file"] else f"Plot: {plots[-1]['note']}", ""]
    problems = [r for r in records if r["type"] in ("error", "crash", "cut", "unavailable")]
    if problems:
        lines += ["## Errors, crashes and what did not run", ""]
        for r in problems:
            what = r.get("error") or r.get("note") or r.get("reason") or \
                f"the process died here (exit {r.get('returncode')}): " + " / ".join(r.get("output", []))
            lines.append(f"- {r['stage']} `{r.get('key', r.get('impl'))}`: {r['type']}: {what}")
        lines.append("")
    return "\n".join(lines) + "\n"


def _speed_tables(timings) -> list:
    if not timings:
        return []
    lines = ["## Speed and memory", "",
             "TFLOP/s (forward 4·B·H·S²·D, halved when causal; backward 2.5x), median of timed calls after a "
             "warm-up; in brackets the peak extra memory in MiB. 16k tokens per batch (B = tokens / S), "
             "hidden size 2048 (H = 2048 / D) on a GPU. numba / cupy: how far the Numba kernels (CUDA cores, "
             "float16 only) are from the CuPy ones. D/Dv: MLA's cells, v of head dim Dv (FLOPs 2·(D + Dv) a pair "
             "where 4·D counts one).", ""]
    impls = sorted({r["impl"] for r in timings}, key=lambda i: (i.startswith("torch"), i))
    for dtype in sorted({r["dtype"] for r in timings}):
        for pass_ in ("forward", "backward"):
            rows = [r for r in timings if (r["dtype"], r["pass"]) == (dtype, pass_)]
            if not rows:
                continue
            lines += [f"### {dtype} {pass_}", "", "| D | causal | S | B x H | " + " | ".join(impls)
                      + " | cupy / torch-flash | cupy / torch-cudnn | cupy / torch-efficient | cupy / cupy-mma"
                      + " | cupy-det / cupy | cupy-wide / cupy | cupy-tallfwd / cupy | cupy-tall / cupy"
                      + " | numba / cupy | cupy+dropout / cupy | cupy+dropout / torch-flash+dropout"
                      + " | cupy+mla / cupy-mma+mla | cupy+mla / torch-cudnn+mla |",
                      "|---" * (len(impls) + 17) + "|"]
            for D, Dv, causal, S in sorted({(r["head_dim"], r.get("head_dim_v"), r["causal"], r["seqlen"])
                                            for r in rows}, key=lambda k: (-k[0], k[1] is not None, not k[2], k[3])):
                cell = {r["impl"]: r for r in rows
                        if (r["head_dim"], r.get("head_dim_v"), r["causal"], r["seqlen"]) == (D, Dv, causal, S)}
                any_row = next(iter(cell.values()))

                def show(impl):
                    r = cell.get(impl)
                    if r is None:
                        return ""
                    mem = f" ({r['peak_bytes'] / 2**20:.0f})" if r["peak_bytes"] is not None else ""
                    return f"{r['tflops']:.1f}{mem}" if r["tflops"] >= 0.1 else f"{r['tflops']:.2g}{mem}"

                def ratio(other, impl="cupy"):
                    if impl in cell and other in cell:
                        return f"{cell[impl]['tflops'] / cell[other]['tflops']:.2f}x"
                    return ""

                lines.append(f"| {D if Dv is None else f'{D}/{Dv}'} | {causal} | {S} | "
                             f"{any_row['batch']} x {any_row['heads']} | "
                             + " | ".join(show(i) for i in impls)
                             + f" | {ratio('torch-flash')} | {ratio('torch-cudnn')} | {ratio('torch-efficient')} |"
                             + f" {ratio('cupy-mma')} |"
                             + f" {ratio('cupy', 'cupy-det')} | {ratio('cupy', 'cupy-wide')} |"
                             + f" {ratio('cupy', 'cupy-tallfwd')} | {ratio('cupy', 'cupy-tall')} |"
                             + f" {ratio('cupy', 'numba')} | {ratio('cupy', 'cupy+dropout')} |"
                             + f" {ratio('torch-flash+dropout', 'cupy+dropout')} |"
                             + f" {ratio('cupy-mma+mla', 'cupy+mla')} | {ratio('torch-cudnn+mla', 'cupy+mla')} |")
            lines.append("")
    return lines + _host_table(timings)


def target_verdicts(timings) -> list:
    """One dict per TARGETS row: its fields, the cells measured (dtype, causal, S: mine over other), the
    worst of them and whether every cell reaches the target ("met", "not met", or "not measured" where no
    cell has both figures: a dry run's shapes, or a backend missing)."""
    tf = {(r["impl"], r["dtype"], r["pass"], r["head_dim"], r["causal"], r["seqlen"]): r["tflops"] for r in timings}
    low, high = TARGET_SEQLENS
    out = []
    for issue, pass_, D, causals, mine, other, least in TARGETS:
        cells = {(dtype, causal, S): tf[(mine, dtype, p, d, causal, S)] / tf[(other, dtype, p, d, causal, S)]
                 for (impl, dtype, p, d, causal, S) in tf
                 if (impl, p, d) == (mine, pass_, D) and causal in causals and low <= S <= high
                 and (other, dtype, p, d, causal, S) in tf}
        worst = min(cells, key=cells.get) if cells else None
        verdict = "not measured" if not cells else "met" if cells[worst] >= least else "not met"
        out.append(dict(issue=issue, pass_=pass_, head_dim=D, causal=causals, mine=mine, other=other, least=least,
                        cells=cells, worst=worst, verdict=verdict))
    return out


def _target_table(timings) -> list:
    verdicts = target_verdicts(timings)
    lines = ["## Issue targets", "",
             f"Issues 26 (forward) and 27 (backward): mine / other TFLOP/s in this run, every dtype, S = "
             f"{TARGET_SEQLENS[0]}..{TARGET_SEQLENS[1]} (gpu_session.TARGETS).", "",
             "| issue | pass | D | causal | mine / other | at least | cells | worst (dtype, causal, S) | |",
             "|---" * 9 + "|"]
    for v in verdicts:
        worst = (f"{v['cells'][v['worst']]:.2f}x ({v['worst'][0]}, {v['worst'][1]}, {v['worst'][2]})"
                 if v["worst"] else "")
        causal = " or ".join(str(c) for c in v["causal"])
        lines.append(f"| {v['issue']} | {v['pass_']} | {v['head_dim']} | {causal} | {v['mine']} / {v['other']} | "
                     f"{v['least']:.2f}x | {len(v['cells'])} | {worst} | {v['verdict']} |")
    met = sum(v["verdict"] == "met" for v in verdicts)
    return lines + ["", f"{met} of {len(verdicts)} targets met.", ""]


def _host_table(timings) -> list:
    """The host's part of a call and the back-to-back TFLOP/s (_host_and_back_to_back) beside the
    per-call median of the tables above, for cupy and torch's cuDNN."""
    rows = {(r["impl"], r["dtype"], r["pass"], r["head_dim"], r["causal"], r["seqlen"]): r for r in timings
            if r.get("host_seconds") is not None}
    if not any(key[0] == "cupy" for key in rows):
        return []
    lines = ["### Host part of a call, and back to back", "",
             f"host: microseconds the host spends in a call before it returns, {BACK_TO_BACK_CALLS} calls issued "
             "one after another (their launches queued, nothing waited for); per call: TFLOP/s of the median "
             "call timed alone (the tables above: CUDA events around one call hold its host part too); b2b: "
             f"TFLOP/s of the {BACK_TO_BACK_CALLS} calls back to back (events around them all: the device's time "
             "where it outruns the host).", "",
             "| dtype | pass | D | causal | S | cupy host | cupy per call | cupy b2b | cudnn host | cudnn per call "
             "| cudnn b2b | cupy / cudnn b2b |", "|---" * 12 + "|"]
    for impl, dtype, pass_, D, causal, S in sorted(rows, key=lambda k: (k[1], k[2], -k[3], not k[4], k[5])):
        if impl != "cupy":
            continue
        mine, other = rows[(impl, dtype, pass_, D, causal, S)], rows.get(("torch-cudnn", dtype, pass_, D, causal, S))
        theirs = (f"{other['host_seconds'] * 1e6:.0f} | {other['tflops']:.1f} | {other['b2b_tflops']:.1f} | "
                  f"{mine['b2b_tflops'] / other['b2b_tflops']:.2f}x" if other else " |  |  | ")
        lines.append(f"| {dtype} | {pass_} | {D} | {causal} | {S} | {mine['host_seconds'] * 1e6:.0f} | "
                     f"{mine['tflops']:.1f} | {mine['b2b_tflops']:.1f} | {theirs} |")
    return lines + [""]


def short_table(records) -> str:
    """The last lines a device call shows: stages, check failures, the headline ratios."""
    out = [f"{r['stage']:<10} {r['status']}" for r in records if r["type"] == "stage"]
    checks = [r for r in records if r["type"] == "check"]
    if checks:
        out.append(f"checks: {sum(r['ok'] for r in checks)} of {len(checks)} passed")
    verdicts = target_verdicts([r for r in records if r["type"] == "timing"])
    out.append("targets: " + ", ".join(f"{v['issue']} {v['pass_']} D={v['head_dim']} {v['mine']}/{v['other']} "
                                       f"{v['verdict']}" for v in verdicts))
    timings = {(r["impl"], r["dtype"], r["pass"], r["head_dim"], r["causal"], r["seqlen"]): r["tflops"]
               for r in records if r["type"] == "timing"}
    for (impl, dtype, pass_, D, causal, S), tf in sorted(timings.items()):
        for mine, other, name in (("cupy", "torch-flash", "flash"), ("cupy", "torch-efficient", "efficient"),
                                  ("cupy", "cupy-mma", "mma.sync"),
                                  ("cupy-det", "cupy", "default"), ("cupy-wide", "cupy", "default"),
                                  ("cupy-tallfwd", "cupy", "default"), ("cupy-tall", "cupy", "default"),
                                  ("numba", "cupy", "cupy")):
            if impl == mine and ((other,) + (dtype, pass_, D, causal, S)) in timings:
                base = timings[(other, dtype, pass_, D, causal, S)]
                out.append(f"{dtype} {pass_:<8} D={D} causal={causal!s:<5} S={S:<6} {mine} {tf:6.1f}  {name} "
                           f"{base:6.1f}  {tf / base:.2f}x")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="no GPU: the CPU emulator, Numba's simulator, tiny shapes")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "benchmarks", "results", "gpu"),
                    help="where the report goes ($OUT on the device machine)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for the whole session (default: 400 on a GPU, 900 in the dry run)")
    ap.add_argument("--only", help=f"comma-separated stages to run, of: {','.join(STAGE_NAMES)}")
    ap.add_argument("--worker", choices=tuple(WORKERS), help=argparse.SUPPRESS)
    ap.add_argument("--group", choices=GROUPS, default="main", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.out = os.path.abspath(args.out)
    if args.worker:
        return run_worker(args.worker, args)
    if args.budget is None:
        args.budget = 900.0 if args.dry_run else 400.0
    return main_driver(args)


if __name__ == "__main__":
    sys.exit(main())
