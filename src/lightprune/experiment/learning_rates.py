"""Learning rates carried from one phase of a run to the next (``optim.lr_rewind=false``).

Kept apart from :mod:`.app` so that the app reports a config error before Lightning is imported.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback
from typing_extensions import override

__all__ = ["HoldLearningRate", "final_learning_rates"]


def final_learning_rates(trainer: Any) -> list[list[float]]:
    """The learning rate of every param group of every optimizer of ``trainer``, as a fit left them.

    Example:
        >>> from types import SimpleNamespace
        >>> import torch
        >>> sgd = torch.optim.SGD([{"params": [torch.zeros(1)], "lr": 0.5}, {"params": [torch.ones(1)]}], lr=0.1)
        >>> final_learning_rates(SimpleNamespace(optimizers=[sgd]))
        [[0.5, 0.1]]
    """
    return [[float(group["lr"]) for group in optimizer.param_groups] for optimizer in trainer.optimizers]


class HoldLearningRate(Callback):
    """Fine-tuning without learning-rate rewinding: at the start of fit each param group takes the learning rate the
    previous phase ended with (:func:`final_learning_rates`), and the phase's schedulers are dropped.

    Args:
        lrs: One list per optimizer, one learning rate per param group; extra optimizers or groups keep their own.

    Example:
        >>> from types import SimpleNamespace
        >>> import torch
        >>> sgd = torch.optim.SGD([torch.zeros(1)], lr=0.1)
        >>> trainer = SimpleNamespace(optimizers=[sgd], strategy=SimpleNamespace(lr_scheduler_configs=["cosine"]))
        >>> HoldLearningRate([[0.02]]).on_train_start(trainer, None)
        >>> final_learning_rates(trainer), trainer.strategy.lr_scheduler_configs
        ([[0.02]], [])
    """

    def __init__(self, lrs: list[list[float]]) -> None:
        self.lrs = lrs

    @override
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        for optimizer, groups in zip(trainer.optimizers, self.lrs, strict=False):
            for group, lr in zip(optimizer.param_groups, groups, strict=False):
                group["lr"] = lr
        trainer.strategy.lr_scheduler_configs = []
