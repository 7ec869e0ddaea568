"""Unit tests of ``lightprune.prune.functional``: the functional forms, global_unstructured, remove, is_pruned and
prepare_for_state_dict."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import Tensor, nn
from torch.nn.utils import prune as tp

from lightprune import prune as lp
from lightprune.prune.functional import remove_masked


def distinct(shape: tuple[int, ...], offset: int = 0, dtype: torch.dtype = torch.float32, seed: int = 0) -> Tensor:
    """Distinct magnitudes ``offset + 1 ... offset + n`` in random order and with random signs."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    values = (torch.randperm(n, generator=g) + 1 + offset).to(torch.float64)
    signs = torch.randint(0, 2, (n,), generator=g) * 2 - 1
    return (values * signs).view(shape).to(dtype)


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 2))


def with_weights(model: nn.Sequential) -> nn.Sequential:
    """Give every Linear weight distinct magnitudes across the whole model (no ties for global ranking)."""
    offset = 0
    with torch.no_grad():
        for i, layer in enumerate(m for m in model if isinstance(m, nn.Linear)):
            layer.weight.copy_(distinct(tuple(layer.weight.shape), offset=offset, seed=i) / 8)
            offset += layer.weight.numel()
    return model


def zeros(t: Tensor) -> int:
    return int((t == 0).sum())


def the_hook(module: nn.Module) -> lp.BasePruningMethod:
    (hook,) = [h for h in module._forward_pre_hooks.values() if isinstance(h, lp.BasePruningMethod)]
    return hook


# --------------------------------------------------------------------------------------------------------------
# The single-tensor functions
# --------------------------------------------------------------------------------------------------------------


def test_functional_forms_return_the_module_and_match_torch() -> None:
    ours, theirs = with_weights(mlp()), with_weights(mlp())
    mask = torch.tensor([1.0, 0.0, 1.0, 1.0])
    calls = [
        lambda p, m: p.identity(m[0], "bias"),
        lambda p, m: p.l1_unstructured(m[0], "weight", amount=0.4),
        lambda p, m: p.l1_unstructured(m[2], "weight", amount=3, importance_scores=m[2].weight.detach().flip(0)),
        lambda p, m: p.ln_structured(m[2], "weight", amount=1, n=2, dim=0),
        lambda p, m: p.ln_structured(m[4], "weight", amount=1, n=1, dim=1, importance_scores=torch.rand(2, 4)),
        lambda p, m: p.custom_from_mask(m[2], "bias", mask=mask),
        lambda p, m: p.l1_unstructured(m[0], "weight", amount=0.25),
    ]
    for i, call in enumerate(calls):
        torch.manual_seed(i)
        returned = call(lp, ours)
        torch.manual_seed(i)
        call(tp, theirs)
        assert isinstance(returned, nn.Linear)
    for key, value in ours.state_dict().items():
        assert torch.equal(value, theirs.state_dict()[key]), key
    x = torch.randn(3, 6)
    assert torch.equal(ours(x), theirs(x))


def test_random_functions_count_exactly_and_return_the_module() -> None:
    torch.manual_seed(0)
    layer = nn.Conv2d(3, 8, 3)
    assert lp.random_unstructured(layer, "weight", amount=0.3) is layer
    assert zeros(layer.weight_mask) == round(0.3 * 216)
    assert lp.random_structured(layer, "weight", amount=3, dim=0) is layer
    channels = (layer.weight_mask.sum(dim=(1, 2, 3)) == 0).sum()
    assert int(channels) == 3
    assert lp.random_unstructured(layer, "bias", amount=8) is layer
    assert zeros(layer.bias) == 8


# --------------------------------------------------------------------------------------------------------------
# global_unstructured
# --------------------------------------------------------------------------------------------------------------


def pairs_of(model: nn.Sequential, name: str = "weight") -> list[tuple[nn.Module, str]]:
    return [(m, name) for m in model if isinstance(m, nn.Linear)]


@pytest.mark.parametrize("amount", [0, 1, 17, 0.5, 0.9, 1.0])
def test_global_l1_matches_torch(amount: int | float) -> None:
    ours, theirs = with_weights(mlp()), with_weights(mlp())
    assert lp.global_unstructured(pairs_of(ours), lp.L1Unstructured, amount=amount) is None
    tp.global_unstructured(pairs_of(theirs), tp.L1Unstructured, amount=amount)
    total = sum(m.weight.numel() for m, _ in pairs_of(ours))
    assert sum(zeros(m.weight_mask) for m, _ in pairs_of(ours)) == (
        amount if isinstance(amount, int) else round(amount * total)
    )
    for (a, _), (b, _) in zip(pairs_of(ours), pairs_of(theirs), strict=True):
        assert torch.equal(a.weight_mask, b.weight_mask)
        assert isinstance(the_hook(a), lp.CustomFromMask)


def test_repeated_global_l1_acts_on_what_is_left_like_torch() -> None:
    ours, theirs = with_weights(mlp()), with_weights(mlp())
    for pruner, model in ((lp, ours), (tp, theirs)):
        pruner.l1_unstructured(model[2], "weight", amount=5)
        pruner.global_unstructured(pairs_of(model), pruner.L1Unstructured, amount=0.5)
        pruner.global_unstructured(pairs_of(model), pruner.L1Unstructured, amount=10)
    for (a, _), (b, _) in zip(pairs_of(ours), pairs_of(theirs), strict=True):
        assert torch.equal(a.weight_mask, b.weight_mask)
    total = sum(m.weight.numel() for m, _ in pairs_of(ours))
    assert sum(zeros(m.weight_mask) for m, _ in pairs_of(ours)) == 5 + round(0.5 * (total - 5)) + 10
    assert [type(m).__name__ for m in the_hook(ours[2])] == ["L1Unstructured", "CustomFromMask", "CustomFromMask"]


def test_global_random_counts_and_never_unprunes() -> None:
    model = mlp()
    lp.global_unstructured(pairs_of(model), lp.RandomUnstructured, amount=0.3)
    first = [m.weight_mask.clone() for m, _ in pairs_of(model)]
    total = sum(m.numel() for m in first)
    assert sum(zeros(m) for m in first) == round(0.3 * total)
    lp.global_unstructured(pairs_of(model), lp.RandomUnstructured, amount=7)
    for before, (m, _) in zip(first, pairs_of(model), strict=True):
        assert bool((m.weight_mask <= before).all())
    assert sum(zeros(m.weight_mask) for m, _ in pairs_of(model)) == round(0.3 * total) + 7


def test_global_importance_scores_dict_matches_torch() -> None:
    ours, theirs = with_weights(mlp()), with_weights(mlp())
    scores_ours = {(ours[2], "weight"): distinct((4, 5), offset=1000, seed=9)}
    scores_theirs = {(theirs[2], "weight"): scores_ours[(ours[2], "weight")]}
    lp.global_unstructured(pairs_of(ours), lp.L1Unstructured, importance_scores=scores_ours, amount=30)
    tp.global_unstructured(pairs_of(theirs), tp.L1Unstructured, importance_scores=scores_theirs, amount=30)
    for (a, _), (b, _) in zip(pairs_of(ours), pairs_of(theirs), strict=True):
        assert torch.equal(a.weight_mask, b.weight_mask)
    assert zeros(ours[2].weight_mask) == 0  # its scores are all above the others' magnitudes


def test_global_mixed_dtypes_fp16_and_fp32() -> None:
    ours, theirs = with_weights(mlp()), with_weights(mlp())
    ours[0].half()
    theirs[0].half()
    lp.global_unstructured(pairs_of(ours), lp.L1Unstructured, amount=0.6)
    tp.global_unstructured(pairs_of(theirs), tp.L1Unstructured, amount=0.6)
    assert ours[0].weight_mask.dtype == torch.float16 and ours[2].weight_mask.dtype == torch.float32
    for (a, _), (b, _) in zip(pairs_of(ours), pairs_of(theirs), strict=True):
        assert torch.equal(a.weight_mask, b.weight_mask)
    with lp.mask_dtype(torch.bool):
        lp.global_unstructured(pairs_of(ours, "bias"), lp.L1Unstructured, amount=3)
    assert {m.bias_mask.dtype for m, _ in pairs_of(ours)} == {torch.bool}
    assert sum(zeros(m.bias_mask) for m, _ in pairs_of(ours)) == 3


def test_global_accepts_a_generator_of_pairs() -> None:
    model = with_weights(mlp())
    lp.global_unstructured(((m, "weight") for m in model if isinstance(m, nn.Linear)), lp.L1Unstructured, amount=9)
    assert sum(zeros(m.weight_mask) for m, _ in pairs_of(model)) == 9


def test_global_masks_own_their_memory_and_hooks_keep_none() -> None:
    model = mlp()
    lp.global_unstructured(pairs_of(model), lp.L1Unstructured, amount=0.5)
    lp.global_unstructured(pairs_of(model), lp.RandomUnstructured, amount=0.5)
    storages = set()
    for m, _ in pairs_of(model):
        mask = m.weight_mask
        assert mask.untyped_storage().nbytes() == mask.numel() * mask.element_size()
        storages.add(mask.untyped_storage().data_ptr())
        for method in the_hook(m):
            assert method.mask is None  # no copy kept: repeated pruning does not accumulate masks
    assert len(storages) == 3


def test_global_user_method_sees_one_vector_like_torch() -> None:
    class SmallestFirstEntries(lp.BasePruningMethod):
        PRUNING_TYPE = "unstructured"

        def __init__(self, amount: int) -> None:
            self.amount = amount

        def compute_mask(self, t: Tensor, default_mask: Tensor) -> Tensor:
            mask = default_mask.clone()
            mask[: self.amount] = 0  # the first entries of the flat vector of what is left
            return mask

    model = mlp()
    lp.global_unstructured(pairs_of(model), SmallestFirstEntries, amount=32)
    assert zeros(model[0].weight_mask) == 30 and zeros(model[2].weight_mask) == 2
    lp.global_unstructured(pairs_of(model), SmallestFirstEntries, amount=1)
    assert zeros(model[2].weight_mask) == 3


@pytest.mark.parametrize("mode", [None, torch.bool], ids=["float-mask", "bool-mask"])
def test_global_user_method_sees_what_torchs_sees(mode: torch.dtype | None) -> None:
    # regression: the user's method got default_mask in the importance scores' dtype; torch concatenates the
    # stored masks, in the parameters' dtype (and a bool mask is shown as the mask torch would have stored)
    def first_entries(base_class: type, seen: list) -> type:
        class FirstEntries(base_class):
            PRUNING_TYPE = "unstructured"

            def __init__(self, amount: int) -> None:
                self.amount = amount

            def compute_mask(self, t: Tensor, default_mask: Tensor) -> Tensor:
                seen.append((t.dtype, default_mask.dtype, default_mask.numel()))
                mask = default_mask.clone()
                mask[: self.amount] = 0
                return mask

        return FirstEntries

    masks = {}
    for pruner in (lp, tp):
        seen: list = []
        method = first_entries(pruner.BasePruningMethod, seen)
        a, b = nn.Linear(3, 2), nn.Linear(2, 2)
        scores = {(a, "weight"): torch.ones(2, 3, dtype=torch.float64), (b, "weight"): torch.ones(2, 2)}
        with lp.mask_dtype(mode if pruner is lp else None):
            pruner.global_unstructured([(a, "weight"), (b, "weight")], method, importance_scores=scores, amount=2)
            pruner.global_unstructured([(a, "weight"), (b, "weight")], method, importance_scores=scores, amount=5)
        masks[pruner] = (seen, a.weight_mask.float(), b.weight_mask.float())
    assert masks[lp][0] == masks[tp][0] == [(torch.float64, torch.float32, 10), (torch.float64, torch.float32, 8)]
    assert torch.equal(masks[lp][1], masks[tp][1]) and torch.equal(masks[lp][2], masks[tp][2])


def test_global_errors() -> None:
    model = mlp()
    pairs = pairs_of(model)
    with pytest.raises(TypeError, match=r'needs a pruning method of PRUNING_TYPE "unstructured"; LnStructured is'):
        lp.global_unstructured(pairs, lp.LnStructured, amount=1, n=2, dim=0)
    with pytest.raises(TypeError, match=r"CustomFromMask is 'global'"):
        lp.global_unstructured(pairs, lp.CustomFromMask, mask=torch.ones(1))
    with pytest.raises(TypeError, match=r"parameters must be an iterable of \(module, name\) pairs, got 'weight'"):
        lp.global_unstructured("weight", lp.L1Unstructured, amount=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"each parameter must be a \(module, name\) pair, got"):
        lp.global_unstructured([model[0]], lp.L1Unstructured, amount=1)  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"importance_scores must be a dict .* got list"):
        lp.global_unstructured(pairs, lp.L1Unstructured, importance_scores=[], amount=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"\(Linear, 'weight'\) appears more than once"):
        lp.global_unstructured([*pairs, pairs[0]], lp.L1Unstructured, amount=1)
    with pytest.raises(ValueError, match=r"importance_scores must have the shape of parameter 'weight'"):
        lp.global_unstructured(pairs, lp.L1Unstructured, importance_scores={pairs[1]: torch.ones(20)}, amount=1)
    with pytest.raises(ValueError, match=r"amount=59 is larger than the number of units that can still be pruned \(58"):
        lp.global_unstructured(pairs, lp.L1Unstructured, amount=59)
    with pytest.raises(ValueError, match=r"amount=1\.5 is out of range"):
        lp.global_unstructured(pairs, lp.L1Unstructured, amount=1.5)
    with pytest.raises(AttributeError, match=r"Linear has no parameter 'wieght'; its parameters are: 'weight', 'bias'"):
        lp.global_unstructured([*pairs, (model[4], "wieght")], lp.L1Unstructured, amount=1)
    assert not lp.is_pruned(model)
    assert lp.global_unstructured([], lp.L1Unstructured, amount=0.5) is None  # nothing to prune: a no-op


# --------------------------------------------------------------------------------------------------------------
# remove
# --------------------------------------------------------------------------------------------------------------


def test_remove_makes_pruning_permanent() -> None:
    layer = nn.Linear(5, 4)
    weight = layer.weight
    user_hook = layer.register_forward_pre_hook(lambda m, i: None)
    lp.l1_unstructured(layer, "weight", amount=6)
    lp.ln_structured(layer, "weight", amount=1, n=2, dim=0)
    lp.l1_unstructured(layer, "bias", amount=1)
    expected = layer.weight.detach().clone()
    assert lp.remove(layer, "weight") is layer
    assert layer._parameters["weight"] is weight and torch.equal(weight, expected)
    assert "weight_orig" not in layer._parameters and "weight_mask" not in layer._buffers
    assert "weight" not in layer.__dict__
    assert user_hook.id in layer._forward_pre_hooks  # other hooks stay
    assert lp.is_pruned(layer)  # bias still is
    lp.remove(layer, "bias")
    assert not lp.is_pruned(layer)
    assert list(layer._forward_pre_hooks) == [user_hook.id]
    assert [n for n, _ in layer.named_parameters()] == ["weight", "bias"]
    out = layer(torch.randn(2, 5))
    out.sum().backward()
    assert weight.grad is not None


def test_remove_of_an_unpruned_tensor_is_a_value_error() -> None:
    layer = nn.Linear(2, 2)
    with pytest.raises(ValueError):
        tp.remove(layer, "weight")
    with pytest.raises(ValueError, match=r"parameter 'weight' of Linear is not pruned, so its pruning cannot be"):
        lp.remove(layer, "weight")
    lp.l1_unstructured(layer, "bias", amount=1)
    with pytest.raises(ValueError, match=r"pruned here: \['bias'\]"):
        lp.remove(layer, "weight")
    lp.remove(layer, "bias")
    with pytest.raises(ValueError, match=r"'bias' of Linear is not pruned"):
        lp.remove(layer, "bias")
    with pytest.raises(ValueError, match=r"'nothing' of Linear is not pruned"):
        lp.remove(layer, "nothing")


def test_remove_calls_a_torch_style_override_of_remove() -> None:
    """A method written for torch overrides ``remove(self, module)``: both removals call it with torch's signature."""
    calls = []

    class LoggedL1(lp.L1Unstructured):
        def remove(self, module):
            calls.append(type(module).__name__)
            super().remove(module)

    for remove in (lp.remove, remove_masked):
        layer = nn.Linear(4, 3)
        LoggedL1.apply(layer, "weight", amount=5)
        remove(layer, "weight")
        assert not lp.is_pruned(layer)
        assert isinstance(layer.weight, nn.Parameter) and int((layer.weight == 0).sum()) == 5
    assert calls == ["Linear", "Linear"]


def test_torchs_helpers_see_lightprunes_pruning() -> None:
    """torch's is_pruned, its methods on top of ours and its remove treat lightprune's hooks as pruning hooks."""
    layer = lp.l1_unstructured(nn.Linear(4, 3), "weight", amount=5)
    assert isinstance(layer._forward_pre_hooks[next(iter(layer._forward_pre_hooks))], tp.BasePruningMethod)
    assert tp.is_pruned(layer)
    tp.l1_unstructured(layer, "weight", amount=2)  # torch's container now holds lightprune's method and its own
    assert int((layer.weight == 0).sum()) == 7
    tp.remove(layer, "weight")
    assert not lp.is_pruned(layer)
    assert isinstance(layer.weight, nn.Parameter) and int((layer.weight == 0).sum()) == 7


def test_remove_of_a_torch_pruned_tensor_gives_advice() -> None:
    layer = nn.Linear(2, 2)
    tp.l1_unstructured(layer, "weight", amount=1)
    with pytest.raises(ValueError, match=r"pruned by torch.nn.utils.prune"):
        lp.remove(layer, "weight")


# --------------------------------------------------------------------------------------------------------------
# is_pruned
# --------------------------------------------------------------------------------------------------------------


def test_is_pruned_recognises_its_own_and_torchs_hooks() -> None:
    model = mlp()
    assert not lp.is_pruned(model)
    model[0].register_forward_pre_hook(lambda m, i: None)
    assert not lp.is_pruned(model)
    lp.identity(model[2], "bias")
    assert lp.is_pruned(model) and lp.is_pruned(model[2]) and not lp.is_pruned(model[0])
    assert tp.is_pruned(model)  # lightprune's methods count as torch's
    lp.remove(model[2], "bias")
    assert not lp.is_pruned(model)
    tp.random_unstructured(model[4], "weight", amount=1)
    assert lp.is_pruned(model) and lp.is_pruned(model[4])


# --------------------------------------------------------------------------------------------------------------
# prepare_for_state_dict
# --------------------------------------------------------------------------------------------------------------


def test_prepare_fresh_model_for_pruned_checkpoint() -> None:
    pruned = mlp(seed=1)
    lp.l1_unstructured(pruned[0], "weight", amount=10)
    lp.ln_structured(pruned[2], "weight", amount=1, n=2, dim=0)
    lp.custom_from_mask(pruned[2], "bias", torch.tensor([1.0, 0.0, 1.0, 1.0]))
    state = pruned.state_dict()
    fresh = mlp(seed=2)
    changed = lp.prepare_for_state_dict(fresh, state)
    assert changed == ["0.weight", "2.weight", "2.bias"]
    assert fresh.load_state_dict(state, strict=True)
    x = torch.randn(3, 6)
    assert torch.equal(fresh(x), pruned(x))
    assert torch.equal(fresh[2].weight, pruned[2].weight)
    assert lp.prepare_for_state_dict(fresh, state) == []  # already matching


def test_prepare_pruned_model_for_plain_checkpoint() -> None:
    plain = mlp(seed=1)
    model = mlp(seed=2)
    weight = model[0].weight
    lp.l1_unstructured(model[0], "weight", amount=10)
    lp.l1_unstructured(model[4], "bias", amount=1)
    state = plain.state_dict()
    assert lp.prepare_for_state_dict(model, state) == ["0.weight", "4.bias"]
    assert not lp.is_pruned(model)
    model.load_state_dict(state, strict=True)
    assert model[0].weight is weight
    assert torch.equal(model[0].weight, plain[0].weight)


def test_prepare_keeps_mask_dtype_and_prefix() -> None:
    with lp.mask_dtype(torch.bool):
        pruned = lp.l1_unstructured(nn.Linear(4, 3), "weight", amount=4)
    state = {"model.layer." + k: v for k, v in pruned.state_dict().items()}
    wrapper = nn.Module()
    wrapper.layer = nn.Linear(4, 3)
    assert lp.prepare_for_state_dict(wrapper, state, prefix="model.") == ["model.layer.weight"]
    assert wrapper.layer.weight_mask.dtype == torch.bool
    wrapper.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})
    assert torch.equal(wrapper.layer.weight, pruned.weight)


def test_prepare_for_an_integer_parameters_checkpoint() -> None:
    # regression: prepare used the saved mask's dtype as the mask dtype setting, which refuses integer dtypes
    def build() -> nn.Module:
        module = nn.Module()
        module.table = nn.Parameter(torch.tensor([[3, -1, 4], [1, -5, 9]]), requires_grad=False)
        return module

    source = lp.l1_unstructured(build(), "table", amount=2)
    assert source.table_mask.dtype == torch.int64
    target = build()
    assert lp.prepare_for_state_dict(target, source.state_dict()) == ["table"]
    target.load_state_dict(source.state_dict())
    assert target.table_mask.dtype == torch.int64 and torch.equal(target.table, source.table)


def test_prepare_leaves_a_buffer_named_like_a_mask_alone() -> None:
    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.Linear(3, 3)
            self.register_buffer("attn_mask", torch.tril(torch.ones(3, 3)))

    source = Attention()
    lp.l1_unstructured(source.attn, "weight", amount=2)
    state = source.state_dict()
    assert "attn_mask" in state and "attn.weight_mask" in state
    target = Attention()
    assert lp.prepare_for_state_dict(target, state) == ["attn.weight"]
    assert target.load_state_dict(state, strict=True)
    assert torch.equal(target.attn_mask, torch.tril(torch.ones(3, 3)))
    back = Attention()
    assert lp.prepare_for_state_dict(target, back.state_dict()) == ["attn.weight"]
    assert target.load_state_dict(back.state_dict(), strict=True)


def test_prepare_lines_up_optimizer_state() -> None:
    model = mlp(seed=3)
    lp.l1_unstructured(model[0], "weight", amount=10)
    lp.l1_unstructured(model[4], "bias", amount=1)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(8, 6)).pow(2).sum().backward()
    optimizer.step()
    state, opt_state = model.state_dict(), copy.deepcopy(optimizer.state_dict())

    fresh = mlp(seed=4)
    lp.prepare_for_state_dict(fresh, state)
    fresh.load_state_dict(state)
    resumed = torch.optim.Adam(fresh.parameters(), lr=0.1)
    resumed.load_state_dict(opt_state)
    for p_fresh, p_model in zip(fresh.parameters(), model.parameters(), strict=True):
        assert p_fresh.shape == p_model.shape
        assert resumed.state[p_fresh]["exp_avg"].shape == p_fresh.shape
        assert torch.equal(resumed.state[p_fresh]["exp_avg"], optimizer.state[p_model]["exp_avg"])
    # and a step on the resumed model equals a step on the original
    x = torch.randn(8, 6)
    for m, opt in ((model, optimizer), (fresh, resumed)):
        opt.zero_grad()
        m(x).pow(2).sum().backward()
        opt.step()
    for p_fresh, p_model in zip(fresh.parameters(), model.parameters(), strict=True):
        assert torch.equal(p_fresh, p_model)


def test_global_unstructured_masks_a_tied_parameter_once_in_every_owner() -> None:
    torch.manual_seed(0)
    embed, head, other = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False), torch.nn.Linear(4, 4)
    head.weight = embed.weight  # tied, as GPT-2's lm_head and wte
    pairs = [(embed, "weight"), (head, "weight"), (other, "weight")]
    lp.global_unstructured(pairs, pruning_method=lp.L1Unstructured, amount=0.5)
    assert embed.weight_orig is head.weight_orig
    assert embed.weight_mask is head.weight_mask  # one mask, shared
    assert torch.equal(embed.weight, head.weight)
    # counted once: half of the 40 + 16 distinct entries, ranked over the distinct entries only
    pruned = int((embed.weight_mask == 0).sum()) + int((other.weight_mask == 0).sum())
    assert pruned == 28
    values = torch.cat([embed.weight_orig.detach().flatten(), other.weight_orig.detach().flatten()]).abs()
    threshold = values.sort().values[27]
    assert bool((embed.weight_orig.detach().abs()[embed.weight_mask == 0] <= threshold).all())
    for module in (embed, head, other):
        lp.remove(module, "weight")
    assert head.weight is embed.weight  # the tie survives remove


@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.bool])
def test_global_unstructured_over_tied_owners_pruned_apart_brings_nothing_back(mask_dtype) -> None:
    """Owners of a tied Parameter with their own masks: the global call ranks what all of them keep."""
    torch.manual_seed(0)
    embed, head = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16, bias=False)
    head.weight = embed.weight
    with lp.mask_dtype(mask_dtype):
        lp.l1_unstructured(embed, "weight", amount=0.2)
        lp.random_unstructured(head, "weight", amount=0.5)
    kept_by_both = (embed.weight_mask != 0) & (head.weight_mask != 0)
    lp.global_unstructured([(embed, "weight"), (head, "weight")], pruning_method=lp.L1Unstructured, amount=4)
    assert embed.weight_mask is head.weight_mask
    kept = embed.weight_mask != 0
    assert not bool((kept & ~kept_by_both).any())  # nothing pruned through either owner comes back
    assert int(kept.sum()) == int(kept_by_both.sum()) - 4
    dropped = kept_by_both & ~kept  # the 4 smallest magnitudes among the entries both kept
    magnitudes = embed.weight_orig.detach().abs()
    assert float(magnitudes[dropped].max()) <= float(magnitudes[kept].min())


def test_global_unstructured_reads_a_tied_parameters_scores_under_any_owner() -> None:
    torch.manual_seed(0)
    embed, head = torch.nn.Embedding(6, 4), torch.nn.Linear(4, 6, bias=False)
    head.weight = embed.weight
    scores = torch.arange(24.0).reshape(6, 4)  # the first entries rank lowest, whatever the weights
    pairs = [(embed, "weight"), (head, "weight")]
    lp.global_unstructured(
        pairs, pruning_method=lp.L1Unstructured, amount=5, importance_scores={(head, "weight"): scores}
    )
    assert (embed.weight_mask.flatten() == 0).nonzero().flatten().tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match=r"importance_scores differ for two owners of one tied Parameter"):
        lp.global_unstructured(
            pairs, pruning_method=lp.L1Unstructured, amount=1,
            importance_scores={(embed, "weight"): scores, (head, "weight"): -scores},
        )  # fmt: skip
    assert int((embed.weight_mask == 0).sum()) == 5  # the refused call changed nothing


def test_global_unstructured_over_tied_owners_equals_torch_over_the_distinct_tensors() -> None:
    """Differential: giving a tied Parameter under both owners prunes what torch prunes given it once."""
    torch.manual_seed(1)
    embed, head, other = torch.nn.Embedding(12, 6), torch.nn.Linear(6, 12, bias=False), torch.nn.Linear(6, 5)
    head.weight = embed.weight
    reference_embed, reference_other = copy.deepcopy(embed), copy.deepcopy(other)
    lp.global_unstructured(
        [(embed, "weight"), (head, "weight"), (other, "weight")], pruning_method=lp.L1Unstructured, amount=0.4
    )
    tp.global_unstructured(
        [(reference_embed, "weight"), (reference_other, "weight")], pruning_method=tp.L1Unstructured, amount=0.4
    )
    assert torch.equal(embed.weight_mask.to(reference_embed.weight_mask.dtype), reference_embed.weight_mask)
    assert torch.equal(other.weight_mask.to(reference_other.weight_mask.dtype), reference_other.weight_mask)
    assert torch.equal(head.weight, reference_embed.weight)


@pytest.mark.parametrize(
    "prune_it",
    [
        lambda m: lp.l1_unstructured(m, "weight", amount=0.5),
        lambda m: lp.random_unstructured(m, "weight", amount=3),
        lambda m: lp.ln_structured(m, "weight", amount=1, n=2, dim=0),
        lambda m: lp.random_structured(m, "weight", amount=0.5, dim=1),
    ],
)
def test_a_meta_skeleton_is_pruned_then_filled_from_a_pruned_state_dict(prune_it) -> None:
    """Torch's pattern: prune a model built on ``meta``, ``to_empty``, load a pruned checkpoint into it."""
    torch.manual_seed(0)
    source = nn.Linear(4, 3)
    prune_it(source)
    with torch.device("meta"):
        skeleton = nn.Linear(4, 3)
    prune_it(skeleton)
    assert skeleton.weight_mask.is_meta and sorted(skeleton.state_dict()) == sorted(source.state_dict())
    skeleton.to_empty(device="cpu")
    skeleton.load_state_dict(source.state_dict())
    x = torch.randn(2, 4)
    assert torch.equal(skeleton(x), source(x))


def test_global_unstructured_takes_pairs_as_lists_as_torch_does() -> None:
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    lp.global_unstructured([[net[0], "weight"], [net[1], "weight"]], lp.L1Unstructured, amount=12)
    assert int((net[0].weight == 0).sum() + (net[1].weight == 0).sum()) == 12


@pytest.mark.parametrize("mask_dtype", [None, torch.bool])
@pytest.mark.parametrize("channels", [4, 64])  # 64: a weight large enough for the bit-select path of bool masks
def test_a_channels_last_weight_keeps_its_layout(mask_dtype: torch.dtype | None, channels: int) -> None:
    conv = nn.Conv2d(channels, channels, 3).to(memory_format=torch.channels_last)
    with lp.mask_dtype(mask_dtype):
        lp.l1_unstructured(conv, "weight", amount=0.5)
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    lp.remove(conv, "weight")
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert int((conv.weight == 0).sum()) == conv.weight.numel() // 2


def test_pruning_again_under_a_parametrized_orig_is_refused_naming_it() -> None:
    from torch.nn.utils import parametrize

    layer = lp.l1_unstructured(nn.Linear(4, 3), "weight", amount=5)
    mask = layer.weight_mask.clone()
    parametrize.register_parametrization(layer, "weight_orig", nn.Identity())
    with pytest.raises(ValueError, match=r"'weight_orig' of ParametrizedLinear is not a plain Parameter"):
        lp.l1_unstructured(layer, "weight", amount=2)
    assert torch.equal(layer.weight_mask, mask)
