"""``benchmarks/training_step.py --quick`` runs every arm and writes what it promises (the figures are the
benchmark's, not a test's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "training_step.py"


@pytest.mark.slow  # a fresh process training four arms: tens of seconds on 2 cores
def test_quick_training_step_benchmark(tmp_path: Path) -> None:
    out = tmp_path / "training_step.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--out", str(out)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {row["arm"] for row in rows} == {
        "torch.nn.utils.prune",
        "lightprune, float masks",
        "lightprune, bool masks",
        "lightprune, in place (bool masks)",
        "in place, one gradient pass (bool masks)",
    }
    for row in rows:
        assert abs(row["sparsity"] - 0.9) < 1e-3, row  # every arm trains the 90% pruned model
        assert row["ratio_median"] > 0
    assert "| lightprune, in place (bool masks) |" in done.stdout


PROFILE = SCRIPT.with_name("step_profile.py")


@pytest.mark.slow  # a fresh process training four models a few steps
def test_quick_step_profile(tmp_path: Path) -> None:
    out = tmp_path / "step_profile.json"
    done = subprocess.run(
        [sys.executable, str(PROFILE), "--quick", "--out", str(out)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ms = json.loads(out.read_text())["ms_per_step"]
    assert set(ms) == {
        "dense",
        "lightprune, bool masks",
        "lightprune, in place (bool masks)",
        "in place, one gradient pass (bool masks)",
    }
    # each arm's own passes are where the profile says: the reparametrization's masked copy in the forward; in
    # place, one gradient pass before the step, nothing in the backward and (Adam) no weight pass after the step;
    # dense has none of them
    assert ms["lightprune, bool masks"]["masking in forward"] > 0 == ms["dense"]["masking in forward"]
    assert ms["lightprune, in place (bool masks)"]["gradient pass"] > ms["dense"]["gradient pass"]
    assert ms["lightprune, in place (bool masks)"]["masking in backward"] == 0
    assert (
        ms["lightprune, in place (bool masks)"]["weight pass"]
        < ms["lightprune, in place (bool masks)"]["gradient pass"]
    )
    assert ms["in place, one gradient pass (bool masks)"]["gradient pass"] > ms["dense"]["gradient pass"]
    assert ms["in place, one gradient pass (bool masks)"]["masking in backward"] == 0
    assert "| (of which masking in forward) |" in done.stdout


@pytest.mark.slow  # a fresh process
def test_quick_adam_state_comparison(tmp_path: Path) -> None:
    out = tmp_path / "adam.json"
    done = subprocess.run(
        [sys.executable, str(PROFILE), "--quick", "--adam-state", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]  # the script checks that pruned weights stay zero in each variant
    ms = json.loads(out.read_text())["adam_step_ms"]
    assert set(ms) == {"dense", "all state zeroed", "first moment zeroed", "first moment zeroed, second set to 1"}
    assert all(value > 0 for value in ms.values())
