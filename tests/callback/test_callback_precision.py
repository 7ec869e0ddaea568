"""``PruningCallback`` in float16 mixed precision: the gradient scaler skips the optimizer steps whose gradients
overflowed, and what the callback reads from gradients (movement scores, RigL's dense gradient) leaves them out."""

from __future__ import annotations

import warnings
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import Tensor, nn

from lightprune.callback import PruningCallback
from lightprune.schedules import Constant
from tiny_lightning import TinyNet, quiet_trainer

pytestmark = pytest.mark.usefixtures("one_thread_for_module")


class Unscaled(TinyNet):
    """Targets of order 100: float16 gradients overflow at the scaler's first scales, so it skips some steps."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        out = self(x)
        return nn.functional.mse_loss(out, 100.0 * nn.functional.one_hot(y, 4).to(out.dtype))


class Scales(L.Callback):
    """The scaler's scale after every batch: a drop is a skipped step."""

    def __init__(self) -> None:
        self.scales: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.scales.append(trainer.precision_plugin.scaler.get_scale())


def float16() -> MixedPrecision:
    return MixedPrecision("16-mixed", "cpu")  # what precision="16-mixed" is on CUDA (on the CPU Lightning takes bf16)


def skipped(scales: list[float]) -> int:
    return sum(after < before for before, after in zip([2.0**16, *scales], scales, strict=False))


def test_movement_scores_leave_out_the_steps_the_scaler_skips() -> None:
    callback = PruningCallback(Constant(0.5, at=8), importance="movement", scope="layerwise", summary=False)
    sums: list[dict[str, Tensor]] = []

    class Read(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            if trainer.global_step == 7:  # the movement sums the event at step 8 ranks by
                sums.append({k: v.clone() for k, v in callback._importance.movement.state_dict()["totals"].items()})

    scales = Scales()
    model = Unscaled()
    quiet_trainer([callback, scales, Read()], max_steps=10, plugins=[float16()]).fit(model)
    assert 0 < skipped(scales.scales[:7]) < 7
    (totals,) = sums
    assert totals and all(bool(torch.isfinite(total).all()) for total in totals.values())
    for layer in (model.net[0], model.net[2], model.net[4]):
        pruned = (layer.weight == 0).flatten()
        assert int(pruned.sum()) == round(0.5 * pruned.numel())
        assert not torch.equal(pruned.nonzero().flatten(), torch.arange(int(pruned.sum())))  # not NaN ties' order


def test_rigl_does_not_move_masks_at_a_step_the_scaler_skips() -> None:
    callback = PruningCallback(0.5, regrow="rigl", regrow_every=1, regrow_until=1.0, masking="inplace", summary=False)
    moved: list[tuple[int, bool]] = []
    before: dict[str, Tensor] = {}

    class Watch(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            masked = callback._masked
            now = {q: masked.mask(m, n).bool().clone() for q, m, n in masked.selection}
            if before:
                moved.append((trainer.global_step, any(not torch.equal(now[q], before[q]) for q in now)))
            before.update(now)

    scales = Scales()
    with pytest.warns(UserWarning, match="the masks did not move at step .* the float16 gradient scaler skipped"):
        quiet_trainer([callback, scales, Watch()], max_steps=10, plugins=[float16()]).fit(Unscaled())
    drops = [i + 1 for i, (before, after) in enumerate(zip([2.0**16, *scales.scales], scales.scales, strict=False))
             if after < before]  # fmt: skip
    assert drops and len(drops) < 10
    for step, did in moved:
        if step in drops:
            assert not did, step  # a skipped step: the masks stay
    assert any(did for _, did in moved)


class SpikeOnAPrunedInput(TinyNet):
    """Input feature 3 spikes in the batch of step 2 (an update step), and the first layer's column 3 is the
    smallest, so it is pruned whole: the float16 overflow lands on pruned gradient entries alone."""

    def __init__(self) -> None:
        super().__init__()
        with torch.no_grad():
            self.net[0].weight[:, 3] = 1e-6

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        if batch_idx == 1:
            x = x.clone()
            x[:, 3] = 1e4
        return nn.functional.cross_entropy(self(x), y)


@pytest.mark.parametrize("masking", ["inplace", "reparametrize"])
def test_rigl_does_not_move_masks_when_only_pruned_gradients_overflow(masking: str) -> None:
    """In place, the pruned entries' inf was zeroed before the skip was looked for: the masks moved at a skipped
    step, and RigL regrew exactly the overflowing entries."""
    callback = PruningCallback(
        0.8,
        scope="layerwise",
        regrow="rigl",
        regrow_every=2,
        regrow_until=1.0,
        masking=masking,
        summary=False,
        make_permanent=False,
    )
    masks: list[Tensor] = []

    class Watch(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
            masks.append(callback._masked.mask(pl_module.net[0], "weight").bool().clone())

    scales = Scales()
    model = SpikeOnAPrunedInput()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_trainer([callback, scales, Watch()], max_steps=4, plugins=[float16()]).fit(model)
    assert not bool(masks[0][:, 3].any())  # the column is pruned
    if scales.scales[1] < scales.scales[0]:  # the scaler skipped step 2 (in place it sees the pruned infs)
        assert torch.equal(masks[1], masks[0])
        assert any("the masks did not move at step 2" in str(w.message) for w in caught)
    else:  # reparametrized: the masked forward gives the pruned entries no float16 gradient, nothing overflowed
        assert masking == "reparametrize" and not torch.equal(masks[1], masks[0])  # an update like any other
