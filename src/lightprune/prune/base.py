"""The pruning methods: ``BasePruningMethod``, ``PruningContainer`` and the rules that combine a new mask with the old.

The contract is torch.nn.utils.prune's, so checkpoints and code move between the two: pruning parameter ``name``
of a module renames the Parameter to ``name_orig`` (the same object, so optimizers keep working), registers the
mask as buffer ``name_mask``, stores ``name_orig * name_mask`` as the plain attribute ``name`` and registers the
method object as a forward pre-hook that recomputes that attribute before every forward. A second method on the
same tensor is combined with the first through a ``PruningContainer``. How the mask is attached to a module, kept
current and rolled back on failure lives in :mod:`lightprune.prune._reparam`.

What differs from torch is behind that contract:

* nothing on the module changes until the new mask has been computed, and a failure while attaching it restores
  the module exactly (parameters, buffers, hooks, attributes), for the first call and every later one;
* a later call replaces the hook in place, so the order of the module's other forward pre-hooks is kept, and
  ``name_orig`` takes ``name``'s place among the parameters, so ``module.parameters()`` keeps its order (an optimizer
  created after pruning, e.g. when resuming from a checkpoint, lines up with the saved optimizer state);
* the pruned attribute survives ``copy.deepcopy`` and ``pickle`` (:class:`_PrunedTensor`, the type the hook writes),
  and is recomputed after ``.to()``, ``.half()``, ``.double()``, ``.cuda()``, every other conversion and
  ``load_state_dict``, so it is never stale;
* masks may be stored as ``torch.bool`` (1 byte an entry) instead of the parameter's dtype, see
  :func:`~lightprune.prune.mask_dtype`;
* the built-in methods select with an exact O(n) threshold pass (``k_smallest.py``) instead of ``topk`` or boolean
  indexing, so tensors of any size work and ties are broken by flat index.
"""

from __future__ import annotations

import functools
import weakref
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.utils.prune as torch_prune
from torch import Tensor, nn

from lightprune.prune.amount import NotATensorError, ShapeMismatchError
from lightprune.prune.masking import masked, masked_

__all__ = ["BasePruningMethod", "PruningContainer"]

_OWN_COMPUTE_MASK: dict[type, Any] = {}
"""Per class defining ``_next_mask``: the ``compute_mask`` function defined beside it (recorded at class creation)."""


def _deepcopy_detached(ref: weakref.ReferenceType[Tensor], memo: dict[int, Any]) -> Tensor:
    tensor = ref()
    assert tensor is not None  # (called as the tensor's own method: it is alive)
    copied = tensor.detach().clone()
    memo[id(tensor)] = copied
    return copied


def _reduce_detached(ref: weakref.ReferenceType[Tensor], protocol: Any) -> Any:
    tensor = ref()
    assert tensor is not None
    return tensor.detach().__reduce_ex__(protocol)


def _as_pruned(tensor: Tensor) -> Tensor:
    """``tensor`` (the pruned attribute ``orig * mask``), made to deep-copy and pickle as its detached values.

    The attribute keeps its autograd history (the gradient must reach ``orig``), and torch refuses to deep-copy such
    non-leaf tensors, which made ``copy.deepcopy`` of a pruned module fail (pytorch #37322). ``copy`` and ``pickle``
    look ``__deepcopy__`` / ``__reduce_ex__`` up on the object itself first, so the tensor gets its own (holding it
    weakly, so that the tensor does not keep itself alive): copies and pickles hold the detached values, and a copy's
    own hook recomputes the attribute before its next forward. A pickled or copied module does the same through its
    own ``__reduce_ex__`` (``_reparam._DetachedReduce``), which also reaches picklers that dispatch tensors by type
    (torch.multiprocessing's). The tensor stays a plain ``torch.Tensor``, so
    a compiled forward that reads it directly (``nn.MultiheadAttention``'s ``out_proj.weight``) takes it as any
    input (a Tensor subclass had failed there in AOT autograd: no dispatch for ``aten.t``).

    While a module is traced (``torch.export``, and so ONNX export, run it on fake or functional tensors) or
    compiled, the value is left as it is; ``copy.deepcopy`` of a module right after a compiled training step fails
    until its next eager forward, as torch's own pruning does always.
    """
    if type(tensor) is not Tensor or torch.compiler.is_compiling():
        return tensor
    ref = weakref.ref(tensor)
    tensor.__deepcopy__ = functools.partial(_deepcopy_detached, ref)  # type: ignore[method-assign]
    tensor.__reduce_ex__ = functools.partial(_reduce_detached, ref)  # type: ignore[method-assign]
    return tensor


def _stored_dtype(module: nn.Module, key: str, value: Any) -> torch.dtype:
    """The dtype of ``module.<key>``: read from the stored tensor while ``value`` is a ``torch.fx`` Proxy of it."""
    stored = module._parameters.get(key, module._buffers.get(key))
    if stored is None:
        raise TypeError(f"cannot trace the pruning hook: {key!r} is not a parameter or buffer of the module")
    return stored.dtype if isinstance(value, torch.fx.Proxy) else value.dtype


def _traced_mask(module: nn.Module, name: str, orig: Any, mask: Any) -> Any:
    """:meth:`BasePruningMethod.apply_mask` while ``torch.fx`` traces the module (``orig`` or ``mask`` a Proxy).

    A Proxy's dtype is itself a Proxy, which Python control flow cannot branch on; the dtypes are read from the
    stored tensors instead, and the graph records the same computation: ``torch.where`` for a boolean mask (what
    :func:`~lightprune.prune.masking.masked` computes), ``orig * mask`` in ``orig``'s dtype for a floating one.
    """
    orig_dtype = _stored_dtype(module, name + "_orig", orig)
    mask_dtype = _stored_dtype(module, name + "_mask", mask)
    if mask_dtype == torch.bool:
        return torch.where(mask, orig, orig.new_zeros(()))
    if mask_dtype != orig_dtype:
        mask = mask.to(dtype=orig_dtype)
    return orig * mask


def replaced_message(module: nn.Module, name: str) -> str:
    """Why a pruned ``module.<name>`` that became a Parameter again cannot be computed or un-pruned."""
    return (
        f"{type(module).__name__}.{name} is pruned, but a Parameter {name!r} replaced the pruned tensor afterwards "
        f"(torch.nn.utils.fusion's fuse_conv_bn_eval / fuse_linear_bn_eval do so on a pruned module): the pruning "
        f"would overwrite it with {name}_orig * {name}_mask. Make the pruning permanent first "
        f"(prune.remove(module, {name!r})), then replace or fuse"
    )


def plain_original(module: nn.Module, name: str, before: str) -> nn.Parameter:
    """``module``'s Parameter ``name_orig``, or a ``ValueError`` (nothing changed) where a parametrization moved it
    under ``module.parametrizations``: lightprune masks the Parameter itself, so ``before`` doing that, the user takes
    the parametrization off.

    Example:
        >>> layer = nn.Linear(2, 1)
        >>> layer.register_parameter("weight_orig", layer._parameters.pop("weight"))
        >>> plain_original(layer, "weight", "pruning again").shape
        torch.Size([1, 2])
    """
    if name + "_orig" not in module._parameters:
        raise ValueError(
            f"{name + '_orig'!r} of {type(module).__name__} is not a plain Parameter of the module (a "
            "torch.nn.utils.parametrize parametrization?); lightprune masks the Parameter itself: take it off "
            f"(parametrize.remove_parametrizations(module, {name + '_orig'!r})) before {before}; nothing was changed"
        )
    return module._parameters[name + "_orig"]


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
        name = self._attached_name()
        if name in module._parameters:
            raise RuntimeError(replaced_message(module, name))
        setattr(module, name, _as_pruned(self.apply_mask(module)))

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
        if isinstance(orig, torch.fx.Proxy) or isinstance(mask, torch.fx.Proxy):
            return _traced_mask(module, name, orig, mask)
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
                (``orig * mask`` once it is pruned, computed now; torch reads the attribute ``module.<name>``, which
                still holds the values of the last forward after an optimizer step).
        """
        from lightprune.prune._reparam import apply_method  # _reparam builds on this module's classes

        method = cls(*args, **kwargs)
        return apply_method(module, name, method, importance_scores=importance_scores)

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

    def remove(self, module: nn.Module, *, in_place: bool = False) -> None:
        """Make the pruning permanent: ``name`` becomes a plain Parameter again holding ``orig * mask``.

        The Parameter object is the one that was ``name_orig`` (its ``.data`` is replaced), so optimizers that hold
        it stay valid, and it takes back its place among the module's parameters. The caller (``prune.remove``)
        also removes the hook from the module. ``in_place=True`` zeroes ``orig``'s pruned entries in place
        (:func:`~lightprune.prune.masking.masked_`) instead of computing ``orig * mask`` into a new weight-sized
        tensor.
        """
        from lightprune.prune._reparam import _move_key  # _reparam builds on this module's classes

        name = self._attached_name()
        orig = plain_original(module, name, f"removing the pruning of {name!r}")
        with torch.no_grad():
            if in_place:
                masked_(orig, module._buffers[name + "_mask"])
            else:
                orig.data = self.apply_mask(module)
        position = list(module._parameters).index(name + "_orig")
        module.__dict__.pop(name, None)
        del module._parameters[name + "_orig"]
        del module._buffers[name + "_mask"]
        setattr(module, name, orig)
        _move_key(module._parameters, name, position)

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
        ``torch.bool`` ``default_mask`` (a mask stored as bool, see :func:`~lightprune.prune.mask_dtype`) gives a
        ``torch.bool`` result instead, so bool masks stay bool.

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


# Code written against torch's class (torch.nn.utils.prune.is_pruned and remove, Lightning's ModelPruning, a user's
# isinstance check) sees lightprune's hooks as pruning hooks: the contract above is torch's.
torch_prune.BasePruningMethod.register(BasePruningMethod)  # type: ignore[type-abstract]


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
        if scores.is_meta:  # a skeleton (built on "meta", then to_empty and a pruned state_dict): no values to rank
            return torch.empty(scores.shape, dtype=dtype, device="meta")
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
        raise NotATensorError(f"{scores_label} must be a Tensor, got {type(scores).__name__}")
    if scores.shape != t.shape:
        raise ShapeMismatchError(
            f"{scores_label} must have the shape of {t_label}: got {tuple(scores.shape)} vs {tuple(t.shape)}"
        )
