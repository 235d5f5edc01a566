// tc_tile.cuh: what the tensor-core kernels (attn_fwd_tc.cu, attn_bwd_tc.cu) share on top of
// tensor_core.cuh: the swizzled shared-memory tile layout, its cp.async loader, and the constants
// of base-2 exponentials.
//
// A tile is ROWS x HEAD_DIM elements of T (2 bytes), row-major, XOR-swizzled in 16-byte chunks:
// chunk c of row r is stored at chunk c ^ (r % 8), so the 8 rows one ldmatrix reads hit 8
// different 16-byte bank groups (HEAD_DIM >= 64: a row has at least 8 chunks).

#pragma once

#include "flash_common.cuh"
#include "tensor_core.cuh"

constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

// Element offset of 8-element chunk `chunk` of row `row` in a swizzled tile.
template <int HEAD_DIM>
__device__ __forceinline__ int swizzled(int row, int chunk) {
    return row * HEAD_DIM + ((chunk ^ (row & 7)) << 3);
}

// cp.async the ROWS x HEAD_DIM tile of rows row0.. of src into `tile` (swizzled); zero-fill the
// rows from seqlen on and the columns from head_dim on. Not committed.
template <int ROWS, int HEAD_DIM, typename T>
__device__ __forceinline__ void load_tile_async(T* tile, const Rows<const T>& src, int row0, int seqlen,
                                                int head_dim) {
    constexpr int CHUNKS = HEAD_DIM / 8;
    static_assert(ROWS * CHUNKS % NUM_THREADS == 0, "every thread copies the same number of chunks");
#pragma unroll
    for (int pass = 0; pass < ROWS * CHUNKS / NUM_THREADS; ++pass) {
        const int e = pass * NUM_THREADS + threadIdx.x;
        const int r = e / CHUNKS, c = e % CHUNKS;
        const bool valid = row0 + r < seqlen && 8 * c < head_dim;
        cp_async_16(tile + swizzled<HEAD_DIM>(r, c), valid ? &src.at(row0 + r, 8 * c) : src.base, valid);
    }
}
