"""``PruningCallback`` beside Lightning's other moving parts: another pruning callback, spawned workers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelPruning

from lightprune import prune
from lightprune.callback import PruningCallback
from lightprune.schedules import Cubic
from tiny_lightning import TinyNet

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*"),
]

WEIGHTS = ["net.0.weight", "net.2.weight", "net.4.weight"]
N = 128 + 192 + 48


def trainer(callbacks: list[Any], tmp_path: Path, **kwargs: Any) -> L.Trainer:
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": 2,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "default_root_dir": tmp_path,
    }
    options.update(kwargs)
    return L.Trainer(callbacks=callbacks, **options)


@pytest.mark.parametrize("order", ["PruningCallback first", "ModelPruning first"])
def test_lightnings_model_pruning_beside_is_refused_at_setup(tmp_path: Path, order: str) -> None:
    callbacks = [PruningCallback(0.5), ModelPruning("l1_unstructured", amount=0.3)]
    if order == "ModelPruning first":
        callbacks.reverse()
    model = TinyNet()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"cannot share a Trainer with lightning's ModelPruning"):
        trainer(callbacks, tmp_path).fit(model)
    assert {k: v for k, v in model.state_dict().items()}.keys() == before.keys()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("make_permanent", [True, False])
def test_ddp_spawn_returns_the_pruned_trained_model_to_the_main_process(tmp_path: Path, make_permanent: bool) -> None:
    model = TinyNet()
    initial = {name: model.get_parameter(name).detach().clone() for name in WEIGHTS}
    callback = PruningCallback(Cubic(final=0.8, start=0, end=6, frequency=2), make_permanent=make_permanent)
    run = trainer([callback], tmp_path, devices=2, strategy="ddp_spawn", max_epochs=2)
    run.fit(model)
    assert not prune.is_pruned(model)  # plain tensors in the main process, whatever make_permanent
    weights = {name: model.get_parameter(name).detach() for name in WEIGHTS}
    assert sum(int((w == 0).sum()) for w in weights.values()) == round(0.8 * N)
    for name, weight in weights.items():  # trained: the kept weights moved away from their initial values
        kept = weight != 0
        assert not torch.equal(weight[kept], initial[name][kept]), name
