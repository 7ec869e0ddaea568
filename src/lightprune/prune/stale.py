"""Pruned tensors that a parent reads without calling their module's forward: find them, keep them current.

A pruned tensor ``name`` is recomputed from ``name_orig`` and ``name_mask`` by its module's forward pre-hook. A
parent may read it without calling that forward: ``nn.MultiheadAttention`` reads ``out_proj.weight`` directly
(pytorch #69353), and would see values from before the last optimizer step, with an autograd graph already freed by
the last backward ("Trying to backward through the graph a second time"). :class:`StaleRefresher` learns, during
the first training step after new tensors are pruned, which of them a forward recomputes; the others it recomputes
itself whenever asked (before every training step and before evaluation). Tensors whose forward runs cost nothing.

A forward pre-hook registered on the module before it was pruned runs before the pruning hook, so it reads the
tensor of the last forward too: the old-style ``nn.utils.weight_norm`` computes ``weight`` from ``weight_v`` there.
Such tensors are recomputed before every step as well (lightprune's own input-recording hooks do not count: they
read no weights).
This is an engine matter: a plain training loop needs it as much as the Lightning callback does.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

from torch import Tensor, nn

from lightprune.prune._reparam import BasePruningMethod, find_hook

__all__ = ["StaleRefresher"]


class StaleRefresher:
    """Recompute the pruned tensors that no forward pre-hook recomputes.

    Call :meth:`watch` before a training step with the pruned ``(module, name)`` pairs, :meth:`classify` after it,
    and :meth:`refresh` before every later forward that trains (with gradient accumulation, every micro-batch: each
    backward frees its forward's graph) and before evaluation. After pruning more tensors, call
    :meth:`expect_new` so the next step classifies them.

    Example:
        >>> import torch
        >>> from lightprune import prune
        >>> attention = torch.nn.MultiheadAttention(4, 1)
        >>> _ = prune.l1_unstructured(attention.out_proj, "weight", amount=8)
        >>> refresher = StaleRefresher()
        >>> x = torch.randn(3, 1, 4)
        >>> refresher.watch([(attention.out_proj, "weight")])
        >>> attention(x, x, x)[0].sum().backward()
        >>> refresher.classify()  # out_proj's forward never ran: it is refreshed from now on
        >>> with torch.no_grad():
        ...     _ = attention.out_proj.weight_orig.add_(1.0)  # an optimizer step
        >>> refresher.refresh()
        >>> masked = torch.where(attention.out_proj.weight_mask.bool(), attention.out_proj.weight_orig, 0)
        >>> torch.equal(attention.out_proj.weight, masked)
        True
    """

    def __init__(self) -> None:
        self._hooked: set[tuple[int, str]] = set()
        self._unhooked: list[tuple[nn.Module, str]] = []
        self._watched: list[tuple[nn.Module, str, weakref.ReferenceType[Tensor]]] = []
        self._pending = True

    def reset(self) -> None:
        """Forget everything learnt (a new fit)."""
        self.__init__()  # type: ignore[misc]

    @property
    def pending(self) -> bool:
        """Whether the next :meth:`watch` has tensors to classify (callers may skip building its pairs otherwise).

        Example:
            >>> refresher = StaleRefresher()
            >>> refresher.pending, refresher.watch([]), refresher.pending
            (True, None, False)
        """
        return self._pending

    def expect_new(self) -> None:
        """New tensors were pruned: the next :meth:`watch` classifies them."""
        self._pending = True

    def watch(self, pairs: Iterable[tuple[nn.Module, str]]) -> None:
        """Before a step: remember the pruned tensors not yet classified, to see afterwards whether a forward
        replaced them."""
        if not self._pending:
            return
        self._pending = False
        known = self._hooked | {(id(module), name) for module, name in self._unhooked}
        self._watched = []
        for module, name in pairs:
            key, hook = find_hook(module, name)
            if hook is None or not isinstance(module.__dict__.get(name), Tensor) or (id(module), name) in known:
                continue
            known.add((id(module), name))
            if _read_by_an_earlier_hook(module, key):
                self._unhooked.append((module, name))
                hook(module, ())  # read before its own hook runs in this step's forward: current from now on
            else:
                self._watched.append((module, name, weakref.ref(module.__dict__[name])))

    def classify(self) -> None:
        """After the step: a watched tensor still in place was not recomputed by its module's forward pre-hook."""
        for module, name, ref in self._watched:
            if module.__dict__.get(name) is ref():
                self._unhooked.append((module, name))
            else:
                self._hooked.add((id(module), name))
        self._watched = []

    @property
    def refreshed(self) -> list[tuple[nn.Module, str]]:
        """The ``(module, name)`` pairs :meth:`refresh` recomputes: the tensors the model reads are the ones it
        leaves in place (a gradient hook on them, after a refresh, sees what the forward did with them).

        Example:
            >>> StaleRefresher().refreshed
            []
        """
        return list(self._unhooked)

    def refresh(self) -> None:
        """Recompute the tensors no forward pre-hook recomputes, from the current ``orig`` and mask."""
        for module, name in self._unhooked:
            _, hook = find_hook(module, name)
            if hook is not None:
                hook(module, ())


def _read_by_an_earlier_hook(module: nn.Module, key: int | None) -> bool:
    """Whether a forward pre-hook of another library runs before the pruning hook ``key`` of ``module`` (and may read
    the pruned tensor it has not yet recomputed)."""
    for other, hook in module._forward_pre_hooks.items():
        if other == key:
            return False
        if not isinstance(hook, BasePruningMethod) and not getattr(hook, "__module__", "").startswith("lightprune."):
            return True
    return False
