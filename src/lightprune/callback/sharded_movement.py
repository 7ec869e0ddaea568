"""Movement sums of sharded weights in checkpoints: each rank's own shard, so a resume mid-interval is exact.

Under ``ModelParallelStrategy`` (FSDP2) each rank sums ``-W * grad`` over its own shard (:mod:`.movement`), and the
callback's state in a distributed checkpoint is rank zero's only. As the masks do (:mod:`.sharded`), the sums then
travel in the model's state as DTensors, under ``lightprune.movement.<callback>.<parameter>`` keys written shard by
shard beside the weights; the callback's state keeps their names. A consolidated checkpoint (one file) holds the
full sums in the callback's state, gathered at save time; a resume takes each rank's rows back
(:meth:`~lightprune.callback.movement.MovementScores.load_state_dict`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lightprune.callback.sharded import load_shards, state_prefix

__all__ = ["load_sums", "save_sums", "sums_prefix"]


def sums_prefix(state_key: str) -> str:
    """The prefix of a callback's movement-sum keys in a distributed checkpoint's model state.

    Example:
        >>> sums_prefix("PruningCallback{'name': 'encoder'}")
        'lightprune.movement.965c2f35f38c.'
    """
    return state_prefix("movement", state_key)


def save_sums(checkpoint: dict[str, Any], state_key: str) -> None:
    """Lay out the movement sums of the callback ``state_key`` in ``checkpoint`` for its format (the sums of sharded
    weights are DTensors in the callback's state: :meth:`~lightprune.callback.movement.MovementScores.state_dict`).

    Example:
        >>> checkpoint = {"callbacks": {"cb": {"importance": {"movement": {"totals": {"w": torch.ones(2)}}}}}}
        >>> save_sums(checkpoint, "cb")  # plain sums stay in the callback's state
        >>> checkpoint["callbacks"]["cb"]["importance"]["movement"]
        {'totals': {'w': tensor([1., 1.])}, 'sharded': []}
    """
    from lightprune.prune.distributed import is_sharded

    state = checkpoint.get("callbacks", {}).get(state_key, {})
    movement = state.get("importance", {}).get("movement")
    if movement is None:
        return
    totals = movement.get("totals", {})
    model_state = checkpoint.get("state_dict", {})
    names = sorted(key for key, total in totals.items() if is_sharded(total))
    if names and any(is_sharded(value) for value in model_state.values()):  # a distributed checkpoint
        prefix = sums_prefix(state_key)
        for key in names:
            model_state[prefix + key] = totals.pop(key)
        movement["sharded"] = names
        return
    movement["totals"] = {key: total.full_tensor() if is_sharded(total) else total for key, total in totals.items()}
    movement["sharded"] = []


def load_sums(path: Any, names: list[str], weights: Mapping[str, Tensor], state_key: str) -> dict[str, Tensor]:
    """This rank's shard of the movement sums ``names`` that a distributed checkpoint at ``path`` holds beside the
    weights, as DTensors laid out like ``weights`` (by qualified name)."""
    return load_shards(path, sums_prefix(state_key), names, weights, torch.float32, "movement sums", state_key)
