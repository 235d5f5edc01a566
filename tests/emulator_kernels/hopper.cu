// hopper.cu: the primitives of hopper.cuh, one at a time (tests/test_emulator_hopper.py).
// Compiled with -I flashcupy/backends/cupy_backend/kernels, by the emulator and by NVRTC (sm_90a).
//
//   ring                  a producer warp and two consumer warps (96 threads) pass `tiles` tiles of
//                         64 floats of x through a 2-stage ring in shared memory, as a TMA pipeline
//                         does: per stage a "full" mbarrier (count 1: the elected producer lane's
//                         arrive.expect_tx of the tile's bytes, each producer lane's complete_tx of
//                         the 8 bytes it wrote) and an "empty" one (count 64, the consumers).
//                         out[c] = sum over tiles of x[64 t + c]. mode 1: the consumers skip the
//                         wait on full; 2: the producer skips the wait on empty; 3: the producer
//                         expects 4 bytes more than it completes (wrong on purpose, all three)
//   mbarrier_cases        64 threads, the mbarrier at byte 8 of 16 bytes of dynamic shared memory.
//                         mode 0: count 2, one arrival, everyone waits on phase 0; 1: count 1, one
//                         arrive.expect_tx of 64 bytes never completed; 2: count 64, three phases in
//                         which each thread writes 100 p + tid, arrives, waits, and reads its
//                         neighbour's: out[4 tid + p]; out[4 tid + 3] = 1 after waits on parities
//                         that had completed already (1 before any arrival, 0 after three phases);
//                         3: an arrive before any init; 4: one arrival too many; 5: init count 0;
//                         6: count 1, one arrival, everyone waits on phase 1
//   named                 128 threads: warps 0-1 write data[tid] = 10 tid + 1 and bar.arrive 1, 128;
//                         warps 2-3 bar.sync 1, 128 and read it: out[tid] = data[tid - 64] (0 for
//                         warps 0-1). mode 1: no bar.sync; 2: count 96 everywhere; 3: count 100;
//                         4: id 16; 5: the consumers sync with count 96; 6: count 160; 7: only the
//                         bar.arrive of warps 0-1, nobody waits
//   elect                 one warp: lanes in `live` call elect_one_sync(mask), out[lane] = 1 if
//                         elected else 0; the others exit at once (out = -1)
//   maxnreg               warpgroup 0 setmaxnreg_dec<24>, warpgroup 1 setmaxnreg_inc<240>, then
//                         out[tid] = 1. mode 1: dec<20>; 2: inc<264>; 3: warp 1 dec<32>; 4:
//                         warpgroup 0 then dec<56>; 5: as 0, launched with 192 threads; 6: warp 3
//                         exits first
//   spin_on_flag          thread 0 spins until thread 1 sets a flag: a wait written as a polling loop
//                         instead of an mbarrier wait, which never ends here (fibers are cooperative)

#include "hopper.cuh"

constexpr int TILE = 64;
constexpr int STAGES = 2;

extern "C" __global__ void ring(const float* __restrict__ x, int tiles, float* __restrict__ out, int mode) {
    __shared__ float buf[STAGES][TILE];
    __shared__ unsigned long long full[STAGES], empty[STAGES];
    const int tid = threadIdx.x;
    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbarrier_init(&full[s], 1);
            mbarrier_init(&empty[s], 64);
        }
        mbarrier_init_fence();
    }
    // the inits before any arrival or wait
    __syncthreads();
    if (tid < 32) {
        for (int t = 0; t < tiles; ++t) {
            const int s = t % STAGES;
            const unsigned phase = (t / STAGES) & 1;
            // the consumers have finished with the tile this stage held (passes at once the first time)
            if (mode != 2) mbarrier_wait_parity(&empty[s], phase ^ 1);
            if (elect_one_sync()) mbarrier_arrive_expect_tx(&full[s], TILE * sizeof(float) + (mode == 3 ? 4 : 0));
            for (int i = tid; i < TILE; i += 32) buf[s][i] = x[t * TILE + i];
            mbarrier_complete_tx(&full[s], (TILE / 32) * sizeof(float));
        }
    } else {
        const int c = tid - 32;
        float acc = 0.0f;
        for (int t = 0; t < tiles; ++t) {
            const int s = t % STAGES;
            const unsigned phase = (t / STAGES) & 1;
            if (mode != 1) mbarrier_wait_parity(&full[s], phase);  // the tile has landed
            acc += buf[s][c];
            mbarrier_arrive(&empty[s]);
        }
        out[c] = acc;
    }
}

extern "C" __global__ void mbarrier_cases(int mode, int* __restrict__ out) {
    extern __shared__ unsigned long long smem[];
    __shared__ int data[64];
    unsigned long long* bar = &smem[1];
    const int tid = threadIdx.x;
    if (mode == 3) {
        mbarrier_arrive(bar);
        return;
    }
    if (tid == 0) mbarrier_init(bar, mode == 5 ? 0 : mode == 0 ? 2 : mode == 2 ? 64 : 1);
    __syncthreads();  // the init before any use
    if (mode == 0 || mode == 6) {
        if (tid == 0) mbarrier_arrive(bar);
        mbarrier_wait_parity(bar, mode == 6);
    } else if (mode == 1) {
        if (tid == 0) mbarrier_arrive_expect_tx(bar, 64);
        mbarrier_wait_parity(bar, 0);
    } else if (mode == 2) {
        mbarrier_wait_parity(bar, 1);
        for (int p = 0; p < 3; ++p) {
            data[tid] = 100 * p + tid;
            mbarrier_arrive(bar);
            mbarrier_wait_parity(bar, p & 1);
            out[4 * tid + p] = data[(tid + 1) % 64];
            __syncthreads();  // every read of this phase before the next phase's writes
        }
        mbarrier_wait_parity(bar, 0);
        out[4 * tid + 3] = 1;
    } else if (mode == 4 && tid == 0) {
        mbarrier_arrive_expect_tx(bar, 16);
        mbarrier_arrive(bar);
    }
}

extern "C" __global__ void named(int mode, int* __restrict__ out) {
    __shared__ int data[64];
    const int tid = threadIdx.x;
    const unsigned count = mode == 2 ? 96 : mode == 3 ? 100 : mode == 6 ? 160 : 128;
    if (tid < 64) {
        data[tid] = 10 * tid + 1;
        named_barrier_arrive(mode == 4 ? 16 : 1, count);
        out[tid] = 0;
    } else {
        if (mode == 7) return;
        if (mode != 1) named_barrier_sync(1, mode == 5 ? 96 : count);
        out[tid] = data[tid - 64];
    }
}

extern "C" __global__ void elect(unsigned live, unsigned mask, int* __restrict__ out) {
    const int lane = threadIdx.x;
    if (!((live >> lane) & 1u)) {
        out[lane] = -1;
        return;
    }
    out[lane] = elect_one_sync(mask) ? 1 : 0;
}

// a register cap at entry (one CTA per SM), without which ptxas drops setmaxnreg
extern "C" __global__ void __launch_bounds__(256, 1) maxnreg(int mode, int* __restrict__ out) {
    const int warp = threadIdx.x / 32;
    if (mode == 6 && warp == 3) return;
    if (warp < 4) {
#ifdef FLASHCUPY_EMULATOR  // out of range: under NVRTC hopper.cuh's static_assert rejects these
        if (mode == 1) setmaxnreg_dec<20>();
        else
#endif
        if (mode == 3 && warp == 1) setmaxnreg_dec<32>();
        else setmaxnreg_dec<24>();
        if (mode == 4) setmaxnreg_dec<56>();
    } else {
#ifdef FLASHCUPY_EMULATOR
        if (mode == 2) setmaxnreg_inc<264>();
        else
#endif
        setmaxnreg_inc<240>();
    }
    out[threadIdx.x] = 1;
}

extern "C" __global__ void spin_on_flag(int* __restrict__ out) {
    __shared__ volatile int flag;
    if (threadIdx.x == 0) {
        flag = 0;
        while (flag == 0) {
        }
    } else {
        flag = 1;
    }
    out[threadIdx.x] = 1;
}
