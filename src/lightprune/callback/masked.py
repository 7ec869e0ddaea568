"""The tensors one PruningCallback masks, every place they live, and the events that grow their masks.

A :class:`MaskedSelection` knows the selected ``(qualified name, module, name)`` triples, the other modules holding
a selected Parameter (tied weights), the channel biases that follow structured weights and the averaged copies of
the model kept by weight-averaging callbacks; all of them share the selected tensors' masks. It prunes to a target
sparsity with exact counts, all or nothing, and saves or restores the masks by qualified name. It knows nothing of
Lightning: the callback owns the clock and decides when.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightprune import prune
from lightprune.callback.inplace import InPlaceMasks
from lightprune.callback.masks import bias_name, mask_of, original, restore_problems, share_mask
from lightprune.prune.base import ModuleSnapshot, find_hook
from lightprune.prune.masking import masked_
from lightprune.prune.state_dict import PlainStateDict

__all__ = ["MaskedSelection"]

Triples = list[tuple[str, nn.Module, str]]


class MaskedSelection:
    """The selected tensors of a model and their masks.

    Args:
        selection: ``(qualified name, module, name)`` of each selected tensor (a tied Parameter once).
        ties: for each selected tensor held by other modules too, ``(module, name, [(qualified, other, name)])``.
        biases: modules whose bias follows the weight's pruned output channels.
        method: the pruning method class; ``method_kwargs`` its arguments besides ``amount``.
        scope: ``"global"`` (one ranking) or ``"layerwise"``.
        mask_dtype: dtype of new masks (``None``: the parameter's).
        seed: seed of the random methods' draws, combined with each event's time.
        inplace: between events, keep the masks apart (:class:`~lightprune.callback.inplace.InPlaceMasks`) and the
            tensors plain Parameters, zeroed in place; events put the reparametrization back for their duration.

    Example:
        >>> net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        >>> selection = [("0.weight", net[0], "weight"), ("1.weight", net[1], "weight")]
        >>> masked = MaskedSelection(selection, [], [], prune.L1Unstructured, {}, "global", torch.bool, 0)
        >>> masked.prune_to(0.5, event=0)
        >>> sum(pruned for _, pruned in masked.counts()), sorted(masked.masks())
        (12, ['0.weight', '1.weight'])
    """

    def __init__(
        self,
        selection: Triples,
        ties: list[tuple[nn.Module, str, Triples]],
        biases: list[nn.Module],
        method: type[prune.BasePruningMethod],
        method_kwargs: Mapping[str, Any],
        scope: str,
        mask_dtype: torch.dtype | None,
        seed: int,
        inplace: bool = False,
    ) -> None:
        self.selection, self.ties, self.biases = selection, ties, biases
        self.method, self.method_kwargs, self.scope = method, dict(method_kwargs), scope
        self.structured = getattr(method, "PRUNING_TYPE", None) == "structured"
        self.mask_dtype, self.seed = mask_dtype, seed
        self.averages: list[nn.Module] = []  # copies of the model kept by weight-averaging callbacks
        self.plain_state_dict = PlainStateDict([])  # what checkpoints of the model write plainly
        self.inplace = InPlaceMasks() if inplace else None

    def mask(self, module: nn.Module, name: str) -> Tensor | None:
        """The mask of ``module.<name>`` (under the reparametrization or kept apart in place), or ``None``."""
        if self.inplace is not None:
            kept = self.inplace.mask(module, name)
            if kept is not None:
                return kept
        return mask_of(module, name)

    # ------------------------------------------------------------------------------------------------------------
    # What is masked
    # ------------------------------------------------------------------------------------------------------------

    def named_pairs(self) -> Triples:
        """Every tensor this selection masks, with its qualified name: selected, tied owners, channel biases."""
        named = list(self.selection)
        named += [other for _, _, others in self.ties for other in others]
        return named + [(bias_name(q), m, "bias") for q, m, _ in self.selection if m in self.biases]

    def pairs(self) -> list[tuple[nn.Module, str]]:
        """:meth:`named_pairs` without the names."""
        return [(module, name) for _, module, name in self.named_pairs()]

    def units(self, module: nn.Module, name: str) -> tuple[int, int]:
        """``(units, pruned units)`` of a tensor: entries, or channels along ``dim`` for structured methods."""
        tensor = original(module, name)
        mask = self.mask(module, name)
        if not self.structured:
            pruned = 0 if mask is None else tensor.numel() - int(torch.count_nonzero(mask))
            return tensor.numel(), pruned
        dim = self.method_kwargs["dim"] % tensor.dim()
        if mask is None:
            return tensor.shape[dim], 0
        other = [d for d in range(mask.dim()) if d != dim]
        return tensor.shape[dim], int((torch.count_nonzero(mask, dim=other) == 0).sum())

    def counts(self) -> list[tuple[int, int]]:
        """:meth:`units` of every selected tensor."""
        return [self.units(module, name) for _, module, name in self.selection]

    # ------------------------------------------------------------------------------------------------------------
    # Events
    # ------------------------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _seeded(self, event: int) -> Iterator[None]:
        """Draw random masks from ``(seed, event)`` alone, leaving the global generators as they were."""
        tensors = [original(module, name) for _, module, name in self.selection]
        devices = sorted({t.device.index or 0 for t in tensors if t.is_cuda})
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed((self.seed * 1_000_003 + event) % (2**63))
            yield

    @contextlib.contextmanager
    def all_or_nothing(self) -> Iterator[None]:
        """Undo every mask change of the block if it raises (also ``KeyboardInterrupt``): an event is applied whole.

        A layerwise event prunes its tensors one call at a time; the engine rolls back only the failing call, so a
        failure at the second tensor would leave the first one at the new target (a half-applied event, in the model
        and in any checkpoint written on the exception).
        """
        snapshots = [(ModuleSnapshot.take(module, name), name) for module, name in self.pairs()]
        try:
            yield
        except BaseException:
            for snapshot, name in reversed(snapshots):
                snapshot.restore(name)
            raise

    @contextlib.contextmanager
    def reparametrized(self) -> Iterator[None]:
        """In place mode: put the reparametrization back for the block (an event, a restore), take it away after."""
        if self.inplace is None:
            yield
            return
        self.inplace.give_back()
        try:
            yield
        finally:
            self.inplace.take(self.pairs())

    def prune_to(self, target: float, event: int) -> None:
        """Prune the selection up to ``target`` total sparsity (exact counts), as one event: all of it or nothing."""
        with self.reparametrized(), prune.mask_dtype(self.mask_dtype), self._seeded(event), self.all_or_nothing():
            if self.scope == "global":
                counts = self.counts()
                total = sum(units for units, _ in counts)
                increment = round(target * total) - sum(pruned for _, pruned in counts)
                if increment > 0:
                    pairs = [(module, name) for _, module, name in self.selection]
                    prune.global_unstructured(pairs, self.method, amount=increment, **self.method_kwargs)
            else:
                for _, module, name in self.selection:
                    units, pruned = self.units(module, name)
                    increment = round(target * units) - pruned
                    if increment > 0:
                        self.method.apply(module, name, amount=increment, **self.method_kwargs)
            for module in self.biases:
                _prune_bias(module)
            self._share_everywhere()

    def _share_everywhere(self) -> None:
        """Give every other place a selected tensor lives the very mask of the selected owner.

        Tied owners get the reparametrization too (``name_orig`` is the same Parameter, so the tie holds), so every
        module computes with the masked values during training. The averaged copies of weight-averaging callbacks
        (found by qualified name) are masked the same way: EMA and SWA average the parameters position by position
        and copy the average back over the model, so their copies must compute with, save and hand back the masked
        average.
        """
        for module, name, others in self.ties:
            mask = mask_of(module, name)
            if mask is not None:
                for _, other, other_name in others:
                    share_mask(other, other_name, mask)
        named = self.named_pairs()
        self.plain_state_dict.pairs = [(module, name) for _, module, name in named]
        if self.inplace is not None:
            return  # the averaged copies stay plain too: apply_in_place zeroes them
        for average in self.averages:
            mirrored = []
            for qualified, module, name in named:
                mask = mask_of(module, name)
                if mask is not None:
                    counterpart = average.get_submodule(qualified.rsplit(".", 1)[0] if "." in qualified else "")
                    share_mask(counterpart, name, mask)
                    mirrored.append((counterpart, name))
            _plain_state_dict_of(average).pairs = mirrored

    def apply_in_place(self) -> None:
        """In place mode: zero the pruned entries of the weights and of the averaged copies' weights."""
        if self.inplace is None:
            return
        self.inplace.apply()
        with torch.no_grad():
            for average in self.averages:
                for qualified, module, name in self.named_pairs():
                    mask = self.inplace.mask(module, name)
                    if mask is not None:
                        counterpart = average.get_submodule(qualified.rsplit(".", 1)[0] if "." in qualified else "")
                        weight = getattr(counterpart, name)
                        masked_(weight, mask.to(weight.device))

    def make_permanent(self) -> None:
        """Remove the reparametrization of the tensors this selection masks (others' are left alone); in place,
        zero the weights a last time and stop masking gradients."""
        if self.inplace is not None:
            self.apply_in_place()
            self.inplace.remove_hooks()
            return
        for module, name in self.pairs():
            if find_hook(module, name)[1] is not None:
                prune.remove(module, name)

    # ------------------------------------------------------------------------------------------------------------
    # Checkpoints
    # ------------------------------------------------------------------------------------------------------------

    def _mask_targets(self) -> dict[str, tuple[nn.Module, str]]:
        """The tensors whose masks go into checkpoints, by qualified name: the selection and the channel biases."""
        targets = {qualified: (module, name) for qualified, module, name in self.selection}
        targets.update((bias_name(q), (m, "bias")) for q, m, _ in self.selection if m in self.biases)
        return targets

    def masks(self) -> dict[str, Tensor]:
        """The masks by qualified name, for a checkpoint (tensors not pruned yet have none)."""
        found = {key: self.mask(module, name) for key, (module, name) in self._mask_targets().items()}
        return {key: mask for key, mask in found.items() if mask is not None}

    def restore(self, saved: Mapping[str, Tensor], owner: str) -> None:
        """Put a checkpoint's masks back, checked first (``owner`` names the state in messages), all or nothing."""
        targets = self._mask_targets()
        problems = restore_problems(saved, targets)
        if problems:
            raise ValueError(
                f"{owner}: the checkpoint's masks do not fit the model (nothing was changed):\n  "
                + "\n  ".join(problems)
            )
        with self.reparametrized(), self.all_or_nothing():
            for key, mask in saved.items():
                module, name = targets[key]
                current = mask_of(module, name)
                if current is not None and torch.equal(current.to(mask.dtype), mask.to(current.device)):
                    continue
                if current is not None:
                    prune.remove(module, name)
                with prune.mask_dtype(mask.dtype):
                    prune.custom_from_mask(module, name, mask=mask)
            self._share_everywhere()

    def share_with_averages(self, averages: list[nn.Module]) -> None:
        """Mask these averaged copies of the model too, now and after every event."""
        self.averages = averages
        self._share_everywhere()


def _prune_bias(module: nn.Module) -> None:
    """Zero the bias entries of the output channels the weight's mask has removed entirely."""
    weight_mask = module._buffers.get("weight_mask")
    if weight_mask is None:
        return
    keep = torch.count_nonzero(weight_mask, dim=list(range(1, weight_mask.dim()))) > 0
    bias_mask = mask_of(module, "bias")
    if bias_mask is not None and torch.equal(bias_mask != 0, keep):
        return
    prune.custom_from_mask(module, "bias", mask=keep)


def _plain_state_dict_of(module: nn.Module) -> PlainStateDict:
    """The :class:`PlainStateDict` hook of an averaged copy, registered on first use."""
    for hook in module._state_dict_hooks.values():
        if isinstance(hook, PlainStateDict):
            return hook
    hook = PlainStateDict([])
    module.register_state_dict_post_hook(hook)
    return hook
