"""Input statistics of layers: one collector for activation importance, OBS's ``X^T X`` and the units' refit.

Every criterion that reads calibration data ranks or rebuilds weights from sums over the inputs a layer received:
activation importance (Wanda) the per-feature sums of squares, OBS the second moments ``H = X^T X``, the structured
units' refit the per-feature sums, token counts and ``X^T X`` of the consuming projections
(:class:`lightprune.structure.Moments`). :class:`InputStatistics` is the one mechanism behind all of them:

* **Hooks only while collecting.** :meth:`~InputStatistics.start` attaches a forward pre-hook to every recorded
  layer, :meth:`~InputStatistics.finish_batch` removes them: outside a collection window they cost nothing.
* **Padding left out.** Given the batch's ``(B, T)`` mask of real tokens, an input ``(B, T, ..., d)`` whose features
  are on its last dim counts only the real positions (the rule of :mod:`lightprune.callback.tokens`, applied here by
  :func:`real_positions`); inputs of other shapes, and convolutions, count whole.
* **Sums, all-reduced.** What a batch adds is kept apart until :meth:`~InputStatistics.finish_batch`, which sums it
  across processes with the ``reduce`` it is given (a sum all-reduce; the identity on one process) and adds it to the
  totals: every rank holds the same totals at every moment. Small statistics travel in one call; large matrices one
  at a time (no concatenated copy of every ``H``).
* **Shared inputs.** With ``share_inputs=True``, layers that read the very same input tensor in a forward (the query,
  key and value projections of an attention block) sum one set of statistics, owned by the first layer that read it.
  Sharing holds only for layers that read exactly the owner's inputs in every call: a shared module applied to
  another input too (``aux(a)``, then ``proj(a) + proj(b)``) sums its own, found in its first batch.
* **Checkpoint state.** :meth:`~InputStatistics.state_dict` / :meth:`~InputStatistics.load_state_dict` hold the
  totals, forward counts and shares; loading checks every name and shape against the recorded layers.

What a layer sums is declared by a :class:`Recorded`: the statistics' shapes and dtypes and the function adding one
input to them. :func:`feature_sums` declares the usual ones of a layer whose features are on the input's last dim.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "InputStatistics",
    "Recorded",
    "feature_sums",
    "paused",
    "real_positions",
    "recomputing",
    "recording_paused",
]

_PAUSED: ContextVar[bool] = ContextVar("lightprune_recording_paused", default=False)


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Forwards run inside this block add to no statistics and no dense gradient: the library's own traces of the
    model (the unit search, run while another callback may be recording) are not training data.

    Example:
        >>> layer = nn.Linear(2, 1)
        >>> stats = InputStatistics([feature_sums("fc", layer, 2)])
        >>> stats.start()
        >>> with paused():
        ...     _ = layer(torch.ones(3, 2))
        >>> _ = layer(torch.ones(1, 2))
        >>> stats.finish_batch(lambda flat: flat)
        >>> stats.totals["fc"]["squares"].tolist()  # the forward in the block did not count
        [1.0, 1.0]
    """
    token = _PAUSED.set(True)
    try:
        yield
    finally:
        _PAUSED.reset(token)


def recording_paused() -> bool:
    """Whether forwards run now are inside :func:`paused`."""
    return _PAUSED.get()


def recomputing() -> bool:
    """Whether a forward runs inside a backward pass: activation checkpointing (``torch.utils.checkpoint``, Hugging
    Face's ``gradient_checkpointing_enable()``) recomputing a block whose forward already ran, and was recorded, in
    this step. torch's own module tracker tells the two apart this way.

    Example:
        >>> recomputing()
        False
    """
    return torch._C._current_graph_task_id() != -1


Reduce = Callable[[Tensor], Tensor]
Add = Callable[[Tensor, Mapping[str, Tensor]], None]


def real_positions(x: Tensor, mask: Tensor | None) -> Tensor:
    """``x`` restricted to the real tokens, ``(n, ..., d)``, when ``x`` starts with ``mask``'s ``(B, T)``; else ``x``.

    Example:
        >>> x = torch.arange(12.0).view(2, 3, 2)
        >>> real_positions(x, torch.tensor([[True, False, False], [True, True, False]]))
        tensor([[0., 1.],
                [6., 7.],
                [8., 9.]])
        >>> real_positions(x[:, 0], torch.ones(2, 3, dtype=torch.bool)).shape  # (B, d): nothing to match
        torch.Size([2, 2])
    """
    if mask is None or x.dim() < 3 or tuple(x.shape[:2]) != tuple(mask.shape):
        return x
    return x[mask.to(x.device)]


@dataclass(frozen=True)
class Recorded:
    """One layer whose inputs are recorded, and what is summed of them.

    Attributes:
        name: the key of its statistics (the callback uses the weight's qualified name).
        module: the layer; its forward's first positional argument is the input recorded.
        sums: ``{statistic: (shape, dtype)}`` of the running sums.
        add: ``add(x, pending)`` adds one input (padding already left out) to this batch's sums ``pending``.
        tokens: whether the padding rule applies (``False`` for convolutions: their positions all count).
        device: where the sums live (default: the first parameter's device, else the CPU).

    Example:
        >>> layer = nn.Linear(2, 1)
        >>> recorded = Recorded("fc", layer, {"max": ((2,), torch.float32)}, lambda x, s: s["max"].copy_(x.amax(0)))
        >>> recorded.sums["max"][0]
        (2,)
    """

    name: str
    module: nn.Module
    sums: Mapping[str, tuple[tuple[int, ...], torch.dtype]]
    add: Add
    tokens: bool = True
    device: torch.device | None = None

    def zeros(self) -> dict[str, Tensor]:
        """Zero sums of every statistic."""
        device = self.device
        if device is None:
            device = next((p.device for p in self.module.parameters()), torch.device("cpu"))
        return {key: torch.zeros(shape, dtype=dtype, device=device) for key, (shape, dtype) in self.sums.items()}


def feature_sums(
    name: str,
    module: nn.Module,
    features: int,
    *,
    squares: bool = True,
    moments: bool = False,
    outer: bool = False,
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
) -> Recorded:
    """The sums of an input whose last dim holds ``features`` features (Linear, transformers' Conv1D), every other
    dim counting as tokens: ``"squares"`` (each feature's sum of squares), with ``moments`` ``"sum"`` and ``"tokens"``
    (each feature's sum, the token count) and with ``outer`` ``"outer"`` (``X^T X``).

    Example:
        >>> layer = nn.Linear(2, 1)
        >>> stats = InputStatistics([feature_sums("fc", layer, 2, moments=True, outer=True)])
        >>> stats.start()
        >>> _ = layer(torch.tensor([[1.0, 2.0], [3.0, 0.0]]))
        >>> stats.finish_batch(lambda flat: flat)
        >>> stats.totals["fc"]["squares"].tolist(), stats.totals["fc"]["tokens"].tolist()
        ([10.0, 4.0], [2.0])
        >>> stats.totals["fc"]["outer"].tolist()
        [[10.0, 2.0], [2.0, 4.0]]
    """
    sums: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    if squares:
        sums["squares"] = ((features,), dtype)
    if moments:
        sums["sum"], sums["tokens"] = ((features,), dtype), ((1,), dtype)
        if outer:
            sums["outer"] = ((features, features), dtype)

    add = functools.partial(_add_feature_sums, dtype=dtype, squares=squares, moments=moments, outer=outer)
    return Recorded(name, module, sums, add, tokens=True, device=device)  # (a partial pickles; a closure would not)


def _add_feature_sums(
    x: Tensor, pending: Mapping[str, Tensor], *, dtype: torch.dtype, squares: bool, moments: bool, outer: bool
) -> None:
    """:func:`feature_sums`'s ``add``."""
    flat = x.detach().reshape(-1, x.shape[-1]).to(dtype)
    if squares:
        pending["squares"] += (flat * flat).sum(0).to(pending["squares"].device)
    if moments:
        flat = flat.to(pending["sum"].device)
        pending["sum"] += flat.sum(0)
        pending["tokens"] += flat.shape[0]
        if outer:
            pending["outer"] += flat.T @ flat


class InputStatistics:
    """Sums of statistics of the inputs of several layers over the collected batches, summed across processes.

    Args:
        recorded: the layers and what each sums (names unique).
        share_inputs: layers reading the very same input tensor (found the first time they run) sum one set of
            statistics, owned by the first reader.
        together: all-reduce a batch's sums in one call (concatenated); ``False``: one statistic at a time.

    Attributes:
        totals: ``{layer name: {statistic: summed tensor}}`` (shared inputs: under the owner's name only).
        calls: forwards counted per layer (shared inputs: per owner).
        shares: ``{layer name: owner name}``, once found (``share_inputs``).

    Example:
        >>> q, k = nn.Linear(2, 2), nn.Linear(2, 2)
        >>> stats = InputStatistics([feature_sums("q", q, 2), feature_sums("k", k, 2)], share_inputs=True)
        >>> stats.start(mask=torch.tensor([[True, False]]))
        >>> x = torch.tensor([[[1.0, 2.0], [5.0, 5.0]]])
        >>> _ = q(x), k(x)
        >>> stats.finish_batch(lambda flat: flat)
        >>> stats.totals["q"]["squares"].tolist(), stats.shares, stats.calls
        ([1.0, 4.0], {'q': 'q', 'k': 'q'}, {'q': 1})
    """

    def __init__(self, recorded: Sequence[Recorded], *, share_inputs: bool = False, together: bool = True) -> None:
        self.recorded = {r.name: r for r in recorded}
        if len(self.recorded) != len(recorded):
            raise ValueError(f"recorded layers need unique names, got {[r.name for r in recorded]}")
        self.share_inputs, self.together = share_inputs, together
        self.totals: dict[str, dict[str, Tensor]] = {}
        self.calls: dict[str, int] = {}
        self.shares: dict[str, str] = {}
        self._pending: dict[str, dict[str, Tensor]] = {}
        self._pending_calls: dict[str, int] = {}
        self._handles: list[Any] = []
        self._inputs: dict[tuple[Any, ...], tuple[str, Tensor]] = {}  # this batch's inputs -> first layer reading
        self._read: dict[str, list[tuple[Any, ...]]] = {}  # this batch's inputs of each layer, by key, in order
        self._verified: set[str] = set()  # layers whose sharing (or not) a whole batch confirmed
        self._mask: Tensor | None = None

    # --------------------------------------------------------------------------------------------------------------
    # Collecting
    # --------------------------------------------------------------------------------------------------------------

    def start(self, mask: Tensor | None = None, only: set[str] | None = None) -> None:
        """Record the inputs of the layers (or of those named in ``only``) until :meth:`finish_batch`.

        Args:
            mask: the batch's ``(B, T)`` boolean mask of real tokens: inputs ``(B, T, ..., d)`` of layers with
                ``tokens`` count only where it is true.
            only: the names of the layers to record (default all).
        """
        self._mask = mask
        if self._handles:
            return
        self._inputs = {}
        for name, recorded in self.recorded.items():
            if only is not None and name not in only:
                continue
            if self.shares.get(name, name) == name:
                self._pending[name] = recorded.zeros()
                self._pending_calls[name] = 0
            self._handles.append(recorded.module.register_forward_pre_hook(self._hook(recorded)))

    def _hook(self, recorded: Recorded) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        name = recorded.name

        def collect(layer: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0] if args else None
            if not isinstance(x, Tensor) or recording_paused() or recomputing():
                return
            if self.share_inputs:
                key = self._key(recorded, x)
                self._read.setdefault(name, []).append(key)
                if name not in self._verified:  # held to the batch's end: ids stay unique, and a layer found not
                    self._inputs.setdefault(key, (name, x))  # to share after all can sum what it read
                if self._owner(recorded, key, x) != name:
                    return  # the layer that read this very input first sums it for both (checked at the batch's end)
            pending = self._pending.get(name)
            if pending is None:  # shared until this batch found it reads its own input: it cannot sum it now
                return
            self._add(recorded, x, pending)

        return collect

    def _add(self, recorded: Recorded, x: Tensor, pending: dict[str, Tensor]) -> None:
        # sums in their own dtype: a mixed-precision forward runs its hooks under autocast, whose matmul would
        # compute X^T X in bfloat16 or float16
        with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
            if recorded.tokens:
                x = real_positions(x.detach(), self._mask)
            recorded.add(x.detach(), pending)
        self._pending_calls[recorded.name] += 1

    @staticmethod
    def _key(recorded: Recorded, x: Tensor) -> tuple[Any, ...]:
        """An input, as layers reading it alike see it: the tensor, and a convolution's window over it."""
        conv = recorded.module if isinstance(recorded.module, (nn.Conv1d, nn.Conv2d)) else None
        layout = (
            None if conv is None else (conv.kernel_size, conv.stride, conv.padding, conv.dilation, type(conv).__name__)
        )
        return (id(x), layout)

    def _owner(self, recorded: Recorded, key: tuple[Any, ...], x: Tensor) -> str:
        """Which layer sums this input: the first to read the same tensor the first time both were seen."""
        known = self.shares.get(recorded.name)
        if known is not None:
            return known
        owner, _ = self._inputs.setdefault(key, (recorded.name, x))  # held: no other tensor takes its id
        self.shares[recorded.name] = owner
        return owner

    def _check_shares(self) -> None:
        """At the end of the first batch a layer ran in: a layer sharing its owner's statistics must have read
        exactly the owner's inputs; one that read others sums its own from now on, this batch's inputs included
        (held until now)."""
        for name in [n for n in self._read if n not in self._verified]:
            owner = self.shares.get(name, name)
            self._verified.add(name)
            if owner == name or self._read[name] == self._read.get(owner):
                continue
            self.shares[name] = name
            recorded = self.recorded[name]
            self._pending[name], self._pending_calls[name] = recorded.zeros(), 0
            for key in self._read[name]:
                self._add(recorded, self._inputs[key][1], self._pending[name])

    def finish_batch(self, reduce: Reduce) -> None:
        """Stop recording; sum this batch's statistics across processes (``reduce``: a sum all-reduce) and add them
        to the totals. Every process must call it at the same batches."""
        if self.share_inputs:
            self._check_shares()
        self._detach()
        names = [n for n in self.recorded if n in self._pending and self.shares.get(n, n) == n]
        if not self.together:
            names.sort()
        if not names:
            self._pending, self._pending_calls = {}, {}
            return
        parts = [(name, key, self._pending[name][key]) for name in names for key in self._pending[name]]
        first = parts[0][2]
        dtype = first.dtype
        for _, _, tensor in parts:
            dtype = torch.promote_types(dtype, tensor.dtype)
        calls = torch.tensor([float(self._pending_calls[n]) for n in names], dtype=dtype, device=first.device)
        if self.together:
            flat = reduce(torch.cat([*(t.to(first.device, dtype).flatten() for _, _, t in parts), calls]))
            start = 0
            for name, key, tensor in parts:
                part = flat[start : start + tensor.numel()].to(tensor.device, tensor.dtype).reshape(tensor.shape)
                start += tensor.numel()
                self._add_total(name, key, part)
            counts = flat[start:].tolist()
        else:  # one statistic at a time: no concatenated copy of every matrix
            for name, key, tensor in parts:
                self._pending[name][key] = tensor.new_empty(0)  # drop the batch's copy before the reduced one lands
                self._add_total(name, key, reduce(tensor))
                del tensor
            counts = reduce(calls).tolist()
        for name, count in zip(names, counts, strict=True):
            self.calls[name] = self.calls.get(name, 0) + int(count)
        self._pending, self._pending_calls = {}, {}

    def _add_total(self, name: str, key: str, part: Tensor) -> None:
        store = self.totals.setdefault(name, {})
        total = store.get(key)
        if total is not None:
            total.add_(part)
        else:  # a view of the concatenated batch is copied; a tensor reduced alone is kept
            store[key] = part.clone() if self.together else part

    def _detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._inputs, self._read, self._mask = [], {}, {}, None

    def stop(self) -> None:
        """Remove the hooks and drop the batch in progress (an exception, the end of fit); the totals stay."""
        self._detach()
        self._pending, self._pending_calls = {}, {}

    def reset(self) -> None:
        """Forget the totals (after an event, or when a fit starts): their memory is freed until the next window."""
        self.stop()
        self.totals, self.calls = {}, {}

    # --------------------------------------------------------------------------------------------------------------
    # Reading
    # --------------------------------------------------------------------------------------------------------------

    def owner(self, name: str) -> str:
        """The layer whose statistics ``name`` uses (itself unless it shares its input)."""
        return self.shares.get(name, name)

    def total(self, name: str, key: str) -> Tensor | None:
        """The summed statistic ``key`` of layer ``name`` (its owner's when shared), or ``None`` before any batch."""
        return self.totals.get(self.owner(name), {}).get(key)

    def by_statistic(self, key: str) -> dict[str, Tensor]:
        """``{layer name: summed statistic key}`` of the layers holding it."""
        return {name: stats[key] for name, stats in self.totals.items() if key in stats}

    # --------------------------------------------------------------------------------------------------------------
    # Checkpoints
    # --------------------------------------------------------------------------------------------------------------

    def load(
        self,
        totals: Mapping[str, Mapping[str, Tensor]],
        calls: Mapping[str, int],
        shares: Mapping[str, str] | None = None,
        *,
        what: str = "input",
        describe: Callable[[Recorded, str], str] | None = None,
    ) -> None:
        """Replace the totals by a checkpoint's, each checked against the recorded layers and moved to its device.

        Args:
            totals: ``{layer name: {statistic: tensor}}``.
            calls: forwards counted per layer.
            shares: the shared inputs found.
            what: the statistics' name in error messages (``"activation"``, ``"OBS"``).
            describe: ``(recorded, statistic) -> what the layer needs`` for the shape error (default: the shape).

        Raises:
            ValueError: a name that is not recorded, a statistic it does not sum, or a shape that does not fit.
        """
        for name, stats in totals.items():
            recorded = self.recorded.get(name)
            if recorded is None:
                raise ValueError(f"the checkpoint's {what} statistics name {name!r}, which is not selected")
            for key, value in stats.items():
                if key not in recorded.sums:
                    raise ValueError(f"the checkpoint's {what} statistics of {name!r} hold {key!r}, not recorded here")
                shape = recorded.sums[key][0]
                if tuple(value.shape) != tuple(shape):
                    needs = describe(recorded, key) if describe is not None else f"needs {tuple(shape)}"
                    raise ValueError(
                        f"the checkpoint's {what} statistics of {name!r} have shape {tuple(value.shape)}, the layer "
                        f"{needs}"
                    )
        self.reset()
        for name, stats in totals.items():
            zeros = self.recorded[name].zeros()
            self.totals[name] = {k: v.to(zeros[k].device, zeros[k].dtype) for k, v in stats.items()}
        self.calls = {str(k): int(v) for k, v in calls.items()}
        if shares is not None:
            self.shares = {str(k): str(v) for k, v in shares.items()}
            self._verified = set(self.shares)  # checked when found
