// hopper.cuh: the sm_90a synchronisation instructions a warp-specialised kernel uses, each in one
// small function, as tensor_core.cuh does for mma.sync (compile for -arch=sm_90a).
//
//   mbarrier_init(bar, count)          an mbarrier (8 bytes of shared memory, 8-byte aligned):
//                                      phase 0, count arrivals pending, tx-count 0      sm_80+
//   mbarrier_init_fence()              fence.mbarrier_init.release.cluster: the inits of this
//                                      thread visible to other threads and the async proxy (TMA)
//   mbarrier_arrive(bar)               one arrival                                       sm_80+
//   mbarrier_arrive_expect_tx(bar, n)  tx-count += n bytes, then one arrival             sm_90
//   mbarrier_complete_tx(bar, n)       tx-count -= n, what a TMA copy does as it lands   sm_90
//   mbarrier_try_wait_parity(bar, p)   whether the phase of parity p has completed      sm_90
//   mbarrier_wait_parity(bar, p)       loop on try_wait until it has
//   named_barrier_sync(id, count)      bar.sync id, count: arrive, wait for `count` threads
//   named_barrier_arrive(id, count)    bar.arrive id, count: arrive, do not wait
//   elect_one_sync(mask)               true in one lane of `mask` (all of it must be here) sm_90
//   setmaxnreg_inc<R>(), _dec<R>()     the warpgroup's register cap to R (24..256, x8)   sm_90a
//
// mbarrier semantics (PTX ISA, "Parallel Synchronization and Communication Instructions:
// mbarrier"): a phase completes when its pending arrival count and its tx-count both reach zero;
// the barrier then enters the next phase with count arrivals pending again. try_wait.parity p is
// true once the current phase's parity differs from p, i.e. the phase of parity p has completed:
// right after init, waiting on parity 1 passes at once (the producer of a ring starts its "empty"
// waits on parity 1 for that reason), and waiting on parity 0 blocks until the first phase
// completes. A waiter must not fall two phases behind: the parity cannot tell them apart.
// Named barriers: 16 per CTA; id 0 is __syncthreads()'s, so these take 1..15. `count` is a
// multiple of 32 and every arrival at one barrier instance names the same count.
// setmaxnreg: every warp of a warpgroup (4 warps from a warp index divisible by 4) executes the
// same one; it only takes effect when the kernel has a register cap at entry
// (__launch_bounds__(threads, 1)).
//
// Under NVRTC these are inline PTX. Under the CPU emulator (FLASHCUPY_EMULATOR) the same names come
// from its emu_hopper.h, which models each as above: waits are scheduling points, a barrier that
// can never complete is a DeadlockError naming it and its phase, misuse is a KernelError.

#pragma once

#include "tensor_core.cuh"

#ifdef FLASHCUPY_EMULATOR
#include <emu_hopper.h>
#else

__device__ __forceinline__ void mbarrier_init(unsigned long long* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(smem_address(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void mbarrier_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

__device__ __forceinline__ void mbarrier_arrive(unsigned long long* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(smem_address(bar)) : "memory");
}

__device__ __forceinline__ void mbarrier_arrive_expect_tx(unsigned long long* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
                 :: "r"(smem_address(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbarrier_complete_tx(unsigned long long* bar, unsigned bytes) {
    asm volatile("mbarrier.complete_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n"
                 :: "r"(smem_address(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ bool mbarrier_try_wait_parity(unsigned long long* bar, unsigned parity) {
    unsigned done;
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                 " selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(smem_address(bar)), "r"(parity) : "memory");
    return done != 0;
}

__device__ __forceinline__ void named_barrier_sync(unsigned id, unsigned count) {
    asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(count) : "memory");
}

__device__ __forceinline__ void named_barrier_arrive(unsigned id, unsigned count) {
    asm volatile("bar.arrive %0, %1;\n" :: "r"(id), "r"(count) : "memory");
}

__device__ __forceinline__ bool elect_one_sync(unsigned mask = 0xffffffffu) {
    unsigned elected;
    asm volatile("{\n .reg .pred p;\n elect.sync _|p, %1;\n selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(elected) : "r"(mask));
    return elected != 0;
}

template <int REGS>
__device__ __forceinline__ void setmaxnreg_inc() {
    static_assert(REGS % 8 == 0 && REGS >= 24 && REGS <= 256, "setmaxnreg: a multiple of 8 in [24, 256]");
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(REGS));
}

template <int REGS>
__device__ __forceinline__ void setmaxnreg_dec() {
    static_assert(REGS % 8 == 0 && REGS >= 24 && REGS <= 256, "setmaxnreg: a multiple of 8 in [24, 256]");
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(REGS));
}

#endif  // FLASHCUPY_EMULATOR

// try_wait returns false when the hardware's time limit passes first: loop until the phase completes.
__device__ __forceinline__ void mbarrier_wait_parity(unsigned long long* bar, unsigned parity) {
    while (!mbarrier_try_wait_parity(bar, parity)) {
    }
}
