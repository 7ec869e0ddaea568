"""The app's models, data, optimizers and LR schedules given as Hydra ``_target_`` nodes.

* :func:`instantiate` - ``hydra.utils.instantiate`` whose failures are one-line config errors naming the config key,
  the import path and the constructor's complaint.
* :func:`build_datamodule` / :func:`build_model` - the ``data`` and ``model`` nodes, bundled presets and a user's
  targets alike, built through :func:`instantiate`; a model's constructor gets the data's sizes where it needs them.
* :func:`data_facts` - what the app needs from a datamodule (input shape, number of classes): its attributes, else
  the ``data.input_shape`` / ``data.num_classes`` keys, else a one-line error naming the missing key.
* :func:`make_scheduler` - an LR scheduler from a ``_partial_`` node, its length filled in from the phase.
* :func:`source_digest` - a hash of the files defining a config's targets (part of the dense-phase cache key).
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
from collections.abc import Mapping
from typing import Any

from omegaconf import OmegaConf

from lightprune.experiment.config import DATA_APP_KEYS, MODEL_APP_KEYS, ConfigError, is_bundled, is_target

__all__ = ["build_datamodule", "build_model", "data_facts", "instantiate", "make_scheduler", "source_digest"]

_LENGTH_ARGUMENTS = ("T_max", "total_steps", "total_iters")
"""Scheduler arguments that take the length of the run (CosineAnnealingLR, OneCycleLR, LinearLR / PolynomialLR)."""


def _root_cause(err: BaseException) -> BaseException:
    while err.__cause__ is not None:
        err = err.__cause__
    return err


def instantiate(key: str, node: Any, *args: Any, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate(node, *args, **kwargs)``; a failure becomes a one-line :class:`ConfigError`.

    Example:
        >>> instantiate("model", {"_target_": "torch.nn.Linear", "in_features": 2, "out_features": 1}).out_features
        1
        >>> instantiate("model", {"_target_": "torch.nn.Linear", "in_features": 2})
        Traceback (most recent call last):
        ...
        lightprune.experiment.config.ConfigError: model: torch.nn.Linear(...) failed: TypeError: ...missing 1 ...
    """
    from hydra.utils import instantiate as hydra_instantiate

    target = node["_target_"]
    try:
        return hydra_instantiate(node, *args, **kwargs)
    except Exception as err:
        cause = _root_cause(err)
        text = " ".join(str(cause).split()) or type(cause).__name__
        if "Error locating target" in str(err) or isinstance(cause, ImportError):
            raise ConfigError(f"{key}: _target_ {target!r} cannot be imported ({text})") from err
        raise ConfigError(f"{key}: {target}(...) failed: {type(cause).__name__}: {text}") from err


def make_optimizer(key: str, node: Any, params: list[Any]) -> Any:
    """An optimizer from a ``_partial_: true`` node over ``params``; a failure (an unknown argument, a negative
    learning rate) becomes a one-line :class:`ConfigError` naming ``key``.

    Example:
        >>> import torch
        >>> params = [torch.zeros(1, requires_grad=True)]
        >>> make_optimizer("optim.dense.optimizer", {"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.1},
        ...                params).defaults["lr"]
        0.1
        >>> make_optimizer("optim.dense.optimizer", {"_target_": "torch.optim.SGD", "_partial_": True, "lr": -1},
        ...                params)
        Traceback (most recent call last):
        ...
        lightprune.experiment.config.ConfigError: optim.dense.optimizer: torch.optim.SGD(params, ...) failed: \
ValueError: Invalid learning rate: -1
    """
    factory = instantiate(key, node)
    try:
        return factory(params)
    except Exception as err:
        raise ConfigError(f"{key}: {node['_target_']}(params, ...) failed: {type(err).__name__}: {err}") from err


def data_facts(data_cfg: Any, datamodule: Any, needed: bool) -> tuple[tuple[int, ...] | None, int | None]:
    """The input shape (one example, no batch dimension) and number of classes of the data.

    From ``datamodule.dims`` (or ``input_shape``) and ``datamodule.num_classes``, else the config's
    ``data.input_shape`` / ``data.num_classes``. ``needed``: a missing number of classes is an error (the app's
    classifier wrapper needs it; a LightningModule that brings its own metrics does not). A missing shape only
    means no FLOPs are counted, unless the model gives an ``example_input_array``.

    Example:
        >>> class Data:
        ...     dims = (1, 8, 8)
        >>> data_facts({"_target_": "x.Data"}, Data(), needed=False)
        ((1, 8, 8), None)
        >>> data_facts({"_target_": "x.Data", "num_classes": 3}, Data(), needed=True)
        ((1, 8, 8), 3)
        >>> data_facts({"_target_": "x.Data"}, Data(), needed=True)
        Traceback (most recent call last):
        ...
        lightprune.experiment.config.ConfigError: data.num_classes: x.Data has no num_classes attribute; set \
data.num_classes=<int>
    """
    shape = getattr(datamodule, "dims", None) or getattr(datamodule, "input_shape", None)
    if shape is None and data_cfg.get("input_shape") is not None:
        shape = data_cfg["input_shape"]
    classes = getattr(datamodule, "num_classes", None)
    if classes is None:
        classes = data_cfg.get("num_classes")
    if classes is None and needed:
        target = data_cfg.get("_target_", type(datamodule).__name__)
        raise ConfigError(f"data.num_classes: {target} has no num_classes attribute; set data.num_classes=<int>")
    return (None if shape is None else tuple(int(d) for d in shape)), (None if classes is None else int(classes))


def datamodule_node(data_cfg: Any) -> Any:
    """The ``data`` node without the app's own keys (``input_shape``, ``num_classes``), for instantiation.

    Example:
        >>> datamodule_node({"_target_": "x.Data", "batch_size": 8, "num_classes": 3})
        {'_target_': 'x.Data', 'batch_size': 8}
    """
    return {key: value for key, value in _plain(data_cfg).items() if key not in DATA_APP_KEYS}


def _plain(node: Any) -> dict[str, Any]:
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else dict(node)  # type: ignore


def build_datamodule(data_cfg: Any) -> Any:
    """The datamodule of a ``data`` node: a bundled preset or a user's ``_target_`` (without the app's keys).

    Example:
        >>> build_datamodule({"_target_": "lightprune.experiment.data.bundled_datamodule", "name": "digits"}).dims
        (1, 8, 8)
    """
    return instantiate("data", datamodule_node(data_cfg))


def build_model(model_cfg: Any, input_shape: Any, num_classes: int | None) -> Any:
    """The network (or LightningModule) of a ``model`` node: a bundled preset or a user's ``_target_``.

    A constructor argument ``input_shape`` or ``num_classes`` that has no default and that the node leaves unset is
    given the data's (an argument with a default keeps it: the data never overrides a value silently). The bundled
    presets' ``lr``, ``optimizer`` and ``weight_decay`` are the app's classifier's, not the constructor's.

    Example:
        >>> node = {"_target_": "lightprune.experiment.models.make_model", "name": "lenet300100", "lr": 0.1}
        >>> build_model(node, (1, 8, 8), 10).fc1.in_features
        64
    """
    from hydra._internal.utils import _locate  # hydra.utils.get_object, without its error log line

    node = _plain(model_cfg)
    if is_bundled(node):
        node = {key: value for key, value in node.items() if key not in MODEL_APP_KEYS}
    facts = {"input_shape": None if input_shape is None else tuple(input_shape), "num_classes": num_classes}
    try:
        target = _locate(str(node["_target_"]))
        params = inspect.signature(target).parameters
    except Exception:  # not importable or no signature: instantiate reports it, or calls it as it is
        params = {}
    extra = {
        name: value
        for name, value in facts.items()
        if name in params and params[name].default is inspect.Parameter.empty and name not in node and value is not None
    }
    return instantiate("model", node, **extra)


def make_scheduler(key: str, node: Any, optimizer: Any, length: int) -> Any:
    """An LR scheduler from a ``_partial_: true`` node; ``T_max`` / ``total_steps`` / ``total_iters``, when the
    scheduler takes one and the node does not set it, is ``length`` (the phase's epochs or steps).

    Example:
        >>> import torch
        >>> optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        >>> node = {"_target_": "torch.optim.lr_scheduler.CosineAnnealingLR", "_partial_": True}
        >>> make_scheduler("optim.dense.scheduler", node, optimizer, 10).T_max
        10
        >>> make_scheduler("optim.prune.scheduler", {"_target_": "torch.optim.lr_scheduler.ReduceLROnPlateau",
        ...                "_partial_": True}, optimizer, 10)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lightprune.experiment.config.ConfigError: optim.prune.scheduler: ...ReduceLROnPlateau steps on a monitored ...
    """
    factory = instantiate(key, node)
    func = getattr(factory, "func", factory)
    given = set(getattr(factory, "keywords", {}) or {})
    try:
        names = inspect.signature(func).parameters
    except (TypeError, ValueError):
        names = {}
    extra = {name: length for name in _LENGTH_ARGUMENTS if name in names and name not in given}
    try:
        scheduler = factory(optimizer, **extra)
    except Exception as err:
        raise ConfigError(f"{key}: {node['_target_']}(optimizer, ...) failed: {type(err).__name__}: {err}") from err
    if hasattr(scheduler, "step") and "metrics" in inspect.signature(scheduler.step).parameters:
        raise ConfigError(  # ReduceLROnPlateau: Lightning needs a metric to monitor, which no phase of the app names
            f"{key}: {node['_target_']} steps on a monitored metric, which the app's phases do not pass; use a "
            "schedule in steps or epochs (CosineAnnealingLR, OneCycleLR, StepLR...)"
        )
    return scheduler


def source_digest(cfg: Mapping[str, Any]) -> str | None:
    """A hash of the source files of the ``_target_`` classes of ``model`` and ``data`` (``None`` when there are
    none), so that editing a user's model retrains a cached dense phase.

    Example:
        >>> source_digest({"model": {"name": "lenet300100"}, "data": {"name": "digits"}}) is None
        True
        >>> len(source_digest({"model": {"_target_": "lightprune.experiment.models.SmallCNN"}, "data": {}}))
        16
    """
    from hydra.utils import get_object

    digest = hashlib.sha256()
    found = False
    for group in ("model", "data"):
        node = cfg.get(group)
        if not is_target(node) or is_bundled(node):  # the bundled ones are part of lightprune's version
            continue
        found = True
        digest.update(str(node["_target_"]).encode())
        with contextlib.suppress(OSError, TypeError, ImportError):
            source = inspect.getsource(inspect.getmodule(get_object(node["_target_"])))  # type: ignore[arg-type]
            digest.update(source.encode())
    return digest.hexdigest()[:16] if found else None
