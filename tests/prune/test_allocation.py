"""Per-layer allocation (ERK, OWL): hand-computed examples, exact totals, bounds, and OWL's own formula."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightprune.prune.allocation import (
    apportion,
    block_outlier_ratios,
    erk_weights,
    layer_counts,
    outlier_ratio,
    owl_blocks,
    owl_offsets,
)

SHAPES = [(2, 2), (20, 20), (20, 10)]  # 4 + 400 + 200 = 604 weights


def test_erk_hand_computed_with_a_layer_kept_dense() -> None:
    # raw densities (sum / prod): 4/4 = 1, 40/400 = 0.1, 30/200 = 0.15. Target 0.5 keeps 302 of 604.
    # First scale: 302 / (4*1 + 400*0.1 + 200*0.15) = 302 / 74 = 4.08 -> the 2x2 layer would keep 408%: dense (4 kept).
    # Again for the rest: 298 / (40 + 30) = 149/35 -> 20x20 keeps 400 * 0.1 * 149/35 = 170.29 (prunes 229.71),
    # 20x10 keeps 200 * 0.15 * 149/35 = 127.71 (prunes 72.29). 229 + 72 = 301 of 302: the larger remainder (.71) wins.
    assert erk_weights(SHAPES) == [1.0, 0.1, 0.15]
    assert layer_counts(SHAPES, 0.5, erk_weights(SHAPES)) == [0, 230, 72]


def test_erk_under_a_cap_gives_the_capped_layers_share_to_the_others() -> None:
    # max_layer_sparsity 0.55: the 20x20 layer may give 220 (ERK wanted 229.71), the 20x10 one 110, the 2x2 one 2.
    # 302 - 220 = 82 left for the 2x2 and 20x10 layers: they keep 4 + 200 - 82 = 122; scale 122 / (4*1 + 200*0.15)
    # = 3.59 makes the 2x2 layer dense, so the 20x10 layer prunes all 82 (under its 110).
    caps = [math.floor(0.55 * n) for n in (4, 400, 200)]
    assert caps == [2, 220, 110]
    assert layer_counts(SHAPES, 0.5, erk_weights(SHAPES), caps=caps) == [0, 220, 82]
    # caps that hold exactly the target's count: every layer at its cap
    assert layer_counts(SHAPES, 0.5, erk_weights(SHAPES), caps=[2, 200, 100]) == [2, 200, 100]
    with pytest.raises(ValueError, match="at most 301 of 604 entries"):
        layer_counts(SHAPES, 0.5, erk_weights(SHAPES), caps=[2, 200, 99])


def test_erk_of_a_convolution_counts_its_kernel() -> None:
    # (out, in, kh, kw) = (4, 2, 3, 3): (4 + 2 + 3 + 3) / 72
    assert erk_weights([(4, 2, 3, 3)]) == [12 / 72]


def test_owl_hand_computed() -> None:
    # outlier ratios at M = 5: [1]*9 + [100]: mean 10.9, one score above 54.5 -> 0.1;
    # [1]*10: none -> 0.0; [1]*19 + [100]: mean 5.95, one above 29.75 -> 0.05.
    scores = [torch.tensor([1.0] * 9 + [100.0]), torch.ones(10), torch.tensor([1.0] * 19 + [100.0])]
    ratios = [outlier_ratio(s) for s in scores]
    assert ratios == [pytest.approx(0.1), 0.0, pytest.approx(0.05)]
    # lambda 0.1: offsets onto [0, 0.2]: [0.2, 0, 0.1]. Sizes 10, 10, 20, target 0.5 keeps 20:
    # 10 (c + 0.2) + 10 c + 20 (c + 0.1) = 20 -> c = 0.4: densities 0.6, 0.4, 0.5 -> pruned 4, 6, 10.
    offsets = owl_offsets(ratios, lam=0.1)
    assert offsets == pytest.approx([0.2, 0.0, 0.1])
    assert layer_counts([(10,), (10,), (20,)], 0.5, offsets, rule="owl") == [4, 6, 10]


def test_owl_blocks_pool_their_tensors_scores_hand_computed() -> None:
    names = ["h.0.attn.weight", "h.0.mlp.weight", "h.1.attn.weight", "h.1.mlp.weight", "head.weight"]
    blocks = owl_blocks(names)
    assert blocks == ["h.0", "h.0", "h.1", "h.1", "head.weight"]
    # h.0 pools [1]*9 + [100] and [1]*10: mean 119 / 20 = 5.95, M = 5: one of 20 above 29.75 -> 0.05 (each tensor
    # alone: 0.1 and 0.0). h.1: [1]*4 + [100] and [1]*5, of which the 100 and two 1s already pruned (keep False):
    # 7 unpruned ones, mean 1, none above 5 -> 0.0. head: [1, 1, 1, 20]: mean 5.75, none above 28.75 -> 0.0.
    scores = [
        torch.tensor([1.0] * 9 + [100.0]),
        torch.ones(10),
        torch.tensor([1.0] * 4 + [100.0]),
        torch.ones(5),
        torch.tensor([1.0, 1.0, 1.0, 20.0]),
    ]
    keeps = [
        None,
        None,
        torch.tensor([True, True, True, True, False]),
        torch.tensor([True, True, True, False, False]),
        None,
    ]
    assert block_outlier_ratios(scores, keeps, blocks) == [pytest.approx(0.05)] * 2 + [0.0, 0.0, 0.0]
    # the same scores with every tensor its own block are the per-tensor ratios
    assert block_outlier_ratios(scores, [None] * 5, names) == [outlier_ratio(s) for s in scores]


def test_owl_equals_its_published_formula_on_layers_of_one_size() -> None:
    """OWL's code: ratio' = (r - min) / (max - min) * 2 lambda; density = ratio' - mean(ratio') + (1 - s)."""
    generator = torch.Generator().manual_seed(0)
    ratios = torch.rand(6, generator=generator).tolist()
    lam, target, size = 0.08, 0.7, 1000
    normalised = [(r - min(ratios)) / (max(ratios) - min(ratios)) * 2 * lam for r in ratios]
    densities = [x - sum(normalised) / len(normalised) + (1 - target) for x in normalised]
    counts = layer_counts([(size,)] * 6, target, owl_offsets(ratios, lam), rule="owl")
    assert sum(counts) == round(target * size * 6)
    for count, density in zip(counts, densities, strict=True):
        assert abs(count - size * (1 - density)) < 1  # rounded to whole weights, the total exact
    spread = (max(counts) - min(counts)) / size  # the sparsities span 2 lambda, their mean the target
    assert spread == pytest.approx(2 * lam, abs=2 / size)


def test_outlier_ratio_counts_the_kept_entries_only() -> None:
    scores = torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0, 20.0])
    keep = torch.tensor([False, False, True, True, True, True])
    assert outlier_ratio(scores, keep, threshold=3.0) == pytest.approx(0.25)  # mean 5.75 -> 20 only, of 4
    assert outlier_ratio(scores, None, threshold=3.0) == pytest.approx(1 / 6)  # mean 3.83 -> 20 only, of 6


def test_apportion_ties_go_to_the_earlier_tensor_and_bounds_hold() -> None:
    assert apportion([0.5, 0.5], 1, [0, 0], [1, 1]) == [1, 0]
    assert apportion([0.5, 0.5], 1, [0, 0], [0, 1]) == [0, 1]
    assert apportion([3.0, 3.0], 4, [3, 0], [5, 5]) == [3, 1]  # the first holds 3 already: the second gives


@settings(max_examples=80, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(1, 12), min_size=1, max_size=3), min_size=1, max_size=5),
    targets=st.lists(st.floats(0, 1), min_size=1, max_size=4),
    cap=st.floats(0.3, 1.0),
    rule=st.sampled_from(["erk", "owl"]),
    ratios=st.lists(st.floats(0, 1), min_size=5, max_size=5),
)
def test_every_event_is_exact_within_bounds_and_monotone(
    shapes: list[list[int]], targets: list[float], cap: float, rule: str, ratios: list[float]
) -> None:
    units = [math.prod(shape) for shape in shapes]
    caps = [math.floor(cap * n) for n in units]
    weights = erk_weights(shapes) if rule == "erk" else owl_offsets(ratios[: len(shapes)], 0.08)
    pruned = [0] * len(units)
    for target in sorted(targets):
        if round(target * sum(units)) > sum(caps):
            with pytest.raises(ValueError, match="at most"):
                layer_counts(shapes, target, weights, rule=rule, pruned=pruned, caps=caps)
            return
        counts = layer_counts(shapes, target, weights, rule=rule, pruned=pruned, caps=caps)
        assert sum(counts) == max(round(target * sum(units)), sum(pruned))
        assert all(before <= now <= max(c, before) for before, now, c in zip(pruned, counts, caps, strict=True))
        pruned = counts
