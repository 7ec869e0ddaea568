"""Training step time with pruned weights against the same dense model: reparametrized masks (float, bool), in place.

Protocol: one torch thread; a model is trained 3 dense steps, pruned to 90% with one global L1 ranking, then its
step time is compared with an identical dense model's, interleaved (dense, pruned, dense, pruned...) so that a busy
machine slows both alike. Each sample is the mean of ``--steps`` steps; the figure is the median of ``--samples``
per-sample ratios (pruned / dense). A step is forward, cross-entropy, backward, optimizer step and zero_grad on a
fixed batch of random inputs.

Arms:

* ``torch.nn.utils.prune``: torch's reparametrization (float masks);
* ``lightprune, float masks`` / ``lightprune, bool masks``: lightprune.prune's reparametrization;
* ``lightprune, in place (bool masks)``: the callback's ``masking="inplace"`` machinery (plain Parameters, gradients
  masked as they are accumulated, weights zeroed after each optimizer step).

Usage:
    python benchmarks/training_step.py                 # LeNet-300-100 (batch 128) and 4 x Linear(2048) (batch 64)
    python benchmarks/training_step.py --quick         # one small model, few samples (smoke test)

Prints a Markdown table and writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightprune import prune
from lightprune.callback.inplace import InPlaceMasks

MODELS: dict[str, tuple[list[int], int]] = {
    "LeNet-300-100": ([784, 300, 100, 10], 128),
    "4xLinear(2048)": ([2048, 2048, 2048, 2048, 2048], 64),
}
OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "SGD": lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9),
    "Adam": lambda params: torch.optim.Adam(params, lr=1e-3),
}
ARMS = [
    "torch.nn.utils.prune",
    "lightprune, float masks",
    "lightprune, bool masks",
    "lightprune, in place (bool masks)",
]


def mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class Trainee:
    """A model, its optimizer and one fixed batch; ``step()`` is one training step."""

    def __init__(self, model: nn.Module, optimizer: str, batch: int, inputs: int, classes: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.model = model
        self.x = torch.randn(batch, inputs, generator=generator)
        self.y = torch.randint(0, classes, (batch,), generator=generator)
        self.optimizer = OPTIMIZERS[optimizer](model.parameters())

    def step(self) -> None:
        loss = nn.functional.cross_entropy(self.model(self.x), self.y)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def pruned_trainee(arm: str, sizes: list[int], optimizer: str, batch: int) -> Trainee:
    torch.manual_seed(0)
    trainee = Trainee(mlp(sizes), optimizer, batch, sizes[0], sizes[-1])
    for _ in range(3):
        trainee.step()
    pairs = [(m, "weight") for m in trainee.model if isinstance(m, nn.Linear)]
    if arm == "torch.nn.utils.prune":
        torch.nn.utils.prune.global_unstructured(pairs, torch.nn.utils.prune.L1Unstructured, amount=0.9)
    else:
        dtype = None if arm == "lightprune, float masks" else torch.bool
        with prune.mask_dtype(dtype):
            prune.global_unstructured(pairs, prune.L1Unstructured, amount=0.9)
    if arm.startswith("lightprune, in place"):
        masks = InPlaceMasks()
        masks.take(pairs)
        trainee.optimizer.register_step_post_hook(lambda *args, **kwargs: masks.apply())
        trainee.in_place = masks  # type: ignore[attr-defined]
    return trainee


def timed(trainee: Trainee, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        trainee.step()
    return (time.perf_counter() - start) / steps


def measure(arm: str, model: str, optimizer: str, steps: int, samples: int) -> dict[str, Any]:
    sizes, batch = MODELS[model]
    pruned = pruned_trainee(arm, sizes, optimizer, batch)
    torch.manual_seed(0)
    dense = Trainee(copy.deepcopy(mlp(sizes)), optimizer, batch, sizes[0], sizes[-1])
    for trainee in (dense, pruned):  # warm up
        timed(trainee, steps)
    ratios, dense_times, pruned_times = [], [], []
    for _ in range(samples):
        d = timed(dense, steps)
        p = timed(pruned, steps)
        dense_times.append(d)
        pruned_times.append(p)
        ratios.append(p / d)
    zeros = sum(int((m.weight == 0).sum()) for m in pruned.model if isinstance(m, nn.Linear))
    total = sum(m.weight.numel() for m in pruned.model if isinstance(m, nn.Linear))
    return {
        "arm": arm,
        "model": model,
        "optimizer": optimizer,
        "ratio_median": statistics.median(ratios),
        "dense_step_ms": 1e3 * statistics.median(dense_times),
        "pruned_step_ms": 1e3 * statistics.median(pruned_times),
        "sparsity": zeros / total,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="LeNet with SGD only, few samples (smoke test)")
    parser.add_argument("--steps", type=int, default=10, help="steps per sample")
    parser.add_argument("--samples", type=int, default=15, help="interleaved samples per figure")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "training_step.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    models, optimizers = (["LeNet-300-100"], ["SGD"]) if args.quick else (list(MODELS), list(OPTIMIZERS))
    steps, samples = (2, 3) if args.quick else (args.steps, args.samples)
    rows = []
    for model in models:
        for optimizer in optimizers:
            for arm in ARMS:
                rows.append(measure(arm, model, optimizer, steps, samples))
                print(f"  {model} {optimizer} {arm}: {rows[-1]['ratio_median']:.3f}", flush=True)
    columns = [(m, o) for m in models for o in optimizers]
    lines = [
        "| step vs dense | " + " | ".join(f"{m} {o}" for m, o in columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for arm in ARMS:
        cells = [next(r for r in rows if (r["arm"], r["model"], r["optimizer"]) == (arm, m, o)) for m, o in columns]
        lines.append(f"| {arm} | " + " | ".join(f"{r['ratio_median']:.2f}" for r in cells) + " |")
    dense = [next(r for r in rows if (r["model"], r["optimizer"]) == (m, o)) for m, o in columns]
    lines.append("| (dense step, ms) | " + " | ".join(f"{r['dense_step_ms']:.2f}" for r in dense) + " |")
    print("\n".join(lines))
    meta = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__, "threads": args.threads}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
