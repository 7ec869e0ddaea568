"""``PruningCallback`` beside each of Lightning's built-in callbacks, in both orders, and under ``LightningCLI``.

Each case asserts what a user relies on: the fit completes (or is refused clearly), the final model holds exactly
the schedule's zeros, every checkpoint holds plain weights with the masks' zeros, and nothing is silently undone.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import (
    BackboneFinetuning,
    BatchSizeFinder,
    Callback,
    DeviceStatsMonitor,
    EarlyStopping,
    EMAWeightAveraging,
    GradientAccumulationScheduler,
    LearningRateFinder,
    LearningRateMonitor,
    ModelCheckpoint,
    ModelSummary,
    OnExceptionCheckpoint,
    RichModelSummary,
    RichProgressBar,
    SpikeDetection,
    StochasticWeightAveraging,
    ThroughputMonitor,
    Timer,
)
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightprune import prune
from lightprune.callback import PruningCallback
from lightprune.schedules import Cubic

pytestmark = [
    pytest.mark.usefixtures("one_thread_for_module"),
    pytest.mark.filterwarnings("ignore:.*(ThroughputMonitor|SpikeDetection|swa_lrs|lr_find|Skipping|psutil).*"),
    pytest.mark.filterwarnings("ignore::UserWarning:lightning.*"),
]

WEIGHTS = ["head.0.weight", "head.2.weight", "backbone.0.weight"]
N = 16 * 12 + 12 * 4 + 8 * 16
SCHEDULE = Cubic(final=0.6, start=0, end=8, frequency=2)


class MatrixNet(L.LightningModule):
    """A small MLP with what the built-in callbacks look for: ``backbone``, ``batch_size``, ``lr``, ``val_loss``."""

    def __init__(self, batch_size: int = 8, lr: float = 0.05) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 4))
        self.batch_size, self.lr = batch_size, lr
        generator = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(64, 8, generator=generator), torch.randint(0, 4, (64,), generator=generator)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.backbone(x))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=self.lr, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x, self.y), batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x[:16], self.y[:16]), batch_size=8)


def checkpoint_dir(tmp_path: Path) -> Path:
    return tmp_path / "ckpt"


CASES: dict[str, Callable[[Path], Callback]] = {
    "EMAWeightAveraging": lambda tmp: EMAWeightAveraging(decay=0.9),
    "StochasticWeightAveraging": lambda tmp: StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=2),
    "BackboneFinetuning": lambda tmp: BackboneFinetuning(unfreeze_backbone_at_epoch=1),
    "BatchSizeFinder": lambda tmp: BatchSizeFinder(max_trials=2, steps_per_trial=2, init_val=4),
    "LearningRateFinder": lambda tmp: LearningRateFinder(num_training_steps=6),
    "GradientAccumulationScheduler": lambda tmp: GradientAccumulationScheduler({1: 2}),
    "ModelCheckpoint every_n_train_steps": lambda tmp: ModelCheckpoint(
        checkpoint_dir(tmp), every_n_train_steps=3, save_top_k=-1
    ),
    "ModelCheckpoint save_last weights_only": lambda tmp: ModelCheckpoint(
        checkpoint_dir(tmp), save_last=True, save_weights_only=True
    ),
    "ModelCheckpoint top-k val_loss": lambda tmp: ModelCheckpoint(
        checkpoint_dir(tmp), monitor="val_loss", save_top_k=2
    ),
    "OnExceptionCheckpoint": lambda tmp: OnExceptionCheckpoint(checkpoint_dir(tmp)),
    "EarlyStopping": lambda tmp: EarlyStopping("val_loss", patience=10),
    "Timer": lambda tmp: Timer(duration="00:00:10:00"),
    "LearningRateMonitor": lambda tmp: LearningRateMonitor(),
    "ThroughputMonitor": lambda tmp: ThroughputMonitor(batch_size_fn=lambda batch: batch[0].shape[0]),
    "DeviceStatsMonitor": lambda tmp: DeviceStatsMonitor(cpu_stats=True),
    "SpikeDetection": lambda tmp: SpikeDetection(),
    "ModelSummary": lambda tmp: ModelSummary(max_depth=2),
    "RichModelSummary": lambda tmp: RichModelSummary(),
    "RichProgressBar": lambda tmp: RichProgressBar(),
}


def zeros_of(state_dict: dict[str, Tensor]) -> int:
    return sum(int((state_dict[name] == 0).sum()) for name in WEIGHTS)


@pytest.mark.parametrize("pruning_first", [True, False], ids=["pruning first", "pruning second"])
@pytest.mark.parametrize("case", list(CASES))
def test_builtin_callback_beside_pruning(tmp_path: Path, case: str, pruning_first: bool) -> None:
    other = CASES[case](tmp_path)
    pruning = PruningCallback(SCHEDULE)
    callbacks = [pruning, other] if pruning_first else [other, pruning]
    model = MatrixNet()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=3,
        callbacks=callbacks,
        logger=CSVLogger(tmp_path, name="logs"),
        enable_progress_bar=isinstance(other, RichProgressBar),
        enable_model_summary=isinstance(other, (ModelSummary, RichModelSummary)),
        enable_checkpointing=isinstance(other, (ModelCheckpoint, OnExceptionCheckpoint)),
        default_root_dir=tmp_path,
        num_sanity_val_steps=0,
    )
    trainer.fit(model)
    assert trainer.state.finished, trainer.state
    # the final model holds exactly the schedule's zeros, as plain Parameters
    assert not prune.is_pruned(model)
    final = {name: model.get_parameter(name).detach() for name in WEIGHTS}
    assert zeros_of(final) == round(SCHEDULE.final_sparsity * N)
    # every checkpoint: plain weights that load into the plain model, with the zeros of the masks it records
    for path in sorted(checkpoint_dir(tmp_path).glob("*.ckpt")):
        checkpoint = torch.load(path, weights_only=False)
        state = checkpoint["state_dict"]
        assert not any(key.endswith(("_orig", "_mask")) for key in state), path.name
        MatrixNet().load_state_dict(state, strict=True)
        saved = [v for k, v in checkpoint.get("callbacks", {}).items() if k.startswith("PruningCallback")]
        for name, mask in (saved[0]["masks"] if saved else {}).items():
            assert not bool(state[name][~mask].any()), (path.name, name)
        if saved and saved[0]["masks"]:
            step = checkpoint["global_step"]
            pruned = sum(int((~mask).sum()) for mask in saved[0]["masks"].values())
            assert pruned == zeros_of(state) == round(SCHEDULE.target(step) * N), (path.name, step, pruned)


@pytest.mark.parametrize("masking", ["reparametrize", "inplace"])
def test_averaged_checkpoint_at_an_event_holds_that_events_zeros(tmp_path: Path, masking: str) -> None:
    """EMA's checkpoints hold the averaged weights: one saved at the step of an event has that event's zeros."""
    checkpoints = ModelCheckpoint(checkpoint_dir(tmp_path), every_n_train_steps=2, save_top_k=-1)  # events: 0, 2, ...
    pruning = PruningCallback(SCHEDULE, masking=masking)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=10,
        callbacks=[EMAWeightAveraging(decay=0.9), pruning, checkpoints],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=tmp_path,
    )
    trainer.fit(MatrixNet())
    paths = sorted(checkpoint_dir(tmp_path).glob("*.ckpt"))
    assert len(paths) == 5
    for path in paths:
        checkpoint = torch.load(path, weights_only=False)
        (saved,) = [v for k, v in checkpoint["callbacks"].items() if k.startswith("PruningCallback")]
        state, step = checkpoint["state_dict"], checkpoint["global_step"]
        pruned = sum(int((~mask).sum()) for mask in saved["masks"].values())
        assert pruned == zeros_of(state) == round(SCHEDULE.target(step) * N), (masking, step)
        assert zeros_of(MatrixNet.load_from_checkpoint(path).state_dict()) == pruned


# ----------------------------------------------------------------------------------------------------------------------
# OnExceptionCheckpoint: an interrupted fit resumes exactly
# ----------------------------------------------------------------------------------------------------------------------


class FailAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError("injected failure")


def test_on_exception_checkpoint_holds_plain_weights_and_masks(tmp_path: Path) -> None:
    model = MatrixNet()
    callbacks = [PruningCallback(SCHEDULE), OnExceptionCheckpoint(tmp_path, filename="on_exception"), FailAt(6)]
    trainer = L.Trainer(max_epochs=3, callbacks=callbacks, logger=False, enable_progress_bar=False,
                        default_root_dir=tmp_path, num_sanity_val_steps=0)  # fmt: skip
    with pytest.raises(RuntimeError, match="injected failure"):
        trainer.fit(model)
    checkpoint = torch.load(tmp_path / "on_exception.ckpt", weights_only=True)
    (saved,) = [v for k, v in checkpoint["callbacks"].items() if k.startswith("PruningCallback")]
    assert not any(key.endswith(("_orig", "_mask")) for key in checkpoint["state_dict"])
    pruned = sum(int((~mask).sum()) for mask in saved["masks"].values())
    assert pruned == round(SCHEDULE.target(6) * N) and zeros_of(checkpoint["state_dict"]) >= pruned
    resumed = MatrixNet()
    again = L.Trainer(max_epochs=3, callbacks=[PruningCallback(SCHEDULE)], logger=False, enable_progress_bar=False,
                      default_root_dir=tmp_path, num_sanity_val_steps=0)  # fmt: skip
    again.fit(resumed, ckpt_path=tmp_path / "on_exception.ckpt")
    assert zeros_of({n: resumed.get_parameter(n) for n in WEIGHTS}) == round(SCHEDULE.final_sparsity * N)


# ----------------------------------------------------------------------------------------------------------------------
# Tuner runs (lr_find, scale_batch_size): no pruning during them, weights restored
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tune", ["lr_find", "scale_batch_size"])
def test_tuner_runs_do_not_prune_and_restore_the_weights(tmp_path: Path, tune: str) -> None:
    from lightning.pytorch.tuner import Tuner

    model = MatrixNet()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = L.Trainer(max_epochs=3, callbacks=[PruningCallback(SCHEDULE)], logger=False, enable_progress_bar=False,
                        default_root_dir=tmp_path, num_sanity_val_steps=0)  # fmt: skip
    tuner = Tuner(trainer)
    if tune == "lr_find":
        tuner.lr_find(model, num_training=6)
    else:
        tuner.scale_batch_size(model, max_trials=2, steps_per_trial=2, init_val=4)
    assert not prune.is_pruned(model)
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], v) for k, v in before.items() if k in WEIGHTS)
    trainer.fit(model)
    assert zeros_of({n: model.get_parameter(n) for n in WEIGHTS}) == round(SCHEDULE.final_sparsity * N)


FINDERS: dict[str, Callable[[], Callback]] = {
    "LearningRateFinder": lambda: LearningRateFinder(num_training_steps=6),
    "BatchSizeFinder": lambda: BatchSizeFinder(max_trials=2, steps_per_trial=2, init_val=4),
}


def finder_trainer(tmp_path: Path, callbacks: list[Callback]) -> L.Trainer:
    return L.Trainer(max_epochs=1, callbacks=callbacks, logger=False, enable_progress_bar=False,
                     enable_checkpointing=False, default_root_dir=tmp_path, num_sanity_val_steps=0)  # fmt: skip


@pytest.mark.parametrize("pruning_first", [True, False], ids=["pruning first", "pruning second"])
@pytest.mark.parametrize("finder", list(FINDERS))
def test_a_finders_restore_inside_fit_is_no_resume(tmp_path: Path, finder: str, pruning_first: bool) -> None:
    """The finders put back their own checkpoint inside fit, before training: the fit still starts the schedule, so
    an event at step 0 gets the checks and the calibration of one (not the ranking of a resumed fit)."""
    movement = PruningCallback(0.5, importance="movement")
    callbacks = [movement, FINDERS[finder]()]
    with pytest.raises(ValueError, match=r"importance='movement' needs optimizer steps before an event"):
        finder_trainer(tmp_path, callbacks if pruning_first else callbacks[::-1]).fit(MatrixNet())

    activation = PruningCallback(0.5, importance="activation", scope="row", calibration_batches=2)
    callbacks = [activation, FINDERS[finder]()]
    model = MatrixNet()
    finder_trainer(tmp_path, callbacks if pruning_first else callbacks[::-1]).fit(model)
    for name in WEIGHTS:  # every row keeps half: a row-wise event ranked on the calibration batches' statistics
        weight = model.get_parameter(name)
        assert torch.equal((weight == 0).sum(dim=1), torch.full((weight.shape[0],), weight.shape[1] // 2)), name


# ----------------------------------------------------------------------------------------------------------------------
# LightningCLI: the callback from the command line and from YAML
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["command line", "yaml class_path with a Cubic schedule"])
def test_lightning_cli_builds_and_runs_the_callback(tmp_path: Path, how: str) -> None:
    pytest.importorskip("jsonargparse")
    from lightning.pytorch.cli import LightningCLI

    if how == "command line":
        callback_args = ["--trainer.callbacks+=lightprune.PruningCallback", "--trainer.callbacks.schedule=0.5"]
    else:
        config = tmp_path / "config.yaml"
        config.write_text(
            "trainer:\n"
            "  callbacks:\n"
            "    - class_path: lightprune.PruningCallback\n"
            "      init_args:\n"
            "        schedule:\n"
            "          class_path: lightprune.schedules.Cubic\n"
            "          init_args: {final: 0.5, start: 0, end: 8, frequency: 2}\n"
            "        scope: layerwise\n"
        )
        callback_args = [f"--config={config}"]
    args = [
        "fit",
        "--trainer.max_epochs=2",
        "--trainer.logger=false",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_checkpointing=false",
        f"--trainer.default_root_dir={tmp_path}",
        *callback_args,
    ]
    cli = LightningCLI(MatrixNet, args=args, save_config_kwargs={"overwrite": True})
    (pruning,) = [c for c in cli.trainer.callbacks if isinstance(c, PruningCallback)]
    assert pruning.scope == ("layerwise" if how != "command line" else "global")
    weights = {n: cli.model.get_parameter(n) for n in WEIGHTS}
    if how == "command line":
        assert zeros_of(weights) == round(0.5 * N)
    else:
        assert all(int((w == 0).sum()) == round(0.5 * w.numel()) for w in weights.values())
