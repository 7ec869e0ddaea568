"""``lightprune.export`` on every device: the CPU and, where one is visible, a CUDA GPU (skipped cleanly elsewhere).

A model pruned and trained on a GPU is saved, compacted and converted there: each result must compute what the pruned
model computes, on the model's device, and the sparse file must read back bit for bit on any machine.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from lightprune import prune
from lightprune.export import SparseLinear, compact, load_sparse, remove_units, save_sparse, to_sparse_linear
from lightprune.structure import find_units, prune_units

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")),
]


def mlp(device: str, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 32), nn.GELU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4)).to(
        device=device, dtype=dtype
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sparse_file_of_a_device_model_reads_back_bit_for_bit(
    device: str, dtype: torch.dtype, tmp_path: Path
) -> None:
    model = mlp(device, dtype)
    prune.global_unstructured(
        [(model[0], "weight"), (model[2], "weight")], pruning_method=prune.L1Unstructured, amount=0.85
    )
    prune.ln_structured(model[4], "weight", amount=1, n=2, dim=0)
    save_sparse(model, tmp_path / "model.safetensors")
    state = load_sparse(tmp_path / "model.safetensors")
    expected = {"0.weight": model[0].weight, "2.weight": model[2].weight, "4.weight": model[4].weight}
    expected.update({f"{i}.bias": model[i].bias for i in (0, 2, 4)})
    assert state.keys() == expected.keys()
    for key, tensor in expected.items():
        assert state[key].dtype == dtype and state[key].device.type == "cpu"
        assert torch.equal(state[key], tensor.detach().cpu()), key


@pytest.mark.parametrize("device", DEVICES)
def test_compact_of_a_device_model_computes_the_pruned_function_there(device: str) -> None:
    model = mlp(device).eval()
    prune.ln_structured(model[0], "weight", amount=0.5, n=2, dim=0)
    prune.ln_structured(model[2], "weight", amount=0.25, n=1, dim=0)
    x = torch.randn(5, 24, device=device)
    small = compact(model, x)
    assert small.get_submodule("2").in_features == 16 and small.get_submodule("4").in_features == 12
    assert next(small.parameters()).device.type == device
    torch.testing.assert_close(small(x), model(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_sparse_linear_decisions_on_the_device_keep_the_outputs(device: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 8)).to(device)
    prune.l1_unstructured(model[0], "weight", amount=0.95)
    prune.remove(model[0], "weight")
    x = torch.randn(16, 512, device=device)
    converted, decisions = to_sparse_linear(model, x, repeats=3)
    timed = {decision.name: decision for decision in decisions}
    assert timed["0"].sparse_s is not None and timed["0"].note == ""  # the device has a sparse kernel for it
    assert timed["2"].sparse_s is None  # dense: below min_sparsity, not timed
    assert isinstance(converted.get_submodule("0"), SparseLinear) == timed["0"].converted
    torch.testing.assert_close(converted(x), model(x), rtol=1e-4, atol=1e-4)
    assert all(p.device.type == device for p in converted.parameters())


@pytest.mark.parametrize("device", DEVICES)
def test_remove_units_of_a_device_transformer_computes_the_pruned_function(device: str) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=40
    )
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval().to(device)
    example = {"input_ids": torch.randint(0, 64, (2, 7), device=device)}
    groups = find_units(model, (), example)
    prune_units(model, groups, 0.5)
    pruned = copy.deepcopy(model)
    small = remove_units(model, (), example, groups=groups)
    assert [layer.intermediate.dense.out_features for layer in small.encoder.layer] == [20, 20]
    assert [layer.attention.self.query.out_features for layer in small.encoder.layer] == [16, 16]  # 2 heads of 8
    assert next(small.parameters()).device.type == device
    other = {"input_ids": torch.randint(0, 64, (3, 11), device=device)}
    torch.testing.assert_close(
        small(**other).last_hidden_state, pruned(**other).last_hidden_state, rtol=1e-4, atol=1e-4
    )
