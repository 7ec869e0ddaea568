"""Input second moments ``H = X^T X`` of the selected layers, for OBS pruning (``importance="obs"``).

Collected as :mod:`.activations` collects its sums: while a batch is collected, a forward pre-hook on every
selected layer adds ``X^T X`` of its input (:func:`lightprune.prune.input_second_moment`: one row per token, or per
position of a convolution's unfolded input) into a float32 matrix; hooks exist only while a batch is collected.
Given the batch's token mask, padded positions are left out by the rule of :mod:`.tokens` (the one the activation
statistics follow): a Linear or ``Conv1D`` input starting with the mask's ``(B, T)`` counts only the real tokens;
convolutions count every position.
After each collected batch the batch's matrices are all-reduced (summed) across processes, one matrix at a time,
and added to the totals, so every rank holds the same totals, the masks and reconstructed weights agree, and a
checkpoint holds the totals (a resume mid-window is exact). Layers that receive the very same input tensor in a
forward (the query, key and value projections of an attention block: the same tensor object, found the first time
the layers run) share one matrix: ``H`` costs ``d_in**2`` float32 per distinct input for the totals, and as much
again for the batch being collected, only between the start of an event's window and the event.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightprune import prune
from lightprune.callback.tokens import real_positions
from lightprune.prune.obs import check_obs_layer, input_second_moment, obs_columns

__all__ = ["HessianStats"]

Reduce = Callable[[Tensor], Tensor]


class HessianStats:
    """``X^T X`` of the inputs of the selected layers, summed over the collected batches and across processes.

    Args:
        selection: ``(qualified name, module, name)`` of the selected weights; each must be one OBS can prune
            (:func:`~lightprune.prune.obs.check_obs_layer`), else a ``ValueError`` names it.

    Example:
        >>> layer = nn.Linear(2, 1)
        >>> stats = HessianStats([("fc.weight", layer, "weight")])
        >>> stats.start()
        >>> _ = layer(torch.tensor([[1.0, 2.0], [0.0, 1.0]]))
        >>> stats.finish_batch(lambda flat: flat)
        >>> stats.hessian("fc.weight")
        tensor([[1., 2.],
                [2., 5.]])
    """

    def __init__(self, selection: list[tuple[str, nn.Module, str]]) -> None:
        for qualified, module, name in selection:
            check_obs_layer(module, name, qualified)
        self.selection = selection
        self.totals: dict[str, Tensor] = {}  # by the qualified name of the first layer reading the input
        self.calls: dict[str, int] = {}
        self.shares: dict[str, str] = {}  # a layer -> the layer whose matrix it uses (itself when alone)
        self._pending: dict[str, Tensor] = {}
        self._pending_calls: dict[str, int] = {}
        self._handles: list[Any] = []
        self._inputs: dict[tuple[Any, ...], tuple[str, Tensor]] = {}  # this batch's inputs -> first layer reading
        self._mask: Tensor | None = None

    def start(self, only: set[str] | None = None, mask: Tensor | None = None) -> None:
        """Collect the inputs of the selected layers (or of those named in ``only``) until :meth:`finish_batch`.

        Args:
            only: the qualified names of the layers to collect (default all).
            mask: the batch's ``(B, T)`` boolean mask of real tokens (:func:`~lightprune.callback.tokens.
                find_token_mask`): inputs ``(B, T, ..., d)`` of non-convolutions count only where it is true.
        """
        if self._handles:
            return
        self._inputs, self._mask = {}, mask
        for qualified, module, _ in self.selection:
            if only is not None and qualified not in only:
                continue
            if self.shares.get(qualified, qualified) == qualified:  # every rank sums the same matrices
                columns = obs_columns(module)
                device = prune.original(module, "weight").device
                self._pending[qualified] = torch.zeros(columns, columns, dtype=torch.float32, device=device)
                self._pending_calls[qualified] = 0
            self._handles.append(module.register_forward_pre_hook(self._hook(qualified, module)))

    def _hook(self, qualified: str, module: nn.Module) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        conv = isinstance(module, nn.modules.conv._ConvNd)

        def collect(layer: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0] if args else None
            if not isinstance(x, Tensor):
                return
            owner = self._owner(qualified, module, x)
            if owner != qualified:
                return  # the layer that read this very input first sums it for both
            with torch.no_grad():
                if not conv:  # the owner was found by the tensor read; the mask only drops rows of X
                    x = real_positions(x.detach(), self._mask)
                pending = self._pending[qualified]
                pending += input_second_moment(module, x).to(pending.device)
            self._pending_calls[qualified] += 1

        return collect

    def _owner(self, qualified: str, module: nn.Module, x: Tensor) -> str:
        """Which layer sums this input: the first to read the same tensor the first time both were seen."""
        known = self.shares.get(qualified)
        if known is not None:
            return known
        conv = module if isinstance(module, (nn.Conv1d, nn.Conv2d)) else None
        layout = (
            None if conv is None else (conv.kernel_size, conv.stride, conv.padding, conv.dilation, type(conv).__name__)
        )
        key = (id(x), layout)
        owner, _ = self._inputs.setdefault(key, (qualified, x))  # held, so no other tensor takes its id this batch
        self.shares[qualified] = owner
        return owner

    def finish_batch(self, reduce: Reduce) -> None:
        """Stop collecting; sum this batch's matrices across processes (``reduce``: a sum all-reduce) into the totals.
        Every process must call it at the same batches."""
        for handle in self._handles:
            handle.remove()
        self._handles, self._inputs, self._mask = [], {}, None
        names = sorted(q for q in self._pending if self.shares.get(q, q) == q)  # a layer found sharing drops its own
        if not names:
            self._pending, self._pending_calls = {}, {}
            return
        first = self._pending[names[0]]
        calls = torch.tensor([float(self._pending_calls[q]) for q in names], dtype=torch.float32, device=first.device)
        for qualified in names:  # one matrix at a time: no concatenated copy of every H
            part = reduce(self._pending.pop(qualified))
            total = self.totals.get(qualified)
            self.totals[qualified] = part if total is None else total.add_(part)
            del part
        for qualified, count in zip(names, reduce(calls).tolist(), strict=True):
            self.calls[qualified] = self.calls.get(qualified, 0) + int(count)
        self._pending, self._pending_calls = {}, {}

    def hessian(self, qualified: str) -> Tensor:
        """The summed ``H`` of a selected layer (shared with the layers reading the same input).

        Raises:
            RuntimeError: the layer's forward never ran while collecting.
        """
        owner = self.shares.get(qualified, qualified)
        if self.calls.get(owner, 0) == 0:
            raise RuntimeError(
                f"importance='obs' has no input statistics for {qualified}: its forward did not run in the window "
                "before this event (set calibration_batches for an event when training starts, or exclude layers "
                "that do not run)"
            )
        return self.totals[owner]

    def check(self, names: list[str] | None = None) -> None:
        """Raise :meth:`hessian`'s error for the first layer (of ``names``, default all) without statistics."""
        for qualified in names if names is not None else [q for q, _, _ in self.selection]:
            self.hessian(qualified)

    def stop(self) -> None:
        """Remove the hooks and drop the batch in progress; the totals stay."""
        for handle in self._handles:
            handle.remove()
        self._handles, self._inputs, self._mask = [], {}, None
        self._pending, self._pending_calls = {}, {}

    def reset(self) -> None:
        """Forget the totals (after an event, or when a fit starts): their memory is freed until the next window."""
        self.stop()
        self.totals, self.calls = {}, {}

    def state_dict(self) -> dict[str, Any]:
        """The totals, forward counts and shared inputs, for a checkpoint."""
        return {"totals": dict(self.totals), "calls": dict(self.calls), "shares": dict(self.shares)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s totals, checked against the selection, onto the weights' devices."""
        totals, calls = dict(state.get("totals", {})), dict(state.get("calls", {}))
        expected = {q: module for q, module, _ in self.selection}
        for qualified, total in totals.items():
            if qualified not in expected:
                raise ValueError(f"the checkpoint's OBS statistics name {qualified!r}, which is not selected")
            columns = obs_columns(expected[qualified])
            if tuple(total.shape) != (columns, columns):
                raise ValueError(
                    f"the checkpoint's OBS statistics of {qualified!r} have shape {tuple(total.shape)}, the layer "
                    f"needs ({columns}, {columns})"
                )
        self.reset()
        self.totals = {q: t.to(prune.original(expected[q], "weight").device) for q, t in totals.items()}
        self.calls = {q: int(c) for q, c in calls.items()}
        self.shares = {str(k): str(v) for k, v in dict(state.get("shares", {})).items()}
