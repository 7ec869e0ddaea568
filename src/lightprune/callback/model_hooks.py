"""The hooks a :class:`~lightprune.PruningCallback` registers on the model and the optimizers, and their removal.

Three kinds, each removed when it is no longer wanted: a ``state_dict`` post-hook that writes plain checkpoints
(effective values under the tensors' own names) while fit runs, a ``load_state_dict`` pre-hook that lets a model left
reparametrized load those plain checkpoints, and the masking strategy's optimizer-step hooks (in-place masking).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from lightprune import prune

__all__ = ["ModelHooks"]


class ModelHooks:
    """The handles of the hooks one callback registered, so that each is registered once and removed on time.

    Example:
        >>> hooks = ModelHooks()
        >>> model = nn.Linear(2, 1)
        >>> hooks.write_plain_state_dict(model, lambda module, state_dict, prefix, local_metadata: None)
        >>> hooks.remove_plain_state_dict()
        >>> hooks.step_handles, hooks.plain_state_dict
        ([], None)
    """

    def __init__(self) -> None:
        self.plain_state_dict: Any = None  # the model's state_dict post-hook: plain checkpoints during fit
        self.plain_load: Any = None  # the model's load_state_dict pre-hook: a reparametrized model loads them
        self.step_handles: list[Any] = []  # in place: the optimizers' step post-hooks
        self.optimizers: list[Any] = []  # the optimizers when the step hooks were attached (held: compared by id)

    def write_plain_state_dict(self, model: nn.Module, hook: Callable[..., Any]) -> None:
        """While fit runs, ``model.state_dict()`` passes through ``hook`` (the selection's plain state_dict)."""
        self.remove_plain_state_dict()
        self.plain_state_dict = model.register_state_dict_post_hook(hook)

    def remove_plain_state_dict(self) -> None:
        """After fit, the model follows torch's state_dict contract again (``name_orig``, ``name_mask``)."""
        if self.plain_state_dict is not None:
            self.plain_state_dict.remove()
            self.plain_state_dict = None

    def accept_plain_checkpoints(self, model: nn.Module) -> None:
        """Let a model left reparametrized (by a fit with ``make_permanent=False``, or one that failed) load the plain
        checkpoints the callback writes: Lightning loads a checkpoint's weights before any callback sees it."""
        if self.plain_load is None and prune.is_pruned(model):
            self.plain_load = model.register_load_state_dict_pre_hook(_adapt_to_checkpoint)

    def remove_plain_load(self) -> None:
        if self.plain_load is not None:
            self.plain_load.remove()
            self.plain_load = None

    def attach_steps(self, optimizers: list[Any], attach: Callable[[], list[Any]]) -> None:
        """Register the strategy's step hooks (``attach()`` returns their handles) on ``optimizers``, replacing any
        attached before."""
        self.remove_steps()
        self.step_handles = attach()
        self.optimizers = list(optimizers)

    def optimizers_replaced(self, optimizers: list[Any]) -> bool:
        """Whether a callback or the module replaced the optimizers since the step hooks were attached."""
        return [id(o) for o in optimizers] != [id(o) for o in self.optimizers]

    def remove_steps(self) -> None:
        for handle in self.step_handles:
            handle.remove()
        self.step_handles = []
        self.optimizers = []

    def remove_all(self) -> None:
        """Fit failed: Lightning skips teardown, so every hook goes now."""
        self.remove_plain_state_dict()
        self.remove_plain_load()
        self.remove_steps()


def _adapt_to_checkpoint(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """``load_state_dict`` pre-hook: a plain checkpoint makes the pruning of a reparametrized model permanent first
    (:func:`~lightprune.prune.prepare_for_state_dict`), so it loads as saved."""
    prune.prepare_for_state_dict(module, state_dict, prefix)
