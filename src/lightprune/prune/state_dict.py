"""Pruned models' state_dicts in plain torch terms: the pruned tensors under their own names, masks applied.

A module under the pruning reparametrization saves ``weight_orig`` and ``weight_mask`` where a plain model saves
``weight``, so its checkpoints load only into a model pruned the same way. :class:`PlainStateDict` is a state_dict
post-hook that writes the listed pruned tensors the plain way instead: ``weight`` holding the effective values
(``orig`` masked: exact zeros where pruned), at ``weight_orig``'s place in the key order. Such a checkpoint loads
strictly into the unpruned model, with torch's own loading rules; whoever needs the masks keeps them elsewhere (the
Lightning callback keeps them in its own checkpoint state).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightprune.prune._reparam import find_hook

__all__ = ["PlainStateDict"]


class PlainStateDict:
    """``state_dict`` post-hook: each listed pruned tensor as one plain key holding its effective (masked) value.

    Register it on the root of the model with ``register_state_dict_post_hook``; tensors that are not (or no longer)
    pruned are left as they are. The hook holds the modules themselves, so ``copy.deepcopy`` of the model gives a
    copy whose hook names the copied modules.

    Args:
        pairs: ``(module, name)`` of the pruned tensors to write plainly.

    Example:
        >>> from lightprune import prune
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 2))
        >>> _ = prune.l1_unstructured(net[0], "weight", amount=3)
        >>> handle = net.register_state_dict_post_hook(PlainStateDict([(net[0], "weight")]))
        >>> list(net.state_dict()), int((net.state_dict()["0.weight"] == 0).sum())
        (['0.weight', '0.bias'], 3)
        >>> handle.remove()
        >>> list(net.state_dict())
        ['0.weight_orig', '0.bias', '0.weight_mask']
    """

    def __init__(self, pairs: list[tuple[nn.Module, str]]) -> None:
        self.pairs = list(pairs)

    def __call__(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        wanted = {id(owner) for owner, _ in self.pairs}
        names: dict[int, list[str]] = {}
        for qualified, submodule in module.named_modules(remove_duplicate=False):
            if id(submodule) in wanted:
                names.setdefault(id(submodule), []).append(f"{prefix}{qualified}." if qualified else prefix)
        renamed: dict[str, tuple[str, Any]] = {}
        dropped: set[str] = set()
        for owner, name in self.pairs:
            _, hook = find_hook(owner, name)
            if hook is None:
                continue
            value = None
            for base in names.get(id(owner), []):
                key = base + name
                if key + "_orig" not in state_dict:
                    continue
                if value is None:
                    with torch.no_grad():
                        value = hook.apply_mask(owner).detach()
                renamed[key + "_orig"] = (key, value)
                dropped.add(key + "_mask")
        if not renamed:
            return
        items = list(state_dict.items())
        state_dict.clear()
        for key, value in items:
            if key in renamed:
                plain_key, plain_value = renamed[key]
                state_dict[plain_key] = plain_value
            elif key not in dropped:
                state_dict[key] = value
