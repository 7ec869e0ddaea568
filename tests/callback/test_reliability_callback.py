"""Faults during a pruning fit (issue #6): no mask is lost, no checkpoint or model holds a half-applied event, and a
run restarted from its last checkpoint ends exactly where a run that never failed ends.

Every fit trains ``Net`` (Linear 8-16-12-4: 368 prunable weights) on 64 fixed samples in 8 batches of 8, 4 epochs
(32 optimizer steps), pruning on a cubic schedule with an event every 2 steps from step 2 to step 28 (14 events),
and saves a checkpoint at the end of every epoch (steps 8, 16, 24, 32: the default DataLoader cannot resume
mid-epoch). One torch thread, so that two fits of the same configuration are bit-identical, in this process or in
another one.

Faults injected:

(a) an exception inside ``compute_mask`` at the Nth call (a ``BasePruningMethod`` subclass given as the callback's
    method), in the middle of an event (layerwise: after the event's first tensor was pruned);
(b) a ``KeyboardInterrupt`` in mid-epoch (from a callback's ``on_train_batch_end``, and from inside ``compute_mask``,
    i.e. in the middle of an event): Lightning shuts down gracefully and exits (``SystemExit(1)``);
(c) the training process killed with SIGKILL right after a checkpoint was written, and while one was being saved
    (this file run as a script in a subprocess).

This file is also the script of (c): ``python tests/callback/test_reliability_callback.py ROOT MODE STEP``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import Tensor

from lightprune import prune
from lightprune.callback import PruningCallback
from lightprune.schedules import Cubic
from tiny_lightning import STEPS_PER_EPOCH, WEIGHTS, N, folded, pruning_state, quiet_trainer, state
from tiny_lightning import TinyNet as Net

pytestmark = [
    pytest.mark.usefixtures("one_thread_for_module"),
    pytest.mark.filterwarnings("ignore:.*checkpoint directory.*"),
]

EPOCHS = 4
SCHEDULE = dict(final=0.7, start=2, end=28, frequency=2)  # events at steps 2, 4, ..., 28


def schedule() -> Cubic:
    return Cubic(**SCHEDULE)


# ----------------------------------------------------------------------------------------------------------------------
# Model, data, method, fits
# ----------------------------------------------------------------------------------------------------------------------


class Flaky(prune.L1Unstructured):
    """L1 pruning through ``compute_mask`` (the path of any user's method) that raises at its ``fail_at``-th call.

    One class for the failing and the non-failing runs: the callback's checkpoint state is keyed by the method's
    name, so a restart with the non-failing configuration restores the failed run's state.
    """

    calls = 0
    fail_at: int | None = None
    error: type[BaseException] = RuntimeError

    def compute_mask(self, t: Tensor, default_mask: Tensor) -> Tensor:
        Flaky.calls += 1
        if Flaky.calls == Flaky.fail_at:
            raise Flaky.error(f"injected failure at compute_mask call {Flaky.calls}")
        return super().compute_mask(t, default_mask)

    @staticmethod
    def configure(fail_at: int | None = None, error: type[BaseException] = RuntimeError) -> None:
        Flaky.calls, Flaky.fail_at, Flaky.error = 0, fail_at, error


class CallsPerStep(Callback):
    """Records ``Flaky.calls`` after every training batch (after the pruning callback's event of that step)."""

    def __init__(self) -> None:
        self.after_step: dict[int, int] = {}

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.after_step[trainer.global_step] = Flaky.calls


class SaveOnException(Callback):
    """Writes a checkpoint when the fit fails (like Lightning's OnExceptionCheckpoint, which deletes it at teardown)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        trainer.save_checkpoint(self.path)


class InterruptAt(Callback):
    """Raises ``KeyboardInterrupt`` at the end of training step ``step`` (as Ctrl+C there would)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            raise KeyboardInterrupt


class KillAt(ModelCheckpoint):
    """SIGKILLs the process right after the checkpoint of step ``step`` is written (``after``), or while it is being
    assembled, before anything reaches the disk (``before``)."""

    def __init__(self, step: int, when: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.kill_step, self.when = step, when

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        if self.when == "before" and trainer.global_step == self.kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        super().on_save_checkpoint(trainer, pl_module, checkpoint)

    def _save_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        super()._save_checkpoint(trainer, filepath)
        if self.when == "after" and trainer.global_step == self.kill_step:
            os.kill(os.getpid(), signal.SIGKILL)


def checkpoints(root: Path, **kwargs: Any) -> ModelCheckpoint:
    return ModelCheckpoint(root / "ckpt", every_n_epochs=1, save_top_k=-1, **kwargs)


def pruning(scope: str, method: Any = Flaky) -> PruningCallback:
    return PruningCallback(schedule(), method=method, scope=scope, make_permanent=False, seed=3)


def make_trainer(root: Path, callbacks: list[Callback]) -> L.Trainer:
    """A quiet CPU Trainer for :data:`EPOCHS` epochs whose checkpoints come from the ``ModelCheckpoint`` given."""
    return quiet_trainer(callbacks, max_epochs=EPOCHS, enable_checkpointing=True, default_root_dir=root)


def fit(
    root: Path,
    callbacks: list[Callback],
    *,
    ckpt_path: Path | None = None,
    checkpoint_callback: ModelCheckpoint | None = None,
) -> tuple[Net, L.Trainer]:
    model = Net()
    run = make_trainer(root, [*callbacks, checkpoint_callback or checkpoints(root)])
    run.fit(model, ckpt_path=ckpt_path)
    return model, run


def assert_same_state(actual: dict[str, Tensor], expected: dict[str, Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for key, value in expected.items():
        assert actual[key].dtype == value.dtype, key
        assert torch.equal(actual[key], value), key


def assert_same_resumed(actual: dict[str, Tensor], expected: dict[str, Tensor]) -> None:
    """Same effective weights, masks and keys; ``name_orig`` may differ where the mask prunes (checkpoints hold the
    effective values, and a pruned entry of ``name_orig`` never reaches the model)."""
    assert sorted(actual) == sorted(expected)
    assert_same_state(folded(actual), folded(expected))
    assert_same_state(
        {k: v for k, v in actual.items() if k.endswith("_mask")},
        {k: v for k, v in expected.items() if k.endswith("_mask")},
    )


def checkpoint_masks(checkpoint: dict[str, Any], where: str) -> dict[str, Tensor]:
    """The masks a checkpoint holds in the callback's state, as ``name_mask`` keys, after checking that its plain
    weights hold their zeros."""
    saved = pruning_state(checkpoint)
    for name, mask in saved["masks"].items():
        assert not bool(checkpoint["state_dict"][name][~mask].any()), f"{where}: {name} not masked"
    return {name + "_mask": mask for name, mask in saved["masks"].items()}


def reference(root: Path, scope: str) -> tuple[dict[str, Tensor], dict[int, int]]:
    """The uninterrupted run: its final state and ``Flaky.calls`` after each step."""
    Flaky.configure()
    calls = CallsPerStep()
    model, _ = fit(root, [pruning(scope), calls])
    return state(model), calls.after_step


# ----------------------------------------------------------------------------------------------------------------------
# What a complete event leaves: every tensor's mask count is the target of the last event the callback recorded
# ----------------------------------------------------------------------------------------------------------------------


def pruned_counts(state_dict: dict[str, Tensor]) -> dict[str, int]:
    return {
        name: int((state_dict[name + "_mask"] == 0).sum()) if name + "_mask" in state_dict else 0 for name in WEIGHTS
    }


def assert_complete_event(state_dict: dict[str, Tensor], last_event: int, scope: str, where: str) -> None:
    """The masks are exactly those of the event at step ``last_event`` (-1: none yet)."""
    target = 0.0 if last_event < 0 else schedule().target(last_event)
    counts = pruned_counts(state_dict)
    if scope == "global":
        assert sum(counts.values()) == round(target * N), f"{where}: {counts} after the event at {last_event}"
    else:
        expected = {name: round(target * rows * cols) for name, (rows, cols) in WEIGHTS.items()}
        assert counts == expected, f"{where}: half-applied event? {counts} != {expected} (event {last_event})"


def assert_checkpoints_hold_complete_events(root: Path, scope: str) -> list[Path]:
    """Every checkpoint on disk loads weights-only and holds the masks of a completed event; returns them by step."""
    paths = sorted((root / "ckpt").glob("*.ckpt"), key=lambda p: int(p.stem.split("step=")[1]))
    for path in paths:
        checkpoint = torch.load(path, weights_only=True)
        # the weights are plain and hold the zeros of the masks, which travel in the callback's state
        masks = checkpoint_masks(checkpoint, path.name)
        assert_complete_event(masks, pruning_state(checkpoint)["last_event"], scope, path.name)
    return paths


def ckpt_at(root: Path, step: int) -> Path:
    return root / "ckpt" / f"epoch={step // STEPS_PER_EPOCH - 1}-step={step}.ckpt"


def resume(root: Path, ckpt: Path, scope: str) -> dict[str, Tensor]:
    Flaky.configure()  # the same method, no longer failing
    model, trainer = fit(root, [pruning(scope)], ckpt_path=ckpt)
    assert trainer.global_step == EPOCHS * STEPS_PER_EPOCH
    return state(model)


@pytest.fixture
def restore_sigint() -> Iterator[None]:
    """Lightning ignores SIGINT from a KeyboardInterrupt on (to shut down in peace); put the handler back."""
    handler = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, handler)


# ----------------------------------------------------------------------------------------------------------------------
# A structured dim that the selected tensors lack fails at setup, not at the first event in mid-training
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dim", [2, -3])
def test_structured_dim_out_of_range_fails_at_setup(tmp_path: Path, dim: int) -> None:
    callback = PruningCallback(schedule(), method="ln_structured", method_kwargs={"dim": dim})
    model = Net()
    before = state(model)
    trainer = L.Trainer(
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
        callbacks=[callback],
    )
    with pytest.raises(ValueError, match=rf"dim={dim} is out of range for net\.0\.weight of shape \(16, 8\)"):
        trainer.fit(model)
    assert trainer.global_step == 0
    assert_same_state(state(model), before)


# ----------------------------------------------------------------------------------------------------------------------
# (a) an exception inside compute_mask in the middle of an event
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("scope", ["layerwise", "global"])
def test_exception_in_compute_mask_mid_event(tmp_path: Path, scope: str) -> None:
    expected, calls = reference(tmp_path / "reference", scope)
    # fail at the 2nd compute_mask call of the event at step 20 (layerwise: after the event pruned one tensor)
    assert calls[20] - calls[19] >= (2 if scope == "layerwise" else 1)
    fail_at = calls[19] + (2 if scope == "layerwise" else 1)

    root = tmp_path / "failing"
    Flaky.configure(fail_at=fail_at)
    model = Net()
    callback = pruning(scope)
    run = make_trainer(root, [callback, SaveOnException(root / "on_exception.ckpt"), checkpoints(root)])
    with pytest.raises(RuntimeError, match=f"injected failure at compute_mask call {fail_at}"):
        run.fit(model)
    assert run.global_step == 20 and Flaky.calls == fail_at

    # the model in memory holds the last completed event (step 18), never part of the failed one
    assert callback._timeline.last_event == 18
    assert_complete_event(state(model), 18, scope, "the model after the failure")
    # so does every checkpoint: those of epochs 1 and 2 and the one written on the exception
    paths = assert_checkpoints_hold_complete_events(root, scope)
    assert [p.name for p in paths] == ["epoch=0-step=8.ckpt", "epoch=1-step=16.ckpt"]
    on_exception = torch.load(root / "on_exception.ckpt", weights_only=True)
    assert pruning_state(on_exception)["last_event"] == 18
    where = "the checkpoint written on the exception"
    assert_complete_event(checkpoint_masks(on_exception, where), 18, scope, where)

    # restarting from the last checkpoint with the method no longer failing ends as if nothing had happened
    assert_same_resumed(resume(root, paths[-1], scope), expected)


# ----------------------------------------------------------------------------------------------------------------------
# (b) KeyboardInterrupt in mid-epoch, between events and in the middle of one
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("where", ["between events (step 21)", "inside compute_mask (event at step 22)"])
def test_keyboard_interrupt_mid_epoch_then_resume(tmp_path: Path, where: str, restore_sigint: None) -> None:
    scope = "layerwise"
    expected, calls = reference(tmp_path / "reference", scope)
    root = tmp_path / "interrupted"
    if where.startswith("between"):
        Flaky.configure()
        extra: list[Callback] = [InterruptAt(21)]
        stopped_at, last_event = 21, 20
    else:
        Flaky.configure(fail_at=calls[21] + 2, error=KeyboardInterrupt)
        extra, stopped_at, last_event = [], 22, 20
    callback = pruning(scope)
    model = Net()
    run = make_trainer(root, [callback, *extra, checkpoints(root)])
    # Lightning catches the KeyboardInterrupt, runs the on_exception hooks, tears down, and exits with status 1
    with pytest.raises(SystemExit) as info:
        run.fit(model)
    assert info.value.code == 1
    assert run.interrupted and run.global_step == stopped_at
    assert callback._timeline.last_event == last_event
    assert_complete_event(state(model), last_event, scope, "the model after the interrupt")
    paths = assert_checkpoints_hold_complete_events(root, scope)
    assert paths[-1] == ckpt_at(root, 16)
    assert_same_resumed(resume(root, paths[-1], scope), expected)


# ----------------------------------------------------------------------------------------------------------------------
# (c) the process killed right after a checkpoint was written, or while one was being saved
# ----------------------------------------------------------------------------------------------------------------------


def run_killed(root: Path, when: str, step: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, __file__, str(root), when, str(step)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


@pytest.mark.slow
@pytest.mark.parametrize(("when", "step", "resume_step"), [("after", 16, 16), ("before", 24, 16)])
def test_process_killed_at_a_checkpoint_then_resume(tmp_path: Path, when: str, step: int, resume_step: int) -> None:
    scope = "global"
    expected, _ = reference(tmp_path / "reference", scope)
    root = tmp_path / "killed"
    done = run_killed(root, when, step)
    assert done.returncode == -signal.SIGKILL, done.stdout + done.stderr
    paths = assert_checkpoints_hold_complete_events(root, scope)
    assert paths[-1] == ckpt_at(root, resume_step)  # nothing half-written of the checkpoint being saved
    assert not [p for p in (root / "ckpt").iterdir() if p.suffix != ".ckpt"], "temporary files left behind"
    assert_same_resumed(resume(root, paths[-1], scope), expected)


def _killed_run(root: Path, when: str, step: int) -> None:
    """The script of (c): a global-scope fit that SIGKILLs itself at the checkpoint of ``step``."""
    torch.set_num_threads(1)
    Flaky.configure()
    fit(root, [pruning("global")], checkpoint_callback=KillAt(step, when, dirpath=root / "ckpt", every_n_epochs=1,
                                                              save_top_k=-1))  # fmt: skip
    raise SystemExit("the process was not killed")


if __name__ == "__main__":
    _killed_run(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
