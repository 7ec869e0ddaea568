"""LoRA recovery of a pruned transformer that stays sparse: all-MiniLM-L6-v2, one-shot Wanda to 50% and 2:4.

Protocol (the criteria benchmark's, ``benchmarks/criteria_minilm.py``: same model, text, splits, distillation loss,
batches and metrics):

* all-MiniLM-L6-v2's 36 encoder Linear weights pruned one-shot before the first step by ``PruningCallback`` with
  ``importance="activation"`` (Wanda, input norms from ``calibration_batches=4`` training batches): 50% per output
  row (``scope="row"``) or 2:4 along the inputs (``method="semi_structured"``).
* then 300 optimizer steps of embedding distillation from the dense model (loss ``1 - cosine``, batch 32, the same
  batches in every run), either
  - ``full``: every parameter trained (AdamW, lr 5e-5), the pruned weights kept sparse by the callback; or
  - ``lora``: PEFT LoRA (r=8, alpha=16, no dropout) on the 36 pruned Linears, everything else frozen (AdamW,
    lr 5e-4); the callback masks each adapter's update where the base weight is pruned, and
    ``lightprune.export.merge_lora`` folds it in afterwards.
* metrics of the merged model on the 1,000 evaluation lines: mean cosine to the dense embeddings and nearest-
  neighbour agreement; the sparsity of the 36 weights; trainable parameters; the median wall and CPU time of an
  optimizer step; for LoRA, the largest difference between the merged and the unmerged model's embeddings.

``--cost`` measures what masking the update costs per step, side by side in one process: one forward and backward
of a batch (32 lines) through the pruned model trained fully, with plain LoRA (update not masked: the sparsity is
lost at merge) and with masked LoRA (one product with ``W + M ⊙ s·B·A``, the default without dropout; and two
products, base and masked update, as with dropout), interleaved, repeated; and the bytes of the tensors autograd saves
for the backward (activation memory) in each.

Usage:
    python benchmarks/lora_minilm.py                      # the four fits, 1 torch thread (about 20 min of CPU each)
    python benchmarks/lora_minilm.py --runs row50_lora row50_full
    python benchmarks/lora_minilm.py --cost               # the per-step cost of masking the update
    python benchmarks/lora_minilm.py --quick              # a smoke run (numbers mean nothing)

Writes ``OUT/lora_minilm.json`` and ``OUT/lora_minilm.md`` (OUT: ``benchmarks/results/lora_minilm``); every fit is
cached under ``OUT/runs`` so processes with disjoint ``--runs`` can share the machine.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # criteria_minilm.py and machine.py
import criteria_minilm as base
from lightprune import PruningCallback
from lightprune.export import merge_lora
from lightprune.schedules import Constant
from machine import describe

PATTERNS = ("row50", "2:4")
ARMS = ("full", "lora")
RUNS = [f"{pattern}_{arm}" for pattern in PATTERNS for arm in ARMS]
TARGETS = (
    r".*encoder\.layer\.\d+\.(attention\.self\.(query|key|value)|attention\.output\.dense|intermediate\.dense"
    r"|output\.dense)"
)
"""The 36 pruned Linear layers, as PEFT's ``target_modules`` regular expression."""


@dataclass(frozen=True)
class Settings:
    """Everything that decides a fit's result (a cached fit is reused only if its settings are equal)."""

    criteria: base.Settings = field(default_factory=lambda: replace(base.Settings(), sparsity=0.5))
    lr_full: float = 5e-5
    lr_lora: float = 5e-4
    rank: int = 8
    alpha: int = 16


QUICK = Settings(criteria=replace(base.QUICK, sparsity=0.5))


class Student(pl.LightningModule):
    """The criteria benchmark's distillation (loss ``1 - cosine`` to the dense embedding), training only the
    parameters that require gradients."""

    def __init__(self, student: nn.Module, lr: float) -> None:
        super().__init__()
        self.student = student.train()
        self.lr = lr

    def training_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> Tensor:
        ids, mask, target = batch
        return 1.0 - (base.embed_batch(self.student, ids, mask) * target).sum(-1).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr)


def with_lora(model: nn.Module, settings: Settings) -> nn.Module:
    """``model`` wrapped by PEFT: LoRA on the 36 Linear layers, everything else frozen."""
    import peft

    config = peft.LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=0.0, target_modules=TARGETS)
    return peft.get_peft_model(model, config)


def pruning_callback(pattern: str, student: nn.Module, settings: Settings) -> PruningCallback:
    """One-shot Wanda at step 0 on the 36 weights (the base weights under LoRA), per row to 50% or 2:4."""
    inner = student.get_base_model() if hasattr(student, "get_base_model") else student
    layers = [
        module
        for name, module in inner.named_modules()
        if name.startswith("encoder.layer.") and name.endswith(base.LINEAR_SUFFIXES)
    ]
    assert len(layers) == 6 * len(base.LINEAR_SUFFIXES), len(layers)
    parameters = [(getattr(layer, "base_layer", layer), "weight") for layer in layers]
    options: dict[str, Any] = {"scope": "row"} if pattern == "row50" else {"method": "semi_structured"}
    return PruningCallback(
        Constant(0.5, at=0), parameters=parameters, importance="activation",
        calibration_batches=settings.criteria.calibration_batches, summary=False, log_per_parameter=False, **options,
    )  # fmt: skip


def trainable(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def run_fit(name: str, dense_model: nn.Module, tokenizer: Any, parts: Any, dense: Tensor, batches: Any,
            settings: Settings) -> dict[str, Any]:  # fmt: skip
    """One fit: prune one-shot, train fully or with masked LoRA, merge, evaluate."""
    pattern, arm = name.rsplit("_", 1)
    crit = settings.criteria
    torch.manual_seed(0)
    student = copy.deepcopy(dense_model)
    if arm == "lora":
        student = with_lora(student, settings)
    module = Student(student, settings.lr_lora if arm == "lora" else settings.lr_full)
    callback = pruning_callback(pattern, student, settings)
    clock = base.StepClock()
    trainer = pl.Trainer(
        max_steps=crit.steps, max_epochs=1, accelerator="cpu", devices=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, callbacks=[clock, callback],
    )  # fmt: skip
    wall, cpu = time.perf_counter(), time.process_time()
    trainer.fit(module, train_dataloaders=base.Batches(batches))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    unmerged = base.embed(student, tokenizer, parts["evaluation"], crit)
    merged = merge_lora(student) if arm == "lora" else student
    embeddings = base.embed(merged, tokenizer, parts["evaluation"], crit)
    return {
        "run": name,
        **base.compare(embeddings, dense),
        **base.weight_sparsity(merged),
        "merged_vs_unmerged_max_abs": float((embeddings - unmerged).abs().max()),
        "trainable_parameters": trainable(student),
        "fit_wall_seconds": wall,
        "fit_cpu_seconds": cpu,
        "step_wall_median": statistics.median(clock.wall[1:]),
        "step_cpu_median": statistics.median(clock.cpu[1:]),
    }


# ------------------------------------------------------------------------------------------------------------------
# The per-step cost of masking the update
# ------------------------------------------------------------------------------------------------------------------


def saved_bytes(step: Any) -> int:
    """Bytes of the tensors autograd saves for the backward while ``step()`` runs its forward (each storage once)."""
    seen: dict[int, int] = {}

    def pack(tensor: Tensor) -> Tensor:
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        step()
    return sum(seen.values())


def measure_cost(dense_model: nn.Module, batch: tuple[Tensor, Tensor, Tensor], settings: Settings,
                 repeats: int) -> dict[str, Any]:  # fmt: skip
    """Forward + backward of one batch: full fine-tuning, plain LoRA and masked LoRA on the same 50%-pruned
    weights, interleaved ``repeats`` times; median wall seconds and saved-tensor bytes of each."""
    from lightprune import prune
    from lightprune.adapters import mask_delta

    ids, mask, target = batch
    models: dict[str, nn.Module] = {}
    full = copy.deepcopy(dense_model).train()
    for _, layer in base.pruned_linears(full):
        prune.rowwise_l1_unstructured(layer, "weight", amount=0.5)
        prune.remove(layer, "weight")
    models["full"] = full
    for arm in ("lora_plain", "lora_masked", "lora_masked_two"):
        model = with_lora(copy.deepcopy(full), settings).train()
        for layer in model.modules():
            if type(layer).__name__ == "Linear" and hasattr(layer, "lora_A"):
                with torch.no_grad():
                    layer.lora_B["default"].weight.normal_(std=1e-3)
                if arm != "lora_plain":
                    mask_delta(layer, layer.base_layer.weight != 0)
                    layer.lora_variant["default"].fold = arm == "lora_masked"  # two products: as LoRA does
        models[arm] = model

    def step(model: nn.Module) -> None:
        loss = 1.0 - (base.embed_batch(model, ids, mask) * target).sum(-1).mean()
        loss.backward()
        model.zero_grad(set_to_none=True)

    times: dict[str, list[float]] = {arm: [] for arm in models}
    for model in models.values():
        step(model)  # warm-up
    for _ in range(repeats):
        for arm, model in models.items():
            start = time.perf_counter()
            step(model)
            times[arm].append(time.perf_counter() - start)
    result: dict[str, Any] = {"repeats": repeats, "batch": list(ids.shape)}
    for arm, model in models.items():
        forward_saved = saved_bytes(lambda model=model: base.embed_batch(model, ids, mask))
        result[arm] = {
            "step_wall_median": statistics.median(times[arm]),
            "saved_bytes": forward_saved,
            "trainable_parameters": trainable(model),
        }
    for arm in ("lora_plain", "lora_masked", "lora_masked_two"):
        result[arm]["time_vs_full"] = result[arm]["step_wall_median"] / result["full"]["step_wall_median"]
    result["masked_vs_plain_time"] = (
        result["lora_masked"]["step_wall_median"] / result["lora_plain"]["step_wall_median"]
    )
    result["masked_vs_plain_saved"] = result["lora_masked"]["saved_bytes"] / result["lora_plain"]["saved_bytes"]
    return result


# ------------------------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------------------------


def markdown(payload: dict[str, Any]) -> str:
    lines = [f"Command: `{payload['command']}`", "", f"Machine: {payload['machine']}", ""]
    fits = payload.get("fit", {})
    if fits:
        lines += [
            'all-MiniLM-L6-v2, one-shot Wanda (`importance="activation"`) at step 0, then 300 steps of distillation; '
            "the LoRA runs merged with `merge_lora`. Cosine / agreement to the dense embeddings (1000 lines):",
            "",
            "| pattern | recovery | cosine | agreement | sparsity | trainable parameters | step (ms, wall / CPU) "
            "| merged vs unmerged (max abs) |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        for name in RUNS:
            if name not in fits:
                continue
            fit = fits[name]
            pattern, arm = name.rsplit("_", 1)
            recovery = "full fine-tuning" if arm == "full" else "masked LoRA, merged"
            lines.append(
                f"| {pattern} | {recovery} | {fit['cosine']:.3f} | {fit['agreement']:.3f} | {fit['sparsity']:.4f} | "
                f"{fit['trainable_parameters']:,} | {1000 * fit['step_wall_median']:.0f} / "
                f"{1000 * fit['step_cpu_median']:.0f} | {fit['merged_vs_unmerged_max_abs']:.1e} |"
            )
        lines.append("")
    cost = payload.get("cost")
    if cost:
        lines += [
            f"Per-step cost, one forward + backward of a batch {cost['batch']} (interleaved, median of "
            f"{cost['repeats']}), 50%-pruned weights; saved for the backward = bytes autograd keeps from the forward:",
            "",
            "| training | trainable parameters | step (ms) | vs full | saved for the backward (MB) |",
            "|---|---:|---:|---:|---:|",
        ]
        labels = {
            "full": "full fine-tuning",
            "lora_plain": "LoRA, update not masked",
            "lora_masked": "LoRA, update masked (one product, the default)",
            "lora_masked_two": "LoRA, update masked, two products (`fold=False`; with dropout)",
        }
        for arm, label in labels.items():
            row = cost[arm]
            ratio = "1" if arm == "full" else f"{row['time_vs_full']:.2f}"
            lines.append(
                f"| {label} | {row['trainable_parameters']:,} | {1000 * row['step_wall_median']:.0f} | {ratio} | "
                f"{row['saved_bytes'] / 1e6:.1f} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=Path("~/.cache/lightprune/minilm"))
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "lora_minilm")
    parser.add_argument("--runs", nargs="*", default=RUNS, choices=RUNS, help="fits to run")
    parser.add_argument("--cost", action="store_true", help="measure the per-step cost of masking the update")
    parser.add_argument("--repeats", type=int, default=10, help="--cost: interleaved repetitions")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--quick", action="store_true", help="few lines, few steps: a smoke run")
    parser.add_argument("--fresh", action="store_true", help="ignore cached fits")
    args = parser.parse_args(argv)

    settings = QUICK if args.quick else Settings()
    settings = replace(settings, criteria=replace(settings.criteria, threads=args.threads))
    torch.set_num_threads(args.threads)
    import logging
    import warnings

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    command = "python benchmarks/lora_minilm.py " + " ".join(argv if argv is not None else sys.argv[1:])

    out = args.out / "quick" if args.quick else args.out
    tag = "quick" if args.quick else "lora"
    (out / "runs").mkdir(parents=True, exist_ok=True)
    cache = args.cache.expanduser()
    crit = settings.criteria
    model_dir, archive = base.ensure_files(cache)
    parts = base.split_lines(base.read_lines(archive), crit)
    tokenizer = base.load_tokenizer(model_dir)
    dense_model = base.load_model(model_dir)
    dense = base.dense_embeddings(dense_model, tokenizer, parts["evaluation"], crit, cache / f"dense_eval_{tag}.pt")
    batches = base.training_batches(dense_model, tokenizer, parts["train"], crit, cache / f"train_batches_{tag}.pt")
    payload: dict[str, Any] = {
        "command": command.strip(),
        "machine": describe("lightning", "transformers", "peft"),
        "settings": asdict(settings),
    }
    key = json.loads(json.dumps(asdict(settings) | {"criteria": asdict(crit) | {"threads": 0}}))
    fits: dict[str, Any] = {}
    for name in RUNS:
        path = out / "runs" / f"{name}.json"
        if path.exists() and not args.fresh:
            cached = json.loads(path.read_text())
            if cached["key"] == key:
                fits[name] = cached["result"]
                continue
        if name not in args.runs or args.cost:
            continue
        result = run_fit(name, dense_model, tokenizer, parts, dense, batches, settings)
        path.write_text(json.dumps({"key": key, "result": result}))
        fits[name] = result
        print(f"fit {name}: {result}", flush=True)
    payload["fit"] = fits
    cost_path = out / "runs" / "cost.json"
    if args.cost:
        payload["cost"] = measure_cost(dense_model, batches[0], settings, args.repeats)
        cost_path.write_text(json.dumps(payload["cost"]))
    elif cost_path.exists():
        payload["cost"] = json.loads(cost_path.read_text())
    report = markdown(payload)
    (out / "lora_minilm.md").write_text(report)
    (out / "lora_minilm.json").write_text(json.dumps(payload, indent=1))
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
