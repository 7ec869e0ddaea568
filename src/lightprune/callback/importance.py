"""What ranks the weights at an event: their magnitude, activation-weighted magnitude, movement, or a function.

* ``"magnitude"``: ``|W|`` (the methods' own ranking; no scores are passed; the default);
* ``"activation"``: ``|W_ij| * ||X_j||_2`` (Wanda, Sun et al. 2023), ``X_j`` the layer's input feature ``j`` over
  the training batches of a window before each event (:mod:`.activations`);
* ``"movement"``: ``-sum_t W * dL/dW`` since the previous event (Sanh et al. 2020), signed, higher kept
  (:mod:`.movement`);
* ``"obs"``: Optimal Brain Surgeon saliency ``w_ij**2 / d_j**2`` from ``H = X^T X`` of the layer's inputs over the
  same window (:mod:`.hessians`); with reconstruction (the callback's default for obs) the event also updates the
  kept weights (:mod:`lightprune.prune.obs`), without it the saliencies rank as any scores do;
* a callable ``(qualified_name, module, parameter_name, weight) -> scores`` of the weight's shape, ranked as the
  methods rank ``importance_scores`` (by magnitude for the L1 methods).

Every input statistic (the activation sums, OBS's ``H``) leaves padded positions out by one rule (:mod:`.tokens`).
Parameters sharded as DTensor take magnitude, activation, movement (:mod:`.sharded`) and ``"obs"``
(:mod:`lightprune.prune.distributed_obs`: the saliencies of each rank's own rows); a callable, and ``"obs"`` where a
rank does not hold whole rows, are refused for them at setup, with the reason
(:func:`.setup_checks.refuse_sharded_criteria`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightprune import choices, prune, rules
from lightprune._checks import is_int
from lightprune.callback.activations import ActivationStats
from lightprune.callback.hessians import HessianStats
from lightprune.callback.movement import MovementScores
from lightprune.callback.options import method_name, raise_problems
from lightprune.prune.obs import layer_saliency

__all__ = ["IMPORTANCES", "Importance", "ScoreFunction", "check_importance"]

IMPORTANCES = choices.IMPORTANCES
"""The importance criteria named by a string; a callable is accepted too."""

ScoreFunction = Callable[[str, nn.Module, str, Tensor], Tensor]
Reduce = Callable[[Tensor], Tensor]
WeightOf = Callable[[str, nn.Module, str], Tensor]
"""``(qualified name, module, parameter name) -> the weight to rank``, detached."""


def _parameter(qualified: str, module: nn.Module, name: str) -> Tensor:
    return prune.original(module, name).detach()


def check_importance(
    importance: str | ScoreFunction,
    method: type[prune.BasePruningMethod],
    activation_window: int,
    calibration_batches: int,
    scope: str | None = None,
    units: str | None = None,
    reconstruct: bool = False,
) -> None:
    """Refuse, naming the bad value, an importance the callback cannot use with ``method``.

    Example:
        >>> check_importance("gradient", prune.L1Unstructured, 1, 0)
        Traceback (most recent call last):
        ...
        ValueError: importance='gradient' is not supported: use one of ('magnitude', 'activation', 'movement', \
'obs') or a callable (qualified_name, module, parameter_name, weight) -> scores
    """
    if not (importance in IMPORTANCES or callable(importance)):
        raise ValueError(
            f"importance={importance!r} is not supported: use one of {IMPORTANCES} or a callable "
            "(qualified_name, module, parameter_name, weight) -> scores"
        )
    if not (is_int(activation_window) and activation_window >= 1):
        raise ValueError(f"activation_window={activation_window!r} must be an int >= 1")
    if not (is_int(calibration_batches) and calibration_batches >= 0):
        raise ValueError(f"calibration_batches={calibration_batches!r} must be an int >= 0")
    named = "callable" if callable(importance) else importance
    label = units or method_name(method) or method.__name__
    problems = rules.importance_problems(
        named,
        label,
        calibration_batches=calibration_batches,
        scope=scope,
        reconstruct=reconstruct,
        activation_window=activation_window,
    )
    raise_problems(problems)


class Importance:
    """The scores one PruningCallback ranks by, and the statistics behind them (kept in its checkpoint state).

    Args:
        importance: ``"magnitude"``, ``"activation"``, ``"movement"`` or a :data:`ScoreFunction`.
        window: activation statistics are collected over this many time units (steps or epochs) before an event.

    Example:
        >>> layer = nn.Linear(2, 1)
        >>> scores = Importance(lambda q, m, n, w: w.abs() + 1, window=1)
        >>> scores.bind([("fc.weight", layer, "weight")])
        >>> scores.scores(lambda t: t, lambda t: t)["fc.weight"].shape
        torch.Size([1, 2])
    """

    def __init__(self, importance: str | ScoreFunction, window: int = 1) -> None:
        self.importance = importance
        self.window = window
        self._seen_steps: set[int] = set()  # optimizers whose step on_before_optimizer_step announced (movement)
        self.activations: ActivationStats | None = None
        self.movement: MovementScores | None = None
        self.hessians: HessianStats | None = None
        self._selection: list[tuple[str, nn.Module, str]] = []
        self._weight: WeightOf = _parameter
        self._restored: Mapping[str, Any] | None = None

    @property
    def kind(self) -> str:
        """``"magnitude"``, ``"activation"``, ``"movement"``, ``"obs"`` or ``"callable"``."""
        return self.importance if isinstance(self.importance, str) else "callable"

    @property
    def signed(self) -> bool:
        """Whether the scores rank by value (movement) instead of by magnitude."""
        return self.kind == "movement"

    def bind(
        self,
        selection: list[tuple[str, nn.Module, str]],
        weight: WeightOf | None = None,
        *,
        inputs_of: list[tuple[str, nn.Module, str]] | None = None,
        moments: bool = False,
        outer: bool = False,
    ) -> None:
        """Attach to the tensors a fit selected (checks activation's layers); restores a checkpoint's statistics.

        ``weight(qualified, module, name)`` gives the weight to rank (the effective ``W + update`` of a weight under
        a LoRA adapter); by default the Parameter. Structured units (``method="neurons"``/``"heads"``) record the
        inputs of ``inputs_of`` (their consuming projections) instead of the selection's, as
        :class:`~lightprune.structure.Moments` (``moments``), with ``X^T X`` when ``outer`` (a refit needs them
        whatever ranks the units).
        """
        self._selection = list(selection)
        self._weight = weight or _parameter
        recorded = self._selection if inputs_of is None else list(inputs_of)
        wanted = self.kind == "activation" or outer
        self.activations = ActivationStats(recorded, self._weight, moments=moments, outer=outer) if wanted else None
        self.movement = MovementScores(self._selection) if self.kind == "movement" else None
        self.hessians = HessianStats(self._selection) if self.kind == "obs" else None
        self._apply_restored()

    def unbind(self) -> None:
        """Forget the selection and the statistics (a new fit starts)."""
        self.close()
        self._selection, self.activations, self.movement, self._restored = [], None, None, None
        self.hessians = None

    def close(self) -> None:
        """Remove any hook still attached (end of fit, an exception)."""
        if self.activations is not None:
            self.activations.stop()
        if self.hessians is not None:
            self.hessians.stop()

    # ------------------------------------------------------------------------------------------------------------
    # Collecting
    # ------------------------------------------------------------------------------------------------------------

    def collects(self, now: int, next_event: int | None) -> bool:
        """Whether the batch starting at time ``now`` lies in the window before ``next_event``."""
        collecting = self.activations is not None or self.hessians is not None
        return collecting and next_event is not None and now >= next_event - self.window

    def start_batch(self, mask: Tensor | None = None, only: set[str] | None = None) -> None:
        """Collect the inputs of the coming forward passes.

        Args:
            mask: the batch's ``(B, T)`` boolean mask of real tokens (:mod:`.tokens`): every input statistic
                (activation sums, OBS's ``H``) counts only the real positions by the same rule.
            only: OBS: collect ``H`` only for the layers named here (default all).
        """
        if self.activations is not None:
            self.activations.start(mask)
        if self.hessians is not None:
            self.hessians.start(only, mask)

    def finish_batch(self, reduce_sum: Reduce) -> None:
        """Stop collecting and add the batch's statistics, summed across processes by ``reduce_sum``."""
        if self.activations is not None:
            self.activations.finish_batch(reduce_sum)
        if self.hessians is not None:
            self.hessians.finish_batch(reduce_sum)

    def optimizer_step(self, optimizer: Any, skipped: bool = False, collect: bool = True) -> None:
        """Movement: add ``-W * grad`` of the selected weights this optimizer is about to step (unless the gradient
        scaler ``skipped`` the step, or no event is left to read them: ``collect=False``); called from Lightning's
        ``on_before_optimizer_step``."""
        if self.movement is not None:
            optimizer = getattr(optimizer, "optimizer", optimizer)  # Lightning's wrapper
            self._seen_steps.add(id(optimizer))
            if collect and not skipped:
                self.movement.accumulate(p for group in optimizer.param_groups for p in group["params"])

    def follow_parameters(self) -> None:
        """Move the running sums to their weights' devices (Lightning moved the model back to the CPU at fit end)."""
        if self.movement is not None:
            self.movement.follow_parameters()

    def watch_steps(self, optimizers: list[Any]) -> list[Any]:
        """Movement: refuse a step of ``optimizers`` that Lightning's ``on_before_optimizer_step`` did not announce
        (an optimizer stepped directly under manual optimization, ``self.optimizers(use_pl_optimizer=False)``): its
        gradients would never be added, and the event would rank zeros. Returns the hooks' handles."""
        if self.movement is None:
            return []
        seen = self._seen_steps

        def check(optimizer: Any, args: Any, kwargs: Any) -> None:
            if id(optimizer) in seen:
                seen.discard(id(optimizer))
                return
            raise RuntimeError(
                f"PruningCallback: importance='movement' adds up -W*grad in Lightning's on_before_optimizer_step, "
                f"which this step of {type(optimizer).__name__} skipped: an optimizer stepped directly "
                "(self.optimizers(use_pl_optimizer=False), or one of your own) is not seen, and its event would rank "
                "all-zero scores. Under manual optimization step the optimizers self.optimizers() returns"
            )

        raw = [getattr(optimizer, "optimizer", optimizer) for optimizer in optimizers]
        return [optimizer.register_step_post_hook(check) for optimizer in raw]

    # ------------------------------------------------------------------------------------------------------------
    # Scores at an event
    # ------------------------------------------------------------------------------------------------------------

    def scores(self, reduce_sum: Reduce, reduce_mean: Reduce) -> dict[str, Tensor] | None:
        """The scores of every selected tensor by qualified name, or ``None`` for magnitude (the methods' own)."""
        if self.kind == "magnitude":
            return None
        if self.kind == "activation" and self.activations is not None:
            return self.activations.scores()
        if self.movement is not None:
            return self.movement.scores(reduce_mean)
        if self.hessians is not None:
            self.hessians.check()
            return {
                qualified: layer_saliency(module, name, self.hessians.hessian(qualified))
                for qualified, module, name in self._selection
            }
        found = {}
        for qualified, module, name in self._selection:
            weight = self._weight(qualified, module, name)
            with torch.no_grad():
                score = self.importance(qualified, module, name, weight)  # type: ignore[operator]
            if not isinstance(score, Tensor) or score.shape != weight.shape:
                got = tuple(score.shape) if isinstance(score, Tensor) else type(score).__name__
                raise ValueError(
                    f"the importance function returned {got} for {qualified}; it must return a tensor of the "
                    f"weight's shape {tuple(weight.shape)}"
                )
            if score.is_meta:
                raise ValueError(f"the importance function returned a meta tensor for {qualified}: it holds no scores")
            if score.is_complex():  # ranked by magnitude in every scope, as complex importance_scores are
                score = score.abs()
            score = score.to(weight.device)
            nans = int(torch.isnan(score).sum()) if score.is_floating_point() else 0
            if nans:  # NaN ranks above every number: those entries would always be kept, whatever was meant
                raise ValueError(
                    f"the importance function returned {nans} NaN score(s) of {score.numel()} for {qualified}: NaN "
                    "ranks above every number, so those entries would never be pruned; return finite scores (inf "
                    "keeps an entry)"
                )
            found[qualified] = score.detach()
        return found

    def after_event(self) -> None:
        """The statistics were used: start afresh for the next event."""
        if self.activations is not None:
            self.activations.reset()
        if self.movement is not None:
            self.movement.reset()
        if self.hessians is not None:
            self.hessians.reset()

    # ------------------------------------------------------------------------------------------------------------
    # Checkpoints
    # ------------------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The running statistics (empty for magnitude and callables)."""
        state: dict[str, Any] = {}
        if self.activations is not None:
            state["activation"] = self.activations.state_dict()
        if self.movement is not None:
            state["movement"] = self.movement.state_dict()
        if self.hessians is not None:
            state["obs"] = self.hessians.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`, now or once a fit selected its tensors."""
        self._restored = dict(state)
        if self._selection:
            self._apply_restored()

    def _apply_restored(self) -> None:
        restored, self._restored = self._restored, None
        if not restored:
            return
        if self.activations is not None and "activation" in restored:
            self.activations.load_state_dict(restored["activation"])
        if self.movement is not None and "movement" in restored:
            self.movement.load_state_dict(restored["movement"])
        if self.hessians is not None and "obs" in restored:
            self.hessians.load_state_dict(restored["obs"])
