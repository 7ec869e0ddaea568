"""The callback's clock: which count of the run a schedule's times are read against, and how long the run is.

* ``unit="epoch"``: completed epochs (``trainer.current_epoch``); the run lasts ``max_epochs``, or, where
  ``max_steps`` ends it first, the epochs completed within ``max_steps`` (an epoch it cuts short is not completed).
* ``unit="step"`` under automatic optimization: optimizer steps (``trainer.global_step``, so gradient accumulation is
  handled); the run lasts ``trainer.estimated_stepping_batches``, or, beside a ``GradientAccumulationScheduler``
  (whose factors Lightning's estimate does not read), the sum over epochs of each epoch's optimizer steps.
* ``unit="step"`` under manual optimization (``automatic_optimization = False``): *training batches*. There Lightning's
  ``global_step`` counts every ``optimizer.step()`` call, so a GAN stepping two optimizers a batch would run its
  schedule twice as fast, and a loop that steps every other batch (gradient accumulation by hand) half as fast, as
  one that steps once. Counting batches makes a fraction of the run a fraction of the run whatever the loop does with
  its optimizers; with one ``optimizer.step()`` a batch both counts agree. The run lasts ``max_epochs`` times the
  batches of an epoch; with ``max_steps`` set its length is unknown (``max_steps`` counts ``optimizer.step()``
  calls, so it cannot say how many batches run: a GAN stepping twice a batch stops after half of them).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Trainer

__all__ = [
    "clock_name",
    "counts_batches",
    "ended_inside_epoch",
    "in_swa_batch_norm_epoch",
    "last_batch_reached",
    "max_steps_cuts_last_epoch",
    "now",
    "run_length",
    "stopped_early",
    "swa_batch_norm_epoch",
]


def counts_batches(trainer: Trainer, unit: str) -> bool:
    """Whether the ``"step"`` clock counts training batches: ``unit="step"`` under manual optimization.

    Example:
        >>> counts_batches(Trainer(logger=False, enable_progress_bar=False), "epoch")
        False
    """
    module = trainer.lightning_module
    return unit == "step" and module is not None and not module.automatic_optimization


def clock_name(trainer: Trainer, unit: str) -> str:
    """What the clock counts, in words, for messages.

    Example:
        >>> clock_name(Trainer(logger=False, enable_progress_bar=False), "step")
        'optimizer steps'
    """
    if unit == "epoch":
        return "epochs"
    return "training batches" if counts_batches(trainer, unit) else "optimizer steps"


def now(trainer: Trainer, unit: str) -> int:
    """The clock's time: epochs completed, optimizer steps taken, or (manual optimization) batches trained on.

    In ``on_train_batch_end`` the batch that just ran is counted; in ``on_train_batch_start`` it is not yet.

    Example:
        >>> now(Trainer(logger=False, enable_progress_bar=False), "step")
        0
    """
    if unit == "epoch":
        return trainer.current_epoch
    if counts_batches(trainer, unit):
        return trainer.fit_loop.epoch_loop.batch_progress.total.processed
    return trainer.global_step


def _accumulation(trainer: Trainer) -> Any:
    """The ``GradientAccumulationScheduler`` among the callbacks (its factors replace the Trainer's), or ``None``."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    schedulers = [c for c in trainer.callbacks if isinstance(c, GradientAccumulationScheduler)]  # type: ignore[attr-defined]
    return schedulers[0] if schedulers else None


def _epoch_steps(trainer: Trainer, epoch: int, batches: int, scheduler: Any) -> int:
    """The optimizer steps of one epoch of ``batches`` batches accumulated ``a`` at a time: ``ceil(batches / a)``
    (its last, short group steps too)."""
    factor = trainer.accumulate_grad_batches if scheduler is None else scheduler.get_accumulate_grad_batches(epoch)
    return -(-batches // factor)


def _optimizer_steps(trainer: Trainer) -> int | float:
    """How many optimizer steps the run takes: ``trainer.estimated_stepping_batches``, counted epoch by epoch with
    the factors of a ``GradientAccumulationScheduler`` among the callbacks."""
    estimated = trainer.estimated_stepping_batches  # (sets the training data up if it is not yet)
    scheduler = _accumulation(trainer)
    epochs, batches = trainer.max_epochs, trainer.num_training_batches
    if scheduler is None or epochs is None or epochs < 0 or batches == float("inf"):
        return estimated
    total = sum(_epoch_steps(trainer, epoch, int(batches), scheduler) for epoch in range(max(epochs, 1)))
    return min(total, trainer.max_steps) if trainer.max_steps != -1 else total


def _epochs(trainer: Trainer) -> tuple[int | None, bool]:
    """The epochs the run completes, and whether ``max_steps`` then ends it inside the next one.

    ``max_epochs``, or where ``max_steps`` ends the run first the epochs completed within it; unknown (``None``)
    where ``max_steps`` may end it and cannot be turned into epochs: a loader without length, or manual optimization
    (``max_steps`` counts ``optimizer.step()`` calls, any number a batch).
    """
    epochs = trainer.max_epochs
    if trainer.max_steps == -1:
        return epochs, False
    bounded = epochs is not None and epochs >= 0
    module = trainer.lightning_module
    _ = trainer.estimated_stepping_batches  # (sets the training data up if it is not yet)
    batches = trainer.num_training_batches
    if batches == float("inf") or (module is not None and not module.automatic_optimization):
        return None, False
    if batches < 1:  # (no training at all)
        return (epochs if bounded else None), False
    scheduler, steps, completed = _accumulation(trainer), 0, 0
    while not (bounded and completed >= epochs) and steps < trainer.max_steps:
        steps += _epoch_steps(trainer, completed, int(batches), scheduler)
        if steps > trainer.max_steps:
            return completed, True
        completed += 1
    return completed, False


def swa_batch_norm_epoch(trainer: Trainer) -> int | None:
    """The epoch ``StochasticWeightAveraging`` adds after the last one, for a model with BatchNorm: a pass over the
    training data without backward, recomputing the normalization statistics of the averaged weights, which it has
    copied into the model. No training happens there. ``None`` without such an epoch (or before SWA's
    ``on_fit_start`` adds it).

    Example:
        >>> swa_batch_norm_epoch(Trainer(max_epochs=3, logger=False, enable_progress_bar=False)) is None
        True
    """
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    module = trainer.lightning_module
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if not isinstance(callback, StochasticWeightAveraging) or module is None:
            continue
        try:
            end = callback.swa_end  # the last training epoch, once its on_fit_start has run
        except AttributeError:
            return None
        if end != float("inf") and callback.pl_module_contains_batch_norm(module):
            return int(end) + 1
    return None


def in_swa_batch_norm_epoch(trainer: Trainer) -> bool:
    """Whether training is in the epoch of :func:`swa_batch_norm_epoch`: nothing trains there, so the callback takes
    no event and moves no mask in it.

    Example:
        >>> in_swa_batch_norm_epoch(Trainer(max_epochs=3, logger=False, enable_progress_bar=False))
        False
    """
    return trainer.training and swa_batch_norm_epoch(trainer) == trainer.current_epoch


def run_length(trainer: Trainer, unit: str) -> int | float | None:
    """How many units of the clock the run lasts; ``None`` or ``inf`` when that is unknown.

    Under manual optimization the length is unknown when ``max_steps`` is set: it counts ``optimizer.step()`` calls,
    any number of which a batch may make, so it may end the run before ``max_epochs`` does. The epoch that
    ``StochasticWeightAveraging`` adds to recompute BatchNorm statistics trains nothing and does not count
    (:func:`swa_batch_norm_epoch`).

    Example:
        >>> run_length(Trainer(max_epochs=3, logger=False, enable_progress_bar=False), "epoch")
        3
    """
    added = swa_batch_norm_epoch(trainer)
    if added is not None and trainer.fit_loop.max_epochs == added + 1:
        trainer.fit_loop.max_epochs = added  # the length of the training epochs, read through Lightning's estimate
        try:
            return _run_length(trainer, unit)
        finally:
            trainer.fit_loop.max_epochs = added + 1
    return _run_length(trainer, unit)


def _run_length(trainer: Trainer, unit: str) -> int | float | None:
    if unit == "epoch":
        return _epochs(trainer)[0]
    if not counts_batches(trainer, unit):
        return _optimizer_steps(trainer)
    epochs, batches = trainer.max_epochs, trainer.num_training_batches
    if epochs is None or epochs < 0 or batches == float("inf"):
        return None
    return None if trainer.max_steps != -1 else int(batches) * max(epochs, 1)


def max_steps_cuts_last_epoch(trainer: Trainer) -> bool:
    """Whether ``max_steps`` ends the run inside the epoch after its last completed one: that epoch starts (and an
    event due when it starts runs) but is not completed.

    Example:
        >>> max_steps_cuts_last_epoch(Trainer(max_epochs=3, logger=False, enable_progress_bar=False))
        False
    """
    return _epochs(trainer)[1]


def stopped_early(trainer: Trainer) -> bool:
    """Whether fit ended because something asked it to stop (``EarlyStopping``, ``Timer``, ``trainer.should_stop``)
    before ``max_epochs`` and ``max_steps``: the model was last trained at the clock's time now, not before it.

    Example:
        >>> trainer = Trainer(max_epochs=3, logger=False, enable_progress_bar=False)
        >>> trainer.should_stop = True
        >>> stopped_early(trainer)
        True
    """
    if not trainer.should_stop:
        return False
    if trainer.max_steps != -1 and trainer.global_step >= trainer.max_steps:
        return False
    epochs = trainer.max_epochs
    return epochs is None or epochs < 0 or trainer.current_epoch < epochs


def ended_inside_epoch(trainer: Trainer) -> bool:
    """At the end of fit: whether its last epoch stopped before its last batch (``max_steps``, or ``EarlyStopping``
    or a ``Timer`` stopping mid-epoch). Lightning counts that epoch in ``current_epoch`` all the same, so the epoch
    clock would read one epoch the model never finished. Read it in ``on_train_end`` only: during fit the count of
    the epoch's batches starts again at every epoch.

    Example:
        >>> ended_inside_epoch(Trainer(max_epochs=3, logger=False, enable_progress_bar=False))
        False
    """
    trained = trainer.fit_loop.epoch_loop.batch_progress.current.processed
    return trainer.current_epoch > 0 and trained > 0 and not last_batch_reached(trainer, trained)


def last_batch_reached(trainer: Trainer, trained: int) -> bool:
    """Whether the epoch's batch ``trained`` (counting from 1) is its last: for a loader without length, the fit
    loop's flag (its fetcher looks one batch ahead), else the count of the epoch's batches.

    Example:
        >>> trainer = Trainer(max_epochs=3, logger=False, enable_progress_bar=False)
        >>> trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        False
    """
    batches = trainer.num_training_batches
    if batches == float("inf"):
        return trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
    return trained >= batches
