"""TMA's building blocks: the boxes tests/emulator_kernels/tma.cu loads and stores, checked byte for
byte against NumPy, for the emulator (tests/test_emulator_tma.py) and a GPU (tests/test_hopper_gpu.py).

A box lands in shared memory densely, dim 0 innermost (NumPy's C order of the box with the
dimensions reversed), elements outside the tensor as zeros, then swizzled as hopper.cuh and the
wgmma descriptor swizzle: within each 1024-byte repeat of the (1024-byte aligned) tile, the 16-byte
chunk bits [4, 4 + b) XOR the bits [7, 7 + b), b = log2(span / 16).

`kernel(name)` gives a function called like the emulator's; `encode(array, box, swizzle, **options)`
a map of `array` to pass where the kernel takes a TensorMap (the emulator's encode_tiled, or a GPU
stand-in that the GPU test file turns into the driver's map at the launch).
"""

from __future__ import annotations

import os

import numpy as np

import wgmma_blocks

HERE = os.path.dirname(os.path.abspath(__file__))
TEST_KERNELS = os.path.join(HERE, "emulator_kernels", "tma.cu")
NAMES = ("tma_box", "tma_copy", "tma_fill_store", "tma_qk", "tma_bulk_reduce", "tma_ordered_reduce")
SPAN = {"none": 16, "32B": 32, "64B": 64, "128B": 128}
MODES = {"normal": 0, "misaligned": 1, "short": 2}


def source():
    with open(TEST_KERNELS) as f:
        return f.read()


def swizzle_bytes(data: np.ndarray, swizzle: str) -> np.ndarray:
    """The bytes `data` (uint8, a tile starting at a multiple of 1024) as the swizzle lays them."""
    span = SPAN[swizzle]
    if span == 16:
        return data.copy()
    off = np.arange(data.size)
    out = np.zeros_like(data)
    out[off ^ (((off >> 7) & (span // 16 - 1)) << 4)] = data
    return out


def expected_box(array: np.ndarray, box, coords) -> np.ndarray:
    """The box of `array` at `coords` (both innermost first), zeros outside the array."""
    index = []
    for axis in range(array.ndim):
        d = array.ndim - 1 - axis  # the map's dimension of this NumPy axis
        index.append(coords[d] + np.arange(box[d]))
    valid = np.ones([box[array.ndim - 1 - a] for a in range(array.ndim)], bool)
    clipped = []
    for axis, idx in enumerate(index):
        ok = (idx >= 0) & (idx < array.shape[axis])
        shape = [1] * array.ndim
        shape[axis] = -1
        valid &= ok.reshape(shape)
        clipped.append(np.clip(idx, 0, array.shape[axis] - 1))
    return np.where(valid, array[np.ix_(*clipped)], np.zeros((), array.dtype))


def load_box(kernel, encode, array, box, coords, swizzle, steps=1, step=0, mode="normal", **options):
    """What tma_box leaves in shared memory (uint8, steps x box bytes), and the map's box bytes."""
    tmap = encode(array, box, swizzle, **options)
    box_bytes = int(np.prod(box)) * array.itemsize
    c = list(coords) + [0] * (4 - len(coords))
    if len(coords) == 2:
        c[3] = step
    out = np.full(steps * box_bytes, 0xAB, np.uint8)
    kernel("tma_box")((1,), (32,), (tmap, np.int32(len(box)), *(np.int32(v) for v in c), np.int32(box_bytes),
                                    np.int32(steps), np.int32(MODES[mode]), out), shared_mem=box_bytes + 1024 + 16)
    return out.reshape(steps, box_bytes)


def check_box_load(kernel, encode, shape, box, coords, swizzle, rng, dtype=np.float16):
    """One box, byte for byte: the swizzled layout, zeros where it crosses the tensor's edge."""
    array = rng.standard_normal(shape).astype(dtype)
    got = load_box(kernel, encode, array, box, coords, swizzle)[0]
    want = swizzle_bytes(np.ascontiguousarray(expected_box(array, box, coords)).view(np.uint8).ravel(), swizzle)
    np.testing.assert_array_equal(got, want)


def check_phases(kernel, encode, rng, steps=3, rows=16):
    """A walk down the rows through one mbarrier: step s waits on parity s & 1 and sees box s."""
    array = rng.standard_normal((steps * rows, 64)).astype(np.float16)
    got = load_box(kernel, encode, array, (64, rows), (0, 0), "128B", steps=steps, step=rows)
    for s in range(steps):
        want = swizzle_bytes(array[s * rows:(s + 1) * rows].view(np.uint8).ravel(), "128B")
        np.testing.assert_array_equal(got[s], want, err_msg=f"step {s}")


def check_store_round_trip(kernel, encode, rng, shape=(40, 64), box=(64, 32), coords=(0, 24)):
    """Load a box that crosses the tensor's edge and store it back at the same place through another
    map: the elements inside the tensor are copied, the rest of the output untouched (no store past it)."""
    src = rng.standard_normal(shape).astype(np.float16)
    dst = np.full(shape, 7.0, np.float16)
    box_bytes = int(np.prod(box)) * 2
    c = list(coords) + [0] * (4 - len(coords))
    kernel("tma_copy")((1,), (32,), (encode(src, box, "128B"), encode(dst, box, "128B"), np.int32(len(box)),
                                     *(np.int32(v) for v in c), np.int32(box_bytes)), shared_mem=box_bytes + 1024)
    want = np.full(shape, 7.0, np.float16)
    inside = tuple(slice(max(coords[len(box) - 1 - a], 0), coords[len(box) - 1 - a] + box[len(box) - 1 - a])
                   for a in range(len(shape)))
    want[inside] = src[inside]
    assert (want != 7.0).any() and (want == 7.0).any()  # the box covers part of the tensor, not all of it
    np.testing.assert_array_equal(dst, want)


FILL_MODES = {"fenced": 0, "no proxy fence": 1, "proxy fence in thread 0 only": 2, "load, overwrite, fenced": 3,
              "load, overwrite, no proxy fence": 4}


def fill_store(kernel, encode, rng, mode, shape=(32, 64), box=(64, 16), coords=(0, 8)):
    """tma_fill_store: what the TMA store writes (dst) and what it should (want, from NumPy)."""
    loaded = rng.standard_normal(shape).astype(np.float16)
    dst = np.full(shape, 7.0, np.float16)
    box_bytes = int(np.prod(box)) * 2
    src = rng.standard_normal((box[1], box[0])).astype(np.float16)
    kernel("tma_fill_store")((1,), (32,), (encode(loaded, box, "none"), encode(dst, box, "none"), np.int32(coords[0]),
                                           np.int32(coords[1]), np.int32(box_bytes), np.int32(FILL_MODES[mode]),
                                           src.view(np.uint8).ravel()), shared_mem=box_bytes + 1024)
    want = np.full(shape, 7.0, np.float16)
    rows = slice(coords[1], coords[1] + box[1])
    cols = slice(coords[0], coords[0] + box[0])
    want[rows, cols] = src
    if FILL_MODES[mode] >= 3:  # the tile's second half is still the TMA-loaded box
        half = box[1] // 2
        want[coords[1] + half:coords[1] + box[1], cols] = loaded[coords[1] + half:coords[1] + box[1], cols]
    return dst, want


def check_tma_then_wgmma(kernel, encode, rng):
    """Q and K (64 x 64 fp16) loaded by TMA with 128B swizzle, S = Q K^T by wgmma with 128B
    descriptors: the wgmma tests' NumPy reference."""
    Q = wgmma_blocks.to_bits(rng.standard_normal((64, 64)), "float16")
    K = wgmma_blocks.to_bits(rng.standard_normal((64, 64)), "float16")
    out = np.full(128 * 32, -1, np.float32)
    kernel("tma_qk")((1,), (128,), (encode(Q.view(np.float16), (64, 64), "128B"),
                                    encode(K.view(np.float16), (64, 64), "128B"), out), shared_mem=2 * 8192 + 1024)
    got = wgmma_blocks.from_fragments(out, 64)
    np.testing.assert_allclose(got, wgmma_blocks.want("float16", Q, K.T), rtol=wgmma_blocks.RTOL,
                               atol=wgmma_blocks.ATOL)


REDUCE_MODES = {"normal": 0, "wait after the last round": 1, "size not a multiple of 16": 2}


def bulk_reduce(kernel, rng, mode="normal", ctas=3, rounds=3, floats=320):
    """tma_bulk_reduce: what `ctas` CTAs of `rounds` bulk reduce-adds each leave in dst (start: `base`),
    with the rounds' sources and the start, for the caller's expectation."""
    base = rng.standard_normal(floats).astype(np.float32)
    src = rng.standard_normal((rounds, floats)).astype(np.float32)
    dst = base.copy()
    kernel("tma_bulk_reduce")((ctas,), (64,), (dst, src.ravel(), np.int32(floats), np.int32(rounds),
                                                np.int32(REDUCE_MODES[mode])), shared_mem=floats * 4 + 1024)
    return dst, base, src


def check_bulk_reduce(kernel, rng, ctas=3):
    """Every CTA's every round added once into the same floats: float32 sums of n = ctas * rounds terms
    in some order, each within the recursive-summation bound (n - 1) 2^-24 sum |terms| of the exact."""
    dst, base, src = bulk_reduce(kernel, rng, ctas=ctas)
    want = base.astype(np.float64) + ctas * src.astype(np.float64).sum(axis=0)
    terms = ctas * src.shape[0]
    bound = terms * 2.0 ** -24 * (np.abs(base) + ctas * np.abs(src.astype(np.float64)).sum(axis=0))
    err = np.abs(dst - want)
    assert (err <= bound).all(), (f"{int((err > bound).sum())} of {dst.size} sums off: worst error "
                                  f"{err.max():.3g}, {float((err / bound).max()):.3g} x the bound")


ORDERED_MODES = {"normal": 0, "no flag wait": 1, "wait_group.read": 2, "no fence after the wait": 3,
                 "no fence before the release": 4, "a flag never reached": 5}


def ordered_reduce(kernel, rng, mode="normal", ctas=5, floats=320):
    """tma_ordered_reduce: (what `ctas` CTAs leave in dst, what adding src[0], src[1], .. in CTA order into
    the start gives in float32, the flag)."""
    base = rng.standard_normal(floats).astype(np.float32)
    # terms of several magnitudes: float32 sums of them in another order round differently
    src = (rng.standard_normal((ctas, floats)) * 10.0 ** rng.integers(-3, 4, (ctas, 1))).astype(np.float32)
    dst, flags = base.copy(), np.zeros(4, dtype=np.int32)
    kernel("tma_ordered_reduce")((ctas,), (64,), (dst, src.ravel(), flags, np.int32(floats),
                                                  np.int32(ORDERED_MODES[mode])), shared_mem=floats * 4 + 1024)
    want = base.copy()
    for term in src:
        want += term
    return dst, want, flags
