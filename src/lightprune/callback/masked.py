"""The tensors one PruningCallback masks, every place they live, and the events that grow their masks.

A :class:`MaskedSelection` knows the selected ``(qualified name, module, name)`` triples, the other modules holding
a selected Parameter (tied weights), the channel biases that follow structured weights and the averaged copies of
the model kept by weight-averaging callbacks; all of them share the selected tensors' masks. It prunes to a target
sparsity with exact counts, all or nothing, and saves or restores the masks by qualified name. It knows nothing of
Lightning: the callback owns the clock and decides when.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightprune import adapters, prune
from lightprune.callback import reconstruction, sharded
from lightprune.callback.inplace import InPlaceMasks
from lightprune.callback.masks import bias_name, mask_of, restore_problems, share_mask
from lightprune.callback.options import is_n_m
from lightprune.callback.regrowth import zero_optimizer_state
from lightprune.layouts import input_dim
from lightprune.prune import allocation, distributed
from lightprune.prune.collapse import LayerCollapseWarning, cap_units, capped_count
from lightprune.prune.masking import masked_
from lightprune.prune.regrow import drop_and_grow, moved_count
from lightprune.prune.rowwise import RowwiseToSparsity
from lightprune.prune.signed import signed_variant
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
        scope: ``"global"`` (one ranking), ``"layerwise"`` or ``"row"`` (every row of every tensor to the target),
            ``"erk"`` or ``"owl"`` (each tensor ranked alone, its count from :mod:`lightprune.prune.allocation`).
        mask_dtype: dtype of new masks (``None``: the parameter's).
        seed: seed of the random methods' draws, combined with each event's time.
        inplace: between events, keep the masks apart (:class:`~lightprune.callback.inplace.InPlaceMasks`) and the
            tensors plain Parameters, zeroed in place; events put the reparametrization back for their duration.
        max_layer_sparsity: no tensor is pruned beyond this share of its units; a global (or ERK, OWL) event still
            prunes its exact count (from the tensors under the cap), a layerwise one stops each tensor at the cap.
        adapted: the adapted layers (LoRA, see :mod:`lightprune.adapters`) by the qualified name of their selected
            base weight: once that weight has a mask, the layer's forward masks its update with it, and events rank
            the effective weight ``W + update``.
        owl: OWL's ``(M, lambda)`` for ``scope="owl"`` (:mod:`lightprune.prune.allocation`).

    Sharded tensors (DTensors: FSDP2, ``ModelParallelStrategy``) are always masked in place, each rank keeping the
    mask of its local shard only (``torch.bool`` unless ``mask_dtype`` says otherwise); events select with
    :mod:`lightprune.prune.distributed` (histograms summed across ranks), never under the reparametrization.

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
        max_layer_sparsity: float = 1.0,
        adapted: Mapping[str, nn.Module] | None = None,
        owl: tuple[float, float] = (allocation.OWL_THRESHOLD, allocation.OWL_LAMBDA),
    ) -> None:
        self.owl_threshold, self.owl_lambda = owl
        self.selection, self.ties, self.biases = selection, ties, biases
        self.adapted = dict(adapted or {})
        self.method, self.method_kwargs, self.scope = method, dict(method_kwargs), scope
        self.structured = getattr(method, "PRUNING_TYPE", None) == "structured"
        self.n_m = is_n_m(method)  # a fixed N:M pattern, built per layer along its input dim
        self.mask_dtype, self.seed = mask_dtype, seed
        self.max_layer_sparsity = max_layer_sparsity
        self.averages: list[nn.Module] = []  # copies of the model kept by weight-averaging callbacks
        self.plain_state_dict = PlainStateDict([])  # what checkpoints of the model write plainly
        tensors = [prune.original(module, name) for _, module, name in selection]
        self.sharded = any(distributed.is_sharded(t) for t in tensors)
        self.group = distributed.group_of(tensors) if self.sharded else None
        self.inplace = InPlaceMasks() if inplace or self.sharded else None
        self.permanent = False  # made permanent: the masks are gone, the pruned entries are the weights' zeros

    def mask(self, module: nn.Module, name: str) -> Tensor | None:
        """The mask of ``module.<name>`` (under the reparametrization or kept apart in place), or ``None``."""
        if self.inplace is not None:
            kept = self.inplace.mask(module, name)
            if kept is not None:
                return kept
        return mask_of(module, name)

    def weight(self, qualified: str, module: nn.Module, name: str) -> Tensor:
        """The weight events rank (detached): ``W + update`` for an adapted base weight, else the Parameter."""
        layer = self.adapted.get(qualified)
        return prune.original(module, name).detach() if layer is None else adapters.effective_weight(layer)

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
        """``(units, pruned units)`` of a tensor: entries, or channels along ``dim`` for structured methods.

        After :meth:`make_permanent` removed the reparametrization, the pruned units are read from the plain weight:
        its zero entries, or its all-zero channels.

        Example:
            >>> layer = nn.Linear(4, 2)
            >>> masked = MaskedSelection([("fc.weight", layer, "weight")], [], [], prune.L1Unstructured, {},
            ...                          "layerwise", torch.bool, 0)
            >>> masked.prune_to(0.5, event=0)
            >>> masked.units(layer, "weight")
            (8, 4)
            >>> masked.make_permanent()
            >>> prune.is_pruned(layer), masked.units(layer, "weight")
            (False, (8, 4))
        """
        if self.sharded:
            return self._sharded_counts([(module, name)])[0]
        tensor = prune.original(module, name)
        mask = self.mask(module, name)
        if mask is None and self.permanent:
            mask = tensor.detach() != 0
        if not self.structured:
            pruned = 0 if mask is None else tensor.numel() - int(torch.count_nonzero(mask))
            return tensor.numel(), pruned
        dim = self.method_kwargs["dim"] % tensor.dim()
        if mask is None:
            return tensor.shape[dim], 0
        other = [d for d in range(mask.dim()) if d != dim]
        return tensor.shape[dim], int((torch.count_nonzero(mask, dim=other) == 0).sum())

    def collapsed(self) -> list[str]:
        """Qualified names of the selected tensors with every unit pruned (no weight, or no channel, left).

        Example:
            >>> layer = nn.Linear(2, 2)
            >>> masked = MaskedSelection([("fc.weight", layer, "weight")], [], [], prune.L1Unstructured, {},
            ...                          "layerwise", torch.bool, 0)
            >>> masked.prune_to(1.0, event=0)
            >>> masked.collapsed()
            ['fc.weight']
        """
        counts = self.counts()
        return [q for (q, _, _), (units, pruned) in zip(self.selection, counts, strict=True) if 0 < units == pruned]

    def counts(self) -> list[tuple[int, int]]:
        """:meth:`units` of every selected tensor."""
        if self.sharded:  # one all_reduce for all of them
            return self._sharded_counts([(module, name) for _, module, name in self.selection])
        return [self.units(module, name) for _, module, name in self.selection]

    def _sharded_counts(self, pairs: list[tuple[nn.Module, str]]) -> list[tuple[int, int]]:
        tensors = [prune.original(module, name) for module, name in pairs]
        masks = [self.mask(module, name) for module, name in pairs]
        dim = self.method_kwargs["dim"] if self.structured else None
        return distributed.pruned_units(tensors, masks, dim=dim, group=self.group)

    # ------------------------------------------------------------------------------------------------------------
    # Events
    # ------------------------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _seeded(self, event: int) -> Iterator[None]:
        """Draw random masks from ``(seed, event)`` alone, leaving the global generators as they were."""
        tensors = [prune.original(module, name) for _, module, name in self.selection]
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
        with prune.transaction(self.pairs()):
            yield

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

    def prune_to(
        self, target: float, event: int, scores: Mapping[str, Tensor] | None = None, signed: bool = False
    ) -> None:
        """Prune the selection up to ``target`` total sparsity (exact counts), as one event: all of it or nothing.

        ``scores`` (by qualified name) rank instead of the weights, as ``importance_scores``; ``signed`` ranks them
        by value, higher kept (:mod:`lightprune.prune.signed`). The ``"row"`` scope prunes every row (dim 0) to
        ``target``; an N:M method applies its pattern whatever ``target`` says.
        """
        if self.sharded:
            with self._seeded(event):
                self._prune_sharded(target, scores, signed)
            return
        cap = self.max_layer_sparsity
        # new masks get self.mask_dtype through the calls' mask_dtype= (the user's prune.mask_dtype setting is theirs)
        with self.reparametrized(), self._seeded(event), self.all_or_nothing():
            method = signed_variant(self.method) if signed else self.method
            if scores is None and self.adapted:  # rank the effective weights W + update
                scores = {q: self.weight(q, m, n) for q, m, n in self.selection}
            if self.n_m:
                for qualified, module, name in self.selection:
                    pattern = method(**{**self.method_kwargs, "dim": input_dim(module)})
                    self._apply(module, name, pattern, scores, qualified)
            elif self.scope == "row":
                for qualified, module, name in self.selection:
                    self._apply(module, name, RowwiseToSparsity(target, by_magnitude=not signed), scores, qualified)
                self._check_caps(target)
            elif self.scope == "global":
                counts = self.counts()
                total = sum(units for units, _ in counts)
                increment = round(target * total) - sum(pruned for _, pruned in counts)
                if increment > 0:
                    pairs = [(module, name) for _, module, name in self.selection]
                    by_pair = None if scores is None else {(m, n): scores[q] for q, m, n in self.selection}
                    with warnings.catch_warnings():  # the callback says it, naming the tensors (PruningCallback)
                        warnings.simplefilter("ignore", LayerCollapseWarning)
                        prune.global_unstructured(
                            pairs,
                            method,
                            importance_scores=by_pair,
                            mask_dtype=self.mask_dtype,
                            max_layer_sparsity=cap,
                            amount=increment,
                            **self.method_kwargs,
                        )
            elif self.scope in ("erk", "owl") and target > 0:  # (a ramp's level-0 event has no scores: nothing to do)
                for (qualified, module, name), count, (_, pruned) in zip(
                    self.selection, self.allocate(target, scores), self.counts(), strict=True
                ):
                    if count > pruned:
                        more = method(amount=count - pruned, **self.method_kwargs)
                        self._apply(module, name, more, scores, qualified)
            else:
                for qualified, module, name in self.selection:
                    units, pruned = self.units(module, name)
                    increment = capped_count(target, units, cap) - pruned
                    if increment > 0:
                        self._apply(module, name, method(amount=increment, **self.method_kwargs), scores, qualified)
            for module in self.biases:
                _prune_bias(module, self.mask_dtype)
            self._share_everywhere()

    def allocate(self, target: float, scores: Mapping[str, Tensor] | None = None) -> list[int]:
        """ERK or OWL: how many weights each selected tensor has pruned in all after an event to ``target``.

        The total is exactly ``round(target * total)``; a tensor keeps at least what it has pruned already and gives
        at most its ``max_layer_sparsity`` share. OWL's outlier ratios come from ``scores`` (``|W| * ||X||``), over
        each tensor's unpruned entries.

        Example:
            >>> net = nn.Sequential(nn.Linear(2, 2), nn.Linear(20, 20), nn.Linear(10, 20))
            >>> selection = [(f"{i}.weight", net[i], "weight") for i in range(3)]
            >>> MaskedSelection(selection, [], [], prune.L1Unstructured, {}, "erk", torch.bool, 0).allocate(0.5)
            [0, 230, 72]
        """
        shapes = [tuple(prune.original(module, name).shape) for _, module, name in self.selection]
        counts = self.counts()
        if self.scope == "erk":
            weights = allocation.erk_weights(shapes)
        else:
            if scores is None:
                raise ValueError("scope='owl' allocates by the outliers of activation scores, and none were given")
            ratios = [
                allocation.outlier_ratio(scores[qualified], self.mask(module, name), self.owl_threshold)
                for qualified, module, name in self.selection
            ]
            weights = allocation.owl_offsets(ratios, self.owl_lambda)
        return allocation.layer_counts(
            shapes,
            target,
            weights,
            rule=self.scope,
            pruned=[pruned for _, pruned in counts],
            caps=[cap_units(self.max_layer_sparsity, units) for units, _ in counts],
        )

    def move(
        self,
        fraction: float,
        step: int,
        grads: Mapping[str, Tensor] | None = None,
        optimizers: Iterable[Any] = (),
    ) -> dict[str, float]:
        """Dynamic sparse training: in every masked tensor, drop the ``k`` smallest active weights and regrow ``k``
        inactive ones (:func:`~lightprune.prune.regrow.drop_and_grow`), ``k = round(fraction * active)``.

        RigL regrows where ``grads`` (dense gradients by qualified name) are largest; SET (``grads=None``) at random,
        drawn from ``(seed, step)`` alone, so every DDP rank and a resumed run draw the same. The new masks replace
        the old ones (a fresh ``CustomFromMask`` each, as a restore does: masks are no longer monotone); regrown
        weights start at zero and their optimizer state (momentum, Adam's moments) is zeroed. Every tensor keeps its
        count of active weights. Returns the share of each tensor's active weights that moved.

        Example:
            >>> layer = nn.Linear(10, 10)
            >>> masked = MaskedSelection([("fc.weight", layer, "weight")], [], [], prune.L1Unstructured, {},
            ...                          "layerwise", torch.bool, 0)
            >>> masked.prune_to(0.8, event=0)
            >>> masked.move(0.25, step=100)
            {'fc.weight': 0.25}
            >>> masked.units(layer, "weight")
            (100, 80)
        """
        generator = torch.Generator().manual_seed((self.seed * 1_000_003 + step) % (2**63))
        new: dict[str, Tensor] = {}
        grown: dict[str, Tensor] = {}
        shares: dict[str, float] = {}
        for qualified, module, name in self.selection:
            mask = self.mask(module, name)
            if mask is None:
                continue
            weight = prune.original(module, name)
            active = int(torch.count_nonzero(mask))
            k = moved_count(fraction, active, mask.numel() - active)
            shares[qualified] = k / active if active else 0.0
            if k == 0:
                continue
            scores = None if grads is None else grads[qualified]
            fresh, grown[qualified] = drop_and_grow(weight, mask, k, grow_scores=scores, generator=generator)
            new[qualified] = fresh.to(mask.dtype)
        if new:
            self.restore(new, "dynamic sparse training")
        targets = self.mask_targets()
        with torch.no_grad():
            for qualified, where in grown.items():
                parameter = prune.original(*targets[qualified])
                parameter.masked_fill_(where.to(parameter.device), 0)
                zero_optimizer_state(optimizers, parameter, where)
        return shares

    def _check_caps(self, target: float) -> None:
        """Per-row ranking prunes every row to the target, rounded row by row: refuse an event that would take a
        tensor past ``max_layer_sparsity`` (the event is then undone whole)."""
        if self.max_layer_sparsity >= 1:
            return
        for qualified, module, name in self.selection:
            units, pruned = self.units(module, name)
            if pruned > cap_units(self.max_layer_sparsity, units):
                raise ValueError(
                    f"scope='row' at target {target} would prune {pruned} of the {units} weights of {qualified}, "
                    f"beyond max_layer_sparsity={self.max_layer_sparsity} (rows round to whole weights): lower the "
                    "target or raise the cap"
                )

    def reconstruct_to(
        self, target: float, hessian_of: Callable[[str], Tensor], only: Collection[str] | None = None
    ) -> None:
        """An OBS event (:mod:`~lightprune.callback.reconstruction`): prune up to ``target`` and update the kept
        weights from each layer's ``hessian_of(qualified name)``; ``only`` restricts it to those layers (sequential
        calibration). All of it or nothing: every ``H`` is checked before any weight changes."""
        triples = [t for t in self.selection if only is None or t[0] in only]
        n_m = None
        if self.n_m:
            n_m = (self.method_kwargs["n"], self.method_kwargs["m"])
        with self.reparametrized(), self.all_or_nothing():
            reconstruction.reconstruct(
                triples, self.mask, target, self.scope, hessian_of, n_m=n_m, mask_dtype=self.mask_dtype
            )
            self._share_everywhere()

    def _apply(
        self, module: nn.Module, name: str, method: prune.BasePruningMethod, scores: Any, qualified: str
    ) -> None:
        """Prune ``module.<name>`` with the built ``method``, ranked by this event's scores if there are any."""
        ranking = None if scores is None else scores.get(qualified)
        prune.apply_method(module, name, method, importance_scores=ranking, mask_dtype=self.mask_dtype)

    def adopt_zeros(self) -> None:
        """Mask every entry of the selected tensors that is exactly zero now (weights pruned by another tool), on top
        of any mask already there, as one change: all of it or nothing. Sharded tensors: each rank its own shard."""
        if self.sharded:
            self._adopt_zeros_sharded()
            return
        with self.reparametrized(), self.all_or_nothing():
            for _, module, name in self.selection:
                with torch.no_grad():
                    keep = getattr(module, name) != 0
                if not bool(keep.all()):
                    prune.custom_from_mask(module, name, mask=keep, mask_dtype=self.mask_dtype)
            self._share_everywhere()

    def _adopt_zeros_sharded(self) -> None:
        """:meth:`adopt_zeros` on local shards: a zero is a zero wherever it lies, so no traffic. Every tensor gets a
        mask on every rank (all ones where a shard holds no zero), so the ranks' masks stay alike."""
        assert self.inplace is not None
        new = {}
        for _, module, name in self.selection:
            local = distributed.local_of(prune.original(module, name)).detach()
            current = self.mask(module, name)
            keep = local != 0
            if current is not None:
                keep &= distributed.local_of(current).bool()
            new[(module, name)] = keep.to(self._sharded_dtype)
        for (module, name), keep in new.items():
            self.inplace.put(module, name, keep)

    def _prune_sharded(self, target: float, scores: Mapping[str, Tensor] | None = None, signed: bool = False) -> None:
        """An event on sharded tensors: new local masks from :mod:`lightprune.prune.distributed`, kept in place.

        ``scores`` hold each tensor's local scores (the shard's shape). The new masks are computed for every tensor
        first and only then put in place, so a failure leaves the old masks untouched (all or nothing, as on one
        process).
        """
        assert self.inplace is not None
        pairs = [(module, name) for _, module, name in self.selection]
        tensors = [prune.original(module, name) for module, name in pairs]
        current = [self.mask(module, name) for module, name in pairs]
        local_scores = None if scores is None else [scores[q] for q, _, _ in self.selection]
        new = sharded.new_masks(
            tensors, current, self.counts(), target, self.method, self.method_kwargs, self.scope, self._sharded_dtype,
            self.group, self.max_layer_sparsity, scores=local_scores, signed=signed,
            input_dims=[input_dim(module) for module, _ in pairs],
        )  # fmt: skip
        for i, mask in new.items():
            module, name = pairs[i]
            self.inplace.put(module, name, mask)
        for _, module, name in self.selection:
            if module in self.biases:
                weight_mask = self.inplace.mask(module, name)
                if weight_mask is not None:
                    bias = distributed.local_of(prune.original(module, "bias"))
                    keep = sharded.bias_keep(weight_mask, bias, type(module).__name__)
                    self.inplace.put(module, "bias", keep.to(self._sharded_dtype))

    @property
    def _sharded_dtype(self) -> torch.dtype:
        return torch.bool if self.mask_dtype is None else self.mask_dtype

    def _share_everywhere(self) -> None:
        """Give every other place a selected tensor lives the very mask of the selected owner.

        Tied owners get the reparametrization too (``name_orig`` is the same Parameter, so the tie holds), so every
        module computes with the masked values during training. The averaged copies of weight-averaging callbacks
        (found by qualified name) are masked the same way: EMA and SWA average the parameters position by position
        and copy the average back over the model, so their copies must compute with, save and hand back the masked
        average. An adapted layer (LoRA) masks its update with its base weight's mask from its first mask on.
        """
        for module, name, others in self.ties:
            mask = mask_of(module, name)
            if mask is not None:
                for _, other, other_name in others:
                    share_mask(other, other_name, mask)
        for layer in self.adapted.values():
            mask = self.mask(adapters.base_of(layer), "weight")
            if mask is not None:
                adapters.mask_delta(layer, mask)
        named = self.named_pairs()
        self.plain_state_dict.pairs = [(module, name) for _, module, name in named]
        if self.inplace is not None:
            return  # the averaged copies stay plain too: apply_in_place zeroes them
        for average in self.averages:
            mirrored = []
            for qualified, module, name in named:
                mask = mask_of(module, name)
                if mask is not None:
                    counterpart = _owner_in(average, qualified)
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
                        counterpart = _owner_in(average, qualified)
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
            if name in prune.pruned_names(module):
                prune.remove(module, name)
        self.permanent = True

    # ------------------------------------------------------------------------------------------------------------
    # Checkpoints
    # ------------------------------------------------------------------------------------------------------------

    def mask_targets(self) -> dict[str, tuple[nn.Module, str]]:
        """The tensors whose masks go into checkpoints, by qualified name: the selection and the channel biases."""
        targets = {qualified: (module, name) for qualified, module, name in self.selection}
        targets.update((bias_name(q), (m, "bias")) for q, m, _ in self.selection if m in self.biases)
        return targets

    def masks(self) -> dict[str, Tensor]:
        """The masks by qualified name, for a checkpoint (tensors not pruned yet have none)."""
        targets = self.mask_targets()
        found = {key: self.mask(module, name) for key, (module, name) in targets.items()}
        if self.sharded:  # each rank's local shard, as a DTensor of the parameter's layout
            return {
                key: distributed.as_dtensor(mask, prune.original(*targets[key]))
                for key, mask in found.items()
                if mask is not None
            }
        return {key: mask for key, mask in found.items() if mask is not None}

    def restore(self, saved: Mapping[str, Tensor], owner: str) -> None:
        """Put a checkpoint's masks back, checked first (``owner`` names the state in messages), all or nothing."""
        targets = self.mask_targets()
        if self.sharded:
            self._restore_sharded(saved, targets, owner)
            return
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
                prune.custom_from_mask(module, name, mask=mask, mask_dtype=mask.dtype)
            self._share_everywhere()

    def _restore_sharded(
        self, saved: Mapping[str, Tensor], targets: dict[str, tuple[nn.Module, str]], owner: str
    ) -> None:
        """Sharded tensors: each saved mask's local part (checked first: all or nothing) put in place."""
        assert self.inplace is not None
        for key, mask in sharded.local_masks(saved, targets, owner).items():
            module, name = targets[key]
            self.inplace.put(module, name, mask)

    def share_with_averages(self, averages: list[nn.Module]) -> None:
        """Mask these averaged copies of the model too, now and after every event."""
        if self.sharded and averages:
            raise ValueError(
                "PruningCallback does not mask the averaged copies of weight-averaging callbacks (EMA, SWA) of a "
                "sharded model; remove the weight-averaging callback or train without sharding"
            )
        self.averages = averages
        self._share_everywhere()


def _owner_in(model: nn.Module, qualified: str) -> nn.Module:
    """The module of ``model`` that owns the tensor named ``qualified`` (``"features.0.weight"`` -> ``features.0``)."""
    return model.get_submodule(qualified.rsplit(".", 1)[0] if "." in qualified else "")


def _prune_bias(module: nn.Module, mask_dtype: torch.dtype | None) -> None:
    """Zero the bias entries of the output channels the weight's mask has removed entirely (a new bias mask in
    ``mask_dtype``, ``None`` being the bias's dtype)."""
    weight_mask = module._buffers.get("weight_mask")
    if weight_mask is None:
        return
    keep = torch.count_nonzero(weight_mask, dim=list(range(1, weight_mask.dim()))) > 0
    bias_mask = mask_of(module, "bias")
    if bias_mask is not None and torch.equal(bias_mask != 0, keep):
        return
    prune.custom_from_mask(module, "bias", mask=keep, mask_dtype=mask_dtype)


def _plain_state_dict_of(module: nn.Module) -> PlainStateDict:
    """The :class:`PlainStateDict` hook of an averaged copy, registered on first use."""
    for hook in module._state_dict_hooks.values():
        if isinstance(hook, PlainStateDict):
            return hook
    hook = PlainStateDict([])
    module.register_state_dict_post_hook(hook)
    return hook
