"""The pruning reparametrization: ``BasePruningMethod``, ``PruningContainer`` and how a mask is attached to a module.

The contract is torch.nn.utils.prune's, so checkpoints and code move between the two: pruning parameter ``name``
of a module renames the Parameter to ``name_orig`` (the same object, so optimizers keep working), registers the
mask as buffer ``name_mask``, stores ``name_orig * name_mask`` as the plain attribute ``name`` and registers the
method object as a forward pre-hook that recomputes that attribute before every forward. A second method on the
same tensor is combined with the first through a ``PruningContainer``.

What differs from torch is behind that contract:

* nothing on the module changes until the new mask has been computed, and a failure while attaching it restores
  the module exactly (parameters, buffers, hooks, attributes), for the first call and every later one;
* a later call replaces the hook in place, so the order of the module's other forward pre-hooks is kept, and
  ``name_orig`` takes ``name``'s place among the parameters, so ``module.parameters()`` keeps its order (an optimizer
  created after pruning, e.g. when resuming from a checkpoint, lines up with the saved optimizer state);
* the pruned attribute survives ``copy.deepcopy`` and ``pickle``, and is recomputed after ``.to()``, ``.half()``,
  ``.double()``, ``.cuda()``, every other conversion and ``load_state_dict``, so it is never stale;
* masks may be stored as ``torch.bool`` (1 byte an entry) instead of the parameter's dtype, see :func:`mask_dtype`;
* the built-in methods select with an exact O(n) threshold pass (``select.py``) instead of ``topk`` or boolean
  indexing, so tensors of any size work and ties are broken by flat index.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightprune.prune.masking import masked

__all__ = [
    "BasePruningMethod",
    "PruningContainer",
    "get_mask_dtype",
    "mask_dtype",
    "set_mask_dtype",
]

_MASK_DTYPE: torch.dtype | None = None

_OWN_COMPUTE_MASK: dict[type, Any] = {}
"""Per class defining ``_next_mask``: the ``compute_mask`` function defined beside it (recorded at class creation)."""


def set_mask_dtype(dtype: torch.dtype | None) -> torch.dtype | None:
    """Choose the dtype of masks created from now on; ``None`` (the default) means the parameter's own dtype.

    ``torch.bool`` stores 1 byte per entry instead of 4 (float32) and is what large models want. A tensor keeps
    the mask dtype it was first pruned with; later pruning calls on it reuse that dtype.

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
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"mask dtype must be a torch.dtype or None (the parameter's dtype), got {dtype!r}")
    if dtype is not None and dtype != torch.bool and not dtype.is_floating_point:
        raise ValueError(
            f"mask dtype must be torch.bool, a floating dtype or None (the parameter's dtype), got {dtype}"
        )
    previous, _MASK_DTYPE = _MASK_DTYPE, dtype
    return previous


def get_mask_dtype() -> torch.dtype | None:
    """Return the dtype new masks are created with, ``None`` meaning the parameter's dtype.

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


class _PrunedTensor(Tensor):
    """The type of the pruned attribute ``name``: a plain tensor that also deep-copies and pickles.

    The attribute is ``orig * mask`` with its autograd history (the gradient must reach ``orig``), and torch refuses
    to deep-copy such non-leaf tensors, which made ``copy.deepcopy`` of a pruned module fail (pytorch #37322).
    Copies and pickles of this type hold the detached values instead; the copy's own hook recomputes the attribute
    before its next forward. Torch functions see a regular tensor (``__torch_function__`` is disabled).
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __deepcopy__(self, memo: dict[int, Any]) -> Tensor:
        copied = self.detach().clone()
        memo[id(self)] = copied
        return copied

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self.detach().__reduce_ex__(protocol)

    def __repr__(self, **kwargs: Any) -> str:
        return repr(self.as_subclass(Tensor))


def _as_pruned(tensor: Tensor) -> Tensor:
    """``tensor`` as a :class:`_PrunedTensor`, if it is a plain tensor; any other tensor type as it is.

    While a module is traced (``torch.export``, and so ONNX export, run it on fake or functional tensors), the
    masked value is an instance of a tracing subclass bound to its tensor object, which cannot be given another
    Python type; a traced program is never deep-copied through this attribute anyway.
    """
    if type(tensor) is not Tensor or (_SUBCLASS_NOT_TRACEABLE and torch.compiler.is_compiling()):
        return tensor
    return tensor.as_subclass(_PrunedTensor)


_SUBCLASS_NOT_TRACEABLE = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13)
"""TorchDynamo of torch 2.5 cannot trace ``as_subclass`` into ``_PrunedTensor`` (``torch.compile`` and strict
``torch.export`` then fail); torch 2.13 can. Before 2.13 (versions between were not tested), a value computed in a
compiled forward stays a plain tensor: everything works but ``copy.deepcopy`` of the module right after a compiled
training step, until the next eager forward."""


class BasePruningMethod(ABC):
    """Base class of pruning methods: compute a mask for a tensor and keep a module's parameter masked.

    Subclasses implement :meth:`compute_mask` and set ``PRUNING_TYPE`` to ``"unstructured"`` (single entries),
    ``"structured"`` (whole channels along ``self.dim``) or ``"global"`` (the whole tensor at once); the type tells a
    :class:`PruningContainer` which part of an already pruned tensor a new method acts on.

    An attached method object is the module's forward pre-hook: calling it recomputes ``module.<name>``.

    Example:
        >>> from lightprune import prune
        >>> class EveryOther(prune.BasePruningMethod):
        ...     PRUNING_TYPE = "unstructured"
        ...     def compute_mask(self, t, default_mask):
        ...         mask = default_mask.clone()
        ...         mask.view(-1)[::2] = 0
        ...         return mask
        >>> layer = torch.nn.Linear(2, 2)
        >>> method = EveryOther.apply(layer, "weight")
        >>> layer.weight_mask
        tensor([[0., 1.],
                [0., 1.]])
    """

    PRUNING_TYPE: str
    _tensor_name: str | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # a class with a fast path (``_next_mask``) records the ``compute_mask`` it stands in for; see _has_fast_path
        if "_next_mask" in cls.__dict__ and "compute_mask" in cls.__dict__:
            _OWN_COMPUTE_MASK[cls] = cls.__dict__["compute_mask"]

    def __call__(self, module: nn.Module, inputs: Any) -> None:
        """Forward pre-hook: store the masked tensor as ``module.<name>`` before the module runs."""
        setattr(module, self._attached_name(), _as_pruned(self.apply_mask(module)))

    @abstractmethod
    def compute_mask(self, t: Tensor, default_mask: Tensor) -> Tensor:
        """Return the mask for ``t``, combining the units this method removes with ``default_mask``.

        Args:
            t: the importance scores (by default the tensor itself).
            default_mask: the mask already in force; entries it zeroes stay zero.
        """

    def apply_mask(self, module: nn.Module) -> Tensor:
        """Return ``orig * mask`` for the attached tensor, in the parameter's dtype, keeping autograd history.

        A boolean mask selects as ``torch.where`` does (fast on the CPU, see :mod:`lightprune.prune.masking`), so
        pruned entries are exact zeros even where ``orig`` holds ``inf`` or ``NaN``; a floating mask multiplies, as
        torch does (fractional masks scale entries).
        """
        name = self._attached_name()
        orig = getattr(module, name + "_orig")
        mask = getattr(module, name + "_mask")
        if mask.dtype == torch.bool:
            return masked(orig, mask)
        if mask.dtype != orig.dtype:
            mask = mask.to(dtype=orig.dtype)
        return orig * mask

    @classmethod
    def apply(cls, module: nn.Module, name: str, *args: Any, importance_scores: Tensor | None = None, **kwargs: Any):
        """Create the method from ``args``/``kwargs``, prune ``module.<name>`` with it and return the attached hook.

        If the tensor is already pruned, the new method acts on what is left (see :class:`PruningContainer`) and
        the returned hook is the tensor's container. On any error the module is left exactly as it was.

        Args:
            module: the module owning the tensor.
            name: the parameter's name in ``module`` (``"weight"``).
            importance_scores: ranking input with the parameter's shape; defaults to the parameter's current value
                (``orig * mask`` once it is pruned, as in torch).
        """
        method = cls(*args, **kwargs)
        return attach(module, name, method, importance_scores=importance_scores)

    def prune(self, t: Tensor, default_mask: Tensor | None = None, importance_scores: Tensor | None = None) -> Tensor:
        """Return ``t`` multiplied by the mask this method computes for it (no module involved).

        Example:
            >>> from lightprune import prune
            >>> prune.L1Unstructured(amount=1).prune(torch.tensor([3.0, -1.0, 2.0]))
            tensor([3., -0., 2.])
        """
        scores = t if importance_scores is None else importance_scores
        _check_same_shape(scores, t, "importance_scores", "tensor t")
        if default_mask is None:
            default_mask = torch.ones_like(t)
        return t * self.compute_mask(scores, default_mask=default_mask)

    def remove(self, module: nn.Module) -> None:
        """Make the pruning permanent: ``name`` becomes a plain Parameter again holding ``orig * mask``.

        The Parameter object is the one that was ``name_orig`` (its ``.data`` is replaced), so optimizers that hold
        it stay valid, and it takes back its place among the module's parameters. The caller (``prune.remove``)
        also removes the hook from the module.
        """
        name = self._attached_name()
        with torch.no_grad():
            pruned = self.apply_mask(module)
        orig = module._parameters[name + "_orig"]
        position = list(module._parameters).index(name + "_orig")
        module.__dict__.pop(name, None)
        orig.data = pruned
        del module._parameters[name + "_orig"]
        del module._buffers[name + "_mask"]
        setattr(module, name, orig)
        move_key(module._parameters, name, position)

    def _attached_name(self) -> str:
        if self._tensor_name is None:
            raise ValueError(f"{type(self).__name__} is not attached to a tensor: call apply(module, name) first")
        return self._tensor_name

    def __repr__(self) -> str:
        fields = {k: v for k, v in vars(self).items() if not k.startswith("_") and not isinstance(v, Tensor)}
        inner = ", ".join(f"{k}={v!r}" for k, v in fields.items())
        return f"{type(self).__name__}({inner})"


class PruningContainer(BasePruningMethod):
    """The sequence of methods applied to one tensor; its mask is the newest method applied to what is left.

    The newest method acts on the part of the tensor the current mask still keeps, and its amount is a fraction
    (or count) of that part: an ``"unstructured"`` method chooses among entries whose mask is 1, a
    ``"structured"`` method among channels along its ``dim`` that are not entirely zero, and a ``"global"``
    method sees the whole tensor.

    Example:
        >>> from lightprune import prune
        >>> layer = torch.nn.Linear(10, 1)
        >>> _ = prune.l1_unstructured(layer, "weight", amount=0.5)
        >>> container = prune.l1_unstructured(layer, "weight", amount=0.4)._forward_pre_hooks
        >>> hook = next(iter(container.values()))
        >>> len(hook), int((layer.weight == 0).sum())  # 5 entries, then 40% of the 5 left
        (2, 7)
    """

    def __init__(self, *args: BasePruningMethod) -> None:
        self._pruning_methods: tuple[BasePruningMethod, ...] = ()
        if len(args) == 1 and not isinstance(args[0], BasePruningMethod) and hasattr(args[0], "__iter__"):
            args = tuple(args[0])
        if args:
            first = args[0]
            if not isinstance(first, BasePruningMethod):
                raise TypeError(f"{type(first).__name__} is not a BasePruningMethod subclass")
            self._tensor_name = first._tensor_name
        for method in args:
            self.add_pruning_method(method)

    def add_pruning_method(self, method: BasePruningMethod | None) -> None:
        """Append ``method``; it must act on the same tensor name as the container.

        ``None`` is ignored, as in torch. An empty container without a tensor name takes ``method``'s (torch's
        empty container has no name at all and fails here).

        Raises:
            TypeError: ``method`` is not a pruning method.
            ValueError: ``method`` acts on another tensor.
        """
        if method is None:
            return
        if not isinstance(method, BasePruningMethod):
            raise TypeError(f"{type(method).__name__} is not a BasePruningMethod subclass")
        if not self._pruning_methods and self._tensor_name is None:
            self._tensor_name = method._tensor_name
        if self._tensor_name != method._tensor_name:
            raise ValueError(
                f"PruningContainer holds methods for the tensor named {self._tensor_name!r}; "
                f"cannot add a method for {method._tensor_name!r}"
            )
        self._pruning_methods = (*self._pruning_methods, method)

    def __len__(self) -> int:
        return len(self._pruning_methods)

    def __iter__(self) -> Iterator[BasePruningMethod]:
        return iter(self._pruning_methods)

    def __getitem__(self, idx: int | slice) -> Any:
        return self._pruning_methods[idx]

    def compute_mask(self, t: Tensor, default_mask: Tensor) -> Tensor:
        """Apply the newest method to what ``default_mask`` still keeps and return the combined mask.

        The result has ``t``'s dtype, as torch's container returns, whatever ``default_mask``'s dtype; a
        ``torch.bool`` ``default_mask`` (a mask stored as bool, see :func:`mask_dtype`) gives a ``torch.bool``
        result instead, so bool masks stay bool.

        Example:
            >>> from lightprune import prune
            >>> container = prune.PruningContainer(prune.L1Unstructured(amount=1))
            >>> container.compute_mask(torch.tensor([3.0, -1.0, 2.0]), torch.tensor([1, 1, 0]))
            tensor([1., 0., 0.])
            >>> container.compute_mask(torch.tensor([3.0, -1.0, 2.0]), torch.tensor([True, True, False]))
            tensor([ True, False, False])
        """
        if not self._pruning_methods:
            raise ValueError("PruningContainer is empty: add a pruning method before computing a mask")
        dtype = torch.bool if default_mask.dtype == torch.bool else t.dtype
        return next_mask(self._pruning_methods[-1], t, default_mask, dtype)

    def __repr__(self) -> str:
        return f"PruningContainer({', '.join(repr(m) for m in self._pruning_methods)})"


def _defining_class(cls: type, attribute: str) -> type | None:
    return next((klass for klass in cls.__mro__ if attribute in klass.__dict__), None)


def _has_fast_path(method: BasePruningMethod) -> bool:
    """True while ``method.compute_mask`` is still the function written next to its class's ``_next_mask``.

    ``_next_mask`` computes what ``compute_mask`` would, faster, so it may only stand in for the original: a
    subclass overriding ``compute_mask``, a ``unittest.mock.patch`` of the class attribute, a monkey-patched
    function (``L1Unstructured.compute_mask = f``) or one set on the instance all turn the fast path off, and the
    method is then called the way torch calls it.
    """
    if "compute_mask" in getattr(method, "__dict__", {}):
        return False
    cls = type(method)
    owner = _defining_class(cls, "_next_mask")
    if owner is None or owner not in _OWN_COMPUTE_MASK:
        return False
    return _defining_class(cls, "compute_mask") is owner and owner.__dict__["compute_mask"] is _OWN_COMPUTE_MASK[owner]


def _ranks_current_values(method: BasePruningMethod) -> bool:
    """True if ``method``'s mask on a pruned tensor depends on the values of the entries already pruned."""
    return not _has_fast_path(method) or getattr(method, "_ranks_pruned_entries", False)


def next_mask(
    method: BasePruningMethod,
    scores: Tensor,
    current: Tensor | None,
    dtype: torch.dtype,
    first_default_dtype: torch.dtype | None = None,
) -> Tensor:
    """Mask after applying ``method`` on top of ``current`` (``None``: nothing pruned yet), in ``dtype``.

    Built-in methods compute it directly, in O(n) and without boolean indexing. Any other method is called the way
    torch calls it: on a fresh tensor ``compute_mask(scores, ones)`` with the ones in ``first_default_dtype`` (torch
    uses the parameter's dtype, whatever the scores' and the mask dtype setting), then as torch's container does,
    ``compute_mask`` on the slice of ``scores`` that ``current`` still keeps (a bool ``current`` is shown to the
    method in ``first_default_dtype``).
    """
    with torch.no_grad():
        scores = scores.detach()
        if _has_fast_path(method):
            mask = method._next_mask(scores, current, dtype)  # type: ignore[attr-defined]
        elif current is None:
            ones = torch.ones(scores.shape, dtype=first_default_dtype or scores.dtype, device=scores.device)
            mask = method.compute_mask(scores, default_mask=ones)
        else:
            mask = _combine_like_torch(method, scores, current, first_default_dtype)
        return _to_mask_dtype(mask, dtype)


def _combine_like_torch(
    method: BasePruningMethod, t: Tensor, mask: Tensor, view_dtype: torch.dtype | None = None
) -> Tensor:
    """Torch's container semantics for a method without a fast path: slice, compute, scatter back.

    As in torch, the part to act on is found from ``mask`` itself, the method sees the slice of ``mask`` as its
    ``default_mask`` and the result is assembled in ``t``'s dtype. A ``torch.bool`` mask is shown to the method in
    ``view_dtype`` (the parameter's dtype, the mask torch would have stored) when given.
    """
    if mask.dtype == torch.bool and view_dtype is not None and view_dtype != torch.bool:
        mask = mask.to(view_dtype)
    kind = getattr(method, "PRUNING_TYPE", None)
    if kind == "unstructured":
        region: Any = mask == 1
    elif kind == "structured":
        if not hasattr(method, "dim"):
            raise AttributeError('pruning methods of PRUNING_TYPE "structured" need an attribute `dim`')
        from lightprune.prune.amount import normalize_dim

        dim = normalize_dim(t, method.dim)
        other = [d for d in range(t.dim()) if d != dim]
        region = [slice(None)] * t.dim()
        region[dim] = mask.sum(dim=other) != 0
        region = tuple(region)
    elif kind == "global":
        region = tuple(slice(None) for _ in range(t.dim()))
    else:
        raise ValueError(f"unrecognized PRUNING_TYPE {kind!r}: allowed are 'unstructured', 'structured', 'global'")
    new_mask = mask.to(dtype=t.dtype, copy=True)
    partial = method.compute_mask(t[region], default_mask=mask[region])
    new_mask[region] = partial.to(dtype=new_mask.dtype)
    return new_mask


def _to_mask_dtype(mask: Tensor, dtype: torch.dtype) -> Tensor:
    if mask.dtype == dtype:
        return mask
    if dtype == torch.bool:
        if ((mask != 0) & (mask != 1)).any():
            raise ValueError(
                "the mask holds values other than 0 and 1, which a torch.bool mask cannot store; "
                "use a floating mask dtype (prune.set_mask_dtype(None)) for fractional masks"
            )
        return mask != 0
    return mask.to(dtype=dtype)


def _check_same_shape(scores: Tensor, t: Tensor, scores_label: str, t_label: str) -> None:
    if not isinstance(scores, Tensor):
        raise TypeError(f"{scores_label} must be a Tensor, got {type(scores).__name__}")
    if scores.shape != t.shape:
        raise ValueError(
            f"{scores_label} must have the shape of {t_label}: got {tuple(scores.shape)} vs {tuple(t.shape)}"
        )


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
    """The tensor to prune: ``name_orig`` if ``name`` is already pruned, else the Parameter ``name``."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a str naming a parameter, got {name!r} ({type(name).__name__})")
    if hook is not None:
        return module._parameters[name + "_orig"]
    if name in module._parameters and module._parameters[name] is not None:
        return module._parameters[name]
    params = ", ".join(repr(p) for p, v in module._parameters.items() if v is not None) or "none"
    if hasattr(module, name) and isinstance(getattr(module, name), Tensor):
        raise TypeError(
            f"{name!r} of {type(module).__name__} is a tensor but not a Parameter; only parameters can be pruned "
            f"(its parameters: {params})"
        )
    raise AttributeError(f"{type(module).__name__} has no parameter {name!r}; its parameters are: {params}")


def refresh_pruned(module: nn.Module) -> None:
    """Recompute ``module.<name>`` for every tensor of ``module`` under a lightprune hook."""
    for _, hook in pruning_hooks(module):
        name = hook._tensor_name
        if name is not None and name + "_orig" in module._parameters and name + "_mask" in module._buffers:
            hook(module, ())


class _RefreshingApply:
    """Installed as ``module._apply`` on pruned modules: after a conversion, recompute the pruned attributes.

    ``Module.to()``, ``.half()``, ``.double()``, ``.cuda()``... convert parameters and buffers through ``_apply``
    but know nothing of the plain attribute holding ``orig * mask``, which torch leaves stale until the next
    forward. This wrapper runs the class's own ``_apply`` and then recomputes every pruned attribute.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, fn: Any, *args: Any, **kwargs: Any) -> nn.Module:
        result = type(self.module)._apply(self.module, fn, *args, **kwargs)
        refresh_pruned(self.module)
        return result


def _refresh_after_load(module: nn.Module, incompatible_keys: Any) -> None:
    """``load_state_dict`` post-hook: the loaded ``orig`` and ``mask`` make the pruned attribute stale."""
    refresh_pruned(module)


def install_refresh(module: nn.Module) -> None:
    """Keep ``module``'s pruned attributes current across conversions (``.to()``...) and ``load_state_dict``."""
    if not isinstance(module.__dict__.get("_apply"), _RefreshingApply):
        module.__dict__["_apply"] = _RefreshingApply(module)
    if _refresh_after_load not in module._load_state_dict_post_hooks.values():
        module.register_load_state_dict_post_hook(_refresh_after_load)


def uninstall_refresh_if_unpruned(module: nn.Module) -> None:
    if any(True for _ in pruning_hooks(module)):
        return
    if isinstance(module.__dict__.get("_apply"), _RefreshingApply):
        del module.__dict__["_apply"]
    for key in [k for k, h in module._load_state_dict_post_hooks.items() if h is _refresh_after_load]:
        del module._load_state_dict_post_hooks[key]


def move_key(table: dict[str, Any], key: str, position: int) -> None:
    """Move ``key`` of an insertion-ordered dict to ``position``, in place (the dict object is kept)."""
    items = [(k, v) for k, v in table.items() if k != key]
    items.insert(position, (key, table[key]))
    table.clear()
    table.update(items)


@dataclass
class ModuleSnapshot:
    """What attaching a mask may change on one module, saved so that a failure can restore it exactly."""

    module: nn.Module
    parameters: dict[str, Any] = field(default_factory=dict)
    buffers: dict[str, Any] = field(default_factory=dict)
    non_persistent: set[str] = field(default_factory=set)
    hooks: dict[int, Any] = field(default_factory=dict)
    load_hooks: dict[int, Any] = field(default_factory=dict)
    attributes: dict[str, Any] = field(default_factory=dict)
    containers: list[tuple[PruningContainer, tuple[BasePruningMethod, ...]]] = field(default_factory=list)
    # RNNs keep their weights in the list ``_flat_weights`` too, updated by their ``__setattr__``
    flat_weights: tuple[list[Any], list[Any]] | None = None

    @classmethod
    def take(cls, module: nn.Module, name: str) -> ModuleSnapshot:
        flat = module.__dict__.get("_flat_weights")
        return cls(
            module=module,
            parameters=dict(module._parameters),
            buffers=dict(module._buffers),
            non_persistent=set(module._non_persistent_buffers_set),
            hooks=dict(module._forward_pre_hooks),
            load_hooks=dict(module._load_state_dict_post_hooks),
            attributes={k: module.__dict__[k] for k in (name, "_apply") if k in module.__dict__},
            containers=[(h, h._pruning_methods) for _, h in pruning_hooks(module) if isinstance(h, PruningContainer)],
            flat_weights=(flat, list(flat)) if isinstance(flat, list) else None,
        )

    def restore(self, name: str) -> None:
        module = self.module
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
        for key in (name, "_apply"):
            module.__dict__.pop(key, None)
        module.__dict__.update(self.attributes)
        for container, methods in self.containers:
            container._pruning_methods = methods
        if self.flat_weights is not None:
            flat, contents = self.flat_weights
            flat[:] = contents
            module.__dict__["_flat_weights"] = flat


@dataclass
class Attachment:
    """A planned change: put ``mask`` on ``module.<name>`` under ``method``, combined with any existing hook."""

    module: nn.Module
    name: str
    method: BasePruningMethod
    orig: Tensor
    hook_key: int | None
    hook: BasePruningMethod | None
    mask: Tensor | None = None

    @classmethod
    def plan(cls, module: nn.Module, name: str, method: BasePruningMethod) -> Attachment:
        """Look up the tensor and its current hook; changes nothing."""
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        key, hook = find_hook(module, name)
        orig = original_parameter(module, name, hook)
        method._tensor_name = name
        return cls(module=module, name=name, method=method, orig=orig, hook_key=key, hook=hook)

    @property
    def current_mask(self) -> Tensor | None:
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
            return self.hook.apply_mask(self.module)

    def mask_dtype(self) -> torch.dtype:
        current = self.current_mask
        if current is not None:
            return current.dtype
        return _MASK_DTYPE if _MASK_DTYPE is not None else self.orig.dtype

    def commit(self) -> BasePruningMethod:
        """Register parameter, buffer, hook and attribute. Call through :func:`commit_all` for rollback."""
        module, name, mask = self.module, self.name, self.mask
        assert mask is not None, "compute the mask before committing"
        if mask.shape != self.orig.shape:
            raise ValueError(f"mask shape {tuple(mask.shape)} differs from {name!r}'s shape {tuple(self.orig.shape)}")
        if mask.device != self.orig.device:
            mask = mask.to(self.orig.device)
        if self.hook is None:
            position = list(module._parameters).index(name)
            module.register_parameter(name + "_orig", self.orig)
            del module._parameters[name]
            move_key(module._parameters, name + "_orig", position)
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


def commit_all(attachments: list[Attachment]) -> list[BasePruningMethod]:
    """Commit every attachment, or none: on any exception each module is restored exactly, then it re-raises."""
    snapshots = [ModuleSnapshot.take(a.module, a.name) for a in attachments]
    done = 0
    try:
        hooks = []
        for attachment in attachments:
            hooks.append(attachment.commit())
            done += 1
        return hooks
    except BaseException:
        for attachment, snapshot in reversed(list(zip(attachments[: done + 1], snapshots[: done + 1], strict=True))):
            snapshot.restore(attachment.name)
        raise


def attach(
    module: nn.Module, name: str, method: BasePruningMethod, *, importance_scores: Tensor | None = None
) -> BasePruningMethod:
    """Prune ``module.<name>`` with ``method`` (on top of any existing pruning) and return the attached hook."""
    if importance_scores is not None and isinstance(name, str):
        # torch checks the scores' shape first: keep its order of errors (e.g. for a buffer's name)
        target = getattr(module, name, None)
        if isinstance(target, Tensor):
            _check_same_shape(importance_scores, target, "importance_scores", f"parameter {name!r}")
    attachment = Attachment.plan(module, name, method)
    scores = attachment.default_scores(method) if importance_scores is None else importance_scores
    _check_same_shape(scores, attachment.orig, "importance_scores", f"parameter {name!r}")
    scores = scores.to(attachment.orig.device)  # scores elsewhere (CPU scores for a CUDA weight) work on every call
    attachment.mask = next_mask(
        method, scores, attachment.current_mask, attachment.mask_dtype(), first_default_dtype=attachment.orig.dtype
    )
    return commit_all([attachment])[0]
