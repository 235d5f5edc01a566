// flash_bwd.cu: FlashAttention-2 backward on CUDA cores (SIMT, no tensor cores), three kernels.
//
// P is recomputed from Q, K and the forward's lse: P = exp(scale Q Kᵀ - lse), so nothing of size
// seqlen_q x seqlen_k is stored. A row with lse = -inf saw no key: its P is 0, its gradients 0.
//
// 1. flash_bwd_preprocess (flash_bwd_common.cuh, shared with the tensor-core backward):
//    D_i = rowsum(dO_i ∘ O_i), one warp per query row, into a float (double for float64)
//    workspace of shape (batch, heads_q, seqlen_q). No shared memory.
//
// 2. flash_bwd_dkdv: one CTA per (key block j, batch * heads_kv); K_j, V_j (BLOCK_N keys) stay in
//    shared memory while the query blocks Q_i (BLOCK_M rows) of every query head in the GQA group
//    that can see key block j stream past:
//        Sᵀ = K_j (scale Q_i)ᵀ;   Pᵀ = exp(Sᵀ - lse_i);   dPᵀ = V_j dO_iᵀ;   dSᵀ = Pᵀ ∘ (dPᵀ - D_i)
//        dV_j += Pᵀ dO_i;         dK_j += dSᵀ (scale Q_i)
//    Warp w owns keys w R .. w R + R - 1 (R = BLOCK_N / 4) and their dK_j, dV_j rows in registers;
//    for Sᵀ and dPᵀ, lane owns query c = lane % BLOCK_M of Q_i.
//    Shared memory: K_s, V_s  BLOCK_N x HEAD_DIM each;  Q_s (pre-scaled), dO_s  BLOCK_M x HEAD_DIM
//    each; total 2 (BLOCK_N + BLOCK_M) HEAD_DIM sizeof(Acc) <= 48 KiB.
//
// 3. flash_bwd_dq: one CTA per (query block i, batch * heads_q); Q_i, dO_i stay in shared memory
//    while the key blocks that Q_i can see stream past:
//        S = (scale Q_i) K_jᵀ;   P = exp(S - lse_i);   dP = dO_i V_jᵀ;   dS = P ∘ (dP - D_i)
//        dQ_i += scale dS K_j
//    Warp w owns query rows w R .. w R + R - 1 (R = BLOCK_M / 4), their dQ_i rows, lse_i and D_i in
//    registers; for S and dP, lane owns key c = lane % BLOCK_N of K_j.
//    Shared memory: Q_s (pre-scaled), dO_s  BLOCK_M x HEAD_DIM each;  K_s, V_s  BLOCK_N x HEAD_DIM
//    each; total 2 (BLOCK_M + BLOCK_N) HEAD_DIM sizeof(Acc) <= 48 KiB.
//
// dQ gets its own kernel so that every output element is written by exactly one thread: no
// atomics, and the result is bitwise reproducible. The price is computing S and dP twice.
// Tile tables: BACKWARD_DQ_TILES and BACKWARD_DKDV_TILES in flashcupy/backends/cupy_backend/specs.py.

#include "flash_bwd_common.cuh"

template <typename T, typename Acc, int HEAD_DIM, int BLOCK_M, int BLOCK_N>
__global__ void __launch_bounds__(NUM_THREADS, MIN_CTAS_PER_SM) flash_bwd_dkdv(
    const T* __restrict__ q, index_t q_sb, index_t q_ss, index_t q_sh, index_t q_sd,
    const T* __restrict__ k, index_t k_sb, index_t k_ss, index_t k_sh, index_t k_sd,
    const T* __restrict__ v, index_t v_sb, index_t v_ss, index_t v_sh, index_t v_sd,
    const T* __restrict__ dout, index_t do_sb, index_t do_ss, index_t do_sh, index_t do_sd,
    const Acc* __restrict__ lse, index_t lse_sb, index_t lse_sh, index_t lse_ss,
    const Acc* __restrict__ Dvec,
    T* __restrict__ dk, index_t dk_sb, index_t dk_ss, index_t dk_sh, index_t dk_sd,
    T* __restrict__ dv, index_t dv_sb, index_t dv_ss, index_t dv_sh, index_t dv_sd,
    int seqlen_q, int seqlen_k, int heads_q, int group, int head_dim, Acc scale, int causal) {
    static_assert(BLOCK_N % NUM_WARPS == 0, "every warp owns the same number of keys");
    static_assert(is_pow2(HEAD_DIM) && HEAD_DIM >= WARP_SIZE, "HEAD_DIM must be a power of two >= 32");
    static_assert(2 * (BLOCK_N + BLOCK_M) * HEAD_DIM * sizeof(Acc) <= SMEM_LIMIT, "tiles exceed 48 KiB");
    constexpr int R = BLOCK_N / NUM_WARPS;
    constexpr int COLS_PER_LANE = HEAD_DIM / WARP_SIZE;

    __shared__ Acc K_s[BLOCK_N * HEAD_DIM];
    __shared__ Acc V_s[BLOCK_N * HEAD_DIM];
    __shared__ Acc Q_s[BLOCK_M * HEAD_DIM];
    __shared__ Acc dO_s[BLOCK_M * HEAD_DIM];

    const int heads_kv = heads_q / group;
    const int num_blocks = (seqlen_k + BLOCK_N - 1) / BLOCK_N;
    const int bg = blockIdx.x / num_blocks;
    const int j0 = (blockIdx.x % num_blocks) * BLOCK_N;
    const int b = bg / heads_kv, g = bg % heads_kv;
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int key0 = j0 + warp * R;       // this warp's first key
    const int query = lane % BLOCK_M;     // this lane's query row within Q_i

    const Rows<const T> K = head_rows(k, k_sb, k_ss, k_sh, k_sd, b, g);
    const Rows<const T> V = head_rows(v, v_sb, v_ss, v_sh, v_sd, b, g);
    // the first query row that can see key j0
    const int i_start = causal ? max(0, j0 - (seqlen_k - seqlen_q)) : 0;

    load_tile<BLOCK_N, HEAD_DIM>(K_s, K, j0, seqlen_k, head_dim, Acc(1));
    load_tile<BLOCK_N, HEAD_DIM>(V_s, V, j0, seqlen_k, head_dim, Acc(1));

    Acc dK[R][COLS_PER_LANE], dV[R][COLS_PER_LANE];
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int t = 0; t < COLS_PER_LANE; ++t) dK[r][t] = dV[r][t] = Acc(0);
    }

    for (int h = g * group; h < (g + 1) * group; ++h) {
        const Rows<const T> Q = head_rows(q, q_sb, q_ss, q_sh, q_sd, b, h);
        const Rows<const T> dO = head_rows(dout, do_sb, do_ss, do_sh, do_sd, b, h);
        const Acc* lse_row = lse + b * lse_sb + h * lse_sh;
        const Acc* D_row = Dvec + (index_t(b) * heads_q + h) * seqlen_q;
        for (int i0 = i_start; i0 < seqlen_q; i0 += BLOCK_M) {
            load_tile<BLOCK_M, HEAD_DIM>(Q_s, Q, i0, seqlen_q, head_dim, scale);
            load_tile<BLOCK_M, HEAD_DIM>(dO_s, dO, i0, seqlen_q, head_dim, Acc(1));
            const int i = i0 + query;
            const Acc lse_i = lse_for_p(lse_row, lse_ss, i, seqlen_q);
            const Acc D_i = i < seqlen_q ? D_row[i] : Acc(0);
            __syncthreads();  // Q_i, dO_i (and, on the first pass, K_j, V_j) are in shared memory for every warp

            Acc S[R], dP[R];
            row_dots<R, BLOCK_M, HEAD_DIM>(S, K_s + warp * R * HEAD_DIM, Q_s);
            row_dots<R, BLOCK_M, HEAD_DIM>(dP, V_s + warp * R * HEAD_DIM, dO_s);
            // S becomes Pᵀ, dP becomes dSᵀ
#pragma unroll
            for (int r = 0; r < R; ++r) {
                S[r] = visible(i, key0 + r, seqlen_q, seqlen_k, causal) ? acc_exp(S[r] - lse_i) : Acc(0);
                dP[r] = S[r] * (dP[r] - D_i);
            }
            accumulate<R, BLOCK_M, HEAD_DIM>(dV, S, dO_s);
            accumulate<R, BLOCK_M, HEAD_DIM>(dK, dP, Q_s);
            __syncthreads();  // every warp is done reading Q_i, dO_i before the next pass overwrites them
        }
    }

    store_rows<R, HEAD_DIM>(head_rows(dk, dk_sb, dk_ss, dk_sh, dk_sd, b, g), dK, key0, seqlen_k, head_dim);
    store_rows<R, HEAD_DIM>(head_rows(dv, dv_sb, dv_ss, dv_sh, dv_sd, b, g), dV, key0, seqlen_k, head_dim);
}

template <typename T, typename Acc, int HEAD_DIM, int BLOCK_M, int BLOCK_N>
__global__ void __launch_bounds__(NUM_THREADS, MIN_CTAS_PER_SM) flash_bwd_dq(
    const T* __restrict__ q, index_t q_sb, index_t q_ss, index_t q_sh, index_t q_sd,
    const T* __restrict__ k, index_t k_sb, index_t k_ss, index_t k_sh, index_t k_sd,
    const T* __restrict__ v, index_t v_sb, index_t v_ss, index_t v_sh, index_t v_sd,
    const T* __restrict__ dout, index_t do_sb, index_t do_ss, index_t do_sh, index_t do_sd,
    const Acc* __restrict__ lse, index_t lse_sb, index_t lse_sh, index_t lse_ss,
    const Acc* __restrict__ Dvec,
    T* __restrict__ dq, index_t dq_sb, index_t dq_ss, index_t dq_sh, index_t dq_sd,
    int seqlen_q, int seqlen_k, int heads_q, int group, int head_dim, Acc scale, int causal) {
    static_assert(BLOCK_M % NUM_WARPS == 0, "every warp owns the same number of query rows");
    static_assert(is_pow2(HEAD_DIM) && HEAD_DIM >= WARP_SIZE, "HEAD_DIM must be a power of two >= 32");
    static_assert(2 * (BLOCK_M + BLOCK_N) * HEAD_DIM * sizeof(Acc) <= SMEM_LIMIT, "tiles exceed 48 KiB");
    constexpr int R = BLOCK_M / NUM_WARPS;
    constexpr int COLS_PER_LANE = HEAD_DIM / WARP_SIZE;

    __shared__ Acc Q_s[BLOCK_M * HEAD_DIM];
    __shared__ Acc dO_s[BLOCK_M * HEAD_DIM];
    __shared__ Acc K_s[BLOCK_N * HEAD_DIM];
    __shared__ Acc V_s[BLOCK_N * HEAD_DIM];

    const int num_blocks = (seqlen_q + BLOCK_M - 1) / BLOCK_M;
    const int bh = blockIdx.x / num_blocks;
    const int i0 = (num_blocks - 1 - blockIdx.x % num_blocks) * BLOCK_M;
    const int b = bh / heads_q, h = bh % heads_q, g = h / group;
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int row0 = i0 + warp * R;       // this warp's first query row
    const int key = lane % BLOCK_N;       // this lane's key within K_j

    const Rows<const T> K = head_rows(k, k_sb, k_ss, k_sh, k_sd, b, g);
    const Rows<const T> V = head_rows(v, v_sb, v_ss, v_sh, v_sd, b, g);
    const Acc* lse_row = lse + b * lse_sb + h * lse_sh;
    const Acc* D_row = Dvec + (index_t(b) * heads_q + h) * seqlen_q;

    const int last_row = min(i0 + BLOCK_M, seqlen_q) - 1;
    const int key_end = causal ? max(0, min(seqlen_k, last_row + 1 + seqlen_k - seqlen_q)) : seqlen_k;

    load_tile<BLOCK_M, HEAD_DIM>(Q_s, head_rows(q, q_sb, q_ss, q_sh, q_sd, b, h), i0, seqlen_q, head_dim, scale);
    load_tile<BLOCK_M, HEAD_DIM>(dO_s, head_rows(dout, do_sb, do_ss, do_sh, do_sd, b, h), i0, seqlen_q,
                                 head_dim, Acc(1));

    Acc lse_r[R], D_r[R], dQ[R][COLS_PER_LANE];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        lse_r[r] = lse_for_p(lse_row, lse_ss, row0 + r, seqlen_q);
        D_r[r] = row0 + r < seqlen_q ? D_row[row0 + r] : Acc(0);
#pragma unroll
        for (int t = 0; t < COLS_PER_LANE; ++t) dQ[r][t] = Acc(0);
    }

    for (int j0 = 0; j0 < key_end; j0 += BLOCK_N) {
        load_tile<BLOCK_N, HEAD_DIM>(K_s, K, j0, seqlen_k, head_dim, Acc(1));
        load_tile<BLOCK_N, HEAD_DIM>(V_s, V, j0, seqlen_k, head_dim, Acc(1));
        __syncthreads();  // K_j, V_j (and, on the first pass, Q_i, dO_i) are in shared memory for every warp

        Acc S[R], dP[R];
        row_dots<R, BLOCK_N, HEAD_DIM>(S, Q_s + warp * R * HEAD_DIM, K_s);
        row_dots<R, BLOCK_N, HEAD_DIM>(dP, dO_s + warp * R * HEAD_DIM, V_s);
        // dP becomes dS
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const Acc P = visible(row0 + r, j0 + key, seqlen_q, seqlen_k, causal) ? acc_exp(S[r] - lse_r[r]) : Acc(0);
            dP[r] = P * (dP[r] - D_r[r]);
        }
        accumulate<R, BLOCK_N, HEAD_DIM>(dQ, dP, K_s);
        __syncthreads();  // every warp is done reading K_j, V_j before the next pass overwrites them
    }

#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int t = 0; t < COLS_PER_LANE; ++t) dQ[r][t] *= scale;
    }
    store_rows<R, HEAD_DIM>(head_rows(dq, dq_sb, dq_ss, dq_sh, dq_sd, b, h), dQ, row0, seqlen_q, head_dim);
}
