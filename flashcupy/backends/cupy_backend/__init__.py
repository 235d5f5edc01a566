"""CuPy backend: FlashAttention kernels in CUDA C++, compiled at first use by NVRTC.

The kernels live beside this file in kernels/*.cu (see the header of each file for what it
computes, its tiles and its shared-memory budget); specs.py says which specializations exist.
This module packs arguments, allocates outputs and workspaces, and launches:

    forward   flash_fwd | flash_fwd_tc | flash_fwd_sm90  grid: query blocks x batch x heads_q
              (split-KV: x splits, partial outs merged by flashcupy.merge's rule; split_plan)
              (a packed batch, forward_varlen: flash_fwd | flash_fwd_tc reading the offsets themselves,
              grid: (total_q / block_m + sequences) x heads_q, launch.varlen_blocks; on sm_90 too)
    backward  flash_bwd_preprocess  D = rowsum(dO ∘ O)    grid: batch x heads_q x seqlen_q / 4
              flash_bwd_dkdv | flash_bwd_dkdv_tc  dK, dV   grid: key blocks x batch x heads_kv
              flash_bwd_dq | flash_bwd_dq_tc      dQ       grid: query blocks x batch x heads_q
              (tensor cores, unless deterministic: dQ added by flash_bwd_dkdv_tc with atomics into an
              fp32 workspace, then flash_bwd_dq_convert scales and rounds it; grid: elements / 128)
              (sm_90: flash_bwd_dkdv_sm90 adds dQ by bulk reduce-adds into fp32 tiles, in key-block
              order when deterministic, then flash_bwd_dq_convert_sm90 scales and rounds them)
              flash_bwd_dbias (with a bias)      dbias    grid: tiles of the bias's own shape
              (a packed batch, backward_varlen: dK/dV and dQ reading the offsets themselves, grids
              (total_k / block_n + sequences) x heads_kv and (total_q / block_m + sequences) x heads_q;
              the preprocess and the conversion over the packed rows as over one sequence)
    probs     flash_probs (attention_probs)      P        grid: row blocks x key blocks x batch x heads_q
    append    flash_kv_append (attention_with_kvcache's new k, v into the cache)  grid: elements / 128

The SIMT kernels (flash_*.cu) take every dtype; the tensor-core ones (flash_*_tc.cu) take
float16/bfloat16 where `forward_path` / `backward_path` say so, with the same arguments; on compute
capability 9.0 the Hopper kernels (flash_fwd_sm90.cu, flash_bwd_sm90.cu, compiled for sm_90a by
cubin.py) take the calls they cover, their tensors passed as TMA tensor maps (tensor_maps.py) made
through the Runtime.

Every tensor is passed as a pointer to its first element plus its element strides (any layout,
negative strides included); sizes as int32, the scale in the accumulation type, then causal and the
causal diagonal (Problem.diagonal) as int32, then the score modifiers (_modifier_args: the window's
sides, softcap, the ALiBi slopes, the bias, the bool mask), which only the kernels specialised for them read: the MODS
template argument (specs.MOD_BITS) is chosen per call from Problem.modifiers, and a call without
modifiers launches the kernels it launched before they existed. The interface has checked head_dim and every grid
(MAX_HEAD_DIM, grid_axes) before a call gets here. Launches go to CuPy's current stream on the
inputs' device.

CuPy is imported at first use, never at import time. Everything the backend takes from CUDA
goes through one `Runtime`: the array module for allocations and the module compiler. The
tests install a runtime made of NumPy and a CPU emulator of CUDA (flashcupy/tools/emulator/cupy.py),
which runs these same kernels and this same launch code without a GPU.
"""

from __future__ import annotations

import functools

import numpy as np

from ... import _dropout, backends
from ..._problem import LOG2E
from . import launch, sources, specs, tensor_maps
from .runtime import Runtime, cupy_runtime

NAME = "cupy"
ARRAY_LIBRARIES = ("cupy",)
DTYPES = tuple(specs.CUDA_TYPES)  # bfloat16 as uint16 bit patterns: CuPy has no bfloat16 dtype

# The float16/bfloat16 forward and backward run on tensor cores (flash_fwd_tc.cu, flash_bwd_tc.cu)
# wherever they can; False forces the SIMT kernels (flash_fwd.cu, flash_bwd.cu) everywhere, to
# compare the two.
USE_TENSOR_CORES = True
# On compute capability 9.0 the forward and backward run on the Hopper kernels (flash_fwd_sm90.cu,
# flash_bwd_sm90.cu: TMA, wgmma, warp specialisation) wherever they can; False forces the mma.sync
# kernels (flash_*_tc.cu), to compare.
USE_WGMMA = True


runtime: Runtime | None = None  # the runtime in use; the CuPy one (runtime.cupy_runtime) is created at first use


def _runtime() -> Runtime:
    global runtime
    if runtime is None:
        runtime = cupy_runtime()
    return runtime


def unavailable_reason():
    if runtime is not None:
        return None
    try:
        import cupy
    except ImportError:
        return "cupy is not installed (pip install flashcupy[cuda12])"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # CUDARuntimeError when there is no driver or no device
        return f"no CUDA device ({e})"
    return None if count > 0 else "no CUDA device"


def allocate(like, shape, dtype, fill):
    rt = _runtime()
    with rt.device_of(like):
        return rt.xp.full(shape, fill, dtype=dtype)


# ----------------------------------------------------------------------------
# compilation and argument packing


@functools.lru_cache(maxsize=None)
def _source(source_file: str) -> str:
    return sources.read_source(source_file)


def _options(module: specs.ModuleSpec) -> tuple:
    """Our NVRTC options. cupy.RawModule adds CuPy's own (sources.CUPY_NVRTC_OPTIONS, -arch for the
    device, and -I for the CUDA headers, found by cuda-pathfinder), so none of those is passed here;
    a module for an arch of its own (sm_90a) gets the whole list with that -arch (sources.arch_options)."""
    return sources.COMPILE_OPTIONS if module.arch is None else sources.arch_options(module.arch)


def _functions(rt: Runtime, module: specs.ModuleSpec, like) -> list:
    """The module's kernels on `like`'s device, in the order of module.kernels, ready to launch.

    Fetched, and opted in to more than 48 KiB of dynamic shared memory where they need it, once
    per (device, module): both are driver calls that would otherwise cost every launch.
    Call with `like`'s device current.
    """
    key = (rt.device_id(like), module)
    functions = rt.functions.get(key)
    if functions is None:
        compiled = rt.compile_module(_source(module.source_file), module.name_expressions, _options(module))
        functions = [compiled.get_function(name) for name in module.name_expressions]
        for function, kernel in zip(functions, module.kernels):
            if kernel.dynamic_smem > specs.SMEM_DEFAULT_LIMIT:  # opt in above 48 KiB (sm_70+)
                function.max_dynamic_shared_size_bytes = kernel.dynamic_smem
        rt.functions[key] = functions
    return functions


def _tensor(x) -> tuple:
    """A tensor argument: the array (its first element), then its strides in elements."""
    strides, itemsize = x.strides, x.itemsize
    return (x, *_remember(_element_strides_cache, (strides, itemsize),
                          lambda: tuple(np.int64(s // itemsize) for s in strides)))


def _shape_args(p) -> tuple:
    return tuple(np.int32(n) for n in (p.seqlen_q, p.seqlen_k, p.heads_q, p.group, p.head_dim, p.head_dim_v))


def _tile_head_dim(p) -> int:
    """The head dim the SIMT and tensor-core (mma.sync) kernels' tiles are built for: the larger of
    q's and v's (each tile zero past its own tensor's, so the padding adds nothing)."""
    return max(p.head_dim, p.head_dim_v)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


MAX_HEAD_DIM = specs.MAX_HEAD_DIM
MODIFIERS = frozenset(specs.MOD_BITS)  # the score modifiers the kernels compute; _api refuses the others
DROPOUT = True  # dropout_p: every kernel (the SIMT, mma.sync and Hopper ones)
DROPOUT_SEED_ON_DEVICE = True  # the kernels read the seed from device memory where given (_dropout_args)
HEAD_DIM_V = True  # v's head_dim may differ from q's and k's (_tc_takes: which kernels)


# The host's own work of a call, kept between calls where its inputs are the same: every launch's grid
# (grid_axes, by the problem's shapes), the kernel path (forward_path, backward_path: by the arrays'
# layouts), the kernels' scalar arguments (_problem_args: by the Problem), element strides (_tensor) and the
# Hopper kernels' tensor maps (by address, shape and strides: a map is a function of them alone). False:
# made again every call (benchmarks/host_overhead.py compares).
CACHE_HOST_WORK = True
_HOST_CACHE_SIZE = 512  # entries of each cache; a full one starts again empty
_grid_axes_cache = {}
_element_strides_cache = {}  # (byte strides, itemsize) -> the strides in elements, as kernel arguments


def _remember(cache: dict, key, make):
    """make(), kept in `cache` under key (CACHE_HOST_WORK)."""
    if not CACHE_HOST_WORK:
        return make()
    value = cache.get(key)
    if value is None:
        if len(cache) >= _HOST_CACHE_SIZE:
            cache.clear()
        value = cache[key] = make()
    return value


def grid_axes(p, backward):
    """Every launch's grid along x on either kernel path (the tensor-core backward's y is 2 at most:
    Kernel.column_parts): the path is chosen per call, from strides.
    They depend on the dtype, head_dim, modifiers, shapes and the bias's shape alone (launch.GRIDS)."""
    key = (bool(backward), p.dtype, p.head_dim, p.head_dim_v, _mods(p), p.batch, p.seqlen_q, p.seqlen_k, p.heads_q,
           p.heads_kv, None if p.bias is None else tuple(p.bias.shape))
    return _remember(_grid_axes_cache, key, lambda: _grid_axes(p, backward))


def _grid_axes(p, backward) -> tuple:
    mods, tiles, tc_backward = _mods(p), _tile_head_dim(p), _tc_backward_mods(p)
    builds = [(specs.forward_module, tiles, mods), (specs.probs_module, p.head_dim, mods)]
    builds += [(specs.backward_module, tiles, mods)] * backward
    if backward and p.dbias:
        builds.append((specs.dbias_module, tiles, mods))
    if _tc_takes(p) and specs.tensor_core_eligible(p.dtype, tiles):
        builds += [(specs.tc_forward_module, tiles, mods)]
    if backward and _tc_takes(p) and specs.tensor_core_eligible(p.dtype, tiles, tc_backward, backward=True):
        builds += [(specs.tc_backward_module, tiles, tc_backward),
                   (specs.deterministic_tc_backward_module, tiles, tc_backward)]
    if _tc_takes(p) and specs.sm90_eligible(p.dtype, tiles, mods):
        builds += [(specs.sm90_forward_module, tiles, mods)]
    if backward and _tc_takes(p) and specs.sm90_eligible(p.dtype, tiles, mods, backward=True):
        builds += [(specs.sm90_backward_module, tiles, mods)]
    return tuple((*kernel.grid(p), 0) for build, dim, m in builds for kernel in build(p.dtype, dim, m).kernels)


def _same_head_dims(p) -> bool:
    """Whether v's head_dim is q's and k's (a call with another takes the mma.sync backward's kernels
    specialised for it, _tc_backward_mods)."""
    return p.head_dim_v == p.head_dim


def _tc_takes(p) -> bool:
    """Whether the tensor-core kernels (mma.sync, forward and backward; the Hopper forward) take p's head
    dims: their tiles are padded to the larger (_tile_head_dim), each a multiple of 8, as the 16-byte rows
    ask."""
    return _same_head_dims(p) or (p.head_dim % 8 == 0 and p.head_dim_v % 8 == 0)


# ----------------------------------------------------------------------------
# forward and backward


def _layout(rt, x) -> tuple:
    """What the kernel paths' choice reads of an array besides its dtype: shape, strides and the address's
    alignment (to 16 bytes, the widest any path asks)."""
    return x.shape, x.strides, rt.data_ptr(x) % 16


def _path_remembered(kind: str, p, tensors, flags: tuple, choose) -> str:
    """choose(), kept in the Runtime's plans by what it reads: the switches, the problem's dtype, head_dim
    and modifiers, the device, and each tensor's layout (CACHE_HOST_WORK)."""
    rt = _runtime()
    key = (kind, USE_TENSOR_CORES, USE_WGMMA, p.dtype, p.head_dim, p.head_dim_v, _mods(p), flags,
           rt.device_id(tensors[0]), *(_layout(rt, x) for x in tensors))
    return _remember(rt.plans, key, choose)


def _rows_16_bytes(rt, dtype, *tensors) -> bool:
    """Whether the device runs the tensor-core kernels of `dtype` (the call's: bfloat16 comes as uint16
    bits; specs.tensor_cores_run_on) and `tensors` are all read or written through 16-byte rows:
    contiguous along head_dim, the other strides multiples of 8 elements, 16-byte aligned."""
    if not specs.tensor_cores_run_on(dtype, rt.compute_capability(tensors[0])):
        return False
    for x in tensors:
        strides = [s // x.itemsize for s in x.strides]
        if strides[3] != 1 or any(s % 8 for s in strides[:3]) or rt.data_ptr(x) % 16:
            return False
    return True


def _path(p, *tensors, split: bool = False, backward: bool = False) -> str:
    """'tensor-core' when the tensor-core forward (split: split-KV's; backward: the backward) takes the
    call (specs.tensor_core_eligible) and `tensors` (all read or written through 16-byte rows), else
    'simt'."""
    eligible = USE_TENSOR_CORES and _tc_takes(p) and specs.tensor_core_eligible(
        p.dtype, _tile_head_dim(p), _tc_backward_mods(p) if backward else _mods(p), split, backward,
        _turing(tensors[0]))
    return "tensor-core" if eligible and _rows_16_bytes(_runtime(), p.dtype, *tensors) else "simt"


def _tma_describable(rt, x) -> bool:
    """Whether a tensor map (tensor_maps.py) can describe x, a (batch, seqlen, heads, head_dim) array:
    contiguous along head_dim, 16-byte aligned, the other strides positive multiples of 16 bytes below
    2^40; a dimension of size 1 may have any stride (never used: _map_strides)."""
    return (x.strides[3] == x.itemsize and rt.data_ptr(x) % 16 == 0
            and all(n == 1 or (0 < s < 2 ** 40 and s % 16 == 0) for n, s in zip(x.shape[:3], x.strides[:3])))


def _hopper(p, backward: bool, rows, *tensors, varlen: bool = False) -> bool:
    """Whether the Hopper forward (backward) takes a call (varlen: a packed batch's): USE_TENSOR_CORES and
    USE_WGMMA, compute capability 9.0, a dtype, head_dim and modifiers it covers (specs.sm90_eligible:
    head_dim up to 256 in the forward and the backward; every modifier in one
    batch's forward and backward; v of its own head dim as the mma.sync kernels take it, _tc_takes, the
    tiles padded to the larger), `rows` read through 16-byte rows (_rows_16_bytes: what the mma.sync
    kernels ask of the same arrays), and `tensors`, read or written through tensor maps, describable by
    one (_tma_describable)."""
    rt = _runtime()
    return (USE_TENSOR_CORES and USE_WGMMA and _tc_takes(p)
            and specs.sm90_eligible(p.dtype, _tile_head_dim(p), _mods(p), backward, varlen)
            and rt.compute_capability(tensors[0]) == specs.SM90_COMPUTE_CAPABILITY
            and _rows_16_bytes(rt, p.dtype, *rows) and all(_tma_describable(rt, x) for x in tensors))


def forward_path(p, q, k, v, out=None, split: bool = False, paged: bool = False, varlen: bool = False) -> str:
    """'hopper', 'tensor-core' or 'simt': which forward kernel serves this call.

    Tensor cores take float16/bfloat16 with head_dim a multiple of 8 up to 256, on sm_80 or newer
    (float16 up to head_dim 128 on Turing, sm_75: specs.TC_COMPUTE_CAPABILITY, TC_TURING_HEAD_DIM_BUCKETS),
    when q, k, v are contiguous along head_dim with 16-byte aligned rows (the other strides multiples
    of 8 elements); everything else runs on the SIMT kernel. On compute capability 9.0 the Hopper
    kernel takes those calls when they have
    modifiers it takes (specs.sm90_eligible: all of them but a bias above head_dim 128; in a packed
    batch, varlen, the window, softcap and ALiBi, but the window alone at 256), no split-KV and no
    paged KV cache (paged: its keys are read through the block table, a row at a time), and q, k, v
    (and out, when given) a tensor map can describe (_tma_describable: positive strides too); the
    others stay on the mma.sync kernel, never an error. A packed batch (q, k, v
    a batch of one) takes the same kernels as a batch of its sequences would, but for the modifiers
    above.
    """
    tensors = (q, k, v) if out is None else (q, k, v, out)

    def choose():
        if not split and not paged and _hopper(p, False, (q, k, v), *tensors, varlen=varlen):
            return "hopper"
        path = _path(p, q, k, v, split=split)
        if path == "tensor-core" and not _fits(_tc_forward_module(p, q, split, varlen), q):
            return "simt"
        return path
    return _path_remembered("forward", p, tensors, (split, paged, varlen), choose)


def _fits(module: specs.ModuleSpec, x) -> bool:
    """Whether every kernel of `module` asks for no more dynamic shared memory than x's device lets a CTA
    opt in to (Runtime.smem_optin): a tensor-core tile that does not fit runs on the SIMT kernels instead
    (today the backward's above head_dim 192 on an sm_86, sm_89 or sm_120; every forward tile fits the
    devices that take it, Turing's 64 KiB with TC_TURING_TILES)."""
    return max(kernel.dynamic_smem for kernel in module.kernels) <= _runtime().smem_optin(x)


def backward_path(p, dout, q, k, v, out, deterministic: bool = False, varlen: bool = False,
                  dq_only: bool = False) -> str:
    """'hopper', 'tensor-core' or 'simt': which backward kernels (dK/dV and dQ) serve this call.

    The forward's conditions, on dout and out as well as q, k, v (lse may have any strides;
    dq, dk, dv are allocated contiguous), and the tensor-core backward's shared memory no more than the
    device lets a CTA opt in to (head_dim 193..256 on an sm_86, sm_89 or sm_120 runs on the SIMT
    kernels); the Hopper backward takes calls up to head_dim 256 (136..256 in its 256 kernel), with
    any modifier (varlen, a packed batch: the window, softcap and ALiBi; specs.sm90_eligible)
    (q, k, v and dout through tensor maps), deterministic or not: its CTAs add dQ into one workspace
    by bulk reduce-adds, in an order that varies from run to run, or (deterministic) in key-block
    order, each CTA waiting for its turn at a tile (flash_bwd_sm90.cu's DETERMINISTIC). dq_only: never
    the Hopper kernels, whose dQ comes out of the dK/dV kernel (the others' deterministic dQ kernel runs
    alone then).
    """
    def choose():
        if not dq_only and _hopper(p, True, (q, k, v, dout, out), q, k, v, dout, varlen=varlen):
            return "hopper"
        path = _path(p, q, k, v, dout, out, backward=True)
        if path == "tensor-core":  # above head_dim 192 its tiles ask for up to 129 KiB (launch.LAUNCH)
            if not _fits(_tc_backward_module(p, q, deterministic, varlen), q):
                return "simt"
        return path
    return _path_remembered("backward", p, (q, k, v, dout, out), (varlen, deterministic, dq_only), choose)


def _window_args(p) -> tuple:
    """The band's sides as the kernels take them (Band.kernel_sides), as int32."""
    return tuple(np.int32(side) for side in p.band.kernel_sides())


def _problem_args(rt, p, like, tensor_cores: bool) -> tuple:
    """The arguments every kernel takes after its tensors (PROBLEM_PARAMS): the sizes (_shape_args), the
    scale in the accumulation type, causal and the diagonal as int32, then the score modifiers'
    (_modifier_args; tensor_cores: in the units of the tensor-core and Hopper kernels), then dropout's
    (_dropout_args). Kept in the Runtime's plans where p holds no array (alibi_slopes, bias, mask,
    dropout_seed_words): a function of p alone then, its
    absent arrays one stand-in a device. Call with like's device current."""
    def make():
        return (*_shape_args(p), p.acc_dtype.type(p.scale), np.int32(p.causal), np.int32(p.diagonal),
                *_modifier_args(p, _stand_in(rt, like, p.acc_dtype), tensor_cores),
                *_dropout_args(p, _stand_in(rt, like, _UINT32)))
    if p.alibi_slopes is None and p.bias is None and p.mask is None and p.dropout_seed_words is None:
        return _remember(rt.plans, ("problem", p, tensor_cores, rt.device_id(like)), make)
    return make()


def _modifier_args(p, unused, tensor_cores: bool) -> tuple:
    """The kernels' arguments after PROBLEM_PARAMS' diagonal: window_left, window_right, the
    softcap's cap_in and cap_out in the units of the kernel path (Score in mask.cuh: the SIMT
    kernels' scores are natural and scaled, the tensor-core ones' unscaled and then base 2),
    the ALiBi slopes as a (batch, heads_q) array of the accumulation type and its element
    strides (batch stride 0 for per-head slopes), then the bias (_pair_tensor), whether it is
    float32, and the bool mask (_pair_tensor). `unused`, an array of the accumulation type,
    stands in for absent arrays: a kernel not specialised for a modifier never reads its pointer."""
    acc = p.acc_dtype.type
    window = _window_args(p) if "window" in p.modifiers else (np.int32(0), np.int32(0))
    c = 1.0 if p.softcap is None else p.softcap
    softcap = (acc(p.scale / c), acc(c * LOG2E)) if tensor_cores else (acc(1 / c), acc(c))
    bias = (*_pair_tensor(p.bias, unused), np.int32(p.bias is not None and p.bias.dtype == np.float32))
    mask = _pair_tensor(p.mask, unused)
    slopes = p.alibi_slopes
    if slopes is None:
        return (*window, *softcap, unused, np.int64(0), np.int64(0), *bias, *mask)
    slopes = _runtime().xp.asarray(slopes, dtype=p.acc_dtype)  # a copy only for float32 slopes in float64
    strides = [s // slopes.itemsize for s in slopes.strides]
    return (*window, *softcap, slopes, np.int64(0 if slopes.ndim == 1 else strides[0]), np.int64(strides[-1]),
            *bias, *mask)


def _dropout_args(p, unused) -> tuple:
    """PROBLEM_PARAMS' last (mask.cuh's Dropout): the threshold, the seed's low and high words, the
    device array that holds them instead (p.dropout_seed_words; `unused`, a uint32 stand-in, where there
    is none) and whether it does, the origin (batch, head, query, key) as uint32, then 1 / (1 - p) in the
    accumulation type."""
    words = p.dropout_seed_words
    seed = (p.dropout_seed & 0xFFFFFFFF, p.dropout_seed >> 32)
    origin = (x & 0xFFFFFFFF for x in p.dropout_origin)
    return (np.uint32(_dropout.threshold(p.dropout_p)), *map(np.uint32, seed),
            unused if words is None else words,
            np.int32(words is not None), *map(np.uint32, origin), p.acc_dtype.type(p.dropout_scale))


def _pair_tensor(x, unused) -> tuple:
    """A bias or mask argument (rank 4, broadcastable to (batch, heads_q, seqlen_q, seqlen_k)): the
    array as it is, then its element strides, 0 along a dimension of size 1 (broadcast, whatever its
    stride); `unused` and zeros when absent."""
    if x is None:
        return (unused, *(np.int64(0),) * 4)
    return (x, *(np.int64(0 if n == 1 else s // x.itemsize) for n, s in zip(x.shape, x.strides)))


def _mods(p) -> int:
    """The MODS template argument of p: its score modifiers' bits, and dropout's."""
    return specs.mods_of(p.modifiers) | (specs.MOD_DROPOUT if p.dropout else 0)


def _tc_backward_mods(p) -> int:
    """The mma.sync backward's MODS: _mods', and MOD_HEAD_DIM_V where v has a head dim of its own (its
    kernels bound v's and dout's tiles by head_dim, the same bound as q's and k's, unless specialised so:
    flash_bwd_tc.cu's V_HEAD_DIM says why)."""
    return _mods(p) | (0 if _same_head_dims(p) else specs.MOD_HEAD_DIM_V)


def split_plan(p, q, k, v, num_splits=None) -> tuple:
    """(splits, keys per split) of split-KV for this forward: (1, 0) for none.

    num_splits None: when one CTA per (query block, batch, query head) leaves the device with at most
    two CTAs per SM (decoding: one query block, few heads), enough splits that the grid holds more,
    each of at least specs.SPLIT_ALIGN keys (so there may be fewer). An int: at most that many, of
    about equal length. Keys per split are a multiple of specs.SPLIT_ALIGN, so no tile crosses a split.
    """
    ctas = _forward_module(p, q, k, v, False)[1].kernels[0].blocks(p) if num_splits is None else 0
    split_ctas = _forward_module(p, q, k, v, True)[1].kernels[0].blocks(p)
    return _split_rule(p.seqlen_k, ctas, split_ctas, num_splits, q)


def _split_rule(keys: int, ctas: int, split_ctas: int, num_splits, like) -> tuple:
    """split_plan's rule, shared with packed.cache_plan: (splits, keys per split) of `keys` keys for a
    grid of `ctas` CTAs unsplit and `split_ctas` per split (on like's device), or (1, 0)."""
    align = specs.SPLIT_ALIGN
    if num_splits is None:
        target = 2 * _runtime().sm_count(like)
        if ctas > target:
            return 1, 0
        key_split = max(align, keys // _cdiv(target + 1, ctas) // align * align)
    else:
        key_split = _cdiv(_cdiv(keys, num_splits), align) * align
    room = backends.MAX_GRID[0] // split_ctas  # the splits CUDA's grid x holds
    if _cdiv(keys, key_split) > room:
        key_split = _cdiv(_cdiv(keys, room), align) * align
    splits = _cdiv(keys, key_split)
    return (splits, key_split) if splits > 1 else (1, 0)


def _forward_module(p, q, k, v, split: bool, out=None, varlen: bool = False, paged: bool = False) -> tuple:
    """(forward_path, the forward's ModuleSpec) for this call; varlen: a packed batch's, in one launch
    (forward_varlen), paged: its keys a paged KV cache's."""
    path = forward_path(p, q, k, v, out, split, paged, varlen)
    if path == "hopper":
        dim = _tile_head_dim(p)
        tile = specs.sm90_forward_tile(dim, _mods(p), p.causal, varlen, SM90_WIDE, SM90_TALL_FORWARD)
        return path, specs.sm90_forward_module(p.dtype, dim, _mods(p), varlen, tile)
    if path == "tensor-core":
        return path, _tc_forward_module(p, q, split, varlen)
    return path, specs.forward_module(p.dtype, _tile_head_dim(p), _mods(p), split, varlen)


def _tc_forward_module(p, q, split: bool, varlen: bool) -> specs.ModuleSpec:
    """The tensor-core forward's ModuleSpec for this call, with the tiles of q's device (specs.tc_turing)."""
    return specs.tc_forward_module(p.dtype, _tile_head_dim(p), _mods(p), split, varlen, _turing(q))


def _tc_backward_module(p, q, deterministic: bool, varlen: bool) -> specs.ModuleSpec:
    """The tensor-core backward's ModuleSpec for this call, with the tiles of q's device (specs.tc_turing)."""
    return specs.tc_backward_module(p.dtype, _tile_head_dim(p), _tc_backward_mods(p), deterministic, varlen,
                                    _turing(q))


def _turing(x) -> bool:
    """Whether x's device takes the tensor-core kernels' Turing tiles (specs.tc_turing)."""
    return specs.tc_turing(_runtime().compute_capability(x))


def _map_strides(x) -> tuple:
    """x's byte strides as a tensor map takes them (dims 1.. innermost first: heads, seqlen, batch),
    a dimension of size 1 given 16 (its stride is never used, and the map wants a multiple of 16)."""
    return tuple(s if n > 1 else 16 for n, s in zip(reversed(x.shape[:3]), reversed(x.strides[:3])))


def _sm90_maps(rt, p, *boxes) -> tuple:
    """The tensor maps of a Hopper kernel's (array, rows) `boxes`: (head_dim, heads, seqlen, batch)
    innermost first, boxes of one 128B-swizzled atom of columns (specs.SM90_ATOM), one head, one batch,
    and the rows one load or store moves. Kept in rt.tensor_map_cache where the Runtime has one (a GPU's:
    the driver's map is a function of the address, dtype, shape, strides and box alone; the emulator's
    holds the array itself)."""
    def tensor_map(x, rows):
        arguments = tensor_maps.tiled_arguments(x, (specs.SM90_ATOM, 1, rows, 1), "128B", strides=_map_strides(x))
        return rt.tensor_map(x, arguments, p.dtype)

    def remembered(x, rows):
        if rt.tensor_map_cache is None:
            return tensor_map(x, rows)
        key = (rt.device_id(x), rt.data_ptr(x), x.shape, x.strides, x.dtype.str, p.dtype, rows)
        return _remember(rt.tensor_map_cache, key, lambda: tensor_map(x, rows))
    return tuple(remembered(x, rows) for x, rows in boxes)


WRITES_INTO = True  # forward, backward and probs write into given arrays (into=): XLA's buffers for flashcupy.jax
DQ_ONLY = True  # backward launches the D pre-pass and the (deterministic) dQ kernel alone where p.dq_only


def forward(p, q, k, v, num_splits=1, into=None):
    """out, lse. num_splits (split_plan): 1, the default, one launch over all keys; None or an int >
    1, split-KV: the splits' partial outs (in the accumulation dtype) and lses from one launch,
    merged by flashcupy.merge's rule in a second (flash_merge.cu). into: None or (out, lse) arrays the
    kernels write."""
    rt = _runtime()
    splits, key_split = (1, 0) if num_splits == 1 else split_plan(p, q, k, v, num_splits)
    path, module = _forward_module(p, q, k, v, splits > 1, None if into is None else into[0])
    (kernel,) = module.kernels
    with rt.device_of(q):
        (fwd,) = _functions(rt, module, q)
        if path == "hopper":
            out, lse = into if into is not None else (rt.xp.empty(p.out_shape, dtype=p.carrier),
                                                      rt.xp.empty(p.lse_shape, dtype=p.lse_dtype))
            # persistent: a CTA an SM (at most), each taking its next tile where a counter says (zeros)
            tiles = kernel.blocks(p)
            ctas = min(tiles, rt.sm_count(q)) if SM90_PERSISTENT else tiles
            counter = rt.xp.zeros(1, dtype=np.int32) if ctas < tiles else _int32_stand_in(rt, q)
            fwd((ctas,), (kernel.threads,),
                # Q_i's BLOCK_M rows, a key block's BLOCK_N, a consumer's rows of out
                (*_sm90_maps(rt, p, (q, kernel.block_m), (k, kernel.block_n), (v, kernel.block_n),
                             (out, specs.SM90_CONSUMER_ROWS)), *_tensor(lse), *_problem_args(rt, p, q, True),
                 np.int32(tiles), counter, *_tensor(out), *_no_varlen(rt, q)),
                shared_mem=kernel.dynamic_smem)
            return out, lse
        out, lse = into if into is not None else (rt.xp.empty(p.out_shape, dtype=p.carrier),
                                                  rt.xp.empty(p.lse_shape, dtype=p.lse_dtype))
        if splits > 1:  # workspaces: (splits, *out's shape) and (splits, *lse's shape)
            outs = rt.xp.empty((splits,) + p.out_shape, dtype=p.acc_dtype)
            lses = rt.xp.empty((splits,) + p.lse_shape, dtype=p.lse_dtype)
            # the whole workspaces, with one split's strides: the kernel adds the split's offset
            part_out, part_lse = (_tensor(x)[:1] + _tensor(x[0])[1:] for x in (outs, lses))
            split_args = (np.int32(key_split), np.int64(outs.strides[0] // outs.itemsize),
                          np.int64(lses.strides[0] // lses.itemsize))
        else:
            part_out, part_lse = _tensor(out), _tensor(lse)
            split_args = (np.int32(0), np.int64(0), np.int64(0))
        fwd(
            (kernel.blocks(p) * splits,), (kernel.threads,),
            (*_tensor(q), *_tensor(k), *_tensor(v), *part_out, *part_lse,
             *_problem_args(rt, p, q, path == "tensor-core"), *split_args, *_no_varlen(rt, q), *_no_pages(rt, q)),
            shared_mem=kernel.dynamic_smem)
        if splits > 1:
            _merge_splits(rt, p, q, splits, part_out, part_lse, split_args, _tensor(out), _tensor(lse),
                          p.batch, p.seqlen_q)
    return out, lse


def _merge_splits(rt, p, like, splits, outs, lses, split_args, out, lse, batch, seqlen) -> None:
    """split-KV's merge in one launch (flash_merge.cu, flashcupy.merge's rule): the partial outs and lses
    that a SPLIT forward kernel wrote into its workspaces, given as that kernel's out and lse arguments
    (outs, lses: the workspace, split 0's strides) and its split_args (the offsets between splits), into
    out and lse, kernel arguments likewise (a packed batch's with batch strides 0: batch 1, seqlen its
    rows). Call with like's device current."""
    module = specs.merge_module(p.dtype)
    (kernel,) = module.kernels
    (merge,) = _functions(rt, module, like)
    elements = batch * seqlen * p.heads_q * p.head_dim_v
    merge((_cdiv(elements, specs.NUM_THREADS),), (kernel.threads,),
          (*outs, *lses, *out, *lse, np.int32(splits), *split_args[1:], np.int32(batch), np.int32(seqlen),
           np.int32(p.heads_q), np.int32(p.head_dim_v)))


# The Hopper forward's grid: True, min(tiles, SMs) CTAs, each taking tiles until none is left (the next
# free one by an atomic counter); False, the default, a CTA a tile. Measured side by side on an H200 with
# a static round-robin of the tiles (benchmarks/results/h200_session3/forward_persistent.txt): 0.92-1.03x
# a CTA a tile at S = 512..16384, and 0.72x causal at S=16k, D=128, where the round-robin lost the balance
# the hardware's dispatch of one CTA a tile gives; with the counter: unmeasured
SM90_PERSISTENT = False

# The Hopper forward's key block without causal or a window, one batch: True, FA3's wider ones
# (specs.SM90_WIDE_FORWARD_TILES: 176 keys at head_dim 128, O staged in Q_i's shared memory; 192 at 64);
# False, the default, 128, the block measured on an H200 (benchmarks/results/h200_session3/). The wide
# blocks: unmeasured (the GPU session's cupy-wide)
SM90_WIDE = False

# The Hopper forward's query tile at head_dim 64: True, FA3's 192 rows, three consumer warpgroups
# (specs.SM90_TALL_FORWARD_TILES; before SM90_WIDE there); False, the default, 128, the tile measured on an
# H200 (benchmarks/results/h200_session3/). The 192-row tile: unmeasured (the GPU session's cupy-tallfwd)
SM90_TALL_FORWARD = False

# The Hopper backward's pass at head_dim 64 without the window: True, FA3's 128 query rows
# (specs.SM90_TALL_BACKWARD_TILES); False, the default, 64, the pass measured on an H200
# (benchmarks/results/h200_session3/). The 128-row pass: unmeasured (hopper_backward_check.py's tall column)
SM90_TALL_BACKWARD = False


def _stand_in(rt, like, dtype):
    """A never-read one-element array argument of dtype, made once per device. Call with like's device
    current."""
    key = (rt.device_id(like), dtype)  # dtype: an np.dtype (p.acc_dtype, _INT32)
    stand_in = rt.stand_ins.get(key)
    if stand_in is None:
        stand_in = rt.stand_ins[key] = rt.xp.zeros(1, dtype=dtype)
    return stand_in


def _int32_stand_in(rt, like):
    """A never-read int32 array argument, made once per device. Call with like's device current."""
    return _stand_in(rt, like, _INT32)


_INT32 = np.dtype(np.int32)
_UINT32 = np.dtype(np.uint32)  # dropout's seed pointer (_dropout_args)


def _no_varlen(rt, like) -> tuple:
    """The VARLEN_PARAMS of a kernel not specialised for a packed batch (never read): int32 stand-ins for
    the offsets, no sequence, no seqused_k. Call with like's device current."""
    stand_in = _int32_stand_in(rt, like)
    return stand_in, stand_in, np.int32(0), stand_in, np.int32(0), np.int32(0)


def _no_pages(rt, like) -> tuple:
    """The PAGED_PARAMS of a forward kernel whose keys are not a paged cache's: no block table (page_size
    0). Call with like's device current."""
    return _int32_stand_in(rt, like), np.int64(0), np.int64(0), np.int32(0), np.int32(0)


def probs(p, q, k, lse, rows, into=None):
    """attention_probs: P of the query rows `rows` (a host index array, checked by the interface),
    (batch, heads_q, len(rows), seqlen_k) in lse's dtype, by flash_probs (flash_pairs.cu); into: None
    or the array to write (P's shape and dtype, any strides)."""
    rt = _runtime()
    module = specs.probs_module(p.dtype, p.head_dim, _mods(p))
    (kernel,) = module.kernels
    with rt.device_of(q):
        (fn,) = _functions(rt, module, q)
        index = rt.xp.asarray(np.asarray(rows, dtype=np.int64))
        P = rt.xp.empty((p.batch, p.heads_q, len(rows), p.seqlen_k), dtype=p.lse_dtype) if into is None else into
        fn(
            (kernel.blocks(p, len(rows)),), (specs.NUM_THREADS,),
            (*_tensor(q), *_tensor(k), *_tensor(lse), index, np.int32(len(rows)),
             P, *(np.int64(s // P.itemsize) for s in P.strides),
             *_problem_args(rt, p, q, False)))
    return P


# the backward, the packed batches and the KV cache: their launchers use the helpers above (imported
# last, so that they find them)
from .backward import ATOMIC_BACKWARD, backward  # noqa: E402,F401
from .packed import append_kv, backward_varlen, cache_plan, even_offsets, forward_varlen  # noqa: E402,F401
