"""Checkpoints as untrusted input (issue #6).

* A lightprune checkpoint loads strictly into the same model, into a fresh model (``prepare_for_state_dict`` or the
  callback's ``install_checkpoint_adapter``) and into a model pruned by ``torch.nn.utils.prune``.
* Everything the callback saves is plain data: checkpoints load with ``torch.load(..., weights_only=True)`` and a fit
  resumes with ``weights_only=True``.
* A truncated file fails in ``torch.load``, before the model is touched.
* A tampered file (shapes changed, tensors removed, replaced or added) fails with an error naming the keys and leaves
  the model exactly as it was: through the adapter, ``prepare_for_state_dict`` and ``trainer.fit(ckpt_path=...)``.
  Torch alone copies every tensor it can before it raises (a half-loaded model); the adapter checks first.
* Single bit flips anywhere in the file: each one either fails to load (model unchanged) or loads different values
  silently (torch's zip reader does not verify checksums); counted and reported, never half-loaded.
"""

from __future__ import annotations

import copy
import io
import pickle
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor, nn
from torch.nn.utils import prune as torch_prune

from lightprune import prune
from lightprune.callback import PruningCallback, install_checkpoint_adapter
from lightprune.schedules import Cubic
from tiny_lightning import TinyNet as Net
from tiny_lightning import folded

pytestmark = [
    pytest.mark.usefixtures("one_thread_for_module"),
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*"),
    pytest.mark.filterwarnings("ignore:.*exists and is not empty.*"),
    pytest.mark.filterwarnings("ignore:.*checkpoint directory.*"),
    pytest.mark.filterwarnings("ignore:.*callbacks used to create the checkpoint.*"),
    pytest.mark.filterwarnings("ignore:.*dirpath has changed.*"),
]

PRUNED = ["net.0.weight", "net.2.weight", "net.4.weight"]
STEPS_PER_EPOCH = 8


class AdaptingNet(Net):
    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        install_checkpoint_adapter(self)


X = torch.randn(5, 8, generator=torch.Generator().manual_seed(7))


def run(root: Path, *, ckpt_path: Path | None = None, epochs: int = 2, **options: Any) -> tuple[Net, PruningCallback]:
    callback = PruningCallback(Cubic(final=0.6, start=0, end=12, frequency=4), make_permanent=False, **options)
    model = Net()
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        callbacks=[callback, ModelCheckpoint(root / "ckpt", every_n_epochs=1, save_top_k=-1)],
    )
    trainer.fit(model, ckpt_path=ckpt_path, weights_only=True if ckpt_path is not None else None)
    return model, callback


@pytest.fixture(scope="module")
def pruned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Net, Path]:
    """A model pruned by the callback (2 epochs) and its checkpoint after epoch 1 (masks, weights, rewind snapshot)."""
    root = tmp_path_factory.mktemp("pruned")
    model, _ = run(root, rewind="init")
    return model, root / "ckpt" / f"epoch=1-step={2 * STEPS_PER_EPOCH}.ckpt"


def state_of(model: nn.Module) -> dict[str, Tensor]:
    return {key: value.detach().clone() for key, value in model.state_dict().items()}


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


def loaded_model(path: Path, seed: int = 5) -> Net:
    """A fresh model holding a checkpoint's pruned state (as the trained model held it), with the adapter."""
    model = AdaptingNet(seed=seed)
    model.load_state_dict(torch.load(path, weights_only=True)["state_dict"])
    return model


# ----------------------------------------------------------------------------------------------------------------------
# Where a lightprune checkpoint loads, strictly
# ----------------------------------------------------------------------------------------------------------------------


def same_model() -> nn.Module:
    model = Net(seed=3)
    for name in PRUNED:
        prune.random_unstructured(model.get_submodule(name[: -len(".weight")]), "weight", amount=0.3)
    return model


def fresh_prepared(state_dict: dict[str, Tensor]) -> nn.Module:
    model = Net(seed=3)
    assert prune.prepare_for_state_dict(model, state_dict) == PRUNED
    return model


def fresh_with_adapter(state_dict: dict[str, Tensor]) -> nn.Module:
    return AdaptingNet(seed=3)


def torch_pruned(state_dict: dict[str, Tensor]) -> nn.Module:
    model = Net(seed=3)
    for name in PRUNED:
        torch_prune.l1_unstructured(model.get_submodule(name[: -len(".weight")]), "weight", amount=0.5)
    return model


TARGETS: dict[str, Callable[[dict[str, Tensor]], nn.Module]] = {
    "the same (pruned) model": lambda state_dict: same_model(),
    "a fresh model, prepare_for_state_dict": fresh_prepared,
    "a fresh model, install_checkpoint_adapter": fresh_with_adapter,
    "a model pruned by torch.nn.utils.prune": torch_pruned,
}


@pytest.mark.parametrize("target", list(TARGETS))
def test_a_checkpoint_loads_strictly(pruned: tuple[Net, Path], target: str) -> None:
    saved = torch.load(pruned[1], weights_only=True)["state_dict"]
    model = TARGETS[target](saved)
    assert str(model.load_state_dict(saved, strict=True)) == "<All keys matched successfully>"
    loaded = state_of(model)
    assert sorted(loaded) == sorted(saved)
    for key, value in saved.items():  # a torch-pruned model keeps its float masks: equal values
        assert torch.equal(loaded[key].to(value.dtype), value), key
    reference = Net()
    reference.load_state_dict(folded(saved))
    with torch.no_grad():
        assert torch.equal(model(X), reference(X))


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
    expected = state_of(uninterrupted)
    assert all(torch.equal(value, expected[key]) for key, value in state_of(resumed).items())


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
    model = AdaptingNet()
    fingerprint = Fingerprint(model)
    trainer = L.Trainer(max_epochs=4, logger=False, enable_progress_bar=False, default_root_dir=tmp_path)
    with pytest.raises(LOAD_ERRORS):
        trainer.fit(model, ckpt_path=truncated, weights_only=True)
    assert trainer.global_step == 0
    fingerprint.assert_unchanged()


# ----------------------------------------------------------------------------------------------------------------------
# Tampered contents
# ----------------------------------------------------------------------------------------------------------------------


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def tamper(state_dict: dict[str, Any]) -> None:
        state_dict[key] = value

    return tamper


def _delete(key: str) -> Callable[[dict[str, Any]], None]:
    def tamper(state_dict: dict[str, Any]) -> None:
        del state_dict[key]

    return tamper


TAMPERINGS: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "orig of another shape": (_set("net.2.weight_orig", torch.zeros(5, 5)), "net.2.weight_orig"),
    "mask of another shape": (_set("net.4.weight_mask", torch.ones(12, 4, dtype=torch.bool)), "net.4.weight_mask"),
    "mask removed": (_delete("net.2.weight_mask"), "net.2.weight"),
    "orig removed": (_delete("net.0.weight_orig"), "net.0.weight"),
    "bias removed": (_delete("net.4.bias"), "net.4.bias"),
    "bias of another shape": (_set("net.4.bias", torch.zeros(7)), "net.4.bias"),
    "a tensor replaced by a string": (_set("net.0.weight_orig", "weights"), "net.0.weight_orig"),
    "an unknown key added": (_set("net.9.weight", torch.zeros(1)), "net.9.weight"),
    "a plain weight beside the pair": (_set("net.0.weight", torch.zeros(16, 8)), "net.0.weight"),
}


def tampered(path: Path, tamper: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    checkpoint = torch.load(path, weights_only=True)
    tamper(checkpoint["state_dict"])
    return checkpoint


@pytest.mark.parametrize("case", list(TAMPERINGS))
@pytest.mark.parametrize("into", ["a fresh model", "a model pruned differently", "the trained model"])
def test_a_tampered_state_dict_is_refused_and_the_model_is_unchanged(
    pruned: tuple[Net, Path], case: str, into: str
) -> None:
    tamper, key = TAMPERINGS[case]
    state_dict = tampered(pruned[1], tamper)["state_dict"]
    if into == "the trained model":
        model: nn.Module = loaded_model(pruned[1])
    else:
        model = AdaptingNet(seed=5)
        if into == "a model pruned differently":  # the adapter would have to make net.4 permanent, add net.0
            prune.l1_unstructured(model.net[4], "weight", amount=10)
            prune.l1_unstructured(model.net[4], "bias", amount=1)
    fingerprint = Fingerprint(model)
    with pytest.raises(RuntimeError, match="lightprune checked it first") as info:
        model.load_state_dict(state_dict, strict=True)
    assert key in str(info.value)
    fingerprint.assert_unchanged()


def test_torch_alone_half_loads_a_tampered_state_dict(pruned: tuple[Net, Path]) -> None:
    """Why the adapter checks first: torch copies every tensor it can, then raises."""
    state_dict = tampered(pruned[1], TAMPERINGS["bias of another shape"][0])["state_dict"]
    model = Net()  # no adapter: prepare, then let torch load
    prune.prepare_for_state_dict(model, state_dict)
    before = state_of(model)
    with pytest.raises(RuntimeError, match=r"size mismatch for net\.4\.bias"):
        model.load_state_dict(state_dict, strict=True)
    assert not torch.equal(state_of(model)["net.0.weight_orig"], before["net.0.weight_orig"])


def test_prepare_for_state_dict_refuses_a_bad_pair_and_changes_nothing(pruned: tuple[Net, Path]) -> None:
    state_dict = tampered(pruned[1], TAMPERINGS["mask of another shape"][0])["state_dict"]
    model = Net()
    fingerprint = Fingerprint(model)
    with pytest.raises(ValueError, match=r"net\.4\.weight_mask has shape \(12, 4\)"):
        prune.prepare_for_state_dict(model, state_dict)
    fingerprint.assert_unchanged()  # net.0 and net.2 were not put under the reparametrization either


@pytest.mark.parametrize("case", ["mask removed", "orig of another shape", "an unknown key added"])
def test_resuming_from_a_tampered_checkpoint_fails_before_training(
    pruned: tuple[Net, Path], tmp_path: Path, case: str
) -> None:
    path = tmp_path / "tampered.ckpt"
    torch.save(tampered(pruned[1], TAMPERINGS[case][0]), path)
    model = Net()
    fingerprint = Fingerprint(model)
    callback = PruningCallback(Cubic(final=0.6, start=0, end=12, frequency=4), make_permanent=False)
    trainer = L.Trainer(max_epochs=4, logger=False, enable_progress_bar=False, default_root_dir=tmp_path,
                        callbacks=[callback])  # fmt: skip
    with pytest.raises(RuntimeError, match=TAMPERINGS[case][1].replace(".", r"\.")):
        trainer.fit(model, ckpt_path=path, weights_only=True)
    assert trainer.global_step == 0
    fingerprint.assert_unchanged()


# ----------------------------------------------------------------------------------------------------------------------
# Bit flips
# ----------------------------------------------------------------------------------------------------------------------

FLIPS = 150


@pytest.mark.slow
def test_single_bit_flips_either_fail_cleanly_or_load_whole(pruned: tuple[Net, Path]) -> None:
    data = pruned[1].read_bytes()
    rng = random.Random(0)
    outcomes: dict[str, int] = {}
    for _ in range(FLIPS):
        position, bit = rng.randrange(len(data)), rng.randrange(8)
        flipped = bytearray(data)
        flipped[position] ^= 1 << bit
        model = AdaptingNet(seed=5)
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
            label = "load_state_dict raised, model unchanged"
            outcomes[label] = outcomes.get(label, 0) + 1
            continue
        loaded = state_of(model)
        for key, value in state_dict.items():
            assert torch.equal(loaded[key], value), f"{key} half-loaded"
        original = torch.load(pruned[1], weights_only=True)
        same = all(torch.equal(v, original["state_dict"][k]) for k, v in state_dict.items())
        label = "loaded, identical state_dict" if same else "loaded whole, different values (undetectable)"
        outcomes[label] = outcomes.get(label, 0) + 1
    print(f"\n{FLIPS} single bit flips in a {len(data)}-byte checkpoint: {outcomes}")
    assert sum(outcomes.values()) == FLIPS


# ----------------------------------------------------------------------------------------------------------------------
# The adapter's checks never refuse what torch itself loads
# ----------------------------------------------------------------------------------------------------------------------


class Scalar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.0))
        self.register_buffer("steps", torch.tensor(0), persistent=False)


class WithExtraState(nn.Linear):
    def get_extra_state(self) -> Any:
        return {"note": "kept"}

    def set_extra_state(self, state: Any) -> None:
        self.note = state["note"]


def batch_norm_net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(2, 3))


def old_batch_norm_checkpoint() -> tuple[nn.Module, dict[str, Any], bool]:
    """A BatchNorm state_dict of version 1 (before num_batches_tracked), with a pruned conv."""
    source = batch_norm_net()
    prune.l1_unstructured(source[0], "weight", amount=3)
    state_dict = source.state_dict()
    del state_dict["1.num_batches_tracked"]
    state_dict._metadata["1"]["version"] = 1  # type: ignore[attr-defined]
    return batch_norm_net(), state_dict, True


LEGIT: dict[str, Callable[[], tuple[nn.Module, dict[str, Any], bool]]] = {
    "batch norm checkpoint without num_batches_tracked": old_batch_norm_checkpoint,
    "a 0-d parameter saved as 1-d": lambda: (Scalar(), {"scale": torch.tensor([2.0])}, True),
    "extra state": lambda: (WithExtraState(2, 2), WithExtraState(2, 2).state_dict(), True),
    "strict=False with missing and unexpected keys": lambda: (
        nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)),
        {"0.weight": torch.ones(2, 2), "9.bias": torch.ones(1)},
        False,
    ),
    "a pruned checkpoint, strict=False, a missing bias": lambda: (
        nn.Sequential(nn.Linear(2, 2)),
        {"0.weight_orig": torch.ones(2, 2), "0.weight_mask": torch.tensor([[1.0, 0.0], [1.0, 1.0]])},
        False,
    ),
}


@pytest.mark.parametrize("case", list(LEGIT))
def test_the_adapter_refuses_nothing_torch_loads(case: str) -> None:
    model, state_dict, strict = LEGIT[case]()
    plain, adapted = copy.deepcopy(model), model
    install_checkpoint_adapter(adapted)
    if not any(key.endswith("_orig") for key in state_dict):
        plain.load_state_dict(state_dict, strict=strict)  # torch alone loads it
    result = adapted.load_state_dict(state_dict, strict=strict)
    if strict:
        assert str(result) == "<All keys matched successfully>"
    for key, value in state_dict.items():
        loaded = adapted.state_dict().get(key)
        if isinstance(loaded, Tensor):
            assert torch.equal(loaded, value.reshape(loaded.shape).to(loaded.dtype)), key
