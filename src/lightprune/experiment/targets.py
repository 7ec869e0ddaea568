"""The app's models, data, optimizers and LR schedules given as Hydra ``_target_`` nodes.

* :func:`instantiate` - ``hydra.utils.instantiate`` whose failures are one-line config errors naming the config key,
  the import path and the constructor's complaint.
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

from lightprune.config import DATA_APP_KEYS, ConfigError, is_target

__all__ = ["data_facts", "instantiate", "make_scheduler", "source_digest"]

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
        lightprune.config.ConfigError: model: torch.nn.Linear(...) failed: TypeError: ...missing 1 required ...
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
        lightprune.config.ConfigError: data.num_classes: x.Data has no num_classes attribute; set data.num_classes=<int>
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
    plain = OmegaConf.to_container(data_cfg, resolve=True) if OmegaConf.is_config(data_cfg) else dict(data_cfg)
    return {key: value for key, value in plain.items() if key not in DATA_APP_KEYS}  # type: ignore[union-attr]


def make_scheduler(key: str, node: Any, optimizer: Any, length: int) -> Any:
    """An LR scheduler from a ``_partial_: true`` node; ``T_max`` / ``total_steps`` / ``total_iters``, when the
    scheduler takes one and the node does not set it, is ``length`` (the phase's epochs or steps).

    Example:
        >>> import torch
        >>> optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        >>> node = {"_target_": "torch.optim.lr_scheduler.CosineAnnealingLR", "_partial_": True}
        >>> make_scheduler("optim.dense.scheduler", node, optimizer, 10).T_max
        10
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
        return factory(optimizer, **extra)
    except Exception as err:
        raise ConfigError(f"{key}: {node['_target_']}(optimizer, ...) failed: {type(err).__name__}: {err}") from err


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
        if not is_target(node):
            continue
        found = True
        digest.update(str(node["_target_"]).encode())
        with contextlib.suppress(OSError, TypeError, ImportError):
            source = inspect.getsource(inspect.getmodule(get_object(node["_target_"])))  # type: ignore[arg-type]
            digest.update(source.encode())
    return digest.hexdigest()[:16] if found else None
