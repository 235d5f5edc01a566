"""The test suite's own configuration: under setup.cfg's pytest-xdist options a file's tests run on
one worker, so a module-scoped fixture (compiled modules, kernel counters, an NVRTC report of
minutes) is built once. pytest-xdist's loadgroup stopped doing this without a word under pytest 9.2
(pytest-dev/pytest-xdist#1386), and CI's NVRTC reports were built twice each."""

import os
import subprocess
import sys

MODULE = '''
import os
import pytest

@pytest.fixture(scope="module")
def built():
    with open({log!r}, "a") as f:
        f.write(__name__ + " " + str(os.getpid()) + "\\n")

@pytest.mark.parametrize("n", range(6))
def test_uses_it(built, n):
    pass
'''


def test_a_files_module_fixture_is_built_once_on_two_workers(tmp_path):
    log = tmp_path / "built.txt"
    for name in ("test_first.py", "test_second.py"):
        (tmp_path / name).write_text(MODULE.format(log=str(log)))
    setup_cfg = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "setup.cfg")
    done = subprocess.run([sys.executable, "-m", "pytest", "-c", setup_cfg, "--rootdir", str(tmp_path),
                           "-n", "2", "-p", "no:cacheprovider", "-q", str(tmp_path)],
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "12 passed" in done.stdout
    built = sorted(log.read_text().split("\n")[:-1])
    assert [line.split()[0] for line in built] == ["test_first", "test_second"], built
