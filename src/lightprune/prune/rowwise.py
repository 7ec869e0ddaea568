"""Per-row ranking: every output row of a weight loses the same share of its entries (Wanda's convention).

A row is a slice along ``dim``: 0 for a Linear or Conv weight ``(out, in, ...)``, 1 for an ``(in, out)`` weight
(transformers' ``Conv1D``, ``ConvTranspose``; :func:`lightprune.layouts.row_dim` says which).

:class:`RowwiseL1Unstructured` ranks ``|score|`` inside each row (the slice ``t[i]``, flattened over the other dims)
and prunes ``amount`` of the entries each row still has. Its ``PRUNING_TYPE`` is ``"global"``: a
:class:`~lightprune.prune.PruningContainer` then hands it the whole tensor and the mask in
force, instead of the flattened entries still unpruned that an ``"unstructured"`` method gets and in which the rows
are lost. It honours that mask itself: entries already pruned stay pruned and are not counted in a row's entries.
"""

from __future__ import annotations

import numbers

import torch
from torch import Tensor, nn

from lightprune.prune.amount import check_dim, normalize_dim, validate_amount
from lightprune.prune.base import BasePruningMethod, _to_mask_dtype
from lightprune.prune.ranks import group_ranks

__all__ = ["RowwiseL1Unstructured", "RowwiseToSparsity", "row_counts"]


def row_counts(amount: int | float, available: Tensor) -> Tensor:
    """How many entries each row prunes: ``amount`` itself (an int) or ``round(amount * available)`` per row.

    ``round`` halves to even, as Python's ``round`` (and so torch's amount rule) does.

    Raises:
        ValueError: an int ``amount`` is larger than what some row still has, naming that row.

    Example:
        >>> row_counts(0.5, torch.tensor([4, 3, 5]))
        tensor([2, 2, 2])
        >>> row_counts(3, torch.tensor([4, 2]))
        Traceback (most recent call last):
        ...
        ValueError: amount=3 is larger than the number of entries still unpruned in row 1 (2)
    """
    if isinstance(amount, numbers.Integral):
        short = torch.nonzero(available < int(amount)).flatten()
        if short.numel():
            row = int(short[0])
            raise ValueError(
                f"amount={amount} is larger than the number of entries still unpruned in row {row} "
                f"({int(available[row])})"
            )
        return torch.full_like(available, int(amount))
    return torch.round(available.to(torch.float64) * float(amount)).to(torch.int64)


def rowwise_mask(
    amount: int | float | None,
    scores: Tensor,
    base: Tensor | None,
    dtype: torch.dtype,
    *,
    magnitude: bool = True,
    sparsity: float | None = None,
    dim: int = 0,
) -> Tensor:
    """``base`` (``None``: all ones) with the ``amount`` lowest-ranked entries of every row set to 0.

    A row is a slice along ``dim`` (``scores.select(dim, i)``). Only entries where ``base`` is 1 are ranked and
    counted; ``magnitude=False`` ranks the signed scores (higher kept). Ties: the lower flat index is pruned first.
    With ``sparsity`` instead of ``amount``, every row is pruned up to ``round(sparsity * row length)`` entries, those
    already pruned included (rows already there lose none).

    Example:
        >>> rowwise_mask(1, torch.tensor([[3.0, -1.0], [0.5, 2.0]]), None, torch.bool)
        tensor([[ True, False],
                [False,  True]])
        >>> rowwise_mask(1, torch.tensor([[3.0, -1.0], [0.5, 2.0]]), None, torch.bool, dim=1)  # rows: the columns
        tensor([[ True, False],
                [False,  True]])
    """
    if scores.dim() < 2:
        raise ValueError(
            f"per-row pruning needs a tensor of at least 2 dims (rows along dim {dim}), got shape {tuple(scores.shape)}"
        )
    dim = normalize_dim(scores, dim)
    if dim % scores.dim():  # rows along another dim: rank the moved views (their entries keep their flat order)
        moved_base = None if base is None else base.movedim(dim, 0)
        mask = rowwise_mask(amount, scores.movedim(dim, 0), moved_base, dtype, magnitude=magnitude, sparsity=sparsity)
        return mask.movedim(0, dim).contiguous()
    rows = scores.shape[0]
    flat = scores.flatten(1)  # (reshape(rows, -1) cannot infer a row's length without rows)
    eligible = None if base is None else base.flatten(1)
    eligible_bool = None if eligible is None else (eligible if eligible.dtype == torch.bool else eligible == 1)
    if eligible_bool is None:
        available = torch.full((rows,), flat.shape[1], dtype=torch.int64, device=scores.device)
    else:
        available = eligible_bool.sum(dim=1)
    if sparsity is None:
        counts = row_counts(amount, available)  # type: ignore[arg-type]
    else:
        wanted = round(sparsity * flat.shape[1])
        counts = (wanted - (flat.shape[1] - available)).clamp(min=0)
    ranks = group_ranks(flat, eligible_bool, magnitude=magnitude, ineligible_first=False)
    keep = ranks >= counts.unsqueeze(1)
    if eligible_bool is not None:
        keep &= eligible_bool
    if base is None:
        return _to_mask_dtype(keep.view(scores.shape), dtype)
    return _zero_where(base, ~keep.view(scores.shape) & eligible_bool.view(scores.shape), dtype)


def _zero_where(base: Tensor, pruned: Tensor, dtype: torch.dtype) -> Tensor:
    """A copy of ``base`` with ``pruned`` entries set to 0, in ``dtype`` (fractional entries keep their value)."""
    mask = base.clone()
    mask.masked_fill_(pruned.to(mask.device), 0)
    return _to_mask_dtype(mask, dtype)


class RowwiseL1Unstructured(BasePruningMethod):
    """Prune the entries with the smallest absolute score in every row: each row keeps the same count.

    The ranking of Wanda (Sun et al. 2023): a row is ``t.select(dim, i)``, flattened over the other dims (an output
    neuron of a Linear weight, a filter of a Conv weight; ``dim=1`` for the output units of an ``(in, out)`` weight,
    such as transformers' ``Conv1D``). ``amount`` applies to every row, to the entries it still has:
    a float prunes ``round(amount * remaining)`` of them (halves to even), an int that many (refused when a row has
    fewer). Ties are broken by flat index, the lower one pruned first, as :class:`~lightprune.prune.L1Unstructured`
    does; ``NaN`` ranks above ``+inf``.

    ``PRUNING_TYPE`` is ``"global"``, so inside a :class:`~lightprune.prune.PruningContainer` the method sees the whole
    tensor and the mask in force (an ``"unstructured"`` method would get the flattened unpruned entries, without
    rows); it ranks only the entries that mask keeps, and entries already pruned stay pruned. Ranking sorts each row
    (``O(n log n)``, one key tensor of the weight's size).

    Args:
        amount: a float in [0, 1] (the fraction of each row's unpruned entries) or an int (how many per row).
        dim: the dim the rows are slices along (default 0: ``(out, in, ...)`` weights).

    Example:
        >>> from lightprune import prune
        >>> scores = torch.tensor([[0.1, -3.0, 2.0, -0.5], [4.0, 1.0, 1.0, 5.0]])
        >>> prune.RowwiseL1Unstructured(amount=0.5).compute_mask(scores, torch.ones(2, 4))
        tensor([[0., 1., 1., 0.],
                [1., 0., 0., 1.]])
    """

    PRUNING_TYPE = "global"
    #: rank ``|score|`` (``False`` in the signed variant, :class:`~lightprune.prune.signed.SignedRowwise`)
    _by_magnitude = True

    def __init__(self, amount: int | float, dim: int = 0) -> None:
        validate_amount(amount)
        check_dim(dim)
        self.amount = amount
        self.dim = dim

    def compute_mask(self, t: Tensor, default_mask: Tensor) -> Tensor:
        return rowwise_mask(
            self.amount, t, default_mask, default_mask.dtype, magnitude=self._by_magnitude, dim=self.dim
        )

    def _next_mask(self, scores: Tensor, current: Tensor | None, dtype: torch.dtype) -> Tensor:
        return rowwise_mask(self.amount, scores, current, dtype, magnitude=self._by_magnitude, dim=self.dim)

    def __repr__(self) -> str:
        rows = f", dim={self.dim}" if self.dim else ""
        return f"{type(self).__name__}(amount={self.amount!r}{rows})"

    @classmethod
    def apply(  # type: ignore[override]
        cls,
        module: nn.Module,
        name: str,
        amount: int | float,
        importance_scores: Tensor | None = None,
        dim: int = 0,
    ) -> BasePruningMethod:
        """Prune ``amount`` of every row (slice along ``dim``) of ``module.<name>`` by the smallest
        ``|importance_scores|`` (default: the tensor's values)."""
        return super().apply(module, name, amount=amount, importance_scores=importance_scores, dim=dim)


class RowwiseToSparsity(RowwiseL1Unstructured):
    """Prune every row up to a total ``sparsity``, counting the entries it already lost: ``PruningCallback``'s
    per-row target, exact per row also when rows start uneven (zeros adopted from a checkpoint).

    Args:
        sparsity: the share of every row's entries pruned afterwards (rows already sparser keep their mask).
        by_magnitude: rank ``|score|`` (``True``) or the signed score, higher kept.
        dim: the dim the rows are slices along.

    Example:
        >>> default = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 1.0]])
        >>> RowwiseToSparsity(0.5).compute_mask(torch.tensor([[1.0, 2.0, 3.0, 4.0]] * 2), default)
        tensor([[0., 0., 1., 1.],
                [0., 0., 0., 1.]])
    """

    def __init__(self, sparsity: float, by_magnitude: bool = True, dim: int = 0) -> None:
        validate_amount(float(sparsity))
        self.amount = self.sparsity = float(sparsity)
        self._by_magnitude = by_magnitude
        self.dim = dim

    def compute_mask(self, t: Tensor, default_mask: Tensor) -> Tensor:
        return self._next_mask(t, default_mask, default_mask.dtype)

    def _next_mask(self, scores: Tensor, current: Tensor | None, dtype: torch.dtype) -> Tensor:
        return rowwise_mask(
            None, scores, current, dtype, magnitude=self._by_magnitude, sparsity=self.sparsity, dim=self.dim
        )

    def __repr__(self) -> str:
        rows = f", dim={self.dim}" if self.dim else ""
        return f"{type(self).__name__}(sparsity={self.sparsity!r}{rows})"
