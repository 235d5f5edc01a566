"""The interface with runtime.cpp: ctypes mirrors of its structures and enums, and loading a module.

Room: the ABI. Each structure here has the layout of runtime.cpp's of the same name (EmuLaunchConfig,
EmuLaunchReport, EmuCounters, emu::ParamInfo); change both together. _load opens a built module
(build.py's _build) once per process and declares the prototypes of the functions it exports.
"""

from __future__ import annotations

import ctypes
import threading

from .counters import CATEGORIES, SCALARS

class _ParamInfo(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int), ("size", ctypes.c_int), ("pointee_size", ctypes.c_int)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("dynamic_shared_bytes", ctypes.c_uint64), ("stack_bytes", ctypes.c_uint64),
                ("seed", ctypes.c_uint64), ("order", ctypes.c_int), ("cp_async_eager", ctypes.c_int),
                ("flush_denormals", ctypes.c_int), ("count", ctypes.c_int), ("time_limit", ctypes.c_double)]


class _Counters(ctypes.Structure):  # runtime.cpp's EmuCounters
    _fields_ = [("access", (ctypes.c_uint64 * 4) * len(CATEGORIES))] + [(name, ctypes.c_uint64) for name in SCALARS]


class _LaunchReport(ctypes.Structure):
    _fields_ = [("status", ctypes.c_int), ("signal", ctypes.c_int), ("access", ctypes.c_int),
                ("where", ctypes.c_int), ("fault_address", ctypes.c_uint64), ("has_thread", ctypes.c_int),
                ("block", ctypes.c_uint * 3), ("thread", ctypes.c_uint * 3), ("message", ctypes.c_char * 2048)]


# runtime.cpp's enums
_OK, _FAULT, _DEADLOCK, _WARP_MISUSE, _TRAP, _SHARED_OVERRUN, _RESOURCES, _TIMEOUT = range(8)
_ELSEWHERE, _DYNAMIC_SHARED, _STACK = range(3)
_POINTER, _SIGNED, _UNSIGNED, _FLOATING, _BOOL, _OTHER = range(6)
_PARAM_KIND_NAMES = {_POINTER: "pointer", _SIGNED: "signed integer", _UNSIGNED: "unsigned integer",
                     _FLOATING: "floating-point", _BOOL: "bool", _OTHER: "class-type"}

_libraries: dict = {}
_load_lock = threading.Lock()


def _load(path: str):
    with _load_lock:
        if path not in _libraries:
            lib = ctypes.CDLL(path)
            lib.emu_launch.restype = ctypes.c_int
            lib.emu_launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(_LaunchConfig),
                                       ctypes.POINTER(_LaunchReport)]
            lib.emu_map_guarded.restype = ctypes.c_uint64
            lib.emu_map_guarded.argtypes = [ctypes.c_uint64, ctypes.c_int, ctypes.POINTER(ctypes.c_uint64),
                                            ctypes.POINTER(ctypes.c_uint64)]
            lib.emu_unmap.restype = None
            lib.emu_unmap.argtypes = [ctypes.c_uint64, ctypes.c_uint64]
            lib.emu_page_size.restype = ctypes.c_uint64
            lib.emu_counters.restype = None
            lib.emu_counters.argtypes = [ctypes.POINTER(_Counters)]
            lib.emu_release_stacks.restype = None
            lib.emu_release_stacks.argtypes = []
            _libraries[path] = lib
        return _libraries[path]
