"""Tokens per second of ``generate`` before and after removing half the MLP neurons and half the key/value groups of a
small Llama with grouped-query attention (random weights: speed does not depend on their values).

The model: ``LlamaConfig(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
intermediate_size=2048, vocab_size=4096)``; 50% of every layer's neurons and key/value groups pruned by magnitude
(:func:`lightprune.structure.prune_units`), removed with :func:`lightprune.export.remove_units`. Greedy ``generate``
of ``--new`` tokens from a prompt of 16 tokens, batch 1, dense and compact interleaved, one torch thread; the two
token sequences are checked equal.

Usage:
    python benchmarks/structured_llama.py [--new 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lightprune.export import remove_units
from lightprune.structure import find_units, prune_units
from machine import describe


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new", type=int, default=64, help="tokens generated per call")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per model")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "structured_llama.json")
    args = parser.parse_args(argv)
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=4096,
        hidden_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=2048,
        bos_token_id=0,
        eos_token_id=None,
        pad_token_id=0,
    )
    dense = LlamaForCausalLM(config).eval()
    example = {"input_ids": torch.randint(1, 4096, (1, 16))}
    pruned = LlamaForCausalLM(config).eval()
    pruned.load_state_dict(dense.state_dict())
    prune_units(pruned, find_units(pruned, (), example), 0.5)
    small = remove_units(pruned, (), example)
    settings = {"max_new_tokens": args.new, "min_new_tokens": args.new, "do_sample": False}
    prompt = example["input_ids"]
    with torch.inference_mode():
        assert torch.equal(pruned.generate(prompt, **settings), small.generate(prompt, **settings))
        times: dict[str, list[float]] = {"dense": [], "compact": []}
        models = {"dense": dense, "compact": small}
        for model in models.values():
            model.generate(prompt, **settings)  # warm-up
        for round_ in range(args.repeats):
            order = list(models) if round_ % 2 == 0 else list(reversed(models))
            for name in order:
                start = time.perf_counter()
                models[name].generate(prompt, **settings)
                times[name].append(time.perf_counter() - start)
    result = {
        "command": " ".join(["python benchmarks/structured_llama.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": describe("transformers"),
        "parameters": {
            "dense": sum(p.numel() for p in dense.parameters()),
            "compact": sum(p.numel() for p in small.parameters()),
        },
        "tokens_per_second": {name: args.new / statistics.median(values) for name, values in times.items()},
    }
    result["speedup"] = result["tokens_per_second"]["compact"] / result["tokens_per_second"]["dense"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
