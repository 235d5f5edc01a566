"""The contract (tests/contract.py) on the numba backend: on Numba's CUDA simulator here, the
simulator's shapes; on a GPU (numba_device.py decides) those and the shared CASES too."""

import pytest

import contract
from conftest import CASES
from numba_device import GPU, quick_thread_switches  # noqa: F401 (an autouse fixture)

ROWS = contract.table("numba") + contract.table("numba", cases=CASES, modified=False, marks=pytest.mark.gpu,
                                                prefix="gpu-")


@pytest.mark.parametrize("row", ROWS)
def test_contract(rng, row, request):
    if request.node.get_closest_marker("gpu") and not GPU:
        pytest.skip("no CUDA GPU in this process (numba.cuda is the simulator)")
    contract.check(row, rng)
