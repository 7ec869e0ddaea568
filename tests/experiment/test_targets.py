"""The app on a user's own model, data, optimizer and LR schedule, all given as Hydra ``_target_`` nodes.

The user's classes live in a module written to a temporary folder on ``sys.path`` (as a user's package would be),
so the config names them by import path and the app knows nothing about them.
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig
from torch import nn

from lightprune.experiment import load_run
from lightprune.experiment.app import config_dir, run_experiment
from lightprune.experiment.config import ConfigError, register_configs, validate_config

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*no `validation_step`.*"),
]

USER_CODE = '''
import torch
import lightning.pytorch as pl
from torch import nn

STEP_LRS = []


class Net(nn.Module):
    def __init__(self, width: int, classes: int = 3):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(6, width), nn.BatchNorm1d(width), nn.ReLU())
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        return self.head(self.body(x))


class HeadFirst(nn.Module):
    """The output layer defined before the hidden one."""

    def __init__(self, width: int, classes: int = 3):
        super().__init__()
        self.head = nn.Linear(width, classes)
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(6, width), nn.ReLU())

    def forward(self, x):
        return self.head(self.body(x))


class Data(pl.LightningDataModule):
    """Three separable classes of 6 features; no num_classes attribute (the config gives it)."""

    def __init__(self, batch_size: int = 32, n: int = 192):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.y = torch.arange(n) % 3
        self.x = torch.randn(n, 6, generator=generator) * 0.3 + nn.functional.one_hot(self.y, 6).float() * 2
        self.batch_size = batch_size

    def _loader(self, shuffle: bool):
        dataset = torch.utils.data.TensorDataset(self.x, self.y)
        return torch.utils.data.DataLoader(dataset, batch_size=self.batch_size, shuffle=shuffle)

    def train_dataloader(self):
        return self._loader(True)

    def val_dataloader(self):
        return self._loader(False)

    def test_dataloader(self):
        return self._loader(False)


class RecordingSGD(torch.optim.SGD):
    def step(self, closure=None):
        STEP_LRS.append(self.param_groups[0]["lr"])
        return super().step(closure)


class OwnModule(pl.LightningModule):
    """A LightningModule the user already has: its own steps, optimizer and metric name."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.net = Net(width)
        self.example_input_array = torch.zeros(1, 6)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_acc", (self(x).argmax(1) == y).float().mean())

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)
'''

TINY = ["experiment=smoke", "cache.dense=false", "plots=false"]
MODEL = "{_target_:lp_user_code.Net,width:16}"
DATA = "{_target_:lp_user_code.Data,num_classes:3,input_shape:[6]}"
ADAM = "optim.dense.optimizer={_target_:torch.optim.Adam,_partial_:true,lr:0.03}"
USER = ["~model", f"+model={MODEL}", "~data", f"+data={DATA}"]
"""On the command line a ``_target_`` node replaces a bundled option with ``~group +group={...}`` (in a file: a
config group option of the user's own config directory)."""


@pytest.fixture(autouse=True)
def user_code(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    folder = tmp_path_factory.mktemp("user")
    (folder / "lp_user_code.py").write_text(textwrap.dedent(USER_CODE))
    sys.path.insert(0, str(folder))
    import lp_user_code

    yield lp_user_code
    sys.path.remove(str(folder))
    sys.modules.pop("lp_user_code", None)


def make_config(*overrides: str) -> DictConfig:
    register_configs()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_an_nn_module_and_a_datamodule_by_target_are_pruned_summarized_and_reloaded(tmp_path: Path) -> None:
    cfg = make_config(*TINY, *USER, ADAM, "pruning=one_shot", "pruning.final_sparsity=0.5")
    summary = run_experiment(cfg, tmp_path)
    assert summary.final_test_acc > 0.6
    assert set(summary.layer_sparsity) == {"model.body.1.weight", "model.head.weight"}
    assert summary.flops_layers == ["model.body.1", "model.head"] and summary.flops_unattributed == 0
    assert summary.dense_flops == 6 * 16 + 16 * 3 and summary.theoretical_speedup > 1.5
    model = load_run(tmp_path)
    assert type(model).__name__ == "Net"
    weights = {"model.body.1.weight": model.body[1].weight, "model.head.weight": model.head.weight}
    zeros = {name: int((weight == 0).sum()) for name, weight in weights.items()}  # counted here, in the saved model
    total = sum(weight.numel() for weight in weights.values())
    assert sum(zeros.values()) == round(0.5 * total)  # global one-shot: exactly half of the selected weights
    assert summary.total_sparsity == sum(zeros.values()) / total
    for name, weight in weights.items():
        assert summary.layer_sparsity[name] == zeros[name] / weight.numel(), name


def test_a_lightning_module_by_target_is_used_as_it_is(tmp_path: Path, user_code: object) -> None:
    own = ["~model", "+model={_target_:lp_user_code.OwnModule}", "~data", "+data={_target_:lp_user_code.Data}"]
    cfg = make_config(*TINY, *own)
    summary = run_experiment(cfg, tmp_path)
    assert summary.num_classes is None  # the module needs none: it brings its own metric
    assert summary.final_test_acc is not None
    total = sum(module.weight.numel() for module in user_code.Net(16).modules() if isinstance(module, nn.Linear))
    assert summary.total_weights == total and total - summary.nonzero_weights == round(0.9 * total)
    assert "net.head.weight" in summary.layer_sparsity and summary.dense_flops == 6 * 16 + 16 * 3


@pytest.mark.parametrize("rewind", [True, False])
def test_optimizer_and_schedule_per_phase_and_learning_rate_rewinding(
    tmp_path: Path, user_code: object, rewind: bool
) -> None:
    sgd = "{_target_:lp_user_code.RecordingSGD,_partial_:true,lr:0.1}"
    cosine = "{_target_:torch.optim.lr_scheduler.CosineAnnealingLR,_partial_:true,eta_min:0.001}"
    cfg = make_config(
        *TINY, *USER, "pruning=iterative_rounds", "pruning.rounds=2", "trainer.max_epochs=1",
        f"optim.dense.optimizer={sgd}", f"optim.dense.scheduler={cosine}", "optim.dense.interval=step",
        f"optim.lr_rewind={str(rewind).lower()}",
    )  # fmt: skip
    user_code.STEP_LRS.clear()  # type: ignore[attr-defined]
    run_experiment(cfg, tmp_path)
    lrs = list(user_code.STEP_LRS)  # type: ignore[attr-defined]
    steps = len(lrs) // 3  # the dense phase (1 epoch) and 2 rounds of 1 epoch: the same steps each
    dense, round_1, round_2 = lrs[:steps], lrs[steps : 2 * steps], lrs[2 * steps :]
    assert dense[0] == pytest.approx(0.1) and dense[-1] < 0.1  # cosine over the phase's steps (T_max filled in)
    if rewind:  # each round replays the schedule from its start
        assert round_1 == pytest.approx(dense) and round_2 == pytest.approx(dense)
    else:  # fine-tuning at the learning rate the dense phase ended with, no scheduler
        final = round_1[0]
        assert final < dense[0] and set(round_1 + round_2) == {final}


def test_exclude_classifier_keeps_the_layer_the_forward_ends_with_whatever_the_definition_order(
    tmp_path: Path,
) -> None:
    model = ["~model", "+model={_target_:lp_user_code.HeadFirst,width:16}", "~data", f"+data={DATA}"]
    summary = run_experiment(
        make_config(*TINY, *model, "pruning=ln_structured", "pruning.final_sparsity=0.5"), tmp_path
    )
    assert set(summary.layer_sparsity) == {"model.body.1.weight"}  # the output layer stays whole


def test_fine_tuning_carried_over_at_learning_rate_0_is_warned(tmp_path: Path, user_code: object, caplog) -> None:
    cosine = "{_target_:torch.optim.lr_scheduler.CosineAnnealingLR,_partial_:true}"  # eta_min 0: it ends at 0
    cfg = make_config(
        *TINY, *USER, "trainer.max_epochs=1", "optim.dense.optimizer={_target_:torch.optim.SGD,_partial_:true,lr:0.1}",
        f"optim.dense.scheduler={cosine}", "optim.dense.interval=step", "optim.lr_rewind=false",
    )  # fmt: skip
    with caplog.at_level("WARNING", logger="lightprune.experiment.app"):
        run_experiment(cfg, tmp_path)
    assert "prune trains at learning rate 0: the previous phase's schedule ended there" in caplog.text


def test_target_errors_are_one_line_naming_the_key_the_path_and_the_complaint(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model: _target_ 'lp_user_code\.Nope' cannot be imported"):
        validate_config(make_config(*TINY, "~model", "+model={_target_:lp_user_code.Nope}", *USER[2:]))
    with pytest.raises(ConfigError, match=r"optim\.dense\.optimizer: _partial_ must be true"):
        validate_config(make_config(*TINY, *USER, "optim.dense.optimizer={_target_:torch.optim.SGD,lr:0.1}"))
    cfg = make_config(*TINY, "~model", "+model={_target_:lp_user_code.Net}", *USER[2:])  # width missing
    with pytest.raises(ConfigError) as info:
        run_experiment(cfg, tmp_path / "run")
    message = str(info.value)
    assert "\n" not in message and message.startswith("model: lp_user_code.Net(...) failed: TypeError:"), message
    assert "width" in message
    cfg = make_config(*TINY, *USER[:2], "~data", "+data={_target_:lp_user_code.Data}")  # no num_classes anywhere
    with pytest.raises(ConfigError, match=r"^data\.num_classes: lp_user_code\.Data has no num_classes attribute"):
        run_experiment(cfg, tmp_path / "run2")


@pytest.mark.parametrize("model", ["lenet300100", "small_cnn"])
def test_the_bundled_presets_are_target_nodes_a_users_app_instantiates(model: str) -> None:
    """``instantiate(cfg.data)`` and ``build_model(cfg.model, ...)`` give what the app trains, from the presets."""
    from hydra.utils import instantiate

    from lightprune.experiment.config import is_bundled
    from lightprune.experiment.models import LeNet300100, SmallCNN
    from lightprune.experiment.targets import build_model

    cfg = make_config(f"model={model}", "model.hidden=[12]", "model.channels=[3]", "data.batch_size=16")
    assert is_bundled(cfg.model) and is_bundled(cfg.data)
    datamodule = instantiate(cfg.data)
    assert datamodule.batch_size == 16 and datamodule.split_sizes == {"train": 1258, "val": 180, "test": 359}
    network = build_model(cfg.model, datamodule.dims, datamodule.num_classes)
    if model == "lenet300100":
        assert isinstance(network, LeNet300100) and (network.fc1.in_features, network.fc1.out_features) == (64, 12)
    else:
        assert isinstance(network, SmallCNN) and network.conv1.out_channels == 3
    for group in ("model", "data"):
        for preset in (config_dir() / group).glob("*.yaml"):
            assert "\n_target_: lightprune.experiment." in preset.read_text(), preset


def test_a_model_target_gets_the_data_sizes_only_where_its_constructor_requires_them(user_code: object) -> None:
    from lightprune.experiment.targets import build_model

    class Sized(nn.Module):
        def __init__(self, input_shape: tuple[int, ...], num_classes: int, width: int = 4) -> None:
            super().__init__()
            self.fc = nn.Linear(int(torch.tensor(input_shape).prod()), num_classes)

    class Defaulted(nn.Module):
        def __init__(self, num_classes: int = 5) -> None:
            super().__init__()
            self.fc = nn.Linear(2, num_classes)

    user_code.Sized, user_code.Defaulted = Sized, Defaulted
    sized = build_model({"_target_": "lp_user_code.Sized"}, (2, 3), 7)
    assert (sized.fc.in_features, sized.fc.out_features) == (6, 7)
    assert build_model({"_target_": "lp_user_code.Defaulted"}, (2, 3), 7).fc.out_features == 5  # its default holds
    assert build_model({"_target_": "lp_user_code.Sized", "num_classes": 2}, (2, 3), 7).fc.out_features == 2
