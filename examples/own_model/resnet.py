"""A user's own network for the experiment app: a small ResNet (BatchNorm, residual blocks) for 28x28 images.

lightprune knows nothing about it: ``conf/model/resnet.yaml`` names it by import path (``_target_: resnet.ResNet``)
and the app wraps it in its classifier, prunes, fine-tunes and reports it like a bundled model. See README.md.
"""

from __future__ import annotations

from torch import Tensor, nn


class Block(nn.Module):
    """Two 3x3 conv + BatchNorm layers with an identity (or 1x1 conv + BatchNorm) shortcut."""

    def __init__(self, channels_in: int, channels_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or channels_in != channels_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(channels_in, channels_out, 1, stride=stride, bias=False), nn.BatchNorm2d(channels_out)
            )

    def forward(self, x: Tensor) -> Tensor:
        out = nn.functional.relu(self.bn1(self.conv1(x)))
        return nn.functional.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    """A stem conv, one residual block per stage (each stage after the first halves the size), pooling, a head.

    Args:
        widths: output channels of each stage.
        in_channels: input channels (1 for Fashion-MNIST).
        num_classes: outputs.
    """

    def __init__(self, widths: tuple[int, ...] = (16, 32, 64), in_channels: int = 1, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, widths[0], 3, padding=1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU()
        )
        blocks = []
        for index, width in enumerate(widths):
            blocks.append(Block(widths[max(index - 1, 0)], width, stride=1 if index == 0 else 2))
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(widths[-1], num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.pool(self.blocks(self.stem(x))).flatten(1))
