"""Effective tensors of pruned modules: ``name_orig`` and ``name_mask`` folded into the plain ``name``.

Both lightprune's and ``torch.nn.utils.prune``'s reparametrization keep the dense original as the Parameter
``name_orig`` and the mask as the buffer ``name_mask``; the module computes ``name`` from the two. The export
functions read the pair and store the tensor the model computes with, pruned entries as exact ``+0``.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightprune import prune

ORIG_SUFFIX = "_orig"
MASK_SUFFIX = "_mask"


def apply_mask(orig: Tensor, mask: Tensor) -> Tensor:
    """``orig * mask`` where the mask keeps an entry and an exact ``+0`` where it prunes it (even over NaN or inf).

    Example:
        >>> apply_mask(torch.tensor([-1.0, float("nan"), 3.0]), torch.tensor([0.0, 0.0, 1.0]))
        tensor([0., 0., 3.])
    """
    orig = orig.detach()
    mask = mask.detach()
    if mask.dtype == torch.bool:
        return torch.where(mask, orig, torch.zeros((), dtype=orig.dtype, device=orig.device))
    keep = mask != 0
    return torch.where(keep, orig * mask.to(orig.dtype), torch.zeros((), dtype=orig.dtype, device=orig.device))


def pruned_pairs(keys: list[str]) -> dict[str, tuple[str, str]]:
    """``{plain key: (orig key, mask key)}`` for every ``*_orig`` key whose ``*_mask`` partner is present.

    Example:
        >>> pruned_pairs(["fc.weight_orig", "fc.weight_mask", "fc.bias", "attn_mask"])
        {'fc.weight': ('fc.weight_orig', 'fc.weight_mask')}
    """
    present = set(keys)
    pairs = {}
    for key in keys:
        if key.endswith(ORIG_SUFFIX):
            plain = key[: -len(ORIG_SUFFIX)]
            if plain + MASK_SUFFIX in present and plain not in present:
                pairs[plain] = (key, plain + MASK_SUFFIX)
    return pairs


def _pruned_module_prefixes(module: nn.Module) -> set[str]:
    return {name + "." if name else "" for name, sub in module.named_modules() if prune.is_pruned(sub)}


def _warn_split_ties(module: nn.Module, pairs: dict[str, tuple[str, str]]) -> None:
    """Warn where one Parameter is the ``_orig`` of a pruned pair under one name and a plain tensor under another.

    That is a tie (an output layer sharing the embedding's weight, say) that pruning only some of its owners has
    split: the owners compute with different tensors, the exported state (a file, a compact model) holds both, and a
    model that ties them again keeps only one of them when it loads that state.
    """
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    origs = {keys[0] for keys in pairs.values()}
    for plain, (orig_key, _) in pairs.items():
        owner = plain.rpartition(".")[0] or "the model"
        for other in names.get(id(module.get_parameter(orig_key)), ()):
            if other not in origs:
                warnings.warn(
                    f"the Parameter {other!r} is also {orig_key!r}, which only {owner!r} prunes: the exported "
                    f"tensors hold the unpruned {other!r} and the pruned {plain!r}, and a model that ties them loads "
                    "only one of the two. Prune every owner of a tied Parameter with one mask "
                    "(prune.global_unstructured given every owner, or PruningCallback) to keep the tie.",
                    UserWarning,
                    stacklevel=4,
                )


def effective_state_dict(obj: nn.Module | Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The tensors a model computes with: each ``name_orig``/``name_mask`` pair becomes ``name``, in key order.

    For a module, pairs count only inside submodules that carry a pruning hook (lightprune's or torch's), so a
    buffer that happens to be called ``attn_mask`` stays what it is. For a state_dict, every ``x_orig`` with an
    ``x_mask`` partner is a pair.

    Raises:
        TypeError: ``obj`` is neither a module nor a mapping, or a state_dict key is not a ``str`` (naming the key).

    Example:
        >>> layer = prune.l1_unstructured(nn.Linear(3, 1, bias=False), "weight", amount=2)
        >>> sorted(layer.state_dict()), list(effective_state_dict(layer))
        (['weight_mask', 'weight_orig'], ['weight'])
    """
    if isinstance(obj, nn.Module):
        state = obj.state_dict(keep_vars=False)
        prefixes = _pruned_module_prefixes(obj)
        pairs = {
            plain: keys
            for plain, keys in pruned_pairs(list(state)).items()
            if plain[: plain.rfind(".") + 1] in prefixes
        }
        _warn_split_ties(obj, pairs)
    elif isinstance(obj, Mapping):
        state = dict(obj)
        for key in state:  # the keys are names in a file or a module, and are matched as str below
            if not isinstance(key, str):
                raise TypeError(f"state_dict key {key!r} is not a str ({type(key).__name__}); keys are tensor names")
        pairs = pruned_pairs(list(state))
    else:
        raise TypeError(f"expected an nn.Module or a state_dict (a mapping of names to tensors), got {type(obj)!r}")
    partner = {keys[1]: plain for plain, keys in pairs.items()}
    out: dict[str, Tensor] = {}
    folded: dict[tuple[Any, ...], Tensor] = {}  # a tie pruned through every owner: one tensor, under each name
    for key, value in state.items():
        if key in partner:
            continue
        if key.endswith(ORIG_SUFFIX) and key[: -len(ORIG_SUFFIX)] in pairs:
            plain = key[: -len(ORIG_SUFFIX)]
            orig, mask = (state[k] for k in pairs[plain])
            same = (tensor_place(orig), tensor_place(mask))
            if None in same:
                out[plain] = apply_mask(orig, mask)
                continue
            if same not in folded:
                folded[same] = apply_mask(orig, mask)
            out[plain] = folded[same]
        else:
            out[key] = value
    return out


def tensor_place(t: Tensor) -> tuple[Any, ...] | None:
    """Where and how ``t``'s entries lie: equal for the same tensor under two names (tied weights); ``None`` for one
    without plain storage (empty, a DTensor), never taken as shared.

    Example:
        >>> w = torch.ones(2, 3)
        >>> tensor_place(w) == tensor_place(w.detach()), tensor_place(w) == tensor_place(w.t()), tensor_place(w[:0])
        (True, False, None)
    """
    if not t.numel() or type(t) is not Tensor:
        return None
    return (t.device, t.dtype, t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride())
