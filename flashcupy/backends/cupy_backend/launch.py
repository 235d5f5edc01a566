"""How the cupy backend launches each kernel template, beside specs.py's tiles and specializations:
its threads, dynamic shared memory and occupancy bounds (LAUNCH: the policy per kernel family, passed
as template arguments), and its 1-D grid (GRIDS: what its thread blocks count and how many for a
Problem; mask.cuh decodes it). specs.Kernel asks these tables for its own.

Needs nothing but specs.py's constants.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .specs import (Kernel, MOD_BITS, MOD_PAIRS, NUM_THREADS, SM90_CONSUMER_ROWS, SM90_DQ_ROW_PAD,
                    SM90_SMEM_OPTIN, SM90_THREADS, WIDE_WARPS)


@dataclass(frozen=True)
class Launch:
    """What a template's launches take besides its grid: `threads` a CTA; `dynamic_smem(block_m,
    block_n, row, dq_atomic)`, the bytes of dynamic shared memory (row: a tile row's elements,
    tc_tile_row), or None for a kernel with static shared memory only (the layouts behind the formulas:
    the module docstring's tables, and the kernels' headers); and `bounds(kernel)`, its occupancy
    policy (Bounds), or None for a template without those parameters."""

    threads: int | Callable = NUM_THREADS  # or threads(kernel), for a template whose CTA follows its tile
    dynamic_smem: Callable | None = None
    bounds: Callable | None = None


@dataclass(frozen=True)
class Bounds:
    """A tiled kernel's occupancy policy, its template arguments after BLOCK_N: `min_ctas` (MIN_CTAS),
    the CTAs an SM that ptxas must leave registers for (__launch_bounds__(threads, MIN_CTAS); 0 leaves
    the count to ptxas' own heuristic), and `max_registers` (MAX_REGISTERS), a register cap a thread
    (__maxnreg__), for the template that takes one; before CUDA 12.4, which brought __maxnreg__, that
    kernel asks for min_ctas instead (CAPPED_BOUNDS, tc_tile.cuh). None: the template takes no cap."""

    min_ctas: int
    max_registers: int | None = None

    @property
    def template_args(self) -> list:
        return [str(self.min_ctas)] + ([] if self.max_registers is None else [str(self.max_registers)])


# The occupancy policy of each tiled template (LAUNCH's bounds). Where a figure behind a choice is a
# register count, it is in benchmarks/results/tile_choices.md (`python -m flashcupy kernels` prints
# today's).
#
# SIMT: tiles of up to 48 KiB leave room for 3 CTAs on an A100 SM (4 on an H100). Asking ptxas for 3
# caps registers at 168 a thread, so registers do not cut occupancy below what shared memory allows;
# the SIMT tile tables are chosen so that no kernel spills under that cap (tests/test_nvrtc.py).
SIMT_MIN_CTAS = 3


def _simt_bounds(kernel: Kernel) -> Bounds:
    return Bounds(SIMT_MIN_CTAS)


# Tensor cores: every loop over a tile is unrolled and ptxas hoists the ldmatrix of whole k-loops ahead
# of their mmas, so a kernel takes what its bounds allow. Their minimum: 0 (ptxas' own choice, which
# the tile tables were sized against) at HEAD_DIM 64 and 128; 1 at the others, where ptxas' heuristic
# allowed some kernels fewer registers than they hold, and they spilled (the forward at 192 with softcap
# and ALiBi got 168). Asking 1 at 64 and 128 too took the forward with every modifier past the register
# limit tests/test_nvrtc.py keeps.
def _tc_min_ctas(head_dim: int) -> int:
    return 0 if head_dim in (64, 128) else 1


def _tc_forward_bounds(kernel: Kernel) -> Bounds:
    """flash_fwd_tc: split-KV and a packed batch ask for one CTA an SM (left to its heuristic, ptxas
    allowed those too few registers and they spilled); with a bias or a bool mask, two (up to 255
    registers: ptxas' own choice spilled in some of the 24 sets of modifiers that hold one)."""
    if kernel.split or kernel.varlen:
        return Bounds(1)
    return Bounds(2 if kernel.mods & MOD_PAIRS else _tc_min_ctas(kernel.head_dim))


# The wide forward (flash_fwd_tc_wide: WIDE_WARPS warps of two row tiles) under a register cap: left to
# ptxas under __launch_bounds__ it took every register and spilled; each cap is one at which none of
# the NVRTCs and archs that tests/test_nvrtc.py compiles for spills (it checks; the scan of caps:
# benchmarks/results/tile_choices.md). NVRTCs before 12.4 get one CTA an SM, and may spill.
WIDE_MAX_REGISTERS = 247
WIDE_MAX_REGISTERS_WINDOW = 240


def _tc_wide_bounds(kernel: Kernel) -> Bounds:
    window = kernel.mods & MOD_BITS["window"]
    return Bounds(1, WIDE_MAX_REGISTERS_WINDOW if window else WIDE_MAX_REGISTERS)


# The backward takes every register its bounds allow: at HEAD_DIM 64 and 128, ptxas' own choice, 2
# CTAs (8 warps) an SM by registers. Asking for 3 CTAs (168 registers a thread) makes ptxas spill, and
# so did its own heuristic, which chose 3 (or 4) for some sets of modifiers that the NVRTC report does
# not compile, and for Turing's smaller tiles at 64 (specs.TC_TURING_TILES: 8-32 bytes): dQ with any
# modifier, and at HEAD_DIM 64 the dK/dV tiles of 32 query rows (softcap, ALiBi or a bias; Turing's) and
# the dQ tiles of 32 keys (the same), ask for 2.
def _tc_dkdv_bounds(kernel: Kernel) -> Bounds:
    thin_at_64 = kernel.head_dim == 64 and kernel.block_m < 64
    return Bounds(2 if thin_at_64 else _tc_min_ctas(kernel.head_dim))


def _tc_dq_bounds(kernel: Kernel) -> Bounds:
    thin_at_64 = kernel.head_dim == 64 and kernel.block_n < 64
    return Bounds(2 if kernel.mods or thin_at_64 else _tc_min_ctas(kernel.head_dim))


# The tensor-core kernels' shared memory, 2 bytes an element: the forward (Q_i; 2 x (K_j, V_j)), dK/dV
# (K_j, V_j; 2 x (Q_i, dO_i); lse_i and D_i per stage; with dQ by atomics dS_s and the warps' 16 x 16
# float staging tiles), dQ (Q_i, dO_i; 2 x (K_j, V_j))
def _tc_forward_smem(m: int, n: int, d: int, atomic: bool) -> int:
    return (m + 4 * n) * d * 2


# The Hopper forward: Q_i; STAGES (2) x (K_j, V_j), HEAD_DIM columns each; O (its staging for the TMA
# store), unless that would pass the opt-in limit (the kernel's O_IN_Q: O in Q_i's place); 1024 bytes to
# align the tiles up to the 128B swizzle's repeat (the kernel does)
def _sm90_forward_smem(m: int, n: int, d: int, atomic: bool) -> int:
    smem = _tc_forward_smem(m, n, d, atomic) + m * d * 2 + 1024
    return smem if smem <= SM90_SMEM_OPTIN else smem - m * d * 2


# The Hopper backward's dK/dV kernel (flash_bwd_sm90.cu's shared-memory table): K_j, V_j; STAGES x (Q_i, dO_i);
# two buffers of each consumer's dSᵀ (64 keys x m), or above head_dim 128 (SPLIT_D) dSᵀ and Pᵀ once; dQ_i in
# fp32, rows padded; STAGES x (lse_i, D_i); 1024 bytes to align. SPLIT_D takes one stage (two: 245 KiB)
def _sm90_backward_smem(m: int, n: int, d: int) -> int:
    split = d > 128
    stages = 1 if split else 2
    ds_tiles = 2 if split else 2 * 2
    return (2 * n + 2 * stages * m) * d * 2 + ds_tiles * 64 * m * 2 + m * (d + SM90_DQ_ROW_PAD) * 4 \
        + stages * 2 * m * 4 + 1024


LAUNCH = {
    **{t: Launch(bounds=_simt_bounds) for t in ("flash_fwd", "flash_bwd_dkdv", "flash_bwd_dq", "flash_probs",
                                                "flash_bwd_dbias")},
    **{t: Launch() for t in ("flash_bwd_preprocess", "flash_bwd_dq_convert", "flash_bwd_dq_convert_sm90",
                             "flash_bwd_dq_convert_sm90_varlen",
                             "flash_kv_append", "flash_split_merge")},
    "flash_fwd_tc": Launch(dynamic_smem=_tc_forward_smem, bounds=_tc_forward_bounds),
    "flash_fwd_tc_wide": Launch(32 * WIDE_WARPS, _tc_forward_smem, _tc_wide_bounds),
    "flash_bwd_dkdv_tc": Launch(dynamic_smem=lambda m, n, d, atomic: (2 * n + 4 * m) * d * 2 + 2 * 2 * m * 4
                               + atomic * (m * n * 2 + NUM_THREADS // 32 * 1024), bounds=_tc_dkdv_bounds),
    "flash_bwd_dq_tc": Launch(dynamic_smem=lambda m, n, d, atomic: (2 * m + 4 * n) * d * 2, bounds=_tc_dq_bounds),
    # the Hopper kernels: one CTA an SM, always (their __launch_bounds__(threads, 1): the register cap at
    # entry that setmaxnreg needs), so no bounds rule. The forward: a producer warpgroup and a consumer
    # warpgroup for each 64 query rows of its tile (two, or three with specs.SM90_TALL_FORWARD_TILES)
    "flash_fwd_sm90": Launch(lambda kernel: 128 * (1 + kernel.block_m // SM90_CONSUMER_ROWS), _sm90_forward_smem),
    "flash_bwd_dkdv_sm90": Launch(SM90_THREADS, lambda m, n, d, atomic: _sm90_backward_smem(m, n, d)),
}


@dataclass(frozen=True)
class Grid:
    """The rule of a kernel's grid along x (mask.cuh decodes it; y is Kernel.column_parts): `counts`,
    what its thread blocks count (formatted with the kernel's block_m and block_n), `blocks(kernel, p,
    rows)`, how many for Problem p, and `loop`, the side of the problem each CTA walks block by block
    ("keys", "queries", or None for a kernel without such a loop)."""

    counts: str
    blocks: Callable
    loop: str | None = None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _dbias_tiles(kernel: Kernel, p, _rows) -> int:
    """flash_bwd_dbias's CTAs: one per (bias batch, bias head, row block, key block) of the bias's shape,
    a dimension of size 1 being one block (flash_pairs.cu)."""
    batch, heads, rows, keys = p.bias.shape
    return (batch * heads * _cdiv(rows, kernel.block_m if rows > 1 else 1)
            * _cdiv(keys, kernel.block_n if keys > 1 else 1))


# A block of query rows per query head, walking the keys (forward, dQ); a block of keys per kv head,
# walking the queries (dK/dV)
_QUERY_BLOCKS = Grid("seqlen_q / {block_m} x batch x heads_q",
                     lambda k, p, rows: _cdiv(p.seqlen_q, k.block_m) * p.batch * p.heads_q, "keys")
_KEY_BLOCKS = Grid("seqlen_k / {block_n} x batch x heads_kv",
                   lambda k, p, rows: _cdiv(p.seqlen_k, k.block_n) * p.batch * p.heads_kv, "queries")


def varlen_blocks(kernel: Kernel, p, num_seqs: int) -> int:
    """The CTAs of a kernel for a packed batch (kernel.varlen) of num_seqs sequences, p its packed
    Problem (batch 1, seqlen_q and seqlen_k the totals): per query head, total_q // block_m + num_seqs
    for a kernel that owns query blocks (forward, dQ); per key/value head, total_k // block_n + num_seqs
    for one that owns key blocks (dK/dV). varlen_slots in mask.cuh, whose Sequence says why that covers
    every sequence's blocks, and at most one CTA a sequence more."""
    if kernel.loop == "queries":  # it owns key blocks
        return (p.seqlen_k // kernel.block_n + num_seqs) * p.heads_kv
    return (p.seqlen_q // kernel.block_m + num_seqs) * p.heads_q


_PREPROCESS_ROWS = NUM_THREADS // 32  # a warp a row
_DQ_ELEMENTS = Grid(f"batch x seqlen_q x heads_q x head_dim / {NUM_THREADS}",
                    lambda k, p, rows: _cdiv(p.batch * p.seqlen_q * p.heads_q * p.head_dim, NUM_THREADS))
# The grid of every template Kernel instantiates
GRIDS = {
    "flash_fwd": _QUERY_BLOCKS, "flash_fwd_tc": _QUERY_BLOCKS, "flash_fwd_tc_wide": _QUERY_BLOCKS,
    "flash_fwd_sm90": _QUERY_BLOCKS,  # its tiles (SM90_PERSISTENT: min(tiles, SMs) CTAs walk them)
    "flash_bwd_dq": _QUERY_BLOCKS, "flash_bwd_dq_tc": _QUERY_BLOCKS,
    "flash_bwd_dkdv": _KEY_BLOCKS, "flash_bwd_dkdv_tc": _KEY_BLOCKS, "flash_bwd_dkdv_sm90": _KEY_BLOCKS,
    "flash_bwd_preprocess": Grid(f"batch x heads_q x seqlen_q / {_PREPROCESS_ROWS}",
                                 lambda k, p, rows: _cdiv(p.batch * p.heads_q * p.seqlen_q, _PREPROCESS_ROWS)),
    # a thread an element of dQ; of out (split-KV's merge, flash_merge.cu: q's shape)
    "flash_bwd_dq_convert": _DQ_ELEMENTS, "flash_bwd_dq_convert_sm90": _DQ_ELEMENTS, "flash_split_merge": _DQ_ELEMENTS,
    # a CTA a tile of a packed batch's Hopper dQ workspace (varlen_blocks: varlen_slots a query head)
    "flash_bwd_dq_convert_sm90_varlen": Grid("seqlen_q / {block_m} x batch x heads_q",
                                             lambda k, p, rows: _cdiv(p.seqlen_q, k.block_m) * p.batch * p.heads_q),
    # a thread an element of the new keys (flash_append.cu); rows: the new tokens a sequence
    "flash_kv_append": Grid(f"batch x seqlen_new x heads_kv x head_dim / {NUM_THREADS}",
                            lambda k, p, rows: _cdiv(p.batch * rows * p.heads_kv * p.head_dim, NUM_THREADS)),
    # a tile of (asked rows, keys), per query head; at most every row
    "flash_probs": Grid("rows / {block_m} x seqlen_k / {block_n} x batch x heads_q",
                        lambda k, p, rows: _cdiv(rows if rows is not None else p.seqlen_q, k.block_m)
                        * _cdiv(p.seqlen_k, k.block_n) * p.batch * p.heads_q),
    # a tile of dbias's own shape
    "flash_bwd_dbias": Grid("a tile of the bias's shape", _dbias_tiles),
}
