"""``lightprune.prune.masking.masked`` against ``torch.where(keep, values, 0)``: values, bits, gradients.

The bit-operation path runs only on the CPU for tensors of at least ``MIN_NUMEL_FOR_BITS`` entries; most tests
lower that threshold to 0 so that small Hypothesis examples take it, and compare with ``torch.where`` bit for bit
(``-0.0``, ``inf``, ``NaN`` payloads included).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lightprune import prune
from lightprune.prune import masking
from lightprune.prune.masking import masked, masked_

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
SPECIALS = (0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -3.5)


@pytest.fixture
def bits_always(monkeypatch: pytest.MonkeyPatch) -> None:
    """Take the bit-operation path for tensors of any size."""
    monkeypatch.setattr(masking, "MIN_NUMEL_FOR_BITS", 0)


def _where(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return torch.where(keep, values, torch.zeros((), dtype=values.dtype))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    width = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(width), b.view(width))


@st.composite
def values_and_keep(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=3)))
    n = int(torch.tensor(shape).prod())
    seed = draw(st.integers(0, 2**31 - 1))
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(n, generator=generator, dtype=torch.float64)
    specials = draw(st.lists(st.tuples(st.integers(0, n - 1), st.sampled_from(SPECIALS)), max_size=n))
    for index, special in specials:
        values[index] = special
    keep = torch.rand(n, generator=generator) < draw(st.floats(0.0, 1.0))
    values, keep = values.to(dtype).reshape(shape), keep.reshape(shape)
    if draw(st.booleans()) and values.dim() >= 2:  # non-contiguous operands
        values, keep = values.transpose(0, 1), keep.transpose(0, 1)
    return values, keep


@settings(max_examples=300, deadline=None)
@given(values_and_keep())
def test_bits_path_equals_torch_where_bit_for_bit(case: tuple[torch.Tensor, torch.Tensor]) -> None:
    values, keep = case
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(masking, "MIN_NUMEL_FOR_BITS", 0)
        assert masking._bits_apply(values, keep)
        out = masked(values, keep)
    assert _same_bits(out, _where(values, keep))
    assert not torch.signbit(out[~keep]).any()  # pruned entries are +0.0, as torch.where's zero


@settings(max_examples=100, deadline=None)
@given(values_and_keep())
def test_gradient_equals_torch_where(case: tuple[torch.Tensor, torch.Tensor]) -> None:
    values, keep = case
    grad_out = torch.randn(values.shape, dtype=torch.float64).to(values.dtype)
    grads = []
    for path in ("bits", "where"):
        leaf = values.detach().clone().requires_grad_()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(masking, "MIN_NUMEL_FOR_BITS", 0 if path == "bits" else 2**62)
            out = masked(leaf, keep)
        assert (out.grad_fn is not None) and (type(out.grad_fn).__name__ != "WhereBackward0") == (path == "bits")
        out.backward(grad_out)
        grads.append(leaf.grad)
    assert _same_bits(grads[0], grads[1])


@pytest.mark.usefixtures("bits_always")
def test_expanded_and_non_contiguous_gradients() -> None:
    values = torch.randn(64, 33, requires_grad=True)
    keep = torch.rand(64, 33) < 0.3
    masked(values, keep).sum().backward()  # the gradient arrives expanded (stride 0)
    assert torch.equal(values.grad, keep.to(values.dtype))
    values.grad = None
    (masked(values, keep).t() * torch.arange(64.0)).sum().backward()
    assert torch.equal(values.grad, torch.where(keep, torch.arange(64.0)[:, None].expand(64, 33), 0.0))


@pytest.mark.usefixtures("bits_always")
def test_double_backward_matches_torch_where() -> None:
    def second_derivative(fn) -> torch.Tensor:
        x = torch.linspace(-2, 2, 40, dtype=torch.float64).reshape(5, 8).requires_grad_()
        keep = torch.arange(40).reshape(5, 8) % 3 != 0
        (grad,) = torch.autograd.grad((fn(x, keep) ** 3).sum(), x, create_graph=True)
        (hess_diag,) = torch.autograd.grad(grad.sum(), x)
        return hess_diag

    assert torch.equal(second_derivative(masked), second_derivative(_where))
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    keep = torch.rand(3, 4) < 0.5
    assert torch.autograd.gradcheck(lambda t: masked(t, keep), (x,))
    assert torch.autograd.gradgradcheck(lambda t: masked(t, keep), (x,))


def test_paths_taken() -> None:
    big = torch.randn(masking.MIN_NUMEL_FOR_BITS)
    keep = torch.ones_like(big, dtype=torch.bool)
    assert masking._bits_apply(big, keep)
    assert masking._bits_apply(nn.Parameter(big), keep)
    assert not masking._bits_apply(big[:-1], keep[:-1])  # small: torch.where
    assert not masking._bits_apply(big.to(torch.int32), keep)  # not floating
    assert not masking._bits_apply(big.to(torch.complex64), keep)
    assert not masking._bits_apply(big, keep.float())  # not a bool mask
    assert not masking._bits_apply(big[None], keep)  # broadcasting: torch.where
    assert not masking._bits_apply(big.to("meta"), keep.to("meta"))
    with torch.no_grad():
        assert type(masked(big.requires_grad_(), keep)) is torch.Tensor  # no autograd node without grad mode


def test_under_torch_func_transforms_falls_back_to_where() -> None:
    values = torch.randn(masking.MIN_NUMEL_FOR_BITS + 5)
    keep = torch.rand(values.shape) < 0.5
    grad = torch.func.grad(lambda v: masked(v, keep).sin().sum())(values)
    assert torch.equal(grad, torch.where(keep, values.cos(), 0.0))
    batched = torch.func.vmap(lambda v: masked(v, keep))(values.expand(3, -1))
    assert torch.equal(batched, _where(values, keep).expand(3, -1))


@pytest.mark.usefixtures("bits_always")
def test_pruned_layer_with_bool_mask_trains_like_a_float_mask() -> None:
    torch.manual_seed(0)
    layers = [nn.Linear(30, 20) for _ in range(2)]
    layers[1].load_state_dict(layers[0].state_dict())
    prune.l1_unstructured(layers[0], "weight", amount=0.7)
    with prune.mask_dtype(torch.bool):
        prune.l1_unstructured(layers[1], "weight", amount=0.7)
    assert torch.equal(layers[0].weight_mask.bool(), layers[1].weight_mask)
    x = torch.randn(8, 30)
    for layer in layers:
        optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
        for _ in range(3):
            optimizer.zero_grad()
            layer(x).pow(2).sum().backward()
            optimizer.step()
    assert type(layers[1].weight.grad_fn).__name__ == "_KeepWhereBackward"
    assert torch.equal(layers[0].weight, layers[1].weight)
    assert torch.equal(layers[0].weight_orig, layers[1].weight_orig)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mask_kind", ["bool", "float", "non-contiguous bool"])
def test_masked_in_place_zeroes_exactly_where_the_mask_prunes(dtype: torch.dtype, mask_kind: str) -> None:
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(64, 33, generator=generator).to(dtype)
    values[0, :3] = torch.tensor([float("inf"), float("nan"), -0.0])
    keep = torch.rand(64, 33, generator=generator) > 0.5
    keep[0, :3] = False
    expected = torch.where(keep, values, torch.zeros((), dtype=dtype))
    mask: torch.Tensor = keep
    if mask_kind == "float":
        mask = keep.to(dtype)
        expected = values * mask  # a floating mask multiplies: inf * 0 is NaN, as torch's own masks give
    elif mask_kind == "non-contiguous bool":
        values, mask, expected = values.t(), keep.t(), expected.t()
    out = masked_(values, mask)
    assert out is values
    assert torch.equal(values.isnan(), expected.isnan())
    finite = ~expected.isnan()
    assert torch.equal(values[finite], expected[finite])
    if mask_kind != "float":  # a bool mask gives +0 even over inf and NaN
        assert not bool(values[~mask].isnan().any()) and bool((values[~mask] == 0).all())


def test_masked_in_place_works_chunk_by_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(masking, "MASK_CHUNK", 100)  # 21 chunks, the last one short
    generator = torch.Generator().manual_seed(1)
    values = torch.randn(41, 50, generator=generator)
    keep = torch.rand(41, 50, generator=generator) > 0.3
    expected = torch.where(keep, values, 0.0)
    masked_(values, keep)
    assert torch.equal(values, expected)


@st.composite
def many_values_and_keeps(draw: st.DrawFn) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A few tensors of mixed dtypes and shapes (empty ones included), bool or 0/1 floating masks, some transposed."""
    values, keeps = [], []
    for _ in range(draw(st.integers(0, 5))):
        dtype = draw(st.sampled_from(DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 9), min_size=0, max_size=3)))
        n = int(torch.tensor(shape, dtype=torch.int64).prod())
        generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
        flat = torch.randn(n, generator=generator, dtype=torch.float64)
        for index, special in draw(st.lists(st.tuples(st.integers(0, max(n - 1, 0)), st.sampled_from(SPECIALS)))):
            if n:
                flat[index] = special
        keep = (torch.rand(n, generator=generator) < draw(st.floats(0.0, 1.0))).reshape(shape)
        value = flat.to(dtype).reshape(shape)
        if draw(st.booleans()) and value.dim() >= 2:  # non-contiguous operands
            value, keep = value.transpose(0, 1), keep.transpose(0, 1)
        mask_dtype = draw(st.sampled_from([torch.bool, torch.bool, torch.float32, dtype]))
        values.append(value)
        keeps.append(keep.to(mask_dtype))
    return values, keeps


@settings(max_examples=200, deadline=None)
@given(many_values_and_keeps(), st.sampled_from([3, 17, masking.MASK_CHUNK]))
def test_masked_all_equals_torch_where_bit_for_bit(
    case: tuple[list[torch.Tensor], list[torch.Tensor]], chunk: int
) -> None:
    values, keeps = case
    expected = [_where(value, keep.bool()) for value, keep in zip(values, keeps, strict=True)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(masking, "MASK_CHUNK", chunk)  # small chunks: tensors cut and packed into many batches
        masking.masked_all_(values, keeps)
    for value, keep, want in zip(values, keeps, expected, strict=True):
        assert _same_bits(value, want)
        assert not torch.signbit(value[~keep.bool()]).any()  # +0.0 where pruned, even over -0.0, inf and NaN


def test_masked_all_takes_parameters_and_gradients_in_one_call() -> None:
    layers = [nn.Linear(40, 30), nn.Linear(30, 2)]
    keeps = [torch.rand(layer.weight.shape) < 0.2 for layer in layers]
    sum(layer(torch.randn(5, 40 if i == 0 else 30)).sum() for i, layer in enumerate(layers)).backward()
    grads = [layer.weight.grad.clone() for layer in layers]
    weights = [layer.weight.detach().clone() for layer in layers]
    masking.masked_all_([layer.weight.grad for layer in layers] + [layer.weight for layer in layers], keeps * 2)
    for layer, keep, grad, weight in zip(layers, keeps, grads, weights, strict=True):
        assert torch.equal(layer.weight.grad, torch.where(keep, grad, 0.0))
        assert torch.equal(layer.weight.detach(), torch.where(keep, weight, 0.0))
        assert layer.weight.grad_fn is None and layer.weight.requires_grad  # still a leaf Parameter


def test_masked_all_refuses_mismatched_arguments() -> None:
    with pytest.raises(ValueError, match="one mask per tensor: got 2 tensors and 1 masks"):
        masking.masked_all_([torch.ones(3), torch.ones(3)], [torch.ones(3, dtype=torch.bool)])
    with pytest.raises(ValueError, match=r"a mask of shape \(3,\) for a tensor of shape \(1, 3\)"):
        masking.masked_all_([torch.ones(1, 3)], [torch.ones(3, dtype=torch.bool)])


def test_masked_all_allocates_nothing_after_its_first_call() -> None:
    values = [torch.randn(700, 900), torch.randn(50, 60), torch.randn(100, dtype=torch.float64)]
    keeps = [torch.rand(v.shape) < 0.1 for v in values]
    masking.masked_all_(values, keeps)  # the thread's scratch buffers are made once, here
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profile:
        masking.masked_all_(values, keeps)
        masking.masked_(values[0], keeps[0])
    allocated = [(event.name, event.cpu_memory_usage) for event in profile.events() if event.cpu_memory_usage > 0]
    assert allocated == []
    # the same profiler does see an allocating mask (the check can fail)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profile:
        values[0].masked_fill_(~keeps[0], 0)
    assert sum(event.cpu_memory_usage for event in profile.events() if event.cpu_memory_usage > 0) >= keeps[0].numel()


@st.composite
def plan_case(draw: st.DrawFn) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.dtype], list[bool]]:
    """Contiguous tensors, their masks and dtypes for a plan; some tensors missing, and sometimes one that the plan
    was not made for (another dtype, or transposed)."""
    values, keeps = draw(many_values_and_keeps())
    values = [value.contiguous() for value in values]
    keeps = [keep.contiguous() for keep in keeps]
    dtypes = [value.dtype for value in values]
    present = [draw(st.booleans()) or not values for _ in values]
    if values and draw(st.integers(0, 4)) == 0:  # a tensor the plan does not fit: masked_all_ takes the call
        index = draw(st.integers(0, len(values) - 1))
        other = torch.float64 if values[index].dtype != torch.float64 else torch.float32
        values[index] = values[index].to(other)
    return values, keeps, dtypes, present


@settings(max_examples=200, deadline=None)
@given(plan_case(), st.sampled_from([3, 17, masking.MASK_CHUNK]), st.integers(1, 3), st.sampled_from([0, 1 << 30]))
def test_mask_plan_equals_torch_where_bit_for_bit(case: tuple, chunk: int, calls: int, kept: int) -> None:
    values, keeps, dtypes, present = case
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(masking, "MASK_CHUNK", chunk)  # small chunks: tensors cut and packed into many batches
        plan = masking.MaskPlan(keeps, dtypes, keep_widened_bytes=kept)  # kept: masks widened once, not per call
        for _ in range(calls):  # the prepared batches are reused
            fresh = [value.clone() for value in values]
            expected = [_where(value, keep.bool()) for value, keep in zip(fresh, keeps, strict=True)]
            plan.apply_([value if here else None for value, here in zip(fresh, present, strict=True)])
            for value, original, want, here in zip(fresh, values, expected, present, strict=True):
                assert _same_bits(value, want if here else original)


def test_mask_plan_reads_the_masks_at_every_call_and_refuses_a_wrong_count() -> None:
    keep = torch.tensor([True, False, True, True])
    plan = masking.MaskPlan([keep], [torch.float32])
    values = torch.tensor([1.0, 2.0, 3.0, float("nan")])
    plan.apply_([values])
    assert values[:3].tolist() == [1.0, 0.0, 3.0] and bool(values[3].isnan())
    keep[0] = False  # changed in place: seen by the next call
    plan.apply_([values])
    assert values[:3].tolist() == [0.0, 0.0, 3.0] and bool(values[3].isnan())
    with pytest.raises(ValueError, match="a plan of 1 masks applied to 2 tensors"):
        plan.apply_([values, values])
    with pytest.raises(ValueError, match="one dtype per mask: got 1 masks and 0 dtypes"):
        masking.MaskPlan([keep], [])


def test_mask_plan_allocates_nothing_after_its_first_call() -> None:
    values = [torch.randn(700, 900), torch.randn(50, 60), torch.randn(100, dtype=torch.float64)]
    keeps = [torch.rand(v.shape) < 0.1 for v in values]
    plan = masking.MaskPlan(keeps, [v.dtype for v in values])
    plan.apply_(values)  # the thread's scratch buffers and the plan's batches are made once, here
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profile:
        plan.apply_(values)
    assert [(event.name, event.cpu_memory_usage) for event in profile.events() if event.cpu_memory_usage > 0] == []


def _ops_of_one_call(plan: masking.MaskPlan, values: list[torch.Tensor]) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        plan.apply_(values)
    return [event.name for event in profile.events() if event.name.startswith("aten::_foreach")]


def test_mask_plan_keeps_its_widened_masks_within_the_budget_and_only_there() -> None:
    values = [torch.randn(300, 784), torch.randn(100, 300), torch.randn(10, 100, dtype=torch.float64)]
    keeps = [torch.rand(v.shape) < 0.1 for v in values]
    widened = sum(keep.numel() * (8 if v.dtype == torch.float64 else 4) for v, keep in zip(values, keeps, strict=True))
    kept = masking.MaskPlan(keeps, [v.dtype for v in values], keep_widened_bytes=widened)
    first = _ops_of_one_call(kept, [v.clone() for v in values])  # widens the masks once, into the plan's buffers
    later = _ops_of_one_call(kept, values)
    assert first.count("aten::_foreach_copy_") == 2 and later == ["aten::_foreach_mul_"] * 2  # one multiply a dtype
    assert all(_same_bits(v, _where(v, k)) for v, k in zip(values, keeps, strict=True))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profile:
        kept.apply_(values)
    assert [event.cpu_memory_usage for event in profile.events() if event.cpu_memory_usage > 0] == []

    over = masking.MaskPlan(keeps, [v.dtype for v in values], keep_widened_bytes=widened - 1)  # one byte short
    over.apply_([v.clone() for v in values])
    assert "aten::_foreach_copy_" in _ops_of_one_call(over, values)  # widened at every call, through the scratch
    keeps[0][0, 0] = False  # so an in-place change of a mask is seen
    value = torch.ones(300, 784)
    over.apply_([value, None, None])
    assert value[0, 0].item() == 0.0
    with pytest.raises(ValueError, match="keep_widened_bytes must be >= 0, got -1"):
        masking.MaskPlan(keeps, [torch.float32] * 3, keep_widened_bytes=-1)


@pytest.mark.parametrize("requires_grad", [False, True])
def test_forward_mode_tangents_are_masked_as_torch_where_masks_them(requires_grad: bool) -> None:
    """Forward-mode AD (``torch.func.jvp``, ``forward_ad.make_dual``) through a large bool mask: the bit path has no
    tangent rule, so dual tensors take ``torch.where`` (before: the tangent was dropped, or a NotImplementedError)."""
    from torch.autograd import forward_ad

    values = torch.randn(256, 256, requires_grad=requires_grad)
    keep = torch.rand(256, 256) < 0.5
    tangent = torch.randn(256, 256)
    with forward_ad.dual_level():
        out = masked(forward_ad.make_dual(values, tangent), keep)
        primal, out_tangent = forward_ad.unpack_dual(out)
    assert out_tangent is not None
    assert torch.equal(out_tangent, torch.where(keep, tangent, 0.0))
    assert torch.equal(primal, torch.where(keep, values, 0.0))


def test_jvp_through_a_pruned_layer_with_bool_masks_is_torchs() -> None:
    torch.manual_seed(0)
    layers = [nn.Linear(256, 256) for _ in range(2)]
    layers[1].load_state_dict(layers[0].state_dict())
    torch.nn.utils.prune.l1_unstructured(layers[0], "weight", amount=0.5)
    with prune.mask_dtype(torch.bool):
        prune.l1_unstructured(layers[1], "weight", amount=0.5)
    x, tangent = torch.randn(3, 256), torch.randn(256, 256)
    found = []
    for layer in layers:
        params = {name: p.detach() for name, p in layer.named_parameters()}
        _, jvp = torch.func.jvp(
            lambda orig, layer=layer, params=params: torch.func.functional_call(
                layer, {**params, "weight_orig": orig}, (x,)
            ),
            (params["weight_orig"],),
            (tangent,),
        )
        found.append(jvp)
    torch.testing.assert_close(found[1], found[0])
