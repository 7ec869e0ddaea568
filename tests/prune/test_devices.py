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


ROUTES = {  # (BIN_LIMIT, SAMPLE, RADIX_BITS): which route find_cut takes on 200,000 entries
    "sort all": (1 << 20, 1 << 18, 16),  # at most BIN_LIMIT entries: their keys sorted at once
    "sample and window": (1 << 10, 1 << 12, 16),  # the sample's window holds the k-th key
    "histograms": (1 << 10, 0, 8),  # no sample: histogram passes, refined, the last bin's keys sorted
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
@pytest.mark.parametrize(("magnitude", "largest"), [(True, False), (False, True)])
def test_every_route_of_the_search_finds_the_cpus_cut(
    device: str, route: str, dtype: torch.dtype, magnitude: bool, largest: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The k-th key is picked where the keys are (a sort or ``kthvalue`` on the device): the same cut and masks as
    on the CPU, ties split by flat order, over tensors of mixed shapes and eligibility."""
    from lightprune.prune import k_smallest

    limit, sample, radix = ROUTES[route]
    for name, value in {"BIN_LIMIT": limit, "SAMPLE": sample, "RADIX_BITS": radix, "CHUNK_CUDA": 1 << 14}.items():
        monkeypatch.setattr(k_smallest, name, value)
    generator = torch.Generator().manual_seed(1)
    # 700 distinct values over 200,000 entries: every key is shared by hundreds of entries, so the cut splits ties.
    pool = (torch.randint(-350, 350, (200_000,), generator=generator).double() / 8).to(dtype)
    scores = [pool[:120_000].reshape(300, 400), pool[120_000:199_000], pool[199_000:].reshape(10, 100)]
    eligible = [None, torch.rand(79_000, generator=generator) < 0.7, None]
    k = 61_234
    taken: list[str] = []
    window, gather, histogram = k_smallest._window_cut, k_smallest._gather, k_smallest.histogram

    def spied_window(*args: object) -> object:
        found = window(*args)
        taken.append("window" if found is not None else "window missed")
        return found

    def spied_gather(*args: object) -> Tensor:
        taken.append("a bin's keys sorted" if args[-1] is not None else "all keys sorted")
        return gather(*args)

    def spied_histogram(*args: object) -> Tensor:
        taken.append("histogram")
        return histogram(*args)

    monkeypatch.setattr(k_smallest, "_window_cut", spied_window)
    monkeypatch.setattr(k_smallest, "_gather", spied_gather)
    monkeypatch.setattr(k_smallest, "histogram", spied_histogram)
    cuts, masks = {}, {}
    for where in dict.fromkeys(("cpu", device)):
        here = [s.to(where) for s in scores]
        allowed = [None if e is None else e.to(where) for e in eligible]
        cuts[where] = k_smallest.find_cut(here, k, eligible=allowed, magnitude=magnitude, largest=largest)
        found = k_smallest.select_smallest(here, k, eligible=allowed, magnitude=magnitude, largest=largest)
        masks[where] = [m.cpu() for m in found]
    expected_route = {
        "sort all": {"all keys sorted"},
        "sample and window": {"window"},
        "histograms": {"window missed", "histogram"},
    }[route]
    assert expected_route <= set(taken) <= expected_route | {"a bin's keys sorted"}
    assert cuts[device] == cuts["cpu"]
    assert cuts["cpu"].ties > 0  # the cut splits a run of equal keys: the tie rule is exercised
    # The reference: a stable sort of every eligible entry, ties in flat order across the tensors.
    flat = torch.cat([s.reshape(-1).double() for s in scores])
    rank = flat.abs() if magnitude else flat
    rank = -rank if largest else rank
    allowed_flat = torch.cat(
        [torch.ones(s.numel(), dtype=torch.bool) if e is None else e for s, e in zip(scores, eligible, strict=True)]
    )
    rank[~allowed_flat] = float("inf")
    want = torch.zeros(flat.numel(), dtype=torch.bool)
    want[torch.sort(rank, stable=True).indices[:k]] = True
    assert torch.equal(torch.cat([m.reshape(-1) for m in masks["cpu"]]), want)
    assert sum(int(m.sum()) for m in masks[device]) == k
    for cpu_mask, device_mask in zip(masks["cpu"], masks[device], strict=True):
        assert torch.equal(cpu_mask, device_mask)
