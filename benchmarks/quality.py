"""Accuracy at sparsity on Fashion-MNIST: lightprune's PruningCallback side by side with lightning's ModelPruning.

The protocol is fixed so results compare (issue #7):

* Data: Fashion-MNIST in MNIST IDX format (Debian's ``dataset-fashion-mnist``, /usr/share/datasets/fashion-mnist),
  60,000 training / 10,000 test images, pixels scaled to [0, 1], flattened.
* Model: LeNet-300-100 (784-300-100-10, ReLU). Only the three Linear weights are pruned (266,200); biases never.
* Training: 20 epochs, Adam lr 1.2e-3, batch 128 shuffled, cross-entropy. Test accuracy on the 10,000 test images
  after fit; seeds 0, 1, 2 (mean +- std). The seed fixes the initial weights and the shuffle, so the arms of one
  seed start from the same network and see the same batches.
* Sparsity 0.90, 0.95, 0.98, 0.99 of the 266,200 weights, verified by counting exact zeros after fit.

Arms (``--arms``; see :data:`ARMS`):

* ``dense``: no pruning.
* ``modelpruning``: lightning's ``ModelPruning``, ``l1_unstructured``, global, amount ``a = 1 - (1 - s) ** (1/14)``
  at epochs 1..14 (at the end of those epochs), no lottery-ticket reset, ``make_pruning_permanent=True``.
* ``lp_control``: lightprune with ModelPruning's schedule: ``Geometric(a, start=2, rounds=14)`` in epochs (an epoch
  event at ``e`` runs after ``e`` epochs, i.e. where ModelPruning's end-of-epoch ``e - 1`` does).
* ``lp_gradual``: lightprune, global L1, ``Cubic`` schedule (Zhu & Gupta 2017) in optimizer steps from 5% to 60%
  of the run, an event every 0.5% of the run (47 steps here), then 40% of the run to recover at the final sparsity.
* ``lp_gradual_layerwise``: the same schedule, every layer pruned to the same sparsity.
* ``lp_one_shot``: lightprune, global L1, to ``s`` at once after 10 epochs, then 10 epochs of fine-tuning.
* ``lp_one_shot_rewind``: the same, then the surviving weights rewound to their values after epoch 1 (lottery-ticket
  rewinding, Frankle et al. 2020) and retrained for the remaining 10 epochs.
* ``lp_one_shot_cosine_ft`` (run only when named in ``--arms``): a learning-rate schedule for the protocol's Adam:
  a cosine from 1.2e-3 to 1.2e-5 over the first 10 epochs (epoch-wise, as ``CosineAnnealingLR(T_max=10,
  eta_min=lr/100)``), one-shot to ``s`` after them, then 10 epochs of fine-tuning at the schedule's final learning
  rate (1.2e-5): the fine-tuning baseline of Renda, Frankle & Carbin (2020).
* ``lp_2_4`` (run only when named): 2:4 semi-structured pruning (``method="semi_structured"``, two of every four
  consecutive inputs kept in every row; the three layers' inputs, 784, 300 and 100, are multiples of 4), one-shot
  after 10 epochs, then 10 epochs of fine-tuning. Its sparsity is 0.5 whatever ``--sparsities`` says.
* ``lp_gradual_erk`` (run only when named): ``lp_gradual``'s schedule, each layer ranked alone with its ERK share
  (``scope="erk"``: density proportional to ``(fan_in + fan_out) / (fan_in * fan_out)``).
* ``lp_rigl_erk``, ``lp_set_erk`` (run only when named): dynamic sparse training, sparse from the first step: ERK
  amounts at step 0 from the initial weights, then every 100 steps each layer drops 30% of its active weights
  (cosine-decayed to 0 at 75% of the run) and regrows as many where the dense gradient is largest (RigL) or at random
  (SET); ``--regrow EVERY,FRACTION,UNTIL`` changes these three settings (of these arms only), and ``--sparse-init``
  scales each row's initial weights to its kept fan-in once the first masks are on (Evci et al. 2022);
  ``--warm-regrown-adam`` sets a regrown weight's Adam second moment to the mean of its tensor's other active
  weights' instead of zero (zeroed, with the global step count long past Adam's bias correction, a regrown weight's
  first steps are 3-6x the learning rate).
* ``lp_rigl_erk_3x``, ``lp_set_erk_3x`` (run only when named): the same in 3x the protocol's epochs (60), the
  regrow schedule scaled with the run.
* ``lp_one_shot_lr_rewind`` (run only when named): the same training and pruning, then learning-rate rewinding
  (Renda et al. 2020): the 10 retraining epochs replay the cosine from its start (1.2e-3 -> 1.2e-5), weights not
  rewound. Under the protocol's constant learning rate, rewinding the learning rate changes nothing
  (``lp_one_shot`` is both), so it is measured against ``lp_one_shot_cosine_ft``, which shares its schedule.

Pruning criteria (issue 22): ``--importance magnitude activation movement`` runs every lightprune arm once per
criterion, the callback's ``importance=``: ``magnitude`` (|W|, the default), ``activation`` (|W_ij| * ||X_j||_2
with the layer inputs collected over the callback's window of training steps before each event; Wanda) or
``movement`` (movement pruning, Sanh et al. 2020: the weights that move towards zero go) or ``obs`` (Optimal Brain
Surgeon saliency from ``H = X^T X`` of the layer inputs over a window of 8 steps, 1,024 images, before each event,
with SparseGPT's update of the kept weights). A criterion other than
magnitude is named in the run's key and in the tables' arm column (``lp_gradual [activation]``).

The gradual schedule's start, end and frequency were chosen before any run, from Zhu & Gupta's recipe (start
after a short dense phase, end with a long enough recovery phase, prune every few dozen steps), and were not tuned
on the test set. ``--val-size N`` holds N training images out and reports accuracy on them instead, for tuning;
with ``--gradual START,END,FREQUENCY`` five schedules were compared that way, and this one was best (BENCHMARKS.md).

``--lr-schedule cosine`` changes every arm's learning rate from the protocol's constant 1.2e-3 to a cosine from
1.2e-3 to 1.2e-5 over the arm's own epochs, set at each epoch start (60 epochs for the ``_3x`` arms): the decayed
schedule that RigL's and Zhu & Gupta's experiments train with. It refuses the two arms with a schedule of their own
(``lp_one_shot_cosine_ft``, ``lp_one_shot_lr_rewind``).

Training FLOPs: every run counts the multiply-adds of the three Linear weights step by step, as the masks were at
each step (:class:`TrainingFlops`: forward ``n``, backward ``2n`` per sample with ``n`` the unpruned entries; a dense
weight gradient at RigL's update steps), and the report gives them relative to the dense model's training in the
protocol's epochs (dense = 1). The count depends on the arm, sparsity and settings only, not on the seed (every
event's total is exact); runs cached from before the count have none, and the report averages the runs that have it.

Epoch time: after the accuracy runs (alone on the machine), three-epoch fits of the dense model, of lightprune's
callback (bool masks, its default, and float masks) and of ModelPruning, each pruning to 90% after epoch 0, run
interleaved ``--timing-repeats`` times; the table gives the median time of the last epoch (reparametrized weights,
an optimizer state warmed up as in a real run, no pruning event inside it), its ratio to the dense model's median,
and the median over repeats of the ratio to the dense fit of the same repeat (paired, so less sensitive to a machine
whose speed drifts).

Every run is a fresh process (``--jobs`` at a time, ``--threads`` torch threads each; ``--quick`` runs, seconds long,
share ``--jobs`` processes) and leaves a JSON file under ``OUT/runs``; a rerun with the same settings reuses them
(``--fresh`` to redo), so an interrupted benchmark resumes.

Usage:
    python benchmarks/quality.py                        # the full benchmark: 75 runs, 30-45 minutes on 2 cores
    python benchmarks/quality.py --quick                # a smoke run of every arm: a few minutes
    python benchmarks/quality.py --seeds 0 --sparsities 0.98 --arms modelpruning lp_gradual

Writes ``OUT/quality.md`` (the tables), ``OUT/quality.png`` (accuracy against sparsity, both tools),
``OUT/quality_flops.png`` (accuracy against training FLOPs, where counted) and ``OUT/quality.json``; OUT defaults
to ``benchmarks/results/quality``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field, replace
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn

from lightprune import PruningCallback
from lightprune.experiment.data import IDX_FILES, read_idx
from lightprune.experiment.models import LeNet300100
from lightprune.schedules import Constant, Cubic, Geometric

sys.path.insert(0, str(Path(__file__).resolve().parent))  # machine.py, also when a test loads this file
from machine import describe

FASHION_MNIST_ROOT = "/usr/share/datasets/fashion-mnist"
LAYERS = ("fc1", "fc2", "fc3")
MP_ROUNDS = 14
"""ModelPruning prunes at the end of epochs 1..14: 14 geometric rounds."""

ARMS = {
    "dense": "dense (no pruning)",
    "modelpruning": "lightning ModelPruning, geometric per epoch (torch.nn.utils.prune)",
    "lp_control": "lightprune, ModelPruning's geometric per-epoch schedule (control)",
    "lp_gradual": "lightprune, gradual cubic in steps, global",
    "lp_gradual_layerwise": "lightprune, gradual cubic in steps, layerwise",
    "lp_one_shot": "lightprune, one-shot after 10 epochs, fine-tune",
    "lp_one_shot_rewind": "lightprune, one-shot after 10 epochs, rewind to epoch 1, retrain",
    "lp_one_shot_cosine_ft": "lightprune, cosine LR for 10 epochs, one-shot, fine-tune at the final LR",
    "lp_one_shot_lr_rewind": "lightprune, cosine LR for 10 epochs, one-shot, retrain replaying the cosine",
    "lp_2_4": "lightprune, 2:4 semi-structured one-shot after 10 epochs, fine-tune (sparsity 0.5)",
    "lp_gradual_erk": "lightprune, gradual cubic in steps, ERK per-layer amounts",
    "lp_rigl_erk": "lightprune, RigL from step 0 with ERK amounts (sparse from the start)",
    "lp_set_erk": "lightprune, SET from step 0 with ERK amounts (sparse from the start)",
    "lp_rigl_erk_3x": "lightprune, RigL-ERK from step 0 in 3x the epochs",
    "lp_set_erk_3x": "lightprune, SET-ERK from step 0 in 3x the epochs",
}
"""Arm name -> what it does."""

OPT_IN_ARMS = (
    "lp_one_shot_cosine_ft",
    "lp_one_shot_lr_rewind",
    "lp_2_4",
    "lp_gradual_erk",
    "lp_rigl_erk",
    "lp_set_erk",
    "lp_rigl_erk_3x",
    "lp_set_erk_3x",
)
DEFAULT_ARMS = tuple(arm for arm in ARMS if arm not in OPT_IN_ARMS)
SPARSITIES = (0.9, 0.95, 0.98, 0.99)
"""The protocol's sparsities; ``--quick`` runs :data:`QUICK_SPARSITIES` unless ``--sparsities`` names others."""
QUICK_SPARSITIES = (0.9, 0.98)
"""The protocol's arms (what a plain run and ``--quick`` run); the learning-rate-rewinding pair, 2:4, ERK and dynamic
sparse training are asked for by name."""

REGROW = (100, 0.3, 0.75)
"""RigL's published settings (Evci et al. 2020) for the dynamic sparse training arms: update every 100 optimizer
steps, regrow fraction 0.3 cosine-decayed to 0 at 75% of the run (``--regrow EVERY,FRACTION,UNTIL`` changes them)."""

DST_ARMS = ("lp_rigl_erk", "lp_set_erk", "lp_rigl_erk_3x", "lp_set_erk_3x")
"""The dynamic sparse training arms: the ones ``--regrow`` changes."""

EPOCH_MULTIPLIER = {"lp_rigl_erk_3x": 3, "lp_set_erk_3x": 3}
"""Arms that train for a multiple of the protocol's epochs (their schedules scale with the run)."""

IMPORTANCES = ("magnitude", "activation", "movement", "obs")
"""The criteria of ``--importance`` (PruningCallback's ``importance=``)."""

FIXED_SPARSITY = {"lp_2_4": 0.5}
"""Arms whose pattern fixes the sparsity: run at this one only."""

OWN_LR_SCHEDULE = ("lp_one_shot_cosine_ft", "lp_one_shot_lr_rewind")
"""Arms with a learning-rate schedule of their own (``--lr-schedule`` other than constant refuses them)."""

GRADUAL = (0.05, 0.6, 0.005)
"""The cubic schedule of the gradual arms: start, end and frequency in fractions of the run's optimizer steps."""


@dataclass(frozen=True)
class Settings:
    """Everything that decides a run's result (a cached run is reused only if its settings are equal)."""

    epochs: int = 20
    lr: float = 1.2e-3
    batch_size: int = 128
    limit_train: int | None = None
    limit_test: int | None = None
    val_size: int = 0
    gradual: tuple[float, float, float] = GRADUAL
    regrow: tuple[int, float, float] = REGROW
    data_root: str = FASHION_MNIST_ROOT
    threads: int = 1
    masking: str = "reparametrize"  # the lightprune arms' PruningCallback(masking=...)
    importance: str = "magnitude"  # the lightprune arms' PruningCallback(importance=...)
    sparse_init: bool = False  # dynamic sparse training arms: each row's initial weights scaled to its kept fan-in
    warm_regrown_adam: bool = False  # dynamic sparse training arms: regrown weights' exp_avg_sq at the active mean
    lr_schedule: str = "constant"  # every arm's learning rate: constant, or a cosine to lr / 100 over its epochs


@dataclass(frozen=True)
class Run:
    """One training run: an arm at a sparsity with a seed."""

    arm: str
    sparsity: float
    seed: int
    settings: Settings = field(default_factory=Settings)

    @property
    def key(self) -> str:
        importance = "" if self.settings.importance == "magnitude" else f"_{self.settings.importance}"
        return f"{self.arm}{importance}_s{self.sparsity:g}_seed{self.seed}"

    @property
    def label(self) -> str:
        """The arm as the tables name it: with its criterion unless magnitude."""
        return arm_label(self.arm, self.settings.importance)


def arm_label(arm: str, importance: str) -> str:
    """``arm``, or ``arm [importance]`` for a criterion other than magnitude.

    Example:
        >>> arm_label("lp_gradual", "magnitude"), arm_label("lp_gradual", "activation")
        ('lp_gradual', 'lp_gradual [activation]')
    """
    return arm if importance == "magnitude" else f"{arm} [{importance}]"


# ------------------------------------------------------------------------------------------------------------------
# Data and model
# ------------------------------------------------------------------------------------------------------------------


def load_data(settings: Settings) -> dict[str, tuple[Tensor, Tensor]]:
    """Train and evaluation tensors (``x`` float in [0, 1], flattened; ``y`` int64) of the IDX directory.

    With ``val_size > 0`` the evaluation split is ``val_size`` training images held out (the same for every seed);
    otherwise it is the test file.
    """
    root = Path(settings.data_root)

    def read(kind: str) -> Tensor:
        for candidate in (root / IDX_FILES[kind], root / (IDX_FILES[kind] + ".gz")):
            if candidate.exists():
                return read_idx(candidate)
        raise FileNotFoundError(
            f"{IDX_FILES[kind]}[.gz] not found in {root}; install Fashion-MNIST with "
            "`apt-get install dataset-fashion-mnist` or pass --data-root"
        )

    x_train = read("train_images").flatten(1).float().div_(255)
    y_train = read("train_labels").long()
    x_test = read("test_images").flatten(1).float().div_(255)
    y_test = read("test_labels").long()
    if settings.val_size:
        order = torch.randperm(len(y_train), generator=torch.Generator().manual_seed(12345))
        held, kept = order[: settings.val_size], order[settings.val_size :]
        x_test, y_test = x_train[held], y_train[held]
        x_train, y_train = x_train[kept], y_train[kept]
    if settings.limit_train is not None:
        x_train, y_train = x_train[: settings.limit_train], y_train[: settings.limit_train]
    if settings.limit_test is not None:
        x_test, y_test = x_test[: settings.limit_test], y_test[: settings.limit_test]
    return {"train": (x_train, y_train), "eval": (x_test, y_test)}


class ShuffledBatches:
    """Batches of in-memory tensors in a fresh seeded order every epoch (no per-sample collation).

    Example:
        >>> batches = ShuffledBatches(torch.arange(5.0), torch.arange(5), batch_size=2, seed=0)
        >>> len(batches), [len(x) for x, _ in batches]
        (3, [2, 2, 1])
    """

    def __init__(self, x: Tensor, y: Tensor, batch_size: int, seed: int) -> None:
        self.x, self.y, self.batch_size, self.seed = x, y, batch_size, seed
        self.epoch = 0

    def __len__(self) -> int:
        return math.ceil(len(self.y) / self.batch_size)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        self.epoch += 1
        order = torch.randperm(len(self.y), generator=generator)
        for start in range(0, len(order), self.batch_size):
            index = order[start : start + self.batch_size]
            yield self.x[index], self.y[index]


class LeNetModule(pl.LightningModule):
    """A lean LightningModule around LeNet-300-100: cross-entropy, Adam, nothing logged per step."""

    def __init__(self, lr: float) -> None:
        super().__init__()
        self.lr = lr
        self.model = LeNet300100(in_features=784, hidden=(300, 100), num_classes=10)

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.model(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def pruned_weights(module: Any) -> list[tuple[nn.Module, str]]:
    """The three Linear weights the protocol prunes."""
    return [(getattr(module.model, name), "weight") for name in LAYERS]


@torch.no_grad()
def accuracy(module: Any, x: Tensor, y: Tensor) -> float:
    """Top-1 accuracy in percent."""
    module.eval()
    correct = sum(int((module(x[i : i + 2000]).argmax(1) == y[i : i + 2000]).sum()) for i in range(0, len(y), 2000))
    return 100.0 * correct / len(y)


class EpochTimer(Callback):
    """Records the wall time (``times``) and the process's CPU time (``cpu_times``, every thread) of every epoch."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self._start = (0.0, 0.0)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = (time.perf_counter(), time.process_time())

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.times.append(time.perf_counter() - self._start[0])
        self.cpu_times.append(time.process_time() - self._start[1])


class SparseInit(Callback):
    """A sparsity-aware initialization (Evci et al. 2022): once the first masks are on, each row of a pruned weight
    is scaled by ``sqrt(fan_in / kept fan_in)``, giving its pre-activations the dense initialization's variance.

    Runs after the pruning callback's ``on_train_start`` (placed after it), whose first event at step 0 masks.
    """

    def __init__(self, weights: Sequence[tuple[nn.Module, str]]) -> None:
        self.weights = list(weights)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from lightprune import prune

        with torch.no_grad():
            for module, name in self.weights:
                weight = prune.original(module, name)
                mask = getattr(module, name + "_mask", None)
                kept = (weight != 0) if mask is None else (mask != 0)
                fan_in = kept.shape[1]
                weight.mul_(torch.sqrt(fan_in / kept.sum(dim=1).clamp(min=1).to(weight.dtype))[:, None])


class WarmRegrownAdam(Callback):
    """After each mask move (placed after the pruning callback, whose moves run in ``on_train_batch_end``): the
    regrown weights' Adam ``exp_avg_sq`` is set to the mean over the tensor's other active weights (``exp_avg`` stays
    zero), so that their first steps are about the learning rate, not 3-6x it (a zeroed second moment gets no bias
    correction once the global step count is large)."""

    def __init__(self, weights: Sequence[tuple[nn.Module, str]]) -> None:
        self.weights = list(weights)
        self.masks: list[Tensor] = []

    def _current(self) -> list[Tensor]:
        return [getattr(module, name + "_mask").detach().bool().clone() for module, name in self.weights]

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.masks = self._current()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        from lightprune import prune

        masks = self._current()
        for (module, name), old, new in zip(self.weights, self.masks, masks, strict=True):
            grown = new & ~old
            state = trainer.optimizers[0].state.get(prune.original(module, name), {})
            if bool(grown.any()) and "exp_avg_sq" in state:
                state["exp_avg_sq"][grown] = state["exp_avg_sq"][new & ~grown].mean()
        self.masks = masks


class EpochCosineLR(Callback):
    """Sets the learning rate at each epoch start: a cosine from ``lr`` to ``lr / 100`` over ``period`` epochs, then
    (``rewind=False``) the final ``lr / 100`` to the end, or (``rewind=True``) the cosine replayed from its start.

    Example:
        >>> schedule = EpochCosineLR(1.0, period=2, rewind=True)
        >>> [schedule.lr_at(epoch) for epoch in range(4)]
        [1.0, 0.505, 1.0, 0.505]
        >>> EpochCosineLR(1.0, period=2, rewind=False).lr_at(3)
        0.01
    """

    def __init__(self, lr: float, period: int, rewind: bool) -> None:
        self.lr, self.period, self.rewind = lr, period, rewind

    def lr_at(self, epoch: int) -> float:
        """The learning rate of ``epoch`` (0-based)."""
        low = self.lr / 100
        step = epoch % self.period if self.rewind else min(epoch, self.period)
        return low + (self.lr - low) * (1 + math.cos(math.pi * step / self.period)) / 2

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:
                group["lr"] = self.lr_at(trainer.current_epoch)


def lr_callbacks(settings: Settings, epochs: int) -> list[Callback]:
    """The learning-rate schedule of ``settings.lr_schedule`` for a run of ``epochs``: none for ``"constant"``, an
    :class:`EpochCosineLR` over the whole run for ``"cosine"``.

    Example:
        >>> lr_callbacks(Settings(), 20)
        []
        >>> (schedule,) = lr_callbacks(Settings(lr=1.0, lr_schedule="cosine"), 4)
        >>> [round(schedule.lr_at(epoch), 3) for epoch in range(4)]
        [1.0, 0.855, 0.505, 0.155]
    """
    if settings.lr_schedule == "constant":
        return []
    if settings.lr_schedule == "cosine":
        return [EpochCosineLR(settings.lr, period=epochs, rewind=False)]
    raise ValueError(f"lr_schedule={settings.lr_schedule!r} is not one of ('constant', 'cosine')")


class TrainingFlops(Callback):
    """Counts the training multiply-adds of the pruned weights, step by step, as the masks were at each step.

    Counting rule (RigL's, Evci et al. 2020, Appendix H): a Linear weight with ``n`` unpruned entries costs ``n``
    multiply-adds per sample in the forward pass and ``2 n`` in the backward pass (the input's gradient and the
    weight's); a step of ``b`` samples costs ``3 n b``. A dense step has ``n`` = the weight's size. At a RigL update
    step the weight's gradient is dense: ``2 n + size`` per sample. SET draws regrown weights at random: no dense
    gradient. Biases, activations, the loss and the optimizer are not counted (a few per cent of a dense step here).
    The masks are read before each backward pass (the ones the forward used): ``weight_mask`` under the
    reparametrization (lightprune, ModelPruning), the weight's non-zeros otherwise.

    Example:
        >>> layer = nn.Linear(4, 3)
        >>> counter = TrainingFlops([(layer, "weight")])
        >>> counter.active()  # dense: every entry counts
        12
    """

    def __init__(self, weights: list[tuple[nn.Module, str]]) -> None:
        self.weights = weights
        self.macs = 0
        self._plan: Any = None
        self._samples = 0

    def active(self) -> int:
        """Unpruned entries of the counted weights now."""
        total = 0
        for module, name in self.weights:
            mask = getattr(module, f"{name}_mask", None)
            total += int(torch.count_nonzero(mask if mask is not None else getattr(module, name)))
        return total

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from lightprune.callback.regrowth import RegrowPlan

        for callback in trainer.callbacks:  # RigL's update steps, from the callback's own public settings
            if isinstance(callback, PruningCallback) and callback.regrow == "rigl":
                self._plan = RegrowPlan("rigl", callback.regrow_every, callback.regrow_fraction, callback.regrow_until)
                self._plan.resolve(int(trainer.estimated_stepping_batches))

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        active = self.active()
        dense_grad = self._plan is not None and self._plan.is_update(trainer.global_step + 1)
        weight_grad = sum(getattr(module, name).numel() for module, name in self.weights) if dense_grad else active
        self.macs += self._samples * (2 * active + weight_grad)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self._samples = len(batch[1])


def make_trainer(epochs: int, callbacks: list[Any]) -> Any:
    """A quiet CPU Trainer: no logger, checkpoints, progress bar or validation."""
    return pl.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=callbacks,
    )


# ------------------------------------------------------------------------------------------------------------------
# The arms
# ------------------------------------------------------------------------------------------------------------------


def mp_amount(sparsity: float, rounds: int = MP_ROUNDS) -> float:
    """ModelPruning's per-epoch amount reaching ``sparsity`` after ``rounds`` rounds: ``1 - (1 - s) ** (1/rounds)``.

    Example:
        >>> round(1 - (1 - mp_amount(0.9)) ** 14, 12)
        0.9
    """
    return 1.0 - (1.0 - sparsity) ** (1.0 / rounds)


def arm_callbacks(
    arm: str,
    sparsity: float,
    module: Any,
    epochs: int,
    gradual: tuple[float, float, float] = GRADUAL,
    masking: str = "reparametrize",
    importance: str = "magnitude",
    regrow: tuple[int, float, float] = REGROW,
) -> list[Any]:
    """The pruning callback(s) of an arm (scaled to ``epochs``; the protocol's 20 give the epochs in the docs).

    ``importance`` is the lightprune arms' criterion; magnitude leaves the callback's arguments as they were before
    criteria existed, so those runs stay comparable with (and cached as) the earlier ones.
    """
    params = pruned_weights(module)
    if importance != "magnitude":
        if not arm.startswith("lp_"):
            raise ValueError(f"arm={arm!r} has no pruning criterion; importance={importance!r} is lightprune's")
        masking_kwargs: dict[str, Any] = {"masking": masking, "importance": importance}
        if importance == "obs":  # fc1 has 784 inputs: one batch of 128 images would leave H of rank 128
            masking_kwargs["activation_window"] = 8
    else:
        masking_kwargs = {"masking": masking}
    one_shot_epoch = epochs // 2
    rounds = min(MP_ROUNDS, epochs - 1)  # 14 of the protocol's 20 epochs; fewer in --quick runs
    if arm == "dense":
        return []
    if arm == "modelpruning":
        from lightning.pytorch.callbacks import ModelPruning

        amount = mp_amount(sparsity, rounds)
        return [
            ModelPruning(
                "l1_unstructured",
                parameters_to_prune=params,
                use_global_unstructured=True,
                amount=lambda epoch: amount if 1 <= epoch <= rounds else 0.0,
                use_lottery_ticket_hypothesis=False,
                make_pruning_permanent=True,
            )
        ]
    if arm == "lp_control":
        schedule = Geometric(mp_amount(sparsity, rounds), start=2, frequency=1, rounds=rounds)
        return [PruningCallback(schedule, parameters=params, unit="epoch", scope="global", **masking_kwargs)]
    if arm in ("lp_gradual", "lp_gradual_layerwise", "lp_gradual_erk"):
        start, end, frequency = gradual
        schedule = Cubic(final=sparsity, start=start, end=end, frequency=frequency)
        scope = {"lp_gradual": "global", "lp_gradual_layerwise": "layerwise", "lp_gradual_erk": "erk"}[arm]
        return [PruningCallback(schedule, parameters=params, unit="step", scope=scope, **masking_kwargs)]
    if arm in DST_ARMS:
        every, fraction, until = regrow
        return [
            PruningCallback(
                Constant(sparsity, at=0), parameters=params, unit="step", scope="erk",
                regrow="rigl" if arm.startswith("lp_rigl") else "set", regrow_every=int(every),
                regrow_fraction=fraction, regrow_until=until, **masking_kwargs,
            )
        ]  # fmt: skip
    if arm == "lp_one_shot":
        schedule = Constant(sparsity, at=one_shot_epoch)
        return [PruningCallback(schedule, parameters=params, unit="epoch", **masking_kwargs)]
    if arm == "lp_one_shot_rewind":
        schedule = Constant(sparsity, at=one_shot_epoch)
        return [PruningCallback(schedule, parameters=params, unit="epoch", rewind=1, **masking_kwargs)]
    if arm in ("lp_one_shot_cosine_ft", "lp_one_shot_lr_rewind"):
        schedule = Constant(sparsity, at=one_shot_epoch)
        lr = EpochCosineLR(module.lr, period=one_shot_epoch, rewind=arm == "lp_one_shot_lr_rewind")
        return [lr, PruningCallback(schedule, parameters=params, unit="epoch", **masking_kwargs)]
    if arm == "lp_2_4":
        schedule = Constant(FIXED_SPARSITY[arm], at=one_shot_epoch)
        return [
            PruningCallback(
                schedule, parameters=params, unit="epoch", method="semi_structured", method_kwargs={"n": 2, "m": 4},
                **masking_kwargs,
            )
        ]  # fmt: skip
    raise ValueError(f"arm={arm!r} is not one of {sorted(ARMS)}")


def count_zeros(module: Any) -> dict[str, int]:
    """Exact zeros of each pruned weight after fit (the tools made the pruning permanent)."""
    counts = {}
    for name in LAYERS:
        layer = getattr(module.model, name)
        assert "weight" in layer._parameters, f"{name}.weight is still reparametrized after fit"
        counts[name] = int((layer.weight == 0).sum())
        assert not bool((layer.bias == 0).any()), f"{name}.bias has zeros: only weights may be pruned"
    return counts


def run_one(run: Run) -> dict[str, Any]:
    """Train one arm and return its test accuracy, exact zero counts and timings."""

    settings = run.settings
    torch.set_num_threads(settings.threads)
    data = load_data(settings)
    pl.seed_everything(run.seed, verbose=False)
    module = LeNetModule(settings.lr)
    timer = EpochTimer()
    epochs = settings.epochs * EPOCH_MULTIPLIER.get(run.arm, 1)
    callbacks = arm_callbacks(
        run.arm, run.sparsity, module, epochs, settings.gradual, settings.masking, settings.importance, settings.regrow
    )
    flops = TrainingFlops(pruned_weights(module))
    callbacks = [*lr_callbacks(settings, epochs), *callbacks]
    if settings.sparse_init:
        callbacks.append(SparseInit(pruned_weights(module)))
    if settings.warm_regrown_adam:
        if settings.masking != "reparametrize":  # (in place, a regrown weight is zero: only the masks show it)
            raise ValueError("--warm-regrown-adam reads the reparametrization's masks: use --masking reparametrize")
        callbacks.append(WarmRegrownAdam(pruned_weights(module)))
    trainer = make_trainer(epochs, [timer, flops, *callbacks])
    loader = ShuffledBatches(*data["train"], batch_size=settings.batch_size, seed=run.seed)
    start = time.perf_counter()
    trainer.fit(module, train_dataloaders=loader)
    fit_seconds = time.perf_counter() - start
    zeros = count_zeros(module)
    sizes = {name: getattr(module.model, name).weight.numel() for name in LAYERS}
    return {
        "run": asdict(run),
        "accuracy": accuracy(module, *data["eval"]),
        "zeros": zeros,
        "sizes": sizes,
        "sparsity_counted": sum(zeros.values()) / sum(sizes.values()),
        "steps": trainer.global_step,
        "train_macs": flops.macs,
        "dense_macs": 3 * sum(sizes.values()) * len(data["train"][1]) * settings.epochs,
        "epoch_seconds": timer.times,
        "fit_seconds": fit_seconds,
    }


def _run_in_worker(run: Run) -> dict[str, Any]:
    import logging
    import warnings

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    return run_one(run)


# ------------------------------------------------------------------------------------------------------------------
# Epoch time of reparametrized weights
# ------------------------------------------------------------------------------------------------------------------

TIMING_ARMS = ("dense", "lightprune", "lightprune_float", "lightprune_inplace", "modelpruning")
"""The models of the epoch-time comparison: dense, lightprune's callback (bool masks, its default; float masks;
in-place masking), lightning's ModelPruning."""

TIMING_EPOCHS = 3
"""Each timing fit: epoch 0 dense (the optimizer state warms up as in a real run), pruned at the end of epoch 0 /
start of epoch 1, epoch 2 timed (reparametrized weights, no pruning event inside it)."""


def timing_callbacks(kind: str, module: LeNetModule, sparsity: float) -> list[Callback]:
    """The callback that prunes ``module`` to ``sparsity`` after epoch 0 and keeps it reparametrized to the end."""
    params = pruned_weights(module)
    if kind == "dense":
        return []
    if kind in ("lightprune", "lightprune_float", "lightprune_inplace"):
        mask = None if kind == "lightprune_float" else torch.bool
        masking = "inplace" if kind == "lightprune_inplace" else "reparametrize"
        schedule = Constant(sparsity, at=1)
        return [PruningCallback(schedule, parameters=params, unit="epoch", mask_dtype=mask, masking=masking)]
    if kind == "modelpruning":
        from lightning.pytorch.callbacks import ModelPruning

        return [
            ModelPruning(
                "l1_unstructured",
                parameters_to_prune=params,
                amount=lambda epoch: sparsity if epoch == 0 else 0.0,
                use_lottery_ticket_hypothesis=False,
            )
        ]
    raise ValueError(f"kind={kind!r} is not one of {TIMING_ARMS}")


def time_epochs(
    settings: Settings,
    repeats: int,
    sparsity: float = 0.9,
    arms: Sequence[str] = TIMING_ARMS,
    clock: str = "wall",
) -> dict[str, Any]:
    """Epoch time with reparametrized weights against dense, in Lightning fit, interleaved ``repeats`` times.

    Every repeat runs one fit of each kind (rotating the order) and keeps the time of its last epoch, which trains
    with weights pruned to ``sparsity`` and the optimizer state of a run in progress; the table reports medians of
    ``clock``: ``"wall"`` time, or ``"cpu"``, the process's CPU time (on a machine shared with other jobs it does not
    count the time spent waiting for a core). Both are kept (``wall_seconds``, ``cpu_seconds``).
    """
    torch.set_num_threads(settings.threads)
    data = load_data(settings)
    arms = tuple(dict.fromkeys(("dense", *arms)))  # dense is every ratio's denominator
    times: dict[str, list[float]] = {kind: [] for kind in arms}
    both: dict[str, dict[str, list[float]]] = {"wall": {kind: [] for kind in arms}, "cpu": {kind: [] for kind in arms}}
    for repeat in range(repeats):
        shift = repeat % len(arms)
        for kind in arms[shift:] + arms[:shift]:
            pl.seed_everything(repeat, verbose=False)
            module = LeNetModule(settings.lr)
            timer = EpochTimer()
            loader = ShuffledBatches(*data["train"], batch_size=settings.batch_size, seed=repeat)
            trainer = make_trainer(TIMING_EPOCHS, [timer, *timing_callbacks(kind, module, sparsity)])
            trainer.fit(module, train_dataloaders=loader)
            if kind != "dense":
                weights = sum(layer.weight.numel() for layer, _ in pruned_weights(module))
                assert sum(count_zeros(module).values()) == round(sparsity * weights)
            both["wall"][kind].append(timer.times[-1])
            both["cpu"][kind].append(timer.cpu_times[-1])
            times[kind].append(both[clock][kind][-1])
    medians = {kind: statistics.median(values) for kind, values in times.items()}
    paired = {kind: [t / d for t, d in zip(values, times["dense"], strict=True)] for kind, values in times.items()}
    return {
        "sparsity": sparsity,
        "repeats": repeats,
        "clock": clock,
        "seconds": times,
        "wall_seconds": both["wall"],
        "cpu_seconds": both["cpu"],
        "median_seconds": medians,
        "ratio_to_dense": {kind: medians[kind] / medians["dense"] for kind in arms},
        "median_paired_ratio": {kind: statistics.median(values) for kind, values in paired.items()},
    }


# ------------------------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------------------------


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def summarize(results: list[dict[str, Any]]) -> dict[str, dict[float, dict[str, Any]]]:
    """Group results by arm and sparsity: accuracy mean/std over seeds, mean per-layer sparsity, epoch seconds.

    Example:
        >>> result = {"run": {"arm": "dense", "sparsity": 0.0, "seed": 0}, "accuracy": 90.0, "zeros": {"fc1": 1},
        ...           "sizes": {"fc1": 4}, "sparsity_counted": 0.25, "epoch_seconds": [2.0], "fit_seconds": 3.0}
        >>> summarize([result])["dense"][0.0]["accuracy"]
        (90.0, 0.0, 1)
    """
    grouped: dict[str, dict[float, list[dict[str, Any]]]] = {}
    for result in results:
        label = arm_label(result["run"]["arm"], result["run"].get("settings", {}).get("importance", "magnitude"))
        grouped.setdefault(label, {}).setdefault(result["run"]["sparsity"], []).append(result)
    summary: dict[str, dict[float, dict[str, Any]]] = {}
    for arm, by_sparsity in grouped.items():
        for sparsity, group in by_sparsity.items():
            accuracies = [r["accuracy"] for r in group]
            layers = group[0]["sizes"]
            summary.setdefault(arm, {})[sparsity] = {
                "accuracy": (*_mean_std(accuracies), len(group)),
                "seeds": sorted(r["run"]["seed"] for r in group),
                "layer_sparsity": {
                    name: statistics.fmean(r["zeros"][name] / r["sizes"][name] for r in group) for name in layers
                },
                "sparsity_counted": statistics.fmean(r["sparsity_counted"] for r in group),
                "epoch_seconds": statistics.median(t for r in group for t in r["epoch_seconds"]),
                "fit_seconds": statistics.fmean(r["fit_seconds"] for r in group),
                "training_flops": _training_flops(group),
            }
    return summary


def _training_flops(group: Sequence[dict[str, Any]]) -> float | None:
    """Mean training multiply-adds relative to the dense model's in the protocol's epochs; ``None`` if not counted.

    Example:
        >>> _training_flops([{"train_macs": 30, "dense_macs": 100}, {"train_macs": 50, "dense_macs": 100}])
        0.4
        >>> _training_flops([{"accuracy": 90.0}]) is None  # a run from before the count
        True
        >>> _training_flops([{"accuracy": 90.0}, {"train_macs": 30, "dense_macs": 100}])  # seed-independent count
        0.3
    """
    counted = [r["train_macs"] / r["dense_macs"] for r in group if "train_macs" in r]
    return statistics.fmean(counted) if counted else None


def _arm_order(summary: dict[str, Any]) -> list[str]:
    return [label for arm in ARMS for importance in IMPORTANCES if (label := arm_label(arm, importance)) in summary]


def _arm_table(title: str, summary: dict[str, Any], cell: Any, dense: bool = True) -> list[str]:
    """A table with an arm a row and a sparsity a column; the dense arm's single entry fills its whole row."""
    sparsities = sorted({s for arm in summary.values() for s in arm if s > 0})
    lines = ["", title, "", "| arm | " + " | ".join(f"s = {s:g}" for s in sparsities) + " |"]
    lines.append("|---|" + "---:|" * len(sparsities))
    for arm in _arm_order(summary):
        if arm == "dense":
            if dense:
                lines.append(
                    f"| {arm} | " + " | ".join([cell(next(iter(summary[arm].values())))] * len(sparsities)) + " |"
                )
            continue
        cells = [cell(summary[arm][s]) if s in summary[arm] else "-" for s in sparsities]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return lines


def _sparsity_cell(entry: dict[str, Any]) -> str:
    layers = " / ".join(f"{value:.3f}" for value in entry["layer_sparsity"].values())
    return f"{entry['sparsity_counted']:.5f} ({layers})"


def accuracy_label(settings: Settings) -> str:
    """What the runs' accuracy was measured on: the test set, or ``--val-size`` held-out training images.

    Example:
        >>> accuracy_label(Settings()), accuracy_label(Settings(val_size=10000))
        ('test accuracy (%)', 'validation accuracy (%), 10,000 held-out training images')
    """
    if settings.val_size:
        return f"validation accuracy (%), {settings.val_size:,} held-out training images"
    return "test accuracy (%)"


def markdown(
    summary: dict[str, Any],
    timing: dict[str, Any] | None,
    machine: str,
    command: str,
    accuracy: str = "test accuracy (%)",
) -> str:
    """The Markdown report: accuracy table (``accuracy``: what it was measured on), per-layer sparsity table,
    epoch-time tables."""
    lines = [f"Command: `{command}`", "", f"Machine: {machine}"]
    if summary:  # empty with --timing-only
        lines += _arm_table(
            f"{accuracy[0].upper()}{accuracy[1:]}, mean ± std over seeds (n = seeds):",
            summary,
            lambda entry: "{:.2f} ± {:.2f} (n={})".format(*entry["accuracy"]),
        )
        lines += _arm_table(
            "Sparsity counted after fit (exact zeros), total and per layer (fc1 / fc2 / fc3), mean over seeds:",
            summary,
            _sparsity_cell,
            dense=False,
        )
        if any(entry["training_flops"] is not None for by_s in summary.values() for entry in by_s.values()):
            lines += _arm_table(
                "Training FLOPs relative to the dense model's training in the protocol's epochs (dense = 1; counted "
                "step by step: multiply-adds of the three Linear weights per sample, forward n and backward 2n with n "
                "the weight's unpruned entries in that step, so dense steps before pruning and sparse ones after; at "
                "RigL's update steps the weight gradient is dense, 2n + size; SET regrows at random, no dense "
                "gradient; biases, activations and the optimizer not counted):",
                summary,
                lambda entry: "-" if entry["training_flops"] is None else f"{entry['training_flops']:.3f}",
            )
        lines += _arm_table(
            "Median epoch time within the accuracy runs (s; the runs shared the machine, so only indicative):",
            summary,
            lambda entry: f"{entry['epoch_seconds']:.2f}",
        )
    if timing:
        lines += [
            "",
            f"Epoch time in Lightning fit with weights reparametrized at {timing['sparsity']:g} sparsity (the third "
            f"epoch of fits pruned after the first), fits interleaved, median of {timing['repeats']}"
            + (" (CPU time of the process, all threads):" if timing.get("clock") == "cpu" else ":"),
            "",
            "| model | median epoch (s) | ratio of medians to dense | median of per-repeat ratios to dense |",
            "|---|---:|---:|---:|",
        ]
        names = {
            "dense": "dense",
            "lightprune": "lightprune PruningCallback (bool masks, the default)",
            "lightprune_float": "lightprune PruningCallback (float masks)",
            "lightprune_inplace": "lightprune PruningCallback (masking='inplace', bool masks)",
            "modelpruning": "lightning ModelPruning (torch.nn.utils.prune, float masks)",
        }
        for kind in timing["median_seconds"]:
            lines.append(
                f"| {names[kind]} | {timing['median_seconds'][kind]:.3f} | {timing['ratio_to_dense'][kind]:.3f}× "
                f"| {timing['median_paired_ratio'][kind]:.3f}× |"
            )
    return "\n".join(lines) + "\n"


ZOOMED_ARMS = ("dense", "modelpruning", "lp_control", "lp_gradual")
"""The arms of the plot's right panel, on an axis that separates them."""


STYLES: dict[str, dict[str, Any]] = {
    "modelpruning": {"color": "black", "marker": "s", "linestyle": "--"},
    "lp_control": {"color": "tab:gray", "marker": "x", "linestyle": ":"},
    "lp_gradual": {"color": "tab:blue", "marker": "o"},
    "lp_gradual_layerwise": {"color": "tab:cyan", "marker": "^"},
    "lp_one_shot": {"color": "tab:orange", "marker": "v"},
    "lp_one_shot_rewind": {"color": "tab:red", "marker": "D"},
    "lp_2_4": {"color": "tab:olive", "marker": "s"},
    "lp_gradual_erk": {"color": "tab:purple", "marker": "o", "linestyle": "-."},
    "lp_rigl_erk": {"color": "tab:brown", "marker": "*", "markersize": 9},
    "lp_rigl_erk_3x": {"color": "tab:brown", "marker": "*", "markersize": 9, "linestyle": "--", "mfc": "none"},
    "lp_set_erk": {"color": "tab:pink", "marker": "d"},
    "lp_set_erk_3x": {"color": "tab:pink", "marker": "d", "linestyle": "--", "mfc": "none"},
}
"""Each arm's line and marker in the plots (a 3x-epochs arm: its arm's colour and marker, hollow and dashed)."""


def _plot_arms(ax: Any, summary: dict[str, Any], arms: Sequence[str], positions: dict[float, int]) -> None:
    styles = STYLES
    criteria = {  # a criterion keeps its arm's colour, with its own line and marker
        "activation": {"linestyle": "--", "marker": "*", "markersize": 9},
        "movement": {"linestyle": ":", "marker": "P"},
        "obs": {"linestyle": "-.", "marker": "X"},
    }
    for arm in arms:
        base, _, importance = arm.partition(" [")
        style = {**styles.get(base, {}), **criteria.get(importance.rstrip("]"), {})}
        if arm == "dense":
            mean, std, _ = next(iter(summary[arm].values()))["accuracy"]
            ax.axhspan(mean - std, mean + std, color="tab:green", alpha=0.15)
            ax.axhline(mean, color="tab:green", label="dense")
            continue
        points = sorted((positions[s], *entry["accuracy"][:2]) for s, entry in summary[arm].items() if s > 0)
        xs, means, stds = zip(*points, strict=True)
        ax.errorbar(xs, means, yerr=stds, capsize=3, label=arm, **style)
    ax.set_xticks(range(len(positions)), [f"{s:g}" for s in positions])
    ax.set_xlabel("sparsity of the three Linear weights (266,200)")
    ax.grid(alpha=0.3)


def _figure_legend(fig: Any, axes: Sequence[Any], summary: dict[str, Any]) -> None:
    """One legend for the whole figure, right of the panels: an entry per arm, whichever panels draw it.

    Inside a panel the legend would cover data (the dense band at the top, arms near chance at the bottom).
    """
    handles: dict[str, Any] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
    order = [arm for arm in _arm_order(summary) if arm in handles]
    fig.legend([handles[arm] for arm in order], order, loc="center right", fontsize=8)
    width = max(len(label) for label in order) * 0.065 + 0.6  # inches: the longest label and its marker
    fig.tight_layout(rect=(0, 0, 1 - width / fig.get_figwidth(), 1))


def plot(
    summary: dict[str, Any],
    path: Path,
    accuracy: str = "test accuracy (%)",
    epochs: int = 20,
    lr_schedule: str = "constant",
) -> Any:
    """Accuracy (mean ± std; ``accuracy`` names what it was measured on) against sparsity: every arm (left), the
    gradual arm against ModelPruning (right); the title names a learning-rate schedule other than the protocol's.

    Returns the (closed) figure, whose artists say what was drawn.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def positions_of(arms: Sequence[str]) -> dict[float, int]:
        sparsities = sorted({s for arm in arms for s in summary[arm] if s > 0})
        return {s: i for i, s in enumerate(sparsities)}

    # The zoomed panel leaves out arms at chance level (a collapsed criterion), which would flatten the others.
    zoomed = [
        arm
        for arm in _arm_order(summary)
        if arm.partition(" [")[0] in ZOOMED_ARMS and max(e["accuracy"][0] for e in summary[arm].values()) > 20.0
    ]
    if zoomed:
        fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
        axes = (left, right)
    else:  # no gradual arm to zoom on (a tuning run of one arm): one panel, not an empty one beside it
        fig, left = plt.subplots(1, 1, figsize=(7, 4.8))
        axes = (left,)
    _plot_arms(left, summary, _arm_order(summary), positions_of(_arm_order(summary)))
    left.set_ylabel(accuracy)
    left.set_title("every arm")
    versus = "modelpruning" in summary
    if zoomed:
        _plot_arms(right, summary, zoomed, positions_of([arm for arm in zoomed if arm != "dense"] or zoomed))
        right.set_title(
            "gradual (lightprune) against ModelPruning" if versus else "gradual arms (arms at chance left out)"
        )
    longer = sorted({EPOCH_MULTIPLIER.get(arm.partition(" [")[0], 1) for arm in summary} - {1})
    fig.suptitle(
        f"LeNet-300-100 on Fashion-MNIST, {epochs} epochs"
        + "".join(f" ({m * epochs} for the _{m}x arms)" for m in longer)
        + _lr_words(lr_schedule)
        + (": lightprune vs lightning ModelPruning" if versus else "")
    )
    _figure_legend(fig, axes, summary)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return fig


def _lr_words(lr_schedule: str) -> str:
    """The learning-rate schedule as a title names it: nothing for the protocol's constant rate.

    Example:
        >>> _lr_words("constant"), _lr_words("cosine")
        ('', ', cosine learning rate')
    """
    return "" if lr_schedule == "constant" else f", {lr_schedule} learning rate"


FLOPS_LABELS = (1.0, 2.0, 5.0)
"""The FLOPs plot labels its log axis at these multiples of each power of ten."""


def plot_flops(
    summary: dict[str, Any],
    path: Path,
    accuracy: str = "test accuracy (%)",
    epochs: int = 20,
    lr_schedule: str = "constant",
) -> Any | None:
    """Accuracy (mean ± std) against training FLOPs (dense = 1, log scale), one panel per sparsity.

    Only arms whose runs counted their FLOPs are drawn; the dense model is the green band and point at 1. Returns
    the (closed) figure, whose artists say what was drawn, or ``None`` (nothing drawn) when no pruned arm counted.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    sparsities = sorted({s for by_s in summary.values() for s, e in by_s.items() if s > 0 and e["training_flops"]})
    if not sparsities:  # the dense model alone: no panel to draw
        return None
    fig, axes = plt.subplots(1, len(sparsities), figsize=(3.6 * len(sparsities) + 2.4, 4.2), squeeze=False)
    dense = next(iter(summary["dense"].values())) if "dense" in summary else None
    for ax, sparsity in zip(axes[0], sparsities, strict=True):
        if dense is not None:
            mean, std, _ = dense["accuracy"]
            ax.axhspan(mean - std, mean + std, color="tab:green", alpha=0.15)
            ax.errorbar([dense["training_flops"]], [mean], yerr=[std], color="tab:green", marker="o", label="dense")
        for arm in _arm_order(summary):
            entry = summary[arm].get(sparsity)
            if arm == "dense" or entry is None or entry["training_flops"] is None:
                continue
            mean, std, _ = entry["accuracy"]
            style = {key: value for key, value in STYLES.get(arm, {}).items() if key != "linestyle"}
            ax.errorbar([entry["training_flops"]], [mean], yerr=[std], capsize=3, label=arm, **style)
        ax.set_xscale("log")
        # labels at 1, 2 and 5 of each decade, as plain numbers; the other grid lines unlabelled (they collide)
        ax.xaxis.set_major_locator(LogLocator(subs=FLOPS_LABELS))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        low, high = ax.get_xlim()  # start at a labelled value, so that the leftmost points have a label beside them
        ax.set_xlim(_labelled_value_below(low), high)
        ax.set_title(f"sparsity {sparsity:g}")
        ax.set_xlabel(f"training FLOPs (dense {epochs} epochs = 1)")
        ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel(accuracy)
    fig.suptitle(f"LeNet-300-100 on Fashion-MNIST{_lr_words(lr_schedule)}: accuracy against training cost")
    _figure_legend(fig, axes[0], summary)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return fig


def _labelled_value_below(value: float) -> float:
    """The largest ``m * 10**k`` (``m`` in :data:`FLOPS_LABELS`) at or below ``value`` (> 0).

    Example:
        >>> _labelled_value_below(0.23), _labelled_value_below(0.05), _labelled_value_below(0.7)
        (0.2, 0.05, 0.5)
    """
    decade = 10.0 ** math.floor(math.log10(value))
    return max(m * decade for m in FLOPS_LABELS if m * decade <= value * (1 + 1e-12))


# ------------------------------------------------------------------------------------------------------------------
# Driver
# ------------------------------------------------------------------------------------------------------------------


def plan(
    arms: Sequence[str],
    sparsities: Sequence[float],
    seeds: Sequence[int],
    settings: Settings,
    importances: Sequence[str] = ("magnitude",),
) -> list[Run]:
    """The runs of a benchmark: dense once per seed, every other arm at every sparsity and seed (an arm of
    :data:`FIXED_SPARSITY` at its own), the lightprune arms once per criterion of ``importances``.

    Example:
        >>> [run.key for run in plan(["dense", "lp_gradual", "lp_2_4"], [0.9], [0], Settings(),
        ...                          ["magnitude", "activation"])]  # doctest: +NORMALIZE_WHITESPACE
        ['dense_s0_seed0', 'lp_gradual_s0.9_seed0', 'lp_gradual_activation_s0.9_seed0', 'lp_2_4_s0.5_seed0',
         'lp_2_4_activation_s0.5_seed0']
    """
    own_schedule = sorted(set(arms) & set(OWN_LR_SCHEDULE))
    if settings.lr_schedule != "constant" and own_schedule:
        raise ValueError(f"arms {own_schedule} set their own learning rate; lr_schedule={settings.lr_schedule!r} "
                         "would overwrite it")  # fmt: skip
    runs = []
    for seed in seeds:
        for arm in arms:
            arm_sparsities = [0.0] if arm == "dense" else [FIXED_SPARSITY[arm]] if arm in FIXED_SPARSITY else sparsities
            criteria = importances if arm.startswith("lp_") else ("magnitude",)
            regrow = settings.regrow if arm in DST_ARMS else REGROW  # other arms: cached runs stay valid
            init = settings.sparse_init and arm in DST_ARMS
            warm = settings.warm_regrown_adam and arm in DST_ARMS
            for importance in criteria:
                for sparsity in arm_sparsities:
                    arm_settings = replace(
                        settings, importance=importance, regrow=regrow, sparse_init=init, warm_regrown_adam=warm
                    )
                    runs.append(Run(arm, sparsity, seed, arm_settings))
    return runs


def _same_run(cached: dict[str, Any], run: Run) -> bool:
    """Whether a cached run was made with ``run``'s settings (settings it predates count as their defaults)."""
    expected = json.loads(json.dumps(asdict(run)))
    defaults = json.loads(json.dumps(asdict(Settings())))
    completed = {**cached, "settings": {**defaults, **cached["settings"]}}
    return completed == expected


def execute(
    runs: list[Run], out: Path, jobs: int, fresh: bool, cached_only: bool = False, process_per_run: bool = True
) -> list[dict[str, Any]]:
    """Run what is not cached under ``out/runs`` (``jobs`` processes at a time, a fresh one for each run unless
    ``process_per_run`` is off) and return every result; with ``cached_only``, run nothing and return the cached
    results alone."""
    run_dir = out / "runs"
    run_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    todo = []
    for run in runs:
        path = run_dir / f"{run.key}.json"
        if path.exists() and not fresh:
            cached = json.loads(path.read_text())
            if _same_run(cached["run"], run):
                results[run.key] = cached
                continue
        todo.append(run)
    if cached_only:
        print(f"{len(runs)} runs: {len(results)} cached, {len(todo)} not run (--report-only)", flush=True)
        return [results[run.key] for run in runs if run.key in results]
    print(f"{len(runs)} runs: {len(results)} cached, {len(todo)} to do with {jobs} processes", flush=True)
    context = get_context("spawn")
    per_child = 1 if process_per_run else None
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context, max_tasks_per_child=per_child) as pool:
        futures = {pool.submit(_run_in_worker, run): run for run in todo}
        for done, future in enumerate(as_completed(futures), 1):
            run = futures[future]
            result = future.result()
            tmp = run_dir / f"{run.key}.json.tmp"
            tmp.write_text(json.dumps(result, indent=1))
            tmp.replace(run_dir / f"{run.key}.json")
            results[run.key] = result
            print(
                f"[{done}/{len(todo)}] {run.key}: {result['accuracy']:.2f}% at sparsity "
                f"{result['sparsity_counted']:.5f} ({result['fit_seconds']:.0f} s)",
                flush=True,
            )
    return [results[run.key] for run in runs]


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and write the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--sparsities", type=float, nargs="+", default=None, help=f"default: {SPARSITIES} (--quick: {QUICK_SPARSITIES})"
    )
    parser.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS), choices=list(ARMS))
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--jobs", type=int, default=2, help="runs in parallel (processes)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--timing-repeats", type=int, default=9, help="interleaved epoch-time repeats (0: skip)")
    parser.add_argument("--timing-arms", nargs="+", default=list(TIMING_ARMS), choices=list(TIMING_ARMS),
                        help="the epoch-time comparison's models (dense is always timed)")  # fmt: skip
    parser.add_argument("--timing-only", action="store_true", help="only the epoch-time comparison, no accuracy runs")
    parser.add_argument("--timing-clock", default="wall", choices=("wall", "cpu"),
                        help="epoch time measured as wall time or as the process's CPU time")  # fmt: skip
    parser.add_argument("--val-size", type=int, default=0, help="hold out this many training images for tuning")
    parser.add_argument(
        "--gradual",
        type=lambda text: tuple(float(part) for part in text.split(",")),
        default=GRADUAL,
        help="start,end,frequency of the gradual arms' cubic schedule, fractions of the run (default %(default)s)",
    )
    parser.add_argument(
        "--regrow",
        type=lambda text: tuple(float(part) if i else int(part) for i, part in enumerate(text.split(","))),
        default=REGROW,
        help="every,fraction,until of the dynamic sparse training arms (default %(default)s)",
    )
    parser.add_argument(
        "--sparse-init",
        action="store_true",
        help="dynamic sparse training arms: scale each row's initial weights to its kept fan-in (Evci et al. 2022)",
    )
    parser.add_argument(
        "--warm-regrown-adam",
        action="store_true",
        help="dynamic sparse training arms: a regrown weight's Adam exp_avg_sq starts at its tensor's active mean",
    )
    parser.add_argument(
        "--lr-schedule",
        default="constant",
        choices=("constant", "cosine"),
        help="every arm's learning rate: constant, or set each epoch on a cosine to lr / 100 over the arm's epochs",
    )
    parser.add_argument("--data-root", default=FASHION_MNIST_ROOT)
    parser.add_argument("--masking", default="reparametrize", choices=("reparametrize", "inplace"),
                        help="PruningCallback(masking=...) of the lightprune arms")  # fmt: skip
    parser.add_argument(
        "--importance",
        nargs="+",
        default=["magnitude"],
        choices=IMPORTANCES,
        help="criteria of the lightprune arms (PruningCallback(importance=...)), one set of runs each",
    )
    parser.add_argument("--quick", action="store_true", help="a few minutes: subsets, 4 epochs, one seed")
    parser.add_argument("--fresh", action="store_true", help="ignore cached runs")
    parser.add_argument("--report-only", action="store_true", help="run nothing: the report of the cached runs")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "quality")
    args = parser.parse_args(argv)

    settings = Settings(
        epochs=args.epochs,
        val_size=args.val_size,
        gradual=args.gradual,
        regrow=args.regrow,
        sparse_init=args.sparse_init,
        warm_regrown_adam=args.warm_regrown_adam,
        lr_schedule=args.lr_schedule,
        data_root=args.data_root,
        threads=args.threads,
        masking=args.masking,
    )
    seeds, sparsities, repeats = args.seeds, args.sparsities or list(SPARSITIES), args.timing_repeats
    if args.quick:
        settings = replace(settings, epochs=4, limit_train=4096, limit_test=2000)
        seeds, sparsities, repeats = seeds[:1], args.sparsities or list(QUICK_SPARSITIES), min(repeats, 1)
    command = "python benchmarks/quality.py " + " ".join(argv if argv is not None else sys.argv[1:])

    if args.timing_only:
        timing = time_epochs(settings, max(repeats, 1), arms=args.timing_arms, clock=args.timing_clock)
        args.out.mkdir(parents=True, exist_ok=True)
        report = markdown({}, timing, describe("lightning"), command.strip())
        (args.out / "timing.md").write_text(report)
        (args.out / "timing.json").write_text(json.dumps({"settings": asdict(settings), "timing": timing}, indent=1))
        print(report)
        return 0
    runs = plan(args.arms, sparsities, seeds, settings, args.importance)
    # (--quick: runs of seconds, where starting a process, which imports Lightning, would take longer than the run)
    results = execute(
        runs, args.out, args.jobs, args.fresh, cached_only=args.report_only, process_per_run=not args.quick
    )
    summary = summarize(results)
    timing = time_epochs(settings, repeats, arms=args.timing_arms, clock=args.timing_clock) if repeats > 0 else None
    label = accuracy_label(settings)
    report = markdown(summary, timing, describe("lightning"), command.strip(), label)
    args.out.mkdir(parents=True, exist_ok=True)
    serializable = {arm: {str(s): entry for s, entry in by_s.items()} for arm, by_s in summary.items()}
    payload = {"settings": asdict(settings), "summary": serializable, "timing": timing, "results": results}
    (args.out / "quality.json").write_text(json.dumps(payload, indent=1))  # first: a plot's failure loses nothing
    (args.out / "quality.md").write_text(report)
    plot(summary, args.out / "quality.png", label, settings.epochs, settings.lr_schedule)
    if any(entry["training_flops"] for by_s in summary.values() for entry in by_s.values()):
        plot_flops(summary, args.out / "quality_flops.png", label, settings.epochs, settings.lr_schedule)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
