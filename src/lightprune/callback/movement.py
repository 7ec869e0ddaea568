"""Movement importance (Sanh et al. 2020): ``S = -sum_t W * dL/dW`` over the optimizer steps since the last event.

A weight moving away from zero (its gradient pointing towards zero's opposite side) gains score; one moving towards
zero loses it. The sum is taken once per optimizer step, when the gradients are final (Lightning's
``on_before_optimizer_step``: accumulated over the micro-batches, unscaled under mixed precision, before clipping),
in float32. Scores are signed and rank by value (higher kept): the callback prunes with the signed variants of the
methods (:mod:`lightprune.prune.signed`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightprune import prune
from lightprune.prune.distributed import is_sharded, local_of

__all__ = ["MovementScores"]


class MovementScores:
    """The running movement scores of the selected weights.

    Example:
        >>> layer = nn.Linear(2, 1, bias=False)
        >>> with torch.no_grad():
        ...     _ = layer.weight.copy_(torch.tensor([[1.0, -2.0]]))
        >>> layer.weight.grad = torch.tensor([[0.5, 0.5]])
        >>> scores = MovementScores([("w", layer, "weight")])
        >>> scores.accumulate([layer.weight])
        >>> scores.scores(lambda t: t)["w"]
        tensor([[-0.5000,  1.0000]])
    """

    def __init__(self, selection: list[tuple[str, nn.Module, str]]) -> None:
        self.selection = selection
        self.totals: dict[str, Tensor] = {}
        self.pending: list[str] = []  # sums a distributed checkpoint holds beside the weights, not read yet

    def accumulate(self, parameters: Iterable[Tensor]) -> None:
        """Add ``-W * grad`` of the selected weights among ``parameters`` (an optimizer's) that have a gradient."""
        stepped = {id(p) for p in parameters}
        with torch.no_grad():
            for qualified, module, name in self.selection:
                weight = prune.original(module, name)
                if id(weight) not in stepped or weight.grad is None:
                    continue
                local, grad = local_of(weight.detach()), local_of(weight.grad)  # a DTensor's own shard
                total = self.totals.get(qualified)
                if total is None:
                    total = torch.zeros(local.shape, dtype=torch.float32, device=local.device)
                    self.totals[qualified] = total
                total.addcmul_(local.to(torch.float32), grad.to(torch.float32), value=-1)

    def scores(self, reduce: Callable[[Tensor], Tensor]) -> dict[str, Tensor]:
        """The scores of every selected weight (zeros where no step was taken), averaged across processes by
        ``reduce`` (a mean all-reduce; DDP's gradients, and so the scores, are the same on every rank already).

        A parameter sharded as DTensor has scores of its local shard's shape, not reduced: FSDP2 reduce-scatters the
        gradients, so each rank's shard of the sum is already the sum's."""
        found = {}
        for qualified, module, name in self.selection:
            weight = prune.original(module, name)
            local = local_of(weight)
            total = self.totals.get(qualified)
            if total is None:
                total = torch.zeros(local.shape, dtype=torch.float32, device=local.device)
            found[qualified] = total.clone() if is_sharded(weight) else reduce(total.clone())
        return found

    def follow_parameters(self) -> None:
        """Move each sum to its weight's device."""
        for qualified, module, name in self.selection:
            total = self.totals.get(qualified)
            if total is not None:
                self.totals[qualified] = total.to(local_of(prune.original(module, name)).device)

    def reset(self) -> None:
        """Start a new sum (after an event, or when a fit starts)."""
        self.totals = {}

    def state_dict(self) -> dict[str, Any]:
        """The running sums, for a checkpoint: those of a sharded weight as a DTensor of its layout (each rank's
        shard; :mod:`.sharded_movement` lays them out for the checkpoint's format)."""
        from lightprune.prune.distributed import as_dtensor

        weights = {q: prune.original(module, name) for q, module, name in self.selection}
        return {"totals": {q: as_dtensor(total, weights[q]) for q, total in self.totals.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s sums, checked against the selection, onto the weights' devices. The sums of
        a sharded weight come back as this rank's shard (from a DTensor, or the rows of a full tensor); those a
        distributed checkpoint holds beside the weights are named in ``state["sharded"]`` and wait in
        :attr:`pending` until they are read (:func:`~lightprune.callback.sharded_movement.load_sums`)."""
        from lightprune.prune.distributed import local_part

        expected = {q: prune.original(module, name) for q, module, name in self.selection}
        totals = dict(state.get("totals", {}))
        for qualified, total in totals.items():
            if qualified not in expected or tuple(total.shape) != tuple(expected[qualified].shape):
                raise ValueError(f"the checkpoint's movement scores of {qualified!r} do not fit the selection")
        self.pending = [str(name) for name in state.get("sharded", [])]
        restored = {}
        for qualified, total in totals.items():
            weight = expected[qualified]
            if is_sharded(total):
                total = local_of(total)
            elif is_sharded(weight):
                total = local_part(total, weight)
            restored[qualified] = total.to(local_of(weight).device, torch.float32)
        self.totals = restored
