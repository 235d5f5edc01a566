"""The test suite's own configuration and layout.

Under setup.cfg's pytest-xdist options a file's tests run on one worker, so a module-scoped fixture
(compiled modules, kernel counters, an NVRTC report of minutes) is built once. pytest-xdist's
loadgroup stopped doing this without a word under pytest 9.2 (pytest-dev/pytest-xdist#1386), and
CI's NVRTC reports were built twice each.

No test file imports another: what several files share lives in a helper module named for what it
holds (tests/README.md lists them), so each file reads on its own and no file's tests depend on
another's being importable.
"""

import ast
import glob
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


HERE = os.path.dirname(os.path.abspath(__file__))
TEST_MODULES = {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(HERE, "test_*.py"))}


def imported_test_modules(source: str) -> set:
    """The test modules (tests/test_*.py) that `source` imports, at any depth and in any spelling:
    import test_x, from test_x import y, from tests.test_x import y, from . import test_x and
    from .test_x import y."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            dotted = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            dotted = [node.module or ""] + [f"{node.module or ''}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {part for name in dotted for part in name.split(".") if part in TEST_MODULES}
    return found


def test_no_test_file_imports_another():
    for spelling in ("import test_modifiers as m", "from test_varlen import packed_inputs",
                     "from tests.test_nvrtc import ARCHS", "from . import test_modifiers",
                     "from .test_varlen import LENGTHS", "def f():\n    import test_modifiers\n"):
        assert imported_test_modules(spelling), spelling
    assert not imported_test_modules("from conftest import make_qkv\nimport modifier_checks\nimport tests")
    offenders = {}
    for path in sorted(glob.glob(os.path.join(HERE, "test_*.py"))):
        with open(path) as f:
            imported = imported_test_modules(f.read())
        if imported:
            offenders[os.path.basename(path)] = sorted(imported)
    assert not offenders, f"test files that import test files (move what they share to a helper module): {offenders}"


def test_the_random_search_runs_every_surface_and_counts_what_fails(monkeypatch, capsys):
    """tests/random_search.py (a search for defects the batteries miss, run by hand): a few cases of each
    surface pass against the oracle, and a wrong answer is counted, not hidden."""
    import numpy as np

    import flashcupy
    import random_search

    for surface in random_search.SURFACES:
        assert random_search.search(random_search.parse([surface, "-n", "2", "--seed", "3"])) == 0, surface
    attention = flashcupy.attention

    def off(*args, **kw):  # out off by 1 %
        out, lse = attention(*args, **kw)
        return out * np.asarray(1.01, out.dtype), lse

    monkeypatch.setattr(flashcupy, "attention", off)
    assert random_search.search(random_search.parse(["attention", "-n", "3", "--dtypes", "float32,float64"])) == 3
    assert capsys.readouterr().out.count("FAIL") == 3
