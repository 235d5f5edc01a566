// shared_memory.cu: dynamic shared memory.
//   reverse_blocks  y = x reversed within each block, through a blockDim.x-float
//                   tile; `shift` moves the tile index (shift 1 is an off-by-one
//                   that the emulator must catch at the end of the tile)
//   stale_shared    only block 0 writes its tile, every block reads it: blocks
//                   1.. must read garbage, as on a GPU, not block 0's values.
//                   which = 0 uses dynamic shared memory, 1 a static __shared__ array.

extern "C" __global__ void reverse_blocks(const float* __restrict__ x, float* __restrict__ y, int n, int shift) {
    extern __shared__ __align__(16) float tile[];
    int t = threadIdx.x;
    int i = blockIdx.x * blockDim.x + t;
    tile[t + shift] = i < n ? x[i] : 0.0f;
    __syncthreads();  // the tile is full before it is read backwards
    int j = blockIdx.x * blockDim.x + (blockDim.x - 1 - t);
    if (j < n) y[j] = tile[t];
}

extern "C" __global__ void stale_shared(float* __restrict__ y, int which) {
    extern __shared__ float dynamic_tile[];
    __shared__ float static_tile[64];
    float* tile = which == 0 ? dynamic_tile : static_tile;
    int t = threadIdx.x;
    if (blockIdx.x == 0) tile[t] = 1.0f;
    __syncthreads();  // block 0's writes land before its reads
    y[blockIdx.x * blockDim.x + t] = tile[t];
}

// The same as stale_shared's static case, from a template: g++ puts a template's statics in
// sections of their own, which emu_shared.ld gathers so they are refilled per block too.
template <int N>
__global__ void stale_shared_template(float* __restrict__ y) {
    __shared__ float static_tile[N];
    int t = threadIdx.x;
    if (blockIdx.x == 0) static_tile[t] = 1.0f;
    __syncthreads();  // block 0's writes land before its reads
    y[blockIdx.x * blockDim.x + t] = static_tile[t];
}
