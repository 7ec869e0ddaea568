"""``PruningCallback``'s importance criteria, N:M masks, calibration and adopted zeros, in real tiny fits on the CPU.

The reference values are computed here by hand from a second, unpruned fit of the same deterministic run (``TinyNet``
on fixed batches without shuffling): its layers' inputs and gradients up to an event are those the pruning fit saw.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightprune import prune
from lightprune.callback import PruningCallback
from lightprune.callback.activations import ActivationStats
from lightprune.schedules import Constant, Cubic, Linear, Points
from tiny_lightning import TinyNet, folded, quiet_trainer

pytestmark = [
    pytest.mark.usefixtures("one_thread_for_module"),
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*"),
    pytest.mark.filterwarnings("ignore:.*exists and is not empty.*"),
    pytest.mark.filterwarnings("ignore:.*callbacks used to create the checkpoint.*"),
    pytest.mark.filterwarnings("ignore:.*must be `None` or an integer within the vocabulary.*"),
]

LAYERS = ("net.0", "net.2", "net.4")


def fit(callbacks: list[Callback], model: L.LightningModule | None = None, **kwargs: Any) -> L.LightningModule:
    model = TinyNet() if model is None else model
    ckpt_path = kwargs.pop("ckpt_path", None)
    quiet_trainer(callbacks, **{"max_epochs": 1, "num_sanity_val_steps": 0, **kwargs}).fit(model, ckpt_path=ckpt_path)
    return model


def masks(model: nn.Module) -> dict[str, Tensor]:
    return {key: value.clone() for key, value in model.state_dict().items() if key.endswith("_mask")}


def prune_lowest_per_row(scores: Tensor, amount: int) -> Tensor:
    """Keep-mask pruning the ``amount`` lowest scores of every row (ties: lower index first)."""
    keep = torch.ones_like(scores, dtype=torch.bool)
    for row, values in enumerate(scores.tolist()):
        for column in sorted(range(len(values)), key=lambda j: (values[j], j))[:amount]:
            keep[row, column] = False
    return keep


class Spy(Callback):
    """Records, in an unpruned fit, each layer's inputs in chosen batches and ``-W * grad`` at every optimizer step."""

    def __init__(self, batches: set[int]) -> None:
        self.batches = batches
        self.inputs: dict[str, list[Tensor]] = {layer: [] for layer in LAYERS}
        self.movement: dict[str, Tensor] = {}
        self._handles: list[Any] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx in self.batches:
            for layer in LAYERS:
                module = pl_module.get_submodule(layer)
                hook = module.register_forward_pre_hook(lambda m, args, layer=layer: self.inputs[layer].append(args[0]))
                self._handles.append(hook)

    def on_train_batch_end(self, *args: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
        for layer in LAYERS:
            weight = pl_module.get_submodule(layer).weight
            step = -(weight.detach() * weight.grad)
            self.movement[layer] = self.movement.get(layer, torch.zeros_like(weight)) + step


# ----------------------------------------------------------------------------------------------------------------------
# Activation (Wanda), per row
# ----------------------------------------------------------------------------------------------------------------------


def test_wanda_per_row_masks_match_the_formula() -> None:
    # one event at step 3; window 2: the batches run at steps 1 and 2 (batch indices 1, 2) are collected
    callback = PruningCallback(
        Constant(0.5, at=3), importance="activation", activation_window=2, scope="row", make_permanent=False
    )
    pruned = fit([callback], max_steps=5)
    spy = Spy({1, 2})
    reference = fit([spy], max_steps=3)  # the weights at the event, the inputs the window saw
    for layer in LAYERS:
        weight = reference.get_submodule(layer).weight.detach()
        inputs = torch.cat(spy.inputs[layer])
        norms = (inputs * inputs).sum(dim=0).sqrt()
        expected = prune_lowest_per_row(weight.abs() * norms, round(0.5 * weight.shape[1]))
        assert torch.equal(pruned.get_submodule(layer).weight_mask, expected), layer
    assert callback.state_dict()["importance"]["activation"] == {"totals": {}, "calls": {}}  # reset after the event


def test_calibration_batches_without_an_event_at_the_start_are_not_run_and_do_not_join_the_window() -> None:
    """Before, the calibration batches ran and their sums joined the first event's window: other masks."""
    kwargs = {"importance": "activation", "activation_window": 2, "scope": "row", "make_permanent": False}
    with pytest.warns(UserWarning, match=r"calibration_batches=3 gives statistics .* prunes nothing at step 0"):
        calibrated = fit([PruningCallback(Constant(0.5, at=3), calibration_batches=3, **kwargs)], max_steps=5)
    plain = fit([PruningCallback(Constant(0.5, at=3), **kwargs)], max_steps=5)
    assert masks(calibrated).keys() == {f"{layer}.weight_mask" for layer in LAYERS}
    assert all(torch.equal(mask, masks(plain)[key]) for key, mask in masks(calibrated).items())


@pytest.mark.parametrize(
    ("kwargs", "reader"),
    [
        ({"importance": "activation"}, "importance='activation'"),
        ({"importance": "obs"}, "importance='obs'"),
        ({"scope": "owl", "importance": "activation"}, "importance='activation'"),
    ],
)
def test_input_statistics_of_a_projection_its_parent_calls_are_refused_at_setup(kwargs: dict, reader: str) -> None:
    """MultiheadAttention computes with out_proj.weight without calling out_proj: before, the first event failed
    after the training before it, asking for calibration batches that were set."""
    model = nn.Sequential(nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True), nn.Linear(8, 2))
    callback = PruningCallback(Constant(0.5, at=2), calibration_batches=0, **kwargs)
    with pytest.raises(ValueError, match=rf"{re.escape(reader)} records .* \['0\.self_attn\.out_proj\.weight'\]"):
        callback.check_model(model)
    PruningCallback(Constant(0.5, at=2), exclude=r".*out_proj\.weight", **kwargs).check_model(model)
    PruningCallback(Constant(0.5, at=2)).check_model(model)  # magnitude reads no input


class TwoLoaders(TinyNet):
    """Trained on a dict of two loaders: every batch is ``{"a": batch, "b": batch}``."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return sum(super(TwoLoaders, self).training_step(part, batch_idx) for part in batch.values())

    def train_dataloader(self) -> Any:
        return {"a": super().train_dataloader(), "b": super().train_dataloader()}


class Manual(TinyNet):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(super().training_step(batch, batch_idx))
        optimizer.step()


class FromIterator(TinyNet):
    def training_step(self, dataloader_iter: Any) -> Tensor:
        batch, _, _ = next(dataloader_iter)
        return super().training_step(batch, 0)


@pytest.mark.parametrize(
    ("model", "options"),
    [(TinyNet, {"precision": "bf16-true"}), (TinyNet, {"precision": "64-true"}), (TwoLoaders, {})],
)
@pytest.mark.parametrize("importance", ["activation", "obs"])
def test_calibration_batches_are_the_batches_training_step_gets(model: type, options: dict, importance: str) -> None:
    """Converted to the precision's dtype, combined from several loaders (before: a dtype error, or the dict's keys
    handed to training_step as batches)."""
    callback = PruningCallback(0.5, importance=importance, scope="row", calibration_batches=2, make_permanent=False)
    pruned = fit([callback], model(), max_steps=2, **options)
    for layer in LAYERS:
        mask = pruned.get_submodule(layer).weight_mask
        assert (~mask).sum(dim=1).tolist() == [mask.shape[1] // 2] * mask.shape[0], layer


@pytest.mark.parametrize(("model", "reason"), [(Manual, "a manual-optimization"), (FromIterator, "dataloader_iter")])
def test_a_training_step_calibration_cannot_run_is_refused_before_training(model: type, reason: str) -> None:
    module = model()
    before = {key: value.clone() for key, value in module.state_dict().items()}
    with pytest.raises(ValueError, match=rf"calibration_batches .*{reason}"):
        fit([PruningCallback(0.5, importance="activation", calibration_batches=2)], module, max_steps=2)
    assert all(torch.equal(value, before[key]) for key, value in module.state_dict().items())
    fit([PruningCallback(Constant(0.5, at=1), importance="activation")], model(), max_steps=2)  # a window serves


@pytest.mark.parametrize("importance", ["activation", "obs"])
def test_a_one_shot_event_from_a_dense_checkpoint_is_calibrated(tmp_path: Path, importance: str) -> None:
    """A checkpoint without the callback's state (dense training) starts its schedule: the event is due and the
    calibration batches give it statistics (before, none ran, and the event failed asking for them)."""
    dense = TinyNet()
    trainer = quiet_trainer([], max_steps=3, num_sanity_val_steps=0)
    trainer.fit(dense)
    trainer.save_checkpoint(tmp_path / "dense.ckpt")
    callback = PruningCallback(0.5, importance=importance, scope="row", calibration_batches=2, make_permanent=False)
    model = fit([callback], TinyNet(), max_epochs=2, max_steps=5, ckpt_path=tmp_path / "dense.ckpt")
    for layer in LAYERS:
        mask = model.get_submodule(layer).weight_mask
        assert (~mask).sum(dim=1).tolist() == [mask.shape[1] // 2] * mask.shape[0], layer
    with pytest.raises(ValueError, match=rf"importance='{importance}' needs input statistics, .* at step 3, before"):
        fit([PruningCallback(0.5, importance=importance)], TinyNet(), max_epochs=2, ckpt_path=tmp_path / "dense.ckpt")


def test_activation_hooks_exist_only_inside_the_window() -> None:
    seen: list[tuple[int, int]] = []

    class Count(Callback):
        def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
            hooks = len(pl_module.net[0]._forward_pre_hooks)
            seen.append((trainer.global_step, hooks))

    class During(Callback):
        def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
            seen.append((-trainer.global_step - 1, len(pl_module.net[0]._forward_pre_hooks)))

    callback = PruningCallback(Constant(0.5, at=4), importance="activation", activation_window=2)
    fit([callback, During(), Count()], max_steps=6)
    starts = {-key - 1: hooks for key, hooks in seen if key < 0}
    assert starts == {0: 0, 1: 0, 2: 1, 3: 1, 4: 1, 5: 1}  # collecting at steps 2, 3; after the event: pruning hook
    ends = {key: hooks for key, hooks in seen if key >= 0}
    assert ends[1] == ends[2] == ends[3] == 0  # the collecting hook is gone at every batch end


def test_activation_scores_of_conv_and_transposed_conv1d_layers() -> None:
    transformers = pytest.importorskip("transformers")
    conv = nn.Conv2d(3, 2, 2)
    gpt_conv = transformers.pytorch_utils.Conv1D(5, 3)  # weight (in=3, out=5)
    stats = ActivationStats([("conv.weight", conv, "weight"), ("gpt.weight", gpt_conv, "weight")])
    x, tokens = torch.randn(2, 3, 4, 4), torch.randn(2, 7, 3)
    stats.start()
    conv(x)
    gpt_conv(tokens)
    stats.finish_batch(lambda flat: flat)
    scores = stats.scores()
    channel_norms = x.pow(2).sum(dim=(0, 2, 3)).sqrt()
    torch.testing.assert_close(scores["conv.weight"], conv.weight.detach().abs() * channel_norms.view(1, 3, 1, 1))
    feature_norms = tokens.pow(2).sum(dim=(0, 1)).sqrt()
    torch.testing.assert_close(scores["gpt.weight"], gpt_conv.weight.detach().abs() * feature_norms.view(3, 1))


# ----------------------------------------------------------------------------------------------------------------------
# Movement
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("masking", ["reparametrize", "inplace"])
def test_movement_masks_rank_the_signed_sum_of_minus_w_grad(masking: str) -> None:
    callback = PruningCallback(
        Constant(0.5, at=4), importance="movement", scope="layerwise", make_permanent=False, masking=masking
    )
    pruned = fit([callback], max_steps=5)
    spy = Spy(set())
    fit([spy], max_steps=4)
    pruned_masks = {layer: pruned.get_submodule(layer).weight != 0 for layer in LAYERS}
    if masking == "reparametrize":
        pruned_masks = {layer: pruned.get_submodule(layer).weight_mask for layer in LAYERS}
    for layer in LAYERS:
        scores = spy.movement[layer]
        count = round(0.5 * scores.numel())
        expected = prune_lowest_per_row(scores.reshape(1, -1), count).view(scores.shape)
        assert torch.equal(pruned_masks[layer], expected), layer
        by_magnitude = prune_lowest_per_row(scores.abs().reshape(1, -1), count).view(scores.shape)
        assert not torch.equal(expected, by_magnitude)  # the sign matters: it is not an L1 ranking


@pytest.mark.parametrize("scope", ["global", "row"])
def test_movement_works_with_every_scope(scope: str) -> None:
    callback = PruningCallback(Linear(final=0.6, start=2, end=6, frequency=2), importance="movement", scope=scope)
    model = fit([callback], max_steps=7)
    weights = [model.get_submodule(layer).weight for layer in LAYERS]
    total = sum(w.numel() for w in weights)
    if scope == "global":
        assert sum(int((w == 0).sum()) for w in weights) == round(0.6 * total)
    else:
        for weight in weights:
            assert (weight == 0).sum(dim=1).tolist() == [round(0.6 * weight.shape[1])] * weight.shape[0]


class MovementSums(Callback):
    """After each training batch (placed after the PruningCallback): how many movement sums the callback holds."""

    def __init__(self, callback: PruningCallback) -> None:
        self.callback = callback
        self.held: list[int] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        sums = self.callback.state_dict().get("importance", {}).get("movement", {}).get("totals", {})
        self.held.append(len(sums))


def test_movement_stops_summing_after_the_last_event_and_its_sums_follow_the_model() -> None:
    """The sums went on growing after the schedule's last event (a weight-sized pass every step that no event would
    read) and stayed on the training device after fit, where Lightning moves the model back to the CPU."""
    callback = PruningCallback(Linear(final=0.5, start=2, end=4, frequency=2), importance="movement")
    sums = MovementSums(callback)
    fit([callback, sums], max_steps=8)
    assert sums.held[:3] == [3, 3, 3] and sums.held[4:] == [0, 0, 0, 0]  # events at steps 2 and 4


class ToMetaAtTeardown(Callback):
    """Moves the model at teardown, before the PruningCallback's (as Lightning's strategy moves it to the CPU)."""

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        pl_module.to("meta")


def test_movement_sums_of_an_unfinished_schedule_follow_the_model_at_fit_end() -> None:
    """A schedule cut short keeps its sums (a checkpoint written after fit resumes from them); they stayed on the
    training device (a GPU) after fit while the model and the in-place masks went back to the CPU."""
    callback = PruningCallback(Linear(final=0.5, start=2, end=40, frequency=2), importance="movement")
    fit([ToMetaAtTeardown(), callback], max_steps=5)
    totals = callback.state_dict()["importance"]["movement"]["totals"]
    assert totals and {total.device.type for total in totals.values()} == {"meta"}


class FreezeAtFitStart(Callback):
    """Freezes ``net.2`` when fit starts, as ``BackboneFinetuning`` freezes a backbone."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pl_module.net[2].weight.requires_grad_(False)


@pytest.mark.parametrize("when", ["at setup", "when training starts"])
def test_movement_refuses_frozen_weights_by_name_and_changes_nothing(when: str) -> None:
    model = TinyNet()
    callbacks: list[Callback] = [PruningCallback(Cubic(final=0.5, start=2, end=6, frequency=2), importance="movement")]
    if when == "at setup":
        model.net[2].weight.requires_grad_(False)
    else:  # after the pruning callback, whose selection is made when fit starts
        callbacks.append(FreezeAtFitStart())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(
        ValueError, match=rf"movement.*frozen \(requires_grad=False {when}\) tensors \['net.2.weight'\]"
    ):
        fit(callbacks, model, max_steps=8)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("importance", ["movement", "activation"])
def test_a_ramp_from_step_0_at_level_0_needs_no_statistics_then(importance: str) -> None:
    """A ramp's first event at step 0 prunes nothing: accepted without calibration, and the masks are those of the
    same levels starting at the ramp's next event (the statistics are not reset by the empty event)."""
    from_zero = PruningCallback(Linear(final=0.6, start=0, end=6, frequency=2), importance=importance)
    later = PruningCallback(Points([(t, from_zero.schedule(t)) for t in (2, 4, 6)]), importance=importance)
    assert [from_zero.schedule(t) for t in range(8)] == [later.schedule(t) for t in range(8)]
    models = [fit([callback], max_steps=7) for callback in (from_zero, later)]
    for layer in LAYERS:
        assert torch.equal(models[0].get_submodule(layer).weight, models[1].get_submodule(layer).weight), layer
    assert sum(int((models[0].get_submodule(layer).weight == 0).sum()) for layer in LAYERS) > 0


# ----------------------------------------------------------------------------------------------------------------------
# N:M, callables, magnitude unchanged
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "importance", ["magnitude", "activation", "movement", lambda q, m, n, w: torch.arange(w.numel()).view(w.shape)]
)
def test_semi_structured_masks_under_the_callback(importance: Any) -> None:
    callback = PruningCallback(
        Constant(0.5, at=2), method="semi_structured", importance=importance, make_permanent=False
    )
    model = fit([callback], max_steps=4)
    for layer in LAYERS:
        mask = model.get_submodule(layer).weight_mask
        assert mask.view(mask.shape[0], -1, 4).sum(dim=-1).eq(2).all(), layer
    if callable(importance):  # increasing scores: the last two of every group stay
        assert model.net[4].weight_mask.view(4, 3, 4)[..., 2:].all()


def test_callable_scores_rank_like_importance_scores() -> None:
    def reversed_index(qualified: str, module: nn.Module, name: str, weight: Tensor) -> Tensor:
        return torch.arange(weight.numel(), 0, -1, dtype=torch.float32).view(weight.shape)

    callback = PruningCallback(0.25, importance=reversed_index, scope="layerwise", make_permanent=False)
    model = fit([callback], max_steps=1)
    mask = model.net[0].weight_mask.flatten()
    assert not mask[-32:].any() and mask[:-32].all()  # the 25% with the lowest scores: the last entries


def test_callable_scores_with_nan_are_refused_naming_the_tensor() -> None:
    """NaN ranks above every number: those entries would never be pruned, and the rest pruned in their place."""

    def nan_rows(qualified: str, module: nn.Module, name: str, weight: Tensor) -> Tensor:
        scores = weight.abs().clone()
        if qualified == "net.2.weight":
            scores[:6] = float("nan")
        return scores

    with pytest.raises(ValueError, match=r"returned 96 NaN score\(s\) of 192 for net\.2\.weight"):
        fit([PruningCallback(0.5, importance=nan_rows, scope="layerwise")], max_steps=1)


@pytest.mark.parametrize("scope", ["global", "layerwise", "row"])
def test_callable_complex_scores_rank_by_magnitude_in_every_scope(scope: str) -> None:
    def complex_scores(qualified: str, module: nn.Module, name: str, weight: Tensor) -> Tensor:
        return torch.polar(weight.abs(), torch.ones_like(weight))  # |score| = |w|: magnitude pruning

    by_magnitude = fit([PruningCallback(0.5, scope=scope, make_permanent=False)], max_steps=1)
    by_complex = fit([PruningCallback(0.5, importance=complex_scores, scope=scope, make_permanent=False)], max_steps=1)
    for a, b in zip(masks(by_magnitude).values(), masks(by_complex).values(), strict=True):
        assert torch.equal(a, b)


def test_callable_scores_on_the_meta_device_are_refused_naming_the_tensor() -> None:
    def meta(qualified: str, module: nn.Module, name: str, weight: Tensor) -> Tensor:
        return torch.empty(weight.shape, device="meta")

    with pytest.raises(ValueError, match=r"returned a meta tensor for net\.0\.weight"):
        fit([PruningCallback(0.5, importance=meta)], max_steps=1)


@pytest.mark.parametrize(("importance", "says"), [("magnitude", ""), ("movement", " by movement")])
def test_the_summary_table_names_the_importance(importance: str, says: str) -> None:
    callback = PruningCallback(Constant(0.5, at=2), importance=importance, make_permanent=False)
    fit([callback], max_steps=3)
    assert callback.summary_table().splitlines()[0] == f"PruningCallback: pruned global, L1Unstructured{says}"


def test_magnitude_importance_is_todays_behaviour() -> None:
    schedule = Cubic(final=0.7, start=1, end=7, frequency=2)
    default = fit([PruningCallback(schedule, make_permanent=False)], max_steps=8)
    explicit = PruningCallback(schedule, importance="magnitude", make_permanent=False)
    again = fit([explicit], max_steps=8)
    assert all(torch.equal(a, b) for a, b in zip(masks(default).values(), masks(again).values(), strict=True))
    assert "importance" not in explicit.state_dict()


# ----------------------------------------------------------------------------------------------------------------------
# Resume, adopted zeros
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("importance", ["activation", "movement", "obs"])
def test_resume_mid_window_is_bit_exact(tmp_path: Path, importance: str) -> None:
    # events 12, 20, 28; window 6: the epoch-end checkpoint at step 16 falls inside a window, statistics in state
    def run(ckpt_path: Path | None) -> L.LightningModule:
        callback = PruningCallback(
            Linear(final=0.6, start=12, end=28, frequency=8),
            importance=importance,
            activation_window=1 if importance == "movement" else 6,  # (movement sums every step: no window)
            scope="row",
            make_permanent=False,
        )
        checkpoints = ModelCheckpoint(tmp_path / "ckpt", every_n_epochs=1, save_top_k=-1)
        return fit(
            [callback, checkpoints],
            ckpt_path=ckpt_path,
            max_epochs=4,
            enable_checkpointing=True,
            default_root_dir=tmp_path,
        )

    uninterrupted = run(None)
    middle = tmp_path / "ckpt" / "epoch=1-step=16.ckpt"
    saved = torch.load(middle, weights_only=False)
    (state,) = [v for k, v in saved["callbacks"].items() if k.startswith("PruningCallback")]
    assert state["importance"][importance]["totals"], "the checkpoint must hold statistics collected so far"
    resumed = run(middle)
    for key, value in masks(uninterrupted).items():
        assert torch.equal(masks(resumed)[key], value), key
    expected = folded(uninterrupted.state_dict())
    for key, value in folded(resumed.state_dict()).items():
        assert torch.equal(value, expected[key]), key


def test_adopt_zeros_keeps_given_zeros_through_training() -> None:
    def zeroed() -> TinyNet:
        model = TinyNet()
        with torch.no_grad():
            model.net[0].weight.view(-1)[:40] = 0
        return model

    kept = fit([PruningCallback(0.0, adopt_zeros=True)], zeroed(), max_steps=8)
    assert not prune.is_pruned(kept)  # made permanent at the end
    assert kept.net[0].weight.view(-1)[:40].eq(0).all()
    lost = fit([PruningCallback(0.0)], zeroed(), max_steps=8)
    assert lost.net[0].weight.view(-1)[:40].ne(0).any()  # without adopting, training moves them

    on_top = fit([PruningCallback(Constant(0.5, at=2), adopt_zeros=True, scope="row")], zeroed(), max_steps=4)
    weight = on_top.net[0].weight
    assert weight.view(-1)[:40].eq(0).all()
    assert (weight == 0).sum(dim=1).tolist() == [8] * 5 + [4] * 11  # rows 0-4 were all zeros; the rest to 50%


# ----------------------------------------------------------------------------------------------------------------------
# A tiny BERT: calibration, then a gradual Wanda schedule
# ----------------------------------------------------------------------------------------------------------------------


class TinyBert(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        import transformers

        torch.manual_seed(0)
        config = transformers.BertConfig(
            vocab_size=64,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=12,
            num_labels=2,
        )
        self.model = transformers.BertForSequenceClassification(config)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids[:, 0] % 2).loss
        self.log("loss", loss, on_step=True)  # skipped during calibration
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        ids = torch.randint(0, 64, (48, 12), generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(ids), batch_size=8, shuffle=True)


def test_tiny_bert_calibrated_one_shot_then_gradual_wanda() -> None:
    pytest.importorskip("transformers")
    encoder = r"model\.bert\.encoder\..*\.weight"
    callback = PruningCallback(
        Cubic(initial=0.3, final=0.6, start=0, end=10, frequency=5),
        importance="activation",
        calibration_batches=3,
        scope="row",
        include=encoder,
        make_permanent=False,
    )
    model = TinyBert()
    fit([callback], model, max_epochs=2)  # 12 steps: events at 0 (on the calibration batches), 5 and 10
    assert callback.selection and all(".encoder." in name for name in callback.selection)
    for name in callback.selection:
        mask = model.get_submodule(name.rsplit(".", 1)[0]).weight_mask
        assert (~mask).sum(dim=1).tolist() == [round(0.6 * mask.shape[1])] * mask.shape[0], name


# ----------------------------------------------------------------------------------------------------------------------
# Refusals
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"importance": "gradient"}, r"importance='gradient' is not supported"),
        ({"importance": "activation", "activation_window": 0}, r"activation_window=0 must be an int >= 1"),
        ({"importance": "activation", "calibration_batches": -1}, r"calibration_batches=-1 must be an int >= 0"),
        (
            {"importance": "movement", "calibration_batches": 2},
            r"calibration_batches=2: .*only importance=activation or obs uses \(importance=movement\)",
        ),
        (
            {"importance": "activation", "method": "random_unstructured"},
            r"importance='activation': random_unstructured draws at random and ignores scores",
        ),
        ({"importance": "movement", "method": "ln_structured"}, r"importance='movement': .*ln_structured cannot"),
        ({"scope": "row", "method": "ln_structured"}, r"scope='row': .*not ln_structured"),
        (
            {"method": "semi_structured", "scope": "global"},
            r"scope='global': semi_structured ranks its N:M groups within each layer",
        ),
        ({"method": "semi_structured", "schedule": Cubic(final=0.5, end=10)}, r"schedule=Cubic\(.*1 - n/m = 0\.5 "),
        ({"method": "semi_structured", "method_kwargs": {"n": 3, "m": 8}}, r"schedule=Constant\(.*n=3, m=8 .* 0\.625 "),
        ({"method": "semi_structured", "method_kwargs": {"n": 4, "m": 4}}, r"n=4 must be smaller than m=4"),
    ],
)
def test_configuration_mistakes_raise_at_construction(kwargs: dict[str, Any], message: str) -> None:
    schedule = kwargs.pop("schedule", 0.5)
    with pytest.raises(ValueError, match=message):
        PruningCallback(schedule, **kwargs)


def test_a_flag_of_another_type_is_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"adopt_zeros=1 must be a bool"):
        PruningCallback(0.5, adopt_zeros=1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"importance": "activation", "module_types": [nn.Linear, nn.Embedding], "schedule": Constant(0.5, at=2)},
            r"importance='activation' needs input features: emb\.weight of Embedding",
        ),
        ({"importance": "movement", "schedule": 0.5}, r"movement.*has one at step 0"),
        ({"importance": "activation", "schedule": 0.5}, r"calibration_batches"),
        ({"method": "semi_structured", "method_kwargs": {"n": 1, "m": 3}, "schedule": 2 / 3}, r"m=3 .* net\.0\.weight"),
        (
            {"importance": lambda q, m, n, w: w[0], "schedule": Constant(0.5, at=1)},
            r"returned \(8,\) for net\.0\.weight",
        ),
    ],
)
def test_mistakes_found_with_the_model_raise_when_fit_starts(kwargs: dict[str, Any], message: str) -> None:
    class WithEmbedding(TinyNet):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(4, 8)

    schedule = kwargs.pop("schedule")
    with pytest.raises(ValueError, match=message):
        fit([PruningCallback(schedule, **kwargs)], WithEmbedding(), max_steps=2)


# DDP (two processes, different data, identical masks with activation and movement): tests/callback/test_callback_ddp.py


# ----------------------------------------------------------------------------------------------------------------------
# Grouped and transposed convolutions: each weight scaled by the norm of the input channel it multiplies
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "layer",
    [nn.Conv2d(4, 6, 3, groups=2), nn.Conv1d(6, 3, 2, groups=3), nn.ConvTranspose2d(4, 6, 3, groups=2)],
    ids=["conv2d groups=2", "conv1d depthwise-like groups=3", "conv-transpose2d groups=2"],
)
def test_grouped_and_transposed_convolutions_score_by_their_own_input_channel(layer: nn.Module) -> None:
    torch.manual_seed(0)
    spatial = (5, 5) if isinstance(layer, (nn.Conv2d, nn.ConvTranspose2d)) else (7,)
    x = torch.randn(3, layer.in_channels, *spatial)
    stats = ActivationStats([("conv.weight", layer, "weight")])
    stats.start()
    layer(x)
    stats.finish_batch(lambda flat: flat)
    scores = stats.scores()["conv.weight"]
    norms = x.double().pow(2).sum(dim=[0, *range(2, x.dim())]).sqrt()  # one per input channel
    weight = layer.weight.detach()
    expected = torch.empty_like(weight)
    transposed = isinstance(layer, nn.ConvTranspose2d)
    per_group = layer.in_channels // layer.groups
    for a in range(weight.shape[0]):
        for b in range(weight.shape[1]):
            # transposed: weight (in, out / groups, ...), dim 0 is the input channel; else weight
            # (out, in / groups, ...), row a belongs to group a // (out / groups)
            channel = a if transposed else (a // (layer.out_channels // layer.groups)) * per_group + b
            expected[a, b] = weight[a, b].abs() * norms[channel].float()
    torch.testing.assert_close(scores, expected)


class CheckpointedLlama(L.LightningModule):
    """A tiny Llama (from a config), with Hugging Face's gradient checkpointing on or off."""

    def __init__(self, checkpointing: bool, reentrant: bool) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers")
        config = transformers.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=64, max_position_embeddings=64, tie_word_embeddings=False, use_cache=False,
        )  # fmt: skip
        torch.manual_seed(0)
        self.model = transformers.LlamaForCausalLM(config)
        if checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("importance", ["activation", "obs"])
def test_gradient_checkpointing_changes_no_mask(reentrant: bool, importance: str) -> None:
    """Checkpointing recomputes each block's forward during backward: a memory technique, it must not count the
    block's inputs twice (a global ranking of the statistics would then favour the blocks over the head)."""
    ids = torch.randint(0, 64, (16, 12), generator=torch.Generator().manual_seed(0))
    masks = []
    for checkpointing in (False, True):
        callback = PruningCallback(Constant(0.5, at=3), importance=importance, make_permanent=False, summary=False)
        quiet_trainer([callback], max_steps=4).fit(
            CheckpointedLlama(checkpointing, reentrant), DataLoader(TensorDataset(ids), batch_size=4)
        )
        masks.append({q: callback._masked.mask(m, n).bool() for q, m, n in callback._masked.selection})
    assert masks[0].keys() == masks[1].keys()
    assert [q for q in masks[0] if not torch.equal(masks[0][q], masks[1][q])] == []


def test_integer_callable_scores_rank_channels_too() -> None:
    """Integer scores worked with every method but ln_structured, whose first event failed inside torch.norm
    ("linalg.vector_norm ... Long"), naming neither the function nor the tensor. Channels rank by their norms."""
    schedule = Constant(0.5, at=2)

    def as_integers(qualified: str, module: nn.Module, name: str, weight: Tensor) -> Tensor:
        return (weight.abs() * 1000).round().long()

    def as_floats(qualified: str, module: nn.Module, name: str, weight: Tensor) -> Tensor:
        return (weight.abs() * 1000).round()

    models = [fit([PruningCallback(schedule, method="ln_structured", importance=rank)], max_steps=4)
              for rank in (as_integers, as_floats)]  # fmt: skip
    for layer in LAYERS:
        kept = [model.get_submodule(layer).weight.detach().abs().sum(1) != 0 for model in models]
        assert torch.equal(kept[0], kept[1]) and int((~kept[0]).sum()) == round(0.5 * kept[0].numel()), layer
