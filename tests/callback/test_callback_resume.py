"""Resuming a pruned fit from each kind of checkpoint Lightning writes, bounded by ``max_steps`` or ``max_epochs``.

The resumed fit must end with the uninterrupted fit's masks and effective weights whenever Lightning replays the
same batches. Lightning does not in one case: a fit bounded by ``max_steps``, resumed from a checkpoint written at
an epoch's end (``ModelCheckpoint`` in ``on_train_epoch_end``), trains one extra batch past that epoch's end. The
callback cannot change Lightning's loop; it warns, naming the way out.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import Tensor

from lightprune import prune
from lightprune.callback import PruningCallback
from lightprune.schedules import Linear
from tiny_lightning import ResumableBatches, TinyNet, folded, loader, quiet_trainer, state

pytestmark = pytest.mark.usefixtures("one_thread_for_module")

BOUNDS = {"max_steps": {"max_steps": 16}, "max_epochs": {"max_epochs": 2}}  # both end at step 16 (8 steps an epoch)
CHECKPOINTS = {
    "mid-epoch, between events": "step/epoch=0-step=4.ckpt",
    "mid-epoch, at an event": "step/epoch=1-step=12.ckpt",
    "after an epoch's last batch": "step/epoch=0-step=8.ckpt",
    "at an epoch's end": "epoch/epoch=0-step=8.ckpt",
}
PAST_THE_END = "past the epoch's"


class Net(TinyNet):
    def train_dataloader(self) -> Any:
        return ResumableBatches(loader())  # so that mid-epoch checkpoints resume with the same batches


class Batches(Callback):
    """Records ``(global step, sum of the inputs)`` of every training batch: which data each step trained on."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, float]] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, i: int) -> None:
        self.seen.append((trainer.global_step, float(batch[0].sum())))


def fit(root: Path, bound: str, ckpt_path: Path | None = None) -> tuple[Net, list[tuple[int, float]], list[str]]:
    """A fit with events at steps 0, 3, 6, 9, 12; checkpoints every 4 steps (``step/``) and every epoch (``epoch/``)."""
    model, batches = Net(), Batches()
    callbacks = [
        PruningCallback(Linear(final=0.85, start=0, end=12, frequency=3), make_permanent=False, summary=False),
        ModelCheckpoint(root / "step", every_n_train_steps=4, save_top_k=-1),
        ModelCheckpoint(root / "epoch", every_n_epochs=1, save_top_k=-1),
        batches,
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = quiet_trainer(callbacks, enable_checkpointing=True, **BOUNDS[bound])
        trainer.fit(model, ckpt_path=ckpt_path)
    assert trainer.global_step == 16
    return model, batches.seen, [str(w.message) for w in caught if PAST_THE_END in str(w.message)]


def end_state(model: Net) -> dict[str, Tensor]:
    """The effective weights and the masks (``name_orig`` may differ where pruned: it never reaches the model)."""
    masks = {key: value for key, value in state(model).items() if key.endswith("_mask")}
    assert masks  # the fit pruned
    return {**folded(state(model)), **masks}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, Tensor], list]]:
    runs = {}
    for bound in BOUNDS:
        root = tmp_path_factory.mktemp(bound)
        model, seen, said = fit(root, bound)
        assert said == []
        runs[bound] = (root, end_state(model), seen)
    return runs


@pytest.mark.parametrize("checkpoint", list(CHECKPOINTS), ids=list(CHECKPOINTS))
@pytest.mark.parametrize("bound", list(BOUNDS))
def test_a_resumed_fit_is_exact_unless_lightning_trains_past_an_epochs_end_and_then_it_says_so(
    tmp_path: Path, uninterrupted: dict[str, Any], bound: str, checkpoint: str
) -> None:
    root, expected, seen_before = uninterrupted[bound]
    path = root / CHECKPOINTS[checkpoint]
    resumed, seen, said = fit(tmp_path, bound, ckpt_path=path)
    same_batches = seen == seen_before[len(seen_before) - len(seen) :]
    assert bool(said) != same_batches  # warned exactly when Lightning replays other batches
    if same_batches:
        got = end_state(resumed)
        assert got.keys() == expected.keys()
        assert all(torch.equal(got[key], expected[key]) for key in expected), "masks or weights differ"
    else:  # the one case Lightning gets wrong (2.6): an extra batch at the end of the checkpoint's epoch
        (message,) = said
        assert (bound, checkpoint) == ("max_steps", "at an epoch's end")
        assert message.startswith("PruningCallback: Lightning is training batch 8 of epoch 0, past the epoch's 8")
        assert "every_n_train_steps" in message and "max_epochs" in message


def _zeros(model: L.LightningModule) -> list[int]:
    return [int((layer.weight == 0).sum()) for layer in model.net if isinstance(layer, torch.nn.Linear)]


@pytest.mark.parametrize("masking", ["reparametrize", "inplace"])
def test_a_checkpoint_saved_after_fit_holds_the_masks_and_resumes_with_them(tmp_path: Path, masking: str) -> None:
    """With ``make_permanent=True`` the masks are gone when ``trainer.save_checkpoint`` (or ``save_last`` at the
    end of training) writes: the saved masks come from the weights' zeros, and a longer fit resumed from it keeps
    them, as an uninterrupted fit does."""
    schedule = Linear(final=0.6, start=0, end=12, frequency=4)
    whole = TinyNet()
    quiet_trainer([PruningCallback(schedule, masking=masking)], max_epochs=3).fit(whole, loader())
    first = TinyNet()
    trainer = quiet_trainer([PruningCallback(schedule, masking=masking)], max_epochs=2)
    trainer.fit(first, loader())
    trainer.save_checkpoint(tmp_path / "after_fit.ckpt")
    saved = torch.load(tmp_path / "after_fit.ckpt", weights_only=False)
    (state_of,) = [v for k, v in saved["callbacks"].items() if k.startswith("PruningCallback")]
    assert sum(int((~mask.bool()).sum()) for mask in state_of["masks"].values()) == sum(_zeros(first))
    resumed = TinyNet()
    again = quiet_trainer([PruningCallback(schedule, masking=masking)], max_epochs=3)
    again.fit(resumed, loader(), ckpt_path=tmp_path / "after_fit.ckpt")
    assert _zeros(resumed) == _zeros(whole)
    for a, b in zip(resumed.parameters(), whole.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("masking", "make_permanent"), [("reparametrize", True), ("inplace", True), ("reparametrize", False)]
)
def test_validate_with_a_checkpoint_after_fit_evaluates_that_checkpoint(
    tmp_path: Path, masking: str, make_permanent: bool
) -> None:
    """``fit``, then ``validate(ckpt_path=...)`` / ``test`` of an earlier checkpoint on the same Trainer: the
    checkpoint's weights as saved, not the fit's final masks, and the model stays plain for the next call; also when
    the fit left the model reparametrized (``make_permanent=False``) and the checkpoint is plain."""

    class Evaluated(TinyNet):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.log("val_loss", torch.nn.functional.cross_entropy(self(x), y))

        test_step = validation_step

    checkpoints = ModelCheckpoint(tmp_path, every_n_train_steps=4, save_top_k=-1)
    schedule = Linear(final=0.8, start=0, end=16, frequency=4)
    model = Evaluated()
    callbacks = [PruningCallback(schedule, masking=masking, make_permanent=make_permanent), checkpoints]
    trainer = quiet_trainer(callbacks, max_epochs=2, enable_checkpointing=True)
    trainer.fit(model, loader())
    assert prune.is_pruned(model) == (masking == "reparametrize" and not make_permanent)
    early = tmp_path / "epoch=0-step=4.ckpt"
    reference = quiet_trainer().validate(Evaluated.load_from_checkpoint(early), loader(), verbose=False)
    assert trainer.validate(model, loader(), ckpt_path=early, verbose=False) == reference
    assert sorted(model.state_dict()) == sorted(Evaluated().state_dict())  # plain keys: no mask put back
    assert trainer.test(model, loader(), ckpt_path=early, verbose=False)[0]["val_loss"] == reference[0]["val_loss"]


def test_a_failed_fit_resumes_from_its_exception_checkpoint_on_the_same_model(tmp_path: Path) -> None:
    """A fit that raised leaves the model reparametrized; resuming that very object from the plain checkpoint
    ``OnExceptionCheckpoint`` wrote (a notebook retry) ends as resuming a fresh model does."""
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    class FailAt(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            if trainer.global_step == 5:
                raise RuntimeError("failure at step 5")

    schedule = Linear(final=0.6, start=0, end=12, frequency=4)
    model = TinyNet()
    crashing = [PruningCallback(schedule), OnExceptionCheckpoint(tmp_path, filename="on_exception"), FailAt()]
    with pytest.raises(RuntimeError, match="failure at step 5"):
        quiet_trainer(crashing, max_epochs=3, enable_checkpointing=True).fit(model, loader())
    assert prune.is_pruned(model)
    fresh = TinyNet()
    for resumed in (model, fresh):
        trainer = quiet_trainer([PruningCallback(schedule)], max_epochs=3)
        trainer.fit(resumed, loader(), ckpt_path=tmp_path / "on_exception.ckpt")
    assert _zeros(model) == _zeros(fresh)
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)


def test_masks_read_from_zeros_cover_every_selected_name() -> None:
    """Not only ``weight``: an attention's ``in_proj_weight`` too, once the pruning is permanent."""
    from lightprune import prune
    from lightprune.callback.masked_selection import MaskedSelection

    attention = torch.nn.MultiheadAttention(8, 2)
    selection = [("attention.in_proj_weight", attention, "in_proj_weight")]
    masked = MaskedSelection(selection, [], [], prune.L1Unstructured, {}, "layerwise", torch.bool, 0)
    masked.prune_to(0.5, event=0)
    before = masked.masks()["attention.in_proj_weight"].clone()
    masked.make_permanent()
    assert torch.equal(masked.masks_or_zeros()["attention.in_proj_weight"], before)


@pytest.mark.parametrize("regrow", [None, "set"])
def test_a_fit_resumed_with_another_length_keeps_the_checkpoint_runs_fractions_and_says_so(
    tmp_path: Path, regrow: str | None
) -> None:
    """Fractions of the run are resolved against the run that wrote the checkpoint: a resumed fit of another length
    (here half as long) keeps its events at the same steps instead of re-spreading the schedule over the new length
    behind the restored clock, which left the model at 0.40 sparsity without a word."""
    schedule = Linear(final=0.8, start=0, end=0.5, frequency=0.125)  # 64 steps: events at 0, 8, 16, 24, 32

    def callbacks() -> list[Callback]:
        checkpoints = ModelCheckpoint(tmp_path, every_n_epochs=1, save_top_k=-1, filename="{epoch}")
        moves = {"regrow": regrow, "regrow_every": 4, "regrow_until": 0.75} if regrow else {}
        return [PruningCallback(schedule, summary=False, **moves), checkpoints]

    whole = Net()
    quiet_trainer(callbacks(), enable_checkpointing=True, max_epochs=8).fit(whole)
    saved = torch.load(tmp_path / "epoch=1.ckpt", weights_only=False)  # after step 16: sparsity 0.4
    (state_of,) = [v for k, v in saved["callbacks"].items() if k.startswith("PruningCallback")]
    assert state_of["run_lengths"] == {"step": 64}
    resumed = Net()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = quiet_trainer(callbacks(), enable_checkpointing=True, max_epochs=4)
        trainer.fit(resumed, ckpt_path=tmp_path / "epoch=1.ckpt")
    said = [str(w.message) for w in caught if "the run of the checkpoint" in str(w.message)]
    assert len(said) == 1 and "this fit lasts 32 optimizer steps, the run of the checkpoint 64" in said[0]
    assert trainer.global_step == 32
    if regrow is None:
        assert _zeros(resumed) == _zeros(whole) and sum(_zeros(whole)) == round(0.8 * 368)  # events 24 and 32 ran
    else:  # (the masks moved on past step 32 in the longer run; weights regrown but never stepped stay zero)
        assert sum(_zeros(resumed)) >= round(0.8 * 368)


@pytest.mark.parametrize(
    ("schedule", "warns"),
    [
        (Linear(final=0.6, start=0, end=24, frequency=4), True),  # a ramp under way at step 8: its events 0, 4, 8
        (Linear(final=0.6, start=8, end=24, frequency=4), False),  # a ramp that starts with this fit
        (0.5, False),  # a one-shot schedule: its one event, taken when this fit starts
    ],
    ids=["ramp under way", "ramp starting now", "one-shot"],
)
def test_a_dense_checkpoint_resumed_past_the_ramps_start_says_it_catches_up(
    tmp_path: Path, schedule: Any, warns: bool
) -> None:
    """Fine-tuning from a dense checkpoint (no state of the callback): the schedule counts Lightning's global_step,
    so a ramp that began before the checkpoint's step is taken up to it in one event: the callback says so."""
    dense = quiet_trainer(max_steps=8, enable_checkpointing=True, default_root_dir=tmp_path)
    dense.fit(TinyNet())
    (path,) = (tmp_path / "checkpoints").glob("*.ckpt")
    model = TinyNet()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_trainer([PruningCallback(schedule, summary=False)], max_steps=24).fit(model, ckpt_path=str(path))
    said = [str(w.message) for w in caught if "instead of ramping" in str(w.message)]
    if warns:
        assert len(said) == 1, said
        assert "starts at step 8" in said[0] and "prunes to 0.2 at once" in said[0], said
    else:
        assert not said, said
    pruned = sum(int((model.get_parameter(f"net.{i}.weight") == 0).sum()) for i in (0, 2, 4))
    assert pruned == round((schedule if isinstance(schedule, float) else 0.6) * (128 + 192 + 48))


def _checkpoint_after_fit(tmp_path: Path, callback: PruningCallback) -> Path:
    trainer = quiet_trainer([callback], max_epochs=2)
    trainer.fit(TinyNet(), loader())
    trainer.save_checkpoint(tmp_path / "after_fit.ckpt")
    return tmp_path / "after_fit.ckpt"


@pytest.mark.parametrize(
    ("changed", "named"),
    [
        ({"schedule": 0.8}, "schedule=Constant(sparsity=0.5, at=0) there, schedule=Constant(sparsity=0.8, at=0) here"),
        ({"schedule": Linear(final=0.5, start=0, end=12, frequency=4)}, "schedule=Constant"),
        ({"unit": "epoch"}, "unit='step' there, unit='epoch' here"),  # step 16 had been read as epoch 16
        ({"method": "ln_structured"}, "method='l1_unstructured' there, method='ln_structured' here"),
        ({"importance": "movement", "schedule": 0.5}, "importance='magnitude' there, importance='movement' here"),
        ({"rewind": "init"}, "rewind=None there, rewind=0 here"),  # rewound to the resume step's weights
        ({"masking": "inplace"}, "masking='reparametrize' there, masking='inplace' here"),
    ],
    ids=["one-shot target (had stayed at 0.5)", "schedule", "unit", "method", "importance", "rewind", "masking"],
)
def test_a_fit_resumed_with_other_options_is_refused_naming_them(
    tmp_path: Path, changed: dict[str, Any], named: str
) -> None:
    """The checkpoint's masks and last event belong to its configuration: resumed under another, the new one was
    ignored (a target 0.8 stayed at 0.5) or mixed with it (a cubic to 0.5 ended at 0.7), without a word."""
    path = _checkpoint_after_fit(tmp_path, PruningCallback(0.5, name="p"))
    options = {"name": "p", "schedule": 0.5, **changed}
    model = TinyNet()
    with pytest.raises(ValueError, match=r"resumes a checkpoint written with other options: .*" + re.escape(named)):
        quiet_trainer([PruningCallback(**options)], max_epochs=3).fit(model, loader(), ckpt_path=path)
    assert not prune.is_pruned(model)  # refused before the selection: nothing was reparametrized


def test_a_fit_resumed_with_another_selection_is_refused_naming_it(tmp_path: Path) -> None:
    path = _checkpoint_after_fit(tmp_path, PruningCallback(0.5, name="p", include=r"net\.[02]\.weight"))
    callback = PruningCallback(0.5, name="p", include=r"net\.[024]\.weight")
    with pytest.raises(ValueError, match=r"selection was other: it selects \['net\.4\.weight'\]"):
        quiet_trainer([callback], max_epochs=3).fit(TinyNet(), loader(), ckpt_path=path)


def test_a_checkpoint_of_a_differently_keyed_callback_is_refused(tmp_path: Path) -> None:
    """Unnamed, the state key follows scope, unit and patterns: under another key the checkpoint's masks were
    skipped and its pruned weights trained again (one layer from 0.953 to 0.828)."""
    path = _checkpoint_after_fit(tmp_path, PruningCallback(0.8))
    with pytest.raises(ValueError, match=r"the checkpoint holds the state of PruningCallback\{.*'scope': 'global'"):
        quiet_trainer([PruningCallback(0.8, scope="layerwise")], max_epochs=3).fit(TinyNet(), loader(), ckpt_path=path)


def test_the_same_options_resume_and_another_configuration_goes_on_from_the_weights(tmp_path: Path) -> None:
    """The way out the refusal names: a new fit from the checkpoint's weights with adopt_zeros=True."""
    path = _checkpoint_after_fit(tmp_path, PruningCallback(0.5, name="p"))
    resumed = TinyNet()
    quiet_trainer([PruningCallback(0.5, name="p")], max_epochs=3).fit(resumed, loader(), ckpt_path=path)
    assert sum(_zeros(resumed)) == round(0.5 * 368)
    again = TinyNet()
    again.load_state_dict(torch.load(path, weights_only=False)["state_dict"])
    pruned_before = [layer.weight == 0 for layer in again.net if isinstance(layer, torch.nn.Linear)]
    quiet_trainer([PruningCallback(0.8, adopt_zeros=True)], max_epochs=1).fit(again, loader())
    assert sum(_zeros(again)) == round(0.8 * 368)
    layers = [layer for layer in again.net if isinstance(layer, torch.nn.Linear)]
    assert all(bool((layer.weight[before] == 0).all()) for layer, before in zip(layers, pruned_before, strict=True))


class RenamedPruning(PruningCallback):
    """A subclass: its state key carries its own class name."""


def test_a_subclass_checkpoint_is_recognised_as_a_pruning_state(tmp_path: Path) -> None:
    path = _checkpoint_after_fit(tmp_path, RenamedPruning(0.8))
    with pytest.raises(ValueError, match=r"the checkpoint holds the state of RenamedPruning\{"):
        quiet_trainer([PruningCallback(0.8)], max_epochs=3).fit(TinyNet(), loader(), ckpt_path=path)


def test_a_changed_statistics_window_is_refused_on_resume(tmp_path: Path) -> None:
    options = {"name": "p", "importance": "activation", "calibration_batches": 2, "scope": "layerwise"}
    path = _checkpoint_after_fit(tmp_path, PruningCallback(0.5, **options, activation_window=2))
    with pytest.raises(ValueError, match=r"activation_window=2 there, activation_window=3 here"):
        callback = PruningCallback(0.5, **options, activation_window=3)
        quiet_trainer([callback], max_epochs=3).fit(TinyNet(), loader(), ckpt_path=path)
