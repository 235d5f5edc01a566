// attn_bwd_tc.cu: FlashAttention backward on tensor cores (mma.sync m16n8k16), float16 and bfloat16.
//
// The same maths as flash_bwd.cu, with P recomputed from the forward's lse (natural log), in base 2:
//     P = 2^(S c - lse log2 e),  c = scale log2 e;   dP = dO Vᵀ;   dS = P ∘ (dP - D),  D = rowsum(dO ∘ O)
//     dV = Pᵀ dO;   dK = scale dSᵀ Q;   dQ = scale dS K
// A row with lse = -inf saw no key: its P is 0, so are its dS and its dQ. Causal is bottom-right
// aligned (query i sees key j iff j <= i + seqlen_k - seqlen_q); blocks that no pair of rows can
// see are never loaded, and only blocks that cross the diagonal or the end of the keys are masked
// element by element. Three kernels, launched in this order:
//
// 1. flash_bwd_preprocess (flash_bwd_common.cuh, the SIMT one): D into a float workspace.
//
// 2. attn_bwd_dkdv_tc: one CTA per (key block j, batch * heads_kv), key blocks on x. K_j, V_j
//    (BLOCK_N = 64 keys) stay in shared memory while the query blocks Q_i (BLOCK_M rows) of every
//    query head of the GQA group that can see key block j stream past, double-buffered by cp.async
//    (a "pass" is one (query head, query block)):
//        Sᵀ = K_j Q_iᵀ;  dPᵀ = V_j dO_iᵀ;  Pᵀ = 2^(Sᵀ c - lse_i log2 e);  dSᵀ = Pᵀ ∘ (dPᵀ - D_i)
//        dV_j += Pᵀ dO_i;  dK_j += dSᵀ Q_i                    (dK_j times scale once, at the end)
//    Sᵀ, not S, is computed, so that each warp owns keys: warp w holds keys 16 w .. 16 w + 15, the
//    rows of Sᵀ, dPᵀ and of its dK_j, dV_j accumulators (no reduction between warps). Per pass and
//    warp, in registers (fragment layouts in tensor_core.cuh; lane holds rows g = lane / 4 and g + 8
//    of its 16, and columns 2 t, 2 t + 1 of each 8-column tile, t = lane % 4):
//        Sᵀ, dPᵀ  BLOCK_M / 8 C fragments each (fp32): 16 keys x BLOCK_M queries; then Pᵀ, dSᵀ in place
//        dK, dV   HEAD_DIM / 8 C fragments each (fp32), kept across passes
//    The operands, each one ldmatrix from a swizzled tile:
//        Sᵀ = K_j Q_iᵀ     A: K_j rows (ldmatrix_x4)             B = Q_iᵀ: Q_i rows (ldmatrix_x4)
//        dPᵀ = V_j dO_iᵀ   A: V_j rows (ldmatrix_x4)             B = dO_iᵀ: dO_i rows (ldmatrix_x4)
//        dV += Pᵀ dO_i     A: Pᵀ from the Sᵀ C fragments (pack2) B = dO_i: dO_i rows (ldmatrix_x4_trans)
//        dK += dSᵀ Q_i     A: dSᵀ from the dPᵀ C fragments       B = Q_i: Q_i rows (ldmatrix_x4_trans)
//    (two C fragments of 8 queries are the A fragment of one 16-query k-step, as P in attn_fwd_tc.cu).
//    lse_i and D_i are per query, so per column of Sᵀ: they come from shared memory, lse_i already
//    times log2 e and +inf where P must be 0 (rows that saw no key, rows past seqlen_q).
//
// 3. attn_bwd_dq_tc: one CTA per (query block i, batch * heads_q), last query blocks first. Q_i,
//    dO_i (BLOCK_M = 64 rows) stay in shared memory while the key blocks K_j, V_j (BLOCK_N keys)
//    that Q_i can see stream past, double-buffered by cp.async:
//        S = Q_i K_jᵀ;  dP = dO_i V_jᵀ;  P = 2^(S c - lse_i log2 e);  dS = P ∘ (dP - D_i);  dQ_i += dS K_j
//    Warp w owns query rows 16 w .. 16 w + 15, their lse_i, D_i (registers) and dQ_i (HEAD_DIM / 8
//    C fragments, fp32; times scale at the end). S, dP: BLOCK_N / 8 C fragments each.
//        S = Q_i K_jᵀ      A: Q_i rows (ldmatrix_x4)             B = K_jᵀ: K_j rows (ldmatrix_x4)
//        dP = dO_i V_jᵀ    A: dO_i rows (ldmatrix_x4)            B = V_jᵀ: V_j rows (ldmatrix_x4)
//        dQ += dS K_j      A: dS from the dP C fragments (pack2) B = K_j: K_j rows (ldmatrix_x4_trans)
//    dQ gets its own kernel, like flash_bwd_dq: every output element is written by one thread, no
//    atomics, bitwise reproducible; the price is computing S and dP a second time.
//
// The A operands of the first two products (K_j, V_j in dK/dV; Q_i, dO_i in dQ) are read from
// shared memory at every k-step rather than kept in registers: one ldmatrix_x4 per k-step, shared
// by the BLOCK_M / 8 (BLOCK_N / 8) mmas of that step, and it leaves the registers to the fp32
// accumulators (for HEAD_DIM 128, dK and dV alone are 128 registers a thread).
//
// Shared memory (dynamic), T (2 bytes) tiles of HEAD_DIM elements a row, swizzled (tc_tile.cuh):
//     dK/dV:  K_s, V_s        BLOCK_N x HEAD_DIM each       K_j, V_j; loaded once
//             Q_s, dO_s       2 x BLOCK_M x HEAD_DIM each   Q_i, dO_i of this pass and the next
//             stats_s         2 x 2 x BLOCK_M floats        lse_i log2 e and D_i, per stage
//             total (2 BLOCK_N + 4 BLOCK_M) HEAD_DIM 2 + 16 BLOCK_M bytes:
//             HEAD_DIM 64 (64 x 64 tiles): (128 + 256) 64 2 + 1024 = 49 KiB;
//             HEAD_DIM 128 (BLOCK_M 32):   (128 + 128) 128 2 + 512 = 64.5 KiB
//     dQ:     Q_s, dO_s       BLOCK_M x HEAD_DIM each       Q_i, dO_i; loaded once
//             K_s, V_s        2 x BLOCK_N x HEAD_DIM each   K_j, V_j of this pass and the next
//             total (2 BLOCK_M + 4 BLOCK_N) HEAD_DIM 2 bytes: HEAD_DIM 64 (64 x 64): 48 KiB;
//             HEAD_DIM 128 (64 x 32): 64 KiB
//     Above 48 KiB the launcher raises max_dynamic_shared_size_bytes (sm_80+). The tiles per head
//     dim are two tables, TC_BACKWARD_DKDV_TILES and TC_BACKWARD_DQ_TILES, in specs.py.
//
// Barriers, the same two per pass in both kernels, as in attn_fwd_tc.cu: one after the cp.async
// wait (the other threads' copies of this pass's stage, and in dK/dV the lse_i, D_i they stored,
// have landed), one at the end of the pass (no warp still reads the stage that the next pass's
// prefetch, or its lse_i, D_i, overwrites). Each pass commits one cp.async group, empty on the
// last pass, so that one wait_group 1 always completes this pass's stage. tests/test_tensor_core.py
// shows each barrier and wait missing under the emulator.
//
// Registers (ptxas, NVRTC 12.9, tests/test_tensor_core.py; sm_80 / sm_90, no spills):
//     dK/dV HEAD_DIM 64: 232 / 223;  HEAD_DIM 128: 238 / 240;  128 HMMA.16816 a pass
//     dQ    HEAD_DIM 64: 243 / 240;  HEAD_DIM 128: 233 / 224;   96 HMMA.16816 a pass
// Every loop over a tile is unrolled and ptxas hoists the ldmatrix of whole k-loops ahead of their
// mmas, so it takes what __launch_bounds__(NUM_THREADS) allows: 2 CTAs (8 warps) an SM by
// registers. Asking for 3 CTAs (168 registers) spills, HEAD_DIM 128 dK/dV most (380 bytes).
//
// Requirements on the arguments, checked by the launcher (as for attn_fwd_tc): head_dim a multiple
// of 8 and at most HEAD_DIM (columns past head_dim are zero-filled); q, k, v, dout and the outputs
// contiguous in head_dim, every row 16-byte aligned (pointers and the other strides multiples of 8
// elements). lse may have any strides. Rows past seqlen are zero-filled and never written.
//
// Template parameters: T (__half or __nv_bfloat16), HEAD_DIM (64 or 128: the padded head dim),
// BLOCK_M, BLOCK_N: dK/dV BLOCK_N = 16 NUM_WARPS = 64 and BLOCK_M a multiple of 16 (at most 64);
// dQ BLOCK_M = 64 and BLOCK_N a multiple of 16.

#include "flash_bwd_common.cuh"
#include "tc_tile.cuh"

// acc (16 x 8 C fragments, fp32) = 0
template <int TILES>
__device__ __forceinline__ void zero(float (&acc)[TILES][4]) {
#pragma unroll
    for (int nt = 0; nt < TILES; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[nt][i] = 0.0f;
}

// The A fragment of k-step kk from the C fragments of 8-column tiles 2 kk and 2 kk + 1, in T.
template <typename T>
__device__ __forceinline__ void c_to_a(unsigned a[4], const float c0[4], const float c1[4]) {
    a[0] = pack2<T>(c0[0], c0[1]);
    a[1] = pack2<T>(c0[2], c0[3]);
    a[2] = pack2<T>(c1[0], c1[1]);
    a[3] = pack2<T>(c1[2], c1[3]);
}

// X = A_s B_sᵀ and Y = C_s D_sᵀ for one warp: A_s, C_s the warp's 16 rows (A operands), B_s, D_s
// COLS rows each (B operands, as stored); X, Y: COLS / 8 C fragments each.
template <typename T, int HEAD_DIM, int COLS>
__device__ __forceinline__ void two_mma_abt(float (&X)[COLS / 8][4], float (&Y)[COLS / 8][4], const T* A_s,
                                            const T* B_s, const T* C_s, const T* D_s) {
    const int lane = threadIdx.x % WARP_SIZE;
    zero(X);
    zero(Y);
#pragma unroll
    for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
        unsigned A_frag[4], C_frag[4];
        ldmatrix_x4(A_frag, A_s + swizzled<HEAD_DIM>(lane % 16, 2 * ks + lane / 16));
        ldmatrix_x4(C_frag, C_s + swizzled<HEAD_DIM>(lane % 16, 2 * ks + lane / 16));
#pragma unroll
        for (int nt = 0; nt < COLS / 8; nt += 2) {
            unsigned B_frag[4], D_frag[4];
            const int row = 8 * nt + lane % 8 + 8 * (lane / 16), chunk = 2 * ks + lane / 8 % 2;
            ldmatrix_x4(B_frag, B_s + swizzled<HEAD_DIM>(row, chunk));
            ldmatrix_x4(D_frag, D_s + swizzled<HEAD_DIM>(row, chunk));
            mma_m16n8k16<T>(X[nt], A_frag, B_frag, X[nt]);
            mma_m16n8k16<T>(X[nt + 1], A_frag, B_frag + 2, X[nt + 1]);
            mma_m16n8k16<T>(Y[nt], C_frag, D_frag, Y[nt]);
            mma_m16n8k16<T>(Y[nt + 1], C_frag, D_frag + 2, Y[nt + 1]);
        }
    }
}

// acc += X B_s for one warp: X the C fragments (fp32) of the warp's 16 rows x K columns, rounded to
// T; B_s K rows of HEAD_DIM (B operand, transposed by ldmatrix). acc: HEAD_DIM / 8 C fragments.
template <typename T, int HEAD_DIM, int K>
__device__ __forceinline__ void mma_ab(float (&acc)[HEAD_DIM / 8][4], const float (&X)[K / 8][4], const T* B_s) {
    const int lane = threadIdx.x % WARP_SIZE;
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
        unsigned X_frag[4];
        c_to_a<T>(X_frag, X[2 * kk], X[2 * kk + 1]);
#pragma unroll
        for (int dt = 0; dt < HEAD_DIM / 8; dt += 2) {
            unsigned B_frag[4];
            ldmatrix_x4_trans(B_frag, B_s + swizzled<HEAD_DIM>(16 * kk + lane % 16, dt + lane / 16));
            mma_m16n8k16<T>(acc[dt], X_frag, B_frag, acc[dt]);
            mma_m16n8k16<T>(acc[dt + 1], X_frag, B_frag + 2, acc[dt + 1]);
        }
    }
}

// Store rows row_g and row_g + 8 (those < seqlen) of the C fragments acc, times `factor`, in T.
template <int HEAD_DIM, typename T>
__device__ __forceinline__ void store_fragments(const Rows<T>& dst, const float (&acc)[HEAD_DIM / 8][4], float factor,
                                                int row_g, int seqlen, int head_dim) {
    const int t = threadIdx.x % 4;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = row_g + 8 * r;
        if (row >= seqlen) continue;
#pragma unroll
        for (int dt = 0; dt < HEAD_DIM / 8; ++dt) {
            const int col = 8 * dt + 2 * t;
            if (col < head_dim)
                *reinterpret_cast<unsigned*>(&dst.at(row, col)) =
                    pack2<T>(acc[dt][2 * r] * factor, acc[dt][2 * r + 1] * factor);
        }
    }
}

template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N>
__global__ void __launch_bounds__(NUM_THREADS) attn_bwd_dkdv_tc(
    const T* __restrict__ q, index_t q_sb, index_t q_ss, index_t q_sh, index_t q_sd,
    const T* __restrict__ k, index_t k_sb, index_t k_ss, index_t k_sh, index_t k_sd,
    const T* __restrict__ v, index_t v_sb, index_t v_ss, index_t v_sh, index_t v_sd,
    const T* __restrict__ dout, index_t do_sb, index_t do_ss, index_t do_sh, index_t do_sd,
    const float* __restrict__ lse, index_t lse_sb, index_t lse_sh, index_t lse_ss,
    const float* __restrict__ Dvec,
    T* __restrict__ dk, index_t dk_sb, index_t dk_ss, index_t dk_sh, index_t dk_sd,
    T* __restrict__ dv, index_t dv_sb, index_t dv_ss, index_t dv_sh, index_t dv_sd,
    int seqlen_q, int seqlen_k, int heads_q, int group, int head_dim, float scale, int causal) {
    static_assert(BLOCK_N == 16 * NUM_WARPS, "each warp owns 16 keys: one mma row tile of Sᵀ");
    static_assert(BLOCK_M % 16 == 0 && 2 * BLOCK_M <= NUM_THREADS, "BLOCK_M: whole k-steps, one thread a statistic");
    static_assert(HEAD_DIM % 16 == 0 && HEAD_DIM >= 64, "the swizzle needs 8 chunks of 16 bytes a row");
    constexpr int D_TILES = HEAD_DIM / 8;
    constexpr int M_TILES = BLOCK_M / 8;  // 8-query column tiles of Sᵀ
    constexpr int Q_TILE = BLOCK_M * HEAD_DIM;

    extern __shared__ __align__(16) unsigned char smem[];
    T* K_s = reinterpret_cast<T*>(smem);
    T* V_s = K_s + BLOCK_N * HEAD_DIM;
    T* Q_s = V_s + BLOCK_N * HEAD_DIM;
    T* dO_s = Q_s + 2 * Q_TILE;
    float* stats_s = reinterpret_cast<float*>(dO_s + 2 * Q_TILE);  // per stage: lse_i log2 e, then D_i

    const int heads_kv = heads_q / group;
    const int num_blocks = (seqlen_k + BLOCK_N - 1) / BLOCK_N;
    const int bg = blockIdx.x / num_blocks;
    const int j0 = (blockIdx.x % num_blocks) * BLOCK_N;
    const int b = bg / heads_kv, kv_head = bg % heads_kv;
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int t = lane % 4;
    const int key_g = j0 + 16 * warp + lane / 4;  // this lane's keys: key_g and key_g + 8

    const Rows<const T> K = head_rows(k, k_sb, k_ss, k_sh, k_sd, b, kv_head);
    const Rows<const T> V = head_rows(v, v_sb, v_ss, v_sh, v_sd, b, kv_head);

    // the query blocks that see key block j: from the first row that sees key j0, in every head of the group
    const int diagonal = seqlen_k - seqlen_q;
    const int i_start = causal ? max(0, j0 - diagonal) : 0;
    const int q_blocks = i_start < seqlen_q ? (seqlen_q - i_start + BLOCK_M - 1) / BLOCK_M : 0;
    const int passes = group * q_blocks;

    // cp.async Q_i, dO_i of pass p into its stage (not committed); thread x < 2 BLOCK_M returns the
    // statistic it stores for that pass: lse log2 e (+inf where P = 0) of row x, or D of row x - BLOCK_M
    auto prefetch = [&](int p) {
        const int h = kv_head * group + p / q_blocks, i0 = i_start + p % q_blocks * BLOCK_M;
        const int stage = p & 1;
        load_tile_async<BLOCK_M, HEAD_DIM>(Q_s + stage * Q_TILE, head_rows(q, q_sb, q_ss, q_sh, q_sd, b, h), i0,
                                           seqlen_q, head_dim);
        load_tile_async<BLOCK_M, HEAD_DIM>(dO_s + stage * Q_TILE, head_rows(dout, do_sb, do_ss, do_sh, do_sd, b, h),
                                           i0, seqlen_q, head_dim);
        const int i = i0 + threadIdx.x % BLOCK_M;
        if (threadIdx.x < BLOCK_M) return lse_for_p(lse + b * lse_sb + h * lse_sh, lse_ss, i, seqlen_q) * LOG2E;
        return i < seqlen_q ? Dvec[(index_t(b) * heads_q + h) * seqlen_q + i] : 0.0f;
    };
    auto store_stat = [&](int p, float stat) {
        if (threadIdx.x < 2 * BLOCK_M) stats_s[(p & 1) * 2 * BLOCK_M + threadIdx.x] = stat;
    };

    // group 0: K_j, V_j and pass 0
    if (passes > 0) {
        load_tile_async<BLOCK_N, HEAD_DIM>(K_s, K, j0, seqlen_k, head_dim);
        load_tile_async<BLOCK_N, HEAD_DIM>(V_s, V, j0, seqlen_k, head_dim);
        store_stat(0, prefetch(0));
        cp_async_commit();
    }

    const float scale_log2 = scale * LOG2E;
    float dK[D_TILES][4], dV[D_TILES][4];
    zero(dK);
    zero(dV);

    for (int p = 0; p < passes; ++p) {
        const int i0 = i_start + p % q_blocks * BLOCK_M;
        const T* Q_i = Q_s + (p & 1) * Q_TILE;
        const T* dO_i = dO_s + (p & 1) * Q_TILE;
        const float* lse_i = stats_s + (p & 1) * 2 * BLOCK_M;
        const float* D_i = lse_i + BLOCK_M;
        float next_stat = 0.0f;
        if (p + 1 < passes) next_stat = prefetch(p + 1);  // into the other stage
        cp_async_commit();
        cp_async_wait<1>();  // this thread's copies of pass p have landed (K_j, V_j, Q_i, dO_i)
        __syncthreads();  // ... and every thread's, with the lse_i, D_i they stored: the stage is whole

        // Sᵀ = K_j Q_iᵀ and dPᵀ = V_j dO_iᵀ: the warp's 16 keys x BLOCK_M queries
        float S[M_TILES][4], dP[M_TILES][4];
        two_mma_abt<T, HEAD_DIM, BLOCK_M>(S, dP, K_s + 16 * warp * HEAD_DIM, Q_i, V_s + 16 * warp * HEAD_DIM, dO_i);

        // mask keys past seqlen_k and above the diagonal, in the blocks that have any
        const bool edge = j0 + BLOCK_N > seqlen_k || (causal && j0 + BLOCK_N - 1 > i0 + diagonal);
        // Sᵀ becomes Pᵀ, dPᵀ becomes dSᵀ. Element i of tile nt: key key_g + 8 (i >> 1), query
        // 8 nt + 2 t + (i & 1) of Q_i.
#pragma unroll
        for (int nt = 0; nt < M_TILES; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int key = key_g + 8 * (i >> 1), query = 8 * nt + 2 * t + (i & 1);
                const bool masked = edge && (key >= seqlen_k || (causal && key > i0 + query + diagonal));
                const float P = masked ? 0.0f : ex2_approx(S[nt][i] * scale_log2 - lse_i[query]);
                S[nt][i] = P;
                dP[nt][i] = P * (dP[nt][i] - D_i[query]);
            }

        mma_ab<T, HEAD_DIM, BLOCK_M>(dV, S, dO_i);
        mma_ab<T, HEAD_DIM, BLOCK_M>(dK, dP, Q_i);
        if (p + 1 < passes) store_stat(p + 1, next_stat);  // into the stage no warp reads in this pass
        __syncthreads();  // every warp is done with this Q_i, dO_i, lse_i, D_i: the next prefetch overwrites them
    }

    store_fragments<HEAD_DIM>(head_rows(dk, dk_sb, dk_ss, dk_sh, dk_sd, b, kv_head), dK, scale, key_g, seqlen_k,
                              head_dim);
    store_fragments<HEAD_DIM>(head_rows(dv, dv_sb, dv_ss, dv_sh, dv_sd, b, kv_head), dV, 1.0f, key_g, seqlen_k,
                              head_dim);
}

template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N>
__global__ void __launch_bounds__(NUM_THREADS) attn_bwd_dq_tc(
    const T* __restrict__ q, index_t q_sb, index_t q_ss, index_t q_sh, index_t q_sd,
    const T* __restrict__ k, index_t k_sb, index_t k_ss, index_t k_sh, index_t k_sd,
    const T* __restrict__ v, index_t v_sb, index_t v_ss, index_t v_sh, index_t v_sd,
    const T* __restrict__ dout, index_t do_sb, index_t do_ss, index_t do_sh, index_t do_sd,
    const float* __restrict__ lse, index_t lse_sb, index_t lse_sh, index_t lse_ss,
    const float* __restrict__ Dvec,
    T* __restrict__ dq, index_t dq_sb, index_t dq_ss, index_t dq_sh, index_t dq_sd,
    int seqlen_q, int seqlen_k, int heads_q, int group, int head_dim, float scale, int causal) {
    static_assert(BLOCK_M == 16 * NUM_WARPS, "each warp owns 16 query rows: one mma row tile");
    static_assert(BLOCK_N % 16 == 0, "BLOCK_N is a whole number of dS K_j k-steps");
    static_assert(HEAD_DIM % 16 == 0 && HEAD_DIM >= 64, "the swizzle needs 8 chunks of 16 bytes a row");
    constexpr int D_TILES = HEAD_DIM / 8;
    constexpr int N_TILES = BLOCK_N / 8;  // 8-key column tiles of S
    constexpr int KV_TILE = BLOCK_N * HEAD_DIM;

    extern __shared__ __align__(16) unsigned char smem[];
    T* Q_s = reinterpret_cast<T*>(smem);
    T* dO_s = Q_s + BLOCK_M * HEAD_DIM;
    T* K_s = dO_s + BLOCK_M * HEAD_DIM;
    T* V_s = K_s + 2 * KV_TILE;

    const int num_blocks = (seqlen_q + BLOCK_M - 1) / BLOCK_M;
    const int bh = blockIdx.x / num_blocks;
    const int i0 = (num_blocks - 1 - blockIdx.x % num_blocks) * BLOCK_M;
    const int b = bh / heads_q, h = bh % heads_q, kv_head = h / group;
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int t = lane % 4;
    const int row_g = i0 + 16 * warp + lane / 4;  // this lane's rows: row_g and row_g + 8

    const Rows<const T> K = head_rows(k, k_sb, k_ss, k_sh, k_sd, b, kv_head);
    const Rows<const T> V = head_rows(v, v_sb, v_ss, v_sh, v_sd, b, kv_head);

    // one past the last key that the last row of Q_i can see
    const int diagonal = seqlen_k - seqlen_q;
    const int last_row = min(i0 + BLOCK_M, seqlen_q) - 1;
    const int key_end = causal ? max(0, min(seqlen_k, last_row + 1 + diagonal)) : seqlen_k;
    const int kv_blocks = (key_end + BLOCK_N - 1) / BLOCK_N;

    // group 0: Q_i, dO_i, K_0, V_0
    if (kv_blocks > 0) {
        load_tile_async<BLOCK_M, HEAD_DIM>(Q_s, head_rows(q, q_sb, q_ss, q_sh, q_sd, b, h), i0, seqlen_q, head_dim);
        load_tile_async<BLOCK_M, HEAD_DIM>(dO_s, head_rows(dout, do_sb, do_ss, do_sh, do_sd, b, h), i0, seqlen_q,
                                           head_dim);
        load_tile_async<BLOCK_N, HEAD_DIM>(K_s, K, 0, seqlen_k, head_dim);
        load_tile_async<BLOCK_N, HEAD_DIM>(V_s, V, 0, seqlen_k, head_dim);
        cp_async_commit();
    }

    // lse log2 e (+inf where P = 0) and D of this lane's two rows
    float lse_r[2], D_r[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = row_g + 8 * r;
        lse_r[r] = lse_for_p(lse + b * lse_sb + h * lse_sh, lse_ss, row, seqlen_q) * LOG2E;
        D_r[r] = row < seqlen_q ? Dvec[(index_t(b) * heads_q + h) * seqlen_q + row] : 0.0f;
    }
    const float scale_log2 = scale * LOG2E;
    float dQ[D_TILES][4];
    zero(dQ);

    for (int jb = 0; jb < kv_blocks; ++jb) {
        const int j0 = jb * BLOCK_N;
        const T* K_j = K_s + (jb & 1) * KV_TILE;
        const T* V_j = V_s + (jb & 1) * KV_TILE;
        if (jb + 1 < kv_blocks) {  // prefetch K_{j+1}, V_{j+1} into the other stage
            load_tile_async<BLOCK_N, HEAD_DIM>(K_s + ((jb + 1) & 1) * KV_TILE, K, j0 + BLOCK_N, seqlen_k, head_dim);
            load_tile_async<BLOCK_N, HEAD_DIM>(V_s + ((jb + 1) & 1) * KV_TILE, V, j0 + BLOCK_N, seqlen_k, head_dim);
        }
        cp_async_commit();
        cp_async_wait<1>();  // this thread's copies of K_j, V_j (and Q_i, dO_i) have landed
        __syncthreads();  // ... and every thread's: the tiles are whole for every warp

        // S = Q_i K_jᵀ and dP = dO_i V_jᵀ: the warp's 16 rows x BLOCK_N keys
        float S[N_TILES][4], dP[N_TILES][4];
        two_mma_abt<T, HEAD_DIM, BLOCK_N>(S, dP, Q_s + 16 * warp * HEAD_DIM, K_j, dO_s + 16 * warp * HEAD_DIM, V_j);

        // mask keys past seqlen_k and above the diagonal, in the blocks that have any
        const bool edge = j0 + BLOCK_N > seqlen_k || (causal && j0 + BLOCK_N - 1 > i0 + diagonal);
        // dP becomes dS. Element i of tile nt: row row_g + 8 (i >> 1), key j0 + 8 nt + 2 t + (i & 1).
#pragma unroll
        for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int r = i >> 1, key = j0 + 8 * nt + 2 * t + (i & 1);
                const bool masked = edge && (key >= seqlen_k || (causal && key > row_g + 8 * r + diagonal));
                const float P = masked ? 0.0f : ex2_approx(S[nt][i] * scale_log2 - lse_r[r]);
                dP[nt][i] = P * (dP[nt][i] - D_r[r]);
            }

        mma_ab<T, HEAD_DIM, BLOCK_N>(dQ, dP, K_j);
        __syncthreads();  // every warp is done with K_j, V_j before the next prefetch overwrites them
    }

    store_fragments<HEAD_DIM>(head_rows(dq, dq_sb, dq_ss, dq_sh, dq_sd, b, h), dQ, scale, row_g, seqlen_q,
                              head_dim);
}
