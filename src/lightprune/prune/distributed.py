"""Exact pruning of sharded tensors: every rank keeps the mask of its own shard, no rank gathers a full tensor.

A model sharded with FSDP2 (``fully_shard``, Lightning's ``ModelParallelStrategy``) holds each parameter as a
:class:`~torch.distributed.tensor.DTensor` whose rows are split across the ranks (``Shard(0)``). The selection of
:mod:`lightprune.prune.k_smallest` is a sequence of histogram passes over the scores' bit patterns, and histograms add:
each rank counts its own shard, the counts are summed with one ``all_reduce`` per pass, and every rank finds the same
exact threshold. The passes refine until the threshold key is known exactly (two passes for 32-bit scores, one for
16-bit ones, four for 64-bit ones), so the traffic of one event is a few hundred kilobytes whatever the model size.

Ties at the threshold are broken by the *global* flat index, as in one process: each rank reports how many
threshold entries its shard of each tensor holds (one ``all_gather`` of two integers per tensor), and the ones
to select are counted out in global order (tensor after tensor, and within a tensor shard after shard, since a
``Shard(0)`` shard is one contiguous run of the tensor's flat order). The masks are therefore exactly those of
:func:`lightprune.prune.global_unstructured` (or ``l1_unstructured``) run in one process on the full tensors.

Plain tensors (modules left unsharded, replicated on every rank) may be mixed in: they count once (on the group's
rank 0) and every rank writes the same full mask for them.

Structured pruning ranks channels by a per-channel quantity (a norm, a random draw) over a vector as long as the
channel dim: each rank computes its part of that small vector (its own channels, or partial sums over its rows
when the channels run along another dim) and one ``all_reduce`` completes it on every rank; the ranking itself
is then the single-process one. Norms along a dim split across ranks are combined from partial sums in float64
and rounded once to the tensor's dtype: equal to ``torch.norm`` up to its own rounding, so the channels chosen match
a single process unless two channel norms are within one rounding step of each other.

Random methods draw identically on every rank from the global generator (seed every rank the same): unstructured
draws are generated in chunks over each full tensor's entries still unpruned, in flat order, each rank keeping its
own run, which gives the very numbers one process draws (so the same seed gives the same mask) in bounded memory.
They come from the CPU generator whatever the device (one process on a GPU draws from the GPU's generator, so there
the same seed gives other, equally uniform, masks).

Supported layouts: DTensors on a one-dimensional device mesh whose placement is ``Shard(0)`` or ``Replicate()``
(FSDP2's layout), and plain tensors. Other placements raise ``NotImplementedError`` naming them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightprune.prune.amount import _compute_nparams_toprune, _validate_pruning_amount, validate_amount
from lightprune.prune.collapse import cap_units, check_max_layer_sparsity, fill_under_caps
from lightprune.prune.k_smallest import (
    Cut,
    Keys,
    apply_cut,
    check_scores,
    chunk_size,
    chunks,
    common_dtype,
    count_eligible,
    descend,
    first_pass,
    histogram,
    select_smallest,
)

__all__ = [
    "Piece",
    "Traffic",
    "as_dtensor",
    "find_cuts",
    "group_of",
    "is_sharded",
    "local_of",
    "local_part",
    "local_piece",
    "pruned_units",
    "sharded_structured_mask",
    "sharded_unstructured_masks",
    "traffic",
]


@dataclass
class Traffic:
    """Bytes this process handed to collectives (the payload of each call), and how many calls.

    Example:
        >>> t = Traffic()
        >>> t.add(torch.zeros(4, dtype=torch.int64)); (t.bytes, t.calls)
        (32, 1)
    """

    bytes: int = 0
    calls: int = 0

    def add(self, tensor: Tensor) -> None:
        """Count one collective call on ``tensor``."""
        self.bytes += tensor.numel() * tensor.element_size()
        self.calls += 1


#: Payload of every collective issued by this module since import (reset it with ``traffic.bytes = 0``).
traffic = Traffic()


@dataclass
class Piece:
    """One rank's part of a logical tensor.

    Attributes:
        local: The values this rank holds (a plain tensor; the whole tensor for a replicated one).
        offset: Flat index, in the full tensor, of ``local``'s first entry (its part is one contiguous run).
        owner: Whether this rank's part counts in the histograms (``False`` for the copies of a replicated tensor
            on ranks other than 0).
        replicated: Every rank holds the whole tensor.
        shape: The full tensor's shape.
    """

    local: Tensor
    offset: int
    owner: bool
    replicated: bool
    shape: torch.Size


def _dtensor_type() -> Any:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    return DTensor


def is_sharded(tensor: Any) -> bool:
    """Whether ``tensor`` is a DTensor (a parameter of an FSDP2 / ``ModelParallelStrategy`` model).

    Example:
        >>> is_sharded(torch.zeros(2))
        False
    """
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(tensor, dtensor)


def _rank(group: Any) -> int:
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def _world(group: Any) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def placement_problem(tensor: Any) -> str | None:
    """Why sharded pruning cannot take this DTensor (``None`` when it can, or for a plain tensor): it supports a 1-D
    device mesh with ``Shard(0)`` (FSDP2's layout) or ``Replicate()``, not tensor parallelism's other dims nor 2-D
    meshes (FSDP with tensor parallelism, HSDP).

    Example:
        >>> placement_problem(torch.ones(2)) is None
        True
    """
    if not is_sharded(tensor):
        return None
    from torch.distributed.tensor import Replicate, Shard

    placements = tuple(tensor.placements)
    if tensor.device_mesh.ndim != 1 or len(placements) != 1:
        return (
            f"sharded pruning supports DTensors on a 1-D device mesh; got a mesh of shape "
            f"{tuple(tensor.device_mesh.shape)} with placements {placements}"
        )
    placement = placements[0]
    if isinstance(placement, Replicate) or (isinstance(placement, Shard) and placement.dim == 0):
        return None
    return f"sharded pruning supports DTensors placed Shard(0) (FSDP2's layout) or Replicate(); got {placement}"


def local_piece(tensor: Tensor, group: Any = None) -> Piece:
    """This rank's :class:`Piece` of ``tensor``: a DTensor's local shard, or a plain tensor as a replicated one.

    Args:
        tensor: A DTensor on a 1-D mesh placed ``Shard(0)`` or ``Replicate()``, or a plain tensor.
        group: The process group (``None``: the default group); a plain tensor counts on its rank 0 only.

    Raises:
        NotImplementedError: For another placement or a mesh of more than one dimension.

    Example:
        >>> piece = local_piece(torch.ones(3, 2))
        >>> piece.offset, piece.owner, piece.replicated, tuple(piece.shape)
        (0, True, True, (3, 2))
    """
    if not is_sharded(tensor):
        return Piece(tensor, 0, _rank(group) == 0, True, tensor.shape)
    from torch.distributed.tensor import Replicate

    problem = placement_problem(tensor)
    if problem is not None:
        raise NotImplementedError(problem)
    placements = tuple(tensor.placements)
    local = tensor.to_local()
    if isinstance(placements[0], Replicate):
        return Piece(local, 0, tensor.device_mesh.get_local_rank() == 0, True, tensor.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, placements)
    row = math.prod(tensor.shape[1:])
    return Piece(local, int(offsets[0]) * row if tensor.dim() else 0, True, False, tensor.shape)


def _all_reduce(t: Tensor, group: Any, op: Any = None) -> Tensor:
    """``all_reduce`` on the backend's device (CUDA for NCCL); returns the result on ``t``'s device."""
    if _world(group) == 1:
        return t
    device = _comm_device(group)
    buf = t.to(device)
    traffic.add(buf)
    dist.all_reduce(buf, op=dist.ReduceOp.SUM if op is None else op, group=group)
    return buf.to(t.device)


def _all_gather(t: Tensor, group: Any) -> Tensor:
    """Stacks every rank's ``t`` (same shape everywhere) along a new dim 0, on ``t``'s device."""
    world = _world(group)
    if world == 1:
        return t.unsqueeze(0)
    device = _comm_device(group)
    buf = t.to(device)
    out = [torch.empty_like(buf) for _ in range(world)]
    traffic.add(buf)
    dist.all_gather(out, buf, group=group)
    return torch.stack(out).to(t.device)


def _comm_device(group: Any) -> torch.device:
    backend = dist.get_backend(group)
    if "nccl" in str(backend).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _global_count(pieces: Sequence[Piece], eligible: Sequence[Tensor | None], group: Any) -> int:
    owned = [(p.local, e) for p, e in zip(pieces, eligible, strict=True) if p.owner]
    local = count_eligible([e for _, e in owned], [s for s, _ in owned]) if owned else 0
    return int(_all_reduce(torch.tensor([local], dtype=torch.int64), group)[0])


def find_cuts(
    pieces: Sequence[Piece],
    k: int,
    *,
    eligible: Sequence[Tensor | None] | None = None,
    magnitude: bool = False,
    largest: bool = False,
    group: Any = None,
) -> list[Cut]:
    """The cut of each local piece such that, over all ranks, the ``k`` smallest eligible entries are selected.

    The distributed counterpart of :func:`lightprune.prune.k_smallest.find_cut` (same arguments, same order, same
    tie rule by global flat index), called on every rank of ``group`` with that rank's pieces. Apply the result
    with :func:`lightprune.prune.k_smallest.apply_cut`, one piece at a time: ``apply_cut([p.local], cuts[i], ...)``.

    Args:
        pieces: This rank's :class:`Piece` of every tensor, in the same order on every rank.
        k: How many entries to select over all ranks.
        eligible: Per piece, ``None`` or a local mask of ``piece.local``'s shape (bool, or 1 = eligible).
        magnitude: Rank by absolute value.
        largest: Select the largest instead.
        group: The process group (``None``: the default one).

    Returns:
        One :class:`~lightprune.prune.k_smallest.Cut` per piece.

    Raises:
        ValueError: If ``k`` is negative or exceeds the eligible entries over all ranks.

    Example:
        >>> w = torch.tensor([[0.5, -0.1], [0.3, 0.1]])
        >>> cuts = find_cuts([local_piece(w)], 2, magnitude=True)  # one process: as find_cut
        >>> mask = torch.empty(2, 2, dtype=torch.bool)
        >>> apply_cut([w], cuts[0], out=[mask], magnitude=True)
        >>> mask
        tensor([[ True, False],
                [ True, False]])
    """
    pieces = list(pieces)
    scores, elig = check_scores([p.local for p in pieces], eligible)
    if k < 0:
        raise ValueError(f"k={k} must be non-negative")
    if not pieces:
        if k:
            raise ValueError(f"k={k} exceeds the number of eligible entries (0)")
        return []
    keys = Keys(common_dtype(scores), magnitude, largest)
    own = [i for i, p in enumerate(pieces) if p.owner and p.local.numel()]
    own_scores = [scores[i] for i in own]
    own_elig = [elig[i] for i in own]

    # The last pass (shift 0) counts exact keys. Counted piece by piece, the local counts of the threshold key in
    # every piece come with it, which the tie split needs: no extra pass over the data (at most 16 MB of counts).
    per_piece_ok = len(pieces) <= PER_PIECE_PIECES
    local_final: list[Tensor] | None = None

    def global_histogram(shift: int, offset: int, nbins: int, within: tuple[int, int] | None) -> Tensor:
        """The histogram of every rank's own scores, summed across ranks."""
        nonlocal local_final
        if shift == 0 and per_piece_ok:
            local_final = [
                histogram([s], [e], keys, shift, offset, nbins, within)
                if s.numel()
                else torch.zeros(nbins, dtype=torch.int64)
                for s, e in zip(scores, elig, strict=True)
            ]
            hist = torch.zeros(nbins, dtype=torch.int64)
            for i in own:
                hist += local_final[i]
        elif own_scores:
            hist = histogram(own_scores, own_elig, keys, shift, offset, nbins, within)
        else:
            hist = torch.zeros(nbins, dtype=torch.int64)
        return _all_reduce(hist, group)

    shift, offset, nbins = first_pass(keys)
    hist = global_histogram(shift, offset, nbins, None)
    total = int(hist.sum())
    if k > total:
        raise ValueError(f"k={k} exceeds the number of eligible entries ({total})")
    if k == 0:
        return [Cut(keys.lo, 0)] * len(pieces)
    key, ties, equal, final_bin = descend(hist, shift, offset, k, global_histogram)
    if ties == equal and key < keys.dmax:
        return [Cut(key + 1, 0)] * len(pieces)
    counts = None if local_final is None else [int(h[final_bin]) for h in local_final]
    return _split_ties(pieces, scores, elig, keys, key, ties, group, counts)


#: Up to this many pieces, the last histogram pass counts piece by piece (``pieces x 2**RADIX_BITS`` int64 counts);
#: beyond, the tie split counts the threshold key in one more pass.
PER_PIECE_PIECES = 64


def _split_ties(
    pieces: list[Piece],
    scores: list[Tensor],
    elig: list[Tensor | None],
    keys: Keys,
    key: int,
    ties: int,
    group: Any,
    counts: list[int] | None = None,
) -> list[Cut]:
    """Hands out the ``ties`` threshold entries to select in global flat order: each piece's share.

    ``counts``: the eligible entries of each local piece whose key is ``key``, when known (else counted here).
    """
    local = torch.zeros(len(pieces), 2, dtype=torch.int64)
    for i, (p, s, e) in enumerate(zip(pieces, scores, elig, strict=True)):
        local[i, 0] = p.offset
        if counts is not None:
            local[i, 1] = counts[i]
            continue
        count = 0
        for x, ek in chunks([s], [e], chunk_size(s.device)):  # bounded temporaries, never a full key tensor
            equal = keys(x) == key
            if ek is not None:
                equal &= ek
            count += int(equal.sum())
        local[i, 1] = count
    table = _all_gather(local, group)  # (world, pieces, (offset, equal count))
    me = _rank(group)
    left = ties
    cuts = []
    for i, p in enumerate(pieces):
        if p.replicated:
            share = min(left, int(local[i, 1]))
            left -= share
            cuts.append(Cut(key, share))
            continue
        order = sorted(range(table.shape[0]), key=lambda r: int(table[r, i, 0]))
        mine = 0
        for r in order:
            share = min(left, int(table[r, i, 1]))
            left -= share
            if r == me:
                mine = share
        cuts.append(Cut(key, mine))
    return cuts


def _pieces_of(tensors: Sequence[Tensor], group: Any) -> list[Piece]:
    pieces = [local_piece(t, group) for t in tensors]
    return pieces


def _local(tensor: Tensor | None) -> Tensor | None:
    if tensor is None:
        return None
    return tensor.to_local() if is_sharded(tensor) else tensor


def _draw_run(before: int, count: int, total: int, dtype: torch.dtype, chunk: int = 1 << 20) -> Tensor:
    """Entries ``before`` to ``before + count`` of ``torch.rand(total)`` from the global generator, drawn chunk by chunk
    (every rank draws all ``total``, keeping the stream in step)."""
    out = torch.empty(count, dtype=dtype)
    stop, pos = before + count, 0
    while pos < total:
        n = min(chunk, total - pos)
        if pos + n <= before or pos >= stop:
            torch.rand(n, dtype=dtype)  # not ours: draw to keep the stream in step
        else:
            draws = torch.rand(n, dtype=dtype)
            lo, hi = max(pos, before), min(pos + n, stop)
            out[lo - before : hi - before] = draws[lo - pos : hi - pos]
        pos += n
    return out


def _random_draws(pieces: Sequence[Piece], current: Sequence[Tensor | None], group: Any) -> list[Tensor]:
    """Each piece's share of what one process draws for its tensor: ``torch.rand`` over the entries still eligible,
    in the full tensor's flat order (:func:`~lightprune.prune.methods.uniform_draws`); 0 elsewhere.

    The eligible entries before this rank's run are counted with one ``all_gather`` of two integers per tensor.
    """
    eligible = [None if c is None else (c if c.dtype == torch.bool else c == 1) for c in current]
    local = torch.tensor(
        [[p.offset, p.local.numel() if e is None else int(e.sum())] for p, e in zip(pieces, eligible, strict=True)],
        dtype=torch.int64,
    ).reshape(len(pieces), 2)
    table = _all_gather(local, group) if not all(p.replicated for p in pieces) else local.unsqueeze(0)
    draws = []
    for i, (p, e) in enumerate(zip(pieces, eligible, strict=True)):
        count = int(local[i, 1])
        if p.replicated:
            before, total = 0, count
        else:
            before = int(table[table[:, i, 0] < p.offset, i, 1].sum())
            total = int(table[:, i, 1].sum())
        dtype = torch.float64 if p.local.dtype == torch.float64 else torch.float32
        run = _draw_run(before, count, total, dtype)
        if e is None:
            draws.append(run.view(p.local.shape).to(p.local.device))
        else:
            out = torch.zeros(p.local.shape, dtype=dtype, device=p.local.device)
            draws.append(out.masked_scatter_(e.to(p.local.device), run.to(p.local.device)))
    return draws


def sharded_unstructured_masks(
    tensors: Sequence[Tensor],
    amount: int | float,
    *,
    method: str = "l1",
    current: Sequence[Tensor | None] | None = None,
    importance_scores: Sequence[Tensor | None] | None = None,
    dtype: torch.dtype = torch.bool,
    group: Any = None,
    max_layer_sparsity: float = 1.0,
    signed: bool = False,
) -> list[Tensor]:
    """New local masks pruning ``amount`` more entries over all ``tensors`` together (global unstructured pruning).

    Called on every rank with the same tensors (DTensors and plain tensors alike). The result on each rank is the
    local part of the masks :func:`lightprune.prune.global_unstructured` gives in one process on the full tensors
    (``L1Unstructured`` for ``method="l1"``, ``RandomUnstructured`` for ``"random"`` with the same seed), bit for bit.
    One tensor at a time is layerwise pruning (``l1_unstructured``, ``random_unstructured``).

    Args:
        tensors: The tensors to prune, in the same order on every rank.
        amount: As for the pruning methods: a float in [0, 1] (fraction of the entries still unpruned, over all
            tensors) or an int (how many of them).
        method: ``"l1"`` (smallest magnitude) or ``"random"``.
        current: Per tensor, the current local mask (zeros pruned) or ``None`` (nothing pruned yet).
        importance_scores: Per tensor, ``None`` or scores of the tensor's layout ranking it instead of its values.
        dtype: dtype of the new masks.
        group: The process group (``None``: the default one).
        max_layer_sparsity: no tensor ends with more than this share of its entries pruned; the total stays
            ``amount`` (:func:`lightprune.prune.collapse.fill_under_caps`, each round's cut found across ranks).
        signed: with ``method="l1"``, rank the signed values (or scores), the lowest pruned, as
            :class:`~lightprune.prune.signed.SignedUnstructured` does (movement scores), instead of magnitudes.

    Returns:
        Per tensor, the new mask of this rank's part (the local shard's shape; the full shape for a plain tensor).

    Raises:
        ValueError: If ``method`` is unknown, ``amount`` exceeds what is left, or the caps leave less than it.

    Example:
        >>> w = [torch.tensor([[0.5, -0.1], [0.3, 0.1]]), torch.tensor([2.0, 0.2])]
        >>> sharded_unstructured_masks(w, 0.5)  # one process: global_unstructured's masks
        [tensor([[ True, False],
                [ True, False]]), tensor([ True, False])]
    """
    if method not in ("l1", "random"):
        raise ValueError(f"method must be 'l1' or 'random', got {method!r}")
    validate_amount(amount)
    max_layer_sparsity = check_max_layer_sparsity(max_layer_sparsity)
    tensors = list(tensors)
    pieces = _pieces_of(tensors, group)
    current = [None] * len(pieces) if current is None else [_local(c) for c in current]
    if len(current) != len(pieces):
        raise ValueError(f"got {len(current)} current masks for {len(pieces)} tensors")
    with torch.no_grad():
        if method == "random":
            for p, draws in zip(pieces, _random_draws(pieces, current, group), strict=True):
                p.local = draws
        elif importance_scores is not None:
            for p, s in zip(pieces, importance_scores, strict=True):
                if s is not None:
                    p.local = _local(s).detach()
        else:
            for p in pieces:
                p.local = p.local.detach()
        available = _global_count(pieces, current, group)
        k = _compute_nparams_toprune(amount, available)
        _validate_pruning_amount(k, available)
        random = method == "random"
        by_magnitude = not random and not signed
        masks = [torch.empty(p.local.shape, dtype=dtype, device=p.local.device) for p in pieces]
        capped = max_layer_sparsity < 1
        counts = pruned_units(tensors, current, group=group) if capped else []

        def select(indices: list[int], n: int) -> list[int]:
            """Select ``n`` over the tensors ``indices`` across ranks; how many each lost, over all ranks."""
            cuts = find_cuts(
                [pieces[i] for i in indices], n, eligible=[current[i] for i in indices],
                magnitude=by_magnitude, largest=random, group=group,
            )  # fmt: skip
            for i, cut in zip(indices, cuts, strict=True):
                c = current[i]
                apply_cut([pieces[i].local], cut, out=[masks[i]], eligible=[c], base=[c], magnitude=by_magnitude,
                          largest=random)  # fmt: skip
            if not capped:
                return []
            after = pruned_units([tensors[i] for i in indices], [masks[i] for i in indices], group=group)
            return [pruned - counts[i][1] for i, (_, pruned) in zip(indices, after, strict=True)]

        if not capped:
            select(list(range(len(pieces))), k)
            return masks
        caps = [max(0, cap_units(max_layer_sparsity, units) - pruned) for units, pruned in counts]
        if k > sum(caps):
            raise ValueError(
                f"max_layer_sparsity={max_layer_sparsity} leaves {sum(caps)} of the {available} unpruned entries "
                f"prunable, fewer than the {k} asked for (amount={amount!r})"
            )
        fill_under_caps(caps, k, select)
    return masks


def _partial_norm(local: Tensor, n: Any, dim: int, channels: int, group: Any) -> Tensor:
    """Per-channel ``torch.norm`` along every dim but ``dim``, the entries of each channel split across ranks."""
    other = [d for d in range(local.dim()) if d != dim]
    x = local.detach().to(torch.float64).abs()
    if n in ("fro",):
        n = 2
    if not isinstance(n, (int, float)) or isinstance(n, bool):
        raise NotImplementedError(f"sharded structured pruning supports numeric norms (and 'fro'); got n={n!r}")
    if local.numel() == 0:
        x = torch.zeros((channels,) if not other else [channels if d == dim else 1 for d in range(local.dim())])
        x = x.to(torch.float64)
    if n == math.inf:
        part = x.amax(dim=other) if x.numel() else torch.zeros(channels, dtype=torch.float64)
        return _all_reduce(part.reshape(channels), group, dist.ReduceOp.MAX)
    if n == -math.inf:
        part = x.amin(dim=other) if local.numel() else torch.full((channels,), math.inf, dtype=torch.float64)
        return _all_reduce(part.reshape(channels), group, dist.ReduceOp.MIN)
    if n == 0:
        part = (x != 0).sum(dim=other).to(torch.float64)
        return _all_reduce(part.reshape(channels), group)
    part = x.pow(n).sum(dim=other)
    return _all_reduce(part.reshape(channels), group).pow(1.0 / n)


def sharded_structured_mask(
    tensor: Tensor,
    amount: int | float,
    *,
    dim: int,
    n: Any = None,
    current: Tensor | None = None,
    importance_scores: Tensor | None = None,
    dtype: torch.dtype = torch.bool,
    group: Any = None,
) -> Tensor:
    """New local mask pruning ``amount`` more channels of ``tensor`` along ``dim`` (structured pruning).

    ``n`` given: the channels with the smallest Ln norm (``LnStructured``); ``n=None``: channels drawn at random
    (``RandomStructured``, the same draws on every rank: seed every rank the same). Channels already all zero in
    ``current`` are neither counted nor chosen again, as in one process. The channel norms come from a vector of
    per-channel values (``tensor.shape[dim]`` long) completed with one ``all_reduce``.

    Args:
        tensor: A DTensor (``Shard(0)``) or a plain tensor, of two or more dims.
        amount: A float in [0, 1] (fraction of the channels still present) or an int (how many).
        dim: The channel dim.
        n: The norm's order (a number, ``inf``, ``-inf`` or ``'fro'``), or ``None`` for random channels.
        current: The current local mask, or ``None``.
        importance_scores: Scores of ``tensor``'s layout to rank instead of its values.
        dtype: dtype of the new mask.
        group: The process group.

    Returns:
        The new mask of this rank's part.

    Example:
        >>> w = torch.tensor([[1.0, 1.0], [3.0, 0.0], [0.1, 0.2]])
        >>> sharded_structured_mask(w, 1, dim=0, n=2)
        tensor([[ True,  True],
                [ True,  True],
                [False, False]])
    """
    validate_amount(amount)
    piece = local_piece(tensor, group)
    if len(piece.shape) < 2:
        raise ValueError(f"structured pruning needs a tensor of two or more dims, got shape {tuple(piece.shape)}")
    dim = dim % len(piece.shape)
    channels = piece.shape[dim]
    local = piece.local if importance_scores is None else _local(importance_scores)
    cur = _local(current)
    rows = piece.local.shape[0]
    first = piece.offset // max(1, math.prod(piece.shape[1:])) if not piece.replicated else 0
    other = [d for d in range(len(piece.shape)) if d != dim]
    with torch.no_grad():
        # channels still present: a channel counts as active if any rank's part of it is nonzero in the mask
        if cur is None:
            active = None
        else:
            alive = torch.count_nonzero(cur, dim=other).to(torch.int64) if cur.numel() else None
            alive = _channel_vector(alive, dim, first, rows, channels, torch.int64)
            active = (alive if piece.replicated else _all_reduce(alive, group)) > 0
        available = channels if active is None else int(active.sum())
        k = _compute_nparams_toprune(amount, available)
        _validate_pruning_amount(k, available)
        if k == 0:
            return _full_or(cur, piece.local, dtype)
        if n is None:
            draws = torch.rand(available)
            chosen = select_smallest([draws], k)[0]
            pruned = chosen if active is None else torch.zeros(channels, dtype=torch.bool)
            if active is not None:
                pruned[torch.nonzero(active).flatten()[chosen]] = True
        else:
            scores = local if cur is None or importance_scores is not None else local * cur.to(local.dtype)
            if piece.replicated:
                from lightprune.prune.amount import _compute_norm

                norms = _compute_norm(scores, n, dim).cpu()
            elif dim == 0:
                from lightprune.prune.amount import _compute_norm

                part = _compute_norm(scores, n, dim).to(torch.float64).cpu() if rows else None
                norms = _all_reduce(_channel_vector(part, 0, first, rows, channels, torch.float64), group).to(
                    local.dtype
                )
            else:
                norms = _partial_norm(scores, n, dim, channels, group).to(local.dtype).cpu()
            pruned = select_smallest([norms], k, eligible=[active])[0]
        keep = ~pruned
        if dim == 0 and not piece.replicated:
            keep = keep[first : first + rows]
        view = [1] * len(piece.shape)
        view[dim] = keep.numel()
        keep = keep.view(view).to(piece.local.device)
        out = torch.empty(piece.local.shape, dtype=dtype, device=piece.local.device)
        if cur is None:
            out.copy_(keep.expand(piece.local.shape))
        else:
            out.copy_((cur != 0) & keep)
    return out


def _channel_vector(part: Tensor | None, dim: int, first: int, rows: int, channels: int, dtype: torch.dtype) -> Tensor:
    """A full per-channel vector of ``dtype`` holding this rank's values (its rows for ``dim == 0``), zeros
    elsewhere; ``part=None`` (an empty shard) contributes nothing."""
    full = torch.zeros(channels, dtype=dtype)
    if part is None:
        return full
    part = part.cpu().reshape(-1).to(dtype)
    if dim == 0:
        full[first : first + rows] = part
    else:
        full += part
    return full


def _full_or(cur: Tensor | None, like: Tensor, dtype: torch.dtype) -> Tensor:
    if cur is None:
        return torch.ones(like.shape, dtype=dtype, device=like.device)
    return (cur != 0).to(dtype) if dtype == torch.bool else cur.to(dtype)


def local_of(tensor: Tensor) -> Tensor:
    """A DTensor's local shard, or a plain tensor itself.

    Example:
        >>> t = torch.zeros(2)
        >>> local_of(t) is t
        True
    """
    return tensor.to_local() if is_sharded(tensor) else tensor


def group_of(tensors: Sequence[Tensor]) -> Any:
    """The process group of the first DTensor among ``tensors`` (its 1-D mesh's), or ``None`` (the default group).

    Example:
        >>> group_of([torch.zeros(2)]) is None
        True
    """
    for t in tensors:
        if is_sharded(t):
            return t.device_mesh.get_group()
    return None


def pruned_units(
    tensors: Sequence[Tensor], masks: Sequence[Tensor | None], *, dim: int | None = None, group: Any = None
) -> list[tuple[int, int]]:
    """``(units, pruned units)`` of each tensor over all ranks, from the local masks, with one ``all_reduce``.

    Units are entries, or channels along ``dim`` (a channel is pruned when it is zero on every rank).

    Args:
        tensors: DTensors or plain tensors (a plain tensor is the same on every rank and counted once).
        masks: Per tensor, its local mask (zeros pruned) or ``None`` (nothing pruned).
        dim: ``None`` for entries, else the channel dim.
        group: The process group.

    Example:
        >>> pruned_units([torch.zeros(2, 3)], [torch.tensor([[True, False, True], [False, False, False]])])
        [(6, 4)]
        >>> pruned_units([torch.zeros(2, 3)], [torch.tensor([[True, False, True], [False, False, False]])], dim=0)
        [(2, 1)]
    """
    pieces = [local_piece(t, group) for t in tensors]
    parts: list[Tensor] = []
    for p, m in zip(pieces, masks, strict=True):
        counts_here = p.owner or not p.replicated
        if dim is None:
            kept = p.local.numel() if m is None else int(torch.count_nonzero(local_of(m)))
            parts.append(torch.tensor([kept if counts_here else 0], dtype=torch.int64))
        else:
            d = dim % len(p.shape)
            channels = p.shape[d]
            if m is None:
                parts.append(
                    torch.ones(channels, dtype=torch.int64) if counts_here else torch.zeros(channels, dtype=torch.int64)
                )
                continue
            m = local_of(m)
            other = [i for i in range(m.dim()) if i != d]
            alive = torch.count_nonzero(m, dim=other).to(torch.int64) if m.numel() else None
            rows = m.shape[0]
            first = 0 if p.replicated else p.offset // max(1, math.prod(p.shape[1:]))
            parts.append(_channel_vector(alive if counts_here else None, d, first, rows, channels, torch.int64))
    if not parts:
        return []
    total = _all_reduce(torch.cat(parts), group)
    out, pos = [], 0
    for p, part in zip(pieces, parts, strict=True):
        values = total[pos : pos + part.numel()]
        pos += part.numel()
        if dim is None:
            units = math.prod(p.shape)
            out.append((units, units - int(values[0])))
        else:
            out.append((values.numel(), int((values == 0).sum())))
    return out


def as_dtensor(local: Tensor, like: Tensor) -> Tensor:
    """``local`` (this rank's part of a tensor laid out like ``like``) as a DTensor of ``like``'s mesh and placement;
    a plain ``like`` gives ``local`` itself.

    Example:
        >>> m = torch.ones(2, dtype=torch.bool)
        >>> as_dtensor(m, torch.zeros(2)) is m
        True
    """
    if not is_sharded(like):
        return local
    from torch.distributed.tensor import DTensor

    stride = torch.empty(like.shape, device="meta").stride()
    return DTensor.from_local(local, like.device_mesh, like.placements, shape=like.shape, stride=stride)


def local_part(full: Tensor, like: Tensor) -> Tensor:
    """This rank's part of ``full`` (a tensor of ``like``'s full shape) in ``like``'s layout.

    Example:
        >>> full = torch.arange(4)
        >>> local_part(full, torch.zeros(4)) is full
        True
    """
    piece = local_piece(like)
    if piece.replicated:
        return full
    row = max(1, math.prod(piece.shape[1:]))
    first = piece.offset // row
    return full[first : first + piece.local.shape[0]].contiguous()
