"""The experiment app: one command runs a prune-finetune experiment and shows what pruning did.

``lightprune-experiment [overrides]`` (or ``python -m lightprune.experiment``) trains a dense model, prunes and
fine-tunes it with :class:`lightprune.PruningCallback`, and writes into Hydra's run directory:

* ``logs/dense`` and ``logs/prune`` (``logs/round_<r>`` for iterative rounds): Lightning's CSV logs (and
  TensorBoard's when it is installed); ``logs/all_phases.csv``: all of them laid end to end, steps counted from
  the start of the run (what ``training_curves.png`` shows);
* ``summary.json``: dense and final test accuracy, per-layer and total sparsity, compression ratio, theoretical
  speed-up, wall time and the config;
* ``training_curves.png`` (sparsity and accuracy over steps) and ``layer_sparsity.png``;
* ``model.pt``: the final pruned model's state_dict (plain parameters holding zeros); rebuild the model with
  :func:`lightprune.experiment.load_run`.

The dense phase is cached (:mod:`lightprune.experiment.cache`): runs that share it (a sweep over pruning settings)
train it once. ``lightprune-experiment report <multirun dir>`` gathers a sweep (``-m``) into one Markdown table and
one accuracy-versus-sparsity plot; ``lightprune-experiment load <run dir>`` rebuilds a run's model.

A config error (a bad value or choice, an unknown key, missing data files, a selection that selects nothing) is
printed as its message alone and the app exits with status 2, before Lightning is imported;
``LIGHTPRUNE_DEBUG=1`` (or Hydra's ``HYDRA_FULL_ERROR=1``) shows the traceback.

Each job returns the ``objective`` (:func:`lightprune.experiment.search.objective_value`): the value of a scalar
field of ``summary.json``, or a tuple of them, which Hydra's Optuna, Ax and Nevergrad sweepers optimise
(``experiment=sparsity_search``: the accuracy-sparsity trade-off). A job that fails returns nothing: Hydra keeps its
exception, which the Optuna sweeper records as a failed trial (and re-raises, ending the sweep, beyond
``hydra.sweeper.max_failure_rate``).
"""

from __future__ import annotations

import contextlib
import csv
import logging
import os
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from lightprune.experiment.checks import exclude_patterns, preflight
from lightprune.experiment.config import (
    ConfigError,
    config_warnings,
    is_bundled,
    method_kwargs,
    per_round,
    pruning_schedule,
    register_configs,
    unknown_key_message,
    validate_config,
)

if TYPE_CHECKING:  # torch is imported where it is used: a config error is reported before it loads
    from torch import nn

__all__ = ["DEBUG_ENV", "build_callback", "config_dir", "main", "pruning_callback", "run_experiment"]

DEBUG_ENV = "LIGHTPRUNE_DEBUG"
"""Set to 1 to see the traceback of a config error (the app prints its message alone otherwise)."""

CONFIG_ERROR_STATUS = 2
"""Exit status of a config error (1: any other failure)."""

log = logging.getLogger(__name__)


def config_dir() -> Path:
    """The ``conf/`` tree: inside the installed package, or at the repository's top level in a source checkout.

    Example:
        >>> (config_dir() / "config.yaml").is_file()
        True
    """
    packaged = Path(__file__).resolve().parent.parent / "conf"
    if (packaged / "config.yaml").is_file():
        return packaged
    return Path(__file__).resolve().parents[3] / "conf"


def _schedule(cfg: DictConfig, rounds_target: float | None = None) -> Any:
    """The pruning schedule of ``cfg.pruning`` (:func:`~lightprune.experiment.config.pruning_schedule`), or for one
    round of ``iterative_rounds`` a single event to ``rounds_target`` when the round's fit starts."""
    from lightprune.schedules import make_schedule

    if rounds_target is not None:
        return make_schedule("constant", sparsity=rounds_target, at=0)
    return pruning_schedule(cfg.pruning)


def build_callback(
    cfg: DictConfig,
    *,
    module: nn.Module | None = None,
    rounds_target: float | None = None,
    rewind: Any = None,
    make_permanent: bool = True,
    adopt_masks: bool = False,
    example: Any = None,
) -> Any:
    """A :class:`lightprune.PruningCallback` for ``cfg.pruning``, or ``None`` for the dense preset.

    Every key of ``cfg.pruning`` that names an argument of the callback reaches it as the config holds it, so a key
    added to :class:`~lightprune.experiment.config.PruningConfig` under an argument's name needs no change here. Built
    from the config: the schedule (:func:`~lightprune.experiment.config.pruning_schedule`), ``method_kwargs``
    (:func:`~lightprune.experiment.config.method_kwargs`), ``include`` / ``exclude`` (with the classifier's pattern),
    ``rewind``, ``mask_dtype``; the keys that are no argument of the callback are
    :data:`~lightprune.experiment.config.PRUNING_APP_KEYS`.

    Args:
        cfg: the experiment config.
        module: the LightningModule to prune; needed for ``pruning.exclude_classifier`` (and for nothing else).
        rounds_target: for one round of ``iterative_rounds``: prune once, when the round's fit starts, to this.
        rewind: the callback's ``rewind=``, e.g. a :meth:`~lightprune.PruningCallback.snapshot_weights` dict of
            the initial weights. ``None`` with ``pruning.rewind=init``: rewind to the weights at the start of fit.
        make_permanent: remove the pruning reparametrization at the end of fit (plain weights with zeros).
        adopt_masks: the model carries the masks of an earlier round (left by ``make_permanent=False``): start from
            them (``adopt_zeros=True``), which a callback refuses otherwise.
        example: one input of the model, run once to find the classifier for ``pruning.exclude_classifier`` (the
            last ``nn.Linear`` called); ``None``: ``module.example_input_array``, else the last one defined.

    Example:
        >>> from lightprune.experiment.config import ExperimentConfig
        >>> callback = build_callback(OmegaConf.structured(ExperimentConfig))
        >>> type(callback).__name__, callback.scope, type(callback.schedule).__name__
        ('PruningCallback', 'global', 'Cubic')
    """
    import inspect

    import torch

    from lightprune.callback import PruningCallback

    p = cfg.pruning
    if p.preset == "none" or (p.final_sparsity == 0 and not p.adopt_zeros):
        return None
    if rewind is None and p.rewind is not None:
        rewind = p.rewind
    built: dict[str, Any] = {
        "include": list(p.include) if p.include else None,
        "exclude": exclude_patterns(cfg, module, example),
        "rewind": rewind,
        "mask_dtype": torch.bool if p.mask_dtype == "bool" else None,
        "method_kwargs": method_kwargs(p),
        "make_permanent": make_permanent,
        "adopt_zeros": bool(p.adopt_zeros) or adopt_masks,
        "log_every_n_steps": cfg.trainer.log_every_n_steps,
    }
    arguments = inspect.signature(PruningCallback).parameters
    passed: dict[str, Any] = {  # every other key that names an argument of the callback, as the config holds it
        key: OmegaConf.to_container(p[key]) if OmegaConf.is_config(p[key]) else p[key]
        for key in p
        if key in arguments and key not in built and key != "schedule"
    }
    return PruningCallback(_schedule(cfg, rounds_target), **passed, **built)


def pruning_callback(
    *, module: nn.Module | None = None, log_every_n_steps: int = 50, _target_: str | None = None, **pruning: Any
) -> Any:
    """The :class:`lightprune.PruningCallback` of a ``pruning`` preset: the ``_target_`` of every ``conf/pruning``
    option, so a user's own Hydra app gets the callback with ``hydra.utils.instantiate(cfg.pruning)``.

    Args:
        module: the LightningModule, needed for ``exclude_classifier: true`` (the ``ln_structured`` preset):
            ``instantiate(cfg.pruning, module=model)``.
        log_every_n_steps: how often the callback logs (the Trainer's ``log_every_n_steps``).
        **pruning: the preset's keys (:class:`~lightprune.experiment.config.PruningConfig`; unset keys take its
            defaults).

    Returns:
        The callback; for the ``none`` preset (or ``final_sparsity: 0`` without ``adopt_zeros``) a Lightning
        ``Callback`` that does nothing, so ``callbacks=[instantiate(cfg.pruning)]`` works with every preset.

    Raises:
        ConfigError: a key the schema does not have, or a value it rejects (every problem listed).

    Example:
        >>> callback = pruning_callback(preset="one_shot", schedule="constant", final_sparsity=0.8)
        >>> type(callback).__name__, type(callback.schedule).__name__, callback.schedule.sparsity
        ('PruningCallback', 'Constant', 0.8)
    """
    from lightprune.experiment.config import ExperimentConfig

    cfg = OmegaConf.structured(ExperimentConfig)
    try:
        cfg.pruning = OmegaConf.merge(cfg.pruning, pruning)
    except Exception as err:  # an unknown key or a wrong type
        raise ConfigError(f"invalid pruning config: pruning.{str(err).splitlines()[0]}") from err
    cfg.trainer.log_every_n_steps = log_every_n_steps
    validate_config(cfg)
    try:
        callback = build_callback(cfg, module=module)
    except ValueError as err:
        raise ConfigError(f"invalid pruning config (pruning.*): {err}") from err
    if callback is None:
        from lightning.pytorch import Callback

        return Callback()
    return callback


def _check_selection(callback: Any, module: nn.Module) -> None:
    """Fail before any training when ``pruning.include``/``pruning.exclude`` select nothing in the model."""
    from lightprune.selection import select_parameters

    try:
        select_parameters(
            module,
            include=callback.include,
            exclude=callback.exclude,
            module_types=callback.module_types,
            parameter_names=callback.parameter_names,
        )
    except ValueError as err:
        raise ConfigError(f"pruning.include / pruning.exclude: {err}") from err


def _datamodule(cfg: DictConfig) -> Any:
    from lightprune.experiment.targets import build_datamodule

    return build_datamodule(cfg.data)


def _module(cfg: DictConfig, datamodule: Any) -> tuple[Any, nn.Module, tuple[int, ...] | None, int | None]:
    """The LightningModule to train, the network inside it (what is summarized and saved), the input shape and the
    number of classes.

    A bundled model or an ``nn.Module`` given by ``model._target_`` is wrapped in the app's
    :class:`~lightprune.experiment.classifier.Classifier`; a ``LightningModule`` given by ``_target_`` is used as it
    is (its own steps, optimizers and metrics; it must log ``test/acc`` for the summary's accuracies).
    """
    import lightning.pytorch as pl
    from torch import nn

    from lightprune.experiment.classifier import Classifier
    from lightprune.experiment.targets import build_model, data_facts

    bundled = is_bundled(cfg.model)
    shape, classes = data_facts(cfg.data, datamodule, needed=bundled)  # a bundled network is sized by the data
    built = build_model(cfg.model, shape, classes)
    if isinstance(built, pl.LightningModule):
        for phase in ("dense", "prune"):
            for part in ("optimizer", "scheduler"):
                if cfg.optim[phase][part] is not None:
                    raise ConfigError(
                        f"optim.{phase}.{part}: model {cfg.model._target_} is a LightningModule and configures its "
                        "own optimizers; leave optim unset (optim.lr_rewind applies)"
                    )
        return built, built, shape, classes
    if not isinstance(built, nn.Module):
        raise ConfigError(f"model: {cfg.model._target_} built a {type(built).__name__}, not an nn.Module")
    shape, classes = data_facts(cfg.data, datamodule, needed=True)
    if bundled:
        m = cfg.model
        return Classifier(built, lr=m.lr, optimizer=m.optimizer, weight_decay=m.weight_decay), built, shape, classes
    return Classifier(built, num_classes=classes), built, shape, classes


def _set_optimization(cfg: DictConfig, module: Any, phase: str) -> None:
    """Give the Classifier the phase's optimizer and scheduler nodes (``optim.prune``'s unset parts: the dense's)."""
    from lightprune.experiment.classifier import Classifier

    if not isinstance(module, Classifier):
        return
    dense, chosen = cfg.optim.dense, cfg.optim[phase]
    optimizer = chosen.optimizer if chosen.optimizer is not None else dense.optimizer
    scheduler = chosen.scheduler if chosen.scheduler is not None else dense.scheduler
    interval = chosen.interval if chosen.scheduler is not None else dense.interval
    if optimizer is None and not is_bundled(cfg.model):
        optimizer = {"_target_": "torch.optim.Adam", "_partial_": True, "lr": 1e-3}
    key = f"optim.{phase if chosen.optimizer is not None or chosen.scheduler is not None else 'dense'}"
    module.set_optimization(optimizer, scheduler, interval, key=key)


def _loggers(output_dir: Path, phase: str) -> list[Any]:
    from lightning.pytorch.loggers import CSVLogger

    loggers: list[Any] = [CSVLogger(output_dir, name="logs", version=phase)]
    try:
        from lightning.pytorch.loggers import TensorBoardLogger

        loggers.append(TensorBoardLogger(output_dir, name="tensorboard", version=phase))
    except ModuleNotFoundError:  # tensorboard is optional
        pass
    return loggers


def _trainer(cfg: DictConfig, output_dir: Path, phase: str, max_epochs: int, callbacks: Sequence[Any]) -> Any:
    import lightning.pytorch as pl

    t = cfg.trainer
    trainer = pl.Trainer(
        max_epochs=max_epochs,
        accelerator=t.accelerator,
        devices=t.devices,
        precision=t.precision,
        log_every_n_steps=t.log_every_n_steps,
        enable_progress_bar=t.enable_progress_bar,
        accumulate_grad_batches=t.accumulate_grad_batches,
        deterministic=t.deterministic,
        callbacks=[c for c in callbacks if c is not None],
        logger=_loggers(output_dir, phase),
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=output_dir,
        num_sanity_val_steps=0,
    )
    _hide_version(trainer)
    return trainer


def _hide_version(trainer: Any) -> None:
    """Drop the logger version from the progress bar: ours is the phase's name, which Lightning cuts to its last four
    letters (``v_num=ense`` for ``dense``)."""
    bar = trainer.progress_bar_callback
    if bar is None:
        return
    get_metrics = bar.get_metrics

    def without_version(trainer: Any, pl_module: Any) -> dict[str, Any]:
        items = get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        return items

    bar.get_metrics = without_version


class DivergedError(RuntimeError):
    """A phase ended with weights that are not finite: its training diverged, and the run has no result."""


def _refuse_diverged(module: nn.Module, phase: str) -> None:
    """End the run (with no summary, so sweeps and ``report`` count it as failed) when ``phase`` left weights that
    are NaN or inf: its accuracy and sparsity would describe a model that computes nothing."""
    import torch

    broken = [name for name, p in module.named_parameters() if not bool(torch.isfinite(p).all())]
    if broken:
        raise DivergedError(
            f"the {phase} phase diverged: {len(broken)} parameter(s) hold NaN or inf after it ({', '.join(broken[:3])}"
            f"{', ...' if len(broken) > 3 else ''}); lower the learning rate (model.lr) or clip gradients"
        )


def _test_accuracy(trainer: Any, module: Any, datamodule: Any) -> float:
    """The model's test accuracy, over every test example once.

    Under DDP Lightning's distributed sampler pads the test set to a multiple of the processes (an example counted
    twice): there each process tests the whole set instead, with a tester of the same devices that keeps the data's
    own sampler; the model is the same on every process, so the accuracy synced across them is the set's.
    """
    if trainer.world_size > 1:
        import lightning.pytorch as pl

        trainer = pl.Trainer(
            accelerator=trainer.accelerator,
            devices=trainer.num_devices,
            num_nodes=trainer.num_nodes,
            precision=trainer.precision,
            use_distributed_sampler=False,
            logger=False,
            enable_checkpointing=False,
            enable_model_summary=False,
            enable_progress_bar=False,
        )
    results = trainer.test(module, datamodule=datamodule, verbose=False)
    logged = results[0] if results else {}
    names = ["test/acc", *(name for name in logged if "test" in name and "acc" in name)]
    for name in names:
        if name in logged:
            return float(logged[name])
    raise ConfigError(
        f"model: {type(module).__name__}.test_step logs no test accuracy (logged: {sorted(logged) or 'nothing'}); "
        "log it as 'test/acc'"
    )


@contextlib.contextmanager
def _torch_threads(num_threads: int | None) -> Iterator[None]:
    """Run with ``torch.set_num_threads(num_threads)`` (``None``: leave it), restoring the previous count after."""
    import torch

    if num_threads is None:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _round_targets(cfg: DictConfig) -> list[float]:
    """Target sparsity after each round of ``iterative_rounds``: the same fraction of what remains is pruned in
    every round, and the last round reaches ``final_sparsity`` exactly."""
    p = cfg.pruning
    fraction = per_round(p)
    targets = [1.0 - (1.0 - fraction) ** r for r in range(1, p.rounds + 1)]
    targets[-1] = p.final_sparsity
    return targets


def _fine_tuning_length(cfg: DictConfig, datamodule: Any) -> tuple[int, int] | None:
    """``(optimizer steps, epochs)`` of each pruning phase's fit, where the bundled data's batches say it before any
    training (one device); ``None`` otherwise (the callback then checks its schedule when training starts). A data
    module of the user's own is not set up early: that could draw random numbers the dense phase would miss."""
    from lightprune.experiment.data import ClassificationDataModule

    if not (is_bundled(cfg.data) and isinstance(datamodule, ClassificationDataModule)) or cfg.trainer.devices != 1:
        return None
    batches = len(datamodule.train_dataloader())  # (its datasets are split when it is built: no setup draws)
    epochs = int(cfg.trainer.max_epochs)
    return -(-batches // int(cfg.trainer.accumulate_grad_batches)) * epochs, epochs


def _plan(
    cfg: DictConfig, module: nn.Module, rewind: Any, example: Any = None, datamodule: Any = None
) -> list[tuple[str, float | None, Any]]:
    """The phases after the dense one, as ``(log name, round target or None, callback or None)``.

    Every callback is built and checked against the model here (unit groups on ``example``, one input of the
    model, when there is one), before any training, so that a bad method, method argument, scope, cap or selection
    fails at once rather than after the dense phase.
    """
    import torch

    try:
        if cfg.pruning.preset == "iterative_rounds" and build_callback(cfg, module=module) is not None:
            targets = _round_targets(cfg)
            plan: list[tuple[str, float | None, Any]] = [
                (
                    f"round_{index}",
                    target,
                    build_callback(
                        cfg,
                        module=module,
                        rounds_target=target,
                        rewind=rewind,
                        make_permanent=index == len(targets),
                        adopt_masks=index > 1,
                        example=example,
                    ),
                )
                for index, target in enumerate(targets, start=1)
            ]
        else:
            plan = [("prune", None, build_callback(cfg, module=module, rewind=rewind, example=example))]
    except ValueError as err:  # the callback's own checks, e.g. of a method given by import path
        raise ConfigError(f"invalid pruning config (pruning.*): {err}") from err
    if plan[0][2] is not None and plan[0][2].units is None:  # unit groups are found (and checked) on a batch
        _check_selection(plan[0][2], module)
    length = _fine_tuning_length(cfg, datamodule)
    for _, _, callback in plan:
        if callback is not None and length is not None:
            try:  # the schedule and the mask moves against the fine-tuning run's length
                callback.check_run(*length)
            except ValueError as err:
                raise ConfigError(
                    f"invalid pruning config for a fine-tuning run of {length[0]} optimizer steps over {length[1]} "
                    f"epochs (pruning.*, trainer.max_epochs): {err}"
                ) from err
        if callback is not None:
            try:  # the method, scope and cap against the selected layers; unit groups on an example input
                with torch.random.fork_rng():
                    callback.check_model(module, None if example is None else (example,))
            except ValueError as err:
                raise ConfigError(f"invalid pruning config for model {_model_name(cfg)} (pruning.*): {err}") from err
    return plan


def _check_optimization(cfg: DictConfig, module: Any) -> None:
    """Build each phase's optimizer and scheduler once, before any training, so that a bad ``optim.*`` node fails
    at once (a :class:`ConfigError` naming its key) instead of after the dense phase."""
    from lightprune.experiment.classifier import Classifier

    if not isinstance(module, Classifier):
        return
    for phase in ("dense", "prune"):
        _set_optimization(cfg, module, phase)
        module.configure_optimizers()  # throwaway: nothing is stepped, no state is kept


def _lay_end_to_end(output_dir: Path, phases: Sequence[tuple[str, int]], out_csv: Path) -> Path | None:
    """Concatenate the phases' ``logs/<phase>/metrics.csv`` into one CSV with steps counted from the run's start.

    Each phase's steps are shifted by the optimizer steps of the phases before it; a ``phase`` column names the
    phase. Returns ``out_csv``, or ``None`` when no phase wrote a metrics file.
    """
    columns: list[str] = ["phase"]
    rows: list[dict[str, str]] = []
    offset = 0
    for phase, steps in phases:
        path = output_dir / "logs" / phase / "metrics.csv"
        if path.is_file():
            with path.open(newline="") as handle:
                reader = csv.DictReader(handle)
                columns += [c for c in reader.fieldnames or [] if c not in columns]
                for row in reader:
                    if row.get("step"):
                        row["step"] = str(int(float(row["step"])) + offset)
                    rows.append({"phase": phase, **row})
        offset += steps
    if not rows:
        return None
    with out_csv.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns, restval="")
        writer.writeheader()
        writer.writerows(rows)
    return out_csv


class _DropLightningTips(logging.Filter):
    """Lightning's advertising tips (``💡 Tip: ... litlogger``), printed once per Trainer, say nothing about the run."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡")


_RANK_ZERO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")


@contextlib.contextmanager
def _quiet_third_party() -> Iterator[None]:
    """Silence what third-party libraries print that tells the app's user nothing (restored afterwards)."""
    tip_filter = _DropLightningTips()
    loggers = [logging.getLogger(name) for name in _RANK_ZERO_LOGGERS]
    for logger in loggers:
        logger.addFilter(tip_filter)
    try:
        with warnings.catch_warnings():
            # Lightning's own use of a torch API torch deprecated (lightning/pytorch/utilities/_pytree.py)
            warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=Warning)
            # the data are tensors in memory: worker processes would only slow loading down
            warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
            yield
    finally:
        for logger in loggers:
            logger.removeFilter(tip_filter)


def run_experiment(cfg: DictConfig, output_dir: str | Path, *, overrides: Sequence[str] | None = None) -> Any:
    """Run the whole experiment described by ``cfg`` and write its outputs into ``output_dir``.

    Args:
        cfg: the experiment config (composed from ``conf/`` or built from
            :class:`~lightprune.experiment.config.ExperimentConfig`).
        output_dir: the run directory.
        overrides: the command-line overrides the config was composed with, stored in ``summary.json``.

    Returns:
        The :class:`~lightprune.experiment.summary.RunSummary` written to ``summary.json``.

    A ``summary.json`` an earlier run left in ``output_dir`` is removed first: if this run fails, nothing there
    reads as its result.

    Raises:
        ConfigError: the config is invalid (every problem is listed), the data files are missing, or the pruning
            method or selection does not fit the model; nothing has been trained or written then.
    """
    _forget_earlier_summary(Path(output_dir))
    validate_config(cfg)
    preflight(cfg)
    for message in config_warnings(cfg):
        log.warning(message)
    with _torch_threads(cfg.trainer.num_threads), _quiet_third_party():
        return _run(cfg, Path(output_dir), list(overrides or []))


def _dense_phase(
    cfg: DictConfig, output_dir: Path, module: Any, datamodule: Any
) -> tuple[float, int, str, list[list[float]] | None]:
    """Train and test the dense model, or load both from the cache; returns ``(test accuracy, steps, how, the
    learning rates it ended with)``."""
    from lightprune.experiment.cache import DenseCache, dense_key, rng_state, set_rng_state
    from lightprune.experiment.learning_rates import final_learning_rates

    final_lrs: list[list[float]] | None = None

    def train() -> tuple[float, int]:
        nonlocal final_lrs
        dense = _trainer(cfg, output_dir, "dense", cfg.trainer.dense_epochs, [])
        dense.fit(module, datamodule=datamodule)
        _refuse_diverged(module, "dense")
        final_lrs = final_learning_rates(dense)
        return _test_accuracy(dense, module, datamodule), dense.global_step

    if not cfg.cache.dense:
        return (*train(), "trained", final_lrs)
    if cfg.trainer.devices > 1:  # every rank must take the same branch, and a rank waiting on the lock cannot join
        log.info("dense-phase cache not used: the run has %d processes, which train the dense phase together",
                 cfg.trainer.devices)  # fmt: skip
        return (*train(), "trained", final_lrs)
    plain = OmegaConf.to_container(cfg, resolve=True)
    key = dense_key(plain)  # type: ignore[arg-type]
    cache = DenseCache(cfg.cache.dir)
    try:
        cache.dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        log.warning("dense-phase cache unusable (%s): training the dense phase without it (cache.dir)", err)
        return (*train(), "trained", final_lrs)
    with cache.lock(key):
        entry = None if cfg.cache.retrain else cache.load(key)
        if entry is not None:
            module.load_state_dict(entry.state_dict)
            set_rng_state(entry.rng)
            entry.copy_logs(output_dir)
            log.info("dense phase loaded from the cache: %s", entry.path)
            lrs = entry.info.get("final_lrs")
            return float(entry.info["dense_test_acc"]), int(entry.info["global_step"]), "loaded", lrs
        accuracy, steps = train()
        info = {"dense_test_acc": accuracy, "global_step": steps, "key": key, "final_lrs": final_lrs}
        entry = cache.store(key, module.state_dict(), rng_state(), info, output_dir)
        log.info("dense phase stored in the cache: %s", entry.path)
        return accuracy, steps, "stored", final_lrs


def _run(cfg: DictConfig, output_dir: Path, overrides: list[str]) -> Any:
    import lightning.pytorch as pl
    import torch

    from lightprune.callback import PruningCallback
    from lightprune.experiment.learning_rates import HoldLearningRate, final_learning_rates
    from lightprune.experiment.plots import (
        has_mask_movement,
        plot_layer_sparsity,
        plot_mask_movement,
        plot_training_curves,
    )
    from lightprune.experiment.summary import format_summary_table, summarize

    started = time.perf_counter()
    written_from = time.time()  # outputs older than this in output_dir are an earlier run's
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    datamodule = _datamodule(cfg)
    module, network, input_shape, num_classes = _module(cfg, datamodule)
    initial_weights = PruningCallback.snapshot_weights(module)
    example = _example_input(module, network, input_shape)
    rewind = initial_weights if cfg.pruning.rewind == "init" else None
    plan = _plan(cfg, module, rewind=rewind, example=example, datamodule=datamodule)
    _check_optimization(cfg, module)
    output_dir.mkdir(parents=True, exist_ok=True)

    dense_started = time.perf_counter()
    _set_optimization(cfg, module, "dense")
    dense_acc, dense_steps, dense_how, lrs = _dense_phase(cfg, output_dir, module, datamodule)
    dense_time = time.perf_counter() - dense_started
    phases = [("dense", dense_steps)]

    metrics: dict[str, float] = {}
    final_acc = dense_acc
    _set_optimization(cfg, module, "prune")
    for phase, target, callback in plan:
        hold = None if cfg.optim.lr_rewind or lrs is None else HoldLearningRate(lrs)
        if hold is not None and not any(lr for groups in hold.lrs for lr in groups):
            log.warning(  # a schedule decayed to 0 (CosineAnnealingLR's default eta_min), carried over
                "%s trains at learning rate 0: the previous phase's schedule ended there and optim.lr_rewind=false "
                "carries it over; set the schedule's final learning rate above 0 (eta_min) or optim.lr_rewind=true",
                phase,
            )
        trainer = _trainer(cfg, output_dir, phase, cfg.trainer.max_epochs, [callback, hold])
        trainer.fit(module, datamodule=datamodule)
        _refuse_diverged(module, phase)
        lrs = final_learning_rates(trainer)
        phases.append((phase, trainer.global_step))
        final_acc = _test_accuracy(trainer, module, datamodule)
        if target is not None:  # a round's measured sparsity (zeros of the selection) beside its target
            metrics[f"{phase}/test_acc"] = final_acc
            measured = summarize(module, parameters=callback.selection).total_sparsity
            metrics[f"{phase}/sparsity"] = float("nan") if measured is None else measured
            metrics[f"{phase}/target_sparsity"] = target
    last_callback = plan[-1][2]
    structured = last_callback is not None and last_callback.structured
    units = last_callback is not None and last_callback.units is not None

    summary = summarize(
        module,
        input_shape=input_shape,
        parameters=None if last_callback is None else last_callback.selection,
        dense_test_acc=dense_acc,
        final_test_acc=final_acc,
        wall_time_s=time.perf_counter() - started,
        config=OmegaConf.to_container(cfg, resolve=True),
        metrics=metrics,
        channel_dim=cfg.pruning.dim if structured else None,
        num_classes=num_classes,
        example_input=getattr(module, "example_input_array", None),
    )
    summary.overrides = overrides
    summary.run_dir = str(output_dir.resolve())
    summary.dense_cache = dense_how
    summary.dense_time_s = dense_time
    if not trainer.is_global_zero:  # several processes (trainer.devices > 1): the first writes the outputs
        return summary
    if cfg.save_model:
        torch.save(network.state_dict(), output_dir / "model.pt")
        _export(summary, network, module, output_dir, input_shape, structured, units)
    summary.to_json(output_dir / "summary.json")
    curves_csv = _lay_end_to_end(output_dir, phases, output_dir / "logs" / "all_phases.csv")
    if cfg.plots:
        if curves_csv is not None:
            plot_training_curves(curves_csv, output_dir / "training_curves.png", title=_plot_title(cfg))
            if has_mask_movement(curves_csv):
                plot_mask_movement(curves_csv, output_dir / "mask_movement.png")
        plot_layer_sparsity(summary, output_dir / "layer_sparsity.png")
    _remove_stale_outputs(output_dir, [phase for phase, _ in phases], since=written_from)
    print(format_summary_table(summary))
    print(f"outputs: {output_dir}")
    return summary


STALE_CANDIDATES = (
    "model.pt",
    "model.safetensors",
    "model_compact.pt",
    "training_curves.png",
    "mask_movement.png",
    "layer_sparsity.png",
    "logs/all_phases.csv",
)
"""Outputs a run may write or not (``save_model``, ``plots``, the kind of run): a run into a directory that holds an
earlier run's removes those it did not write itself, so no file contradicts its ``summary.json``."""


def _forget_earlier_summary(output_dir: Path) -> None:
    """Remove the ``summary.json`` an earlier run left in ``output_dir``: this run writes its own when it succeeds,
    and if it fails, ``report`` must list the directory as failed, not the earlier run's results under this run's
    configuration (Hydra has replaced ``.hydra/`` already)."""
    earlier = output_dir / "summary.json"
    if earlier.is_file():
        earlier.unlink()
        log.warning("removed the summary.json of an earlier run in %s: this run writes its own when it finishes",
                    output_dir)  # fmt: skip


def _remove_stale_outputs(output_dir: Path, phases: Sequence[str], since: float) -> None:
    """Remove what an earlier run left in ``output_dir`` and this one did not write (older than ``since``, a
    ``time.time()``): the :data:`STALE_CANDIDATES` and the logs of phases this run does not have."""
    import shutil

    stale = [output_dir / name for name in STALE_CANDIDATES if (output_dir / name).is_file()]
    stale = [path for path in stale if path.stat().st_mtime < since]
    logs = output_dir / "logs"
    if logs.is_dir():
        stale += sorted(path for path in logs.iterdir() if path.is_dir() and path.name not in phases)
    for path in stale:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    if stale:
        names = ", ".join(str(path.relative_to(output_dir)) for path in stale)
        log.warning("removed outputs of an earlier run in %s that this run did not write: %s", output_dir, names)


def _example_input(module: Any, network: nn.Module, shape: Any) -> Any:
    """One input of the model: the module's ``example_input_array``, else zeros of the data's shape (a batch of one,
    in the network's dtype and device), else ``None``."""
    import torch

    example = getattr(module, "example_input_array", None)
    if example is None and shape is not None:
        reference = next(iter(network.parameters()))
        example = torch.zeros(1, *shape, dtype=reference.dtype, device=reference.device)
    return example


def _export(
    summary: Any, network: nn.Module, module: Any, output_dir: Path, shape: Any, structured: bool, units: bool = False
) -> None:
    """``model.safetensors`` (and the compact model of a structured or unit run), with the measured ratios in the
    summary."""

    from lightprune.experiment.exporting import export_run

    example = _example_input(module, network, shape)
    try:
        result = export_run(network, output_dir, example, structured=structured, units=units)
    except Exception as err:  # a state_dict safetensors cannot store: the run's other outputs still count
        log.warning("export skipped: %s", " ".join(str(err).split()))
        summary.export_notes = [f"export skipped: {err}"]
        return
    summary.file_size_ratio, summary.latency_ratio = result.file_size_ratio, result.latency_ratio
    summary.latency_model, summary.export_notes = result.deployed, result.notes
    for note in result.notes:
        log.info(note)


def _model_name(cfg: DictConfig) -> str:
    """``model.name``, or the class name of ``model._target_``."""
    return str(cfg.model.name) if is_bundled(cfg.model) else str(cfg.model._target_).rpartition(".")[2]


def _data_name(cfg: DictConfig) -> str:
    return str(cfg.data.name) if is_bundled(cfg.data) else str(cfg.data._target_).rpartition(".")[2]


def _plot_title(cfg: DictConfig) -> str:
    """What a reader of ``training_curves.png`` needs to know about the run, in one line."""
    p = cfg.pruning
    if p.preset == "none" or p.final_sparsity == 0:
        what = "no pruning"
    else:
        when = f"{p.rounds} rounds" if p.preset == "iterative_rounds" else f"{p.schedule} schedule"
        what = f"{p.method}, {p.scope}, {when}, to {100 * p.final_sparsity:g}% sparsity"
    return f"{_model_name(cfg)} on {_data_name(cfg)}: {what} (seed {cfg.seed})"


def _route_lightning_logs_to_hydra() -> None:
    """Lightning gives its loggers console handlers of their own; under Hydra, whose root handlers already print
    to the console and write the job's log file, every Lightning line would appear twice."""
    import lightning.pytorch  # noqa: F401  (adds the handlers on first import)

    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            if type(handler) is logging.StreamHandler:
                logger.removeHandler(handler)
        logger.propagate = True


def _debug() -> bool:
    """Show tracebacks: ``LIGHTPRUNE_DEBUG=1``, or Hydra's own ``HYDRA_FULL_ERROR=1``."""
    return any(os.environ.get(name, "") not in ("", "0") for name in (DEBUG_ENV, "HYDRA_FULL_ERROR"))


def _log_to_file(message: str) -> None:
    """Write an error into the job's log file only (``report`` gives it as the reason a run has no summary)."""
    record = logging.LogRecord(log.name, logging.ERROR, __file__, 0, message, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def _hydra_main(argv: Sequence[str]) -> int:
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    register_configs()
    # Optuna's storage layer logs its set-up at INFO when Hydra's Optuna sweeper imports it: not the user's business
    logging.getLogger("alembic").setLevel(logging.WARNING)
    failed: list[ConfigError] = []
    debug = _debug()  # before HYDRA_FULL_ERROR is set below

    @hydra.main(config_path=str(config_dir()), config_name="config", version_base="1.3")
    def _run_job(cfg: DictConfig) -> Any:
        from lightprune.experiment.search import check_directions, objective_value

        hydra_cfg = HydraConfig.get()
        _forget_earlier_summary(Path(hydra_cfg.runtime.output_dir))
        try:
            validate_config(cfg)  # before importing Lightning: a config error is reported in a moment
            check_directions(cfg.objective, hydra_cfg.sweeper)
            preflight(cfg)
            if logging.getLogger().handlers:
                _route_lightning_logs_to_hydra()
            summary = run_experiment(cfg, hydra_cfg.runtime.output_dir, overrides=list(hydra_cfg.overrides.task))
            return objective_value(summary.to_dict(), cfg.objective)  # what a sweeper optimises
        except Exception as err:
            _log_to_file(" ".join((_one_line(err) or f"{type(err).__name__}: {err}").split()))
            if isinstance(err, ConfigError) and hydra_cfg.mode == RunMode.RUN and not debug:
                failed.append(err)  # reported by main() alone, without Hydra's "Error executing job" line
                return None
            raise

    saved_argv, saved_full_error = sys.argv, os.environ.get("HYDRA_FULL_ERROR")
    sys.argv = [saved_argv[0], *argv]
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra re-raises instead of printing a partial traceback; main() reports
    try:
        _run_job()
    finally:
        sys.argv = saved_argv
        if saved_full_error is None:
            del os.environ["HYDRA_FULL_ERROR"]
        else:
            os.environ["HYDRA_FULL_ERROR"] = saved_full_error
    if failed:
        raise failed[0]
    return 0


def _config_key_error(err: BaseException) -> str | None:
    """For an unknown key Hydra could not override, the key and the closest known one (not Hydra's ``+key`` hint,
    which would add the misspelt key)."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    cause = err.__cause__
    if isinstance(cause, ConfigAttributeError | ConfigKeyError) and getattr(cause, "full_key", None):
        return unknown_key_message(str(cause.full_key))
    return None


def _one_line(err: BaseException) -> str | None:
    """A config error as one line (a few for several problems), or ``None`` when ``err`` is no config error.

    Config errors: :class:`~lightprune.experiment.config.ConfigError` and what Hydra and OmegaConf raise while
    composing the config (unknown keys, wrong types, unknown config group options, override syntax).
    """
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(err, ConfigError):
        header, *problems = str(err).splitlines()
        return f"{header} {problems[0].strip()}" if len(problems) == 1 else str(err)
    if not isinstance(err, HydraException | OmegaConfBaseException):
        return None
    key_error = _config_key_error(err)
    if key_error is not None:
        return f"invalid experiment config: {key_error}"
    text = str(err)
    if isinstance(err.__cause__, OmegaConfBaseException):
        text += "\n" + str(err.__cause__)
    parts: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("Config search path"):  # Hydra's internals, not the user's config
            break
        if not stripped or stripped.startswith(("To append", "full_key:", "object_type=", "reference_type=")):
            continue
        if line.startswith("\t") and parts and parts[-1].endswith((":", ",")):  # Hydra's list of available options
            parts[-1] = f"{parts[-1]} {stripped},"
            continue
        parts.append(stripped)
    return "; ".join(part.rstrip(",") for part in parts)


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point: ``lightprune-experiment [hydra overrides]``, ``lightprune-experiment report DIR`` or
    ``lightprune-experiment load RUN_DIR``.

    Returns:
        The exit status: 0, or 2 for a config error (printed as its message alone; ``LIGHTPRUNE_DEBUG=1`` raises it
        with its traceback). Other errors propagate.

    Example:
        >>> main(["report", "/nonexistent/multirun"])  # the message goes to stderr
        1
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "report":
        from lightprune.experiment.report import report_main

        return report_main(args[1:])
    if args and args[0] == "load":
        from lightprune.experiment.load import load_main

        return load_main(args[1:])
    try:
        return _hydra_main(args)
    except Exception as err:
        message = None if _debug() else _one_line(err)
        if message is None:
            raise
        print(f"lightprune-experiment: {message}", file=sys.stderr)
        return CONFIG_ERROR_STATUS


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
