"""``PruningCallback(masking="inplace")``: plain Parameters zeroed in place, the same effective weights as the
reparametrized mode, bit for bit, for every optimizer whose update of an entry depends on that entry alone."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint
from torch import Tensor, nn

from lightprune import prune
from lightprune.callback import PruningCallback
from lightprune.schedules import Cubic, Linear
from tiny_lightning import WEIGHTS, N, TinyNet, quiet_trainer

pytestmark = [
    pytest.mark.usefixtures("one_thread_for_module"),
]


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "SGD": lambda params: torch.optim.SGD(params, lr=0.1),
    "SGD momentum, weight decay, Nesterov": lambda params: torch.optim.SGD(
        params, lr=0.1, momentum=0.9, weight_decay=1e-3, nesterov=True
    ),
    "Adam": lambda params: torch.optim.Adam(params, lr=1e-2),
    "Adam with L2": lambda params: torch.optim.Adam(params, lr=1e-2, weight_decay=1e-3),
    "AdamW": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=1e-2),
    "RMSprop": lambda params: torch.optim.RMSprop(params, lr=1e-3, momentum=0.5),
}


class Net(TinyNet):
    def __init__(self, optimizer: str = "SGD") -> None:
        super().__init__()
        self.optimizer_name = optimizer

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return OPTIMIZERS[self.optimizer_name](self.parameters())


def fit(model: L.LightningModule, callbacks: list[Any], tmp_path: Path, **kwargs: Any) -> L.Trainer:
    ckpt_path = kwargs.pop("ckpt_path", None)
    trainer = quiet_trainer(callbacks, **{"max_epochs": 3, "default_root_dir": tmp_path, **kwargs})
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer


def effective(model: nn.Module) -> dict[str, Tensor]:
    return {name: model.get_parameter(name).detach().clone() for name in WEIGHTS}


def assert_same(actual: dict[str, Tensor], expected: dict[str, Tensor]) -> None:
    for name, value in expected.items():
        assert torch.equal(actual[name], value), name
        assert torch.equal(actual[name] == 0, value == 0), name  # the same zeros


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize(
    "options",
    [{}, {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05}],
    ids=["plain", "accumulation and clipping"],
)
def test_in_place_equals_the_reparametrization_bit_for_bit(
    tmp_path: Path, optimizer: str, options: dict[str, Any]
) -> None:
    results = {}
    for masking in ("reparametrize", "inplace"):
        model = Net(optimizer)
        callback = PruningCallback(Cubic(final=0.7, start=0, end=10, frequency=2), masking=masking)
        fit(model, [callback], tmp_path, **options)
        assert not prune.is_pruned(model)
        results[masking] = effective(model)
    assert sum(int((w == 0).sum()) for w in results["inplace"].values()) == round(0.7 * N)
    assert_same(results["inplace"], results["reparametrize"])


@pytest.mark.parametrize(
    "options",
    [
        {"method": "ln_structured", "method_kwargs": {"n": 1}, "prune_channel_bias": True},
        {"method": "random_unstructured", "scope": "layerwise", "rewind": "init"},
    ],
    ids=["structured with channel biases", "random, layerwise, rewinding"],
)
def test_in_place_equals_the_reparametrization_for_other_methods(tmp_path: Path, options: dict[str, Any]) -> None:
    results = {}
    for masking in ("reparametrize", "inplace"):
        model = Net("Adam")
        callback = PruningCallback(Linear(final=0.5, start=0, end=12, frequency=4), masking=masking, **options)
        fit(model, [callback], tmp_path)
        results[masking] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert list(results["inplace"]) == list(results["reparametrize"])
    assert_same(results["inplace"], results["reparametrize"])
    for key, value in results["reparametrize"].items():
        assert torch.equal(results["inplace"][key], value), key


class Probe(L.Callback):
    """Between events the tensors are plain Parameters, and the gradients the optimizer sees are masked."""

    def __init__(self) -> None:
        self.checked = 0

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        assert not prune.is_pruned(pl_module)
        for name in WEIGHTS:
            weight = pl_module.get_parameter(name)
            if bool((weight == 0).any()):
                assert bool((weight.grad[weight == 0] == 0).all()), name
                self.checked += 1


def test_between_events_the_tensors_are_plain_and_gradients_masked(tmp_path: Path) -> None:
    probe = Probe()
    callback = PruningCallback(Cubic(final=0.7, start=0, end=10, frequency=2), masking="inplace")
    fit(Net("Adam"), [callback, probe], tmp_path)
    assert probe.checked > 0


def test_in_place_resumes_exactly(tmp_path: Path) -> None:
    def run(root: Path, ckpt_path: Path | None = None) -> dict[str, Tensor]:
        model = Net("Adam")
        callback = PruningCallback(Cubic(final=0.7, start=0, end=20, frequency=2), masking="inplace")
        checkpoints = ModelCheckpoint(root, every_n_epochs=1, save_top_k=-1)
        fit(model, [callback, checkpoints], tmp_path, enable_checkpointing=True, ckpt_path=ckpt_path)
        return effective(model)

    uninterrupted = run(tmp_path / "a")
    (middle,) = (tmp_path / "a").glob("*step=8.ckpt")
    saved = torch.load(middle, weights_only=True)
    (state,) = [v for k, v in saved["callbacks"].items() if k.startswith("PruningCallback")]
    assert state["masks"] and not any(k.endswith(("_orig", "_mask")) for k in saved["state_dict"])
    assert_same(run(tmp_path / "b", ckpt_path=middle), uninterrupted)


def test_in_place_with_ema_keeps_the_zeros(tmp_path: Path) -> None:
    model = Net("Adam")
    callbacks = [
        PruningCallback(Cubic(final=0.7, start=0, end=10, frequency=2), masking="inplace"),
        EMAWeightAveraging(),
    ]
    fit(model, callbacks, tmp_path)
    assert sum(int((w == 0).sum()) for w in effective(model).values()) == round(0.7 * N)


def test_lbfgs_is_refused_and_adafactor_warns(tmp_path: Path) -> None:
    class LBFGSNet(TinyNet):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.LBFGS(self.parameters())

    with pytest.raises(ValueError, match=r"masking='inplace'\) cannot mask inside LBFGS's step"):
        fit(LBFGSNet(), [PruningCallback(0.5, masking="inplace")], tmp_path, max_epochs=1)

    class AdafactorNet(TinyNet):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adafactor(self.parameters())

    with pytest.warns(UserWarning, match=r"with Adafactor: its update reads whole tensors"):
        fit(AdafactorNet(), [PruningCallback(0.5, masking="inplace")], tmp_path, max_epochs=1)


def test_masking_must_be_one_of_the_modes() -> None:
    with pytest.raises(
        ValueError, match=r"masking='in_place' is not supported: allowed are \('reparametrize', 'inplace'\)"
    ):
        PruningCallback(0.5, masking="in_place")


class PassCounter(L.Callback):
    """Placed after the PruningCallback: counts the weight passes (``InPlaceMasks.apply``) that run inside each
    optimizer step, between a step pre-hook and a step post-hook registered after the callback's own, and checks
    after every step that every pruned weight and its optimizer state are exactly zero."""

    def __init__(self, callback: PruningCallback, counter: list[int], check_state: bool) -> None:
        self.callback, self.counter, self.check_state = callback, counter, check_state
        self.passes: list[int] = []
        self.checked = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.depth = 0  # a subclass's step calling super().step() runs the hooks twice, nested
        for optimizer in trainer.optimizers:
            optimizer.register_step_pre_hook(lambda *args: self.before_step())
            optimizer.register_step_post_hook(lambda optimizer, *args: self.after_step(optimizer))

    def before_step(self) -> None:
        if self.depth == 0:
            self.passes.append(-self.counter[0])
        self.depth += 1

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.depth -= 1
        if self.depth > 0:
            return
        self.passes[-1] += self.counter[0]
        masked = self.callback._masked
        for _, module, name in masked.selection:
            mask = masked.mask(module, name)
            if mask is None:
                continue
            parameter = getattr(module, name)
            assert bool((parameter[~mask] == 0).all())
            for key in ("momentum_buffer", "exp_avg", "grad_avg") if self.check_state else ():
                value = optimizer.state[parameter].get(key)
                if value is not None:
                    assert bool((value[~mask] == 0).all()), f"the {key} of pruned entries stays zero"
            self.checked += 1


ENTRYWISE = {
    **OPTIMIZERS,
    "Adagrad": lambda params: torch.optim.Adagrad(params, lr=1e-2),
    "SGD momentum, dampening": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, dampening=0.1),
    "Adam AMSGrad": lambda params: torch.optim.Adam(params, lr=1e-2, amsgrad=True),
    "RMSprop centered": lambda params: torch.optim.RMSprop(params, lr=1e-3, momentum=0.5, centered=True),
}


def counted_fit(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    make_optimizer: Callable[[Any], torch.optim.Optimizer],
    entrywise: bool,
) -> tuple[TinyNet, PassCounter, int]:
    """A fit in place whose events come after momentum built up, counting the weight passes inside steps."""
    from lightprune.callback.inplace import InPlaceMasks

    counter = [0]
    apply = InPlaceMasks.apply

    def counted(self: InPlaceMasks) -> None:
        counter[0] += 1
        apply(self)

    monkeypatch.setattr(InPlaceMasks, "apply", counted)

    class Model(TinyNet):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return make_optimizer(self.parameters())

    callback = PruningCallback(Cubic(final=0.7, start=4, end=20, frequency=4), masking="inplace")
    probe = PassCounter(callback, counter, check_state=entrywise)
    model = Model()
    fit(model, [callback, probe], tmp_path, max_epochs=4)
    zeros = sum(int((w == 0).sum()) for w in effective(model).values())
    return model, probe, zeros


@pytest.mark.parametrize("optimizer", list(ENTRYWISE))
def test_entrywise_optimizers_need_no_weight_pass_and_zeros_stay_exact(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, optimizer: str
) -> None:
    _, probe, zeros = counted_fit(monkeypatch, tmp_path, ENTRYWISE[optimizer], entrywise=True)
    assert len(probe.passes) == 32 and set(probe.passes) == {0}, "no weight pass after their steps"
    assert probe.checked > 50  # pruned weights (momentum present at every event) checked zero after every step
    assert zeros == round(0.7 * N)


class ShiftingAdam(torch.optim.Adam):
    """An Adam subclass whose step also moves every weight: pruned entries would leave zero without a weight pass."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = super().step(closure)
        for group in self.param_groups:
            for parameter in group["params"]:
                parameter.add_(1e-3)
        return loss


@pytest.mark.parametrize(
    "make_optimizer",
    [lambda params: ShiftingAdam(params, lr=1e-2), lambda params: torch.optim.Adamax(params, lr=1e-2)],
    ids=["Adam subclass", "Adamax"],
)
def test_other_optimizers_get_a_weight_pass_after_every_step(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, make_optimizer: Callable[[Any], torch.optim.Optimizer]
) -> None:
    _, probe, zeros = counted_fit(monkeypatch, tmp_path, make_optimizer, entrywise=False)
    assert len(probe.passes) == 32 and min(probe.passes) >= 1, "a weight pass after each step"
    assert probe.checked > 50
    assert zeros >= round(0.7 * N)


class ManualClipping(TinyNet):
    """Manual optimization with the user's own clipping between backward and ``optimizer.step()``."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        x, y = batch
        optimizer.zero_grad()
        self.manual_backward(nn.functional.cross_entropy(self(x), y))
        self.clip_gradients(optimizer, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        optimizer.step()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


@pytest.mark.filterwarnings("ignore:.*under manual optimization.*")
def test_manual_optimization_clips_masked_gradients_as_the_reparametrization(tmp_path: Path) -> None:
    results = {}
    for masking in ("reparametrize", "inplace"):
        model = ManualClipping()
        fit(model, [PruningCallback(Cubic(final=0.7, start=2, end=12, frequency=2), masking=masking)], tmp_path)
        results[masking] = effective(model)
    assert_same(results["inplace"], results["reparametrize"])


def test_per_step_passes_follow_every_change_of_masks() -> None:
    """The strategy prepares its per-step passes once per change of masks: a mask put later (an event, a restore)
    replaces the prepared one, for the gradients and for the weights, and a Parameter without a gradient is skipped."""
    from lightprune.callback.inplace import InPlaceMasks

    generator = torch.Generator().manual_seed(0)
    layers = [nn.Linear(30, 20), nn.Linear(20, 4)]
    masks = InPlaceMasks()
    masks.hook_grads = False  # automatic optimization: one pass before each optimizer step
    for round_ in range(3):
        keeps = [torch.rand(layer.weight.shape, generator=generator) < 0.3 + 0.2 * round_ for layer in layers]
        for layer, keep in zip(layers, keeps, strict=True):
            masks.put(layer, "weight", keep)
        layers[0].weight.grad = torch.randn(layers[0].weight.shape, generator=generator)
        layers[1].weight.grad = None if round_ == 1 else torch.randn(layers[1].weight.shape, generator=generator)
        grads = [None if layer.weight.grad is None else layer.weight.grad.clone() for layer in layers]
        masks.mask_grads()
        for layer, keep, grad in zip(layers, keeps, grads, strict=True):
            assert (layer.weight.grad is None) == (grad is None)
            if grad is not None:
                assert torch.equal(layer.weight.grad, torch.where(keep, grad, 0.0))
        with torch.no_grad():
            for layer in layers:
                layer.weight.add_(1.0)  # an optimizer that moves pruned entries: the weight pass zeroes them
        weights = [layer.weight.detach().clone() for layer in layers]
        masks.apply()
        for layer, keep, weight in zip(layers, keeps, weights, strict=True):
            assert torch.equal(layer.weight.detach(), torch.where(keep, weight, 0.0))


class SwitchOptimizer(L.Callback):
    """Replaces the optimizer when epoch 1 starts, as callbacks that switch optimizers mid-fit do."""

    def __init__(self, make_optimizer: Callable[[Any], torch.optim.Optimizer]) -> None:
        self.make_optimizer = make_optimizer

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch == 1:
            trainer.strategy.optimizers = [self.make_optimizer(pl_module.parameters())]


class ZerosAfterEveryBatch(L.Callback):
    """Counts the training batches after which a pruned entry of an effective weight is not zero."""

    def __init__(self, callback: PruningCallback) -> None:
        self.callback, self.batches, self.violations = callback, 0, 0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        masked = self.callback._masked
        for _, module, name in masked.selection:
            mask = masked.mask(module, name)
            if mask is not None:
                weight = getattr(module, name).detach()  # (the plain Parameter, or the reparametrized product)
                self.violations += int(bool((weight[~mask.bool()] != 0).any()))
        self.batches += 1


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
        lambda params: torch.optim.Adamax(params, lr=1e-2),
    ],
    ids=["SGD momentum", "Adamax"],
)
def test_an_optimizer_replaced_mid_fit_keeps_pruned_weights_at_zero(
    tmp_path: Path, make_optimizer: Callable[[Any], torch.optim.Optimizer]
) -> None:
    results = {}
    for masking in ("reparametrize", "inplace"):
        model = Net("SGD momentum, weight decay, Nesterov")
        callback = PruningCallback(Cubic(final=0.8, start=0, end=24, frequency=2), masking=masking)
        checker = ZerosAfterEveryBatch(callback)
        fit(model, [SwitchOptimizer(make_optimizer), callback, checker], tmp_path)
        assert checker.batches == 24 and checker.violations == 0, masking
        results[masking] = effective(model)
    assert_same(results["inplace"], results["reparametrize"])


class MasterCopies(TinyNet):
    """Its optimizer steps float32 master copies of the weights, written back into the model after every step (as a
    half-precision recipe does): the model's own Parameters are in no optimizer."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        self.masters = [p.detach().clone().requires_grad_() for p in self.parameters()]
        return torch.optim.SGD(self.masters, lr=0.1)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        for master, parameter in zip(self.masters, self.parameters(), strict=True):
            master.grad = parameter.grad

    def on_train_batch_end(self, *args: Any) -> None:
        with torch.no_grad():
            for master, parameter in zip(self.masters, self.parameters(), strict=True):
                parameter.copy_(master)


def test_in_place_warns_when_no_optimizer_of_the_fit_steps_the_pruned_weights() -> None:
    """Written by other code after the step passes, in-place pruned entries come back until the next event."""
    callback = PruningCallback(Linear(final=0.5, start=1, end=3, frequency=1), masking="inplace", summary=False)
    with pytest.warns(UserWarning, match=r"no optimizer of the fit steps \['net\.0\.weight', 'net\.2\.weight'"):
        quiet_trainer([callback], max_steps=4).fit(MasterCopies())
    held = PruningCallback(Linear(final=0.5, start=1, end=3, frequency=1), masking="inplace", summary=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*no optimizer of the fit steps.*")
        quiet_trainer([held], max_steps=4).fit(TinyNet())  # its optimizer holds every weight: no warning
