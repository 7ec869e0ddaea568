"""Second-order pruning: Optimal Brain Surgeon saliency and the SparseGPT weight update, from a layer's input ``H``.

For a layer computing ``y = W x`` and calibration inputs ``X`` (one row per token or spatial position),
``H = X^T X`` measures how the layer's output error grows when its weights move. Optimal Brain Surgeon removes the
weights of least saliency ``w_ij**2 / d_j**2`` and moves the weights still to come in each row so that the output on
the calibration inputs changes as little as possible. SparseGPT (Frantar & Alistarh 2023) makes it practical: the
columns are taken left to right in blocks of :data:`BLOCKSIZE`, ``d`` is the diagonal of the upper Cholesky factor
``U`` of ``H^-1`` (``d_j**2`` is the inverse Hessian's diagonal once the columns before ``j`` are fixed), each block
chooses its pruned entries from the weights as the earlier blocks left them, and column ``j``'s error
``(w_j - q_j) / d_j`` is spread over the later columns along ``U[j, j:]``.

Conventions of this implementation:

* **Dampening** :data:`DAMPENING` (1%) of ``H``'s mean diagonal is added to its diagonal; inputs that never fired
  (``H_jj == 0``, "dead") get ``H_jj = 1`` first; their weights cannot change the output on the calibration inputs,
  so they receive no update: the pruned ones are zeroed, the kept ones keep their values. A layer whose ``H`` is
  still not positive definite, or holds NaN or inf, is refused with a ``ValueError`` naming it: its weights are never
  turned into NaN.
* **Selection**: unstructured pruning chooses, in every block, the entries of least saliency over the whole block
  (SparseGPT's own); ``per_row=True`` chooses the same count in every row of every block instead, so every row ends
  with the same count. The counts per block follow the running total (``round(k * eligible so far / eligible)``),
  so a layer prunes exactly ``k`` entries (or ``k`` per row). N:M pruning keeps the ``n`` entries of highest
  saliency in every group of ``m`` consecutive input columns, chosen when the group's first column is reached.
  Ties: the lower index (in the block, row-major; in the group) is pruned first.
* **Composition**: entries a mask in force has pruned are zero from the start, stay pruned and are never restored;
  the new count is taken from the entries still unpruned.
* **Layouts**: ``nn.Linear`` ``(out, in)``; transformers' ``Conv1D`` ``(in, out)`` (transposed); ``nn.Conv1d`` /
  ``nn.Conv2d`` with ``groups=1`` and zero padding given as numbers (or ``"valid"``): the weight is seen as
  ``(out, kernel positions x in channels)``, kernel-position-major, and ``H`` is built from the unfolded inputs in
  that order, so N:M groups run over ``m`` input channels at one kernel position, as :class:`SemiStructured` does.
* **Never worse than masking**: a row whose reconstruction changes the output on the calibration inputs more than
  masking alone would (measured with the undampened ``H``; it happens on nearly uncorrelated inputs, where the greedy
  update can move weights that are pruned later) keeps its masked weights instead.
* **Arithmetic** in ``float32`` (the default) or ``float64``; the weight keeps its dtype (``bfloat16`` included).

Example:
    >>> import torch
    >>> from torch import nn
    >>> from lightprune import prune
    >>> torch.manual_seed(0) and None
    >>> layer, x = nn.Linear(8, 4), torch.randn(64, 8)
    >>> h = prune.input_second_moment(layer, x)
    >>> _ = prune.obs_unstructured(layer, "weight", h, amount=0.5)
    >>> int((layer.weight == 0).sum()), sorted(layer.state_dict())
    (16, ['bias', 'weight_mask', 'weight_orig'])
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightprune.layouts import is_transformers_conv1d
from lightprune.prune._reparam import FROM_SETTING, before_write_in_place, original, pruned_names
from lightprune.prune.amount import validate_amount
from lightprune.prune.distributed import local_of
from lightprune.prune.functional import custom_from_mask
from lightprune.prune.ranks import group_ranks
from lightprune.prune.semi_structured import check_n_m

__all__ = [
    "BLOCKSIZE",
    "DAMPENING",
    "LocalRows",
    "Rows",
    "as_matrix",
    "check_hessian",
    "check_obs_layer",
    "from_matrix",
    "input_second_moment",
    "layer_saliency",
    "obs_columns",
    "obs_layer",
    "obs_saliency",
    "obs_semi_structured",
    "obs_unstructured",
    "sparsegpt",
]

DAMPENING = 0.01
"""Added to ``H``'s diagonal, as a fraction of its mean diagonal (SparseGPT's 1%)."""

BLOCKSIZE = 128
"""Columns handled together: each block's pruned entries are chosen from the weights the earlier blocks left."""

_DTYPES = (torch.float32, torch.float64)


# ----------------------------------------------------------------------------------------------------------------
# Layouts: a layer's weight as a matrix (out, columns), and its inputs as rows of those columns
# ----------------------------------------------------------------------------------------------------------------


def check_obs_layer(module: nn.Module, name: str = "weight", layer: str | None = None) -> None:
    """Refuse, naming the layer, a tensor OBS cannot handle (see the module's docstring for what it can).

    Example:
        >>> check_obs_layer(nn.Linear(3, 2))
        >>> check_obs_layer(nn.Conv3d(3, 2, 1), layer="body.conv")
        Traceback (most recent call last):
        ...
        ValueError: OBS pruning cannot handle body.conv (Conv3d): it supports the weights of Linear, \
transformers' Conv1D and Conv1d/Conv2d with groups=1, padding_mode='zeros' and numeric padding
    """
    label = layer or f"{type(module).__name__}.{name}"
    ok = name == "weight" and (isinstance(module, nn.Linear) or is_transformers_conv1d(module))
    if name == "weight" and isinstance(module, (nn.Conv1d, nn.Conv2d)):
        ok = module.groups == 1 and module.padding_mode == "zeros" and module.padding != "same"
    if not ok:
        raise ValueError(
            f"OBS pruning cannot handle {label} ({type(module).__name__}): it supports the weights of Linear, "
            "transformers' Conv1D and Conv1d/Conv2d with groups=1, padding_mode='zeros' and numeric padding"
        )


def obs_columns(module: nn.Module) -> int:
    """The number of columns of ``module``'s weight as OBS sees it: the size of its ``H``.

    Example:
        >>> obs_columns(nn.Linear(5, 2)), obs_columns(nn.Conv2d(3, 4, 2))
        (5, 12)
    """
    weight = original(module, "weight")
    if is_transformers_conv1d(module):
        return weight.shape[0]
    return math.prod(weight.shape[1:])  # (the shape only: a sharded weight is never indexed)


def as_matrix(module: nn.Module, weight: Tensor) -> Tensor:
    """``weight`` (or a mask or scores of its shape) as OBS sees it: ``(out, columns)``.

    Example:
        >>> as_matrix(nn.Conv2d(3, 4, 2), torch.zeros(4, 3, 2, 2)).shape
        torch.Size([4, 12])
    """
    if is_transformers_conv1d(module):
        return weight.t()
    if weight.dim() > 2:  # (out, in, *kernel) -> (out, *kernel, in): kernel-position-major columns
        return weight.movedim(1, -1).reshape(weight.shape[0], -1)
    return weight


def from_matrix(module: nn.Module, matrix: Tensor, shape: torch.Size) -> Tensor:
    """The inverse of :func:`as_matrix`: a ``(out, columns)`` matrix back in the weight's ``shape``.

    Example:
        >>> conv, weight = nn.Conv2d(3, 4, 2), torch.randn(4, 3, 2, 2)
        >>> torch.equal(from_matrix(conv, as_matrix(conv, weight), weight.shape), weight)
        True
    """
    if is_transformers_conv1d(module):
        return matrix.t()
    if len(shape) > 2:
        moved = (shape[0], *shape[2:], shape[1])
        return matrix.reshape(moved).movedim(-1, 1)
    return matrix


def _input_rows(module: nn.Module, x: Tensor) -> Tensor:
    """The inputs ``x`` of ``module`` as rows ``(tokens or positions, columns)`` in :func:`as_matrix`'s order."""
    if isinstance(module, (nn.Conv1d, nn.Conv2d)):
        spatial = 1 if isinstance(module, nn.Conv1d) else 2
        if x.dim() == spatial + 1:  # unbatched
            x = x.unsqueeze(0)
        if spatial == 1:
            x = x.unsqueeze(2)
            kernel, dilation = (1, *module.kernel_size), (1, *module.dilation)
            padding = (0, 0) if module.padding == "valid" else (0, *module.padding)
            stride = (1, *module.stride)
        else:
            kernel, dilation, stride = module.kernel_size, module.dilation, module.stride
            padding = (0, 0) if module.padding == "valid" else module.padding
        cols = F.unfold(x, kernel, dilation=dilation, padding=padding, stride=stride)  # (N, C * K, L)
        channels = x.shape[1]
        cols = cols.view(x.shape[0], channels, -1, cols.shape[-1])  # (N, C, K, L)
        return cols.permute(0, 3, 2, 1).reshape(-1, cols.shape[2] * channels)
    return x.reshape(-1, x.shape[-1]) if x.numel() else x.reshape(0, x.shape[-1])  # (-1 is ambiguous with no entries)


def input_second_moment(module: nn.Module, x: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """``X^T X`` of the inputs ``x`` of ``module`` (one row of ``X`` per token, or per position of a convolution's
    unfolded input), ``(columns, columns)`` in ``dtype``: the ``H`` the OBS functions take. Sums over batches add.

    Computed in ``dtype`` under autocast too (a forward hook of a mixed-precision fit runs inside it, where a float32
    matmul would be done in bfloat16 or float16).

    Example:
        >>> input_second_moment(nn.Linear(2, 1), torch.tensor([[1.0, 2.0], [0.0, 1.0]]))
        tensor([[1., 2.],
                [2., 5.]])
    """
    rows = _input_rows(module, x.detach()).to(dtype)
    with torch.autocast(rows.device.type, enabled=False):
        return rows.t() @ rows


# ----------------------------------------------------------------------------------------------------------------
# The algorithm, on a matrix
# ----------------------------------------------------------------------------------------------------------------


def _inverse_factor(hessian: Tensor, weight: Tensor, dampening: float, layer: str) -> Tensor:
    """The upper Cholesky factor of the dampened ``H^-1``; zeroes ``weight``'s dead columns in place."""
    if not bool(torch.isfinite(hessian).all()):
        raise ValueError(f"OBS pruning of {layer}: its input second moment H holds NaN or inf; it cannot be pruned")
    h = hessian.clone()
    diagonal = h.diagonal()
    dead = diagonal == 0
    diagonal.masked_fill_(dead, 1.0)
    weight[:, dead] = 0
    diagonal.add_(dampening * diagonal.mean())
    lower, info = torch.linalg.cholesky_ex(h)
    if int(info) == 0:
        upper, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(lower), upper=True)
    if int(info) != 0 or not bool(torch.isfinite(upper).all()):
        raise ValueError(
            f"OBS pruning of {layer}: its input second moment H is not positive definite even after dampening "
            f"({dampening:g} of its mean diagonal); the weights cannot be reconstructed (collect more calibration "
            "inputs, or exclude the layer)"
        )
    return upper


def _block_counts(counts: Tensor, eligible: Tensor) -> Tensor:
    """Spread ``counts`` (per row, ``(R,)``) over the blocks of ``eligible`` (``(R, B)`` eligible entries per row and
    block) in proportion to the running total, so the blocks of a row add up to its count exactly."""
    running = eligible.cumsum(dim=1).to(torch.float64)
    total = running[:, -1:].clamp(min=1)
    target = torch.round(counts.to(torch.float64).unsqueeze(1) * running / total).to(torch.int64)
    spread = torch.diff(target, dim=1, prepend=torch.zeros_like(target[:, :1]))
    return torch.minimum(spread, eligible)


class Rows(Protocol):
    """Where the rows of :func:`sparsegpt`'s matrix are: what its unstructured selection (``per_row=False``), which
    ranks a block of columns across every row, needs when they are split across processes (the rest of the
    algorithm is row by row, from ``H`` alone). :class:`LocalRows` is the one-process default;
    :class:`lightprune.prune.distributed_obs.ShardedRows` the rows of a ``Shard(0)`` weight."""

    def total(self, counts: Tensor) -> Tensor:
        """``counts`` (an ``int64`` vector summed over this part's rows) summed over every part's rows."""
        ...

    def prune_smallest(self, saliency: Tensor, keep: Tensor, k: int) -> Tensor:
        """``keep`` (bool, ``saliency``'s shape) with the ``k`` smallest kept entries over every part set to
        ``False``; ties: the lower row-major index first, rows in global order."""
        ...


class LocalRows:
    """Every row here: :class:`Rows` in one process.

    Example:
        >>> LocalRows().prune_smallest(torch.tensor([[3.0, 1.0], [1.0, 0.5]]), torch.ones(2, 2, dtype=torch.bool), 2)
        tensor([[ True, False],
                [ True, False]])
    """

    def total(self, counts: Tensor) -> Tensor:
        """``counts`` as they are."""
        return counts

    def prune_smallest(self, saliency: Tensor, keep: Tensor, k: int) -> Tensor:
        """``keep`` less its ``k`` smallest kept entries (:class:`Rows`)."""
        ranks = group_ranks(saliency.reshape(1, -1), keep.reshape(1, -1), magnitude=False, ineligible_first=False)
        return keep & (ranks >= k).view(keep.shape)


def obs_saliency(
    weight: Tensor, hessian: Tensor, *, dampening: float = DAMPENING, dtype: torch.dtype = torch.float32
) -> Tensor:
    """The OBS saliency ``w_ij**2 / d_j**2`` of a ``(out, columns)`` weight matrix before any update (``d``: the
    diagonal of the upper Cholesky factor of the dampened ``H^-1``), in ``dtype``; dead columns score 0.

    Example:
        >>> obs_saliency(torch.tensor([[1.0, 1.0]]), torch.tensor([[4.0, 0.0], [0.0, 1.0]]), dampening=0.0)
        tensor([[4., 1.]])
    """
    w = weight.detach().to(dtype).clone()
    d = _inverse_factor(hessian.to(w.device, dtype), w, dampening, "a weight").diagonal()
    return w * w / (d * d)


def check_hessian(
    hessian: Tensor, layer: str, *, dampening: float = DAMPENING, dtype: torch.dtype = torch.float32
) -> None:
    """Refuse, naming ``layer``, an ``H`` :func:`sparsegpt` could not use (NaN or inf, not positive definite after
    dampening): a check before an event changes any weight, so the event is applied whole or not at all.

    Example:
        >>> check_hessian(-torch.eye(2), "enc.q")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: OBS pruning of enc.q: its input second moment H is not positive definite even after dampening ...
    """
    _inverse_factor(hessian.to(dtype), torch.zeros(0, hessian.shape[0], dtype=dtype, device=hessian.device), dampening,
                    layer)  # fmt: skip


def layer_saliency(module: nn.Module, name: str, hessian: Tensor, *, dampening: float = DAMPENING) -> Tensor:
    """:func:`obs_saliency` of ``module.<name>`` (its original values), in the weight's shape, float32: scores to
    rank by without reconstruction. A weight sharded by rows (a DTensor placed ``Shard(0)``) gives its local rows'
    saliencies: each row's depends on that row and ``H`` alone.

    Example:
        >>> layer = nn.Linear(2, 1)
        >>> layer_saliency(layer, "weight", torch.eye(2)).shape
        torch.Size([1, 2])
    """
    weight = original(module, name).detach()
    weight = local_of(weight)  # a DTensor: its local rows
    scores = obs_saliency(as_matrix(module, weight), hessian, dampening=dampening)
    return from_matrix(module, scores, weight.shape)


def sparsegpt(
    weight: Tensor,
    hessian: Tensor,
    *,
    keep: Tensor | None = None,
    counts: int | Tensor | None = None,
    per_row: bool = False,
    n: int | None = None,
    m: int | None = None,
    reconstruct: bool = True,
    blocksize: int = BLOCKSIZE,
    dampening: float = DAMPENING,
    dtype: torch.dtype = torch.float32,
    layer: str = "the weight",
    across: Rows | None = None,
) -> tuple[Tensor, Tensor]:
    """Prune a ``(out, columns)`` weight matrix by OBS saliency with the SparseGPT update, given ``H``.

    Args:
        weight: the weights, ``(out, columns)``; not modified.
        hessian: ``H = X^T X`` of the layer's inputs, ``(columns, columns)``.
        keep: the mask in force (``True`` / 1 where kept); ``None``: nothing pruned yet.
        counts: how many more entries to prune: an int over the matrix, or (``per_row``) an int or an ``int64``
            tensor with one count per row. Not with ``n`` and ``m``.
        per_row: choose the same count in every row of every block instead of over the whole block.
        n, m: N:M pruning instead: keep ``n`` of every ``m`` consecutive columns of every row.
        reconstruct: apply the OBS update to the weights still to come (``False``: choose by saliency only and
            leave the kept weights as they are).
        blocksize: columns per block (a multiple of ``m`` for N:M).
        dampening: fraction of ``H``'s mean diagonal added to its diagonal.
        dtype: ``torch.float32`` or ``torch.float64``, the arithmetic's.
        layer: the layer's name, for messages.
        across: where the matrix's rows are (:class:`Rows`; default :class:`LocalRows`): ``weight``, ``keep`` and
            ``counts`` are then this part's rows, ``counts`` (an int, without ``per_row``) over all parts.

    Returns:
        ``(new weight, new keep mask)``: the weight in ``weight``'s dtype with zeros where pruned, and a bool mask.
        A row whose update would change the layer's output more than masking alone, or leave the weight dtype's
        range (float16), is masked without the update.

    Raises:
        ValueError: a bad argument, a count larger than what is left, or an ``H`` that cannot be used (named).

    Example:
        >>> w, h = torch.tensor([[1.0, 0.5], [0.2, 2.0]]), torch.tensor([[2.0, 1.0], [1.0, 2.0]])
        >>> new, kept = sparsegpt(w, h, counts=1, per_row=True, dampening=0.0, dtype=torch.float64)
        >>> kept
        tensor([[ True, False],
                [False,  True]])
        >>> new  # row 1's kept weight takes over part of its pruned left neighbour's work (updates run rightwards)
        tensor([[1.0000, 0.0000],
                [0.0000, 2.1000]])
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype} is not supported: OBS arithmetic runs in torch.float32 or torch.float64")
    if weight.dim() != 2:
        raise ValueError(f"OBS pruning of {layer} needs a (out, columns) matrix, got shape {tuple(weight.shape)}")
    rows, columns = weight.shape
    if tuple(hessian.shape) != (columns, columns):
        raise ValueError(
            f"OBS pruning of {layer}: H has shape {tuple(hessian.shape)}, the weight has {columns} columns "
            f"(expected ({columns}, {columns}))"
        )
    if not (isinstance(blocksize, numbers.Integral) and blocksize >= 1):
        raise ValueError(f"blocksize={blocksize!r} must be an int >= 1")
    if not (isinstance(dampening, numbers.Real) and dampening >= 0):
        raise ValueError(f"dampening={dampening!r} must be a number >= 0")
    nm = n is not None or m is not None
    if nm:
        if counts is not None:
            raise ValueError("give either counts (unstructured) or n and m (N:M), not both")
        check_n_m(n, m)  # type: ignore[arg-type]
        if columns % m or blocksize % m:  # type: ignore[operator]
            raise ValueError(
                f"N:M pruning of {layer} with m={m} needs its columns ({columns}) and blocksize ({blocksize}) to be "
                "multiples of m"
            )
    elif counts is None:
        raise ValueError("give counts (how many entries to prune) or n and m")
    w = weight.detach().to(dtype).clone()
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"OBS pruning of {layer}: the weight holds NaN or inf; it cannot be reconstructed")
    kept = torch.ones_like(w, dtype=torch.bool) if keep is None else (keep.to(w.device) != 0).reshape(w.shape).clone()
    w[~kept] = 0
    before = w.clone() if reconstruct else None
    upper = _inverse_factor(hessian.to(w.device, dtype), w, dampening, layer)
    starts = list(range(0, columns, blocksize))
    if not nm:
        eligible = torch.stack([kept[:, s : s + blocksize].sum(dim=1) for s in starts], dim=1)  # (rows, blocks)
        if not per_row:
            eligible = (LocalRows() if across is None else across).total(eligible.sum(dim=0, keepdim=True))
        wanted = torch.as_tensor(counts, dtype=torch.int64, device=w.device).reshape(-1)
        if wanted.numel() not in (1, eligible.shape[0]):
            raise ValueError(f"counts for {layer} must be one int or one per row ({rows}), got {wanted.numel()}")
        wanted = wanted.expand(eligible.shape[0])
        short = torch.nonzero((wanted > eligible.sum(dim=1)) | (wanted < 0)).flatten()
        if short.numel():
            where = f" in row {int(short[0])}" if per_row else ""
            raise ValueError(
                f"OBS pruning of {layer}: cannot prune {int(wanted[short[0]])} more entries{where}, "
                f"{int(eligible.sum(dim=1)[short[0]])} are left"
            )
        per_block = _block_counts(wanted, eligible)
    for b, i1 in enumerate(starts):
        i2 = min(i1 + blocksize, columns)
        block, factor = w[:, i1:i2].clone(), upper[i1:i2, i1:i2]
        d = factor.diagonal()
        block_keep = kept[:, i1:i2]
        if not nm:
            saliency = block * block / (d * d)
            if per_row:
                ranks = group_ranks(saliency, block_keep, magnitude=False, ineligible_first=False)
                block_keep &= ranks >= per_block[:, b : b + 1]
            elif int(per_block[0, b]):  # (the same on every part: all of them select, or none)
                block_keep &= (LocalRows() if across is None else across).prune_smallest(
                    saliency, block_keep, int(per_block[0, b])
                )
        quantized = torch.zeros_like(block)
        errors = torch.zeros_like(block)
        for i in range(i2 - i1):
            if nm and i % m == 0:  # type: ignore[operator]
                group = block[:, i : i + m]
                saliency = group * group / (d[i : i + m] * d[i : i + m])
                ranks = group_ranks(saliency, block_keep[:, i : i + m], magnitude=False, ineligible_first=True)
                block_keep[:, i : i + m] &= ranks >= m - n  # type: ignore[operator]
            column = block[:, i]
            q = torch.where(block_keep[:, i], column, torch.zeros_like(column))
            quantized[:, i] = q
            if reconstruct:
                error = (column - q) / d[i]
                block[:, i:] -= error.unsqueeze(1) * factor[i, i:].unsqueeze(0)
                errors[:, i] = error
        w[:, i1:i2] = quantized
        if reconstruct and i2 < columns:
            w[:, i2:] -= errors @ upper[i1:i2, i2:]
    if before is None:  # the kept weights as they were (the dead columns were zeroed for the ranking only)
        original = weight.detach()
        return torch.where(kept.to(original.device), original, torch.zeros((), dtype=original.dtype)), kept
    # inputs that were always zero on the calibration data (H's diagonal 0) were zeroed for the ranking, as
    # SparseGPT does; their kept weights go back: no update reaches them (H couples them to nothing), they change
    # nothing on those inputs, and zeroing them would prune weights the mask keeps (and the counts report)
    dead = hessian.diagonal().to(w.device) == 0
    if bool(dead.any()):
        w[:, dead] = torch.where(kept[:, dead], before[:, dead], torch.zeros((), dtype=w.dtype, device=w.device))
    _keep_better_rows(w, before, kept, hessian.to(w.device, dtype))
    result = w.to(weight.dtype)
    overflow = ~torch.isfinite(result).all(dim=1)  # updated values past the weight dtype's range (float16's 65504)
    if bool(overflow.any()):  # those rows are masked without the update, as rows it makes worse are
        result[overflow] = (before[overflow] * kept[overflow]).to(weight.dtype)
    return result, kept


def _keep_better_rows(weight: Tensor, before: Tensor, kept: Tensor, hessian: Tensor) -> None:
    """Where a reconstructed row changes the layer's output on the calibration inputs more than masking alone would
    (``d H d^T`` with the undampened ``H``, ``d`` the change from ``before``), put the masked row back, in place.

    The sequential update is greedy: a weight it moves may be pruned later, and on nearly uncorrelated inputs the
    moves can cost more than they save (by a few percent). This check makes the reconstruction never worse than
    masking on the inputs ``H`` was collected from.
    """
    masked = before * kept
    moved, plain = weight - before, masked - before
    worse = ((moved @ hessian) * moved).sum(dim=1) > ((plain @ hessian) * plain).sum(dim=1)
    weight[worse] = masked[worse]


# ----------------------------------------------------------------------------------------------------------------
# On a module: the engine's reparametrization
# ----------------------------------------------------------------------------------------------------------------


def obs_layer(
    module: nn.Module,
    name: str,
    hessian: Tensor,
    *,
    counts: int | Tensor | None = None,
    per_row: bool = False,
    n: int | None = None,
    m: int | None = None,
    reconstruct: bool = True,
    blocksize: int = BLOCKSIZE,
    dampening: float = DAMPENING,
    dtype: torch.dtype = torch.float32,
    layer: str | None = None,
    mask_dtype: Any = FROM_SETTING,
) -> nn.Module:
    """:func:`sparsegpt` on ``module.<name>`` in its layout: the updated weights are written into the tensor (its
    ``name_orig`` when pruned) and the new mask composed onto the mask in force (the engine's reparametrization,
    new masks in ``mask_dtype``, by default :func:`~lightprune.prune.mask_dtype`'s setting).

    Example:
        >>> layer = nn.Linear(4, 2)
        >>> _ = obs_layer(layer, "weight", torch.eye(4), counts=torch.tensor([1, 3]), per_row=True)
        >>> (layer.weight_mask == 0).sum(dim=1).tolist()
        [1, 3]
    """
    label = layer or f"{type(module).__name__}.{name}"
    check_obs_layer(module, name, layer)
    if n is not None and isinstance(module, (nn.Conv1d, nn.Conv2d)) and isinstance(m, int) and module.in_channels % m:
        raise ValueError(
            f"N:M pruning of {label} with m={m} needs its input channels ({module.in_channels}) to be a multiple of m"
        )
    param = original(module, name)
    mask = module._buffers.get(name + "_mask") if name in pruned_names(module) else None
    matrix = as_matrix(module, param.detach())
    keep = None if mask is None else as_matrix(module, mask)
    new, kept = sparsegpt(
        matrix, hessian, keep=keep, counts=counts, per_row=per_row, n=n, m=m, reconstruct=reconstruct,
        blocksize=blocksize, dampening=dampening, dtype=dtype, layer=label,
    )  # fmt: skip
    new_weight = from_matrix(module, new, param.shape)
    new_keep = from_matrix(module, kept, param.shape)
    before_write_in_place(param)  # a running transaction puts the weights back if it is undone
    with torch.no_grad():
        param.copy_(torch.where(new_keep, new_weight, param))
    return custom_from_mask(module, name, mask=new_keep, mask_dtype=mask_dtype)


def obs_unstructured(
    module: nn.Module,
    name: str,
    hessian: Tensor,
    amount: int | float,
    *,
    per_row: bool = False,
    reconstruct: bool = True,
    blocksize: int = BLOCKSIZE,
    dampening: float = DAMPENING,
    dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """Prune ``amount`` of the unpruned entries of ``module.<name>`` by OBS saliency, with the SparseGPT update.

    Args:
        module: a Linear, transformers' Conv1D, or Conv1d/Conv2d (see :func:`check_obs_layer`).
        name: ``"weight"``.
        hessian: ``H`` of the layer's inputs (:func:`input_second_moment`), ``(columns, columns)``.
        amount: as torch's ``amount``: a float in [0, 1] (the fraction of the entries still unpruned, per row with
            ``per_row``) or an int (how many; per row with ``per_row``).
        per_row: every row (output neuron or filter) loses the same count.
        reconstruct: update the kept weights (``False``: choose by saliency only).
        blocksize, dampening, dtype: see :func:`sparsegpt`.

    Returns:
        ``module``, pruned through the engine's reparametrization (an earlier mask is kept: its entries stay pruned).

    Example:
        >>> layer = nn.Linear(4, 3)
        >>> _ = obs_unstructured(layer, "weight", torch.eye(4), amount=2, per_row=True)
        >>> (layer.weight != 0).sum(dim=1).tolist()
        [2, 2, 2]
    """
    validate_amount(amount)
    check_obs_layer(module, name)
    mask = module._buffers.get(name + "_mask") if name in pruned_names(module) else None
    matrix = as_matrix(module, original(module, name))
    remaining = (
        torch.full((matrix.shape[0],), matrix.shape[1], device=matrix.device) if mask is None
        else (as_matrix(module, mask) != 0).sum(dim=1)
    )  # fmt: skip
    if not per_row:
        remaining = remaining.sum().reshape(1)
    if isinstance(amount, numbers.Integral):
        counts = torch.full_like(remaining, int(amount))
    else:
        counts = torch.round(remaining.to(torch.float64) * float(amount)).to(torch.int64)
    return obs_layer(
        module, name, hessian, counts=counts if per_row else int(counts[0]), per_row=per_row,
        reconstruct=reconstruct, blocksize=blocksize, dampening=dampening, dtype=dtype,
    )  # fmt: skip


def obs_semi_structured(
    module: nn.Module,
    name: str,
    hessian: Tensor,
    n: int = 2,
    m: int = 4,
    *,
    reconstruct: bool = True,
    blocksize: int = BLOCKSIZE,
    dampening: float = DAMPENING,
    dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """Give ``module.<name>`` the N:M pattern (``n`` kept of every ``m`` input entries) by OBS saliency, with the
    SparseGPT update; groups as :class:`~lightprune.prune.SemiStructured` forms them (input channels of a
    convolution at one kernel position). Entries already pruned count among their group's pruned.

    Example:
        >>> layer = nn.Linear(8, 2)
        >>> _ = obs_semi_structured(layer, "weight", torch.eye(8))
        >>> (layer.weight.view(2, 2, 4) != 0).sum(dim=-1).tolist()
        [[2, 2], [2, 2]]
    """
    return obs_layer(
        module, name, hessian, n=n, m=m, reconstruct=reconstruct, blocksize=blocksize, dampening=dampening,
        dtype=dtype,
    )  # fmt: skip
