"""Searching with Hydra's Optuna sweeper: the app's job returns its ``objective``, the ``sparsity_search`` preset,
``report`` on a search (Pareto front marked), a search stopped and continued from sqlite storage, and parallel trials.

The sweeps run the real sweeper on the bundled digits, in this process (``main(["-m", ...])``, as the console
script does), with 1 dense epoch and 2 pruning epochs of 5 steps: a trial takes a second or two, and the trials of
a sweep share one dense phase (the cache).
"""

from __future__ import annotations

import math
import sqlite3
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any, get_type_hints

import lightning.pytorch as pl
import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import lightprune.experiment.app as app
from lightprune.experiment.app import config_dir, main
from lightprune.experiment.config import OBJECTIVES, ConfigError, ExperimentConfig, register_configs, validate_config
from lightprune.experiment.plots import draw_pareto
from lightprune.experiment.report import RunSummary, collect_runs, write_report
from lightprune.experiment.search import objective_value, pareto_front, read_optimization_results

optuna = pytest.importorskip("optuna")
pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")

SMALL = [
    "trainer.dense_epochs=1",
    "trainer.max_epochs=2",
    "trainer.enable_progress_bar=false",
    "trainer.num_threads=1",
    "data.batch_size=256",
    "plots=false",
    "save_model=false",
]
"""A trial of a second or two (no plots, no export); usable with any experiment preset."""

OPTUNA = [
    "hydra/sweeper=optuna",
    "hydra.sweeper.n_jobs=1",
    "hydra/sweeper/sampler=random",
    "hydra.sweeper.sampler.seed=0",
]
SPARSITY = "pruning.final_sparsity=interval(0.5,0.95)"


def sweep(sweep_dir: Path, *overrides: str) -> None:
    """Run ``lightprune-experiment -m <overrides>`` into ``sweep_dir``; it must succeed."""
    assert main(["-m", *overrides, *SMALL, f"hydra.sweep.dir={sweep_dir}"]) == 0


def summaries(sweep_dir: Path) -> dict[str, RunSummary]:
    """The trials' summaries by run directory name."""
    return {Path(run.run_dir).name: run for run in collect_runs(sweep_dir)}  # type: ignore[arg-type]


def dominated(point: Sequence[float], others: Sequence[Sequence[float]]) -> bool:
    """Reference: some other point is at least as good in both and better in one (both maximised)."""
    return any(o[0] >= point[0] and o[1] >= point[1] and (o[0] > point[0] or o[1] > point[1]) for o in others)


def report_rows(sweep_dir: Path) -> dict[str, list[str]]:
    """The report's table: run -> cells."""
    assert main(["report", str(sweep_dir)]) == 0
    lines = [line for line in (sweep_dir / "report.md").read_text().splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[1:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows[cells[0]] = cells
        assert len(cells) == len(header)
    assert header[-1] == "Pareto front"
    return rows


# --------------------------------------------------------------------------------------------------------------------
# The objective
# --------------------------------------------------------------------------------------------------------------------


def test_objectives_are_the_scalar_fields_of_the_summary() -> None:
    hints = get_type_hints(RunSummary)
    scalar = {f.name for f in fields(RunSummary) if hints[f.name] in (float | None, int | None)}
    assert set(OBJECTIVES) == scalar


def test_objective_value_is_what_summary_json_holds(tmp_path: Path) -> None:
    summary = RunSummary(final_test_acc=0.1 + 0.2, total_sparsity=1 / 3, compression_ratio=math.inf)
    summary.to_json(tmp_path / "summary.json")
    written = RunSummary.load(tmp_path / "summary.json").to_dict()
    assert objective_value(summary.to_dict(), "final_test_acc") == written["final_test_acc"] == 0.1 + 0.2
    assert objective_value(summary.to_dict(), ["final_test_acc", "total_sparsity"]) == (0.1 + 0.2, 1 / 3)
    assert objective_value(summary.to_dict(), ["total_sparsity"]) == 1 / 3
    assert objective_value(summary.to_dict(), "compression_ratio") is None  # JSON null: the sweeper fails the trial


@pytest.mark.parametrize(
    ("objective", "shown"),
    [("accuracy", "objective='accuracy'"), (["final_test_acc", "sparsity"], "'sparsity' is not one of")],
)
def test_an_unknown_objective_names_itself_and_the_allowed_ones(objective: Any, shown: str) -> None:
    cfg = OmegaConf.structured(ExperimentConfig)
    cfg.objective = objective
    with pytest.raises(ConfigError, match=shown) as caught:
        validate_config(cfg)
    assert "final_test_acc, total_sparsity, compression_ratio" in str(caught.value)


@pytest.fixture
def no_training(monkeypatch: pytest.MonkeyPatch) -> None:
    def fit(*args: object, **kwargs: object) -> None:
        raise AssertionError("Trainer.fit ran: the config error was not caught before training")

    monkeypatch.setattr(pl.Trainer, "fit", fit)


@pytest.mark.parametrize(
    ("mode", "overrides", "message"),
    [
        ("run", ["objective=accuracy"], "objective='accuracy': one of final_test_acc, total_sparsity"),
        ("sweep", [*OPTUNA, "objective=accuracy", SPARSITY], "objective='accuracy': one of final_test_acc"),
        (
            "sweep",
            [*OPTUNA, "objective=[final_test_acc,total_sparsity]", "hydra.sweeper.direction=maximize", SPARSITY],
            "gives 2 values, but hydra.sweeper.direction='maximize' optimises 1",
        ),
    ],
)
def test_an_unknown_objective_is_refused_before_training(
    no_training: None,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    mode: str,
    overrides: list[str],
    message: str,
) -> None:
    where = f"hydra.run.dir={tmp_path}" if mode == "run" else f"hydra.sweep.dir={tmp_path}"
    assert main([*(["-m"] if mode == "sweep" else []), *overrides, *SMALL, where]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 or mode == "sweep", err  # a sweep: Hydra names the failed job's overrides first
    assert err[-1].startswith("lightprune-experiment: ") and message in err[-1], err
    assert "Traceback" not in "\n".join(err)
    assert not list(tmp_path.rglob("summary.json"))


# --------------------------------------------------------------------------------------------------------------------
# Real sweeps
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_one_objective_the_best_value_is_the_best_final_test_acc(tmp_path: Path) -> None:
    sweep(tmp_path, *OPTUNA, "hydra.sweeper.n_trials=3", "hydra.sweeper.direction=maximize", SPARSITY)
    runs = summaries(tmp_path)
    assert len(runs) == 3
    results = read_optimization_results(tmp_path)
    assert results is not None
    best = max(runs.values(), key=lambda run: run.final_test_acc)  # type: ignore[arg-type,return-value]
    assert results.best_value == best.final_test_acc  # exactly: the job returns what summary.json holds
    assert [name for name, run in runs.items() if results.matches(run.overrides)] == [Path(best.run_dir).name]


@pytest.mark.slow
def test_two_objectives_every_pareto_entry_is_one_trials_accuracy_and_sparsity(tmp_path: Path) -> None:
    two = ["objective=[final_test_acc,total_sparsity]", "hydra.sweeper.direction=[maximize,maximize]"]
    sweep(tmp_path, *OPTUNA, *two, "hydra.sweeper.n_trials=4", SPARSITY)
    runs = summaries(tmp_path)
    points = {name: (run.final_test_acc, run.total_sparsity) for name, run in runs.items()}
    results = read_optimization_results(tmp_path)
    assert results is not None and results.solutions
    entries = [tuple(values) for _, values in results.solutions]
    assert all(entry in points.values() for entry in entries)  # exactly one trial's values, not rounded
    expected = {p for p in points.values() if not dominated(p, [o for o in points.values() if o != p])}
    assert set(entries) == expected

    rows = report_rows(tmp_path)
    marked = {name for name, cells in rows.items() if cells[-1] == "yes"}
    assert marked == {name for name, p in points.items() if p in expected}


@pytest.mark.slow
def test_the_sparsity_search_preset(tmp_path: Path) -> None:
    register_configs()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        cfg = compose("config", overrides=["experiment=sparsity_search"], return_hydra_config=True)
    assert list(cfg.objective) == ["final_test_acc", "total_sparsity"]
    sweeper = cfg.hydra.sweeper
    assert sweeper._target_.endswith("LightpruneOptunaSweeper")
    assert sweeper.sampler._target_ == "optuna.samplers.NSGAIISampler" and sweeper.sampler.seed == 0
    assert list(sweeper.direction) == ["maximize", "maximize"]
    assert "pruning.final_sparsity" in sweeper.params
    assert str(OmegaConf.to_container(cfg.hydra.sweep)["dir"]).startswith("multirun/${hydra.sweeper.study_name}/")

    sweep(tmp_path, "experiment=sparsity_search", "hydra.sweeper.n_trials=3")
    runs = summaries(tmp_path)
    assert len(runs) == 3
    params = [{key: run.config["pruning"][key] for key in ("final_sparsity", "end")} for run in runs.values()]
    assert len({tuple(p.values()) for p in params}) == 3  # each trial its own point of the space
    assert all(0.5 <= p["final_sparsity"] <= 0.99 for p in params)
    results = read_optimization_results(tmp_path)
    assert results is not None
    points = [(run.final_test_acc, run.total_sparsity) for run in runs.values()]
    assert sorted(tuple(values) for _, values in results.solutions) == sorted(points[i] for i in pareto_front(points))
    rows = report_rows(tmp_path)
    assert sum(cells[-1] == "yes" for cells in rows.values()) == len(results.solutions)
    assert "The sweeper's Pareto front of its objectives" in (tmp_path / "report.md").read_text()


@pytest.mark.slow
def test_a_stopped_search_continues_from_sqlite_storage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    database = tmp_path / "study.db"
    sweep_dir = tmp_path / "sweep"
    search = [
        "hydra/sweeper=lightprune_optuna",
        "hydra/sweeper/sampler=random",
        "hydra.sweeper.sampler.seed=0",
        "hydra.sweeper.n_jobs=1",
        "hydra.sweeper.direction=maximize",
        f"hydra.sweeper.storage=sqlite:///{database}",
        "hydra.sweeper.study_name=stopped",
        "hydra.sweeper.n_trials=4",
        SPARSITY,
    ]
    started = 0
    run_experiment = app.run_experiment

    def stopped_in_the_third_trial(*args: Any, **kwargs: Any) -> Any:
        nonlocal started
        started += 1
        if started == 3:
            raise KeyboardInterrupt  # Ctrl-C during the third trial
        return run_experiment(*args, **kwargs)

    monkeypatch.setattr(app, "run_experiment", stopped_in_the_third_trial)
    with pytest.raises(KeyboardInterrupt):
        main(["-m", *search, *SMALL, f"hydra.sweep.dir={sweep_dir}"])
    first = summaries(sweep_dir)
    assert len(first) == 2
    kept = {name: (sweep_dir / name / "summary.json").read_bytes() for name in first}
    assert len(report_rows(sweep_dir)) == 2  # a stopped search is reported as a search
    assert "wrote no optimization_results.yaml" in (sweep_dir / "report.md").read_text()

    monkeypatch.setattr(app, "run_experiment", run_experiment)
    sweep(sweep_dir, *search)  # the same command again
    runs = summaries(sweep_dir)
    assert len(runs) == 4  # n_trials counts the study's trials: 2 more, not 4
    assert {name: (sweep_dir / name / "summary.json").read_bytes() for name in first} == kept  # kept, not rerun
    sparsities = [run.config["pruning"]["final_sparsity"] for run in runs.values()]
    assert len(set(sparsities)) == 4  # the continued sampler drew new points
    assert sorted(int(name.split("-")[0]) for name in runs) == [0, 1, 3, 4]  # job number = trial number

    with sqlite3.connect(database) as connection:
        states = [state for (state,) in connection.execute("SELECT state FROM trials ORDER BY number")]
    assert states == ["COMPLETE", "COMPLETE", "FAIL", "COMPLETE", "COMPLETE"]
    results = read_optimization_results(sweep_dir)
    assert results is not None
    assert results.best_value == max(run.final_test_acc for run in runs.values())  # type: ignore[type-var]

    rows = report_rows(sweep_dir)  # both invocations' trials, and the stopped one
    assert len(rows) == 4
    markdown = (sweep_dir / "report.md").read_text()
    assert "Skipped 1 run(s)" in markdown and "2-" in markdown.split("Skipped 1 run(s)")[1]

    complete = tmp_path / "complete"
    sweep(complete, *search)  # the study has its 4 trials: nothing runs, the results are written all the same
    assert summaries(complete) == {} and summaries(sweep_dir).keys() == runs.keys()
    again = read_optimization_results(complete)
    assert again is not None and again.best_value == results.best_value


@pytest.mark.slow
def test_parallel_trials_with_the_joblib_launcher(tmp_path: Path) -> None:
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    parallel = ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "hydra.sweeper.n_jobs=2"]
    sweep(tmp_path, *OPTUNA, *parallel, "hydra.sweeper.n_trials=2", "hydra.sweeper.direction=maximize", SPARSITY)
    runs = summaries(tmp_path)
    assert len(runs) == 2
    assert sorted(run.dense_cache for run in runs.values()) == ["loaded", "stored"]  # one dense phase, shared
    results = read_optimization_results(tmp_path)
    assert results is not None
    assert results.best_value == max(run.final_test_acc for run in runs.values())  # type: ignore[type-var]


# --------------------------------------------------------------------------------------------------------------------
# Pieces
# --------------------------------------------------------------------------------------------------------------------


def test_pareto_front_against_the_reference() -> None:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    values = st.sampled_from([0.1, 0.5, 0.9, 0.95, 1.0])  # few values: ties and duplicates are common

    @settings(max_examples=60, deadline=None)
    @given(st.lists(st.tuples(values, values), max_size=12))
    def check(points: list[tuple[float, float]]) -> None:
        front = pareto_front(points)
        assert front == [i for i, p in enumerate(points) if not dominated(p, points[:i] + points[i + 1 :])]

    check()


def test_the_pareto_plot_joins_the_front_and_shows_every_trial() -> None:
    points = [(0.5, 0.95), (0.9, 0.93), (0.8, 0.90), (0.95, 0.70)]
    fig = draw_pareto(points, front=[0, 1, 3], dense=[0.96])
    ax = fig.axes[0]
    lines = {line.get_gid(): line for line in ax.get_lines()}
    front_x = list(lines["pareto-front"].get_xdata())
    assert front_x == pytest.approx([0.5, 0.1, 0.05])  # weights kept, in increasing sparsity
    assert list(lines["pareto-front"].get_ydata()) == pytest.approx([95, 93, 70])
    assert list(lines["trials"].get_xdata()) == pytest.approx([0.2])
    assert lines["dense-reference"].get_ydata()[0] == pytest.approx(96)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "Pareto front (3 of 4 trials)",
        "other trials",
        "dense",
    ]
    assert ax.get_ylabel() == "final test accuracy (%)" and "log scale" in ax.get_xlabel()


def test_the_pareto_plot_draws_dense_accuracies_that_differ_as_a_range() -> None:
    """A search over the model or the data has trials with other dense phases: no one line stands for them."""
    fig = draw_pareto([(0.5, 0.9), (0.9, 0.8)], front=[0, 1], dense=[0.8663, 0.1643, 0.8663])
    ax = fig.axes[0]
    assert "dense-reference" not in {line.get_gid() for line in ax.get_lines()}
    (band,) = [patch for patch in ax.patches if patch.get_gid() == "dense-range"]
    assert band.get_y() == pytest.approx(16.43) and band.get_y() + band.get_height() == pytest.approx(86.63)
    assert [t.get_text() for t in ax.get_legend().get_texts()][-1].startswith("dense: 16.43-86.63%")


def _trial(root: Path, invocation: str, job: int, sparsity: float, storage: str | None) -> None:
    run = root / invocation / str(job)
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text(f"- pruning.final_sparsity={sparsity}\n")
    sweeper = {"_target_": "hydra_plugins.lightprune_optuna_sweeper.LightpruneOptunaSweeper",
               "storage": storage, "study_name": "sparsity_search"}  # fmt: skip
    (run / ".hydra" / "hydra.yaml").write_text(yaml.safe_dump({"hydra": {"sweeper": sweeper}}))
    RunSummary(total_sparsity=sparsity, final_test_acc=0.9, dense_test_acc=0.95).to_json(run / "summary.json")


@pytest.mark.parametrize("storage", [None, "sqlite:///study.db"])
def test_a_report_covers_one_search_and_refuses_separate_ones(tmp_path: Path, storage: str | None) -> None:
    """Two invocations are one study when a storage continues it; without one, each is a search of its own."""
    for invocation in ("first", "second"):
        for job in range(2):
            _trial(tmp_path, invocation, job + 2 * (invocation == "second"), 0.5 + 0.1 * job, storage)
    if storage is None:
        with pytest.raises(ValueError, match=r"holds the trials of 2 separate Optuna searches \(first, second\)"):
            write_report(tmp_path)
        assert "4 run(s)" not in write_report(tmp_path / "first")  # each folder on its own
    else:
        assert "4 run(s)" in write_report(tmp_path)


def test_optimization_results_of_a_single_objective(tmp_path: Path) -> None:
    (tmp_path / "optimization_results.yaml").write_text(
        yaml.safe_dump({"name": "optuna", "best_params": {"pruning.final_sparsity": 0.7}, "best_value": 0.9})
    )
    results = read_optimization_results(tmp_path)
    assert results is not None and results.best_value == 0.9 and not results.solutions
    assert results.matches(["pruning.final_sparsity=0.7"]) and not results.matches(["pruning.final_sparsity=0.75"])
    (tmp_path / "other").mkdir()
    assert read_optimization_results(tmp_path / "other") is None
