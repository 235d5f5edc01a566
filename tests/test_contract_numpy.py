"""The contract (tests/contract.py) on the NumPy backend: both ways it reads K and V, every dtype
(bfloat16 as ml_dtypes arrays and as uint16 bits), the shared CASES, the modifiers at once."""

import pytest

import contract


@pytest.mark.parametrize("row", contract.table("numpy"))
def test_contract(rng, row):
    contract.check(row, rng)
