// memory.cu: global memory access patterns.
//   bounded_copy   y[i] = x[i] with separate read and write bounds, so a test
//                  can push either one past the end of its array
//   strided_axpy   y[i*sy] = a * x[i*sx] + y[i*sy], element strides may be negative
//   atomics        histogram (int atomicAdd), float and double sums, int atomicMax across blocks

#include <cstdint>

extern "C" __global__ void bounded_copy(const float* __restrict__ x, float* __restrict__ y, int n_read, int n_write) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    float v = i < n_read ? x[i] : 0.0f;
    if (i < n_write) y[i] = v;
}

extern "C" __global__ void strided_axpy(const float* x, long long sx, float* y, int64_t sy, float a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    y[i * sy] = a * x[i * sx] + y[i * sy];
}

extern "C" __global__ void atomics(const int* __restrict__ keys, const float* __restrict__ x, int n,
                                   int* hist, float* fsum, double* dsum, int* imax) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    atomicAdd(&hist[keys[i]], 1);
    atomicAdd(fsum, x[i]);
    atomicAdd(dsum, static_cast<double>(x[i]));
    atomicMax(imax, keys[i] * 7 - 3);
}
