"""Exact k-smallest selection over one or many tensors, in bounded memory.

Pruning needs "the ``k`` entries with the smallest score" over one tensor or over
all the tensors of a model at once (global pruning). Sorting or ``topk`` over the
concatenated scores is slow and doubles the memory, so this module selects with a
radix search instead:

1. Every score is mapped to an integer *key* built from its bit pattern, such that
   integer order is the wanted order (by value or by magnitude, smallest or
   largest first). ``-0.0`` and ``+0.0`` get the same key and every NaN gets one
   key above ``+inf``.
2. A histogram (``torch.bincount``) of the top bits of the keys, accumulated chunk
   by chunk over all tensors, tells which bin holds the k-th key. While that bin
   is too crowded, another histogram pass over the next bits of the keys inside
   it narrows it down. The keys of the final bin are then gathered and sorted:
   that small set gives the threshold key exactly. (Inputs of at most
   ``BIN_LIMIT`` entries skip the histograms: all their keys are sorted at once.)
3. A last pass writes the masks chunk by chunk: entries whose key is below the
   threshold are selected, and among those equal to it the first ones in flat
   order (tensor 0 before tensor 1, and so on) until ``k`` is reached.

Before the histograms, a cheaper route is tried (Floyd and Rivest's idea): the keys of a regular sample of about
``SAMPLE`` entries estimate where the k-th key lies, and one exact pass counts the entries below a narrow key window
around the estimate and collects the few inside it; the k-th key is then picked among those. When the window misses
the k-th key (an unrepresentative sample) or holds too many entries, the histogram passes run as above, so the
result never depends on the sample, only the time does.

The result is a :class:`Cut` (a threshold key and a tie count) so the search
(:func:`find_cut`) and the writing (:func:`apply_cut`) can be used separately.
Only per-chunk temporaries (a few MB) and the gathered keys (at most ``BIN_LIMIT``)
are ever allocated: tensors are never concatenated, flattened by copy or sorted
whole. The result does not depend on the machine: ties are always broken by flat
index.

Scores may have several dtypes; they are compared as if promoted to their common
dtype (like ``torch.cat`` would), one chunk at a time.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import operator
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor

_T = TypeVar("_T")

__all__ = ["Cut", "apply_cut", "count_eligible", "find_cut", "select_smallest"]
# Shared with distributed.py, which runs the same passes across ranks (package-internal, hence not in __all__):
# Keys, common_dtype, chunk_size, check_scores, chunks, histogram, first_pass and descend.

#: Elements per chunk on CPU (about L2-sized for 32-bit keys).
CHUNK_CPU = 1 << 18
#: Elements per chunk on accelerators.
CHUNK_CUDA = 1 << 24
#: Key bits resolved by one histogram pass (``2**RADIX_BITS`` bins).
RADIX_BITS = 16
#: A histogram bin holding more eligible entries than this is refined by another pass
#: instead of having its keys gathered and sorted (this bounds that sort's memory).
BIN_LIMIT = 1 << 20
#: Entries in the sample that estimates the cut before the exact window pass (0: no estimate, histograms only).
SAMPLE = 1 << 18
#: Half-width of the window around the estimated rank, in standard deviations of a sample quantile.
SIGMAS = 4.0

_FLOAT_LAYOUT = {
    # dtype: (integer view, bits of the integer view, bit pattern of +inf)
    torch.float16: (torch.int16, 16, 0x7C00),
    torch.bfloat16: (torch.int16, 16, 0x7F80),
    torch.float32: (torch.int32, 32, 0x7F800000),
    torch.float64: (torch.int64, 64, 0x7FF0000000000000),
}
_NARROW_INTS = (torch.bool, torch.uint8, torch.int8, torch.int16)
_WIDE_INTS = (torch.int32, torch.int64)


@dataclass(frozen=True)
class Cut:
    """Where a selection stops, in key space.

    The selected entries are the eligible entries whose key is below ``key``, plus the
    first ``ties`` eligible entries (in flat order, tensor after tensor) whose key equals
    ``key``. :func:`find_cut` returns ``ties == 0`` whenever all the entries equal to the
    last selected key are selected (``key`` is then one above that key), so ties only need
    counting when they are split.

    Keys are internal integers: a cut is only meaningful to :func:`apply_cut` called with
    the same scores, dtypes and ``magnitude``/``largest`` flags as the :func:`find_cut` call
    that produced it.

    Attributes:
        key: The threshold key.
        ties: How many eligible entries with key equal to ``key`` are selected.

    Example:
        >>> import torch
        >>> cut = find_cut([torch.tensor([3.0, 1.0, 2.0])], 2)
        >>> cut.ties
        0
        >>> select_smallest([torch.tensor([3.0, 1.0, 2.0])], 2)
        [tensor([False,  True,  True])]
    """

    key: int
    ties: int


class Keys:
    """Maps score chunks of one common dtype to integer keys, in the wanted order.

    Keys are ``int32`` or ``int64`` tensors whose values lie in ``[lo, hi]``; a smaller
    key means "selected earlier".
    """

    def __init__(self, dtype: torch.dtype, magnitude: bool, largest: bool) -> None:
        self.dtype = dtype
        self.magnitude = magnitude
        self.largest = largest
        if dtype in _FLOAT_LAYOUT:
            view, bits, inf = _FLOAT_LAYOUT[dtype]
            self.view = view
            self.key_dtype = torch.int64 if bits == 64 else torch.int32
            self.sign_mask = (1 << (bits - 1)) - 1
            self.inf = inf
            self.nan = inf + 1  # every NaN gets this key, one above +inf
            lo, hi = (0 if magnitude else -inf), self.nan
        elif dtype in _NARROW_INTS:
            self.key_dtype = torch.int32
            info = torch.iinfo(torch.uint8 if dtype == torch.bool else dtype)
            vmin, vmax = (0, 1) if dtype == torch.bool else (info.min, info.max)
            lo, hi = (0, max(vmax, -vmin)) if magnitude else (vmin, vmax)
        elif dtype in _WIDE_INTS:
            self.key_dtype = dtype
            info = torch.iinfo(dtype)
            # Magnitude key |x| - 1 with wrap-around: |min| wraps to max, the largest key.
            lo, hi = (-1, info.max) if magnitude else (info.min, info.max)
        else:
            raise TypeError(f"unsupported score dtype {dtype}")
        if largest:  # bitwise not reverses the order without overflow
            lo, hi = ~hi, ~lo
        self.lo, self.hi = lo, hi
        info = torch.iinfo(self.key_dtype)
        self.dmin, self.dmax = info.min, info.max

    def __call__(self, x: Tensor) -> Tensor:
        """Keys of a 1-D contiguous chunk ``x``; always a new tensor (safe to modify in place)."""
        if x.dtype != self.dtype:
            x = x.to(self.dtype)
        dt = self.dtype
        if dt in _WIDE_INTS and not self.magnitude:
            return torch.bitwise_not(x) if self.largest else x.clone()
        if dt in _FLOAT_LAYOUT:
            b = x.view(self.view)
            if b.dtype == torch.int16:
                b = b.to(torch.int32)
            key = b & self.sign_mask
            key.clamp_(max=self.nan)
            if not self.magnitude:  # negate the keys of negative values, branch-free
                sign = b >> (b.element_size() * 8 - 1)  # -1 where the sign bit is set, else 0
                sign *= key <= self.inf  # a NaN stays on top whatever its sign bit
                key ^= sign
                key -= sign
        elif dt in _NARROW_INTS:
            key = x.to(torch.int32)
            if self.magnitude and dt not in (torch.bool, torch.uint8):
                key.abs_()
        else:  # wide integers by magnitude: |x| - 1, where |min| wraps to min and then to max
            key = x.abs()
            key -= 1
        if self.largest:
            key.bitwise_not_()
        return key

    @property
    def bits(self) -> int:
        return (self.hi - self.lo).bit_length()


@contextlib.contextmanager
def one_thread(device: torch.device) -> Iterator[None]:
    """Run the block's CPU operations on one torch thread, then restore the thread count.

    The passes run thousands of chunk-sized operations; with several threads each one is a fork and a join of
    OpenMP workers, and when another process keeps the cores busy every join waits for a descheduled worker (a
    scheduler time slice, milliseconds): global L1 at 134M took 46-91 s that way, slower than torch's few large
    operations. On one thread a chunk stays in that core's cache and nothing waits. Does nothing on other devices.
    """
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _on_one_thread(fn: Callable[..., _T]) -> Callable[..., _T]:
    """Run ``fn(scores, ...)`` under :func:`one_thread` for the device of its first score tensor."""

    @functools.wraps(fn)
    def wrapper(scores: Sequence[Tensor], *args: Any, **kwargs: Any) -> _T:
        scores = list(scores)
        first = next((s for s in scores if isinstance(s, Tensor)), None)
        if first is None:
            return fn(scores, *args, **kwargs)
        with one_thread(first.device):
            return fn(scores, *args, **kwargs)

    return wrapper


def common_dtype(scores: Sequence[Tensor]) -> torch.dtype:
    dtype = scores[0].dtype
    for s in scores[1:]:
        dtype = torch.promote_types(dtype, s.dtype)
    return dtype


def chunk_size(device: torch.device) -> int:
    return CHUNK_CPU if device.type == "cpu" else CHUNK_CUDA


def check_scores(
    scores: Sequence[Tensor], eligible: Sequence[Tensor | None] | None, name: str = "eligible"
) -> tuple[list[Tensor], list[Tensor | None]]:
    scores = list(scores)
    for s in scores:
        if not isinstance(s, Tensor):
            raise TypeError(f"scores must be tensors, got {type(s).__name__}")
    if eligible is None:
        elig: list[Tensor | None] = [None] * len(scores)
    else:
        elig = list(eligible)
        if len(elig) != len(scores):
            raise ValueError(f"got {len(elig)} {name} tensors for {len(scores)} score tensors")
        for i, (s, e) in enumerate(zip(scores, elig, strict=True)):
            if e is not None and e.shape != s.shape:
                raise ValueError(f"{name}[{i}] has shape {tuple(e.shape)}, scores[{i}] has {tuple(s.shape)}")
    devices = {t.device for t in scores} | {e.device for e in elig if e is not None}
    if len(devices) > 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    return scores, elig


def _pieces(tensors: Sequence[Tensor | None], chunk: int) -> Iterator[tuple[bool, object]]:
    """Index pieces covering the tensors' common shape in flat (row-major) order.

    Yields ``(flat, index)``: when every tensor is contiguous, ``index`` is a slice of
    the flattened view; otherwise it is a basic index whose result covers a run of at
    most ``chunk`` consecutive flat positions. Use :func:`_take` to apply it.
    """
    ref = next(t for t in tensors if t is not None)
    numel = ref.numel()
    if numel == 0:
        return
    if all(t is None or t.is_contiguous() for t in tensors):
        for a in range(0, numel, chunk):
            yield True, slice(a, min(a + chunk, numel))
        return
    shape = tuple(ref.shape)
    if numel <= chunk:
        yield False, (...,)
        return
    # Split along the first dim j whose trailing block (one index of j) fits in a chunk.
    j = 0
    inner = numel
    while True:
        inner //= shape[j]
        if inner <= chunk:
            break
        j += 1
    size = shape[j]
    rows = chunk // inner
    nblocks = -(-size // rows)
    step = -(-size // nblocks)
    for outer in itertools.product(*(range(d) for d in shape[:j])):
        for a in range(0, size, step):
            yield False, (*outer, slice(a, min(a + step, size)))


def _take(t: Tensor, flat: bool, index: object) -> Tensor:
    if flat:
        return t.view(-1)[index]  # type: ignore[index]
    return t[index].reshape(-1)  # type: ignore[index]


def _as_bool(e: Tensor) -> Tensor:
    return e if e.dtype == torch.bool else e == 1


def chunks(
    scores: Sequence[Tensor], eligible: Sequence[Tensor | None], chunk: int
) -> Iterator[tuple[Tensor, Tensor | None]]:
    """Yields ``(score chunk, eligible chunk as bool or None)`` over all tensors, in order."""
    for s, e in zip(scores, eligible, strict=True):
        for flat, index in _pieces((s, e), chunk):
            yield _take(s, flat, index), (None if e is None else _as_bool(_take(e, flat, index)))


def batches(
    scores: Sequence[Tensor], eligible: Sequence[Tensor | None], chunk: int, dtype: torch.dtype
) -> Iterator[tuple[Tensor, Tensor | None]]:
    """Like :func:`chunks`, in the same order, but runs of small contiguous tensors come concatenated.

    Each operation on a chunk costs a few microseconds of dispatch whatever its size: over thousands of small
    tensors (biases, narrow layers) that, not the entries, is the cost of a pass. Concatenating them copies at most
    ``chunk`` entries at a time. Concatenated scores are in ``dtype``, the common dtype of all the scores (a run's
    own promotion can be narrower: float16 with int32 is float16, where -2**31 overflows); eligibility is ``bool``.
    """
    run: list[tuple[Tensor, Tensor | None]] = []
    size = 0

    def flush() -> Iterator[tuple[Tensor, Tensor | None]]:
        if len(run) == 1:
            yield from chunks([run[0][0]], [run[0][1]], chunk)
        elif run:
            x = torch.cat([t.view(-1).to(dtype) for t, _ in run])
            if all(e is None for _, e in run):
                yield x, None
            else:
                parts = [
                    torch.ones(t.numel(), dtype=torch.bool, device=t.device) if e is None else _as_bool(e.view(-1))
                    for t, e in run
                ]
                yield x, torch.cat(parts)

    for s, e in zip(scores, eligible, strict=True):
        numel = s.numel()
        if numel * 4 <= chunk and s.is_contiguous() and (e is None or e.is_contiguous()):
            if size + numel > chunk:
                yield from flush()
                run, size = [], 0
            run.append((s, e))
            size += numel
        else:
            yield from flush()
            run, size = [], 0
            yield from chunks([s], [e], chunk)
    yield from flush()


def _sample_keys(
    scores: Sequence[Tensor], eligible: Sequence[Tensor | None], keys: Keys, numel: int
) -> tuple[Tensor, int] | None:
    """Sorted keys of the eligible entries among every ``numel // SAMPLE``-th entry (flat order across tensors),
    and how many entries were picked (eligible or not).

    ``None`` if a tensor is not contiguous (its flat positions are not a view).
    """
    step = max(1, numel // SAMPLE)
    parts: list[Tensor] = []
    flags: list[Tensor | None] = []
    start = 0  # flat position of the next tensor's first entry
    for s, e in zip(scores, eligible, strict=True):
        if not s.is_contiguous() or (e is not None and not e.is_contiguous()):
            return None
        first = -start % step
        start += s.numel()
        if first >= s.numel():
            continue
        parts.append(s.view(-1)[first::step])  # a strided view: copied once, by torch.cat below
        flags.append(None if e is None else e.view(-1)[first::step])
    if not parts:
        return None
    picked = keys(torch.cat(parts))
    if any(f is not None for f in flags):
        picked = picked[
            torch.cat(
                [
                    torch.ones(p.numel(), dtype=torch.bool, device=p.device) if f is None else _as_bool(f)
                    for p, f in zip(parts, flags, strict=True)
                ]
            )
        ]
    return torch.sort(_where_to_sort(picked)).values, sum(p.numel() for p in parts)


def _where_to_sort(t: Tensor) -> Tensor:
    """``t`` where its final sort or k-th pick runs: on a CUDA device, where it is; otherwise on the CPU.

    These sets are small (the sample, a window or a bin: up to a few million keys), but on an H100 a copy to the host
    and a CPU ``kthvalue`` over a window of 2M keys took 22 ms of a 33 ms global selection at 134M weights; with the
    pick on the device the whole call takes 14 ms. Only scalars then travel to the host.
    """
    return t if t.device.type == "cuda" else t.cpu()


def _positions(flags: Tensor) -> Tensor:
    """Indices of the true entries of a 1-D contiguous bool tensor where they are rare (a few per thousand).

    ``nonzero`` and boolean indexing cost several nanoseconds an entry on the CPU however few are true; here the
    flags are read eight at a time as 64-bit words, so only the words holding a true flag are opened.
    """
    n = flags.numel()
    whole = n - n % 8
    words = flags[:whole].view(torch.int64)
    opened = words.nonzero().squeeze(1).mul_(8)
    candidates = (opened.unsqueeze(1) + torch.arange(8, device=flags.device)).view(-1)
    found = candidates[flags[candidates]]
    if whole < n:
        found = torch.cat([found, flags[whole:].nonzero().squeeze(1).add_(whole)])
    return found


def _window_cut(
    scores: Sequence[Tensor], eligible: Sequence[Tensor | None], keys: Keys, k: int, numel: int
) -> tuple[int, int, int] | None:
    """``(key, ties, equal)`` of the k-th eligible key from one exact pass over a window estimated by a sample.

    The sample's quantiles bound a key window ``[lo, lo + 2**s)`` that holds the k-th key with high probability;
    one pass counts the eligible keys below the window and collects those inside it (a few per thousand entries),
    and the k-th key is picked among them. Per chunk that is a handful of cheap integer operations and a sum,
    without comparisons into fresh masks (slow on the CPU) or ``bincount``. ``None`` when the sample is not usable,
    the window misses the k-th key or holds too many entries: the caller then runs the histogram passes.
    """
    drawn = _sample_keys(scores, eligible, keys, numel) if SAMPLE > 0 else None
    if drawn is None or drawn[0].numel() == 0:
        return None
    sample, picked = drawn
    m = sample.numel()
    at = k * picked / numel  # the k-th key's expected rank among the sampled eligible keys
    p = min(max(at / m, 0.0), 1.0)
    spread = SIGMAS * math.sqrt(m * p * (1 - p)) + 4
    a, b = min(math.floor(at - spread), m - 1), math.ceil(at + spread)
    lo = keys.lo if a < 0 else int(sample[a])
    top = keys.hi if b >= m else int(sample[b])  # the window must hold keys up to top
    shift = max(0, (top - lo).bit_length())  # 2**shift > top - lo
    if (1 << shift) > keys.dmax:  # wider than the key dtype can offset (signed keys around 0): histograms
        return None
    if lo + (1 << shift) > keys.dmax:  # near the top of the key range: the same width, ending at its top
        lo = keys.dmax - (1 << shift)
    hi = lo + (1 << shift)
    if lo - 1 < keys.dmin or top >= hi:
        return None  # the window's bounds would overflow the key dtype: let the histograms handle it
    expected = (min(b, m) - max(a, 0) + 1) / m * numel
    capacity = min(numel, max(1 << 16, int(4 * expected)))
    device = scores[0].device
    found = torch.empty(capacity, dtype=keys.key_dtype, device=device)
    pos = 0
    total = torch.zeros((), dtype=torch.int64, device=device)  # sum over entries: -1 below, 0 inside, 1 above
    entries = 0
    for x, e in batches(scores, eligible, chunk_size(device), keys.dtype):
        t = keys(x)
        t.clamp_(lo - 1, hi).sub_(lo)  # -1 below the window, 0 .. 2**shift - 1 inside, 2**shift above
        where = t >> shift  # -1 below, 0 inside, 1 above
        if e is not None:  # an ineligible entry counts as above the window
            where.sub_(1).mul_(e).add_(1)
        hits = t[_positions(torch.logical_not(where))]
        if pos + hits.numel() > capacity:
            return None
        found[pos : pos + hits.numel()] = hits
        pos += hits.numel()
        total += where.sum(dtype=torch.int32)
        entries += x.numel()
    below = (entries - pos - int(total)) // 2
    rank = k - below
    if not 0 < rank <= pos:
        return None
    cand = _where_to_sort(found[:pos])
    value = torch.kthvalue(cand, rank).values
    value, less, equal = torch.stack([value.to(torch.int64), (cand < value).sum(), (cand == value).sum()]).tolist()
    return value + lo, rank - less, equal


def histogram(
    scores: Sequence[Tensor],
    eligible: Sequence[Tensor | None],
    keys: Keys,
    shift: int,
    offset: int,
    nbins: int,
    within: tuple[int, int] | None,
) -> Tensor:
    """Counts eligible keys by bin ``(key >> shift) - offset``; returns ``nbins`` counts on CPU.

    With ``within=(s, p)`` only keys with ``key >> s == p`` are counted.
    """
    device = scores[0].device
    # Bin 0 collects the entries not counted; bin b + 1 counts bin b.
    hist = torch.zeros(nbins + 1, dtype=torch.int64, device=device)
    for x, e in chunks(scores, eligible, chunk_size(device)):
        idx = keys(x)  # a new tensor: modified in place below
        keep = e
        if within is not None:
            s, p = within
            inside = (idx >> s) == p
            keep = inside if keep is None else inside.logical_and_(keep)
        if shift:
            idx >>= shift
        if offset != 1:  # bin b is counted at index b + 1
            if offset - 1 >= keys.dmin:
                idx -= offset - 1
            else:  # offset - 1 does not fit the key dtype
                idx -= offset
                idx += 1
        if keep is not None:
            idx *= keep  # much faster than a data-dependent select on CPU
        if idx.numel() * 4 >= nbins:
            hist += torch.bincount(idx, minlength=nbins + 1)
        else:  # a small chunk: cheaper than building and adding a full histogram
            hist.index_add_(0, idx, torch.ones_like(idx, dtype=torch.int64))
    return hist[1:].cpu()


def _gather(
    scores: Sequence[Tensor],
    eligible: Sequence[Tensor | None],
    keys: Keys,
    capacity: int,
    within: tuple[int, int] | None,
) -> Tensor:
    """Sorted keys of the eligible entries (with ``key >> s == p`` if ``within=(s, p)``), where
    :func:`_where_to_sort` puts them.

    There must be at most ``capacity`` of them.
    """
    device = scores[0].device
    # One buffer allocated up front: many small per-chunk results would fragment the heap.
    found = torch.empty(capacity, dtype=keys.key_dtype, device=device)
    pos = 0
    for x, e in chunks(scores, eligible, chunk_size(device)):
        key = keys(x)
        keep = e
        if within is not None:
            s, p = within
            inside = (key >> s) == p
            keep = inside if keep is None else inside.logical_and_(keep)
        hits = key if keep is None else key[keep]
        if pos + hits.numel() > capacity:  # pragma: no cover - the histogram pass counted these entries
            raise RuntimeError("the scores changed during the selection")
        found[pos : pos + hits.numel()] = hits
        pos += hits.numel()
    return torch.sort(_where_to_sort(found[:pos])).values


def _cut_from_sorted(keys: Tensor, rank: int) -> tuple[int, int, int]:
    """``(key, ties, equal)`` for the ``rank``-th (1-based) of sorted ``keys``."""
    at = keys[rank - 1 : rank]
    key, below, after = torch.cat(
        [at.to(torch.int64), torch.searchsorted(keys, at), torch.searchsorted(keys, at, right=True)]
    ).tolist()
    return key, rank - below, after - below


def real_scores(scores: list[Tensor], magnitude: bool) -> list[Tensor]:
    """``scores`` with every complex tensor replaced by its magnitude (``abs``, a real tensor), as torch's
    ``L1Unstructured`` ranks complex parameters; complex values have no signed order, so ranking by value refuses them.

    Example:
        >>> real_scores([torch.tensor([3 + 4j, 1j])], magnitude=True)
        [tensor([5., 1.])]
    """
    if not any(s.is_complex() for s in scores):
        return scores
    if not magnitude:
        dtype = next(s.dtype for s in scores if s.is_complex())
        raise TypeError(
            f"complex scores (dtype {dtype}) have no order by value: rank them by magnitude (e.g. L1Unstructured)"
        )
    return [s.abs() if s.is_complex() else s for s in scores]


@_on_one_thread
def find_cut(
    scores: Sequence[Tensor],
    k: int,
    *,
    eligible: Sequence[Tensor | None] | None = None,
    magnitude: bool = False,
    largest: bool = False,
) -> Cut:
    """Finds the cut selecting the ``k`` smallest eligible entries over all ``scores``.

    Ties are broken by flat index: among equal scores, lower flat indices are selected
    first, and all entries of ``scores[0]`` come before those of ``scores[1]``, etc.
    NaN ranks above ``+inf`` (so it is selected last, or first when ``largest``), and
    ``-0.0`` equals ``+0.0``.

    Args:
        scores: Tensors of any shapes and layouts on one device; floating (16/32/64-bit)
            or integer dtypes, or complex ones with ``magnitude`` (ranked by ``abs``). Mixed
            dtypes compare as if promoted to their common dtype.
        k: How many entries to select, ``0 <= k <=`` number of eligible entries.
        eligible: Per tensor, ``None`` (all entries eligible) or a tensor of the same shape:
            bool, or numeric where entries equal to 1 are eligible. Other entries are
            never selected and do not count toward ``k``.
        magnitude: Rank by absolute value instead of signed value.
        largest: Select the ``k`` largest entries instead of the smallest.

    Returns:
        The :class:`Cut` to pass to :func:`apply_cut` with the same arguments.

    Raises:
        ValueError: If ``k`` is negative or exceeds the number of eligible entries, or if
            shapes or devices do not match.

    Example:
        >>> import torch
        >>> scores = [torch.tensor([0.5, -2.0]), torch.tensor([[1.0, -0.5], [3.0, 0.0]])]
        >>> cut = find_cut(scores, 3, magnitude=True)
        >>> masks = [torch.empty(s.shape, dtype=torch.bool) for s in scores]
        >>> apply_cut(scores, cut, out=masks, magnitude=True)
        >>> masks  # False where selected
        [tensor([False,  True]), tensor([[ True, False],
                [ True, False]])]
    """
    scores, elig = check_scores(scores, eligible)
    scores = real_scores(scores, magnitude)
    if isinstance(k, bool):
        raise TypeError("k must be an integer, got bool")
    k = operator.index(k)
    if k < 0:
        raise ValueError(f"k={k} must be non-negative")
    if not scores:
        if k > 0:
            raise ValueError(f"k={k} exceeds the number of eligible entries (0)")
        return Cut(0, 0)
    keys = Keys(common_dtype(scores), magnitude, largest)

    numel = sum(s.numel() for s in scores)
    if numel <= BIN_LIMIT:  # small enough to sort all eligible keys at once
        cand = _gather(scores, elig, keys, numel, None)
        _check_k(k, cand.numel())
        if k == 0:
            return Cut(keys.lo, 0)
        key, ties, equal = _cut_from_sorted(cand, k)
        return _canonical(key, ties, equal, keys)

    if k > 0:
        window = _window_cut(scores, elig, keys, k, numel)
        if window is not None:
            return _canonical(*window, keys)

    shift, offset, nbins = first_pass(keys)
    hist = histogram(scores, elig, keys, shift, offset, nbins, None)
    _check_k(k, int(hist.sum()))
    if k == 0:
        return Cut(keys.lo, 0)

    def refine(shift: int, offset: int, nbins: int, within: tuple[int, int]) -> Tensor:
        return histogram(scores, elig, keys, shift, offset, nbins, within)

    def settle(count: int, shift: int, prefix: int, rank: int) -> tuple[int, int, int] | None:
        """A bin small enough is sorted instead of refined."""
        if count > BIN_LIMIT:
            return None
        return _cut_from_sorted(_gather(scores, elig, keys, count, (shift, prefix)), rank)

    key, ties, equal, _ = descend(hist, shift, offset, k, refine, settle)
    return _canonical(key, ties, equal, keys)


def first_pass(keys: Keys) -> tuple[int, int, int]:
    """``(shift, offset, nbins)`` of the first histogram pass over ``keys``: its top :data:`RADIX_BITS` bits.

    Example:
        >>> first_pass(Keys(torch.int8, magnitude=False, largest=False))
        (0, -128, 256)
    """
    shift = max(0, keys.bits - RADIX_BITS)
    offset = keys.lo >> shift
    return shift, offset, (keys.hi >> shift) - offset + 1


def descend(
    hist: Tensor,
    shift: int,
    offset: int,
    rank: int,
    refine: Callable[[int, int, int, tuple[int, int]], Tensor],
    settle: Callable[[int, int, int, int], tuple[int, int, int] | None] | None = None,
) -> tuple[int, int, int, int]:
    """Walk the histogram passes down to the ``rank``-th (1-based) smallest key, from the first pass's ``hist``.

    Each pass finds the bin holding that key; ``refine(shift, offset, nbins, within)`` histograms the bin's keys at
    the next, finer ``shift`` (``within = (shift, prefix)``: the keys with ``key >> shift == prefix``), until the
    shift is 0 and a bin is one key. ``settle(count, shift, prefix, rank)`` may end the walk earlier with
    ``(key, ties, equal)`` (e.g. by sorting a small bin), or return ``None`` to go on.

    Returns:
        ``(key, ties, equal, bin)``: the key, how many entries equal to it are selected (``rank`` among them),
        how many there are, and its bin in the last histogram (``-1`` when ``settle`` ended the walk).

    Example:
        >>> keys = torch.tensor([3, 1, 2, 2, 5])
        >>> hist = torch.bincount(keys, minlength=6)  # one pass at shift 0: offset 0, one bin a key
        >>> descend(hist, 0, 0, 4, refine=histogram)  # the 4th smallest: 3, the 1st of the one 3 (refines nothing)
        (3, 1, 1, 3)
    """
    while True:
        cum = hist.cumsum(0)
        j = int(torch.searchsorted(cum, torch.tensor([rank], dtype=cum.dtype))[0])
        if j > 0:
            rank -= int(cum[j - 1])
        count = int(hist[j])
        prefix = offset + j  # keys in this bin satisfy key >> shift == prefix
        if shift == 0:
            return prefix, rank, count, j
        settled = None if settle is None else settle(count, shift, prefix, rank)
        if settled is not None:
            return (*settled, -1)
        new_shift = max(0, shift - RADIX_BITS)
        offset = prefix << (shift - new_shift)
        hist = refine(new_shift, offset, 1 << (shift - new_shift), (shift, prefix))
        shift = new_shift


def _check_k(k: int, total: int) -> None:
    if k > total:
        raise ValueError(f"k={k} exceeds the number of eligible entries ({total})")


def _canonical(key: int, ties: int, equal: int, keys: Keys) -> Cut:
    if ties == equal and key < keys.dmax:
        return Cut(key + 1, 0)  # every equal key is selected: a plain threshold suffices
    return Cut(key, ties)


@_on_one_thread
def apply_cut(
    scores: Sequence[Tensor],
    cut: Cut,
    *,
    out: Sequence[Tensor],
    eligible: Sequence[Tensor | None] | None = None,
    base: Sequence[Tensor | None] | None = None,
    magnitude: bool = False,
    largest: bool = False,
) -> None:
    """Writes masks for a cut: ``base`` with the selected entries set to 0.

    Works chunk by chunk, without any full-size temporary. ``out`` may alias ``base``
    and ``eligible`` (e.g. to update a mask in place for a second pruning round).

    Args:
        scores: The scores given to :func:`find_cut`.
        cut: The cut returned by :func:`find_cut`.
        out: Preallocated contiguous tensors, one per score tensor and of the same shape,
            of any dtype (bool included); values are converted to it.
        eligible: The eligibility masks given to :func:`find_cut`.
        base: Per tensor, the values to write where nothing is selected; ``None`` means ones.
        magnitude: As given to :func:`find_cut`.
        largest: As given to :func:`find_cut`.

    Raises:
        ValueError: If shapes, lengths or devices do not match, or an output is not contiguous.

    Example:
        >>> import torch
        >>> w = torch.tensor([[0.3, -0.1], [2.0, 0.2]])
        >>> cut = find_cut([w], 2, magnitude=True)
        >>> mask = torch.empty(2, 2)
        >>> apply_cut([w], cut, out=[mask], magnitude=True)
        >>> mask
        tensor([[1., 0.],
                [1., 0.]])
    """
    scores, elig = check_scores(scores, eligible)
    scores = real_scores(scores, magnitude)
    _, bases = check_scores(scores, base, "base")
    outs = list(out)
    if len(outs) != len(scores):
        raise ValueError(f"got {len(outs)} out tensors for {len(scores)} score tensors")
    for i, (s, o) in enumerate(zip(scores, outs, strict=True)):
        if o.shape != s.shape:
            raise ValueError(f"out[{i}] has shape {tuple(o.shape)}, scores[{i}] has {tuple(s.shape)}")
        if not o.is_contiguous():
            raise ValueError(f"out[{i}] must be contiguous")
        if o.device != s.device:
            raise ValueError(f"out[{i}] is on {o.device}, scores[{i}] on {s.device}")
    if not scores:
        return
    keys = Keys(common_dtype(scores), magnitude, largest)
    device = scores[0].device
    _apply(scores, cut, outs, elig, bases, keys, chunk_size(device), sync_free=device.type != "cpu")


def _apply(
    scores: list[Tensor],
    cut: Cut,
    outs: list[Tensor],
    elig: list[Tensor | None],
    bases: list[Tensor | None],
    keys: Keys,
    chunk: int,
    sync_free: bool,
) -> None:
    threshold, ties = cut.key, cut.ties
    if ties < 0:
        raise ValueError(f"cut.ties={ties} must be non-negative")
    if threshold > keys.dmax:  # all keys are below: select every eligible entry
        threshold, ties = keys.dmax, 0
        select_all = True
    else:
        select_all = False
        if threshold < keys.dmin:
            threshold, ties = keys.dmin, 0  # nothing below; no equal key is selected
    device = scores[0].device
    plain = not select_all and threshold > keys.dmin  # a threshold alone decides where no tie is split
    if plain and ties == 0:
        _apply_threshold(scores, threshold, outs, elig, bases, keys, chunk)
        return
    left = ties  # equal keys still to select (host counter)
    used = torch.zeros((), dtype=torch.int64, device=device)  # equal keys seen so far (device counter)
    for s, e, b, o in zip(scores, elig, bases, outs, strict=True):
        for flat, index in _pieces((s, e, b), chunk):
            key = keys(_take(s, flat, index))
            ek = None if e is None else _as_bool(_take(e, flat, index))
            dst = o.view(-1)[index] if flat else o[index].view(-1)  # type: ignore[index]
            if plain and not sync_free and left == 0:
                _write_threshold(key, threshold, ek, [(dst, None if b is None else _take(b, flat, index))])
                continue
            sel = torch.ones(key.shape, dtype=torch.bool, device=device) if select_all else key < threshold
            if ek is not None:
                sel &= ek
            if ties > 0 and (sync_free or left > 0):
                equal = key == threshold
                if ek is not None:
                    equal &= ek
                if sync_free:
                    rank = equal.cumsum(0)
                    rank += used
                    if rank.numel():
                        used = rank[-1]
                    equal &= rank <= ties
                    sel |= equal
                else:
                    n = int(equal.sum())
                    if n > left:
                        equal &= equal.cumsum(0) <= left
                        n = left
                    sel |= equal
                    left -= n
            if b is None:
                if dst.dtype == torch.bool:
                    torch.logical_not(sel, out=dst)
                else:
                    dst.copy_(sel.logical_not_())
            else:
                _write_kept(dst, _take(b, flat, index), sel.logical_not_())


def _apply_threshold(
    scores: list[Tensor],
    threshold: int,
    outs: list[Tensor],
    elig: list[Tensor | None],
    bases: list[Tensor | None],
    keys: Keys,
    chunk: int,
) -> None:
    """:func:`_apply` for a cut without split ties: keep what is at or above ``threshold``.

    Runs of small contiguous tensors are concatenated (as in :func:`batches`) and written back one slice each, so
    that thousands of biases and narrow layers cost one operation each instead of one per step of the pass.
    """
    run: list[int] = []
    size = 0

    def flush() -> None:
        if not run:
            return
        x = torch.cat([scores[i].view(-1).to(keys.dtype) for i in run])  # (the run's own promotion may be narrower)
        flags = [elig[i] for i in run]
        ek = None
        if any(f is not None for f in flags):
            ek = torch.cat(
                [
                    torch.ones(scores[i].numel(), dtype=torch.bool, device=x.device)
                    if f is None
                    else _as_bool(f.view(-1))
                    for i, f in zip(run, flags, strict=True)
                ]
            )
        pieces = [(outs[i].view(-1), None if bases[i] is None else bases[i].view(-1)) for i in run]  # type: ignore[union-attr]
        _write_threshold(keys(x), threshold, ek, pieces)

    for i, (s, e, b, o) in enumerate(zip(scores, elig, bases, outs, strict=True)):
        numel = s.numel()
        small = numel * 4 <= chunk and all(t is None or t.is_contiguous() for t in (s, e, b, o))
        if small:
            if size + numel > chunk:
                flush()
                run, size = [], 0
            run.append(i)
            size += numel
            continue
        flush()
        run, size = [], 0
        for flat, index in _pieces((s, e, b), chunk):
            ek = None if e is None else _as_bool(_take(e, flat, index))
            dst = o.view(-1)[index] if flat else o[index].view(-1)  # type: ignore[index]
            piece = None if b is None else _take(b, flat, index)
            _write_threshold(keys(_take(s, flat, index)), threshold, ek, [(dst, piece)])
    flush()


def _write_threshold(
    key: Tensor, threshold: int, ek: Tensor | None, pieces: list[tuple[Tensor, Tensor | None]]
) -> None:
    """Write ``base`` (or ones) where ``key >= threshold`` or the entry is not eligible, else 0, into consecutive
    ``(dst, base)`` pieces covering ``key`` (1-D views; ``base`` may be ``None``).

    ``key >= threshold`` is integer arithmetic (a comparison into a fresh bool tensor is several times slower on the
    CPU): the keys are clamped to ``{threshold - 1, threshold}`` and shifted to 0 or 1.
    """
    kept = key.clamp_(threshold - 1, threshold).sub_(threshold - 1)
    keep: Tensor = kept
    if ek is not None or any(base is not None for _, base in pieces):
        keep = torch.empty(kept.shape, dtype=torch.bool, device=kept.device).copy_(kept)
        if ek is not None:  # an ineligible entry is never selected
            keep.logical_or_(ek.logical_not())
    start = 0
    for dst, base in pieces:
        part = keep[start : start + dst.numel()]
        start += dst.numel()
        if base is None:
            dst.copy_(part)
        else:
            _write_kept(dst, base, part)


def _write_kept(dst: Tensor, src: Tensor, keep: Tensor) -> None:
    """``dst = src`` where ``keep``, else ``0``, with no data-dependent branch (slow on random masks).

    Floats are multiplied as integer bit patterns: a cleared pattern is exactly ``+0.0``, and
    kept values (NaN, infinities, ``-0.0``) are untouched.
    """
    bits = _FLOAT_LAYOUT[dst.dtype][0] if dst.dtype in _FLOAT_LAYOUT else None
    if bits is not None and src.dtype == dst.dtype:
        torch.mul(src.view(bits), keep, out=dst.view(bits))
        return
    dst.copy_(src)
    if bits is not None:
        dst.view(bits).mul_(keep)
    elif dst.is_complex():
        dst.masked_fill_(keep.logical_not_(), 0)
    else:
        dst.mul_(keep)


def select_smallest(
    scores: Sequence[Tensor],
    k: int,
    *,
    eligible: Sequence[Tensor | None] | None = None,
    magnitude: bool = False,
    largest: bool = False,
) -> list[Tensor]:
    """Selects the ``k`` smallest (or largest) eligible entries and returns bool masks.

    A convenience over :func:`find_cut` and :func:`apply_cut` for tests and small inputs;
    the arguments and tie-breaking are those of :func:`find_cut`.

    Returns:
        One bool tensor per score tensor, of the same shape, ``True`` where selected.

    Example:
        >>> import torch
        >>> select_smallest([torch.tensor([2, -7, 5]), torch.tensor([-1, 2])], 3, magnitude=True)
        [tensor([ True, False, False]), tensor([True, True])]
        >>> select_smallest([torch.tensor([1.0, float("nan"), 1.0])], 2, largest=True)
        [tensor([ True,  True, False])]
    """
    scores = list(scores)
    cut = find_cut(scores, k, eligible=eligible, magnitude=magnitude, largest=largest)
    outs = [torch.empty(s.shape, dtype=torch.bool, device=s.device) for s in scores]
    apply_cut(scores, cut, out=outs, eligible=eligible, magnitude=magnitude, largest=largest)
    for o in outs:
        o.logical_not_()
    return outs


def count_eligible(eligible: Sequence[Tensor | None], scores: Sequence[Tensor]) -> int:
    """Counts the eligible entries, chunk by chunk.

    Args:
        eligible: Per tensor, ``None`` (every entry eligible) or a mask of the same shape
            as the matching score tensor (bool, or numeric where 1 means eligible).
        scores: The score tensors (only their shapes are used).

    Returns:
        The number of eligible entries over all tensors.

    Example:
        >>> import torch
        >>> count_eligible([None, torch.tensor([1.0, 0.0, 1.0])], [torch.zeros(2, 3), torch.zeros(3)])
        8
    """
    scores, elig = check_scores(scores, eligible)
    total = 0
    for s, e in zip(scores, elig, strict=True):
        if e is None:
            total += s.numel()
            continue
        count = torch.zeros((), dtype=torch.int64, device=e.device)
        for flat, index in _pieces((e,), chunk_size(e.device)):
            count += _as_bool(_take(e, flat, index)).sum()
        total += int(count)
    return total
