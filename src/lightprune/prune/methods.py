"""The built-in pruning methods: Identity, RandomUnstructured, L1Unstructured, RandomStructured, LnStructured and
CustomFromMask.

Each method offers torch's ``compute_mask(t, default_mask)`` and, privately, ``_next_mask(scores, current, dtype)``:
the mask after the method is applied on top of ``current`` with a container's semantics (unstructured methods choose
among entries still equal to 1, structured ones among channels not yet all zero). The engine calls the latter, which
selects with an exact O(n) threshold pass (:mod:`lightprune.prune.k_smallest`): no ``topk``, no sort, no boolean
indexing of the full tensor, and ties broken by flat index so the same input always gives the same mask.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lightprune.prune.amount import (
    NotATensorError,
    _compute_norm,
    _compute_nparams_toprune,
    _validate_pruning_amount,
    _validate_structured_pruning,
    normalize_dim,
    validate_amount,
)
from lightprune.prune.base import BasePruningMethod, _check_same_shape, _to_mask_dtype
from lightprune.prune.k_smallest import apply_cut, count_eligible, find_cut, select_smallest

__all__ = [
    "CustomFromMask",
    "Identity",
    "L1Unstructured",
    "LnStructured",
    "RandomStructured",
    "RandomUnstructured",
]


def _unstructured_mask(
    amount: int | float,
    scores: Tensor,
    base: Tensor | None,
    *,
    restrict: bool,
    dtype: torch.dtype,
    magnitude: bool,
    largest: bool,
    draw: bool = False,
) -> Tensor:
    """``base`` (None: all ones) with the ``amount`` lowest-ranked entries set to 0.

    With ``restrict`` the entries are chosen among those where ``base == 1`` and ``amount`` refers to them;
    otherwise among all entries of ``scores``. With ``draw`` (``RandomUnstructured``) the scores are uniform draws
    of ``scores``' shape, drawn once the amount is checked and only if it prunes something: torch checks first and
    draws nothing for a count of 0, so the generator is left where torch leaves it (and unmoved by a refused call).
    """
    eligible = base if restrict else None
    available = count_eligible([eligible], [scores])
    k = _compute_nparams_toprune(amount, available)
    _validate_pruning_amount(k, available)
    if draw:  # (nothing to prune: zeros, which select nothing)
        scores = uniform_draws(scores, eligible=eligible) if k else torch.zeros(scores.shape, device=scores.device)
    out = torch.empty(scores.shape, dtype=dtype, device=scores.device)
    cut = find_cut([scores], k, eligible=[eligible], magnitude=magnitude, largest=largest)
    apply_cut([scores], cut, out=[out], eligible=[eligible], base=[base], magnitude=magnitude, largest=largest)
    return out


def uniform_draws(like: Tensor, eligible: Tensor | None = None, dtype: torch.dtype | None = None) -> Tensor:
    """Uniform numbers in [0, 1) of ``like``'s shape and device, in float32 (float64 for a float64 ``like``, or
    ``dtype`` where given).

    Never in a 16-bit dtype, whose few distinct values make ties, nor in an integer one. With ``eligible`` (a mask:
    bool, or numeric where 1 means eligible) only the eligible entries are drawn, in flat order, and the others hold
    0: torch's ``PruningContainer`` draws for the entries still unpruned, so a seed gives torch's mask on an already
    pruned tensor too and leaves the generator where torch leaves it.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> draws = uniform_draws(torch.zeros(4), eligible=torch.tensor([True, False, True, False]))
        >>> _ = torch.manual_seed(0)
        >>> torch.equal(draws[[0, 2]], torch.rand(2)), draws[[1, 3]].tolist()
        (True, [0.0, 0.0])
    """
    if dtype is None:
        dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
    if eligible is None:
        return torch.rand(like.shape, dtype=dtype, device=like.device)
    keep = _eligible_on(like, eligible)
    draws = torch.zeros(like.shape, dtype=dtype, device=like.device)
    return draws.masked_scatter_(keep, torch.rand(int(keep.sum()), dtype=dtype, device=like.device))


def _eligible_on(like: Tensor, eligible: Tensor) -> Tensor:
    """``eligible`` (bool, or numeric where 1 means eligible) as a bool tensor on ``like``'s device."""
    return (eligible if eligible.dtype == torch.bool else eligible == 1).to(like.device)


def joint_uniform_draws(likes: list[Tensor], eligible: list[Tensor | None]) -> list[Tensor]:
    """:func:`uniform_draws` for several tensors as one vector of their eligible entries, in order: what torch's
    ``global_unstructured`` draws for ``RandomUnstructured`` (one ``rand_like`` of the concatenated scores).

    All are drawn in one dtype, as torch draws in the dtype ``cat`` promotes them to (float64 where one is float64).
    On the CPU the generator's stream is sequential, so one draw per tensor gives the same numbers and holds less
    memory at once; on a GPU (Philox: each call starts its numbers at a fresh offset) only one draw gives torch's
    numbers, so tensors on one GPU are drawn together, then scattered back.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> a, b = joint_uniform_draws([torch.zeros(2), torch.zeros(3)], [None, torch.tensor([1.0, 0.0, 1.0])])
        >>> _ = torch.manual_seed(0)
        >>> torch.equal(torch.cat([a, b[[0, 2]]]), torch.rand(4)), b[1].item()
        (True, 0.0)
    """
    dtype = torch.float64 if any(like.dtype == torch.float64 for like in likes) else torch.float32  # cat's promotion
    devices = {like.device for like in likes}
    if len(devices) != 1 or next(iter(devices)).type == "cpu":
        return [uniform_draws(like, eligible=e, dtype=dtype) for like, e in zip(likes, eligible, strict=True)]
    keeps = [None if e is None else _eligible_on(like, e) for like, e in zip(likes, eligible, strict=True)]
    counts = [like.numel() if keep is None else int(keep.sum()) for like, keep in zip(likes, keeps, strict=True)]
    draws = torch.rand(sum(counts), dtype=dtype, device=likes[0].device).split(counts)
    out = []
    for like, keep, piece in zip(likes, keeps, draws, strict=True):
        if keep is None:
            out.append(piece.view(like.shape))
        else:
            out.append(torch.zeros(like.shape, dtype=dtype, device=like.device).masked_scatter_(keep, piece))
    return out


def _active_channels(mask: Tensor | None, dim: int) -> Tensor | None:
    """Channels along ``dim`` that ``mask`` does not zero entirely (torch: ``mask.sum(other dims) != 0``)."""
    if mask is None:
        return None
    other = [d for d in range(mask.dim()) if d != dim]
    if mask.dtype == torch.bool:
        return torch.count_nonzero(mask, dim=other) > 0
    return mask.sum(dim=other) != 0


def _channel_mask(pruned: Tensor, dim: int, shape: torch.Size, base: Tensor | None, dtype: torch.dtype) -> Tensor:
    """``base`` (None: ones) with every channel in ``pruned`` (a bool vector along ``dim``) set to 0."""
    view = [1] * len(shape)
    view[dim] = shape[dim]
    keep = (~pruned).view(view)
    if base is None:
        out = torch.empty(shape, dtype=dtype, device=pruned.device)
        out.copy_(keep.expand(shape))
        return out
    return _to_mask_dtype(base * keep.to(base.device), dtype)


class _StructuredMethod(BasePruningMethod):
    """Shared steps of the structured methods: validate, find the channels still there, rank, zero channels."""

    PRUNING_TYPE = "structured"
    amount: int | float
    dim: int

    def _rank(self, scores: Tensor, dim: int, active: Tensor | None, available: int, k: int) -> Tensor:
        """Bool vector over the channels along ``dim``: True for the ``k`` channels to prune."""
        raise NotImplementedError

    def _check_ranking(self, scores: Tensor, dim: int, available: int) -> None:
        """Raise what ranking ``available`` channels of ``scores`` would raise, even when none is pruned."""

    def _masked(self, scores: Tensor, base: Tensor | None, *, restrict: bool, dtype: torch.dtype) -> Tensor | None:
        _validate_structured_pruning(scores)
        dim = normalize_dim(scores, self.dim)
        active = _active_channels(base, dim) if restrict else None
        available = scores.shape[dim] if active is None else int(active.sum())
        k = _compute_nparams_toprune(self.amount, available)
        _validate_pruning_amount(k, available)
        if k == 0:  # nothing to rank; with k > 0 the ranking itself raises what the check would
            self._check_ranking(scores, dim, available)
            return None
        pruned = self._rank(scores, dim, active, available, k)
        return _channel_mask(pruned.to(scores.device), dim, scores.shape, base, dtype)

    def compute_mask(self, t: Tensor, default_mask: Tensor) -> Tensor:
        mask = self._masked(t, default_mask, restrict=False, dtype=default_mask.dtype)
        return default_mask if mask is None else mask

    def _next_mask(self, scores: Tensor, current: Tensor | None, dtype: torch.dtype) -> Tensor:
        mask = self._masked(scores, current, restrict=True, dtype=dtype)
        if mask is None:
            return torch.ones(scores.shape, dtype=dtype, device=scores.device) if current is None else current
        return mask


class Identity(BasePruningMethod):
    """A method that prunes nothing: the mask stays as it is (all ones on a fresh tensor).

    Useful to put a tensor under the reparametrization without removing anything.

    Example:
        >>> from lightprune import prune
        >>> layer = prune.identity(torch.nn.Linear(2, 2), "weight")
        >>> layer.weight_mask
        tensor([[1., 1.],
                [1., 1.]])
    """

    PRUNING_TYPE = "unstructured"

    def compute_mask(self, t: Tensor, default_mask: Tensor) -> Tensor:
        return default_mask

    def _next_mask(self, scores: Tensor, current: Tensor | None, dtype: torch.dtype) -> Tensor:
        if current is None:
            return torch.ones(scores.shape, dtype=dtype, device=scores.device)
        return current

    @classmethod
    def apply(cls, module: nn.Module, name: str) -> Identity:  # type: ignore[override]
        """Put ``module.<name>`` under the reparametrization with an all-ones mask."""
        return super().apply(module, name)


class RandomUnstructured(BasePruningMethod):
    """Prune entries chosen uniformly at random.

    Draws uniform numbers from the global generator and prunes the entries with the largest draws, as torch
    does: on a fresh float32 or float64 tensor the same seed gives torch's mask (when the draws have no ties).

    The draws are float32 (float64 for a float64 tensor) whatever the tensor's dtype. Torch draws in the
    tensor's dtype: a bfloat16 ``rand`` has about 1700 distinct values, so the entries at the threshold tie by the
    thousand and the tie-break decides, e.g. ``amount=0.001`` of a 1000 x 1000 bfloat16 weight prunes only entries
    of its first quarter. Integer tensors work too (torch's ``rand_like`` refuses them).

    Args:
        amount: a float in [0, 1] (the fraction of the entries still unpruned) or an int (how many of them).

    Example:
        >>> from lightprune import prune
        >>> _ = torch.manual_seed(0)
        >>> layer = prune.random_unstructured(torch.nn.Linear(10, 10), "weight", amount=0.3)
        >>> int((layer.weight_mask == 0).sum())
        30
    """

    PRUNING_TYPE = "unstructured"

    def __init__(self, amount: int | float) -> None:
        validate_amount(amount)
        self.amount = amount

    def compute_mask(self, t: Tensor, default_mask: Tensor) -> Tensor:
        return _unstructured_mask(
            self.amount,
            t,
            default_mask,
            restrict=False,
            dtype=default_mask.dtype,
            magnitude=False,
            largest=True,
            draw=True,
        )

    def _next_mask(self, scores: Tensor, current: Tensor | None, dtype: torch.dtype) -> Tensor:
        return _unstructured_mask(
            self.amount, scores, current, restrict=True, dtype=dtype, magnitude=False, largest=True, draw=True
        )

    @classmethod
    def apply(cls, module: nn.Module, name: str, amount: int | float) -> BasePruningMethod:  # type: ignore[override]
        """Prune ``amount`` random entries of ``module.<name>``."""
        return super().apply(module, name, amount=amount)


class L1Unstructured(BasePruningMethod):
    """Prune the entries with the smallest absolute value (of the importance scores, by default the tensor).

    Exact: a float amount prunes ``round(amount * n)`` entries, and ties are broken by flat index (lower first).

    ``NaN`` and ``inf``: magnitudes rank as in ``torch.topk``, ``NaN`` above ``+inf``, so NaN entries are pruned last
    (and ``-0.0`` ties with ``+0.0``); the counts stay exact whatever the values. The pruned attribute
    ``module.<name>`` depends on the mask dtype: with a floating mask (the default) a pruned entry is
    ``orig * 0``, which is ``NaN`` where ``orig`` is ``inf`` or ``NaN``, as in torch; with a ``torch.bool`` mask
    (:func:`mask_dtype`) it is selected with ``torch.where`` and is an exact ``0`` whatever ``orig`` holds.

    Args:
        amount: a float in [0, 1] (the fraction of the entries still unpruned) or an int (how many of them).

    Example:
        >>> from lightprune import prune
        >>> prune.L1Unstructured(amount=0.5).compute_mask(torch.tensor([0.1, -3.0, 2.0, -0.5]), torch.ones(4))
        tensor([0., 1., 1., 0.])
    """

    PRUNING_TYPE = "unstructured"
    #: rank ``|score|`` (``False`` in the signed variant, :class:`~lightprune.prune.signed.SignedUnstructured`)
    _by_magnitude = True

    def __init__(self, amount: int | float) -> None:
        validate_amount(amount)
        self.amount = amount

    def compute_mask(self, t: Tensor, default_mask: Tensor) -> Tensor:
        return _unstructured_mask(
            self.amount,
            t,
            default_mask,
            restrict=False,
            dtype=default_mask.dtype,
            magnitude=self._by_magnitude,
            largest=False,
        )

    def _next_mask(self, scores: Tensor, current: Tensor | None, dtype: torch.dtype) -> Tensor:
        return _unstructured_mask(
            self.amount, scores, current, restrict=True, dtype=dtype, magnitude=self._by_magnitude, largest=False
        )

    @classmethod
    def apply(  # type: ignore[override]
        cls, module: nn.Module, name: str, amount: int | float, importance_scores: Tensor | None = None
    ) -> BasePruningMethod:
        """Prune the ``amount`` smallest-magnitude entries of ``module.<name>`` (or of ``importance_scores``)."""
        return super().apply(module, name, amount=amount, importance_scores=importance_scores)


class RandomStructured(_StructuredMethod):
    """Prune whole channels along ``dim``, chosen uniformly at random.

    Draws one ``torch.rand`` value per channel still present (as torch does, so the same seed gives torch's
    channels) and prunes the channels with the smallest draws.

    Args:
        amount: a float in [0, 1] (the fraction of the channels still present) or an int (how many of them).
        dim: the dimension whose slices are the channels (``-1``, the last, by default).

    Example:
        >>> from lightprune import prune
        >>> _ = torch.manual_seed(0)
        >>> layer = prune.random_structured(torch.nn.Linear(3, 4), "weight", amount=2, dim=0)
        >>> layer.weight_mask.sum(dim=1)
        tensor([3., 3., 0., 0.])
    """

    def __init__(self, amount: int | float, dim: int = -1) -> None:
        validate_amount(amount)
        self.amount = amount
        self.dim = dim

    def _rank(self, scores: Tensor, dim: int, active: Tensor | None, available: int, k: int) -> Tensor:
        draws = torch.rand(available)
        chosen = select_smallest([draws], k)[0]
        channels = scores.shape[dim]
        if active is None:
            return chosen
        pruned = torch.zeros(channels, dtype=torch.bool)
        pruned[torch.nonzero(active.cpu()).flatten()[chosen]] = True
        return pruned

    @classmethod
    def apply(  # type: ignore[override]
        cls, module: nn.Module, name: str, amount: int | float, dim: int = -1
    ) -> BasePruningMethod:
        """Prune ``amount`` random channels of ``module.<name>`` along ``dim``."""
        return super().apply(module, name, amount=amount, dim=dim)


class LnStructured(_StructuredMethod):
    """Prune the channels along ``dim`` with the smallest Ln norm.

    Args:
        amount: a float in [0, 1] (the fraction of the channels still present) or an int (how many of them).
        n: the norm's order, anything ``torch.norm`` takes as ``p``: an int or float, ``inf``, ``-inf``, ``'fro'``,
            ``'nuc'``. The norms are the installed torch's (see ``_compute_norm``): ``'fro'`` over more than two
            dims besides ``dim`` raises up to torch 2.13 and is the 2-norm from torch 2.14 on; ``'nuc'`` needs
            exactly two dims besides ``dim`` in every version (torch 2.14+ prunes arbitrary channels otherwise).
        dim: the dimension whose slices are the channels (``-1`` by default).

    Example:
        >>> from lightprune import prune
        >>> weight = torch.tensor([[1.0, 1.0], [3.0, 0.0], [0.1, 0.2]])
        >>> prune.LnStructured(amount=1, n=2, dim=0).compute_mask(weight, torch.ones(3, 2))
        tensor([[1., 1.],
                [1., 1.],
                [0., 0.]])
    """

    #: A channel's norm includes its entries already pruned: on a pruned tensor they count as 0 (torch ranks
    #: ``module.<name>``, the masked value), so the engine passes the masked tensor as the default scores.
    _ranks_pruned_entries = True

    def __init__(self, amount: int | float, n: Any, dim: int = -1) -> None:
        validate_amount(amount)
        self.amount = amount
        self.n = n
        self.dim = dim

    def _check_ranking(self, scores: Tensor, dim: int, available: int) -> None:
        # torch computes the norms even for amount 0, so an ``n`` torch.norm refuses for this shape or dtype
        # ('fro' over three dims, a negative order over an empty dim, an integer tensor) fails on every call.
        # A tensor of the same dims and dtype, each dim cut to at most 1, raises the same errors at no cost
        # (a meta tensor would too, but its first use imports torch's Python meta kernels: seconds).
        shape = [min(size, 1) for size in scores.shape]
        shape[dim] = min(available, 1)
        self._channel_norms(torch.zeros(shape, dtype=scores.dtype), dim, scores.shape)

    def _rank(self, scores: Tensor, dim: int, active: Tensor | None, available: int, k: int) -> Tensor:
        norms = self._channel_norms(scores, dim, scores.shape)
        return select_smallest([norms], k, eligible=[active])[0]

    def _channel_norms(self, scores: Tensor, dim: int, shape: torch.Size) -> Tensor:
        """One norm per channel along ``dim``, or a ``RuntimeError`` where ``n`` gives no such thing.

        That happens for ``n='nuc'`` unless exactly two dims are left besides ``dim``: a nuclear norm is a matrix
        norm. torch up to 2.13 raises there (``torch.norm``); torch 2.14 and later take the nuclear norm over the
        tensor's last two dims instead (for a conv weight and ``dim=0``, one value per input *and* output channel)
        and rank channels by that, which prunes an arbitrary number of channels, or none. lightprune raises in
        every torch version: a deliberate difference, documented in the README.
        """
        norms = _compute_norm(scores, self.n, dim)
        if norms.shape != (scores.shape[dim],):
            raise RuntimeError(
                f"LnStructured(n={self.n!r}, dim={self.dim}) has no norm per channel for a tensor of shape "
                f"{tuple(shape)}: a nuclear norm needs exactly two dims besides dim, this tensor has "
                f"{len(shape) - 1}; use n='fro' or a number"
            )
        return norms

    @classmethod
    def apply(  # type: ignore[override]
        cls,
        module: nn.Module,
        name: str,
        amount: int | float,
        n: Any,
        dim: int,
        importance_scores: Tensor | None = None,
    ) -> BasePruningMethod:
        """Prune the ``amount`` channels of ``module.<name>`` along ``dim`` with the smallest Ln norm."""
        return super().apply(module, name, amount=amount, n=n, dim=dim, importance_scores=importance_scores)


class CustomFromMask(BasePruningMethod):
    """Apply a mask given by the caller (combined with whatever is already pruned).

    Args:
        mask: a tensor of the parameter's shape; zeros prune. A floating mask may hold fractions, which scale the
            entries, as in torch; a ``torch.bool`` mask store (see ``mask_dtype``) accepts only 0 and 1.

    Example:
        >>> from lightprune import prune
        >>> layer = prune.custom_from_mask(torch.nn.Linear(2, 2), "weight", mask=torch.tensor([[1, 0], [0, 1]]))
        >>> layer.weight_mask
        tensor([[1., 0.],
                [0., 1.]])
    """

    PRUNING_TYPE = "global"

    def __init__(self, mask: Tensor) -> None:
        self.mask = mask

    def _checked_mask(self, shape: torch.Size, device: torch.device) -> Tensor:
        if self.mask is None:
            raise ValueError(
                "this CustomFromMask has no mask: global_unstructured's hooks do not keep theirs once applied "
                "(it is the module's <name>_mask buffer); create CustomFromMask(mask) to apply a mask"
            )
        if not isinstance(self.mask, Tensor):
            raise NotATensorError(f"mask must be a Tensor, got {type(self.mask).__name__}")
        _check_same_shape(self.mask, torch.empty(shape, device="meta"), "mask", "the pruned tensor")
        return self.mask.to(device=device)

    def compute_mask(self, t: Tensor, default_mask: Tensor) -> Tensor:
        mask = self._checked_mask(default_mask.shape, default_mask.device)
        return default_mask * mask.to(dtype=default_mask.dtype)

    def _next_mask(self, scores: Tensor, current: Tensor | None, dtype: torch.dtype) -> Tensor:
        mask = self._checked_mask(scores.shape, scores.device)
        if current is None:
            return _to_mask_dtype(mask.clone(), dtype)
        if current.dtype == torch.bool and mask.dtype != torch.bool:
            mask = _to_mask_dtype(mask, torch.bool)
        return _to_mask_dtype(current * mask, dtype)

    @classmethod
    def apply(cls, module: nn.Module, name: str, mask: Tensor) -> BasePruningMethod:  # type: ignore[override]
        """Prune ``module.<name>`` with the given ``mask``."""
        return super().apply(module, name, mask=mask)
