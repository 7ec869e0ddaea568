"""The experiment app: one command runs a prune-finetune experiment and shows what pruning did.

``lightprune-experiment [overrides]`` (or ``python -m lightprune.experiment``) trains a dense model, prunes and
fine-tunes it with :class:`lightprune.PruningCallback`, and writes into Hydra's run directory:

* ``logs/dense`` and ``logs/prune`` (``logs/round_<r>`` for iterative rounds): Lightning's CSV logs (and
  TensorBoard's when it is installed);
* ``summary.json``: dense and final test accuracy, per-layer and total sparsity, compression ratio, theoretical
  speed-up, wall time and the config;
* ``training_curves.png`` (sparsity and accuracy over steps) and ``layer_sparsity.png``;
* ``model.pt``: the final pruned model's state_dict (plain parameters holding zeros).

``lightprune-experiment report <multirun dir>`` gathers a sweep (``-m``) into one Markdown table and one
accuracy-versus-sparsity plot.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

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


def build_callback(cfg: DictConfig, *, rounds_target: float | None = None, rewind: Any = None) -> Any:
    """A :class:`lightprune.PruningCallback` for ``cfg.pruning``, or ``None`` for the dense preset.

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
    return PruningCallback(
        _schedule(cfg, rounds_target),
        method=p.method,
        method_kwargs=method_kwargs,
        scope=p.scope,
        unit=p.unit,
        include=list(p.include) if p.include else None,
        exclude=list(p.exclude) if p.exclude else None,
        prune_channel_bias=p.prune_channel_bias,
        rewind=rewind,
        make_permanent=rounds_target is None,
        mask_dtype=torch.bool if p.mask_dtype == "bool" else None,
        log_per_parameter=p.log_per_parameter,
        seed=p.seed,
    )


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


def run_experiment(cfg: DictConfig, output_dir: str | Path) -> Any:
    """Run the whole experiment described by ``cfg`` and write its outputs into ``output_dir``.

    Returns:
        The :class:`~lightprune.experiment.report.RunSummary` written to ``summary.json``.

    Raises:
        ValueError: the config is invalid (every problem is listed); nothing has been trained then.
    """
    import lightning.pytorch as pl

    from lightprune import prune
    from lightprune.callback import PruningCallback
    from lightprune.experiment.models import Classifier, make_model
    from lightprune.experiment.report import format_summary_table, plot_layer_sparsity, plot_training_curves, summarize

    validate_config(cfg)
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
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

    dense = _trainer(cfg, output_dir, "dense", cfg.trainer.dense_epochs, [])
    dense.fit(module, datamodule=datamodule)
    dense_acc = _test_accuracy(dense, module, datamodule)

    metrics: dict[str, float] = {}
    curves_csv = output_dir / "logs" / "prune" / "metrics.csv"
    selection: list[tuple[Any, str]] | None = None
    if cfg.pruning.preset == "iterative_rounds" and build_callback(cfg) is not None:
        per_round = 1.0 - (1.0 - cfg.pruning.final_sparsity) ** (1.0 / cfg.pruning.rounds)
        callback = None
        for round_index in range(1, cfg.pruning.rounds + 1):
            target = 1.0 - (1.0 - per_round) ** round_index
            if round_index == cfg.pruning.rounds:
                target = cfg.pruning.final_sparsity
            rewind = initial_weights if cfg.pruning.rewind == "init" else None
            callback = build_callback(cfg, rounds_target=target, rewind=rewind)
            trainer = _trainer(cfg, output_dir, f"round_{round_index}", cfg.trainer.max_epochs, [callback])
            trainer.fit(module, datamodule=datamodule)
            metrics[f"round_{round_index}/test_acc"] = _test_accuracy(trainer, module, datamodule)
            metrics[f"round_{round_index}/sparsity"] = target
        assert callback is not None
        selection = [(m, n) for _, m, n in callback._selection]
        for m, n in selection:
            prune.remove(m, n)
        final_acc = metrics[f"round_{cfg.pruning.rounds}/test_acc"]
        curves_csv = output_dir / "logs" / f"round_{cfg.pruning.rounds}" / "metrics.csv"
    else:
        callback = build_callback(cfg)
        trainer = _trainer(cfg, output_dir, "prune", cfg.trainer.max_epochs, [callback])
        trainer.fit(module, datamodule=datamodule)
        final_acc = _test_accuracy(trainer, module, datamodule)
        if callback is not None:
            selection = [(m, n) for _, m, n in callback._selection]

    summary = summarize(
        module,
        input_shape=datamodule.dims,
        parameters=selection,
        dense_test_acc=dense_acc,
        final_test_acc=final_acc,
        wall_time_s=time.perf_counter() - started,
        config=OmegaConf.to_container(cfg, resolve=True),
        metrics=metrics,
    )
    summary.to_json(output_dir / "summary.json")
    if cfg.save_model:
        torch.save(module.model.state_dict(), output_dir / "model.pt")
    if cfg.plots:
        if curves_csv.is_file():
            plot_training_curves(curves_csv, output_dir / "training_curves.png")
        plot_layer_sparsity(summary, output_dir / "layer_sparsity.png")
    print(format_summary_table(summary))
    print(f"outputs: {output_dir}")
    return summary


def _hydra_main(argv: Sequence[str]) -> int:
    import hydra
    from hydra.core.hydra_config import HydraConfig

    register_configs()

    @hydra.main(config_path=str(config_dir()), config_name="config", version_base="1.3")
    def _run(cfg: DictConfig) -> None:
        run_experiment(cfg, HydraConfig.get().runtime.output_dir)

    saved = sys.argv
    sys.argv = [saved[0], *argv]
    try:
        _run()
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
