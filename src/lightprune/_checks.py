"""Small argument checks shared by the schedules and the callback."""

from __future__ import annotations

from numbers import Integral
from typing import Any

__all__ = ["is_int"]


def is_int(value: Any) -> bool:
    """An integer that is not a bool: ``True`` must not pass for ``1`` as a time, a step count or a seed.

    Example:
        >>> is_int(3), is_int(True), is_int(3.0)
        (True, False, False)
    """
    return isinstance(value, Integral) and not isinstance(value, bool)
