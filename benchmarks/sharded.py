"""Global pruning of a sharded model: histograms all-reduced vs gathering every full tensor, world size 2 (gloo).

Each rank holds its ``Shard(0)`` half of ``--tensors`` weights of ``--rows x --cols`` (DTensors built from local
shards: no rank ever materializes a full tensor in the sharded approach). Per event (global L1 to ``0.5`` then to
``0.8`` of all weights, the second on top of the first's masks) it measures on every rank:

* ``sharded``: :func:`lightprune.prune.distributed.sharded_unstructured_masks` (local histograms summed with
  ``all_reduce``, ties split by global flat index);
* ``gather``: the gather-everything approach: ``full_tensor()`` of every weight and every current mask on every
  rank, one-process global selection over the full tensors, then each rank keeps its rows;
* ``single``: rank 0 alone running the one-process selection over the gathered full tensors (the reference for
  "event time at most 2x a single-process global prune of the same total size"), the other rank idle;

with the wall time, the bytes each rank hands to collectives, and the peak resident memory above the rank's
resident size before the event (sampled every millisecond, after ``malloc_trim`` returned freed heap pages). Both
approaches' masks are checked equal. Then the training-step overhead of in-place masking on the shards: an SGD step
(momentum) over the local shards with and without zeroing the pruned gradient and weight entries (what the callback
adds to a step; forward and backward, which it does not touch, are left out). Last, ``criteria``: one global event
to 50% ranked by activation (Wanda) scores and one by movement scores, with what their statistics cost (bytes per
collected batch, bytes per local weight) and the event's time against rank 0 alone on the gathered scores, and one
layerwise OBS event to 50% with the SparseGPT update on ``--obs-tensors`` of the weights (each rank its own rows)
against rank 0 alone running the one-process event on the gathered weights.

Run: ``python benchmarks/sharded.py --out benchmarks/results/sharded_cpu_268M.json`` (defaults: 16 weights of
4096 x 4096 = 268M, float32, one thread per rank).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _trim() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the measure may miss reused memory
        pass


class PeakRSS:
    """Peak resident memory above the level at entry, sampled every millisecond in a thread."""

    def __enter__(self) -> PeakRSS:
        _trim()  # hand freed heap pages back first: memory reused from earlier phases would not show in the RSS
        self.base = _rss()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.001)

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())

    @property
    def extra(self) -> int:
        return self.peak - self.base


def _one_process_masks(
    fulls: list[torch.Tensor], current: list[torch.Tensor | None], amount: float, magnitude: bool = True
) -> list:
    """The one-process global selection over full tensors (what ``global_unstructured`` runs), bool masks: by
    magnitude (L1), or by signed value (movement scores)."""
    from lightprune.prune.amount import _compute_nparams_toprune
    from lightprune.prune.k_smallest import apply_cut, count_eligible, find_cut

    available = count_eligible(current, fulls)
    k = _compute_nparams_toprune(amount, available)
    cut = find_cut(fulls, k, eligible=current, magnitude=magnitude)
    masks = [torch.empty(t.shape, dtype=torch.bool) for t in fulls]
    apply_cut(fulls, cut, out=masks, eligible=current, base=current, magnitude=magnitude)
    return masks


def _criteria_events(rank: int, world: int, weights: list, args: argparse.Namespace) -> dict[str, Any]:
    """One global event to 50% ranked by activation (Wanda) and one by movement scores, as the callback runs them on
    shards: the statistics' traffic (activation: one all-reduce of every layer's ``cols`` sums per collected batch;
    movement: none, each rank sums ``-W * grad`` on its own shard), their memory per local weight, and the event's
    time, bytes and extra peak against rank 0 alone on the gathered tensors (masks checked equal)."""
    from lightprune.prune import distributed as D

    generator = torch.Generator().manual_seed(7 + rank)
    local_weights = sum(w.to_local().numel() for w in weights)
    total = args.tensors * args.rows * args.cols
    rows: dict[str, Any] = {}
    for criterion in ("activation", "movement"):
        row: dict[str, Any] = {}
        dist.barrier()
        D.traffic.bytes = D.traffic.calls = 0
        if criterion == "activation":  # a batch's sums of squares per input feature, summed across ranks
            sums = torch.rand(args.tensors * args.cols + args.tensors, generator=generator)
            sums = D._all_reduce(sums, None)
            row["statistics_bytes_per_batch"] = D.traffic.bytes
            row["statistics_bytes_per_local_weight"] = (sums.numel() * 4) / local_weights
            norms = sums[: args.tensors * args.cols].view(args.tensors, args.cols).sqrt()
            scores = [w.to_local().abs().float() * n[None] for w, n in zip(weights, norms, strict=True)]
        else:  # the running sum -W * grad of the shard: float32, one per local weight, no traffic
            scores = [-(w.to_local().float() * torch.randn(w.to_local().shape, generator=generator)) for w in weights]
            row["statistics_bytes_per_batch"] = 0
            row["statistics_bytes_per_local_weight"] = 4.0
        signed = criterion == "movement"
        dist.barrier()
        D.traffic.bytes = D.traffic.calls = 0
        with PeakRSS() as mem:
            start = time.perf_counter()
            new = D.sharded_unstructured_masks(weights, round(0.5 * total), importance_scores=scores, signed=signed)
            row["seconds"] = time.perf_counter() - start
        row["event_bytes"] = D.traffic.bytes
        row["extra_peak_bytes_per_local_weight"] = mem.extra / local_weights
        full_scores = [D.as_dtensor(s, w).full_tensor() for s, w in zip(scores, weights, strict=True)]
        dist.barrier()
        if rank == 0:
            start = time.perf_counter()
            reference = _one_process_masks(full_scores, [None] * len(weights), round(0.5 * total), not signed)
            row["single_seconds"] = time.perf_counter() - start
            pairs = zip(new, reference, weights, strict=True)
            row["masks_equal"] = all(torch.equal(m, D.local_part(r, w)) for m, r, w in pairs)
        del full_scores
        dist.barrier()
        rows[criterion] = row
    return rows


def _obs_event(rank: int, world: int, weights: list, args: argparse.Namespace) -> dict[str, Any]:
    """One layerwise OBS event to 50% with the SparseGPT update on ``--obs-tensors`` of the shards, as the callback
    runs it (:func:`lightprune.callback.reconstruction.reconstruct_sharded`: each rank its own rows, the block
    selection ranked across ranks): the statistics' cost (one all-reduce of each ``cols x cols`` ``H`` per collected
    batch, the same ``H`` held on every rank), the event's time, bytes and extra peak, against rank 0 alone running
    the one-process event (:func:`~lightprune.callback.reconstruction.reconstruct`) on the gathered weights; masks
    and updated weights compared."""
    from torch import nn

    from lightprune.callback.reconstruction import reconstruct, reconstruct_sharded
    from lightprune.prune import distributed as D

    chosen = weights[: args.obs_tensors]
    local_weights = sum(w.to_local().numel() for w in chosen)
    generator = torch.Generator().manual_seed(11)  # the same H on every rank, as the all-reduce leaves it
    hessians = {}
    for i in range(len(chosen)):
        x = torch.randn(2 * args.cols, args.cols, generator=generator)
        hessians[f"w{i}"] = x.t() @ x
        del x
    row: dict[str, Any] = {"tensors": len(chosen)}
    dist.barrier()
    D.traffic.bytes = D.traffic.calls = 0
    D._all_reduce(hessians["w0"].clone(), None)  # what one layer's H costs per collected batch
    row["statistics_bytes_per_batch"] = D.traffic.bytes * len(chosen)
    row["statistics_bytes_per_local_weight"] = sum(h.numel() * 4 for h in hessians.values()) / local_weights
    fulls = [w.full_tensor() for w in chosen]  # the weights before the event, for the one-process reference

    def linear(weight: torch.Tensor) -> nn.Module:
        layer = nn.Linear(args.cols, args.rows, bias=False, device="meta")
        layer.weight = nn.Parameter(weight)
        return layer

    modules = {f"w{i}": linear(D.as_dtensor(w.to_local().clone(), w)) for i, w in enumerate(chosen)}
    triples = [(q, m, "weight") for q, m in modules.items()]
    masks: dict[Any, torch.Tensor] = {}
    dist.barrier()
    D.traffic.bytes = D.traffic.calls = 0
    with PeakRSS() as mem:
        start = time.perf_counter()
        reconstruct_sharded(triples, lambda m, n: masks.get(m), 0.5, "layerwise", hessians.__getitem__,
                            lambda m, n, keep: masks.__setitem__(m, keep))  # fmt: skip
        row["seconds"] = time.perf_counter() - start
    row["event_bytes"] = D.traffic.bytes
    row["extra_peak_bytes_per_local_weight"] = mem.extra / local_weights
    got_masks = [D.as_dtensor(masks[m], m.weight).full_tensor() for m in modules.values()]
    got_weights = [m.weight.full_tensor() for m in modules.values()]
    dist.barrier()
    if rank == 0:
        reference = {q: linear(f.clone()) for q, f in zip(modules, fulls, strict=True)}
        start = time.perf_counter()
        reconstruct([(q, m, "weight") for q, m in reference.items()], lambda m, n: getattr(m, n + "_mask", None), 0.5,
                    "layerwise", hessians.__getitem__)  # fmt: skip
        row["single_seconds"] = time.perf_counter() - start
        want = list(reference.values())
        row["masks_equal"] = all(torch.equal(g, m.weight_mask.bool()) for g, m in zip(got_masks, want, strict=True))
        differences = [
            float((g.detach() - m.weight.detach()).abs().max()) for g, m in zip(got_weights, want, strict=True)
        ]
        row["weights_equal"] = max(differences) == 0.0
        row["max_weight_difference"] = max(differences)
    dist.barrier()
    return row


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from lightprune.prune import distributed as D
    from lightprune.prune.masking import masked_

    mesh = init_device_mesh("cpu", (world,))
    rows = -(-args.rows // world)
    local_rows = max(0, min(rows, args.rows - rank * rows))
    generator = torch.Generator().manual_seed(1000 + rank)
    dtype = getattr(torch, args.dtype)
    stride = (args.cols, 1)
    weights = [
        DTensor.from_local(
            torch.randn(local_rows, args.cols, generator=generator).to(dtype),
            mesh,
            [Shard(0)],
            shape=torch.Size((args.rows, args.cols)),
            stride=stride,
        )
        for _ in range(args.tensors)
    ]
    local_weights = sum(w.to_local().numel() for w in weights)
    report: dict[str, Any] = {"rank": rank, "local_weights": local_weights, "events": []}
    current: list[torch.Tensor | None] = [None] * len(weights)
    for amount_total in (0.5, 0.8):
        event: dict[str, Any] = {"target": amount_total}
        pruned = 0 if current[0] is None else sum(int((~m).sum()) for m in current)
        pruned = int(D._all_reduce(torch.tensor([pruned]), None)[0])
        total = args.tensors * args.rows * args.cols
        increment = round(amount_total * total) - pruned

        # --- sharded: histograms summed across ranks ---
        dist.barrier()
        D.traffic.bytes = D.traffic.calls = 0
        with PeakRSS() as mem:
            start = time.perf_counter()
            new = D.sharded_unstructured_masks(weights, increment, current=current)
            seconds = time.perf_counter() - start
        event["sharded"] = {
            "seconds": seconds,
            "bytes": D.traffic.bytes,
            "calls": D.traffic.calls,
            "extra_peak_bytes": mem.extra,
            "extra_bytes_per_local_weight": mem.extra / local_weights,
        }

        # --- gather everything: full tensors (and current masks) on every rank ---
        dist.barrier()
        with PeakRSS() as mem:
            start = time.perf_counter()
            fulls = [w.full_tensor() for w in weights]
            full_current = [
                None if c is None else D.as_dtensor(c, w).full_tensor() for c, w in zip(current, weights, strict=True)
            ]
            gathered_bytes = sum(w.to_local().numel() * w.element_size() * (world - 1) for w in weights)
            gathered_bytes += sum(0 if c is None else c.numel() * (world - 1) for c in current)
            full_masks = _one_process_masks(fulls, full_current, increment)
            mine = [D.local_part(m, w) for m, w in zip(full_masks, weights, strict=True)]
            seconds = time.perf_counter() - start
        event["gather"] = {
            "seconds": seconds,
            "bytes": gathered_bytes,
            "extra_peak_bytes": mem.extra,
            "extra_bytes_per_local_weight": mem.extra / local_weights,
        }
        event["masks_equal"] = all(torch.equal(a, b) for a, b in zip(new, mine, strict=True))
        del full_masks, mine

        # --- one process over the same total size (rank 0 alone) ---
        dist.barrier()
        if rank == 0:
            start = time.perf_counter()
            _one_process_masks(fulls, full_current, increment)
            event["single_seconds"] = time.perf_counter() - start
        del fulls, full_current
        dist.barrier()
        current = new
        report["events"].append(event)

    # --- training-step overhead of in-place masking: an SGD step on the local shards, with and without masking ---
    params = [torch.nn.Parameter(w.to_local().clone()) for w in weights]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.SGD(params, lr=0.01, momentum=0.9)
    optimizer.step()
    timings: dict[str, float] = {}
    for masked in (False, True, False, True):
        start = time.perf_counter()
        for _ in range(args.steps):
            if masked:
                for p, m in zip(params, current, strict=True):
                    masked_(p.grad, m)
            optimizer.step()
            if masked:
                with torch.no_grad():
                    for p, m in zip(params, current, strict=True):
                        masked_(p, m)
        key = "masked" if masked else "plain"
        timings[key] = min(timings.get(key, float("inf")), (time.perf_counter() - start) / args.steps)
    report["step_seconds"] = timings
    report["criteria"] = _criteria_events(rank, world, weights, args)
    if args.obs_tensors:
        report["criteria"]["obs"] = _obs_event(rank, world, weights, args)
    results[rank] = report
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--obs-tensors", type=int, default=2, help="weights of the OBS event (0: none)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    world = 2
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    manager = mp.Manager()
    results = manager.dict()
    mp.start_processes(_worker, args=(world, port, args, results), nprocs=world, start_method="spawn")
    out = {
        "config": {**vars(args), "out": None, "world": world, "total_weights": args.tensors * args.rows * args.cols},
        "torch": torch.__version__,
        "device": "cpu",
        "ranks": [results[r] for r in range(world)],
    }
    text = json.dumps(out, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
