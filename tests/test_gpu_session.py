"""The GPU session script, run here as its dry run: every stage on the CPU (the emulator in place of
the GPU, Numba's simulator, tiny shapes), the same report. A lent GPU is rare and short: the script
must work the first time, and a failing stage must not take the others' results with it.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_session.sh")


def session(out, *args, inject=None, **env_vars):
    env = dict(os.environ, PYTHON=sys.executable, **env_vars)
    env.pop("FLASHCUPY_SESSION_INJECT", None)
    env.setdefault("FLASHCUPY_NUMBA_WHEELS", str(out / "no-wheels"))  # not a checkout's .whl/numba/
    if inject:
        env["FLASHCUPY_SESSION_INJECT"] = inject
    done = subprocess.run(["bash", SCRIPT, "--dry-run", "--out", str(out), *args], env=env, capture_output=True,
                          text=True, timeout=600)
    with open(out / "results.jsonl") as f:
        records = [json.loads(line) for line in f]
    return done, records, (out / "report.md").read_text()


def stages(records):
    return {r["stage"]: r["status"] for r in records if r["type"] == "stage"}


def carried_numpy_wheel(folder) -> str:
    """This interpreter's NumPy as a wheel, its installed files packed again: it stands in for the one
    benchmarks/gpu_wheels.sh downloads for the device, so that the dry run takes the path the GPU
    session takes (gpu_session.sh installs it into a folder that only the Numba processes see)."""
    dist = importlib.metadata.distribution("numpy")
    tag = next(line.split(": ", 1)[1] for line in dist.read_text("WHEEL").splitlines() if line.startswith("Tag: "))
    info = f"numpy-{dist.version}.dist-info"
    path = os.path.join(folder, f"numpy-{dist.version}-{tag}.whl")
    record = []
    os.makedirs(folder, exist_ok=True)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for f in dist.files:
            name = str(f)
            if name.startswith("..") or "__pycache__" in name or name in (
                    f"{info}/{x}" for x in ("RECORD", "INSTALLER", "REQUESTED", "direct_url.json")):
                continue  # the scripts in bin/, bytecode, and what pip wrote when it installed it
            data = f.locate().read_bytes()
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            z.writestr(name, data)
            record.append(f"{name},sha256={digest},{len(data)}")
        z.writestr(f"{info}/RECORD", "\n".join(record + [f"{info}/RECORD,,"]) + "\n")
    return path


def test_dry_run_writes_a_complete_report(tmp_path):
    # with a NumPy wheel carried for the Numba processes, as the GPU session runs (benchmarks/gpu_wheels.sh)
    wheel = carried_numpy_wheel(tmp_path / "wheels")
    (tmp_path / "tmp").mkdir()
    done, records, report = session(tmp_path, FLASHCUPY_NUMBA_WHEELS=str(tmp_path / "wheels"),
                                    TMPDIR=str(tmp_path / "tmp"))
    assert done.returncode == 0, done.stdout + done.stderr
    status = stages(records)
    assert list(status) == ["preflight", "blocks", "pytest", "check", "sanitizer", "varlen", "sweep", "plot"]
    for stage, result in status.items():
        want = "skipped: compute-sanitizer not found" if stage == "sanitizer" and not shutil.which(
            "compute-sanitizer") else "ok"
        assert result.startswith(want), (stage, result)
    (env,) = [r for r in records if r["type"] == "env"]
    assert env["dry_run"] and env["numpy"]
    # the Numba processes imported the carried NumPy (installed by gpu_session.sh, removed after), the others not
    (numba,) = [r for r in records if r["type"] == "numba-env"]
    site = numba["site"]
    assert numba["numpy_from"] == "the carried wheels" and numba["carried"] == [os.path.basename(wheel).split("-cp")[0]]
    assert numba["numpy_file"].startswith(site) and numba["backend"] == "available"
    assert not env["numpy_file"].startswith(site) and not os.path.exists(site)
    assert site.startswith(str(tmp_path / "tmp"))
    assert f"Numba processes: numpy {numba['numpy']} from the carried wheels" in report
    assert {r["group"] for r in records if r["type"] == "pytest" and r["stage"] == "pytest"} == {"main", "numba"}
    blocks = next(r for r in records if r["type"] == "pytest" and r["stage"] == "blocks")
    assert blocks["returncode"] == 0 and "passed" in blocks["summary"] and "skipped" not in blocks["summary"]
    assert blocks["files"][0] == "tests/test_hopper_gpu.py"  # the sm_90 blocks run first, on the emulator here
    assert int(blocks["summary"].split()[0]) > 8  # the hopper file's 8 cases and the tensor-core file's
    checks = [r for r in records if r["type"] == "check"]
    groups = {(r["backend"], r["path"], r["dtype"]) for r in checks}
    assert {("cupy", "tensor-core", "float16"), ("cupy", "tensor-core", "bfloat16"), ("cupy", "simt", "float64"),
            ("numba", "simt", "float32")} <= groups
    assert all(r["ok"] is True and 0 <= r["worst"] <= 1 for r in checks)
    timings = [r for r in records if r["type"] == "timing"]
    assert {(r["impl"], r["dtype"]) for r in timings} >= {("cupy", "bfloat16"), ("cupy", "float16")}
    # the deterministic backward beside the default (issue 27's ratio), the backward alone
    assert {(r["pass"], r["dtype"]) for r in timings if r["impl"] == "cupy-det"} == {
        ("backward", "bfloat16"), ("backward", "float16")}
    assert "cupy-det / cupy" in report
    # the wide key block's forward beside the default (cupy_backend.SM90_WIDE), the forward alone
    assert {(r["pass"], r["dtype"], r["seqlen"]) for r in timings if r["impl"] == "cupy-wide"} == {
        ("forward", dtype, S) for dtype in ("bfloat16", "float16") for S in (16, 32)}
    assert "cupy-wide / cupy" in report
    # the 192-row forward beside the default (cupy_backend.SM90_TALL_FORWARD), the forward alone
    assert {(r["pass"], r["dtype"], r["seqlen"]) for r in timings if r["impl"] == "cupy-tallfwd"} == {
        ("forward", dtype, S) for dtype in ("bfloat16", "float16") for S in (16, 32)}
    assert "cupy-tallfwd / cupy" in report
    # the tall backward pass beside the default (cupy_backend.SM90_TALL_BACKWARD), the backward alone
    assert {(r["pass"], r["dtype"], r["seqlen"]) for r in timings if r["impl"] == "cupy-tall"} == {
        ("backward", dtype, S) for dtype in ("bfloat16", "float16") for S in (16, 32)}
    assert "cupy-tall / cupy" in report
    # wide_head_configs (head_dim 256 and 192 on a GPU, (64, False) here): the first dtype, by WIDE_HEAD_IMPLS of those
    # available (torch's cuDNN needs a GPU), both passes
    # precise_configs: float32 and float64 on the SIMT kernels beside torch's math backend (its memory-efficient
    # one needs a GPU, and takes float32 only), both passes, and in no other cell
    precise = {(r["impl"], r["pass"], r["dtype"]) for r in timings if r["dtype"] in ("float32", "float64")}
    assert precise == {(impl, pass_, dtype) for impl in ("cupy", "torch-math") for dtype in ("float32", "float64")
                       for pass_ in ("forward", "backward")}
    assert "### float32 forward" in report and "cupy / torch-efficient" in report
    assert "torch-efficient" in {r["impl"] for r in records if r["type"] == "unavailable" and r["stage"] == "sweep"}
    alone = {(r["impl"], r["pass"], r["dtype"], r["seqlen"]) for r in timings if not r["causal"]}
    assert alone == {(impl, pass_, "bfloat16", S) for impl in ("cupy", "cupy-mma", "torch-flash") for S in (16, 32)
                     for pass_ in ("forward", "backward")}
    # the Numba kernels timed beside the CuPy ones (the simulator's figures: only the path is checked)
    assert {(r["pass"], r["seqlen"]) for r in timings if r["impl"] == "numba"} == {("forward", 16), ("backward", 16)}
    assert not [r for r in records if r["type"] == "unavailable" and r["stage"] == "sweep" and r["impl"] == "numba"]
    assert all(r["seconds"] > 0 and r["tflops"] > 0 for r in timings)
    # the host's part of a call and the back-to-back rate beside the per-call median (the fast implementations)
    assert all(r["host_seconds"] > 0 and r["b2b_tflops"] > 0 for r in timings
               if r["impl"] in ("cupy", "cupy-det", "cupy-wide", "cupy-tallfwd"))
    assert all(r["host_seconds"] is None for r in timings if r["impl"] in ("numba", "cupy-mma"))
    (host_row,) = [line for line in report.split("### Host part of a call, and back to back")[1].splitlines()
                   if line.startswith("| float16 | backward | 64 | True | 16 |")]
    # issue 28's timings: every path of the packed batch both ways, the decode step's, torch's dense cache
    varlen = {(r["path"], r["pass"]) for r in records if r["type"] == "varlen" and r["seconds"] > 0}
    assert {("one launch", "backward"), ("per sequence (before issue 28)", "backward"), ("dense batch 5 x 11", "forward"),
            ("append + attention, check_offsets=False", "forward"),
            ("torch SDPA, dense cache (attention alone)", "forward")} <= varlen, varlen
    assert not [r for r in records if r["type"] in ("error", "crash")]
    assert os.path.getsize(tmp_path / "speed.png") > 10_000
    for section in ("## Stages", "## Correctness against the float64 oracle", "### bfloat16 forward",
                    "## Packed batches and KV-cache decoding (issue 28)", "per sequence / one launch",
                    "![speed and memory](speed.png)", "**dry run**", "| numba / cupy |", "## Issue targets"):
        assert section in report
    # the dry run's lengths are far below issues 26's and 27's S = 4k..16k: no target is measured
    assert "0 of 8 targets met." in report and report.count("| not measured |") == 8
    section = report.split("### float16 backward")[1].split("###")[0]
    (row,) = [line for line in section.splitlines() if line.startswith("| 64 | True | 16 |")]
    assert row.split("|")[-6].strip().endswith("x") and "numba" in done.stdout  # numba / cupy, the closing lines
    # dropout, timed last (dropout_configs): flashcupy's on the Hopper and the mma.sync kernels, the first dtype
    # (torch's flash backend has no dropout on a CPU: not timed in the dry run)
    dropped = {(r["impl"], r["pass"], r["dtype"], r["seqlen"]) for r in timings if r["impl"].endswith("+dropout")}
    assert dropped == {(f"{impl}+dropout", pass_, "bfloat16", S) for impl in ("cupy", "cupy-mma") for S in (16, 32)
                       for pass_ in ("forward", "backward")}
    assert all(r["host_seconds"] is None for r in timings if r["impl"].endswith("+dropout"))
    section = report.split("### bfloat16 backward")[1].split("###")[0]
    (row,) = [line for line in section.splitlines() if line.startswith("| 64 | True | 32 |")]
    assert row.split("|")[-5].strip().endswith("x")  # cupy+dropout / cupy
    # MLA (mla_configs: head dims 64 and 32 here), timed after the dropout cells: flashcupy's Hopper and mma.sync
    # kernels (torch's cuDNN needs a GPU), the first dtype, each record with v's head dim, its row D/Dv
    mla = {(r["impl"], r["pass"], r["dtype"], r["seqlen"], r["head_dim_v"]) for r in timings
           if r["impl"].endswith("+mla")}
    assert mla == {(f"{impl}+mla", pass_, "bfloat16", S, 32) for impl in ("cupy", "cupy-mma") for S in (16, 32)
                   for pass_ in ("forward", "backward")}
    assert all(r["host_seconds"] is None for r in timings if r["impl"].endswith("+mla"))
    (row,) = [line for line in section.splitlines() if line.startswith("| 64/32 | True | 32 |")]
    assert row.split("|")[-3].strip().endswith("x")  # cupy+mla / cupy-mma+mla


def test_a_stage_that_raises_leaves_the_stages_before_and_after(tmp_path):
    done, records, report = session(tmp_path, "--only", "preflight,check,plot", inject="check:raise")
    assert done.returncode == 1
    status = stages(records)
    assert status["preflight"] == "ok" and status["plot"] == "ok"
    assert status["check"].startswith("failed")
    assert any(r["type"] == "env" for r in records)
    assert not [r for r in records if r["type"] == "check"]
    # without carried wheels the Numba processes import the image's NumPy, and the report says so
    (numba,) = [r for r in records if r["type"] == "numba-env"]
    assert numba["numpy_from"].startswith("the image (no wheels carried") and numba["site"] is None
    assert "failed on purpose" in report and "| preflight | ok |" in report and "| plot | ok |" in report


def test_a_process_that_dies_inside_an_item_is_restarted_after_it(tmp_path):
    # what an illegal address does: the process is gone, the items before it are kept, the item is
    # reported as crashed, and a fresh process does the rest
    done, records, report = session(tmp_path, "--only", "sweep", inject="sweep:crash:2")
    assert done.returncode == 1
    assert stages(records)["sweep"] == "ok after 1 restart(s)"
    (crash,) = [r for r in records if r["type"] == "crash"]
    begun = [r["key"] for r in records if r["type"] == "begin"]
    assert crash["key"] == begun[1] and crash["returncode"] == 70
    timed = {r["key"] for r in records if r["type"] == "timing"}
    measured = [key for key in begun if not key.startswith("unavailable/")]
    assert begun[0] in timed and crash["key"] not in timed and set(measured[2:]) <= timed and len(measured) > 4
    assert f"`{crash['key']}`: crash" in report


def _gpu_session_module(monkeypatch):
    import importlib.util
    spec = importlib.util.spec_from_file_location("gpu_session", os.path.join(ROOT, "benchmarks", "gpu_session.py"))
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_session", module)  # its dataclasses look their module up
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))  # the modules it imports beside it
    spec.loader.exec_module(module)
    return module


def test_the_mma_forward_runs_the_kernel_the_hopper_one_replaces(monkeypatch):
    # the sweep's "cupy-mma" times the forward (and backward) with USE_WGMMA off: on an sm_90 device that
    # must launch the mma.sync kernel where "cupy" launches the Hopper one, both give the oracle's answer,
    # and the switch is left as it was
    import numpy as np
    from conftest import assert_matches_oracle
    from flashcupy.tools.emulator.cupy import emulated, recording

    from flashcupy.backends import cupy_backend
    from flashcupy.tools import bench
    gpu_session = _gpu_session_module(monkeypatch)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 70, 2, 128)).astype(np.float16) for _ in range(3))
    launched = []
    with emulated(compile=recording(launched), compute_capability=90):
        forward, _ = bench.closures("cupy", q, k, v, q, True, 128 ** -0.5, "cpu")
        hopper = forward()
        mma = gpu_session.on_mma(forward)()
    assert launched == ["flash_fwd_sm90<__half, 128, 128, 128>", "flash_fwd_tc_wide<__half, 128, 256, 32, 1, 247>"]
    assert cupy_backend.USE_WGMMA
    for out in (hopper, mma):
        assert_matches_oracle((out,), q, k, v, causal=True, backend="cupy")


def test_the_report_says_which_issue_targets_are_met(monkeypatch):
    # timing records as the sweep writes them: each target met, missed or not measured, and cells outside
    # S = 4k..16k (S = 1024 here, far below every target) left out
    gpu_session = _gpu_session_module(monkeypatch)
    tflops = {("forward", 128, False): {"cupy": 500, "torch-cudnn": 480, "torch-flash": 290},  # 1.04x, 1.72x
              ("forward", 64, False): {"cupy": 300, "torch-cudnn": 400},                    # 0.75x
              ("forward", 64, True): {"cupy": 300, "torch-cudnn": 320},                     # 0.94x
              ("backward", 128, False): {"cupy": 500, "torch-cudnn": 490, "torch-flash": 300, "cupy-det": 450},
              ("backward", 128, True): {"cupy": 480, "torch-cudnn": 470, "torch-flash": 290, "cupy-det": 420}}
    records = []
    for (pass_, D, causal), impls in tflops.items():
        for dtype in ("bfloat16", "float16"):
            for S in (1024, 4096, 16384):
                for impl, tf in impls.items():
                    slow = S == 1024 and impl == "cupy"
                    # bfloat16's causal backward at 16k: the deterministic one under 0.85x the default
                    if (impl, dtype, pass_, causal, S) == ("cupy-det", "bfloat16", "backward", True, 16384):
                        tf = 400
                    records.append({"type": "timing", "impl": impl, "dtype": dtype, "pass": pass_, "head_dim": D,
                                    "causal": causal, "seqlen": S, "tflops": tf / 10 if slow else tf,
                                    "batch": 16384 // S, "heads": 2048 // D, "peak_bytes": None})
    verdicts = {(v["issue"], v["pass_"], v["head_dim"], v["causal"], v["other"]): v
                for v in gpu_session.target_verdicts(records)}
    assert len(verdicts) == len(gpu_session.TARGETS)
    got = {key: v["verdict"] for key, v in verdicts.items()}
    assert got == {(26, "forward", 128, (False,), "torch-cudnn"): "met",
                   (26, "forward", 128, (False,), "torch-flash"): "met",
                   (26, "forward", 64, (False,), "torch-cudnn"): "not met",
                   (26, "forward", 128, (True,), "torch-cudnn"): "not measured",  # no causal D=128 forward timed
                   (26, "forward", 64, (True,), "torch-cudnn"): "met",
                   (27, "backward", 128, (False, True), "torch-cudnn"): "met",
                   (27, "backward", 128, (False, True), "torch-flash"): "met",
                   (27, "backward", 128, (False, True), "cupy"): "not met"}
    det = verdicts[(27, "backward", 128, (False, True), "cupy")]
    assert len(det["cells"]) == 8 and det["worst"] == ("bfloat16", True, 16384)  # 2 dtypes x 2 causal x 2 S
    assert abs(det["cells"][det["worst"]] - 400 / 480) < 1e-12
    report = gpu_session.render(records)
    assert "## Issue targets" in report and "5 of 8 targets met." in report
    assert "| 27 | backward | 128 | False or True | cupy-det / cupy | 0.85x | 8 | 0.83x (bfloat16, True, 16384) | " \
           "not met |" in report
    short = gpu_session.short_table(records)
    assert "26 forward D=64 cupy/torch-cudnn not met" in short and "27 backward D=128 cupy-det/cupy not met" in short


def test_the_plot_draws_every_implementation_the_sweep_can_time(monkeypatch, tmp_path):
    # a GPU session can time every one of SWEEP_IMPLS (eleven, and the precise dtypes' peers among them),
    # the dropout cells' and MLA's (v of head dim 128 beside 192: a panel of their own), more than
    # matplotlib's default colour cycle holds: each gets a line, none is lost to a KeyError
    import argparse
    gpu_session = _gpu_session_module(monkeypatch)
    results = gpu_session.Results(str(tmp_path))
    names = ([(impl, None) for impl in gpu_session.SWEEP_IMPLS]
             + [(f"{impl}+dropout", None) for impl in gpu_session.DROPOUT_IMPLS]
             + [(f"{impl}+mla", 128) for impl in gpu_session.MLA_IMPLS])
    for impl, head_dim_v in names:
        for dtype, pass_, S in ((d, p, s) for d in ("bfloat16", "float32") for p in ("forward", "backward")
                                for s in (1024, 4096)):
            results.add(**{"type": "timing", "impl": impl, "dtype": dtype, "pass": pass_,
                           "head_dim": 128 if head_dim_v is None else 192, "head_dim_v": head_dim_v,
                           "causal": True, "seqlen": S, "tflops": 100.0, "batch": 4, "heads": 16,
                           "peak_bytes": 2**20})
    (key, draw), = gpu_session.plot_items(argparse.Namespace(out=str(tmp_path)))
    assert draw() == [{"type": "plot", "file": "speed.png"}]
    assert os.path.getsize(tmp_path / "speed.png") > 0
