"""Validation of pruning amounts, dims and norms, with the names and behaviour of torch's private helpers.

Third-party code calls ``torch.nn.utils.prune``'s underscore helpers directly, so they are provided here with the
same signatures, results and exception types; only the messages are clearer.
"""

from __future__ import annotations

import functools
import numbers
import re
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "DimOutOfRangeError",
    "MissingParameterError",
    "NotATensorError",
    "ShapeMismatchError",
    "_compute_norm",
    "_compute_nparams_toprune",
    "_validate_pruning_amount",
    "_validate_pruning_amount_init",
    "_validate_pruning_dim",
    "_validate_structured_pruning",
    "normalize_dim",
    "norms_follow_linalg",
    "validate_amount",
]


def _validate_pruning_amount_init(amount: Any) -> None:
    """Check the type and range of ``amount`` when a pruning method is constructed.

    A float (any real that is not an integral number) is a fraction and must lie in [0, 1]; an integral number
    is a count of units and must be non-negative. Booleans count as integers, as in torch.

    Args:
        amount: the value to check.

    Raises:
        TypeError: ``amount`` is not a real number.
        ValueError: ``amount`` is out of range.

    Example:
        >>> _validate_pruning_amount_init(0.3)
        >>> _validate_pruning_amount_init(1.5)
        Traceback (most recent call last):
        ...
        ValueError: amount=1.5 is out of range: a float amount is a fraction in [0, 1], an int amount a count >= 0
    """
    if not isinstance(amount, numbers.Real):
        raise TypeError(
            f"Invalid type for amount: {amount!r} ({type(amount).__name__}). "
            "Must be int (a count) or float (a fraction)."
        )
    # a float must be a fraction; NaN passes here, as in torch (validate_amount rejects it)
    out_of_range = amount < 0 if isinstance(amount, numbers.Integral) else float(amount) > 1.0 or float(amount) < 0.0
    if out_of_range:
        raise ValueError(
            f"amount={amount} is out of range: a float amount is a fraction in [0, 1], an int amount a count >= 0"
        )


def validate_amount(amount: Any) -> None:
    """What the pruning methods check when constructed: :func:`_validate_pruning_amount_init`, and no NaN.

    torch's helper lets a NaN amount through and the method fails later, when ``round(nan * n)`` raises; the
    methods reject it at once with the same type and a message naming the value.

    Raises:
        TypeError: ``amount`` is not a real number.
        ValueError: ``amount`` is out of range or NaN.

    Example:
        >>> validate_amount(float("nan"))
        Traceback (most recent call last):
        ...
        ValueError: amount=nan is out of range: a float amount is a fraction in [0, 1], an int amount a count >= 0
    """
    _validate_pruning_amount_init(amount)
    if not isinstance(amount, numbers.Integral) and float(amount) != float(amount):
        raise ValueError(
            f"amount={amount} is out of range: a float amount is a fraction in [0, 1], an int amount a count >= 0"
        )


def _compute_nparams_toprune(amount: int | float, tensor_size: int) -> int:
    """Convert ``amount`` into a number of units: an int as it is, a float as ``round(amount * tensor_size)``.

    Python's ``round`` is used (halves round to even), as torch does.

    Example:
        >>> _compute_nparams_toprune(0.5, 7), _compute_nparams_toprune(3, 7)
        (4, 3)
    """
    if isinstance(amount, numbers.Integral):
        return int(amount)
    return round(amount * tensor_size)


def _validate_pruning_amount(amount: int | float, tensor_size: int) -> None:
    """Check that an integer ``amount`` does not exceed the number of units that can still be pruned.

    Raises:
        ValueError: ``amount`` is an int larger than ``tensor_size``.

    Example:
        >>> _validate_pruning_amount(5, 4)
        Traceback (most recent call last):
        ...
        ValueError: amount=5 is larger than the number of units that can still be pruned (4)
    """
    if isinstance(amount, numbers.Integral) and amount > tensor_size:
        raise ValueError(f"amount={amount} is larger than the number of units that can still be pruned ({tensor_size})")


def _validate_structured_pruning(t: Tensor) -> None:
    """Check that ``t`` has at least two dimensions, so that it has channels to remove.

    Raises:
        ValueError: ``t`` is 0-D or 1-D.

    Example:
        >>> _validate_structured_pruning(torch.ones(3))
        Traceback (most recent call last):
        ...
        ValueError: structured pruning needs a tensor with at least 2 dims; got shape (3,) with 1 dim
    """
    if t.dim() <= 1:
        raise ValueError(
            "structured pruning needs a tensor with at least 2 dims; "
            f"got shape {tuple(t.shape)} with {t.dim()} dim{'' if t.dim() == 1 else 's'}"
        )


def _validate_pruning_dim(t: Tensor, dim: int) -> None:
    """Check that ``dim`` is not past the last dimension of ``t``, exactly as torch's helper does.

    Like torch's, this only rejects ``dim >= t.dim()``: third-party code calling it gets torch's results. The
    pruning methods themselves go further (:func:`normalize_dim`): a negative ``dim`` below ``-t.dim()`` raises an
    ``IndexError`` and a non-integer ``dim`` a ``TypeError`` before anything is pruned.

    Raises:
        IndexError: ``dim >= t.dim()`` (a :class:`DimOutOfRangeError`).

    Example:
        >>> _validate_pruning_dim(torch.ones(2, 3), 2)
        Traceback (most recent call last):
        ...
        lightprune.prune.amount.DimOutOfRangeError: dim=2 is out of range for a tensor of shape (2, 3): ...
    """
    if dim >= t.dim():
        ndim = t.dim()
        raise DimOutOfRangeError(
            f"dim={dim} is out of range for a tensor of shape {tuple(t.shape)}: allowed dims are {-ndim} ... {ndim - 1}"
        )


class DimOutOfRangeError(IndexError, ValueError):
    """A ``dim`` outside a tensor's dimensions.

    An ``IndexError``, as torch's ``_validate_pruning_dim`` raises, and also a ``ValueError``, as torch's
    ``_compute_norm`` raises for a dim too large, so code catching either of torch's types keeps working.
    """


class ShapeMismatchError(ValueError, AssertionError):
    """Importance scores or a mask whose shape is not the pruned tensor's.

    A ``ValueError``, and also an ``AssertionError``, as torch asserts the shapes (``l1_unstructured``'s scores,
    ``custom_from_mask``'s mask), so code catching torch's type keeps working.
    """


class NotATensorError(TypeError, AttributeError):
    """Importance scores or a mask that is not a tensor (a list, a NumPy array).

    A ``TypeError``, and also an ``AttributeError``, which torch raises reading the object's tensor attributes.
    """


class NotAModuleError(TypeError, AttributeError):
    """A ``module`` argument that is not a ``torch.nn.Module``.

    A ``TypeError``, and also an ``AttributeError``, which torch raises reading the object's hooks or parameters.
    """


class DeviceMismatchError(ValueError, TypeError):
    """Tensors to rank together (``global_unstructured``'s parameters) that are on more than one device.

    A ``ValueError``, and also a ``TypeError``, as torch raises ("Found two parameters on different devices").
    """


class MissingParameterError(AttributeError, TypeError):
    """A name that is no parameter of the module, or one set to ``None`` (``nn.Linear(bias=False)``'s ``bias``).

    An ``AttributeError``, as torch raises for a name the module lacks, and also a ``TypeError``, as torch raises for
    a parameter that is ``None``.
    """


def check_dim(dim: Any) -> None:
    """Refuse a ``dim`` that is not an integer (torch's ``int`` arguments take ``True`` as 1, and so does this).

    Example:
        >>> check_dim(1.0)
        Traceback (most recent call last):
        ...
        TypeError: dim must be an int, got 1.0 (float)
    """
    if not isinstance(dim, numbers.Integral):
        raise TypeError(f"dim must be an int, got {dim!r} ({type(dim).__name__})")


def normalize_dim(t: Tensor, dim: int) -> int:
    """Return ``dim`` as a non-negative index into ``t``'s dimensions.

    Raises:
        TypeError: ``dim`` is not an integer (a bool is one, as in torch: ``True`` is dim 1).
        DimOutOfRangeError: ``dim`` is out of range (an ``IndexError`` and a ``ValueError``).

    Example:
        >>> normalize_dim(torch.ones(2, 3, 4), -1)
        2
    """
    check_dim(dim)
    ndim = t.dim()
    if not -ndim <= dim < ndim:
        raise DimOutOfRangeError(
            f"dim={dim} is out of range for a tensor of shape {tuple(t.shape)}: allowed dims are {-ndim} ... {ndim - 1}"
        )
    return int(dim) % ndim


def norms_follow_linalg() -> bool:
    """True if the installed torch ranks channels by ``torch.linalg`` norms (torch 2.14 and later).

    Up to torch 2.13, ``torch.nn.utils.prune._compute_norm`` is ``torch.norm(t, p=n, dim=<other dims>)``, which
    refuses ``'fro'`` over more than two dims. From torch 2.14 it calls ``torch.linalg``: ``'fro'`` is the 2-norm
    over any number of dims (a matrix norm over exactly two), and ``'nuc'`` is a matrix norm over the other dims
    when there are exactly two of them, else over the tensor's last two dims. lightprune follows the torch it runs
    with; which one it is is found once, by asking torch's helper about ``'fro'`` over three dims (the torch
    version decides if the helper is gone).

    Example:
        >>> norms_follow_linalg() == (tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 14))
        True
    """
    return _norms_follow_linalg()


@functools.cache
def _norms_follow_linalg() -> bool:
    try:
        from torch.nn.utils import prune as torch_prune

        probe = torch_prune._compute_norm
    except (ImportError, AttributeError):  # pragma: no cover - a torch without the helper
        return _torch_version() >= (2, 14)
    try:
        probe(torch.ones(1, 1, 1, 1), "fro", 0)
    except RuntimeError:
        return False
    return True


def _torch_version() -> tuple[int, int]:
    found = re.match(r"(\d+)\.(\d+)", torch.__version__)
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


def _compute_norm(t: Tensor, n: int | float | str, dim: int) -> Tensor:
    """Norm of each slice of ``t`` along ``dim``: one value per channel, reducing over every other dim.

    ``n`` is anything ``torch.norm`` accepts as ``p`` (an int or float, ``inf``, ``-inf``, ``'fro'``, ``'nuc'``).
    The result is the one the installed torch's own helper gives (see :func:`norms_follow_linalg`): up to torch
    2.13 ``torch.norm(t, p=n, dim=<other dims>)``; from torch 2.14 the ``torch.linalg`` norms, where ``'fro'`` is
    the 2-norm over any number of dims and ``'nuc'`` over other than two remaining dims is taken over the last
    two dims of ``t`` (then not one value per channel: :class:`LnStructured` refuses that case).

    Raises:
        DimOutOfRangeError: ``dim`` is out of range (an ``IndexError`` and a ``ValueError``, torch's two types).

    Example:
        >>> _compute_norm(torch.tensor([[3.0, 4.0], [0.0, 1.0]]), 2, 0)
        tensor([5., 1.])
    """
    channel_dim = normalize_dim(t, dim)
    other_dims = [d for d in range(t.dim()) if d != channel_dim]
    if not norms_follow_linalg():
        return torch.norm(t, p=n, dim=other_dims)
    matrix = len(other_dims) == 2
    if isinstance(n, str) and n == "nuc":
        return torch.linalg.matrix_norm(t, ord="nuc", dim=other_dims if matrix else (-2, -1))
    if isinstance(n, str) and n == "fro":
        if matrix:
            return torch.linalg.matrix_norm(t, ord="fro", dim=other_dims)
        return torch.linalg.vector_norm(t, ord=2, dim=other_dims)
    return torch.linalg.vector_norm(t, ord=n, dim=other_dims)
