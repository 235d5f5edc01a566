"""Which numba.cuda the numba tests get (the simulator here, a GPU where one is present), decided
once per process before numba.cuda is first imported, for test_numba_backend.py and
test_contract_numba.py.

numba.cuda decides once, when it is first imported, whether it is the simulator
(NUMBA_ENABLE_CUDASIM=1) or the real thing. This module decides before importing it:
- NUMBA_ENABLE_CUDASIM set in the environment: respected as it is;
- unset and no CUDA device: the simulator, and the variable is removed again once
  numba.cuda is imported, so subprocesses of later tests do not inherit it;
- unset and a CUDA device present: the real device.
Importing it skips the importing test file where numba-cuda is not installed.
"""

import os
import sys

import pytest


def gpu_present() -> bool:
    """A CUDA device answers the driver, asked without importing numba."""
    try:
        from cuda.bindings import driver
        err, = driver.cuInit(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            return False
        err, count = driver.cuDeviceGetCount()
        return err == driver.CUresult.CUDA_SUCCESS and count > 0
    except Exception:  # no bindings, no driver library
        return False


_NUMBA_CUDA_PREIMPORTED = "numba.cuda" in sys.modules
_WE_SET_SIM = (not _NUMBA_CUDA_PREIMPORTED and "NUMBA_ENABLE_CUDASIM" not in os.environ
               and not gpu_present())
if _WE_SET_SIM:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
try:
    cuda = pytest.importorskip("numba.cuda", reason="numba-cuda is not installed (pip install flashcupy[numba])")
finally:
    if _WE_SET_SIM:
        del os.environ["NUMBA_ENABLE_CUDASIM"]

from flashcupy.backends.numba_backend import kernels  # noqa: E402

SIMULATOR = kernels.SIMULATOR
GPU = not SIMULATOR and cuda.is_available()

if _NUMBA_CUDA_PREIMPORTED and not SIMULATOR and not GPU:
    raise RuntimeError(
        "numba.cuda was imported without the simulator before the numba tests, and there is no GPU: "
        "the numba backend cannot be tested in this process. Set NUMBA_ENABLE_CUDASIM=1 in the "
        "environment (or at the top of tests/conftest.py) so numba.cuda starts as the simulator.")


@pytest.fixture(autouse=True)
def quick_thread_switches():
    """Under the simulator, hand the GIL over every 0.2 ms instead of every 5 ms (3-4x faster).

    Its block manager busy-polls the block's Python threads to release them from
    cuda.syncthreads(); with the default switch interval every barrier costs milliseconds.
    A test file that imports this fixture has it for every test.
    """
    if not SIMULATOR:
        yield
        return
    old = sys.getswitchinterval()
    sys.setswitchinterval(2e-4)
    yield
    sys.setswitchinterval(old)


def require(device):
    """Skip unless this process's numba.cuda is `device` ("simulator" or "gpu")."""
    if device == "simulator" and not SIMULATOR:
        pytest.skip("numba.cuda is not the simulator in this process (the gpu battery covers these cases)")
    if device == "gpu" and not GPU:
        pytest.skip("no CUDA GPU in this process" + (" (numba.cuda is the simulator)" if SIMULATOR else ""))
