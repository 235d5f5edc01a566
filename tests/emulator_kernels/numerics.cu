// numerics.cu: 16-bit floats and the maths library.
//   narrow      float -> __half / __nv_bfloat16 and back, double -> __half, and __half arithmetic
//   maths       one column per function, out is (n, COLUMNS)
//   coords      every thread writes its (threadIdx, blockIdx, blockDim, gridDim) into out
//   subnormal   float32 products and sums with a subnormal operand or result, which -ftz=true flushes
//   mulhi       __umulhi(a, b) and a * b, the two halves of a 32 x 32-bit product (mask.cuh's Philox)

#include <cuda_bf16.h>
#include <cuda_fp16.h>

extern "C" __global__ void narrow(const float* __restrict__ x, const double* __restrict__ xd, int n,
                                  __half* h, __nv_bfloat16* b, float* h_back, float* b_back,
                                  __half* hd, __half* h_square) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    h[i] = __float2half_rn(x[i]);
    b[i] = __float2bfloat16(x[i]);
    h_back[i] = __half2float(__float2half(x[i]));
    b_back[i] = __bfloat162float(b[i]);
    hd[i] = __double2half(xd[i]);
    h_square[i] = h[i] * h[i] + h[i];
}

#define COLUMNS 16

extern "C" __global__ void maths(const float* __restrict__ x, const double* __restrict__ xd, float* __restrict__ out,
                                 double* __restrict__ outd, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = x[i];
    double d = xd[i];
    float* o = out + static_cast<long long>(i) * COLUMNS;
    o[0] = expf(v);
    o[1] = exp2f(v);
    o[2] = __expf(v);
    o[3] = logf(fabsf(v));
    o[4] = log2f(fabsf(v));
    o[5] = fmaxf(v, 0.25f);
    o[6] = fminf(v, 0.25f);
    o[7] = sqrtf(fabsf(v));
    o[8] = rsqrtf(fabsf(v));
    o[9] = isinf(v) ? 1.0f : (isnan(v) ? 2.0f : 0.0f);
    o[10] = __int_as_float(__float_as_int(v) ^ 0x80000000);
    o[11] = v > 0.0f ? INFINITY : -INFINITY;
    o[12] = static_cast<float>(max(i, 7) + min(i, 7));
    o[13] = fmax(v, 1.0f);
    o[14] = fmin(v, 1.0f);
    // a local array of 300 floats: fibers need real stacks
    float local[300];
#pragma unroll 4
    for (int k = 0; k < 300; ++k) local[k] = v * k;
    float total = 0.0f;
    for (int k = 299; k >= 0; k -= 3) total += local[k];
    o[15] = total;
    double* od = outd + static_cast<long long>(i) * 4;
    od[0] = exp(d);
    od[1] = exp2(d);
    od[2] = log(fabs(d));
    od[3] = fmax(d, 0.5);
}

extern "C" __global__ void coords(unsigned* out) {
    unsigned block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    unsigned thread = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    unsigned* o = out + (block * blockDim.x * blockDim.y * blockDim.z + thread) * 12;
    const unsigned values[12] = {threadIdx.x, threadIdx.y, threadIdx.z, blockIdx.x, blockIdx.y, blockIdx.z,
                                 blockDim.x, blockDim.y, blockDim.z, gridDim.x, gridDim.y, gridDim.z};
    for (int k = 0; k < 12; ++k) o[k] = values[k];
}

// product[i] = x[i] * y[i] and sum[i] = x[i] + y[i]: with -ftz=true a subnormal x[i] counts as
// zero (DAZ) and a subnormal result is zero (FTZ).
extern "C" __global__ void subnormal(const float* __restrict__ x, const float* __restrict__ y,
                                     float* __restrict__ product, float* __restrict__ sum) {
    const int i = threadIdx.x;
    product[i] = x[i] * y[i];
    sum[i] = x[i] + y[i];
}

// Fails an assert() for negative inputs (a test of how the emulator reports it).
#include <cassert>
extern "C" __global__ void checked(const float* x) {
    assert(x[threadIdx.x] >= 0.0f);
}

// A thread whose locals need more than the emulator's default fiber stack.
extern "C" __global__ void stack_hog(float* out) {
    float big[100000];
    for (int k = 0; k < 100000; ++k) big[k] = out[0] * k;
    out[threadIdx.x] = big[99999 - threadIdx.x];
}

extern "C" __global__ void mulhi(const unsigned* __restrict__ a, const unsigned* __restrict__ b, unsigned* hi,
                                 unsigned* lo, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    hi[i] = __umulhi(a[i], b[i]);
    lo[i] = a[i] * b[i];
}
