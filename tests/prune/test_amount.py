"""Unit tests of ``lightprune.prune.amount``: the validation helpers, compared with torch's private ones.

Third-party code calls torch's underscore helpers directly, so lightprune's must give the same results and raise the
same exception types; only the messages differ (they name the bad value and what is allowed). Where lightprune is
deliberately stricter than torch (a NaN amount, a dim below ``-t.dim()``, a non-int dim), the helpers still give
torch's results and the stricter check is made by the methods, whose error is of the type torch raises later.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils import prune as tp

from lightprune import prune as lp
from lightprune.prune import amount as am
from lightprune.prune.rowwise import rowwise_mask


def outcome(fn: Any, *args: Any) -> tuple[str, Any]:
    """``("ok", result)`` or ``(exception type name, None)``."""
    try:
        return "ok", fn(*args)
    except Exception as exc:  # the type is the result
        return type(exc).__name__, None


# --------------------------------------------------------------------------------------------------------------
# _validate_pruning_amount_init
# --------------------------------------------------------------------------------------------------------------

ACCEPTED_AMOUNTS = [0, 1, 7, 10**12, 0.0, 0.5, 1.0, True, False, np.float32(0.25), np.int64(3), Fraction(1, 2)]


@pytest.mark.parametrize("amount", ACCEPTED_AMOUNTS, ids=repr)
def test_amount_init_accepts_what_torch_accepts(amount: Any) -> None:
    assert outcome(tp._validate_pruning_amount_init, amount) == ("ok", None)
    assert lp._validate_pruning_amount_init(amount) is None


@pytest.mark.parametrize(
    ("amount", "match"),
    [
        ("0.5", r"Invalid type for amount: '0\.5' \(str\)\. Must be int \(a count\) or float \(a fraction\)"),
        (None, r"None \(NoneType\)"),
        ([0.5], r"\[0\.5\] \(list\)"),
        (torch.tensor(0.5), r"tensor\(0\.5000\) \(Tensor\)"),
        (1 + 2j, r"\(1\+2j\) \(complex\)"),
    ],
    ids=repr,
)
def test_amount_init_wrong_type_is_type_error(amount: Any, match: str) -> None:
    assert outcome(tp._validate_pruning_amount_init, amount)[0] == "TypeError"
    with pytest.raises(TypeError, match=match):
        lp._validate_pruning_amount_init(amount)


@pytest.mark.parametrize(
    ("amount", "match"),
    [
        (-1, r"amount=-1 is out of range"),
        (-0.1, r"amount=-0\.1 is out of range"),
        (1.5, r"amount=1\.5 is out of range: a float amount is a fraction in \[0, 1\], an int amount a count >= 0"),
        (2.0, r"amount=2\.0 is out of range"),
        (float("inf"), r"amount=inf is out of range"),
        (float("-inf"), r"amount=-inf is out of range"),
    ],
    ids=repr,
)
def test_amount_init_out_of_range_is_value_error(amount: Any, match: str) -> None:
    assert outcome(tp._validate_pruning_amount_init, amount)[0] == "ValueError"
    with pytest.raises(ValueError, match=match):
        lp._validate_pruning_amount_init(amount)


def test_nan_amount_passes_the_helper_like_torch_and_the_methods_reject_it() -> None:
    # torch's helper lets NaN through and its methods fail later with a ValueError from round(nan * n); the helper
    # keeps torch's result, the methods reject NaN at once with the same type and a message naming the value
    assert outcome(tp._validate_pruning_amount_init, float("nan")) == ("ok", None)
    assert lp._validate_pruning_amount_init(float("nan")) is None
    with pytest.raises(ValueError):
        tp.L1Unstructured(amount=float("nan")).compute_mask(torch.ones(3), torch.ones(3))
    assert outcome(tp._compute_nparams_toprune, float("nan"), 3)[0] == "ValueError"
    assert outcome(lp._compute_nparams_toprune, float("nan"), 3)[0] == "ValueError"
    with pytest.raises(ValueError, match=r"amount=nan is out of range"):
        am.validate_amount(float("nan"))
    for method in (lp.L1Unstructured, lp.RandomUnstructured, lp.RandomStructured):
        with pytest.raises(ValueError, match=r"amount=nan is out of range"):
            method(amount=float("nan"))
    with pytest.raises(ValueError, match=r"amount=nan"):
        lp.LnStructured(amount=float("nan"), n=2)
    layer = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"amount=nan"):
        lp.global_unstructured([(layer, "weight")], lp.L1Unstructured, amount=float("nan"))
    assert not lp.is_pruned(layer)


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.integers(-(10**6), 10**6), st.floats(), st.booleans(), st.fractions()))
def test_amount_init_matches_torch_on_any_real(amount: Any) -> None:
    assert outcome(lp._validate_pruning_amount_init, amount)[0] == outcome(tp._validate_pruning_amount_init, amount)[0]


# --------------------------------------------------------------------------------------------------------------
# _compute_nparams_toprune and _validate_pruning_amount
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("amount", "size", "expected"),
    [
        (0.5, 7, 4),  # round(3.5) = 4 (banker's rounding to even)
        (0.5, 5, 2),  # round(2.5) = 2
        (0.25, 10, 2),  # round(2.5) = 2
        (0.35, 10, 4),  # 0.35 * 10 = 3.5 in binary: rounds to 4
        (1.0, 9, 9),
        (0.0, 9, 0),
        (3, 7, 3),
        (12, 7, 12),  # an int is returned as it is; _validate_pruning_amount rejects it
        (True, 3, 1),
        (np.int64(3), 7, 3),
        (np.float32(0.5), 7, 4),
        (Fraction(1, 3), 9, 3),
    ],
    ids=repr,
)
def test_compute_nparams_toprune_matches_torch(amount: Any, size: int, expected: int) -> None:
    ours = lp._compute_nparams_toprune(amount, size)
    assert ours == tp._compute_nparams_toprune(amount, size) == expected
    assert type(ours) is int


@settings(max_examples=300, deadline=None)
@given(st.floats(0.0, 1.0), st.integers(0, 10**7))
def test_compute_nparams_toprune_float_is_python_round(amount: float, size: int) -> None:
    ours = lp._compute_nparams_toprune(amount, size)
    assert ours == round(amount * size) == tp._compute_nparams_toprune(amount, size)
    assert 0 <= ours <= size


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.integers(0, 50), st.floats(0.0, 1.0)), st.integers(0, 40))
def test_validate_pruning_amount_matches_torch(amount: Any, size: int) -> None:
    assert outcome(lp._validate_pruning_amount, amount, size) == outcome(tp._validate_pruning_amount, amount, size)


def test_validate_pruning_amount_message_names_both_numbers() -> None:
    with pytest.raises(ValueError, match=r"amount=5 is larger than the number of units that can still be pruned \(4\)"):
        lp._validate_pruning_amount(5, 4)
    assert lp._validate_pruning_amount(4, 4) is None
    assert lp._validate_pruning_amount(0.9, 4) is None  # floats are fractions: never too large here


# --------------------------------------------------------------------------------------------------------------
# _validate_structured_pruning and _validate_pruning_dim
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "match"),
    [
        ((), r"at least 2 dims; got shape \(\) with 0 dims"),
        ((3,), r"at least 2 dims; got shape \(3,\) with 1 dim$"),
        ((0,), r"got shape \(0,\) with 1 dim"),
    ],
)
def test_structured_pruning_needs_two_dims(shape: tuple[int, ...], match: str) -> None:
    t = torch.ones(shape)
    assert outcome(tp._validate_structured_pruning, t)[0] == "ValueError"
    with pytest.raises(ValueError, match=match):
        lp._validate_structured_pruning(t)


@pytest.mark.parametrize("shape", [(2, 3), (1, 1), (2, 0), (2, 3, 4, 5)])
def test_structured_pruning_accepts_two_dims_or_more(shape: tuple[int, ...]) -> None:
    t = torch.ones(shape)
    assert outcome(tp._validate_structured_pruning, t) == outcome(lp._validate_structured_pruning, t) == ("ok", None)


@pytest.mark.parametrize("dim", [-3, -2, -1, 0, 1, 2])
def test_validate_pruning_dim_in_range_matches_torch(dim: int) -> None:
    t = torch.ones(2, 3, 4)
    assert outcome(lp._validate_pruning_dim, t, dim) == outcome(tp._validate_pruning_dim, t, dim) == ("ok", None)


@pytest.mark.parametrize("dim", [3, 4, 100])
def test_validate_pruning_dim_too_large_is_index_error(dim: int) -> None:
    t = torch.ones(2, 3, 4)
    assert outcome(tp._validate_pruning_dim, t, dim)[0] == "IndexError"
    with pytest.raises(IndexError, match=rf"dim={dim} is out of range for a tensor of shape \(2, 3, 4\): "):
        lp._validate_pruning_dim(t, dim)
    with pytest.raises(IndexError, match=r"allowed dims are -3 \.\.\. 2"):
        lp._validate_pruning_dim(t, dim)


@pytest.mark.parametrize("dim", [-4, -100, 1.0, True])
def test_validate_pruning_dim_passes_what_torch_passes(dim: Any) -> None:
    # torch's helper only rejects dim >= t.dim(); the helper keeps torch's results for third-party callers
    t = torch.ones(2, 3, 4)
    assert outcome(tp._validate_pruning_dim, t, dim) == outcome(lp._validate_pruning_dim, t, dim) == ("ok", None)


@pytest.mark.parametrize("dim", ["1", None])
def test_validate_pruning_dim_incomparable_is_type_error_like_torch(dim: Any) -> None:
    t = torch.ones(2, 3)
    assert outcome(tp._validate_pruning_dim, t, dim)[0] == "TypeError"
    with pytest.raises(TypeError):
        lp._validate_pruning_dim(t, dim)


def test_zero_dim_tensor_like_torch() -> None:
    t = torch.ones(())
    assert outcome(lp._validate_pruning_dim, t, -1) == outcome(tp._validate_pruning_dim, t, -1) == ("ok", None)
    assert outcome(tp._validate_pruning_dim, t, 0)[0] == "IndexError"
    with pytest.raises(IndexError, match=r"dim=0 is out of range for a tensor of shape \(\)"):
        lp._validate_pruning_dim(t, 0)


def test_methods_reject_a_too_negative_dim_at_once() -> None:
    # torch lets dim=-4 of a 3-D tensor pass its validation and fails later with an IndexError; the methods
    # raise it before anything else, with a message naming the allowed dims
    t = torch.ones(2, 3, 4)
    assert outcome(tp._compute_norm, t, 2, -4)[0] == "IndexError"
    for method in (lp.LnStructured(amount=1, n=2, dim=-4), lp.RandomStructured(amount=1, dim=-4)):
        with pytest.raises(IndexError, match=r"dim=-4 is out of range .* allowed dims are -3 \.\.\. 2"):
            method.compute_mask(t, torch.ones_like(t))


@pytest.mark.parametrize("dim", [1.0, None, "1"])
def test_methods_reject_non_integer_dims(dim: Any) -> None:
    # torch fails on a float dim later (list index) with a TypeError
    with pytest.raises(TypeError, match=r"dim must be an int, got"):
        lp.LnStructured(amount=1, n=2, dim=dim).compute_mask(torch.ones(2, 3), torch.ones(2, 3))
    with pytest.raises(TypeError, match=r"dim must be an int, got"):
        lp.RandomStructured(amount=1, dim=dim).compute_mask(torch.ones(2, 3), torch.ones(2, 3))
    with pytest.raises(TypeError, match=r"dim must be an int, got"):
        lp.RowwiseL1Unstructured(amount=1, dim=dim)
    with pytest.raises(TypeError, match=r"dim must be an int, got"):
        rowwise_mask(1, torch.ones(2, 3), None, torch.bool, dim=dim)


def test_a_bool_dim_is_an_int_as_in_torch() -> None:
    """Code that runs with torch runs unchanged: torch's int arguments take True as 1."""
    torch.manual_seed(0)
    ours, theirs = nn.Conv2d(2, 4, 3), nn.Conv2d(2, 4, 3)
    theirs.load_state_dict(ours.state_dict())
    lp.ln_structured(ours, "weight", amount=1, n=2, dim=True)
    torch.nn.utils.prune.ln_structured(theirs, "weight", amount=1, n=2, dim=True)
    assert torch.equal(ours.weight_mask.float(), theirs.weight_mask) and ours.weight_mask.sum((0, 2, 3)).min() == 0


def test_normalize_dim() -> None:
    t = torch.ones(2, 3, 4)
    assert [am.normalize_dim(t, d) for d in (-3, -2, -1, 0, 1, 2)] == [0, 1, 2, 0, 1, 2]
    assert am.normalize_dim(t, np.int64(-1)) == 2
    assert type(am.normalize_dim(t, np.int64(-1))) is int


# --------------------------------------------------------------------------------------------------------------
# _compute_norm, and the norm checks of LnStructured
# --------------------------------------------------------------------------------------------------------------

NORMS = [1, 2, 3.5, float("inf"), float("-inf"), "fro", "nuc", 0]
LINALG = am.norms_follow_linalg()  # torch >= 2.14: torch's _compute_norm uses torch.linalg (see its docstring)


@pytest.mark.parametrize("n", NORMS, ids=repr)
@pytest.mark.parametrize("dim", [0, 1, 2, -1, -3])
def test_compute_norm_matches_torch(n: Any, dim: int) -> None:
    t = torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(7))
    ours = lp._compute_norm(t, n, dim)
    theirs = tp._compute_norm(t, n, dim)
    assert ours.shape == (t.shape[dim],)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("n", [*NORMS, "abc"], ids=repr)
@pytest.mark.parametrize("shape", [(5,), (3, 4), (2, 3, 4, 5), (2, 3, 2, 2, 3)], ids=str)
def test_compute_norm_follows_the_installed_torch_for_every_n_and_rank(n: Any, shape: tuple[int, ...]) -> None:
    # the cases where torch 2.13 (torch.norm) and 2.14+ (torch.linalg) differ: 'fro' and 'nuc' over other than
    # two dims, and unknown strings; lightprune gives what the installed torch gives, errors included
    t = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    for dim in range(-len(shape), len(shape)):
        (ours_kind, ours), (theirs_kind, theirs) = (
            outcome(lp._compute_norm, t, n, dim),
            outcome(tp._compute_norm, t, n, dim),
        )
        assert ours_kind == theirs_kind, f"n={n!r}, shape={shape}, dim={dim}"
        if theirs is not None:
            assert ours.shape == theirs.shape and torch.equal(ours, theirs), f"n={n!r}, shape={shape}, dim={dim}"


def test_norms_follow_linalg_says_which_torch_this_is() -> None:
    # 'fro' over three dims: refused by torch.norm (torch <= 2.13), the 2-norm with torch.linalg (torch >= 2.14)
    kind, norms = outcome(tp._compute_norm, torch.ones(2, 2, 2, 2), "fro", 0)
    assert kind == ("ok" if LINALG else "RuntimeError")
    if LINALG:
        assert torch.equal(norms, torch.full((2,), 8.0).sqrt())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_compute_norm_dtypes_match_torch(dtype: torch.dtype) -> None:
    t = torch.randn(4, 6, generator=torch.Generator().manual_seed(1)).to(dtype)
    for n in (1, 2, float("inf"), "fro"):
        ours = lp._compute_norm(t, n, 0)
        assert ours.dtype == dtype
        assert torch.equal(ours, tp._compute_norm(t, n, 0))


def test_compute_norm_errors_have_torchs_types() -> None:
    # 'nuc' over one remaining dim: torch.norm raises (torch <= 2.13); torch.linalg takes the last two dims (2.14+)
    assert (
        outcome(lp._compute_norm, torch.ones(3, 4), "nuc", 0)[0]
        == outcome(tp._compute_norm, torch.ones(3, 4), "nuc", 0)[0]
    )
    assert outcome(tp._compute_norm, torch.ones(3, 4), "nuc", 0)[0] == ("ok" if LINALG else "RuntimeError")
    # a dim too large: torch raises ValueError (list.remove), an IndexError is what the rest of the API raises for
    # a bad dim; lightprune's error is both
    assert outcome(tp._compute_norm, torch.ones(3, 4), 2, 5)[0] == "ValueError"
    with pytest.raises(ValueError, match=r"dim=5 is out of range"):
        lp._compute_norm(torch.ones(3, 4), 2, 5)
    with pytest.raises(IndexError, match=r"dim=5 is out of range"):
        lp._compute_norm(torch.ones(3, 4), 2, 5)
    # a dim too negative: IndexError in both
    assert outcome(tp._compute_norm, torch.ones(3, 4), 2, -3)[0] == "IndexError"
    with pytest.raises(IndexError, match=r"dim=-3"):
        lp._compute_norm(torch.ones(3, 4), 2, -3)


@pytest.mark.parametrize(
    ("shape", "n", "dim"),
    [((2, 3, 4, 5), "fro", 1), ((0, 0), -1, 0), ((3, 4), "nuc", 0)],
)
def test_ln_structured_checks_the_norm_even_for_amount_zero(shape: tuple[int, ...], n: Any, dim: int) -> None:
    # regression: torch computes the norms before looking at the amount, so an order refused for this shape fails
    # even with amount=0; lightprune skipped the norms when nothing was pruned and accepted it. Which orders are
    # refused depends on the torch version ('fro' over three dims is the 2-norm from torch 2.14 on): follow torch.
    t = torch.ones(shape)
    theirs = outcome(tp.LnStructured(0, n=n, dim=dim).compute_mask, t, torch.ones(shape))
    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(t)
    if theirs[0] == "ok":
        assert torch.equal(lp.LnStructured(0, n=n, dim=dim).compute_mask(t, torch.ones(shape)), theirs[1])
        lp.ln_structured(module, "weight", amount=0.0, n=n, dim=dim)
        assert torch.equal(module.weight_mask, torch.ones(shape))
        return
    assert theirs[0] == "RuntimeError"
    with pytest.raises(RuntimeError, match=r"norm"):
        lp.LnStructured(0, n=n, dim=dim).compute_mask(t, torch.ones(shape))
    with pytest.raises(RuntimeError, match=r"norm"):
        lp.ln_structured(module, "weight", amount=0.0, n=n, dim=dim)
    assert not lp.is_pruned(module)


def test_helpers_are_exported_with_torchs_names() -> None:
    for name in (
        "_validate_pruning_amount_init",
        "_validate_pruning_amount",
        "_compute_nparams_toprune",
        "_validate_structured_pruning",
        "_validate_pruning_dim",
        "_compute_norm",
    ):
        assert callable(getattr(lp, name)), name
        assert hasattr(tp, name), name
        assert name in lp.__all__
