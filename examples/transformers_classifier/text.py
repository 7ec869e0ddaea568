"""A LightningModule the user already has - a tiny ``transformers`` sequence classifier built from a config, no
download - and a datamodule that makes its own data: the experiment app prunes and fine-tunes it as it is.

``conf/model/tiny_bert.yaml`` names :class:`TextClassifier` by import path with the ``BertConfig`` arguments;
``conf/data/counting.yaml`` names :class:`CountingData`. The app uses the module's own ``training_step``,
``configure_optimizers`` and metric, and adds the pruning callback, the dense phase, logging and the summary (its
FLOPs counted on ``example_input_array``). See docs/app.md ("Your own model, data, optimizer and schedule").
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset
from transformers import BertConfig, BertForSequenceClassification


class TextClassifier(pl.LightningModule):
    """``BertForSequenceClassification`` from a ``BertConfig`` (random weights), trained with AdamW.

    Args:
        bert: ``BertConfig`` arguments (``vocab_size``, ``hidden_size``, ``num_hidden_layers``, ...).
        lr: AdamW's learning rate.
        sequence_length: length of the example input FLOPs are counted on.
    """

    def __init__(self, bert: dict[str, Any], lr: float = 1e-3, sequence_length: int = 16) -> None:
        super().__init__()
        self.bert = BertForSequenceClassification(BertConfig(**bert))
        self.lr = lr
        self.example_input_array = torch.zeros(1, sequence_length, dtype=torch.long)

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.bert(input_ids=input_ids).logits

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        ids, labels = batch
        loss = nn.functional.cross_entropy(self(ids), labels)
        self.log("train/loss", loss)
        return loss

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        ids, labels = batch
        self.log("test/acc", (self(ids).argmax(-1) == labels).float().mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class CountingData(pl.LightningDataModule):
    """Random token sequences; the label says whether token 1 occurs more often than token 2 (a task attention
    must count over the whole sequence for)."""

    def __init__(self, size: int = 2048, sequence_length: int = 16, vocab_size: int = 32, batch_size: int = 64):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab_size, (size, sequence_length), generator=generator)
        self.labels = ((self.ids == 1).sum(1) > (self.ids == 2).sum(1)).long()
        self.batch_size = batch_size
        self.split = size * 3 // 4

    def train_dataloader(self) -> DataLoader:
        dataset = TensorDataset(self.ids[: self.split], self.labels[: self.split])
        return DataLoader(dataset, batch_size=self.batch_size, shuffle=True)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.ids[self.split :], self.labels[self.split :]), batch_size=256)
