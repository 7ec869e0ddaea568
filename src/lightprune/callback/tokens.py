"""Which positions of a batch count in the input statistics: real tokens, not padding.

Padded batches of text put zero-information positions (the padding tokens' hidden states) into every layer's input;
summing them into activation statistics (or OBS's ``H = X^T X``) biases the scores towards what padding looks like.
One rule for every input statistic (:mod:`.activations`, :mod:`.hessians`, the units' moments), applied by their one
collector :class:`lightprune.statistics.InputStatistics`:

1. **Finding the mask.** ``token_mask="attention_mask"`` (the callback's default) takes ``batch["attention_mask"]``
   when the batch is a mapping (a ``dict``, transformers' ``BatchEncoding``) holding a 2-D tensor under that key;
   any other string names another key. A callable ``batch -> Tensor | None`` finds it in any batch (a tuple, a
   dataclass). ``None`` counts every position. The mask has shape ``(B, T)``; nonzero marks a real token.
2. **Applying it.** A layer whose input features are on the input's last dim (Linear, transformers' ``Conv1D``)
   counts only the positions ``(b, t)`` where the mask is nonzero, *when its input starts with the mask's shape*
   ``(B, T, ..., d)``. An input of another shape (a classifier's pooled ``(B, d)``, a sequence-first ``(T, B, d)``)
   has no positions to match and counts whole (but a ``(T, B, d)`` with ``B == T`` cannot be told from a batch-first
   input: it is filtered as one). Convolutions count every position (their channels sit on dim 1).
   (:func:`real_positions`, defined in :mod:`lightprune.statistics` beside the collector, re-exported here.)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor

from lightprune.statistics import real_positions  # the rule's second half, applied by the one collector

__all__ = ["TokenMask", "check_token_mask", "find_token_mask", "real_positions"]

TokenMask = str | Callable[[Any], Tensor | None] | None
"""How the callback finds a batch's token mask: a key of a mapping batch, a callable, or ``None`` (no mask)."""


def check_token_mask(token_mask: Any) -> None:
    """Refuse, naming the bad value, what :func:`find_token_mask` cannot use.

    Example:
        >>> check_token_mask(3)
        Traceback (most recent call last):
        ...
        ValueError: token_mask=3 must be None, a key of the batch (a non-empty str, e.g. 'attention_mask') or a \
callable batch -> (B, T) mask
    """
    if token_mask is None or callable(token_mask) or (isinstance(token_mask, str) and token_mask):
        return
    raise ValueError(
        f"token_mask={token_mask!r} must be None, a key of the batch (a non-empty str, e.g. 'attention_mask') or a "
        "callable batch -> (B, T) mask"
    )


def find_token_mask(batch: Any, token_mask: TokenMask) -> Tensor | None:
    """The batch's ``(B, T)`` boolean mask of real tokens by the rule above, or ``None`` (every position counts).

    Raises:
        ValueError: the callable returned something else than ``None`` or a 2-D tensor.

    Example:
        >>> import torch
        >>> find_token_mask({"input_ids": torch.ones(2, 3), "attention_mask": torch.tensor([[1, 1, 0], [1, 1, 1]])},
        ...                 "attention_mask")
        tensor([[ True,  True, False],
                [ True,  True,  True]])
        >>> find_token_mask((torch.ones(2, 3),), "attention_mask") is None
        True
    """
    if token_mask is None:
        return None
    if callable(token_mask):
        mask = token_mask(batch)
        if mask is not None and not (isinstance(mask, Tensor) and mask.dim() == 2):
            got = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
            raise ValueError(f"the token_mask callable returned {got}; it must return None or a (B, T) tensor")
    else:
        mask = batch.get(token_mask) if isinstance(batch, Mapping) else None
        if not (isinstance(mask, Tensor) and mask.dim() == 2):
            return None
    return None if mask is None else mask.detach() != 0
