"""Layer collapse in the engine: ``global_unstructured`` says it, and ``max_layer_sparsity`` prevents it exactly.

The capped selection is checked against an independent greedy reference written here: every eligible entry in rank
order (magnitude, then tensor, then flat index: the engine's tie rule), taken unless its tensor already holds its
cap, until the count is reached.
"""

from __future__ import annotations

import contextlib
import io
import re
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from lightprune import prune
from lightprune.prune.collapse import LayerCollapseWarning, cap_units, check_max_layer_sparsity
from lightprune.prune.distributed import sharded_unstructured_masks


def brute_cap(cap: float, units: int) -> int:
    """The most units that may be pruned, by trying them all."""
    return max(p for p in range(units + 1) if p / units <= cap)


def greedy(scores: list[torch.Tensor], eligible: list[torch.Tensor], k: int, caps: list[int]) -> list[torch.Tensor]:
    """The reference capped selection: True where selected."""
    entries = [
        (abs(float(value)), t, i)
        for t, (s, e) in enumerate(zip(scores, eligible, strict=True))
        for i, (value, ok) in enumerate(zip(s.flatten().tolist(), e.flatten().tolist(), strict=True))
        if ok
    ]
    chosen = [torch.zeros(s.numel(), dtype=torch.bool) for s in scores]
    taken = [0] * len(scores)
    for _, t, i in sorted(entries):
        if k == 0:
            break
        if taken[t] < caps[t]:
            chosen[t][i], taken[t], k = True, taken[t] + 1, k - 1
    return [c.view(s.shape) for c, s in zip(chosen, scores, strict=True)]


@st.composite
def layers(draw: st.DrawFn) -> list[nn.Linear]:
    """1 to 5 Linear layers of random sizes whose weights are multiples of 1/4 in [-2, 2] (many ties)."""
    shapes = draw(st.lists(st.tuples(st.integers(1, 6), st.integers(1, 8)), min_size=1, max_size=5))
    modules = []
    for rows, cols in shapes:
        layer = nn.Linear(cols, rows, bias=False)
        values = draw(st.lists(st.integers(-8, 8), min_size=rows * cols, max_size=rows * cols))
        with torch.no_grad():
            layer.weight.copy_(torch.tensor(values, dtype=torch.float32).view(rows, cols) / 4)
        modules.append(layer)
    return modules


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(modules=layers(), first=st.floats(0.0, 0.6), cap=st.floats(0.05, 1.0), fraction=st.floats(0.0, 1.0))
def test_capped_global_pruning_is_the_greedy_selection_exact_per_layer_and_in_total(
    modules: list[nn.Linear], first: float, cap: float, fraction: float
) -> None:
    pairs = [(m, "weight") for m in modules]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LayerCollapseWarning)
        prune.global_unstructured(pairs, prune.L1Unstructured, amount=first)  # an earlier, uncapped call
    scores = [m.weight_orig.detach().clone() for m in modules]
    before = [m.weight_mask.bool().clone() for m in modules]
    units = [s.numel() for s in scores]
    pruned = [int((~b).sum()) for b in before]
    caps = [max(0, brute_cap(cap, n) - p) for n, p in zip(units, pruned, strict=True)]
    available = sum(int(b.sum()) for b in before)
    k = round(fraction * available)
    if k > sum(caps):
        with pytest.raises(ValueError, match=rf"max_layer_sparsity={cap} leaves {sum(caps)} .* fewer than the {k}"):
            prune.global_unstructured(pairs, prune.L1Unstructured, amount=k, max_layer_sparsity=cap)
        for m, b in zip(modules, before, strict=True):  # nothing changed
            assert torch.equal(m.weight_mask.bool(), b)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LayerCollapseWarning)
        prune.global_unstructured(pairs, prune.L1Unstructured, amount=k, max_layer_sparsity=cap)
    want = greedy(scores, before, k, caps)
    for m, b, w, n, p in zip(modules, before, want, units, pruned, strict=True):
        assert torch.equal(m.weight_mask.bool(), b & ~w)
        now = int((~m.weight_mask.bool()).sum())
        assert now <= max(p, brute_cap(cap, n))  # never beyond the cap (nor below what was pruned before)
    assert sum(int((~m.weight_mask.bool()).sum()) for m in modules) == sum(pruned) + k  # the total is exact


@settings(max_examples=40, deadline=None)
@given(modules=layers(), cap=st.floats(0.05, 1.0), fraction=st.floats(0.0, 1.0))
def test_sharded_capped_selection_in_one_process_is_the_engines(
    modules: list[nn.Linear], cap: float, fraction: float
) -> None:
    tensors = [m.weight.detach().clone() for m in modules]
    k = round(fraction * sum(t.numel() for t in tensors))
    if k > sum(brute_cap(cap, t.numel()) for t in tensors):
        with pytest.raises(ValueError, match="max_layer_sparsity"):
            sharded_unstructured_masks(tensors, k, max_layer_sparsity=cap)
        return
    masks = sharded_unstructured_masks(tensors, k, max_layer_sparsity=cap)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LayerCollapseWarning)
        prune.global_unstructured([(m, "weight") for m in modules], prune.L1Unstructured, amount=k,
                                  max_layer_sparsity=cap)  # fmt: skip
    for m, mask in zip(modules, masks, strict=True):
        assert torch.equal(m.weight_mask.bool(), mask)


@given(cap=st.floats(1e-6, 1.0), units=st.integers(1, 5000))
def test_cap_units_is_the_largest_count_within_the_cap(cap: float, units: int) -> None:
    p = cap_units(cap, units)
    assert p / units <= cap
    assert p == units or (p + 1) / units > cap


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2))


def test_a_collapsed_output_layer_is_named_and_the_result_is_the_rankings() -> None:
    net, same = mlp(), mlp()
    pairs = [(net[0], "weight"), (net[2], "weight")]
    with pytest.warns(
        LayerCollapseWarning, match=r"every weight of parameters\[1\] \(Linear\.weight, shape \(2, 64\)\)"
    ):
        prune.global_unstructured(pairs, prune.L1Unstructured, amount=0.8)
    assert not net[2].weight_mask.bool().any()  # collapsed: the output is the bias alone, whatever the input
    x = torch.randn(5, 20)
    assert torch.equal(net(x), net[2].bias.expand(5, 2))
    # the result is the plain ranking's: torch's own global_unstructured gives the same masks
    from torch.nn.utils import prune as torch_prune

    torch_prune.global_unstructured([(same[0], "weight"), (same[2], "weight")], torch_prune.L1Unstructured, amount=0.8)
    assert torch.equal(net[0].weight_mask.bool(), same[0].weight_mask.bool())
    # said once: a later call on the collapsed layer does not repeat it
    with warnings.catch_warnings():
        warnings.simplefilter("error", LayerCollapseWarning)
        prune.global_unstructured(pairs, prune.L1Unstructured, amount=0.1)


def test_no_collapse_no_warning_and_the_cap_prevents_it() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", LayerCollapseWarning)
        net = mlp()
        prune.global_unstructured([(net[0], "weight"), (net[2], "weight")], prune.L1Unstructured, amount=0.5)
        capped = mlp()
        pairs = [(capped[0], "weight"), (capped[2], "weight")]
        prune.global_unstructured(pairs, prune.L1Unstructured, amount=0.8, max_layer_sparsity=0.95)
    assert int((~capped[2].weight_mask.bool()).sum()) == 121  # 0.95 of 128, rounded down
    assert sum(int((~m.weight_mask.bool()).sum()) for m in (capped[0], capped[2])) == round(0.8 * (1280 + 128))


def test_random_unstructured_honours_the_cap_too() -> None:
    net = mlp()
    pairs = [(net[0], "weight"), (net[2], "weight")]
    torch.manual_seed(3)
    prune.global_unstructured(pairs, prune.RandomUnstructured, amount=700, max_layer_sparsity=0.5)
    assert int((~net[2].weight_mask.bool()).sum()) <= 64 and int((~net[0].weight_mask.bool()).sum()) <= 640
    assert sum(int((~m.weight_mask.bool()).sum()) for m in (net[0], net[2])) == 700


def test_caps_refused_with_a_message_and_nothing_changed() -> None:
    net = mlp()
    pairs = [(net[0], "weight"), (net[2], "weight")]
    with pytest.raises(ValueError, match=r"max_layer_sparsity=0.5 leaves 704 of the 1408 unpruned .* fewer than"):
        prune.global_unstructured(pairs, prune.L1Unstructured, amount=0.6, max_layer_sparsity=0.5)
    assert not prune.is_pruned(net)
    for bad in (0, -0.1, 1.5, float("nan"), True, "0.9"):
        with pytest.raises(ValueError, match=r"max_layer_sparsity=.* must be a float in \(0, 1\]"):
            prune.global_unstructured(pairs, prune.L1Unstructured, amount=0.5, max_layer_sparsity=bad)
        with pytest.raises(ValueError, match="must be a float in"):
            check_max_layer_sparsity(bad)

    class Mine(prune.BasePruningMethod):
        PRUNING_TYPE = "unstructured"

        def __init__(self, amount: float) -> None:
            self.amount = amount

        def compute_mask(self, t: torch.Tensor, default_mask: torch.Tensor) -> torch.Tensor:
            return default_mask

    with pytest.raises(
        ValueError, match=r"max_layer_sparsity=0\.9 needs L1Unstructured or RandomUnstructured; got Mine"
    ):
        prune.global_unstructured(pairs, Mine, amount=0.5, max_layer_sparsity=0.9)
    prune.global_unstructured(pairs, Mine, amount=0.5)  # without a cap, a custom method runs as in torch


def test_the_docs_mlp_example_says_the_collapse_and_the_cap_prevents_it() -> None:
    readme = (Path(__file__).resolve().parents[2] / "docs" / "callback.md").read_text()
    (source,) = [
        b for b in re.findall(r"```python\n(.*?)```", readme, flags=re.DOTALL) if "max_layer_sparsity=0.95)" in b
    ]
    printed = io.StringIO()
    said = pytest.warns(LayerCollapseWarning, match=r"parameters\[1\] \(Linear\.weight, shape \(2, 64\)\)")
    with said, contextlib.redirect_stdout(printed):
        exec(compile(source, "docs/callback.md", "exec"), {})
    assert printed.getvalue().split() == ["121", "1126"]  # as the page says: 0.95 of 128 held, 0.8 of 1408 in all
