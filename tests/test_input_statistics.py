"""The one collector of input statistics (``lightprune.statistics``), against sums written out here token by token;
and its users' checkpoint state (activation, OBS, the units' moments) in the format it always had."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from lightprune.callback.activations import ActivationStats
from lightprune.callback.hessians import HessianStats
from lightprune.statistics import InputStatistics, feature_sums


def reference(batches: list[tuple[Tensor, Tensor]]) -> dict[str, Tensor]:
    """Squares, sums, token count and ``X^T X`` over the real positions, one token at a time (float64)."""
    features = batches[0][0].shape[-1]
    found = {
        "squares": torch.zeros(features, dtype=torch.float64),
        "sum": torch.zeros(features, dtype=torch.float64),
        "tokens": torch.zeros(1, dtype=torch.float64),
        "outer": torch.zeros(features, features, dtype=torch.float64),
    }
    for x, mask in batches:
        for b in range(x.shape[0]):
            for t in range(x.shape[1]):
                if mask[b, t]:
                    token = x[b, t].double()
                    found["squares"] += token**2
                    found["sum"] += token
                    found["tokens"] += 1
                    found["outer"] += torch.outer(token, token)
    return found


@settings(max_examples=20, deadline=None)
@given(
    shapes=st.lists(st.tuples(st.integers(1, 3), st.integers(1, 4)), min_size=1, max_size=3),
    features=st.integers(1, 4),
    together=st.booleans(),
    ranks=st.integers(1, 3),
    data=st.data(),
)
def test_sums_shares_and_reduce_match_a_token_by_token_reference(
    shapes: list[tuple[int, int]], features: int, together: bool, ranks: int, data: Any
) -> None:
    """q and k read the same tensor (one owner sums it), v its own; ``reduce`` stands for ``ranks`` equal ranks."""
    generator = torch.Generator().manual_seed(len(shapes) * 10 + features)
    q, k, v = (nn.Linear(features, 2) for _ in range(3))
    recorded = [
        feature_sums(name, layer, features, moments=True, outer=True, dtype=torch.float64)
        for name, layer in (("q", q), ("k", k), ("v", v))
    ]
    stats = InputStatistics(recorded, share_inputs=True, together=together)
    calls: list[int] = []

    def reduce(flat: Tensor) -> Tensor:
        calls.append(flat.numel())
        return flat * ranks

    batches, other = [], []
    for batch_size, length in shapes:
        x = torch.randn(batch_size, length, features, generator=generator)
        y = torch.randn(batch_size, length, features, generator=generator)
        lengths = [data.draw(st.integers(0, length)) for _ in range(batch_size)]
        mask = torch.arange(length)[None] < torch.tensor(lengths)[:, None]
        stats.start(mask)
        q(x), k(x), v(y)
        stats.finish_batch(reduce)
        batches.append((x, mask))
        other.append((y, mask))
    assert stats.shares == {"q": "q", "k": "q", "v": "v"} and sorted(stats.totals) == ["q", "v"]
    assert stats.calls == {"q": ranks * len(shapes), "v": ranks * len(shapes)}
    assert len(calls) == (len(shapes) if together else 9 * len(shapes))  # one call, or one per tensor + the counts
    for name, inputs in (("q", batches), ("k", batches), ("v", other)):
        for key, expected in reference(inputs).items():
            torch.testing.assert_close(stats.total(name, key), expected * ranks)


@pytest.mark.parametrize("order", ["aux first", "proj first"])
def test_a_module_applied_to_another_input_too_sums_its_own(order: str) -> None:
    """``aux(a)`` and a shared ``proj(a) + proj(b)``: proj read aux's input first, then one aux never read. Before,
    proj kept sharing aux's sums (``a`` alone); and aux, reading ``a`` only, must not take proj's ``b`` either."""
    generator = torch.Generator().manual_seed(0)
    aux, proj = nn.Linear(3, 2), nn.Linear(3, 2)
    recorded = [
        feature_sums(name, layer, 3, moments=True, outer=True) for name, layer in (("aux", aux), ("proj", proj))
    ]
    stats = InputStatistics(recorded, share_inputs=True)
    inputs: dict[str, list[Tensor]] = {"aux": [], "proj": []}
    for _ in range(2):
        a, b = torch.randn(4, 3, generator=generator), torch.randn(4, 3, generator=generator)
        stats.start()
        if order == "aux first":
            aux(a), proj(a), proj(b)
        else:
            proj(a), proj(b), aux(a)
        stats.finish_batch(lambda flat: flat)
        inputs["aux"].append(a)
        inputs["proj"] += [a, b]
    assert stats.shares["proj"] == "proj" and stats.shares["aux"] == "aux"
    for name, seen in inputs.items():
        rows = torch.cat(seen)
        torch.testing.assert_close(stats.total(name, "outer"), rows.T @ rows, msg=name)
        assert stats.calls[name] == len(seen)


def test_activation_state_keeps_its_checkpoint_format_and_loads_it() -> None:
    """The keys and value types the checkpoints of earlier versions hold; a round trip gives equal moments."""
    layer = nn.Linear(3, 2)
    stats = ActivationStats([("fc.weight", layer, "weight")], moments=True, outer=True)
    stats.start(torch.tensor([[True, True, False]]))
    layer(torch.randn(1, 3, 3))
    stats.finish_batch(lambda flat: flat)
    state = stats.state_dict()
    assert sorted(state) == ["calls", "outers", "sums", "tokens", "totals"]
    assert state["tokens"] == {"fc.weight": 2} and state["calls"] == {"fc.weight": 1}
    assert state["totals"]["fc.weight"].shape == (3,) and state["outers"]["fc.weight"].shape == (3, 3)
    restored = ActivationStats([("fc.weight", layer, "weight")], moments=True, outer=True)
    restored.load_state_dict(state)
    before, after = stats.moments()["fc"], restored.moments()["fc"]
    assert after.count == before.count == 2
    for name in ("total", "squares", "outer"):
        torch.testing.assert_close(getattr(after, name), getattr(before, name))
    plain = ActivationStats([("fc.weight", layer, "weight")])
    plain.load_state_dict({"totals": {"fc.weight": torch.ones(3)}, "calls": {"fc.weight": 4}})
    assert plain.calls == {"fc.weight": 4} and plain.totals["fc.weight"].dtype == torch.float32


def test_checkpoints_that_do_not_fit_are_refused_by_name() -> None:
    layer = nn.Linear(3, 2)
    with pytest.raises(ValueError, match=r"activation statistics of 'fc.weight' have shape \(4,\), the layer has 3"):
        ActivationStats([("fc.weight", layer, "weight")]).load_state_dict({"totals": {"fc.weight": torch.ones(4)}})
    with pytest.raises(ValueError, match=r"activation statistics name 'other.weight', which is not selected"):
        ActivationStats([("fc.weight", layer, "weight")]).load_state_dict({"totals": {"other.weight": torch.ones(3)}})
    with pytest.raises(
        ValueError, match=r"OBS statistics of 'fc.weight' have shape \(2, 2\), the layer needs \(3, 3\)"
    ):
        HessianStats([("fc.weight", layer, "weight")]).load_state_dict({"totals": {"fc.weight": torch.ones(2, 2)}})


def test_obs_state_keeps_shares_and_the_hessian_across_a_round_trip() -> None:
    q, k = nn.Linear(2, 2), nn.Linear(2, 2)
    selection = [("q.weight", q, "weight"), ("k.weight", k, "weight")]
    stats = HessianStats(selection)
    stats.start()
    x = torch.randn(5, 2)
    q(x), k(x)
    stats.finish_batch(lambda flat: flat)
    state = stats.state_dict()
    assert sorted(state) == ["calls", "shares", "totals"] and sorted(state["totals"]) == ["q.weight"]
    restored = HessianStats(selection)
    restored.load_state_dict(state)
    assert restored.shares == {"q.weight": "q.weight", "k.weight": "q.weight"}
    torch.testing.assert_close(restored.hessian("k.weight"), stats.hessian("q.weight"))
    torch.testing.assert_close(restored.hessian("q.weight"), x.T @ x)


def test_sums_stay_in_float32_inside_an_autocast_forward() -> None:
    """A mixed-precision fit runs the recording hooks under autocast, which would compute X^T X in bfloat16."""
    torch.manual_seed(0)
    layer, x = nn.Linear(64, 4), torch.randn(8, 32, 64)
    stats = InputStatistics([feature_sums("fc", layer, 64, moments=True, outer=True)])
    stats.start()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        layer(x)
    stats.finish_batch(lambda flat: flat)
    expected = reference([(x, torch.ones(8, 32, dtype=torch.bool))])
    for key in ("squares", "outer"):
        got = stats.totals["fc"][key]
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), expected[key], rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_block_recomputed_by_activation_checkpointing_is_counted_once(reentrant: bool) -> None:
    """Activation checkpointing runs a block's forward again during backward; those inputs were recorded already."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    x = torch.randn(5, 4, requires_grad=True)
    totals = []
    for checkpointed in (False, True):
        stats = InputStatistics([feature_sums("first", block[0], 4), feature_sums("second", block[2], 6)])
        stats.start()
        out = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=reentrant) if checkpointed else block(x)
        out.sum().backward()
        stats.finish_batch(lambda flat: flat)
        stats.stop()
        totals.append(stats.totals)
    for name in ("first", "second"):
        for key, value in totals[0][name].items():
            assert torch.equal(totals[1][name][key], value), (name, key)
    assert totals[0]["first"]["squares"].tolist() == (x.detach() ** 2).sum(0).tolist()  # one batch's worth
