"""Training step time with pruned weights against the same dense model: reparametrized masks (float, bool), in place.

Protocol: a model is trained 3 dense steps, pruned to 90% with one global L1 ranking over its Linear weights, then its
step time is compared with an identical dense model's, interleaved (dense, pruned, dense, pruned...) so that a busy
machine slows both alike. Each sample is the mean of a model's steps per sample (``--steps`` scales them); the figure
is the median of ``--samples`` per-sample ratios (pruned / dense). A step is forward, loss, backward, optimizer step
and zero_grad on a fixed batch of random inputs.

Models: LeNet-300-100 (batch 128), 4 x Linear(2048) (batch 64), both with SGD (momentum) and Adam; a tiny BERT
built from a ``transformers`` config (bert-tiny's sizes: 2 layers, hidden 128, 2 heads, intermediate 512, its 30,522
token vocabulary; no download) fine-tuned for sequence classification with AdamW (batch 8 of 64 random tokens).

Arms:

* ``torch.nn.utils.prune``: torch's reparametrization (float masks);
* ``lightprune, float masks`` / ``lightprune, bool masks``: lightprune.prune's reparametrization;
* ``lightprune, in place (bool masks)``: the callback's ``masking="inplace"`` strategy, driven as the callback drives
  it (before the masking strategies: gradients masked as they are accumulated, weights zeroed after every step; with
  them: the strategy's own per-step passes);
* ``in place, one gradient pass (bool masks)``: the per-step work that in-place masking needs with these optimizers,
  and nothing else: one ``prune.masking.masked_all_`` call over every pruned gradient before each optimizer step, no
  weight pass (the optimizer state of the pruned entries is zeroed at the event, so they stay exactly zero: the
  figure ``sparsity`` checks it after the timed steps).

Usage:
    python benchmarks/training_step.py                 # every model, one torch thread
    python benchmarks/training_step.py --threads 0     # torch's default number of threads
    python benchmarks/training_step.py --quick         # one small model, few samples (smoke test)

Prints a Markdown table and writes JSON to ``--out`` (default ``results/training_step_t<threads>.json``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor, nn

from lightprune import prune
from lightprune.callback.inplace import InPlaceMasks

MODELS: dict[str, dict[str, Any]] = {
    "LeNet-300-100": {"sizes": [784, 300, 100, 10], "batch": 128, "steps": 20, "optimizers": ["SGD", "Adam"]},
    "4xLinear(2048)": {"sizes": [2048] * 5, "batch": 64, "steps": 3, "optimizers": ["SGD", "Adam"]},
    "tiny BERT": {"batch": 8, "tokens": 64, "steps": 5, "optimizers": ["AdamW"]},
}
OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "SGD": lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9),
    "Adam": lambda params: torch.optim.Adam(params, lr=1e-3),
    "AdamW": lambda params: torch.optim.AdamW(params, lr=5e-5, weight_decay=0.01),
}
ARMS = [
    "torch.nn.utils.prune",
    "lightprune, float masks",
    "lightprune, bool masks",
    "lightprune, in place (bool masks)",
    "in place, one gradient pass (bool masks)",
]


def mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def tiny_bert() -> nn.Module:
    """bert-tiny's architecture for sequence classification, randomly initialized from its config."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512)
    return BertForSequenceClassification(config)


class Trainee:
    """A model, its optimizer and one fixed batch; ``step()`` is one training step."""

    def __init__(self, model_name: str, optimizer: str) -> None:
        spec = MODELS[model_name]
        generator = torch.Generator().manual_seed(0)
        torch.manual_seed(0)
        if model_name == "tiny BERT":
            self.model = tiny_bert()
            vocab = self.model.config.vocab_size
            ids = torch.randint(0, vocab, (spec["batch"], spec["tokens"]), generator=generator)
            labels = torch.randint(0, 2, (spec["batch"],), generator=generator)
            self.loss: Callable[[], Tensor] = lambda: self.model(input_ids=ids, labels=labels).loss
        else:
            self.model = mlp(spec["sizes"])
            x = torch.randn(spec["batch"], spec["sizes"][0], generator=generator)
            y = torch.randint(0, spec["sizes"][-1], (spec["batch"],), generator=generator)
            self.loss = lambda: nn.functional.cross_entropy(self.model(x), y)
        self.model.train()
        self.optimizer = OPTIMIZERS[optimizer](self.model.parameters())

    def step(self) -> None:
        self.loss().backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def linears(self) -> list[nn.Linear]:
        return [m for m in self.model.modules() if isinstance(m, nn.Linear)]


def pruned_trainee(arm: str, model_name: str, optimizer: str) -> Trainee:
    trainee = Trainee(model_name, optimizer)
    for _ in range(3):
        trainee.step()
    pairs = [(m, "weight") for m in trainee.linears()]
    if arm == "torch.nn.utils.prune":
        torch.nn.utils.prune.global_unstructured(pairs, torch.nn.utils.prune.L1Unstructured, amount=0.9)
        return trainee
    dtype = None if arm == "lightprune, float masks" else torch.bool
    with prune.mask_dtype(dtype):
        prune.global_unstructured(pairs, prune.L1Unstructured, amount=0.9)
    if arm == "lightprune, in place (bool masks)":
        in_place_strategy(trainee, pairs)
    elif arm == "in place, one gradient pass (bool masks)":
        one_gradient_pass(trainee, pairs)
    return trainee


def in_place_strategy(trainee: Trainee, pairs: list[tuple[nn.Module, str]]) -> None:
    """The callback's in-place masks, driven per step as ``PruningCallback`` drives them under automatic optimization:
    ``attach`` (its optimizer-state zeroing and step hooks), then ``before_optimizer_step`` before every step."""
    masks = InPlaceMasks()
    masks.take(pairs)
    if not hasattr(masks, "attach"):  # versions before the masking strategies: hooks on gradients, a weight pass
        trainee.optimizer.register_step_post_hook(lambda *args, **kwargs: masks.apply())
        return
    trainer = SimpleNamespace(optimizers=[trainee.optimizer])
    named = [(f"{i}.{name}", module, name) for i, (module, name) in enumerate(pairs)]
    selection = SimpleNamespace(averages=[], named_pairs=lambda: [], selection=named)
    masks.attach(trainer, SimpleNamespace(automatic_optimization=True), selection)  # type: ignore[arg-type]
    trainee.optimizer.register_step_pre_hook(lambda *args, **kwargs: masks.before_optimizer_step())


def one_gradient_pass(trainee: Trainee, pairs: list[tuple[nn.Module, str]]) -> None:
    """Plain Parameters, pruned optimizer state zeroed now, one ``masked_all_`` over the gradients before each step."""
    from lightprune.prune.masking import masked_all_

    masks = InPlaceMasks()
    masks.take(pairs)
    masks.remove_hooks()  # this arm masks the gradients itself, in one call
    parameters = [getattr(module, name) for module, name in pairs]
    keeps = [masks.mask(module, name) for module, name in pairs]
    for parameter, keep in zip(parameters, keeps, strict=True):
        state = [v for v in trainee.optimizer.state[parameter].values() if v.shape == parameter.shape]
        masked_all_(state, [keep] * len(state))

    def mask_gradients(*args: Any, **kwargs: Any) -> None:
        masked_all_([p.grad for p in parameters], keeps)

    trainee.optimizer.register_step_pre_hook(mask_gradients)


CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}
"""``--clock``: wall time, or the CPU time of this process (all its threads): on a machine shared with other jobs, a
step's CPU time does not count the time the process waited for a core."""
clock = CLOCKS["wall"]


def timed(trainee: Trainee, steps: int) -> float:
    start = clock()
    for _ in range(steps):
        trainee.step()
    return (clock() - start) / steps


def measure(arm: str, model: str, optimizer: str, steps: int, samples: int) -> dict[str, Any]:
    pruned = pruned_trainee(arm, model, optimizer)
    dense = Trainee(model, optimizer)
    for trainee in (dense, pruned):  # warm up
        timed(trainee, steps)
    ratios, dense_times, pruned_times = [], [], []
    for _ in range(samples):
        d = timed(dense, steps)
        p = timed(pruned, steps)
        dense_times.append(d)
        pruned_times.append(p)
        ratios.append(p / d)
    zeros = sum(int((m.weight == 0).sum()) for m in pruned.linears())
    total = sum(m.weight.numel() for m in pruned.linears())
    return {
        "arm": arm,
        "model": model,
        "optimizer": optimizer,
        "ratio_median": statistics.median(ratios),
        "ratios": ratios,
        "dense_step_ms": 1e3 * statistics.median(dense_times),
        "pruned_step_ms": 1e3 * statistics.median(pruned_times),
        "sparsity": zeros / total,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="LeNet with SGD only, few samples (smoke test)")
    parser.add_argument("--steps", type=float, default=1.0, help="scale every model's steps per sample")
    parser.add_argument("--samples", type=int, default=15, help="interleaved samples per figure")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--arms", nargs="+", default=ARMS, choices=ARMS)
    parser.add_argument("--clock", default="wall", choices=list(CLOCKS), help="wall or process CPU time")
    parser.add_argument("--out", default=None, help="JSON file (default: results/training_step_t<threads>.json)")
    args = parser.parse_args(argv)
    global clock
    clock = CLOCKS[args.clock]
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    columns = [(m, o) for m in args.models for o in MODELS[m]["optimizers"]]
    if args.quick:
        columns = [("LeNet-300-100", "SGD")]
    rows = []
    for model, optimizer in columns:
        steps = 2 if args.quick else max(1, round(args.steps * MODELS[model]["steps"]))
        for arm in args.arms:
            rows.append(measure(arm, model, optimizer, steps, 3 if args.quick else args.samples))
            print(f"  {model} {optimizer} {arm}: {rows[-1]['ratio_median']:.3f}", flush=True)
    lines = [
        "| step vs dense | " + " | ".join(f"{m} {o}" for m, o in columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for arm in args.arms:
        cells = [next(r for r in rows if (r["arm"], r["model"], r["optimizer"]) == (arm, m, o)) for m, o in columns]
        lines.append(f"| {arm} | " + " | ".join(f"{r['ratio_median']:.3f}" for r in cells) + " |")
    dense = [[r["dense_step_ms"] for r in rows if (r["model"], r["optimizer"]) == (m, o)] for m, o in columns]
    lines.append("| (dense step, ms) | " + " | ".join(f"{statistics.median(d):.2f}" for d in dense) + " |")
    print("\n".join(lines))
    meta = {
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "clock": args.clock,
        "command": "python benchmarks/training_step.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    out = Path(args.out or Path(__file__).parent / "results" / f"training_step_t{args.threads}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
