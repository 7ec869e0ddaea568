"""Tests of lightprune.metrics: exact zero counting, the Sparsity metric and SparsityCollection."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.utils.prune as torch_prune
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torchmetrics.utilities.data import dim_zero_sum

import lightprune.metrics as metrics_module
from lightprune.metrics import Sparsity, SparsityCollection, count_zeros, sparsity
from lightprune.selection import select_parameters
from ranks import LEAVE, run_ranks

# ----------------------------------------------------------------------------------------------------------------------
# Functionals
# ----------------------------------------------------------------------------------------------------------------------


def test_count_zeros_known_values() -> None:
    # Zeros: 0.0 and -0.0. Not zeros: nan, inf, tiny values.
    values = torch.tensor([0.0, -0.0, float("nan"), float("inf"), 1e-45, 3.0])
    result = count_zeros(values)
    assert result.dtype == torch.int64
    assert result.shape == ()
    assert result.item() == 2
    assert count_zeros(torch.tensor([[0, 1], [2, 0]])).item() == 2
    assert count_zeros(torch.tensor([True, False, False])).item() == 2
    assert count_zeros(torch.zeros(3, 4, 5)).item() == 60
    assert count_zeros(torch.tensor(0.0)).item() == 1
    assert count_zeros(torch.empty(0, 3)).item() == 0


def test_sparsity_known_values() -> None:
    result = sparsity(torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 5.0]]))
    assert result.dtype == torch.float32
    assert result.shape == ()
    assert result.item() == 0.625  # 5 zeros out of 8
    assert sparsity(torch.ones(7)).item() == 0.0
    assert sparsity(torch.zeros(7)).item() == 1.0
    assert sparsity(torch.tensor([True, False, True])).item() == pytest.approx(1 / 3)
    assert sparsity(torch.zeros(3, dtype=torch.float16)).item() == 1.0


@pytest.mark.parametrize(
    "dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64, torch.uint8]
)
def test_count_zeros_of_float8_and_unsigned_dtypes(dtype: torch.dtype) -> None:
    values = torch.tensor([0.0, 1.0, -0.0, 2.0, 0.0, 3.0]).to(dtype)  # -0.0 is +0 as an unsigned integer
    assert count_zeros(values).item() == 3
    assert count_zeros(values[::2]).item() == 3  # a non-contiguous view
    assert sparsity(values.reshape(2, 3)).item() == 0.5
    metric = Sparsity()
    metric.update(values)
    assert metric.compute().item() == 0.5


def test_count_zeros_of_float8_nan_and_smallest_values() -> None:
    tiny = torch.tensor([2.0**-9, -(2.0**-9), float("nan"), -0.0]).to(torch.float8_e4m3fn)
    assert count_zeros(tiny).item() == 1


def test_count_zeros_of_sparse_layouts() -> None:
    dense = torch.tensor([[0.0, 1.0, 0.0], [2.0, 0.0, 0.0]])
    for tensor in (dense.to_sparse(), dense.to_sparse_csr(), dense.to_sparse_csc(), dense.to_sparse_bsr((1, 1))):
        assert count_zeros(tensor).item() == 4
        assert sparsity(tensor).item() == pytest.approx(4 / 6)
    # a stored zero counts; duplicate COO entries are summed first (1 + -1 is a zero)
    coo = torch.sparse_coo_tensor(
        torch.tensor([[0, 0, 1], [0, 0, 2]]), torch.tensor([1.0, -1.0, 0.0]), (2, 3), check_invariants=True
    )
    assert count_zeros(coo).item() == 6
    hybrid = torch.tensor([[[0.0, 1.0]], [[0.0, 0.0]]]).to_sparse(sparse_dim=1)  # dense trailing dimensions
    assert count_zeros(hybrid).item() == 3
    metric = SparsityCollection(["a"], total_key=None)
    metric.update({"a": dense.to_sparse_csr()})
    assert metric.total.tolist() == [6] and metric.zeros.tolist() == [4]


def test_sparsity_of_an_empty_tensor_is_nan() -> None:
    assert math.isnan(sparsity(torch.empty(0)).item())


def test_sparsity_ignores_autograd() -> None:
    weight = nn.Parameter(torch.tensor([0.0, 2.0]))
    result = sparsity(weight)
    assert not result.requires_grad
    assert result.item() == 0.5


def test_sparsity_of_a_pruning_mask() -> None:
    layer = nn.Linear(10, 10)
    torch_prune.l1_unstructured(layer, "weight", amount=30)
    assert sparsity(layer.weight_mask).item() == pytest.approx(0.3)
    assert sparsity(layer.weight).item() >= 0.3


def test_division_is_exact_beyond_float32_integers() -> None:
    # 2**24 + 1 is not a float32; the counts are divided in float64 and only the result is rounded to float32.
    zeros = torch.tensor(2**24 + 1)
    total = torch.tensor(2 * (2**24 + 1))
    assert metrics_module._sparsity_compute(zeros, total).item() == 0.5
    huge = torch.tensor(2**62)
    assert metrics_module._sparsity_compute(huge - 2**61, huge).item() == 0.5


# ----------------------------------------------------------------------------------------------------------------------
# Chunked counting
# ----------------------------------------------------------------------------------------------------------------------


def reference_zeros(tensor: torch.Tensor) -> int:
    return sum(1 for value in tensor.flatten().tolist() if value == 0)


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make chunks 7 elements long and record the size of every ``torch.count_nonzero`` call."""
    sizes: list[int] = []
    original = torch.count_nonzero

    def recording_count_nonzero(tensor: torch.Tensor) -> torch.Tensor:
        sizes.append(tensor.numel())
        return original(tensor)

    monkeypatch.setattr(metrics_module, "_CHUNK_NUMEL", 7)
    monkeypatch.setattr(metrics_module.torch, "count_nonzero", recording_count_nonzero)
    return sizes


@pytest.mark.parametrize(
    "make",
    [
        lambda t: t,  # contiguous
        lambda t: t.transpose(0, 2),  # permuted
        lambda t: t[:, ::2],  # strided
        lambda t: t[:1],  # leading dimension of size 1
        lambda t: t[:1].transpose(1, 2),  # leading size 1 and non-contiguous
        lambda t: t[0, 0].expand(5, 4, 6),  # stride 0
    ],
    ids=["contiguous", "permuted", "strided", "leading-one", "leading-one-permuted", "expanded"],
)
def test_chunked_counting_is_exact_and_bounded(small_chunks: list[int], make) -> None:
    generator = torch.Generator().manual_seed(0)
    base = torch.randint(0, 3, (5, 4, 6), generator=generator).float()
    tensor = make(base)
    assert count_zeros(tensor).item() == reference_zeros(tensor)
    assert small_chunks, "count_nonzero was never called"
    assert max(small_chunks) <= 7


@settings(max_examples=100, deadline=None)
@given(
    shape=st.lists(st.integers(1, 6), min_size=1, max_size=4),
    chunk=st.integers(1, 40),
    seed=st.integers(0, 2**16),
    transpose=st.booleans(),
)
def test_chunked_counting_matches_reference(shape: list[int], chunk: int, seed: int, transpose: bool) -> None:
    tensor = torch.randint(0, 2, shape, generator=torch.Generator().manual_seed(seed))
    if transpose and tensor.dim() > 1:
        tensor = tensor.transpose(0, -1)
    old = metrics_module._CHUNK_NUMEL
    metrics_module._CHUNK_NUMEL = chunk
    try:
        assert count_zeros(tensor).item() == reference_zeros(tensor)
    finally:
        metrics_module._CHUNK_NUMEL = old


def test_count_beyond_float32_precision() -> None:
    # 2**25 + 3 zeros: not representable in float32, exact in int64. Expanded, so it takes no memory.
    tensor = torch.zeros(1).expand(2**25 + 3)
    assert count_zeros(tensor).item() == 2**25 + 3


@pytest.mark.slow
def test_count_beyond_int32() -> None:
    numel = 2**31 + 7
    tensor = torch.zeros(1, dtype=torch.bool).expand(numel)
    assert count_zeros(tensor).item() == numel  # int32 would overflow


# ----------------------------------------------------------------------------------------------------------------------
# Sparsity metric
# ----------------------------------------------------------------------------------------------------------------------


def test_sparsity_metric_class_attributes() -> None:
    assert Sparsity.is_differentiable is False
    assert Sparsity.higher_is_better is None
    assert Sparsity.full_state_update is False


def test_sparsity_metric_accumulates() -> None:
    metric = Sparsity()
    metric.update(torch.tensor([0.0, 1.0, 0.0, 2.0]))  # 2 of 4
    metric.update(torch.zeros(2, 3))  # 6 of 6
    metric.update(torch.ones(10))  # 0 of 10
    assert metric.zeros.item() == 8
    assert metric.total.item() == 20
    assert metric.zeros.dtype == metric.total.dtype == torch.int64
    assert metric.compute().item() == pytest.approx(0.4)


def test_sparsity_metric_reset() -> None:
    metric = Sparsity()
    metric.update(torch.zeros(4))
    assert metric.compute().item() == 1.0
    metric.reset()
    assert (metric.zeros.item(), metric.total.item()) == (0, 0)
    metric.update(torch.tensor([0, 1]))
    assert metric.compute().item() == 0.5


def test_sparsity_metric_forward_returns_the_batch_value() -> None:
    metric = Sparsity()
    assert metric(torch.tensor([0, 1])).item() == 0.5
    assert metric(torch.tensor([0, 0, 0, 0, 0, 0])).item() == 1.0
    assert metric.compute().item() == 0.875  # 7 of 8 over both calls


def test_sparsity_metric_compute_before_update_is_nan() -> None:
    with pytest.warns(UserWarning, match="before the ``update``"):
        value = Sparsity().compute()
    assert math.isnan(value.item())


SYNC_SCRIPT = (
    """
import json, os, sys
import torch
import torch.distributed as dist
from lightprune.metrics import Sparsity, SparsityCollection

dist.init_process_group("gloo")
rank = dist.get_rank()
zeros, total = [(1, 4), (6, 6)][rank]  # rank 0: 1 of 4 entries zero; rank 1: 6 of 6
tensor = torch.cat([torch.zeros(zeros), torch.ones(total - zeros)])
metric = Sparsity()
metric.update(tensor)
collection = SparsityCollection(["a"])
collection.update({"a": tensor})
result = {
    "synced": metric.compute().item(),
    "local": (metric.zeros.item(), metric.total.item()),  # compute() restores the local states afterwards
    "collection": {key: value.item() for key, value in collection.compute().items()},
}
with open(f"{sys.argv[1]}.{rank}", "w") as handle:
    json.dump(result, handle)
"""
    + LEAVE
)


@pytest.mark.slow
def test_sparsity_metric_states_are_summed_across_processes(tmp_path: Path) -> None:
    """Two gloo processes: each counts its own tensor, ``compute`` sums the counts of both (7 zeros of 10)."""
    metric = Sparsity()
    assert metric._reductions == {"zeros": dim_zero_sum, "total": dim_zero_sum}
    script = tmp_path / "sync.py"
    script.write_text(SYNC_SCRIPT)
    run_ranks(script, 2, [str(tmp_path / "result")], timeout=120)
    results = [json.loads((tmp_path / f"result.{rank}").read_text()) for rank in range(2)]
    for rank, result in enumerate(results):
        assert result["synced"] == pytest.approx((1 + 6) / (4 + 6), rel=1e-6), rank  # float32; alone: 0.25, 1.0
        assert result["collection"] == pytest.approx({"a": 0.7, "total": 0.7}, rel=1e-6), rank
    assert [tuple(result["local"]) for result in results] == [(1, 4), (6, 6)]


def test_sparsity_metric_merge_state() -> None:
    first, second = Sparsity(), Sparsity()
    first.update(torch.tensor([0, 1, 1, 1]))  # 1 of 4
    second.update(torch.zeros(4))  # 4 of 4
    first.merge_state(second)
    assert (first.zeros.item(), first.total.item()) == (5, 8)
    assert first.compute().item() == 0.625
    first.merge_state({"zeros": torch.tensor(2**40), "total": torch.tensor(2**41)})
    assert first.total.item() == 2**41 + 8


# ----------------------------------------------------------------------------------------------------------------------
# SparsityCollection
# ----------------------------------------------------------------------------------------------------------------------


def test_collection_values_and_keys() -> None:
    metric = SparsityCollection(["features.0.weight", "head.weight"])
    metric.update({"features.0.weight": torch.tensor([[0.0, 1.0], [0.0, 0.0]]), "head.weight": torch.ones(4)})
    metric.update({"head.weight": torch.zeros(4), "features.0.weight": torch.ones(4)})
    result = metric.compute()
    # features.0.weight: 3 + 0 zeros of 8; head.weight: 0 + 4 of 8; total: 7 of 16.
    assert result == {
        "features.0.weight": pytest.approx(0.375),
        "head.weight": pytest.approx(0.5),
        "total": pytest.approx(0.4375),
    }
    assert list(result) == ["features.0.weight", "head.weight", "total"]
    assert all(value.dtype == torch.float32 and value.shape == () for value in result.values())
    assert metric.zeros.tolist() == [3, 4]
    assert metric.total.tolist() == [8, 8]


def test_collection_total_is_weighted_by_size() -> None:
    metric = SparsityCollection(["small", "large"])
    metric.update({"small": torch.zeros(2), "large": torch.ones(98)})
    result = metric.compute()
    # Mean of the per-name values would be 0.5; the total is 2 / 100.
    assert result["total"].item() == pytest.approx(0.02)


def test_collection_prefix_and_total_key() -> None:
    metric = SparsityCollection(["a.weight"], prefix="sparsity/", total_key="all")
    metric.update({"a.weight": torch.tensor([0, 1])})
    assert list(metric.compute()) == ["sparsity/a.weight", "sparsity/all"]
    metric = SparsityCollection(["a.weight"], total_key=None)
    metric.update({"a.weight": torch.tensor([0, 1])})
    assert list(metric.compute()) == ["a.weight"]


def test_collection_update_must_name_every_tensor() -> None:
    metric = SparsityCollection(["a", "b"])
    with pytest.raises(
        ValueError, match=r"^update\(\) needs exactly one tensor per name; missing \['b'\], unexpected \[\]$"
    ):
        metric.update({"a": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"missing \[\], unexpected \['c'\]$"):
        metric.update({"a": torch.zeros(1), "b": torch.zeros(1), "c": torch.zeros(1)})
    assert metric.total.tolist() == [0, 0]  # a rejected update changes nothing


def test_collection_construction_errors() -> None:
    for name in ("weight", "head.weight"):  # a str is a sequence of its characters: not taken for names
        with pytest.raises(TypeError, match=rf"^names must be a sequence of names, not a str: .*\['{name}'\]$"):
            SparsityCollection(name)
    with pytest.raises(ValueError, match=r"^names is empty"):
        SparsityCollection([])
    with pytest.raises(ValueError, match=r"^names must be distinct, got duplicates \['a'\]$"):
        SparsityCollection(["a", "b", "a"])
    with pytest.raises(ValueError, match=r"^total_key='total' is also a tensor name; choose another total_key$"):
        SparsityCollection(["total"])
    assert list(SparsityCollection(["total"], total_key="overall").names) == ["total"]


def test_collection_refuses_keys_that_are_not_str() -> None:
    # names become output keys through str formatting: 1 and "1" would collapse into one key, one value lost
    with pytest.raises(TypeError, match=r"^names\[0\]=1 is not a str \(int\); names must be str$"):
        SparsityCollection([1, "1"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"^names\[1\]=\('b',\) is not a str \(tuple\); names must be str$"):
        SparsityCollection(["a", ("b",)])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"^prefix=None must be a str"):
        SparsityCollection(["a"], prefix=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^total_key=0 must be a str, or None"):
        SparsityCollection(["a"], total_key=0)  # type: ignore[arg-type]


def test_collection_reset_forward_and_reductions() -> None:
    metric = SparsityCollection(["a", "b"])
    batch = metric({"a": torch.tensor([0, 1]), "b": torch.tensor([0, 0])})
    assert batch == {"a": pytest.approx(0.5), "b": pytest.approx(1.0), "total": pytest.approx(0.75)}
    metric({"a": torch.ones(2), "b": torch.ones(2)})
    assert metric.compute()["total"].item() == pytest.approx(0.375)
    assert metric._reductions == {"zeros": dim_zero_sum, "total": dim_zero_sum}
    metric.reset()
    assert metric.zeros.tolist() == [0, 0]
    assert metric.total.tolist() == [0, 0]


def test_collection_merge_state() -> None:
    first, second = SparsityCollection(["a", "b"]), SparsityCollection(["a", "b"])
    first.update({"a": torch.zeros(2), "b": torch.ones(2)})
    second.update({"a": torch.ones(2), "b": torch.ones(2)})
    first.merge_state(second)
    assert first.compute() == {"a": pytest.approx(0.5), "b": pytest.approx(0.0), "total": pytest.approx(0.25)}


def test_collection_of_a_pruned_model() -> None:
    model = nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5))
    selection = select_parameters(model)
    torch_prune.l1_unstructured(model[0], "weight", amount=0.5)  # 50 of 100
    torch_prune.l1_unstructured(model[2], "weight", amount=10)  # 10 of 50
    metric = SparsityCollection([name for name, _, _ in selection], prefix="sparsity/")
    metric.update({name: getattr(module, f"{attr}_mask") for name, module, attr in selection})
    assert metric.compute() == {
        "sparsity/0.weight": pytest.approx(0.5),
        "sparsity/2.weight": pytest.approx(0.2),
        "sparsity/total": pytest.approx(60 / 150),
    }


# ----------------------------------------------------------------------------------------------------------------------
# Imports
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.slow  # a fresh interpreter imports torch: a few seconds
def test_modules_do_not_import_lightning() -> None:
    code = (
        "import sys, lightprune.metrics, lightprune.schedules, lightprune.selection; "
        "assert 'lightning' not in sys.modules and 'lightning.pytorch' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
