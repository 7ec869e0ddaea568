"""Structured units in the callback: MLP neurons and attention heads found from the model, pruned group by group.

``PruningCallback(method="neurons")`` (or ``"heads"``) finds its unit groups when training starts with
:func:`lightprune.structure.find_units`, traced on example inputs taken from the first training batch (or given).
A :class:`UnitSelection` holds the groups' parameters (every row, bias entry and column of a unit is masked
together) and prunes them at each event to the schedule's target *fraction of units*: ``round(target * count)``
units of every group (``"layerwise"``), or of all groups of the kind together (``"global"``, each group keeping at
least one unit), with :func:`lightprune.structure.prune_units`. With ``reconstruct=True`` the consuming projections
are refit to the kept units by least squares (:func:`lightprune.structure.refit_consumers`) from the input moments
collected in the activation window.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn

from lightprune import prune
from lightprune._modes import eval_mode
from lightprune.callback.masked_selection import MaskedSelection
from lightprune.selection import compile_patterns, patterns_matching_none
from lightprune.statistics import paused
from lightprune.structure import Moments, UnitGroup, find_units, prune_units, refit_consumers
from lightprune.structure.ranking import _per_unit, check_unit_amount
from lightprune.structure.units import removal_problem

__all__ = ["UnitRanking", "UnitSelection", "example_from_batch", "find_groups"]

ExampleInputs = Callable[[Any], Any] | Mapping[str, Any] | Sequence[Any] | Tensor | None


@dataclass
class UnitRanking:
    """What ranks the units at one event: the criterion and the statistics it reads.

    Attributes:
        importance: ``"magnitude"``, ``"activation"``, ``"movement"`` or a callable ``(model, group) -> scores``.
        moments: the consuming projections' input moments (activation, reconstruct), by module name.
        movement: the accumulated ``-W * grad`` of every parameter of the groups, by qualified name (movement).
    """

    importance: Any
    moments: Mapping[str, Moments] | None = None
    movement: Mapping[str, Tensor] | None = None

    def engine_importance(self) -> Any:
        """The criterion as :func:`lightprune.structure.unit_scores` takes it (movement as a callable: first-order
        Taylor ``|sum over the unit's weights of the accumulated -W * grad|``)."""
        if self.importance != "movement":
            return self.importance
        movement = self.movement or {}

        def taylor(model: nn.Module, group: UnitGroup) -> Tensor:
            total = torch.zeros(group.count, dtype=torch.float64)
            for piece in group.slices:
                key = f"{piece.module}.{piece.name}" if piece.module else piece.name
                if key in movement:
                    total += _per_unit(movement[key], piece, group.count).double().sum(1).cpu()
            return total.abs()

        return taylor


def example_from_batch(batch: Any, example_inputs: ExampleInputs = None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` of one forward of the LightningModule, to find its units.

    By default from the batch: a dict is passed as keyword arguments (Hugging Face style), a tensor as the one
    argument, a tuple or list by its first element (``(inputs, targets)``). ``example_inputs`` overrides it: a callable
    ``batch -> inputs`` or fixed inputs, read by the same rule (a tuple is then all the positional arguments).

    Example:
        >>> example_from_batch((torch.ones(2, 3), torch.zeros(2)))[0][0].shape
        torch.Size([2, 3])
        >>> example_from_batch({"input_ids": torch.ones(1, 4)})[1]["input_ids"].shape
        torch.Size([1, 4])
        >>> example_from_batch(None, lambda batch: (torch.ones(1), torch.ones(2)))[0][1].shape
        torch.Size([2])
    """
    if example_inputs is None:
        inputs = batch[0] if isinstance(batch, (tuple, list)) else batch
    else:
        inputs = example_inputs(batch) if callable(example_inputs) else example_inputs
        if isinstance(inputs, (tuple, list)):
            return tuple(inputs), {}
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    if isinstance(inputs, Tensor):
        return (inputs,), {}
    raise ValueError(
        f"cannot build example inputs from a batch of {type(inputs).__name__}: give example_inputs (a callable "
        "batch -> inputs, or the inputs: a tensor, a tuple of positional arguments or a dict of keyword arguments)"
    )


def find_groups(
    model: nn.Module,
    kind: str,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    include: Sequence[str] | str | None = None,
    exclude: Sequence[str] | str | None = None,
) -> list[UnitGroup]:
    """The unit groups of ``kind`` in ``model`` (traced in eval mode, no gradients), filtered by the patterns: a
    pattern matches a group when it fully matches the group's module name (``"model.layers.0.mlp"``) or the name of
    a tensor the group slices (``"model.layers.0.mlp.up_proj.weight"``), so the patterns that select weights for the
    other methods select their units too. A pattern that matches no group is warned about, naming the groups.

    Raises:
        UnitError: the model has no such units (the message names the module), or the patterns leave none.

    Example:
        >>> mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> [(g.module, g.count) for g in find_groups(mlp, "neurons", (torch.ones(1, 4),), {})]
        [('', 8)]
    """
    from lightprune.structure import UnitError

    with eval_mode(model), torch.no_grad(), paused():  # the trace's forward is no training data for any recording
        groups = find_units(model, args, kwargs, kinds=(kind,))  # (an adapter's rank is no unit: left out there)
    included = compile_patterns("include", include)
    excluded = compile_patterns("exclude", exclude)
    names = {id(group): [group.module, *(_qualified(s.module, s.name) for s in group.produce + group.consume)]
             for group in groups}  # fmt: skip

    def matches(pattern: re.Pattern[str], group: UnitGroup) -> bool:
        return any(pattern.fullmatch(name) for name in names[id(group)])

    unmatched = patterns_matching_none(
        [name for group_names in names.values() for name in group_names], include, exclude
    )
    if unmatched:
        rank_zero_warn(
            f"{', '.join(unmatched)} matches none of the {kind} groups of {type(model).__name__} (their modules: "
            f"{[group.module for group in groups][:6]}; a pattern matches a module or a tensor name in full)",
            category=UserWarning,
        )
    kept = [
        group
        for group in groups
        if (not included or any(matches(p, group) for p in included)) and not any(matches(p, group) for p in excluded)
    ]
    if not kept:
        found = [group.module for group in groups]
        raise UnitError(f"include/exclude leave none of the {kind} groups of {type(model).__name__}: {found}")
    stuck = [(group.module, problem) for group in kept if (problem := removal_problem(model, group)) is not None]
    if stuck:  # (masked exactly all the same)
        rank_zero_warn(
            f"the {kind} of {[module for module, _ in stuck][:3]} ({len(stuck)} of {len(kept)} groups) can be masked "
            f"but not removed: {stuck[0][1]}. lightprune.export.remove_units will refuse them, so the model gets "
            "sparser, not smaller; exclude them to keep them whole",
            category=UserWarning,
        )
    return kept


def _qualified(module: str, name: str) -> str:
    return f"{module}.{name}" if module else name


class UnitSelection(MaskedSelection):
    """The parameters of unit groups and their masks, pruned unit by unit (see the module's docstring).

    Args:
        model: the model the groups were found in (names are relative to it).
        groups: the unit groups.
        scope: ``"layerwise"`` or ``"global"``.
        mask_dtype: dtype of new masks.
        seed: kept for the base class (ranking is deterministic: ties go to the lower index).
        reconstruct: refit the consuming projections to the kept units at every event.

    Example:
        >>> mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> groups = find_groups(mlp, "neurons", (torch.ones(1, 4),), {})
        >>> units = UnitSelection(mlp, groups, "layerwise", torch.bool, 0)
        >>> units.prune_to(0.5, event=0, scores=UnitRanking("magnitude"))
        >>> units.counts(), int((mlp[2].weight == 0).all(0).sum())
        ([(8, 4)], 4)
    """

    def __init__(
        self,
        model: nn.Module,
        groups: Sequence[UnitGroup],
        scope: str,
        mask_dtype: torch.dtype | None,
        seed: int,
        reconstruct: bool = False,
    ) -> None:
        triples: dict[str, tuple[str, nn.Module, str]] = {}
        for group in groups:
            for piece in group.slices:
                qualified = _qualified(piece.module, piece.name)
                triples.setdefault(qualified, (qualified, model.get_submodule(piece.module), piece.name))
        super().__init__(list(triples.values()), [], [], prune.CustomFromMask, {}, scope, mask_dtype, seed)
        self.model = model
        self.groups = list(groups)
        self.reconstruct = reconstruct

    def consumers(self) -> list[tuple[str, nn.Module, str]]:
        """``(qualified name, module, "weight")`` of every projection that reads units (their inputs are recorded)."""
        found: dict[str, tuple[str, nn.Module, str]] = {}
        for group in self.groups:
            for piece in group.consume:
                qualified = _qualified(piece.module, piece.name)
                found.setdefault(qualified, (qualified, self.model.get_submodule(piece.module), piece.name))
        return list(found.values())

    def _pruned(self, group: UnitGroup) -> int:
        """Units of ``group`` whose consumer columns are masked whole."""
        pruned = torch.ones(group.count, dtype=torch.bool)
        for piece in group.consume:
            mask = self.mask(self.model.get_submodule(piece.module), piece.name)
            if mask is None and self.permanent:
                mask = getattr(self.model.get_submodule(piece.module), piece.name).detach() != 0
            if mask is None:
                return 0
            pruned &= (_per_unit(mask, piece, group.count) == 0).all(1).cpu()
        return int(pruned.sum())

    def counts(self) -> list[tuple[int, int]]:
        """``(units, pruned units)`` of every group."""
        return [(group.count, self._pruned(group)) for group in self.groups]

    def collapsed(self) -> list[str]:
        """Always empty: every group keeps at least one unit (a target that would take all is refused)."""
        return []

    def prune_to(
        self, target: float, event: int, scores: Mapping[str, Tensor] | UnitRanking | None = None, signed: bool = False
    ) -> None:
        """Prune every group (layerwise) or every kind (global) to ``target`` of its units, as one event; refit the
        consumers when ``reconstruct``. ``scores`` is the event's :class:`UnitRanking` (magnitude when ``None``)."""
        if target <= 0:
            return  # an event at level 0 (a ramp's first) prunes nothing
        ranking = scores if isinstance(scores, UnitRanking) else UnitRanking("magnitude")
        importance = ranking.engine_importance()
        with self.all_or_nothing():
            if self.scope == "global":
                keeps = prune_units(
                    self.model, self.groups, target, importance=importance, scope="global",
                    moments=ranking.moments, mask_dtype=self.mask_dtype,
                )  # fmt: skip
            else:
                keeps = [
                    prune_units(
                        self.model, [group], target, importance=importance, moments=ranking.moments,
                        mask_dtype=self.mask_dtype,
                    )[0]
                    for group in self.groups
                ]  # fmt: skip
            if self.reconstruct:
                if ranking.moments is None:
                    raise ValueError("reconstruct=True needs the consumers' input moments of the window")
                refit_consumers(self.model, self.groups, keeps, ranking.moments)
            self.share_everywhere()

    def check_final(self, final: float) -> None:
        """Refuse, before training, a schedule whose final target would prune every unit of a group."""
        try:
            check_unit_amount(self.groups, final, self.scope if self.scope == "global" else "layerwise")
        except ValueError as err:
            raise ValueError(f"the schedule's final target {final}: {err}") from None

    def table_rows(self) -> list[tuple[str, tuple[int, ...], int, int]]:
        """``(group module, (count,), units, pruned)`` rows for the summary table."""
        names = [group.module or "<model>" for group in self.groups]
        rows = []
        for group, name, (units, pruned) in zip(self.groups, names, self.counts(), strict=True):
            if names.count(name) > 1:  # several MLP layers under one module: name the group by its first projection
                name = group.produce[0].module
            rows.append((f"{name} ({group.kind})", (group.count,), units, pruned))
        return rows
