"""wgmma's building blocks: shared-memory tiles laid out by hand in NumPy, the accumulator fragment
layout, and the checks of tests/emulator_kernels/wgmma.cu against NumPy's matmul, for the emulator
(tests/test_emulator_wgmma.py) and a GPU (tests/test_hopper_gpu.py) alike.

The layouts are the PTX ISA's canonical ones as hopper.cuh writes them out, built here from scratch
for a whole tile (rows x K, 16-bit elements), with the swizzle applied to the byte offset from the
tile's start (the kernel puts every tile at a multiple of 1024 bytes):
  K-major, no swizzle    8x8 core matrices of 128 contiguous bytes: (mn % 8) 16 + (k % 8) 2, core
                         matrices along mn 128 bytes apart (SBO), along k rows * 16 apart (LBO)
  K-major, swizzle W     rows of W bytes, 8-row groups 8 W apart (SBO); K beyond W / 2 elements in
                         further atoms, rows * W apart (the next k16 step's start, not LBO)
  MN-major, no swizzle   core matrices of 8 mn (16 bytes) x 8 k rows; along mn 128 apart (SBO),
                         along k rows * 16 apart (LBO)
  MN-major, swizzle W    k rows of W bytes (W / 2 elements of mn), 8-row groups 8 W apart (SBO),
                         atoms along mn K * W apart (LBO)
then the 16-byte chunk bits [4, 4 + b) XOR bits [7, 7 + b), b = log2(W / 16).
"""

from __future__ import annotations

import os

import numpy as np

from flashcupy.backends.cupy_backend import sources
from tensor_core_blocks import from_bits as from_bits_32, to_bits  # noqa: F401 (tma_blocks uses to_bits)

HERE = os.path.dirname(os.path.abspath(__file__))
TEST_KERNELS = os.path.join(HERE, "emulator_kernels", "wgmma.cu")
INCLUDE = f"-I{sources.KERNEL_DIR}"
CUDA_NAME = {"float16": "__half", "bfloat16": "__nv_bfloat16"}
# N = 64, 128, 192, 256: the kernels' S = Q K_jᵀ (K_j K-major) and O += P V_j (V_j MN-major, N = head_dim:
# 192 and 256 at head_dim 136..256)
SIZES = (64, 128, 192, 256)
# N = 80, 176: S = Q K_jᵀ of head_dim 256's key block and of the wide forward's at 128
# (specs.SM90_FORWARD_TILES, SM90_WIDE_FORWARD_TILES), whose B (K_j) is K-major only (as an MN-major
# operand they are not whole 128B-swizzled atoms; no kernel uses them so); N = 32: the head_dim-256
# backward's Sᵀ = K_j Q_cᵀ and dPᵀ, B a consumer's 32 rows of Q_i (dO_i), K-major
K_MAJOR_SIZES = (32, 80, 176)
NAMES = tuple(f"wgmma_gemm<{t}, {n}>" for t in CUDA_NAME.values() for n in SIZES + K_MAJOR_SIZES)
SWIZZLE = {"none": (0, 16), "128B": (1, 128), "64B": (2, 64), "32B": (3, 32)}  # descriptor mode, span


def source():
    with open(TEST_KERNELS) as f:
        return f.read()


def name(fmt, n):
    return f"wgmma_gemm<{CUDA_NAME[fmt]}, {n}>"


# ----------------------------------------------------------------------------
# 16-bit formats: tensor_core_blocks.py's, the products' reference in float64


def from_bits(bits, fmt):
    return from_bits_32(bits, fmt).astype(np.float64)
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


# ----------------------------------------------------------------------------
# tiles in shared memory


def layout(rows, K, swizzle, mn_major):
    """(byte offset of element (mn, k) before the swizzle, rows x K; lbo; sbo; start of each k16 step)."""
    span = SWIZZLE[swizzle][1]
    mn, k = np.meshgrid(np.arange(rows), np.arange(K), indexing="ij")
    steps = np.arange(K // 16)
    if not mn_major and span == 16:
        lbo, sbo = rows * 16, 128
        off = (k // 8) * lbo + (mn // 8) * sbo + (mn % 8) * 16 + (k % 8) * 2
        starts = 2 * steps * lbo
    elif not mn_major:
        per_row = span // 2
        lbo, sbo = 16, 8 * span  # lbo unused: any non-zero value
        off = (k // per_row) * rows * span + (mn // 8) * sbo + (mn % 8) * span + (k % per_row) * 2
        starts = (16 * steps // per_row) * rows * span + (16 * steps % per_row) * 2
    elif span == 16:
        lbo, sbo = rows * 16, 128
        off = (mn // 8) * sbo + (k // 8) * lbo + (k % 8) * 16 + (mn % 8) * 2
        starts = 2 * steps * lbo
    else:
        per_row = span // 2
        lbo, sbo = K * span, 8 * span
        off = (mn // per_row) * lbo + (k // 8) * sbo + (k % 8) * span + (mn % per_row) * 2
        starts = 2 * steps * sbo
    return off, lbo, sbo, starts


def swizzled(off, swizzle):
    span = SWIZZLE[swizzle][1]
    if span == 16:
        return off
    return off ^ (((off >> 7) & (span // 16 - 1)) << 4)


def place(image, at, bits, swizzle, mn_major):
    """Write tile `bits` (rows x K uint16) into `image` (uint8) at byte `at`; return (lbo, sbo, starts)."""
    off, lbo, sbo, starts = layout(*bits.shape, swizzle, mn_major)
    words = image[at:].view(np.uint16)
    words[swizzled(off, swizzle).ravel() // 2] = bits.ravel()
    assert len(set(swizzled(off, swizzle).ravel())) == bits.size  # a bijection onto the tile
    return lbo, sbo, starts


# ----------------------------------------------------------------------------
# the accumulator fragments


def fragment_index(n):
    """(row, col) of d[i] of each of the 128 threads: arrays 128 x N/2."""
    tid = np.arange(128)[:, None]
    i = np.arange(n // 2)[None, :]
    warp, lane = tid // 32, tid % 32
    j, h, v = i // 4, (i // 2) % 2, i % 2
    return 16 * warp + lane // 4 + 8 * h, 8 * j + 2 * (lane % 4) + v


def to_fragments(C):
    rows, cols = fragment_index(C.shape[1])
    return C[rows, cols].astype(np.float32)


def from_fragments(frags, n):
    D = np.full((64, n), np.nan, np.float32)
    rows, cols = fragment_index(n)
    D[rows, cols] = frags.reshape(128, n // 2)
    return D


# ----------------------------------------------------------------------------
# one launch


MODES = {"normal": 0, "early read": 1, "two groups": 2, "mismatched warp": 3, "unaligned A": 4,
         "base offset B": 5, "no fence": 6, "warp exits": 7, "early write": 8, "deadlock": 9,
         "P V": 10, "no proxy fence": 11, "proxy fence in thread 0 only": 12}


# The sums are of up to 64 exact products of magnitude ~1 (|D| ~ 8): the emulator rounds once; a
# GPU's tensor cores add in their own order with their own fp32 adders, a few ulp of the partial sums.
RTOL, ATOL = 1e-5, 1e-4


CFG_FIELDS = ("steps", "a_lbo", "a_sbo", "a_swizzle", "b_offset", "b_lbo", "b_sbo", "b_swizzle")


def problem(fmt, n, K, rng):
    A = to_bits(rng.standard_normal((64, K)), fmt)
    B = to_bits(rng.standard_normal((K, n)), fmt)
    C = rng.standard_normal((64, n)).astype(np.float32)
    return A, B, C


def want(fmt, A, B, C=None):
    D = from_bits(A, fmt) @ from_bits(B, fmt)
    return D if C is None else D + C


def run(kernel, fmt, A, B, C=None, a_swizzle="128B", b_swizzle="128B", trans_a=False, trans_b=False, rs=False,
        mode="normal", static=False, **fields):
    """D (64 x N) of wgmma_gemm<fmt, N> on A (64 x K) and B (K x N), both uint16 bits; C: accumulate onto it.
    Mode "two groups" returns the three matrices the kernel writes. `fields` (a_lbo=0, ...) replace the
    descriptor fields the layout needs, wrong on purpose. static: the tiles in static __shared__ memory."""
    K, n = B.shape
    footprint = [int(swizzled(layout(rows, K, sw, mn)[0], sw).max()) + 2 for rows, sw, mn in
                 ((64, a_swizzle, trans_a), (n, b_swizzle, trans_b))]
    b_offset = -(-footprint[0] // 1024) * 1024
    image = np.zeros(b_offset + -(-footprint[1] // 16) * 16, np.uint8)
    a_lbo, a_sbo, a_starts = place(image, 0, A, a_swizzle, trans_a)
    # B is stored as its transpose, N rows of K (K-major), or as itself, K rows of N: MN-major
    b_lbo, b_sbo, b_starts = place(image, b_offset, np.ascontiguousarray(B.T), b_swizzle, trans_b)
    steps = K // 16
    cfg = [steps, a_lbo, a_sbo, SWIZZLE[a_swizzle][0], b_offset, b_lbo, b_sbo, SWIZZLE[b_swizzle][0],
           int(trans_a), int(trans_b), int(rs), int(C is not None), MODES[mode], int(static)]
    for key, value in fields.items():
        cfg[CFG_FIELDS.index(key)] = value
    for s in range(steps):
        cfg += [int(a_starts[s]), int(b_starts[s])]
    copies = 3 if mode == "two groups" else 1
    out = np.full(copies * 128 * n // 2, -1, np.float32)
    c = to_fragments(C) if C is not None else np.zeros((128, n // 2), np.float32)
    a_global = A.view(np.float16) if fmt == "float16" else A
    kernel(name(fmt, n))((1,), (128,), (image.view(np.int32), np.int32(image.size // 4), np.array(cfg, np.int32),
                                        c.ravel(), np.ascontiguousarray(a_global), out),
                         shared_mem=16 if static else image.size + 1024)
    if copies == 1:
        return from_fragments(out, n)
    return [from_fragments(part, n) for part in out.reshape(copies, -1)]


# ----------------------------------------------------------------------------
# the checks, each on the kernels `kernel` gives


def check_identity_picks_b(kernel, fmt, n, b_swizzle, trans_b):
    """A = [I 0] (64 x 16 over rows 0..15): D's first 16 rows are B, the rest 0, exactly."""
    rng = np.random.default_rng(n)
    B = to_bits(rng.integers(-64, 64, (16, n)).astype(np.float32), fmt)
    A = to_bits(np.eye(64, 16), fmt)
    np.testing.assert_array_equal(run(kernel, fmt, A, B, a_swizzle="none", b_swizzle=b_swizzle, trans_b=trans_b),
                                  want(fmt, A, B))


def check_gemm(kernel, fmt, n, K, a_swizzle, b_swizzle, trans_a, trans_b, rs, accumulate, rng):
    """D = A B (+ C) over K / 16 chained k16 steps against NumPy (products exact, one rounding)."""
    A, B, C = problem(fmt, n, K, rng)
    got = run(kernel, fmt, A, B, C if accumulate else None, a_swizzle, b_swizzle, trans_a, trans_b, rs)
    np.testing.assert_allclose(got, want(fmt, A, B, C if accumulate else None), rtol=RTOL, atol=ATOL)


def check_static_shared_tiles(kernel, fmt, rng):
    """The same GEMM with the tiles in a static __shared__ array (aligned by its declaration)."""
    A, B, C = problem(fmt, 128, 64, rng)
    got = run(kernel, fmt, A, B, C, trans_b=True, static=True)
    np.testing.assert_allclose(got, want(fmt, A, B, C), rtol=RTOL, atol=ATOL)


def check_d_packed_as_the_next_a(kernel, trans_b, rng, n=64):
    """D = A B (N = K = 64: at 128 the two tiles pass 48 KiB of shared memory) packed to f16 in registers as the A of an RS wgmma against B again: T(A B) B, exactly
    (small integers: every sum exact in f32, every D exact in f16)."""
    A = to_bits(rng.integers(-3, 4, (64, n)).astype(np.float32), "float16")
    B = to_bits(rng.integers(-3, 4, (n, n)).astype(np.float32), "float16")
    D = want("float16", A, B)
    assert np.abs(D).max() <= 2048  # integers exact in f16
    got = run(kernel, "float16", A, B, trans_b=trans_b, mode="P V")
    np.testing.assert_array_equal(got, D @ from_bits(B, "float16"))


def check_wait_group_1_completes_the_older_group(kernel, fmt, rng):
    """Two groups; wait_group 1 completes the first (acc0 right); wait_group 0 then the second."""
    A, B, _ = problem(fmt, 64, 64, rng)
    acc0, acc1_early, acc1 = run(kernel, fmt, A, B, mode="two groups")
    D = want(fmt, A, B)
    np.testing.assert_allclose(acc0, D, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(acc1, D, rtol=RTOL, atol=ATOL)
    return acc1_early, D
