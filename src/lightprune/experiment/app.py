"""The experiment app: one command runs a prune-finetune experiment and shows what pruning did.

``lightprune-experiment [overrides]`` (or ``python -m lightprune.experiment``) trains a dense model, prunes and
fine-tunes it with :class:`lightprune.PruningCallback`, and writes into Hydra's run directory:

* ``logs/dense`` and ``logs/prune`` (``logs/round_<r>`` for iterative rounds): Lightning's CSV logs (and
  TensorBoard's when it is installed); ``logs/all_phases.csv``: all of them laid end to end, steps counted from
  the start of the run (what ``training_curves.png`` shows);
* ``summary.json``: dense and final test accuracy, per-layer and total sparsity, compression ratio, theoretical
  speed-up, wall time and the config;
* ``training_curves.png`` (sparsity and accuracy over steps) and ``layer_sparsity.png``;
* ``model.pt``: the final pruned model's state_dict (plain parameters holding zeros).

``lightprune-experiment report <multirun dir>`` gathers a sweep (``-m``) into one Markdown table and one
accuracy-versus-sparsity plot.
"""

from __future__ import annotations

import contextlib
import csv
import logging
import re
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from lightprune.config import register_configs, validate_config

__all__ = ["build_callback", "config_dir", "main", "run_experiment"]

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
    """The pruning schedule of ``cfg.pruning`` (times as fractions of the fine-tuning run)."""
    from lightprune.schedules import Constant, Cubic, Geometric, Linear

    p = cfg.pruning
    if rounds_target is not None:  # one round of iterative_rounds: prune once when the round's fit starts
        return Constant(rounds_target, at=0)
    if p.schedule == "constant":
        return Constant(p.final_sparsity, at=float(p.start))
    if p.schedule == "geometric":
        per_event = 1.0 - (1.0 - p.final_sparsity) ** (1.0 / p.rounds)
        return Geometric(per_event, start=float(p.start), frequency=float(p.frequency), rounds=p.rounds)
    ramp = Cubic if p.schedule == "cubic" else Linear
    return ramp(
        initial=p.initial_sparsity,
        final=p.final_sparsity,
        start=float(p.start),
        end=float(p.end),
        frequency=float(p.frequency),
    )


def _classifier_weight(module: nn.Module) -> str:
    """Qualified name of the weight of ``module``'s last ``nn.Linear`` (the classifier head)."""
    linears = [name for name, child in module.named_modules() if isinstance(child, nn.Linear)]
    if not linears:
        raise ValueError("pruning.exclude_classifier=true, but the model has no nn.Linear layer")
    return f"{linears[-1]}.weight" if linears[-1] else "weight"


def _exclude_patterns(cfg: DictConfig, module: nn.Module | None) -> list[str] | None:
    """``cfg.pruning.exclude``, plus the classifier's weight when ``cfg.pruning.exclude_classifier`` is set."""
    exclude = list(cfg.pruning.exclude) if cfg.pruning.exclude else []
    if cfg.pruning.exclude_classifier:
        if module is None:
            raise ValueError("pruning.exclude_classifier=true needs the model: pass build_callback(cfg, module=...)")
        exclude.append(re.escape(_classifier_weight(module)))
    return exclude or None


def build_callback(
    cfg: DictConfig,
    *,
    module: nn.Module | None = None,
    rounds_target: float | None = None,
    rewind: Any = None,
    make_permanent: bool = True,
) -> Any:
    """A :class:`lightprune.PruningCallback` for ``cfg.pruning``, or ``None`` for the dense preset.

    Args:
        cfg: the experiment config.
        module: the LightningModule to prune; needed for ``pruning.exclude_classifier`` (and for nothing else).
        rounds_target: for one round of ``iterative_rounds``: prune once, when the round's fit starts, to this.
        rewind: the callback's ``rewind=``, e.g. a :meth:`~lightprune.PruningCallback.snapshot_weights` dict of
            the initial weights. ``None`` with ``pruning.rewind=init``: rewind to the weights at the start of fit.
        make_permanent: remove the pruning reparametrization at the end of fit (plain weights with zeros).

    Example:
        >>> from lightprune.config import ExperimentConfig
        >>> callback = build_callback(OmegaConf.structured(ExperimentConfig))
        >>> type(callback).__name__, callback.scope, type(callback.schedule).__name__
        ('PruningCallback', 'global', 'Cubic')
    """
    from lightprune.callback import PruningCallback

    p = cfg.pruning
    if p.preset == "none" or p.final_sparsity == 0:
        return None
    structured = p.method in ("ln_structured", "random_structured")
    method_kwargs: dict[str, Any] = {"dim": p.dim} if structured else {}
    if p.method == "ln_structured":
        method_kwargs["n"] = p.n
    if rewind is None and p.rewind is not None:
        rewind = p.rewind
    return PruningCallback(
        _schedule(cfg, rounds_target),
        method=p.method,
        method_kwargs=method_kwargs,
        scope=p.scope,
        unit=p.unit,
        include=list(p.include) if p.include else None,
        exclude=_exclude_patterns(cfg, module),
        prune_channel_bias=p.prune_channel_bias,
        rewind=rewind,
        make_permanent=make_permanent,
        mask_dtype=torch.bool if p.mask_dtype == "bool" else None,
        log_per_parameter=p.log_per_parameter,
        log_every_n_steps=cfg.trainer.log_every_n_steps,
        seed=p.seed,
    )


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
        raise ValueError(f"pruning.include / pruning.exclude: {err}") from err


def _datamodule(cfg: DictConfig) -> Any:
    from lightprune.experiment.data import make_datamodule

    d = cfg.data
    kwargs: dict[str, Any] = {"val_size": d.val_size, "seed": d.seed, "flatten": d.flatten, "batch_size": d.batch_size}
    if d.name == "digits":
        kwargs["test_size"] = d.test_size
    else:
        kwargs["root"] = d.root
        kwargs["limit"] = d.limit
    return make_datamodule(d.name, **kwargs)


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
    return pl.Trainer(
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


def _test_accuracy(trainer: Any, module: Any, datamodule: Any) -> float:
    results = trainer.test(module, datamodule=datamodule, verbose=False)
    return float(results[0]["test/acc"])


@contextlib.contextmanager
def _torch_threads(num_threads: int | None) -> Iterator[None]:
    """Run with ``torch.set_num_threads(num_threads)`` (``None``: leave it), restoring the previous count after."""
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
    per_round = 1.0 - (1.0 - p.final_sparsity) ** (1.0 / p.rounds)
    targets = [1.0 - (1.0 - per_round) ** r for r in range(1, p.rounds + 1)]
    targets[-1] = p.final_sparsity
    return targets


def _plan(cfg: DictConfig, module: nn.Module, rewind: Any) -> list[tuple[str, float | None, Any]]:
    """The phases after the dense one, as ``(log name, round target or None, callback or None)``.

    Every callback is built here, before any training, so that a bad method, method argument or selection fails
    at once rather than after the dense phase.
    """
    try:
        if cfg.pruning.preset == "iterative_rounds" and build_callback(cfg, module=module) is not None:
            targets = _round_targets(cfg)
            plan: list[tuple[str, float | None, Any]] = [
                (
                    f"round_{index}",
                    target,
                    build_callback(
                        cfg, module=module, rounds_target=target, rewind=rewind, make_permanent=index == len(targets)
                    ),
                )
                for index, target in enumerate(targets, start=1)
            ]
        else:
            plan = [("prune", None, build_callback(cfg, module=module, rewind=rewind))]
    except ValueError as err:  # the callback's own checks, e.g. of a method given by import path
        raise ValueError(f"invalid pruning config (pruning.*): {err}") from err
    if plan[0][2] is not None:
        _check_selection(plan[0][2], module)
    return plan


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


def run_experiment(cfg: DictConfig, output_dir: str | Path) -> Any:
    """Run the whole experiment described by ``cfg`` and write its outputs into ``output_dir``.

    Returns:
        The :class:`~lightprune.experiment.report.RunSummary` written to ``summary.json``.

    Raises:
        ValueError: the config is invalid (every problem is listed), or the pruning method or selection does not
            fit the model; nothing has been trained or written then.
    """
    validate_config(cfg)
    with _torch_threads(cfg.trainer.num_threads):
        return _run(cfg, Path(output_dir))


def _run(cfg: DictConfig, output_dir: Path) -> Any:
    import lightning.pytorch as pl

    from lightprune.callback import PruningCallback
    from lightprune.experiment.models import Classifier, make_model
    from lightprune.experiment.report import format_summary_table, plot_layer_sparsity, plot_training_curves, summarize

    started = time.perf_counter()
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    datamodule = _datamodule(cfg)
    model_kwargs: dict[str, Any] = (
        {"hidden": tuple(cfg.model.hidden)}
        if cfg.model.name == "lenet300100"
        else {"channels": tuple(cfg.model.channels)}
    )
    network = make_model(cfg.model.name, datamodule.dims, datamodule.num_classes, **model_kwargs)
    module = Classifier(network, lr=cfg.model.lr, optimizer=cfg.model.optimizer, weight_decay=cfg.model.weight_decay)
    initial_weights = PruningCallback.snapshot_weights(module)
    plan = _plan(cfg, module, rewind=initial_weights if cfg.pruning.rewind == "init" else None)
    output_dir.mkdir(parents=True, exist_ok=True)

    dense = _trainer(cfg, output_dir, "dense", cfg.trainer.dense_epochs, [])
    dense.fit(module, datamodule=datamodule)
    phases = [("dense", dense.global_step)]
    dense_acc = _test_accuracy(dense, module, datamodule)

    metrics: dict[str, float] = {}
    final_acc = dense_acc
    for phase, target, callback in plan:
        trainer = _trainer(cfg, output_dir, phase, cfg.trainer.max_epochs, [callback])
        trainer.fit(module, datamodule=datamodule)
        phases.append((phase, trainer.global_step))
        final_acc = _test_accuracy(trainer, module, datamodule)
        if target is not None:
            metrics[f"{phase}/test_acc"] = final_acc
            metrics[f"{phase}/sparsity"] = target
    last_callback = plan[-1][2]

    summary = summarize(
        module,
        input_shape=datamodule.dims,
        parameters=None if last_callback is None else last_callback.selection,
        dense_test_acc=dense_acc,
        final_test_acc=final_acc,
        wall_time_s=time.perf_counter() - started,
        config=OmegaConf.to_container(cfg, resolve=True),
        metrics=metrics,
    )
    summary.to_json(output_dir / "summary.json")
    if cfg.save_model:
        torch.save(module.model.state_dict(), output_dir / "model.pt")
    curves_csv = _lay_end_to_end(output_dir, phases, output_dir / "logs" / "all_phases.csv")
    if cfg.plots:
        if curves_csv is not None:
            plot_training_curves(curves_csv, output_dir / "training_curves.png")
        plot_layer_sparsity(summary, output_dir / "layer_sparsity.png")
    print(format_summary_table(summary))
    print(f"outputs: {output_dir}")
    return summary


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


def _hydra_main(argv: Sequence[str]) -> int:
    import hydra
    from hydra.core.hydra_config import HydraConfig

    register_configs()

    @hydra.main(config_path=str(config_dir()), config_name="config", version_base="1.3")
    def _run_job(cfg: DictConfig) -> None:
        validate_config(cfg)  # before importing Lightning: a config error is reported in a moment
        if logging.getLogger().handlers:
            _route_lightning_logs_to_hydra()
        run_experiment(cfg, HydraConfig.get().runtime.output_dir)

    saved = sys.argv
    sys.argv = [saved[0], *argv]
    try:
        _run_job()
    finally:
        sys.argv = saved
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point: ``lightprune-experiment [hydra overrides]`` or ``lightprune-experiment report DIR``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "report":
        from lightprune.experiment.report import report_main

        return report_main(args[1:])
    return _hydra_main(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
