"""Where a layer's input features are: in its weight (the input dim) and in the inputs its forward receives.

Activation importance (Wanda) scales each weight by the norm of the input feature it multiplies, N:M groups run
along the input dim, and a sparse Linear layer for export needs its weight as ``(out, in)``. All need to know the
layer's layout (this module imports torch alone, so the callback and the export functions can share it):

* ``nn.Linear``: weight ``(out, in)``, input features on the inputs' last dim;
* transformers' ``Conv1D`` (GPT-2): weight ``(in, out)``, input features on the last dim;
* ``nn.Conv1d/2d/3d`` with ``groups=1``: weight ``(out, in, *kernel)``, input channels on dim 1 of a batched input
  (dim 0 of an unbatched one); a channel's statistic covers every sample and position.
"""

from __future__ import annotations

from torch import nn

__all__ = ["feature_layout", "input_dim", "is_transformers_conv1d"]


def is_transformers_conv1d(module: nn.Module) -> bool:
    """transformers' ``Conv1D`` (a Linear whose weight is stored ``(in, out)``), without importing transformers.

    Example:
        >>> is_transformers_conv1d(nn.Linear(3, 2)), is_transformers_conv1d(nn.Conv1d(3, 2, 1))
        (False, False)
    """
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def input_dim(module: nn.Module) -> int:
    """The dim of ``module.weight`` that runs over input features: 0 for ``(in, out)`` weights, else 1.

    Example:
        >>> input_dim(nn.Linear(3, 2)), input_dim(nn.ConvTranspose2d(3, 2, 1))
        (1, 0)
    """
    if is_transformers_conv1d(module) or isinstance(module, nn.modules.conv._ConvTransposeNd):
        return 0
    return 1


def feature_layout(module: nn.Module, name: str) -> str | None:
    """``"last"`` (features on the inputs' last dim), ``"channels"`` (a convolution's input channels), or ``None``
    where ``module.<name>`` has no input feature per entry (a bias, an embedding, a grouped convolution...).

    Example:
        >>> feature_layout(nn.Linear(3, 2), "weight"), feature_layout(nn.Conv2d(3, 2, 1), "weight")
        ('last', 'channels')
        >>> feature_layout(nn.Embedding(3, 2), "weight") is None, feature_layout(nn.Linear(3, 2), "bias") is None
        (True, True)
    """
    if name != "weight":
        return None
    if isinstance(module, nn.Linear) or is_transformers_conv1d(module):
        return "last"
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) and module.groups == 1:
        return "channels"
    return None
