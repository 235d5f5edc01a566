"""flashcupy: exact FlashAttention for NumPy and CuPy arrays, with no framework underneath."""

from ._api import Problem, attention, attention_backward, attention_vjp
from .backends import BackendUnavailableError

__version__ = "0.1.0"

__all__ = [
    "attention",
    "attention_backward",
    "attention_vjp",
    "BackendUnavailableError",
    "Problem",
    "__version__",
]
