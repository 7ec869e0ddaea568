"""OBS pruning with the SparseGPT update (``lightprune.prune.obs``) against a plain reference written here.

The reference follows the algorithm as its paper states it, column by column with immediate updates of every later
column (no lazy block updates), the inverse Hessian from ``torch.linalg.inv`` and its Cholesky factor, and the
selection by Python's ``sorted`` on ``(saliency, index)``; in float64 the masks must be equal and the weights within
1e-10.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from lightprune import prune
from lightprune.prune.obs import sparsegpt

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _spread(count: int, eligible: list[int]) -> list[int]:
    """Per block: ``round(count * eligible so far / eligible)`` minus the same at the block's start."""
    total, running, done, out = max(sum(eligible), 1), 0, 0, []
    for size in eligible:
        running += size
        target = round(count * running / total)
        out.append(min(target - done, size))
        done = target
    return out


def reference(
    weight: Tensor,
    hessian: Tensor,
    keep: Tensor | None,
    *,
    counts: int | list[int] | None = None,
    per_row: bool = False,
    nm: tuple[int, int] | None = None,
    blocksize: int = 128,
    dampening: float = 0.01,
    reconstruct: bool = True,
) -> tuple[Tensor, Tensor]:
    w = weight.double().clone()
    h = hessian.double().clone()
    rows, cols = w.shape
    kept = torch.ones(rows, cols, dtype=torch.bool) if keep is None else keep.bool().clone()
    w[~kept] = 0
    for j in range(cols):
        if h[j, j] == 0:
            h[j, j] = 1
            w[:, j] = 0
    h += dampening * torch.diagonal(h).mean() * torch.eye(cols, dtype=torch.float64)
    u = torch.linalg.cholesky(torch.linalg.inv(h)).T  # upper: H^-1 = U^T U
    blocks = [(s, min(s + blocksize, cols)) for s in range(0, cols, blocksize)]
    if nm is None:
        eligible = [[int(kept[r, s:e].sum()) for s, e in blocks] for r in range(rows)]
        if per_row:
            wanted = counts if isinstance(counts, list) else [counts] * rows
            plan = [_spread(wanted[r], eligible[r]) for r in range(rows)]
        else:
            plan = [_spread(counts, [sum(col) for col in zip(*eligible, strict=True)])]  # type: ignore[arg-type]
    for b, (s, e) in enumerate(blocks):
        if nm is None:
            score = {(r, c): float(w[r, c] ** 2 / u[c, c] ** 2) for r in range(rows) for c in range(s, e) if kept[r, c]}
            if per_row:
                for r in range(rows):
                    ranked = sorted((c for c in range(s, e) if kept[r, c]), key=lambda c: (score[r, c], c))
                    for c in ranked[: plan[r][b]]:
                        kept[r, c] = False
            else:
                ranked = sorted(score, key=lambda rc: (score[rc], rc[0] * (e - s) + rc[1] - s))
                for r, c in ranked[: plan[0][b]]:
                    kept[r, c] = False
        for c in range(s, e):
            if nm is not None and (c - s) % nm[1] == 0:
                n, m = nm
                for r in range(rows):
                    group = range(c, c + m)
                    alive = [j for j in group if kept[r, j]]
                    ranked = sorted(alive, key=lambda j: (float(w[r, j] ** 2 / u[j, j] ** 2), j))
                    for j in ranked[: max(m - n - (m - len(alive)), 0)]:
                        kept[r, j] = False
            for r in range(rows):
                q = w[r, c] if kept[r, c] else torch.zeros((), dtype=torch.float64)
                if reconstruct:
                    error = (w[r, c] - q) / u[c, c]
                    for c2 in range(c + 1, cols):
                        w[r, c2] -= error * u[c, c2]
                w[r, c] = q
    if reconstruct:  # a row whose reconstruction costs more output error than masking keeps its masked weights
        start = weight.double() * (keep.bool() if keep is not None else 1)
        for j in range(cols):  # dead inputs: zeroed for the ranking only, their kept weights come back
            if hessian[j, j] == 0:
                w[:, j] = start[:, j] * kept[:, j]
        for r in range(rows):
            masked = start[r] * kept[r]
            if (w[r] - start[r]) @ hessian.double() @ (w[r] - start[r]) > (masked - start[r]) @ hessian.double() @ (
                masked - start[r]
            ):
                w[r] = masked
    else:  # no update: the dead columns were zeroed for the ranking only, the kept weights stay as they were
        w = weight.double() * kept
    return w, kept


@st.composite
def layers(draw: st.DrawFn) -> dict:
    rows = draw(st.integers(1, 5))
    cols = 4 * draw(st.integers(1, 5))
    tokens = draw(st.integers(1, 3 * cols))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, cols, generator=gen, dtype=torch.float64)
    dead = draw(st.lists(st.integers(0, cols - 1), max_size=2))
    x[:, dead] = 0
    weight = torch.randn(rows, cols, generator=gen, dtype=torch.float64)
    keep = None
    if draw(st.booleans()):
        keep = torch.rand(rows, cols, generator=gen) > draw(st.sampled_from([0.2, 0.5]))
    mode = draw(st.sampled_from(["block", "row", "nm"]))
    case = {
        "weight": weight,
        "hessian": x.T @ x,
        "keep": keep,
        "blocksize": draw(st.sampled_from([4, 8, 128])),
        "reconstruct": draw(st.booleans()),
        "x": x,
    }
    alive = torch.ones(rows, cols, dtype=torch.bool) if keep is None else keep
    if mode == "nm":
        case["nm"] = draw(st.sampled_from([(2, 4), (1, 4), (3, 4)]))
    elif mode == "row":
        case["per_row"] = True
        case["counts"] = [draw(st.integers(0, int(alive[r].sum()))) for r in range(rows)]
    else:
        case["counts"] = draw(st.integers(0, int(alive.sum())))
    return case


def _ours(case: dict) -> tuple[Tensor, Tensor]:
    counts = case.get("counts")
    n, m = case.get("nm", (None, None))
    return sparsegpt(
        case["weight"], case["hessian"], keep=case["keep"], per_row=case.get("per_row", False), n=n, m=m,
        counts=torch.tensor(counts) if isinstance(counts, list) else counts, blocksize=case["blocksize"],
        reconstruct=case["reconstruct"], dtype=torch.float64,
    )  # fmt: skip


@SETTINGS
@given(layers())
def test_matches_the_reference_in_float64(case: dict) -> None:
    new, kept = _ours(case)
    ref_w, ref_keep = reference(
        case["weight"], case["hessian"], case["keep"], counts=case.get("counts"), per_row=case.get("per_row", False),
        nm=case.get("nm"), blocksize=case["blocksize"], reconstruct=case["reconstruct"],
    )  # fmt: skip
    assert torch.equal(kept, ref_keep)
    torch.testing.assert_close(new, ref_w, rtol=0, atol=1e-10)
    assert torch.equal(new[~kept], torch.zeros_like(new[~kept]))


@SETTINGS
@given(layers())
def test_counts_patterns_and_earlier_masks_hold(case: dict) -> None:
    _, kept = _ours(case)
    before = torch.ones_like(kept) if case["keep"] is None else case["keep"]
    assert not bool((kept & ~before).any()), "an entry pruned before came back"
    if "nm" in case:
        n, m = case["nm"]
        groups = kept.view(kept.shape[0], -1, m)
        alive = before.view(groups.shape).sum(dim=-1)
        assert torch.equal(groups.sum(dim=-1), alive.clamp(max=n))
    elif case.get("per_row"):
        assert (before.sum(dim=1) - kept.sum(dim=1)).tolist() == case["counts"]
    else:
        assert int(before.sum() - kept.sum()) == case["counts"]


@SETTINGS
@given(layers())
def test_reconstruction_never_increases_the_output_error(case: dict) -> None:
    x, weight = case["x"], case["weight"]
    case = {**case, "reconstruct": True}
    new, kept = _ours(case)
    target = weight if case["keep"] is None else torch.where(case["keep"], weight, 0.0)
    error_obs = ((new - target) @ x.T).pow(2).sum(dim=1)
    error_mask = ((target * kept - target) @ x.T).pow(2).sum(dim=1)
    assert bool((error_obs <= error_mask * (1 + 1e-9) + 1e-12).all())


def test_reconstruction_helps_much_on_correlated_inputs() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=gen) @ torch.randn(8, 32, generator=gen)
    x += 0.1 * torch.randn(512, 32, generator=gen)  # correlated inputs, as a network's hidden features are
    weight = torch.randn(16, 32, generator=gen)
    h = x.T @ x
    new, kept = sparsegpt(weight, h, counts=256, dtype=torch.float64)
    error_obs = ((new - weight) @ x.T).pow(2).sum()
    error_mask = ((weight * kept - weight) @ x.T).pow(2).sum()
    assert error_obs < 0.5 * error_mask


def test_dead_inputs_give_no_nan_and_zero_weights() -> None:
    x = torch.randn(3, 8)  # fewer tokens than columns: H is singular
    x[:, 2] = 0
    layer = nn.Linear(8, 4)
    prune.obs_unstructured(layer, "weight", prune.input_second_moment(layer, x), amount=0.25)
    assert bool(torch.isfinite(layer.weight).all())
    assert torch.equal(layer.weight[:, 2], torch.zeros(4))


def test_kept_weights_of_dead_inputs_stay_with_reconstruction_too() -> None:
    """SparseGPT zeroes the weights of inputs that are always zero; the mask kept some of them, so they stay (no
    update reaches them): the layer holds exactly the zeros its mask says, and is not emptied unannounced."""
    torch.manual_seed(0)
    x = torch.randn(16, 8)
    x[:, 2:8] = 0  # six dead input features
    layer = nn.Linear(8, 4)
    weight = layer.weight.detach().clone()
    prune.obs_unstructured(layer, "weight", prune.input_second_moment(layer, x), amount=0.5, per_row=True)
    kept = layer.weight_mask.bool()
    assert int((layer.weight == 0).sum()) == int((~kept).sum()) == 16
    assert torch.equal(layer.weight[:, 2:][kept[:, 2:]], weight[:, 2:][kept[:, 2:]])


def test_without_reconstruction_dead_inputs_rank_first_and_kept_weights_stay() -> None:
    """``reconstruct=False`` leaves the kept weights as they are: the dead columns are zeroed for the ranking only
    (before, they were zeroed in the layer too: 6 zeros a row under a mask of 4)."""
    torch.manual_seed(0)
    x = torch.randn(16, 8)
    x[:, 2:8] = 0  # six dead input features, two of them kept in each row
    layer = nn.Linear(8, 4)
    weight = layer.weight.detach().clone()
    prune.obs_unstructured(layer, "weight", prune.input_second_moment(layer, x), amount=0.5, per_row=True,
                           reconstruct=False)  # fmt: skip
    kept = layer.weight_mask.bool()
    assert kept.sum(dim=1).tolist() == [4] * 4
    assert torch.equal(layer.weight, torch.where(kept, weight, 0))
    assert int((layer.weight == 0).sum()) == 16


def test_transformers_conv1d_is_the_transposed_linear() -> None:
    # tests/prune also runs on the newest torch with torch alone (no transformers there)
    Conv1D = pytest.importorskip("transformers.pytorch_utils").Conv1D

    torch.manual_seed(0)
    linear, conv = nn.Linear(8, 6), Conv1D(6, 8)
    with torch.no_grad():
        conv.weight.copy_(linear.weight.T)
    x = torch.randn(2, 5, 8)
    h = prune.input_second_moment(linear, x)
    assert torch.equal(h, prune.input_second_moment(conv, x))
    prune.obs_unstructured(linear, "weight", h, amount=0.5, per_row=True)
    prune.obs_unstructured(conv, "weight", h, amount=0.5, per_row=True)
    assert torch.equal(conv.weight_mask.T, linear.weight_mask)
    torch.testing.assert_close(conv.weight.T, linear.weight, rtol=0, atol=0)


@pytest.mark.parametrize(
    "make", [lambda: nn.Conv2d(4, 3, 3, padding=1, stride=2), lambda: nn.Conv1d(4, 3, 3, dilation=2)]
)
def test_convolutions_unfold_their_inputs(make) -> None:
    torch.manual_seed(0)
    conv = make()
    x = torch.randn(6, 4, *([7, 7] if isinstance(conv, nn.Conv2d) else [11]))
    h = prune.input_second_moment(conv, x, dtype=torch.float64)
    dense = conv(x).detach()
    original = conv.weight.detach().clone()
    prune.obs_semi_structured(conv, "weight", h, n=2, m=4, dtype=torch.float64)
    # N:M groups run over 4 input channels at every output channel and kernel position
    assert torch.equal((conv.weight_mask != 0).sum(dim=1), torch.full_like(conv.weight_mask[:, 0], 2).long())
    error_obs = (conv(x) - dense).pow(2).sum()
    masked = nn.functional.conv2d if isinstance(conv, nn.Conv2d) else nn.functional.conv1d
    plain = masked(x, original * conv.weight_mask, conv.bias, conv.stride, conv.padding, conv.dilation)
    error_mask = (plain - dense).pow(2).sum()
    assert error_obs < error_mask
    # H from the unfolded inputs equals the sum of the layer's own products: the quadratic form of any weight change
    delta = torch.randn_like(original, dtype=torch.float64)
    change = masked(x.double(), delta, None, conv.stride, conv.padding, conv.dilation)
    matrix = delta.movedim(1, -1).reshape(delta.shape[0], -1)
    torch.testing.assert_close(change.pow(2).sum(), (matrix @ h * matrix).sum(), rtol=1e-9, atol=1e-9)


def test_bfloat16_weights_keep_their_dtype() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(16, 8).to(torch.bfloat16)
    x = torch.randn(64, 16)
    twin = nn.Linear(16, 8)
    with torch.no_grad():
        twin.weight.copy_(layer.weight.float())
    h = prune.input_second_moment(layer, x)
    prune.obs_unstructured(layer, "weight", h, amount=0.5)
    prune.obs_unstructured(twin, "weight", h, amount=0.5)
    assert layer.weight.dtype == torch.bfloat16
    assert torch.equal(layer.weight_mask.bool(), twin.weight_mask.bool())
    torch.testing.assert_close(layer.weight.float(), twin.weight, rtol=1e-2, atol=1e-2)


def test_composes_with_an_earlier_mask_on_the_module() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(8, 4)
    prune.l1_unstructured(layer, "weight", amount=8)
    first = layer.weight_mask.clone()
    h = prune.input_second_moment(layer, torch.randn(32, 8))
    prune.obs_unstructured(layer, "weight", h, amount=0.5)
    assert not bool((layer.weight_mask.bool() & ~first.bool()).any())
    assert int((layer.weight_mask == 0).sum()) == 8 + 12
    assert torch.equal(layer.weight[first == 0], torch.zeros(8))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: sparsegpt(torch.ones(2, 4), torch.full((4, 4), float("nan")), counts=1, layer="enc.q"), "enc.q"),
        (lambda: sparsegpt(torch.ones(2, 4), -torch.eye(4), counts=1, layer="enc.k"), "enc.k: its input second"),
        (lambda: sparsegpt(torch.ones(2, 4), torch.eye(3), counts=1), r"expected \(4, 4\)"),
        (lambda: sparsegpt(torch.ones(2, 4), torch.eye(4), counts=9), "cannot prune 9 more entries"),
        (lambda: sparsegpt(torch.ones(2, 6), torch.eye(6), n=2, m=4, layer="fc"), "fc with m=4"),
        (lambda: sparsegpt(torch.ones(2, 4), torch.eye(4), counts=1, dtype=torch.float16), "float16"),
        (lambda: prune.obs_unstructured(nn.Conv3d(2, 2, 1), "weight", torch.eye(2), 0.5), "Conv3d"),
        (lambda: prune.obs_semi_structured(nn.Conv2d(2, 2, 2), "weight", torch.eye(8)), "input channels"),
    ],
)
def test_refusals_name_the_problem(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


def test_the_second_moment_is_summed_in_float32_under_autocast() -> None:
    """A mixed-precision fit runs forward hooks inside autocast, which would compute a float32 matmul in bfloat16."""
    torch.manual_seed(0)
    layer, x = nn.Linear(64, 4), torch.randn(256, 64)
    exact = (x.double().t() @ x.double()).float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = prune.input_second_moment(layer, x)
    assert h.dtype == torch.float32
    torch.testing.assert_close(h, exact, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("pruned_before", [False, True], ids=["dense layer", "already pruned layer"])
def test_an_undone_transaction_puts_obs_updated_weights_back(pruned_before: bool) -> None:
    """OBS writes the updated weights in place: undone, the transaction had restored the masks but left the layer
    dense with the SparseGPT-updated weights (a model no code asked for)."""
    torch.manual_seed(0)
    layer, other = nn.Linear(8, 4), nn.Linear(8, 4)
    if pruned_before:
        prune.l1_unstructured(layer, "weight", amount=0.25)
    before = {name: tensor.detach().clone() for name, tensor in layer.state_dict().items()}
    hessian = prune.input_second_moment(layer, torch.randn(64, 8))
    block = prune.transaction([(layer, "weight"), (other, "weight")])
    with pytest.raises(ValueError, match="larger than the number of units"), block:
        prune.obs_unstructured(layer, "weight", hessian, amount=0.5)
        assert not torch.equal(
            prune.original(layer, "weight").detach(), before.get("weight_orig", before.get("weight"))
        )
        prune.l1_unstructured(other, "weight", amount=100)  # fails: undoes the block
    after = layer.state_dict()
    assert sorted(after) == sorted(before)
    assert all(torch.equal(after[name], before[name]) for name in before)
    if pruned_before:
        assert torch.equal(layer.weight, prune.original(layer, "weight") * layer.weight_mask)


def test_an_update_past_float16s_range_leaves_the_row_masked_not_infinite() -> None:
    """The update runs in float32 and was cast back without a range check: a kept float16 weight moved past 65504
    became inf, silently. Such a row is masked without the update; the other rows keep theirs."""
    torch.manual_seed(0)
    layer = nn.Linear(4, 2, bias=False).half()
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[40000.0, 39000.0, 1.0, 1.0], [1.0, 2.0, 3.0, 4.0]]))
    x = torch.randn(256, 4)
    x[:, 1] = x[:, 0] + 1e-3 * torch.randn(256)  # two nearly equal inputs: the update moves one weight onto the other
    before = layer.weight.detach().clone()
    hessian = prune.input_second_moment(layer, x)
    wide, kept = sparsegpt(before.float(), hessian, counts=3, per_row=True)
    assert float(wide.abs().max()) > 65504  # (in float32 the update leaves float16's range)
    prune.obs_unstructured(layer, "weight", hessian, amount=3, per_row=True)
    weight, mask = layer.weight.detach(), layer.weight_mask.bool()
    assert bool(torch.isfinite(weight).all()) and torch.equal(mask, kept)
    assert torch.equal(weight[0], before[0] * mask[0])  # masked only
    assert torch.equal(weight[1], wide[1].half())  # updated as in float32


@pytest.mark.parametrize("shape", [(4, 0), (0, 4)], ids=["no inputs", "no outputs"])
def test_zero_size_layers_prune_nothing_as_every_other_method(shape: tuple[int, int]) -> None:
    """rowwise_l1_unstructured and input_second_moment failed on empty layers inside torch's reshape."""
    layer = nn.Linear(*shape)
    prune.rowwise_l1_unstructured(layer, "weight", amount=0.5)
    assert layer.weight_mask.shape == layer.weight.shape == (shape[1], shape[0])
    hessian = prune.input_second_moment(layer, torch.randn(5, shape[0]))
    assert hessian.shape == (shape[0], shape[0])
