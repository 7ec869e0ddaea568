"""Models for the experiment app, the Lightning training wrapper, and FLOP counting for reports.

* :class:`LeNet300100` - the classic fully connected LeNet-300-100 (sizes configurable), for unstructured pruning.
* :class:`SmallCNN` - conv/ReLU/max-pool blocks and a linear head, for structured (channel) pruning.
* :class:`Classifier` - a ``LightningModule`` training any of them with cross-entropy (in
  :mod:`lightprune.experiment.classifier`, imported on first use: the networks need no Lightning).
* :func:`make_model` - the factory the Hydra app calls by name.
* :func:`count_flops`, :func:`dense_flops`, :func:`nonzero_flops`, :func:`flops_by_layer`, :func:`theoretical_speedup`
  - multiply-accumulates of any model, counted by :class:`torch.utils.flop_counter.FlopCounterMode` and attributed
  to the layers whose (effective, ``module.weight``) weights they use, so they work on plain and on reparametrized
  (``weight_orig * weight_mask``) pruned models alike.

Both models are ``nn.Sequential`` subclasses with named children, so parameter names are short and stable
(``fc1.weight``, ``conv2.weight``, ...): those are the names pruning selections, logged metrics and reports use.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightprune import choices
from lightprune._modes import eval_mode

__all__ = [
    "MODEL_NAMES",
    "Classifier",  # noqa: F822  (module __getattr__)
    "FlopCount",
    "LeNet300100",
    "SmallCNN",
    "count_flops",
    "dense_flops",
    "flops_by_layer",
    "make_model",
    "nonzero_flops",
    "theoretical_speedup",
]

MODEL_NAMES = choices.MODELS
"""Names accepted by :func:`make_model`."""

OPTIMIZERS = choices.OPTIMIZERS
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


def make_model(
    name: str,
    input_shape: Sequence[int],
    num_classes: int,
    hidden: Sequence[int] | None = None,
    channels: Sequence[int] | None = None,
    **kwargs: Any,
) -> nn.Module:
    """Builds a model by name, sized from the data (``datamodule.dims`` and ``datamodule.num_classes``).

    It is the ``_target_`` of the app's bundled ``model`` presets, which is why it takes the sizes of both models:
    one config switches models by ``name``, and the argument of the other model is ignored.

    Args:
        name: ``"lenet300100"`` or ``"small_cnn"`` (case and dashes ignored).
        input_shape: Shape of one example without the batch dimension: ``(C, H, W)`` for ``small_cnn``; any shape
            for ``lenet300100``, which flattens it.
        num_classes: Number of classes.
        hidden: LeNet's hidden layer sizes (``None``: its default).
        channels: the CNN's conv layers' output channels (``None``: its default).
        **kwargs: Further constructor arguments of the model (``kernel_size`` for the CNN).

    Returns:
        The model.

    Raises:
        ValueError: Unknown name, or an input shape the model cannot take.

    Example:
        >>> make_model("lenet300100", (1, 8, 8), 10).fc1.in_features
        64
        >>> make_model("small_cnn", (1, 8, 8), 10, hidden=[300, 100], channels=(4,)).feature_shape
        (4, 4, 4)
        >>> make_model("resnet", (1, 8, 8), 10)
        Traceback (most recent call last):
        ...
        ValueError: unknown model 'resnet'; choose one of: lenet300100, small_cnn
    """
    key = name.lower().replace("-", "_")
    shape = tuple(int(d) for d in input_shape)
    if key in ("lenet300100", "lenet_300_100"):
        if hidden is not None:
            kwargs["hidden"] = tuple(hidden)
        return LeNet300100(in_features=math.prod(shape), num_classes=num_classes, **kwargs)
    if key == "small_cnn":
        if len(shape) != 3:
            raise ValueError(
                f"small_cnn needs image inputs of shape (C, H, W), got {shape}; load data with flatten=False"
            )
        if channels is not None:
            kwargs["channels"] = tuple(channels)
        return SmallCNN(in_channels=shape[0], image_size=shape[1:], num_classes=num_classes, **kwargs)
    raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(MODEL_NAMES)}")


# --------------------------------------------------------------------------------------------------------------------
# FLOPs
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class FlopCount:
    """Multiply-accumulates of one forward pass, by the layer whose weight they multiply.

    Counted by :class:`torch.utils.flop_counter.FlopCounterMode` (matrix products, convolutions, attention of any
    module) and halved: it counts a multiply-accumulate as 2 FLOPs. The count of a module is given to it when it
    holds a ``weight`` tensor itself (Linear, Conv, a custom layer), minus what its submodules count; the sparse
    figure scales it by that weight's measured density (``module.weight``: the effective weight, so plain and
    reparametrized pruned models count alike). Work that no weight-holding module owns (attention's score and value
    products, a functional matmul in a parent's ``forward``) is ``unattributed`` and counts as dense in both figures.

    Attributes:
        layers: qualified module name -> ``(dense, nonzero)`` multiply-accumulates, in the order modules were called.
        unattributed: multiply-accumulates no weight-holding module owns (in both ``dense`` and ``nonzero``).

    Example:
        >>> count = count_flops(nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)), torch.zeros(1, 4))
        >>> count.layers, count.dense, count.unattributed
        ({'0': (12, 12), '2': (6, 6)}, 18, 0)
    """

    layers: dict[str, tuple[int, int]] = field(default_factory=dict)
    unattributed: int = 0

    @property
    def dense(self) -> int:
        """Multiply-accumulates with every weight."""
        return sum(dense for dense, _ in self.layers.values()) + self.unattributed

    @property
    def nonzero(self) -> int:
        """Multiply-accumulates with the nonzero weights only (unattributed work counted in full)."""
        return sum(nonzero for _, nonzero in self.layers.values()) + self.unattributed


def _example(model: nn.Module, inputs: Any) -> Any:
    """``inputs`` as given, or a batch of one zero example when it is a shape (on the model's device and dtype)."""
    if isinstance(inputs, Tensor | tuple | dict) and not (
        isinstance(inputs, tuple) and all(isinstance(d, int) for d in inputs)
    ):
        return inputs
    reference = next(iter(model.parameters()), None)
    if reference is None:
        reference = next(iter(model.buffers()), torch.zeros(()))
    return torch.zeros(1, *(int(d) for d in inputs), dtype=reference.dtype, device=reference.device)


def count_flops(model: nn.Module, inputs: Any) -> FlopCount:
    """Multiply-accumulates of one forward pass of ``model``, attributed to the layers whose weights they use.

    Args:
        model: Any module, pruned or not. It runs once in eval mode; training flags are restored.
        inputs: The example to run: a tensor, a tuple of positional arguments or a dict of keyword arguments; or
            the shape of one example without the batch dimension (a batch of one zero example is made).

    Returns:
        A :class:`FlopCount`.

    Example:
        >>> model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(8, 3))
        >>> with torch.no_grad():
        ...     _ = model[2].weight[0].zero_()
        >>> count_flops(model, (1, 4, 4)).layers
        {'0': (72, 72), '2': (24, 16)}
    """
    from torch.utils.flop_counter import FlopCounterMode

    example = _example(model, inputs)
    counter = FlopCounterMode(display=False)
    # gradients on: under no_grad, fused fast paths (MultiheadAttention's) escape the counter
    with eval_mode(model), counter:
        if isinstance(example, dict):
            model(**example)
        elif isinstance(example, tuple):
            model(*example)
        else:
            model(example)
    root = type(model).__name__
    totals = {
        name: sum(by_op.values()) for name, by_op in counter.get_flop_counts().items() if name != "Global"
    }  # "Root.child.grandchild" -> FLOPs, parents including their children
    modules = dict(model.named_modules())
    children = dict.fromkeys(totals, 0)
    for name, total in totals.items():  # give each count to its nearest counted ancestor (a ModuleList never runs)
        parent = name.rpartition(".")[0]
        while parent and parent not in totals:
            parent = parent.rpartition(".")[0]
        if parent:
            children[parent] += total
    result = FlopCount()
    for name, total in totals.items():
        if name != root and not name.startswith(root + "."):
            continue
        qualified = name[len(root) + 1 :]
        module = modules.get(qualified)
        own = (total - children[name]) // 2
        if own <= 0:
            continue
        weight = getattr(module, "weight", None) if module is not None else None
        if isinstance(weight, Tensor) and weight.numel() > 0:
            nonzero = own * int(torch.count_nonzero(weight.detach())) // weight.numel()
            dense_before, nonzero_before = result.layers.get(qualified, (0, 0))
            result.layers[qualified] = (dense_before + own, nonzero_before + nonzero)
        else:
            result.unattributed += own
    return result


def flops_by_layer(model: nn.Module, input_shape: Any) -> dict[str, tuple[int, int]]:
    """Multiply-accumulates of every weight-holding layer for one input: ``{name: (dense, nonzero)}``.

    The layers of :func:`count_flops` (which also reports the work no layer's weight owns). A weight is used once
    per output position: ``output_h * output_w`` times in a 2-D conv, once per leading position in a Linear.

    Args:
        model: The model, pruned or not.
        input_shape: Shape of one example without the batch dimension (or an example, as :func:`count_flops` takes).

    Returns:
        Counts per qualified module name.

    Example:
        >>> model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(8, 3))
        >>> with torch.no_grad():
        ...     _ = model[2].weight[0].zero_()
        >>> flops_by_layer(model, (1, 4, 4))
        {'0': (72, 72), '2': (24, 16)}
    """
    return count_flops(model, input_shape).layers


def dense_flops(model: nn.Module, input_shape: Sequence[int]) -> int:
    """Multiply-accumulates of one input with every weight (see :func:`count_flops`).

    Example:
        >>> dense_flops(LeNet300100(), (784,))
        266200
    """
    return count_flops(model, input_shape).dense


def nonzero_flops(model: nn.Module, input_shape: Sequence[int]) -> int:
    """Multiply-accumulates of one input with the nonzero weights (see :func:`count_flops`).

    Example:
        >>> model = nn.Linear(10, 2, bias=False)
        >>> with torch.no_grad():
        ...     model.weight[:, :5] = 0
        >>> nonzero_flops(model, (10,))
        10
    """
    return count_flops(model, input_shape).nonzero


def theoretical_speedup(model: nn.Module, input_shape: Sequence[int]) -> float:
    """Dense over nonzero multiply-accumulates: the speed-up if zeros cost nothing (``inf`` when all are zero).

    Example:
        >>> model = nn.Linear(10, 2, bias=False)
        >>> with torch.no_grad():
        ...     model.weight[:, :5] = 0
        >>> theoretical_speedup(model, (10,))
        2.0
    """
    count = count_flops(model, input_shape)
    return count.dense / count.nonzero if count.nonzero else math.inf


def __getattr__(name: str) -> Any:
    """``Classifier`` is imported from :mod:`lightprune.experiment.classifier` (and Lightning with it) on first use."""
    if name == "Classifier":
        from lightprune.experiment.classifier import Classifier

        return Classifier
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
