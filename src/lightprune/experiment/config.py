"""Typed configuration of the experiment app, registered in Hydra's ConfigStore.

The dataclasses are the schema of ``conf/``: OmegaConf checks every key and type against them, so a misspelt key or
a wrong type fails before anything runs, naming the key. :func:`validate_config` then checks ranges and choices that
types cannot express, with one message listing every problem.

Nothing here requires Hydra to be initialised: :func:`register_configs` is called by the app (and by tests that use
Hydra's compose API); the dataclasses are plain Python.

Example:
    >>> from omegaconf import OmegaConf
    >>> cfg = OmegaConf.structured(ExperimentConfig)
    >>> cfg.pruning.final_sparsity, cfg.data.name
    (0.9, 'digits')
    >>> validate_config(cfg)
"""

from __future__ import annotations

import difflib
import importlib
import math
import re
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lightprune import choices, registry, rules
from lightprune.schedules import SCHEDULES as SCHEDULE_CLASSES

__all__ = [
    "PRUNING_APP_KEYS",
    "CacheConfig",
    "ConfigError",
    "DataConfig",
    "ExperimentConfig",
    "ModelConfig",
    "OptimConfig",
    "PhaseOptimConfig",
    "PruningConfig",
    "TrainerConfig",
    "config_warnings",
    "is_bundled",
    "is_target",
    "method_kwargs",
    "objective_names",
    "register_configs",
    "unknown_keys",
    "validate_config",
]

DATASETS = choices.DATASETS
MODELS = choices.MODELS
OPTIMIZERS = choices.OPTIMIZERS
PRESETS = (
    "none", "one_shot", "gmp_cubic", "gmp_erk", "rigl_erk", "set_erk", "iterative_rounds", "ln_structured",
    "wanda_gradual", "movement", "nm_2_4", "sparsegpt_oneshot", "sparsegpt_2_4", "custom",
)  # fmt: skip
SCHEDULES = tuple(name for name in SCHEDULE_CLASSES if name != "points")
"""The schedules a config names (``points`` takes a list of times and sparsities, which the config does not have)."""
METHODS = choices.METHODS
SCOPES = choices.SCOPES
IMPORTANCES = choices.IMPORTANCES
UNITS = choices.UNITS
MASK_DTYPES = ("bool", "param")
ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps", "tpu")
PRECISIONS = (
    "32-true", "32", "64-true", "64", "16-mixed", "16-true", "16", "bf16-mixed", "bf16-true", "bf16",
    "transformer-engine", "transformer-engine-float16",
)  # fmt: skip
"""Lightning's precision strings (its ``_PRECISION_INPUT_STR`` and aliases)."""
INTERVALS = ("epoch", "step")
"""When an LR scheduler steps (Lightning's ``interval``)."""
TARGET_KEYS = ("_target_", "_partial_", "_args_", "_recursive_", "_convert_")
"""Hydra's instantiation keys."""
DATA_APP_KEYS = ("input_shape", "num_classes")
"""Keys of a ``data`` node with a ``_target_`` that the app reads instead of passing them to the constructor."""
MODEL_APP_KEYS = ("lr", "optimizer", "weight_decay")
"""Keys of a bundled ``model`` preset that configure the app's classifier, not the network's constructor."""
BUNDLED_DATA_TARGET = "lightprune.experiment.data.bundled_datamodule"
"""The ``_target_`` of every bundled ``data`` preset."""
BUNDLED_MODEL_TARGET = "lightprune.experiment.models.make_model"
"""The ``_target_`` of every bundled ``model`` preset (given the data's ``input_shape`` and ``num_classes``)."""
OBJECTIVES = (
    "final_test_acc", "total_sparsity", "compression_ratio", "theoretical_speedup", "dense_test_acc",
    "file_size_ratio", "latency_ratio", "nonzero_weights", "nonzero_flops", "wall_time_s", "dense_time_s",
    "total_weights", "dense_flops", "flops_unattributed", "num_classes",
)  # fmt: skip
"""What ``objective`` may name: the scalar (number) fields of a run's ``summary.json``
(:class:`~lightprune.experiment.summary.RunSummary`), the most searched first."""
PRUNING_APP_KEYS = (
    "_target_", "preset", "initial_sparsity", "final_sparsity", "start", "end", "frequency", "rounds", "n", "dim",
    "nm_n", "nm_m", "exclude_classifier",
)  # fmt: skip
"""The keys of :class:`PruningConfig` that name no argument of :class:`lightprune.PruningCallback`: they build its
schedule (:func:`pruning_schedule`), its ``method_kwargs`` (:func:`method_kwargs`) and its ``exclude`` patterns. Every
other key is passed to the callback under its own name (``lightprune.experiment.app.build_callback``)."""
MAX_SEED = 2**32 - 1
"""Seeds reach numpy through ``seed_everything``, which accepts 0 ... 2**32 - 1."""


@dataclass
class DataConfig:
    """Which data to train on.

    A bundled preset is itself a Hydra ``_target_`` node (:func:`lightprune.experiment.data.bundled_datamodule`):
    ``hydra.utils.instantiate(cfg.data)`` builds its datamodule.

    Attributes:
        _target_: the function that builds the datamodule from the other keys.
        name: ``digits`` (bundled with scikit-learn), ``fashion_mnist``, ``mnist`` or ``idx`` (any MNIST-layout dir).
        root: directory of the IDX files; ``None`` for the dataset's default location.
        batch_size: training batch size.
        val_size: validation examples held out from the training data (a fraction in (0, 1)).
        test_size: test fraction for ``digits`` (the IDX datasets have their own test files).
        limit: use at most this many training and test examples of an IDX dataset (quick runs); ``None``: all.
        flatten: give inputs as vectors (MLPs) instead of ``C x H x W`` images (CNNs).
        seed: seed of the split and the shuffling.
    """

    _target_: str = BUNDLED_DATA_TARGET
    name: str = "digits"
    root: str | None = None
    batch_size: int = 64
    val_size: float = 0.1
    test_size: float = 0.2
    limit: int | None = None
    flatten: bool = False
    seed: int = 0


@dataclass
class ModelConfig:
    """The network and its optimizer.

    A bundled preset is itself a Hydra ``_target_`` node (:func:`lightprune.experiment.models.make_model`, given the
    data's ``input_shape`` and ``num_classes``); ``lr``, ``optimizer`` and ``weight_decay`` are the app's classifier's.

    Attributes:
        _target_: the function that builds the network from ``name``, ``hidden`` and ``channels``.
        name: ``lenet300100`` (MLP) or ``small_cnn`` (Conv2d layers, for structured pruning).
        hidden: hidden layer sizes of the MLP.
        channels: output channels of the CNN's conv layers.
        lr: learning rate.
        optimizer: ``adam``, ``adamw`` or ``sgd``.
        weight_decay: weight decay.
    """

    _target_: str = BUNDLED_MODEL_TARGET
    name: str = "lenet300100"
    hidden: list[int] = field(default_factory=lambda: [300, 100])
    channels: list[int] = field(default_factory=lambda: [16, 32])
    lr: float = 1e-3
    optimizer: str = "adam"
    weight_decay: float = 0.0


@dataclass
class PhaseOptimConfig:
    """The optimizer and learning-rate schedule of one phase, as Hydra ``_partial_: true`` nodes.

    Attributes:
        optimizer: e.g. ``{_target_: torch.optim.SGD, _partial_: true, lr: 0.1, momentum: 0.9}``: called with the
            parameters. ``None``: ``model.optimizer`` / ``model.lr`` / ``model.weight_decay`` (Adam, lr 1e-3 for a
            model given by ``_target_``); for ``optim.prune``: the dense phase's.
        scheduler: e.g. ``{_target_: torch.optim.lr_scheduler.CosineAnnealingLR, _partial_: true}``: called with
            the optimizer. ``T_max`` / ``total_steps`` / ``total_iters``, when the node does not set them, are filled
            in with the phase's length in ``interval`` units. ``None``: a constant learning rate (for
            ``optim.prune``: the dense phase's scheduler, replayed).
        interval: ``epoch`` or ``step``: when the scheduler steps.
    """

    optimizer: Any = None
    scheduler: Any = None
    interval: str = "epoch"


@dataclass
class OptimConfig:
    """Optimizer and learning-rate schedule of the dense phase and of the pruning / fine-tuning phase.

    Ignored for a model that is a ``LightningModule`` (its own ``configure_optimizers`` is used), except
    ``lr_rewind``.

    Attributes:
        dense: the dense phase's.
        prune: the pruning / fine-tuning phase's (each round's for ``iterative_rounds``); unset parts: the dense's.
        lr_rewind: learning-rate rewinding (Renda, Frankle & Carbin 2020): every pruning fit (each round) replays
            its schedule from the start. ``false``: fine-tuning, at the learning rate the previous phase ended with
            and without a scheduler.
    """

    dense: PhaseOptimConfig = field(default_factory=PhaseOptimConfig)
    prune: PhaseOptimConfig = field(default_factory=PhaseOptimConfig)
    lr_rewind: bool = True


@dataclass
class PruningConfig:
    """How to prune during the fine-tuning phase (mirrors :class:`lightprune.PruningCallback`).

    Times (``start``, ``end``, ``frequency``) are fractions of the fine-tuning run, counted in ``unit``.

    Attributes:
        _target_: what ``hydra.utils.instantiate(cfg.pruning)`` calls in a user's own Hydra app (the experiment app
            builds its callbacks itself): :func:`lightprune.experiment.app.pruning_callback`.
        preset: name of the preset this config came from (``none`` disables pruning).
        method: ``l1_unstructured``, ``random_unstructured``, ``ln_structured``, ``random_structured``,
            ``semi_structured`` (N:M, one event to ``1 - nm_n/nm_m``: ``schedule=constant``), ``neurons`` or
            ``heads`` (transformer units found from the model; ``final_sparsity`` is then the share of units) or the
            import path of a ``BasePruningMethod`` subclass.
        scope: ``global`` (one ranking over all selected weights), ``layerwise``, ``row`` (every output row to the
            target, Wanda's ranking; ``l1_unstructured`` only), ``erk`` (per-layer amounts from the
            Erdős–Rényi-Kernel rule: small layers keep more) or ``owl`` (per-layer amounts from each layer's share
            of outliers of ``|W| * ||X||``; ``importance=activation``); ``erk`` and ``owl`` take unstructured methods.
        schedule: ``constant`` (one-shot at ``start``), ``linear``, ``cubic`` (Zhu & Gupta) or ``geometric``.
        initial_sparsity: sparsity at the first event of a linear/cubic ramp.
        final_sparsity: target total sparsity at the end of the schedule.
        start: first event: a fraction of the fine-tuning run (a float, ``0.1``) or a time on the clock of ``unit``
            (an int, ``100`` steps), as ``lightprune.schedules`` reads times.
        end: last event, the same way.
        frequency: time between events, the same way: ``1`` is an event every step (or epoch), ``1.0`` one period
            lasting the whole run.
        unit: ``step`` (optimizer steps) or ``epoch``.
        rounds: number of rounds of ``iterative_rounds`` (each a fresh fit that prunes, rewinds and retrains).
        rewind: ``init`` to rewind the unpruned weights to their initial values (before the dense phase) after each
            event; ``None``: off.
        n: order of the norm of ``ln_structured``.
        dim: channel dimension of the structured methods (0: output channels).
        prune_channel_bias: with a structured method on dim 0, also zero the bias of pruned channels.
        include: regular expressions of parameter names to prune (``None``: every Linear/Conv weight).
        exclude: regular expressions of parameter names to skip.
        exclude_classifier: leave the model's classifier unpruned, the last Linear layer its forward calls on an
            example input; structured pruning of its output channels would remove whole classes.
        mask_dtype: ``bool`` (1 byte per weight) or ``param`` (the parameter's dtype).
        log_per_parameter: log the sparsity of every pruned tensor.
        seed: seed of the random methods.
        importance: what ranks the weights: ``magnitude``, ``activation`` (Wanda: ``|W|`` times the input feature's
            L2 norm over the batches of ``activation_window`` steps before each event), ``movement``
            (``-sum W * dL/dW`` since the previous event; ``l1_unstructured`` or ``semi_structured``) or ``obs``
            (Optimal Brain Surgeon saliency from ``X^T X`` of the layers' inputs, with SparseGPT's update of the
            kept weights; ``l1_unstructured`` or ``semi_structured``).
        activation_window: steps (or epochs) of input statistics before each event, for ``importance=activation``
            or ``obs``.
        calibration_batches: training batches run forward before fine-tuning starts, so that an event at its start
            has input statistics (``importance=activation`` or ``obs``).
        reconstruct: with ``importance=obs``, update the kept weights at each event (``null``: on for obs); with
            ``neurons``/``heads``, refit the projections reading the units by least squares on the inputs collected
            in the ``activation_window`` (an event at the start needs ``calibration_batches``).
        sequential: with ``importance=obs`` and calibration batches, prune the event at the start block by block,
            each block's statistics taken through the blocks already pruned (SparseGPT's one-shot procedure).
        adopt_zeros: weights already exactly zero when fine-tuning starts stay zero (masked).
        max_layer_sparsity: the largest share of any one layer's weights (channels) that may be pruned, in (0, 1];
            ``1.0``: no cap. A global ranking can otherwise prune a layer away entirely (layer collapse); with a cap
            the global total stays exact. In ``layerwise``/``row`` scope it may not be below ``final_sparsity``.
        owl_threshold: OWL's ``M``, for ``scope=owl``: a score above ``M`` times its block's mean is an outlier (a
            block: a transformer block, the tensors named alike up to the first numeric part; else one tensor).
        owl_lambda: OWL's ``lambda``, for ``scope=owl``: the blocks' sparsities span ``2 * lambda`` around the target.
        regrow: dynamic sparse training during the fine-tuning phase: ``rigl`` (regrow where the dense gradient is
            largest) or ``set`` (at random); ``None``: masks only grow.
        regrow_every: optimizer steps between mask updates.
        regrow_fraction: the share of each layer's active weights moved at the first update, decayed by a cosine
            to 0 at ``regrow_until``.
        regrow_until: the fraction of the fine-tuning run after which masks stay put.
        nm_n: weights kept in every group of ``semi_structured``.
        nm_m: the group size of ``semi_structured`` (must divide every pruned layer's input size).
    """

    _target_: str = "lightprune.experiment.app.pruning_callback"
    preset: str = "gmp_cubic"
    method: str = "l1_unstructured"
    scope: str = "global"
    schedule: str = "cubic"
    initial_sparsity: float = 0.0
    final_sparsity: float = 0.9
    start: float | int = 0.0
    end: float | int = 0.6
    frequency: float | int = 0.02
    unit: str = "step"
    rounds: int = 3
    rewind: str | None = None
    n: float = 2.0
    dim: int = 0
    prune_channel_bias: bool = False
    include: list[str] | None = None
    exclude: list[str] | None = None
    exclude_classifier: bool = False
    mask_dtype: str = "bool"
    log_per_parameter: bool = True
    seed: int = 0
    importance: str = "magnitude"
    activation_window: int = 1
    calibration_batches: int = 0
    reconstruct: bool | None = None
    sequential: bool = False
    adopt_zeros: bool = False
    max_layer_sparsity: float = 1.0
    owl_threshold: float = 5.0
    owl_lambda: float = 0.08
    regrow: str | None = None
    regrow_every: int = choices.REGROW_EVERY
    regrow_fraction: float = choices.REGROW_FRACTION
    regrow_until: float = choices.REGROW_UNTIL
    nm_n: int = 2
    nm_m: int = 4


@dataclass
class TrainerConfig:
    """Arguments of the Lightning Trainer for each phase.

    Attributes:
        dense_epochs: epochs of dense training before pruning (the dense baseline's accuracy is measured there).
        max_epochs: epochs of the pruning / fine-tuning phase (per round for ``iterative_rounds``).
        accelerator: ``cpu``, ``gpu`` or ``auto``.
        devices: number of devices.
        precision: Lightning precision string.
        log_every_n_steps: how often Lightning logs training metrics.
        enable_progress_bar: show Lightning's progress bar.
        accumulate_grad_batches: gradient accumulation.
        deterministic: ask torch for deterministic algorithms.
        num_threads: CPU threads of torch's intra-op pool during the run (``torch.set_num_threads``, restored
            afterwards); ``None``: torch's default. Tiny models often train faster with 1, above all on a busy machine.
    """

    dense_epochs: int = 8
    max_epochs: int = 16
    accelerator: str = "cpu"
    devices: int = 1
    precision: str = "32-true"
    log_every_n_steps: int = 5
    enable_progress_bar: bool = True
    accumulate_grad_batches: int = 1
    deterministic: bool = False
    num_threads: int | None = None


@dataclass
class CacheConfig:
    """Reuse of the dense phase across runs and sweeps.

    The dense phase depends only on the data, the model, the seed, the dense phase's trainer settings and the code
    (lightprune's app and the torch / Lightning versions): runs that share all of them (a sweep over pruning
    settings) train it once and load it afterwards, with the same weights, logs, dense accuracy and random state.

    Attributes:
        dense: look the dense phase up in the cache, and store it there after training it.
        dir: cache directory; ``None``: ``$LIGHTPRUNE_CACHE_DIR``, else ``$XDG_CACHE_HOME/lightprune``, else
            ``~/.cache/lightprune``.
        retrain: train the dense phase even when it is cached, and replace the cached one.
    """

    dense: bool = True
    dir: str | None = None
    retrain: bool = False


@dataclass
class ExperimentConfig:
    """A whole prune-finetune experiment.

    Attributes:
        name: a label for the run (shown in reports).
        seed: global seed (the initial weights and training's random numbers; the data's split and batch order
            follow ``data.seed``).
        save_model: write the final pruned model's state_dict to ``model.pt``.
        plots: draw the PNG plots.
        objective: what the run returns to a Hydra sweeper (Optuna, Ax, Nevergrad): the name of a scalar field of
            ``summary.json`` (one of :data:`OBJECTIVES`), whose value is returned as ``summary.json`` holds it, or a
            list of two or more names, returned as a tuple (Optuna's multi-objective search).
    """

    data: Any = field(default_factory=DataConfig)
    """A :class:`DataConfig`, or any ``LightningDataModule`` as a Hydra ``_target_`` node (plus ``input_shape`` /
    ``num_classes`` where the datamodule has no such attributes)."""
    model: Any = field(default_factory=ModelConfig)
    """A :class:`ModelConfig`, or any ``nn.Module`` / ``LightningModule`` as a Hydra ``_target_`` node."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    pruning: PruningConfig = field(default_factory=PruningConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    name: str = "experiment"
    seed: int = 0
    save_model: bool = True
    plots: bool = True
    objective: Any = "final_test_acc"


def register_configs() -> None:
    """Register the schema in Hydra's ConfigStore as ``experiment_schema`` (used by ``conf/config.yaml``), and the
    schemas of the bundled ``model`` and ``data`` options as ``schema/model`` and ``schema/data``.

    ``model`` and ``data`` are left empty in ``experiment_schema``: a bundled option brings its schema (its
    defaults list names ``/schema/model@_here_``), so its keys and types are checked as before, while a node with
    a ``_target_`` may have any keys (its constructor's arguments).

    Example:
        >>> register_configs()
        >>> from hydra.core.config_store import ConfigStore
        >>> "experiment_schema.yaml" in ConfigStore.instance().repo
        True
    """
    from hydra.core.config_store import ConfigStore

    schema = OmegaConf.structured(ExperimentConfig)
    schema.model = None
    schema.data = None
    store = ConfigStore.instance()
    store.store(name="experiment_schema", node=schema)
    store.store(group="schema", name="model", node=ModelConfig)
    store.store(group="schema", name="data", node=DataConfig)


def is_target(node: Any) -> bool:
    """Whether a config node is a Hydra ``_target_`` node (a class or function to call).

    Example:
        >>> is_target({"_target_": "torch.nn.Linear", "in_features": 4}), is_target({"name": "digits"})
        (True, False)
    """
    return (isinstance(node, dict) or OmegaConf.is_dict(node)) and "_target_" in node


def is_bundled(node: Any) -> bool:
    """Whether a ``model`` or ``data`` node is one of the app's bundled presets (whose keys the schema checks),
    rather than a user's ``_target_``.

    Example:
        >>> is_bundled({"_target_": BUNDLED_MODEL_TARGET, "name": "lenet300100"}), is_bundled({"name": "digits"})
        (True, True)
        >>> is_bundled({"_target_": "torch.nn.Linear", "in_features": 4})
        False
    """
    if not (isinstance(node, dict) or OmegaConf.is_dict(node)):
        return False
    return node.get("_target_", BUNDLED_DATA_TARGET) in (BUNDLED_DATA_TARGET, BUNDLED_MODEL_TARGET)


class ConfigError(ValueError):
    """A problem with the experiment config, fixed by changing the config: the app prints the message alone.

    Example:
        >>> isinstance(ConfigError("data.root: not found"), ValueError)
        True
    """


def _schema_keys(schema: type = ExperimentConfig, prefix: str = "") -> list[str]:
    """Every full key of the schema, groups included (``data``, ``data.root``, ...)."""
    keys = []
    for item in fields(schema):
        key = prefix + item.name
        keys.append(key)
        default = item.default_factory() if callable(item.default_factory) else None  # type: ignore[misc]
        if is_dataclass(default):
            keys += _schema_keys(type(default), key + ".")
    return keys


def _closest_key(key: str) -> str:
    """`` (did you mean X?)`` for the schema key closest to ``key``, or nothing if none is close.

    The key's last part is compared with the names of its group, then with every name (the right name in the wrong
    group).
    """
    known = _schema_keys()
    group, _, leaf = key.rpartition(".")
    siblings = {k.rpartition(".")[2]: k for k in known if k.rpartition(".")[0] == group}
    match = difflib.get_close_matches(leaf, list(siblings), n=1, cutoff=0.6)
    if match:
        return f" (did you mean {siblings[match[0]]}?)"
    elsewhere = [k for k in known if k.rpartition(".")[2] == leaf]
    return f" (did you mean {elsewhere[0]}?)" if elsewhere else ""


def unknown_key_message(key: str) -> str:
    """The message for a key the schema does not have, naming the closest known key.

    Example:
        >>> unknown_key_message("pruning.final_sparsty")
        'pruning.final_sparsty: not a config key (did you mean pruning.final_sparsity?)'
    """
    group, _, leaf = key.partition(".")
    if group in ("model", "data") and leaf == "_target_":
        return (
            f"{key}: the bundled {group} options take no _target_; replace the option with one: "
            f"~{group} +{group}={{_target_:...}} on the command line, or a {group}/<name>.yaml of your own "
            "config directory (--config-dir)"
        )
    return f"{key}: not a config key{_closest_key(key)}"


def unknown_keys(cfg: DictConfig) -> list[str]:
    """Full keys of ``cfg`` that the schema (:class:`ExperimentConfig`) does not have.

    Hydra lets ``+key=value`` add a key to a config built from the schema; the app would store it and ignore it, so
    :func:`validate_config` rejects it.

    Example:
        >>> from omegaconf import open_dict
        >>> cfg = OmegaConf.structured(ExperimentConfig)
        >>> with open_dict(cfg.pruning):
        ...     cfg.pruning.final_sparsty = 0.5
        >>> unknown_keys(cfg)
        ['pruning.final_sparsty']
    """
    known = set(_schema_keys())
    found = []

    def walk(node: Any, prefix: str) -> None:
        for key in node:
            full = f"{prefix}{key}"
            if full not in known:
                found.append(full)
            elif OmegaConf.is_dict(node._get_node(key)) and _schema_node(full, node[key]):
                walk(node[key], full + ".")

    walk(cfg, "")
    return found


def _schema_node(key: str, node: Any) -> bool:
    """Whether the schema describes the keys of ``node``: every group but a user's ``_target_`` node (whose keys are
    its constructor's arguments); ``pruning``'s ``_target_`` is the schema's own."""
    return key == "pruning" or not is_target(node) or is_bundled(node)


def config_warnings(cfg: DictConfig | ExperimentConfig) -> list[str]:
    """Settings that are valid but probably not meant: one message each (the app logs them as warnings).

    Example:
        >>> cfg = OmegaConf.structured(ExperimentConfig)
        >>> cfg.pruning.final_sparsity = 1.0
        >>> config_warnings(cfg)
        ['pruning.final_sparsity=1.0 removes every selected weight: the pruned layers will output only their biases']
    """
    if not isinstance(cfg, DictConfig):
        cfg = OmegaConf.structured(cfg)
    messages = []
    if cfg.pruning.preset != "none" and cfg.pruning.final_sparsity >= 1.0:
        messages.append(
            f"pruning.final_sparsity={cfg.pruning.final_sparsity} removes every selected weight: "
            "the pruned layers will output only their biases"
        )
    if cfg.pruning.preset == "none" and cfg.pruning.final_sparsity != 0:
        messages.append(
            f"pruning.final_sparsity={cfg.pruning.final_sparsity} is not used with pruning=none: the model stays dense "
            "(choose a pruning preset, e.g. pruning=gmp_cubic, to prune)"
        )
    optim = cfg.get("optim")
    if optim is not None and not optim.lr_rewind:
        for key, what in (("scheduler", "is not used"), ("optimizer", "keeps its kind, but not its learning rate")):
            if optim.prune.get(key) is not None:
                messages.append(
                    f"optim.prune.{key} {what} with optim.lr_rewind=false: each pruning fit trains at the learning "
                    "rate the previous phase ended with, without a scheduler (optim.lr_rewind=true replays it)"
                )
    if cfg.pruning.preset == "none" and cfg.pruning.adopt_zeros:
        messages.append(
            "pruning.adopt_zeros=true is not used with pruning=none: no callback masks the zeros (choose a preset with "
            "pruning.final_sparsity=0 to keep them while fine-tuning)"
        )
    messages += _unused_schedule_keys(cfg.pruning)
    if is_bundled(cfg.data) and cfg.data.get("name") == "digits" and cfg.data.get("limit") is not None:
        messages.append(f"data.limit={cfg.data.limit} is not used with data=digits (1,797 examples, all used)")
    return messages


SCHEDULE_READS = {
    "constant": ("final_sparsity", "start"),
    "geometric": ("final_sparsity", "rounds", "start", "frequency"),
    "linear": ("initial_sparsity", "final_sparsity", "start", "end", "frequency"),
    "cubic": ("initial_sparsity", "final_sparsity", "start", "end", "frequency"),
}
"""The ``pruning`` keys each schedule reads (:func:`pruning_schedule`)."""


def _unused_schedule_keys(pruning: Any) -> list[str]:
    """One message per timing key set away from its default that the preset's schedule does not read (it would
    change nothing): ``iterative_rounds`` prunes once at the start of each round, and reads only the sparsity and the
    number of rounds."""
    if pruning.preset == "none":
        return []  # config_warnings says the whole pruning group is unused
    defaults = OmegaConf.structured(PruningConfig)
    if pruning.preset == "iterative_rounds":
        defaults.schedule = "geometric"  # the preset's own: the rounds are geometric
        reads: tuple[str, ...] = ("final_sparsity", "rounds")
        what = "pruning=iterative_rounds, which prunes once at the start of each of pruning.rounds rounds"
        candidates = ("schedule", "initial_sparsity", "start", "end", "frequency")
    else:
        reads = SCHEDULE_READS.get(pruning.schedule, ())
        what = f"pruning.schedule={pruning.schedule}"
        candidates = ("initial_sparsity", "start", "end", "frequency", "rounds")
    return [
        f"pruning.{key}={pruning[key]} is not used by {what} (it reads {', '.join(f'pruning.{k}' for k in reads)}): "
        "it changes nothing"
        for key in candidates
        if key not in reads and key in pruning and pruning[key] != defaults[key]
    ]


def _check(problems: list[str], ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        problems.append(f"{key}={value!r}: {allowed}")


def objective_names(objective: Any) -> list[str]:
    """The summary fields an ``objective`` value names, in order: ``[name]`` for one name, the list for a list.

    Example:
        >>> objective_names("final_test_acc"), objective_names(["final_test_acc", "total_sparsity"])
        (['final_test_acc'], ['final_test_acc', 'total_sparsity'])
    """
    plain = OmegaConf.to_container(objective) if OmegaConf.is_config(objective) else objective
    return [plain] if isinstance(plain, str) else [str(name) for name in plain]


def _check_objective(problems: list[str], objective: Any) -> None:
    """``objective``: one name of :data:`OBJECTIVES`, or a non-empty list of them."""
    plain = OmegaConf.to_container(objective) if OmegaConf.is_config(objective) else objective
    names = f"one of {', '.join(OBJECTIVES)} (the scalar fields of summary.json)"
    allowed = f"{names}, or a list of them"
    if isinstance(plain, str):
        _check(problems, plain in OBJECTIVES, "objective", plain, allowed)
    elif isinstance(plain, list) and plain:
        bad = [name for name in plain if name not in OBJECTIVES]
        if bad:
            problems.append(f"objective={plain!r}: {bad[0]!r} is not {names}")
    else:
        _check(problems, False, "objective", plain, allowed)


def _check_patterns(problems: list[str], key: str, patterns: Any) -> None:
    """Every entry of ``patterns`` (a list of regular expressions, or ``None``) must compile."""
    for pattern in patterns or []:
        try:
            re.compile(pattern)
        except re.error as err:
            problems.append(f"{key}: {pattern!r} is not a regular expression ({err})")


STRUCTURED_METHODS = choices.STRUCTURED_METHODS
_SCHEDULE_KEYS = {
    "initial": "initial_sparsity",
    "final": "final_sparsity",
    "sparsity": "final_sparsity",
    "fraction": "final_sparsity",
    "at": "start",
    "start": "start",
    "end": "end",
    "frequency": "frequency",
    "rounds": "rounds",
}
"""The ``pruning`` key behind each argument of the schedule classes (see :func:`pruning_schedule`)."""


def method_kwargs(pruning: Any) -> dict[str, Any]:
    """The callback's ``method_kwargs`` for a ``pruning`` config: every argument its method's registry entry fills in
    (:attr:`~lightprune.registry.Method.defaults`) that the config holds, under the argument's name (``dim``, ``n``),
    or with the prefix ``nm_`` for an N:M method (``nm_n``, ``nm_m``: ``n`` is ``ln_structured``'s norm); and
    ``pruning.dim`` for every structured method, registered without defaults or given by import path too (the
    channels' dim; its other arguments keep its constructor's defaults).

    Example:
        >>> method_kwargs(OmegaConf.structured(PruningConfig(method="ln_structured", dim=1)))
        {'dim': 1, 'n': 2.0}
        >>> method_kwargs(OmegaConf.structured(PruningConfig(method="semi_structured")))
        {'n': 2, 'm': 4}
        >>> method_kwargs(OmegaConf.structured(PruningConfig(method="lightprune.prune.RandomStructured", dim=1)))
        {'dim': 1}
    """
    entry = registry.get(pruning.method)
    prefix = "nm_" if entry is not None and entry.kind == "n:m" else ""
    keys = list(entry.defaults or {}) if entry is not None else []
    if "dim" not in keys and _structured(pruning.method, entry):
        keys.append("dim")
    return {key: pruning[prefix + key] for key in keys if prefix + key in pruning}


def _structured(method: str, entry: registry.Method | None) -> bool:
    """Whether ``method`` (a registry name or an import path) prunes channels; an import that fails is the callback's
    to report."""
    if entry is not None:
        return entry.kind == "structured"
    module_name, _, class_name = method.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError):
        return False
    return getattr(cls, "PRUNING_TYPE", None) == "structured"


def per_round(pruning: Any) -> float:
    """The fraction of the remaining weights each of ``pruning.rounds`` geometric events (or rounds) prunes, so that
    the last reaches ``pruning.final_sparsity``: ``1 - (1 - s) ** (1 / rounds)``.

    Example:
        >>> round(per_round(OmegaConf.create({"final_sparsity": 0.75, "rounds": 2})), 6)
        0.5
    """
    return 1.0 - (1.0 - pruning.final_sparsity) ** (1.0 / pruning.rounds)


def pruning_schedule(pruning: Any) -> Any:
    """The :class:`~lightprune.schedules.Schedule` of a ``pruning`` config (times as fractions of the run), built by
    :func:`~lightprune.schedules.make_schedule` from the registry name ``pruning.schedule``; it checks its arguments.

    Example:
        >>> pruning_schedule(OmegaConf.structured(PruningConfig))
        Cubic(initial=0.0, final=0.9, start=0.0, end=0.6, frequency=0.02)
    """
    from lightprune.schedules import make_schedule

    # a float is a fraction of the fine-tuning run, an int a time on the callback's clock (steps or epochs), as the
    # library reads them: frequency=1 is an event every step (or epoch), frequency=1.0 one period of the whole run
    times = {"start": pruning.start, "frequency": pruning.frequency}
    arguments: dict[str, dict[str, Any]] = {
        "constant": {"sparsity": pruning.final_sparsity, "at": pruning.start},
        "geometric": {"fraction": per_round(pruning), **times, "rounds": pruning.rounds},
        "linear": {"initial": pruning.initial_sparsity, "final": pruning.final_sparsity, "end": pruning.end, **times},
    }
    arguments["cubic"] = arguments["linear"]
    return make_schedule(pruning.schedule, **arguments[pruning.schedule])


def _schedule_problem(err: ValueError) -> str:
    """A schedule's complaint (``"initial=0.5 must be ..."``) under the ``pruning`` key it comes from."""
    text = str(err)
    name, _, rest = text.partition("=")
    if name in _SCHEDULE_KEYS:
        value, _, why = rest.partition(" ")
        return f"pruning.{_SCHEDULE_KEYS[name]}={value}: {why}"
    return f"pruning.schedule={text}"


STATISTICS_IMPORTANCES = choices.STATISTICS_IMPORTANCES


def _check_rules(problems: list[str], pruning: Any) -> None:
    """The rules tying method, scope, criterion and N:M pattern together: :mod:`lightprune.rules`, the callback's
    own, listed under the ``pruning.`` keys; then what only the config's fractions of the run can break."""
    importance, method = pruning.importance, pruning.method
    _check(problems, importance in IMPORTANCES, "pruning.importance", importance, f"one of {IMPORTANCES}")
    _check(problems, pruning.activation_window >= 1, "pruning.activation_window", pruning.activation_window, ">= 1")
    _check(
        problems, pruning.calibration_batches >= 0, "pruning.calibration_batches", pruning.calibration_batches, ">= 0"
    )
    kind = rules.kind_of(method)
    units = method in choices.UNIT_METHODS
    reconstruct = bool(pruning.reconstruct) and units  # the units' refit (OBS's update is checked by obs_problems)
    found = rules.method_problems(
        method, kind, scope=pruning.scope, prune_channel_bias=pruning.prune_channel_bias, dim=pruning.dim
    )
    found += rules.importance_problems(
        importance,
        method,
        calibration_batches=pruning.calibration_batches,
        scope=pruning.scope,
        reconstruct=reconstruct,
    )
    found += rules.owl_problems(pruning.owl_threshold, pruning.owl_lambda, scope=pruning.scope)
    found += rules.regrow_problems(
        pruning.regrow,
        pruning.regrow_every,
        pruning.regrow_fraction,
        pruning.regrow_until,
        method=method,
        kind=kind,
        scope=pruning.scope,
    )
    found += rules.cap_problems(pruning.max_layer_sparsity, scope=pruning.scope, final_sparsity=pruning.final_sparsity)
    found += rules.obs_problems(
        importance,
        reconstruct=None if units else pruning.reconstruct,
        sequential=pruning.sequential,
        scope=pruning.scope,
        calibration_batches=pruning.calibration_batches,
        max_layer_sparsity=pruning.max_layer_sparsity,
    )
    entry = registry.get(method)
    if entry is not None and entry.kind == "n:m":
        _check(problems, pruning.nm_m >= 2, "pruning.nm_m", pruning.nm_m, "a group of >= 2 weights")
        _check(problems, 1 <= pruning.nm_n < pruning.nm_m, "pruning.nm_n", pruning.nm_n, f"in [1, nm_m={pruning.nm_m})")
        if 1 <= pruning.nm_n < pruning.nm_m:
            one_event = pruning.schedule == "constant"
            found += rules.n_m_problems(
                method,
                pruning.nm_n,
                pruning.nm_m,
                one_event=one_event,
                sparsity=pruning.final_sparsity,
                schedule=pruning.schedule,
            )
    problems += [problem.format("pruning.") for problem in found]
    ramp = pruning.schedule in ("linear", "cubic")  # a ramp's first event is at level initial_sparsity
    first_level = pruning.initial_sparsity if ramp else pruning.final_sparsity
    first_at_start = pruning.start == 0 and first_level > 0  # every schedule's first event is at `start`
    _check(
        problems,
        not (first_at_start and importance == "movement"),
        "pruning.start",
        pruning.start,
        "pruning.importance=movement needs training steps before the first event that prunes: start > 0",
    )
    _check(
        problems,
        not (first_at_start and importance in STATISTICS_IMPORTANCES and pruning.calibration_batches == 0),
        "pruning.start",
        pruning.start,
        f"pruning.importance={importance} with an event at the start needs pruning.calibration_batches > 0",
    )
    _check(
        problems,
        not (first_at_start and reconstruct and pruning.calibration_batches == 0),
        "pruning.start",
        pruning.start,
        "pruning.reconstruct=true with an event at the start needs pruning.calibration_batches > 0",
    )


def _typed(problems: list[str], cfg: DictConfig, key: str, schema: type) -> Any:
    """``cfg[key]`` checked against ``schema`` (``None`` for a ``_target_`` node, whose targets are checked here)."""
    node = cfg[key]
    if is_target(node) and not is_bundled(node):
        _check_target(problems, key, node)
        if key == "data":
            shape = node.get("input_shape")
            _check(
                problems,
                shape is None or (OmegaConf.is_list(shape) and all(isinstance(d, int) and d >= 1 for d in shape)),
                "data.input_shape",
                shape,
                "None (the datamodule's dims) or a list of sizes >= 1",
            )
            classes = node.get("num_classes")
            _check(
                problems,
                classes is None or (isinstance(classes, int) and classes >= 1),
                "data.num_classes",
                classes,
                "None (the datamodule's num_classes) or an int >= 1",
            )
        return None
    if node is None:
        return OmegaConf.structured(schema)
    if OmegaConf.get_type(node) is schema:
        return node
    try:  # a plain node (a user's config without the bundled schema): check its keys and types
        return OmegaConf.merge(OmegaConf.structured(schema), node)
    except Exception as err:  # OmegaConf's ValidationError / ConfigKeyError
        problems.append(f"{key}: {str(err).splitlines()[0]} (or give a _target_)")
        return None


def _check_target(problems: list[str], key: str, node: Any, partial: bool | None = None) -> None:
    """A ``_target_`` node: the target imports, and ``_partial_`` is set where the app calls it with arguments."""
    from hydra._internal.utils import _locate  # hydra.utils.get_object, without its error log line

    target = node.get("_target_")
    try:
        _locate(str(target))
    except Exception as err:
        cause = str(err.__cause__ or err).splitlines()[0]
        problems.append(f"{key}: _target_ {target!r} cannot be imported ({cause})")
    if partial and not node.get("_partial_", False):
        problems.append(
            f"{key}: _partial_ must be true (the app calls {target} with "
            f"{'the parameters' if key.endswith('optimizer') else 'the optimizer'})"
        )


def _check_optim(problems: list[str], optim: Any) -> None:
    for phase in ("dense", "prune"):
        node = optim[phase]
        for part in ("optimizer", "scheduler"):
            value = node[part]
            key = f"optim.{phase}.{part}"
            if value is None:
                continue
            if not is_target(value):
                problems.append(
                    f"{key}={OmegaConf.to_container(value) if OmegaConf.is_config(value) else value!r}: "
                    "None or a node with _target_ and _partial_: true"
                )
                continue
            _check_target(problems, key, value, partial=True)
        _check(problems, node.interval in INTERVALS, f"optim.{phase}.interval", node.interval, f"one of {INTERVALS}")


def _check_data(problems: list[str], data: Any) -> None:
    _check(problems, data.name in DATASETS, "data.name", data.name, f"one of {DATASETS}")
    root = None if OmegaConf.is_missing(data, "root") else data.root
    _check(problems, data.name != "idx" or root is not None, "data.root", root, "required for data=idx")
    _check(problems, data.batch_size >= 1, "data.batch_size", data.batch_size, "must be >= 1")
    _check(problems, 0 < data.val_size < 1, "data.val_size", data.val_size, "must be in (0, 1)")
    _check(problems, 0 < data.test_size < 1, "data.test_size", data.test_size, "must be in (0, 1)")
    _check(
        problems,
        data.name != "digits" or data.val_size + data.test_size < 1,
        "data.test_size",
        data.test_size,
        f"data.val_size + data.test_size must be < 1 (data.val_size={data.val_size})",
    )
    _check(problems, data.limit is None or data.limit >= 1, "data.limit", data.limit, "must be None or >= 1")
    _check(problems, 0 <= data.seed <= MAX_SEED, "data.seed", data.seed, f"must be in [0, {MAX_SEED}]")


def _check_model(problems: list[str], model: Any) -> None:
    _check(problems, model.name in MODELS, "model.name", model.name, f"one of {MODELS}")
    _check(problems, all(h >= 1 for h in model.hidden), "model.hidden", list(model.hidden), "sizes must be >= 1")
    _check(
        problems,
        len(model.channels) >= 1 and all(c >= 1 for c in model.channels),
        "model.channels",
        list(model.channels),
        "one or more sizes, each >= 1",
    )
    _check(problems, model.lr > 0 and math.isfinite(model.lr), "model.lr", model.lr, "must be > 0 and finite")
    _check(problems, model.optimizer in OPTIMIZERS, "model.optimizer", model.optimizer, f"one of {OPTIMIZERS}")
    _check(
        problems,
        model.weight_decay >= 0 and math.isfinite(model.weight_decay),
        "model.weight_decay",
        model.weight_decay,
        "must be >= 0 and finite",
    )


def validate_config(cfg: DictConfig | ExperimentConfig) -> None:
    """Check ranges and choices of a whole experiment config; raise one error listing every problem.

    Types and key names are checked by OmegaConf against the schema when the config is composed; this checks what
    types cannot express. It reads the config only: nothing is built or trained.

    Raises:
        ConfigError: a ``ValueError`` naming each bad key, its value and what is allowed, and each key the schema
            does not have (added with Hydra's ``+key=value``) with the closest known key.

    Example:
        >>> cfg = OmegaConf.structured(ExperimentConfig)
        >>> cfg.pruning.final_sparsity = 1.5
        >>> validate_config(cfg)
        Traceback (most recent call last):
        ...
        lightprune.experiment.config.ConfigError: invalid experiment config:
          pruning.final_sparsity=1.5: must be in [0, 1]
    """
    if not isinstance(cfg, DictConfig):
        cfg = OmegaConf.structured(cfg)
    problems: list[str] = [unknown_key_message(key) for key in unknown_keys(cfg)]
    pruning, trainer = cfg.pruning, cfg.trainer
    data = _typed(problems, cfg, "data", DataConfig)
    model = _typed(problems, cfg, "model", ModelConfig)
    if data is not None:
        _check_data(problems, data)
    if model is not None:
        _check_model(problems, model)
    if model is not None and data is not None:
        _check(
            problems,
            not (model.name == "small_cnn" and data.flatten),
            "data.flatten",
            data.flatten,
            "model=small_cnn needs images: set data.flatten=false",
        )
    _check_optim(problems, cfg.optim)
    _check(problems, pruning.preset in PRESETS, "pruning.preset", pruning.preset, f"one of {PRESETS}")
    _check(
        problems,
        pruning.method in METHODS or "." in pruning.method,
        "pruning.method",
        pruning.method,
        f"one of {METHODS} or an import path",
    )
    structured = pruning.method in STRUCTURED_METHODS
    _check(problems, pruning.scope in SCOPES, "pruning.scope", pruning.scope, f"one of {SCOPES}")
    _check(problems, pruning.schedule in SCHEDULES, "pruning.schedule", pruning.schedule, f"one of {SCHEDULES}")
    _check(problems, pruning.rounds >= 1, "pruning.rounds", pruning.rounds, "must be >= 1")
    _check(problems, 0 <= pruning.seed <= MAX_SEED, "pruning.seed", pruning.seed, f"must be in [0, {MAX_SEED}]")
    if pruning.schedule in SCHEDULES and pruning.rounds >= 1:  # the schedule checks its own arguments
        try:
            pruning_schedule(pruning)
        except ValueError as err:
            problems.append(_schedule_problem(err))
    _check(problems, pruning.unit in UNITS, "pruning.unit", pruning.unit, f"one of {UNITS}")
    _check(problems, pruning.rewind in (None, "init"), "pruning.rewind", pruning.rewind, "None or 'init'")
    _check(problems, pruning.n > 0, "pruning.n", pruning.n, "the order of a norm, must be > 0")
    if structured:  # every pruned weight must have the dim: Linear weights have 2 dims, Conv2d weights 4
        convs_only = model is not None and model.name == "small_cnn" and pruning.exclude_classifier
        ndim = 4 if convs_only else 2
        why = "the Conv2d weights have 4 dims" if convs_only else "the Linear weights have 2 dims"
        if model is not None and model.name == "small_cnn" and not convs_only:
            why += " (pruning.exclude_classifier=true prunes only the convs)"
        allowed = f"must be in [{-ndim}, {ndim - 1}]: {why}"
        if model is not None:  # a model given by _target_: its weights decide (the callback checks them)
            _check(problems, -ndim <= pruning.dim < ndim, "pruning.dim", pruning.dim, allowed)
    _check_rules(problems, pruning)
    _check_patterns(problems, "pruning.include", pruning.include)
    _check_patterns(problems, "pruning.exclude", pruning.exclude)
    _check(
        problems, pruning.mask_dtype in MASK_DTYPES, "pruning.mask_dtype", pruning.mask_dtype, f"one of {MASK_DTYPES}"
    )
    _check(problems, trainer.dense_epochs >= 1, "trainer.dense_epochs", trainer.dense_epochs, "must be >= 1")
    _check(problems, trainer.max_epochs >= 1, "trainer.max_epochs", trainer.max_epochs, "must be >= 1")
    _check(problems, trainer.devices >= 1, "trainer.devices", trainer.devices, "must be >= 1")
    _check(
        problems,
        trainer.accelerator in ACCELERATORS,
        "trainer.accelerator",
        trainer.accelerator,
        f"one of {ACCELERATORS}",
    )
    _check(problems, trainer.precision in PRECISIONS, "trainer.precision", trainer.precision, f"one of {PRECISIONS}")
    _check(problems, trainer.log_every_n_steps >= 1, "trainer.log_every_n_steps", trainer.log_every_n_steps, ">= 1")
    _check(
        problems,
        trainer.accumulate_grad_batches >= 1,
        "trainer.accumulate_grad_batches",
        trainer.accumulate_grad_batches,
        "must be >= 1",
    )
    _check(
        problems,
        trainer.num_threads is None or trainer.num_threads >= 1,
        "trainer.num_threads",
        trainer.num_threads,
        "must be None (torch's default) or >= 1",
    )
    _check(problems, 0 <= cfg.seed <= MAX_SEED, "seed", cfg.seed, f"must be in [0, {MAX_SEED}]")
    _check_objective(problems, cfg.objective)
    if problems:
        raise ConfigError("invalid experiment config:\n  " + "\n  ".join(problems))
