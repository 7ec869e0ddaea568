"""Plots of the experiment app: one run's curves and layers, and accuracy against sparsity over a sweep.

* :func:`read_metrics_csv` - Lightning ``CSVLogger``'s ``metrics.csv`` as ``{column: [(step, value), ...]}``.
* :func:`plot_training_curves` - sparsity and accuracy over training steps, phases and pruning events marked.
* :func:`plot_layer_sparsity` - per-layer sparsity bars (channels kept, for structured pruning).
* :func:`plot_mask_movement` - dynamic sparse training: the share of each layer's active weights regrown at each
  mask update, beside the planned (cosine-decayed) share.
* :func:`plot_accuracy_vs_sparsity` - final accuracy against weights kept, one line per arm of a sweep, mean and
  standard deviation over seeds, the dense accuracy as a reference.
* :func:`plot_pareto` - the same axes for a search (Optuna): every trial a point, the Pareto front marked.

Every colour means one thing within a figure. Plots are drawn on ``matplotlib.figure.Figure`` objects directly (no
``pyplot``), so no display is needed, no global backend is switched and no figure is left open; each function returns
the figure's path, and the ``draw_*`` functions the figure itself (what the tests inspect).
"""

from __future__ import annotations

import csv
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "Arm",
    "draw_accuracy_vs_sparsity",
    "draw_layer_sparsity",
    "draw_mask_movement",
    "draw_pareto",
    "draw_training_curves",
    "has_mask_movement",
    "plot_accuracy_vs_sparsity",
    "plot_layer_sparsity",
    "plot_mask_movement",
    "plot_pareto",
    "plot_training_curves",
    "read_metrics_csv",
    "read_phases",
]

# One meaning per colour: the pruning schedule is red, the total sparsity black, accuracies grey (train), blue (val)
# and orange (test); layers take the remaining colours, with line styles when there are more layers than colours.
TARGET_COLOR = "tab:red"
TOTAL_COLOR = "black"
TRAIN_COLOR = "tab:gray"
VAL_COLOR = "tab:blue"
TEST_COLOR = "tab:orange"
LAYER_COLORS = ("tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan")
LAYER_STYLES = ("-", "--", "-.", ":")
PHASE_COLOR = "0.35"
DENSE_SHADE = "0.93"

_ACC_COLUMN = re.compile(r"^(train|val|test)/acc(_step|_epoch)?$")
_LAYER_PREFIX = "pruning/sparsity/"
_REGROWN_PREFIX = "pruning/regrown/"
_REGROWN_PLAN = "pruning/regrown/fraction"
_EVENT_LINES_UP_TO = 5
"""Up to this many pruning events are also drawn as lines across the accuracy panel."""


# --------------------------------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------------------------------


def _read(metrics_csv: str | Path) -> tuple[dict[str, list[tuple[float, float]]], dict[str, list[float]]]:
    """Series by column and ``{phase: [first step, last step]}`` (from a ``phase`` column; empty without one)."""
    series: dict[str, list[tuple[float, float]]] = {}
    phases: dict[str, list[float]] = {}
    offset = previous = phase_largest = largest = 0.0
    with Path(metrics_csv).open(newline="") as handle:
        for index, row in enumerate(csv.DictReader(handle)):
            step_text = row.get("step") or ""
            raw_step = float(step_text) if step_text else float(index)
            if raw_step < previous - 2 and raw_step <= phase_largest / 2:  # a new phase, not logging jitter
                offset = largest
                phase_largest = 0.0
            previous = raw_step
            phase_largest = max(phase_largest, raw_step)
            step = raw_step + offset
            largest = max(largest, step)
            phase = row.get("phase")
            if phase:
                span = phases.setdefault(phase, [step, step])
                span[0], span[1] = min(span[0], step), max(span[1], step)
            for key, text in row.items():
                if key in (None, "step", "phase") or not text:
                    continue
                try:
                    value = float(text)
                except ValueError:
                    continue
                series.setdefault(key, []).append((step, value))
    for points in series.values():
        points.sort(key=lambda point: point[0])  # stable: rows of one step keep their order
    return series, phases


def read_metrics_csv(metrics_csv: str | Path) -> dict[str, list[tuple[float, float]]]:
    """Reads Lightning ``CSVLogger``'s ``metrics.csv`` into ``{column: [(step, value), ...]}``.

    Empty cells (a key not logged at that row) are skipped; a file without a ``step`` column uses the row index.
    Each series is sorted by step (loggers interleave rows a step or two apart). When the step falls back to at most
    half of the largest step so far (a second ``Trainer``, e.g. for fine-tuning, logging to the same logger), the
    later rows are shifted by that largest step (the new phase's step 0 is the old phase's last step), so phases are
    laid end to end. The app's ``phase`` column (``logs/all_phases.csv``) is read by :func:`read_phases`.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     path = Path(tmp) / "metrics.csv"
        ...     _ = path.write_text("epoch,step,train/loss,val/acc\\n0,9,0.5,\\n0,9,,0.8\\n")
        ...     read_metrics_csv(path)
        {'epoch': [(9.0, 0.0), (9.0, 0.0)], 'train/loss': [(9.0, 0.5)], 'val/acc': [(9.0, 0.8)]}
    """
    return _read(metrics_csv)[0]


def read_phases(metrics_csv: str | Path) -> list[tuple[str, float, float]]:
    """The phases of an app run's ``logs/all_phases.csv`` as ``(name, start step, end step)``, in order.

    A phase starts where the previous one ended (its last logged step: the test at the end of its fit) and the
    first at step 0. A file without a ``phase`` column has no phases.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     path = Path(tmp) / "all_phases.csv"
        ...     _ = path.write_text("phase,step,train/acc\\ndense,4,0.5\\ndense,10,\\nprune,14,0.9\\nprune,20,\\n")
        ...     read_phases(path)
        [('dense', 0.0, 10.0), ('prune', 10.0, 20.0)]
    """
    spans = _read(metrics_csv)[1]
    phases = []
    start = 0.0
    for name, (_, last) in spans.items():
        phases.append((name, start, last))
        start = last
    return phases


# --------------------------------------------------------------------------------------------------------------------
# Training curves
# --------------------------------------------------------------------------------------------------------------------


def _note(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4")


def _lone_point(steps: Sequence[float]) -> dict[str, Any]:
    """A marker for a series of a single point, which a line alone would not show."""
    return {"marker": "o", "markersize": 4} if len(steps) == 1 else {}


def _pruning_events(series: Mapping[str, list[tuple[float, float]]]) -> list[float]:
    """Steps at which the pruning target changed (from 0 before the first event): one per pruning event."""
    events = []
    previous = 0.0
    for step, value in series.get("pruning/target", []):
        if not math.isclose(value, previous, abs_tol=1e-12):
            events.append(step)
        previous = value
    return events


def _phase_label(name: str, pruned: bool) -> str:
    if name == "dense":
        return "dense"
    if name.startswith("round_"):
        return "round " + name.removeprefix("round_")
    return "pruning + fine-tuning" if pruned else "fine-tuning (no pruning)"


def _short_names(keys: Sequence[str]) -> dict[str, str]:
    """Layer names for the legend: the column without ``pruning/sparsity/`` and a prefix every name shares."""
    names = {key: key.removeprefix(_LAYER_PREFIX) for key in keys}
    while names and len({n.partition(".")[0] for n in names.values()}) == 1 and all("." in n for n in names.values()):
        stripped = {key: n.partition(".")[2] for key, n in names.items()}
        if any("." not in n for n in stripped.values()):  # keep "fc1.weight" rather than "weight"
            break
        names = stripped
    return names


_SAME_CURVE_TOLERANCE = 0.004
"""Curves closer than this everywhere (under a pixel at the figure's size) would hide each other: they share a line."""


def _curve_gap(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]) -> float:
    """Largest difference between two curves logged at the same steps (``inf`` when their steps differ)."""
    if len(a) != len(b) or any(sa != sb for (sa, _), (sb, _) in zip(a, b, strict=True)):
        return math.inf
    return max((abs(va - vb) for (_, va), (_, vb) in zip(a, b, strict=True)), default=0.0)


def _same_curve(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]) -> bool:
    return _curve_gap(a, b) <= _SAME_CURVE_TOLERANCE


def _group_label(names: Sequence[str], series: Mapping[str, Any], keys: Sequence[str]) -> str:
    """``fc1.weight`` for one layer; ``fc1.weight = fc2.weight`` (``≈`` when not exactly equal) for a shared line."""
    exact = all(_curve_gap(series[keys[0]], series[key]) <= 1e-9 for key in keys[1:])
    return f" {'=' if exact else '≈'} ".join(names)


def _draw_phases(axes: Sequence[Any], phases: Sequence[tuple[str, float, float]], pruned: bool) -> None:
    """Shade the dense phase, draw a line where each later phase starts and name the phases above the top panel."""
    if len(phases) < 2:
        return
    top = axes[0]
    for ax in axes:
        for index, (name, start, end) in enumerate(phases):
            if name == "dense":
                ax.axvspan(start, end, color=DENSE_SHADE, zorder=0, linewidth=0)
            if index > 0:
                ax.axvline(start, color=PHASE_COLOR, linewidth=1.0, zorder=1, gid="phase-boundary")
    for name, start, end in phases:
        top.annotate(
            _phase_label(name, pruned),
            xy=((start + end) / 2, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(0, 3),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize="small",
            color=PHASE_COLOR,
        )


def _draw_sparsity(ax: Any, series: Mapping[str, list[tuple[float, float]]], events: Sequence[float]) -> None:
    layer_keys = [k for k in series if k.startswith(_LAYER_PREFIX) and k != _LAYER_PREFIX + "total"]
    names = _short_names(layer_keys)
    total = series.get(_LAYER_PREFIX + "total")
    # layers whose curve equals the total's, or another layer's, share one line and one legend entry
    groups: list[list[str]] = []
    on_total = []
    exact = True
    for key in layer_keys:
        if total is not None and _same_curve(series[key], total):
            on_total.append(names[key])
            exact = exact and _curve_gap(series[key], total) <= 1e-9
            continue
        for group in groups:
            if _same_curve(series[group[0]], series[key]):
                group.append(key)
                break
        else:
            groups.append([key])
    labelled = len(groups) <= 10
    for index, group in enumerate(groups):
        steps, values = zip(*series[group[0]], strict=True)
        ax.plot(
            steps,
            values,
            color=LAYER_COLORS[index % len(LAYER_COLORS)],
            linestyle=LAYER_STYLES[(index // len(LAYER_COLORS)) % len(LAYER_STYLES)],
            linewidth=1.2,
            label=_group_label([names[key] for key in group], series, group) if labelled else None,
            zorder=3,
            **_lone_point(steps),
        )
    if total is not None:
        steps, values = zip(*total, strict=True)
        label = "total" + (f" ({'=' if exact else '≈'} {', '.join(on_total)})" if on_total else "")
        ax.plot(steps, values, color=TOTAL_COLOR, linewidth=2.2, label=label, zorder=2, **_lone_point(steps))
    if "pruning/target" in series:
        steps, values = zip(*series["pruning/target"], strict=True)
        style = {"color": TARGET_COLOR, "linestyle": (0, (4, 3)), "linewidth": 1.2, "zorder": 4}
        ax.plot(steps, values, label="target", **style, **_lone_point(steps))
    if events:
        ax.plot(
            events,
            [0.0] * len(events),
            linestyle="none",
            marker="|",
            markersize=9,
            markeredgewidth=1.2,
            color=TARGET_COLOR,
            label=f"pruning event{'s' if len(events) > 1 else ''} ({len(events)})",
            zorder=5,
            clip_on=False,
            gid="pruning-events",
        )
    if not labelled:
        _note(ax, f"{len(groups)} layer curves (thin)")
    ax.set_ylim(-0.03, 1.03)
    ax.set_ylabel("sparsity (fraction of\nselected weights zero)")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)


def _draw_accuracy(
    ax: Any, series: Mapping[str, list[tuple[float, float]]], events: Sequence[float], phases: Sequence[Any]
) -> None:
    if len(events) <= _EVENT_LINES_UP_TO:
        for step in events:
            ax.axvline(step, color=TARGET_COLOR, linestyle=":", linewidth=1.2, zorder=1.5, gid="event-line")
    order = {"train": 0, "val": 1, "test": 2}
    keys = sorted((k for k in series if _ACC_COLUMN.match(k)), key=lambda k: (order[k.split("/")[0]], k))
    for key in keys:
        steps, values = zip(*series[key], strict=True)
        kind = key.split("/")[0]
        if kind == "train":
            ax.plot(steps, values, color=TRAIN_COLOR, linewidth=0.8, alpha=0.7, label=key, zorder=2)
        elif kind == "val":
            ax.plot(steps, values, color=VAL_COLOR, linewidth=1.2, marker="o", markersize=3, label=key, zorder=3)
        else:  # measured once per phase: points, never a line between them
            ax.plot(
                steps,
                values,
                linestyle="none",
                marker="D",
                markersize=6,
                markeredgecolor="black",
                markeredgewidth=0.6,
                color=TEST_COLOR,
                label=f"{key} (end of each phase)" if len(phases) > 1 else key,
                zorder=5,
            )
            for step, value in zip(steps, values, strict=True):
                ax.annotate(
                    f"{100 * value:.1f}%",
                    (step, value),
                    xytext=(-7, 6),
                    textcoords="offset points",
                    ha="right",
                    va="bottom",
                    fontsize="small",
                    color="black",
                    zorder=6,
                    bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "edgecolor": "none", "alpha": 0.85},
                )
    if keys:
        if events and len(events) <= _EVENT_LINES_UP_TO:
            ax.plot([], [], color=TARGET_COLOR, linestyle=":", label="pruning event")
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    else:
        _note(ax, "no accuracy columns in metrics.csv")
    ax.set_ylabel("accuracy")
    ax.set_xlabel("optimizer step (from the start of the run)")


def draw_training_curves(metrics_csv: str | Path, title: str | None = None) -> Any:
    """The figure :func:`plot_training_curves` saves (a ``matplotlib.figure.Figure``).

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     csv_path = Path(tmp) / "metrics.csv"
        ...     _ = csv_path.write_text("step,train/acc,test/acc\\n0,0.5,\\n10,0.9,\\n10,,0.8\\n")
        ...     fig = draw_training_curves(csv_path)
        >>> [ax.get_ylabel() for ax in fig.axes]
        ['accuracy']
        >>> [line.get_linestyle() for line in fig.axes[0].lines if line.get_label() == "test/acc"]
        ['None']
    """
    from matplotlib.figure import Figure

    series, _ = _read(metrics_csv)
    phases = read_phases(metrics_csv)
    pruned = any(key.startswith("pruning/") for key in series)
    events = _pruning_events(series)
    if pruned:
        fig = Figure(figsize=(9.5, 6.5), layout="constrained")
        ax_sparsity, ax_acc = fig.subplots(2, 1, sharex=True, height_ratios=(1, 1.2))
        axes = [ax_sparsity, ax_acc]
        _draw_sparsity(ax_sparsity, series, events)
    else:
        fig = Figure(figsize=(9.5, 4.0), layout="constrained")
        ax_acc = fig.subplots()
        axes = [ax_acc]
    _draw_phases(axes, phases, pruned)
    _draw_accuracy(ax_acc, series, events, phases)
    last = max((step for points in series.values() for step, _ in points), default=0.0)
    for ax in axes:
        ax.grid(alpha=0.3)
        if last > 0:
            ax.set_xlim(-0.01 * last, 1.025 * last)  # room for the last test point's marker
    if title is None:
        title = "Sparsity and accuracy over training" if pruned else "Accuracy over training (no pruning)"
    fig.suptitle(title)
    return fig


def plot_training_curves(metrics_csv: str | Path, out_png: str | Path, title: str | None = None) -> Path:
    """Draws sparsity (top) and accuracy (bottom) over training steps from a ``metrics.csv``; saves a PNG.

    Top: the pruning callback's ``pruning/sparsity/total`` (thick black), ``pruning/target`` (dashed red) and
    ``pruning/sparsity/<param>`` (one colour and line style per layer; layers whose curve equals the total's or
    another layer's share a line and say so in the legend), with a red tick at each pruning event. Bottom:
    ``train/acc`` (grey), ``val/acc`` (blue, one point per epoch) and ``test/acc`` (orange diamonds, labelled: it is
    measured only at the end of each phase, so it is never drawn as a line). With the app's ``phase`` column the
    dense phase is shaded, a line marks where each later phase (pruning, or each lottery-ticket round) starts, and
    the phases are named above the plot. Without ``pruning/*`` columns (``pruning=none``) only the accuracy panel is
    drawn. Legends sit outside the axes, so they hide no curve.

    Args:
        metrics_csv: Lightning ``CSVLogger``'s ``metrics.csv``, or the app's ``logs/all_phases.csv``.
        out_png: Output PNG path (parent directories are created).
        title: Figure title; default says what is drawn.

    Returns:
        ``out_png`` as a ``Path``.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     csv_path = Path(tmp) / "metrics.csv"
        ...     _ = csv_path.write_text("step,train/acc,pruning/sparsity/total\\n0,0.5,0.0\\n10,0.9,0.5\\n")
        ...     plot_training_curves(csv_path, Path(tmp) / "curves.png").read_bytes()[:4]
        b'\\x89PNG'
    """
    return _save(draw_training_curves(metrics_csv, title), out_png)


def _save(fig: Any, out_png: str | Path) -> Path:
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    return out_png


# --------------------------------------------------------------------------------------------------------------------
# Layer sparsity
# --------------------------------------------------------------------------------------------------------------------


def draw_layer_sparsity(summary: Any) -> Any:
    """The figure :func:`plot_layer_sparsity` saves.

    Example:
        >>> layers = {"layer_sparsity": {"conv1.weight": 0.5}, "layer_channels": {"conv1.weight": [8, 16]}}
        >>> fig = draw_layer_sparsity(layers)
        >>> [text.get_text() for text in fig.axes[0].texts]
        ['50.0% (8 of 16 channels kept)']
    """
    from matplotlib.figure import Figure

    data = summary.to_dict() if hasattr(summary, "to_dict") else dict(summary)
    layers: dict[str, float] = data.get("layer_sparsity") or {}
    channels: dict[str, list[int]] = data.get("layer_channels") or {}
    names = list(layers)
    fig = Figure(figsize=(7.5, 1.6 + 0.4 * max(len(names), 1)), layout="constrained")
    ax = fig.subplots()
    if names:
        positions = range(len(names))
        values = [layers[name] for name in names]
        ax.barh(positions, values, color="tab:blue")
        ax.set_yticks(list(positions), names, fontsize="small")
        ax.invert_yaxis()  # first layer on top
        for position, name, value in zip(positions, names, values, strict=True):
            text = percent(value)
            if name in channels:
                kept, count = channels[name]
                text += f" ({kept} of {count} channels kept)"
            ax.text(min(value, 1.0) + 0.01, position, text, va="center", fontsize="small")
        ax.set_xlim(0, 1.45 if channels else 1.12)
        ax.set_xticks([0, 0.25, 0.5, 0.75, 1.0])
        if not any(values):
            _note(ax, "no weight pruned: every layer is dense")
    else:
        _note(ax, "no per-layer sparsity in the summary")
    ax.set_xlabel("sparsity (fraction of the layer's weights that are zero)")
    total = data.get("total_sparsity")
    ax.set_title("Per-layer sparsity" + (f" (total {percent(total)})" if total is not None else ""))
    return fig


def percent(value: float) -> str:
    """``value`` as a percentage with one decimal, or as many more as keep a value short of 100% (or above 0%) from
    reading as 100.0% (0.0%): a layer at 99.98% is not a collapsed one.

    Example:
        >>> percent(0.9), percent(0.9998), percent(1.0), percent(0.00002)
        ('90.0%', '99.98%', '100.0%', '0.002%')
    """
    digits = 1
    while digits < 6 and 0 < value < 1 and f"{100 * value:.{digits}f}" in (f"{100:.{digits}f}", f"{0:.{digits}f}"):
        digits += 1
    return f"{100 * value:.{digits}f}%"


def plot_layer_sparsity(summary: Any, out_png: str | Path) -> Path:
    """Horizontal bar chart of the per-layer sparsity of a run (a ``RunSummary`` or its dict); saves a PNG.

    Each bar is labelled with its percentage and, for structured pruning (``layer_channels`` in the summary), how
    many of the layer's channels are kept.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     s = {"layer_sparsity": {"fc1.weight": 0.9, "fc2.weight": 0.5}, "total_sparsity": 0.8}
        ...     plot_layer_sparsity(s, Path(tmp) / "layers.png").stat().st_size > 0
        True
    """
    return _save(draw_layer_sparsity(summary), out_png)


# --------------------------------------------------------------------------------------------------------------------
# Mask movement (dynamic sparse training)
# --------------------------------------------------------------------------------------------------------------------


def has_mask_movement(metrics_csv: str | Path) -> bool:
    """Whether ``metrics_csv`` holds dynamic sparse training's ``pruning/regrown/*`` columns.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     path = Path(tmp) / "metrics.csv"
        ...     _ = path.write_text("step,pruning/regrown/fc1.weight\\n25,0.3\\n")
        ...     has_mask_movement(path)
        True
    """
    with Path(metrics_csv).open(newline="") as handle:
        header = next(csv.reader(handle), [])
    return any(column.startswith(_REGROWN_PREFIX) for column in header)


def draw_mask_movement(metrics_csv: str | Path, title: str | None = None) -> Any:
    """The figure :func:`plot_mask_movement` saves.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     path = Path(tmp) / "metrics.csv"
        ...     text = "step,pruning/regrown/fc1.weight,pruning/regrown/fc2.weight,pruning/regrown/fraction\\n"
        ...     _ = path.write_text(text + "25,0.3,0.29,0.3\\n50,0.15,0.16,0.15\\n")
        ...     fig = draw_mask_movement(path)
        >>> sorted(line.get_label() for line in fig.axes[0].lines)
        ['fc1.weight', 'fc2.weight', 'planned share (cosine decay)']
    """
    from matplotlib.figure import Figure

    series, _ = _read(metrics_csv)
    keys = [key for key in series if key.startswith(_REGROWN_PREFIX) and key != _REGROWN_PLAN]
    names = _short_names([_LAYER_PREFIX + key.removeprefix(_REGROWN_PREFIX) for key in keys])
    fig = Figure(figsize=(9.5, 4.2), layout="constrained")
    ax = fig.subplots()
    plan = series.get(_REGROWN_PLAN, [])
    if plan:
        steps, values = zip(*plan, strict=True)
        # wide and pale under the layers' lines, so a layer that follows the plan exactly does not hide it
        ax.plot(
            steps,
            values,
            color=TARGET_COLOR,
            linewidth=6,
            alpha=0.3,
            marker="o",
            markersize=9,
            label="planned share (cosine decay)",
        )  # fmt: skip  (a point per update: one update is seen too)
    groups: list[list[str]] = []  # layers with the same curve share one line (they would hide each other)
    for key in keys:
        group = next((g for g in groups if _same_curve(series[g[0]], series[key])), None)
        if group is None:
            groups.append([key])
        else:
            group.append(key)
    for index, group in enumerate(groups):
        steps, values = zip(*series[group[0]], strict=True)
        color = LAYER_COLORS[index % len(LAYER_COLORS)]
        style = LAYER_STYLES[(index // len(LAYER_COLORS)) % len(LAYER_STYLES)]
        label = _group_label([names[_LAYER_PREFIX + key.removeprefix(_REGROWN_PREFIX)] for key in group], series, group)
        ax.plot(steps, values, color=color, linestyle=style, marker="o", markersize=4, label=label)
    if not keys:
        _note(ax, "no mask update logged (pruning.regrow is off)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("share of the layer's active\nweights regrown at the update")
    highest = max([v for key in [*keys, _REGROWN_PLAN] for _, v in series.get(key, [])], default=0.0)
    top = 1.12 * highest if highest > 0 else 1.0
    ax.set_ylim(-0.04 * top, top)  # room around the highest point and the points at 0: none is cut by the frame
    ax.grid(alpha=0.3)
    if keys or plan:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", title="layer")
    ax.set_title(title or "Mask movement: weights dropped and regrown at each update")
    return fig


def plot_mask_movement(metrics_csv: str | Path, out_png: str | Path, title: str | None = None) -> Path:
    """Dynamic sparse training (``regrow``): at each mask update, the share of each layer's active weights that was
    dropped and regrown (``pruning/regrown/<layer>``, one colour per layer, a point per update), and the planned
    share (``pruning/regrown/fraction``, wide, pale red, a point per update joined by straight lines:
    ``regrow_fraction`` decayed by a cosine to 0, taken at the updates only); saves a PNG.

    A layer's points sit under the planned share when it has fewer inactive weights than the share asks for, or
    where rounding to whole weights lowers it. Layers with the same curve share one line, labelled
    ``fc1.weight = fc2.weight`` (``≈`` when they differ by less than a pixel).

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     path = Path(tmp) / "metrics.csv"
        ...     _ = path.write_text("step,pruning/regrown/fc1.weight\\n25,0.3\\n")
        ...     plot_mask_movement(path, Path(tmp) / "movement.png").read_bytes()[:4]
        b'\x89PNG'
    """
    return _save(draw_mask_movement(metrics_csv, title), out_png)


# --------------------------------------------------------------------------------------------------------------------
# Accuracy against sparsity over a sweep
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class Arm:
    """One line of :func:`plot_accuracy_vs_sparsity`: the runs sharing every setting but sparsity and seed.

    Attributes:
        label: What sets the arm apart (``"pruning.scope=global"``); empty when there is a single arm.
        points: ``(sparsity, [final accuracies over seeds])`` per sparsity, in increasing sparsity.
        dense: Dense test accuracies of the arm's dense models: one per seed (the runs of a seed share theirs).
    """

    label: str
    points: list[tuple[float, list[float]]] = field(default_factory=list)
    dense: list[float] = field(default_factory=list)


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return mean, std


def _kept(sparsity: float, floor: float) -> float:
    return max(1.0 - sparsity, floor)


def _kept_axis(ax: Any, sparsities: Sequence[float]) -> float:
    """A logarithmic x axis of the weights kept (``1 - sparsity``), decreasing so that sparsity grows to the right,
    ticks naming the weights kept and the sparsity; returns the floor where a fully pruned run is drawn: past the
    sparsest other run (at most half its kept fraction, rounded down to a power of ten), at a tick of its own that
    reads ``0% (100%)``."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    ax.set_xscale("log")
    partial = [1.0 - s for s in sparsities if 1.0 - s > 0]
    floor = 10 ** math.floor(math.log10(max(1e-4, min(partial, default=1.0)) / 2))
    full = len(partial) < len(sparsities)
    lo = min(_kept(s, floor) for s in sparsities)
    ax.set_xlim(1.25, lo / 1.6)  # decreasing: sparsity grows to the right
    slack = 1 - 1e-9  # 1 - 0.7 is 0.30000000000000004: a tick at exactly a third less must stay
    ticks = [t for t in (1.0, 0.5, 0.2, 0.1, 0.05, 0.02, 0.01, 0.005, 0.002, 0.001, 1e-4) if t >= lo / 1.5 * slack]
    if full:  # no ordinary tick past the sparsest other run: the axis reads as a sparsity the last one does not have
        ticks = [t for t in ticks if t >= min(partial, default=1.0) / 1.5 * slack] + [floor]

    def label(x: float, _: Any) -> str:
        if full and math.isclose(x, floor):
            return "0%\n(100%)"
        return f"{100 * x:g}%\n({100 * (1 - x):g}%)"

    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_major_formatter(FuncFormatter(label))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("weights kept (sparsity), log scale")
    return floor


def draw_accuracy_vs_sparsity(arms: Sequence[Arm], title: str = "Accuracy versus sparsity") -> Any:
    """The figure :func:`plot_accuracy_vs_sparsity` saves.

    Example:
        >>> fig = draw_accuracy_vs_sparsity([Arm("scope=global", [(0.5, [0.9]), (0.9, [0.8, 0.82])], [0.95])])
        >>> ax = fig.axes[0]
        >>> ax.get_xscale(), [t.get_text() for t in ax.get_legend().get_texts()]
        ('log', ['scope=global', 'dense'])
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5), layout="constrained")
    ax = fig.subplots()
    ax.set_xscale("log")
    drawn = [arm for arm in arms if arm.points]
    if not drawn:
        _note(ax, "no run has both sparsity and final accuracy")
        ax.set_title(title)
        return fig
    floor = _kept_axis(ax, [s for arm in drawn for s, _ in arm.points])
    from matplotlib import colormaps

    palette = colormaps["tab10"].colors
    dense_means = [_mean_std(arm.dense)[0] for arm in drawn if arm.dense]
    shared_dense = bool(dense_means) and max(dense_means) - min(dense_means) < 1e-9
    seeds = _has_seeds(drawn)
    for index, arm in enumerate(drawn):
        color = palette[index % len(palette)]
        nudge = 1.025 ** (index - (len(drawn) - 1) / 2) if seeds else 1.0  # error bars of arms side by side
        xs, ys, errs = [], [], []
        for sparsity, accs in arm.points:
            mean, std = _mean_std(accs)
            xs.append(_kept(sparsity, floor) * nudge)
            ys.append(100 * mean)
            errs.append(100 * std)
        several = any(len(accs) > 1 for _, accs in arm.points)
        ax.errorbar(
            xs,
            ys,
            yerr=errs if several else None,
            color=color,
            marker="o",
            markersize=5,
            linewidth=1.5,
            capsize=3,
            label=arm.label or "final",
        )
        if arm.dense and not shared_dense:
            ax.axhline(100 * _mean_std(arm.dense)[0], color=color, linestyle=":", linewidth=1.2)
    if shared_dense:  # the arms share their dense models: one arm's (one per seed) are all of them
        mean, std = _mean_std(max((arm.dense for arm in drawn), key=len))
        ax.axhline(100 * mean, color="0.3", linestyle="--", linewidth=1.2, label="dense", gid="dense-reference")
        if std > 0:
            ax.axhspan(
                100 * (mean - std), 100 * (mean + std), color="0.3", alpha=0.12, linewidth=0,
                label="dense ± std over seeds",
            )  # fmt: skip
    elif dense_means:
        ax.plot([], [], color="0.3", linestyle=":", label="dense (dotted, in the arm's colour)")
    ax.set_ylabel("final test accuracy (%)" + (", mean ± std over seeds" if seeds else ""))
    ax.set_title(title)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    order = sorted(range(len(labels)), key=lambda i: labels[i].startswith("dense"))  # arms first, then dense
    ax.legend([handles[i] for i in order], [labels[i] for i in order], fontsize="small", loc="best")
    return fig


def _has_seeds(arms: Sequence[Arm]) -> bool:
    return any(len(accs) > 1 for arm in arms for _, accs in arm.points)


def plot_accuracy_vs_sparsity(
    arms: Sequence[Arm], out_png: str | Path, title: str = "Accuracy versus sparsity"
) -> Path:
    """Final test accuracy against the fraction of weights kept, one line per arm; saves a PNG.

    The x axis is logarithmic in the weights kept (``1 - sparsity``), so 90%, 95%, 98% and 99% sparsity, which crowd
    near 1 on a linear axis, are evenly spread; its tick labels give the weights kept and, in parentheses, the
    sparsity. Where an arm has several runs at a sparsity (seeds), the point is their mean and the error bar their
    standard deviation. The dense accuracy is a dashed reference line (its band: the standard deviation over
    seeds); when the arms' dense accuracies differ (they vary the model or data), each arm gets a dotted line in
    its colour. With error bars, the arms' points are nudged apart by 2.5% along the axis so that the bars do not
    overlap. A run at 100% sparsity is drawn past the sparsest other run, at a tick of its own that reads
    ``0% (100%)``.

    Args:
        arms: The lines to draw (see :class:`Arm`).
        out_png: Output PNG path.
        title: Figure title.

    Returns:
        ``out_png`` as a ``Path``.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     arms = [Arm("", [(0.5, [0.9]), (0.9, [0.85])], [0.93])]
        ...     plot_accuracy_vs_sparsity(arms, Path(tmp) / "acc.png").read_bytes()[:4]
        b'\\x89PNG'
    """
    return _save(draw_accuracy_vs_sparsity(arms, title), out_png)


# --------------------------------------------------------------------------------------------------------------------
# The trials of a search, Pareto front marked
# --------------------------------------------------------------------------------------------------------------------

FRONT_COLOR = "tab:red"
TRIAL_COLOR = "tab:blue"


def draw_pareto(
    points: Sequence[tuple[float, float]],
    front: Sequence[int],
    dense: Sequence[float] = (),
    title: str = "Accuracy versus sparsity: the trials of the search",
) -> Any:
    """The figure :func:`plot_pareto` saves.

    Example:
        >>> fig = draw_pareto([(0.5, 0.95), (0.9, 0.93), (0.8, 0.90)], front=[0, 1], dense=[0.96])
        >>> [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
        ['Pareto front (2 of 3 trials)', 'other trials', 'dense']
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5), layout="constrained")
    ax = fig.subplots()
    if not points:
        _note(ax, "no trial has both sparsity and final accuracy")
        ax.set_title(title)
        return fig
    floor = _kept_axis(ax, [sparsity for sparsity, _ in points])
    on_front = sorted(front, key=lambda i: points[i][0])
    others = [i for i in range(len(points)) if i not in set(front)]
    xs = [_kept(points[i][0], floor) for i in on_front]
    ys = [100 * points[i][1] for i in on_front]
    ax.plot(xs, ys, color=FRONT_COLOR, marker="o", markersize=7, linewidth=1.5, drawstyle="steps-pre",
            label=f"Pareto front ({len(on_front)} of {len(points)} trials)", gid="pareto-front")  # fmt: skip
    ax.plot([_kept(points[i][0], floor) for i in others], [100 * points[i][1] for i in others], linestyle="none",
            marker="o", markersize=5, color=TRIAL_COLOR, alpha=0.6, label="other trials", gid="trials")  # fmt: skip
    if dense and max(dense) - min(dense) < 1e-9:
        ax.axhline(100 * dense[0], color="0.3", linestyle="--", linewidth=1.2, label="dense", gid="dense-reference")
    elif dense:  # the trials' dense phases differ (the search varies the model, the data or the dense training)
        low, high = 100 * min(dense), 100 * max(dense)
        label = f"dense: {low:.2f}-{high:.2f}% (the trials' dense phases differ)"
        ax.axhspan(low, high, color="0.3", alpha=0.15, linewidth=0, gid="dense-range", label=label)
    ax.set_ylabel("final test accuracy (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", loc="lower left")
    return fig


def plot_pareto(
    points: Sequence[tuple[float, float]],
    front: Sequence[int],
    out_png: str | Path,
    dense: Sequence[float] = (),
    title: str = "Accuracy versus sparsity: the trials of the search",
) -> Path:
    """Final test accuracy against the fraction of weights kept for every trial of a search; saves a PNG.

    The axes are those of :func:`plot_accuracy_vs_sparsity`. The trials on the Pareto front (no other trial is both
    sparser and more accurate) are joined by a step line: at each sparsity, the best accuracy a trial reached at
    that sparsity or higher.

    Args:
        points: ``(sparsity, final accuracy)`` per trial, fractions.
        front: the indices of ``points`` on the Pareto front (:func:`lightprune.experiment.search.pareto_front`).
        out_png: Output PNG path.
        dense: the trials' dense test accuracies: one value, a dashed reference line; values that differ (the
            search varies the dense phase), a band from the lowest to the highest.
        title: Figure title.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     plot_pareto([(0.5, 0.95), (0.9, 0.93)], [0, 1], Path(tmp) / "front.png").read_bytes()[:4]
        b'\\x89PNG'
    """
    return _save(draw_pareto(points, front, dense, title), out_png)
