"""Lottery-ticket rewinding: snapshots of a model's weights under their user-facing names, copied back into it."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch
from torch import Tensor, nn

from lightprune import prune

__all__ = ["check_snapshot", "named_weights", "rewind_into", "snapshot_weights"]


def named_weights(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """Every parameter under its user-facing name (``weight`` for a pruned ``weight_orig``).

    Example:
        >>> [name for name, _ in named_weights(torch.nn.Linear(2, 1))]
        ['weight', 'bias']
    """
    for module_name, module in model.named_modules():
        pruned = prune.pruned_names(module)
        for name, parameter in module._parameters.items():
            if parameter is None:
                continue
            if name.endswith("_orig") and name[: -len("_orig")] in pruned:
                name = name[: -len("_orig")]
            yield (f"{module_name}.{name}" if module_name else name), parameter


def snapshot_weights(model: nn.Module) -> dict[str, Tensor]:
    """A CPU copy of every parameter of ``model``, keyed by its user-facing name.

    Example:
        >>> snapshot = snapshot_weights(torch.nn.Linear(2, 1))
        >>> sorted(snapshot), snapshot["weight"].device.type
        (['bias', 'weight'], 'cpu')
    """
    return {name: p.detach().to("cpu", copy=True) for name, p in named_weights(model)}


def rewind_into(model: nn.Module, snapshot: Mapping[str, Tensor]) -> None:
    """Copy the snapshot's values into the live parameters (a copy: they never share storage) and recompute the
    pruned tensors; parameters missing from the snapshot, or of another shape, are left as they are.

    Example:
        >>> layer = torch.nn.Linear(2, 1)
        >>> saved = snapshot_weights(layer)
        >>> _ = torch.nn.init.zeros_(layer.weight)
        >>> rewind_into(layer, saved)
        >>> torch.equal(layer.weight, saved["weight"])
        True
    """
    with torch.no_grad():
        for name, parameter in named_weights(model):
            saved = snapshot.get(name)
            if saved is not None and saved.shape == parameter.shape:
                parameter.copy_(saved)
    for module in model.modules():
        prune.refresh_pruned(module)


def check_snapshot(model: nn.Module, snapshot: Mapping[str, Tensor], tensors: Iterable[Tensor]) -> None:
    """Refuse a given snapshot that does not hold each of ``tensors`` (the selected ones) in its shape under its
    user-facing name in ``model``: :func:`rewind_into` would leave them as they are, and lottery-ticket rounds would
    silently become plain fine-tuning (a snapshot of a submodule has names without the submodule's prefix).

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 1))
        >>> check_snapshot(net, snapshot_weights(net), [net[0].weight])
        >>> check_snapshot(net, snapshot_weights(net[0]), [net[0].weight])
        Traceback (most recent call last):
        ...
        ValueError: rewind: the snapshot has no entry for the pruned 0.weight (its keys: 'bias', 'weight'); ...
    """
    wanted = {id(tensor) for tensor in tensors}
    missing, reshaped = [], []
    for name, parameter in named_weights(model):
        if id(parameter) not in wanted:
            continue
        saved = snapshot.get(name)
        if saved is None:
            missing.append(name)
        elif saved.shape != parameter.shape:
            reshaped.append(f"{name} ({tuple(saved.shape)} in the snapshot, {tuple(parameter.shape)} in the model)")
    if missing:
        keys = sorted(snapshot)
        shown = ", ".join(repr(key) for key in keys[:5]) + (f", ... ({len(keys)} keys)" if len(keys) > 5 else "")
        raise ValueError(
            f"rewind: the snapshot has no entry for the pruned {', '.join(missing)} (its keys: {shown or 'none'}); "
            f"take it with snapshot_weights({type(model).__name__}), the module given to fit: its names are "
            "qualified from there"
        )
    if reshaped:
        raise ValueError(f"rewind: the snapshot holds the pruned {', '.join(reshaped)}: it is of another model")
