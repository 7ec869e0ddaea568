"""Scheduled pruning in a plain Lightning script: ``PruningCallback`` with a cubic schedule, no Hydra.

A small MLP (a ``LightningModule``) learns scikit-learn's bundled handwritten digits. ``PruningCallback`` prunes the
weights of its Linear layers during ``trainer.fit`` on the cubic schedule of Zhu & Gupta (2017), from 0% to the
target total sparsity between 20% and 70% of training, ranking all weights globally by magnitude. The sparsity of each
layer and in total reaches every logger at each pruning event; here a ``CSVLogger`` writes them to
``<out>/example/version_0/metrics.csv``. At the end of fit the callback makes the pruning permanent: the model holds
plain Parameters with exact zeros.

Run::

    python examples/lightning_callback.py                    # about 20 seconds on a CPU
    python examples/lightning_callback.py --quick --out /tmp  # a few seconds, for tests
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightprune import PruningCallback
from lightprune.schedules import Cubic


class DigitsMLP(pl.LightningModule):
    """A 64-128-64-10 MLP trained with cross-entropy and Adam."""

    def __init__(self, lr: float = 1e-3) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val/acc", (self(x).argmax(dim=1) == y).float().mean(), prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def loaders(batch_size: int = 64) -> tuple[DataLoader, DataLoader]:
    """Training and validation loaders over the digits (1437 / 360 examples, pixels in [0, 1])."""
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    train, val = order[:1437], order[1437:]
    return (
        DataLoader(TensorDataset(x[train], y[train]), batch_size=batch_size, shuffle=True),
        DataLoader(TensorDataset(x[val], y[val]), batch_size=256),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny run (a few seconds), for tests")
    parser.add_argument("--target", type=float, default=0.8, help="final total sparsity of the Linear weights")
    parser.add_argument("--out", type=Path, default=Path("lightning_callback_logs"), help="directory of the logs")
    parser.add_argument("--save", type=Path, help="write the pruned model's state_dict (plain tensors) to this file")
    args = parser.parse_args()
    pl.seed_everything(0, verbose=False)
    torch.set_num_threads(1)  # tiny model: one thread is fastest
    epochs = 2 if args.quick else 15

    model = DigitsMLP()
    # times given as fractions of the run: the callback resolves them to optimizer steps when fit starts
    pruning = PruningCallback(
        Cubic(final=args.target, start=0.2, end=0.7, frequency=0.05),
        method="l1_unstructured",
        scope="global",
    )
    logger = CSVLogger(args.out, name="example", version=0)
    trainer = pl.Trainer(
        max_epochs=epochs,
        callbacks=[pruning],
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=5,
    )
    train_loader, val_loader = loaders()
    trainer.fit(model, train_loader, val_loader)

    # the callback made the pruning permanent: plain weights with exact zeros
    total = zeros = 0
    for name in pruning.selection:
        weight = model.get_parameter(name)
        print(f"{name}: sparsity {float((weight == 0).float().mean()):.4f}")
        total += weight.numel()
        zeros += int((weight == 0).sum())
    print(f"final sparsity: {zeros / total:.4f} (target {args.target:.4f}: {zeros} of {total} weights are zero)")
    print(f"final validation accuracy: {float(trainer.callback_metrics['val/acc']):.4f}")
    if args.save is not None:
        torch.save(model.state_dict(), args.save)  # loads into a fresh DigitsMLP

    with Path(logger.log_dir, "metrics.csv").open(newline="") as handle:
        logged = [row for row in csv.DictReader(handle) if row.get("pruning/sparsity/total")]
    print(f"{len(logged)} pruning events logged to {logger.log_dir}/metrics.csv")


if __name__ == "__main__":
    main()
