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

from lightprune.callback.masks import original

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

    def accumulate(self, parameters: Iterable[Tensor]) -> None:
        """Add ``-W * grad`` of the selected weights among ``parameters`` (an optimizer's) that have a gradient."""
        stepped = {id(p) for p in parameters}
        with torch.no_grad():
            for qualified, module, name in self.selection:
                weight = original(module, name)
                if id(weight) not in stepped or weight.grad is None:
                    continue
                total = self.totals.get(qualified)
                if total is None:
                    total = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
                    self.totals[qualified] = total
                total.addcmul_(weight.detach().to(torch.float32), weight.grad.to(torch.float32), value=-1)

    def scores(self, reduce: Callable[[Tensor], Tensor]) -> dict[str, Tensor]:
        """The scores of every selected weight (zeros where no step was taken), averaged across processes by
        ``reduce`` (a mean all-reduce; DDP's gradients, and so the scores, are the same on every rank already)."""
        found = {}
        for qualified, module, name in self.selection:
            weight = original(module, name)
            total = self.totals.get(qualified)
            if total is None:
                total = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            found[qualified] = reduce(total.clone())
        return found

    def reset(self) -> None:
        """Start a new sum (after an event, or when a fit starts)."""
        self.totals = {}

    def state_dict(self) -> dict[str, Any]:
        """The running sums, for a checkpoint."""
        return {"totals": dict(self.totals)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s sums, checked against the selection, onto the weights' devices."""
        expected = {q: original(module, name) for q, module, name in self.selection}
        totals = dict(state.get("totals", {}))
        for qualified, total in totals.items():
            if qualified not in expected or tuple(total.shape) != tuple(expected[qualified].shape):
                raise ValueError(f"the checkpoint's movement scores of {qualified!r} do not fit the selection")
        self.totals = {q: t.to(expected[q].device) for q, t in totals.items()}
