"""Unit tests of ``lightprune.prune.base``: the reparametrization, BasePruningMethod, PruningContainer, mask dtypes.

The reparametrization is torch's (so checkpoints move both ways); the one deliberate difference is that
``name_orig`` keeps ``name``'s position among the parameters (torch appends it), so ``module.parameters()`` keeps
its order through pruning and ``remove``.
"""

from __future__ import annotations

import copy
import pickle
from typing import Any
from unittest import mock

import pytest
import torch
from torch import Tensor, nn
from torch.nn.utils import prune as tp

from lightprune import prune as lp
from lightprune.prune import _reparam, base


def linear(in_features: int = 4, out_features: int = 3, seed: int = 0, **kwargs) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, **kwargs)


def net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(2, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(16, 3), nn.BatchNorm1d(3))


class EveryOther(lp.BasePruningMethod):
    """A user's method: prunes every other entry still unpruned (flat order)."""

    PRUNING_TYPE = "unstructured"

    def compute_mask(self, t: Tensor, default_mask: Tensor) -> Tensor:
        mask = default_mask.clone()
        mask.view(-1)[::2] = 0
        return mask


class TorchEveryOther(tp.BasePruningMethod):
    PRUNING_TYPE = "unstructured"

    def compute_mask(self, t: Tensor, default_mask: Tensor) -> Tensor:
        mask = default_mask.clone()
        mask.view(-1)[::2] = 0
        return mask


# --------------------------------------------------------------------------------------------------------------
# Mask dtype setting
# --------------------------------------------------------------------------------------------------------------


def test_mask_dtype_default_is_parameter_dtype() -> None:
    assert lp.get_mask_dtype() is None
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        layer = linear().to(dtype)
        lp.l1_unstructured(layer, "weight", amount=3)
        assert layer.weight_mask.dtype == dtype
        assert layer.weight.dtype == dtype


def test_set_mask_dtype_returns_previous_and_applies() -> None:
    previous = lp.set_mask_dtype(torch.bool)
    try:
        assert previous is None
        assert lp.get_mask_dtype() is torch.bool
        layer = lp.l1_unstructured(linear(), "weight", amount=3)
        assert layer.weight_mask.dtype == torch.bool
        assert int((~layer.weight_mask).sum()) == 3
        assert torch.equal(layer.weight, torch.where(layer.weight_mask, layer.weight_orig, 0.0))
    finally:
        assert lp.set_mask_dtype(previous) is torch.bool
    assert lp.get_mask_dtype() is None


def test_mask_dtype_context_manager_restores_on_exit_and_on_error() -> None:
    with lp.mask_dtype(torch.bool):
        assert lp.get_mask_dtype() is torch.bool
        with lp.mask_dtype(torch.float16):
            assert lp.get_mask_dtype() is torch.float16
        assert lp.get_mask_dtype() is torch.bool
    assert lp.get_mask_dtype() is None
    with pytest.raises(RuntimeError, match="boom"), lp.mask_dtype(torch.bool):
        raise RuntimeError("boom")
    assert lp.get_mask_dtype() is None


def test_float_mask_dtype_setting() -> None:
    with lp.mask_dtype(torch.float16):
        layer = lp.l1_unstructured(linear(), "weight", amount=2)
    assert layer.weight_mask.dtype == torch.float16
    assert layer.weight.dtype == torch.float32
    assert torch.equal(layer.weight, layer.weight_orig * layer.weight_mask.float())


@pytest.mark.parametrize("bad", ["bool", bool, 1, torch.ones(1)])
def test_set_mask_dtype_rejects_non_dtypes(bad: object) -> None:
    with pytest.raises(TypeError, match=r"mask dtype must be a torch.dtype or None"):
        lp.set_mask_dtype(bad)  # type: ignore[arg-type]
    assert lp.get_mask_dtype() is None


@pytest.mark.parametrize("bad", [torch.int64, torch.uint8, torch.int8, torch.complex64])
def test_set_mask_dtype_rejects_integer_and_complex_dtypes(bad: torch.dtype) -> None:
    # regression: an integer mask dtype was accepted and truncated fractional masks to 0 without a word
    with pytest.raises(ValueError, match=rf"mask dtype must be torch.bool, a floating dtype or None .* got {bad}"):
        lp.set_mask_dtype(bad)
    with pytest.raises(ValueError, match=r"mask dtype must be torch.bool"), lp.mask_dtype(bad):
        pass
    assert lp.get_mask_dtype() is None


def test_a_tensor_keeps_its_first_mask_dtype() -> None:
    layer = linear(8, 8)
    with lp.mask_dtype(torch.bool):
        lp.l1_unstructured(layer, "weight", amount=10)
    lp.l1_unstructured(layer, "weight", amount=10)  # default setting now, the mask stays bool
    assert layer.weight_mask.dtype == torch.bool
    assert int((~layer.weight_mask).sum()) == 20
    other = linear(8, 8)
    lp.random_unstructured(other, "weight", amount=10)
    with lp.mask_dtype(torch.bool):
        lp.ln_structured(other, "weight", amount=1, n=1, dim=0)
        lp.global_unstructured([(other, "weight"), (layer, "weight")], lp.L1Unstructured, amount=4)
    assert other.weight_mask.dtype == torch.float32
    assert layer.weight_mask.dtype == torch.bool


def test_bool_mask_rejects_fractional_custom_mask() -> None:
    fractional = torch.full((3, 4), 0.5)
    with lp.mask_dtype(torch.bool):
        layer = linear()
        with pytest.raises(ValueError, match=r"values other than 0 and 1, which a torch.bool mask cannot store"):
            lp.custom_from_mask(layer, "weight", fractional)
        assert not lp.is_pruned(layer)
        assert "weight" in layer._parameters
        lp.l1_unstructured(layer, "weight", amount=1)
    with pytest.raises(ValueError, match=r"set_mask_dtype\(None\)"):
        lp.custom_from_mask(layer, "weight", fractional)  # later call: the tensor's mask is bool
    assert layer.weight_mask.dtype == torch.bool
    assert int((~layer.weight_mask).sum()) == 1
    # 0/1 masks of any dtype are fine
    lp.custom_from_mask(layer, "weight", torch.eye(3, 4, dtype=torch.int64))
    assert int(layer.weight_mask.sum()) <= 3


def test_float_mask_keeps_fractions_like_torch() -> None:
    a, b = linear(), linear()
    mask = torch.full((3, 4), 0.5)
    tp.custom_from_mask(a, "weight", mask)
    lp.custom_from_mask(b, "weight", mask)
    assert torch.equal(a.weight_mask, b.weight_mask)
    assert torch.equal(a.weight, b.weight)


# --------------------------------------------------------------------------------------------------------------
# The reparametrization, and torch compatibility of its state
# --------------------------------------------------------------------------------------------------------------


def test_reparametrization_is_torchs() -> None:
    layer = linear()
    weight = layer.weight
    hook = lp.L1Unstructured.apply(layer, "weight", amount=5)
    assert isinstance(hook, lp.L1Unstructured)
    assert layer._parameters["weight_orig"] is weight  # the same Parameter object
    assert "weight" not in layer._parameters
    assert isinstance(layer.weight_mask, Tensor) and "weight_mask" in layer._buffers
    assert list(layer._forward_pre_hooks.values()) == [hook]
    assert hook._tensor_name == "weight"
    assert not isinstance(layer.weight, nn.Parameter)
    assert torch.equal(layer.weight, layer.weight_orig * layer.weight_mask)
    assert layer.weight.grad_fn is not None  # gradients reach weight_orig
    layer(torch.randn(2, 4)).sum().backward()
    assert weight.grad is not None
    assert bool((weight.grad[layer.weight_mask == 0] == 0).all())


def test_state_dict_keys_buffers_and_hooks_match_torch() -> None:
    a, b = net(), net()
    for pruner in (tp, lp):
        model = a if pruner is tp else b
        pruner.l1_unstructured(model[0], "weight", amount=0.3)
        pruner.ln_structured(model[3], "weight", amount=1, n=2, dim=0)
        pruner.random_unstructured(model[3], "bias", amount=1)
        pruner.l1_unstructured(model[0], "weight", amount=0.3)
        pruner.identity(model[4], "weight")
    assert set(a.state_dict()) == set(b.state_dict())
    assert {n for n, _ in a.named_buffers()} == {n for n, _ in b.named_buffers()}
    assert {n for n, _ in a.named_parameters()} == {n for n, _ in b.named_parameters()}
    for ma, mb in zip(a.modules(), b.modules(), strict=True):
        assert [type(h).__name__ for h in ma._forward_pre_hooks.values()] == [
            type(h).__name__ for h in mb._forward_pre_hooks.values()
        ]
        for ha, hb in zip(ma._forward_pre_hooks.values(), mb._forward_pre_hooks.values(), strict=True):
            assert ha._tensor_name == hb._tensor_name
            if isinstance(ha, tp.PruningContainer):
                assert [type(m).__name__ for m in ha] == [type(m).__name__ for m in hb]


def test_parameter_order_is_kept_by_pruning_and_remove() -> None:
    model = net()
    before = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    lp.l1_unstructured(model[3], "bias", amount=1)
    lp.l1_unstructured(model[0], "weight", amount=3)
    lp.l1_unstructured(model[3], "weight", amount=3)
    lp.l1_unstructured(model[3], "weight", amount=3)  # a container now
    lp.global_unstructured([(model[0], "bias"), (model[4], "weight")], lp.L1Unstructured, amount=2)
    after = list(model.parameters())
    assert len(after) == len(before) and all(p is q for p, q in zip(before, after, strict=True))
    pruned_names = [n for n, _ in model.named_parameters()]
    assert [n.removesuffix("_orig") for n in pruned_names] == names
    # torch appends name_orig: its order changes (the deliberate difference)
    theirs = net()
    tp.l1_unstructured(theirs[3], "bias", amount=1)
    assert [n for n, _ in theirs.named_parameters()] != names
    for module, name in [(model[3], "weight"), (model[0], "bias"), (model[3], "bias"), (model[0], "weight")]:
        lp.remove(module, name)
    lp.remove(model[4], "weight")
    assert [n for n, _ in model.named_parameters()] == names
    assert all(p is q for p, q in zip(before, model.parameters(), strict=True))


def _prune_all(pruner, model: nn.Sequential) -> None:
    pruner.l1_unstructured(model[0], "weight", amount=0.4)
    pruner.ln_structured(model[3], "weight", amount=1, n=1, dim=0)
    pruner.l1_unstructured(model[0], "weight", amount=5)
    pruner.custom_from_mask(model[3], "bias", torch.tensor([1.0, 0.0, 1.0]))


@pytest.mark.parametrize("direction", ["torch->lightprune", "lightprune->torch"])
def test_checkpoints_move_between_torch_and_lightprune(direction: str) -> None:
    source, target = net(seed=1), net(seed=2)
    src_pruner, dst_pruner = (tp, lp) if direction == "torch->lightprune" else (lp, tp)
    _prune_all(src_pruner, source)
    _prune_all(dst_pruner, target)
    state = source.state_dict()
    assert set(state) == set(target.state_dict())
    result = target.load_state_dict(state, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    for key, value in target.state_dict().items():
        assert torch.equal(value, state[key]), key
    source.eval()
    target.eval()
    x = torch.randn(5, 2, 4, 4)
    assert torch.equal(source(x), target(x))
    assert torch.equal(source[0].weight, target[0].weight)


def test_bool_mask_checkpoint_loads_into_a_float_mask_model() -> None:
    with lp.mask_dtype(torch.bool):
        source = lp.l1_unstructured(linear(), "weight", amount=5)
    target = lp.l1_unstructured(linear(seed=3), "weight", amount=5)
    target.load_state_dict(source.state_dict())
    assert target.weight_mask.dtype == torch.float32
    assert torch.equal(target.weight, source.weight)


# --------------------------------------------------------------------------------------------------------------
# The pruned attribute
# --------------------------------------------------------------------------------------------------------------


def test_pruned_attribute_behaves_as_a_tensor() -> None:
    layer = lp.l1_unstructured(linear(), "weight", amount=5)
    w = layer.weight
    assert isinstance(w, Tensor)
    assert type(w + 1) is Tensor  # torch functions see a regular tensor
    assert repr(w).startswith("tensor(")
    copied = copy.deepcopy(w)
    assert type(copied) is Tensor and not copied.requires_grad and torch.equal(copied, w)
    loaded = pickle.loads(pickle.dumps(w))
    assert torch.equal(loaded, w)


def test_a_pruned_module_is_freed_when_its_last_reference_goes() -> None:
    """The module's own _apply and __reduce_ex__ held it strongly: a dropped pruned model (its weights and masks, on
    a GPU too) stayed alive until Python's cyclic collector ran. They hold it weakly; copies still act on
    themselves."""
    import copy
    import gc
    import weakref

    enabled = gc.isenabled()
    gc.disable()
    try:
        layer = lp.l1_unstructured(linear(), "weight", amount=5)
        layer(torch.randn(2, 4))
        twin = copy.deepcopy(layer).double()  # the copy's _apply recomputes the copy's attribute
        assert twin.weight.dtype == torch.float64 and torch.equal(twin.weight, layer.weight.double())
        module, weight = weakref.ref(layer), weakref.ref(layer.weight_orig)
        del layer
        assert module() is None and weight() is None
    finally:
        if enabled:
            gc.enable()


@pytest.mark.parametrize("how", ["copy", "deepcopy", "pickle"])
def test_a_copied_pruned_module_converts_itself_after_the_original_is_gone(how: str) -> None:
    """A shallow copy.copy took the original's own _apply: converting the copy recomputed the original's attribute
    (the copy's stayed float32), and once the original was gone it failed. Every copy has helpers of its own."""
    import copy

    layer = lp.l1_unstructured(linear(), "weight", amount=5)
    expected = layer.weight.detach().double()
    copies = {"copy": copy.copy, "deepcopy": copy.deepcopy, "pickle": lambda m: pickle.loads(pickle.dumps(m))}
    twin = copies[how](layer)
    del layer
    twin.double()
    assert twin.weight.dtype == torch.float64 and torch.equal(twin.weight, expected)
    assert twin(torch.randn(2, 4, dtype=torch.float64)).dtype == torch.float64


@pytest.mark.parametrize("kind", ["linear", "lstm"])
def test_a_pruned_module_goes_through_torch_multiprocessing_pickler(kind: str) -> None:
    """ddp_spawn and mp.Queue pickle with torch.multiprocessing's ForkingPickler, which dispatches tensors by type
    and refuses a non-leaf one that requires grad (torch's pruned modules cannot be sent): the module's own
    __reduce_ex__ hands it the detached values, also those an RNN lists in its _flat_weights."""
    import io
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing

    module: nn.Module = linear() if kind == "linear" else nn.LSTM(3, 4)
    name = "weight" if kind == "linear" else "weight_hh_l0"
    lp.l1_unstructured(module, name, amount=5)
    x = torch.randn(2, 4) if kind == "linear" else torch.randn(5, 2, 3)

    def output(m: nn.Module) -> Tensor:
        out = m(x)
        return out if kind == "linear" else out[0]

    expected = output(module)
    buffer = io.BytesIO()
    ForkingPickler(buffer, pickle.HIGHEST_PROTOCOL).dump(module)
    buffer.seek(0)
    copied = pickle.load(buffer)
    assert lp.is_pruned(copied) and torch.equal(getattr(copied, name), getattr(module, name))
    assert torch.equal(output(copied), expected)
    lp.remove(module, name)
    assert "__reduce_ex__" not in vars(module)  # a plain module again


# --------------------------------------------------------------------------------------------------------------
# BasePruningMethod
# --------------------------------------------------------------------------------------------------------------


def test_base_pruning_method_is_abstract() -> None:
    with pytest.raises(TypeError, match="abstract"):
        lp.BasePruningMethod()  # type: ignore[abstract]


def test_compute_mask_of_a_subclass() -> None:
    mask = EveryOther().compute_mask(torch.randn(2, 3), torch.ones(2, 3))
    assert mask.tolist() == [[0, 1, 0], [1, 0, 1]]


def test_apply_returns_the_hook_and_prunes() -> None:
    layer = linear()
    hook = EveryOther.apply(layer, "weight")
    assert isinstance(hook, EveryOther)
    assert list(layer._forward_pre_hooks.values()) == [hook]
    assert layer.weight_mask.view(-1).tolist() == [0, 1] * 6


def test_user_method_composes_like_torch_on_repeated_application() -> None:
    ours, theirs = linear(8, 4), linear(8, 4)
    for _ in range(3):
        hook = EveryOther.apply(ours, "weight")
        TorchEveryOther.apply(theirs, "weight")
        assert torch.equal(ours.weight_mask, theirs.weight_mask)
        assert torch.equal(ours.weight, theirs.weight)
    assert isinstance(hook, lp.PruningContainer) and len(hook) == 3
    assert int(ours.weight_mask.sum()) == 4  # 32 -> 16 -> 8 -> 4
    with lp.mask_dtype(torch.bool):
        flagged = linear(8, 4)
        EveryOther.apply(flagged, "weight")
        EveryOther.apply(flagged, "weight")
    assert flagged.weight_mask.dtype == torch.bool
    assert torch.equal(flagged.weight_mask.float(), linear_mask_after(2))


def linear_mask_after(times: int) -> Tensor:
    layer = linear(8, 4)
    for _ in range(times):
        TorchEveryOther.apply(layer, "weight")
    return layer.weight_mask


@pytest.mark.parametrize("scores_dtype", [torch.float64, torch.int64, torch.float16])
def test_user_method_default_mask_has_the_parameters_dtype_like_torch(scores_dtype: torch.dtype) -> None:
    # regression: the first call's default_mask took the importance scores' dtype (torch: the parameter's), so a
    # method scaling it got an integer mask for integer scores
    seen = {}

    def halving(base_class: type) -> type:
        class Halve(base_class):
            PRUNING_TYPE = "unstructured"

            def compute_mask(self, t: Tensor, default_mask: Tensor) -> Tensor:
                seen.setdefault(base_class, []).append(default_mask.dtype)
                return default_mask * 0.5

        return Halve

    scores = torch.ones(3, 4, dtype=scores_dtype)
    ours, theirs = linear(), linear()
    for _ in range(2):
        halving(lp.BasePruningMethod).apply(ours, "weight", importance_scores=scores)
        halving(tp.BasePruningMethod).apply(theirs, "weight", importance_scores=scores)
        assert torch.equal(ours.weight_mask, theirs.weight_mask.to(ours.weight_mask.dtype))
    assert seen[lp.BasePruningMethod] == seen[tp.BasePruningMethod]
    assert seen[lp.BasePruningMethod][0] == torch.float32
    assert ours.weight_mask.dtype == torch.float32  # torch's turns int64 on the second call (#57631)


def test_user_structured_method_needs_dim_on_repeated_application() -> None:
    class FirstRow(lp.BasePruningMethod):
        PRUNING_TYPE = "structured"

        def compute_mask(self, t: Tensor, default_mask: Tensor) -> Tensor:
            mask = default_mask.clone()
            mask[0] = 0
            return mask

    layer = linear(3, 3)
    FirstRow.apply(layer, "weight")
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    with pytest.raises(AttributeError, match=r'PRUNING_TYPE "structured" need an attribute `dim`'):
        FirstRow.apply(layer, "weight")
    assert all(torch.equal(v, state[k]) for k, v in layer.state_dict().items())

    class FirstRowDim(FirstRow):
        dim = 0

    layer = linear(3, 3)
    FirstRowDim.apply(layer, "weight")
    FirstRowDim.apply(layer, "weight")  # acts on the channels left: rows 1 and 2, prunes row 1
    assert layer.weight_mask.sum(dim=1).tolist() == [0, 0, 3]


def test_user_method_of_unknown_type_fails_on_repeated_application() -> None:
    class Weird(lp.BasePruningMethod):
        PRUNING_TYPE = "weird"

        def compute_mask(self, t: Tensor, default_mask: Tensor) -> Tensor:
            return default_mask

    layer = linear()
    Weird.apply(layer, "weight")
    with pytest.raises(ValueError, match=r"unrecognized PRUNING_TYPE 'weird': allowed are"):
        Weird.apply(layer, "weight")
    assert isinstance(next(iter(layer._forward_pre_hooks.values())), Weird)


def test_user_global_method_sees_the_whole_tensor() -> None:
    class LastEntry(lp.BasePruningMethod):
        PRUNING_TYPE = "global"

        def compute_mask(self, t: Tensor, default_mask: Tensor) -> Tensor:
            mask = default_mask.clone()
            mask.view(-1)[-1] = 0
            return mask

    layer = linear(3, 3)
    LastEntry.apply(layer, "weight")
    LastEntry.apply(layer, "weight")
    assert layer.weight_mask.view(-1).tolist() == [1] * 8 + [0]


def test_subclass_overriding_compute_mask_is_used_instead_of_the_fast_path() -> None:
    calls = []

    class FirstEntry(lp.L1Unstructured):
        def compute_mask(self, t: Tensor, default_mask: Tensor) -> Tensor:
            calls.append(t.shape)
            mask = default_mask.clone()
            mask.view(-1)[0] = 0
            return mask

    layer = linear(3, 3)
    FirstEntry.apply(layer, "weight", amount=0.5)
    assert layer.weight_mask.view(-1).tolist() == [0] + [1] * 8
    FirstEntry.apply(layer, "weight", amount=0.5)  # torch's container: acts on the 8 entries left
    assert layer.weight_mask.view(-1).tolist() == [0, 0] + [1] * 7
    assert calls == [torch.Size([3, 3]), torch.Size([8])]
    assert not base._has_fast_path(FirstEntry(amount=1))
    assert base._has_fast_path(lp.L1Unstructured(amount=1))

    class Renamed(lp.L1Unstructured):  # no override: the fast path stays
        pass

    assert base._has_fast_path(Renamed(amount=1))


FAST_METHODS = ["L1Unstructured", "RandomUnstructured", "LnStructured", "RandomStructured", "Identity"]
ARGS = {
    "L1Unstructured": {"amount": 2},
    "RandomUnstructured": {"amount": 2},
    "LnStructured": {"amount": 1, "n": 2, "dim": 0},
    "RandomStructured": {"amount": 1, "dim": 0},
    "Identity": {},
}


def _first_entry(t: Tensor, default_mask: Tensor) -> Tensor:
    """A replacement compute_mask: prune the first entry (flat order), whatever the method's own rule."""
    mask = default_mask.clone()
    mask.view(-1)[0] = 0
    return mask


@pytest.mark.parametrize("name", FAST_METHODS)
def test_a_mocked_compute_mask_is_called_instead_of_the_fast_path(name: str) -> None:
    # torch always calls compute_mask, so tests (torch's own among them) replace it with unittest.mock.patch
    cls, kwargs = getattr(lp, name), ARGS[name]
    layer = linear()
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0]] * 3)
    with mock.patch.object(cls, "compute_mask", return_value=mask) as patched:
        assert not base._has_fast_path(cls(**kwargs))
        cls.apply(layer, "weight", **kwargs)
    patched.assert_called_once()
    assert torch.equal(layer.weight_mask, mask)
    assert base._has_fast_path(cls(**kwargs))  # the original is back: so is the fast path


@pytest.mark.parametrize("name", FAST_METHODS)
def test_a_monkey_patched_compute_mask_is_called_like_torch_calls_it(name: str) -> None:
    ours, theirs = linear(), linear()
    replacement = lambda self, t, default_mask: _first_entry(t, default_mask)  # noqa: E731
    owners = [next(k for k in getattr(impl, name).__mro__ if "compute_mask" in k.__dict__) for impl in (lp, tp)]
    saved = [owner.__dict__["compute_mask"] for owner in owners]
    try:
        for owner in owners:
            owner.compute_mask = replacement
        for _ in range(2):  # the second call goes through the container rule: the replacement sees what is left
            getattr(lp, name).apply(ours, "weight", **ARGS[name])
            getattr(tp, name).apply(theirs, "weight", **ARGS[name])
            assert torch.equal(ours.weight_mask, theirs.weight_mask)
    finally:
        for owner, original in zip(owners, saved, strict=True):
            owner.compute_mask = original
    assert int((ours.weight_mask == 0).sum()) >= 1
    assert base._has_fast_path(getattr(lp, name)(**ARGS[name]))

    method = getattr(lp, name)(**ARGS[name])
    method.compute_mask = _first_entry  # on the instance only
    assert not base._has_fast_path(method)
    container = lp.PruningContainer(method)
    assert container.compute_mask(torch.ones(3, 4), torch.ones(3, 4)).view(-1).tolist() == [0.0] + [1.0] * 11
    assert base._has_fast_path(getattr(lp, name)(**ARGS[name]))  # other instances keep it


def test_a_mocked_compute_mask_is_called_by_global_unstructured() -> None:
    a, b = linear(seed=1), linear(seed=2)
    calls = []

    def replacement(self, t: Tensor, default_mask: Tensor) -> Tensor:
        calls.append(tuple(t.shape))
        mask = default_mask.clone()
        mask[:5] = 0
        return mask

    with mock.patch.object(lp.L1Unstructured, "compute_mask", replacement):
        lp.global_unstructured([(a, "weight"), (b, "weight")], lp.L1Unstructured, amount=3)
    assert calls == [(24,)]
    assert a.weight_mask.view(-1).tolist() == [0] * 5 + [1] * 7 and b.weight_mask.eq(1).all()


def test_a_failing_mocked_compute_mask_leaves_the_module_untouched() -> None:
    layer = linear()
    with (
        mock.patch.object(lp.L1Unstructured, "compute_mask", side_effect=RuntimeError("boom")),
        pytest.raises(RuntimeError, match="boom"),
    ):
        lp.l1_unstructured(layer, "weight", amount=2)
    assert "weight" in layer._parameters and not lp.is_pruned(layer)


def test_container_compute_mask_has_ts_dtype_like_torch() -> None:
    # torch's container converts the mask to t's dtype before writing the new partial mask into it
    t = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    default = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 1]])
    for ours, theirs in (
        (lp.PruningContainer(lp.L1Unstructured(2)), _torch_container(tp.L1Unstructured(2))),
        (lp.PruningContainer(EveryOther()), _torch_container(TorchEveryOther())),
        (lp.PruningContainer(lp.LnStructured(1, n=2, dim=0)), _torch_container(tp.LnStructured(1, n=2, dim=0))),
    ):
        for t_dtype in (torch.float32, torch.float64, torch.float16):
            mask = ours.compute_mask(t.to(t_dtype), default)
            expected = theirs.compute_mask(t.to(t_dtype), default.clone())
            assert mask.dtype == expected.dtype == t_dtype
            assert torch.equal(mask, expected)
    # a bool default_mask (a mask stored as bool) stays bool
    flagged = lp.PruningContainer(lp.L1Unstructured(2)).compute_mask(t, default.bool())
    assert flagged.dtype == torch.bool and flagged.tolist() == [[0, 0, 1, 0], [1, 1, 0, 1]]


def test_apply_mask_float_and_bool() -> None:
    layer = lp.custom_from_mask(linear(), "weight", torch.tensor([[1.0, 0.0, 0.5, 1.0]] * 3))
    hook = next(iter(layer._forward_pre_hooks.values()))
    out = hook.apply_mask(layer)
    assert torch.equal(out, layer.weight_orig * layer.weight_mask)
    assert out.requires_grad
    with lp.mask_dtype(torch.bool):
        flagged = lp.custom_from_mask(linear(), "weight", torch.tensor([[1, 0, 0, 1]] * 3))
    with torch.no_grad():
        flagged.weight_orig.fill_(float("inf"))
    out = next(iter(flagged._forward_pre_hooks.values())).apply_mask(flagged)
    assert out.dtype == torch.float32
    assert out[:, 1:3].eq(0).all() and out[:, [0, 3]].isinf().all()


class FunctionalLinear(nn.Module):
    """Not a torch.nn leaf: torch.fx traces into it, and so through its pruning hook."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 4))

    def forward(self, x: Tensor) -> Tensor:
        return nn.functional.linear(x, self.weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_apply_mask_traces_with_torch_fx_to_the_same_values(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    with lp.mask_dtype(dtype):
        mask = torch.tensor([[1.0, 0.0, 0.5, 1.0]] * 3) if dtype == torch.float32 else torch.tensor([[1, 0, 0, 1]] * 3)
        module = lp.custom_from_mask(FunctionalLinear(), "weight", mask)
    assert module.weight_mask.dtype == dtype
    if dtype == torch.bool:
        with torch.no_grad():
            module.weight_orig[:, 1] = float("inf")  # a pruned entry: an exact zero with a boolean mask
    traced = torch.fx.symbolic_trace(nn.Sequential(module))  # the root's own hooks are not traced: a child's are
    x = torch.rand(5, 4)
    with torch.no_grad():
        assert torch.equal(traced(x), module(x))
        module.weight_orig.mul_(2)  # the graph masks the current weight_orig, as the hook does
        assert torch.equal(traced(x), module(x))


def test_apply_mask_of_unattached_method_raises() -> None:
    with pytest.raises(ValueError, match=r"L1Unstructured is not attached to a tensor: call apply\(module, name\)"):
        lp.L1Unstructured(amount=1).apply_mask(linear())


def test_call_recomputes_the_pruned_attribute() -> None:
    layer = linear()
    hook = lp.L1Unstructured.apply(layer, "weight", amount=4)
    with torch.no_grad():
        layer.weight_orig.mul_(3)
    assert not torch.equal(layer.weight, layer.weight_orig * layer.weight_mask)
    assert hook(layer, ()) is None
    assert torch.equal(layer.weight, layer.weight_orig * layer.weight_mask)
    with torch.no_grad():
        layer.weight_orig.mul_(3)
    layer(torch.randn(1, 4))  # the forward pre-hook does the same
    assert torch.equal(layer.weight, layer.weight_orig * layer.weight_mask)


def test_prune_without_module_matches_torch() -> None:
    t = torch.tensor([[3.0, -1.0, 2.0], [0.5, -4.0, 0.25]])
    scores = torch.arange(6.0).view(2, 3)
    default = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    for ours, theirs in [
        (lp.L1Unstructured(amount=2), tp.L1Unstructured(amount=2)),
        (lp.LnStructured(amount=1, n=1, dim=0), tp.LnStructured(amount=1, n=1, dim=0)),
        (lp.Identity(), tp.Identity()),
        (lp.CustomFromMask(default), tp.CustomFromMask(default)),
    ]:
        assert torch.equal(ours.prune(t), theirs.prune(t))
        assert torch.equal(ours.prune(t, default_mask=default), theirs.prune(t, default_mask=default))
        assert torch.equal(ours.prune(t, importance_scores=scores), theirs.prune(t, importance_scores=scores))
    with pytest.raises(ValueError, match=r"importance_scores must have the shape of tensor t: got \(3,\) vs \(2, 3\)"):
        lp.L1Unstructured(amount=1).prune(t, importance_scores=torch.ones(3))
    with pytest.raises(TypeError, match=r"importance_scores must be a Tensor, got list"):
        lp.L1Unstructured(amount=1).prune(t, importance_scores=[1.0, 2.0])  # type: ignore[arg-type]


def test_remove_method_keeps_the_parameter_object_and_position() -> None:
    layer = linear()
    weight = layer.weight
    hook = lp.L1Unstructured.apply(layer, "weight", amount=5)
    expected = layer.weight.detach().clone()
    hook.remove(layer)
    assert layer._parameters["weight"] is weight
    assert list(layer._parameters) == ["weight", "bias"]
    assert "weight_mask" not in layer._buffers and "weight_orig" not in layer._parameters
    assert torch.equal(weight, expected)
    assert weight.grad_fn is None and weight.is_leaf


def test_repr_of_methods_and_containers() -> None:
    assert repr(lp.L1Unstructured(amount=0.3)) == "L1Unstructured(amount=0.3)"
    assert repr(lp.LnStructured(amount=2, n="fro", dim=1)) == "LnStructured(amount=2, n='fro', dim=1)"
    assert repr(lp.CustomFromMask(torch.ones(2))) == "CustomFromMask()"
    container = lp.PruningContainer(lp.Identity(), lp.RandomUnstructured(amount=1))
    assert repr(container) == "PruningContainer(Identity(), RandomUnstructured(amount=1))"


# --------------------------------------------------------------------------------------------------------------
# PruningContainer
# --------------------------------------------------------------------------------------------------------------


def test_container_constructors() -> None:
    empty = lp.PruningContainer()
    assert len(empty) == 0 and list(empty) == []
    one = lp.PruningContainer(lp.L1Unstructured(amount=1))
    assert len(one) == 1
    m1, m2, m3 = lp.L1Unstructured(amount=1), lp.RandomUnstructured(amount=1), lp.Identity()
    two = lp.PruningContainer(m1, m2)  # torch raises AttributeError here
    with pytest.raises(AttributeError):
        tp.PruningContainer(tp.L1Unstructured(amount=1), tp.RandomUnstructured(amount=1))
    assert list(two) == [m1, m2]
    from_iterable = lp.PruningContainer([m1, m2, m3])
    assert list(from_iterable) == [m1, m2, m3]
    assert from_iterable[0] is m1 and from_iterable[-1] is m3 and from_iterable[1:] == (m2, m3)
    with pytest.raises(IndexError):
        from_iterable[3]


def test_container_add_pruning_method_errors() -> None:
    container = lp.PruningContainer(lp.L1Unstructured(amount=1))
    with pytest.raises(TypeError, match=r"str is not a BasePruningMethod subclass"):
        container.add_pruning_method("L1Unstructured")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"L1Unstructured is not a BasePruningMethod subclass"):
        container.add_pruning_method(tp.L1Unstructured(amount=1))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"int is not a BasePruningMethod subclass"):
        lp.PruningContainer(3)  # type: ignore[arg-type]
    other = lp.L1Unstructured(amount=1)
    other._tensor_name = "bias"
    with pytest.raises(ValueError, match=r"tensor named None; cannot add a method for 'bias'"):
        container.add_pruning_method(other)
    assert len(container) == 1
    layer = linear()
    hook = lp.L1Unstructured.apply(layer, "weight", amount=1)
    named = lp.PruningContainer(hook)
    assert named._tensor_name == "weight"
    with pytest.raises(ValueError, match=r"'weight'; cannot add a method for None"):
        named.add_pruning_method(lp.Identity())


def test_container_add_none_is_ignored_and_empty_container_takes_the_name() -> None:
    # torch: add_pruning_method(None) is a no-op; an empty torch container has no _tensor_name and fails
    theirs = tp.PruningContainer()
    with pytest.raises(AttributeError):
        theirs.add_pruning_method(tp.Identity())
    container = lp.PruningContainer()
    container.add_pruning_method(None)
    assert len(container) == 0
    method = lp.L1Unstructured(amount=1)
    method._tensor_name = "weight"
    container.add_pruning_method(method)
    assert container._tensor_name == "weight" and list(container) == [method]
    with pytest.raises(ValueError, match=r"'weight'; cannot add a method for None"):
        container.add_pruning_method(lp.Identity())


def test_empty_container_cannot_compute_a_mask() -> None:
    with pytest.raises(ValueError, match=r"PruningContainer is empty"):
        lp.PruningContainer().compute_mask(torch.ones(3), torch.ones(3))


def _torch_container(*methods: tp.BasePruningMethod) -> tp.PruningContainer:
    container = tp.PruningContainer()
    container._tensor_name = None
    for method in methods:
        method._tensor_name = None
        container.add_pruning_method(method)
    return container


def test_container_compute_mask_unstructured_matches_torch() -> None:
    t = torch.tensor([[0.5, -3.0, 2.0, 0.1], [4.0, -0.2, 0.3, 1.5]])
    default = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    ours = lp.PruningContainer(lp.Identity(), lp.L1Unstructured(amount=0.5))
    theirs = _torch_container(tp.Identity(), tp.L1Unstructured(amount=0.5))
    mask = ours.compute_mask(t, default)
    assert torch.equal(mask, theirs.compute_mask(t, default.clone()))  # torch writes into default_mask
    assert mask.tolist() == [[0, 1, 0, 0], [1, 0, 0, 1]]  # 3 of the 6 left, by |t|
    assert mask.dtype == default.dtype
    flagged = ours.compute_mask(t, default.bool())
    assert flagged.dtype == torch.bool and torch.equal(flagged, mask.bool())


def test_container_compute_mask_structured_matches_torch() -> None:
    t = torch.tensor([[1.0, 1.0], [3.0, 0.0], [0.1, 0.2], [5.0, 5.0]])
    default = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [0.0, 0.0]])  # channel 3 already pruned
    ours = lp.PruningContainer(lp.Identity(), lp.LnStructured(amount=2, n=2, dim=0))
    theirs = _torch_container(tp.Identity(), tp.LnStructured(amount=2, n=2, dim=0))
    mask = ours.compute_mask(t, default)
    assert torch.equal(mask, theirs.compute_mask(t, default.clone()))
    assert mask.sum(dim=1).tolist() == [0, 2, 0, 0]
    # a partly pruned channel still counts as a channel
    default = torch.tensor([[0.0, 1.0], [1.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    mask = ours.compute_mask(t, default)
    assert torch.equal(mask, theirs.compute_mask(t, default.clone()))


def test_container_compute_mask_global_matches_torch() -> None:
    t = torch.randn(3, 3)
    default = torch.tensor([[1.0, 0.0, 1.0]] * 3)
    custom = torch.tensor([[1.0, 1.0, 0.0]] * 3)
    ours = lp.PruningContainer(lp.Identity(), lp.CustomFromMask(custom))
    theirs = _torch_container(tp.Identity(), tp.CustomFromMask(custom))
    mask = ours.compute_mask(t, default)
    assert torch.equal(mask, theirs.compute_mask(t, default.clone()))
    assert mask.tolist() == [[1, 0, 0]] * 3


def test_container_uses_only_its_newest_method() -> None:
    t = torch.arange(1.0, 7.0)
    container = lp.PruningContainer(lp.L1Unstructured(amount=5), lp.L1Unstructured(amount=1))
    assert container.compute_mask(t, torch.ones(6)).tolist() == [0, 1, 1, 1, 1, 1]


def test_container_of_two_methods_prunes_random_among_what_is_left() -> None:
    torch.manual_seed(0)
    container = lp.PruningContainer(lp.L1Unstructured(amount=1), lp.RandomUnstructured(amount=2))
    default = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    for _ in range(20):
        mask = container.compute_mask(torch.randn(6), default)
        assert int(mask.sum()) == 2
        assert bool((mask <= default).all())


# --------------------------------------------------------------------------------------------------------------
# Hooks from torch, internal helpers
# --------------------------------------------------------------------------------------------------------------


def test_a_tensor_pruned_by_torch_is_refused_with_advice() -> None:
    layer = linear()
    tp.l1_unstructured(layer, "weight", amount=2)
    with pytest.raises(ValueError, match=r"'weight' of Linear is pruned by torch.nn.utils.prune; .*prune.remove"):
        lp.l1_unstructured(layer, "weight", amount=2)
    assert isinstance(next(iter(layer._forward_pre_hooks.values())), tp.L1Unstructured)
    lp.l1_unstructured(layer, "bias", amount=1)  # another tensor of the same module is fine
    assert lp.is_pruned(layer)


def test_two_hooks_on_one_tensor_is_an_error() -> None:
    layer = linear()
    lp.l1_unstructured(layer, "weight", amount=2)
    stray = lp.Identity()
    stray._tensor_name = "weight"
    layer.register_forward_pre_hook(stray)
    with pytest.raises(RuntimeError, match=r"2 pruning hooks act on 'weight' of Linear"):
        lp.l1_unstructured(layer, "weight", amount=1)


def test_name_must_be_a_string_and_a_parameter() -> None:
    layer = linear()
    layer.register_buffer("running", torch.ones(3))
    with pytest.raises(TypeError, match=r"name must be a str naming a parameter, got 0 \(int\)"):
        lp.l1_unstructured(layer, 0, amount=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"'running' of Linear is a tensor but not a Parameter"):
        lp.l1_unstructured(layer, "running", amount=1)
    with pytest.raises(TypeError, match=r"module must be a torch.nn.Module, got str"):
        lp.l1_unstructured("layer", "weight", amount=1)  # type: ignore[arg-type]
    assert not lp.is_pruned(layer)


def test_importance_scores_shape_is_checked_first_like_torch() -> None:
    # torch asserts the scores' shape before it finds that the name is a buffer; the same order of errors
    # (ValueError where torch raises AssertionError, then TypeError where torch raises TypeError)
    layer = linear()
    layer.register_buffer("running", torch.ones(3))
    with pytest.raises(AssertionError):
        tp.l1_unstructured(copy.deepcopy(layer), "running", amount=1, importance_scores=torch.ones(1, 0))
    with pytest.raises(ValueError, match=r"importance_scores must have the shape of parameter 'running'"):
        lp.l1_unstructured(layer, "running", amount=1, importance_scores=torch.ones(1, 0))
    with pytest.raises(TypeError):
        tp.l1_unstructured(copy.deepcopy(layer), "running", amount=1, importance_scores=torch.ones(3))
    with pytest.raises(TypeError, match=r"'running' of Linear is a tensor but not a Parameter"):
        lp.l1_unstructured(layer, "running", amount=1, importance_scores=torch.ones(3))
    lp.l1_unstructured(layer, "weight", amount=1)
    with pytest.raises(ValueError, match=r"importance_scores must have the shape of parameter 'weight'"):
        lp.ln_structured(layer, "weight", amount=1, n=1, dim=0, importance_scores=torch.ones(4, 3))
    assert not lp.is_pruned(linear()) and lp.is_pruned(layer)


def test_move_key_keeps_the_dict_object() -> None:
    table = {"a": 1, "b": 2, "c": 3}
    same = table
    _reparam._move_key(table, "c", 0)
    assert same is table and list(table.items()) == [("c", 3), ("a", 1), ("b", 2)]
    _reparam._move_key(table, "c", 2)
    assert list(table) == ["a", "b", "c"]


def test_refresh_machinery_is_installed_and_uninstalled() -> None:
    layer = linear()
    lp.l1_unstructured(layer, "weight", amount=2)
    lp.l1_unstructured(layer, "bias", amount=1)
    assert isinstance(layer.__dict__["_apply"], _reparam._RefreshingApply)
    assert list(layer._load_state_dict_post_hooks.values()).count(_reparam._refresh_after_load) == 1
    lp.remove(layer, "weight")
    assert "_apply" in layer.__dict__  # bias is still pruned
    lp.remove(layer, "bias")
    assert "_apply" not in layer.__dict__
    assert _reparam._refresh_after_load not in layer._load_state_dict_post_hooks.values()
    assert not lp.is_pruned(layer)


def test_apply_method_takes_lightprunes_and_torchs_method_objects() -> None:
    ours, theirs = linear(), linear()
    theirs.load_state_dict(ours.state_dict())
    assert isinstance(lp.apply_method(ours, "weight", lp.L1Unstructured(amount=5)), lp.L1Unstructured)
    assert isinstance(lp.apply_method(theirs, "weight", tp.L1Unstructured(amount=5)), tp.L1Unstructured)
    assert torch.equal(ours.weight_mask.float(), theirs.weight_mask.float())


@pytest.mark.parametrize("method", [lp.L1Unstructured, "l1_unstructured", None])
def test_apply_method_refuses_what_is_not_a_method_object_naming_it(method: object) -> None:
    """The class (the form global_unstructured takes) or a name failed inside the method with an unrelated message."""
    layer = linear()
    before = {key: value.clone() for key, value in layer.state_dict().items()}
    with pytest.raises(TypeError, match=r"method must be a pruning method object, such as L1Unstructured\(amount"):
        lp.apply_method(layer, "weight", method)  # type: ignore[arg-type]
    assert not lp.is_pruned(layer) and layer.state_dict().keys() == before.keys()


def test_a_parametrization_added_on_the_original_after_pruning_keeps_the_attribute_current() -> None:
    """Pruned first, then a parametrization on ``weight_orig`` (the only tensor one can go on): conversions and
    load_state_dict left ``weight`` stale (skipped, as not a plain Parameter), and remove failed with a bare
    KeyError."""
    from torch.nn.utils import parametrize

    class Doubled(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return 2 * x

    layer = lp.l1_unstructured(linear(), "weight", amount=5)
    parametrize.register_parametrization(layer, "weight_orig", Doubled())
    layer(torch.randn(1, 4))
    layer.double()
    assert layer.weight.dtype == torch.float64
    state = {key: value.clone() for key, value in layer.state_dict().items()}
    state["parametrizations.weight_orig.original"].add_(1.0)
    layer.load_state_dict(state)
    expected = 2 * layer.parametrizations.weight_orig.original.detach() * layer.weight_mask
    assert torch.equal(layer.weight.detach(), expected)
    with pytest.raises(
        ValueError, match=r"'weight_orig' of ParametrizedLinear is not a plain Parameter.*nothing was changed"
    ):
        lp.remove(layer, "weight")
    assert lp.is_pruned(layer) and torch.equal(layer.weight.detach(), expected)


class RebuiltFromArguments(nn.Linear):
    """Reduces itself to its constructor's arguments, without state (a 2-item ``__reduce__``)."""

    def __init__(self, features: int = 4, outputs: int = 3) -> None:
        super().__init__(features, outputs)
        self.arguments = (features, outputs)

    def __reduce__(self) -> tuple[Any, ...]:
        return RebuiltFromArguments, self.arguments


def test_a_class_reducing_to_its_arguments_copies_as_with_torch() -> None:
    """Its reduction has no state: reading one failed with a bare IndexError, where torch's pruned module copies."""
    import copy

    ours = lp.l1_unstructured(RebuiltFromArguments(), "weight", amount=5)
    theirs = tp.l1_unstructured(RebuiltFromArguments(), "weight", amount=5)
    for copied in (copy.copy, copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m))):
        assert type(copied(ours)) is type(copied(theirs)) is RebuiltFromArguments
