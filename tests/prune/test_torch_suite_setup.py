"""The vendored torch suite (``test_torch_suite.py``) must not change torch's global state for the other tests."""

import importlib

import torch
import torch.backends


def test_importing_torchs_test_utilities_leaves_backend_flags_settable() -> None:
    # torch.testing._internal.common_utils freezes torch.backends' flags when imported; conftest.py undoes that
    importlib.import_module("torch.testing._internal.common_utils")
    assert not torch.backends.flags_frozen()
    previous = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = not previous  # what Lightning's Trainer does; raises while the flags are frozen
    torch.backends.cudnn.benchmark = previous
