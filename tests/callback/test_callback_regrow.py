"""Dynamic sparse training in ``PruningCallback`` (``regrow="rigl" | "set"``): the dense gradients RigL ranks by,
masks that move only at update steps by the cosine-decayed share with every count exact, regrown weights and their
optimizer state at zero, in both masking modes and under gradient accumulation; resume exact; refusals named."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor, nn

from lightprune import prune
from lightprune.callback import PruningCallback
from lightprune.callback.inplace import InPlaceMasks
from lightprune.callback.masked_selection import MaskedSelection
from lightprune.callback.regrowth import DenseGradients
from tiny_lightning import N, TinyNet, folded, quiet_trainer, state

pytestmark = pytest.mark.usefixtures("one_thread_for_module")


@pytest.mark.parametrize("inplace", [False, True])
def test_dense_gradients_are_the_effective_weights_gradient_summed_over_micro_batches(inplace: bool) -> None:
    torch.manual_seed(0)
    layer = nn.Linear(5, 3)
    prune.l1_unstructured(layer, "weight", amount=9)
    effective = layer.weight.detach().clone()
    masks = InPlaceMasks()
    if inplace:
        masks.take([(layer, "weight")])
    grads = DenseGradients([("fc.weight", layer, "weight")])
    inputs = [torch.randn(4, 5), torch.randn(2, 5)]
    grads.start()
    for x in inputs:  # two micro-batches of one optimizer step
        (layer(x) ** 2).sum().backward()
    taken = grads.take(lambda t: t)["fc.weight"]

    leaf = effective.clone().requires_grad_(True)  # the reference: the gradient with respect to the used weight
    for x in inputs:
        (nn.functional.linear(x, leaf, layer.bias.detach()) ** 2).sum().backward()
    torch.testing.assert_close(taken, leaf.grad)
    assert bool((taken[effective == 0] != 0).any()), "pruned entries have their dense gradient"
    assert not grads.collecting
    (layer(inputs[0]) ** 2).sum().backward()  # no hook left: nothing is collected after the step
    assert grads.sums == {}
    masks.remove_hooks()


class Before(L.Callback):
    """Runs before the pruning callback: the weights right after each optimizer step, before masks move."""

    def __init__(self) -> None:
        self.weights: dict[int, dict[str, Tensor]] = {}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.weights.setdefault(trainer.global_step, folded(state(pl_module)))


class After(L.Callback):
    """Runs after the pruning callback: masks, effective weights and momentum after each step's updates."""

    def __init__(self, callback: PruningCallback) -> None:
        self.callback = callback
        self.masks: dict[int, dict[str, Tensor]] = {}
        self.weights: dict[int, dict[str, Tensor]] = {}
        self.momentum: dict[int, dict[str, Tensor]] = {}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if step in self.masks or step == 0:  # (accumulating: a micro-batch before the first optimizer step)
            return
        masked = self.callback._masked
        optimizer = trainer.optimizers[0]
        self.masks[step], self.weights[step], self.momentum[step] = {}, {}, {}
        for qualified, module, name in masked.selection:
            parameter = prune.original(module, name)
            self.masks[step][qualified] = masked.mask(module, name).bool().clone()
            # the effective weight now (a reparametrized module's attribute is recomputed at the next forward only)
            self.weights[step][qualified] = torch.where(self.masks[step][qualified], parameter.detach(), 0)
            self.momentum[step][qualified] = optimizer.state[parameter]["momentum_buffer"].clone()


@pytest.mark.parametrize(
    ("regrow", "masking", "accumulate"),
    [("rigl", "reparametrize", 1), ("rigl", "inplace", 2), ("set", "reparametrize", 2), ("set", "inplace", 1)],
)
def test_masks_move_at_update_steps_only_with_exact_counts(regrow: str, masking: str, accumulate: int) -> None:
    callback = PruningCallback(
        0.8,
        scope="erk",
        regrow=regrow,
        regrow_every=2,
        regrow_fraction=0.3,
        regrow_until=0.75,
        masking=masking,
        make_permanent=False,
    )
    before, after = Before(), After(callback)
    quiet_trainer([before, callback, after], max_epochs=2, accumulate_grad_batches=accumulate).fit(TinyNet())
    steps = 16 // accumulate
    until = round(0.75 * steps)
    updates = [t for t in range(1, steps + 1) if t % 2 == 0 and t < until]
    assert sorted(after.masks) == list(range(1, steps + 1))
    for t in range(2, steps + 1):
        old, new = after.masks[t - 1], after.masks[t]
        total = sum(int((~mask).sum()) for mask in new.values())
        assert total == round(0.8 * N)  # the total stays at the target
        for qualified in new:
            active = int(old[qualified].sum())
            assert int(new[qualified].sum()) == active  # every tensor's count is exact
            grown = new[qualified] & ~old[qualified]
            if t not in updates:
                assert not bool(grown.any()), (t, qualified)
                continue
            share = 0.3 / 2 * (1 + math.cos(math.pi * t / until))
            k = min(round(share * active), old[qualified].numel() - active)
            assert int(grown.sum()) <= k  # fewer where a dropped weight was regrown by the same update
            assert bool((after.weights[t][qualified][grown] == 0).all())  # regrown weights start at zero
            assert bool((after.momentum[t][qualified][grown] == 0).all())  # and so does their optimizer state
            dropped, kept = old[qualified] & ~new[qualified], old[qualified] & new[qualified]
            magnitude = before.weights[t][qualified].abs()
            if dropped.any():  # dropped: among the k smallest active magnitudes right after the optimizer step
                assert magnitude[dropped].max() <= magnitude[old[qualified]].sort().values[k - 1]
            torch.testing.assert_close(after.weights[t][qualified][kept], before.weights[t][qualified][kept])
    assert any(bool((after.masks[t][q] != after.masks[t - 1][q]).any()) for t in updates for q in after.masks[t])


class FreezeFirstLayer(L.Callback):
    """Holds ``net.0`` frozen (as ``BackboneFinetuning`` holds a backbone) from the start of fit."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for parameter in pl_module.net[0].parameters():
            parameter.requires_grad_(False)


@pytest.mark.parametrize(("regrow", "masking"), [("set", "reparametrize"), ("rigl", "inplace")])
def test_a_frozen_tensor_keeps_its_mask_and_the_total_stays_exact(regrow: str, masking: str) -> None:
    callback = PruningCallback(
        0.5, scope="erk", regrow=regrow, regrow_every=2, regrow_fraction=0.3, masking=masking, make_permanent=False
    )
    masks: list[dict[str, Tensor]] = []

    class Masks(L.Callback):  # after the pruning callback: the masks after each step's moves
        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
            masks.append({q: callback._masked.mask(m, n).bool().clone() for q, m, n in callback._masked.selection})

    model = TinyNet()
    quiet_trainer([FreezeFirstLayer(), callback, Masks()], max_epochs=2).fit(model)
    assert all(torch.equal(m["net.0.weight"], masks[0]["net.0.weight"]) for m in masks)  # a regrown entry stays 0
    assert any(not torch.equal(m["net.2.weight"], masks[0]["net.2.weight"]) for m in masks)  # the others move
    effective = folded(state(model))
    zeros = sum(int((effective[f"net.{i}.weight"] == 0).sum()) for i in (0, 2, 4))
    assert zeros == round(0.5 * N)  # every kept weight nonzero: the model is as sparse as reported


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize(("dropped_gradient", "moves"), [(9.0, False), (0.5, True)])
def test_a_dropped_weight_among_the_largest_gradients_is_regrown_with_its_value_and_state(
    inplace: bool, dropped_gradient: float, moves: bool
) -> None:
    """RigL's Algorithm 1: the regrowth candidates are the entries inactive after the drop, so a dropped weight whose
    dense gradient ranks in the top k stays, with its value and optimizer state (nothing moved)."""
    layer = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[0.1, 2.0, 3.0, 0.01]]))
    masked = MaskedSelection(
        [("fc.weight", layer, "weight")], [], [], prune.L1Unstructured, {}, "layerwise", torch.bool, 0, inplace=inplace
    )
    masked.prune_to(0.25, event=0)  # 0.01 is pruned: the mask is [1, 1, 1, 0]
    parameter = prune.original(layer, "weight")
    optimizer = torch.optim.SGD([parameter], lr=0.0, momentum=0.9)
    parameter.grad = torch.ones_like(parameter)
    optimizer.step()  # momentum 1 everywhere, the weights unchanged
    grads = {"fc.weight": torch.tensor([[dropped_gradient, 0.0, 0.0, 1.0]])}
    shares = masked.move(0.34, step=1, grads=grads, optimizers=[optimizer])  # k = round(0.34 * 3) = 1

    mask = masked.mask(layer, "weight").bool()
    momentum = optimizer.state[parameter]["momentum_buffer"]
    if moves:  # 0.1 dropped, the pruned entry regrown at zero with zero momentum
        assert mask.tolist() == [[False, True, True, True]] and shares == {"fc.weight": pytest.approx(1 / 3)}
        assert layer.weight[0, 3].item() == 0.0 and momentum[0, 3].item() == 0.0
    else:  # 0.1 dropped and regrown: it keeps its value and momentum
        assert mask.tolist() == [[True, True, True, False]] and shares == {"fc.weight": 0.0}
        assert layer.weight[0, 0].item() == pytest.approx(0.1) and momentum[0, 0].item() == 1.0
    assert int(mask.sum()) == 3


@pytest.mark.parametrize("regrow", ["rigl", "set"])
def test_resume_mid_run_is_exact(tmp_path: Path, regrow: str) -> None:
    def run(ckpt_path: Path | None) -> nn.Module:
        callback = PruningCallback(
            0.8, scope="erk", regrow=regrow, regrow_every=2, regrow_until=0.9, make_permanent=False, seed=3
        )
        checkpoints = ModelCheckpoint(tmp_path / "ckpt", every_n_epochs=1, save_top_k=-1)
        model = TinyNet()
        trainer = quiet_trainer([callback, checkpoints], max_epochs=4, enable_checkpointing=True)
        trainer.fit(model, ckpt_path=ckpt_path)
        return model

    uninterrupted = run(None)
    (middle,) = (tmp_path / "ckpt").glob("epoch=1-step=16.ckpt")  # Lightning resumes exactly at epoch ends
    resumed = run(middle)  # masks moved at steps 2, 4, ..., 16 before, and move at 18, ..., 28 after the resume
    a, b = state(uninterrupted), state(resumed)
    assert sorted(a) == sorted(b)
    for key in a:
        if key.endswith("_mask"):
            assert torch.equal(a[key], b[key]), key
    for key, value in folded(a).items():
        torch.testing.assert_close(folded(b)[key], value, rtol=0, atol=0, msg=key)


@pytest.mark.parametrize(
    ("arguments", "match"),
    [
        ({"regrow": "grow"}, r"regrow='grow': one of \('rigl', 'set'\)"),
        ({"regrow": "rigl", "method": "ln_structured"}, "moves single weights, which needs an unstructured method"),
        ({"regrow": "set", "scope": "row"}, "moves weights within each tensor, not within each row"),
        ({"regrow": "set", "regrow_fraction": 1.0}, r"regrow_fraction=1.0: must be a float in \(0, 1\)"),
        ({"regrow": "set", "regrow_every": 0}, "regrow_every=0: must be an int >= 1"),
        ({"regrow": "rigl", "regrow_until": 0}, r"regrow_until=0: must be a float in \(0, 1\]"),
    ],
)
def test_refusals_are_named_at_construction(arguments: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PruningCallback(0.9, **arguments)


def test_an_unknown_run_length_is_refused_before_the_first_step() -> None:
    callback = PruningCallback(0.8, regrow="set")
    with pytest.raises(ValueError, match=r"regrow_until=0\.75 is a fraction of the run"):
        quiet_trainer([callback], max_epochs=-1, max_steps=-1).fit(TinyNet())


@pytest.mark.parametrize(
    ("arguments", "last_update"),
    [({"regrow_every": 100}, None), ({"regrow_every": 8, "regrow_until": 0.2}, None), ({"regrow_every": 8}, 16)],
    ids=["every past the run", "until before the first update", "moves"],
)
def test_a_run_whose_masks_would_never_move_is_refused_when_training_starts(
    arguments: dict[str, Any], last_update: int | None
) -> None:
    """RigL or SET with no update before regrow_until would train a static sparse model: refused, naming why."""
    callback = PruningCallback(0.8, regrow="set", summary=False, **arguments)
    trainer = quiet_trainer([callback], max_epochs=4)  # 32 optimizer steps
    if last_update is None:
        with pytest.raises(ValueError, match=r"no update falls before it, so the masks would never move"):
            trainer.fit(TinyNet())
    else:
        trainer.fit(TinyNet())
        assert callback.state_dict()["last_regrow"] == last_update  # updates at 8 and 16, before step 24


@pytest.mark.parametrize(("fraction", "warns"), [(0.001, True), (0.3, False)])
def test_a_fraction_that_moves_nothing_anywhere_is_said_at_the_first_update(fraction: float, warns: bool) -> None:
    """round(fraction x active) = 0 in every tensor: no update would ever move a weight."""
    callback = PruningCallback(0.8, regrow="set", regrow_every=8, regrow_fraction=fraction, summary=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_trainer([callback], max_epochs=4).fit(TinyNet())
    said = [str(w.message) for w in caught if "the masks never move" in str(w.message)]
    assert len(said) == warns, said
    if warns:
        assert "regrow_fraction=0.001 moves round(" in said[0] and "(step 8)" in said[0]


class TinyGPT2(L.LightningModule):
    """GPT-2 from a config (no download): transformers' Conv1D layers, the lm_head tied to the embedding."""

    def __init__(self, optimizer: Any = None) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers")
        torch.manual_seed(0)
        config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
        self.model = transformers.GPT2LMHeadModel(config)
        self.optimizer = optimizer or (lambda parameters: torch.optim.AdamW(parameters, lr=1e-3))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids, use_cache=False).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.optimizer(self.parameters())

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 64, (32, 12), generator=generator)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=8)


def test_rigl_erk_on_a_tiny_gpt2_keeps_counts_ties_and_zeroes_adams_moments() -> None:
    """GPT-2 from a config: transformers' Conv1D layers, the lm_head tied to the embedding, AdamW's two moments."""
    pytest.importorskip("transformers")

    callback = PruningCallback(
        0.8,
        scope="erk",
        regrow="rigl",
        regrow_every=2,
        regrow_until=1.0,
        module_types=(nn.Linear, "transformers.pytorch_utils.Conv1D"),
        make_permanent=False,
    )
    model = TinyGPT2()
    before: dict[str, Tensor] = {}

    class Check(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
            masked = callback._masked
            now = {q: masked.mask(m, n).bool().clone() for q, m, n in masked.selection}
            if trainer.global_step == 2:  # the update: regrown entries have Adam's moments at zero
                optimizer = trainer.optimizers[0]
                for qualified, module, name in masked.selection:
                    grown = now[qualified] & ~before[qualified]
                    assert int(now[qualified].sum()) == int(before[qualified].sum())
                    assert grown.any(), qualified
                    moments = optimizer.state[prune.original(module, name)]
                    assert not bool(moments["exp_avg"][grown].any()) and not bool(moments["exp_avg_sq"][grown].any())
            before.update(now)

    quiet_trainer([callback, Check()], max_steps=3).fit(model)
    assert sum(pruned for _, pruned in callback._masked.counts()) == round(
        0.8 * sum(u for u, _ in callback._masked.counts())
    )
    assert model.model.lm_head.weight is model.model.transformer.wte.weight or torch.equal(
        model.model.lm_head.weight, model.model.transformer.wte.weight
    )  # the tie holds through the moving masks


def _fit_state(model: L.LightningModule, callbacks: list[Any], **options: Any) -> dict[str, Tensor]:
    quiet_trainer(callbacks, **{"max_steps": 12, **options}).fit(model)
    return {key: value.clone() for key, value in model.state_dict().items()}


def test_rigl_on_a_tied_weight_sums_the_gradient_of_every_owner() -> None:
    """Reparametrized, each module holding the tied tensor computes with its own masked copy: the dense gradient
    is the sum over the owners, as the in-place mode's hook on the Parameter sees it, so both modes move alike."""
    pytest.importorskip("transformers")

    states = {
        masking: _fit_state(
            TinyGPT2(lambda parameters: torch.optim.SGD(parameters, lr=0.1)),
            [
                PruningCallback(
                    0.8,
                    regrow="rigl",
                    regrow_every=2,
                    regrow_until=1.0,
                    masking=masking,
                    include=r"model\.lm_head\.weight",
                    module_types=None,
                )
            ],
        )
        for masking in ("reparametrize", "inplace")
    }
    for key, value in states["inplace"].items():
        torch.testing.assert_close(states["reparametrize"][key], value, rtol=0, atol=0, msg=key)


def test_regrown_entries_start_at_zero_in_the_averaged_copy_too() -> None:
    """EMA beside SET: the reparametrized average must not bring back its old values at regrown entries."""
    from lightning.pytorch.callbacks import EMAWeightAveraging

    states = {
        masking: _fit_state(
            TinyNet(),
            [
                EMAWeightAveraging(decay=0.9, use_buffers=False),
                PruningCallback(
                    0.8, regrow="set", regrow_every=2, regrow_fraction=0.3, regrow_until=0.9, masking=masking
                ),
            ],
        )
        for masking in ("reparametrize", "inplace")
    }
    for key, value in states["inplace"].items():
        torch.testing.assert_close(states["reparametrize"][key], value, msg=key)


def test_rigl_refuses_what_it_cannot_collect_and_regrowth_refuses_adapters() -> None:
    from lightprune.adapters import AdaptedWeight

    class Attending(TinyNet):
        def __init__(self) -> None:
            super().__init__()
            self.attention = nn.MultiheadAttention(8, 2)

    callback = PruningCallback(0.5, regrow="rigl", include=r"attention\.out_proj\.weight")
    with pytest.raises(ValueError, match=r"misses the MultiheadAttention projections .*out_proj"):
        quiet_trainer([callback], max_steps=2).fit(Attending())

    class Adapted(TinyNet):
        def __init__(self) -> None:
            super().__init__()
            self.net[0] = AdaptedWeight(nn.Linear(8, 16), rank=2)

    with pytest.raises(ValueError, match=r"regrow='set' cannot move the masks of adapted \(LoRA\) base weights"):
        quiet_trainer([PruningCallback(0.5, regrow="set")], max_steps=2).fit(Adapted())
    with pytest.raises(ValueError, match=r"method='semi_structured': regrow=set .* semi_structured is n:m"):
        PruningCallback(0.5, regrow="set", method="semi_structured")


class ReadsItsHead(TinyNet):
    """The last layer's weight is read by the parent (``F.linear``), its module's forward never called."""

    def forward(self, x: Tensor) -> Tensor:
        head = self.net[4]
        return nn.functional.linear(self.net[3](self.net[2](self.net[1](self.net[0](x)))), head.weight, head.bias)


class WeightNormed(TinyNet):
    """The old ``weight_norm``, whose pre-hook (before the pruning's) reads ``weight_v`` to compute ``weight``."""

    def __init__(self) -> None:
        super().__init__()
        nn.utils.weight_norm(self.net[2])


@pytest.mark.filterwarnings("ignore:.*weight_norm.*:FutureWarning")
@pytest.mark.parametrize(("model", "include"), [(ReadsItsHead, r".*weight"), (WeightNormed, r".*weight(_v)?")])
def test_rigl_takes_the_dense_gradient_of_a_tensor_no_module_forward_recomputes(model: type, include: str) -> None:
    """Reparametrized, such a tensor's dense gradient was all zeros (its forward hook never saw the tensor the loss
    read): RigL regrew the first inactive entries by index. Now both maskings move the same masks."""
    masks = {}
    for masking in ("reparametrize", "inplace"):
        callback = PruningCallback(  # (0.5: weight_norm divides by each row's norm, which must not vanish)
            0.5, scope="layerwise", regrow="rigl", regrow_every=2, regrow_until=1.0, include=include,
            module_types=None, parameter_names=["weight", "weight_v"], masking=masking, summary=False,
            make_permanent=False,
        )  # fmt: skip
        quiet_trainer([callback], max_steps=7).fit(net := model())
        assert all(bool(p.isfinite().all()) for p in net.parameters())
        masks[masking] = {q: callback._masked.mask(m, n).bool() for q, m, n in callback._masked.selection}
        assert callback.state_dict()["last_regrow"] == 6  # the masks moved after steps 2, 4 and 6
    assert masks["reparametrize"].keys() == masks["inplace"].keys()
    for name, mask in masks["reparametrize"].items():
        assert torch.equal(mask, masks["inplace"][name]), name


class HeadOnlyOptimizer(TinyNet):
    """A backbone kept fixed by leaving it out of the optimizer (its weights still require grad)."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.net[4].parameters(), lr=0.1, momentum=0.9)


@pytest.mark.parametrize("regrow", ["rigl", "set"])
def test_a_tensor_no_optimizer_steps_keeps_its_mask_like_a_frozen_one(regrow: str) -> None:
    """Before, every update dropped trained weights of such a tensor and regrew zeros that never trained."""
    callback = PruningCallback(
        0.5, scope="layerwise", regrow=regrow, regrow_every=2, regrow_until=1.0, summary=False, make_permanent=False
    )
    model = HeadOnlyOptimizer()
    quiet_trainer([callback], max_steps=7).fit(model)
    for layer in (model.net[0], model.net[2]):  # the same weights as pruned at step 0, none of them zero
        assert torch.equal(layer.weight != 0, layer.weight_mask.bool())
    head = model.net[4]
    assert int(head.weight_mask.sum()) == head.weight.numel() // 2


class SkipsItsHeadOnOddSteps(TinyNet):
    """A branch that the update steps do not take: the last layer gets no gradient in their backward."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        hidden = self.net[3](self.net[2](self.net[1](self.net[0](x))))
        if batch_idx % 2 == 1:  # steps 2, 4, 6 (the update steps) end on this branch
            return hidden.square().mean()
        return nn.functional.cross_entropy(self.net[4](hidden), y)


def test_rigl_leaves_the_mask_of_a_layer_the_update_step_did_not_use() -> None:
    """Its dense gradient was all zeros, and RigL regrew its first inactive entries by index."""
    callback = PruningCallback(
        0.5, scope="layerwise", regrow="rigl", regrow_every=2, regrow_until=1.0, summary=False, make_permanent=False
    )
    model = SkipsItsHeadOnOddSteps()
    before: dict[str, Tensor] = {}

    class First(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
            if trainer.global_step == 1:
                before["head"] = pl_module.net[4].weight_mask.clone()
                before["first"] = pl_module.net[0].weight_mask.clone()

    with pytest.warns(UserWarning, match=r"no gradient reached \['net.4.weight'\] in the backward of step 2"):
        quiet_trainer([callback, First()], max_steps=6).fit(model)
    assert torch.equal(model.net[4].weight_mask, before["head"])  # never moved
    assert not torch.equal(model.net[0].weight_mask, before["first"])  # the layers the steps used did


def test_a_frozen_layer_is_not_named_as_unreached_by_the_update_step() -> None:
    """A frozen tensor has no gradient either; it keeps its mask for that reason, without the warning."""
    model = TinyNet()
    model.net[0].weight.requires_grad_(False)
    callback = PruningCallback(
        0.5, scope="layerwise", regrow="rigl", regrow_every=2, regrow_until=1.0, summary=False, make_permanent=False
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*no gradient reached.*")
        quiet_trainer([callback], max_steps=4).fit(model)
    assert callback._masked.unranked == []
