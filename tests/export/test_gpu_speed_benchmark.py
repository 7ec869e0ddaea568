"""``benchmarks/gpu_speed.py`` on the CPU (``--device cpu --quick``): the compact-transformer table is computed and
written, the CUDA-only 2:4 table is skipped with a word, and ``--device cuda`` without a GPU is refused."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
import torch

from benchmark_scripts import load_script


def load() -> ModuleType:
    return load_script("gpu_speed")


@pytest.mark.slow
def test_quick_cpu_run_writes_the_compact_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    gpu_speed = load()
    assert gpu_speed.main(["--device", "cpu", "--quick", "--out", str(tmp_path)]) == 0
    assert "semi_structured: skipped" in capsys.readouterr().err
    payload = json.loads((tmp_path / "gpu_speed.json").read_text())
    assert payload["semi_structured"] == []
    (row,) = payload["compact_bert"]
    assert set(row["speedup"]) == {"50% neurons", "50% neurons + 50% heads"}
    dense, neurons, both = row["parameters"].values()
    assert dense > neurons > both  # each compact model is smaller
    assert max(row["error_vs_pruned"].values()) < 1e-5  # and computes what the masked model computes
    table = (tmp_path / "gpu_speed.md").read_text()
    assert "| tiny shape | float32 | 4 x 16 |" in table and "2:4" not in table


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no GPU is visible")
def test_cuda_without_a_gpu_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        load().main(["--device", "cuda"])
    assert "no CUDA device is visible" in capsys.readouterr().err


def test_paired_timing_names_every_variant_and_ratio() -> None:
    calls = {"slow": lambda: sum(range(20_000)), "fast": lambda: None}
    out = load().paired(calls, rounds=3, inner=2, device="cpu")
    assert set(out["ms"]) == {"slow", "fast"} and set(out["speedup"]) == {"fast"}
    speedup = out["speedup"]["fast"]
    assert speedup["q1"] <= speedup["median"] <= speedup["q3"] and speedup["median"] > 1
