"""``RowwiseL1Unstructured`` / ``rowwise_l1_unstructured`` against a plain per-row sort written here.

The reference ranks each row's unpruned entries by ``(|score|, flat index)`` with Python's ``sorted`` and prunes the
first ``round(amount * remaining)`` (or ``amount``) of them.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.nn.utils import prune as torch_prune

from lightprune import prune
from lightprune.prune.rowwise import RowwiseToSparsity
from lightprune.prune.signed import SignedRowwise

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def reference(scores: Tensor, amount: int | float, mask: Tensor | None = None, signed: bool = False) -> Tensor:
    """The per-row mask by sorting each row's unpruned entries in Python."""
    rows = scores.shape[0]
    flat = scores.reshape(rows, -1).tolist()
    base = torch.ones(scores.shape) if mask is None else mask.float()
    out = base.reshape(rows, -1).clone()
    for i, row in enumerate(flat):
        alive = [j for j in range(len(row)) if out[i, j] == 1]
        count = amount if isinstance(amount, int) else round(amount * len(alive))
        ranked = sorted(alive, key=lambda j: (row[j] if signed else abs(row[j]), j))
        for j in ranked[:count]:
            out[i, j] = 0
    return out.reshape(scores.shape)


@st.composite
def cases(draw: st.DrawFn) -> tuple[Tensor, int | float, Tensor | None]:
    shape = draw(st.lists(st.integers(1, 5), min_size=2, max_size=4))
    numel = 1
    for size in shape:
        numel *= size
    values = draw(st.lists(st.integers(-4, 4), min_size=numel, max_size=numel))  # small ints: many ties
    scores = torch.tensor(values, dtype=torch.float32).reshape(shape)
    mask = None
    if draw(st.booleans()):
        bits = draw(st.lists(st.booleans(), min_size=numel, max_size=numel))
        mask = torch.tensor(bits, dtype=torch.float32).reshape(shape)
    row = numel // shape[0]
    fewest = row if mask is None else int(mask.reshape(shape[0], -1).sum(dim=1).min())
    amount = draw(st.one_of(st.floats(0, 1), st.integers(0, fewest)))
    return scores, amount, mask


@SETTINGS
@given(cases())
def test_matches_the_per_row_sort(case: tuple[Tensor, int | float, Tensor | None]) -> None:
    scores, amount, mask = case
    default = torch.ones_like(scores) if mask is None else mask
    got = prune.RowwiseL1Unstructured(amount).compute_mask(scores, default)
    assert torch.equal(got, reference(scores, amount, mask))
    signed = SignedRowwise(amount).compute_mask(scores, default)
    assert torch.equal(signed, reference(scores, amount, mask, signed=True))


@SETTINGS
@given(cases(), st.sampled_from([None, torch.bool]))
def test_iterative_composition_keeps_rows_and_earlier_pruning(
    case: tuple[Tensor, int | float, Tensor | None], dtype: torch.dtype | None
) -> None:
    scores, amount, _ = case
    layer = nn.Linear(1, 1, bias=False)
    layer.weight = nn.Parameter(scores.clone())
    with prune.mask_dtype(dtype):
        prune.rowwise_l1_unstructured(layer, "weight", amount=0.25)
        first = layer.weight_mask.float().clone()
        fewest = int(first.reshape(first.shape[0], -1).sum(dim=1).min())
        second = amount if not isinstance(amount, int) else min(amount, fewest)
        prune.rowwise_l1_unstructured(layer, "weight", amount=second)
    assert torch.equal(layer.weight_mask.float(), reference(scores, second, first))
    assert bool((layer.weight_mask.float() <= first).all())  # pruned entries stay pruned
    hook = next(iter(layer._forward_pre_hooks.values()))
    assert isinstance(hook, prune.PruningContainer) and len(hook) == 2


def test_every_row_keeps_the_same_count() -> None:
    torch.manual_seed(0)
    layer = prune.rowwise_l1_unstructured(nn.Linear(10, 6), "weight", amount=0.3)
    assert layer.weight_mask.sum(dim=1).tolist() == [7.0] * 6


def test_ties_prune_the_lower_flat_index_first_as_l1_does() -> None:
    scores = torch.tensor([[1.0, -1.0, 1.0, 2.0], [0.0, -0.0, 0.0, 0.0]])
    mask = prune.RowwiseL1Unstructured(2).compute_mask(scores, torch.ones(2, 4))
    assert mask.tolist() == [[0, 0, 1, 1], [0, 0, 1, 1]]
    flat = prune.L1Unstructured(2).compute_mask(scores[0], torch.ones(4))
    assert torch.equal(flat, mask[0])


@SETTINGS
@given(cases(), st.integers(1, 3))
def test_rows_along_another_dim_are_the_moved_tensors_rows(
    case: tuple[Tensor, int | float, Tensor | None], dim: int
) -> None:
    """``dim=d``: the mask of the tensor with ``d`` moved first, moved back (ties by the original flat index)."""
    scores, amount, mask = case
    dim = dim % scores.dim()
    moved_scores = scores.movedim(0, dim).contiguous()  # rows of ``scores`` now run along ``dim``
    moved_mask = None if mask is None else mask.movedim(0, dim).contiguous()
    default = torch.ones_like(moved_scores) if moved_mask is None else moved_mask
    got = prune.RowwiseL1Unstructured(amount, dim=dim).compute_mask(moved_scores, default)
    assert got.is_contiguous()
    assert torch.equal(got, reference(scores, amount, mask).movedim(0, dim))
    target = RowwiseToSparsity(0.5, dim=dim).compute_mask(moved_scores, default)
    assert torch.equal(target.movedim(dim, 0), RowwiseToSparsity(0.5).compute_mask(scores, default.movedim(dim, 0)))


def test_rows_of_an_in_out_weight_are_its_columns() -> None:
    transformers = pytest.importorskip("transformers")
    layer = transformers.pytorch_utils.Conv1D(4, 6)  # weight (in=6, out=4): an output unit is a column
    prune.rowwise_l1_unstructured(layer, "weight", amount=0.5, dim=1)
    assert layer.weight_mask.sum(dim=0).tolist() == [3.0] * 4
    assert repr(prune.RowwiseL1Unstructured(0.5, dim=1)) == "RowwiseL1Unstructured(amount=0.5, dim=1)"
    with pytest.raises(ValueError, match=r"dim=2 is out of range for a tensor of shape \(6, 4\)"):
        prune.RowwiseL1Unstructured(0.5, dim=2).compute_mask(torch.ones(6, 4), torch.ones(6, 4))


def test_nan_ranks_above_inf() -> None:
    scores = torch.tensor([[float("nan"), float("inf"), 1.0]])
    assert prune.RowwiseL1Unstructured(2).compute_mask(scores, torch.ones(1, 3)).tolist() == [[1, 0, 0]]


def test_conv_rows_are_filters() -> None:
    conv = nn.Conv2d(3, 4, 3)
    prune.rowwise_l1_unstructured(conv, "weight", amount=0.5)
    assert conv.weight_mask.sum(dim=(1, 2, 3)).tolist() == [13.0] * 4  # round(13.5) = 14 pruned, 13 kept


def test_importance_scores_rank_instead_of_the_weights() -> None:
    layer = nn.Linear(4, 2, bias=False)
    scores = torch.tensor([[4.0, 3.0, 2.0, 1.0], [1.0, 2.0, 3.0, 4.0]])
    prune.rowwise_l1_unstructured(layer, "weight", amount=2, importance_scores=scores)
    assert layer.weight_mask.tolist() == [[1, 1, 0, 0], [0, 0, 1, 1]]


def test_a_container_hands_it_the_whole_tensor_and_mask() -> None:
    scores = torch.tensor([[1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0]])
    method = prune.RowwiseL1Unstructured(1)
    method._tensor_name = "weight"
    container = prune.PruningContainer(method)
    default = torch.tensor([[1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    assert container.compute_mask(scores, default).tolist() == [[0, 0, 1, 1], [1, 1, 1, 0]]


def test_state_dict_keys_and_remove_like_torchs_methods() -> None:
    layer = prune.rowwise_l1_unstructured(nn.Linear(4, 3), "weight", amount=0.5)
    assert sorted(layer.state_dict()) == ["bias", "weight_mask", "weight_orig"]
    masked = layer.weight.detach().clone()
    prune.remove(layer, "weight")
    assert sorted(layer.state_dict()) == ["bias", "weight"]
    assert torch.equal(layer.weight.detach(), masked)
    assert not prune.is_pruned(layer)


def test_refusals_name_the_bad_value() -> None:
    with pytest.raises(ValueError, match=r"amount=1\.5"):
        prune.RowwiseL1Unstructured(1.5)
    with pytest.raises(ValueError, match=r"at least 2 dims .* shape \(4,\)"):
        prune.RowwiseL1Unstructured(1).compute_mask(torch.ones(4), torch.ones(4))
    layer = nn.Linear(3, 2)
    with pytest.raises(ValueError, match=r"amount=4 is larger than .* row 0 \(3\)"):
        prune.rowwise_l1_unstructured(layer, "weight", amount=4)
    assert not prune.is_pruned(layer)  # left as it was
    with pytest.raises(ValueError, match="importance_scores must have the shape"):
        prune.rowwise_l1_unstructured(layer, "weight", amount=1, importance_scores=torch.ones(3, 2))


def torch_count(amount: float, length: int) -> int:
    """How many of ``length`` entries torch.nn.utils.prune's L1Unstructured prunes for a float ``amount``."""
    return int(
        (torch_prune.L1Unstructured(amount).compute_mask(torch.arange(1.0, length + 1), torch.ones(length)) == 0).sum()
    )


HALVES = [(amount, length) for amount in (0.5, 0.25, 0.125, 0.375) for length in range(1, 17)]
"""Row lengths where ``amount * length`` is often exactly ``k + 0.5``: round half to even and half up disagree."""


@pytest.mark.parametrize("amount", sorted({amount for amount, _ in HALVES}))
def test_a_row_count_at_a_half_rounds_to_even_as_torch_does(amount: float) -> None:
    lengths = [length for a, length in HALVES if a == amount]
    mask = torch.zeros(len(lengths), max(lengths))
    for row, length in enumerate(lengths):
        mask[row, :length] = 1  # row i has `length` unpruned entries
    scores = torch.arange(1.0, mask.numel() + 1).reshape(mask.shape)
    got = prune.RowwiseL1Unstructured(amount).compute_mask(scores, mask)
    pruned = (mask - got).sum(dim=1).to(torch.int64).tolist()
    assert pruned == [torch_count(amount, length) for length in lengths]
    halves = [length for length in lengths if amount * length % 1 == 0.5]
    assert any(torch_count(amount, n) != math.floor(amount * n + 0.5) for n in halves)  # the case pins the rule


@pytest.mark.parametrize("length", [2, 6, 10, 14, 3, 5, 7])
def test_a_row_sparsity_target_at_a_half_rounds_to_even_as_torch_does(length: int) -> None:
    for sparsity in (0.5, 0.25):
        scores = torch.arange(1.0, 2 * length + 1).reshape(2, length)
        got = RowwiseToSparsity(sparsity).compute_mask(scores, torch.ones(2, length))
        assert (got == 0).sum(dim=1).tolist() == [torch_count(sparsity, length)] * 2, sparsity
