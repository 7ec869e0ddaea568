"""Low-rank adapters on pruned weights: the update masked where the base weight is pruned, so the sparsity survives.

A layer fine-tuned with LoRA computes with the effective weight ``W + s·B·A``. Pruning ``W`` alone leaves the
update ``s·B·A`` dense, and folding it in (PEFT's ``merge_and_unload()``) fills every pruned entry again. Here the
mask ``M`` of ``W`` applies to the whole effective weight, ``M ⊙ (W + s·B·A)``, during training (the approach of
SPP, sparsity-preserved PEFT): what trains is the sparse model that will be shipped, and
:func:`lightprune.export.merge_lora` folds the update in exactly.

Two kinds of adapted layer are understood (this module imports torch alone; PEFT only when a model holds its layers):

* PEFT's LoRA ``Linear`` (``peft.tuners.lora.Linear``, also with ``fan_in_fan_out=True`` around transformers'
  ``Conv1D``): :func:`mask_delta` installs :class:`MaskedDelta` as the LoRA variant of each adapter, whose forward
  adds ``dropout(x) @ (M ⊙ s·B·A)ᵀ`` instead of LoRA's two thin products, and whose merge (PEFT's own
  ``merge_and_unload()`` included) adds the masked update.
* A plain ``nn.Module`` marked by its author (:func:`is_marked`): it has a ``base_layer`` (the module owning the
  pruned ``weight``), a method ``delta_weight()`` returning the update in the weight's layout (differentiable), and
  an attribute ``delta_mask`` (``None`` until lightprune sets the weight's mask there); its forward adds the update
  masked by ``delta_mask`` when that is set. See :class:`AdaptedWeight` for an example.

Cost of the masked update, per adapted layer and step: the update ``s·B·A`` is formed as a dense weight-sized
tensor (``out·in·r`` multiply-adds) and masked. Without dropout and with one adapter, the forward multiplies the
input with ``W + M ⊙ s·B·A`` once (PEFT has already run the base layer's product, which is then left unused), and the
backward runs two weight-sized products (the input's gradient and the update's, from which ``A`` and ``B`` get theirs
by thin products): about full fine-tuning's compute plus one forward product. With dropout the update's product is a
second one, as in LoRA, and the backward needs three. Memory: a weight-sized tensor per adapted layer is kept for the
backward; the optimizer state is LoRA's (``2·r·(out+in)`` per layer instead of ``2·out·in``).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from lightprune import prune
from lightprune.prune.masking import masked

__all__ = [
    "AdaptedWeight",
    "adapted_layers",
    "adapter_problems",
    "effective_weight",
    "is_marked",
    "mask_delta",
]


def is_marked(module: nn.Module) -> bool:
    """Whether ``module`` is a plain module marked as adapted: ``base_layer``, ``delta_weight()`` and ``delta_mask``.

    Example:
        >>> is_marked(nn.Linear(2, 2)), is_marked(AdaptedWeight(nn.Linear(4, 3), rank=2))
        (False, True)
    """
    return (
        isinstance(getattr(module, "base_layer", None), nn.Module)
        and callable(getattr(module, "delta_weight", None))
        and hasattr(module, "delta_mask")
        and not _is_peft_layer(module)
    )


def _is_peft_layer(module: nn.Module) -> bool:
    """A PEFT tuner layer (LoRA, DoRA, IA3...): only possible when PEFT was imported."""
    if "peft" not in sys.modules:
        return False
    from peft.tuners.tuners_utils import BaseTunerLayer

    return isinstance(module, BaseTunerLayer)


def _is_peft_lora_linear(module: nn.Module) -> bool:
    if "peft" not in sys.modules:
        return False
    from peft.tuners.lora.layer import Linear

    return type(module) is Linear


def adapted_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Every adapted layer of ``model``: PEFT tuner layers and marked modules (:func:`is_marked`), by name.

    Example:
        >>> net = nn.Sequential(AdaptedWeight(nn.Linear(4, 3), rank=2), nn.ReLU())
        >>> [name for name, _ in adapted_layers(net)]
        ['0']
    """
    for name, module in model.named_modules():
        if (_is_peft_layer(module) and hasattr(module, "get_base_layer")) or is_marked(module):
            yield name, module


def base_of(layer: nn.Module) -> nn.Module:
    """The module owning the adapted weight (PEFT's ``get_base_layer()``, else ``base_layer``)."""
    get = getattr(layer, "get_base_layer", None)
    return get() if callable(get) else layer.base_layer


def _active_adapters(layer: nn.Module) -> list[str]:
    if getattr(layer, "disable_adapters", False):
        return []
    trained = [layer.lora_A, getattr(layer, "lora_embedding_A", {})]  # PEFT keeps an Embedding's apart
    return [name for name in layer.active_adapters if any(name in adapters for adapters in trained)]


def delta(layer: nn.Module) -> Tensor | None:
    """The update of an adapted layer's weight in the weight's layout (every active adapter), unmasked; ``None`` when
    nothing is active."""
    if is_marked(layer):
        return layer.delta_weight()
    parts = [layer.get_delta_weight(name) for name in _active_adapters(layer)]
    return None if not parts else functools.reduce(torch.add, parts)


def delta_mask(layer: nn.Module) -> Tensor | None:
    """The mask the layer's forward applies to its update (``None``: the update is not masked)."""
    if is_marked(layer):
        return layer.delta_mask
    variants = getattr(layer, "lora_variant", {})
    found = [variants.get(name) for name in _active_adapters(layer)]
    masks = [v.mask for v in found if isinstance(v, _masked_delta_class())]
    return masks[0] if masks and len(masks) == len(found) else None


def effective_weight(layer: nn.Module) -> Tensor:
    """``W + update`` of an adapted layer, detached, unmasked (``W``: the base weight's Parameter, ``name_orig``
    while it is pruned): what importance ranks.

    Example:
        >>> layer = AdaptedWeight(nn.Linear(4, 3), rank=2)
        >>> torch.equal(effective_weight(layer), layer.base_layer.weight + layer.delta_weight())
        True
    """
    with torch.no_grad():
        weight = prune.original(base_of(layer), "weight").detach()
        update = delta(layer)
        return weight if update is None else weight + update.to(weight.dtype)


def mask_delta(layer: nn.Module, mask: Tensor | None) -> None:
    """From now on, the layer's forward masks its update with ``mask`` (the base weight's, in its layout).

    A PEFT LoRA ``Linear`` gets :class:`MaskedDelta` as the variant of each adapter (once); a marked module gets
    ``delta_mask = mask``.

    Example:
        >>> layer = AdaptedWeight(nn.Linear(4, 3), rank=2)
        >>> mask_delta(layer, torch.ones(3, 4, dtype=torch.bool))
        >>> layer.delta_mask.shape
        torch.Size([3, 4])
    """
    if is_marked(layer):
        layer.delta_mask = mask
        return
    variant_class = _masked_delta_class()
    for name in layer.lora_A:
        variant = layer.lora_variant.get(name)
        if not isinstance(variant, variant_class):
            variant = layer.lora_variant[name] = variant_class()
        variant.mask = mask


def adapter_problems(selection: Iterable[tuple[str, nn.Module, str]], model: nn.Module) -> list[str]:
    """Why the selected tensors of ``model`` cannot be pruned with their adapters' updates masked, if they cannot.

    Supported: the ``weight`` of the base layer of a PEFT LoRA ``Linear`` (one or more plain LoRA adapters, not
    merged, ``lora_bias=False``) and of a marked module; any tensor outside adapted layers. Refused, by name: the
    adapters' own tensors (``lora_A``, ``lora_B``...), other PEFT layer types (LoRA on embeddings or convolutions,
    DoRA and other LoRA variants, IA3, LoHa, AdaLoRA...), merged adapters, and the frozen ``original_module`` copy
    PEFT keeps of a ``modules_to_save`` layer (its trained copy may be selected).

    Example:
        >>> net = nn.Sequential(AdaptedWeight(nn.Linear(4, 3), rank=2))
        >>> adapter_problems([("0.A", net[0], "A")], net)
        ["0.A is a tensor of the adapted layer '0' (AdaptedWeight), not its base weight: select '0.base_layer.weight'"]
    """
    layers = dict(adapted_layers(model))
    frozen_copies = [
        f"{name}.original_module." if name else "original_module."
        for name, module in model.named_modules()
        if type(module).__name__ == "ModulesToSaveWrapper" and type(module).__module__.startswith("peft")
    ]
    problems = []
    for qualified, module, name in selection:
        owner = _owner_name(qualified)
        copy = next((prefix for prefix in frozen_copies if qualified.startswith(prefix)), None)
        if copy is not None:
            wrapper = copy[: -len("original_module.")]
            problems.append(
                f"{qualified} is the frozen copy PEFT keeps under modules_to_save (unused while the adapter is "
                f"active, dropped by merge_and_unload), not the copy that trains ({wrapper}modules_to_save.<adapter>):"
                " exclude it, e.g. exclude=r'.*\\.original_module\\..*'"
            )
            continue
        for layer_name, layer in layers.items():
            inside = owner == layer_name or owner.startswith(layer_name + ".") if layer_name else True
            if not inside:
                continue
            base = base_of(layer)
            if module is not base or name != "weight":
                if module is base:
                    continue  # a bias of the base layer: the update does not touch it
                problems.append(
                    f"{qualified} is a tensor of the adapted layer {layer_name!r} ({type(layer).__name__}), not its "
                    f"base weight: select {layer_name + '.base_layer.weight'!r}"
                )
                continue
            problems += _layer_problems(layer_name, layer)
    return problems


def _layer_problems(layer_name: str, layer: nn.Module) -> list[str]:
    if is_marked(layer):
        return []
    kind = f"{type(layer).__module__}.{type(layer).__qualname__}"
    if not _is_peft_lora_linear(layer):
        return [
            f"{layer_name!r} is a {kind}: lightprune masks the updates of PEFT LoRA Linear layers (and marked "
            "modules) only; exclude its base weight"
        ]
    problems = []
    variant_class = _masked_delta_class()
    others = {n: type(v).__name__ for n, v in layer.lora_variant.items() if not isinstance(v, variant_class)}
    if others:
        problems.append(
            f"{layer_name!r} uses the LoRA variant(s) {others} (DoRA or another): only plain LoRA updates can be "
            "masked; exclude its base weight"
        )
    if any(layer.lora_bias.get(n, False) for n in layer.lora_A):
        problems.append(f"{layer_name!r} has lora_bias=True: its update has a bias term that cannot be masked")
    if layer.merged:
        problems.append(f"{layer_name!r} has merged adapters ({layer.merged_adapters}): unmerge them first")
    return problems


def _owner_name(qualified: str) -> str:
    return qualified.rsplit(".", 1)[0] if "." in qualified else ""


def layer_of(model: nn.Module, module: nn.Module) -> nn.Module | None:
    """The adapted layer of ``model`` whose base layer is ``module``, if any."""
    for _, layer in adapted_layers(model):
        if base_of(layer) is module:
            return layer
    return None


# ----------------------------------------------------------------------------------------------------------------
# The masked update inside PEFT's LoRA Linear
# ----------------------------------------------------------------------------------------------------------------


def _keep(mask: Tensor) -> Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def masked_update(layer: nn.Module, adapter: str, mask: Tensor | None) -> Tensor:
    """``s·B·A`` of one PEFT adapter in the base weight's layout, masked by ``mask`` (differentiable)."""
    update = layer.get_delta_weight(adapter)
    if mask is None:
        return update
    return masked(update, _keep(mask).to(update.device))


def _single_adapter(layer: nn.Module) -> bool:
    return len(_active_adapters(layer)) == 1


def _linear_like(module: nn.Module) -> bool:
    from lightprune.layouts import is_transformers_conv1d

    return type(module) is nn.Linear or is_transformers_conv1d(module)


@functools.cache
def _masked_delta_class() -> type:
    """:class:`MaskedDelta`, built on PEFT's ``LoraVariant`` on first use (PEFT is imported only then)."""
    from peft.tuners.lora.layer import LoraVariant

    class _MaskedDelta(LoraVariant):
        __doc__ = _MASKED_DELTA_DOC

        def __init__(self) -> None:
            self.mask: Tensor | None = None
            self.fold = True  # without dropout, one product with W + M ⊙ s·B·A (False: two, as LoRA computes)

        def supports_lora_conversion(self) -> bool:
            return False

        @staticmethod
        def init(module: nn.Module, adapter_name: str, **kwargs: Any) -> None:
            """Nothing to set up: the adapter's ``lora_A`` and ``lora_B`` are LoRA's."""

        # PEFT writes a merge into the base layer's ``weight``; under the pruning reparametrization (a fit with
        # make_permanent=False) that is recomputed from ``weight_orig`` before every forward, so the Parameter
        # takes the same change (the masked update is zero where pruned)

        def merge_safe(self, module: nn.Module, active_adapter: str, orig_weight: Tensor) -> Tensor:
            update = masked_update(module, active_adapter, self.mask).detach()
            merged = orig_weight + update.to(orig_weight.dtype)
            if bool(torch.isfinite(merged).all()):  # PEFT refuses a merge that is not finite: nothing changes then
                _shift_reparametrized(module, update)
            return merged

        def merge_unsafe(self, module: nn.Module, active_adapter: str, orig_weight: Tensor) -> None:
            update = masked_update(module, active_adapter, self.mask).detach()
            orig_weight.data += update.to(orig_weight.dtype)
            _shift_reparametrized(module, update)

        def unmerge(self, module: nn.Module, active_adapter: str, orig_weight: Tensor) -> Tensor:
            update = masked_update(module, active_adapter, self.mask).detach()
            _shift_reparametrized(module, -update)
            return orig_weight - update.to(orig_weight.dtype)

        def forward(self, module: nn.Module, active_adapter: str, x: Tensor, result: Tensor, **kwargs: Any) -> Tensor:
            device = module.lora_A[active_adapter].weight.device
            if self.mask is not None and self.mask.device != device:  # the model moved after the mask was set
                self.mask = self.mask.to(device)
            update = masked_update(module, active_adapter, self.mask)
            dropout = module.lora_dropout[active_adapter]
            base = module.get_base_layer()
            if self.fold and isinstance(dropout, nn.Identity) and _single_adapter(module) and _linear_like(base):
                # one product with the effective weight: ``result`` (the base layer's output) is left unused, so
                # the backward runs one weight-sized product for the input and one for the update, as full
                # fine-tuning of the weight does (two separate products would cost one more each way)
                weight = base.weight + update.to(base.weight.dtype)
                x = x.to(weight.dtype)  # (PEFT casts x to the adapter's dtype, float32 beside a bfloat16 base)
                return F.linear(x, weight.T if module.fan_in_fan_out else weight, base.bias).to(result.dtype)
            if module.fan_in_fan_out:  # the mask and the update in Conv1D's (in, out) layout
                update = update.T
            return result + F.linear(dropout(x), update.to(x.dtype))

    _MaskedDelta.__name__ = _MaskedDelta.__qualname__ = "MaskedDelta"
    return _MaskedDelta


def _shift_reparametrized(layer: nn.Module, update: Tensor) -> None:
    """Add ``update`` to the base weight's ``weight_orig`` if the base weight is under the pruning reparametrization."""
    base = layer.get_base_layer()
    if "weight" in prune.pruned_names(base):
        with torch.no_grad():
            orig = prune.original(base, "weight")
            orig += update.to(device=orig.device, dtype=orig.dtype)


_MASKED_DELTA_DOC = """The LoRA variant that masks an adapter's update with the base weight's mask: ``M ⊙ s·B·A``.

    Installed by :func:`mask_delta` on PEFT LoRA ``Linear`` layers whose base weight is pruned; ``mask`` (in the
    base weight's layout) is set by lightprune at every pruning event. Its forward returns
    ``F.linear(x, W + M ⊙ s·B·A, bias)`` for a single adapter without dropout (``fold``, the default), else adds
    ``F.linear(dropout(x), M ⊙ s·B·A)`` to the base layer's result; PEFT's ``merge``, ``unmerge`` and
    ``merge_and_unload`` add or subtract the masked update.
    """


def __getattr__(name: str) -> Any:
    """``MaskedDelta`` is built on PEFT's ``LoraVariant`` when first asked for (PEFT is imported then)."""
    if name == "MaskedDelta":
        return _masked_delta_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ----------------------------------------------------------------------------------------------------------------
# A marked plain module
# ----------------------------------------------------------------------------------------------------------------


class AdaptedWeight(nn.Module):
    """A low-rank update ``scale·B·A`` beside a ``nn.Linear``, marked so lightprune masks the update: an example of
    how to mark a plain module, and a small LoRA for models without PEFT.

    The marks are ``base_layer`` (the module whose ``weight`` is pruned), ``delta_weight()`` (the update in that
    weight's layout, differentiable) and ``delta_mask`` (``None``; lightprune sets the weight's mask here). The
    forward must add the update masked by ``delta_mask`` when it is set.

    Args:
        base_layer: the ``nn.Linear`` adapted (its parameters are frozen here).
        rank: the rank ``r`` of the update.
        alpha: the update is scaled by ``alpha / rank``; ``B`` starts at zero, so the layer starts as ``base_layer``.

    Example:
        >>> layer = AdaptedWeight(nn.Linear(4, 3), rank=2)
        >>> x = torch.randn(5, 4)
        >>> torch.equal(layer(x), layer.base_layer(x)), layer.base_layer.weight.requires_grad
        (True, False)
    """

    def __init__(self, base_layer: nn.Linear, rank: int, alpha: float = 1.0) -> None:
        super().__init__()
        self.base_layer = base_layer
        for parameter in base_layer.parameters():
            parameter.requires_grad_(False)
        weight = base_layer.weight
        self.A = nn.Parameter(torch.randn(rank, weight.shape[1], dtype=weight.dtype) / weight.shape[1] ** 0.5)
        self.B = nn.Parameter(torch.zeros(weight.shape[0], rank, dtype=weight.dtype))
        self.scale = alpha / rank
        self.delta_mask: Tensor | None = None

    def delta_weight(self) -> Tensor:
        """The update ``scale·B·A``, shaped like ``base_layer.weight``."""
        return (self.B @ self.A) * self.scale

    def forward(self, x: Tensor) -> Tensor:
        """``base_layer(x) + x @ (delta_mask ⊙ scale·B·A)ᵀ``."""
        update = self.delta_weight()
        if self.delta_mask is not None:
            update = masked(update, _keep(self.delta_mask).to(update.device))
        return self.base_layer(x) + F.linear(x, update)
