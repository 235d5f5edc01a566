// tensor_core.cu: the primitives of tensor_core.cuh, one warp at a time (tests/test_emulator_tensor_core.py).
// Compiled with -I flashcupy/backends/cupy_backend/kernels, by the emulator and by NVRTC alike.
//
//   mma_fragments<T>      d = mma(a, b, c) on raw per-lane fragments: a (32 x 4), b (32 x 2) and
//                         c, d (32 x 4), lane-major, so the test checks the ISA's layouts itself
//   mma_k8_fragments      d = mma_m16n8k8_f16f32(a, b, c) (Turing's mma) on raw per-lane fragments:
//                         a (32 x 2), b (32 x 1), c, d (32 x 4)
//   ldmatrix_variant<NUM, TRANS>
//                         copies `tile` (n 16-bit elements) to shared memory; lane l passes the
//                         address tile + row_offsets[l] (null where row_offsets[l] < 0) to
//                         ldmatrix_xNUM{_trans}; out (32 x NUM) is what each lane receives
//   tile_matmul<T>        d (16 x 8, f32) = a (16 x 16) b (16 x 8), both row-major, through the
//                         whole pipeline: cp.async to shared memory (a in one group, b in the
//                         next; rows of a from a_rows on are zero-filled), ldmatrix_x4 for A,
//                         ldmatrix_x2_trans for B, one mma. wait_mode 0 waits for both groups;
//                         1 does not wait and 2 waits for all but the newest group (b's) before
//                         reading them: wrong on purpose, to prove that the emulator's cp.async
//                         bites (every mode waits for all before exiting). Launch with 768 bytes
//                         of dynamic shared memory
//   pack_and_exp          per thread: pack_f16x2 and pack_bf16x2 of (x[2i], x[2i+1]), and
//                         ex2_approx(x[i]); below sm_80 (no bfloat16 pack there) bf16 is left as is
//
// Built for sm_75 too (-arch=sm_75, TURING_NAMES in tests/tensor_core_blocks.py): the float16 kernels then
// run on tensor_core.cuh's Turing stand-ins (two m16n8k8 for m16n8k16, a plain copy for cp.async)
//   tensor_core_misuse    mode 0: lane 31 leaves before an mma; 1: a misaligned ldmatrix row;
//                         2: cp.async into global memory; 3: lane 0 exits with a committed
//                         cp.async group never waited for; 4: with a cp.async never committed

#include "tensor_core.cuh"

template <typename T>
__global__ void mma_fragments(const unsigned* __restrict__ a, const unsigned* __restrict__ b,
                              const float* __restrict__ c, float* __restrict__ d) {
    const int lane = threadIdx.x;
    unsigned a_frag[4], b_frag[2];
    float c_frag[4], d_frag[4];
    for (int i = 0; i < 4; ++i) a_frag[i] = a[4 * lane + i];
    for (int i = 0; i < 2; ++i) b_frag[i] = b[2 * lane + i];
    for (int i = 0; i < 4; ++i) c_frag[i] = c[4 * lane + i];
    mma_m16n8k16<T>(d_frag, a_frag, b_frag, c_frag);
    for (int i = 0; i < 4; ++i) d[4 * lane + i] = d_frag[i];
}

extern "C" __global__ void mma_k8_fragments(const unsigned* __restrict__ a, const unsigned* __restrict__ b,
                                            const float* __restrict__ c, float* __restrict__ d) {
    const int lane = threadIdx.x;
    unsigned a_frag[2] = {a[2 * lane], a[2 * lane + 1]}, b_frag[1] = {b[lane]};
    float c_frag[4], d_frag[4];
    for (int i = 0; i < 4; ++i) c_frag[i] = c[4 * lane + i];
    mma_m16n8k8_f16f32(d_frag, a_frag, b_frag, c_frag);
    for (int i = 0; i < 4; ++i) d[4 * lane + i] = d_frag[i];
}

template <int NUM, bool TRANS>
__global__ void ldmatrix_variant(const unsigned short* __restrict__ tile, int n, const int* __restrict__ row_offsets,
                                 unsigned* __restrict__ out) {
    extern __shared__ __align__(16) unsigned short tile_s[];
    const int lane = threadIdx.x;
    for (int e = lane; e < n; e += 32) tile_s[e] = tile[e];
    __syncwarp();  // the whole tile is in shared memory before any lane's row is read
    const unsigned short* row = row_offsets[lane] < 0 ? nullptr : tile_s + row_offsets[lane];
    unsigned r[NUM];
    if constexpr (NUM == 1 && !TRANS) ldmatrix_x1(r, row);
    if constexpr (NUM == 2 && !TRANS) ldmatrix_x2(r, row);
    if constexpr (NUM == 4 && !TRANS) ldmatrix_x4(r, row);
    if constexpr (NUM == 1 && TRANS) ldmatrix_x1_trans(r, row);
    if constexpr (NUM == 2 && TRANS) ldmatrix_x2_trans(r, row);
    if constexpr (NUM == 4 && TRANS) ldmatrix_x4_trans(r, row);
    for (int m = 0; m < NUM; ++m) out[NUM * lane + m] = r[m];
}

template <typename T>
__global__ void tile_matmul(const T* __restrict__ a, const T* __restrict__ b, float* __restrict__ d, int a_rows,
                            int wait_mode) {
    // dynamic shared memory, 768 bytes: A_s (16 x 16), then B_s (16 x 8)
    extern __shared__ __align__(16) unsigned char smem[];
    T* A_s = reinterpret_cast<T*>(smem);
    T* B_s = A_s + 16 * 16;
    const int lane = threadIdx.x, g = lane / 4, t = lane % 4;

    // A: 32 chunks of 8 elements, two per row; B: 16 chunks, one per row
    const bool valid = lane / 2 < a_rows;
    cp_async_16(A_s + 8 * lane, valid ? a + 8 * lane : a, valid);
    cp_async_commit();
    if (lane < 16) cp_async_16(B_s + 8 * lane, b + 8 * lane);
    cp_async_commit();
    if (wait_mode == 0) cp_async_wait<0>();
    if (wait_mode == 2) cp_async_wait<1>();
    __syncwarp();  // every lane's copies have landed before any lane reads them

    // A's four 8x8 quarters, in fragment order: rows 0-7 | 8-15 of columns 0-7, then of 8-15
    unsigned a_frag[4], b_frag[2];
    ldmatrix_x4(a_frag, A_s + 16 * (lane % 16) + 8 * (lane / 16));
    // B's two 8x8 halves (k 0-7, 8-15), transposed into the "col" layout; lanes 16-31 unused
    ldmatrix_x2_trans(b_frag, B_s + 8 * (lane % 16));
    const float zero[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    float d_frag[4];
    mma_m16n8k16<T>(d_frag, a_frag, b_frag, zero);
    for (int i = 0; i < 4; ++i) d[8 * (g + 8 * (i >> 1)) + 2 * t + (i & 1)] = d_frag[i];
    cp_async_wait<0>();  // no copy may be in flight when the thread exits
}

extern "C" __global__ void pack_and_exp(const float* __restrict__ x, unsigned* __restrict__ f16,
                                        unsigned* __restrict__ bf16, float* __restrict__ e) {
    const int i = threadIdx.x;
    f16[i] = pack_f16x2(x[2 * i], x[2 * i + 1]);
#if __CUDA_ARCH__ >= AMPERE_ARCH
    bf16[i] = pack_bf16x2(x[2 * i], x[2 * i + 1]);
#endif
    e[i] = ex2_approx(x[i]);
}

extern "C" __global__ void tensor_core_misuse(int mode, unsigned* global) {
    __shared__ __align__(16) unsigned short tile_s[8 * 8 + 8];
    const int lane = threadIdx.x;
    for (int e = lane; e < 8 * 8 + 8; e += 32) tile_s[e] = 0;
    __syncwarp();  // the tile is zero before ldmatrix reads it
    unsigned r[4] = {0, 0, 0, 0};
    if (mode == 0) {
        if (lane == 31) return;
        const float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        float d[4];
        mma_m16n8k16_f16f32(d, r, r, c);
        r[0] = static_cast<unsigned>(d[0]);
    } else if (mode == 1) {
        ldmatrix_x1(r, tile_s + 8 * (lane % 8) + 1);
    } else if (mode == 2) {
        cp_async_16(global, tile_s);
        cp_async_commit();
        cp_async_wait<0>();
    } else if (lane == 0) {
        cp_async_16(tile_s, global);
        if (mode == 3) cp_async_commit();
    }
    global[lane] = r[0];
}
