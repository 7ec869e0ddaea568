"""End-to-end tests of the experiment app: every pruning preset at tiny size, config errors, the console script,
``python -m``, a real Hydra multirun and the ``report`` subcommand.

Runs compose the config with Hydra's compose API (as the console script does) and call ``run_experiment`` in this
process. ``experiment=smoke`` (1 dense epoch, 2 pruning epochs, 1 CPU thread) with ``data.batch_size=256`` makes a
run take a second or two; subprocess tests pay a few seconds of imports each and are marked slow.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import DictConfig

import lightprune.experiment.app as app
from lightprune.experiment import cache as dense_cache
from lightprune.experiment import load_run
from lightprune.experiment.app import config_dir, main, run_experiment
from lightprune.experiment.config import ConfigError, register_configs
from lightprune.experiment.data import write_idx
from lightprune.experiment.report import RunSummary, scan_runs
from lightprune.experiment.targets import build_datamodule

TINY = ["experiment=smoke", "data.batch_size=256"]
"""1 dense epoch and 2 pruning epochs of 5 steps each, one CPU thread: a run takes a second or two."""

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_config(*overrides: str) -> DictConfig:
    """The app's config for ``overrides``, composed like the console script composes it."""
    register_configs()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose("config", overrides=list(overrides))


@pytest.fixture
def no_training(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any ``Trainer.fit`` fail the test: config errors must surface before training."""

    def fit(*args: object, **kwargs: object) -> None:
        raise AssertionError("Trainer.fit ran: the config error was not caught before training")

    monkeypatch.setattr(pl.Trainer, "fit", fit)


# --------------------------------------------------------------------------------------------------------------------
# Checking a run directory
# --------------------------------------------------------------------------------------------------------------------


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def last_value(rows: list[dict[str, str]], column: str) -> float:
    values = [float(row[column]) for row in rows if row.get(column)]
    assert values, f"no value in column {column}"
    return values[-1]


def check_run_dir(run_dir: Path, phases: Sequence[str], pruned: bool) -> RunSummary:
    """Every output of a run exists and parses; returns the summary. Per-phase checks are the caller's."""
    summary = RunSummary.load(run_dir / "summary.json")
    assert 0.0 <= summary.dense_test_acc <= 1.0
    assert 0.0 <= summary.final_test_acc <= 1.0
    assert summary.total_weights > 0
    assert summary.config["trainer"]["max_epochs"] == 2
    assert summary.wall_time_s > 0

    for phase in phases:
        rows = read_csv(run_dir / "logs" / phase / "metrics.csv")
        assert rows, phase
        assert any(row.get("train/loss") for row in rows), phase
        assert last_value(rows, "test/acc") >= 0.0
        if pruned and phase != "dense":
            assert "pruning/sparsity/total" in rows[0], phase
    if pruned:
        final_rows = read_csv(run_dir / "logs" / phases[-1] / "metrics.csv")
        assert last_value(final_rows, "pruning/sparsity/total") == pytest.approx(summary.total_sparsity, abs=1e-6)

    # all phases laid end to end, steps counted from the start of the run
    combined = read_csv(run_dir / "logs" / "all_phases.csv")
    assert [phase for phase in dict.fromkeys(row["phase"] for row in combined)] == list(phases)
    first_steps = {}
    for row in combined:
        first_steps.setdefault(row["phase"], int(row["step"]))
    assert sorted(first_steps.values()) == list(first_steps.values())
    assert first_steps[phases[-1]] > 0

    for png in ("training_curves.png", "layer_sparsity.png"):
        assert (run_dir / png).read_bytes()[:8] == PNG_MAGIC, png

    state_dict = torch.load(run_dir / "model.pt", weights_only=True)
    assert all(isinstance(tensor, torch.Tensor) for tensor in state_dict.values())
    assert not any(key.endswith(("_orig", "_mask")) for key in state_dict), sorted(state_dict)
    for qualified, sparsity in summary.layer_sparsity.items():
        weight = state_dict[qualified.removeprefix("model.")]
        assert float((weight == 0).sum()) / weight.numel() == pytest.approx(sparsity)
    return summary


def assert_exact_sparsity(summary: RunSummary, target: float) -> None:
    """The callback prunes exactly ``round(target * n)`` of the ``n`` selected weights."""
    n = summary.total_weights
    assert summary.nonzero_weights == n - round(target * n)  # exact, in integers
    assert summary.total_sparsity == pytest.approx(round(target * n) / n, rel=0, abs=1e-12)  # 1 - nonzero / n


# --------------------------------------------------------------------------------------------------------------------
# End to end, in process
# --------------------------------------------------------------------------------------------------------------------


def test_default_preset_gmp_cubic_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    threads = torch.get_num_threads()
    summary = run_experiment(make_config(*TINY), tmp_path, overrides=TINY)
    assert RunSummary.load(tmp_path / "summary.json") == summary
    assert summary.overrides == TINY and summary.run_dir == str(tmp_path.resolve())
    assert (summary.input_shape, summary.num_classes, summary.dense_cache) == ([1, 8, 8], 10, "stored")
    check_run_dir(tmp_path, ["dense", "prune"], pruned=True)
    assert_exact_sparsity(summary, 0.9)
    assert summary.total_weights == 64 * 300 + 300 * 100 + 100 * 10
    assert sorted(summary.layer_sparsity) == ["model.fc1.weight", "model.fc2.weight", "model.fc3.weight"]
    # the cubic ramp reaches its target in several events, all logged
    rows = read_csv(tmp_path / "logs" / "prune" / "metrics.csv")
    targets = sorted({float(row["pruning/target"]) for row in rows if row.get("pruning/target")})
    assert len(targets) > 3 and targets[-1] == pytest.approx(0.9)
    assert torch.get_num_threads() == threads  # the smoke preset's trainer.num_threads=1 is undone after the run

    # the documented one-liner rebuilds the pruned model from the run directory
    model = load_run(tmp_path)
    state_dict = torch.load(tmp_path / "model.pt", weights_only=True)
    assert all(torch.equal(model.state_dict()[key], value) for key, value in state_dict.items())
    assert not model.training and model(torch.zeros(2, 1, 8, 8)).shape == (2, 10)
    capsys.readouterr()
    assert main(["load", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("LeNet300100(") and "fc2.weight" in printed and "load_run(" in printed


@pytest.mark.slow
@pytest.mark.parametrize("sparsity", [0.5, 0.95])
def test_one_shot_hits_the_target_exactly(tmp_path: Path, sparsity: float) -> None:
    summary = run_experiment(make_config(*TINY, "pruning=one_shot", f"pruning.final_sparsity={sparsity}"), tmp_path)
    check_run_dir(tmp_path, ["dense", "prune"], pruned=True)
    assert_exact_sparsity(summary, sparsity)


@pytest.mark.slow
def test_none_preset_trains_without_pruning(tmp_path: Path) -> None:
    summary = run_experiment(make_config(*TINY, "pruning=none"), tmp_path)
    check_run_dir(tmp_path, ["dense", "prune"], pruned=False)
    assert summary.total_sparsity == 0.0
    assert summary.nonzero_weights == summary.total_weights
    assert "pruning/sparsity/total" not in read_csv(tmp_path / "logs" / "prune" / "metrics.csv")[0]


@pytest.mark.slow
def test_iterative_rounds_prune_geometrically_and_rewind(tmp_path: Path) -> None:
    summary = run_experiment(make_config(*TINY, "pruning=iterative_rounds", "pruning.rounds=2"), tmp_path)
    check_run_dir(tmp_path, ["dense", "round_1", "round_2"], pruned=True)
    assert_exact_sparsity(summary, 0.9)
    first = 1 - math.sqrt(0.1)  # the same fraction of what remains in each round
    n = summary.total_weights
    assert summary.metrics["round_1/target_sparsity"] == pytest.approx(first)
    assert summary.metrics["round_2/target_sparsity"] == 0.9
    assert summary.metrics["round_1/sparsity"] == pytest.approx(round(first * n) / n, abs=1e-9)  # measured
    assert summary.metrics["round_2/sparsity"] == summary.total_sparsity
    assert summary.metrics["round_2/test_acc"] == summary.final_test_acc
    round_1 = read_csv(tmp_path / "logs" / "round_1" / "metrics.csv")
    assert last_value(round_1, "pruning/sparsity/total") == pytest.approx(round(first * n) / n, abs=1e-6)
    assert not (tmp_path / "logs" / "round_3").exists()


def test_a_run_into_an_earlier_runs_directory_leaves_nothing_of_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No file may contradict the new ``summary.json``: the earlier run's model, plots and phase logs go."""
    run_experiment(make_config(*TINY, "pruning=iterative_rounds", "pruning.rounds=2"), tmp_path)
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "logs" / "round_2").is_dir()
    with caplog.at_level(logging.WARNING):
        summary = run_experiment(make_config(*TINY, "save_model=false", "plots=false"), tmp_path)
    assert_exact_sparsity(summary, 0.9)
    left = sorted(str(path.relative_to(tmp_path)) for path in tmp_path.rglob("*") if path.is_file())
    assert not [name for name in left if name.startswith(("model", "logs/round")) or name.endswith(".png")], left
    assert RunSummary.load(tmp_path / "summary.json").final_test_acc == summary.final_test_acc
    assert "removed outputs of an earlier run" in caplog.text and "logs/round_1" in caplog.text


@pytest.mark.slow
def test_ln_structured_prunes_channels_and_keeps_the_classifier(tmp_path: Path) -> None:
    summary = run_experiment(make_config(*TINY, "pruning=ln_structured", "model=small_cnn"), tmp_path)
    check_run_dir(tmp_path, ["dense", "prune"], pruned=True)
    assert summary.layer_sparsity == {"model.conv1.weight": 0.5, "model.conv2.weight": 0.5}
    assert summary.layer_channels == {"model.conv1.weight": [8, 16], "model.conv2.weight": [16, 32]}
    state_dict = torch.load(tmp_path / "model.pt", weights_only=True)
    for layer, channels in (("conv1", 16), ("conv2", 32)):
        weight, bias = state_dict[f"{layer}.weight"], state_dict[f"{layer}.bias"]
        dead = weight.flatten(1).abs().sum(dim=1) == 0
        assert int(dead.sum()) == channels // 2
        assert torch.all(bias[dead] == 0)  # prune_channel_bias: the pruned channels' biases are zero too
    assert int((state_dict["fc.weight"] == 0).sum()) == 0  # exclude_classifier


@pytest.mark.slow
def test_cnn_channels_experiment_preset(tmp_path: Path) -> None:
    tiny = ["trainer.dense_epochs=1", "trainer.max_epochs=2", "trainer.num_threads=1", "data.batch_size=256"]
    summary = run_experiment(make_config("experiment=cnn_channels", *tiny), tmp_path)
    assert summary.layer_sparsity == {"model.conv1.weight": 0.5, "model.conv2.weight": 0.5}


@pytest.mark.slow
def test_epoch_unit_hits_the_target_exactly(tmp_path: Path) -> None:
    summary = run_experiment(make_config(*TINY, "pruning.unit=epoch", "pruning.final_sparsity=0.8"), tmp_path)
    check_run_dir(tmp_path, ["dense", "prune"], pruned=True)
    assert_exact_sparsity(summary, 0.8)


def test_idx_directory_with_limit(tmp_path: Path) -> None:
    """``data=idx`` reads any MNIST-layout directory: here 12x12 random images of 3 classes."""
    generator = torch.Generator().manual_seed(0)
    for split, count in (("train", 200), ("t10k", 60)):
        images = torch.randint(0, 256, (count, 12, 12), dtype=torch.uint8, generator=generator)
        write_idx(tmp_path / "data" / f"{split}-images-idx3-ubyte.gz", images)
        write_idx(tmp_path / "data" / f"{split}-labels-idx1-ubyte.gz", (torch.arange(count) % 3).to(torch.uint8))
    cfg = make_config(*TINY, "data=idx", f"data.root={tmp_path / 'data'}", "data.limit=100", "data.batch_size=32")
    summary = run_experiment(cfg, tmp_path / "run")
    assert summary.total_weights == 144 * 300 + 300 * 100 + 100 * 3
    assert_exact_sparsity(summary, 0.9)
    assert summary.config["data"]["limit"] == 100


def test_rewind_init_passes_the_initial_weights_to_the_callback(
    monkeypatch: pytest.MonkeyPatch, no_training: None, tmp_path: Path
) -> None:
    seen = []
    build = app.build_callback

    def spy(cfg: DictConfig, **kwargs: object) -> object:
        seen.append(kwargs.get("rewind"))
        return build(cfg, **kwargs)

    monkeypatch.setattr(app, "build_callback", spy)
    with pytest.raises(AssertionError, match=r"Trainer\.fit ran"):
        run_experiment(make_config(*TINY, "pruning=one_shot", "pruning.rewind=init"), tmp_path)
    assert isinstance(seen[-1], dict)
    assert {"model.fc1.weight", "model.fc1.bias", "model.fc3.weight"} <= set(seen[-1])


def test_build_callback_maps_the_config() -> None:
    cfg = make_config("pruning=one_shot", "pruning.final_sparsity=0.7", "pruning.rewind=init")
    callback = app.build_callback(cfg)
    assert type(callback.schedule).__name__ == "Constant"
    assert (callback.scope, callback.rewind, callback.make_permanent) == ("global", 0, True)
    assert app.build_callback(make_config("pruning=none")) is None
    structured = make_config("pruning=ln_structured", "model=small_cnn")
    with pytest.raises(ValueError, match="exclude_classifier"):
        app.build_callback(structured)  # the classifier's name comes from the model


# --------------------------------------------------------------------------------------------------------------------
# Config errors: named, and raised before any training
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("pruning.final_sparsty=0.9", "pruning.final_sparsty"),
        ("pruning.final_sparsity=abc", "pruning.final_sparsity"),
        ("data.batch_size=many", "data.batch_size"),
        ("trainer.num_threads=1.5", "trainer.num_threads"),
        ("pruning=not_a_preset", "pruning/not_a_preset"),
    ],
)
def test_misspelt_keys_and_wrong_types_fail_at_composition(override: str, key: str) -> None:
    with pytest.raises(ConfigCompositionException) as info:
        make_config(*TINY, override)
    message = str(info.value) + str(info.value.__cause__)
    assert key in message


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["pruning.final_sparsity=1.5"], "pruning.final_sparsity"),
        (["pruning.final_sparsity=-0.1"], "pruning.final_sparsity"),
        (["data.batch_size=0"], "data.batch_size"),
        (["trainer.max_epochs=0"], "trainer.max_epochs"),
        (["trainer.dense_epochs=0"], "trainer.dense_epochs"),
        (["trainer.num_threads=0"], "trainer.num_threads"),
        (["pruning.scope=diagonal"], "pruning.scope"),
        (["pruning=ln_structured", "model=small_cnn", "pruning.scope=global"], "pruning.scope"),
        (["pruning.schedule=exponential"], "pruning.schedule"),
        (["pruning.frequency=0"], "pruning.frequency"),
        (["pruning.rewind=late"], "pruning.rewind"),
        (["pruning=iterative_rounds", "pruning.rounds=0"], "pruning.rounds"),
        (["pruning.include=['model\\.fc(']"], "pruning.include"),
        (["pruning.prune_channel_bias=true"], "pruning.prune_channel_bias"),
        (["model=small_cnn", "data.flatten=true"], "data.flatten"),
        (["model.channels=[]", "model=small_cnn"], "model.channels"),
        (["data=idx"], "data.root"),
        (["data.val_size=0.5", "data.test_size=0.5"], "data.test_size"),
        (["model.optimizer=adagrad"], "model.optimizer"),
        (["pruning.seed=-1"], "pruning.seed"),
    ],
)
def test_invalid_values_fail_before_training(no_training: None, tmp_path: Path, overrides: list[str], key: str) -> None:
    cfg = make_config(*TINY, *overrides)
    run_dir = tmp_path / "run"
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        run_experiment(cfg, run_dir)
    assert not run_dir.exists()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["pruning.include=['nothing\\..*']"], "pruning.include"),
        (["pruning.method=no_such_package.Method"], "could not be imported"),
        (["model=small_cnn", "pruning=nm_2_4"], r"semi_structured with m=4 needs the input dim .*model\.conv1\.weight"),
        (["pruning.max_layer_sparsity=0.5"], r"max_layer_sparsity=0\.5 lets at most .* fewer than"),
        (["pruning.method=heads", "pruning.scope=layerwise"], "found no heads in Classifier"),
        (
            ["optim.prune.optimizer={_target_:torch.optim.SGD,_partial_:true,lrr:0.1}"],
            r"optim\.prune\.optimizer: torch\.optim\.SGD\(params, \.\.\.\) failed: TypeError: .*'lrr'",
        ),
        (["optim.dense.optimizer={_target_:torch.optim.SGD,_partial_:true,lr:-0.1}"], "Invalid learning rate"),
    ],
)
def test_selection_and_method_errors_fail_before_training(
    no_training: None, tmp_path: Path, overrides: list[str], message: str
) -> None:
    run_dir = tmp_path / "run"
    with pytest.raises(ValueError, match=message):
        run_experiment(make_config(*TINY, *overrides), run_dir)
    assert not run_dir.exists()


def test_an_accelerator_this_machine_lacks_fails_before_training(
    no_training: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"trainer\.accelerator='gpu': no CUDA device is available here"):
        run_experiment(make_config(*TINY, "trainer.accelerator=gpu"), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_a_late_one_shot_is_valid_whatever_end_says(no_training: None, tmp_path: Path) -> None:
    """``end`` belongs to the ramps: a one-shot event after the default ``end=0.6`` is fine."""
    with pytest.raises(AssertionError, match=r"Trainer\.fit ran"):
        run_experiment(make_config(*TINY, "pruning=one_shot", "pruning.start=0.8"), tmp_path)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("pruning.final_sparsity=1.5", "invalid experiment config: pruning.final_sparsity=1.5: must be in [0, 1]"),
        (
            "+pruning.final_sparsty=0.5",  # what Hydra's own hint for the typo below suggests
            "invalid experiment config: pruning.final_sparsty: not a config key (did you mean pruning.final_sparsity?)",
        ),
        (
            "pruning.final_sparsty=0.5",
            "invalid experiment config: pruning.final_sparsty: not a config key (did you mean pruning.final_sparsity?)",
        ),
        ("+trainer.max_epoch=3", "trainer.max_epoch: not a config key (did you mean trainer.max_epochs?)"),
        (
            "pruning=not_a_preset",
            "Could not find 'pruning/not_a_preset'; Available options in 'pruning': gmp_cubic, gmp_erk, "
            "iterative_rounds, ln_structured, movement, nm_2_4, none, one_shot, rigl_erk, set_erk, sparsegpt_2_4, "
            "sparsegpt_oneshot, wanda_gradual",
        ),
        ("pruning.final_sparsity=abc", "Value 'abc' of type 'str' could not be converted to Float"),
        ("data=mnist", "(the default for data=mnist) is not a directory; set data.root=<directory holding"),
        ("pruning.include=[nothing]", "pruning.include / pruning.exclude: no parameter of the model matches"),
        (  # checked against the fine-tuning run's length before the dense phase trains, not after it
            "pruning=set_erk",
            "for a fine-tuning run of 10 optimizer steps over 2 epochs (pruning.*, trainer.max_epochs): regrow='set'",
        ),
        (
            "pruning.unit=epoch pruning.start=0.5",  # 2 epochs: start 1, end round(1.2) = 1
            "(pruning.*, trainer.max_epochs): start=1 must be < end=1 (after resolving fractions of the run with total",
        ),
    ],
)
def test_config_errors_print_one_line_and_exit_2(
    no_training: None, tmp_path: Path, capsys: pytest.CaptureFixture[str], override: str, message: str
) -> None:
    assert main([*TINY, *override.split(), f"hydra.run.dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("lightprune-experiment: ") and message in err, err
    assert "Traceback" not in err and "HYDRA_FULL_ERROR" not in err


def test_a_failed_run_into_an_earlier_runs_directory_leaves_no_summary_to_report(tmp_path: Path) -> None:
    """Hydra replaces ``.hydra/`` when a run starts: an earlier run's ``summary.json`` left beside a failed run would
    be reported as its result, under its configuration."""
    assert main([*TINY, f"hydra.run.dir={tmp_path}"]) == 0
    assert (tmp_path / "summary.json").is_file()
    assert main([*TINY, "pruning.final_sparsity=1.5", f"hydra.run.dir={tmp_path}"]) == 2
    assert not (tmp_path / "summary.json").exists()
    (job_log,) = tmp_path.glob("*.log")
    assert "removed the summary.json of an earlier run" in job_log.read_text()
    runs, skipped = scan_runs(tmp_path)
    assert runs == [] and [Path(s.run_dir) for s in skipped] == [tmp_path]
    assert "pruning.final_sparsity=1.5" in skipped[0].reason


def test_config_error_with_debug_raises_with_traceback(
    no_training: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LIGHTPRUNE_DEBUG", "1")
    with pytest.raises(ConfigError, match=r"pruning\.final_sparsity=1\.5"):
        main([*TINY, "pruning.final_sparsity=1.5", f"hydra.run.dir={tmp_path}"])


def test_missing_data_directory_names_data_root(no_training: None, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        run_experiment(make_config(*TINY, "data=fashion_mnist", f"data.root={tmp_path}"), tmp_path / "run")
    assert f"data.root='{tmp_path}': {tmp_path} lacks train-images-idx3-ubyte" in str(info.value)
    assert "set data.root=<directory holding" in str(info.value)


def test_removing_every_weight_warns(no_training: None, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING), pytest.raises(AssertionError, match=r"Trainer\.fit ran"):
        run_experiment(make_config(*TINY, "pruning=one_shot", "pruning.final_sparsity=1.0"), tmp_path)
    assert "pruning.final_sparsity=1.0 removes every selected weight" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING), pytest.raises(AssertionError, match=r"Trainer\.fit ran"):
        run_experiment(make_config(*TINY, "pruning=one_shot", "pruning.final_sparsity=0.99"), tmp_path)
    assert "removes every" not in caplog.text


# --------------------------------------------------------------------------------------------------------------------
# The dense-phase cache
# --------------------------------------------------------------------------------------------------------------------


def key_of(*overrides: str) -> str:
    from omegaconf import OmegaConf

    return dense_cache.dense_key(OmegaConf.to_container(make_config(*overrides), resolve=True))


def test_dense_key_changes_with_what_determines_the_dense_phase(monkeypatch: pytest.MonkeyPatch) -> None:
    base = key_of()
    for same in ("pruning=one_shot", "pruning.final_sparsity=0.5", "trainer.max_epochs=3", "name=x", "plots=false"):
        assert key_of(same) == base, same
    assert key_of("trainer.enable_progress_bar=false") == base
    for different in (
        "seed=1",
        "data.seed=1",
        "data.batch_size=32",
        "model.lr=0.01",
        "model=small_cnn",
        "trainer.dense_epochs=3",
        "trainer.num_threads=2",
    ):
        assert key_of(different) != base, different
    monkeypatch.setattr(dense_cache, "_version", lambda package: "other")  # another torch, Lightning, ...
    assert key_of() != base


def fit_counter(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts ``Trainer.fit`` calls by their ``max_epochs`` (the dense phase's is 1 under ``TINY``)."""
    calls: list[int] = []
    fit = pl.Trainer.fit

    def counting(self: pl.Trainer, *args: object, **kwargs: object) -> object:
        calls.append(self.max_epochs)
        return fit(self, *args, **kwargs)

    monkeypatch.setattr(pl.Trainer, "fit", counting)
    return calls


def test_a_cached_dense_phase_gives_the_same_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fit_counter(monkeypatch)
    overrides = [*TINY, "pruning=one_shot"]
    plain = run_experiment(make_config(*overrides, "cache.dense=false"), tmp_path / "plain")
    stored = run_experiment(make_config(*overrides), tmp_path / "stored")
    loaded = run_experiment(make_config(*overrides), tmp_path / "loaded")
    assert calls == [1, 2, 1, 2, 2]  # the third run trained no dense phase
    assert (plain.dense_cache, stored.dense_cache, loaded.dense_cache) == ("trained", "stored", "loaded")
    models = [(tmp_path / run / "model.pt").read_bytes() for run in ("plain", "stored", "loaded")]
    assert models[0] == models[1] == models[2]
    for field in ("dense_test_acc", "final_test_acc", "layer_sparsity"):
        assert getattr(plain, field) == getattr(stored, field) == getattr(loaded, field), field
    dense_logs = [(tmp_path / run / "logs" / "dense" / "metrics.csv").read_text() for run in ("stored", "loaded")]
    assert dense_logs[0] == dense_logs[1]
    assert read_csv(tmp_path / "loaded" / "logs" / "all_phases.csv")[0]["phase"] == "dense"

    retrained = run_experiment(make_config(*overrides, "cache.retrain=true"), tmp_path / "retrained")
    assert retrained.dense_cache == "stored" and calls[-2:] == [1, 2]
    assert (tmp_path / "retrained" / "model.pt").read_bytes() == models[0]


# --------------------------------------------------------------------------------------------------------------------
# Report over runs
# --------------------------------------------------------------------------------------------------------------------


def check_report(sweep_dir: Path, runs: int, sparsities: Sequence[str]) -> None:
    assert main(["report", str(sweep_dir)]) == 0
    markdown = (sweep_dir / "report.md").read_text()
    table = [line for line in markdown.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + runs  # header and one row per run
    for sparsity in sparsities:
        assert any(f"| {sparsity} |" in row for row in table[1:]), (sparsity, table)
    assert (sweep_dir / "accuracy_vs_sparsity.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.slow
def test_report_over_two_emulated_runs(tmp_path: Path) -> None:
    for job, sparsity in enumerate(("0.5", "0.8")):
        run_dir = tmp_path / str(job)
        override = f"pruning.final_sparsity={sparsity}"
        run_experiment(make_config(*TINY, "pruning=one_shot", override), run_dir)
        (run_dir / ".hydra").mkdir()
        (run_dir / ".hydra" / "overrides.yaml").write_text(f"- {override}\n")
    check_report(tmp_path, runs=2, sparsities=["0.5", "0.8", "50.0%", "80.0%"])


def test_help_names_the_app_and_the_report_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("lightprune-experiment: train a dense model")
    assert (
        "pruning: gmp_cubic, gmp_erk, iterative_rounds, ln_structured, movement, nm_2_4, none, one_shot, rigl_erk, "
        "set_erk, sparsegpt_2_4, sparsegpt_oneshot, wanda_gradual" in text
    )
    assert "lightprune-experiment report multirun/" in text


def test_report_of_a_directory_without_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(tmp_path)]) == 1
    assert "no summary.json" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------------------------
# The command line: console script, python -m, multirun
# --------------------------------------------------------------------------------------------------------------------

PYTHON_M = [sys.executable, "-m", "lightprune.experiment"]
SCRIPT = shutil.which("lightprune-experiment")
"""The console script (on PATH when the package is installed); the multirun test falls back to ``python -m``."""


def run_cli(
    command: list[str], *args: str, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=timeout, check=False, env=env)


DISTRIBUTED_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK")
"""What an earlier in-process DDP test leaves in ``os.environ`` (Lightning sets them): a new run must pick its own."""


@pytest.mark.slow
def test_python_m_run(tmp_path: Path) -> None:
    result = run_cli(PYTHON_M, *TINY, f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "final test acc" in result.stdout
    summary = check_run_dir(tmp_path, ["dense", "prune"], pruned=True)
    assert_exact_sparsity(summary, 0.9)
    assert (tmp_path / ".hydra" / "overrides.yaml").is_file()
    assert not any(line.startswith("INFO: ") for line in result.stderr.splitlines()), "Lightning logs printed twice"
    assert "Trainer.fit" in (tmp_path / "app.log").read_text()
    output = result.stdout + result.stderr
    for noise in ("LeafSpec", "litlogger", "💡", "v_num"):
        assert noise not in output, noise
    assert RunSummary.load(tmp_path / "summary.json").overrides == TINY  # the task's overrides, not hydra.*


@pytest.mark.slow
def test_two_processes_train_together_and_the_first_writes_the_outputs(tmp_path: Path) -> None:
    """``trainer.devices=2`` (DDP on CPU): no rank waits on the dense cache's lock while the other waits for it. With
    the cache asked for: a run of several processes leaves it unused, so this is also the path of cache.dense=false."""
    run_dir, cache_dir = tmp_path / "run", tmp_path / "cache"
    overrides = [
        *TINY,
        "trainer.devices=2",
        "cache.dense=true",
        f"cache.dir={cache_dir}",
        f"hydra.run.dir={run_dir}",
    ]
    env = {key: value for key, value in os.environ.items() if key not in DISTRIBUTED_VARIABLES}
    result = run_cli(PYTHON_M, *overrides, timeout=240, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("outputs: ") == 1  # the summary table and outputs once, by the first process
    summary = RunSummary.load(run_dir / "summary.json")
    assert_exact_sparsity(summary, 0.9)
    assert summary.dense_cache == "trained"
    tests = build_datamodule(make_config(*TINY).data).split_sizes["test"]  # 359: no multiple of the 2 processes
    for accuracy in (summary.dense_test_acc, summary.final_test_acc):  # every test example counted once
        assert abs(accuracy * tests - round(accuracy * tests)) < 1e-3, (accuracy, tests)  # (float32 logged)
    assert (run_dir / "model.safetensors").is_file() and (run_dir / "layer_sparsity.png").is_file()
    assert not cache_dir.exists() or not any(cache_dir.glob("*/state_dict.pt"))  # nothing stored from a DDP run


@pytest.mark.slow
def test_command_line_config_error(tmp_path: Path) -> None:
    result = run_cli(PYTHON_M, *TINY, "pruning.final_sparsity=1.5", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "lightprune-experiment: invalid experiment config: pruning.final_sparsity=1.5: must be in [0, 1]"
    ]
    assert not (tmp_path / "logs").exists() and not (tmp_path / "summary.json").exists()
    assert "pruning.final_sparsity=1.5: must be in [0, 1]" in (tmp_path / "app.log").read_text()  # for `report`
    debug = subprocess.run(
        [*PYTHON_M, *TINY, "pruning.final_sparsity=1.5", f"hydra.run.dir={tmp_path}"],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "LIGHTPRUNE_DEBUG": "1"},
    )
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "ConfigError" in debug.stderr


@pytest.mark.slow
def test_config_errors_are_found_before_lightning_is_imported(tmp_path: Path) -> None:
    code = (
        "import sys; from lightprune.experiment.app import main; "
        "codes = [main([a, 'hydra.run.dir=' + sys.argv[1]]) for a in sys.argv[2:]]; "
        "print(codes, 'lightning.pytorch' in sys.modules)"
    )
    errors = ["pruning.final_sparsity=2", "data=mnist", "pruning.include=[nothing]", "+pruning.final_sparsty=0.5"]
    result = run_cli([sys.executable, "-c", code], str(tmp_path / "run"), *errors)
    assert result.stdout.strip() == "[2, 2, 2, 2] False", result.stderr


@pytest.mark.slow
def test_console_script_multirun_then_report_and_a_parallel_sweep_gives_the_same_runs(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    command = [SCRIPT] if SCRIPT else PYTHON_M
    sweep = ["-m", "pruning.final_sparsity=0.5,0.8", *TINY]
    result = run_cli(command, *sweep, "cache.dense=false", f"hydra.sweep.dir={sweep_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    summaries = sorted(sweep_dir.glob("*/summary.json"))
    assert len(summaries) == 2
    for path in summaries:
        assert (path.parent / ".hydra" / "overrides.yaml").is_file()
        check_run_dir(path.parent, ["dense", "prune"], pruned=True)
        assert RunSummary.load(path).dense_cache == "trained"
    check_report(sweep_dir, runs=2, sparsities=["0.5", "0.8", "50.0%", "80.0%"])

    # docs/app.md: a second sweep into the same folder (more seeds) keeps the first one's runs (folders were named by
    # job number and settings but not the seed, so the second sweep's job 0 replaced the first sweep's)
    result = run_cli(command, "-m", "pruning.final_sparsity=0.5", "seed=1", *TINY, f"hydra.sweep.dir={sweep_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(path.parent.name for path in sweep_dir.glob("*/summary.json")) == [
        "0-gmp_cubic-global-s0.5-seed0",
        "0-gmp_cubic-global-s0.5-seed1",
        "1-gmp_cubic-global-s0.8-seed0",
    ]

    # the README's parallel sweep: Hydra's joblib launcher, dense phase from the cache: the same runs
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    parallel_dir = tmp_path / "parallel"
    launcher = ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"]
    result = run_cli(command, *sweep, *launcher, "cache.dense=true", f"hydra.sweep.dir={parallel_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    for path in summaries:
        twin = parallel_dir / path.parent.name
        assert (twin / "model.pt").read_bytes() == (path.parent / "model.pt").read_bytes()
        sequential, parallel = RunSummary.load(path), RunSummary.load(twin / "summary.json")
        assert (parallel.dense_test_acc, parallel.final_test_acc) == (
            sequential.dense_test_acc,
            sequential.final_test_acc,
        )
        assert parallel.layer_sparsity == sequential.layer_sparsity
    assert sorted(RunSummary.load(p / "summary.json").dense_cache for p in parallel_dir.glob("[0-9]*")) == [
        "loaded",
        "stored",
    ]  # the second job waited for the first's dense phase instead of training its own


@pytest.mark.parametrize("structured", [False, True])
def test_the_run_writes_a_sparse_safetensors_file_and_measures_size_and_latency(
    tmp_path: Path, structured: bool
) -> None:
    from lightprune.export import load_sparse

    overrides = ["experiment=cnn_channels"] if structured else []
    summary = run_experiment(make_config(*TINY, *overrides), tmp_path)
    state = load_sparse(tmp_path / "model.safetensors")  # a plain state_dict, without lightprune's model classes
    reference = torch.load(tmp_path / "model.pt", weights_only=True)
    assert sorted(state) == sorted(reference)
    assert all(torch.equal(state[name], reference[name]) for name in state)  # -0.0 == 0.0: the same values
    loaded = load_run(tmp_path)  # model.pt still rebuilds the network
    assert all(torch.equal(loaded.state_dict()[name], reference[name]) for name in reference)
    dense_bytes = sum(t.numel() * t.element_size() for t in reference.values())
    assert summary.file_size_ratio == pytest.approx(dense_bytes / (tmp_path / "model.safetensors").stat().st_size, 0.05)
    assert summary.file_size_ratio > (1.4 if structured else 4.0)
    assert summary.latency_ratio is not None and summary.latency_ratio > 0
    assert summary.latency_model == ("compact" if structured else summary.latency_model)
    assert (tmp_path / "model_compact.pt").is_file() == structured
    if structured:  # the compact model computes what the pruned one does, with half the conv channels
        compact = torch.load(tmp_path / "model_compact.pt", weights_only=False)
        x = torch.randn(4, 1, 8, 8)
        assert torch.allclose(compact(x), loaded(x), atol=1e-5)
        assert compact.get_submodule("conv1").out_channels == 8
    data = json.loads((tmp_path / "summary.json").read_text())
    assert data["file_size_ratio"] == summary.file_size_ratio


def test_a_neurons_run_reports_the_measured_speed_up_of_the_compact_model(tmp_path: Path) -> None:
    overrides = ["pruning.method=neurons", "pruning.scope=layerwise", "pruning.final_sparsity=0.5"]
    overrides += ["pruning.schedule=constant", "pruning.start=0.5", "pruning.importance=activation"]
    summary = run_experiment(make_config(*TINY, *overrides, "pruning.reconstruct=true"), tmp_path)
    assert summary.latency_model == "compact" and summary.latency_ratio is not None and summary.latency_ratio > 0
    compact = torch.load(tmp_path / "model_compact.pt", weights_only=False)
    loaded = load_run(tmp_path)
    assert (compact.fc1.out_features, compact.fc2.out_features) == (150, 50)  # half of LeNet-300-100's neurons
    x = torch.randn(4, compact.fc1.in_features)
    torch.testing.assert_close(compact(x), loaded(x), rtol=1e-5, atol=1e-5)


def test_a_phase_that_diverges_ends_the_run_without_a_summary(tmp_path: Path) -> None:
    """Weights gone to NaN: the accuracy and sparsity of the summary would describe a model that computes nothing,
    so the run fails, naming the phase (sweeps and ``report`` count it as failed)."""
    from lightprune.experiment.app import DivergedError

    diverging = "optim.prune.optimizer={_target_:torch.optim.SGD,_partial_:true,lr:1e30}"
    with pytest.raises(DivergedError, match=r"the prune phase diverged: \d+ parameter\(s\) hold NaN or inf"):
        run_experiment(make_config(*TINY, "pruning=one_shot", diverging), tmp_path)
    assert not (tmp_path / "summary.json").exists()
