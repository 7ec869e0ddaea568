"""Calibration passes: forward a few training batches before training starts, to collect input statistics.

A one-shot Wanda event when training starts (step 0) has seen no training batch; ``calibration_batches`` runs the
first ``k`` batches of ``trainer.train_dataloader`` through ``pl_module.training_step`` under ``torch.no_grad()``
first, with the model in eval mode (no dropout, BatchNorm's running statistics untouched; each module's mode is
restored after), the module's ``self.log`` calls skipped, and the random generators left as they were (a shuffling
sampler or dropout would otherwise change the training run that follows).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer

from lightprune._modes import eval_mode

__all__ = ["calibrate", "first_batch"]


@contextlib.contextmanager
def _quiet_eval(pl_module: LightningModule) -> Iterator[None]:
    """Eval mode and no logging for the block; every module's mode and the module's ``log`` restored after."""
    pl_module.log = lambda *args, **kwargs: None  # type: ignore[method-assign]
    pl_module.log_dict = lambda *args, **kwargs: None  # type: ignore[method-assign]
    try:
        with eval_mode(pl_module):
            yield
    finally:
        del pl_module.log, pl_module.log_dict


def calibrate(
    trainer: Trainer,
    pl_module: LightningModule,
    batches: int,
    start_batch: Callable[[Any], None],
    finish_batch: Callable[[], None],
) -> int:
    """Run ``batches`` training batches forward (no gradients), between ``start_batch(batch)`` and ``finish_batch()``.

    Every process must call it (``finish_batch`` all-reduces); each forwards its own shard of the data. Returns the
    number of batches run (fewer when the dataloader is shorter).

    Example:
        >>> from types import SimpleNamespace
        >>> class Tiny(LightningModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.layer, self.seen = torch.nn.Linear(2, 1), []
        ...     def training_step(self, batch, batch_idx):
        ...         self.seen.append((batch_idx, self.training, torch.is_grad_enabled()))
        ...         return self.layer(batch).sum()
        >>> strategy = SimpleNamespace(batch_to_device=lambda batch: batch)
        >>> trainer = SimpleNamespace(train_dataloader=[torch.ones(1, 2)] * 5, strategy=strategy)
        >>> module = Tiny()
        >>> calibrate(trainer, module, 2, lambda batch: None, lambda: None), module.seen, module.training
        (2, [(0, False, False), (1, False, False)], True)
    """
    loader: Any = trainer.train_dataloader
    if loader is None:
        raise ValueError("calibration_batches needs the training dataloader, which this fit does not have")
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    done = 0
    with torch.random.fork_rng(devices=devices), _quiet_eval(pl_module), torch.no_grad():
        for index, batch in enumerate(loader):
            if index >= batches:
                break
            batch = trainer.strategy.batch_to_device(batch)
            start_batch(batch)
            try:
                pl_module.training_step(batch, index)
            finally:
                finish_batch()
            done += 1
    reshard(pl_module)
    return done


def reshard(pl_module: LightningModule) -> None:
    """Put FSDP2 modules back in their sharded state: a root ``fully_shard`` module stays unsharded after a forward
    without backward (it expects the backward to come), which would leave full tensors where the shards belong.

    Example:
        >>> module = torch.nn.Linear(2, 2)  # no FSDP2 module in it: nothing to do
        >>> reshard(module)
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return
    for module in pl_module.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def first_batch(trainer: Trainer) -> Any:
    """The first batch of ``trainer.train_dataloader``, on the device, with the random generators left as they were
    (a shuffling sampler draws from them: the training run that follows sees the same batches).

    Example:
        >>> from types import SimpleNamespace
        >>> strategy = SimpleNamespace(batch_to_device=lambda batch: batch)
        >>> first_batch(SimpleNamespace(train_dataloader=[torch.ones(1, 2)] * 3, strategy=strategy)).shape
        torch.Size([1, 2])
    """
    loader: Any = trainer.train_dataloader
    if loader is None:
        raise ValueError("finding units needs a training batch, and this fit has no training dataloader")
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        for batch in loader:
            return trainer.strategy.batch_to_device(batch)
    raise ValueError("finding units needs a training batch, and the training dataloader is empty")
