"""The emulator's model of the sm_90 synchronisation instructions (kernels/hopper.cuh).

mbarrier phases, arrival and transaction counts; named barriers; elect.sync; setmaxnreg. Each
test runs a small kernel of tests/emulator_kernels/hopper.cu and checks values written out here,
or that a misuse is reported (the model is flashcupy/tools/emulator/include/emu_hopper.h and
runtime.cpp). Every check that a mistake bites runs the same kernel with the mistake made on
purpose (its `mode`).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from flashcupy.backends.cupy_backend import sources
from flashcupy.tools.emulator import THREAD_ORDERS, DeadlockError, EmulatedModule, EmulatorError, KernelError, garbage

HERE = os.path.dirname(os.path.abspath(__file__))
TEST_KERNELS = os.path.join(HERE, "emulator_kernels", "hopper.cu")
INCLUDE = f"-I{sources.KERNEL_DIR}"
NAMES = ["ring", "mbarrier_cases", "named", "elect", "maxnreg", "spin_on_flag"]
TILE = 64

_modules = {}


def kernel(name, order="ascending"):
    if order not in _modules:
        with open(TEST_KERNELS) as f:
            _modules[order] = EmulatedModule(f.read(), NAMES, (INCLUDE,), thread_order=order)
    return _modules[order].get_function(name)


def run_ring(tiles, mode=0, order="ascending"):
    x = (np.arange(tiles * TILE) % 7).astype(np.float32)
    out = garbage(TILE, np.float32)
    kernel("ring", order)((1,), (96,), (x, np.int32(tiles), out, np.int32(mode)))
    return out


# ----------------------------------------------------------------------------
# mbarrier


@pytest.mark.parametrize("order", THREAD_ORDERS)
def test_ring_of_two_stages_through_full_and_empty_barriers(order):
    # x[64 t + c] = (64 t + c) % 7; five tiles, so each stage's barriers go round phases 0, 1, 0
    want = np.array([sum((TILE * t + c) % 7 for t in range(5)) for c in range(TILE)], np.float32)
    assert want[:3].tolist() == [0 + 1 + 2 + 3 + 4, 1 + 2 + 3 + 4 + 5, 2 + 3 + 4 + 5 + 6]
    np.testing.assert_array_equal(run_ring(5, order=order), want)


@pytest.mark.parametrize("mode, what", [(1, "the consumers' wait on full"), (2, "the producer's wait on empty")])
def test_each_wait_of_the_ring_is_needed(mode, what):
    want = run_ring(5)
    bitten = []
    for order in THREAD_ORDERS:
        try:
            bitten.append(not np.array_equal(run_ring(5, mode, order), want))
        except EmulatorError:
            bitten.append(True)
    assert any(bitten), f"deleting {what} changed nothing under any thread order"


def test_expect_tx_never_completed_is_a_deadlock_naming_the_barrier():
    # 4 bytes expected beyond the 256 completed: the first stage's full barrier never completes
    with pytest.raises(DeadlockError, match=r"mbarrier at static __shared__ offset \d+ for its phase 0 "
                                            r"\(parity 0\).* 0 of 1 arrivals and a tx-count of 4 bytes"):
        run_ring(5, mode=3)


def mbarrier_case(mode, order="ascending"):
    out = garbage(4 * 64, np.int32)
    kernel("mbarrier_cases", order)((1,), (64,), (np.int32(mode), out), shared_mem=16)
    return out.reshape(64, 4)


@pytest.mark.parametrize("order", THREAD_ORDERS)
def test_mbarrier_phases_and_parities(order):
    got = mbarrier_case(2, order)
    tid = np.arange(64)
    for p in range(3):  # what the neighbour wrote in the same phase
        np.testing.assert_array_equal(got[:, p], 100 * p + (tid + 1) % 64)
    np.testing.assert_array_equal(got[:, 3], 1)


@pytest.mark.parametrize("mode, phase, arrivals", [(0, 0, "1 of 2 arrivals and a tx-count of 0"),
                                                   (1, 0, "0 of 1 arrivals and a tx-count of 64"),
                                                   (6, 1, "1 of 1 arrivals and a tx-count of 0")])
def test_a_barrier_that_never_completes_is_a_deadlock_naming_it_and_its_phase(mode, phase, arrivals):
    with pytest.raises(DeadlockError, match=rf"64 threads .* wait on the mbarrier at dynamic shared memory offset 8 "
                                            rf"for its phase {phase} \(parity {phase}\).*{arrivals} bytes"):
        mbarrier_case(mode)


@pytest.mark.parametrize("mode, message", [(3, "was not initialised"), (4, "one arrival too many"),
                                           (5, r"count 0 \(it must be in \[1, 2\^20 - 1\]\)")])
def test_mbarrier_misuse_is_reported(mode, message):
    with pytest.raises(KernelError, match=message) as info:
        mbarrier_case(mode)
    assert info.value.kernel == "mbarrier_cases" and info.value.thread is not None


# ----------------------------------------------------------------------------
# named barriers


def named(mode, order="ascending"):
    out = garbage(128, np.int32)
    kernel("named", order)((1,), (128,), (np.int32(mode), out))
    return out


@pytest.mark.parametrize("order", THREAD_ORDERS)
def test_named_barrier_passes_data_from_arriving_to_syncing_warps(order):
    want = np.concatenate([np.zeros(64, np.int32), 10 * np.arange(64) + 1])
    np.testing.assert_array_equal(named(0, order), want)


def test_named_barrier_sync_is_needed():
    want = named(0)
    assert any(not np.array_equal(named(1, order), want) for order in THREAD_ORDERS)


def test_bar_arrive_does_not_wait():
    np.testing.assert_array_equal(named(7)[:64], 0)


def test_a_count_below_the_arrivals_leaves_a_named_barrier_waiting():
    # 96 of the 128 arrivals complete the barrier; the last warp starts an instance nobody completes
    with pytest.raises(DeadlockError, match="32 threads wait at named barrier 1 .bar.sync., 32 of its 96 threads"):
        named(2)


@pytest.mark.parametrize("mode, message", [
    (3, r"bar.(arrive|sync) 1, 100: the thread count must be a positive multiple of 32"),
    (4, r"bar.arrive 16, 128: named barrier ids are 1..15"),
    (5, r"must name the same count"),
    (6, r"bar.(arrive|sync) 1, 160: .* at most the block's 128 threads"),
])
@pytest.mark.parametrize("order", ("ascending", "descending"))
def test_named_barrier_misuse_is_reported(mode, message, order):
    with pytest.raises(KernelError, match=message) as info:
        named(mode, order)
    assert info.value.kernel == "named" and info.value.thread is not None


# ----------------------------------------------------------------------------
# elect.sync


@pytest.mark.parametrize("live, mask, leader", [(0xFFFFFFFF, 0xFFFFFFFF, 0), (0x00F0F000, 0x00F0F000, 12),
                                                (0xFFFFFFF0, 0xFFFFFFFF, 4)])
def test_elect_sync_elects_the_lowest_lane_present(live, mask, leader):
    out = garbage(32, np.int32)
    kernel("elect")((1,), (32,), (np.uint32(live), np.uint32(mask), out))
    want = np.array([-1 if not (live >> lane) & 1 else int(lane == leader) for lane in range(32)], np.int32)
    np.testing.assert_array_equal(out, want)


def test_elect_sync_from_a_lane_outside_the_mask_is_reported():
    with pytest.raises(KernelError, match=r"elect.sync\(mask 0x0000ff00\) called by lane 0"):
        kernel("elect")((1,), (32,), (np.uint32(0xFFFFFFFF), np.uint32(0xFF00), garbage(32, np.int32)))


# ----------------------------------------------------------------------------
# setmaxnreg


def maxnreg(mode, threads=256):
    out = garbage(threads, np.int32)
    kernel("maxnreg")((1,), (threads,), (np.int32(mode), out))
    return out


def test_setmaxnreg_per_warpgroup():
    np.testing.assert_array_equal(maxnreg(0), 1)


@pytest.mark.parametrize("mode, threads, message", [
    (1, 256, r"setmaxnreg.dec 20: the register count must be a multiple of 8 in \[24, 256\]"),
    (2, 256, r"setmaxnreg.inc 264: the register count must be a multiple of 8 in \[24, 256\]"),
    (3, 256, r"setmaxnreg.dec 32 in thread \d+ \(warp 1\) but setmaxnreg.dec 24 .*the same setmaxnreg"),
    (4, 256, r"setmaxnreg.dec 56 after setmaxnreg set 24"),
    (5, 192, r"warpgroup 1: setmaxnreg needs the 128 threads .* 64 of them do not exist"),
    (6, 256, r"warpgroup 0: setmaxnreg needs the 128 threads .* 32 of them have exited"),
])
def test_setmaxnreg_misuse_is_reported(mode, threads, message):
    with pytest.raises(KernelError, match=message) as info:
        maxnreg(mode, threads)
    assert info.value.kernel == "maxnreg" and info.value.thread is not None


# ----------------------------------------------------------------------------
# the launch's time limit


def test_a_launch_past_its_time_limit_is_reported_not_hung():
    with open(TEST_KERNELS) as f:
        module = EmulatedModule(f.read(), ["spin_on_flag"], (INCLUDE,), time_limit=0.5)
    with pytest.raises(KernelError, match=r"ran past its time limit of 0.5 s of CPU time") as info:
        module.get_function("spin_on_flag")((1,), (32,), (garbage(32, np.int32),))
    assert info.value.thread == (0, 0, 0)
    # the same module launches again afterwards (the timer is disarmed, the handler restored)
    with pytest.raises(KernelError, match="time limit"):
        module.get_function("spin_on_flag")((1,), (32,), (garbage(32, np.int32),))
