"""Pruning schedules: the target total sparsity as a pure function of time.

A schedule answers three questions for the pruning callback, which owns the clock (optimizer steps or epochs):

* *When* to prune: :meth:`Schedule.is_event`, :meth:`Schedule.latest_event` and :meth:`Schedule.events`. Events are
  integer times.
* *How much* in total: :meth:`Schedule.target` (also ``schedule(t)``), a fraction in ``[0, 1]`` of the selected
  entries that should be zero.
* *Until when*: :attr:`Schedule.first_event`, :attr:`Schedule.last_event` and :attr:`Schedule.final_sparsity`.

Semantics shared by every schedule:

* ``target(t)`` is a right-continuous step function: it is ``0.0`` before the first event, jumps at each event to
  that event's level and holds it until the next event. So ``target(t)`` is the sparsity the model should have at
  time ``t`` once the event at ``t`` (if any) has been applied. It never decreases (pruning is monotone).
* Times may be given as ``int`` (absolute, in the clock's unit) or as ``float`` in ``[0, 1]`` meaning a fraction of
  the whole run. Fractions are turned into integers by :meth:`Schedule.resolve` once the run length is known; a
  schedule holding fractions refuses time queries until it is resolved.
* Schedules are immutable values: :meth:`Schedule.resolve` returns a new schedule.

Example:
    >>> schedule = Cubic(final=0.875, end=4)
    >>> schedule.events()
    [0, 1, 2, 3, 4]
    >>> [schedule(t) for t in range(6)]
    [0.0, 0.505859375, 0.765625, 0.861328125, 0.875, 0.875]

"""

from __future__ import annotations

import bisect
import itertools
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from functools import cached_property
from numbers import Integral, Real
from typing import Any

from lightprune._checks import is_int

__all__ = [
    "SCHEDULES",
    "Constant",
    "Cubic",
    "FromCallable",
    "Geometric",
    "Linear",
    "Points",
    "Schedule",
    "make_schedule",
]

Time = int | float


# ----------------------------------------------------------------------------------------------------------------------
# Validation and fraction resolution helpers
# ----------------------------------------------------------------------------------------------------------------------


def _is_float(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, (Integral, bool))


def _check_sparsity(name: str, value: Any) -> float:
    """Return ``value`` as a float after checking that it is a number in ``[0, 1]``."""
    if not (is_int(value) or _is_float(value)) or not 0 <= value <= 1:
        raise ValueError(f"{name}={value!r} must be in [0, 1]")
    return float(value)


def _check_position(name: str, value: Any) -> Time:
    """Check a point in time: an int >= 0 (clock time) or a float in [0, 1] (fraction of the run)."""
    if is_int(value) and value >= 0:
        return int(value)
    if _is_float(value) and 0 <= value <= 1:
        return float(value)
    raise ValueError(
        f"{name}={value!r} must be an int >= 0 (a time in the clock's unit) "
        "or a float in [0, 1] (a fraction of the run)"
    )


def _check_period(name: str, value: Any) -> Time:
    """Check a duration: an int >= 1 (clock units) or a float in (0, 1] (fraction of the run)."""
    if is_int(value) and value >= 1:
        return int(value)
    if _is_float(value) and 0 < value <= 1:
        return float(value)
    raise ValueError(f"{name}={value!r} must be an int >= 1 (clock units) or a float in (0, 1] (a fraction of the run)")


def _check_before(first_name: str, first: Time, second_name: str, second: Time, or_equal: bool = False) -> None:
    """Check ``first < second`` (``<=`` with ``or_equal``) when both are of the same kind (both ints or both
    fractions)."""
    if type(first) is type(second) and not (first <= second if or_equal else first < second):
        raise ValueError(f"{first_name}={first!r} must be {'<=' if or_equal else '<'} {second_name}={second!r}")


def _round_half_up(value: float) -> int:
    return math.floor(value + 0.5)


def _resolve_position(value: Time, total: int) -> int:
    """Map a fraction of the run to a clock time in ``[0, total - 1]``; ints pass through."""
    if isinstance(value, float):
        return min(_round_half_up(value * total), total - 1)
    return value


def _resolve_period(value: Time, total: int) -> int:
    """Map a fraction of the run to a number of clock units ``>= 1``; ints pass through."""
    if isinstance(value, float):
        return max(1, _round_half_up(value * total))
    return value


def _check_total(total: Any) -> int:
    if not is_int(total) or total < 1:
        raise ValueError(f"total={total!r} must be an int >= 1 (the number of clock units in the run)")
    return int(total)


# ----------------------------------------------------------------------------------------------------------------------
# Base class
# ----------------------------------------------------------------------------------------------------------------------


class Schedule(ABC):
    """Base class of pruning schedules: the target total sparsity as a pure function of time.

    Subclasses describe a finite, sorted set of integer *event* times and the sparsity *level* reached at each
    event; this base class derives the public queries from them. See the module docstring for the shared semantics.

    Subclasses implement :meth:`_params`, :meth:`_last_event_at_or_before`, :meth:`_level` and :meth:`events` (from
    which :attr:`first_event` and :attr:`last_event` follow), and list the names of their time arguments in
    ``_position_args`` (points in time) and ``_period_args`` (durations) so that :meth:`resolve` can convert
    fractions.

    Example:
        >>> schedule = Linear(initial=0.2, final=0.8, start=10, end=40, frequency=10)
        >>> schedule.events()
        [10, 20, 30, 40]
        >>> schedule.is_event(20), schedule.is_event(25)
        (True, False)
        >>> schedule.target(5), schedule.target(10), schedule.target(25), schedule.target(99)
        (0.0, 0.2, 0.4, 0.8)
        >>> schedule.first_event, schedule.last_event, schedule.final_sparsity
        (10, 40, 0.8)

    """

    _position_args: tuple[str, ...] = ()
    _period_args: tuple[str, ...] = ()

    # -- to implement --------------------------------------------------------------------------------------------------

    @abstractmethod
    def _params(self) -> dict[str, Any]:
        """Return the constructor keyword arguments that rebuild this schedule."""

    @abstractmethod
    def _last_event_at_or_before(self, t: float) -> int | None:
        """Return the latest event time ``<= t``, or ``None`` when ``t`` is before the first event."""

    @abstractmethod
    def _level(self, event: int) -> float:
        """Return the target sparsity reached at ``event``, which is one of :meth:`events`."""

    @abstractmethod
    def events(self) -> list[int]:
        """Return all event times, sorted increasingly.

        Example:
            >>> Geometric(0.5, start=2, frequency=3, rounds=3).events()
            [2, 5, 8]

        """

    @property
    def first_event(self) -> int:
        """The time of the first event.

        Example:
            >>> Geometric(0.5, start=2, frequency=3, rounds=3).first_event
            2
        """
        return self.events()[0]

    @property
    def last_event(self) -> int:
        """The time of the last event, after which the target stays at :attr:`final_sparsity`.

        Example:
            >>> Geometric(0.5, start=2, frequency=3, rounds=3).last_event
            8
        """
        return self.events()[-1]

    def validate(self) -> None:
        """Raise ``ValueError`` where a level is not a number in ``[0, 1]`` or is lower than the one before: the
        callback checks a resolved schedule before training (lightprune's own schedules check their arguments when
        built, so theirs returns at once; a subclass of your own gets this check of every event).

        Example:
            >>> class Halving(Points):  # a subclass of your own: its levels are read
            ...     def _level(self, event: int) -> float:
            ...         return super()._level(event) / (1 + event)
            >>> Halving({0: 0.5, 4: 0.8}).validate()
            Traceback (most recent call last):
            ...
            ValueError: Halving: its level at event 4 (0.16) is lower than at event 0 (0.5): ...
        """
        if type(self) in _CHECKED_WHEN_BUILT:
            return
        previous: tuple[int, float] | None = None
        for event in self.events():
            level = self._level(event)
            if not (is_int(level) or _is_float(level)) or not 0 <= level <= 1:  # (NaN is in no range)
                raise ValueError(
                    f"{type(self).__name__}: its level at event {event} is {level!r}; levels are numbers in [0, 1]"
                )
            if previous is not None and level < previous[1]:
                raise ValueError(
                    f"{type(self).__name__}: its level at event {event} ({level!r}) is lower than at event "
                    f"{previous[0]} ({previous[1]!r}): the target sparsity must never decrease"
                )
            previous = (event, float(level))

    # -- public queries ------------------------------------------------------------------------------------------------

    def target(self, t: float) -> float:
        """Return the target total sparsity at time ``t``.

        Args:
            t: time in the clock's unit; need not be an integer nor an event.

        Returns:
            ``0.0`` before the first event, else the level of the latest event at or before ``t``.

        Raises:
            RuntimeError: if the schedule still holds fractions of the run (see :meth:`resolve`).

        Example:
            >>> schedule = Constant(0.5, at=3)
            >>> schedule.target(2.9), schedule.target(3), schedule.target(1000)
            (0.0, 0.5, 0.5)

        """
        event = self.latest_event(t)
        return 0.0 if event is None else self._level(event)

    def __call__(self, t: float) -> float:
        """Alias of :meth:`target`.

        Example:
            >>> Constant(0.5)(0)
            0.5

        """
        return self.target(t)

    def is_event(self, t: float) -> bool:
        """Return whether the callback should prune at time ``t``.

        Args:
            t: time in the clock's unit; non-integer times are never events.

        Example:
            >>> schedule = Linear(final=0.5, start=0, end=10, frequency=4)
            >>> [t for t in range(12) if schedule.is_event(t)]
            [0, 4, 8, 10]

        """
        self._require_resolved()
        return float(t).is_integer() and self._last_event_at_or_before(t) == t

    def latest_event(self, t: float) -> int | None:
        """Return the latest event at or before time ``t``, or ``None`` if ``t`` is before the first event.

        Constant time (logarithmic for :class:`Points`), so a callback can call it at every step, e.g. to catch up on
        events it did not see (after resuming, or when its hook did not run at that exact time).

        Example:
            >>> schedule = Linear(final=0.5, start=2, end=10, frequency=4)
            >>> [schedule.latest_event(t) for t in (1, 2, 7.5, 99)]
            [None, 2, 6, 10]

        """
        self._require_resolved()
        return self._last_event_at_or_before(t)

    @property
    def final_sparsity(self) -> float:
        """The target sparsity from :attr:`last_event` on.

        Example:
            >>> Geometric(0.5, rounds=3).final_sparsity
            0.875

        """
        self._require_resolved()
        return self._level(self.last_event)

    @cached_property
    def is_resolved(self) -> bool:
        """Whether every time argument is an integer, i.e. the schedule can be queried.

        Example:
            >>> Linear(final=0.5, end=1.0).is_resolved
            False
            >>> Linear(final=0.5, end=1.0).resolve(100).is_resolved
            True

        """
        params = self._params()
        return not any(isinstance(params[name], float) for name in (*self._position_args, *self._period_args))

    def resolve(self, total: int) -> Schedule:
        """Return a copy where every time given as a fraction of the run is converted to clock units.

        The clock is assumed to take the values ``0, 1, ..., total - 1`` (e.g. epochs ``0 .. max_epochs - 1`` or the
        global steps of a run of ``total`` optimizer steps). Rounding is half up:

        * a point in time (``start``, ``end``, ``at``, the times of :class:`Points`) given as fraction ``f`` becomes
          ``min(floor(f * total + 0.5), total - 1)``, so ``1.0`` is the last tick of the run and ``0.0`` the first;
        * a duration (``frequency``) given as fraction ``f`` becomes ``max(1, floor(f * total + 0.5))``.

        Integer arguments are kept as they are (even past the end of the run). Validation runs again on the resolved
        values; errors mention ``total``.

        Args:
            total: number of clock units in the run, ``>= 1``.

        Raises:
            ValueError: if ``total`` is not a positive int, or if the resolved values are invalid (e.g. ``start``
                and ``end`` round to the same time).

        Example:
            >>> Cubic(final=0.9, start=0.1, end=0.75, frequency=0.05).resolve(1000)
            Cubic(initial=0.0, final=0.9, start=100, end=750, frequency=50)
            >>> Constant(0.5, at=1.0).resolve(10)
            Constant(sparsity=0.5, at=9)

        """
        total = _check_total(total)
        try:
            return type(self)(**self._resolved_params(total))
        except ValueError as err:
            raise ValueError(f"{err} (after resolving fractions of the run with total={total})") from None

    # -- helpers -------------------------------------------------------------------------------------------------------

    def _resolved_params(self, total: int) -> dict[str, Any]:
        params = self._params()
        for name in self._position_args:
            if params[name] is not None:
                params[name] = _resolve_position(params[name], total)
        for name in self._period_args:
            if params[name] is not None:
                params[name] = _resolve_period(params[name], total)
        return params

    def _require_resolved(self) -> None:
        if not self.is_resolved:
            raise RuntimeError(
                f"{self!r} has times given as fractions of the run; call `.resolve(total)` with the run length first"
            )

    def __repr__(self) -> str:
        args = ", ".join(f"{name}={value!r}" for name, value in self._params().items())
        return f"{type(self).__name__}({args})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Schedule) or type(self) is not type(other):
            return NotImplemented
        # an int time is a step or an epoch, a float one a fraction of the run: at=1 and at=1.0 differ
        return self._params() == other._params() and self._time_kinds() == other._time_kinds()

    def _time_kinds(self) -> tuple[type, ...]:
        """The types of the time arguments, which ``==`` compares besides their values (``1 == 1.0`` in Python)."""
        params = self._params()
        return tuple(type(params[name]) for name in (*self._position_args, *self._period_args))

    __hash__ = None  # type: ignore[assignment]


# ----------------------------------------------------------------------------------------------------------------------
# Concrete schedules
# ----------------------------------------------------------------------------------------------------------------------


class Constant(Schedule):
    """One-shot pruning: a single event at time ``at`` that reaches ``sparsity``.

    Args:
        sparsity: target sparsity in ``[0, 1]``.
        at: time of the event, an int ``>= 0`` or a fraction of the run in ``[0, 1]``.

    Example:
        >>> schedule = Constant(0.9, at=5)
        >>> schedule.events(), schedule.target(4), schedule.target(5)
        ([5], 0.0, 0.9)

    """

    _position_args = ("at",)

    def __init__(self, sparsity: float, at: Time = 0) -> None:
        self.sparsity = _check_sparsity("sparsity", sparsity)
        self.at = _check_position("at", at)

    def _params(self) -> dict[str, Any]:
        return {"sparsity": self.sparsity, "at": self.at}

    def _last_event_at_or_before(self, t: float) -> int | None:
        return self.at if t >= self.at else None  # type: ignore[return-value]

    def _level(self, event: int) -> float:
        return self.sparsity

    def events(self) -> list[int]:
        """Return ``[at]``.

        Example:
            >>> Constant(0.5, at=7).events()
            [7]

        """
        self._require_resolved()
        return [self.at]  # type: ignore[list-item]


class _Ramp(Schedule):
    """Shared event grid of :class:`Linear`, :class:`Cubic` and :class:`FromCallable`.

    Events are ``start, start + frequency, start + 2 * frequency, ...`` while ``< end``, plus ``end`` itself, so the
    last event is exactly ``end`` even when ``end - start`` is not a multiple of ``frequency``.
    """

    _position_args = ("start", "end")
    _period_args = ("frequency",)
    _one_event = False  # whether end == start is a schedule (one event) rather than a mistake

    def __init__(self, start: Time, end: Time, frequency: Time) -> None:
        self.start = _check_position("start", start)
        self.end = _check_position("end", end)
        self.frequency = _check_period("frequency", frequency)
        _check_before("start", self.start, "end", self.end, or_equal=self._one_event)

    def _last_event_at_or_before(self, t: float) -> int | None:
        start, end, frequency = int(self.start), int(self.end), int(self.frequency)
        if t < start:
            return None
        if t >= end:
            return end
        return start + math.floor((t - start) / frequency) * frequency

    def events(self) -> list[int]:
        """Return ``start, start + frequency, ...`` below ``end``, then ``end``.

        Example:
            >>> Linear(final=0.5, start=1, end=8, frequency=3).events()
            [1, 4, 7, 8]

        """
        self._require_resolved()
        return [*range(int(self.start), int(self.end), int(self.frequency)), int(self.end)]


class _MonotoneRamp(_Ramp):
    """A ramp from ``initial`` at ``start`` to ``final`` at ``end`` along a non-decreasing curve."""

    def __init__(self, *, initial: float = 0.0, final: float, start: Time = 0, end: Time, frequency: Time = 1) -> None:
        super().__init__(start, end, frequency)
        self.initial = _check_sparsity("initial", initial)
        self.final = _check_sparsity("final", final)
        if self.initial > self.final:
            raise ValueError(f"initial={initial!r} must be <= final={final!r}: the target sparsity must never decrease")

    def _params(self) -> dict[str, Any]:
        return {
            "initial": self.initial,
            "final": self.final,
            "start": self.start,
            "end": self.end,
            "frequency": self.frequency,
        }

    @abstractmethod
    def _fraction_done(self, done: int, length: int) -> tuple[int, int]:
        """Return the fraction of ``final - initial`` reached after ``done`` of ``length`` units, as integers.

        Returning ``(numerator, denominator)`` keeps the arithmetic exact until a single final float division.
        """

    def _level(self, event: int) -> float:
        # The endpoints are returned exactly; in between, clamping keeps float rounding from leaving
        # [initial, final], which also keeps the levels non-decreasing.
        if event <= self.start:
            return self.initial
        if event >= self.end:
            return self.final
        numerator, denominator = self._fraction_done(event - int(self.start), int(self.end) - int(self.start))
        level = self.initial + (self.final - self.initial) * numerator / denominator
        return min(max(level, self.initial), self.final)


class Linear(_MonotoneRamp):
    r"""Linear ramp: ``s(t) = initial + (final - initial) * (t - start) / (end - start)`` sampled at each event.

    Events are every ``frequency`` units from ``start``, plus ``end`` (see :meth:`events`); the level at ``start`` is
    exactly ``initial`` and at ``end`` exactly ``final``.

    Args:
        initial: sparsity reached at the first event, in ``[0, 1]``.
        final: sparsity reached at ``end``, in ``[initial, 1]``.
        start: time of the first event (int ``>= 0`` or fraction of the run).
        end: time of the last event (int or fraction of the run), ``> start``.
        frequency: units between events (int ``>= 1`` or fraction of the run).

    Example:
        >>> schedule = Linear(final=0.6, start=0, end=30, frequency=10)
        >>> [schedule(t) for t in (0, 10, 19, 20, 30)]
        [0.0, 0.2, 0.2, 0.4, 0.6]

    """

    def _fraction_done(self, done: int, length: int) -> tuple[int, int]:
        return done, length


class Cubic(_MonotoneRamp):
    r"""Gradual pruning of Zhu & Gupta (2017), "To prune, or not to prune".

    ``s(t) = final + (initial - final) * (1 - (t - start) / (end - start)) ** 3``, sampled at each event: pruning is
    fast early, while the network has many redundant weights, and slows down towards ``final``. The paper's
    ``n * Δt`` is ``end - start`` and ``Δt`` is ``frequency``. When ``end - start`` is not a multiple of
    ``frequency``, the grid is kept and ``end`` is added as a last event (see :meth:`events`), so the last event is
    exactly ``end`` with level exactly ``final``.

    Args:
        initial: sparsity reached at the first event, in ``[0, 1]``.
        final: sparsity reached at ``end``, in ``[initial, 1]``.
        start: time of the first event (int ``>= 0`` or fraction of the run).
        end: time of the last event (int or fraction of the run), ``> start``.
        frequency: units between events (int ``>= 1`` or fraction of the run).

    Example:
        >>> schedule = Cubic(final=0.8, start=0, end=100, frequency=50)
        >>> schedule.events(), schedule(50), schedule(100)
        ([0, 50, 100], 0.7, 0.8)

    """

    def _fraction_done(self, done: int, length: int) -> tuple[int, int]:
        # 1 - (1 - done / length) ** 3 == (length**3 - (length - done)**3) / length**3, exact in integers.
        return length**3 - (length - done) ** 3, length**3


class Geometric(Schedule):
    """Iterative pruning where each event removes ``fraction`` of the entries that remain.

    After the ``j``-th event (``j = 1, 2, ...``) the target is ``1 - (1 - fraction) ** j``. This is the schedule of
    iterative magnitude pruning / lottery-ticket rounds, and what ``lightning``'s ``ModelPruning`` does with a float
    ``amount`` applied every epoch.

    Events are ``start + k * frequency``; give exactly one of ``rounds`` (the number of events) or ``end`` (an
    inclusive bound: the last event is the last grid time ``<= end``, which need not be ``end`` itself). For "every
    epoch until the end of training" use ``end=1.0`` and :meth:`~Schedule.resolve`.

    Args:
        fraction: fraction of the remaining entries removed at each event, in ``[0, 1]``.
        start: time of the first event (int ``>= 0`` or fraction of the run).
        frequency: units between events (int ``>= 1`` or fraction of the run).
        rounds: number of events, an int ``>= 1``.
        end: no events after this time (int or fraction of the run), ``>= start``.

    Example:
        >>> schedule = Geometric(0.2, start=1, frequency=2, end=6)
        >>> schedule.events(), schedule.last_event
        ([1, 3, 5], 5)
        >>> [round(schedule(t), 6) for t in (0, 1, 3, 5, 6)]
        [0.0, 0.2, 0.36, 0.488, 0.488]

    """

    _position_args = ("start", "end")
    _period_args = ("frequency",)

    def __init__(
        self,
        fraction: float,
        *,
        start: Time = 0,
        frequency: Time = 1,
        rounds: int | None = None,
        end: Time | None = None,
    ) -> None:
        self.fraction = _check_sparsity("fraction", fraction)
        self.start = _check_position("start", start)
        self.frequency = _check_period("frequency", frequency)
        if (rounds is None) == (end is None):
            raise ValueError(f"give exactly one of rounds or end, got rounds={rounds!r} and end={end!r}")
        if rounds is not None and not (is_int(rounds) and rounds >= 1):
            raise ValueError(f"rounds={rounds!r} must be an int >= 1")
        self.rounds = None if rounds is None else int(rounds)
        self.end = None if end is None else _check_position("end", end)
        if self.end is not None and type(self.start) is type(self.end) and self.end < self.start:
            raise ValueError(f"end={end!r} must be >= start={start!r}")

    def _params(self) -> dict[str, Any]:
        return {
            "fraction": self.fraction,
            "start": self.start,
            "frequency": self.frequency,
            "rounds": self.rounds,
            "end": self.end,
        }

    @property
    def num_events(self) -> int:
        """The number of events: ``rounds``, or the number of grid times in ``[start, end]``.

        Example:
            >>> Geometric(0.5, start=0, frequency=3, end=10).num_events
            4

        """
        self._require_resolved()
        if self.rounds is not None:
            return self.rounds
        return (int(self.end) - int(self.start)) // int(self.frequency) + 1  # type: ignore[arg-type]

    def _last_event_at_or_before(self, t: float) -> int | None:
        start, frequency = int(self.start), int(self.frequency)
        if t < start:
            return None
        if t >= self.last_event:
            return self.last_event
        return start + math.floor((t - start) / frequency) * frequency

    def _level(self, event: int) -> float:
        rounds_done = (event - int(self.start)) // int(self.frequency) + 1
        return 1.0 - (1.0 - self.fraction) ** rounds_done

    def events(self) -> list[int]:
        """Return ``start + k * frequency`` for ``k = 0 .. num_events - 1``.

        Example:
            >>> Geometric(0.5, start=0, frequency=3, end=10).events()
            [0, 3, 6, 9]

        """
        self._require_resolved()
        start, frequency = int(self.start), int(self.frequency)
        return [start + k * frequency for k in range(self.num_events)]


class Points(Schedule):
    """Explicit ``(time, sparsity)`` pairs; each time is an event and the target is a step function through them.

    Pairs are sorted by time. Times must be distinct and either all ints ``>= 0`` (clock times) or all floats in
    ``[0, 1]`` (fractions of the run). Sparsities must not decrease over time: a decreasing pair is rejected here,
    at construction (and again by :meth:`~Schedule.resolve` should two fractions round to the same time).

    Args:
        points: iterable of ``(time, sparsity)`` pairs, e.g. ``[(0, 0.5), (10, 0.75)]`` or a YAML list of lists, or a
            mapping from time to sparsity, ``{0: 0.5, 10: 0.75}``.

    Example:
        >>> schedule = Points([(10, 0.75), (0, 0.5)])
        >>> schedule.points
        [(0, 0.5), (10, 0.75)]
        >>> [schedule(t) for t in (-1, 0, 9, 10)]
        [0.0, 0.5, 0.5, 0.75]
        >>> Points({0: 0.5, 10: 0.75}) == schedule
        True

    """

    def __init__(self, points: Iterable[Iterable[Any]] | Mapping[Any, Any]) -> None:
        pairs = []
        items = points.items() if isinstance(points, Mapping) else points
        for index, item in enumerate(items):
            pair = tuple(item)
            if len(pair) != 2:
                raise ValueError(f"points[{index}]={item!r} must be a (time, sparsity) pair")
            time = _check_position(f"points[{index}] time", pair[0])
            pairs.append((time, _check_sparsity(f"points[{index}] sparsity", pair[1])))
        if not pairs:
            raise ValueError("points must contain at least one (time, sparsity) pair")
        if len({type(time) for time, _ in pairs}) > 1:
            raise ValueError(
                "points times must be all ints (clock times) or all floats in [0, 1] (fractions of the run), got "
                f"{[time for time, _ in pairs]!r}"
            )
        pairs.sort(key=lambda pair: pair[0])
        for (t0, s0), (t1, s1) in itertools.pairwise(pairs):
            if t0 == t1:
                raise ValueError(f"points times must be distinct, got time {t1!r} twice")
            if s1 < s0:
                raise ValueError(
                    f"points sparsities must not decrease over time: {s0!r} at time {t0!r} is followed by "
                    f"{s1!r} at time {t1!r}"
                )
        self.points: list[tuple[Time, float]] = pairs
        self._times = [time for time, _ in pairs]

    def _params(self) -> dict[str, Any]:
        return {"points": list(self.points)}

    @cached_property
    def is_resolved(self) -> bool:
        """Whether the times are ints (clock times) rather than fractions of the run."""
        return not isinstance(self._times[0], float)

    def _resolved_params(self, total: int) -> dict[str, Any]:
        return {"points": [(_resolve_position(time, total), sparsity) for time, sparsity in self.points]}

    def _time_kinds(self) -> tuple[type, ...]:
        # the times sit inside ``points``, all of one type (checked at construction)
        return (type(self._times[0]),)

    def _last_event_at_or_before(self, t: float) -> int | None:
        index = bisect.bisect_right(self._times, t) - 1
        return None if index < 0 else int(self._times[index])

    def _level(self, event: int) -> float:
        return self.points[bisect.bisect_left(self._times, event)][1]

    def events(self) -> list[int]:
        """Return the times of the points, sorted.

        Example:
            >>> Points([(5, 0.1), (2, 0.0)]).events()
            [2, 5]

        """
        self._require_resolved()
        return [int(time) for time in self._times]


class FromCallable(_Ramp):
    """Any callable ``t -> sparsity`` sampled on the event grid of :class:`Linear` (every ``frequency`` plus ``end``).

    ``fn`` receives the absolute event time (an int in the clock's unit) and must return a sparsity in ``[0, 1]``
    that does not decrease from one event to the next. Since ``fn`` is opaque, this is checked when the level is
    queried rather than at construction: :meth:`~Schedule.target` and :attr:`~Schedule.final_sparsity` raise
    ``ValueError`` if ``fn`` returns a value outside ``[0, 1]`` or lower than at the previous event. The callback
    queries every event in turn, so any decrease is reported at the first event where it happens; call
    :meth:`validate` to check the whole schedule up front.

    Args:
        fn: callable mapping an event time to a sparsity.
        start: time of the first event (int ``>= 0`` or fraction of the run).
        end: time of the last event (int or fraction of the run), ``>= start``: equal, the one event is ``fn(start)``
            (a callable given to the callback on a run of one step or epoch, whose ``end=1.0`` resolves to 0).
        frequency: units between events (int ``>= 1`` or fraction of the run).

    Example:
        >>> schedule = FromCallable(lambda t: t / 100, start=10, end=50, frequency=20)
        >>> schedule.events(), schedule(35), schedule.final_sparsity
        ([10, 30, 50], 0.3, 0.5)
        >>> FromCallable(lambda t: 0.5, end=1.0).resolve(1).events()
        [0]

    """

    _one_event = True

    def __init__(self, fn: Callable[[int], float], *, start: Time = 0, end: Time, frequency: Time = 1) -> None:
        if not callable(fn):
            raise ValueError(f"fn={fn!r} must be callable (time -> sparsity)")
        super().__init__(start, end, frequency)
        self.fn = fn

    def _params(self) -> dict[str, Any]:
        return {"fn": self.fn, "start": self.start, "end": self.end, "frequency": self.frequency}

    def _call(self, event: int) -> float:
        value = self.fn(event)
        if not (is_int(value) or _is_float(value)) or not 0 <= value <= 1:
            raise ValueError(f"fn({event})={value!r} must be in [0, 1]")
        return float(value)

    def _level(self, event: int) -> float:
        level = self._call(event)
        if event > self.start:
            previous = self._last_event_at_or_before(event - 1)
            assert previous is not None
            previous_level = self._call(previous)
            if level < previous_level:
                raise ValueError(
                    f"fn({event})={level!r} is lower than fn({previous})={previous_level!r} at the previous event: "
                    "the target sparsity must never decrease"
                )
        return level

    def validate(self) -> None:
        """Evaluate ``fn`` at every event and raise ``ValueError`` on a value outside ``[0, 1]`` or a decrease.

        Example:
            >>> FromCallable(lambda t: 1 - t / 10, end=10).validate()
            Traceback (most recent call last):
            ...
            ValueError: fn(1)=0.9 is lower than fn(0)=1.0 at the previous event: the target sparsity must never decrease

        """
        for event in self.events():
            self._level(event)


# ----------------------------------------------------------------------------------------------------------------------
# Registry
# ----------------------------------------------------------------------------------------------------------------------

_CHECKED_WHEN_BUILT = (Constant, Linear, Cubic, Geometric, Points)
"""lightprune's schedules, whose constructors check their levels (a subclass may change them: it is checked)."""

SCHEDULES: dict[str, type[Schedule]] = {
    "constant": Constant,
    "linear": Linear,
    "cubic": Cubic,
    "geometric": Geometric,
    "points": Points,
}
"""Schedules that configuration files can name by string (see :func:`make_schedule`)."""


def make_schedule(name_or_schedule: str | Schedule | Callable[[int], float], **kwargs: Any) -> Schedule:
    """Build a schedule from a registry name, or pass a schedule through.

    Args:
        name_or_schedule: a key of :data:`SCHEDULES` (case-insensitive), a :class:`Schedule` (returned as is; no
            ``kwargs`` allowed) or a plain callable (wrapped in :class:`FromCallable` with ``kwargs``).
        kwargs: constructor arguments of the named schedule.

    Raises:
        ValueError: for an unknown name (the message lists the allowed ones), or ``kwargs`` given with a schedule.

    Example:
        >>> make_schedule("cubic", final=0.9, end=100, frequency=10)
        Cubic(initial=0.0, final=0.9, start=0, end=100, frequency=10)
        >>> make_schedule("exponential")
        Traceback (most recent call last):
        ...
        ValueError: unknown schedule 'exponential'; allowed: 'constant', 'linear', 'cubic', 'geometric', 'points'

    """
    if isinstance(name_or_schedule, Schedule):
        if kwargs:
            raise ValueError(f"got a schedule instance {name_or_schedule!r} and extra arguments {sorted(kwargs)}")
        return name_or_schedule
    if isinstance(name_or_schedule, str):
        cls = SCHEDULES.get(name_or_schedule.lower())
        if cls is None:
            allowed = ", ".join(repr(name) for name in SCHEDULES)
            raise ValueError(f"unknown schedule {name_or_schedule!r}; allowed: {allowed}")
        return cls(**kwargs)
    if callable(name_or_schedule):
        return FromCallable(name_or_schedule, **kwargs)
    raise ValueError(
        f"name_or_schedule={name_or_schedule!r} must be a schedule name, a Schedule or a callable (time -> sparsity)"
    )
