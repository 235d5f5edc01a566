"""The tensor-core building blocks' test kernels, the PTX ISA's fragment layouts in NumPy, and the
checks that hold the one against the other, for the emulator and a GPU alike.

The kernels are tests/emulator_kernels/tensor_core.cu (source, NAMES, INCLUDE). Each check launches
them through `kernel`, the emulator's; tests/test_emulator_tensor_core.py runs the checks so,
tests/test_tensor_core_gpu.py with `kernel` replaced by cupy's on a real GPU, and tests/test_nvrtc.py
compiles the same kernels for sm_80 and sm_90.
"""

from __future__ import annotations

import os

import numpy as np

from flashcupy.backends.cupy_backend import sources
from flashcupy.tools.emulator import EmulatedModule, garbage

HERE = os.path.dirname(os.path.abspath(__file__))
TEST_KERNELS = os.path.join(HERE, "emulator_kernels", "tensor_core.cu")
INCLUDE = f"-I{sources.KERNEL_DIR}"
NARROW = ("float16", "bfloat16")
CUDA_NAME = {"float16": "__half", "bfloat16": "__nv_bfloat16"}
LDMATRIX = [(num, trans) for num in (1, 2, 4) for trans in (False, True)]


def source():
    with open(TEST_KERNELS) as f:
        return f.read()


NAMES = ([f"mma_fragments<{t}>" for t in CUDA_NAME.values()] + ["mma_k8_fragments"]
         + [f"ldmatrix_variant<{num}, {str(trans).lower()}>" for num, trans in LDMATRIX]
         + [f"tile_matmul<{t}>" for t in CUDA_NAME.values()]
         + ["pack_and_exp", "tensor_core_misuse"])

# What a Turing GPU runs of them (float16; tensor_core.cuh's stand-ins for the sm_80 instructions), built
# for sm_75 on the emulator and with -DAMPERE_ARCH past the device's own arch on a GPU (TURING_OPTIONS)
TURING_NAMES = ["mma_fragments<__half>", "mma_k8_fragments", "tile_matmul<__half>", "pack_and_exp"]
TURING_OPTIONS = {"emulator": ("-arch=sm_75",), "gpu": ("-DAMPERE_ARCH=1000",)}

_modules = {}


def kernel(name, order="ascending", turing=False):
    """The test kernel `name` on the emulator, built for sm_75 if `turing` (else sm_90)."""
    key = (order, turing)
    if key not in _modules:
        names, options = (TURING_NAMES, TURING_OPTIONS["emulator"]) if turing else (NAMES, ())
        _modules[key] = EmulatedModule(source(), names, (INCLUDE, *options), thread_order=order)
    return _modules[key].get_function(name)


# ----------------------------------------------------------------------------
# 16-bit formats and the ISA's fragment layouts, in NumPy


def to_bits(x, fmt):
    """uint16 patterns of float32 `x` rounded to `fmt` (nearest, ties to even)."""
    x = np.asarray(x, np.float32)
    if fmt == "float16":
        with np.errstate(over="ignore"):
            return x.astype(np.float16).view(np.uint16)
    bits = x.view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def from_bits(bits, fmt):
    bits = np.asarray(bits, np.uint16)
    if fmt == "float16":
        return bits.view(np.float16).astype(np.float32)
    return (bits.astype(np.uint32) << 16).view(np.float32)


def pair(lo, hi):
    return np.uint32(lo) | np.uint32(hi) << np.uint32(16)


def lanes():
    """(lane, g, t) for the 32 lanes: groupID and threadID_in_group."""
    return [(lane, lane // 4, lane % 4) for lane in range(32)]


def a_fragments(A):
    """A (16x16 uint16, row-major) -> 32 x 4 .b32: a[i] holds A[g + 8 (i & 1)][2t + 8 (i >> 1) + {0, 1}]."""
    out = np.empty((32, 4), np.uint32)
    for lane, g, t in lanes():
        for i in range(4):
            r, c = g + 8 * (i & 1), 2 * t + 8 * (i >> 1)
            out[lane, i] = pair(A[r, c], A[r, c + 1])
    return out


def b_fragments(B):
    """B (16x8 uint16, K x N) -> 32 x 2 .b32: b[i] holds B[2t + 8 i + {0, 1}][g]."""
    out = np.empty((32, 2), np.uint32)
    for lane, g, t in lanes():
        for i in range(2):
            k = 2 * t + 8 * i
            out[lane, i] = pair(B[k, g], B[k + 1, g])
    return out


def a8_fragments(A):
    """A (16x8 uint16, row-major) -> 32 x 2 .b32, m16n8k8's: a[i] holds A[g + 8 i][2t + {0, 1}]."""
    return np.ascontiguousarray(a_fragments(np.pad(A, ((0, 0), (0, 8))))[:, :2])


def b8_fragments(B):
    """B (8x8 uint16, K x N) -> 32 x 1 .b32, m16n8k8's: b[0] holds B[2t + {0, 1}][g]."""
    return np.ascontiguousarray(b_fragments(np.pad(B, ((0, 8), (0, 0))))[:, :1])


def c_fragments(C):
    """C (16x8 float32) -> 32 x 4: c[i] = C[g + 8 (i >> 1)][2t + (i & 1)]."""
    out = np.empty((32, 4), np.float32)
    for lane, g, t in lanes():
        for i in range(4):
            out[lane, i] = C[g + 8 * (i >> 1), 2 * t + (i & 1)]
    return out


def c_matrix(frags):
    """The inverse of c_fragments."""
    C = np.empty((16, 8), np.float32)
    for lane, g, t in lanes():
        for i in range(4):
            C[g + 8 * (i >> 1), 2 * t + (i & 1)] = frags[lane, i]
    return C


def mma(fmt, A, B, C, turing=False):
    d = garbage((32, 4), np.float32)
    kernel(f"mma_fragments<{CUDA_NAME[fmt]}>", turing=turing)(
        (1,), (32,), (a_fragments(A), b_fragments(B), c_fragments(C), d))
    return c_matrix(d)


def mma_k8(A, B, C):
    """m16n8k8 (float16) of A (16x8), B (8x8) and C (16x8 float32), through the per-lane fragments."""
    d = garbage((32, 4), np.float32)
    kernel("mma_k8_fragments")((1,), (32,), (a8_fragments(A), b8_fragments(B), c_fragments(C), d))
    return c_matrix(d)


def ldmatrix_numpy(tile, row_offsets, num, trans):
    """Register m of lane l: elements (l / 4, 2 (l % 4) + {0, 1}) of matrix m (transposed with .trans),
    whose row r is the 8 elements at the address lane 8 m + r supplies."""
    out = np.empty((32, num), np.uint32)
    for m in range(num):
        M = np.stack([tile[o:o + 8] for o in row_offsets[8 * m:8 * m + 8]])
        if trans:
            M = M.T
        for lane, g, t in lanes():
            out[lane, m] = pair(M[g, 2 * t], M[g, 2 * t + 1])
    return out


def tile_matmul(fmt, A, B, a_rows=16, wait_mode=0, order="ascending", turing=False):
    d = garbage((16, 8), np.float32)
    kernel(f"tile_matmul<{CUDA_NAME[fmt]}>", order, turing)(
        (1,), (32,), (A, B, d, np.int32(a_rows), np.int32(wait_mode)), shared_mem=(16 * 16 + 16 * 8) * 2)
    return d


def narrow(x, fmt):
    """x rounded to fmt, as the array the kernel takes (float16, or uint16 bfloat16 patterns)."""
    return x.astype(np.float16) if fmt == "float16" else to_bits(x, fmt)


# ----------------------------------------------------------------------------
# the checks, each on the kernels `kernel` gives


def check_mma_c_and_d_layout(fmt):
    """mma's C and D fragments: with A = B = 0, D is C, element by element."""
    C = np.arange(128, dtype=np.float32).reshape(16, 8) - 40
    zeros = np.zeros((16, 16), np.uint16)
    np.testing.assert_array_equal(mma(fmt, zeros, zeros[:, :8], C), C)


def check_mma_a_layout(fmt, rng):
    """mma's A fragments: B an identity over half of K picks half of A's columns."""
    A = rng.integers(-64, 64, (16, 16)).astype(np.float32)
    for half in range(2):  # B picks columns 0-7, then 8-15, of A
        B = np.zeros((16, 8), np.float32)
        B[8 * half:8 * half + 8] = np.eye(8)
        got = mma(fmt, to_bits(A, fmt), to_bits(B, fmt), np.zeros((16, 8), np.float32))
        np.testing.assert_array_equal(got, A[:, 8 * half:8 * half + 8])


def check_mma_b_layout(fmt, rng):
    """mma's B fragments: A the identity gives B back."""
    B = rng.integers(-64, 64, (16, 8)).astype(np.float32)
    got = mma(fmt, to_bits(np.eye(16), fmt), to_bits(B, fmt), np.zeros((16, 8), np.float32))
    np.testing.assert_array_equal(got, B)


def check_mma_random(fmt, rng):
    """mma of random operands against NumPy's matmul."""
    A, B = (to_bits(rng.standard_normal(shape), fmt) for shape in ((16, 16), (16, 8)))
    C = rng.standard_normal((16, 8)).astype(np.float32)
    want = from_bits(A, fmt).astype(np.float64) @ from_bits(B, fmt) + C
    np.testing.assert_allclose(mma(fmt, A, B, C), want, rtol=1e-6, atol=1e-6)


def check_mma_k8(rng):
    """m16n8k8 (float16): small integers, so that every sum is exact; an element in the wrong place of A,
    B, C or D changes D."""
    A, B = (rng.integers(-16, 16, shape).astype(np.float32) for shape in ((16, 8), (8, 8)))
    C = rng.integers(-64, 64, (16, 8)).astype(np.float32)
    np.testing.assert_array_equal(mma_k8(to_bits(A, "float16"), to_bits(B, "float16"), C), A @ B + C)


def check_turing(order, a_rows, rng):
    """The float16 kernels as a Turing GPU runs them (tensor_core.cuh's stand-ins): m16n8k16 as two
    m16n8k8 (A's column halves each picked by an identity B, then random operands), the cp.async ->
    ldmatrix -> mma pipeline with plain copies, and pack_f16x2 as two conversions."""
    A = rng.integers(-64, 64, (16, 16)).astype(np.float32)
    for half in range(2):
        B = np.zeros((16, 8), np.float32)
        B[8 * half:8 * half + 8] = np.eye(8)
        got = mma("float16", to_bits(A, "float16"), to_bits(B, "float16"), np.zeros((16, 8), np.float32), turing=True)
        np.testing.assert_array_equal(got, A[:, 8 * half:8 * half + 8])
    A, B = (to_bits(rng.standard_normal(shape), "float16") for shape in ((16, 16), (16, 8)))
    C = rng.standard_normal((16, 8)).astype(np.float32)
    want = from_bits(A, "float16").astype(np.float64) @ from_bits(B, "float16") + C
    np.testing.assert_allclose(mma("float16", A, B, C, turing=True), want, rtol=1e-6, atol=1e-6)
    A, B = narrow(rng.standard_normal((16, 16)), "float16"), narrow(rng.standard_normal((16, 8)), "float16")
    a = A.astype(np.float64)
    a[a_rows:] = 0  # the stand-in zero-fills the rows past a_rows, as cp.async does
    np.testing.assert_allclose(tile_matmul("float16", A, B, a_rows, order=order, turing=True), a @ B.astype(np.float64),
                               rtol=1e-6, atol=1e-6)
    x = np.concatenate([rng.standard_normal(60) * 4, [1 + 2**-11, 1 + 3 * 2**-11, np.nan, 1e5]]).astype(np.float32)
    f16, bf16, e = garbage(32, np.uint32), garbage(32, np.uint32), garbage(32, np.float32)
    kernel("pack_and_exp", turing=True)((1,), (32,), (x, f16, bf16, e))
    bits = to_bits(x, "float16")
    bits[np.isnan(x)] = 0x7FFF  # canonical NaN, as sm_80's cvt gives
    np.testing.assert_array_equal(f16, pair(bits[0::2], bits[1::2]))


def check_ldmatrix(num, trans, rng):
    """One ldmatrix variant (num matrices, .trans or not) against the ISA's thread mapping."""
    rows = 64
    tile = rng.permutation(rows * 8).astype(np.uint16)
    # 32 distinct rows in random order; lanes past 8 num supply no address (null: must not be read)
    offsets = (rng.permutation(rows)[:32] * 8).astype(np.int32)
    offsets[8 * num:] = -1
    out = garbage((32, num), np.uint32)
    kernel(f"ldmatrix_variant<{num}, {str(trans).lower()}>")(
        (1,), (32,), (tile, np.int32(tile.size), offsets, out), shared_mem=tile.nbytes)
    np.testing.assert_array_equal(out, ldmatrix_numpy(tile, offsets, num, trans))


def check_tile_matmul_matches_numpy(fmt, order, a_rows, rng):
    """cp.async -> ldmatrix -> mma of a 16x16 by 16x8 tile (a_rows rows of A loaded) against NumPy."""
    A, B = narrow(rng.standard_normal((16, 16)), fmt), narrow(rng.standard_normal((16, 8)), fmt)
    a = from_bits(A.view(np.uint16), fmt).astype(np.float64)
    a[a_rows:] = 0  # cp.async zero-fills the rows past a_rows
    want = a @ from_bits(B.view(np.uint16), fmt)
    np.testing.assert_allclose(tile_matmul(fmt, A, B, a_rows, order=order), want, rtol=1e-6, atol=1e-6)


def check_pack_and_exp(rng):
    """pack_f16x2 and pack_bf16x2 (nearest, ties to even; the canonical NaN) and ex2_approx (.ftz)."""
    x = np.concatenate([rng.standard_normal(58) * 4, [1 + 2**-11, 1 + 3 * 2**-11, -130.0, np.nan, 1e5, -200.0]])
    x = x.astype(np.float32)
    f16, bf16 = garbage(32, np.uint32), garbage(32, np.uint32)
    e = garbage(32, np.float32)
    kernel("pack_and_exp")((1,), (32,), (x, f16, bf16, e))
    for got, fmt in ((f16, "float16"), (bf16, "bfloat16")):
        bits = to_bits(x, fmt)
        bits[np.isnan(x)] = 0x7FFF  # the GPU's cvt gives the canonical NaN
        np.testing.assert_array_equal(got, pair(bits[0::2], bits[1::2]))
    want = np.exp2(x[:32].astype(np.float64))
    want[want < np.finfo(np.float32).tiny] = 0  # .ftz
    np.testing.assert_allclose(e, want, rtol=2e-7)
