// flash_append.cu: the KV-cache append of attention_with_kvcache, one launch for every sequence and
// new token: k_new (batch, seqlen_new, heads_kv, head_dim) and v_new (..., head_dim_v) written into
// k_cache, v_cache at positions cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1 of sequence b,
// before the attention kernels on the same stream.
//
// flash_kv_append: one thread per element of the wider of k_new and v_new (width = max(head_dim,
// head_dim_v)), writing that element of each that has it, flattened on x (batch x seqlen_new x heads_kv
// x width / NUM_THREADS CTAs), consecutive threads along the head dim, so that the reads and writes of a
// warp are coalesced where it is contiguous. No shared memory. Where v_cache is a view of k_cache's
// first head_dim_v columns (MLA's shared latent), the thread that writes an element of both writes
// k's value, then v's: v's lands, as on the host paths.
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
    TENSOR_PARAMS(const T, k_new), TENSOR_PARAMS(const T, v_new),
    // not __restrict__: v_cache may alias k_cache (MLA), and then v's store must stay after k's
    T* k_cache, index_t k_cache_sb, index_t k_cache_ss, index_t k_cache_sh, index_t k_cache_sd,
    T* v_cache, index_t v_cache_sb, index_t v_cache_ss, index_t v_cache_sh, index_t v_cache_sd,
    const int* __restrict__ cache_seqlens, const int* __restrict__ block_table, index_t table_sb, index_t table_sn,
    int paged, int batch, int seqlen_new, int heads_kv, int head_dim, int head_dim_v, int capacity, int block_size,
    int num_blocks) {
    const int width = max(head_dim, head_dim_v);
    const index_t e = index_t(blockIdx.x) * NUM_THREADS + threadIdx.x;
    if (e >= index_t(batch) * seqlen_new * heads_kv * width) return;
    const int d = e % width, h = e / width % heads_kv;
    const int j = e / width / heads_kv % seqlen_new, b = e / width / heads_kv / seqlen_new;
    const int n = min(max(cache_seqlens[b], 0), capacity - seqlen_new) + j;  // the token's position
    int slot = b, row = n;  // the cache's (batch or physical block, row)
    if (paged) {
        const int logical = n / block_size;  // < capacity / block_size: within the table's row
        slot = min(max(block_table[b * table_sb + logical * table_sn], 0), num_blocks - 1);
        row = n % block_size;
    }
    if (d < head_dim) HEAD_ROWS(k_cache, slot, h).at(row, d) = HEAD_ROWS(k_new, b, h).at(j, d);
    if (d < head_dim_v) HEAD_ROWS(v_cache, slot, h).at(row, d) = HEAD_ROWS(v_new, b, h).at(j, d);
}
