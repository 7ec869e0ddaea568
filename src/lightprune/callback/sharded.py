"""Masks of sharded tensors (DTensors: FSDP2, ``ModelParallelStrategy``): events, restores and checkpoints.

Each rank keeps the masks of its own shards. :func:`new_masks` computes an event's new local masks with
:mod:`lightprune.prune.distributed` (exactly one process's masks), :func:`bias_keep` the local channel biases that
follow them, and :func:`local_masks` this rank's part of masks read back from a checkpoint.

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
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lightprune import prune
from lightprune.callback.options import is_n_m

__all__ = ["bias_keep", "load_masks", "local_masks", "mask_prefix", "new_masks", "save_masks"]


def mask_prefix(state_key: str) -> str:
    """The prefix of a callback's mask keys in a distributed checkpoint's model state.

    Example:
        >>> mask_prefix("PruningCallback{'name': 'encoder'}")
        'lightprune.masks.965c2f35f38c.'
    """
    return f"lightprune.masks.{hashlib.sha1(state_key.encode()).hexdigest()[:12]}."


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
    shaped like the shards of ``masked``'s tensors (a :class:`~lightprune.callback.masked.MaskedSelection`)."""
    if path is None:
        raise ValueError(f"{state_key}: the checkpoint's masks are in a distributed checkpoint, path unknown")
    import torch.distributed.checkpoint as dcp

    from lightprune.prune.distributed import as_dtensor, local_of

    targets = masked.mask_targets()
    missing = [name for name in names if name not in targets]
    if missing:
        raise ValueError(f"{state_key}: the checkpoint holds masks of {missing}, not selected by this callback")
    prefix = mask_prefix(state_key)
    holders = {}
    for key in names:
        tensor = prune.original(*targets[key])
        local = local_of(tensor)
        holders[prefix + key] = as_dtensor(
            torch.empty(local.shape, dtype=mask_dtype or torch.bool, device=local.device), tensor
        )
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
) -> dict[int, Tensor]:
    """This rank's new local masks for an event to ``target`` (by the index of the tensor; tensors that need no
    more pruning are left out), from :mod:`lightprune.prune.distributed`: the masks one process would compute.

    ``counts`` holds each tensor's ``(units, pruned units)`` over all ranks; ``method`` is one of the built-in
    unstructured or structured methods or an N:M one (the callback refuses others at setup). No tensor is
    pruned beyond ``max_layer_sparsity`` of its units: a global event takes its exact count from the tensors under
    the cap, a layerwise one stops each tensor at the cap. ``scores`` (local, per tensor) rank instead of the
    weights, by value when ``signed`` (higher kept). Per-row ranking (``scope="row"``) and N:M groups along the input
    dim (``input_dims``) need no traffic: under ``Shard(0)`` every row, and every group along dim 1, is local.
    """
    from lightprune.prune import distributed
    from lightprune.prune.collapse import capped_count

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
                new[i] = rowwise_mask(None, score, base, dtype, magnitude=not signed, sparsity=target)
                continue
            pattern_class = signed_variant(method) if signed else method
            pattern = pattern_class(**{**method_kwargs, "dim": (input_dims or [1] * len(tensors))[i]})
            ones = torch.ones(score.shape, dtype=dtype, device=score.device) if base is None else base.to(dtype)
            new[i] = pattern.compute_mask(score, ones).to(dtype)
        return new
    if method.PRUNING_TYPE == "structured":
        n = method_kwargs.get("n")  # None: RandomStructured
        for i, (tensor, mask, (units, pruned)) in enumerate(zip(tensors, current, counts, strict=True)):
            increment = capped_count(target, units, max_layer_sparsity) - pruned
            if increment > 0:
                new[i] = distributed.sharded_structured_mask(
                    tensor, increment, dim=method_kwargs["dim"], n=n, current=mask, dtype=dtype, group=group
                )
        return new
    name = "random" if method is prune.RandomUnstructured else "l1"
    if scope == "global":
        increment = round(target * sum(u for u, _ in counts)) - sum(p for _, p in counts)
        if increment > 0:
            masks = distributed.sharded_unstructured_masks(
                tensors, increment, method=name, current=current, dtype=dtype, group=group,
                max_layer_sparsity=max_layer_sparsity, importance_scores=scores, signed=signed,
            )  # fmt: skip
            new = dict(enumerate(masks))
        return new
    for i, (tensor, mask, (units, pruned)) in enumerate(zip(tensors, current, counts, strict=True)):
        increment = capped_count(target, units, max_layer_sparsity) - pruned
        if increment > 0:
            new[i] = distributed.sharded_unstructured_masks(
                [tensor], increment, method=name, current=[mask], dtype=dtype, group=group,
                importance_scores=None if scores is None else [scores[i]], signed=signed,
            )[0]  # fmt: skip
    return new


def bias_keep(weight_mask: Tensor, bias: Tensor, owner: str) -> Tensor:
    """Which local bias entries to keep: those of the output channels (rows) whose local weight mask is not all zero.

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


def local_masks(saved: Mapping[str, Tensor], targets: dict[str, tuple[Any, str]], owner: str) -> dict[str, Tensor]:
    """This rank's part of each saved mask, checked against the selected tensors ``targets`` before any is used: a
    DTensor's local shard, or this rank's rows of a full tensor (a consolidated checkpoint).

    Raises:
        ValueError: naming every mask that is not selected or whose shape differs; nothing is returned then.
    """
    from lightprune.prune import distributed

    local: dict[str, Tensor] = {}
    problems = []
    for key, mask in saved.items():
        if key not in targets:
            problems.append(f"{key!r} is not selected by this callback (the selection is {sorted(targets)})")
            continue
        tensor = prune.original(*targets[key])
        if tuple(mask.shape) != tuple(tensor.shape):
            problems.append(f"the mask of {key!r} has shape {tuple(mask.shape)}, the parameter {tuple(tensor.shape)}")
            continue
        part = distributed.local_of(mask) if distributed.is_sharded(mask) else distributed.local_part(mask, tensor)
        local[key] = part.to(distributed.local_of(tensor).device)
    if problems:
        raise ValueError(
            f"{owner}: the checkpoint's masks do not fit the model (nothing was changed):\n  " + "\n  ".join(problems)
        )
    return local
