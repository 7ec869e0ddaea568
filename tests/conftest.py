"""Fixtures shared by the test files."""

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch


@contextmanager
def _torch_threads(threads: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Tiny models train much faster on one torch thread, above all on a busy 2-core machine; restored afterwards."""
    with _torch_threads(1):
        yield


@pytest.fixture(scope="module")
def one_thread_for_module() -> Iterator[None]:
    """:func:`one_thread` for a whole test module (``pytestmark = pytest.mark.usefixtures(...)``)."""
    with _torch_threads(1):
        yield
