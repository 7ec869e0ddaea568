"""N:M semi-structured sparsity: in every group of ``M`` consecutive input entries, keep the ``N`` highest scores.

The layout is NVIDIA ASP's (2:4 sparse tensor cores): a group is ``M`` consecutive entries along the input dimension
(dim 1: a Linear weight's columns; for a Conv weight ``(out, in, *kernel)``, ``M`` input channels at one output
channel and one kernel position). A weight stored transposed, ``(in, out)`` as transformers' ``Conv1D``, takes
``dim=0``. Like :class:`~lightprune.prune.RowwiseL1Unstructured` the method is of ``PRUNING_TYPE`` ``"global"``, so a
:class:`~lightprune.prune.PruningContainer` hands it the whole tensor and the mask in force.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightprune._checks import is_int
from lightprune.prune.amount import check_dim
from lightprune.prune.base import BasePruningMethod, _to_mask_dtype
from lightprune.prune.ranks import group_ranks

__all__ = ["SemiStructured", "check_n_m", "semi_structured_mask"]


def check_n_m(n: int, m: int) -> None:
    """Refuse anything but ints ``1 <= n < m``, naming the bad value.

    Example:
        >>> check_n_m(2, 4)
        >>> check_n_m(4, 4)
        Traceback (most recent call last):
        ...
        ValueError: n=4 must be smaller than m=4: an N:M pattern keeps n of every m entries
    """
    for label, value in (("n", n), ("m", m)):
        if not is_int(value):
            raise TypeError(f"{label}={value!r} must be an int >= 1")
        if value < 1:
            raise ValueError(f"{label}={value!r} must be an int >= 1")
    if n >= m:
        raise ValueError(f"n={n} must be smaller than m={m}: an N:M pattern keeps n of every m entries")


def _check_layout(shape: torch.Size, m: int, dim: int) -> int:
    """The input dim, normalized; refuse a tensor without one or whose input dim ``M`` does not divide."""
    if len(shape) < 2:
        raise ValueError(f"N:M pruning needs a weight of at least 2 dims (out, in, ...), got shape {tuple(shape)}")
    if not -len(shape) <= dim < len(shape):
        raise ValueError(f"dim={dim} is out of range for a tensor of shape {tuple(shape)}")
    dim %= len(shape)
    if shape[dim] % m:
        raise ValueError(
            f"N:M pruning with m={m} needs the input dim (dim {dim}) to be a multiple of m; the tensor of shape "
            f"{tuple(shape)} has {shape[dim]}"
        )
    return dim


def semi_structured_mask(
    n: int, m: int, scores: Tensor, base: Tensor | None, dtype: torch.dtype, *, dim: int = 1, magnitude: bool = True
) -> Tensor:
    """``base`` (``None``: all ones) with the ``m - n`` lowest-ranked entries of every group of ``m`` set to 0.

    Entries where ``base`` is not 1 rank lowest, so they are among each group's pruned ones (and stay pruned even
    when a group already has more than ``m - n`` of them). ``magnitude=False`` ranks the signed scores (higher kept).
    Ties: the lower index within the group is pruned first.

    Example:
        >>> semi_structured_mask(2, 4, torch.tensor([[1.0, -4.0, 3.0, 2.0]]), None, torch.bool)
        tensor([[False,  True,  True, False]])
    """
    dim = _check_layout(scores.shape, m, dim)
    moved = scores.movedim(dim, -1)
    grouped_shape = (*moved.shape[:-1], moved.shape[-1] // m, m)
    eligible = None
    if base is not None:
        eligible = base if base.dtype == torch.bool else base == 1
        eligible = eligible.movedim(dim, -1).reshape(grouped_shape)
    ranks = group_ranks(moved.reshape(grouped_shape), eligible, magnitude=magnitude, ineligible_first=True)
    pruned = (ranks < m - n).reshape(moved.shape).movedim(-1, dim)
    if base is None:
        return _to_mask_dtype(~pruned, dtype)
    mask = base.clone()
    mask.masked_fill_(pruned.to(mask.device), 0)
    return _to_mask_dtype(mask, dtype)


class SemiStructured(BasePruningMethod):
    """N:M sparsity: keep the ``n`` highest ``|scores|`` of every ``m`` consecutive entries along the input dim.

    The pattern of sparse tensor cores (2:4 on NVIDIA Ampere and later), in NVIDIA ASP's layout: groups of ``m``
    entries along ``dim`` (1, the input dim of Linear and Conv weights; 0 for a ``(in, out)`` weight such as
    transformers' ``Conv1D``). Entries already pruned (``default_mask`` 0) stay pruned and count as the lowest
    scores of their group. Ties are broken by position: the lower index in the group is pruned first. ``NaN`` ranks
    above ``+inf``. A weight whose input dim is not a multiple of ``m`` is refused.

    The pattern is fixed, so there is no ``amount``: the method prunes ``1 - n/m`` of every group at once, and
    applying it again changes nothing. ``PRUNING_TYPE`` is ``"global"``: a
    :class:`~lightprune.prune.PruningContainer` hands it the whole tensor and the mask in force.

    Args:
        n: entries kept per group, an int >= 1.
        m: the group's size, an int > ``n``.
        dim: the input dim along which groups run (default 1).

    Example:
        >>> from lightprune import prune
        >>> weight = torch.tensor([[0.1, -3.0, 2.0, -0.5, 1.0, 1.0, 0.0, 4.0]])
        >>> prune.SemiStructured(n=2, m=4).compute_mask(weight, torch.ones(1, 8))
        tensor([[0., 1., 1., 0., 0., 1., 0., 1.]])
    """

    PRUNING_TYPE = "global"
    #: rank ``|score|`` (``False`` in the signed variant, :class:`~lightprune.prune.signed.SignedSemiStructured`)
    _by_magnitude = True

    def __init__(self, n: int = 2, m: int = 4, dim: int = 1) -> None:
        check_n_m(n, m)
        check_dim(dim)
        self.n, self.m, self.dim = int(n), int(m), int(dim)

    def compute_mask(self, t: Tensor, default_mask: Tensor) -> Tensor:
        return semi_structured_mask(
            self.n, self.m, t, default_mask, default_mask.dtype, dim=self.dim, magnitude=self._by_magnitude
        )

    def _next_mask(self, scores: Tensor, current: Tensor | None, dtype: torch.dtype) -> Tensor:
        return semi_structured_mask(self.n, self.m, scores, current, dtype, dim=self.dim, magnitude=self._by_magnitude)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(n={self.n}, m={self.m}, dim={self.dim})"

    @classmethod
    def apply(  # type: ignore[override]
        cls,
        module: nn.Module,
        name: str,
        n: int = 2,
        m: int = 4,
        dim: int = 1,
        importance_scores: Tensor | None = None,
    ) -> BasePruningMethod:
        """Give ``module.<name>`` the N:M pattern of its ``|importance_scores|`` (default: its values)."""
        return super().apply(module, name, n=n, m=m, dim=dim, importance_scores=importance_scores)
