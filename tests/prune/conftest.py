"""Test setup for the engine's tests.

``test_torch_suite.py`` runs PyTorch's own pruning tests, which import ``torch.testing._internal.common_utils``.
On import that module calls ``torch.backends.disable_global_flags()`` for torch's own test runner: from then on,
in the whole pytest process, setting a flag such as ``torch.backends.cudnn.benchmark`` raises, and Lightning's
``Trainer`` sets that flag. It is imported here first, before any test module, and the freeze undone at once; the
vendored suite's import then finds the module already loaded and changes nothing.
"""

import contextlib

import torch
import torch.backends

with contextlib.suppress(ImportError):  # without expecttest the vendored suite fails to import, visibly, by itself
    import torch.testing._internal.common_utils

if torch.backends.flags_frozen():
    # the flag lives in the globals of torch.backends' functions (torch.backends itself is a module wrapper)
    torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True
