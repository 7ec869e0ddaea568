"""Input statistics of the selected layers for activation importance (Wanda): ``sum over samples of x_j**2``.

While collecting, a forward pre-hook on every selected layer adds the squares of its input, summed over every sample
and token (or spatial position), into a float32 vector with one entry per input feature; given the batch's token mask,
padded positions are left out (the rule of :mod:`lightprune.callback.tokens`). Hooks exist only while a
batch is collected (attached when it starts, removed when it ends), so outside the window they cost nothing. After
each collected batch the batch's sums are all-reduced (summed) across processes in one call and added to the
totals, so every rank holds the same totals at every moment: the masks agree, and a checkpoint holds the totals.

With ``moments=True`` the same hooks also add, in float64, each feature's sum and the token count and, with
``outer=True``, the sum of outer products ``X^T X``: the statistics of the structured units' ranking and refit
(:class:`lightprune.structure.Moments`). The hooks, the padding rule, the all-reduce and the checkpoint state are
those of :class:`lightprune.statistics.InputStatistics`, the one collector behind every input statistic (OBS's
:mod:`.hessians` too).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightprune import prune
from lightprune.layouts import feature_layout, feature_of_entries, input_dim
from lightprune.statistics import InputStatistics, Recorded, feature_sums
from lightprune.structure.statistics import Moments

__all__ = ["ActivationStats"]

Reduce = Callable[[Tensor], Tensor]

_STATE_KEYS = {"totals": "squares", "sums": "sum", "outers": "outer"}
"""This class's checkpoint keys -> the collector's statistics (``tokens`` is stored as ints)."""


def _add_channel_squares(weight_dims: int, x: Tensor, pending: Mapping[str, Tensor]) -> None:
    """A convolution's ``add``: each channel's sum of squares (channels on dim 1 of a sample)."""
    squares = pending["squares"]
    x = x.to(squares.dtype)
    feature = x.dim() - weight_dims + 1
    dims = [d for d in range(x.dim()) if d != feature]
    squares += ((x * x).sum(dim=dims) if dims else x * x).to(squares.device)


class ActivationStats:
    """Sums of squared inputs per input feature of the selected layers, and the Wanda scores built from them.

    Args:
        selection: ``(qualified name, module, name)`` of the selected weights; each must have input features (see
            :func:`~lightprune.layouts.feature_layout`), else a ``ValueError`` names it.
        weight: ``(qualified, module, name) -> the weight scored``, detached (default: the Parameter; the callback
            gives the effective ``W + update`` of a weight under a LoRA adapter).
        moments: also collect each feature's sum and the token count (float64); Linear/Conv1D inputs only.
        outer: with ``moments``, also collect ``X^T X`` (for a least-squares refit).

    Example:
        >>> layer = nn.Linear(3, 2)
        >>> stats = ActivationStats([("fc.weight", layer, "weight")])
        >>> stats.start()
        >>> _ = layer(torch.tensor([[1.0, 2.0, 0.0], [1.0, 0.0, 0.0]]))
        >>> stats.finish_batch(lambda flat: flat)
        >>> stats.totals["fc.weight"]
        tensor([2., 4., 0.])
    """

    def __init__(
        self,
        selection: list[tuple[str, nn.Module, str]],
        weight: Callable[[str, nn.Module, str], Tensor] | None = None,
        *,
        moments: bool = False,
        outer: bool = False,
    ) -> None:
        for qualified, module, name in selection:
            if feature_layout(module, name) is None:
                raise ValueError(
                    f"importance='activation' needs input features: {qualified} of {type(module).__name__} has none "
                    "(supported: the weights of Linear, Conv1d/2d/3d, ConvTranspose1d/2d/3d and transformers' "
                    "Conv1D); "
                    "exclude it or use another importance"
                )
            if moments and feature_layout(module, name) != "last":
                raise ValueError(
                    f"{qualified} of {type(module).__name__} reads units without a Linear or Conv1D forward: its "
                    "inputs cannot be recorded as moments"
                )
        self.selection = selection
        self._weight = weight or (lambda qualified, module, name: prune.original(module, name).detach())
        self.with_moments, self.with_outer = moments, moments and outer
        self.collector = InputStatistics([self._recorded(*entry) for entry in selection])

    def _features(self, module: nn.Module, name: str) -> int:
        if isinstance(module, nn.modules.conv._ConvNd):
            return module.in_channels  # a grouped convolution's weight holds in / groups of them per row
        return prune.original(module, name).shape[input_dim(module)]

    def _recorded(self, qualified: str, module: nn.Module, name: str) -> Recorded:
        """What is summed of one layer's input: squares per feature (and the moments), on the weight's device."""
        weight = prune.original(module, name)
        features = self._features(module, name)
        if feature_layout(module, name) != "channels":
            dtype = torch.float64 if self.with_moments else torch.float32
            return feature_sums(
                qualified, module, features, moments=self.with_moments, outer=self.with_outer, dtype=dtype,
                device=weight.device,
            )  # fmt: skip
        add = functools.partial(_add_channel_squares, weight.dim())  # (a partial pickles; a closure would not)
        return Recorded(qualified, module, {"squares": ((features,), torch.float32)}, add, False, weight.device)

    @property
    def totals(self) -> dict[str, Tensor]:
        """Sums of squares per input feature, by qualified name."""
        return self.collector.by_statistic("squares")

    @property
    def calls(self) -> dict[str, int]:
        """Forwards collected, by qualified name."""
        return self.collector.calls

    @property
    def sums(self) -> dict[str, Tensor]:
        """``moments``: sums per input feature (float64), by qualified name."""
        return self.collector.by_statistic("sum")

    @property
    def tokens(self) -> dict[str, int]:
        """``moments``: tokens counted, by qualified name."""
        return {q: round(float(t)) for q, t in self.collector.by_statistic("tokens").items()}

    @property
    def outers(self) -> dict[str, Tensor]:
        """``outer``: ``X^T X`` (float64), by qualified name."""
        return self.collector.by_statistic("outer")

    def start(self, mask: Tensor | None = None) -> None:
        """Collect the inputs of the selected layers from now on (until :meth:`finish_batch`).

        Args:
            mask: the batch's ``(B, T)`` boolean mask of real tokens (:func:`~lightprune.callback.tokens.
                find_token_mask`): inputs ``(B, T, ..., d)`` count only where it is true.
        """
        self.collector.start(mask)

    def finish_batch(self, reduce: Reduce) -> None:
        """Stop collecting; sum this batch's statistics across processes (``reduce``: a sum all-reduce) and add them
        to the totals. Every process must call it at the same batches."""
        self.collector.finish_batch(reduce)

    def scores(self) -> dict[str, Tensor]:
        """``|W_ij| * ||X_j||_2`` for every selected weight (float32), the norm broadcast along the input dim.

        Raises:
            RuntimeError: a layer's forward never ran while collecting (no statistics to rank it by).
        """
        missing = [q for q, _, _ in self.selection if self.calls.get(q, 0) == 0]
        if missing:
            raise RuntimeError(
                f"importance='activation' has no input statistics for {missing[:5]}: their forward did not run in "
                "the window before this event (set calibration_batches for an event when training starts, or "
                "exclude layers that do not run)"
            )
        from lightprune.prune.distributed import is_sharded, local_of, local_piece

        totals = self.totals
        found = {}
        for qualified, module, name in self.selection:
            weight = self._weight(qualified, module, name)
            norms = feature_of_entries(module, totals[qualified].sqrt())
            if is_sharded(weight):  # this rank's shard: its rows, and their norms when they differ row by row
                piece = local_piece(weight)
                weight = local_of(weight)
                if norms.shape[0] > 1 and not piece.replicated:
                    first = piece.offset // max(1, weight[0].numel()) if weight.shape[0] else 0
                    norms = norms[first : first + weight.shape[0]]
            found[qualified] = weight.abs().to(torch.float32) * norms.to(weight.device)
        return found

    def moments(self) -> dict[str, Moments]:
        """The collected moments by consuming module's qualified name (``moments=True``): token count, sums, squares
        and (``outer=True``) ``X^T X``, summed across processes."""
        totals = self.collector.totals
        return {q.rpartition(".")[0]: Moments.of(totals[q]) for q, _, _ in self.selection if q in totals}

    def stop(self) -> None:
        """Remove the hooks and drop the batch in progress (an exception, the end of fit); the totals stay."""
        self.collector.stop()

    def reset(self) -> None:
        """Forget the totals (after an event, or when a fit starts)."""
        self.collector.reset()

    def state_dict(self) -> dict[str, Any]:
        """The totals and forward counts, for a checkpoint."""
        state: dict[str, Any] = {"totals": self.totals, "calls": dict(self.calls)}
        if self.with_moments:
            state.update(sums=self.sums, tokens=self.tokens, outers=self.outers)
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s totals, checked against the selection, onto the weights' devices."""
        totals: dict[str, dict[str, Tensor]] = {}
        keys = ("totals", "sums", "outers") if self.with_moments else ("totals",)
        for key in keys:
            for qualified, value in dict(state.get(key, {})).items():
                totals.setdefault(qualified, {})[_STATE_KEYS[key]] = value
        if self.with_moments:
            for qualified, count in dict(state.get("tokens", {})).items():
                totals.setdefault(qualified, {})["tokens"] = torch.tensor([float(count)], dtype=torch.float64)

        def needs(recorded: Recorded, key: str) -> str:
            return f"has {recorded.sums[key][0][0]} input features"

        self.collector.load(totals, dict(state.get("calls", {})), what="activation", describe=needs)
