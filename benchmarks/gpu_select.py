"""Where the time of a global selection goes on a GPU, and what the chunk size changes.

``benchmarks/engine.py`` times one call a process, so every call there pays the CUDA caching allocator's first
allocations. This script times the same operation (global L1 to 90% over ``L x Linear(4096, 4096)``, tie-free
weights filled on the device) again and again in one process, interleaved with torch's, so the rounds after the first
show the warm cost, and splits lightprune's call into its two passes (``find_cut``, the search, and ``apply_cut``, the
writing of the masks) at several chunk sizes (``k_smallest.CHUNK_CUDA``). One warm call is profiled
(``torch.profiler``): the table of its operations by device time and by host time tells launches, synchronizations
and kernels apart.

Usage:
    python benchmarks/gpu_select.py --out OUT_DIR                    # on a GPU: 134M weights, 5 rounds
    python benchmarks/gpu_select.py --device cpu --layers 2 --hidden 512 --rounds 2 --out /tmp/x   # a smoke test

Writes ``OUT_DIR/gpu_select.json`` (every round's times and peak memory) and prints a table of medians.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.utils.prune as torch_prune

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import _Memory, _model, _pairs
from lightprune import prune
from lightprune.prune import k_smallest

AMOUNT = 0.9
CHUNKS = (1 << 24, 1 << 26, 1 << 28)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _measure(device: str, fn: Callable[[], Any]) -> tuple[float, int]:
    """Seconds and extra peak bytes of ``fn()``, metered as the engine benchmark meters a case."""
    with _Memory(device) as meter:
        fn()
    return meter.seconds, meter.extra


@contextlib.contextmanager
def _chunk(chunk: int | None) -> Iterator[None]:
    """``k_smallest.CHUNK_CUDA`` set to ``chunk`` (``None``: left as it is) for the block, then restored."""
    previous = k_smallest.CHUNK_CUDA
    if chunk is not None:
        k_smallest.CHUNK_CUDA = chunk
    try:
        yield
    finally:
        k_smallest.CHUNK_CUDA = previous


def _fingerprint(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for module, name in _pairs(model):
        digest.update((getattr(module, name + "_mask") != 0).to(torch.uint8).cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = _model(args.layers, args.hidden, device, True, 0)
    weights = [module.weight.detach() for module in base]
    total = sum(w.numel() for w in weights)
    k = round(AMOUNT * total)

    def fresh() -> torch.nn.Module:
        layers = (torch.nn.Linear(args.hidden, args.hidden, bias=False, device="meta") for _ in weights)
        model = torch.nn.Sequential(*layers)
        model = model.to_empty(device=device)
        with torch.no_grad():
            for module, w in zip(model, weights, strict=True):
                module.weight.copy_(w)
        return model

    def global_call(
        api: Any, mask_dtype: torch.dtype | None = None, chunk: int | None = None, fingerprint: bool = True
    ) -> Callable[[], Any]:
        def run() -> None:
            model = fresh()
            _sync(device)
            options = {} if mask_dtype is None else {"mask_dtype": mask_dtype}
            with _chunk(chunk):
                seconds, extra = _measure(
                    device,
                    lambda: api.global_unstructured(
                        _pairs(model), pruning_method=api.L1Unstructured, amount=AMOUNT, **options
                    ),
                )
            run.result = (seconds, extra, _fingerprint(model) if fingerprint else None)  # type: ignore[attr-defined]

        return run

    def passes(chunk: int) -> tuple[Callable[[], Any], Callable[[], Any]]:
        state: dict[str, Any] = {}

        def search() -> None:
            with _chunk(chunk):
                state["cut"] = k_smallest.find_cut(weights, k, magnitude=True)

        def write() -> None:
            masks = [torch.empty(w.shape, dtype=torch.bool, device=device) for w in weights]
            with _chunk(chunk):
                k_smallest.apply_cut(weights, state["cut"], out=masks, magnitude=True)

        return search, write

    cases: dict[str, Callable[[], Any]] = {"torch": global_call(torch_prune)}
    cases["lightprune float masks"] = global_call(prune, torch.float32)
    cases["lightprune bool masks"] = global_call(prune, torch.bool)
    for chunk in CHUNKS[1:]:
        cases[f"lightprune bool masks, chunk 2^{chunk.bit_length() - 1}"] = global_call(prune, torch.bool, chunk)
    for chunk in CHUNKS:
        search, write = passes(chunk)
        cases[f"find_cut, chunk 2^{chunk.bit_length() - 1}"] = search
        cases[f"apply_cut (bool), chunk 2^{chunk.bit_length() - 1}"] = write

    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in cases}
    for round_ in range(args.rounds):
        for name, fn in cases.items():
            seconds, extra = _measure(device, fn)
            if hasattr(fn, "result"):
                seconds, extra, fingerprint = fn.result
            else:
                fingerprint = None
            rows[name].append({"round": round_, "seconds": seconds, "extra_bytes": extra, "masks": fingerprint})
            print(f"round {round_} {name}: {seconds * 1e3:.2f} ms, {extra / 2**30:.3f} GiB", flush=True)

    print(f"\n{total / 1e6:.0f}M weights on {device}; medians of rounds 1..{args.rounds - 1} (round 0: cold)\n")
    print("| case | cold ms | warm ms (median, range) | extra GiB | masks |")
    print("|---|---:|---:|---:|---|")
    for name, runs in rows.items():
        warm = [r["seconds"] * 1e3 for r in runs[1:]] or [runs[0]["seconds"] * 1e3]
        print(
            f"| {name} | {runs[0]['seconds'] * 1e3:.2f} | {statistics.median(warm):.2f} ({min(warm):.2f}-"
            f"{max(warm):.2f}) | {max(r['extra_bytes'] for r in runs) / 2**30:.3f} | {runs[-1]['masks'] or ''} |"
        )

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiled = global_call(prune, torch.bool, fingerprint=False)
    with torch.profiler.profile(activities=activities) as profiler:
        profiled()
    table = profiler.key_averages()
    print(f"\nProfile of one warm lightprune call (bool masks): {sum(e.count for e in table)} operations")
    sort = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    print(table.table(sort_by=sort, row_limit=20))
    print(table.table(sort_by="self_cpu_time_total", row_limit=20))

    info = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "weights": total,
        "rounds": rows,
    }
    (out / "gpu_select.json").write_text(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
