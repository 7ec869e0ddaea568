"""``PruningCallback`` on the models and workflows users bring: Hugging Face transformers built from configs (no
download), tied embeddings, ``Conv1D`` layers, layers built in ``configure_model``, ``load_from_checkpoint``,
``save_pretrained``, exact resume, and what the callback says at the end of fit.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, EarlyStopping, ModelCheckpoint
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightprune import prune
from lightprune.callback import PruningCallback
from lightprune.schedules import Constant, Cubic, Linear
from tiny_lightning import TinyNet, folded, loader, quiet_trainer

transformers = pytest.importorskip("transformers")

pytestmark = [
    pytest.mark.usefixtures("one_thread_for_module"),
    pytest.mark.filterwarnings("ignore:.*must be `None` or an integer within the vocabulary.*"),
]

CONV1D = "transformers.pytorch_utils.Conv1D"
VOCAB, SEQ = 64, 12


def zeros(tensor: Tensor) -> int:
    return int((tensor == 0).sum())


def tokens(samples: int = 32, seed: int = 0) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (samples, SEQ), generator=generator)
    return DataLoader(TensorDataset(ids), batch_size=8, shuffle=False)


def gpt2_config() -> Any:
    return transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=2,
        n_positions=SEQ,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )


class TinyGPT2(L.LightningModule):
    """GPT-2 with tied input and output embeddings (``lm_head.weight is transformer.wte.weight``)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.model = transformers.GPT2LMHeadModel(gpt2_config())

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        (ids,) = batch
        self.log("val_loss", self.model(input_ids=ids, labels=ids).loss)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return tokens()


class TinyBert(L.LightningModule):
    """A BERT sequence classifier from a config; labels are the parity of the first token."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        config = transformers.BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=SEQ,
            num_labels=2,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        self.model = transformers.BertForSequenceClassification(config)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids[:, 0] % 2).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return tokens()


def trainer(callbacks: list[Callback], tmp_path: Path | None = None, **kwargs: Any) -> L.Trainer:
    return quiet_trainer(
        callbacks, **{"max_epochs": 3, "num_sanity_val_steps": 0, "default_root_dir": tmp_path, **kwargs}
    )


class EmbeddingSpy(Callback):
    """Records, at every training forward of the tied input embedding, the zeros of the weight it computes with."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []  # (zeros of wte's weight in its forward, zeros of lm_head's mask)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        model = pl_module.model

        def record(module: nn.Module, inputs: Any, output: Tensor) -> None:
            mask = model.lm_head._buffers.get("weight_mask")
            if module.training and mask is not None:
                # the embedding's output is computed from module.weight: check it is the masked tensor
                assert torch.equal(output, nn.functional.embedding(inputs[0], module.weight))
                self.seen.append((zeros(module.weight), int((~mask).sum())))

        model.transformer.wte.register_forward_hook(record)


# ----------------------------------------------------------------------------------------------------------------------
# GPT-2: Conv1D layers and tied embeddings
# ----------------------------------------------------------------------------------------------------------------------


def gpt2_fit(tmp_path: Path, ckpt_path: Path | None = None, **options: Any) -> tuple[TinyGPT2, PruningCallback]:
    model = TinyGPT2()
    callback = PruningCallback(
        Cubic(final=0.5, start=0, end=8, frequency=2), module_types=["torch.nn.Linear", CONV1D], **options
    )
    checkpoints = ModelCheckpoint(tmp_path / "ckpt", every_n_epochs=1, save_top_k=-1)
    trainer([callback, checkpoints], tmp_path, enable_checkpointing=True).fit(model, ckpt_path=ckpt_path)
    return model, callback


def test_gpt2_tied_embedding_is_masked_in_both_owners_counted_once_and_stays_tied(tmp_path: Path) -> None:
    model = TinyGPT2()
    spy = EmbeddingSpy()
    callback = PruningCallback(Cubic(final=0.5, start=0, end=8, frequency=2), module_types=["torch.nn.Linear", CONV1D])
    trainer([callback, spy], tmp_path).fit(model)
    gpt2 = model.model
    # Conv1D weights are selected by import path; the tied lm_head/wte weight once, under its first name
    assert callback.selection[0] == "model.transformer.h.0.attn.c_attn.weight"
    assert "model.lm_head.weight" in callback.selection
    assert "model.transformer.wte.weight" not in callback.selection
    # during training the input embedding computed with the masked tensor at every step after the first event
    assert spy.seen and all(seen >= pruned for seen, pruned in spy.seen)
    # the tie survives fit end, and the exact target counts the shared tensor once
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight
    assert not prune.is_pruned(model)
    selected = [model.get_parameter(name) for name in callback.selection]
    total = sum(p.numel() for p in selected)
    assert sum(zeros(p) for p in selected) == round(0.5 * total)


@pytest.mark.slow
def test_gpt2_save_pretrained_round_trip_and_mid_fit_checkpoints(tmp_path: Path) -> None:
    model, callback = gpt2_fit(tmp_path, make_permanent=False)
    gpt2 = model.model
    assert gpt2.transformer.wte.weight_mask is gpt2.lm_head.weight_mask  # one mask, shared
    middle = tmp_path / "ckpt" / "epoch=0-step=4.ckpt"
    loaded = TinyGPT2.load_from_checkpoint(middle)  # plain transformers model, no lightprune
    assert loaded.model.lm_head.weight is loaded.model.transformer.wte.weight
    state = torch.load(middle, weights_only=True)
    assert not any(key.endswith(("_orig", "_mask")) for key in state["state_dict"])
    # resume from the mid-fit checkpoint: the same effective weights and masks as the uninterrupted run
    resumed, _ = gpt2_fit(tmp_path / "resumed", ckpt_path=middle, make_permanent=False)
    for key, value in folded(model.state_dict()).items():
        assert torch.equal(folded(resumed.state_dict())[key], value), key
    for key, value in model.state_dict().items():
        if key.endswith("_mask"):
            assert torch.equal(resumed.state_dict()[key], value), key
    # after making the pruning permanent, save_pretrained / from_pretrained keeps every zero and the tie
    for qualified in [*callback.selection, "model.transformer.wte.weight"]:
        module_name, name = qualified.rsplit(".", 1)
        prune.remove(model.get_submodule(module_name), name)
    gpt2.save_pretrained(tmp_path / "hf")
    again = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    assert again.lm_head.weight is again.transformer.wte.weight
    for key, value in gpt2.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key


@pytest.mark.parametrize("importance", ["magnitude", "activation"])
def test_row_scope_ranks_each_output_unit_of_a_conv1d(tmp_path: Path, importance: str) -> None:
    """``Conv1D`` stores its weight ``(in, out)``: per-row (Wanda) pruning counts per output unit, a column."""
    model = TinyGPT2()
    callback = PruningCallback(
        Constant(0.5, at=1), scope="row", importance=importance, module_types=["torch.nn.Linear", CONV1D]
    )
    trainer([callback], tmp_path, max_epochs=1).fit(model)
    c_attn = model.model.transformer.h[0].attn.c_attn.weight  # (32, 96)
    assert (c_attn == 0).sum(dim=0).tolist() == [16] * 96  # every output unit: half of its 32 inputs
    assert (model.model.lm_head.weight == 0).sum(dim=1).tolist() == [16] * VOCAB  # a Linear: rows


def test_row_scope_refuses_a_grouped_conv_transpose(tmp_path: Path) -> None:
    class Upsample(TinyNet):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.ConvTranspose1d(4, 6, 3, groups=2)

    with pytest.raises(ValueError, match=r"up\.weight belongs to a ConvTranspose1d with groups=2: .*scope='row'"):
        callback = PruningCallback(0.5, scope="row", module_types=["torch.nn.ConvTranspose1d"])
        trainer([callback], tmp_path).fit(Upsample())


@pytest.mark.parametrize("layer", ["Conv1D", "ConvTranspose2d"])
def test_channel_bias_is_refused_where_dim_0_runs_over_inputs(tmp_path: Path, layer: str) -> None:
    """``(in, out)`` weights: the bias entries matching pruned inputs belong to other output channels."""
    model = TinyGPT2()
    if layer == "ConvTranspose2d":
        model.model.transformer.h[0].attn.c_proj = nn.ConvTranspose2d(32, 32, 1)  # selected only, never run
    selected = CONV1D if layer == "Conv1D" else "torch.nn.ConvTranspose2d"
    callback = PruningCallback(0.5, method="ln_structured", prune_channel_bias=True, module_types=[selected])
    with pytest.raises(
        ValueError, match=rf"dim 0 of model\.transformer\.h\.0\.attn\.c_\w+\.weight \({layer}, .*inputs"
    ):
        trainer([callback], tmp_path, max_epochs=1).fit(model)
    assert not prune.is_pruned(model)


def test_default_selection_on_gpt2_warns_and_names_conv1d(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match=r"covers \d+% of the model's weights.*transformers\.pytorch_utils\.Conv1D"):
        trainer([PruningCallback(0.3)], tmp_path, max_epochs=1).fit(TinyGPT2())


# ----------------------------------------------------------------------------------------------------------------------
# BERT: default selection, load_from_checkpoint, resume
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_bert_prunes_exactly_and_resumes_bit_exact(tmp_path: Path) -> None:
    def run(root: Path, ckpt_path: Path | None = None) -> tuple[TinyBert, PruningCallback]:
        model = TinyBert()
        callback = PruningCallback(Linear(final=0.6, start=0, end=10, frequency=2), make_permanent=False)
        checkpoints = ModelCheckpoint(root, every_n_epochs=1, save_top_k=-1)
        trainer([callback, checkpoints], tmp_path, enable_checkpointing=True).fit(model, ckpt_path=ckpt_path)
        return model, callback

    model, callback = run(tmp_path / "a")
    linear = [model.get_parameter(name.replace(".weight", ".weight_orig")) for name in callback.selection]
    masks = [model.get_buffer(name + "_mask") for name in callback.selection]
    assert sum(int((~m).sum()) for m in masks) == round(0.6 * sum(p.numel() for p in linear))
    middle = tmp_path / "a" / "epoch=1-step=8.ckpt"
    loaded = TinyBert.load_from_checkpoint(middle)
    assert not prune.is_pruned(loaded)
    resumed, _ = run(tmp_path / "b", ckpt_path=middle)
    for key, value in folded(model.state_dict()).items():
        assert torch.equal(folded(resumed.state_dict())[key], value), key


# ----------------------------------------------------------------------------------------------------------------------
# T5: an encoder-decoder whose embedding is shared four ways (shared, encoder, decoder, lm_head)
# ----------------------------------------------------------------------------------------------------------------------


class TinyT5(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = transformers.T5Config(
            vocab_size=VOCAB,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=2,
            dropout_rate=0.0,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=1,
            tie_word_embeddings=True,
        )
        self.model = transformers.T5ForConditionalGeneration(config)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids.flip(1)).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return tokens()


def test_t5_shared_embedding_is_masked_in_all_four_owners(tmp_path: Path) -> None:
    model = TinyT5()
    callback = PruningCallback(Linear(final=0.5, start=0, end=6, frequency=2), make_permanent=False)
    seen: list[bool] = []

    class Spy(Callback):
        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
            t5 = pl_module.model
            owners = [t5.shared, t5.encoder.embed_tokens, t5.decoder.embed_tokens, t5.lm_head]
            masks = [owner._buffers.get("weight_mask") for owner in owners]
            if masks[0] is not None:  # after the first event: one mask object, one Parameter, in every owner
                seen.append(all(m is masks[0] for m in masks))
                seen.append(all(o.weight_orig is owners[0].weight_orig for o in owners))

    trainer([callback, Spy()], tmp_path).fit(model)
    assert seen and all(seen)
    t5 = model.model
    assert "model.lm_head.weight" in callback.selection  # the one Linear owner of the shared embedding, once
    assert not {"model.shared.weight", "model.encoder.embed_tokens.weight"} & set(callback.selection)
    selected = [model.get_parameter(n.replace(".weight", ".weight_orig")) for n in callback.selection]
    masks = [model.get_buffer(n + "_mask") for n in callback.selection]
    assert sum(int((~m).sum()) for m in masks) == round(0.5 * sum(p.numel() for p in selected))
    reparametrized = {k for k in t5.state_dict() if k.endswith("_orig")}
    assert {"shared.weight_orig", "lm_head.weight_orig"} <= reparametrized
    for qualified in [*callback.selection, "model.shared.weight", "model.encoder.embed_tokens.weight",
                      "model.decoder.embed_tokens.weight"]:  # fmt: skip
        module_name, name = qualified.rsplit(".", 1)
        module = model.get_submodule(module_name)
        if name + "_orig" in module._parameters:
            prune.remove(module, name)
    assert t5.lm_head.weight is t5.shared.weight is t5.encoder.embed_tokens.weight is t5.decoder.embed_tokens.weight


# ----------------------------------------------------------------------------------------------------------------------
# Layers built in configure_model
# ----------------------------------------------------------------------------------------------------------------------


class BuiltLate(TinyNet):
    """``TinyNet`` whose body is built in ``configure_model`` (Lightning calls it after ``Callback.setup``)."""

    def __init__(self, seed: int = 0, all_late: bool = False) -> None:
        super().__init__(seed)
        self.all_late = all_late
        self.stem = None if all_late else nn.Linear(8, 8)
        self.net = None  # type: ignore[assignment]

    def configure_model(self) -> None:
        if self.net is None:
            with torch.random.fork_rng():
                torch.manual_seed(0)
                self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 4))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x if self.stem is None else self.stem(x))


@pytest.mark.parametrize("all_late", [False, True], ids=["stem in __init__", "everything in configure_model"])
def test_layers_built_in_configure_model_are_selected_and_pruned(tmp_path: Path, all_late: bool) -> None:
    model = BuiltLate(all_late=all_late)
    callback = PruningCallback(0.5)
    trainer([callback], tmp_path, max_epochs=1).fit(model)
    expected = ["net.0.weight", "net.2.weight", "net.4.weight", *([] if all_late else ["stem.weight"])]
    assert callback.selection == expected
    weights = [model.get_parameter(name) for name in expected]
    assert sum(zeros(w) for w in weights) == round(0.5 * sum(w.numel() for w in weights))


# ----------------------------------------------------------------------------------------------------------------------
# Tied parameters in a plain model, and sharded parameters
# ----------------------------------------------------------------------------------------------------------------------


class Tied(TinyNet):
    """Two Linear layers holding the very same weight (``b.weight = a.weight``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.b.weight = self.a.weight

    def forward(self, x: Tensor) -> Tensor:
        return self.net(self.b(torch.relu(self.a(x))))


def test_a_weight_shared_by_two_linears_is_masked_in_both_and_counted_once(tmp_path: Path) -> None:
    model = Tied()
    callback = PruningCallback(0.5, make_permanent=False, scope="layerwise")
    trainer([callback], tmp_path, max_epochs=1).fit(model)
    assert "b.weight" not in callback.selection and "a.weight" in callback.selection
    assert model.a.weight_orig is model.b.weight_orig
    assert torch.equal(model.a.weight, model.b.weight)
    assert zeros(model.b.weight) == 32  # layerwise: half of the 64 entries, once
    x = next(iter(loader()))[0]
    plain = Tied()
    plain.load_state_dict(folded(model.state_dict()))
    assert torch.equal(plain(x), model(x))


def test_dtensor_parameters_are_refused_at_setup(tmp_path: Path) -> None:
    dist = pytest.importorskip("torch.distributed")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = TinyNet()
        mesh = init_device_mesh("cpu", (1,))
        model.net[2].weight = nn.Parameter(distribute_tensor(model.net[2].weight.detach(), mesh, [Replicate()]))
        with pytest.raises(ValueError, match=r"does not support parameters sharded as DTensor.*'net\.2\.weight'"):
            trainer([PruningCallback(0.5)], tmp_path, max_epochs=1).fit(model)
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------------------------------
# Saying what happened
# ----------------------------------------------------------------------------------------------------------------------


def test_fit_end_prints_a_summary_table(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        trainer([PruningCallback(0.5)], tmp_path, max_epochs=1).fit(TinyNet())
    (table,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("PruningCallback: pruned")]
    lines = table.splitlines()
    assert re.fullmatch(r"parameter +shape +kept / total weights +sparsity", lines[1])
    assert re.fullmatch(r"net\.0\.weight +16x8 +\d+ / 128 +\d+\.\d\d%", lines[3])
    assert re.fullmatch(r"total +184 / 368 +50\.00%", lines[-1])


def pruned_units(weight: Tensor, structured: bool) -> int:
    """Zero entries of a plain weight, or its all-zero output channels (dim 0): counted apart from the callback."""
    if structured:
        return int((weight.detach().flatten(1).count_nonzero(dim=1) == 0).sum())
    return zeros(weight.detach())


@pytest.mark.parametrize(
    ("model_class", "options"),
    [(TinyBert, {}), (TinyBert, {"method": "ln_structured"}), (TinyNet, {"masking": "inplace"})],
    ids=["bert-global-l1", "bert-ln-structured", "tinynet-inplace"],
)
def test_summary_table_after_a_permanent_fit_is_the_one_printed_at_fit_end(
    model_class: type[L.LightningModule], options: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    callback = PruningCallback(Linear(final=0.6, start=0, end=2, frequency=1), make_permanent=True, **options)
    model = model_class()
    with caplog.at_level(logging.INFO):
        trainer([callback], max_steps=3).fit(model)
    (printed,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("PruningCallback: pruned")]
    assert not prune.is_pruned(model)  # the masks are gone: the zeros are in the plain weights
    assert callback.summary_table() == printed
    rows = [line.split() for line in printed.splitlines()[3:-2]]
    assert [row[0] for row in rows] == callback.selection
    structured = "method" in options
    pruned = 0
    for qualified, _, kept, _, total, _ in rows:
        units = int(total.replace(",", ""))
        assert units - int(kept.replace(",", "")) == pruned_units(model.get_parameter(qualified), structured)
        pruned += units - int(kept.replace(",", ""))
    if not structured:  # global: the exact count of the final target, in the plain weights
        assert pruned == round(0.6 * sum(model.get_parameter(q).numel() for q in callback.selection))


class StopAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


def test_fit_ending_before_the_last_event_warns_with_reached_and_final(tmp_path: Path) -> None:
    callback = PruningCallback(Linear(final=0.8, start=0, end=16, frequency=4))
    with pytest.warns(
        UserWarning,
        match=r"at step 9, before the schedule's last event at step 16: sparsity reached 0\.\d+, scheduled final "
        r"sparsity 0\.8000",
    ):
        trainer([callback, StopAt(9)], tmp_path).fit(TinyNet())


def test_early_stopping_warns_too(tmp_path: Path) -> None:
    class Net(TinyNet):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val_loss", torch.tensor(1.0))  # never improves

    callback = PruningCallback(Linear(final=0.8, start=0, end=40, frequency=8))
    stop = EarlyStopping("val_loss", patience=0)
    with pytest.warns(UserWarning, match=r"scheduled final sparsity 0\.8000"):
        trainer([callback, stop], tmp_path, max_epochs=10).fit(Net(), val_dataloaders=loader(16))


class ZerosAtValidation(Callback):
    """The zeros of the model's weights at the end of each validation (what EarlyStopping and checkpoints saw)."""

    def __init__(self) -> None:
        self.zeros: list[int] = []

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.zeros.append(sum(int((w == 0).sum()) for w in folded(pl_module.state_dict()).values()))


@pytest.mark.parametrize(
    ("unit", "schedule"),
    [
        ("epoch", Linear(final=0.8, start=0, end=8, frequency=1)),
        ("step", Linear(final=0.8, start=0, end=64, frequency=8)),
    ],
)
def test_early_stopping_returns_the_model_it_trained_and_validated_last(
    tmp_path: Path, unit: str, schedule: Linear
) -> None:
    class Net(TinyNet):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val_loss", torch.tensor(1.0))  # never improves: stops after the second epoch

    callback = PruningCallback(schedule, unit=unit, summary=False)
    seen = ZerosAtValidation()
    model = Net()
    with pytest.warns(UserWarning, match=r"sparsity reached (0\.\d+)") as caught:
        fit = trainer([callback, EarlyStopping("val_loss", patience=0), seen], tmp_path, max_epochs=10)
        fit.fit(model, val_dataloaders=loader(16))
    assert fit.current_epoch == 2 and len(seen.zeros) == 2  # one validation an epoch
    returned = sum(int((w == 0).sum()) for w in folded(model.state_dict()).values())
    assert returned == seen.zeros[-1] > seen.zeros[-2]  # no event after the last training step
    (reached,) = [float(m) for w in caught for m in re.findall(r"sparsity reached (0\.\d+)", str(w.message))]
    assert reached == pytest.approx(returned / 368, abs=1e-4)


class ZerosAfterBatch(Callback):
    """The zeros of the model's weights after each training batch (placed after the PruningCallback)."""

    def __init__(self) -> None:
        self.zeros: list[int] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.zeros.append(sum(int((w == 0).sum()) for w in folded(pl_module.state_dict()).values()))


@pytest.mark.parametrize("stop", ["max_steps", "should_stop"])
def test_an_epoch_stopped_partway_is_not_completed_on_the_epoch_clock(tmp_path: Path, stop: str) -> None:
    # 8 batches an epoch, stopped after step 20 (4 batches into epoch 2): Lightning's current_epoch reads 3 at the end
    schedule = Linear(final=0.5, start=0, end=4, frequency=1)  # events when epochs 0, 1, 2, 3 start, and at epoch 4
    callback = PruningCallback(schedule, unit="epoch", summary=False)
    after = ZerosAfterBatch()
    options: dict[str, Any] = {"max_steps": 20} if stop == "max_steps" else {}
    extra = [] if stop == "max_steps" else [StopAt(20)]
    model = TinyNet()
    with pytest.warns(UserWarning, match=r"fit ended at epoch 2, before the schedule's last event at epoch 4"):
        trainer([callback, after, *extra], tmp_path, max_epochs=4, **options).fit(model)
    returned = sum(int((w == 0).sum()) for w in folded(model.state_dict()).values())
    assert len(after.zeros) == 20
    assert returned == after.zeros[-1] == round(schedule.target(2) * 368)  # no event after the last step


def test_two_callbacks_need_distinct_names_for_their_logged_keys(tmp_path: Path) -> None:
    first = PruningCallback(0.5, include=r"net\.0\.weight")
    second = PruningCallback(0.5, include=r"net\.2\.weight")
    with pytest.raises(ValueError, match=r"would log to the same keys pruning/\.\.\.: give each a distinct name="):
        trainer([first, second], tmp_path, max_epochs=1).fit(TinyNet())
    named = [
        PruningCallback(0.5, include=r"net\.0\.weight", name="a"),
        PruningCallback(0.5, name="b", include="net.2.weight"),
    ]
    logger = L.pytorch.loggers.CSVLogger(tmp_path, name="csv", version=0)
    trainer(named, tmp_path, max_epochs=1, logger=logger).fit(TinyNet())
    header = (tmp_path / "csv" / "version_0" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"pruning/a/sparsity/total", "pruning/b/sparsity/total", "pruning/a/target", "pruning/b/target"} <= set(
        header
    )
    assert named[0].state_key != named[1].state_key


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"include": "net.(0"}, r"include pattern 'net\.\(0' is not a valid regular expression"),
        ({"exclude": ["ok", "["]}, r"exclude pattern '\[' is not a valid regular expression"),
        ({"module_types": ["transformers.pytorch_utils.Conv2D"]}, r"module_types entry .*Conv2D' cannot be imported"),
        ({"module_types": ["torch.optim.SGD"]}, r"'torch\.optim\.SGD' is not an nn\.Module subclass"),
        ({"name": ""}, r"name='' must be None or a non-empty str"),
    ],
)
def test_bad_patterns_types_and_names_fail_at_construction(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PruningCallback(0.5, **kwargs)


def test_state_key_comes_from_constructor_arguments_and_name() -> None:
    assert PruningCallback(0.5).state_key == PruningCallback(0.9).state_key  # the schedule is not part of it
    assert PruningCallback(0.5, include="a.*").state_key != PruningCallback(0.5, include="b.*").state_key
    assert PruningCallback(0.5, name="enc", include="a.*").state_key == PruningCallback(0.5, name="enc").state_key
    callback = PruningCallback(0.5, include="a.*")
    assert callback.state_key is callback.state_key  # built once: Lightning reads it at every hook it calls


# ----------------------------------------------------------------------------------------------------------------------
# A model left under the reparametrization by the callback traces and exports
# ----------------------------------------------------------------------------------------------------------------------


def test_a_model_pruned_by_the_callback_exports_traces_and_compiles(tmp_path: Path) -> None:
    model = TinyNet()
    trainer([PruningCallback(Cubic(final=0.6, start=0, end=8, frequency=2), make_permanent=False)], tmp_path).fit(model)
    assert prune.is_pruned(model)
    model.eval()
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(x)
        exported = torch.export.export(model, (torch.randn(5, 8),))
        assert torch.equal(exported.module()(x), expected)
        traced = torch.jit.trace(model, (torch.randn(5, 8),))
        assert torch.equal(traced(x), expected)
        compiled = torch.compile(model, fullgraph=True, backend="eager")
        assert torch.equal(compiled(x), expected)
