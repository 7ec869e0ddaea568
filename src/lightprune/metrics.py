"""Sparsity as torchmetrics metrics: the fraction of entries of a tensor that are exactly zero.

Following torchmetrics, there are functionals (:func:`count_zeros`, :func:`sparsity`) and :class:`~torchmetrics.Metric`
classes that accumulate exact ``int64`` counts and reduce them with a sum across processes: :class:`Sparsity` for one
stream of tensors and :class:`SparsityCollection` for several named tensors at once (e.g. one per pruned parameter,
plus their total).

An entry counts as zero when it compares equal to zero: ``0.0`` and ``-0.0`` are zeros, ``NaN`` is not, and for
``bool`` tensors ``False`` is a zero. Counting is chunked so that no temporary larger than
``2**24`` elements is allocated, whatever the tensor's size, layout or device. To measure how much of a parameter was
*pruned*, pass its mask; to measure how sparse it *is* (pruned entries plus weights that happen to be zero), pass the
effective (masked) tensor.

Example:
    >>> import torch
    >>> sparsity(torch.tensor([[0.0, 1.0], [-0.0, 2.0]]))
    tensor(0.5000)

"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric

__all__ = ["TOTAL_KEY", "Sparsity", "SparsityCollection", "count_zeros", "sparsity"]

TOTAL_KEY = "total"
"""The key of the total sparsity among :class:`SparsityCollection`'s outputs (after its ``prefix``), unless its
``total_key`` says otherwise; the pruning callback logs the total under it and refuses a tensor of that name."""

_CHUNK_NUMEL = 2**24
"""Largest number of elements counted by a single ``torch.count_nonzero`` call (bounds its temporaries)."""


_SAME_SIZE_SIGNED = {torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}
"""Unsigned dtypes ``torch.count_nonzero`` lacks, viewed as signed integers of their size (zero iff all bits are)."""


def _count_nonzero_piece(tensor: Tensor) -> Tensor:
    """``torch.count_nonzero`` for every dtype: unsigned integers viewed as signed ones, 1-byte floats widened."""
    if tensor.dtype in _SAME_SIZE_SIGNED:
        tensor = tensor.view(_SAME_SIZE_SIGNED[tensor.dtype])
    elif tensor.is_floating_point() and tensor.element_size() == 1:  # float8: float32 holds every value exactly
        tensor = tensor.to(torch.float32)
    return torch.count_nonzero(tensor)


def _count_nonzero(tensor: Tensor) -> Tensor:
    """Count non-zero entries exactly (``int64``), in pieces of at most ``_CHUNK_NUMEL`` elements, without copies.

    A sparse tensor's unstored entries are zeros: only its stored values (duplicates of a COO tensor summed) count.
    """
    if tensor.layout != torch.strided:
        coo = tensor.coalesce() if tensor.layout == torch.sparse_coo else tensor.to_sparse_coo().coalesce()
        return _count_nonzero(coo.values())
    if tensor.numel() <= _CHUNK_NUMEL:
        return _count_nonzero_piece(tensor)
    if tensor.is_contiguous():
        pieces = tensor.view(-1).split(_CHUNK_NUMEL)
    elif tensor.size(0) == 1:
        return _count_nonzero(tensor[0])
    else:
        # Slicing the first dimension gives views whatever the strides; each slice is counted recursively.
        rows = max(1, _CHUNK_NUMEL // (tensor.numel() // tensor.size(0)))
        pieces = tensor.split(rows, dim=0)
    count = torch.zeros((), dtype=torch.int64, device=tensor.device)
    for piece in pieces:
        count += _count_nonzero(piece)
    return count


def count_zeros(tensor: Tensor) -> Tensor:
    """Count the entries of ``tensor`` that are exactly zero.

    Args:
        tensor: a tensor of any shape, dtype (float8 and unsigned integers included), device and layout (sparse
            tensors count their unstored entries as zeros).

    Returns:
        A 0-dim ``int64`` tensor on ``tensor``'s device; exact for any size.

    Example:
        >>> import torch
        >>> count_zeros(torch.tensor([0.0, 1.0, -0.0, float("nan")]))
        tensor(2)
        >>> count_zeros(torch.tensor([[0.0, 1.0], [2.0, 0.0]]).to_sparse_csr())
        tensor(2)

    """
    return _numel(tensor) - _count_nonzero(tensor)


def _numel(tensor: Tensor) -> int:
    """The number of entries, stored or not (a sparse tensor's ``numel`` is not defined for every layout)."""
    return math.prod(tensor.shape)


def _sparsity_compute(zeros: Tensor, total: Tensor) -> Tensor:
    """Divide integer counts in double precision (single on MPS, which has no float64) and return ``float32``.

    ``0 / 0`` gives ``nan``: the sparsity of no entries is undefined.
    """
    dtype = torch.float32 if zeros.device.type == "mps" else torch.float64
    return (zeros.to(dtype) / total.to(dtype)).to(torch.float32)


def sparsity(tensor: Tensor) -> Tensor:
    """Compute the fraction of entries of ``tensor`` that are exactly zero.

    Args:
        tensor: a tensor of any shape, dtype, device and layout, as for :func:`count_zeros`.

    Returns:
        A 0-dim ``float32`` tensor on ``tensor``'s device, in ``[0, 1]``; ``nan`` for an empty tensor.

    Example:
        >>> import torch
        >>> sparsity(torch.tensor([[0, 3, 0, 0], [1, 0, 0, 5]]))
        tensor(0.6250)

    """
    zeros = count_zeros(tensor)
    return _sparsity_compute(zeros, torch.tensor(_numel(tensor), dtype=torch.int64, device=zeros.device))


class Sparsity(Metric):
    r"""Accumulate the fraction of exactly-zero entries over every tensor passed to :meth:`update`.

    .. math:: \text{Sparsity} = \frac{\sum_k \#\{i : x^{(k)}_i = 0\}}{\sum_k \text{numel}(x^{(k)})}

    As input to ``forward`` and ``update`` the metric accepts:

    - ``tensor`` (:class:`~torch.Tensor`): a tensor of any shape, dtype and layout, as for :func:`count_zeros`

    As output of ``forward`` and ``compute`` the metric returns:

    - ``sparsity`` (:class:`~torch.Tensor`): a 0-dim ``float32`` tensor, ``nan`` if no entry was seen

    The states ``zeros`` and ``total`` are exact ``int64`` counts reduced with a sum across processes, so the
    distributed result is the sparsity of the union of all tensors seen by all processes.

    Args:
        kwargs: Additional keyword arguments, see :ref:`Metric kwargs` for more info.

    Example:
        >>> import torch
        >>> metric = Sparsity()
        >>> metric.update(torch.tensor([0.0, 1.0, 0.0, 2.0]))
        >>> metric.update(torch.zeros(2, 2))
        >>> metric.compute()
        tensor(0.7500)
        >>> metric.zeros, metric.total
        (tensor(6), tensor(8))

    """

    is_differentiable = False
    higher_is_better = None
    full_state_update = False

    zeros: Tensor
    total: Tensor

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("zeros", default=torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")
        self.add_state("total", default=torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")

    def update(self, tensor: Tensor) -> None:
        """Add the zeros and entries of ``tensor`` to the counts.

        Example:
            >>> import torch
            >>> metric = Sparsity()
            >>> metric.update(torch.tensor([0, 1]))
            >>> metric.zeros, metric.total
            (tensor(1), tensor(2))

        """
        self.zeros += count_zeros(tensor).to(self.zeros.device)
        self.total += _numel(tensor)

    def compute(self) -> Tensor:
        """Return ``zeros / total`` as a 0-dim ``float32`` tensor.

        Example:
            >>> import torch
            >>> metric = Sparsity()
            >>> metric.update(torch.tensor([0, 1, 1, 1]))
            >>> metric.compute()
            tensor(0.2500)

        """
        return _sparsity_compute(self.zeros, self.total)


class SparsityCollection(Metric):
    r"""Per-tensor sparsities of several named tensors (e.g. the pruned parameters of a model) and their total.

    One metric holds the counts of all tensors in two ``int64`` vector states (``zeros`` and ``total``, one entry per
    name, reduced with a sum across processes), so synchronizing costs one reduction per state whatever the number of
    tensors. This replaces a :class:`~torchmetrics.MetricCollection` of :class:`Sparsity` metrics, which cannot be
    keyed by qualified parameter names: its keys are ``nn.ModuleDict`` keys, and those may not contain ``"."``.
    Here names are kept verbatim in a plain list and only appear as keys of the dict returned by :meth:`compute`.

    As input to ``forward`` and ``update`` the metric accepts:

    - ``tensors`` (``Mapping[str, Tensor]``): one tensor per name (any dtype and layout, as for :func:`count_zeros`),
      exactly the names given at construction

    As output of ``forward`` and ``compute`` the metric returns:

    - ``dict[str, Tensor]``: ``prefix + name`` to the sparsity of that name's tensors, plus ``prefix + total_key`` to
      the sparsity of all of them together (weighted by size, i.e. total zeros over total entries). Values are 0-dim
      ``float32`` tensors, ``nan`` where no entry was seen.

    Args:
        names: distinct names of the tensors, e.g. qualified parameter names from
            :func:`lightprune.selection.select_parameters`.
        prefix: prepended to every output key, e.g. ``"sparsity/"`` for logging.
        total_key: output key (before ``prefix``) of the overall sparsity; ``None`` to leave it out. It must differ
            from every name.
        kwargs: Additional keyword arguments, see :ref:`Metric kwargs` for more info.

    Raises:
        TypeError: if ``names`` is a single ``str`` (a sequence of its characters) or holds a name that is not a
            ``str``, if ``prefix`` is not a ``str``, or if ``total_key`` is neither a ``str`` nor ``None``.
        ValueError: if ``names`` is empty or has duplicates, or ``total_key`` is one of the names.

    Example:
        >>> import torch
        >>> metric = SparsityCollection(["encoder.weight", "head.weight"], prefix="sparsity/")
        >>> metric.update({"encoder.weight": torch.tensor([[0.0, 1.0], [0.0, 0.0]]), "head.weight": torch.ones(4)})
        >>> metric.compute()
        {'sparsity/encoder.weight': tensor(0.7500), 'sparsity/head.weight': tensor(0.),
         'sparsity/total': tensor(0.3750)}

    """

    is_differentiable = False
    higher_is_better = None
    full_state_update = False

    zeros: Tensor
    total: Tensor

    def __init__(
        self, names: Sequence[str], *, prefix: str = "", total_key: str | None = TOTAL_KEY, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        if isinstance(names, str):
            raise TypeError(f"names must be a sequence of names, not a str: for one tensor pass [{names!r}]")
        names = list(names)
        if not names:
            raise ValueError("names is empty: give the name of at least one tensor")
        for index, name in enumerate(names):  # 1 and "1" would both become the output key "1", one value lost
            if not isinstance(name, str):
                raise TypeError(f"names[{index}]={name!r} is not a str ({type(name).__name__}); names must be str")
        if not isinstance(prefix, str):
            raise TypeError(f"prefix={prefix!r} must be a str (use '' for no prefix)")
        if total_key is not None and not isinstance(total_key, str):
            raise TypeError(f"total_key={total_key!r} must be a str, or None to leave the total out")
        seen: set[str] = set()
        repeated: set[str] = set()
        for name in names:  # one pass: list.count per name is quadratic in thousands of tensors
            (repeated if name in seen else seen).add(name)
        duplicates = sorted(repeated)
        if duplicates:
            raise ValueError(f"names must be distinct, got duplicates {duplicates!r}")
        if total_key is not None and total_key in names:
            raise ValueError(f"total_key={total_key!r} is also a tensor name; choose another total_key")
        self.names = names
        self._name_set = frozenset(names)  # membership checks in update(): thousands of tensors, not a list scan
        self.prefix = prefix
        self.total_key = total_key
        self.add_state("zeros", default=torch.zeros(len(names), dtype=torch.int64), dist_reduce_fx="sum")
        self.add_state("total", default=torch.zeros(len(names), dtype=torch.int64), dist_reduce_fx="sum")

    def update(self, tensors: Mapping[str, Tensor]) -> None:
        """Add the zeros and entries of each named tensor to that name's counts.

        Args:
            tensors: one tensor for each name given at construction, no more, no less.

        Raises:
            ValueError: if names are missing or unexpected.

        Example:
            >>> import torch
            >>> metric = SparsityCollection(["a", "b"])
            >>> metric.update({"a": torch.tensor([0, 1]), "b": torch.tensor([0, 0, 0])})
            >>> metric.zeros, metric.total
            (tensor([1, 3]), tensor([2, 3]))

        """
        missing = [name for name in self.names if name not in tensors]
        unexpected = [name for name in tensors if name not in self._name_set]
        if missing or unexpected:
            raise ValueError(
                f"update() needs exactly one tensor per name; missing {missing!r}, unexpected {unexpected!r}"
            )
        device = self.zeros.device
        zeros = torch.stack([count_zeros(tensors[name]).to(device) for name in self.names])
        numels = torch.tensor([_numel(tensors[name]) for name in self.names], dtype=torch.int64, device=device)
        self.zeros += zeros
        self.total += numels

    def compute(self) -> dict[str, Tensor]:
        """Return the sparsity of each name, and the total, keyed by ``prefix + name``.

        Example:
            >>> import torch
            >>> metric = SparsityCollection(["a", "b"], total_key=None)
            >>> metric.update({"a": torch.tensor([0, 1]), "b": torch.tensor([0, 0, 0, 2])})
            >>> metric.compute()
            {'a': tensor(0.5000), 'b': tensor(0.7500)}

        """
        values = _sparsity_compute(self.zeros, self.total)
        result = {f"{self.prefix}{name}": values[index] for index, name in enumerate(self.names)}
        if self.total_key is not None:
            result[f"{self.prefix}{self.total_key}"] = _sparsity_compute(self.zeros.sum(), self.total.sum())
        return result
