"""What a pruned model buys on a GPU: 2:4 semi-structured Linear layers, and compact transformers.

Two measurements, each timed **paired** (every round times every variant, in alternating order, with CUDA events
around a block of calls; the report gives medians over rounds and the median and quartiles of per-round ratios):

* ``semi_structured``: ``nn.Linear`` weights given a 2:4 pattern by :func:`lightprune.prune.semi_structured`, the
  pruning made permanent, then compressed with torch's ``to_sparse_semi_structured`` (cuSPARSELt where torch finds
  it, else CUTLASS; both are tried) against the same weights dense. Float16 and bfloat16, shapes of a 7B model's
  attention and MLP projections on 2,048 and 8,192 tokens. The outputs are compared with the dense product's
  (relative Frobenius error).
* ``compact_bert``: BERT encoders built from configs (random weights: the shapes decide the speed, not the values),
  the all-MiniLM-L6-v2 shape and the BERT-base shape, with 50% of every layer's MLP neurons, or 50% neurons and 50% of
  its heads, removed by :func:`lightprune.export.remove_units` (the same ``BertModel`` class, smaller) against the
  dense model, in float32 and float16, on a batch of 32 x 48 tokens (small: launch-bound) and 256 x 128. The compact
  model's outputs are checked against the pruned (masked) model's.

Usage:
    python benchmarks/gpu_speed.py                       # on a CUDA device: both tables
    python benchmarks/gpu_speed.py --device cpu --quick  # a smoke run on the CPU (compact_bert only, tiny)

Writes ``OUT/gpu_speed.json`` and ``OUT/gpu_speed.md`` (OUT: ``benchmarks/results/gpu``).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lightprune import prune
from lightprune.export import remove_units
from lightprune.structure import find_units, prune_units
from machine import describe

SEMI_SHAPES = [  # (tokens, in_features, out_features)
    (2048, 4096, 4096),
    (2048, 4096, 11008),
    (2048, 11008, 4096),
    (8192, 4096, 4096),
    (8192, 4096, 11008),
    (8192, 11008, 4096),
]
BERT_SHAPES = {  # name -> (hidden, layers, heads, intermediate)
    "MiniLM-L6 shape": (384, 6, 12, 1536),
    "BERT-base shape": (768, 12, 12, 3072),
}
BATCHES = [(32, 48), (256, 128)]


def paired(calls: Mapping[str, Callable[[], Any]], rounds: int, inner: int, device: str) -> dict[str, Any]:
    """Milliseconds per call of every variant, timed in alternating order each round (``inner`` calls a block).

    Returns each variant's median (``ms``) and, for each variant after the first, the median and quartiles of the
    per-round ratio first / variant (``speedup``: above 1 when the variant is faster).

    Example:
        >>> out = paired({"a": lambda: sum(range(100)), "b": lambda: sum(range(10))}, rounds=3, inner=2, device="cpu")
        >>> sorted(out["ms"]), sorted(out["speedup"])
        (['a', 'b'], ['b'])
    """
    names = list(calls)
    for call in calls.values():  # warm-up: kernels loaded, workspaces allocated, autotuning done
        for _ in range(3):
            call()
    times: dict[str, list[float]] = {name: [] for name in names}
    for index in range(rounds):
        for name in names if index % 2 == 0 else names[::-1]:
            times[name].append(_block(calls[name], inner, device) / inner)
    first = names[0]
    speedup = {}
    for name in names[1:]:
        ratios = sorted(a / b for a, b in zip(times[first], times[name], strict=True))
        q1, median, q3 = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
        speedup[name] = {"median": median, "q1": q1, "q3": q3}
    return {"ms": {name: statistics.median(values) * 1e3 for name, values in times.items()}, "speedup": speedup}


def _block(call: Callable[[], Any], inner: int, device: str) -> float:
    """Seconds for ``inner`` calls: CUDA events on a GPU (the calls queue without waiting), the host clock on a CPU."""
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    began = time.perf_counter()
    for _ in range(inner):
        call()
    return time.perf_counter() - began


def relative_error(out: Tensor, reference: Tensor) -> float:
    """``||out - reference|| / ||reference||`` in float64.

    Example:
        >>> relative_error(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0]))
        0.0
    """
    reference = reference.double()
    return float(torch.linalg.vector_norm(out.double() - reference) / torch.linalg.vector_norm(reference))


def semi_structured_rows(rounds: int, inner: int) -> list[dict[str, Any]]:
    """2:4 weights through torch's semi-structured kernels against the same weights dense (see the module doc)."""
    from torch.sparse import SparseSemiStructuredTensor, to_sparse_semi_structured

    rows = []
    for dtype in (torch.float16, torch.bfloat16):
        for tokens, features, outputs in SEMI_SHAPES:
            layer = nn.Linear(features, outputs, bias=False, device="cuda", dtype=dtype)
            prune.semi_structured(layer, "weight", n=2, m=4)
            prune.remove(layer, "weight")
            weight = layer.weight.detach()
            x = torch.randn(tokens, features, device="cuda", dtype=dtype)
            dense_out = nn.functional.linear(x, weight)
            reference = nn.functional.linear(x.double(), weight.double())
            row: dict[str, Any] = {
                "dtype": str(dtype).removeprefix("torch."),
                "tokens": tokens,
                "in": features,
                "out": outputs,
                "zeros": float((weight == 0).float().mean()),
                "dense_error": relative_error(dense_out, reference),
            }
            calls: dict[str, Callable[[], Any]] = {"dense": lambda x=x, w=weight: nn.functional.linear(x, w)}
            for backend in ("cusparselt", "cutlass"):
                SparseSemiStructuredTensor._FORCE_CUTLASS = backend == "cutlass"
                try:
                    compressed = to_sparse_semi_structured(weight)
                    out = nn.functional.linear(x, compressed)
                    row[f"{backend}_class"] = type(compressed).__name__
                    row[f"{backend}_error"] = relative_error(out, reference)
                    calls[backend] = lambda x=x, w=compressed: nn.functional.linear(x, w)
                except Exception as error:  # a backend this build or card lacks: named in the table
                    row[f"{backend}_failed"] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
                finally:
                    SparseSemiStructuredTensor._FORCE_CUTLASS = False
            timing = paired(calls, rounds, inner, "cuda")
            row["ms"], row["speedup"] = timing["ms"], timing["speedup"]
            flops = 2 * tokens * features * outputs
            row["dense_tflops"] = flops / (timing["ms"]["dense"] / 1e3) / 1e12
            rows.append(row)
            print(_semi_line(row), flush=True)
            del layer, weight, x, calls
            torch.cuda.empty_cache()
    return rows


def bert(shape: tuple[int, int, int, int], seed: int = 0) -> nn.Module:
    """A ``BertModel`` of the given (hidden, layers, heads, intermediate), random weights, eval mode, on the CPU."""
    from transformers import BertConfig, BertModel

    hidden, layers, heads, intermediate = shape
    config = BertConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=intermediate,
        vocab_size=30522,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    return BertModel(config, add_pooling_layer=False).eval()


def compact_models(dense: nn.Module, example: dict[str, Tensor]) -> dict[str, tuple[nn.Module, nn.Module]]:
    """Name -> (the pruned model, masks in place; its compact copy): 50% neurons, and 50% neurons + 50% heads."""
    found = {}
    for name, kinds in (("50% neurons", ("neurons",)), ("50% neurons + 50% heads", ("neurons", "heads"))):
        pruned = copy.deepcopy(dense)
        groups = [group for group in find_units(pruned, (), example) if group.kind in kinds]
        prune_units(pruned, groups, 0.5, importance="magnitude")
        small = remove_units(copy.deepcopy(pruned), (), example, groups=groups).eval()
        found[name] = (pruned, small)
    return found


def compact_bert_rows(device: str, rounds: int, inner: int, quick: bool) -> list[dict[str, Any]]:
    """Dense BERT encoders against their compact copies (see the module doc)."""
    rows = []
    shapes = {"tiny shape": (64, 2, 4, 128)} if quick else BERT_SHAPES
    batches = [(4, 16)] if quick else BATCHES
    dtypes = (torch.float32,) if quick else (torch.float32, torch.float16)
    for shape_name, shape in shapes.items():
        dense = bert(shape)
        example = {"input_ids": torch.randint(0, 30522, (2, 16)), "attention_mask": torch.ones(2, 16, dtype=torch.long)}
        variants = compact_models(dense, example)
        for dtype in dtypes:
            on_device = {"dense": dense.to(device=device, dtype=dtype)}
            on_device.update({name: small.to(device=device, dtype=dtype) for name, (_, small) in variants.items()})
            for batch, tokens in batches:
                generator = torch.Generator().manual_seed(1)
                ids = torch.randint(0, 30522, (batch, tokens), generator=generator).to(device)
                mask = torch.ones(batch, tokens, dtype=torch.long, device=device)
                mask[batch // 2 :, tokens * 3 // 4 :] = 0  # padded sequences, as real batches have
                inputs = {"input_ids": ids, "attention_mask": mask}
                with torch.inference_mode():
                    errors = {}
                    for name, (pruned, small) in variants.items():
                        pruned.to(device=device, dtype=dtype)
                        expected = pruned(**inputs).last_hidden_state
                        errors[name] = relative_error(small(**inputs).last_hidden_state, expected)
                        pruned.cpu()
                    calls = {name: (lambda m=model, i=inputs: m(**i)) for name, model in on_device.items()}
                    timing = paired(calls, rounds, inner, device)
                row = {
                    "shape": shape_name,
                    "dtype": str(dtype).removeprefix("torch."),
                    "batch": [batch, tokens],
                    "parameters": {name: sum(p.numel() for p in m.parameters()) for name, m in on_device.items()},
                    "ms": timing["ms"],
                    "speedup": timing["speedup"],
                    "error_vs_pruned": errors,
                }
                rows.append(row)
                print(_bert_line(row), flush=True)
            dense = dense.float().cpu()
            for _, small in variants.values():
                small.float().cpu()
    return rows


def _semi_line(row: dict[str, Any]) -> str:
    cells = [
        f"{row['dtype']:<8} {row['tokens']:>5} x {row['in']:>5} -> {row['out']:>5}",
        f"dense {row['ms']['dense']:.3f} ms",
    ]
    for backend in ("cusparselt", "cutlass"):
        if backend in row["speedup"]:
            s = row["speedup"][backend]
            cells.append(
                f"{backend} {row['ms'][backend]:.3f} ms {s['median']:.2f}x (err {row[backend + '_error']:.1e})"
            )
        else:
            cells.append(f"{backend}: {row.get(backend + '_failed', 'not run')}")
    return " | ".join(cells)


def _bert_line(row: dict[str, Any]) -> str:
    cells = [f"{row['shape']} {row['dtype']} {row['batch'][0]}x{row['batch'][1]}: dense {row['ms']['dense']:.2f} ms"]
    for name, s in row["speedup"].items():
        cells.append(f"{name} {row['ms'][name]:.2f} ms {s['median']:.2f}x")
    return " | ".join(cells)


def markdown(payload: dict[str, Any]) -> str:
    """The two tables of a run, as in BENCHMARKS.md."""
    lines = [f"Command: `{payload['command']}`", "", f"Machine: {payload['machine']}", ""]
    if payload["semi_structured"]:
        lines += [
            f"2:4 semi-structured `F.linear`, ms per call (median of {payload['rounds']} paired rounds of "
            f"{payload['inner']} calls) and speed-up over dense, median (quartiles):",
            "",
            "| dtype | tokens x in -> out | dense ms (TFLOP/s) | cuSPARSELt | CUTLASS | rel. error (dense, 2:4) |",
            "|---|---|---|---|---|---|",
        ]
        for row in payload["semi_structured"]:
            cells = []
            for backend in ("cusparselt", "cutlass"):
                s = row["speedup"].get(backend)
                cells.append(
                    f"{row['ms'][backend]:.3f} ms, {s['median']:.2f}x ({s['q1']:.2f}-{s['q3']:.2f})"
                    if s
                    else f"failed: {row.get(backend + '_failed', 'not run')}"
                )
            errors = ", ".join(
                f"{row[k]:.1e}" for k in ("dense_error", "cusparselt_error", "cutlass_error") if k in row
            )
            lines.append(
                f"| {row['dtype']} | {row['tokens']} x {row['in']} -> {row['out']} | {row['ms']['dense']:.3f} "
                f"({row['dense_tflops']:.0f}) | {cells[0]} | {cells[1]} | {errors} |"
            )
        lines.append("")
    if payload["compact_bert"]:
        lines += [
            f"Compact BERT encoders, ms per forward (median of {payload['rounds']} paired rounds of {payload['inner']} "
            "forwards) and speed-up over dense, median (quartiles):",
            "",
            "| shape | dtype | batch | dense ms | 50% neurons | 50% neurons + 50% heads | params (M): dense, the two | "
            "max rel. error vs the masked model |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for row in payload["compact_bert"]:
            cells = [
                f"{row['ms'][name]:.2f} ms, {s['median']:.2f}x ({s['q1']:.2f}-{s['q3']:.2f})"
                for name, s in row["speedup"].items()
            ]
            params = ", ".join(f"{count / 1e6:.1f}" for count in row["parameters"].values())
            worst = max(row["error_vs_pruned"].values())
            lines.append(
                f"| {row['shape']} | {row['dtype']} | {row['batch'][0]} x {row['batch'][1]} | "
                f"{row['ms']['dense']:.2f} | {' | '.join(cells)} | {params} | {worst:.1e} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--parts", default="semi_structured,compact_bert", help="comma-separated: which tables")
    parser.add_argument("--rounds", type=int, default=15, help="paired rounds per row")
    parser.add_argument("--inner", type=int, default=10, help="calls per timed block")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, few rounds: a smoke run")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gpu")
    args = parser.parse_args(argv)
    parts = set(args.parts.split(","))
    unknown = parts - {"semi_structured", "compact_bert"}
    if unknown:
        parser.error(f"--parts: {', '.join(sorted(unknown))} not among semi_structured, compact_bert")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible (use --device cpu for a smoke run)")
    if args.device == "cpu" and "semi_structured" in parts:
        parts.discard("semi_structured")  # torch's 2:4 kernels are CUDA-only
        print("semi_structured: skipped, torch's 2:4 kernels need a CUDA device", file=sys.stderr)
    rounds, inner = (3, 2) if args.quick else (args.rounds, args.inner)
    machine = describe("transformers")
    if args.device == "cuda":
        machine += f"; GPU: {torch.cuda.get_device_name()}"
    payload: dict[str, Any] = {
        "command": " ".join(["python benchmarks/gpu_speed.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine,
        "device": args.device,
        "rounds": rounds,
        "inner": inner,
        "semi_structured": semi_structured_rows(rounds, inner) if "semi_structured" in parts else [],
        "compact_bert": compact_bert_rows(args.device, rounds, inner, args.quick) if "compact_bert" in parts else [],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_speed.json").write_text(json.dumps(payload, indent=2))
    text = markdown(payload)
    (args.out / "gpu_speed.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
