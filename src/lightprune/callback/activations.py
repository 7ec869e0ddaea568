"""Input statistics of the selected layers for activation importance (Wanda): ``sum over samples of x_j**2``.

While collecting, a forward pre-hook on every selected layer adds the squares of its input, summed over every sample
and token (or spatial position), into a float32 vector with one entry per input feature; given the batch's token mask,
padded positions are left out (the rule of :mod:`lightprune.callback.tokens`). Hooks exist only while a
batch is collected (attached when it starts, removed when it ends), so outside the window they cost nothing. After
each collected batch the batch's sums are all-reduced (summed) across processes in one call and added to the
totals, so every rank holds the same totals at every moment: the masks agree, and a checkpoint holds the totals.

With ``moments=True`` the same hooks also add, in float64, each feature's sum and the token count and, with
``outer=True``, the sum of outer products ``X^T X``: the statistics of the structured units' ranking and refit
(:class:`lightprune.structure.Moments`), collected, all-reduced and checkpointed by this one mechanism.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightprune import prune
from lightprune.callback.tokens import real_positions
from lightprune.layouts import feature_layout, feature_of_entries, input_dim
from lightprune.structure.statistics import Moments

__all__ = ["ActivationStats"]

Reduce = Callable[[Tensor], Tensor]


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
        self.sums: dict[str, Tensor] = {}  # moments: per-feature sums, token counts, X^T X
        self.tokens: dict[str, int] = {}
        self.outers: dict[str, Tensor] = {}
        self.totals: dict[str, Tensor] = {}
        self.calls: dict[str, int] = {}
        self._pending: dict[str, Tensor] = {}
        self._pending_calls: dict[str, int] = {}
        self._handles: list[Any] = []
        self._mask: Tensor | None = None

    def _features(self, module: nn.Module, name: str) -> int:
        if isinstance(module, nn.modules.conv._ConvNd):
            return module.in_channels  # a grouped convolution's weight holds in / groups of them per row
        return prune.original(module, name).shape[input_dim(module)]

    def start(self, mask: Tensor | None = None) -> None:
        """Collect the inputs of the selected layers from now on (until :meth:`finish_batch`).

        Args:
            mask: the batch's ``(B, T)`` boolean mask of real tokens (:func:`~lightprune.callback.tokens.
                find_token_mask`): inputs ``(B, T, ..., d)`` count only where it is true.
        """
        self._mask = mask
        if self._handles:
            return
        for qualified, module, name in self.selection:
            weight = prune.original(module, name)
            features = self._features(module, name)
            dtype = torch.float64 if self.with_moments else torch.float32
            self._pending[qualified] = torch.zeros(features, dtype=dtype, device=weight.device)
            self._pending_calls[qualified] = 0
            if self.with_moments:
                self._pending[qualified + "#sum"] = torch.zeros(features, dtype=dtype, device=weight.device)
                self._pending[qualified + "#tokens"] = torch.zeros(1, dtype=dtype, device=weight.device)
            if self.with_outer:
                square = torch.zeros(features, features, dtype=dtype, device=weight.device)
                self._pending[qualified + "#outer"] = square
            self._handles.append(module.register_forward_pre_hook(self._hook(qualified, module, name)))

    def _hook(self, qualified: str, module: nn.Module, name: str) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        channels = feature_layout(module, name) == "channels"
        weight_dims = prune.original(module, name).dim()

        def collect(layer: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0] if args else None
            if not isinstance(x, Tensor):
                return
            with torch.no_grad():
                pending = self._pending[qualified]
                if not channels:
                    x = real_positions(x.detach(), self._mask)
                x = x.detach().to(pending.dtype)
                feature = x.dim() - weight_dims + 1 if channels else x.dim() - 1
                dims = [d for d in range(x.dim()) if d != feature]
                squares = (x * x).sum(dim=dims) if dims else x * x
                pending += squares.to(pending.device)
                if self.with_moments:
                    flat = x.reshape(-1, x.shape[-1]).to(pending.device)
                    self._pending[qualified + "#sum"] += flat.sum(0)
                    self._pending[qualified + "#tokens"] += flat.shape[0]
                    if self.with_outer:
                        self._pending[qualified + "#outer"] += flat.T @ flat
            self._pending_calls[qualified] += 1

        return collect

    def finish_batch(self, reduce: Reduce) -> None:
        """Stop collecting; sum this batch's statistics across processes (``reduce``: a sum all-reduce) and add them
        to the totals. Every process must call it at the same batches."""
        for handle in self._handles:
            handle.remove()
        self._handles, self._mask = [], None
        if not self._pending:
            return
        names = [qualified for qualified, _, _ in self.selection]
        keys = list(self._pending)  # the squares of every layer, then (moments) their sums, token counts, X^T X
        first = self._pending[names[0]]
        calls = torch.tensor([float(self._pending_calls[q]) for q in names], dtype=first.dtype, device=first.device)
        flat = torch.cat([*(self._pending[k].to(first.device).flatten() for k in keys), calls])
        flat = reduce(flat)
        start = 0
        for key in keys:
            pending = self._pending[key]
            part = flat[start : start + pending.numel()].to(pending.device).reshape(pending.shape)
            start += pending.numel()
            qualified, _, what = key.partition("#")
            if what == "tokens":
                self.tokens[qualified] = self.tokens.get(qualified, 0) + round(float(part))
                continue
            store = {"": self.totals, "sum": self.sums, "outer": self.outers}[what]
            total = store.get(qualified)
            store[qualified] = part.clone() if total is None else total + part
        for qualified, count in zip(names, flat[start:].tolist(), strict=True):
            self.calls[qualified] = self.calls.get(qualified, 0) + int(count)
        self._pending, self._pending_calls = {}, {}

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

        found = {}
        for qualified, module, name in self.selection:
            weight = self._weight(qualified, module, name)
            norms = feature_of_entries(module, self.totals[qualified].sqrt())
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
        found = {}
        for qualified, _, _ in self.selection:
            if qualified not in self.totals:
                continue
            module_name = qualified.rpartition(".")[0]
            found[module_name] = Moments(
                self.tokens.get(qualified, 0),
                self.sums[qualified].double(),
                self.totals[qualified].double(),
                self.outers[qualified].double() if qualified in self.outers else None,
            )
        return found

    def stop(self) -> None:
        """Remove the hooks and drop the batch in progress (an exception, the end of fit); the totals stay."""
        for handle in self._handles:
            handle.remove()
        self._handles, self._mask = [], None
        self._pending, self._pending_calls = {}, {}

    def reset(self) -> None:
        """Forget the totals (after an event, or when a fit starts)."""
        self.stop()
        self.totals, self.calls = {}, {}
        self.sums, self.tokens, self.outers = {}, {}, {}

    def state_dict(self) -> dict[str, Any]:
        """The totals and forward counts, for a checkpoint."""
        state: dict[str, Any] = {"totals": dict(self.totals), "calls": dict(self.calls)}
        if self.with_moments:
            state.update(sums=dict(self.sums), tokens=dict(self.tokens), outers=dict(self.outers))
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s totals, checked against the selection, onto the weights' devices."""
        totals, calls = dict(state.get("totals", {})), dict(state.get("calls", {}))
        expected = {q: (module, name) for q, module, name in self.selection}
        for qualified, total in totals.items():
            if qualified not in expected:
                raise ValueError(f"the checkpoint's activation statistics name {qualified!r}, which is not selected")
            module, name = expected[qualified]
            if tuple(total.shape) != (self._features(module, name),):
                raise ValueError(
                    f"the checkpoint's activation statistics of {qualified!r} have shape {tuple(total.shape)}, the "
                    f"layer has {self._features(module, name)} input features"
                )
        self.reset()
        self.totals = {q: t.to(prune.original(*expected[q]).device) for q, t in totals.items()}
        self.calls = {q: int(c) for q, c in calls.items()}
        if self.with_moments:
            for key, store in (("sums", self.sums), ("outers", self.outers)):
                for qualified, value in dict(state.get(key, {})).items():
                    if qualified not in expected:
                        raise ValueError(f"the checkpoint's activation {key} name {qualified!r}, which is not selected")
                    store[qualified] = value.to(prune.original(*expected[qualified]).device)
            self.tokens = {q: int(c) for q, c in dict(state.get("tokens", {})).items()}
