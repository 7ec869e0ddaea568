"""SparseLinear and to_sparse_linear: the same outputs as the dense layers, conversions decided by measurement."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.utils import prune as torch_prune

from lightprune import prune
from lightprune.export import Latency, SparseLinear, compare_latency, measure_latency, to_sparse_linear

pytestmark = pytest.mark.usefixtures("one_thread_for_module")


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(7, 64), (2, 3, 64), (64,)])
def test_sparse_linear_matches_dense(bias, shape):
    torch.manual_seed(0)
    layer = nn.Linear(64, 48, bias=bias)
    prune.l1_unstructured(layer, "weight", amount=0.9)
    sparse = SparseLinear.from_linear(layer)
    assert sparse.weight.layout == torch.sparse_csr and sparse.weight._nnz() == 64 * 48 - round(0.9 * 64 * 48)
    x = torch.randn(shape)
    with torch.no_grad():
        assert_close(sparse(x), layer(x))


def test_sparse_linear_refuses_non_matrices():
    with pytest.raises(ValueError, match=r"2-D.*\(3,\)"):
        SparseLinear(torch.ones(3))
    for bias in (torch.zeros(3), torch.zeros(1, 4)):
        with pytest.raises(ValueError, match=r"bias must have shape \(out_features,\) = \(4,\), got shape"):
            SparseLinear(torch.eye(4, 8), bias)


def _net() -> nn.Sequential:
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256), nn.ReLU(), nn.Linear(256, 10))
    prune.l1_unstructured(net[0], "weight", amount=0.99)
    prune.l1_unstructured(net[2], "weight", amount=0.3)
    return net


def test_to_sparse_linear_converts_by_measurement_and_keeps_outputs():
    net = _net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    x = torch.randn(16, 256)
    # margin 0: every timed layer converts; an impossible margin: none does
    fast, decisions = to_sparse_linear(net, x, min_sparsity=0.2, repeats=3, margin=0.0)
    assert [d.name for d in decisions] == ["0", "2", "4"]
    assert [d.converted for d in decisions] == [True, True, False]
    assert decisions[2].dense_s is None and decisions[2].sparsity == 0.0
    assert all(d.dense_s > 0 and d.sparse_s > 0 for d in decisions[:2])
    assert isinstance(fast[0], SparseLinear) and isinstance(fast[2], SparseLinear) and type(fast[4]) is nn.Linear
    net.eval()
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(16, 256)
            assert_close(fast(x), net(x))
    slow, decisions = to_sparse_linear(net, x, min_sparsity=0.2, repeats=3, margin=1e9)
    assert not any(d.converted for d in decisions) and not any(isinstance(m, SparseLinear) for m in slow.modules())
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())


def test_to_sparse_linear_decision_follows_the_timings():
    fast, decisions = to_sparse_linear(_net(), torch.randn(16, 256), min_sparsity=0.9, repeats=3)
    (first,) = [d for d in decisions if d.name == "0"]
    assert first.converted == (first.dense_s >= first.sparse_s)
    assert isinstance(fast[0], SparseLinear) == first.converted


def test_to_sparse_linear_on_a_single_layer_and_bad_arguments():
    layer = nn.Linear(128, 128)
    prune.l1_unstructured(layer, "weight", amount=0.99)
    fast, decisions = to_sparse_linear(layer, torch.randn(4, 128), repeats=2, margin=0.0)
    assert isinstance(fast, SparseLinear) and decisions[0].name == ""
    with pytest.raises(ValueError, match=r"min_sparsity.*1.5"):
        to_sparse_linear(layer, torch.randn(4, 128), min_sparsity=1.5)
    with pytest.raises(ValueError, match=r"margin.*-1"):
        to_sparse_linear(layer, torch.randn(4, 128), margin=-1)
    with pytest.raises(ValueError, match=r"margin.*nan"):
        to_sparse_linear(layer, torch.randn(4, 128), margin=float("nan"))


def test_latency_helpers():
    calls = []
    result = compare_latency(
        {"a": lambda x: calls.append("a"), "b": lambda x: calls.append("b")}, torch.zeros(1), repeats=4, warmup=1
    )
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a", "a", "b"]  # rotated order, warm-up included
    assert list(result) == ["a", "b"] and result["a"].repeats == 4
    stats = Latency.of([0.4, 0.1, 0.2, 0.3])
    assert stats.q1 <= stats.median == 0.25 <= stats.q3
    assert measure_latency(nn.Identity(), torch.zeros(2), repeats=2).repeats == 2
    with pytest.raises(ValueError, match=r"repeats.*0"):
        measure_latency(nn.Identity(), torch.zeros(2), repeats=0)
    with pytest.raises(ValueError, match=r"warmup.*-1"):
        compare_latency({}, torch.zeros(2), warmup=-1)


@pytest.mark.parametrize(
    ("counts", "error", "pattern"),
    [
        ({"repeats": 2.5}, TypeError, r"^repeats=2.5 must be an int .*not a float$"),
        ({"repeats": float("nan")}, TypeError, r"^repeats=nan must be an int"),
        ({"repeats": True}, TypeError, r"^repeats=True must be an int .*not a bool$"),
        ({"repeats": "3"}, TypeError, r"^repeats='3' must be an int"),
        ({"warmup": 1.5}, TypeError, r"^warmup=1.5 must be an int"),
        ({"warmup": False}, TypeError, r"^warmup=False must be an int"),
        ({"repeats": 0}, ValueError, r"^repeats must be at least 1, got 0$"),
    ],
)
def test_latency_refuses_round_counts_that_are_not_ints_before_any_call(counts, error, pattern):
    calls = []
    with pytest.raises(error, match=pattern):
        measure_latency(lambda x: calls.append(x), torch.zeros(1), **counts)
    with pytest.raises(error, match=pattern):
        compare_latency({"a": lambda x: calls.append(x)}, torch.zeros(1), **counts)
    assert calls == []


def test_to_sparse_linear_checks_repeats_before_any_work():
    calls = []
    dense = nn.Sequential(nn.Linear(4, 4))  # no layer is sparse enough to be timed: repeats was never used
    dense.register_forward_pre_hook(lambda module, args: calls.append(1))
    with pytest.raises(ValueError, match=r"^repeats must be at least 1, got 0$"):
        to_sparse_linear(dense, torch.randn(2, 4), repeats=0)
    with pytest.raises(TypeError, match=r"^repeats=1.5 must be an int"):
        to_sparse_linear(dense, torch.randn(2, 4), repeats=1.5)
    assert calls == []  # refused before the copy ran the model


def test_latency_waits_for_the_gpu_before_and_after_each_timed_call(monkeypatch):
    """A CUDA call returns once its kernels are queued: without a synchronize the timings would be launch times."""
    events = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: events.append("sync"))
    measure_latency(lambda x: events.append("call"), torch.zeros(1), repeats=2, warmup=0)
    assert events == ["sync", "call", "sync"] * 2


def test_hugging_face_conv1d_layers_count_as_linear():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=50, n_positions=16)
    config.bos_token_id = config.eos_token_id = None
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    conv1d = [(name, m) for name, m in model.named_modules() if type(m).__name__ == "Conv1D"]
    assert len(conv1d) == 4
    prune.global_unstructured([(m, "weight") for _, m in conv1d], prune.L1Unstructured, amount=0.95)
    ids = torch.randint(0, 50, (4, 16))
    fast, decisions = to_sparse_linear(model, (ids,), repeats=2, margin=0.0)
    by_name = {d.name: d for d in decisions}
    for name, _ in conv1d:
        assert by_name[name].converted and by_name[name].sparsity > 0.9
        assert isinstance(fast.get_submodule(name), SparseLinear)
    assert not by_name["lm_head"].converted  # dense: below min_sparsity
    with torch.no_grad():
        assert torch.allclose(fast(ids).logits, model(ids).logits, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_dtype_without_a_sparse_kernel_stays_dense_and_says_why(dtype: torch.dtype) -> None:
    net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).to(dtype)
    prune.l1_unstructured(net[0], "weight", amount=0.95)
    x = torch.randn(16, 64, dtype=dtype)
    fast, decisions = to_sparse_linear(net, x, repeats=2, margin=0.0)
    first = decisions[0]
    assert (first.converted, first.dense_s, first.sparse_s) == (False, None, None)
    assert first.note.startswith(f"kept dense: no sparse kernel for {dtype} on cpu")
    assert torch.equal(fast(x), net.eval()(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_sparse_linear_without_a_kernel_for_its_dtype_says_so(dtype: torch.dtype) -> None:
    layer = SparseLinear.from_linear(nn.Linear(8, 4).to(dtype))
    with pytest.raises(NotImplementedError, match=rf"no sparse CSR matmul for a {dtype} weight on cpu"):
        layer(torch.randn(2, 8, dtype=dtype))


def test_sparse_linear_and_converted_models_deep_copy():
    torch.manual_seed(5)
    net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    prune.l1_unstructured(net[0], "weight", amount=0.95)
    fast, _ = to_sparse_linear(net, torch.randn(8, 64), repeats=1, margin=0.0)
    assert isinstance(fast[0], SparseLinear)
    twin = copy.deepcopy(fast)
    assert twin[0].weight.layout == torch.sparse_csr and twin[0].weight is not fast[0].weight
    x = torch.randn(3, 64)
    with torch.no_grad():
        assert torch.equal(twin(x), fast(x))
        fast[0].bias.add_(1.0)  # the copy is independent
        assert not torch.equal(twin(x), fast(x))
    again, _ = to_sparse_linear(fast, torch.randn(8, 64), repeats=1, margin=0.0)
    assert isinstance(again[0], SparseLinear)


def test_a_state_dict_loads_into_a_layer_with_another_nonzero_count():
    """The usual recipe (rebuild the model, then ``load_state_dict``) with a checkpoint of the layer pruned otherwise:
    before, torch's copy into the CSR buffer failed (same shapes, other nonzero counts)."""
    torch.manual_seed(0)
    dense = torch.randn(6, 8)
    saved = SparseLinear(dense * (dense.abs() > 1.0), torch.randn(6))
    target = SparseLinear(torch.randn(6, 8), torch.zeros(6))
    assert saved.weight._nnz() != target.weight._nnz()
    target.load_state_dict(saved.state_dict())
    x = torch.randn(3, 8)
    assert torch.equal(target(x), saved(x)) and target.weight._nnz() == saved.weight._nnz()
    assert target.weight.layout == torch.sparse_csr and target.weight is not saved.weight


def test_a_model_that_cannot_be_copied_is_named():
    class Cached(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.ones(4, requires_grad=True) * 2  # not a leaf: torch cannot deep-copy it

        def forward(self, x):
            return x * self.scale

    net = nn.Sequential(nn.Linear(4, 4), nn.Sequential(Cached()))
    with pytest.raises(RuntimeError, match=r"module '1\.0' \(Cached\) cannot be deep-copied") as info:
        to_sparse_linear(net, torch.randn(2, 4), repeats=1)
    assert "torch.nn.utils.prune" not in str(info.value)
    net = nn.Sequential(nn.Linear(4, 4))
    torch_prune.l1_unstructured(net[0], "weight", amount=0.5)
    with pytest.raises(RuntimeError, match=r"module '0' \(Linear\).*torch\.nn\.utils\.prune.*prune\.remove"):
        to_sparse_linear(net, torch.randn(2, 4), repeats=1)


def test_layers_called_by_keyword_are_timed_and_uncalled_ones_say_why():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.kw = nn.Linear(64, 64)
            self.aux = nn.Linear(64, 4)  # an auxiliary head the inference forward does not use
            self.head = nn.Linear(64, 4)

        def forward(self, x):
            return self.head(self.kw(input=x))

    torch.manual_seed(6)
    net = Net()
    for layer in (net.kw, net.aux):
        prune.l1_unstructured(layer, "weight", amount=0.95)
    fast, decisions = to_sparse_linear(net, torch.randn(8, 64), repeats=1, margin=0.0)
    by_name = {d.name: d for d in decisions}
    assert by_name["kw"].converted and by_name["kw"].sparse_s is not None and by_name["kw"].note == ""
    assert isinstance(fast.kw, SparseLinear)
    assert not by_name["aux"].converted and by_name["aux"].sparse_s is None
    assert by_name["aux"].note == "kept dense, not timed: the model did not call it on example_inputs"
    assert by_name["head"].note == ""  # below min_sparsity
