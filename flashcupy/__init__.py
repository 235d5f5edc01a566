"""flashcupy: exact FlashAttention for NumPy and CuPy arrays, with no framework underneath."""

from ._api import attention, attention_backward, attention_probs, attention_vjp
from ._merge import merge, merge_backward
from ._problem import Problem
from ._varlen import attention_varlen, attention_varlen_backward, attention_varlen_vjp, attention_with_kvcache
from .backends import BackendUnavailableError

__version__ = "0.1.0"

__all__ = [
    "attention",
    "attention_backward",
    "attention_probs",
    "attention_vjp",
    "attention_varlen",
    "attention_varlen_backward",
    "attention_varlen_vjp",
    "attention_with_kvcache",
    "BackendUnavailableError",
    "merge",
    "merge_backward",
    "Problem",
    "__version__",
]
