"""Where the time of a compact MiniLM goes: the speed-up of 50% neurons (and 50% neurons + 50% heads), paired.

The shapes decide the speed, not the weights' values: all-MiniLM-L6-v2 is cut one-shot by magnitude
(:func:`lightprune.structure.prune_units`, 50% of every layer's MLP neurons; then also 50% of its heads) and
compacted (:func:`lightprune.export.remove_units`: the same ``BertModel`` class with ``intermediate_size`` 768, and 6
heads). Each compact model is timed against the dense one on the criteria benchmark's batch of 32 lines x 48
tokens, **paired**: a round times both, in alternating order, and the report gives the median of the per-round ratios
with their quartiles (a busy machine slows both calls of a round alike), with one thread and with the default
threads. A second pass times the parts of the forward (forward hooks on the embeddings and on each layer's
self-attention, attention output projection + LayerNorm, intermediate projection + GELU, output projection +
LayerNorm) to show which part shrank and which did not.

Usage:
    python benchmarks/structured_minilm_speed.py --repeats 40     # timing: run it without nice
    python benchmarks/structured_minilm_speed.py --quick          # a smoke run

Writes ``OUT/structured_minilm_speed.json`` and ``.md`` (OUT: ``benchmarks/results/structured_minilm``).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import criteria_minilm as cm
from lightprune.export import remove_units
from lightprune.structure import find_units, prune_units
from machine import describe
from structured_minilm_distill import paired_timing

PARTS = {
    "embeddings": lambda model: [model.embeddings],
    "self-attention (q, k, v, softmax)": lambda model: [layer.attention.self for layer in model.encoder.layer],
    "attention output + LayerNorm": lambda model: [layer.attention.output for layer in model.encoder.layer],
    "MLP in (intermediate + GELU)": lambda model: [layer.intermediate for layer in model.encoder.layer],
    "MLP out (output + LayerNorm)": lambda model: [layer.output for layer in model.encoder.layer],
}
"""Part of the forward -> the modules whose calls it sums (none nested in another)."""


def compact_model(dense: nn.Module, example: dict[str, Tensor], kinds: tuple[str, ...]) -> nn.Module:
    """``dense`` with 50% of every layer's units of ``kinds`` removed (magnitude ranking; shapes are what count)."""
    model = copy.deepcopy(dense)
    groups = [group for group in find_units(model, (), example) if group.kind in kinds]
    prune_units(model, groups, 0.5, importance="magnitude")
    return remove_units(model, (), example, groups=groups).eval()


def part_times(model: nn.Module, inputs: dict[str, Tensor], repeats: int) -> dict[str, float]:
    """Median milliseconds per forward of each part and of the whole forward (hooks on the parts' modules)."""
    spent: dict[str, float] = defaultdict(float)
    started: dict[int, float] = {}
    handles = []
    for part, modules in PARTS.items():
        for module in modules(model):

            def before(module: nn.Module, args: Any) -> None:
                started[id(module)] = time.perf_counter()

            def after(module: nn.Module, args: Any, output: Any, part: str = part) -> None:
                spent[part] += time.perf_counter() - started[id(module)]

            handles += [module.register_forward_pre_hook(before), module.register_forward_hook(after)]
    rounds: dict[str, list[float]] = defaultdict(list)
    try:
        with torch.inference_mode():
            for index in range(repeats + 1):
                spent.clear()
                start = time.perf_counter()
                model(**inputs)
                total = time.perf_counter() - start
                if index == 0:
                    continue  # warm-up
                for part in PARTS:
                    rounds[part].append(spent[part])
                rounds["other (pooling of masks, casts, Python)"].append(total - sum(spent.values()))
                rounds["whole forward"].append(total)
    finally:
        for handle in handles:
            handle.remove()
    return {part: statistics.median(values) * 1e3 for part, values in rounds.items()}


def markdown(payload: dict[str, Any]) -> str:
    threads = payload["default_threads"]
    lines = [
        f"| one-shot, compact | params | speed-up 1 thread: median of {payload['repeats']} paired rounds (IQR) | "
        f"speed-up {threads} threads (IQR) |",
        "|---|---|---|---|",
    ]
    for name, row in payload["models"].items():
        cells = [
            f"{t['speedup']:.2f}x ({t['speedup_q1']:.2f}-{t['speedup_q3']:.2f}; {t['dense_ms']:.0f} -> "
            f"{t['compact_ms']:.0f} ms)"
            for t in (row["timing"]["one_thread"], row["timing"]["default_threads"])
        ]
        lines.append(f"| {name} | {row['parameters'] / 1e6:.2f}M | {cells[0]} | {cells[1]} |")
    names = list(payload["models"])
    lines += ["", "Parts of the forward, one thread, median ms per forward (hooks on the modules):", ""]
    lines += ["| part | dense | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for part, dense_ms in payload["parts"]["dense"].items():
        cells = [
            f"{payload['parts'][name][part]:.1f} ({dense_ms / payload['parts'][name][part]:.2f}x)" for name in names
        ]
        lines.append(f"| {part} | {dense_ms:.1f} | " + " | ".join(cells) + " |")
    lines += ["", f"Command: `{payload['command']}`", f"Machine: {payload['machine']}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=Path("~/.cache/lightprune/minilm"))
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "structured_minilm")
    parser.add_argument("--repeats", type=int, default=40, help="paired rounds per model and thread setting")
    parser.add_argument("--quick", action="store_true", help="few rounds: a smoke run")
    args = parser.parse_args(argv)
    repeats = 3 if args.quick else args.repeats
    default_threads = torch.get_num_threads()
    settings = cm.Settings()
    out = args.out / "quick" if args.quick else args.out
    out.mkdir(parents=True, exist_ok=True)
    model_dir, archive = cm.ensure_files(args.cache.expanduser())
    parts = cm.split_lines(cm.read_lines(archive), settings)
    tokenizer = cm.load_tokenizer(model_dir)
    dense = cm.load_model(model_dir).eval()
    ids, mask = cm.tokenize(tokenizer, parts["evaluation"][:2], settings.max_tokens)
    example = {"input_ids": ids, "attention_mask": mask}
    ids, mask = cm.tokenize(tokenizer, [" ".join([line] * 8) for line in parts["evaluation"][:32]], settings.max_tokens)
    batch = {"input_ids": ids, "attention_mask": mask}
    models = {
        "50% neurons": compact_model(dense, example, ("neurons",)),
        "50% neurons + 50% heads": compact_model(dense, example, ("neurons", "heads")),
    }
    payload: dict[str, Any] = {
        "command": " ".join(["python benchmarks/structured_minilm_speed.py", *(argv if argv else sys.argv[1:])]),
        "machine": describe("transformers"),
        "default_threads": default_threads,
        "repeats": repeats,
        "timing_batch": list(ids.shape),
        "models": {
            name: {"parameters": sum(p.numel() for p in m.parameters()), "timing": {}} for name, m in models.items()
        },
        "parts": {},
    }
    for label, threads in (("one_thread", 1), ("default_threads", default_threads)):
        torch.set_num_threads(threads)
        for name, model in models.items():
            timing = paired_timing(dense, model, batch, repeats)
            payload["models"][name]["timing"][label] = {"threads": threads, **timing}
            print(name, label, json.dumps(timing), flush=True)
    torch.set_num_threads(1)
    for name, model in {"dense": dense, **models}.items():
        payload["parts"][name] = part_times(model, batch, max(repeats // 4, 3))
        print(name, json.dumps(payload["parts"][name]), flush=True)
    report = markdown(payload)
    (out / "structured_minilm_speed.md").write_text(report)
    (out / "structured_minilm_speed.json").write_text(json.dumps(payload, indent=1))
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
