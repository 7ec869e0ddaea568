"""Lottery-ticket rounds (Frankle & Carbin, 2019) with ``PruningCallback``: train, prune, rewind to init, retrain.

A small MLP learns scikit-learn's bundled handwritten digits. Its initial weights are saved with
``PruningCallback.snapshot_weights`` before any training. Then each round is one ``trainer.fit``: a callback prunes
20% of the weights that remain (ranked by magnitude over all Linear layers) when the fit starts, rewinds the
surviving weights to their saved initial values (``rewind=``) and the fit retrains the sparser network from there.
Masks carry over from round to round (each later round's callback adopts them: ``adopt_zeros=True``), so sparsity
grows 20%, 36%, 49%, 59%, ... The last round makes the pruning permanent (plain weights with zeros).

Run::

    python examples/iterative_rounds.py            # 5 rounds, about 30 seconds on a CPU
    python examples/iterative_rounds.py --quick    # 2 short rounds, for tests
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import lightning.pytorch as pl
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightprune import PruningCallback
from lightprune.schedules import Constant


class DigitsMLP(pl.LightningModule):
    """A 64-128-64-10 MLP trained with cross-entropy and Adam; logs validation accuracy as ``val/acc``."""

    def __init__(self, lr: float = 1e-3) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val/acc", (self(x).argmax(dim=1) == y).float().mean())

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


def fit(model: pl.LightningModule, epochs: int, callbacks: list[pl.Callback]) -> float:
    """One fit of ``epochs``; returns the final validation accuracy."""
    trainer = pl.Trainer(
        max_epochs=epochs,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    train_loader, val_loader = loaders()
    trainer.fit(model, train_loader, val_loader)
    return float(trainer.callback_metrics["val/acc"])


def effective_weight(model: nn.Module, qualified: str) -> torch.Tensor:
    """``module.weight`` for ``"net.0.weight"``: ``weight_orig * weight_mask`` while the pruning is not permanent."""
    module_name, _, name = qualified.rpartition(".")
    return getattr(model.get_submodule(module_name), name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds of 1 epoch (a few seconds), for tests")
    parser.add_argument("--rounds", type=int, default=5, help="pruning rounds")
    parser.add_argument("--rate", type=float, default=0.2, help="fraction of the remaining weights pruned per round")
    parser.add_argument("--save", type=Path, help="write the pruned model's state_dict (plain tensors) to this file")
    args = parser.parse_args()
    pl.seed_everything(0, verbose=False)
    torch.set_num_threads(1)  # tiny model: one thread is fastest
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # no banner for each of the fits
    rounds, epochs = (2, 1) if args.quick else (args.rounds, 8)

    model = DigitsMLP()
    initial = PruningCallback.snapshot_weights(model)  # CPU copy of every parameter, by name
    print(f"round 0: sparsity 0.0000, val accuracy {fit(model, epochs, []):.4f} (dense)")

    for round_index in range(1, rounds + 1):
        target = 1.0 - (1.0 - args.rate) ** round_index  # total sparsity after this round
        pruning = PruningCallback(
            Constant(target, at=0),  # one event, when this fit starts: prune to the target total sparsity
            scope="global",
            rewind=initial,  # after pruning, the surviving weights restart from their initial values
            make_permanent=round_index == rounds,  # keep the masks between rounds; plain zeros after the last
            adopt_zeros=round_index > 1,  # start from the earlier rounds' masks (a model with masks is refused else)
        )
        accuracy = fit(model, epochs, [pruning])
        weights = [effective_weight(model, name) for name in pruning.selection]
        zeros = sum(int((w == 0).sum()) for w in weights)
        total = sum(w.numel() for w in weights)
        print(f"round {round_index}: sparsity {zeros / total:.4f} (target {target:.4f}), val accuracy {accuracy:.4f}")
    print(f"final sparsity: {zeros / total:.4f}")
    if args.save is not None:
        torch.save(model.state_dict(), args.save)  # the last round made the pruning permanent: plain tensors


if __name__ == "__main__":
    main()
