"""Where the callback's masks live: on its tensors, on every other owner of a tied tensor, in its checkpoint state.

A selected tensor is masked through the engine's reparametrization. Other modules holding the same Parameter (tied
weights) and the averaged copies of weight-averaging callbacks share the very same mask tensor. In a checkpoint the
masks travel in the callback's state, keyed by qualified name, and are checked against the model before any of
them is put back.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from lightprune import prune

__all__ = ["bias_name", "mask_of", "restore_problems", "share_mask"]


def mask_of(module: nn.Module, name: str) -> Tensor | None:
    """The mask of ``module.<name>``, or ``None`` while it is not pruned.

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


def restore_problems(masks: Mapping[str, Tensor], targets: Mapping[str, tuple[nn.Module, str]]) -> list[str]:
    """Why a checkpoint's masks cannot be put back on ``targets`` (qualified name -> ``(module, name)``), if they
    cannot: unknown names, other shapes, dtypes that are not masks.

    Example:
        >>> layer = torch.nn.Linear(2, 2)
        >>> restore_problems({"fc.weight": torch.ones(3, dtype=torch.bool)}, {"fc.weight": (layer, "weight")})
        ["the mask of 'fc.weight' has shape (3,), the parameter (2, 2)"]
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
    return problems
