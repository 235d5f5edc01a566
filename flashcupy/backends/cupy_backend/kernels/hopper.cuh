// hopper.cuh: the sm_90a synchronisation and wgmma instructions a warp-specialised kernel uses,
// each in one small function, as tensor_core.cuh does for mma.sync (compile for -arch=sm_90a).
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
//   make_descriptor(tile, lbo, sbo, swizzle)  the 64-bit shared-memory matrix descriptor of wgmma
//   wgmma_ss<T, N, TRANS_A, TRANS_B>(d, desc_a, desc_b, accumulate)                     sm_90a
//                                      wgmma.mma_async m64nNk16.f32.T.T, A and B by descriptor
//   wgmma_rs<T, N, TRANS_B>(d, a, desc_b, accumulate)   the same with A from 4 registers sm_90a
//   wgmma_fence()                      wgmma.fence.sync.aligned: before a warpgroup's first
//                                      mma_async, and after ordinary writes to the registers one
//                                      reads (its accumulators, the A fragment of wgmma_rs)
//   wgmma_commit_group()               the thread's uncommitted mma_async become its newest group
//   wgmma_wait_group<N>()              wait until at most the newest N groups are in flight
//   fence_proxy_async()                fence.proxy.async.shared::cta: ordinary shared-memory writes
//                                      of this thread visible to wgmma (and TMA) reads after it
//   wgmma_fence_operand<COUNT>(r)      keep the compiler from moving accesses to the COUNT floats
//                                      of r across it (no instruction: an empty asm on each)
//   TensorMap                          the 128-byte, 64-byte-aligned tensor map (CUtensorMap) a
//                                      kernel takes as a `const __grid_constant__ TensorMap`
//                                      parameter; built on the host (see TMA below)
//   tma_load_2d/3d/4d(dst, map, c0.., bar)  cp.async.bulk.tensor.Nd.shared::cluster.global.tile
//                                      .mbarrier::complete_tx::bytes: the box at coordinates
//                                      (c0 innermost ..) of the map's tensor into shared memory at
//                                      dst; the bytes of the box complete_tx on bar as they land sm_90
//   tma_store_2d/3d/4d(map, c0.., src)  cp.async.bulk.tensor.Nd.global.shared::cta.tile.bulk_group:
//                                      the box at src to global memory, out-of-bounds elements
//                                      not written                                        sm_90
//   bulk_reduce_add_f32(dst, src, bytes)  cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32:
//                                      dst[e] += src[e], bytes / 4 floats, added in the L2; src
//                                      shared, dst global, both 16-byte aligned, bytes a multiple
//                                      of 16                                              sm_90
//   tma_store_commit_group()           cp.async.bulk.commit_group: this thread's bulk stores and
//                                      reduce-adds so far become its newest bulk group
//   tma_store_wait_group_read<N>()     cp.async.bulk.wait_group.read N: at most the newest N groups
//                                      still read their shared-memory source (it may be reused)
//   tma_store_wait_group<N>()          cp.async.bulk.wait_group N: at most the newest N groups are
//                                      not complete (their writes visible to this thread)
//   fence_proxy_async_global()         fence.proxy.async.global: this thread's global-memory
//                                      operations in one proxy ordered with those in the other (an
//                                      acquire before a bulk reduce-add; its completed writes before
//                                      a release)
//   flag_wait_at_least(flag, n)        ld.acquire.gpu.global.s32 until the int at flag (global
//                                      memory) is at least n: another CTA raises it     sm_70+
//   flag_release_add(flag, n)          red.release.gpu.global.add.s32: *flag += n, this thread's
//                                      writes before it seen by a CTA that acquires the sum
//
// Flags order CTAs: a CTA that waits for one must only wait for CTAs of lower linear index (the
// hardware dispatches them no later), or those may never be resident beside it.
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
// wgmma (PTX ISA, "Asynchronous Warpgroup Level Matrix Multiply-Accumulate Instructions"): a
// warpgroup is 4 consecutive warps from a warp index divisible by 4; its 128 threads all issue the
// same wgmma.mma_async (same shape, types, descriptors, scale-d, transposes). D (64 x N, f32) =
// A (64 x 16) B (16 x N) + (accumulate ? D : 0), T = __half or __nv_bfloat16, N a multiple of 8
// up to 256 (wrapped here: 64, 128).
//   Accumulators, float d[N / 2] per thread: warp w of the warpgroup holds rows 16 w .. 16 w + 15;
//   with r = 16 w + lane / 4 and c = 2 (lane % 4), for j in 0 .. N/8 - 1:
//     d[4 j + 0], d[4 j + 1] = D[r][8 j + c], D[r][8 j + c + 1]
//     d[4 j + 2], d[4 j + 3] = D[r + 8][8 j + c], D[r + 8][8 j + c + 1]
//   (per warp, the mma.sync m16n8k16 C layout repeated N/8 times along the columns).
//   A fragment of wgmma_rs, unsigned a[4] (two 16-bit elements each, the smaller column in the low
//   half), the mma.sync m16n8k16 A layout per warp: a[0] = A[r][c, c+1], a[1] = A[r+8][c, c+1],
//   a[2] = A[r][c+8, c+9], a[3] = A[r+8][c+8, c+9]. So a D of one wgmma, packed in pairs, is the
//   A of the next: for k-step t, a[i] = pack2<T>(d[8t + 2i], d[8t + 2i + 1]) (P = softmax(S), P V).
// Shared-memory operands: matrix descriptor (64 bits; PTX ISA "Matrix Descriptor Format"):
//   bits  0-13  start address >> 4 (the shared-window address, 16-byte aligned)
//   bits 16-29  leading dimension byte offset (LBO) >> 4
//   bits 32-45  stride dimension byte offset (SBO) >> 4
//   bits 49-51  base offset (0 here: every tile is aligned to its swizzle pattern's repeat)
//   bits 62-63  swizzle: 0 none, 1 128B, 2 64B, 3 32B
// The layout of an operand X (A: 64 rows m, B: N rows n; 16 columns k), 16-bit elements, byte
// offsets from the start address, with W the swizzle span (32, 64, 128 bytes):
//   K-major (TRANS 0: X[mn][k] with k contiguous), no swizzle: core matrices of 8 rows x 16 bytes
//     (128 contiguous bytes), 8-row groups SBO apart, the two 8-column halves of k LBO apart:
//       (mn % 8) * 16 + (mn / 8) * SBO + (k / 8) * LBO + (k % 8) * 2
//   K-major, swizzle W: rows of W bytes, 8-row groups SBO apart (1024 for 128B), LBO unused:
//       (mn % 8) * W + (mn / 8) * SBO + k * 2
//   MN-major (TRANS 1, "transposed": X[mn][k] with mn contiguous, e.g. B = V stored [key][d]),
//     no swizzle: (mn % 8) * 2 + (mn / 8) * SBO + (k % 8) * 16 + (k / 8) * LBO
//   MN-major, swizzle W: (mn % (W/2)) * 2 + (mn / (W/2)) * LBO + (k % 8) * W + (k / 8) * SBO
// and swizzle W then XORs the 16-byte chunk bits [4, 4 + log2(W/16)) of the absolute shared
// address with its bits [7, 7 + log2(W/16)): tiles must start at a multiple of 8 W bytes (1024 for
// 128B), plus at most W - 16 bytes (the K advance inside a row: +32 bytes per k16 step in 128B).
//
// TMA (PTX ISA, "Data Movement and Conversion Instructions: cp.async.bulk.tensor"; CUDA driver API
// "Tensor Map Object Management"): the map is made on the host by the driver's
// cuTensorMapEncodeTiled (cuda.bindings.driver; flashcupy/tools/emulator/tma.py documents the
// arguments and makes the emulator's own map from the same ones): data type, rank 1..5, the global
// address (16-byte aligned), globalDim (innermost first), globalStrides (bytes of dims 1..rank-1,
// multiples of 16, < 2^40), boxDim (each 1..256; the inner one times the element size a multiple of
// 16 bytes and, when swizzled, at most the swizzle span: 64 fp16 for 128B), elementStrides (1..8),
// interleave none, swizzle none/32B/64B/128B, L2 promotion, OOB fill (none: zeros). The map is
// passed by value as a `const __grid_constant__` kernel parameter, and the instructions take its
// generic address (param space). A box is written to shared memory densely, dim 0 innermost: the
// element at box index (i0, i1, ..) at byte ((.. i2) * box1 + i1) * box0 * size + i0 * size from
// dst, then swizzled as the wgmma descriptor's swizzle (above): the 16-byte chunk bits [4, 4 + b)
// of the absolute shared address XOR its bits [7, 7 + b). So a box of 64 fp16 x R rows loaded with
// 128B swizzle to a 1024-byte aligned dst is the K-major 128B-swizzled wgmma operand (SBO 1024).
// Elements outside the tensor (a coordinate < 0 or >= globalDim) are written as zeros and still
// count: a box always completes its full byte count on the mbarrier. dst: 128-byte aligned
// (1024 to line up with a wgmma swizzle repeat). Loads are issued by one thread (elect_one_sync).
// Keep a swizzled box's inner extent equal to the span (whether a narrower one is padded to the
// span in shared memory is [verify]; the emulator refuses it).
//
// Under NVRTC these are inline PTX. Under the CPU emulator (FLASHCUPY_EMULATOR) the same names come
// from its emu_hopper.h, which models each as above: waits are scheduling points, a barrier that
// can never complete is a DeadlockError naming it and its phase, misuse is a KernelError. wgmma
// is emu_wgmma.h's: a warpgroup rendezvous whose results land at the covering wait_group, the
// accumulators holding NaN in between; bad descriptors and mismatched warps are KernelErrors.
// The emulator tracks which thread last wrote each shared-memory byte with an ordinary store:
// wgmma or a TMA store reading one its writer has not followed with fence_proxy_async() is a
// KernelError naming that thread (emu_hopper.h).

#pragma once

#include "tensor_core.cuh"

#ifdef FLASHCUPY_EMULATOR
#include <emu_hopper.h>
#include <emu_wgmma.h>
#include <emu_tma.h>
#else

// The CUtensorMap of the driver API (cuda.h is not available under NVRTC): opaque, 128 bytes,
// 64-byte aligned. Under the emulator emu_tma.h declares it, its bytes holding the emulator's map.
struct __align__(64) TensorMap {
    unsigned long long opaque[16];
};

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

// ---------------------------------------------------------------------------------------------
// wgmma

// fence.proxy.async.shared::cta: this thread's ordinary shared-memory writes before it are seen by
// the async proxy (wgmma's operand reads, TMA) after it; then a barrier for the other threads.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }

__device__ __forceinline__ void wgmma_commit_group() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }

template <int N>
__device__ __forceinline__ void wgmma_wait_group() {
    static_assert(N >= 0 && N <= 7, "wgmma.wait_group: N in [0, 7]");
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory");
}

template <int COUNT>
__device__ __forceinline__ void wgmma_fence_operand(float* r) {
#pragma unroll
    for (int i = 0; i < COUNT; ++i) asm volatile("" : "+f"(r[i]) :: "memory");
}

// One specialisation per (type, N): the instructions differ in a suffix and in how many registers
// they name, which an asm statement can only spell out. scale-d is a predicate made from
// `accumulate`; imm-scale-a and -b are 1; the transposes are immediates.
template <typename T, int N>
struct Wgmma;

#define FLASHCUPY_WGMMA(T, AB, N, DREGS, DOPERANDS, SS_SCALE, SS_TAIL, RS_SCALE, RS_TAIL)                  \
    template <>                                                                                              \
    struct Wgmma<T, N> {                                                                                     \
        template <bool TRANS_A, bool TRANS_B>                                                                \
        __device__ static __forceinline__ void ss(float* d, unsigned long long desc_a,                        \
                                                  unsigned long long desc_b, bool accumulate) {               \
            asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %" SS_SCALE ", 0;\n"                            \
                         " wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." AB "." AB " " DREGS ", " SS_TAIL   \
                         ";\n}\n"                                                                             \
                         : DOPERANDS(d)                                                                      \
                         : "l"(desc_a), "l"(desc_b), "r"(int(accumulate)), "n"(int(TRANS_A)), "n"(int(TRANS_B)) \
                         : "memory");                                                                        \
        }                                                                                                    \
        template <bool TRANS_B>                                                                              \
        __device__ static __forceinline__ void rs(float* d, const unsigned a[4], unsigned long long desc_b,   \
                                                  bool accumulate) {                                         \
            asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %" RS_SCALE ", 0;\n"                            \
                         " wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." AB "." AB " " DREGS ", " RS_TAIL   \
                         ";\n}\n"                                                                             \
                         : DOPERANDS(d)                                                                      \
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(int(accumulate)),    \
                           "n"(int(TRANS_B))                                                                 \
                         : "memory");                                                                        \
        }                                                                                                    \
    };

// m64n32k16 (the head_dim-256 backward's Sᵀ, dPᵀ): d is %0-%15; SS: desc_a %16, desc_b %17, scale-d %18,
// transposes %19, %20; RS: a %16-%19, desc_b %20, scale-d %21, trans-b %22.
// m64n64k16: d is %0-%31; SS: desc_a %32, desc_b %33, scale-d %34, transposes %35, %36;
// RS: a %32-%35, desc_b %36, scale-d %37, trans-b %38.
// m64n128k16: d is %0-%63; SS: desc_a %64, desc_b %65, scale-d %66, transposes %67, %68;
// RS: a %64-%67, desc_b %68, scale-d %69, trans-b %70.
// m64n176k16 and m64n192k16 (the forward's wide key blocks): d is %0-%87 (%0-%95); SS: desc_a %88 (%96),
// desc_b %89 (%97), scale-d %90 (%98), transposes %91, %92 (%99, %100); RS: a %88-%91 (%96-%99), desc_b
// %92 (%100), scale-d %93 (%101), trans-b %94 (%102). m64n80k16 (head_dim 256's key block): d is %0-%39,
// SS: desc_a %40, desc_b %41, scale-d %42, transposes %43, %44; RS: a %40-%43, desc_b %44, scale-d %45,
// trans-b %46. m64n256k16 (head_dim 256's P V_j): d is %0-%127; SS: desc_a %128, desc_b %129, scale-d
// %130, transposes %131, %132; RS: a %128-%131, desc_b %132, scale-d %133, trans-b %134. Each list
// extends one before it.
#define FLASHCUPY_WGMMA_R16 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define FLASHCUPY_WGMMA_R32 FLASHCUPY_WGMMA_R16 ", " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define FLASHCUPY_WGMMA_R64 FLASHCUPY_WGMMA_R32 ", " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, " \
    "%54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define FLASHCUPY_WGMMA_D32 "{" FLASHCUPY_WGMMA_R16 "}"
#define FLASHCUPY_WGMMA_D64 "{" FLASHCUPY_WGMMA_R32 "}"
#define FLASHCUPY_WGMMA_D128 "{" FLASHCUPY_WGMMA_R64 "}"
#define FLASHCUPY_WGMMA_R88 FLASHCUPY_WGMMA_R64 ", " \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, " \
    "%86, %87"
#define FLASHCUPY_WGMMA_D176 "{" FLASHCUPY_WGMMA_R88 "}"
#define FLASHCUPY_WGMMA_D192 "{" FLASHCUPY_WGMMA_R88 ", %88, %89, %90, %91, %92, %93, %94, %95}"
#define FLASHCUPY_WGMMA_D80 "{" FLASHCUPY_WGMMA_R32 ", %32, %33, %34, %35, %36, %37, %38, %39}"
#define FLASHCUPY_WGMMA_D256 "{" FLASHCUPY_WGMMA_R88 ", " \
    "%88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, " \
    "%108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}"
#define FLASHCUPY_WGMMA_D32_OPERANDS(d) \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), \
    "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
#define FLASHCUPY_WGMMA_D64_OPERANDS(d) FLASHCUPY_WGMMA_D32_OPERANDS(d), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define FLASHCUPY_WGMMA_D128_OPERANDS(d) FLASHCUPY_WGMMA_D64_OPERANDS(d), \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define FLASHCUPY_WGMMA_D176_OPERANDS(d) FLASHCUPY_WGMMA_D128_OPERANDS(d), \
    "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
    "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
    "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87])
#define FLASHCUPY_WGMMA_D192_OPERANDS(d) FLASHCUPY_WGMMA_D176_OPERANDS(d), \
    "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
#define FLASHCUPY_WGMMA_D80_OPERANDS(d) FLASHCUPY_WGMMA_D64_OPERANDS(d), \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39])
#define FLASHCUPY_WGMMA_D256_OPERANDS(d) FLASHCUPY_WGMMA_D192_OPERANDS(d), \
    "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
    "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
    "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
    "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
#define FLASHCUPY_WGMMA_SIZE(N, ss_scale, ss, rs_scale, rs) \
    FLASHCUPY_WGMMA(__half, "f16", N, FLASHCUPY_WGMMA_D##N, FLASHCUPY_WGMMA_D##N##_OPERANDS, ss_scale, ss, rs_scale, rs) \
    FLASHCUPY_WGMMA(__nv_bfloat16, "bf16", N, FLASHCUPY_WGMMA_D##N, FLASHCUPY_WGMMA_D##N##_OPERANDS, ss_scale, ss, \
                    rs_scale, rs)
FLASHCUPY_WGMMA_SIZE(32, "18", "%16, %17, p, 1, 1, %19, %20", "21", "{%16, %17, %18, %19}, %20, p, 1, 1, %22")
FLASHCUPY_WGMMA_SIZE(64, "34", "%32, %33, p, 1, 1, %35, %36", "37", "{%32, %33, %34, %35}, %36, p, 1, 1, %38")
FLASHCUPY_WGMMA_SIZE(80, "42", "%40, %41, p, 1, 1, %43, %44", "45", "{%40, %41, %42, %43}, %44, p, 1, 1, %46")
FLASHCUPY_WGMMA_SIZE(128, "66", "%64, %65, p, 1, 1, %67, %68", "69", "{%64, %65, %66, %67}, %68, p, 1, 1, %70")
FLASHCUPY_WGMMA_SIZE(176, "90", "%88, %89, p, 1, 1, %91, %92", "93", "{%88, %89, %90, %91}, %92, p, 1, 1, %94")
FLASHCUPY_WGMMA_SIZE(192, "98", "%96, %97, p, 1, 1, %99, %100", "101", "{%96, %97, %98, %99}, %100, p, 1, 1, %102")
FLASHCUPY_WGMMA_SIZE(256, "130", "%128, %129, p, 1, 1, %131, %132", "133", "{%128, %129, %130, %131}, %132, p, 1, 1, %134")
#undef FLASHCUPY_WGMMA_SIZE
#undef FLASHCUPY_WGMMA_R16
#undef FLASHCUPY_WGMMA_R32
#undef FLASHCUPY_WGMMA_R64
#undef FLASHCUPY_WGMMA_R88
#undef FLASHCUPY_WGMMA_D32
#undef FLASHCUPY_WGMMA_D32_OPERANDS
#undef FLASHCUPY_WGMMA_D64
#undef FLASHCUPY_WGMMA_D64_OPERANDS
#undef FLASHCUPY_WGMMA_D128
#undef FLASHCUPY_WGMMA_D128_OPERANDS
#undef FLASHCUPY_WGMMA_D176
#undef FLASHCUPY_WGMMA_D176_OPERANDS
#undef FLASHCUPY_WGMMA_D192
#undef FLASHCUPY_WGMMA_D192_OPERANDS
#undef FLASHCUPY_WGMMA_D80
#undef FLASHCUPY_WGMMA_D80_OPERANDS
#undef FLASHCUPY_WGMMA_D256
#undef FLASHCUPY_WGMMA_D256_OPERANDS
#undef FLASHCUPY_WGMMA

// ---------------------------------------------------------------------------------------------
// TMA

__device__ __forceinline__ unsigned long long tensor_map_address(const TensorMap& map) {
    return reinterpret_cast<unsigned long long>(&map);
}

__device__ __forceinline__ void tma_load_2d(void* dst, const TensorMap& map, int c0, int c1, unsigned long long* bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3}], [%4];\n"
                 :: "r"(smem_address(dst)), "l"(tensor_map_address(map)), "r"(c0), "r"(c1), "r"(smem_address(bar))
                 : "memory");
}

__device__ __forceinline__ void tma_load_3d(void* dst, const TensorMap& map, int c0, int c1, int c2,
                                            unsigned long long* bar) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4}], [%5];\n"
                 :: "r"(smem_address(dst)), "l"(tensor_map_address(map)), "r"(c0), "r"(c1), "r"(c2),
                    "r"(smem_address(bar))
                 : "memory");
}

__device__ __forceinline__ void tma_load_4d(void* dst, const TensorMap& map, int c0, int c1, int c2, int c3,
                                            unsigned long long* bar) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
                 :: "r"(smem_address(dst)), "l"(tensor_map_address(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
                    "r"(smem_address(bar))
                 : "memory");
}

__device__ __forceinline__ void tma_store_2d(const TensorMap& map, int c0, int c1, const void* src) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group [%0, {%1, %2}], [%3];\n"
                 :: "l"(tensor_map_address(map)), "r"(c0), "r"(c1), "r"(smem_address(src)) : "memory");
}

__device__ __forceinline__ void tma_store_3d(const TensorMap& map, int c0, int c1, int c2, const void* src) {
    asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.tile.bulk_group [%0, {%1, %2, %3}], [%4];\n"
                 :: "l"(tensor_map_address(map)), "r"(c0), "r"(c1), "r"(c2), "r"(smem_address(src)) : "memory");
}

__device__ __forceinline__ void tma_store_4d(const TensorMap& map, int c0, int c1, int c2, int c3, const void* src) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n"
                 :: "l"(tensor_map_address(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_address(src))
                 : "memory");
}

// dst[e] += src[e] for the bytes / 4 floats at src (shared memory) into dst (global memory), in the L2:
// one instruction for a whole tile, where per-element atomics ask the L2 an atomic each
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, const float* src, unsigned bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                 :: "l"(dst), "r"(smem_address(src)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void tma_store_commit_group() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }

template <int N>
__device__ __forceinline__ void tma_store_wait_group_read() {
    static_assert(N >= 0 && N <= 7, "cp.async.bulk.wait_group.read: N in [0, 7]");
    asm volatile("cp.async.bulk.wait_group.read %0;\n" :: "n"(N) : "memory");
}

template <int N>
__device__ __forceinline__ void tma_store_wait_group() {
    static_assert(N >= 0 && N <= 7, "cp.async.bulk.wait_group: N in [0, 7]");
    asm volatile("cp.async.bulk.wait_group %0;\n" :: "n"(N) : "memory");
}

__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;\n" ::: "memory"); }

// ---------------------------------------------------------------------------------------------
// flags between CTAs (global memory, gpu scope)

__device__ __forceinline__ void flag_wait_at_least(const int* flag, int value) {
    int seen;
    do {
        asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(seen) : "l"(flag) : "memory");
    } while (seen < value);
}

__device__ __forceinline__ void flag_release_add(int* flag, int value) {
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" :: "l"(flag), "r"(value) : "memory");
}

#endif  // FLASHCUPY_EMULATOR

// try_wait returns false when the hardware's time limit passes first: loop until the phase completes.
__device__ __forceinline__ void mbarrier_wait_parity(unsigned long long* bar, unsigned parity) {
    while (!mbarrier_try_wait_parity(bar, parity)) {
    }
}

// ---------------------------------------------------------------------------------------------
// wgmma: descriptors and the calls by type (the same under NVRTC and the emulator)

enum WgmmaSwizzle : unsigned { kSwizzleNone = 0, kSwizzle128B = 1, kSwizzle64B = 2, kSwizzle32B = 3 };

// The descriptor of the operand whose first element (before the swizzle) is at `tile`; lbo and
// sbo in bytes (multiples of 16), base offset 0. Adding (bytes >> 4) to it moves the start
// address, as the K advance inside a swizzled row does.
__device__ __forceinline__ unsigned long long make_descriptor(const void* tile, unsigned lbo_bytes, unsigned sbo_bytes,
                                                              WgmmaSwizzle swizzle) {
    const unsigned long long address = smem_address(tile);
    return ((address & 0x3FFFFull) >> 4) | (static_cast<unsigned long long>((lbo_bytes >> 4) & 0x3FFFu) << 16) |
           (static_cast<unsigned long long>((sbo_bytes >> 4) & 0x3FFFu) << 32) |
           (static_cast<unsigned long long>(swizzle) << 62);
}

template <typename T, int N, bool TRANS_A = false, bool TRANS_B = false>
__device__ __forceinline__ void wgmma_ss(float d[N / 2], unsigned long long desc_a, unsigned long long desc_b,
                                         bool accumulate) {
    Wgmma<T, N>::template ss<TRANS_A, TRANS_B>(d, desc_a, desc_b, accumulate);
}

template <typename T, int N, bool TRANS_B = false>
__device__ __forceinline__ void wgmma_rs(float d[N / 2], const unsigned a[4], unsigned long long desc_b,
                                         bool accumulate) {
    Wgmma<T, N>::template rs<TRANS_B>(d, a, desc_b, accumulate);
}
