"""torch autograd (and torch.compile) through flashcupy.attention and attention_varlen.

Imported only when torch tensors reach an entry point: torch stays an optional extra.

With grad mode on and an input that requires grad, `flashcupy.attention` on torch tensors calls
the custom op `torch.ops.flashcupy.attention` (torch.library.custom_op), whose autograd formula
saves q, k, v, out and lse and whose backward is a second custom op,
`torch.ops.flashcupy.attention_backward`, that runs flashcupy's backward on them (P recomputed
from lse, as every flashcupy backward: no forward recompute). It returns dq, dk, dv, and dbias for
a bias; the mask, alibi_slopes and the offsets take no gradient (a float tensor among them that
requires grad is refused, not silently left without one), nor do scale and softcap (_checks.real).
lse, when returned, is differentiable too (unlike torch SDPA's logsumexp): its gradient reaches the
backward as dlse (None where the loss does not read lse: no work for it). `attention_varlen` is the
same with `flashcupy::attention_varlen`.

Custom ops rather than a bare torch.autograd.Function because torch.compile then keeps each one
as a single opaque node, forward and backward, with their fake (meta) implementations giving the
shapes, where a Function's forward would be traced into (DLPack and NumPy: graph breaks). Under
torch.compile these entry points always take the custom op, so a compiled model has no break there.

Each op's implementation runs the ordinary entry point on views of its tensors (flashcupy._interop):
CPU tensors on the NumPy backend, CUDA tensors on the cupy backend, on torch's current stream
(current_stream; not yet run on a GPU). The backward follows torch.use_deterministic_algorithms
(deterministic=True then).
"""

from __future__ import annotations

import contextlib
import numbers
from typing import Optional

import torch
from torch import Tensor

from . import _api, _checks, _interop, _varlen
from ._problem import out_shape

_CUSTOM_OP = hasattr(torch.library, "custom_op")  # torch >= 2.4


def current_stream(tensor):
    """Run the cupy backend on torch's current stream of tensor's device, so that flashcupy's
    kernels are ordered with torch's work on both sides without a synchronisation (DLPack then
    finds producer and consumer on the same stream)."""
    import cupy

    index = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
    stack = contextlib.ExitStack()
    stack.enter_context(cupy.cuda.Device(index))
    stack.enter_context(cupy.cuda.ExternalStream(torch.cuda.current_stream(index).cuda_stream, index))
    return stack


def records_autograd(name: str, named: dict) -> bool:
    """Whether this call of entry point `name` on torch tensors {argument: tensor} records autograd:
    grad mode on and an argument that requires grad. An entry point that records none refuses it."""
    wanting = [arg for arg, x in named.items() if _interop.tracked_by_autograd(x)]
    if not wanting:
        return False
    if name not in ENTRY_POINTS:
        raise ValueError(f"flashcupy.{name} records no autograd graph, and {', '.join(wanting)} "
                         f"require{'s' if len(wanting) == 1 else ''} grad: call it under torch.no_grad(), or pass "
                         f"{wanting[0]}.detach() (flashcupy.attention and attention_varlen record autograd)")
    if not _CUSTOM_OP:
        raise TypeError(f"flashcupy.{name} records autograd through torch.library.custom_op, which needs torch "
                        f">= 2.4, got torch {torch.__version__} (or call it under torch.no_grad())")
    return True


def refuse_transforms(name: str, named: dict) -> None:
    """A TypeError for a tensor of torch.func's transforms (vmap, grad, jvp, jacrev, jacfwd: functorch's
    wrapped tensors, which have no storage to view) or a forward-mode dual tensor (torch.autograd.forward_ad,
    whose tangent a view would drop: out would come back with none, as if it were a constant). flashcupy's
    torch path records reverse-mode autograd only (torch's custom ops take no forward-mode rule)."""
    from torch.autograd import forward_ad

    wrapped = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor", lambda x: False)
    for arg, x in named.items():
        if not isinstance(x, Tensor):
            continue
        if wrapped(x):
            raise TypeError(f"{arg} is a tensor of a torch.func transform (vmap, grad, jvp, jacrev or jacfwd), which "
                            f"flashcupy.{name} does not support: for gradients use torch.autograd (loss.backward(), "
                            f"torch.autograd.grad), for a batch a leading dimension (README: Leading batch "
                            f"dimensions), for forward mode flashcupy.jax")
        if forward_ad.unpack_dual(x).tangent is not None:
            raise TypeError(f"{arg} is a forward-mode dual tensor (torch.autograd.forward_ad), which flashcupy.{name} "
                            f"does not support: its tangent would be dropped. Reverse mode works through "
                            f"torch.autograd; forward mode through flashcupy.jax")


def _check_tensors(named: dict) -> None:
    """The one-library rule (flashcupy._interop) where torch.compile traces the call: every array
    argument a torch tensor."""
    if any(x is not None and not isinstance(x, Tensor) for x in named.values()):
        raise _interop.mixed_libraries({n: "torch" if isinstance(x, Tensor) else type(x).__module__.split(".")[0]
                                        for n, x in named.items() if x is not None})


def _no_gradient(name: str, x) -> None:
    if x is not None and _interop.tracked_by_autograd(x):
        raise ValueError(f"{name} requires grad, but flashcupy gives {name} no gradient: pass {name}.detach() "
                         f"if it is a constant")


def _number(name: str, x):
    return None if x is None else _checks.real(name, x)


def _window(left, right):
    return None if left is None and right is None else (left, right)


def _lse_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _dropout(rate: float, seed_lo: int, seed_hi: int) -> dict:
    """flashcupy's dropout keywords from the ops' own arguments (torch's ints are int64: the seed's two
    32-bit halves)."""
    return dict(dropout_p=rate, dropout_seed=seed_lo | seed_hi << 32) if rate > 0 else {}


def _contiguous(xs):
    # the fake implementations promise contiguous results (what the backends allocate)
    return [x.contiguous() for x in xs]


# ----------------------------------------------------------------------------
# attention

if _CUSTOM_OP:
    @torch.library.custom_op("flashcupy::attention", mutates_args=())
    def _attention_op(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], mask: Optional[Tensor],
                      alibi_slopes: Optional[Tensor], causal: bool, window_left: Optional[int],
                      window_right: Optional[int], softcap: Optional[float], scale: Optional[float], backend: str,
                      dtype: Optional[str], dropout_p: float, seed_lo: int, seed_hi: int) -> tuple[Tensor, Tensor]:
        kw = dict(causal=causal, window=_window(window_left, window_right), softcap=softcap,
                  alibi_slopes=alibi_slopes, bias=bias, mask=mask, scale=scale, return_lse=True, backend=backend,
                  dtype=dtype, **_dropout(dropout_p, seed_lo, seed_hi))
        return tuple(_contiguous(_interop.through_views(_api.attention.__wrapped__, (q, k, v), kw)))

    @_attention_op.register_fake
    def _(q, k, v, bias, mask, alibi_slopes, causal, window_left, window_right, softcap, scale, backend, dtype,
          *dropout):
        return (q.new_empty(out_shape(q.shape, v.shape)),
                q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=_lse_dtype(q)))

    @torch.library.custom_op("flashcupy::attention_backward", mutates_args=())
    def _attention_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                               dlse: Optional[Tensor], bias: Optional[Tensor], mask: Optional[Tensor],
                               alibi_slopes: Optional[Tensor], causal: bool, window_left: Optional[int],
                               window_right: Optional[int], softcap: Optional[float], scale: Optional[float],
                               backend: str, dtype: Optional[str], dropout_p: float, seed_lo: int, seed_hi: int,
                               deterministic: bool, return_dbias: bool) -> list[Tensor]:
        kw = dict(causal=causal, window=_window(window_left, window_right), softcap=softcap,
                  alibi_slopes=alibi_slopes, bias=bias, mask=mask, scale=scale, backend=backend, dtype=dtype,
                  deterministic=deterministic, dlse=dlse, return_dbias=return_dbias,
                  **_dropout(dropout_p, seed_lo, seed_hi))
        return _contiguous(_interop.through_views(_api.attention_backward.__wrapped__, (dout, q, k, v, out, lse), kw))

    @_attention_backward_op.register_fake
    def _(dout, q, k, v, out, lse, dlse, bias, mask, alibi_slopes, *options):
        return_dbias = options[-1]
        return [x.new_empty(x.shape) for x in (q, k, v) + ((bias,) if bias is not None and return_dbias else ())]

    def _attention_setup(ctx, inputs, output):
        q, k, v, bias, mask, alibi_slopes, *options = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, bias, mask, alibi_slopes)
        ctx.options = options
        ctx.set_materialize_grads(False)  # no dlse where the loss does not read lse

    def _attention_backward(ctx, dout, dlse):
        q, k, v, out, lse, bias, mask, alibi_slopes = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout  # a loss of lse alone
        # dbias only where the bias wants a gradient: the backward spends nothing on it otherwise
        return_dbias = bias is not None and ctx.needs_input_grad[3]
        grads = torch.ops.flashcupy.attention_backward(dout, q, k, v, out, lse, dlse, bias, mask, alibi_slopes,
                                                       *ctx.options, torch.are_deterministic_algorithms_enabled(),
                                                       return_dbias)
        dbias = grads[3] if return_dbias else None
        return (grads[0], grads[1], grads[2], dbias) + (None,) * (len(ctx.needs_input_grad) - 4)

    _attention_op.register_autograd(_attention_backward, setup_context=_attention_setup)


def attention(q, k, v, *, causal=False, window=None, softcap=None, alibi_slopes=None, bias=None, mask=None,
              scale=None, return_lse=False, backend="auto", dtype=None, dropout_p=0.0, dropout_seed=None):
    """flashcupy.attention recorded by autograd (the module docstring); the same arguments (the
    backward redraws dropout's mask from dropout_seed, checked here as flashcupy.attention does)."""
    rate, seed = _checks.check_dropout(dropout_p, dropout_seed)
    _check_tensors(dict(q=q, k=k, v=v, bias=bias, mask=mask, alibi_slopes=alibi_slopes))
    _no_gradient("alibi_slopes", alibi_slopes)
    return_lse = _checks.check_bool("return_lse", return_lse)
    left, right = _checks.check_window(window)
    _checks.check_dtype_name(dtype)
    out, lse = torch.ops.flashcupy.attention(q, k, v, bias, mask, alibi_slopes, _checks.check_bool("causal", causal),
                                             left, right, _number("softcap", softcap), _number("scale", scale),
                                             _checks.check_backend_name(backend), dtype, rate, seed & 0xFFFFFFFF,
                                             seed >> 32)
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------
# attention_varlen

if _CUSTOM_OP:
    @torch.library.custom_op("flashcupy::attention_varlen", mutates_args=())
    def _varlen_op(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                   max_seqlen_q: Optional[int], max_seqlen_k: Optional[int], alibi_slopes: Optional[Tensor],
                   causal: bool, window_left: Optional[int], window_right: Optional[int], softcap: Optional[float],
                   scale: Optional[float], backend: str, dtype: Optional[str],
                   check_offsets: bool, dropout_p: float, seed_lo: int, seed_hi: int) -> tuple[Tensor, Tensor]:
        kw = dict(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, causal=causal,
                  window=_window(window_left, window_right), softcap=softcap, alibi_slopes=alibi_slopes, scale=scale,
                  return_lse=True, backend=backend, dtype=dtype, check_offsets=check_offsets,
                  **_dropout(dropout_p, seed_lo, seed_hi))
        args = (q, k, v, cu_seqlens_q, cu_seqlens_k)
        return tuple(_contiguous(_interop.through_views(_varlen.attention_varlen.__wrapped__, args, kw)))

    @_varlen_op.register_fake
    def _(q, k, v, cu_seqlens_q, cu_seqlens_k, *options):
        return q.new_empty(out_shape(q.shape, v.shape)), q.new_empty((q.shape[1], q.shape[0]), dtype=_lse_dtype(q))

    @torch.library.custom_op("flashcupy::attention_varlen_backward", mutates_args=())
    def _varlen_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                            dlse: Optional[Tensor], cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                            max_seqlen_q: Optional[int], max_seqlen_k: Optional[int], alibi_slopes: Optional[Tensor],
                            causal: bool,
                            window_left: Optional[int], window_right: Optional[int], softcap: Optional[float],
                            scale: Optional[float], backend: str, dtype: Optional[str],
                            check_offsets: bool, dropout_p: float, seed_lo: int, seed_hi: int) -> list[Tensor]:
        kw = dict(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, causal=causal,
                  window=_window(window_left, window_right), softcap=softcap, alibi_slopes=alibi_slopes, scale=scale,
                  backend=backend, dtype=dtype, check_offsets=check_offsets, dlse=dlse,
                  **_dropout(dropout_p, seed_lo, seed_hi))
        args = (dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
        return _contiguous(_interop.through_views(_varlen.attention_varlen_backward.__wrapped__, args, kw))

    @_varlen_backward_op.register_fake
    def _(dout, q, k, v, *options):
        return [x.new_empty(x.shape) for x in (q, k, v)]

    def _varlen_setup(ctx, inputs, output):
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, *options = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes)
        ctx.options = (max_seqlen_q, max_seqlen_k)
        ctx.more = options
        ctx.set_materialize_grads(False)  # no dlse where the loss does not read lse

    def _varlen_backward(ctx, dout, dlse):
        q, k, v, out, lse, cu_q, cu_k, alibi_slopes = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout  # a loss of lse alone
        dq, dk, dv = torch.ops.flashcupy.attention_varlen_backward(dout, q, k, v, out, lse, dlse, cu_q, cu_k,
                                                                   *ctx.options, alibi_slopes, *ctx.more)
        return (dq, dk, dv) + (None,) * (len(ctx.needs_input_grad) - 3)

    _varlen_op.register_autograd(_varlen_backward, setup_context=_varlen_setup)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None, causal=False,
                     window=None, softcap=None, alibi_slopes=None, scale=None, return_lse=False, backend="auto",
                     dtype=None, check_offsets=True, dropout_p=0.0, dropout_seed=None):
    """flashcupy.attention_varlen recorded by autograd (the module docstring); the same arguments."""
    rate, seed = _checks.check_dropout(dropout_p, dropout_seed)
    _check_tensors(dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                        alibi_slopes=alibi_slopes))
    _no_gradient("alibi_slopes", alibi_slopes)
    return_lse = _checks.check_bool("return_lse", return_lse)
    left, right = _checks.check_window(window)
    _checks.check_dtype_name(dtype)
    hints = []
    for name, hint in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if hint is not None and (isinstance(hint, bool) or not isinstance(hint, numbers.Integral)):
            raise TypeError(f"{name} must be None or an int >= 0, got {hint!r}")
        hints.append(None if hint is None else int(hint))
    out, lse = torch.ops.flashcupy.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *hints, alibi_slopes,
                                                    _checks.check_bool("causal", causal), left, right,
                                                    _number("softcap", softcap), _number("scale", scale),
                                                    _checks.check_backend_name(backend), dtype,
                                                    _checks.check_bool("check_offsets", check_offsets), rate,
                                                    seed & 0xFFFFFFFF, seed >> 32)
    return (out, lse) if return_lse else out


ENTRY_POINTS = {"attention": attention, "attention_varlen": attention_varlen}


def compiled(fn, wrapper, args, kwargs):
    """An entry point called while torch.compile traces: the differentiable ones on a torch q as
    their custom op (one node of the graph, whether or not anything requires grad), the others run
    eagerly (a graph break: torch.compiler.disable)."""
    entry = ENTRY_POINTS.get(fn.__name__)
    if entry is not None and args and isinstance(args[0], Tensor):
        return entry(*args, **kwargs)
    return torch.compiler.disable(wrapper)(*args, **kwargs)
