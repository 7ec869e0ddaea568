"""In-place masking: the selected tensors stay plain Parameters; the masks are kept apart and applied in place.

The reparametrization (``name_orig * name_mask`` recomputed before every forward, the product's gradient masked in
every backward) costs two weight-sized passes and a weight-sized copy per step. In place, a training step costs at
most one pass over the pruned gradients, as one call over all of them, and no weight pass where none is needed:

- Gradients: under automatic optimization, once per optimizer step when the gradients are final (accumulated over
  micro-batches, unscaled by AMP, reduced across DDP ranks), before clipping, gradient logging and the optimizer see
  them (Lightning calls callbacks' ``on_before_optimizer_step`` before it clips). Under manual optimization, and
  when used alone, also as each gradient is accumulated, so that the user's own ``clip_gradients`` before
  ``optimizer.step()`` sees masked gradients.
- Weights: optimizers whose update of an entry depends only on that entry's gradient and state, of these exact
  classes (not subclasses, which may override ``step``): :data:`ENTRYWISE_OPTIMIZERS`, ``torch.optim.SGD``
  (momentum, Nesterov, weight decay), ``Adam``, ``AdamW``, ``RMSprop`` and ``Adagrad``. A pruned entry is zero, its
  gradient is masked and the state its update is made of (momentum, Adam's first moment) is zeroed whenever masks
  change, so each step leaves it exactly zero: no weight pass runs after their steps. The second moments, which
  only divide, are left as they are (a square root of exact zeros is several times slower on CPUs). Every other
  optimizer (``Adamax``, ``NAdam``, ``RAdam``, ``Adadelta``, ``Rprop``, ``ASGD``, ``SparseAdam``, subclasses,
  optimizers of other packages) gets a weight pass after each of its steps. Rewinds and weight averages copied
  back are masked explicitly (:meth:`InPlaceMasks.after_rewrite`), and every training epoch starts with a weight
  pass; code of your own that writes the weights between steps (adding noise, say) must leave pruned entries at
  zero. Optimizers that replace the Trainer's mid-fit (``trainer.strategy.optimizers = [...]``) are followed before
  their first step.

For the optimizers of :data:`ENTRYWISE_OPTIMIZERS` the effective weights are those of the reparametrized mode, bit
for bit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from lightprune import prune
from lightprune.callback.mask_strategy import MaskStrategy, Pairs, mask_of, owner_in
from lightprune.callback.regrowth import zero_optimizer_state
from lightprune.prune.distributed import is_sharded, local_of
from lightprune.prune.functional import remove_masked
from lightprune.prune.masking import MaskPlan, masked_

if TYPE_CHECKING:
    from lightprune.callback.masked_selection import MaskedSelection

__all__ = ["ENTRYWISE_OPTIMIZERS", "InPlaceMasks", "needs_weight_pass"]

ENTRYWISE_OPTIMIZERS: dict[type[torch.optim.Optimizer], tuple[str, ...]] = {
    torch.optim.SGD: ("momentum_buffer",),
    torch.optim.Adam: ("exp_avg",),
    torch.optim.AdamW: ("exp_avg",),
    torch.optim.RMSprop: ("momentum_buffer", "grad_avg"),
    torch.optim.Adagrad: (),
}
"""Optimizer classes (exact types) whose step leaves an entry exactly zero when its value, its gradient and the state
named here are zero (whatever the other state: it only divides a zero update)."""


WIDENED_MASKS_BYTES = 4 << 20
"""The most memory an :class:`InPlaceMasks` keeps for its masks widened to the weights' width (4 MiB: a model of up to
about a million pruned float32 weights). Its masks change only through :meth:`InPlaceMasks.put` and
:meth:`InPlaceMasks.take`, which make a new plan, so the per-step pass can skip widening them again: on LeNet-300-100
that is half the pass. Larger models widen through a fixed scratch at every step (no weight-sized memory)."""


def _warn_unstepped(masked: MaskedSelection, optimizers: list[Any]) -> None:
    """Warn when no optimizer of the fit steps a selected tensor that requires grad: something else writes it (float32
    master copies copied back into a half-precision model, say), after the step passes that keep pruned entries at
    zero in place, so they come back until the next event. Frozen tensors (a LoRA base weight) are left alone."""
    from lightning.pytorch.utilities import rank_zero_warn

    if not optimizers:
        return
    held = {id(p) for optimizer in optimizers for group in optimizer.param_groups for p in group["params"]}
    unstepped = [
        qualified
        for qualified, module, name in masked.selection
        if (parameter := prune.original(module, name)).requires_grad and id(parameter) not in held
    ]
    if unstepped:
        rank_zero_warn(
            f"PruningCallback(masking='inplace'): no optimizer of the fit steps {unstepped[:4]}"
            f"{' ...' if len(unstepped) > 4 else ''}, which require grad. In place, pruned entries stay zero through "
            "the fit's optimizer steps; code that writes these weights otherwise (master copies copied back, say) "
            "brings them back until the next event. Use masking='reparametrize', which masks them at every forward.",
            category=UserWarning,
        )


def needs_weight_pass(optimizer: Any) -> bool:
    """Whether pruned weights must be zeroed again after ``optimizer``'s steps: unless its exact class is one of
    :data:`ENTRYWISE_OPTIMIZERS` (Lightning's wrapper is looked through).

    Example:
        >>> weight = [nn.Parameter(torch.ones(2))]
        >>> needs_weight_pass(torch.optim.Adam(weight)), needs_weight_pass(torch.optim.Adamax(weight))
        (False, True)
        >>> class MyAdam(torch.optim.Adam): ...
        >>> needs_weight_pass(MyAdam(weight))
        True
    """
    return type(getattr(optimizer, "optimizer", optimizer)) not in ENTRYWISE_OPTIMIZERS


class InPlaceMasks(MaskStrategy):
    """Masks held outside the model, applied to the weights and their gradients in place (see the module docstring).

    Parameters sharded as DTensor are masked on their local shards (:class:`~lightprune.callback.sharded.ShardedMasks`
    adds their events and checkpoints).

    Example:
        >>> layer = torch.nn.Linear(4, 2)
        >>> _ = prune.l1_unstructured(layer, "weight", amount=4)
        >>> masks = InPlaceMasks()
        >>> masks.take([(layer, "weight")])  # back to a plain Parameter; the mask is kept here
        >>> prune.is_pruned(layer), int((layer.weight == 0).sum())
        (False, 4)
        >>> layer(torch.randn(3, 4)).sum().backward()
        >>> int((layer.weight.grad == 0).sum())  # masked as soon as it was accumulated
        4
        >>> masks.remove_hooks()
    """

    def __init__(self) -> None:
        self._entries: dict[tuple[int, str], tuple[nn.Module, str, Tensor]] = {}
        self._by_parameter: dict[int, tuple[nn.Parameter, Tensor]] = {}
        self._handles: dict[int, Any] = {}
        self._optimizers: list[Any] = []  # whose state of pruned entries is zeroed when masks change
        self._plan: MaskPlan | None = None  # the masks prepared for the per-step passes, made again when they change
        self._parameters: list[nn.Parameter] = []  # the masked Parameters, in the plan's order
        self._sharded = False  # some of them are DTensors: mask their local shards
        self.hook_grads = True  # mask each gradient as it is accumulated (standalone, manual optimization)
        self.weight_pass = True  # zero the pruned weights after every optimizer step

    # ------------------------------------------------------------------------------------------------------------
    # The masks
    # ------------------------------------------------------------------------------------------------------------

    def mask(self, module: nn.Module, name: str) -> Tensor | None:
        """The mask kept here for ``module.<name>`` (or its reparametrization's during :meth:`editing`), if any."""
        entry = self._entries.get((id(module), name))
        return mask_of(module, name) if entry is None else entry[2]

    def take(self, pairs: Iterable[tuple[nn.Module, str]]) -> None:
        """Move the masks of these reparametrized tensors here and make them plain Parameters again (zeros where
        pruned); their gradients are masked from now on."""
        for module, name in pairs:
            mask = mask_of(module, name)
            if mask is None:
                continue
            parameter = prune.original(module, name)
            remove_masked(module, name)  # orig * mask in place: no new weight-sized tensor
            self._keep(module, name, parameter, mask)

    def put(self, module: nn.Module, name: str, mask: Tensor) -> None:
        """Keep ``mask`` for the plain (or DTensor) Parameter ``module.<name>`` and zero it where pruned now.

        For a DTensor (a sharded parameter), ``mask`` is the mask of this rank's local shard: the reparametrization
        never applies to it, and weights and gradients are masked on the local shard.
        """
        parameter = prune.original(module, name)
        self._keep(module, name, parameter, mask)
        with torch.no_grad():
            masked_(local_of(parameter), mask)

    def _keep(self, module: nn.Module, name: str, parameter: nn.Parameter, mask: Tensor) -> None:
        self._entries[(id(module), name)] = (module, name, mask)
        self._by_parameter[id(parameter)] = (parameter, mask)
        self._plan = None
        if self.hook_grads:
            self._watch_grad(parameter)
        self._zero_update_state(parameter, mask)

    def _zero_update_state(self, parameter: Tensor, mask: Tensor) -> None:
        """Zero, where pruned, the optimizer state an entrywise optimizer's update is made of, so its steps leave
        pruned entries at zero (other optimizers' state is left alone: a weight pass follows their steps)."""
        for optimizer in self._optimizers:
            keys = ENTRYWISE_OPTIMIZERS.get(type(getattr(optimizer, "optimizer", optimizer)))
            if keys:
                zero_optimizer_state([optimizer], parameter, ~mask.bool(), keys)

    def give_back(self) -> list[tuple[nn.Module, str, Tensor]]:
        """Put every mask back under the reparametrization (for an event) and forget them here; returns them."""
        entries = list(self._entries.values())
        for module, name, mask in entries:
            prune.custom_from_mask(module, name, mask=mask, mask_dtype=mask.dtype)
        self._entries.clear()
        self._by_parameter.clear()
        self._plan = None
        return entries

    @contextlib.contextmanager
    def editing(self, pairs: Pairs) -> Iterator[None]:
        """Put the reparametrization back for the block (an event, a restore), all or nothing; take it away after."""
        self.give_back()
        try:
            with prune.transaction(pairs):
                yield
        finally:
            self.take(pairs)

    def share_with_averages(self, masked: MaskedSelection, averages: list[nn.Module]) -> None:
        """The averaged copies stay plain too: zero their pruned entries now (an event's new masks must hold in a
        checkpoint or a validation run of the same step), and again after every rewrite (:meth:`after_rewrite`)."""
        self._mask_averages(masked)

    # ------------------------------------------------------------------------------------------------------------
    # Training steps
    # ------------------------------------------------------------------------------------------------------------

    def apply(self) -> None:
        """Zero the pruned entries of every masked Parameter: one weight pass."""
        plan = self._prepared()
        with torch.no_grad():
            plan.apply_([local_of(p) for p in self._parameters] if self._sharded else self._parameters)

    def mask_grads(self) -> None:
        """Zero the pruned entries of every gradient: one pass, one call over all pruned gradients."""
        plan = self._prepared()
        if self._sharded:
            plan.apply_([None if p.grad is None else local_of(p.grad) for p in self._parameters])
        else:
            plan.apply_([p.grad for p in self._parameters])

    def _prepared(self) -> MaskPlan:
        """The masks and Parameters in a fixed order, prepared for the per-step passes (once per change of masks)."""
        if self._plan is None:
            self._parameters = [parameter for parameter, _ in self._by_parameter.values()]
            self._sharded = any(is_sharded(parameter) for parameter in self._parameters)
            locals_ = [local_of(parameter) for parameter in self._parameters]
            masks = [mask for _, mask in self._by_parameter.values()]
            self._plan = MaskPlan(masks, [local.dtype for local in locals_], keep_widened_bytes=WIDENED_MASKS_BYTES)
        return self._plan

    def _watch_grad(self, parameter: Tensor) -> None:
        """Mask the gradient of ``parameter`` as soon as it is accumulated (a frozen Parameter, such as the base
        weight under a LoRA adapter, has none to mask)."""
        if parameter.requires_grad and id(parameter) not in self._handles:
            self._handles[id(parameter)] = parameter.register_post_accumulate_grad_hook(self._mask_grad)

    def _mask_grad(self, parameter: Tensor) -> None:
        entry = self._by_parameter.get(id(parameter))
        if entry is not None and parameter.grad is not None:
            masked_(local_of(parameter.grad), entry[1])

    def follow_parameters(self) -> None:
        """Move each mask held here to its Parameter's device (for a DTensor: its local shard's), where it moved.

        Example:
            >>> layer = torch.nn.Linear(4, 2)
            >>> masks = InPlaceMasks()
            >>> masks.put(layer, "weight", torch.ones(2, 4, dtype=torch.bool))
            >>> _ = layer.to("meta")
            >>> masks.follow_parameters()
            >>> masks.mask(layer, "weight").device.type
            'meta'
        """
        for key, (module, name, mask) in list(self._entries.items()):
            parameter = prune.original(module, name)
            device = local_of(parameter).device
            if mask.device != device:
                mask = mask.to(device)
                self._entries[key] = (module, name, mask)
                self._by_parameter[id(parameter)] = (parameter, mask)
                self._plan = None

    def remove_hooks(self) -> None:
        """Stop masking gradients as they are accumulated; the masks stay readable."""
        for handle in self._handles.values():
            handle.remove()
        self._handles.clear()

    def attach(self, trainer: Any, pl_module: Any, masked: MaskedSelection) -> list[Any]:
        """Training starts: decide the per-step passes (see the module docstring) and zero the optimizer state of the
        pruned entries (a resumed fit brings back state saved by either mode); returns the step hooks' handles."""
        from lightprune.callback import neighbours

        self._optimizers = list(trainer.optimizers)
        self.weight_pass = any(needs_weight_pass(optimizer) for optimizer in self._optimizers)
        _warn_unstepped(masked, self._optimizers)
        self.hook_grads = not pl_module.automatic_optimization
        if self.hook_grads:
            for parameter, _ in self._by_parameter.values():
                self._watch_grad(parameter)
        else:
            self.remove_hooks()
        for parameter, mask in self._by_parameter.values():
            self._zero_update_state(parameter, mask)
        return neighbours.mask_after_optimizer_steps(trainer, pl_module, lambda: self.after_optimizer_step(masked))

    def before_optimizer_step(self) -> None:
        """The gradients are final: mask them (one pass over all of them)."""
        self.mask_grads()

    def after_optimizer_step(self, masked: MaskedSelection) -> None:
        """After an optimizer step: a weight pass, unless every optimizer leaves pruned entries at zero."""
        if self.weight_pass:
            self.after_rewrite(masked)

    def after_rewrite(self, masked: MaskedSelection) -> None:
        """Zero the pruned entries of the weights and of the averaged copies' weights."""
        self.apply()
        self._mask_averages(masked)

    def _mask_averages(self, masked: MaskedSelection) -> None:
        """Zero the pruned entries of the averaged copies' weights."""
        with torch.no_grad():
            for average in masked.averages:
                for qualified, module, name in masked.named_pairs():
                    mask = self.mask(module, name)
                    if mask is not None:
                        weight = getattr(owner_in(average, qualified), name)
                        masked_(weight, mask.to(weight.device))

    def finish(self, masked: MaskedSelection, make_permanent: bool) -> None:
        """End of fit, whatever ``make_permanent`` says: zero the weights a last time and stop masking gradients."""
        self.after_rewrite(masked)
        self.remove_hooks()
        self._optimizers = []
