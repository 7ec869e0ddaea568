"""Calibration passes: forward a few training batches before training starts, to collect input statistics.

A one-shot Wanda event when training starts (step 0) has seen no training batch; ``calibration_batches`` runs the
first ``k`` batches of ``trainer.train_dataloader`` through ``pl_module.training_step`` under ``torch.no_grad()``
first, with the model in eval mode (no dropout, BatchNorm's running statistics untouched; each module's mode is
restored after), the module's ``self.log`` calls skipped, and the random generators left as they were (a shuffling
sampler or dropout would otherwise change the training run that follows).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import move_data_to_device

from lightprune._modes import eval_mode

__all__ = ["calibrate", "first_batch", "inputs_as_trained_on"]


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
        >>> strategy = SimpleNamespace(batch_to_device=lambda batch, dataloader_idx: batch)
        >>> precision = SimpleNamespace(convert_input=lambda batch: batch, train_step_context=contextlib.nullcontext)
        >>> loader = torch.utils.data.DataLoader(torch.ones(5, 2), batch_size=1)
        >>> trainer = SimpleNamespace(train_dataloader=loader, strategy=strategy, precision_plugin=precision)
        >>> module = Tiny()
        >>> calibrate(trainer, module, 2, lambda batch: None, lambda: None), module.seen, module.training
        (2, [(0, False, False), (1, False, False)], True)
    """
    refuse_uncalibratable(pl_module)
    loader = _training_batches(trainer, "calibration_batches needs the training dataloader")
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    done = 0
    with torch.random.fork_rng(devices=devices), _quiet_eval(pl_module), torch.no_grad():
        for index, batch in enumerate(loader):
            if index >= batches:
                break
            batch = _as_trained_on(trainer, pl_module, batch)
            start_batch(batch)
            try:
                with trainer.precision_plugin.train_step_context():  # autocast; the -true precisions' default dtype
                    pl_module.training_step(batch, index)
            finally:
                finish_batch()
            done += 1
    reshard(pl_module)
    return done


def refuse_uncalibratable(pl_module: LightningModule) -> None:
    """Refuse, naming the reason, a ``training_step`` calibration cannot run forward under ``torch.no_grad()``: one
    that steps its optimizers itself (manual optimization) or takes the dataloader's iterator.

    Example:
        >>> class Manual(LightningModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.automatic_optimization = False
        >>> refuse_uncalibratable(Manual())  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: calibration_batches runs training_step forward under torch.no_grad(), which a manual-optimization...
    """
    from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

    if not pl_module.automatic_optimization:
        raise ValueError(
            "calibration_batches runs training_step forward under torch.no_grad(), which a manual-optimization "
            "training_step (manual_backward, optimizer.step) cannot run: start the schedule after a few steps, so "
            "that the activation_window before its first event gives the statistics"
        )
    if is_param_in_hook_signature(pl_module.training_step, "dataloader_iter", explicit=True):
        raise ValueError(
            "calibration_batches hands training_step one batch at a time, but this training_step takes "
            "dataloader_iter: start the schedule after a few steps, so that the activation_window before its first "
            "event gives the statistics"
        )


def _training_batches(trainer: Trainer, needs: str) -> Iterable[Any]:
    """The training batches as ``training_step`` receives them: from one dataloader, or combined from several (a
    dict or list of them) in the fit's mode."""
    from lightning.pytorch.utilities import CombinedLoader

    loader: Any = trainer.train_dataloader
    if loader is None:
        raise ValueError(f"{needs}, which this fit does not have")
    fitted = getattr(getattr(trainer, "fit_loop", None), "_combined_loader", None)  # the fit's, for its mode
    return (batch for batch, _, _ in CombinedLoader(loader, mode=getattr(fitted, "_mode", "max_size_cycle")))


def _as_trained_on(trainer: Trainer, pl_module: LightningModule, batch: Any) -> Any:
    """``batch`` as the training loop hands it to ``training_step``: the precision's input conversion, the module's
    batch-transfer hooks and the device."""
    batch = trainer.precision_plugin.convert_input(batch)
    batch = pl_module._on_before_batch_transfer(batch, dataloader_idx=0)
    return trainer.strategy.batch_to_device(batch, dataloader_idx=0)


def inputs_as_trained_on(trainer: Trainer, inputs: Any) -> Any:
    """Fixed forward ``inputs`` (``example_inputs``, built where the user built the callback: on the CPU, in full
    precision) as the training batches reach the forward: the precision's input conversion and the strategy's device.
    The module's batch hooks are left out: these are a forward's inputs, not a batch.

    Example:
        >>> from types import SimpleNamespace
        >>> trainer = SimpleNamespace(precision_plugin=SimpleNamespace(convert_input=lambda x: x),
        ...                           strategy=SimpleNamespace(root_device=torch.device("cpu")))
        >>> inputs_as_trained_on(trainer, ((torch.ones(1),), {}))[0][0].device
        device(type='cpu')
    """
    return move_data_to_device(trainer.precision_plugin.convert_input(inputs), trainer.strategy.root_device)


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
        >>> module = LightningModule()
        >>> strategy = SimpleNamespace(batch_to_device=lambda batch, dataloader_idx: batch)
        >>> precision = SimpleNamespace(convert_input=lambda batch: batch)
        >>> loader = torch.utils.data.DataLoader(torch.ones(3, 2), batch_size=1)
        >>> trainer = SimpleNamespace(train_dataloader=loader, strategy=strategy, precision_plugin=precision)
        >>> trainer.lightning_module = module
        >>> first_batch(trainer).shape
        torch.Size([1, 2])
    """
    loader = _training_batches(trainer, "finding units needs a training batch from the training dataloader")
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        for batch in loader:
            return _as_trained_on(trainer, trainer.lightning_module, batch)
    raise ValueError("finding units needs a training batch, and the training dataloader is empty")
