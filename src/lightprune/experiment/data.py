"""In-memory classification data for the experiment app.

Everything here keeps the whole data set in memory as tensors (``x`` float32, ``y`` int64), which is right for the
small benchmark sets pruning papers use (digits, MNIST, Fashion-MNIST) and keeps runs deterministic:

* :class:`ClassificationDataModule` - a ``LightningDataModule`` over train/val/test tensors.
* :func:`load_digits_data` - scikit-learn's bundled 8x8 handwritten digits (no download).
* :func:`read_idx` / :func:`write_idx` - the MNIST IDX file format, gzip-compressed or not (from
  :mod:`lightprune.experiment.idx`, re-exported here).
* :func:`load_idx_dataset` - a directory in MNIST layout (MNIST, Fashion-MNIST, KMNIST, ...).
* :func:`make_datamodule` - the factory the Hydra app calls by name.

Images keep their ``(channels, height, width)`` shape by default (``flatten=False``): MLPs such as
:class:`~lightprune.experiment.models.LeNet300100` flatten their input themselves, so one data module serves both
MLPs and CNNs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from lightprune import choices
from lightprune.experiment.datafiles import FASHION_MNIST_ROOT, IDX_FILES, MNIST_ROOT, _find_idx_file
from lightprune.experiment.idx import read_idx, write_idx

__all__ = [
    "DATASET_NAMES",
    "FASHION_MNIST_CLASSES",
    "FASHION_MNIST_ROOT",
    "IDX_FILES",
    "MNIST_ROOT",
    "ClassificationDataModule",
    "bundled_datamodule",
    "load_digits_data",
    "load_idx_dataset",
    "make_datamodule",
    "read_idx",
    "split_indices",
    "write_idx",
]

FASHION_MNIST_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
"""Fashion-MNIST class names, indexed by label."""

DATASET_NAMES = choices.DATASETS
"""Names accepted by :func:`make_datamodule`."""


# --------------------------------------------------------------------------------------------------------------------
# Splitting
# --------------------------------------------------------------------------------------------------------------------


def _resolve_size(size: int | float, total: int, what: str) -> int:
    """Turns a split size given as a count (int) or a fraction (float in [0, 1)) into a count."""
    if isinstance(size, bool):
        raise TypeError(f"{what} must be an int count or a float fraction, got {size!r}")
    if isinstance(size, float):
        if not 0.0 <= size < 1.0:
            raise ValueError(f"{what} as a fraction must be in [0, 1), got {size}")
        return round(size * total)
    if isinstance(size, int):
        if not 0 <= size <= total:
            raise ValueError(f"{what} must be between 0 and {total} examples, got {size}")
        return size
    raise TypeError(f"{what} must be an int count or a float fraction, got {size!r}")


def split_indices(labels: Tensor, sizes: Sequence[int], seed: int = 0, stratify: bool = True) -> list[Tensor]:
    """Splits ``range(len(labels))`` into parts of the given sizes plus a remainder, deterministically.

    With ``stratify=True`` each part keeps the class proportions of ``labels`` (every class count is within one of
    its proportional share) while the part sizes are exact: each class is shuffled, its members are spread evenly
    over ``[0, 1)`` with a random offset, and the merged order is cut into consecutive parts.

    Args:
        labels: 1-D integer class labels.
        sizes: Exact sizes of the first parts; their sum must not exceed ``len(labels)``.
        seed: Seed of the private random generator (the global RNG is untouched).
        stratify: Keep class proportions in every part; otherwise a plain random permutation is cut.

    Returns:
        ``len(sizes) + 1`` sorted int64 index tensors: the requested parts, then the remaining indices.

    Example:
        >>> labels = torch.tensor([0] * 8 + [1] * 4)
        >>> test, train = split_indices(labels, [3], seed=0)
        >>> len(test), len(train), int((labels[test] == 1).sum())
        (3, 9, 1)
        >>> torch.equal(split_indices(labels, [3], seed=0)[0], test)
        True
    """
    labels = torch.as_tensor(labels).flatten()
    n = labels.numel()
    if any(s < 0 for s in sizes) or sum(sizes) > n:
        raise ValueError(f"split sizes {list(sizes)} do not fit in {n} examples")
    generator = torch.Generator().manual_seed(seed)
    if stratify:
        keys = torch.empty(n, dtype=torch.float64)
        for cls in torch.unique(labels):
            members = (labels == cls).nonzero().flatten()
            members = members[torch.randperm(members.numel(), generator=generator)]
            offset = torch.rand(1, generator=generator, dtype=torch.float64)
            keys[members] = (torch.arange(members.numel(), dtype=torch.float64) + offset) / members.numel()
        order = torch.argsort(keys, stable=True)
    else:
        order = torch.randperm(n, generator=generator)
    parts = []
    start = 0
    for size in sizes:
        parts.append(torch.sort(order[start : start + size]).values)
        start += size
    parts.append(torch.sort(order[start:]).values)
    return parts


# --------------------------------------------------------------------------------------------------------------------
# Data module
# --------------------------------------------------------------------------------------------------------------------


class ClassificationDataModule(pl.LightningDataModule):
    """A ``LightningDataModule`` over in-memory classification tensors with fixed train/val/test splits.

    Batches come from ``TensorDataset`` + ``DataLoader``; only the training loader shuffles, with a generator seeded
    from ``seed``, so two runs with the same seed see the same batches.

    Args:
        train: ``(x, y)`` training tensors; ``x`` is cast to float32 and ``y`` to int64.
        val: ``(x, y)`` validation tensors (may hold zero examples).
        test: ``(x, y)`` test tensors (may hold zero examples).
        batch_size: Training batch size.
        eval_batch_size: Validation/test batch size (default: ``batch_size``).
        num_workers: ``DataLoader`` worker processes (0 loads in the main process).
        seed: Seed for the training shuffle (and, in :meth:`from_tensors`, for the split).
        num_classes: Number of classes; default ``max label + 1`` over all splits.
        name: A short name for logs and reports.
        class_names: Optional class names, indexed by label.

    Example:
        >>> x, y = torch.rand(10, 1, 4, 4), torch.arange(10) % 2
        >>> dm = ClassificationDataModule((x[:6], y[:6]), (x[6:8], y[6:8]), (x[8:], y[8:]), batch_size=4)
        >>> dm.dims, dm.num_classes, dm.split_sizes
        ((1, 4, 4), 2, {'train': 6, 'val': 2, 'test': 2})
        >>> xb, yb = next(iter(dm.train_dataloader()))
        >>> xb.shape, xb.dtype, yb.dtype
        (torch.Size([4, 1, 4, 4]), torch.float32, torch.int64)
    """

    def __init__(
        self,
        train: tuple[Tensor, Tensor],
        val: tuple[Tensor, Tensor],
        test: tuple[Tensor, Tensor],
        *,
        batch_size: int = 64,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        seed: int = 0,
        num_classes: int | None = None,
        name: str = "tensors",
        class_names: Sequence[str] | None = None,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size if eval_batch_size is not None else batch_size
        self.num_workers = num_workers
        self.seed = seed
        self.name = name
        self.class_names = tuple(class_names) if class_names is not None else None
        self.train_dataset = self._make_dataset(train, "train")
        self.val_dataset = self._make_dataset(val, "val")
        self.test_dataset = self._make_dataset(test, "test")
        shapes = {split: ds.tensors[0].shape[1:] for split, ds in self._datasets().items()}
        if len(set(shapes.values())) != 1:
            raise ValueError(f"all splits must have the same example shape, got {shapes}")
        self._dims = tuple(shapes["train"])
        labels = torch.cat([ds.tensors[1] for ds in self._datasets().values()])
        if labels.numel() and int(labels.min()) < 0:
            raise ValueError(f"labels must be >= 0, got {int(labels.min())}")
        inferred = int(labels.max()) + 1 if labels.numel() else 0
        if num_classes is None:
            num_classes = inferred
        elif num_classes < inferred:
            raise ValueError(f"num_classes={num_classes} but labels go up to {inferred - 1}")
        self._num_classes = num_classes

    @staticmethod
    def _make_dataset(split: tuple[Tensor, Tensor], what: str) -> TensorDataset:
        x, y = split
        x = torch.as_tensor(x).float()
        y = torch.as_tensor(y).long().flatten()
        if x.ndim < 2 or x.shape[0] != y.shape[0]:
            raise ValueError(f"{what}: x must be (N, ...) and y (N,), got x {tuple(x.shape)} and y {tuple(y.shape)}")
        return TensorDataset(x, y)

    def _datasets(self) -> dict[str, TensorDataset]:
        return {"train": self.train_dataset, "val": self.val_dataset, "test": self.test_dataset}

    @classmethod
    def from_tensors(
        cls,
        x: Tensor,
        y: Tensor,
        *,
        val_size: int | float = 0.1,
        test_size: int | float = 0.2,
        seed: int = 0,
        stratify: bool = True,
        **kwargs,
    ) -> ClassificationDataModule:
        """Splits one labelled set into train/val/test (see :func:`split_indices`) and wraps it.

        Args:
            x: Inputs, ``(N, ...)``.
            y: Integer labels, ``(N,)``.
            val_size: Validation examples: a count (int) or a fraction of ``N`` (float in [0, 1)).
            test_size: Test examples: a count (int) or a fraction of ``N`` (float in [0, 1)).
            seed: Seed for the split and for the training shuffle.
            stratify: Keep class proportions in every split.
            **kwargs: Passed on to the constructor (``batch_size``, ``num_workers``, ``name``, ...).

        Returns:
            The data module.

        Example:
            >>> x, y = torch.rand(100, 3), torch.arange(100) % 4
            >>> dm = ClassificationDataModule.from_tensors(x, y, val_size=0.1, test_size=20, seed=1)
            >>> dm.split_sizes, dm.dims, dm.num_classes
            ({'train': 70, 'val': 10, 'test': 20}, (3,), 4)
        """
        x = torch.as_tensor(x)
        y = torch.as_tensor(y).flatten()
        if x.shape[0] != y.shape[0]:
            raise ValueError(f"x has {x.shape[0]} examples but y has {y.shape[0]}")
        n = y.shape[0]
        n_test = _resolve_size(test_size, n, "test_size")
        n_val = _resolve_size(val_size, n, "val_size")
        test_idx, val_idx, train_idx = split_indices(y, [n_test, n_val], seed=seed, stratify=stratify)
        return cls(
            (x[train_idx], y[train_idx]),
            (x[val_idx], y[val_idx]),
            (x[test_idx], y[test_idx]),
            seed=seed,
            **kwargs,
        )

    @property
    def dims(self) -> tuple[int, ...]:
        """Shape of one input example, without the batch dimension, e.g. ``(1, 28, 28)``."""
        return self._dims

    @property
    def num_classes(self) -> int:
        """Number of classes."""
        return self._num_classes

    @property
    def split_sizes(self) -> dict[str, int]:
        """Number of examples in each split."""
        return {split: len(ds) for split, ds in self._datasets().items()}

    def _loader(self, dataset: TensorDataset, batch_size: int, shuffle: bool) -> DataLoader:
        generator = torch.Generator().manual_seed(self.seed) if shuffle else None
        return DataLoader(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            generator=generator,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        """Shuffled training batches (seeded by ``seed``)."""
        return self._loader(self.train_dataset, self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        """Validation batches in a fixed order."""
        return self._loader(self.val_dataset, self.eval_batch_size, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        """Test batches in a fixed order."""
        return self._loader(self.test_dataset, self.eval_batch_size, shuffle=False)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, dims={self.dims}, num_classes={self.num_classes}, "
            f"split_sizes={self.split_sizes}, batch_size={self.batch_size})"
        )


# --------------------------------------------------------------------------------------------------------------------
# scikit-learn digits
# --------------------------------------------------------------------------------------------------------------------


def load_digits_data(
    *,
    val_size: int | float = 0.1,
    test_size: int | float = 0.2,
    seed: int = 0,
    flatten: bool = False,
    batch_size: int = 64,
    **kwargs,
) -> ClassificationDataModule:
    """scikit-learn's bundled handwritten digits (1797 images of 8x8 pixels, 10 classes; nothing is downloaded).

    Pixels are scaled from 0..16 to [0, 1]. The split is stratified and deterministic for a given ``seed``; with the
    defaults it holds 1258 training, 180 validation and 359 test images.

    Args:
        val_size: Validation examples: a count or a fraction of all 1797 (default 10%).
        test_size: Test examples: a count or a fraction of all 1797 (default 20%).
        seed: Seed for the split and the training shuffle.
        flatten: Give inputs as 64-vectors instead of ``1x8x8`` images.
        batch_size: Training batch size.
        **kwargs: Passed on to :class:`ClassificationDataModule` (``num_workers``, ``eval_batch_size``, ...).

    Returns:
        The data module, named ``"digits"``.

    Example:
        >>> dm = load_digits_data(seed=0)
        >>> dm.dims, dm.num_classes, dm.split_sizes
        ((1, 8, 8), 10, {'train': 1258, 'val': 180, 'test': 359})
        >>> float(dm.train_dataset.tensors[0].max())
        1.0
    """
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.from_numpy(digits.images.astype(np.float32) / 16.0)
    x = x.reshape(len(x), -1) if flatten else x.unsqueeze(1)
    y = torch.from_numpy(digits.target.astype(np.int64))
    kwargs.setdefault("name", "digits")
    return ClassificationDataModule.from_tensors(
        x, y, val_size=val_size, test_size=test_size, seed=seed, batch_size=batch_size, **kwargs
    )


# --------------------------------------------------------------------------------------------------------------------
# IDX data sets (the file codec: lightprune.experiment.idx)
# --------------------------------------------------------------------------------------------------------------------


def _images_to_float(images: Tensor) -> Tensor:
    """uint8 pixels are scaled by 1/255 to [0, 1]; other dtypes are only cast to float32."""
    if images.dtype == torch.uint8:
        return images.float().div_(255.0)
    return images.float()


def _subsample(n: int, limit: int | None, seed: int) -> Tensor:
    """Sorted indices of a deterministic random subset of at most ``limit`` of ``n`` examples."""
    if limit is None or limit >= n:
        return torch.arange(n)
    if limit < 1:
        raise ValueError(f"limit must be >= 1 or None, got {limit}")
    generator = torch.Generator().manual_seed(seed)
    return torch.sort(torch.randperm(n, generator=generator)[:limit]).values


def load_idx_dataset(
    root: str | Path,
    *,
    val_size: int | float = 0.1,
    limit: int | None = None,
    flatten: bool = False,
    seed: int = 0,
    batch_size: int = 128,
    stratify: bool = True,
    name: str = "idx",
    **kwargs,
) -> ClassificationDataModule:
    """Loads a directory in MNIST layout: the four standard IDX files, each plain or ``.gz``.

    The expected files are ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte`` and
    ``t10k-labels-idx1-ubyte`` (see :data:`IDX_FILES`), directly in ``root`` or in ``root/raw``. This is how
    Debian's ``dataset-fashion-mnist`` installs Fashion-MNIST (in :data:`FASHION_MNIST_ROOT`, gzip-compressed).
    The validation split is held out from the training file (stratified, deterministic); the test split is the
    ``t10k`` file. uint8 pixels are scaled to [0, 1].

    Args:
        root: The directory.
        val_size: Validation examples held out from the (possibly limited) training set: a count or a fraction
            (default 10%: 6000 of MNIST's 60000).
        limit: Use at most this many training and at most this many test examples (a deterministic random subset,
            drawn before the validation split), for quick runs; ``None`` uses all.
        flatten: Give inputs as vectors (784 for MNIST) instead of ``1xHxW`` images.
        seed: Seed for the subsets, the split and the training shuffle.
        batch_size: Training batch size.
        stratify: Keep class proportions in the validation split.
        name: Name of the data module.
        **kwargs: Passed on to :class:`ClassificationDataModule` (``num_workers``, ``eval_batch_size``, ...).

    Returns:
        The data module.

    Raises:
        FileNotFoundError: ``root`` or one of the files is missing; the message names the path and the files
            expected.
        ValueError: A file is not valid IDX, or images and labels do not match; the message names the file.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     for split, n in (("train", 20), ("t10k", 10)):
        ...         _ = write_idx(f"{tmp}/{split}-images-idx3-ubyte.gz", torch.zeros(n, 5, 5, dtype=torch.uint8))
        ...         _ = write_idx(f"{tmp}/{split}-labels-idx1-ubyte.gz", torch.arange(n, dtype=torch.uint8) % 2)
        ...     dm = load_idx_dataset(tmp, val_size=4)
        >>> dm.dims, dm.num_classes, dm.split_sizes
        ((1, 5, 5), 2, {'train': 16, 'val': 4, 'test': 10})
    """
    root = Path(root)
    expected = ", ".join(f"{stem}[.gz]" for stem in IDX_FILES.values())
    if not root.is_dir():
        raise FileNotFoundError(f"{name} data directory not found: {root} (expected the files {expected})")
    paths = {key: _find_idx_file(root, stem) for key, stem in IDX_FILES.items()}
    missing = [IDX_FILES[key] for key, path in paths.items() if path is None]
    if missing:
        raise FileNotFoundError(
            f"{name} data directory {root} lacks {', '.join(missing)} (with or without .gz); "
            f"expected the files {expected}"
        )

    splits = {}
    for split in ("train", "test"):
        images_path, labels_path = paths[f"{split}_images"], paths[f"{split}_labels"]
        images, labels = read_idx(images_path), read_idx(labels_path)
        if images.ndim not in (3, 4):
            raise ValueError(f"{images_path}: expected images of shape (N, H, W) or (N, C, H, W), got {images.shape}")
        if labels.ndim != 1 or labels.is_floating_point():
            raise ValueError(f"{labels_path}: expected integer labels of shape (N,), got {labels.dtype} {labels.shape}")
        if labels.shape[0] != images.shape[0]:
            raise ValueError(
                f"{images_path} holds {images.shape[0]} images but {labels_path} holds {labels.shape[0]} labels"
            )
        keep = _subsample(labels.shape[0], limit, seed)
        images, labels = images[keep], labels[keep].long()
        x = _images_to_float(images)
        x = x.reshape(len(x), -1) if flatten else (x.unsqueeze(1) if x.ndim == 3 else x)
        splits[split] = (x, labels)

    x_train, y_train = splits["train"]
    n_val = _resolve_size(val_size, len(y_train), "val_size")
    val_idx, train_idx = split_indices(y_train, [n_val], seed=seed, stratify=stratify)
    return ClassificationDataModule(
        (x_train[train_idx], y_train[train_idx]),
        (x_train[val_idx], y_train[val_idx]),
        splits["test"],
        batch_size=batch_size,
        seed=seed,
        name=name,
        **kwargs,
    )


# --------------------------------------------------------------------------------------------------------------------
# Factory
# --------------------------------------------------------------------------------------------------------------------


def make_datamodule(name: str, /, **kwargs) -> ClassificationDataModule:
    """Builds a data module by name, as the Hydra config names it.

    Names: ``"digits"`` (:func:`load_digits_data`), ``"fashion_mnist"`` (:func:`load_idx_dataset` with ``root``
    defaulting to :data:`FASHION_MNIST_ROOT`), ``"mnist"`` (``root`` defaulting to :data:`MNIST_ROOT`) and ``"idx"``
    (any MNIST-layout directory; ``root`` is required). Dashes count as underscores and case is ignored; a ``root``
    of ``None`` means the default.

    Args:
        name: One of :data:`DATASET_NAMES` (positional-only, so ``name=...`` in ``kwargs`` names the data module).
        **kwargs: Passed on to the loader.

    Returns:
        The data module.

    Raises:
        ValueError: Unknown name, or ``"idx"`` without ``root``.

    Example:
        >>> make_datamodule("digits", val_size=0.2, batch_size=32).split_sizes
        {'train': 1079, 'val': 359, 'test': 359}
        >>> make_datamodule("cifar")
        Traceback (most recent call last):
        ...
        ValueError: unknown dataset 'cifar'; choose one of: digits, fashion_mnist, mnist, idx
    """
    key = name.lower().replace("-", "_")
    if key == "digits":
        return load_digits_data(**kwargs)
    if key in ("fashion_mnist", "mnist"):
        default_root = FASHION_MNIST_ROOT if key == "fashion_mnist" else MNIST_ROOT
        root = kwargs.pop("root", None) or default_root
        kwargs.setdefault("name", key)
        if key == "fashion_mnist":
            kwargs.setdefault("class_names", FASHION_MNIST_CLASSES)
        try:
            return load_idx_dataset(root, **kwargs)
        except FileNotFoundError as err:
            if key == "fashion_mnist" and str(root) == FASHION_MNIST_ROOT:
                raise FileNotFoundError(f"{err}; on Debian/Ubuntu: apt-get install dataset-fashion-mnist") from err
            raise
    if key == "idx":
        root = kwargs.pop("root", None)
        if root is None:
            raise ValueError("dataset 'idx' needs root=<directory holding the four MNIST-layout IDX files>")
        return load_idx_dataset(root, **kwargs)
    raise ValueError(f"unknown dataset {name!r}; choose one of: {', '.join(DATASET_NAMES)}")


def bundled_datamodule(
    name: str,
    *,
    root: str | None = None,
    batch_size: int = 64,
    val_size: float = 0.1,
    test_size: float = 0.2,
    limit: int | None = None,
    flatten: bool = False,
    seed: int = 0,
) -> ClassificationDataModule:
    """The ``_target_`` of the app's bundled ``data`` presets: :func:`make_datamodule` with every key of the preset.

    One signature serves every bundled dataset, so one config switches datasets by ``name``: ``test_size`` is
    ``digits``' alone (the IDX datasets have test files), ``root`` and ``limit`` are the IDX datasets' alone.
    ``hydra.utils.instantiate(cfg.data)`` in a user's own Hydra app gives the same datamodule as the app.

    Example:
        >>> bundled_datamodule("digits", batch_size=32).split_sizes
        {'train': 1258, 'val': 180, 'test': 359}
    """
    kwargs: dict = {"val_size": val_size, "seed": seed, "flatten": flatten, "batch_size": batch_size}
    if name.lower().replace("-", "_") == "digits":
        kwargs["test_size"] = test_size
    else:
        kwargs.update(root=root, limit=limit)
    return make_datamodule(name, **kwargs)
