"""The tensor-core building blocks on a real GPU: the emulator's model of each PTX instruction,
checked against silicon.

tests/test_emulator_tensor_core.py checks the emulator's mma, ldmatrix, cp.async, pack and ex2 against the
PTX ISA's fragment layouts written out in NumPy. Here the same test kernels
(tests/emulator_kernels/tensor_core.cu) and the same checks (tests/tensor_core_blocks.py) run
through cupy.RawModule with the backend's own compile options, so a GPU confirms both the ISA
reading and the emulator in seconds, before any attention kernel is trusted. Marked `gpu`; the GPU session runs this file
first (benchmarks/gpu_session.py). FLASHCUPY_BLOCKS_DEVICE=emulator runs it on the emulator
instead, which is how the session's dry run exercises this stage without a GPU.

Not repeated here: the checks that only an emulator can make (a missing cp.async wait reads
NaN garbage, misuse is reported); on silicon their outcome depends on timing.
"""

from __future__ import annotations

import os

import pytest

import tensor_core_blocks as blocks
from conftest import DeviceFunction
from flashcupy.backends import cupy_backend
from flashcupy.backends.cupy_backend import sources

DEVICE = os.environ.get("FLASHCUPY_BLOCKS_DEVICE", "cupy")
if DEVICE not in ("cupy", "emulator"):
    raise ValueError(f"FLASHCUPY_BLOCKS_DEVICE must be 'cupy' or 'emulator', got {DEVICE!r}")
REASON = cupy_backend.unavailable_reason() if DEVICE == "cupy" else None
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=f"no GPU for cupy: {REASON}")]


@pytest.fixture(autouse=True)
def on_device(monkeypatch):
    if DEVICE == "emulator":
        yield
        return
    import cupy
    modules = {}

    def kernel(name, order="ascending", turing=False):
        # turing: tensor_core.cuh's Turing stand-ins, on this GPU's own arch (blocks.TURING_OPTIONS)
        if turing not in modules:
            names, extra = (blocks.TURING_NAMES, blocks.TURING_OPTIONS["gpu"]) if turing else (blocks.NAMES, ())
            modules[turing] = cupy.RawModule(code=blocks.source(), name_expressions=names,
                                             options=sources.COMPILE_OPTIONS + (blocks.INCLUDE, *extra))
        return DeviceFunction(modules[turing].get_function(name))
    monkeypatch.setattr(blocks, "kernel", kernel)
    yield


@pytest.mark.parametrize("fmt", blocks.NARROW)
def test_mma_c_and_d_layout(fmt):
    blocks.check_mma_c_and_d_layout(fmt)


@pytest.mark.parametrize("fmt", blocks.NARROW)
def test_mma_a_layout(fmt, rng):
    blocks.check_mma_a_layout(fmt, rng)


@pytest.mark.parametrize("fmt", blocks.NARROW)
def test_mma_b_layout(fmt, rng):
    blocks.check_mma_b_layout(fmt, rng)


@pytest.mark.parametrize("fmt", blocks.NARROW)
def test_mma_random(fmt, rng):
    blocks.check_mma_random(fmt, rng)


def test_mma_k8(rng):
    blocks.check_mma_k8(rng)


@pytest.mark.parametrize("a_rows", [16, 11])
def test_turing_stand_ins(a_rows, rng):
    blocks.check_turing("ascending", a_rows, rng)


@pytest.mark.parametrize("num,trans", blocks.LDMATRIX, ids=[f"x{n}{'.trans' if t else ''}" for n, t in blocks.LDMATRIX])
def test_ldmatrix(num, trans, rng):
    blocks.check_ldmatrix(num, trans, rng)


@pytest.mark.parametrize("fmt", blocks.NARROW)
@pytest.mark.parametrize("a_rows", [16, 11])
def test_tile_matmul_matches_numpy(fmt, a_rows, rng):
    blocks.check_tile_matmul_matches_numpy(fmt, "ascending", a_rows, rng)


def test_pack_and_exp(rng):
    blocks.check_pack_and_exp(rng)
