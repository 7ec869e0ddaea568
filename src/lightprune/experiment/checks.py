"""Checks of an experiment config that look beyond its values (data files, the model's parameter names), made before
Lightning is imported so that a mistake is reported in about a second.

:func:`preflight` raises :class:`~lightprune.experiment.config.ConfigError`, as
:func:`~lightprune.experiment.config.validate_config` does for values.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

from lightprune.experiment.config import ConfigError, is_bundled
from lightprune.experiment.datafiles import FASHION_MNIST_ROOT, IDX_FILES, default_root, missing_idx_files

if TYPE_CHECKING:  # torch is imported where a model is built: the value checks come before it loads
    from torch import nn

__all__ = ["classifier_weight", "exclude_patterns", "preflight"]


def classifier_weight(module: nn.Module, example: Any = None) -> str:
    """Qualified name of the weight of ``module``'s classifier head: the last ``nn.Linear`` its forward calls on
    ``example`` (``module.example_input_array`` when not given; eval mode, no gradient, the modules' modes restored),
    else, with no example to run, the last one it defines.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> classifier_weight(nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)))
        '2.weight'
        >>> class HeadFirst(nn.Module):  # the output layer defined before a hidden one
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.classifier, self.proj = nn.Linear(8, 10), nn.Linear(4, 8)
        ...     def forward(self, x):
        ...         return self.classifier(self.proj(x).relu())
        >>> classifier_weight(HeadFirst()), classifier_weight(HeadFirst(), torch.zeros(1, 4))
        ('proj.weight', 'classifier.weight')
    """
    import torch
    from torch import nn

    from lightprune._modes import eval_mode

    linears: dict[nn.Module, str] = {c: name for name, c in module.named_modules() if isinstance(c, nn.Linear)}
    if not linears:
        raise ConfigError("pruning.exclude_classifier=true, but the model has no nn.Linear layer")
    last = list(linears.values())[-1]
    example = getattr(module, "example_input_array", None) if example is None else example
    if example is not None:
        called: list[nn.Module] = []
        handles = [child.register_forward_hook(lambda m, *_: called.append(m)) for child in linears]
        try:
            with eval_mode(module), torch.no_grad():
                module(*example) if isinstance(example, tuple) else module(example)
        finally:
            for handle in handles:
                handle.remove()
        if called:
            last = linears[called[-1]]
    return f"{last}.weight" if last else "weight"


def exclude_patterns(cfg: DictConfig, module: nn.Module | None, example: Any = None) -> list[str] | None:
    """``cfg.pruning.exclude``, plus the classifier's weight when ``cfg.pruning.exclude_classifier`` is set (found by
    running ``example``, one input of the model: :func:`classifier_weight`)."""
    exclude = list(cfg.pruning.exclude) if cfg.pruning.exclude else []
    if cfg.pruning.exclude_classifier:
        if module is None:
            raise ValueError(
                "pruning.exclude_classifier=true needs the model: pass it, "
                "hydra.utils.instantiate(cfg.pruning, module=model) (or build_callback(cfg, module=model))"
            )
        exclude.append(re.escape(classifier_weight(module, example)))
    return exclude or None


def _accelerator_problems(cfg: DictConfig) -> list[str]:
    """``trainer.accelerator`` names a device this machine has (``auto`` and ``cpu`` always do)."""
    accelerator = cfg.trainer.accelerator
    if accelerator not in ("gpu", "cuda", "mps"):
        return []
    import torch

    if accelerator == "mps" and not torch.backends.mps.is_available():
        return ["trainer.accelerator='mps': no MPS device is available here; use cpu or auto"]
    if accelerator != "mps" and not torch.cuda.is_available():
        return [f"trainer.accelerator={accelerator!r}: no CUDA device is available here; use cpu or auto"]
    return []


def _data_problems(cfg: DictConfig) -> list[str]:
    if not is_bundled(cfg.data):  # a user's datamodule finds its own files
        return []
    name = cfg.data.name
    root = cfg.data.root or default_root(name)
    if name == "digits" or root is None:  # digits is bundled; idx without root is validate_config's to report
        return []
    missing = missing_idx_files(root)
    if not missing:
        return []
    expected = ", ".join(f"{stem}[.gz]" for stem in IDX_FILES.values())
    where = f"{root} (the default for data={name})" if not cfg.data.root else str(root)
    found = f"lacks {', '.join(missing)}" if Path(root).is_dir() else "is not a directory"
    hint = f"set data.root=<directory holding {expected}>"
    if name == "fashion_mnist" and str(root) == FASHION_MNIST_ROOT:
        hint += ", or on Debian/Ubuntu: apt-get install dataset-fashion-mnist"
    return [f"data.root={cfg.data.root!r}: {where} {found}; {hint}"]


def _selection_problems(cfg: DictConfig) -> list[str]:
    from lightprune.experiment.targets import build_model
    from lightprune.selection import select_parameters

    p = cfg.pruning
    if p.preset == "none" or p.final_sparsity == 0 or not is_bundled(cfg.model):  # a user's model: checked when built
        return []
    shape = (1, 8, 8) if cfg.data.get("name") == "digits" else (1, 28, 28)  # names do not depend on the sizes
    try:
        from torch import nn

        container = nn.Module()
        container.model = build_model(cfg.model, shape, 10)
    except ValueError:  # the real data's shape decides; the run reports it
        return []
    try:
        select_parameters(
            container, include=list(p.include) if p.include else None, exclude=exclude_patterns(cfg, container)
        )
    except ValueError as err:
        return [f"pruning.include / pruning.exclude: {err}"]
    return []


def preflight(cfg: DictConfig) -> None:
    """Checks what :func:`~lightprune.experiment.config.validate_config` cannot from values alone, without importing
    Lightning: the data files exist (naming ``data.root`` when they do not), ``pruning.include`` /
    ``pruning.exclude`` select some weight of the model, and ``trainer.accelerator`` names a device this machine has.

    Raises:
        ConfigError: listing every problem.

    Example:
        >>> from omegaconf import OmegaConf
        >>> from lightprune.experiment.config import ExperimentConfig
        >>> cfg = OmegaConf.structured(ExperimentConfig)
        >>> preflight(cfg)
        >>> cfg.data.name, cfg.data.root = "mnist", "/nonexistent"
        >>> preflight(cfg)
        Traceback (most recent call last):
        ...
        lightprune.experiment.config.ConfigError: invalid experiment config:
          data.root='/nonexistent': /nonexistent is not a directory; set data.root=<directory holding ...>
    """
    problems = _data_problems(cfg) + _selection_problems(cfg) + _accelerator_problems(cfg)
    if problems:
        raise ConfigError("invalid experiment config:\n  " + "\n  ".join(problems))
