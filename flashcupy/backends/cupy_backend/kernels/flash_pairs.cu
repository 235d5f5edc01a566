// flash_pairs.cu: the kernels whose output has an element per (query, key) pair, on CUDA cores
// (SIMT, every dtype; the tensor-core path uses them too). Both recompute the final score of a
// tile exactly as the forward did (mask.cuh's Mask and Score) and never hold more than a tile.
//
// 1. flash_probs (attention_probs): P[b, h, r, j] = exp(s_ij - lse_i) for the query rows i = rows[r]
//    that the caller asked for, 0 where the pair is hidden (or the row saw no key: lse = -inf).
//    One CTA per (block of BLOCK_M asked rows, key block, batch * heads_q; pair_tile in mask.cuh):
//    the rows are gathered into Q_s (pre-scaled), K_j into K_s, and S = Q_s K_jᵀ as in flash_fwd.cu (warp w owns rows
//    w R .. w R + R - 1, lane owns key c = lane % BLOCK_N). rows holds values in [0, seqlen_q),
//    checked on the host (_checks.check_rows) before it is copied to the device.
//    Shared memory: Q_s BLOCK_M x HEAD_DIM, K_s BLOCK_N x HEAD_DIM, in Acc.
//
// 2. flash_bwd_dbias: the bias's gradient, dS of the final score (before the softcap's derivative,
//    which acts before the bias is added): dS = P ∘ (dP - D), summed over the bias's broadcast
//    dimensions. One CTA per tile of dbias's own shape (pair_tile in mask.cuh; bias_batch,
//    bias_heads, bias_rows, bias_keys; each either the problem's size or 1): a block of BLOCK_M rows (all rows when
//    bias_rows = 1), a block of BLOCK_N keys (all keys when bias_keys = 1), one (batch, head) index
//    of the bias. It loops over every (batch, head, query block, key block) whose dS lands in its
//    tile, recomputing S = Q_i K_jᵀ and dP = dO_i V_jᵀ as flash_bwd_dq does, and adds dS into
//    registers (lane's key c of each of the warp's rows). At the end it sums over keys (bias_keys =
//    1: a shuffle tree over the lanes) and over rows (bias_rows = 1: each warp's rows, then the warps
//    through shared memory, in warp order), and stores each element once. No atomics, no workspace:
//    the result is bitwise reproducible, and the backward's extra memory is dbias itself. Key blocks
//    outside the band (Mask::key_start, key_end) are skipped.
//    The price: S and dP computed a third time (two GEMMs besides the backward's seven), and a bias
//    broadcast over everything runs in one CTA.
//    Shared memory: Q_s, dO_s BLOCK_M x HEAD_DIM; K_s, V_s BLOCK_N x HEAD_DIM, in Acc (the dQ tiles,
//    BACKWARD_DQ_TILES in specs.py); the row sum's NUM_WARPS x BLOCK_N partial sums reuse Q_s.
//
// Template parameters as flash_bwd.cu's: T, Acc, HEAD_DIM, BLOCK_M, BLOCK_N, MIN_CTAS, MODS.

#include "flash_bwd_common.cuh"
#include "mask.cuh"

// Q_s[r][d] = scale Q(rows[r0 + r], d), zero past num_rows and head_dim: the asked rows, gathered.
template <int ROWS, int HEAD_DIM, typename T, typename Acc>
__device__ __forceinline__ void load_rows(Acc* tile, const Rows<const T>& src, const long long* rows, int r0,
                                          int num_rows, int head_dim, Acc scale) {
    for (int e = threadIdx.x; e < ROWS * HEAD_DIM; e += NUM_THREADS) {
        const int r = e / HEAD_DIM, d = e % HEAD_DIM;
        tile[e] = (r0 + r < num_rows && d < head_dim) ? scale * to_acc(src.at(int(rows[r0 + r]), d)) : Acc(0);
    }
}

template <typename T, typename Acc, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int MIN_CTAS, int MODS = 0>
__global__ void __launch_bounds__(NUM_THREADS, MIN_CTAS) flash_probs(
    TENSOR_PARAMS(const T, q), TENSOR_PARAMS(const T, k), LSE_PARAMS(const Acc, lse), const long long* __restrict__ rows,
    int num_rows, Acc* __restrict__ P, index_t P_sb, index_t P_sh, index_t P_sr, index_t P_sk, PROBLEM_PARAMS(Acc)) {
    constexpr int R = rows_per_warp<BLOCK_M>();

    __shared__ Acc Q_s[BLOCK_M * HEAD_DIM], K_s[BLOCK_N * HEAD_DIM];
    static_assert(sizeof(Q_s) + sizeof(K_s) <= SMEM_LIMIT, "tiles exceed 48 KiB");

    const auto mask = MAKE_MASK(MODS);
    const int key_blocks = num_blocks(seqlen_k, BLOCK_N), row_blocks = num_blocks(num_rows, BLOCK_M);
    const PairTile tile = pair_tile<BLOCK_M, BLOCK_N>(key_blocks, row_blocks, heads_q);
    const int r0 = tile.r0, j0 = tile.j0, b = tile.b, h = tile.h;
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE, key = lane % BLOCK_N;

    load_rows<BLOCK_M, HEAD_DIM>(Q_s, HEAD_ROWS(q, b, h), rows, r0, num_rows, head_dim, scale);
    load_tile<BLOCK_N, HEAD_DIM>(K_s, HEAD_ROWS(k, b, h / group), j0, seqlen_k, head_dim, Acc(1));
    __syncthreads();  // Q_s and K_s are whole for every warp (one pass: no second barrier)

    Acc S[R];
    row_dots<R, BLOCK_N, HEAD_DIM>(S, Q_s + warp * R * HEAD_DIM, K_s);
    const auto score = MAKE_SCORE(T, Acc, MODS, b, h, Acc(1), Acc(1));
    const Stats<const Acc> lse_row = LSE_ROW(lse, b, h);
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int n = r0 + warp * R + r, j = j0 + key;  // the asked row and the key of this lane
        if (n >= num_rows || j >= seqlen_k || lane >= BLOCK_N) continue;  // lanes past BLOCK_N hold copies
        const int i = int(rows[n]);
        Acc t = Acc(0);
        const Acc s = final_score(score, S[r], i, j, t);
        P[b * P_sb + h * P_sh + n * P_sr + j * P_sk] = PAIR_SEEN(i, j) ? prob(s - lse_for_p(lse_row, i, seqlen_q)) : Acc(0);
    }
}

template <typename T, typename Acc, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int MIN_CTAS, int MODS>
__global__ void __launch_bounds__(NUM_THREADS, MIN_CTAS) flash_bwd_dbias(
    TENSOR_PARAMS(const T, q), TENSOR_PARAMS(const T, k), TENSOR_PARAMS(const T, v), TENSOR_PARAMS(const T, dout),
    LSE_PARAMS(const Acc, lse), const Acc* __restrict__ Dvec, void* __restrict__ dbias, index_t dbias_sb,
    index_t dbias_sh, index_t dbias_sq, index_t dbias_sk, int batch, int bias_batch, int bias_heads, int bias_rows,
    int bias_keys, PROBLEM_PARAMS(Acc)) {
    constexpr int R = rows_per_warp<BLOCK_M>();

    __shared__ Acc Q_s[BLOCK_M * HEAD_DIM], dO_s[BLOCK_M * HEAD_DIM];
    __shared__ Acc K_s[BLOCK_N * HEAD_DIM], V_s[BLOCK_N * HEAD_DIM];
    static_assert(sizeof(Q_s) + sizeof(dO_s) + sizeof(K_s) + sizeof(V_s) <= SMEM_LIMIT, "tiles exceed 48 KiB");
    static_assert(NUM_WARPS * BLOCK_N <= BLOCK_M * HEAD_DIM, "the row sum's red_s fits in Q_s");

    const auto mask = MAKE_MASK(MODS);
    const bool all_rows = bias_rows == 1, all_keys = bias_keys == 1;  // sum over every row, every key
    const int key_blocks = all_keys ? 1 : num_blocks(seqlen_k, BLOCK_N);
    const int row_blocks = all_rows ? 1 : num_blocks(seqlen_q, BLOCK_M);
    const PairTile tile = pair_tile<BLOCK_M, BLOCK_N>(key_blocks, row_blocks, bias_heads);
    const int bb = tile.b, bh = tile.h;  // the bias's batch and head indices (0 where it broadcasts)
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE, key = lane % BLOCK_N;

    // the members whose dS lands in this tile: a range of batches, heads, query blocks, key blocks
    const int b_first = bias_batch == 1 ? 0 : bb, b_last = bias_batch == 1 ? batch : bb + 1;
    const int h_first = bias_heads == 1 ? 0 : bh, h_last = bias_heads == 1 ? heads_q : bh + 1;
    const int i_first = all_rows ? 0 : tile.r0, i_last = all_rows ? seqlen_q : tile.r0 + 1;
    const int j_first = all_keys ? 0 : tile.j0, j_last = all_keys ? seqlen_k : tile.j0 + 1;

    Acc acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = Acc(0);

    for (int b = b_first; b < b_last; ++b) {
        for (int h = h_first; h < h_last; ++h) {
            const auto score = MAKE_SCORE(T, Acc, MODS, b, h, Acc(1), Acc(1));
            const auto drop = MAKE_DROPOUT(Acc, MODS, true, b, h);  // dS of the dropped weights' dP
            const Stats<const Acc> lse_row = LSE_ROW(lse, b, h), D_row = d_row(Dvec, heads_q, seqlen_q, b, h);
            for (int i0 = i_first; i0 < i_last; i0 += BLOCK_M) {
                const int j_start = max(j_first, mask.key_start(i0) / BLOCK_N * BLOCK_N);
                const int j_end = min(j_last, mask.key_end(i0));
                if (j_start >= j_end) continue;  // the band hides the whole row block from these keys
                // the previous pass ended with a barrier: no warp still reads Q_s, dO_s
                load_tile<BLOCK_M, HEAD_DIM>(Q_s, HEAD_ROWS(q, b, h), i0, seqlen_q, head_dim, scale);
                load_tile<BLOCK_M, HEAD_DIM>(dO_s, HEAD_ROWS(dout, b, h), i0, seqlen_q, head_dim_v, Acc(1));
                for (int j0 = j_start; j0 < j_end; j0 += BLOCK_N) {
                    load_tile<BLOCK_N, HEAD_DIM>(K_s, HEAD_ROWS(k, b, h / group), j0, seqlen_k, head_dim, Acc(1));
                    load_tile<BLOCK_N, HEAD_DIM>(V_s, HEAD_ROWS(v, b, h / group), j0, seqlen_k, head_dim_v, Acc(1));
                    __syncthreads();  // Q_i, dO_i, K_j, V_j are whole for every warp

                    Acc S[R], dP[R];
                    two_row_dots<R, BLOCK_N, HEAD_DIM>(S, dP, Q_s + warp * R * HEAD_DIM, K_s,
                                                      dO_s + warp * R * HEAD_DIM, V_s);
#pragma unroll
                    for (int r = 0; r < R; ++r) {
                        const int i = i0 + warp * R + r, j = j0 + key;
                        Acc t = Acc(0);
                        S[r] = final_score(score, S[r], i, j, t);
                        // selected, not P = 0 times dP: a NaN in the dO of a row that sees no key stays out
                        if (PAIR_SEEN(i, j) && i < seqlen_q)
                            acc[r] += final_ds(prob(S[r] - lse_for_p(lse_row, i, seqlen_q)), drop(dP[r], i, j),
                                               D_row[i]);
                    }
                    __syncthreads();  // every warp is done with the tiles before the next pass overwrites them
                }
            }
        }
    }

    // sum over the keys (lanes differing in key) and over the rows (the warp's, then the warps')
    if (all_keys) {
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] = group_sum<BLOCK_N>(acc[r]);
    }
    Acc total = Acc(0);
    if (all_rows) {
#pragma unroll
        for (int r = 0; r < R; ++r) total += acc[r];
        Acc* red_s = Q_s;  // free: the last pass ended with a barrier (or there was none and nobody read it)
        if (lane < BLOCK_N) red_s[warp * BLOCK_N + lane] = total;
        __syncthreads();  // every warp's row sums are in red_s
        total = Acc(0);
        for (int w = 0; w < NUM_WARPS; ++w) total += red_s[w * BLOCK_N + key];
    }

    // store: lanes past BLOCK_N hold copies; with all_keys only key 0, with all_rows only warp 0
    if (lane >= BLOCK_N || (all_keys && key != 0) || (all_rows && warp != 0)) return;
    const bool f32 = bias_f32 != 0;
#pragma unroll
    for (int r = 0; r < (all_rows ? 1 : R); ++r) {
        const int i = all_rows ? 0 : tile.r0 + warp * R + r, j = all_keys ? 0 : tile.j0 + key;
        if (i >= bias_rows || j >= bias_keys) continue;
        const index_t e = bb * dbias_sb + bh * dbias_sh + i * dbias_sq + j * dbias_sk;
        const Acc x = all_rows ? total : acc[r];
        if (f32)
            store(static_cast<float*>(dbias) + e, float(x));
        else
            store(static_cast<T*>(dbias) + e, x);
    }
}
