"""Calibration statistics of the units: what reaches each consuming projection, feature by feature.

A unit's output is an input feature of the projection that reads it (an MLP's output projection, an attention's
output projection), so one forward pre-hook per consuming projection sees every unit. :class:`Moments` holds the
token count, the sum and the sum of squares of each feature and, for a least-squares refit, the sum of outer
products ``X^T X``. Moments add: sums from several batches or several processes (an all-reduce of each tensor) are
the moments of the union. :func:`collect_moments` records them with :class:`lightprune.statistics.InputStatistics`,
the collector the callback's activation and OBS statistics use (there with the padding rule, the all-reduce and the
checkpoint state).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightprune import prune
from lightprune.layouts import feature_layout, input_dim
from lightprune.statistics import InputStatistics, feature_sums
from lightprune.structure.units import UnitError, UnitGroup

__all__ = ["Moments", "collect_moments"]

NEVER_CALLED = (
    "its forward never ran (a parent computing with its weight, as nn.MultiheadAttention does with out_proj), so its "
    "inputs cannot be recorded"
)
"""Why a module's input moments can be empty: said by the refit and the activation ranking, which refuse them."""


@dataclass
class Moments:
    """Per-feature moments of the inputs a projection received.

    Attributes:
        count: tokens seen.
        total: sum of each feature, shape ``(features,)``.
        squares: sum of each feature's square, shape ``(features,)``.
        outer: sum of ``x x^T`` over tokens, shape ``(features, features)``, or ``None`` when not collected.

    Example:
        >>> moments = Moments.empty(2, outer=True)
        >>> moments.add(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
        >>> moments.count, moments.mean.tolist(), moments.squares.tolist()
        (2, [2.0, 3.0], [10.0, 20.0])
        >>> moments.outer.tolist()
        [[10.0, 14.0], [14.0, 20.0]]
    """

    count: int
    total: Tensor
    squares: Tensor
    outer: Tensor | None = field(default=None)

    @classmethod
    def empty(cls, features: int, *, outer: bool = False, device: Any = None) -> Moments:
        """Zero moments of ``features`` features (float64 sums, so long runs stay exact enough for a refit)."""
        zeros = torch.zeros(features, dtype=torch.float64, device=device)
        square = torch.zeros(features, features, dtype=torch.float64, device=device) if outer else None
        return cls(0, zeros, zeros.clone(), square)

    def add(self, inputs: Tensor) -> None:
        """Add a batch of inputs whose last dim is the features (every other dim counts as tokens)."""
        x = inputs.detach().reshape(-1, inputs.shape[-1]).to(self.total.device, torch.float64)
        self.count += x.shape[0]
        self.total += x.sum(0)
        self.squares += x.square().sum(0)
        if self.outer is not None:
            self.outer += x.T @ x

    @classmethod
    def of(cls, sums: Mapping[str, Tensor]) -> Moments:
        """The moments of :func:`lightprune.statistics.feature_sums`' statistics (``moments=True``): ``"tokens"``,
        ``"sum"``, ``"squares"`` and, when collected, ``"outer"``.

        Example:
            >>> Moments.of({"tokens": torch.tensor([2.0]), "sum": torch.ones(1), "squares": torch.ones(1)}).count
            2
        """
        outer = sums.get("outer")
        return cls(
            round(float(sums["tokens"])),
            sums["sum"].double(),
            sums["squares"].double(),
            None if outer is None else outer.double(),
        )

    @property
    def mean(self) -> Tensor:
        """The mean of each feature."""
        return self.total / max(self.count, 1)

    @property
    def norms(self) -> Tensor:
        """The L2 norm of each feature over every token seen (what activation importance multiplies weights by)."""
        return self.squares.sqrt()


def _consumer_modules(model: nn.Module, groups: Sequence[UnitGroup]) -> dict[str, nn.Module]:
    consumers: dict[str, nn.Module] = {}
    for group in groups:
        for piece in group.consume:
            module = model.get_submodule(piece.module)
            if feature_layout(module, "weight") != "last":
                raise UnitError(
                    f"{piece.module!r} ({type(module).__name__}) reads the units of {group.module!r} without calling "
                    "a Linear or Conv1D forward; its inputs cannot be recorded for activation statistics"
                )
            consumers[piece.module] = module
    return consumers


def collect_moments(
    model: nn.Module,
    groups: Sequence[UnitGroup],
    batches: Iterable[Any],
    *,
    outer: bool = False,
    run: Callable[[nn.Module, Any], Any] | None = None,
) -> dict[str, Moments]:
    """Run ``model`` on ``batches`` (no gradients) and record the inputs of every projection that reads units.

    Args:
        model: the model the groups were found in.
        groups: the unit groups (their consuming projections are recorded).
        batches: the calibration batches.
        outer: also collect ``X^T X`` (needed by :func:`~lightprune.structure.refit_consumers`).
        run: how to run one batch (default: a dict as keyword arguments, a tuple or list as positional ones, anything
            else as the single argument).

    Returns:
        ``{consuming module's qualified name: Moments}``.

    Raises:
        UnitError: a consuming projection is not a Linear or Conv1D called through its forward, or recorded nothing.

    Example:
        >>> from lightprune.structure import find_units
        >>> mlp = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 4))
        >>> groups = find_units(mlp, (torch.randn(2, 4),))
        >>> stats = collect_moments(mlp, groups, [torch.randn(3, 4), torch.randn(5, 4)])
        >>> stats["2"].count, bool((stats["2"].total >= 0).all())
        (8, True)
    """
    consumers = _consumer_modules(model, groups)
    collector = InputStatistics(
        [
            feature_sums(name, module, _features(module), moments=True, outer=outer, dtype=torch.float64)
            for name, module in consumers.items()
        ]
    )
    collector.start()
    try:
        with torch.no_grad():
            for batch in batches:
                if run is not None:
                    run(model, batch)
                elif isinstance(batch, dict):
                    model(**batch)
                elif isinstance(batch, (tuple, list)):
                    model(*batch)
                else:
                    model(batch)
        collector.finish_batch(lambda flat: flat)  # one process: the sums are the totals
    finally:
        collector.stop()
    missing = [name for name in consumers if collector.calls.get(name, 0) == 0]
    if missing:
        raise UnitError(f"no inputs reached {missing!r} during calibration: its forward was never called")
    return {name: Moments.of(collector.totals[name]) for name in consumers}


def _features(module: nn.Module) -> int:
    return prune.original(module, "weight").shape[input_dim(module)]
