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

:func:`masked_all_` zeroes many tensors in place at once (the in-place mode's gradients and weights, every step):
on the CPU each mask is widened to ``0`` / ``1`` in the value's integer width through one small scratch buffer kept
per thread and reused by every call, and the value's bits are multiplied by it (an integer multiplication by ``0`` or
``1`` keeps the bits or gives ``+0``, whatever they encode). Tensors are cut into, and small ones packed together
into, scratch-sized batches, and each batch is two multi-tensor (``torch._foreach_*``) calls, whatever the number of
tensors. Nothing weight-sized is allocated: the memory beside the model stays the bool mask's byte a weight.
:class:`MaskPlan` is :func:`masked_all_` for masks that stay the same from one call to the next (the in-place mode's
per-step passes): the batches, views and scratch slices are worked out once, so a call is little more than its two
multi-tensor calls per batch.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.autograd import forward_ad

__all__ = ["MaskPlan", "masked", "masked_", "masked_all_"]

_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}
"""Integer dtype of the same width as a floating dtype of that many bytes."""

_PLAIN_TYPES = (Tensor, torch.nn.Parameter)
"""Tensor types the bit paths take (subclasses' ``__torch_function__`` must see the ops: they get torch.where)."""

MIN_NUMEL_FOR_BITS = 1 << 14
"""Below this many entries ``torch.where`` is faster than the autograd function's Python overhead."""

MASK_CHUNK = 1 << 18
"""Entries :func:`masked_all_` widens at a time (1 MB of int32 scratch: stays in cache, nothing weight-sized)."""

_scratch = threading.local()
"""Per thread, ``{integer dtype: MASK_CHUNK-entry tensor}``: the widened masks' buffer, reused by every call."""


def _select_bits(values: Tensor, keep: Tensor) -> Tensor:
    """``where(keep, values, +0)`` by bit operations, without autograd (``values``: floating, a ``_BITS`` width)."""
    bits = _BITS[values.element_size()]
    out = keep.to(bits)  # 0 or 1 (straight from bool: converting a uint8 view is several times slower mid-size)
    out.mul_(values.view(bits))  # the value's bits, or +0
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
    # torch.jit.trace records the ops run, not the autograd function: a traced bit selection would have no gradient,
    # and the shape and size checks below would be traced as values (they fail inside the tracer), so it is asked
    # first. torch.compile and torch.export get torch.where, which their compilers fuse (torch 2.5's cannot trace the
    # in-place bit operations).
    if torch.jit.is_tracing():
        return False
    return (  # cheapest checks first: a small tensor or a float mask is decided by the first two or three
        keep.dtype == torch.bool
        and values.is_cpu
        and values.numel() >= MIN_NUMEL_FOR_BITS
        and type(values) in _PLAIN_TYPES  # subclasses' __torch_function__ must see the op
        and values.is_floating_point()
        and values.element_size() in _BITS
        and keep.shape == values.shape
        and not torch.compiler.is_compiling()
        and not torch._C._are_functorch_transforms_active()
        and forward_ad.unpack_dual(values).tangent is None  # forward-mode AD: torch.where carries the tangent
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

    With a ``torch.bool`` mask this is :func:`masked_all_` on one tensor: pruned entries become ``+0`` even where they
    held ``inf`` or ``NaN``. A floating mask multiplies in place, as torch's reparametrization does with its float
    masks (``inf * 0`` is ``NaN``, ``-1 * 0`` is ``-0``).

    Example:
        >>> values = torch.tensor([1.5, -2.0, float("nan"), 4.0])
        >>> masked_(values, torch.tensor([True, False, False, True]))
        tensor([1.5000, 0.0000, 0.0000, 4.0000])
    """
    if keep.dtype == torch.bool:
        masked_all_([values], [keep])
        return values
    return values.mul_(keep.to(values.dtype) if keep.dtype != values.dtype else keep)


def masked_all_(values: Sequence[Tensor], keeps: Sequence[Tensor]) -> None:
    """Zero every ``values[i]`` in place where ``keeps[i]`` is false: an exact ``+0``, even over ``inf`` or ``NaN``.

    ``keeps[i]`` is a ``torch.bool`` or a ``0`` / ``1`` floating tensor of ``values[i]``'s shape, on its device. The
    result is ``torch.where(keeps[i], values[i], 0)`` bit for bit, written into ``values[i]``; autograd does not record
    it (gradients and weights between steps are what it is for). On the CPU, contiguous floating tensors of 2, 4 or 8
    bytes an entry go through the batched multi-tensor path of the module docstring, which allocates nothing
    weight-sized; any other tensor gets ``torch.where(keep, value, 0, out=value)`` on its own (one fused kernel on
    CUDA; a floating mask is compared with ``0`` first there, a mask-sized temporary).

    Args:
        values: the tensors to mask, e.g. the pruned parameters or their gradients.
        keeps: one mask per tensor, true (or ``1``) for the entries kept.

    Raises:
        ValueError: if the two sequences differ in length, or a mask's shape differs from its tensor's.

    Example:
        >>> weights = [torch.tensor([1.5, float("inf"), -2.0]), torch.tensor([[float("nan"), 3.0]])]
        >>> masked_all_(weights, [torch.tensor([True, False, True]), torch.tensor([[0.0, 1.0]])])
        >>> weights
        [tensor([ 1.5000,  0.0000, -2.0000]), tensor([[0., 3.]])]
    """
    if len(values) != len(keeps):
        raise ValueError(f"masked_all_ needs one mask per tensor: got {len(values)} tensors and {len(keeps)} masks")
    batched: dict[torch.dtype, list[tuple[Tensor, Tensor]]] = {}
    with torch.no_grad():
        for value, keep in zip(values, keeps, strict=True):
            if keep.shape != value.shape:
                raise ValueError(f"a mask of shape {tuple(keep.shape)} for a tensor of shape {tuple(value.shape)}")
            bits = _batchable_bits(value, keep)
            if bits is not None:
                flat_keep = keep.view(-1).view(torch.uint8) if keep.dtype == torch.bool else keep.view(-1)
                batched.setdefault(bits, []).append((value.view(-1).view(bits), flat_keep))
            elif value.numel():
                condition = keep if keep.dtype == torch.bool else keep != 0
                torch.where(condition, value, torch.zeros((), dtype=value.dtype, device=value.device), out=value)
        for bits, pairs in batched.items():
            _multiply_in_batches(pairs, _scratch_of(bits))


_BATCHED_BITS = {
    dtype: _BITS[torch.finfo(dtype).bits // 8]
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)
}
"""The floating dtypes :func:`masked_all_` batches, and the integer dtype of their width."""


def _batchable_bits(value: Tensor, keep: Tensor) -> torch.dtype | None:
    """The integer dtype :func:`masked_all_` multiplies ``value``'s bits in on the CPU, or ``None`` (torch.where)."""
    if value.is_cpu and value.is_contiguous() and type(value) in _PLAIN_TYPES and _batchable_mask(keep, value.dtype):
        return _BATCHED_BITS[value.dtype]
    return None


def _scratch_of(bits: torch.dtype) -> Tensor:
    """This thread's reusable ``MASK_CHUNK``-entry buffer of integer dtype ``bits``."""
    buffers: dict[torch.dtype, Tensor] = _scratch.__dict__.setdefault("buffers", {})
    buffer = buffers.get(bits)
    if buffer is None or buffer.numel() != MASK_CHUNK:
        buffer = buffers[bits] = torch.empty(MASK_CHUNK, dtype=bits)
    return buffer


def _cut(numels: Sequence[int], chunk: int) -> list[list[tuple[int, int, int]]]:
    """Batches of at most ``chunk`` entries: ``(tensor index, start, size)`` pieces, small tensors packed together,
    large ones cut (empty tensors take no piece)."""
    batches: list[list[tuple[int, int, int]]] = []
    batch: list[tuple[int, int, int]] = []
    used = 0
    for index, numel in enumerate(numels):
        for start in range(0, numel, chunk):
            size = min(chunk, numel - start)
            if used + size > chunk:
                batches.append(batch)
                batch, used = [], 0
            batch.append((index, start, size))
            used += size
    if batch:
        batches.append(batch)
    return batches


def _multiply_in_batches(pairs: list[tuple[Tensor, Tensor]], scratch: Tensor) -> None:
    """Multiply each flat integer view by its flat mask (``0`` / ``1``), widened through ``scratch`` in batches."""
    for batch in _cut([bits.numel() for bits, _ in pairs], scratch.numel()):
        targets, masks = [], []
        for index, start, size in batch:
            bits, keep = pairs[index]
            whole = size == bits.numel()  # the usual case: no slicing
            targets.append(bits if whole else bits[start : start + size])
            masks.append(keep if whole else keep[start : start + size])
        _multiply_batch(targets, masks, scratch)


def _multiply_batch(targets: list[Tensor], masks: list[Tensor], scratch: Tensor) -> None:
    """``targets[i] *= masks[i]`` in the targets' integer dtype, the masks widened into consecutive scratch slices."""
    widened, offset = [], 0
    for mask in masks:
        widened.append(scratch[offset : offset + mask.numel()])
        offset += mask.numel()
    torch._foreach_copy_(widened, masks)  # 0 or 1, in the value's width
    torch._foreach_mul_(targets, widened)  # the bits kept, or +0


class MaskPlan:
    """:func:`masked_all_` with fixed masks, prepared once: for tensors zeroed at every step by the same masks.

    :func:`masked_all_` works out, at every call, which tensors it can batch, their flat integer views, how they are
    cut and packed into scratch-sized batches and the scratch slices their masks are widened into: Python work
    that costs about as much as the passes themselves on a small model. A plan does it once for ``keeps`` and tensors
    of ``dtypes``; :meth:`apply_` then checks each tensor cheaply and runs the two multi-tensor calls per batch. The
    result is :func:`masked_all_`'s, bit for bit; tensors the plan does not fit (another dtype, shape or layout, a
    mask that cannot be batched) go through :func:`masked_all_` itself. The masks are read at every call, so
    changing their values in place is seen; replacing a mask tensor needs a new plan. With ``keep_widened_bytes``,
    masks whose widened copies take at most that many bytes in all are widened once, at the first call, into
    buffers of the plan's own: each later call is one multi-tensor multiply per dtype, and changing a mask's values
    in place is not seen (make a new plan).

    Args:
        keeps: one mask per tensor, as :func:`masked_all_` takes them.
        dtypes: the dtype of the tensors each mask will be applied to.
        keep_widened_bytes: the most memory the plan may keep for widened masks (``0``: none, widen at every call
            through this thread's ``MASK_CHUNK`` scratch).

    Example:
        >>> keeps = [torch.tensor([True, False, True]), torch.tensor([[False, True]])]
        >>> plan = MaskPlan(keeps, [torch.float32, torch.float32])
        >>> grads = [torch.tensor([1.5, float("nan"), -2.0]), torch.tensor([[float("inf"), 3.0]])]
        >>> plan.apply_(grads)
        >>> grads
        [tensor([ 1.5000,  0.0000, -2.0000]), tensor([[0., 3.]])]
        >>> plan.apply_([None, torch.ones(1, 2)])  # a missing tensor (a Parameter without a gradient) is skipped
    """

    def __init__(self, keeps: Sequence[Tensor], dtypes: Sequence[torch.dtype], *, keep_widened_bytes: int = 0) -> None:
        if len(keeps) != len(dtypes):
            raise ValueError(f"MaskPlan needs one dtype per mask: got {len(keeps)} masks and {len(dtypes)} dtypes")
        if keep_widened_bytes < 0:
            raise ValueError(f"keep_widened_bytes must be >= 0, got {keep_widened_bytes}")
        self.keeps = list(keeps)
        self.dtypes = list(dtypes)
        self.keep_widened_bytes = keep_widened_bytes
        self._kept = False  # the widened masks are the plan's own, filled once (no copy per call)
        self._batchable = all(_batchable_mask(keep, dtype) for keep, dtype in zip(self.keeps, self.dtypes, strict=True))
        self._scratches: dict[torch.dtype, Tensor] = {}
        self._batches: list[tuple[torch.dtype, list[tuple[int, int, int, Tensor]], list[Tensor]]] = []

    def apply_(self, values: Sequence[Tensor | None]) -> None:
        """Zero every ``values[i]`` in place where ``keeps[i]`` is false, as :func:`masked_all_` does; ``None``
        entries are skipped.

        Raises:
            ValueError: if ``values`` and the plan's masks differ in length.
        """
        if len(values) != len(self.keeps):
            raise ValueError(f"a plan of {len(self.keeps)} masks applied to {len(values)} tensors")
        if not (self._batchable and self._fits(values)):
            present = [i for i, value in enumerate(values) if value is not None]
            masked_all_([values[i] for i in present], [self.keeps[i] for i in present])  # type: ignore[misc]
            return
        with torch.no_grad():
            for bits, pieces, widened in self._prepared():
                targets, masks = [], []
                for (index, start, size, keep), wide in zip(pieces, widened, strict=True):
                    value = values[index]
                    if value is None:
                        continue
                    target = value.view(bits)
                    if size != value.numel():  # a piece of a tensor larger than the scratch
                        target = target.view(-1)[start : start + size]
                    targets.append(target)
                    masks.append((keep, wide))
                if targets:
                    if not self._kept:
                        torch._foreach_copy_([wide for _, wide in masks], [keep for keep, _ in masks])
                    torch._foreach_mul_(targets, [wide for _, wide in masks])

    def _fits(self, values: Sequence[Tensor | None]) -> bool:
        """Whether every present tensor is one the plan was made for: a plain contiguous CPU tensor of its dtype and
        its mask's shape."""
        for value, keep, dtype in zip(values, self.keeps, self.dtypes, strict=True):
            if value is not None and not (
                type(value) in _PLAIN_TYPES
                and value.dtype == dtype
                and value.is_cpu
                and value.is_contiguous()
                and value.shape == keep.shape
            ):
                return False
        return True

    def _prepared(self) -> list[tuple[torch.dtype, list[tuple[int, int, int, Tensor]], list[Tensor]]]:
        """The batches: integer dtype, ``(index, start, size, flat or shaped mask piece)`` and their scratch slices
        (made again when this thread's scratch buffers are not those they were cut from)."""
        if self._kept:
            return self._batches
        scratches = {bits: _scratch_of(bits) for bits in self._scratches} if self._batches else {}
        if self._batches and all(scratches[bits] is buffer for bits, buffer in self._scratches.items()):
            return self._batches
        by_bits: dict[torch.dtype, list[int]] = {}
        for index, dtype in enumerate(self.dtypes):
            by_bits.setdefault(_BATCHED_BITS[dtype], []).append(index)
        widened_bytes = sum(self.keeps[i].numel() * bits.itemsize for bits, indices in by_bits.items() for i in indices)
        self._kept = 0 < widened_bytes <= self.keep_widened_bytes
        self._scratches, self._batches = {}, []
        for bits, indices in by_bits.items():
            numels = [self.keeps[i].numel() for i in indices]
            if self._kept:  # the plan's own buffer, all of this dtype's masks in one batch
                scratch = torch.empty(max(sum(numels), 1), dtype=bits)
            else:
                scratch = self._scratches[bits] = _scratch_of(bits)
            for batch in _cut(numels, scratch.numel()):
                pieces, widened, offset = [], [], 0
                for position, start, size in batch:
                    index = indices[position]
                    keep = self.keeps[index]
                    flat = keep.view(torch.uint8) if keep.dtype == torch.bool else keep
                    if size == keep.numel():  # whole: shaped like the tensor, no slicing at apply time
                        pieces.append((index, start, size, flat))
                        widened.append(scratch[offset : offset + size].view(keep.shape))
                    else:
                        pieces.append((index, start, size, flat.reshape(-1)[start : start + size]))
                        widened.append(scratch[offset : offset + size])
                    offset += size
                self._batches.append((bits, pieces, widened))
                if self._kept:
                    torch._foreach_copy_(widened, [piece[3] for piece in pieces])
        return self._batches


def _batchable_mask(keep: Tensor, dtype: torch.dtype) -> bool:
    """Whether a :class:`MaskPlan` batches ``keep`` for tensors of ``dtype`` (as :func:`_batchable_bits` would)."""
    return (
        dtype in _BATCHED_BITS
        and keep.is_cpu
        and (keep.dtype == torch.bool or keep.is_floating_point())
        and keep.is_contiguous()
    )
