// emu_tma.h: the emulator's versions of the TMA instructions that
// flashcupy/backends/cupy_backend/kernels/hopper.cuh wraps (tma_load_Nd, tma_store_Nd and the bulk
// groups), under the same names, and the emulator's own tensor map. hopper.cuh includes it after
// declaring TensorMap; the model lives in runtime/tma.h (it needs the scheduler's mbarriers).
//
//   TensorMap     128 bytes, 64-byte aligned, as the driver's CUtensorMap, but its bytes hold
//                 TmaMapLayout below: the arguments of cuTensorMapEncodeTiled as
//                 flashcupy/tools/emulator/tma.py's encode_tiled checked and packed them, with the
//                 guarded buffer's address filled in at the launch. A map whose magic is wrong
//                 (a driver-made CUtensorMap, garbage) or whose rank is not the instruction's is a
//                 KernelError.
//   tma_load      checked on issue; when it lands (when a thread waits on its mbarrier, the latest the
//                 hardware may write it; with cp_async="eager" at issue, the earliest: a stage refilled
//                 while a wgmma still reads it then gives that wgmma the new tile), copies the box from
//                 global memory to shared memory as hopper.cuh
//                 writes it out: dense, dim 0 innermost, then swizzled (none/32B/64B/128B) on the
//                 absolute shared-window address with the wgmma descriptor's XOR (runtime/wgmma.h's
//                 swizzled), so a 128B-swizzled box read by wgmma with a 128B descriptor is right.
//                 Elements outside the tensor are written as zeros. Then complete_tx of the box's
//                 full byte count on the named mbarrier (runtime/hopper.h). A destination not
//                 128-byte aligned (with or without swizzle), a box reaching
//                 outside shared memory, or an element of the tensor outside the array the map
//                 was made from (the guarded argument buffer) are KernelErrors naming the thread.
//   tma_store     checked on issue (the same checks); the box is read from shared memory (the same
//                 layout) when a wait_group (.read or not) covers its group, so a source overwritten
//                 before that wait is stored as overwritten, and written to global memory when a
//                 wait_group without .read covers it, or at the block's end; elements outside the
//                 tensor are not written.
//   async proxy   a load's landing makes its bytes async-written, a store's source read is an
//                 async-proxy read: an ordinary store to it that its writer has not followed with
//                 fence.proxy.async is a KernelError naming the writer (emu_hopper.h, runtime/proxy.h).
//   reduce-add    bulk_reduce_add_f32 (cp.reduce.async.bulk .add.f32, no tensor map): checked at issue
//                 (16-byte alignment and size, the source in shared memory and fenced, the destination
//                 inside one array argument); its source is read when a wait_group (.read or not)
//                 covers its group, so a source overwritten before that wait is wrong, and added into
//                 global memory when a wait_group without .read covers it (tma_store_wait_group), or
//                 at the block's end. A reduce-add after a flag_wait needs fence.proxy.async.global
//                 between them (emu_hopper.h's flags).
//   commit / wait stores not committed, or groups not waited for (wait_group.read N leaves at most N),
//                 when the thread exits are a KernelError (the next CTA on the SM may own that memory).
// Not modelled: a swizzled box whose inner extent is narrower than the swizzle span (encode_tiled
// refuses it: whether the hardware pads each row to the span is unverified), L2 promotion, interleaved layouts, OOB fill NaN, im2col, multicast and clusters,
// tensor reduce-adds. A load is checked at issue and lands (the copy, then complete_tx) when a thread
// waits on its mbarrier, or when every thread is blocked and one waits on it: a reader that skips
// the wait reads stale bytes; loads nobody waited for when the block ends are a KernelError. With
// cp_async="eager" it lands at issue instead.

#pragma once

#include "cuda_emu.h"

namespace emu {
constexpr std::uint32_t kTmaMagic = 0x50414d54;  // "TMAP"

// The emulator's tensor map, 128 bytes (tma.py's _LAYOUT packs the same fields in this order).
struct TmaMapLayout {
    std::uint32_t magic;
    std::uint32_t rank;           // 1..5
    std::uint32_t element_bytes;  // 1, 2, 4 or 8
    std::uint32_t swizzle;        // CUtensorMapSwizzle: 0 none, 1 32B, 2 64B, 3 128B
    std::uint32_t oob_fill;       // CUtensorMapFloatOOBfill: 0 none (zeros)
    std::uint32_t interleave;     // CUtensorMapInterleave: 0 none
    std::uint64_t address;        // global address of element (0, .., 0)
    std::uint32_t dims[5];        // globalDim, innermost first
    std::uint32_t reserved;
    std::uint64_t strides[4];     // globalStrides: bytes between elements of dims 1..rank-1
    std::uint32_t box[5];         // boxDim
    std::uint32_t element_strides[5];
};
static_assert(sizeof(TmaMapLayout) == 128, "a tensor map is 128 bytes");

void tma_load(void* dst, const void* map, int rank, const int* coords, void* bar);
void tma_store(const void* map, int rank, const int* coords, const void* src);
void bulk_reduce_add_f32(float* dst, const float* src, unsigned bytes);
void tma_commit_group();
void tma_wait_group(int pending, bool read_only);
}  // namespace emu

// hopper.cuh's TensorMap (the driver's CUtensorMap there), here holding a TmaMapLayout.
struct __align__(64) TensorMap {
    unsigned long long opaque[16];
};
static_assert(sizeof(TensorMap) == sizeof(emu::TmaMapLayout));

inline void tma_load_2d(void* dst, const TensorMap& map, int c0, int c1, unsigned long long* bar) {
    const int c[5] = {c0, c1, 0, 0, 0};
    emu::tma_load(dst, &map, 2, c, bar);
}
inline void tma_load_3d(void* dst, const TensorMap& map, int c0, int c1, int c2, unsigned long long* bar) {
    const int c[5] = {c0, c1, c2, 0, 0};
    emu::tma_load(dst, &map, 3, c, bar);
}
inline void tma_load_4d(void* dst, const TensorMap& map, int c0, int c1, int c2, int c3, unsigned long long* bar) {
    const int c[5] = {c0, c1, c2, c3, 0};
    emu::tma_load(dst, &map, 4, c, bar);
}
inline void tma_store_2d(const TensorMap& map, int c0, int c1, const void* src) {
    const int c[5] = {c0, c1, 0, 0, 0};
    emu::tma_store(&map, 2, c, src);
}
inline void tma_store_3d(const TensorMap& map, int c0, int c1, int c2, const void* src) {
    const int c[5] = {c0, c1, c2, 0, 0};
    emu::tma_store(&map, 3, c, src);
}
inline void tma_store_4d(const TensorMap& map, int c0, int c1, int c2, int c3, const void* src) {
    const int c[5] = {c0, c1, c2, c3, 0};
    emu::tma_store(&map, 4, c, src);
}
inline void bulk_reduce_add_f32(float* dst, const float* src, unsigned bytes) { emu::bulk_reduce_add_f32(dst, src, bytes); }
inline void tma_store_commit_group() { emu::tma_commit_group(); }
template <int N>
inline void tma_store_wait_group_read() {
    static_assert(N >= 0 && N <= 7, "cp.async.bulk.wait_group.read: N in [0, 7]");
    emu::tma_wait_group(N, true);
}
template <int N>
inline void tma_store_wait_group() {
    static_assert(N >= 0 && N <= 7, "cp.async.bulk.wait_group: N in [0, 7]");
    emu::tma_wait_group(N, false);
}
