"""Every sync-point mutant of the kernels from one build: the kernel sources with each listed call guarded.

test_hopper_kernels.py and test_cupy_backend.py remove each barrier, wait and fence of the kernels in turn,
and some thread order must then give a wrong answer or an emulator error. Removed from the text, each call
made a source of its own, and g++ built every module its problems reach once more for it: some 280 of the
700 module builds of a CI run with the emulator's cache empty. Here each listed call is wrapped instead,
`EMU_UNLESS_MUTANT(id, call);`, which runs it unless $FLASHCUPY_TEST_MUTANT is `id`: one source per kernel
file for all the mutants, built once per specialisation, the mutant chosen by the environment as the
kernel runs. Only the emulator compiles these sources; a guarded call not chosen is the call itself, and
each test file runs its problems on the guarded sources with none chosen, so that a guard that skipped
more than its own call would fail there.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import tempfile
from unittest import mock

from flashcupy.backends.cupy_backend import sources

ENV = "FLASHCUPY_TEST_MUTANT"
PRELUDE = (
    "#include <cstdlib>\n"
    f'static inline int emu_mutant() {{ const char* id = std::getenv("{ENV}"); return id ? std::atoi(id) : 0; }}\n'
    "#define EMU_UNLESS_MUTANT(id, ...) do { if (emu_mutant() != (id)) { __VA_ARGS__; } } while (0)\n"
)


def guard(n: int) -> str:
    """The text that opens point n's guard in a guarded source."""
    return f"EMU_UNLESS_MUTANT({n}, "


@functools.lru_cache(maxsize=None)
def guarded(points: tuple, pattern: re.Pattern) -> dict:
    """{top-level kernel file (.cu): (its source, the same with every point's call guarded)}, as
    sources.read_source gives them (headers inlined), for each file whose text a guard reaches. The
    points are (kernel file, line number); point n (from 1) guards the first call `pattern` finds on its
    line outside a comment (a whole statement, ending in ";") as EMU_UNLESS_MUTANT(n, call)."""
    tops = sorted(f for f in os.listdir(sources.KERNEL_DIR) if f.endswith(".cu"))
    with tempfile.TemporaryDirectory() as folder:
        kernel_dir = shutil.copytree(sources.KERNEL_DIR, os.path.join(folder, "kernels"))
        edits: dict = {}
        for n, (name, lineno) in enumerate(points, 1):
            edits.setdefault(name, []).append((n, lineno))
        for name, at in edits.items():
            path = os.path.join(kernel_dir, name)
            with open(path, encoding="utf-8") as f:
                lines = f.read().splitlines(keepends=True)
            for n, lineno in at:
                code = lines[lineno - 1].split("//")[0]
                call = pattern.search(code).group(0)
                assert call.endswith(";"), f"{name}:{lineno}: {call!r} is not a whole statement"
                lines[lineno - 1] = lines[lineno - 1].replace(call, f"{guard(n)}{call[:-1]});", 1)
            with open(path, "w", encoding="utf-8") as f:
                f.write("".join(lines))
        with mock.patch.object(sources, "KERNEL_DIR", kernel_dir):
            mutants = {f: sources.read_source(f) for f in tops}
    originals = {f: sources.read_source(f) for f in tops}
    return {f: (originals[f], PRELUDE + mutants[f]) for f in tops if mutants[f] != originals[f]}


def reached(pairs: dict, n: int) -> dict:
    """The items of guarded()'s `pairs` whose guarded text holds point n's guard."""
    return {name: pair for name, pair in pairs.items() if guard(n) in pair[1]}
