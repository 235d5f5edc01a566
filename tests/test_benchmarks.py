"""The asv suite is discoverable and every benchmark imports: a broken benchmark fails CI."""

import os
import shutil
import subprocess
import sys

import pytest

BENCH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def test_asv_check_finds_no_problems():
    asv = shutil.which("asv", path=os.path.dirname(sys.executable)) or shutil.which("asv")
    if asv is None:
        pytest.fail("asv is not installed: it is part of the test extra (pip install -e '.[test]')")
    run = subprocess.run([asv, "check", "-E", f"existing:{sys.executable}"], cwd=BENCH_DIR,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "No problems found" in run.stdout, run.stdout + run.stderr


def test_overhead_fit_recovers_a_fixed_cost_and_a_rate(tmp_path):
    # rows in the check scripts' format, made from t(S) = H + F(S) / R with two known columns: the fit gives
    # back H and R (benchmarks/overhead_fit.py reads the committed H200 figures the same way)
    sys.path.insert(0, BENCH_DIR)
    try:
        import overhead_fit
    finally:
        sys.path.remove(BENCH_DIR)
    from flashcupy.tools import bench
    truth = {"ours": (540e-6, 546e12), "theirs": (52e-6, 679e12)}
    lines = []
    for S in (512, 1024, 2048, 4096, 16384):
        flops = bench.flops(16384 // S, 16, S, 128, False, "forward")
        figures = [flops / (h + flops / r) / 1e12 for h, r in truth.values()]
        lines.append(f"bfloat16 128 False {S} " + " ".join(map(str, figures)) + " 0.001")
        lines.append(f"bfloat16 128 True {S} 1.0 1.0 0.001")  # causal rows: left out of the fit
    lines += ["", "dtype     D   causal  S      ours  theirs  ours/theirs  vs cudnn",
              "bfloat16  128 False   512    1.0  1.0   1.00  1.00e-03"]  # the table after the raw rows
    path = tmp_path / "rows.txt"
    path.write_text("\n".join(lines) + "\n")
    names, rows = overhead_fit.rows(str(path))
    assert names == ["ours", "theirs"] and len(rows) == 10
    group = [r for r in rows if not r[2]]
    gflops = [bench.flops(16384 // r[3], 16, r[3], 128, False, "forward") / 1e9 for r in group]
    for c, (h, r) in enumerate(truth.values()):
        got_h, got_r, worst = overhead_fit.fit([r[3] for r in group], gflops, [row[4][c] for row in group])
        assert abs(got_h - h * 1e6) < 1e-3 * h * 1e6 and abs(got_r - r / 1e12) < 1e-6 * r / 1e12 and worst < 1e-9


def test_compare_jax_runs_every_pass(tmp_path, monkeypatch):
    # the script at a toy size (its report, not its timings): a jitted forward, value_and_grad and
    # jvp for flashcupy.jax and XLA, the direct NumPy calls but the jvp, and the memory of each pass;
    # it had broken unseen once when the NumPy backend's scratch pools moved
    pytest.importorskip("jax", reason="jax[cpu] is in the test extra")
    sys.path.insert(0, BENCH_DIR)
    try:
        import compare_jax
    finally:
        sys.path.remove(BENCH_DIR)
    monkeypatch.setattr(compare_jax, "PAUSE", 0.0)
    path = tmp_path / "jax.md"
    compare_jax.main(["--seqlen", "64", "--heads", "2", "--head-dim", "8", "--rounds", "1", "--memory-seqlens", "64",
                      "--markdown", str(path)])
    text = path.read_text()
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ")[1:] for line in text.splitlines()
            if line.startswith("| jitted")}
    assert set(rows) == {"jitted forward", "jitted value_and_grad", "jitted jvp"}
    assert all(" ms (" in cell for cells in rows.values() for cell in (cells[0], cells[2]))
    assert rows["jitted jvp"][1] == "-" and " ms (" in rows["jitted value_and_grad"][1]
    assert [line.split(" | ")[1] for line in text.splitlines() if line.startswith("| 64 |")] == \
        ["forward", "value_and_grad", "jvp"]
