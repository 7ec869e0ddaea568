"""Unit tests of ``lightprune.prune.methods``: the built-in pruning methods.

Masks are compared with torch's wherever the ranking has no ties (lightprune breaks ties by flat index, torch by
whatever ``topk`` does), and counts are checked exactly everywhere: a float amount prunes ``round(amount * n)`` of
the ``n`` units still unpruned, an int amount that many.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.nn.utils import prune as tp

from lightprune import prune as lp
from lightprune.prune.amount import norms_follow_linalg

FLOAT_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
NAN, INF = float("nan"), float("inf")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def distinct(shape: tuple[int, ...], seed: int = 0, dtype: torch.dtype = torch.float32) -> Tensor:
    """Values with pairwise distinct magnitudes, exact in every float dtype (integers up to 256, random signs)."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    assert n <= 256
    magnitudes = (torch.randperm(n, generator=g) + 1).to(torch.float64)
    signs = torch.randint(0, 2, (n,), generator=g) * 2 - 1
    return (magnitudes * signs).view(shape).to(dtype)


def layer_with(weight: Tensor) -> nn.Module:
    module = nn.Module()
    module.weight = nn.Parameter(weight.clone(), requires_grad=weight.is_floating_point())
    return module


def pair_with(weight: Tensor) -> tuple[nn.Module, nn.Module]:
    return layer_with(weight), layer_with(weight)


def zeros(mask: Tensor) -> int:
    return int((mask == 0).sum())


def zero_channels(mask: Tensor, dim: int) -> int:
    other = [d for d in range(mask.dim()) if d != dim % mask.dim()]
    return int((mask.to(torch.float64).abs().sum(dim=other) == 0).sum())


def expected_count(amount: int | float, available: int) -> int:
    return amount if isinstance(amount, int) else round(amount * available)


# --------------------------------------------------------------------------------------------------------------
# Identity
# --------------------------------------------------------------------------------------------------------------


def test_identity_prunes_nothing() -> None:
    t = torch.randn(3, 4)
    default = torch.ones(3, 4)
    default[0, 0] = 0
    assert lp.Identity().compute_mask(t, default) is default
    ours, theirs = pair_with(t)
    hook = lp.Identity.apply(ours, "weight")
    tp.Identity.apply(theirs, "weight")
    assert isinstance(hook, lp.Identity)
    assert torch.equal(ours.weight_mask, theirs.weight_mask) and bool(ours.weight_mask.eq(1).all())
    lp.l1_unstructured(ours, "weight", amount=3)
    lp.Identity.apply(ours, "weight")
    assert zeros(ours.weight_mask) == 3


# --------------------------------------------------------------------------------------------------------------
# L1Unstructured
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("amount", [0, 1, 7, 12, 0.0, 0.3, 0.5, 1.0])
def test_l1_unstructured_matches_torch(dtype: torch.dtype, amount: int | float) -> None:
    ours, theirs = pair_with(distinct((3, 4), seed=1, dtype=dtype))
    hook = lp.L1Unstructured.apply(ours, "weight", amount=amount)
    tp.L1Unstructured.apply(theirs, "weight", amount=amount)
    assert isinstance(hook, lp.L1Unstructured) and hook.amount == amount
    assert ours.weight_mask.dtype == dtype
    assert torch.equal(ours.weight_mask, theirs.weight_mask)
    assert torch.equal(ours.weight, theirs.weight)
    assert zeros(ours.weight_mask) == expected_count(amount, 12)


def test_l1_unstructured_compute_mask_selects_among_all_entries_like_torch() -> None:
    t = distinct((4, 5), seed=2)
    default = torch.ones(4, 5)
    default.view(-1)[t.abs().view(-1).argsort()[:3]] = 0  # the 3 smallest are already pruned
    for amount in (3, 5, 0.5):
        ours = lp.L1Unstructured(amount).compute_mask(t, default)
        theirs = tp.L1Unstructured(amount).compute_mask(t, default.clone())
        assert torch.equal(ours, theirs)
        assert ours.dtype == default.dtype
    assert zeros(lp.L1Unstructured(3).compute_mask(t, default)) == 3  # it picked the same, pruned ones


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_l1_unstructured_importance_scores(dtype: torch.dtype) -> None:
    weight = distinct((4, 6), seed=3, dtype=dtype)
    scores = distinct((4, 6), seed=4, dtype=torch.float32)
    ours, theirs = pair_with(weight)
    lp.l1_unstructured(ours, "weight", amount=10, importance_scores=scores)
    tp.l1_unstructured(theirs, "weight", amount=10, importance_scores=scores)
    assert torch.equal(ours.weight_mask, theirs.weight_mask)
    assert ours.weight_mask.dtype == dtype
    pruned = ours.weight_mask == 0
    assert scores.abs()[pruned].max() < scores.abs()[~pruned].min()


def test_l1_unstructured_breaks_ties_by_flat_index() -> None:
    layer = layer_with(torch.tensor([[1.0, -1.0, 1.0], [2.0, 1.0, -2.0]]))
    lp.l1_unstructured(layer, "weight", amount=3)
    assert layer.weight_mask.tolist() == [[0, 0, 0], [1, 1, 1]]
    layer = layer_with(torch.tensor([-0.0, 0.0, 0.0, -0.0]))
    lp.l1_unstructured(layer, "weight", amount=2)
    assert layer.weight_mask.tolist() == [0, 0, 1, 1]  # -0.0 ties with +0.0


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8])
def test_l1_unstructured_on_an_integer_parameter_like_torch(dtype: torch.dtype) -> None:
    weight = torch.tensor([[1, -5, 3], [2, 0, -7]] if dtype != torch.uint8 else [[1, 5, 3], [2, 0, 7]], dtype=dtype)
    ours, theirs = pair_with(weight)
    assert not ours.weight.requires_grad
    lp.l1_unstructured(ours, "weight", amount=2)
    tp.l1_unstructured(theirs, "weight", amount=2)
    assert ours.weight_mask.dtype == dtype
    assert torch.equal(ours.weight_mask, theirs.weight_mask)
    assert torch.equal(ours.weight, theirs.weight)
    lp.l1_unstructured(ours, "weight", amount=0.5)  # 2 of the 4 left
    assert zeros(ours.weight_mask) == 4
    assert ours.weight.dtype == dtype


def test_l1_unstructured_int_min_ranks_largest() -> None:
    weight = torch.tensor([torch.iinfo(torch.int64).min, 5, -3, torch.iinfo(torch.int64).max])
    layer = layer_with(weight)
    lp.l1_unstructured(layer, "weight", amount=3)
    assert layer.weight_mask.tolist() == [1, 0, 0, 0]  # |min| = max + 1 is the largest magnitude


# --------------------------------------------------------------------------------------------------------------
# NaN and inf
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_l1_nan_ranks_above_inf_and_float_mask_propagates(dtype: torch.dtype) -> None:
    weight = torch.tensor([[NAN, INF, 0.5], [-INF, -2.0, NAN], [1.0, 0.25, 3.0]], dtype=dtype)
    layer = layer_with(weight)
    lp.l1_unstructured(layer, "weight", amount=7)
    # every finite value and both infinities go before the two NaNs; the infinities tie, flat order decides
    assert layer.weight_mask.tolist() == [[1, 0, 0], [0, 0, 1], [0, 0, 0]]
    assert zeros(layer.weight_mask) == 7
    w = layer.weight
    assert w.dtype == dtype
    assert bool(w[0, 0].isnan()) and bool(w[1, 2].isnan())
    assert bool(w[0, 1].isnan()) and bool(w[1, 0].isnan())  # inf * 0, as torch
    assert bool((w[2] == 0).all()) and bool(w[0, 2] == 0) and bool(w[1, 1] == 0)
    # torch.topk agrees on the ranking: NaN is the largest
    theirs = layer_with(weight)
    tp.l1_unstructured(theirs, "weight", amount=7)
    assert torch.equal(theirs.weight_mask[:, [0, 2]], layer.weight_mask[:, [0, 2]])
    assert zeros(theirs.weight_mask) == 7


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_bool_mask_gives_exact_zeros_under_inf_and_nan(dtype: torch.dtype) -> None:
    weight = torch.tensor([[NAN, INF, 0.5], [-INF, -2.0, NAN]], dtype=dtype)
    with lp.mask_dtype(torch.bool):
        layer = layer_with(weight)
        lp.l1_unstructured(layer, "weight", amount=5)
    assert layer.weight_mask.dtype == torch.bool
    assert int((~layer.weight_mask).sum()) == 5
    kept = layer.weight_mask
    assert bool((layer.weight[~kept] == 0).all())  # exact zeros, not NaN
    assert int(layer.weight.isnan().sum()) == 1  # the one NaN kept stays NaN
    with torch.no_grad():
        layer.weight_orig.fill_(NAN)
    hook = next(iter(layer._forward_pre_hooks.values()))
    hook(layer, ())
    assert bool((layer.weight[~kept] == 0).all()) and bool(layer.weight[kept].isnan().all())


def test_nan_and_inf_in_importance_scores() -> None:
    scores = torch.tensor([NAN, -INF, 1.0, INF, -NAN, 0.0])
    layer = layer_with(torch.arange(6.0))
    lp.l1_unstructured(layer, "weight", amount=4, importance_scores=scores)
    assert layer.weight_mask.tolist() == [1, 0, 0, 0, 1, 0]
    for amount in range(7):
        layer = layer_with(torch.arange(6.0))
        lp.l1_unstructured(layer, "weight", amount=amount, importance_scores=scores)
        assert zeros(layer.weight_mask) == amount
    # LnStructured: a channel whose norm is NaN goes last, +inf just before it
    ln_scores = torch.tensor([[NAN, 1.0], [INF, 0.0], [5.0, 5.0], [0.1, 0.1]])
    for amount in range(5):
        layer = layer_with(torch.ones(4, 2))
        lp.ln_structured(layer, "weight", amount=amount, n=2, dim=0, importance_scores=ln_scores)
        assert zero_channels(layer.weight_mask, 0) == amount
        order = [3, 2, 1, 0][:amount]
        assert sorted(int(i) for i in (layer.weight_mask.sum(dim=1) == 0).nonzero().flatten()) == sorted(order)


def test_all_nan_weight_still_prunes_exact_counts() -> None:
    for amount in (0, 3, 0.5, 12):
        layer = layer_with(torch.full((3, 4), NAN))
        lp.l1_unstructured(layer, "weight", amount=amount)
        assert zeros(layer.weight_mask) == expected_count(amount, 12)


def test_l1_docstring_states_the_nan_rules() -> None:
    doc = lp.L1Unstructured.__doc__ or ""
    assert "NaN" in doc and "torch.where" in doc and "orig * 0" in doc


# --------------------------------------------------------------------------------------------------------------
# RandomUnstructured
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("amount", [0, 5, 0.25, 1.0])
def test_random_unstructured_same_seed_same_mask_as_torch(amount: int | float) -> None:
    ours, theirs = pair_with(torch.randn(5, 8))
    torch.manual_seed(11)
    hook = lp.RandomUnstructured.apply(ours, "weight", amount)
    torch.manual_seed(11)
    tp.RandomUnstructured.apply(theirs, "weight", amount)
    assert isinstance(hook, lp.RandomUnstructured)
    assert torch.equal(ours.weight_mask, theirs.weight_mask)
    assert zeros(ours.weight_mask) == expected_count(amount, 40)


def test_random_unstructured_compute_mask_matches_torch() -> None:
    t = torch.randn(6, 5)
    default = (torch.rand(6, 5) > 0.3).float()
    torch.manual_seed(5)
    ours = lp.RandomUnstructured(7).compute_mask(t, default)
    torch.manual_seed(5)
    theirs = tp.RandomUnstructured(7).compute_mask(t, default.clone())
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mask_dtype", [None, torch.bool])
def test_random_unstructured_repeated_matches_torch_with_the_same_seed(dtype, mask_dtype) -> None:
    """torch draws for the entries still unpruned: the same masks, and the generator left where torch leaves it."""
    ours, theirs = pair_with(torch.randn(6, 7, dtype=dtype))
    torch.manual_seed(3)
    with lp.mask_dtype(mask_dtype):
        for amount in (0.5, 4, 0.3):
            lp.random_unstructured(ours, "weight", amount=amount)
    after_ours = torch.rand(3)
    torch.manual_seed(3)
    for amount in (0.5, 4, 0.3):
        tp.random_unstructured(theirs, "weight", amount=amount)
    after_theirs = torch.rand(3)
    assert torch.equal(ours.weight_mask.to(theirs.weight_mask.dtype), theirs.weight_mask)
    assert torch.equal(after_ours, after_theirs)


@pytest.mark.parametrize("second", [torch.float32, torch.float64], ids=["float32", "float32 and float64"])
def test_global_random_repeated_matches_torch_with_the_same_seed(second: torch.dtype) -> None:
    """torch draws once, in the dtype cat promotes the tensors to: float64 as soon as one is float64."""
    models = [nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 4).to(second)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    draws_after = []
    for impl, model in zip((lp, tp), models, strict=True):
        torch.manual_seed(0)
        pairs = [(model[0], "weight"), (model[1], "weight")]
        impl.l1_unstructured(model[1], "weight", amount=5)  # one tensor pruned before the global calls
        impl.global_unstructured(pairs, impl.RandomUnstructured, amount=0.5)
        impl.global_unstructured(pairs, impl.RandomUnstructured, amount=9)
        draws_after.append(torch.rand(3))
    for ours, theirs in zip(models[0], models[1], strict=True):
        assert torch.equal(ours.weight_mask, theirs.weight_mask)
    assert torch.equal(*draws_after)


CALLS_THAT_DRAW_NOTHING: dict[str, Any] = {  # torch checks the count first and draws only to prune something
    "amount 0": lambda impl, m: impl.random_unstructured(m[0], "weight", amount=0),
    "amount rounding to 0": lambda impl, m: impl.random_unstructured(m[0], "weight", amount=0.01),
    "amount 0 on a pruned tensor": lambda impl, m: (
        impl.l1_unstructured(m[0], "weight", amount=0.5),
        impl.random_unstructured(m[0], "weight", amount=0.0),
    ),
    "global amount 0": lambda impl, m: impl.global_unstructured(
        [(m[0], "weight"), (m[1], "weight")], impl.RandomUnstructured, amount=0
    ),
    "compute_mask amount 0": lambda impl, m: impl.RandomUnstructured(0).compute_mask(torch.ones(3), torch.ones(3)),
    "refused: amount above the size": lambda impl, m: impl.random_unstructured(m[0], "weight", amount=1000),
    "refused: amount above what is left": lambda impl, m: (
        impl.l1_unstructured(m[0], "weight", amount=0.5),
        impl.random_unstructured(m[0], "weight", amount=10),
    ),
    "refused: global amount above the size": lambda impl, m: impl.global_unstructured(
        [(m[0], "weight"), (m[1], "weight")], impl.RandomUnstructured, amount=1000
    ),
}


@pytest.mark.parametrize("call", list(CALLS_THAT_DRAW_NOTHING))
def test_random_unstructured_leaves_the_generator_where_torch_leaves_it(call: str) -> None:
    """A count of 0, or one that is refused, draws no random number in torch: every later draw of the run
    (initialization, dropout, shuffling) stays the same as with torch."""
    after = []
    for impl in (lp, tp):
        model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
        torch.manual_seed(42)
        try:
            CALLS_THAT_DRAW_NOTHING[call](impl, model)
        except ValueError:
            assert call.startswith("refused")
        after.append(torch.get_rng_state())
    assert torch.equal(*after)


def test_random_unstructured_repeated_never_unprunes() -> None:
    layer = layer_with(torch.randn(10, 10))
    previous = torch.ones(10, 10)
    left = 100
    for amount in (0.5, 7, 0.2, 0.0, 1.0):
        lp.random_unstructured(layer, "weight", amount=amount)
        k = expected_count(amount, left)
        assert zeros(layer.weight_mask) == 100 - left + k
        assert bool((layer.weight_mask <= previous).all())
        previous, left = layer.weight_mask.clone(), left - k


# --------------------------------------------------------------------------------------------------------------
# Structured methods
# --------------------------------------------------------------------------------------------------------------

NORMS = [1, 2, 3.5, INF, -INF, "fro"]  # (n=0 counts nonzeros: every channel ties)


@pytest.mark.parametrize("n", NORMS, ids=repr)
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_ln_structured_matches_torch(n: Any, dim: int) -> None:
    weight = distinct((4, 5, 3), seed=9)
    ours, theirs = pair_with(weight)
    norms = lp._compute_norm(weight, n, dim)
    if len(set(norms.tolist())) < norms.numel():
        pytest.skip("tied norms")
    hook = lp.LnStructured.apply(ours, "weight", amount=0.5, n=n, dim=dim)
    tp.LnStructured.apply(theirs, "weight", amount=0.5, n=n, dim=dim)
    assert isinstance(hook, lp.LnStructured) and hook.n == n and hook.dim == dim
    assert torch.equal(ours.weight_mask, theirs.weight_mask)
    assert zero_channels(ours.weight_mask, dim) == round(0.5 * weight.shape[dim])


def test_ln_structured_nuclear_norm_where_torch_accepts_it() -> None:
    weight = distinct((5, 4, 3), seed=1)  # two dims besides dim 0
    ours, theirs = pair_with(weight)
    lp.ln_structured(ours, "weight", amount=2, n="nuc", dim=0)
    tp.ln_structured(theirs, "weight", amount=2, n="nuc", dim=0)
    assert torch.equal(ours.weight_mask, theirs.weight_mask)
    assert zero_channels(ours.weight_mask, 0) == 2
    four_d = layer_with(torch.randn(3, 2, 2, 2))
    with pytest.raises(RuntimeError, match=r"norm"):  # see the next test
        lp.ln_structured(four_d, "weight", amount=1, n="nuc", dim=0)
    assert not lp.is_pruned(four_d)


@pytest.mark.parametrize(("shape", "dim"), [((4, 3, 2, 2), 0), ((4, 3, 2, 2), 1), ((4, 3), 0), ((5, 3, 2, 2, 2), 0)])
def test_ln_structured_nuclear_norm_without_a_matrix_per_channel_is_refused_in_every_torch(
    shape: tuple[int, ...], dim: int
) -> None:
    # A deliberate difference from torch >= 2.14. A nuclear norm needs a matrix per channel: exactly two dims
    # besides dim. torch <= 2.13 raises otherwise (torch.norm); torch 2.14+ takes it over the last two dims, which
    # for a conv weight gives one value per (output, input) channel pair, and ranks channels by that: for a
    # (4, 3, 2, 2) weight and amount=0.5 it prunes one output channel with dim=0 and none at all with dim=1.
    weight = distinct(shape, seed=4)
    ours, theirs = pair_with(weight)
    with pytest.raises(RuntimeError, match=r"norm"):
        lp.ln_structured(ours, "weight", amount=0.5, n="nuc", dim=dim)
    assert not lp.is_pruned(ours)
    with pytest.raises(RuntimeError, match=r"norm"):
        lp.LnStructured(0.5, n="nuc", dim=dim).compute_mask(weight, torch.ones(shape))
    try:
        tp.ln_structured(theirs, "weight", amount=0.5, n="nuc", dim=dim)
    except RuntimeError:
        return  # torch refuses too: torch <= 2.13, or a shape where torch 2.14+ fails further on
    assert norms_follow_linalg()  # only torch.linalg's nuclear norm lets such a call through
    pruned = (theirs.weight_mask == 0).movedim(dim, 0).reshape(shape[dim], -1).all(dim=1)
    assert int(pruned.sum()) != round(0.5 * shape[dim])  # not the channels asked for: the ranking is meaningless


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_ln_structured_fro_over_three_dims_follows_the_installed_torch(dim: int) -> None:
    # torch <= 2.13 refuses 'fro' over more than two dims (torch.norm); torch 2.14+ ranks by the 2-norm
    weight = distinct((4, 3, 2, 2), seed=5)
    ours, theirs = pair_with(weight)
    try:
        tp.ln_structured(theirs, "weight", amount=0.5, n="fro", dim=dim)
    except RuntimeError:
        assert not norms_follow_linalg()
        with pytest.raises(RuntimeError, match=r"norm"):
            lp.ln_structured(ours, "weight", amount=0.5, n="fro", dim=dim)
        assert not lp.is_pruned(ours)
        return
    lp.ln_structured(ours, "weight", amount=0.5, n="fro", dim=dim)
    assert torch.equal(ours.weight_mask, theirs.weight_mask)
    by_two_norm = lp.ln_structured(layer_with(weight.clone()), "weight", amount=0.5, n=2, dim=dim)
    assert torch.equal(by_two_norm.weight_mask, ours.weight_mask)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_ln_structured_dtypes_and_importance_scores(dtype: torch.dtype) -> None:
    weight = distinct((6, 4), seed=2, dtype=dtype)
    rows = torch.randperm(6, generator=torch.Generator().manual_seed(3))
    scores = -(torch.arange(24.0, dtype=torch.float64) + 1).view(6, 4)[rows]  # distinct L1 norms
    ours, theirs = pair_with(weight)
    lp.ln_structured(ours, "weight", amount=3, n=1, dim=0, importance_scores=scores)
    tp.ln_structured(theirs, "weight", amount=3, n=1, dim=0, importance_scores=scores)
    assert ours.weight_mask.dtype == dtype
    assert torch.equal(ours.weight_mask, theirs.weight_mask.to(dtype))


def test_structured_compute_mask_matches_torch_and_keeps_default_dtype() -> None:
    t = torch.randn(4, 3, dtype=torch.float64)
    default = torch.ones(4, 3)
    default[0, 0] = 0
    default[2] = 0
    for n in (1, 2):
        ours = lp.LnStructured(1, n=n, dim=0).compute_mask(t, default)
        theirs = tp.LnStructured(1, n=n, dim=0).compute_mask(t, default.clone())
        assert torch.equal(ours, theirs.to(ours.dtype))
        assert ours.dtype == torch.float32  # torch returns t's dtype here (pytorch #57631)
    torch.manual_seed(3)
    ours = lp.RandomStructured(2, dim=1).compute_mask(t, default)
    torch.manual_seed(3)
    theirs = tp.RandomStructured(2, dim=1).compute_mask(t, default.clone())
    assert torch.equal(ours, theirs.to(ours.dtype)) and ours.dtype == torch.float32
    assert lp.LnStructured(0, n=1, dim=0).compute_mask(t, default) is default


@pytest.mark.parametrize("amount", [0, 1, 3, 0.4, 1.0])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_random_structured_same_seed_same_channels_as_torch(amount: int | float, dim: int) -> None:
    ours, theirs = pair_with(torch.randn(5, 3, 4))
    torch.manual_seed(21)
    hook = lp.RandomStructured.apply(ours, "weight", amount, dim)
    torch.manual_seed(21)
    tp.RandomStructured.apply(theirs, "weight", amount, dim)
    assert isinstance(hook, lp.RandomStructured)
    assert torch.equal(ours.weight_mask, theirs.weight_mask)
    assert zero_channels(ours.weight_mask, dim) == expected_count(amount, ours.weight.shape[dim])


def test_random_structured_repeated_matches_torch_with_the_same_seed() -> None:
    ours, theirs = pair_with(torch.randn(8, 3))
    torch.manual_seed(2)
    for amount in (2, 0.5, 1):
        lp.random_structured(ours, "weight", amount=amount, dim=0)
    torch.manual_seed(2)
    for amount in (2, 0.5, 1):
        tp.random_structured(theirs, "weight", amount=amount, dim=0)
    assert torch.equal(ours.weight_mask, theirs.weight_mask)
    assert zero_channels(ours.weight_mask, 0) == 2 + 3 + 1


def test_default_dim_is_the_last() -> None:
    assert lp.RandomStructured(amount=1).dim == -1
    assert lp.LnStructured(amount=1, n=2).dim == -1
    layer = layer_with(distinct((3, 5)))
    lp.RandomStructured.apply(layer, "weight", amount=2)
    assert zero_channels(layer.weight_mask, 1) == 2


@pytest.mark.parametrize("bool_mask", [False, True])
def test_structured_after_unstructured_counts_partly_pruned_channels(bool_mask: bool) -> None:
    weight = distinct((4, 4), seed=5)
    ours, theirs = pair_with(weight)
    mask = torch.tensor([[0.0, 0, 0, 0], [0, 1, 1, 1], [1, 1, 1, 1], [1, 0, 1, 1]])
    with lp.mask_dtype(torch.bool if bool_mask else None):
        for pruner, module in ((lp, ours), (tp, theirs)):
            pruner.custom_from_mask(module, "weight", mask)
            pruner.ln_structured(module, "weight", amount=0.5, n=1, dim=0)  # 2 of the 3 channels left
            pruner.l1_unstructured(module, "weight", amount=1)
    assert torch.equal(ours.weight_mask.float(), theirs.weight_mask)
    assert zero_channels(ours.weight_mask, 0) == 3


def test_repeated_structured_ranks_the_pruned_tensor_like_torch() -> None:
    # regression: a second call ranked channels by the norms of weight_orig; torch ranks module.weight, i.e.
    # orig * mask, so entries already pruned count as 0. Here row 0 keeps only its 1.0: L1 norm 1 (orig: 21).
    weight = torch.tensor([[10.0, 10.0, 1.0], [6.0, 6.0, 6.0], [1.0, 1.0, 1.0], [9.0, 0.5, 0.5]])
    cut = torch.tensor([[0.0, 0.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    for bool_mask in (False, True):
        ours, theirs = pair_with(weight)
        with lp.mask_dtype(torch.bool if bool_mask else None):
            for pruner, module in ((lp, ours), (tp, theirs)):
                pruner.custom_from_mask(module, "weight", cut)
                pruner.ln_structured(module, "weight", amount=1, n=1, dim=0)
        assert torch.equal(ours.weight_mask.float(), theirs.weight_mask)
        assert ours.weight_mask.sum(dim=1).tolist() == [0, 3, 3, 3]
    # a user's method sees the masked values too, as in torch
    seen = []

    class Spy(lp.BasePruningMethod):
        PRUNING_TYPE = "global"

        def compute_mask(self, t: Tensor, default_mask: Tensor) -> Tensor:
            seen.append(t.clone())
            return default_mask

    layer = layer_with(weight)
    lp.custom_from_mask(layer, "weight", cut)
    Spy.apply(layer, "weight")
    assert torch.equal(seen[0], weight * cut)


def test_structured_amount_larger_than_channels_left() -> None:
    layer = layer_with(torch.randn(4, 3))
    lp.ln_structured(layer, "weight", amount=3, n=2, dim=0)
    with pytest.raises(ValueError, match=r"amount=2 is larger than the number of units that can still be pruned \(1\)"):
        lp.ln_structured(layer, "weight", amount=2, n=2, dim=0)
    with pytest.raises(ValueError, match=r"amount=4 is larger .* \(3\)"):
        lp.RandomStructured(4, dim=1).compute_mask(torch.randn(4, 3), torch.ones(4, 3))


# --------------------------------------------------------------------------------------------------------------
# CustomFromMask
# --------------------------------------------------------------------------------------------------------------


def test_custom_from_mask_matches_torch_including_composition() -> None:
    weight = torch.randn(3, 4)
    ours, theirs = pair_with(weight)
    first = torch.tensor([[1, 0, 1, 1]] * 3)
    second = torch.tensor([[1.0, 1.0, 0.0, 0.5]] * 3)
    hook = lp.CustomFromMask.apply(ours, "weight", mask=first)
    tp.CustomFromMask.apply(theirs, "weight", mask=first)
    assert isinstance(hook, lp.CustomFromMask)
    assert ours.weight_mask.dtype == torch.float32 == theirs.weight_mask.dtype
    lp.CustomFromMask.apply(ours, "weight", mask=second)
    tp.CustomFromMask.apply(theirs, "weight", mask=second)
    assert torch.equal(ours.weight_mask, theirs.weight_mask)
    assert ours.weight_mask[0].tolist() == [1, 0, 0, 0.5]
    assert torch.equal(ours.weight, theirs.weight)


def test_custom_from_mask_compute_mask() -> None:
    default = torch.tensor([1.0, 0.0, 1.0])
    mask = lp.CustomFromMask(torch.tensor([True, True, False])).compute_mask(torch.randn(3), default)
    assert mask.tolist() == [1, 0, 0] and mask.dtype == torch.float32


def test_custom_from_mask_errors() -> None:
    layer = layer_with(torch.randn(3, 4))
    with pytest.raises(ValueError, match=r"mask must have the shape of the pruned tensor: got \(4, 3\) vs \(3, 4\)"):
        lp.custom_from_mask(layer, "weight", mask=torch.ones(4, 3))
    with pytest.raises(TypeError, match=r"mask must be a Tensor, got list"):
        lp.custom_from_mask(layer, "weight", mask=[[1.0] * 4] * 3)  # type: ignore[arg-type]
    assert not lp.is_pruned(layer)
    with pytest.raises(ValueError, match=r"mask must have the shape"):
        lp.CustomFromMask(torch.ones(2)).compute_mask(torch.ones(3), torch.ones(3))


# --------------------------------------------------------------------------------------------------------------
# Exact counts under repeated calls (Hypothesis)
# --------------------------------------------------------------------------------------------------------------

amounts = st.one_of(st.floats(0.0, 1.0), st.integers(0, 12))


@settings(max_examples=40, deadline=None)
@given(
    shape=st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple),
    dtype=st.sampled_from(FLOAT_DTYPES),
    steps=st.lists(st.tuples(st.sampled_from(["l1", "random"]), amounts), min_size=1, max_size=4),
    bool_mask=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_unstructured_counts_are_exact_and_compose(
    shape: tuple[int, ...], dtype: torch.dtype, steps: list[tuple[str, Any]], bool_mask: bool, seed: int
) -> None:
    torch.manual_seed(seed)
    weight = torch.randn(shape).to(dtype)
    layer = layer_with(weight)
    left = weight.numel()
    previous = torch.ones(shape, dtype=torch.bool)
    with lp.mask_dtype(torch.bool if bool_mask else None):
        for kind, amount in steps:
            k = expected_count(amount, left)
            if k > left:
                with pytest.raises(ValueError, match=rf"amount={amount} is larger"):
                    lp.l1_unstructured(layer, "weight", amount=amount)
                continue
            if kind == "l1":
                lp.l1_unstructured(layer, "weight", amount=amount)
            else:
                lp.random_unstructured(layer, "weight", amount=amount)
            kept = layer.weight_mask != 0
            assert int((~kept).sum()) == weight.numel() - left + k
            assert bool((kept <= previous).all()), "a pruned entry came back"
            if kind == "l1" and k:
                newly = previous & ~kept
                magnitude = weight.abs().to(torch.float64)
                still = magnitude[kept]
                if still.numel():
                    assert magnitude[newly].max() <= still.min()
            previous, left = kept, left - k
    if lp.is_pruned(layer):
        assert layer.weight_mask.dtype == (torch.bool if bool_mask else dtype)


@settings(max_examples=40, deadline=None)
@given(
    shape=st.lists(st.integers(1, 5), min_size=2, max_size=3).map(tuple),
    steps=st.lists(
        st.tuples(st.sampled_from(["ln", "random"]), amounts, st.integers(-3, 2), st.sampled_from([1, 2, INF])),
        min_size=1,
        max_size=4,
    ),
    bool_mask=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_structured_counts_are_exact_and_compose(
    shape: tuple[int, ...], steps: list[tuple[str, Any, int, Any]], bool_mask: bool, seed: int
) -> None:
    torch.manual_seed(seed)
    layer = layer_with(torch.randn(shape))
    with lp.mask_dtype(torch.bool if bool_mask else None):
        for kind, amount, dim, n in steps:
            if not -len(shape) <= dim < len(shape):
                with pytest.raises(IndexError, match=rf"dim={dim} is out of range"):
                    lp.ln_structured(layer, "weight", amount=amount, n=n, dim=dim)
                continue
            mask = layer.weight_mask if lp.is_pruned(layer) else torch.ones(shape)
            left = shape[dim] - zero_channels(mask, dim)
            k = expected_count(amount, left)
            before = zero_channels(mask, dim)
            if k > left:
                with pytest.raises(ValueError, match=r"is larger than the number of units"):
                    lp.random_structured(layer, "weight", amount=amount, dim=dim)
                continue
            if kind == "ln":
                lp.ln_structured(layer, "weight", amount=amount, n=n, dim=dim)
            else:
                lp.random_structured(layer, "weight", amount=amount, dim=dim)
            assert zero_channels(layer.weight_mask, dim) == before + k
            assert bool((layer.weight_mask.to(torch.float32) <= mask.to(torch.float32)).all())


# --------------------------------------------------------------------------------------------------------------
# Mask dtypes of compute_mask (pytorch #57631: torch returns int64 or float64 depending on the method)
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("default_dtype", [torch.float16, torch.float32, torch.float64, torch.bool])
def test_compute_mask_returns_the_default_masks_dtype(default_dtype: torch.dtype) -> None:
    t = torch.randn(4, 5, dtype=torch.float64)
    default = torch.ones(4, 5, dtype=default_dtype)
    methods = [
        lp.Identity(),
        lp.L1Unstructured(3),
        lp.RandomUnstructured(0.5),
        lp.LnStructured(2, n=2, dim=0),
        lp.RandomStructured(1, dim=1),
        lp.CustomFromMask(torch.ones(4, 5, dtype=torch.int64)),
    ]
    for method in methods:
        assert method.compute_mask(t, default).dtype == default_dtype, type(method).__name__


# --------------------------------------------------------------------------------------------------------------
# CUDA (run on a GPU machine only)
# --------------------------------------------------------------------------------------------------------------


@cuda
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("bool_mask", [False, True])
def test_cuda_masks_live_on_the_parameters_device(dtype: torch.dtype, bool_mask: bool) -> None:
    with lp.mask_dtype(torch.bool if bool_mask else None):
        layer = nn.Linear(16, 8).to(device="cuda", dtype=dtype)
        other = nn.Linear(8, 4).to(device="cuda", dtype=dtype)
        lp.l1_unstructured(layer, "weight", amount=0.5)
        lp.random_unstructured(layer, "weight", amount=10)
        lp.ln_structured(layer, "weight", amount=2, n=2, dim=0)
        lp.random_structured(layer, "weight", amount=0.25, dim=1)
        lp.custom_from_mask(layer, "bias", torch.ones(8))  # a CPU mask for a CUDA parameter
        before = zeros(layer.weight_mask)
        assert before >= 64 + 10
        lp.global_unstructured([(layer, "weight"), (other, "weight")], lp.L1Unstructured, amount=0.5)
        lp.global_unstructured([(layer, "bias"), (other, "bias")], lp.RandomUnstructured, amount=3)
    for module in (layer, other):
        for name in ("weight", "bias"):
            mask = getattr(module, name + "_mask")
            assert mask.device.type == "cuda"
            assert mask.dtype == (torch.bool if bool_mask else dtype)
            assert getattr(module, name).device.type == "cuda"
    left = 128 - before + 32
    assert zeros(other.weight_mask) + zeros(layer.weight_mask) == before + round(0.5 * left)
    assert zeros(layer.bias_mask) + zeros(other.bias_mask) == 3
    out = layer(torch.randn(3, 16, device="cuda", dtype=dtype))
    assert out.device.type == "cuda"
    layer.cpu()
    assert layer.weight.device.type == "cpu" and layer.weight_mask.device.type == "cpu"


@cuda
def test_cuda_l1_matches_cpu() -> None:
    weight = torch.randn(8, 16)
    cpu_layer, gpu_layer = pair_with(weight)
    gpu_layer.cuda()
    lp.l1_unstructured(cpu_layer, "weight", amount=0.37)
    lp.l1_unstructured(gpu_layer, "weight", amount=0.37)
    assert torch.equal(cpu_layer.weight_mask, gpu_layer.weight_mask.cpu())


@cuda
def test_cuda_parameter_with_cpu_importance_scores() -> None:
    # the first call worked (the mask was moved), a later one failed: its current mask is on the GPU
    layer = nn.Linear(8, 6).cuda()
    other = nn.Linear(8, 6).cuda()
    for _ in range(2):
        lp.l1_unstructured(layer, "weight", amount=5, importance_scores=torch.randn(6, 8))
        lp.ln_structured(layer, "weight", amount=1, n=2, dim=0, importance_scores=torch.randn(6, 8))
        scores = {(layer, "weight"): torch.randn(6, 8), (other, "weight"): torch.randn(6, 8)}
        lp.global_unstructured([(layer, "weight"), (other, "weight")], lp.L1Unstructured, scores, amount=4)
    assert layer.weight_mask.device.type == "cuda" and other.weight_mask.device.type == "cuda"


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_complex_parameters_are_ranked_by_magnitude_as_torch_ranks_them(dtype: torch.dtype) -> None:
    """Complex weights (e.g. a Fourier layer's spectral weights): torch's L1 ranks ``abs``; so do lightprune's L1,
    repeated and global calls, also with complex importance scores on a real parameter."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(6, 8, dtype=dtype, generator=generator)
    scores = torch.randn(6, 8, dtype=dtype, generator=generator)
    found = []
    for api in (tp, lp):
        layer, other = nn.Module(), nn.Module()
        layer.w = nn.Parameter(weight.clone())
        other.w = nn.Parameter(weight.real.clone())
        api.l1_unstructured(layer, "w", amount=0.3)
        api.l1_unstructured(layer, "w", amount=10)
        api.l1_unstructured(other, "w", amount=0.5, importance_scores=scores)
        api.global_unstructured([(layer, "w"), (other, "w")], pruning_method=api.L1Unstructured, amount=0.4)
        found.append((layer.w_mask.clone(), other.w_mask.clone(), layer.w.clone()))
    for expected, got in zip(*found, strict=True):
        assert torch.equal(got, expected)


def test_complex_scores_ranked_by_value_are_refused() -> None:
    from lightprune.prune.k_smallest import find_cut

    with pytest.raises(TypeError, match=r"complex scores \(dtype torch.complex64\) have no order by value"):
        find_cut([torch.tensor([1 + 1j, 2j])], 1)


@pytest.mark.parametrize(
    "call",
    [
        lambda impl, m: impl.l1_unstructured(m, "weight", 0.3, importance_scores=torch.randn(6, 5)),
        lambda impl, m: impl.custom_from_mask(m, "weight", torch.ones(6, 5)),
        lambda impl, m: impl.CustomFromMask(torch.ones(3)).compute_mask(torch.ones(5, 6), torch.ones(5, 6)),
        lambda impl, m: (setattr(m, "bias", None), impl.l1_unstructured(m, "bias", 1)),
        lambda impl, m: impl.custom_from_mask(m, "weight", [[1.0] * 6] * 5),
        lambda impl, m: impl.l1_unstructured(m, "weight", 0.3, importance_scores=[[1.0] * 6] * 5),
        lambda impl, m: impl.l1_unstructured(nn.LazyLinear(3), "weight", 0.5),
        lambda impl, m: impl.global_unstructured([(m, "weight"), ("m", "weight")], impl.L1Unstructured, amount=1),
    ],
    ids=[
        "scores shape",
        "mask shape",
        "compute_mask shape",
        "None parameter",
        "list mask",
        "list scores",
        "lazy parameter",
        "not a module",
    ],
)
def test_code_catching_torchs_exception_type_catches_ours(call: Any) -> None:
    errors = []
    for impl in (tp, lp):
        try:
            call(impl, nn.Linear(6, 5))
        except Exception as err:  # (the type is what is compared)
            errors.append(err)
    torch_error, ours = errors
    assert isinstance(ours, type(torch_error)), (torch_error, ours)


@cuda
def test_global_unstructured_on_cpu_and_cuda_raises_torchs_type() -> None:
    errors = []
    for impl in (tp, lp):
        pairs = [(nn.Linear(4, 3), "weight"), (nn.Linear(3, 2).cuda(), "weight")]
        with pytest.raises(TypeError) as caught:
            impl.global_unstructured(pairs, impl.L1Unstructured, amount=2)
        errors.append(caught.value)
    assert "parameters[1] (Linear.weight) on cuda:0" in str(errors[1])


def test_global_unstructured_on_two_devices_names_them_and_changes_nothing() -> None:
    first, second = nn.Linear(4, 3), nn.Linear(3, 2, device="meta")
    before = {k: v.clone() for k, v in first.state_dict().items()}
    with pytest.raises(
        ValueError, match=r"parameters\[0\] \(Linear.weight\) on cpu, parameters\[1\] \(Linear.weight\) on meta"
    ):
        lp.global_unstructured([(first, "weight"), (second, "weight")], lp.L1Unstructured, amount=2)
    assert not lp.is_pruned(first) and not lp.is_pruned(second)
    assert all(torch.equal(v, before[k]) for k, v in first.state_dict().items())
