// flash_fwd.cu: FlashAttention forward on CUDA cores (SIMT, no tensor cores).
//
// For one query block Q_i (BLOCK_M rows) of one (batch, query head), with m = -inf, l = 0, O = 0:
//     for each key block K_j, V_j (BLOCK_N keys) that some row of Q_i can see:
//         S = (scale Q_i) K_jᵀ          -inf where the key is past seqlen_k or above the causal diagonal
//         m_new = max(m, rowmax S);  P = exp(S - m_new);  alpha = exp(m - m_new)
//         l = alpha l + rowsum P;    O = alpha O + P V_j
//     out_i = O / l,  lse_i = m + log l  (natural log); a row that saw no key: out 0, lse -inf.
// Causal is bottom-right aligned (query i sees key j iff j <= i + seqlen_k - seqlen_q); key
// blocks past the last one that Q_i can see are never loaded.
//
// Grid: one CTA per (query block, batch * heads_q), flattened on x. The query blocks of one head
// are adjacent, so its K and V stay in L2; the last query blocks (the longest when causal) go first.
// CTA: NUM_WARPS = 4 warps. Warp w owns query rows w R .. w R + R - 1 (R = BLOCK_M / 4) and keeps
// their m, l (in every lane) and O (lane owns head-dim columns lane, lane + 32, ...) in registers.
// For S, lane owns key c = lane % BLOCK_N of K_j (see row_dots in flash_common.cuh).
//
// Shared memory, in Acc (float, or double for float64 inputs):
//     Q_s   BLOCK_M x HEAD_DIM    the query block, multiplied by scale on the way in
//     K_s   BLOCK_N x HEAD_DIM    the current key block
//     V_s   BLOCK_N x HEAD_DIM    the current value block
//     total (BLOCK_M + 2 BLOCK_N) HEAD_DIM sizeof(Acc) <= 48 KiB, e.g. float, HEAD_DIM 128,
//     BLOCK_M = BLOCK_N = 32: (32 + 64) * 128 * 4 = 48 KiB. The tile table is FORWARD_TILES in
//     flashcupy/backends/cupy_backend/specs.py.
//
// Template parameters: T storage type, Acc accumulation type, HEAD_DIM the padded head dim
// (32, 64, 128 or 256; the true head_dim is a runtime bound), BLOCK_M, BLOCK_N the tile.

#include "flash_common.cuh"

template <typename T, typename Acc, int HEAD_DIM, int BLOCK_M, int BLOCK_N>
__global__ void __launch_bounds__(NUM_THREADS, MIN_CTAS_PER_SM) flash_fwd(
    const T* __restrict__ q, index_t q_sb, index_t q_ss, index_t q_sh, index_t q_sd,
    const T* __restrict__ k, index_t k_sb, index_t k_ss, index_t k_sh, index_t k_sd,
    const T* __restrict__ v, index_t v_sb, index_t v_ss, index_t v_sh, index_t v_sd,
    T* __restrict__ out, index_t o_sb, index_t o_ss, index_t o_sh, index_t o_sd,
    Acc* __restrict__ lse, index_t lse_sb, index_t lse_sh, index_t lse_ss,
    int seqlen_q, int seqlen_k, int heads_q, int group, int head_dim, Acc scale, int causal) {
    static_assert(BLOCK_M % NUM_WARPS == 0, "every warp owns the same number of query rows");
    static_assert(is_pow2(HEAD_DIM) && HEAD_DIM >= WARP_SIZE, "HEAD_DIM must be a power of two >= 32");
    static_assert((BLOCK_M + 2 * BLOCK_N) * HEAD_DIM * sizeof(Acc) <= SMEM_LIMIT, "tiles exceed 48 KiB");
    constexpr int R = BLOCK_M / NUM_WARPS;
    constexpr int COLS_PER_LANE = HEAD_DIM / WARP_SIZE;

    __shared__ Acc Q_s[BLOCK_M * HEAD_DIM];
    __shared__ Acc K_s[BLOCK_N * HEAD_DIM];
    __shared__ Acc V_s[BLOCK_N * HEAD_DIM];

    const int num_blocks = (seqlen_q + BLOCK_M - 1) / BLOCK_M;
    const int bh = blockIdx.x / num_blocks;
    const int i0 = (num_blocks - 1 - blockIdx.x % num_blocks) * BLOCK_M;
    const int b = bh / heads_q, h = bh % heads_q, g = h / group;
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int row0 = i0 + warp * R;       // this warp's first query row
    const int key = lane % BLOCK_N;       // this lane's key within K_j

    const Rows<const T> Q = head_rows(q, q_sb, q_ss, q_sh, q_sd, b, h);
    const Rows<const T> K = head_rows(k, k_sb, k_ss, k_sh, k_sd, b, g);
    const Rows<const T> V = head_rows(v, v_sb, v_ss, v_sh, v_sd, b, g);
    const Rows<T> Out = head_rows(out, o_sb, o_ss, o_sh, o_sd, b, h);

    // one past the last key that the last row of Q_i can see
    const int last_row = min(i0 + BLOCK_M, seqlen_q) - 1;
    const int key_end = causal ? max(0, min(seqlen_k, last_row + 1 + seqlen_k - seqlen_q)) : seqlen_k;

    load_tile<BLOCK_M, HEAD_DIM>(Q_s, Q, i0, seqlen_q, head_dim, scale);

    Acc m[R], l[R], O[R][COLS_PER_LANE];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        m[r] = -INFINITY;
        l[r] = Acc(0);
#pragma unroll
        for (int t = 0; t < COLS_PER_LANE; ++t) O[r][t] = Acc(0);
    }

    for (int j0 = 0; j0 < key_end; j0 += BLOCK_N) {
        load_tile<BLOCK_N, HEAD_DIM>(K_s, K, j0, seqlen_k, head_dim, Acc(1));
        load_tile<BLOCK_N, HEAD_DIM>(V_s, V, j0, seqlen_k, head_dim, Acc(1));
        __syncthreads();  // K_j, V_j (and, on the first pass, Q_i) are in shared memory for every warp

        Acc S[R];
        row_dots<R, BLOCK_N, HEAD_DIM>(S, Q_s + warp * R * HEAD_DIM, K_s);
        // online softmax; S becomes P
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (!visible(row0 + r, j0 + key, seqlen_q, seqlen_k, causal)) S[r] = -INFINITY;
            const Acc m_new = acc_max(m[r], group_max<BLOCK_N>(S[r]));
            const Acc m_ref = m_new == -INFINITY ? Acc(0) : m_new;  // no key seen yet: exp(-inf) = 0, not NaN
            const Acc alpha = acc_exp(m[r] - m_ref);
            S[r] = acc_exp(S[r] - m_ref);
            l[r] = alpha * l[r] + group_sum<BLOCK_N>(S[r]);
            m[r] = m_new;
#pragma unroll
            for (int t = 0; t < COLS_PER_LANE; ++t) O[r][t] *= alpha;
        }
        accumulate<R, BLOCK_N, HEAD_DIM>(O, S, V_s);
        __syncthreads();  // every warp is done reading K_j, V_j before the next pass overwrites them
    }

    // out = O / l and lse = m + log l; a row that saw no key (l == 0) gets out 0, lse -inf
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const Acc inv_l = l[r] == Acc(0) ? Acc(0) : Acc(1) / l[r];
#pragma unroll
        for (int t = 0; t < COLS_PER_LANE; ++t) O[r][t] *= inv_l;
        if (lane == 0 && row0 + r < seqlen_q)
            lse[b * lse_sb + h * lse_sh + (row0 + r) * lse_ss] = l[r] == Acc(0) ? -INFINITY : m[r] + acc_log(l[r]);
    }
    store_rows<R, HEAD_DIM>(Out, O, row0, seqlen_q, head_dim);
}
