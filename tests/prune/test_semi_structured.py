"""``SemiStructured`` / ``semi_structured`` (N:M) against a reference written here: reshape into groups, ``topk``.

The reference moves the input dim last, reshapes into groups of ``m``, sets the scores of pruned entries to
``-inf`` and keeps each group's ``topk(n)`` among the entries still unpruned. ``topk`` breaks ties arbitrarily, so
the differential test draws distinct scores; the tie rule has its own tests.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from lightprune import prune
from lightprune.prune.signed import SignedSemiStructured

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def reference(scores: Tensor, n: int, m: int, mask: Tensor | None = None, dim: int = 1, signed: bool = False) -> Tensor:
    ranked = (scores if signed else scores.abs()).double()
    alive = torch.ones_like(scores, dtype=torch.bool) if mask is None else mask.bool()
    ranked = ranked.masked_fill(~alive, float("-inf")).movedim(dim, -1)
    grouped = ranked.reshape(*ranked.shape[:-1], -1, m)
    keep = torch.zeros_like(grouped, dtype=torch.bool)
    keep.scatter_(-1, grouped.topk(n, dim=-1).indices, True)
    keep = keep.reshape(ranked.shape).movedim(-1, dim)
    return (keep & alive).float()


@st.composite
def cases(draw: st.DrawFn) -> tuple[Tensor, int, int, Tensor | None, int]:
    m = draw(st.integers(2, 6))
    n = draw(st.integers(1, m - 1))
    ndim = draw(st.integers(2, 4))
    shape = [draw(st.integers(1, 3)) for _ in range(ndim)]
    dim = draw(st.sampled_from([0, 1]))
    shape[dim] = m * draw(st.integers(1, 3))
    numel = 1
    for size in shape:
        numel *= size
    scores = torch.randperm(numel, generator=torch.Generator().manual_seed(draw(st.integers(0, 999)))) - numel // 2
    scores = scores.float().reshape(shape)  # distinct values of both signs
    scores = scores + 0.25  # no +x / -x pair has equal magnitude
    mask = None
    if draw(st.booleans()):
        bits = draw(st.lists(st.booleans(), min_size=numel, max_size=numel))
        mask = torch.tensor(bits, dtype=torch.float32).reshape(shape)
    return scores, n, m, mask, dim


@SETTINGS
@given(cases())
def test_matches_reshape_and_topk(case: tuple[Tensor, int, int, Tensor | None, int]) -> None:
    scores, n, m, mask, dim = case
    default = torch.ones_like(scores) if mask is None else mask
    got = prune.SemiStructured(n, m, dim=dim).compute_mask(scores, default)
    assert torch.equal(got, reference(scores, n, m, mask, dim))
    signed = SignedSemiStructured(n, m, dim=dim).compute_mask(scores, default)
    assert torch.equal(signed, reference(scores, n, m, mask, dim, signed=True))
    grouped = got.movedim(dim, -1).reshape(-1, m)
    assert bool((grouped.sum(dim=-1) <= n).all())


@SETTINGS
@given(cases(), st.sampled_from([None, torch.bool]))
def test_composes_after_other_pruning_and_is_idempotent(
    case: tuple[Tensor, int, int, Tensor | None, int], dtype: torch.dtype | None
) -> None:
    scores, n, m, _, dim = case
    layer = nn.Linear(1, 1, bias=False)
    layer.weight = nn.Parameter(scores.clone())
    with prune.mask_dtype(dtype):
        prune.l1_unstructured(layer, "weight", amount=0.3)
        first = layer.weight_mask.float().clone()
        prune.semi_structured(layer, "weight", n=n, m=m, dim=dim)
        second = layer.weight_mask.float().clone()
        prune.semi_structured(layer, "weight", n=n, m=m, dim=dim)
    assert torch.equal(second, reference(scores, n, m, first, dim))
    assert torch.equal(layer.weight_mask.float(), second)
    assert len(next(iter(layer._forward_pre_hooks.values()))) == 3


def test_two_four_on_a_linear_keeps_two_of_every_four_columns() -> None:
    torch.manual_seed(0)
    layer = prune.semi_structured(nn.Linear(16, 8), "weight")
    assert layer.weight_mask.view(8, 4, 4).sum(dim=-1).eq(2).all()


def test_conv_groups_are_input_channels_at_each_position() -> None:
    torch.manual_seed(0)
    conv = prune.semi_structured(nn.Conv2d(8, 3, 3), "weight", n=2, m=4)
    per_group = conv.weight_mask.permute(0, 2, 3, 1).reshape(3, 3, 3, 2, 4).sum(dim=-1)
    assert per_group.eq(2).all()
    scores = torch.randn(3, 8, 3, 3)
    assert torch.equal(prune.SemiStructured().compute_mask(scores, torch.ones_like(scores)), reference(scores, 2, 4))


def test_ties_prune_the_lower_index_of_the_group_first() -> None:
    scores = torch.tensor([[1.0, -1.0, 1.0, 1.0, 0.0, -0.0, 0.0, 0.0]])
    assert prune.SemiStructured(2, 4).compute_mask(scores, torch.ones(1, 8)).tolist() == [[0, 0, 1, 1, 0, 0, 1, 1]]


def test_pruned_entries_count_as_the_lowest_and_stay_pruned() -> None:
    scores = torch.tensor([[9.0, 8.0, 1.0, 2.0, 9.0, 8.0, 7.0, 6.0]])
    default = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0]])
    assert prune.SemiStructured(2, 4).compute_mask(scores, default).tolist() == [[0, 1, 0, 1, 0, 0, 0, 1]]


def test_importance_scores_are_ranked_exactly() -> None:
    layer = nn.Linear(4, 1, bias=False)
    prune.semi_structured(layer, "weight", importance_scores=torch.tensor([[1e-8, 3e-8, 2e-8, 1.5e-8]]))
    assert layer.weight_mask.tolist() == [[0, 1, 1, 0]]


def test_state_dict_keys_and_remove_like_torchs_methods() -> None:
    layer = prune.semi_structured(nn.Linear(8, 2), "weight")
    assert sorted(layer.state_dict()) == ["bias", "weight_mask", "weight_orig"]
    masked = layer.weight.detach().clone()
    prune.remove(layer, "weight")
    assert sorted(layer.state_dict()) == ["bias", "weight"] and torch.equal(layer.weight.detach(), masked)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0, "m": 4}, r"n=0 must be an int >= 1"),
        ({"n": 2.0, "m": 4}, r"n=2\.0 must be an int >= 1"),
        ({"n": 2, "m": True}, r"m=True must be an int >= 1"),
        ({"n": 4, "m": 4}, r"n=4 must be smaller than m=4"),
        ({"n": 2, "m": 4, "dim": "1"}, r"dim must be an int, got '1'"),
    ],
)
def test_bad_n_m_are_refused_naming_the_value(kwargs: dict, message: str) -> None:
    wrong_type = any(not isinstance(value, int) or isinstance(value, bool) for value in kwargs.values())
    with pytest.raises(TypeError if wrong_type else ValueError, match=message):
        prune.SemiStructured(**kwargs)


def test_input_dim_not_a_multiple_of_m_is_refused_and_the_module_left_alone() -> None:
    layer = nn.Linear(6, 2)
    with pytest.raises(ValueError, match=r"m=4 .* shape \(2, 6\) has 6"):
        prune.semi_structured(layer, "weight", n=2, m=4)
    assert not prune.is_pruned(layer)
    with pytest.raises(ValueError, match=r"at least 2 dims .* shape \(2,\)"):
        prune.semi_structured(layer, "bias", n=1, m=2)
