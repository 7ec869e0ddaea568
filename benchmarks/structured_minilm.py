"""Structured pruning that pays on a real transformer: all-MiniLM-L6-v2, MLP neurons and attention heads removed.

Protocol: the criteria benchmark's (``benchmarks/criteria_minilm.py``: the same model, lines, embedding and metrics,
cosine and nearest-neighbour agreement against the dense model on the 1,000 evaluation lines). One-shot, no training:

* units found with :func:`lightprune.structure.find_units` (6 layers x 1,536 MLP neurons and 12 heads);
* calibration: the 128 calibration lines, one line per forward (no padding tokens), inputs of every consuming
  projection recorded (:func:`~lightprune.structure.collect_moments`, with ``X^T X`` for the refit);
* 50% of every layer's neurons (``scope="layerwise"``) by ``magnitude``, ``activation``, ``activation`` + refit of
  ``output.dense`` (:func:`~lightprune.structure.refit_consumers`), then the same plus 50% of every layer's heads
  (activation + refit of ``attention.output.dense``);
* the masked model compacted with :func:`lightprune.export.remove_units` (a ``BertModel`` of the same class), checked
  equal to the masked one on the evaluation embeddings, and timed against the dense model, interleaved
  (:func:`lightprune.export.compare_latency`), on a batch of 32 lines x 48 tokens with one torch thread and with the
  default threads.

Usage:
    python benchmarks/structured_minilm.py            # about 3 minutes of CPU
    python benchmarks/structured_minilm.py --quick    # a smoke run (numbers mean nothing)

Writes ``OUT/structured_minilm.json`` and ``.md`` (OUT: ``benchmarks/results/structured_minilm``).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import criteria_minilm as cm
from lightprune.export import compare_latency, remove_units
from lightprune.structure import collect_moments, find_units, prune_units, refit_consumers
from machine import describe

ARMS = {
    "neurons_magnitude": (("neurons",), "magnitude", False),
    "neurons_activation": (("neurons",), "activation", False),
    "neurons_activation_refit": (("neurons",), "activation", True),
    "neurons_heads_activation_refit": (("neurons", "heads"), "activation", True),
}
"""Arm -> (unit kinds pruned at 50% per layer, importance, refit)."""

REFERENCES = {"neurons_magnitude": 0.714, "neurons_activation": 0.777, "neurons_activation_refit": 0.893}
"""Cosine of the issue's reference implementation on this protocol."""


def calibration_batches(tokenizer: Any, lines: list[str], max_tokens: int) -> list[dict[str, torch.Tensor]]:
    """One line per batch: the recorded inputs hold real tokens only."""
    batches = []
    for line in lines:
        ids, mask = cm.tokenize(tokenizer, [line], max_tokens)
        batches.append({"input_ids": ids, "attention_mask": mask})
    return batches


def run_arm(
    dense_model: nn.Module,
    groups: list,
    moments: dict,
    arm: str,
) -> nn.Module:
    """The masked model of one arm."""
    kinds, importance, refit = ARMS[arm]
    model = copy.deepcopy(dense_model)
    chosen = [group for group in groups if group.kind in kinds]
    keeps = prune_units(model, chosen, 0.5, importance=importance, moments=moments)
    if refit:
        refit_consumers(model, chosen, keeps, moments)
    return model


def timing(
    dense: nn.Module, small: nn.Module, ids: torch.Tensor, mask: torch.Tensor, repeats: int, default: int
) -> dict:
    """Dense and compact forward times, interleaved, with one thread and with the default threads."""
    result = {}
    for label, threads in (("one_thread", 1), ("default_threads", default)):
        torch.set_num_threads(threads)
        times = compare_latency(
            {"dense": lambda: dense(input_ids=ids, attention_mask=mask), "compact": lambda: small(ids, mask)},
            (),
            repeats=repeats,
        )
        result[label] = {
            "threads": threads,
            "dense_ms": times["dense"].median * 1e3,
            "compact_ms": times["compact"].median * 1e3,
            "speedup": times["dense"].median / times["compact"].median,
        }
    torch.set_num_threads(1)
    return result


def markdown(payload: dict[str, Any]) -> str:
    lines = [
        "| one-shot, 50% per layer | cosine / NN agreement | params | speed-up 1 thread | speed-up "
        f"{payload['default_threads']} threads |",
        "|---|---|---|---|---|",
    ]
    for arm, row in payload["arms"].items():
        reference = f" (reference {REFERENCES[arm]:.3f})" if arm in REFERENCES else ""
        lines.append(
            f"| {arm} | {row['cosine']:.3f} / {row['agreement']:.3f}{reference} | {row['parameters'] / 1e6:.2f}M | "
            f"{row['timing']['one_thread']['speedup']:.2f}x | {row['timing']['default_threads']['speedup']:.2f}x |"
        )
    lines += ["", f"dense: {payload['dense_parameters'] / 1e6:.2f}M parameters. Command: `{payload['command']}`"]
    lines += [f"Machine: {payload['machine']}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=Path("~/.cache/lightprune/minilm"))
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "structured_minilm")
    parser.add_argument("--repeats", type=int, default=15, help="timed forwards per model and thread setting")
    parser.add_argument("--quick", action="store_true", help="few lines: a smoke run")
    args = parser.parse_args(argv)
    settings = cm.QUICK if args.quick else cm.Settings()
    settings = replace(settings, threads=1)
    default_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = args.out / "quick" if args.quick else args.out
    out.mkdir(parents=True, exist_ok=True)
    cache = args.cache.expanduser()
    model_dir, archive = cm.ensure_files(cache)
    parts = cm.split_lines(cm.read_lines(archive), settings)
    tokenizer = cm.load_tokenizer(model_dir)
    dense_model = cm.load_model(model_dir)
    tag = "quick" if args.quick else "full"
    dense = cm.dense_embeddings(dense_model, tokenizer, parts["evaluation"], settings, cache / f"dense_eval_{tag}.pt")
    example_ids, example_mask = cm.tokenize(tokenizer, parts["evaluation"][:2], settings.max_tokens)
    example = {"input_ids": example_ids, "attention_mask": example_mask}
    groups = find_units(dense_model, (), example)
    moments = collect_moments(
        dense_model, groups, calibration_batches(tokenizer, parts["calibration"], settings.max_tokens), outer=True
    )
    timing_lines = parts["evaluation"][:32] if not args.quick else parts["evaluation"][:8]
    ids, mask = cm.tokenize(tokenizer, [" ".join([line] * 8) for line in timing_lines], settings.max_tokens)
    assert ids.shape[1] == settings.max_tokens
    payload: dict[str, Any] = {
        "command": "python benchmarks/structured_minilm.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": describe("transformers"),
        "default_threads": default_threads,
        "dense_parameters": sum(p.numel() for p in dense_model.parameters()),
        "timing_batch": list(ids.shape),
        "arms": {},
    }
    for arm in ARMS:
        masked = run_arm(dense_model, groups, moments, arm)
        quality = cm.compare(cm.embed(masked, tokenizer, parts["evaluation"], settings), dense)
        small = remove_units(masked, (), example, groups=groups)
        compact_quality = cm.compare(cm.embed(small, tokenizer, parts["evaluation"], settings), dense)
        row = {
            **quality,
            "compact_cosine": compact_quality["cosine"],
            "parameters": sum(p.numel() for p in small.parameters()),
            "timing": timing(dense_model, small, ids, mask, args.repeats, default_threads),
        }
        payload["arms"][arm] = row
        print(arm, json.dumps(row), flush=True)
    report = markdown(payload)
    (out / "structured_minilm.md").write_text(report)
    (out / "structured_minilm.json").write_text(json.dumps(payload, indent=1))
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
