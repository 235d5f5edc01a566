// mask.cuh: which keys each query sees, and which block of which head a CTA works on. Every kernel,
// SIMT and tensor-core alike, asks these questions here instead of spelling the rule itself.
//
// Query i sees key j iff j < seqlen_k and, when causal, j <= i + diagonal. The interface computes
// diagonal once (Problem.diagonal in flashcupy/_api.py: seqlen_k - seqlen_q, the causal mask aligned
// bottom-right) and every kernel takes it as an argument. The kernels' loops run over key_start ..
// key_end (query_start .. query_end) and mask element by element only the tiles that partial()
// names, so a sliding window or per-sequence lengths change the answers here, not the loops.
//
// Rows past seqlen_q, the padding of the last query block, are no part of the rule: no kernel stores
// them, and the backward gives them P = 0 through their lse (lse_for_p in flash_bwd_common.cuh).
// Checking them here too took the tensor-core dK/dV kernel past the register limit that
// tests/test_nvrtc.py sets.

#pragma once

#include "flash_common.cuh"

template <int BLOCK_M, int BLOCK_N>  // query rows and keys of the kernel's tile
struct Mask {
    int seqlen_q, seqlen_k;
    int diagonal;
    bool causal;

    __device__ __forceinline__ bool visible(int i, int j) const {
        return j < seqlen_k && (!causal || j <= i + diagonal);
    }

    // The keys that some row of the query block at i0 sees lie in key_start(i0) .. key_end(i0) - 1;
    // key_end <= key_start when the block sees none (causal, its last row before the diagonal starts).
    // key_start is 0 while no window hides the earliest keys.
    __device__ __forceinline__ int key_start(int) const { return 0; }
    __device__ __forceinline__ int key_end(int i0) const {
        if (!causal) return seqlen_k;
        const int last_row = min(i0 + BLOCK_M, seqlen_q) - 1;
        return max(0, min(seqlen_k, last_row + 1 + diagonal));
    }

    // The rows that see some key of the key block at j0 lie in query_start(j0) .. query_end(j0) - 1
    // (none when query_start >= query_end). query_end is seqlen_q while no window hides the latest
    // rows.
    __device__ __forceinline__ int query_start(int j0) const { return causal ? max(0, j0 - diagonal) : 0; }
    __device__ __forceinline__ int query_end(int) const { return seqlen_q; }

    // Whether visible() is false anywhere in the tile of the query block at i0 and the key block at
    // j0 (rows past seqlen_q aside); the other tiles skip the element-wise mask.
    __device__ __forceinline__ bool partial(int i0, int j0) const {
        return j0 + BLOCK_N > seqlen_k || (causal && j0 + BLOCK_N - 1 > i0 + diagonal);
    }
};

// Grid decode. The grid is flattened on x, which has room for any problem where y and z stop at 65535.

// A kernel with one CTA per (query block, batch * heads_q): the query blocks of one head are adjacent,
// so its K and V stay in L2, and the last query blocks, which see the most keys when causal, go first.
struct QueryBlock {
    int i0;       // its first query row
    int b, h;     // batch, query head
    int kv_head;  // the key/value head that query head h reads (GQA: group query heads share one)
};

template <int BLOCK_M>
__device__ __forceinline__ QueryBlock query_block(int seqlen_q, int heads_q, int group) {
    const int blocks = num_blocks(seqlen_q, BLOCK_M);
    const int bh = blockIdx.x / blocks, h = bh % heads_q;
    return {int(blocks - 1 - blockIdx.x % blocks) * BLOCK_M, bh / heads_q, h, h / group};
}

// A kernel with one CTA per (key block, batch * heads_kv), the key blocks of one kv head adjacent.
struct KeyBlock {
    int j0;  // its first key
    int b, kv_head;
};

template <int BLOCK_N>
__device__ __forceinline__ KeyBlock key_block(int seqlen_k, int heads_kv) {
    const int blocks = num_blocks(seqlen_k, BLOCK_N);
    const int bk = blockIdx.x / blocks;
    return {int(blockIdx.x % blocks) * BLOCK_N, bk / heads_kv, bk % heads_kv};
}
