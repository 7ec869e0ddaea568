"""Unit scores against references written here, exact per-group masks through lightprune.prune, refusals."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_transformers import BUILDERS, outputs
from torch import nn

from lightprune import prune
from lightprune.structure import collect_moments, find_units, prune_units, unit_scores

pytestmark = pytest.mark.usefixtures("one_thread_for_module")


@pytest.fixture(scope="module")
def llama() -> tuple[nn.Module, dict, list]:
    model, example, _ = BUILDERS["llama"]()
    return model, example, find_units(model, (), example)


def _attn(model: nn.Module, layer: int) -> nn.Module:
    return model.model.layers[layer].self_attn


def test_magnitude_is_the_l2_of_every_weight_of_the_unit(llama: tuple) -> None:
    model, _, groups = llama
    heads, neurons = groups[0], groups[1]  # layer 0: attention, then MLP
    mlp, attn = model.model.layers[0].mlp, _attn(model, 0)
    want = (
        mlp.gate_proj.weight.square().sum(1) + mlp.up_proj.weight.square().sum(1)
    ) + mlp.down_proj.weight.square().sum(0)
    torch.testing.assert_close(unit_scores(model, neurons), want.detach().double().sqrt())
    want_heads = []
    torch.set_grad_enabled(False)
    for g in range(4):  # kv head g with query heads 2g, 2g+1 (4 features each)
        q = slice(8 * g, 8 * g + 8)
        kv = slice(4 * g, 4 * g + 4)
        total = sum(float(t.square().sum()) for t in (attn.q_proj.weight[q], attn.q_proj.bias[q]))
        total += sum(float(t.square().sum()) for p in (attn.k_proj, attn.v_proj) for t in (p.weight[kv], p.bias[kv]))
        total += float(attn.o_proj.weight[:, q].square().sum())
        want_heads.append(math.sqrt(total))
    torch.set_grad_enabled(True)
    torch.testing.assert_close(unit_scores(model, heads), torch.tensor(want_heads, dtype=torch.float64))


def test_activation_is_output_norm_times_column_norm(llama: tuple) -> None:
    model, example, groups = llama
    batches = [example, {"input_ids": example["input_ids"][:, :4]}]
    seen = []
    handle = model.model.layers[1].mlp.down_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach()))
    try:
        stats = collect_moments(model, groups, batches)
    finally:
        handle.remove()
    inputs = torch.cat([x.reshape(-1, x.shape[-1]) for x in seen]).double()
    down = model.model.layers[1].mlp.down_proj.weight.detach().double()
    want = inputs.norm(dim=0) * down.norm(dim=0)
    torch.testing.assert_close(unit_scores(model, groups[3], "activation", moments=stats), want)
    assert stats["model.layers.1.mlp.down_proj"].count == 2 * 7 + 2 * 4


def test_taylor_is_the_abs_sum_of_weight_times_gradient() -> None:
    mlp = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))
    group = find_units(mlp, (torch.randn(1, 3),))[0]
    mlp(torch.randn(7, 3)).square().sum().backward()
    first, second = mlp[0], mlp[2]
    want = (first.weight * first.weight.grad).sum(1) + first.bias * first.bias.grad
    want = (want + (second.weight * second.weight.grad).sum(0)).abs()
    torch.testing.assert_close(unit_scores(mlp, group, "taylor"), want.detach().double())
    given_grads = {name: torch.ones_like(p) for name, p in mlp.named_parameters()}
    ones = (first.weight.sum(1) + first.bias + second.weight.sum(0)).abs()
    torch.testing.assert_close(unit_scores(mlp, group, "taylor", gradients=given_grads), ones.detach().double())


def test_callable_importance_and_refusals() -> None:
    mlp = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2))
    group = find_units(mlp, (torch.randn(1, 3),))[0]
    ranks = torch.tensor([4.0, 0.0, 3.0, 1.0, 2.0])
    prune_units(mlp, [group], 2, importance=lambda model, g: ranks)
    assert (mlp[2].weight == 0).all(0).tolist() == [False, True, False, True, False]
    with pytest.raises(ValueError, match=r"gave 2 scores for 5 units"):
        unit_scores(mlp, group, lambda model, g: torch.ones(2))
    with pytest.raises(
        ValueError, match=r"unknown importance 'size'; allowed: \['magnitude', 'activation', 'taylor'\]"
    ):
        unit_scores(mlp, group, "size")
    with pytest.raises(ValueError, match=r"needs the moments"):
        unit_scores(mlp, group, "activation")
    with pytest.raises(ValueError, match=r"unknown scope 'local'; allowed: \['layerwise', 'global'\]"):
        prune_units(mlp, [group], 0.5, scope="local")
    with pytest.raises(ValueError, match=r"prunes all 5 neurons of ''; keep at least one"):
        prune_units(mlp, [group], 1.0)


@pytest.mark.parametrize("scope", ["layerwise", "global"])
def test_a_nan_amount_is_refused_naming_it(scope: str) -> None:
    mlp = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2))
    group = find_units(mlp, (torch.randn(1, 3),))[0]
    weight = mlp[2].weight.detach().clone()
    with pytest.raises(ValueError, match=r"^amount=nan is out of range: a float amount is a fraction in \[0, 1\]"):
        prune_units(mlp, [group], math.nan, scope=scope)
    assert torch.equal(mlp[2].weight, weight) and not prune.is_pruned(mlp[2])


@pytest.mark.parametrize(("amount", "plain"), [(np.float32(0.4), 0.4), (np.int64(2), 2), (np.float64(0.6), 0.6)])
def test_numpy_amounts_count_as_the_numbers_they_hold(amount: object, plain: float | int) -> None:
    """torch's pruning methods take any real number (a NumPy scalar from a sweep, say); so does prune_units."""
    kept = []
    for value in (amount, plain):
        torch.manual_seed(0)
        mlp = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2))
        group = find_units(mlp, (torch.randn(1, 3),))[0]
        kept.append(prune_units(mlp, [group], value)[0])
    assert torch.equal(kept[0], kept[1])
    assert int((~kept[0]).sum()) == (plain if isinstance(plain, int) else round(plain * 5))


def _pruned_units(model: nn.Module, group) -> torch.Tensor:
    """Units whose every entry (rows, bias, columns) reads zero in the model's tensors, computed independently."""
    gone = torch.ones(group.count, dtype=torch.bool)
    for piece in group.slices:
        weight = getattr(model.get_submodule(piece.module), piece.name)
        for unit in range(group.count):
            block = weight.narrow(piece.dim, piece.offset + unit * piece.per_unit, piece.per_unit)
            gone[unit] &= bool((block == 0).all())
    return gone


@settings(max_examples=8, deadline=None)
@given(amount=st.sampled_from([1, 2, 3, 0.25, 0.5, 0.74]), seed=st.integers(0, 2**16))
def test_layerwise_masks_are_exact_per_group(amount: float | int, seed: int) -> None:
    model, example, _ = BUILDERS["llama"]()
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_()
    groups = find_units(model, (), example)
    scores = [unit_scores(model, g) for g in groups]
    keeps = prune_units(model, groups, amount)
    for group, keep, score in zip(groups, keeps, scores, strict=True):
        count = amount if isinstance(amount, int) else round(amount * group.count)
        assert int((~keep).sum()) == count
        assert torch.equal(_pruned_units(model, group), ~keep)
        if count:  # the lowest scores went
            assert float(score[~keep].max()) <= float(score[keep].min())
        for piece in group.slices:
            assert prune.is_pruned(model.get_submodule(piece.module))


def test_global_prunes_the_total_and_keeps_one_per_group() -> None:
    model, example, _ = BUILDERS["bert"]()
    groups = [g for g in find_units(model, (), example) if g.kind == "heads"]
    with torch.no_grad():  # layer 1's heads are all tiny: a global ranking takes them first, but keeps one
        for name in ("query", "key", "value"):
            getattr(model.encoder.layer[1].attention.self, name).weight.mul_(1e-3)
            getattr(model.encoder.layer[1].attention.self, name).bias.mul_(1e-3)
        model.encoder.layer[1].attention.output.dense.weight.mul_(1e-3)
    keeps = prune_units(model, groups, 4, scope="global")
    assert [int(k.sum()) for k in keeps] == [3, 1]
    assert sum(int(_pruned_units(model, g).sum()) for g in groups) == 4
    with pytest.raises(ValueError, match=r"every group must keep at least one"):
        prune_units(model, groups, 0.9, scope="global")


def test_pruning_again_prunes_further_and_failed_calls_change_nothing() -> None:
    model, example, _ = BUILDERS["gpt2"]()
    groups = find_units(model, (), example)
    prune_units(model, groups, 0.25)
    before = [t.clone() for t in outputs(model, example)]
    with pytest.raises(ValueError):
        prune_units(model, groups, 1.0)
    for a, b in zip(before, outputs(model, example), strict=True):
        assert torch.equal(a, b)
    keeps = prune_units(model, groups, 0.5)
    assert [int((~k).sum()) for k in keeps] == [round(0.5 * g.count) for g in groups]
    assert [int(_pruned_units(model, g).sum()) for g in groups] == [round(0.5 * g.count) for g in groups]


@pytest.mark.parametrize("scope", ["layerwise", "global"])
def test_units_already_pruned_rank_below_any_score_of_a_callable(scope: str) -> None:
    """Already-pruned units scored -1: with a callable's scores below -1 ("higher keeps", any sign) they outranked
    every live unit, so each call pruned its full count of new units on top of the old ones."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    groups = find_units(mlp, (torch.randn(1, 4),))

    def negative(model: nn.Module, group: object) -> torch.Tensor:  # minus a loss increase, say
        return -100.0 - torch.arange(8.0).flip(0)

    prune_units(mlp, groups, 0.25 if scope == "layerwise" else 4, importance=negative, scope=scope)
    prune_units(mlp, groups, 0.5 if scope == "layerwise" else 8, importance=negative, scope=scope)
    assert sum(int(_pruned_units(mlp, g).sum()) for g in groups) == 8


def test_nan_unit_scores_rank_above_every_number_in_a_global_ranking() -> None:
    """Python's sort of float tuples with NaN misranked the finite scores too (30 and 10 pruned, 3 and 4 kept)."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    groups = find_units(mlp, (torch.randn(1, 4),))
    nan = math.nan
    scores = [torch.tensor([30.0, nan, 10.0, nan, 90, 80, 70, 60]), torch.tensor([1.0, 2, 3, 4, 50, 51, 52, 53])]
    keeps = prune_units(mlp, groups, 4, importance=lambda model, group: scores[groups.index(group)], scope="global")
    assert [k.int().tolist() for k in keeps] == [[1] * 8, [0, 0, 0, 0, 1, 1, 1, 1]]
    layerwise = prune_units(mlp, groups, 0.75, importance=lambda model, group: scores[groups.index(group)])
    assert layerwise[0].int().tolist() == [0, 1, 0, 1, 0, 0, 0, 0]  # the NaN units kept longest
