"""Run every script of ``examples/`` at tiny size (``--quick``) in a fresh process, as a user would.

Each example prints the final sparsity it reached; the tests check the exit code and that number against the
target the script prunes to. They start Python, torch (and Lightning) afresh, so each takes several seconds.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


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


def test_every_example_has_a_docstring_and_a_quick_flag() -> None:
    scripts = sorted(path.name for path in EXAMPLES.glob("*.py"))
    assert scripts == ["engine_plain_loop.py", "iterative_rounds.py", "lightning_callback.py"]
    for name in scripts:
        text = (EXAMPLES / name).read_text()
        assert text.startswith('"""'), name
        assert "--quick" in text, name


@pytest.mark.slow
def test_engine_plain_loop(tmp_path: Path) -> None:
    stdout = run_example("engine_plain_loop.py", "--target", "0.75", cwd=tmp_path)
    assert final_sparsity(stdout) == 0.75
    assert re.search(r"^dense: test accuracy 0\.\d+", stdout, re.MULTILINE)
    assert len(re.findall(r"^step \d: sparsity", stdout, re.MULTILINE)) == 2
    assert re.search(r"^final test accuracy: 0\.\d+", stdout, re.MULTILINE)


@pytest.mark.slow
def test_lightning_callback(tmp_path: Path) -> None:
    stdout = run_example("lightning_callback.py", "--out", str(tmp_path), cwd=tmp_path)
    assert final_sparsity(stdout) == 0.8
    layers = re.findall(r"^net\.\d\.weight: sparsity ([0-9.]+)", stdout, re.MULTILINE)
    assert len(layers) == 3
    metrics = tmp_path / "example" / "version_0" / "metrics.csv"
    assert "pruning/sparsity/total" in metrics.read_text().splitlines()[0]


@pytest.mark.slow
def test_iterative_rounds(tmp_path: Path) -> None:
    stdout = run_example("iterative_rounds.py", cwd=tmp_path)
    rounds = re.findall(r"^round (\d): sparsity ([0-9.]+)", stdout, re.MULTILINE)
    assert [(int(r), float(s)) for r, s in rounds] == [(0, 0.0), (1, 0.2), (2, 0.36)]
    assert final_sparsity(stdout) == 0.36
    assert not list(tmp_path.iterdir())  # nothing written
