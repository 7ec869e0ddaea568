"""Run summaries, plots and multirun reports for the experiment app.

* :class:`RunSummary` / :func:`summarize` - what one run writes as ``summary.json``: accuracies, per-layer and total
  sparsity, compression, theoretical speed-up, wall time and the config.
* :func:`format_summary_table` - a short text table for the terminal at the end of a run.
* :func:`plot_training_curves` - sparsity and accuracy over training steps from Lightning's ``metrics.csv``.
* :func:`plot_layer_sparsity` - a bar chart of per-layer sparsity.
* :func:`collect_runs`, :func:`write_report`, :func:`report_main` - one Markdown table and one accuracy-versus-sparsity
  plot over every run of a Hydra multirun directory (``lightprune-experiment report <dir>``).

Plots are drawn on ``matplotlib.figure.Figure`` objects directly (no ``pyplot``), so no display is needed, no global
backend is switched and no figure is left open.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightprune.experiment.models import flops_by_layer

__all__ = [
    "RunSummary",
    "collect_runs",
    "format_summary_table",
    "plot_layer_sparsity",
    "plot_training_curves",
    "read_metrics_csv",
    "report_main",
    "sparsity_by_layer",
    "summarize",
    "write_report",
]

SUMMARY_FILE = "summary.json"
"""File name :func:`collect_runs` looks for."""

Selection = Iterable[tuple[nn.Module, str] | tuple[str, nn.Module, str] | str] | None


@dataclass
class RunSummary:
    """The result of one prune-finetune run, as written to ``summary.json``.

    Fractions (accuracy, sparsity) are in [0, 1]. Sparsity, weight counts and compression are over the pruned
    selection; FLOPs and speed-up over all Linear/Conv layers (see :func:`summarize`). In JSON, non-finite numbers
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
        overrides: Hydra overrides of the run (filled in by :func:`collect_runs`, not written by the app).
        run_dir: Directory the summary was read from (filled in by :func:`collect_runs`).

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

    ``None`` selects the ``weight`` of every Linear and Conv layer.
    """
    if parameters is None:
        return [
            (f"{name}.weight" if name else "weight", module, "weight")
            for name, module in model.named_modules()
            if isinstance(module, nn.Linear | nn.modules.conv._ConvNd)
        ]
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
) -> RunSummary:
    """Builds the run summary from the (pruned) model and plain values.

    Sparsity, weight counts and compression are computed over the selection (the pruned parameters); FLOPs and the
    theoretical speed-up over every Linear and Conv layer of the model (see
    :func:`~lightprune.experiment.models.flops_by_layer`), so unpruned layers count at full cost.

    Args:
        model: The model at the end of the run (plain or reparametrized; effective weights are read).
        input_shape: Shape of one example without batch dimension (``datamodule.dims``); ``None`` skips FLOPs.
        parameters: The pruned selection, as in :func:`sparsity_by_layer`; default every Linear/Conv ``weight``.
        dense_test_acc: Test accuracy before pruning, in [0, 1].
        final_test_acc: Test accuracy at the end, in [0, 1].
        wall_time_s: Wall-clock time of the run.
        config: The run's config (an OmegaConf ``DictConfig`` is resolved to plain containers).
        metrics: Further final metrics (tensors are turned into floats).

    Returns:
        The summary; write it with ``summary.to_json(run_dir / "summary.json")``.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.ReLU(), nn.Linear(4, 2, bias=False))
        >>> with torch.no_grad():
        ...     _ = model[0].weight[:3].zero_()
        >>> s = summarize(model, input_shape=(4,), parameters=[(model[0], "weight")], final_test_acc=0.9)
        >>> s.layer_sparsity, s.total_sparsity, s.compression_ratio, s.theoretical_speedup
        ({'0.weight': 0.75}, 0.75, 4.0, 2.0)
    """
    selection = _resolve_selection(model, parameters)
    layer_sparsity = {}
    total = nonzero = 0
    for name, module, param_name in selection:
        tensor = getattr(module, param_name)
        count = int(torch.count_nonzero(tensor))
        layer_sparsity[name] = (tensor.numel() - count) / tensor.numel() if tensor.numel() else 0.0  # zeros / size
        total += tensor.numel()
        nonzero += count
    dense = sparse = speedup = None
    if input_shape is not None:
        counts = flops_by_layer(model, input_shape).values()
        dense = sum(d for d, _ in counts)
        sparse = sum(n for _, n in counts)
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
    width = max([len(label) for label, _ in rows] + [len(name) + 2 for name in summary.layer_sparsity]) + 2
    lines = [f"{label:<{width}}{value}" for label, value in rows]
    if summary.layer_sparsity:
        lines.append("layer sparsity:")
        lines += [f"{'  ' + name:<{width}}{_pct(value)}" for name, value in summary.layer_sparsity.items()]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------------------------------


def read_metrics_csv(metrics_csv: str | Path) -> dict[str, list[tuple[float, float]]]:
    """Reads Lightning ``CSVLogger``'s ``metrics.csv`` into ``{column: [(step, value), ...]}``.

    Empty cells (a key not logged at that row) are skipped; a file without a ``step`` column uses the row index.
    Each series is sorted by step (loggers interleave rows a step or two apart). When the step falls back to at most
    half of the largest step so far (a second ``Trainer``, e.g. for fine-tuning, logging to the same logger), the
    later rows are shifted by that largest step (the new phase's step 0 is the old phase's last step), so phases are
    laid end to end.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     path = Path(tmp) / "metrics.csv"
        ...     _ = path.write_text("epoch,step,train/loss,val/acc\\n0,9,0.5,\\n0,9,,0.8\\n")
        ...     read_metrics_csv(path)
        {'epoch': [(9.0, 0.0), (9.0, 0.0)], 'train/loss': [(9.0, 0.5)], 'val/acc': [(9.0, 0.8)]}
    """
    series: dict[str, list[tuple[float, float]]] = {}
    offset = previous = phase_largest = largest = 0.0
    with Path(metrics_csv).open(newline="") as handle:
        for index, row in enumerate(csv.DictReader(handle)):
            step_text = row.get("step") or ""
            raw_step = float(step_text) if step_text else float(index)
            if raw_step < previous - 2 and raw_step <= phase_largest / 2:  # a new phase, not logging jitter
                offset = largest
                phase_largest = 0.0
            previous = raw_step
            phase_largest = max(phase_largest, raw_step)
            step = raw_step + offset
            largest = max(largest, step)
            for key, text in row.items():
                if key in (None, "step") or not text:
                    continue
                try:
                    value = float(text)
                except ValueError:
                    continue
                series.setdefault(key, []).append((step, value))
    for points in series.values():
        points.sort(key=lambda point: point[0])  # stable: rows of one step keep their order
    return series


_ACC_COLUMN = re.compile(r"^(train|val|test)/acc(_step|_epoch)?$")


def _note(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="grey")


def _lone_point(steps: Sequence[float]) -> dict[str, Any]:
    """A marker for a series of a single point, which a line alone would not show."""
    return {"marker": "o", "markersize": 4} if len(steps) == 1 else {}


def plot_training_curves(metrics_csv: str | Path, out_png: str | Path) -> Path:
    """Draws sparsity (top) and accuracy (bottom) over training steps from a ``metrics.csv``.

    Sparsity uses the pruning callback's columns ``pruning/sparsity/total`` (thick), ``pruning/target`` (dashed red) and
    ``pruning/sparsity/<param>`` (thin); accuracy uses ``train/acc``, ``val/acc`` and ``test/acc`` (also with
    ``_step``/``_epoch`` suffixes). Missing columns are left out; an empty panel says so.

    Args:
        metrics_csv: Lightning ``CSVLogger``'s ``metrics.csv``.
        out_png: Output PNG path (parent directories are created).

    Returns:
        ``out_png`` as a ``Path``.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     csv_path = Path(tmp) / "metrics.csv"
        ...     _ = csv_path.write_text("step,train/acc,pruning/sparsity/total\\n0,0.5,0.0\\n10,0.9,0.5\\n")
        ...     plot_training_curves(csv_path, Path(tmp) / "curves.png").read_bytes()[:4]
        b'\\x89PNG'
    """
    from matplotlib.figure import Figure

    series = read_metrics_csv(metrics_csv)
    fig = Figure(figsize=(8, 6), layout="constrained")
    ax_sparsity, ax_acc = fig.subplots(2, 1, sharex=True)

    layer_keys = [k for k in series if k.startswith("pruning/sparsity/") and k != "pruning/sparsity/total"]
    for key in layer_keys:
        steps, values = zip(*series[key], strict=True)
        label = key.removeprefix("pruning/sparsity/") if len(layer_keys) <= 10 else None
        ax_sparsity.plot(steps, values, linewidth=0.8, alpha=0.6, label=label, **_lone_point(steps))
    if "pruning/sparsity/total" in series:
        steps, values = zip(*series["pruning/sparsity/total"], strict=True)
        ax_sparsity.plot(steps, values, color="black", linewidth=2, label="total", **_lone_point(steps))
    if "pruning/target" in series:
        steps, values = zip(*series["pruning/target"], strict=True)
        target_style = {"color": "tab:red", "linestyle": "--", "linewidth": 1.2, "zorder": 3, **_lone_point(steps)}
        ax_sparsity.plot(steps, values, label="target", **target_style)
    if ax_sparsity.lines:
        ax_sparsity.set_ylim(-0.02, 1.02)
        ax_sparsity.legend(fontsize="small", loc="best")
    else:
        _note(ax_sparsity, "no pruning/* columns in metrics.csv")
    ax_sparsity.set_ylabel("sparsity")
    ax_sparsity.set_title("Sparsity and accuracy over training")
    ax_sparsity.grid(alpha=0.3)

    for key in sorted(k for k in series if _ACC_COLUMN.match(k)):
        steps, values = zip(*series[key], strict=True)
        style = {"linewidth": 0.8, "alpha": 0.5} if key.startswith("train") else {"marker": "o", "markersize": 3}
        ax_acc.plot(steps, values, label=key, **style)
    if ax_acc.lines:
        ax_acc.legend(fontsize="small", loc="best")
    else:
        _note(ax_acc, "no accuracy columns in metrics.csv")
    ax_acc.set_ylabel("accuracy")
    ax_acc.set_xlabel("step")
    ax_acc.grid(alpha=0.3)
    return _save(fig, out_png)


def _save(fig: Any, out_png: str | Path) -> Path:
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    return out_png


def plot_layer_sparsity(summary: RunSummary | Mapping[str, Any], out_png: str | Path) -> Path:
    """Horizontal bar chart of the per-layer sparsity of a run (a :class:`RunSummary` or its dict).

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     s = RunSummary(layer_sparsity={"fc1.weight": 0.9, "fc2.weight": 0.5}, total_sparsity=0.8)
        ...     plot_layer_sparsity(s, Path(tmp) / "layers.png").stat().st_size > 0
        True
    """
    from matplotlib.figure import Figure

    data = summary.to_dict() if isinstance(summary, RunSummary) else dict(summary)
    layers: dict[str, float] = data.get("layer_sparsity") or {}
    names = list(layers)
    fig = Figure(figsize=(7, 1.5 + 0.35 * max(len(names), 1)), layout="constrained")
    ax = fig.subplots()
    if names:
        positions = range(len(names))
        values = [layers[name] for name in names]
        ax.barh(positions, values, color="tab:blue")
        ax.set_yticks(list(positions), names, fontsize="small")
        ax.invert_yaxis()  # first layer on top
        for position, value in zip(positions, values, strict=True):
            ax.text(min(value, 1.0) + 0.01, position, f"{100 * value:.1f}%", va="center", fontsize="small")
        ax.set_xlim(0, 1.12)
    else:
        _note(ax, "no per-layer sparsity in the summary")
    ax.set_xlabel("sparsity (fraction of zero weights)")
    total = data.get("total_sparsity")
    ax.set_title("Per-layer sparsity" + (f" (total {100 * total:.1f}%)" if total is not None else ""))
    return _save(fig, out_png)


# --------------------------------------------------------------------------------------------------------------------
# Multirun report
# --------------------------------------------------------------------------------------------------------------------


def _natural_key(path: Path) -> list[Any]:
    """Sorts ``2`` before ``10`` in Hydra's numbered job directories."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.as_posix())]


def _read_overrides(run_dir: Path, stop: Path) -> list[str]:
    """The run's ``.hydra/overrides.yaml``, looked up from ``run_dir`` towards ``stop``; ``[]`` if none."""
    import yaml

    for folder in (run_dir, *run_dir.parents):
        candidate = folder / ".hydra" / "overrides.yaml"
        if candidate.is_file():
            loaded = yaml.safe_load(candidate.read_text()) or []
            return [str(item) for item in loaded]
        if folder == stop:
            break
    return []


def collect_runs(multirun_dir: str | Path) -> list[RunSummary]:
    """Reads every ``summary.json`` under a Hydra multirun directory, in natural path order.

    Each summary gets ``run_dir`` (its directory) and ``overrides`` (from the run's ``.hydra/overrides.yaml``,
    found in the run directory or the nearest parent inside ``multirun_dir``).

    Args:
        multirun_dir: The sweep directory (e.g. ``multirun/2024-01-01/12-00-00``) or any parent of run directories.

    Returns:
        The summaries; empty if none was found.

    Raises:
        FileNotFoundError: ``multirun_dir`` does not exist.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     _ = RunSummary(total_sparsity=0.5).to_json(Path(tmp) / "summary.json")
        ...     [run.total_sparsity for run in collect_runs(tmp)]
        [0.5]
    """
    root = Path(multirun_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"multirun directory not found: {root}")
    runs = []
    for path in sorted(root.rglob(SUMMARY_FILE), key=_natural_key):
        summary = RunSummary.load(path)
        summary.run_dir = str(path.parent)
        summary.overrides = _read_overrides(path.parent, root)
        runs.append(summary)
    return runs


def _override_pairs(overrides: Sequence[str]) -> dict[str, str]:
    """``["+a.b=1", "~c"]`` -> ``{"a.b": "1", "c": "(deleted)"}``."""
    pairs = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.lstrip("+~")
        pairs[key] = value if sep else "(deleted)"
    return pairs


def _run_label(run: RunSummary, root: Path) -> str:
    if run.run_dir is None:
        return "-"
    try:
        return Path(run.run_dir).relative_to(root).as_posix() or "."
    except ValueError:
        return run.run_dir


def _md_cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def write_report(multirun_dir: str | Path, out_md: str | Path | None = None, out_png: str | Path | None = None) -> str:
    """Writes a Markdown table (one row per run) and an accuracy-versus-sparsity plot for a multirun directory.

    Columns: the run directory, one column per overridden key (from ``.hydra/overrides.yaml``), sparsity, dense and
    final test accuracy, compression and theoretical speed-up.

    Args:
        multirun_dir: The sweep directory.
        out_md: Markdown output; default ``<multirun_dir>/report.md``.
        out_png: Plot output; default ``<multirun_dir>/accuracy_vs_sparsity.png``. The Markdown links it.

    Returns:
        The Markdown text.

    Raises:
        FileNotFoundError: The directory does not exist or holds no ``summary.json``.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     for job, amount in enumerate((0.5, 0.9)):
        ...         run = Path(tmp) / str(job)
        ...         (run / ".hydra").mkdir(parents=True)
        ...         _ = (run / ".hydra" / "overrides.yaml").write_text(f"- prune.amount={amount}\\n")
        ...         _ = RunSummary(total_sparsity=amount, final_test_acc=0.9).to_json(run / "summary.json")
        ...     markdown = write_report(tmp)
        >>> print("\\n".join(markdown.splitlines()[4:8]))
        | run | prune.amount | sparsity | dense acc | final acc | compression | speed-up |
        |---|---|---:|---:|---:|---:|---:|
        | 0 | 0.5 | 50.0% | - | 90.00% | - | - |
        | 1 | 0.9 | 90.0% | - | 90.00% | - | - |
    """
    root = Path(multirun_dir)
    runs = collect_runs(root)
    if not runs:
        raise FileNotFoundError(f"no {SUMMARY_FILE} found under {root}")
    out_md = Path(out_md) if out_md is not None else root / "report.md"
    out_png = Path(out_png) if out_png is not None else root / "accuracy_vs_sparsity.png"

    pairs = [_override_pairs(run.overrides) for run in runs]
    keys: list[str] = []
    for run_pairs in pairs:
        keys += [key for key in run_pairs if key not in keys]
    header = ["run", *keys, "sparsity", "dense acc", "final acc", "compression", "speed-up"]
    lines = [
        f"# Pruning report: {root}",
        "",
        f"{len(runs)} run(s). Sparsity and compression over the pruned weights; speed-up = dense / nonzero FLOPs.",
        "",
        "| " + " | ".join(_md_cell(h) for h in header) + " |",
        "|" + "|".join("---" if i <= len(keys) else "---:" for i in range(len(header))) + "|",
    ]
    for run, run_pairs in zip(runs, pairs, strict=True):
        cells = [
            _run_label(run, root),
            *(run_pairs.get(key, "") for key in keys),
            _pct(run.total_sparsity, 1),
            _pct(run.dense_test_acc),
            _pct(run.final_test_acc),
            _times(run.compression_ratio),
            _times(run.theoretical_speedup),
        ]
        lines.append("| " + " | ".join(_md_cell(cell) for cell in cells) + " |")
    _plot_accuracy_vs_sparsity(runs, root, out_png)
    try:
        link = out_png.resolve().relative_to(out_md.resolve().parent).as_posix()
    except ValueError:
        link = out_png.resolve().as_posix()
    lines += ["", f"![accuracy versus sparsity]({link})", ""]
    markdown = "\n".join(lines)
    out_md.parent.mkdir(parents=True, exist_ok=True)
    out_md.write_text(markdown)
    return markdown


def _plot_accuracy_vs_sparsity(runs: Sequence[RunSummary], root: Path, out_png: Path) -> Path:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 5), layout="constrained")
    ax = fig.subplots()
    points = [(run, run.total_sparsity, run.final_test_acc) for run in runs]
    points = [(run, x, y) for run, x, y in points if x is not None and y is not None]
    if points:
        ax.scatter([100 * x for _, x, _ in points], [100 * y for _, _, y in points], label="final", zorder=3)
        if len(points) <= 15:
            pairs = [_override_pairs(run.overrides) for run, _, _ in points]
            varying = {key for p in pairs for key in p if len({q.get(key) for q in pairs}) > 1}
            for (run, x, y), run_pairs in zip(points, pairs, strict=True):
                label = " ".join(f"{k}={v}" for k, v in run_pairs.items() if k in varying) or _run_label(run, root)
                right = x > 0.6  # keep labels of high-sparsity points inside the axes
                ax.annotate(
                    label,
                    (100 * x, 100 * y),
                    fontsize="x-small",
                    xytext=(-4 if right else 4, 4),
                    textcoords="offset points",
                    ha="right" if right else "left",
                )
        dense = [run.dense_test_acc for run in runs if run.dense_test_acc is not None]
        if dense:
            ax.scatter([0.0] * len(dense), [100 * d for d in dense], marker="x", color="grey", label="dense")
        ax.legend(fontsize="small")
    else:
        _note(ax, "no run has both sparsity and final accuracy")
    ax.set_xlim(-3, 103)
    ax.set_xlabel("sparsity of pruned weights (%)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("Accuracy versus sparsity")
    ax.grid(alpha=0.3)
    return _save(fig, out_png)


def report_main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``lightprune-experiment report <multirun_dir> [--out-md F] [--out-png F]``.

    Prints the Markdown report and returns the exit status (1 when no run was found).

    Example:
        >>> report_main(["/nonexistent/multirun"])
        1
    """
    parser = argparse.ArgumentParser(
        prog="lightprune-experiment report",
        description="Markdown table and accuracy-versus-sparsity plot over the runs of a Hydra multirun directory.",
    )
    parser.add_argument("multirun_dir", type=Path, help="directory holding the runs' summary.json files")
    parser.add_argument("--out-md", type=Path, default=None, help="Markdown output (default <dir>/report.md)")
    parser.add_argument("--out-png", type=Path, default=None, help="plot (default <dir>/accuracy_vs_sparsity.png)")
    args = parser.parse_args(argv)
    try:
        markdown = write_report(args.multirun_dir, out_md=args.out_md, out_png=args.out_png)
    except FileNotFoundError as err:
        print(f"lightprune-experiment report: {err}", file=sys.stderr)
        return 1
    print(markdown)
    return 0
