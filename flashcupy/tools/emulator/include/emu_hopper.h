// emu_hopper.h: the emulator's versions of the sm_90 instructions that
// flashcupy/backends/cupy_backend/kernels/hopper.cuh wraps, under the same names. The models live
// in runtime/hopper.h, a part of runtime.cpp (they need the scheduler):
//   mbarrier          a table, per block, keyed by the barrier's shared address: phase, arrivals
//                     pending of the init count, tx-count. Arrivals and complete_tx complete the
//                     phase when both reach zero, which wakes the threads waiting on its parity.
//                     try_wait.parity returns true at once if the phase of that parity has
//                     completed, else blocks (a scheduling point) until it does; it never
//                     returns false, so a wait loop runs once; it first lands the TMA loads in
//                     flight on that barrier (emu_tma.h). More arrivals than pending, a barrier used
//                     before init or re-initialised with waiters, a barrier used by another thread
//                     than its initialiser before any block barrier (__syncthreads, a named barrier)
//                     has completed since the init, and a TMA completing a transaction on a barrier
//                     whose initialiser has not run fence.mbarrier_init since are KernelErrors.
//                     The 8 bytes themselves are not used: an ordinary store to them is not seen.
//   bar.sync/arrive   16 per block, id 0 reserved for __syncthreads(); counted per thread (a GPU
//                     counts whole warps: a warp arrives once every non-exited lane has); an id
//                     outside 1..15, a count that is not a positive multiple of 32 or exceeds the
//                     block, or an arrival naming another count than the ones before it in the
//                     same instance are KernelErrors.
//   elect.sync        a warp collective over the mask; the lowest lane of the mask is elected.
//   setmaxnreg        a warpgroup rendezvous: the 128 threads of the warpgroup meet; the value
//                     must be a multiple of 8 in [24, 256] and the same (and the same .inc/.dec)
//                     in every thread, and .inc may not lower (.dec raise) the cap a previous
//                     setmaxnreg of the warpgroup set. The register count itself is not modelled.
//   wgmma             emu_wgmma.h (hopper.cuh includes it beside this one) and
//                     runtime/wgmma.h: mma_async a warpgroup rendezvous on decoded and
//                     checked descriptors, results landing at the covering wait_group.
//   TMA               emu_tma.h (hopper.cuh includes it too) and runtime/tma.h: a box copied
//                     at issue, swizzled as the wgmma descriptor's swizzle, zeros out of
//                     bounds, then complete_tx of its bytes on the mbarrier named.
//   async proxy       wgmma and TMA read and write shared memory through the async proxy, ordinary
//                     stores through the generic one (runtime/proxy.h). Per byte of the block's
//                     shared memory (dynamic and static, by its smem_address), the thread that last
//                     wrote it with an ordinary store (or a cp.async landing) and whether that
//                     thread has executed fence.proxy.async (fence_proxy_async()) since. A wgmma
//                     operand read (as the operation completes) or a TMA store's source read (at
//                     issue) of a byte whose last ordinary write is not fenced by its own writer is
//                     a KernelError naming the kernel, the writer (the reported thread), the reader,
//                     the byte's shared address and the instruction: a fence in another thread does
//                     not count. A TMA load's landing makes its bytes async-written (nothing pending);
//                     ordinary reads are not checked (after the mbarrier wait they are ordered by
//                     it); an ordinary write over them then an async read needs a fence again.
//                     Seen: the stores of the kernel's own code (build.py compiles modules that
//                     include hopper.cuh with store-only -fsanitize=kernel-address
//                     callbacks; no other module is instrumented, so ordinary kernels pay nothing)
//                     and cp.async landings; not seen: writes by the runtime's own code for the
//                     kernel (none besides those), which no kernel here relies on.
//   flags             between CTAs: flag_wait_at_least (ld.acquire.gpu until an int of global
//                     memory reaches a value) blocks the thread while it is lower, and the
//                     scheduler parks its block (runtime/scheduler.h: its shared memory, stacks and
//                     state kept aside) to run the others, resuming it once the int has reached the
//                     value; flag_release_add (red.release.gpu) adds. The proxies of global memory:
//                     a bulk reduce-add issued after a flag_wait needs fence.proxy.async.global
//                     between them (fence_proxy_async_global), and a release needs every bulk store
//                     and reduce-add of the thread complete (cp.async.bulk.wait_group without .read)
//                     and fenced the same way since; otherwise KernelErrors. Parked blocks that can
//                     never resume are a DeadlockError naming the flag, its value and the awaited one.
// A block whose threads all wait (barriers, mbarriers, collectives) with none able to complete
// is a DeadlockError that names each mbarrier waited on (its shared-memory offset and phase).
// The async proxy also needs a block barrier between another thread's fenced store and the wgmma or
// TMA store that reads it (the fence orders the store, not another warp's issue): without one it is
// a KernelError too (runtime/proxy.h). Not modelled yet: clusters (emu_tma.h lists the rest).

#pragma once

// A module that uses these without build.py's store callbacks would check nothing: refuse it.
#if !defined(EMU_RUNTIME) && !defined(EMU_PROXY)
#error "emu_hopper.h: the emulator records shared-memory stores only in modules that include hopper.cuh, from the source or a header in an -I directory (build.py's _includes_hopper)"
#endif

#include "cuda_emu.h"

namespace emu {
void mbarrier_init(void* bar, unsigned count);
void mbarrier_arrive(void* bar, unsigned expect_tx_bytes);
// What a TMA copy does to the barrier it signals as it lands (runtime/hopper.h; hopper.cuh's
// mbarrier_complete_tx is the same operation issued by a thread).
void mbarrier_complete_tx(void* bar, unsigned bytes);
void mbarrier_complete_tx_async(void* bar, unsigned bytes);  // a TMA's: the init must have been fenced
void mbarrier_init_fence();
bool mbarrier_try_wait_parity(void* bar, unsigned parity);
void named_barrier(unsigned id, unsigned count, bool wait);
void setmaxnreg(unsigned regs, bool increase);
void flag_wait(const int* flag, int value);
void flag_release_add(int* flag, int value);
void fence_proxy_async_global();
}  // namespace emu

inline void mbarrier_init(unsigned long long* bar, unsigned count) { emu::mbarrier_init(bar, count); }
// Marks this thread's inits as fenced for the async proxy: a TMA completing a transaction on a barrier
// whose init was not fenced is a KernelError (runtime/hopper.h).
inline void mbarrier_init_fence() { emu::mbarrier_init_fence(); }
inline void mbarrier_arrive(unsigned long long* bar) { emu::mbarrier_arrive(bar, 0); }
inline void mbarrier_arrive_expect_tx(unsigned long long* bar, unsigned bytes) { emu::mbarrier_arrive(bar, bytes); }
inline void mbarrier_complete_tx(unsigned long long* bar, unsigned bytes) { emu::mbarrier_complete_tx(bar, bytes); }
inline bool mbarrier_try_wait_parity(unsigned long long* bar, unsigned parity) {
    return emu::mbarrier_try_wait_parity(bar, parity);
}

// Flags between CTAs (hopper.cuh): a CTA waits for other CTAs to raise an int in global memory
inline void flag_wait_at_least(const int* flag, int value) { emu::flag_wait(flag, value); }
inline void flag_release_add(int* flag, int value) { emu::flag_release_add(flag, value); }
inline void fence_proxy_async_global() { emu::fence_proxy_async_global(); }

inline void named_barrier_sync(unsigned id, unsigned count) { emu::named_barrier(id, count, true); }
inline void named_barrier_arrive(unsigned id, unsigned count) { emu::named_barrier(id, count, false); }

inline bool elect_one_sync(unsigned mask = 0xffffffffu) {
    return emu::warp_collective(emu::kElect, mask, 0, 0, 32) == emu::lane_id();
}

// Not static_asserted here, unlike under NVRTC, so that the emulator's tests can show the check.
template <int REGS>
inline void setmaxnreg_inc() {
    emu::setmaxnreg(REGS, true);
}
template <int REGS>
inline void setmaxnreg_dec() {
    emu::setmaxnreg(REGS, false);
}
