"""refit_consumers: the least-squares solution of a reference solver, and what it buys on a real model."""

from __future__ import annotations

import pytest
import torch
from tiny_transformers import BUILDERS, outputs
from torch import nn

from lightprune.structure import collect_moments, find_units, prune_units, refit_consumers

pytestmark = pytest.mark.usefixtures("one_thread_for_module")


@pytest.mark.parametrize("bias", [True, False])
def test_refit_is_the_least_squares_fit_of_the_dense_output(bias: bool) -> None:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(5, 9), nn.GELU(), nn.Linear(9, 3, bias=bias)).double()
    data = [torch.randn(64, 5, dtype=torch.float64) for _ in range(3)]
    groups = find_units(mlp, (data[0],))
    stats = collect_moments(mlp, groups, data, outer=True)
    with torch.no_grad():
        hidden = torch.cat([mlp[1](mlp[0](x)) for x in data])
        dense = mlp[2](hidden)
    keeps = prune_units(mlp, groups, 4, importance="activation", moments=stats)
    refit_consumers(mlp, groups, keeps, stats, damp=0.0)
    kept = keeps[0]
    design = (
        torch.cat([hidden[:, kept], torch.ones(len(hidden), 1, dtype=torch.float64)], 1) if bias else hidden[:, kept]
    )
    solution = torch.linalg.lstsq(design, dense).solution  # (kept [+1], out)
    weight = mlp[2].weight.detach()
    torch.testing.assert_close(weight[:, kept], solution[: int(kept.sum())].T, rtol=1e-8, atol=1e-8)
    assert bool((weight[:, ~kept] == 0).all())
    if bias:
        torch.testing.assert_close(mlp[2].bias.detach(), solution[-1], rtol=1e-8, atol=1e-8)


def test_refit_brings_a_pruned_bert_closer_to_the_dense_one() -> None:
    model, example, other = BUILDERS["bert"]()
    calibration = [
        {"input_ids": torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(s))} for s in range(4)
    ]
    dense = outputs(model, other)[0]
    groups = find_units(model, (), example, kinds=["neurons"])
    stats = collect_moments(model, groups, calibration, outer=True)
    keeps = prune_units(model, groups, 0.5, importance="activation", moments=stats)
    before = float((outputs(model, other)[0] - dense).square().mean())
    refit_consumers(model, groups, keeps, stats)
    after = float((outputs(model, other)[0] - dense).square().mean())
    assert after < 0.7 * before


def test_refit_needs_second_moments() -> None:
    mlp = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    groups = find_units(mlp, (torch.randn(2, 3),))
    stats = collect_moments(mlp, groups, [torch.randn(5, 3)])
    keeps = prune_units(mlp, groups, 1)
    with pytest.raises(ValueError, match=r"refit needs the second moments of '2'"):
        refit_consumers(mlp, groups, keeps, stats)


def test_moments_of_no_input_are_refused_by_the_refit_and_the_activation_ranking() -> None:
    """Empty moments (a projection whose forward never ran) used to solve to a zero weight, and to score every unit
    0, so the units went by index."""
    from lightprune.structure.statistics import Moments

    mlp = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    groups = find_units(mlp, (torch.randn(2, 3),))
    empty = {"2": Moments.empty(4, outer=True)}
    with pytest.raises(ValueError, match=r"no input of '2' was recorded: its forward never ran"):
        prune_units(mlp, groups, 1, importance="activation", moments=empty)
    keeps = prune_units(mlp, groups, 1)
    weight = mlp[2].weight.detach().clone()
    with pytest.raises(ValueError, match=r"refit: no input of '2' was recorded"):
        refit_consumers(mlp, groups, keeps, empty)
    assert torch.equal(mlp[2].weight, weight)
