"""Least-squares refit of the projections that read pruned units.

After units are pruned, the consuming projection ``y = W x + b`` sees only the kept features ``x_K``. Its kept
columns and bias are refit so that ``W'_K x_K + b'`` is the least-squares fit of the dense output ``W x + b`` on the
calibration inputs: with ``C`` the covariance of the inputs and ``mu`` their mean,
``W'_K = W C[:, K] (C[K, K] + lambda I)^-1`` and ``b' = b + W mu - W'_K mu_K`` (the bias absorbs the removed units'
mean contribution). Without a bias the uncentred second moment replaces ``C`` and nothing is absorbed.
``lambda`` is ``damp`` times the mean of the diagonal. ``W`` is the consumer's dense original (``name_orig`` of a
pruned weight); the new values are written into it, so its mask still zeroes the pruned columns.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from lightprune import prune
from lightprune.structure.statistics import NEVER_CALLED, Moments
from lightprune.structure.units import UnitGroup

__all__ = ["refit_consumers"]


def _kept_features(group: UnitGroup, keep: Tensor, features: int, piece_index: int) -> Tensor:
    piece = group.consume[piece_index]
    kept = torch.ones(features, dtype=torch.bool)
    block = keep.to(torch.bool).cpu().repeat_interleave(piece.per_unit)
    kept[piece.offset : piece.offset + block.numel()] = block
    return kept


def refit_consumers(
    model: nn.Module,
    groups: Sequence[UnitGroup],
    keeps: Sequence[Tensor],
    moments: Mapping[str, Moments],
    *,
    damp: float = 0.01,
) -> None:
    """Refit the consuming projections of ``groups`` to the kept units (see the module's docstring).

    Args:
        model: the model, its units pruned (or about to be: the masks are not read).
        groups: the unit groups.
        keeps: each group's kept units, as :func:`~lightprune.structure.prune_units` returns them.
        moments: the consumers' input moments with ``outer`` (``collect_moments(..., outer=True)``), collected before
            pruning.
        damp: relative dampening of the normal equations.

    Example:
        >>> from lightprune.structure import collect_moments, find_units, prune_units
        >>> torch.manual_seed(0) and None
        >>> mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        >>> groups = find_units(mlp, (torch.randn(1, 4),))
        >>> data = [torch.randn(256, 4)]
        >>> stats = collect_moments(mlp, groups, data, outer=True)
        >>> with torch.no_grad():
        ...     dense = mlp(data[0])
        ...     keeps = prune_units(mlp, groups, 0.5, importance="activation", moments=stats)
        ...     before = float((mlp(data[0]) - dense).square().mean())
        ...     refit_consumers(mlp, groups, keeps, stats)
        ...     after = float((mlp(data[0]) - dense).square().mean())
        >>> after < before
        True
    """
    if damp < 0:
        raise ValueError(f"damp must be >= 0, got {damp!r}")
    for group, keep in zip(groups, keeps, strict=True):
        for index, piece in enumerate(group.consume):
            stats = moments.get(piece.module)
            if stats is None or stats.outer is None:
                raise ValueError(
                    f"refit needs the second moments of {piece.module!r}'s inputs (collect_moments(..., outer=True))"
                )
            if stats.count == 0:  # (the least squares would solve to zero weights: the layer's output erased)
                raise ValueError(f"refit: no input of {piece.module!r} was recorded: {NEVER_CALLED}")
            module = model.get_submodule(piece.module)
            param = prune.original(module, piece.name)
            weight = param.detach().movedim(piece.dim, -1).double().cpu()  # (out, in)
            kept = _kept_features(group, keep, weight.shape[-1], index)
            count = max(stats.count, 1)
            mean = stats.mean.cpu()
            second = stats.outer.cpu() / count
            has_bias = getattr(module, "bias", None) is not None
            cov = second - torch.outer(mean, mean) if has_bias else second
            block = cov[kept][:, kept]
            ridge = damp * float(block.diagonal().mean().clamp_min(1e-12))
            block = block + ridge * torch.eye(block.shape[0], dtype=block.dtype)
            new = torch.linalg.solve(block, cov[kept] @ weight.T).T  # (out, kept)
            with torch.no_grad():
                if has_bias:
                    bias = prune.original(module, "bias")
                    shift = weight @ mean - new @ mean[kept]
                    bias.add_(shift.to(bias.dtype).to(bias.device))
                target = param.movedim(piece.dim, -1)
                target[..., kept] = new.to(param.dtype).to(param.device)
            if prune.is_pruned(module):
                prune.refresh_pruned(module)
