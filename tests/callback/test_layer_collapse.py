"""Layer collapse under ``PruningCallback``: said at the event, marked in the table, prevented by
``max_layer_sparsity`` with the global total exact (also resumed); impossible caps and untested strategies refused
before any step."""

from __future__ import annotations

import copy
import itertools
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceXLAStrategy,
    XLAStrategy,
)
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightprune import prune
from lightprune.callback import PruningCallback
from lightprune.callback.setup_checks import refuse_strategy
from lightprune.prune import LayerCollapseWarning
from lightprune.schedules import Linear
from tiny_lightning import TinyNet, quiet_trainer

pytestmark = pytest.mark.usefixtures("one_thread_for_module")


class MLP(L.LightningModule):
    """The issue's 20-64-2 MLP (or other widths), SGD on random two-class data."""

    def __init__(self, widths: tuple[int, ...] = (20, 64, 2), seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(itertools.pairwise(widths)):
            layers += [nn.Linear(a, b)] + ([nn.ReLU()] if i < len(widths) - 2 else [])
        self.net = nn.Sequential(*layers)
        self.widths = widths

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(16, self.widths[0], generator=generator)
        y = torch.randint(0, self.widths[-1], (16,), generator=generator)
        return DataLoader(TensorDataset(x, y), batch_size=8)


def fit(
    callback: PruningCallback,
    model: L.LightningModule,
    others: tuple[L.Callback, ...] = (),
    ckpt_path: Path | None = None,
    **options: Any,
) -> list[warnings.WarningMessage]:
    """Fit (2 steps unless told), returning the collapse warnings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_trainer([callback, *others], **{"max_steps": 2, **options}).fit(model, ckpt_path=ckpt_path)
    return [w for w in caught if issubclass(w.category, LayerCollapseWarning)]


def pruned(model: nn.Module, qualified: str) -> tuple[int, int]:
    """``(units, pruned)`` of a weight of ``model`` (pruned or not)."""
    owner = model.get_submodule(qualified.rsplit(".", 1)[0])
    mask = owner.weight_mask if hasattr(owner, "weight_mask") else torch.ones_like(owner.weight)
    return mask.numel(), int((mask == 0).sum())


def test_a_collapsed_output_layer_is_named_at_the_event_and_marked_in_the_table() -> None:
    model, callback = MLP(), PruningCallback(0.8, make_permanent=False)
    (warning,) = fit(callback, model)
    message = str(warning.message)
    assert message.startswith(
        "PruningCallback: the event at step 0 pruned every weight of net.2.weight: layer collapse"
    )
    assert "outputs its bias alone" in message and "max_layer_sparsity" in message
    assert pruned(model, "net.2.weight") == (128, 128)
    table = callback.summary_table().splitlines()
    (row,) = [line for line in table if line.startswith("net.2.weight")]
    assert row.split()[-2:] == ["100.00%", "COLLAPSED"]
    assert not any(line.startswith("net.0.weight") and "COLLAPSED" in line for line in table)
    assert table[-1].startswith("COLLAPSED: no weights left (layer collapse)")


def test_nothing_collapsed_nothing_said_and_the_cap_prevents_collapse() -> None:
    model, callback = MLP(), PruningCallback(0.5, make_permanent=False)
    assert fit(callback, model) == []
    assert "COLLAPSED" not in callback.summary_table()
    capped, callback = MLP(), PruningCallback(0.8, make_permanent=False, max_layer_sparsity=0.95)
    assert fit(callback, capped) == []
    assert pruned(capped, "net.2.weight") == (128, 121)  # 0.95 of 128, rounded down
    assert pruned(capped, "net.0.weight")[1] + 121 == round(0.8 * 1408)  # the total stays exact


def test_bert_classifier_collapse_under_activation_scores_is_named_and_prevented() -> None:
    transformers = pytest.importorskip("transformers")

    class TinyBert(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            config = transformers.BertConfig(
                vocab_size=64, hidden_size=48, num_hidden_layers=2, num_attention_heads=2, intermediate_size=96,
                max_position_embeddings=12, num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            )  # fmt: skip
            self.model = transformers.BertForSequenceClassification(config)

        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            (ids,) = batch
            return self.model(input_ids=ids, labels=ids[:, 0] % 2).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self) -> DataLoader:
            generator = torch.Generator().manual_seed(0)
            return DataLoader(TensorDataset(torch.randint(0, 64, (16, 12), generator=generator)), batch_size=8)

    options = {"importance": "activation", "scope": "global", "calibration_batches": 1, "make_permanent": False}
    model = TinyBert()
    (warning,) = fit(PruningCallback(0.5, **options), model, max_steps=1)
    assert "every weight of model.classifier.weight: layer collapse" in str(warning.message)
    assert pruned(model, "model.classifier.weight") == (96, 96)
    model, callback = TinyBert(), PruningCallback(0.5, max_layer_sparsity=0.9, **options)
    assert fit(callback, model, max_steps=1) == []
    counts = [pruned(model, name) for name in callback.selection]
    assert max(p / n for n, p in counts) <= 0.9
    assert pruned(model, "model.classifier.weight") == (96, 86)  # held at its cap
    assert sum(p for _, p in counts) == round(0.5 * sum(n for n, _ in counts))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    widths=st.lists(st.integers(1, 12), min_size=3, max_size=5),
    cap=st.floats(0.3, 1.0),
    target=st.floats(0.05, 0.95),
)
def test_capped_global_events_are_the_engines_exact_per_layer_and_in_total(
    widths: list[int], cap: float, target: float
) -> None:
    model = MLP(tuple(widths))
    reference = copy.deepcopy(model.net)
    callback = PruningCallback(target, max_layer_sparsity=cap, make_permanent=False)
    sizes = [a * b for a, b in itertools.pairwise(widths)]
    reachable = sum(max(p for p in range(n + 1) if p / n <= cap) for n in sizes)
    if round(target * sum(sizes)) > reachable:
        with pytest.raises(ValueError, match=rf"max_layer_sparsity={cap} lets at most {reachable} of the selection's"):
            fit(callback, model)
        assert not prune.is_pruned(model)  # refused before any event
        return
    fit(callback, model, max_steps=1)
    # the event ran at step 0, before training: the engine on the initial weights gives the same masks
    layers = [m for m in reference if isinstance(m, nn.Linear)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LayerCollapseWarning)
        prune.global_unstructured(
            [(m, "weight") for m in layers], prune.L1Unstructured, amount=round(target * sum(sizes)),
            max_layer_sparsity=cap,
        )  # fmt: skip
    for i, layer in zip(range(0, len(model.net), 2), layers, strict=True):
        mask = getattr(model.net[i], "weight_mask", torch.ones_like(layer.weight)).bool()  # (none: nothing pruned)
        assert torch.equal(mask, layer.weight_mask.bool())
        assert int((~mask).sum()) / mask.numel() <= cap


def test_capped_global_pruning_resumes_exactly(tmp_path: Path) -> None:
    def run(root: Path, ckpt_path: Path | None = None) -> tuple[TinyNet, PruningCallback]:
        model = TinyNet()
        callback = PruningCallback(Linear(final=0.85, start=0, end=12, frequency=4), max_layer_sparsity=0.87,
                                   make_permanent=False)  # fmt: skip
        checkpoints = ModelCheckpoint(root, every_n_epochs=1, save_top_k=-1)
        fit(callback, model, (checkpoints,), ckpt_path, max_steps=-1, max_epochs=2, enable_checkpointing=True)
        return model, callback

    model, callback = run(tmp_path / "a")
    counts = {name: pruned(model, name) for name in callback.selection}
    assert sum(p for _, p in counts.values()) == round(0.85 * sum(n for n, _ in counts.values()))
    assert all(p / n <= 0.87 for n, p in counts.values())
    assert any(p == max(q for q in range(n + 1) if q / n <= 0.87) for n, p in counts.values())
    resumed, _ = run(tmp_path / "b", ckpt_path=tmp_path / "a" / "epoch=0-step=8.ckpt")
    for name in callback.selection:
        owner = name.rsplit(".", 1)[0]
        assert torch.equal(model.get_submodule(owner).weight_mask, resumed.get_submodule(owner).weight_mask), name


def test_impossible_caps_are_refused_before_any_step() -> None:
    with pytest.raises(
        ValueError, match=r"max_layer_sparsity=0\.5: is below the final sparsity 0\.8, and scope=layerwise"
    ):
        PruningCallback(0.8, scope="layerwise", max_layer_sparsity=0.5)
    for bad in (0, 1.5, float("nan"), "0.9"):
        with pytest.raises(ValueError, match=r"max_layer_sparsity=.* must be a float in \(0, 1\]"):
            PruningCallback(0.5, max_layer_sparsity=bad)
    # a schedule in fractions of the run is checked once the run's length resolves it, before the first step
    late = PruningCallback(
        Linear(final=0.9, start=0, end=0.5, frequency=0.25), scope="layerwise", max_layer_sparsity=0.8
    )
    model = TinyNet()
    with pytest.raises(ValueError, match=r"below the final sparsity 0\.9"):
        fit(late, model, max_steps=4)
    assert model.trainer.global_step == 0 and not prune.is_pruned(model)
    # global: the capped layers cannot hold the final count (368 weights, at most 184 of them prunable)
    model = TinyNet()
    with pytest.raises(
        ValueError, match=r"lets at most 184 of the selection's 368 units \(50\.00%\) be pruned, fewer than"
    ):
        fit(PruningCallback(0.8, max_layer_sparsity=0.5), model)
    assert model.trainer.global_step == 0 and not prune.is_pruned(model)


def test_layerwise_stops_each_layer_at_the_cap() -> None:
    """Layers of 15 and 9 weights at 50%: rounding would take 8 of 15 (round(7.5)), the cap holds 7."""
    model = MLP((5, 3, 3))
    callback = PruningCallback(0.5, scope="layerwise", max_layer_sparsity=0.5, make_permanent=False)
    fit(callback, model)
    assert [pruned(model, name) for name in callback.selection] == [(15, 7), (9, 4)]


@pytest.mark.parametrize("kind", [DeepSpeedStrategy, XLAStrategy, SingleDeviceXLAStrategy])
def test_strategies_without_their_backends_are_refused_by_isinstance(kind: type) -> None:
    strategy = object.__new__(kind)  # their constructors need deepspeed / torch_xla; the check reads the class alone
    with pytest.raises(ValueError, match=rf"PruningCallback does not support {kind.__name__}: "):
        refuse_strategy(strategy)
    subclass = type("Mine", (kind,), {})  # a user's tweak of a refused strategy is refused too
    with pytest.raises(ValueError, match="PruningCallback does not support Mine: "):
        refuse_strategy(object.__new__(subclass))


def test_fsdp1_is_refused_at_setup_and_users_subclasses_of_tested_strategies_are_not() -> None:
    callback = PruningCallback(0.5)
    with pytest.raises(ValueError, match=r"does not support FSDPStrategy: FSDP1 flattens the parameters"):
        callback.setup(SimpleNamespace(strategy=FSDPStrategy()), TinyNet(), "fit")
    with pytest.raises(ValueError, match=r"does not support DeepSpeedStrategy: ZeRO keeps its own master weights"):
        refuse_strategy(object.__new__(DeepSpeedStrategy))

    class MyDDP(DDPStrategy):
        pass

    class MyParallel(ModelParallelStrategy):
        pass

    refuse_strategy(MyDDP())
    refuse_strategy(MyParallel())
    # and a fit under a user's DDPStrategy subclass (one CPU process) prunes as usual
    model, callback = TinyNet(), PruningCallback(0.5, make_permanent=False)
    fit(callback, model, strategy=MyDDP(process_group_backend="gloo"))
    assert sum(pruned(model, name)[1] for name in callback.selection) == round(0.5 * 368)


def test_a_structured_event_that_removes_every_channel_is_named_in_channels() -> None:
    model = TinyNet()
    callback = PruningCallback(
        Linear(final=1.0, start=0, end=2, frequency=2), method="ln_structured", scope="layerwise",
        include=r"net\.4\.weight", make_permanent=False,
    )  # fmt: skip
    (warning,) = fit(callback, model, max_steps=3)  # step 0 prunes nothing (level 0), step 2 every channel
    assert str(warning.message).startswith(
        "PruningCallback: the event at step 2 pruned every channel (dim 0) of net.4.weight: layer collapse"
    )
    assert "COLLAPSED: no channels (dim 0) left" in callback.summary_table()
