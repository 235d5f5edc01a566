"""The contract (tests/contract.py) on the cupy backend's kernels, run by the CPU CUDA emulator:
the tensor-core and SIMT kernels, each thread order, every dtype (bfloat16 as uint16 bits), the
shared CASES, the modifiers at once. No GPU is needed (flashcupy/tools/emulator/cupy.py); without
g++ the emulator cannot build and these fail loudly."""

import pytest

import contract


@pytest.mark.parametrize("row", contract.table("cupy"))
def test_contract(rng, row):
    contract.check(row, rng)
