"""Tests for lightprune.prune.k_smallest: exact k-smallest selection, checked against a sorting oracle."""

from __future__ import annotations

import importlib
import itertools
import math
from contextlib import contextmanager

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from lightprune.prune.k_smallest import Cut, apply_cut, count_eligible, find_cut, select_smallest

# the module itself, for its tuning constants and internals (robust to a same-named attribute of the package)
select = importlib.import_module("lightprune.prune.k_smallest")

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
INTS = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]


# ---------------------------------------------------------------------------------------------- oracle


def oracle(scores, k, eligible=None, magnitude=False, largest=False):
    """Selected masks by a plain stable sort of (rank, tensor, flat index) in Python."""
    common = scores[0].dtype
    for s in scores[1:]:
        common = torch.promote_types(common, s.dtype)
    entries = []
    for i, s in enumerate(scores):
        values = s.to(common).reshape(-1).tolist()
        elig = [True] * len(values) if eligible is None or eligible[i] is None else _elig_list(eligible[i])
        for j, (v, ok) in enumerate(zip(values, elig, strict=True)):
            if not ok:
                continue
            nan = isinstance(v, float) and math.isnan(v)
            v = 0 if nan else (abs(v) if magnitude else v)
            rank = (1, 0) if nan else (0, v)
            if largest:
                rank = (-rank[0], -rank[1])
            entries.append((rank, i, j))
    entries.sort()
    masks = [torch.zeros(s.numel(), dtype=torch.bool) for s in scores]
    for _, i, j in entries[:k]:
        masks[i][j] = True
    return [m.reshape(s.shape) for m, s in zip(masks, scores, strict=True)]


def _elig_list(e):
    flat = e.reshape(-1)
    return flat.tolist() if e.dtype == torch.bool else (flat == 1).tolist()


@contextmanager
def tuning(chunk=None, radix=None, limit=None, sample=None):
    saved = select.CHUNK_CPU, select.RADIX_BITS, select.BIN_LIMIT, select.SAMPLE
    try:
        if sample is not None:
            select.SAMPLE = sample
        if chunk is not None:
            select.CHUNK_CPU = chunk
        if radix is not None:
            select.RADIX_BITS = radix
        if limit is not None:
            select.BIN_LIMIT = limit
        yield
    finally:
        select.CHUNK_CPU, select.RADIX_BITS, select.BIN_LIMIT, select.SAMPLE = saved


def masks_sync_free(scores, k, eligible=None, magnitude=False, largest=False):
    """Like select_smallest, but through the apply path used on accelerators (no host syncs)."""
    cut = find_cut(scores, k, eligible=eligible, magnitude=magnitude, largest=largest)
    outs = [torch.empty(s.shape, dtype=torch.bool) for s in scores]
    keys = select.Keys(select.common_dtype(scores), magnitude, largest)
    elig = [None] * len(scores) if eligible is None else list(eligible)
    select._apply(list(scores), cut, outs, elig, [None] * len(scores), keys, select.CHUNK_CPU, sync_free=True)
    return [o.logical_not_() for o in outs]


def assert_same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.bool
        assert g.shape == w.shape
        assert torch.equal(g, w), (g, w)


# ------------------------------------------------------------------------------------------- strategies

FLOAT_POOLS = {
    "small": [-2.0, -1.0, -0.0, 0.0, 1.0, 2.0],
    "zeros": [0.0],
    "special": [math.nan, -math.nan, math.inf, -math.inf, -0.0, 0.0, 1.0, -1.0, 1e-40, -1e-40, 3.0e38, -3.0e38],
}


def make_values(dtype, shape, mode, gen):
    n = math.prod(shape)
    if dtype.is_floating_point:
        if mode == "random":
            return (torch.randn(n, generator=gen, dtype=torch.float64) * 10).to(dtype).reshape(shape)
        pool = torch.tensor(FLOAT_POOLS[mode], dtype=torch.float64).to(dtype)
        if mode == "special":  # keep NaN payloads with the sign bit set
            pool[1] = -pool[1].abs()
    else:
        info = torch.iinfo(dtype)
        if mode == "random":
            return torch.randint(info.min, info.max, (n,), generator=gen, dtype=torch.int64).to(dtype).reshape(shape)
        pools = {
            "small": [-2, -1, 0, 1, 2],
            "zeros": [0],
            "special": [info.min, info.min + 1, -1, 0, 1, info.max - 1, info.max],
        }
        pool = torch.tensor([v for v in pools[mode] if info.min <= v <= info.max], dtype=torch.int64).to(dtype)
    idx = torch.randint(0, len(pool), (n,), generator=gen)
    return pool[idx].reshape(shape)


def layout(t, how):
    """The same logical tensor with another memory layout."""
    if how == "transposed" and t.dim() >= 2:
        return t.transpose(0, -1).contiguous().transpose(0, -1)
    if how == "channels_last" and t.dim() == 4:
        return t.contiguous(memory_format=torch.channels_last)
    if how == "strided" and t.dim() >= 1:
        wide = torch.zeros((*t.shape[:-1], 2 * t.shape[-1]), dtype=t.dtype)
        wide[..., ::2] = t
        return wide[..., ::2]
    return t


@st.composite
def problems(draw, dtypes=(*FLOATS, *INTS)):
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    mixed = draw(st.booleans())
    base_dtype = draw(st.sampled_from(dtypes))
    n_tensors = draw(st.integers(1, 4))
    scores, eligible = [], []
    for _ in range(n_tensors):
        shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=4)))
        dtype = draw(st.sampled_from(dtypes)) if mixed else base_dtype
        mode = draw(st.sampled_from(["random", "small", "zeros", "special"]))
        values = make_values(dtype, shape, mode, gen)
        scores.append(layout(values, draw(st.sampled_from(["plain", "transposed", "channels_last", "strided"]))))
        kind = draw(st.sampled_from(["none", "bool", "float", "int"]))
        if kind == "none":
            eligible.append(None)
            continue
        bits = torch.rand(shape, generator=gen) < draw(st.sampled_from([0.0, 0.5, 0.9, 1.0]))
        if kind == "bool":
            e = bits
        elif kind == "float":  # 0.5 is not eligible: only entries == 1 are
            e = torch.where(bits, 1.0, torch.where(torch.rand(shape, generator=gen) < 0.5, 0.0, 0.5))
        else:
            e = bits.to(torch.int32) * (1 + (torch.rand(shape, generator=gen) < 0.3))  # 2 is not eligible
        eligible.append(layout(e, draw(st.sampled_from(["plain", "transposed"]))))
    if draw(st.booleans()):
        eligible = None
    total = sum(
        s.numel() if eligible is None or eligible[i] is None else int((_as_bool(eligible[i])).sum())
        for i, s in enumerate(scores)
    )
    k = draw(st.one_of(st.just(0), st.just(total), st.integers(0, total)))
    return scores, eligible, k, draw(st.booleans()), draw(st.booleans())


def _as_bool(e):
    return e if e.dtype == torch.bool else e == 1


TUNINGS = st.sampled_from(
    [
        {},  # defaults: small inputs are gathered and sorted whole
        {"chunk": 7},  # many chunks: ties across chunk and tensor boundaries
        {"chunk": 7, "limit": 40},  # a window estimated from every entry
        {"chunk": 7, "limit": 40, "sample": 0},  # no estimate: one histogram pass, then gathering a bin
        {"chunk": 16, "limit": 0, "sample": 3},  # a window from a sparse sample (often missed: histograms then)
        {"chunk": 2, "limit": 0, "sample": 1},  # one sampled entry, many tiny chunks
        {"chunk": 5, "radix": 3, "limit": 0, "sample": 0},  # refine down to single keys, many passes
        {"chunk": 11, "radix": 4, "limit": 3, "sample": 0},  # refine a while, then gather
        {"chunk": 3, "radix": 2, "limit": 1, "sample": 0},
    ]
)

# ------------------------------------------------------------------------------------------------ tests


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=problems(), tune=TUNINGS)
def test_matches_sorting_oracle(problem, tune):
    scores, eligible, k, magnitude, largest = problem
    want = oracle(scores, k, eligible, magnitude, largest)
    with tuning(**tune):
        assert_same(select_smallest(scores, k, eligible=eligible, magnitude=magnitude, largest=largest), want)
        assert_same(masks_sync_free(scores, k, eligible=eligible, magnitude=magnitude, largest=largest), want)


@st.composite
def tie_splits(draw):
    """Problems whose k-th entry lies strictly inside a run of equal keys (the cut selects some of them and not
    others: the tie count decides), with many entries so that the sampled window, not a whole sort, finds it."""
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    dtype = draw(st.sampled_from(FLOATS))
    # three magnitudes, close in bit pattern (a window around zero and 2.0 would be too wide for the key dtype)
    pool = torch.tensor([-2.0, -1.5, -1.0, 1.0, 1.5, 2.0], dtype=dtype)
    shapes = [(draw(st.integers(20, 40)), 37) for _ in range(draw(st.integers(1, 3)))]
    scores = [pool[torch.randint(0, 6, shape, generator=gen)] for shape in shapes]
    eligible = [draw(st.sampled_from([None, torch.rand(s.shape, generator=gen) < 0.8])) for s in scores]
    largest = draw(st.booleans())
    ranked = sorted(
        (abs(v) * (-1 if largest else 1), i, j)
        for i, (sc, el) in enumerate(zip(scores, eligible, strict=True))
        for j, (v, ok) in enumerate(
            zip(sc.reshape(-1).tolist(), _elig_list(el) if el is not None else [True] * sc.numel(), strict=True)
        )
        if ok
    )
    n = len(ranked)  # the middle 80%: the window around the sampled rank lies between the smallest and largest keys
    inside = [k for k in range(n // 10, 9 * n // 10) if ranked[k - 1][0] == ranked[k][0]]  # k-1 selected, k not
    assume(inside)
    return scores, eligible, draw(st.sampled_from(inside)), largest


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(problem=tie_splits(), chunk=st.sampled_from([3, 7, 64]))
def test_ties_split_inside_the_window_match_the_oracle(problem, chunk):
    """The window pass counts how many equal keys to select; the property above rarely reaches it with a split
    tie, since its inputs are small enough to sort whole. Here the window must find every cut (no histograms)."""
    scores, eligible, k, largest = problem
    want = oracle(scores, k, eligible, magnitude=True, largest=largest)

    def no_histograms(*args, **kwargs):
        raise AssertionError("the window pass should have found the cut")

    saved = select.histogram
    select.histogram = no_histograms
    try:
        with tuning(chunk=chunk, limit=0):
            cut = find_cut(scores, k, eligible=eligible, magnitude=True, largest=largest)
            assert cut.ties > 0  # a split tie
            assert_same(select_smallest(scores, k, eligible=eligible, magnitude=True, largest=largest), want)
    finally:
        select.histogram = saved


@settings(max_examples=40, deadline=None)
@given(problem=problems(dtypes=(torch.float32, torch.float16)), tune=TUNINGS, out_dtype=st.sampled_from(FLOATS))
def test_apply_cut_writes_base_with_selected_zeroed(problem, tune, out_dtype):
    scores, eligible, k, magnitude, largest = problem
    want = oracle(scores, k, eligible, magnitude, largest)
    specials = torch.tensor([math.nan, -0.0, -math.inf, 2.5, -1.0, 0.0, 1.0])
    bases = [
        None if i % 3 == 0 else specials[torch.arange(s.numel()) % 7].reshape(s.shape) for i, s in enumerate(scores)
    ]
    bases = [b if b is None or i % 3 == 1 else b.to(out_dtype) for i, b in enumerate(bases)]
    outs = [torch.full(s.shape, 7.0, dtype=out_dtype) for s in scores]
    with tuning(**tune):
        cut = find_cut(scores, k, eligible=eligible, magnitude=magnitude, largest=largest)
        apply_cut(scores, cut, out=outs, eligible=eligible, base=bases, magnitude=magnitude, largest=largest)
    for o, b, w in zip(outs, bases, want, strict=True):
        expected = torch.ones(w.shape, dtype=out_dtype) if b is None else b.to(out_dtype)
        expected[w] = 0
        assert torch.equal(o.isnan(), expected.isnan())
        assert torch.equal(o.nan_to_num(), expected.nan_to_num())
        # kept -0.0 stays, cleared entries are +0.0 (NaN signs are skipped: torch's own casts disagree on them)
        assert torch.equal(o.signbit() & ~o.isnan(), expected.signbit() & ~expected.isnan())


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("magnitude", [False, True])
def test_nan_ranks_above_inf_and_zeros_are_equal(dtype, magnitude):
    x = torch.tensor([math.nan, math.inf, -0.0, -math.nan, 0.0, -math.inf, 1.0], dtype=dtype)
    x[3] = -x[3].abs()  # NaN with the sign bit set
    order_small = [2, 4, 6, 1, 5, 0, 3] if magnitude else [5, 2, 4, 6, 1, 0, 3]
    order_large = [0, 3, 1, 5, 6, 2, 4] if magnitude else [0, 3, 1, 6, 2, 4, 5]
    for largest, order in ((False, order_small), (True, order_large)):
        for k in range(len(order) + 1):
            (got,) = select_smallest([x], k, magnitude=magnitude, largest=largest)
            want = torch.zeros(len(order), dtype=torch.bool)
            want[order[:k]] = True
            assert torch.equal(got, want), (largest, k)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_integer_extremes(dtype):
    info = torch.iinfo(dtype)
    x = torch.tensor([info.min, info.max, -info.max, 0, -1, 1, info.min, info.max], dtype=dtype)
    for tune in ({}, {"limit": 0, "radix": 13}, {"limit": 0, "radix": 5, "chunk": 3}):
        with tuning(**tune):
            for magnitude, largest in itertools.product((False, True), repeat=2):
                for k in range(9):
                    assert_same(
                        select_smallest([x], k, magnitude=magnitude, largest=largest),
                        oracle([x], k, magnitude=magnitude, largest=largest),
                    )


def test_ties_break_by_flat_index_across_chunks_and_tensors():
    a = torch.zeros(3, 5)
    b = torch.zeros(4).as_strided((2, 2), (1, 2))  # non-contiguous
    for chunk in (1, 4, 1 << 18):
        with tuning(chunk=chunk, limit=0, radix=8):
            for k in (0, 1, 4, 5, 6, 14, 15, 16, 18, 19):
                got = select_smallest([a, b], k)
                flat = torch.cat([got[0].reshape(-1), got[1].reshape(-1)])
                assert flat.tolist() == [True] * k + [False] * (19 - k)


def test_larger_inputs_many_chunks_and_refinement():
    gen = torch.Generator().manual_seed(0)
    scores = [
        torch.randn(120, 100, generator=gen).t(),  # non-contiguous
        torch.randint(-3, 4, (3000,), generator=gen).float(),  # heavy ties
        torch.randn(2, 3, 20, 25, generator=gen).to(memory_format=torch.channels_last),
    ]
    eligible = [torch.rand(s.shape, generator=gen) < 0.8 for s in scores]
    total = count_eligible(eligible, scores)
    assert total == sum(int(e.sum()) for e in eligible)
    for k in (1, 9000, total):
        for magnitude in (False, True):
            want = oracle(scores, k, eligible, magnitude)
            tunes = (
                {"chunk": 1000},
                {"chunk": 333, "limit": 50},
                {"chunk": 333, "limit": 50, "sample": 64},
                {"chunk": 4096, "radix": 6, "limit": 0, "sample": 0},
            )
            for tune in tunes:
                with tuning(**tune):
                    assert_same(select_smallest(scores, k, eligible=eligible, magnitude=magnitude), want)


def test_window_pass_finds_the_cut_without_histograms(monkeypatch):
    """The sampled window is the usual route: over many small tensors and a few large ones, with ties, NaN and
    eligibility, it finds the exact cut in one pass (the histogram passes are not run at all)."""
    gen = torch.Generator().manual_seed(3)
    scores = [torch.randn(37, 29, generator=gen) for _ in range(40)]
    scores += [torch.randn(300, 200, generator=gen), torch.randint(-5, 6, (5000,), generator=gen).float()]
    scores[3][0, :4] = math.nan
    eligible = [None if i % 3 else torch.rand(s.shape, generator=gen) < 0.7 for i, s in enumerate(scores)]
    total = count_eligible(eligible, scores)

    def no_histograms(*args, **kwargs):
        raise AssertionError("the window pass should have found the cut")

    for k in (1, total // 10, total // 2, 9 * total // 10, total - 1):
        for magnitude, largest in itertools.product((False, True), repeat=2):
            want = oracle(scores, k, eligible, magnitude, largest)
            with tuning(chunk=4096, limit=1000, sample=8192), monkeypatch.context() as patch:
                # by signed value, a window around 0 spans more keys than 32 bits hold: histograms then
                if magnitude or k != total // 2:
                    patch.setattr(select, "histogram", no_histograms)
                got = select_smallest(scores, k, eligible=eligible, magnitude=magnitude, largest=largest)
            assert_same(got, want)


def test_in_place_second_round():
    gen = torch.Generator().manual_seed(1)
    w = [torch.randn(30, 20, generator=gen), torch.randn(50, generator=gen)]
    masks = [torch.ones(30, 20), torch.ones(50)]
    first = select_smallest(w, 325, magnitude=True)
    for m, f in zip(masks, first, strict=True):
        m[f] = 0
    with tuning(chunk=64):
        cut = find_cut(w, 130, eligible=masks, magnitude=True)
        apply_cut(w, cut, out=masks, eligible=masks, base=masks, magnitude=True)
    pruned = select_smallest(w, 455, magnitude=True)
    assert_same([m == 0 for m in masks], pruned)


def test_count_eligible():
    scores = [torch.zeros(4, 5), torch.zeros(()), torch.zeros(0, 3), torch.zeros(6)]
    eligible = [
        (torch.arange(20).reshape(4, 5) % 3 == 0).t().contiguous().t(),
        None,
        torch.ones(0, 3),
        torch.tensor([1.0, 0.5, 1.0, 0.0, 2.0, 1.0]),
    ]
    with tuning(chunk=3):
        assert count_eligible(eligible, scores) == 7 + 1 + 0 + 3
    assert count_eligible([None, None], scores[:2]) == 21


def test_zero_dim_and_empty():
    scores = [torch.tensor(3.0), torch.empty(0, 4), torch.tensor([2.0, 5.0])]
    assert_same(
        select_smallest(scores, 2),
        [torch.tensor(True), torch.zeros(0, 4, dtype=torch.bool), torch.tensor([True, False])],
    )
    assert_same(select_smallest([torch.empty(0)], 0), [torch.zeros(0, dtype=torch.bool)])
    assert find_cut([], 0) == Cut(0, 0)


def test_errors():
    x = [torch.randn(3, 4)]
    eligible = [torch.tensor([[True, False, True, False]] * 3)]
    with pytest.raises(ValueError, match=r"k=7 exceeds the number of eligible entries \(6\)"):
        find_cut(x, 7, eligible=eligible)
    with pytest.raises(ValueError, match="k=13"):
        select_smallest(x, 13)
    with pytest.raises(ValueError, match="k=-1"):
        find_cut(x, -1)
    with pytest.raises(ValueError, match="shape"):
        find_cut(x, 1, eligible=[torch.ones(4, 3)])
    with pytest.raises(ValueError, match="eligible"):
        find_cut(x, 1, eligible=[None, None])
    with pytest.raises(ValueError, match="contiguous"):
        apply_cut(x, Cut(0, 0), out=[torch.empty(4, 3).t()])
    with pytest.raises(TypeError, match="dtype"):
        find_cut([torch.zeros(2, dtype=torch.complex64)], 1)


def test_deterministic_cut_is_canonical():
    x = [torch.tensor([5.0, 1.0, 1.0, 1.0, 3.0])]
    assert find_cut(x, 2) == find_cut([x[0].clone()], 2)
    assert find_cut(x, 2).ties == 2
    assert find_cut(x, 3).ties == 0  # all equal keys taken: plain threshold


def test_bool_scores_and_integer_like_k():
    x = torch.tensor([True, False, True, False])
    assert_same(select_smallest([x], 3), [torch.tensor([True, True, False, True])])
    assert_same(select_smallest([x], torch.tensor(1), largest=True), [torch.tensor([True, False, False, False])])
    with pytest.raises(TypeError):
        find_cut([x], 1.0)


@pytest.mark.parametrize("out_dtype", [torch.bool, torch.int64, torch.complex64, torch.float16])
def test_apply_cut_other_output_dtypes(out_dtype):
    x = [torch.tensor([[0.5, -3.0, 2.0], [0.1, -0.2, 9.0]])]
    base = [torch.tensor([[1.0, 2.0, 0.0], [4.0, 5.0, 6.0]])]
    out = [torch.empty(2, 3, dtype=out_dtype)]
    cut = find_cut(x, 3, magnitude=True)
    apply_cut(x, cut, out=out, base=base, magnitude=True)
    assert torch.equal(out[0], torch.tensor([[0.0, 2.0, 0.0], [0.0, 0.0, 6.0]]).to(out_dtype))


def test_the_cut_runs_its_passes_on_one_cpu_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """find_cut and apply_cut run thousands of chunk-sized operations: on a busy machine each multi-threaded one
    waits on descheduled workers (global L1 at 134M took 46-91 s), so both run on one thread and restore the count."""
    calls: list[int] = []
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    scores = [torch.tensor([0.5, -2.0, 1.0])]
    cut = find_cut(scores, 1, magnitude=True)
    assert calls == [1, 4]
    apply_cut(scores, cut, out=[torch.empty(3, dtype=torch.bool)], magnitude=True)
    assert calls == [1, 4, 1, 4]


@pytest.mark.parametrize("tune", [{}, {"chunk": 7}, {"chunk": 7, "limit": 2}, {"chunk": 7, "limit": 2, "sample": 4}])
def test_small_tensors_concatenated_compare_in_the_common_dtype(tune):
    """Runs of small tensors were concatenated with torch.cat's promotion of the run alone: float16 beside int32 is
    float16, where -2**31 overflows to -inf, though the common dtype of all the scores (with a bfloat16 one) is
    float32. Found by test_matches_sorting_oracle."""
    scores = [
        torch.tensor([15.4062, -2.9336], dtype=torch.float16),
        torch.tensor(12.6484, dtype=torch.float16),
        torch.tensor(-(2**31), dtype=torch.int32),
        torch.tensor([-6.8750, 4.0312], dtype=torch.bfloat16),
    ]
    eligible = [torch.tensor([False, False]), torch.tensor(False), None, None]
    want = oracle(scores, 3, eligible, False, True)
    with tuning(**tune):
        assert_same(select_smallest(scores, 3, eligible=eligible, largest=True), want)
        assert_same(masks_sync_free(scores, 3, eligible=eligible, largest=True), want)
