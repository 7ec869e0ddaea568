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

The hooks, the padding rule, the all-reduce, the shared inputs and the checkpoint state are those of
:class:`lightprune.statistics.InputStatistics`, the one collector behind every input statistic (activation
importance's :mod:`.activations` too).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightprune import prune
from lightprune.prune.obs import check_obs_layer, input_second_moment, obs_columns
from lightprune.statistics import InputStatistics, Recorded

__all__ = ["HessianStats"]

Reduce = Callable[[Tensor], Tensor]


def _recorded(qualified: str, module: nn.Module) -> Recorded:
    """``H`` of one layer's input (float32, on the weight's device; convolutions count every position)."""
    columns = obs_columns(module)
    add = functools.partial(_add_second_moment, module)  # (a partial pickles; a closure would not)
    conv = isinstance(module, nn.modules.conv._ConvNd)
    device = prune.original(module, "weight").device
    return Recorded(qualified, module, {"H": ((columns, columns), torch.float32)}, add, not conv, device)


def _add_second_moment(module: nn.Module, x: Tensor, pending: Mapping[str, Tensor]) -> None:
    """:func:`_recorded`'s ``add``."""
    pending["H"] += input_second_moment(module, x).to(pending["H"].device)


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
        self.collector = InputStatistics(
            [_recorded(qualified, module) for qualified, module, _ in selection], share_inputs=True, together=False
        )

    @property
    def totals(self) -> dict[str, Tensor]:
        """The summed ``H`` by the qualified name of the first layer reading the input."""
        return self.collector.by_statistic("H")

    @property
    def calls(self) -> dict[str, int]:
        """Forwards collected, by the qualified name of the first layer reading the input."""
        return self.collector.calls

    @property
    def shares(self) -> dict[str, str]:
        """A layer -> the layer whose matrix it uses (itself when alone), once found."""
        return self.collector.shares

    def start(self, only: set[str] | None = None, mask: Tensor | None = None) -> None:
        """Collect the inputs of the selected layers (or of those named in ``only``) until :meth:`finish_batch`.

        Args:
            only: the qualified names of the layers to collect (default all).
            mask: the batch's ``(B, T)`` boolean mask of real tokens (:func:`~lightprune.callback.tokens.
                find_token_mask`): inputs ``(B, T, ..., d)`` of non-convolutions count only where it is true.
        """
        self.collector.start(mask, only)

    def finish_batch(self, reduce: Reduce) -> None:
        """Stop collecting; sum this batch's matrices across processes (``reduce``: a sum all-reduce) into the totals.
        Every process must call it at the same batches."""
        self.collector.finish_batch(reduce)

    def hessian(self, qualified: str) -> Tensor:
        """The summed ``H`` of a selected layer (shared with the layers reading the same input).

        Raises:
            RuntimeError: the layer's forward never ran while collecting.
        """
        owner = self.collector.owner(qualified)
        if self.calls.get(owner, 0) == 0:
            raise RuntimeError(
                f"importance='obs' has no input statistics for {qualified}: its forward did not run in the window "
                "before this event (set calibration_batches for an event when training starts, or exclude layers "
                "that do not run)"
            )
        return self.collector.totals[owner]["H"]

    def check(self, names: list[str] | None = None) -> None:
        """Raise :meth:`hessian`'s error for the first layer (of ``names``, default all) without statistics."""
        for qualified in names if names is not None else [q for q, _, _ in self.selection]:
            self.hessian(qualified)

    def stop(self) -> None:
        """Remove the hooks and drop the batch in progress; the totals stay."""
        self.collector.stop()

    def reset(self) -> None:
        """Forget the totals (after an event, or when a fit starts): their memory is freed until the next window."""
        self.collector.reset()

    def state_dict(self) -> dict[str, Any]:
        """The totals, forward counts and shared inputs, for a checkpoint."""
        return {"totals": self.totals, "calls": dict(self.calls), "shares": dict(self.shares)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s totals, checked against the selection, onto the weights' devices."""
        totals = {qualified: {"H": total} for qualified, total in dict(state.get("totals", {})).items()}

        def needs(recorded: Recorded, key: str) -> str:
            columns = recorded.sums[key][0][0]
            return f"needs ({columns}, {columns})"

        self.collector.load(
            totals, dict(state.get("calls", {})), dict(state.get("shares", {})), what="OBS", describe=needs
        )
