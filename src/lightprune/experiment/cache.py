"""A cache of the experiment app's dense phase, shared by runs and sweeps.

A sweep over pruning settings trains the same dense model in every run. The dense phase is determined by the data,
the model, the seed, the dense phase's trainer settings and the code; :func:`dense_key` hashes all of them, and
:class:`DenseCache` keeps, per key, what a later run needs to go on exactly as if it had trained the phase itself:
the trained weights, the random number generators' states, the dense test accuracy, the step count and the phase's
logs. Entries are written to a temporary directory and renamed into place, and a lock file per key makes parallel
runs (Hydra's joblib launcher) wait for the one training the phase instead of training it too.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["CACHE_ENV", "DenseCache", "DenseEntry", "default_cache_dir", "dense_key", "dense_key_material"]

CACHE_ENV = "LIGHTPRUNE_CACHE_DIR"
"""Environment variable naming the cache directory (when ``cache.dir`` is not set)."""

_CODE_FILES = ("app.py", "cache.py", "classifier.py", "data.py", "datafiles.py", "idx.py", "models.py", "targets.py")
"""The app's modules that take part in the dense phase: a change to any of them changes every key."""

_TRAINER_KEYS = (
    "dense_epochs",
    "accelerator",
    "devices",
    "precision",
    "log_every_n_steps",
    "accumulate_grad_batches",
    "deterministic",
    "num_threads",
)
"""Trainer settings of the dense phase (``max_epochs`` and ``enable_progress_bar`` do not change it)."""


def default_cache_dir() -> Path:
    """``$LIGHTPRUNE_CACHE_DIR``, else ``$XDG_CACHE_HOME/lightprune``, else ``~/.cache/lightprune``.

    Example:
        >>> import os
        >>> saved = os.environ.get(CACHE_ENV)
        >>> os.environ[CACHE_ENV] = "/tmp/lp-cache"
        >>> default_cache_dir().as_posix()
        '/tmp/lp-cache'
        >>> _ = os.environ.pop(CACHE_ENV) if saved is None else os.environ.update({CACHE_ENV: saved})
    """
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "lightprune"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "absent"


def _data_files(data: Mapping[str, Any]) -> list[list[Any]]:
    """Name, size and modification time of the data set's files (none for the bundled digits)."""
    from lightprune.experiment.datafiles import IDX_FILES, _find_idx_file, default_root

    if "_target_" in data:  # a user's datamodule: its own files are its business (its source is hashed)
        return []
    root = data.get("root") or default_root(str(data.get("name")))
    if root is None or not Path(root).is_dir():
        return []
    files = []
    for stem in IDX_FILES.values():
        path = _find_idx_file(Path(root), stem)
        if path is not None:
            stat = path.stat()
            files.append([str(path.resolve()), stat.st_size, stat.st_mtime_ns])
    return files


def dense_key_material(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Everything the dense phase depends on, as plain JSON-ready values: the hashed input of :func:`dense_key`.

    ``data`` (the whole group, and the data files' paths, sizes and modification times), ``model`` (the whole
    group), the dense phase's optimizer and schedule (``optim.dense``), ``seed``, the dense phase's trainer settings,
    and the code: a hash of the app's modules, of the source files of ``model`` / ``data`` given by ``_target_``,
    and the versions of lightprune, torch, Lightning, torchmetrics, numpy and scikit-learn.

    Example:
        >>> from omegaconf import OmegaConf
        >>> from lightprune.experiment.config import ExperimentConfig
        >>> cfg = OmegaConf.to_container(OmegaConf.structured(ExperimentConfig))
        >>> sorted(dense_key_material(cfg))
        ['code', 'data', 'data_files', 'model', 'optim', 'seed', 'trainer']
    """
    from lightprune.experiment.targets import source_digest

    here = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for name in _CODE_FILES:
        digest.update((here / name).read_bytes())
    packages = ("lightprune", "torch", "lightning", "torchmetrics", "numpy", "scikit-learn")
    return {
        "data": dict(cfg["data"]),
        "data_files": _data_files(cfg["data"]),
        "model": dict(cfg["model"]),
        "optim": dict(cfg.get("optim", {}).get("dense", {})),
        "seed": cfg["seed"],
        "trainer": {key: cfg["trainer"][key] for key in _TRAINER_KEYS},
        "code": {
            "app_sha256": digest.hexdigest(),
            "targets_sha256": source_digest(cfg),
            **{package: _version(package) for package in packages},
        },
    }


def dense_key(cfg: Mapping[str, Any]) -> str:
    """The cache key of ``cfg``'s dense phase: a hash of :func:`dense_key_material`.

    Example:
        >>> from omegaconf import OmegaConf
        >>> from lightprune.experiment.config import ExperimentConfig
        >>> cfg = OmegaConf.to_container(OmegaConf.structured(ExperimentConfig))
        >>> key = dense_key(cfg)
        >>> cfg["pruning"]["final_sparsity"] = 0.5  # pruning settings share the dense phase
        >>> dense_key(cfg) == key
        True
        >>> cfg["seed"] = 1
        >>> dense_key(cfg) == key
        False
    """
    text = json.dumps(dense_key_material(cfg), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def rng_state() -> dict[str, Any]:
    """The states of Python's, numpy's and torch's (CPU and CUDA) global random number generators."""
    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state()}
    state["torch"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restores :func:`rng_state`'s states."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass
class DenseEntry:
    """One cached dense phase.

    Attributes:
        path: its directory.
        state_dict: the module's state after the dense phase.
        rng: the random number generators' states after the dense phase (see :func:`rng_state`).
        info: ``dense_test_acc``, ``global_step``, ``train_time_s`` and the key material.
    """

    path: Path
    state_dict: dict[str, torch.Tensor]
    rng: dict[str, Any]
    info: dict[str, Any]

    def copy_logs(self, output_dir: Path) -> None:
        """Copies the phase's logs (``logs/dense``, ``tensorboard/dense``) into a run directory."""
        for folder in ("logs", "tensorboard"):
            source = self.path / folder
            if source.is_dir():
                shutil.copytree(source, output_dir / folder / "dense", dirs_exist_ok=True)


class DenseCache:
    """The dense-phase entries under ``root / "dense"``, one directory per :func:`dense_key`.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     cache = DenseCache(tmp)
        ...     with cache.lock("k"):
        ...         entry = cache.store("k", {"w": torch.ones(2)}, rng_state(), {"dense_test_acc": 0.9}, Path(tmp))
        ...     cache.load("k").info["dense_test_acc"], cache.load("other")
        (0.9, None)
    """

    def __init__(self, root: str | Path | None = None) -> None:
        self.root = Path(root) if root is not None else default_cache_dir()
        self.dir = self.root / "dense"

    def path(self, key: str) -> Path:
        """The entry directory of ``key`` (whether it exists or not)."""
        return self.dir / key

    @contextlib.contextmanager
    def lock(self, key: str) -> Iterator[None]:
        """Holds ``key``'s lock file: one process trains a missing phase while the others wait, then load it."""
        self.dir.mkdir(parents=True, exist_ok=True)
        with (self.dir / f"{key}.lock").open("w") as handle:
            try:
                import fcntl
            except ImportError:  # no POSIX locks (Windows): parallel runs may train the same phase
                yield
                return
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def load(self, key: str) -> DenseEntry | None:
        """The entry of ``key``, or ``None`` when there is none (or it cannot be read)."""
        path = self.path(key)
        try:
            info = json.loads((path / "dense.json").read_text())
            state_dict = torch.load(path / "state_dict.pt", map_location="cpu", weights_only=True)
            rng = torch.load(path / "rng.pt", weights_only=False)
        except (OSError, ValueError, RuntimeError, EOFError):
            return None
        return DenseEntry(path, state_dict, rng, info)

    def store(
        self,
        key: str,
        state_dict: Mapping[str, torch.Tensor],
        rng: Mapping[str, Any],
        info: Mapping[str, Any],
        run_dir: Path,
    ) -> DenseEntry:
        """Writes an entry (replacing any old one), with the logs of ``run_dir``'s dense phase."""
        self.dir.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=self.dir))
        torch.save({name: tensor.detach().cpu() for name, tensor in state_dict.items()}, staging / "state_dict.pt")
        torch.save(dict(rng), staging / "rng.pt")
        (staging / "dense.json").write_text(json.dumps(dict(info), indent=2, default=str) + "\n")
        for folder in ("logs", "tensorboard"):
            source = run_dir / folder / "dense"
            if source.is_dir():
                shutil.copytree(source, staging / folder)
        target = self.path(key)
        if target.exists():
            old = target.with_name(f".{key}-old-{os.getpid()}")
            target.rename(old)
            shutil.rmtree(old, ignore_errors=True)
        staging.rename(target)
        return DenseEntry(target, dict(state_dict), dict(rng), dict(info))
