"""What one attention call is: its `Problem` (shapes, dtype, options, score modifiers) and its `Band`
(which keys each query sees), with the constants every backend shares.

`Band` is the Python peer of `Mask` in cupy_backend/kernels/mask.cuh: the NumPy backend's tile plans,
the Dask graph's pairs, the Numba and CuPy launchers' window arguments and the FLOP counts all ask it,
and none of them spells the rule again. Semantics (README, "Semantics"): query i sees key j iff
i + diagonal - left <= j <= i + diagonal + right, a side None where unbounded; causal is right = 0;
diagonal is seqlen_k - seqlen_q (bottom-right alignment) unless the problem is a chunk of a larger one.

This module needs NumPy and the standard library only.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np

LOG2E = math.log2(math.e)  # the kernels scale scores by scale * log2(e) and exponentiate with exp2
LN2 = math.log(2)          # and lse = ln 2 m + ln l turns their base-2 m back into natural logs

FLOAT_DTYPES = ("float16", "float32", "float64", "bfloat16")  # the value dtypes, by name
MODIFIERS = ("window", "softcap", "alibi_slopes", "bias", "mask")  # the keywords, in the order they apply

# A backward tile does five matmuls of the forward's two-per-tile size: the FlashAttention papers
# count its FLOPs as 2.5 times the forward's.
BACKWARD_FLOPS_RATIO = 2.5


def default_scale(head_dim: int) -> float:
    """The scale when none is given: 1/sqrt(head_dim), as in "Attention Is All You Need"."""
    return 1.0 / math.sqrt(head_dim)


def out_shape(q_shape, v_shape) -> tuple:
    """out's (and dout's) shape: q's with v's head dim, the last dimension (which may differ from q's
    and k's: Problem.head_dim_v)."""
    return tuple(q_shape[:-1]) + tuple(v_shape[-1:])


def accumulation_dtype(value_dtype: str) -> np.dtype:
    """What every backend accumulates in (and stores lse in): float64 for float64 values, float32
    for float32, float16 and bfloat16."""
    return np.dtype(np.float64) if value_dtype == "float64" else np.dtype(np.float32)


@dataclass(frozen=True)
class Band:
    """Which keys each query sees under causal and a window: query i sees key j iff
    i + diagonal - left <= j <= i + diagonal + right (and j < seqlen_k), a side None where unbounded.

    Every function here answers for the band alone; a user's bool mask is no band and is applied
    per tile on top. The rule bounds j - i, so each query sees one interval of keys whose two ends
    never decrease from one query to the next: the ranges below are exact."""

    seqlen_q: int
    seqlen_k: int
    diagonal: int
    left: int | None = None
    right: int | None = None

    @classmethod
    def of(cls, seqlen_q: int, seqlen_k: int, causal: bool = False, window=None, diagonal=None) -> Band:
        """The band of validated options: window (left, right) or None, causal as right = 0,
        diagonal None for seqlen_k - seqlen_q."""
        left, right = window or (None, None)
        return cls(seqlen_q, seqlen_k, seqlen_k - seqlen_q if diagonal is None else diagonal,
                   left, 0 if causal else right)

    @property
    def width(self) -> int | None:
        """The most keys a query row sees when both sides are bounded, else None."""
        return None if self.left is None or self.right is None else self.left + self.right + 1

    def visible(self, i, j):
        """Query i sees key j; i and j are numbers or index arrays that broadcast."""
        left, right, d = self.left, self.right, self.diagonal
        if left is None and right is None:
            return np.ones(np.broadcast(i, j).shape, dtype=bool)
        if left is None:
            return j <= i + d + right
        if right is None:
            return j >= i + d - left
        return (j <= i + d + right) & (j >= i + d - left)

    def key_range(self, i0: int, i1: int) -> tuple:
        """Keys [start, end) that some query row of [i0, i1) sees."""
        start = 0 if self.left is None else min(self.seqlen_k, max(0, i0 + self.diagonal - self.left))
        if self.right is None:
            return start, self.seqlen_k
        return start, max(start, min(self.seqlen_k, i1 + self.diagonal + self.right))

    def query_range(self, j0: int, j1: int) -> tuple:
        """Query rows [start, end) that see some key of [j0, j1)."""
        start = 0 if self.right is None else min(self.seqlen_q, max(0, j0 - self.diagonal - self.right))
        if self.left is None:
            return start, self.seqlen_q
        return start, max(start, min(self.seqlen_q, j1 - self.diagonal + self.left))

    def keys_seen_by_all(self, i0: int, i1: int) -> tuple:
        """Keys [start, end) that every query row of [i0, i1) sees (none when start >= end): those
        its first and its last row both see."""
        first, last = self.key_range(i0, i0 + 1), self.key_range(i1 - 1, i1)
        return max(first[0], last[0]), min(first[1], last[1])

    def queries_seeing_all(self, j0: int, j1: int) -> tuple:
        """Query rows [start, end) that see every key of [j0, j1) (none when start >= end)."""
        first, last = self.query_range(j0, j0 + 1), self.query_range(j1 - 1, j1)
        return max(first[0], last[0]), min(first[1], last[1])

    def hidden(self, i0: int, i1: int, j0: int, j1: int):
        """None when query rows [i0, i1) see every key of [j0, j1), else the bool (rows, keys) mask of
        the pairs hidden."""
        # j - i is largest at the tile's top-right corner and smallest at its bottom-left one: both
        # visible, every pair is
        if self.visible(i0, j1 - 1) and self.visible(i1 - 1, j0):
            return None
        return ~self.visible(np.arange(i0, i1)[:, None], np.arange(j0, j1)[None, :])

    def sees_block(self, i0: int, i1: int, j0: int, j1: int) -> bool:
        """Whether some query row of [i0, i1) sees some key of [j0, j1)."""
        if i0 >= i1 or j0 >= j1:
            return False
        start, end = self.key_range(i0, i1)
        return max(start, j0) < min(end, j1)

    @functools.cached_property
    def pairs(self) -> int:
        """The (query, key) pairs the band leaves visible (per batch and head)."""
        i = np.arange(self.seqlen_q, dtype=np.int64) + self.diagonal
        lo = np.zeros_like(i) if self.left is None else np.clip(i - self.left, 0, self.seqlen_k)
        hi = (np.full_like(i, self.seqlen_k) if self.right is None
              else np.clip(i + self.right + 1, 0, self.seqlen_k))
        return int(np.maximum(hi - lo, 0).sum())

    def kernel_sides(self) -> tuple:
        """(left, right) as the CUDA kernels take them (mask.cuh): an unbounded side, or one wider than
        the keys, becomes the narrowest that hides nothing, so that no bound a kernel computes from
        it overflows int32."""
        widest_left = max(0, self.seqlen_q - 1 + self.diagonal)   # i + diagonal - left <= 0 for every row
        widest_right = max(0, self.seqlen_k - 1 - self.diagonal)  # i + diagonal + right >= seqlen_k - 1
        return (widest_left if self.left is None else min(self.left, widest_left),
                widest_right if self.right is None else min(self.right, widest_right))


def attention_flops(batch: int, heads_q: int, head_dim: int, band: Band, *, windowed: bool,
                    backward: bool = False, head_dim_v: int | None = None) -> float:
    """The standard count (FlashAttention papers): 4 head_dim FLOPs per (query, key) pair and head
    (2 head_dim for q.k and 2 head_dim_v for p v where v's head dim differs), over the whole
    square, halved when causal (S^2 / 2, as the papers and flash-attn's benchmarks count it), or,
    with a window, over the pairs the band leaves visible; the backward BACKWARD_FLOPS_RATIO times
    the forward."""
    if windowed:
        pairs = band.pairs
    else:  # without a window, right is 0 exactly when causal
        pairs = band.seqlen_q * band.seqlen_k / (2 if band.right == 0 else 1)
    dims = 2.0 * (head_dim + (head_dim if head_dim_v is None else head_dim_v))
    return dims * batch * heads_q * pairs * (BACKWARD_FLOPS_RATIO if backward else 1.0)


@dataclass(frozen=True)
class Problem:
    """Everything a backend needs to know besides q, k, v (and dout, out, lse): shapes, options,
    and the score modifiers, the arrays among them (alibi_slopes, bias, mask) included. Made only
    by flashcupy._checks.problem, so a backend receives it validated."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    dtype: str          # the values' dtype, by name: one of FLOAT_DTYPES
    causal: bool
    scale: float
    carrier: np.dtype   # the arrays' own dtype: dtype, or uint16/int16 holding bfloat16 bits
    # Score modifiers (README, Semantics); None where absent. The window's sides as validated, None
    # unbounded; with causal the window's right is dropped (causal is right = 0, see band).
    window_left: int | None = None
    window_right: int | None = None
    softcap: float | None = None
    # arrays of the inputs' library: (heads_q,) or (batch, heads_q); rank 4 and broadcastable to
    # (batch, heads_q, seqlen_q, seqlen_k), bias in q's dtype (carrier) or float32, mask bool
    alibi_slopes: object = field(default=None, compare=False, repr=False)
    bias: object = field(default=None, compare=False, repr=False)
    mask: object = field(default=None, compare=False, repr=False)
    # The diagonal when this problem is a chunk of a larger one (flashcupy.dask: the chunks' global
    # positions); None: seqlen_k - seqlen_q, the bottom-right alignment of the whole arrays.
    offset: int | None = None
    # v's head dim (out's and dout's last dimension too); None: head_dim (MLA-style attention has
    # queries and keys of one size, values of another)
    head_dim_v: int | None = None
    # Dropout (README, Semantics; flashcupy/_dropout.py): the probability p of dropping a weight, in
    # [0, 1), 0 for none; the seed of the keep mask; and the (batch, head, query, key) position of this
    # problem's first pair in the whole call's mask: a chunk's (flashcupy.dask), a view's of a call with
    # leading dimensions or a sequence's of a packed batch; zeros for a whole call.
    dropout_p: float = 0.0
    dropout_seed: int = 0
    dropout_origin: tuple = (0, 0, 0, 0)
    # the seed as a device array of two uint32 words (low, high) that the kernels read themselves, in
    # place of dropout_seed: flashcupy.jax's traced seeds on a GPU, never copied to the host (backends
    # that declare DROPOUT_SEED_ON_DEVICE); None: dropout_seed
    dropout_seed_words: object = field(default=None, compare=False, repr=False)
    # False where the caller wants no dbias (attention_backward's return_dbias): the bias still shapes
    # the scores, but the backward spends nothing on its gradient
    return_dbias: bool = True
    # True where the caller wants dq alone (flashcupy.jax's forward mode, whose widened backward reads
    # only dq): a backend that declares DQ_ONLY then skips dk and dv, and returns (dq,)
    dq_only: bool = False

    def __post_init__(self):
        if self.head_dim_v is None:
            object.__setattr__(self, "head_dim_v", self.head_dim)

    @property
    def dbias(self) -> bool:
        """Whether the backward computes dbias: a bias was given, and its gradient is wanted."""
        return self.bias is not None and self.return_dbias

    @functools.cached_property
    def band(self) -> Band:
        """Which keys each query sees (causal and window; the user's mask aside)."""
        return Band(self.seqlen_q, self.seqlen_k, self.diagonal, self.window_left,
                    0 if self.causal else self.window_right)

    @functools.cached_property  # a call asks it several times; the fields are frozen
    def modifiers(self) -> frozenset:
        """The score modifiers this call uses, by keyword name (empty for plain and causal attention)."""
        present = {"window": self.window_left is not None or self.window_right is not None,
                   "softcap": self.softcap is not None, "alibi_slopes": self.alibi_slopes is not None,
                   "bias": self.bias is not None, "mask": self.mask is not None}
        return frozenset(name for name, there in present.items() if there)

    @property
    def dropout(self) -> bool:
        return self.dropout_p > 0

    @property
    def dropout_scale(self) -> float:
        """What a kept weight is multiplied by: 1 / (1 - p)."""
        return 1.0 / (1.0 - self.dropout_p)

    @property
    def group(self) -> int:
        """Query heads per kv head (1 for plain multi-head attention)."""
        return self.heads_q // self.heads_kv

    @property
    def acc_dtype(self) -> np.dtype:
        return accumulation_dtype(self.dtype)

    @property
    def lse_dtype(self) -> np.dtype:
        return self.acc_dtype

    @property
    def out_shape(self) -> tuple:
        """out's (and dout's) shape: q's with v's head dim."""
        return (self.batch, self.seqlen_q, self.heads_q, self.head_dim_v)

    @property
    def lse_shape(self) -> tuple:
        return (self.batch, self.heads_q, self.seqlen_q)

    @property
    def diagonal(self) -> int:
        """Query i sees key j iff j <= i + diagonal (bottom-right alignment)."""
        return self.seqlen_k - self.seqlen_q if self.offset is None else self.offset

    def flops(self, backward: bool = False) -> float:
        """attention_flops of this problem."""
        return attention_flops(self.batch, self.heads_q, self.head_dim, self.band,
                               windowed="window" in self.modifiers, backward=backward, head_dim_v=self.head_dim_v)
