"""The schedule of one fit: resolved against the run's length, the events taken on it, and what to say about timing.

A :class:`Timeline` belongs to one :class:`~lightprune.PruningCallback`. When training starts it fixes the schedule's
fractions of the run to a length (this run's, or the length of the run a checkpoint was written in, so that a resumed
run prunes at the same times) and keeps which event was taken last; both travel in the callback's checkpoint state.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.utilities import rank_zero_warn

from lightprune.callback import clock, reporting
from lightprune.callback.options import schedule_for_run
from lightprune.schedules import Schedule

__all__ = ["Timeline"]


class Timeline:
    """The schedule of one fit on ``unit``'s clock (``"step"`` or ``"epoch"``) and the last event taken on it.

    ``title`` names the callback in warnings. ``resolved`` is ``None`` until :meth:`start`; ``last_event`` is ``-1``
    until an event is taken.

    Example:
        >>> from lightprune.schedules import Constant
        >>> timeline = Timeline("PruningCallback", "step")
        >>> timeline.resolved = Constant(0.5, at=3)
        >>> timeline.events = timeline.resolved.events()
        >>> timeline.next_event(), timeline.state()
        (3, {'last_event': -1, 'run_lengths': {}})
    """

    def __init__(self, title: str, unit: str) -> None:
        self.title = title
        self.unit = unit
        self.resolved: Schedule | None = None
        self.last_event = -1
        self.events: list[int] = []  # the resolved schedule's events, where a statistics window needs the next one
        self.lengths: dict[str, int] = {}  # the run lengths fractions of the run were resolved against, per clock
        self.restored_lengths: dict[str, int] = {}  # a checkpoint's: a resumed run keeps them
        self._measured_steps: int | None = None  # this run's length in steps as the Trainer gave it at the start
        self._first_batches: int | float | None = None  # the loader's batches when training started

    def reset(self) -> None:
        """Forget the last fit: a new one replays the schedule from its start."""
        self.resolved = None
        self.last_event = -1
        self.events = []
        self.lengths, self.restored_lengths, self._measured_steps = {}, {}, None
        self._first_batches = None

    def state(self) -> dict[str, Any]:
        """The entries of the callback's checkpoint state that resume this timeline."""
        return {"last_event": self.last_event, "run_lengths": dict(self.lengths)}

    def load_state(self, state: dict[str, Any]) -> None:
        """Resume from a checkpoint's state (entries missing in older checkpoints start afresh)."""
        self.last_event = int(state.get("last_event", -1))
        self.restored_lengths = {unit: int(n) for unit, n in state.get("run_lengths", {}).items()}

    def run_length(self, trainer: Trainer, unit: str) -> int | float | None:
        """The run length that fractions of the run on ``unit``'s clock are resolved against: this run's, or in a
        run resumed from a checkpoint that recorded one, the checkpoint's (warned about where they differ), so that
        events and mask updates fall at the same times as in the run that wrote it."""
        if unit in self.lengths:  # the schedule's and the regrowth's step clocks: one length, said once
            return self.lengths[unit]
        length = clock.run_length(trainer, unit)
        if unit == "step" and length is not None and length != float("inf"):
            self._measured_steps = int(length)
            self._first_batches = trainer.num_training_batches
        restored = self.restored_lengths.get(unit)
        if restored is not None and length != restored:
            if length is not None and length != float("inf"):
                rank_zero_warn(
                    f"{self.title}: this fit lasts {int(length)} {clock.clock_name(trainer, unit)}, the run of the "
                    f"checkpoint {restored}: the schedule's fractions of the run keep that run's length, so events "
                    f"(and regrow_until) come at the same {unit}s as there; to spread them over this run, start a "
                    "new fit from the checkpoint's weights with a PruningCallback of integer times and "
                    "adopt_zeros=True",
                    category=UserWarning,
                )
            length = restored
        if length is not None and length != float("inf"):
            self.lengths[unit] = int(length)
        return length

    def warn_if_length_changed(self, trainer: Trainer) -> None:
        """At an epoch's start: the step clock's fractions of the run were fixed to a length read from the first
        epoch's loader, and a reloaded loader (``reload_dataloaders_every_n_epochs``) has another number of batches:
        say so, once."""
        measured = self._measured_steps
        batches, first = trainer.num_training_batches, self._first_batches
        if measured is None or first is None or batches == first:
            return
        if clock.run_length(trainer, "step") == measured:
            return  # (max_steps bounds the run: its length did not move)
        self._first_batches = None  # said once
        rank_zero_warn(
            f"{self.title}: the loader of epoch {trainer.current_epoch} has {batches} batches, the one the run's "
            f"length was read from when training started {first}: the schedule's fractions of the run (and "
            f"regrow_until) stay fixed to {self.lengths.get('step', measured)} {clock.clock_name(trainer, 'step')}, "
            "so events and mask updates do not follow the new length. Give integer times for loaders whose length "
            "changes between epochs",
            category=UserWarning,
        )

    def start(self, schedule: Schedule, trainer: Trainer, rewind: int | None, windowed: bool) -> Schedule:
        """Resolve ``schedule`` for this fit and check it against the run; keep its events where a statistics window
        (``windowed``) needs the next one. Returns the resolved schedule."""
        length = None if schedule.is_resolved else self.run_length(trainer, self.unit)
        resolved = schedule_for_run(schedule, self.unit, trainer, rewind, length)
        self.resolved = resolved
        self._warn_if_last_event_ends_fit(trainer)
        self.events = resolved.events() if windowed else []
        return resolved

    def finished(self) -> bool:
        """Whether the resolved schedule's last event was taken (``False`` before the fit resolved it)."""
        return self.resolved is not None and self.last_event >= self.resolved.last_event

    def next_event(self) -> int | None:
        """The first event of the schedule after the last one taken, or ``None`` (only where ``windowed``)."""
        index = bisect.bisect_right(self.events, self.last_event)
        return self.events[index] if index < len(self.events) else None

    def event_next(self, trainer: Trainer, batch_idx: int) -> bool:
        """``unit="epoch"``: whether this batch ends its epoch and an event comes when the next one starts (or fit
        ends), which logs at this same step: one value a step, the one the next batch trains with."""
        if self.unit != "epoch" or self.resolved is None or not clock.last_batch_reached(trainer, batch_idx + 1):
            return False
        after = trainer.current_epoch + 1
        return self.resolved.latest_event(after) == after > self.last_event

    def warn_catching_up(self, now: int) -> None:
        """A fit that starts the schedule at ``now`` > 0 (from a checkpoint without the callback's state) takes every
        event of the ramp up to ``now`` at once: say so, and how to ramp from here."""
        assert self.resolved is not None
        first = self.resolved.first_event
        if first >= now or self.resolved.latest_event(now) == first:
            return  # no event is past, or a single one (a one-shot schedule) is taken late
        rank_zero_warn(
            f"{self.title}: this fit starts at {self.unit} {now} (Lightning's clock goes on from the checkpoint it "
            "resumes, which holds no state of this callback, or from an earlier fit of this Trainer), past the "
            f"events from {self.unit} {first} of the schedule "
            f"{self.resolved!r}: its first event prunes to {self.resolved.target(now):.4g} at once instead of "
            f"ramping. To ramp from this fit's start, start the schedule at {self.unit} {now} or later",
            category=UserWarning,
        )

    def warn_if_unfinished(self, now: int, counts: Callable[[], list[tuple[int, int]]]) -> None:
        """Fit ended (EarlyStopping, max_steps, interruption) at ``now``, before the schedule's last event: say how
        far it got (``counts``: the ``(units, pruned)`` of every tensor)."""
        if self.resolved is None or self.finished():
            return
        pairs = counts()
        reached = sum(pruned for _, pruned in pairs) / max(sum(units for units, _ in pairs), 1)
        reporting.warn_unfinished(self.unit, now, self.resolved.last_event, reached, self.resolved.final_sparsity)

    def _warn_if_last_event_ends_fit(self, trainer: Trainer) -> None:
        """An epoch event at ``max_epochs`` runs when fit ends, after the last validation and checkpoints: say so."""
        epochs = clock.run_length(trainer, "epoch")
        if self.resolved is None or self.unit != "epoch" or epochs is None or self.resolved.last_event != epochs:
            return
        if clock.max_steps_cuts_last_epoch(trainer):  # (the event runs when that epoch starts, and it trains)
            return
        rank_zero_warn(
            f"{self.title}: the schedule {self.resolved!r} has its last event at epoch {epochs}, "
            "where the run ends (max_epochs, or the epochs max_steps completes): it runs when fit ends, after the last "
            "validation and every checkpoint written "
            f"during fit, so the returned model (at {self.resolved.final_sparsity:.4g}) is neither fine-tuned, nor "
            f"validated, nor in those checkpoints. End the schedule at epoch {int(epochs) - 1} or before (a "
            "fraction of the run, end=1.0, resolves to it) to train after its last event",
            category=UserWarning,
        )
