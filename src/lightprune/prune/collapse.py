"""Layer collapse: said when it happens, and prevented by a cap on each layer's sparsity.

A global ranking compares weights across layers; a layer whose weights are small next to the others' can lose all of
them (Tanaka et al. 2020). The network then computes without it: a collapsed output layer leaves only its bias, the
same output whatever the input. :class:`LayerCollapseWarning` says so, and ``max_layer_sparsity`` caps the share of
any one tensor that a global ranking may prune, the total staying exact: the entries a capped tensor cannot give
are taken from the tensors still under their caps (:func:`fill_under_caps`).

Example:
    >>> cap_units(0.8, 128), cap_units(0.29, 100), cap_units(1.0, 7)
    (102, 29, 7)
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from numbers import Real
from typing import Any

__all__ = [
    "LayerCollapseWarning",
    "cap_units",
    "capped_count",
    "check_max_layer_sparsity",
    "fill_under_caps",
    "warn_collapsed",
]

COLLAPSE_MEANING = (
    "a weight so pruned no longer computes anything from its input (a Linear outputs its bias alone, whatever the "
    "input); a bias or norm vector so pruned adds or scales by nothing"
)


class LayerCollapseWarning(UserWarning):
    """Pruning left a parameter with no unpruned weight (or, for structured methods, no channel): layer collapse.

    Turn it into an error with ``warnings.simplefilter("error", LayerCollapseWarning)``; prevent it with
    ``max_layer_sparsity``.

    Example:
        >>> issubclass(LayerCollapseWarning, UserWarning)
        True
    """


def check_max_layer_sparsity(value: Any) -> float:
    """``value`` as a float in (0, 1], or a ``ValueError`` naming it and the allowed range.

    Example:
        >>> check_max_layer_sparsity(0.9)
        0.9
        >>> check_max_layer_sparsity(0)
        Traceback (most recent call last):
        ...
        ValueError: max_layer_sparsity=0 must be a float in (0, 1] (1.0: no cap)
    """
    number = isinstance(value, Real) and not isinstance(value, bool) and not math.isnan(value)  # numpy's too
    if not (number and 0 < value <= 1):  # the engine's own argument check: it imports nothing outside prune/
        raise ValueError(f"max_layer_sparsity={value!r} must be a float in (0, 1] (1.0: no cap)")
    return float(value)


def cap_units(max_sparsity: float, units: int) -> int:
    """The most units of a tensor of ``units`` that may be pruned: the largest ``p`` with ``p / units <= max_sparsity``.

    Computed against the division a reader checks with, so float rounding never lets a tensor pass the cap, nor
    keeps it one unit short of it (``0.29 * 100`` is ``28.999999999999996``, yet 29 of 100 is 0.29).

    Example:
        >>> cap_units(0.5, 3), cap_units(0.999, 10)
        (1, 9)
    """
    pruned = min(units, math.floor(max_sparsity * units))
    while pruned < units and (pruned + 1) / units <= max_sparsity:
        pruned += 1
    while pruned > 0 and pruned / units > max_sparsity:
        pruned -= 1
    return pruned


def capped_count(target: float, units: int, max_sparsity: float) -> int:
    """How many units of a tensor of ``units`` a layerwise event to ``target`` prunes in all: ``round(target * units)``,
    stopped at the cap (:func:`cap_units`) when rounding would pass it.

    Example:
        >>> capped_count(0.5, 3, 1.0), capped_count(0.5, 3, 0.5)
        (2, 1)
    """
    return min(round(target * units), cap_units(max_sparsity, units))


def fill_under_caps(caps: Sequence[int], k: int, select: Callable[[list[int], int], list[int]]) -> None:
    """Select the ``k`` smallest entries over many tensors, no more than ``caps[i]`` in tensor ``i``, exactly.

    ``select(indices, n)`` must select the ``n`` smallest eligible entries over the tensors ``indices`` with one
    shared ranking (an exact cut of :mod:`lightprune.prune.k_smallest`, or of :mod:`lightprune.prune.distributed`
    across ranks), write their masks, and return how many entries it selected in each of them. The result is the
    greedy one: entries in rank order, a tensor skipped once it holds its cap. A tensor that the shared ranking
    would push past its cap holds its cap in that greedy selection too (it had more than ``caps[i]`` entries before
    the shared cut, so before the greedy one), so it is filled alone to its cap with its own smallest entries and
    left out; the rest share the remaining count. Each round fills at least one tensor, so there are at most as
    many rounds as tensors, and usually one.

    Raises:
        ValueError: the caps leave fewer than ``k`` entries to select.

    Example:
        >>> import torch
        >>> from lightprune.prune.k_smallest import select_smallest
        >>> scores = [torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([5.0, 6.0])]
        >>> chosen = [None, None]
        >>> def select(indices, n):
        ...     masks = select_smallest([scores[i] for i in indices], n)
        ...     for i, mask in zip(indices, masks):
        ...         chosen[i] = mask
        ...     return [int(mask.sum()) for mask in masks]
        >>> fill_under_caps([2, 2], 3, select)
        >>> chosen
        [tensor([ True,  True, False, False]), tensor([ True, False])]
    """
    if k > sum(caps):
        raise ValueError(f"max_layer_sparsity leaves {sum(caps)} entries to prune, fewer than the {k} asked for")
    active = list(range(len(caps)))
    while True:
        counts = select(active, k)
        over = [i for i, count in zip(active, counts, strict=True) if count > caps[i]]
        if not over:
            return
        for i in over:
            select([i], caps[i])
        k -= sum(caps[i] for i in over)
        active = [i for i in active if i not in over]


def warn_collapsed(names: Sequence[str], where: str, unit: str = "weight", stacklevel: int = 3) -> None:
    """Warn (:class:`LayerCollapseWarning`) that ``names`` were left with no unpruned weight by ``where``.

    Example:
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn_collapsed(["fc.weight"], "global_unstructured()")
        >>> print(caught[0].message)  # doctest: +ELLIPSIS
        global_unstructured() pruned every weight of fc.weight: layer collapse; a weight so pruned no longer ...
    """
    if names:
        warnings.warn(collapse_message(names, where, unit), LayerCollapseWarning, stacklevel=stacklevel)


def collapse_message(names: Sequence[str], where: str, unit: str = "weight") -> str:
    """The text of the collapse warning (also the callback's); ``unit`` is what was pruned (``"channel (dim 0)"``).

    Example:
        >>> collapse_message(["a.weight", "b.weight"], "x").startswith("x pruned every weight of a.weight, b.weight")
        True
    """
    return (
        f"{where} pruned every {unit} of {', '.join(names)}: layer collapse; {COLLAPSE_MEANING}. "
        "Cap each layer's share with max_layer_sparsity (e.g. 0.95), or exclude the layer."
    )
