"""Extra memory of a prune-finetune Lightning fit against the same dense fit: in-place masks and reparametrization.

A ``L x Linear(H, H)`` MLP without bias (8 x 4096: 134M weights) trains with Adam on random data, one torch thread.
``PruningCallback(Constant(0.9, at=EVENT), masking=...)`` prunes all its weights with one global L1 event after
``EVENT`` dense steps; training goes on for ``--after`` steps. Each arm (dense, in place, reparametrized) is a fresh
process, and the arms run in turn ``--repeats`` times.

Memory is the process's resident set (Linux ``/proc/self/status``), read by a callback that runs after the
PruningCallback: per optimizer step, the peak resident set during the step (``VmHWM``, reset through
``/proc/self/clear_refs`` when the step starts; the event runs at the end of its step, so the event step's peak
includes it) and the resident set when the step ends. torch allocates outside Python's heap, so ``tracemalloc``
would see none of it. Reported, in bytes per pruned weight, above the dense fit at the same step:

* **event peak**: the peak of the event's step (the event's one-off cost: masks, the selection's temporaries, and
  what the mode keeps afterwards);
* **steady state**: the resident set at the end of the last steps (medians), once the event's temporaries are gone.

Usage:
    python benchmarks/fit_memory.py                 # 134M weights, 3 repeats: a few minutes
    python benchmarks/fit_memory.py --quick         # 8 x Linear(512): seconds (smoke test)

Prints a Markdown table and writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # machine.py, also when a test loads this file
from machine import proc_status

ARMS = ("dense", "inplace", "reparametrize")


def run_arm(arm: str, layers: int, hidden: int, batch: int, event: int, after: int) -> dict[str, Any]:
    """One fit in this process; returns per-step peak and end resident sets (bytes)."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import Callback
    from torch import nn

    from lightprune import PruningCallback
    from lightprune.schedules import Constant

    torch.set_num_threads(1)
    torch.manual_seed(0)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(*(nn.Linear(hidden, hidden, bias=False) for _ in range(layers)))

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=1e-4)

    class Meter(Callback):
        """Peak and end resident set of every training step (runs after the PruningCallback's batch end)."""

        def __init__(self) -> None:
            self.peaks: list[int] = []
            self.ends: list[int] = []

        def on_train_batch_start(self, *args: Any) -> None:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")  # VmHWM := VmRSS

        def on_train_batch_end(self, *args: Any) -> None:
            self.peaks.append(proc_status("VmHWM"))
            self.ends.append(proc_status("VmRSS"))

    steps = event + after
    x = torch.randn(steps * batch, hidden)
    data = torch.utils.data.TensorDataset(x, torch.randn(steps * batch, hidden))
    loader = torch.utils.data.DataLoader(data, batch_size=batch)
    module = Module()
    meter = Meter()
    callbacks: list[Callback] = []
    if arm != "dense":
        callbacks.append(PruningCallback(Constant(0.9, at=event), unit="step", masking=arm, summary=False))
    trainer = pl.Trainer(
        max_steps=steps,
        callbacks=[*callbacks, meter],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
    )
    trainer.fit(module, train_dataloaders=loader)
    weights = sum(p.numel() for p in module.parameters())
    zeros = sum(int((p == 0).sum()) for p in module.parameters())
    return {"arm": arm, "weights": weights, "zeros": zeros, "peaks": meter.peaks, "ends": meter.ends}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # one fit, in this process
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--event", type=int, default=3, help="dense steps before the pruning event")
    parser.add_argument("--after", type=int, default=4, help="steps after the event")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="8 x Linear(512), one repeat")
    parser.add_argument("--render", type=Path, help="print the table of a JSON written earlier; run nothing")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "fit_memory.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.hidden, args.repeats = 512, 1
    shape = (args.layers, args.hidden, args.batch, args.event, args.after)
    if args.arm:
        print(json.dumps(run_arm(args.arm, *shape)))
        return 0

    if args.render:  # the table again from a JSON this script wrote
        saved = json.loads(args.render.read_text())
        print(render(saved["runs"], *saved["shape"])[0])
        return 0
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    for _ in range(args.repeats):
        for arm in ARMS:
            command = [sys.executable, __file__, "--arm", arm, "--layers", str(args.layers), "--hidden",
                       str(args.hidden), "--batch", str(args.batch), "--event", str(args.event), "--after",
                       str(args.after)]  # fmt: skip
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            runs[arm].append(json.loads(done.stdout.strip().splitlines()[-1]))
    text, table = render(runs, *shape)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"machine": platform.platform(), "shape": shape, "table": table, "runs": runs, "markdown": text}
    args.out.write_text(json.dumps(payload, indent=1))
    return 0


def render(
    runs: dict[str, list[dict[str, Any]]], layers: int, hidden: int, batch: int, event: int, after: int
) -> tuple[str, dict[str, Any]]:
    """The Markdown table and its figures (bytes per weight above the dense fit, medians over repeats)."""
    event_step = event - 1  # 0-based index of the step whose end runs the event
    steady = slice(event_step + 2, None)  # steps after the one following the event

    def extra(arm: str, pick: Any) -> float:
        """Median over repeats of (arm - dense, same repeat) in bytes per weight."""
        values = []
        for mine, dense in zip(runs[arm], runs["dense"], strict=True):
            values.append((pick(mine) - pick(dense)) / mine["weights"])
        return statistics.median(values)

    def event_peak(run: dict[str, Any]) -> float:
        return run["peaks"][event_step]

    def highest_from_event(arm: str) -> float:
        """The largest step peak above dense's same step, from the event's step on (median over repeats)."""
        values = []
        for mine, dense in zip(runs[arm], runs["dense"], strict=True):
            pairs = zip(mine["peaks"][event_step:], dense["peaks"][event_step:], strict=True)
            values.append(max(a - b for a, b in pairs) / mine["weights"])
        return statistics.median(values)

    def steady_state(run: dict[str, Any]) -> float:
        return statistics.median(run["ends"][steady])

    weights = runs["dense"][0]["weights"]
    lines = [
        f"| {layers} x Linear({hidden}), {weights / 1e6:.0f}M weights, Adam, batch {batch} | peak of the event's "
        "step | highest step peak from the event on | steady state (end of step) | zeros after fit |",
        "|---|---:|---:|---:|---:|",
    ]
    table: dict[str, Any] = {}
    for arm in ("inplace", "reparametrize"):
        peak, highest, rest = extra(arm, event_peak), highest_from_event(arm), extra(arm, steady_state)
        zeros = runs[arm][0]["zeros"]
        table[arm] = {
            "event_peak_bytes_per_weight": peak,
            "highest_peak_bytes_per_weight": highest,
            "steady_bytes_per_weight": rest,
            "zeros": zeros,
        }
        lines.append(
            f"| masking={arm!r} | {peak:.2f} B/weight | {highest:.2f} B/weight | {rest:.2f} B/weight "
            f"| {zeros / weights:.3f} |"
        )
    dense_steady = statistics.median(steady_state(r) for r in runs["dense"])
    dense_peak = statistics.median(max(r["peaks"]) for r in runs["dense"])
    lines.append(f"| dense fit (reference, absolute) | {dense_peak / 2**30:.2f} GiB peak | — "
                 f"| {dense_steady / 2**30:.2f} GiB resident | — |")  # fmt: skip
    return "\n".join(lines), table


if __name__ == "__main__":
    sys.exit(main())
