"""The emulator's model of TMA (kernels/hopper.cuh; flashcupy/tools/emulator/include/emu_tma.h,
runtime/tma.h, tma.py).

Boxes loaded by cp.async.bulk.tensor (2D, 3D and 4D, swizzle none/32B/64B/128B) byte for byte against
NumPy, crossing the tensor's edges (zeros); a walk through one mbarrier's phases; a store that
crosses an edge; a TMA-loaded 128B-swizzled tile read by wgmma (S = Q K^T); the mbarrier's phase
waiting for the bytes; and each misuse reported: encode arguments the driver rejects, a
misaligned destination, a map reaching past its array, the wrong rank, a map passed where it does
not belong; and the async proxy: a TMA store of ordinary stores needs fence.proxy.async in each
writer (also after a TMA load the stores overwrite), ordinary reads after the wait need none.
tests/test_hopper_gpu.py runs the non-timing cases on an H100/H200.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import tma_blocks as blocks
from flashcupy.backends.cupy_backend import sources
from flashcupy.tools.emulator import DeadlockError, EmulatedModule, KernelError, LaunchError
from flashcupy.tools.emulator.tma import TensorMapError, encode_tiled

_modules = {}


def kernel(name, order="ascending"):
    if order not in _modules:
        _modules[order] = EmulatedModule(blocks.source(), blocks.NAMES, (f"-I{sources.KERNEL_DIR}",),
                                         thread_order=order)
    return _modules[order].get_function(name)


# ----------------------------------------------------------------------------
# values


@pytest.mark.parametrize("swizzle", ["none", "32B", "64B", "128B"])
def test_a_2d_box_inside_the_tensor(swizzle, rng):
    inner = blocks.SPAN[swizzle] // 2 if swizzle != "none" else 24
    blocks.check_box_load(kernel, encode_tiled, (48, 96), (inner, 16), (8, 8), swizzle, rng)


@pytest.mark.parametrize("swizzle", ["none", "128B"])
@pytest.mark.parametrize("coords", [(32, 40), (-8, -4)], ids=["past the end", "before the start"])
def test_a_2d_box_crossing_the_edge_reads_zeros(swizzle, coords, rng):
    blocks.check_box_load(kernel, encode_tiled, (48, 96), (64, 16), coords, swizzle, rng)


def test_a_box_of_a_strided_view(rng):
    # 48 of 56 columns: a row stride of 112 bytes, a multiple of 16 (the guarded buffer spans the view)
    array = rng.standard_normal((24, 56)).astype(np.float16)[:, :48]
    got = blocks.load_box(kernel, encode_tiled, array, (32, 16), (24, 16), "64B")[0]
    want = blocks.swizzle_bytes(np.ascontiguousarray(blocks.expected_box(array, (32, 16), (24, 16))).view(np.uint8)
                                .ravel(), "64B")
    np.testing.assert_array_equal(got, want)


def test_a_3d_box_crossing_two_edges(rng):
    # (seqlen, heads, head_dim) = (20, 4, 32): 2 heads from head 3 and 8 rows from row 16
    blocks.check_box_load(kernel, encode_tiled, (20, 4, 32), (32, 2, 8), (0, 3, 16), "64B", rng)


def test_a_4d_box_of_an_attention_tensor(rng):
    # (batch, seqlen, heads, head_dim) = (2, 40, 3, 64): one head's 32 rows from row 24, crossing seqlen's end
    blocks.check_box_load(kernel, encode_tiled, (2, 40, 3, 64), (64, 1, 32, 1), (0, 2, 24, 1), "128B", rng)


def test_a_4d_box_of_float32(rng):
    blocks.check_box_load(kernel, encode_tiled, (1, 20, 2, 32), (32, 2, 16, 1), (0, 0, 8, 0), "128B", rng,
                          dtype=np.float32)


@pytest.mark.parametrize("order", ["ascending", "descending", "warp_skew"])
def test_boxes_through_the_phases_of_one_mbarrier(order, rng):
    blocks.check_phases(lambda name: kernel(name, order), encode_tiled, rng)


def test_a_store_crossing_the_edge_writes_only_inside(rng):
    blocks.check_store_round_trip(kernel, encode_tiled, rng)


@pytest.mark.parametrize("shape, box, coords", [((20, 4, 64), (64, 2, 8), (0, 3, 16)),
                                                ((2, 20, 3, 64), (64, 1, 8, 1), (0, 1, 16, 1))], ids=["3d", "4d"])
def test_3d_and_4d_stores_crossing_the_edge(shape, box, coords, rng):
    blocks.check_store_round_trip(kernel, encode_tiled, rng, shape, box, coords)


@pytest.mark.parametrize("order", ["ascending", "descending"])
def test_a_tma_loaded_tile_read_by_wgmma(order, rng):
    blocks.check_tma_then_wgmma(lambda name: kernel(name, order), encode_tiled, rng)


def test_the_phase_waits_for_the_bytes(rng):
    # expect_tx of two boxes, one box issued: the barrier's tx-count never reaches zero
    array = rng.standard_normal((16, 64)).astype(np.float16)
    with pytest.raises(DeadlockError, match=r"mbarrier"):
        blocks.load_box(kernel, encode_tiled, array, (64, 16), (0, 0), "128B", mode="short")


# ----------------------------------------------------------------------------
# misuse


@pytest.mark.parametrize("make, message", [
    (lambda: encode_tiled(np.zeros((8, 52), np.float16)[:, :48], (16, 8)),
     r"globalStrides\[0\] = 104 bytes: it must be a positive multiple of 16"),
    (lambda: encode_tiled(np.zeros((8, 50), np.float16), (16, 8)),
     r"globalStrides\[0\] = 100 bytes"),
    (lambda: encode_tiled(np.zeros((512, 64), np.float16), (64, 300)), r"boxDim\[1\] = 300: it must be in \[1, 256\]"),
    (lambda: encode_tiled(np.zeros((8, 128), np.float16), (128, 8), "128B"),
     r"boxDim\[0\] = 128 elements of 2 bytes is 256 bytes, more than the 128B swizzle's span of 128 bytes"),
    (lambda: encode_tiled(np.zeros((8, 64), np.float16), (12, 8)), r"the inner box must be a multiple of 16 bytes"),
    (lambda: encode_tiled(np.zeros((8, 64), np.float16), (32, 8), "128B"),
     r"64 bytes, less than the 128B swizzle's span of 128 bytes: not modelled"),
    (lambda: encode_tiled(np.zeros(1000, np.float16)[1:65].reshape(8, 8), (8, 8)),
     r"globalAddress 0x[0-9a-f]+ \(the array's first element\) is not 16-byte aligned"),
    (lambda: encode_tiled(np.zeros((8, 64), np.float16), (64, 8), element_strides=(1, 9)),
     r"elementStrides\[1\] = 9"),
    (lambda: encode_tiled(np.zeros((8, 64), np.float16), (64,)), r"boxDim has 1 entries; a rank-2 map needs 2"),
], ids=["row stride 104 of a view", "row stride 100", "box of 300", "inner box past the swizzle", "inner box 24 bytes",
        "inner box short of the swizzle",
        "address", "element stride", "box rank"])
def test_encode_rejects_what_the_driver_rejects(make, message):
    with pytest.raises(TensorMapError, match=message):
        make()


def test_a_misaligned_destination_is_reported(rng):
    array = rng.standard_normal((16, 64)).astype(np.float16)
    with pytest.raises(KernelError, match=r"tma_load\): the shared-memory destination 0x[0-9a-f]+ is not 128-byte "
                                          r"aligned shared memory \(swizzle 128B\)") as info:
        blocks.load_box(kernel, encode_tiled, array, (64, 16), (0, 0), "128B", mode="misaligned")
    assert info.value.kernel == "tma_box" and info.value.thread == (0, 0, 0)


def test_a_destination_16_bytes_off_is_reported_without_swizzle_too(rng):
    array = rng.standard_normal((16, 64)).astype(np.float16)
    with pytest.raises(KernelError, match=r"is not 128-byte aligned shared memory \(swizzle none\)"):
        blocks.load_box(kernel, encode_tiled, array, (64, 16), (0, 0), "none", mode="misaligned")


def test_a_map_reaching_past_its_array_is_reported(rng):
    array = rng.standard_normal((16, 64)).astype(np.float16)
    with pytest.raises(KernelError, match=r"outside every array argument of the launch: its dims or strides reach "
                                          r"past the array it was made from"):
        blocks.load_box(kernel, encode_tiled, array, (64, 16), (0, 16), "128B", dims=(64, 64))


def test_a_map_of_the_wrong_rank_is_reported(rng):
    array = rng.standard_normal((16, 64)).astype(np.float16)
    tmap = encode_tiled(array, (64, 16), "128B")
    out = np.zeros(2048, np.uint8)
    with pytest.raises(KernelError, match=r"a 3d instruction on a tensor map of rank 2"):
        kernel("tma_box")((1,), (32,), (tmap, np.int32(3), *(np.int32(0),) * 4, np.int32(2048), np.int32(1),
                                        np.int32(0), out), shared_mem=4096)


def test_a_map_passed_to_a_pointer_is_a_launch_error(rng):
    array = rng.standard_normal((16, 64)).astype(np.float16)
    tmap = encode_tiled(array, (64, 16))
    with pytest.raises(LaunchError, match=r"argument 9 is a tensor map, but the parameter is a 8-byte pointer"):
        kernel("tma_box")((1,), (32,), (tmap, np.int32(2), *(np.int32(0),) * 4, np.int32(2048), np.int32(1),
                                        np.int32(0), tmap), shared_mem=4096)


# ----------------------------------------------------------------------------
# the async proxy (emu_hopper.h): ordinary stores a TMA store reads need fence.proxy.async


_PROXY = (r"cp.async.bulk.tensor store \(tma_store\) by thread \(0,0,0\) reads the byte at shared address "
          r"0x[0-9a-f]+ through the async proxy, but thread \((\d+),0,0\) last wrote it with an ordinary store "
          r"and has not executed fence.proxy.async since")


@pytest.mark.parametrize("mode", ["fenced", "load, overwrite, fenced"])
def test_fenced_ordinary_stores_are_stored_by_tma(mode, rng):
    # "load, overwrite": the untouched half is async-written (the TMA load) and needs no fence
    dst, want = blocks.fill_store(kernel, encode_tiled, rng, mode)
    np.testing.assert_array_equal(dst, want)


@pytest.mark.parametrize("mode, writer", [("no proxy fence", 0), ("proxy fence in thread 0 only", 1),
                                          ("load, overwrite, no proxy fence", 0)])
def test_unfenced_ordinary_stores_read_by_a_tma_store_are_reported(mode, writer, rng):
    # the first unfenced byte of the tile (byte 0, or byte 1 when thread 0 fenced) names its writer
    with pytest.raises(KernelError, match=_PROXY) as info:
        blocks.fill_store(kernel, encode_tiled, rng, mode)
    assert info.value.kernel == "tma_fill_store" and info.value.thread == (writer, 0, 0)
    assert re.search(_PROXY, str(info.value)).group(1) == str(writer)


def test_ordinary_reads_of_a_tma_loaded_tile_after_the_wait_are_not_reported(rng):
    # tma_box's threads read the box with ordinary loads after mbarrier_wait_parity: ordered by the mbarrier
    blocks.check_box_load(kernel, encode_tiled, (48, 96), (64, 16), (8, 8), "128B", rng)


# ----------------------------------------------------------------------------
# bulk reduce-adds (cp.reduce.async.bulk .add.f32): the dQ of flash_bwd_sm90.cu


def test_bulk_reduce_adds_every_round_of_every_cta(rng):
    blocks.check_bulk_reduce(kernel, rng)


def test_a_bulk_reduce_reads_its_source_at_the_wait(rng):
    # thread 0 waits only after the last round: the model reads every round's tile there, so each adds
    # the last round's values (on silicon a race: the next round overwrites a source not yet read)
    dst, base, src = blocks.bulk_reduce(kernel, rng, "wait after the last round", ctas=2)
    np.testing.assert_allclose(dst, base + 2 * 3 * src[-1], rtol=1e-5, atol=1e-5)
    assert not np.allclose(dst, base + 2 * src.sum(axis=0), rtol=1e-5, atol=1e-5)


def test_a_bulk_reduce_of_a_size_not_a_multiple_of_16_is_reported(rng):
    with pytest.raises(KernelError, match=r"cp.reduce.async.bulk .add.f32.*not a positive multiple of 16"):
        blocks.bulk_reduce(kernel, rng, "size not a multiple of 16")


# ----------------------------------------------------------------------------
# flags between CTAs: the deterministic dQ of flash_bwd_sm90.cu (its CTAs add into a tile in turn)


@pytest.mark.parametrize("order", ["ascending", "descending", "shuffled", "warp_skew"])
def test_adds_ordered_by_a_flag_are_the_same_bits_in_every_block_order(order, rng):
    # descending: every CTA but the first parks at its flag wait, and resumes in turn
    dst, want, flags = blocks.ordered_reduce(lambda name: kernel(name, order), rng)
    np.testing.assert_array_equal(dst.view(np.int32), want.view(np.int32))
    assert flags[0] == 5 and (flags[1:] == 0).all()


def test_adds_without_the_flag_wait_follow_the_block_order(rng):
    # the check above can fail: without the wait the CTAs add in the order the blocks run
    dst, want, _ = blocks.ordered_reduce(lambda name: kernel(name, "ascending"), rng, "no flag wait")
    np.testing.assert_array_equal(dst.view(np.int32), want.view(np.int32))
    dst, want, _ = blocks.ordered_reduce(lambda name: kernel(name, "descending"), rng, "no flag wait")
    assert (dst.view(np.int32) != want.view(np.int32)).any()


@pytest.mark.parametrize("mode, message", [
    ("wait_group.read", r"flag_release_add .* 1 bulk store\(s\) or reduce-add\(s\) of this thread not complete"),
    ("no fence after the wait", r"bulk_reduce_add_f32\) after a flag_wait .* without fence.proxy.async.global"),
    ("no fence before the release", r"flag_release_add .* after bulk writes completed without fence.proxy.async.global"),
])
def test_a_release_or_an_add_out_of_order_with_the_proxies_is_reported(mode, message, rng):
    with pytest.raises(KernelError, match=message):
        blocks.ordered_reduce(lambda name: kernel(name, "descending"), rng, mode)


def test_a_flag_that_never_reaches_its_value_is_a_deadlock(rng):
    message = (r"5 block\(s\) wait for flags in global memory that no block raises; in block \(4,0,0\) 1 thread\(s\) "
               r".* wait in flag_wait for the int at 0x[0-9a-f]+ to reach 5, and it holds 0")
    with pytest.raises(DeadlockError, match=message):
        blocks.ordered_reduce(lambda name: kernel(name, "descending"), rng, "a flag never reached")
    # the launch after it parks and resumes its blocks as before (the parked stacks were released)
    dst, want, _ = blocks.ordered_reduce(lambda name: kernel(name, "descending"), rng)
    np.testing.assert_array_equal(dst.view(np.int32), want.view(np.int32))
