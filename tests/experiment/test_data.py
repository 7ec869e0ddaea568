"""Tests for lightprune.experiment.data: splits, the data module, digits, the IDX format and MNIST-layout folders."""

import gzip
from pathlib import Path

import numpy as np
import pytest
import torch

from lightprune.experiment.data import (
    DATASET_NAMES,
    FASHION_MNIST_CLASSES,
    FASHION_MNIST_ROOT,
    IDX_FILES,
    MNIST_ROOT,
    ClassificationDataModule,
    load_digits_data,
    load_idx_dataset,
    make_datamodule,
    read_idx,
    split_indices,
    write_idx,
)

# --------------------------------------------------------------------------------------------------------------------
# split_indices
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stratify", [True, False])
def test_split_indices_exact_sizes_disjoint_and_covering(stratify):
    labels = torch.arange(103) % 7
    test, val, train = split_indices(labels, [20, 11], seed=3, stratify=stratify)
    assert (len(test), len(val), len(train)) == (20, 11, 72)
    together = torch.cat([test, val, train])
    assert torch.equal(torch.sort(together).values, torch.arange(103))
    for part in (test, val, train):
        assert torch.equal(part, torch.sort(part).values)


def test_split_indices_stratified_counts_are_proportional():
    labels = torch.cat([torch.zeros(500), torch.ones(300), torch.full((200,), 2)]).long()
    test, val, train = split_indices(labels, [200, 100], seed=0)
    for part in (test, val, train):
        counts = torch.bincount(labels[part], minlength=3).tolist()
        expected = [len(part) * share for share in (0.5, 0.3, 0.2)]
        assert all(abs(c - e) <= 1 for c, e in zip(counts, expected, strict=True)), (counts, expected)


def test_split_indices_deterministic_and_seed_dependent():
    labels = torch.arange(200) % 4
    first = split_indices(labels, [50], seed=1)
    assert all(torch.equal(a, b) for a, b in zip(first, split_indices(labels, [50], seed=1), strict=True))
    assert not torch.equal(first[0], split_indices(labels, [50], seed=2)[0])


def test_split_indices_leaves_global_rng_alone():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    split_indices(torch.arange(50) % 3, [10], seed=5)
    assert torch.equal(torch.rand(3), expected)


def test_split_indices_rejects_oversized_parts():
    with pytest.raises(ValueError, match="do not fit"):
        split_indices(torch.zeros(10), [6, 5])


# --------------------------------------------------------------------------------------------------------------------
# ClassificationDataModule
# --------------------------------------------------------------------------------------------------------------------


def _toy(n=60, shape=(1, 4, 4), classes=3):
    x = torch.rand(n, *shape, generator=torch.Generator().manual_seed(0))
    y = torch.arange(n) % classes
    return x, y


def test_from_tensors_sizes_dtypes_and_properties():
    x, y = _toy()
    dm = ClassificationDataModule.from_tensors(x.double(), y.int(), val_size=0.1, test_size=12, batch_size=8)
    assert dm.split_sizes == {"train": 42, "val": 6, "test": 12}
    assert dm.dims == (1, 4, 4)
    assert dm.num_classes == 3
    xb, yb = next(iter(dm.train_dataloader()))
    assert xb.shape == (8, 1, 4, 4) and xb.dtype == torch.float32 and yb.dtype == torch.int64


def test_train_loader_shuffle_is_seeded_and_eval_loaders_are_ordered():
    x, y = _toy()

    def first_batches(seed):
        dm = ClassificationDataModule.from_tensors(x, y, seed=seed, batch_size=10)
        return [b[0] for b in dm.train_dataloader()], dm

    a, dm = first_batches(0)
    b, _ = first_batches(0)
    assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
    c, _ = first_batches(1)
    assert not torch.equal(a[0], c[0])
    # the training loader is shuffled, val/test come in dataset order
    assert not torch.equal(torch.cat(a), dm.train_dataset.tensors[0])
    assert torch.equal(torch.cat([b[0] for b in dm.val_dataloader()]), dm.val_dataset.tensors[0])
    assert torch.equal(torch.cat([b[0] for b in dm.test_dataloader()]), dm.test_dataset.tensors[0])


def test_eval_batch_size_and_explicit_num_classes():
    x, y = _toy()
    small = (x[:7], y[:7])
    dm = ClassificationDataModule((x, y), small, small, batch_size=4, eval_batch_size=7, num_classes=5)
    assert dm.num_classes == 5
    assert len(next(iter(dm.val_dataloader()))[0]) == 7
    assert "num_classes=5" in repr(dm)


def test_datamodule_validates_inputs():
    x, y = _toy()
    with pytest.raises(ValueError, match="same example shape"):
        ClassificationDataModule((x, y), (x[:, :, :2], y), (x, y))
    with pytest.raises(ValueError, match="x must be"):
        ClassificationDataModule((x, y[:-1]), (x, y), (x, y))
    with pytest.raises(ValueError, match="num_classes=2"):
        ClassificationDataModule((x, y), (x, y), (x, y), num_classes=2)
    with pytest.raises(ValueError, match="labels must be >= 0"):
        ClassificationDataModule((x, y - 1), (x, y), (x, y))
    with pytest.raises(ValueError, match="test_size"):
        ClassificationDataModule.from_tensors(x, y, test_size=1.5)
    with pytest.raises(ValueError, match="val_size"):
        ClassificationDataModule.from_tensors(x, y, val_size=61)


# --------------------------------------------------------------------------------------------------------------------
# digits
# --------------------------------------------------------------------------------------------------------------------


def test_digits_shapes_range_and_default_split():
    dm = load_digits_data()
    assert dm.name == "digits"
    assert dm.dims == (1, 8, 8) and dm.num_classes == 10
    assert dm.split_sizes == {"train": 1258, "val": 180, "test": 359}
    x = torch.cat([ds.tensors[0] for ds in (dm.train_dataset, dm.val_dataset, dm.test_dataset)])
    assert x.shape == (1797, 1, 8, 8)
    assert float(x.min()) == 0.0 and float(x.max()) == 1.0
    for ds in (dm.train_dataset, dm.val_dataset, dm.test_dataset):
        counts = torch.bincount(ds.tensors[1], minlength=10)
        assert int(counts.min()) >= 0.09 * len(ds) - 1  # every class present, roughly 10% each


def test_digits_deterministic_and_flatten():
    a, b = load_digits_data(seed=4), load_digits_data(seed=4)
    for split in ("train_dataset", "val_dataset", "test_dataset"):
        for u, v in zip(getattr(a, split).tensors, getattr(b, split).tensors, strict=True):
            assert torch.equal(u, v)
    c = load_digits_data(seed=5)
    assert not torch.equal(a.test_dataset.tensors[1], c.test_dataset.tensors[1])
    flat = load_digits_data(seed=4, flatten=True, val_size=100, test_size=0.25)
    assert flat.dims == (64,)
    assert flat.split_sizes == {"train": 1797 - 100 - 449, "val": 100, "test": 449}


# --------------------------------------------------------------------------------------------------------------------
# IDX format
# --------------------------------------------------------------------------------------------------------------------

DTYPE_CODES = {
    torch.uint8: 0x08,
    torch.int8: 0x09,
    torch.int16: 0x0B,
    torch.int32: 0x0C,
    torch.float32: 0x0D,
    torch.float64: 0x0E,
}


def _sample(dtype):
    if dtype.is_floating_point:
        return torch.linspace(-3.5, 1e6, 24, dtype=dtype).reshape(2, 3, 4)
    info = torch.iinfo(dtype)
    values = torch.linspace(info.min, info.max, 24, dtype=torch.float64).round().to(dtype)
    return values.reshape(2, 3, 4)


@pytest.mark.parametrize("compress", [False, True])
@pytest.mark.parametrize("dtype", list(DTYPE_CODES))
def test_idx_round_trip_every_dtype(tmp_path, dtype, compress):
    tensor = _sample(dtype)
    path = write_idx(tmp_path / "data-idx3", tensor, compress=compress)
    raw = path.read_bytes()
    assert (raw[:2] == b"\x1f\x8b") == compress
    header = gzip.decompress(raw)[:16] if compress else raw[:16]
    assert header == bytes([0, 0, DTYPE_CODES[dtype], 3, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 4])
    loaded = read_idx(path)
    assert loaded.dtype == dtype
    assert torch.equal(loaded, tensor)


def test_idx_data_are_big_endian(tmp_path):
    path = write_idx(tmp_path / "x", torch.tensor([0x0102, -2], dtype=torch.int16))
    assert path.read_bytes()[8:] == bytes([0x01, 0x02, 0xFF, 0xFE])
    hand_made = tmp_path / "hand-made"
    hand_made.write_bytes(bytes([0, 0, 0x0C, 1, 0, 0, 0, 1, 0, 0, 1, 0]))
    assert read_idx(hand_made).tolist() == [256]


def test_idx_compression_detected_by_magic_not_suffix(tmp_path):
    tensor = torch.arange(10, dtype=torch.uint8)
    gz_without_suffix = write_idx(tmp_path / "labels-idx1-ubyte", tensor, compress=True)
    plain_with_suffix = write_idx(tmp_path / "labels-idx1-ubyte.gz", tensor, compress=False)
    assert torch.equal(read_idx(gz_without_suffix), tensor)
    assert torch.equal(read_idx(plain_with_suffix), tensor)
    assert write_idx(tmp_path / "auto.gz", tensor).read_bytes()[:2] == b"\x1f\x8b"


def test_idx_gzip_output_is_reproducible(tmp_path):
    tensor = torch.arange(100, dtype=torch.uint8)
    assert write_idx(tmp_path / "a.gz", tensor).read_bytes() == write_idx(tmp_path / "b.gz", tensor).read_bytes()


def test_idx_scalar_and_empty(tmp_path):
    assert read_idx(write_idx(tmp_path / "empty", torch.zeros(0, 5, dtype=torch.uint8))).shape == (0, 5)
    assert read_idx(write_idx(tmp_path / "scalar", torch.tensor(7, dtype=torch.int32))).item() == 7


def test_write_idx_rejects_unsupported_dtype(tmp_path):
    with pytest.raises(ValueError, match="int64"):
        write_idx(tmp_path / "x", torch.zeros(3, dtype=torch.int64))


def write_idx_bytes(tensor):
    """IDX bytes of a tensor, gzip-compressed (helper for the corruption tests)."""
    header = bytes([0, 0, 0x08, tensor.ndim]) + np.asarray(tensor.shape, dtype=">u4").tobytes()
    return gzip.compress(header + tensor.numpy().tobytes(), mtime=0)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (bytes([1, 0, 8, 1, 0, 0, 0, 1, 5]), "not an IDX file"),
        (bytes([0, 0, 0x0A, 1, 0, 0, 0, 1, 5]), "unknown IDX type code 0x0A"),
        (bytes([0, 0]), "too short"),
        (bytes([0, 0, 8, 3, 0, 0, 0, 1]), "truncated IDX header"),
        (bytes([0, 0, 8, 1, 0, 0, 0, 4, 1, 2]), "truncated"),
        (bytes([0, 0, 0x0D, 1, 0, 0, 0, 1, 1, 2, 3]), "truncated"),
        (bytes([0, 0, 8, 1, 0, 0, 0, 1, 1, 2]), "trailing bytes"),
        (write_idx_bytes(torch.arange(50, dtype=torch.uint8))[:-12], "gzip"),
        (b"\x1f\x8b" + b"garbage" * 3, "gzip"),
    ],
    ids=["magic", "dtype", "short", "header", "data", "float-data", "trailing", "gzip-truncated", "gzip-garbage"],
)
def test_read_idx_corrupt_files_raise_value_error_naming_the_path(tmp_path, content, message):
    path = tmp_path / "broken-idx1-ubyte"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message) as info:
        read_idx(path)
    assert str(path) in str(info.value)


def test_read_idx_gzipped_truncated_data(tmp_path):
    path = tmp_path / "short.gz"
    raw = gzip.decompress(write_idx_bytes(torch.arange(50, dtype=torch.uint8)))
    path.write_bytes(gzip.compress(raw[:-5]))
    with pytest.raises(ValueError, match="truncated"):
        read_idx(path)


def test_read_idx_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing-here"):
        read_idx(tmp_path / "nothing-here")


# --------------------------------------------------------------------------------------------------------------------
# MNIST-layout directories
# --------------------------------------------------------------------------------------------------------------------


def make_fake_mnist(root: Path, n_train=60, n_test=20, size=(5, 6), gz=True, folder="", dotted=False) -> Path:
    """Writes the four MNIST-layout files with deterministic pixels (train image i is filled with i)."""
    target = root / folder if folder else root
    for split, n in (("train", n_train), ("t10k", n_test)):
        images = (torch.arange(n, dtype=torch.int64) * 3 % 256).to(torch.uint8)[:, None, None].expand(n, *size)
        labels = (torch.arange(n) % 10).to(torch.uint8)
        for kind, tensor in (("images-idx3-ubyte", images.contiguous()), ("labels-idx1-ubyte", labels)):
            name = f"{split}-{kind}".replace("-idx", ".idx") if dotted else f"{split}-{kind}"
            write_idx(target / (name + (".gz" if gz else "")), tensor)
    return root


@pytest.mark.parametrize("gz", [True, False])
def test_load_idx_dataset_shapes_scaling_and_split(tmp_path, gz):
    root = make_fake_mnist(tmp_path, gz=gz)
    dm = load_idx_dataset(root, val_size=10, batch_size=16)
    assert dm.dims == (1, 5, 6) and dm.num_classes == 10
    assert dm.split_sizes == {"train": 50, "val": 10, "test": 20}
    x_test = dm.test_dataset.tensors[0]
    assert x_test.dtype == torch.float32
    assert torch.allclose(x_test[:, 0, 0, 0], (torch.arange(20) * 3 % 256).float() / 255)
    assert torch.equal(dm.test_dataset.tensors[1], torch.arange(20) % 10)
    # validation is held out of train, stratified: one of each class
    assert sorted(dm.val_dataset.tensors[1].tolist()) == list(range(10))
    train_ids = set((dm.train_dataset.tensors[0][:, 0, 0, 0] * 255).round().long().tolist())
    val_ids = set((dm.val_dataset.tensors[0][:, 0, 0, 0] * 255).round().long().tolist())
    assert not train_ids & val_ids and len(train_ids | val_ids) == 60


def test_load_idx_dataset_flatten_limit_and_fraction(tmp_path):
    root = make_fake_mnist(tmp_path)
    dm = load_idx_dataset(root, flatten=True, limit=30, val_size=0.2, seed=1)
    assert dm.dims == (30,)
    assert dm.split_sizes == {"train": 24, "val": 6, "test": 20}
    again = load_idx_dataset(root, flatten=True, limit=30, val_size=0.2, seed=1)
    assert torch.equal(dm.train_dataset.tensors[0], again.train_dataset.tensors[0])
    small_test = load_idx_dataset(root, limit=8, val_size=0)
    assert small_test.split_sizes == {"train": 8, "val": 0, "test": 8}


@pytest.mark.parametrize(("folder", "dotted"), [("raw", False), ("", True)])
def test_load_idx_dataset_layout_variants(tmp_path, folder, dotted):
    root = make_fake_mnist(tmp_path, folder=folder, dotted=dotted, gz=False)
    assert load_idx_dataset(root, val_size=0).split_sizes["train"] == 60


def test_load_idx_dataset_missing_directory_names_path_and_files(tmp_path):
    missing = tmp_path / "no-such-dir"
    with pytest.raises(FileNotFoundError) as info:
        load_idx_dataset(missing)
    message = str(info.value)
    assert str(missing) in message
    assert all(name in message for name in IDX_FILES.values())


def test_load_idx_dataset_missing_file_names_it(tmp_path):
    root = make_fake_mnist(tmp_path)
    (root / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(FileNotFoundError) as info:
        load_idx_dataset(root)
    message = str(info.value)
    assert str(root) in message and "lacks t10k-labels-idx1-ubyte" in message
    assert all(name in message for name in IDX_FILES.values())


def test_load_idx_dataset_truncated_file_names_it(tmp_path):
    root = make_fake_mnist(tmp_path, gz=False)
    path = root / "train-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:-7])
    with pytest.raises(ValueError, match="truncated") as info:
        load_idx_dataset(root)
    assert str(path) in str(info.value)


def test_load_idx_dataset_inconsistent_files(tmp_path):
    root = make_fake_mnist(tmp_path)
    write_idx(root / "train-labels-idx1-ubyte.gz", torch.zeros(59, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"60 images but .* 59 labels"):
        load_idx_dataset(root)
    write_idx(root / "train-labels-idx1-ubyte.gz", torch.zeros(60, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="labels of shape"):
        load_idx_dataset(root)
    write_idx(root / "train-images-idx3-ubyte.gz", torch.zeros(60, dtype=torch.uint8))
    with pytest.raises(ValueError, match="images of shape"):
        load_idx_dataset(root)


# --------------------------------------------------------------------------------------------------------------------
# make_datamodule
# --------------------------------------------------------------------------------------------------------------------


def test_make_datamodule_names(tmp_path):
    assert make_datamodule("digits", batch_size=8).batch_size == 8
    root = make_fake_mnist(tmp_path)
    fashion = make_datamodule("Fashion-MNIST", root=root, val_size=0)
    assert fashion.name == "fashion_mnist" and fashion.class_names == FASHION_MNIST_CLASSES
    assert make_datamodule("mnist", root=root).name == "mnist"
    generic = make_datamodule("idx", root=str(root), name="kmnist")
    assert generic.name == "kmnist" and generic.split_sizes["test"] == 20


def test_make_datamodule_errors(tmp_path):
    with pytest.raises(ValueError) as info:
        make_datamodule("cifar10")
    assert all(name in str(info.value) for name in DATASET_NAMES)
    with pytest.raises(ValueError, match="needs root"):
        make_datamodule("idx")
    if not Path(MNIST_ROOT).exists():
        with pytest.raises(FileNotFoundError, match=MNIST_ROOT):
            make_datamodule("mnist", root=None)


def test_make_datamodule_fashion_mnist_missing_suggests_the_package(tmp_path, monkeypatch):
    import lightprune.experiment.data as data

    missing = str(tmp_path / "fashion-mnist")
    monkeypatch.setattr(data, "FASHION_MNIST_ROOT", missing)
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist") as info:
        make_datamodule("fashion_mnist")
    assert missing in str(info.value) and "train-images-idx3-ubyte" in str(info.value)


@pytest.mark.slow
def test_real_fashion_mnist():
    if not Path(FASHION_MNIST_ROOT).is_dir():
        pytest.skip(f"{FASHION_MNIST_ROOT} not found: install the Debian package dataset-fashion-mnist")
    dm = make_datamodule("fashion_mnist", limit=500, val_size=100)
    assert dm.dims == (1, 28, 28) and dm.num_classes == 10
    assert dm.split_sizes == {"train": 400, "val": 100, "test": 500}
    x = dm.train_dataset.tensors[0]
    assert float(x.min()) >= 0.0 and float(x.max()) <= 1.0 and float(x.max()) > 0.9
    assert set(dm.test_dataset.tensors[1].tolist()) == set(range(10))
