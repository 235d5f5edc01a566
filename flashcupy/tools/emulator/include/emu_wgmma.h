// emu_wgmma.h: the emulator's versions of the wgmma instructions that
// flashcupy/backends/cupy_backend/kernels/hopper.cuh wraps (and smem_address, which its
// make_descriptor uses), under the same names. The model lives in runtime/wgmma.h (it needs
// the scheduler); hopper.cuh writes out the layouts and the descriptor format it follows.
//
//   smem_address(p)   the shared-window address of p: dynamic shared memory from 0 (its first
//                     page), the static __shared__ objects after it from the next multiple of
//                     1024. Both windows keep the host address's low 10 bits, so a tile aligned
//                     as a pointer (alignas, or rounding the pointer) is aligned as an address
//                     and the swizzle (address bits 4-9) is the one the kernel computed. A
//                     pointer outside shared memory, or a window past 2^18 bytes (the 14-bit
//                     start-address field), is a KernelError.
//   wgmma.mma_async   a warpgroup rendezvous: the 128 threads of the warpgroup (4 warps from a
//                     warp index divisible by 4) meet. Every thread must issue the same
//                     instruction (shape, types, SS or RS, transposes, descriptors, scale-d) or
//                     the launch fails naming the warps that differ; a warp that has exited or
//                     does not exist fails it too. Each descriptor is decoded field by field
//                     (start address, LBO, SBO, base offset, swizzle none/32B/64B/128B) and
//                     checked: reserved bits set, a non-zero base offset (not modelled: align
//                     the tile instead), a swizzled tile whose start is not within the first
//                     row (W bytes) of its 8 W-byte repeat, an LBO or SBO of 0 where the layout
//                     uses it, or an element outside shared memory are KernelErrors naming the
//                     kernel and the thread. So is an mma_async issued by a thread that has
//                     not executed wgmma.fence since its last wgmma.wait_group (or since it
//                     started): stricter than the ISA, which needs the fence only where the
//                     thread touched the registers, and what every kernel here does.
//                     At the meeting each thread's accumulator input (its d[N/2]) is taken,
//                     the A fragments of the RS form are gathered into A, and d is filled with
//                     NaN: reading the accumulators before the wait that covers the operation
//                     reads NaN, and writing them is lost (the wait overwrites them), so either
//                     is a wrong answer. An mma_async into the same d as one still in flight
//                     in the thread (the K loop of one tile) takes that one's result as its
//                     input, as the ISA orders accumulator accesses of the same shape; the same
//                     d with another N is a KernelError.
//   wgmma.commit_group  per thread: its uncommitted mma_async become its newest group.
//   wgmma.wait_group N  per thread: every group but the newest N completes, oldest first. A
//                     completing operation reads A (SS) and B from shared memory now, so a tile
//                     overwritten before the wait gives a wrong answer, and computes this
//                     thread's elements of D = A B + (scale-d ? C : 0): products exact, the sum
//                     in double rounded once to float (a GPU's tensor cores add in their own
//                     order with their own adders: expect differences in the last bits).
//                     Operations never committed never complete.
//   wgmma.fence       marks the thread as fenced (see above); no other effect.
//   fence_proxy_async  fence.proxy.async.shared::cta: the async-proxy model of emu_hopper.h. A
//                     completing operation's read of an operand byte last written by an ordinary
//                     store whose writer has not fenced since is a KernelError naming the writer.
// Not modelled: the register count, the timing; commit and wait are per thread, not checked as
// warp collectives.

#pragma once

#include "cuda_emu.h"
#include "emu_narrow_float.h"

namespace emu {
// Arrival::kind of a thread waiting at a warpgroup rendezvous (runtime.cpp's resolve_warpgroups).
enum WarpgroupKind : int { kWarpgroupSetmaxnregDec = 0, kWarpgroupSetmaxnregInc = 1, kWarpgroupWgmma = 2 };

// What a thread brings to the wgmma.mma_async rendezvous.
struct WgmmaIssue {
    int format;  // 0: f16, 1: bf16
    int n;
    int trans_a, trans_b;
    int rs;      // A from registers (a), not by desc_a
    int scale_d;
    unsigned long long desc_a, desc_b;
    unsigned a[4];
    float* d;
};

unsigned shared_window_address(const void* p);
void wgmma_mma_async(WgmmaIssue& issue);
void wgmma_fence();
void fence_proxy_async();
void wgmma_commit_group();
void wgmma_wait_group(int pending);

template <class Format>
constexpr int wgmma_format() {
    static_assert(std::is_same_v<Format, Binary16> || std::is_same_v<Format, BFloat16>, "wgmma: f16 or bf16");
    return std::is_same_v<Format, Binary16> ? 0 : 1;
}
}  // namespace emu

inline unsigned smem_address(const void* p) { return emu::shared_window_address(p); }

inline void wgmma_fence() { emu::wgmma_fence(); }
// fence.proxy.async.shared::cta: this thread's ordinary shared-memory writes so far become
// visible to wgmma and TMA (runtime/proxy.h; emu_hopper.h states the model).
inline void fence_proxy_async() { emu::fence_proxy_async(); }
inline void wgmma_commit_group() { emu::wgmma_commit_group(); }
template <int N>
inline void wgmma_wait_group() {
    static_assert(N >= 0 && N <= 7, "wgmma.wait_group: N in [0, 7]");
    emu::wgmma_wait_group(N);
}
// The compiler here never moves a read of d across the wait (it is a call): nothing to do.
template <int COUNT>
inline void wgmma_fence_operand(float*) {}

template <typename T, int N>
struct Wgmma;

template <class Format, int N>
struct Wgmma<emu::NarrowFloat<Format>, N> {
    static_assert(N % 8 == 0 && N >= 8 && N <= 256, "wgmma: N a multiple of 8 in [8, 256]");
    template <bool TRANS_A, bool TRANS_B>
    static void ss(float* d, unsigned long long desc_a, unsigned long long desc_b, bool accumulate) {
        emu::WgmmaIssue issue{emu::wgmma_format<Format>(), N, TRANS_A, TRANS_B, 0, accumulate, desc_a, desc_b, {}, d};
        emu::wgmma_mma_async(issue);
    }
    template <bool TRANS_B>
    static void rs(float* d, const unsigned a[4], unsigned long long desc_b, bool accumulate) {
        emu::WgmmaIssue issue{emu::wgmma_format<Format>(), N, 0, TRANS_B, 1, accumulate, 0, desc_b,
                              {a[0], a[1], a[2], a[3]}, d};
        emu::wgmma_mma_async(issue);
    }
};
