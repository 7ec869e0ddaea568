"""One mask update of dynamic sparse training: drop the smallest active weights, regrow as many inactive ones.

SET (Mocanu et al. 2018) regrows at random; RigL (Evci et al. 2020) where the dense gradient is largest. Either way
a tensor's count of active weights is unchanged, so its sparsity (and the total) stays at the target.

Ties are broken by flat index, as everywhere in :mod:`lightprune.prune.k_smallest`: among active weights of equal
magnitude the ones earlier in the tensor are dropped first, among candidates of equal gradient magnitude the ones
earlier in the tensor are regrown first.

The candidates for regrowth are the entries inactive *after* the drop, as in RigL's Algorithm 1 (the top ``k`` over
the entries outside the active set the drop leaves) and its reference code, which does the same for SET: a dropped
weight whose dense gradient is among the ``k`` largest is regrown by the same update. It then keeps its value and
optimizer state (the reference code's default, ``reinit_when_same=False``): it has not moved. So at most ``k``
weights move, and the count of active weights is unchanged.

Example:
    >>> weight = torch.tensor([0.5, -0.1, 0.0, 0.0, 2.0])
    >>> mask = torch.tensor([True, True, False, False, True])
    >>> new, grown = drop_and_grow(weight, mask, 1, grow_scores=torch.tensor([9.0, 1.0, 0.1, -3.0, 9.0]))
    >>> new.tolist(), grown.tolist()
    ([True, False, False, True, True], [False, False, False, True, False])
    >>> new, grown = drop_and_grow(weight, mask, 1, grow_scores=torch.tensor([9.0, 5.0, 0.1, -3.0, 9.0]))
    >>> new.tolist(), grown.tolist()  # the dropped -0.1 has the largest gradient: it stays, nothing moves
    ([True, True, False, False, True], [False, False, False, False, False])
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightprune.prune.k_smallest import select_smallest

__all__ = ["drop_and_grow", "moved_count"]


def moved_count(fraction: float, active: int, inactive: int) -> int:
    """How many weights an update moves in a tensor: ``round(fraction * active)``, at most ``inactive``.

    Example:
        >>> moved_count(0.3, 10, 90), moved_count(0.3, 10, 2), moved_count(0.3, 0, 100)
        (3, 2, 0)
    """
    return min(round(fraction * active), inactive)


def drop_and_grow(
    weight: Tensor,
    mask: Tensor,
    k: int,
    *,
    grow_scores: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """The new mask after dropping the ``k`` smallest active ``|weight|`` and regrowing ``k`` entries inactive after
    the drop (the dropped ones included: see the module's docstring).

    Args:
        weight: the tensor's current values (only the active entries' magnitudes are read).
        mask: the current mask (true or nonzero where active).
        k: how many weights move (:func:`moved_count`); at most the number of inactive entries.
        grow_scores: RigL: regrow the candidates with the largest ``|grow_scores|`` (the dense gradient).
        generator: SET (when ``grow_scores`` is ``None``): regrow uniformly at random among the candidates, drawn
            from this generator (on the CPU: the same seed gives the same draw on every device and process).

    Returns:
        ``(new mask, grown)``: bool tensors of ``weight``'s shape; ``grown`` marks the new connections (inactive
        before the update): the entries whose value and optimizer state start at zero. A weight dropped and regrown
        by the same update is active in the new mask and not in ``grown``.

    Raises:
        ValueError: ``k`` is more than the active or the inactive entries.

    Example:
        >>> new, grown = drop_and_grow(torch.ones(6), torch.tensor([1, 1, 1, 0, 0, 0]), 2,
        ...                            generator=torch.Generator().manual_seed(0))
        >>> int(new.sum()), int(grown.sum()) <= 2, bool((grown & torch.tensor([1, 1, 1, 0, 0, 0]).bool()).any())
        (3, True, False)
    """
    active = mask.detach() != 0
    inactive = ~active
    n_active, n_inactive = int(active.sum()), int(inactive.sum())
    if not 0 <= k <= min(n_active, n_inactive):
        raise ValueError(f"k={k} weights cannot move: {n_active} are active and {n_inactive} inactive")
    if k == 0:
        return active.clone(), torch.zeros_like(active)
    (drop,) = select_smallest([weight.detach()], k, eligible=[active], magnitude=True)
    kept = active & ~drop
    candidates = ~kept
    if grow_scores is not None:
        (regrown,) = select_smallest([grow_scores.detach()], k, eligible=[candidates], magnitude=True, largest=True)
    else:
        where = candidates.reshape(-1).nonzero().squeeze(1).cpu()
        chosen = where[torch.randperm(where.numel(), generator=generator)[:k]]
        regrown = torch.zeros(active.numel(), dtype=torch.bool)
        regrown[chosen] = True
        regrown = regrown.reshape(active.shape).to(active.device)
    return kept | regrown, regrown & inactive
