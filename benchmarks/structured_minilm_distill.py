"""Gradual structured pruning during distillation: at what embedding cosine do neurons and heads buy 1.5x and 2x?

Protocol: the criteria benchmark's fit (``benchmarks/criteria_minilm.py``, arm 2): all-MiniLM-L6-v2 distilled toward
its own dense embeddings (loss 1 - cosine) on the same 300 batches of 32 Shakespeare lines (<= 48 tokens), AdamW
lr 5e-5, one torch thread; quality is the cosine (and nearest-neighbour agreement) of the sentence embeddings against
the dense model's on the 1,000 held-out evaluation lines. Every arm prunes gradually with ``PruningCallback``: the
criteria benchmark's cubic (an event every 20 steps up to step 180, written without its empty step-0 event), then
fine-tuning under the fixed masks to step 300.

* ``unstructured_activation_50``: 50% of every row of every Linear, ``importance="activation"`` (window 5, padding
  left out), the criteria benchmark's gradual activation fit at 50% instead of 70%: no speed-up, the reference;
* ``neurons_N`` / ``neurons_N_heads_H``: ``method="neurons"`` to N% of every layer's MLP neurons and
  ``method="heads"`` to H% of its attention heads, both ``importance="activation"`` with ``reconstruct=True`` (the
  least-squares refit of the consuming projection at each event), window 5, padding left out.

After the fit the pruned units are removed (:func:`lightprune.export.remove_units`: a smaller ``BertModel``) and the
compact model is timed against the dense one on a batch of 32 lines x 48 tokens, paired: each round times both, in
alternating order, and the report gives the median of the per-round ratios with their quartiles, with one thread and
with the default threads.

Usage:
    nice -n 10 python benchmarks/structured_minilm_distill.py        # ~5 minutes of CPU per arm
    python benchmarks/structured_minilm_distill.py --quick               # a smoke run (numbers mean nothing)

Fits are cached per arm under ``--cache`` (``structured_distill/``; rerunning times the cached compact models
again). Writes ``OUT/structured_minilm_distill.json`` and ``.md`` (OUT: ``benchmarks/results/structured_minilm``).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import criteria_minilm as cm
from lightprune import PruningCallback
from lightprune.export import remove_units
from machine import describe

ARMS = {
    "unstructured_activation_50": None,
    "neurons_50": (0.5, 0.0),
    "neurons_50_heads_50": (0.5, 0.5),
    "neurons_25_heads_25": (0.25, 0.25),
    "neurons_75_heads_50": (0.75, 0.5),
    "neurons_25": (0.25, 0.0),
}
"""Arm -> (share of neurons, share of heads) pruned in every layer; ``None``: unstructured activation at 50%."""


def paired_timing(
    dense: nn.Module, small: nn.Module, inputs: dict[str, Tensor], repeats: int, warmup: int = 2
) -> dict[str, Any]:
    """Seconds of both models per round (order alternating) and the median and quartiles of the per-round ratios."""
    rounds: list[tuple[float, float]] = []
    with torch.inference_mode():
        for index in range(warmup + repeats):
            times = {}
            for name in ("dense", "compact") if index % 2 == 0 else ("compact", "dense"):
                model = dense if name == "dense" else small
                start = time.perf_counter()
                model(**inputs)
                times[name] = time.perf_counter() - start
            if index >= warmup:
                rounds.append((times["dense"], times["compact"]))
    ratios = sorted(d / c for d, c in rounds)
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else (ratios[0],) * 3
    return {
        "dense_ms": statistics.median(d for d, _ in rounds) * 1e3,
        "compact_ms": statistics.median(c for _, c in rounds) * 1e3,
        "speedup": statistics.median(ratios),
        "speedup_q1": q1,
        "speedup_q3": q3,
        "repeats": repeats,
    }


def callbacks(arm: str, settings: cm.Settings, module: cm.Distillation) -> list[pl.Callback]:
    """The arm's PruningCallbacks (the criteria benchmark's gradual cubic to each arm's share)."""
    shares = ARMS[arm]
    if shares is None:
        return [cm.pruning_callback("gradual", "activation", module, replace(settings, sparsity=0.5))]
    found = []
    for method, share in zip(("neurons", "heads"), shares, strict=True):
        if share > 0:
            found.append(
                PruningCallback(
                    cm.gradual_schedule(replace(settings, sparsity=share)),
                    method=method,
                    importance="activation",
                    reconstruct=True,
                    activation_window=settings.window,
                    token_mask=cm.mask_of_batch,
                    unit="step",
                    example_inputs=lambda batch: (batch[0], batch[1]),
                    summary=False,
                    log_per_parameter=False,
                    name=method,
                )
            )
    return found


def run_arm(
    arm: str,
    dense_model: nn.Module,
    tokenizer: Any,
    parts: dict[str, list[str]],
    dense: Tensor,
    batches: list,
    settings: cm.Settings,
    example: dict[str, Tensor],
) -> tuple[dict[str, Any], nn.Module]:
    """One fit: quality of the pruned student, and its compact model (the student itself for unstructured)."""
    torch.manual_seed(0)
    module = cm.Distillation(copy.deepcopy(dense_model), settings.lr)
    trainer = pl.Trainer(
        max_steps=settings.steps, max_epochs=1, accelerator="cpu", devices=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, callbacks=callbacks(arm, settings, module),
    )  # fmt: skip
    wall = time.perf_counter()
    trainer.fit(module, train_dataloaders=cm.Batches(batches))
    wall = time.perf_counter() - wall
    assert trainer.global_step == settings.steps, trainer.global_step
    student = module.student.eval()
    quality = cm.compare(cm.embed(student, tokenizer, parts["evaluation"], settings), dense)
    if ARMS[arm] is None:
        compact, compact_cosine = student, quality["cosine"]
    else:
        # after 6 trained layers, summing fewer terms moves float32 outputs by ~1e-5 of their max
        compact = remove_units(student, (), example, rtol=1e-4)
        compact_cosine = cm.compare(cm.embed(compact, tokenizer, parts["evaluation"], settings), dense)["cosine"]
    layer = compact.encoder.layer[0]
    row = {
        **quality,
        "compact_cosine": compact_cosine,
        "parameters": sum(p.numel() for p in compact.parameters()),
        "nonzero_parameters": sum(int((p != 0).sum()) for p in student.parameters()),
        "layer0_neurons": layer.intermediate.dense.out_features,
        "layer0_heads": layer.attention.self.num_attention_heads,
        "fit_wall_seconds": wall,
    }
    return row, compact


def markdown(payload: dict[str, Any]) -> str:
    threads = payload["default_threads"]
    lines = [
        f"| {payload['settings']['steps']}-step distillation, gradual | cosine / NN agreement | params (compact) | "
        f"neurons / heads per layer | speed-up 1 thread (IQR) | speed-up {threads} threads (IQR) |",
        "|---|---|---|---|---|---|",
    ]
    for arm, row in payload["arms"].items():
        cells = []
        for label in ("one_thread", "default_threads"):
            t = row["timing"][label]
            cells.append(f"{t['speedup']:.2f}x ({t['speedup_q1']:.2f}-{t['speedup_q3']:.2f})")
        lines.append(
            f"| {arm} | {row['cosine']:.3f} / {row['agreement']:.3f} | {row['parameters'] / 1e6:.2f}M | "
            f"{row['layer0_neurons']} / {row['layer0_heads']} | {cells[0]} | {cells[1]} |"
        )
    lines += ["", f"dense: {payload['dense_parameters'] / 1e6:.2f}M parameters, 1536 neurons / 12 heads per layer."]
    lines += [f"Command: `{payload['command']}`", f"Machine: {payload['machine']}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=Path("~/.cache/lightprune/minilm"))
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "structured_minilm")
    parser.add_argument("--repeats", type=int, default=20, help="paired timing rounds per arm and thread setting")
    parser.add_argument("--arms", nargs="*", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--fit-only", action="store_true", help="fit and cache the arms, time nothing")
    parser.add_argument("--quick", action="store_true", help="few lines, few steps: a smoke run")
    args = parser.parse_args(argv)
    settings = cm.QUICK if args.quick else cm.Settings()
    default_threads = torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    out = args.out / "quick" if args.quick else args.out
    out.mkdir(parents=True, exist_ok=True)
    cache = args.cache.expanduser()
    runs = cache / ("structured_distill_quick" if args.quick else "structured_distill")
    runs.mkdir(parents=True, exist_ok=True)
    model_dir, archive = cm.ensure_files(cache)
    parts = cm.split_lines(cm.read_lines(archive), settings)
    tokenizer = cm.load_tokenizer(model_dir)
    dense_model = cm.load_model(model_dir)
    tag = "quick" if args.quick else "full"
    dense = cm.dense_embeddings(dense_model, tokenizer, parts["evaluation"], settings, cache / f"dense_eval_{tag}.pt")
    batches = cm.training_batches(dense_model, tokenizer, parts["train"], settings, cache / f"train_batches_{tag}.pt")
    ids, mask = cm.tokenize(tokenizer, parts["evaluation"][:2], settings.max_tokens)
    example = {"input_ids": ids, "attention_mask": mask}
    timing_lines = parts["evaluation"][:32]
    ids, mask = cm.tokenize(tokenizer, [" ".join([line] * 8) for line in timing_lines], settings.max_tokens)
    timing_batch = {"input_ids": ids, "attention_mask": mask}
    payload: dict[str, Any] = {
        "command": " ".join(["python benchmarks/structured_minilm_distill.py", *(argv if argv else sys.argv[1:])]),
        "machine": describe("transformers"),
        "settings": asdict(settings),
        "default_threads": default_threads,
        "dense_parameters": sum(p.numel() for p in dense_model.parameters()),
        "timing_batch": list(ids.shape),
        "arms": {},
    }
    compacts = {}
    for arm in args.arms:
        cached = runs / f"{arm}.pt"
        if cached.exists() and torch.load(cached, weights_only=False)["settings"] == asdict(settings):
            saved = torch.load(cached, weights_only=False)
        else:
            row, compact = run_arm(arm, dense_model, tokenizer, parts, dense, batches, settings, example)
            saved = {"settings": asdict(settings), "row": row, "model": compact}
            torch.save(saved, cached)
        print(arm, json.dumps(saved["row"]), flush=True)
        payload["arms"][arm] = saved["row"]
        compacts[arm] = saved["model"].eval()
    if args.fit_only:
        return 0
    dense_model.eval()
    for label, threads in (("one_thread", 1), ("default_threads", default_threads)):
        torch.set_num_threads(threads)
        for arm, compact in compacts.items():
            timing = paired_timing(dense_model, compact, timing_batch, 3 if args.quick else args.repeats)
            payload["arms"][arm].setdefault("timing", {})[label] = {"threads": threads, **timing}
            print(arm, label, json.dumps(timing), flush=True)
    report = markdown(payload)
    (out / "structured_minilm_distill.md").write_text(report)
    (out / "structured_minilm_distill.json").write_text(json.dumps(payload, indent=1))
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
