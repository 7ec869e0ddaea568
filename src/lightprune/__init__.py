"""lightprune: exact, fast and lean pruning for PyTorch and Lightning.

``lightprune.prune`` is a drop-in replacement for ``torch.nn.utils.prune`` and needs torch alone.
``lightprune.PruningCallback`` (Lightning) is imported lazily, so using the engine never imports Lightning; the
engine itself is imported on first use, so the experiment app checks its config before torch is loaded.

Example:
    >>> from lightprune import prune
    >>> import torch
    >>> layer = prune.l1_unstructured(torch.nn.Linear(4, 2), "weight", amount=0.5)
    >>> int((layer.weight == 0).sum())
    4
"""

import importlib
from typing import Any

__version__ = "0.1.0"
__all__ = ["PruningCallback", "__version__", "prune"]


def __getattr__(name: str) -> Any:
    if name == "prune":
        return importlib.import_module("lightprune.prune")
    if name == "PruningCallback":
        from lightprune.callback import PruningCallback

        return PruningCallback
    raise AttributeError(f"module 'lightprune' has no attribute {name!r}")
