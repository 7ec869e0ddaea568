"""Tests of lightprune.schedules: golden values, events, fraction resolution, validation and properties."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightprune.schedules import (
    SCHEDULES,
    Constant,
    Cubic,
    FromCallable,
    Geometric,
    Linear,
    Points,
    Schedule,
    make_schedule,
)

# ----------------------------------------------------------------------------------------------------------------------
# Golden values (computed by hand)
# ----------------------------------------------------------------------------------------------------------------------


def test_constant_golden() -> None:
    schedule = Constant(0.7, at=5)
    assert schedule.events() == [5]
    assert schedule.first_event == schedule.last_event == 5
    assert schedule.final_sparsity == 0.7
    # Nothing is pruned before the single event, then the target holds forever.
    assert [schedule(t) for t in (0, 4, 4.99, 5, 5.5, 6, 10**9)] == [0.0, 0.0, 0.0, 0.7, 0.7, 0.7, 0.7]
    assert [t for t in range(10) if schedule.is_event(t)] == [5]


def test_constant_default_is_one_shot_at_zero() -> None:
    schedule = Constant(0.5)
    assert schedule.events() == [0]
    assert schedule(-1) == 0.0
    assert schedule(0) == 0.5


def test_linear_golden() -> None:
    schedule = Linear(initial=0.2, final=0.8, start=10, end=40, frequency=10)
    assert schedule.events() == [10, 20, 30, 40]
    # s(t) = 0.2 + (0.8 - 0.2) * (t - 10) / 30 at the events:
    #   t=10 -> 0.2; t=20 -> 0.2 + 0.6 * 10/30 = 0.4; t=30 -> 0.2 + 0.6 * 20/30 = 0.6; t=40 -> 0.8
    expected = {9: 0.0, 10: 0.2, 19: 0.2, 20: 0.4, 25: 0.4, 30: 0.6, 39.9: 0.6, 40: 0.8, 1000: 0.8}
    for t, value in expected.items():
        assert schedule(t) == pytest.approx(value, abs=1e-12), t
    assert schedule(10) == 0.2  # exactly initial at start
    assert schedule(40) == 0.8  # exactly final at end
    assert schedule.final_sparsity == 0.8
    assert (schedule.first_event, schedule.last_event) == (10, 40)


def test_linear_end_not_on_the_grid_is_an_event() -> None:
    schedule = Linear(final=0.5, start=0, end=10, frequency=4)
    # Grid 0, 4, 8 below end, then end=10 itself.
    assert schedule.events() == [0, 4, 8, 10]
    # s = 0.5 * t / 10: t=4 -> 0.2, t=8 -> 0.4, t=10 -> 0.5
    assert [schedule(t) for t in (0, 4, 8, 9, 10)] == pytest.approx([0.0, 0.2, 0.4, 0.4, 0.5], abs=1e-12)
    assert schedule(10) == 0.5


def test_cubic_golden() -> None:
    schedule = Cubic(final=0.9, start=0, end=100, frequency=25)
    assert schedule.events() == [0, 25, 50, 75, 100]
    # s(t) = 0.9 + (0 - 0.9) * (1 - t/100)^3:
    #   t=25: 0.9 * (1 - 0.75^3)  = 0.9 * (1 - 0.421875) = 0.9 * 0.578125 = 0.5203125
    #   t=50: 0.9 * (1 - 0.5^3)   = 0.9 * 0.875                           = 0.7875
    #   t=75: 0.9 * (1 - 0.25^3)  = 0.9 * 0.984375                        = 0.8859375
    expected = {0: 0.0, 24: 0.0, 25: 0.5203125, 50: 0.7875, 74: 0.7875, 75: 0.8859375, 100: 0.9, 101: 0.9}
    for t, value in expected.items():
        assert schedule(t) == pytest.approx(value, abs=1e-12), t
    assert schedule(100) == 0.9


def test_cubic_with_initial_and_offset() -> None:
    schedule = Cubic(initial=0.5, final=0.9, start=100, end=200, frequency=50)
    assert schedule.events() == [100, 150, 200]
    # t=150: 0.9 + (0.5 - 0.9) * (1 - 50/100)^3 = 0.9 - 0.4 * 0.125 = 0.85
    assert schedule(99) == 0.0
    assert schedule(100) == 0.5
    assert schedule(150) == pytest.approx(0.85, abs=1e-12)
    assert schedule(200) == 0.9


def test_cubic_end_not_on_the_grid_is_an_event() -> None:
    schedule = Cubic(final=0.8, start=0, end=10, frequency=4)
    assert schedule.events() == [0, 4, 8, 10]
    # t=4: 0.8 * (1 - 0.6^3) = 0.8 * 0.784 = 0.6272; t=8: 0.8 * (1 - 0.2^3) = 0.8 * 0.992 = 0.7936
    assert [schedule(t) for t in (4, 8)] == pytest.approx([0.6272, 0.7936], abs=1e-12)
    assert schedule(10) == 0.8
    assert schedule.last_event == 10


def test_geometric_rounds_golden() -> None:
    schedule = Geometric(0.5, rounds=3)
    assert schedule.events() == [0, 1, 2]
    # 1 - 0.5^1 = 0.5; 1 - 0.5^2 = 0.75; 1 - 0.5^3 = 0.875
    assert [schedule(t) for t in (-1, 0, 1, 2, 3, 100)] == [0.0, 0.5, 0.75, 0.875, 0.875, 0.875]
    assert schedule.final_sparsity == 0.875
    assert schedule.num_events == 3


def test_geometric_end_golden() -> None:
    schedule = Geometric(0.2, start=1, frequency=2, end=6)
    # Grid 1, 3, 5; 7 > end. The last event is 5, not 6.
    assert schedule.events() == [1, 3, 5]
    assert schedule.last_event == 5
    assert not schedule.is_event(6)
    # 1 - 0.8 = 0.2; 1 - 0.8^2 = 0.36; 1 - 0.8^3 = 1 - 0.512 = 0.488
    assert [schedule(t) for t in (0, 1, 2, 3, 5, 6, 50)] == pytest.approx([0.0, 0.2, 0.2, 0.36, 0.488, 0.488, 0.488])


def test_geometric_end_on_the_grid() -> None:
    assert Geometric(0.5, start=0, frequency=5, end=10).events() == [0, 5, 10]


def test_points_golden() -> None:
    schedule = Points([(30, 0.9), (0, 0.1), (10, 0.5), (20, 0.5)])
    assert schedule.points == [(0, 0.1), (10, 0.5), (20, 0.5), (30, 0.9)]
    assert schedule.events() == [0, 10, 20, 30]
    expected = {-1: 0.0, 0: 0.1, 9: 0.1, 10: 0.5, 20: 0.5, 29.5: 0.5, 30: 0.9, 31: 0.9}
    assert {t: schedule(t) for t in expected} == expected
    assert (schedule.first_event, schedule.last_event, schedule.final_sparsity) == (0, 30, 0.9)


def test_points_accept_lists_of_lists() -> None:
    # What a YAML/Hydra config provides.
    assert Points([[0, 0.25], [4, 0.5]]).points == [(0, 0.25), (4, 0.5)]


def test_points_accept_a_mapping_of_times_to_sparsities() -> None:
    # The "milestones" form, {time: sparsity}, as Python and YAML mappings write it; checked as pairs are.
    assert Points({4: 0.5, 0: 0.25}).points == [(0, 0.25), (4, 0.5)]
    assert Points({0.5: 0.5, 0.0: 0.25}).points == [(0.0, 0.25), (0.5, 0.5)]
    with pytest.raises(ValueError, match="must not decrease over time"):
        Points({0: 0.5, 4: 0.25})


def test_from_callable_golden() -> None:
    schedule = FromCallable(lambda t: t / 100, start=10, end=50, frequency=20)
    assert schedule.events() == [10, 30, 50]
    # fn is sampled at the latest event: fn(10) = 0.1, fn(30) = 0.3, fn(50) = 0.5
    assert [schedule(t) for t in (9, 10, 29, 30, 35, 50, 60)] == [0.0, 0.1, 0.1, 0.3, 0.3, 0.5, 0.5]
    assert schedule.final_sparsity == 0.5
    schedule.validate()


def test_from_callable_receives_event_times() -> None:
    seen = []

    def fn(t: int) -> float:
        seen.append(t)
        return 0.5

    FromCallable(fn, start=0, end=10, frequency=5).target(7)
    assert set(seen) <= {0, 5}
    assert 5 in seen


def test_from_callable_out_of_range_raises_at_query() -> None:
    schedule = FromCallable(lambda t: 2.0, end=10)
    with pytest.raises(ValueError, match=r"fn\(0\)=2.0 must be in \[0, 1\]"):
        schedule.target(0)


def test_from_callable_decrease_raises_at_query() -> None:
    schedule = FromCallable(lambda t: 0.5 if t < 4 else 0.25, end=8, frequency=2)
    assert schedule(2) == 0.5
    with pytest.raises(ValueError, match=r"fn\(4\)=0.25 is lower than fn\(2\)=0.5 at the previous event"):
        schedule.target(4)
    with pytest.raises(ValueError, match="must never decrease"):
        schedule.validate()


def test_call_is_target() -> None:
    schedule = Cubic(final=0.5, end=10)
    assert all(schedule(t) == schedule.target(t) for t in range(-2, 13))


def test_is_event_rejects_non_integer_times() -> None:
    schedule = Linear(final=0.5, end=10)
    assert schedule.is_event(3)
    assert schedule.is_event(3.0)
    assert not schedule.is_event(3.5)
    assert not schedule.is_event(-1)
    assert not schedule.is_event(11)


# ----------------------------------------------------------------------------------------------------------------------
# Fractions of the run
# ----------------------------------------------------------------------------------------------------------------------


def test_resolve_fractions() -> None:
    schedule = Cubic(final=0.9, start=0.1, end=0.75, frequency=0.05)
    assert not schedule.is_resolved
    resolved = schedule.resolve(1000)
    assert resolved.is_resolved
    # 0.1 * 1000 = 100, 0.75 * 1000 = 750, 0.05 * 1000 = 50
    assert resolved == Cubic(final=0.9, start=100, end=750, frequency=50)
    assert schedule.start == 0.1  # the original is unchanged


def test_resolve_end_one_is_the_last_tick() -> None:
    # The clock runs over 0 .. total - 1, so 1.0 -> min(round(1.0 * 10), 9) = 9.
    assert Constant(0.5, at=1.0).resolve(10).at == 9
    assert Linear(final=0.5, end=1.0).resolve(10).end == 9
    assert Constant(0.5, at=0.0).resolve(10).at == 0


def test_resolve_rounds_half_up() -> None:
    # 0.25 * 10 = 2.5 -> 3 (half up, not half to even which gives 2); 0.35 * 10 = 3.5 -> 4
    assert Linear(final=0.5, start=0.25, end=1.0).resolve(10).start == 3
    assert Linear(final=0.5, start=0.35, end=1.0).resolve(10).start == 4
    # 0.29 * 100 = 28.999999999999996 in floats; rounding (not flooring) gives 29
    assert Linear(final=0.5, start=0.29, end=1.0).resolve(100).start == 29


def test_resolve_frequency_is_at_least_one() -> None:
    # 0.001 * 10 = 0.01 -> rounds to 0 -> clamped to 1
    assert Linear(final=0.5, end=1.0, frequency=0.001).resolve(10).frequency == 1
    # 0.1 * 95 = 9.5 -> 10
    assert Linear(final=0.5, end=1.0, frequency=0.1).resolve(95).frequency == 10


def test_resolve_mixed_int_and_fraction() -> None:
    resolved = Linear(final=0.5, start=5, end=0.5).resolve(100)
    assert (resolved.start, resolved.end) == (5, 50)


def test_resolve_keeps_ints_and_returns_a_copy() -> None:
    schedule = Linear(final=0.5, start=5, end=500)
    resolved = schedule.resolve(10)
    assert resolved == schedule
    assert resolved is not schedule
    assert resolved.end == 500  # ints are not clipped to the run


def test_resolve_points() -> None:
    schedule = Points([(0.0, 0.1), (0.5, 0.5), (1.0, 0.9)])
    assert not schedule.is_resolved
    # 0.0 -> 0; 0.5 * 11 = 5.5 -> 6; 1.0 * 11 = 11 -> clipped to 10
    assert schedule.resolve(11).points == [(0, 0.1), (6, 0.5), (10, 0.9)]


def test_resolve_geometric_every_epoch_until_the_end() -> None:
    resolved = Geometric(0.5, end=1.0).resolve(5)
    assert resolved.events() == [0, 1, 2, 3, 4]
    assert resolved.final_sparsity == 1 - 0.5**5


def test_unresolved_queries_raise() -> None:
    schedule = Linear(final=0.5, end=1.0)
    for query in (
        lambda: schedule.target(0),
        lambda: schedule(0),
        lambda: schedule.is_event(0),
        lambda: schedule.latest_event(0),
        schedule.events,
        lambda: schedule.final_sparsity,
        lambda: schedule.first_event,
        lambda: schedule.last_event,
    ):
        with pytest.raises(RuntimeError, match=r"fractions of the run; call `.resolve\(total\)`"):
            query()
    with pytest.raises(RuntimeError, match="resolve"):
        Points([(0.5, 0.5)]).events()
    with pytest.raises(RuntimeError, match="resolve"):
        Constant(0.5, at=0.5).target(0)


def test_resolve_errors() -> None:
    with pytest.raises(ValueError, match=r"total=0 must be an int >= 1"):
        Linear(final=0.5, end=1.0).resolve(0)
    with pytest.raises(ValueError, match=r"total=10.0 must be an int >= 1"):
        Linear(final=0.5, end=1.0).resolve(10.0)  # type: ignore[arg-type]
    # 0.9 * 5 = 4.5 -> 5 -> clipped to 4; 1.0 -> 4: start == end
    with pytest.raises(
        ValueError, match=r"start=4 must be < end=4 \(after resolving fractions of the run with total=5\)"
    ):
        Linear(final=0.5, start=0.9, end=1.0).resolve(5)
    with pytest.raises(ValueError, match=r"start=50 must be < end=50 \(after resolving .* total=100\)"):
        Linear(final=0.5, start=50, end=0.5).resolve(100)
    # 0.5 * 10 = 5 and 0.54 * 10 = 5.4 -> 5
    with pytest.raises(ValueError, match=r"got time 5 twice \(after resolving .* total=10\)"):
        Points([(0.5, 0.1), (0.54, 0.2)]).resolve(10)


# ----------------------------------------------------------------------------------------------------------------------
# Validation messages
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: Linear(final=1.3, end=10), r"^final=1.3 must be in \[0, 1\]$"),
        (lambda: Linear(initial=-0.1, final=0.5, end=10), r"^initial=-0.1 must be in \[0, 1\]$"),
        (lambda: Cubic(final=float("nan"), end=10), r"^final=nan must be in \[0, 1\]$"),
        (lambda: Cubic(final="0.5", end=10), r"^final='0.5' must be in \[0, 1\]$"),
        (lambda: Cubic(initial=0.6, final=0.5, end=10), r"initial=0.6 must be <= final=0.5: .* never decrease"),
        (lambda: Linear(final=0.5, start=10, end=10), r"^start=10 must be < end=10$"),
        (lambda: Linear(final=0.5, start=0.5, end=0.25), r"^start=0.5 must be < end=0.25$"),
        (lambda: Linear(final=0.5, start=-1, end=10), r"^start=-1 must be an int >= 0 .* or a float in \[0, 1\]"),
        (lambda: Linear(final=0.5, end=100.0), r"^end=100.0 must be an int >= 0 .* or a float in \[0, 1\]"),
        (lambda: Linear(final=0.5, start=True, end=10), r"^start=True must be an int >= 0"),
        (lambda: Cubic(final=0.5, end=10, frequency=0), r"^frequency=0 must be an int >= 1 .* float in \(0, 1\]"),
        (lambda: Cubic(final=0.5, end=10, frequency=0.0), r"^frequency=0.0 must be an int >= 1"),
        (lambda: Cubic(final=0.5, end=10, frequency=1.5), r"^frequency=1.5 must be an int >= 1"),
        (lambda: Constant(1.5), r"^sparsity=1.5 must be in \[0, 1\]$"),
        (lambda: Constant(0.5, at=-3), r"^at=-3 must be an int >= 0"),
        (lambda: Geometric(1.5, rounds=2), r"^fraction=1.5 must be in \[0, 1\]$"),
        (lambda: Geometric(0.5), r"^give exactly one of rounds or end, got rounds=None and end=None$"),
        (lambda: Geometric(0.5, rounds=2, end=5), r"^give exactly one of rounds or end, got rounds=2 and end=5$"),
        (lambda: Geometric(0.5, rounds=0), r"^rounds=0 must be an int >= 1$"),
        (lambda: Geometric(0.5, rounds=0.5), r"^rounds=0.5 must be an int >= 1$"),
        (lambda: Geometric(0.5, start=5, end=2), r"^end=2 must be >= start=5$"),
        (lambda: Geometric(0.5, frequency=0, rounds=2), r"^frequency=0 must be an int >= 1"),
        (lambda: Points([]), r"^points must contain at least one \(time, sparsity\) pair$"),
        (lambda: Points([(0, 0.5), (10, 0.25)]), r"must not decrease over time: 0.5 at time 0 .* 0.25 at time 10$"),
        (lambda: Points([(0, 0.1), (0, 0.2)]), r"^points times must be distinct, got time 0 twice$"),
        (lambda: Points([(0, 0.1), (0.5, 0.2)]), r"^points times must be all ints .* or all floats .* \[0, 0.5\]$"),
        (lambda: Points([(0, 0.1, 3)]), r"^points\[0\]=\(0, 0.1, 3\) must be a \(time, sparsity\) pair$"),
        (lambda: Points([(0, 0.1), (5, 1.5)]), r"^points\[1\] sparsity=1.5 must be in \[0, 1\]$"),
        (lambda: Points([(-5, 0.1)]), r"^points\[0\] time=-5 must be an int >= 0"),
        (lambda: FromCallable(0.5, end=10), r"^fn=0.5 must be callable"),
        (lambda: FromCallable(lambda t: 0.5, start=6, end=5), r"^start=6 must be <= end=5$"),  # equal: one event
    ],
)
def test_validation_messages(build, message) -> None:
    with pytest.raises(ValueError, match=message):
        build()


# ----------------------------------------------------------------------------------------------------------------------
# Registry
# ----------------------------------------------------------------------------------------------------------------------


def test_registry_names() -> None:
    assert list(SCHEDULES) == ["constant", "linear", "cubic", "geometric", "points"]
    assert [SCHEDULES[name] for name in SCHEDULES] == [Constant, Linear, Cubic, Geometric, Points]


def test_make_schedule_by_name() -> None:
    assert make_schedule("cubic", final=0.9, end=100, frequency=10) == Cubic(final=0.9, end=100, frequency=10)
    assert make_schedule("Linear", final=0.5, end=10) == Linear(final=0.5, end=10)
    assert make_schedule("points", points=[[0, 0.5]]) == Points([(0, 0.5)])
    assert make_schedule("geometric", fraction=0.2, rounds=5) == Geometric(0.2, rounds=5)
    assert make_schedule("constant", sparsity=0.3, at=2) == Constant(0.3, at=2)


def test_make_schedule_passes_instances_and_wraps_callables() -> None:
    schedule = Constant(0.5)
    assert make_schedule(schedule) is schedule
    wrapped = make_schedule(lambda t: 0.25, end=10, frequency=5)
    assert isinstance(wrapped, FromCallable)
    assert wrapped.events() == [0, 5, 10]


def test_make_schedule_errors() -> None:
    with pytest.raises(
        ValueError, match=r"^unknown schedule 'cosine'; allowed: 'constant', 'linear', 'cubic', 'geometric', 'points'$"
    ):
        make_schedule("cosine")
    with pytest.raises(ValueError, match=r"got a schedule instance Constant\(sparsity=0.5, at=0\) and extra arguments"):
        make_schedule(Constant(0.5), at=3)
    with pytest.raises(ValueError, match=r"name_or_schedule=3 must be a schedule name, a Schedule or a callable"):
        make_schedule(3)  # type: ignore[arg-type]


def test_repr_and_equality() -> None:
    assert repr(Linear(final=0.5, end=10)) == "Linear(initial=0.0, final=0.5, start=0, end=10, frequency=1)"
    assert repr(Geometric(0.5, rounds=2)) == "Geometric(fraction=0.5, start=0, frequency=1, rounds=2, end=None)"
    assert repr(Points([(1, 0.5)])) == "Points(points=[(1, 0.5)])"
    assert Linear(final=0.5, end=10) != Cubic(final=0.5, end=10)
    assert Linear(final=0.5, end=10) != Linear(final=0.5, end=11)
    # an int time is a step (or epoch), a float one a fraction of the run: they fire at different steps
    assert Constant(0.5, at=1) != Constant(0.5, at=1.0) and Linear(final=0.5, end=1) != Linear(final=0.5, end=1.0)
    assert Constant(1, at=2) == Constant(1.0, at=2)  # a sparsity is a number either way


def test_points_equality_tells_steps_from_fractions() -> None:
    # Points keeps its times inside ``points``: step 1 and 1.0 (the end of the run) must differ there too
    steps, fractions = Points([(1, 0.5)]), Points([(1.0, 0.5)])
    assert steps.resolve(100).events() != fractions.resolve(100).events()
    assert steps != fractions and fractions != steps
    assert Points([(0, 0.1), (1, 0.5)]) != Points([(0.0, 0.1), (1.0, 0.5)])
    assert Points([(1, 0.5), (2, 1)]) == Points([(1, 0.5), (2, 1.0)])  # a sparsity is a number either way
    assert Points([(0.5, 0.5)]) == Points([(0.5, 0.5)]) and Points([(1, 0.5)]) == Points([(1, 0.5)])


# ----------------------------------------------------------------------------------------------------------------------
# Properties
# ----------------------------------------------------------------------------------------------------------------------

sparsities = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)


@st.composite
def ramps(draw: st.DrawFn) -> Schedule:
    cls = draw(st.sampled_from([Linear, Cubic]))
    initial, final = sorted((draw(sparsities), draw(sparsities)))
    start = draw(st.integers(0, 300))
    end = draw(st.integers(start + 1, start + 300))
    frequency = draw(st.integers(1, 400))
    return cls(initial=initial, final=final, start=start, end=end, frequency=frequency)


@st.composite
def geometrics(draw: st.DrawFn) -> Schedule:
    fraction = draw(sparsities)
    start = draw(st.integers(0, 300))
    frequency = draw(st.integers(1, 50))
    if draw(st.booleans()):
        return Geometric(fraction, start=start, frequency=frequency, rounds=draw(st.integers(1, 40)))
    return Geometric(fraction, start=start, frequency=frequency, end=draw(st.integers(start, start + 300)))


@st.composite
def points(draw: st.DrawFn) -> Schedule:
    times = draw(st.lists(st.integers(0, 600), min_size=1, max_size=20, unique=True))
    levels = sorted(draw(st.lists(sparsities, min_size=len(times), max_size=len(times))))
    return Points(list(zip(sorted(times), levels, strict=True)))


@st.composite
def constants(draw: st.DrawFn) -> Schedule:
    return Constant(draw(sparsities), at=draw(st.integers(0, 600)))


any_schedule = st.one_of(ramps(), geometrics(), points(), constants())
times = st.lists(st.floats(min_value=-10, max_value=1000, allow_nan=False), min_size=1, max_size=50)


@settings(max_examples=300)
@given(schedule=any_schedule, ts=times)
def test_targets_are_in_unit_interval_and_non_decreasing(schedule: Schedule, ts: list[float]) -> None:
    values = [schedule(t) for t in sorted(ts)]
    assert all(0.0 <= value <= 1.0 for value in values)
    assert all(a <= b for a, b in itertools.pairwise(values))


@settings(max_examples=300)
@given(schedule=any_schedule, offset=st.floats(min_value=0, max_value=1e6, allow_nan=False))
def test_zero_before_first_event_and_final_from_last_event_on(schedule: Schedule, offset: float) -> None:
    events = schedule.events()
    assert events == sorted(set(events))
    assert (schedule.first_event, schedule.last_event) == (events[0], events[-1])
    assert schedule(schedule.first_event - 0.5) == 0.0
    assert schedule(schedule.last_event + offset) == schedule.final_sparsity


@settings(max_examples=300)
@given(schedule=ramps(), offset=st.floats(min_value=0, max_value=1e6, allow_nan=False))
def test_ramps_start_at_initial_and_end_at_final(schedule: Linear | Cubic, offset: float) -> None:
    assert schedule(schedule.start) == schedule.initial
    assert schedule(schedule.end + offset) == schedule.final
    assert schedule.final_sparsity == schedule.final
    assert schedule.is_event(schedule.start)
    assert schedule.is_event(schedule.end)


@settings(max_examples=200)
@given(schedule=any_schedule)
def test_target_is_a_step_function_through_the_events(schedule: Schedule) -> None:
    events = schedule.events()
    event_set = set(events)
    for t in range(events[0] - 2, events[-1] + 3):
        assert schedule.is_event(t) == (t in event_set)
    for previous, event in itertools.pairwise(events):
        # Constant between events, at the level of the earlier one.
        assert schedule(event - 0.5) == schedule(previous)
        assert schedule(event - 1) == schedule(previous)


@settings(max_examples=200)
@given(schedule=any_schedule, t=st.floats(min_value=-10, max_value=1e9, allow_nan=False))
def test_latest_event_agrees_with_events(schedule: Schedule, t: float) -> None:
    earlier = [event for event in schedule.events() if event <= t]
    assert schedule.latest_event(t) == (earlier[-1] if earlier else None)
    assert schedule(t) == (schedule(earlier[-1]) if earlier else 0.0)


@settings(max_examples=200)
@given(fraction=sparsities, rounds=st.integers(1, 60))
def test_geometric_matches_closed_form(fraction: float, rounds: int) -> None:
    schedule = Geometric(fraction, rounds=rounds)
    for j, event in enumerate(schedule.events(), start=1):
        assert schedule(event) == pytest.approx(1 - (1 - fraction) ** j)


@settings(max_examples=300)
@given(
    start=st.floats(min_value=0, max_value=1),
    end=st.floats(min_value=0, max_value=1),
    frequency=st.floats(min_value=1e-6, max_value=1),
    total=st.integers(1, 10**6),
)
def test_resolved_fractions_fall_inside_the_run(start: float, end: float, frequency: float, total: int) -> None:
    if not start < end:
        return
    try:
        resolved = Cubic(final=0.5, start=start, end=end, frequency=frequency).resolve(total)
    except ValueError as err:
        # Only a collapse of start and end after rounding is allowed to fail.
        assert f"total={total}" in str(err)
        return
    assert 0 <= resolved.start < resolved.end <= total - 1
    assert resolved.frequency >= 1
    assert abs(resolved.end - end * total) <= 1
    assert abs(resolved.start - start * total) <= 0.5 + 1e-9 or resolved.start == total - 1
    assert math.isclose(resolved(resolved.end), 0.5)


def test_a_callable_schedule_on_a_run_of_one_unit_has_its_one_event() -> None:
    """The callback wraps a callable as FromCallable(start=0, end=1.0): on a one-step (or one-epoch) run end
    resolves to 0, which was refused with 'start=0 must be < end=0', arguments the user never gave."""
    schedule = FromCallable(lambda t: 0.25 + t / 10, end=1.0).resolve(1)
    assert (schedule.events(), schedule.target(0), schedule.final_sparsity) == ([0], 0.25, 0.25)
    assert FromCallable(lambda t: 0.5, start=3, end=3).events() == [3]
    with pytest.raises(ValueError, match="start=0 must be < end=0"):  # a ramp of one event is a mistake
        Linear(final=0.5, end=1.0).resolve(1)


class Stepped(Points):
    """A schedule of a user's own: its levels come from ``_level``, which lightprune's constructors never saw."""

    def __init__(self, levels: dict[int, object]) -> None:
        super().__init__({event: 0.0 for event in levels})
        self.levels = levels

    def _level(self, event: int) -> float:
        return self.levels[event]  # type: ignore[return-value]


@pytest.mark.parametrize(
    ("levels", "message"),
    [
        ({0: 0.6, 4: 0.3}, r"Stepped: its level at event 4 \(0\.3\) is lower than at event 0 \(0\.6\)"),
        ({0: 0.3, 4: 1.5}, r"Stepped: its level at event 4 is 1\.5; levels are numbers in \[0, 1\]"),
        ({0: 0.3, 4: float("nan")}, r"its level at event 4 is nan"),
        ({0: 0.3, 4: torch.tensor(0.5)}, r"its level at event 4 is tensor\(0\.5000\)"),
    ],
)
def test_a_schedule_subclass_has_its_levels_checked(levels: dict[int, object], message: str) -> None:
    """Only callables had their levels checked: a subclass decreasing ended at its old level (0.6 for a final 0.3),
    one above 1 pruned every weight, NaN failed mid-training."""
    with pytest.raises(ValueError, match=message):
        Stepped(levels).validate()
    Stepped({0: 0.3, 4: 0.5}).validate()
    Points({0: 0.3, 4: 0.5}).validate()  # (built-ins checked their levels when built)
