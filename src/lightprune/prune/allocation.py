"""Per-layer sparsity allocation: how many weights each tensor gives when a total count is pruned layer by layer.

Two rules decide each tensor's *density* (the share of its weights kept); one routine turns densities into exact
integer counts that add up to the requested total.

* **ERK** (Erdős–Rényi-Kernel, Evci et al. 2020, RigL): density proportional to ``sum(shape) / prod(shape)`` (for a
  ``(out, in)`` Linear weight ``(out + in) / (out * in)``, for a convolution the kernel dims count too), scaled so
  the total is met; a tensor whose density would pass 1 is kept dense and the scale is solved again for the rest.
  Small tensors (the first and last layers) keep more, large ones give more.
* **OWL** (outlier-weighted layerwise sparsity, Yin et al. 2024): each *block*'s outlier ratio ``D`` is the share of
  its scores (Wanda's ``|W| * ||X||``, of all its tensors together) above ``threshold`` times their mean (OWL's
  ``M``, 5 by default); the ratios are mapped linearly onto ``[0, 2 * lam]`` (``lam``: OWL's ``lambda``, 0.08 by
  default) and shifted so the mean density is the target's: the blocks' sparsities span ``2 * lam`` around the
  target, more outliers keep more, and every tensor of a block has the block's sparsity. A block is what OWL calls
  a layer, a transformer block: the tensors whose qualified names share the prefix up to the first all-digit part
  (a ``ModuleList`` index: ``encoder.layer.3`` for ``encoder.layer.3.attention.self.query.weight``,
  :func:`owl_blocks`); a tensor with no such part is a block of its own. OWL's blocks are of one size, so its plain
  mean is the weighted one; here the shift is solved with each tensor weighted by its size, so the total is exact
  whatever the sizes.

Both rules also respect per-tensor bounds: a cap on the share of a tensor that may be pruned (``max_layer_sparsity``)
and what a tensor already has pruned (masks only grow). The density level (ERK's scale, OWL's shift) is solved by
bisection of a monotone sum with every density clipped to its bounds; :func:`apportion` then rounds the real counts
to integers with the exact total, by largest remainder (ties to the earlier tensor), within the bounds.

Example:
    >>> layer_counts([(2, 2), (20, 20), (20, 10)], 0.5, erk_weights([(2, 2), (20, 20), (20, 10)]))
    [0, 230, 72]
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from lightprune.choices import OWL_LAMBDA, OWL_THRESHOLD

__all__ = [
    "apportion",
    "block_outlier_ratios",
    "erk_weights",
    "layer_counts",
    "outlier_ratio",
    "owl_blocks",
    "owl_offsets",
]


_BISECTIONS = 200


def erk_weights(shapes: Sequence[Sequence[int]]) -> list[float]:
    """ERK's raw density of each shape: ``sum(shape) / prod(shape)`` (to be scaled to the target).

    Example:
        >>> erk_weights([(4, 2), (3, 2, 3, 3)])
        [0.75, 0.2037037037037037]
    """
    return [sum(shape) / math.prod(shape) for shape in shapes]


def outlier_ratio(scores: Tensor, keep: Tensor | None = None, threshold: float = OWL_THRESHOLD) -> float:
    """OWL's outlier ratio: the share of ``scores`` above ``threshold`` times their mean.

    Only the entries where ``keep`` is true count (the unpruned ones, at a later event; all when ``None``): pruned
    weights score zero and would lower the mean.

    Example:
        >>> outlier_ratio(torch.tensor([1.0, 1.0, 1.0, 9.0]), threshold=2.0)  # mean 3: one of four is above 6
        0.25
        >>> outlier_ratio(torch.tensor([1.0, 1.0, 1.0, 9.0]), keep=torch.tensor([True, True, True, False]))
        0.0
    """
    values = scores.detach().reshape(-1).double()
    if keep is not None:
        values = values[keep.reshape(-1).to(device=values.device, dtype=torch.bool)]
    if values.numel() == 0:
        return 0.0
    return float((values > threshold * values.mean()).double().mean())


def owl_blocks(names: Sequence[str]) -> list[str]:
    """OWL's block of each qualified tensor name: the name up to its first all-digit part, or the name itself.

    Example:
        >>> owl_blocks(["encoder.layer.3.attention.self.query.weight", "encoder.layer.3.output.dense.weight",
        ...             "encoder.layer.10.intermediate.dense.weight", "pooler.dense.weight"])
        ['encoder.layer.3', 'encoder.layer.3', 'encoder.layer.10', 'pooler.dense.weight']
    """
    blocks = []
    for name in names:
        parts = name.split(".")
        index = next((i for i, part in enumerate(parts) if part.isdigit()), None)
        blocks.append(name if index is None else ".".join(parts[: index + 1]))
    return blocks


def block_outlier_ratios(
    scores: Sequence[Tensor],
    keeps: Sequence[Tensor | None],
    blocks: Sequence[str],
    threshold: float = OWL_THRESHOLD,
) -> list[float]:
    """Each tensor's OWL ratio: :func:`outlier_ratio` of its block's scores together (one mean for the block).

    Args:
        scores: per tensor, its scores (``|W| * ||X||``).
        keeps: per tensor, its unpruned entries (``None``: all), the only ones that count.
        blocks: per tensor, its block (:func:`owl_blocks`); tensors of one block get one ratio.
        threshold: OWL's ``M``.

    Example:
        >>> scores = [torch.tensor([1.0, 1.0]), torch.tensor([1.0, 9.0]), torch.tensor([1.0, 9.0])]
        >>> block_outlier_ratios(scores, [None] * 3, ["a", "a", "b"], threshold=2.0)  # block a: mean 3, one of 4
        [0.25, 0.25, 0.0]
    """
    ratio = {}
    for block in dict.fromkeys(blocks):
        members = [i for i, of in enumerate(blocks) if of == block]
        values = torch.cat([scores[i].detach().reshape(-1).double() for i in members])
        kept: list[Tensor] = []
        for i in members:
            given = keeps[i]
            kept.append(torch.ones_like(scores[i], dtype=torch.bool) if given is None else given)
        keep = torch.cat([k.reshape(-1).to(device=values.device, dtype=torch.bool) for k in kept])
        ratio[block] = outlier_ratio(values, keep, threshold)
    return [ratio[block] for block in blocks]


def owl_offsets(ratios: Sequence[float], lam: float = OWL_LAMBDA) -> list[float]:
    """OWL's density offsets before the shift to the target: the ratios mapped linearly onto ``[0, 2 * lam]``.

    All ratios equal (no outliers anywhere, or one tensor): every offset is 0, a uniform allocation.

    Example:
        >>> owl_offsets([0.0, 0.5, 0.25], lam=0.25)
        [0.0, 0.5, 0.25]
    """
    low, high = min(ratios), max(ratios)
    if high <= low:
        return [0.0 for _ in ratios]
    return [(ratio - low) / (high - low) * 2 * lam for ratio in ratios]


def layer_counts(
    shapes: Sequence[Sequence[int]],
    target: float,
    weights: Sequence[float],
    *,
    rule: str = "erk",
    pruned: Sequence[int] | None = None,
    caps: Sequence[int] | None = None,
) -> list[int]:
    """How many entries of each tensor to have pruned in all so that exactly ``round(target * total)`` are.

    Args:
        shapes: the tensors' shapes.
        target: the total sparsity to reach, in [0, 1].
        weights: per tensor, ERK's raw density (:func:`erk_weights`, scaled: ``rule="erk"``) or OWL's offset
            (:func:`owl_offsets`, shifted: ``rule="owl"``).
        rule: ``"erk"`` (density ``scale * weight``) or ``"owl"`` (density ``shift + weight``).
        pruned: entries already pruned in each tensor (lower bounds: masks only grow); zeros by default.
        caps: the most entries of each tensor that may be pruned (``max_layer_sparsity``); all by default.

    Returns:
        The total count of pruned entries per tensor, each within its bounds, adding up to the target's count.

    Raises:
        ValueError: the bounds cannot hold the target's count, or ``rule`` is unknown.

    Example:
        >>> layer_counts([(10, 10), (10, 10)], 0.5, [0.0, 0.1], rule="owl")  # sparsities 0.55 and 0.45
        [55, 45]
    """
    if rule not in ("erk", "owl"):
        raise ValueError(f"rule={rule!r} is not supported: allowed are ('erk', 'owl')")
    units = [math.prod(shape) for shape in shapes]
    lower = list(pruned) if pruned is not None else [0] * len(units)
    upper = [max(cap, low) for cap, low in zip(caps, lower, strict=True)] if caps is not None else list(units)
    total = round(target * sum(units))
    total = max(total, sum(lower))  # a lower target than what is pruned already: nothing more to prune
    if total > sum(upper):
        raise ValueError(
            f"the per-layer caps let at most {sum(upper)} of {sum(units)} entries be pruned, fewer than the {total} "
            f"that sparsity {target} asks for"
        )
    # density bounds: keep at least units - upper, at most units - lower
    low_density = [(n - up) / n for n, up in zip(units, upper, strict=True)]
    high_density = [(n - lo) / n for n, lo in zip(units, lower, strict=True)]
    keep = sum(units) - total

    def density(level: float, i: int) -> float:
        raw = level * weights[i] if rule == "erk" else level + weights[i]
        return min(max(raw, low_density[i]), high_density[i])

    def kept(level: float) -> float:
        return sum(units[i] * density(level, i) for i in range(len(units)))

    if rule == "erk":
        low, high = 0.0, max((1 / w for w in weights if w > 0), default=1.0)
    else:
        low, high = -1.0 - max(weights, default=0.0), 1.0
    for _ in range(_BISECTIONS):
        middle = (low + high) / 2
        if kept(middle) < keep:
            low = middle
        else:
            high = middle
    real = [units[i] * (1 - density(high, i)) for i in range(len(units))]
    return apportion(real, total, lower, upper)


def apportion(real: Sequence[float], total: int, lower: Sequence[int], upper: Sequence[int]) -> list[int]:
    """Integers within ``[lower[i], upper[i]]`` adding up to ``total``, each as close to ``real[i]`` as the rest
    allows: floors first, then +1 to the largest remainders (or -1 from the smallest), ties to the earlier index.

    Example:
        >>> apportion([1.5, 1.5, 1.0], 4, [0, 0, 0], [3, 3, 3])
        [2, 1, 1]
        >>> apportion([2.2, 0.9], 2, [2, 0], [5, 5])
        [2, 0]
    """
    counts = [min(max(math.floor(x), lo), up) for x, lo, up in zip(real, lower, upper, strict=True)]
    missing = total - sum(counts)
    if missing > 0:
        heap = [(-(real[i] - counts[i]), i) for i in range(len(counts)) if counts[i] < upper[i]]
        sign = 1
    else:
        heap = [(real[i] - counts[i], i) for i in range(len(counts)) if counts[i] > lower[i]]
        sign = -1
    heapq.heapify(heap)
    for _ in range(abs(missing)):
        _, i = heapq.heappop(heap)
        counts[i] += sign
        if sign > 0 and counts[i] < upper[i]:
            heapq.heappush(heap, (-(real[i] - counts[i]), i))
        elif sign < 0 and counts[i] > lower[i]:
            heapq.heappush(heap, (real[i] - counts[i], i))
    return counts
