"""The reparametrization: how a mask is attached to a module, kept current, looked up and undone exactly.

Pruning parameter ``name`` of a module renames the Parameter to ``name_orig`` (the same object), registers the mask
as buffer ``name_mask``, stores ``name_orig * name_mask`` as the plain attribute ``name`` and registers the method
object as a forward pre-hook (see :mod:`lightprune.prune.base` for the methods and how masks combine). This module
owns everything about that arrangement on a module:

* looking it up: :func:`pruned_names`, :func:`original` (public), ``find_hook``, ``pruning_hooks``;
* keeping ``name`` current across ``.to()``, ``.half()``... and ``load_state_dict``: :func:`refresh_pruned`,
  ``install_refresh``, ``uninstall_refresh_if_unpruned``;
* attaching a new mask all or nothing (:func:`apply_method`) and undoing any block of changes exactly:
  :func:`transaction`, the one rollback every all-or-nothing path of the library goes through (pruning calls,
  ``remove``, state-dict adaptation, the callback's events and checkpoint restores);
* the dtype of new masks: :func:`set_mask_dtype`/:func:`mask_dtype` (the user's setting) or an explicit
  ``mask_dtype=`` argument (what the library itself passes, so it never changes the user's setting).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.utils.prune as torch_prune
from torch import Tensor, nn
from torch.nn.parameter import is_lazy

from lightprune.prune.amount import MissingParameterError, NotAModuleError, ShapeMismatchError
from lightprune.prune.base import (
    BasePruningMethod,
    PruningContainer,
    _check_same_shape,
    _ranks_current_values,
    next_mask,
    plain_original,
)

__all__ = [
    "FROM_SETTING",
    "Transaction",
    "get_mask_dtype",
    "mask_dtype",
    "original",
    "pruned_names",
    "refresh_pruned",
    "set_mask_dtype",
    "transaction",
]

# ----------------------------------------------------------------------------------------------------------------
# The dtype of new masks
# ----------------------------------------------------------------------------------------------------------------

_MASK_DTYPE: torch.dtype | None = None


class _FromSetting:
    """The type of :data:`FROM_SETTING`."""

    def __repr__(self) -> str:
        return "FROM_SETTING"


FROM_SETTING: Any = _FromSetting()
"""Default of the ``mask_dtype=`` arguments: the dtype chosen with :func:`set_mask_dtype` / :func:`mask_dtype`."""


def _checked_mask_dtype(dtype: Any) -> torch.dtype | None:
    """``dtype`` if it is a mask dtype (``None``: the parameter's); else the error :func:`set_mask_dtype` raises."""
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"mask dtype must be a torch.dtype or None (the parameter's dtype), got {dtype!r}")
    if dtype is not None and dtype != torch.bool and not dtype.is_floating_point:
        raise ValueError(
            f"mask dtype must be torch.bool, a floating dtype or None (the parameter's dtype), got {dtype}"
        )
    return dtype


def set_mask_dtype(dtype: torch.dtype | None) -> torch.dtype | None:
    """Choose the dtype of masks created from now on; ``None`` (the default) means the parameter's own dtype.

    ``torch.bool`` stores 1 byte per entry instead of 4 (float32) and is what large models want. A tensor keeps
    the mask dtype it was first pruned with; later pruning calls on it reuse that dtype. Library code that needs a
    particular dtype passes ``mask_dtype=`` to the call instead (:func:`~lightprune.prune.global_unstructured`,
    :func:`~lightprune.prune.custom_from_mask`, :func:`~lightprune.prune.apply_method`), leaving this setting alone.

    Args:
        dtype: ``torch.bool``, a floating dtype, or ``None`` for the parameter's dtype.

    Returns:
        The previous setting.

    Raises:
        TypeError: ``dtype`` is neither ``None`` nor a ``torch.dtype``.
        ValueError: ``dtype`` is neither ``torch.bool`` nor a floating dtype (an integer mask would silently
            truncate fractional masks; a parameter of an integer dtype still gets a mask of its own dtype by
            default, as in torch).

    Example:
        >>> previous = set_mask_dtype(torch.bool)
        >>> get_mask_dtype()
        torch.bool
        >>> set_mask_dtype(previous)
        torch.bool
    """
    global _MASK_DTYPE
    previous, _MASK_DTYPE = _MASK_DTYPE, _checked_mask_dtype(dtype)
    return previous


def get_mask_dtype() -> torch.dtype | None:
    """Return the dtype new masks are created with, ``None`` meaning the parameter's dtype.

    This is the one place the setting is read.

    Example:
        >>> get_mask_dtype() is None
        True
    """
    return _MASK_DTYPE


@contextlib.contextmanager
def mask_dtype(dtype: torch.dtype | None) -> Iterator[None]:
    """Context manager form of :func:`set_mask_dtype`; the previous setting is restored on exit.

    Example:
        >>> from lightprune import prune
        >>> layer = torch.nn.Linear(3, 2)
        >>> with prune.mask_dtype(torch.bool):
        ...     _ = prune.l1_unstructured(layer, "weight", amount=2)
        >>> layer.weight_mask.dtype, int((layer.weight == 0).sum())
        (torch.bool, 2)
    """
    previous = set_mask_dtype(dtype)
    try:
        yield
    finally:
        set_mask_dtype(previous)


def _requested_mask_dtype(requested: Any) -> torch.dtype | None:
    """The dtype a ``mask_dtype=`` argument asks for: the setting for :data:`FROM_SETTING`, else the argument."""
    return get_mask_dtype() if requested is FROM_SETTING else _checked_mask_dtype(requested)


# ----------------------------------------------------------------------------------------------------------------
# Looking up the reparametrization
# ----------------------------------------------------------------------------------------------------------------


def pruning_hooks(module: nn.Module) -> Iterator[tuple[int, BasePruningMethod]]:
    """Yield ``(key, hook)`` for every lightprune pruning hook registered on ``module`` itself."""
    for key, hook in list(module._forward_pre_hooks.items()):
        if isinstance(hook, BasePruningMethod):
            yield key, hook


def _is_foreign_pruning_hook(hook: Any, name: str) -> bool:
    """A pruning hook from torch.nn.utils.prune (or another copy of the API) acting on ``name``."""
    return (
        not isinstance(hook, BasePruningMethod)
        and getattr(hook, "_tensor_name", None) == name
        and callable(getattr(hook, "compute_mask", None))
    )


def pruned_names(module: nn.Module) -> list[str]:
    """The names of ``module``'s own tensors that are pruned (reparametrized), in the order of their hooks.

    A tensor ``X`` is pruned when one of the module's forward pre-hooks has ``_tensor_name == "X"`` and a
    ``compute_mask`` method: hooks of ``lightprune.prune`` and of ``torch.nn.utils.prune`` both count. Its
    Parameter is then ``X_orig`` (see :func:`original`) and its mask the buffer ``X_mask``. Submodules' tensors
    are not included.

    Example:
        >>> from lightprune import prune
        >>> layer = torch.nn.Linear(4, 2)
        >>> prune.pruned_names(layer)
        []
        >>> _ = prune.l1_unstructured(layer, "bias", amount=1)
        >>> _ = prune.identity(layer, "weight")
        >>> prune.pruned_names(layer), sorted(name for name, _ in layer.named_parameters())
        (['bias', 'weight'], ['bias_orig', 'weight_orig'])
    """
    names: list[str] = []
    for hook in module._forward_pre_hooks.values():
        name = getattr(hook, "_tensor_name", None)
        if isinstance(name, str) and callable(getattr(hook, "compute_mask", None)) and name not in names:
            names.append(name)
    return names


def find_hook(module: nn.Module, name: str) -> tuple[int | None, BasePruningMethod | None]:
    """Return ``(key, hook)`` of the pruning hook acting on ``module.<name>``, or ``(None, None)``."""
    found = [(key, hook) for key, hook in pruning_hooks(module) if hook._tensor_name == name]
    if len(found) > 1:
        raise RuntimeError(
            f"{len(found)} pruning hooks act on {name!r} of {type(module).__name__}; there must be at most one "
            "(a PruningContainer combines several methods)"
        )
    if not found and any(_is_foreign_pruning_hook(h, name) for h in module._forward_pre_hooks.values()):
        raise ValueError(
            f"{name!r} of {type(module).__name__} is pruned by torch.nn.utils.prune; make that pruning permanent "
            "with torch.nn.utils.prune.remove(module, name) before pruning it with lightprune"
        )
    return found[0] if found else (None, None)


def original_parameter(module: nn.Module, name: str, hook: BasePruningMethod | None) -> Tensor:
    """The tensor to prune: ``name_orig`` if ``name`` is pruned (``hook`` given), else the Parameter ``name``."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a str naming a parameter, got {name!r} ({type(name).__name__})")
    if hook is not None:
        return plain_original(module, name, f"pruning {name!r} again")
    if name in module._parameters and module._parameters[name] is not None:
        return module._parameters[name]
    params = ", ".join(repr(p) for p, v in module._parameters.items() if v is not None) or "none"
    if hasattr(module, name) and isinstance(getattr(module, name), Tensor):
        raise TypeError(
            f"{name!r} of {type(module).__name__} is a tensor but not a Parameter; only parameters can be pruned "
            f"(its parameters: {params})"
        )
    raise MissingParameterError(f"{type(module).__name__} has no parameter {name!r}; its parameters are: {params}")


def original(module: nn.Module, name: str) -> Tensor:
    """The Parameter behind ``module.<name>``: ``name_orig`` while it is pruned by lightprune, else ``name`` itself.

    This is the tensor an optimizer trains and a pruning call ranks; ``module.<name>`` of a pruned tensor is a plain
    attribute computed from it.

    Raises:
        TypeError: ``name`` is not a str, or names a tensor that is not a Parameter.
        AttributeError: ``module`` has no parameter ``name``.
        ValueError: ``name`` is pruned by ``torch.nn.utils.prune`` (make that permanent first).

    Example:
        >>> from lightprune import prune
        >>> layer = torch.nn.Linear(2, 2)
        >>> prune.original(layer, "weight") is layer.weight
        True
        >>> prune.original(prune.identity(layer, "weight"), "weight") is layer.weight_orig
        True
    """
    return original_parameter(module, name, find_hook(module, name)[1])


# ----------------------------------------------------------------------------------------------------------------
# Keeping the pruned attribute current
# ----------------------------------------------------------------------------------------------------------------


def refresh_pruned(module: nn.Module) -> None:
    """Recompute ``module.<name>`` for every tensor of ``module`` (not its children) under a lightprune hook.

    Needed after writing into ``name_orig`` or replacing ``name_mask`` outside a forward: the plain attribute is only
    recomputed by the next forward (and, automatically, after conversions and ``load_state_dict``).

    Example:
        >>> from lightprune import prune
        >>> layer = prune.identity(torch.nn.Linear(2, 1), "weight")
        >>> layer.weight_mask[0, 0] = 0  # a new mask, written outside a forward
        >>> bool(layer.weight[0, 0] == 0)
        False
        >>> prune.refresh_pruned(layer)
        >>> bool(layer.weight[0, 0] == 0)
        True
    """
    from torch.nn.utils import parametrize

    for _, hook in pruning_hooks(module):
        name = hook._tensor_name
        if name is None or name + "_mask" not in module._buffers:
            continue
        if name + "_orig" in module._parameters or parametrize.is_parametrized(module, name + "_orig"):
            hook(module, ())  # (a parametrization the user put on name_orig computes it, as in the forward)


class _OwnAttribute:
    """A callable kept in a pruned module's ``__dict__`` that acts on that module, held weakly: a module that refers
    to itself would stay alive, its weights and masks included, until Python's cyclic collector runs, not as soon as
    the last reference to it goes. A copy or pickle of the module gets its own, acting on the copy."""

    def __init__(self, module: nn.Module) -> None:
        self._module = weakref.ref(module)

    @property
    def module(self) -> nn.Module:
        module = self._module()
        assert module is not None  # (called through the module: it is alive)
        return module

    def __deepcopy__(self, memo: dict[int, Any]) -> _OwnAttribute:
        module = self._module()
        return type(self)(memo.get(id(module), module))  # the copy of the module is in memo before its state

    def __reduce__(self) -> Any:
        return type(self), (self._module(),)  # (pickle's memo turns the module into the unpickled one)


class _RefreshingApply(_OwnAttribute):
    """Installed as ``module._apply`` on pruned modules: after a conversion, recompute the pruned attributes.

    ``Module.to()``, ``.half()``, ``.double()``, ``.cuda()``... convert parameters and buffers through ``_apply``
    but know nothing of the plain attribute holding ``orig * mask``, which torch leaves stale until the next
    forward. This wrapper runs the class's own ``_apply`` and then recomputes every pruned attribute.
    """

    def __call__(self, fn: Any, *args: Any, **kwargs: Any) -> nn.Module:
        module = self.module
        result = type(module)._apply(module, fn, *args, **kwargs)
        refresh_pruned(module)
        return result


class _DetachedReduce(_OwnAttribute):
    """Installed as ``module.__reduce_ex__`` on pruned modules: pickled or copied, the module holds each pruned
    attribute (``orig * mask``, a non-leaf tensor) as its detached values; its hook recomputes it at the next forward.

    ``pickle`` and ``copy`` look ``__reduce_ex__`` up on the object itself, so this reaches every pickler, also those
    that dispatch tensors by type before any method of theirs (torch.multiprocessing's, used by ``ddp_spawn``,
    refuses non-leaf tensors that require grad). The copy is made with helpers of its own (:func:`_rebuilt`).
    """

    def __call__(self, protocol: Any) -> Any:
        module = self.module
        reduced = type(module).__reduce_ex__(module, protocol)  # (a class of its own may define one)
        state = reduced[2] if isinstance(reduced, tuple) and len(reduced) > 2 else None  # (a state is optional)
        if not isinstance(state, dict):
            return reduced
        state = {key: value for key, value in state.items() if not isinstance(value, _OwnAttribute)}
        for name in {hook._tensor_name for _, hook in pruning_hooks(module)} & state.keys():
            state[name] = _detached(state[name])
        flat = state.get("_flat_weights")  # an RNN lists its weights there too, the pruned ones as computed
        if isinstance(flat, list):
            state["_flat_weights"] = [_detached(value) for value in flat]
        return (_rebuilt, reduced[:2], state, *reduced[3:])


def _rebuilt(make: Any, args: tuple[Any, ...]) -> nn.Module:
    """A copied or unpickled pruned module, made by its class's own reduction, with helpers acting on itself (a
    shallow ``copy.copy`` too, whose state is the original's ``__dict__``)."""
    module = make(*args)
    module.__dict__["_apply"] = _RefreshingApply(module)
    module.__dict__["__reduce_ex__"] = _DetachedReduce(module)
    return module


def _detached(value: Any) -> Any:
    return value.detach() if isinstance(value, Tensor) and value.grad_fn is not None else value


def _refresh_after_load(module: nn.Module, incompatible_keys: Any) -> None:
    """``load_state_dict`` post-hook: the loaded ``orig`` and ``mask`` make the pruned attribute stale."""
    refresh_pruned(module)


def install_refresh(module: nn.Module) -> None:
    """Keep ``module``'s pruned attributes current across conversions (``.to()``...) and ``load_state_dict``."""
    if not isinstance(module.__dict__.get("_apply"), _RefreshingApply):
        module.__dict__["_apply"] = _RefreshingApply(module)
    if not isinstance(module.__dict__.get("__reduce_ex__"), _DetachedReduce):
        module.__dict__["__reduce_ex__"] = _DetachedReduce(module)
    if _refresh_after_load not in module._load_state_dict_post_hooks.values():
        module.register_load_state_dict_post_hook(_refresh_after_load)


def uninstall_refresh_if_unpruned(module: nn.Module) -> None:
    """Undo :func:`install_refresh` once no lightprune hook is left on ``module``."""
    if any(True for _ in pruning_hooks(module)):
        return
    if isinstance(module.__dict__.get("_apply"), _RefreshingApply):
        del module.__dict__["_apply"]
    if isinstance(module.__dict__.get("__reduce_ex__"), _DetachedReduce):
        del module.__dict__["__reduce_ex__"]
    for key in [k for k, h in module._load_state_dict_post_hooks.items() if h is _refresh_after_load]:
        del module._load_state_dict_post_hooks[key]


def _move_key(table: dict[str, Any], key: str, position: int) -> None:
    """Move ``key`` of an insertion-ordered dict to ``position``, in place (the dict object is kept)."""
    items = [(k, v) for k, v in table.items() if k != key]
    items.insert(position, (key, table[key]))
    table.clear()
    table.update(items)


# ----------------------------------------------------------------------------------------------------------------
# All or nothing
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class _ModuleSnapshot:
    """What changing the reparametrization of ``module.<name>`` may touch, saved so that it can be restored exactly."""

    module: nn.Module
    name: str
    parameters: dict[str, Any] = field(default_factory=dict)
    buffers: dict[str, Any] = field(default_factory=dict)
    non_persistent: set[str] = field(default_factory=set)
    hooks: dict[int, Any] = field(default_factory=dict)
    load_hooks: dict[int, Any] = field(default_factory=dict)
    attributes: dict[str, Any] = field(default_factory=dict)
    containers: list[tuple[PruningContainer, tuple[BasePruningMethod, ...]]] = field(default_factory=list)
    # RNNs keep their weights in the list ``_flat_weights`` too, updated by their ``__setattr__``
    flat_weights: tuple[list[Any], list[Any]] | None = None
    # the values of the Parameter behind ``name``: ``remove`` replaces them with ``orig * mask``
    data: tuple[Tensor, Tensor] | None = None

    @classmethod
    def take(cls, module: nn.Module, name: str) -> _ModuleSnapshot:
        flat = module.__dict__.get("_flat_weights")
        parameter = None
        if isinstance(name, str):
            parameter = module._parameters.get(name + "_orig", module._parameters.get(name))
        return cls(
            module=module,
            name=name,
            parameters=dict(module._parameters),
            buffers=dict(module._buffers),
            non_persistent=set(module._non_persistent_buffers_set),
            hooks=dict(module._forward_pre_hooks),
            load_hooks=dict(module._load_state_dict_post_hooks),
            attributes={
                k: module.__dict__[k]
                for k in (name, "_apply", "__reduce_ex__")
                if isinstance(k, str) and k in module.__dict__
            },
            containers=[(h, h._pruning_methods) for _, h in pruning_hooks(module) if isinstance(h, PruningContainer)],
            flat_weights=(flat, list(flat)) if isinstance(flat, list) else None,
            data=(parameter, parameter.data) if isinstance(parameter, Tensor) else None,
        )

    def restore(self) -> None:
        module, name = self.module, self.name
        if self.data is not None:
            self.data[0].data = self.data[1]
        module._parameters.clear()
        module._parameters.update(self.parameters)
        module._buffers.clear()
        module._buffers.update(self.buffers)
        module._non_persistent_buffers_set.clear()
        module._non_persistent_buffers_set.update(self.non_persistent)
        module._forward_pre_hooks.clear()
        module._forward_pre_hooks.update(self.hooks)
        module._load_state_dict_post_hooks.clear()
        module._load_state_dict_post_hooks.update(self.load_hooks)
        for key in (name, "_apply", "__reduce_ex__"):
            if isinstance(key, str):
                module.__dict__.pop(key, None)
        module.__dict__.update(self.attributes)
        for container, methods in self.containers:
            container._pruning_methods = methods
        if self.flat_weights is not None:
            flat, contents = self.flat_weights
            flat[:] = contents
            module.__dict__["_flat_weights"] = flat


class Transaction:
    """Saved reparametrization states of ``(module, name)`` pairs; :meth:`undo` puts them back, newest first.

    Saved are the module's parameters, buffers, forward pre-hooks, ``load_state_dict`` post-hooks, the attribute
    ``name``, the methods of its pruning containers and the values of the Parameter behind ``name``: everything a
    pruning call, ``remove`` or a mask swap changes. Save a pair before changing it; a pair may be saved again after
    earlier changes (undo restores the older state last).
    """

    def __init__(self) -> None:
        self._snapshots: list[_ModuleSnapshot] = []
        self._values: list[tuple[Tensor, Tensor]] = []  # tensors written in place during the block, their values

    def save(self, module: nn.Module, name: str) -> None:
        """Record the current state of ``module.<name>``'s reparametrization."""
        self._snapshots.append(_ModuleSnapshot.take(module, name))

    def keep_values(self, tensor: Tensor, values: Tensor) -> None:
        """Record ``values`` (a copy) of ``tensor`` before the block writes into it in place (the first time)."""
        if not any(kept is tensor for kept, _ in self._values):
            self._values.append((tensor, values))

    def undo(self) -> None:
        """Restore every saved state, newest first, and the values of tensors written in place; forget them."""
        while self._snapshots:
            self._snapshots.pop().restore()
        with torch.no_grad():
            while self._values:
                tensor, values = self._values.pop()
                tensor.copy_(values)


_RUNNING: list[Transaction] = []
"""The transactions whose block is running, innermost last."""


def before_write_in_place(tensor: Tensor) -> None:
    """Call before writing into ``tensor`` in place (OBS's update of the kept weights): every running
    :func:`transaction` keeps a copy of its values (one copy, shared; in CPU memory for a plain tensor, so that an
    accelerator holds no second model) so that undoing it puts them back. Outside a transaction nothing is copied.

    Example:
        >>> layer = torch.nn.Linear(2, 2)
        >>> before = layer.weight.detach().clone()
        >>> try:
        ...     with transaction():
        ...         before_write_in_place(layer.weight)
        ...         _ = layer.weight.data.zero_()
        ...         raise KeyboardInterrupt
        ... except KeyboardInterrupt:
        ...     pass
        >>> torch.equal(layer.weight.detach(), before)
        True
    """
    if _RUNNING:
        detached = tensor.detach()
        values = detached.to("cpu", copy=True) if type(detached) is Tensor else detached.clone()
        for running in _RUNNING:
            running.keep_values(tensor, values)


@contextlib.contextmanager
def transaction(pairs: Iterable[tuple[nn.Module, str]] = ()) -> Iterator[Transaction]:
    """All or nothing: if the block raises (also ``KeyboardInterrupt``), the reparametrization of ``pairs`` (and of
    any pair saved on the yielded :class:`Transaction` during the block) is restored exactly, then it re-raises.

    Every all-or-nothing path of lightprune goes through it: a pruning call, ``global_unstructured`` (all its masks
    or none), ``remove``, ``prepare_for_state_dict`` and the callback's pruning events and checkpoint restores.

    Example:
        >>> from lightprune import prune
        >>> a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
        >>> try:
        ...     with prune.transaction([(a, "weight"), (b, "weight")]):
        ...         _ = prune.l1_unstructured(a, "weight", amount=1)
        ...         _ = prune.l1_unstructured(b, "weight", amount=5)  # more entries than there are: fails
        ... except ValueError:
        ...     pass
        >>> prune.is_pruned(a), sorted(name for name, _ in a.named_parameters())
        (False, ['bias', 'weight'])
    """
    saved = Transaction()
    for module, name in pairs:
        saved.save(module, name)
    _RUNNING.append(saved)
    try:
        yield saved
    except BaseException:
        saved.undo()
        raise
    finally:
        _RUNNING.remove(saved)


# ----------------------------------------------------------------------------------------------------------------
# Attaching a mask
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class _Attachment:
    """A planned change: put ``mask`` on ``module.<name>`` under ``method``, combined with any existing hook."""

    module: nn.Module
    name: str
    method: BasePruningMethod
    orig: Tensor
    hook_key: int | None
    hook: BasePruningMethod | None
    mask: Tensor | None = None
    requested_dtype: torch.dtype | None = None  # for a fresh tensor's mask; None: the parameter's dtype
    shared_mask: Tensor | None = None  # a tied Parameter's owners pruned apart: what all their masks keep

    @classmethod
    def plan(
        cls, module: nn.Module, name: str, method: BasePruningMethod, *, mask_dtype: Any = FROM_SETTING
    ) -> _Attachment:
        """Look up the tensor and its current hook; changes nothing."""
        if not isinstance(module, nn.Module):
            raise NotAModuleError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        requested = _requested_mask_dtype(mask_dtype)
        key, hook = find_hook(module, name)
        orig = original_parameter(module, name, hook)
        if is_lazy(orig):  # torch raises a ValueError too, from the uninitialized parameter
            raise ValueError(
                f"{name!r} of {type(module).__name__} is not initialized yet (a lazy module): run a forward pass "
                "through the module before pruning it"
            )
        method._tensor_name = name
        return cls(
            module=module, name=name, method=method, orig=orig, hook_key=key, hook=hook, requested_dtype=requested
        )

    @property
    def current_mask(self) -> Tensor | None:
        if self.shared_mask is not None:
            return self.shared_mask
        return None if self.hook is None else self.module._buffers[self.name + "_mask"]

    def default_scores(self, method: BasePruningMethod) -> Tensor:
        """What ranks the tensor when no importance scores are given: its current value, as in torch.

        Torch ranks by ``module.<name>``, which is ``orig * mask`` once the tensor is pruned: a structured method
        compares the norms of what is left of each channel, and a user's method sees the masked values. Built-in
        methods that choose among entries whose mask is 1, or that ignore the values, get the same result from
        ``orig`` itself, so no full-size product is made for them.
        """
        if self.hook is None or not _ranks_current_values(method):
            return self.orig
        with torch.no_grad():
            if self.shared_mask is not None:
                return self.orig * self.shared_mask
            return self.hook.apply_mask(self.module)

    def mask_dtype(self) -> torch.dtype:
        """The new mask's dtype: the current mask's, else the requested one, else the parameter's."""
        current = self.current_mask
        if current is not None:
            return current.dtype
        return self.requested_dtype if self.requested_dtype is not None else self.orig.dtype

    def commit(self) -> BasePruningMethod:
        """Register parameter, buffer, hook and attribute. Call through :func:`_commit_all` for rollback."""
        module, name, mask = self.module, self.name, self.mask
        assert mask is not None, "compute the mask before committing"
        if mask.shape != self.orig.shape:
            raise ShapeMismatchError(
                f"mask shape {tuple(mask.shape)} differs from {name!r}'s shape {tuple(self.orig.shape)}"
            )
        if mask.device != self.orig.device:
            mask = mask.to(self.orig.device)
        if mask.stride() != self.orig.stride() and not self.orig.is_contiguous():
            # the parameter's layout (channels_last): the masked tensor and, after remove, the Parameter keep it
            mask = torch.empty_like(self.orig, dtype=mask.dtype).copy_(mask)
        if self.hook is None:
            position = list(module._parameters).index(name)
            module.register_parameter(name + "_orig", self.orig)
            del module._parameters[name]
            _move_key(module._parameters, name + "_orig", position)
            module.register_buffer(name + "_mask", mask)
            module.register_forward_pre_hook(self.method)
            install_refresh(module)
            hook = self.method
        else:
            module._buffers[name + "_mask"] = mask
            if isinstance(self.hook, PruningContainer):
                self.hook.add_pruning_method(self.method)
                hook = self.hook
            else:
                hook = PruningContainer(self.hook, self.method)
                module._forward_pre_hooks[self.hook_key] = hook
        hook(module, ())
        return hook


def _commit_all(attachments: list[_Attachment]) -> list[BasePruningMethod]:
    """Commit every attachment, or none: on any exception each module is restored exactly, then it re-raises."""
    with transaction((a.module, a.name) for a in attachments):
        return [attachment.commit() for attachment in attachments]


def apply_method(
    module: nn.Module,
    name: str,
    method: BasePruningMethod,
    *,
    importance_scores: Tensor | None = None,
    mask_dtype: Any = FROM_SETTING,
) -> BasePruningMethod:
    """Prune ``module.<name>`` with a method object already built, on top of any existing pruning.

    ``Method.apply(module, name, **arguments)`` is ``apply_method(module, name, Method(**arguments))``; this form
    also takes the dtype of a new mask as an argument, for code that must not change the
    :func:`~lightprune.prune.mask_dtype` setting (a library, a callback). All or nothing, as every pruning call.

    Args:
        module: the module owning the parameter.
        name: the parameter's name.
        method: the pruning method object (not attached to another tensor yet).
        importance_scores: ranks entries instead of the parameter's values; same shape as the parameter.
        mask_dtype: the stored mask's dtype if ``name`` is not pruned yet (``None``: the parameter's); by default the
            :func:`~lightprune.prune.mask_dtype` setting. A pruned tensor keeps its mask's dtype.

    Returns:
        The hook now acting on ``module.<name>``: ``method``, or the tensor's ``PruningContainer``.

    Example:
        >>> from lightprune.prune import L1Unstructured
        >>> layer = torch.nn.Linear(4, 2)
        >>> hook = apply_method(layer, "weight", L1Unstructured(amount=3), mask_dtype=torch.bool)
        >>> type(hook).__name__, layer.weight_mask.dtype, int((layer.weight == 0).sum())
        ('L1Unstructured', torch.bool, 3)
    """
    if not isinstance(method, torch_prune.BasePruningMethod):  # lightprune's methods, torch's and their subclasses
        given = f"the class {method.__name__}" if isinstance(method, type) else f"{method!r}"
        raise TypeError(
            f"method must be a pruning method object, such as L1Unstructured(amount=0.5), got {given}: "
            "Method.apply(module, name, ...) builds one and applies it"
        )
    if importance_scores is not None and isinstance(name, str):
        # torch checks the scores' shape first: keep its order of errors (e.g. for a buffer's name)
        target = getattr(module, name, None)
        if isinstance(target, Tensor):
            _check_same_shape(importance_scores, target, "importance_scores", f"parameter {name!r}")
    attachment = _Attachment.plan(module, name, method, mask_dtype=mask_dtype)
    scores = attachment.default_scores(method) if importance_scores is None else importance_scores
    _check_same_shape(scores, attachment.orig, "importance_scores", f"parameter {name!r}")
    scores = scores.to(attachment.orig.device)  # scores elsewhere (CPU scores for a CUDA weight) work on every call
    attachment.mask = next_mask(
        method, scores, attachment.current_mask, attachment.mask_dtype(), first_default_dtype=attachment.orig.dtype
    )
    return _commit_all([attachment])[0]
