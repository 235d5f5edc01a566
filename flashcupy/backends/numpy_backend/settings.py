"""The NumPy backend's tunables: what a user may set (configure), read by plan.py (tiles) and
pool.py (workers). A room of its own so that both read it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Config:
    """Tunables. BLOCK_M x BLOCK_N is the tile (None: chosen per call by tile_sizes); NUM_THREADS
    the worker count (None: the environment's FLASHCUPY_NUM_THREADS, else one per core); SHORT the
    longest sequence run in a group with others, of a packed batch or of a rank-4 batch of at least
    packed.DENSE_BATCH (None: packed.SHORT; 0: no groups, the tiled path)."""

    BLOCK_M: int | None = None
    BLOCK_N: int | None = None
    NUM_THREADS: int | None = None
    SHORT: int | None = None


config = Config()


def configure(*, block_m=None, block_n=None, num_threads=None, short=None) -> Config:
    """Change tile sizes, the thread count or the short sequences' grouping (short: 0 turns it off) for
    later calls (an argument left out, or None, keeps its value; set config.BLOCK_M = None to give the
    choice back to tile_sizes); returns the config."""
    for name, value in (("block_m", block_m), ("block_n", block_n), ("num_threads", num_threads), ("short", short)):
        least = 0 if name == "short" else 1
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < least):
            raise ValueError(f"{name} must be a {'non-negative' if least == 0 else 'positive'} int, got {value!r}")
    if block_m is not None:
        config.BLOCK_M = block_m
    if block_n is not None:
        config.BLOCK_N = block_n
    if num_threads is not None:
        config.NUM_THREADS = num_threads
    if short is not None:
        config.SHORT = short
    return config
