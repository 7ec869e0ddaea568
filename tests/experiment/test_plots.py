"""Tests of the app's plots by what they draw: the artists of the figures, not only that a PNG was written."""

from __future__ import annotations

import statistics
from pathlib import Path

import matplotlib.colors as mcolors
import pytest

from lightprune.experiment.plots import (
    Arm,
    draw_accuracy_vs_sparsity,
    draw_layer_sparsity,
    draw_pareto,
    draw_training_curves,
    plot_accuracy_vs_sparsity,
    read_phases,
)

HEADER = "phase,epoch,step,train/acc,val/acc,test/acc,pruning/sparsity/model.fc1.weight,"
HEADER += "pruning/sparsity/model.fc2.weight,pruning/sparsity/model.fc3.weight,pruning/sparsity/total,pruning/target"


def all_phases_csv(path: Path, phases: tuple[str, ...] = ("dense", "prune"), pruned: bool = True) -> Path:
    """An app-like ``logs/all_phases.csv``: 10 dense steps, then 20 steps per later phase. fc1's sparsity equals the
    total's; fc2 and fc3 differ. Pruning events at steps +2, +4 and +6 of each later phase."""
    header = HEADER if pruned else ",".join(HEADER.split(",")[:6])
    rows = [header]
    for step in range(2, 11, 2):
        rows.append(f"dense,0,{step},0.{step // 2 + 4},,,,,,,")
    rows.append("dense,1,10,,0.9,,,,,,")
    rows.append("dense,1,10,,,0.91,,,,,")
    start = 10
    for phase in phases[1:]:
        for offset in range(2, 21, 2):
            target = min(offset, 6) / 10
            cells = f"{target},{target + 0.05},{target - 0.05},{target},{target}" if pruned else ",,,,"
            rows.append(f"{phase},0,{start + offset},0.9,,,{cells}")
        rows.append(f"{phase},1,{start + 20},,0.88,,,,,,")
        rows.append(f"{phase},1,{start + 20},,,0.87,,,,,")
        start += 20
    if not pruned:
        rows = [",".join(row.split(",")[:6]) for row in rows]
    path.write_text("\n".join(rows) + "\n")
    return path


def legend_texts(ax) -> list[str]:
    return [text.get_text() for text in ax.get_legend().get_texts()]


def test_read_phases_of_an_app_run(tmp_path: Path) -> None:
    csv_path = all_phases_csv(tmp_path / "all.csv", ("dense", "round_1", "round_2"))
    assert read_phases(csv_path) == [("dense", 0.0, 10.0), ("round_1", 10.0, 30.0), ("round_2", 30.0, 50.0)]


def test_test_accuracy_is_drawn_as_points_only(tmp_path: Path) -> None:
    fig = draw_training_curves(all_phases_csv(tmp_path / "all.csv"))
    ax_acc = fig.axes[1]
    test = [line for line in ax_acc.lines if line.get_label().startswith("test/acc")]
    assert len(test) == 1
    assert test[0].get_linestyle() == "None" and test[0].get_marker() == "D"
    assert list(test[0].get_xdata()) == [10.0, 30.0] and list(test[0].get_ydata()) == [0.91, 0.87]
    assert sorted(text.get_text() for text in ax_acc.texts) == ["87.0%", "91.0%"]  # each measured value labelled


def test_phase_boundary_and_pruning_events_are_marked(tmp_path: Path) -> None:
    fig = draw_training_curves(all_phases_csv(tmp_path / "all.csv", ("dense", "round_1", "round_2")))
    for ax in fig.axes:  # a line where each phase after the dense one starts, in both panels
        boundaries = [line.get_xdata()[0] for line in ax.lines if line.get_gid() == "phase-boundary"]
        assert boundaries == [10.0, 30.0]
    names = [text.get_text() for text in fig.axes[0].texts]
    assert names == ["dense", "round 1", "round 2"]
    events = next(line for line in fig.axes[0].lines if line.get_gid() == "pruning-events")
    assert list(events.get_xdata()) == [12.0, 14.0, 16.0, 32.0, 34.0, 36.0]  # target changes; round 2 starts anew
    assert "pruning events (6)" in legend_texts(fig.axes[0])


def test_a_layer_equal_to_the_total_is_named_in_its_legend_entry(tmp_path: Path) -> None:
    fig = draw_training_curves(all_phases_csv(tmp_path / "all.csv"))
    labels = legend_texts(fig.axes[0])
    assert "total (= fc1.weight)" in labels
    assert "fc2.weight" in labels and "fc3.weight" in labels and "fc1.weight" not in labels


def test_no_colour_means_two_things(tmp_path: Path) -> None:
    fig = draw_training_curves(all_phases_csv(tmp_path / "all.csv"))
    meaning: dict[str, set[str]] = {}
    for ax in fig.axes:
        for line in ax.lines:
            label = line.get_label()
            if label.startswith("_") and line.get_gid() is None:
                continue
            what = line.get_gid() or label
            what = "pruning schedule" if what in ("target", "pruning-events", "event-line", "pruning event") else what
            meaning.setdefault(mcolors.to_hex(line.get_color()), set()).add(what)
    shared = {colour: whats for colour, whats in meaning.items() if len(whats) > 1 and "phase-boundary" not in whats}
    assert not shared, shared


def test_pruning_none_draws_accuracy_alone_and_says_so(tmp_path: Path) -> None:
    fig = draw_training_curves(all_phases_csv(tmp_path / "all.csv", pruned=False))
    assert len(fig.axes) == 1
    assert "no pruning" in fig._suptitle.get_text()
    assert [text.get_text() for text in fig.axes[0].texts if not text.get_text().endswith("%")] == [
        "dense",
        "fine-tuning (no pruning)",
    ]
    assert not any("metrics.csv" in text.get_text() for text in fig.axes[0].texts)


def test_layer_sparsity_of_a_structured_run_says_channels_kept() -> None:
    fig = draw_layer_sparsity(
        {
            "layer_sparsity": {"conv1.weight": 0.5, "conv2.weight": 0.25},
            "layer_channels": {"conv1.weight": [8, 16], "conv2.weight": [24, 32]},
            "total_sparsity": 0.3,
        }
    )
    texts = [text.get_text() for text in fig.axes[0].texts]
    assert texts == ["50.0% (8 of 16 channels kept)", "25.0% (24 of 32 channels kept)"]


def test_a_layer_short_of_every_weight_is_not_labelled_100_percent() -> None:
    fig = draw_layer_sparsity({"layer_sparsity": {"fc1.weight": 0.9998, "fc2.weight": 1.0}, "total_sparsity": 0.9997})
    assert [text.get_text() for text in fig.axes[0].texts] == ["99.98%", "100.0%"]
    assert fig.axes[0].get_title() == "Per-layer sparsity (total 99.97%)"


def test_a_single_mask_update_is_drawn_whole_with_its_planned_share(tmp_path: Path) -> None:
    from lightprune.experiment.plots import draw_mask_movement

    path = tmp_path / "metrics.csv"
    path.write_text("step,pruning/regrown/fc1.weight,pruning/regrown/fraction\n25,0.3,0.3\n")
    ax = draw_mask_movement(path).axes[0]
    planned = next(line for line in ax.lines if line.get_label() == "planned share (cosine decay)")
    assert planned.get_marker() == "o" and list(planned.get_ydata()) == [0.3]  # a point, seen without a segment
    bottom, top = ax.get_ylim()
    assert bottom < 0 and top > 0.3 * 1.1  # around the points (at 0.3, or at 0 for a layer that moved none)


def test_layer_sparsity_of_a_dense_run_says_nothing_was_pruned() -> None:
    fig = draw_layer_sparsity({"layer_sparsity": {"fc1.weight": 0.0, "fc2.weight": 0.0}, "total_sparsity": 0.0})
    assert "no weight pruned: every layer is dense" in [text.get_text() for text in fig.axes[0].texts]


def test_accuracy_vs_sparsity_one_line_per_arm_with_error_bars_and_dense_reference() -> None:
    arms = [
        Arm("pruning.scope=global", [(0.5, [0.97, 0.96]), (0.9, [0.95, 0.93]), (0.99, [0.6, 0.7])], [0.96, 0.96]),
        Arm("pruning.scope=layerwise", [(0.5, [0.96, 0.96]), (0.9, [0.9, 0.92]), (0.99, [0.3, 0.5])], [0.96, 0.96]),
    ]
    fig = draw_accuracy_vs_sparsity(arms)
    ax = fig.axes[0]
    assert legend_texts(ax) == ["pruning.scope=global", "pruning.scope=layerwise", "dense"]
    assert ax.get_xscale() == "log" and ax.xaxis_inverted()
    assert "weights kept" in ax.get_xlabel() and "mean ± std" in ax.get_ylabel()
    assert len(ax.containers) == 2  # one errorbar container per arm
    global_line, _, bars = ax.containers[0]
    assert global_line.get_ydata() == pytest.approx([96.5, 94.0, 65.0])
    assert bars[0].get_segments()[2][:, 1] == pytest.approx([65 - 7.0711, 65 + 7.0711], abs=1e-3)
    # kept fractions, nudged apart by arm so that the error bars do not overlap
    assert global_line.get_xdata() == pytest.approx([kept * 1.025**-0.5 for kept in (0.5, 0.1, 0.01)])
    dense = [line for line in ax.lines if line.get_gid() == "dense-reference"]
    assert len(dense) == 1 and dense[0].get_ydata()[0] == pytest.approx(96.0)


@pytest.mark.parametrize("draw", ["arms", "pareto"])
def test_a_fully_pruned_run_is_drawn_past_the_sparsest_at_a_tick_that_says_so(draw: str) -> None:
    if draw == "arms":
        fig = draw_accuracy_vs_sparsity([Arm("a", [(0.5, [0.9]), (0.9, [0.8]), (1.0, [0.1])], [0.95])])
        xs = list(fig.axes[0].containers[0].lines[0].get_xdata())
    else:
        fig = draw_pareto([(0.5, 0.9), (0.9, 0.8), (1.0, 0.1)], front=[0, 1, 2])
        xs = sorted((x for line in fig.axes[0].lines for x in line.get_xdata()), reverse=True)
    ax = fig.axes[0]
    assert xs[:2] == pytest.approx([0.5, 0.1]) and 0 < xs[2] <= 0.05  # past 90%, within a decade or so
    label = ax.xaxis.get_major_formatter()
    labels = {round(tick, 6): label(tick, 0) for tick in ax.get_xticks()}
    assert labels[round(xs[2], 6)] == "0%\n(100%)"
    assert [text for tick, text in labels.items() if tick < 0.1] == ["0%\n(100%)"]  # no tick reading 99% there
    assert ax.get_xlim()[1] < xs[2]  # inside the axes


def test_accuracy_vs_sparsity_dense_lines_per_arm_when_they_differ(tmp_path: Path) -> None:
    arms = [Arm("model=a", [(0.9, [0.9])], [0.95]), Arm("model=b", [(0.9, [0.8])], [0.85])]
    fig = draw_accuracy_vs_sparsity(arms)
    ax = fig.axes[0]
    assert not [line for line in ax.lines if line.get_gid() == "dense-reference"]
    dotted = [line for line in ax.lines if line.get_linestyle() == ":" and len(line.get_ydata()) == 2]
    assert sorted(line.get_ydata()[0] for line in dotted) == pytest.approx([85.0, 95.0])
    assert ax.containers[0].lines[1] == ()  # one seed: no error bars
    assert plot_accuracy_vs_sparsity(arms, tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"


def test_dense_band_is_the_std_over_seeds_not_over_runs() -> None:
    """A sweep of 2 seeds x 2 sparsities has two dense models: the band is their std, with a legend entry (counted
    once per run, each seed came twice and the band was narrower than the report's figure)."""
    from lightprune.experiment.report import RunSummary, group_arms

    runs = [
        RunSummary(total_sparsity=s, final_test_acc=0.8, dense_test_acc=dense, overrides=[f"seed={seed}"])
        for s in (0.5, 0.8)
        for seed, dense in ((0, 0.8663), (1, 0.7994))
    ]
    (arm,) = group_arms(runs)
    assert sorted(arm.dense) == [0.7994, 0.8663]
    ax = draw_accuracy_vs_sparsity([arm]).axes[0]
    (band,) = [patch for patch in ax.patches if patch.get_label() == "dense ± std over seeds"]
    low, high = band.get_path().get_extents().transformed(band.get_patch_transform()).intervaly
    std = statistics.stdev([86.63, 79.94])
    assert high - low == pytest.approx(2 * std)
    assert "dense ± std over seeds" in [t.get_text() for t in ax.get_legend().get_texts()]


def test_a_run_at_70_percent_sparsity_keeps_the_20_percent_tick() -> None:
    ax = draw_accuracy_vs_sparsity([Arm("", [(0.5, [0.9]), (0.7, [0.85])], [0.95])]).axes[0]
    labels = [ax.xaxis.get_major_formatter()(tick, 0) for tick in ax.xaxis.get_major_locator()()]
    assert labels == ["100%\n(0%)", "50%\n(50%)", "20%\n(80%)"]
