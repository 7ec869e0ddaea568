"""The checks made when fit starts, on the tensors a callback selected: before any step, never mid-training."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn

from lightprune import prune, registry, rules
from lightprune._checks import is_int
from lightprune.callback.options import method_entry, raise_problems
from lightprune.metrics import TOTAL_KEY
from lightprune.prune.collapse import cap_units

__all__ = [
    "SMALL_SHARE",
    "check_adapters",
    "check_cap",
    "check_dims",
    "check_n_m_layout",
    "check_rows",
    "check_sharded",
    "find_ties",
    "refuse_masked_already",
    "refuse_overlaps",
    "refuse_reserved_names",
    "refuse_sharded_criteria",
    "refuse_strategy",
    "warn_small_share",
]

Selection = list[tuple[str, nn.Module, str]]

SMALL_SHARE = 0.5
"""Below this share of the model's weights (parameters of two or more dimensions), the default selection warns."""


def refuse_overlaps(selection: Selection, others: Iterable[Any], log_prefix: str) -> None:
    """Another PruningCallback (``others``, whose selection is made) prunes some of the same tensors, or logs to the
    same keys: refuse, naming them."""
    mine = {id(prune.original(module, name)) for _, module, name in selection}
    others = list(others)
    for other in others:
        shared = [q for q, module, name in other._masked.selection if id(prune.original(module, name)) in mine]
        if shared:
            raise ValueError(f"two PruningCallbacks select the same parameters {shared}: make them disjoint")
    for other in others:
        if other._log_prefix == log_prefix:
            raise ValueError(
                f"two PruningCallbacks would log to the same keys {log_prefix}...: give each a distinct name= (e.g. "
                "PruningCallback(..., name='encoder'))"
            )


def refuse_masked_already(selection: Selection, model: nn.Module, adopt: bool) -> None:
    """Selected tensors that carry a pruning mask when fit starts (pruned with :mod:`lightprune.prune`, or left
    reparametrized by a fit with ``make_permanent=False`` or one that raised), also through another module they are
    tied to: a fit's schedule starts from an unpruned model, so they are refused, naming them, unless ``adopt``
    (``adopt_zeros=True``: start from the masks already there).

    Example:
        >>> layer = prune.l1_unstructured(nn.Linear(4, 2), "weight", amount=0.5)
        >>> refuse_masked_already([("weight", layer, "weight")], layer, adopt=True)
        >>> refuse_masked_already([("weight", layer, "weight")], layer, adopt=False)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: PruningCallback: weight (50.0% masked) already carries a pruning mask ...
    """
    if adopt:
        return
    masked: dict[int, tuple[str, Tensor]] = {}  # id of a pruned tensor's original -> where it is masked, the mask
    for prefix, module in model.named_modules():
        for name in prune.pruned_names(module):
            mask = module._buffers[name + "_mask"]
            if mask is not None:
                masked[id(module._parameters[name + "_orig"])] = (f"{prefix}.{name}" if prefix else name, mask)
    found = []
    for qualified, module, name in selection:
        where = masked.get(id(prune.original(module, name)))
        if where is not None:
            tied = "" if where[0] == qualified else f", through {where[0]}"
            share = 1 - int(where[1].count_nonzero()) / max(where[1].numel(), 1)
            found.append(f"{qualified} ({share:.1%} masked{tied})")
    if not found:
        return
    raise ValueError(
        f"PruningCallback: {', '.join(found[:5])}{' and more' if len(found) > 5 else ''} already "
        f"{'carries a pruning mask' if len(found) == 1 else 'carry pruning masks'} "
        "(from lightprune.prune, or a fit left reparametrized by make_permanent=False or by an exception; resume "
        "such a fit with trainer.fit(..., ckpt_path=...)), and a fit's schedule starts from an unpruned model: pass "
        "adopt_zeros=True to start from these masks (they stay pruned; the targets of unstructured methods count "
        "them), or make them permanent first with prune.remove(module, name) (their zeros are then trained like any "
        "weight)"
    )


def refuse_reserved_names(selection: Selection, total_key: str = TOTAL_KEY) -> None:
    """Refuse a selected tensor named ``total_key`` (a Parameter ``total`` of the model itself): its sparsity would
    be logged under the total's key, and the first event would fail on the clash.

    Example:
        >>> refuse_reserved_names([("total", nn.Module(), "total")])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: the selected tensor 'total' would be logged under the key of the total sparsity ...
    """
    if any(qualified == total_key for qualified, _, _ in selection):
        raise ValueError(
            f"the selected tensor {total_key!r} would be logged under the key of the total sparsity "
            f"(pruning/sparsity/{total_key}): exclude it, or hold it in a submodule so that its name has a prefix"
        )


def refuse_strategy(strategy: Any) -> None:
    """Refuse, by ``isinstance`` and with the reason, the strategies under which masks cannot hold.

    DeepSpeed (a ``DDPStrategy`` subclass): ZeRO keeps the optimizer's own fp32 master weights and writes them back
    into the module after every step, and under stage 3 the module's parameters are empty partitions, so masks on
    the module's tensors are overwritten or meaningless. XLA: untested, and its lazy tensors would hold masks
    applied between steps unrun. ``FSDPStrategy`` (FSDP1) flattens the parameters into flat shards whose layout is
    not the tensors'. Subclasses of the tested strategies (``DDPStrategy``, ``ModelParallelStrategy``...) that users
    write to tweak them are accepted.

    Example:
        >>> from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
        >>> refuse_strategy(DDPStrategy())
        >>> refuse_strategy(object.__new__(DeepSpeedStrategy))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: PruningCallback does not support DeepSpeedStrategy: ZeRO keeps its own master weights ...
    """
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, SingleDeviceXLAStrategy, XLAStrategy

    refused = (
        (
            DeepSpeedStrategy,
            "ZeRO keeps its own master weights and writes them over the module's after every step (under stage 3 the "
            "module's parameters are empty partitions), so masks on the module's tensors would be overwritten; use "
            "DDPStrategy, or ModelParallelStrategy with fully_shard (FSDP2) in configure_model",
        ),
        (
            FSDPStrategy,
            "FSDP1 flattens the parameters into flat shards whose layout is not the tensors'; use "
            "ModelParallelStrategy with fully_shard (FSDP2) in configure_model, whose DTensor shards are pruned "
            "exactly",
        ),
        (
            (XLAStrategy, SingleDeviceXLAStrategy),
            "pruning has not been tested on XLA devices, where masks applied between steps act on lazy tensors; "
            "train on CPU or CUDA",
        ),
    )
    for kinds, why in refused:
        if isinstance(strategy, kinds):
            raise ValueError(f"PruningCallback does not support {type(strategy).__name__}: {why}")


def is_compiled(model: nn.Module) -> bool:
    """Whether ``model`` runs through ``torch.compile``: a LightningModule given to ``fit`` compiled (Lightning keeps
    the compiled forward in ``_compiler_ctx``), a compiled submodule (``OptimizedModule``), a module compiled in place
    (``nn.Module.compile()``), or a module given a compiled function as an attribute
    (``self.net.forward = torch.compile(self.net.forward)``).

    Example:
        >>> import torch
        >>> is_compiled(nn.Sequential(nn.Linear(2, 2))), is_compiled(nn.Sequential(torch.compile(nn.Linear(2, 2))))
        (False, True)
        >>> in_place = nn.Sequential(nn.Linear(2, 2))
        >>> in_place[0].compile()
        >>> is_compiled(in_place)
        True
    """
    from torch._dynamo.eval_frame import OptimizedModule

    if getattr(model, "_compiler_ctx", None):
        return True
    for module in model.modules():
        if isinstance(module, OptimizedModule) or getattr(module, "_compiled_call_impl", None) is not None:
            return True
        if any(hasattr(value, "_torchdynamo_orig_callable") for value in vars(module).values() if callable(value)):
            return True
    return False


def refuse_hooks_under_compile(model: nn.Module, features: Iterable[str]) -> None:
    """Refuse ``features`` (descriptions of options that attach hooks during training) on a compiled ``model``.

    Input statistics (activation, OBS, the units' refit, OWL) and RigL's dense gradients under the
    reparametrization are read by forward hooks attached while a window or an update lasts. torch.compile does not
    guard on a module's hooks (``torch._dynamo.config.skip_nnmodule_hook_guards``): a compiled forward never runs hooks
    added after it was compiled, so the statistics would be empty or partial and the gradients zero, silently.

    Example:
        >>> import torch
        >>> refuse_hooks_under_compile(nn.Linear(2, 2), ["importance='activation'"])
        >>> compiled = torch.compile(nn.Linear(2, 2))
        >>> refuse_hooks_under_compile(compiled, ["importance='activation'"])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: importance='activation' reads the model's forwards through hooks attached during training, ...
    """
    features = list(features)
    if not features or not is_compiled(model):
        return
    raise ValueError(
        f"{' and '.join(features)} reads the model's forwards through hooks attached during training, which a "
        "torch.compile'd model does not run (it does not recompile when hooks are added), so the statistics would "
        "be missing or partial: fit the model without torch.compile"
    )


def check_cap(max_layer_sparsity: float, scope: str, final: float, counts: list[tuple[int, int]] | None = None) -> None:
    """Refuse a ``max_layer_sparsity`` under which the schedule's ``final`` sparsity cannot be met, before any step.

    In ``"layerwise"`` and ``"row"`` scope every tensor is pruned to the target, so a cap below the final target is
    refused outright. In ``"global"``, ``"erk"`` and ``"owl"`` scope, with the selection's ``(units, pruned units)``
    ``counts``, the cap is refused when the capped tensors cannot hold the final count (tensors already pruned
    beyond the cap, e.g. by an earlier fit, keep what they have and count as full).

    Example:
        >>> check_cap(0.9, "global", 0.8, [(100, 0), (10, 0)])
        >>> check_cap(0.5, "global", 0.8, [(100, 0), (10, 0)])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: max_layer_sparsity=0.5 lets at most 55 of the selection's 110 units (50.00%) be pruned, fewer ...
    """
    if max_layer_sparsity >= 1:
        return
    raise_problems(rules.cap_problems(max_layer_sparsity, scope=scope, final_sparsity=final))
    if counts is None:
        return
    total = sum(units for units, _ in counts)
    need = round(final * total)
    reachable = sum(max(pruned, cap_units(max_layer_sparsity, units)) for units, pruned in counts)
    if need > reachable:
        raise ValueError(
            f"max_layer_sparsity={max_layer_sparsity} lets at most {reachable} of the selection's {total} units "
            f"({reachable / max(total, 1):.2%}) be pruned, fewer than the schedule's final sparsity {final} asks for "
            f"({need}): raise the cap or lower the target"
        )


def check_sharded(
    selection: Selection, strategy: Any, method: Any, rewind: Any, owners: Mapping[int, Selection] | None = None
) -> None:
    """Sharded parameters: what the callback supports, else a clear refusal naming what is not.

    Parameters sharded as DTensor (``ModelParallelStrategy``, FSDP2's ``fully_shard``) are pruned exactly with the
    built-in methods, masked in place on each rank's shard. Refused: DTensors under any other strategy (untested
    there, and their checkpoints would not carry the masks' shards), custom pruning methods, rewinding and tied
    weights of a sharded selection. (``FSDPStrategy`` is refused whatever the selection: :func:`refuse_strategy`.)
    """
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightprune.prune.distributed import is_sharded, placement_problem

    sharded = [qualified for qualified, module, name in selection if is_sharded(prune.original(module, name))]
    if not sharded:
        return
    if not isinstance(strategy, ModelParallelStrategy):
        raise ValueError(
            f"PruningCallback does not support parameters sharded as DTensor outside ModelParallelStrategy (got "
            f"{type(strategy).__name__}); sharded: {sharded[:5]}{' ...' if len(sharded) > 5 else ''}. Shard with "
            "ModelParallelStrategy and fully_shard in configure_model, or exclude them."
        )
    placed = [(q, placement_problem(prune.original(m, n))) for q, m, n in selection]
    placed = [(q, problem) for q, problem in placed if problem is not None]
    if placed:
        qualified, problem = placed[0]
        raise ValueError(
            f"PruningCallback cannot prune {qualified}: {problem}"
            f"{f' ({len(placed) - 1} more tensors alike)' if len(placed) > 1 else ''}. Tensor parallelism and 2-D "
            "meshes are not supported: exclude these tensors, or shard with fully_shard alone"
        )
    supported = [entry.load() for entry in registry.METHODS.values() if entry.sharded]
    if method not in supported:
        raise ValueError(
            f"PruningCallback prunes sharded (DTensor) parameters with the built-in methods "
            f"{[m.__name__ for m in supported]}; got {getattr(method, '__name__', method)} for {sharded[:3]}"
        )
    if rewind is not None:
        raise ValueError(
            f"PruningCallback does not rewind sharded (DTensor) parameters yet ({sharded[:3]} are sharded): leave "
            "rewind unset, or shard nothing"
        )
    ties = find_ties(selection, owners) if owners is not None else []
    if ties:
        module, name, others = ties[0]
        selected = next(q for q, m, n in selection if m is module and n == name)
        raise ValueError(
            f"PruningCallback does not support tied weights among sharded (DTensor) parameters: {selected} is also "
            f"{', '.join(q for q, _, _ in others)}; untie them, or exclude them"
        )


def refuse_sharded_units(model: nn.Module, units: str | None) -> None:
    """Unit methods (``"neurons"``, ``"heads"``) find their units by tracing the model, which a model sharded as
    DTensor cannot be: refused, naming a sharded parameter.

    Example:
        >>> refuse_sharded_units(nn.Linear(2, 2), "neurons")
    """
    from lightprune.prune.distributed import is_sharded

    if units is None:
        return
    sharded = [name for name, parameter in model.named_parameters() if is_sharded(parameter)]
    if sharded:
        raise ValueError(
            f"method={units!r} does not support models sharded as DTensor (FSDP2, ModelParallelStrategy), such as "
            f"{sharded[0]}: prune the units before sharding, or use an unstructured or Ln-structured method"
        )


def refuse_sharded_criteria(
    selection: Selection, importance: str, method: Any, scope: str = "layerwise", regrow: str | None = None
) -> None:
    """What parameters sharded as DTensor cannot be pruned with; refused, naming it and why.

    Magnitude, activation, movement and OBS importance, ``scope="row"`` and ``adopt_zeros`` work on sharded
    parameters (statistics all-reduced, or local: see :mod:`lightprune.callback.sharded` and
    :mod:`lightprune.prune.distributed_obs`). Refused: an importance callable (it would be handed a DTensor whose
    values live on several ranks); ``"obs"`` where a rank does not hold whole rows of the OBS matrix (a placement
    other than ``Shard(0)`` or ``Replicate()``, and transformers' ``Conv1D``, whose ``(in, out)`` weight is split
    along the columns SparseGPT's update walks in order); and N:M groups along an input dim that is sharded
    (transformers' ``Conv1D`` stores its weight ``(in, out)``: under ``Shard(0)`` a group of ``m`` inputs may span
    two ranks), and the same for ``scope="row"``, whose rows are the columns of such a weight. Per-layer allocation
    (``scope`` ``"erk"`` or ``"owl"``) and dynamic sparse training (``regrow``) would need their own distributed
    implementations and are refused too.

    Example:
        >>> refuse_sharded_criteria([("fc.weight", nn.Linear(2, 2), "weight")], "callable", None)  # not sharded
    """
    from lightprune.layouts import input_dim
    from lightprune.prune.distributed import is_sharded, local_piece

    sharded = [(q, module, name) for q, module, name in selection if is_sharded(prune.original(module, name))]
    if not sharded:
        return
    names = [q for q, _, _ in sharded]
    more = " ..." if len(names) > 3 else ""
    refused = [
        what
        for what, bad in ((f"scope={scope!r}", scope in ("erk", "owl")), (f"regrow={regrow!r}", regrow is not None))
        if bad
    ]
    if refused:
        raise ValueError(
            f"PruningCallback does not support {', '.join(refused)} for parameters sharded as DTensor ({names[:3]}"
            f"{more}): per-layer allocation and dynamic sparse training have no distributed implementation; use "
            "scope='global', 'layerwise' or 'row' without regrow, or exclude them"
        )
    if importance == "callable":
        raise ValueError(
            f"PruningCallback does not pass parameters sharded as DTensor ({names[:3]}{more})"
            " to an importance callable (their values live on several ranks): use 'magnitude', 'activation' or "
            "'movement', or exclude them"
        )
    if importance == "obs":
        from lightprune.prune.distributed_obs import sharded_obs_problem

        problems = [(q, sharded_obs_problem(module, name)) for q, module, name in sharded]
        problems = [(q, why) for q, why in problems if why is not None]
        if problems:
            raise ValueError(
                f"importance='obs' cannot prune {[q for q, _ in problems][:3]} as sharded: {problems[0][1]}; "
                "exclude them, or leave those modules unsharded"
            )
    if scope == "row":
        from lightprune.layouts import row_dim

        split = [
            q
            for q, module, name in sharded
            if row_dim(module, name) != 0 and not local_piece(prune.original(module, name)).replicated
        ]
        if split:
            raise ValueError(
                f"scope='row' ranks the output units along dim 1 of {split[:3]} ((in, out) weights), but FSDP2 "
                "shards dim 0 (Shard(0)): a row's entries span every rank; exclude them or leave those modules "
                "unsharded"
            )
    entry = method_entry(method) if isinstance(method, type) else None
    if entry is not None and entry.kind == "n:m":
        split = [
            q
            for q, module, name in sharded
            if input_dim(module) == 0 and not local_piece(prune.original(module, name)).replicated
        ]
        if split:
            raise ValueError(
                f"method={entry.name!r} groups inputs along dim 0 of {split[:3]}, the dim FSDP2 shards (Shard(0)): "
                "a group may span two ranks; exclude them or leave those modules unsharded"
            )


def check_adapters(selection: Selection, model: nn.Module, importance: str) -> dict[str, nn.Module]:
    """The adapted layers (LoRA) by the qualified name of their selected base weight; refuse, naming them, what the
    callback cannot prune with the update masked (see :func:`lightprune.adapters.adapter_problems`), movement
    importance of a frozen base weight, and sharded base weights.

    Example:
        >>> from lightprune.adapters import AdaptedWeight
        >>> net = nn.Sequential(AdaptedWeight(nn.Linear(4, 3), rank=2))
        >>> list(check_adapters([("0.base_layer.weight", net[0].base_layer, "weight")], net, "magnitude"))
        ['0.base_layer.weight']
    """
    from lightprune import adapters
    from lightprune.prune.distributed import is_sharded

    problems = adapters.adapter_problems(selection, model)
    if problems:
        raise ValueError("PruningCallback cannot mask these adapters' updates:\n  " + "\n  ".join(problems))
    layers = {id(adapters.base_of(layer)): layer for _, layer in adapters.adapted_layers(model)}
    adapted = {q: layers[id(m)] for q, m, n in selection if n == "weight" and id(m) in layers}
    if not adapted:
        return adapted
    if importance == "movement":
        raise ValueError(
            f"importance='movement' ranks by the weights' gradients, which the frozen base weights under adapters "
            f"{sorted(adapted)[:3]} do not have: use 'magnitude' or 'activation', or exclude them"
        )
    if importance == "obs":
        raise ValueError(
            f"importance='obs' ranks and rebuilds a layer's weight from its inputs, but the adapted layers "
            f"{sorted(adapted)[:3]} compute with W + s*B*A, of which OBS would see the base W alone: use 'magnitude' "
            "or 'activation', or exclude them"
        )
    sharded = [q for q, layer in adapted.items() if is_sharded(prune.original(adapters.base_of(layer), "weight"))]
    if sharded:
        raise ValueError(
            f"PruningCallback does not mask the adapters' updates of sharded (DTensor) weights {sharded[:3]}"
        )
    return adapted


def refuse_uninitialized(selection: Selection) -> None:
    """Refuse, naming them, selected tensors of lazy modules (``nn.LazyLinear``...) not yet materialized: the
    selection is made when fit starts, before any forward, and its counts need their shapes.

    Example:
        >>> refuse_uninitialized([("fc.weight", nn.LazyLinear(2), "weight")])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: ['fc.weight'] belong to lazy modules not yet initialized when fit starts: ...
    """
    lazy = [
        q
        for q, module, name in selection
        if isinstance(prune.original(module, name), nn.parameter.UninitializedParameter)
    ]
    if lazy:
        raise ValueError(
            f"{lazy[:3]} belong to lazy modules not yet initialized when fit starts: the selection needs their shapes; "
            "run one forward on an example input first (in LightningModule.setup or configure_model), or exclude them"
        )


def refuse_replaced(selection: Selection, model: nn.Module) -> None:
    """Refuse to prune when a selected layer is no longer the model's: one the module replaced after the callback
    selected it (in its own ``on_fit_start`` or ``on_train_start``, which run after the callback's) would stay dense
    while the masks and the summary counted it.

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 2))
        >>> selection = [("0.weight", net[0], "weight")]
        >>> refuse_replaced(selection, net)
        >>> net[0] = nn.Linear(2, 2)
        >>> refuse_replaced(selection, net)
        Traceback (most recent call last):
        ...
        RuntimeError: PruningCallback selected 0.weight of a Linear that is no longer the model's 0 ...
    """
    for qualified, module, _ in selection:
        path = qualified.rpartition(".")[0]
        try:
            found: nn.Module | None = model.get_submodule(path)
        except AttributeError:
            found = None
        if found is not module:
            raise RuntimeError(
                f"PruningCallback selected {qualified} of a {type(module).__name__} that is no longer the model's "
                f"{path or 'root'} (now {type(found).__name__ if found is not None else 'gone'}): a layer replaced "
                "after the selection, in the LightningModule's own on_fit_start or on_train_start, would be left "
                "unpruned. Build layers in __init__, setup or configure_model"
            )


def refuse_frozen_movement(selection: Selection, importance: str, when: str = "at setup") -> None:
    """Under movement importance, refuse frozen selected tensors (``requires_grad=False``), naming them: without
    gradients their score is zero everywhere, and an event would prune them in index order. (Dynamic sparse training
    leaves a frozen tensor's mask as it is.)

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 2))
        >>> _ = net[0].weight.requires_grad_(False)
        >>> refuse_frozen_movement([("0.weight", net[0], "weight")], "movement")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: importance='movement' ranks by the weights' gradients, which the frozen ... ['0.weight'] ...
    """
    if importance != "movement":
        return
    frozen = [q for q, module, name in selection if not prune.original(module, name).requires_grad]
    if frozen:
        raise ValueError(
            f"importance='movement' ranks by the weights' gradients, which the frozen (requires_grad=False {when}) "
            f"tensors {frozen[:3]} do not have: use 'magnitude' or 'activation', exclude them, or unfreeze them"
        )


def refuse_sparse_gradients(
    selection: Selection, mask_dtype: torch.dtype | None, masking: str, importance: str, regrow: str | None
) -> None:
    """Refuse, naming them, selected tensors of modules with sparse gradients (``nn.Embedding(sparse=True)``,
    ``nn.EmbeddingBag(sparse=True)``) where the fit would fail at its first event or step: only a reparametrization
    with floating masks (``mask_dtype=None``) passes a sparse gradient through, and only magnitude pruning reads no
    gradient.

    Example:
        >>> embedding = nn.Embedding(10, 4, sparse=True)
        >>> refuse_sparse_gradients([("emb.weight", embedding, "weight")], None, "reparametrize", "magnitude", None)
        >>> refuse_sparse_gradients(  # doctest: +ELLIPSIS
        ...     [("emb.weight", embedding, "weight")], torch.bool, "reparametrize", "magnitude", None
        ... )
        Traceback (most recent call last):
        ...
        ValueError: ['emb.weight'] belong to modules with sparse=True, whose sparse gradients mask_dtype=torch.bool ...
    """
    sparse = [q for q, module, _ in selection if getattr(module, "sparse", False) is True]
    if not sparse:
        return
    settings = [
        f"{key}={value!r}"
        for key, value, fits in [
            ("mask_dtype", mask_dtype, mask_dtype is None or mask_dtype.is_floating_point),
            ("masking", masking, masking == "reparametrize"),
            ("importance", importance, importance == "magnitude"),
            ("regrow", regrow, regrow is None),
        ]
        if not fits
    ]
    if settings:
        raise ValueError(
            f"{sparse[:3]} belong to modules with sparse=True, whose sparse gradients {', '.join(settings)} cannot "
            "handle (the fit would fail at its first event): set sparse=False on them, exclude them, or use "
            "mask_dtype=None, masking='reparametrize' and importance='magnitude' without regrowth"
        )


def check_rows(selection: Selection) -> None:
    """Per-row ranking needs rows: tensors of two or more dims (else the first event fails, mid-training), and one
    dim whose slices are the output units (:func:`~lightprune.layouts.row_dim`: not a grouped ``ConvTranspose``).

    Example:
        >>> check_rows([("fc.bias", nn.Linear(2, 3), "bias")])
        Traceback (most recent call last):
        ...
        ValueError: fc.bias has shape (3,): scope='row' needs >= 2 dims (rows: dim 0)
    """
    from lightprune.layouts import row_dim

    for qualified, module, name in selection:
        tensor = prune.original(module, name)
        dim = row_dim(module, name)
        if tensor.dim() < 2:
            raise ValueError(
                f"{qualified} has shape {tuple(tensor.shape)}: scope='row' needs >= 2 dims (rows: dim {dim})"
            )
        if dim and getattr(module, "groups", 1) > 1:
            raise ValueError(
                f"{qualified} belongs to a {type(module).__name__} with groups={module.groups}: its output channels "
                f"are not the slices of one dim of its weight {tuple(tensor.shape)}, so scope='row' cannot rank them; "
                "exclude it or choose another scope"
            )


def channel_biases(selection: Selection) -> list[nn.Module]:
    """The modules whose bias ``prune_channel_bias`` zeroes with the output channels their weight's mask removes
    along dim 0; refuse a layer whose weight's dim 0 runs over its inputs (an ``(in, out)`` weight: transformers'
    ``Conv1D``, ``ConvTranspose``), where those entries would be the bias of other channels, and a tensor other than
    ``weight`` with a bias of its own beside it (``in_proj_weight`` and ``in_proj_bias``, ``weight_ih_l0`` and
    ``bias_ih_l0``), which the option would leave whole.

    Example:
        >>> with_bias, without = nn.Linear(2, 3), nn.Linear(2, 3, bias=False)
        >>> channel_biases([("fc.weight", with_bias, "weight"), ("fc2.weight", without, "weight")]) == [with_bias]
        True
        >>> channel_biases([("up.weight", nn.ConvTranspose1d(4, 2, 1), "weight")])
        Traceback (most recent call last):
        ...
        ValueError: prune_channel_bias=True zeroes the bias of the output channels pruned along dim 0, but dim 0 of \
up.weight (ConvTranspose1d, weight (4, 2, 1)) runs over its inputs: exclude it or set prune_channel_bias=False
    """
    from lightprune.layouts import row_dim

    biases = []
    for qualified, module, name in selection:
        paired = name.replace("weight", "bias")
        if name != "weight" and paired != name and isinstance(getattr(module, paired, None), Tensor):
            raise ValueError(
                f"prune_channel_bias=True zeroes a layer's 'bias' beside its pruned 'weight', but {qualified} "
                f"({type(module).__name__}) has its bias in {paired!r}, which it does not follow: exclude "
                f"{qualified} or set prune_channel_bias=False"
            )
        if name != "weight" or not isinstance(getattr(module, "bias", None), Tensor):
            continue
        if row_dim(module, name) != 0:
            shape = tuple(prune.original(module, name).shape)
            raise ValueError(
                "prune_channel_bias=True zeroes the bias of the output channels pruned along dim 0, but dim 0 of "
                f"{qualified} ({type(module).__name__}, weight {shape}) runs over its inputs: exclude it or set "
                "prune_channel_bias=False"
            )
        biases.append(module)
    return biases


def called_by_their_parent(selection: Selection, model: nn.Module) -> list[str]:
    """The selected tensors whose module's forward never runs because its parent computes with the weight itself:
    the ``out_proj`` of ``nn.MultiheadAttention``. Hooks on those modules see nothing.

    Example:
        >>> attention = nn.MultiheadAttention(4, 2)
        >>> called_by_their_parent([("out_proj.weight", attention.out_proj, "weight")], attention)
        ['out_proj.weight']
    """
    out_projections = {id(m.out_proj) for m in model.modules() if isinstance(m, nn.MultiheadAttention)}
    return [q for q, module, _ in selection if id(module) in out_projections]


def refuse_unrecorded_inputs(
    selection: Selection,
    model: nn.Module,
    reader: str,
    way_out: str = "exclude them (for example exclude=[r'.*out_proj\\.weight']) or use another importance",
) -> None:
    """Refuse input statistics (``reader``: the option reading them) for tensors whose module's forward never runs
    (:func:`called_by_their_parent`), naming them and ``way_out``: their inputs cannot be recorded, and the first
    event would fail for want of statistics after the training before it (or, for units, rank and refit on none).

    Example:
        >>> attention = nn.MultiheadAttention(4, 2)
        >>> refuse_unrecorded_inputs(  # doctest: +ELLIPSIS
        ...     [("out_proj.weight", attention.out_proj, "weight")], attention, "importance='activation'"
        ... )
        Traceback (most recent call last):
        ...
        ValueError: importance='activation' records each layer's inputs in its forward, which never runs for ...
    """
    unseen = called_by_their_parent(selection, model)
    if unseen:
        raise ValueError(
            f"{reader} records each layer's inputs in its forward, which never runs for the MultiheadAttention "
            f"projections {unseen[:3]} (their parent computes with their weights): {way_out}"
        )


def check_regrowth(
    selection: Selection, model: nn.Module, regrow: str, masking: str, adapted: Mapping[str, Any]
) -> None:
    """Refuse what dynamic sparse training would get wrong: adapted (LoRA) base weights, whose effective weight a
    regrown entry would not start at zero in; and, for RigL under the reparametrization (whose dense gradients come
    from the forwards of the modules holding each tensor), the ``out_proj`` of ``nn.MultiheadAttention``, which its
    parent reads without calling it.

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 2))
        >>> check_regrowth([("0.weight", net[0], "weight")], net, "rigl", "reparametrize", {})
        >>> attention = nn.MultiheadAttention(4, 2)
        >>> check_regrowth([("out_proj.weight", attention.out_proj, "weight")], attention, "rigl", "reparametrize",
        ...                {})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: regrow='rigl' with masking='reparametrize' collects dense gradients from each module's own ...
    """
    if adapted:
        raise ValueError(
            f"regrow={regrow!r} cannot move the masks of adapted (LoRA) base weights {sorted(adapted)[:3]}: a regrown "
            "entry would start at the adapter's update, not at zero; exclude them or merge the adapters first"
        )
    if regrow != "rigl" or masking == "inplace":
        return
    unseen = called_by_their_parent(selection, model)
    if unseen:
        raise ValueError(
            f"regrow='rigl' with masking='reparametrize' collects dense gradients from each module's own forward, "
            f"which misses the MultiheadAttention projections {unseen[:3]} (their parent computes with them): use "
            "masking='inplace', whose gradient hooks sit on the Parameters"
        )


def check_n_m_layout(selection: Selection, method: str, m: int) -> None:
    """N:M groups (of ``method``) run along each layer's input dim, which ``m`` must divide; refuse, naming the first
    that fails.

    Example:
        >>> check_n_m_layout([("fc.weight", nn.Linear(6, 2), "weight")], "semi_structured", 4)
        Traceback (most recent call last):
        ...
        ValueError: semi_structured with m=4 needs the input dim (dim 1) of every weight to be a multiple of m: \
fc.weight has shape (2, 6); exclude it or choose another m
    """
    from lightprune.layouts import input_dim

    for qualified, module, name in selection:
        tensor = prune.original(module, name)
        dim = input_dim(module)
        if tensor.dim() < 2 or tensor.shape[dim] % m:
            raise ValueError(
                f"{method} with m={m} needs the input dim (dim {dim}) of every weight to be a multiple of m: "
                f"{qualified} has shape {tuple(tensor.shape)}; exclude it or choose another m"
            )


def check_dims(
    selection: Selection, method_kwargs: Mapping[str, Any], method: type[prune.BasePruningMethod] | None = None
) -> None:
    """A structured method needs tensors of two or more dims, and its ``dim`` among them; the engine's ``method``
    (given) must rank each tensor's channels with its other ``method_kwargs`` (``ln_structured``'s ``n``: a norm
    torch knows for that shape and dtype). Else the first event fails, mid-training."""
    dim = method_kwargs.get("dim")
    for qualified, module, name in selection:
        tensor = prune.original(module, name)
        if tensor.dim() < 2:
            raise ValueError(f"{qualified} has shape {tuple(tensor.shape)}: structured pruning needs >= 2 dims")
        if is_int(dim) and not -tensor.dim() <= dim < tensor.dim():
            raise ValueError(
                f"method_kwargs dim={dim} is out of range for {qualified} of shape {tuple(tensor.shape)}: "
                f"allowed dims are {-tensor.dim()} ... {tensor.dim() - 1}"
            )
        if method is not None and method.__module__.startswith("lightprune."):  # amount 0, dims cut to 1: no cost
            tiny = torch.zeros([min(size, 1) for size in tensor.shape], dtype=tensor.dtype)
            try:
                method(amount=0, **method_kwargs).compute_mask(tiny, torch.ones_like(tiny))
            except (RuntimeError, TypeError, ValueError) as err:
                raise ValueError(
                    f"method_kwargs={dict(method_kwargs)!r} cannot rank the channels of {qualified} "
                    f"({tuple(tensor.shape)}, {tensor.dtype}) with {method.__name__}: {err}"
                ) from err


def find_ties(
    selection: Selection, owners: Mapping[int, Selection]
) -> list[tuple[nn.Module, str, list[tuple[str, nn.Module, str]]]]:
    """For each selected tensor registered on other modules too (tied weights): ``(module, name, other owners)``."""
    ties = []
    for _, module, name in selection:
        others = [(q, m, n) for q, m, n in owners.get(id(prune.original(module, name)), []) if (m, n) != (module, name)]
        if others:
            ties.append((module, name, others))
    return ties


def refuse_reconstructing_ties(
    ties: list[tuple[nn.Module, str, list[tuple[str, nn.Module, str]]]], selection: Selection
) -> None:
    """OBS's reconstruction rewrites the kept weights for the selected layer's own output; a tensor tied to another
    module (GPT-2's ``lm_head`` is its input embedding) would change there too, for inputs the update never saw.

    Example:
        >>> head, embedding = nn.Linear(4, 3, bias=False), nn.Embedding(3, 4)
        >>> head.weight = embedding.weight
        >>> ties = [(head, "weight", [("embed.weight", embedding, "weight")])]
        >>> refuse_reconstructing_ties(ties, [("head.weight", head, "weight")])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: reconstruct=True rewrites the kept weights of head.weight, which is tied to ['embed.weight']: ...
    """
    if not ties:
        return
    module, name, others = ties[0]
    qualified = next((q for q, m, n in selection if m is module and n == name), f"{type(module).__name__}.{name}")
    raise ValueError(
        f"reconstruct=True rewrites the kept weights of {qualified}, which is tied to "
        f"{[q for q, _, _ in others][:3]}: the update fits this layer's output only and would change theirs too; "
        "exclude the tied tensor or set reconstruct=False"
    )


def warn_small_share(selection: Selection, owners: Mapping[int, Selection]) -> None:
    """Say so once when the selection leaves most of the model's weights out (GPT-2's ``Conv1D`` layers are not
    ``nn.Linear``; the older ``weight_norm`` keeps a Linear's weight as ``weight_v``), naming the largest unselected
    module types and their tensors' names."""
    selected = {id(prune.original(module, name)) for _, module, name in selection}
    total = chosen = 0
    unselected: dict[tuple[str, str], int] = {}
    for parameter_id, places in owners.items():
        _, module, name = places[0]
        tensor = prune.original(module, name)
        if tensor.dim() < 2:
            continue
        total += tensor.numel()
        if parameter_id in selected:
            chosen += tensor.numel()
        else:
            kind = f"{type(module).__module__}.{type(module).__qualname__}"
            unselected[kind, name] = unselected.get((kind, name), 0) + tensor.numel()
    if total == 0 or chosen / total >= SMALL_SHARE:
        return
    largest = sorted(unselected.items(), key=lambda item: -item[1])[:3]
    named = ", ".join(f"{kind}'s {name} ({count / total:.0%})" for (kind, name), count in largest)
    rank_zero_warn(
        f"PruningCallback: the default selection (Linear and Conv weights) covers {chosen / total:.0%} of the "
        f"model's weights; the largest unselected are {named}. Pass module_types (classes or import paths) and "
        "parameter_names to prune them too.",
        category=UserWarning,
    )
