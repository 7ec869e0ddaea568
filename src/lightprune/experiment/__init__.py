"""Hydra experiment app for prune-finetune runs: data (``data``), models (``models``), summaries (``summary``),
plots (``plots``), reports (``report``), the dense-phase cache (``cache``), and :func:`load_run`, which rebuilds a
finished run's pruned model: ``model = load_run("outputs/<date>/<time>-<name>")``.

``load_run`` is imported on first use, so the app's entry point checks a config before torch is loaded.
"""

import importlib
from typing import Any

__all__ = ["load_run"]


def __getattr__(name: str) -> Any:
    if name == "load_run":
        return importlib.import_module("lightprune.experiment.load").load_run
    raise AttributeError(f"module 'lightprune.experiment' has no attribute {name!r}")
