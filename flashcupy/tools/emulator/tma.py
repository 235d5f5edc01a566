"""Tensor maps for TMA (hopper.cuh's tma_load_Nd / tma_store_Nd) under the emulator.

Room: tensor maps. The encode arguments (cuTensorMapEncodeTiled's, innermost dimension first), their
checks and the GPU's map live with the backend, in flashcupy/backends/cupy_backend/tensor_maps.py.
Here, ``encode_tiled(array, box, swizzle)`` makes the emulator's own map (include/emu_tma.h's
TmaMapLayout) from the same arguments, with the same checks; the launch puts the guarded argument
buffer's address into it (arguments.py), so the array is passed as the map and a box that reaches
outside the tensor reads zeros while a map that reaches outside the array is a KernelError. The cupy
backend's emulated Runtime (cupy.py) hands kernels these maps where a GPU gets the driver's.
"""

from __future__ import annotations

import struct

import numpy as np

from flashcupy.backends.cupy_backend.tensor_maps import (  # noqa: F401 (the emulator's names)
    SWIZZLES, TensorMapError, TiledArguments, gpu_tensor_map_bytes, tiled_arguments)

MAGIC = 0x50414D54  # "TMAP", emu_tma.h's kTmaMagic
# emu_tma.h's TmaMapLayout: magic, rank, element_bytes, swizzle, oob_fill, interleave, address,
# dims[5], reserved, strides[4], box[5], element_strides[5]
_LAYOUT = struct.Struct("<6IQ5II4Q5I5I")
assert _LAYOUT.size == 128


class TensorMap:
    """The emulator's tensor map of `array`: pass it where the kernel takes a TensorMap.

    The launch guards `array` like a pointer argument (it shares a buffer with the same array
    passed as a pointer) and packs the map with the guarded address (``pack``)."""

    def __init__(self, array: np.ndarray, arguments: TiledArguments):
        self.array = array
        self.arguments = arguments

    def pack(self, address: int) -> bytes:
        """The 128 bytes of emu_tma.h's TmaMapLayout for the tensor at global `address`."""
        if address % 16:
            raise TensorMapError(f"encode_tiled: globalAddress {address:#x} is not 16-byte aligned")
        a = self.arguments
        pad = lambda values, n: tuple(values) + (0,) * (n - len(values))  # noqa: E731
        return _LAYOUT.pack(MAGIC, a.rank, a.element_bytes, SWIZZLES[a.swizzle][0], 0, 0, address,
                            *pad(a.dims, 5), 0, *pad(a.strides, 4), *pad(a.box, 5), *pad(a.element_strides, 5))

    def __repr__(self):
        a = self.arguments
        return f"TensorMap(dims={a.dims}, box={a.box}, swizzle={a.swizzle!r})"


def encode_tiled(array: np.ndarray, box, swizzle: str = "none", **options) -> TensorMap:
    """The emulator's cuTensorMapEncodeTiled: a TensorMap of `array` with `box` (innermost first).
    options: dims, strides (bytes), element_strides, each innermost first; checked as the driver does."""
    arguments = tiled_arguments(array, box, swizzle, **options)
    address = array.__array_interface__["data"][0]
    if address % 16:
        raise TensorMapError(f"encode_tiled: globalAddress {address:#x} (the array's first element) is not "
                             f"16-byte aligned")
    return TensorMap(array, arguments)
