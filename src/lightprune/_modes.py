"""A block in eval mode, every module's own ``training`` flag put back after (a model in a mixed state included)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

__all__ = ["eval_mode"]


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Run the block with ``model`` in eval mode; each module's ``training`` flag is restored after, also on error.

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.Dropout())
        >>> model[1].eval()  # a mixed state: training model, dropout off
        Dropout(p=0.5, inplace=False)
        >>> with eval_mode(model):
        ...     model.training, model[1].training
        (False, False)
        >>> model.training, model[1].training
        (True, False)
    """
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training
