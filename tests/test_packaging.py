"""What the wheel holds: the runtime and every kernel source it compiles, not the checkout's tools.

The CPU emulator lives in the package tree (flashcupy/tools/emulator/) so that the tools, the tests
and the GPU session import it without editing sys.path; setup.cfg leaves it out of the wheel, and
`python -m flashcupy kernels --counters` must then say so. The wheel is built from a copy of the
tree by the environment's setuptools (no network, no build isolation) and installed into a folder
of its own: a few seconds.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _files(top: str, suffixes: tuple) -> set:
    """Paths relative to ROOT, with '/', of the files under ROOT/top ending in one of `suffixes`."""
    found = set()
    for folder, dirs, names in os.walk(os.path.join(ROOT, top)):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        found |= {os.path.relpath(os.path.join(folder, n), ROOT).replace(os.sep, "/")
                  for n in names if n.endswith(suffixes)}
    return found


def _pip(*args) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", *args, "-q", "--no-deps", "--no-index"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_wheel_holds_every_kernel_source_and_leaves_the_emulator_out(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(os.path.join(ROOT, "flashcupy"), src / "flashcupy",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    _pip("wheel", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src))
    (wheel,) = (tmp_path / "dist").glob("flashcupy-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())

    emulator = {n for n in names if n.startswith("flashcupy/tools/emulator/")}
    assert not emulator, f"the wheel ships the emulator: {sorted(emulator)}"
    kernels = _files("flashcupy/backends", (".cu", ".cuh"))
    assert len(kernels) >= 10 and kernels <= names, f"kernel sources left out: {sorted(kernels - names)}"
    modules = {n for n in _files("flashcupy", (".py",)) if not n.startswith("flashcupy/tools/emulator/")}
    assert modules <= names, f"modules left out: {sorted(modules - names)}"

    # installed where no checkout is near: the counters refuse, naming what is missing
    _pip("install", "--target", str(tmp_path / "site"), str(wheel))
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"))
    code = "import sys, flashcupy.__main__ as cli; print(cli.__file__); sys.exit(cli.main(sys.argv[1:]))"
    done = subprocess.run([sys.executable, "-c", code, "kernels", "--counters"], cwd=tmp_path, env=env,
                          capture_output=True, text=True)
    assert done.stdout.startswith(str(tmp_path / "site")), done.stdout + done.stderr
    assert done.returncode == 2, done.stdout + done.stderr
    assert "needs the CPU emulator" in done.stderr and "checkout" in done.stderr, done.stderr
