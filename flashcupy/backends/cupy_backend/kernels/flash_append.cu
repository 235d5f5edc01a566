// flash_append.cu: the KV-cache append of attention_with_kvcache, one launch for every sequence and
// new token: k_new, v_new (batch, seqlen_new, heads_kv, head_dim) written into k_cache, v_cache at
// positions cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1 of sequence b, before the attention
// kernels on the same stream.
//
// flash_kv_append: one thread per element of k_new (and the same element of v_new), flattened on x
// (batch x seqlen_new x heads_kv x head_dim / NUM_THREADS CTAs), consecutive threads along head_dim, so
// that the reads and writes of a warp are coalesced where head_dim is contiguous. No shared memory.
//
// A contiguous cache (paged 0; block_table is not read): k_cache (batch, capacity, heads_kv, head_dim), sequence b's
// position n at row n of batch b. A paged cache: k_cache (num_blocks, block_size, heads_kv, head_dim),
// position n of sequence b (paged 1) at row n % block_size of physical block block_table[b, n / block_size]
// (table strides table_sb, table_sn). The lengths and the table are read from device memory and clamped
// into the arrays, as mask.cuh's Sequence clamps a packed batch's offsets: a length into
// [0, capacity - seqlen_new] (capacity: the cache's rows a sequence, max_blocks * block_size when
// paged), a physical block into [0, num_blocks). So no table, checked on the host or not, makes a thread
// write outside the cache: a hostile one writes garbage where the arrays are. Two sequences whose
// appended positions map to one physical block write it in no defined order (the interface refuses
// such a table where it checks it).

#include "flash_common.cuh"

template <typename T>
__global__ void __launch_bounds__(NUM_THREADS) flash_kv_append(
    TENSOR_PARAMS(const T, k_new), TENSOR_PARAMS(const T, v_new), TENSOR_PARAMS(T, k_cache), TENSOR_PARAMS(T, v_cache),
    const int* __restrict__ cache_seqlens, const int* __restrict__ block_table, index_t table_sb, index_t table_sn,
    int paged, int batch, int seqlen_new, int heads_kv, int head_dim, int capacity, int block_size, int num_blocks) {
    const index_t e = index_t(blockIdx.x) * NUM_THREADS + threadIdx.x;
    if (e >= index_t(batch) * seqlen_new * heads_kv * head_dim) return;
    const int d = e % head_dim, h = e / head_dim % heads_kv;
    const int j = e / head_dim / heads_kv % seqlen_new, b = e / head_dim / heads_kv / seqlen_new;
    const int n = min(max(cache_seqlens[b], 0), capacity - seqlen_new) + j;  // the token's position
    int slot = b, row = n;  // the cache's (batch or physical block, row)
    if (paged) {
        const int logical = n / block_size;  // < capacity / block_size: within the table's row
        slot = min(max(block_table[b * table_sb + logical * table_sn], 0), num_blocks - 1);
        row = n % block_size;
    }
    HEAD_ROWS(k_cache, slot, h).at(row, d) = HEAD_ROWS(k_new, b, h).at(j, d);
    HEAD_ROWS(v_cache, slot, h).at(row, d) = HEAD_ROWS(v_new, b, h).at(j, d);
}
