"""Hydra experiment app for prune-finetune runs: data (``data``), models (``models``), summaries (``summary``),
plots (``plots``), reports (``report``), the dense-phase cache (``cache``), and :func:`load_run`, which rebuilds a
finished run's pruned model: ``model = load_run("outputs/<date>/<time>-<name>")``."""

from lightprune.experiment.load import load_run

__all__ = ["load_run"]
