"""Searching with Hydra's sweepers: what a job returns, which trials are on the Pareto front, what Optuna wrote.

* :func:`objective_value` - the value(s) of ``objective`` in a run's summary: what the app's job returns, so that
  Hydra's Optuna (or Ax, Nevergrad) sweeper can optimise it.
* :func:`pareto_front` - the runs no other run beats in accuracy and sparsity at once.
* :func:`read_optimization_results` - the ``optimization_results.yaml`` Hydra's Optuna sweeper writes at the end of
  a sweep (its best trial, or its Pareto front).
* :func:`continue_study` - what the ``lightprune_optuna`` sweeper does before Hydra's Optuna sweeper runs: a study
  kept in Optuna's storage goes on where an interrupted sweep stopped.

Nothing here imports torch, and Optuna only where a study is opened.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightprune.experiment.config import ConfigError, objective_names

__all__ = [
    "OPTIMIZATION_RESULTS",
    "OptimizationResults",
    "continue_study",
    "direction_count",
    "objective_value",
    "pareto_front",
    "read_optimization_results",
]

OPTIMIZATION_RESULTS = "optimization_results.yaml"
"""What Hydra's Optuna sweeper writes into the sweep directory when the sweep ends."""

log = logging.getLogger(__name__)


def objective_value(summary: Mapping[str, Any], objective: Any) -> Any:
    """The value of ``objective`` in a run's summary, exactly as ``summary.json`` holds it.

    Args:
        summary: the summary as ``summary.json`` holds it (``RunSummary.to_dict()``, or the parsed file).
        objective: one field name, or a list of names (:func:`~lightprune.experiment.config.objective_names`).

    Returns:
        The field's value for one name (or a list of one), the tuple of values for two or more names. A field the
        summary holds as ``null`` (the compression of a selection pruned away entirely) gives ``None``: a sweeper
        records that trial as failed.

    Example:
        >>> summary = {"final_test_acc": 0.9625, "total_sparsity": 0.9}
        >>> objective_value(summary, "final_test_acc"), objective_value(summary, ["final_test_acc", "total_sparsity"])
        (0.9625, (0.9625, 0.9))
    """
    values = tuple(summary.get(name) for name in objective_names(objective))
    return values[0] if len(values) == 1 else values


def direction_count(direction: Any) -> int:
    """How many objectives an Optuna sweeper's ``direction`` asks for (one name, or a list of names).

    Example:
        >>> direction_count("maximize"), direction_count(["maximize", "maximize"])
        (1, 2)
    """
    from omegaconf import OmegaConf

    plain = OmegaConf.to_container(direction) if OmegaConf.is_config(direction) else direction
    return len(plain) if isinstance(plain, list | tuple) else 1


def check_directions(objective: Any, sweeper: Any) -> None:
    """Refuse an ``objective`` whose number of values differs from the Optuna sweeper's ``direction`` (before any
    training: the sweeper would reject the trial's value only after it ran).

    Args:
        objective: the config's ``objective``.
        sweeper: the ``hydra.sweeper`` node of the job's Hydra config (other sweepers, without ``direction``, pass).

    Raises:
        ConfigError: naming both counts.

    Example:
        >>> check_directions(["final_test_acc", "total_sparsity"], {"direction": "maximize"})
        Traceback (most recent call last):
        ...
        lightprune.experiment.config.ConfigError: objective=['final_test_acc', 'total_sparsity'] gives 2 values, but \
hydra.sweeper.direction='maximize' optimises 1: give one direction per objective
    """
    direction = sweeper.get("direction") if hasattr(sweeper, "get") else None
    if direction is None:
        return
    names = objective_names(objective)
    count = direction_count(direction)
    if len(names) != count:
        from omegaconf import OmegaConf

        plain = OmegaConf.to_container(direction) if OmegaConf.is_config(direction) else direction
        shown = plain if isinstance(plain, list | tuple | str) else getattr(plain, "name", plain)
        given = names[0] if len(names) == 1 else names
        raise ConfigError(
            f"objective={given!r} gives {len(names)} value{'s' * (len(names) != 1)}, but "
            f"hydra.sweeper.direction={shown!r} optimises {count}: give one direction per objective"
        )


def _dominates(a: Sequence[float], b: Sequence[float]) -> bool:
    return all(x >= y for x, y in zip(a, b, strict=True)) and any(x > y for x, y in zip(a, b, strict=True))


def pareto_front(points: Sequence[Sequence[float | None]]) -> list[int]:
    """The indices of the points no other point dominates, all coordinates maximised (a point with a missing or
    non-finite coordinate is never on the front; equal points are all on it).

    Example:
        >>> pareto_front([(0.95, 0.5), (0.93, 0.9), (0.90, 0.8), (0.95, 0.5), (None, 0.99)])
        [0, 1, 3]
    """
    usable = [
        i for i, point in enumerate(points) if all(v is not None and math.isfinite(v) for v in point)
    ]  # fmt: skip
    return [i for i in usable if not any(_dominates(points[j], points[i]) for j in usable if j != i)]  # type: ignore[arg-type]


@dataclass
class OptimizationResults:
    """What Hydra's Optuna sweeper wrote into ``optimization_results.yaml``.

    Attributes:
        path: the file.
        best_params: a single-objective sweep's best trial's parameters (override key -> value); empty otherwise.
        best_value: that trial's value.
        solutions: a multi-objective sweep's Pareto front: ``(params, values)`` per trial on it.
    """

    path: Path
    best_params: dict[str, Any] = field(default_factory=dict)
    best_value: float | None = None
    solutions: list[tuple[dict[str, Any], list[float]]] = field(default_factory=list)

    def matches(self, overrides: Sequence[str]) -> bool:
        """Whether a run with these overrides is the best trial or one of the Pareto solutions: every parameter of
        the trial is among the run's overrides with the same value.

        Example:
            >>> results = OptimizationResults(Path("r.yaml"), best_params={"pruning.final_sparsity": 0.8125})
            >>> results.matches(["pruning.final_sparsity=0.8125", "seed=1"]), results.matches(["seed=1"])
            (True, False)
        """
        given = dict(item.partition("=")[::2] for item in overrides)
        candidates = [self.best_params] if self.best_params else [params for params, _ in self.solutions]
        return any(params and all(_same(given.get(k), v) for k, v in params.items()) for params in candidates)


def _same(text: str | None, value: Any) -> bool:
    """Whether an override's text holds ``value`` (numbers compared as numbers: the sweeper writes ``repr``)."""
    if text is None:
        return False
    if isinstance(value, bool) or not isinstance(value, int | float):
        return text == str(value)
    try:
        return float(text) == float(value)
    except ValueError:
        return False


def read_optimization_results(sweep_dir: str | Path) -> OptimizationResults | None:
    """The newest ``optimization_results.yaml`` under ``sweep_dir`` (a sweep, or a folder of sweeps of one study:
    the last invocation's covers the whole study), or ``None`` where the sweeper wrote none (another sweeper, or
    a sweep still running or stopped).

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     _ = (Path(tmp) / OPTIMIZATION_RESULTS).write_text(
        ...         "name: optuna\\nsolutions:\\n- params: {pruning.final_sparsity: 0.9}\\n  values: [0.95, 0.9]\\n")
        ...     read_optimization_results(tmp).solutions
        [({'pruning.final_sparsity': 0.9}, [0.95, 0.9])]
    """
    import yaml

    found = sorted(Path(sweep_dir).rglob(OPTIMIZATION_RESULTS), key=lambda path: path.stat().st_mtime)
    if not found:
        return None
    data = yaml.safe_load(found[-1].read_text()) or {}
    solutions = [
        (dict(item.get("params") or {}), [float(v) for v in item.get("values") or []])
        for item in data.get("solutions") or []
    ]
    best = data.get("best_value")
    return OptimizationResults(found[-1], dict(data.get("best_params") or {}), _float(best), solutions)


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


def continue_study(sweeper: Any) -> None:
    """Prepare Hydra's Optuna sweeper (its ``OptunaSweeperImpl``) to go on with a study kept in Optuna's storage.

    Where ``storage`` and ``study_name`` name a study that already has trials (a sweep that was interrupted, or
    ended, and is started again):

    * trials still marked running (their process was killed) are marked failed: no sweep is running them now;
    * ``n_trials`` counts the study's trials in all: only the missing ones run (none when the study has them: the
      results are still written);
    * job numbers go on from the study's trial count, so job ``N`` is the study's trial ``N`` and the run
      directories of earlier invocations are never reused;
    * a seeded sampler is seeded anew from its seed and the trial count (reproducible, and another stream), so it
      does not draw the parameters of the earlier invocations' trials again.

    A new study (or none stored) is left to the sweeper as it is.
    """
    if sweeper.storage is None or sweeper.study_name is None:
        return
    import optuna
    from optuna.trial import TrialState

    try:
        study = optuna.load_study(study_name=sweeper.study_name, storage=sweeper.storage)
    except KeyError:  # no such study yet: the sweeper creates it
        return
    trials = study.get_trials(deepcopy=False)
    if not trials:
        return
    for trial in trials:
        if trial.state == TrialState.RUNNING:
            study.tell(trial.number, state=TrialState.FAIL)
            log.warning("trial %d of study %r did not finish (its sweep stopped): marked failed", trial.number,
                        study.study_name)  # fmt: skip
    complete = sum(trial.state == TrialState.COMPLETE for trial in trials)
    remaining = max(0, sweeper.n_trials - complete)
    log.info(
        "continuing study %r: %d of %d trials complete, %d to run", study.study_name, complete, sweeper.n_trials,
        remaining,
    )  # fmt: skip
    sweeper.n_trials = remaining
    sweeper.job_idx = len(trials)
    if remaining == 0 and sweeper.config is not None:  # no job creates the sweep directory the results go into
        Path(str(sweeper.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
    node = sweeper.config.hydra.sweeper.get("sampler") if sweeper.config is not None else None
    if node is not None and node.get("seed") is not None and not node.get("_partial_", False):
        import numpy as np
        from hydra.utils import instantiate

        seed = int(np.random.SeedSequence(int(node.seed), spawn_key=(len(trials),)).generate_state(1)[0])
        sweeper.sampler = instantiate(node, seed=seed)
