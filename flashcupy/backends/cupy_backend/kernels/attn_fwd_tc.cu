// attn_fwd_tc.cu: FlashAttention forward on tensor cores (mma.sync m16n8k16), float16 and bfloat16.
//
// The same maths as flash_fwd.cu, for one query block Q_i (BLOCK_M rows) of one (batch, query head):
//     for each key block K_j, V_j (BLOCK_N keys) that some row of Q_i can see:
//         S = Q_i K_jᵀ                  -inf where the key is past seqlen_k or above the causal diagonal
//         m_new = max(m, rowmax S · c)  with c = scale · log2(e): m, and the exponents, are in base 2
//         P = 2^(S · c - m_new);  alpha = 2^(m - m_new);  l = alpha l + rowsum P;  O = alpha O + P V_j
//     out_i = O / l,  lse_i = (m + log2 l) · ln 2  (natural log); a row that saw no key: out 0, lse -inf.
// Causal is bottom-right aligned (query i sees key j iff j <= i + seqlen_k - seqlen_q); key blocks
// that no row of Q_i can see are never loaded, and only blocks that cross the diagonal or the end
// of the keys are masked element by element.
//
// Grid: one CTA per (query block, batch * heads_q), flattened on x, last query blocks first (as
// flash_fwd). CTA: NUM_WARPS = 4 warps; warp w owns query rows 16 w .. 16 w + 15 of Q_i, so
// BLOCK_M = 64. In registers, per warp (fragment layouts in tensor_core.cuh; lane holds rows
// g = lane / 4 and g + 8 of its 16):
//     Q_frag  HEAD_DIM / 16 A fragments of its rows of Q_i, loaded once (ldmatrix_x4)
//     S       BLOCK_N / 8 C fragments: S = Q K_jᵀ, then P in place (fp32)
//     O       HEAD_DIM / 8 C fragments (fp32); m, l for the lane's two rows (l is the lane's
//             partial row sum, summed over the 4 lanes of a quad once, at the end)
// P goes from the S accumulators straight into the A operand of the P V mma (pack2: two fp32 ->
// one f16x2/bf16x2 register), never through shared memory. K_j is the B operand of Q K_jᵀ as it
// is stored (ldmatrix_x4); V_j is the B operand of P V_j transposed (ldmatrix_x4_trans).
//
// Shared memory, T (2 bytes), every tile row-major with HEAD_DIM elements a row, XOR-swizzled in
// 16-byte chunks (chunk c of row r is stored at chunk c ^ (r % 8): the 8 rows one ldmatrix reads
// hit 8 different 16-byte bank groups; tc_tile.cuh):
//     Q_s   BLOCK_M x HEAD_DIM        Q_i; read once, into registers
//     K_s   2 x BLOCK_N x HEAD_DIM    K_j and K_{j+1}: cp.async fills one stage while the
//     V_s   2 x BLOCK_N x HEAD_DIM    other is computed on (double buffering)
//     total (BLOCK_M + 4 BLOCK_N) HEAD_DIM 2 bytes: HEAD_DIM 64: (64 + 256) 64 2 = 40 KiB;
//     HEAD_DIM 128: 80 KiB (above 48 KiB: the launcher raises max_dynamic_shared_size_bytes).
// The tiles per head dim are one table, TC_FORWARD_TILES {HEAD_DIM: (BLOCK_M, BLOCK_N)}, in
// flashcupy/backends/cupy_backend/specs.py.
//
// Barriers: one after the cp.async wait of each pass (the other threads' copies of K_j, V_j, Q_i
// have landed), one at the end of each pass (no warp still reads the stage that the next pass's
// prefetch overwrites). The emulator shows each one missing (tests/test_tensor_core.py), the second
// only with warps skewed and cp.async landing at issue.
//
// ptxas: 64 / 128 HMMA.16816 per pass of the key loop; registers and spills under NVRTC 12 and 13:
// `python -m flashcupy kernels` (tests/test_nvrtc.py fails on a spill, or within 8 of 255 registers).
//
// Requirements on the arguments, checked by the launcher: head_dim a multiple of 8 and at most
// HEAD_DIM (columns past head_dim are zero-filled); q, k, v, out contiguous in head_dim (the *_sd
// strides are 1; they are kept so the argument list is flash_fwd's), every row 16-byte aligned
// (pointers and the other strides multiples of 8 elements). Rows past seqlen are zero-filled.
//
// Template parameters: T (__half or __nv_bfloat16), HEAD_DIM (64 or 128: the padded head dim),
// BLOCK_M (16 NUM_WARPS = 64), BLOCK_N (a multiple of 16).

#include "tc_tile.cuh"

template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N>
__global__ void __launch_bounds__(NUM_THREADS) attn_fwd_tc(
    const T* __restrict__ q, index_t q_sb, index_t q_ss, index_t q_sh, index_t q_sd,
    const T* __restrict__ k, index_t k_sb, index_t k_ss, index_t k_sh, index_t k_sd,
    const T* __restrict__ v, index_t v_sb, index_t v_ss, index_t v_sh, index_t v_sd,
    T* __restrict__ out, index_t o_sb, index_t o_ss, index_t o_sh, index_t o_sd,
    float* __restrict__ lse, index_t lse_sb, index_t lse_sh, index_t lse_ss,
    int seqlen_q, int seqlen_k, int heads_q, int group, int head_dim, float scale, int causal) {
    static_assert(BLOCK_M == 16 * NUM_WARPS, "each warp owns 16 query rows: one mma row tile");
    static_assert(BLOCK_N % 16 == 0, "BLOCK_N is a whole number of P V k-steps");
    static_assert(HEAD_DIM % 16 == 0 && HEAD_DIM >= 64, "the swizzle needs 8 chunks of 16 bytes a row");
    constexpr int N_TILES = BLOCK_N / 8;     // 8-key column tiles of S
    constexpr int D_TILES = HEAD_DIM / 8;    // 8-column tiles of O
    constexpr int QK_STEPS = HEAD_DIM / 16;  // k-steps of Q K_jᵀ
    constexpr int PV_STEPS = BLOCK_N / 16;   // k-steps of P V_j
    constexpr int KV_TILE = BLOCK_N * HEAD_DIM;

    extern __shared__ __align__(16) unsigned char smem[];
    T* Q_s = reinterpret_cast<T*>(smem);
    T* K_s = Q_s + BLOCK_M * HEAD_DIM;
    T* V_s = K_s + 2 * KV_TILE;

    const int num_blocks = (seqlen_q + BLOCK_M - 1) / BLOCK_M;
    const int bh = blockIdx.x / num_blocks;
    const int i0 = (num_blocks - 1 - blockIdx.x % num_blocks) * BLOCK_M;
    const int b = bh / heads_q, h = bh % heads_q, kv_head = h / group;
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int g = lane / 4, t = lane % 4;
    const int row_g = i0 + 16 * warp + g;  // this lane's rows: row_g and row_g + 8

    const Rows<const T> Q = head_rows(q, q_sb, q_ss, q_sh, q_sd, b, h);
    const Rows<const T> K = head_rows(k, k_sb, k_ss, k_sh, k_sd, b, kv_head);
    const Rows<const T> V = head_rows(v, v_sb, v_ss, v_sh, v_sd, b, kv_head);
    const Rows<T> Out = head_rows(out, o_sb, o_ss, o_sh, o_sd, b, h);

    // one past the last key that the last row of Q_i can see
    const int diagonal = seqlen_k - seqlen_q;
    const int last_row = min(i0 + BLOCK_M, seqlen_q) - 1;
    const int key_end = causal ? max(0, min(seqlen_k, last_row + 1 + diagonal)) : seqlen_k;
    const int kv_blocks = (key_end + BLOCK_N - 1) / BLOCK_N;

    // group 0: Q_i, K_0, V_0. A CTA whose rows see no key (causal, seqlen_q > seqlen_k) copies
    // nothing: it never waits, and copies still in flight when a CTA exits would land in shared
    // memory that the next CTA on the SM may already own.
    if (kv_blocks > 0) {
        load_tile_async<BLOCK_M, HEAD_DIM>(Q_s, Q, i0, seqlen_q, head_dim);
        load_tile_async<BLOCK_N, HEAD_DIM>(K_s, K, 0, seqlen_k, head_dim);
        load_tile_async<BLOCK_N, HEAD_DIM>(V_s, V, 0, seqlen_k, head_dim);
        cp_async_commit();
    }

    const float scale_log2 = scale * LOG2E;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    float O[D_TILES][4];
#pragma unroll
    for (int dt = 0; dt < D_TILES; ++dt)
#pragma unroll
        for (int i = 0; i < 4; ++i) O[dt][i] = 0.0f;
    unsigned Q_frag[QK_STEPS][4];

    for (int jb = 0; jb < kv_blocks; ++jb) {
        const int j0 = jb * BLOCK_N;
        const T* K_j = K_s + (jb & 1) * KV_TILE;
        const T* V_j = V_s + (jb & 1) * KV_TILE;
        if (jb + 1 < kv_blocks) {  // prefetch K_{j+1}, V_{j+1} into the other stage
            load_tile_async<BLOCK_N, HEAD_DIM>(K_s + ((jb + 1) & 1) * KV_TILE, K, j0 + BLOCK_N, seqlen_k, head_dim);
            load_tile_async<BLOCK_N, HEAD_DIM>(V_s + ((jb + 1) & 1) * KV_TILE, V, j0 + BLOCK_N, seqlen_k, head_dim);
            cp_async_commit();
            cp_async_wait<1>();  // this thread's copies of K_j, V_j (and Q_i) have landed
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();  // ... and every other thread's: K_j, V_j (and Q_i) are whole

        if (jb == 0) {
#pragma unroll
            for (int ks = 0; ks < QK_STEPS; ++ks)
                ldmatrix_x4(Q_frag[ks], Q_s + swizzled<HEAD_DIM>(16 * warp + lane % 16, 2 * ks + lane / 16));
        }

        // S = Q_i K_jᵀ: ldmatrix_x4 gives the B fragments of two 8-key tiles for one k-step
        float S[N_TILES][4];
#pragma unroll
        for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) S[nt][i] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < QK_STEPS; ++ks) {
#pragma unroll
            for (int nt = 0; nt < N_TILES; nt += 2) {
                unsigned K_frag[4];
                const int key = 8 * nt + lane % 8 + 8 * (lane / 16), chunk = 2 * ks + lane / 8 % 2;
                ldmatrix_x4(K_frag, K_j + swizzled<HEAD_DIM>(key, chunk));
                mma_m16n8k16<T>(S[nt], Q_frag[ks], K_frag, S[nt]);
                mma_m16n8k16<T>(S[nt + 1], Q_frag[ks], K_frag + 2, S[nt + 1]);
            }
        }

        // mask keys past seqlen_k and above the diagonal, in the blocks that have any
        if (j0 + BLOCK_N > seqlen_k || (causal && j0 + BLOCK_N - 1 > i0 + diagonal)) {
#pragma unroll
            for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int key = j0 + 8 * nt + 2 * t + (i & 1), row = row_g + 8 * (i >> 1);
                    if (key >= seqlen_k || (causal && key > row + diagonal)) S[nt][i] = -INFINITY;
                }
        }

        // online softmax, base 2; S becomes P. Row r's entries are S[.][2 r] and S[.][2 r + 1],
        // spread over the 4 lanes of a quad.
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float row_max = -INFINITY;
#pragma unroll
            for (int nt = 0; nt < N_TILES; ++nt) row_max = fmaxf(row_max, fmaxf(S[nt][2 * r], S[nt][2 * r + 1]));
            row_max = fmaxf(row_max, __shfl_xor_sync(FULL_MASK, row_max, 1));
            row_max = fmaxf(row_max, __shfl_xor_sync(FULL_MASK, row_max, 2));
            const float m_new = fmaxf(m[r], row_max * scale_log2);
            const float m_ref = m_new == -INFINITY ? 0.0f : m_new;  // no key seen yet: 2^-inf = 0, not NaN
            const float alpha = ex2_approx(m[r] - m_ref);
            m[r] = m_new;
            float row_sum = 0.0f;
#pragma unroll
            for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const float p = ex2_approx(S[nt][2 * r + c] * scale_log2 - m_ref);
                    S[nt][2 * r + c] = p;
                    row_sum += p;
                }
            l[r] = alpha * l[r] + row_sum;
#pragma unroll
            for (int dt = 0; dt < D_TILES; ++dt) {
                O[dt][2 * r] *= alpha;
                O[dt][2 * r + 1] *= alpha;
            }
        }

        // O += P V_j: the C fragments of two 8-key tiles of P are the A fragment of one k-step
#pragma unroll
        for (int kk = 0; kk < PV_STEPS; ++kk) {
            const unsigned P_frag[4] = {
                pack2<T>(S[2 * kk][0], S[2 * kk][1]), pack2<T>(S[2 * kk][2], S[2 * kk][3]),
                pack2<T>(S[2 * kk + 1][0], S[2 * kk + 1][1]), pack2<T>(S[2 * kk + 1][2], S[2 * kk + 1][3])};
#pragma unroll
            for (int dt = 0; dt < D_TILES; dt += 2) {
                unsigned V_frag[4];
                ldmatrix_x4_trans(V_frag, V_j + swizzled<HEAD_DIM>(16 * kk + lane % 16, dt + lane / 16));
                mma_m16n8k16<T>(O[dt], P_frag, V_frag, O[dt]);
                mma_m16n8k16<T>(O[dt + 1], P_frag, V_frag + 2, O[dt + 1]);
            }
        }
        __syncthreads();  // every warp is done with this stage before the next pass's prefetch overwrites it
    }

    // out = O / l and lse = (m + log2 l) ln 2; a row that saw no key (l == 0) gets out 0, lse -inf
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(FULL_MASK, l[r], 1);
        l[r] += __shfl_xor_sync(FULL_MASK, l[r], 2);
        const int row = row_g + 8 * r;
        if (row >= seqlen_q) continue;
        const float inv_l = l[r] == 0.0f ? 0.0f : 1.0f / l[r];
        if (t == 0)
            lse[b * lse_sb + h * lse_sh + row * lse_ss] = l[r] == 0.0f ? -INFINITY : m[r] * LN2 + logf(l[r]);
#pragma unroll
        for (int dt = 0; dt < D_TILES; ++dt) {
            const int col = 8 * dt + 2 * t;
            if (col < head_dim)
                *reinterpret_cast<unsigned*>(&Out.at(row, col)) =
                    pack2<T>(O[dt][2 * r] * inv_l, O[dt][2 * r + 1] * inv_l);
        }
    }
}
