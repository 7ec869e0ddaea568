"""lightprune.prune against torch.nn.utils.prune: wall time and extra peak memory, side by side in one run.

Every measurement runs in a fresh Python process (``--case``), so one case's allocations never flatter another's,
and is repeated (median). Models are ``L x Linear(4096, 4096)`` without bias (16.8M weights a layer). Weights are
tie-free (distinct magnitudes) wherever torch also runs, and the benchmark checks that lightprune's masks equal
torch's (a SHA-256 of each mask); the 1B row uses random normal weights and lightprune alone.

Memory is the process's peak resident set during the call minus its resident set just before it (Linux
``/proc/self/clear_refs`` resets the peak), so it includes the pruned copy ``weight = weight_orig * mask`` the
reparametrization keeps. On CUDA it is ``torch.cuda.max_memory_allocated`` minus the allocation before the call.

Usage:
    python benchmarks/engine.py                  # the full table (34M, 134M, 268M, 1B): tens of minutes
    python benchmarks/engine.py --quick          # tiny sizes, one repetition: well under a minute
    python benchmarks/engine.py --device cuda    # the same on a GPU (each case warms its kernels up first)
    python benchmarks/engine.py --train-only     # the training-step rows alone
    python benchmarks/engine.py --sizes 134M,2000x224 --ops global_l1,callback_event --torch-sizes 134M --busy
                                                 # global L1 while a busy loop runs on every core
    python benchmarks/engine.py --render benchmarks/results/engine.json   # a saved run's tables again

Times are medians over rounds with their range; speed-ups are medians (and ranges) of per-round ratios: the cases of
a size run interleaved, a round of every case and then the next, and so do the training steps.

Sizes: ``34M``... ``1B`` are ``L x Linear(4096, 4096)``; ``2000x224`` is 1,000 ``Linear(224, 224)`` whose weights and
biases are pruned together (2,000 tensors, 50M entries): the per-tensor costs. Two read passes are timed as the
yardsticks: ``sum |w|`` (``w.abs().sum()``, a temporary per tensor: the reference of earlier tables) and
``vector_norm(w, 1)`` (``torch.linalg.vector_norm``: one fused pass, no temporary, the honest lower bound).

Writes a Markdown table to stdout and JSON to ``--out`` (default ``benchmarks/results/engine.json``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # machine.py, also when a test loads this file
from machine import proc_status

HIDDEN = 4096
LAYERS_FOR_SIZE = {"34M": 2, "134M": 8, "268M": 16, "1B": 60}
#: Many small tensors: 1,000 Linear(224, 224), weights and biases pruned (2,000 tensors).
SMALL_SIZE, SMALL_LAYERS, SMALL_HIDDEN = "2000x224", 1000, 224
QUICK_LAYERS = {"2M": 2}
QUICK_HIDDEN = 1024


# ------------------------------------------------------------------------------------------------------------------
# One case, in its own process
# ------------------------------------------------------------------------------------------------------------------


class _Memory:
    """Extra peak memory of a block: host RSS (CPU) or CUDA allocations."""

    def __init__(self, device: str) -> None:
        self.device = device

    def __enter__(self) -> _Memory:
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.before = torch.cuda.memory_allocated()
        else:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")  # reset VmHWM to the current RSS
            self.before = proc_status("VmRSS")
        self.started = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()
        self.seconds = time.perf_counter() - self.started
        if self.device == "cuda":
            self.extra = torch.cuda.max_memory_allocated() - self.before
        else:
            self.extra = proc_status("VmHWM") - self.before


def _tie_free_(weight: Any, generator: Any, offset: int) -> None:
    """Fill ``weight`` with distinct magnitudes in random order (consecutive float32 bit patterns, random signs).

    ``offset`` shifts the bit patterns, so layers filled with offsets ``0, n, 2n, ...`` share no magnitude: the
    model is tie-free across layers too, as global pruning needs for a mask comparison with torch.
    """
    import torch

    n = weight.numel()
    base = torch.tensor(1e-3, dtype=torch.float32).view(torch.int32).item() + offset
    bits = torch.randperm(n, generator=generator, dtype=torch.int32, device=weight.device).add_(base)
    values = bits.view(torch.float32)
    signs = torch.randint(0, 2, (n,), generator=generator, dtype=torch.int8, device=weight.device)
    values[signs.bool()] *= -1
    weight.copy_(values.view_as(weight))


def _model(layers: int, hidden: int, device: str, tie_free: bool, seed: int, bias: bool = False) -> Any:
    import torch

    # Filled where it runs: on a GPU from the GPU's generator (a fill on the CPU and a copy would cost more than
    # the operations timed), so the values differ between devices, never between the implementations on one.
    generator = torch.Generator(device).manual_seed(seed)
    with torch.device("meta"):
        model = torch.nn.Sequential(*(torch.nn.Linear(hidden, hidden, bias=bias) for _ in range(layers)))
    model = model.to_empty(device=device)
    with torch.no_grad():
        offset = 0
        for module, name in _pairs(model):
            tensor = getattr(module, name)
            if tie_free:
                _tie_free_(tensor, generator, offset=offset)
            else:
                tensor.normal_(generator=generator)
            offset += tensor.numel()
    return model


def _pairs(model: Any) -> list[tuple[Any, str]]:
    """The pruned tensors: every layer's weight, and its bias where it has one."""
    return [(layer, name) for layer in model for name in ("weight", "bias") if getattr(layer, name, None) is not None]


def _fingerprint(model: Any) -> str:
    import torch

    digest = hashlib.sha256()
    for layer, name in _pairs(model):
        mask = getattr(layer, name + "_mask", None)
        if mask is None:
            continue
        digest.update((mask != 0).to(torch.uint8).cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def _callback_event(model: Any, inplace: bool) -> Any:
    """What a PruningCallback event does for global L1 at 90%, Lightning's clock aside: the selection's event
    (counting, the engine call, putting masks in place) and the sparsities it logs (a torchmetrics collection)."""
    import torch

    from lightprune.callback.masked_selection import MaskedSelection
    from lightprune.callback.reporting import sparsities
    from lightprune.prune import L1Unstructured

    triples = [(f"{i}.{name}", module, name) for i, (module, name) in enumerate(_pairs(model))]
    masked = MaskedSelection(triples, [], [], L1Unstructured, {}, "global", torch.bool, 0, inplace=inplace)

    sparsities({"warm-up": torch.ones(1, dtype=torch.bool)}, "", torch.device("cpu"))  # first-call costs: not timed

    def event() -> None:
        masked.prune_to(0.9, event=0)
        current = {q: masked.mask(m, n) for q, m, n in masked.selection}
        sparsities(current, "pruning/sparsity/", torch.device("cpu"))

    return event


def _operate(api: Any, op: str, pairs: list[tuple[Any, str]], amount: float) -> float:
    """Run ``op`` with ``api`` (lightprune.prune or torch.nn.utils.prune) on ``pairs``; the read passes' sum, else 0.

    ``amount`` serves the global calls (0.9 for ``global_l1``, 0.5 for a repeated call); the layerwise operations
    keep the table's fixed amounts.
    """
    import torch

    if op == "read":
        return sum(float(getattr(m, n).abs().sum()) for m, n in pairs)
    if op == "read_fused":
        with torch.no_grad():
            return sum(float(torch.linalg.vector_norm(getattr(m, n), 1)) for m, n in pairs)
    if op == "global_l1" or op.startswith("repeat"):
        api.global_unstructured(pairs, pruning_method=api.L1Unstructured, amount=amount)
    elif op == "l1_layerwise":
        for module, name in pairs:
            api.l1_unstructured(module, name, amount=0.9)
    elif op == "ln_structured":
        for module, name in pairs:
            api.ln_structured(module, name, amount=0.5, n=2, dim=0)
    elif op == "random_structured":
        for module, name in pairs:
            api.random_structured(module, name, amount=0.5, dim=0)
    elif op == "random_unstructured":
        for module, name in pairs:
            api.random_unstructured(module, name, amount=0.9)
    else:
        raise ValueError(f"unknown op {op!r}")
    return 0.0


def run_case(spec: dict[str, Any]) -> dict[str, Any]:
    """Build the model, run one operation under the meter, and report time, memory and the masks' fingerprint."""
    import torch
    import torch.nn.utils.prune as torch_prune

    from lightprune import prune as lightprune

    torch.set_num_threads(int(spec.get("threads", torch.get_num_threads())))
    device = spec["device"]
    model = _model(spec["layers"], spec["hidden"], device, spec["tie_free"], spec["seed"], spec.get("bias", False))
    impl = spec["impl"]
    api = torch_prune if impl == "torch" else lightprune
    if impl == "lightprune-bool":
        lightprune.set_mask_dtype(torch.bool)
    pairs = _pairs(model)
    op = spec["op"]
    torch.manual_seed(spec["seed"])
    event = _callback_event(model, op.endswith("inplace")) if op.startswith("callback_event") else None

    if op.startswith("repeat"):  # the second or third global call on already pruned weights
        for _ in range(int(op[-1]) - 1):
            _operate(api, "global_l1", pairs, amount=0.5)
    if device == "cuda" and event is None:
        # The first call of a kernel in a process loads it (and cuBLAS/cuRAND set up): do that on a tiny model of
        # the same layers, so the timed call measures the pruning, for both libraries alike.
        tiny = _model(2, 64, device, False, spec["seed"], spec.get("bias", False))
        _operate(api, op, _pairs(tiny), amount=0.9 if op == "global_l1" else 0.5)
        torch.manual_seed(spec["seed"])
    with _Memory(device) as meter:
        if event is not None:
            event()
        else:
            total = _operate(api, op, pairs, amount=0.9 if op == "global_l1" else 0.5)
    result = {
        "seconds": meter.seconds,
        "extra_bytes": meter.extra,
        "weights": sum(p.numel() for p in model.parameters()),
        "tensors": len(pairs),
    }
    if op.startswith("read"):
        result["checksum"] = total
    elif spec.get("fingerprint") and not op.startswith(("random", "callback")):
        result["fingerprint"] = _fingerprint(model)
    return result


def run_training_case(spec: dict[str, Any]) -> dict[str, Any]:
    """Median time of forward + backward + optimizer step of a 4 x Linear(2048, 2048) MLP, batch 64, pruned to 90%
    after three dense steps (the dense rows: never pruned)."""
    import torch
    import torch.nn.utils.prune as torch_prune

    from lightprune import prune as lightprune

    torch.set_num_threads(int(spec.get("threads", torch.get_num_threads())))
    torch.manual_seed(0)
    device = spec["device"]
    width, depth, batch = spec.get("width", 2048), 4, 64
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers).to(device)
    pairs = [(m, "weight") for m in model if isinstance(m, torch.nn.Linear)]
    impl = spec["impl"]
    if spec.get("optimizer", "sgd") == "adam":
        optimizer: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    x = torch.randn(batch, width, device=device)
    target = torch.randn(batch, width, device=device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), target)
        loss.backward()
        optimizer.step()

    # Prune a model in training, as a schedule does: after dense steps, so the optimizer state of the pruned
    # weights is not all zeros (with Adam, torch's CPU sqrt of exact zeros is several times slower than of other
    # values, which would charge a kernel quirk to the reparametrization).
    for _ in range(3):
        step()
    if impl == "torch":
        torch_prune.global_unstructured(pairs, pruning_method=torch_prune.L1Unstructured, amount=0.9)
    elif impl.startswith("lightprune"):
        with lightprune.mask_dtype(torch.bool if impl == "lightprune-bool" else None):
            lightprune.global_unstructured(pairs, pruning_method=lightprune.L1Unstructured, amount=0.9)
    for _ in range(3):
        step()
    times = []
    for _ in range(spec.get("steps", 20)):
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return {"seconds": statistics.median(times)}


# ------------------------------------------------------------------------------------------------------------------
# The driver: fresh processes, repetitions, the table
# ------------------------------------------------------------------------------------------------------------------


def _spawn(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    command = [sys.executable, __file__, "--case", json.dumps(spec)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["?"]
        return {"error": f"exit {done.returncode}: {tail[0][:200]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median time and memory of a case's processes (in the order they ran: ``runs`` pairs with other cases')."""
    good = [r for r in runs if "error" not in r]
    if not good:
        return {"error": runs[0]["error"]}
    out: dict[str, Any] = {
        "seconds": statistics.median(r["seconds"] for r in good),
        "runs": [r.get("seconds") for r in runs],  # None where a process failed: rounds stay paired
    }
    if "extra_bytes" in good[0]:
        out["extra_bytes"] = statistics.median(r["extra_bytes"] for r in good)
        out["weights"] = good[0]["weights"]
        out["tensors"] = good[0]["tensors"]
    for key in ("fingerprint", "checksum"):
        if key in good[0]:
            out[key] = good[0][key]
    return out


def _fmt_seconds(value: float | None) -> str:
    return "—" if value is None else (f"{value:.3f} s" if value < 10 else f"{value:.1f} s")


def _fmt_time(row: dict[str, Any]) -> str:
    """The median time, with the range over rounds when there were several."""
    if "error" in row:
        return f"failed: {row['error']}"
    runs = [r for r in row.get("runs", []) if r is not None]
    if len(runs) < 2:
        return _fmt_seconds(row.get("seconds"))
    return f"{_fmt_seconds(row['seconds'])} ({_fmt_seconds(min(runs))} – {_fmt_seconds(max(runs))})"


def _fmt_bpw(result: dict[str, Any]) -> str:
    if "extra_bytes" not in result:
        return "—"
    return f"{result['extra_bytes'] / 2**30:.2f} GB ({result['extra_bytes'] / result['weights']:.1f} B/w)"


def _start_busy_loops() -> list[subprocess.Popen[bytes]]:
    """One Python busy loop per core, for as long as the benchmark runs (another job keeping the machine busy)."""
    command = [sys.executable, "-c", "while True: pass"]
    return [subprocess.Popen(command) for _ in range(os.cpu_count() or 1)]


def _run_all(
    args: argparse.Namespace,
    sizes: dict[str, int],
    hidden: int,
    repeats: int,
    torch_sizes: set[str],
    all_ops: set[str],
    threads: dict[str, int],
) -> list[dict[str, Any]]:
    """Every case of every size; the cases of one size run interleaved (a round of each case, then the next round),
    so that a machine whose speed drifts slows them alike."""
    rows: list[dict[str, Any]] = []
    ops = ["global_l1", "l1_layerwise", "ln_structured", "random_structured", "random_unstructured"]
    wanted = None if args.ops is None else set(args.ops.split(","))

    def report(row: dict[str, Any]) -> None:
        print(
            f"  {row['size']:>8} {row['op']:<22} {row['impl']:<16} {_fmt_seconds(row.get('seconds')):>9}  "
            f"{_fmt_bpw(row)}  {row.get('error', '')}",
            file=sys.stderr,
            flush=True,
        )

    for size, layers in sizes.items():
        with_torch = size in torch_sizes
        small = size == SMALL_SIZE
        base = {
            "layers": layers,
            "hidden": SMALL_HIDDEN if small else hidden,
            "bias": small,
            "device": args.device,
            "tie_free": with_torch,
            "fingerprint": with_torch,
            **threads,
        }
        cases: list[tuple[str, str, dict[str, Any]]] = [
            ("read", "sum |w|", {**base, "op": "read", "impl": "lightprune"}),
            ("read_fused", "vector_norm(w, 1)", {**base, "op": "read_fused", "impl": "lightprune"}),
        ]
        size_ops = ops if size in all_ops else ["global_l1"]
        if small:
            size_ops = ["global_l1", "callback_event", "callback_event_inplace"]
        for op in size_ops:
            if wanted is not None and op not in wanted:
                continue
            impls = ["lightprune", "lightprune-bool"] + (["torch"] if with_torch else [])
            if size == "1B" or op.startswith("callback"):
                impls = ["lightprune-bool"]
            cases += [(op, impl, {**base, "op": op, "impl": impl}) for impl in impls]
        if size in ("134M", "2M") and (wanted is None or "repeat" in wanted):
            cases += [
                (op, "lightprune-bool", {**base, "op": op, "impl": "lightprune-bool"}) for op in ("repeat2", "repeat3")
            ]
        runs: list[list[dict[str, Any]]] = [[] for _ in cases]
        for _ in range(repeats):
            for (_, _, spec), done in zip(cases, runs, strict=True):
                done.append(_spawn({**spec, "seed": spec.get("seed", 0)}, args.timeout))
        for (op, impl, _), done in zip(cases, runs, strict=True):
            row = {"size": size, "op": op, "impl": impl, **_summarise(done)}
            rows.append(row)
            report(row)
    train_base = {"op": "train", "device": args.device, "width": 512 if args.quick else 2048, **threads}
    train_cases = [
        (optimizer, impl, {**train_base, "impl": impl, "optimizer": optimizer, "steps": 10 if args.quick else 30})
        for optimizer in (() if args.no_train else ("sgd", "adam"))
        for impl in ("dense", "lightprune-bool", "lightprune", "torch")
    ]
    # Interleaved as the pruning cases: a round of every training case, then the next round.
    train_runs: list[list[dict[str, Any]]] = [[] for _ in train_cases]
    for _ in range(repeats):
        for (_, _, spec), done in zip(train_cases, train_runs, strict=True):
            done.append(_spawn({**spec, "seed": spec.get("seed", 0)}, args.timeout))
    for (optimizer, impl, spec), done in zip(train_cases, train_runs, strict=True):
        row = {"size": "MLP", "op": f"train_step_{optimizer}", "impl": impl, "width": spec["width"], **_summarise(done)}
        rows.append(row)
        report(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 1 repetition (smoke test)")
    parser.add_argument(
        "--sizes", default="34M,134M,268M,1B,2000x224", help="comma-separated: 34M,134M,268M,1B,2000x224"
    )
    parser.add_argument("--torch-sizes", default="34M,134M,268M,2000x224", help="sizes at which torch runs too")
    parser.add_argument(
        "--all-ops-sizes", default="34M,134M", help="sizes with every operation; the others run read + global L1"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads per process (default: torch's)")
    parser.add_argument("--ops", default=None, help="only these operations (comma-separated), e.g. ln_structured")
    parser.add_argument("--no-train", action="store_true", help="skip the training-step rows")
    parser.add_argument("--train-only", action="store_true", help="only the training-step rows (no pruning sizes)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per process")
    parser.add_argument(
        "--busy",
        action="store_true",
        help="keep every core busy (one Python busy loop per core) while the cases run; use torch's default threads",
    )
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "engine.json"))
    parser.add_argument("--render", metavar="JSON", help="print the tables of a saved result file and exit")
    args = parser.parse_args(argv)
    operations = ("global_l1", "l1_layerwise", "ln_structured", "random_structured", "random_unstructured",
                  "callback_event", "callback_event_inplace", "repeat")  # fmt: skip
    unknown_ops = [op for op in (args.ops or "").split(",") if op and op not in operations]
    if unknown_ops:  # a typo would otherwise run the read passes alone and exit 0
        parser.error(f"--ops: {', '.join(unknown_ops)} not among {', '.join(operations)}")

    if args.render:
        print(render(json.loads(Path(args.render).read_text())["rows"]))
        return 0

    if args.case:
        spec = json.loads(args.case)
        result = run_training_case(spec) if spec["op"].startswith("train") else run_case(spec)
        print(json.dumps(result))
        return 0

    if args.quick:
        sizes, hidden, repeats = {**QUICK_LAYERS, SMALL_SIZE: 20}, QUICK_HIDDEN, 1
        torch_sizes = all_ops = set(QUICK_LAYERS)
    else:
        known = [*LAYERS_FOR_SIZE, SMALL_SIZE]
        unknown = [s for s in args.sizes.split(",") if s not in known]
        if unknown:
            parser.error(f"--sizes: {', '.join(unknown)} not among {', '.join(known)}")
        sizes = {s: SMALL_LAYERS if s == SMALL_SIZE else LAYERS_FOR_SIZE[s] for s in args.sizes.split(",")}
        hidden, repeats = HIDDEN, args.repeats
        torch_sizes = set(args.torch_sizes.split(","))
        all_ops = set(args.all_ops_sizes.split(","))
    if args.train_only:
        if args.no_train:
            parser.error("--train-only and --no-train leave nothing to run")
        sizes = {}
    threads = {} if args.threads is None else {"threads": args.threads}
    busy = _start_busy_loops() if args.busy else []
    try:
        rows = _run_all(args, sizes, hidden, repeats, torch_sizes, all_ops, threads)
    finally:
        for process in busy:
            process.kill()
            process.wait()

    table = render(rows)
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    machine = {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "device": args.device,
    }
    try:
        import torch

        machine["torch"] = torch.__version__
        if args.device == "cuda":
            machine["gpu"] = torch.cuda.get_device_name()
    except ImportError:  # pragma: no cover
        pass
    out.write_text(json.dumps({"machine": machine, "rows": rows, "table": table}, indent=2))
    mismatches = [r for r in rows if r.get("mask_match") is False]
    return 1 if mismatches else 0


def _find(rows: list[dict[str, Any]], size: str, op: str, impl: str) -> dict[str, Any] | None:
    return next((r for r in rows if r["size"] == size and r["op"] == op and r["impl"] == impl), None)


def _ratios(row: dict[str, Any], other: dict[str, Any] | None) -> list[float]:
    """``row``'s time / ``other``'s time in each round (the cases ran interleaved), rounds where either failed left out.

    Example:
        >>> _ratios({"runs": [2.0, None, 3.0]}, {"runs": [1.0, 1.0, 2.0]})
        [2.0, 1.5]
    """
    if other is None or "runs" not in row or "runs" not in other:
        return []
    return [a / b for a, b in zip(row["runs"], other["runs"], strict=False) if a is not None and b]


def _paired(row: dict[str, Any], other: dict[str, Any] | None) -> float | None:
    """Median over rounds of ``row``'s time / ``other``'s time in the same round (the cases ran interleaved)."""
    ratios = _ratios(row, other)
    return statistics.median(ratios) if ratios else None


def _times(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}×"


def _times_range(ratios: list[float]) -> str:
    """The median of per-round ratios, with their range when there were several rounds."""
    if not ratios:
        return "—"
    median = statistics.median(ratios)
    return _times(median) if len(ratios) < 2 else f"{median:.1f}× ({min(ratios):.1f}–{max(ratios):.1f}×)"


def render(rows: list[dict[str, Any]]) -> str:
    """The Markdown tables: one line per (size, operation, implementation), with ratios to torch and to both read
    passes (medians of per-round ratios); then the per-tensor costs over the many small tensors."""
    lines = [
        "| size | operation | implementation | time, median (range) | extra peak memory "
        "| speed-up vs torch, median (range) | time / sum abs | time / fused read | masks = torch |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if row["op"].startswith("train_step"):
            continue
        torch_row = _find(rows, row["size"], row["op"], "torch")
        read_row = _find(rows, row["size"], "read", "sum |w|")
        fused_row = _find(rows, row["size"], "read_fused", "vector_norm(w, 1)")
        speedup = match = "—"
        if torch_row and "seconds" in torch_row and "seconds" in row and row["impl"] != "torch":
            speedup = _times_range(_ratios(torch_row, row))
        reading = row["op"].startswith("read")
        ratio = "—" if reading else _times(_paired(row, read_row))
        fused = "—" if reading else _times(_paired(row, fused_row))
        if torch_row and "fingerprint" in row and "fingerprint" in torch_row and row["impl"] != "torch":
            row["mask_match"] = row["fingerprint"] == torch_row["fingerprint"]
            match = "yes" if row["mask_match"] else "**NO**"
        time_text = _fmt_time(row)
        lines.append(
            f"| {row['size']} | {row['op']} | {row['impl']} | {time_text} | {_fmt_bpw(row)} | {speedup} | {ratio} "
            f"| {fused} | {match} |"
        )
    small = [r for r in rows if r["size"] == SMALL_SIZE]
    engine = _find(small, SMALL_SIZE, "global_l1", "lightprune-bool")
    fused_row = _find(small, SMALL_SIZE, "read_fused", "vector_norm(w, 1)")
    if engine and fused_row and "runs" in engine and "runs" in fused_row:
        tensors = engine["tensors"]
        extra = [a - b for a, b in zip(engine["runs"], fused_row["runs"], strict=False) if a is not None and b]
        lines += [
            "",
            f"| {SMALL_SIZE} ({tensors:,} tensors), bool masks | value |",
            "|---|---|",
            f"| engine per tensor: (global L1 − fused read) / {tensors:,} | "
            f"{statistics.median(extra) / tensors * 1e3:.3f} ms |",
        ]
        for op in ("callback_event", "callback_event_inplace"):
            event = _find(small, SMALL_SIZE, op, "lightprune-bool")
            if event:
                lines.append(f"| {op} / global L1 (same tensors) | {_paired(event, engine) or float('nan'):.2f}× |")
    for optimizer in ("sgd", "adam"):
        train = {r["impl"]: r for r in rows if r["op"] == f"train_step_{optimizer}" and "seconds" in r}
        if "dense" not in train:
            continue
        width = train["dense"].get("width", 2048)  # (512 in --quick runs)
        header = (
            f"| training step, 4 × Linear({width}, {width}) with bias, batch 64, {optimizer} | time, median (range) "
            "| vs dense, median (range) |"
        )
        lines += ["", header, "|---|---|---|"]
        for impl, row in train.items():
            runs = [r * 1e3 for r in row["runs"] if r is not None]
            ratios = _ratios(row, train["dense"])
            lines.append(
                f"| {impl} | {row['seconds'] * 1e3:.1f} ms ({min(runs):.1f} – {max(runs):.1f}) "
                f"| {statistics.median(ratios):.2f}× ({min(ratios):.2f}–{max(ratios):.2f}×) |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
