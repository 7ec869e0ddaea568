"""Long runs keep memory flat: 10,000 optimizer steps with a pruning event every 10 steps (1,000 events).

A tiny MLP (64-128-128-10, 25,856 prunable weights) trains on random data in batches of 4 with Lightning
(``CSVLogger``, no checkpoints), while ``PruningCallback`` prunes it globally on a linear schedule from 0 to 95%
sparsity, one event every ``--frequency`` steps. The process's resident set (RSS, ``/proc/self/status``) is sampled
every ``--sample-every`` steps; the growth reported is the RSS at the end minus the RSS after step ``--warmup``
(once Lightning, the allocator and the first events have settled). ``--no-pruning`` runs the same fit without the
callback, as a baseline of what Lightning and torch grow by themselves.

Also reported: the pruning hooks' history (a ``PruningContainer`` keeps one small method object per event that
changed its tensor), live Python objects (``gc``), and the metrics rows the logger wrote.

Usage:
    python benchmarks/long_run.py                          # 10,000 steps, 1,000 events (about a minute)
    python benchmarks/long_run.py --steps 1000             # 1,000 steps, 100 events (what the test runs)
    python benchmarks/long_run.py --no-pruning             # the baseline
    python benchmarks/long_run.py --json out.json          # also write the figures as JSON

Prints a summary; with ``--json`` writes the figures (the test reads them).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # machine.py, also when a test loads this file
from machine import proc_status


def run(steps: int, frequency: int, warmup: int, sample_every: int, pruning: bool, log_dir: Path) -> dict[str, Any]:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.loggers import CSVLogger
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightprune import PruningCallback, prune
    from lightprune.schedules import Linear

    torch.set_num_threads(1)
    torch.manual_seed(0)

    class MLP(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.cross_entropy(self(x), y)
            self.log("train/loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    class Sampler(Callback):
        def __init__(self) -> None:
            self.samples: list[tuple[int, int]] = []

        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            step = trainer.global_step
            if step in (warmup, steps) or step % sample_every == 0:
                gc.collect()
                self.samples.append((step, proc_status("VmRSS")))

    x = torch.randn(1000, 64)
    y = torch.randint(0, 10, (1000,))
    loader = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)  # 250 steps an epoch
    model = MLP()
    sampler = Sampler()
    callbacks: list[Callback] = [sampler]
    callback = None
    if pruning:
        schedule = Linear(initial=0.0, final=0.95, start=frequency, end=steps, frequency=frequency)
        callback = PruningCallback(schedule, make_permanent=False)
        callbacks.insert(0, callback)
    logger = CSVLogger(log_dir, name="long_run", version=0)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=logger,
        log_every_n_steps=50,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, loader)
    wall = time.perf_counter() - started

    gc.collect()
    samples = dict(sampler.samples)
    start_rss, end_rss = samples[warmup], samples[max(samples)]
    history = [
        len(hook)
        for m in model.modules()
        for hook in m._forward_pre_hooks.values()
        if isinstance(hook, prune.BasePruningMethod)  # lightprune's pruning hooks (PruningContainers by now)
    ]
    weights = [m.weight_mask for m in model.net if isinstance(m, nn.Linear) and hasattr(m, "weight_mask")]
    pruned = sum(int((mask == 0).sum()) for mask in weights)
    total = sum(m.weight.numel() for m in model.net if isinstance(m, nn.Linear))
    metrics_file = Path(logger.experiment.metrics_file_path)
    rows = sum(1 for _ in metrics_file.open()) - 1 if metrics_file.exists() else 0
    return {
        "steps": trainer.global_step,
        "frequency": frequency,
        "pruning": pruning,
        "events": 0 if callback is None else len(range(frequency, steps + 1, frequency)),
        "last_event": None if callback is None else callback._timeline.last_event,
        "sparsity": pruned / total,
        "weights": total,
        "rss_start_bytes": start_rss,
        "rss_end_bytes": end_rss,
        "rss_growth_bytes": end_rss - start_rss,
        "rss_max_bytes": max(samples.values()),
        "rss_samples": sorted(samples.items()),
        "warmup_step": warmup,
        "container_history": history,
        "python_objects": len(gc.get_objects()),
        "metrics_rows": rows,
        "wall_s": wall,
    }


def summary(result: dict[str, Any]) -> str:
    mb = 1 / 2**20
    lines = [
        f"{result['steps']} optimizer steps, "
        + (
            f"{result['events']} pruning events (every {result['frequency']} steps)"
            if result["pruning"]
            else "no pruning"
        )
        + f", {result['wall_s']:.1f} s",
        f"RSS after step {result['warmup_step']}: {result['rss_start_bytes'] * mb:.1f} MB; at the end: "
        f"{result['rss_end_bytes'] * mb:.1f} MB; growth {result['rss_growth_bytes'] * mb:+.2f} MB "
        f"(max {result['rss_max_bytes'] * mb:.1f} MB)",
        f"final sparsity {result['sparsity']:.4f} of {result['weights']} weights; pruning history per tensor "
        f"(methods in its PruningContainer): {result['container_history']}",
        f"live Python objects at the end: {result['python_objects']}; metrics rows written: {result['metrics_rows']}",
        "RSS (MB) by step: "
        + ", ".join(
            f"{step}: {rss * mb:.1f}" for step, rss in result["rss_samples"] if step % 1000 == 0 or step < 1000
        ),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000, help="optimizer steps (default 10,000)")
    parser.add_argument("--frequency", type=int, default=10, help="steps between pruning events (default 10)")
    parser.add_argument("--warmup", type=int, default=100, help="the step whose RSS is the start (default 100)")
    parser.add_argument("--sample-every", type=int, default=250, help="RSS sampling interval in steps")
    parser.add_argument("--no-pruning", action="store_true", help="the same fit without PruningCallback (baseline)")
    parser.add_argument("--json", type=Path, help="write the figures to this JSON file")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as log_dir:
        result = run(args.steps, args.frequency, args.warmup, args.sample_every, not args.no_pruning, Path(log_dir))
    print(summary(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
