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

__all__ = ["DenseGradients", "RegrowPlan", "zero_optimizer_state"]


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
