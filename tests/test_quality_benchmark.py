"""``benchmarks/quality.py --quick`` (issue #7) end to end, in a fresh process, on a Fashion-MNIST look-alike.

The data are scikit-learn's bundled 8x8 digits padded to 28x28 and written in MNIST IDX layout, so the test runs
anywhere (the real benchmark reads Debian's Fashion-MNIST). It checks what the full benchmark promises: every arm
runs, the counted sparsity is exact (lightprune) or within ModelPruning's per-round rounding, the Markdown table,
the plot and the JSON are written, the epoch-time comparison is there, and a rerun reuses the cached runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from sklearn.datasets import load_digits

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
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.mark.slow
def test_quick_benchmark_runs_every_arm_and_writes_the_report(tmp_path: Path) -> None:
    data, out = tmp_path / "data", tmp_path / "out"
    _digits_as_idx(data)
    done = _run(data, out)
    assert "13 runs: 0 cached, 13 to do" in done.stdout

    payload = json.loads((out / "quality.json").read_text())
    results = payload["results"]
    assert sorted({r["run"]["arm"] for r in results}) == sorted(ARMS)
    assert len(results) == 1 + 6 * 2  # dense once, six pruning arms at 0.9 and 0.98, one seed
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

    again = _run(data, out)
    assert "13 runs: 13 cached, 0 to do" in again.stdout


def _quality_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("quality_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


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
