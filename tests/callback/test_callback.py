"""Tests of ``PruningCallback`` in real, tiny and deterministic Lightning fits on the CPU.

Every fit trains ``Net`` (Linear 8-16-12-4: 128 + 192 + 48 = 368 prunable weights) on 64 fixed samples in 8 batches
of 8 without shuffling, so two fits of the same configuration are bit-identical. A fit takes a fraction of a second
with one intra-op thread (conftest.py's ``one_thread_for_module`` fixture; with several threads on a busy 2-core
machine it is 10x slower).
"""

from __future__ import annotations

import copy
import csv
import math
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor, nn

from lightprune import prune
from lightprune.callback import PruningCallback
from lightprune.prune._reparam import pruning_hooks
from lightprune.schedules import Constant, Cubic, Geometric, Linear, Points, Schedule
from tiny_lightning import STEPS_PER_EPOCH, WEIGHTS, N, TinyNet, folded, loader, pruning_state, quiet_trainer, state

pytestmark = [
    pytest.mark.usefixtures("one_thread_for_module"),
    pytest.mark.filterwarnings("ignore:.*but have no `val_dataloader`.*"),
]


# ----------------------------------------------------------------------------------------------------------------------
# Model, data, fits
# ----------------------------------------------------------------------------------------------------------------------


class Net(TinyNet):
    """:class:`TinyNet` that also validates, tests and predicts, and records whether it was pruned in validation."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.pruned_in: dict[str, list[bool]] = {"sanity": [], "validation": []}

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.pruned_in["sanity" if self.trainer.sanity_checking else "validation"].append(prune.is_pruned(self))
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", nn.functional.cross_entropy(self(x), y))

    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self(batch[0])


def trainer(
    callbacks: list[Callback] | Callback = (), *, tmp_path: Path | None = None, logger: Any = False, **kwargs: Any
) -> L.Trainer:
    options = {"max_epochs": 2, "logger": logger, "num_sanity_val_steps": 0, "log_every_n_steps": 1}
    options.update(default_root_dir=tmp_path, **kwargs)
    return quiet_trainer([callbacks] if isinstance(callbacks, Callback) else callbacks, **options)


def fit(
    callbacks: list[Callback] | Callback, model: L.LightningModule | None = None, **kwargs: Any
) -> tuple[L.LightningModule, L.Trainer]:
    model = Net() if model is None else model
    fit_kwargs = {key: kwargs.pop(key) for key in ("ckpt_path", "val_dataloaders") if key in kwargs}
    run = trainer(callbacks, **kwargs)
    run.fit(model, **fit_kwargs)
    return model, run


def csv_logger(tmp_path: Path) -> CSVLogger:
    return CSVLogger(tmp_path, name="csv", version=0)


def read_metrics(logger: CSVLogger) -> list[dict[str, float]]:
    """The rows of metrics.csv, empty cells dropped, values as floats (floats round-trip through their repr)."""
    with open(logger.experiment.metrics_file_path, newline="") as file:
        return [{key: float(value) for key, value in row.items() if value != ""} for row in csv.DictReader(file)]


def columns(logger: CSVLogger) -> list[str]:
    with open(logger.experiment.metrics_file_path, newline="") as file:
        return next(csv.reader(file))


def events_logged(rows: list[dict[str, float]]) -> dict[int, float]:
    """``{step: pruning/target}`` of the rows the callback logged (one per event without ``log_every_n_steps``)."""
    return {int(row["step"]): row["pruning/target"] for row in rows if "pruning/target" in row}


def zeros(tensor: Tensor) -> int:
    return int((tensor == 0).sum())


def weights(model: nn.Module) -> dict[str, Tensor]:
    """The effective (masked) value of every selected weight, by qualified name."""
    return {name: model.get_submodule(name.rsplit(".", 1)[0]).weight for name in WEIGHTS}


def masks(model: nn.Module) -> dict[str, Tensor]:
    return {name: model.get_submodule(name.rsplit(".", 1)[0]).weight_mask for name in WEIGHTS}


def zero_channels(tensor: Tensor, dim: int) -> int:
    other = [d for d in range(tensor.dim()) if d != dim]
    return int((torch.count_nonzero(tensor, dim=other) == 0).sum())


def assert_same_state(actual: dict[str, Tensor], expected: dict[str, Tensor], ordered: bool = True) -> None:
    """Same keys (in the same order unless ``ordered=False``), dtypes and values."""
    assert list(actual) == list(expected) if ordered else sorted(actual) == sorted(expected)
    for key in expected:
        assert actual[key].dtype == expected[key].dtype, key
        assert torch.equal(actual[key], expected[key]), key


def pruning_hook_names(model: nn.Module) -> set[str]:
    """Qualified names of the tensors under a pruning hook."""
    return {
        f"{prefix}.{hook._tensor_name}" if prefix else hook._tensor_name
        for prefix, module in model.named_modules()
        for _, hook in pruning_hooks(module)
    }


class Recorder(Callback):
    """Records, after every training batch (put it after the pruning callback), the number of pruned entries."""

    def __init__(self) -> None:
        self.batches: list[tuple[int, int, int]] = []  # (batch number in the fit, global_step, pruned weights)
        self._batch = 0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        pruned = sum(zeros(weight) for weight in weights(pl_module).values())
        self.batches.append((self._batch, trainer.global_step, pruned))
        self._batch += 1

    def changes(self) -> list[tuple[int, int, int]]:
        """The records where the pruned count differs from the previous batch's."""
        previous, changed = 0, []
        for record in self.batches:
            if record[2] != previous:
                changed.append(record)
            previous = record[2]
        return changed


# ----------------------------------------------------------------------------------------------------------------------
# 1. Schedules as seen through the callback: event steps and targets in metrics.csv
# ----------------------------------------------------------------------------------------------------------------------


GOLDEN: list[tuple[str, Any, dict[str, Any], dict[int, float]]] = [
    ("constant", Constant(0.4, at=5), {}, {5: 0.4}),
    ("float is one-shot at the start", 0.3, {}, {0: 0.3}),
    ("linear", Linear(initial=0.25, final=0.75, start=1, end=9, frequency=4), {}, {1: 0.25, 5: 0.5, 9: 0.75}),
    ("cubic", Cubic(final=0.8, start=2, end=12, frequency=5), {}, {2: 0.0, 7: 0.7, 12: 0.8}),
    ("geometric", Geometric(0.5, start=0, frequency=4, rounds=3), {}, {0: 0.5, 4: 0.75, 8: 0.875}),
    ("points", Points([(10, 0.625), (3, 0.25)]), {}, {3: 0.25, 10: 0.625}),
    ("callable every step", lambda t: min(t, 8) / 16, {}, {t: min(t, 8) / 16 for t in range(16)}),
    (
        "fractions of the 16 steps",
        Linear(final=0.6, start=0.25, end=0.75, frequency=0.25),
        {},
        {4: 0.0, 8: 0.3, 12: 0.6},
    ),
    (
        "fractions of the 8 optimizer steps under accumulation",
        Linear(final=0.5, start=0.0, end=1.0, frequency=0.25),
        {"accumulate_grad_batches": 2},
        {0: 0.0, 2: 1 / 7, 4: 2 / 7, 6: 3 / 7, 7: 0.5},  # end=1.0 is the last step, 7
    ),
    ("callable on a one-epoch run", lambda t: 0.25 + t, {"unit": "epoch", "max_epochs": 1}, {0: 0.25}),
    (
        "epochs, the last one when fit ends",
        Points([(1, 0.25), (2, 0.5)]),
        {"unit": "epoch"},
        {STEPS_PER_EPOCH: 0.25, 2 * STEPS_PER_EPOCH: 0.5},
    ),
]


@pytest.mark.parametrize(("schedule", "options", "expected"), [g[1:] for g in GOLDEN], ids=[g[0] for g in GOLDEN])
def test_event_steps_and_targets_in_metrics_csv(
    tmp_path: Path, schedule: Any, options: dict[str, Any], expected: dict[int, float]
) -> None:
    options = dict(options)
    unit = options.pop("unit", "step")
    logger = csv_logger(tmp_path)
    fit(PruningCallback(schedule, unit=unit), logger=logger, **options)
    rows = read_metrics(logger)
    assert events_logged(rows) == expected
    for row in rows:
        if "pruning/target" in row:  # every event reaches its target to the unit: round(target * N) weights
            assert row["pruning/sparsity/total"] == pytest.approx(round(row["pruning/target"] * N) / N, abs=1e-7)


def test_golden_values_are_the_schedules_own() -> None:
    """The golden table above is the schedules' own target(t); the callback must not re-interpret them."""
    for _, schedule, options, expected in GOLDEN:
        if not isinstance(schedule, Schedule) or "unit" in options:
            continue
        steps = 2 * STEPS_PER_EPOCH // options.get("accumulate_grad_batches", 1)
        resolved = schedule if schedule.is_resolved else schedule.resolve(steps)
        assert {t: resolved.target(t) for t in resolved.events()} == expected


# ----------------------------------------------------------------------------------------------------------------------
# 2. Final sparsity exact to the unit
# ----------------------------------------------------------------------------------------------------------------------

TARGET = 0.3
RAMP = Linear(final=TARGET, start=0, end=12, frequency=3)  # five events: 0, 0.075, 0.15, 0.225, 0.3


@pytest.mark.parametrize(
    "options",
    [
        {"method": "l1_unstructured", "scope": "global"},
        {"method": "random_unstructured", "scope": "global"},
        {"method": "l1_unstructured", "scope": "layerwise"},
        {"method": "random_unstructured", "scope": "layerwise"},
        {"method": "l1_unstructured", "scope": "global", "accumulate_grad_batches": 2},
        {"method": "l1_unstructured", "scope": "layerwise", "unit": "epoch", "max_epochs": 3},
    ],
    ids=str,
)
@pytest.mark.parametrize("make_permanent", [True, False])
def test_unstructured_final_sparsity_is_exact(options: dict[str, Any], make_permanent: bool) -> None:
    options = dict(options)
    schedule = Linear(final=TARGET, start=0, end=2, frequency=1) if options.get("unit") == "epoch" else RAMP
    trainer_options = {key: options.pop(key) for key in ("accumulate_grad_batches", "max_epochs") if key in options}
    if "accumulate_grad_batches" in trainer_options:
        schedule = Linear(final=TARGET, start=0, end=8, frequency=2)
    callback = PruningCallback(schedule, make_permanent=make_permanent, **options)
    model, _ = fit(callback, **trainer_options)
    counts = {name: zeros(weight) for name, weight in weights(model).items()}
    if options["scope"] == "global":
        assert sum(counts.values()) == round(TARGET * N) == 110
    else:
        assert counts == {name: round(TARGET * rows * cols) for name, (rows, cols) in WEIGHTS.items()}
        assert list(counts.values()) == [38, 58, 14]
    if make_permanent:
        assert pruning_hook_names(model) == set()
        assert not any(key.endswith(("_orig", "_mask")) for key in model.state_dict())
    else:  # the masks hold exactly the zeros (no trained weight happens to be zero)
        assert {name: zeros(mask) for name, mask in masks(model).items()} == counts


@pytest.mark.parametrize(
    ("method", "dim"),
    [("ln_structured", 0), ("ln_structured", 1), ("random_structured", 0), ("random_structured", 1)],
)
def test_structured_final_sparsity_is_exact_in_channels(method: str, dim: int) -> None:
    callback = PruningCallback(RAMP, method=method, method_kwargs={"dim": dim})
    assert callback.scope == "layerwise"
    model, _ = fit(callback)
    for name, weight in weights(model).items():
        channels = WEIGHTS[name][dim]
        assert zero_channels(weight, dim) == round(TARGET * channels), name
        assert zeros(weight) == round(TARGET * channels) * WEIGHTS[name][1 - dim], name


class SmallestFirst(prune.BasePruningMethod):
    """A user's method without the engine's fast path: torch's container semantics (slice, compute, scatter)."""

    PRUNING_TYPE = "unstructured"

    def __init__(self, amount: int, largest: bool = False) -> None:
        self.amount, self.largest = amount, largest

    def compute_mask(self, t: Tensor, default_mask: Tensor) -> Tensor:
        mask = default_mask.clone()
        if self.amount:
            chosen = torch.topk(t.abs().flatten(), self.amount, largest=self.largest).indices
            mask.view(-1)[chosen] = 0
        return mask


@pytest.mark.parametrize(
    ("method", "scope"),
    [(SmallestFirst, "global"), (SmallestFirst, "layerwise"), ("lightprune.prune.L1Unstructured", "global")],
)
def test_custom_method_and_import_path_reach_the_target_exactly(method: Any, scope: str) -> None:
    method_kwargs = {"largest": False} if method is SmallestFirst else {}
    callback = PruningCallback(RAMP, method=method, method_kwargs=method_kwargs, scope=scope)
    model, _ = fit(callback)
    counts = [zeros(weight) for weight in weights(model).values()]
    assert sum(counts) == 110
    if scope == "layerwise":
        assert counts == [38, 58, 14]


def test_gradient_accumulation_counts_optimizer_steps(tmp_path: Path) -> None:
    """With accumulate_grad_batches=2 an event at step t runs after the t-th optimizer step, i.e. batch 2t."""
    logger, recorder = csv_logger(tmp_path), Recorder()
    callback = PruningCallback(Linear(final=0.5, start=0, end=6, frequency=2))
    fit([callback, recorder], logger=logger, accumulate_grad_batches=2)
    assert list(events_logged(read_metrics(logger))) == [0, 2, 4, 6]
    # (batch number, optimizer steps done, pruned weights) where the pruned count changed
    assert recorder.changes() == [
        (3, 2, round(N * 0.5 / 3)),
        (7, 4, round(N * 0.5 * 2 / 3)),
        (11, 6, round(N * 0.5)),
    ]


def test_epoch_unit_prunes_at_epoch_starts_only(tmp_path: Path) -> None:
    """unit='epoch' prunes when an epoch starts; mid-epoch validations (val_check_interval=0.5) never prune."""
    logger, recorder = csv_logger(tmp_path), Recorder()
    callback = PruningCallback(Points([(1, 0.25), (2, 0.5)]), unit="epoch")
    model = Net()
    fit([callback, recorder], model, logger=logger, max_epochs=3, val_check_interval=0.5, val_dataloaders=loader(16))
    assert events_logged(read_metrics(logger)) == {8: 0.25, 16: 0.5}
    assert [(batch, step) for batch, step, _ in recorder.changes()] == [(8, 9), (16, 17)]
    assert sum(zeros(weight) for weight in weights(model).values()) == round(0.5 * N)
    assert len(model.pruned_in["validation"]) == 3 * 2 * 2  # 2 validations an epoch, 2 batches each


# ----------------------------------------------------------------------------------------------------------------------
# 3. What is logged
# ----------------------------------------------------------------------------------------------------------------------


def test_logged_keys_per_parameter_total_and_target(tmp_path: Path) -> None:
    logger = csv_logger(tmp_path)
    _, run = fit(PruningCallback(Constant(0.5, at=4), scope="layerwise"), logger=logger)
    keys = {f"pruning/sparsity/{name}" for name in WEIGHTS} | {"pruning/sparsity/total", "pruning/target"}
    assert keys <= set(columns(logger))
    (event,) = [row for row in read_metrics(logger) if "pruning/target" in row]
    assert event["step"] == 4
    assert event["pruning/target"] == 0.5
    for name, (rows, cols) in WEIGHTS.items():
        assert event[f"pruning/sparsity/{name}"] == round(0.5 * rows * cols) / (rows * cols)
    assert event["pruning/sparsity/total"] == 0.5
    assert float(run.callback_metrics["pruning/sparsity"]) == 0.5  # self.log: progress bar and callback_metrics


class EpochTotals(Callback):
    """``pruning/sparsity`` in ``callback_metrics`` at each epoch's end."""

    def __init__(self) -> None:
        self.totals: list[float | None] = []

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        value = trainer.callback_metrics.get("pruning/sparsity")
        self.totals.append(None if value is None else float(value))


@pytest.mark.parametrize(
    ("schedule", "unit", "expected"),
    [
        (0.5, "step", [0.5, 0.5, 0.5]),  # one-shot when training starts: never self.logged before
        (Constant(0.5, at=3), "step", [0.5, 0.5, 0.5]),  # every event in epoch 0: logged for epoch 0 only
        (Linear(final=0.5, start=0, end=2, frequency=1), "epoch", [0.0, 0.25, 0.5]),  # epoch 0's event at its start
    ],
    ids=["one-shot", "events in epoch 0", "epoch clock"],
)
def test_the_total_is_self_logged_every_epoch(schedule: Any, unit: str, expected: list[float]) -> None:
    """docs: `pruning/sparsity` reaches the module's logged metrics once an epoch. It was logged only by events taken
    inside an epoch's batches, so a one-shot schedule never gave it (EarlyStopping on it raised, ModelCheckpoint on
    it saved nothing)."""
    totals = EpochTotals()
    fit([PruningCallback(schedule, unit=unit, summary=False), totals], max_epochs=3)
    assert totals.totals == pytest.approx(expected, abs=1 / N)


def test_log_per_parameter_false_and_log_every_n_steps(tmp_path: Path) -> None:
    logger = csv_logger(tmp_path)
    callback = PruningCallback(Points([(2, 0.25), (9, 0.5)]), log_per_parameter=False, log_every_n_steps=3)
    fit(callback, logger=logger)
    assert not [column for column in columns(logger) if column.startswith("pruning/sparsity/net")]
    rows = [row for row in read_metrics(logger) if "pruning/target" in row]
    assert [int(row["step"]) for row in rows] == [2, 3, 6, 9, 12, 15]  # events 2 and 9, every 3 steps between
    assert [row["pruning/target"] for row in rows] == [0.25, 0.25, 0.25, 0.5, 0.5, 0.5]
    assert [row["pruning/sparsity/total"] for row in rows] == pytest.approx(
        [round(0.25 * N) / N] * 3 + [0.5] * 3, abs=1e-7
    )


# ----------------------------------------------------------------------------------------------------------------------
# 4. Resume from a mid-schedule end-of-epoch checkpoint is exact
# ----------------------------------------------------------------------------------------------------------------------
# A checkpoint saved mid-epoch would resume with a different data order (the default DataLoader is not resumable),
# so only end-of-epoch checkpoints are compared (under max_epochs); test_callback_resume.py resumes from every kind of
# checkpoint, with a resumable loader, under max_steps and max_epochs.

RESUME_CASES = {
    "l1 global, permanent": ({}, {}),
    "l1 global, rewind init, not permanent": ({"rewind": "init", "make_permanent": False}, {}),
    "random global, seeded draws": ({"method": "random_unstructured", "make_permanent": False}, {}),
    "random layerwise, rewind init": ({"method": "random_unstructured", "scope": "layerwise", "rewind": "init"}, {}),
    "rewind after 2 steps, float masks": ({"rewind": 2, "mask_dtype": None, "make_permanent": False}, {}),
    "random structured with bias, epochs": (
        {"method": "random_structured", "prune_channel_bias": True, "unit": "epoch", "make_permanent": False},
        {"schedule": Linear(final=0.6, start=0, end=4, frequency=1)},
    ),
}


def resume_schedule(case: dict[str, Any]) -> Schedule:
    return case.get("schedule", Cubic(final=0.7, start=2, end=30, frequency=4))  # events 2, 6, ..., 30


@pytest.mark.parametrize("case", list(RESUME_CASES), ids=list(RESUME_CASES))
def test_resume_from_mid_schedule_checkpoint_is_exact(tmp_path: Path, case: str) -> None:
    options, extra = RESUME_CASES[case]

    def run(ckpt_path: Path | None) -> L.LightningModule:
        checkpoints = ModelCheckpoint(tmp_path / "ckpt", every_n_epochs=1, save_top_k=-1)
        callback = PruningCallback(resume_schedule(extra), **options)
        model, done = fit(
            [callback, checkpoints], ckpt_path=ckpt_path, max_epochs=4, enable_checkpointing=True, tmp_path=tmp_path
        )
        assert done.global_step == 4 * STEPS_PER_EPOCH
        return model

    uninterrupted = run(None)
    middle = tmp_path / "ckpt" / f"epoch=1-step={2 * STEPS_PER_EPOCH}.ckpt"
    saved = torch.load(middle, weights_only=False)
    assert not any(key.endswith(("_orig", "_mask")) for key in saved["state_dict"]), "plain keys in checkpoints"
    callback_state = pruning_state(saved)
    assert callback_state["masks"], "the checkpoint must be mid-schedule, with masks in the callback's state"
    resumed = run(middle)  # a fresh, unpruned Net
    assert_same_resumed(resumed, uninterrupted)


def assert_same_resumed(resumed: nn.Module, uninterrupted: nn.Module) -> None:
    """A resumed fit holds what the uninterrupted one holds: the same effective weights, masks and hooks.

    ``name_orig`` may differ where the mask is zero: the checkpoint holds the effective values, and what an optimizer
    does to a pruned entry of ``name_orig`` never reaches the model (torch ranks a re-prune on ``orig * mask``).
    """
    assert_same_state(folded(state(resumed)), folded(state(uninterrupted)))
    mask_keys = [key for key in state(uninterrupted) if key.endswith("_mask")]
    assert_same_state({k: state(resumed)[k] for k in mask_keys}, {k: state(uninterrupted)[k] for k in mask_keys})
    assert pruning_hook_names(resumed) == pruning_hook_names(uninterrupted)


# ----------------------------------------------------------------------------------------------------------------------
# A module-scoped pruned run shared by the checkpoint, validate/test/predict and fit-end tests
# ----------------------------------------------------------------------------------------------------------------------


class PrunedRun:
    def __init__(self, root: Path) -> None:
        self.user_pruned = Net()
        prune.l1_unstructured(self.user_pruned.net[0], "bias", amount=3)  # the user's own pruning, not selected
        self.callback = PruningCallback(Cubic(final=0.6, start=0, end=12, frequency=4), make_permanent=False)
        checkpoints = ModelCheckpoint(root / "ckpt", every_n_epochs=1, save_top_k=-1)
        self.model, self.trainer = fit(
            [self.callback, checkpoints], self.user_pruned, enable_checkpointing=True, tmp_path=root
        )
        self.checkpoint = root / "ckpt" / f"epoch=1-step={2 * STEPS_PER_EPOCH}.ckpt"


@pytest.fixture(scope="module")
def pruned_run(tmp_path_factory: pytest.TempPathFactory) -> PrunedRun:
    return PrunedRun(tmp_path_factory.mktemp("pruned_run"))


def test_not_permanent_keeps_exact_bool_masks(pruned_run: PrunedRun) -> None:
    model = pruned_run.model
    assert pruning_hook_names(model) == {*WEIGHTS, "net.0.bias"}
    assert all(mask.dtype == torch.bool for mask in masks(model).values())
    assert sum(zeros(mask) for mask in masks(model).values()) == round(0.6 * N)
    assert zeros(model.net[0].bias_mask) == 3


# ----------------------------------------------------------------------------------------------------------------------
# 5. A pruned checkpoint loads into a fresh model, strictly, with no key surgery
# ----------------------------------------------------------------------------------------------------------------------


def test_checkpoints_hold_plain_pruned_tensors_and_load_into_a_plain_model(pruned_run: PrunedRun) -> None:
    checkpoint = torch.load(pruned_run.checkpoint, weights_only=True)
    saved = checkpoint["state_dict"]
    # the callback's tensors under their plain names; the user's own pruning of net.0.bias is left as torch saves it
    assert [key for key in saved if key.startswith("net.0.")] == ["net.0.weight", "net.0.bias_orig", "net.0.bias_mask"]
    assert set(WEIGHTS) <= set(saved)
    callback_state = pruning_state(checkpoint)
    for name in WEIGHTS:  # the effective values: exact zeros where the saved mask prunes
        mask = callback_state["masks"][name]
        assert mask.dtype == torch.bool and 0 < zeros(mask) < mask.numel()
        assert torch.equal(saved[name] == 0, ~mask | (saved[name] == 0))
        assert zeros(saved[name][~mask]) == zeros(mask)
    plain = {key: value for key, value in saved.items() if not key.startswith("net.0.bias")}
    fresh = Net(seed=5)
    del fresh.net[0].bias
    fresh.net[0].register_parameter("bias", None)
    fresh.net[0].bias = nn.Parameter(torch.zeros(16))
    plain["net.0.bias"] = torch.where(saved["net.0.bias_mask"].bool(), saved["net.0.bias_orig"], 0)
    assert str(fresh.load_state_dict(plain, strict=True)) == "<All keys matched successfully>"


class UnprunedBiasNet(Net):
    """Net whose checkpoint is loaded without lightprune: the user's own bias pruning is not part of the test."""


def test_a_checkpoint_written_during_fit_loads_the_lightning_way(tmp_path: Path) -> None:
    checkpoints = ModelCheckpoint(tmp_path / "ckpt", every_n_epochs=1, save_top_k=-1)
    callback = PruningCallback(Cubic(final=0.6, start=0, end=12, frequency=4), make_permanent=False)
    model, _ = fit([callback, checkpoints], enable_checkpointing=True, tmp_path=tmp_path)
    path = tmp_path / "ckpt" / f"epoch=1-step={2 * STEPS_PER_EPOCH}.ckpt"
    loaded = Net.load_from_checkpoint(path)  # a plain LightningModule, no lightprune involved
    assert not prune.is_pruned(loaded)
    assert_same_state(state(loaded), folded(state(model)))
    assert sum(zeros(weight) for weight in weights(loaded).values()) == round(0.6 * N)
    # and a plain Trainer (no PruningCallback) restores it for validate
    other = Net(seed=5)
    trainer().validate(other, loader(16), ckpt_path=path, weights_only=True)
    assert_same_state(state(other), folded(state(model)))
    # the model itself follows torch's contract again after fit (make_permanent=False)
    assert {"net.0.weight_orig", "net.0.weight_mask"} <= set(model.state_dict())


def test_plain_state_dict_loads_into_pruned_model(pruned_run: PrunedRun) -> None:
    pruned = copy.deepcopy(pruned_run.model)
    plain = folded(state(pruned_run.model))
    prune.prepare_for_state_dict(pruned, plain)
    pruned.load_state_dict(plain, strict=True)
    assert pruning_hook_names(pruned) == set()
    assert_same_state(state(pruned), plain, ordered=False)


# ----------------------------------------------------------------------------------------------------------------------
# 6. Buffers whose name ends in _mask, and MultiheadAttention
# ----------------------------------------------------------------------------------------------------------------------


class Attention(Net):
    """A causal self-attention block: a buffer ``attn_mask`` (lightning's ModelPruning fails on it with KeyError:
    'attn_orig') and an nn.MultiheadAttention, whose ``out_proj.weight`` is read without calling out_proj's forward."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.embed = nn.Linear(2, 8)
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.register_buffer("attn_mask", torch.triu(torch.ones(4, 4, dtype=torch.bool), diagonal=1))

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x.view(-1, 4, 2))
        h, _ = self.attn(h, h, h, attn_mask=self.attn_mask, need_weights=False)
        return self.net(h.mean(dim=1))


ATTENTION_WEIGHTS = [*WEIGHTS, "embed.weight", "attn.out_proj.weight"]


def test_mask_buffer_and_multihead_attention_prune_checkpoint_and_resume(tmp_path: Path) -> None:
    def run(ckpt_path: Path | None) -> tuple[L.LightningModule, PruningCallback]:
        callback = PruningCallback(Linear(final=0.5, start=0, end=28, frequency=4), make_permanent=False)
        checkpoints = ModelCheckpoint(tmp_path / "ckpt", every_n_epochs=1, save_top_k=-1)
        model, _ = fit(
            [callback, checkpoints],
            Attention(),
            ckpt_path=ckpt_path,
            max_epochs=4,
            enable_checkpointing=True,
            tmp_path=tmp_path,
            val_dataloaders=loader(16),
        )
        return model, callback

    uninterrupted, callback = run(None)
    assert callback.selection == ATTENTION_WEIGHTS
    assert torch.equal(uninterrupted.attn_mask, Attention().attn_mask)
    out_proj = uninterrupted.attn.out_proj
    assert zeros(out_proj.weight_mask) > 0
    # the forward sees the current orig * mask, although MultiheadAttention never calls out_proj's forward
    assert torch.equal(out_proj.weight, torch.where(out_proj.weight_mask, out_proj.weight_orig, 0))
    x = next(iter(loader()))[0]
    permanent = copy.deepcopy(uninterrupted).eval()
    for name in ATTENTION_WEIGHTS:
        prune.remove(permanent.get_submodule(name.rsplit(".", 1)[0]), "weight")
    assert torch.equal(uninterrupted.eval()(x), permanent(x))

    middle = tmp_path / "ckpt" / f"epoch=1-step={2 * STEPS_PER_EPOCH}.ckpt"
    checkpoint = torch.load(middle, weights_only=False)
    saved = checkpoint["state_dict"]
    assert {"attn_mask", "attn.out_proj.weight"} <= set(saved)
    assert not {"attn_orig", "attn.out_proj.weight_orig", "attn.out_proj.weight_mask"} & set(saved)
    assert "attn.out_proj.weight" in pruning_state(checkpoint)["masks"]
    resumed, _ = run(middle)
    assert_same_resumed(resumed, uninterrupted)


class WeightNormed(Net):
    """The first layer under the old-style ``nn.utils.weight_norm``: its forward pre-hook, registered before any
    pruning, computes ``weight`` from ``weight_v`` before ``weight_v``'s pruning hook runs. Every training step
    records how far the layer's output is from the masked math and whether ``weight_v_orig`` got a gradient."""

    def __init__(self) -> None:
        super().__init__()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # the old API is deprecated, still common in vocoders
            self.net[0] = nn.utils.weight_norm(self.net[0])
        self.errors: list[float] = []
        self.got_gradient: list[bool] = []

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        layer, x = self.net[0], batch[0]
        if "weight_v_orig" in layer._parameters:
            v = torch.where(layer.weight_v_mask, layer.weight_v_orig, 0)
            want = nn.functional.linear(x, layer.weight_g * v / v.norm(dim=1, keepdim=True), layer.bias)
            self.errors.append(float((layer(x) - want).abs().max().detach()))
        return super().training_step(batch, batch_idx)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if self.errors:
            self.got_gradient.append(self.net[0].weight_v_orig.grad is not None)


def test_a_tensor_read_by_an_earlier_pre_hook_is_current_at_every_step() -> None:
    """Reparametrized ``weight_v`` under weight_norm: the forward uses this step's masked value (before, the last
    forward's, and no gradient at all after a validation pass)."""
    callback = PruningCallback(Linear(final=0.5, start=0, end=12, frequency=4), parameter_names=["weight", "weight_v"])
    model, _ = fit(callback, WeightNormed(), max_epochs=2, val_dataloaders=loader(16))
    assert callback.selection == ["net.0.weight_v", "net.2.weight", "net.4.weight"]
    assert len(model.errors) == 2 * STEPS_PER_EPOCH - 4 and max(model.errors) < 1e-5, model.errors  # pruned at step 4
    assert all(model.got_gradient) and len(model.got_gradient) == len(model.errors)


# ----------------------------------------------------------------------------------------------------------------------
# 7. validate / test / predict and the sanity check never prune
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pruned", [False, True], ids=["fresh model", "pruned model"])
def test_validate_test_predict_leave_the_model_untouched(pruned_run: PrunedRun, pruned: bool) -> None:
    model = copy.deepcopy(pruned_run.model) if pruned else Net()
    before, hooked = state(model), pruning_hook_names(model)
    callback = PruningCallback(Constant(0.9, at=0), include=r".*", parameter_names=None, module_types=None)
    run = trainer(callback)
    run.validate(model, loader(16))
    run.test(model, loader(16))
    predictions = run.predict(model, loader(16))
    assert len(predictions) == 2
    assert_same_state(state(model), before)
    assert pruning_hook_names(model) == hooked


def test_sanity_check_never_prunes() -> None:
    model = Net()
    callback = PruningCallback(Constant(0.5, at=0))
    fit(callback, model, num_sanity_val_steps=2, val_dataloaders=loader(16), max_epochs=1)
    assert model.pruned_in["sanity"] == [False, False]
    assert model.pruned_in["validation"] == [True, True]


# ----------------------------------------------------------------------------------------------------------------------
# 8. Reuse: fit after fit, test after fit, several callbacks
# ----------------------------------------------------------------------------------------------------------------------


def total_zeros(model: nn.Module) -> int:
    return sum(zeros(weight) for weight in weights(model).values())


@pytest.mark.parametrize("second", ["same callback, same model", "same callback, new model", "new callback"])
@pytest.mark.parametrize("make_permanent", [True, False])
def test_fit_twice(tmp_path: Path, second: str, make_permanent: bool) -> None:
    def new_callback() -> PruningCallback:
        return PruningCallback(Linear(final=0.5, start=2, end=10, frequency=4), make_permanent=make_permanent)

    callback = new_callback()
    model, _ = fit(callback)
    assert total_zeros(model) == round(0.5 * N)
    logger = csv_logger(tmp_path)
    if second == "same callback, new model":
        model = Net(seed=3)
    elif second == "new callback":
        callback = new_callback()
    if not make_permanent and second != "same callback, new model":
        # the model carries the first fit's masks: a replayed schedule would log targets its masks are past
        with pytest.raises(ValueError, match=r"already carry pruning masks .*adopt_zeros=True"):
            fit(callback, model, logger=logger)
        return
    fit(callback, model, logger=logger)
    # the second fit replays the schedule (its events are logged) and ends exactly at the target
    assert events_logged(read_metrics(logger)) == {2: 0.0, 6: 0.25, 10: 0.5}
    assert total_zeros(model) == round(0.5 * N)
    assert (pruning_hook_names(model) == set()) is make_permanent


@pytest.mark.parametrize("make_permanent", [True, False])
def test_test_after_fit(make_permanent: bool) -> None:
    model, run = fit(PruningCallback(0.5, make_permanent=make_permanent))
    before = state(model)
    (metrics,) = run.test(model, loader(16))
    assert math.isfinite(metrics["test_loss"])
    assert_same_state(state(model), before)
    assert total_zeros(model) == round(0.5 * N)


def test_two_callbacks_on_disjoint_parameters_reach_their_targets() -> None:
    unstructured = PruningCallback(Linear(final=0.5, end=8, frequency=4), include=r"net\.[02]\.weight", name="a")
    structured = PruningCallback(Constant(0.5, at=3), method="ln_structured", include=r"net\.4\..*", name="b")
    model, _ = fit([unstructured, structured])
    assert zeros(model.net[0].weight) + zeros(model.net[2].weight) == round(0.5 * (128 + 192))
    assert zero_channels(model.net[4].weight, 0) == 2
    assert unstructured.state_key != structured.state_key


def test_two_callbacks_with_disjoint_explicit_parameters_checkpoint_and_resume(tmp_path: Path) -> None:
    def run(ckpt_path: Path | None) -> tuple[L.LightningModule, list[PruningCallback]]:
        model = Net()
        first = PruningCallback(
            Linear(final=0.5, end=20, frequency=4), parameters=[(model.net[0], "weight")], name="first"
        )
        second = PruningCallback(
            Linear(final=0.25, end=20, frequency=4), parameters=[(model.net[2], "weight")], name="second"
        )
        checkpoints = ModelCheckpoint(tmp_path / "ckpt", every_n_epochs=1, save_top_k=-1)
        fit([first, second, checkpoints], model, ckpt_path=ckpt_path, enable_checkpointing=True, max_epochs=3)
        return model, [first, second]

    uninterrupted, (first, second) = run(None)
    assert first.state_key != second.state_key
    assert "first" in first.state_key and "second" in second.state_key
    assert zeros(uninterrupted.net[0].weight) == 64
    assert zeros(uninterrupted.net[2].weight) == 48
    middle = tmp_path / "ckpt" / f"epoch=0-step={STEPS_PER_EPOCH}.ckpt"
    assert {first.state_key, second.state_key} <= set(torch.load(middle, weights_only=False)["callbacks"])
    resumed, _ = run(middle)
    assert_same_resumed(resumed, uninterrupted)


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ({"include": r"net\.[02]\.weight"}, {"include": r"net\.2\..*"}),
        ({"name": "a"}, {"name": "b"}),  # identical configurations (named apart, else Lightning refuses their keys)
    ],
)
def test_overlapping_selections_raise_at_setup(first: dict[str, Any], second: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"two PruningCallbacks select the same parameters \[.*'net\.2\.weight'"):
        fit([PruningCallback(0.5, **first), PruningCallback(0.25, **second)])


# ----------------------------------------------------------------------------------------------------------------------
# 9. Lottery ticket rewinding
# ----------------------------------------------------------------------------------------------------------------------


class RewindSpy(Callback):
    """Snapshots every parameter (user-facing names) at ``at`` and checks the weights around each event."""

    def __init__(self, callback: PruningCallback, events: list[int], at: int | None) -> None:
        self.callback, self.events, self.at = callback, events, at
        self.expected: dict[str, Tensor] | None = None
        self.checked: list[int] = []
        self.drifted: list[int] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.at == 0:
            self.expected = PruningCallback.snapshot_weights(pl_module)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        current = PruningCallback.snapshot_weights(pl_module)
        if step == self.at:  # no event here: the callback snapshots the same values
            self.expected = current
        if self.expected is None:
            return
        same = all(torch.equal(current[name], self.expected[name]) for name in self.expected)
        if step in self.events:
            assert same, f"not rewound after the event at step {step}"
            for name in WEIGHTS:  # the effective weights are the snapshot's, masked
                module = pl_module.get_submodule(name.rsplit(".", 1)[0])
                assert torch.equal(module.weight, torch.where(module.weight_mask, self.expected[name], 0))
            self.checked.append(step)
        elif step + 1 in self.events and not same:
            self.drifted.append(step)


@pytest.mark.parametrize("rewind", ["init", 3, "snapshot"])
def test_rewind_after_every_event(rewind: Any) -> None:
    events = [4, 8, 12, 16]
    model = Net()
    spy_at: int | None = 0 if rewind in ("init", "snapshot") else rewind
    given = PruningCallback.snapshot_weights(model) if rewind == "snapshot" else rewind
    callback = PruningCallback(
        Linear(initial=0.2, final=0.8, start=4, end=16, frequency=4), rewind=given, make_permanent=False
    )
    spy = RewindSpy(callback, events, spy_at)
    fit([callback, spy], model)
    assert spy.checked == events  # every event rewinds, not just the first (lightning's ModelPruning: only once)
    assert spy.drifted == ([3] if spy_at == 0 else []) + [7, 11, 15]  # training moved the weights in between
    snapshot = callback._rewind_snapshot
    assert snapshot is not None
    assert all(tensor.device.type == "cpu" for tensor in snapshot.values())
    live = {parameter.untyped_storage().data_ptr() for parameter in model.parameters()}
    assert not live & {tensor.untyped_storage().data_ptr() for tensor in snapshot.values()}


@pytest.mark.parametrize("rewind", ["init", 6])
def test_a_ramps_first_event_at_level_0_prunes_and_rewinds_nothing(rewind: Any) -> None:
    """A ramp from 0 starting at step 4: that event prunes nothing, so the training before it is kept (it was thrown
    away by a rewind to the snapshot), and a rewind point before the next event (step 8) is no error."""
    model = Net()
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    callback = PruningCallback(Linear(final=0.8, start=4, end=16, frequency=4), rewind=rewind, make_permanent=False)
    seen: dict[int, bool] = {}

    class AtStep(Callback):
        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
            if trainer.global_step in (4, 8):
                weight = pl_module.net[0].weight_orig if trainer.global_step == 8 else pl_module.net[0].weight
                seen[trainer.global_step] = torch.equal(weight, initial["net.0.weight"])

    fit([callback, AtStep()], model)
    assert seen[4] is False  # not rewound at the level-0 event
    assert seen[8] is (rewind == "init")  # rewound at the first event that prunes (to step 6's weights for 6)


def test_a_layerwise_cap_that_rounding_would_pass_holds_and_names_the_tensor() -> None:
    """net.4 has 4 output channels and net.2 12: at 0.375 with a cap of 0.375, round(1.5) = 2 channels of net.4
    would pass the cap (1.5): it holds 1, and the warning says so, naming it."""
    callback = PruningCallback(0.375, method="ln_structured", method_kwargs={"n": 2, "dim": 0}, scope="layerwise",
                               max_layer_sparsity=0.375, make_permanent=False, summary=False)  # fmt: skip
    with pytest.warns(UserWarning, match=r"max_layer_sparsity=0\.375 holds net\.4\.weight \(1 of 4\) short of"):
        model, _ = fit(callback, max_steps=1)
    assert int((~model.net[4].weight_mask.bool()).all(dim=1).sum()) == 1


def test_check_run_makes_the_checks_of_training_start_on_a_given_length() -> None:
    """An app that knows its fine-tuning run's length refuses what fit would refuse, before anything trains."""
    fractions = Linear(initial=0.1, final=0.5, start=0.25, end=0.75)
    PruningCallback(fractions, rewind=3).check_run(steps=16, epochs=2)
    with pytest.raises(ValueError, match=r"rewind=5 is after the first pruning event at step 4"):
        PruningCallback(fractions, rewind=5).check_run(steps=16, epochs=2)
    with pytest.raises(ValueError, match=r"start=1 must be < end=1"):
        PruningCallback(Linear(final=0.5, start=0.5, end=0.6), unit="epoch").check_run(steps=16, epochs=2)
    with pytest.raises(ValueError, match=r"no update falls before it"):
        PruningCallback(0.5, regrow="rigl", regrow_every=8).check_run(steps=10, epochs=1)


def test_a_snapshot_that_lacks_a_selected_tensor_is_refused_before_training() -> None:
    """A snapshot of the inner network (names without ``net.``) would rewind nothing: lottery-ticket rounds would
    silently be plain fine-tuning."""
    model = Net()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    for snapshot, match in (
        (PruningCallback.snapshot_weights(model.net), r"no entry for the pruned net\.0\.weight, .*'0\.bias'"),
        ({}, r"no entry for the pruned net\.0\.weight.*its keys: none"),
        (
            {**PruningCallback.snapshot_weights(model), "net.2.weight": torch.zeros(3, 3)},
            r"holds the pruned net\.2\.weight \(\(3, 3\) in the snapshot",
        ),
    ):
        callback = PruningCallback(Constant(0.5, at=2), rewind=snapshot)
        with pytest.raises(ValueError, match=match):
            fit(callback, model)
        assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())  # no step was taken
    # a snapshot of the whole model holding more (an unselected bias of another shape) is fine
    extra = {**PruningCallback.snapshot_weights(model), "net.0.bias": torch.zeros(1)}
    fit(PruningCallback(Constant(0.5, at=2), rewind=extra, make_permanent=False), model, max_steps=2)
    assert torch.equal(model.net[0].weight_orig, extra["net.0.weight"])  # rewound at the event, the fit's end


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_rewind_snapshot_lives_on_cpu_for_a_cuda_model() -> None:
    callback = PruningCallback(Linear(final=0.5, start=2, end=6, frequency=2), rewind="init")
    devices: set[str] = set()

    class Spy(Callback):  # at the end of training: Lightning moves the model back to the CPU once fit returns
        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            devices.update(parameter.device.type for parameter in pl_module.parameters())

    model, _ = fit([callback, Spy()], accelerator="cuda")
    assert devices == {"cuda"}
    assert {tensor.device.type for tensor in callback._rewind_snapshot.values()} == {"cpu"}
    assert total_zeros(model) == round(0.5 * N)


class GlobalRngSpy(Callback):
    """Put one before and one after the pruning callback: the global RNG state must not change in between."""

    def __init__(self, before: GlobalRngSpy | None = None) -> None:
        self.before, self.state, self.compared = before, torch.Tensor(), 0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self.before is None:
            self.state = torch.get_rng_state()
        else:
            assert torch.equal(torch.get_rng_state(), self.before.state)
            self.compared += 1


def test_random_masks_come_from_seed_and_event_not_from_the_global_generator() -> None:
    def random_masks(global_seed: int, seed: int) -> dict[str, Tensor]:
        torch.manual_seed(global_seed)
        before = GlobalRngSpy()
        after = GlobalRngSpy(before)
        callback = PruningCallback(RAMP, method="random_unstructured", seed=seed, make_permanent=False)
        model, _ = fit([before, callback, after])
        assert after.compared == 2 * STEPS_PER_EPOCH  # the draws left the global generator as it was
        return {name: mask.clone() for name, mask in masks(model).items()}

    reference = random_masks(global_seed=1, seed=0)
    assert_same_state(random_masks(global_seed=2, seed=0), reference)
    other = random_masks(global_seed=1, seed=1)
    assert any(not torch.equal(other[name], reference[name]) for name in WEIGHTS)


# ----------------------------------------------------------------------------------------------------------------------
# 10, 11. Fit end: only this callback's tensors become plain Parameters; channel biases
# ----------------------------------------------------------------------------------------------------------------------


def test_make_permanent_removes_only_this_callbacks_reparametrization() -> None:
    model = Net()
    prune.l1_unstructured(model.net[0], "bias", amount=3)
    prune.random_unstructured(model.net[4], "bias", amount=1)
    callback = PruningCallback(RAMP, scope="layerwise")
    fit(callback, model)
    assert pruning_hook_names(model) == {"net.0.bias", "net.4.bias"}  # the user's hooks are kept
    for name in WEIGHTS:
        module = model.get_submodule(name.rsplit(".", 1)[0])
        assert isinstance(module._parameters["weight"], nn.Parameter)
        assert "weight_orig" not in module._parameters
        assert "weight_mask" not in module._buffers
    assert sorted(key for key in model.state_dict() if key.endswith(("_orig", "_mask"))) == [
        "net.0.bias_mask",
        "net.0.bias_orig",
        "net.4.bias_mask",
        "net.4.bias_orig",
    ]
    assert [zeros(weight) for weight in weights(model).values()] == [38, 58, 14]
    assert zeros(model.net[0].bias) == 3


@pytest.mark.parametrize("make_permanent", [True, False])
def test_prune_channel_bias_zeroes_the_bias_of_pruned_channels(make_permanent: bool) -> None:
    callback = PruningCallback(
        Linear(final=0.5, end=8, frequency=4),
        method="ln_structured",
        method_kwargs={"n": 1},
        prune_channel_bias=True,
        make_permanent=make_permanent,
    )
    model, _ = fit(callback)
    for name, (rows, _) in WEIGHTS.items():
        module = model.get_submodule(name.rsplit(".", 1)[0])
        pruned_rows = torch.count_nonzero(module.weight, dim=1) == 0
        assert int(pruned_rows.sum()) == round(0.5 * rows)
        assert torch.equal(module.bias == 0, pruned_rows)
        if not make_permanent:
            assert torch.equal(module.bias_mask, ~pruned_rows)
    assert (pruning_hook_names(model) == set()) is make_permanent


@pytest.mark.parametrize(
    ("layer", "name", "bias"),
    [
        (nn.MultiheadAttention(8, 2), "in_proj_weight", "in_proj_bias"),
        (nn.LSTM(8, 4), "weight_ih_l0", "bias_ih_l0"),
    ],
)
def test_prune_channel_bias_refuses_a_tensor_whose_bias_it_would_leave_whole(layer: nn.Module, name: str, bias: str):
    callback = PruningCallback(0.5, method="ln_structured", prune_channel_bias=True, parameters=[(layer, name)])
    with pytest.raises(ValueError, match=rf"0\.{name} \({type(layer).__name__}\) has its bias in '{bias}'"):
        callback.check_model(nn.Sequential(layer))
    PruningCallback(0.5, method="ln_structured", parameters=[(layer, name)]).check_model(nn.Sequential(layer))


class SparseEmbedding(TinyNet):
    """Token ids through ``nn.Embedding(sparse=True)`` (sparse gradients) into :class:`TinyNet`'s layers."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.embed = nn.Embedding(20, 8, sparse=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(self.embed((x.abs() * 5).long().clamp(max=19)).mean(dim=1))


def test_layers_under_a_parametrization_are_named_where_the_selection_cannot_take_them() -> None:
    """``torch.nn.utils.parametrizations.weight_norm``: ``weight`` is computed, not a Parameter. Before, the default
    selection skipped the layer without a word, and an explicit pair was refused as a missing parameter."""
    model = TinyNet()
    model.net[0] = nn.utils.parametrizations.weight_norm(model.net[0])
    with pytest.warns(UserWarning, match=r"\['net\.0\.weight'\] are computed from other parameters by a parametri"):
        PruningCallback(0.5).check_model(model)
    with pytest.raises(
        ValueError, match=r"'weight' is computed by .*\(_WeightNorm\) from \['original0', 'original1'\]"
    ):
        PruningCallback(0.5, parameters=[(model.net[0], "weight")]).check_model(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        PruningCallback(0.5, exclude=r"net\.0\..*").check_model(model)
        PruningCallback(0.5, include=r"net\.[24]\.weight").check_model(model)  # chosen by name: not asked for
    callback = PruningCallback(0.5, parameters=[(model.net[0].parametrizations.weight, "original1")])
    pruned, _ = fit(callback, model, max_epochs=1)
    assert zeros(pruned.net[0].weight) == 64  # the forward's weight: weight_norm keeps the original's zeros


class Lazy(TinyNet):
    """The first layer is an ``nn.LazyLinear``: materialized by its first forward, or in ``setup`` when asked."""

    def __init__(self, materialize: bool) -> None:
        super().__init__()
        self.net[0] = nn.LazyLinear(16)
        self.materialize = materialize

    def setup(self, stage: str) -> None:
        if self.materialize:
            self(torch.zeros(1, 8))


def test_a_lazy_module_not_yet_materialized_is_refused_naming_it() -> None:
    """Before, setup failed inside a size check with torch's message, which names no tensor."""
    with pytest.raises(ValueError, match=r"\['net\.0\.weight'\] belong to lazy modules not yet initialized"):
        PruningCallback(0.5).check_model(Lazy(materialize=False))
    with pytest.raises(ValueError, match=r"\['net\.0\.weight'\] belong to lazy modules not yet initialized"):
        fit(PruningCallback(0.5), Lazy(materialize=False))
    model, _ = fit(PruningCallback(Constant(0.5, at=2)), Lazy(materialize=True))
    assert sum(zeros(w) for w in weights(model).values()) == N // 2


@pytest.mark.parametrize(
    ("kwargs", "refused"),
    [
        ({}, "mask_dtype=torch.bool"),
        ({"mask_dtype": None, "masking": "inplace"}, "masking='inplace'"),
        ({"mask_dtype": None, "importance": "movement"}, "importance='movement'"),
        ({"mask_dtype": None}, None),
    ],
)
def test_sparse_gradients_are_refused_at_setup_where_they_cannot_be_masked(kwargs: dict, refused: str | None) -> None:
    """Before, the fit trained densely up to the first event and failed there (or at the first step)."""
    callback = PruningCallback(Constant(0.5, at=3), module_types=[nn.Embedding, nn.Linear], **kwargs)
    model = SparseEmbedding()
    before = model.embed.weight.detach().clone()
    if refused is None:
        fit(callback, model, max_epochs=1)
        assert zeros(model.embed.weight) + sum(zeros(w) for w in weights(model).values()) == round(0.5 * (160 + N))
        return
    with pytest.raises(
        ValueError, match=rf"\['embed\.weight'\] belong to modules with sparse=True, .*{re.escape(refused)}"
    ):
        fit(callback, model, max_epochs=1)
    assert torch.equal(model.embed.weight, before)


# ----------------------------------------------------------------------------------------------------------------------
# 12. Configuration mistakes raise at construction or setup, naming the value and what is allowed
# ----------------------------------------------------------------------------------------------------------------------


class MostlyEmbedding(Net):
    """A model whose weights are mostly not Linear or Conv: the default selection would cover a small share."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(500, 8)

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x + self.embed.weight[:1])


@pytest.mark.parametrize(("parameter_names", "warns"), [(("weight",), True), (["bias"], False)])
def test_the_small_share_warning_is_for_the_default_selection_only(parameter_names: Any, warns: bool) -> None:
    """It advises module_types for the default types' weights; parameter_names chosen by the user is no default."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(PruningCallback(0.3, parameter_names=parameter_names, summary=False), MostlyEmbedding(), max_epochs=1)
    said = [str(w.message) for w in caught if "of the model's weights" in str(w.message)]
    assert len(said) == warns, said


def test_fractions_too_fine_for_a_fast_dev_run_name_it() -> None:
    """The smoke run users make before the real one: its one step cannot hold a ramp given in fractions of the run."""
    callback = PruningCallback(Cubic(final=0.6, start=0.1, end=0.7, frequency=0.1))
    with pytest.raises(ValueError, match=r"start=0 must be < end=0 .*Trainer\(fast_dev_run=True\) makes the run 1"):
        quiet_trainer([callback], fast_dev_run=True).fit(Net())


class TorchsOwnSubclass(torch.nn.utils.prune.BasePruningMethod):
    PRUNING_TYPE = "unstructured"


@pytest.mark.parametrize("given", ["class", "import path"])
@pytest.mark.parametrize("name", ["L1Unstructured", "RandomUnstructured", "LnStructured", "RandomStructured"])
def test_torchs_built_in_methods_stand_for_lightprunes(name: str, given: str) -> None:
    """A user swapping torch's pruning for the callback passes torch's classes: they mean lightprune's twins."""
    method = getattr(torch.nn.utils.prune, name) if given == "class" else f"torch.nn.utils.prune.{name}"
    kwargs = {"n": 2, "dim": 0} if name == "LnStructured" else {"dim": 0} if name == "RandomStructured" else None
    callback = PruningCallback(0.5, method=method, method_kwargs=kwargs)
    assert callback.method is getattr(prune, name)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"method": "l2_unstructured"}, r"method='l2_unstructured' is not supported: use one of 'l1_unstructured'"),
        ({"method": "no_such_package.Method"}, r"method='no_such_package.Method' could not be imported"),
        ({"method": "torch.nn.Linear"}, r"method='torch.nn.Linear' is not a lightprune.prune.BasePruningMethod"),
        ({"method": TorchsOwnSubclass}, r"derives from torch.nn.utils.prune.BasePruningMethod: .* lightprune.prune"),
        ({"method": "torch.nn.utils.prune.prune"}, r"method='torch.nn.utils.prune.prune' could not be imported"),
        ({"method": 3}, r"method=3 is not supported"),
        (
            {"method": torch.nn.utils.prune.l1_unstructured},
            r"is not supported: use one of .*a BasePruningMethod subclass",
        ),
        ({"method_kwargs": {"amount": 0.5}}, r"method_kwargs must not contain 'amount'"),
        ({"method": "ln_structured", "method_kwargs": {"dim": "0"}}, r"method_kwargs dim='0' must be an int"),
        ({"method": "random_structured", "method_kwargs": {"dim": 0.0}}, r"method_kwargs dim=0.0 must be an int"),
        ({"method_kwargs": {"dim": 0}}, r"method_kwargs=\{'dim': 0\} do not fit L1Unstructured"),
        ({"method": "ln_structured", "method_kwargs": {"p": 2}}, r"method_kwargs=.*'p': 2.* do not fit LnStructured"),
        (
            {"scope": "local"},
            r"scope='local' is not supported: allowed are \('global', 'layerwise', 'row', 'erk', 'owl'\)",
        ),
        (
            {"method": "ln_structured", "scope": "global"},
            r"scope='global': .*needs an unstructured method.*ln_structured",
        ),
        ({"method": "random_structured", "scope": "global"}, r"use scope=layerwise"),
        ({"unit": "batch"}, r"unit='batch' is not supported: allowed are \('step', 'epoch'\)"),
        ({"prune_channel_bias": True}, r"prune_channel_bias=True: needs a structured method .*l1_unstructured"),
        (
            {"method": "ln_structured", "method_kwargs": {"dim": 1}, "prune_channel_bias": True},
            r"prune_channel_bias=True: needs .*dim=0.*dim=1",
        ),
        ({"parameters": [nn.Linear(2, 3).weight]}, r"parameters\[0\] is a Parameter of shape \(3, 2\), not a \(mod"),
        ({"rewind": "start"}, r"rewind='start' must be None, 'init', an int >= 0"),
        ({"rewind": -1}, r"rewind=-1 must be None"),
        ({"rewind": 1.5}, r"rewind=1.5 must be None"),
        ({"rewind": True}, r"rewind=True must be None"),
        ({"schedule": Linear(final=0.5, start=2, end=8), "rewind": 5}, r"rewind=5 is after the first pruning event at"),
        (
            {"rewind": {"net.0.weight": [1.0]}},
            r"rewind snapshot must map parameter names to tensors.*'net.0.weight': list",
        ),
        ({"mask_dtype": "bool"}, r"mask_dtype='bool' must be torch.bool, a floating torch.dtype or None"),
        ({"mask_dtype": torch.int64}, r"mask_dtype=torch.int64 must be torch.bool, a floating torch.dtype"),
        ({"make_permanent": "false"}, r"make_permanent='false' must be a bool"),
        ({"prune_channel_bias": "no"}, r"prune_channel_bias='no' must be a bool"),
        ({"summary": 1}, r"summary=1 must be a bool"),
        ({"log_per_parameter": None}, r"log_per_parameter=None must be a bool"),
        ({"reconstruct": "yes"}, r"reconstruct='yes': must be None \(the default: on for obs\) or a bool"),
        ({"method_kwargs": "abc"}, r"method_kwargs='abc' must be a dict of the method's arguments"),
        ({"activation_window": 50}, r"activation_window=50: is the window of input statistics, which only"),
        ({"regrow_every": 0}, r"regrow_every=0: is used with regrow='rigl' or 'set' only"),
        ({"regrow_fraction": 0.5}, r"regrow_fraction=0.5: is used with regrow='rigl' or 'set' only"),
        ({"log_every_n_steps": 0}, r"log_every_n_steps=0 must be None or an int >= 1"),
        ({"log_every_n_steps": 2.0}, r"log_every_n_steps=2.0 must be None or an int >= 1"),
        ({"log_every_n_steps": True}, r"log_every_n_steps=True must be"),
        ({"seed": "0"}, r"seed='0' must be an int"),
        ({"parameters": [], "include": "net.*"}, r"give either parameters=.* or include/exclude patterns, not both"),
        ({"schedule": "cubic"}, r"schedule='cubic' must be a lightprune.schedules.Schedule, a sparsity in \[0, 1\]"),
        ({"schedule": 1.5}, r"sparsity=1.5 must be in \[0, 1\]"),
    ],
)
def test_configuration_mistakes_raise_at_construction(kwargs: dict[str, Any], message: str) -> None:
    kwargs = dict(kwargs)
    schedule = kwargs.pop("schedule", 0.5)
    with pytest.raises((ValueError, TypeError), match=message) as raised:
        PruningCallback(schedule, **kwargs)
    wrong_types = {"mask_dtype": "bool", "make_permanent": "false", "prune_channel_bias": "no", "summary": 1}
    wrong_types |= {"log_per_parameter": None, "method_kwargs": "abc", "seed": "0", "schedule": "cubic"}
    wrong_type = any(wrong_types.get(key, ...) == value for key, value in {**kwargs, "schedule": schedule}.items())
    assert raised.type is (TypeError if wrong_type else ValueError)


def _a_tensor_named_total(model: Net) -> dict[str, Any]:
    """A Parameter ``total`` of the LightningModule itself: its log key was the total's, and the first event failed."""
    model.total = nn.Parameter(torch.randn(4, 4))
    return {"parameters": [(model, "total"), (model.net[0], "weight")]}


def _explicit_bias(model: Net) -> dict[str, Any]:
    return {"parameters": [(model.net[0], "bias")], "method": "ln_structured"}


@pytest.mark.parametrize(
    ("make_kwargs", "trainer_kwargs", "message"),
    [
        (lambda model: {"include": [r"encoder\..*"]}, {}, re.escape("include=" + repr([r"encoder\..*"]))),
        (
            lambda model: {"exclude": r".*", "parameter_names": ("weight",)},
            {},
            r"no parameter of the model matches the selection: include=None, exclude='\.\*'",
        ),
        (_explicit_bias, {}, r"net.0.bias has shape \(16,\): structured pruning needs >= 2 dims"),
        (_a_tensor_named_total, {}, r"the selected tensor 'total' would be logged under the key of the total"),
        (
            lambda model: {"method": "ln_structured", "method_kwargs": {"n": "bogus"}},
            {},
            r"method_kwargs=\{'n': 'bogus', 'dim': 0\} cannot rank the channels of net.0.weight \(\(16, 8\), "
            r"torch.float32\) with LnStructured: .*bogus",
        ),
        (
            lambda model: {"parameters": [(nn.Linear(2, 2), "weight")]},
            {},
            r"module Linear is not a submodule of the model",
        ),
        (
            lambda model: {"schedule": Linear(final=0.5, end=0.5)},
            {"max_epochs": -1, "max_steps": -1},
            r"gives times as fractions of the run, but the run length in optimizer steps is unknown: ",
        ),
        (  # (integer times: refused at construction, below; fractions of the run: when it starts)
            lambda model: {"schedule": Linear(initial=0.1, final=0.5, start=0.25, end=0.75), "rewind": 5},
            {},
            r"rewind=5 is after the first pruning event at step 4",
        ),
    ],
)
def test_configuration_mistakes_raise_at_setup(
    make_kwargs: Callable[[Net], dict[str, Any]], trainer_kwargs: dict[str, Any], message: str
) -> None:
    model = Net()
    kwargs = make_kwargs(model)
    callback = PruningCallback(kwargs.pop("schedule", 0.5), **kwargs)
    before = state(model)
    with pytest.raises(ValueError, match=message):
        fit(callback, model, **trainer_kwargs)
    assert_same_state(state(model), before)  # nothing was pruned
    assert pruning_hook_names(model) == set()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"include": 5}, r"include=5 must be a regular expression \(str\), a sequence of them or None"),
        ({"exclude": [5]}, r"exclude pattern 5 must be a str"),
        ({"parameter_names": 5}, r"parameter_names=5 must be None, an attribute name \(str\) or a sequence"),
    ],
)
def test_arguments_of_the_wrong_type_raise_type_errors_naming_them(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(TypeError, match=message):
        PruningCallback(0.5, **kwargs)


def test_numpy_scalars_are_numbers_too() -> None:
    np = pytest.importorskip("numpy")
    callback = PruningCallback(np.float32(0.5), max_layer_sparsity=np.float64(0.9))
    assert callback.schedule == Constant(0.5) and callback.max_layer_sparsity == 0.9


def test_patterns_that_match_no_parameter_are_warned_and_a_narrowed_selection_is_not_called_default() -> None:
    callback = PruningCallback(0.5, include=[r"net\.0\.weight", r"net\.2\.wieght"], exclude=r"4\.weight")
    with pytest.warns(
        UserWarning, match=r"include pattern 'net\\\\.2\\\\.wieght', exclude pattern '4\\\\.weight' matches no"
    ):
        quiet_trainer([callback], max_steps=1).fit(TinyNet())
    assert callback.selection == ["net.0.weight"]
    with warnings.catch_warnings(record=True) as caught:  # 35% of the weights, chosen by name: not "the default"
        warnings.simplefilter("always")
        quiet_trainer([PruningCallback(0.5, include=r"net\.0\.weight")], max_steps=1).fit(TinyNet())
    assert not [w for w in caught if "default selection" in str(w.message)]


def test_an_include_pattern_whose_tensors_the_type_filters_leave_out_is_warned() -> None:
    """The user named the LSTM's tensor; the default module types and names drop it: say so."""
    model = TinyNet()
    model.rnn = nn.LSTM(8, 4)
    callback = PruningCallback(0.5, include=[r"rnn\.weight_hh_l0", r"net\.0\.weight", r"net\.[24]\..*"])
    with pytest.warns(
        UserWarning, match=r"include pattern 'rnn\\\\.weight_hh_l0' matches \['rnn\.weight_hh_l0'\], but "
    ):
        callback.check_model(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the biases of net are left out, but the pattern's weights are selected
        callback = PruningCallback(
            0.5,
            include=[r"rnn\.weight_hh_l0", r"net\..*"],
            parameter_names=["weight", "weight_hh_l0"],
            module_types=None,
        )
        callback.check_model(model)
        PruningCallback(0.5, parameters=[(model.rnn, "weight_hh_l0")]).check_model(model)


def test_tensor_pruned_by_torch_prune_is_refused_at_setup() -> None:
    model = Net()
    torch.nn.utils.prune.l1_unstructured(model.net[2], "weight", amount=0.5)
    with pytest.raises(ValueError, match=r"'weight' of Linear is pruned by torch.nn.utils.prune; make that pruning"):
        fit(PruningCallback(0.5), model)


def test_last_event_after_the_end_of_training_warns() -> None:
    with pytest.warns(UserWarning, match=r"last event is at step 40, after the end of training at step 16"):
        fit(PruningCallback(Linear(final=0.5, end=40, frequency=8)))


# ----------------------------------------------------------------------------------------------------------------------
# 14. Mask dtype
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mask_dtype", "model_dtype"), [(torch.bool, torch.float64), (None, torch.float64), (None, torch.float32)]
)
def test_mask_dtype(mask_dtype: torch.dtype | None, model_dtype: torch.dtype) -> None:
    callback = PruningCallback(RAMP, mask_dtype=mask_dtype, make_permanent=False)
    model = Net().to(model_dtype)
    fit(callback, model, precision="64-true" if model_dtype == torch.float64 else "32-true")
    expected = model_dtype if mask_dtype is None else mask_dtype
    assert {mask.dtype for mask in masks(model).values()} == {expected}
    assert sum(zeros(mask) for mask in masks(model).values()) == round(TARGET * N)


@pytest.mark.parametrize("scope", ["global", "layerwise"])
def test_events_pass_the_mask_dtype_and_leave_the_users_setting_alone(scope: str) -> None:
    """The callback's mask_dtype reaches the masks as an argument: the process-wide prune.mask_dtype setting a
    method sees during an event is still the user's."""
    seen: list[torch.dtype | None] = []

    class Spy(prune.L1Unstructured):
        def compute_mask(self, t: Tensor, default_mask: Tensor) -> Tensor:
            seen.append(prune.get_mask_dtype())
            return super().compute_mask(t, default_mask)

    callback = PruningCallback(RAMP, scope=scope, method=Spy, make_permanent=False)
    with prune.mask_dtype(torch.float64):
        model, _ = fit(callback)
        assert prune.get_mask_dtype() == torch.float64
    assert seen and set(seen) == {torch.float64}
    assert {mask.dtype for mask in masks(model).values()} == {torch.bool}
    assert sum(zeros(mask) for mask in masks(model).values()) == round(TARGET * N)


def test_defaults_bool_masks_weights_only_no_rewind() -> None:
    callback = PruningCallback(0.5)
    assert callback.mask_dtype == torch.bool
    assert callback.rewind is None  # lottery-ticket rewinding is opt-in (lightning's ModelPruning: on by default)
    assert (callback.scope, callback.unit, callback.make_permanent) == ("global", "step", True)
    assert callback.parameter_names == ("weight",)


def test_layers_under_the_older_weight_norm_are_named_with_the_tensor_to_select() -> None:
    """``torch.nn.utils.weight_norm`` keeps a Linear's weight as ``weight_g``/``weight_v`` and computes ``weight`` in
    a forward pre-hook. The default selection left such a layer out while the coverage warning advised passing
    module_types for Linear, already selected; with a model of such layers only, the refusal said nothing of why."""
    model = TinyNet()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # (torch deprecates the older weight_norm)
        model.net[0] = nn.utils.weight_norm(model.net[0])
    message = r"\['net\.0\.weight'\] are computed from other parameters .*parameter_names=\['weight_v'\]"
    with pytest.warns(UserWarning, match=message):
        PruningCallback(0.5).check_model(model)
    with pytest.warns(UserWarning, match=message), pytest.raises(ValueError):
        PruningCallback(0.5, include=r"net\.0\..*").check_model(model)
    callback = PruningCallback(0.5, parameter_names=["weight", "weight_v"])
    pruned, _ = fit(callback, model, max_epochs=1)
    selected = [pruned.net[0].weight_v, pruned.net[2].weight, pruned.net[4].weight]
    assert sum(zeros(tensor) for tensor in selected) == N // 2 and zeros(pruned.net[0].weight_v) > 0
    pruned(torch.randn(1, 8))  # (the pre-hook computes weight from weight_v)
    assert torch.equal(pruned.net[0].weight == 0, pruned.net[0].weight_v == 0)


def test_the_coverage_warning_names_the_tensors_left_out() -> None:
    """A model whose largest weights are a selected type's other tensors: the advice names them."""
    model = TinyNet()
    model.net[0].register_parameter("table", nn.Parameter(torch.zeros(64, 64)))
    with pytest.warns(UserWarning, match=r"the largest unselected are torch\.nn\.modules\.linear\.Linear's table \("):
        fit(PruningCallback(0.5), model, max_epochs=1)
