"""One mask update of dynamic sparse training against a reference written here: sorts with ties by flat index."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightprune.prune.regrow import drop_and_grow, moved_count


def reference(weight: torch.Tensor, mask: torch.Tensor, k: int, grads: torch.Tensor) -> torch.Tensor:
    """Drop the k active entries of smallest |w| (earlier index first on ties), regrow the k inactive entries of
    largest |g| (earlier index first on ties)."""
    w, m, g = weight.reshape(-1).tolist(), mask.reshape(-1).tolist(), grads.reshape(-1).tolist()
    active = sorted((abs(w[i]), i) for i in range(len(w)) if m[i])
    inactive = sorted((-abs(g[i]), i) for i in range(len(w)) if not m[i])
    new = list(m)
    for _, i in active[:k]:
        new[i] = False
    for _, i in inactive[:k]:
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
    assert int(new.sum()) == active and int(grown.sum()) == k and not bool((grown & mask).any())
    dropped = mask & ~new
    kept = weight[mask & new].abs()
    assert int(dropped.sum()) == k and (k == 0 or kept.numel() == 0 or weight[dropped].abs().max() <= kept.min())


def test_moved_count_and_refusal() -> None:
    assert moved_count(0.3, 100, 900) == 30
    with pytest.raises(ValueError, match="k=3 weights cannot move: 2 are active and 2 inactive"):
        drop_and_grow(torch.ones(4), torch.tensor([1, 1, 0, 0]), 3)
