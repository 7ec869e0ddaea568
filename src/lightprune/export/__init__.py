"""``lightprune.export``: take a pruned model somewhere smaller and faster.

* :func:`save_sparse` / :func:`load_sparse` - a safetensors checkpoint storing each tensor dense or as a packed
  bitmask plus its kept values, whichever is smaller; loads back bit for bit into a plain state_dict.
* :func:`compact` - a smaller model with the pruned channels of Linear/Conv layers physically removed, computing
  the same function (constants of removed channels folded into the next layer).
* :func:`remove_units` / :func:`load_compact` - pruned MLP neurons and attention heads removed from Hugging Face and
  torch models (same class, no ``torch.fx``), and the compact model loaded back from ``save_pretrained``.
* :func:`to_sparse_linear` - unstructured-sparse ``nn.Linear`` layers on torch's CSR kernel, where measured faster.
* :func:`measure_latency` / :func:`compare_latency` - inference latency, models interleaved.
* :func:`merge_lora` - LoRA adapters folded into pruned weights, as sparse as the masks say.

Example:
    >>> import torch
    >>> from lightprune import prune
    >>> from lightprune.export import compact
    >>> net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> _ = prune.ln_structured(net[0], "weight", amount=0.5, n=2, dim=0)
    >>> compact(net, torch.randn(1, 8)).get_submodule("2").in_features
    4
"""

from lightprune.export.compact import CompactError, compact
from lightprune.export.latency import Latency, compare_latency, measure_latency
from lightprune.export.lora import merge_lora
from lightprune.export.sparse_file import SparseFileError, load_sparse, save_sparse, stored_layouts
from lightprune.export.sparse_linear import LayerDecision, SparseLinear, to_sparse_linear
from lightprune.export.units import load_compact, remove_units

__all__ = [
    "CompactError",
    "Latency",
    "LayerDecision",
    "SparseFileError",
    "SparseLinear",
    "compact",
    "compare_latency",
    "load_compact",
    "load_sparse",
    "measure_latency",
    "merge_lora",
    "remove_units",
    "save_sparse",
    "stored_layouts",
    "to_sparse_linear",
]
