"""collect_moments: additive moments (what an all-reduce across ranks needs) and the consumers it cannot see."""

from __future__ import annotations

import pytest
import torch
from tiny_transformers import BUILDERS
from torch import nn

from lightprune.structure import UnitError, collect_moments, find_units


def test_moments_of_two_halves_add_up_to_the_moments_of_the_whole() -> None:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(4, 6), nn.SiLU(), nn.Linear(6, 2))
    groups = find_units(mlp, (torch.randn(1, 4),))
    data = [torch.randn(5, 4) for _ in range(4)]
    whole = collect_moments(mlp, groups, data, outer=True)["2"]
    first, second = (collect_moments(mlp, groups, part, outer=True)["2"] for part in (data[:2], data[2:]))
    assert whole.count == first.count + second.count == 20
    for name in ("total", "squares", "outer"):
        torch.testing.assert_close(getattr(whole, name), getattr(first, name) + getattr(second, name))
    hidden = torch.cat([mlp[1](mlp[0](x)) for x in data]).detach().double()
    torch.testing.assert_close(whole.outer, hidden.T @ hidden)
    torch.testing.assert_close(whole.mean, hidden.mean(0))


def test_a_consumer_called_without_its_forward_is_refused_by_name() -> None:
    """MultiheadAttention reads out_proj.weight directly: its inputs cannot be recorded."""
    layer, example, _ = BUILDERS["encoder_layer"]()
    heads = find_units(layer, (), example, kinds=["heads"])
    with pytest.raises(UnitError, match=r"no inputs reached \['self_attn.out_proj'\]"):
        collect_moments(layer, heads, [example])
