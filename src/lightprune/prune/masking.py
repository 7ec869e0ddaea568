"""Applying a boolean mask: ``where(mask, values, 0)``, fast on the CPU and exact for every value.

The reparametrization recomputes ``name = orig`` masked before every forward and masks the gradient in every
backward, so this runs twice per training step for every pruned tensor. With a ``torch.bool`` mask, ``torch.where``
is the obvious way, but on the CPU its kernel is not vectorized: for a 300x784 weight it takes about 9x as long as
multiplying by a float mask (measured with torch 2.13, one thread), which made a training step with bool masks
markedly slower than one with float masks. Multiplying by the mask converted to float is fast but turns ``inf`` and
``NaN`` into ``NaN`` instead of ``0``, and keeps a float copy of the mask alive until the backward pass.

:func:`masked` keeps ``torch.where``'s exact result and the bool mask's memory: on the CPU it selects with integer
bit operations (the mask as ``0`` / all-ones in an integer type of the value's width, ANDed with the value's bits),
three vectorized passes that cost about what one float multiplication does; the gradient is masked the same way.
Elsewhere (CUDA, where ``torch.where`` is one fused kernel), for small tensors (where a Python autograd function
costs more than it saves), under ``torch.func`` transforms, while ``torch.jit.trace``, ``torch.compile`` or
``torch.export`` trace, or for dtypes without a same-width integer type, it is ``torch.where``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["masked", "masked_"]

_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}
"""Integer dtype of the same width as a floating dtype of that many bytes."""

MIN_NUMEL_FOR_BITS = 1 << 14
"""Below this many entries ``torch.where`` is faster than the autograd function's Python overhead."""

MASK_CHUNK = 1 << 18
"""Entries :func:`masked_` widens at a time (1 MB of int32 scratch: stays in cache, allocates nothing weight-sized)."""


def _select_bits(values: Tensor, keep: Tensor) -> Tensor:
    """``where(keep, values, +0)`` by bit operations, without autograd (``values``: floating, a ``_BITS`` width)."""
    bits = _BITS[values.element_size()]
    out = keep.view(torch.uint8).to(bits)  # 0 or 1
    out.neg_()  # 0 or all ones
    out.bitwise_and_(values.view(bits))
    return out.view(values.dtype)


class _KeepWhere(torch.autograd.Function):
    """``where(keep, values, 0)`` with the gradient ``where(keep, grad, 0)``, both by :func:`_select_bits`."""

    @staticmethod
    def forward(ctx: Any, values: Tensor, keep: Tensor) -> Tensor:
        ctx.save_for_backward(keep)
        return _select_bits(values, keep)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None]:
        (keep,) = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: stay differentiable, for double backward
            return masked(grad, keep), None
        return _select_bits(grad, keep), None


def _bits_apply(values: Tensor, keep: Tensor) -> bool:
    return (
        # torch.jit.trace records the ops run, not the autograd function: a traced bit selection would have no
        # gradient, and its shape checks would be traced as values (TracerWarning). torch.compile and torch.export
        # get torch.where, which their compilers fuse (torch 2.5's cannot trace the in-place bit operations).
        not torch.jit.is_tracing()
        and not torch.compiler.is_compiling()
        and values.device.type == "cpu"
        and values.is_floating_point()
        and values.element_size() in _BITS
        and keep.dtype == torch.bool
        and keep.shape == values.shape
        and values.numel() >= MIN_NUMEL_FOR_BITS
        and type(values) in (Tensor, torch.nn.Parameter)  # subclasses' __torch_function__ must see the op
        and not torch._C._are_functorch_transforms_active()
    )


def masked(values: Tensor, keep: Tensor) -> Tensor:
    """Return ``torch.where(keep, values, 0)``: ``values`` where ``keep`` is true, an exact ``+0`` elsewhere.

    Same result, dtype and gradient as ``torch.where`` (a pruned entry is ``0`` even where ``values`` is ``inf`` or
    ``NaN``, and no gradient reaches it), faster on the CPU; see the module docstring.

    Args:
        values: the tensor to mask, e.g. a parameter's ``orig``.
        keep: a ``torch.bool`` tensor of the same shape, true for the entries kept.

    Example:
        >>> values = torch.tensor([1.5, float("inf"), -2.0, float("nan")], requires_grad=True)
        >>> out = masked(values, torch.tensor([True, False, True, False]))
        >>> out
        tensor([ 1.5000,  0.0000, -2.0000,  0.0000], grad_fn=<WhereBackward0>)
        >>> out.sum().backward()
        >>> values.grad
        tensor([1., 0., 1., 0.])
    """
    if _bits_apply(values, keep):
        if values.requires_grad and torch.is_grad_enabled():
            return _KeepWhere.apply(values, keep)
        return _select_bits(values, keep)
    return torch.where(keep, values, torch.zeros((), dtype=values.dtype, device=values.device))


def masked_(values: Tensor, keep: Tensor) -> Tensor:
    """Zero ``values`` in place where ``keep`` is false (``keep``: a bool or 0/1 floating mask); returns ``values``.

    With a ``torch.bool`` mask on the CPU, a floating ``values`` is ANDed with the mask widened to its bit width
    (0 or all ones), about 2.5x a float multiplication where multiplying by the bool mask takes about 9x; pruned
    entries become ``+0`` even where they held ``inf`` or ``NaN``. Otherwise it multiplies in place.

    Example:
        >>> values = torch.tensor([1.5, -2.0, float("nan"), 4.0])
        >>> masked_(values, torch.tensor([True, False, False, True]))
        tensor([1.5000, 0.0000, 0.0000, 4.0000])
    """
    if (
        keep.dtype == torch.bool
        and values.is_floating_point()
        and values.element_size() in _BITS
        and values.device.type == "cpu"
        and values.is_contiguous()
        and keep.is_contiguous()
        and keep.shape == values.shape
    ):
        bits = _BITS[values.element_size()]
        flat_values, flat_keep = values.view(-1).view(bits), keep.view(-1).view(torch.uint8)
        # in chunks through one small scratch: a weight-sized widened copy would cost more in page faults than work
        scratch = torch.empty(min(flat_values.numel(), MASK_CHUNK), dtype=bits)
        for start in range(0, flat_values.numel(), MASK_CHUNK):
            part = flat_keep[start : start + MASK_CHUNK]
            widened = scratch[: part.numel()]
            widened.copy_(part)
            widened.neg_()  # 0 or all ones
            flat_values[start : start + MASK_CHUNK].bitwise_and_(widened)
        return values
    if keep.dtype == torch.bool:
        return values.masked_fill_(~keep, 0)
    return values.mul_(keep.to(values.dtype) if keep.dtype != values.dtype else keep)
