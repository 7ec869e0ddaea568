"""``PruningCallback(importance="obs")``: statistics from calibration batches or the training window, the OBS event
with reconstruction, sequential calibration, and refusals; in real tiny fits on the CPU.

The expected results are built here from the layers' inputs recorded in an unpruned forward of the same batches and
the engine's :func:`lightprune.prune.sparsegpt` (tested against its own plain reference in tests/prune/test_obs.py).
Resume mid-window: tests/callback/test_importance.py; DDP: tests/callback/test_callback_ddp.py.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from torch import Tensor, nn

from lightprune import prune
from lightprune.callback import PruningCallback
from lightprune.schedules import Constant, Linear
from tiny_lightning import TinyNet, loader, quiet_trainer

pytestmark = [
    pytest.mark.usefixtures("one_thread_for_module"),
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:.*the default selection.*covers.*"),
]

LAYERS = ("net.0", "net.2", "net.4")


class Frozen(TinyNet):
    """TinyNet whose optimizer does not move the weights: after a fit they are those the events left."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def fit(callback: PruningCallback, model: L.LightningModule | None = None, **kwargs: Any) -> L.LightningModule:
    model = Frozen() if model is None else model
    quiet_trainer([callback], **{"max_steps": 1, "num_sanity_val_steps": 0, **kwargs}).fit(model)
    return model


def hessians(model: nn.Module, batches: int) -> dict[str, Tensor]:
    """``X^T X`` of every layer's inputs over the first ``batches`` batches, summed batch by batch in float32."""
    found: dict[str, Tensor] = {}
    handles = [
        model.get_submodule(layer).register_forward_pre_hook(
            lambda m, args, layer=layer: found.__setitem__(
                layer, found.get(layer, 0) + args[0].T.float() @ args[0].float()
            )
        )
        for layer in LAYERS
    ]
    with torch.no_grad():
        for index, (x, _) in enumerate(loader()):
            if index < batches:
                model(x)
    for handle in handles:
        handle.remove()
    return found


def test_one_shot_from_calibration_batches_is_sparsegpt_per_row() -> None:
    reference = Frozen()
    h = hessians(reference, 3)
    model = fit(PruningCallback(0.5, importance="obs", calibration_batches=3, scope="row", make_permanent=False))
    for layer in LAYERS:
        weight = reference.get_submodule(layer).weight.detach()
        counts = torch.full((weight.shape[0],), round(0.5 * weight.shape[1]))
        expected, keep = prune.sparsegpt(weight, h[layer], counts=counts, per_row=True)
        module = model.get_submodule(layer)
        assert torch.equal(module.weight_mask, keep), layer
        torch.testing.assert_close(module.weight, expected, rtol=0, atol=1e-6)
        moved = (module.weight.detach() - weight)[keep]
        assert float(moved.abs().max()) > 0, f"{layer}: the kept weights were not reconstructed"


def test_sequential_calibration_takes_each_block_through_the_pruned_ones() -> None:
    reference = Frozen()
    for layer in LAYERS:  # each Linear of TinyNet is a block of its own ("net.0", "net.2", "net.4")
        h = hessians(reference, 2)[layer]
        prune.obs_unstructured(reference.get_submodule(layer), "weight", h, amount=0.5, per_row=True)
    callback = PruningCallback(
        0.5, importance="obs", calibration_batches=2, sequential=True, scope="row", make_permanent=False
    )
    model = fit(callback)
    plain = fit(PruningCallback(0.5, importance="obs", calibration_batches=2, scope="row", make_permanent=False))
    for layer in LAYERS:
        module, expected = model.get_submodule(layer), reference.get_submodule(layer)
        assert torch.equal(module.weight_mask.bool(), expected.weight_mask.bool()), layer
        torch.testing.assert_close(module.weight, expected.weight, rtol=0, atol=1e-6)
    assert not torch.equal(model.net[4].weight, plain.net[4].weight), "later blocks must see the pruned earlier ones"


def test_global_scope_meets_the_target_and_compares_layers() -> None:
    model = fit(PruningCallback(0.7, importance="obs", calibration_batches=2, make_permanent=False))
    pruned = [int((model.get_submodule(layer).weight_mask == 0).sum()) for layer in LAYERS]
    sizes = [model.get_submodule(layer).weight.numel() for layer in LAYERS]
    assert sum(pruned) == round(0.7 * sum(sizes))
    assert len({round(p / s, 2) for p, s in zip(pruned, sizes, strict=True)}) > 1, "one ranking across layers"


def test_without_reconstruction_the_saliency_ranks_and_weights_stay() -> None:
    reference = Frozen()
    h = hessians(reference, 2)
    callback = PruningCallback(
        0.5, importance="obs", reconstruct=False, calibration_batches=2, scope="row", make_permanent=False
    )
    model = fit(callback)
    for layer in LAYERS:
        weight = reference.get_submodule(layer).weight.detach()
        saliency = prune.obs_saliency(weight, h[layer])
        keep = torch.ones_like(weight, dtype=torch.bool)
        for row, values in enumerate(saliency.tolist()):
            for column in sorted(range(len(values)), key=lambda j: (values[j], j))[: round(0.5 * len(values))]:
                keep[row, column] = False
        module = model.get_submodule(layer)
        assert torch.equal(module.weight_mask, keep), layer
        assert torch.equal(module.weight, weight * keep), layer


@pytest.mark.parametrize("masking", ["reparametrize", "inplace"])
def test_gradual_obs_in_the_training_window_with_n_m_and_rows(masking: str) -> None:
    callback = PruningCallback(
        Linear(final=0.75, start=4, end=12, frequency=4), importance="obs", activation_window=2, scope="row",
        masking=masking,
    )  # fmt: skip
    model = fit(callback, TinyNet(), max_steps=16, max_epochs=2)
    for layer in LAYERS:
        weight = model.get_submodule(layer).weight
        assert (weight == 0).sum(dim=1).tolist() == [round(0.75 * weight.shape[1])] * weight.shape[0]
    nm = PruningCallback(
        Constant(0.5, at=2), method="semi_structured", importance="obs", include=r"net\.[24]\.weight", masking=masking
    )
    model = fit(nm, TinyNet(), max_steps=4)
    for layer in ("net.2", "net.4"):
        weight = model.get_submodule(layer).weight
        assert ((weight != 0).view(weight.shape[0], -1, 4).sum(dim=-1) <= 2).all()


def test_q_k_v_share_one_matrix_in_a_tiny_bert() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )

    class TinyBert(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = transformers.BertForMaskedLM(config)

        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            (ids,) = batch
            return self.model(input_ids=ids, labels=ids).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self) -> Any:
            ids = torch.randint(0, 64, (32, 12), generator=torch.Generator().manual_seed(0))
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=8)

    callback = PruningCallback(
        Constant(0.5, at=2), importance="obs", activation_window=2, scope="row", include=r"model\.bert\.encoder\..*"
    )
    shares: dict[str, str] = {}

    class Spy(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            if trainer.global_step == 2:
                shares.update(callback._importance.hessians.shares)

    model = TinyBert()
    quiet_trainer([callback, Spy()], max_steps=3, num_sanity_val_steps=0).fit(model)
    prefix = "model.bert.encoder.layer.0.attention.self."
    assert {shares[prefix + p + ".weight"] for p in ("query", "key", "value")} == {prefix + "query.weight"}
    assert len(set(shares.values())) == 4  # q/k/v, attention output, intermediate, output
    for name in callback.selection:
        weight = model.get_submodule(name.rsplit(".", 1)[0]).weight
        assert (weight == 0).sum(dim=1).tolist() == [round(0.5 * weight.shape[1])] * weight.shape[0], name


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"importance": "obs", "method": "ln_structured"}, r"importance='obs': obs chooses .*ln_structured cannot"),
        ({"importance": "activation", "reconstruct": True}, r"reconstruct=True: .*needs importance=obs"),
        ({"importance": "obs", "sequential": True}, r"sequential=True: .*calibration_batches > 0"),
        (
            {"importance": "obs", "sequential": True, "calibration_batches": 2, "scope": "global"},
            r"sequential=True: .*use scope=layerwise or row",
        ),
        (
            {"importance": "obs", "sequential": True, "calibration_batches": 2, "reconstruct": False},
            r"sequential=True: .*reconstruct on",
        ),
        ({"importance": "obs", "reconstruct": 1}, r"reconstruct=1: must be None"),
        ({"importance": "obs", "max_layer_sparsity": 0.9}, r"max_layer_sparsity=0.9: is not applied by OBS"),
    ],
)
def test_configuration_mistakes_raise_at_construction(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PruningCallback(0.5, **kwargs)


class WithConv3d(Frozen):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(2, 2, 1)


class Tied(Frozen):
    """The last layer's weight is an embedding's too, as GPT-2's lm_head is its input embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(4, 12)
        self.embedding.weight = self.net[4].weight


@pytest.mark.parametrize(
    ("kwargs", "model", "message"),
    [
        ({"schedule": 0.5}, Frozen, r"importance='obs' needs input statistics.*calibration_batches"),
        (
            {"schedule": 0.5, "calibration_batches": 1},
            Tied,
            r"reconstruct=True rewrites the kept weights of net\.4\.weight, which is tied to \[.embedding\.weight.\]",
        ),
        ({"schedule": Constant(0.5, at=1)}, WithConv3d, r"OBS pruning cannot handle conv\.weight \(Conv3d\)"),
        (
            {"schedule": Constant(0.5, at=1), "sequential": True, "calibration_batches": 1, "scope": "row"},
            Frozen,
            r"sequential=True calibrates an event at step 0",
        ),
    ],
)
def test_mistakes_found_with_the_model_raise_when_fit_starts(kwargs: dict[str, Any], model: type, message: str) -> None:
    schedule = kwargs.pop("schedule")
    with pytest.raises(ValueError, match=message):
        fit(PruningCallback(schedule, importance="obs", **kwargs), model(), max_steps=2)


def test_a_layer_whose_statistics_cannot_be_used_is_refused_by_name_and_nothing_changes() -> None:
    class Dead(Frozen):
        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            x, y = batch
            return super().training_step((x * float("nan"), y), batch_idx)

    model = Dead()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    callback = PruningCallback(0.5, importance="obs", calibration_batches=1, scope="row", make_permanent=False)
    with pytest.raises(ValueError, match=r"OBS pruning of net\.0\.weight: its input second moment H holds NaN"):
        fit(callback, model)
    for key, value in model.state_dict().items():
        if key in before:
            assert torch.equal(value, before[key]), key
    assert not prune.is_pruned(model)
