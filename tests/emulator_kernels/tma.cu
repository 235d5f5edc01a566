// tma.cu: hopper.cuh's TMA wrappers (tests/test_emulator_tma.py, tests/test_hopper_gpu.py, and
// tests/test_hopper_nvrtc.py for the SASS). Compiled with -I flashcupy/backends/cupy_backend/kernels,
// by the emulator and by NVRTC (sm_90a). The map is the first parameter (64-byte aligned).
//
//   tma_box(map, rank, c0, c1, c2, c3, box_bytes, steps, mode, out)   32 threads
//       thread 0 initialises an mbarrier (count 1); per step s (of `steps`), thread 0 arrives with
//       expect_tx(box_bytes) and issues tma_load_<rank>d of the box at (c0, c1, c2, c3) into a
//       1024-byte aligned tile of dynamic shared memory (rank 2: at (c0, c1 + s * c3), a walk down
//       the rows of one map, reusing the barrier); every thread waits on parity s & 1, copies the
//       tile's bytes as they lie (swizzled) to out + s * box_bytes, and syncs.
//       Modes (the emulator's checks):
//         0  as described
//         1  the tile 16 bytes past its alignment (a misaligned destination)
//         2  expect_tx of twice the box: the phase never completes (a deadlock)
//   tma_copy(map_in, map_out, rank, c0, c1, c2, c3, box_bytes)   32 threads: thread 0 loads the box
//       at (c0, c1, ..) (rank 2, 3 or 4), stores it at the same coordinates through map_out (commit,
//       wait_group.read 0).
//   tma_fill_store(map_in, map_out, c0, c1, box_bytes, mode, src)   32 threads, rank 2, no swizzle:
//       the tile's bytes written by ordinary stores (thread t writes bytes t, t + 32, ..: tile[i] =
//       src[i]), __syncthreads, then thread 0 stores the box at (c0, c1) through map_out (commit,
//       wait_group.read 0). Modes (the emulator's async-proxy checks):
//         0  every writer executes fence_proxy_async after its stores
//         1  no fence (emulator only: a KernelError)
//         2  only thread 0 fences (emulator only: a KernelError naming another writer)
//         3  thread 0 first loads the box at (c0, c1) of map_in by TMA, every thread waits on the
//            mbarrier, then the first half of the tile is overwritten from src, fenced: out holds
//            src's first half and the loaded second half
//         4  as 3 without the fence (emulator only: a KernelError)
//   tma_bulk_reduce(dst, src, floats, rounds, mode)   64 threads a CTA, any number of CTAs: per round r,
//       each thread writes tile[i] = src[r * floats + i] (i = tid, tid + 64, ..) with ordinary stores,
//       fences them for the async proxy, __syncthreads, and thread 0 adds the tile into dst by
//       bulk_reduce_add_f32 (floats * 4 bytes) and commits; thread 0 waits (wait_group.read 0) before
//       the __syncthreads that lets the next round overwrite the tile. dst[i] += sum over CTAs and
//       rounds of src[r][i]: the CTAs add into the same floats. Modes:
//         0  as described
//         1  thread 0 waits only after the last round (emulator only: the reads of every round's
//            tile happen at that wait, so each round adds the last round's values)
//         2  a size of floats * 4 - 4 bytes (emulator only: not a multiple of 16, a KernelError)
//   tma_ordered_reduce(dst, src, flags, floats, mode)   64 threads a CTA, CTA b (x) adds src[b] into dst
//       (floats each) after CTAs 0 .. b - 1, through one flag (flags[0], zero at the launch): the tile's
//       ordinary stores fenced, __syncthreads, then thread 0 waits until the flag reaches b
//       (flag_wait_at_least), fence_proxy_async_global, bulk_reduce_add_f32, commit, waits for the
//       add's completion (tma_store_wait_group<0>, not .read), fence_proxy_async_global and raises the
//       flag (flag_release_add 1). dst holds ((dst + src[0]) + src[1]) + .. in float32, bit for bit,
//       whatever order the CTAs run in. Modes:
//         0  as described
//         1  no flag wait (emulator only: the adds in the order the blocks run)
//         2  wait_group.read instead of the completion (emulator only: a KernelError at the release)
//         3  no fence after the flag wait (emulator only: a KernelError at the reduce-add)
//         4  no fence before the release (emulator only: a KernelError at the release)
//         5  waits until the flag reaches b + 1 (emulator only: a DeadlockError naming the flag)
//   tma_qk(map_q, map_k, out)   128 threads: Q (64 x 64) and K (64 x 64) fp16 boxes loaded with 128B
//       swizzle, then S = Q K^T by 4 k16 steps of wgmma_ss<__half, 64> with 128B K-major
//       descriptors (SBO 1024, +32 bytes per step): out[tid * 32 + i] = d[i].

#include "hopper.cuh"

__device__ unsigned char* aligned_tile(unsigned char* smem) {
    return smem + ((1024u - (smem_address(smem) & 1023u)) & 1023u);
}

extern "C" __global__ void tma_box(const __grid_constant__ TensorMap map, int rank, int c0, int c1, int c2, int c3,
                                   int box_bytes, int steps, int mode, unsigned char* out) {
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ __align__(8) unsigned long long bar;
    unsigned char* tile = aligned_tile(smem) + (mode == 1 ? 16 : 0);
    const int tid = threadIdx.x;
    if (tid == 0) {
        mbarrier_init(&bar, 1);
        mbarrier_init_fence();
    }
    __syncthreads();
    for (int s = 0; s < steps; ++s) {
        if (tid == 0) {
            mbarrier_arrive_expect_tx(&bar, mode == 2 ? 2 * box_bytes : box_bytes);
            if (rank == 2) tma_load_2d(tile, map, c0, c1 + s * c3, &bar);
            else if (rank == 3) tma_load_3d(tile, map, c0, c1, c2, &bar);
            else tma_load_4d(tile, map, c0, c1, c2, c3, &bar);
        }
        mbarrier_wait_parity(&bar, s & 1);
        for (int i = tid; i < box_bytes; i += 32) out[s * box_bytes + i] = tile[i];
        __syncthreads();  // every thread has read the tile before the next box overwrites it
    }
}

extern "C" __global__ void tma_copy(const __grid_constant__ TensorMap map_in, const __grid_constant__ TensorMap map_out,
                                    int rank, int c0, int c1, int c2, int c3, int box_bytes) {
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ __align__(8) unsigned long long bar;
    unsigned char* tile = aligned_tile(smem);
    if (threadIdx.x == 0) {
        mbarrier_init(&bar, 1);
        mbarrier_init_fence();
        mbarrier_arrive_expect_tx(&bar, box_bytes);
        if (rank == 2) tma_load_2d(tile, map_in, c0, c1, &bar);
        else if (rank == 3) tma_load_3d(tile, map_in, c0, c1, c2, &bar);
        else tma_load_4d(tile, map_in, c0, c1, c2, c3, &bar);
        mbarrier_wait_parity(&bar, 0);
        if (rank == 2) tma_store_2d(map_out, c0, c1, tile);
        else if (rank == 3) tma_store_3d(map_out, c0, c1, c2, tile);
        else tma_store_4d(map_out, c0, c1, c2, c3, tile);
        tma_store_commit_group();
        tma_store_wait_group_read<0>();
    }
}

extern "C" __global__ void tma_fill_store(const __grid_constant__ TensorMap map_in,
                                          const __grid_constant__ TensorMap map_out, int c0, int c1, int box_bytes,
                                          int mode, const unsigned char* __restrict__ src) {
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ __align__(8) unsigned long long bar;
    unsigned char* tile = aligned_tile(smem);
    const int tid = threadIdx.x;
    if (tid == 0) {
        mbarrier_init(&bar, 1);
        mbarrier_init_fence();
    }
    __syncthreads();
    if (mode >= 3) {
        if (tid == 0) {
            mbarrier_arrive_expect_tx(&bar, box_bytes);
            tma_load_2d(tile, map_in, c0, c1, &bar);
        }
        mbarrier_wait_parity(&bar, 0);
    }
    for (int i = tid; i < (mode >= 3 ? box_bytes / 2 : box_bytes); i += 32) tile[i] = src[i];
    if (mode == 0 || mode == 3 || (mode == 2 && tid == 0))
        fence_proxy_async();  // this thread's ordinary stores, before the TMA store reads them
    __syncthreads();
    if (tid == 0) {
        tma_store_2d(map_out, c0, c1, tile);
        tma_store_commit_group();
        tma_store_wait_group_read<0>();
    }
}

extern "C" __global__ void __launch_bounds__(128) tma_qk(const __grid_constant__ TensorMap map_q,
                                                         const __grid_constant__ TensorMap map_k, float* out) {
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ __align__(8) unsigned long long bar;
    unsigned char* q = aligned_tile(smem);
    unsigned char* k = q + 64 * 128;
    const int tid = threadIdx.x;
    if (tid == 0) {
        mbarrier_init(&bar, 1);
        mbarrier_init_fence();
    }
    __syncthreads();
    if (tid == 0) {
        mbarrier_arrive_expect_tx(&bar, 2 * 64 * 128);
        tma_load_2d(q, map_q, 0, 0, &bar);
        tma_load_2d(k, map_k, 0, 0, &bar);
    }
    mbarrier_wait_parity(&bar, 0);
    float d[32];
    for (int i = 0; i < 32; ++i) d[i] = 0.0f;
    wgmma_fence();
    for (int s = 0; s < 4; ++s)
        wgmma_ss<__half, 64>(d, make_descriptor(q + 32 * s, 16, 1024, kSwizzle128B),
                             make_descriptor(k + 32 * s, 16, 1024, kSwizzle128B), s > 0);
    wgmma_commit_group();
    wgmma_wait_group<0>();
    wgmma_fence_operand<32>(d);
    for (int i = 0; i < 32; ++i) out[tid * 32 + i] = d[i];
}

extern "C" __global__ void tma_ordered_reduce(float* dst, const float* __restrict__ src, int* flags, int floats,
                                              int mode) {
    extern __shared__ __align__(16) unsigned char smem[];
    float* tile = reinterpret_cast<float*>(aligned_tile(smem));
    const int tid = threadIdx.x, b = blockIdx.x;
    for (int i = tid; i < floats; i += 64) tile[i] = src[b * floats + i];
    fence_proxy_async();  // this thread's stores, before the bulk reduce reads them
    __syncthreads();      // every thread's stores are in the tile before thread 0 issues
    if (tid == 0) {
        if (mode != 1) flag_wait_at_least(flags, mode == 5 ? b + 1 : b);  // CTAs 0 .. b - 1 have added
        if (mode != 3) fence_proxy_async_global();  // the acquire, before the add (the async proxy)
        bulk_reduce_add_f32(dst, tile, floats * 4);
        tma_store_commit_group();
        if (mode == 2) tma_store_wait_group_read<0>();
        else tma_store_wait_group<0>();             // the add has completed
        if (mode != 4) fence_proxy_async_global();  // its writes, before the release
        flag_release_add(flags, 1);
    }
}

extern "C" __global__ void tma_bulk_reduce(float* dst, const float* __restrict__ src, int floats, int rounds,
                                           int mode) {
    extern __shared__ __align__(16) unsigned char smem[];
    float* tile = reinterpret_cast<float*>(aligned_tile(smem));
    const int tid = threadIdx.x;
    for (int r = 0; r < rounds; ++r) {
        for (int i = tid; i < floats; i += 64) tile[i] = src[r * floats + i];
        fence_proxy_async();  // this thread's stores, before the bulk reduce reads them
        __syncthreads();      // every thread's stores are in the tile before thread 0 issues
        if (tid == 0) {
            bulk_reduce_add_f32(dst, tile, mode == 2 ? floats * 4 - 4 : floats * 4);
            tma_store_commit_group();
            if (mode != 1) tma_store_wait_group_read<0>();  // the reduce has read the tile
        }
        __syncthreads();  // the tile is free again before the next round's stores
    }
    if (tid == 0) tma_store_wait_group_read<0>();
}
