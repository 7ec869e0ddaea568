"""Checkpoints as untrusted input.

* What the Trainer writes while ``PruningCallback`` is attached is plain torch: the pruned tensors under their own
  names (effective values, zeros where pruned), loading strictly into a fresh, unpruned model with torch alone; the
  masks, clock and rewind snapshot are in the callback's state.
* Everything the callback saves is plain data: checkpoints load with ``torch.load(..., weights_only=True)`` and a fit
  resumes with ``weights_only=True``.
* A truncated file fails in ``torch.load``, before the model is touched.
* Tampered masks in the callback's state (another shape, an unknown tensor, an integer dtype) are refused before the
  callback changes anything and before training, with an error naming the tensor.
* Single bit flips anywhere in the file: each one either fails to load (model unchanged) or loads whole; where a
  load gives other tensor values, they differ from the saved ones in exactly the flipped bit of the one tensor whose
  storage holds it (torch's zip reader verifies no checksum, so that bit is undetectable), never in another bit or
  another tensor (two tensors sharing a storage), and a flip outside tensor data changes no tensor.
"""

from __future__ import annotations

import io
import pickle
import random
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor, nn

from lightprune import prune
from lightprune.callback import PruningCallback
from lightprune.schedules import Cubic
from tiny_lightning import STEPS_PER_EPOCH, WEIGHTS, folded, pruning_state, quiet_trainer
from tiny_lightning import TinyNet as Net
from tiny_lightning import state as state_of

pytestmark = [
    pytest.mark.usefixtures("one_thread_for_module"),
    pytest.mark.filterwarnings("ignore:.*checkpoint directory.*"),
    pytest.mark.filterwarnings("ignore:.*dirpath has changed.*"),
]

PRUNED = list(WEIGHTS)


X = torch.randn(5, 8, generator=torch.Generator().manual_seed(7))


def run(root: Path, *, ckpt_path: Path | None = None, epochs: int = 2, **options: Any) -> tuple[Net, PruningCallback]:
    callback = PruningCallback(Cubic(final=0.6, start=0, end=12, frequency=4), make_permanent=False, **options)
    model = Net()
    checkpoints = ModelCheckpoint(root / "ckpt", every_n_epochs=1, save_top_k=-1)
    options = {"max_epochs": epochs, "enable_checkpointing": True, "default_root_dir": root}
    trainer = quiet_trainer([callback, checkpoints], **options)
    trainer.fit(model, ckpt_path=ckpt_path, weights_only=True if ckpt_path is not None else None)
    return model, callback


@pytest.fixture(scope="module")
def pruned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Net, Path]:
    """A model pruned by the callback (2 epochs) and its checkpoint after epoch 1 (masks, weights, rewind snapshot)."""
    root = tmp_path_factory.mktemp("pruned")
    model, _ = run(root, rewind="init")
    return model, root / "ckpt" / f"epoch=1-step={2 * STEPS_PER_EPOCH}.ckpt"


class Fingerprint:
    """Everything a failed load must leave as it was: each module's parameters, buffers and hooks (the same objects
    in the same order), the methods of its pruning containers, and every value."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.structure = self._structure(model)
        self.values = state_of(model)

    @staticmethod
    def _structure(model: nn.Module) -> list[tuple[str, list[tuple[Any, Any]]]]:
        return [
            (
                name,
                [*m._parameters.items(), *m._buffers.items(), *m._forward_pre_hooks.items()]
                + [(key, tuple(h)) for key, h in m._forward_pre_hooks.items() if isinstance(h, prune.PruningContainer)],
            )
            for name, m in model.named_modules()
        ]

    def assert_unchanged(self) -> None:
        now = self._structure(self.model)
        assert [name for name, _ in now] == [name for name, _ in self.structure]
        for (name, items), (_, before) in zip(now, self.structure, strict=True):
            assert [key for key, _ in items] == [key for key, _ in before], f"{name}: other keys or order"
            for (key, a), (_, b) in zip(items, before, strict=True):
                same = (
                    all(x is y for x, y in zip(a, b, strict=True)) and len(a) == len(b)
                    if isinstance(a, tuple)
                    else a is b
                )
                assert same, f"{name}.{key} is another object"
        values = state_of(self.model)
        assert list(values) == list(self.values)
        for key, value in self.values.items():
            assert torch.equal(values[key], value), f"{key} changed by a failed load"


# ----------------------------------------------------------------------------------------------------------------------
# Where a checkpoint written during fit loads, strictly
# ----------------------------------------------------------------------------------------------------------------------


def test_the_checkpoint_holds_plain_masked_weights_and_the_masks_apart(pruned: tuple[Net, Path]) -> None:
    _, path = pruned
    checkpoint = torch.load(path, weights_only=True)
    saved = checkpoint["state_dict"]
    assert list(saved) == list(Net().state_dict())  # the unpruned model's keys, in its order
    masks = pruning_state(checkpoint)["masks"]
    assert sorted(masks) == PRUNED
    for name in PRUNED:
        assert masks[name].dtype == torch.bool and int((~masks[name]).sum()) > 0
        assert not bool(saved[name][~masks[name]].any()), f"{name}: a pruned entry is not zero"


def same_model() -> nn.Module:
    model = Net(seed=3)
    for name in PRUNED:
        prune.random_unstructured(model.get_submodule(name[: -len(".weight")]), "weight", amount=0.3)
    prune.prepare_for_state_dict(model, Net().state_dict())  # a plain checkpoint: make the pruning permanent first
    return model


TARGETS: dict[str, Callable[[], nn.Module]] = {
    "a fresh model, torch alone": lambda: Net(seed=3),
    "a pruned model, prepare_for_state_dict": same_model,
}


@pytest.mark.parametrize("target", list(TARGETS))
def test_a_checkpoint_loads_strictly(pruned: tuple[Net, Path], target: str) -> None:
    saved = torch.load(pruned[1], weights_only=True)["state_dict"]
    model = TARGETS[target]()
    assert str(model.load_state_dict(saved, strict=True)) == "<All keys matched successfully>"
    loaded = state_of(model)
    assert list(loaded) == list(saved)
    for key, value in saved.items():
        assert torch.equal(loaded[key], value), key


# ----------------------------------------------------------------------------------------------------------------------
# Plain data only: weights-only loading
# ----------------------------------------------------------------------------------------------------------------------

PLAIN = (Tensor, int, float, str, bool, type(None))


def assert_plain(value: Any, where: str) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            assert isinstance(key, (str, int)), f"{where}: key {key!r}"
            assert_plain(item, f"{where}.{key}")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            assert_plain(item, f"{where}[{index}]")
    else:
        assert isinstance(value, PLAIN), f"{where} is a {type(value).__name__}"
        assert not isinstance(value, Tensor) or type(value) is Tensor, f"{where} is a {type(value).__name__}"


@pytest.mark.parametrize("rewind", [None, "init", 0, "snapshot"])
def test_the_callback_state_is_plain_data_and_checkpoints_load_weights_only(tmp_path: Path, rewind: Any) -> None:
    options: dict[str, Any] = {"rewind": PruningCallback.snapshot_weights(Net()) if rewind == "snapshot" else rewind}
    options["method"] = "random_unstructured"
    _, callback = run(tmp_path, **options)
    assert_plain(callback.state_dict(), "PruningCallback.state_dict()")
    paths = sorted((tmp_path / "ckpt").glob("*.ckpt"))
    assert len(paths) == 2
    for path in paths:
        checkpoint = torch.load(path, weights_only=True)
        (state,) = [v for k, v in checkpoint["callbacks"].items() if k.startswith("PruningCallback")]
        assert_plain(state, path.name)
        assert_plain(checkpoint["state_dict"], path.name)


def test_a_fit_resumes_with_weights_only(tmp_path: Path) -> None:
    uninterrupted, _ = run(tmp_path / "a", epochs=3)
    resumed, _ = run(tmp_path / "b", epochs=3, ckpt_path=tmp_path / "a" / "ckpt" / "epoch=0-step=8.ckpt")
    expected, actual = state_of(uninterrupted), state_of(resumed)
    assert list(actual) == list(expected)
    for key, value in folded(actual).items():  # the effective weights
        assert torch.equal(value, folded(expected)[key]), key
    for key in (key for key in expected if key.endswith("_mask")):
        assert torch.equal(actual[key], expected[key]), key


# ----------------------------------------------------------------------------------------------------------------------
# Truncated files
# ----------------------------------------------------------------------------------------------------------------------

CUTS = [0, 1, 10, 100, 1000, "half", "-100", "-1"]
LOAD_ERRORS = (RuntimeError, EOFError, ValueError, OSError, pickle.UnpicklingError)
"""What torch.load raises for a truncated file, depending on where it is cut (see RELIABILITY.md)."""


def cut_at(data: bytes, cut: int | str) -> bytes:
    if cut == "half":
        return data[: len(data) // 2]
    if isinstance(cut, str):
        return data[: len(data) + int(cut)]
    return data[:cut]


@pytest.mark.parametrize("cut", CUTS, ids=[str(c) for c in CUTS])
def test_a_truncated_checkpoint_fails_before_the_model_is_touched(
    pruned: tuple[Net, Path], tmp_path: Path, cut: int | str
) -> None:
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(cut_at(pruned[1].read_bytes(), cut))
    with pytest.raises(LOAD_ERRORS):
        torch.load(truncated, weights_only=True)
    model = Net()
    fingerprint = Fingerprint(model)
    trainer = L.Trainer(max_epochs=4, logger=False, enable_progress_bar=False, default_root_dir=tmp_path)
    with pytest.raises(LOAD_ERRORS):
        trainer.fit(model, ckpt_path=truncated, weights_only=True)
    assert trainer.global_step == 0
    fingerprint.assert_unchanged()


# ----------------------------------------------------------------------------------------------------------------------
# Tampered masks in the callback's state
# ----------------------------------------------------------------------------------------------------------------------


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def tamper(masks: dict[str, Any]) -> None:
        masks[key] = value

    return tamper


TAMPERINGS: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "mask of another shape": (_set("net.4.weight", torch.ones(12, 4, dtype=torch.bool)), r"net\.4\.weight.*\(12, 4\)"),
    "a mask of an unknown tensor": (_set("net.9.weight", torch.ones(2, dtype=torch.bool)), r"'net\.9\.weight'"),
    "an integer mask": (_set("net.0.weight", torch.ones(16, 8, dtype=torch.int64)), r"net\.0\.weight.*torch\.int64"),
}


@pytest.mark.parametrize("case", list(TAMPERINGS))
def test_resuming_from_tampered_masks_fails_before_training(
    pruned: tuple[Net, Path], tmp_path: Path, case: str
) -> None:
    tamper, message = TAMPERINGS[case]
    checkpoint = torch.load(pruned[1], weights_only=True)
    tamper(pruning_state(checkpoint)["masks"])
    path = tmp_path / "tampered.ckpt"
    torch.save(checkpoint, path)
    model = Net()
    callback = PruningCallback(Cubic(final=0.6, start=0, end=12, frequency=4), make_permanent=False, rewind="init")
    trainer = L.Trainer(max_epochs=4, logger=False, enable_progress_bar=False, default_root_dir=tmp_path,
                        callbacks=[callback])  # fmt: skip
    with pytest.raises(ValueError, match=message) as info:
        trainer.fit(model, ckpt_path=path, weights_only=True)
    assert "nothing was changed" in str(info.value)
    assert trainer.global_step == 0
    assert not prune.is_pruned(model)  # no mask was put back


# ----------------------------------------------------------------------------------------------------------------------
# Bit flips
# ----------------------------------------------------------------------------------------------------------------------

FLIPS = 150


def storage_records(data: bytes) -> dict[str, tuple[int, int]]:
    """Where each tensor storage (``<archive>/data/<key>``) lies in a checkpoint's bytes: its key -> (start, end).

    torch writes its zip archive uncompressed (stored), so an entry's bytes start after its local header (30 bytes,
    the file name and the extra field, whose lengths the header gives at offsets 26 and 28).
    """
    records = {}
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        for info in archive.infolist():
            folder, _, key = info.filename.rpartition("/")
            if folder.endswith("/data") and info.compress_type == zipfile.ZIP_STORED:
                name_length, extra_length = struct.unpack_from("<HH", data, info.header_offset + 26)
                start = info.header_offset + 30 + name_length + extra_length
                records[key] = (start, start + info.compress_size)
    return records


def tensors_of(value: Any, where: str = "") -> dict[str, Tensor]:
    """Every tensor in a nested checkpoint (dicts, lists, tuples), keyed by its path."""
    if isinstance(value, Tensor):
        return {where: value}
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    return {path: t for key, item in items for path, t in tensors_of(item, f"{where}/{key}").items()}


def storage_bytes(tensor: Tensor) -> Tensor:
    return torch.frombuffer(bytearray(bytes(tensor.untyped_storage())), dtype=torch.uint8)


def layout(t: Tensor) -> tuple[Any, ...]:
    """What, besides its storage's bytes, decides a tensor's values: dtype, shape, strides and storage offset."""
    return t.dtype, tuple(t.shape), t.stride(), t.storage_offset(), t.untyped_storage().nbytes()


def flipped_bits(a: Tensor, b: Tensor) -> list[tuple[int, int]]:
    """(byte, bit) of every bit in which the storages of ``a`` and ``b`` differ."""
    xor = storage_bytes(a) ^ storage_bytes(b)
    return [(int(i), bit) for i in xor.nonzero().flatten() for bit in range(8) if int(xor[i]) >> bit & 1]


@pytest.fixture(scope="module")
def portable(pruned: tuple[Net, Path], tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """The epoch-1 checkpoint re-saved with the temporary directory in its paths (ModelCheckpoint's state) spelled
    as a fixed string, so that its bytes, and the bytes the seeded flips hit, are the same on every machine."""
    root = str(pruned[1].parent)

    def fixed(value: Any) -> Any:
        if isinstance(value, str):
            return value.replace(root, "/ckpt")
        if isinstance(value, dict):
            return {key: fixed(item) for key, item in value.items()}
        return value

    path = tmp_path_factory.mktemp("portable") / "epoch=1.ckpt"
    torch.save(fixed(torch.load(pruned[1], weights_only=True)), path)
    return path.read_bytes()


@pytest.mark.slow
def test_single_bit_flips_fail_cleanly_or_change_exactly_the_flipped_bit(portable: bytes) -> None:
    """A flip either fails to load (the model unchanged), or loads whole; a load that gives other tensor values than
    the saved ones must change exactly the flipped bit, in the one tensor whose storage holds the flipped byte (torch
    verifies no checksum: that one bit is undetectable). Anything else fails: another bit, another tensor, two
    tensors sharing a storage, a tensor's dtype, shape, strides or storage changed, or a flip outside tensor data
    that changes a tensor of the model. (A flip in a name outside the model's state renames that key undetected, as
    torch checks no names, and one in a storage's key can point a tensor of a callback's state at another storage of
    the same layout; both are counted, not failed.)"""
    data = portable
    records = storage_records(data)
    original = torch.load(io.BytesIO(data), weights_only=True)
    saved = tensors_of(original)
    assert len(records) == len({t.untyped_storage().data_ptr() for t in saved.values()}) == len(saved)
    rng = random.Random(0)
    outcomes: dict[str, int] = {}
    for _ in range(FLIPS):
        position, bit = rng.randrange(len(data)), rng.randrange(8)
        flipped = bytearray(data)
        flipped[position] ^= 1 << bit
        model = Net(seed=5)
        fingerprint = Fingerprint(model)
        try:
            checkpoint = torch.load(io.BytesIO(bytes(flipped)), weights_only=True)
            state_dict = checkpoint["state_dict"]
        except Exception:
            outcomes["torch.load raised"] = outcomes.get("torch.load raised", 0) + 1
            continue
        try:
            model.load_state_dict(state_dict, strict=True)
        except Exception:
            fingerprint.assert_unchanged()
            outcomes["load_state_dict raised"] = outcomes.get("load_state_dict raised", 0) + 1
            continue
        loaded = state_of(model)
        for key, value in state_dict.items():
            assert torch.equal(loaded[key], value), f"{key} half-loaded"
        now = tensors_of(checkpoint)
        inside = [(key, position - start) for key, (start, end) in records.items() if start <= position < end]
        where = f"bit {bit} of byte {position} ({'storage ' + inside[0][0] if inside else 'outside tensor data'})"
        both = [key for key in now if key in saved]
        relaid = [key for key in both if layout(now[key]) != layout(saved[key])]
        assert not relaid, f"{where} silently changed the dtype, shape, strides or storage of {relaid}"
        changed = {key: flipped_bits(now[key], saved[key]) for key in both}
        changed = {key: bits for key, bits in changed.items() if bits}
        if not inside:
            in_model = sorted(key for key in changed if key.startswith("/state_dict/"))
            assert not in_model, f"{where} silently changed {in_model}"
            # a flip in a name outside the model's state (which load_state_dict(strict=True) checked) renames a key,
            # or, in a storage's key, points a tensor of a callback's state at another storage of the same layout
            if changed:
                kind = "loaded, a tensor outside the model read from another storage"
            else:
                kind = "loaded, same tensors" if list(now) == list(saved) else "loaded, a key outside the model renamed"
            outcomes[kind] = outcomes.get(kind, 0) + 1
            continue
        assert list(now) == list(saved), f"{where} changed which tensors the checkpoint holds"
        assert list(changed.values()) == [[(inside[0][1], bit)]], f"{where} silently changed {changed}"
        outcomes["loaded, the flipped bit in one tensor"] = outcomes.get("loaded, the flipped bit in one tensor", 0) + 1
    print(f"\n{FLIPS} single bit flips in a {len(data)}-byte checkpoint: {outcomes}")
    assert {"torch.load raised", "loaded, the flipped bit in one tensor"} <= set(outcomes)  # both kinds were tried
