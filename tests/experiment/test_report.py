"""Tests for lightprune.experiment.report: summaries, text table, plots and the multirun report."""

import csv
import json
import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn
from torch.nn.utils import prune as torch_prune

from lightprune.experiment import plots
from lightprune.experiment.models import LeNet300100
from lightprune.experiment.report import (
    RunSummary,
    collect_runs,
    format_summary_table,
    group_arms,
    plot_layer_sparsity,
    plot_training_curves,
    read_metrics_csv,
    report_main,
    scan_runs,
    sparsity_by_layer,
    summarize,
    write_report,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def known_zeros_model() -> nn.Sequential:
    """Linear(4, 4) with 12 of 16 weights zero, then Linear(4, 2) with none: 24 weights, 12 nonzero."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with torch.no_grad():
        model[0].weight.fill_(1.0)
        model[0].weight[:3] = 0
        model[2].weight.fill_(2.0)
    return model


# --------------------------------------------------------------------------------------------------------------------
# summarize / RunSummary
# --------------------------------------------------------------------------------------------------------------------


def test_summarize_numbers_on_known_zeros():
    summary = summarize(
        known_zeros_model(),
        input_shape=(4,),
        dense_test_acc=torch.tensor(0.98),
        final_test_acc=0.96,
        wall_time_s=3.5,
        config={"prune": {"amount": 0.5}},
        metrics={"val/acc": torch.tensor(0.97)},
    )
    assert summary.layer_sparsity == {"0.weight": 0.75, "2.weight": 0.0}
    assert (summary.total_weights, summary.nonzero_weights) == (24, 12)
    assert summary.total_sparsity == 0.5
    assert summary.compression_ratio == 2.0
    assert (summary.dense_flops, summary.nonzero_flops) == (24, 12)
    assert summary.theoretical_speedup == 2.0
    assert summary.dense_test_acc == pytest.approx(0.98) and isinstance(summary.dense_test_acc, float)
    assert summary.metrics == {"val/acc": pytest.approx(0.97)}
    assert summary.config == {"prune": {"amount": 0.5}}


def test_summarize_selection_forms_agree():
    model = known_zeros_model()
    by_pairs = summarize(model, parameters=[(model[0], "weight")])
    by_names = summarize(model, parameters=["0.weight"])
    by_triples = summarize(model, parameters=[("first.weight", model[0], "weight")])
    assert by_pairs.layer_sparsity == by_names.layer_sparsity == {"0.weight": 0.75}
    assert by_triples.layer_sparsity == {"first.weight": 0.75}
    assert by_pairs.total_sparsity == 0.75 and by_pairs.compression_ratio == 4.0
    assert by_pairs.theoretical_speedup is None and by_pairs.dense_flops is None  # no input_shape given
    # a bias can be selected too
    assert summarize(model, parameters=["2.bias"]).total_weights == 2


def test_summarize_selection_errors():
    model = known_zeros_model()
    with pytest.raises(ValueError, match="not in model"):
        summarize(model, parameters=[(nn.Linear(2, 2), "weight")])
    with pytest.raises(ValueError, match="no tensor attribute 'kernel'"):
        summarize(model, parameters=[(model[0], "kernel")])
    with pytest.raises(AttributeError):
        summarize(model, parameters=["7.weight"])


def test_summarize_reads_effective_weights_of_reparametrized_model():
    model = LeNet300100(in_features=10, hidden=(8,), num_classes=2)
    torch_prune.global_unstructured(
        [(model.fc1, "weight"), (model.fc2, "weight")], pruning_method=torch_prune.L1Unstructured, amount=48
    )
    assert hasattr(model.fc1, "weight_orig")
    summary = summarize(model, input_shape=(10,))
    assert summary.total_weights == 96 and summary.nonzero_weights == 48
    assert summary.total_sparsity == 0.5 and summary.compression_ratio == 2.0
    assert summary.theoretical_speedup == 2.0
    assert list(summary.layer_sparsity) == ["fc1.weight", "fc2.weight"]
    assert sparsity_by_layer(model) == summary.layer_sparsity


def test_summarize_fully_pruned_and_omegaconf_config():
    model = nn.Linear(3, 3, bias=False)
    nn.init.zeros_(model.weight)
    config = OmegaConf.create({"a": 1, "b": "${a}"})
    summary = summarize(model, input_shape=(3,), config=config)
    assert summary.total_sparsity == 1.0
    assert math.isinf(summary.compression_ratio) and math.isinf(summary.theoretical_speedup)
    assert summary.config == {"a": 1, "b": 1}
    data = json.loads(summary.to_json())  # strict JSON: inf is written as null
    assert data["compression_ratio"] is None and data["theoretical_speedup"] is None


def test_run_summary_json_round_trip(tmp_path):
    summary = summarize(known_zeros_model(), input_shape=(4,), final_test_acc=0.9, config={"x": [1, 2]})
    path = tmp_path / "nested" / "summary.json"
    text = summary.to_json(path)
    assert path.read_text() == text
    assert RunSummary.load(path) == summary
    assert RunSummary.from_json(text) == summary
    assert RunSummary.from_json('{"final_test_acc": 0.5, "added_later": true}') == RunSummary(final_test_acc=0.5)
    with pytest.raises(ValueError, match="JSON object"):
        RunSummary.from_json("[1, 2]")


def test_format_summary_table():
    summary = summarize(known_zeros_model(), input_shape=(4,), dense_test_acc=0.98, final_test_acc=0.9, wall_time_s=7)
    table = format_summary_table(summary)
    assert "final test acc        90.00%" in table
    assert "compression           2.00x" in table
    assert "  0.weight            75.00%" in table
    empty = format_summary_table(RunSummary())
    assert "wall time" in empty and "layer sparsity" not in empty and "-" in empty


# --------------------------------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------------------------------

METRICS_HEADER = (
    "epoch,step,pruning/sparsity/fc1.weight,pruning/sparsity/fc2.weight,pruning/sparsity/total,pruning/target,"
    "train/acc,train/loss,val/acc,val/loss,test/acc,test/loss"
)


def write_metrics_csv(path, restart=False):
    """A CSVLogger-like metrics.csv: per-step train and pruning rows, per-epoch val rows, a final test row."""
    rows = [METRICS_HEADER]
    step = 0
    for epoch in range(3):
        for _ in range(5):
            step += 1
            target = min(0.9, step / 10)
            rows.append(f"{epoch},{step},{target * 1.1:.3f},{target * 0.8:.3f},{target},{target},0.8,0.5,,,,")
        rows.append(f"{epoch},{step},,,,,,,{0.85 + 0.01 * epoch},0.4,,")
        if restart and epoch == 1:
            step = 0  # a second Trainer logging to the same logger
    rows.append(f"2,{step},,,,,,,,,0.87,0.45")
    path.write_text("\n".join(rows) + "\n")
    return path


def test_read_metrics_csv_skips_empty_cells_and_chains_restarts(tmp_path):
    series = read_metrics_csv(write_metrics_csv(tmp_path / "metrics.csv"))
    assert len(series["train/loss"]) == 15 and len(series["val/acc"]) == 3
    assert series["test/acc"] == [(15.0, 0.87)]
    restarted = read_metrics_csv(write_metrics_csv(tmp_path / "restart.csv", restart=True))
    steps = [step for step, _ in restarted["train/loss"]]
    assert steps == sorted(steps) and steps[10] == 11.0  # phase two starts after step 10
    assert restarted["test/acc"][0][0] == 15.0


def test_read_metrics_csv_logging_jitter_is_not_a_restart(tmp_path):
    # the pruning callback logs at the event's step, Lightning at global_step - 1: rows go 10, 9, 20, 19, ...
    path = tmp_path / "metrics.csv"
    path.write_text("step,pruning/target,train/loss\n0,0.0,\n10,0.5,\n9,,1.0\n20,0.8,\n19,,0.9\n18,,0.95\n")
    series = read_metrics_csv(path)
    assert series["pruning/target"] == [(0.0, 0.0), (10.0, 0.5), (20.0, 0.8)]
    assert series["train/loss"] == [(9.0, 1.0), (18.0, 0.95), (19.0, 0.9)]


@pytest.fixture
def drawn(monkeypatch):
    """The figures the plot functions save, by file name, so that tests check what was drawn (the artists)."""
    figures = {}
    save = plots._save

    def recording(fig, out_png):
        figures[Path(out_png).name] = fig
        return save(fig, out_png)

    monkeypatch.setattr(plots, "_save", recording)
    return figures


def curves(ax):
    """Label -> (x, y) of every labelled line of ``ax``."""
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.lines}


def test_plot_training_curves_draws_the_csv(tmp_path, drawn):
    csv_path = write_metrics_csv(tmp_path / "metrics.csv")
    out = plot_training_curves(csv_path, tmp_path / "plots" / "curves.png")
    assert out == tmp_path / "plots" / "curves.png" and out.read_bytes().startswith(PNG_MAGIC)
    rows = list(csv.DictReader(csv_path.open()))
    steps = [float(row["step"]) for row in rows if row["train/acc"]]
    column = {key: [float(row[key]) for row in rows if row[key]] for key in rows[0] if key not in ("epoch", "step")}
    top, bottom = drawn["curves.png"].axes
    lines = curves(top)
    for label, key in [("fc1.weight", "fc1.weight"), ("fc2.weight", "fc2.weight"), ("total", "total")]:
        assert lines[label] == (steps, column[f"pruning/sparsity/{key}"]), label
    assert lines["target"] == (steps, column["pruning/target"])
    target = column["pruning/target"]
    changes = [step for step, a, b in zip(steps[1:], target, target[1:], strict=False) if a != b]
    assert lines[f"pruning events ({len(changes) + 1})"][0] == [steps[0], *changes]  # each change of the target
    lines = curves(bottom)
    assert lines["train/acc"] == (steps, column["train/acc"])
    assert lines["val/acc"][1] == column["val/acc"]
    assert lines["test/acc"] == ([15.0], column["test/acc"])
    assert [text.get_text() for text in bottom.texts] == [f"{100 * column['test/acc'][0]:.1f}%"]


@pytest.mark.parametrize(
    "content",
    ["epoch,step,train/loss\n0,1,0.5\n", "step,val/acc\n", "epoch,step,val_acc\n0,3,0.5\n"],
    ids=["no-pruning-columns", "header-only", "unknown-columns"],
)
def test_plot_training_curves_tolerates_missing_columns(tmp_path, content, drawn):
    csv_path = tmp_path / "metrics.csv"
    csv_path.write_text(content)
    assert plot_training_curves(csv_path, tmp_path / "out.png").read_bytes().startswith(PNG_MAGIC)
    (ax,) = drawn["out.png"].axes  # no pruning column: the accuracy panel alone
    assert list(ax.lines) == [] and [text.get_text() for text in ax.texts] == ["no accuracy columns in metrics.csv"]
    assert drawn["out.png"]._suptitle.get_text() == "Accuracy over training (no pruning)"


def test_plot_training_curves_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        plot_training_curves(tmp_path / "absent.csv", tmp_path / "out.png")


def bars(ax):
    """Label -> width of every bar of a horizontal bar chart."""
    names = [label.get_text() for label in ax.get_yticklabels()]
    return dict(zip(names, [bar.get_width() for bar in ax.patches], strict=True))


def test_plot_layer_sparsity(tmp_path, drawn):
    model = known_zeros_model()
    summary = summarize(model, input_shape=(4,))
    out = plot_layer_sparsity(summary, tmp_path / "layers.png")
    assert out.read_bytes().startswith(PNG_MAGIC)
    ax = drawn["layers.png"].axes[0]
    zeros = {f"{index}.weight": float((model[index].weight == 0).float().mean()) for index in (0, 2)}
    assert bars(ax) == zeros  # counted here, independently of summarize
    assert [text.get_text() for text in ax.texts] == [f"{100 * value:.1f}%" for value in zeros.values()]
    assert ax.get_title() == f"Per-layer sparsity (total {100 * summary.total_sparsity:.1f}%)"
    from_dict = plot_layer_sparsity({"layer_sparsity": {"a": 0.2}}, tmp_path / "dict.png")
    assert from_dict.read_bytes().startswith(PNG_MAGIC) and bars(drawn["dict.png"].axes[0]) == {"a": 0.2}
    assert plot_layer_sparsity(RunSummary(), tmp_path / "empty.png").read_bytes().startswith(PNG_MAGIC)
    empty = drawn["empty.png"].axes[0]
    assert list(empty.patches) == [] and [t.get_text() for t in empty.texts] == ["no per-layer sparsity in the summary"]


# --------------------------------------------------------------------------------------------------------------------
# Multirun report
# --------------------------------------------------------------------------------------------------------------------


def make_multirun(root):
    """A Hydra-like sweep: jobs 0, 1 and 10 (to check natural order), one without overrides, one not finished."""
    sweep = root / "multirun" / "2024-01-01" / "12-00-00"
    jobs = {
        "0": (["prune.amount=0.5", "model=lenet300100"], 0.5, 0.97),
        "1": (["prune.amount=0.9", "model=lenet300100", "+seed=1"], 0.9, 0.95),
        "10": (None, 0.8, 0.96),
    }
    for job, (overrides, sparsity, acc) in jobs.items():
        run = sweep / job
        if overrides is not None:
            (run / ".hydra").mkdir(parents=True)
            (run / ".hydra" / "overrides.yaml").write_text("".join(f"- {item}\n" for item in overrides))
        RunSummary(
            dense_test_acc=0.98,
            final_test_acc=acc,
            total_sparsity=sparsity,
            compression_ratio=1 / (1 - sparsity),
            theoretical_speedup=2.0,
        ).to_json(run / "summary.json")
    (sweep / "2" / ".hydra").mkdir(parents=True)  # a job that died before writing its summary
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    return sweep


def test_collect_runs(tmp_path):
    sweep = make_multirun(tmp_path)
    runs = collect_runs(sweep)
    assert [run.run_dir for run in runs] == [str(sweep / job) for job in ("0", "1", "10")]
    assert runs[0].overrides == ["prune.amount=0.5", "model=lenet300100"]
    assert runs[2].overrides == []
    assert [run.final_test_acc for run in runs] == [0.97, 0.95, 0.96]
    assert len(collect_runs(tmp_path)) == 3  # any parent works
    with pytest.raises(FileNotFoundError, match="not found"):
        collect_runs(tmp_path / "nope")


def test_write_report(tmp_path, drawn):
    sweep = make_multirun(tmp_path)
    markdown = write_report(sweep)
    assert (sweep / "report.md").read_text() == markdown
    assert (sweep / "accuracy_vs_sparsity.png").read_bytes().startswith(PNG_MAGIC)
    ax = drawn["accuracy_vs_sparsity.png"].axes[0]
    points = sorted((float(line.get_xdata()[0]), float(line.get_ydata()[0])) for line in ax.lines if not line.get_gid())
    runs = collect_runs(sweep)  # one arm per run here: each differs in a setting other than sparsity and seed
    expected = sorted((1 - run.total_sparsity, 100 * run.final_test_acc) for run in runs)
    assert [x for pair in points for x in pair] == pytest.approx([x for pair in expected for x in pair])
    (dense,) = [line for line in ax.lines if line.get_gid() == "dense-reference"]
    assert list(dense.get_ydata()) == pytest.approx([100 * runs[0].dense_test_acc] * 2)
    lines = markdown.splitlines()
    header = next(line for line in lines if line.startswith("| run"))
    assert header == "| run | prune.amount | model | seed | sparsity | dense acc | final acc | compression | speed-up |"
    rows = [line for line in lines if line.startswith("| ") and line != header]
    assert rows == [
        "| 0 | 0.5 | lenet300100 |  | 50.0% | 98.00% | 97.00% | 2.00x | 2.00x |",
        "| 1 | 0.9 | lenet300100 | 1 | 90.0% | 98.00% | 95.00% | 10.00x | 2.00x |",
        "| 10 |  |  |  | 80.0% | 98.00% | 96.00% | 5.00x | 2.00x |",
    ]
    assert "![accuracy versus sparsity](accuracy_vs_sparsity.png)" in markdown


def test_write_report_custom_outputs_and_empty_dir(tmp_path):
    sweep = make_multirun(tmp_path)
    out_md, out_png = tmp_path / "out" / "r.md", tmp_path / "pngs" / "a.png"
    markdown = write_report(sweep, out_md=out_md, out_png=out_png)
    assert out_md.exists() and out_png.read_bytes().startswith(PNG_MAGIC)
    assert "](../pngs/a.png)" not in markdown  # the link is relative only when below the Markdown's folder
    assert str(out_png.resolve()) in markdown
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no summary\.json"):
        write_report(tmp_path / "empty")


def test_report_main(tmp_path, capsys):
    sweep = make_multirun(tmp_path)
    assert report_main([str(sweep), "--out-md", str(tmp_path / "r.md")]) == 0
    printed = capsys.readouterr().out
    assert "| 1 | 0.9 |" in printed and (tmp_path / "r.md").read_text() in printed
    (tmp_path / "empty").mkdir()
    assert report_main([str(tmp_path / "empty")]) == 1
    assert "no summary.json" in capsys.readouterr().err


def test_runs_without_a_summary_are_listed_as_skipped_with_their_logged_reason(tmp_path):
    sweep = make_multirun(tmp_path)
    (sweep / "2" / "app.log").write_text(
        "[2024-01-01 12:00:00,000][lightprune.experiment.app][INFO] - starting\n"
        "[2024-01-01 12:00:01,000][lightprune.experiment.app][ERROR] - invalid experiment config: data.root=None: ...\n"
    )
    (sweep / "3" / ".hydra").mkdir(parents=True)  # killed before it logged anything
    runs, skipped = scan_runs(sweep)
    assert len(runs) == 3
    assert [(Path(s.run_dir).name, s.reason) for s in skipped] == [
        ("2", "invalid experiment config: data.root=None: ..."),
        ("3", "no summary.json and no error in its log (the run was stopped, or is still running)"),
    ]
    markdown = write_report(sweep)
    assert "Skipped 2 run(s) without a summary.json:" in markdown
    assert "- 2: invalid experiment config: data.root=None: ..." in markdown


def test_a_corrupt_summary_is_named_in_one_line(tmp_path, capsys):
    sweep = make_multirun(tmp_path)
    (sweep / "1" / "summary.json").write_text('{"final_test_acc": 0.9,')  # cut off mid-write
    with pytest.raises(ValueError, match=r"1/summary\.json: not a valid run summary"):
        collect_runs(sweep)
    assert report_main([str(sweep)]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and str(sweep / "1" / "summary.json") in err
    (sweep / "1" / "summary.json").write_text("[1, 2]")  # JSON, but no summary
    with pytest.raises(ValueError, match=r"1/summary\.json: not a valid run summary \(a run summary must be"):
        collect_runs(sweep)


def test_seed_sweep_gets_mean_and_std_per_arm(tmp_path):
    accuracies = {("global", 0): 0.90, ("global", 1): 0.92, ("layerwise", 0): 0.80, ("layerwise", 1): 0.84}
    for job, ((scope, seed), acc) in enumerate(accuracies.items()):
        run = tmp_path / str(job)
        (run / ".hydra").mkdir(parents=True)
        overrides = f"- pruning.scope={scope}\n- seed={seed}\n- pruning.final_sparsity=0.9\n"
        (run / ".hydra" / "overrides.yaml").write_text(overrides)
        RunSummary(total_sparsity=0.9, final_test_acc=acc, dense_test_acc=0.95 + 0.01 * seed).to_json(
            run / "summary.json"
        )
    markdown = write_report(tmp_path)
    assert "| pruning.scope | sparsity | runs | dense acc | final acc |" in markdown
    assert "| global | 90.0% | 2 | 95.50 ± 0.71% | 91.00 ± 1.41% |" in markdown
    assert "| layerwise | 90.0% | 2 | 95.50 ± 0.71% | 82.00 ± 2.83% |" in markdown
    arms = group_arms(collect_runs(tmp_path))
    assert [(arm.label, arm.points) for arm in arms] == [
        ("pruning.scope=global", [(0.9, [0.9, 0.92])]),
        ("pruning.scope=layerwise", [(0.9, [0.8, 0.84])]),
    ]


def test_no_seed_table_without_repeated_runs(tmp_path):
    assert "Mean ± standard deviation" not in write_report(make_multirun(tmp_path))


def test_overrides_stored_in_the_summary_are_used_when_the_run_has_no_hydra_dir(tmp_path):
    RunSummary(total_sparsity=0.5, final_test_acc=0.9, overrides=["seed=3"], run_dir="/elsewhere").to_json(
        tmp_path / "moved" / "summary.json"
    )
    (run,) = collect_runs(tmp_path)
    assert run.overrides == ["seed=3"] and run.run_dir == str(tmp_path / "moved")


def test_the_default_selection_is_the_callbacks_transposed_convolutions_excepted() -> None:
    """summary.json's totals agree with the callback's logged ones: both leave transposed convolutions alone."""
    from lightprune.experiment.summary import sparsity_by_layer

    model = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.ConvTranspose2d(2, 1, 3), torch.nn.Linear(4, 2))
    assert list(sparsity_by_layer(model)) == ["0.weight", "2.weight"]


def test_runs_of_an_earlier_sweep_into_the_same_folder_are_named(tmp_path: Path) -> None:
    """A second sweep into a folder rewrites its multirun.yaml; the first sweep's runs stay and are reported, named."""
    for job, (sparsity, seed) in enumerate([(0.5, 0), (0.6, 1), (0.8, 1)]):
        run = tmp_path / f"{job}-s{sparsity}"
        (run / ".hydra").mkdir(parents=True)
        (run / ".hydra" / "overrides.yaml").write_text(f"- pruning.final_sparsity={sparsity}\n- seed={seed}\n")
        RunSummary(total_sparsity=sparsity, final_test_acc=0.9).to_json(run / "summary.json")
    multirun = "hydra:\n  overrides:\n    task:\n    - pruning.final_sparsity=0.6,0.8\n    - seed=1\n"
    (tmp_path / "multirun.yaml").write_text(multirun)
    markdown = write_report(tmp_path)
    assert (
        "1 of the runs were not made by the sweep multirun.yaml describes (the last one into this folder): 0-s0.5"
        in (markdown)
    )
    (tmp_path / "multirun.yaml").write_text(multirun.replace("0.6,0.8", "0.5,0.6,0.8").replace("seed=1", "seed=0,1"))
    assert "were not made by the sweep" not in write_report(tmp_path)
