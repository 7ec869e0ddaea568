"""The Lightning training wrapper of the experiment app's models (kept apart so the networks import without Lightning).

:class:`Classifier` is importable as ``lightprune.experiment.models.Classifier`` too.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torchmetrics
from torch import Tensor, nn

from lightprune.choices import OPTIMIZERS

__all__ = ["Classifier"]


class Classifier(pl.LightningModule):
    """Trains a classification model with cross-entropy and logs loss and accuracy.

    Logged keys: ``train/loss`` and ``train/acc`` every step; ``val/loss``, ``val/acc``, ``test/loss`` and
    ``test/acc`` per epoch (accuracies are torchmetrics multiclass micro accuracy and go to the progress bar).
    Hyperparameters are saved without the model object (checkpoints need the model rebuilt, e.g. with
    ``Classifier.load_from_checkpoint(path, model=make_model(...))``).

    Args:
        model: The network; it maps a batch of inputs to logits (and flattens them itself if it needs to).
        lr: Learning rate.
        optimizer: ``"adam"``, ``"adamw"`` or ``"sgd"``.
        weight_decay: Weight decay.
        momentum: SGD momentum (ignored by Adam/AdamW).
        num_classes: Number of classes for the accuracy metrics; default: ``out_features`` of the model's last
            ``nn.Linear``.

    Example:
        >>> from lightprune.experiment.models import LeNet300100
        >>> module = Classifier(LeNet300100(in_features=4, hidden=(8,), num_classes=3), lr=0.1, optimizer="sgd")
        >>> module.hparams
        "lr":           0.1
        "momentum":     0.9
        "num_classes":  3
        "optimizer":    sgd
        "weight_decay": 0.0
        >>> module(torch.zeros(5, 4)).shape
        torch.Size([5, 3])
        >>> type(module.configure_optimizers()).__name__
        'SGD'
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float = 1e-3,
        optimizer: str = "adam",
        weight_decay: float = 0.0,
        momentum: float = 0.9,
        num_classes: int | None = None,
    ) -> None:
        super().__init__()
        optimizer = optimizer.lower()
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {optimizer!r}; choose one of: {', '.join(OPTIMIZERS)}")
        if num_classes is None:
            linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
            if not linears:
                raise ValueError("cannot infer num_classes: the model has no nn.Linear; pass num_classes")
            num_classes = linears[-1].out_features
        self.model = model
        self.save_hyperparameters(ignore=["model"])
        self.hparams["optimizer"] = optimizer
        self.hparams["num_classes"] = num_classes
        self.optimization: dict[str, Any] | None = None
        self.train_acc = torchmetrics.Accuracy(task="multiclass", num_classes=num_classes)
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=num_classes)
        self.test_acc = torchmetrics.Accuracy(task="multiclass", num_classes=num_classes)

    def forward(self, x: Tensor) -> Tensor:
        """Logits of the wrapped model."""
        return self.model(x)

    def _shared_step(self, batch: tuple[Tensor, Tensor], stage: str, accuracy: torchmetrics.Metric) -> Tensor:
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits, y)
        accuracy(logits, y)
        per_step = stage == "train"
        common = {"on_step": per_step, "on_epoch": not per_step, "batch_size": y.shape[0]}
        self.log(f"{stage}/loss", loss, sync_dist=not per_step, **common)
        self.log(f"{stage}/acc", accuracy, prog_bar=True, **common)
        return loss

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        """Cross-entropy on one training batch; logs ``train/loss`` and ``train/acc`` per step."""
        return self._shared_step(batch, "train", self.train_acc)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        """Logs ``val/loss`` and ``val/acc``, averaged over the epoch."""
        return self._shared_step(batch, "val", self.val_acc)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        """Logs ``test/loss`` and ``test/acc``, averaged over the epoch."""
        return self._shared_step(batch, "test", self.test_acc)

    def set_optimization(
        self, optimizer: Any = None, scheduler: Any = None, interval: str = "epoch", key: str = "optim"
    ) -> None:
        """Use these Hydra ``_partial_`` nodes in the next fits' :meth:`configure_optimizers` (``None``: the
        ``optimizer`` / ``lr`` / ``weight_decay`` given to the constructor; no scheduler).

        Example:
            >>> from lightprune.experiment.models import LeNet300100
            >>> module = Classifier(LeNet300100(in_features=4, hidden=(8,), num_classes=3))
            >>> module.set_optimization({"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.5})
            >>> module.configure_optimizers().param_groups[0]["lr"]
            0.5
        """
        self.optimization = {"optimizer": optimizer, "scheduler": scheduler, "interval": interval, "key": key}

    def _phase_length(self, interval: str) -> int:
        trainer = self._trainer
        if trainer is None:
            return 1
        if interval == "step":
            return max(1, int(trainer.estimated_stepping_batches))
        return max(1, int(trainer.max_epochs or 1))

    def configure_optimizers(self) -> Any:
        """The optimizer over all trainable parameters: the one given to :meth:`set_optimization` (with its
        scheduler), else the one named by ``optimizer``."""
        from lightprune.experiment.targets import make_optimizer, make_scheduler

        params = [p for p in self.parameters() if p.requires_grad]
        chosen = self.optimization or {}
        key = chosen.get("key", "optim")
        if chosen.get("optimizer") is not None:
            optimizer = make_optimizer(f"{key}.optimizer", chosen["optimizer"], params)
        else:
            optimizer = self._named_optimizer(params)
        if chosen.get("scheduler") is None:
            return optimizer
        interval = chosen["interval"]
        length = self._phase_length(interval)
        scheduler = make_scheduler(f"{key}.scheduler", chosen["scheduler"], optimizer, length)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": interval}}

    def _named_optimizer(self, params: list[Tensor]) -> torch.optim.Optimizer:
        hp = self.hparams
        if hp.optimizer == "sgd":
            return torch.optim.SGD(params, lr=hp.lr, momentum=hp.momentum, weight_decay=hp.weight_decay)
        if hp.optimizer == "adamw":
            return torch.optim.AdamW(params, lr=hp.lr, weight_decay=hp.weight_decay)
        return torch.optim.Adam(params, lr=hp.lr, weight_decay=hp.weight_decay)
