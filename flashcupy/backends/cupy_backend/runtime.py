"""What the cupy backend takes from CUDA, in one object: the `Runtime` seam.

The backend (__init__.py) allocates, compiles and launches only through the Runtime in use
(`cupy_backend.runtime`): on a GPU `cupy_runtime()`, made at first use; under the CPU emulator
(flashcupy/tools/emulator/cupy.py) one made of NumPy and the emulator, which runs the same launch code.
"""

from __future__ import annotations

import contextlib
import functools


class Runtime:
    """What the backend takes from CUDA.

    xp: the array module outputs and workspaces are allocated with (cupy).
    compile_module(source, name_expressions, options): an object whose get_function(name) gives
        a kernel callable as kernel(grid, block, args), like cupy.RawModule; it should be memoized.
    device_of(x): a context manager that makes x's device current (cupy: x.device).
    compute_capability(x): of x's device, as an int (80 for sm_80).
    data_ptr(x): the address of x's first element.
    device_id(x): which device x lives on (kernel handles are kept per device).
    sm_count(x): the streaming multiprocessors of x's device (split-KV fills them: split_plan).
    smem_optin(x): the most dynamic shared memory a CTA on x's device may opt in to, in bytes (the
        tensor-core backward above head_dim 192 asks for more than some devices have: backward_path).
    tensor_map(x, arguments, dtype_name): the kernel argument that is the TMA tensor map of array x
        with tensor_maps.TiledArguments `arguments` (the driver's map on a GPU, the emulator's own
        under it); dtype_name the values' dtype ("bfloat16" for uint16 bits).
    tensor_map_cache: a dict where the backend keeps the maps it made, by (device, address, shape, strides,
        dtype, box), when tensor_map's result is a function of those alone (the driver's), or None (the
        emulator's maps hold the array itself).
    compile_module is also handed modules whose options name an -arch (ModuleSpec.arch: sm_90a),
    compiled for that architecture rather than the device's (cubin.py on a GPU).
    """

    def __init__(self, xp, compile_module, device_of=None, compute_capability=None, data_ptr=None,
                 device_id=None, sm_count=None, tensor_map=None, tensor_map_cache=None, smem_optin=None):
        self.xp = xp
        self.compile_module = compile_module
        self.device_of = device_of or (lambda x: contextlib.nullcontext())
        self.compute_capability = compute_capability or (lambda x: 90)
        self.data_ptr = data_ptr or (lambda x: x.ctypes.data)
        self.device_id = device_id or (lambda x: 0)
        self.sm_count = sm_count or (lambda x: 132)  # an H100's or H200's
        self.smem_optin = smem_optin or (lambda x: 227 * 1024)  # theirs too
        self.tensor_map = tensor_map
        self.tensor_map_cache = tensor_map_cache
        self.functions = {}  # (device, ModuleSpec) -> its kernels, ready to launch
        self.stand_ins = {}  # (device, dtype) -> a one-element array passed for an argument never read
        # the backend's per-call decisions that depend on the arguments' shapes, strides and alignment alone
        # (the kernel path, the problem's kernel arguments), kept by those (cupy_backend._remember)
        self.plans = {}


def cupy_runtime() -> Runtime:
    """The Runtime of a GPU: CuPy, its NVRTC (and cubin.py for modules of their own arch), the driver's
    tensor maps."""
    import cupy

    from . import cubin, tensor_maps

    @cupy.memoize(for_each_device=True)
    def compile_module(source, name_expressions, options):
        if any(option.startswith("-arch") for option in options):  # an arch CuPy's own -arch cannot name
            return cubin.CubinModule(cupy, source, name_expressions, options)
        return cupy.RawModule(code=source, options=options, name_expressions=name_expressions)

    def tensor_map(x, arguments, dtype_name):
        return tensor_maps.gpu_tensor_map_bytes(x.data.ptr, dtype_name, arguments)

    # A device's compute capability and SM count, asked once: Device.attributes queries every attribute
    # of the device, each a driver call, where a decode step asks the SM count (split_plan) every call
    @functools.lru_cache(maxsize=None)
    def compute_capability(device_id):
        return int(cupy.cuda.Device(device_id).compute_capability)

    @functools.lru_cache(maxsize=None)
    def sm_count(device_id):
        return int(cupy.cuda.Device(device_id).attributes["MultiProcessorCount"])

    @functools.lru_cache(maxsize=None)
    def smem_optin(device_id):
        return int(cupy.cuda.Device(device_id).attributes["MaxSharedMemoryPerBlockOptin"])

    return Runtime(cupy, compile_module, lambda x: x.device, lambda x: compute_capability(x.device.id),
                   lambda x: x.data.ptr, lambda x: x.device.id, lambda x: sm_count(x.device.id), tensor_map, {},
                   lambda x: smem_optin(x.device.id))
