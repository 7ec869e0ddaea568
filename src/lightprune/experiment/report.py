"""Multirun reports of the experiment app, and the names the app's outputs were first published under.

* :func:`collect_runs` / :func:`scan_runs` - every run's ``summary.json`` under a Hydra multirun directory (and the
  runs that wrote none, with the reason their log gives).
* :func:`group_arms` - runs grouped into arms: every setting but sparsity and seed.
* :func:`write_report`, :func:`report_main` - one Markdown table (per run, and per arm and sparsity: mean ± std over
  seeds) and one accuracy-versus-sparsity plot (``lightprune-experiment report <dir>``); for an Optuna search, the
  trials on the accuracy-sparsity Pareto front marked in both, and the sweeper's own result.

Summaries live in :mod:`lightprune.experiment.summary` and plots in :mod:`lightprune.experiment.plots`; their public
names are importable from here too.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightprune.experiment.plots import (
    Arm,
    plot_accuracy_vs_sparsity,
    plot_layer_sparsity,
    plot_pareto,
    plot_training_curves,
    read_metrics_csv,
)
from lightprune.experiment.search import OptimizationResults, pareto_front, read_optimization_results
from lightprune.experiment.summary import (
    SUMMARY_FILE,
    RunSummary,
    _pct,
    _times,
    format_summary_table,
    sparsity_by_layer,
    summarize,
)

__all__ = [
    "SEED_KEYS",
    "SPARSITY_KEYS",
    "RunSummary",
    "SkippedRun",
    "collect_runs",
    "format_summary_table",
    "group_arms",
    "plot_layer_sparsity",
    "plot_training_curves",
    "read_metrics_csv",
    "report_main",
    "scan_runs",
    "sparsity_by_layer",
    "summarize",
    "write_report",
]

SEED_KEYS = ("seed", "data.seed", "pruning.seed")
"""Overrides that only repeat a run with other random numbers: runs differing in these are averaged."""

SPARSITY_KEYS = ("pruning.final_sparsity",)
"""Overrides that move a run along the sparsity axis of an arm."""


@dataclass
class SkippedRun:
    """A run directory (it holds ``.hydra/``) without a ``summary.json``: the run failed or is still going.

    Attributes:
        run_dir: The directory.
        reason: The last error its log recorded, or what is missing.
    """

    run_dir: str
    reason: str


def _natural_key(path: Path) -> list[Any]:
    """Sorts ``2`` before ``10`` in Hydra's numbered job directories."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.as_posix())]


def _job_file(run_dir: Path, stop: Path, name: str) -> Path | None:
    """The run's Hydra job file ``.hydra/<name>``, looked up from ``run_dir`` towards ``stop``; ``None`` if none."""
    for folder in (run_dir, *run_dir.parents):
        candidate = folder / ".hydra" / name
        if candidate.is_file():
            return candidate
        if folder == stop:
            break
    return None


def _read_overrides(run_dir: Path, stop: Path) -> list[str] | None:
    """The run's ``.hydra/overrides.yaml``, looked up from ``run_dir`` towards ``stop``; ``None`` if none."""
    import yaml

    found = _job_file(run_dir, stop, "overrides.yaml")
    if found is None:
        return None
    return [str(item) for item in yaml.safe_load(found.read_text()) or []]


def _sweeper_node(hydra_yaml: Path) -> dict[str, Any] | None:
    """The ``hydra.sweeper`` node of a job's ``.hydra/hydra.yaml`` (empty when it has none); ``None`` if the file is
    not valid YAML."""
    import yaml

    try:
        return ((yaml.safe_load(hydra_yaml.read_text()) or {}).get("hydra") or {}).get("sweeper") or {}
    except yaml.YAMLError:
        return None


def _runs_of_other_sweeps(runs: Sequence[RunSummary], root: Path) -> list[RunSummary]:
    """The runs the folder's ``multirun.yaml`` (written by the last sweep into it) does not describe: an override of
    theirs takes a value outside that sweep's (an earlier sweep into the same folder, kept beside it).

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     _ = (Path(tmp) / "multirun.yaml").write_text("hydra: {overrides: {task: [seed=1, 'p.s=0.6,0.8']}}")
        ...     runs = [RunSummary(overrides=["seed=0", "p.s=0.5"]), RunSummary(overrides=["seed=1", "p.s=0.8"])]
        ...     [run.overrides for run in _runs_of_other_sweeps(runs, Path(tmp))]
        [['seed=0', 'p.s=0.5']]
    """
    import yaml
    from hydra.core.override_parser.overrides_parser import OverridesParser

    described = root / "multirun.yaml"
    if not described.is_file():
        return []
    try:
        task = (((yaml.safe_load(described.read_text()) or {}).get("hydra") or {}).get("overrides") or {}).get("task")
        parser = OverridesParser.create()
        values = {
            o.key_or_group: set(o.sweep_string_iterator()) if o.is_sweep_override() else {o.get_value_element_as_str()}
            for o in parser.parse_overrides([str(item) for item in task or []])
            if not o.is_delete()
        }
    except Exception:  # not a file Hydra wrote, or a grammar this check does not follow: nothing to say
        return []
    other = []
    for run in runs:
        try:
            job = {o.key_or_group: o.get_value_element_as_str() for o in parser.parse_overrides(run.overrides)
                   if not o.is_delete()}  # fmt: skip
        except Exception:
            continue
        if any(key in job and job[key] not in allowed for key, allowed in values.items()):
            other.append(run)
    return other


def _failure_reason(run_dir: Path) -> str:
    """The last ``[ERROR]`` line of the run's Hydra log (``*.log``), else what is missing."""
    for log in sorted(run_dir.glob("*.log")):
        errors = [line for line in log.read_text(errors="replace").splitlines() if "[ERROR]" in line]
        if errors:
            return errors[-1].split("] - ", 1)[-1].strip()
    return f"no {SUMMARY_FILE} and no error in its log (the run was stopped, or is still running)"


def scan_runs(multirun_dir: str | Path) -> tuple[list[RunSummary], list[SkippedRun]]:
    """Every ``summary.json`` under a multirun directory, and the run directories without one.

    Like :func:`collect_runs`, and also lists each Hydra job directory (one holding ``.hydra/``) that has no
    ``summary.json``, with the reason from its log when it has one.

    Raises:
        FileNotFoundError: ``multirun_dir`` does not exist.
        ValueError: a ``summary.json`` is not valid JSON or not a summary; the message names the file.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     _ = RunSummary(total_sparsity=0.5).to_json(Path(tmp) / "0" / "summary.json")
        ...     (Path(tmp) / "1" / ".hydra").mkdir(parents=True)
        ...     _ = (Path(tmp) / "1" / "app.log").write_text("[t][app][ERROR] - data.root: not found\\n")
        ...     runs, skipped = scan_runs(tmp)
        >>> len(runs), skipped[0].reason
        (1, 'data.root: not found')
    """
    root = Path(multirun_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"multirun directory not found: {root}")
    runs = []
    for path in sorted(root.rglob(SUMMARY_FILE), key=_natural_key):
        try:
            summary = RunSummary.load(path)
        except (ValueError, TypeError) as err:  # json.JSONDecodeError is a ValueError
            raise ValueError(f"{path}: not a valid run summary ({str(err).splitlines()[0]})") from err
        summary.run_dir = str(path.parent)
        overrides = _read_overrides(path.parent, root)
        if overrides is not None or not summary.overrides:
            summary.overrides = overrides or []
        runs.append(summary)
    finished = {Path(run.run_dir) for run in runs if run.run_dir is not None}
    skipped = []
    for hydra_dir in sorted(root.rglob(".hydra"), key=_natural_key):
        job_dir = hydra_dir.parent
        if hydra_dir.is_dir() and not any(run_dir.is_relative_to(job_dir) for run_dir in finished):
            skipped.append(SkippedRun(str(job_dir), _failure_reason(job_dir)))
    return runs, skipped


def collect_runs(multirun_dir: str | Path) -> list[RunSummary]:
    """Reads every ``summary.json`` under a Hydra multirun directory, in natural path order.

    Each summary gets ``run_dir`` (the directory it was read from) and ``overrides`` (from the run's
    ``.hydra/overrides.yaml``, found in the run directory or the nearest parent inside ``multirun_dir``; else the
    overrides the app stored in the summary).

    Args:
        multirun_dir: The sweep directory (e.g. ``multirun/2024-01-01/12-00-00``) or any parent of run directories.

    Returns:
        The summaries; empty if none was found.

    Raises:
        FileNotFoundError: ``multirun_dir`` does not exist.
        ValueError: a ``summary.json`` is corrupt (the message names it).

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     _ = RunSummary(total_sparsity=0.5).to_json(Path(tmp) / "summary.json")
        ...     [run.total_sparsity for run in collect_runs(tmp)]
        [0.5]
    """
    return scan_runs(multirun_dir)[0]


def _override_pairs(overrides: Sequence[str]) -> dict[str, str]:
    """``["+a.b=1", "~c"]`` -> ``{"a.b": "1", "c": "(deleted)"}``."""
    pairs = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.lstrip("+~")
        pairs[key] = value if sep else "(deleted)"
    return pairs


def _arm_pairs(run: RunSummary) -> dict[str, str]:
    return {k: v for k, v in _override_pairs(run.overrides).items() if k not in SEED_KEYS + SPARSITY_KEYS}


def group_arms(runs: Sequence[RunSummary]) -> list[Arm]:
    """Groups runs into arms (the same overrides but for :data:`SEED_KEYS` and :data:`SPARSITY_KEYS`), then by
    measured sparsity; an arm's label names the overrides that differ between arms.

    Runs without a final accuracy or sparsity are left out.

    Example:
        >>> runs = [
        ...     RunSummary(total_sparsity=s, final_test_acc=a, dense_test_acc=0.95, overrides=[f"seed={seed}", scope])
        ...     for s, a, seed, scope in [(0.5, 0.9, 0, "pruning.scope=global"), (0.5, 0.92, 1, "pruning.scope=global"),
        ...                               (0.5, 0.8, 0, "pruning.scope=layerwise")]
        ... ]
        >>> [(arm.label, arm.points) for arm in group_arms(runs)]
        [('pruning.scope=global', [(0.5, [0.9, 0.92])]), ('pruning.scope=layerwise', [(0.5, [0.8])])]
    """
    usable = [run for run in runs if run.total_sparsity is not None and run.final_test_acc is not None]
    pairs = [_arm_pairs(run) for run in usable]
    keys = [k for k in dict.fromkeys(k for p in pairs for k in p) if len({p.get(k) for p in pairs}) > 1]
    arms: dict[str, Arm] = {}
    by_sparsity: dict[str, dict[float, list[float]]] = {}
    dense_by_seeds: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for run, run_pairs in zip(usable, pairs, strict=True):
        label = " ".join(f"{k}={run_pairs[k]}" for k in keys if k in run_pairs)
        arms.setdefault(label, Arm(label))
        if run.dense_test_acc is not None:  # one dense model per seed: the arm's sparsities share it
            seeds = tuple(sorted((k, v) for k, v in _override_pairs(run.overrides).items() if k in SEED_KEYS))
            dense_by_seeds.setdefault(label, {})[seeds] = run.dense_test_acc
        by_sparsity.setdefault(label, {}).setdefault(round(run.total_sparsity, 9), []).append(run.final_test_acc)
    for label, arm in arms.items():
        arm.points = sorted(by_sparsity[label].items())
        arm.dense = list(dense_by_seeds.get(label, {}).values())
    return list(arms.values())


def _relative(path: Path, root: Path) -> str:
    try:
        return path.relative_to(root).as_posix() or "."
    except ValueError:
        return str(path)


def _run_label(run: RunSummary, root: Path) -> str:
    return "-" if run.run_dir is None else _relative(Path(run.run_dir), root)


def _attribution_note(runs: Sequence[RunSummary]) -> list[str]:
    """A line naming the layers FLOPs were attributed to, and how much work no layer's weight owns (counted dense)."""
    counted = [run for run in runs if run.flops_layers]
    if not counted:
        return []
    layers = list(dict.fromkeys(layer for run in counted for layer in run.flops_layers))
    shares = [run.flops_unattributed / run.dense_flops for run in counted if run.flops_unattributed and run.dense_flops]
    shown = ", ".join(layers[:8]) + (f" and {len(layers) - 8} more" if len(layers) > 8 else "")
    note = f"FLOPs attributed to the weights of {shown}"
    if shares:
        share = 100 * max(shares)
        note += f"; {share:.1f}% of the dense FLOPs belong to no weight (attention, functional ops) and count dense"
    return ["", note + "."]


def _other_sweeps_note(runs: Sequence[RunSummary], root: Path) -> list[str]:
    """A line naming the runs of earlier sweeps into the folder (:func:`_runs_of_other_sweeps`), when there are any."""
    other = _runs_of_other_sweeps(runs, root)
    if not other:
        return []
    named = ", ".join(_run_label(run, root) for run in other[:6]) + (" ..." if len(other) > 6 else "")
    return [
        f"{len(other)} of the runs were not made by the sweep multirun.yaml describes (the last one into this folder): "
        f"{named}. They come from an earlier sweep into the same folder and are reported beside it."
    ]


def _md_cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _mean_std_pct(values: Sequence[float | None]) -> str:
    present = [v for v in values if v is not None]
    if not present:
        return "-"
    mean = sum(present) / len(present)
    if len(present) == 1:
        return f"{100 * mean:.2f}%"
    std = (sum((v - mean) ** 2 for v in present) / (len(present) - 1)) ** 0.5
    return f"{100 * mean:.2f} ± {100 * std:.2f}%"


def _seed_table(runs: Sequence[RunSummary]) -> list[str]:
    """Markdown rows of the per-arm, per-sparsity mean ± std table; empty when no arm repeats a sparsity."""
    usable = [run for run in runs if run.total_sparsity is not None]
    groups: dict[tuple[str, float], list[RunSummary]] = {}
    pairs = [_arm_pairs(run) for run in usable]
    keys = [k for k in dict.fromkeys(k for p in pairs for k in p) if len({p.get(k) for p in pairs}) > 1]
    for run, run_pairs in zip(usable, pairs, strict=True):
        arm = tuple(run_pairs.get(k, "") for k in keys)
        groups.setdefault((arm, round(run.total_sparsity, 9)), []).append(run)
    if all(len(group) == 1 for group in groups.values()):
        return []
    header = [*keys, "sparsity", "runs", "dense acc", "final acc"]
    lines = [
        "Mean ± standard deviation over the runs of each arm and sparsity (seeds):",
        "",
        "| " + " | ".join(_md_cell(h) for h in header) + " |",
        "|" + "|".join("---" if i < len(keys) else "---:" for i in range(len(header))) + "|",
    ]
    for (arm, sparsity), group in groups.items():
        cells = [
            *arm,
            _pct(sparsity, 1),
            str(len(group)),
            _mean_std_pct([run.dense_test_acc for run in group]),
            _mean_std_pct([run.final_test_acc for run in group]),
        ]
        lines.append("| " + " | ".join(_md_cell(cell) for cell in cells) + " |")
    return [*lines, ""]


def _is_optuna_search(root: Path, results: OptimizationResults | None) -> bool:
    """Whether the runs under ``root`` come from Hydra's Optuna sweeper: it wrote its results, or a job's
    ``.hydra/hydra.yaml`` names it (a search that is still running or was stopped)."""
    if results is not None:
        return True
    for path in sorted(root.rglob(".hydra/hydra.yaml"), key=_natural_key)[:1]:  # the jobs of a sweep share it
        sweeper = _sweeper_node(path)
        return sweeper is not None and "optuna" in str(sweeper.get("_target_", "")).lower()
    return False


def _study_of(run_dir: Path, root: Path) -> str:
    """Which Optuna study a search's run belongs to: its storage and study name from the job's ``.hydra/hydra.yaml``,
    or, for a study kept in memory (no storage: each invocation is a study of its own), its invocation's folder."""
    found = _job_file(run_dir, root, "hydra.yaml")
    if found is None:
        return _relative(run_dir.parent, root)
    sweeper = _sweeper_node(found) or {}
    if sweeper.get("storage"):
        return f"{sweeper.get('study_name')!r} in {sweeper['storage']}"
    return _relative(found.parent.parent.parent, root)  # the invocation's folder, above the job's


def _refuse_separate_studies(runs: Sequence[RunSummary], root: Path) -> None:
    """One search per report: the trials of separate studies (searches run again without a storage, or other study
    names) have no common front, and the sweeper's result covers one of them only."""
    studies: dict[str, None] = {}
    for run in runs:
        if run.run_dir is not None:
            studies.setdefault(_study_of(Path(run.run_dir), root), None)
    if len(studies) > 1:
        names = ", ".join(list(studies)[:4]) + (" ..." if len(studies) > 4 else "")
        raise ValueError(
            f"{root} holds the trials of {len(studies)} separate Optuna searches ({names}); a search is continued "
            "only through a storage (hydra.sweeper.storage): report each search's folder on its own"
        )


def _search_lines(
    runs: Sequence[RunSummary], front: Sequence[int], results: OptimizationResults | None, root: Path
) -> list[str]:
    """What the report says of an Optuna search: the accuracy-sparsity front, then the sweeper's own result."""
    lines = [
        f"Optuna search: the Pareto front of final accuracy and sparsity (no other trial is both sparser and more "
        f"accurate) holds {len(front)} of the {len(runs)} trials, marked in the table and the plot.",
    ]
    if results is None:
        return [*lines, "The sweeper wrote no optimization_results.yaml (the search is running, or was stopped)."]
    found = [_run_label(run, root) for run in runs if results.matches(run.overrides)]
    shown = ", ".join(found[:8]) + (f" and {len(found) - 8} more" if len(found) > 8 else "")
    where = f"run{'s' * (len(found) != 1)} {shown}" if found else "no run found here"
    source = _relative(results.path, root)
    count = len(results.solutions)
    if results.best_params:
        lines.append(f"The sweeper's best trial ({source}): value {results.best_value!r}, {where}.")
    else:
        lines.append(
            f"The sweeper's Pareto front of its objectives ({source}): {count} trial{'s' * (count != 1)}, {where}."
        )
    return lines


def write_report(multirun_dir: str | Path, out_md: str | Path | None = None, out_png: str | Path | None = None) -> str:
    """Writes a Markdown report and an accuracy-versus-sparsity plot for a multirun directory.

    The table has one row per run: the run directory, one column per overridden key (from ``.hydra/overrides.yaml``),
    sparsity, dense and final test accuracy, compression and theoretical speed-up. When runs repeat an arm at the
    same sparsity (a seed sweep), a second table gives each arm's mean ± standard deviation. Runs without a summary
    are listed as skipped, with the reason from their log. The plot (see
    :func:`~lightprune.experiment.plots.plot_accuracy_vs_sparsity`) draws one line per arm.

    For a search by Hydra's Optuna sweeper (its ``optimization_results.yaml`` under ``multirun_dir``, or a job's
    ``.hydra/hydra.yaml`` naming it), the table's last column marks the trials on the Pareto front of final accuracy
    and sparsity, the plot (:func:`~lightprune.experiment.plots.plot_pareto`) draws every trial with the front
    joined, and the report names the runs of the sweeper's result (its best trial, or its Pareto front of its own
    objectives).
    ``multirun_dir`` may hold several invocations of one study (a stopped search continued through a storage): all
    their runs count, and the newest ``optimization_results.yaml`` (the whole study's) is read. The trials of
    separate studies (a search started again without a storage is a new study) are refused.

    Args:
        multirun_dir: The sweep directory.
        out_md: Markdown output; default ``<multirun_dir>/report.md``.
        out_png: Plot output; default ``<multirun_dir>/accuracy_vs_sparsity.png``. The Markdown links it.

    Returns:
        The Markdown text.

    Raises:
        FileNotFoundError: The directory does not exist or holds no ``summary.json``.
        ValueError: A ``summary.json`` is corrupt (the message names it), or the directory holds the trials of
            separate Optuna searches (the message names them).

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     for job, amount in enumerate((0.5, 0.9)):
        ...         run = Path(tmp) / str(job)
        ...         (run / ".hydra").mkdir(parents=True)
        ...         _ = (run / ".hydra" / "overrides.yaml").write_text(f"- prune.amount={amount}\\n")
        ...         _ = RunSummary(total_sparsity=amount, final_test_acc=0.9).to_json(run / "summary.json")
        ...     markdown = write_report(tmp)
        >>> print("\\n".join(markdown.splitlines()[4:8]))
        | run | prune.amount | sparsity | dense acc | final acc | compression | speed-up |
        |---|---|---:|---:|---:|---:|---:|
        | 0 | 0.5 | 50.0% | - | 90.00% | - | - |
        | 1 | 0.9 | 90.0% | - | 90.00% | - | - |
    """
    root = Path(multirun_dir)
    runs, skipped = scan_runs(root)
    if not runs:
        why = f"; {len(skipped)} run(s) without one, e.g. {skipped[0].run_dir}: {skipped[0].reason}" if skipped else ""
        raise FileNotFoundError(f"no {SUMMARY_FILE} found under {root}{why}")
    out_md = Path(out_md) if out_md is not None else root / "report.md"
    out_png = Path(out_png) if out_png is not None else root / "accuracy_vs_sparsity.png"

    pairs = [_override_pairs(run.overrides) for run in runs]
    keys: list[str] = []
    for run_pairs in pairs:
        keys += [key for key in run_pairs if key not in keys]
    measured = any(run.file_size_ratio is not None or run.latency_ratio is not None for run in runs)
    results = read_optimization_results(root)
    search = _is_optuna_search(root, results)
    if search:
        _refuse_separate_studies(runs, root)
    front = pareto_front([(run.final_test_acc, run.total_sparsity) for run in runs]) if search else []
    header = ["run", *keys, "sparsity", "dense acc", "final acc", "compression", "speed-up"]
    header += ["file size", "latency"] if measured else []
    header += ["Pareto front"] if search else []
    lines = [
        f"# Pruning report: {root}",
        "",
        f"{len(runs)} run(s). Sparsity and compression over the pruned weights; speed-up = dense / nonzero FLOPs.",
        *(
            [
                "Measured: file size = dense safetensors bytes / model.safetensors bytes; latency = masked model's "
                "median / the compact (structured) or sparse-Linear model's, batch 64, on the machine of the run."
            ]
            if measured
            else []
        ),
        *_attribution_note(runs),
        *_other_sweeps_note(runs, root),
        *(["", *_search_lines(runs, front, results, root)] if search else []),
        "",
        "| " + " | ".join(_md_cell(h) for h in header) + " |",
        "|" + "|".join("---" if i <= len(keys) else "---:" for i in range(len(header))) + "|",
    ]
    for index, (run, run_pairs) in enumerate(zip(runs, pairs, strict=True)):
        cells = [
            _run_label(run, root),
            *(run_pairs.get(key, "") for key in keys),
            _pct(run.total_sparsity, 1),
            _pct(run.dense_test_acc),
            _pct(run.final_test_acc),
            _times(run.compression_ratio),
            _times(run.theoretical_speedup),
            *([_times(run.file_size_ratio), _times(run.latency_ratio)] if measured else []),
            *(["yes" if index in front else ""] if search else []),
        ]
        lines.append("| " + " | ".join(_md_cell(cell) for cell in cells) + " |")
    lines.append("")
    lines += _seed_table(runs)
    if skipped:
        lines += [f"Skipped {len(skipped)} run(s) without a {SUMMARY_FILE}:", ""]
        lines += [f"- {_md_cell(_relative(Path(s.run_dir), root))}: {_md_cell(s.reason)}" for s in skipped]
        lines.append("")
    if search:
        drawn = [i for i, run in enumerate(runs) if run.total_sparsity is not None and run.final_test_acc is not None]
        points = [(runs[i].total_sparsity, runs[i].final_test_acc) for i in drawn]
        dense = [run.dense_test_acc for run in runs if run.dense_test_acc is not None]
        plot_pareto(points, [drawn.index(i) for i in front], out_png, dense=dense)  # type: ignore[arg-type]
    else:
        plot_accuracy_vs_sparsity(group_arms(runs), out_png)
    try:
        link = out_png.resolve().relative_to(out_md.resolve().parent).as_posix()
    except ValueError:
        link = out_png.resolve().as_posix()
    lines += [f"![accuracy versus sparsity]({link})", ""]
    markdown = "\n".join(lines)
    out_md.parent.mkdir(parents=True, exist_ok=True)
    out_md.write_text(markdown)
    return markdown


def report_main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``lightprune-experiment report <multirun_dir> [--out-md F] [--out-png F]``.

    Prints the Markdown report and returns the exit status (1, with a one-line message, when no run was found or a
    summary is corrupt).

    Example:
        >>> report_main(["/nonexistent/multirun"])
        1
    """
    parser = argparse.ArgumentParser(
        prog="lightprune-experiment report",
        description="Markdown table and accuracy-versus-sparsity plot over the runs of a Hydra multirun directory.",
    )
    parser.add_argument("multirun_dir", type=Path, help="directory holding the runs' summary.json files")
    parser.add_argument("--out-md", type=Path, default=None, help="Markdown output (default <dir>/report.md)")
    parser.add_argument("--out-png", type=Path, default=None, help="plot (default <dir>/accuracy_vs_sparsity.png)")
    args = parser.parse_args(argv)
    try:
        markdown = write_report(args.multirun_dir, out_md=args.out_md, out_png=args.out_png)
    except (FileNotFoundError, ValueError, json.JSONDecodeError) as err:
        print(f"lightprune-experiment report: {err}", file=sys.stderr)
        return 1
    print(markdown)
    return 0
