"""Masks of sharded tensors (DTensors: FSDP2, ``ModelParallelStrategy``): events, restores and checkpoints.

Each rank keeps the masks of its own shards, in place (:class:`ShardedMasks`, the mask strategy of a sharded
selection). :func:`new_masks` computes an event's new local masks with :mod:`lightprune.prune.distributed` (exactly
one process's masks); the channel biases follow them by the rule of every strategy
(:func:`~lightprune.callback.mask_strategy.bias_keep`, on local shards).

Checkpoints hold them exactly whatever the format. A distributed checkpoint (the model's state holds DTensors)
saves the weights shard by shard from every rank, but the callbacks' states from rank zero only: each rank's local
masks go into the model's state as DTensors under ``lightprune.masks.<callback>.<parameter>`` keys, written shard by
shard beside the weights, and the callback's state keeps just their names (a strict load of the model ignores
checkpoint keys it does not ask for). A consolidated checkpoint (one file, full tensors) holds the full masks in the
callback's state, gathered once at save time, as Lightning gathers the full weights; its weights are plain and
pruned (:func:`save_masks`, :func:`load_masks`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from lightprune import prune
from lightprune.callback import reconstruction
from lightprune.callback.inplace import InPlaceMasks
from lightprune.callback.mask_strategy import Pairs, bias_keep, check_restored, exact_increment
from lightprune.callback.options import is_n_m
from lightprune.layouts import input_dim, row_dim
from lightprune.prune import distributed

if TYPE_CHECKING:
    from lightprune.callback.masked_selection import MaskedSelection

__all__ = ["ShardedMasks", "load_masks", "load_shards", "mask_prefix", "new_masks", "save_masks"]


def mask_prefix(state_key: str) -> str:
    """The prefix of a callback's mask keys in a distributed checkpoint's model state.

    Example:
        >>> mask_prefix("PruningCallback{'name': 'encoder'}")
        'lightprune.masks.965c2f35f38c.'
    """
    return state_prefix("masks", state_key)


def state_prefix(kind: str, state_key: str) -> str:
    """``lightprune.<kind>.<12 hex digits of the callback's state key>.``: where a callback's per-rank tensors of
    ``kind`` go in a distributed checkpoint's model state (one prefix per callback, stable across runs).

    Example:
        >>> state_prefix("masks", "PruningCallback{'name': 'encoder'}")
        'lightprune.masks.965c2f35f38c.'
    """
    return f"lightprune.{kind}.{hashlib.sha1(state_key.encode()).hexdigest()[:12]}."


def save_masks(checkpoint: dict[str, Any], state_key: str) -> None:
    """Lay out the masks of the callback ``state_key`` in ``checkpoint`` for its format (see the module docstring)."""
    from lightprune.prune.distributed import is_sharded

    state = checkpoint.get("callbacks", {}).get(state_key)
    model_state = checkpoint.get("state_dict", {})
    if state is None:
        return
    masks = state.get("masks", {})
    if any(is_sharded(value) for value in model_state.values()):
        prefix = mask_prefix(state_key)
        for key, mask in masks.items():
            model_state[prefix + key] = mask
        state["sharded_masks"] = sorted(masks)
        state["masks"] = {}
    else:
        state["masks"] = {key: mask.full_tensor() if is_sharded(mask) else mask for key, mask in masks.items()}
        state["sharded_masks"] = []


def load_masks(
    path: Any, names: list[str], masked: Any, state_key: str, mask_dtype: torch.dtype | None
) -> dict[str, Tensor]:
    """This rank's shard of each mask ``names`` that a distributed checkpoint at ``path`` holds beside the weights,
    shaped like the shards of ``masked``'s tensors (a
    :class:`~lightprune.callback.masked_selection.MaskedSelection`)."""
    like = {key: prune.original(*target) for key, target in masked.mask_targets().items()}
    return load_shards(path, mask_prefix(state_key), names, like, mask_dtype or torch.bool, "masks", state_key)


def load_shards(
    path: Any,
    prefix: str,
    names: list[str],
    like: Mapping[str, Tensor],
    dtype: torch.dtype,
    what: str,
    state_key: str,
) -> dict[str, Tensor]:
    """This rank's shard of each tensor ``names`` that a distributed checkpoint at ``path`` holds in its model state
    under ``prefix + name``, as DTensors laid out like ``like[name]`` (the sharded weight it belongs to), in ``dtype``.

    ``what`` names the tensors in the errors: a checkpoint whose ``path`` is unknown, or that holds ``what`` of a
    tensor this callback did not select (not in ``like``), is refused.

    Example:
        >>> load_shards(None, "lightprune.masks.0.", ["fc.weight"], {}, torch.bool, "masks", "cb")
        Traceback (most recent call last):
        ...
        ValueError: cb: the checkpoint's masks are in a distributed checkpoint, path unknown
    """
    if path is None:
        raise ValueError(f"{state_key}: the checkpoint's {what} are in a distributed checkpoint, path unknown")
    import torch.distributed.checkpoint as dcp

    from lightprune.prune.distributed import as_dtensor, local_of

    missing = [name for name in names if name not in like]
    if missing:
        raise ValueError(f"{state_key}: the checkpoint holds {what} of {missing}, not selected by this callback")
    holders = {}
    for key in names:
        local = local_of(like[key])
        holders[prefix + key] = as_dtensor(torch.empty(local.shape, dtype=dtype, device=local.device), like[key])
    loaded = {"state_dict": holders}
    dcp.load(loaded, checkpoint_id=path)
    return {key: loaded["state_dict"][prefix + key] for key in names}


def new_masks(
    tensors: list[Tensor],
    current: list[Tensor | None],
    counts: list[tuple[int, int]],
    target: float,
    method: type[prune.BasePruningMethod],
    method_kwargs: dict[str, Any],
    scope: str,
    dtype: torch.dtype,
    group: Any,
    max_layer_sparsity: float = 1.0,
    scores: list[Tensor | None] | None = None,
    signed: bool = False,
    input_dims: list[int] | None = None,
    row_dims: list[int] | None = None,
) -> dict[int, Tensor]:
    """This rank's new local masks for an event to ``target`` (by the index of the tensor; tensors that need no
    more pruning are left out), from :mod:`lightprune.prune.distributed`: the masks one process would compute.

    ``counts`` holds each tensor's ``(units, pruned units)`` over all ranks; ``method`` is one of the built-in
    unstructured or structured methods or an N:M one (the callback refuses others at setup). No tensor is
    pruned beyond ``max_layer_sparsity`` of its units: a global event takes its exact count from the tensors under
    the cap, a layerwise one stops each tensor at the cap. ``scores`` (local, per tensor) rank instead of the
    weights, by value when ``signed`` (higher kept). Per-row ranking (``scope="row"``, rows along ``row_dims``) and
    N:M groups along the input dim (``input_dims``) need no traffic: under ``Shard(0)`` every row along dim 0, and
    every group along dim 1, is local (the callback refuses the others at setup).
    """
    new: dict[int, Tensor] = {}
    local_scores = [
        distributed.local_of(t) if s is None else s
        for t, s in zip(tensors, scores or [None] * len(tensors), strict=True)
    ]
    if is_n_m(method) or scope == "row":
        from lightprune.prune.rowwise import rowwise_mask
        from lightprune.prune.signed import signed_variant

        for i, (score, mask) in enumerate(zip(local_scores, current, strict=True)):
            base = None if mask is None else distributed.local_of(mask)
            if scope == "row":
                dim = 0 if row_dims is None else row_dims[i]
                new[i] = rowwise_mask(None, score, base, dtype, magnitude=not signed, sparsity=target, dim=dim)
                continue
            pattern_class = signed_variant(method) if signed else method
            pattern = pattern_class(**{**method_kwargs, "dim": (input_dims or [1] * len(tensors))[i]})
            ones = torch.ones(score.shape, dtype=dtype, device=score.device) if base is None else base.to(dtype)
            new[i] = pattern.compute_mask(score, ones).to(dtype)
        return new
    if method.PRUNING_TYPE == "structured":
        n = method_kwargs.get("n")  # None: RandomStructured
        for i, (tensor, mask, (units, pruned)) in enumerate(zip(tensors, current, counts, strict=True)):
            increment = exact_increment(target, units, pruned, max_layer_sparsity)
            if increment > 0:
                new[i] = distributed.sharded_structured_mask(
                    tensor, increment, dim=method_kwargs["dim"], n=n, current=mask, dtype=dtype, group=group
                )
        return new
    name = "random" if method is prune.RandomUnstructured else "l1"
    if scope == "global":
        increment = exact_increment(target, sum(u for u, _ in counts), sum(p for _, p in counts))
        if increment > 0:
            masks = distributed.sharded_unstructured_masks(
                tensors, increment, method=name, current=current, dtype=dtype, group=group,
                max_layer_sparsity=max_layer_sparsity, importance_scores=scores, signed=signed,
            )  # fmt: skip
            new = dict(enumerate(masks))
        return new
    for i, (tensor, mask, (units, pruned)) in enumerate(zip(tensors, current, counts, strict=True)):
        increment = exact_increment(target, units, pruned, max_layer_sparsity)
        if increment > 0:
            new[i] = distributed.sharded_unstructured_masks(
                [tensor], increment, method=name, current=[mask], dtype=dtype, group=group,
                importance_scores=None if scores is None else [scores[i]], signed=signed,
            )[0]  # fmt: skip
    return new


class ShardedMasks(InPlaceMasks):
    """The masks of a selection sharded as DTensor: in place, each rank holding the masks of its local shards.

    Counting is collective (one all_reduce for all tensors); events select with :func:`new_masks`, never under the
    reparametrization; the callback's state holds each mask as a DTensor of its parameter's layout. The averaged
    copies of weight-averaging callbacks are refused.

    Example:
        >>> strategy = ShardedMasks(group=None)
        >>> strategy.collective, strategy.saved_mask(torch.ones(2, dtype=torch.bool), torch.zeros(2)).shape
        (True, torch.Size([2]))
    """

    collective = True

    def __init__(self, group: Any) -> None:
        super().__init__()
        self.group = group

    def counts(self, pairs: Pairs, dim: int | None) -> list[tuple[int, int]]:
        """``(units, pruned units)`` of each tensor over all ranks, in one all_reduce."""
        tensors = [prune.original(module, name) for module, name in pairs]
        masks = [self.mask(module, name) for module, name in pairs]
        return distributed.pruned_units(tensors, masks, dim=dim, group=self.group)

    def prune_to(self, masked: MaskedSelection, target: float, scores: Any, signed: bool) -> None:
        """An event on local shards: new masks from :func:`new_masks`, kept in place.

        ``scores`` hold each tensor's local scores (the shard's shape). The new masks are computed for every tensor
        first and only then put in place, so a failure leaves the old masks untouched (all or nothing, as on one
        process).
        """
        dtype = _dtype(masked)
        pairs = [(module, name) for _, module, name in masked.selection]
        tensors = [prune.original(module, name) for module, name in pairs]
        current = [self.mask(module, name) for module, name in pairs]
        local_scores = None if scores is None else [scores[q] for q, _, _ in masked.selection]
        new = new_masks(
            tensors, current, masked.counts(), target, masked.method, masked.method_kwargs, masked.scope, dtype,
            self.group, masked.max_layer_sparsity, scores=local_scores, signed=signed,
            input_dims=[input_dim(module) for module, _ in pairs], row_dims=[row_dim(*pair) for pair in pairs],
        )  # fmt: skip
        for i, mask in new.items():
            self.put(*pairs[i], mask)
        for _, module, name in masked.selection:
            weight_mask = self.mask(module, name)
            if module in masked.biases and weight_mask is not None:
                bias = distributed.local_of(prune.original(module, "bias"))
                self.put(module, "bias", bias_keep(weight_mask, bias, type(module).__name__).to(dtype))

    def reconstruct(
        self,
        masked: MaskedSelection,
        triples: list[tuple[str, nn.Module, str]],
        target: float,
        hessian_of: Callable[[str], Tensor],
        n_m: tuple[int, int] | None,
    ) -> None:
        """An OBS event on local shards: each rank updates its own rows and keeps their masks in place
        (:func:`~lightprune.callback.reconstruction.reconstruct_sharded`; every ``H`` is checked first)."""
        dtype = _dtype(masked)
        reconstruction.reconstruct_sharded(
            triples, self.mask, target, masked.scope, hessian_of,
            lambda module, name, keep: self.put(module, name, keep.to(dtype)), n_m=n_m, group=self.group,
        )  # fmt: skip

    def adopt_zeros(self, masked: MaskedSelection) -> None:
        """A zero is a zero wherever it lies, so no traffic. Every tensor gets a mask on every rank (all ones where a
        shard holds no zero), so the ranks' masks stay alike."""
        new = {}
        for _, module, name in masked.selection:
            keep = distributed.local_of(prune.original(module, name)).detach() != 0
            current = self.mask(module, name)
            if current is not None:
                keep &= distributed.local_of(current).bool()
            new[(module, name)] = keep.to(_dtype(masked))
        for (module, name), keep in new.items():
            self.put(module, name, keep)

    def restore(self, masked: MaskedSelection, saved: Mapping[str, Tensor], owner: str) -> None:
        """Each saved mask's local part (a DTensor's local shard, or this rank's rows of a full tensor from a
        consolidated checkpoint), checked first: all or nothing."""
        targets = masked.mask_targets()
        check_restored(saved, targets, owner)
        local = {}
        for key, mask in saved.items():
            tensor = prune.original(*targets[key])
            part = distributed.local_of(mask) if distributed.is_sharded(mask) else distributed.local_part(mask, tensor)
            local[key] = part.to(distributed.local_of(tensor).device)
        for key, mask in local.items():
            self.put(*targets[key], mask)

    def saved_mask(self, mask: Tensor, tensor: Tensor) -> Tensor:
        """This rank's local mask as a DTensor of the parameter's layout."""
        return distributed.as_dtensor(mask, tensor)

    def save_checkpoint(self, checkpoint: dict[str, Any], state_key: str) -> None:
        """:func:`save_masks`."""
        save_masks(checkpoint, state_key)

    def logged_mask(self, module: nn.Module, name: str, rank: int) -> Tensor:
        """The local shard's mask; a plain tensor, the same on every rank, is counted on rank 0 only."""
        tensor = prune.original(module, name)
        if not distributed.is_sharded(tensor) and rank != 0:
            return torch.ones(0, dtype=torch.bool, device=tensor.device)
        mask = self.mask(module, name)
        local = distributed.local_of(tensor)
        return torch.ones_like(local, dtype=torch.bool) if mask is None else mask

    def share_with_averages(self, masked: MaskedSelection, averages: list[nn.Module]) -> None:
        """Refused: the averaged copies of a sharded model are not masked."""
        if averages:
            raise ValueError(
                "PruningCallback does not mask the averaged copies of weight-averaging callbacks (EMA, SWA) of a "
                "sharded model; remove the weight-averaging callback or train without sharding"
            )


def _dtype(masked: MaskedSelection) -> torch.dtype:
    """The dtype of a sharded selection's new masks: ``torch.bool`` unless ``mask_dtype`` says otherwise."""
    return torch.bool if masked.mask_dtype is None else masked.mask_dtype
