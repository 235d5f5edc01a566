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
