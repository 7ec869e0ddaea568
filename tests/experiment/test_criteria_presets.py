"""The criterion presets of the app (``wanda_gradual``, ``movement``, ``nm_2_4``): they compose, validate, build the
callback they describe, refuse inconsistent overrides before training, and run end to end at tiny size."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

import lightprune.experiment.app as app
from lightprune.experiment.app import config_dir, run_experiment
from lightprune.experiment.config import ConfigError, register_configs, validate_config

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*"),
    pytest.mark.filterwarnings("ignore:.*exists and is not empty.*"),
    pytest.mark.filterwarnings("ignore:.*smaller than the logging interval.*"),
]

TINY = ["experiment=smoke", "data.batch_size=256"]


def make_config(*overrides: str) -> DictConfig:
    register_configs()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose("config", overrides=list(overrides))


@pytest.mark.parametrize(
    ("preset", "expected"),
    [
        (
            "wanda_gradual",
            {"importance": "activation", "scope": "row", "calibration_batches": 4, "method": "L1Unstructured"},
        ),
        (
            "movement",
            {"importance": "movement", "scope": "global", "calibration_batches": 0, "method": "L1Unstructured"},
        ),
        (
            "nm_2_4",
            {"importance": "magnitude", "scope": "layerwise", "calibration_batches": 0, "method": "SemiStructured"},
        ),
        (
            "sparsegpt_oneshot",
            {"importance": "obs", "scope": "row", "calibration_batches": 8, "method": "L1Unstructured"},
        ),
        (
            "sparsegpt_2_4",
            {"importance": "obs", "scope": "layerwise", "calibration_batches": 8, "method": "SemiStructured"},
        ),
        (
            "gmp_erk",
            {"importance": "magnitude", "scope": "erk", "calibration_batches": 0, "method": "L1Unstructured"},
        ),
        (
            "rigl_erk",
            {"importance": "magnitude", "scope": "erk", "calibration_batches": 0, "method": "L1Unstructured"},
        ),
        (
            "set_erk",
            {"importance": "magnitude", "scope": "erk", "calibration_batches": 0, "method": "L1Unstructured"},
        ),
    ],
)
def test_each_criterion_preset_composes_and_builds_its_callback(preset: str, expected: dict[str, object]) -> None:
    cfg = make_config(f"pruning={preset}")
    validate_config(cfg)
    callback = app.build_callback(cfg)
    built = {
        "importance": callback.importance,
        "scope": callback.scope,
        "calibration_batches": callback.calibration_batches,
        "method": callback.method.__name__,
    }
    assert built == expected
    assert callback.reconstruct == (preset.startswith("sparsegpt"))
    if preset in ("nm_2_4", "sparsegpt_2_4"):
        assert callback.method_kwargs == {"n": 2, "m": 4}
        assert type(callback.schedule).__name__ == "Constant" and callback.schedule.sparsity == 0.5


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["pruning=nm_2_4", "pruning.final_sparsity=0.7"],
            r"pruning\.schedule='constant': semi_structured with n=2, m=4 prunes .* \(this one prunes to 0\.7\)",
        ),
        (["pruning=nm_2_4", "pruning.nm_n=4"], r"pruning\.nm_n=4: in \[1, nm_m=4\)"),
        (
            ["pruning=movement", "pruning.start=0.0", "pruning.initial_sparsity=0.1"],
            r"pruning\.start=0\.0: pruning\.importance=movement needs",
        ),
        (["pruning=wanda_gradual", "pruning.calibration_batches=0"], r"needs pruning\.calibration_batches > 0"),
        (["pruning=sparsegpt_oneshot", "pruning.calibration_batches=0"], r"=obs with an event at the start needs"),
        (["pruning=sparsegpt_oneshot", "pruning.method=ln_structured"], r"obs chooses single weights .* ln_structured"),
        (["pruning=sparsegpt_oneshot", "pruning.sequential=true", "pruning.scope=global"], r"pruning\.sequential=True"),
        (["pruning=wanda_gradual", "pruning.reconstruct=true"], r"pruning\.reconstruct=True: .*needs importance=obs"),
        (
            ["pruning=movement", "pruning.method=ln_structured", "pruning.scope=layerwise"],
            r"pruning\.importance='movement': movement ranks signed scores, which ln_structured cannot",
        ),
        (["pruning=gmp_cubic", "pruning.importance=gradient"], r"pruning\.importance='gradient': one of"),
        (["pruning=rigl_erk", "pruning.scope=row"], r"pruning\.scope='row': regrow=rigl moves weights within each"),
        (["pruning=gmp_erk", "pruning.scope=owl"], r"pruning\.importance='magnitude': scope=owl allocates by the"),
        (
            ["pruning=gmp_erk", "pruning.method=ln_structured"],
            r"pruning\.scope='erk': erk allocates each layer a share of the weights, which needs an unstructured",
        ),
        (
            ["pruning=gmp_cubic", "pruning.calibration_batches=2"],
            r"pruning\.calibration_batches=2: collects input statistics, which only importance=activation or obs uses",
        ),
        (
            ["pruning=gmp_cubic", "pruning.scope=row", "pruning.method=random_unstructured"],
            r"pruning\.scope='row': row ranks every row's entries as l1_unstructured does, not random_unstructured",
        ),
    ],
)
def test_inconsistent_overrides_are_refused_by_validation(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        validate_config(make_config(*overrides))


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["wanda_gradual", "movement", "nm_2_4", "sparsegpt_oneshot", "sparsegpt_2_4"])
def test_criterion_presets_end_to_end(tmp_path: Path, preset: str) -> None:
    summary = run_experiment(make_config(*TINY, f"pruning={preset}"), tmp_path)
    state_dict = torch.load(tmp_path / "model.pt", weights_only=True)
    if preset in ("nm_2_4", "sparsegpt_2_4"):
        for name in ("fc1.weight", "fc2.weight", "fc3.weight"):
            weight = state_dict[name]
            assert (weight.view(weight.shape[0], -1, 4) != 0).sum(dim=-1).le(2).all(), name
        assert summary.total_sparsity == pytest.approx(0.5, abs=1e-3)
    elif preset == "sparsegpt_oneshot":
        for name in ("fc1.weight", "fc2.weight", "fc3.weight"):
            weight = state_dict[name]
            assert (weight == 0).sum(dim=1).unique().tolist() == [round(0.5 * weight.shape[1])], name
    else:
        assert summary.total_sparsity == pytest.approx(0.9, abs=0.01)
    if preset == "wanda_gradual":
        weight = state_dict["fc1.weight"]
        assert (weight == 0).sum(dim=1).unique().tolist() == [round(0.9 * weight.shape[1])]


def test_a_ramp_starting_at_level_0_needs_no_statistics_at_its_start() -> None:
    """Movement from step 0 passes validation because its first event, at step 0, prunes nothing: the callback it
    builds has its first event at 0 with target 0, and prunes only later, after steps were scored."""
    cfg = make_config("pruning=movement", "pruning.start=0.0")
    validate_config(cfg)
    schedule = app.build_callback(cfg).schedule.resolve(100)
    assert schedule.first_event == 0 and schedule.target(0) == 0.0
    assert schedule.events()[1] > 0 and schedule.target(schedule.events()[1]) > 0.0
    started = make_config("pruning=movement", "pruning.start=0.0", "pruning.initial_sparsity=0.1")
    assert app.build_callback(started).schedule.resolve(100).target(0) == 0.1  # what validation refuses


@pytest.mark.slow
def test_movement_from_step_0_runs_end_to_end(tmp_path: Path) -> None:
    summary = run_experiment(make_config(*TINY, "pruning=movement", "pruning.start=0.0"), tmp_path)
    assert summary.total_sparsity == pytest.approx(0.9, abs=0.01)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["rigl_erk", "set_erk"])
def test_dynamic_sparse_training_presets_end_to_end_draw_the_mask_movement(tmp_path: Path, preset: str) -> None:
    from lightprune.experiment.plots import draw_mask_movement

    cfg = make_config(*TINY, f"pruning={preset}", "pruning.regrow_every=2", "pruning.regrow_until=0.9")
    summary = run_experiment(cfg, tmp_path)
    # the summary counts zeros: a weight SET regrew (at zero) on an input pixel that is always 0 stays exactly 0
    assert 0.9 - 1e-3 <= summary.total_sparsity < 0.91
    assert (tmp_path / "mask_movement.png").is_file()
    fig = draw_mask_movement(tmp_path / "logs" / "all_phases.csv")
    labels = [line.get_label() for line in fig.axes[0].lines]
    assert labels[0] == "planned share (cosine decay)"
    layers = " ".join(labels[1:]).replace("=", " ").replace("≈", " ").split()
    assert sorted(layers) == ["fc1.weight", "fc2.weight", "fc3.weight"]  # every layer, alone or sharing a line
    planned = next(line for line in fig.axes[0].lines if line.get_label().startswith("planned"))
    shares = planned.get_ydata()
    assert len(shares) >= 2 and all(a > b for a, b in itertools.pairwise(shares))  # the cosine decays
