"""One mask update of dynamic sparse training against a reference written here: sorts with ties by flat index."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightprune.prune.regrow import drop_and_grow, moved_count


def reference(weight: torch.Tensor, mask: torch.Tensor, k: int, grads: torch.Tensor) -> torch.Tensor:
    """Drop the k active entries of smallest |w| (earlier index first on ties), then regrow the k entries inactive
    after the drop (the dropped ones included, as in RigL's Algorithm 1) of largest |g| (earlier index first)."""
    w, m, g = weight.reshape(-1).tolist(), mask.reshape(-1).tolist(), grads.reshape(-1).tolist()
    active = sorted((abs(w[i]), i) for i in range(len(w)) if m[i])
    new = list(m)
    for _, i in active[:k]:
        new[i] = False
    candidates = sorted((-abs(g[i]), i) for i in range(len(w)) if not new[i])
    for _, i in candidates[:k]:
        new[i] = True
    return torch.tensor(new).reshape(mask.shape)


small = st.integers(-3, 3).map(float)  # few values: many ties


@settings(max_examples=150, deadline=None)
@given(data=st.data(), rows=st.integers(1, 6), cols=st.integers(1, 6))
def test_rigl_drops_the_smallest_active_and_regrows_the_largest_inactive_gradients(
    data: st.DataObject, rows: int, cols: int
) -> None:
    n = rows * cols
    weight = torch.tensor(data.draw(st.lists(small, min_size=n, max_size=n))).reshape(rows, cols)
    grads = torch.tensor(data.draw(st.lists(small, min_size=n, max_size=n))).reshape(rows, cols)
    mask = torch.tensor(data.draw(st.lists(st.booleans(), min_size=n, max_size=n))).reshape(rows, cols)
    active = int(mask.sum())
    k = data.draw(st.integers(0, min(active, n - active)))
    new, grown = drop_and_grow(weight, mask, k, grow_scores=grads)
    assert torch.equal(new, reference(weight, mask, k, grads))
    assert int(new.sum()) == active  # the count is exact
    assert torch.equal(grown, new & ~mask)


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.integers(2, 40), data=st.data())
def test_set_regrows_k_inactive_entries_drawn_from_the_generator(seed: int, n: int, data: st.DataObject) -> None:
    mask = torch.tensor(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    weight = torch.arange(n, dtype=torch.float32) - n / 2
    active = int(mask.sum())
    k = data.draw(st.integers(0, min(active, n - active)))
    new, grown = drop_and_grow(weight, mask, k, generator=torch.Generator().manual_seed(seed))
    again, _ = drop_and_grow(weight, mask, k, generator=torch.Generator().manual_seed(seed))
    assert torch.equal(new, again)  # the same seed, the same draw (every DDP rank, a resumed run)
    assert int(new.sum()) == active and torch.equal(grown, new & ~mask)
    dropped = mask & ~new
    assert int(dropped.sum()) == int(grown.sum()) <= k
    smallest = weight[mask].abs().sort().values  # dropped: among the k smallest active magnitudes
    assert k == 0 or not dropped.any() or weight[dropped].abs().max() <= smallest[k - 1]


def test_set_draws_among_the_dropped_weights_too() -> None:
    """SET's candidates are the entries inactive after the drop: over seeds, a dropped weight is sometimes drawn
    again (it then stays: fewer than k move) and sometimes not."""
    weight, mask = torch.tensor([1.0, 2.0, 3.0, 0.0, 0.0]), torch.tensor([True, True, True, False, False])
    moved = set()
    for seed in range(40):
        new, grown = drop_and_grow(weight, mask, 2, generator=torch.Generator().manual_seed(seed))
        assert int(new.sum()) == 3 and bool(new[2])  # the largest weight is never dropped
        moved.add(int(grown.sum()))
    assert moved == {0, 1, 2}


def test_moved_count_and_refusal() -> None:
    assert moved_count(0.3, 100, 900) == 30
    with pytest.raises(ValueError, match="k=3 weights cannot move: 2 are active and 2 inactive"):
        drop_and_grow(torch.ones(4), torch.tensor([1, 1, 0, 0]), 3)
