"""Check lightprune as installed from its wheel, run from outside the checkout (CI runs it in a fresh venv).

``python check_installed.py torch-alone``: with only torch and the wheel (``--no-deps``) installed, the engine imports
and prunes, and nothing of Lightning, Hydra or torchmetrics is needed.
``python check_installed.py app RUN_DIR``: after ``lightprune-experiment`` wrote RUN_DIR, its summary reached the
default target, and lightprune's presets are found by another Hydra app through the search-path plugin.
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
import tempfile
from pathlib import Path


def torch_alone() -> None:
    import torch

    import lightprune
    from lightprune import prune

    assert "site-packages" in lightprune.__file__, f"lightprune imported from {lightprune.__file__}, not the wheel"
    assert importlib.metadata.version("lightprune") == lightprune.__version__  # the version is written once
    layer = prune.l1_unstructured(torch.nn.Linear(8, 8), "weight", amount=0.75)
    assert int((layer.weight == 0).sum()) == 48
    loaded = sorted(name for name in ("lightning", "hydra", "torchmetrics", "omegaconf") if name in sys.modules)
    assert not loaded, f"the engine imported {loaded}"
    print(f"lightprune {lightprune.__version__}: lightprune.prune works with torch {torch.__version__} alone")


def app(run_dir: Path) -> None:
    from hydra import compose, initialize_config_dir

    summary = json.loads((run_dir / "summary.json").read_text())
    assert abs(summary["total_sparsity"] - 0.9) < 1e-3, summary["total_sparsity"]
    with tempfile.TemporaryDirectory() as empty, initialize_config_dir(config_dir=empty, version_base="1.3"):
        cfg = compose(overrides=["+pruning=gmp_cubic"])  # found through hydra_plugins/lightprune_searchpath.py
    assert cfg.pruning._target_.startswith("lightprune."), cfg.pruning
    print(f"the default experiment ran from the wheel (sparsity {summary['total_sparsity']:.3f}); presets found")


if __name__ == "__main__":
    if sys.argv[1] == "torch-alone":
        torch_alone()
    else:
        app(Path(sys.argv[2]))
