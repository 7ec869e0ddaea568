"""``PruningCallback`` on models fine-tuned with LoRA (PEFT, built from configs: BERT, GPT-2's ``Conv1D``, Llama).

The effective weight a LoRA layer computes with is read from its forward (the layer applied to the identity matrix),
independently of lightprune's code; the masks from the callback's checkpoint state. At every step the effective
weight must be an exact zero wherever the base weight is pruned, while the adapter's unmasked update is not.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightprune import prune
from lightprune.adapters import AdaptedWeight
from lightprune.callback import PruningCallback
from lightprune.export import merge_lora
from lightprune.schedules import Constant, Linear
from tiny_lightning import folded, quiet_trainer

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

pytestmark = [
    pytest.mark.usefixtures("one_thread_for_module"),
    pytest.mark.filterwarnings("ignore:.*must be `None` or an integer within the vocabulary.*"),
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:PruningCallback. the default selection.*:UserWarning"),
]

VOCAB, SEQ = 64, 8


def tokens(samples: int = 32, seed: int = 0) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(torch.randint(0, VOCAB, (samples, SEQ), generator=generator)), batch_size=8)


def build(kind: str, dtype: torch.dtype = torch.float32, **lora: Any) -> nn.Module:
    """A tiny transformers model of ``kind`` (its weights in ``dtype``) wrapped by PEFT's LoRA (r=4) on its attention
    projections; PEFT keeps the adapters in float32."""
    torch.manual_seed(0)
    if kind == "bert":
        config = transformers.BertConfig(
            vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
            max_position_embeddings=SEQ, num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )  # fmt: skip
        model = transformers.BertForSequenceClassification(config)
        options = {"target_modules": ["query", "value"], "task_type": "SEQ_CLS"}
    elif kind == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(config)
        options = {"target_modules": ["c_attn"], "fan_in_fan_out": True, "task_type": "CAUSAL_LM"}
    else:
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(config)
        options = {"target_modules": ["q_proj", "v_proj", "o_proj"], "task_type": "CAUSAL_LM"}
    return peft.get_peft_model(model.to(dtype), peft.LoraConfig(**{"r": 4, "lora_alpha": 8, **options, **lora}))


INCLUDE = {
    "bert": r".*(query|value)\.base_layer\.weight",
    "gpt2": r".*c_attn\.base_layer\.weight",
    "llama": r".*(q_proj|v_proj|o_proj)\.base_layer\.weight",
}
CONV1D = "transformers.pytorch_utils.Conv1D"


class Lora(L.LightningModule):
    """A PEFT model trained on random tokens: sequence classification (BERT) or causal LM; AdamW on the adapters."""

    def __init__(self, kind: str, lr: float = 2e-2, **lora: Any) -> None:
        super().__init__()
        self.kind = kind
        self.model = build(kind, **lora)
        self.lr = lr

    def forward(self, ids: Tensor) -> Tensor:
        return self.model(input_ids=ids).logits

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        (ids,) = batch
        labels = ids[:, 0] % 2 if self.kind == "bert" else ids
        return self.model(input_ids=ids, labels=labels).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        return tokens()


def callback_for(kind: str, schedule: Any = None, **options: Any) -> PruningCallback:
    types = {"module_types": [nn.Linear, CONV1D]} if kind == "gpt2" else {}
    schedule = Linear(final=0.6, start=0, end=4, frequency=2) if schedule is None else schedule
    return PruningCallback(schedule, **{"include": INCLUDE[kind], "summary": False, **types, **options})


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """PEFT's LoRA layers by the qualified name of their base weight (as the callback names it)."""
    return {
        f"{name}.base_layer.weight": module
        for name, module in model.named_modules()
        if isinstance(module, peft.tuners.lora.layer.Linear)
    }


@torch.no_grad()
def effective_from_forward(layer: nn.Module) -> Tensor:
    """The weight the layer's forward computes with, in its base weight's layout: the layer applied to the identity
    minus its bias (exact for an entry whose products are all zero)."""
    base = layer.get_base_layer()
    fan_in_fan_out = getattr(layer, "fan_in_fan_out", False)
    weight = prune.original(base, "weight")
    inputs = weight.shape[0] if fan_in_fan_out else weight.shape[1]
    training = layer.training
    out = layer.eval()(torch.eye(inputs))  # dropout off: its forward is then the update's own product
    layer.train(training)
    if base.bias is not None:
        out = out - base.bias
    return out if fan_in_fan_out else out.T


class Spy(Callback):
    """After every optimizer step (after the pruning callback): the masks, the effective weights read from the
    forward, and the unmasked updates ``s·B·A`` of every LoRA layer."""

    def __init__(self, pruning: PruningCallback) -> None:
        self.pruning = pruning
        self.steps: list[dict[str, tuple[Tensor, Tensor, Tensor]]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        masks = self.pruning.state_dict()["masks"]
        found = {}
        for qualified, layer in lora_layers(pl_module).items():
            mask = masks.get("model." + qualified if not qualified.startswith("model.") else qualified)
            if mask is None:
                continue
            update = sum(layer.get_delta_weight(name) for name in layer.active_adapters).detach()
            found[qualified] = (mask.clone(), effective_from_forward(layer), update)
        self.steps.append(found)


def lora_keys(masks: dict[str, Tensor], model: nn.Module) -> list[str]:
    return [key for key in masks if key.removeprefix("model.") in lora_layers(model)]


@pytest.mark.parametrize(
    ("kind", "masking", "accumulate", "dropout"),
    [
        ("bert", "reparametrize", 1, 0.0),
        ("gpt2", "inplace", 2, 0.0),
        ("llama", "reparametrize", 2, 0.1),  # dropout: the base's product and the masked update's, added
        ("llama", "inplace", 1, 0.0),
    ],
)
def test_effective_weight_is_zero_where_pruned_at_every_step_and_the_merge_is_exact(
    kind: str, masking: str, accumulate: int, dropout: float
) -> None:
    module = Lora(kind, lora_dropout=dropout)
    pruning = callback_for(kind, masking=masking)
    spy = Spy(pruning)
    quiet_trainer([pruning, spy], max_steps=6, accumulate_grad_batches=accumulate).fit(module)
    assert len(spy.steps) == 6 * accumulate
    assert sum(1 for step in spy.steps if step) >= 4 * accumulate  # pruned from step 2 on (step 0's level is 0)
    events_seen = set()
    for step in spy.steps:
        for qualified, (mask, effective, _) in step.items():
            pruned = ~mask.bool()
            events_seen.add(int(pruned.sum()))
            assert bool((effective[pruned] == 0).all()), qualified
            assert bool(effective[~pruned].ne(0).all()), qualified
    assert len(events_seen) >= 2  # the masks grew during the run
    last = spy.steps[-1]
    assert any(float(update[~mask.bool()].abs().max()) > 1e-4 for mask, _, update in last.values())  # masked, not 0

    ids = next(iter(tokens(8, seed=5)))[0]
    module.eval()
    with torch.no_grad():
        unmerged = module(ids)
    merged = merge_lora(module.model)
    assert not any(isinstance(m, peft.tuners.tuners_utils.BaseTunerLayer) for m in merged.modules())
    with torch.no_grad():
        out = merged(input_ids=ids).logits
    assert float((out - unmerged).norm() / unmerged.norm()) <= 1e-5
    for qualified, (mask, effective, _) in last.items():
        weight = merged.get_parameter(qualified.removeprefix("model.").replace("base_model.model.", "", 1).replace(
            ".base_layer", ""))  # fmt: skip
        assert torch.equal(weight == 0, ~mask.bool()), qualified  # exactly as sparse as the mask says
        torch.testing.assert_close(weight, effective, rtol=1e-5, atol=1e-6)


def test_peft_merge_and_unload_stays_sparse_too_after_the_fit() -> None:
    module = Lora("bert")
    pruning = callback_for("bert", schedule=Constant(0.5, at=0))
    quiet_trainer([pruning], max_steps=8).fit(module)
    pruned = {_merged_name(q): layer.get_base_layer().weight == 0 for q, layer in lora_layers(module).items()}
    assert sum(int(zeros.sum()) for zeros in pruned.values()) == sum(zeros.numel() for zeros in pruned.values()) // 2
    merged = module.model.merge_and_unload()
    for name, zeros in pruned.items():
        assert torch.equal(merged.get_parameter(name) == 0, zeros), name


@pytest.mark.parametrize("safe_merge", [False, True])
def test_peft_merge_after_a_fit_that_kept_the_reparametrization_keeps_the_update(safe_merge: bool) -> None:
    """With ``make_permanent=False`` the base weight is recomputed from ``weight_orig`` at every forward: PEFT's merge
    and unmerge must reach that Parameter, or the merged model computes with the pruned base weight alone."""
    module = Lora("gpt2")
    quiet_trainer([callback_for("gpt2", schedule=Constant(0.5, at=0), make_permanent=False)], max_steps=6).fit(module)
    model = module.model.eval()
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        trained = model(input_ids=ids).logits
        with model.disable_adapter():
            assert not torch.allclose(model(input_ids=ids).logits, trained, atol=1e-4)  # the adapters matter
        model.merge_adapter(safe_merge=safe_merge)
        torch.testing.assert_close(model.base_model.model(input_ids=ids).logits, trained, rtol=1e-5, atol=1e-5)
        model.unmerge_adapter()
        torch.testing.assert_close(model(input_ids=ids).logits, trained, rtol=1e-5, atol=1e-5)
        merged = model.merge_and_unload(safe_merge=safe_merge)
        torch.testing.assert_close(merged(input_ids=ids).logits, trained, rtol=1e-5, atol=1e-5)


def test_a_bfloat16_base_with_float32_adapters_trains_and_stays_sparse() -> None:
    module = Lora("gpt2")
    module.model = build("gpt2", dtype=torch.bfloat16)
    layer = next(iter(lora_layers(module.model).values()))
    assert (
        layer.get_base_layer().weight.dtype == torch.bfloat16 and layer.lora_A["default"].weight.dtype == torch.float32
    )
    quiet_trainer([callback_for("gpt2", schedule=Constant(0.5, at=0))], max_steps=4).fit(module)
    weights = [prune.original(layer.get_base_layer(), "weight") for layer in lora_layers(module.model).values()]
    assert sum(int((w == 0).sum()) for w in weights) == sum(w.numel() for w in weights) // 2  # a global half


def test_the_frozen_copy_of_a_modules_to_save_layer_is_refused_and_its_trained_copy_prunes() -> None:
    module = Lora("gpt2", modules_to_save=["c_fc"])
    selected = {"module_types": [CONV1D], "exclude": [r".*lora_.*"], "summary": False}
    with pytest.raises(ValueError, match=r"c_fc\.original_module\.weight is the frozen copy PEFT keeps"):
        quiet_trainer([PruningCallback(Constant(0.5, at=0), **selected)], max_steps=1).fit(module)
    selected["exclude"] = [r".*lora_.*", r".*\.original_module\..*"]
    callback = PruningCallback(Constant(0.5, at=0), **selected)
    quiet_trainer([callback], max_steps=2).fit(module)
    assert any(".c_fc.modules_to_save.default.weight" in name for name in callback.selection)


def test_merge_during_training_leaves_the_training_model_alone() -> None:
    class MergeAt(Callback):
        def __init__(self) -> None:
            self.difference: float | None = None
            self.zeros: tuple[int, int] | None = None

        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
            if trainer.global_step != 3:
                return
            ids = next(iter(tokens(8, seed=7)))[0]
            with torch.no_grad():
                before = pl_module(ids)
                merged = merge_lora(pl_module.model)
                self.difference = float((merged(input_ids=ids).logits - before).norm() / before.norm())
            masks = pruning.state_dict()["masks"]
            self.zeros = (
                sum(int((~mask.bool()).sum()) for mask in masks.values()),
                sum(int((merged.get_parameter(_merged_name(k)) == 0).sum()) for k in masks),
            )

    module = Lora("llama")
    pruning = callback_for("llama", make_permanent=False)
    merge = MergeAt()
    quiet_trainer([pruning, merge], max_steps=5).fit(module)
    assert merge.difference is not None and merge.difference <= 1e-5
    assert merge.zeros is not None and merge.zeros[0] == merge.zeros[1] > 0
    # training went on with the model as it was: still adapted, still reparametrized
    assert lora_layers(module) and prune.is_pruned(next(iter(lora_layers(module).values())).get_base_layer())


def _merged_name(qualified: str) -> str:
    return qualified.removeprefix("model.base_model.model.").replace(".base_layer", "")


@pytest.mark.parametrize("importance", ["magnitude", "activation"])
def test_effective_weights_rank_at_events(importance: str) -> None:
    """One-shot magnitude and activation importance rank ``W + s·B·A``, as an independent top-k of it says."""
    module = Lora("bert", lr=0.0)
    torch.manual_seed(1)
    layers = lora_layers(module)
    with torch.no_grad():
        for layer in layers.values():
            layer.lora_B["default"].weight.normal_(std=1.0)  # an update as large as the weights
    expected = {}
    for qualified, layer in layers.items():
        effective = prune.original(layer.get_base_layer(), "weight") + layer.get_delta_weight("default")
        expected[qualified] = effective.detach().abs()
    if importance == "activation":  # |W_ij| * ||X_j||, X over the two calibration batches
        norms: dict[str, Tensor] = {}

        def record(qualified: str) -> Any:
            return lambda m, args: norms.__setitem__(qualified, norms.get(qualified, 0) + args[0].pow(2).sum((0, 1)))

        hooks = [layer.get_base_layer().register_forward_pre_hook(record(q)) for q, layer in layers.items()]
        with torch.no_grad():
            for (ids,) in list(tokens())[:2]:
                module(ids)
        for hook in hooks:
            hook.remove()
        expected = {q: e * norms[q].sqrt() for q, e in expected.items()}
    extra = {"calibration_batches": 2, "importance": "activation"} if importance == "activation" else {}
    pruning = callback_for("bert", schedule=Constant(0.5, at=0), scope="layerwise", make_permanent=False, **extra)
    quiet_trainer([pruning], max_steps=1).fit(module)
    masks = pruning.state_dict()["masks"]
    for qualified, scores in expected.items():
        keep = torch.zeros(scores.numel(), dtype=torch.bool)
        keep[scores.flatten().argsort(descending=True)[: scores.numel() // 2]] = True
        assert torch.equal(masks[qualified], keep.view_as(scores)), qualified


def test_resume_is_exact(tmp_path: Path) -> None:
    def run(root: Path, ckpt_path: Path | None = None) -> Lora:
        module = Lora("gpt2")
        pruning = callback_for("gpt2", schedule=Linear(final=0.6, start=0, end=6, frequency=2), make_permanent=False)
        checkpoints = ModelCheckpoint(root, every_n_epochs=1, save_top_k=-1)  # 4 steps an epoch
        quiet_trainer(
            [pruning, checkpoints], max_epochs=2, enable_checkpointing=True, default_root_dir=root
        ).fit(module, ckpt_path=ckpt_path)  # fmt: skip
        return module

    whole = run(tmp_path / "a")
    resumed = run(tmp_path / "b", ckpt_path=tmp_path / "a" / "epoch=0-step=4.ckpt")
    for key, value in folded(whole.state_dict()).items():  # the checkpoint holds the masked weights, not orig
        assert torch.equal(folded(resumed.state_dict())[key], value), key
    for qualified, layer in lora_layers(whole).items():
        assert torch.equal(effective_from_forward(layer), effective_from_forward(lora_layers(resumed)[qualified]))


# ----------------------------------------------------------------------------------------------------------------------
# What the callback refuses at setup, by name
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("lora", "options", "message"),
    [
        ({}, {"include": r".*query\.lora_A\.default\.weight"}, r"lora_A\.default\.weight is a tensor of the adapted"),
        (
            {"use_dora": True},
            {},
            r"query' uses the LoRA variant\(s\) \{'default': 'DoraLinearVariant'",
        ),
        ({"lora_bias": True}, {}, r"attention\.self\.query' has lora_bias=True"),
        ({}, {"importance": "movement", "schedule": Constant(0.5, at=2)}, "importance='movement' ranks by the"),
        ({}, {"importance": "obs", "calibration_batches": 1}, r"importance='obs' ranks and rebuilds .* base W alone"),
        (
            {"target_modules": ["query", "value", "word_embeddings"]},
            {"include": r".*(query\.base_layer|word_embeddings\.base_layer)\.weight", "module_types": None},
            r"word_embeddings' is a peft\.tuners\.lora\.layer\.Embedding",
        ),
    ],
)
def test_unsupported_adapters_are_refused_at_setup_by_name(lora: dict, options: dict, message: str) -> None:
    module = Lora("bert", **lora)
    pruning = callback_for("bert", **{"schedule": Constant(0.5, at=0), **options})
    trainer = quiet_trainer([pruning], max_steps=2)
    with pytest.raises(ValueError, match=message):
        trainer.fit(module)
    assert trainer.global_step == 0


def test_merged_adapters_are_refused_at_setup() -> None:
    module = Lora("bert")
    next(iter(lora_layers(module).values())).merge()
    with pytest.raises(ValueError, match=r"query' has merged adapters \(\['default'\]\): unmerge them first"):
        quiet_trainer([callback_for("bert")], max_steps=2).fit(module)


# ----------------------------------------------------------------------------------------------------------------------
# A plain module marked as adapted
# ----------------------------------------------------------------------------------------------------------------------


class Marked(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(AdaptedWeight(nn.Linear(8, 16), rank=2), nn.ReLU(), nn.Linear(16, 4))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=5e-2)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(1)
        x, y = torch.randn(64, 8, generator=generator), torch.randint(0, 4, (64,), generator=generator)
        return DataLoader(TensorDataset(x, y), batch_size=8)


@pytest.mark.parametrize("masking", ["reparametrize", "inplace"])
def test_a_marked_plain_module_keeps_its_sparsity_through_training_and_merge(masking: str) -> None:
    module = Marked()
    pruning = PruningCallback(
        Linear(final=0.5, start=0, end=4, frequency=2), include=r"net\.0\.base_layer\.weight", masking=masking,
        summary=False,
    )  # fmt: skip
    quiet_trainer([pruning], max_steps=8).fit(module)
    layer = module.net[0]
    mask = layer.base_layer.weight != 0  # the fit made the mask permanent: zeros
    assert int((~mask).sum()) == 64
    assert float(layer.delta_weight().detach()[~mask].abs().max()) > 1e-4  # trained, and masked
    x = torch.randn(5, 8)
    with torch.no_grad():
        expected = module.net(x)
    merged = merge_lora(module.net)
    assert isinstance(merged[0], nn.Linear) and torch.equal(merged[0].weight == 0, ~mask)
    torch.testing.assert_close(merged(x), expected, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------------------------------
# DDP: two gloo processes, each on its own shard of the data
# ----------------------------------------------------------------------------------------------------------------------

DDP_SCRIPT = textwrap.dedent(
    """
    import atexit
    import sys
    from pathlib import Path

    import lightning as L
    import peft
    import torch
    import transformers
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader, TensorDataset

    from lightprune.callback import PruningCallback
    from lightprune.schedules import Linear

    out = Path(sys.argv[1])
    masking = sys.argv[2]
    torch.set_num_threads(1)
    atexit.register(lambda: torch.distributed.is_initialized() and torch.distributed.destroy_process_group())


    class Lora(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            config = transformers.LlamaConfig(
                vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=8, bos_token_id=0, eos_token_id=0, pad_token_id=0,
            )
            lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
            self.model = peft.get_peft_model(transformers.LlamaForCausalLM(config), lora)

        def training_step(self, batch, batch_idx):
            (ids,) = batch
            return self.model(input_ids=ids, labels=ids).loss

        def configure_optimizers(self):
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=2e-2)

        def train_dataloader(self):
            ids = torch.randint(0, 64, (64, 8), generator=torch.Generator().manual_seed(1))
            return DataLoader(TensorDataset(ids), batch_size=8)


    class Dump(Callback):
        def __init__(self, pruning):
            self.pruning, self.steps, self.inputs = pruning, {}, []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.inputs.append(batch[0][0].clone())

        def on_train_batch_end(self, trainer, pl_module, *args):
            layers = {n: m for n, m in pl_module.named_modules() if isinstance(m, peft.tuners.lora.layer.Linear)}
            found = {}
            with torch.no_grad():
                for name, layer in layers.items():
                    base = layer.get_base_layer()
                    effective = layer(torch.eye(base.in_features)).T  # no bias in Llama's projections
                    found[name] = (effective, layer.lora_B["default"].weight.detach().clone())
            masks = {k: v.clone() for k, v in self.pruning.state_dict()["masks"].items()}
            self.steps[trainer.global_step] = (masks, found)

        def on_train_end(self, trainer, pl_module):
            torch.save({"steps": self.steps, "inputs": self.inputs}, out / f"rank{trainer.global_rank}.pt")


    pruning = PruningCallback(
        Linear(final=0.6, start=0, end=4, frequency=2), include=r".*(q_proj|v_proj)\\.base_layer\\.weight",
        masking=masking, summary=False,
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=6, callbacks=[pruning, Dump(pruning)], logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )
    trainer.fit(Lora())
    """
)


@pytest.mark.slow
def test_ddp_ranks_hold_identical_masks_and_adapters_and_the_effective_weight_stays_sparse(tmp_path: Path) -> None:
    """One parametrization only (two interpreters importing transformers and PEFT cost ~30 s); in-place masking is
    the same masked update, tested on one process above."""
    from processes import run_script

    script = tmp_path / "ddp_lora.py"
    script.write_text(DDP_SCRIPT)
    run_script(script, str(tmp_path), "reparametrize", timeout=300)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in (0, 1)]
    assert not torch.equal(torch.stack(ranks[0]["inputs"]), torch.stack(ranks[1]["inputs"]))  # different shards
    assert sorted(ranks[0]["steps"]) == sorted(ranks[1]["steps"]) == list(range(1, 7))
    for step, (masks, layers) in ranks[0]["steps"].items():
        other_masks, other_layers = ranks[1]["steps"][step]
        assert masks.keys() == other_masks.keys() and all(torch.equal(masks[k], other_masks[k]) for k in masks)
        for name, (effective, b) in layers.items():
            assert torch.equal(effective, other_layers[name][0]) and torch.equal(b, other_layers[name][1])
            mask = masks.get(name + ".base_layer.weight")
            if mask is not None:
                assert bool((effective[~mask.bool()] == 0).all()), (step, name)
    final_masks, _ = ranks[0]["steps"][6]
    assert sum(int((~m.bool()).sum()) for m in final_masks.values()) == round(
        0.6 * sum(m.numel() for m in final_masks.values())
    )


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ["gate_proj", "up_proj", "down_proj"]])
def test_neurons_are_the_models_not_the_adapters_ranks(targets: list[str]) -> None:
    """A LoRA adapter's lora_A -> lora_B looks like an MLP whose width is its rank: it was pruned as neurons, halving
    every adapter's rank, where the adapters' own tensors are documented as never pruned."""
    from lightprune.callback.units import find_groups

    model = Lora("llama", target_modules=targets)
    ids = next(iter(tokens()))[0]
    groups = find_groups(model, "neurons", (ids,), {})
    assert len(groups) == 2 and all(group.count == 32 for group in groups)  # the two MLPs, intermediate_size 32
    callback = PruningCallback(Constant(0.5, at=1), method="neurons", summary=False)
    fit = L.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    fit.callbacks.append(callback)
    fit.fit(model)
    assert [(total, pruned) for total, pruned in callback._masked.counts()] == [(32, 16), (32, 16)]
    for name, layer in lora_layers(model.model).items():  # every rank of every adapter is still there
        a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        assert bool((a != 0).any(1).all()) and bool((b != 0).any(0).all()), name


class Evaluated(Lora):
    """Records its logits on fixed tokens when a checkpoint is written and at every validation step."""

    IDS = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(5))

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.saved: dict[int, Tensor] = {}
        self.validated: list[Tensor] = []

    def logits(self) -> Tensor:
        training = self.training
        with torch.no_grad():
            out = self.eval()(self.IDS).clone()
        self.train(training)
        return out

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.saved[checkpoint["global_step"]] = self.logits()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.validated.append(self.logits())


@pytest.mark.parametrize("masking", ["reparametrize", "inplace"])
def test_validating_an_earlier_checkpoint_evaluates_its_model_updates_masked_as_then(
    tmp_path: Path, masking: str
) -> None:
    """The mask of a LoRA update is not in the weights: validate(ckpt_path=...) after fit must mask the updates with
    that checkpoint's masks, not the fit's last ones."""
    module = Evaluated("llama")
    pruning = callback_for("llama", schedule=Linear(final=0.6, start=0, end=8, frequency=2), masking=masking)
    checkpoints = ModelCheckpoint(tmp_path, every_n_train_steps=2, save_top_k=-1)
    trainer = quiet_trainer([pruning, checkpoints], max_steps=10, enable_checkpointing=True, default_root_dir=tmp_path)
    trainer.fit(module)
    (path,) = tmp_path.glob("*step=4.ckpt")
    early = torch.load(path, weights_only=False)
    final_masks = pruning.state_dict()["masks"]
    (state,) = [value for key, value in early["callbacks"].items() if key.startswith("PruningCallback")]
    assert any(not torch.equal(state["masks"][key], final_masks[key]) for key in state["masks"])  # masks moved on
    trainer.validate(module, dataloaders=tokens(samples=8), ckpt_path=path)
    torch.testing.assert_close(module.validated[-1], module.saved[4], rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("kind", "targets"), [("llama", ["q_proj", "k_proj", "v_proj", "o_proj"]), ("bert", ["query", "value"])]
)
def test_heads_are_pruned_with_the_adapters_on_their_projections(kind: str, targets: list[str]) -> None:
    """A LoRA update is added to its base projection feature by feature: a head's rows of the query, key and value
    projections, and its columns of the output projection, are the base layer's and the adapter's together. Heads
    were refused whenever an adapter sat on an attention projection, the standard LoRA set-up."""
    from lightprune.export import remove_units

    model = Lora(kind, target_modules=targets)
    callback = PruningCallback(Constant(0.5, at=1), method="heads", summary=False)
    quiet_trainer([callback], max_steps=3).fit(model)
    assert [pruned / total for total, pruned in callback._masked.counts()] == [0.5, 0.5]
    for name, layer in lora_layers(model.model).items():  # what the forward computes with: half the heads gone
        effective = effective_from_forward(layer)
        if "o_proj" in name:
            assert int((effective == 0).all(0).sum()) == effective.shape[1] // 2, name
        else:
            assert int((effective == 0).all(1).sum()) == effective.shape[0] // 2, name
    ids = next(iter(tokens()))[0]
    with torch.no_grad():
        expected = model.eval()(ids)
        merged = merge_lora(model.model).eval()
        torch.testing.assert_close(merged(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-6)
        small = remove_units(merged, (), {"input_ids": ids})  # and the pruned heads can be removed
        torch.testing.assert_close(small(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-6)
    assert sum(p.numel() for p in small.parameters()) < sum(p.numel() for p in merged.parameters())


class ZerosInTheBase(Evaluated):
    """The Llama's adapted projections arrive with 30% exact zeros (pruned before, by another tool)."""

    def __init__(self) -> None:
        super().__init__("llama")
        generator = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for name, parameter in self.model.named_parameters():
                if re.fullmatch(INCLUDE["llama"], name):
                    parameter[torch.rand(parameter.shape, generator=generator) < 0.3] = 0.0


def test_a_checkpoint_after_fit_keeps_the_update_where_the_mask_keeps_a_zero_base_entry(tmp_path: Path) -> None:
    """An event after the adapter moved ranks W + s*B*A and keeps entries whose W is 0 (their weight is the update).
    After fit the checkpoint's masks were read from W's zeros: validate(ckpt_path=...) of a checkpoint written after
    fit evaluated another model, silently. They are the updates' own masks now, and the fit end warns that a mask read
    from the base weight's zeros (a saved adapter merged with remask=True) would drop them."""
    module = ZerosInTheBase()
    pruning = callback_for("llama", schedule=Constant(0.5, at=6))
    trainer = quiet_trainer([pruning], max_steps=10, default_root_dir=tmp_path)
    with pytest.warns(UserWarning, match=r"keep entries whose base weight is exactly 0 under a LoRA adapter: .*q_proj"):
        trainer.fit(module)
    trained = module.logits()
    path = tmp_path / "after_fit.ckpt"
    trainer.save_checkpoint(path)
    trainer.validate(module, dataloaders=tokens(samples=8), ckpt_path=path)
    torch.testing.assert_close(module.validated[-1], trained, rtol=0, atol=1e-6)
