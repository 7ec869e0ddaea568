"""An OBS event: how many entries each selected layer prunes, then SparseGPT's update of every layer's kept weights.

The counts follow the callback's scopes, as the other criteria's events do, so the target is met to the unit:

* ``"layerwise"``: ``round(target * entries) - pruned`` more per layer;
* ``"row"``: every output row (a row of the weight as OBS sees it, :func:`~lightprune.prune.obs.as_matrix`: for
  transformers' ``Conv1D`` a column of the stored ``(in, out)`` tensor) up to ``round(target * row length)``;
* ``"global"``: one ranking of the saliencies ``w**2 / d**2`` before any update across the selection chooses how
  many entries each layer loses (saliencies measure the squared change of the layer's output on its calibration
  inputs, so they compare across layers); each layer then chooses which, block by block, as SparseGPT does;
* N:M (``semi_structured``): every layer gets the pattern.

Every ``H`` is checked (finite, positive definite after dampening: one more Cholesky factorization per layer) before
any weight changes, so a refused layer leaves the event undone; the masks roll back with the event's transaction.
The optimizer's state (Adam's moments) is kept as it is for the updated weights: the update is a small correction of
weights training already reached, and the pruned entries' gradients are masked from then on.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from lightprune import prune
from lightprune.prune.k_smallest import select_smallest
from lightprune.prune.obs import as_matrix, check_hessian, layer_saliency, obs_layer

__all__ = ["blocks", "obs_counts", "reconstruct", "reconstruct_sharded"]

Triples = list[tuple[str, nn.Module, str]]
Masks = Callable[[nn.Module, str], Tensor | None]


def obs_counts(
    triples: Triples, masks: Masks, target: float, scope: str, hessian_of: Callable[[str], Tensor]
) -> dict[str, int | Tensor]:
    """How many more entries each layer prunes to reach ``target`` (``scope`` as the callback's; ``"row"``: a
    tensor with one count per output row).

    Example:
        >>> layer = nn.Linear(4, 2)
        >>> obs_counts([("fc.weight", layer, "weight")], lambda m, n: None, 0.5, "layerwise", lambda q: torch.eye(4))
        {'fc.weight': 4}
    """
    counts: dict[str, int | Tensor] = {}
    if scope == "global":
        scores, eligible = [], []
        for qualified, module, name in triples:
            scores.append(layer_saliency(module, name, hessian_of(qualified)))
            mask = masks(module, name)
            eligible.append(None if mask is None else mask != 0)
        total = sum(s.numel() for s in scores)
        pruned = sum(0 if e is None else e.numel() - int(e.sum()) for e in eligible)
        k = max(round(target * total) - pruned, 0)
        chosen = select_smallest(scores, k, eligible=eligible) if k else [torch.zeros(0)] * len(scores)
        return {qualified: int(c.sum()) for (qualified, _, _), c in zip(triples, chosen, strict=True)}
    for qualified, module, name in triples:
        weight = prune.original(module, name)
        mask = masks(module, name)
        if scope == "row":
            keep = as_matrix(module, torch.ones_like(weight, dtype=torch.bool) if mask is None else mask != 0)
            length = keep.shape[1]
            counts[qualified] = (round(target * length) - (length - keep.sum(dim=1))).clamp(min=0)
        else:
            pruned = 0 if mask is None else weight.numel() - int(torch.count_nonzero(mask))
            counts[qualified] = max(round(target * weight.numel()) - pruned, 0)
    return counts


def reconstruct(
    triples: Triples,
    masks: Masks,
    target: float,
    scope: str,
    hessian_of: Callable[[str], Tensor],
    *,
    n_m: tuple[int, int] | None = None,
    mask_dtype: torch.dtype | None = None,
) -> None:
    """Prune ``triples`` to ``target`` by OBS with the SparseGPT update (``n_m``: the N:M pattern instead).

    Example:
        >>> layer = nn.Linear(8, 2)
        >>> reconstruct([("fc.weight", layer, "weight")], lambda m, n: None, 0.5, "row", lambda q: torch.eye(8))
        >>> (layer.weight == 0).sum(dim=1).tolist()
        [4, 4]
    """
    for qualified, module, name in triples:  # all refusals before any weight moves
        check_hessian(hessian_of(qualified), qualified)
        if not bool(torch.isfinite(prune.original(module, name)).all()):
            raise ValueError(f"OBS pruning of {qualified}: the weight holds NaN or inf; it cannot be reconstructed")
    if n_m is not None:
        for qualified, module, name in triples:
            obs_layer(module, name, hessian_of(qualified), n=n_m[0], m=n_m[1], layer=qualified, mask_dtype=mask_dtype)
        return
    counts = obs_counts(triples, masks, target, scope, hessian_of)
    for qualified, module, name in triples:
        count = counts[qualified]
        if not bool(torch.as_tensor(count).any()):
            continue  # nothing to prune: the weights stay as training left them
        obs_layer(
            module, name, hessian_of(qualified), counts=count, per_row=scope == "row", layer=qualified,
            mask_dtype=mask_dtype,
        )  # fmt: skip


def reconstruct_sharded(
    triples: Triples,
    masks: Masks,
    target: float,
    scope: str,
    hessian_of: Callable[[str], Tensor],
    put: Callable[[nn.Module, str, Tensor], None],
    *,
    n_m: tuple[int, int] | None = None,
    group: object = None,
) -> None:
    """:func:`reconstruct` on weights sharded by rows (:mod:`lightprune.prune.distributed_obs`), called on every rank
    alike: each rank updates its own rows in place and hands each layer's new local mask to ``put(module, name,
    mask)``. Every ``H`` is checked before any weight changes.

    Example:
        >>> layer, kept = nn.Linear(8, 2), {}
        >>> reconstruct_sharded([("fc.weight", layer, "weight")], lambda m, n: None, 0.5, "row",
        ...                     lambda q: torch.eye(8), lambda m, n, mask: kept.update(fc=mask))
        >>> (~kept["fc"]).sum(dim=1).tolist(), (layer.weight == 0).sum(dim=1).tolist()
        ([4, 4], [4, 4])
    """
    from lightprune.prune.distributed import local_of
    from lightprune.prune.distributed_obs import sharded_obs_counts, sharded_sparsegpt

    for qualified, _, _ in triples:  # all refusals before any weight moves
        check_hessian(hessian_of(qualified), qualified)
    counts = None if n_m is not None else sharded_obs_counts(triples, masks, target, scope, hessian_of, group)
    for qualified, module, name in triples:
        count = None if counts is None else counts[qualified]
        if isinstance(count, int) and count == 0:
            continue  # (the same on every rank; per-row counts are local, so every rank takes part whatever they say)
        weight, keep = sharded_sparsegpt(
            module, name, hessian_of(qualified), masks(module, name), counts=count, per_row=scope == "row",
            n=None if n_m is None else n_m[0], m=None if n_m is None else n_m[1], layer=qualified, group=group,
        )  # fmt: skip
        local = local_of(prune.original(module, name))
        prune.before_write_in_place(local)  # the event's transaction puts the weights back if it is undone
        with torch.no_grad():  # (zero where pruned: the weights are masked in place)
            local.copy_(weight)
        put(module, name, keep)


def blocks(names: list[str]) -> list[list[str]]:
    """The selected tensors grouped by block for sequential calibration, in selection order: a name's block is its
    path up to its first numeric part (``encoder.layer.3.attention.self.query.weight`` -> ``encoder.layer.3``);
    a name without one is a block of its own.

    Example:
        >>> blocks(["h.0.attn.c_attn.weight", "h.0.mlp.c_fc.weight", "h.1.attn.c_attn.weight", "lm_head.weight"])
        [['h.0.attn.c_attn.weight', 'h.0.mlp.c_fc.weight'], ['h.1.attn.c_attn.weight'], ['lm_head.weight']]
    """
    groups: dict[str, list[str]] = {}
    for qualified in names:
        parts = qualified.split(".")
        numeric = next((i for i, part in enumerate(parts[:-1]) if part.isdigit()), None)
        key = qualified if numeric is None else ".".join(parts[: numeric + 1])
        groups.setdefault(key, []).append(qualified)
    return list(groups.values())
