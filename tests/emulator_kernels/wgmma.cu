// wgmma.cu: hopper.cuh's wgmma wrappers, one warpgroup (128 threads) per block
// (tests/test_emulator_wgmma.py, tests/test_hopper_gpu.py). Compiled with
// -I flashcupy/backends/cupy_backend/kernels, by the emulator and by NVRTC (sm_90a).
//
//   wgmma_gemm<T, N>(image, words, cfg, c, a_global, out)
//       copies `words` 4-byte words of `image` (the A and B tiles as laid out by the test, in
//       shared-memory order) to a 1024-byte aligned buffer of dynamic shared memory, then runs
//       cfg[0] k16 steps of D (64 x N) = A B (+ C), one wgmma per step, with the descriptors
//       make_descriptor(tile + start, lbo, sbo, swizzle) for each operand, start the step's byte
//       offset: cfg = {steps, a_lbo, a_sbo, a_swizzle, b_offset, b_lbo, b_sbo, b_swizzle,
//       trans_a, trans_b, rs, accumulate, mode, static, then per step a_start, b_start}. A is at
//       byte 0 of the buffer, B at b_offset. static: the buffer is a static __shared__ array
//       (__align__(1024), 24 KiB) instead. rs: A comes from registers instead, loaded from a_global
//       (64 x 16 steps, row-major) in hopper.cuh's fragment layout. accumulate: the
//       accumulators start as c (per thread, N/2 floats, fragment order) and the first step adds
//       to them; otherwise they start as 12345 and the first step has scale-d 0.
//       out[tid * N/2 + i] = d[i] after the wait. Modes (the emulator's checks):
//         0  as described
//         1  d is copied to out before the wait_group (an early read; emulator only)
//         2  two groups: the steps into acc0, commit; the same into acc1 (scale-d 0), commit;
//            wait_group 1; out = acc0, then acc1 (still in flight); wait_group 0; then acc1
//            again: out holds 3 x 128 x N/2
//         3  warp 1 gives B's descriptor a start 16 bytes later (a mismatched warpgroup)
//         4  A's descriptor starts 128 bytes into the tile (not aligned to its swizzle)
//         5  B's descriptor has base offset 1
//         6  no wgmma.fence
//         7  warp 3 exits before the wgmma
//         8  d[0] is set to 0 between the mma_async and the wait (an early write; emulator only)
//         9  warp 3 waits at __syncthreads() instead (a deadlock)
//        10  P V as attention does it: after the wait, d (64 x N) is packed to T in registers as the
//            A fragments of N/16 RS k-steps against B again (K must equal N): out = T(A B) B
//        11  no fence.proxy.async after the tiles' ordinary stores (emulator only: a KernelError)
//        12  only thread 0 executes fence.proxy.async (emulator only: the other writers' bytes are
//            not fenced, a KernelError naming one of them)

#include "hopper.cuh"

enum { kSteps, kALbo, kASbo, kASwizzle, kBOffset, kBLbo, kBSbo, kBSwizzle, kTransA, kTransB, kRs, kAccumulate,
       kMode, kStatic, kStarts };
constexpr int kStaticBytes = 24 * 1024;  // the largest image the tests lay out: A 8 KiB, B 16 KiB
// At file scope, one object for every instantiation: inside the template each of the 14 wgmma_gemm<T, N>
// had its own, and the emulator lays a module's static __shared__ objects one after another, past the
// 2^18 bytes a descriptor addresses (a GPU gives each kernel its own)
__shared__ __align__(1024) unsigned char static_tile[kStaticBytes];

__device__ unsigned long long b_descriptor(const unsigned char* tile, const int* cfg, int step, int warp) {
    const int b_start = cfg[kStarts + 2 * step + 1] + (cfg[kMode] == 3 && warp == 1 ? 16 : 0);
    unsigned long long desc = make_descriptor(tile + cfg[kBOffset] + b_start, cfg[kBLbo], cfg[kBSbo],
                                              WgmmaSwizzle(cfg[kBSwizzle]));
    return cfg[kMode] == 5 ? desc | 1ull << 49 : desc;
}

template <typename T, int N>
__device__ void issue(float* d, const unsigned char* tile, const int* cfg, int step, const T* a_global, bool scale_d,
                      int warp) {
    const int a_start = cfg[kStarts + 2 * step];
    const unsigned long long desc_a = make_descriptor(tile + a_start + (cfg[kMode] == 4 ? 128 : 0), cfg[kALbo],
                                                      cfg[kASbo], WgmmaSwizzle(cfg[kASwizzle]));
    const unsigned long long desc_b = b_descriptor(tile, cfg, step, warp);
    if (cfg[kRs]) {
        // hopper.cuh's A fragment: a[i] = A[r + 8 (i & 1)][c + 8 (i >> 1) + {0, 1}] of this k16 step
        const int lane = threadIdx.x % 32, r = 16 * warp + lane / 4, c = 2 * (lane % 4);
        const unsigned short* bits = reinterpret_cast<const unsigned short*>(a_global);
        const int K = 16 * cfg[kSteps];
        unsigned a[4];
        for (int i = 0; i < 4; ++i) {
            const int row = r + 8 * (i & 1), col = 16 * step + c + 8 * (i >> 1);
            a[i] = bits[row * K + col] | static_cast<unsigned>(bits[row * K + col + 1]) << 16;
        }
        if (cfg[kTransB]) wgmma_rs<T, N, true>(d, a, desc_b, scale_d);
        else wgmma_rs<T, N, false>(d, a, desc_b, scale_d);
    } else if (cfg[kTransA]) {
        if (cfg[kTransB]) wgmma_ss<T, N, true, true>(d, desc_a, desc_b, scale_d);
        else wgmma_ss<T, N, true, false>(d, desc_a, desc_b, scale_d);
    } else {
        if (cfg[kTransB]) wgmma_ss<T, N, false, true>(d, desc_a, desc_b, scale_d);
        else wgmma_ss<T, N, false, false>(d, desc_a, desc_b, scale_d);
    }
}

template <typename T, int N>
__global__ void __launch_bounds__(128) wgmma_gemm(const int* __restrict__ image, int words, const int* __restrict__ cfg,
                                                  const float* __restrict__ c, const T* __restrict__ a_global,
                                                  float* __restrict__ out) {
    extern __shared__ __align__(16) unsigned char smem[];
    unsigned char* tile = cfg[kStatic] ? static_tile : smem + ((1024u - (smem_address(smem) & 1023u)) & 1023u);
    const int tid = threadIdx.x, warp = tid / 32, mode = cfg[kMode];
    for (int i = tid; i < words; i += 128) reinterpret_cast<int*>(tile)[i] = image[i];
    if (mode != 11 && (mode != 12 || tid == 0))
        fence_proxy_async();  // each thread's ordinary stores of the tiles, before wgmma reads them
    __syncthreads();
    if (mode == 7 && warp == 3) return;
    if (mode == 9 && warp == 3) __syncthreads();

    constexpr int R = N / 2;
    float acc0[R], acc1[R];
    for (int i = 0; i < R; ++i) acc0[i] = cfg[kAccumulate] ? c[tid * R + i] : 12345.0f;
    if (mode != 6) wgmma_fence();
    for (int s = 0; s < cfg[kSteps]; ++s) issue<T, N>(acc0, tile, cfg, s, a_global, s > 0 || cfg[kAccumulate], warp);
    wgmma_commit_group();
    if (mode == 2) {
        for (int s = 0; s < cfg[kSteps]; ++s) issue<T, N>(acc1, tile, cfg, s, a_global, s > 0, warp);
        wgmma_commit_group();
        wgmma_wait_group<1>();
        wgmma_fence_operand<R>(acc0);
        for (int i = 0; i < R; ++i) out[tid * R + i] = acc0[i];
        for (int i = 0; i < R; ++i) out[(128 + tid) * R + i] = acc1[i];
        wgmma_wait_group<0>();
        wgmma_fence_operand<R>(acc1);
        for (int i = 0; i < R; ++i) out[(256 + tid) * R + i] = acc1[i];
        return;
    }
    if (mode == 10) {
        wgmma_wait_group<0>();
        wgmma_fence_operand<R>(acc0);
        wgmma_fence();  // acc1 and the A fragments were written by ordinary instructions
        for (int t = 0; t < N / 16; ++t) {
            unsigned p[4];
            for (int i = 0; i < 4; ++i) p[i] = pack2<T>(acc0[8 * t + 2 * i], acc0[8 * t + 2 * i + 1]);
            if (cfg[kTransB]) wgmma_rs<T, N, true>(acc1, p, b_descriptor(tile, cfg, t, warp), t > 0);
            else wgmma_rs<T, N, false>(acc1, p, b_descriptor(tile, cfg, t, warp), t > 0);
        }
        wgmma_commit_group();
        wgmma_wait_group<0>();
        wgmma_fence_operand<R>(acc1);
        for (int i = 0; i < R; ++i) out[tid * R + i] = acc1[i];
        return;
    }
#ifdef FLASHCUPY_EMULATOR  // undefined on a GPU (and ptxas would serialise the pipeline for them)
    if (mode == 1)
        for (int i = 0; i < R; ++i) out[tid * R + i] = acc0[i];
    if (mode == 8) acc0[0] = 0.0f;
#endif
    wgmma_wait_group<0>();
    wgmma_fence_operand<R>(acc0);
    if (mode != 1)
        for (int i = 0; i < R; ++i) out[tid * R + i] = acc0[i];
}
