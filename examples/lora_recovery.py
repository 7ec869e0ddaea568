"""Recover a pruned transformer with LoRA and ship it sparse: prune one-shot, fine-tune adapters, ``merge_lora``.

A sentence-embedding BERT (all-MiniLM-L6-v2 from a local directory) is wrapped by PEFT's LoRA on its 36 encoder
Linear layers and pruned by ``PruningCallback`` before the first step, one-shot with Wanda's importance
(``importance="activation"``, input norms from 4 calibration batches): 50% of every output row, or 2:4. The adapters
then learn to reproduce the dense model's embeddings (loss ``1 - cosine``); the callback masks each adapter's update
where the base weight is pruned, so the effective weight ``M ⊙ (W + s·B·A)`` stays sparse. ``merge_lora`` folds the
adapters in: the plain ``BertModel`` it returns is exactly as sparse as the masks and computes what the adapted
model did (PEFT's own ``merge_and_unload()`` would have filled every pruned entry).

Run::

    python examples/lora_recovery.py --model-dir DIR --text lines.txt   # DIR: config.json + model.safetensors
    python examples/lora_recovery.py --quick                           # a tiny BERT from a config, random tokens

``benchmarks/lora_minilm.py`` runs this recipe on the criteria benchmark's protocol against full fine-tuning.
"""

from __future__ import annotations

import argparse
import copy
import random
from pathlib import Path

import lightning.pytorch as pl
import peft
import torch
import transformers
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightprune import PruningCallback
from lightprune.export import merge_lora
from lightprune.schedules import Constant

TARGETS = ["query", "key", "value", "attention.output.dense", "intermediate.dense", "output.dense"]


def embed(model: nn.Module, ids: Tensor, mask: Tensor) -> Tensor:
    """Mean of the last hidden states over the real tokens, L2-normalised."""
    hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    return nn.functional.normalize((hidden * weights).sum(1) / weights.sum(1).clamp_min(1e-9), dim=-1)


class Distillation(pl.LightningModule):
    """The student (PEFT-wrapped) learns the frozen dense teacher's embeddings; AdamW on the adapters only."""

    def __init__(self, student: nn.Module, teacher: nn.Module, lr: float) -> None:
        super().__init__()
        self.student, self.lr = student, lr
        self.teacher = [teacher.eval().requires_grad_(False)]  # a list: not a submodule, not trained or saved

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        ids, mask = batch
        with torch.no_grad():
            target = embed(self.teacher[0], ids, mask)
        return 1.0 - (embed(self.student, ids, mask) * target).sum(-1).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr)


def data(args: argparse.Namespace, vocab: int) -> tuple[nn.Module, DataLoader, tuple[Tensor, Tensor]]:
    """The dense model, the training batches and a held-out batch: MiniLM and text lines, or a tiny random set."""
    if args.quick:
        torch.manual_seed(0)
        config = transformers.BertConfig(
            vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )  # fmt: skip
        model = transformers.BertModel(config, add_pooling_layer=False)
        ids = torch.randint(1, vocab, (8 * args.batch_size + 16, 12))
        mask = torch.ones_like(ids)
    else:
        model = transformers.BertModel.from_pretrained(
            args.model_dir, add_pooling_layer=False, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
        )
        tokenizer = transformers.PreTrainedTokenizerFast(
            tokenizer_file=str(Path(args.model_dir) / "tokenizer.json"), pad_token="[PAD]", unk_token="[UNK]",
            cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
        )  # fmt: skip
        lines = [line.strip() for line in Path(args.text).read_text().splitlines() if len(line.split()) >= 6]
        random.Random(0).shuffle(lines)
        lines = lines[: args.steps * args.batch_size + 256]
        encoded = tokenizer(lines, padding="max_length", truncation=True, max_length=48, return_tensors="pt")
        ids, mask = encoded["input_ids"], encoded["attention_mask"]
    held_out = (ids[-16:], mask[-16:])
    train = DataLoader(TensorDataset(ids[:-16], mask[:-16]), batch_size=args.batch_size, shuffle=True)
    return model, train, held_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=str(Path("~/.cache/lightprune/minilm/model").expanduser()))
    parser.add_argument("--text", help="a text file, one sentence a line (at least 6 words are kept)")
    parser.add_argument("--pattern", choices=["row50", "2:4"], default="row50")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None, help="save the merged model here (save_pretrained)")
    parser.add_argument("--quick", action="store_true", help="a tiny BERT from a config and random tokens")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.batch_size = 8, 8
    elif args.text is None:
        parser.error("--text is required (or --quick)")

    dense, train, held_out = data(args, vocab=64)
    lora = peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=TARGETS, lora_dropout=0.0)
    student = peft.get_peft_model(copy.deepcopy(dense), lora)
    # the base weights of the 36 LoRA layers: PEFT names them <layer>.base_layer.weight
    include = r".*encoder\.layer\.\d+\..*\.base_layer\.weight"
    shape = {"scope": "row"} if args.pattern == "row50" else {"method": "semi_structured"}  # 2:4 along the inputs
    pruning = PruningCallback(
        Constant(0.5, at=0), include=include, importance="activation", calibration_batches=4, summary=False, **shape
    )
    trainer = pl.Trainer(
        max_steps=args.steps, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[pruning],
    )  # fmt: skip
    trainer.fit(Distillation(student, dense, args.lr), train_dataloaders=train)

    trainable = sum(p.numel() for p in student.parameters() if p.requires_grad)
    with torch.no_grad():
        unmerged = embed(student.eval(), *held_out)
        merged = merge_lora(student)  # the plain BertModel, weights M ⊙ (W + s·B·A)
        out = embed(merged.eval(), *held_out)
        cosine = float((out * embed(dense.eval(), *held_out)).sum(-1).mean())
    weights = [m.weight for n, m in merged.named_modules() if isinstance(m, nn.Linear) and n.startswith("encoder.")]
    zeros = sum(int((w == 0).sum()) for w in weights) / sum(w.numel() for w in weights)
    print(f"trainable parameters: {trainable} (LoRA r={args.rank})")
    print(f"merged vs unmerged embeddings: max abs difference {float((out - unmerged).abs().max()):.2e}")
    print(f"cosine to the dense model on {len(held_out[0])} held-out lines: {cosine:.3f}")
    print(f"final sparsity: {zeros:.4f}")
    if args.out is not None:
        merged.save_pretrained(args.out)


if __name__ == "__main__":
    main()
