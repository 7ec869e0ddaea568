"""How the callback holds its masks: the interface of a mask strategy, the reparametrized strategy, and the rules
every strategy follows.

A :class:`~lightprune.callback.masked_selection.MaskedSelection` decides what is masked and by how much; a
:class:`MaskStrategy` holds the masks and applies them. Three strategies exist:

- :class:`ReparametrizedMasks` (here): torch's contract, ``name_orig * name_mask`` recomputed before every forward.
  Tied owners of a selected Parameter and the averaged copies of weight-averaging callbacks share the very same
  mask tensor.
- :class:`~lightprune.callback.inplace.InPlaceMasks`: the tensors stay plain Parameters, the masks are kept apart
  and applied to gradients and weights in place at the steps of training that need it.
- :class:`~lightprune.callback.sharded.ShardedMasks`: DTensor parameters (FSDP2, ``ModelParallelStrategy``), each
  rank keeping the masks of its local shards, in place.

The rules they share live once, here: how many units an event prunes (:func:`exact_increment`), which channel biases
follow a weight's pruned rows (:func:`bias_keep`) and whether a checkpoint's masks fit the model
(:func:`check_restored`). In a checkpoint the masks travel in the callback's state, keyed by qualified name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from lightprune import prune
from lightprune.callback import reconstruction

if TYPE_CHECKING:
    from lightprune.callback.masked_selection import MaskedSelection

__all__ = [
    "MaskStrategy",
    "ReparametrizedMasks",
    "bias_keep",
    "bias_name",
    "check_restored",
    "exact_increment",
    "mask_of",
    "owner_in",
    "plain_state_dict_of",
    "replace_mask",
    "share_mask",
    "units_of",
]

Pairs = Sequence[tuple[nn.Module, str]]


def mask_of(module: nn.Module, name: str) -> Tensor | None:
    """The mask of ``module.<name>`` under the reparametrization, or ``None`` while it is not pruned.

    Example:
        >>> layer = torch.nn.Linear(2, 2)
        >>> mask_of(layer, "weight") is None, mask_of(prune.identity(layer, "weight"), "weight").shape
        (True, torch.Size([2, 2]))
    """
    return module._buffers[name + "_mask"] if name in prune.pruned_names(module) else None


def bias_name(weight_name: str) -> str:
    """The qualified name of the bias beside a qualified weight name.

    Example:
        >>> bias_name("features.0.weight"), bias_name("weight")
        ('features.0.bias', 'bias')
    """
    return weight_name.rsplit(".", 1)[0] + ".bias" if "." in weight_name else "bias"


def share_mask(module: nn.Module, name: str, mask: Tensor) -> None:
    """Mask ``module.<name>`` with ``mask`` itself (the same tensor, or a copy on the parameter's device).

    Example:
        >>> a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
        >>> b.weight = a.weight
        >>> _ = prune.l1_unstructured(a, "weight", amount=2)
        >>> share_mask(b, "weight", a.weight_mask)
        >>> b.weight_mask is a.weight_mask, b.weight_orig is a.weight_orig, torch.equal(a.weight, b.weight)
        (True, True, True)
    """
    if name not in prune.pruned_names(module):
        prune.custom_from_mask(module, name, mask=mask, mask_dtype=mask.dtype)
    device = prune.original(module, name).device
    module._buffers[name + "_mask"] = mask if mask.device == device else mask.to(device)
    prune.refresh_pruned(module)


def exact_increment(target: float, units: int, pruned: int, max_sparsity: float = 1.0) -> int:
    """How many more units an event to ``target`` prunes among ``units`` of which ``pruned`` are pruned already:
    ``round(target * units) - pruned``, the total stopped at the ``max_sparsity`` cap
    (:func:`~lightprune.prune.collapse.capped_count`). Global events pass the sums over their tensors.

    Example:
        >>> exact_increment(0.5, 10, 2), exact_increment(0.5, 10, 2, max_sparsity=0.4), exact_increment(0.1, 10, 3)
        (3, 2, -2)
    """
    from lightprune.prune.collapse import capped_count

    return capped_count(target, units, max_sparsity) - pruned


def bias_keep(weight_mask: Tensor, bias: Tensor, owner: str) -> Tensor:
    """Which bias entries to keep: those of the output channels (rows, dim 0) whose weight mask is not all zero.

    Sharded tensors pass their local shards: bias and weight must then be sharded alike along dim 0.

    Example:
        >>> bias_keep(torch.tensor([[1, 0], [0, 0]], dtype=torch.bool), torch.zeros(2), "Linear")
        tensor([ True, False])
    """
    keep = torch.count_nonzero(weight_mask, dim=list(range(1, weight_mask.dim()))) > 0
    if keep.shape != bias.shape:
        raise ValueError(
            f"the local bias of {owner} has shape {tuple(bias.shape)} but its weight's local shard has "
            f"{keep.numel()} rows: bias and weight must be sharded alike along dim 0"
        )
    return keep


def check_restored(masks: Mapping[str, Tensor], targets: Mapping[str, tuple[nn.Module, str]], owner: str) -> None:
    """Refuse a checkpoint's masks that cannot be put back on ``targets`` (qualified name -> ``(module, name)``):
    unknown names, other shapes (the parameter's full shape), dtypes that are not masks; ``owner`` names the state.

    Raises:
        ValueError: naming every problem; nothing was changed then.

    Example:
        >>> layer = torch.nn.Linear(2, 2)
        >>> check_restored({"fc.weight": torch.ones(3, dtype=torch.bool)}, {"fc.weight": (layer, "weight")}, "state")
        Traceback (most recent call last):
        ...
        ValueError: state: the checkpoint's masks do not fit the model (nothing was changed):
          the mask of 'fc.weight' has shape (3,), the parameter (2, 2)
    """
    problems = []
    for key, mask in masks.items():
        if key not in targets:
            problems.append(
                f"{key!r} is not selected by this callback (a renamed layer or another selection? the selection "
                f"is {sorted(targets)})"
            )
            continue
        shape = tuple(prune.original(*targets[key]).shape)
        if tuple(mask.shape) != shape:
            problems.append(f"the mask of {key!r} has shape {tuple(mask.shape)}, the parameter {shape}")
        elif mask.dtype != torch.bool and not mask.dtype.is_floating_point:
            problems.append(f"the mask of {key!r} has dtype {mask.dtype}; masks are torch.bool or floating")
    if problems:
        raise ValueError(
            f"{owner}: the checkpoint's masks do not fit the model (nothing was changed):\n  " + "\n  ".join(problems)
        )


def replace_mask(module: nn.Module, name: str, mask: Tensor) -> None:
    """Reparametrize ``module.<name>`` with ``mask`` (in its dtype) instead of any mask it had.

    Example:
        >>> layer = prune.l1_unstructured(nn.Linear(2, 2), "weight", amount=3)
        >>> replace_mask(layer, "weight", torch.ones(2, 2, dtype=torch.bool))
        >>> int(layer.weight_mask.sum())
        4
    """
    if mask_of(module, name) is not None:
        prune.remove(module, name)
    prune.custom_from_mask(module, name, mask=mask, mask_dtype=mask.dtype)


def units_of(tensor: Tensor, mask: Tensor | None, dim: int | None) -> tuple[int, int]:
    """``(units, pruned units)`` of ``tensor`` under ``mask``: entries, or channels along ``dim`` (structured).

    Example:
        >>> units_of(torch.ones(2, 3), torch.tensor([[0, 0, 0], [1, 0, 1]]), None), units_of(torch.ones(2, 3), None, 0)
        ((6, 4), (2, 0))
    """
    if dim is None:
        return tensor.numel(), 0 if mask is None else tensor.numel() - int(torch.count_nonzero(mask))
    dim = dim % tensor.dim()
    if mask is None:
        return tensor.shape[dim], 0
    other = [d for d in range(mask.dim()) if d != dim]
    return tensor.shape[dim], int((torch.count_nonzero(mask, dim=other) == 0).sum())


class MaskStrategy:
    """How the masks of a :class:`~lightprune.callback.masked_selection.MaskedSelection` are held and applied.

    Subclasses: :class:`ReparametrizedMasks`, :class:`~lightprune.callback.inplace.InPlaceMasks`,
    :class:`~lightprune.callback.sharded.ShardedMasks`. The selection calls only these methods; it never asks which
    strategy it has. Events computed by the engine run inside :meth:`editing`, where the masks are under the
    reparametrization; the per-step hooks (:meth:`attach`, :meth:`before_optimizer_step`, :meth:`after_rewrite`)
    are the training loop's. The methods' defaults hold the masks under the reparametrization (torch's contract,
    which needs no per-step work); :class:`ReparametrizedMasks` is that strategy by name.

    Example:
        >>> strategy = ReparametrizedMasks()
        >>> layer = nn.Linear(2, 2)
        >>> strategy.put(layer, "weight", torch.tensor([[True, False], [True, True]]))
        >>> strategy.counts([(layer, "weight")], None), strategy.collective
        ([(4, 1)], False)
    """

    collective = False  # counting needs every process (each holds a part of every mask)
    permanent = False  # made permanent: the masks are gone, the pruned entries are the weights' zeros

    def mask(self, module: nn.Module, name: str) -> Tensor | None:
        """The mask of ``module.<name>``, or ``None`` while it has none."""
        return mask_of(module, name)

    def put(self, module: nn.Module, name: str, mask: Tensor) -> None:
        """Mask ``module.<name>`` with ``mask`` from now on, replacing any mask it had (zeros where pruned now)."""
        replace_mask(module, name, mask)

    def counts(self, pairs: Pairs, dim: int | None) -> list[tuple[int, int]]:
        """``(units, pruned units)`` of each tensor: entries, or channels along ``dim``. Once the masks were made
        permanent, the pruned units are read from the plain weights' zeros."""
        found = []
        for module, name in pairs:
            tensor = prune.original(module, name)
            mask = self.mask(module, name)
            if mask is None and self.permanent:
                mask = tensor.detach() != 0
            found.append(units_of(tensor, mask, dim))
        return found

    @contextlib.contextmanager
    def editing(self, pairs: Pairs) -> Iterator[None]:
        """A block in which the engine changes the masks of ``pairs`` under the reparametrization: all or nothing
        (every mask change is undone if it raises, also ``KeyboardInterrupt``)."""
        with prune.transaction(pairs):
            yield

    def prune_to(self, masked: MaskedSelection, target: float, scores: Any, signed: bool) -> None:
        """An event to ``target``, computed by the engine (see :meth:`MaskedSelection.engine_event`)."""
        with self.editing(masked.pairs()):
            masked.engine_event(target, scores, signed)

    def reconstruct(
        self,
        masked: MaskedSelection,
        triples: list[tuple[str, nn.Module, str]],
        target: float,
        hessian_of: Callable[[str], Tensor],
        n_m: tuple[int, int] | None,
    ) -> None:
        """An OBS event on ``triples`` (:func:`~lightprune.callback.reconstruction.reconstruct`: prune to ``target``
        and update the kept weights from each layer's ``H``), all or nothing."""
        with self.editing(masked.pairs()):
            reconstruction.reconstruct(
                triples, masked.mask, target, masked.scope, hessian_of, n_m=n_m, mask_dtype=masked.mask_dtype
            )
            masked.share_everywhere()

    def adopt_zeros(self, masked: MaskedSelection) -> None:
        """Mask every entry of the selected tensors that is exactly zero now, on top of any mask: all or nothing."""
        with self.editing(masked.pairs()):
            for _, module, name in masked.selection:
                with torch.no_grad():
                    keep = getattr(module, name) != 0
                if not bool(keep.all()):
                    prune.custom_from_mask(module, name, mask=keep, mask_dtype=masked.mask_dtype)
            masked.share_everywhere()

    def restore(self, masked: MaskedSelection, saved: Mapping[str, Tensor], owner: str) -> None:
        """Put a checkpoint's masks back, checked first (:func:`check_restored`), all or nothing."""
        targets = masked.mask_targets()
        check_restored(saved, targets, owner)
        with self.editing(masked.pairs()):
            for key, mask in saved.items():
                module, name = targets[key]
                current = mask_of(module, name)
                if current is not None and torch.equal(current.to(mask.dtype), mask.to(current.device)):
                    continue
                replace_mask(module, name, mask)
            masked.share_everywhere()

    def saved_mask(self, mask: Tensor, tensor: Tensor) -> Tensor:
        """How ``mask`` (of ``tensor``) goes into the callback's checkpoint state."""
        return mask

    def save_checkpoint(self, checkpoint: dict[str, Any], state_key: str) -> None:
        """Lay out the callback ``state_key``'s masks in ``checkpoint`` (they are in its state already)."""

    def logged_mask(self, module: nn.Module, name: str, rank: int) -> Tensor:
        """The mask whose zeros this process counts in the logged sparsities (all ones while there is none)."""
        mask = self.mask(module, name)
        return torch.ones_like(prune.original(module, name), dtype=torch.bool) if mask is None else mask

    def share_with_averages(self, masked: MaskedSelection, averages: list[nn.Module]) -> None:
        """Mask the averaged copies of weight-averaging callbacks with the model's own mask tensors."""
        named = masked.named_pairs()
        for average in averages:
            mirrored = []
            for qualified, module, name in named:
                mask = mask_of(module, name)
                if mask is not None:
                    counterpart = owner_in(average, qualified)
                    share_mask(counterpart, name, mask)
                    mirrored.append((counterpart, name))
            plain_state_dict_of(average).pairs = mirrored

    def attach(self, trainer: Any, pl_module: Any, masked: MaskedSelection) -> list[Any]:
        """Training starts: register what the strategy needs at every step; returns handles to remove at the end."""
        return []

    def before_optimizer_step(self) -> None:
        """The gradients are final (accumulated, unscaled), before clipping and the optimizer step."""

    def after_rewrite(self, masked: MaskedSelection) -> None:
        """Something rewrote the weights (a rewind, a weight average copied back): mask them again."""

    def follow_parameters(self) -> None:
        """The model moved to another device (Lightning moves it back to the CPU after fit): keep every mask on its
        tensor's device. Masks held as the model's buffers moved with it."""

    def finish(self, masked: MaskedSelection, make_permanent: bool) -> None:
        """End of fit: remove the reparametrization of the selection's tensors when ``make_permanent``."""
        if not make_permanent:
            return
        for module, name in masked.pairs():
            if name in prune.pruned_names(module):
                prune.remove(module, name)
        self.permanent = True


class ReparametrizedMasks(MaskStrategy):
    """torch's contract: ``name_orig``, ``name_mask`` and ``name = name_orig * name_mask`` before every forward; the
    gradient of ``name_orig`` is masked by autograd, so no step of training needs a pass of its own.

    Example:
        >>> layer = nn.Linear(4, 2)
        >>> ReparametrizedMasks().put(layer, "weight", torch.arange(8).reshape(2, 4) % 2 == 0)
        >>> prune.is_pruned(layer), int((layer.weight == 0).sum())
        (True, 4)
    """


def owner_in(model: nn.Module, qualified: str) -> nn.Module:
    """The module of ``model`` that owns the tensor named ``qualified`` (``"features.0.weight"`` -> ``features.0``).

    Example:
        >>> owner_in(nn.Sequential(nn.Linear(2, 2)), "0.weight")
        Linear(in_features=2, out_features=2, bias=True)
    """
    return model.get_submodule(qualified.rsplit(".", 1)[0] if "." in qualified else "")


def plain_state_dict_of(module: nn.Module) -> Any:
    """The :class:`~lightprune.prune.state_dict.PlainStateDict` hook of an averaged copy, registered on first use.

    Example:
        >>> layer = nn.Linear(2, 2)
        >>> plain_state_dict_of(layer) is plain_state_dict_of(layer)
        True
    """
    from lightprune.prune.state_dict import PlainStateDict

    for hook in module._state_dict_hooks.values():
        if isinstance(hook, PlainStateDict):
            return hook
    hook = PlainStateDict([])
    module.register_state_dict_post_hook(hook)
    return hook
