// warp_ops.cu: every warp shuffle, on one value per thread, for float, double and int.
//   butterfly[i]  warp total by __shfl_xor_sync (every lane holds it)
//   half_warp[i]  the same over 16-lane segments (width 16)
//   down[i]       what lane i holds after the __shfl_down_sync tree (lane 0: the total)
//   scan[i]       inclusive prefix sum by __shfl_up_sync
//   broadcast[i]  lane src_lane's value by __shfl_sync
// blockDim.x must be a multiple of 32.

template <typename T>
__global__ void warp_ops(const T* __restrict__ x, T* __restrict__ butterfly, T* __restrict__ half_warp,
                         T* __restrict__ down, T* __restrict__ scan, T* __restrict__ broadcast, int src_lane) {
    const unsigned FULL = 0xffffffffu;
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    int lane = threadIdx.x % warpSize;
    T v = x[i];

    T b = v;
    for (int m = 16; m > 0; m >>= 1) b += __shfl_xor_sync(FULL, b, m);
    butterfly[i] = b;

    T h = v;
    for (int m = 8; m > 0; m >>= 1) h += __shfl_xor_sync(FULL, h, m, 16);
    half_warp[i] = h;

    T d = v;
    for (int offset = 16; offset > 0; offset >>= 1) d += __shfl_down_sync(FULL, d, offset);
    down[i] = d;

    T s = v;
    for (int offset = 1; offset < 32; offset <<= 1) {
        T up = __shfl_up_sync(FULL, s, offset);
        if (lane >= offset) s += up;
    }
    scan[i] = s;

    broadcast[i] = __shfl_sync(FULL, v, src_lane);
}

// Misuse, for the emulator's own tests. mode 0: lane 0 waits at a barrier while
// the rest of its warp waits for it in a shuffle (deadlock); mode 1: a lane
// calls a shuffle with a mask that leaves itself out.
extern "C" __global__ void warp_misuse(float* x, int mode) {
    int lane = threadIdx.x % 32;
    float v = x[threadIdx.x];
    if (mode == 0) {
        if (lane == 0) __syncthreads();
        else v = __shfl_xor_sync(0xffffffffu, v, 1);
    } else {
        v = __shfl_xor_sync(1u, v, 1);
    }
    x[threadIdx.x] = v;
}
