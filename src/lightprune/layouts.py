"""Where a layer's input features are: in its weight (the input dim) and in the inputs its forward receives.

Activation importance (Wanda) scales each weight by the norm of the input feature it multiplies, N:M groups run
along the input dim, and a sparse Linear layer for export needs its weight as ``(out, in)``. All need to know the
layer's layout (this module imports torch alone, so the callback and the export functions can share it):

* ``nn.Linear``: weight ``(out, in)``, input features on the inputs' last dim;
* transformers' ``Conv1D`` (GPT-2): weight ``(in, out)``, input features on the last dim;
* ``nn.Conv1d/2d/3d``: weight ``(out, in / groups, *kernel)``, input channels on dim 1 of a batched input (dim 0 of
  an unbatched one); a channel's statistic covers every sample and position. With ``groups > 1`` entry ``(o, j)``
  multiplies input channel ``g * in / groups + j``, ``g = o // (out / groups)`` the output channel's group;
* ``nn.ConvTranspose1d/2d/3d``: weight ``(in, out / groups, *kernel)``, input channels on dim 0 of the weight and
  dim 1 of a batched input, whatever ``groups``.
"""

from __future__ import annotations

from torch import Tensor, nn

__all__ = ["feature_layout", "feature_of_entries", "input_dim", "is_transformers_conv1d", "row_dim"]


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


def row_dim(module: nn.Module, name: str) -> int:
    """The dim of ``module.<name>`` whose slices are output units (per-row ranking's rows): 1 for the weight of an
    ``(in, out)`` layout (transformers' ``Conv1D``, ``ConvTranspose``), else 0.

    A grouped ``ConvTranspose`` (``groups > 1``) has no such dim: its dim 1 runs over the channels of one group, so a
    slice along it mixes ``groups`` output channels (``PruningCallback`` refuses ``scope="row"`` on it).

    Example:
        >>> row_dim(nn.Linear(3, 2), "weight"), row_dim(nn.ConvTranspose2d(3, 2, 1), "weight")
        (0, 1)
    """
    return 1 if name == "weight" and input_dim(module) == 0 else 0


def feature_layout(module: nn.Module, name: str) -> str | None:
    """``"last"`` (features on the inputs' last dim), ``"channels"`` (a convolution's input channels), or ``None``
    where ``module.<name>`` has no input feature per entry (a bias, an embedding...).

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
    if isinstance(module, nn.modules.conv._ConvNd):
        return "channels"
    return None


def feature_of_entries(module: nn.Module, values: Tensor) -> Tensor:
    """``values`` (one per input feature of ``module``, e.g. its input norms) laid out to broadcast against
    ``module.weight``: along its input dim, and for a grouped convolution per output channel's group.

    Example:
        >>> import torch
        >>> feature_of_entries(nn.Conv1d(4, 2, 1, groups=2), torch.tensor([1.0, 2.0, 3.0, 4.0])).squeeze(-1)
        tensor([[1., 2.],
                [3., 4.]])
        >>> feature_of_entries(nn.Linear(3, 2), torch.tensor([1.0, 2.0, 3.0])).shape
        torch.Size([1, 3])
    """
    weight_dims = module.weight.dim()
    groups = getattr(module, "groups", 1)
    if groups > 1 and input_dim(module) == 1:  # (out, in / groups, *kernel): each group of rows its own inputs
        out = module.weight.shape[0]
        table = values.view(groups, -1).repeat_interleave(out // groups, dim=0)
        return table.view(*table.shape, *([1] * (weight_dims - 2)))
    shape = [1] * weight_dims
    shape[input_dim(module)] = values.numel()
    return values.view(shape)
