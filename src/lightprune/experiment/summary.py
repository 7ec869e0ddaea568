"""What one prune-finetune run writes as ``summary.json``, and the short table printed at its end.

* :class:`RunSummary` / :func:`summarize` - accuracies, per-layer and total sparsity, compression, theoretical speed-up,
  wall time, the config and where the run came from (overrides, run directory).
* :func:`sparsity_by_layer` - the fraction of zeros of each selected weight.
* :func:`format_summary_table` - a short text table for the terminal at the end of a run.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightprune.experiment.models import count_flops

__all__ = ["SUMMARY_FILE", "RunSummary", "format_summary_table", "sparsity_by_layer", "summarize"]

SUMMARY_FILE = "summary.json"
"""File name of a run's summary in its run directory."""

Selection = Iterable[tuple[nn.Module, str] | tuple[str, nn.Module, str] | str] | None


@dataclass
class RunSummary:
    """The result of one prune-finetune run, as written to ``summary.json``.

    Fractions (accuracy, sparsity) are in [0, 1]. Sparsity, weight counts and compression are over the pruned
    selection; FLOPs and speed-up over the whole forward pass (see :func:`summarize`). In JSON, non-finite numbers
    (the compression of a fully pruned selection) are written as ``null``.

    Attributes:
        dense_test_acc: Test accuracy before pruning.
        final_test_acc: Test accuracy at the end of the run.
        total_sparsity: Fraction of zeros over the selected weights.
        compression_ratio: Selected weights / nonzero selected weights.
        theoretical_speedup: Dense FLOPs / nonzero FLOPs.
        layer_sparsity: Qualified parameter name -> fraction of zeros.
        total_weights: Number of selected weights.
        nonzero_weights: Number of nonzero selected weights.
        dense_flops: Multiply-accumulates of one input with all weights.
        nonzero_flops: Multiply-accumulates of one input with the nonzero weights.
        wall_time_s: Wall-clock time of the run in seconds.
        config: The run's configuration (plain containers).
        metrics: Any further final metrics (e.g. ``{"val/acc": 0.97}``).
        overrides: Hydra overrides of the run (``.hydra/overrides.yaml``), as the app wrote them.
        run_dir: The run directory when the app wrote the summary; :func:`~lightprune.experiment.report.collect_runs`
            replaces it by the directory it read the summary from (runs may have been moved).
        input_shape: Shape of one input example without the batch dimension (to rebuild the model).
        num_classes: Number of classes of the data (to rebuild the model).
        layer_channels: For structured pruning: qualified parameter name -> ``[kept, total]`` channels along the
            pruned dimension (a channel is kept while any of its weights is nonzero).
        dense_cache: How the dense phase was obtained: ``"trained"`` (cache off), ``"stored"`` (trained and put in
            the cache), ``"loaded"`` (taken from the cache).
        dense_time_s: Wall-clock seconds of the dense phase (training and test, or loading it from the cache).
        flops_layers: The layers whose multiply-accumulates were attributed to their weights (their nonzero count
            scaled by the weight's density), in call order; see :func:`~lightprune.experiment.models.count_flops`.
        flops_unattributed: Multiply-accumulates that no weight-holding layer owns (attention products, functional
            matmuls), counted in full in both ``dense_flops`` and ``nonzero_flops``.
        file_size_ratio: Measured: bytes of the dense safetensors file of the network / bytes of its
            ``model.safetensors`` (:func:`lightprune.export.save_sparse`).
        latency_ratio: Measured: median latency of the masked network / of ``latency_model`` at batch 64 (>1: faster).
        latency_model: What ``latency_ratio`` measured: ``compact`` (structured runs), ``sparse_linear`` (CSR where
            faster) or ``masked`` (no faster form: 1.0).
        export_notes: Why an export step was skipped.

    Example:
        >>> s = RunSummary(dense_test_acc=0.98, final_test_acc=0.97, total_sparsity=0.9, compression_ratio=10.0)
        >>> RunSummary.from_json(s.to_json()) == s
        True
    """

    dense_test_acc: float | None = None
    final_test_acc: float | None = None
    total_sparsity: float | None = None
    compression_ratio: float | None = None
    theoretical_speedup: float | None = None
    layer_sparsity: dict[str, float] = field(default_factory=dict)
    total_weights: int | None = None
    nonzero_weights: int | None = None
    dense_flops: int | None = None
    nonzero_flops: int | None = None
    wall_time_s: float | None = None
    config: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    overrides: list[str] = field(default_factory=list)
    run_dir: str | None = None
    input_shape: list[int] | None = None
    num_classes: int | None = None
    layer_channels: dict[str, list[int]] = field(default_factory=dict)
    dense_cache: str | None = None
    dense_time_s: float | None = None
    flops_layers: list[str] = field(default_factory=list)
    flops_unattributed: int | None = None
    file_size_ratio: float | None = None
    latency_ratio: float | None = None
    latency_model: str | None = None
    export_notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (non-finite floats become ``None``).

        Example:
            >>> RunSummary(compression_ratio=math.inf).to_dict()["compression_ratio"] is None
            True
        """
        return _finite(dataclasses.asdict(self))

    def to_json(self, path: str | Path | None = None) -> str:
        """Serializes to indented, strict JSON; also writes it to ``path`` when given.

        Example:
            >>> print(RunSummary(final_test_acc=0.5).to_json().splitlines()[2])
              "final_test_acc": 0.5,
        """
        text = json.dumps(self.to_dict(), indent=2, default=str, allow_nan=False) + "\n"
        if path is not None:
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        return text

    @classmethod
    def from_json(cls, text: str) -> RunSummary:
        """Parses :meth:`to_json` output; unknown keys (from newer versions) are ignored.

        Example:
            >>> RunSummary.from_json('{"total_sparsity": 0.5, "future_key": 1}').total_sparsity
            0.5
        """
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"a run summary must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in known})

    @classmethod
    def load(cls, path: str | Path) -> RunSummary:
        """Reads a ``summary.json`` file (``run_dir`` is left as stored)."""
        return cls.from_json(Path(path).read_text())


def _finite(value: Any) -> Any:
    """Recursively replaces non-finite floats by ``None`` (strict JSON has no inf/nan)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


def _plain_config(config: Any) -> dict[str, Any]:
    """Turns an OmegaConf config (resolved) or any mapping into plain containers."""
    if config is None:
        return {}
    if type(config).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        return OmegaConf.to_container(config, resolve=True)  # type: ignore[return-value]
    return dict(config)


def _resolve_selection(model: nn.Module, parameters: Selection) -> list[tuple[str, nn.Module, str]]:
    """``(qualified name, module, parameter name)`` for each selected parameter.

    ``None`` selects what :class:`lightprune.PruningCallback` selects by default
    (:func:`lightprune.selection.select_parameters` itself: the ``weight`` of every Linear and Conv layer, a tied
    weight once), so the summary's totals match the callback's logged ones.
    """
    if parameters is None:
        from lightprune.selection import select_parameters

        try:
            return select_parameters(model)
        except ValueError:  # nothing the callback would select: nothing to summarize
            return []
    names = {id(module): name for name, module in model.named_modules()}
    selection = []
    for entry in parameters:
        if isinstance(entry, str):
            module_name, _, param_name = entry.rpartition(".")
            module = model.get_submodule(module_name)
            qualified = entry
        elif len(entry) == 3:  # (qualified name, module, name), as lightprune.selection.select_parameters gives
            qualified, module, param_name = entry
        else:
            module, param_name = entry
            if id(module) not in names:
                raise ValueError(f"selected module {type(module).__name__} (parameter {param_name!r}) is not in model")
            qualified = f"{names[id(module)]}.{param_name}" if names[id(module)] else param_name
        if not isinstance(getattr(module, param_name, None), torch.Tensor):
            raise ValueError(f"{qualified}: {type(module).__name__} has no tensor attribute {param_name!r}")
        selection.append((qualified, module, param_name))
    return selection


def sparsity_by_layer(model: nn.Module, parameters: Selection = None) -> dict[str, float]:
    """Fraction of zeros of each selected effective weight, by qualified name.

    Args:
        model: The model.
        parameters: ``(module, name)`` pairs as for ``prune.global_unstructured``, ``(qualified name, module,
            name)`` triples as ``lightprune.selection.select_parameters`` returns, or qualified names such as
            ``"fc1.weight"``; default: the ``weight`` of every Linear and Conv layer. The effective tensor
            (``getattr(module, name)``) is read, which is ``orig * mask`` under torch-style pruning.

    Returns:
        ``{qualified name: fraction of zeros}`` in selection order.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 2), nn.ReLU(), nn.Linear(2, 2))
        >>> with torch.no_grad():
        ...     _ = model[0].weight[0].zero_()
        >>> sparsity_by_layer(model)
        {'0.weight': 0.5, '2.weight': 0.0}
    """
    result = {}
    for name, module, param_name in _resolve_selection(model, parameters):
        tensor = getattr(module, param_name)
        result[name] = float((tensor == 0).sum()) / tensor.numel() if tensor.numel() else 0.0
    return result


def summarize(
    model: nn.Module,
    *,
    input_shape: Sequence[int] | None = None,
    parameters: Selection = None,
    dense_test_acc: float | None = None,
    final_test_acc: float | None = None,
    wall_time_s: float | None = None,
    config: Any = None,
    metrics: Mapping[str, float] | None = None,
    channel_dim: int | None = None,
    num_classes: int | None = None,
    example_input: Any = None,
) -> RunSummary:
    """Builds the run summary from the (pruned) model and plain values.

    Sparsity, weight counts and compression are computed over the selection (the pruned parameters); FLOPs and the
    theoretical speed-up over the whole forward pass of the model (see
    :func:`~lightprune.experiment.models.count_flops`), so unpruned layers count at full cost.

    Args:
        model: The model at the end of the run (plain or reparametrized; effective weights are read).
        input_shape: Shape of one example without batch dimension (``datamodule.dims``); ``None`` skips FLOPs.
        parameters: The pruned selection, as in :func:`sparsity_by_layer`; default every Linear/Conv ``weight``.
        dense_test_acc: Test accuracy before pruning, in [0, 1].
        final_test_acc: Test accuracy at the end, in [0, 1].
        wall_time_s: Wall-clock time of the run.
        config: The run's config (an OmegaConf ``DictConfig`` is resolved to plain containers).
        metrics: Further final metrics (tensors are turned into floats).
        channel_dim: For structured pruning, the dimension whose slices are channels: fills ``layer_channels``.
        num_classes: Number of classes of the data, stored to rebuild the model.
        example_input: The input FLOPs are counted on (a tensor, a tuple of arguments or a dict of keyword
            arguments, batch of one), when a zero tensor of ``input_shape`` will not do (token ids); it takes
            precedence over ``input_shape`` for the count.

    Returns:
        The summary; write it with ``summary.to_json(run_dir / "summary.json")``.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.ReLU(), nn.Linear(4, 2, bias=False))
        >>> with torch.no_grad():
        ...     _ = model[0].weight[:3].zero_()
        >>> s = summarize(model, input_shape=(4,), parameters=[(model[0], "weight")], final_test_acc=0.9)
        >>> s.layer_sparsity, s.total_sparsity, s.compression_ratio, s.theoretical_speedup
        ({'0.weight': 0.75}, 0.75, 4.0, 2.0)
        >>> summarize(model, parameters=[(model[0], "weight")], channel_dim=0).layer_channels
        {'0.weight': [1, 4]}
    """
    selection = _resolve_selection(model, parameters)
    layer_sparsity = {}
    layer_channels = {}
    total = nonzero = 0
    for name, module, param_name in selection:
        tensor = getattr(module, param_name)
        if channel_dim is not None and tensor.ndim > 0:
            channels = tensor.detach().movedim(channel_dim, 0).reshape(tensor.shape[channel_dim], -1)
            layer_channels[name] = [int((channels != 0).any(dim=1).sum()), int(channels.shape[0])]
        count = int(torch.count_nonzero(tensor))
        layer_sparsity[name] = (tensor.numel() - count) / tensor.numel() if tensor.numel() else 0.0  # zeros / size
        total += tensor.numel()
        nonzero += count
    dense = sparse = speedup = unattributed = None
    flops_layers: list[str] = []
    inputs = example_input if example_input is not None else input_shape
    if inputs is not None:
        count = count_flops(model, tuple(inputs) if isinstance(inputs, list) else inputs)
        dense, sparse, unattributed = count.dense, count.nonzero, count.unattributed
        flops_layers = list(count.layers)
        speedup = dense / sparse if sparse else math.inf
    return RunSummary(
        dense_test_acc=_as_float(dense_test_acc),
        final_test_acc=_as_float(final_test_acc),
        total_sparsity=1.0 - nonzero / total if total else 0.0,
        compression_ratio=total / nonzero if nonzero else math.inf,
        theoretical_speedup=speedup,
        layer_sparsity=layer_sparsity,
        total_weights=total,
        nonzero_weights=nonzero,
        dense_flops=dense,
        nonzero_flops=sparse,
        wall_time_s=_as_float(wall_time_s),
        config=_plain_config(config),
        metrics={key: float(value) for key, value in (metrics or {}).items()},
        input_shape=None if input_shape is None else [int(size) for size in input_shape],
        num_classes=num_classes,
        layer_channels=layer_channels,
        flops_layers=flops_layers,
        flops_unattributed=unattributed,
    )


def _as_float(value: Any) -> float | None:
    return None if value is None else float(value)


# --------------------------------------------------------------------------------------------------------------------
# Text
# --------------------------------------------------------------------------------------------------------------------


def _pct(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{100 * value:.{digits}f}%"


def _times(value: float | None) -> str:
    if value is None:
        return "-"
    return "inf" if math.isinf(value) else f"{value:.2f}x"


def format_summary_table(summary: RunSummary) -> str:
    """A short two-column text table of a run for the terminal, then the per-layer sparsity.

    Example:
        >>> s = RunSummary(dense_test_acc=0.98, final_test_acc=0.975, total_sparsity=0.9, compression_ratio=10.0,
        ...                theoretical_speedup=8.0, layer_sparsity={"fc1.weight": 0.95}, wall_time_s=12.5)
        >>> print(format_summary_table(s))
        dense test acc          98.00%
        final test acc          97.50%
        sparsity (selection)    90.00%
        compression             10.00x
        theoretical speed-up    8.00x
        wall time               12.5 s
        layer sparsity:
          fc1.weight            95.00%
        >>> s = RunSummary(layer_sparsity={"conv1.weight": 0.5}, layer_channels={"conv1.weight": [8, 16]})
        >>> print(format_summary_table(s).splitlines()[-1])
          conv1.weight          50.00%  (8 of 16 channels kept)
    """
    wall = "-" if summary.wall_time_s is None else f"{summary.wall_time_s:.1f} s"
    rows = [
        ("dense test acc", _pct(summary.dense_test_acc)),
        ("final test acc", _pct(summary.final_test_acc)),
        ("sparsity (selection)", _pct(summary.total_sparsity)),
        ("compression", _times(summary.compression_ratio)),
        ("theoretical speed-up", _times(summary.theoretical_speedup)),
        ("wall time", wall),
    ]
    if summary.file_size_ratio is not None:
        rows.insert(5, ("file size (measured)", f"{_times(summary.file_size_ratio)} smaller (model.safetensors)"))
    if summary.latency_ratio is not None:
        faster = f"{_times(summary.latency_ratio)} ({summary.latency_model} vs masked, batch 64)"
        rows.insert(6, ("latency (measured)", faster))
    if summary.flops_unattributed and summary.dense_flops:
        share = summary.flops_unattributed / summary.dense_flops
        attributed = f"{_pct(share)} (counted dense; {len(summary.flops_layers)} layers were)"
        rows.insert(5, ("FLOPs not attributed", attributed))
    width = max([len(label) for label, _ in rows] + [len(name) + 2 for name in summary.layer_sparsity]) + 2
    lines = [f"{label:<{width}}{value}" for label, value in rows]
    if summary.layer_sparsity:
        lines.append("layer sparsity:")
        for name, value in summary.layer_sparsity.items():
            channels = summary.layer_channels.get(name)
            kept = f"  ({channels[0]} of {channels[1]} channels kept)" if channels else ""
            lines.append(f"{'  ' + name:<{width}}{_pct(value)}{kept}")
    return "\n".join(lines)
