// counters.cu: memory access patterns whose cost is known by construction, for the emulator's
// performance counters (tests/test_emulator_counters.py). One warp of 32 threads unless said.
//   shared_stride      each lane reads the float at word `stride` * lane (mod 1024) of a 4 KiB tile
//                      and writes it back: stride 1 is conflict-free, 2 a 2-way conflict, 32 a
//                      32-way one, 0 a broadcast
//   shared_vector16    each lane reads 16 bytes (an int4) at chunk `stride` * lane of a 4 KiB tile:
//                      stride 1 is conflict-free in quarter-warp phases, 2 a 2-way conflict, 8 8-way
//   global_stride      each lane reads the float at element `stride` * lane of x and writes y[lane]:
//                      stride 1 is one 128-byte line (4 sectors), 8 and above one sector a lane
//   ldmatrix_rows      one ldmatrix_x4 of a 32 x 64 half tile (128-byte rows): `swizzle` 0 reads
//                      rows 0..7 of chunk 0 for each matrix (every row in the same 4 banks: 8-way),
//                      1 the same rows with chunk c stored at c ^ (row % 8) (conflict-free); the
//                      copy in is one 16-byte load and store a lane, conflict-free either way
//   cp_async_rows      lane l cp.asyncs chunk l / 8 (16 bytes) of row l % 8 of an 8 x 64 half source
//                      into the same place of a shared tile (`swizzle` 0: each quarter warp writes
//                      one chunk column of 8 rows 128 bytes apart, an 8-way conflict) or at chunk
//                      c ^ (row % 8) (`swizzle` 1: conflict-free); the global reads are 16 whole sectors
//   barriers_and_mma   `passes` passes of two __syncthreads() and one mma each

#include "tensor_core.cuh"

extern "C" __global__ void shared_stride(float* __restrict__ y, int stride) {
    __shared__ float tile[1024];
    const int t = threadIdx.x;
    for (int i = t; i < 1024; i += 32) tile[i] = static_cast<float>(i);
    __syncthreads();
    const float v = tile[(stride * t) % 1024];
    __syncthreads();
    y[t] = v;
}

extern "C" __global__ void shared_vector16(int4* __restrict__ y, int stride) {
    __shared__ int4 tile[256];
    const int t = threadIdx.x;
    for (int i = t; i < 256; i += 32) tile[i] = make_int4(i, i, i, i);
    __syncthreads();
    y[t] = tile[(stride * t) % 256];  // copied whole: one 16-byte load a lane (g++ splits a float4 used by fields)
}

extern "C" __global__ void global_stride(const float* __restrict__ x, float* __restrict__ y, int stride) {
    const int t = threadIdx.x;
    y[t] = x[stride * t];
}

extern "C" __global__ void ldmatrix_rows(const unsigned short* __restrict__ src, unsigned* __restrict__ out,
                                         int swizzle) {
    __shared__ __align__(16) unsigned short tile[32 * 64];
    const int t = threadIdx.x;
    // copy the 32 x 64 tile in 16-byte chunks, chunk c of row r at c ^ (r % 8) when swizzled
    for (int e = t; e < 32 * 8; e += 32) {
        const int r = e / 8, c = e % 8, sc = swizzle ? c ^ (r % 8) : c;
        *reinterpret_cast<int4*>(&tile[r * 64 + 8 * sc]) = *reinterpret_cast<const int4*>(&src[r * 64 + 8 * c]);
    }
    __syncthreads();
    // matrix m = t / 8 is rows 8 m .. 8 m + 7 of chunk 0
    const int r = t, sc = swizzle ? 0 ^ (r % 8) : 0;
    unsigned frag[4];
    ldmatrix_x4(frag, &tile[r * 64 + 8 * sc]);
    for (int i = 0; i < 4; ++i) out[4 * t + i] = frag[i];
}

extern "C" __global__ void cp_async_rows(const unsigned short* __restrict__ src, unsigned short* __restrict__ out,
                                         int swizzle) {
    __shared__ __align__(16) unsigned short tile[8 * 64];
    const int t = threadIdx.x, r = t % 8, c = t / 8, sc = swizzle ? c ^ r : c;
    cp_async_16(&tile[r * 64 + 8 * sc], &src[r * 64 + 8 * c]);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    for (int i = t; i < 8 * 64; i += 32) out[i] = tile[i];
}

extern "C" __global__ void barriers_and_mma(float* __restrict__ y, int passes) {
    const unsigned a[4] = {0, 0, 0, 0}, b[2] = {0, 0};
    float d[4] = {0, 0, 0, 0};
    for (int p = 0; p < passes; ++p) {
        __syncthreads();
        mma_m16n8k16_f16f32(d, a, b, d);
        __syncthreads();
    }
    y[threadIdx.x] = d[0];
}
