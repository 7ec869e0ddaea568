"""Order of entries inside small groups (a weight's rows, N:M groups): integer sort keys and stable ranks.

The threshold search of :mod:`lightprune.prune.k_smallest` finds one cut over whole tensors. Methods that choose a count
per row or per group of ``M`` entries instead rank inside each group: the scores become the integer keys of
:mod:`~lightprune.prune.k_smallest` (the same order: by magnitude or by value, ``-0.0`` equal to ``+0.0``, ``NaN`` above
``+inf``), entries that may not be chosen get a key outside that range (for ``int64`` scores, whose keys fill
the whole range, a second stable sort by eligibility does it), and a stable sort along the group's last dim
gives each entry its rank. Equal keys keep their index order, so ties are broken by position: lower index first.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightprune.prune.k_smallest import Keys

__all__ = ["group_ranks"]


def group_ranks(scores: Tensor, eligible: Tensor | None, *, magnitude: bool, ineligible_first: bool) -> Tensor:
    """The rank (0 = smallest score) of every entry within its group, the groups being the slices along the last dim.

    Args:
        scores: the scores; every slice ``scores[..., :]`` is one group.
        eligible: ``None`` (all entries rank by score) or a mask of ``scores``' shape, 1 (or True) where the entry
            ranks by score; the others rank before every eligible entry (``ineligible_first``) or after all of them,
            among themselves by position.
        magnitude: rank ``|score|`` instead of the signed value.
        ineligible_first: put the ineligible entries first (they count as the lowest scores) or last.

    Returns:
        An ``int64`` tensor of ``scores``' shape: the position each entry takes when its group is sorted stably.

    Example:
        >>> group_ranks(torch.tensor([[3.0, -1.0, 2.0, -1.0]]), None, magnitude=True, ineligible_first=False)
        tensor([[3, 0, 2, 1]])
        >>> group_ranks(torch.tensor([[3.0, -1.0, 2.0]]), torch.tensor([[1, 1, 0]]), magnitude=False,
        ...             ineligible_first=True)
        tensor([[2, 1, 0]])
    """
    shape = scores.shape
    keys = Keys(scores.dtype, magnitude=magnitude, largest=False)(scores.detach().reshape(-1).contiguous())
    keys = keys.to(torch.int64).view(shape)
    order = None
    if eligible is not None:
        outside = ~(eligible if eligible.dtype == torch.bool else eligible == 1)
        if scores.dtype == torch.int64:  # its keys span all of int64: no key is free, sort by (eligible, key)
            order = torch.sort(keys, dim=-1, stable=True).indices
            last = ~outside if ineligible_first else outside  # sorts after the others
            flags = last.gather(-1, order).to(torch.uint8)
            order = order.gather(-1, torch.sort(flags, dim=-1, stable=True).indices)
        else:
            info = torch.iinfo(torch.int64)
            keys.masked_fill_(outside, info.min if ineligible_first else info.max)
    if order is None:
        order = torch.sort(keys, dim=-1, stable=True).indices
    ranks = torch.empty_like(order)
    positions = torch.arange(shape[-1], device=scores.device).expand_as(order)
    ranks.scatter_(-1, order, positions)
    return ranks
