"""``benchmarks/quality.py --quick`` (issue #7) end to end, in a fresh process, on a Fashion-MNIST look-alike.

The data are scikit-learn's bundled 8x8 digits padded to 28x28 and written in MNIST IDX layout, so the test runs
anywhere (the real benchmark reads Debian's Fashion-MNIST). It checks what the full benchmark promises: every arm
runs, the counted sparsity is exact (lightprune) or within ModelPruning's per-round rounding, the Markdown table,
the plot and the JSON are written, the epoch-time comparison is there, and a rerun reuses the cached runs.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from sklearn.datasets import load_digits

from benchmark_scripts import load_script
from lightprune.experiment.data import IDX_FILES, write_idx

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "quality.py"
ARMS = (
    "dense",
    "modelpruning",
    "lp_control",
    "lp_gradual",
    "lp_gradual_layerwise",
    "lp_one_shot",
    "lp_one_shot_rewind",
)
WEIGHTS = 784 * 300 + 300 * 100 + 100 * 10


def _digits_as_idx(root: Path) -> None:
    digits = load_digits()
    images = torch.nn.functional.pad(torch.tensor(digits.images * 15, dtype=torch.uint8), (10, 10, 10, 10))
    labels = torch.tensor(digits.target, dtype=torch.uint8)
    write_idx(root / (IDX_FILES["train_images"] + ".gz"), images[:1500])
    write_idx(root / (IDX_FILES["train_labels"] + ".gz"), labels[:1500])
    write_idx(root / (IDX_FILES["test_images"] + ".gz"), images[1500:])
    write_idx(root / (IDX_FILES["test_labels"] + ".gz"), labels[1500:])


def _run(data: Path, out: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, str(SCRIPT), "--quick", "--data-root", str(data), "--out", str(out), "--jobs", "2"]
    command += ["--sparsities", "0.9"]  # every arm once: the quick run's second sparsity adds no wiring to check
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.mark.slow
def test_quick_benchmark_runs_every_arm_and_writes_the_report(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    data, out = tmp_path / "data", tmp_path / "out"
    _digits_as_idx(data)
    done = _run(data, out)
    assert "7 runs: 0 cached, 7 to do" in done.stdout

    payload = json.loads((out / "quality.json").read_text())
    results = payload["results"]
    assert sorted({r["run"]["arm"] for r in results}) == sorted(ARMS)
    assert len(results) == 1 + 6  # dense once, six pruning arms at 0.9, one seed
    for result in results:
        arm, sparsity = result["run"]["arm"], result["run"]["sparsity"]
        zeros = sum(result["zeros"].values())
        assert sum(result["sizes"].values()) == WEIGHTS
        if arm.startswith("lp_"):
            assert zeros == round(sparsity * WEIGHTS), result  # exact, as the callback promises
        elif arm == "modelpruning":
            assert abs(zeros - sparsity * WEIGHTS) <= 4, result  # torch rounds each of its rounds
        else:
            assert zeros == 0
        if arm == "lp_gradual_layerwise":
            assert all(abs(z / result["sizes"][name] - sparsity) < 1e-3 for name, z in result["zeros"].items())
        assert result["steps"] == 4 * 12  # 1500 images in batches of 128, four epochs
    dense = next(r for r in results if r["run"]["arm"] == "dense")
    assert dense["accuracy"] > 50.0  # digits are learnable: the data and the evaluation are wired right

    report = (out / "quality.md").read_text()
    for arm in ARMS:
        assert f"| {arm} |" in report
    assert "| lightprune PruningCallback (bool masks, the default) |" in report
    timed = {"dense", "lightprune", "lightprune_float", "lightprune_inplace", "modelpruning"}
    assert set(payload["timing"]["ratio_to_dense"]) == timed
    assert "| lightprune PruningCallback (masking='inplace', bool masks) |" in report
    assert (out / "quality.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # a rerun with the same settings reuses every run (here in this process: no new one, no fit)
    quality = _quality_module()
    runs = quality.plan(list(ARMS), [0.9], [0], quality.Settings(**payload["settings"]), ["magnitude"])
    again = quality.execute(runs, out, jobs=2, fresh=False)
    assert "7 runs: 7 cached, 0 to do" in capsys.readouterr().out
    assert sorted(again, key=lambda r: r["run"]["arm"]) == sorted(results, key=lambda r: r["run"]["arm"])


def _quality_module():
    return load_script("quality")


def test_importance_flag_plans_one_run_set_per_criterion_and_reaches_the_callback() -> None:
    quality = _quality_module()
    runs = quality.plan(["dense", "lp_gradual", "lp_2_4"], [0.9], [0], quality.Settings(), ["magnitude", "movement"])
    assert [run.key for run in runs] == [
        "dense_s0_seed0",
        "lp_gradual_s0.9_seed0",
        "lp_gradual_movement_s0.9_seed0",
        "lp_2_4_s0.5_seed0",
        "lp_2_4_movement_s0.5_seed0",
    ]
    assert runs[2].label == "lp_gradual [movement]"
    module = quality.LeNetModule(1e-3)
    (callback,) = quality.arm_callbacks("lp_gradual", 0.9, module, epochs=20, importance="activation")
    assert callback.importance == "activation" and callback.scope == "global"
    (callback,) = quality.arm_callbacks("lp_gradual", 0.9, module, epochs=20, importance="obs")
    assert (callback.importance, callback.reconstruct, callback.activation_window) == ("obs", True, 8)
    (callback,) = quality.arm_callbacks("lp_2_4", 0.5, module, epochs=20)
    assert callback.method.__name__ == "SemiStructured" and callback.importance == "magnitude"
    with pytest.raises(ValueError, match="no pruning criterion"):
        quality.arm_callbacks("modelpruning", 0.9, module, epochs=20, importance="activation")


def _fit_counting(quality, arm: str, sparsity: float, samples: int, batch: int, epochs: int, regrow=(2, 0.3, 0.75)):
    """A short fit of one arm on random data with the benchmark's FLOP counter; returns the counter, callbacks."""
    torch.manual_seed(0)
    module = quality.LeNetModule(1e-3)
    callbacks = quality.arm_callbacks(arm, sparsity, module, epochs, regrow=regrow)
    counter = quality.TrainingFlops(quality.pruned_weights(module))
    loader = quality.ShuffledBatches(torch.rand(samples, 784), torch.randint(0, 10, (samples,)), batch, seed=0)
    trainer = quality.make_trainer(epochs, [counter, *callbacks])
    trainer.fit(module, train_dataloaders=loader)
    return counter, callbacks


@pytest.mark.parametrize("arm", ["dense", "lp_rigl_erk", "lp_set_erk"])
def test_training_flops_count_against_the_counting_rule(arm: str) -> None:
    quality = _quality_module()
    samples, batch, epochs, sparsity = 200, 64, 3, 0.9  # batches of 64, 64, 64, 8: 4 steps an epoch, 12 in all
    counter, _ = _fit_counting(quality, arm, sparsity, samples, batch, epochs)
    sizes = [64, 64, 64, 8] * epochs
    active = WEIGHTS if arm == "dense" else WEIGHTS - round(sparsity * WEIGHTS)  # ERK keeps the total exact
    # Independent of the counter: regrow every 2 steps until round(0.75 * 12) = 9 moves the masks after steps
    # 2, 4, 6, 8; RigL's backward of those steps takes the dense weight gradient.
    dense_grad_steps = {2, 4, 6, 8} if arm == "lp_rigl_erk" else set()
    expected = sum(
        b * (2 * active + (WEIGHTS if step in dense_grad_steps else active)) for step, b in enumerate(sizes, 1)
    )
    assert counter.macs == expected
    if arm == "dense":
        assert counter.macs == 3 * WEIGHTS * samples * epochs  # the run's dense_macs: dense = 1


def test_3x_arms_train_three_times_longer_and_regrow_settings_reach_only_dst_arms() -> None:
    quality = _quality_module()
    settings = quality.Settings(regrow=(300, 0.1, 0.5))
    runs = {run.arm: run for run in quality.plan(["lp_gradual", "lp_rigl_erk_3x"], [0.99], [0], settings)}
    assert runs["lp_rigl_erk_3x"].settings.regrow == (300, 0.1, 0.5)
    assert runs["lp_gradual"].settings.regrow == quality.REGROW  # its cached runs stay valid
    (callback,) = quality.arm_callbacks("lp_set_erk_3x", 0.99, quality.LeNetModule(1e-3), 60, regrow=(300, 0.1, 0.5))
    settings_seen = (callback.regrow, callback.regrow_every, callback.regrow_fraction, callback.regrow_until)
    assert settings_seen == ("set", 300, 0.1, 0.5)
    assert quality.EPOCH_MULTIPLIER["lp_rigl_erk_3x"] == 3 and callback.scope == "erk"


def test_sparse_init_reaches_only_dst_arms_and_scales_each_row_to_its_kept_fan_in() -> None:
    quality = _quality_module()
    runs = {
        r.arm: r for r in quality.plan(["lp_gradual", "lp_set_erk"], [0.9], [0], quality.Settings(sparse_init=True))
    }
    assert runs["lp_set_erk"].settings.sparse_init and not runs["lp_gradual"].settings.sparse_init
    layer = torch.nn.Linear(8, 3)
    from lightprune import prune

    prune.custom_from_mask(layer, "weight", torch.tensor([[1.0] * 8, [1.0, 1.0] + [0.0] * 6, [1.0] + [0.0] * 7]))
    before = layer.weight_orig.detach().clone()
    quality.SparseInit([(layer, "weight")]).on_train_start(None, None)
    scale = layer.weight_orig.detach() / before
    torch.testing.assert_close(scale[:, 0], torch.tensor([1.0, 2.0, 8.0**0.5]))  # sqrt(8 / kept) per row


def test_warm_regrown_adam_reaches_only_dst_arms_and_sets_the_regrown_second_moments() -> None:
    quality = _quality_module()
    settings = quality.Settings(warm_regrown_adam=True)
    runs = {r.arm: r for r in quality.plan(["lp_gradual", "lp_rigl_erk"], [0.9], [0], settings)}
    assert runs["lp_rigl_erk"].settings.warm_regrown_adam and not runs["lp_gradual"].settings.warm_regrown_adam
    from types import SimpleNamespace

    from lightprune import prune

    layer = torch.nn.Linear(4, 1)
    prune.custom_from_mask(layer, "weight", torch.tensor([[1.0, 1.0, 0.0, 0.0]]))
    optimizer = torch.optim.Adam(layer.parameters())
    optimizer.state[layer.weight_orig] = {"exp_avg_sq": torch.tensor([[2.0, 4.0, 0.0, 0.0]])}
    warm = quality.WarmRegrownAdam([(layer, "weight")])
    trainer = SimpleNamespace(optimizers=[optimizer])
    warm.on_train_start(trainer, None)
    layer.weight_mask.copy_(torch.tensor([[1.0, 0.0, 1.0, 0.0]]))  # the second dropped, the third regrown
    warm.on_train_batch_end(trainer, None)
    assert optimizer.state[layer.weight_orig]["exp_avg_sq"].tolist() == [[2.0, 4.0, 2.0, 0.0]]  # the kept one's


def test_cosine_lr_schedule_decays_over_each_arms_own_epochs_and_refuses_arms_with_their_own() -> None:
    quality = _quality_module()
    settings = quality.Settings(lr_schedule="cosine")
    runs = {r.arm: r for r in quality.plan(["lp_gradual", "lp_rigl_erk_3x"], [0.9], [0], settings)}
    assert {r.settings.lr_schedule for r in runs.values()} == {"cosine"}
    (schedule,) = quality.lr_callbacks(settings, 60)
    assert schedule.lr_at(0) == settings.lr and not schedule.rewind
    assert settings.lr / 100 < schedule.lr_at(59) < settings.lr / 90  # the end of the 3x arm's run, not of 20 epochs
    assert quality.lr_callbacks(quality.Settings(), 60) == []
    with pytest.raises(ValueError, match=r"lp_one_shot_lr_rewind.*set their own learning rate"):
        quality.plan(["lp_gradual", "lp_one_shot_lr_rewind"], [0.9], [0], settings)


def _entry(accuracy: float, flops: float | None) -> dict:
    return {"accuracy": (accuracy, 0.5, 3), "training_flops": flops, "layer_sparsity": {}, "sparsity_counted": 0.0}


def test_flops_plot_draws_one_point_per_counted_arm_and_sparsity(tmp_path: Path) -> None:
    quality = _quality_module()
    summary = {
        "dense": {0.0: _entry(89.0, 1.0)},
        "lp_gradual": {0.98: _entry(87.0, 0.3), 0.99: _entry(86.0, 0.29)},
        "lp_rigl_erk_3x": {0.98: _entry(86.5, 0.07), 0.99: _entry(85.5, 0.04)},
        "modelpruning": {0.99: _entry(80.0, None)},  # not counted: left out
    }
    fig = quality.plot_flops(summary, tmp_path / "flops.png")
    axes = fig.axes
    assert [ax.get_title() for ax in axes] == ["sparsity 0.98", "sparsity 0.99"]
    for ax, sparsity in zip(axes, (0.98, 0.99), strict=True):
        assert ax.get_xscale() == "log"
        points = {
            label: (line.get_xdata()[0], line.get_ydata()[0])
            for line, label in zip(*ax.get_legend_handles_labels(), strict=True)
            for line in [line.lines[0]]
        }
        assert set(points) == {"dense", "lp_gradual", "lp_rigl_erk_3x"}
        for arm in ("lp_gradual", "lp_rigl_erk_3x"):
            entry = summary[arm][sparsity]
            assert points[arm] == (entry["training_flops"], entry["accuracy"][0])
        low, high = ax.get_xlim()  # the x labels a reader sees: plain numbers at 1, 2, 5 of a decade, nothing between
        shown = [(tick.get_position()[0], tick.get_text()) for tick in ax.xaxis.get_majorticklabels()]
        shown = [text for position, text in shown if low <= position <= high]
        decades = range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1)
        wanted = sorted(m * 10.0**k for k in decades for m in (1, 2, 5) if low <= m * 10.0**k <= high)
        assert shown == [f"{value:g}" for value in wanted] and len(shown) >= 3
        assert float(shown[0]) <= min(x for x, _ in points.values())  # the leftmost points have a label beside them
        assert all(tick.get_text() == "" for tick in ax.xaxis.get_minorticklabels())
    legend = fig.legends[0]
    assert [text.get_text() for text in legend.get_texts()] == ["dense", "lp_gradual", "lp_rigl_erk_3x"]
    assert (tmp_path / "flops.png").read_bytes()[:4] == b"\x89PNG"


def test_plots_name_the_runs_epochs_draw_each_criterion_apart_and_a_dense_run_alone_draws_no_flops_panel(
    tmp_path: Path,
) -> None:
    quality = _quality_module()
    summary = {
        "dense": {0.0: _entry(89.0, 1.0)},
        "lp_gradual": {0.9: _entry(88.0, 0.3)},
        "lp_gradual [obs]": {0.9: _entry(88.5, None)},
    }
    fig = quality.plot(summary, tmp_path / "quality.png", epochs=4)
    assert fig._suptitle.get_text() == "LeNet-300-100 on Fashion-MNIST, 4 epochs"
    handles, labels = fig.axes[0].get_legend_handles_labels()
    lines = {label: getattr(handle, "lines", [handle])[0] for handle, label in zip(handles, labels, strict=True)}
    plain, obs = lines["lp_gradual"], lines["lp_gradual [obs]"]
    assert (plain.get_linestyle(), plain.get_marker()) != (obs.get_linestyle(), obs.get_marker())
    flops = quality.plot_flops(summary, tmp_path / "flops.png", epochs=4)
    assert flops.axes[0].get_xlabel() == "training FLOPs (dense 4 epochs = 1)"
    assert quality.plot_flops({"dense": summary["dense"]}, tmp_path / "dense.png") is None
    assert not (tmp_path / "dense.png").exists()


def test_accuracy_plot_has_one_legend_outside_both_panels(tmp_path: Path) -> None:
    quality = _quality_module()
    summary = {
        "dense": {0.0: _entry(89.0, 1.0)},
        "modelpruning": {0.98: _entry(87.4, None), 0.99: _entry(86.1, None)},
        "lp_gradual": {0.98: _entry(88.0, 0.3), 0.99: _entry(86.9, 0.29)},
        "lp_rigl_erk_3x": {0.98: _entry(87.9, 0.07), 0.99: _entry(86.4, 0.04)},
    }
    fig = quality.plot(summary, tmp_path / "quality.png")
    left, right = fig.axes
    assert left.get_legend() is None and right.get_legend() is None  # inside, it covered the dense band
    (legend,) = fig.legends
    assert [text.get_text() for text in legend.get_texts()] == ["dense", "modelpruning", "lp_gradual", "lp_rigl_erk_3x"]
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    renderer = FigureCanvasAgg(fig).get_renderer()  # the figure came back closed
    box = legend.get_window_extent(renderer)
    for ax in (left, right):
        assert not box.overlaps(ax.get_window_extent(renderer))
    drawn = {label for ax in (left, right) for label in ax.get_legend_handles_labels()[1]}
    assert drawn == {"dense", "modelpruning", "lp_gradual", "lp_rigl_erk_3x"}
    assert left.get_ylabel() == "test accuracy (%)"
    tuning = quality.accuracy_label(quality.Settings(val_size=10000))  # a tuning run's held-out images
    assert quality.plot(summary, tmp_path / "tuning.png", tuning).axes[0].get_ylabel() == tuning
    cosine = quality.plot(summary, tmp_path / "cosine.png", tuning, lr_schedule="cosine")
    assert "20 epochs (60 for the _3x arms), cosine learning rate:" in cosine.texts[0].get_text()
    alone = quality.plot({"lp_rigl_erk_3x": summary["lp_rigl_erk_3x"]}, tmp_path / "alone.png", tuning)
    (panel,) = alone.axes  # no gradual arm to zoom on: no empty second panel
    assert panel.get_title() == "every arm" and len(panel.lines) > 0
    assert "learning rate" not in quality.plot(summary, tmp_path / "constant.png").texts[0].get_text()
    assert quality.plot_flops(summary, tmp_path / "flops.png", tuning).axes[0].get_ylabel() == tuning


def test_report_only_returns_the_cached_runs_and_runs_nothing(tmp_path: Path) -> None:
    quality = _quality_module()
    runs = quality.plan(["dense", "lp_gradual"], [0.99], [0, 1], quality.Settings())
    (tmp_path / "runs").mkdir()
    cached = {"run": json.loads(json.dumps(quality.asdict(runs[1]))), "accuracy": 86.0}
    (tmp_path / "runs" / f"{runs[1].key}.json").write_text(json.dumps(cached))
    stale = {"run": {**cached["run"], "seed": 5}, "accuracy": 1.0}  # another run's settings under this key
    (tmp_path / "runs" / f"{runs[3].key}.json").write_text(json.dumps(stale))
    assert quality.execute(runs, tmp_path, jobs=1, fresh=False, cached_only=True) == [cached]
