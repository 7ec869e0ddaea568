"""``benchmarks/export.py --quick`` end to end in a fresh process: every section runs and the JSON is complete."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "export.py"


@pytest.mark.slow
def test_quick_benchmark_writes_every_section(tmp_path: Path) -> None:
    out = tmp_path / "export.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SCRIPT.parents[1] / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["quick"] is True
    files = result["files"]
    assert {(r["dtype"], r["sparsity"]) for r in files} == {
        (d, s) for d in ("float32", "bfloat16") for s in (0.5, 0.9, 0.95, 0.99)
    }
    for row in files:
        assert row["exact"], row
        # never larger than the dense file, within 2% of the information limit (below it where tensors stored
        # dense, such as biases, skip the limit's 1 bit per entry)
        assert row["lightprune_bytes"] < row["dense_bytes"]
        assert abs(row["lightprune_over_limit"]) < 0.02
        if sys.platform.startswith("linux"):  # the page cache can be dropped: loads timed from the disk too
            assert row["load_dense_cold_s"] > 0 and row["load_lightprune_cold_s"] > 0
    cnn = result["cnn_channels"]
    assert cnn["params_compact"] < cnn["params_dense"] and cnn["max_relative_error"] <= 1e-5
    assert cnn["dense_s"] > 0 and cnn["compact_s"] > 0
    widths = cnn["breakdown"]["conv1_widths"]
    assert [w["out_channels"] for w in widths] == [4, 8, 16, 24, 32] and all(w["s"] > 0 for w in widths)
    (linear,) = result["sparse_linear"]
    assert linear["sparsity"] == 0.95 and linear["max_relative_error"] <= 1e-5
    assert "| cnn_channels compact |" in done.stdout and "| float32 | 90% |" in done.stdout
    assert "page cache dropped" in done.stdout
