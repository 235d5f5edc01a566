// flash_fwd.cu: FlashAttention forward on CUDA cores (SIMT, no tensor cores).
//
// For one query block Q_i (BLOCK_M rows) of one (batch, query head), with m = -inf, l = 0, O = 0:
//     for each key block K_j, V_j (BLOCK_N keys) that some row of Q_i can see:
//         S = (scale Q_i) K_jᵀ          -inf where the query does not see the key (mask.cuh)
//         m_new = max(m, rowmax S);  P = exp(S - m_new);  alpha = exp(m - m_new)
//         l = alpha l + rowsum P;    O = alpha O + P V_j
//     out_i = O / l,  lse_i = m + log l  (natural log); a row that saw no key: out 0, lse -inf.
// Key blocks that no row of Q_i can see are never loaded.
//
// Grid: one CTA per (query block, batch * heads_q), flattened on x (query_block in mask.cuh); with
// VARLEN, a packed batch, total_q / BLOCK_M + num_seqs CTAs per query head, each finding its sequence
// and query block in the offsets (mask.cuh's Sequence), those past their sequence's blocks exiting.
// CTA: NUM_WARPS = 4 warps. Warp w owns query rows w R .. w R + R - 1 (R = BLOCK_M / 4) and keeps
// their m, l (in every lane) and O (lane owns head-dim columns lane, lane + 32, ...) in registers.
// For S, lane owns key c = lane % BLOCK_N of K_j (see row_dots in flash_common.cuh).
//
// Shared memory, in Acc (float, or double for float64 inputs):
//     Q_s   BLOCK_M x HEAD_DIM    the query block, multiplied by scale on the way in
//     K_s   BLOCK_N x HEAD_DIM    the current key block
//     V_s   BLOCK_N x HEAD_DIM    the current value block
//     total (BLOCK_M + 2 BLOCK_N) HEAD_DIM sizeof(Acc) <= 48 KiB (static_assert below). The tiles per
//     head dim are FORWARD_TILES in flashcupy/backends/cupy_backend/specs.py; `python -m flashcupy
//     kernels` prints each specialization's shared memory, registers and occupancy.
//
// Score modifiers (mask.cuh): with MOD_SOFTCAP, MOD_ALIBI or MOD_BIAS, S is modified (in natural
// units, as the scale is already in Q_s) before the mask, which MOD_MASK extends by the caller's bool
// mask; with MOD_WINDOW the Mask is the band, so key_start and key_end skip the key blocks outside it.
//
// Dropout (MOD_DROPOUT, mask.cuh's Dropout): P times Z / (1 - p) after l took its row sum, before P V_j.
//
// Split-KV (SPLIT, mask.cuh's Split): the grid is one copy per split of keys, each CTA attends to its
// split's keys only, and out is a partial one in Acc (split s at out + s out_split, its lse at lse +
// s lse_split), which flash_merge.cu merges.
//
// Varlen (VARLEN, mask.cuh's Sequence): q, k, v, out, lse are packed batches of num_seqs sequences
// (batch strides 0), seqlen_q and seqlen_k their total lengths; each CTA reads cu_seqlens_q and
// cu_seqlens_k, clamped into the arrays, and then runs as on its sequence alone (TAKE_SEQUENCE). The
// keys and values of a KV cache's sequence may be paged (PAGED_PARAMS: a block table, read per key row
// by flash_common.cuh's CacheRows, its page indices clamped into the cache).
//
// Template parameters: T storage type, Acc accumulation type, HEAD_DIM the padded head dim
// (32, 64, 128 or 256; the true head_dims are runtime bounds: head_dim q's and k's, head_dim_v v's and
// out's, HEAD_DIM padding the larger, each tile zero past its own), BLOCK_M, BLOCK_N the tile, MIN_CTAS the
// CTAs an SM ptxas leaves registers for (specs.py), MODS the score modifiers (mask.cuh; 0: none),
// SPLIT split-KV, VARLEN a packed batch.

#include "flash_common.cuh"
#include "mask.cuh"

// The online softmax of one key block for one of the warp's rows, as flash_fwd_tc.cu's for the
// lane's two: s (this lane's key's score, -inf where masked) becomes P; m and l move to the new
// running max and sum over the BLOCK_N lanes that hold the row's keys, and O_row is rescaled by alpha.
template <int BLOCK_N, typename Acc, int COLS>
__device__ __forceinline__ void online_softmax(Acc& s, Acc& m, Acc& l, Acc (&O_row)[COLS]) {
    const Acc m_new = acc_max(m, group_max<BLOCK_N>(s));
    const Acc m_safe = m_new == -INFINITY ? Acc(0) : m_new;  // no key seen yet: exp(-inf) = 0, not NaN
    const Acc alpha = acc_exp(m - m_safe);
    s = acc_exp(s - m_safe);
    l = alpha * l + group_sum<BLOCK_N>(s);
    m = m_new;
    scale_row(O_row, alpha);
}

template <typename T, typename Acc, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int MIN_CTAS, int MODS = 0,
          bool SPLIT = false, bool VARLEN = false>
__global__ void __launch_bounds__(NUM_THREADS, MIN_CTAS) flash_fwd(
    TENSOR_PARAMS(const T, q), TENSOR_PARAMS(const T, k), TENSOR_PARAMS(const T, v),
    SplitOut<SPLIT, T, Acc>* __restrict__ out, index_t out_sb, index_t out_ss, index_t out_sh, index_t out_sd,
    LSE_PARAMS(Acc, lse), PROBLEM_PARAMS(Acc), SPLIT_PARAMS, VARLEN_PARAMS, PAGED_PARAMS) {
    constexpr int R = rows_per_warp<BLOCK_M>();

    __shared__ Acc Q_s[BLOCK_M * HEAD_DIM];
    __shared__ Acc K_s[BLOCK_N * HEAD_DIM], V_s[BLOCK_N * HEAD_DIM];
    static_assert(sizeof(Q_s) + sizeof(K_s) + sizeof(V_s) <= SMEM_LIMIT, "tiles exceed 48 KiB");

    const Split split = split_of_cta<BLOCK_M, SPLIT, VARLEN>(seqlen_q, seqlen_k, key_split, num_seqs, heads_q);
    QueryBlock blk;
    if constexpr (VARLEN) {
        const Sequence seq = sequence_of<BLOCK_M>(VARLEN_ARGS, seqlen_q, seqlen_k, group, split.cta);
        if (seq.start < 0) return;  // past its sequence's query blocks: no work (the whole CTA)
        TAKE_SEQUENCE(seq);
        blk = {seq.start, seq.index, seq.h, seq.kv_head};
    } else {
        blk = query_block<BLOCK_M>(seqlen_q, heads_q, group, split.cta);
    }
    const auto mask = MAKE_MASK(MODS);
    const auto score = MAKE_SCORE(T, Acc, MODS, blk.b, blk.h, Acc(1), Acc(1));
    const auto drop = MAKE_DROPOUT(Acc, MODS, true, blk.b, blk.h);
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int row0 = blk.i0 + warp * R, key = lane % BLOCK_N;  // this warp's first query row, this lane's key in K_j

    const KeyRows<VARLEN, const T> K = KEY_ROWS(VARLEN, k, blk.b, blk.kv_head), V = KEY_ROWS(VARLEN, v, blk.b, blk.kv_head);
    // here: made after the key loop, it made ptxas spill
    const auto Out = head_rows(out + split.index * out_split, out_sb, out_ss, out_sh, out_sd, blk.b, blk.h);
    load_tile<BLOCK_M, HEAD_DIM>(Q_s, HEAD_ROWS(q, blk.b, blk.h), blk.i0, seqlen_q, head_dim, scale);

    Acc m[R], l[R], O[R][HEAD_DIM / WARP_SIZE];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        m[r] = -INFINITY;
        l[r] = Acc(0);
    }
    zero(O);

    int j_start = mask.key_start(blk.i0), j_end = mask.key_end(blk.i0);
    if constexpr (SPLIT) split_range<BLOCK_N>(j_start, j_end, split.index * key_split, key_split);
    for (int j0 = j_start; j0 < j_end; j0 += BLOCK_N) {
        load_tile<BLOCK_N, HEAD_DIM>(K_s, K, j0, seqlen_k, head_dim, Acc(1));
        load_tile<BLOCK_N, HEAD_DIM>(V_s, V, j0, seqlen_k, head_dim_v, Acc(1));
        __syncthreads();  // K_j, V_j (and, on the first pass, Q_i) are in shared memory for every warp

        Acc S[R];
        row_dots<R, BLOCK_N, HEAD_DIM>(S, Q_s + warp * R * HEAD_DIM, K_s);
        // online softmax; S becomes P
#pragma unroll
        for (int r = 0; r < R; ++r) {
            Acc t = Acc(0);
            S[r] = final_score(score, S[r], row0 + r, j0 + key, t);
            if (PAIR_HIDDEN(row0 + r, j0 + key)) S[r] = -INFINITY;
            online_softmax<BLOCK_N>(S[r], m[r], l[r], O[r]);
            S[r] = drop(S[r], row0 + r, j0 + key);  // after l took it: l sums the undropped P
        }
        accumulate<R, BLOCK_N, HEAD_DIM>(O, S, V_s);
        __syncthreads();  // every warp is done reading K_j, V_j before the next pass overwrites them
    }

    // out = O / l and lse = m + log l; a row that saw no key (l == 0) gets out 0, lse -inf
#pragma unroll
    for (int r = 0; r < R; ++r) {
        scale_row(O[r], l[r] == Acc(0) ? Acc(0) : Acc(1) / l[r]);
        if (lane == 0 && row0 + r < seqlen_q)
            LSE_ROW_AT(lse, split.index * lse_split, blk.b, blk.h)[row0 + r] =
                l[r] == Acc(0) ? -INFINITY : m[r] + acc_log(l[r]);
    }
    store_rows<R, HEAD_DIM>(Out, O, row0, seqlen_q, head_dim_v);
}
