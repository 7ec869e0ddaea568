"""The tensors one PruningCallback masks, every place they live, and the events that grow their masks.

A :class:`MaskedSelection` knows the selected ``(qualified name, module, name)`` triples, the other modules holding
a selected Parameter (tied weights), the channel biases that follow structured weights and the averaged copies of
the model kept by weight-averaging callbacks; all of them share the selected tensors' masks. It prunes to a target
sparsity with exact counts, all or nothing, and saves or restores the masks by qualified name. How the masks are held
and applied (reparametrized, in place, on sharded tensors' local shards) is its
:class:`~lightprune.callback.mask_strategy.MaskStrategy`'s business. It knows nothing of Lightning: the callback
owns the clock and decides when.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightprune import adapters, choices, prune
from lightprune.callback.inplace import InPlaceMasks
from lightprune.callback.mask_strategy import (
    MaskStrategy,
    ReparametrizedMasks,
    bias_keep,
    bias_name,
    exact_increment,
    mask_of,
    owner_in,
    share_mask,
)
from lightprune.callback.options import is_n_m
from lightprune.callback.regrowth import zero_optimizer_state
from lightprune.callback.sharded import ShardedMasks
from lightprune.layouts import input_dim, row_dim
from lightprune.prune import allocation, distributed
from lightprune.prune.collapse import LayerCollapseWarning, cap_units
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
            Otherwise :class:`~lightprune.callback.mask_strategy.ReparametrizedMasks`.
        max_layer_sparsity: no tensor is pruned beyond this share of its units; a global (or ERK, OWL) event still
            prunes its exact count (from the tensors under the cap), a layerwise one stops each tensor at the cap.
        adapted: the adapted layers (LoRA, see :mod:`lightprune.adapters`) by the qualified name of their selected
            base weight: once that weight has a mask, the layer's forward masks its update with it, and events rank
            the effective weight ``W + update``.
        owl: OWL's ``(M, lambda)`` for ``scope="owl"`` (:mod:`lightprune.prune.allocation`).

    Sharded tensors (DTensors: FSDP2, ``ModelParallelStrategy``) are always masked in place, each rank keeping the
    mask of its local shard only (``torch.bool`` unless ``mask_dtype`` says otherwise); events select with
    :mod:`lightprune.prune.distributed` (histograms summed across ranks), never under the reparametrization
    (:class:`~lightprune.callback.sharded.ShardedMasks`).

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
        owl: tuple[float, float] = (choices.OWL_THRESHOLD, choices.OWL_LAMBDA),
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
        # the last move's tensors with an all-zero dense gradient (masks left as they are)
        self.unranked: list[str] = []
        self.plain_state_dict = PlainStateDict([])  # what checkpoints of the model write plainly
        self.strategy = _strategy_for([prune.original(module, name) for _, module, name in selection], inplace)

    @property
    def permanent(self) -> bool:
        """Made permanent: the masks are gone, the pruned entries are the weights' zeros."""
        return self.strategy.permanent

    def mask(self, module: nn.Module, name: str) -> Tensor | None:
        """The mask of ``module.<name>`` (under the reparametrization or kept apart in place), or ``None``."""
        return self.strategy.mask(module, name)

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
        return self.strategy.counts([(module, name)], self._dim)[0]

    @property
    def _dim(self) -> int | None:
        """The dim whose channels are the units (structured methods), or ``None``: entries are."""
        return self.method_kwargs["dim"] if self.structured else None

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
        """:meth:`units` of every selected tensor (sharded: one all_reduce for all of them)."""
        return self.strategy.counts([(module, name) for _, module, name in self.selection], self._dim)

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

    def prune_to(
        self, target: float, event: int, scores: Mapping[str, Tensor] | None = None, signed: bool = False
    ) -> None:
        """Prune the selection up to ``target`` total sparsity (exact counts), as one event: all of it or nothing.

        ``scores`` (by qualified name) rank instead of the weights, as ``importance_scores``; ``signed`` ranks them
        by value, higher kept (:mod:`lightprune.prune.signed`). The ``"row"`` scope prunes every output row
        (:func:`~lightprune.layouts.row_dim`) to ``target``; an N:M method applies its pattern whatever ``target`` says.
        """
        with self._seeded(event):
            self.strategy.prune_to(self, target, scores, signed)

    def engine_event(self, target: float, scores: Mapping[str, Tensor] | None, signed: bool) -> None:
        """:meth:`prune_to` computed by the engine, under the reparametrization (the strategy's
        :meth:`~lightprune.callback.mask_strategy.MaskStrategy.editing` block: all or nothing)."""
        cap = self.max_layer_sparsity
        # new masks get self.mask_dtype through the calls' mask_dtype= (the user's prune.mask_dtype setting is theirs)
        method = signed_variant(self.method) if signed else self.method
        if scores is None and self.adapted:  # rank the effective weights W + update
            scores = {q: self.weight(q, m, n) for q, m, n in self.selection}
        if self.n_m:
            for qualified, module, name in self.selection:
                pattern = method(**{**self.method_kwargs, "dim": input_dim(module)})
                self._apply(module, name, pattern, scores, qualified)
        elif self.scope == "row":
            for qualified, module, name in self.selection:
                rows = RowwiseToSparsity(target, by_magnitude=not signed, dim=row_dim(module, name))
                self._apply(module, name, rows, scores, qualified)
            self._check_caps(target)
        elif self.scope == "global":
            counts = self.counts()
            increment = exact_increment(target, sum(u for u, _ in counts), sum(p for _, p in counts))
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
            held = []  # tensors the cap stops short of round(target * units)
            for qualified, module, name in self.selection:
                units, pruned = self.units(module, name)
                increment = exact_increment(target, units, pruned, cap)
                if increment < exact_increment(target, units, pruned):
                    held.append(f"{qualified} ({pruned + increment} of {units})")
                if increment > 0:
                    self._apply(module, name, method(amount=increment, **self.method_kwargs), scores, qualified)
            if held:
                warnings.warn(
                    f"layerwise event to {target:g}: max_layer_sparsity={cap} holds {', '.join(held[:4])}"
                    f"{', ...' if len(held) > 4 else ''} short of the target (pruned of all units given), as "
                    "rounding to whole units would pass the cap there",
                    UserWarning,
                    stacklevel=2,
                )
        for module in self.biases:
            _prune_bias(module, self.mask_dtype)
        self.share_everywhere()

    def allocate(self, target: float, scores: Mapping[str, Tensor] | None = None) -> list[int]:
        """ERK or OWL: how many weights each selected tensor has pruned in all after an event to ``target``.

        The total is exactly ``round(target * total)``; a tensor keeps at least what it has pruned already and gives
        at most its ``max_layer_sparsity`` share. OWL's outlier ratios come from ``scores`` (``|W| * ||X||``), one per
        block (:func:`~lightprune.prune.allocation.owl_blocks`), over the block's unpruned entries.

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
            names = [qualified for qualified, _, _ in self.selection]
            ratios = allocation.block_outlier_ratios(
                [scores[qualified] for qualified in names],
                [self.mask(module, name) for _, module, name in self.selection],
                allocation.owl_blocks(names),
                self.owl_threshold,
            )
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
        count of active weights. A frozen tensor (``requires_grad=False``, e.g. a backbone that ``BackboneFinetuning``
        holds frozen, or one none of ``optimizers`` steps, when they are given) keeps its mask: its regrown weights
        could not leave zero; so does a tensor whose dense gradient in ``grads`` is all zeros (a layer the step
        did not use: RigL would regrow by index), listed in :attr:`unranked`. Returns the share of each tensor's
        active weights that moved: at most ``fraction``, less where a dropped weight was regrown by the same update
        (it keeps its value and state), 0 for a frozen tensor.

        Example:
            >>> _ = torch.manual_seed(0)  # which weights are dropped, and so whether SET's draw re-picks one
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
        self.unranked = []
        optimizers = list(optimizers)
        stepped = {id(p) for optimizer in optimizers for group in optimizer.param_groups for p in group["params"]}
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
            shares[qualified] = 0.0
            frozen = not weight.requires_grad or (optimizers and id(weight) not in stepped)  # (BackboneFinetuning...)
            if k == 0 or frozen:  # a regrown entry would stay 0, where a trained weight was dropped
                continue
            scores = None if grads is None else grads[qualified]
            if scores is not None and not bool(scores.any()):  # no backward reached it: no ranking to regrow by
                self.unranked.append(qualified)
                continue
            fresh, grown[qualified] = drop_and_grow(weight, mask, k, grow_scores=scores, generator=generator)
            shares[qualified] = int(grown[qualified].sum()) / active
            new[qualified] = fresh.to(mask.dtype)
        if new:
            self.restore(new, "dynamic sparse training")
        targets = self.mask_targets()
        with torch.no_grad():
            for qualified, where in grown.items():
                parameter = prune.original(*targets[qualified])
                parameter.masked_fill_(where.to(parameter.device), 0)
                zero_optimizer_state(optimizers, parameter, where)
                for average in self.averages:  # EMA / SWA copies: regrown weights start at zero there too
                    copy = prune.original(owner_in(average, qualified), targets[qualified][1])
                    copy.masked_fill_(where.to(copy.device), 0)
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
        self.strategy.reconstruct(self, triples, target, hessian_of, n_m)

    def _apply(
        self, module: nn.Module, name: str, method: prune.BasePruningMethod, scores: Any, qualified: str
    ) -> None:
        """Prune ``module.<name>`` with the built ``method``, ranked by this event's scores if there are any."""
        ranking = None if scores is None else scores.get(qualified)
        prune.apply_method(module, name, method, importance_scores=ranking, mask_dtype=self.mask_dtype)

    def adopt_zeros(self) -> None:
        """Mask every entry of the selected tensors that is exactly zero now (weights pruned by another tool), on top
        of any mask already there, as one change: all of it or nothing. Sharded tensors: each rank its own shard."""
        self.strategy.adopt_zeros(self)

    def share_everywhere(self) -> None:
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
        self.plain_state_dict.pairs = self.pairs()
        self.strategy.share_with_averages(self, self.averages)

    def mask_updates_as_saved(self, saved: Mapping[str, Tensor]) -> None:
        """Outside a fit (``validate``/``test`` from a checkpoint, which loads its weights): every adapted layer masks
        its update with the checkpoint's mask of its base weight, as when that checkpoint was written; the mask is not
        in the weights. A layer the checkpoint holds no mask for (written before the first event) adds its whole
        update, as it did then."""
        for qualified, layer in self.adapted.items():
            mask = saved.get(qualified)
            device = prune.original(adapters.base_of(layer), "weight").device
            adapters.mask_delta(layer, None if mask is None else mask.to(device))

    def after_rewrite(self) -> None:
        """The weights were rewritten (a rewind, a weight average): mask them, and the averaged copies, again."""
        self.strategy.after_rewrite(self)

    def kept_zeros_under_adapters(self) -> dict[str, int]:
        """For each adapted base weight (LoRA): how many entries its mask keeps where the weight itself is exactly 0.
        Their effective weight is the update alone, which a mask read from the weight's zeros (an adapter saved with
        PEFT and merged with ``remask=True``) drops."""
        found = {}
        with torch.no_grad():
            for qualified, layer in self.adapted.items():
                mask = adapters.delta_mask(layer)
                if mask is None:
                    continue
                weight = prune.original(adapters.base_of(layer), "weight")
                count = int(((mask != 0) & (weight == 0).to(mask.device)).sum())
                if count:
                    found[qualified] = count
        return found

    def make_permanent(self, remove: bool = True) -> None:
        """End of fit: remove the reparametrization of the tensors this selection masks when ``remove`` (others' are
        left alone); in place, whatever ``remove`` says, zero the weights a last time and stop masking gradients."""
        self.strategy.finish(self, remove)

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
        return {
            key: self.strategy.saved_mask(mask, prune.original(*targets[key]))
            for key, mask in found.items()
            if mask is not None
        }

    def masks_or_zeros(self) -> dict[str, Tensor]:
        """:meth:`masks`; once the pruning was made permanent (a checkpoint written after fit's training, by
        ``save_last`` or ``trainer.save_checkpoint``), masks read from the plain weights' zeros, so that a fit resumed
        from it keeps them.

        Example:
            >>> layer = nn.Linear(4, 2)
            >>> masked = MaskedSelection([("fc.weight", layer, "weight")], [], [], prune.L1Unstructured, {},
            ...                          "layerwise", torch.bool, 0)
            >>> masked.prune_to(0.5, event=0)
            >>> masked.make_permanent()
            >>> masked.masks(), int((~masked.masks_or_zeros()["fc.weight"]).sum())
            ({}, 4)
        """
        if not self.permanent or self.strategy.collective:
            return self.masks()
        masks = {}
        with torch.no_grad():
            for key, (module, name) in self.mask_targets().items():
                weight = prune.original(module, name)
                layer = self.adapted.get(key)  # (an adapted base weight's zeros are not its mask: kept entries of W
                held = None if layer is None else adapters.delta_mask(layer)  # = 0 carry the update; its own mask)
                kept = held != 0 if held is not None else weight != 0
                masks[key] = kept.to(self.mask_dtype or weight.dtype)
        return masks

    def restore(self, saved: Mapping[str, Tensor], owner: str) -> None:
        """Put a checkpoint's masks back, checked first (``owner`` names the state in messages), all or nothing."""
        self.strategy.restore(self, saved, owner)

    def share_with_averages(self, averages: list[nn.Module]) -> None:
        """Mask these averaged copies of the model too, now and after every event (refused for a sharded model)."""
        self.averages = averages
        self.share_everywhere()


def _strategy_for(tensors: list[Tensor], inplace: bool) -> MaskStrategy:
    """The mask strategy of a selection of ``tensors``: sharded when any is a DTensor, else as ``inplace`` says."""
    if any(distributed.is_sharded(t) for t in tensors):
        return ShardedMasks(distributed.group_of(tensors))
    return InPlaceMasks() if inplace else ReparametrizedMasks()


def _prune_bias(module: nn.Module, mask_dtype: torch.dtype | None) -> None:
    """Zero the bias entries of the output channels the weight's mask has removed entirely (a new bias mask in
    ``mask_dtype``, ``None`` being the bias's dtype)."""
    weight_mask = module._buffers.get("weight_mask")
    if weight_mask is None:
        return
    keep = bias_keep(weight_mask, prune.original(module, "bias"), type(module).__name__)
    bias_mask = mask_of(module, "bias")
    if bias_mask is not None and torch.equal(bias_mask != 0, keep):
        return
    prune.custom_from_mask(module, "bias", mask=keep, mask_dtype=mask_dtype)
