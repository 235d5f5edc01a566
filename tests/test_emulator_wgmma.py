"""The emulator's model of wgmma (kernels/hopper.cuh; flashcupy/tools/emulator/include/emu_wgmma.h).

wgmma.mma_async SS and RS, f16 and bf16 into f32, N = 64 and 128 (and 176, 192, K-major: the wide forward's),
K-major and transposed (MN-major)
operands, each swizzle mode, against NumPy's matmul of tiles laid out in shared memory by hand
(tests/wgmma_blocks.py); the asynchronous semantics (the accumulators hold NaN until the wait that
covers their group, wait_group 1 leaves the newest group in flight); and the misuses reported: a
descriptor not aligned to its swizzle, a base offset, a warpgroup whose warps differ or are missing,
a missing wgmma.fence, tiles written by ordinary stores without fence.proxy.async in each writing
thread (the async proxy). tests/test_hopper_gpu.py runs the same non-timing cases on an H100/H200.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import wgmma_blocks as blocks
from flashcupy.tools.emulator import DeadlockError, EmulatedModule, KernelError
from wgmma_blocks import INCLUDE, NAMES, problem, run, source, want

FORMATS = ("float16", "bfloat16")
_modules = {}


def kernel(name, order="ascending"):
    if order not in _modules:
        _modules[order] = EmulatedModule(source(), NAMES, (INCLUDE,), thread_order=order)
    return _modules[order].get_function(name)


# ----------------------------------------------------------------------------
# values


def test_fragment_layout_is_a_bijection():
    rows, cols = blocks.fragment_index(128)
    assert len(set(zip(rows.ravel(), cols.ravel()))) == 64 * 128
    # thread 37 (warp 1, lane 5): rows 16 + 1 and 16 + 9, columns 2, 3, then 10, 11 ...
    assert rows[37, :4].tolist() == [17, 17, 25, 25] and cols[37, :6].tolist() == [2, 3, 2, 3, 10, 11]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("b_swizzle, trans_b", [("none", False), ("128B", False), ("none", True), ("128B", True)])
def test_identity_a_gives_b_back(fmt, b_swizzle, trans_b):
    blocks.check_identity_picks_b(kernel, fmt, 64, b_swizzle, trans_b)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n", blocks.SIZES)
@pytest.mark.parametrize("swizzle", ["none", "128B"])
@pytest.mark.parametrize("trans_b", [False, True], ids=["B K-major", "B transposed"])
@pytest.mark.parametrize("rs", [False, True], ids=["SS", "RS"])
def test_gemm_matches_numpy(fmt, n, swizzle, trans_b, rs, rng):
    blocks.check_gemm(kernel, fmt, n, 64, swizzle, swizzle, False, trans_b, rs, True, rng)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n", blocks.K_MAJOR_SIZES)
@pytest.mark.parametrize("swizzle", ["none", "128B"])
@pytest.mark.parametrize("rs", [False, True], ids=["SS", "RS"])
def test_gemm_of_a_k_major_b_only_matches_numpy(fmt, n, swizzle, rs, rng):
    blocks.check_gemm(kernel, fmt, n, 64, swizzle, swizzle, False, False, rs, True, rng)


@pytest.mark.parametrize("swizzle", ["32B", "64B"])
@pytest.mark.parametrize("trans_a, trans_b", [(False, False), (True, True)])
def test_gemm_other_swizzles_and_transposed_a(swizzle, trans_a, trans_b, rng):
    blocks.check_gemm(kernel, "bfloat16", 64, 64, swizzle, swizzle, trans_a, trans_b, False, False, rng)


@pytest.mark.parametrize("order", ["descending", "shuffled", "warp_skew"])
def test_gemm_under_other_thread_orders(order, rng):
    A, B, C = problem("float16", 64, 32, rng)
    got = run(lambda name: kernel(name, order), "float16", A, B, C)
    np.testing.assert_allclose(got, want("float16", A, B, C), rtol=blocks.RTOL, atol=blocks.ATOL)


@pytest.mark.parametrize("trans_b", [False, True], ids=["B K-major", "B transposed"])
def test_d_packed_as_the_next_a(trans_b, rng):
    blocks.check_d_packed_as_the_next_a(kernel, trans_b, rng)


def test_tiles_in_static_shared_memory(rng):
    blocks.check_static_shared_tiles(kernel, "float16", rng)


# ----------------------------------------------------------------------------
# asynchrony


def test_reading_the_accumulators_before_the_wait_reads_nan(rng):
    A, B, C = problem("float16", 64, 32, rng)
    assert np.isnan(run(kernel, "float16", A, B, C, mode="early read")).all()


def test_writing_the_accumulators_before_the_wait_is_lost(rng):
    A, B, C = problem("float16", 64, 32, rng)
    got, D = run(kernel, "float16", A, B, C, mode="early write"), want("float16", A, B, C)
    np.testing.assert_allclose(got, D, rtol=blocks.RTOL, atol=blocks.ATOL)  # thread 0's d[0] = 0 was overwritten


def test_wait_group_1_leaves_the_newest_group_in_flight(rng):
    acc1_early, _ = blocks.check_wait_group_1_completes_the_older_group(kernel, "bfloat16", rng)
    assert np.isnan(acc1_early).all()


# ----------------------------------------------------------------------------
# misuse


def misuse(mode, message, rng, **run_options):
    A, B, _ = problem("float16", 64, 16, rng)
    with pytest.raises(KernelError, match=message) as info:
        run(kernel, "float16", A, B, mode=mode, **run_options)
    assert info.value.kernel == "wgmma_gemm<__half, 64>" and info.value.thread is not None
    return info.value


def test_a_descriptor_not_aligned_to_its_swizzle_is_reported(rng):
    misuse("unaligned A", r"descriptor of A \(0x[0-9a-f]+\) starts at shared address 0x[0-9a-f]+, 128 bytes into "
                          r"the 128B swizzle's 1024-byte repeat", rng)


@pytest.mark.parametrize("field, message", [
    ("a_lbo", r"descriptor of A .* has LBO 0, which its K-major layout uses"),
    ("b_sbo", r"descriptor of B .* has SBO 0, which its K-major layout uses"),
])
def test_a_zero_offset_the_layout_uses_is_reported(field, message, rng):
    misuse("normal", message, rng, a_swizzle="none", b_swizzle="none", **{field: 0})


def test_a_tile_reaching_past_shared_memory_is_reported(rng):
    misuse("normal", r"descriptor of B .* puts element \(\d+, \d+\) at shared address 0x[0-9a-f]+, outside this "
                     r"block's shared memory", rng, b_sbo=1 << 17)


def test_a_base_offset_is_reported(rng):
    misuse("base offset B", r"descriptor of B .* has base offset 1: not modelled", rng)


def test_warps_issuing_different_wgmma_are_reported(rng):
    error = misuse("mismatched warp", r"warpgroup 0: thread \d+ \(warp 1\) issues wgmma.mma_async.m64n64k16.f32.f16 "
                                      r"\(SS, .*\) but thread 0 \(warp 0\) issues .*the same wgmma", rng)
    assert 32 <= error.thread[0] < 64


def test_a_warp_missing_from_the_warpgroup_is_reported(rng):
    misuse("warp exits", r"warpgroup 0: wgmma.mma_async needs the 128 threads .* 32 of them have exited", rng)


def test_a_missing_wgmma_fence_is_reported(rng):
    misuse("no fence", r"issued by a thread that has not executed wgmma.fence since it started", rng)


_PROXY = (r"wgmma.mma_async m64n64k16 \(operand [AB], completing at wgmma.wait_group\) by thread \(\d+,0,0\) reads the "
          r"byte at shared address 0x[0-9a-f]+ through the async proxy, but thread \((\d+),0,0\) last wrote it with "
          r"an ordinary store and has not executed fence.proxy.async since")


def test_ordinary_stores_without_fence_proxy_async_are_reported(rng):
    # the tiles are written by ordinary stores: wgmma (the async proxy) may read stale bytes on a GPU
    error = misuse("no proxy fence", _PROXY, rng)
    assert int(re.search(_PROXY, str(error)).group(1)) == error.thread[0]  # the writer is the thread reported


def test_a_fence_proxy_async_in_another_thread_does_not_count(rng):
    # thread 0 fences; the bytes the other 127 threads wrote are not made visible by it
    error = misuse("proxy fence in thread 0 only", _PROXY, rng)
    assert error.thread[0] != 0


def test_fenced_ordinary_stores_give_the_numpy_result(rng):
    # the same tiles as the two misuses above, each writer fenced: the wgmma reference (wgmma_blocks.want)
    A, B, _ = problem("float16", 64, 16, rng)
    np.testing.assert_allclose(run(kernel, "float16", A, B), want("float16", A, B), rtol=blocks.RTOL,
                               atol=blocks.ATOL)



def test_a_warp_waiting_elsewhere_is_a_deadlock_naming_the_wgmma(rng):
    A, B, _ = problem("float16", 64, 16, rng)
    with pytest.raises(DeadlockError, match=r"32 threads wait at __syncthreads\(\); 96 threads of warpgroup 0 wait "
                                            r"in wgmma.mma_async for the rest of the warpgroup"):
        run(kernel, "float16", A, B, mode="deadlock")
