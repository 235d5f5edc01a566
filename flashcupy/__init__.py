"""flashcupy: exact FlashAttention for NumPy and CuPy arrays, with no framework underneath."""

from ._api import Problem, attention, attention_backward, attention_probs, attention_vjp
from ._merge import merge, merge_backward
from .backends import BackendUnavailableError

__version__ = "0.1.0"

__all__ = [
    "attention",
    "attention_backward",
    "attention_probs",
    "attention_vjp",
    "BackendUnavailableError",
    "merge",
    "merge_backward",
    "Problem",
    "__version__",
]
