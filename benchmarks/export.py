"""lightprune.export against dense: file sizes, save/load times, compact and sparse-Linear latency, in one run.

* **Files**: a model of 4 x Linear(2048, 2048) with biases (16.8M weights), pruned by ``global_unstructured``
  (L1) at 50/90/95/99%, in float32 and bfloat16: the dense safetensors file of its pruned weights, that file
  gzipped (level 6), torch's CSR (``torch.save`` of each weight ``.to_sparse_csr()``), and ``save_sparse``; the
  information limit ``dense_bytes / (kept_values_bytes + 1 bit per entry)``; save and load times (median of
  ``--repeats``): saving the same state_dict both ways (and ``save_sparse`` of the pruned module, which folds each
  ``weight_orig``/``weight_mask`` pair first); the dense load three ways: ``load_file`` as it returns (memory-mapped,
  nothing read yet), ``load_file`` then ``.clone()`` of every tensor (every value read), and
  ``load_file(backend="pread")`` (every tensor read into memory); the load target is judged against the faster of
  the two full reads. On Linux both loads are timed again from the disk: each file is flushed and dropped from the
  page cache (``posix_fadvise(POSIX_FADV_DONTNEED)``, untimed) before ``load_file(backend="pread")`` and
  ``load_sparse`` read it.
* **compact**: the app's ``cnn_channels`` model (``SmallCNN`` on 8x8 digits, channels 16/32, ``ln_structured``
  n=2 dim=0 at 50% on both convs with their biases, classifier untouched) at batch 64, dense vs compact in 5 blocks
  of interleaved rounds (median and range over the blocks); then where the time goes: each layer alone (dense vs
  compact), both models in channels_last and with oneDNN disabled, at batch 256 and 1024, and the first
  convolution alone with 4 to 32 output channels.
* **sparse Linear**: Linear(4096, 4096) at batch 32, 95% unstructured (and a sweep of sparsities): dense
  ``nn.Linear`` vs ``to_sparse_linear``'s CSR layer.

Every time is a median of interleaved repeats (dense and lightprune in turn, round after round) on ``--threads``
torch threads (1 by default: on a shared 2-core machine two OpenMP threads stall whenever the other core is busy,
and one thread gives repeatable ratios).

Usage:
    python benchmarks/export.py                 # the full run (a few minutes on 2 cores)
    python benchmarks/export.py --quick         # tiny sizes, few repeats: seconds
    python benchmarks/export.py --device cuda   # not implemented: CPU figures only

Writes a Markdown table to stdout and JSON to ``--out`` (default ``benchmarks/results/export_cpu.json``).
"""

from __future__ import annotations

import argparse
import copy
import gzip
import io
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from lightprune import prune
from lightprune.experiment.models import SmallCNN, theoretical_speedup
from lightprune.export import compact, compare_latency, load_sparse, save_sparse, to_sparse_linear
from lightprune.export._pruned import effective_state_dict

warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta state")

SPARSITIES = (0.5, 0.9, 0.95, 0.99)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _interleaved(calls: dict[str, Any], repeats: int) -> dict[str, float]:
    """Median seconds of each call, run in turn round after round (one untimed round first).

    A call given as a ``(prepare, call)`` pair has ``prepare()`` run untimed just before it, every round.
    """
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for round_index in range(repeats + 1):
        for name, call in calls.items():
            if isinstance(call, tuple):
                prepare, call = call
                prepare()
            start = time.perf_counter()
            call()
            if round_index:
                samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in samples.items()}


def _evict(path: Path) -> None:
    """Drop ``path`` from the page cache (flushed first), so that the next read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


COLD = hasattr(os, "posix_fadvise")
"""Whether this platform can drop a file from the page cache (Linux): the cold-load columns."""


def _mlp(width: int, layers: int, dtype: torch.dtype) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(layers))).to(dtype)


def _sizes(state: dict[str, torch.Tensor], workdir: Path) -> dict[str, Any]:
    """File sizes of one state_dict: dense safetensors, gzip of it, torch CSR, lightprune, information limit."""
    dense_path, sparse_path = workdir / "sizes_dense.safetensors", workdir / "sizes_sparse.safetensors"
    save_file(state, str(dense_path))
    save_sparse(state, sparse_path)
    loaded = load_sparse(sparse_path)
    exact = loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state)
    dense_bytes = dense_path.stat().st_size
    gzip_bytes = len(gzip.compress(dense_path.read_bytes(), compresslevel=6))
    buffer = io.BytesIO()
    torch.save({k: (v.to_sparse_csr() if v.dim() == 2 else v) for k, v in state.items()}, buffer)
    csr_bytes = buffer.getbuffer().nbytes
    sparse_bytes = sparse_path.stat().st_size
    payload = sum(t.numel() * t.element_size() for t in state.values())
    limit_bytes = sum(int((t != 0).sum()) * t.element_size() + t.numel() / 8 for t in state.values())
    return {
        "weights": sum(t.numel() for t in state.values()),
        "zeros": sum(int((t == 0).sum()) for t in state.values()) / max(sum(t.numel() for t in state.values()), 1),
        "dense_bytes": dense_bytes,
        "gzip_bytes": gzip_bytes,
        "csr_bytes": csr_bytes,
        "lightprune_bytes": sparse_bytes,
        "ratio_gzip": dense_bytes / gzip_bytes,
        "ratio_csr": dense_bytes / csr_bytes,
        "ratio_lightprune": dense_bytes / sparse_bytes,
        "ratio_limit": payload / limit_bytes,
        "lightprune_over_limit": sparse_bytes / limit_bytes - 1,
        "exact": exact,
    }


def files(width: int, layers: int, repeats: int, workdir: Path) -> list[dict[str, Any]]:
    rows = []
    dense_path, sparse_path = workdir / "dense.safetensors", workdir / "sparse.safetensors"
    for dtype_name, dtype in DTYPES.items():
        for sparsity in SPARSITIES:
            model = _mlp(width, layers, dtype)
            prune.global_unstructured(
                [(m, "weight") for m in model], pruning_method=prune.L1Unstructured, amount=sparsity
            )
            state = {k: v.contiguous() for k, v in effective_state_dict(model).items()}
            calls = {
                "save_dense": lambda state=state: save_file(state, str(dense_path)),
                "save_lightprune": lambda state=state: save_sparse(state, sparse_path),
                "save_lightprune_module": lambda model=model: save_sparse(model, sparse_path),
                "load_dense_lazy": lambda: load_file(str(dense_path)),
                "load_dense_read": lambda: [t.clone() for t in load_file(str(dense_path)).values()],
                "load_dense_pread": lambda: load_file(str(dense_path), backend="pread"),
                "load_lightprune": lambda: load_sparse(sparse_path),
            }
            if COLD:
                calls["load_dense_cold"] = (lambda: _evict(dense_path), calls["load_dense_pread"])
                calls["load_lightprune_cold"] = (lambda: _evict(sparse_path), calls["load_lightprune"])
            times = _interleaved(calls, repeats)
            rows.append(
                {
                    "dtype": dtype_name,
                    "sparsity": sparsity,
                    **_sizes(state, workdir),
                    **{f"{name}_s": seconds for name, seconds in times.items()},
                }
            )
            print(f"files {dtype_name} {sparsity}: {rows[-1]['ratio_lightprune']:.2f}x", file=sys.stderr)
    return rows


def checkpoint_files(path: Path, workdir: Path) -> list[dict[str, Any]]:
    """Sizes for a trained, pruned state_dict (``torch.load``-able, e.g. the experiment app's ``model.pt``)."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    rows = []
    for dtype_name, dtype in DTYPES.items():
        cast = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in state.items()}
        rows.append({"checkpoint": str(path), "dtype": dtype_name, **_sizes(cast, workdir)})
    return rows


def _cnn_models(batch: int) -> tuple[nn.Module, nn.Module, torch.Tensor]:
    """Dense SmallCNN and its compact 50%-channel version (eval mode), and an input batch."""
    dense, pruned, x = _cnn_pruned(batch)
    return dense, compact(pruned, x), x


def _cnn_pruned(batch: int) -> tuple[nn.Module, nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    dense = SmallCNN(in_channels=1, image_size=8, channels=(16, 32), num_classes=10).eval()
    pruned = SmallCNN(in_channels=1, image_size=8, channels=(16, 32), num_classes=10)
    pruned.load_state_dict(dense.state_dict())
    for conv in (pruned.conv1, pruned.conv2):
        prune.ln_structured(conv, "weight", amount=0.5, n=2, dim=0)
        prune.custom_from_mask(conv, "bias", conv.weight_mask.flatten(1).any(1).to(conv.bias.dtype))
    pruned.eval()
    return dense, pruned, torch.randn(batch, 1, 8, 8)


def cnn_channels(batch: int, repeats: int, blocks: int) -> dict[str, Any]:
    """The app's cnn_channels experiment at its final 50% of conv channels, dense against compact.

    ``blocks`` blocks of ``repeats`` interleaved rounds: each figure is the median over the blocks of each block's
    median, and the speed-up's range over the blocks says how much the shared machine moved it.
    """
    dense, pruned, x = _cnn_pruned(batch)
    small = compact(pruned, x)
    with torch.no_grad():
        want, got = pruned(x), small(x)
    error = float((want - got).abs().max() / want.abs().max())
    runs = [
        compare_latency({"dense": dense, "masked": pruned, "compact": small}, x, repeats=repeats, warmup=20)
        for _ in range(blocks)
    ]
    ratios = [times["dense"].median / times["compact"].median for times in runs]
    return {
        "batch": batch,
        "blocks": blocks,
        "params_dense": sum(p.numel() for p in dense.parameters()),
        "params_compact": sum(p.numel() for p in small.parameters()),
        "theoretical_speedup": theoretical_speedup(pruned, (1, 8, 8)),
        **{
            f"{name}_s": statistics.median(times[name].median for times in runs)
            for name in ("dense", "masked", "compact")
        },
        "speedup": statistics.median(ratios),
        "speedup_range": [min(ratios), max(ratios)],
        "max_relative_error": error,
    }


def _pair(dense: nn.Module, small: nn.Module, x: torch.Tensor, repeats: int) -> dict[str, float]:
    times = compare_latency({"dense": dense, "compact": small}, x, repeats=repeats, warmup=20)
    d, c = times["dense"].median, times["compact"].median
    return {"dense_s": d, "compact_s": c, "speedup": d / c}


def cnn_breakdown(repeats: int) -> dict[str, Any]:
    """Where cnn_channels' time goes: each layer alone, other memory formats and kernels, larger batches."""
    dense, small, x = _cnn_models(64)
    result: dict[str, Any] = {"layers": []}
    with torch.inference_mode():
        inputs_dense, inputs_small = [x], [x]
        for layer_dense, layer_small in zip(dense.children(), small.children(), strict=True):
            inputs_dense.append(layer_dense(inputs_dense[-1]))
            inputs_small.append(layer_small(inputs_small[-1]))
    for index, ((name, layer_dense), layer_small) in enumerate(
        zip(dense.named_children(), small.children(), strict=True)
    ):
        times = _pair(
            lambda layer=layer_dense, a=inputs_dense[index]: layer(a),
            lambda layer=layer_small, a=inputs_small[index]: layer(a),
            (),
            repeats,
        )
        shapes = {"in_dense": list(inputs_dense[index].shape), "in_compact": list(inputs_small[index].shape)}
        result["layers"].append({"layer": name, **shapes, **times})
    last = torch.channels_last
    result["channels_last"] = _pair(
        copy.deepcopy(dense).to(memory_format=last),
        copy.deepcopy(small).to(memory_format=last),
        x.contiguous(memory_format=last),
        repeats,
    )
    with torch.backends.mkldnn.flags(enabled=False):
        result["no_onednn"] = _pair(dense, small, x, repeats)
    for batch in (256, 1024):
        result[f"batch_{batch}"] = _pair(dense, small, torch.randn(batch, 1, 8, 8), max(10, repeats // 10))
    conv1 = dense.conv1
    widths = {
        width: nn.Conv2d(conv1.in_channels, width, conv1.kernel_size, padding=conv1.padding).eval()
        for width in (4, 8, 16, 24, 32)
    }
    with torch.inference_mode():
        times = _interleaved({width: lambda conv=conv: conv(x) for width, conv in widths.items()}, repeats)
    result["conv1_widths"] = [{"out_channels": width, "s": seconds} for width, seconds in times.items()]
    return result


def sparse_linear(width: int, batch: int, sparsities: tuple[float, ...], repeats: int) -> list[dict[str, Any]]:
    rows = []
    for sparsity in sparsities:
        torch.manual_seed(0)
        layer = nn.Linear(width, width)
        prune.l1_unstructured(layer, "weight", amount=sparsity)
        x = torch.randn(batch, width)
        fast, decisions = to_sparse_linear(layer, x, min_sparsity=0.0, repeats=max(3, repeats // 3), margin=0.0)
        dense = nn.Linear(width, width)
        dense.load_state_dict(effective_state_dict(layer))
        dense.eval()
        times = compare_latency({"dense": dense, "csr": fast}, x, repeats=repeats, warmup=3)
        with torch.no_grad():
            want, got = dense(x), fast(x)
        rows.append(
            {
                "width": width,
                "batch": batch,
                "sparsity": sparsity,
                "dense_s": times["dense"].median,
                "csr_s": times["csr"].median,
                "speedup": times["dense"].median / times["csr"].median,
                "to_sparse_linear_would_convert": decisions[0].dense_s >= decisions[0].sparse_s,
                "max_relative_error": float((want - got).abs().max() / want.abs().max()),
            }
        )
        print(f"sparse linear {sparsity}: {rows[-1]['speedup']:.2f}x", file=sys.stderr)
    return rows


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def _full_read(row: dict[str, Any]) -> float:
    """The faster of the two dense loads that read every value."""
    return min(row["load_dense_read_s"], row["load_dense_pread_s"])


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "| dtype | sparsity | dense safetensors | gzip -6 | torch CSR | lightprune | information limit "
        "| lightprune over limit | save dense / lp (state_dict; pruned module) "
        "| load dense (lazy / mmap+read / pread) / lp | load from disk, page cache dropped: dense / lp | exact |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["files"]:
        cold = (
            f"{r['load_dense_cold_s'] * 1e3:.1f} / {r['load_lightprune_cold_s'] * 1e3:.1f} ms "
            f"({r['load_lightprune_cold_s'] / r['load_dense_cold_s']:.2f}x)"
            if "load_dense_cold_s" in r
            else "not measured"
        )
        lines.append(
            f"| {r['dtype']} | {r['sparsity']:.0%} | {_mb(r['dense_bytes'])} | {r['ratio_gzip']:.2f}x "
            f"| {r['ratio_csr']:.2f}x | **{r['ratio_lightprune']:.2f}x** | {r['ratio_limit']:.2f}x "
            f"| {r['lightprune_over_limit']:+.3%} "
            f"| {r['save_dense_s'] * 1e3:.0f} / {r['save_lightprune_s'] * 1e3:.0f} ms "
            f"({r['save_lightprune_s'] / r['save_dense_s']:.2f}x; {r['save_lightprune_module_s'] * 1e3:.0f} ms) "
            f"| {r['load_dense_lazy_s'] * 1e3:.1f} / {r['load_dense_read_s'] * 1e3:.1f} / "
            f"{r['load_dense_pread_s'] * 1e3:.1f} / {r['load_lightprune_s'] * 1e3:.1f} ms "
            f"({r['load_lightprune_s'] / _full_read(r):.2f}x of the faster read) | {cold} | {r['exact']} |"
        )
    if result["checkpoints"]:
        lines += [
            "",
            "| checkpoint | dtype | zeros | dense safetensors | gzip -6 | torch CSR | lightprune | information limit "
            "| lightprune over limit | exact |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in result["checkpoints"]:
            lines.append(
                f"| {r['checkpoint']} | {r['dtype']} | {r['zeros']:.1%} | {_mb(r['dense_bytes'])} "
                f"| {r['ratio_gzip']:.2f}x | {r['ratio_csr']:.2f}x | **{r['ratio_lightprune']:.2f}x** "
                f"| {r['ratio_limit']:.2f}x | {r['lightprune_over_limit']:+.2%} | {r['exact']} |"
            )
    c = result["cnn_channels"]
    lines += [
        "",
        "| model | batch | params | latency (median) | speed-up vs dense | theoretical |",
        "|---|---|---|---|---|---|",
        f"| cnn_channels dense | {c['batch']} | {c['params_dense']:,} | {c['dense_s'] * 1e6:.0f} us | 1.00x | |",
        f"| cnn_channels masked (reparametrized) | {c['batch']} | {c['params_dense']:,} | {c['masked_s'] * 1e6:.0f} us "
        f"| {c['dense_s'] / c['masked_s']:.2f}x | |",
        f"| cnn_channels compact | {c['batch']} | {c['params_compact']:,} | {c['compact_s'] * 1e6:.0f} us "
        f"| **{c['speedup']:.2f}x** ({c['speedup_range'][0]:.2f}-{c['speedup_range'][1]:.2f}x over {c['blocks']} "
        f"blocks) | {c['theoretical_speedup']:.2f}x |",
        "",
        "| cnn_channels, where the time goes | dense | compact | speed-up |",
        "|---|---|---|---|",
    ]
    breakdown = c.get("breakdown", {})
    for r in breakdown.get("layers", []):
        lines.append(
            f"| layer `{r['layer']}` alone, input {'x'.join(map(str, r['in_dense']))} -> "
            f"{'x'.join(map(str, r['in_compact']))} | {r['dense_s'] * 1e6:.1f} us | {r['compact_s'] * 1e6:.1f} us "
            f"| {r['speedup']:.2f}x |"
        )
    labels = {
        "channels_last": "both models in channels_last (batch 64)",
        "no_onednn": "oneDNN disabled (`torch.backends.mkldnn`), batch 64",
        "batch_256": "batch 256",
        "batch_1024": "batch 1024",
    }
    for key, label in labels.items():
        if key in breakdown:
            r = breakdown[key]
            lines.append(
                f"| {label} | {r['dense_s'] * 1e6:.0f} us | {r['compact_s'] * 1e6:.0f} us | {r['speedup']:.2f}x |"
            )
    if breakdown.get("conv1_widths"):
        widths = breakdown["conv1_widths"]
        lines += [
            "",
            "| `conv1` alone (input 64x1x8x8) with output channels | "
            + " | ".join(str(w["out_channels"]) for w in widths)
            + " |",
            "|---|" + "---|" * len(widths),
            "| latency (median) | " + " | ".join(f"{w['s'] * 1e6:.1f} us" for w in widths) + " |",
        ]
    lines += [
        "",
        "| Linear | batch | sparsity | dense | CSR | speed-up | to_sparse_linear converts |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["sparse_linear"]:
        lines.append(
            f"| {r['width']}x{r['width']} | {r['batch']} | {r['sparsity']:.0%} | {r['dense_s'] * 1e3:.2f} ms "
            f"| {r['csr_s'] * 1e3:.2f} ms | **{r['speedup']:.2f}x** | {r['to_sparse_linear_would_convert']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few repeats (smoke test)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for every timing")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats (default: 11 files, 300 latency)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument(
        "--checkpoint",
        type=Path,
        action="append",
        default=[],
        help="also measure file sizes of this pruned state_dict (e.g. an experiment run's model.pt); repeatable",
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/export_cpu.json"))
    args = parser.parse_args(argv)
    if args.device != "cpu":
        parser.error("only --device cpu is implemented; CUDA rows are not measured yet")
    width, layers = (256, 2) if args.quick else (2048, 4)
    file_repeats = args.repeats or (1 if args.quick else 11)
    latency_repeats = args.repeats or (5 if args.quick else 300)
    default_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            file_rows = files(width, layers, file_repeats, Path(tmp))
            checkpoint_rows = [row for path in args.checkpoint for row in checkpoint_files(path, Path(tmp))]
        cnn = cnn_channels(64, latency_repeats, 1 if args.quick else 5)
        cnn["breakdown"] = cnn_breakdown(latency_repeats)
        linear_width = 512 if args.quick else 4096
        sweep = (0.95,) if args.quick else (0.5, 0.7, 0.8, 0.9, 0.95, 0.99)
        linear_rows = sparse_linear(linear_width, 32, sweep, max(3, latency_repeats // 10))
    finally:
        torch.set_num_threads(default_threads)
    result = {
        "command": " ".join(["python", "benchmarks/export.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torch_threads": args.threads,
        },
        "quick": args.quick,
        "files": file_rows,
        "checkpoints": checkpoint_rows,
        "cnn_channels": cnn,
        "sparse_linear": linear_rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
