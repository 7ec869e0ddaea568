"""Tests of lightprune.selection: default selection, regexes, pruned models, MultiheadAttention, explicit pairs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.utils.prune as torch_prune
from torch import nn

from lightprune import prune as lightprune_prune
from lightprune.selection import DEFAULT_MODULE_TYPES, pruned_tensor_names, resolve_pairs, select_parameters


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(10, 4)
        self.features = nn.Sequential(
            nn.Conv1d(4, 4, 3), nn.BatchNorm1d(4), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.ConvTranspose2d(4, 4, 3)
        )
        self.volume = nn.Conv3d(4, 4, 1)
        self.classifier = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2)
        self.head = nn.Linear(8, 2)


def names(selection: list[tuple[str, nn.Module, str]]) -> list[str]:
    return [qualified_name for qualified_name, _, _ in selection]


# ----------------------------------------------------------------------------------------------------------------------
# Default selection
# ----------------------------------------------------------------------------------------------------------------------


def test_default_selects_linear_and_conv_weights_only() -> None:
    model = Net()
    # No biases, norms, embeddings or transposed convolutions; named_modules() order.
    assert names(select_parameters(model)) == [
        "features.0.weight",
        "features.3.weight",
        "volume.weight",
        "classifier.0.weight",
        "classifier.2.weight",
    ]
    default_types = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
    assert default_types == DEFAULT_MODULE_TYPES


def test_triples_hold_the_owning_module_and_attribute_name() -> None:
    model = Net()
    parameters = dict(model.named_parameters())
    for qualified_name, module, name in select_parameters(model):
        assert name == "weight"
        assert getattr(module, name) is parameters[qualified_name]
    _, module, _ = select_parameters(model)[-1]
    assert module is model.classifier[2]


def test_root_module_has_unprefixed_names() -> None:
    layer = nn.Linear(3, 2)
    assert select_parameters(layer) == [("weight", layer, "weight")]


def test_subclasses_of_the_module_types_count() -> None:
    model = nn.Sequential(nn.LazyLinear(3), nn.Linear(3, 3))
    assert names(select_parameters(model)) == ["0.weight", "1.weight"]


def test_module_types_and_parameter_names() -> None:
    model = Net()
    assert names(select_parameters(model, module_types=nn.Conv2d)) == ["features.3.weight"]
    assert names(select_parameters(model, module_types=[nn.Linear], parameter_names="bias")) == [
        "classifier.0.bias",
        "classifier.2.bias",
    ]
    assert names(select_parameters(model, module_types=[nn.LayerNorm, nn.Linear], parameter_names=None)) == [
        "classifier.0.weight",
        "classifier.0.bias",
        "classifier.1.weight",
        "classifier.1.bias",
        "classifier.2.weight",
        "classifier.2.bias",
    ]
    # module_types=None: any module, here restricted by name only.
    assert names(select_parameters(model, module_types=None)) == [
        n for n, _ in model.named_parameters() if "weight" in n
    ]


# ----------------------------------------------------------------------------------------------------------------------
# Regular expressions
# ----------------------------------------------------------------------------------------------------------------------


def test_include_is_a_full_match_on_the_qualified_name() -> None:
    model = Net()
    assert names(select_parameters(model, include=r"features\..*")) == ["features.0.weight", "features.3.weight"]
    assert names(select_parameters(model, include=r"classifier\.2\.weight")) == ["classifier.2.weight"]
    # re.search would match these; re.fullmatch does not.
    with pytest.raises(ValueError, match="no parameter of the model matches"):
        select_parameters(model, include="features")
    with pytest.raises(ValueError, match="no parameter of the model matches"):
        select_parameters(model, include=r"0\.weight")


def test_several_includes_are_alternatives() -> None:
    model = Net()
    selection = select_parameters(model, include=[r"volume\.weight", r"classifier\.0\..*"])
    assert names(selection) == ["volume.weight", "classifier.0.weight"]


def test_exclude_is_a_full_match_and_wins_over_include() -> None:
    model = Net()
    assert names(select_parameters(model, exclude=[r"features\..*", r".*\.2\.weight"])) == [
        "volume.weight",
        "classifier.0.weight",
    ]
    assert names(select_parameters(model, include=r"classifier\..*", exclude=r"classifier\.0\.weight")) == [
        "classifier.2.weight"
    ]
    # Substrings do not exclude anything.
    assert len(select_parameters(model, exclude="classifier")) == 5


def test_include_with_any_module_type() -> None:
    model = Net()
    selection = select_parameters(
        model, include=r"features\.1\..*|embedding\..*", module_types=None, parameter_names=None
    )
    assert names(selection) == ["embedding.weight", "features.1.weight", "features.1.bias"]


def test_invalid_pattern() -> None:
    with pytest.raises(ValueError, match=r"^include pattern '\(' is not a valid regular expression: "):
        select_parameters(Net(), include="(")
    with pytest.raises(ValueError, match=r"^exclude pattern '\[' is not a valid regular expression: "):
        select_parameters(Net(), exclude=["ok", "["])


# ----------------------------------------------------------------------------------------------------------------------
# Empty selections
# ----------------------------------------------------------------------------------------------------------------------


def test_empty_selection_names_the_criteria() -> None:
    message = (
        r"^no parameter of the model matches the selection: include='nothing', exclude=None, "
        r"module_types=\['Linear', 'Conv1d', 'Conv2d', 'Conv3d'\], parameter_names=\['weight'\]$"
    )
    with pytest.raises(ValueError, match=message):
        select_parameters(Net(), include="nothing")
    with pytest.raises(ValueError, match=r"module_types=\['GRU'\], parameter_names=\['weight'\]"):
        select_parameters(Net(), module_types=[nn.GRU])
    with pytest.raises(ValueError, match=r"exclude='.\*', module_types=None, parameter_names=None$"):
        select_parameters(Net(), exclude=".*", module_types=None, parameter_names=None)
    with pytest.raises(ValueError, match="no parameter of the model matches"):
        select_parameters(nn.ReLU())


# ----------------------------------------------------------------------------------------------------------------------
# MultiheadAttention
# ----------------------------------------------------------------------------------------------------------------------


def test_multihead_attention_default_selects_out_proj() -> None:
    model = Attention()
    # out_proj is a NonDynamicallyQuantizableLinear, a Linear subclass; in_proj_weight belongs to the
    # MultiheadAttention module itself, which is not a default type.
    assert type(model.attn.out_proj) is not nn.Linear
    assert names(select_parameters(model)) == ["attn.out_proj.weight", "head.weight"]


def test_multihead_attention_in_proj_weight() -> None:
    model = Attention()
    selection = select_parameters(model, module_types=None, parameter_names=["weight", "in_proj_weight"])
    assert names(selection) == ["attn.in_proj_weight", "attn.out_proj.weight", "head.weight"]
    assert selection[0][1:] == (model.attn, "in_proj_weight")
    selection = select_parameters(model, include=r"attn\.in_proj_.*", module_types=None, parameter_names=None)
    assert names(selection) == ["attn.in_proj_weight", "attn.in_proj_bias"]


# ----------------------------------------------------------------------------------------------------------------------
# Already pruned models
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prune", [torch_prune, lightprune_prune], ids=["torch", "lightprune"])
def test_pruned_parameters_keep_their_user_names(prune) -> None:
    model = Net()
    expected = names(select_parameters(model))
    prune.l1_unstructured(model.classifier[0], "weight", amount=0.5)
    prune.random_unstructured(model.features[0], "weight", amount=0.5)
    assert "classifier.0.weight_orig" in dict(model.named_parameters())
    assert pruned_tensor_names(model.classifier[0]) == {"weight"}

    selection = select_parameters(model)
    assert names(selection) == expected
    assert selection[3] == ("classifier.0.weight", model.classifier[0], "weight")
    assert names(select_parameters(model, include=r"classifier\.0\.weight")) == ["classifier.0.weight"]
    with pytest.raises(ValueError, match="no parameter of the model matches"):
        select_parameters(model, include=r".*_orig")


@pytest.mark.parametrize("prune", [torch_prune, lightprune_prune], ids=["torch", "lightprune"])
def test_pruned_twice_and_pruned_bias(prune) -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    prune.l1_unstructured(model[0], "weight", amount=0.25)
    prune.l1_unstructured(model[0], "weight", amount=0.25)  # a PruningContainer now
    prune.random_unstructured(model[0], "bias", amount=0.5)
    assert pruned_tensor_names(model[0]) == {"weight", "bias"}
    assert sorted(names(select_parameters(model, parameter_names=None))) == ["0.bias", "0.weight"]


def test_removed_pruning_is_a_plain_parameter_again() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    torch_prune.l1_unstructured(model[0], "weight", amount=0.5)
    torch_prune.remove(model[0], "weight")
    assert pruned_tensor_names(model[0]) == set()
    assert names(select_parameters(model)) == ["0.weight"]


class Masked(nn.Module):
    """A module with names that look like pruning's but are not."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(2, 2))
        self.scale_orig = nn.Parameter(torch.ones(2))
        self.register_buffer("attn_mask", torch.zeros(2, 2))
        self.register_buffer("weight_mask", torch.zeros(2, 2))


def test_suffixes_alone_do_not_mean_pruned() -> None:
    model = nn.Sequential(Masked())
    assert pruned_tensor_names(model[0]) == set()
    selection = select_parameters(model, module_types=None, parameter_names=None)
    assert names(selection) == ["0.weight", "0.scale_orig"]
    with pytest.raises(ValueError, match="no parameter of the model matches"):
        select_parameters(model, module_types=None, parameter_names=["scale", "attn"])


def test_hooks_need_tensor_name_and_compute_mask() -> None:
    class NotAPruningHook:
        _tensor_name = "scale"

        def __call__(self, module: nn.Module, inputs: object) -> None:
            return None

    class DuckPruningHook(NotAPruningHook):
        def compute_mask(self, t: torch.Tensor, default_mask: torch.Tensor) -> torch.Tensor:
            return default_mask

    module = Masked()
    handle = module.register_forward_pre_hook(NotAPruningHook())
    assert pruned_tensor_names(module) == set()
    assert names(select_parameters(module, module_types=None, parameter_names=None)) == ["weight", "scale_orig"]
    handle.remove()
    module.register_forward_pre_hook(DuckPruningHook())
    assert pruned_tensor_names(module) == {"scale"}
    assert names(select_parameters(module, module_types=None, parameter_names=None)) == ["weight", "scale"]


# ----------------------------------------------------------------------------------------------------------------------
# Shared parameters
# ----------------------------------------------------------------------------------------------------------------------


def test_shared_module_appears_once() -> None:
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    assert names(select_parameters(model)) == ["0.weight"]


def test_tied_weights_appear_once_under_the_first_name() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].weight = model[0].weight
    assert names(select_parameters(model)) == ["0.weight"]
    assert names(select_parameters(model, parameter_names=None)) == ["0.weight", "0.bias", "1.bias"]


def test_a_tied_tensor_excluded_under_one_name_is_excluded_under_all() -> None:
    """An exclusion of the embeddings also keeps the tied output layer (the same tensor) unpruned, whichever
    name comes first and whatever module types are selected."""
    model = nn.ModuleDict({"embed": nn.Embedding(4, 3), "body": nn.Linear(3, 3), "head": nn.Linear(3, 4)})
    model.head.weight = model.embed.weight
    assert names(select_parameters(model)) == ["body.weight", "head.weight"]
    assert names(select_parameters(model, exclude=r"embed\..*")) == ["body.weight"]
    assert names(select_parameters(model, module_types=None, exclude=r"head\..*")) == ["body.weight"]


# ----------------------------------------------------------------------------------------------------------------------
# Explicit (module, name) pairs
# ----------------------------------------------------------------------------------------------------------------------


def test_resolve_pairs_keeps_the_given_order() -> None:
    model = Net()
    triples = resolve_pairs(
        model, [(model.classifier[2], "weight"), (model.features[1], "bias"), (model.volume, "weight")]
    )
    assert triples == [
        ("classifier.2.weight", model.classifier[2], "weight"),
        ("features.1.bias", model.features[1], "bias"),
        ("volume.weight", model.volume, "weight"),
    ]


def test_resolve_pairs_root_module_and_duplicates() -> None:
    layer = nn.Linear(2, 2)
    assert resolve_pairs(layer, [(layer, "weight"), (layer, "weight")]) == [("weight", layer, "weight")]
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].weight = model[0].weight
    assert resolve_pairs(model, [(model[1], "weight"), (model[0], "weight")]) == [("1.weight", model[1], "weight")]


def test_resolve_pairs_multihead_attention() -> None:
    model = Attention()
    triples = resolve_pairs(model, [(model.attn, "in_proj_weight"), (model.attn.out_proj, "weight")])
    assert [name for name, _, _ in triples] == ["attn.in_proj_weight", "attn.out_proj.weight"]


def test_resolve_pairs_pruned_module() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    torch_prune.l1_unstructured(model[0], "weight", amount=0.5)
    assert resolve_pairs(model, [(model[0], "weight")]) == [("0.weight", model[0], "weight")]
    with pytest.raises(
        ValueError,
        match=r"module '0' \(Linear\) has no parameter 'weight_orig'; its parameters are \['bias', 'weight'\] "
        r"\('weight_orig' holds the original values of the pruned tensor 'weight'; pass 'weight'\)",
    ):
        resolve_pairs(model, [(model[0], "weight_orig")])


def test_resolve_pairs_errors() -> None:
    model = Net()
    with pytest.raises(
        ValueError, match=r"^module 'classifier.1' \(LayerNorm\) has no parameter 'wieght'; its parameters are "
    ):
        resolve_pairs(model, [(model.classifier[1], "wieght")])
    with pytest.raises(ValueError, match=r"its parameters are \['weight', 'bias'\]$"):
        resolve_pairs(model, [(model.classifier[1], "running_mean")])
    with pytest.raises(ValueError, match=r"^the model itself \(Linear\) has no parameter 'scale'"):
        layer = nn.Linear(2, 2)
        resolve_pairs(layer, [(layer, "scale")])
    with pytest.raises(ValueError, match=r"^pairs\[1\]: module Linear is not a submodule of the model$"):
        resolve_pairs(model, [(model.volume, "weight"), (nn.Linear(2, 2), "weight")])
    with pytest.raises(ValueError, match=r"^pairs is empty"):
        resolve_pairs(model, [])
    with pytest.raises(ValueError, match=r"^pairs\[0\] is 'weight', not a \(module, parameter name\) pair"):
        resolve_pairs(model, ["weight"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"^pairs\[0\] is \('weight', .*\), not a \(module, parameter name\) pair"):
        resolve_pairs(model, [("weight", model.volume)])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"^pairs\[0\] is a Parameter of shape \(2, 2\), not a \(module, param"):
        resolve_pairs(model, [nn.Linear(2, 2).weight])  # type: ignore[list-item]
