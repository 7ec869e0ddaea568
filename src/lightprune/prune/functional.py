"""The functional forms: prune a module's parameter in one call, prune many globally, remove, is_pruned.

Every function here that changes modules is all or nothing, through :func:`lightprune.prune._reparam.transaction`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightprune.prune._reparam import (
    FROM_SETTING,
    _Attachment,
    _commit_all,
    apply_method,
    find_hook,
    pruning_hooks,
    transaction,
    uninstall_refresh_if_unpruned,
)
from lightprune.prune.amount import DeviceMismatchError, _compute_nparams_toprune, _validate_pruning_amount
from lightprune.prune.base import (
    BasePruningMethod,
    _check_same_shape,
    _has_fast_path,
    _to_mask_dtype,
    next_mask,
    replaced_message,
)
from lightprune.prune.collapse import cap_units, check_max_layer_sparsity, fill_under_caps, warn_collapsed
from lightprune.prune.k_smallest import apply_cut, count_eligible, find_cut, one_thread
from lightprune.prune.methods import (
    CustomFromMask,
    Identity,
    L1Unstructured,
    LnStructured,
    RandomStructured,
    RandomUnstructured,
    joint_uniform_draws,
)
from lightprune.prune.rowwise import RowwiseL1Unstructured
from lightprune.prune.semi_structured import SemiStructured

__all__ = [
    "apply_method",
    "custom_from_mask",
    "global_unstructured",
    "identity",
    "is_pruned",
    "l1_unstructured",
    "ln_structured",
    "prepare_for_state_dict",
    "random_structured",
    "random_unstructured",
    "remove",
    "rowwise_l1_unstructured",
    "semi_structured",
]


def identity(module: nn.Module, name: str) -> nn.Module:
    """Put ``module.<name>`` under the pruning reparametrization with an all-ones mask; returns ``module``.

    Example:
        >>> layer = identity(torch.nn.Linear(2, 1), "bias")
        >>> sorted(dict(layer.named_buffers()))
        ['bias_mask']
    """
    Identity.apply(module, name)
    return module


def random_unstructured(module: nn.Module, name: str, amount: int | float) -> nn.Module:
    """Prune ``amount`` entries of ``module.<name>`` chosen at random; returns ``module``.

    Args:
        module: the module owning the parameter.
        name: the parameter's name.
        amount: a float in [0, 1] (fraction of the entries still unpruned) or an int (how many).

    Example:
        >>> layer = random_unstructured(torch.nn.Linear(4, 5), "weight", amount=0.25)
        >>> int((layer.weight_mask == 0).sum())
        5
    """
    RandomUnstructured.apply(module, name, amount)
    return module


def l1_unstructured(
    module: nn.Module, name: str, amount: int | float, importance_scores: Tensor | None = None
) -> nn.Module:
    """Prune the ``amount`` entries of ``module.<name>`` with the smallest magnitude; returns ``module``.

    Args:
        module: the module owning the parameter.
        name: the parameter's name.
        amount: a float in [0, 1] (fraction of the entries still unpruned) or an int (how many).
        importance_scores: ranks entries instead of the parameter's values; same shape as the parameter.

    Example:
        >>> layer = torch.nn.Linear(3, 1, bias=False)
        >>> with torch.no_grad():
        ...     _ = layer.weight.copy_(torch.tensor([[0.5, -2.0, 0.1]]))
        >>> l1_unstructured(layer, "weight", amount=2).weight
        tensor([[ 0., -2.,  0.]], grad_fn=<MulBackward0>)
    """
    L1Unstructured.apply(module, name, amount=amount, importance_scores=importance_scores)
    return module


def rowwise_l1_unstructured(
    module: nn.Module, name: str, amount: int | float, importance_scores: Tensor | None = None, dim: int = 0
) -> nn.Module:
    """Prune ``amount`` of every row of ``module.<name>`` by the smallest magnitude; returns ``module``.

    Every row keeps the same count (Wanda's per-output ranking), see :class:`RowwiseL1Unstructured`.

    Args:
        module: the module owning the parameter.
        name: the parameter's name.
        amount: a float in [0, 1] (fraction of each row's unpruned entries) or an int (how many per row).
        importance_scores: ranks entries instead of the parameter's values; same shape as the parameter.
        dim: the dim rows are slices along: 0 (default) for ``(out, in, ...)`` weights, 1 for the output units of
            an ``(in, out)`` weight such as transformers' ``Conv1D`` (:func:`lightprune.layouts.row_dim`).

    Example:
        >>> layer = torch.nn.Linear(4, 2, bias=False)
        >>> with torch.no_grad():
        ...     _ = layer.weight.copy_(torch.tensor([[0.1, -3.0, 2.0, -0.5], [4.0, 1.0, 1.0, 5.0]]))
        >>> rowwise_l1_unstructured(layer, "weight", amount=0.5).weight_mask
        tensor([[0., 1., 1., 0.],
                [1., 0., 0., 1.]])
    """
    RowwiseL1Unstructured.apply(module, name, amount=amount, importance_scores=importance_scores, dim=dim)
    return module


def semi_structured(
    module: nn.Module,
    name: str,
    n: int = 2,
    m: int = 4,
    importance_scores: Tensor | None = None,
    dim: int = 1,
) -> nn.Module:
    """Give ``module.<name>`` an N:M pattern: the ``n`` largest ``|scores|`` of every ``m`` input entries stay.

    Groups run along the input dim (``dim=1``: Linear, Conv; ``dim=0`` for an ``(in, out)`` weight such as
    transformers' ``Conv1D``), see :class:`SemiStructured`.

    Args:
        module: the module owning the parameter.
        name: the parameter's name.
        n: entries kept per group.
        m: the group's size; must divide the input dim.
        importance_scores: ranks entries instead of the parameter's values; same shape as the parameter.
        dim: the input dim.

    Example:
        >>> layer = semi_structured(torch.nn.Linear(8, 3), "weight", n=2, m=4)
        >>> layer.weight_mask.view(3, 2, 4).sum(dim=-1)
        tensor([[2., 2.],
                [2., 2.],
                [2., 2.]])
    """
    SemiStructured.apply(module, name, n=n, m=m, dim=dim, importance_scores=importance_scores)
    return module


def random_structured(module: nn.Module, name: str, amount: int | float, dim: int) -> nn.Module:
    """Prune ``amount`` channels of ``module.<name>`` along ``dim``, chosen at random; returns ``module``.

    Example:
        >>> layer = random_structured(torch.nn.Conv2d(2, 4, 3), "weight", amount=0.5, dim=0)
        >>> int((layer.weight_mask.sum(dim=(1, 2, 3)) == 0).sum())
        2
    """
    RandomStructured.apply(module, name, amount, dim)
    return module


def ln_structured(
    module: nn.Module, name: str, amount: int | float, n: Any, dim: int, importance_scores: Tensor | None = None
) -> nn.Module:
    """Prune the ``amount`` channels of ``module.<name>`` along ``dim`` with the smallest Ln norm.

    Args:
        module: the module owning the parameter.
        name: the parameter's name.
        amount: a float in [0, 1] (fraction of the channels still present) or an int (how many).
        n: the norm's order, as ``p`` of ``torch.norm`` (int, float, ``inf``, ``-inf``, ``'fro'``, ``'nuc'``).
        dim: the dimension whose slices are the channels (0 for a layer's output channels).
        importance_scores: ranks channels instead of the parameter's values; same shape as the parameter.

    Example:
        >>> layer = torch.nn.Linear(2, 3, bias=False)
        >>> with torch.no_grad():
        ...     _ = layer.weight.copy_(torch.tensor([[1.0, 1.0], [3.0, 0.0], [0.1, 0.2]]))
        >>> ln_structured(layer, "weight", amount=1, n=2, dim=0).weight_mask
        tensor([[1., 1.],
                [1., 1.],
                [0., 0.]])
    """
    LnStructured.apply(module, name, amount, n, dim, importance_scores=importance_scores)
    return module


def custom_from_mask(module: nn.Module, name: str, mask: Tensor, *, mask_dtype: Any = FROM_SETTING) -> nn.Module:
    """Prune ``module.<name>`` with a given mask (zeros prune), on top of any existing pruning; returns ``module``.

    Args:
        module: the module owning the parameter.
        name: the parameter's name.
        mask: the mask, of the parameter's shape.
        mask_dtype: the stored mask's dtype if ``name`` is not pruned yet (``None``: the parameter's); by default the
            :func:`~lightprune.prune.mask_dtype` setting. ``mask.dtype`` keeps the given mask's own dtype.

    Example:
        >>> layer = custom_from_mask(torch.nn.Linear(3, 1), "bias", mask=torch.tensor([0.0]))
        >>> layer.bias_mask, float(layer.bias.detach().abs())
        (tensor([0.]), 0.0)
        >>> mask = torch.tensor([[True, False, True]])
        >>> custom_from_mask(layer, "weight", mask=mask, mask_dtype=mask.dtype).weight_mask
        tensor([[ True, False,  True]])
    """
    apply_method(module, name, CustomFromMask(mask=mask), mask_dtype=mask_dtype)
    return module


def global_unstructured(
    parameters: Iterable[tuple[nn.Module, str]],
    pruning_method: type[BasePruningMethod],
    importance_scores: dict[tuple[nn.Module, str], Tensor] | None = None,
    *,
    mask_dtype: Any = FROM_SETTING,
    max_layer_sparsity: float = 1.0,
    **kwargs: Any,
) -> None:
    """Prune many parameters with one ranking across all of them (e.g. the smallest 90% of all weights).

    ``pruning_method`` must be unstructured (``L1Unstructured``, ``RandomUnstructured`` or your own) and ``kwargs``
    its arguments; ``amount`` refers to all entries still unpruned across ``parameters``. Each parameter gets its
    own mask, attached as a ``CustomFromMask`` hook.

    The built-in methods never concatenate the parameters: the threshold is found with histogram passes over the
    tensors in chunks, so the extra memory is the new masks plus bounded temporaries, and every mask owns its
    memory (torch's hooks each keep a view of one flat mask of all parameters, pytorch #34257). The
    ``CustomFromMask`` hooks it attaches keep no mask (their ``mask`` is ``None``): the mask is the buffer
    ``<name>_mask``, so repeated global pruning never holds on to the masks of earlier steps.

    A Parameter registered on several modules (tied weights, e.g. an embedding and an output layer) may be given
    under each of its owners: it is ranked once, counted once, and every owner gets the same mask tensor, so every
    module computes with the same masked values (torch prunes each owner separately, from the same entries counted
    twice). Owners pruned apart before (each its own mask, e.g. by per-module calls) are ranked from the entries that
    all of their masks keep, so the shared mask never brings back an entry pruned through one of them. Its
    ``importance_scores`` may be given under any one owner (two different tensors for one Parameter are refused). A
    tied Parameter pruned through one owner only leaves the others computing with the dense tensor: give every
    owner.

    A global ranking may take every weight of a parameter whose values are small next to the others' (layer
    collapse: a collapsed output layer outputs its bias alone, whatever the input). The result is the ranking's, as
    torch's API promises, but a :class:`~lightprune.prune.collapse.LayerCollapseWarning` names every parameter this
    call left with no unpruned entry. ``max_layer_sparsity`` prevents it: no parameter ends with more than that
    share of its entries pruned (entries pruned before count), and the call still prunes exactly ``amount``, taking
    what a capped parameter cannot give from the parameters under their caps, in rank order.

    Args:
        parameters: ``(module, name)`` pairs.
        pruning_method: an unstructured ``BasePruningMethod`` subclass.
        importance_scores: optional ``{(module, name): scores}``; parameters not in it are ranked by their values.
        mask_dtype: the dtype of the masks of parameters not pruned yet (``None``: each parameter's); by default
            the :func:`~lightprune.prune.mask_dtype` setting. Pruned parameters keep their masks' dtypes.
        max_layer_sparsity: the largest share of any one parameter's entries that may end up pruned, in (0, 1]
            (1.0: no cap). Below 1, the method must be ``L1Unstructured`` or ``RandomUnstructured``.
        **kwargs: the method's arguments, e.g. ``amount=0.9``.

    Raises:
        TypeError: ``parameters`` is not iterable, ``importance_scores`` not a dict, or the method not unstructured.
        ValueError: a pair appears twice, scores have the wrong shape, ``amount`` is too large, or
            ``max_layer_sparsity`` is out of range, given with another method, or leaves fewer than ``amount``
            entries to prune. Nothing is changed then.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 10))
        >>> global_unstructured([(net[0], "weight"), (net[1], "weight")], L1Unstructured, amount=0.75)
        >>> sum(int((m.weight == 0).sum()) for m in net)
        150
        >>> wide, narrow = torch.nn.Linear(64, 20), torch.nn.Linear(20, 2)
        >>> with torch.no_grad():
        ...     _ = narrow.weight.mul_(0.01)  # small weights: an uncapped ranking would take all of them
        >>> global_unstructured([(wide, "weight"), (narrow, "weight")], L1Unstructured, amount=0.8,
        ...                     max_layer_sparsity=0.9)
        >>> int((narrow.weight == 0).sum()), int((wide.weight == 0).sum()) + int((narrow.weight == 0).sum())
        (36, 1056)
    """
    max_layer_sparsity = check_max_layer_sparsity(max_layer_sparsity)
    if isinstance(parameters, (str, bytes)) or not isinstance(parameters, Iterable):
        raise TypeError(
            f"global_unstructured(): parameters must be an iterable of (module, name) pairs, got {parameters!r}"
        )
    pairs = list(parameters)
    importance_scores = {} if importance_scores is None else importance_scores
    if not isinstance(importance_scores, dict):
        raise TypeError(
            f"global_unstructured(): importance_scores must be a dict {{(module, name): tensor}}, "
            f"got {type(importance_scores).__name__}"
        )
    method = pruning_method(**kwargs)
    if getattr(method, "PRUNING_TYPE", None) != "unstructured":
        raise TypeError(
            'global_unstructured() needs a pruning method of PRUNING_TYPE "unstructured"; '
            f"{getattr(pruning_method, '__name__', pruning_method)} is {getattr(method, 'PRUNING_TYPE', None)!r}"
        )
    fast = _has_fast_path(method) and isinstance(method, (L1Unstructured, RandomUnstructured))
    if max_layer_sparsity < 1 and not fast:
        raise ValueError(
            f"global_unstructured(): max_layer_sparsity={max_layer_sparsity} needs L1Unstructured or "
            f"RandomUnstructured; got {type(method).__name__}"
        )
    seen: set[tuple[int, str]] = set()
    attachments: list[_Attachment] = []
    for pair in pairs:
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):  # torch unpacks any pair: [module, name] too
            raise TypeError(f"global_unstructured(): each parameter must be a (module, name) pair, got {pair!r}")
        module, name = pair
        if (id(module), name) in seen:
            raise ValueError(f"global_unstructured(): ({type(module).__name__}, {name!r}) appears more than once")
        seen.add((id(module), name))
        attachments.append(_Attachment.plan(module, name, CustomFromMask(mask=torch.empty(0)), mask_dtype=mask_dtype))
    if not attachments:
        return
    _check_one_device(attachments)
    # a Parameter registered on several modules (tied weights) is ranked once and all its owners share one mask
    owners: dict[int, list[_Attachment]] = {}
    for attachment in attachments:
        owners.setdefault(id(attachment.orig), []).append(attachment)
    unique = [_tied_owners(group) for group in owners.values()]
    scores = []
    for attachment, group in zip(unique, owners.values(), strict=True):
        score = _tied_scores(group, importance_scores)
        if score is None:
            score = attachment.default_scores(method)
        _check_same_shape(score, attachment.orig, "importance_scores", f"parameter {attachment.name!r}")
        scores.append(score.detach().to(attachment.orig.device))

    with torch.no_grad():
        if fast and isinstance(method, (L1Unstructured, RandomUnstructured)):  # (the isinstance narrows for mypy)
            with one_thread(attachments[0].orig.device):  # thousands of chunk-sized operations: no fork-joins
                masks = _global_masks_fast(method, unique, scores, max_layer_sparsity)
        else:
            masks = _global_masks_like_torch(method, unique, scores)
        collapsed = _newly_collapsed(unique, masks, pairs)
    by_parameter = {id(attachment.orig): mask for attachment, mask in zip(unique, masks, strict=True)}
    for attachment in attachments:
        attachment.mask = by_parameter[id(attachment.orig)]
        attachment.method.mask = attachment.mask
    _commit_all(attachments)
    for attachment in attachments:
        # the mask lives on as the buffer <name>_mask; a copy held by the hook would outlive the buffer once a
        # later call or a conversion (.half(), .to()) replaces it, one more full mask per pruning step
        attachment.method.mask = None
    warn_collapsed(collapsed, "global_unstructured()")


def _check_one_device(attachments: list[_Attachment]) -> None:
    """Refuse parameters on several devices (naming the first on each), before anything changes."""
    first: dict[torch.device, str] = {}
    for index, a in enumerate(attachments):
        first.setdefault(a.orig.device, f"parameters[{index}] ({type(a.module).__name__}.{a.name}) on {a.orig.device}")
    if len(first) > 1:
        raise DeviceMismatchError(
            f"global_unstructured() ranks the tensors of one device, got {', '.join(first.values())}: move the "
            "model to one device first"
        )


def _tied_owners(group: list[_Attachment]) -> _Attachment:
    """The attachment that ranks a Parameter given under ``group``'s owners (one owner: itself).

    Owners pruned apart before (each its own mask, as per-module calls leave them) rank from what every one of them
    keeps, so no entry pruned through one owner comes back through the shared mask.
    """
    first = group[0]
    masks = [a.current_mask for a in group if a.current_mask is not None]
    if len(masks) > 1 and any(m is not masks[0] for m in masks[1:]):
        shared = masks[0].clone()
        for mask in masks[1:]:
            shared.mul_(mask.to(device=shared.device, dtype=shared.dtype))  # (a logical and for bool masks)
        first.shared_mask = shared
    elif masks and first.current_mask is None:
        first.shared_mask = masks[0]
    return first


def _tied_scores(group: list[_Attachment], importance_scores: dict[Any, Tensor]) -> Tensor | None:
    """The importance scores given for a Parameter under any of its owners' ``(module, name)``, or ``None``."""
    given = [(a, importance_scores[(a.module, a.name)]) for a in group if (a.module, a.name) in importance_scores]
    if not given:
        return None
    first, score = given[0]
    for other, another in given[1:]:
        if another is not score and not (another.shape == score.shape and torch.equal(another, score)):
            raise ValueError(
                "global_unstructured(): importance_scores differ for two owners of one tied Parameter "
                f"(({type(first.module).__name__}, {first.name!r}) and ({type(other.module).__name__}, "
                f"{other.name!r})); it is ranked once: give its scores under one owner"
            )
    return score


def _newly_collapsed(attachments: list[_Attachment], masks: list[Tensor], pairs: list[Any]) -> list[str]:
    """Names of the parameters whose new mask prunes every entry and whose current one did not."""
    collapsed = []
    for attachment, mask in zip(attachments, masks, strict=True):
        if mask.numel() == 0 or bool(mask.any()):
            continue
        current = attachment.current_mask
        if current is None or bool(current.any()):
            index = next(i for i, (m, n) in enumerate(pairs) if m is attachment.module and n == attachment.name)
            collapsed.append(
                f"parameters[{index}] ({type(attachment.module).__name__}.{attachment.name}, "
                f"shape {tuple(attachment.orig.shape)})"
            )
    return collapsed


def _global_masks_fast(
    method: L1Unstructured | RandomUnstructured,
    attachments: list[_Attachment],
    scores: list[Tensor],
    max_layer_sparsity: float = 1.0,
) -> list[Tensor]:
    """One exact threshold across all tensors, written into one new mask per tensor; with a cap below 1, the
    exact capped selection of :func:`~lightprune.prune.collapse.fill_under_caps` (one threshold per filled tensor
    and one for the rest)."""
    current = [a.current_mask for a in attachments]
    random = isinstance(method, RandomUnstructured)
    magnitude = not random and method._by_magnitude  # the signed variant of L1Unstructured ranks by value
    shapes = [a.orig for a in attachments] if random else scores  # the counts below read shapes only
    available = count_eligible(current, shapes)
    k = _compute_nparams_toprune(method.amount, available)
    _validate_pruning_amount(k, available)
    capped = max_layer_sparsity < 1
    if capped:
        left = [count_eligible([c], [s]) for c, s in zip(current, shapes, strict=True)]
        caps = [
            max(0, cap_units(max_layer_sparsity, s.numel()) - (s.numel() - n))
            for s, n in zip(shapes, left, strict=True)
        ]
        if k > sum(caps):
            raise ValueError(
                f"global_unstructured(): max_layer_sparsity={max_layer_sparsity} leaves {sum(caps)} of the "
                f"{available} unpruned entries prunable, fewer than the {k} asked for (amount={method.amount!r})"
            )
    if random:  # drawn once every check has passed, and only when something is pruned, as torch draws
        scores = (
            joint_uniform_draws([a.orig for a in attachments], current)
            if k
            else [torch.zeros(a.orig.shape, device=a.orig.device) for a in attachments]
        )
    # scores of several dtypes are compared as if promoted, one chunk at a time (k_smallest.py): no promoted copies
    masks = [torch.empty(a.orig.shape, dtype=a.mask_dtype(), device=a.orig.device) for a in attachments]
    if not capped:
        cut = find_cut(scores, k, eligible=current, magnitude=magnitude, largest=random)
        apply_cut(scores, cut, out=masks, eligible=current, base=current, magnitude=magnitude, largest=random)
        return masks

    def select(indices: list[int], n: int) -> list[int]:
        some = [scores[i] for i in indices]
        elig = [current[i] for i in indices]
        cut = find_cut(some, n, eligible=elig, magnitude=magnitude, largest=random)
        outs = [masks[i] for i in indices]
        apply_cut(some, cut, out=outs, eligible=elig, base=elig, magnitude=magnitude, largest=random)
        return [left[i] - count_eligible([masks[i]], [scores[i]]) for i in indices]

    fill_under_caps(caps, k, select)
    return masks


def _global_masks_like_torch(
    method: BasePruningMethod, attachments: list[_Attachment], scores: list[Tensor]
) -> list[Tensor]:
    """For a user's method: the method sees all scores as one vector, as in torch; each mask is then copied out."""
    flat_scores = torch.cat([s.reshape(-1) for s in scores])
    current = [a.current_mask for a in attachments]
    # torch concatenates the stored masks (ones for a fresh tensor), which are in the parameters' dtypes
    mask_dtype = attachments[0].orig.dtype
    for attachment in attachments[1:]:
        mask_dtype = torch.promote_types(mask_dtype, attachment.orig.dtype)
    flat_mask = torch.cat(
        [
            torch.ones(a.orig.numel(), dtype=mask_dtype, device=flat_scores.device)
            if m is None
            else m.reshape(-1).to(mask_dtype)
            for a, m in zip(attachments, current, strict=True)
        ]
    )
    method._tensor_name = "temp"
    flat_new = next_mask(method, flat_scores, flat_mask, flat_mask.dtype)
    masks, start = [], 0
    for attachment in attachments:
        count = attachment.orig.numel()
        piece = flat_new[start : start + count].reshape(attachment.orig.shape)
        masks.append(_to_mask_dtype(piece.clone(), attachment.mask_dtype()))
        start += count
    return masks


def remove(module: nn.Module, name: str) -> nn.Module:
    """Make the pruning of ``module.<name>`` permanent: a plain Parameter holding ``orig * mask``; returns ``module``.

    The Parameter object is the one that was ``name_orig``, so optimizers holding it stay valid.

    Raises:
        ValueError: ``module.<name>`` is not pruned.

    Example:
        >>> layer = l1_unstructured(torch.nn.Linear(4, 2), "weight", amount=0.5)
        >>> layer = remove(layer, "weight")
        >>> sorted(name for name, _ in layer.named_parameters()), int((layer.weight == 0).sum())
        (['bias', 'weight'], 4)
    """
    return _remove(module, name, in_place=False)


def remove_masked(module: nn.Module, name: str) -> nn.Module:
    """:func:`remove`, zeroing ``name_orig``'s pruned entries in place instead of computing ``orig * mask`` into a
    new weight-sized tensor (in-place masking taking a tensor back); returns ``module``.

    Raises:
        ValueError: ``module.<name>`` is not pruned.
    """
    return _remove(module, name, in_place=True)


def _remove(module: nn.Module, name: str, in_place: bool) -> nn.Module:
    key, hook = find_hook(module, name)
    if hook is None:
        raise ValueError(
            f"parameter {name!r} of {type(module).__name__} is not pruned, so its pruning cannot be removed; "
            f"pruned here: {[h._tensor_name for _, h in pruning_hooks(module)]}"
        )
    if name in module._parameters:  # replaced after pruning: un-pruning would write orig * mask over it
        raise ValueError(replaced_message(module, name))
    # all or nothing, as for pruning calls: an exception or a KeyboardInterrupt part-way through would leave a
    # plain Parameter next to a hook that still looks for <name>_orig (every forward then fails)
    with transaction([(module, name)]):
        if in_place and type(hook).remove is BasePruningMethod.remove:
            hook.remove(module, in_place=True)
        else:  # a method written for torch may override remove(self, module), torch's signature
            hook.remove(module)
        del module._forward_pre_hooks[key]
        uninstall_refresh_if_unpruned(module)
    return module


def prepare_for_state_dict(module: nn.Module, state_dict: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Make ``module``'s pruning reparametrization match ``state_dict``'s keys, so a strict load succeeds.

    A checkpoint of a pruned model has ``<p>_orig`` and ``<p>_mask`` where a fresh model has ``<p>``, and the reverse;
    neither loads into the other with torch alone. For every parameter ``p`` of every submodule:

    * ``state_dict`` has ``<p>_orig`` and ``<p>_mask`` but ``p`` is not pruned: ``p`` is put under the
      reparametrization with an all-ones mask of the checkpoint mask's dtype; loading then fills in both;
    * ``p`` is pruned here but ``state_dict`` has a plain ``<p>`` (and no ``<p>_orig``): the pruning is made
      permanent (:func:`remove`), so the plain value loads into the Parameter.

    Only a pair of ``_orig`` and ``_mask`` keys whose stem is a parameter counts: a buffer that merely ends in
    ``_mask`` (an attention mask) is never taken for a pruning mask. Parameter order is kept, so optimizer state
    saved with the checkpoint still lines up.

    Args:
        module: the model that will load ``state_dict``.
        state_dict: the state dict (or just its keys, mapped to tensors) about to be loaded.
        prefix: prefix of ``module``'s keys in ``state_dict``.

    Returns:
        The qualified names of the parameters whose reparametrization changed.

    Example:
        >>> pruned = l1_unstructured(torch.nn.Linear(4, 2), "weight", amount=0.5)
        >>> fresh = torch.nn.Linear(4, 2)
        >>> prepare_for_state_dict(fresh, pruned.state_dict())
        ['weight']
        >>> fresh.load_state_dict(pruned.state_dict())
        <All keys matched successfully>
        >>> torch.equal(fresh.weight, pruned.weight)
        True
    """
    plan = adaptation_plan(module, state_dict, prefix)
    problems = pair_problems(plan, state_dict)
    if problems:
        raise ValueError("the state_dict does not fit the model (nothing was changed):\n  " + "\n  ".join(problems))
    apply_adaptation(plan, state_dict)
    return [key for key, _, _, _ in plan]


def adaptation_plan(
    module: nn.Module, state_dict: Mapping[str, Any], prefix: str = ""
) -> list[tuple[str, nn.Module, str, str]]:
    """What :func:`prepare_for_state_dict` would change, as ``(key, submodule, name, action)``; changes nothing.

    ``action`` is ``"identity"`` (put ``name`` under the reparametrization) or ``"remove"`` (make it permanent).
    """
    plan = []
    for module_name, submodule in module.named_modules():
        base = f"{prefix}{module_name}." if module_name else prefix
        pruned_here = {hook._tensor_name: hook for _, hook in pruning_hooks(submodule)}
        for name in list(submodule._parameters):
            key = base + name
            if name in pruned_here or (name.endswith("_orig") and name[: -len("_orig")] in pruned_here):
                continue
            if submodule._parameters[name] is not None and key + "_orig" in state_dict and key + "_mask" in state_dict:
                plan.append((key, submodule, name, "identity"))
        for name in pruned_here:
            key = base + name
            if key in state_dict and key + "_orig" not in state_dict:
                plan.append((key, submodule, name, "remove"))
    return plan


def pair_problems(plan: list[tuple[str, nn.Module, str, str]], state_dict: Mapping[str, Any]) -> list[str]:
    """Why the ``<p>_orig``/``<p>_mask`` pairs the plan puts under the reparametrization cannot load, if they cannot."""
    problems = []
    for key, submodule, name, action in plan:
        if action != "identity":
            continue
        shape = tuple(submodule._parameters[name].shape)
        for suffix in ("_orig", "_mask"):
            value = state_dict[key + suffix]
            if not isinstance(value, Tensor):
                problems.append(f"{key}{suffix} is a {type(value).__name__}, not a tensor")
            elif tuple(value.shape) != shape:
                problems.append(f"{key}{suffix} has shape {tuple(value.shape)}, the parameter {key} has {shape}")
    return problems


def apply_adaptation(plan: list[tuple[str, nn.Module, str, str]], state_dict: Mapping[str, Any]) -> Callable[[], None]:
    """Carry out ``plan`` all or nothing; returns a function that undoes it (masks and values included)."""
    with transaction() as saved:
        for key, submodule, name, action in plan:
            saved.save(submodule, name)
            if action == "identity":
                saved_mask = state_dict[key + "_mask"]
                dtype = saved_mask.dtype if isinstance(saved_mask, Tensor) else None
                if dtype is not None and dtype != torch.bool and not dtype.is_floating_point:
                    dtype = None  # an integer mask (an integer parameter's): the parameter's dtype, as saved
                apply_method(submodule, name, Identity(), mask_dtype=dtype)
            else:
                remove(submodule, name)
    return saved.undo


def is_pruned(module: nn.Module) -> bool:
    """True if ``module`` or any submodule has a pruning hook (from lightprune or torch.nn.utils.prune).

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> is_pruned(net), is_pruned(identity(net[0], "weight")) and is_pruned(net)
        (False, True)
    """
    for submodule in module.modules():
        for hook in submodule._forward_pre_hooks.values():
            if isinstance(hook, BasePruningMethod) or _is_torch_pruning_hook(hook):
                return True
    return False


def _is_torch_pruning_hook(hook: Any) -> bool:
    torch_prune = getattr(getattr(torch.nn, "utils", None), "prune", None)
    base = getattr(torch_prune, "BasePruningMethod", None)
    return base is not None and isinstance(hook, base)
