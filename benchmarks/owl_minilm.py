"""OWL's per-layer allocation on all-MiniLM-L6-v2, one-shot to 70% with Wanda scores, beside per-row and layerwise.

The protocol of ``criteria_minilm.py`` (its model, Shakespeare lines, calibration on 128 lines, metrics on 1,000
evaluation lines against the dense embeddings), one-shot, no training. All three arms rank ``|W_ij| * ||X_j||_2``
(Wanda's scores) and prune 70% of the 36 encoder Linear weights in all:

* ``row``: every output row of every layer to 70% (Wanda's own ranking);
* ``layerwise``: every layer to 70%, ranked over the whole layer;
* ``owl``: each layer ranked over itself, its share from OWL's outlier ratio of its transformer block
  (``scope="owl"``: the six Linears of one encoder layer pool their scores into one ratio and share one sparsity;
  M and lambda given).

Usage:
    python benchmarks/owl_minilm.py                       # ~2 minutes of CPU
    python benchmarks/owl_minilm.py --lam 0.08 0.2 --threshold 5 7
    python benchmarks/owl_minilm.py --arms owl --out benchmarks/results/owl_minilm_blocks   # OWL alone

Prints one line per arm and writes ``OUT/owl_minilm.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))

from criteria_minilm import (
    Settings,
    compare,
    dense_embeddings,
    embed,
    ensure_files,
    input_norms,
    load_model,
    load_tokenizer,
    pruned_linears,
    read_lines,
    split_lines,
    weight_sparsity,
)
from lightprune import prune
from lightprune.callback.masked_selection import MaskedSelection


def prune_arm(model: torch.nn.Module, norms: dict[str, torch.Tensor], arm: str, sparsity: float, owl: Any) -> list:
    """Prune ``model``'s encoder Linears one-shot by Wanda's scores in ``arm``; the per-layer sparsities."""
    layers = pruned_linears(model)
    selection = [(f"{name}.weight", layer, "weight") for name, layer in layers]
    scores = {f"{name}.weight": layer.weight.detach().abs() * norms[name] for name, layer in layers}
    scope = {"row": "row", "layerwise": "layerwise", "owl": "owl"}[arm]
    masked = MaskedSelection(selection, [], [], prune.L1Unstructured, {}, scope, torch.bool, 0, owl=owl)
    masked.prune_to(sparsity, event=0, scores=scores)
    shares = [pruned / units for units, pruned in masked.counts()]
    masked.make_permanent()
    return shares


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sparsity", type=float, default=0.7)
    parser.add_argument("--threshold", type=float, nargs="+", default=[5.0], help="OWL's M")
    parser.add_argument("--lam", type=float, nargs="+", default=[0.08], help="OWL's lambda")
    parser.add_argument("--cache", type=Path, default=Path("~/.cache/lightprune/minilm"))
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "owl_minilm")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--arms", nargs="+", default=["row", "layerwise", "owl"], choices=["row", "layerwise", "owl"])
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    settings = Settings()
    model_dir, archive = ensure_files(args.cache.expanduser())
    parts = split_lines(read_lines(archive), settings)
    tokenizer, dense_model = load_tokenizer(model_dir), load_model(model_dir)
    cache = args.cache.expanduser() / "dense_eval_full.pt"
    dense = dense_embeddings(dense_model, tokenizer, parts["evaluation"], settings, cache)
    norms = input_norms(dense_model, tokenizer, parts["calibration"], settings)
    arms: list[tuple[str, Any]] = [(arm, None) for arm in ("row", "layerwise") if arm in args.arms]
    arms += [("owl", (m, lam)) for m in args.threshold for lam in args.lam if "owl" in args.arms]
    results = {}
    for arm, owl in arms:
        model = copy.deepcopy(dense_model)
        shares = prune_arm(model, norms, arm, args.sparsity, owl or (5.0, 0.08))
        entry = {**compare(embed(model, tokenizer, parts["evaluation"], settings), dense), **weight_sparsity(model)}
        entry["layer_sparsity_range"] = [min(shares), max(shares)]
        key = arm if owl is None else f"owl M={owl[0]:g} lambda={owl[1]:g}"
        results[key] = entry
        print(
            f"{key}: cosine {entry['cosine']:.4f}, agreement {entry['agreement']:.3f}, sparsity "
            f"{entry['sparsity']:.4f}, layers {min(shares):.3f}-{max(shares):.3f}",
            flush=True,
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "owl_minilm.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
