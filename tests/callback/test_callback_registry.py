"""A method is one class plus one registry entry: a new one is accepted by the callback and by the app's config check
with no other change, and its entry's traits (not its name) decide what the rules allow."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from omegaconf import OmegaConf
from torch import Tensor

from lightprune import PruningCallback, choices, prune, registry
from lightprune.callback import options
from lightprune.experiment.app import build_callback
from lightprune.experiment.config import ConfigError, ExperimentConfig, validate_config
from lightprune.schedules import Constant
from tiny_lightning import WEIGHTS, TinyNet, quiet_trainer


class PruneLeading(prune.BasePruningMethod):
    """Prunes the first unpruned entries in flat order (``amount`` of them): a ranking no built-in method has."""

    PRUNING_TYPE = "unstructured"

    def __init__(self, amount: int | float) -> None:
        prune._validate_pruning_amount_init(amount)
        self.amount = amount

    def compute_mask(self, t: Tensor, default_mask: Tensor) -> Tensor:
        k = prune._compute_nparams_toprune(self.amount, t.nelement())
        mask = default_mask.clone()
        mask.view(-1)[:k] = 0
        return mask


@pytest.fixture
def prune_leading() -> Iterator[registry.Method]:
    """The one registry line, taken out again after the test."""
    entry = registry.register(registry.Method("prune_leading", f"{__name__}.PruneLeading", "unstructured"))
    yield entry
    del registry.METHODS[entry.name]


def leading_zeros_reference(weight: Tensor, sparsity: float) -> Tensor:
    """The zeros PruneLeading leaves in one tensor pruned alone to ``sparsity``: the first ``round(s * n)`` entries."""
    expected = torch.zeros(weight.numel(), dtype=torch.bool)
    expected[: round(sparsity * weight.numel())] = True
    return expected.view_as(weight)


def app_config(method: str, **pruning: object) -> ExperimentConfig:
    cfg = OmegaConf.structured(ExperimentConfig)
    cfg.pruning.method = method
    for key, value in pruning.items():
        cfg.pruning[key] = value
    return cfg


@pytest.mark.usefixtures("one_thread")
def test_a_registered_method_prunes_through_the_callback(prune_leading: registry.Method) -> None:
    callback = PruningCallback(Constant(0.5), method="prune_leading", scope="layerwise")
    assert callback.method is PruneLeading and options.method_name(PruneLeading) == "prune_leading"
    model = TinyNet()
    quiet_trainer([callback], max_epochs=1).fit(model)
    weights = dict(model.named_parameters())
    for name in WEIGHTS:
        zeros = weights[name].detach() == 0
        assert torch.equal(zeros, leading_zeros_reference(weights[name], 0.5)), name


def test_a_registered_method_passes_the_apps_config_check(prune_leading: registry.Method) -> None:
    validate_config(app_config("prune_leading", scope="layerwise"))
    callback = build_callback(app_config("prune_leading", scope="layerwise"))
    assert callback.method is PruneLeading and callback.scope == "layerwise"
    assert "prune_leading" in choices.METHODS and "prune_leading" in options.METHODS
    # its traits, not its name, decide: it ranks no signed scores and is no N:M method
    with pytest.raises(ConfigError, match=r"pruning.importance='movement': movement ranks signed scores, which "):
        validate_config(app_config("prune_leading", importance="movement", start=0.1))
    with pytest.raises(ValueError, match="movement ranks signed scores, which prune_leading cannot"):
        PruningCallback(Constant(0.5, at=2), method="prune_leading", importance="movement")


def test_an_unregistered_name_is_refused_by_both() -> None:
    with pytest.raises(ConfigError, match=r"pruning.method='prune_leading': one of \("):
        validate_config(app_config("prune_leading"))
    with pytest.raises(ValueError, match="method='prune_leading' is not supported: use one of 'l1_unstructured'"):
        PruningCallback(0.5, method="prune_leading")


def test_the_traits_of_an_entry_change_what_the_rules_allow(monkeypatch: pytest.MonkeyPatch) -> None:
    """A signed entry for the same class: movement is allowed now, by the callback and by the app alike."""
    entry = registry.Method("prune_leading", f"{__name__}.PruneLeading", "unstructured", signed=True)
    monkeypatch.setitem(registry.METHODS, entry.name, entry)
    validate_config(app_config("prune_leading", importance="movement", start=0.1))
    assert PruningCallback(Constant(0.5, at=2), method="prune_leading", importance="movement").method is PruneLeading


def test_entries_refuse_what_the_callback_cannot_use() -> None:
    with pytest.raises(ValueError, match=r"kind='blocks' is not supported: allowed are \('unstructured', "):
        registry.Method("blocky", "x.Blocks", "blocks")
    with pytest.raises(ValueError, match="target='Blocks' must be an import path"):
        registry.Method("blocky", "Blocks", "unstructured")
    for taken in ("l1_unstructured", "heads"):
        with pytest.raises(ValueError, match=f"a method named '{taken}' exists already"):
            registry.register(registry.Method(taken, "lightprune.prune.L1Unstructured", "unstructured"))
    with pytest.raises(ValueError, match=r"method 'gone': 'lightprune\.prune\.Gone' could not be imported"):
        registry.Method("gone", "lightprune.prune.Gone", "unstructured").load()


def test_the_registry_describes_the_built_in_classes_as_they_behave() -> None:
    """Each entry agrees with its class: the class's ``PRUNING_TYPE``, and defaults the constructor accepts."""
    for name, entry in registry.METHODS.items():
        cls = entry.load()
        assert entry.pruning_type == cls.PRUNING_TYPE, name
        kwargs = dict(entry.defaults)
        cls(**kwargs) if entry.fixed_amount else cls(amount=0.5, **kwargs)
    assert list(choices.STRUCTURED_METHODS) == [n for n, e in registry.METHODS.items() if e.kind == "structured"]


class KeepLeadingOfGroups(prune.BasePruningMethod):
    """An N:M method of the test's own: in every group of ``m`` entries along ``dim``, keep the first ``n``."""

    PRUNING_TYPE = "global"

    def __init__(self, n: int = 1, m: int = 2, dim: int = 1) -> None:
        self.n, self.m, self.dim = n, m, dim

    def compute_mask(self, t: Tensor, default_mask: Tensor) -> Tensor:
        moved = default_mask.clone().movedim(self.dim, -1)
        grouped = moved.reshape(*moved.shape[:-1], moved.shape[-1] // self.m, self.m).clone()
        grouped[..., self.n :] = 0
        return grouped.reshape(moved.shape).movedim(-1, self.dim).contiguous()


@pytest.fixture
def keep_leading() -> Iterator[registry.Method]:
    entry = registry.register(
        registry.Method("keep_leading", f"{__name__}.KeepLeadingOfGroups", "n:m", defaults={"n": 1, "m": 2})
    )
    yield entry
    del registry.METHODS[entry.name]


@pytest.mark.usefixtures("one_thread")
def test_a_registered_n_m_method_gets_the_n_m_rules_and_pattern(keep_leading: registry.Method) -> None:
    """Kind ``"n:m"`` alone makes a method a fixed per-layer pattern along the input dim (callback and app alike)."""
    with pytest.raises(ValueError, match=r"keep_leading with n=1, m=2 prunes 1 - n/m = 0\.5 of the weights in one"):
        PruningCallback(Constant(0.75), method="keep_leading")
    callback = PruningCallback(Constant(0.5), method="keep_leading")
    assert (callback.scope, callback.method_kwargs) == ("layerwise", {"n": 1, "m": 2})
    model = TinyNet()
    quiet_trainer([callback], max_epochs=1).fit(model)
    weights = dict(model.named_parameters())
    for name, (rows, cols) in WEIGHTS.items():
        odd_columns = (torch.arange(cols) % 2 == 1).expand(rows, cols)  # Linear's input dim is 1
        assert torch.equal(weights[name].detach() == 0, odd_columns), name
    cfg = app_config("keep_leading", schedule="constant", final_sparsity=0.5, scope="layerwise", nm_n=1, nm_m=2)
    validate_config(cfg)
    assert build_callback(cfg).method_kwargs == {"n": 1, "m": 2}
    with pytest.raises(ConfigError, match="keep_leading ranks its N:M groups within each layer: use scope=layerwise"):
        validate_config(app_config("keep_leading", schedule="constant", final_sparsity=0.5, nm_n=1, nm_m=2))


def test_a_registered_target_that_is_not_a_pruning_method_is_refused_by_name() -> None:
    """Before, the callback built the target with amount=0 and said its kwargs 'do not fit Linear'."""
    entry = registry.register(registry.Method("not_a_method", "torch.nn.Linear", "unstructured"))
    try:
        with pytest.raises(
            ValueError,
            match=r"method='not_a_method' is registered as <class 'torch.nn.modules.linear.Linear'>, which is not a",
        ):
            PruningCallback(0.5, method="not_a_method")
    finally:
        del registry.METHODS[entry.name]


def test_a_class_has_one_entry_and_names_are_plain() -> None:
    """A second entry for a class was accepted and silently ignored: the callback finds entries by class, so a
    '1:4' preset of SemiStructured pruned 2:4. Names that are import paths or empty were accepted too."""
    with pytest.raises(ValueError, match=r"SemiStructured is registered already, as 'semi_structured'.*subclass"):
        registry.register(registry.Method("semi_1_4", "lightprune.prune.SemiStructured", "n:m", defaults={"n": 1}))
    for name in ("", "lightprune.prune.L1Unstructured"):
        with pytest.raises(ValueError, match=r"must be a non-empty name without '\.'"):
            registry.register(registry.Method(name, f"{__name__}.PruneLeading", "unstructured"))
    assert "semi_1_4" not in registry.METHODS


class StructuredRows(prune.LnStructured):
    """A structured method of the test's own."""


def test_an_entry_whose_kind_its_class_contradicts_is_refused_by_the_callback(monkeypatch: pytest.MonkeyPatch) -> None:
    """Declared unstructured, the class structured: the rules read the kind (SET was let through) and the engine the
    class (channels), so SET moved single weights out of pruned channels, silently."""
    entry = registry.Method("rows_as_entries", f"{__name__}.StructuredRows", "unstructured")
    monkeypatch.setitem(registry.METHODS, entry.name, entry)
    with pytest.raises(ValueError, match=r"'rows_as_entries' says kind='unstructured', but StructuredRows.PRUNING_TYP"):
        PruningCallback(0.5, method="rows_as_entries", regrow="set")
    declared = registry.Method(entry.name, entry.target, "structured", defaults={"n": 1})
    monkeypatch.setitem(registry.METHODS, entry.name, declared)
    assert PruningCallback(0.5, method="rows_as_entries").scope == "layerwise"
