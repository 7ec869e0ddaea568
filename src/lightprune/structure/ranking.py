"""Scores of units and exact masks: which neurons and heads go, applied through ``lightprune.prune``.

Scores (higher keeps):

* ``"magnitude"``: the L2 norm of all the unit's weights (its rows, bias entries and output columns);
* ``"activation"``: the norm of the unit's output over the calibration tokens times the norm of its output columns,
  ``||a_u||_2 * ||W_out[:, u]||_2`` (from :func:`~lightprune.structure.collect_moments`);
* ``"taylor"``: first-order Taylor, ``|sum(w * g)|`` over the unit's weights (from the parameters' ``.grad`` or
  given gradients);
* a callable ``(model, group) -> Tensor[count]``.

Selection is exact: with ``scope="layerwise"`` every group loses ``round(amount * count)`` units (a float) or
``amount`` (an int); with ``scope="global"`` the lowest-scoring units across all groups of one kind go, each group
keeping at least one. Ties go to the lower index. Masks are set with :func:`lightprune.prune.custom_from_mask`, so
every pruned tensor is an ordinary pruned tensor (``name_orig``, ``name_mask``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor, nn

from lightprune import prune
from lightprune.prune.amount import _compute_nparams_toprune, validate_amount
from lightprune.structure.statistics import NEVER_CALLED, Moments
from lightprune.structure.units import Slice, UnitGroup

__all__ = ["IMPORTANCES", "SCOPES", "check_unit_amount", "group_masks", "prune_units", "unit_scores"]

IMPORTANCES = ("magnitude", "activation", "taylor")
SCOPES = ("layerwise", "global")
Importance = str | Callable[[nn.Module, UnitGroup], Tensor]


def _per_unit(values: Tensor, piece: Slice, count: int) -> Tensor:
    """``values`` (shaped like the parameter) cut into ``(count, rest)``: one row per unit."""
    block = values.narrow(piece.dim, piece.offset, count * piece.per_unit).movedim(piece.dim, 0)
    return block.reshape(count, -1)


def _weight(model: nn.Module, piece: Slice) -> Tensor:
    return getattr(model.get_submodule(piece.module), piece.name).detach()


def unit_scores(
    model: nn.Module,
    group: UnitGroup,
    importance: Importance = "magnitude",
    *,
    moments: Mapping[str, Moments] | None = None,
    gradients: Mapping[str, Tensor] | None = None,
) -> Tensor:
    """One score per unit of ``group`` (higher keeps), in float64.

    Args:
        model: the model.
        group: the unit group.
        importance: ``"magnitude"``, ``"activation"``, ``"taylor"`` or a callable ``(model, group) -> scores``.
        moments: ``"activation"``: the consuming projections' input moments.
        gradients: ``"taylor"``: gradients by qualified parameter name (default: each parameter's ``.grad``).

    Example:
        >>> from lightprune.structure import find_units
        >>> mlp = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
        >>> with torch.no_grad():
        ...     _ = mlp[0].weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 0.0], [3.0, 4.0]]))
        ...     _ = mlp[0].bias.zero_()
        ...     _ = mlp[2].weight.zero_()
        >>> unit_scores(mlp, find_units(mlp, (torch.randn(1, 2),))[0]).tolist()
        [1.0, 0.0, 5.0]
    """
    if callable(importance):
        scores = torch.as_tensor(importance(model, group), dtype=torch.float64).flatten()
        if scores.numel() != group.count:
            raise ValueError(f"the importance callable gave {scores.numel()} scores for {group.count} units")
        return scores
    if importance == "magnitude":
        squares = [_per_unit(_weight(model, p), p, group.count).double().square().sum(1) for p in group.slices]
        return torch.stack(squares).sum(0).sqrt().cpu()
    if importance == "activation":
        if moments is None:
            raise ValueError('importance="activation" needs the moments of the calibration inputs (collect_moments)')
        score = torch.ones(group.count, dtype=torch.float64)
        for piece in group.consume:
            if piece.module not in moments:
                raise ValueError(f"no activation moments for {piece.module!r}; collect them with collect_moments")
            if moments[piece.module].count == 0:  # (every score would be 0: the units pruned by index)
                raise ValueError(f"no input of {piece.module!r} was recorded: {NEVER_CALLED}")
            norms = moments[piece.module].squares.cpu().narrow(0, piece.offset, group.count * piece.per_unit)
            weights = _per_unit(_weight(model, piece), piece, group.count).double().cpu()
            score = score * norms.reshape(group.count, -1).sum(1).sqrt() * weights.square().sum(1).sqrt()
        return score
    if importance == "taylor":
        total = torch.zeros(group.count, dtype=torch.float64)
        for piece in group.slices:
            module = model.get_submodule(piece.module)
            param = prune.original(module, piece.name)
            key = f"{piece.module}.{piece.name}" if piece.module else piece.name
            grad = gradients.get(key) if gradients is not None else param.grad
            if grad is None:
                raise ValueError(f'importance="taylor" needs the gradient of {key!r}; run a backward pass first')
            product = _per_unit(param.detach() * grad.detach(), piece, group.count).double().cpu()
            total += product.sum(1)
        return total.abs()
    raise ValueError(f"unknown importance {importance!r}; allowed: {list(IMPORTANCES)} or a callable")


def group_masks(model: nn.Module, group: UnitGroup, keep: Tensor) -> dict[tuple[str, str], Tensor]:
    """Boolean masks of the parameters of ``group`` that prune the units where ``keep`` is False.

    Example:
        >>> from lightprune.structure import find_units
        >>> mlp = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
        >>> group = find_units(mlp, (torch.randn(1, 2),))[0]
        >>> masks = group_masks(mlp, group, torch.tensor([True, False, True]))
        >>> masks[("0", "bias")].tolist(), masks[("2", "weight")].tolist()
        ([True, False, True], [[True, False, True]])
    """
    keep = torch.as_tensor(keep, dtype=torch.bool).cpu()
    if keep.shape != (group.count,):
        raise ValueError(f"keep must have one entry per unit ({group.count}), got shape {tuple(keep.shape)}")
    masks: dict[tuple[str, str], Tensor] = {}
    for piece in group.slices:
        key = (piece.module, piece.name)
        if key not in masks:
            shape = _weight(model, piece).shape
            masks[key] = torch.ones(shape, dtype=torch.bool)
        line = torch.ones(masks[key].shape[piece.dim], dtype=torch.bool)
        line[piece.offset : piece.offset + group.count * piece.per_unit] = keep.repeat_interleave(piece.per_unit)
        view = [1] * masks[key].dim()
        view[piece.dim] = -1
        masks[key] &= line.reshape(view)
    return masks


def check_unit_amount(groups: Sequence[UnitGroup], amount: int | float, scope: str = "layerwise") -> None:
    """Refuse an ``amount`` that would prune every unit of a group: of each group (``"layerwise"``) or of all of
    them together, every group keeping its best unit (``"global"``).

    Raises:
        ValueError: naming the amount and the group (layerwise) or the counts (global).

    Example:
        >>> group = UnitGroup("neurons", "mlp", 4, 1, (), ())
        >>> check_unit_amount([group], 0.5)
        >>> check_unit_amount([group], 0.9)
        Traceback (most recent call last):
        ...
        ValueError: amount=0.9 prunes all 4 neurons of 'mlp'; keep at least one
    """
    if scope == "layerwise":
        for group in groups:
            if _compute_nparams_toprune(amount, group.count) >= group.count:
                raise ValueError(
                    f"amount={amount!r} prunes all {group.count} {group.kind} of {group.module!r}; keep at least one"
                )
        return
    total = sum(group.count for group in groups)
    target = _compute_nparams_toprune(amount, total)
    if target > total - len(groups):
        raise ValueError(f"amount={amount!r} prunes {target} of {total} units; every group must keep at least one")


def _rank_key(value: float, pruned: bool) -> tuple[int, int, float]:
    """A unit's place in the ranking, lowest pruned first: units already pruned below every live one (whatever the
    scores' sign), then by score, NaN above ``+inf`` (as the engine ranks it; ``float`` NaN compares with nothing)."""
    nan = math.isnan(value)
    return (0 if pruned else 1, int(nan), 0.0 if nan else value)


def _keys(values: Tensor, pruned: Tensor) -> list[tuple[int, int, float]]:
    return [_rank_key(v, p) for v, p in zip(values.tolist(), pruned.tolist(), strict=True)]


def _ranking(values: Tensor, pruned: Tensor) -> list[int]:
    """The units of one group from the first to prune to the last, ties by index."""
    keys = _keys(values, pruned)
    return sorted(range(len(keys)), key=lambda i: (keys[i], i))


def _prune_counts(
    groups: Sequence[UnitGroup], scores: list[Tensor], pruned: list[Tensor], amount: int | float, scope: str
) -> list[int]:
    check_unit_amount(groups, amount, scope)
    if scope == "layerwise":
        return [_compute_nparams_toprune(amount, group.count) for group in groups]
    total = sum(group.count for group in groups)
    target = _compute_nparams_toprune(amount, total)
    # each group's best unit is kept; the rest are ranked together, ties by (group, index)
    pool = []
    for g, (values, done) in enumerate(zip(scores, pruned, strict=True)):
        keys = _keys(values, done)
        best = max(range(len(keys)), key=lambda i: (keys[i], -i))  # (the first of the highest)
        pool += [(key, g, i) for i, key in enumerate(keys) if i != best]
    pool.sort()
    counts = [0] * len(groups)
    for _, g, _ in pool[:target]:
        counts[g] += 1
    return counts


def prune_units(
    model: nn.Module,
    groups: Sequence[UnitGroup],
    amount: int | float,
    *,
    importance: Importance = "magnitude",
    scope: str = "layerwise",
    moments: Mapping[str, Moments] | None = None,
    gradients: Mapping[str, Tensor] | None = None,
    mask_dtype: torch.dtype | None = torch.bool,
) -> list[Tensor]:
    """Prune the lowest-scoring units of ``groups`` with exact counts; returns each group's kept units (bool).

    Units already pruned (all their consumer columns zero) rank below every live unit, whatever the scores' sign, so
    a second call prunes further; a NaN score ranks above ``+inf`` (kept longest), as in :mod:`lightprune.prune`.
    All or nothing: if any mask cannot be applied, no parameter changes.

    Args:
        model: the model the groups were found in.
        groups: the unit groups (one kind or several; ``scope="global"`` ranks each kind on its own).
        amount: a float in ``[0, 1]`` (fraction of units) or an int (units), per group (layerwise) or in all (global).
        importance: see :func:`unit_scores`.
        scope: ``"layerwise"`` (every group alike) or ``"global"`` (one ranking per kind, per-group counts differ).
        moments: for ``importance="activation"``.
        gradients: for ``importance="taylor"``.
        mask_dtype: the dtype of new masks.

    Raises:
        ValueError: an unknown ``scope`` or ``importance``; an ``amount`` that is not a float in ``[0, 1]`` or an int
            ``>= 0`` (a bool, NaN or a non-number included), or that prunes every unit of a group.

    Example:
        >>> from lightprune.structure import find_units
        >>> mlp = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
        >>> groups = find_units(mlp, (torch.randn(1, 4),))
        >>> keep = prune_units(mlp, groups, 0.25)
        >>> int(keep[0].sum()), int((mlp[2].weight == 0).all(0).sum()), int((mlp[0].bias == 0).sum())
        (6, 2, 2)
    """
    if scope not in SCOPES:
        raise ValueError(f"unknown scope {scope!r}; allowed: {list(SCOPES)}")
    if isinstance(amount, bool) or not isinstance(amount, numbers.Real) or amount < 0:
        raise ValueError(f"amount must be a float in [0, 1] or a non-negative int, got {amount!r}")
    amount = int(amount) if isinstance(amount, numbers.Integral) else float(amount)  # NumPy scalars, as in torch
    if isinstance(amount, float) and amount > 1:
        raise ValueError(f"a float amount must be in [0, 1], got {amount!r}")
    validate_amount(amount)  # NaN slips through the comparisons above
    scores = [unit_scores(model, group, importance, moments=moments, gradients=gradients) for group in groups]
    pruned = [_already_pruned(model, group) for group in groups]  # (ranked below every live unit)
    counts: list[int] = [0] * len(groups)
    kinds = sorted({group.kind for group in groups})
    for kind in kinds:
        index = [i for i, group in enumerate(groups) if group.kind == kind]
        found = _prune_counts(
            [groups[i] for i in index], [scores[i] for i in index], [pruned[i] for i in index], amount, scope
        )
        for i, count in zip(index, found, strict=True):
            counts[i] = count
    keeps: list[Tensor] = []
    masks: dict[tuple[str, str], Tensor] = {}
    for group, values, done, count in zip(groups, scores, pruned, counts, strict=True):
        order = torch.tensor(_ranking(values, done), dtype=torch.long)
        keep = torch.ones(group.count, dtype=torch.bool)
        keep[order[:count]] = False
        keeps.append(keep)
        for key, mask in group_masks(model, group, keep).items():
            masks[key] = masks[key] & mask if key in masks else mask
    pairs = [(model.get_submodule(module), name) for module, name in masks]
    with prune.transaction(pairs):
        for (module, name), mask in masks.items():
            target = model.get_submodule(module)
            prune.custom_from_mask(target, name, mask.to(getattr(target, name).device), mask_dtype=mask_dtype)
    return keeps


def _already_pruned(model: nn.Module, group: UnitGroup) -> Tensor:
    """Units whose consumer columns are all zero: they contribute nothing already."""
    pruned = torch.ones(group.count, dtype=torch.bool)
    for piece in group.consume:
        pruned &= (_per_unit(_weight(model, piece), piece, group.count) == 0).all(1).cpu()
    return pruned
