// flash_common.cuh: what every flashcupy kernel shares.
//
// Types. T is the storage dtype (__half, __nv_bfloat16, float, double); Acc the accumulation
// type (float for all but double, double for double). Shared-memory tiles hold Acc, so a tile is converted
// once when it is loaded and never again.
//
// Thread layout. A CTA is NUM_WARPS warps of 32 lanes. The kernels keep one tile "in rows"
// (ROWS rows, ROWS / NUM_WARPS per warp: query rows in the forward and dQ kernels, key rows in
// the dK/dV kernel) and stream a second tile "in columns" (COLS <= 32 rows of the other operand).
// Two warp-level patterns make up all of the algebra:
//
//   row_dots    S[r] = A_r . B_c       lane owns column c = lane % COLS; when COLS < 32 the
//                                      32 / COLS lanes that share c each take an interleaved
//                                      share of head_dim and are summed with shuffles
//   accumulate  acc[r][t] += sum_c W[r]_c C_c[lane + 32 t]
//                                      lane owns head-dim columns lane, lane + 32, ...;
//                                      W[r]_c is broadcast from lane c with a shuffle
//
// Shared-memory tiles are row-major with HEAD_DIM (a power of two >= 32) elements per row and
// are zero past the true head_dim and past the last valid row, so padding adds nothing to a dot
// product. Global memory is addressed through element strides in 64-bit arithmetic, so any
// layout works, transposed and negative strides included.

#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#ifndef INFINITY  // NVRTC has no <cmath>
#define INFINITY __int_as_float(0x7f800000)
#endif

using index_t = long long;

constexpr int WARP_SIZE = 32;
constexpr int NUM_WARPS = 4;
constexpr int NUM_THREADS = NUM_WARPS * WARP_SIZE;
constexpr unsigned FULL_MASK = 0xffffffffu;
constexpr int SMEM_LIMIT = 48 * 1024;  // static shared memory per CTA without an opt-in
// A tiled kernel's occupancy policy comes as template parameters after BLOCK_N: MIN_CTAS, the CTAs an
// SM of __launch_bounds__(threads, MIN_CTAS), and for the wide tensor-core forward MAX_REGISTERS, a
// register cap. launch.py chooses them for every kernel (LAUNCH, Bounds) and says why.

__device__ constexpr bool is_pow2(int x) { return x > 0 && (x & (x - 1)) == 0; }

// R = ROWS / NUM_WARPS: the rows of a tile kept in rows (layout above) that each warp owns.
template <int ROWS>
__device__ constexpr int rows_per_warp() {
    static_assert(ROWS % NUM_WARPS == 0, "every warp owns the same number of rows");
    return ROWS / NUM_WARPS;
}

// How many blocks of `block` cover n items (none when n <= 0).
__device__ constexpr int num_blocks(int n, int block) { return n > 0 ? (n + block - 1) / block : 0; }

// ---------------------------------------------------------------------------------------------
// conversions and maths in the accumulation type

__device__ __forceinline__ float to_acc(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ double to_acc(double x) { return x; }

__device__ __forceinline__ void store(__half* p, float x) { *p = __float2half(x); }
__device__ __forceinline__ void store(__nv_bfloat16* p, float x) { *p = __float2bfloat16(x); }
__device__ __forceinline__ void store(float* p, float x) { *p = x; }
__device__ __forceinline__ void store(double* p, double x) { *p = x; }

__device__ __forceinline__ float acc_exp(float x) { return expf(x); }
__device__ __forceinline__ double acc_exp(double x) { return exp(x); }
__device__ __forceinline__ float acc_log(float x) { return logf(x); }
__device__ __forceinline__ double acc_log(double x) { return log(x); }
__device__ __forceinline__ float acc_max(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double acc_max(double a, double b) { return fmax(a, b); }
// tanh in float, cheaply: tanhf's polynomial, inlined for every element of a tile, took the
// tensor-core kernels past the register limit of tests/test_nvrtc.py. From |x| = 1/8 on,
// 1 - 2 / (e^2x + 1) with the fast exponential and division (a few units of float's roundoff
// relative to t, +-1 where e^2x overflows or vanishes); below, where that formula cancels (its
// error is absolute, so a softcap far above the scores saw it whole), the odd Taylor polynomial to
// x^7 (its first neglected term is below 2e-9 relative).
__device__ __forceinline__ float acc_tanh(float x) {
    const float x2 = x * x;
    const float small = x * (1.0f + x2 * (-1.0f / 3.0f + x2 * (2.0f / 15.0f + x2 * (-17.0f / 315.0f))));
    return fabsf(x) < 0.125f ? small : 1.0f - __fdividef(2.0f, __expf(2.0f * x) + 1.0f);
}
__device__ __forceinline__ double acc_tanh(double x) { return tanh(x); }

// ---------------------------------------------------------------------------------------------
// global memory

// The rows of one (batch, head) slice of a (batch, seqlen, heads, head_dim) tensor.
template <typename T>
struct Rows {
    T* base;
    index_t row_stride;
    index_t dim_stride;

    __device__ __forceinline__ T& at(int i, int d) const {
        return base[i * row_stride + d * dim_stride];
    }

    // The same rows from column d on (a CTA that writes some of a row's columns: flash_bwd_tc.cu)
    __device__ __forceinline__ Rows from_column(int d) const { return {base + d * dim_stride, row_stride, dim_stride}; }
};

template <typename T>
__device__ __forceinline__ Rows<T> head_rows(T* x, index_t s_batch, index_t s_seq, index_t s_head,
                                             index_t s_dim, int b, int h) {
    return Rows<T>{x + b * s_batch + h * s_head, s_seq, s_dim};
}

// The key (or value) rows of one (sequence, head) of a packed forward's k (v), VARLEN kernels' K and V:
// contiguous (table nullptr: as Rows), or a paged KV cache's, row i of the sequence being row
// i % page_size of physical block ("page") table[i / page_size] (the sequence's row of the block table,
// element stride table_stride along it). A page index read from the table is clamped into
// [0, last_page], so that no table makes a read leave the cache; the row index i / page_size stays in
// the table's row because the loaders read rows below the Sequence's seqlen_k only, which is clamped
// to the launch's seqlen_k: the table's row length times page_size (mask.cuh's sequence_of).
template <typename T>
struct CacheRows {
    T* base;  // row 0 of the head: of the sequence (contiguous), of page 0 (paged)
    index_t row_stride;
    index_t dim_stride;
    const int* table;  // nullptr: contiguous
    index_t table_stride, page_stride;
    int page_size, last_page;

    __device__ __forceinline__ T* row(int i) const {
        if (table == nullptr) return base + i * row_stride;
        const int page = min(max(table[(i / page_size) * table_stride], 0), last_page);
        return base + page * page_stride + (i % page_size) * row_stride;
    }
    __device__ __forceinline__ T& at(int i, int d) const { return row(i)[d * dim_stride]; }
};

// The row of one (batch, head) of a per-row statistic: lse, (batch, heads, seqlen) with element
// strides, or D, the backward's contiguous (batch, heads_q, seqlen_q) workspace. Every kernel that
// reads or writes either addresses it through this view (LSE_ROW, d_row), so the layout is spelled once.
// Row i is base[offset + i stride]: the row's start is a pointer (offset 0) where a kernel reads the
// row many times, and an element offset from the array's own pointer where it stores each row once
// (the forward's lse, with a split's offset; the tensor-core backward's D): the two forms the kernels
// spelled inline, kept because NVRTC compiles them differently.
template <typename Acc>
struct Stats {
    Acc* base;
    index_t offset;
    index_t stride;

    __device__ __forceinline__ Acc& operator[](int i) const { return base[offset + i * stride]; }
};

// The row of (batch b, head h) of a (batch, heads, seqlen) statistic x (element strides s_batch,
// s_head, s_seq), as a pointer; or, given an element offset `split` (a split-KV forward's), as an offset.
template <typename Acc>
__device__ __forceinline__ Stats<Acc> stat_row(Acc* x, index_t s_batch, index_t s_head, index_t s_seq, int b, int h) {
    return Stats<Acc>{x + b * s_batch + h * s_head, 0, s_seq};
}
template <typename Acc>
__device__ __forceinline__ Stats<Acc> stat_row(Acc* x, index_t split, index_t s_batch, index_t s_head, index_t s_seq,
                                               int b, int h) {
    return Stats<Acc>{x, split + b * s_batch + h * s_head, s_seq};
}

// D's row of (batch b, query head h): contiguous, heads_q rows of seqlen_q a batch; as a pointer, or
// (AT_OFFSET) as an offset.
template <bool AT_OFFSET = false, typename Acc>
__device__ __forceinline__ Stats<Acc> d_row(Acc* D, int heads_q, int seqlen_q, int b, int h) {
    const index_t start = (index_t(b) * heads_q + h) * seqlen_q;
    if constexpr (AT_OFFSET) return Stats<Acc>{D, start, 1};
    return Stats<Acc>{D + start, 0, 1};
}

// A kernel's (batch, seqlen, heads, head_dim) tensor argument x: TENSOR_PARAMS declares x, the address
// of its first element, and x_sb, x_ss, x_sh, x_sd, its element strides, in the order the launcher
// packs them (_tensor in cupy_backend/__init__.py); HEAD_ROWS(x, b, h) is its (batch b, head h) slice.
// LSE_PARAMS is the same for a (batch, heads, seqlen) statistic (lse), strides x_sb, x_sh, x_ss.
#define TENSOR_PARAMS(T, x) T* __restrict__ x, index_t x##_sb, index_t x##_ss, index_t x##_sh, index_t x##_sd
#define HEAD_ROWS(x, b, h) head_rows(x, x##_sb, x##_ss, x##_sh, x##_sd, b, h)
#define LSE_PARAMS(T, x) T* __restrict__ x, index_t x##_sb, index_t x##_sh, index_t x##_ss
// LSE_ROW(x, b, h): the Stats of (batch b, head h) of such an argument; LSE_ROW_AT(x, split, b, h) the
// same at element offset split (its row as an offset).
#define LSE_ROW(x, b, h) stat_row(x, x##_sb, x##_sh, x##_ss, b, h)
#define LSE_ROW_AT(x, split, b, h) stat_row(x, split, x##_sb, x##_sh, x##_ss, b, h)
// The scalars that close every attention kernel's argument list, in the launcher's order: the sizes
// (head_dim q's and k's, head_dim_v v's, out's and dout's: the SIMT kernels' and the tensor-core
// forward's tiles are padded to the larger, the tensor-core backward and the Hopper kernels are only
// launched with the two equal); a Mask
// (mask.cuh) is made of seqlen_q, seqlen_k, diagonal and causal, and with a window of window_left and
// window_right. The score modifiers follow (Score in mask.cuh): the softcap's cap_in and cap_out in
// the kernel's units, computed by the launcher (so they stay kernel parameters, not registers), and
// the ALiBi slopes as a (batch, heads_q) array of Acc with element strides alibi_sb (0 for per-head
// slopes), alibi_sh; the bias (of the kernel's T, or of float where bias_f32) and the bool mask
// (keep), each a rank-4 array broadcastable to (batch, heads_q, seqlen_q, seqlen_k) with its element
// strides (0 along a broadcast dimension). Dropout's last (mask.cuh's Dropout): the threshold, the seed's
// two words, or where drop_seed_read is 1 the device memory that holds them (flashcupy.jax's seeds, which
// live on the device), the origin (batch, head, query, key) of the kernel's pairs in the whole call's
// mask, and 1 / (1 - p) in Acc.
// Every kernel takes them all; a kernel not specialised for a modifier never reads its arguments.
#define PROBLEM_PARAMS(Acc) \
    int seqlen_q, int seqlen_k, int heads_q, int group, int head_dim, int head_dim_v, Acc scale, int causal, \
    int diagonal, int window_left, int window_right, Acc cap_in, Acc cap_out, const Acc* __restrict__ alibi, \
    index_t alibi_sb, index_t alibi_sh, const void* __restrict__ bias, index_t bias_sb, index_t bias_sh, \
    index_t bias_sq, index_t bias_sk, int bias_f32, const bool* __restrict__ keep, index_t keep_sb, \
    index_t keep_sh, index_t keep_sq, index_t keep_sk, unsigned drop_threshold, unsigned drop_seed_lo, \
    unsigned drop_seed_hi, const unsigned* __restrict__ drop_seed, int drop_seed_read, unsigned drop_b, \
    unsigned drop_h, unsigned drop_i, unsigned drop_j, Acc drop_scale

// The forward kernels' last arguments, split-KV (mask.cuh's Split): keys per split, and the element
// offsets between the splits' partial outs and lses; read only by kernels specialised for SPLIT.
#define SPLIT_PARAMS int key_split, index_t out_split, index_t lse_split
// Then a packed batch's (mask.cuh's Sequence): the int32 offsets of its num_seqs sequences in q and in
// k, v (num_seqs + 1 each, device memory), and where has_seqused is 1 the keys each sequence uses from its
// offset on, seqused_k[s] + seqused_add (num_seqs of them: a KV cache's lengths before its new tokens, and
// their count); read only by kernels specialised for VARLEN.
#define VARLEN_PARAMS                                                                                  \
    const int* __restrict__ cu_seqlens_q, const int* __restrict__ cu_seqlens_k, int num_seqs, \
        const int* __restrict__ seqused_k, int has_seqused, int seqused_add

// Then, a forward kernel's, a paged KV cache's (CacheRows; read only by kernels specialised for VARLEN): its
// block table (int32 (sequences, max_blocks) in device memory, element strides table_sb, table_sn), the
// rows of a page (a physical block; 0: no table, the keys are the packed rows of cu_seqlens_k) and the
// pages the cache holds. With a table, k's and v's batch strides (k_sb, v_sb) are the pages' strides.
#define PAGED_PARAMS \
    const int* __restrict__ block_table, index_t table_sb, index_t table_sn, int page_size, int num_pages

// The same argument lists passed on, name for name: a kernel entry point handing its arguments to the
// device function that does its CTA's work (flash_fwd_tc.cu).
#define TENSOR_ARGS(x) x, x##_sb, x##_ss, x##_sh, x##_sd
#define LSE_ARGS(x) x, x##_sb, x##_sh, x##_ss
#define PROBLEM_ARGS                                                                                        \
    seqlen_q, seqlen_k, heads_q, group, head_dim, head_dim_v, scale, causal, diagonal, window_left, window_right, \
        cap_in, cap_out, alibi, alibi_sb, alibi_sh, bias, bias_sb, bias_sh, bias_sq, bias_sk, bias_f32, keep, keep_sb, \
        keep_sh, keep_sq, keep_sk, drop_threshold, drop_seed_lo, drop_seed_hi, drop_seed, drop_seed_read, drop_b, \
        drop_h, drop_i, drop_j, drop_scale
#define SPLIT_ARGS key_split, out_split, lse_split
#define VARLEN_ARGS cu_seqlens_q, cu_seqlens_k, num_seqs, seqused_k, has_seqused, seqused_add
#define PAGED_ARGS block_table, table_sb, table_sn, page_size, num_pages

// A forward kernel's key and value rows of (batch or sequence b, key/value head h) of its argument x (k or v):
// Rows, or for VARLEN (KeyRows<VARLEN, T>) CacheRows, through the block table when PAGED_PARAMS give one.
template <bool VARLEN, typename T>
struct KeyRowsT { using type = Rows<T>; };
template <typename T>
struct KeyRowsT<true, T> { using type = CacheRows<T>; };
template <bool VARLEN, typename T>
using KeyRows = typename KeyRowsT<VARLEN, T>::type;

template <bool VARLEN, typename T>
__device__ __forceinline__ KeyRows<VARLEN, T> key_rows(T* x, index_t s_batch, index_t s_seq, index_t s_head,
                                                       index_t s_dim, int b, int h, PAGED_PARAMS) {
    if constexpr (!VARLEN) {
        return head_rows(x, s_batch, s_seq, s_head, s_dim, b, h);
    } else {
        if (page_size > 0)
            return {x + h * s_head, s_seq, s_dim, block_table + b * table_sb, table_sn, s_batch, page_size, num_pages - 1};
        return {x + b * s_batch + h * s_head, s_seq, s_dim, nullptr, 0, 0, 1, 0};
    }
}
#define KEY_ROWS(VARLEN, x, b, h) key_rows<VARLEN>(x, x##_sb, x##_ss, x##_sh, x##_sd, b, h, PAGED_ARGS)

// A forward kernel's out: T, or with split-KV the partial out in Acc (the merge's input).
template <bool SPLIT, typename T, typename Acc>
struct SplitOutT { using type = T; };
template <typename T, typename Acc>
struct SplitOutT<true, T, Acc> { using type = Acc; };
template <bool SPLIT, typename T, typename Acc>
using SplitOut = typename SplitOutT<SPLIT, T, Acc>::type;

// tile[r][d] = scale * src(row0 + r, d) for r < ROWS, d < HEAD_DIM; zero where row0 + r >= seqlen
// or d >= head_dim. Consecutive threads take consecutive d: coalesced when head_dim is contiguous.
template <int ROWS, int HEAD_DIM, typename Src, typename Acc>
__device__ __forceinline__ void load_tile(Acc* tile, const Src& src, int row0, int seqlen,
                                          int head_dim, Acc scale) {
    for (int e = threadIdx.x; e < ROWS * HEAD_DIM; e += NUM_THREADS) {
        const int r = e / HEAD_DIM, d = e % HEAD_DIM;
        tile[e] = (row0 + r < seqlen && d < head_dim) ? scale * to_acc(src.at(row0 + r, d)) : Acc(0);
    }
}

// ---------------------------------------------------------------------------------------------
// warp-level tile algebra

// row *= factor, for one of the warp's rows of an accumulator (this lane's columns of it)
template <typename Acc, int COLS>
__device__ __forceinline__ void scale_row(Acc (&row)[COLS], Acc factor) {
#pragma unroll
    for (int t = 0; t < COLS; ++t) row[t] *= factor;
}

template <typename Acc, int ROWS, int COLS>
__device__ __forceinline__ void zero(Acc (&x)[ROWS][COLS]) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int c = 0; c < COLS; ++c) x[r][c] = Acc(0);
}

template <typename Acc, int TILES, int ROWS, int COLS>
__device__ __forceinline__ void zero(Acc (&x)[TILES][ROWS][COLS]) {
#pragma unroll
    for (int t = 0; t < TILES; ++t) zero(x[t]);
}

// Reduce x over the lanes whose indices differ only in their low log2(WIDTH) bits.
template <int WIDTH, typename Acc>
__device__ __forceinline__ Acc group_max(Acc x) {
    for (int offset = WIDTH / 2; offset > 0; offset /= 2)
        x = acc_max(x, __shfl_xor_sync(FULL_MASK, x, offset));
    return x;
}

template <int WIDTH, typename Acc>
__device__ __forceinline__ Acc group_sum(Acc x) {
    for (int offset = WIDTH / 2; offset > 0; offset /= 2)
        x += __shfl_xor_sync(FULL_MASK, x, offset);
    return x;
}

// S[r] = A_s[r] . B_s[c] for the warp's R rows of A_s and this lane's column c of B_s (COLS rows).
// The SPLIT = 32 / COLS lanes that share c take the head-dim entries d = part (mod SPLIT) and
// are summed at the end, so every lane holds the full dot product. Each lane walks head_dim in
// a rotated order (starting at its own c) so that the 32 lanes always touch 32 distinct banks.
template <int R, int COLS, int HEAD_DIM, typename Acc>
__device__ __forceinline__ void row_dots(Acc (&S)[R], const Acc* A_s, const Acc* B_s) {
    constexpr int SPLIT = WARP_SIZE / COLS;
    constexpr int STEPS = HEAD_DIM / SPLIT;
    static_assert(is_pow2(COLS) && COLS <= WARP_SIZE, "COLS must be a power of two <= 32");
    static_assert(is_pow2(STEPS) && STEPS >= COLS, "HEAD_DIM / SPLIT must be a power of two >= COLS");
    const int lane = threadIdx.x % WARP_SIZE;
    const int c = lane % COLS, part = lane / COLS;
    const Acc* B_c = B_s + c * HEAD_DIM;
#pragma unroll
    for (int r = 0; r < R; ++r) S[r] = Acc(0);
    auto step = [&](int u) {
        const int d = ((u + c) & (STEPS - 1)) * SPLIT + part;
        const Acc b = B_c[d];
#pragma unroll
        for (int r = 0; r < R; ++r) S[r] += A_s[r * HEAD_DIM + d] * b;
    };
    if constexpr (sizeof(Acc) == 8) {
        // Not unrolled: the float64 loads (two registers each) that unrolling lets ptxas hoist took
        // the backward kernels past the register cap of their MIN_CTAS, and spilled.
#pragma unroll 1
        for (int u = 0; u < STEPS; ++u) step(u);
    } else {
        for (int u = 0; u < STEPS; ++u) step(u);
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        for (int offset = COLS; offset < WARP_SIZE; offset *= 2)
            S[r] += __shfl_xor_sync(FULL_MASK, S[r], offset);
    }
}

// X = A_s B_sᵀ and Y = C_s D_sᵀ, as row_dots: the two products of both backward kernels (S and dP,
// or their transposes), as two_mma_abt in tc_tile.cuh is for the tensor-core ones.
template <int R, int COLS, int HEAD_DIM, typename Acc>
__device__ __forceinline__ void two_row_dots(Acc (&X)[R], Acc (&Y)[R], const Acc* A_s, const Acc* B_s,
                                             const Acc* C_s, const Acc* D_s) {
    row_dots<R, COLS, HEAD_DIM>(X, A_s, B_s);
    row_dots<R, COLS, HEAD_DIM>(Y, C_s, D_s);
}

// acc[r][t] += sum_c W[r]_c * C_s[c][lane + 32 t], where W[r]_c is the W[r] held by lane c.
template <int R, int COLS, int HEAD_DIM, typename Acc>
__device__ __forceinline__ void accumulate(Acc (&acc)[R][HEAD_DIM / WARP_SIZE], const Acc (&W)[R],
                                           const Acc* C_s) {
    static_assert(is_pow2(HEAD_DIM) && HEAD_DIM >= WARP_SIZE, "HEAD_DIM must be a power of two >= 32");
    const int lane = threadIdx.x % WARP_SIZE;
    for (int c = 0; c < COLS; ++c) {
        Acc w[R];
#pragma unroll
        for (int r = 0; r < R; ++r) w[r] = __shfl_sync(FULL_MASK, W[r], c);
#pragma unroll
        for (int t = 0; t < HEAD_DIM / WARP_SIZE; ++t) {
            const Acc x = C_s[c * HEAD_DIM + lane + WARP_SIZE * t];
#pragma unroll
            for (int r = 0; r < R; ++r) acc[r][t] += w[r] * x;
        }
    }
}

// Store the warp's R rows of acc (this lane's columns lane + 32 t) to dst rows row0 + r < seqlen.
template <int R, int HEAD_DIM, typename T, typename Acc>
__device__ __forceinline__ void store_rows(const Rows<T>& dst, const Acc (&acc)[R][HEAD_DIM / WARP_SIZE],
                                           int row0, int seqlen, int head_dim) {
    const int lane = threadIdx.x % WARP_SIZE;
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int t = 0; t < HEAD_DIM / WARP_SIZE; ++t) {
            const int d = lane + WARP_SIZE * t;
            if (row0 + r < seqlen && d < head_dim) store(&dst.at(row0 + r, d), acc[r][t]);
        }
    }
}
