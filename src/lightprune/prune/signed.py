"""Ranking by the signed score, higher kept: variants of the magnitude methods for signed importance scores.

``L1Unstructured``, ``RowwiseL1Unstructured`` and ``SemiStructured`` rank ``|importance_scores|``, as torch's
methods do. Some criteria are signed: movement pruning's score ``S = -sum_t W * dL/dW`` is negative for a weight
moving towards zero, and such a weight must rank *below* one with ``S = 0``, not above. The variants here rank the
score itself (the lowest pruned), with the same exact selection, tie rule (lower flat index pruned first) and
container semantics; ``NaN`` ranks above ``+inf``. They differ from their parent only in that one flag.

Example:
    >>> import torch
    >>> scores = torch.tensor([-3.0, 1.0, 2.0, -0.5])
    >>> SignedUnstructured(amount=2).compute_mask(scores, torch.ones(4))
    tensor([0., 1., 1., 0.])
"""

from __future__ import annotations

from lightprune.prune.base import BasePruningMethod
from lightprune.prune.methods import L1Unstructured
from lightprune.prune.rowwise import RowwiseL1Unstructured
from lightprune.prune.semi_structured import SemiStructured

__all__ = ["SignedRowwise", "SignedSemiStructured", "SignedUnstructured", "signed_variant"]


class SignedUnstructured(L1Unstructured):
    """:class:`~lightprune.prune.L1Unstructured` ranking the signed scores: the ``amount`` lowest are pruned.

    Example:
        >>> import torch
        >>> SignedUnstructured(amount=1).compute_mask(torch.tensor([0.5, -1.0]), torch.ones(2))
        tensor([1., 0.])
    """

    _by_magnitude = False


class SignedRowwise(RowwiseL1Unstructured):
    """:class:`~lightprune.prune.RowwiseL1Unstructured` ranking the signed scores in every row.

    Example:
        >>> import torch
        >>> SignedRowwise(amount=1).compute_mask(torch.tensor([[0.5, -1.0], [-2.0, 3.0]]), torch.ones(2, 2))
        tensor([[1., 0.],
                [0., 1.]])
    """

    _by_magnitude = False


class SignedSemiStructured(SemiStructured):
    """:class:`~lightprune.prune.SemiStructured` keeping the ``n`` highest signed scores of every group.

    Example:
        >>> import torch
        >>> SignedSemiStructured(n=1, m=2).compute_mask(torch.tensor([[0.5, -1.0]]), torch.ones(1, 2))
        tensor([[1., 0.]])
    """

    _by_magnitude = False


_SIGNED: dict[type[BasePruningMethod], type[BasePruningMethod]] = {
    L1Unstructured: SignedUnstructured,
    RowwiseL1Unstructured: SignedRowwise,
    SemiStructured: SignedSemiStructured,
}


def signed_variant(method: type[BasePruningMethod]) -> type[BasePruningMethod]:
    """The class ranking signed scores that stands for ``method``, or a ``ValueError`` if it has none.

    Example:
        >>> signed_variant(L1Unstructured).__name__
        'SignedUnstructured'
    """
    if method in _SIGNED.values():
        return method
    if method not in _SIGNED:
        allowed = ", ".join(cls.__name__ for cls in _SIGNED)
        raise ValueError(
            f"{getattr(method, '__name__', method)} cannot rank signed scores (e.g. movement scores): use one of "
            f"{allowed}"
        )
    return _SIGNED[method]
