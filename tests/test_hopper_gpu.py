"""The sm_90 building blocks (kernels/hopper.cuh) on an H100/H200: the emulator's models checked
against silicon.

The cases of tests/test_emulator_hopper.py whose outcome does not depend on timing: the 2-stage
producer/consumer ring through full and empty mbarriers (arrive.expect_tx, complete_tx,
try_wait.parity), mbarrier phases and parities, named barriers passing data, elect.sync, and a
legal setmaxnreg per warpgroup; and the wgmma cases of tests/test_emulator_wgmma.py (tests/wgmma_blocks.py):
SS and RS, f16 and bf16, N 64 and 128, each swizzle, K-major and transposed operands against NumPy,
and wait_group 1 completing the older of two groups. The kernels (tests/emulator_kernels/hopper.cu
and wgmma.cu) are compiled for
sm_90a by NVRTC through flashcupy/tools/nvrtc.py (CuPy's RawModule(code=) cannot target sm_90a)
and loaded from the cubin. Marked `gpu`; skipped without a compute capability 9.0 device.
FLASHCUPY_BLOCKS_DEVICE=emulator runs them on the emulator instead (a dry run of this file).

Not repeated here: the checks that only an emulator can make (deadlocks reported, misuse caught,
a deleted wait giving a wrong answer, accumulators read before their wait_group); on silicon those
hang, are undefined, or depend on timing.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import wgmma_blocks
from conftest import DeviceFunction
from flashcupy.backends import cupy_backend
from flashcupy.backends.cupy_backend import sources

HERE = os.path.dirname(os.path.abspath(__file__))
TEST_KERNELS = os.path.join(HERE, "emulator_kernels", "hopper.cu")
NAMES = ("ring", "mbarrier_cases", "named", "elect", "maxnreg")
TILE = 64

DEVICE = os.environ.get("FLASHCUPY_BLOCKS_DEVICE", "cupy")
if DEVICE not in ("cupy", "emulator"):
    raise ValueError(f"FLASHCUPY_BLOCKS_DEVICE must be 'cupy' or 'emulator', got {DEVICE!r}")


def _unavailable():
    if DEVICE == "emulator":
        return None
    reason = cupy_backend.unavailable_reason()
    if reason is not None:
        return f"no GPU for cupy: {reason}"
    import cupy
    cc = cupy.cuda.Device().compute_capability
    return None if cc == "90" else f"sm_90a kernels need a compute capability 9.0 device, this one is {cc}"


REASON = _unavailable()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=str(REASON))]


def source():
    with open(TEST_KERNELS) as f:
        return f.read()


def load(text, names, tmp_path_factory):
    """name -> a function called like the emulator's, for `names` of the kernels `text`."""
    if DEVICE == "emulator":
        from flashcupy.tools.emulator import EmulatedModule
        return EmulatedModule(text, names, (f"-I{sources.KERNEL_DIR}",)).get_function
    import cupy

    from flashcupy.tools import nvrtc
    _, lowered, cubin = nvrtc.compile_cubin(text, names, nvrtc.compile_options("sm_90a")
                                            + (f"-I{sources.KERNEL_DIR}",))
    path = tmp_path_factory.mktemp("hopper") / "kernels.cubin"
    path.write_bytes(cubin)
    module = cupy.RawModule(path=str(path))
    return lambda name: DeviceFunction(module.get_function(lowered.get(name, name)))


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    return load(source(), (), tmp_path_factory)


@pytest.fixture(scope="module")
def wgmma_kernel(tmp_path_factory):
    return load(wgmma_blocks.source(), wgmma_blocks.NAMES, tmp_path_factory)


def filled(n, dtype):
    return np.full(n, -1, dtype)


def test_ring_of_two_stages_through_full_and_empty_barriers(kernel):
    x = (np.arange(5 * TILE) % 7).astype(np.float32)
    out = filled(TILE, np.float32)
    kernel("ring")((1,), (96,), (x, np.int32(5), out, np.int32(0)))
    want = np.array([sum((TILE * t + c) % 7 for t in range(5)) for c in range(TILE)], np.float32)
    np.testing.assert_array_equal(out, want)


def test_mbarrier_phases_and_parities(kernel):
    out = filled(4 * 64, np.int32)
    kernel("mbarrier_cases")((1,), (64,), (np.int32(2), out), shared_mem=16)
    got, tid = out.reshape(64, 4), np.arange(64)
    for p in range(3):
        np.testing.assert_array_equal(got[:, p], 100 * p + (tid + 1) % 64)
    np.testing.assert_array_equal(got[:, 3], 1)


@pytest.mark.parametrize("mode", [0, 7])
def test_named_barriers(kernel, mode):
    out = filled(128, np.int32)
    kernel("named")((1,), (128,), (np.int32(mode), out))
    np.testing.assert_array_equal(out[:64], 0)
    if mode == 0:
        np.testing.assert_array_equal(out[64:], 10 * np.arange(64) + 1)


@pytest.mark.parametrize("live, mask, leader", [(0xFFFFFFFF, 0xFFFFFFFF, 0), (0x00F0F000, 0x00F0F000, 12),
                                                (0xFFFFFFF0, 0xFFFFFFFF, 4)])
def test_elect_sync_elects_the_lowest_lane_present(kernel, live, mask, leader):
    out = filled(32, np.int32)
    kernel("elect")((1,), (32,), (np.uint32(live), np.uint32(mask), out))
    want = np.array([-1 if not (live >> lane) & 1 else int(lane == leader) for lane in range(32)], np.int32)
    np.testing.assert_array_equal(out, want)


def test_setmaxnreg_per_warpgroup(kernel):
    out = filled(256, np.int32)
    kernel("maxnreg")((1,), (256,), (np.int32(0), out))
    np.testing.assert_array_equal(out, 1)


# ----------------------------------------------------------------------------
# wgmma


@pytest.mark.parametrize("fmt", ["float16", "bfloat16"])
@pytest.mark.parametrize("b_swizzle, trans_b", [("none", False), ("128B", False), ("none", True), ("128B", True)])
def test_wgmma_identity_a_gives_b_back(wgmma_kernel, fmt, b_swizzle, trans_b):
    wgmma_blocks.check_identity_picks_b(wgmma_kernel, fmt, 64, b_swizzle, trans_b)


@pytest.mark.parametrize("fmt", ["float16", "bfloat16"])
@pytest.mark.parametrize("n", wgmma_blocks.SIZES)
@pytest.mark.parametrize("swizzle", ["none", "128B"])
@pytest.mark.parametrize("trans_b", [False, True], ids=["B K-major", "B transposed"])
@pytest.mark.parametrize("rs", [False, True], ids=["SS", "RS"])
def test_wgmma_gemm_matches_numpy(wgmma_kernel, fmt, n, swizzle, trans_b, rs, rng):
    wgmma_blocks.check_gemm(wgmma_kernel, fmt, n, 64, swizzle, swizzle, False, trans_b, rs, True, rng)


@pytest.mark.parametrize("swizzle", ["32B", "64B"])
@pytest.mark.parametrize("trans_a, trans_b", [(False, False), (True, True)])
def test_wgmma_other_swizzles_and_transposed_a(wgmma_kernel, swizzle, trans_a, trans_b, rng):
    wgmma_blocks.check_gemm(wgmma_kernel, "bfloat16", 64, 64, swizzle, swizzle, trans_a, trans_b, False, False, rng)


@pytest.mark.parametrize("trans_b", [False, True], ids=["B K-major", "B transposed"])
def test_wgmma_d_packed_as_the_next_a(wgmma_kernel, trans_b, rng):
    wgmma_blocks.check_d_packed_as_the_next_a(wgmma_kernel, trans_b, rng)


def test_wgmma_tiles_in_static_shared_memory(wgmma_kernel, rng):
    wgmma_blocks.check_static_shared_tiles(wgmma_kernel, "float16", rng)


def test_wgmma_wait_group_1_completes_the_older_group(wgmma_kernel, rng):
    wgmma_blocks.check_wait_group_1_completes_the_older_group(wgmma_kernel, "bfloat16", rng)
