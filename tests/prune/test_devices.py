"""The engine on every device: the same masks as ``torch.nn.utils.prune`` on that device, and as the CPU's.

Each test runs on the CPU and, where a CUDA device is visible, on it (skipped cleanly elsewhere). Weights are tie-free
(distinct magnitudes, exact in every float dtype used), so every method's answer is unique and the masks must be
equal, not just equally valid. Random methods draw from the generator of the weight's device, as torch's do: with the
same seed the masks are torch's.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch.nn.utils import prune as tp

from lightprune import prune as lp

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")),
]


def distinct(shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """Distinct magnitudes ``k / 32`` (``k`` = 1..256 are exact in float16 and bfloat16), random signs and order."""
    generator = torch.Generator().manual_seed(seed)
    n = torch.Size(shape).numel()
    magnitudes = (torch.randperm(n, generator=generator) + 1).double() / 32
    signs = torch.randint(0, 2, (n,), generator=generator).double() * 2 - 1
    return (magnitudes * signs).reshape(shape).to(dtype)


def tie_free_bits(n: int, seed: int) -> Tensor:
    """``n`` distinct float32 magnitudes (consecutive bit patterns from 1e-3, in random order), random signs."""
    generator = torch.Generator().manual_seed(seed)
    base = torch.tensor(1e-3, dtype=torch.float32).view(torch.int32).item()
    values = (torch.randperm(n, generator=generator, dtype=torch.int32) + base).view(torch.float32)
    signs = torch.randint(0, 2, (n,), generator=generator).bool()
    return torch.where(signs, -values, values)


def pair(weight: Tensor, device: str) -> tuple[nn.Linear, nn.Linear]:
    """Two Linear layers on ``device`` holding ``weight`` (and the same bias): one for torch, one for lightprune."""
    layers = []
    for _ in range(2):
        layer = nn.Linear(weight.shape[1], weight.shape[0], device=device, dtype=weight.dtype)
        with torch.no_grad():
            layer.weight.copy_(weight)
            layer.bias.copy_(distinct((weight.shape[0],), 99, weight.dtype))
        layers.append(layer)
    return layers[0], layers[1]


def same_calls(device: str, dtype: torch.dtype, calls: list[Callable[[object, nn.Module], object]], bool_masks: bool):
    """Run ``calls`` (each ``call(api, layer)``) on torch's layer and lightprune's, seeding alike before each call."""
    torch_layer, lp_layer = pair(distinct((16, 16), 0, dtype), device)
    for index, call in enumerate(calls):
        torch.manual_seed(index)
        call(tp, torch_layer)
        torch.manual_seed(index)
        with lp.mask_dtype(torch.bool if bool_masks else None):
            call(lp, lp_layer)
        for name in ("weight", "bias"):
            if hasattr(torch_layer, name + "_mask"):
                expected = getattr(torch_layer, name + "_mask")
                mask = getattr(lp_layer, name + "_mask")
                assert mask.device == expected.device, name
                assert torch.equal(mask.bool(), expected.bool()), f"call {index}, {name}: masks differ from torch's"
                assert torch.equal(getattr(lp_layer, name), getattr(torch_layer, name)), f"call {index}, {name}"
    return torch_layer, lp_layer


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("bool_masks", [False, True])
def test_unstructured_and_random_calls_match_torch_on_the_device(
    device: str, dtype: torch.dtype, bool_masks: bool
) -> None:
    calls = [
        lambda api, layer: api.l1_unstructured(layer, "weight", amount=0.3),
        lambda api, layer: api.random_unstructured(layer, "weight", amount=0.25),
        lambda api, layer: api.l1_unstructured(layer, "weight", amount=40),
        lambda api, layer: api.random_structured(layer, "weight", amount=3, dim=1),
        lambda api, layer: api.random_unstructured(layer, "bias", amount=5),
        # scores on the weight's device: torch's PruningContainer fails to index CPU scores with a CUDA mask
        lambda api, layer: api.l1_unstructured(
            layer, "bias", amount=0.5, importance_scores=distinct((16,), 7, dtype).to(device)
        ),
    ]
    if dtype in (torch.float16, torch.bfloat16):
        # random_unstructured draws in the weight's dtype (as torch does): in 8 or 11 bits, draws tie and either
        # library's pick among equal draws is right. The draws themselves are compared in float32 and float64.
        calls = [call for index, call in enumerate(calls) if index not in (1, 4)]
    _, layer = same_calls(device, dtype, calls, bool_masks)
    assert layer.weight_mask.dtype == (torch.bool if bool_masks else dtype)
    assert layer.weight.device.type == device


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [1, 2, float("inf")])  # -inf: channels holding a pruned entry tie at 0
def test_ln_structured_matches_torch_on_the_device(device: str, dtype: torch.dtype, n: float) -> None:
    calls = [
        lambda api, layer: api.ln_structured(layer, "weight", amount=0.25, n=n, dim=0),
        lambda api, layer: api.l1_unstructured(layer, "weight", amount=0.2),
        lambda api, layer: api.ln_structured(layer, "weight", amount=3, n=n, dim=1),
    ]
    same_calls(device, dtype, calls, bool_masks=False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bool_masks", [False, True])
def test_global_unstructured_matches_torch_on_the_device(device: str, bool_masks: bool) -> None:
    every = tie_free_bits(24 * 40 + 8 * 24, seed=1)
    weights = [every[: 24 * 40].reshape(24, 40), every[24 * 40 :].reshape(8, 24)]
    models = []
    for api in (tp, lp):
        layers = [nn.Linear(w.shape[1], w.shape[0], device=device) for w in weights]
        with torch.no_grad():
            for layer, weight in zip(layers, weights, strict=True):
                layer.weight.copy_(weight)
        params = [(layer, "weight") for layer in layers]
        with lp.mask_dtype(torch.bool if bool_masks and api is lp else None):
            api.global_unstructured(params, pruning_method=api.L1Unstructured, amount=0.6)
            api.global_unstructured(params, pruning_method=api.L1Unstructured, amount=100)
            torch.manual_seed(3)
            api.global_unstructured(params, pruning_method=api.RandomUnstructured, amount=0.1)
        models.append(layers)
    for torch_layer, lp_layer in zip(*models, strict=True):
        assert lp_layer.weight_mask.device.type == device
        assert torch.equal(lp_layer.weight_mask.bool(), torch_layer.weight_mask.bool())


@pytest.mark.parametrize("device", DEVICES)
def test_a_large_global_prune_gives_the_cpus_masks(device: str) -> None:
    """Millions of entries: the chunked selection and the histogram passes give the same masks on every device."""
    sizes = [(1024, 2048), (512, 1024), (3000,)]
    every = tie_free_bits(sum(torch.Size(size).numel() for size in sizes), seed=0)  # one draw: the layers interleave
    parts = every.split([torch.Size(size).numel() for size in sizes])
    values = [part.reshape(size) for part, size in zip(parts, sizes, strict=True)]
    found = {}
    for where in dict.fromkeys(("cpu", device)):
        holders = []
        for value in values:
            holder = nn.Module()
            holder.w = nn.Parameter(value.to(where))
            holders.append(holder)
        params = [(holder, "w") for holder in holders]
        with lp.mask_dtype(torch.bool):
            lp.global_unstructured(params, pruning_method=lp.L1Unstructured, amount=0.9)
            lp.global_unstructured(params, pruning_method=lp.L1Unstructured, amount=0.5)
        found[where] = [holder.w_mask.cpu() for holder in holders]
    total = sum(int((~mask).sum()) for mask in found[device])
    n = sum(value.numel() for value in values)
    assert total == round(0.9 * n) + round(0.5 * (n - round(0.9 * n)))
    for cpu_mask, device_mask in zip(found["cpu"], found[device], strict=True):
        assert torch.equal(cpu_mask, device_mask)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_semi_structured_gives_the_cpus_pattern(device: str, dtype: torch.dtype) -> None:
    weight = distinct((16, 16), 4, dtype)
    cpu_layer, layer = nn.Linear(16, 16, dtype=dtype), nn.Linear(16, 16, device=device, dtype=dtype)
    with torch.no_grad():
        cpu_layer.weight.copy_(weight)
        layer.weight.copy_(weight)
    lp.semi_structured(cpu_layer, "weight", n=2, m=4)
    lp.semi_structured(layer, "weight", n=2, m=4)
    assert layer.weight_mask.device.type == device
    assert torch.equal(layer.weight_mask.cpu(), cpu_layer.weight_mask)
    assert (layer.weight_mask.reshape(16, 4, 4).sum(-1) == 2).all()
