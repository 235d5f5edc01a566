// sm90_tile.cuh: what the Hopper kernels (flash_fwd_sm90.cu, flash_bwd_sm90.cu) share on top of
// hopper.cuh and tc_tile.cuh: the CTA's roles (a producer warpgroup and CONSUMERS consumer warpgroups,
// their register split), the shared-memory tile as a 128B-swizzled TMA box lands it, and the wgmma
// descriptors of its k-steps.
//
// A tile of ROWS rows x HEAD_DIM columns (16-bit) lies as TMA boxes of 64 columns land it with the 128B
// swizzle: atoms of 64 columns (128 bytes a row, rows 128 bytes apart, the 16-byte chunk c of row r at
// chunk c ^ (r % 8)), the HEAD_DIM / 64 atoms of the tile one after the other (ATOM_BYTES<ROWS> apart),
// each 1024-byte aligned (the swizzle's repeat). That is wgmma's K-major 128B layout when the product
// runs along the columns (k_major: SBO 1024, 8 rows; k-step s at +32 s bytes inside its atom), and its
// MN-major 128B layout when it runs along the rows (mn_major: SBO 1024, 8 rows; LBO an atom, the next
// 64 columns; k-step t at +2048 t bytes).

#pragma once

#include "hopper.cuh"
#include "tc_tile.cuh"

constexpr int SM90_CONSUMERS = 2;                          // consumer warpgroups, 64 rows of the product each
constexpr int SM90_THREADS = 128 * (1 + SM90_CONSUMERS);   // launch.py's LAUNCH says the same
constexpr int SM90_STAGES = 2;                             // stages of a TMA ring
// setmaxnreg: the producer needs few registers, the consumers hold the accumulators; FA3's splits for
// two consumer warpgroups (24 x 128 + 240 x 256) and three (32 x 128 + 160 x 384), each the SM's 64 Ki
// registers. A CTA's warpgroups trade registers within what its launch took (the kernel's launch bound,
// 65536 / threads: 168 a thread with 384 threads, 128 with 512); setmaxnreg.inc past that would wait
// for ever (tests/test_hopper_nvrtc.py checks the counts ptxas gives). specs.SM90_REGISTERS says the same
template <int CONSUMERS>
constexpr int PRODUCER_REGISTERS = CONSUMERS == 2 ? 24 : 32;
template <int CONSUMERS>
constexpr int CONSUMER_REGISTERS = CONSUMERS == 2 ? 240 : 160;
constexpr int ATOM = 64;  // columns of a 128B-swizzled atom: 128 bytes of 16-bit elements
constexpr int SM90_SMEM_OPTIN = 227 * 1024;  // the most dynamic shared memory a CTA may opt in to on sm_90

// A compile-time int as a value: the argument of a generic lambda that indexes an array of accumulators,
// which must be a constant for them to stay in registers
template <int V>
struct Static {
    static constexpr int value = V;
};

// Bytes of an atom (64 columns) of a tile of ROWS rows
template <int ROWS>
constexpr int ATOM_BYTES = ROWS * 128;

// The wgmma descriptor of k-step ks (16 columns) of a K-major operand whose first row is at `rows` in
// a tile of ROWS rows: the step's atom, then 32 bytes a step inside its 128-byte rows
template <int ROWS>
__device__ __forceinline__ unsigned long long k_major(const unsigned char* rows, int ks) {
    return make_descriptor(rows + (16 * ks / ATOM) * ATOM_BYTES<ROWS> + (16 * ks % ATOM) * 2, 16, 1024, kSwizzle128B);
}

// The descriptor of k-step kt (16 rows, from `rows`) of a tile of ROWS rows as wgmma's MN-major
// operand: 16 rows are 2048 bytes, the next 64 columns an atom further (LBO)
template <int ROWS>
__device__ __forceinline__ unsigned long long mn_major(const unsigned char* rows, int kt) {
    return make_descriptor(rows + kt * 16 * 128, ATOM_BYTES<ROWS>, 1024, kSwizzle128B);
}

// TMA the ROWS x HEAD_DIM box at row `row` of head h of batch b (map: (head_dim, heads, seqlen, batch),
// innermost first; its box 64 x 1 x ROWS x 1) into `tile`, atom by atom, completing on bar: its first
// `atoms` atoms (the others lie wholly past head_dim: not loaded, their transaction bytes not expected)
template <int ROWS, int HEAD_DIM>
__device__ __forceinline__ void load_box(unsigned char* tile, const TensorMap& map, int h, int row, int b,
                                         unsigned long long* bar, int atoms = HEAD_DIM / ATOM) {
#pragma unroll
    for (int a = 0; a < HEAD_DIM / ATOM; ++a)
        if (a < atoms) tma_load_4d(tile + a * ATOM_BYTES<ROWS>, map, a * ATOM, h, row, b, bar);
}

// The byte of element (row, col) of a ROWS-row tile in its swizzled atoms (an ordinary store's address)
template <int ROWS>
__device__ __forceinline__ int swizzled_byte(int row, int col) {
    return (col / ATOM) * ATOM_BYTES<ROWS> + row * 128 + (((col % ATOM / 8) ^ (row % 8)) * 16) + col % 8 * 2;
}

// The dynamic shared memory, aligned up to the 128B swizzle's repeat (the launcher asks 1024 bytes more)
__device__ __forceinline__ unsigned char* aligned_smem(unsigned char* smem) {
    return smem + ((1024u - (smem_address(smem) & 1023u)) & 1023u);
}

// Zeros rows r0 .. ROWS - 1 of a ROWS x HEAD_DIM tile, thread `lane` of `lanes`: whole 128-byte rows of
// each atom, which the swizzle only permutes inside. A packed batch's (VARLEN) box reaches past its
// sequence into the next one's rows, which the kernel must see as the zeros a box past the tensor's end
// lands: P = 0 times a NaN in another sequence's row would be NaN
template <int ROWS, int HEAD_DIM>
__device__ __forceinline__ void zero_rows(unsigned char* tile, int r0, int lane, int lanes) {
    r0 = max(r0, 0);
    const int chunks = (ROWS - r0) * 8;  // 16 bytes each
#pragma unroll
    for (int a = 0; a < HEAD_DIM / ATOM; ++a)
        for (int c = lane; c < chunks; c += lanes)
            *reinterpret_cast<int4*>(tile + a * ATOM_BYTES<ROWS> + r0 * 128 + 16 * c) = make_int4(0, 0, 0, 0);
}

// Zeros atoms a0 .. of a ROWS x HEAD_DIM tile (contiguous: an atom is ROWS whole 128-byte rows), thread
// `lane` of `lanes`: the atoms load_box leaves out, which a wgmma reading the tile must see as zeros
template <int ROWS, int HEAD_DIM>
__device__ __forceinline__ void zero_atoms(unsigned char* tile, int a0, int lane, int lanes) {
    for (int c = lane; c < (HEAD_DIM / ATOM - a0) * ROWS * 8; c += lanes)
        *reinterpret_cast<int4*>(tile + a0 * ATOM_BYTES<ROWS> + 16 * c) = make_int4(0, 0, 0, 0);
}

// Zeros the rows r of a ROWS x HEAD_DIM tile for which dead(r), thread `lane` of `lanes`, as zero_rows:
// the rows of dO_i whose query sees no key (flash_bwd_sm90.cu: P = 0 times a NaN in their dout would be NaN)
template <int ROWS, int HEAD_DIM, typename Dead>
__device__ __forceinline__ void zero_rows_if(unsigned char* tile, Dead dead, int lane, int lanes) {
#pragma unroll
    for (int a = 0; a < HEAD_DIM / ATOM; ++a)
#pragma unroll 1
        for (int c = lane; c < ROWS * 8; c += lanes)
            if (dead(c / 8)) *reinterpret_cast<int4*>(tile + a * ATOM_BYTES<ROWS> + 16 * c) = make_int4(0, 0, 0, 0);
}
