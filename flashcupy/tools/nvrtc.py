"""Compile every CUDA kernel specialization with NVRTC as CuPy does, and report what ptxas says.

Used by `python -m flashcupy kernels` and by tests/test_nvrtc.py; needs no GPU and no CuPy.

What is compiled: the kernel sources with the options CuPy's RawModule hands NVRTC, that is the
backend's (sources.COMPILE_OPTIONS), those CuPy adds itself (sources.CUPY_NVRTC_OPTIONS: -ftz=true
among them), -arch=sm_XY and -I for the CUDA headers that go with the NVRTC. CuPy's -I for its own
headers and its copy of CCCL are left out: the kernels reach none of their files (with CuPy 14.2's
whole include list every cubin came out byte for byte the same).

Which NVRTC, as a `Toolkit` (a libnvrtc and the CUDA headers compiled against):
- the one cuda-pathfinder finds: `load_nvidia_dynamic_lib("nvrtc")` and
  `find_nvidia_header_directory("cudart")`, the search CuPy (>= 14.1) and numba-cuda make, so
  where one CUDA is installed these are the NVRTC and the headers that CuPy compiles with;
- every other CUDA major installed as NVIDIA's wheels (`WHEELS`), its files located through the
  installer's record of the wheel (importlib.metadata). cuda-pathfinder gives one answer per
  environment, the newest CUDA, and NVRTC 12 and 13 allocate registers differently, so this is how
  one environment (the test extra installs both) checks what CuPy on CUDA 12 and on CUDA 13 get.

How NVRTC is called: through cuda.bindings.nvrtc, which binds the libnvrtc that cuda-pathfinder
loads, once per process. So every batch of compilations runs in a worker process of its own (a
thread per core in it: cuda.bindings releases the GIL while NVRTC compiles), which loads the
toolkit's libnvrtc before cuda.bindings asks for one (cuda-pathfinder first looks for an NVRTC
already loaded in the process) and checks that cuda.bindings got that one. The calls made here have
the same C signatures in NVRTC 12 and 13, so cuda.bindings of either major drives either.

For each kernel: registers per thread, spill bytes (stores + loads), static and dynamic shared
memory per CTA, threads per CTA, the theoretical occupancy (resident warps / maximum warps per
SM) on that architecture, and for the tensor-core kernels the count of HMMA.16816.F32 (HMMA.1688.F32
on Turing, two an mma) instructions in their SASS (by nvdisasm, which cuda-pathfinder finds: the
`nvidia-cuda-nvdisasm` wheel or a toolkit's). Asked (`kernel_report(..., instructions=True)`), every
kernel's SASS is read: its instruction count and a digest of its instructions with addresses, labels
and the kernel's own name taken out, so that two compilations of the same code compare equal even
where the template arguments (and so the mangled name) differ (benchmarks/sass_counts.py).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import importlib.metadata
import os
import pickle
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from flashcupy.backends.cupy_backend import catalog, sources, specs
from flashcupy.tools import hardware
from flashcupy.tools.hardware import MAX_REGISTERS

# A kernel this close to MAX_REGISTERS is one compiler release from spilling: allocation moves by
# more than this between NVRTC versions. tests/test_nvrtc.py fails on it; the report flags it.
REGISTER_MARGIN = 8

# NVIDIA's wheels of NVRTC and of the CUDA runtime headers, per CUDA major
WHEELS = {
    12: ("nvidia-cuda-nvrtc-cu12", "nvidia-cuda-runtime-cu12"),
    13: ("nvidia-cuda-nvrtc", "nvidia-cuda-runtime"),
}
_LIBNVRTC = re.compile(r"libnvrtc\.so\.\d+|nvrtc64_\d+_0\.dll")  # not the builtins or the .alt build
_WORKERS = min(4, os.cpu_count() or 1)  # compiling threads in a worker process


class NvrtcError(RuntimeError):
    pass


@dataclass(frozen=True)
class Toolkit:
    """A libnvrtc and the directory of the CUDA headers (cuda_fp16.h) compiled against it."""

    nvrtc: str
    include: str
    found_by: str  # "cuda-pathfinder", or the wheels it comes from

    @property
    def version(self) -> str:
        """NVRTC's own, e.g. "12.9" (asked of a worker process)."""
        return _about(self)[0]

    @property
    def archs(self) -> tuple:
        """The architectures this NVRTC compiles for, as ints (nvrtcGetSupportedArchs: 50 ... 121 for
        NVRTC 12.9; CUDA 13 dropped those before sm_75)."""
        return _about(self)[1]

    def compiles_for(self, arch: str) -> bool:
        """Whether this NVRTC takes -arch=`arch` ("sm_75", "sm_90a")."""
        return arch_number(arch) in self.archs


@functools.lru_cache(maxsize=None)
def cupy_toolkit() -> Toolkit:
    """The NVRTC and CUDA headers cuda-pathfinder finds: what CuPy compiles with here."""
    try:
        from cuda.pathfinder import DynamicLibNotFoundError, find_nvidia_header_directory, load_nvidia_dynamic_lib
    except ImportError:
        raise NvrtcError("cuda-pathfinder is not installed (pip install cuda-pathfinder)") from None
    try:
        nvrtc = load_nvidia_dynamic_lib("nvrtc").abs_path
    except DynamicLibNotFoundError as e:
        raise NvrtcError(f"NVRTC not found (pip install nvidia-cuda-nvrtc-cu12, or nvidia-cuda-nvrtc for "
                         f"CUDA 13): {e}") from None
    include = find_nvidia_header_directory("cudart")
    if include is None:
        raise NvrtcError("the CUDA headers (cuda_runtime.h) not found (pip install nvidia-cuda-runtime-cu12, "
                         "or nvidia-cuda-runtime for CUDA 13)")
    return Toolkit(nvrtc, include, "cuda-pathfinder")


def _wheel_file(wheel: str, major: int, matches) -> tuple | None:
    """(the path of the first file of the installed `wheel` whose name `matches`, "wheel version"),
    or None if the wheel is not installed, not of CUDA `major`, or has no such file."""
    try:
        dist = importlib.metadata.distribution(wheel)
    except importlib.metadata.PackageNotFoundError:
        return None
    if dist.version.split(".")[0] != str(major):
        return None
    path = next((f.locate() for f in dist.files or () if matches(f.name)), None)
    return None if path is None else (path, f"{wheel} {dist.version}")


def _wheel_toolkit(major: int) -> Toolkit | None:
    """The toolkit that CUDA `major`'s wheels (WHEELS) make, if both are installed."""
    nvrtc_wheel, headers_wheel = WHEELS[major]
    nvrtc = _wheel_file(nvrtc_wheel, major, _LIBNVRTC.fullmatch)
    headers = _wheel_file(headers_wheel, major, lambda name: name == "cuda_fp16.h")
    if nvrtc is None or headers is None:
        return None
    return Toolkit(str(nvrtc[0]), str(headers[0].parent), f"{nvrtc[1]}, {headers[1]}")


@functools.lru_cache(maxsize=None)
def toolkits() -> tuple:
    """Every NVRTC to check, in order of version: cuda-pathfinder's (CuPy's), and each other CUDA
    major installed as wheels."""
    found = [cupy_toolkit()]
    for major in WHEELS:
        wheel = _wheel_toolkit(major)
        if wheel is not None and not any(os.path.samefile(wheel.nvrtc, t.nvrtc) for t in found):
            found.append(wheel)
    return tuple(sorted(found, key=lambda t: tuple(map(int, t.version.split(".")))))


# ----------------------------------------------------------------------------
# the worker: a process that runs one toolkit's NVRTC for a batch of compilations


def _check(result, what: str):
    """The values of a cuda.bindings.nvrtc call after its status; NvrtcError unless it succeeded."""
    from cuda.bindings import nvrtc

    status, *values = result
    if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise NvrtcError(f"{what}: {nvrtc.nvrtcGetErrorString(status)[1].decode()}")
    return values[0] if len(values) == 1 else values


def _bind(nvrtc_path: str) -> tuple:
    """Make cuda.bindings.nvrtc run the libnvrtc at `nvrtc_path` in this process; (its version, the
    architectures it compiles for)."""
    ctypes.CDLL(nvrtc_path)  # cuda-pathfinder takes an NVRTC already loaded before searching
    try:
        from cuda.bindings import nvrtc
        from cuda.pathfinder import load_nvidia_dynamic_lib
    except ImportError as e:
        raise NvrtcError(f"{e.name} is not installed (pip install cuda-bindings cuda-pathfinder)") from None
    bound = load_nvidia_dynamic_lib("nvrtc").abs_path
    if not os.path.samefile(bound, nvrtc_path):
        raise NvrtcError(f"cuda.bindings runs {bound}, not {nvrtc_path}")
    version = "{}.{}".format(*_check(nvrtc.nvrtcVersion(), "nvrtcVersion"))
    return version, tuple(_check(nvrtc.nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs"))


def _compile(source: str, name_expressions, options) -> tuple:
    """(ptxas log, {name expression: lowered name}, cubin) by the NVRTC that _bind chose."""
    from cuda.bindings import nvrtc

    prog = _check(nvrtc.nvrtcCreateProgram(source.encode(), b"flashcupy.cu", 0, [], []), "nvrtcCreateProgram")
    try:
        for name in name_expressions:
            _check(nvrtc.nvrtcAddNameExpression(prog, name.encode()), "nvrtcAddNameExpression")
        opts = [o.encode() for o in options]
        (status,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        log = b" " * _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        _check(nvrtc.nvrtcGetProgramLog(prog, log), "nvrtcGetProgramLog")
        log = log.rstrip(b"\0").decode(errors="replace")
        if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise NvrtcError(f"compilation failed:\n{log}")
        lowered = {name: _check(nvrtc.nvrtcGetLoweredName(prog, name.encode()), "nvrtcGetLoweredName").decode()
                   for name in name_expressions}
        cubin = b" " * _check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        _check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return log, lowered, cubin
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _outcome(job) -> tuple:
    try:
        return True, _compile(*job)
    except NvrtcError as e:
        return False, e


def _serve() -> None:
    """The worker's main: (libnvrtc path, [(source, name expressions, options)]) from stdin, then
    (True, (_bind's (version, architectures), [(True, _compile's result) or (False, NvrtcError)])), or
    (False, the error that stopped it), to stdout, pickled."""
    nvrtc_path, jobs = pickle.load(sys.stdin.buffer)
    try:
        about = _bind(nvrtc_path)
        with ThreadPoolExecutor(_WORKERS) as pool:  # cuda.bindings releases the GIL while NVRTC compiles
            reply = True, (about, list(pool.map(_outcome, jobs)))
    except NvrtcError as e:
        reply = False, e
    pickle.dump(reply, sys.stdout.buffer)


# ----------------------------------------------------------------------------
# in this process


def _run(toolkit: Toolkit, jobs) -> tuple:
    """((NVRTC version, architectures), [(True, (log, lowered, cubin)) or (False, NvrtcError)] per job)
    from a worker process running `toolkit`'s NVRTC."""
    # where flashcupy is imported from: the folder that holds the flashcupy package
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = f"import sys; sys.path.insert(0, {root!r}); from flashcupy.tools.nvrtc import _serve; _serve()"
    done = subprocess.run([sys.executable, "-c", code], input=pickle.dumps((toolkit.nvrtc, list(jobs))),
                          capture_output=True)
    if done.returncode != 0:
        raise NvrtcError(f"the worker for {toolkit.nvrtc} failed:\n{done.stderr.decode(errors='replace')[-4000:]}")
    ok, value = pickle.loads(done.stdout)
    if not ok:
        raise value
    return value


@functools.lru_cache(maxsize=None)
def _about(toolkit: Toolkit) -> tuple:
    return _run(toolkit, ())[0]


def arch_number(arch: str) -> int:
    """The compute capability of an -arch value, as an int: 90 for "sm_90" and "sm_90a"."""
    found = re.fullmatch(r"sm_(\d+)a?", arch)
    if not found:
        raise ValueError(f"arch must look like sm_80 or sm_90, got {arch!r}")
    return int(found.group(1))


def _workers(jobs: int) -> int:
    """The worker processes _results runs for `jobs` jobs: one per CPU, at most one a job."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(jobs, cpus))


def _results(toolkit: Toolkit, jobs) -> list:
    """_compile's result per job, compiled by `toolkit`'s NVRTC; the first job's NvrtcError if any failed.
    The jobs are shared round-robin among one worker process per CPU (NVRTC compiles on one thread;
    the report's few hundred kernels took minutes in one worker)."""
    jobs = list(jobs)
    workers = _workers(len(jobs))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:  # each thread waits on its process
        parts = list(pool.map(lambda w: _run(toolkit, jobs[w::workers])[1], range(workers)))
    outcomes = [parts[n % workers][n // workers] for n in range(len(jobs))]
    for ok, value in outcomes:
        if not ok:
            raise value
    return [value for _, value in outcomes]


def compile_cubin(source: str, name_expressions, options, toolkit: Toolkit | None = None) -> tuple:
    """Compile with the NVRTC of `toolkit` (default: CuPy's); returns (ptxas log, {name expression:
    lowered (mangled) name}, cubin bytes)."""
    return _results(toolkit or cupy_toolkit(), [(source, tuple(name_expressions), tuple(options))])[0]


def compile_options(arch: str, toolkit: Toolkit | None = None) -> tuple:
    """CuPy's NVRTC options for our kernels on an `arch` device, and ptxas' resource report."""
    toolkit = toolkit or cupy_toolkit()
    return sources.COMPILE_OPTIONS + sources.CUPY_NVRTC_OPTIONS + (f"-I{toolkit.include}", f"-arch={arch}", "-Xptxas=-v")


def nvdisasm_path() -> str | None:
    """nvdisasm as cuda-pathfinder finds it (the nvidia-cuda-nvdisasm wheel, or a toolkit), else None."""
    try:
        from cuda.pathfinder import find_nvidia_binary_utility
    except ImportError:
        return None
    return find_nvidia_binary_utility("nvdisasm")


def sass(cubin: bytes) -> str:
    """The SASS text of a cubin, by nvdisasm."""
    tool = nvdisasm_path()
    if tool is None:
        raise NvrtcError("nvdisasm not found: pip install nvidia-cuda-nvdisasm cuda-pathfinder")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-c", f.name], capture_output=True, text=True, check=True).stdout


def function_sass(text: str, mangled: str) -> str | None:
    """The SASS of one function in nvdisasm's output, or None."""
    m = re.search(rf"\.text\.{re.escape(mangled)}:(.*?)(?=\n\s*\.section|\Z)", text, re.S)
    return m.group(1) if m else None


_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;?\s*$", re.M)
_LABEL = re.compile(r"\.L_x_\d+")


def sass_instructions(code: str, mangled: str) -> tuple:
    """(instruction count, digest) of one function's SASS (function_sass's text): the digest is a
    SHA-256 of its instructions in order with the addresses dropped, the labels renumbered in order of
    first mention and the function's own mangled name replaced, so that it names the code alone."""
    import hashlib

    labels = {}
    lines = []
    for ins in _INSTRUCTION.findall(code):
        ins = ins.replace(mangled, "SELF")
        ins = _LABEL.sub(lambda m: labels.setdefault(m.group(0), f"L{len(labels)}"), ins)
        lines.append(ins)
    return len(lines), hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USAGE = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas(log: str) -> dict:
    """{mangled name: {registers, spill_stores, spill_loads, stack, static_smem}} from `ptxas -v`."""
    info, current = {}, None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            current = info.setdefault(m.group(1), dict(registers=0, spill_stores=0, spill_loads=0,
                                                        stack=0, static_smem=0))
        elif current is None:
            continue
        elif m := _SPILLS.search(line):
            current.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        elif m := _USAGE.search(line):
            current["registers"] = int(m.group(1))
            if s := _SMEM.search(line):
                current["static_smem"] = int(s.group(1))
    return info


def occupancy(arch: str, registers: int, smem: int, threads: int) -> float:
    """Resident warps / maximum warps per SM, from registers, shared memory and threads (the limits:
    tools/hardware.py)."""
    lim = hardware.sm(arch)
    granule = hardware.REGISTER_GRANULE
    warps = -(-threads // 32)
    by_threads = lim.threads // (warps * 32)
    regs_per_warp = -(-max(registers, 1) * 32 // granule) * granule
    by_registers = (lim.registers // regs_per_warp) // warps
    by_smem = lim.smem // (smem + lim.smem_reserved) if smem + lim.smem_reserved else lim.ctas
    ctas = min(by_threads, by_registers, by_smem, lim.ctas)
    return ctas * warps / (lim.threads // 32)


def variant(kernel: specs.Kernel) -> str | None:
    """A report row's "mods": the score modifiers, then split-KV, a packed batch, dQ by atomics, the
    Hopper backward's ordered dQ, the Hopper forward's wide key block and the Hopper kernels' tall tiles
    (the forward's 192 query rows, the backward's 128-row pass), joined by "+"; None for the plain kernel."""
    wide = (kernel.template == "flash_fwd_sm90"
            and (kernel.block_m, kernel.block_n) == specs.SM90_WIDE_FORWARD_TILES.get(kernel.head_dim))
    tall_tiles = (specs.SM90_TALL_FORWARD_TILES if kernel.template == "flash_fwd_sm90"
                  else specs.SM90_TALL_BACKWARD_TILES if kernel.template.startswith("flash_bwd")
                  and kernel.template.endswith(("_sm90", "_sm90_varlen")) else {})
    tall = (kernel.block_m, kernel.block_n) == tall_tiles.get(kernel.head_dim)
    flags = (kernel.modifiers, "split" * kernel.split, "varlen" * kernel.varlen, "dq_atomic" * kernel.dq_atomic,
             "deterministic" * kernel.deterministic, "wide" * wide, "tall" * tall)
    return "+".join(x for x in flags if x) or None


def _module_rows(arch: str, module: specs.ModuleSpec, log: str, lowered: dict, cubin: bytes,
                 instructions: bool = False, info: dict | None = None, text: str | None = None) -> list:
    """The report's rows of `module`'s kernels from a compile that holds them (log, lowered, cubin);
    info and text: that compile's parse_ptxas(log) and sass(cubin) where the caller has them."""
    info = parse_ptxas(log) if info is None else info
    if text is None:
        text = sass(cubin) if instructions or any(k.tensor_cores or k.wgmma for k in module.kernels) else ""
    rows = []
    for kernel in module.kernels:
        got = info[lowered[kernel.name_expression]]
        code = (function_sass(text, lowered[kernel.name_expression]) if kernel.tensor_cores or kernel.wgmma or instructions
                else None)
        extra = {}
        if instructions:
            extra["instructions"], extra["sass_digest"] = sass_instructions(code, lowered[kernel.name_expression])
        rows.append(dict(
            kernel=kernel.template,
            mods=variant(kernel),
            dtype=kernel.dtype,
            head_dim=kernel.head_dim or None,
            tile=f"{kernel.block_m}x{kernel.block_n}" if kernel.head_dim else None,
            registers=got["registers"],
            spill_bytes=got["spill_stores"] + got["spill_loads"],
            static_smem=got["static_smem"],
            dynamic_smem=kernel.dynamic_smem,
            threads=kernel.threads,
            occupancy=occupancy(arch, got["registers"], got["static_smem"] + kernel.dynamic_smem,
                                kernel.threads),
            # mma.sync's HMMA, or wgmma's HGMMA for the Hopper kernels
            hmma=(len(re.findall(r"\bHMMA\.(?:16816|1688)\.F32", code)) if kernel.tensor_cores
                  else len(re.findall(r"\bHGMMA\.", code)) if kernel.wgmma else None),
            **extra,
        ))
    return rows


def kernel_report(arch: str = "sm_90", toolkit: Toolkit | None = None, modules=None,
                  instructions: bool = False) -> list:
    """One row per kernel specialization the cupy backend can launch (`modules`, by default
    catalog.modules_for the arch: without score modifiers and with all of them), compiled for `arch` by
    the NVRTC of `toolkit` (default: CuPy's; NvrtcError if it does not compile for `arch`). `instructions`:
    every row also gets its SASS instruction count and digest (sass_instructions)."""
    number = arch_number(arch)
    toolkit = toolkit or cupy_toolkit()
    if not toolkit.compiles_for(arch):
        raise NvrtcError(f"NVRTC {toolkit.version} does not compile for {arch} (it does for sm_{toolkit.archs[0]} "
                         f"to sm_{toolkit.archs[-1]})")
    options = compile_options(arch, toolkit)
    modules = catalog.modules_for(number) if modules is None else modules
    jobs, job_of = _shared_programs(modules, options)
    compiled = _results(toolkit, jobs)
    parsed = [parse_ptxas(log) for log, _, _ in compiled]
    texts = {}  # a job's SASS, disassembled once for all its modules that need it
    # the preprocess kernel does not depend on the head-dim bucket: report it once per dtype
    rows, seen = [], set()
    for module, j in zip(modules, job_of):
        if (instructions or any(k.tensor_cores or k.wgmma for k in module.kernels)) and j not in texts:
            texts[j] = sass(compiled[j][2])
        for row in _module_rows(arch, module, *compiled[j], instructions=instructions, info=parsed[j],
                                text=texts.get(j, "")):
            key = (row["kernel"], row["mods"], row["dtype"], row["head_dim"])
            if key not in seen:
                seen.add(key)
                rows.append(row)
    return rows


def _shared_programs(modules, options) -> tuple:
    """(jobs, the job of each module): the modules' kernels compiled in fewer NVRTC programs, those of
    one source file shared among as many programs as _results runs at once (a program per module parsed
    the same headers again each time: a quarter of the CPU time of the report). ptxas compiles each
    kernel of a program apart: its registers and SASS do not depend on the others."""
    workers = _workers(len(modules))
    by_source = {}
    for n, module in enumerate(modules):
        by_source.setdefault(module.source_file, []).append(n)
    jobs, job_of = [], [0] * len(modules)
    for source_file, members in by_source.items():
        for part in range(min(workers, len(members))):
            chunk = members[part::workers]
            names = tuple(dict.fromkeys(name for n in chunk for name in modules[n].name_expressions))
            for n in chunk:
                job_of[n] = len(jobs)
            jobs.append((sources.read_source(source_file), names, tuple(options)))
    return jobs, job_of


def _over(row: dict, column: str) -> bool:
    """Whether the row's registers or spills are what limits_exceeded reports."""
    if column == "registers":
        return row["registers"] > MAX_REGISTERS - REGISTER_MARGIN
    return column == "spill_bytes" and row["spill_bytes"] > 0


def _kernel_name(row: dict) -> str:
    """The kernel's template, with its score modifiers if any: flash_fwd_tc[window+softcap]."""
    return row["kernel"] + (f"[{row['mods']}]" if row.get("mods") else "")


def limits_exceeded(rows) -> list:
    """A line for each kernel that spills or takes more than MAX_REGISTERS - REGISTER_MARGIN registers."""
    return [f"{_kernel_name(r)} {r['dtype']} head_dim={r['head_dim']}: {r['registers']} registers, "
            f"{r['spill_bytes']} spill bytes"
            for r in rows if _over(r, "registers") or _over(r, "spill_bytes")]


_KERNEL_COLUMNS = (("kernel", "{}"), ("mods", "{}"), ("dtype", "{}"), ("head_dim", "{}"), ("tile", "{}"),
                   ("static_smem", "{}"), ("dynamic_smem", "{}"), ("threads", "{}"))
_NVRTC_COLUMNS = (("registers", "{}"), ("spill_bytes", "{}"), ("occupancy", "{:.0%}"), ("hmma", "{}"))


def _cell(row: dict, column: str, fmt: str) -> str:
    if row.get(column) is None:
        return "-"
    return fmt.format(row[column]) + ("!" if _over(row, column) else "")


def format_kernel_report(reports: dict) -> str:
    """{heading: rows} (the reports of the same kernels by different NVRTCs, e.g. {"NVRTC 12.9":
    rows}) as one aligned text table: the kernels' columns, then each report's under its heading.
    Registers and spills that limits_exceeded reports are marked with "!". Reports of other kernels
    (the sm_90a Hopper kernels beside the others) get a table of their own, one after the other."""
    groups: dict = {}
    for heading, rows in reports.items():
        kernels = tuple(sorted(tuple(str(r.get(c)) for c in ("kernel", "mods", "dtype", "head_dim")) for r in rows))
        groups.setdefault(kernels, {})[heading] = rows
    if len(groups) > 1:
        return "\n\n".join(format_kernel_report(group) for group in groups.values())
    names = [name for name, _ in _KERNEL_COLUMNS] + [name for _ in reports for name, _ in _NVRTC_COLUMNS]
    table = [names]
    for same_kernel in zip(*reports.values()):
        table.append([_cell(same_kernel[0], name, fmt) for name, fmt in _KERNEL_COLUMNS]
                     + [_cell(row, name, fmt) for row in same_kernel for name, fmt in _NVRTC_COLUMNS])
    widths = [max(len(r[i]) for r in table) for i in range(len(names))]
    lines = ["  ".join(cell.rjust(w) if i >= 3 else cell.ljust(w) for i, (cell, w) in enumerate(zip(r, widths)))
             .rstrip() for r in table]
    heading = ""  # each title starts above its report's first column
    for k, title in enumerate(reports):
        heading = heading.ljust(sum(w + 2 for w in widths[:len(_KERNEL_COLUMNS) + k * len(_NVRTC_COLUMNS)])) + title
    return "\n".join([heading] + lines)
