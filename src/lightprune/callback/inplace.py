"""In-place masking: the selected tensors stay plain Parameters, zeroed where pruned after every optimizer step.

The reparametrization (``name_orig * name_mask`` recomputed before every forward, the product's gradient masked in
every backward) costs two weight-sized passes and a weight-sized copy per step. In place, the masks are kept beside
the model: the gradient of a pruned entry is zeroed as soon as it is accumulated (so clipping, logging and the
optimizer never see it), and the weight of a pruned entry is zeroed right after each optimizer step. For optimizers
whose update of an entry depends on that entry alone (SGD with momentum, weight decay and Nesterov, Adam, AdamW,
RMSprop...) the effective weights are those of the reparametrized mode, bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from lightprune import prune
from lightprune.callback.masks import mask_of
from lightprune.prune.distributed import local_of
from lightprune.prune.functional import remove_masked
from lightprune.prune.masking import masked_

__all__ = ["InPlaceMasks"]


class InPlaceMasks:
    """Masks held outside the model, applied to the weights and their gradients in place.

    Example:
        >>> layer = torch.nn.Linear(4, 2)
        >>> _ = prune.l1_unstructured(layer, "weight", amount=4)
        >>> masks = InPlaceMasks()
        >>> masks.take([(layer, "weight")])  # back to a plain Parameter; the mask is kept here
        >>> prune.is_pruned(layer), int((layer.weight == 0).sum())
        (False, 4)
        >>> layer(torch.randn(3, 4)).sum().backward()
        >>> int((layer.weight.grad == 0).sum())  # masked as soon as it was accumulated
        4
        >>> masks.remove_hooks()
    """

    def __init__(self) -> None:
        self._entries: dict[tuple[int, str], tuple[nn.Module, str, Tensor]] = {}
        self._by_parameter: dict[int, tuple[nn.Parameter, Tensor]] = {}
        self._handles: dict[int, Any] = {}

    def take(self, pairs: Iterable[tuple[nn.Module, str]]) -> None:
        """Move the masks of these reparametrized tensors here and make them plain Parameters again (zeros where
        pruned); their gradients are masked from now on."""
        for module, name in pairs:
            mask = mask_of(module, name)
            if mask is None:
                continue
            parameter = prune.original(module, name)
            remove_masked(module, name)  # orig * mask in place: no new weight-sized tensor
            self._entries[(id(module), name)] = (module, name, mask)
            self._by_parameter[id(parameter)] = (parameter, mask)
            self._watch_grad(parameter)

    def put(self, module: nn.Module, name: str, mask: Tensor) -> None:
        """Keep ``mask`` for the plain (or DTensor) Parameter ``module.<name>`` and zero it where pruned now.

        For a DTensor (a sharded parameter), ``mask`` is the mask of this rank's local shard: the reparametrization
        never applies to it, and weights and gradients are masked on the local shard.
        """
        parameter = prune.original(module, name)
        self._entries[(id(module), name)] = (module, name, mask)
        self._by_parameter[id(parameter)] = (parameter, mask)
        self._watch_grad(parameter)
        with torch.no_grad():
            masked_(local_of(parameter), mask)

    def _watch_grad(self, parameter: Tensor) -> None:
        """Mask the gradient of ``parameter`` as soon as it is accumulated (a frozen Parameter, such as the base
        weight under a LoRA adapter, has none to mask)."""
        if parameter.requires_grad and id(parameter) not in self._handles:
            self._handles[id(parameter)] = parameter.register_post_accumulate_grad_hook(self._mask_grad)

    def forget(self) -> None:
        """Drop every mask kept here (the hooks stay)."""
        self._entries.clear()
        self._by_parameter.clear()

    def give_back(self) -> list[tuple[nn.Module, str, Tensor]]:
        """Put every mask back under the reparametrization (for an event) and forget them here; returns them."""
        entries = list(self._entries.values())
        for module, name, mask in entries:
            prune.custom_from_mask(module, name, mask=mask, mask_dtype=mask.dtype)
        self._entries.clear()
        self._by_parameter.clear()
        return entries

    def mask(self, module: nn.Module, name: str) -> Tensor | None:
        """The mask kept here for ``module.<name>``, if any."""
        entry = self._entries.get((id(module), name))
        return None if entry is None else entry[2]

    def masks_by_parameter(self) -> dict[int, tuple[nn.Parameter, Tensor]]:
        """``{id(parameter): (parameter, mask)}``, one entry per Parameter (tied owners share one)."""
        return dict(self._by_parameter)

    def apply(self) -> None:
        """Zero the pruned entries of every masked Parameter (after an optimizer step, a rewind, an average)."""
        with torch.no_grad():
            for parameter, mask in self._by_parameter.values():
                masked_(local_of(parameter), mask)

    def mask_grads(self) -> None:
        """Zero the pruned entries of every gradient (again: a no-op unless something wrote gradients since)."""
        for parameter, _ in self._by_parameter.values():
            self._mask_grad(parameter)

    def _mask_grad(self, parameter: Tensor) -> None:
        entry = self._by_parameter.get(id(parameter))
        if entry is not None and parameter.grad is not None:
            masked_(local_of(parameter.grad), entry[1])

    def remove_hooks(self) -> None:
        """Stop masking gradients (end of fit); the masks stay readable."""
        for handle in self._handles.values():
            handle.remove()
        self._handles.clear()
