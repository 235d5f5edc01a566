"""The CUDA side of the cupy backend, described without CuPy: sources, tile tables, specializations.

Every SIMT kernel is a template over (T, Acc, HEAD_DIM, BLOCK_M, BLOCK_N, MIN_CTAS), instantiated
through NVRTC name expressions such as ``flash_fwd<__half, float, 64, 64, 32, 3>`` (the tensor-core
kernels, further down, have no Acc: ``flash_fwd_tc<__half, 64, 64, 64, 0>``; MIN_CTAS and the wide
forward's MAX_REGISTERS are the occupancy policy of launch.py's LAUNCH, Bounds). HEAD_DIM is the true
head_dim rounded up to a bucket; the tiles of each bucket come from the tables below, which are
sized so that the shared memory of one CTA stays within 48 KiB (the kernels static_assert it):

    forward  (BLOCK_M + 2 BLOCK_N) HEAD_DIM sizeof(Acc)     Q_i; K_j, V_j
    dK/dV    2 (BLOCK_N + BLOCK_M) HEAD_DIM sizeof(Acc)     K_j, V_j; Q_i, dO_i
    dQ       2 (BLOCK_M + BLOCK_N) HEAD_DIM sizeof(Acc)     Q_i, dO_i; K_j, V_j

BLOCK_M counts query rows and BLOCK_N keys in every kernel. The operand a lane owns one row of
(K_j in the forward and dQ kernels, Q_i in the dK/dV kernel) must be at most 32 rows, a power of
two; the operand split between the 4 warps must be a multiple of 4 rows.

A further template parameter, MODS, specialises the attention kernels for score modifiers
(mask.cuh): the sum of the MOD_* bits below. It is left out of the name expression when 0, so a
call without modifiers instantiates exactly the kernels it did before they existed:
``flash_fwd<float, float, 64, 64, 32, 3, 5>`` is the window-and-ALiBi forward.

This module is imported by the backend, by flashcupy/tools/nvrtc.py (the NVRTC resource report) and
by the tests; it needs nothing but the standard library and NumPy. The sources and compile options
are in sources.py.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ..._problem import accumulation_dtype

NUM_THREADS = 128  # NUM_WARPS * WARP_SIZE in flash_common.cuh
SMEM_DEFAULT_LIMIT = 48 * 1024  # dynamic shared memory a launch gets without opting in
HEAD_DIM_BUCKETS = (32, 64, 128, 256)
MAX_HEAD_DIM = HEAD_DIM_BUCKETS[-1]

# (storage type, accumulation type) in CUDA, per value dtype name (bfloat16 arrives as uint16 bits)
CUDA_TYPES = {
    "float16": ("__half", "float"),
    "bfloat16": ("__nv_bfloat16", "float"),
    "float32": ("float", "float"),
    "float64": ("double", "double"),
}

# (BLOCK_M, BLOCK_N) per HEAD_DIM bucket, one table per accumulation size (4: float, 8: double).
#                     HEAD_DIM:  32        64        128       256
FORWARD_TILES = {
    4: {32: (64, 32), 64: (64, 32), 128: (32, 32), 256: (16, 16)},
    8: {32: (32, 32), 64: (32, 32), 128: (16, 16), 256: (8, 8)},
}
BACKWARD_DKDV_TILES = {
    4: {32: (32, 64), 64: (32, 64), 128: (16, 32), 256: (8, 16)},
    8: {32: (32, 32), 64: (16, 32), 128: (16, 8), 256: (4, 8)},
}
BACKWARD_DQ_TILES = {
    4: {32: (64, 32), 64: (32, 32), 128: (32, 16), 256: (16, 8)},
    8: {32: (32, 32), 64: (32, 16), 128: (16, 8), 256: (8, 4)},
}

# The SIMT tiles of kernels specialised for score modifiers (any MODS), where the plain tile spilled
# under the SIMT_MIN_CTAS register cap for some arch and NVRTC of tests/test_nvrtc.py:
# (template, acc size, bucket) -> tile. What each spilled: benchmarks/results/tile_choices.md.
MODIFIED_TILES = {("flash_fwd", 4, 64): (32, 32), ("flash_bwd_dq", 8, 64): (16, 16),
                  ("flash_bwd_dkdv", 4, 128): (16, 16)}
# With a bias or a bool mask (the address arithmetic of a rank-4 array's element, per element of a
# tile), over MODIFIED_TILES, where tests/test_nvrtc.py saw spills with every modifier on: fewer rows
# (or keys) per warp, the float64 dQ at 32 included (a bias without the window, a set the report does
# not compile, spilled there). flash_pairs.cu's kernels start from the dQ tiles (BACKWARD_DQ_TILES).
PAIR_TILES = {("flash_fwd", 4, 32): (32, 32), ("flash_fwd", 8, 64): (16, 32),
              ("flash_bwd_dq", 4, 32): (32, 32), ("flash_bwd_dq", 8, 32): (16, 32), ("flash_bwd_dq", 4, 128): (16, 16),
              ("flash_bwd_dkdv", 4, 32): (32, 32), ("flash_bwd_dkdv", 4, 64): (32, 32),
              ("flash_bwd_dkdv", 4, 256): (8, 8), ("flash_bwd_dkdv", 8, 32): (32, 16),
              ("flash_bwd_dbias", 4, 32): (16, 32), ("flash_bwd_dbias", 4, 64): (16, 32),
              ("flash_bwd_dbias", 4, 128): (16, 16)}
# A packed batch's dK/dV kernel (VARLEN: the sequence's offsets and lengths besides), over
# MODIFIED_TILES, where tests/test_nvrtc.py saw spills: fewer keys a pass
VARLEN_TILES = {("flash_bwd_dkdv", 4, 64): (32, 32), ("flash_bwd_dkdv", 4, 256): (8, 8)}
# With dropout (MOD_DROPOUT: a Philox call per pair), over all of those, where NVRTC 12.9 or 13 for sm_80
# or sm_90 saw spills (benchmarks/results/dropout_registers.md): fewer rows (forward) or keys a warp
DROPOUT_TILES = {("flash_fwd", 8, 32): (16, 32), ("flash_fwd", 8, 64): (16, 32), ("flash_bwd_dq", 4, 32): (32, 32),
                 ("flash_bwd_dkdv", 4, 64): (32, 16), ("flash_bwd_dkdv", 4, 128): (16, 8),
                 ("flash_bwd_dkdv", 8, 64): (16, 16), ("flash_bwd_dbias", 8, 32): (16, 32),
                 ("flash_bwd_dbias", 8, 64): (16, 16)}


# The register figures behind every tile table below: benchmarks/results/tile_choices.md.
# Tensor-core kernels (flash_fwd_tc.cu, flash_bwd_tc.cu): float16/bfloat16 only, head_dim a multiple
# of 8 up to 256; HEAD_DIM is head_dim rounded up to 16 (tc_head_dim; the backward's above 128 to 32), the
# tiles those of the bucket 64, 128, 192 or 256 (TC_HEAD_DIM_BUCKETS: the tables' keys); no Acc template
# parameter (they accumulate in float). The warps own 16-row mma tiles (two in the forward up to head_dim
# 64): BLOCK_M = 64 query rows in the forward and dQ (128 there), BLOCK_N = 64 keys in dK/dV. Shared
# memory is dynamic, 2 bytes an element, a tile row ROW = HEAD_DIM rounded up to 64 elements (tc_tile_row),
# the streamed operands double-buffered:
#     forward  (BLOCK_M + 4 BLOCK_N) ROW 2                 Q_i; 2 x (K_j, V_j)
#     dK/dV    (2 BLOCK_N + 4 BLOCK_M) ROW 2 + 16 BLOCK_M  K_j, V_j; 2 x (Q_i, dO_i, lse_i, D_i)
#     dQ       (2 BLOCK_M + 4 BLOCK_N) ROW 2               Q_i, dO_i; 2 x (K_j, V_j)
TC_DTYPES = ("float16", "bfloat16")
# Above 128 (head_dim 136..256) the forward keeps one row tile a warp and reads Q_i from shared memory at
# every pass (flash_fwd_tc.cu's Q_KEPT 0); the backward splits each block's output columns between two
# CTAs (tc_column_parts)
TC_HEAD_DIM_BUCKETS = (64, 128, 192, 256)
# The split-KV forward with a bias or mask: up to 192. At 256 (64 x 16, the smallest tile) some sets with
# the window besides took 250-252 registers on sm_80 (NVRTC 12.9 and 13.5), past tests/test_nvrtc.py's
# limit: those calls run on the SIMT forward
TC_SPLIT_PAIRS_BUCKETS = (64, 128, 192)
# The backward with the bool mask: up to 192. At 256 its dK/dV kernel (deterministic: no mask is added by
# atomics above 64, TC_ATOMIC_BUCKETS_PAIRS) took 250-255 registers in every set with the mask but the one
# with the window, softcap and ALiBi besides, and spilled 8 bytes (sm_90, NVRTC 12.9) with softcap, ALiBi
# and a bias: those calls' backward runs on the SIMT kernels
TC_BACKWARD_MASK_BUCKETS = (64, 128, 192)
# The forward's warps a row count takes: 8 at 256 rows (WIDE_WARPS in tc_tile.cuh), else 4
WIDE_WARPS = 8
WIDE_BLOCK_M = 32 * WIDE_WARPS
# The tensor-core tiles: (pass, variant) -> {bucket: (BLOCK_M, BLOCK_N)}. The pass is "forward", "dkdv"
# or "dq"; tc_tile chooses the variant from a call's modifiers, split-KV and dQ by atomics.
TC_TILES = {
    # The forward at head_dim 64 takes 128 query rows, two 16-row mma tiles a warp: each K_j or V_j
    # fragment feeds twice the mma (192 shared-memory bytes per mma, not 320 as with one). At head_dim
    # 128 it takes 256 rows and 32 keys a pass, in the wide kernel (flash_fwd_tc_wide: 8 warps of two
    # row tiles, k-step 0 of Q_i kept in registers, a register cap): 200 bytes per mma. The two row
    # tiles' O alone take 128 registers there; every other layout of two row tiles tried spilled
    # (benchmarks/results/tile_choices.md).
    # At head_dim 192 and 256 (one row tile a warp, Q_i from shared memory, O's 96 or 128 registers a
    # thread) 64 x 32 and 64 x 16: 64 x 32 took 255 registers at 256 under NVRTC 13.5, every modifier
    # 255 at 192 too; 64 x 64 at 192, 239-242, too near the limit for the window besides
    ("forward", "plain"): {64: (128, 64), 128: (256, 32), 192: (64, 32), 256: (64, 16)},
    # With softcap or ALiBi the forward at head_dim 128 keeps 64 x 64 tiles in the 4-warp kernel: the
    # score's extra work per element of S took the two-row-tile kernels past 255 registers, into spills.
    # So does dropout's (a Philox call per two keys: the wide kernel spilled 48 to 80 bytes under its cap,
    # benchmarks/results/dropout_registers.md).
    ("forward", "score"): {64: (128, 64), 128: (64, 64), 192: (64, 32), 256: (64, 16)},
    # With a bias or a bool mask the forward takes 64 rows and 32 keys a pass, and asks ptxas for two
    # CTAs an SM (Bounds): larger tiles, or ptxas' own register heuristic, spilled with some of the 24
    # sets of modifiers that hold a bias or mask (tests/test_nvrtc.py compiles all 24).
    ("forward", "pairs"): {64: (64, 32), 128: (64, 32), 192: (64, 16), 256: (64, 16)},
    # Split-KV forwards take half the keys a pass: the split's offsets and the float partial out took
    # the full tiles past the register limit, into spills. A decode's passes are few and memory-bound,
    # so the smaller tile costs little.
    ("forward", "split"): {64: (64, 32), 128: (64, 32), 192: (64, 16), 256: (64, 16)},
    ("forward", "split+pairs"): {64: (64, 32), 128: (64, 16), 192: (64, 16)},  # and a bias or mask: 64 x 32 passed the limit at 128
    # A packed batch's forward (VARLEN: each CTA finds its sequence, mask.cuh's Sequence) takes 64 query
    # rows, one row tile a warp: short sequences pad their last query block less, and the grid's CTAs
    # that find no work (at most one a sequence) are fewer beside those that work (14 % of those launched
    # for 256 sequences of 17-300 tokens, against 21 % with 128 rows and 28 % with 256: tests/test_varlen.py).
    # With the larger tiles, the sequence's lengths and offsets took the kernel past the register limit
    # of tests/test_nvrtc.py. 32 keys a pass at 128 (64 x 64 spilled there), and one CTA an SM asked of
    # ptxas (launch.py), whose own heuristic gave them too few registers.
    ("forward", "varlen"): {64: (64, 64), 128: (64, 32), 192: (64, 32), 256: (64, 16)},
    # Above 128 a CTA computes half the output columns (tc_column_parts), so that the accumulators are
    # those of 128 at most, and the tiles are 128's
    ("dkdv", "plain"): {64: (64, 64), 128: (32, 64), 192: (32, 64), 256: (32, 64)},
    ("dq", "plain"): {64: (64, 64), 128: (64, 32), 192: (64, 32), 256: (64, 32)},
    # With softcap or ALiBi (MOD_SCORE): dK/dV takes half the query rows a pass, and dQ at head_dim 64
    # half the keys. The modified score (and, for softcap, its tanh) of every element of S took the full
    # tiles past the register limit of tests/test_nvrtc.py; a window alone keeps the full tiles.
    ("dkdv", "score"): {64: (32, 64), 128: (16, 64), 192: (16, 64), 256: (16, 64)},
    ("dq", "score"): {64: (64, 32), 128: (64, 32), 192: (64, 32), 256: (64, 16)},  # every modifier at 256, 32 keys: 250
    # With v of a head dim of its own (MOD_HEAD_DIM_V), without softcap or ALiBi: dQ at 256 half the keys
    # (32 spilled 88 bytes under NVRTC 12.9 and 13.5 on sm_80: benchmarks/results/head_dim_v_registers.md)
    ("dq", "head_dim_v"): {64: (64, 64), 128: (64, 32), 192: (64, 32), 256: (64, 16)},
    # The dK/dV kernel that also adds dQ (five GEMMs, not deterministic) takes at most these query rows
    # a pass (16 at head_dim 128: with 32 it went past the register limit tests/test_nvrtc.py keeps)
    ("dkdv", "dq_atomic"): {64: (64, 64), 128: (16, 64), 192: (16, 64), 256: (16, 64)},
    # A packed batch's dK/dV kernel takes at most these (the deterministic one at head_dim 128 went past
    # the limit with 32 rows: its sequence's offsets and lengths besides)
    ("dkdv", "varlen"): {64: (64, 64), 128: (16, 64), 192: (16, 64), 256: (16, 64)},
}
# Turing (below TC_AMPERE_COMPUTE_CAPABILITY) takes the tensor-core kernels up to head_dim 128, each tile at
# most these rows and keys a pass. ptxas gave the sm_75 builds (two m16n8k8 an mma, the plain copies'
# registers) up to 38 more registers than sm_80's (NVRTC 13.5, the same tiles: dK/dV at head_dim 64 227 ->
# 252, the split-KV forward at 256 216 -> 254; benchmarks/results/other_archs.md), and the full tiles went
# past the limit of tests/test_nvrtc.py (the backward at head_dim 64: 248-255; its deterministic dK/dV at
# 128: spills), and so, with these, did the split-KV and packed forwards at 256 (64 x 16: 16-60 bytes of
# spills). A Turing SM lets a CTA have 64 KiB of shared memory, which the forward's tiles at 128 pass (80
# and 96 KiB), and so does the backward above 128 with any tile
TC_TURING_HEAD_DIM_BUCKETS = (64, 128)
TC_TURING_TILES = {
    "forward": {64: (128, 64), 128: (64, 32)},
    "dkdv": {64: (32, 64), 128: (16, 64)},
    "dq": {64: (64, 32), 128: (64, 32)},
}
# On Turing the dK/dV kernel that adds dQ with softcap or ALiBi at 128 took 248-254 registers (the window
# besides; NVRTC 12.9 and 13.5): those calls keep the deterministic kernels there
TC_TURING_ATOMIC_BUCKETS_SCORE = (64,)
# With a bias or mask at head_dim 128 the dK/dV kernel that adds dQ went past the limit even so: those
# calls keep the deterministic kernels.
TC_ATOMIC_BUCKETS_PAIRS = (64,)
TC_TEMPLATES = ("flash_fwd_tc", "flash_fwd_tc_wide", "flash_bwd_dkdv_tc", "flash_bwd_dq_tc")
TC_FORWARD_TEMPLATES = TC_TEMPLATES[:2]
TC_BACKWARD_TEMPLATES = TC_TEMPLATES[2:]  # the two whose grid has column parts (tc_column_parts)

# The Hopper forward (flash_fwd_sm90.cu: TMA, wgmma, warp specialisation), compiled for sm_90a and run
# on compute capability 9.0 only: float16/bfloat16, head_dim a multiple of 8 up to 256 (the backward's
# above 128 in its 256 kernel: sm90_backward_bucket), the modifiers of SM90_FORWARD_MODS (the backward's:
# SM90_BACKWARD_MODS), no split-KV. HEAD_DIM is head_dim rounded up to 64 (a 128B-swizzled TMA box is 64
# columns; tc_tile_row); BLOCK_M is two (or three) consumer warpgroups of 64 query rows, BLOCK_N a key
# block (wgmma N).
SM90_TEMPLATES = ("flash_fwd_sm90", "flash_bwd_dkdv_sm90")
SM90_ARCH = "sm_90a"
SM90_COMPUTE_CAPABILITY = 90
SM90_THREADS = 3 * 128  # a producer and two consumer warpgroups (SM90_THREADS in the kernel)
# setmaxnreg's registers a thread (producer, consumers) per number of consumer warpgroups: FA3's splits, the
# SM's 64 Ki registers each (sm90_tile.cuh's PRODUCER_REGISTERS, CONSUMER_REGISTERS)
SM90_REGISTERS = {2: (24, 240), 3: (32, 160)}
# FA3's 128 x 80 at head_dim 256 (its tile_size.h): O's 128 accumulators a thread, S's 40 and P's 20 fit
# the consumers' 240 registers; Q_i, two stages of K_j and V_j take 225 KiB, so O_s lies in Q_s (O_IN_Q).
# The same tile at 192 (head_dim 136..192: three atoms, O's 96 accumulators) fits with O_s its own, 217
# KiB. Without this kernel those calls run on the mma.sync forward (64 x 16 at 256: TC_TILES).
SM90_FORWARD_TILES = {64: (128, 128), 128: (128, 128), 192: (128, 80), 256: (128, 80)}
# With a bias or a bool mask (MOD_PAIRS: a load per score) the Hopper forward takes 64 keys a pass: at 128 a
# bias alone spilled 20 bytes at head_dim 128, all the modifiers 96-336 at every head_dim (NVRTC 12.9 and
# 13.5); softcap and ALiBi alone keep the default tiles
SM90_PAIRS_FORWARD_TILES = {64: (128, 64), 128: (128, 64), 192: (128, 64), 256: (128, 64)}
# and at head_dim 256 with softcap or ALiBi too: ALiBi alone spilled 12 bytes at 80 keys; in a packed
# batch at 128 and 192 as well (24-72 bytes at 128 and 80 keys)
SM90_SCORE_FORWARD_TILES = {256: (128, 64)}
SM90_VARLEN_SCORE_FORWARD_TILES = {128: (128, 64), 192: (128, 64)}
# A packed batch's forward at head_dim 256 takes 64 keys a pass: at 80 its kernel spilled 48-96 bytes
# (its sequence's offsets and out's row-by-row store besides; NVRTC 12.9 and 13.5); at 192 it did not
SM90_VARLEN_FORWARD_TILES = {256: (128, 64)}
# FA3's 192 query rows at head_dim 64 (its tile_size.h: 192 x 128 with causal or a window, 192 x 192 without),
# three consumer warpgroups of 64 rows and 160 registers each: at head_dim 64 a block's softmax takes about
# as long as its GEMMs (the counters' ex2 and tensor bounds: 959 and 989 TFLOP/s on an H200), so that two
# warpgroups' pingpong cannot hide one's softmax under the other's GEMMs; with three, each softmax runs
# under two others' GEMMs. 128 keys, P V_j from registers (FA3's 192 keys take P through shared memory:
# S, P and O of 192 keys would not fit in 160 registers). Taken where cupy_backend.SM90_TALL_FORWARD asks
# for it, one batch, before the wide block (sm90_forward_tile)
SM90_TALL_FORWARD_TILES = {64: (192, 128)}
# FA3's wider key blocks for calls without causal or a window (its tile_size.h: 128 x 176 at head_dim 128,
# 192 x 192 at 64, of which the 192 keys: two consumer warpgroups here), one batch: fewer passes for the
# same keys. Taken where cupy_backend.SM90_WIDE asks for it (sm90_forward_tile). At 176 x 128 Q_i, the
# ring and O_s would not fit in 227 KiB: O_s lies in Q_s (flash_fwd_sm90.cu's O_IN_Q)
SM90_WIDE_FORWARD_TILES = {64: (128, 192), 128: (128, 176)}
SM90_SMEM_OPTIN = 227 * 1024  # the most dynamic shared memory a CTA may opt in to on sm_90
# The same per compute capability (the CUDA C++ Programming Guide's table; 99 KiB on the others from sm_80
# on, 48 KiB before sm_70): what the emulator's devices report (a GPU reports its own, Runtime.smem_optin)
SMEM_OPTIN = {70: 96 * 1024, 72: 96 * 1024, 75: 64 * 1024,
              80: 163 * 1024, 87: 163 * 1024, 90: SM90_SMEM_OPTIN, 100: SM90_SMEM_OPTIN}
SMEM_OPTIN_OTHERS = 99 * 1024
SMEM_OPTIN_BEFORE_SM70 = 48 * 1024


def smem_optin(compute_capability: int) -> int:
    """SMEM_OPTIN's figure for a device of `compute_capability` (an int: 86 for sm_86)."""
    if compute_capability < 70:
        return SMEM_OPTIN_BEFORE_SM70
    return SMEM_OPTIN.get(compute_capability, SMEM_OPTIN_OTHERS)


# The oldest compute capability each dtype's tensor-core kernels run on: cp.async, mma.sync m16n8k16 and
# bfloat16's mma are sm_80's (ptxas refuses them below); float16 runs from Turing (sm_75: mma m16n8k8 and
# ldmatrix, with tensor_core.cuh's stand-ins for the rest, its AMPERE_ARCH). Older devices, and bfloat16
# below sm_80, take the SIMT kernels, which need nothing newer than sm_50 (tests/test_nvrtc.py compiles
# them for the oldest architecture each NVRTC targets)
TC_COMPUTE_CAPABILITY = {"float16": 75, "bfloat16": 80}
# From here on the full tensor-core tiles; below, Turing's (TC_TURING_TILES)
TC_AMPERE_COMPUTE_CAPABILITY = 80


def tc_turing(compute_capability: int) -> bool:
    """Whether a device of `compute_capability` takes the tensor-core kernels' Turing tiles (TC_TURING_TILES)."""
    return compute_capability < TC_AMPERE_COMPUTE_CAPABILITY


def tensor_cores_run_on(dtype, compute_capability: int) -> bool:
    """Whether a device of `compute_capability` runs the tensor-core kernels of `dtype` (TC_COMPUTE_CAPABILITY)."""
    return compute_capability >= TC_COMPUTE_CAPABILITY.get(_name(dtype), 1 << 30)
# The Hopper backward's dK/dV kernel (flash_bwd_sm90.cu): (query rows a pass, keys a CTA), two consumer
# warpgroups of 64 keys each (FA3's 64 x 128 at head_dim 128); at head_dim 136..256 (SPLIT_D) 64 keys that
# both consumers share, each taking half of the columns (FA3's 64-row pass; dK and dV of 64 keys x 256
# columns would take 256 registers a thread; FA3's 64 x 80 there, one stage of Q_i and dO_i as here).
# Head_dim 136..192 takes the 256 kernel too (sm90_backward_bucket): its atoms past head_dim are neither
# loaded nor stored, zeros in shared memory, a quarter of its wgmma work or more spent on them, against the
# mma.sync backward's S and dP computed twice (benchmarks/results/sm90_backward_head_dim_256.md: a model)
SM90_BACKWARD_TILES = {64: (64, 128), 128: (64, 128), 256: (64, 64)}
# FA3's 128 x 128 at head_dim 64 (its flash_bwd_launch_template.h): twice the query rows a pass, Sᵀ and dPᵀ
# as wgmma N = 128 for the same K_c, V_c operand reads, half the barriers a FLOP. Taken where
# cupy_backend.SM90_TALL_BACKWARD asks for it, without the window: at 128 rows the window's masked passes
# spilled Sᵀ's accumulators (NVRTC 12.9 and 13.5)
SM90_TALL_BACKWARD_TILES = {64: (128, 128)}
# floats of padding a row of the Hopper backward's dQ tiles (its workspace; DQ_ROW in flash_bwd_sm90.cu)
SM90_DQ_ROW_PAD = 8
SM90_ATOM = 64            # columns of a TMA box: 128 bytes, the 128B swizzle's span (ATOM in the kernel)
SM90_CONSUMER_ROWS = 64   # query rows of a consumer warpgroup: one wgmma M, one TMA store of out


# The MODS bits of the kernels (mask.cuh), per keyword of the interface (Problem.modifiers)
MOD_BITS = {"window": 1, "softcap": 2, "alibi_slopes": 4, "bias": 8, "mask": 16}
ALL_MODS = sum(MOD_BITS.values())
MOD_SCORE = MOD_BITS["softcap"] | MOD_BITS["alibi_slopes"] | MOD_BITS["bias"]  # they change a score's value
MOD_PAIRS = MOD_BITS["bias"] | MOD_BITS["mask"]  # they read a rank-4 array per (query, key) pair
# The Hopper forward's modifiers for one batch, per head_dim bucket: every one, but a bias above 128, which
# with ALiBi or softcap besides spilled at 64 keys (12-108 bytes, NVRTC 12.9 and 13.5; every set of
# modifiers compiled: benchmarks/results/sm90_modifiers.md)
SM90_FORWARD_MODS = {64: ALL_MODS, 128: ALL_MODS, 192: ALL_MODS & ~MOD_BITS["bias"],
                     256: ALL_MODS & ~MOD_BITS["bias"]}
# A packed batch's (attention_varlen takes the window, softcap and ALiBi): all three up to 192, the window
# alone at 256, where with softcap and ALiBi it spilled 64 bytes at 64 keys (its sequence's offsets besides)
_VARLEN_MODS = MOD_BITS["window"] | MOD_BITS["softcap"] | MOD_BITS["alibi_slopes"]
SM90_VARLEN_FORWARD_MODS = {64: _VARLEN_MODS, 128: _VARLEN_MODS, 192: _VARLEN_MODS, 256: MOD_BITS["window"]}
# The Hopper backward's (head_dim up to 256): every modifier for one batch, a packed batch's three, but
# (SM90_BACKWARD_SPILLS) the window with a bias or the mask at head_dim 128, which spilled 4-20 bytes
# (NVRTC 12.9 and 13.5; every set compiled: benchmarks/results/sm90_modifiers.md); those calls' backward
# runs on mma.sync
SM90_BACKWARD_MODS = ALL_MODS
SM90_VARLEN_BACKWARD_MODS = _VARLEN_MODS
# bucket: pairs of (every bit of one, any bit of the other)
SM90_BACKWARD_SPILLS = {128: ((MOD_BITS["window"], MOD_PAIRS),)}


# Dropout's bit of MODS (mask.cuh's MOD_DROPOUT): no score modifier (so not in MOD_BITS, ALL_MODS, nor the
# catalog's sets), set per call from Problem.dropout by cupy_backend._mods; every kernel takes it
MOD_DROPOUT = 32
# The Hopper kernels take dropout (a rolled Philox call per two keys in the forward, per pair in the
# backward: unrolled, the backward at 128 and the forward at 256 and in packed batches spilled 24-156
# bytes) with every set of modifiers they take but these, which spilled all the same (NVRTC 12.9 or
# 13.5, every set compiled: `python benchmarks/dropout_registers.py --every-hopper-set`, and
# benchmarks/results/dropout_registers.md); such calls take the mma.sync kernels.
# (backward, varlen, bucket): pairs of (every bit of one, any bit of the other), as SM90_BACKWARD_SPILLS'
SM90_DROPOUT_SPILLS = {
    (True, False, 128): ((MOD_DROPOUT, MOD_PAIRS),  # a bias or the mask: 12-528 bytes
                         (MOD_DROPOUT | MOD_BITS["window"], MOD_BITS["alibi_slopes"])),  # 16-40 bytes
    # the deterministic kernel with the three, 20 bytes under NVRTC 13.5
    (True, False, 256): ((MOD_DROPOUT | MOD_BITS["window"] | MOD_BITS["softcap"], MOD_BITS["mask"]),),
    (False, True, 64): ((MOD_DROPOUT | MOD_BITS["window"], MOD_BITS["alibi_slopes"]),),  # 64 bytes
}
# v (and dout) of a head dim of their own (mask.cuh's MOD_HEAD_DIM_V): the mma.sync backward alone is
# specialised for it (flash_bwd_tc.cu's V_HEAD_DIM), set by cupy_backend._tc_backward_mods; the other
# kernels bound v's tiles by head_dim_v in every specialisation
MOD_HEAD_DIM_V = 64


def mods_of(modifiers) -> int:
    """The MODS template argument for a set of modifier keywords (all of them in MOD_BITS)."""
    return sum(MOD_BITS[name] for name in modifiers)


def head_dim_bucket(head_dim: int) -> int:
    """The padded compile-time HEAD_DIM the kernels use for `head_dim` (1..MAX_HEAD_DIM, which the
    interface checks)."""
    return next(bucket for bucket in HEAD_DIM_BUCKETS if head_dim <= bucket)


# The bool template flags that follow MODS, in order, per template (Kernel's fields of the same names):
# a name expression spells them up to the last one set (the others default to false)
TEMPLATE_FLAGS = {"flash_fwd": ("split", "varlen"), "flash_fwd_tc": ("split", "varlen"),
                  "flash_bwd_dkdv": ("varlen",), "flash_bwd_dq": ("varlen",),
                  "flash_bwd_dkdv_tc": ("dq_atomic", "varlen"), "flash_bwd_dq_tc": ("varlen",),
                  "flash_fwd_sm90": ("varlen",), "flash_bwd_dkdv_sm90": ("varlen", "deterministic")}


# The templates without an Acc parameter besides the tensor-core ones: they move or round elements
STORAGE_ONLY_TEMPLATES = ("flash_bwd_dq_convert", "flash_bwd_dq_convert_sm90", "flash_bwd_dq_convert_sm90_varlen",
                          "flash_kv_append")


@dataclass(frozen=True)
class Kernel:
    """One specialization: the template it instantiates and the tile it runs with."""

    template: str            # flash_fwd, flash_bwd_preprocess, flash_bwd_dkdv, flash_bwd_dq, flash_probs,
                             # flash_bwd_dbias, or one of TC_TEMPLATES
    dtype: str               # a key of CUDA_TYPES
    head_dim: int            # HEAD_DIM: the bucket (SIMT), tc_head_dim (tensor cores); 0 for kernels without one
    block_m: int = 0
    block_n: int = 0
    mods: int = 0            # the score modifiers it is specialised for (MOD_BITS); 0 for none
    split: bool = False      # a forward kernel for split-KV (partial outs in Acc, mask.cuh's Split)
    dq_atomic: bool = False  # the tensor-core dK/dV kernel that adds dQ into an fp32 workspace too
    varlen: bool = False     # a forward, dK/dV or dQ kernel for a packed batch (the offsets read on the device,
                             # mask.cuh's Sequence)
    deterministic: bool = False  # the Hopper dK/dV kernel that adds each dQ tile's parts in key-block order

    @property
    def modifiers(self) -> str:
        """The modifiers' keywords joined by '+', or '' for none."""
        return "+".join(name for name, bit in {**MOD_BITS, "dropout": MOD_DROPOUT, "head_dim_v": MOD_HEAD_DIM_V}.items()
                        if self.mods & bit)

    @property
    def tensor_cores(self) -> bool:
        """An mma.sync kernel (flash_*_tc.cu)."""
        return self.template in TC_TEMPLATES

    @property
    def wgmma(self) -> bool:
        """A Hopper kernel (flash_*_sm90.cu, sm_90a)."""
        return self.template in SM90_TEMPLATES

    @functools.cached_property  # the fields are frozen
    def threads(self) -> int:
        """Threads a CTA (the launch's block size): the template's LAUNCH policy."""
        from .launch import LAUNCH
        threads = LAUNCH[self.template].threads
        return threads(self) if callable(threads) else threads

    @property
    def column_parts(self) -> int:
        """The CTAs that share each block's output columns (the grid's second dimension): the tensor-core
        backward's tc_column_parts, 1 for every other kernel."""
        return tc_column_parts(self.head_dim) if self.template in TC_BACKWARD_TEMPLATES else 1

    @functools.cached_property  # the fields are frozen
    def dynamic_smem(self) -> int:
        """Bytes of dynamic shared memory a launch asks for (the SIMT kernels use static tiles): the
        template's LAUNCH policy."""
        from .launch import LAUNCH
        smem = LAUNCH[self.template].dynamic_smem
        return 0 if smem is None else smem(self.block_m, self.block_n, tc_tile_row(self.head_dim), self.dq_atomic)

    def grid(self, p, rows: int | None = None) -> tuple:
        """(what it counts, thread blocks) of this kernel's 1-D grid for Problem p (GRIDS): what the
        launches use, and what the interface checks against CUDA's limit (grid_axes) before any work.
        `rows`: the query rows attention_probs asks for (flash_probs; default every row)."""
        from .launch import GRIDS
        counts = GRIDS[self.template].counts.format(block_m=self.block_m, block_n=self.block_n)
        return counts, self.blocks(p, rows)

    def blocks(self, p, rows: int | None = None) -> int:
        """The thread blocks of its grid for Problem p (grid's second half)."""
        from .launch import GRIDS
        return GRIDS[self.template].blocks(self, p, rows)

    @functools.cached_property  # the fields are frozen
    def loop(self) -> str | None:
        """The side of the problem each CTA's main loop walks: "keys", "queries", or None (GRIDS)."""
        from .launch import GRIDS
        return GRIDS[self.template].loop

    @functools.cached_property  # the fields are frozen
    def bounds(self):
        """Its occupancy policy (the template's LAUNCH bounds), template arguments after the tile; None
        for a kernel without a tile, whose __launch_bounds__ names its threads only."""
        from .launch import LAUNCH
        rule = LAUNCH[self.template].bounds
        return None if rule is None else rule(self)

    @functools.cached_property  # the fields are frozen
    def name_expression(self) -> str:
        storage, acc = CUDA_TYPES[self.dtype]
        # tensor cores accumulate in float
        args = ([storage] if self.tensor_cores or self.wgmma or self.template in STORAGE_ONLY_TEMPLATES
                else [storage, acc])
        if self.head_dim:
            args += [str(self.head_dim), str(self.block_m), str(self.block_n)]
        if self.bounds is not None:
            args += self.bounds.template_args
        # the template's flags after MODS (TEMPLATE_FLAGS), up to the last one set, which MODS precedes
        flags = [getattr(self, flag) for flag in TEMPLATE_FLAGS.get(self.template, ())]
        flags = flags[:max((i + 1 for i, on in enumerate(flags) if on), default=0)]
        if self.mods or flags:
            args.append(str(self.mods))
        args += ["true" if on else "false" for on in flags]
        return f"{self.template}<{', '.join(args)}>"


@dataclass(frozen=True)
class ModuleSpec:
    """One compilation unit: a source file, the kernels instantiated from it, and the architecture it
    is compiled for: None for the device's own (cupy.RawModule's -arch), or an arch such as "sm_90a"
    that the module needs (the backend compiles it with NVRTC itself: sources.arch_options)."""

    source_file: str
    kernels: tuple
    arch: str | None = None

    @property
    def name_expressions(self) -> tuple:
        return tuple(k.name_expression for k in self.kernels)


def _name(dtype) -> str:
    return dtype if isinstance(dtype, str) else np.dtype(dtype).name


@functools.lru_cache(maxsize=None)  # a pure function of its arguments: made once
def forward_module(dtype, head_dim: int, mods: int = 0, split: bool = False, varlen: bool = False) -> ModuleSpec:
    bucket = head_dim_bucket(head_dim)
    dtype = _name(dtype)
    bm, bn = _tile("flash_fwd", FORWARD_TILES[_acc_size(dtype)][bucket], _acc_size(dtype), bucket, mods, varlen)
    return ModuleSpec("flash_fwd.cu", (Kernel("flash_fwd", dtype, bucket, bm, bn, mods, split, varlen=varlen),))


@functools.lru_cache(maxsize=None)  # a pure function of its arguments: made once
def backward_module(dtype, head_dim: int, mods: int = 0, varlen: bool = False) -> ModuleSpec:
    """Kernels in launch order: preprocess (D, the same for every MODS, and for a packed batch the
    same as for one sequence of its total length), dK/dV, dQ; varlen: those two for a packed batch."""
    bucket = head_dim_bucket(head_dim)
    dtype = _name(dtype)
    size = _acc_size(dtype)
    return ModuleSpec("flash_bwd.cu", (
        Kernel("flash_bwd_preprocess", dtype, 0),
        Kernel("flash_bwd_dkdv", dtype, bucket,
               *_tile("flash_bwd_dkdv", BACKWARD_DKDV_TILES[size][bucket], size, bucket, mods, varlen), mods,
               varlen=varlen),
        Kernel("flash_bwd_dq", dtype, bucket,
               *_tile("flash_bwd_dq", BACKWARD_DQ_TILES[size][bucket], size, bucket, mods, varlen), mods,
               varlen=varlen),
    ))


@functools.lru_cache(maxsize=None)  # a pure function of its arguments: made once
def append_module(dtype) -> ModuleSpec:
    """attention_with_kvcache's append of the new k, v into the cache (flash_append.cu), for the cache's
    dtype."""
    return ModuleSpec("flash_append.cu", (Kernel("flash_kv_append", _name(dtype), 0),))


@functools.lru_cache(maxsize=None)  # a pure function of its arguments: made once
def merge_module(dtype) -> ModuleSpec:
    """split-KV's merge of the partial outs and lses (flash_merge.cu), for the values' dtype."""
    return ModuleSpec("flash_merge.cu", (Kernel("flash_split_merge", _name(dtype), 0),))


@functools.lru_cache(maxsize=None)  # a pure function of its arguments: made once
def probs_module(dtype, head_dim: int, mods: int = 0) -> ModuleSpec:
    """attention_probs (flash_pairs.cu): the dQ kernel's tile, two of its four operands."""
    return _pairs_module("flash_probs", dtype, head_dim, mods)


@functools.lru_cache(maxsize=None)  # a pure function of its arguments: made once
def dbias_module(dtype, head_dim: int, mods: int) -> ModuleSpec:
    """The bias's gradient (flash_pairs.cu), launched after either backward path: the dQ kernel's
    tile and operands."""
    return _pairs_module("flash_bwd_dbias", dtype, head_dim, mods)


def _pairs_module(template: str, dtype, head_dim: int, mods: int) -> ModuleSpec:
    bucket = head_dim_bucket(head_dim)
    dtype = _name(dtype)
    size = _acc_size(dtype)
    tile = _tile(template, BACKWARD_DQ_TILES[size][bucket], size, bucket, mods)
    return ModuleSpec("flash_pairs.cu", (Kernel(template, dtype, bucket, *tile, mods),))


def _tile(template: str, tile: tuple, acc_size: int, bucket: int, mods: int, varlen: bool = False) -> tuple:
    """The SIMT kernel's tile: DROPOUT_TILES' for a kernel with dropout, else PAIR_TILES' for one with a
    bias or mask, else VARLEN_TILES' for one for a packed batch, else MODIFIED_TILES' for one with
    modifiers or for a packed batch (the float forward at 64, whose plain tile spilled with the
    sequence's lengths and offsets too), where they list one."""
    key = (template, acc_size, bucket)
    if mods & MOD_DROPOUT and key in DROPOUT_TILES:
        return DROPOUT_TILES[key]
    if mods & MOD_PAIRS and key in PAIR_TILES:
        return PAIR_TILES[key]
    if varlen and key in VARLEN_TILES:
        return VARLEN_TILES[key]
    return MODIFIED_TILES.get(key, tile) if mods or varlen else tile


def _tc_bucket(head_dim: int) -> int:
    """The tile tables' key: the first of TC_HEAD_DIM_BUCKETS that holds head_dim."""
    return next(b for b in TC_HEAD_DIM_BUCKETS if head_dim <= b)


def tc_column_parts(head_dim: int) -> int:
    """The CTAs that share a block's output columns in the tensor-core backward (the dK/dV and dQ
    kernels' second grid dimension; TC_COLUMN_PARTS in tc_tile.cuh says the same of HEAD_DIM): two above
    head_dim 128, each computing the whole of S and dP and half the columns of dK, dV (dQ)."""
    return 2 if head_dim > 128 else 1


def tc_head_dim(head_dim: int, parts: int = 1) -> int:
    """The HEAD_DIM a tensor-core kernel computes for `head_dim`: rounded up to a multiple of 16, the
    columns of an mma k-step (the columns past head_dim are loaded as zeros), times `parts` (the
    backward's tc_column_parts: a part's columns whole k-steps too). Not to the tile tables' 64 or 128:
    D=96 would spend a quarter of its mma on zeros."""
    return -(-head_dim // (16 * parts)) * 16 * parts


def tc_tile_row(head_dim: int) -> int:
    """Elements a shared-memory tile row takes (TILE_ROW in tc_tile.cuh): HEAD_DIM rounded up to 64."""
    return -(-head_dim // 64) * 64


def tc_tile(pass_: str, head_dim: int, mods: int = 0, split: bool = False, dq_atomic: bool = False,
            varlen: bool = False, turing: bool = False) -> tuple:
    """(BLOCK_M, BLOCK_N) of a tensor-core kernel, from TC_TILES: the forward's variant is a packed
    batch's, else split-KV's (with or without a bias or mask), else the bias or mask's, else softcap,
    ALiBi or dropout's (MOD_SCORE, MOD_DROPOUT), else the plain one; the backward's MOD_SCORE's, else dQ's
    head_dim_v one (MOD_HEAD_DIM_V), else the plain one, and with
    dQ by atomics dK/dV takes the fewer query rows of that tile and the dq_atomic one.

    A packed batch's forward takes its own (TC_TILES' varlen rows), whatever its modifiers
    (attention_varlen takes no bias or mask); its dK/dV the fewer query rows of the above and its own.
    turing: for a device below sm_80, at most TC_TURING_TILES' rows and keys."""
    bucket = _tc_bucket(head_dim)
    pairs, score = mods & MOD_PAIRS, mods & MOD_SCORE
    if pass_ == "forward":
        score |= mods & MOD_DROPOUT  # the score variant's tiles: see TC_TILES
        variant = ("varlen" if varlen else ("split+pairs" if pairs else "split") if split else "pairs" if pairs
                   else "score" if score else "plain")
    else:
        variant = "score" if score else "head_dim_v" if pass_ == "dq" and mods & MOD_HEAD_DIM_V else "plain"
    tile = TC_TILES[pass_, variant][bucket]
    if varlen and pass_ == "dkdv":
        tile = min(tile, TC_TILES["dkdv", "varlen"][bucket])
    if dq_atomic:
        tile = min(tile, TC_TILES["dkdv", "dq_atomic"][bucket])
    return tuple(map(min, tile, TC_TURING_TILES[pass_][bucket])) if turing else tile


@functools.lru_cache(maxsize=None)  # a pure function of its arguments: made once
def tc_forward_module(dtype, head_dim: int, mods: int = 0, split: bool = False, varlen: bool = False,
                      turing: bool = False) -> ModuleSpec:
    """The tensor-core forward for float16/bfloat16 and head_dim <= 256 (a multiple of 8); varlen: for
    a packed batch; turing: for a device below sm_80 (tc_tile says its tile)."""
    bm, bn = tc_tile("forward", head_dim, mods, split, varlen=varlen, turing=turing)
    template = "flash_fwd_tc_wide" if bm == WIDE_BLOCK_M else "flash_fwd_tc"
    return ModuleSpec("flash_fwd_tc.cu", (Kernel(template, _name(dtype), tc_head_dim(head_dim), bm, bn, mods, split,
                                                 varlen=varlen),))


# Split-KV: keys per split are a multiple of this, so that every forward tile (BLOCK_N of 8 to 64)
# ends inside its split
SPLIT_ALIGN = 128


@functools.lru_cache(maxsize=None)  # a pure function of its arguments: made once
def tc_backward_module(dtype, head_dim: int, mods: int = 0, deterministic: bool = False,
                       varlen: bool = False, turing: bool = False) -> ModuleSpec:
    """The tensor-core backward, kernels in launch order: preprocess (D, the SIMT one), then dK/dV and
    dQ (deterministic: each output element written once, S and dP computed twice, seven GEMMs), or
    dK/dV adding dQ into an fp32 workspace with atomics and the kernel that scales and rounds it (five
    GEMMs, the default); varlen: dK/dV and dQ for a packed batch (the preprocess and the conversion
    run on it as on one sequence of its total length); turing: for a device below sm_80 (tc_tile)."""
    bucket = _tc_bucket(head_dim)
    dtype = _name(dtype)
    deterministic = (deterministic or (mods & MOD_PAIRS != 0 and bucket not in TC_ATOMIC_BUCKETS_PAIRS)
                     or (turing and mods & MOD_SCORE != 0 and bucket not in TC_TURING_ATOMIC_BUCKETS_SCORE))
    tiles = tc_tile("dkdv", head_dim, mods, dq_atomic=not deterministic, varlen=varlen, turing=turing)
    hd = tc_head_dim(head_dim, tc_column_parts(head_dim))
    dkdv = Kernel("flash_bwd_dkdv_tc", dtype, hd, *tiles, mods, dq_atomic=not deterministic, varlen=varlen)
    if not deterministic:
        return ModuleSpec("flash_bwd_tc.cu", (Kernel("flash_bwd_preprocess", dtype, 0), dkdv,
                                             Kernel("flash_bwd_dq_convert", dtype, 0)))
    return ModuleSpec("flash_bwd_tc.cu", (
        Kernel("flash_bwd_preprocess", dtype, 0), dkdv,
        Kernel("flash_bwd_dq_tc", dtype, hd, *tc_tile("dq", head_dim, mods, turing=turing), mods, varlen=varlen),
    ))


def sm90_forward_tile(head_dim: int, mods: int = 0, causal: bool = False, varlen: bool = False,
                      wide: bool = False, tall: bool = False) -> tuple:
    """(BLOCK_M, BLOCK_N) of the Hopper forward, the first that applies:
    - SM90_PAIRS_FORWARD_TILES' where the call has a bias or a bool mask;
    - SM90_SCORE_FORWARD_TILES' (a packed batch's: SM90_VARLEN_SCORE_FORWARD_TILES' too) where it has
      softcap or ALiBi and the head_dim's bucket has one;
    - a packed batch's SM90_VARLEN_FORWARD_TILES' where its bucket has one;
    - SM90_TALL_FORWARD_TILES' where `tall` asks for it, the call has no modifier but the window (in 160
      registers), is one batch (a packed batch's kernel spilled 48-348 bytes in 160 registers: its
      sequence's offsets and out's row-by-row store besides) and the bucket has one (causal and the
      window too, as FA3's);
    - SM90_WIDE_FORWARD_TILES' where `wide` asks for it, the call has neither causal nor a window (a band
      would mask more of a wider block), is one batch (a packed batch's kernel spilled at 176 keys: its
      sequence's offsets besides) and the bucket has one;
    - else SM90_FORWARD_TILES'."""
    bucket = tc_tile_row(head_dim)
    if mods & MOD_PAIRS:
        return SM90_PAIRS_FORWARD_TILES[bucket]
    if mods & MOD_SCORE and bucket in SM90_SCORE_FORWARD_TILES:
        return SM90_SCORE_FORWARD_TILES[bucket]
    if varlen and mods & MOD_SCORE and bucket in SM90_VARLEN_SCORE_FORWARD_TILES:
        return SM90_VARLEN_SCORE_FORWARD_TILES[bucket]
    if varlen and bucket in SM90_VARLEN_FORWARD_TILES:
        return SM90_VARLEN_FORWARD_TILES[bucket]
    if tall and not varlen and not mods & ~MOD_BITS["window"] and bucket in SM90_TALL_FORWARD_TILES:
        return SM90_TALL_FORWARD_TILES[bucket]
    if wide and not causal and not mods and not varlen and bucket in SM90_WIDE_FORWARD_TILES:
        return SM90_WIDE_FORWARD_TILES[bucket]
    return SM90_FORWARD_TILES[bucket]


@functools.lru_cache(maxsize=None)  # a pure function of its arguments: made once
def sm90_forward_module(dtype, head_dim: int, mods: int = 0, varlen: bool = False,
                        tile: tuple | None = None) -> ModuleSpec:
    """The Hopper forward (sm_90a) for float16/bfloat16, head_dim <= 256 (a multiple of 8), the
    modifiers sm90_eligible allows; varlen: for a packed batch (a CTA a query block, out stored
    row by row); tile: its (BLOCK_M, BLOCK_N) (sm90_forward_tile), SM90_FORWARD_TILES' by default."""
    bucket = tc_tile_row(head_dim)
    bm, bn = tile or SM90_FORWARD_TILES[bucket]
    return ModuleSpec("flash_fwd_sm90.cu", (Kernel("flash_fwd_sm90", _name(dtype), bucket, bm, bn, mods, varlen=varlen),),
                      SM90_ARCH)


def sm90_backward_bucket(head_dim: int) -> int:
    """The HEAD_DIM the Hopper backward computes for head_dim: the first of SM90_BACKWARD_TILES' keys that
    holds it (136..192: 256, where tc_tile_row says 192: flash_bwd_sm90.cu loads whole atoms of head_dim
    only, and zeros the rest once)."""
    return next(b for b in SM90_BACKWARD_TILES if head_dim <= b)


@functools.lru_cache(maxsize=None)  # a pure function of its arguments: made once
def sm90_backward_module(dtype, head_dim: int, mods: int = 0, varlen: bool = False,
                         deterministic: bool = False, tile: tuple | None = None) -> ModuleSpec:
    """The Hopper backward (sm_90a), kernels in launch order: preprocess (D), the dK/dV kernel that adds
    dQ into an fp32 workspace of tiles by bulk reduce-adds, and the kernel that scales and rounds it;
    varlen: the dK/dV kernel and the conversion for a packed batch (the preprocess is the same for one
    sequence of its total length); deterministic: the dK/dV kernel whose CTAs add into each tile in
    key-block order (flash_bwd_sm90.cu's DETERMINISTIC), so that dq is the same bits on every run; tile:
    the dK/dV kernel's (BLOCK_M, BLOCK_N) (sm90_backward_tile), SM90_BACKWARD_TILES' by default."""
    bucket = sm90_backward_bucket(head_dim)
    dtype = _name(dtype)
    bm, bn = tile or SM90_BACKWARD_TILES[bucket]
    convert = "flash_bwd_dq_convert_sm90_varlen" if varlen else "flash_bwd_dq_convert_sm90"
    return ModuleSpec("flash_bwd_sm90.cu", (Kernel("flash_bwd_preprocess", dtype, 0),
                                            Kernel("flash_bwd_dkdv_sm90", dtype, bucket, bm, bn, mods, varlen=varlen,
                                                   deterministic=deterministic),
                                            Kernel(convert, dtype, bucket, bm, bn, varlen=varlen)), SM90_ARCH)


def sm90_backward_tile(head_dim: int, mods: int = 0, tall: bool = False) -> tuple:
    """(BLOCK_M, BLOCK_N) of the Hopper backward's dK/dV kernel: SM90_TALL_BACKWARD_TILES' where `tall`
    asks for it, the call has no modifier (the window's masked passes spilled at 128 rows; the others
    were not tried) and the head_dim's bucket has one; else SM90_BACKWARD_TILES'."""
    bucket = sm90_backward_bucket(head_dim)
    if tall and not mods and bucket in SM90_TALL_BACKWARD_TILES:
        return SM90_TALL_BACKWARD_TILES[bucket]
    return SM90_BACKWARD_TILES[bucket]


def sm90_eligible(dtype, head_dim: int, mods: int, backward: bool = False, varlen: bool = False) -> bool:
    """Whether the Hopper forward (backward: the Hopper backward) covers this dtype, head_dim and set of
    modifiers (varlen: a packed batch's): the head_dim buckets of SM90_FORWARD_TILES with the modifiers of
    SM90_FORWARD_MODS (SM90_VARLEN_FORWARD_MODS), or the buckets of SM90_BACKWARD_TILES with those of
    SM90_BACKWARD_MODS (SM90_VARLEN_BACKWARD_MODS) but the sets of SM90_BACKWARD_SPILLS; dropout with any
    of them but SM90_DROPOUT_SPILLS'. The device's compute capability and the arrays' strides are checked
    apart."""
    buckets = SM90_BACKWARD_TILES if backward else SM90_FORWARD_TILES
    if not (_name(dtype) in TC_DTYPES and head_dim % 8 == 0 and 0 < head_dim <= max(buckets)):
        return False
    bucket = sm90_backward_bucket(head_dim) if backward else tc_tile_row(head_dim)
    spills = list(SM90_DROPOUT_SPILLS.get((backward, varlen, bucket), ()))
    if backward:
        allowed = SM90_VARLEN_BACKWARD_MODS if varlen else SM90_BACKWARD_MODS
        spills += SM90_BACKWARD_SPILLS.get(bucket, ())
    else:
        allowed = (SM90_VARLEN_FORWARD_MODS if varlen else SM90_FORWARD_MODS)[bucket]
    if any(mods & every == every and mods & some for every, some in spills):
        return False
    return mods & ~allowed & ~MOD_DROPOUT == 0  # dropout with any set of modifiers it takes


def tensor_core_eligible(dtype, head_dim: int, mods: int = 0, split: bool = False, backward: bool = False,
                         turing: bool = False) -> bool:
    """Whether the tensor-core forward (backward: the backward) covers this dtype and head_dim: up to
    TC_HEAD_DIM_BUCKETS' last, a split-KV forward (split) with a bias or mask in mods in
    TC_SPLIT_PAIRS_BUCKETS only, a backward with the bool mask in TC_BACKWARD_MASK_BUCKETS only. Strides,
    and the device's shared memory (the backward above head_dim 192 asks for more than an sm_86, sm_89 or
    sm_120 has: cupy_backend.backward_path), are checked apart. turing: on a device below sm_80, up to
    TC_TURING_HEAD_DIM_BUCKETS' last."""
    buckets = TC_HEAD_DIM_BUCKETS
    if split and mods & MOD_PAIRS:
        buckets = TC_SPLIT_PAIRS_BUCKETS
    if backward and mods & MOD_BITS["mask"]:
        buckets = TC_BACKWARD_MASK_BUCKETS
    top = min(buckets[-1], TC_TURING_HEAD_DIM_BUCKETS[-1]) if turing else buckets[-1]
    return _name(dtype) in TC_DTYPES and head_dim % 8 == 0 and head_dim <= top


@functools.lru_cache(maxsize=None)  # a pure function of its arguments: made once
def deterministic_tc_backward_module(dtype, head_dim: int, mods: int = 0, varlen: bool = False,
                                     turing: bool = False) -> ModuleSpec:
    return tc_backward_module(dtype, head_dim, mods, deterministic=True, varlen=varlen, turing=turing)


def _acc_size(dtype: str) -> int:
    return accumulation_dtype(dtype).itemsize
