"""Every module the cupy backend can request, as lists: what the NVRTC report
(flashcupy/tools/nvrtc.py, `python -m flashcupy kernels`), benchmarks/sass_counts.py and the tests
compile. specs.py builds each module; this file only enumerates them.
"""

from __future__ import annotations

import functools

from .specs import (ALL_MODS, CUDA_TYPES, HEAD_DIM_BUCKETS, MOD_BITS, TC_DTYPES, TC_HEAD_DIM_BUCKETS,
                    SM90_BACKWARD_MODS, SM90_BACKWARD_TILES, SM90_FORWARD_MODS, SM90_FORWARD_TILES,
                    SM90_TALL_BACKWARD_TILES, SM90_TALL_FORWARD_TILES, SM90_VARLEN_BACKWARD_MODS,
                    SM90_VARLEN_FORWARD_MODS,
                    SM90_WIDE_FORWARD_TILES, append_module,
                    backward_module, dbias_module, deterministic_tc_backward_module, forward_module, merge_module,
                    probs_module, sm90_backward_module, sm90_eligible, sm90_forward_module, sm90_forward_tile,
                    smem_optin, tc_backward_module, tc_turing, tensor_core_eligible, tensor_cores_run_on,
                    tc_forward_module)

# What the NVRTC report compiles of each kernel family: the plain kernels and every modifier (the most
# work in a tile's loop) everywhere; the window alone on tensor cores only, whose window variants sit
# near the register limit. A SIMT kernel's window alone is its plain loop with the band's bounds: far
# below the limit when it left the report, whose minutes of NVRTC are CI's largest cost.
REPORT_MODS = (0, ALL_MODS)
REPORT_TC_MODS = (0, MOD_BITS["window"], ALL_MODS)


def all_modules(mods=REPORT_MODS, tc_mods=REPORT_TC_MODS, turing: bool = False):
    """Every module the backend can request, for each MODS of `mods` (of `tc_mods` on tensor cores):
    the forward, backward and attention_probs for each dtype and bucket (and the bias's gradient
    where MODS has a bias), the tensor-core forward and backward for each of their dtypes and
    buckets, the split-KV forwards (split_modules, for the first and last of `mods`), and the KV-cache
    append and split-KV's merge for each dtype; turing: the tensor-core kernels with Turing's tiles
    (specs.TC_TURING_TILES). The defaults are what the NVRTC report checks."""
    return ([build(dtype, bucket, m)
             for m in mods for dtype in CUDA_TYPES for bucket in HEAD_DIM_BUCKETS
             for build in (forward_module, backward_module, probs_module)
             + ((dbias_module,) if m & MOD_BITS["bias"] else ())]
            + tc_modules(tc_mods, turing=turing)
            + split_modules(mods, turing)
            + [append_module(dtype) for dtype in CUDA_TYPES] + [merge_module(dtype) for dtype in CUDA_TYPES])


def modules_for(compute_capability: int) -> list:
    """all_modules() as a device of `compute_capability` takes them (taken_on), with its tensor-core tiles
    (specs.tc_turing)."""
    return taken_on(all_modules(turing=tc_turing(compute_capability)), compute_capability)


def taken_on(modules, compute_capability: int) -> list:
    """`modules` but those a device of `compute_capability` never takes: the tensor-core kernels of a dtype
    below its TC_COMPUTE_CAPABILITY (they do not compile there: bfloat16 below sm_80, every dtype below
    sm_75) or that ask for more shared memory than it lets a CTA have (specs.smem_optin: the backward above
    head_dim 192 on an sm_86, sm_89 or sm_120; it runs on the SIMT kernels there)."""
    optin = smem_optin(compute_capability)
    return [m for m in modules
            if not any(k.tensor_cores and (not tensor_cores_run_on(k.dtype, compute_capability)
                                           or k.dynamic_smem > optin) for k in m.kernels)]


def tc_modules(tc_mods, dtypes=TC_DTYPES, split: bool = False, turing: bool = False) -> list:
    """The tensor-core forward, backward and deterministic backward (and split-KV forward if asked)
    for each MODS of `tc_mods`, dtype and bucket of TC_HEAD_DIM_BUCKETS: the backwards where a call takes
    them (not with the mask at 256: specs.tensor_core_eligible); turing: with Turing's tiles."""
    forwards = (tc_forward_module,) + ((_tc_split_forward,) if split else ())
    backwards = (tc_backward_module, deterministic_tc_backward_module)
    modules = [build(dtype, bucket, m, turing=turing) for m in tc_mods for dtype in dtypes
               for bucket in TC_HEAD_DIM_BUCKETS if tensor_core_eligible(dtype, bucket, m, turing=turing)
               for build in forwards + (backwards if tensor_core_eligible(dtype, bucket, m, backward=True) else ())]
    return [m for m in modules if m is not None]


def _tc_split_forward(dtype, bucket, mods, varlen=False, turing=False):
    """The tensor-core split-KV forward, where it takes the call (specs.TC_SPLIT_PAIRS_BUCKETS), else None."""
    if not tensor_core_eligible(dtype, bucket, mods=mods, split=True, turing=turing):
        return None
    return tc_forward_module(dtype, bucket, mods, True, varlen, turing)


def every_tc_modifier_set_modules(dtypes=TC_DTYPES, turing: bool = False):
    """The tensor-core modules with each of the 32 sets of score modifiers (the report above compiles
    three: none, the window, all), at both head-dim buckets: the forward, split-KV forward, default and
    deterministic backward. `python -m flashcupy kernels --every-modifier-set` compiles them
    (minutes)."""
    modules = tc_modules(range(ALL_MODS + 1), dtypes, split=True, turing=turing)
    return list({m.name_expressions: m for m in modules}.values())  # a kernel once, where sets share it


def split_modules(mods=(0, ALL_MODS), turing: bool = False):
    """The split-KV forwards (SIMT and tensor-core), for the first and last MODS of `mods` (plain,
    and the most work in a tile's loop); turing: the tensor-core ones a Turing GPU takes."""
    ends = sorted({mods[0], mods[-1]})
    return ([forward_module(dtype, bucket, m, True) for m in ends for dtype in CUDA_TYPES for bucket in HEAD_DIM_BUCKETS]
            + [m for m in (_tc_split_forward(dtype, bucket, m, turing=turing) for m in ends for dtype in TC_DTYPES
                           for bucket in TC_HEAD_DIM_BUCKETS) if m is not None])


# The modifiers attention_varlen takes (no bias, no mask): a packed batch's forwards are specialised for
# none or some of them
VARLEN_MODS = MOD_BITS["window"] | MOD_BITS["softcap"] | MOD_BITS["alibi_slopes"]


def varlen_modules(mods=(0, VARLEN_MODS), turing: bool = False):
    """The packed batch's forwards (and with split-KV: a contiguous KV cache's) and backwards (SIMT, and
    tensor-core: the default backward and the deterministic one), for each MODS of `mods` (plain, and the
    most work in a tile's loop), every dtype and bucket: what tests/test_nvrtc.py compiles of them; turing:
    the tensor-core ones with Turing's tiles (where a Turing GPU takes the split-KV one)."""
    split_forward = (lambda dtype, bucket, m, varlen: forward_module(dtype, bucket, m, True, varlen),
                     _tc_split_forward)
    tc = [build(dtype, bucket, m, varlen=True, turing=turing) for m in mods for dtype in TC_DTYPES
          for bucket in TC_HEAD_DIM_BUCKETS if tensor_core_eligible(dtype, bucket, m, turing=turing)
          for build in (tc_forward_module, split_forward[1], tc_backward_module, deterministic_tc_backward_module)]
    return ([build(dtype, bucket, m, varlen=True) for m in mods for dtype in CUDA_TYPES
             for bucket in HEAD_DIM_BUCKETS for build in (forward_module, split_forward[0], backward_module)]
            + [m for m in tc if m is not None])


def sm90_modules(dtypes=TC_DTYPES, every_modifier_set: bool = False) -> list:
    """Every Hopper module: the forward (at its tile, sm90_forward_tile) and the backward (and the
    deterministic backward) for each dtype, head-dim bucket each takes (SM90_FORWARD_TILES,
    SM90_BACKWARD_TILES), and the modifier sets they take (none, the window, the window with softcap and
    ALiBi, and every modifier each takes: SM90_FORWARD_MODS, SM90_BACKWARD_MODS and their packed batch's),
    for one batch and for a packed one (every_modifier_set: each set of modifiers each takes: `python -m
    flashcupy kernels --every-modifier-set`); the forward of one batch with FA3's wide
    key block (SM90_WIDE_FORWARD_TILES); the forward with FA3's 192 query rows (SM90_TALL_FORWARD_TILES),
    one batch, with and without the window; and the backward without the window with FA3's tall pass
    (SM90_TALL_BACKWARD_TILES), both kinds of batch, deterministic or not. The NVRTC report compiles them
    for SM90_ARCH only."""
    backwards = (sm90_backward_module, functools.partial(sm90_backward_module, deterministic=True))
    def mods_sets(allowed, more=()):  # none, the window, softcap and ALiBi with it, all it takes
        if every_modifier_set:
            return tuple(m for m in range(ALL_MODS + 1) if m & ~allowed == 0)
        return tuple(dict.fromkeys(m & allowed for m in (0, MOD_BITS["window"], VARLEN_MODS, allowed, *more)))

    def backward_mods(bucket, varlen):  # but the sets of SM90_BACKWARD_SPILLS (at 128 all it takes but the window)
        allowed = SM90_VARLEN_BACKWARD_MODS if varlen else SM90_BACKWARD_MODS
        def eligible(m):
            return sm90_eligible(TC_DTYPES[0], bucket, m, backward=True, varlen=varlen)
        return tuple(m for m in mods_sets(allowed, () if eligible(allowed) else (allowed & ~MOD_BITS["window"],))
                     if eligible(m))

    return ([sm90_forward_module(dtype, bucket, mods, varlen, sm90_forward_tile(bucket, mods, varlen=varlen))
             for varlen in (False, True) for dtype in dtypes for bucket in SM90_FORWARD_TILES
             for mods in mods_sets((SM90_VARLEN_FORWARD_MODS if varlen else SM90_FORWARD_MODS)[bucket])]
            + [build(dtype, bucket, mods, varlen) for build in backwards
               for varlen in (False, True)
               for dtype in dtypes for bucket in SM90_BACKWARD_TILES
               for mods in backward_mods(bucket, varlen)]
            + [sm90_forward_module(dtype, bucket, 0, False, tile) for dtype in dtypes
               for bucket, tile in SM90_WIDE_FORWARD_TILES.items()]
            + [sm90_forward_module(dtype, bucket, mods, False, tile) for dtype in dtypes
               for bucket, tile in SM90_TALL_FORWARD_TILES.items() for mods in (0, MOD_BITS["window"])]
            + [sm90_backward_module(dtype, bucket, 0, varlen, deterministic, tile) for dtype in dtypes
               for bucket, tile in SM90_TALL_BACKWARD_TILES.items() for varlen in (False, True)
               for deterministic in (False, True)])
