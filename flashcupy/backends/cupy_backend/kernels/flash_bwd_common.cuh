// flash_bwd_common.cuh: what the SIMT backward (flash_bwd.cu) and the tensor-core backwards
// (flash_bwd_tc.cu, flash_bwd_sm90.cu) share: the D = rowsum(dO ∘ O) pre-pass, the lse a recomputed P
// uses (the exponent itself: the epilogues, mask.cuh and tc_tile.cuh), and the kernel that scales and
// rounds a dQ added with atomics.

#pragma once

#include "flash_common.cuh"

// D_i = rowsum(dO_i ∘ O_i), one warp per query row, into a float (double for float64) workspace
// of shape (batch, heads_q, seqlen_q). No shared memory.
template <typename T, typename Acc>
__global__ void __launch_bounds__(NUM_THREADS) flash_bwd_preprocess(
    TENSOR_PARAMS(const T, dout), TENSOR_PARAMS(const T, out), Acc* __restrict__ Dvec, int batch, int seqlen_q,
    int heads_q, int head_dim) {
    const int lane = threadIdx.x % WARP_SIZE;
    const index_t n = index_t(blockIdx.x) * NUM_WARPS + threadIdx.x / WARP_SIZE;  // row of Dvec
    if (n >= index_t(batch) * heads_q * seqlen_q) return;  // the whole warp leaves together
    const int i = n % seqlen_q;
    const int bh = n / seqlen_q;
    const int b = bh / heads_q, h = bh % heads_q;
    const Rows<const T> dO = HEAD_ROWS(dout, b, h);
    const Rows<const T> O = HEAD_ROWS(out, b, h);
    Acc sum = Acc(0);
    for (int d = lane; d < head_dim; d += WARP_SIZE) sum += to_acc(dO.at(i, d)) * to_acc(O.at(i, d));
    sum = group_sum<WARP_SIZE>(sum);
    if (lane == 0) Dvec[n] = sum;
}

// D as the dK/dV and dQ kernels read it: d_row's rows of the launch's seqlen_q. In a kernel over a
// packed batch (PACKED: VARLEN) that is one batch of total_q rows a head, which the CTA reads from its
// sequence's first row on (at_row, TAKE_SEQUENCE_BACKWARD in mask.cuh), its batch index ignored as the
// tensors' batch strides 0 ignore it.
template <typename Acc, bool PACKED = false>
struct DRows {
    Acc* D;
    int heads_q, seqlen_q;  // the launch's: a packed batch's total_q, whichever sequence the CTA takes

    __device__ __forceinline__ void at_row(int q_start) { D += q_start; }
    template <bool AT_OFFSET = false>
    __device__ __forceinline__ Stats<Acc> row(int b, int h) const {
        return d_row<AT_OFFSET>(D, heads_q, seqlen_q, PACKED ? 0 : b, h);
    }
};

// lse of row i for recomputing P = exp(S - lse): +inf for rows that saw no key (lse = -inf) and
// for rows past seqlen_q, so that their P is 0 (for any finite score: the mask leaves the rows past
// seqlen_q to this, mask.cuh).
template <typename Acc>
__device__ __forceinline__ Acc lse_for_p(const Stats<const Acc>& lse_row, int i, int seqlen_q) {
    const Acc x = i < seqlen_q ? lse_row[i] : Acc(-INFINITY);
    return x == -INFINITY ? Acc(INFINITY) : x;
}

// dq = scale dQ for the backwards that add dQ with atomics (flash_bwd_tc.cu's DQ_ATOMIC, flash_bwd_sm90.cu):
// the fp32 workspace the dK/dV kernel added into (contiguous, q's shape), rounded to T, into dq
// (contiguous too). One thread an element.
template <typename T>
__global__ void __launch_bounds__(NUM_THREADS) flash_bwd_dq_convert(const float* __restrict__ dqa, T* __restrict__ dq,
                                                                    index_t size, float scale) {
    const index_t n = index_t(blockIdx.x) * NUM_THREADS + threadIdx.x;
    if (n < size) store(dq + n, scale * dqa[n]);
}
