// emu_tensor_core.h: the emulator's versions of the inline PTX that
// flashcupy/backends/cupy_backend/kernels/tensor_core.cuh wraps, under the same names.
//
// Each follows the PTX ISA's definition (see tensor_core.cuh for the fragment layouts):
//   mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32, and m16n8k8 .f16 (sm_75)
//       a warp rendezvous (all 32 lanes, same variant): every lane deposits its A, B and C
//       fragments; the first lane to go on rebuilds A (16xK) and B (Kx8) from them with the ISA's
//       lane -> (row, col) maps, for all; each lane computes its own four elements of D = A B + C.
//       Not bit-faithful: the products are exact, the sum is taken in double and rounded to
//       float once; tensor cores add in an unspecified order with their own fp32 adders, so a
//       GPU's D may differ in the last bits.
//   ldmatrix.sync.aligned.m8n8.{x1,x2,x4}{,.trans}.shared.b16
//       each lane < 8 x NUM reads its row (16 bytes, which must be 16-byte aligned shared
//       memory) when it arrives, so in its own program order; the rows are exchanged at the
//       rendezvous and each lane picks its elements (row l / 4, columns 2 (l % 4) + {0, 1}, or
//       the transpose). Other lanes' addresses are not looked at, as on a GPU.
//   cp.async.cg.shared.global 16 bytes with src-size (zero-fill), commit_group, wait_group N
//       the source is read (and bounds-checked by the guard pages) when the copy is issued; the
//       destination is written only when the issuing thread's wait_group completes its group,
//       so a missing or too lenient wait reads stale shared memory, as on a GPU. A thread that
//       exits with copies never waited for fails the launch (runtime.cpp). A barrier does not
//       complete copies (it does not on a GPU either).
//   ex2.approx.ftz.f32
//       exp2f, exact to float precision (the GPU's approximation is within 2 ulp), results below
//       FLT_MIN flushed to zero.
//   cvt.rn.{f16x2,bf16x2}.f32
//       round to nearest even, NaN -> 0x7fff, as emu_narrow_float.h converts.

#pragma once

#include "cuda_emu.h"
#include "emu_narrow_float.h"

namespace emu {

// D = A B + C for one m16n8kK mma of the warp (K 16, or 8 for m16n8k8); `Format` is the A and B element
// type. m16n8k8's fragments are m16n8k16's formulas with K = 8: a[2], b[1].
template <class Format, int K = 16>
inline void mma_m16n8k(float d[4], const unsigned a[K / 4], const unsigned b[K / 8], const float c[4], int variant) {
    struct Fragments {
        unsigned a[K / 4];
        unsigned b[K / 8];
        float c[4];
    } mine;
    struct Operands {  // A and B widened, by the first lane to go on, for all 32
        bool ready;
        float A[16][K], B[K][8];
    };
    std::memcpy(mine.a, a, sizeof mine.a);
    std::memcpy(mine.b, b, sizeof mine.b);
    std::memcpy(mine.c, c, sizeof mine.c);
    auto* all = static_cast<Fragments*>(warp_all_gather(kMma, variant, &mine, sizeof mine, sizeof(Operands)));
    auto& m = *reinterpret_cast<Operands*>(all + 32);
    if (!m.ready) {  // the ISA's lane -> (row, col) maps
        auto low = [](unsigned r) { return Format::widen(static_cast<std::uint16_t>(r & 0xffffu)); };
        auto high = [](unsigned r) { return Format::widen(static_cast<std::uint16_t>(r >> 16)); };
        for (int lane = 0; lane < 32; ++lane) {
            const int g = lane / 4, t = lane % 4;
            const Fragments& f = all[lane];
            for (int i = 0; i < K / 4; ++i) {
                const int row = g + 8 * (i & 1), col = 2 * t + 8 * (i >> 1);
                m.A[row][col] = low(f.a[i]);
                m.A[row][col + 1] = high(f.a[i]);
            }
            for (int i = 0; i < K / 8; ++i) {
                m.B[2 * t + 8 * i][g] = low(f.b[i]);
                m.B[2 * t + 8 * i + 1][g] = high(f.b[i]);
            }
        }
        m.ready = true;
    }
    // this lane's four elements of D (rows g, g + 8, columns 2t, 2t + 1); C's are its own c
    const int g = static_cast<int>(lane_id()) / 4, t = static_cast<int>(lane_id()) % 4;
    for (int i = 0; i < 4; ++i) {
        const int row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
        double sum = mine.c[i];
        for (int k = 0; k < K; ++k) sum += static_cast<double>(m.A[row][k]) * m.B[k][col];
        d[i] = static_cast<float>(sum);
    }
}

// ldmatrix.sync.aligned.m8n8.xNUM{.trans}.shared.b16
template <int NUM, bool TRANS>
inline void ldmatrix(unsigned r[NUM], const void* row) {
    struct Row {
        std::uint16_t e[8];
    } mine;
    const unsigned lane = lane_id();
    std::memset(&mine, 0xff, sizeof mine);
    if (lane < 8u * NUM) {
        check_shared(row, 16, 16, "ldmatrix row address");
#ifdef EMU_COUNTERS  // a counting build (driver.py): ldmatrix, not a plain 16-byte load
        record_access(2, row, 16);
        copy_raw(&mine, row, sizeof mine);
#else
        std::memcpy(&mine, row, sizeof mine);
#endif
    }
    const auto* rows = static_cast<const Row*>(warp_all_gather(kLdmatrix, 2 * NUM + TRANS, &mine, sizeof mine));
    const unsigned g = lane / 4, t = lane % 4;
    for (int m = 0; m < NUM; ++m) {
        const Row* M = rows + 8 * m;
        const std::uint16_t lo = TRANS ? M[2 * t].e[g] : M[g].e[2 * t];
        const std::uint16_t hi = TRANS ? M[2 * t + 1].e[g] : M[g].e[2 * t + 1];
        r[m] = lo | static_cast<unsigned>(hi) << 16;
    }
}

}  // namespace emu

// mma.sync m16n8k8 f16 is sm_75's; the rest of this file's mma, cp.async and cvt x2 are sm_80's
// (tensor_core.cuh's AMPERE_ARCH), and a build for an older -arch does not have them, as ptxas would
// refuse them (tensor_core.cuh's stand-ins take their place there)
inline void mma_m16n8k8_f16f32(float d[4], const unsigned a[2], const unsigned b[1], const float c[4]) {
    emu::mma_m16n8k<emu::Binary16, 8>(d, a, b, c, 2);
}

#if __CUDA_ARCH__ >= AMPERE_ARCH
inline void mma_m16n8k16_f16f32(float d[4], const unsigned a[4], const unsigned b[2], const float c[4]) {
    emu::mma_m16n8k<emu::Binary16>(d, a, b, c, 0);
}

inline void mma_m16n8k16_bf16f32(float d[4], const unsigned a[4], const unsigned b[2], const float c[4]) {
    emu::mma_m16n8k<emu::BFloat16>(d, a, b, c, 1);
}
#endif

inline void ldmatrix_x1(unsigned r[1], const void* row) { emu::ldmatrix<1, false>(r, row); }
inline void ldmatrix_x2(unsigned r[2], const void* row) { emu::ldmatrix<2, false>(r, row); }
inline void ldmatrix_x4(unsigned r[4], const void* row) { emu::ldmatrix<4, false>(r, row); }
inline void ldmatrix_x1_trans(unsigned r[1], const void* row) { emu::ldmatrix<1, true>(r, row); }
inline void ldmatrix_x2_trans(unsigned r[2], const void* row) { emu::ldmatrix<2, true>(r, row); }
inline void ldmatrix_x4_trans(unsigned r[4], const void* row) { emu::ldmatrix<4, true>(r, row); }

#if __CUDA_ARCH__ >= AMPERE_ARCH
inline void cp_async_16(void* dst, const void* src, bool valid = true) { emu::cp_async(dst, src, 16, valid ? 16 : 0); }
inline void cp_async_commit() { emu::cp_async_commit(); }
template <int N>
inline void cp_async_wait() {
    emu::cp_async_wait(N);
}
#endif

inline float ex2_approx(float x) {
#ifdef EMU_COUNTERS  // a counting build (driver.py): one MUFU exponential
    emu::count_ex2();
#endif
    const float y = exp2f(x);
    return y < FLT_MIN ? 0.0f : y;
}

#if __CUDA_ARCH__ >= AMPERE_ARCH
inline unsigned pack_f16x2(float lo, float hi) {
    return emu::Binary16::round(lo) | static_cast<unsigned>(emu::Binary16::round(hi)) << 16;
}

inline unsigned pack_bf16x2(float lo, float hi) {
    return emu::BFloat16::round(lo) | static_cast<unsigned>(emu::BFloat16::round(hi)) << 16;
}
#endif
