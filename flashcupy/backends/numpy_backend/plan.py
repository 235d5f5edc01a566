"""How big the NumPy backend's pieces are: the tiles (tile_sizes), the steps of causal staircases
and band tiles, the paths a call takes (decoding, a narrow band), how many kv heads a task stacks,
and how the backward's items are split over the workers.

Each choice says why here; the measurements that settled its numbers, with the commands and
commits that made them, are in benchmarks/results/numpy_backend_choices.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from . import pool
from .settings import config

# Query rows per kv head (seqlen_q x group) up to which the forward reads K and V where they lie
# instead of copying them into BLAS-friendly Kᵀ and [V | 1]: a copy reads and writes every key
# once, as much memory traffic as a decoding step's whole work
IN_PLACE_ROWS = 32

# Bounded bands up to this many keys wide take band_forward and band_backward, whose tiles each
# hold every key their rows see; wider ones the tile plans of tiling.py, whose full-height tiles
# then cover most of the band
NARROW_BAND = 2048

# Elements of a score tile with all the heads of a task stacked: 4 MiB, past a core's L2 but no
# slower than a tile that fits, and it amortises the per-call overhead of small heads
TILE_VOLUME = {4: 1 << 20, 8: 1 << 19}
# The backward's, for each of P and dS: a quarter of the forward's, so both fit a 2 MiB L2 together
# (no slower than half of it, which held two heads of 512 x 512 in the 4 MiB of the pair)
BACKWARD_TILE_VOLUME = {4: 1 << 18, 8: 1 << 17}

# The least work a task is given (FLOPs), so that its Python-level overhead stays small next to it
MIN_TASK_FLOPS = 5e7


def tile_sizes(p, backward=False) -> tuple:
    """(BLOCK_M, BLOCK_N) for problem p: config's where set, else 512 x 512.

    One core's QKᵀ and PV matmuls ran within a few per cent of each other over a wide range of
    tiles around 512 x 512 (OpenBLAS packs each key tile once per query block, so more rows
    amortise it), and more keys per tile also mean fewer Python-level steps; float64 takes the
    same 512 rows (faster than 256 at short sequences, the same at long ones). Causal diagonals
    are cut finer regardless (staircase_step). With a handful of query rows per kv head
    (decoding) a tile holds few scores however many keys it spans, and each step's overhead is
    what remains: 8192 keys.
    """
    few_rows = not backward and decoding(p)
    return config.BLOCK_M or 512, config.BLOCK_N or (8192 if few_rows else 512)


def describe_tiles() -> str:
    """The tiles in words, for `python -m flashcupy info`."""
    if config.BLOCK_M and config.BLOCK_N:
        return f"{config.BLOCK_M}x{config.BLOCK_N} (configured)"
    tiles, decode = (tile_sizes(SizeOnly(rows)) for rows in (1 << 30, 1))
    return f"{tiles[0]}x{tiles[1]}, diagonals cut finer, {decode[1]} keys a tile when decoding"


@dataclass
class SizeOnly:
    """What tile_sizes reads of a Problem."""
    seqlen_q: int
    group: int = 1


def decoding(p) -> bool:
    """Few query rows per kv head (IN_PLACE_ROWS): the forward reads K and V where they lie."""
    return p.seqlen_q * p.group <= IN_PLACE_ROWS


def narrow_band(p, backward=False) -> int | None:
    """The band's width when p takes the narrow-band path (band_forward, band_backward: a window
    alone, at most NARROW_BAND keys wide, and not decoding in the forward; no dropout), else None."""
    width = p.band.width
    if width is None or width > NARROW_BAND or p.modifiers != {"window"} or p.dropout:
        return None
    return width if backward or not decoding(p) else None


def band_step(width: int, group: int) -> int:
    """Query rows per tile of a bounded band `width` keys wide (band_forward), whose matmuls stack
    `group` query heads: a tile of s rows spans s + width - 1 keys, s - 1 of them hidden from each
    row, so s trades that waste against the BLAS efficiency of matmuls of s x group rows. 16 to 64
    rows ran within a few per cent of each other; 32 lies in the middle.
    """
    return max(1, 32 // group)


def staircase_step(block_m: int, heads: int, head_dim: int) -> int:
    """Query rows per tile along a causal diagonal, for tiles that stack `heads` query heads.

    Steps of s rows leave about block_m x s / 2 masked pairs per block and head (4 head_dim
    FLOPs each), and each of the block_m / s tiles costs tens of microseconds of Python and NumPy
    call overhead, what ~2 MFLOP of BLAS take: s = sqrt(1e6 / (heads x head_dim)) balances the two
    (64 rows beat 128 and 256 on one and two threads). At least two steps per block, so the
    staircase is always exercised.
    """
    best = int(math.sqrt(1e6 / (max(1, heads) * max(1, head_dim))))
    return max(1, min(block_m // 2, -(-best // 16) * 16))


def heads_per_task(p, units: int, unit_flops: float, unit_volume: int, volume: int) -> int:
    """kv heads stacked into one task (units: the tasks with one kv head each, of unit_flops and a
    score tile of unit_volume elements): as many as a score tile of about `volume` elements holds,
    in groups of equal size, fewer only where the tasks would not spread evenly over the workers (a
    task count that is a multiple of the worker count, or at least four tasks a worker), and at
    least MIN_TASK_FLOPS of work per task, so that its Python-level overhead stays small. Each task
    also copies its operands and normalises its rows, so fewer, larger tasks win wherever they
    still balance (two four-head tasks beat eight one-head ones at short sequences)."""
    top = max(1, min(p.heads_kv, volume // max(1, unit_volume)))
    workers = pool.worker_count()
    per_group = max(1, units // p.heads_kv)  # tasks per group of stacked kv heads
    stacked = 1
    for s in range(top, 0, -1):  # groups of equal size only: one of 5 and one of 3 heads would not balance
        tasks = p.heads_kv // s * per_group
        if p.heads_kv % s == 0 and (workers == 1 or tasks % workers == 0 or tasks >= 4 * workers):
            stacked = s
            break
    by_work = -(-MIN_TASK_FLOPS // max(1.0, unit_flops))
    return int(max(stacked, min(top, by_work)))


def balanced_parts(costs, n, together=None):
    """Indices of costs split into n lists of about equal sum (largest first onto the least loaded,
    ties to the lowest part), each in ascending order. A function of its arguments only, so a
    given thread count always sums dQ in the same order. together: a key per index; indices of
    equal key go to the same list (items that add into the same elements of dbias)."""
    if together is not None:
        groups = {}
        for i, key in enumerate(together):
            groups.setdefault(key, []).append(i)
        members = list(groups.values())
        parts = balanced_parts([sum(costs[i] for i in m) for m in members], n)
        return [sorted(i for group in part for i in members[group]) for part in parts]
    loads, parts = [0] * n, [[] for _ in range(n)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        least = min(range(n), key=lambda x: (loads[x], x))
        loads[least] += costs[i]
        parts[least].append(i)
    return [sorted(part) for part in parts if part]
