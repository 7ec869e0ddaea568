"""Models for the experiment app, the Lightning training wrapper, and FLOP counting for reports.

* :class:`LeNet300100` - the classic fully connected LeNet-300-100 (sizes configurable), for unstructured pruning.
* :class:`SmallCNN` - conv/ReLU/max-pool blocks and a linear head, for structured (channel) pruning.
* :class:`Classifier` - a ``LightningModule`` training any of them with cross-entropy (in
  :mod:`lightprune.experiment.classifier`, imported on first use: the networks need no Lightning).
* :func:`make_model` - the factory the Hydra app calls by name.
* :func:`dense_flops`, :func:`nonzero_flops`, :func:`flops_by_layer`, :func:`theoretical_speedup` - multiply-accumulate
  counts of the Linear and Conv layers, read from the effective weights (``module.weight``), so they work on plain
  and on reparametrized (``weight_orig * weight_mask``) pruned models alike.

Both models are ``nn.Sequential`` subclasses with named children, so parameter names are short and stable
(``fc1.weight``, ``conv2.weight``, ...): those are the names pruning selections, logged metrics and reports use.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "MODEL_NAMES",
    "Classifier",  # noqa: F822  (module __getattr__)
    "LeNet300100",
    "SmallCNN",
    "dense_flops",
    "flops_by_layer",
    "make_model",
    "nonzero_flops",
    "theoretical_speedup",
]

MODEL_NAMES = ("lenet300100", "small_cnn")
"""Names accepted by :func:`make_model`."""

OPTIMIZERS = ("adam", "adamw", "sgd")
"""Optimizer names accepted by :class:`Classifier`."""


class LeNet300100(nn.Sequential):
    """The LeNet-300-100 multilayer perceptron: ``in_features -> 300 -> 100 -> num_classes`` with ReLU.

    The input is flattened first, so images of any shape work. Layers are named ``fc1``, ``fc2``, ... (the last
    one is the classifier), ReLUs ``relu1``, ``relu2``, ... With the default sizes there are 266,200 weights and
    410 biases.

    Args:
        in_features: Input size after flattening (784 for 28x28 images, 64 for 8x8 digits).
        hidden: Widths of the hidden layers.
        num_classes: Number of outputs.

    Example:
        >>> model = LeNet300100()
        >>> model(torch.zeros(2, 1, 28, 28)).shape
        torch.Size([2, 10])
        >>> [name for name, _ in model.named_parameters()][:2]
        ['fc1.weight', 'fc1.bias']
        >>> LeNet300100(in_features=64, hidden=(32,), num_classes=3)
        LeNet300100(
          (flatten): Flatten(start_dim=1, end_dim=-1)
          (fc1): Linear(in_features=64, out_features=32, bias=True)
          (relu1): ReLU()
          (fc2): Linear(in_features=32, out_features=3, bias=True)
        )
    """

    def __init__(self, in_features: int = 784, hidden: Sequence[int] = (300, 100), num_classes: int = 10) -> None:
        layers: OrderedDict[str, nn.Module] = OrderedDict(flatten=nn.Flatten())
        width = in_features
        for i, out in enumerate(hidden, start=1):
            layers[f"fc{i}"] = nn.Linear(width, out)
            layers[f"relu{i}"] = nn.ReLU()
            width = out
        layers[f"fc{len(hidden) + 1}"] = nn.Linear(width, num_classes)
        super().__init__(layers)
        self.in_features = in_features
        self.num_classes = num_classes


def _conv_output_size(size: int, kernel_size: int, stride: int = 1, padding: int = 0) -> int:
    """Output length of a convolution or pooling along one spatial dimension (dilation 1)."""
    return (size + 2 * padding - kernel_size) // stride + 1


class SmallCNN(nn.Sequential):
    """A small convolutional network: ``[conv -> ReLU -> 2x2 max-pool] * len(channels) -> flatten -> linear``.

    Convolutions use ``kernel_size`` with padding ``kernel_size // 2`` (size-preserving for odd kernels); a block
    pools only while both spatial sizes are at least 2, so it works from 8x8 digits (``8 -> 4 -> 2``) to 28x28
    images (``28 -> 14 -> 7``). Layers are named ``conv1``, ``relu1``, ``pool1``, ..., ``flatten``, ``fc``.

    Args:
        in_channels: Input channels.
        image_size: Input height and width, one int for square images.
        channels: Output channels of each conv block.
        num_classes: Number of outputs.
        kernel_size: Convolution kernel size.

    Attributes:
        feature_shape: ``(channels, height, width)`` of the features entering the head.

    Example:
        >>> model = SmallCNN(in_channels=1, image_size=8, channels=(4, 8), num_classes=10)
        >>> model.feature_shape, model.fc.in_features
        ((8, 2, 2), 32)
        >>> model(torch.zeros(3, 1, 8, 8)).shape
        torch.Size([3, 10])
        >>> SmallCNN(image_size=(28, 20)).feature_shape
        (32, 7, 5)
    """

    def __init__(
        self,
        in_channels: int = 1,
        image_size: int | Sequence[int] = 28,
        channels: Sequence[int] = (16, 32),
        num_classes: int = 10,
        kernel_size: int = 3,
    ) -> None:
        height, width = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
        if not channels:
            raise ValueError("SmallCNN needs at least one conv block (channels must not be empty)")
        layers: OrderedDict[str, nn.Module] = OrderedDict()
        depth = in_channels
        padding = kernel_size // 2
        for i, out in enumerate(channels, start=1):
            layers[f"conv{i}"] = nn.Conv2d(depth, out, kernel_size, padding=padding)
            layers[f"relu{i}"] = nn.ReLU()
            height = _conv_output_size(height, kernel_size, padding=padding)
            width = _conv_output_size(width, kernel_size, padding=padding)
            if height < 1 or width < 1:
                raise ValueError(f"image_size {image_size} is too small for {len(channels)} blocks of {kernel_size=}")
            if height >= 2 and width >= 2:
                layers[f"pool{i}"] = nn.MaxPool2d(2)
                height, width = _conv_output_size(height, 2, stride=2), _conv_output_size(width, 2, stride=2)
            depth = out
        layers["flatten"] = nn.Flatten()
        layers["fc"] = nn.Linear(depth * height * width, num_classes)
        super().__init__(layers)
        self.feature_shape = (depth, height, width)
        self.num_classes = num_classes


def make_model(name: str, input_shape: Sequence[int], num_classes: int, **kwargs: Any) -> nn.Module:
    """Builds a model by name, sized from the data (``datamodule.dims`` and ``datamodule.num_classes``).

    Args:
        name: ``"lenet300100"`` or ``"small_cnn"`` (case and dashes ignored).
        input_shape: Shape of one example without the batch dimension: ``(C, H, W)`` for ``small_cnn``; any shape
            for ``lenet300100``, which flattens it.
        num_classes: Number of classes.
        **kwargs: Further constructor arguments (``hidden`` for LeNet; ``channels``, ``kernel_size`` for the CNN).

    Returns:
        The model.

    Raises:
        ValueError: Unknown name, or an input shape the model cannot take.

    Example:
        >>> make_model("lenet300100", (1, 8, 8), 10).fc1.in_features
        64
        >>> make_model("small_cnn", (1, 8, 8), 10, channels=(4,)).feature_shape
        (4, 4, 4)
        >>> make_model("resnet", (1, 8, 8), 10)
        Traceback (most recent call last):
        ...
        ValueError: unknown model 'resnet'; choose one of: lenet300100, small_cnn
    """
    key = name.lower().replace("-", "_")
    shape = tuple(int(d) for d in input_shape)
    if key in ("lenet300100", "lenet_300_100"):
        return LeNet300100(in_features=math.prod(shape), num_classes=num_classes, **kwargs)
    if key == "small_cnn":
        if len(shape) != 3:
            raise ValueError(
                f"small_cnn needs image inputs of shape (C, H, W), got {shape}; load data with flatten=False"
            )
        return SmallCNN(in_channels=shape[0], image_size=shape[1:], num_classes=num_classes, **kwargs)
    raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(MODEL_NAMES)}")


# --------------------------------------------------------------------------------------------------------------------
# FLOPs
# --------------------------------------------------------------------------------------------------------------------

_COUNTED = (nn.Linear, nn.modules.conv._ConvNd)


def flops_by_layer(model: nn.Module, input_shape: Sequence[int]) -> dict[str, tuple[int, int]]:
    """Multiply-accumulates of every Linear and Conv layer for one input: ``{name: (dense, nonzero)}``.

    A weight is used once per output position: ``output_h * output_w`` times in a 2-D conv (``output_numel /
    out_channels`` in general), once per leading position in a Linear (once for a flat input). Dense counts every
    weight, nonzero only those of the effective ``module.weight`` that are nonzero. Biases, activations, pooling
    and normalization are not counted. Output sizes come from forward hooks on one zero input (batch of 1) run in
    eval mode without gradients; the model's training flag is restored afterwards.

    Args:
        model: The model, pruned or not.
        input_shape: Shape of one example without the batch dimension.

    Returns:
        Counts per qualified module name, in call order (a module called twice counts twice).

    Example:
        >>> model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(8, 3))
        >>> with torch.no_grad():
        ...     _ = model[2].weight[0].zero_()
        >>> flops_by_layer(model, (1, 4, 4))
        {'0': (72, 72), '2': (24, 16)}
    """
    counts: dict[str, tuple[int, int]] = {}

    def hook(name: str):
        def count(module: nn.Module, args: Any, output: Tensor) -> None:
            weight = module.weight  # effective weight: weight_orig * weight_mask under torch-style pruning
            channels = module.out_channels if isinstance(module, nn.modules.conv._ConvNd) else module.out_features
            positions = output.numel() // channels
            dense, nonzero = counts.get(name, (0, 0))
            counts[name] = (dense + weight.numel() * positions, nonzero + int(torch.count_nonzero(weight)) * positions)

        return count

    handles = [
        module.register_forward_hook(hook(name))
        for name, module in model.named_modules()
        if isinstance(module, _COUNTED)
    ]
    reference = next(iter(model.parameters()), None)
    if reference is None:
        reference = next(iter(model.buffers()), torch.zeros(()))
    was_training = {module: module.training for module in model.modules()}
    try:
        model.eval()
        with torch.no_grad():
            model(torch.zeros(1, *input_shape, dtype=reference.dtype, device=reference.device))
    finally:
        for handle in handles:
            handle.remove()
        for module, training in was_training.items():
            module.training = training
    return counts


def dense_flops(model: nn.Module, input_shape: Sequence[int]) -> int:
    """Multiply-accumulates of all Linear/Conv weights for one input (see :func:`flops_by_layer`).

    Example:
        >>> dense_flops(LeNet300100(), (784,))
        266200
    """
    return sum(dense for dense, _ in flops_by_layer(model, input_shape).values())


def nonzero_flops(model: nn.Module, input_shape: Sequence[int]) -> int:
    """Multiply-accumulates of the nonzero Linear/Conv weights for one input (see :func:`flops_by_layer`).

    Example:
        >>> model = nn.Linear(10, 2, bias=False)
        >>> with torch.no_grad():
        ...     model.weight[:, :5] = 0
        >>> nonzero_flops(model, (10,))
        10
    """
    return sum(nonzero for _, nonzero in flops_by_layer(model, input_shape).values())


def theoretical_speedup(model: nn.Module, input_shape: Sequence[int]) -> float:
    """Dense over nonzero multiply-accumulates: the speed-up if zeros cost nothing (``inf`` when all are zero).

    Example:
        >>> model = nn.Linear(10, 2, bias=False)
        >>> with torch.no_grad():
        ...     model.weight[:, :5] = 0
        >>> theoretical_speedup(model, (10,))
        2.0
    """
    counts = flops_by_layer(model, input_shape).values()
    dense = sum(d for d, _ in counts)
    nonzero = sum(n for _, n in counts)
    return dense / nonzero if nonzero else math.inf


def __getattr__(name: str) -> Any:
    """``Classifier`` is imported from :mod:`lightprune.experiment.classifier` (and Lightning with it) on first use."""
    if name == "Classifier":
        from lightprune.experiment.classifier import Classifier

        return Classifier
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
