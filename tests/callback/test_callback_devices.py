"""``PruningCallback`` fits on every device: the CPU and, where one is visible, a CUDA GPU (skipped cleanly elsewhere).

Each fit checks what a user relies on whatever the device: the exact count of pruned weights, masks and weights on the
model's device, pruned weights at zero, the reparametrization gone at fit end (or kept, with ``make_permanent=False``),
and for the criteria that read statistics or gradients (activation, OBS, RigL) that those were taken on the device.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch import nn

from lightprune import prune
from lightprune.callback import PruningCallback
from lightprune.schedules import Linear
from tiny_lightning import WEIGHTS, N, TinyNet, quiet_trainer

pytestmark = [
    pytest.mark.usefixtures("one_thread_for_module"),
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:.*the default selection.*covers.*"),
]

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")),
]


def layers(model: nn.Module) -> list[nn.Module]:
    return [model.get_submodule(name.rsplit(".", 1)[0]) for name in WEIGHTS]


def zeros(model: nn.Module) -> int:
    return sum(int((layer.weight == 0).sum()) for layer in layers(model))


class DeviceSpy(L.Callback):
    """Records, at the end of training, the device of every selected tensor and of its mask (Lightning moves the
    model back to the CPU once fit returns, so the devices the fit ran on are read here). Put it before the pruning
    callback: its own ``on_train_end`` makes the pruning permanent."""

    def __init__(self, callback: PruningCallback) -> None:
        self.callback, self.devices = callback, set[str]()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        masked = self.callback._masked
        assert masked is not None
        for _, module, name in masked.selection:
            self.devices |= {prune.original(module, name).device.type, masked.mask(module, name).device.type}


def fit(
    callback: PruningCallback, device: str, model: L.LightningModule | None = None, **options: Any
) -> L.LightningModule:
    """Fit ``model`` (a new TinyNet) on ``device`` and check that the tensors and their masks were there."""
    model = TinyNet() if model is None else model
    spy = DeviceSpy(callback)
    quiet_trainer([spy, callback], accelerator=device, **{"max_epochs": 2, **options}).fit(model)
    assert spy.devices == {device}
    return model


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("masking", ["reparametrize", "inplace"])
@pytest.mark.parametrize("scope", ["global", "layerwise"])
def test_a_gradual_fit_prunes_exactly_on_the_device(device: str, masking: str, scope: str) -> None:
    callback = PruningCallback(Linear(final=0.75, start=2, end=10, frequency=2), scope=scope, masking=masking)
    model = fit(callback, device)
    for layer in layers(model):
        assert not prune.is_pruned(layer)  # made permanent at fit end
    if scope == "global":
        assert zeros(model) == round(0.75 * N)
    else:
        assert all(int((layer.weight == 0).sum()) == round(0.75 * layer.weight.numel()) for layer in layers(model))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("masking", ["reparametrize", "inplace"])
def test_masks_stay_on_the_device_and_hold_their_zeros_through_training(device: str, masking: str) -> None:
    callback = PruningCallback(
        Linear(final=0.5, start=1, end=4, frequency=1), masking=masking, make_permanent=False, mask_dtype=torch.bool
    )
    fit(callback, device)
    masked = callback._masked
    assert masked is not None
    for _, module, name in masked.selection:
        mask = masked.mask(module, name)
        assert mask.device == getattr(module, name).device  # moved back to the CPU with the model after fit
        assert mask.dtype == torch.bool
        assert not bool(getattr(module, name)[~mask].any())  # trained after the last event: still zero
    assert sum(pruned for _, pruned in masked.counts()) == round(0.5 * N)


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_precision_fit_prunes_exactly_on_the_device(device: str) -> None:
    precision = "16-mixed" if device == "cuda" else "bf16-mixed"
    callback = PruningCallback(Linear(final=0.6, start=2, end=8, frequency=2), masking="inplace")
    model = fit(callback, device, precision=precision)
    assert zeros(model) == round(0.6 * N)
    assert all(layer.weight.dtype == torch.float32 for layer in layers(model))  # master weights stay float32


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("regrow", ["rigl", "set"])
def test_dynamic_sparse_training_keeps_every_layers_count_on_the_device(device: str, regrow: str) -> None:
    callback = PruningCallback(0.7, scope="erk", regrow=regrow, regrow_every=2, regrow_until=1.0, make_permanent=False)
    seen: list[dict[str, torch.Tensor]] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
            masked = callback._masked
            seen.append({q: masked.mask(m, n).bool().cpu().clone() for q, m, n in masked.selection})

    spy = DeviceSpy(callback)
    quiet_trainer([spy, callback, Record()], accelerator=device, max_steps=9).fit(TinyNet())
    assert spy.devices == {device}
    first, last = seen[0], seen[-1]
    for qualified in first:
        assert int(first[qualified].sum()) == int(last[qualified].sum()), qualified  # counts exact per layer
    assert any(not torch.equal(first[q], last[q]) for q in first)  # the masks moved


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("importance", ["activation", "obs"])
def test_criteria_with_statistics_prune_exact_rows_on_the_device(device: str, importance: str) -> None:
    callback = PruningCallback(0.5, importance=importance, calibration_batches=2, scope="row", make_permanent=False)
    model = fit(callback, device, max_steps=1, num_sanity_val_steps=0)
    for layer in layers(model):
        mask = layer.weight_mask
        assert (mask.sum(1) == layer.weight.shape[1] - round(0.5 * layer.weight.shape[1])).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.filterwarnings("ignore:.*before the schedule's last event.*")
@pytest.mark.filterwarnings("ignore:.*the final sparsity 0.8 will not be reached.*")
def test_a_checkpoint_written_on_the_device_resumes_with_its_masks(device: str, tmp_path: Path) -> None:
    schedule = Linear(final=0.8, start=2, end=12, frequency=2)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=4, save_top_k=-1)
    first = PruningCallback(schedule, make_permanent=False)
    quiet_trainer([first, checkpoint], accelerator=device, max_steps=4, enable_checkpointing=True).fit(TinyNet())
    saved = {q: first._masked.mask(m, n).bool().cpu().clone() for q, m, n in first._masked.selection}
    resumed = PruningCallback(schedule, make_permanent=False)
    spy = DeviceSpy(resumed)
    resume = quiet_trainer([spy, resumed], accelerator=device, max_steps=5)  # one step, no event: events are even
    resume.fit(TinyNet(), ckpt_path=tmp_path / "last.ckpt")
    restored = {q: resumed._masked.mask(m, n).bool().cpu() for q, m, n in resumed._masked.selection}
    assert restored.keys() == saved.keys()
    assert all(torch.equal(restored[q], saved[q]) for q in saved)
    assert spy.devices == {device}  # the checkpoint's masks were put on the device the fit resumed on


class MovesModelAtTeardown(SingleDeviceStrategy):
    """What Lightning's strategies do at the end of fit (move the model from the GPU to the CPU), to another device
    the CPU can hold (``meta``), so the move is seen without a GPU."""

    def teardown(self) -> None:
        super().teardown()
        self.lightning_module.to("meta")


@pytest.mark.parametrize("masking", ["reparametrize", "inplace"])
def test_masks_move_with_the_model_when_lightning_moves_it_after_fit(masking: str) -> None:
    callback = PruningCallback(
        Linear(final=0.5, start=1, end=4, frequency=1), masking=masking, make_permanent=False, mask_dtype=torch.bool
    )
    quiet_trainer([callback], max_epochs=1, strategy=MovesModelAtTeardown(device=torch.device("cpu"))).fit(TinyNet())
    masked = callback._masked
    assert masked is not None
    assert {masked.mask(module, name).device.type for _, module, name in masked.selection} == {"meta"}


@pytest.mark.parametrize(
    ("device", "precision"),
    [
        ("cpu", "32-true"),
        ("cpu", "bf16-true"),
        ("cpu", "64-true"),
        pytest.param(
            "cuda", "32-true", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
        ),
    ],
)
def test_fixed_example_inputs_reach_the_forward_as_training_batches_do(device: str, precision: str) -> None:
    """``example_inputs`` are built where the user builds the callback: on the CPU, in float32. The units are found
    on the device and in the precision the model trains in, as the training batches reach it."""
    callback = PruningCallback(
        Linear(final=0.5, start=2, end=6, frequency=2), method="neurons", example_inputs=torch.randn(2, 8)
    )
    model = fit(callback, device, precision=precision)
    hidden = [model.net[0].weight, model.net[2].weight]  # the rows of the 16 and 12 hidden neurons
    assert [int((weight == 0).all(dim=1).sum()) for weight in hidden] == [8, 6]
