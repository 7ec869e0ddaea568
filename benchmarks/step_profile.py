"""Where a pruned training step's time goes: milliseconds per step for each pass, by masking mode.

The models, batches, optimizers and arms are ``training_step.py``'s (pruned to 90% with one global L1 ranking after 3
dense steps; the dense model is the reference). A step is cut into its phases, each timed on its own: forward (with
the loss), backward, the in-place gradient pass (where the arm has one before the optimizer step), the optimizer step,
the in-place weight pass (where the arm has one after it) and ``zero_grad``. The masking done inside the forward and
the backward (the reparametrization's masked copy of each weight and its masked gradient; the in-place mode's
gradient hooks) is timed apart too, by wrapping the functions that do it. The arms run interleaved, a step each in
turn; the table gives each phase's median over ``--steps`` steps.

Usage:
    python benchmarks/step_profile.py                           # LeNet-300-100 with Adam, one thread
    python benchmarks/step_profile.py --model "tiny BERT" --optimizer AdamW
    python benchmarks/step_profile.py --quick                   # smoke test
    python benchmarks/step_profile.py --adam-state              # Adam's step with the pruned entries' state zeroed

``--adam-state`` times ``torch.optim.Adam``'s step alone on one 300 x 784 weight, 90% pruned (weight and gradient
zero where pruned), with the pruned entries' state as it was (dense), all zeroed, or only the first moment zeroed (as
few as keeps them at zero), or with the second moment set to 1 there; CPU time of the thread, interleaved.

Prints a Markdown table and writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from lightprune.callback import inplace
from lightprune.prune import base, masking

sys.path.insert(0, str(Path(__file__).parent))
import training_step  # the sibling benchmark: same models, arms and pruning

PHASES = ["forward", "backward", "gradient pass", "optimizer step", "weight pass", "zero_grad"]
INSIDE = ["masking in forward", "masking in backward"]
"""Masking time already counted in the forward / backward phases, timed apart."""


class Clock:
    """Accumulates the seconds spent in wrapped functions under a label."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def wrap(self, label: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - start

        return timed

    def take(self, label: str) -> float:
        return self.seconds.pop(label, 0.0)


@contextmanager
def wrapped_masking(clock: Clock) -> Iterator[None]:
    """Time the masking functions that run inside forward and backward (patched where they are looked up)."""
    patches = [
        (base, "masked", clock.wrap("masking in forward", base.masked)),  # the reparametrization's pre-hook
        (masking._KeepWhere, "backward", staticmethod(clock.wrap("masking in backward", masking._KeepWhere.backward))),
        (inplace, "masked_", clock.wrap("masking in backward", inplace.masked_)),  # gradient hooks, manual optimization
    ]
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in patches]
    try:
        for owner, name, value in patches:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def profiled_step(trainee: training_step.Trainee, clock: Clock) -> dict[str, float]:
    """One training step, each phase timed; the optimizer's pre/post hooks are the gradient/weight passes."""
    optimizer = trainee.optimizer
    pre, post = dict(optimizer._optimizer_step_pre_hooks), dict(optimizer._optimizer_step_post_hooks)
    times: dict[str, float] = {}
    start = time.perf_counter()
    loss = trainee.loss()
    times["forward"] = time.perf_counter() - start
    start = time.perf_counter()
    loss.backward()
    times["backward"] = time.perf_counter() - start
    times["masking in forward"] = clock.take("masking in forward")
    times["masking in backward"] = clock.take("masking in backward")
    start = time.perf_counter()
    for hook in pre.values():
        hook(optimizer, (), {})
    times["gradient pass"] = time.perf_counter() - start
    optimizer._optimizer_step_pre_hooks.clear()
    optimizer._optimizer_step_post_hooks.clear()
    try:
        start = time.perf_counter()
        optimizer.step()
        times["optimizer step"] = time.perf_counter() - start
    finally:
        optimizer._optimizer_step_pre_hooks.update(pre)
        optimizer._optimizer_step_post_hooks.update(post)
    clock.take("masking in backward")
    start = time.perf_counter()
    for hook in post.values():
        hook(optimizer, (), {})
    times["weight pass"] = time.perf_counter() - start
    clock.take("masking in backward")  # the weight pass calls masked_ too: counted as the weight pass
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    times["zero_grad"] = time.perf_counter() - start
    return times


def profile(model: str, optimizer: str, arms: list[str], steps: int) -> dict[str, dict[str, float]]:
    """Median milliseconds per phase for dense and each arm, over ``steps`` interleaved steps."""
    trainees = {"dense": training_step.Trainee(model, optimizer)}
    for arm in arms:
        trainees[arm] = training_step.pruned_trainee(arm, model, optimizer)
    clock = Clock()
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in trainees}
    with wrapped_masking(clock):
        for trainee in trainees.values():  # warm up
            profiled_step(trainee, clock)
        for _ in range(steps):
            for name, trainee in trainees.items():
                samples[name].append(profiled_step(trainee, clock))
    return {
        name: {phase: 1e3 * statistics.median(s[phase] for s in rows) for phase in PHASES + INSIDE}
        for name, rows in samples.items()
    }


def table(result: dict[str, dict[str, float]]) -> str:
    """Markdown: a row per phase, a column per arm, ms per step (total and over dense at the bottom)."""
    names = list(result)
    lines = ["| ms per step | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for phase in PHASES + INSIDE:
        label = phase if phase in PHASES else f"(of which {phase})"
        lines.append(f"| {label} | " + " | ".join(f"{result[n][phase]:.3f}" for n in names) + " |")
    totals = {n: sum(result[n][p] for p in PHASES) for n in names}
    lines.append("| **step (sum of phases)** | " + " | ".join(f"{totals[n]:.3f}" for n in names) + " |")
    lines.append("| over dense | " + " | ".join(f"{totals[n] - totals['dense']:+.3f}" for n in names) + " |")
    return "\n".join(lines)


ADAM_STATES = ["dense", "all state zeroed", "first moment zeroed", "first moment zeroed, second set to 1"]


def adam_state(steps: int) -> dict[str, float]:
    """Median CPU milliseconds of an Adam step on a 90%-pruned 300 x 784 weight, for each of :data:`ADAM_STATES`."""
    generator = torch.Generator().manual_seed(0)
    keep = torch.rand(300, 784, generator=generator) > 0.9
    grad = torch.randn(300, 784, generator=generator) * 0.01
    arms = {}
    for name in ADAM_STATES:
        weight = torch.nn.Parameter(torch.randn(300, 784, generator=generator) * 0.05)
        optimizer = torch.optim.Adam([weight], lr=1e-3)
        for _ in range(3):
            weight.grad = torch.randn(300, 784, generator=generator) * 0.01
            optimizer.step()
        state = optimizer.state[weight]
        with torch.no_grad():
            if name != "dense":
                weight.mul_(keep)
                state["exp_avg"].mul_(keep)
            if name == "all state zeroed":
                state["exp_avg_sq"].mul_(keep)
            elif name == "first moment zeroed, second set to 1":
                state["exp_avg_sq"].masked_fill_(~keep, 1.0)
        arms[name] = (weight, optimizer, grad if name == "dense" else grad * keep)
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(steps):
        for name, (weight, optimizer, g) in arms.items():
            weight.grad = g.clone()
            start = time.thread_time()
            optimizer.step()
            times[name].append(time.thread_time() - start)
    for name, (weight, _, _) in arms.items():  # the zeroed variants all keep pruned weights exactly zero
        assert name == "dense" or bool((weight[~keep] == 0).all()), name
    return {name: 1e3 * statistics.median(values) for name, values in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="LeNet-300-100", choices=list(training_step.MODELS))
    parser.add_argument("--optimizer", default="Adam", choices=list(training_step.OPTIMIZERS))
    parser.add_argument("--arms", nargs="+", default=training_step.ARMS[2:], choices=training_step.ARMS)
    parser.add_argument("--steps", type=int, default=200, help="interleaved steps per arm")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--quick", action="store_true", help="a few steps (smoke test)")
    parser.add_argument("--adam-state", action="store_true", help="only Adam's step by state of the pruned entries")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "step_profile.json"))
    args = parser.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.adam_state:
        adam = adam_state(3 if args.quick else args.steps)
        print("| Adam step, 300 x 784, 90% pruned | CPU ms |\n|---|---:|")
        print("\n".join(f"| {name} | {ms:.3f} |" for name, ms in adam.items()))
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"adam_step_ms": adam}, indent=1) + "\n")
        return 0
    result = profile(args.model, args.optimizer, args.arms, 3 if args.quick else args.steps)
    print(table(result))
    meta = {
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "model": args.model,
        "optimizer": args.optimizer,
        "command": "python benchmarks/step_profile.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "ms_per_step": result}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
