// tc_tile.cuh: what the tensor-core kernels (flash_fwd_tc.cu, flash_bwd_tc.cu) share on top of
// tensor_core.cuh: the swizzled shared-memory tile and its cp.async loader, double buffering (one
// stage idiom for the three loops that stream tiles, and the K/V stream of the two that stream key
// blocks), the products of one warp on mma fragments, and the constants of base-2 exponentials.
//
// A tile is ROWS x HEAD_DIM elements of T (2 bytes), row-major, XOR-swizzled in 16-byte chunks:
// chunk c of row r is stored at chunk c ^ (r % 8), so the 8 rows one ldmatrix reads hit 8
// different 16-byte bank groups. A row takes TILE_ROW<HEAD_DIM> elements, HEAD_DIM (a multiple of
// 16) rounded up to 64: whole groups of 8 chunks, inside which the XOR stays; a head_dim of 80
// computes 80 columns and leaves the rest of its row unused.
//
// Each warp computes 16 rows of a product (a row tile), or M row tiles. X[COLS / 8][4] holds those 16
// rows x COLS columns in fp32 as C fragments (layouts in tensor_core.cuh): X[nt][i] is row c_row(i),
// column 8 nt + c_col(i); the lane holds rows g and g + 8 (g = lane / 4) and columns 2 t, 2 t + 1 of
// each 8-column tile (t = lane % 4). X[M][COLS / 8][4] holds M row tiles, X[mt] rows 16 mt ...

#pragma once

#include "flash_common.cuh"
#include "mask.cuh"
#include "tensor_core.cuh"

constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

template <int HEAD_DIM>
constexpr int TILE_ROW = (HEAD_DIM + 63) / 64 * 64;

// The CTAs that share a block's output columns in the backward (flash_bwd_tc.cu, blockIdx.y the part):
// above head_dim 128 two, each of HEAD_DIM / 2 columns of dK, dV (dQ), each computing the whole of S and
// dP: one warp's dK and dV of 256 columns would take 256 registers a thread. specs.tc_column_parts says
// the same.
template <int HEAD_DIM>
constexpr int TC_COLUMN_PARTS = HEAD_DIM > 128 ? 2 : 1;

// The tensor-core kernels' per-element epilogue (the SIMT kernels': mask.cuh, whose PAIR_SEEN and ds
// these share), in base 2: s is q.k, unscaled; Score's constants carry scale and log2 e.

// Whether a pair of a tile is hidden: never in a tile that needs no element-wise mask (not partial)
#define TC_PAIR_HIDDEN(partial, i, j) ((partial) && !PAIR_SEEN(i, j))

// The final score in base 2 of pair (i, j) from s; t as Score's (softcap only)
template <typename ScoreT>
__device__ __forceinline__ float tc_final_score(const ScoreT& score, float s, int i, int j, float& t, float scale_log2) {
    if constexpr (ScoreT::CHANGES) return score(s, i, j, t);
    return s * scale_log2;
}

// The forward's scores of one row tile (C fragments: rows from row0, keys from j0, of the tile at i0, j0)
// made final: through the modifiers that change scores (else the softmax scales them: tc_softmax_scale),
// then -inf where the pair is hidden, in the tiles that TILE_MASKED names. flash_fwd_tc.cu's and
// flash_fwd_sm90.cu's.
template <int MODS, typename MaskT, typename ScoreT, int TILES>
__device__ __forceinline__ void tc_final_scores(float (&S)[TILES][4], const MaskT& mask, const ScoreT& score, int i0,
                                                int row0, int j0, float scale_log2) {
    if constexpr ((MODS & MOD_SCORE) != 0) {
        for_each_element([&](int r, int c, float& s) {
            float t = 0.0f;
            s = tc_final_score(score, s, row0 + r, j0 + c, t, scale_log2);
        }, S);
    }
    if (TILE_MASKED(MODS, i0, j0)) {
        for_each_element([&](int r, int c, float& s) {
            if (PAIR_HIDDEN(row0 + r, j0 + c)) s = -INFINITY;
        }, S);
    }
}

// The forward's online softmax takes s as the modifiers leave it (modified in place where they change
// scores: tc_final_score) and exponentiates s times this, folded into its exponent
template <typename ScoreT>
__device__ __forceinline__ float tc_softmax_scale(const ScoreT&, float scale_log2) {
    return ScoreT::CHANGES ? 1.0f : scale_log2;
}

// P = 2^x of x = a seen pair's final score - lse log2 e
__device__ __forceinline__ float tc_prob(float x) { return ex2_approx(at_most_zero(x)); }

// The wide forward (flash_fwd_tc_wide in flash_fwd_tc.cu): WIDE_WARPS warps, each of two row tiles.
constexpr int WIDE_WARPS = 8;

// The bounds of a kernel under a register cap, MAX_REGISTERS a thread (the kernels' occupancy policy,
// MIN_CTAS and MAX_REGISTERS, is launch.py's Bounds). __maxnreg__ came with CUDA 12.4: older NVRTCs get
// __launch_bounds__ with MIN_CTAS instead, and may spill.
#if __CUDACC_VER_MAJOR__ > 12 || (__CUDACC_VER_MAJOR__ == 12 && __CUDACC_VER_MINOR__ >= 4)
#define CAPPED_BOUNDS(THREADS, MIN_CTAS, MAX_REGISTERS) __maxnreg__(MAX_REGISTERS)
#else
#define CAPPED_BOUNDS(THREADS, MIN_CTAS, MAX_REGISTERS) __launch_bounds__(THREADS, MIN_CTAS)
#endif

// Pᵀ and dSᵀ of one element of the transposed backward's tiles (flash_bwd_tc.cu's dK/dV kernel,
// flash_bwd_sm90.cu), in place: s, Sᵀ's raw score of key j and query i, becomes P; dp becomes dS.
// lse_log2: lse_i log2 e (+inf where P must be 0), D: D_i; hidden: the pair is masked (P = 0), and
// with zero_hidden_ds its dS is 0 whatever dp holds (a NaN in a hidden row's dout: flash_bwd_tc.cu).
// A macro of the kernel's score: as a function it took flash_bwd_tc.cu's deterministic dK/dV kernel at
// head_dim 128 from 244 to 249 registers under NVRTC 12.9 (tests/test_nvrtc.py's limit is 247).
// With dropout (the kernel's drop, mask.cuh's Dropout), s becomes P of the dropped weights (dV's) and
// dS is of dP times the same factor.
#define TC_P_DS(hidden, zero_hidden_ds, i, j, s, dp, lse_log2, D, scale_log2)                                    \
    do {                                                                                                      \
        const bool hidden_ = (hidden);                                                                        \
        float t_ = 0.0f;                                                                                      \
        const float P_ = hidden_ ? 0.0f : tc_prob(tc_final_score(score, s, i, j, t_, scale_log2) - (lse_log2)); \
        const float z_ = drop.factor(i, j);                                                                   \
        s = drop.times(P_, z_);                                                                               \
        dp = (zero_hidden_ds) && hidden_ ? 0.0f : ds(score, P_, drop.times(dp, z_), D, t_);                   \
    } while (0)

// TC_P_DS in two steps, for a kernel that has Sᵀ before dPᵀ (flash_bwd_sm90.cu's P_UNDER_DP): s becomes P,
// then dp becomes dS of P. Only for scores no modifier changes (the softcap's t would pass between them).
#define TC_P(hidden, i, j, s, lse_log2, scale_log2)                                                        \
    do {                                                                                                \
        static_assert(!decltype(score)::CHANGES, "a modifier changes the scores: TC_P_DS, not TC_P, TC_DS"); \
        float t_ = 0.0f;                                                                                \
        s = (hidden) ? 0.0f : tc_prob(tc_final_score(score, s, i, j, t_, scale_log2) - (lse_log2));    \
    } while (0)
#define TC_DS(P, dp, D)                                                                                 \
    do {                                                                                                \
        static_assert(!decltype(score)::CHANGES, "a modifier changes the scores: TC_P_DS, not TC_P, TC_DS"); \
        dp = ds(score, P, dp, D, 0.0f);                                                                 \
    } while (0)

// Element offset of 8-element chunk `chunk` of row `row` in a swizzled tile.
template <int HEAD_DIM>
__device__ __forceinline__ int swizzled(int row, int chunk) {
    static_assert(HEAD_DIM % 16 == 0, "k-steps and ldmatrix_x4 pairs of 8-column tiles take 16 columns");
    return row * TILE_ROW<HEAD_DIM> + ((chunk ^ (row & 7)) << 3);
}

// Every row: the row filter of the tile loaders below when none is given.
struct EveryRow {
    __device__ __forceinline__ bool operator()(int) const { return true; }
};

// cp.async the ROWS x HEAD_DIM tile of rows row0.. of src into `tile` (swizzled), shared among the
// CTA's THREADS threads; zero-fill the rows from seqlen on, the columns from head_dim on and the rows
// i for which keep(i) is false (EveryRow: none). Not committed.
template <int ROWS, int HEAD_DIM, int THREADS = NUM_THREADS, typename T, typename Src, typename Keep = EveryRow>
__device__ __forceinline__ void load_tile_async(T* tile, const Src& src, int row0, int seqlen,
                                                int head_dim, Keep keep = {}) {
    constexpr int CHUNKS = HEAD_DIM / 8;
    constexpr bool WHOLE = ROWS * CHUNKS % THREADS == 0;  // every thread copies as many chunks
#pragma unroll
    for (int pass = 0; pass < (ROWS * CHUNKS + THREADS - 1) / THREADS; ++pass) {
        const int e = pass * THREADS + threadIdx.x;
        if (!WHOLE && e >= ROWS * CHUNKS) break;  // the last pass of a head_dim not a multiple of 64
        const int r = e / CHUNKS, c = e % CHUNKS;
        const bool valid = row0 + r < seqlen && 8 * c < head_dim && keep(row0 + r);
        cp_async_16(tile + swizzled<HEAD_DIM>(r, c), valid ? &src.at(row0 + r, 8 * c) : src.base, valid);
    }
}

// ---------------------------------------------------------------------------------------------
// double buffering
//
// A loop that streams pairs of tiles (K_j, V_j; or Q_i, dO_i) keeps two stages of each: pass p
// computes on stage p % 2 while cp.async fills the other for pass p + 1. Every pass commits exactly
// one cp.async group, its prefetch (empty on the last pass), so that waiting for all but the newest
// group completes this thread's copies of stage p % 2, on every pass alike. The other threads'
// copies are visible only after a barrier, which the kernel places.

// cp.async rows row0.. of A and B into stage `stage` of A_s and B_s (2 tiles of ROWS rows each), each
// zero past its own head dim (head_dim_a, head_dim_b: K's and V's, or Q's and dO's), B's rows filtered
// by keep_b (load_tile_async). Not committed.
template <int ROWS, int HEAD_DIM, int THREADS = NUM_THREADS, typename T, typename Src, typename Keep = EveryRow>
__device__ __forceinline__ void load_stage_async(T* A_s, T* B_s, int stage, const Src& A,
                                                 const Src& B, int row0, int seqlen, int head_dim_a,
                                                 int head_dim_b, Keep keep_b = {}) {
    load_tile_async<ROWS, HEAD_DIM, THREADS>(A_s + stage * ROWS * TILE_ROW<HEAD_DIM>, A, row0, seqlen, head_dim_a);
    load_tile_async<ROWS, HEAD_DIM, THREADS>(B_s + stage * ROWS * TILE_ROW<HEAD_DIM>, B, row0, seqlen, head_dim_b,
                                             keep_b);
}

// Commit this pass's prefetch and wait for this thread's copies of this pass's stage.
__device__ __forceinline__ void cp_async_next_stage() {
    cp_async_commit();
    cp_async_wait<1>();
}

// The key blocks that the query block at i0 sees (or keys j_start .. j_end - 1, as given), streamed
// through the two stages of K_s, V_s: pass jb (of `blocks`) computes on K_j(jb), V_j(jb), the key
// block at j0(jb). THREADS: the CTA's threads, which share the copies; Src the rows K and V are read
// through (Rows, or a packed forward's CacheRows). K_s and V_s are HEAD_DIM wide, each zero past its
// own head dim (head_dim, head_dim_v).
template <int BLOCK_N, int HEAD_DIM, typename T, int THREADS = NUM_THREADS, typename Src = Rows<const T>>
struct KVStream {
    T* K_s;
    T* V_s;
    Src K, V;
    int j_start, blocks, seqlen_k, head_dim, head_dim_v;

    template <int BLOCK_M, bool WINDOW>
    __device__ __forceinline__ KVStream(T* K_s, T* V_s, const Src& K, const Src& V,
                                        const Mask<BLOCK_M, BLOCK_N, WINDOW>& mask, int i0, int head_dim,
                                        int head_dim_v)
        : K_s(K_s), V_s(V_s), K(K), V(V), j_start(mask.key_start(i0)),
          blocks(num_blocks(mask.key_end(i0) - j_start, BLOCK_N)), seqlen_k(mask.seqlen_k), head_dim(head_dim),
          head_dim_v(head_dim_v) {}

    __device__ __forceinline__ KVStream(T* K_s, T* V_s, const Src& K, const Src& V, int j_start,
                                        int j_end, int seqlen_k, int head_dim, int head_dim_v)
        : K_s(K_s), V_s(V_s), K(K), V(V), j_start(j_start), blocks(num_blocks(j_end - j_start, BLOCK_N)),
          seqlen_k(seqlen_k), head_dim(head_dim), head_dim_v(head_dim_v) {}

    __device__ __forceinline__ int j0(int jb) const { return j_start + jb * BLOCK_N; }
    __device__ __forceinline__ const T* K_j(int jb) const { return K_s + (jb & 1) * BLOCK_N * TILE_ROW<HEAD_DIM>; }
    __device__ __forceinline__ const T* V_j(int jb) const { return V_s + (jb & 1) * BLOCK_N * TILE_ROW<HEAD_DIM>; }

    // cp.async the key block of pass jb into its stage. Not committed.
    __device__ __forceinline__ void load(int jb) const {
        load_stage_async<BLOCK_N, HEAD_DIM, THREADS>(K_s, V_s, jb & 1, K, V, j0(jb), seqlen_k, head_dim, head_dim_v);
    }

    // At the top of pass jb: prefetch pass jb + 1 and wait for this thread's copies of pass jb.
    __device__ __forceinline__ void next(int jb) const {
        if (jb + 1 < blocks) load(jb + 1);
        cp_async_next_stage();
    }
};

// ---------------------------------------------------------------------------------------------
// one warp's products on fragments

// Where element i of one of the lane's C fragments lies in its 16 x 8 tile.
__device__ __forceinline__ int c_row(int i) { return threadIdx.x % WARP_SIZE / 4 + 8 * (i >> 1); }
__device__ __forceinline__ int c_col(int i) { return 2 * (threadIdx.x % 4) + (i & 1); }

// f(row, col, X[nt][i], Y[nt][i]...) for every element the lane holds of the warp's C fragments X (and
// Y..., of the same shape): row 0 .. 15 and col 0 .. 8 TILES - 1 its place in the warp's 16 x 8 TILES.
template <typename F, int TILES, typename... Ys>
__device__ __forceinline__ void for_each_element(F f, float (&X)[TILES][4], Ys&... Y) {
#pragma unroll
    for (int nt = 0; nt < TILES; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) f(c_row(i), 8 * nt + c_col(i), X[nt][i], Y[nt][i]...);
}

// The forward's P of one row tile (C fragments as tc_final_scores'), after the online softmax took its
// row sums, times dropout's factors (mask.cuh's Dropout); nothing without MOD_DROPOUT. Elements 0, 1 (and
// 2, 3) of a fragment are one row's keys c_col(0) and c_col(0) + 1 (even, then odd): one Philox call each.
template <int MODS, typename DropoutT, int TILES>
__device__ __forceinline__ void tc_dropout(float (&P)[TILES][4], const DropoutT& drop, int row0, int j0) {
    if constexpr ((MODS & MOD_DROPOUT) != 0) {
#pragma unroll
        for (int nt = 0; nt < TILES; ++nt)
#pragma unroll
            for (int i = 0; i < 4; i += 2)
                drop.pair(P[nt][i], P[nt][i + 1], row0 + c_row(i), j0 + 8 * nt + c_col(i));
    }
}

// for_each_element, f also given u[col] and v[col], two per-column vectors in shared memory (the backward's
// lse_i and D_i). PAIRED: one 8-byte load of each per 8-column tile, for the lane's two columns there;
// otherwise a load per element, each from an address of its own (fewer registers, more instructions)
template <bool PAIRED, typename F, int TILES, typename... Ys>
__device__ __forceinline__ void for_each_element_cols(F f, const float* u, const float* v, float (&X)[TILES][4],
                                                      Ys&... Y) {
#pragma unroll
    for (int nt = 0; nt < TILES; ++nt) {
        float2 u2, v2;
        if constexpr (PAIRED) {
            u2 = *reinterpret_cast<const float2*>(u + 8 * nt + c_col(0));
            v2 = *reinterpret_cast<const float2*>(v + 8 * nt + c_col(0));
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int col = 8 * nt + c_col(i);
            if constexpr (PAIRED) f(c_row(i), col, i & 1 ? u2.y : u2.x, i & 1 ? v2.y : v2.x, X[nt][i], Y[nt][i]...);
            else f(c_row(i), col, u[col], v[col], X[nt][i], Y[nt][i]...);
        }
    }
}

// The A fragment of k-step ks from the warp's 16 rows of the swizzled tile A_s.
template <int HEAD_DIM, typename T>
__device__ __forceinline__ void load_a(unsigned (&a)[4], const T* A_s, int ks) {
    const int lane = threadIdx.x % WARP_SIZE;
    ldmatrix_x4(a, A_s + swizzled<HEAD_DIM>(lane % 16, 2 * ks + lane / 16));
}

// The A fragment of k-step kk from the C fragments of 8-column tiles 2 kk and 2 kk + 1, rounded to T:
// a product's fp32 result becomes the next product's operand without passing through shared memory.
template <typename T>
__device__ __forceinline__ void c_to_a(unsigned (&a)[4], const float (&c0)[4], const float (&c1)[4]) {
    a[0] = pack2<T>(c0[0], c0[1]);
    a[1] = pack2<T>(c0[2], c0[3]);
    a[2] = pack2<T>(c1[0], c1[1]);
    a[3] = pack2<T>(c1[2], c1[3]);
}

// X[mt] += A[mt] B_sᵀ over k-step ks, for each of the warp's M row tiles: A[mt] the A fragment of
// that step for rows 16 mt .., B_s COLS rows of HEAD_DIM (the B operand as stored). One ldmatrix_x4
// gives the B fragments of two 8-column tiles, which feed 2 M mma: the more row tiles a warp owns,
// the fewer shared-memory bytes each mma costs.
template <typename T, int HEAD_DIM, int COLS, int M>
__device__ __forceinline__ void mma_abt_step(float (&X)[M][COLS / 8][4], const unsigned (&a)[M][4], const T* B_s,
                                             int ks) {
    const int lane = threadIdx.x % WARP_SIZE;
#pragma unroll
    for (int nt = 0; nt < COLS / 8; nt += 2) {
        unsigned b[4];
        ldmatrix_x4(b, B_s + swizzled<HEAD_DIM>(8 * nt + lane % 8 + 8 * (lane / 16), 2 * ks + lane / 8 % 2));
#pragma unroll
        for (int mt = 0; mt < M; ++mt) {
            mma_m16n8k16<T>(X[mt][nt], a[mt], b, X[mt][nt]);
            mma_m16n8k16<T>(X[mt][nt + 1], a[mt], b + 2, X[mt][nt + 1]);
        }
    }
}

// The same for one row tile (16 rows).
template <typename T, int HEAD_DIM, int COLS>
__device__ __forceinline__ void mma_abt_step(float (&X)[COLS / 8][4], const unsigned (&a)[4], const T* B_s,
                                             int ks) {
    mma_abt_step<T, HEAD_DIM, COLS, 1>(reinterpret_cast<float(&)[1][COLS / 8][4]>(X),
                                       reinterpret_cast<const unsigned(&)[1][4]>(a), B_s, ks);
}

// X = A_s B_sᵀ and Y = C_s D_sᵀ: A_s, C_s the warp's 16 rows, B_s, D_s COLS rows each. The A
// operands are read from shared memory at every k-step, one ldmatrix_x4 shared by the COLS / 8 mmas
// of that step, which leaves the registers to the fp32 accumulators. ROLLED: the loop over k-steps is
// not unrolled, so ptxas cannot load the fragments of every k-step ahead of their mmas (which took
// the backward with a bool mask at head_dim 128 to every register, and spills:
// benchmarks/results/tile_choices.md).
template <typename T, int HEAD_DIM, int COLS, bool ROLLED = false>
__device__ __forceinline__ void two_mma_abt(float (&X)[COLS / 8][4], float (&Y)[COLS / 8][4], const T* A_s,
                                            const T* B_s, const T* C_s, const T* D_s) {
    zero(X);
    zero(Y);
#pragma unroll(ROLLED ? 1 : HEAD_DIM / 16)
    for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
        unsigned a[4], c[4];
        load_a<HEAD_DIM>(a, A_s, ks);
        load_a<HEAD_DIM>(c, C_s, ks);
        mma_abt_step<T, HEAD_DIM, COLS>(X, a, B_s, ks);
        mma_abt_step<T, HEAD_DIM, COLS>(Y, c, D_s, ks);
    }
}

// acc[mt] += X[mt] B_s for each of the warp's M row tiles: X[mt] 16 rows x K columns (C fragments,
// rounded to T), B_s K rows of HEAD_DIM (the B operand transposed by ldmatrix; each ldmatrix_x4_trans
// feeds 2 M mma). acc[mt]: COLS / 8 C fragments, of B_s's columns 8 chunk0 .. 8 chunk0 + COLS - 1: all
// HEAD_DIM by default, a part where a CTA computes some of the output's columns (flash_bwd_tc.cu's
// TC_COLUMN_PARTS).
template <typename T, int HEAD_DIM, int K, int M, int COLS = HEAD_DIM>
__device__ __forceinline__ void mma_ab(float (&acc)[M][COLS / 8][4], const float (&X)[M][K / 8][4],
                                       const T* B_s, int chunk0 = 0) {
    static_assert(COLS % 16 == 0 && COLS <= HEAD_DIM, "whole ldmatrix_x4_trans pairs of 8-column tiles");
    const int lane = threadIdx.x % WARP_SIZE;
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
        unsigned x[M][4];
#pragma unroll
        for (int mt = 0; mt < M; ++mt) c_to_a<T>(x[mt], X[mt][2 * kk], X[mt][2 * kk + 1]);
#pragma unroll
        for (int dt = 0; dt < COLS / 8; dt += 2) {
            unsigned b[4];
            ldmatrix_x4_trans(b, B_s + swizzled<HEAD_DIM>(16 * kk + lane % 16, chunk0 + dt + lane / 16));
#pragma unroll
            for (int mt = 0; mt < M; ++mt) {
                mma_m16n8k16<T>(acc[mt][dt], x[mt], b, acc[mt][dt]);
                mma_m16n8k16<T>(acc[mt][dt + 1], x[mt], b + 2, acc[mt][dt + 1]);
            }
        }
    }
}

// The same for one row tile (16 rows).
template <typename T, int HEAD_DIM, int K, int COLS = HEAD_DIM>
__device__ __forceinline__ void mma_ab(float (&acc)[COLS / 8][4], const float (&X)[K / 8][4], const T* B_s,
                                       int chunk0 = 0) {
    mma_ab<T, HEAD_DIM, K, 1, COLS>(reinterpret_cast<float(&)[1][COLS / 8][4]>(acc),
                                    reinterpret_cast<const float(&)[1][K / 8][4]>(X), B_s, chunk0);
}

// The forward's online softmax of one key block for row r (0 or 1) of the lane's two rows of a warp's
// 16, in base 2: the row's scores in S (-inf where masked) become P, m[r] and l[r] move to the new
// running max and sum, and the factor alpha that O's row must be rescaled by is returned. Row r of the
// lane is S[.][2 r] and S[.][2 r + 1], spread over the 4 lanes of a quad. Used by flash_fwd_tc.cu and
// flash_fwd_sm90.cu, whose wgmma accumulators have the mma.sync C layout per warp; the latter rescales
// O later, once the wgmma still adding into it has completed.
template <int N_TILES>
__device__ __forceinline__ float online_softmax_row(float (&S)[N_TILES][4], float (&m)[2], float (&l)[2], int r,
                                                    float scale_log2) {
    float row_max = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < N_TILES; ++nt) row_max = fmaxf(row_max, fmaxf(S[nt][2 * r], S[nt][2 * r + 1]));
    const float m_new = fmaxf(m[r], group_max<4>(row_max) * scale_log2);
    const float m_safe = m_new == -INFINITY ? 0.0f : m_new;  // no key seen yet: 2^-inf = 0, not NaN
    const float alpha = ex2_approx(m[r] - m_safe);
    m[r] = m_new;
    float row_sum = 0.0f;
#pragma unroll
    for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
        for (int c = 2 * r; c < 2 * r + 2; ++c) {
            S[nt][c] = ex2_approx(S[nt][c] * scale_log2 - m_safe);
            row_sum += S[nt][c];
        }
    l[r] = alpha * l[r] + row_sum;
    return alpha;
}

// Row r of the lane's O times alpha
template <int D_TILES>
__device__ __forceinline__ void rescale_row(float (&O)[D_TILES][4], int r, float alpha) {
#pragma unroll
    for (int dt = 0; dt < D_TILES; ++dt) {
        O[dt][2 * r] *= alpha;
        O[dt][2 * r + 1] *= alpha;
    }
}

// The online softmax of one key block for both of the lane's rows, O rescaled at once
template <int N_TILES, int D_TILES>
__device__ __forceinline__ void online_softmax(float (&S)[N_TILES][4], float (&m)[2], float (&l)[2],
                                               float (&O)[D_TILES][4], float scale_log2) {
#pragma unroll
    for (int r = 0; r < 2; ++r) rescale_row(O, r, online_softmax_row(S, m, l, r, scale_log2));
}

// Store the lane's rows row_g and row_g + 8 of acc (those < seqlen; columns < head_dim), row r times
// factor[r], in T (or float: a split-KV partial out).
template <int HEAD_DIM, typename T>
__device__ __forceinline__ void store_fragments(const Rows<T>& dst, const float (&acc)[HEAD_DIM / 8][4],
                                                const float (&factor)[2], int row_g, int seqlen, int head_dim) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = row_g + 8 * r;
        if (row >= seqlen) continue;
#pragma unroll
        for (int dt = 0; dt < HEAD_DIM / 8; ++dt) {
            const int col = 8 * dt + c_col(0);
            if (col >= head_dim) continue;
            if constexpr (sizeof(T) == 4) {
                dst.at(row, col) = acc[dt][2 * r] * factor[r];
                dst.at(row, col + 1) = acc[dt][2 * r + 1] * factor[r];
            } else {
                *reinterpret_cast<unsigned*>(&dst.at(row, col)) =
                    pack2<T>(acc[dt][2 * r] * factor[r], acc[dt][2 * r + 1] * factor[r]);
            }
        }
    }
}

// Store the warp's 16 rows of acc, row r times factor[r], to dst rows row_w .. row_w + 15 (those <
// seqlen; columns < head_dim) in T, through stage: the warp's own 16 rows of a swizzled tile that no
// other warp reads any more. The fragments' 4-byte pieces land in shared memory (8 rows x 16 bytes an
// instruction, conflict-free through the swizzle), then each store instruction writes 32 consecutive
// 4-byte words of out, whole 32-byte sectors: stored straight from the fragments, each instruction
// touched 8 rows and twice the sectors (python -m flashcupy kernels --counters).
template <int HEAD_DIM, typename T>
__device__ __forceinline__ void store_fragments_staged(const Rows<T>& dst, const float (&acc)[HEAD_DIM / 8][4],
                                                       const float (&factor)[2], T* stage, int row_w, int seqlen,
                                                       int head_dim) {
    static_assert(sizeof(T) == 2, "two elements a 4-byte word");
    constexpr int WORDS = HEAD_DIM / 2;  // a row's words
    const int lane = threadIdx.x % WARP_SIZE;
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int dt = 0; dt < HEAD_DIM / 8; ++dt)
            *reinterpret_cast<unsigned*>(stage + swizzled<HEAD_DIM>(c_row(2 * r), dt) + c_col(0)) =
                pack2<T>(acc[dt][2 * r] * factor[r], acc[dt][2 * r + 1] * factor[r]);
    __syncwarp();  // the warp's rows are whole in stage
#pragma unroll
    for (int e = lane; e < 16 * WORDS; e += WARP_SIZE) {
        const int row = e / WORDS, col = 2 * (e % WORDS);
        if (row_w + row < seqlen && col < head_dim)
            *reinterpret_cast<unsigned*>(&dst.at(row_w + row, col)) =
                *reinterpret_cast<const unsigned*>(stage + swizzled<HEAD_DIM>(row, col / 8) + col % 8);
    }
}
