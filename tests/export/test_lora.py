"""``merge_lora``: adapters folded into pruned weights, exactly as sparse as the masks; refusals by name.

The callback's side (masking the update during training) is tested in tests/callback/test_callback_lora.py; here
the models are pruned with the engine and their adapters set by hand, as another training loop would leave them.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightprune import prune
from lightprune.adapters import AdaptedWeight, mask_delta
from lightprune.export import merge_lora

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*must be `None` or an integer within the vocabulary.*"),
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning"),
]


def gpt2_with_lora() -> nn.Module:
    """A tiny GPT-2 (``Conv1D``) with LoRA on ``c_attn`` and ``c_fc`` (``fan_in_fan_out``), updates made nonzero."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=8, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = peft.get_peft_model(
        transformers.GPT2LMHeadModel(config),
        peft.LoraConfig(r=4, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True),
    )
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.1)
    return model


def lora_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, peft.tuners.lora.layer.Linear)]


IDS = torch.randint(0, 64, (3, 8), generator=torch.Generator().manual_seed(3))


def logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


@pytest.mark.parametrize("permanent", [False, True])
def test_masked_updates_merge_exactly_and_stay_sparse(permanent: bool) -> None:
    model = gpt2_with_lora().eval()
    masks = {}
    for layer in lora_layers(model):
        base = layer.get_base_layer()
        prune.l1_unstructured(base, "weight", amount=0.6)
        masks[id(layer)] = base.weight_mask.clone()
        mask_delta(layer, base.weight_mask)
        if permanent:  # as after the callback's fit end: plain zeros, the update still masked
            prune.remove(base, "weight")
    expected = logits(model)
    merged = merge_lora(model)
    assert type(merged).__name__ == "GPT2LMHeadModel" and not lora_layers(merged)
    assert float((logits(merged) - expected).norm() / expected.norm()) <= 1e-5
    for layer in lora_layers(model):  # the input model is untouched (a copy was merged)
        name = next(n for n, m in model.base_model.model.named_modules() if m is layer)
        weight = merged.get_parameter(name + ".weight")
        assert torch.equal(weight == 0, masks[id(layer)] == 0)
        assert not prune.is_pruned(merged.get_submodule(name))


def test_unmasked_updates_on_pruned_weights_are_refused_unless_remasked() -> None:
    model = gpt2_with_lora().eval()
    for layer in lora_layers(model):
        prune.l1_unstructured(layer.get_base_layer(), "weight", amount=0.5)  # pruned, but the update never masked
    with pytest.raises(
        ValueError, match=r"'base_model\.model\.transformer\.h\.0\.attn\.c_attn': the update is nonzero"
    ) as refused:
        merge_lora(model)
    assert "remask=True" in str(refused.value) and "merge_and_unload()" in str(refused.value)  # every way out

    dense_update = logits(model)
    with pytest.warns(UserWarning, match=r"relative change.*transformer\.h\.0\.attn\.c_attn 0\.\d+.*output on "):
        merged = merge_lora(model, remask=True, example_inputs={"input_ids": IDS})
    # the merge is the remasked model: W ⊙ M + update ⊙ M, computed independently
    for layer in lora_layers(model):
        base = layer.get_base_layer()
        keep = base.weight_mask.bool()
        name = next(n for n, m in model.base_model.model.named_modules() if m is layer)
        expected = torch.where(keep, base.weight + layer.get_delta_weight("default"), 0.0).detach()
        torch.testing.assert_close(merged.get_parameter(name + ".weight"), expected)
    assert not torch.allclose(logits(merged), dense_update, atol=1e-4)  # the output did change, and it was said


def test_peft_layers_that_cannot_be_merged_are_named() -> None:
    model = gpt2_with_lora()
    lora_layers(model)[0].merge()
    with pytest.raises(ValueError, match=r"h\.0\.attn\.c_attn': its adapters \['default'\] are merged already"):
        merge_lora(model)
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    dora = peft.get_peft_model(
        transformers.BertModel(config), peft.LoraConfig(r=2, target_modules=["query"], use_dora=True)
    )
    with pytest.raises(ValueError, match=r"query': it uses the LoRA variant\(s\) \{'default': 'DoraLinearVariant'\}"):
        merge_lora(dora)


def test_unpruned_adapters_merge_like_peft() -> None:
    model = gpt2_with_lora().eval()
    reference = gpt2_with_lora().eval().merge_and_unload()  # the same model, merged by PEFT
    merged = merge_lora(model)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(merged.state_dict()[name], value, rtol=0, atol=1e-6)


def test_marked_module_inside_a_plain_model_is_replaced_by_its_base_layer() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(AdaptedWeight(nn.Linear(6, 4), rank=2), nn.Tanh(), AdaptedWeight(nn.Linear(4, 2), rank=2))
    with torch.no_grad():
        net[0].B.normal_()
        net[2].B.normal_()
    prune.l1_unstructured(net[0].base_layer, "weight", amount=12)
    mask_delta(net[0], net[0].base_layer.weight_mask)  # net[2] is not pruned: a plain merge
    x = torch.randn(5, 6)
    expected = net(x)
    merged = merge_lora(net, inplace=True)
    assert merged is net and [type(m).__name__ for m in merged] == ["Linear", "Tanh", "Linear"]
    assert int((merged[0].weight == 0).sum()) == 12 and int((merged[2].weight == 0).sum()) == 0
    torch.testing.assert_close(merged(x), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore::UserWarning")  # PEFT's own warning on a tied target
def test_an_adapter_on_a_tied_weight_is_refused_naming_the_tie() -> None:
    """GPT-2's ``lm_head`` is its input embedding: merging an update into it would change the embedding too, so the
    merged model would not compute what the unmerged one did."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=8)
    model = peft.get_peft_model(transformers.GPT2LMHeadModel(config), peft.LoraConfig(r=2, target_modules=["lm_head"]))
    model.eval()
    head = model.base_model.model.lm_head
    assert head.get_base_layer().weight is model.base_model.model.transformer.wte.weight
    prune.l1_unstructured(head.get_base_layer(), "weight", amount=0.5)
    mask_delta(head, head.get_base_layer().weight_mask.clone())
    prune.remove(head.get_base_layer(), "weight")  # as after the callback's fit end: both owners read the zeros
    with torch.no_grad():
        head.lora_B["default"].weight.normal_()
    embedding = model.base_model.model.transformer.wte.weight.detach().clone()
    with pytest.raises(
        ValueError, match=r"'base_model\.model\.lm_head': its base weight is tied to \['base_model\.model\.transformer"
        r"\.wte\.weight'\].*untie it first"
    ):  # fmt: skip
        merge_lora(model, inplace=True)
    assert torch.equal(model.base_model.model.transformer.wte.weight, embedding)  # nothing written before refusing
    with torch.no_grad():
        head.lora_B["default"].weight.zero_()  # an update of zero changes neither owner: merged
    ids = {"input_ids": torch.randint(0, 64, (2, 8))}
    with torch.no_grad():
        expected = model(**ids).logits
        merged = merge_lora(model)
        assert merged.lm_head.weight is merged.transformer.wte.weight
        assert torch.equal(merged(**ids).logits, expected)


class EmbedAttend(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.attention = nn.Embedding(50, 16), nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        return self.head(self.attention(x, x, x, need_weights=False)[0])


def test_an_embeddings_adapter_is_merged_as_peft_merges_it() -> None:
    """PEFT keeps an Embedding's adapters apart (lora_embedding_A/B, lora_A empty): they were dropped silently."""
    torch.manual_seed(0)
    model = peft.get_peft_model(EmbedAttend(), peft.LoraConfig(r=4, target_modules=["embed"])).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_embedding" in name:
                parameter.normal_(0, 0.5)  # a trained update (PEFT starts an Embedding's A at zero)
    _ = prune.l1_unstructured(model.base_model.model.embed.base_layer, "weight", amount=0.5)
    ids = torch.randint(0, 50, (2, 5))
    with torch.no_grad():
        expected = model(ids)
    with pytest.warns(UserWarning, match=r"dropped the update where the base weights are pruned.*embed"):
        merged = merge_lora(model, remask=True)
    assert isinstance(merged.embed, nn.Embedding) and int((merged.embed.weight == 0).sum()) == 400
    layer = model.base_model.model.embed
    keep = layer.base_layer.weight_mask.bool()
    weight = torch.where(keep, layer.base_layer.weight + layer.get_delta_weight("default"), 0.0)
    torch.testing.assert_close(merged.embed.weight, weight.detach())
    assert not torch.allclose(merged(ids), expected)  # (the update on pruned rows is gone, as it was said)


def test_an_adapter_on_a_layer_without_one_weight_is_refused_by_name() -> None:
    model = peft.get_peft_model(EmbedAttend(), peft.LoraConfig(r=2, target_modules=["attention"]))
    with pytest.raises(ValueError, match=r"'base_model\.model\.attention': its base layer, a MultiheadAttention, has"):
        merge_lora(model)
