"""Pruned modules go through torch's tracers and exporters and compute what the eager pruned module computes.

A module under the reparametrization recomputes ``weight = weight_orig * weight_mask`` in a forward pre-hook, so
every tracer sees the masking as part of the forward: ``torch.export.export`` (and ONNX export, built on it),
``torch.jit.trace`` and ``torch.compile``. Each is checked on float and bool masks (a small bool mask is applied
with ``torch.where``, a large one on the CPU with bit operations, see ``masking.py``), unstructured and structured
methods, a container of two methods, global pruning, and after ``remove()``; the traced program must give the
eager pruned module's outputs (ONNX's reference evaluator: up to float rounding) on inputs it was not traced with,
and differ from the unpruned model's.
"""

from __future__ import annotations

import copy
import pickle
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from lightprune import prune
from lightprune.prune.masking import MIN_NUMEL_FOR_BITS


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.fc1 = nn.Linear(8 * 6 * 6, 64)  # 18,432 entries: a bool mask takes the bit-operation path on the CPU
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.relu(self.fc1(torch.relu(self.conv(x)).flatten(1))))


def unstructured(net: Net) -> None:
    prune.l1_unstructured(net.conv, "weight", amount=0.5)
    prune.l1_unstructured(net.fc1, "weight", amount=0.7)


def structured(net: Net) -> None:
    prune.ln_structured(net.conv, "weight", amount=0.5, n=2, dim=0)
    prune.random_structured(net.fc1, "weight", amount=0.25, dim=1)


def container(net: Net) -> None:
    prune.l1_unstructured(net.fc1, "weight", amount=0.3)
    prune.ln_structured(net.fc1, "weight", amount=0.25, n=1, dim=0)  # a PruningContainer of the two
    prune.random_unstructured(net.fc2, "bias", amount=3)


def global_l1(net: Net) -> None:
    targets = [(net.conv, "weight"), (net.fc1, "weight"), (net.fc2, "weight")]
    prune.global_unstructured(targets, prune.L1Unstructured, amount=0.6)


def removed(net: Net) -> None:
    container(net)
    for module, name in ((net.fc1, "weight"), (net.fc2, "bias")):
        prune.remove(module, name)


PRUNINGS: dict[str, Callable[[Net], None]] = {
    "unstructured": unstructured,
    "structured": structured,
    "container": container,
    "global": global_l1,
    "removed": removed,
}
CASES = [(name, dtype) for name in PRUNINGS for dtype in (None, torch.bool)]


def pruned_net(name: str, mask_dtype: torch.dtype | None) -> tuple[Net, Net]:
    """(the pruned net, an unpruned copy of it)."""
    torch.manual_seed(0)
    net = Net()
    dense = copy.deepcopy(net)
    with prune.mask_dtype(mask_dtype):
        PRUNINGS[name](net)
    if mask_dtype is torch.bool and name != "removed":
        assert net.fc1.weight_mask.dtype == torch.bool and net.fc1.weight_mask.numel() >= MIN_NUMEL_FOR_BITS
    return net, dense


def inputs(seed: int) -> Tensor:
    return torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(seed))


def check_outputs(program: Callable[[Tensor], Tensor], net: Net, dense: Net, *, exact: bool = True) -> None:
    for seed in (1, 2):  # the second input was not seen while tracing
        x = inputs(seed)
        expected = net(x)
        got = program(x)
        if exact:
            assert torch.equal(got, expected)
        else:
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(dense(x), expected)  # the masks matter for this input


def id_of(case: object) -> str:
    return "bool" if case is torch.bool else "float" if case is None else str(case)


@pytest.mark.parametrize(("name", "mask_dtype"), CASES, ids=id_of)
def test_torch_export(name: str, mask_dtype: torch.dtype | None) -> None:
    net, dense = pruned_net(name, mask_dtype)
    exported = torch.export.export(net, (inputs(0),))
    if name != "removed":  # the masking is in the program: orig and mask are its parameter and buffer
        assert "fc1.weight_orig" in exported.state_dict and "fc1.weight_mask" in exported.state_dict
    check_outputs(exported.module(), net, dense)


def test_torch_export_strict() -> None:
    # strict mode traces the Python code with TorchDynamo
    net, dense = pruned_net("container", torch.bool)
    check_outputs(torch.export.export(net, (inputs(0),), strict=True).module(), net, dense)


@pytest.mark.parametrize(("name", "mask_dtype"), CASES, ids=id_of)
def test_torch_jit_trace(name: str, mask_dtype: torch.dtype | None) -> None:
    net, dense = pruned_net(name, mask_dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error", torch.jit.TracerWarning)  # a warning here means a constant was baked in
        traced = torch.jit.trace(net, (inputs(0),))
    check_outputs(traced, net, dense)


@pytest.mark.parametrize(("name", "mask_dtype"), CASES, ids=id_of)
def test_torch_compile_fullgraph(name: str, mask_dtype: torch.dtype | None) -> None:
    # aot_eager: TorchDynamo and AOTAutograd (fake tensors, functionalization) as inductor uses them, without the
    # C++ compilation; the forward and the gradients must be the eager module's
    net, dense = pruned_net(name, mask_dtype)
    torch._dynamo.reset()
    compiled = torch.compile(net, fullgraph=True, backend="aot_eager")
    check_outputs(compiled, net, dense)
    x = inputs(3)
    compiled(x).square().sum().backward()
    compiled_grads = {n: p.grad.clone() for n, p in net.named_parameters()}
    net.zero_grad()
    net(x).square().sum().backward()
    for n, p in net.named_parameters():
        assert torch.equal(compiled_grads[n], p.grad), n
    if name != "removed":
        assert bool((net.fc1.weight_orig.grad[net.fc1.weight_mask == 0] == 0).all())


@pytest.mark.parametrize("mask_dtype", [None, torch.bool], ids=id_of)
def test_a_module_compiled_in_place_trains_as_in_eager_mode(mask_dtype: torch.dtype | None) -> None:
    """``nn.Module.compile()``, the in-place form, on a module pruned before it: its forward pre-hooks run inside the
    compiled region, where the masked value must stay a plain tensor (AOT autograd cannot dispatch the subclass)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    with prune.mask_dtype(mask_dtype):
        prune.l1_unstructured(net[0], "weight", amount=0.5)
    eager = copy.deepcopy(net)
    torch._dynamo.reset()
    net.compile(backend="aot_eager")
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(net(x), eager(x), rtol=1e-5, atol=1e-6)
    net(x).square().sum().backward()
    eager(x).square().sum().backward()
    for (n, p), (_, q) in zip(net.named_parameters(), eager.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=n)
    assert bool((net[0].weight_orig.grad[net[0].weight_mask == 0] == 0).all())


class ReadsDirectly(nn.Module):
    """A parent that reads its child's pruned weight without calling the child (as MultiheadAttention reads
    ``out_proj.weight``): the value the pruning stored in eager mode enters the compiled graph as an input."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        x = nn.functional.linear(x, self.fc.weight, self.fc.bias)
        return self.attention(x, x, x, need_weights=False)[0]


@pytest.mark.parametrize("mask_dtype", [None, torch.bool], ids=id_of)
def test_a_compiled_forward_reading_a_pruned_weight_directly_matches_eager(mask_dtype: torch.dtype | None) -> None:
    """The stored value was a Tensor subclass (so that it deep-copied): AOT autograd failed on it ("Multiple
    dispatch failed for aten.t"), where torch.nn.utils.prune compiles; it is a plain tensor now, still copyable."""
    torch.manual_seed(0)
    net = ReadsDirectly()
    with prune.mask_dtype(mask_dtype):
        prune.l1_unstructured(net.fc, "weight", amount=0.5)
        prune.l1_unstructured(net.attention.out_proj, "weight", amount=0.5)
    twin = copy.deepcopy(net)
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    compiled = torch.compile(net, backend="aot_eager")
    torch.testing.assert_close(compiled(x), twin(x), rtol=1e-5, atol=1e-6)
    compiled(x).square().sum().backward()
    assert bool((net.fc.weight_orig.grad[net.fc.weight_mask == 0] == 0).all())
    assert net.attention.out_proj.weight_orig.grad is not None
    assert torch.equal(pickle.loads(pickle.dumps(net)).fc.weight, net.fc.weight)


def test_torch_compile_inductor() -> None:
    net, dense = pruned_net("container", torch.bool)
    torch._dynamo.reset()
    try:
        check_outputs(torch.compile(net, fullgraph=True), net, dense, exact=False)
    finally:
        # torch 2.5's inductor loads C++ built with -ffast-math, which turns on flush-to-zero for the whole
        # process: the later tests would compute with subnormals flushed (off is every process's default)
        torch.set_flush_denormal(False)


@pytest.mark.parametrize(("name", "mask_dtype"), CASES, ids=id_of)
def test_onnx_export(name: str, mask_dtype: torch.dtype | None) -> None:
    pytest.importorskip("onnxscript")  # torch.onnx.export(dynamo=True) needs onnx and onnxscript (dev extra)
    onnx_reference = pytest.importorskip("onnx.reference")
    net, dense = pruned_net(name, mask_dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's notes about optional packages (torchvision...)
        program = torch.onnx.export(net, (inputs(0),), dynamo=True, verbose=False)
    evaluator = onnx_reference.ReferenceEvaluator(program.model_proto)  # ONNX's own reference runtime
    feed = program.model_proto.graph.input[0].name
    check_outputs(lambda x: torch.from_numpy(evaluator.run(None, {feed: x.numpy()})[0]), net, dense, exact=False)


@pytest.mark.parametrize("mask_dtype", [None, torch.bool], ids=id_of)
def test_tracing_keeps_eager_copies_and_pickles_working(mask_dtype: torch.dtype | None) -> None:
    # the pruned attribute deep-copies and pickles (pytorch #37322) after an export traced the module, too
    net, _ = pruned_net("container", mask_dtype)
    torch.export.export(net, (inputs(0),))
    net(inputs(1))
    assert type(net.fc1.weight) is torch.Tensor and net.fc1.weight.grad_fn is not None
    for twin in (copy.deepcopy(net), pickle.loads(pickle.dumps(net))):
        assert torch.equal(twin(inputs(2)), net(inputs(2)))
