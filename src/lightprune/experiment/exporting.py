"""What a pruned run is worth on disk and on this machine: the app's export step (:mod:`lightprune.export`).

:func:`export_run` writes ``model.safetensors`` (:func:`lightprune.export.save_sparse`: each tensor dense or as a
bitmask plus its kept values) and, for structured runs, ``model_compact.pt`` (:func:`lightprune.export.compact`:
the pruned channels physically removed; for runs of ``method=neurons``/``heads``,
:func:`lightprune.export.remove_units`: the pruned neurons and heads removed, same class), and measures what the
summary reports next to the theoretical FLOP speed-up: the file-size ratio against the dense safetensors file of the
same state_dict, and the latency ratio of the deployable model (the compact one, or the sparse-Linear one where CSR
measures faster) against the masked model, interleaved (:func:`lightprune.export.compare_latency`).
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["COMPACT_FILE", "SPARSE_FILE", "ExportResult", "export_run"]

SPARSE_FILE = "model.safetensors"
"""The network's sparse safetensors checkpoint in a run directory (``lightprune.export.load_sparse`` reads it)."""
COMPACT_FILE = "model_compact.pt"
"""The compact network of a structured run (a pickled ``torch.fx.GraphModule``: ``torch.load(..., weights_only=False)``
from a trusted run only)."""

LATENCY_BATCH = 64
"""Batch size of the latency measurement."""

log = logging.getLogger(__name__)


@dataclass
class ExportResult:
    """Files written and figures measured by :func:`export_run`.

    Attributes:
        files: file name -> bytes.
        file_size_ratio: dense safetensors bytes / ``model.safetensors`` bytes.
        latency_ratio: masked model's median latency / deployed model's (>1: faster).
        deployed: what the latency was measured on: ``compact``, ``sparse_linear`` or ``masked`` (nothing faster).
        notes: why a step was skipped (a model compact cannot trace, no example input).
    """

    files: dict[str, int] = field(default_factory=dict)
    file_size_ratio: float | None = None
    latency_ratio: float | None = None
    deployed: str | None = None
    notes: list[str] = field(default_factory=list)


def _plain_zeros(network: nn.Module) -> dict[str, torch.Tensor]:
    """The network's state_dict with every floating zero a ``+0.0``.

    A pruned weight is ``weight_orig * mask``, so each pruned negative weight is ``-0.0``, whose bits
    :func:`~lightprune.export.save_sparse` keeps as a value (it restores tensors bit for bit): half the pruned
    entries would be stored. They compare equal to 0.0 and compute the same.
    """
    state = {}
    for name, tensor in network.state_dict().items():
        tensor = tensor.detach().contiguous().clone()
        if tensor.is_floating_point():
            tensor[tensor == 0] = 0.0
        state[name] = tensor
    return state


def _dense_bytes(state: dict[str, torch.Tensor]) -> int:
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "dense.safetensors"
        save_file(state, str(path))
        return path.stat().st_size


def _batch(example: Any) -> Any:
    """The example input repeated to :data:`LATENCY_BATCH` rows (a batch of one as given)."""
    if isinstance(example, torch.Tensor):
        return example[:1].expand(LATENCY_BATCH, *example.shape[1:]).contiguous()
    return example


def _save_graph_module(module: Any, path: Path, result: ExportResult) -> None:
    """``torch.save`` the compact model. A traced ``forward`` annotated under ``from __future__ import annotations``
    carries its annotations as strings, which ``GraphModule`` cannot pickle: they are dropped (they do not change
    what it computes) and the module recompiled."""
    try:
        torch.save(module, path)
    except Exception:
        for node in module.graph.nodes:
            node.type = None
        module.recompile()
        try:
            torch.save(module, path)
        except Exception as err:
            path.unlink(missing_ok=True)
            result.notes.append(f"compact model not saved: {' '.join(str(err).split())[:300]}")
            return
    result.files[path.name] = path.stat().st_size


def export_run(
    network: nn.Module, output_dir: Path, example: Any, *, structured: bool, repeats: int = 20, units: bool = False
) -> ExportResult:
    """Write the sparse (and, for ``structured`` runs, the compact) model into ``output_dir`` and measure them.

    Never fails the run: a step that cannot be done (``compact`` on a model ``torch.fx`` cannot trace) is skipped
    with a note.

    Args:
        network: The pruned network (plain weights with zeros).
        output_dir: The run directory.
        example: One example input (batch of one), or ``None`` (no latency then).
        structured: Whether channels were pruned (``compact`` is tried).
        units: Whether neurons or heads were pruned (``remove_units`` is tried).
        repeats: Timed rounds of the latency comparison.

    Example:
        >>> import tempfile
        >>> from lightprune import prune
        >>> net = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))
        >>> _ = prune.ln_structured(net[0], "weight", amount=0.5, n=2, dim=0)
        >>> _ = prune.remove(net[0], "weight")
        >>> result = export_run(net, Path(tempfile.mkdtemp()), torch.zeros(1, 256), structured=True, repeats=3)
        >>> sorted(result.files), result.deployed, result.file_size_ratio > 1.5
        (['model.safetensors', 'model_compact.pt'], 'compact', True)
    """
    from lightprune.export import compact, compare_latency, remove_units, save_sparse, to_sparse_linear

    result = ExportResult()
    sparse_path = output_dir / SPARSE_FILE
    state = _plain_zeros(network)
    save_sparse(state, sparse_path)
    result.files[SPARSE_FILE] = sparse_path.stat().st_size
    result.file_size_ratio = _dense_bytes(state) / result.files[SPARSE_FILE]
    if example is None:
        result.notes.append("no example input (data.input_shape or the module's example_input_array): no latency")
        return result
    was_training = network.training
    network.eval()
    deployed: nn.Module | None = None
    try:
        if units:
            try:
                args = (example,) if isinstance(example, torch.Tensor) else tuple(example)
                deployed = remove_units(network, args)
                result.deployed = "compact"
            except Exception as err:  # CompactError, UnitError
                result.notes.append(f"remove_units skipped: {' '.join(str(err).split())[:300]}")
        elif structured:
            try:
                deployed = compact(network, example)
                result.deployed = "compact"
            except Exception as err:  # CompactError, or a model torch.fx cannot trace
                result.notes.append(f"compact skipped: {' '.join(str(err).split())[:300]}")
        if deployed is not None and units:
            torch.save(deployed, output_dir / COMPACT_FILE)  # the model's own class, smaller
            result.files[COMPACT_FILE] = (output_dir / COMPACT_FILE).stat().st_size
        elif deployed is not None:
            _save_graph_module(deployed, output_dir / COMPACT_FILE, result)
        if deployed is None:
            try:
                converted, decisions = to_sparse_linear(network, _batch(example), repeats=5)
                if any(decision.converted for decision in decisions):
                    deployed, result.deployed = converted, "sparse_linear"
            except Exception as err:
                result.notes.append(f"sparse Linear skipped: {' '.join(str(err).split())[:300]}")
        if deployed is None:
            result.deployed = "masked"
            result.latency_ratio = 1.0
            return result
        latency = compare_latency({"masked": network, "deployed": deployed}, _batch(example), repeats=repeats)
        result.latency_ratio = latency["masked"].median / latency["deployed"].median
    finally:
        network.train(was_training)
    return result
