"""Long runs keep memory flat (issue #6): ``benchmarks/long_run.py`` at reduced size, in a fresh process.

1,000 optimizer steps with a pruning event every 10 steps (100 events) must not grow the resident set by more than
20 MB between step 100 and the end (measured: well under 1 MB; the full 10,000-step run is in RELIABILITY.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "long_run.py"
LIMIT_MB = 20


@pytest.mark.slow
def test_a_thousand_steps_with_a_hundred_events_keep_memory_flat(tmp_path: Path) -> None:
    out = tmp_path / "long_run.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--steps", "1000", "--sample-every", "100", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert (result["steps"], result["events"], result["last_event"]) == (1000, 100, 1000)
    assert result["sparsity"] == round(0.95 * result["weights"]) / result["weights"]  # exact at the end
    growth_mb = result["rss_growth_bytes"] / 2**20
    assert growth_mb < LIMIT_MB, done.stdout
    # each tensor's PruningContainer keeps one small method object per event that pruned it (about 100 bytes)
    assert all(length <= result["events"] for length in result["container_history"])
