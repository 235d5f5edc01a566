// block_reduce.cu: out[b] = sum of x over block b's BLOCK elements, by a tree
// reduction in static shared memory (BLOCK threads, BLOCK floats of shared memory).
//
// Define MISSING_BARRIER to drop the barrier between the loads and the first
// reduction level: the emulator must turn that race into a wrong answer under
// some thread order.

#ifndef BLOCK
#define BLOCK 128
#endif

extern "C" __global__ void __launch_bounds__(BLOCK)
block_sum(const float* __restrict__ x, float* __restrict__ out, int n) {
    __shared__ float partial[BLOCK];
    int tid = threadIdx.x;
    int i = blockIdx.x * BLOCK + tid;
    partial[tid] = i < n ? x[i] : 0.0f;
#ifndef MISSING_BARRIER
    __syncthreads();  // every load has landed before anyone reads a neighbour's
#endif
#pragma unroll
    for (int stride = BLOCK / 2; stride > 0; stride >>= 1) {
        if (tid < stride) partial[tid] += partial[tid + stride];
        __syncthreads();  // this level is complete before the next one reads it
    }
    if (tid == 0) out[blockIdx.x] = partial[0];
}

// ROUNDS rounds of v <- v + 0.5 * (right neighbour's v), 2 * ROUNDS barriers:
// the emulator's speed benchmark (128 threads, 64 blocks, 20 barriers).
#ifndef ROUNDS
#define ROUNDS 10
#endif

extern "C" __global__ void neighbour_rounds(const float* __restrict__ x, float* __restrict__ y) {
    __shared__ float v[BLOCK];
    int tid = threadIdx.x;
    int i = blockIdx.x * BLOCK + tid;
    float mine = x[i];
    for (int r = 0; r < ROUNDS; ++r) {
        v[tid] = mine;
        __syncthreads();  // the whole row is published
        mine = 0.5f * v[(tid + 1) % BLOCK] + mine;
        __syncthreads();  // everyone has read the row before it is overwritten
    }
    y[i] = mine;
}
