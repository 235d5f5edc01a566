"""Tensor maps for the TMA kernels (flash_fwd_sm90.cu): the arguments of the driver's
cuTensorMapEncodeTiled, checked as the driver checks them, and the map a GPU gets from it.

A TMA kernel takes its map as a ``const __grid_constant__ TensorMap`` parameter (128 bytes, 64-byte
aligned). The map is made on the host from cuTensorMapEncodeTiled's arguments, innermost dimension first:

    tensorDataType  the element type (CU_TENSOR_MAP_DATA_TYPE_FLOAT16, _BFLOAT16, _FLOAT32, ...)
    tensorRank      1..5 (attention tensors: 4, (head_dim, heads, seqlen, batch) innermost first)
    globalAddress   the device address of element (0, .., 0); 16-byte aligned
    globalDim       rank sizes, each 1..2^32
    globalStrides   rank - 1 byte strides of dims 1.., each a multiple of 16 and < 2^40
    boxDim          rank box sizes, each 1..256; boxDim[0] * element size a multiple of 16 bytes,
                    and at most the swizzle span (32, 64, 128 bytes) when swizzled (the emulator
                    also refuses less: a narrower swizzled box's layout is unverified)
    elementStrides  rank steps, each 1..8 (1: every element)
    interleave      CU_TENSOR_MAP_INTERLEAVE_NONE
    swizzle         CU_TENSOR_MAP_SWIZZLE_NONE, _32B, _64B, _128B (enum values 0..3)
    l2Promotion     CU_TENSOR_MAP_L2_PROMOTION_* (a cache hint)
    oobFill         CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE: elements outside the tensor read as zeros

`tiled_arguments` computes and checks them for an array (NumPy or CuPy: shape, strides, itemsize);
`gpu_tensor_map_bytes` asks the driver (cuda-bindings) for the map and returns its 128 bytes as a
size-one NumPy array of a 128-byte void dtype, which CuPy passes by value (cupy/cuda/function.pyx's
CNumpyArray: a size-one numpy.ndarray argument is copied as the parameter; the driver places it at the
parameter's 64-byte aligned offset). The CPU emulator makes its own map from the same arguments
(flashcupy/tools/emulator/tma.py). Not yet run on a GPU: **[verify]** on the first one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SWIZZLES = {"none": (0, 16), "32B": (1, 32), "64B": (2, 64), "128B": (3, 128)}  # CUtensorMapSwizzle, span


class TensorMapError(ValueError):
    """An argument cuTensorMapEncodeTiled would reject (the message names it)."""


@dataclass(frozen=True)
class TiledArguments:
    """cuTensorMapEncodeTiled's arguments, innermost dimension first (strides in bytes)."""

    element_bytes: int
    dims: tuple
    strides: tuple
    box: tuple
    element_strides: tuple
    swizzle: str

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def box_bytes(self) -> int:
        """The bytes one box lands in shared memory (what it completes on its mbarrier)."""
        n = self.element_bytes
        for b, e in zip(self.box, self.element_strides):
            n *= -(-b // e)
        return n


def tiled_arguments(array: np.ndarray, box, swizzle: str = "none", *, dims=None, strides=None,
                    element_strides=None) -> TiledArguments:
    """The encode arguments for `array` (any strides; dims and strides default to its own, reversed)
    and `box` (innermost first), checked as cuTensorMapEncodeTiled checks them."""
    if swizzle not in SWIZZLES:
        raise TensorMapError(f"encode_tiled: swizzle must be one of {tuple(SWIZZLES)}, got {swizzle!r}")
    size = array.itemsize
    if size not in (1, 2, 4, 8):
        raise TensorMapError(f"encode_tiled: tensorDataType: {array.dtype} ({size}-byte elements) has no tensor "
                             f"map data type")
    dims = tuple(int(d) for d in (reversed(array.shape) if dims is None else dims))
    rank = len(dims)
    if not 1 <= rank <= 5:
        raise TensorMapError(f"encode_tiled: tensorRank {rank}: it must be 1..5")
    if strides is None:
        if array.strides and array.strides[-1] != size:
            raise TensorMapError(f"encode_tiled: the innermost dimension must be contiguous (its stride is "
                                 f"{array.strides[-1]} bytes, the element {size})")
        strides = tuple(reversed(array.strides))[1:]
    strides = tuple(int(s) for s in strides)
    box = tuple(int(b) for b in box)
    element_strides = (1,) * rank if element_strides is None else tuple(int(e) for e in element_strides)
    for name, values, want in (("globalStrides", strides, rank - 1), ("boxDim", box, rank),
                               ("elementStrides", element_strides, rank)):
        if len(values) != want:
            raise TensorMapError(f"encode_tiled: {name} has {len(values)} entries; a rank-{rank} map needs {want}")
    for i, d in enumerate(dims):
        if not 1 <= d <= 2 ** 32:
            raise TensorMapError(f"encode_tiled: globalDim[{i}] = {d}: it must be in [1, 2^32]")
    for i, s in enumerate(strides):
        if s % 16 or not 0 < s < 2 ** 40:
            raise TensorMapError(f"encode_tiled: globalStrides[{i}] = {s} bytes: it must be a positive multiple "
                                 f"of 16 below 2^40")
    for i, b in enumerate(box):
        if not 1 <= b <= 256:
            raise TensorMapError(f"encode_tiled: boxDim[{i}] = {b}: it must be in [1, 256]")
    for i, e in enumerate(element_strides):
        if not 1 <= e <= 8:
            raise TensorMapError(f"encode_tiled: elementStrides[{i}] = {e}: it must be in [1, 8]")
    inner = box[0] * size
    if inner % 16:
        raise TensorMapError(f"encode_tiled: boxDim[0] = {box[0]} elements of {size} bytes is {inner} bytes: "
                             f"the inner box must be a multiple of 16 bytes")
    span = SWIZZLES[swizzle][1]
    if swizzle != "none" and inner > span:
        raise TensorMapError(f"encode_tiled: boxDim[0] = {box[0]} elements of {size} bytes is {inner} bytes, more "
                             f"than the {swizzle} swizzle's span of {span} bytes")
    if swizzle != "none" and inner < span:  # the driver accepts it; the emulator does not model it
        raise TensorMapError(f"encode_tiled: boxDim[0] = {box[0]} elements of {size} bytes is {inner} bytes, less "
                             f"than the {swizzle} swizzle's span of {span} bytes: not modelled (whether the "
                             f"hardware pads each row to the span is unverified); make the inner box the span")
    return TiledArguments(size, dims, strides, box, element_strides, swizzle)



_GPU_DATA_TYPES = {"float16": "FLOAT16", "bfloat16": "BFLOAT16", "float32": "FLOAT32", "float64": "FLOAT64",
                   "uint8": "UINT8", "uint16": "UINT16", "uint32": "UINT32", "int32": "INT32",
                   "uint64": "UINT64", "int64": "INT64"}


def gpu_tensor_map_bytes(pointer: int, dtype_name: str, arguments: TiledArguments) -> np.ndarray:
    """The driver's map (cuda-bindings' cuTensorMapEncodeTiled) of the tensor at device `pointer`, as a
    size-1 array of a 64-byte-aligned 128-byte void dtype, passed by value to a CuPy kernel."""
    from cuda.bindings import driver

    a = arguments
    u32 = lambda values: [driver.cuuint32_t(v) for v in values]  # noqa: E731 (the bindings' integer types)
    u64 = lambda values: [driver.cuuint64_t(v) for v in values]  # noqa: E731
    err, tmap = driver.cuTensorMapEncodeTiled(
        getattr(driver.CUtensorMapDataType, f"CU_TENSOR_MAP_DATA_TYPE_{_GPU_DATA_TYPES[dtype_name]}"),
        driver.cuuint32_t(a.rank), pointer, u64(a.dims), u64(a.strides), u32(a.box), u32(a.element_strides),
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        driver.CUtensorMapSwizzle(SWIZZLES[a.swizzle][0]),
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise TensorMapError(f"cuTensorMapEncodeTiled failed: {err}")
    raw = np.array(tmap.opaque, np.uint64).tobytes()  # CUtensorMap: 16 opaque 64-bit words
    return np.frombuffer(raw, np.dtype((np.void, 128))).copy()
