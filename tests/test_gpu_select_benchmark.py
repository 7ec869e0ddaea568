"""``benchmarks/gpu_select.py`` on the CPU, at a tiny size: every case is timed in every round, lightprune's masks
(float and bool, every chunk size) equal torch's, and ``--device cuda`` without a GPU is refused."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
import torch

from benchmark_scripts import load_script


def load() -> ModuleType:
    return load_script("gpu_select")


@pytest.mark.filterwarnings("ignore::lightprune.prune.collapse.LayerCollapseWarning")
def test_a_tiny_cpu_run_times_every_case_and_matches_torchs_masks(tmp_path: Path) -> None:
    gpu_select = load()
    assert gpu_select.main(["--device", "cpu", "--layers", "2", "--hidden", "64", "--rounds", "2", "--out",
                            str(tmp_path)]) == 0  # fmt: skip
    payload = json.loads((tmp_path / "gpu_select.json").read_text())
    rounds = payload["rounds"]
    assert payload["weights"] == 2 * 64 * 64
    assert all(len(runs) == 2 and all(run["seconds"] > 0 for run in runs) for runs in rounds.values())
    masks = {runs[-1]["masks"] for name, runs in rounds.items() if not name.startswith(("find_cut", "apply_cut"))}
    assert len(masks) == 1 and None not in masks  # torch's and every lightprune variant's: one set of masks
    assert {name for name in rounds if name.startswith("find_cut")} == {
        "find_cut, chunk 2^24", "find_cut, chunk 2^26", "find_cut, chunk 2^28"}  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no GPU is visible")
def test_cuda_without_a_gpu_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        load().main(["--out", str(tmp_path)])
