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
// Score modifiers (mask.cuh, the MODS template parameter): S is modified in natural units before
// P is recomputed, and dS is multiplied by the softcap's derivative 1 - tanh^2 (Score::grad), as
// the forward did; the caller's bool mask hides pairs as the forward's did; with a window the Mask
// is the band, so query_start/query_end and key_start/key_end skip the blocks outside it. dbias, the
// bias's gradient, is dS before that derivative: flash_pairs.cu computes it after these kernels.
//
// dQ gets its own kernel so that every output element is written by exactly one thread: no
// atomics, and the result is bitwise reproducible. The price is computing S and dP twice.
// Tile tables: BACKWARD_DQ_TILES and BACKWARD_DKDV_TILES in flashcupy/backends/cupy_backend/specs.py.
// HEAD_DIM pads the larger of head_dim (Q_s, K_s, dK, dQ) and head_dim_v (V_s, dO_s, dV), as
// flash_fwd.cu's does: each tile is zero past its own.

#include "flash_bwd_common.cuh"
#include "mask.cuh"

template <typename T, typename Acc, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int MIN_CTAS, int MODS = 0,
          bool VARLEN = false>
__global__ void __launch_bounds__(NUM_THREADS, MIN_CTAS) flash_bwd_dkdv(
    TENSOR_PARAMS(const T, q), TENSOR_PARAMS(const T, k), TENSOR_PARAMS(const T, v), TENSOR_PARAMS(const T, dout),
    LSE_PARAMS(const Acc, lse), const Acc* __restrict__ Dvec, TENSOR_PARAMS(T, dk), TENSOR_PARAMS(T, dv),
    PROBLEM_PARAMS(Acc), VARLEN_PARAMS) {
    constexpr int R = rows_per_warp<BLOCK_N>();

    __shared__ Acc K_s[BLOCK_N * HEAD_DIM], V_s[BLOCK_N * HEAD_DIM];
    __shared__ Acc Q_s[BLOCK_M * HEAD_DIM], dO_s[BLOCK_M * HEAD_DIM];
    static_assert(sizeof(K_s) + sizeof(V_s) + sizeof(Q_s) + sizeof(dO_s) <= SMEM_LIMIT, "tiles exceed 48 KiB");

    DRows<const Acc, VARLEN> D{Dvec, heads_q, seqlen_q};
    BACKWARD_KEY_BLOCK(blk, D, AT_SEQUENCE_K(seq, dk), AT_SEQUENCE_K(seq, dv));
    const auto mask = MAKE_MASK(MODS);
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int key0 = blk.j0 + warp * R, query = lane % BLOCK_M;  // this warp's first key, this lane's row in Q_i

    load_tile<BLOCK_N, HEAD_DIM>(K_s, HEAD_ROWS(k, blk.b, blk.kv_head), blk.j0, seqlen_k, head_dim, Acc(1));
    load_tile<BLOCK_N, HEAD_DIM>(V_s, HEAD_ROWS(v, blk.b, blk.kv_head), blk.j0, seqlen_k, head_dim_v, Acc(1));

    Acc dK[R][HEAD_DIM / WARP_SIZE], dV[R][HEAD_DIM / WARP_SIZE];
    zero(dK);
    zero(dV);

    for (int h = blk.kv_head * group; h < (blk.kv_head + 1) * group; ++h) {
        const Rows<const T> Q = HEAD_ROWS(q, blk.b, h);
        const Rows<const T> dO = HEAD_ROWS(dout, blk.b, h);
        const Stats<const Acc> lse_row = LSE_ROW(lse, blk.b, h), D_row = D.row(blk.b, h);
        const auto score = MAKE_SCORE(T, Acc, MODS, blk.b, h, Acc(1), Acc(1));
        const auto drop = MAKE_DROPOUT(Acc, MODS, true, blk.b, h);
        for (int i0 = mask.query_start(blk.j0), i_end = mask.query_end(blk.j0); i0 < i_end; i0 += BLOCK_M) {
            load_tile<BLOCK_M, HEAD_DIM>(Q_s, Q, i0, seqlen_q, head_dim, scale);
            if constexpr ((MODS & MOD_MASK) != 0) {
                // A row the bool mask leaves no key (lse -inf) can lie inside these query blocks (the band
                // starts them at the first row that sees key block j): its dO reads as 0, so that P = 0
                // times a NaN in its dout reaches neither dV nor dK. load_tile's loop with that test, but
                // rolled: unrolled, its loads of lse spilled float64 kernels.
#pragma unroll 1
                for (int e = threadIdx.x; e < BLOCK_M * HEAD_DIM; e += NUM_THREADS) {
                    const int i = i0 + e / HEAD_DIM, d = e % HEAD_DIM;
                    dO_s[e] = i < seqlen_q && d < head_dim_v && lse_row[i] != Acc(-INFINITY) ? to_acc(dO.at(i, d))
                                                                                                  : Acc(0);
                }
            } else {
                load_tile<BLOCK_M, HEAD_DIM>(dO_s, dO, i0, seqlen_q, head_dim_v, Acc(1));
            }
            const int i = i0 + query;
            const Acc lse_i = lse_for_p(lse_row, i, seqlen_q);
            // that row's D_i (NaN from its dout) 0 as well, so that its dS = P (dP - D_i) is 0 (see dO_s above)
            const Acc D_i = i < seqlen_q && ((MODS & MOD_MASK) == 0 || lse_i != Acc(INFINITY)) ? D_row[i] : Acc(0);
            __syncthreads();  // Q_i, dO_i (and, on the first pass, K_j, V_j) are in shared memory for every warp

            Acc S[R], dP[R];
            two_row_dots<R, BLOCK_M, HEAD_DIM>(S, dP, K_s + warp * R * HEAD_DIM, Q_s, V_s + warp * R * HEAD_DIM, dO_s);
            // S becomes Pᵀ, dP becomes dSᵀ
#pragma unroll
            for (int r = 0; r < R; ++r) {
                Acc t = Acc(0);
                const Acc s = final_score(score, S[r], i, key0 + r, t);
                S[r] = PAIR_SEEN(i, key0 + r) ? prob(s - lse_i) : Acc(0);
                const Acc z = drop.factor(i, key0 + r);  // dropout: dP and, for dV, P of the dropped weights
                dP[r] = ds(score, S[r], drop.times(dP[r], z), D_i, t);
                S[r] = drop.times(S[r], z);
            }
            accumulate<R, BLOCK_M, HEAD_DIM>(dV, S, dO_s);
            accumulate<R, BLOCK_M, HEAD_DIM>(dK, dP, Q_s);
            __syncthreads();  // every warp is done reading Q_i, dO_i before the next pass overwrites them
        }
    }

    store_rows<R, HEAD_DIM>(HEAD_ROWS(dk, blk.b, blk.kv_head), dK, key0, seqlen_k, head_dim);
    store_rows<R, HEAD_DIM>(HEAD_ROWS(dv, blk.b, blk.kv_head), dV, key0, seqlen_k, head_dim_v);
}

template <typename T, typename Acc, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int MIN_CTAS, int MODS = 0,
          bool VARLEN = false>
__global__ void __launch_bounds__(NUM_THREADS, MIN_CTAS) flash_bwd_dq(
    TENSOR_PARAMS(const T, q), TENSOR_PARAMS(const T, k), TENSOR_PARAMS(const T, v), TENSOR_PARAMS(const T, dout),
    LSE_PARAMS(const Acc, lse), const Acc* __restrict__ Dvec, TENSOR_PARAMS(T, dq), PROBLEM_PARAMS(Acc),
    VARLEN_PARAMS) {
    constexpr int R = rows_per_warp<BLOCK_M>();

    __shared__ Acc Q_s[BLOCK_M * HEAD_DIM], dO_s[BLOCK_M * HEAD_DIM];
    __shared__ Acc K_s[BLOCK_N * HEAD_DIM], V_s[BLOCK_N * HEAD_DIM];
    static_assert(sizeof(Q_s) + sizeof(dO_s) + sizeof(K_s) + sizeof(V_s) <= SMEM_LIMIT, "tiles exceed 48 KiB");

    DRows<const Acc, VARLEN> D{Dvec, heads_q, seqlen_q};
    BACKWARD_QUERY_BLOCK(blk, D, AT_SEQUENCE_Q(seq, dq));
    const auto mask = MAKE_MASK(MODS);
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int row0 = blk.i0 + warp * R, key = lane % BLOCK_N;  // this warp's first query row, this lane's key in K_j

    const Rows<const T> K = HEAD_ROWS(k, blk.b, blk.kv_head), V = HEAD_ROWS(v, blk.b, blk.kv_head);
    load_tile<BLOCK_M, HEAD_DIM>(Q_s, HEAD_ROWS(q, blk.b, blk.h), blk.i0, seqlen_q, head_dim, scale);
    load_tile<BLOCK_M, HEAD_DIM>(dO_s, HEAD_ROWS(dout, blk.b, blk.h), blk.i0, seqlen_q, head_dim_v, Acc(1));

    const Stats<const Acc> lse_row = LSE_ROW(lse, blk.b, blk.h), D_row = D.row(blk.b, blk.h);
    const auto score = MAKE_SCORE(T, Acc, MODS, blk.b, blk.h, Acc(1), Acc(1));
    const auto drop = MAKE_DROPOUT(Acc, MODS, true, blk.b, blk.h);
    Acc dQ[R][HEAD_DIM / WARP_SIZE];
    zero(dQ);

    for (int j0 = mask.key_start(blk.i0), j_end = mask.key_end(blk.i0); j0 < j_end; j0 += BLOCK_N) {
        load_tile<BLOCK_N, HEAD_DIM>(K_s, K, j0, seqlen_k, head_dim, Acc(1));
        load_tile<BLOCK_N, HEAD_DIM>(V_s, V, j0, seqlen_k, head_dim_v, Acc(1));
        __syncthreads();  // K_j, V_j (and, on the first pass, Q_i, dO_i) are in shared memory for every warp

        Acc S[R], dP[R];
        two_row_dots<R, BLOCK_N, HEAD_DIM>(S, dP, Q_s + warp * R * HEAD_DIM, K_s, dO_s + warp * R * HEAD_DIM, V_s);
        // dP becomes dS. lse and D are read on every pass: held in registers across the loop, they made
        // ptxas spill float64 under the register cap of MIN_CTAS.
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int i = row0 + r;
            // a hidden pair's dS is 0 by selection, not P = 0 times dP: a row that sees no key gets dQ 0
            // whatever its dO holds (a NaN times 0 is NaN)
            const bool pair_seen = PAIR_SEEN(i, j0 + key);
            Acc t = Acc(0);
            S[r] = final_score(score, S[r], i, j0 + key, t);
            const Acc P = pair_seen ? prob(S[r] - lse_for_p(lse_row, i, seqlen_q)) : Acc(0);
            dP[r] = pair_seen ? ds(score, P, drop(dP[r], i, j0 + key), i < seqlen_q ? D_row[i] : Acc(0), t) : Acc(0);
        }
        accumulate<R, BLOCK_N, HEAD_DIM>(dQ, dP, K_s);
        __syncthreads();  // every warp is done reading K_j, V_j before the next pass overwrites them
    }

#pragma unroll
    for (int r = 0; r < R; ++r) scale_row(dQ[r], scale);
    store_rows<R, HEAD_DIM>(HEAD_ROWS(dq, blk.b, blk.h), dQ, row0, seqlen_q, head_dim);
}
