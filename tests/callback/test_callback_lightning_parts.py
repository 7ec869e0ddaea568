"""``PruningCallback`` beside Lightning's other moving parts: another pruning callback, spawned workers."""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import (
    Callback,
    EMAWeightAveraging,
    ModelCheckpoint,
    ModelPruning,
    StochasticWeightAveraging,
    WeightAveraging,
)
from torch import Tensor, nn

from lightprune import prune
from lightprune.callback import PruningCallback
from lightprune.schedules import Cubic, Linear, Points
from tiny_lightning import WEIGHTS, DestroyGroupAtExit, N, TinyNet, loader, quiet_trainer

pytestmark = [
    pytest.mark.usefixtures("one_thread_for_module"),
    pytest.mark.filterwarnings("ignore:.*val_check_interval.*"),
]


def trainer(callbacks: list[Any], tmp_path: Path, **kwargs: Any) -> L.Trainer:
    return quiet_trainer(callbacks, **{"max_epochs": 2, "default_root_dir": tmp_path, **kwargs})


@pytest.mark.parametrize("order", ["PruningCallback first", "ModelPruning first"])
def test_lightnings_model_pruning_beside_is_refused_at_setup(tmp_path: Path, order: str) -> None:
    callbacks = [PruningCallback(0.5), ModelPruning("l1_unstructured", amount=0.3)]
    if order == "ModelPruning first":
        callbacks.reverse()
    model = TinyNet()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"cannot share a Trainer with lightning's ModelPruning"):
        trainer(callbacks, tmp_path).fit(model)
    assert {k: v for k, v in model.state_dict().items()}.keys() == before.keys()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(  # (spawn with make_permanent=False returns the model as fork does: through the same queue)
    ("strategy", "make_permanent"), [("ddp_spawn", True), ("ddp_fork", False)]
)
def test_spawned_workers_return_the_pruned_trained_model_to_the_main_process(
    tmp_path: Path, strategy: str, make_permanent: bool
) -> None:
    model = TinyNet()
    initial = {name: model.get_parameter(name).detach().clone() for name in WEIGHTS}
    callback = PruningCallback(Cubic(final=0.8, start=0, end=6, frequency=2), make_permanent=make_permanent)
    run = trainer([callback, DestroyGroupAtExit()], tmp_path, devices=2, strategy=strategy, max_epochs=2)
    run.fit(model)
    assert not prune.is_pruned(model)  # plain tensors in the main process, whatever make_permanent
    weights = {name: model.get_parameter(name).detach() for name in WEIGHTS}
    assert sum(int((w == 0).sum()) for w in weights.values()) == round(0.8 * N)
    for name, weight in weights.items():  # trained: the kept weights moved away from their initial values
        kept = weight != 0
        assert not torch.equal(weight[kept], initial[name][kept]), name


# ----------------------------------------------------------------------------------------------------------------------
# Weight averaging: EMA, any WeightAveraging subclass, SWA, in every order
# ----------------------------------------------------------------------------------------------------------------------


class BNNet(TinyNet):
    """``TinyNet`` with a BatchNorm (averaging callbacks pair parameters *and buffers* by position) and validation."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.net = nn.Sequential(
                nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 4)
            )
        self.validated: list[tuple[int, int, int]] = []  # (step, zeros of the weights used, zeros of the masks)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y))
        if batch_idx == 0:
            used = sum(int((self.get_submodule(n.rsplit(".", 1)[0]).weight == 0).sum()) for n in BN_WEIGHTS)
            masks = [self.get_submodule(n.rsplit(".", 1)[0])._buffers.get("weight_mask") for n in BN_WEIGHTS]
            pruned = sum(int((m == 0).sum()) for m in masks if m is not None)
            self.validated.append((self.trainer.global_step, used, pruned))


BN_WEIGHTS = ["net.0.weight", "net.3.weight", "net.5.weight"]
BN_N = 128 + 192 + 48


def bn_zeros(state_dict: dict[str, Tensor]) -> int:
    return sum(int((state_dict[name] == 0).sum()) for name in BN_WEIGHTS)


class EveryOtherStep(WeightAveraging):
    """A user's averaging callback: a plain running mean, updated every other optimizer step."""

    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        return step_idx is not None and step_idx % 2 == 1


def averaging(kind: str) -> Callback:
    if kind == "EMAWeightAveraging":
        return EMAWeightAveraging(decay=0.9)
    return EveryOtherStep(use_buffers=False)  # a running mean of boolean masks cannot be taken


def test_averaging_boolean_mask_buffers_is_refused_with_the_way_out(tmp_path: Path) -> None:
    callbacks = [PruningCallback(0.5), EveryOtherStep()]  # use_buffers=True: every buffer is averaged, masks too
    with pytest.raises(ValueError, match=r"EveryOtherStep averages buffers.*mask_dtype=None.*use_buffers=False"):
        trainer(callbacks, tmp_path, max_steps=4).fit(BNNet())
    trainer([PruningCallback(0.5, mask_dtype=None), EveryOtherStep()], tmp_path, max_steps=4).fit(BNNet())


def averaged_fit(tmp_path: Path, kind: str, pruning_first: bool, **kwargs: Any) -> tuple[BNNet, PruningCallback, Any]:
    model = BNNet()
    pruning = PruningCallback(Cubic(final=0.8, start=0, end=20, frequency=4), make_permanent=True)
    average = averaging(kind)
    checkpoints = ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=10, save_top_k=-1)
    callbacks = [pruning, average] if pruning_first else [average, pruning]
    run = trainer(
        [*callbacks, checkpoints], tmp_path, max_steps=30, max_epochs=-1, enable_checkpointing=True,
        val_check_interval=4, check_val_every_n_epoch=None, num_sanity_val_steps=0, **kwargs,
    )  # fmt: skip
    run.fit(model, val_dataloaders=loader(16))
    return model, pruning, average


@pytest.mark.parametrize("kind", ["EMAWeightAveraging", "WeightAveraging subclass"])
@pytest.mark.parametrize("pruning_first", [True, False], ids=["pruning first", "averaging first"])
def test_weight_averaging_keeps_the_masks_in_every_order(tmp_path: Path, kind: str, pruning_first: bool) -> None:
    model, _, average = averaged_fit(tmp_path, kind, pruning_first)
    # (c) the final model holds exactly the target's zeros, (d) and the average's values, not the last step's
    final = {name: model.get_parameter(name).detach() for name in BN_WEIGHTS}
    assert sum(int((w == 0).sum()) for w in final.values()) == round(0.8 * BN_N)
    averaged = average._average_model.module
    for name, weight in final.items():
        module = averaged.get_submodule(name.rsplit(".", 1)[0])
        masked_average = torch.where(module.weight_mask.bool(), module.weight_orig.detach(), 0)
        assert torch.equal(weight, masked_average), name  # the masked average was copied back
    # (a) validation ran on weights with at least the masks' zeros at every check after the first event
    assert model.validated and all(used >= pruned > 0 for _, used, pruned in model.validated)
    # (b) every checkpoint holds plain keys and the zeros of the event before it, current and averaged state alike
    schedule = Cubic(final=0.8, start=0, end=20, frequency=4)
    for step in (10, 20, 30):
        (path,) = (tmp_path / "ckpt").glob(f"*step={step}.ckpt")
        checkpoint = torch.load(path, weights_only=False)
        expected = round(schedule.target(step) * BN_N)
        assert not any(key.endswith(("_orig", "_mask")) for key in checkpoint["state_dict"])
        assert bn_zeros(checkpoint["state_dict"]) >= expected, step
        assert bn_zeros(checkpoint["current_model_state"]) == expected, step


def test_averaged_model_keeps_the_pruned_positions_exactly_zero(tmp_path: Path) -> None:
    _, _, average = averaged_fit(tmp_path, "EMAWeightAveraging", True)
    averaged = average._average_model
    state = averaged.state_dict()  # plain keys, the masked average
    masks = [averaged.module.get_submodule(name.rsplit(".", 1)[0]).weight_mask for name in BN_WEIGHTS]
    for name, mask in zip(BN_WEIGHTS, masks, strict=True):
        assert "module." + name + "_orig" not in state
        assert int((state["module." + name][~mask] != 0).sum()) == 0, name
    assert sum(int((~m).sum()) for m in masks) == round(0.8 * BN_N)


@pytest.mark.parametrize("batch_norm", [False, True], ids=["no batch norm", "batch norm (SWA's extra epoch)"])
@pytest.mark.parametrize("pruning_first", [True, False], ids=["pruning first", "averaging first"])
def test_stochastic_weight_averaging_keeps_the_masks(tmp_path: Path, pruning_first: bool, batch_norm: bool) -> None:
    model, names = (BNNet(), BN_WEIGHTS) if batch_norm else (TinyNet(), WEIGHTS)
    pruning = PruningCallback(Points([(1, 0.4), (2, 0.8)]), unit="epoch")
    swa = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=3)
    trainer([pruning, swa] if pruning_first else [swa, pruning], tmp_path, max_epochs=5).fit(model)
    weights = {name: model.get_parameter(name).detach() for name in names}
    assert sum(int((w == 0).sum()) for w in weights.values()) == round(0.8 * N)
    assert not prune.is_pruned(model)


class Moves(Callback):
    """Records the global step after every training batch that changed a mask."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.last: list[Tensor] | None = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        now = [b.clone() for name, b in pl_module.named_buffers() if name.endswith("_mask")]
        if (
            self.last is not None
            and len(now) == len(self.last)
            and any(not torch.equal(a, b) for a, b in zip(now, self.last, strict=True))
        ):
            self.steps.append(trainer.global_step)
        self.last = now


@pytest.mark.parametrize("batch_norm", [False, True], ids=["no batch norm", "batch norm (SWA's extra epoch)"])
def test_swas_batch_norm_epoch_is_not_part_of_the_run(tmp_path: Path, batch_norm: bool) -> None:
    """SWA adds an epoch without backward to a model with BatchNorm, to recompute its statistics on the averaged
    weights: fractions of the run are of the epochs that train, and neither events nor mask moves fall in it."""
    model = BNNet() if batch_norm else TinyNet()
    pruning = PruningCallback(Cubic(final=0.8, start=0, end=0.5, frequency=0.125), regrow="set", regrow_every=4,
                              regrow_until=1.0, make_permanent=False, summary=False)  # fmt: skip
    moves = Moves()
    callbacks = [StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=3), pruning, moves]
    trainer(callbacks, tmp_path, max_epochs=4, limit_val_batches=0).fit(model)  # 32 optimizer steps that train
    assert (
        pruning._timeline.resolved is not None and pruning._timeline.resolved.last_event == 16
    )  # half of 32, with or without it
    assert moves.steps and max(moves.steps) < 32


@pytest.mark.parametrize(("until", "warns"), [(1.0, True), (0.75, False)])
def test_moves_after_swas_last_average_are_said_to_be_lost(tmp_path: Path, until: float, warns: bool) -> None:
    """SWA averages when an epoch starts (the last time when epoch 3 of 4 starts) and copies the average back at the
    end: a weight regrown after its last average is zero in the model returned."""
    pruning = PruningCallback(0.8, regrow="set", regrow_every=4, regrow_until=until, summary=False)
    swa = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer([swa, pruning], tmp_path, max_epochs=4, limit_val_batches=0).fit(TinyNet())
    said = [str(w.message) for w in caught if "averages for the last time" in str(w.message)]
    assert len(said) == warns, said
    if warns:
        assert "when epoch 3 starts" in said[0] and "regrow_until <= 0.75" in said[0]


def test_resume_with_ema_is_as_exact_as_lightning_without_pruning(tmp_path: Path) -> None:
    def run(root: Path, prune_it: bool, ckpt_path: Path | None = None) -> dict[str, Tensor]:
        model = BNNet()
        callbacks: list[Any] = [EMAWeightAveraging(decay=0.9)]
        if prune_it:
            callbacks.append(PruningCallback(Cubic(final=0.8, start=0, end=20, frequency=4), make_permanent=True))
        checkpoints = ModelCheckpoint(root, every_n_epochs=1, save_top_k=-1)
        run = trainer([*callbacks, checkpoints], tmp_path, max_epochs=4, enable_checkpointing=True)
        run.fit(model, ckpt_path=ckpt_path)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    # from an epoch's end: Lightning restarts a plain DataLoader at its first batch, so mid-epoch resumes differ
    for prune_it in (False, True):
        name = "pruned" if prune_it else "control"
        uninterrupted = run(tmp_path / name / "a", prune_it)
        (middle,) = (tmp_path / name / "a").glob("*step=16.ckpt")
        resumed = run(tmp_path / name / "b", prune_it, ckpt_path=middle)
        same = all(torch.equal(resumed[key], value) for key, value in uninterrupted.items())
        assert same, f"{name}: resuming with EMA is not exact"
        if prune_it:
            assert bn_zeros(resumed) == round(0.8 * BN_N)


class ReplacesItsHead(TinyNet):
    """Replaces its last layer in one of its own hooks, which Lightning calls after the callbacks' (the selection)."""

    def __init__(self, hook: str) -> None:
        super().__init__()
        self.hook = hook

    def on_fit_start(self) -> None:
        if self.hook == "on_fit_start":
            self.net[4] = nn.Linear(12, 4)

    def on_train_start(self) -> None:
        if self.hook == "on_train_start":
            self.net[4] = nn.Linear(12, 4)


@pytest.mark.parametrize("hook", ["on_fit_start", "on_train_start"])
@pytest.mark.parametrize("start", [0, 3], ids=["event when training starts", "later event"])
def test_a_layer_replaced_after_the_selection_is_refused_at_the_next_event(
    tmp_path: Path, hook: str, start: int
) -> None:
    """It would stay dense while the masks, logs and summary counted it pruned: refused, naming it."""
    callback = PruningCallback(Cubic(final=0.5, start=start, end=8, frequency=1))
    with pytest.raises(RuntimeError, match=r"selected net\.4\.weight of a Linear that is no longer the model's net\.4"):
        trainer([callback], tmp_path).fit(ReplacesItsHead(hook))


class FailsAtStep(TinyNet):
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        if self.global_step == 5:
            raise RuntimeError("stop here")
        return super().training_step(batch, batch_idx)


def test_a_model_that_carries_masks_is_refused_unless_they_are_adopted(tmp_path: Path) -> None:
    """A fit starts its schedule from an unpruned model: masks already on a selected tensor (lightprune.prune, a fit
    left reparametrized) would have been taken over silently (a 0.5 target ending at 0.9). Refused, naming them;
    adopt_zeros=True starts from them, and the schedule's target counts them."""
    model = TinyNet()
    prune.l1_unstructured(model.net[2], "weight", amount=0.9)
    with pytest.raises(
        ValueError, match=r"net\.2\.weight \(90\.1% masked\) already carries a pruning mask .*adopt_zeros=True"
    ):
        trainer([PruningCallback(0.5)], tmp_path).fit(model)
    assert prune.is_pruned(model) and float((model.net[2].weight == 0).float().mean()) == pytest.approx(0.9, abs=0.01)

    callback = PruningCallback(0.5, adopt_zeros=True)
    trainer([callback], tmp_path).fit(model)
    zeros = sum(int((model.net[i].weight == 0).sum()) for i in (0, 2, 4))
    assert zeros == round(0.5 * N)  # the global target counts the 173 weights pruned before
    assert int((model.net[2].weight == 0).sum()) >= round(0.9 * 192)  # they stayed pruned


def test_a_refit_after_a_failed_fit_is_refused_naming_the_way_to_resume(tmp_path: Path) -> None:
    """A fit that raises leaves the model reparametrized (Lightning skips teardown): a plain refit of that model
    would start its ramp at the failed fit's sparsity. Refused, naming the way to resume."""
    model = FailsAtStep()
    schedule = Cubic(final=0.8, start=0, end=12, frequency=2)
    with pytest.raises(RuntimeError, match="stop here"):
        trainer([PruningCallback(schedule)], tmp_path).fit(model)
    assert prune.is_pruned(model)
    with pytest.raises(ValueError, match=r"already carry pruning masks .*ckpt_path="):
        trainer([PruningCallback(schedule)], tmp_path).fit(model)


def test_unit_methods_refuse_masks_already_there_unless_adopted(tmp_path: Path) -> None:
    model = TinyNet()
    prune.ln_structured(model.net[0], "weight", amount=0.5, n=2, dim=0)
    with pytest.raises(ValueError, match=r"net\.0\.weight \(50\.0% masked\) already carries a pruning mask"):
        trainer([PruningCallback(0.25, method="neurons")], tmp_path, max_epochs=1).fit(model)
    callback = PruningCallback(0.75, method="neurons", adopt_zeros=True)
    trainer([callback], tmp_path, max_epochs=1).fit(model)
    rows = (model.net[0].weight != 0).any(dim=1)
    assert int(rows.sum()) == 4  # 16 neurons, 0.75 of them pruned: the 8 pruned before among the 12


class TiedTwin(TinyNet):
    """``twin.weight`` is ``net.2.weight`` (as GPT-2's lm_head is its input embedding); the twin computes too."""

    def __init__(self) -> None:
        super().__init__()
        self.twin = nn.Linear(16, 12)
        self.twin.weight = self.net[2].weight

    def forward(self, x: Tensor) -> Tensor:
        hidden = self.net[1](self.net[0](x))
        return self.net[4](self.net[3](self.net[2](hidden) + self.twin(hidden)))


def test_a_mask_on_a_tied_owner_is_found_through_the_selected_name(tmp_path: Path) -> None:
    """net.2 pruned with the engine, the callback selecting its tied twin only: the mask was missed and changed
    silently (a 50% mask became the callback's 30%)."""
    model = TiedTwin()
    prune.l1_unstructured(model.net[2], "weight", amount=0.5)
    callback = PruningCallback(0.3, include=r"twin\.weight")
    with pytest.raises(ValueError, match=r"twin\.weight \(50\.0% masked, through net\.2\.weight\) already carries"):
        trainer([callback], tmp_path, max_epochs=1).fit(model)


@pytest.mark.parametrize(
    "options",
    [
        {"importance": "activation", "activation_window": 2},
        {"importance": "obs", "activation_window": 2},
        {"method": "neurons", "importance": "activation", "activation_window": 2},
        {"scope": "owl", "importance": "activation", "activation_window": 2},
        {"importance": "movement"},
    ],
    ids=["activation", "obs", "neurons", "owl", "movement"],
)
def test_the_callback_pickles_after_a_fit_that_recorded_statistics(tmp_path: Path, options: dict[str, Any]) -> None:
    """Users pickle callbacks (and Trainers holding them) after a fit: every recorded statistic must pickle, and the
    copy must still record (a later fit with it prunes as the original does)."""
    callback = PruningCallback(Linear(final=0.5, start=2, end=6, frequency=2), summary=False, **options)
    trainer([callback], tmp_path, max_epochs=1).fit(TinyNet(), loader())
    copy_ = pickle.loads(pickle.dumps(callback))

    models = []
    for each in (callback, copy_):
        model = TinyNet()
        trainer([each], tmp_path, max_epochs=1).fit(model, loader())
        models.append(model)
    for name in WEIGHTS:
        assert torch.equal(models[0].state_dict()[name], models[1].state_dict()[name]), name
