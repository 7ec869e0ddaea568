"""OBS / SparseGPT pruning of weights sharded by rows (DTensors placed ``Shard(0)``: FSDP2, ``ModelParallelStrategy``).

Every rank holds the same ``H = X^T X`` (the input statistics are additive: the callback all-reduces them) and its
own rows of the weight. SparseGPT's update moves a row's later columns by that row's own errors and ``H`` alone,
so each rank prunes and updates its own rows; only two things look across rows:

* the unstructured selection of :func:`~lightprune.prune.obs.sparsegpt` (``per_row=False``): block by block, the
  ``k`` smallest saliencies over every row. :class:`ShardedRows` finds them with the histogram passes of
  :func:`lightprune.prune.distributed.find_cuts` (ties by the global row-major index, as one process breaks them),
  and sums the per-block eligible counts with one ``all_reduce``;
* how many entries an event prunes per layer (:func:`sharded_obs_counts`): ``"layerwise"`` counts units over all
  ranks, ``"global"`` ranks the saliencies of every layer across ranks
  (:func:`~lightprune.prune.distributed.sharded_unstructured_masks`).

Per-row counts (``scope="row"``) and N:M groups (along the columns, inside a row) need no traffic. The result on
each rank is its rows of what one process computes on the gathered weights with the same ``H``, up to the
arithmetic: the update multiplies row by row the same factors, so it matches bit for bit where the matrix products
of the local rows round as those of all rows do (see the tests for what is measured). Supported: ``nn.Linear`` and
``nn.Conv1d`` / ``nn.Conv2d`` (their rows are output channels) placed ``Shard(0)`` or ``Replicate()``, and plain
tensors (every rank computes the same). transformers' ``Conv1D`` stores ``(in, out)``: ``Shard(0)`` splits the
columns SparseGPT walks in order, so it is refused (:func:`sharded_obs_problem`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightprune.layouts import is_transformers_conv1d
from lightprune.prune._reparam import original
from lightprune.prune.distributed import (
    Piece,
    _all_reduce,
    find_cuts,
    is_sharded,
    local_of,
    local_piece,
    pruned_units,
    sharded_unstructured_masks,
)
from lightprune.prune.k_smallest import apply_cut
from lightprune.prune.obs import LocalRows, as_matrix, check_obs_layer, from_matrix, layer_saliency, sparsegpt

__all__ = ["ShardedRows", "rows_of", "sharded_obs_counts", "sharded_obs_problem", "sharded_sparsegpt"]

Masks = Callable[[nn.Module, str], Tensor | None]


class ShardedRows:
    """:class:`~lightprune.prune.obs.Rows` of a matrix whose rows ``first_row, first_row + 1, ...`` are here and the
    others on the other ranks of ``group`` (every rank calls :func:`~lightprune.prune.obs.sparsegpt` alike).

    Args:
        first_row: the global index of this rank's first row.
        group: the process group (``None``: the default one).

    Example:
        >>> rows = ShardedRows(0)  # one process: as LocalRows
        >>> rows.prune_smallest(torch.tensor([[3.0, 1.0], [1.0, 0.5]]), torch.ones(2, 2, dtype=torch.bool), 2)
        tensor([[ True, False],
                [ True, False]])
    """

    def __init__(self, first_row: int, group: Any = None) -> None:
        self.first_row, self.group = first_row, group

    def total(self, counts: Tensor) -> Tensor:
        """``counts`` summed over the ranks (one ``all_reduce``)."""
        return _all_reduce(counts.to(torch.int64), self.group)

    def prune_smallest(self, saliency: Tensor, keep: Tensor, k: int) -> Tensor:
        """``keep`` less the ``k`` smallest kept entries over every rank's rows (ties: global row-major order)."""
        scores, eligible = saliency.contiguous(), keep.contiguous()
        width = scores.shape[1] if scores.dim() == 2 else 1
        piece = Piece(scores, self.first_row * width, True, False, scores.shape)  # (find_cuts reads no shape)
        cut = find_cuts([piece], k, eligible=[eligible], group=self.group)[0]
        out = torch.empty(scores.shape, dtype=torch.bool, device=scores.device)
        apply_cut([scores], cut, out=[out], eligible=[eligible], base=[eligible])
        return out


def rows_of(weight: Tensor, group: Any = None) -> LocalRows | ShardedRows:
    """The :class:`~lightprune.prune.obs.Rows` of a weight: :class:`ShardedRows` for a ``Shard(0)`` DTensor, else
    :class:`~lightprune.prune.obs.LocalRows` (a replicated or plain weight: every rank has all of it).

    Example:
        >>> type(rows_of(torch.zeros(2, 3))).__name__
        'LocalRows'
    """
    piece = local_piece(weight, group)
    if piece.replicated:
        return LocalRows()
    row = max(1, int(torch.Size(piece.shape[1:]).numel()))
    return ShardedRows(piece.offset // row, group)


def sharded_obs_problem(module: nn.Module, name: str = "weight") -> str | None:
    """Why OBS cannot prune the (possibly sharded) ``module.<name>``, or ``None`` when it can (see the module's
    docstring).

    Example:
        >>> sharded_obs_problem(nn.Linear(2, 2)) is None
        True
    """
    weight = original(module, name)
    if not is_sharded(weight):
        return None
    try:
        piece = local_piece(weight)
    except NotImplementedError as error:
        return f"{error}: under another placement a rank does not hold whole rows"
    if is_transformers_conv1d(module) and not piece.replicated:
        return (
            "transformers' Conv1D stores its weight (in, out), so Shard(0) splits the input columns that SparseGPT "
            "walks in order across ranks"
        )
    return None


def sharded_obs_counts(
    triples: Sequence[tuple[str, nn.Module, str]],
    masks: Masks,
    target: float,
    scope: str,
    hessian_of: Callable[[str], Tensor],
    group: Any = None,
) -> dict[str, int | Tensor]:
    """:func:`lightprune.callback.reconstruction.obs_counts` for sharded weights: how many more entries each layer
    prunes to reach ``target`` (``"row"``: one count per local row), the same ints on every rank.

    Example:
        >>> layer = nn.Linear(4, 2)
        >>> sharded_obs_counts([("fc.weight", layer, "weight")], lambda m, n: None, 0.5, "layerwise",
        ...                    lambda q: torch.eye(4))
        {'fc.weight': 4}
    """
    tensors = [original(module, name) for _, module, name in triples]
    current = [masks(module, name) for _, module, name in triples]
    if scope == "row":
        counts: dict[str, int | Tensor] = {}
        for (qualified, module, _), weight, mask in zip(triples, tensors, current, strict=True):
            local = local_of(weight)
            keep = torch.ones_like(local, dtype=torch.bool) if mask is None else local_of(mask) != 0
            keep = as_matrix(module, keep)
            length = keep.shape[1]
            counts[qualified] = (round(target * length) - (length - keep.sum(dim=1))).clamp(min=0)
        return counts
    before = pruned_units(tensors, current, group=group)
    if scope != "global":
        return {
            qualified: max(round(target * units) - pruned, 0)
            for (qualified, _, _), (units, pruned) in zip(triples, before, strict=True)
        }
    k = round(target * sum(u for u, _ in before)) - sum(p for _, p in before)
    if k <= 0:
        return {qualified: 0 for qualified, _, _ in triples}
    scores = [layer_saliency(module, name, hessian_of(qualified)) for qualified, module, name in triples]
    chosen = sharded_unstructured_masks(tensors, k, current=current, importance_scores=scores, group=group, signed=True)
    after = pruned_units(tensors, chosen, group=group)
    return {
        qualified: pruned_after - pruned
        for (qualified, _, _), (_, pruned), (_, pruned_after) in zip(triples, before, after, strict=True)
    }


def sharded_sparsegpt(
    module: nn.Module,
    name: str,
    hessian: Tensor,
    mask: Tensor | None,
    *,
    counts: int | Tensor | None = None,
    per_row: bool = False,
    n: int | None = None,
    m: int | None = None,
    layer: str | None = None,
    group: Any = None,
) -> tuple[Tensor, Tensor]:
    """:func:`~lightprune.prune.obs.sparsegpt` on this rank's rows of ``module.<name>`` (a ``Shard(0)`` or
    ``Replicate()`` DTensor, or a plain tensor), called on every rank alike: ``(new local weight, new local keep
    mask)`` in the local shard's shape, this rank's part of what one process computes on the gathered weight.

    Args:
        module, name: the layer and its weight (see :func:`sharded_obs_problem` for what is supported).
        hessian: ``H``, the same on every rank.
        mask: the local mask in force (zeros pruned) or ``None``.
        counts: as :func:`~lightprune.prune.obs.sparsegpt`'s: an int over the whole weight (the same on every rank),
            or with ``per_row`` one per local row.
        per_row, n, m: as :func:`~lightprune.prune.obs.sparsegpt`'s.
        layer: the layer's name, for messages.
        group: the process group.

    Raises:
        ValueError: a layout :func:`sharded_obs_problem` refuses, or one :func:`~lightprune.prune.obs.sparsegpt`
            refuses (every rank raises: the checks that look at local values are summed across ranks first).

    Example:
        >>> layer = nn.Linear(4, 2)
        >>> weight, keep = sharded_sparsegpt(layer, "weight", torch.eye(4), None, counts=4)
        >>> int(keep.sum()), weight.shape
        (4, torch.Size([2, 4]))
    """
    label = layer or f"{type(module).__name__}.{name}"
    check_obs_layer(module, name, layer)
    problem = sharded_obs_problem(module, name)
    if problem is not None:
        raise ValueError(f"OBS pruning of {label}: {problem}")
    weight = original(module, name)
    local = local_of(weight).detach()
    bad = torch.tensor([int((~torch.isfinite(local)).sum())], dtype=torch.int64)
    if int(_all_reduce(bad, group)[0]):
        raise ValueError(f"OBS pruning of {label}: the weight holds NaN or inf; it cannot be reconstructed")
    keep = None if mask is None else as_matrix(module, local_of(mask))
    new, kept = sparsegpt(
        as_matrix(module, local), hessian, keep=keep, counts=counts, per_row=per_row, n=n, m=m, layer=label,
        across=rows_of(weight, group),
    )  # fmt: skip
    return from_matrix(module, new, local.shape), from_matrix(module, kept, local.shape)
