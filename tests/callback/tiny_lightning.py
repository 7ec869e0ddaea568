"""The tiny LightningModule, its data, constants and the state-dict helpers that the callback test files share.

``TinyNet`` is Linear 8-16-12-4 with ReLUs, seeded so that every instance with the same seed starts from the same
weights, trained with SGD with momentum (so resuming needs the optimizer state to line up with the parameters).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import lightning as L
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

WEIGHTS = {"net.0.weight": (16, 8), "net.2.weight": (12, 16), "net.4.weight": (4, 12)}
"""TinyNet's weights that the callback selects by default, with their shapes."""
N = sum(rows * cols for rows, cols in WEIGHTS.values())  # 368
"""How many entries :data:`WEIGHTS` hold."""
STEPS_PER_EPOCH = 8
"""Optimizer steps in an epoch of :func:`loader`'s default data."""


def loader(samples: int = 64, seed: int = 1) -> DataLoader:
    """``samples`` random 8-feature inputs with labels in 0..3, batches of 8, fixed order."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 8, generator=generator)
    y = torch.randint(0, 4, (samples,), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=False)


class ResumableBatches:
    """The batches of a loader as a resumable iterable: Lightning writes its position into checkpoints
    (``state_dict``) and restores it (``load_state_dict``), so a fit resumed mid-epoch sees the batches that the
    uninterrupted fit saw next (a plain DataLoader would start the epoch again from its first batch).

    The position is the count of batches Lightning has taken from the current pass; a pass that was taken whole
    restores to the start of the next one.
    """

    def __init__(self, batches: Iterable[Any]) -> None:
        self.batches = list(batches)
        self._start = 0
        self._taken = 0

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Any]:
        self._taken, self._start = self._start, 0
        for batch in self.batches[self._taken :]:
            self._taken += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"taken": self._taken}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._start = state["taken"] % len(self.batches)


class TinyNet(L.LightningModule):
    """Linear 8-16-12-4 with ReLUs, SGD with momentum, trained on :func:`loader` (8 steps an epoch)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 4))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return loader()


QUIET: dict[str, Any] = {
    "accelerator": "cpu",
    "devices": 1,
    "logger": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "enable_checkpointing": False,
}
"""Trainer options of a one-device CPU run that prints nothing and writes no checkpoint unless a test asks."""


def quiet_trainer(callbacks: Iterable[L.Callback] = (), **options: Any) -> L.Trainer:
    """An ``L.Trainer`` with :data:`QUIET` options, ``options`` overriding them."""
    return L.Trainer(callbacks=list(callbacks), **{**QUIET, **options})


def folded(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """A plain state_dict with ``orig`` masked (``where(mask, orig, 0)``) for every pruned tensor of ``state_dict``."""
    plain = {}
    for key, value in state_dict.items():
        if key.endswith("_orig"):
            plain[key[: -len("_orig")]] = torch.where(state_dict[key[: -len("_orig")] + "_mask"].bool(), value, 0)
        elif not key.endswith("_mask"):
            plain[key] = value
    return plain


def state(model: nn.Module) -> dict[str, Tensor]:
    """A detached copy of ``model``'s state_dict."""
    return {key: value.detach().clone() for key, value in model.state_dict().items()}


def pruning_state(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The one PruningCallback's state in a checkpoint."""
    (found,) = [value for key, value in checkpoint["callbacks"].items() if key.startswith("PruningCallback")]
    return found


class DestroyGroupAtExit(L.Callback):
    """Destroys the gloo process group when a spawned worker exits, before the interpreter's finalization.

    Lightning registers that for NCCL only; a gloo group left to finalization sometimes aborts the worker after fit
    has finished ("terminate called without an active exception"), which fails a test that passed. Test scaffolding,
    not something the pruning callback should do.
    """

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        import atexit

        atexit.register(_destroy_group)


def _destroy_group() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
