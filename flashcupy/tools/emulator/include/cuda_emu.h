// cuda_emu.h: the CUDA device dialect as plain C++, so g++ can compile the very
// .cu files that CuPy hands to NVRTC and the emulator can run them on the CPU.
//
// The driver force-includes this header (g++ -include cuda_emu.h) ahead of the
// kernel source. It declares only what a GPU provides; the machinery behind
// barriers, warp collectives and traps lives in runtime.cpp and its parts (runtime/).
//
// Execution model, in one breath: the blocks of a grid run one after another;
// each CUDA thread of a block is a fiber with its own stack; a fiber runs until
// it reaches __syncthreads(), a warp collective or the end of the kernel, and
// the scheduler then runs the next fiber in the chosen thread order. Memory is
// therefore sequentially consistent, and a missing barrier shows up as a wrong
// answer under some thread order rather than as a weak-memory effect.

#pragma once

#include <cfloat>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <math.h>  // libstdc++'s math.h: expf, fmaxf, INFINITY, and isinf/isnan at global scope
#include <type_traits>

// Kernel headers test this to swap inline PTX for the emulator's versions (emu_tensor_core.h).
#define FLASHCUPY_EMULATOR 1

// ----------------------------------------------------------------------------
// declaration specifiers

#define __global__
#define __device__
#define __host__
#define __constant__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
// A kernel parameter whose address the kernel may take (a TMA tensor map): every parameter here.
#define __grid_constant__

// A __shared__ variable is one object per block. Blocks run one at a time, so a
// static object is enough; the section lets the runtime fill every static
// __shared__ object with garbage when a block starts, as on a GPU (statics of
// kernel templates reach that section through emu_shared.ld). `used` keeps g++
// from proving that no other fiber can touch the object.
// `extern __shared__` (dynamic shared memory) is rewritten by the driver
// before compilation, into EMU_DYNAMIC_SHARED below.
#define __shared__ static __attribute__((section("emu_shared"), used))

namespace emu {
// Base of this block's dynamic shared memory, set by the runtime per launch.
extern void* dynamic_shared;
}  // namespace emu

// `extern __shared__ T name[];` becomes `EMU_DYNAMIC_SHARED(name, T);`: a
// reference to the runtime's pointer, so `name[i]`, `name + k` and
// reinterpret_cast<U*>(name) read as they do on a GPU. (T last: it may hold commas.)
// Not static: a function-local static would land in the shared section (emu_shared.ld)
// and be overwritten with garbage at the next block.
#define EMU_DYNAMIC_SHARED(name, ...) \
    __VA_ARGS__* const& name = reinterpret_cast<__VA_ARGS__* const&>(emu::dynamic_shared)

// ----------------------------------------------------------------------------
// built-in types and variables

struct uint3 {
    unsigned int x, y, z;
};

struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
};

struct __align__(8) float2 { float x, y; };
struct __align__(16) float4 { float x, y, z, w; };
struct __align__(8) int2 { int x, y; };
struct __align__(16) int4 { int x, y, z, w; };
struct __align__(16) double2 { double x, y; };

inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline int2 make_int2(int x, int y) { return {x, y}; }
inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }
inline double2 make_double2(double x, double y) { return {x, y}; }

namespace emu {
struct Builtins {
    uint3 thread_idx;
    uint3 block_idx;
    dim3 block_dim;
    dim3 grid_dim;
};
// Rewritten by the scheduler before it resumes a fiber (thread_idx) or starts
// a block (the rest). Not const: the kernel must reload it after every call.
extern Builtins builtins;
}  // namespace emu

// Read-only views of the runtime's builtins: assigning to threadIdx does not compile.
inline const uint3& threadIdx = emu::builtins.thread_idx;
inline const uint3& blockIdx = emu::builtins.block_idx;
inline const dim3& blockDim = emu::builtins.block_dim;
inline const dim3& gridDim = emu::builtins.grid_dim;
// On a GPU warpSize is a run-time variable; here it is a constant.
static const int warpSize = 32;

// ----------------------------------------------------------------------------
// synchronisation

namespace emu {
enum Collective : int {
    kSyncWarp = 0, kShflIdx = 1, kShflUp = 2, kShflDown = 3, kShflXor = 4,
    kMma = 5, kLdmatrix = 6,  // warp-wide PTX instructions (emu_tensor_core.h), done by warp_all_gather
    kElect = 7,               // elect.sync (emu_hopper.h): every lane receives the elected lane
};

void block_barrier();
// Every lane named in `mask` meets here; returns the 64-bit payload this lane receives.
std::uint64_t warp_collective(int kind, unsigned mask, std::uint64_t payload, int operand, int width);
// All 32 lanes of the warp meet here (a `.sync.aligned` PTX instruction: every lane must be
// alive and execute the same `kind` with the same `variant`); returns every lane's `bytes`-byte
// record, in lane order (32 * bytes), copied once at the meeting into the warp's buffer, then
// `scratch` bytes of zeros the lanes may share (what the first lane to go on works out for all);
// the buffer stays the lanes' until every lane has come to the warp's next such meeting, so each
// may compute its share of the result from it on its own before then.
void* warp_all_gather(int kind, int variant, const void* mine, int bytes, int scratch = 0);
// The calling thread's lane in its warp (threads are numbered x fastest, as on a GPU).
unsigned lane_id();
// Report (as a KernelError naming the thread) unless [p, p + bytes) lies in shared memory and p
// is a multiple of `align`. `what` names the instruction.
void check_shared(const void* p, int bytes, int align, const char* what);
// cp.async: `bytes` (4, 8 or 16) are read from `src` now (only the first `src_bytes`; the rest
// is zero) and written to shared memory at `dst` only when a cp_async_wait lets the group
// holding them complete, so a missing wait leaves `dst` unwritten.
void cp_async(void* dst, const void* src, int bytes, int src_bytes);
void cp_async_commit();                 // the thread's uncommitted copies become its newest group
void cp_async_wait(int pending);        // complete all but the newest `pending` groups
[[noreturn]] void trap(const char* why);
// A lane's part in a warp-wide memory instruction, for the counters of a counted launch (runtime.cpp;
// op: 2 ldmatrix); returns at once otherwise.
void record_access(int op, const void* address, int bytes);
// A counting build's ex2.approx (emu_tensor_core.h): one exponential of the MUFU, for counters.py.
void count_ex2();
// memcpy that the instrumentation of a counting build does not see (the emulator's own copies).
void copy_raw(void* dst, const void* src, std::size_t bytes);

template <class T>
inline T shuffle(int kind, unsigned mask, T var, int operand, int width) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>);
    std::uint64_t bits = 0;
    std::memcpy(&bits, &var, sizeof(T));
    bits = warp_collective(kind, mask, bits, operand, width);
    std::memcpy(&var, &bits, sizeof(T));
    return var;
}
}  // namespace emu

inline void __syncthreads() { emu::block_barrier(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { emu::warp_collective(emu::kSyncWarp, mask, 0, 0, 32); }
// Fibers share one address space and run one at a time: every fence is free.
inline void __threadfence() {}
inline void __threadfence_block() {}
[[noreturn]] inline void __trap() { emu::trap("__trap() called"); }

// The overloads CUDA declares, one set per payload type.
#define EMU_SHUFFLES(T)                                                                      \
    inline T __shfl_sync(unsigned mask, T var, int src_lane, int width = 32) {               \
        return emu::shuffle(emu::kShflIdx, mask, var, src_lane, width);                      \
    }                                                                                        \
    inline T __shfl_up_sync(unsigned mask, T var, unsigned int delta, int width = 32) {      \
        return emu::shuffle(emu::kShflUp, mask, var, static_cast<int>(delta), width);        \
    }                                                                                        \
    inline T __shfl_down_sync(unsigned mask, T var, unsigned int delta, int width = 32) {    \
        return emu::shuffle(emu::kShflDown, mask, var, static_cast<int>(delta), width);      \
    }                                                                                        \
    inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32) {          \
        return emu::shuffle(emu::kShflXor, mask, var, lane_mask, width);                     \
    }

EMU_SHUFFLES(int)
EMU_SHUFFLES(unsigned int)
EMU_SHUFFLES(long)
EMU_SHUFFLES(unsigned long)
EMU_SHUFFLES(long long)
EMU_SHUFFLES(unsigned long long)
EMU_SHUFFLES(float)
EMU_SHUFFLES(double)

// ----------------------------------------------------------------------------
// atomics: fibers never preempt one another, so a plain read-modify-write is atomic.

#define EMU_ATOMIC(name, T, update)            \
    inline T name(T* address, T val) {         \
        T old = *address;                      \
        *address = (update);                   \
        return old;                            \
    }

EMU_ATOMIC(atomicAdd, int, old + val)
EMU_ATOMIC(atomicAdd, unsigned int, old + val)
EMU_ATOMIC(atomicAdd, unsigned long long, old + val)
EMU_ATOMIC(atomicAdd, float, old + val)
EMU_ATOMIC(atomicAdd, double, old + val)
EMU_ATOMIC(atomicMax, int, old > val ? old : val)
EMU_ATOMIC(atomicMax, unsigned int, old > val ? old : val)
EMU_ATOMIC(atomicMin, int, old < val ? old : val)
EMU_ATOMIC(atomicMin, unsigned int, old < val ? old : val)
EMU_ATOMIC(atomicExch, int, val)
EMU_ATOMIC(atomicExch, unsigned int, val)
EMU_ATOMIC(atomicExch, float, val)

inline int atomicCAS(int* address, int compare, int val) {
    int old = *address;
    *address = old == compare ? val : old;
    return old;
}

// ----------------------------------------------------------------------------
// maths beyond <math.h>
//
// The intrinsics below are computed exactly (to float precision), where a GPU
// uses faster, less accurate hardware approximations: __expf(x) here equals
// expf(x). g++ does not contract a*b+c into an FMA on x86-64 by default, where
// nvcc does; results may differ from a GPU in the last bits.

inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __fdividef(float x, float y) { return x / y; }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }

template <class To, class From>
inline To emu_bits(From from) {
    static_assert(sizeof(To) == sizeof(From));
    To to;
    std::memcpy(&to, &from, sizeof(To));
    return to;
}
inline float __int_as_float(int i) { return emu_bits<float>(i); }
inline int __float_as_int(float f) { return emu_bits<int>(f); }
inline float __uint_as_float(unsigned int i) { return emu_bits<float>(i); }
inline unsigned int __float_as_uint(float f) { return emu_bits<unsigned int>(f); }
inline double __longlong_as_double(long long i) { return emu_bits<double>(i); }
inline long long __double_as_longlong(double d) { return emu_bits<long long>(d); }

// The high 32 bits of the 64-bit product of two 32-bit unsigned ints (mul.hi.u32; mask.cuh's Philox).
inline unsigned int __umulhi(unsigned int a, unsigned int b) {
    return static_cast<unsigned int>((static_cast<unsigned long long>(a) * b) >> 32);
}

// CUDA's integer and floating max/min overloads (std::max is not in scope on a GPU either).
#define EMU_MINMAX(T)                                   \
    inline T max(T a, T b) { return a > b ? a : b; }    \
    inline T min(T a, T b) { return a < b ? a : b; }

EMU_MINMAX(int)
EMU_MINMAX(unsigned int)
EMU_MINMAX(long)
EMU_MINMAX(unsigned long)
EMU_MINMAX(long long)
EMU_MINMAX(unsigned long long)
EMU_MINMAX(float)
EMU_MINMAX(double)
inline unsigned int max(int a, unsigned int b) { return max(static_cast<unsigned int>(a), b); }
inline unsigned int max(unsigned int a, int b) { return max(a, static_cast<unsigned int>(b)); }
inline unsigned int min(int a, unsigned int b) { return min(static_cast<unsigned int>(a), b); }
inline unsigned int min(unsigned int a, int b) { return min(a, static_cast<unsigned int>(b)); }

// Read-only data cache load: an ordinary load here.
template <class T>
inline T __ldg(const T* p) { return *p; }
