"""Dynamic sparse training in ``PruningCallback``: when masks move, by how much, and RigL's dense gradients.

Every ``every`` optimizer steps before ``until`` (a fraction of the run), each selected tensor drops its ``k``
smallest active weights and regrows ``k`` of the entries inactive after the drop (:mod:`lightprune.prune.regrow`), with
``k = round(f(t) * active)`` and the share ``f`` decayed by a cosine from ``fraction`` at step 0 to 0 at ``until``
(RigL's schedule)::

    f(t) = fraction / 2 * (1 + cos(pi * t / until_step))

RigL's dense gradient is the gradient of the loss with respect to the *effective* weight (``orig * mask``), pruned
entries included. It is taken only during the update step's backward passes (all micro-batches under gradient
accumulation, summed), from a hook on the tensor the forward used, averaged across DDP ranks at the update, and
dropped right after: no dense gradient outlives its step.

Example:
    >>> plan = RegrowPlan("set", every=100, fraction=0.3, until=0.75)
    >>> plan.resolve(1000)
    >>> plan.is_update(100), plan.is_update(750), plan.is_update(150)
    (True, False, False)
    >>> round(plan.fraction_at(375), 4)  # half way to until: half the initial share
    0.15
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightprune import prune, rules
from lightprune.callback.options import raise_problems
from lightprune.prune.distributed import local_of
from lightprune.statistics import recording_paused

__all__ = ["DenseGradients", "DynamicSparsity", "RegrowPlan", "zero_optimizer_state"]


class RegrowPlan:
    """When masks move and by what share (see the module's docstring); checked at construction.

    Args:
        regrow: ``"rigl"`` or ``"set"``.
        every: optimizer steps between updates.
        fraction: the share of each tensor's active weights moved at step 0, in (0, 1).
        until: the fraction of the run after which masks stay put, in (0, 1].
    """

    def __init__(self, regrow: str, every: int, fraction: float, until: float) -> None:
        raise_problems(rules.regrow_problems(regrow, every, fraction, until))
        self.regrow, self.every, self.fraction, self.until = regrow, int(every), float(fraction), float(until)
        self.until_step: int | None = None

    def resolve(self, total_steps: int) -> None:
        """Fix ``until`` to this run's length in optimizer steps."""
        self.until_step = max(1, round(self.until * total_steps))

    def is_update(self, step: int) -> bool:
        """Whether the masks move right after optimizer step ``step``."""
        assert self.until_step is not None, "resolve() first"
        return step > 0 and step % self.every == 0 and step < self.until_step

    def fraction_at(self, step: int) -> float:
        """The share of each tensor's active weights moved by an update at ``step`` (cosine decay to 0)."""
        assert self.until_step is not None, "resolve() first"
        if step >= self.until_step:
            return 0.0
        return self.fraction / 2 * (1 + math.cos(math.pi * step / self.until_step))


class DynamicSparsity:
    """The callback's dynamic sparse training, from its hooks: the plan fixed to the run, RigL's dense gradients taken
    during each update step, and the moves after it.

    Args:
        regrow: ``"rigl"`` or ``"set"``.
        every: optimizer steps (training batches under manual optimization) between updates.
        fraction: the share of each tensor's active weights moved at step 0.
        until: the fraction of the run after which masks stay put.
    """

    def __init__(self, regrow: str, every: int, fraction: float, until: float) -> None:
        self.plan = RegrowPlan(regrow, every, fraction, until)
        self.grads: DenseGradients | None = None  # RigL's dense gradients, during an update step only
        self.last = -1  # the step of the last update (kept in checkpoints)
        self._unreached: set[str] = set()  # RigL: tensors already named for getting no dense gradient at an update

    def reset(self) -> None:
        """A new fit: no update taken, no gradients held."""
        self.stop()
        self.grads, self.last, self._unreached = None, -1, set()

    def stop(self) -> None:
        """Take off RigL's gradient hooks (fit end, or a failed fit)."""
        if self.grads is not None:
            self.grads.stop()

    def start(self, trainer: Any, masked: Any, total: int | float | None, title: str) -> None:
        """Fix ``until`` to the run's length ``total`` (on the step clock), checking that the masks will move;
        RigL collects dense gradients of ``masked``'s tensors."""
        from lightprune.callback import clock, neighbours
        from lightprune.callback.options import unknown_length_hint

        plan = self.plan
        steps = clock.clock_name(trainer, "step")
        if total is None or not 1 <= total < float("inf"):
            raise ValueError(
                f"regrow_until={plan.until} is a fraction of the run, whose length in {steps} is unknown "
                f"({total!r}): {unknown_length_hint(trainer, 'step')}"
            )
        plan.resolve(int(total))
        self.check(int(total), steps)
        neighbours.warn_moves_after_last_average(trainer, title, plan.regrow, plan.until)
        self.grads = DenseGradients(masked.selection, masked.ties) if plan.regrow == "rigl" else None

    def check(self, total: int, steps: str = "optimizer steps") -> None:
        """Refuse a run of ``total`` steps in which no update falls before ``until``: the masks would never move.

        Example:
            >>> DynamicSparsity("set", every=100, fraction=0.3, until=0.75).check(1000)
            >>> DynamicSparsity("set", every=100, fraction=0.3, until=0.75).check(120)
            Traceback (most recent call last):
            ...
            ValueError: regrow='set' moves the masks every 100 optimizer steps until regrow_until=0.75 of the run, ...
        """
        plan = RegrowPlan(self.plan.regrow, self.plan.every, self.plan.fraction, self.plan.until)
        plan.resolve(total)
        assert plan.until_step is not None
        if plan.every >= plan.until_step:
            raise ValueError(
                f"regrow={plan.regrow!r} moves the masks every {plan.every} {steps} until regrow_until={plan.until} "
                f"of the run, {plan.until_step} of its {total}: no update falls before it, so the masks would never "
                "move (static sparse training). Lower regrow_every or raise regrow_until, or train longer"
            )

    def before_batch(self, trainer: Any, refreshed: Iterable[tuple[nn.Module, str]]) -> None:
        """RigL: a batch whose optimizer step is an update step collects the dense gradients of its backward
        (``refreshed``: the tensors a parent reads without calling their module's forward)."""
        from lightprune.callback import clock

        update = self.grads is not None and self.plan.is_update(clock.now(trainer, "step") + 1)
        if update and self.grads is not None and not clock.in_swa_batch_norm_epoch(trainer):
            self.grads.start()
            self.grads.hook_current(refreshed)

    def move(
        self, trainer: Any, masked: Any, skipped: bool, reduce_mean: Callable[[Tensor], Tensor], title: str
    ) -> tuple[dict[str, float], float] | None:
        """After an update step's optimizer step, move every tensor's mask (once): the share of each tensor moved
        and the update's fraction (logged by the caller), or ``None`` when no update was taken at this step.
        ``skipped``: the float16 gradient scaler skipped the step (its gradients are not finite)."""
        from lightning.pytorch.utilities import rank_zero_warn

        from lightprune.callback import clock

        plan = self.plan
        if plan.until_step is None or clock.in_swa_batch_norm_epoch(trainer):
            return None
        step = clock.now(trainer, "step")  # optimizer steps, or training batches under manual optimization
        if not plan.is_update(step) or step <= self.last:
            return None
        grads = None if self.grads is None else self.grads.take(reduce_mean)
        if skipped:
            self.last = step
            rank_zero_warn(f"{title}: the masks did not move at step {step}, whose optimizer step the float16 "
                           "gradient scaler skipped (gradients not finite)")  # fmt: skip
            return None
        fraction = plan.fraction_at(step)
        if self.last < 0 and all(round(fraction * (n - pruned)) == 0 for n, pruned in masked.counts()):
            rank_zero_warn(  # the share only decays from here: no later update moves anything either
                f"{title}: regrow_fraction={plan.fraction} moves round({fraction:.4g} x active weights) = 0 weights "
                f"of every tensor at the first update (step {step}), and less later: the masks never move. Raise "
                "regrow_fraction",
                category=UserWarning,
            )
        shares = masked.move(fraction, step, grads, trainer.optimizers)
        unreached = [qualified for qualified in masked.unranked if qualified not in self._unreached]
        if unreached:  # (once per tensor: a branch that no step takes would warn at every update)
            self._unreached.update(unreached)
            rank_zero_warn(
                f"{title}: no gradient reached {unreached[:5]} in the backward of step {step} (a layer the step did "
                "not use): RigL has nothing to regrow them by, and their masks did not move",
                category=UserWarning,
            )
        self.last = step
        return shares, fraction


class DenseGradients:
    """RigL's dense gradients of the selected tensors, collected during one optimizer step's backward passes.

    Under the reparametrization the forward reads ``orig * mask``, a fresh tensor every forward: a module forward
    hook puts a gradient hook on it. In place, the weight is the Parameter itself: a gradient hook on it sees the
    gradient before the pruned entries are zeroed. Either way the hooks add into one buffer per tensor, kept until
    :meth:`take`.

    Example:
        >>> layer = nn.Linear(3, 2)
        >>> _ = prune.l1_unstructured(layer, "weight", amount=3)
        >>> grads = DenseGradients([("fc.weight", layer, "weight")])
        >>> grads.start()
        >>> layer(torch.ones(4, 3)).sum().backward()
        >>> grads.take(lambda t: t)["fc.weight"].tolist()  # pruned entries included: d(sum)/dW = 4 everywhere
        [[4.0, 4.0, 4.0], [4.0, 4.0, 4.0]]
    """

    def __init__(
        self,
        selection: list[tuple[str, nn.Module, str]],
        ties: Sequence[tuple[nn.Module, str, list[tuple[str, nn.Module, str]]]] = (),
    ) -> None:
        self.selection = selection
        # tied weights: every other module holding a selected tensor computes with its own masked copy of it
        self.others = {(id(module), name): [(o, n) for _, o, n in owners] for module, name, owners in ties}
        self.sums: dict[str, Tensor] = {}
        self._handles: list[Any] = []
        self._hooked_now: set[int] = set()  # tensors given a hook by hook_current, while collecting

    @property
    def collecting(self) -> bool:
        """Whether hooks are attached."""
        return bool(self._handles)

    def start(self) -> None:
        """Attach the hooks (idempotent): every backward from now adds its gradients."""
        if self._handles:
            return
        for qualified, module, name in self.selection:
            add = self._adder(qualified)
            if name in prune.pruned_names(module):

                def on_forward(module: nn.Module, args: Any, output: Any, name: str = name, add: Any = add) -> None:
                    if recording_paused():  # a trace of the model, not a training forward
                        return
                    tensor = getattr(module, name)
                    if isinstance(tensor, Tensor) and tensor.requires_grad and not tensor.is_leaf:
                        tensor.register_hook(add)

                for owner, owner_name in [(module, name), *self.others.get((id(module), name), [])]:
                    hook = functools.partial(on_forward, name=owner_name)
                    self._handles.append(owner.register_forward_hook(hook))
            else:
                parameter = prune.original(module, name)
                if parameter.requires_grad:
                    self._handles.append(parameter.register_hook(add))

    def hook_current(self, pairs: Iterable[tuple[nn.Module, str]]) -> None:
        """While collecting, put a gradient hook on the tensor each selected ``(module, name)`` of ``pairs`` holds
        now: the pruned tensors a parent reads without calling their module (``F.linear(x, self.fc.weight)``, a
        foreign pre-hook such as the old ``weight_norm``), which :class:`~lightprune.prune.stale.StaleRefresher`
        recomputed before this batch. Their module's forward hook never sees the tensor the loss depends on. Call it
        before every training batch of the step (each refresh makes a new tensor).
        """
        if not self._handles:
            return
        selected = {(id(module), name): qualified for qualified, module, name in self.selection}
        for module, name in pairs:
            qualified = selected.get((id(module), name))
            tensor = module.__dict__.get(name)
            if qualified is None or not isinstance(tensor, Tensor) or id(tensor) in self._hooked_now:
                continue
            if tensor.requires_grad and not tensor.is_leaf:
                self._hooked_now.add(id(tensor))
                self._handles.append(tensor.register_hook(self._adder(qualified)))

    def _adder(self, qualified: str) -> Callable[[Tensor], None]:
        def add(grad: Tensor) -> None:
            grad = grad.detach()
            found = self.sums.get(qualified)
            self.sums[qualified] = grad.clone() if found is None else found.add_(grad)

        return add

    def stop(self) -> None:
        """Remove the hooks (the sums stay until :meth:`take`)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._hooked_now = set()

    def take(self, reduce_mean: Callable[[Tensor], Tensor]) -> dict[str, Tensor]:
        """Stop, and return the summed gradients averaged across processes by ``reduce_mean``; forget them here.

        A selected tensor that saw no backward gets zeros (every rank takes part in the same reductions).
        """
        self.stop()
        found, self.sums = self.sums, {}
        taken = {}
        for qualified, module, name in self.selection:
            grad = found.get(qualified)
            if grad is None:
                grad = torch.zeros_like(prune.original(module, name), memory_format=torch.contiguous_format)
            taken[qualified] = reduce_mean(grad)
        return taken


def zero_optimizer_state(
    optimizers: Iterable[Any], parameter: Tensor, where: Tensor, keys: Collection[str] | None = None
) -> None:
    """Zero every optimizer state tensor of ``parameter``'s shape (momentum, Adam's moments), or only those named
    ``keys``, at ``where`` (for a Parameter sharded as DTensor, ``where`` is of its local shard's shape).

    Example:
        >>> weight = nn.Parameter(torch.ones(3))
        >>> optimizer = torch.optim.SGD([weight], lr=0.1, momentum=0.9)
        >>> weight.grad = torch.ones(3)
        >>> optimizer.step()
        >>> zero_optimizer_state([optimizer], weight, torch.tensor([True, False, False]))
        >>> optimizer.state[weight]["momentum_buffer"].tolist()
        [0.0, 1.0, 1.0]
    """
    for optimizer in optimizers:
        optimizer = getattr(optimizer, "optimizer", optimizer)  # Lightning's wrapper
        state = optimizer.state.get(parameter)
        if not state:
            continue
        for key, value in state.items():
            if keys is not None and key not in keys:
                continue
            if isinstance(value, Tensor) and value.shape == parameter.shape:  # a DTensor's: its local shard
                local_of(value).masked_fill_(where.to(value.device), 0)
