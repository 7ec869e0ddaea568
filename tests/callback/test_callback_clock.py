"""The run clock under manual optimization: a fraction of the run is a fraction of the batches trained on.

Lightning's ``global_step`` counts every ``optimizer.step()`` call under manual optimization, so a loop stepping two
optimizers a batch (a GAN) or one that steps every other batch (gradient accumulation by hand) would otherwise run a
fractional schedule twice as fast or half as fast. Each loop here trains 5 epochs of 8 batches (40 batches) with
``Cubic(final=0.8, start=0, end=0.5)``; the pruned count after every batch must be the one a plain automatic loop
with one step a batch reaches, and 80% must be the target from batch 20 on (70% at batch 10).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import lightning as L
import pytest
import torch
from torch import Tensor, nn

from lightprune.callback import PruningCallback
from lightprune.schedules import Cubic, Linear
from tiny_lightning import WEIGHTS, N, TinyNet, loader, quiet_trainer

pytestmark = [pytest.mark.usefixtures("one_thread_for_module")]

BATCHES = 40  # 5 epochs of tiny_lightning.loader's 8 batches
SCHEDULE = Cubic(final=0.8, start=0, end=0.5)


class TwoOptimizers(TinyNet):
    """GAN-style manual optimization: two optimizers (first layer / the rest), both stepped every batch."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        first, rest = self.optimizers()
        x, y = batch
        for optimizer in (first, rest):
            optimizer.zero_grad()
            self.manual_backward(nn.functional.cross_entropy(self(x), y))
            optimizer.step()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        rest = [p for name, p in self.named_parameters() if not name.startswith("net.0.")]
        return [torch.optim.SGD(self.net[0].parameters(), lr=0.1), torch.optim.SGD(rest, lr=0.1)]


class EveryOtherBatch(TinyNet):
    """Gradient accumulation by hand: gradients of two batches, one ``optimizer.step()`` on every odd batch."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        x, y = batch
        self.manual_backward(nn.functional.cross_entropy(self(x), y) / 2)
        if batch_idx % 2 == 1:
            optimizer.step()
            optimizer.zero_grad()


class Counts(L.Callback):
    """After every batch (placed after the PruningCallback): how many weights the masks prune, and global_step."""

    def __init__(self) -> None:
        self.pruned: list[int] = []
        self.steps: list[int] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        masks = [m for name, m in pl_module.named_buffers() if name.endswith("weight_mask")]
        self.pruned.append(sum(int((~mask.bool()).sum()) for mask in masks))
        self.steps.append(trainer.global_step)


def _fit(model: L.LightningModule, **trainer_options: Any) -> Counts:
    counts = Counts()
    callback = PruningCallback(SCHEDULE, make_permanent=False, summary=False)
    quiet_trainer([callback, counts], max_epochs=5, **trainer_options).fit(model)
    return counts


@pytest.fixture(scope="module")
def plain() -> Counts:
    """The reference: automatic optimization, one optimizer step a batch (the step clock counts batches there)."""
    return _fit(TinyNet())


def test_the_reference_reaches_the_final_target_halfway(plain: Counts) -> None:
    resolved = SCHEDULE.resolve(BATCHES)
    assert plain.steps == list(range(1, BATCHES + 1))
    assert plain.pruned == [round(resolved.target(batch) * N) for batch in range(1, BATCHES + 1)]
    assert resolved.last_event == 20  # the final 80% is the target from batch 20 on...
    assert plain.pruned[9] == round(0.8 * (1 - (1 - 10 / 20) ** 3) * N)  # ...and at batch 10 it is Cubic's 70%


@pytest.mark.parametrize("module", [TwoOptimizers, EveryOtherBatch], ids=["two optimizers", "every other batch"])
def test_manual_optimization_follows_the_batches(module: type[L.LightningModule], plain: Counts) -> None:
    counts = _fit(module())
    steps_per_batch = 2 if module is TwoOptimizers else 0.5
    assert counts.steps[-1] == BATCHES * steps_per_batch  # global_step is not the batch count here...
    assert counts.pruned == plain.pruned  # ...but the schedule runs on the batches all the same


def test_integer_times_count_batches_under_manual_optimization() -> None:
    counts = Counts()
    callback = PruningCallback(Cubic(final=0.5, start=4, end=12, frequency=4), make_permanent=False, summary=False)
    quiet_trainer([callback, counts], max_epochs=2).fit(TwoOptimizers())
    changes = [batch + 1 for batch in range(1, 16) if counts.pruned[batch] != counts.pruned[batch - 1]]
    assert changes == [8, 12]  # events at batches 4 (level 0), 8 and 12; global_step was 8, 16 and 24 there
    assert counts.pruned[-1] == round(0.5 * N)


def test_fractions_under_manual_optimization_refuse_max_steps() -> None:
    callback = PruningCallback(SCHEDULE, summary=False)
    trainer = quiet_trainer([callback], max_epochs=5, max_steps=30)
    with pytest.raises(ValueError, match=r"run length in training batches is unknown: .*max_steps counts optimizer"):
        trainer.fit(TwoOptimizers())


def test_regrowth_under_manual_optimization_with_max_steps_says_what_sets_its_length() -> None:
    callback = PruningCallback(0.5, regrow="set", summary=False)
    trainer = quiet_trainer([callback], max_epochs=-1, max_steps=30)
    with pytest.raises(ValueError, match=r"regrow_until=0\.75 .* batches is unknown.*bound the run by max_epochs"):
        trainer.fit(TwoOptimizers())


@pytest.mark.parametrize("max_steps", [BATCHES, 1000])
def test_fractions_under_manual_optimization_refuse_any_max_steps(max_steps: int) -> None:
    """max_steps counts optimizer.step() calls, any number of which a batch may make: at max_steps=BATCHES two
    optimizers stop the run after half the batches, while the schedule had been spread over all of them."""
    trainer = quiet_trainer([PruningCallback(SCHEDULE, summary=False)], max_epochs=5, max_steps=max_steps)
    with pytest.raises(ValueError, match=r"run length in training batches is unknown: .*max_steps counts optimizer"):
        trainer.fit(TwoOptimizers())


def test_integer_times_under_manual_optimization_take_max_steps() -> None:
    counts = Counts()
    callback = PruningCallback(Cubic(final=0.5, start=4, end=12, frequency=4), make_permanent=False, summary=False)
    quiet_trainer([callback, counts], max_epochs=5, max_steps=24).fit(TwoOptimizers())
    assert len(counts.pruned) == 12 and counts.pruned[-1] == round(0.5 * N)  # 24 steps: 12 batches of two


class MaskChanges(L.Callback):
    """After every batch (placed after the PruningCallback): the batches (1-based) at which some mask changed."""

    def __init__(self) -> None:
        self.previous: list[torch.Tensor] | None = None
        self.batches: list[int] = []
        self.seen = 0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.seen += 1
        masks = [m.clone() for name, m in pl_module.named_buffers() if name.endswith("weight_mask")]
        if self.previous is not None and any(not torch.equal(a, b) for a, b in zip(masks, self.previous, strict=True)):
            self.batches.append(self.seen)
        self.previous = masks


@pytest.mark.parametrize("regrow", ["rigl", "set"])
def test_regrowth_runs_on_the_batches_under_manual_optimization(regrow: str) -> None:
    """RigL and SET move masks every ``regrow_every`` units of the run clock until ``regrow_until`` of the run: the
    same training batches for a GAN-style loop and for one stepping every other batch as for one step a batch."""
    moved = {}
    for module in (TinyNet, TwoOptimizers, EveryOtherBatch):
        changes = MaskChanges()
        callback = PruningCallback(
            0.5, regrow=regrow, regrow_every=4, regrow_until=0.5, make_permanent=False, summary=False
        )  # one-shot at the first batch, then masks move at batches 4, 8, ... before batch 20
        quiet_trainer([callback, changes], max_epochs=5).fit(module())
        moved[module.__name__] = changes.batches
    assert moved["TinyNet"] == [4, 8, 12, 16]
    assert moved["TwoOptimizers"] == moved["TinyNet"]
    assert moved["EveryOtherBatch"] == moved["TinyNet"]


def test_fractions_beside_a_gradient_accumulation_scheduler_count_its_steps() -> None:
    """Lightning's step estimate ignores the scheduler's factors: 8 + 2 + 2 optimizer steps here, not 24."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    model = TinyNet()
    zeros: dict[int, int] = {}  # optimizer steps taken -> zero weights after that batch

    class Zeros(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            layers = [layer for layer in model.net if isinstance(layer, nn.Linear)]
            zeros[trainer.global_step] = sum(int((layer.weight == 0).sum()) for layer in layers)

    callback = PruningCallback(Cubic(final=0.8, start=0, end=1.0, frequency=0.25))
    callbacks = [callback, GradientAccumulationScheduler({1: 4}), Zeros()]
    quiet_trainer(callbacks, max_epochs=3).fit(model, loader())
    assert max(zeros) == 12
    changes = [step for step in sorted(zeros) if step and zeros[step] != zeros.get(step - 1, 0)]
    assert changes == [3, 6, 9, 11]  # a quarter of the run's 12 steps apart, the last at its last tick (1.0)
    assert zeros[12] == round(0.8 * N)


class Steps(L.pytorch.loggers.Logger):
    """A logger recording the step of every metric it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: dict[str, list[int]] = {}

    @property
    def name(self) -> str:
        return "steps"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        for key in metrics:
            self.steps.setdefault(key, []).append(int(step if step is not None else -1))


@pytest.mark.parametrize("module", [TinyNet, TwoOptimizers, EveryOtherBatch], ids=["one", "two", "every other"])
def test_sparsities_are_logged_on_the_runs_clock_as_the_regrowth(module: type[L.LightningModule]) -> None:
    """The callback logs on one axis: the run clock (training batches under manual optimization), the axis of its
    events and of the regrowth logs, whatever global_step counts."""
    logger = Steps()
    callback = PruningCallback(0.5, regrow="set", regrow_every=4, regrow_until=0.5, log_every_n_steps=5, summary=False)
    quiet_trainer([callback], max_epochs=2, logger=logger).fit(module())
    sparsity, regrown = logger.steps["pruning/sparsity/total"], logger.steps["pruning/regrown/fraction"]
    assert regrown == [4]  # batch 4 (the update at batch 8 is past regrow_until: half of 16 batches)
    assert sparsity == [0, 5, 10, 15]  # the one-shot event at batch 0, then every 5 batches


class Endless(torch.utils.data.IterableDataset):
    """A stream without a length: the epochs' steps are unknown until it ends."""

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        generator = torch.Generator().manual_seed(0)
        for _ in range(16):
            yield torch.randn(8, generator=generator), torch.randint(0, 4, (), generator=generator)


def test_fractions_over_a_loader_without_length_ask_for_max_steps_even_with_max_epochs() -> None:
    """Before, the message said 'set max_steps or max_epochs' to a fit that had set max_epochs."""
    trainer = quiet_trainer([PruningCallback(0.5, regrow="set", summary=False)], max_epochs=1)
    with pytest.raises(ValueError, match=r"the training loader has no length, so max_epochs does not give the number"):
        trainer.fit(TinyNet(), torch.utils.data.DataLoader(Endless(), batch_size=4))


def test_epoch_events_and_periodic_logs_give_one_value_a_step() -> None:
    """With ``unit="epoch"`` the periodic log at an epoch's last batch and the event when the next epoch starts fall
    on the same step: the logger got two values for one step (the old sparsity, then the new). Only the event's,
    the sparsity the next batch trains with, is logged there now; the other periodic logs stay."""
    logger = Values()
    callback = PruningCallback(Linear(final=0.5, start=0, end=3, frequency=1), unit="epoch", log_every_n_steps=4,
                               summary=False)  # fmt: skip
    quiet_trainer([callback], max_epochs=4, logger=logger).fit(TinyNet())  # 8 steps an epoch
    logged = logger.values["pruning/sparsity/total"]
    steps = [step for step, _ in logged]
    assert steps == sorted(set(steps)) == [0, 4, 8, 12, 16, 20, 24, 28, 32]
    at = dict(logged)
    assert at[8] == at[12] > at[4] == at[0] == 0.0 and at[24] == at[32] == pytest.approx(0.5, abs=1 / N)


class Values(Steps):
    """A logger recording ``(step, value)`` of every metric it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.values: dict[str, list[tuple[int, float]]] = {}

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        for key, value in metrics.items():
            self.values.setdefault(key, []).append((int(step if step is not None else -1), float(value)))


@pytest.mark.parametrize(("end", "warns"), [(3, True), (2, False), (1.0, False)], ids=["max_epochs", "before", "1.0"])
def test_an_epoch_schedule_ending_at_max_epochs_says_its_last_event_follows_all_training(
    end: int | float, warns: bool
) -> None:
    """Epoch ``e``'s event runs when epoch ``e`` starts: one at ``max_epochs`` runs when fit ends, after the last
    validation and checkpoint, and the model is never trained after it. The callback says so when training starts."""
    callback = PruningCallback(Linear(final=0.5, start=0, end=end, frequency=1), unit="epoch", summary=False)
    trainer = quiet_trainer([callback], max_epochs=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TinyNet())
    said = [str(w.message) for w in caught if "where the run ends (max_epochs" in str(w.message)]
    assert len(said) == warns, said
    if warns:
        assert "End the schedule at epoch 2 or before" in said[0]


class RawOptimizer(TinyNet):
    """Manual optimization stepping the optimizer itself, not Lightning's wrapper (or through it)."""

    def __init__(self, wrapped: bool) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.wrapped = wrapped

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers(use_pl_optimizer=self.wrapped)
        x, y = batch
        optimizer.zero_grad()
        self.manual_backward(nn.functional.cross_entropy(self(x), y))
        optimizer.step()


@pytest.mark.parametrize("wrapped", [True, False], ids=["Lightning's optimizer", "the raw optimizer"])
def test_movement_refuses_optimizer_steps_lightning_does_not_announce(wrapped: bool) -> None:
    """Movement adds -W*grad in on_before_optimizer_step, which a raw optimizer's step skips: its scores stayed zero
    and the event pruned the first half of every tensor in index order, silently."""
    schedule = Linear(final=0.5, start=4, end=8, frequency=4)
    callback = PruningCallback(schedule, importance="movement", scope="layerwise", summary=False)
    model = RawOptimizer(wrapped)
    trainer = quiet_trainer([callback], max_epochs=1)
    if not wrapped:
        with pytest.raises(RuntimeError, match=r"importance='movement' .* this step of SGD skipped"):
            trainer.fit(model)
        return
    trainer.fit(model)
    kept = (model.net[0].weight != 0).flatten()
    assert int((~kept).sum()) == 64 and not bool((~kept[:64]).all())  # half pruned, ranked, not in index order


class LongerEveryEpoch(TinyNet):
    """A loader reloaded every epoch, of 8 batches and then 24."""

    def train_dataloader(self) -> Any:
        return loader(64 if self.trainer.current_epoch == 0 else 192)


@pytest.mark.parametrize("unit", ["step", "epoch"])
def test_fractions_fixed_before_the_loader_changes_length_are_said(unit: str) -> None:
    """Fractions of the run are fixed when training starts (8 batches an epoch: 16 steps); a reloaded loader of 24
    batches makes the run 32 steps, and the ramp ended at step 8 of 32 without a word. The epoch clock's length
    does not change: nothing to say there."""
    schedule = Cubic(final=0.8, start=0.0, end=0.5, frequency=2 if unit == "step" else 1)
    trainer = quiet_trainer([PruningCallback(schedule, unit=unit, summary=False)], max_epochs=2)
    trainer.reload_dataloaders_every_n_epochs = 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(LongerEveryEpoch())
    said = [str(w.message) for w in caught if "stay fixed to" in str(w.message)]
    if unit == "epoch":
        assert said == []
    else:
        assert len(said) == 1 and "the loader of epoch 1 has 24 batches, the one the run's length was read" in said[0]
        assert "started 8: the schedule's fractions of the run (and regrow_until) stay fixed to 16 optimizer" in said[0]


def test_a_run_bounded_by_max_steps_keeps_its_length_when_the_loader_changes() -> None:
    """max_steps bounds the run: a reloaded loader of another length changes nothing of its length, nothing to say."""
    schedule = Cubic(final=0.8, start=0.0, end=0.5, frequency=2)
    trainer = quiet_trainer([PruningCallback(schedule, summary=False)], max_epochs=2, max_steps=12)
    trainer.reload_dataloaders_every_n_epochs = 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(LongerEveryEpoch())
    assert not [w for w in caught if "stay fixed to" in str(w.message)]
    assert trainer.global_step == 12


def _zeros(model: nn.Module) -> float:
    """The share of the selected weights that are zero (the model returned: the reparametrization removed)."""
    weights = [model.get_parameter(name) for name in WEIGHTS]
    return sum(int((w == 0).sum()) for w in weights) / N


def test_an_epoch_the_stream_did_not_finish_takes_no_event_at_fit_end() -> None:
    """A loader without length cut by max_steps inside epoch 2: the event of epoch 3, which never started, ran when
    fit ended (0.8 returned where the last batch trained at 0.53), silently; with a sized loader it did not."""
    schedule = Linear(final=0.8, start=0, end=3, frequency=1)
    model = TinyNet()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_trainer([PruningCallback(schedule, unit="epoch", summary=False)], max_epochs=10, max_steps=10).fit(
            model, torch.utils.data.DataLoader(Endless(), batch_size=4)
        )  # 4 batches an epoch: epochs 0 and 1 complete, epoch 2 cut after 2 batches
    assert _zeros(model) == pytest.approx(schedule.target(2), abs=1 / N)
    assert any("before the schedule's last event at epoch 3" in str(w.message) for w in caught)


@pytest.mark.parametrize(("accumulate", "max_steps"), [(1, 28), (3, 10)])
def test_epoch_fractions_follow_the_epochs_max_steps_completes(accumulate: int, max_steps: int) -> None:
    """max_epochs=10 with max_steps ending the run inside epoch 3: fractions of the run were resolved against 10
    epochs, so a ramp over the whole run stopped at 0.24 of its target, said only when fit ended. They now resolve
    against the 3 epochs completed; the last event (epoch 3) runs when that epoch starts, and the model trains
    after it."""
    model = TinyNet()
    callback = PruningCallback(Linear(final=0.8, start=0.0, end=1.0), unit="epoch", summary=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_trainer([callback], max_epochs=10, max_steps=max_steps, accumulate_grad_batches=accumulate).fit(model)
    assert _zeros(model) == pytest.approx(0.8, abs=1 / N)
    said = [str(w.message) for w in caught]
    assert not [m for m in said if "will not be reached" in m or "where the run ends" in m], said


def test_epoch_fractions_over_a_stream_cut_by_max_steps_say_what_bounds_the_epochs() -> None:
    """The hint said 'set max_steps or max_epochs' to a fit that had set max_steps."""
    callback = PruningCallback(Linear(final=0.5, start=0.0, end=0.5), unit="epoch", summary=False)
    trainer = quiet_trainer([callback], max_steps=10)
    with pytest.raises(ValueError, match=r"no length, so max_steps does not give the number of epochs: bound the run"):
        trainer.fit(TinyNet(), torch.utils.data.DataLoader(Endless(), batch_size=4))


class FailAt(L.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError("stopped by the test")


def test_a_fit_that_raises_says_how_far_the_schedule_got() -> None:
    """The docs promise the warning with the sparsity reached for an interruption too, not only for a stop."""
    callback = PruningCallback(Linear(final=0.8, start=0, end=20, frequency=2), summary=False)
    with warnings.catch_warnings(record=True) as caught, pytest.raises(RuntimeError, match="stopped by the test"):
        warnings.simplefilter("always")
        quiet_trainer([callback, FailAt(9)], max_epochs=5).fit(TinyNet())
    said = [str(w.message) for w in caught if "before the schedule's last event" in str(w.message)]
    assert len(said) == 1 and "fit ended at step 9" in said[0], said


def test_epoch_fractions_in_a_run_shorter_than_an_epoch_say_so() -> None:
    """max_steps=5 of an 8-batch epoch: no epoch completes; the hint blamed a loader without length."""
    callback = PruningCallback(Linear(final=0.5, start=0.0, end=0.5), unit="epoch", summary=False)
    hint = r"max_steps=5 ends the run before its first epoch completes: raise it, or give integer times$"
    with pytest.raises(ValueError, match=hint):
        quiet_trainer([callback], max_epochs=3, max_steps=5).fit(TinyNet())


def test_epoch_events_over_a_stream_give_one_value_a_step() -> None:
    """A loader without length: the epoch's last batch was never recognized, so the periodic log and the next
    epoch's event both logged at that step (two values for one step)."""
    logger = Values()
    callback = PruningCallback(Linear(final=0.5, start=0, end=3, frequency=1), unit="epoch", log_every_n_steps=4,
                               summary=False)  # fmt: skip
    loader = torch.utils.data.DataLoader(Endless(), batch_size=2)  # 8 batches an epoch
    quiet_trainer([callback], max_epochs=4, logger=logger).fit(TinyNet(), loader)
    steps = [step for step, _ in logger.values["pruning/sparsity/total"]]
    assert steps == sorted(set(steps)) == [0, 4, 8, 12, 16, 20, 24, 28, 32]
