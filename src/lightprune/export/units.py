"""Physical removal of pruned MLP neurons and attention heads, without ``torch.fx``: the same model class, smaller.

:func:`remove_units` copies the model, makes its pruning permanent, and for every unit group (see
:func:`lightprune.structure.find_units`) drops the units whose output columns in the consuming projection are all
zero (so removing them is exact whatever their rows hold): smaller ``Linear`` / ``Conv1D`` weights and biases, their
``in_features`` / ``out_features`` / ``nf``, and the attention attributes that count heads or widths
(``num_heads``, ``num_attention_heads``, ``n_heads``, ``n_head``, ``num_key_value_heads``, ``split_size``,
``all_head_size``, ``inner_dim``; a value is changed only where it equals the old count). The models' own code then
runs as it is: Hugging Face attentions infer the head count from the projection's width.

Saving: where every layer keeps the same counts and a model built from the updated config has the compact model's
shapes, the config's sizes are updated (``intermediate_size``, ``num_attention_heads``, ...), and
``save_pretrained`` / ``from_pretrained`` round-trip. Otherwise (per-layer counts, or a config that derives the head
size from the head count, as BERT's does) the config keeps its sizes and records the kept units per group in
``config.lightprune_kept_units`` (the groups of the kinds named in ``config.lightprune_kept_kinds``);
:func:`load_compact` rebuilds that shape and loads the weights. A model without a config of its own (a
LightningModule) has the config of every Hugging Face model it holds (``self.model``) updated or recorded so for the
groups inside that model, so ``small.model.save_pretrained`` loads back; its own layers' units (a head of its own)
need no config.

Refused (:class:`~lightprune.export.CompactError`, naming the module): heads of ``nn.MultiheadAttention`` (its
forward derives the head size from ``embed_dim``, so heads cannot go without changing the class) and heads that get a
per-head bias from outside their projections (T5's relative position bias, computed once and shared by every layer).
"""

from __future__ import annotations

import copy
import os
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree

from lightprune.export.compact import CompactError
from lightprune.layouts import is_transformers_conv1d
from lightprune.structure.units import UnitError, UnitGroup, find_units, plain_copy, removal_problem

__all__ = ["load_compact", "remove_units"]

_HEAD_COUNTS = ("num_heads", "num_attention_heads", "n_heads", "n_head")
_KV_COUNTS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads")
_WIDTHS = ("split_size", "all_head_size", "inner_dim")
_CONFIG_NEURONS = (
    "intermediate_size", "n_inner", "d_ff", "ffn_dim", "dim_feedforward", "hidden_dim", "encoder_ffn_dim",
    "decoder_ffn_dim",
)  # fmt: skip
_CONFIG_HEADS = ("num_attention_heads", "n_head", "num_heads")
_CONFIG_KV = ("num_key_value_heads",)
KEPT_UNITS = "lightprune_kept_units"
KEPT_KINDS = "lightprune_kept_kinds"  # the kinds find_units was asked for to list the groups of KEPT_UNITS
_ALL_KINDS = ("neurons", "heads")


def _per_unit_zero(weight: Tensor, dim: int, offset: int, count: int, per_unit: int) -> Tensor:
    block = weight.detach().narrow(dim, offset, count * per_unit).movedim(dim, 0).reshape(count, -1)
    return (block == 0).all(1).cpu()


def _removable(model: nn.Module, group: UnitGroup) -> Tensor:
    """Units whose every output column is zero: removing them changes nothing."""
    removable = torch.ones(group.count, dtype=torch.bool)
    for piece in group.consume:
        weight = getattr(model.get_submodule(piece.module), piece.name)
        removable &= _per_unit_zero(weight, piece.dim, piece.offset, group.count, piece.per_unit)
    if bool(removable.all()):
        removable[0] = False  # keep one unit: a block without units is not a model its code can run
    return removable


def _check_removable(model: nn.Module, group: UnitGroup) -> None:
    problem = removal_problem(model, group)
    if problem is not None:
        way_out = "; prune its neurons, or keep its heads" if group.per_head_bias else ""
        raise CompactError(f"cannot remove {group.kind} of {group.module!r}: {problem}{way_out}")


def _shrink(model: nn.Module, groups: Sequence[UnitGroup], removed: Sequence[Tensor]) -> None:
    """Remove the units where ``removed`` is True, in place (plain, unpruned modules)."""
    kept: dict[tuple[str, str], dict[int, Tensor]] = {}
    for group, gone in zip(groups, removed, strict=True):
        if not bool(gone.any()):
            continue
        _check_removable(model, group)
        for piece in group.slices:
            size = getattr(model.get_submodule(piece.module), piece.name).shape[piece.dim]
            lines = kept.setdefault((piece.module, piece.name), {})
            line = lines.setdefault(piece.dim, torch.ones(int(size), dtype=torch.bool))
            start = piece.offset
            line[start : start + group.count * piece.per_unit] &= ~gone.repeat_interleave(piece.per_unit)
    for (module_name, name), lines in kept.items():
        module = model.get_submodule(module_name)
        tensor = getattr(module, name).detach()
        for dim, line in lines.items():
            tensor = tensor.index_select(dim, line.nonzero().flatten().to(tensor.device))
        setattr(module, name, nn.Parameter(tensor.clone(), requires_grad=getattr(module, name).requires_grad))
    for module_name in {module for module, _ in kept}:
        module = model.get_submodule(module_name)
        if isinstance(module, nn.Linear):
            module.out_features, module.in_features = module.weight.shape
        elif is_transformers_conv1d(module):
            module.nf = module.weight.shape[1]
    for group, gone in zip(groups, removed, strict=True):
        if group.kind == "heads" and bool(gone.any()):
            _set_head_attributes(model, group, int((~gone).sum()))


def _set_head_attributes(model: nn.Module, group: UnitGroup, units: int) -> None:
    """Set the head counts and widths the attention's modules hold (not its projections) from ``group.count`` units
    to ``units``, where an attribute equals the old value. A unit is one key/value head, so the key/value head count
    shrinks with the units whatever the ratio: with one query head per key/value head (plain multi-head attention)
    it equals the query head count, and a forward that views its keys by it (StableLM's) needs it changed too."""
    ratio, dim = group.heads_per_unit, group.head_dim
    changes = (
        {name: (group.count * ratio, units * ratio) for name in _HEAD_COUNTS}
        | {name: (group.count * ratio * dim, units * ratio * dim) for name in _WIDTHS}
        | {name: (group.count, units) for name in _KV_COUNTS}
    )
    projections = {piece.module for piece in group.slices}
    for name, module in model.get_submodule(group.module).named_modules(prefix=group.module):
        if name in projections:
            continue
        for attribute, (old, new) in changes.items():
            if isinstance(module.__dict__.get(attribute), int) and module.__dict__[attribute] == old:
                setattr(module, attribute, new)


def _update_config(
    model: nn.Module,
    groups: Sequence[UnitGroup],
    counts: list[int],
    all_counts: Callable[[Sequence[str] | None], list[int]],
) -> None:
    """Write uniform counts into the config if a model built from it has the compact shapes; else record the kept
    units of every group of the kinds in ``groups`` in the compact model (``all_counts(kinds)``, in
    :func:`find_units`' order, which :func:`load_compact` follows), whatever subset or order of groups ``groups``
    was, and those kinds (:func:`load_compact` finds the groups with those kinds only: a model whose heads cannot be
    followed still loads back after its neurons went)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return
    if list(counts) == [group.count for group in groups]:
        return
    kinds = {group.kind for group in groups}
    if getattr(config, KEPT_UNITS, None) is not None:  # removed before: the record covers every group again
        before = getattr(config, KEPT_KINDS, None)  # None: a record of every kind find_units finds, as before
        _record(config, all_counts, None if before is None else kinds | set(before))
        return
    changes: dict[str, Any] = {}
    for kind, names, scale in (
        ("neurons", _CONFIG_NEURONS, 1),
        ("heads", _CONFIG_HEADS, None),
        ("heads", _CONFIG_KV, 0),
    ):
        pairs = {(g.count, c, g.heads_per_unit) for g, c in zip(groups, counts, strict=True) if g.kind == kind}
        if len(pairs) != 1:
            if pairs:
                changes = {}
                break
            continue
        old, new, ratio = pairs.pop()
        factor = ratio if scale is None else 1
        for name in names:
            value = getattr(config, name, "absent")
            if value == old * factor or (value is None and name == "n_inner"):
                changes[name] = new * factor
    if changes and _config_fits(model, config, changes):
        for name, value in changes.items():
            setattr(config, name, value)
    else:
        _record(config, all_counts, kinds)


def _record(config: Any, all_counts: Callable[[Sequence[str] | None], list[int]], kinds: set[str] | None) -> None:
    ordered = None if kinds is None else [kind for kind in _ALL_KINDS if kind in kinds]
    setattr(config, KEPT_UNITS, all_counts(ordered))
    if ordered is not None:
        setattr(config, KEPT_KINDS, ordered)


def _config_fits(model: nn.Module, config: Any, changes: Mapping[str, Any]) -> bool:
    trial = copy.deepcopy(config)
    for name, value in changes.items():
        setattr(trial, name, value)
    try:
        with torch.device("meta"):
            fresh = type(model)(trial)
    except Exception:
        return False
    want = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    got = {name: tuple(p.shape) for name, p in fresh.state_dict().items()}
    return want == got


class _NoHeadlessAttention(TorchFunctionMode):
    """Raise where ``scaled_dot_product_attention`` would get query heads but no key/value heads.

    A compact model whose forward splits a fused projection by a count from its config (Phi-3's ``qkv_proj``) hands
    the attention an empty key. torch 2.11's grouped-query path divides by the key's head count in C++ and kills the
    process (a floating-point exception; 2.13 does not) where a Python error is wanted; this mode raises one first.
    """

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            query = args[0] if args else kwargs["query"]
            key = args[1] if len(args) > 1 else kwargs["key"]
            if query.dim() >= 3 and key.dim() >= 3 and key.shape[-3] == 0 < query.shape[-3]:
                raise RuntimeError(
                    f"scaled_dot_product_attention got {query.shape[-3]} query heads and no key/value heads"
                )
        return func(*args, **kwargs)


def _outputs(model: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[Tensor]:
    with torch.no_grad(), _NoHeadlessAttention():
        out = model(*args, **kwargs)
    return [t for t in _pytree.tree_leaves(out) if isinstance(t, Tensor) and t.is_floating_point()]


def _inputs(model: nn.Module, example_inputs: Any, example_kwargs: Mapping[str, Any] | None) -> tuple[tuple, dict]:
    args = (example_inputs,) if isinstance(example_inputs, Tensor) else tuple(example_inputs)
    kwargs = dict(example_kwargs or {})
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "use_cache") and "use_cache" not in kwargs:
        kwargs["use_cache"] = False
    return args, kwargs


def remove_units(
    model: nn.Module,
    example_inputs: Sequence[Any] | Tensor = (),
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    groups: Sequence[UnitGroup] | None = None,
    rtol: float = 1e-5,
) -> nn.Module:
    """Return a copy of ``model``, same class, with its pruned neurons and heads physically removed.

    A unit is removed when all its output columns in the consuming projection are zero in the tensors the model
    computes with (what :func:`lightprune.structure.prune_units` produces); at least one unit per group stays. The
    copy holds plain tensors (no pruning reparametrization) and is in eval mode; ``model`` is left unchanged.

    Args:
        model: the pruned model.
        example_inputs: positional inputs of one forward (for finding the units and checking the result).
        example_kwargs: keyword inputs (Hugging Face models get ``use_cache=False`` if not given).
        groups: the unit groups, if already found on this model (default: :func:`~lightprune.structure.find_units`).
        rtol: tolerance of the check against the masked model, relative to the largest output.

    Returns:
        The compact model. Its config (Hugging Face), or that of each Hugging Face model it wraps, is updated as the
        module's docstring says.

    Raises:
        CompactError: units of a module that cannot shrink (named), or the compact model's outputs differ (an output
            per head, the attention probabilities of ``output_attentions=True``, is named: it has fewer heads).
        lightprune.structure.UnitError: the units cannot be found.

    Example:
        >>> from transformers import GPT2Config, GPT2LMHeadModel
        >>> from lightprune.structure import find_units, prune_units
        >>> gpt = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_inner=64)).eval()
        >>> ids = {"input_ids": torch.randint(0, 64, (1, 6))}
        >>> _ = prune_units(gpt, find_units(gpt, (), ids), 0.5)
        >>> small = remove_units(gpt, (), ids)
        >>> small.transformer.h[0].mlp.c_fc.nf, small.transformer.h[0].attn.split_size
        (32, 16)
        >>> small.config.n_head, small.config.lightprune_kept_units  # GPT-2 derives head_dim from n_head
        (4, [2, 32, 2, 32])
    """
    args, kwargs = _inputs(model, example_inputs, example_kwargs)
    if groups is None:
        try:
            groups = find_units(model, args, kwargs)
        except UnitError as err:
            if "attention" not in str(err):
                raise
            raise UnitError(
                f"{err} (to remove one kind of unit only, pass groups=find_units(model, ..., kinds=['neurons']))"
            ) from err
    groups = list(groups)
    compact = plain_copy(model).eval()
    removed = [_removable(compact, group) for group in groups]
    _shrink(compact, groups, removed)
    was_training = model.training
    model.eval()
    try:
        want = _outputs(model, args, kwargs)
    finally:
        model.train(was_training)
    try:
        got = _outputs(compact, args, kwargs)
    except Exception as err:  # the model's code derives a shape from a count the removal could not change
        raise CompactError(
            f"the compact {type(model).__name__} does not run on the example inputs ({type(err).__name__}: {err}): "
            "its forward reads a head or width count that remove_units does not know; keep its units"
        ) from err
    heads_gone = any(group.kind == "heads" and bool(gone.any()) for group, gone in zip(groups, removed, strict=True))
    for i, (a, b) in enumerate(zip(want, got, strict=True)):
        scale = max(float(a.abs().max()) if a.numel() else 0.0, 1e-30)
        tolerance = max(rtol, 16 * torch.finfo(a.dtype).eps) * scale
        if a.shape != b.shape and heads_gone:
            raise CompactError(
                f"the masked {type(model).__name__}'s output {i} has shape {tuple(a.shape)}, the compact model's "
                f"{tuple(b.shape)}: an output with one entry per head (attention probabilities) changes shape when "
                "heads are removed; pass output_attentions=False in example_kwargs (the compact model returns them "
                "for its remaining heads)"
            )
        if a.shape != b.shape or float((a.double() - b.double()).abs().max()) > tolerance:
            raise CompactError(
                f"the compact {type(model).__name__}'s output {i} differs from the masked model's on the example "
                "inputs; please report this model"
            )
    counts = [int((~gone).sum()) for gone in removed]
    for prefix, owner in _config_owners(compact):
        inside = [i for i, group in enumerate(groups) if _inside(group.module, prefix)]
        if not inside:
            continue

        def found(kinds: Sequence[str] | None, prefix: str = prefix) -> list[int]:
            again = _found_again(compact, args, kwargs, kinds)
            return [group.count for group in again if _inside(group.module, prefix)]

        _update_config(owner, [groups[i] for i in inside], [counts[i] for i in inside], found)
    return compact


def _found_again(
    model: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any], kinds: Sequence[str] | None
) -> list[UnitGroup]:
    """The unit groups of a compact model (or of one rebuilt to be compacted), without warning again about groups
    left out: the caller was warned when the groups were first found."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="find_units leaves out")
        warnings.filterwarnings("ignore", message="find_units found attention-like softmaxes")
        return find_units(model, args, kwargs, kinds=kinds)


def _config_owners(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules whose configs describe the groups inside them, with their qualified names: ``model`` itself if it
    has a config (Hugging Face), else every outermost Hugging Face model it holds (a LightningModule's
    ``self.model``). Groups outside them (a wrapper's own head) have no config to update: the wrapper's state_dict
    holds their shapes."""
    if hasattr(getattr(model, "config", None), "to_dict"):
        return [("", model)]
    owners = [(name, m) for name, m in model.named_modules() if name and hasattr(getattr(m, "config", None), "to_dict")]
    return [(name, m) for name, m in owners if not any(_inside(name, other) for other, _ in owners if other != name)]


def _inside(module: str, prefix: str) -> bool:
    """Whether the module named ``module`` is the one named ``prefix`` or inside it (``""``: the whole model)."""
    return not prefix or module == prefix or module.startswith(prefix + ".")


def load_compact(
    model_class: Any,
    path: str | os.PathLike[str],
    example_inputs: Sequence[Any] | Tensor = (),
    example_kwargs: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> nn.Module:
    """Load a model saved with ``save_pretrained`` after :func:`remove_units`, whatever its per-layer counts.

    Where the config holds the compact sizes this is ``model_class.from_pretrained(path, **kwargs)``. Where it
    records ``lightprune_kept_units`` (per-layer counts, or BERT's heads), the model is built from the config (in the
    saved dtype, or ``dtype=``; ``attn_implementation=`` is honoured too, other arguments are refused), its units
    found on example inputs and cut to the recorded counts, and the saved weights loaded into it. Either way the
    model comes back in eval mode, as ``from_pretrained`` gives it.

    Args:
        model_class: the Hugging Face model class saved (``type(small)``).
        path: the directory ``save_pretrained`` wrote.
        example_inputs: positional inputs of one forward of the model, as for :func:`remove_units` (only for a save
            that records ``lightprune_kept_units``). By default the model's ``dummy_inputs``, or zero images for a
            model whose main input is ``pixel_values``; pass inputs for a model whose forward needs more (CLIP's
            ``input_ids`` and ``pixel_values``, Whisper's ``input_features`` and ``decoder_input_ids``).
        example_kwargs: keyword inputs of that forward.
        **kwargs: passed to ``from_pretrained`` (see above for a save with ``lightprune_kept_units``).

    Returns:
        The compact model, in eval mode.

    Raises:
        CompactError: the inputs cannot be built (pass them), or the saved weights do not fit the rebuilt model.
        TypeError: an argument that cannot be passed on.

    Example:
        >>> import tempfile
        >>> from transformers import BertConfig, BertModel
        >>> from lightprune.structure import find_units, prune_units
        >>> bert = BertModel(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        ...                             intermediate_size=48)).eval()
        >>> ids = {"input_ids": torch.randint(0, 64, (1, 6))}
        >>> _ = prune_units(bert, find_units(bert, (), ids), 0.5)
        >>> small = remove_units(bert, (), ids)
        >>> with tempfile.TemporaryDirectory() as path:
        ...     small.save_pretrained(path)
        ...     loaded = load_compact(BertModel, path).eval()
        >>> torch.equal(loaded(**ids).last_hidden_state, small(**ids).last_hidden_state)
        True
    """
    config = model_class.config_class.from_pretrained(path)
    counts = getattr(config, KEPT_UNITS, None)
    if counts is None:
        return model_class.from_pretrained(path, **kwargs)
    accepted = {key: kwargs.pop(key) for key in ("dtype", "torch_dtype", "attn_implementation") if key in kwargs}
    if kwargs:
        raise TypeError(
            f"load_compact cannot pass {sorted(kwargs)} on for {path}, whose config records per-layer counts "
            f"({KEPT_UNITS}): load it, then move or convert the model"
        )
    if accepted.get("dtype", accepted.get("torch_dtype")) == "auto":  # the saved dtype, as config.dtype says
        accepted.pop("dtype", None), accepted.pop("torch_dtype", None)
    model = model_class._from_config(config, **accepted).eval()  # traced as it will run (no layerdrop)
    given = isinstance(example_inputs, Tensor) or len(example_inputs) > 0 or example_kwargs is not None
    args, inputs = _inputs(model, example_inputs, example_kwargs) if given else ((), _example_inputs(model, path))
    try:
        groups = _found_again(model, args, inputs, getattr(config, KEPT_KINDS, None))
    except UnitError as err:
        if given:
            raise
        raise CompactError(
            f"{path}: cannot find the units of {type(model).__name__} on the inputs load_compact built for it "
            f"({sorted(inputs)}): {err}. Pass example_inputs / example_kwargs that run one forward of the model, "
            "as for remove_units"
        ) from err
    if len(groups) != len(counts):
        raise CompactError(f"{path}: the config records {len(counts)} unit groups, the model has {len(groups)}")
    removed = []
    for group, count in zip(groups, counts, strict=True):
        gone = torch.zeros(group.count, dtype=torch.bool)
        gone[count:] = True
        removed.append(gone)
    _shrink(model, groups, removed)
    from safetensors.torch import load_file

    state: dict[str, Tensor] = {}
    for file in sorted(os.listdir(path)):
        if file.endswith(".safetensors"):
            state |= load_file(os.path.join(path, file))
    own_names, converted = _own_names(model)
    state = _with_prefix_of(model, {own_names.get(key, key): value for key, value in state.items()})
    missing, unexpected = model.load_state_dict(state, strict=False)
    # tied copies are not saved; transformers lists every tie (nested models' too) in all_tied_weights_keys
    tied = set(getattr(model, "_tied_weights_keys", None) or []) | set(
        getattr(model, "all_tied_weights_keys", None) or []
    )
    if converted & set(unexpected):
        raise CompactError(
            f"{path}: transformers converts {type(model).__name__}'s weights on saving (not only renames: "
            f"{sorted(converted & set(unexpected))[:3]} ...), and load_compact does not convert them back; a save of "
            "this model with per-layer counts cannot be loaded with load_compact"
        )
    if unexpected or any(key not in tied and not _left_out_on_save(model, key) for key in missing):
        raise CompactError(f"{path}: the saved weights do not fit (missing {missing}, unexpected {unexpected})")
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return model.eval()


def _left_out_on_save(model: nn.Module, key: str) -> bool:
    """Whether ``save_pretrained`` leaves ``key`` out and ``from_pretrained`` rebuilds it (Marian's sinusoidal position
    tables): named in the model's ``_keys_to_ignore_on_save``, or matched by a pattern of its
    ``_keys_to_ignore_on_load_missing``."""
    if key in (getattr(model, "_keys_to_ignore_on_save", None) or ()):
        return True
    return any(re.search(pattern, key) for pattern in getattr(model, "_keys_to_ignore_on_load_missing", None) or ())


def _with_prefix_of(model: nn.Module, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """``state`` keyed as ``model``'s own state_dict across a base-model prefix, as ``from_pretrained`` loads a base
    model (``GPT2Model``) from a save of a model with a head (``GPT2LMHeadModel``: ``transformer.`` prefixed, plus the
    head's tensors, left out), and the other way round."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    own = set(model.state_dict())
    if not prefix or any(key in own for key in state):
        return state
    head = prefix + "."
    stripped = {key.removeprefix(head): value for key, value in state.items() if key.startswith(head)}
    if stripped and any(key in own for key in stripped):
        return stripped
    prefixed = {head + key: value for key, value in state.items()}
    return prefixed if any(key in own for key in prefixed) else state


def _own_names(model: nn.Module) -> tuple[dict[str, str], set[str]]:
    """The model's state_dict key of each name ``save_pretrained`` wrote (transformers renames some models' weights
    on saving, e.g. ViT's, and renames them back in ``from_pretrained``); renames only, as the tensors tell. Also the
    names of the tensors it converts rather than renames (Mixtral's experts, fused in the model, saved one by one)."""
    own = model.state_dict()
    try:
        from transformers.modeling_utils import revert_weight_conversion
    except ImportError:  # a transformers without renaming on save
        return {}, set()
    saved = revert_weight_conversion(model, dict(own))
    key_of = {id(tensor): key for key, tensor in own.items()}
    renamed = {name: key_of[id(tensor)] for name, tensor in saved.items() if id(tensor) in key_of}
    return renamed, {name for name in saved if name not in renamed}


def _example_inputs(model: nn.Module, path: str | os.PathLike[str]) -> dict[str, Tensor]:
    """Keyword inputs of one forward of a Hugging Face model built from its config, to find its units on."""
    main = getattr(model, "main_input_name", "input_ids")
    dummy = dict(getattr(model, "dummy_inputs", {}) or {})
    if main in dummy:
        return dummy
    config = model.config  # type: ignore[union-attr]
    if main == "pixel_values" and hasattr(config, "num_channels") and hasattr(config, "image_size"):
        size = config.image_size
        height, width = (size, size) if isinstance(size, int) else tuple(size)
        reference = next(model.parameters())
        return {main: torch.zeros(1, config.num_channels, height, width, dtype=reference.dtype)}
    raise CompactError(
        f"{path}: cannot build an example input {main!r} for {type(model).__name__} to find its units on; pass "
        "example_inputs / example_kwargs that run one forward of the model to load_compact, as for remove_units"
    )
