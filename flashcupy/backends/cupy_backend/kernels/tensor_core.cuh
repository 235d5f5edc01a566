// tensor_core.cuh: every inline PTX instruction flashcupy's tensor-core kernels use, each in one
// small function, so that a kernel reads as the maths and the CPU emulator can stand in for them.
//
//   mma_m16n8k16_f16f32 / _bf16f32   D (16x8 f32) = A (16x16) B (16x8) + C, one warp     sm_80+
//   mma_m16n8k8_f16f32               D (16x8 f32) = A (16x8) B (8x8) + C, one warp       sm_75+
//   ldmatrix_x1/x2/x4[_trans]        1, 2 or 4 8x8 b16 matrices from shared memory      sm_75+
//   cp_async_16                      16 bytes global -> shared, asynchronous, zero-fill sm_80+
//   cp_async_commit, cp_async_wait<N>   close a group of cp.async; wait for all but N  sm_80+
//   ex2_approx                       2^x, ex2.approx.ftz.f32 (2 ulp, subnormals flushed)
//   pack_f16x2 / pack_bf16x2         two floats -> one .b32 register, round to nearest even sm_80+
//   mma_m16n8k16<T>, pack2<T>        the same, chosen by the storage type (__half, __nv_bfloat16)
//
// Turing (sm_75; below AMPERE_ARCH) has float16 tensor cores but none of the sm_80+ instructions above:
// there mma_m16n8k16<__half> is two m16n8k8 (the first takes A's columns 0-7 and B's rows 0-7: a[0],
// a[1] and b[0]; the second the rest), pack_f16x2 two cvt.rn.f16.f32, and cp_async_16 a plain 16-byte
// load and store that lands at issue (commit and wait do nothing): the emulator's cp_async="eager",
// which the tensor-core kernels are tested under. bfloat16 has no mma before sm_80 and is not defined.
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"), with
// g = lane / 4 (groupID) and t = lane % 4 (threadID_in_group). A .b32 register holds two 16-bit
// elements, the one with the smaller column (A) or row (B) index in its low half:
//   A 16x16 row-major, a[4]:  a[i] = A[g + 8 (i & 1)][2t + 8 (i >> 1) + {0, 1}]
//   B 16x8 "col",      b[2]:  b[i] = B[2t + 8 i + {0, 1}][g]
//   C, D 16x8 f32,  c[4], d[4]:  c[i] = C[g + 8 (i >> 1)][2t + (i & 1)]
// m16n8k8 (f16): the same formulas with K = 8: a[2] (i < 2), b[1] (i = 0), C and D as above.
// ldmatrix (m8n8, b16): lane 8 m + r supplies the shared address of row r of matrix m (16 bytes,
// 16-byte aligned; only lanes < 8 x NUM are read); register m of lane l receives row l / 4,
// elements 2 (l % 4) and 2 (l % 4) + 1 of matrix m, or with .trans the same of the transpose.
// So ldmatrix_x4 of the four 8x8 quarters of a row-major tile gives an A fragment, ldmatrix of
// K_j's rows gives B = K_jᵀ, and ldmatrix_trans of V_j's rows gives B = V_j.
//
// Under NVRTC these are `asm volatile` (the ones that touch memory also clobber "memory", so the
// compiler keeps ordinary loads and stores on their side). Under the CPU emulator
// (FLASHCUPY_EMULATOR, defined by flashcupy/tools/emulator/include/cuda_emu.h) the same names come
// from its emu_tensor_core.h, which implements each as the ISA defines it: mma and
// ldmatrix as warp rendezvous, cp.async copies landing only at the wait that completes them.

#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

// The first architecture with the sm_80 instructions above (cp.async, m16n8k16, bf16 mma, cvt to x2);
// below it, down to Turing, the float16 stand-ins at the end of this file. specs.TC_COMPUTE_CAPABILITY
// is the same rule on the host. A test may raise it (-DAMPERE_ARCH=1000) to run the stand-ins on a newer
// GPU (tests/test_tensor_core_gpu.py); the backend never does.
#ifndef AMPERE_ARCH
#define AMPERE_ARCH 800
#endif

#ifdef FLASHCUPY_EMULATOR
#include <emu_tensor_core.h>
#else

// The 32-bit shared-state-space address that ldmatrix and cp.async take.
__device__ __forceinline__ unsigned smem_address(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mma_m16n8k8_f16f32(float d[4], const unsigned a[2], const unsigned b[1],
                                                   const float c[4]) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, "
                 "{%7, %8, %9, %10};\n"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(b[0]), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}

#define FLASHCUPY_LDMATRIX(NAME, NUM, SHAPE, OPERANDS, ...)                                                \
    __device__ __forceinline__ void NAME(unsigned r[NUM], const void* row) {                               \
        asm volatile("ldmatrix.sync.aligned.m8n8" SHAPE ".shared.b16 " OPERANDS ";\n"                      \
                     : __VA_ARGS__ : "r"(smem_address(row)) : "memory");                                   \
    }
FLASHCUPY_LDMATRIX(ldmatrix_x1, 1, ".x1", "{%0}, [%1]", "=r"(r[0]))
FLASHCUPY_LDMATRIX(ldmatrix_x2, 2, ".x2", "{%0, %1}, [%2]", "=r"(r[0]), "=r"(r[1]))
FLASHCUPY_LDMATRIX(ldmatrix_x4, 4, ".x4", "{%0, %1, %2, %3}, [%4]", "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]))
FLASHCUPY_LDMATRIX(ldmatrix_x1_trans, 1, ".x1.trans", "{%0}, [%1]", "=r"(r[0]))
FLASHCUPY_LDMATRIX(ldmatrix_x2_trans, 2, ".x2.trans", "{%0, %1}, [%2]", "=r"(r[0]), "=r"(r[1]))
FLASHCUPY_LDMATRIX(ldmatrix_x4_trans, 4, ".x4.trans", "{%0, %1, %2, %3}, [%4]",
                   "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]))
#undef FLASHCUPY_LDMATRIX

__device__ __forceinline__ float ex2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

#if __CUDA_ARCH__ >= AMPERE_ARCH
// One wrapper per data type: the instructions differ in a suffix, which an asm statement can only
// spell out.
#define FLASHCUPY_MMA_M16N8K16(NAME, AB)                                                                   \
    __device__ __forceinline__ void NAME(float d[4], const unsigned a[4], const unsigned b[2],            \
                                         const float c[4]) {                                               \
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." AB "." AB ".f32 {%0, %1, %2, %3}, "         \
                     "{%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"                                \
                     : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])                                      \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),                  \
                       "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));                                        \
    }
FLASHCUPY_MMA_M16N8K16(mma_m16n8k16_f16f32, "f16")
FLASHCUPY_MMA_M16N8K16(mma_m16n8k16_bf16f32, "bf16")
#undef FLASHCUPY_MMA_M16N8K16

// 16 bytes from global `src` to shared `dst`, both 16-byte aligned. With valid == false nothing is
// read (src must still be a valid address) and dst is zero-filled: rows past the end of a tensor.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid = true) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(smem_address(dst)), "l"(src), "r"(valid ? 16 : 0) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Wait until at most N of this thread's committed groups are pending. Other threads' copies are
// visible only after they wait too and a barrier orders them.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
}

// cvt.rn.{f16x2,bf16x2}.f32 d, a, b puts a in the high half and b in the low half.
__device__ __forceinline__ unsigned pack_f16x2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
#endif  // AMPERE_ARCH

#endif  // FLASHCUPY_EMULATOR

#if __CUDA_ARCH__ < AMPERE_ARCH
// Turing's stand-ins (the header's note), written once for the GPU and the emulator alike. Two m16n8k8
// add in two steps (A's columns 0-7, then 8-15) where m16n8k16 adds in one: the same products, another
// fp32 rounding order.
__device__ __forceinline__ void mma_m16n8k16_f16f32(float d[4], const unsigned a[4], const unsigned b[2],
                                                    const float c[4]) {
    mma_m16n8k8_f16f32(d, a, b, c);
    mma_m16n8k8_f16f32(d, a + 2, b + 1, d);
}

__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid = true) {
    *static_cast<int4*>(dst) = valid ? *static_cast<const int4*>(src) : make_int4(0, 0, 0, 0);
}

__device__ __forceinline__ void cp_async_commit() {}

template <int N>
__device__ __forceinline__ void cp_async_wait() {}

__device__ __forceinline__ unsigned pack_f16x2(float lo, float hi) {
    return __half_as_ushort(__float2half_rn(lo)) | static_cast<unsigned>(__half_as_ushort(__float2half_rn(hi))) << 16;
}
#endif  // below AMPERE_ARCH

// ---------------------------------------------------------------------------------------------
// the same, chosen by the storage type (bfloat16 from sm_80 on)

template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float d[4], const unsigned a[4], const unsigned b[2], const float c[4]);

template <>
__device__ __forceinline__ void mma_m16n8k16<__half>(float d[4], const unsigned a[4], const unsigned b[2],
                                                     const float c[4]) {
    mma_m16n8k16_f16f32(d, a, b, c);
}

template <typename T>
__device__ __forceinline__ unsigned pack2(float lo, float hi);

template <>
__device__ __forceinline__ unsigned pack2<__half>(float lo, float hi) { return pack_f16x2(lo, hi); }

#if __CUDA_ARCH__ >= AMPERE_ARCH
template <>
__device__ __forceinline__ void mma_m16n8k16<__nv_bfloat16>(float d[4], const unsigned a[4], const unsigned b[2],
                                                            const float c[4]) {
    mma_m16n8k16_bf16f32(d, a, b, c);
}

template <>
__device__ __forceinline__ unsigned pack2<__nv_bfloat16>(float lo, float hi) { return pack_bf16x2(lo, hi); }
#endif
