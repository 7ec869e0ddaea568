"""Choose which parameters of a model to prune.

A selection is a list of ``(qualified_name, module, name)`` triples: ``qualified_name`` is the parameter's dotted
name in the model (``"features.0.weight"``), ``module`` the module that owns it and ``name`` its attribute name
there (``"weight"``), i.e. what a pruning function takes as ``(module, name)``.

Names are always the user's names, even for parameters that are already pruned. Pruning reparametrizes a parameter
``X`` as a parameter ``X_orig`` and a buffer ``X_mask`` and makes ``X`` a plain attribute recomputed by a forward
pre-hook. Such a parameter is reported as ``X``, and patterns match ``...X``. A pruned tensor is recognized from its
module's forward pre-hooks (any hook object with a ``_tensor_name`` attribute and a ``compute_mask`` method, as both
``torch.nn.utils.prune`` and ``lightprune.prune`` install), never from name suffixes alone.

Example:
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Flatten(), nn.Linear(72, 10))
    >>> [name for name, _, _ in select_parameters(model)]
    ['0.weight', '3.weight']

"""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from lightprune import prune

__all__ = [
    "DEFAULT_MODULE_TYPES",
    "check_pairs",
    "check_parameter_names",
    "compile_patterns",
    "includes_left_out",
    "parameter_owners",
    "parametrized_hint",
    "parametrized_left_out",
    "patterns_matching_none",
    "pruned_tensor_names",
    "resolve_module_types",
    "resolve_pairs",
    "select_parameters",
    "unmatched_patterns",
]

DEFAULT_MODULE_TYPES: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
"""Modules whose ``weight`` is pruned by default. Subclasses count too (e.g. ``nn.LazyLinear``, once a forward has
materialized it, and the ``out_proj`` of ``nn.MultiheadAttention``); transposed convolutions, norms and embeddings do
not."""

_ORIG_SUFFIX = "_orig"


def pruned_tensor_names(module: nn.Module) -> set[str]:
    """Return the names of the tensors of ``module`` that are currently pruned (reparametrized).

    :func:`lightprune.prune.pruned_names` as a set: a tensor ``X`` is pruned when one of the module's forward
    pre-hooks has ``_tensor_name == "X"`` and a ``compute_mask`` method; this works for hooks of both
    ``torch.nn.utils.prune`` and ``lightprune.prune``.

    Args:
        module: the module to inspect (its own hooks only, not its children's).

    Example:
        >>> import torch.nn.utils.prune as torch_prune
        >>> from torch import nn
        >>> layer = nn.Linear(4, 2)
        >>> pruned_tensor_names(layer)
        set()
        >>> _ = torch_prune.random_unstructured(layer, "weight", amount=0.5)
        >>> pruned_tensor_names(layer)
        {'weight'}

    """
    return set(prune.pruned_names(module))


def _own_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Return ``(user_name, parameter)`` for the parameters registered directly on ``module``.

    The parameter ``X_orig`` of a pruned tensor ``X`` is reported under the name ``X``.
    """
    pruned = pruned_tensor_names(module)
    result = []
    for name, parameter in module.named_parameters(recurse=False, remove_duplicate=False):
        if name.endswith(_ORIG_SUFFIX) and name[: -len(_ORIG_SUFFIX)] in pruned:
            name = name[: -len(_ORIG_SUFFIX)]
        result.append((name, parameter))
    return result


def _qualify(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def compile_patterns(kind: str, patterns: Sequence[str] | str | None) -> list[re.Pattern[str]]:
    """Compile ``include`` / ``exclude`` patterns, naming the bad one (``kind`` is the argument's name).

    Example:
        >>> [p.pattern for p in compile_patterns("include", ["fc1", "fc2"])]
        ['fc1', 'fc2']
        >>> compile_patterns("exclude", ["fc(1"])
        Traceback (most recent call last):
        ...
        ValueError: exclude pattern 'fc(1' is not a valid regular expression: missing ), unterminated subpattern ...
    """
    if patterns is None:
        return []
    if isinstance(patterns, str):
        patterns = [patterns]
    if not isinstance(patterns, Iterable):
        raise TypeError(f"{kind}={patterns!r} must be a regular expression (str), a sequence of them or None")
    compiled = []
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise TypeError(f"{kind} pattern {pattern!r} must be a str (a regular expression)")
        try:
            compiled.append(re.compile(pattern))
        except re.error as err:
            raise ValueError(f"{kind} pattern {pattern!r} is not a valid regular expression: {err}") from None
    return compiled


def _filters(
    module_types: Sequence[type[nn.Module]] | type[nn.Module] | None, parameter_names: Sequence[str] | str | None
) -> tuple[tuple[type[nn.Module], ...] | None, set[str] | None]:
    """``module_types`` and ``parameter_names`` as a tuple of classes and a set of names (``None``: any)."""
    if isinstance(module_types, type):
        module_types = (module_types,)
    if isinstance(parameter_names, str):
        parameter_names = (parameter_names,)
    return (
        None if module_types is None else tuple(module_types),
        None if parameter_names is None else set(parameter_names),
    )


def select_parameters(
    model: nn.Module,
    *,
    include: Sequence[str] | str | None = None,
    exclude: Sequence[str] | str | None = None,
    module_types: Sequence[type[nn.Module]] | type[nn.Module] | None = DEFAULT_MODULE_TYPES,
    parameter_names: Sequence[str] | str | None = ("weight",),
) -> list[tuple[str, nn.Module, str]]:
    r"""Select the parameters of ``model`` to prune, by module type, attribute name and regular expressions.

    A parameter is selected when all of these hold:

    * its module is an instance of one of ``module_types`` (``None``: any module);
    * its attribute name is in ``parameter_names`` (``None``: any name);
    * ``include`` is ``None`` or one of its patterns matches the *whole* qualified name (``re.fullmatch``);
    * none of the ``exclude`` patterns matches the whole qualified name (``re.fullmatch``) of the tensor under any of
      its names: a tensor shared by several modules (tied embeddings: ``lm_head.weight`` is ``wte.weight``) is
      excluded everywhere when one of its names is.

    Patterns are matched against the full dotted name, so ``r"features\..*"`` selects everything under
    ``features`` and ``r".*\.weight"`` every weight; use ``.*`` explicitly for a substring match.

    Args:
        model: the model to select from.
        include: a pattern or a sequence of patterns; a parameter must fully match at least one.
        exclude: a pattern or a sequence of patterns; a parameter fully matching any of them is dropped.
        module_types: module classes (or one class) whose parameters may be selected; ``None`` for any module.
        parameter_names: attribute names (or one name) that may be selected; ``None`` for any name.

    Returns:
        ``(qualified_name, module, name)`` triples in ``model.named_modules()`` order, then in the module's parameter
        registration order. The qualified name is the name ``model.named_parameters()`` prints, except for a pruned
        tensor ``X``, reported as ``...X`` rather than ``...X_orig``. A parameter shared by several modules appears
        once, under its first name.

    Raises:
        ValueError: if nothing is selected (the message lists the criteria used), or a pattern is invalid.

    Example:
        >>> from torch import nn
        >>> model = nn.Sequential()
        >>> model.add_module("features", nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3)))
        >>> model.add_module("classifier", nn.Linear(4, 2))
        >>> [name for name, _, _ in select_parameters(model)]
        ['features.0.weight', 'features.2.weight', 'classifier.weight']
        >>> [name for name, _, _ in select_parameters(model, include=r"features\..*", exclude=r".*\.0\..*")]
        ['features.2.weight']
        >>> [name for name, _, _ in select_parameters(model, include=r"classifier\..*", parameter_names=None)]
        ['classifier.weight', 'classifier.bias']
        >>> _, module, name = select_parameters(model)[-1]
        >>> module is model.classifier, name
        (True, 'weight')
        >>> tied = nn.ModuleDict({"embed": nn.Embedding(2, 4), "head": nn.Linear(4, 2), "out": nn.Linear(2, 2)})
        >>> tied.head.weight = tied.embed.weight  # one tensor, two names
        >>> [name for name, _, _ in select_parameters(tied, exclude=r"embed\..*")]
        ['out.weight']

    """
    includes = compile_patterns("include", include)
    excludes = compile_patterns("exclude", exclude)
    types, names = _filters(module_types, parameter_names)

    excluded = {  # a tensor excluded under one of its names is excluded under all of them
        id(parameter)
        for prefix, module in model.named_modules(remove_duplicate=False)
        for name, parameter in _own_parameters(module)
        if any(pattern.fullmatch(_qualify(prefix, name)) for pattern in excludes)
    }
    selected = []
    seen: set[int] = set()
    for prefix, module in model.named_modules():
        if types is not None and not isinstance(module, types):
            continue
        for name, parameter in _own_parameters(module):
            if names is not None and name not in names:
                continue
            qualified_name = _qualify(prefix, name)
            if includes and not any(pattern.fullmatch(qualified_name) for pattern in includes):
                continue
            if id(parameter) in excluded or id(parameter) in seen:
                continue
            seen.add(id(parameter))
            selected.append((qualified_name, module, name))

    if not selected:
        type_names = None if types is None else [cls.__name__ for cls in types]
        raise ValueError(
            "no parameter of the model matches the selection: "
            f"include={include!r}, exclude={exclude!r}, module_types={type_names!r}, "
            f"parameter_names={None if names is None else sorted(names)!r}"
        )
    return selected


def unmatched_patterns(
    model: nn.Module, include: Sequence[str] | str | None = None, exclude: Sequence[str] | str | None = None
) -> list[str]:
    r"""The ``include`` and ``exclude`` patterns that fully match no parameter name of ``model`` (under any of its
    names, any module type): most likely a typo, or a name written without the ``.*`` a suffix match needs.

    Example:
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
        >>> unmatched_patterns(model, include=["0.weight", "2.wieght"], exclude="weight")
        ["include pattern '2.wieght'", "exclude pattern 'weight'"]
    """
    names = [
        _qualify(prefix, name)
        for prefix, module in model.named_modules(remove_duplicate=False)
        for name, _ in _own_parameters(module)
    ]
    return patterns_matching_none(names, include, exclude)


def includes_left_out(
    model: nn.Module, selection: Sequence[tuple[str, nn.Module, str]], include: Sequence[str] | str | None
) -> dict[str, list[str]]:
    r"""The ``include`` patterns that match parameters of ``model`` none of which ``selection`` holds (under any of
    their names): the module types, attribute names or ``exclude`` left every tensor they name out. Maps each such
    pattern to the first names it matches.

    Example:
        >>> from torch import nn
        >>> model = nn.ModuleDict({"rnn": nn.LSTM(2, 2), "head": nn.Linear(2, 2)})
        >>> selection = select_parameters(model, include=[r"rnn\.weight_ih_l0", r"head\..*"])
        >>> [name for name, _, _ in selection], includes_left_out(model, selection, [r"rnn\.weight_ih_l0", r"head\..*"])
        (['head.weight'], {'rnn\\.weight_ih_l0': ['rnn.weight_ih_l0']})
    """
    kept = {id(prune.original(module, name)) for _, module, name in selection}
    named = [
        (_qualify(prefix, name), id(parameter))
        for prefix, module in model.named_modules(remove_duplicate=False)
        for name, parameter in _own_parameters(module)
    ]
    left_out = {}
    for pattern in compile_patterns("include", include):
        matches = [(qualified, ident) for qualified, ident in named if pattern.fullmatch(qualified)]
        if matches and not any(ident in kept for _, ident in matches):
            left_out[pattern.pattern] = [qualified for qualified, _ in matches[:3]]
    return left_out


def patterns_matching_none(
    names: Iterable[str], include: Sequence[str] | str | None = None, exclude: Sequence[str] | str | None = None
) -> list[str]:
    r"""The ``include`` and ``exclude`` patterns that fully match none of ``names``, as ``"<kind> pattern '<p>'"``.

    Example:
        >>> patterns_matching_none(["fc1.weight", "fc2.weight"], include=[r"fc1\..*", "fc3"])
        ["include pattern 'fc3'"]
    """
    names = list(names)
    return [
        f"{kind} pattern {pattern.pattern!r}"
        for kind, patterns in (("include", include), ("exclude", exclude))
        for pattern in compile_patterns(kind, patterns)
        if not any(pattern.fullmatch(name) for name in names)
    ]


def check_parameter_names(parameter_names: Any) -> None:
    """Refuse a ``parameter_names`` that is not ``None``, a str or a sequence of str, naming it.

    Example:
        >>> check_parameter_names(["weight", "bias"])
        >>> check_parameter_names(5)
        Traceback (most recent call last):
        ...
        TypeError: parameter_names=5 must be None, an attribute name (str) or a sequence of them
    """
    if parameter_names is None or isinstance(parameter_names, str):
        return
    if not isinstance(parameter_names, Iterable) or not all(isinstance(n, str) for n in parameter_names):
        raise TypeError(
            f"parameter_names={parameter_names!r} must be None, an attribute name (str) or a sequence of them"
        )


def parametrized_hint(module: nn.Module, name: str) -> str:
    """Where the tensors behind ``module.<name>`` are when a ``torch.nn.utils.parametrize`` parametrization computes
    it (``""`` when none does): the ``original`` Parameters to prune instead.

    Example:
        >>> from torch.nn.utils.parametrizations import weight_norm
        >>> parametrized_hint(weight_norm(nn.Linear(2, 2)), "weight")  # doctest: +ELLIPSIS
        "'weight' is computed by a torch.nn.utils.parametrize parametrization (_WeightNorm) from ['original0', ..."
    """
    from torch.nn.utils import parametrize

    if not parametrize.is_parametrized(module, name):
        return ""
    parametrizations: nn.ModuleList = getattr(module, "parametrizations")[name]  # noqa: B009 (a Module's attribute)
    kinds = ", ".join(type(p).__name__ for p in parametrizations)
    originals = [n for n, _ in parametrizations.named_parameters(recurse=False)]
    return (
        f"{name!r} is computed by a torch.nn.utils.parametrize parametrization ({kinds}) from {originals}: prune "
        f"those, e.g. (module.parametrizations.{name}, {originals[-1]!r}), when the parametrization keeps zeros"
    )


def parametrized_left_out(
    model: nn.Module,
    module_types: Sequence[type[nn.Module]] | type[nn.Module] | None = DEFAULT_MODULE_TYPES,
    parameter_names: Sequence[str] | str | None = ("weight",),
    exclude: Sequence[str] | str | None = None,
    include: Sequence[str] | str | None = None,
) -> list[str]:
    r"""The qualified names of tensors :func:`select_parameters` would select but cannot: computed by a
    ``torch.nn.utils.parametrize`` parametrization (the new ``weight_norm``, ``spectral_norm``, ``orthogonal``) or by
    the forward pre-hook of the older ``torch.nn.utils.weight_norm`` / ``spectral_norm``, so not Parameters of their
    module. ``include`` and ``exclude`` patterns apply to them too.

    Example:
        >>> from torch.nn.utils.parametrizations import weight_norm
        >>> parametrized_left_out(nn.Sequential(weight_norm(nn.Linear(2, 2)), nn.Linear(2, 2)))
        ['0.weight']
        >>> parametrized_left_out(nn.Sequential(nn.Linear(2, 2), nn.utils.weight_norm(nn.Linear(2, 2))))
        ['1.weight']
    """
    types, names = _filters(module_types, parameter_names)
    excludes, includes = compile_patterns("exclude", exclude), compile_patterns("include", include)
    found = []
    for prefix, module in model.named_modules():
        if types is not None and not isinstance(module, types):
            continue
        for name in _computed_tensors(module):
            if names is not None and name not in names:
                continue
            qualified = _qualify(prefix, name)
            if includes and not any(pattern.fullmatch(qualified) for pattern in includes):
                continue
            if not any(pattern.fullmatch(qualified) for pattern in excludes):
                found.append(qualified)
    return found


def _computed_tensors(module: nn.Module) -> list[str]:
    """The names of ``module``'s tensors computed by a parametrization, new (``parametrize``) or old (a forward
    pre-hook of ``torch.nn.utils.weight_norm`` / ``spectral_norm``), that are not Parameters."""
    from torch.nn.utils import parametrize
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    names = list(getattr(module, "parametrizations", {})) if parametrize.is_parametrized(module) else []
    for hook in module._forward_pre_hooks.values():
        if isinstance(hook, (WeightNorm, SpectralNorm)) and hook.name not in module._parameters:
            names.append(hook.name)
    return names


def resolve_pairs(model: nn.Module, pairs: Iterable[tuple[nn.Module, str]]) -> list[tuple[str, nn.Module, str]]:
    """Turn explicit ``(module, name)`` pairs into ``(qualified_name, module, name)`` triples.

    This is the explicit alternative to :func:`select_parameters`, for ``parameters_to_prune``-style configuration.

    Args:
        model: the model that contains every module of ``pairs``.
        pairs: ``(module, name)`` pairs, ``name`` being the user's name of a parameter of ``module`` (``"weight"``
            even when that weight is already pruned).

    Returns:
        Triples in the order of ``pairs``; a parameter given twice (or shared) appears once, at its first position.

    Raises:
        ValueError: if ``pairs`` is empty, a module is not part of ``model``, or a module has no parameter ``name``
            (the message lists the module's parameter names).

    Example:
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        >>> resolve_pairs(model, [(model[2], "weight"), (model[0], "bias")])
        [('2.weight', Linear(in_features=4, out_features=2, bias=True), 'weight'),
         ('0.bias', Linear(in_features=4, out_features=4, bias=True), 'bias')]
        >>> resolve_pairs(model, [(model[0], "wieght")])
        Traceback (most recent call last):
        ...
        ValueError: module '0' (Linear) has no parameter 'wieght'; its parameters are ['weight', 'bias']

    """
    prefixes: dict[int, str] = {}
    for prefix, module in model.named_modules():
        prefixes.setdefault(id(module), prefix)

    triples = []
    seen: set[int] = set()
    for index, pair in enumerate(pairs):
        module, name = _unpack_pair(index, pair)
        prefix = prefixes.get(id(module))
        if prefix is None:
            raise ValueError(f"pairs[{index}]: module {type(module).__name__} is not a submodule of the model")
        parameters = dict(_own_parameters(module))
        if name not in parameters:
            hint = ""
            base = name[: -len(_ORIG_SUFFIX)]
            computed = parametrized_hint(module, name)
            if name.endswith(_ORIG_SUFFIX) and base in parameters:
                hint = f" ({name!r} holds the original values of the pruned tensor {base!r}; pass {base!r})"
            elif computed:
                hint = f" ({computed})"
            where = f"module {prefix!r}" if prefix else "the model itself"
            raise ValueError(
                f"{where} ({type(module).__name__}) has no parameter {name!r}; "
                f"its parameters are {list(parameters)!r}{hint}"
            )
        if id(parameters[name]) in seen:
            continue
        seen.add(id(parameters[name]))
        triples.append((_qualify(prefix, name), module, name))

    if not triples:
        raise ValueError("pairs is empty: give at least one (module, parameter name) pair to prune")
    return triples


def check_pairs(pairs: Iterable[Any], what: str = "pairs") -> list[tuple[nn.Module, str]]:
    """``pairs`` as a list of ``(module, parameter name)`` pairs, or a ``ValueError`` naming the first that is not
    one (a tensor is described by its type and shape, not printed).

    Example:
        >>> from torch import nn
        >>> layer = nn.Linear(2, 2)
        >>> len(check_pairs([(layer, "weight")]))
        1
        >>> check_pairs([layer.weight], "parameters")
        Traceback (most recent call last):
        ...
        ValueError: parameters[0] is a Parameter of shape (2, 2), not a (module, parameter name) pair: ...
    """
    return [_unpack_pair(index, pair, what) for index, pair in enumerate(pairs)]


def _unpack_pair(index: int, pair: Any, what: str = "pairs") -> tuple[nn.Module, str]:
    try:
        module, name = pair
        ok = isinstance(module, nn.Module) and isinstance(name, str)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(
            f"{what}[{index}] is {_describe(pair)}, not a (module, parameter name) pair: write (module, 'weight')"
        )
    return module, name


def _describe(value: Any) -> str:
    """A short description of ``value`` for a message: tensors by type and shape, other values by repr."""
    if isinstance(value, torch.Tensor):
        return f"a {type(value).__name__} of shape {tuple(value.shape)}"
    if isinstance(value, nn.Module):
        return f"a {type(value).__name__} module"
    text = repr(value)
    return text if len(text) <= 80 else f"a {type(value).__name__}"


def resolve_module_types(
    module_types: Sequence[type[nn.Module] | str] | type[nn.Module] | str | None,
) -> tuple[type[nn.Module], ...] | None:
    """Module classes from classes or their import paths (``"transformers.pytorch_utils.Conv1D"``).

    Import paths let a YAML config name a class, as Hydra users expect.

    Raises:
        ValueError: a path cannot be imported or does not name an ``nn.Module`` subclass (the message names it).

    Example:
        >>> resolve_module_types(["torch.nn.Linear", nn.Conv2d])
        (<class 'torch.nn.modules.linear.Linear'>, <class 'torch.nn.modules.conv.Conv2d'>)
        >>> resolve_module_types("torch.nn.Lienar")
        Traceback (most recent call last):
        ...
        ValueError: module_types entry 'torch.nn.Lienar' cannot be imported: module 'torch.nn' has no attribute 'Lienar'
    """
    if module_types is None:
        return None
    if isinstance(module_types, (str, type)):
        module_types = [module_types]
    resolved = []
    for entry in module_types:
        cls: Any = entry
        if isinstance(entry, str):
            module_name, _, class_name = entry.rpartition(".")
            try:
                cls = getattr(importlib.import_module(module_name), class_name) if module_name else None
            except (ImportError, AttributeError) as err:
                raise ValueError(f"module_types entry {entry!r} cannot be imported: {err}") from None
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise ValueError(
                f"module_types entry {entry!r} is not an nn.Module subclass nor the import path of one "
                "(e.g. 'torch.nn.Linear')"
            )
        resolved.append(cls)
    return tuple(resolved)


def parameter_owners(model: nn.Module) -> dict[int, list[tuple[str, nn.Module, str]]]:
    """Every place a parameter is registered in ``model``, keyed by ``id(parameter)``.

    A parameter tied between modules (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``; ``b.weight =
    a.weight``) has several owners; each owner is ``(qualified_name, module, name)`` with the user's name (``weight``
    for a pruned ``weight_orig``). A module registered under several names counts once, under its first name.

    Example:
        >>> a, b = nn.Linear(2, 2), nn.Linear(2, 2)
        >>> b.weight = a.weight
        >>> owners = parameter_owners(nn.Sequential(a, b))
        >>> [qualified for qualified, _, _ in owners[id(a.weight)]]
        ['0.weight', '1.weight']
    """
    owners: dict[int, list[tuple[str, nn.Module, str]]] = {}
    seen: set[tuple[int, str]] = set()
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, parameter in _own_parameters(module):
            if (id(module), name) in seen:
                continue
            seen.add((id(module), name))
            owners.setdefault(id(parameter), []).append((_qualify(prefix, name), module, name))
    return owners
