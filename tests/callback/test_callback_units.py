"""``PruningCallback(method="neurons" | "heads")`` on tiny Hugging Face transformers built from configs.

After every event each unit group (an MLP's neurons, an attention's heads or key/value groups) must be pruned by whole
units, exactly ``round(target * count)`` of them (layerwise) or of all groups of the kind together (global), read
back from the masks themselves; a fit resumed from a checkpoint must end with the uninterrupted fit's weights; the
least-squares refit must bring the pruned model closer to the dense one; what cannot work is refused by name.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightprune.callback import PruningCallback
from lightprune.schedules import Constant, Cubic
from lightprune.structure import UnitError
from tiny_lightning import ResumableBatches

transformers = pytest.importorskip("transformers")

VOCAB = 64


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "bert":
        config = transformers.BertConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=24
        )
        return transformers.BertModel(config)
    if name == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_inner=24)
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
        intermediate_size=24,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


class Lit(L.LightningModule):
    """A transformer trained to shrink its outputs' log-sum-exp (any loss reaching every unit serves)."""

    def __init__(self, name: str, lr: float = 0.05) -> None:
        super().__init__()
        self.model, self.lr = build(name), lr

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=input_ids)
        return out.last_hidden_state if hasattr(out, "last_hidden_state") else out.logits

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).float().logsumexp(-1).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def data(batches: int = 4) -> DataLoader:
    ids = torch.randint(0, VOCAB, (4 * batches, 6), generator=torch.Generator().manual_seed(1))
    return DataLoader(TensorDataset(ids), batch_size=4)


def trainer(callbacks: list[Callback], **kwargs: Any) -> L.Trainer:
    options = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    options.update(kwargs)
    return L.Trainer(callbacks=callbacks, **options)


def unit_states(callback: PruningCallback) -> list[tuple[str, torch.Tensor]]:
    """Each group's kept units read from the masks of all its slices; a unit cut across its slices fails here."""
    masked = callback._masked
    found = []
    for group in masked.groups:
        keeps = []
        for piece in group.slices:
            module = masked.model.get_submodule(piece.module)
            mask = module._buffers.get(f"{piece.name}_mask")  # torch's reparametrization: name_orig * name_mask
            if mask is None:
                mask = torch.ones_like(getattr(module, piece.name), dtype=torch.bool)
            block = mask.narrow(piece.dim, piece.offset, group.count * piece.per_unit).movedim(piece.dim, 0)
            block = block.reshape(group.count, -1).bool()
            assert bool((block.all(1) | ~block.any(1)).all()), f"a unit of {piece.module}.{piece.name} is cut apart"
            keeps.append(block.all(1))
        for keep in keeps[1:]:
            assert torch.equal(keep, keeps[0]), f"the slices of {group.module} disagree on the kept units"
        found.append((group.module, keeps[0]))
    return found


class Record(Callback):
    """After each batch (after the pruning callback), the target and every group's kept units."""

    def __init__(self, pruning: PruningCallback) -> None:
        self.pruning, self.seen = pruning, []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        target = self.pruning._timeline.resolved.target(trainer.global_step)
        self.seen.append((target, unit_states(self.pruning)))


CASES = [
    ("bert", "neurons", "layerwise", "magnitude"),
    ("bert", "heads", "global", "activation"),
    ("gpt2", "heads", "layerwise", "movement"),
    ("gpt2", "neurons", "global", "magnitude"),
    ("llama", "heads", "layerwise", "activation"),
    ("llama", "neurons", "layerwise", "movement"),
]


@pytest.mark.parametrize(("model", "method", "scope", "importance"), CASES)
def test_every_event_prunes_whole_units_to_the_exact_count(
    model: str, method: str, scope: str, importance: str
) -> None:
    pruning = PruningCallback(
        Cubic(final=0.75, start=1, end=4, frequency=1), method=method, scope=scope, importance=importance,
        reconstruct=importance == "activation",
    )  # fmt: skip
    record = Record(pruning)
    trainer([pruning, record], max_steps=4).fit(Lit(model), data())
    assert [g.kind for g in pruning._masked.groups] == [method] * 2
    targets = set()
    for target, states in record.seen:
        counts = [int((~keep).sum()) for _, keep in states]
        sizes = [keep.numel() for _, keep in states]
        if scope == "layerwise":
            assert counts == [round(target * size) for size in sizes]
        else:
            assert sum(counts) == round(target * sum(sizes)) and all(c < s for c, s in zip(counts, sizes, strict=True))
        targets.add(target)
    assert len(targets) >= 3  # several events, each checked


def test_llama_heads_are_whole_key_value_groups() -> None:
    pruning = PruningCallback(0.5, method="heads")
    trainer([pruning], max_steps=1).fit(Lit("llama"), data())
    group = pruning._masked.groups[0]
    assert (group.count, group.heads_per_unit) == (4, 2)  # 4 key/value heads, each read by 2 query heads
    kept = int(group.count - pruning._masked.counts()[0][1])
    attention = pruning._masked.model.get_submodule(group.module)
    assert int((attention.k_proj.weight != 0).any(1).sum()) == kept * 4  # head_dim 4
    assert int((attention.q_proj.weight != 0).any(1).sum()) == kept * 2 * 4


def test_refit_brings_the_pruned_model_closer_to_the_dense_one() -> None:
    batches = data(2)
    errors = {}
    for reconstruct in (False, True):
        module = Lit("llama", lr=0.0)
        with torch.no_grad():
            dense = [module(batch[0]) for batch in batches]
        pruning = PruningCallback(
            0.5, method="neurons", importance="activation", reconstruct=reconstruct, calibration_batches=2
        )
        trainer([pruning], max_steps=1, limit_train_batches=1).fit(module, batches)
        with torch.no_grad():
            pairs = zip(batches, dense, strict=True)
            errors[reconstruct] = sum(float((module(b[0]) - d).square().mean()) for b, d in pairs)
    assert errors[True] < 0.9 * errors[False]


def masks_and_weights(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in module.state_dict().items()}


@pytest.mark.parametrize("importance", ["activation", "magnitude"])  # the refit's moments, whatever ranks
def test_resume_from_a_checkpoint_is_exact(tmp_path: Any, importance: str) -> None:
    def run(ckpt: str | None, save: bool) -> dict[str, torch.Tensor]:
        pruning = PruningCallback(
            Cubic(final=0.5, start=0, end=4, frequency=4), method="neurons", importance=importance,
            reconstruct=True, activation_window=3,  # the window (steps 1-3) spans the checkpoint (after step 3)
        )  # fmt: skip
        callbacks: list[Callback] = [pruning]
        if save:
            callbacks.append(ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1, save_top_k=-1))
        module = Lit("llama")
        trainer(callbacks, max_epochs=2, enable_checkpointing=save).fit(module, data(3), ckpt_path=ckpt)
        return masks_and_weights(module)

    whole = run(None, save=True)
    first = sorted(tmp_path.glob("epoch=0*.ckpt"))[0]
    resumed = run(str(first), save=False)
    assert whole.keys() == resumed.keys()
    for name in whole:
        torch.testing.assert_close(resumed[name], whole[name], rtol=0, atol=0, msg=name)


class SeenBatches(Callback):
    """The first input id of every training batch, with the step it trained: which data each step saw."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, i: int) -> None:
        self.seen.append((trainer.global_step, int(batch[0][0, 0])))


@pytest.mark.parametrize("example_inputs", [None, "fixed"])
def test_a_fit_resumed_mid_epoch_finds_its_units_without_using_up_the_loaders_position(
    tmp_path: Any, example_inputs: str | None
) -> None:
    """Units are found on a training batch; resumed mid-epoch from a resumable loader, the fit must still train on
    the batches the uninterrupted fit trained on, and end with its masks and weights."""
    fixed = (data(1).dataset.tensors[0][:2],) if example_inputs else None

    def run(ckpt: str | None, save: bool) -> tuple[dict[str, torch.Tensor], list[tuple[int, int]]]:
        pruning = PruningCallback(
            Cubic(final=0.5, start=0, end=6, frequency=2), method="neurons", example_inputs=fixed, summary=False
        )
        seen = SeenBatches()
        callbacks: list[Callback] = [pruning, seen]
        if save:
            callbacks.append(ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1))
        module = Lit("llama")  # (no dropout: Lightning does not restore the random generators)
        batches = ResumableBatches(data(4))
        trainer(callbacks, max_epochs=2, enable_checkpointing=save).fit(module, batches, ckpt_path=ckpt)
        return masks_and_weights(module), seen.seen

    whole, seen_whole = run(None, save=True)
    (middle,) = tmp_path.glob("epoch=0-step=3.ckpt")  # after the 3rd of 4 batches of epoch 0
    resumed, seen_resumed = run(str(middle), save=False)
    assert seen_resumed == seen_whole[3:]  # the same batches after the checkpoint
    assert whole.keys() == resumed.keys()
    for name in whole:
        torch.testing.assert_close(resumed[name], whole[name], rtol=0, atol=0, msg=name)


def test_a_resumed_unit_search_does_not_count_in_another_callbacks_statistics(tmp_path: Any) -> None:
    """Resumed, a unit callback finds its units on the first training batch, when another callback's statistics
    hooks are attached for that batch: the search's trace must not add to them (the refit's token count would)."""

    def run(ckpt: str | None, save: bool) -> dict[str, torch.Tensor]:
        schedule = Cubic(final=0.5, start=2, end=10, frequency=2)
        callbacks: list[Callback] = [
            PruningCallback(schedule, method="neurons", importance="activation", reconstruct=True, activation_window=2,
                            name="neurons", summary=False),
            PruningCallback(schedule, method="heads", name="heads", summary=False),
        ]  # fmt: skip
        if save:
            callbacks.append(ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1, save_top_k=-1))
        module = Lit("gpt2")  # biases: the refit's mean of the inputs reaches the weights
        for layer in module.modules():
            if isinstance(layer, nn.Dropout):
                layer.p = 0.0  # (Lightning does not restore the random generators)
        trainer(callbacks, max_epochs=3, enable_checkpointing=save).fit(module, data(4), ckpt_path=ckpt)
        return masks_and_weights(module)

    whole = run(None, save=True)
    (first,) = tmp_path.glob("epoch=0-*.ckpt")
    resumed = run(str(first), save=False)
    for name in whole:
        torch.testing.assert_close(resumed[name], whole[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(("method", "scope", "message"), [
    ("heads", "layerwise", r"final target 1\.0: amount=1\.0 prunes all 4 heads of 'model\.model\.layers\.0\."),
    ("neurons", "global", r"final target 0\.99: amount=0\.99 prunes 48 of 48 units; every group must keep"),
])  # fmt: skip
def test_a_final_target_that_empties_a_group_is_refused_before_training(method: str, scope: str, message: str) -> None:
    final = 1.0 if scope == "layerwise" else 0.99
    callback = PruningCallback(Cubic(final=final, start=4, end=8, frequency=2), method=method, scope=scope)
    fit = trainer([callback], max_steps=10)
    with pytest.raises(ValueError, match=message):
        fit.fit(Lit("llama"), data(4))
    assert fit.global_step == 0


class NoUnits(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_model_without_the_units_is_refused_naming_it() -> None:
    loader = DataLoader(TensorDataset(torch.randn(8, 6)), batch_size=4)
    with pytest.raises(UnitError, match="found no neurons in NoUnits"):
        trainer([PruningCallback(0.5, method="neurons")], max_steps=1).fit(NoUnits(), loader)
    with pytest.raises(UnitError, match="include/exclude leave none of the heads groups"):
        trainer([PruningCallback(0.5, method="heads", include="nothing")], max_steps=1).fit(Lit("bert"), data())


class TorchEncoder(NoUnits):
    """torch's own encoder layer: its MultiheadAttention computes with ``out_proj.weight`` without calling it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=24, dropout=0.0, batch_first=True)


@pytest.mark.parametrize(
    ("kwargs", "reader"),
    [
        ({"importance": "activation"}, "importance='activation'"),
        ({"reconstruct": True}, "reconstruct=True"),
        ({"importance": "activation", "reconstruct": True}, "importance='activation'"),
    ],
)
def test_heads_of_a_multihead_attention_are_not_ranked_or_refit_on_inputs_never_recorded(
    kwargs: dict[str, Any], reader: str
) -> None:
    """Before, the statistics of ``out_proj`` stayed empty: every activation score was 0 (heads pruned by index) and
    the refit solved to a zero ``out_proj``, the kept heads' columns too, with no word."""
    loader = DataLoader(TensorDataset(torch.randn(8, 5, 16)), batch_size=4)
    model = TorchEncoder()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    fit = trainer([PruningCallback(Constant(0.5, at=2), method="heads", **kwargs)], max_steps=4)
    with pytest.raises(ValueError, match=rf"{re.escape(reader)} records each layer's inputs .* \['layer.self_attn"):
        fit.fit(model, loader)
    assert fit.global_step == 0 and all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    # ranked by magnitude, without a refit, the heads prune (out_proj's columns of two heads); torch's attention
    # derives its head size from embed_dim, so they cannot be removed, which setup says
    fit = trainer([PruningCallback(Constant(0.5, at=2), method="heads", make_permanent=False)], max_steps=4)
    removal = r"heads of \['layer.self_attn'\] \(1 of 1 groups\) can be masked but not removed: .*MultiheadAttention"
    with pytest.warns(UserWarning, match=removal):
        fit.fit(TorchEncoder(), loader)
    assert fit.global_step == 4


def test_heads_that_can_be_masked_but_not_removed_are_said_at_setup() -> None:
    """T5's heads get a relative position bias from outside their projections: masked exactly, but remove_units
    refuses them. The user learned that only after training; the setup says it now (and not for BERT's heads)."""
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=24, num_layers=2, num_heads=4, decoder_start_token_id=0
    )
    torch.manual_seed(0)

    class T5Encoder(Lit):
        def __init__(self) -> None:
            L.LightningModule.__init__(self)
            self.model, self.lr = transformers.T5EncoderModel(config), 0.05

    with pytest.warns(UserWarning, match=r"heads of .*SelfAttention.* can be masked but not removed: .*position bias"):
        trainer([PruningCallback(0.5, method="heads")], max_steps=1).fit(T5Encoder(), data(1))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*can be masked but not removed")
        trainer([PruningCallback(0.5, method="heads")], max_steps=1).fit(Lit("bert"), data(1))


@pytest.mark.parametrize("pattern", [r".*layer\.0\..*", r"model\.encoder\.layer\.0\.intermediate\.dense\.weight"])
def test_unit_patterns_match_a_groups_tensors_too_and_one_matching_nothing_is_warned(pattern: str) -> None:
    """The pattern that keeps layer 0 dense for the other methods keeps its neurons too (the group is named after
    the layer, ``model.encoder.layer.0``, which a tensor pattern does not match in full)."""
    callback = PruningCallback(0.5, method="neurons", exclude=pattern)
    trainer([callback], max_steps=1).fit(Lit("bert"), data())
    kept = dict(unit_states(callback))
    assert list(kept) == ["model.encoder.layer.1"]
    with pytest.warns(UserWarning, match=r"exclude pattern 'no_such_module' matches none of the neurons groups"):
        trainer([PruningCallback(0.5, method="neurons", exclude="no_such_module")], max_steps=1).fit(
            Lit("bert"), data()
        )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"masking": "inplace"}, "masking='inplace' is not supported with method='neurons'"),
        ({"max_layer_sparsity": 0.5}, "max_layer_sparsity=0.5 is not supported with method='neurons'"),
        ({"parameters": []}, "parameters='\\[...\\]' is not supported with method='neurons'"),
        ({"scope": "row"}, "scope='row': neurons ranks whole units"),
        ({"method_kwargs": {"dim": 0}}, "takes no method_kwargs"),
        ({"prune_channel_bias": True}, "prune_channel_bias=True: neurons prunes the units' biases already"),
        ({"importance": "gradient"}, "importance='gradient' is not supported"),
        (
            {"calibration_batches": 2},
            "calibration_batches=2: collects input statistics, which only importance=activation .* reconstruct=True",
        ),
    ],
)
def test_options_units_cannot_take_are_refused_by_name(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PruningCallback(0.5, method="neurons", **kwargs)


def test_reconstruct_without_units_is_obs_s_and_the_refit_needs_statistics_at_step_zero() -> None:
    with pytest.raises(ValueError, match="reconstruct=True: updates the kept weights by OBS: needs importance=obs"):
        PruningCallback(0.5, method="l1_unstructured", reconstruct=True)
    with pytest.raises(ValueError, match="reconstruct=True refits from input statistics"):
        trainer([PruningCallback(0.5, method="neurons", reconstruct=True)], max_steps=1).fit(Lit("bert"), data())


class DictBatches(Lit):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch["input_ids"]).float().logsumexp(-1).mean()


def test_a_dict_batch_the_forward_cannot_take_is_named_with_the_way_out() -> None:
    samples = [{"input_ids": ids, "attention_mask": torch.ones_like(ids)} for (ids,) in data().dataset]
    batches = DataLoader(samples, batch_size=4)  # dict batches
    keys = r"the training batch's keys \['attention_mask', 'input_ids'\] passed to DictBatches"
    with pytest.raises(UnitError, match=keys):
        trainer([PruningCallback(0.5, method="neurons")], max_steps=1).fit(DictBatches("bert"), batches)
    callback = PruningCallback(0.5, method="neurons", example_inputs=lambda batch: {"input_ids": batch["input_ids"]})
    trainer([callback], max_steps=1).fit(DictBatches("bert"), batches)  # the way out the message names
    assert len(unit_states(callback)) == 2


@pytest.mark.parametrize(
    "pair",
    [
        [{"method": "neurons"}, {"include": r".*intermediate\.dense\.weight", "name": "mlp"}],
        [{"include": r".*intermediate\.dense\.weight", "name": "mlp"}, {"method": "neurons"}],
        [{"method": "neurons"}, {"method": "neurons", "name": "again"}],
    ],
)
def test_a_unit_callback_overlapping_another_is_refused_before_training(pair: list[dict[str, Any]]) -> None:
    """Both masks stacked on the same tensors, and the unstructured callback's exact count was missed."""
    callbacks = [PruningCallback(Constant(0.5, at=2), **kwargs) for kwargs in pair]
    fit = trainer(callbacks, max_steps=3)
    with pytest.raises(ValueError, match=r"two PruningCallbacks select the same parameters \[.*intermediate\.dense"):
        fit.fit(Lit("bert"), data())
    assert fit.global_step == 0


def test_heads_and_neurons_in_two_callbacks_prune_side_by_side() -> None:
    heads, neurons = (PruningCallback(Constant(0.5, at=2), method=m, name=m) for m in ("heads", "neurons"))
    fit = trainer([heads, neurons], max_steps=3)
    fit.fit(Lit("bert"), data())
    assert fit.global_step == 3
