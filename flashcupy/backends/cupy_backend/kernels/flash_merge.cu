// flash_merge.cu: split-KV's merge in one launch. A forward kernel specialised for SPLIT (mask.cuh's Split)
// leaves, per split s of the keys, a partial out_s (in Acc) and lse_s; this kernel combines them by
// flashcupy.merge's rule (flashcupy/_merge.py), per query row and head:
//     m   = max_s lse_s                              (0 where every lse_s is -inf: no shift)
//     lse = m + log sum_s exp(lse_s - m)             (-inf where no split saw a key)
//     out = sum_s exp(lse_s - lse) out_s             (the exponents against 0 where lse = -inf: out 0)
// in Acc, in split order, out rounded once to T. A NaN lse_s makes the row's lse and out NaN, as the
// rule's array form does (the max below propagates NaN; fmax would drop it).
//
// flash_split_merge: one thread per element of out (batch x seqlen x heads x head_dim / NUM_THREADS CTAs),
// consecutive threads along head_dim, so that a warp's reads of out_s and writes of out are coalesced where
// head_dim is contiguous. Each thread reads its row's lses (the same addresses for the row's threads) and
// computes the weights itself; the thread of column 0 stores lse. No shared memory, no barrier.
//
// outs and lses are the forward's workspaces: split 0's partial out and lse with their element strides,
// split s at element offsets s out_split and s lse_split (SPLIT_PARAMS' out_split, lse_split). A packed
// batch's (attention_varlen, a KV cache) is batch 1 of seqlen its total rows.

#include "flash_common.cuh"

template <typename T, typename Acc>
__global__ void __launch_bounds__(NUM_THREADS) flash_split_merge(
    TENSOR_PARAMS(const Acc, outs), LSE_PARAMS(const Acc, lses), TENSOR_PARAMS(T, out), LSE_PARAMS(Acc, lse),
    int splits, index_t out_split, index_t lse_split, int batch, int seqlen, int heads, int head_dim) {
    const index_t e = index_t(blockIdx.x) * NUM_THREADS + threadIdx.x;
    if (e >= index_t(batch) * seqlen * heads * head_dim) return;
    const int d = e % head_dim, h = e / head_dim % heads;
    const int i = e / head_dim / heads % seqlen, b = e / head_dim / heads / seqlen;

    Acc m = -INFINITY;
    for (int s = 0; s < splits; ++s) {
        const Acc x = LSE_ROW_AT(lses, s * lse_split, b, h)[i];
        m = (x > m || x != x) ? x : m;  // NaN stays: x > NaN is false
    }
    const Acc m_safe = m == -INFINITY ? Acc(0) : m;
    Acc total = Acc(0);
    for (int s = 0; s < splits; ++s) total += acc_exp(LSE_ROW_AT(lses, s * lse_split, b, h)[i] - m_safe);
    const Acc merged = m_safe + acc_log(total);  // log 0 = -inf: no split saw a key
    const Acc merged_safe = merged == -INFINITY ? Acc(0) : merged;
    const Acc* part = &HEAD_ROWS(outs, b, h).at(i, d);
    Acc o = Acc(0);
    for (int s = 0; s < splits; ++s)
        o += acc_exp(LSE_ROW_AT(lses, s * lse_split, b, h)[i] - merged_safe) * part[s * out_split];
    store(&HEAD_ROWS(out, b, h).at(i, d), o);
    if (d == 0) LSE_ROW(lse, b, h)[i] = merged;
}
