"""Where the IDX data sets live and how their files are named: what the app checks before it imports Lightning.

:mod:`lightprune.experiment.data` reads the files; this module only finds them (no torch, no Lightning).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["FASHION_MNIST_ROOT", "IDX_FILES", "MNIST_ROOT", "default_root", "missing_idx_files"]

FASHION_MNIST_ROOT = "/usr/share/datasets/fashion-mnist"
"""Where Debian's ``dataset-fashion-mnist`` package installs the four ``*-ubyte.gz`` files."""

MNIST_ROOT = "/usr/share/datasets/mnist"
"""Default MNIST directory (same layout as Fashion-MNIST; no Debian package ships it, so pass ``root``)."""

IDX_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
"""The four standard file names of an MNIST-layout directory (each may also end in ``.gz``)."""


def _find_idx_file(root: Path, stem: str) -> Path | None:
    """Finds one standard IDX file under ``root`` (or ``root/raw``), with or without ``.gz``.

    Also accepts the dotted spelling some mirrors use (``train-images.idx3-ubyte``).
    """
    dotted = stem.replace("-idx", ".idx")
    for folder in (root, root / "raw"):
        for name in (stem, f"{stem}.gz", dotted, f"{dotted}.gz"):
            candidate = folder / name
            if candidate.is_file():
                return candidate
    return None


def default_root(name: str) -> str | None:
    """The directory a data set is read from when ``data.root`` is not set (``None``: there is none).

    Example:
        >>> default_root("fashion_mnist"), default_root("idx")
        ('/usr/share/datasets/fashion-mnist', None)
    """
    return {"fashion_mnist": FASHION_MNIST_ROOT, "mnist": MNIST_ROOT}.get(name)


def missing_idx_files(root: str | Path) -> list[str]:
    """The standard IDX files (:data:`IDX_FILES`) not found in ``root`` or ``root/raw``; all of them if ``root``
    is not a directory.

    Example:
        >>> missing_idx_files("/nonexistent")[0]
        'train-images-idx3-ubyte'
    """
    root = Path(root)
    if not root.is_dir():
        return list(IDX_FILES.values())
    return [stem for stem in IDX_FILES.values() if _find_idx_file(root, stem) is None]
