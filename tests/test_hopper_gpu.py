"""The sm_90 building blocks (kernels/hopper.cuh) on an H100/H200: the emulator's models checked
against silicon.

The cases of tests/test_emulator_hopper.py whose outcome does not depend on timing: the 2-stage
producer/consumer ring through full and empty mbarriers (arrive.expect_tx, complete_tx,
try_wait.parity), mbarrier phases and parities, named barriers passing data, elect.sync, and a
legal setmaxnreg per warpgroup; and the wgmma cases of tests/test_emulator_wgmma.py (tests/wgmma_blocks.py):
SS and RS, f16 and bf16, N 64 and 128, each swizzle, K-major and transposed operands against NumPy,
and wait_group 1 completing the older of two groups; and the TMA cases of tests/test_emulator_tma.py
(tests/tma_blocks.py): 2D boxes with and without the 128B swizzle crossing the tensor's edge, 3D
and 4D boxes, a walk through one mbarrier's phases, a store crossing an edge, a TMA-loaded tile read by
wgmma, byte for byte, and bulk reduce-adds of 264 CTAs in turn through a flag (flag_wait_at_least,
flag_release_add), the same bits as a float32 sum in CTA order. On a GPU their maps come from the driver's cuTensorMapEncodeTiled through
cuda-bindings (flashcupy/tools/emulator/tma.py's gpu_tensor_map_bytes), from the same arguments the
emulator's encode_tiled checks. The kernels (tests/emulator_kernels/hopper.cu, wgmma.cu and tma.cu)
are compiled for
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

import tma_blocks
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


def _tma_unavailable():
    if DEVICE == "emulator":
        return None
    try:
        from cuda.bindings import driver  # noqa: F401
    except ImportError as e:
        return f"the GPU's tensor maps come from cuda-bindings' cuTensorMapEncodeTiled, which does not import: {e}"
    return None


TMA_REASON = _tma_unavailable()


class TmaDeviceFunction(DeviceFunction):
    """DeviceFunction whose TensorMap arguments (the emulator's encode_tiled, checked on the host) become
    the driver's maps of the arrays' device copies, passed by value; those arrays are copied back."""

    def __call__(self, grid, block, args, shared_mem=0):
        import cupy

        from flashcupy.tools.emulator.tma import TensorMap, gpu_tensor_map_bytes
        on_device, back = [], []
        for a in args:
            if isinstance(a, TensorMap):
                device = cupy.asarray(a.array)
                back.append((a.array, device))
                on_device.append(gpu_tensor_map_bytes(device.data.ptr, a.array.dtype.name, a.arguments))
            elif isinstance(a, np.ndarray):
                device = cupy.asarray(a)
                back.append((a, device))
                on_device.append(device)
            else:
                on_device.append(a)
        self.function(grid, block, on_device, shared_mem=shared_mem)
        cupy.cuda.get_current_stream().synchronize()
        for host, device in back:
            host[...] = device.get()


def load(text, names, tmp_path_factory, wrap=DeviceFunction):
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
    return lambda name: wrap(module.get_function(lowered.get(name, name)))


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    return load(source(), (), tmp_path_factory)


@pytest.fixture(scope="module")
def wgmma_kernel(tmp_path_factory):
    return load(wgmma_blocks.source(), wgmma_blocks.NAMES, tmp_path_factory)


@pytest.fixture(scope="module")
def tma_kernel(tmp_path_factory):
    if TMA_REASON is not None:
        pytest.skip(TMA_REASON)
    return load(tma_blocks.source(), tma_blocks.NAMES, tmp_path_factory, TmaDeviceFunction)


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


@pytest.mark.parametrize("fmt", ["float16", "bfloat16"])
@pytest.mark.parametrize("n", wgmma_blocks.K_MAJOR_SIZES)
@pytest.mark.parametrize("swizzle", ["none", "128B"])
@pytest.mark.parametrize("rs", [False, True], ids=["SS", "RS"])
def test_wgmma_gemm_of_a_k_major_b_only_matches_numpy(wgmma_kernel, fmt, n, swizzle, rs, rng):
    wgmma_blocks.check_gemm(wgmma_kernel, fmt, n, 64, swizzle, swizzle, False, False, rs, True, rng)


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


# ----------------------------------------------------------------------------
# TMA (the maps: the emulator's encode_tiled checks the arguments; on a GPU TmaDeviceFunction has
# the driver encode the same ones)


def encode(array, box, swizzle="none", **options):
    from flashcupy.tools.emulator.tma import encode_tiled
    return encode_tiled(array, box, swizzle, **options)


@pytest.mark.parametrize("swizzle", ["none", "128B"])
@pytest.mark.parametrize("coords", [(8, 8), (32, 40), (-8, -4)], ids=["inside", "past the end", "before the start"])
def test_tma_2d_box(tma_kernel, swizzle, coords, rng):
    tma_blocks.check_box_load(tma_kernel, encode, (48, 96), (64, 16), coords, swizzle, rng)


def test_tma_3d_box_crossing_two_edges(tma_kernel, rng):
    tma_blocks.check_box_load(tma_kernel, encode, (20, 4, 32), (32, 2, 8), (0, 3, 16), "64B", rng)


def test_tma_4d_box_of_an_attention_tensor(tma_kernel, rng):
    tma_blocks.check_box_load(tma_kernel, encode, (2, 40, 3, 64), (64, 1, 32, 1), (0, 2, 24, 1), "128B", rng)


def test_tma_boxes_through_the_phases_of_one_mbarrier(tma_kernel, rng):
    tma_blocks.check_phases(tma_kernel, encode, rng)


def test_tma_store_crossing_the_edge_writes_only_inside(tma_kernel, rng):
    tma_blocks.check_store_round_trip(tma_kernel, encode, rng)


@pytest.mark.parametrize("shape, box, coords", [((20, 4, 64), (64, 2, 8), (0, 3, 16)),
                                                ((2, 20, 3, 64), (64, 1, 8, 1), (0, 1, 16, 1))], ids=["3d", "4d"])
def test_tma_3d_and_4d_stores_crossing_the_edge(tma_kernel, shape, box, coords, rng):
    tma_blocks.check_store_round_trip(tma_kernel, encode, rng, shape, box, coords)


def test_bulk_reduce_adds_every_round_of_every_cta(tma_kernel, rng):
    tma_blocks.check_bulk_reduce(tma_kernel, rng, ctas=264)


def test_adds_ordered_by_a_flag_are_the_same_bits_as_in_turn(tma_kernel, rng):
    # 264 CTAs (two waves of an H200's 132 SMs), each waiting for the CTAs of lower index
    dst, want, flags = tma_blocks.ordered_reduce(tma_kernel, rng, ctas=264)
    np.testing.assert_array_equal(dst.view(np.int32), want.view(np.int32))
    assert flags[0] == 264


def test_tma_loaded_tile_read_by_wgmma(tma_kernel, rng):
    tma_blocks.check_tma_then_wgmma(tma_kernel, encode, rng)
