"""A stateful property-based test of the whole engine API (issue #6: bad input, faults and interruptions never lose a
mask or leave a model half-pruned).

A Hypothesis ``RuleBasedStateMachine`` builds a small model of random modules (Linear, Conv1d/2d/3d, LSTM, Embedding,
MultiheadAttention) and runs random sequences of: l1/random unstructured pruning, ln/random structured pruning with
random ``n`` and ``dim``, identity, global_unstructured over several tensors, custom_from_mask, remove,
``copy.deepcopy``, state_dict save and load (into the same model, into a fresh model and into a deep copy), dtype
conversions, in-place weight updates, NaN and inf injected into weights and importance scores; mixed with INVALID
calls (amount too large, negative, NaN or of the wrong type, bad dim, bad importance_scores, unknown names, remove of
an unpruned tensor, structured pruning of a 1-D bias, bad global arguments, bad custom masks) and with faults injected
while a mask is being attached or removed (an exception or a ``KeyboardInterrupt`` after part of the change was made).

An oracle keeps, for every tensor, whether it is pruned, its mask dtype and how many entries its mask must zero
(computed from what each call asked for: a float amount prunes ``round(amount * remaining units)``, an int exactly
that many; structured counts are in channels). After every step:

* masks hold only 0 and 1 and zero exactly the oracle's count; the pruned attribute is ``orig * mask`` (never stale);
* every module's parameters keep their construction order (``name_orig`` in ``name``'s place);
* the model's forward output equals that of a freshly built copy holding plain parameters ``orig * mask``;
* after an error, every module's parameters and buffers (same objects, same order), hooks (same objects, same order,
  same methods in each container), attributes, LSTM flat-weight lists and state_dict values are exactly as before.

Bounded for CI (``max_examples=40, stateful_step_count=25``); the ``nightly`` Hypothesis profile runs far more:
``LIGHTPRUNE_HYPOTHESIS_PROFILE=nightly python -m pytest tests/prune/test_reliability_engine.py`` (see RELIABILITY.md).
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from torch import Tensor, nn

from lightprune import prune
from lightprune.prune import _reparam, base, functional

# ----------------------------------------------------------------------------------------------------------------------
# Hypothesis profiles: bounded in CI, large nightly (LIGHTPRUNE_HYPOTHESIS_PROFILE=nightly)
# ----------------------------------------------------------------------------------------------------------------------

_HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
settings.register_profile(
    "lightprune-ci", max_examples=40, stateful_step_count=25, deadline=None, suppress_health_check=_HEALTH
)
settings.register_profile(
    "nightly", max_examples=1000, stateful_step_count=50, deadline=None, suppress_health_check=_HEALTH
)
PROFILE = os.environ.get("LIGHTPRUNE_HYPOTHESIS_PROFILE", "lightprune-ci")
if PROFILE == "ci":
    PROFILE = "lightprune-ci"

# Errors an invalid call may raise: each names the bad value (checked to be a real message, not an empty one).
CLEAR_ERRORS = (ValueError, TypeError, IndexError, AttributeError, RuntimeError)


# ----------------------------------------------------------------------------------------------------------------------
# Random modules
# ----------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """How to build one module and feed it: ``kind`` and its sizes."""

    kind: str
    sizes: tuple[int, ...]
    seed: int

    def build(self) -> nn.Module:
        with torch.random.fork_rng():
            torch.manual_seed(self.seed)
            return self._build()

    def _build(self) -> nn.Module:
        s = self.sizes
        if self.kind == "linear":
            return nn.Linear(s[0], s[1], bias=bool(s[2]))
        if self.kind == "conv1d":
            return nn.Conv1d(s[0], s[1], s[2])
        if self.kind == "conv2d":
            return nn.Conv2d(s[0], s[1], s[2])
        if self.kind == "conv3d":
            return nn.Conv3d(s[0], s[1], s[2])
        if self.kind == "lstm":
            return nn.LSTM(s[0], s[1])
        if self.kind == "embedding":
            return nn.Embedding(s[0], s[1])
        if self.kind == "mha":
            return nn.MultiheadAttention(s[0] * s[1], s[0])
        raise AssertionError(self.kind)

    def prunable(self) -> list[str]:
        """The tensors the machine prunes (MultiheadAttention's out_proj is read without its forward: left out)."""
        if self.kind == "linear":
            return ["weight", "bias"] if self.sizes[2] else ["weight"]
        if self.kind == "lstm":
            return ["weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0"]
        if self.kind == "embedding":
            return ["weight"]
        if self.kind == "mha":
            return ["in_proj_weight", "in_proj_bias"]
        return ["weight", "bias"]

    def inputs(self, dtype: torch.dtype) -> tuple[Any, ...]:
        generator = torch.Generator().manual_seed(1234)
        s = self.sizes

        def randn(*shape: int) -> Tensor:
            return torch.randn(*shape, generator=generator).to(dtype)

        if self.kind == "linear":
            return (randn(2, s[0]),)
        if self.kind == "conv1d":
            return (randn(1, s[0], s[2] + 1),)
        if self.kind == "conv2d":
            return (randn(1, s[0], s[2] + 1, s[2] + 1),)
        if self.kind == "conv3d":
            return (randn(1, s[0], s[2], s[2], s[2] + 1),)
        if self.kind == "lstm":
            return (randn(3, 1, s[0]),)
        if self.kind == "embedding":
            return (torch.randint(0, s[0], (5,), generator=generator),)
        x = randn(2, 1, s[0] * s[1])
        return (x, x, x)


def spec(kind: str, *sizes: st.SearchStrategy[int]) -> st.SearchStrategy[Spec]:
    return st.builds(lambda seed, *drawn: Spec(kind, tuple(drawn), seed), st.integers(0, 999), *sizes)


SPECS = st.one_of(
    spec("linear", st.integers(1, 6), st.integers(1, 6), st.integers(0, 1)),
    spec("conv1d", st.integers(1, 3), st.integers(1, 4), st.integers(1, 3)),
    spec("conv2d", st.integers(1, 3), st.integers(1, 4), st.integers(1, 2)),
    spec("conv3d", st.integers(1, 2), st.integers(1, 3), st.integers(1, 2)),
    spec("lstm", st.integers(1, 4), st.integers(1, 3)),
    spec("embedding", st.integers(1, 6), st.integers(1, 4)),
    spec("mha", st.integers(1, 2), st.integers(1, 3)),
)

MASK_MODES = st.sampled_from([None, torch.bool])
NORMS = st.sampled_from([1, 2, 3, 0.5, math.inf, -math.inf])
NONFINITE = st.sampled_from([math.nan, math.inf, -math.inf])


# ----------------------------------------------------------------------------------------------------------------------
# Reading a module
# ----------------------------------------------------------------------------------------------------------------------


def hook_of(module: nn.Module, name: str) -> base.BasePruningMethod | None:
    return _reparam.find_hook(module, name)[1]


def orig_of(module: nn.Module, name: str) -> Tensor:
    return module._parameters[name + "_orig"] if hook_of(module, name) is not None else module._parameters[name]


def mask_of(module: nn.Module, name: str) -> Tensor | None:
    return module._buffers.get(name + "_mask") if hook_of(module, name) is not None else None


def fold(orig: Tensor, mask: Tensor) -> Tensor:
    """``orig * mask`` as the engine defines it: a bool mask selects (exact zeros), a float mask multiplies."""
    with torch.no_grad():
        if mask.dtype == torch.bool:
            return torch.where(mask, orig, torch.zeros((), dtype=orig.dtype))
        return orig * mask.to(orig.dtype)


def zeros(mask: Tensor | None) -> int:
    return 0 if mask is None else int((mask == 0).sum())


def zero_channels(mask: Tensor, dim: int) -> Tensor:
    other = [d for d in range(mask.dim()) if d != dim]
    return torch.count_nonzero(mask, dim=other) == 0


def same_values(a: Tensor, b: Tensor) -> bool:
    """Equal shapes, dtypes and values, NaN equal to NaN."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if torch.equal(a, b):
        return True
    return a.is_floating_point() and bool(((a == b) | (a.isnan() & b.isnan())).all())


def ranks_first(pruned: Tensor, kept: Tensor) -> bool:
    """Every newly pruned magnitude ranks at or below every kept one, NaN ranking above +inf (L1's order)."""
    if pruned.numel() == 0 or kept.numel() == 0:
        return True
    pruned, kept = pruned.double().abs(), kept.double().abs()
    if pruned.isnan().any():
        return bool(kept.isnan().all())
    finite_kept = kept[~kept.isnan()]
    return finite_kept.numel() == 0 or bool(pruned.max() <= finite_kept.min())


def fold_state_dict(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """A plain state_dict: ``orig * mask`` for every ``<p>_orig``/``<p>_mask`` pair."""
    plain = {}
    for key, value in state.items():
        if key.endswith("_orig") and key[: -len("_orig")] + "_mask" in state:
            plain[key[: -len("_orig")]] = fold(value, state[key[: -len("_orig")] + "_mask"])
        elif not (key.endswith("_mask") and key[: -len("_mask")] + "_orig" in state):
            plain[key] = value
    return plain


def flat_outputs(output: Any) -> list[Tensor]:
    if isinstance(output, Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in flat_outputs(item)]
    return []


# ----------------------------------------------------------------------------------------------------------------------
# A snapshot of everything a failed call must leave untouched
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class ModelState:
    modules: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def of(cls, model: nn.Module) -> ModelState:
        state = cls()
        for name, module in model.named_modules():
            flat = module.__dict__.get("_flat_weights")
            state.modules.append(
                {
                    "name": name,
                    "parameters": list(module._parameters.items()),
                    "data_ptrs": [None if v is None else v.data_ptr() for v in module._parameters.values()],
                    "buffers": list(module._buffers.items()),
                    "non_persistent": set(module._non_persistent_buffers_set),
                    "hooks": list(module._forward_pre_hooks.items()),
                    "containers": [
                        tuple(h) for h in module._forward_pre_hooks.values() if isinstance(h, prune.PruningContainer)
                    ],
                    "load_pre_hooks": list(module._load_state_dict_pre_hooks.items()),
                    "load_post_hooks": list(module._load_state_dict_post_hooks.items()),
                    "attributes": {
                        k: v for k, v in module.__dict__.items() if isinstance(v, Tensor) or k in ("_apply",)
                    },
                    "flat_weights": None if flat is None else (flat, list(flat)),
                    "values": {k: v.detach().clone() for k, v in module.state_dict(keep_vars=True).items()},
                }
            )
        return state

    def assert_same(self, model: nn.Module, context: str) -> None:
        now = ModelState.of(model)
        assert [m["name"] for m in now.modules] == [m["name"] for m in self.modules], context
        for before, after in zip(self.modules, now.modules, strict=True):
            where = f"{context}: module {before['name']!r}"
            assert after["data_ptrs"] == before["data_ptrs"], f"{where}: a parameter holds other memory"
            for key in ("parameters", "buffers", "hooks", "load_pre_hooks", "load_post_hooks"):
                assert [k for k, _ in after[key]] == [k for k, _ in before[key]], f"{where}: {key} keys"
                for (k, a), (_, b) in zip(after[key], before[key], strict=True):
                    assert a is b, f"{where}: {key} {k!r} is another object"
            assert after["non_persistent"] == before["non_persistent"], where
            assert len(after["containers"]) == len(before["containers"]), where
            for a, b in zip(after["containers"], before["containers"], strict=True):
                assert len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True)), f"{where}: container"
            assert after["attributes"].keys() == before["attributes"].keys(), f"{where}: attributes"
            for k, v in before["attributes"].items():
                assert after["attributes"][k] is v, f"{where}: attribute {k!r} replaced"
            if before["flat_weights"] is not None:
                flat, contents = before["flat_weights"]
                assert after["flat_weights"][0] is flat, f"{where}: _flat_weights list replaced"
                assert len(flat) == len(contents) and all(a is b for a, b in zip(flat, contents, strict=True)), (
                    f"{where}: _flat_weights holds other tensors (the RNN's forward would use them)"
                )
            assert list(after["values"]) == list(before["values"]), f"{where}: state_dict keys"
            for k, v in before["values"].items():
                assert same_values(after["values"][k], v), f"{where}: state_dict value {k!r} changed"


# ----------------------------------------------------------------------------------------------------------------------
# The oracle
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class Expect:
    """What must hold of one tensor: pruned or not, its mask dtype and the number of entries its mask zeroes."""

    pruned: bool = False
    dtype: torch.dtype | None = None
    zeros: int = 0


Key = tuple[str, str]  # (module name in the ModuleDict, parameter name)


class EngineMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.ModuleDict()
        self.specs: dict[str, Spec] = {}
        self.order: dict[str, list[str]] = {}  # each module's parameter names at construction
        self.expect: dict[Key, Expect] = {}
        self.dtype = torch.float32
        self.saved: tuple[dict[str, Tensor], dict[Key, Expect]] | None = None
        self.steps: dict[str, int] = {}

    # ------------------------------------------------------------------------------------------------------------
    # Set-up and helpers
    # ------------------------------------------------------------------------------------------------------------

    @initialize(specs=st.lists(SPECS, min_size=1, max_size=3))
    def build(self, specs: list[Spec]) -> None:
        for index, spec in enumerate(specs):
            name = f"{spec.kind}{index}"
            module = spec.build()
            self.model[name] = module
            self.specs[name] = spec
            self.order[name] = list(module._parameters)
            for tensor in spec.prunable():
                self.expect[(name, tensor)] = Expect()
        note(f"model: {self.specs}")

    def count(self, what: str) -> None:
        self.steps[what] = self.steps.get(what, 0) + 1
        STATS[what] = STATS.get(what, 0) + 1

    def module(self, key: Key) -> nn.Module:
        return self.model[key[0]]

    def tensor(self, key: Key) -> Tensor:
        return orig_of(self.module(key), key[1])

    def mask(self, key: Key) -> Tensor | None:
        return mask_of(self.module(key), key[1])

    def eligible(self, key: Key) -> int:
        return self.tensor(key).numel() - self.expect[key].zeros

    def keys(self, where: Callable[[Key], bool] = lambda key: True) -> list[Key]:
        return [key for key in self.expect if where(key)]

    def draw_key(self, data: st.DataObject, where: Callable[[Key], bool] = lambda key: True) -> Key:
        keys = self.keys(where)
        assert keys
        return data.draw(st.sampled_from(keys), label="tensor")

    def current_scores(self, key: Key) -> Tensor:
        """What L1 ranks by default: the tensor's current value (orig where the mask is 1)."""
        return self.tensor(key).detach().clone()

    def mask_before(self, key: Key) -> Tensor:
        mask = self.mask(key)
        return torch.ones(self.tensor(key).shape, dtype=torch.bool) if mask is None else (mask != 0).clone()

    def new_dtype(self, key: Key, mode: torch.dtype | None) -> torch.dtype:
        e = self.expect[key]
        if e.pruned:
            assert e.dtype is not None
            return e.dtype
        return mode if mode is not None else self.tensor(key).dtype

    def scores(self, data: st.DataObject, shape: torch.Size) -> Tensor:
        seed = data.draw(st.integers(0, 2**16), label="scores seed")
        scores = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(self.dtype)
        if data.draw(st.booleans(), label="non-finite scores"):
            self.inject(data, scores.view(-1))
        return scores

    def inject(self, data: st.DataObject, flat: Tensor) -> None:
        positions = data.draw(st.lists(st.integers(0, flat.numel() - 1), min_size=1, max_size=4), label="positions")
        with torch.no_grad():
            for position in positions:
                flat[position] = data.draw(NONFINITE, label="value")

    def amount(self, data: st.DataObject, units: int) -> int | float:
        if data.draw(st.booleans(), label="int amount"):
            return data.draw(st.integers(0, units), label="amount")
        return data.draw(st.one_of(st.just(0.0), st.just(1.0), st.floats(0, 1)), label="amount")

    @staticmethod
    def units_to_prune(amount: int | float, units: int) -> int:
        return amount if isinstance(amount, int) else round(amount * units)

    def forward(self, model: nn.Module | None = None) -> dict[str, list[Tensor]]:
        model = self.model if model is None else model
        with torch.no_grad():
            return {name: flat_outputs(model[name](*self.specs[name].inputs(self.dtype))) for name in self.specs}

    @staticmethod
    def forward_of(model: nn.Module, spec: Spec, dtype: torch.dtype = torch.float32) -> list[Tensor]:
        with torch.no_grad():
            return flat_outputs(model["m"](*spec.inputs(dtype)))

    def update(self, key: Key, mode: torch.dtype | None) -> None:
        """After a successful pruning call: the tensor is pruned, with its (first) mask dtype; zeros set by caller."""
        e = self.expect[key]
        e.dtype = self.new_dtype(key, mode)
        e.pruned = True

    def check_grows(self, key: Key, before: Tensor) -> Tensor:
        """The new mask keeps every zero of ``before``; returns it as bool."""
        mask = self.mask(key)
        assert mask is not None, f"{key} is not pruned after a pruning call"
        now = mask != 0
        assert not (now & ~before).any(), f"{key}: an entry pruned before is unpruned"
        return now

    # ------------------------------------------------------------------------------------------------------------
    # Valid calls
    # ------------------------------------------------------------------------------------------------------------

    @rule(data=st.data())
    def unstructured(self, data: st.DataObject) -> None:
        key = self.draw_key(data)
        module, name = self.module(key), key[1]
        method = data.draw(st.sampled_from(["l1", "random"]), label="method")
        eligible = self.eligible(key)
        amount = self.amount(data, eligible)
        mode = data.draw(MASK_MODES, label="mask dtype")
        scores = self.scores(data, self.tensor(key).shape) if method == "l1" and data.draw(st.booleans()) else None
        ranking = self.current_scores(key) if scores is None else scores
        before = self.mask_before(key)
        torch.manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
        with prune.mask_dtype(mode):
            if method == "l1":
                prune.l1_unstructured(module, name, amount=amount, importance_scores=scores)
            else:
                prune.random_unstructured(module, name, amount=amount)
        k = self.units_to_prune(amount, eligible)
        self.update(key, mode)
        now = self.check_grows(key, before)
        assert zeros(self.mask(key)) == self.expect[key].zeros + k, (key, amount, eligible)
        self.expect[key].zeros += k
        if method == "l1":
            assert ranks_first(ranking[before & ~now], ranking[now]), f"{key}: L1 pruned a larger magnitude"
        self.count(f"prune {method}_unstructured")

    @precondition(lambda self: any(len(s) >= 2 for s in self._shapes()))
    @rule(data=st.data())
    def structured(self, data: st.DataObject) -> None:
        key = self.draw_key(data, lambda key: self.tensor(key).dim() >= 2)
        module, name = self.module(key), key[1]
        tensor = self.tensor(key)
        ndim = tensor.dim()
        dim = data.draw(st.integers(-ndim, ndim - 1), label="dim")
        method = data.draw(st.sampled_from(["ln", "random"]), label="method")
        before = self.mask_before(key)
        zero_before = zero_channels(before, dim % ndim)
        active = int((~zero_before).sum())
        amount = self.amount(data, active)
        mode = data.draw(MASK_MODES, label="mask dtype")
        torch.manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
        scores = None
        with prune.mask_dtype(mode):
            if method == "ln":
                n = data.draw(NORMS, label="n")
                scores = self.scores(data, tensor.shape) if data.draw(st.booleans(), label="scores") else None
                prune.ln_structured(module, name, amount=amount, n=n, dim=dim, importance_scores=scores)
            else:
                prune.random_structured(module, name, amount=amount, dim=dim)
        k = self.units_to_prune(amount, active)
        self.update(key, mode)
        now = self.check_grows(key, before)
        zero_now = zero_channels(now, dim % ndim)
        assert not (zero_before & ~zero_now).any()
        assert int(zero_now.sum()) == int(zero_before.sum()) + k, (key, amount, active, dim)
        view = [1] * ndim
        view[dim % ndim] = -1
        assert torch.equal(now, before & ~zero_now.view(view)), f"{key}: entries outside the pruned channels changed"
        self.expect[key].zeros = zeros(self.mask(key))
        self.count(f"prune {method}_structured")

    def _shapes(self) -> list[torch.Size]:
        return [self.tensor(key).shape for key in self.expect]

    @rule(data=st.data())
    def global_unstructured(self, data: st.DataObject) -> None:
        keys = data.draw(st.lists(st.sampled_from(self.keys()), min_size=1, max_size=4, unique=True), label="tensors")
        method = data.draw(st.sampled_from([prune.L1Unstructured, prune.RandomUnstructured]), label="method")
        eligible = sum(self.eligible(key) for key in keys)
        amount = self.amount(data, eligible)
        mode = data.draw(MASK_MODES, label="mask dtype")
        scores: dict[tuple[nn.Module, str], Tensor] = {}
        if method is prune.L1Unstructured:
            for key in keys:
                if data.draw(st.booleans(), label="scores"):
                    scores[(self.module(key), key[1])] = self.scores(data, self.tensor(key).shape)
        ranking = [scores.get((self.module(key), key[1]), self.current_scores(key)) for key in keys]
        before = [self.mask_before(key) for key in keys]
        torch.manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
        with prune.mask_dtype(mode):
            prune.global_unstructured(
                [(self.module(key), key[1]) for key in keys],
                method,
                importance_scores=scores or None,
                amount=amount,
            )
        k = self.units_to_prune(amount, eligible)
        now = []
        for key, b in zip(keys, before, strict=True):
            self.update(key, mode)
            now.append(self.check_grows(key, b))
        total = sum(zeros(self.mask(key)) for key in keys)
        assert total == sum(self.expect[key].zeros for key in keys) + k, (keys, amount, eligible)
        for key in keys:
            self.expect[key].zeros = zeros(self.mask(key))
        if method is prune.L1Unstructured:
            pruned = torch.cat([r[b & ~n].reshape(-1) for r, b, n in zip(ranking, before, now, strict=True)])
            kept = torch.cat([r[n].reshape(-1) for r, n in zip(ranking, now, strict=True)])
            assert ranks_first(pruned, kept), "global L1 pruned a larger magnitude"
        self.count(f"global_unstructured ({len(keys)} tensors)")

    @rule(data=st.data())
    def identity(self, data: st.DataObject) -> None:
        key = self.draw_key(data)
        before = self.mask_before(key)
        mode = data.draw(MASK_MODES, label="mask dtype")
        with prune.mask_dtype(mode):
            prune.identity(self.module(key), key[1])
        self.update(key, mode)
        assert torch.equal(self.check_grows(key, before), before)
        self.count("identity")

    @rule(data=st.data())
    def custom_from_mask(self, data: st.DataObject) -> None:
        key = self.draw_key(data)
        shape = self.tensor(key).shape
        seed = data.draw(st.integers(0, 2**16), label="mask seed")
        keep = torch.rand(shape, generator=torch.Generator().manual_seed(seed)) < data.draw(st.floats(0, 1))
        given = keep.to(data.draw(st.sampled_from([torch.float32, torch.bool, torch.int64, torch.float64])))
        before = self.mask_before(key)
        mode = data.draw(MASK_MODES, label="mask dtype")
        with prune.mask_dtype(mode):
            prune.custom_from_mask(self.module(key), key[1], mask=given)
        self.update(key, mode)
        now = self.check_grows(key, before)
        assert torch.equal(now, before & keep), f"{key}: custom mask not applied on top of the current one"
        self.expect[key].zeros = int((~(before & keep)).sum())
        self.count("custom_from_mask")

    @precondition(lambda self: any(e.pruned for e in self.expect.values()))
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        key = self.draw_key(data, lambda key: self.expect[key].pruned)
        module, name = self.module(key), key[1]
        orig = self.tensor(key)
        folded = fold(orig, self.mask(key))
        prune.remove(module, name)
        assert hook_of(module, name) is None and name + "_mask" not in module._buffers
        assert module._parameters[name] is orig, "remove() must keep the Parameter object (optimizers hold it)"
        assert type(module._parameters[name]) is nn.Parameter
        assert same_values(orig.detach(), folded), f"{key}: remove() did not leave orig * mask"
        self.expect[key] = Expect()
        self.count("remove")

    @rule(data=st.data())
    def update_weights(self, data: st.DataObject) -> None:
        """An in-place update of a tensor (an optimizer step), then a forward (which refreshes the attribute)."""
        key = self.draw_key(data)
        seed = data.draw(st.integers(0, 2**16), label="seed")
        tensor = self.tensor(key)
        with torch.no_grad():
            tensor.add_(torch.randn(tensor.shape, generator=torch.Generator().manual_seed(seed)).to(tensor.dtype))
        self.forward()
        self.count("in-place weight update + forward")

    @rule(data=st.data())
    def nonfinite_weights(self, data: st.DataObject) -> None:
        """NaN, inf and -inf written into a tensor's values; pruning counts must stay exact after this."""
        key = self.draw_key(data)
        self.inject(data, self.tensor(key).data.view(-1))
        self.forward()
        self.count("NaN/inf injected into weights")

    @rule()
    def forward_call(self) -> None:
        self.forward()
        self.count("forward")

    @rule()
    def deepcopy(self) -> None:
        original = self.model
        copied = copy.deepcopy(original)
        assert list(copied.state_dict()) == list(original.state_dict())
        for (k, a), b in zip(copied.state_dict().items(), original.state_dict().values(), strict=True):
            assert same_values(a, b), k
            assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr(), f"{k} shares memory"
        self.model = copied
        self.count("copy.deepcopy")

    @rule(data=st.data())
    def convert(self, data: st.DataObject) -> None:
        self.dtype = data.draw(st.sampled_from([torch.float32, torch.float64]), label="dtype")
        self.model.to(self.dtype)
        self.count("dtype conversion")

    @rule()
    def save(self) -> None:
        state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.saved = (state, {key: copy.copy(e) for key, e in self.expect.items()})
        self.count("state_dict saved")

    @precondition(lambda self: self.saved is not None)
    @rule(data=st.data())
    def load(self, data: st.DataObject) -> None:
        assert self.saved is not None
        state, expect = self.saved
        where = data.draw(st.sampled_from(["same model", "fresh model", "deep copy"]), label="into")
        if where == "same model":
            target = self.model
        elif where == "deep copy":
            target = copy.deepcopy(self.model)
        else:
            target = nn.ModuleDict({name: spec.build() for name, spec in self.specs.items()}).to(self.dtype)
        prune.prepare_for_state_dict(target, state)
        result = target.load_state_dict(state, strict=True)
        assert not result.missing_keys and not result.unexpected_keys
        loaded = target.state_dict()
        assert sorted(loaded) == sorted(state)
        for k, v in state.items():
            assert same_values(loaded[k], v.to(loaded[k].dtype)), k  # in the model's dtypes (it may be converted)
        for name in self.specs:  # parameter order is the construction order, with name_orig in name's place
            pruned = {t for (m, t), e in expect.items() if m == name and e.pruned}
            assert list(target[name]._parameters) == [n + "_orig" if n in pruned else n for n in self.order[name]]
        self.model = target
        self.expect = {key: copy.copy(e) for key, e in expect.items()}
        for key, e in self.expect.items():  # a mask keeps the dtype of the model it was loaded into
            mask = self.mask(key)
            e.dtype = None if mask is None else mask.dtype
        self.count(f"state_dict loaded into the {where}")

    # ------------------------------------------------------------------------------------------------------------
    # Invalid calls: a clear error, and nothing changed
    # ------------------------------------------------------------------------------------------------------------

    def invalid_calls(self, data: st.DataObject, mode: torch.dtype | None) -> dict[str, Callable[[], Any]]:
        """Calls that must fail, for the current model; drawn lazily by name."""
        key = self.draw_key(data)
        module, name = self.module(key), key[1]
        tensor = self.tensor(key)
        shape, ndim = tensor.shape, tensor.dim()
        eligible = self.eligible(key)
        pair = [key, *[k for k in self.keys() if k != key][:1]]
        calls: dict[str, Callable[[], Any]] = {
            "int amount too large": lambda: prune.l1_unstructured(
                module, name, amount=eligible + data.draw(st.integers(1, 5))
            ),
            "random int amount too large": lambda: prune.random_unstructured(module, name, amount=eligible + 1),
            "negative amount": lambda: prune.l1_unstructured(
                module, name, amount=data.draw(st.one_of(st.integers(-5, -1), st.floats(max_value=-1e-9)))
            ),
            "float amount above 1": lambda: prune.random_unstructured(
                module, name, amount=data.draw(st.floats(min_value=1.0, exclude_min=True))
            ),
            "NaN amount": lambda: prune.l1_unstructured(module, name, amount=math.nan),
            "amount of a wrong type": lambda: prune.l1_unstructured(
                module, name, amount=data.draw(st.sampled_from(["0.5", None, [1], torch.tensor(0.5), 0.5j, b"1"]))
            ),
            "importance_scores of a wrong shape": lambda: prune.l1_unstructured(
                module, name, amount=0, importance_scores=torch.ones(*shape, 2)
            ),
            "importance_scores not a tensor": lambda: prune.l1_unstructured(
                module, name, amount=0, importance_scores=torch.ones(shape).tolist()
            ),
            "unknown name": lambda: prune.l1_unstructured(
                module, data.draw(st.sampled_from(["wieght", "", "weight ", "forward", "training"])), amount=0
            ),
            "name of a buffer": lambda: prune.identity(module, name + "_mask"),
            "name not a str": lambda: prune.identity(module, data.draw(st.sampled_from([0, None, ("weight",)]))),
            "custom mask of a wrong shape": lambda: prune.custom_from_mask(module, name, mask=torch.ones(*shape, 2)),
            "custom mask not a tensor": lambda: prune.custom_from_mask(module, name, mask=[1.0] * tensor.numel()),
            "global: a pair twice": lambda: prune.global_unstructured(
                [(module, name), (module, name)], prune.L1Unstructured, amount=0
            ),
            "global: amount too large": lambda: prune.global_unstructured(
                [(self.module(k), k[1]) for k in pair],
                prune.RandomUnstructured,
                amount=sum(self.eligible(k) for k in pair) + 1,
            ),
            "global: a structured method": lambda: prune.global_unstructured(
                [(module, name)], prune.RandomStructured, amount=0
            ),
            "global: an unknown name": lambda: prune.global_unstructured(
                [(module, name), (module, "nope")], prune.L1Unstructured, amount=0.5
            ),
            "global: importance_scores of a wrong shape": lambda: prune.global_unstructured(
                [(module, name)],
                prune.L1Unstructured,
                importance_scores={(module, name): torch.ones(2, *shape)},
                amount=0,
            ),
            "global: not a pair": lambda: prune.global_unstructured(
                [(module, name), name], prune.L1Unstructured, amount=0
            ),
            "global: parameters not iterable": lambda: prune.global_unstructured(5, prune.L1Unstructured, amount=0),
            "global: importance_scores not a dict": lambda: prune.global_unstructured(
                [(module, name)], prune.L1Unstructured, importance_scores=[tensor], amount=0
            ),
        }
        if not self.expect[key].pruned:
            calls["remove of an unpruned tensor"] = lambda: prune.remove(module, name)
        if ndim == 1:
            calls["structured on a 1-D tensor"] = lambda: prune.ln_structured(module, name, amount=0, n=2, dim=0)
            calls["random structured on a 1-D tensor"] = lambda: prune.random_structured(module, name, amount=0, dim=0)
        else:
            active = int((~zero_channels(self.mask_before(key), 0)).sum())
            calls["structured amount too large"] = lambda: prune.ln_structured(
                module, name, amount=active + 1, n=2, dim=0
            )
            bad_dims = st.one_of(st.integers(ndim, ndim + 3), st.integers(-ndim - 3, -ndim - 1))
            calls["dim out of range"] = lambda: prune.random_structured(module, name, amount=0, dim=data.draw(bad_dims))
            calls["dim not an int"] = lambda: prune.ln_structured(
                module, name, amount=0, n=1, dim=data.draw(st.sampled_from([0.0, "0", None, 1.0]))
            )
            calls["bad norm"] = lambda: prune.ln_structured(
                module, name, amount=0, n=data.draw(st.sampled_from(["bogus", "nuc" if ndim != 3 else "bogus"])), dim=0
            )
            calls["structured importance_scores of a wrong shape"] = lambda: prune.ln_structured(
                module, name, amount=1, n=2, dim=0, importance_scores=torch.ones(tensor.numel())
            )
        if self.new_dtype(key, mode) == torch.bool:
            calls["fractional custom mask into a bool mask"] = lambda: prune.custom_from_mask(
                module, name, mask=torch.full(shape, 0.5)
            )
        return calls

    @rule(data=st.data())
    def invalid_call(self, data: st.DataObject) -> None:
        for _ in range(data.draw(st.integers(1, 3), label="invalid calls")):
            mode = data.draw(MASK_MODES, label="mask dtype")
            calls = self.invalid_calls(data, mode)
            case = data.draw(st.sampled_from(sorted(calls)), label="invalid call")
            before = ModelState.of(self.model)
            with pytest.raises(CLEAR_ERRORS) as info, prune.mask_dtype(mode):
                calls[case]()
            assert len(str(info.value)) > 10, f"{case}: unclear message {info.value!r}"
            before.assert_same(self.model, case)
            self.count(f"invalid: {case}")

    # ------------------------------------------------------------------------------------------------------------
    # Faults: an exception or an interrupt while a change is being made
    # ------------------------------------------------------------------------------------------------------------

    @rule(data=st.data())
    def fault_while_attaching(self, data: st.DataObject) -> None:
        """The j-th mask of a call fails to attach, before or after it was registered on its module."""
        keys = data.draw(st.lists(st.sampled_from(self.keys()), min_size=1, max_size=4, unique=True), label="tensors")
        fail_at = data.draw(st.integers(1, len(keys)), label="failing attachment")
        after_commit = data.draw(st.booleans(), label="after the change")
        error = data.draw(st.sampled_from([RuntimeError, KeyboardInterrupt, MemoryError]), label="error")
        mode = data.draw(MASK_MODES, label="mask dtype")
        real = _reparam._Attachment.commit
        seen = []

        def commit(attachment: _reparam._Attachment) -> base.BasePruningMethod:
            seen.append(attachment)
            if len(seen) == fail_at and not after_commit:
                raise error("injected")
            hook = real(attachment)
            if len(seen) == fail_at:
                raise error("injected")
            return hook

        before = ModelState.of(self.model)
        with mock.patch.object(_reparam._Attachment, "commit", commit), pytest.raises(error), prune.mask_dtype(mode):
            if len(keys) == 1 and data.draw(st.booleans(), label="single call"):
                prune.l1_unstructured(self.module(keys[0]), keys[0][1], amount=0.5)
            else:
                prune.global_unstructured([(self.module(k), k[1]) for k in keys], prune.L1Unstructured, amount=0.5)
        before.assert_same(self.model, f"{error.__name__} at attachment {fail_at} of {len(keys)}")
        self.count(f"fault while attaching ({error.__name__})")

    @precondition(lambda self: any(e.pruned for e in self.expect.values()))
    @rule(data=st.data())
    def fault_while_removing(self, data: st.DataObject) -> None:
        """remove() is interrupted after it made part of its change."""
        key = self.draw_key(data, lambda key: self.expect[key].pruned)
        point = data.draw(st.sampled_from(["_move_key", "uninstall_refresh_if_unpruned"]), label="fault point")
        error = data.draw(st.sampled_from([RuntimeError, KeyboardInterrupt]), label="error")
        target = _reparam if point == "_move_key" else functional

        def fail(*args: Any, **kwargs: Any) -> None:
            raise error("injected")

        before = ModelState.of(self.model)
        with mock.patch.object(target, point, fail), pytest.raises(error):
            prune.remove(self.module(key), key[1])
        before.assert_same(self.model, f"{error.__name__} in remove() at {point}")
        self.count(f"fault while removing ({error.__name__})")

    # ------------------------------------------------------------------------------------------------------------
    # Invariants
    # ------------------------------------------------------------------------------------------------------------

    @invariant()
    def consistent(self) -> None:
        if not self.specs:
            return
        assert prune.get_mask_dtype() is None, "the global mask dtype setting leaked"
        for key, e in self.expect.items():
            module, name = self.module(key), key[1]
            hook = hook_of(module, name)
            assert (hook is not None) == e.pruned, f"{key}: pruned={hook is not None}, expected {e.pruned}"
            if not e.pruned:
                assert name in module._parameters and name + "_mask" not in module._buffers, key
                continue
            assert name not in module._parameters and name + "_orig" in module._parameters, key
            mask = module._buffers[name + "_mask"]
            assert mask.dtype == e.dtype or (e.dtype is not None and e.dtype.is_floating_point), (key, mask.dtype)
            assert bool(((mask == 0) | (mask == 1)).all()), f"{key}: the mask holds values other than 0 and 1"
            assert zeros(mask) == e.zeros, f"{key}: the mask zeroes {zeros(mask)} entries, expected {e.zeros}"
            attribute = module.__dict__.get(name)
            assert isinstance(attribute, Tensor) and not isinstance(attribute, nn.Parameter), key
            assert same_values(attribute.detach(), fold(module._parameters[name + "_orig"], mask)), f"{key} is stale"
            if mask.dtype == torch.bool:  # exact zeros, even where orig holds NaN or inf (L1Unstructured's docstring)
                assert bool((attribute.detach()[~mask] == 0).all()), f"{key}: a pruned entry is not an exact 0"
        for name in self.specs:
            pruned = {t for (m, t), e in self.expect.items() if m == name and e.pruned}
            assert list(self.model[name]._parameters) == [n + "_orig" if n in pruned else n for n in self.order[name]]
        # the forward equals that of a fresh copy holding plain parameters orig * mask
        reference = nn.ModuleDict({name: spec.build() for name, spec in self.specs.items()}).to(self.dtype)
        reference.load_state_dict(fold_state_dict(self.model.state_dict()), strict=True)
        actual, expected = self.forward(), self.forward(reference)
        for name in self.specs:
            for a, b in zip(actual[name], expected[name], strict=True):
                assert same_values(a, b), f"{name}: the forward differs from the folded copy's"


STATS: dict[str, int] = {}
"""How often each step ran in this process (printed by ``test_engine_state_machine`` with ``-s``)."""

EngineMachine.TestCase.settings = settings.get_profile(PROFILE)


def test_engine_state_machine() -> None:
    STATS.clear()
    EngineMachine.TestCase("runTest").runTest()
    total = sum(STATS.values())
    print(f"\nengine state machine ({PROFILE}): {total} steps")
    for what, count in sorted(STATS.items(), key=lambda item: -item[1]):
        print(f"  {count:6d}  {what}")
    assert total > 0


# ----------------------------------------------------------------------------------------------------------------------
# Regression tests of the defects the machine found
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize(("target", "point"), [(_reparam, "_move_key"), (functional, "uninstall_refresh_if_unpruned")])
@pytest.mark.parametrize("kind", ["linear", "lstm"])
def test_remove_interrupted_part_way_leaves_the_module_pruned(
    kind: str, target: Any, point: str, error: type[BaseException]
) -> None:
    """remove() failing after it changed part of the module used to leave a plain Parameter next to the hook (every
    forward then failed looking for ``weight_orig``), with ``weight_orig``'s values replaced by ``orig * mask``."""
    spec = Spec(kind, (3, 2, 1), seed=0)
    model = nn.ModuleDict({"m": spec.build()})
    name = spec.prunable()[0]
    prune.l1_unstructured(model["m"], name, amount=3)
    expected = EngineMachine.forward_of(model, spec)
    before = ModelState.of(model)

    def fail(*args: Any, **kwargs: Any) -> None:
        raise error("injected")

    with mock.patch.object(target, point, fail), pytest.raises(error):
        prune.remove(model["m"], name)
    before.assert_same(model, f"{error.__name__} at {point}")
    assert all(same_values(a, b) for a, b in zip(EngineMachine.forward_of(model, spec), expected, strict=True))
    prune.remove(model["m"], name)  # and it can still be removed
    assert zeros(model["m"]._parameters[name]) == 3
