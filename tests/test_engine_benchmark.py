"""``benchmarks/engine.py``'s arguments and table headers: a typo is an error naming the allowed values (a long run
would otherwise do nothing useful and exit 0), and the training-step table names the width that was run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmark_scripts import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "engine.py"


@pytest.mark.parametrize(
    ("argument", "message"),
    [
        (["--sizes", "5M"], "--sizes: 5M not among 34M, 134M, 268M, 1B, 2000x224"),
        (["--ops", "global_ll"], "--ops: global_ll not among global_l1, l1_layerwise"),
    ],
)
def test_an_unknown_size_or_operation_is_an_error_naming_the_allowed_ones(argument: list[str], message: str) -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), *argument], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_the_training_step_table_names_the_width_that_was_run() -> None:
    engine = load_script("engine")
    rows = [
        {"size": "MLP", "op": "train_step_sgd", "impl": impl, "width": 512, "seconds": 0.01, "runs": [0.01]}
        for impl in ("dense", "lightprune-bool")
    ]
    assert "| training step, 4 × Linear(512, 512) with bias, batch 64, sgd |" in engine.render(rows)
