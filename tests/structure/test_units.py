"""find_units: the neurons and heads of real model classes, checked against their known layout and behaviour."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_transformers import BUILDERS, opt_with_projection, outputs, transformers
from torch import nn

from lightprune import prune
from lightprune.structure import UnitError, find_units

pytestmark = pytest.mark.usefixtures("one_thread_for_module")


def _qkv(prefix: str, names: tuple[str, str, str], per_unit: tuple[int, int, int], bias: bool) -> set[tuple]:
    out = set()
    for name, size in zip(names, per_unit, strict=True):
        out.add((f"{prefix}{name}", "weight", 0, 0, size))
        if bias:
            out.add((f"{prefix}{name}", "bias", 0, 0, size))
    return out


def _expected(model_name: str) -> list[tuple[str, str, int, int, bool, set[tuple]]]:
    """(kind, module, count, query heads per unit, per-head bias, slices), written from each model's source."""
    if model_name == "bert":
        groups = []
        for i in range(2):
            layer = f"encoder.layer.{i}"
            heads = _qkv(f"{layer}.attention.self.", ("query", "key", "value"), (8, 8, 8), True)
            heads.add((f"{layer}.attention.output.dense", "weight", 1, 0, 8))
            groups.append(("heads", f"{layer}.attention", 4, 1, False, heads))
            neurons = {
                (f"{layer}.intermediate.dense", "weight", 0, 0, 1),
                (f"{layer}.intermediate.dense", "bias", 0, 0, 1),
                (f"{layer}.output.dense", "weight", 1, 0, 1),
            }
            groups.append(("neurons", layer, 40, 1, False, neurons))
        return groups
    if model_name == "gpt2":
        groups = []
        for i in range(2):
            attn, mlp = f"transformer.h.{i}.attn", f"transformer.h.{i}.mlp"
            heads = {(f"{attn}.c_attn", "weight", 1, offset, 8) for offset in (0, 32, 64)}
            heads |= {(f"{attn}.c_attn", "bias", 0, offset, 8) for offset in (0, 32, 64)}
            heads.add((f"{attn}.c_proj", "weight", 0, 0, 8))
            groups.append(("heads", attn, 4, 1, False, heads))
            neurons = {(f"{mlp}.c_fc", "weight", 1, 0, 1), (f"{mlp}.c_fc", "bias", 0, 0, 1)}
            neurons.add((f"{mlp}.c_proj", "weight", 0, 0, 1))
            groups.append(("neurons", mlp, 40, 1, False, neurons))
        return groups
    if model_name == "llama":  # 8 query heads, 4 key/value heads of 4 features: a unit is 2 query heads + 1 kv head
        groups = []
        for i in range(2):
            attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
            heads = _qkv(f"{attn}.", ("q_proj", "k_proj", "v_proj"), (8, 4, 4), True)
            heads.add((f"{attn}.o_proj", "weight", 1, 0, 8))
            groups.append(("heads", attn, 4, 2, False, heads))
            neurons = {(f"{mlp}.{name}", "weight", 0, 0, 1) for name in ("gate_proj", "up_proj")}
            neurons.add((f"{mlp}.down_proj", "weight", 1, 0, 1))
            groups.append(("neurons", mlp, 40, 1, False, neurons))
        return groups
    if model_name == "t5":
        groups = []
        for attn in (
            "encoder.block.0.layer.0.SelfAttention",
            "decoder.block.0.layer.0.SelfAttention",
            "decoder.block.0.layer.1.EncDecAttention",
        ):
            heads = _qkv(f"{attn}.", ("q", "k", "v"), (8, 8, 8), False) | {(f"{attn}.o", "weight", 1, 0, 8)}
            groups.append(("heads", attn, 4, 1, True, heads))
        for mlp in ("encoder.block.0.layer.1.DenseReluDense", "decoder.block.0.layer.2.DenseReluDense"):
            neurons = {(f"{mlp}.{name}", "weight", 0, 0, 1) for name in ("wi_0", "wi_1")}
            neurons.add((f"{mlp}.wo", "weight", 1, 0, 1))
            groups.append(("neurons", mlp, 40, 1, False, neurons))
        return groups
    assert model_name == "encoder_layer"
    heads = {("self_attn", name, 0, offset, 8) for name in ("in_proj_weight", "in_proj_bias") for offset in (0, 32, 64)}
    heads.add(("self_attn.out_proj", "weight", 1, 0, 8))
    neurons = {("linear1", "weight", 0, 0, 1), ("linear1", "bias", 0, 0, 1), ("linear2", "weight", 1, 0, 1)}
    return [("heads", "self_attn", 4, 1, False, heads), ("neurons", "", 40, 1, False, neurons)]


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def found(request: pytest.FixtureRequest) -> tuple[str, nn.Module, dict, list]:
    model, example, _ = BUILDERS[request.param]()
    return request.param, model, example, find_units(model, (), example)


def test_groups_are_the_models_known_units(found: tuple) -> None:
    name, _, _, groups = found
    got = sorted(
        (g.kind, g.module, g.count, g.heads_per_unit, g.per_head_bias, frozenset(_as_tuples(g))) for g in groups
    )
    want = sorted((k, m, c, r, b, frozenset(s)) for k, m, c, r, b, s in _expected(name))
    assert got == want


def _as_tuples(group) -> set[tuple]:
    return {(s.module, s.name, s.dim, s.offset, s.per_unit) for s in group.slices}


def _zero(model: nn.Module, slices, unit: int) -> None:
    with torch.no_grad():
        for piece in slices:
            param = getattr(model.get_submodule(piece.module), piece.name)
            param.narrow(piece.dim, piece.offset + unit * piece.per_unit, piece.per_unit).zero_()


def test_a_units_rows_act_only_through_its_columns(found: tuple) -> None:
    """With a unit's output columns zeroed, zeroing its rows too changes nothing, and the rows alone do matter:
    the rows found belong to that unit and to no other."""
    _, model, example, groups = found
    for group in groups:
        for unit in (0, group.count - 1):
            columns_only, everything, rows_only = (copy.deepcopy(model) for _ in range(3))
            _zero(columns_only, group.consume, unit)
            _zero(everything, group.slices, unit)
            _zero(rows_only, group.produce, unit)
            for a, b in zip(outputs(columns_only, example), outputs(everything, example), strict=True):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
            changed = [
                float((a - b).abs().max())
                for a, b in zip(outputs(model, example), outputs(rows_only, example), strict=True)
            ]
            assert max(changed) > 1e-5, (group.module, unit)


def test_units_of_a_pruned_model_are_those_of_the_plain_one() -> None:
    model, example, _ = BUILDERS["gpt2"]()
    plain = find_units(model, (), example)
    prune.l1_unstructured(model.transformer.h[0].mlp.c_fc, "weight", amount=0.3)
    prune.random_unstructured(model.transformer.h[1].attn.c_attn, "bias", amount=2)
    assert find_units(model, (), example) == plain
    assert prune.is_pruned(model.transformer.h[0].mlp.c_fc)


def test_a_model_pruned_by_torch_is_refused_by_name() -> None:
    """torch.nn.utils.prune's reparametrization cannot be copied (its pruned tensor is not a leaf): named, not a
    deepcopy error, by find_units and by remove_units given the groups."""
    from lightprune.export import remove_units

    mlp = nn.Sequential(nn.Linear(4, 6), nn.GELU(), nn.Linear(6, 3))
    example = (torch.randn(2, 4),)
    groups = find_units(mlp, example)
    torch.nn.utils.prune.l1_unstructured(mlp[2], "weight", amount=0.3)
    refusal = r"'2': 'weight' of Linear is pruned by torch.nn.utils.prune; make that pruning permanent"
    with pytest.raises(UnitError, match=refusal):
        find_units(mlp, example)
    with pytest.raises(UnitError, match=refusal):
        remove_units(mlp, example, groups=groups)


def test_kinds_select_and_must_be_found() -> None:
    mlp = nn.Sequential(nn.Linear(4, 6), nn.GELU(), nn.Linear(6, 3))
    assert [g.kind for g in find_units(mlp, (torch.randn(2, 4),), kinds=["neurons"])] == ["neurons"]
    with pytest.raises(UnitError, match=r"found no heads in Sequential"):
        find_units(mlp, (torch.randn(2, 4),), kinds=["heads"])
    with pytest.raises(ValueError, match=r"unknown unit kinds \['channels'\]; allowed: \['neurons', 'heads'\]"):
        find_units(mlp, (torch.randn(2, 4),), kinds=["channels"])


def test_no_unit_through_a_non_elementwise_op() -> None:
    """A softmax between two projections mixes features: no neurons; nothing else either: refused by name."""
    model = nn.Sequential(nn.Linear(4, 6), nn.Softmax(-1), nn.Linear(6, 3))
    with pytest.raises(UnitError, match=r"found no neurons and no heads in Sequential"):
        find_units(model, (torch.randn(2, 4),))


class _Reuse(nn.Module):
    """``fc1`` opens an MLP (``fc1 -> relu -> fc2``) and is called again on the MLP's output: its rows are units of
    two MLPs at once, and pruning one of them would prune the other."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc1(self.fc2(torch.relu(self.fc1(x)))))


def test_a_projection_reused_in_two_groups_is_refused_by_name() -> None:
    with pytest.raises(UnitError, match=r"fc1.weight belongs to two unit groups \(the neurons of 'the model' and"):
        find_units(_Reuse(), (torch.randn(4, 8),))


def test_a_layer_shared_across_depth_gives_its_groups_once() -> None:
    """ALBERT calls one layer at every depth: the same groups, found once each, are not an overlap."""
    config = transformers.AlbertConfig(
        vocab_size=64, embedding_size=16, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
        intermediate_size=40,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AlbertModel(config).eval()
    groups = find_units(model, (), {"input_ids": torch.randint(3, 64, (2, 7))})
    assert sorted((g.kind, g.count) for g in groups) == [("heads", 4), ("neurons", 40)]


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if float(x.sum()) > 0:  # Python on a tensor value: not traceable
            return self.fc(x)
        return x


def test_untraceable_model_is_refused_by_name() -> None:
    with pytest.raises(UnitError, match=r"cannot trace _Branchy with torch.export"):
        find_units(_Branchy(), (torch.randn(2, 4),))


class _OddAttention(nn.Module):
    """Queries made by a projection and then mixed across heads by a second matmul: not followable."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(8, 8) for _ in range(4))
        self.mix = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = (self.q(x) @ self.mix).view(2, 3, 2, 4).transpose(1, 2)
        k = self.k(x).view(2, 3, 2, 4).transpose(1, 2)
        v = self.v(x).view(2, 3, 2, 4).transpose(1, 2)
        out = nn.functional.scaled_dot_product_attention(q, k, v)
        return self.o(out.transpose(1, 2).reshape(2, 3, 8))


def test_attention_that_cannot_be_followed_is_refused_by_name() -> None:
    with pytest.raises(UnitError, match=r"cannot follow the attention query of the forward of _OddAttention"):
        find_units(_OddAttention(), (torch.randn(2, 3, 8),))


class _InterleavedQkv(nn.Module):
    """A fused projection laid out q, k, v, q, k, v, ...: a head's query rows are every third one, not a block."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (self.qkv(x)[..., i::3].view(b, s, 4, 4).transpose(1, 2) for i in range(3))
        return self.out(nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, 16))


def test_a_projection_split_with_a_step_is_refused_not_read_as_blocks() -> None:
    """Read as blocks of rows, its heads' masks would cut rows of the heads kept."""
    with pytest.raises(UnitError, match=r"cannot follow the attention query of the forward of _InterleavedQkv"):
        find_units(_InterleavedQkv(), (torch.randn(2, 5, 16),), kinds=["heads"])


def test_multi_query_attention_is_one_unit_of_all_query_heads() -> None:
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=1,
        intermediate_size=24,
    )
    model = transformers.LlamaModel(config).eval()
    heads = find_units(model, (), {"input_ids": torch.zeros(1, 5, dtype=torch.long)}, kinds=["heads"])
    assert [(g.count, g.heads_per_unit, g.head_dim) for g in heads] == [(1, 4, 8)]
    assert {(s.module.rsplit(".", 1)[-1], s.per_unit) for s in heads[0].slices} == {
        ("q_proj", 32),
        ("k_proj", 8),
        ("v_proj", 8),
        ("o_proj", 32),
    }


_QK_NORM_BASE = {
    "vocab_size": 64,
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "intermediate_size": 40,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


@pytest.mark.parametrize(
    ("family", "flag", "norm"),
    [("Cohere", "use_qk_norm", r"self_attn.q_norm'"), ("StableLm", "qk_layernorm", r"self_attn.q_layernorm.norms'")],
)
def test_a_norm_per_head_after_the_split_refuses_the_heads_by_name(family: str, flag: str, norm: str) -> None:
    """Cohere's q_norm weight is (heads, head_dim); StableLM has one LayerNorm per head: removing heads would keep
    (or mismatch) the removed heads' norms, so the heads are refused; the neurons stay."""
    config = getattr(transformers, f"{family}Config")(**_QK_NORM_BASE, **{flag: True})
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    example = {"input_ids": torch.randint(3, 64, (2, 7))}
    with pytest.raises(UnitError, match=r"query of 'model.layers.0.self_attn' goes through parameters of '.*" + norm):
        find_units(model, (), example, kinds=["heads"])
    assert [g.kind for g in find_units(model, (), example, kinds=["neurons"])] == ["neurons"]


@pytest.mark.parametrize("family", ["Qwen3", "Phi"])
def test_a_norm_shared_by_every_head_keeps_the_heads(family: str) -> None:
    extra = {"head_dim": 8} if family == "Qwen3" else {"qk_layernorm": True}
    config = getattr(transformers, f"{family}Config")(**_QK_NORM_BASE, **extra)
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    heads = find_units(model, (), {"input_ids": torch.randint(3, 64, (2, 7))}, kinds=["heads"])
    assert [(g.count, g.heads_per_unit) for g in heads] == [(2, 2)]


def test_a_group_slicing_a_tied_parameter_is_left_out_with_a_warning() -> None:
    """OPT with word_embed_proj_dim != hidden_size: project_out's rows and lm_head's columns would be a group, but
    lm_head's weight is the input embedding's: cutting its columns would cut the embedding's features too."""
    model = opt_with_projection()
    assert model.lm_head.weight is model.model.decoder.embed_tokens.weight
    example = {"input_ids": torch.randint(3, 64, (2, 7))}
    tie = r"leaves out the neurons of 'the model'.*embed_tokens.weight = lm_head.weight"
    with pytest.warns(UserWarning, match=tie):
        groups = find_units(model, (), example)
    assert [(g.kind, g.module) for g in groups] == [
        ("heads", "model.decoder.layers.0.self_attn"),
        ("neurons", "model.decoder.layers.0"),
    ]
    prune.l1_unstructured(model.lm_head, "weight", amount=0.5)  # pruned under one holder: still tied, still seen
    with pytest.warns(UserWarning, match="tied across modules"):
        assert len(find_units(model, (), example)) == 2


def _gpt_neo() -> tuple[nn.Module, dict]:
    config = transformers.GPTNeoConfig(
        vocab_size=64,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        intermediate_size=48,
        attention_types=[[["global", "local"], 1]],
        window_size=4,
    )
    torch.manual_seed(0)
    return transformers.GPTNeoForCausalLM(config).eval(), {"input_ids": torch.randint(0, 64, (2, 7))}


def test_heads_are_followed_through_a_masked_where_on_the_scores() -> None:
    """GPT-Neo's eager attention writes torch.where(causal_mask, scores, min) before the softmax."""
    from lightprune.export import remove_units
    from lightprune.structure import prune_units

    model, example = _gpt_neo()
    groups = find_units(model, (), example)
    assert [(g.kind, g.module, g.count) for g in groups if g.kind == "heads"] == [
        ("heads", f"transformer.h.{i}.attn.attention", 4) for i in range(2)
    ]
    prune_units(model, groups, 0.5)
    small = remove_units(model, (), example)
    assert small.transformer.h[0].attn.attention.q_proj.out_features == 16
    for a, b in zip(outputs(model, example), outputs(small, example), strict=True):
        torch.testing.assert_close(a, b)


def test_attention_whose_heads_cannot_be_followed_is_named_in_a_warning() -> None:
    config = transformers.BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=4)
    model = transformers.BloomForCausalLM(config).eval()
    example = {"input_ids": torch.randint(0, 64, (2, 7))}
    with pytest.warns(UserWarning, match=r"softmaxes in 'transformer\.h\.0\.self_attention' that it cannot follow"):
        groups = find_units(model, (), example)
    assert [g.kind for g in groups] == ["neurons"]
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [g.kind for g in find_units(model, (), example, kinds=["neurons"])] == ["neurons"]


def test_an_adapters_rank_is_no_unit() -> None:
    """A LoRA ``lora_A -> lora_B`` pair traces like an MLP as wide as the rank: it is left out, so neither
    ``prune_units`` nor the callback cuts a trained adapter, and a global ranking's pool holds the model's units only
    (whose slices take the adapters' rows and columns along)."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4), nn.ReLU(), nn.Linear(4, 4))
    model = peft.get_peft_model(mlp, peft.LoraConfig(r=3, target_modules=["0", "2", "4"]))
    groups = find_units(model, (torch.randn(2, 8),), kinds=["neurons"])
    assert [group.count for group in groups] == [16, 4]
    for group in groups:
        assert any("lora" not in piece.module for piece in group.slices), group


def test_a_routers_softmax_is_no_attention_left_out() -> None:
    """A mixture-of-experts router's probabilities go to a top-k, not to a matmul with values: no warning that
    heads were left out (whose advice, kinds=['neurons'], would give up the attention's heads found beside it)."""
    import warnings

    config = transformers.Qwen2MoeConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=32, moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=4,
        num_experts_per_tok=2,
    )  # fmt: skip
    model = transformers.Qwen2MoeForCausalLM(config).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        groups = find_units(model, (), {"input_ids": torch.randint(0, 64, (2, 7))})
    assert ("heads", "model.layers.0.self_attn") in [(g.kind, g.module) for g in groups]


class _MatmulLinear(nn.Linear):
    """Falcon's FalconLinear: an ``nn.Linear`` that computes ``x @ W.T + b`` itself."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T + self.bias


def test_linear_subclasses_with_their_own_forward_are_named_when_no_unit_is_found() -> None:
    model = nn.Sequential(_MatmulLinear(4, 8), nn.ReLU(), _MatmulLinear(8, 2))
    with pytest.raises(UnitError, match=r"found no neurons .*\(_MatmulLinear subclass nn\.Linear with a forward of"):
        find_units(model, (torch.randn(2, 4),), kinds=["neurons"])
