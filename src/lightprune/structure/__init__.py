"""``lightprune.structure``: structured pruning of transformers and MLPs by units (MLP neurons, attention heads).

* :func:`find_units` - the groups of weights that go together, read from one ``torch.export`` forward;
* :func:`collect_moments` - what reaches each projection that reads units (activation statistics, ``X^T X``);
* :func:`unit_scores` / :func:`prune_units` - rank units (magnitude, activation, Taylor, a callable) and mask them
  with exact counts, layerwise or globally, through ``lightprune.prune``;
* :func:`refit_consumers` - least-squares refit of the projections reading the kept units.

:func:`lightprune.export.remove_units` then removes the pruned units physically.

Example:
    >>> import torch
    >>> from lightprune.structure import find_units, prune_units
    >>> mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> groups = find_units(mlp, (torch.randn(1, 4),))
    >>> [int(keep.sum()) for keep in prune_units(mlp, groups, 0.5)]
    [4]
"""

from lightprune.structure.ranking import IMPORTANCES, SCOPES, group_masks, prune_units, unit_scores
from lightprune.structure.refit import refit_consumers
from lightprune.structure.statistics import Moments, collect_moments
from lightprune.structure.units import Slice, UnitError, UnitGroup, find_units

__all__ = [
    "IMPORTANCES",
    "SCOPES",
    "Moments",
    "Slice",
    "UnitError",
    "UnitGroup",
    "collect_moments",
    "find_units",
    "group_masks",
    "prune_units",
    "refit_consumers",
    "unit_scores",
]
