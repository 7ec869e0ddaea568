"""Rebuild the pruned model of a finished run: ``model = load_run("outputs/<date>/<time>-<name>")``.

A run directory holds ``summary.json`` (the config, the input shape and the number of classes) and ``model.pt`` (the
network's state_dict, pruned weights as zeros). :func:`load_run` builds the network the config names and loads the
weights into it; ``lightprune-experiment load <run dir>`` does the same from the command line and prints the model
and its sparsity.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from lightprune.experiment.config import BUNDLED_DATA_TARGET, BUNDLED_MODEL_TARGET, is_bundled
from lightprune.experiment.summary import SUMMARY_FILE, RunSummary, sparsity_by_layer
from lightprune.experiment.targets import build_datamodule, build_model

__all__ = ["MODEL_FILE", "load_main", "load_run"]

MODEL_FILE = "model.pt"
"""File name of the pruned network's state_dict in a run directory."""


def _shape_and_classes(summary: RunSummary) -> tuple[tuple[int, ...], int]:
    """The input shape and class count of the run's data: stored in the summary, else read from the data."""
    if summary.input_shape is not None and summary.num_classes is not None:
        return tuple(summary.input_shape), summary.num_classes
    data = {"_target_": BUNDLED_DATA_TARGET, **summary.config["data"]}  # written before presets were targets
    datamodule = build_datamodule(data)  # a summary written before these fields: load the data
    return tuple(datamodule.dims), datamodule.num_classes


def load_run(run_dir: str | Path, *, map_location: str | torch.device = "cpu") -> nn.Module:
    """The pruned network of a finished run, rebuilt from its config and loaded with its weights (in eval mode).

    Args:
        run_dir: The run's directory (``summary.json`` and ``model.pt``).
        map_location: Where to put the weights.

    Returns:
        The network (e.g. :class:`~lightprune.experiment.models.LeNet300100`, or the class of ``model._target_``):
        plain parameters, pruned ones zero.

    Raises:
        FileNotFoundError: ``summary.json`` or ``model.pt`` is missing (``save_model=false`` writes no model).

    Example:
        >>> import tempfile
        >>> from lightprune.experiment.models import LeNet300100
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     net = LeNet300100(64, (8,), 3)
        ...     _ = torch.save(net.state_dict(), f"{tmp}/model.pt")
        ...     config = {"model": {"name": "lenet300100", "hidden": [8]}}
        ...     _ = RunSummary(config=config, input_shape=[1, 8, 8], num_classes=3).to_json(f"{tmp}/summary.json")
        ...     model = load_run(tmp)
        >>> torch.equal(model.fc1.weight, net.fc1.weight), model.training
        (True, False)
    """
    run_dir = Path(run_dir)
    for name in (SUMMARY_FILE, MODEL_FILE):
        if not (run_dir / name).is_file():
            raise FileNotFoundError(f"{run_dir / name} not found: load_run needs a finished run with save_model=true")
    summary = RunSummary.load(run_dir / SUMMARY_FILE)
    model_cfg = summary.config["model"]
    model_cfg = {"_target_": BUNDLED_MODEL_TARGET, **model_cfg}  # written before the presets were _target_ nodes
    if is_bundled(model_cfg):
        shape, classes = _shape_and_classes(summary)
    else:  # the user's model (or LightningModule): the sizes the run recorded, if its constructor takes them
        shape, classes = summary.input_shape, summary.num_classes
    network = build_model(model_cfg, shape, classes)
    network.load_state_dict(torch.load(run_dir / MODEL_FILE, map_location=map_location, weights_only=True))
    return network.eval()


def load_main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``lightprune-experiment load <run dir>``: loads the run's model, prints it and its sparsity.

    Example:
        >>> load_main(["/nonexistent/run"])
        1
    """
    parser = argparse.ArgumentParser(
        prog="lightprune-experiment load",
        description="Rebuild a finished run's pruned model from its config and weights; print it and its sparsity. "
        "In Python: from lightprune.experiment import load_run; model = load_run(run_dir)",
    )
    parser.add_argument("run_dir", type=Path, help="the run directory (summary.json and model.pt)")
    args = parser.parse_args(argv)
    try:
        model = load_run(args.run_dir)
    except (FileNotFoundError, ValueError, KeyError) as err:
        print(f"lightprune-experiment load: {err}", file=sys.stderr)
        return 1
    print(model)
    layers = sparsity_by_layer(model)
    width = max(len(name) for name in layers) + 2
    print("sparsity:")
    for name, value in layers.items():
        print(f"  {name:<{width}}{100 * value:.2f}%")
    print(f"\nfrom lightprune.experiment import load_run; model = load_run({str(args.run_dir)!r})")
    return 0
