"""Launch arguments: NumPy arrays into guarded buffers, scalars into bytes, grid and block into dim3.

Room: argument marshalling. Each array argument's bytes are copied into a buffer between two
PROT_NONE pages (runtime.cpp's emu_map_guarded), arrays whose bytes overlap share one buffer,
and what the kernel changed is copied back after the launch; scalars are checked against the
parameter's kind and size. driver.py's EmulatedFunction calls marshal() for every launch.
"""

from __future__ import annotations

import ctypes

import numpy as np

from .abi import _BOOL, _FLOATING, _PARAM_KIND_NAMES, _POINTER, _SIGNED, _UNSIGNED
from .errors import LaunchError


def _byte_span(a: np.ndarray) -> tuple:
    """(lo, hi, first): the bytes [lo, hi) the view can touch, and its first element's address."""
    first = a.__array_interface__["data"][0]
    if a.size == 0:
        return first, first, first
    lo = hi = first
    for n, stride in zip(a.shape, a.strides):
        if stride < 0:
            lo += (n - 1) * stride
        else:
            hi += (n - 1) * stride
    return lo, hi + a.itemsize, first


def _describe_array(a: np.ndarray) -> str:
    return f"{a.dtype} array of shape {a.shape}"


class _Region:
    """One guarded copy of the bytes a group of overlapping array arguments covers.

    Arguments whose spans overlap share one region, so aliasing (the same array
    passed twice, or in-place kernels) behaves as on a GPU.
    """

    def __init__(self, lib, members, at_end: bool):
        self.lib = lib
        self.members = members  # [(argument index, array, lo, hi, first)]
        self.lo = min(m[2] for m in members)
        self.hi = max(m[3] for m in members)
        self.bytes = self.hi - self.lo
        mapping, mapping_bytes = ctypes.c_uint64(), ctypes.c_uint64()
        # Flush against the guard page, so one element past the end faults. The copy keeps the
        # host address's alignment whenever the span ends on an aligned address (a contiguous
        # float16 array with head_dim % 8 == 0 does); otherwise cp.async/ldmatrix report a
        # misaligned row rather than run on an alignment the GPU would not see.
        self.data = lib.emu_map_guarded(self.bytes, int(at_end), ctypes.byref(mapping), ctypes.byref(mapping_bytes))
        if not self.data:
            raise MemoryError(f"could not map a guarded buffer of {self.bytes} bytes")
        self.mapping, self.mapping_bytes = mapping.value, mapping_bytes.value
        self.page = lib.emu_page_size()
        if self.bytes:
            ctypes.memmove(self.data, self.lo, self.bytes)

    def pointer(self, first: int) -> int:
        return self.data + (first - self.lo)

    def guard_side(self, address: int):
        """'before' or 'after' if `address` lies in one of this region's guard pages, else None."""
        if self.mapping <= address < self.mapping + self.page:
            return "before"
        end = self.mapping + self.mapping_bytes
        if end - self.page <= address < end:
            return "after"
        return None

    def _view(self, address: int, n: int) -> np.ndarray:
        return np.ctypeslib.as_array((ctypes.c_ubyte * n).from_address(address)) if n else np.empty(0, np.uint8)

    def slack_written(self) -> str | None:
        """'before'/'after' if the kernel wrote into the unguarded slack beside the data."""
        data_lo = self.mapping + self.page
        data_hi = self.mapping + self.mapping_bytes - self.page
        if (self._view(data_lo, self.data - data_lo) != 0xFF).any():
            return "before"
        if (self._view(self.data + self.bytes, data_hi - self.data - self.bytes) != 0xFF).any():
            return "after"
        return None

    def copy_back(self, kernel: str) -> None:
        new = self._view(self.data, self.bytes)
        old = self._view(self.lo, self.bytes)
        changed = new != old
        if not changed.any():
            return
        for index, array, lo, hi, _ in self.members:
            if not array.flags.writeable and changed[lo - self.lo:hi - self.lo].any():
                raise LaunchError(f"kernel {kernel!r} wrote into argument {index}, a read-only "
                                  f"{_describe_array(array)}")
        ctypes.memmove(self.lo, self.data, self.bytes)

    def release(self) -> None:
        self.lib.emu_unmap(self.mapping, self.mapping_bytes)


def _scalar(value):
    """A NumPy scalar for a by-value argument; Python numbers convert as CuPy converts them."""
    if isinstance(value, (bool, np.bool_)):
        return np.bool_(value)
    if isinstance(value, np.generic):
        return value
    if isinstance(value, int):
        return np.int64(value)
    if isinstance(value, float):
        return np.float64(value)
    return None


_SCALAR_KINDS = {_SIGNED: "iu", _UNSIGNED: "iu", _FLOATING: "f", _BOOL: "b"}


def _dim3(value, what: str) -> tuple:
    dims = (value,) if isinstance(value, (int, np.integer)) else tuple(value)
    if not 1 <= len(dims) <= 3 or not all(isinstance(d, (int, np.integer)) for d in dims):
        raise LaunchError(f"{what} must be an int or a tuple of 1 to 3 ints, got {value!r}")
    return tuple(int(d) for d in dims) + (1,) * (3 - len(dims))


def marshal(lib, kernel: str, params: tuple, args: tuple, at_end: bool):
    """Guarded regions, and per argument the ctypes object whose address goes into argv.

    params: the kernel's (kind, size, pointee size) per parameter (abi.py's _ParamInfo);
    at_end: the buffers lie flush against their upper guard page (oob_guard="end").
    """
    prefix = f"kernel {kernel!r}:"
    arrays, storage = [], [None] * len(args)
    for i, (arg, (kind, size, pointee)) in enumerate(zip(args, params)):
        if kind == _POINTER:
            if arg is None:
                storage[i] = ctypes.c_uint64(0)
                continue
            if not isinstance(arg, np.ndarray):
                raise LaunchError(f"{prefix} argument {i} is a pointer parameter; pass a numpy.ndarray, "
                                  f"got {type(arg).__name__}")
            if pointee not in (0, 1, arg.itemsize):
                raise LaunchError(f"{prefix} argument {i} points to {pointee}-byte elements, got a "
                                  f"{_describe_array(arg)} ({arg.itemsize}-byte elements)")
            arrays.append((i, arg, *_byte_span(arg)))
            continue
        value = _scalar(arg)
        if value is None:
            raise LaunchError(f"{prefix} argument {i} is a {size}-byte {_PARAM_KIND_NAMES[kind]} parameter; "
                              f"pass a NumPy scalar, got {type(arg).__name__}")
        if value.dtype.itemsize != size or (kind in _SCALAR_KINDS and value.dtype.kind not in _SCALAR_KINDS[kind]):
            raise LaunchError(f"{prefix} argument {i} is a {size}-byte {_PARAM_KIND_NAMES[kind]} parameter, "
                              f"got {value.dtype} ({value.dtype.itemsize} bytes)")
        storage[i] = ctypes.create_string_buffer(value.tobytes(), size)

    # group arrays whose byte spans overlap into one region each
    groups = []
    for member in sorted(arrays, key=lambda m: m[2]):
        if groups and member[2] < max(m[3] for m in groups[-1]) and member[3] > member[2]:
            groups[-1].append(member)
        else:
            groups.append([member])
    regions = []
    try:
        for members in groups:
            region = _Region(lib, members, at_end)
            regions.append(region)
            for index, _, _, _, first in members:
                storage[index] = ctypes.c_uint64(region.pointer(first))
    except BaseException:
        for region in regions:
            region.release()
        raise
    return regions, storage
