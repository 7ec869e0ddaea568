"""Fold LoRA adapters into pruned weights and keep them exactly as sparse as their masks say.

PEFT's ``merge_and_unload()`` adds the dense update ``s·B·A`` to every adapted weight, so a pruned model fine-tuned
with LoRA comes back dense. :func:`merge_lora` folds in ``M ⊙ (W + s·B·A)`` instead, which is what a model trained
with :class:`~lightprune.PruningCallback` computes (the callback masks the update of a pruned base weight, see
:mod:`lightprune.adapters`), so the merged model computes what the unmerged one did and keeps every pruned entry at
an exact zero.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightprune import adapters, prune

__all__ = ["merge_lora"]


def merge_lora(
    model: nn.Module,
    *,
    remask: bool = False,
    example_inputs: Sequence[Any] | Mapping[str, Any] | None = None,
    inplace: bool = False,
) -> nn.Module:
    """The plain model with its LoRA adapters folded in, exactly as sparse as the pruning masks say.

    Every adapted layer (PEFT LoRA layers, and modules marked as :mod:`lightprune.adapters` describes) becomes its
    base layer holding ``M ⊙ (W + update)``, where ``M`` is the mask its forward applies to the update (set by
    :class:`~lightprune.PruningCallback`); without one, ``W + update``. Every pruned tensor of the model becomes a
    plain Parameter (the reparametrization removed), and a PEFT model is unwrapped (``unload()``): the result is the
    base model, as from ``merge_and_unload()``. It works during training (on a copy: the model is left as it was)
    and after the callback's fit end, when the masks were made permanent.

    A layer whose base weight is pruned (a mask under the reparametrization, or exact zeros) but whose forward adds
    a dense update was trained without the mask on its effective weight: merging it sparse would change what it
    computes, so it is refused, unless ``remask=True``; then the update's pruned entries are dropped and a warning
    says how much each layer's weight, and (with ``example_inputs``) the model's output, change.

    Args:
        model: a PEFT model (``get_peft_model``), a LightningModule or any ``nn.Module`` holding adapted layers.
        remask: drop the update where the base weight is pruned, for layers trained without the mask.
        example_inputs: positional (a sequence) or keyword (a mapping) inputs of ``model``'s forward; with
            ``remask=True``, the warning gives the relative change of the output on them.
        inplace: change ``model`` itself instead of a copy.

    Returns:
        The merged model: the base model of a PEFT model, else ``model`` (or its copy) with its layers replaced.

    Raises:
        ValueError: a layer trained without the mask on its effective weight (``remask=False``), a merged adapter,
            an adapter type that cannot be merged (DoRA and other LoRA variants, IA3, LoHa...), or a layer whose base
            weight is tied to another module's (GPT-2's ``lm_head`` and its input embedding), named.

    Example:
        >>> from lightprune.adapters import AdaptedWeight, mask_delta
        >>> torch.manual_seed(0)
        <torch._C.Generator object at ...>
        >>> layer = AdaptedWeight(nn.Linear(4, 3), rank=2)
        >>> _ = prune.l1_unstructured(layer.base_layer, "weight", amount=6)
        >>> mask_delta(layer, layer.base_layer.weight_mask)  # what PruningCallback does
        >>> with torch.no_grad():
        ...     _ = layer.B.normal_()  # as if trained
        >>> model = nn.Sequential(layer)
        >>> merged = merge_lora(model)
        >>> type(merged[0]).__name__, int((merged[0].weight == 0).sum())
        ('Linear', 6)
        >>> x = torch.randn(2, 4)
        >>> torch.allclose(merged(x), model(x), atol=1e-6)
        True
    """
    target = model if inplace else copy.deepcopy(model)
    plans = [(name, layer, *_plan(layer)) for name, layer in adapters.adapted_layers(target)]
    refused = [f"{name!r}: {why}" for name, _, merged, why, _ in plans if merged is None]
    refused += [
        f"{name!r}: {why}" for name, layer, merged, _, _ in plans if (why := _tie_problem(target, layer, merged))
    ]
    unmasked = [(name, why, change) for name, _, merged, why, change in plans if merged is not None and why]
    if refused:
        raise ValueError("merge_lora cannot merge these layers:\n  " + "\n  ".join(refused))
    if unmasked and not remask:
        raise ValueError(
            "merge_lora: these layers were trained without the pruning mask on their effective weight (their update "
            "is dense where the base weight is pruned), so a sparse merge would change what they compute:\n  "
            + "\n  ".join(f"{name!r}: {why}" for name, why, _ in unmasked)
            + "\nTrain with a PruningCallback that prunes these weights (it masks the update; zeros left by an "
            "earlier pruning become its masks with adopt_zeros=True and an unstructured method), or pass remask=True "
            "to drop the update there (a sparse model, not the one trained), or, for the model as trained (dense "
            "there), merge with PEFT's merge_and_unload() once the pruning is permanent."
        )
    before = _output(target, example_inputs) if unmasked and example_inputs is not None else None
    for _, layer, merged, _, _ in plans:
        assert merged is not None  # refused above
        _write_weight(adapters.base_of(layer), merged)
    for module in target.modules():
        for tensor_name in prune.pruned_names(module):
            prune.remove(module, tensor_name)
    result = _unload(target)
    if unmasked:
        listed = ", ".join(f"{name} {change:.3g}" for name, _, change in unmasked)
        said = "; pass example_inputs to measure the change of the output"
        if before is not None and example_inputs is not None:
            after = _output(result, example_inputs)
            said = f"; the output on example_inputs changed by {float((after - before).norm() / before.norm()):.3g}"
        warnings.warn(
            "merge_lora(remask=True) dropped the update where the base weights are pruned; relative change "
            f"(Frobenius norm) of each such layer's weight: {listed}{said} (relative L2 norm)",
            UserWarning,
            stacklevel=2,
        )
    return result


def _plan(layer: nn.Module) -> tuple[Tensor | None, str, float]:
    """``(merged weight, why, change)`` of one adapted layer: the weight is ``None`` (and ``why`` says why) where it
    cannot be merged; a ``why`` beside a weight means it merges only by dropping the update where the base weight is
    pruned, ``change`` being the relative change of the effective weight that makes."""
    if not adapters.is_marked(layer):
        if not hasattr(layer, "lora_A") or not hasattr(layer, "get_delta_weight"):
            return None, f"{type(layer).__name__} is not a LoRA layer; merge_lora folds in LoRA updates only", 0.0
        if getattr(layer, "merged", False):
            return None, f"its adapters {layer.merged_adapters} are merged already (unmerge them first)", 0.0
        variant_class = adapters._masked_delta_class()
        others = {n: type(v).__name__ for n, v in layer.lora_variant.items() if not isinstance(v, variant_class)}
        if others:
            return None, f"it uses the LoRA variant(s) {others}, whose update is not W + s·B·A", 0.0
        if any(layer.lora_bias.get(n, False) for n in layer.lora_A):
            return None, "it has lora_bias=True", 0.0
    base = adapters.base_of(layer)
    if not isinstance(getattr(base, "weight", None), Tensor):
        return None, f"its base layer, a {type(base).__name__}, has no single weight to fold the update into", 0.0
    with torch.no_grad():
        weight = base.weight.detach()  # what the base layer computes with (masked while pruned)
        update = adapters.delta(layer)
        if update is None:
            return weight.clone(), "", 0.0
        update = update.detach().to(weight.dtype)
        zero = torch.zeros((), dtype=weight.dtype, device=weight.device)
        mask = adapters.delta_mask(layer)
        if mask is not None:  # trained with the mask on the effective weight
            return torch.where(_keep(mask).to(weight.device), weight + update, zero), "", 0.0
        base_mask = base._buffers.get("weight_mask") if "weight" in prune.pruned_names(base) else None
        keep = _keep(base_mask) if base_mask is not None else weight != 0
        merged = torch.where(keep, weight + update, zero)
        dropped = (update != 0) & ~keep
        if not bool(dropped.any()):
            return merged, "", 0.0
        change = float(torch.where(dropped, update, zero).norm() / (weight + update).norm())
        why = f"the update is nonzero at {int(dropped.sum())} of the {int((~keep).sum())} pruned entries of its weight"
        return merged, why, change


def _tie_problem(model: nn.Module, layer: nn.Module, merged: Tensor | None) -> str:
    """Why ``layer`` cannot be merged in place if its base weight is tied to another module's (GPT-2's ``lm_head`` is
    its input embedding): writing the merged weight there would change that module too. Empty when it is not tied, or
    when the merge leaves the weight as it is."""
    if merged is None:  # refused for its own reason
        return ""
    base = adapters.base_of(layer)
    weight = prune.original(base, "weight") if "weight" in prune.pruned_names(base) else base.weight
    if torch.equal(merged, base.weight.detach()):
        return ""
    others = [
        f"{owner}.{name}" if owner else name
        for owner, module in model.named_modules(remove_duplicate=False)
        for name, tensor in module._parameters.items()
        if tensor is weight and module is not base
    ]
    if not others:
        return ""
    return (
        f"its base weight is tied to {sorted(set(others))}, which the merged update would change too; untie it "
        "first (give the layer its own copy: base_layer.weight = nn.Parameter(base_layer.weight.detach().clone())), "
        "or leave that layer without an adapter"
    )


def _keep(mask: Tensor) -> Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def _write_weight(base: nn.Module, merged: Tensor) -> None:
    """Make the base layer's weight a plain Parameter holding ``merged``."""
    if "weight" in prune.pruned_names(base):
        prune.remove(base, "weight")
    with torch.no_grad():
        base.weight.copy_(merged)


def _unload(model: nn.Module) -> nn.Module:
    """Replace every adapted layer by its base layer; a PEFT model (or one inside ``model``) by its base model."""
    import sys

    if "peft" in sys.modules:
        from peft import PeftModel
        from peft.tuners.tuners_utils import BaseTuner

        if isinstance(model, (PeftModel, BaseTuner)):
            return model.unload()
        for name, module in list(model.named_modules()):
            if isinstance(module, (PeftModel, BaseTuner)) and name:
                parent, _, child = name.rpartition(".")
                model.get_submodule(parent).register_module(child, module.unload())
                return _unload(model)
    for name, layer in list(adapters.adapted_layers(model)):
        if not name:
            return adapters.base_of(layer)
        parent, _, child = name.rpartition(".")
        model.get_submodule(parent).register_module(child, adapters.base_of(layer))
    return model


def _output(model: nn.Module, inputs: Sequence[Any] | Mapping[str, Any]) -> Tensor:
    """The first tensor of ``model``'s output on ``inputs`` (logits of a transformers output), flattened."""
    with torch.no_grad():
        out = model(**inputs) if isinstance(inputs, Mapping) else model(*inputs)
    while not isinstance(out, Tensor):
        out = out[0] if not isinstance(out, Mapping) else next(iter(out.values()))
    return out.detach().float().flatten()
