"""Which tensors a :class:`~lightprune.callback.PruningCallback` prunes in a model: the explicit ``(module, name)``
pairs, or the tensors its patterns, module types and parameter names select, with the warnings a selection that
misses what the user probably meant deserves (a pattern matching nothing, tensors computed by a parametrization,
an include pattern the other filters empty)."""

from __future__ import annotations

from collections.abc import Sequence

from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from lightprune.callback import setup_checks
from lightprune.selection import (
    includes_left_out,
    parametrized_left_out,
    resolve_pairs,
    select_parameters,
    unmatched_patterns,
)

__all__ = ["selected"]

Selection = list[tuple[str, nn.Module, str]]


def selected(
    model: nn.Module,
    parameters: Sequence[tuple[nn.Module, str]] | None,
    include: Sequence[str] | str | None,
    exclude: Sequence[str] | str | None,
    module_types: Sequence[type[nn.Module]] | type[nn.Module] | None,
    parameter_names: Sequence[str] | str | None,
) -> Selection:
    """The ``(qualified name, module, name)`` of the tensors to prune in ``model``: ``parameters`` if given, else the
    pattern selection; a lazy module not yet materialized or a reserved name (``..._orig``) is refused.

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
        >>> [q for q, _, _ in selected(model, None, None, r"2\\..*", (nn.Linear,), ("weight",))]
        ['0.weight']
    """
    selection = (
        resolve_pairs(model, parameters)
        if parameters is not None
        else _by_patterns(model, include, exclude, module_types, parameter_names)
    )
    setup_checks.refuse_uninitialized(selection)
    setup_checks.refuse_reserved_names(selection)
    return selection


def _by_patterns(
    model: nn.Module,
    include: Sequence[str] | str | None,
    exclude: Sequence[str] | str | None,
    module_types: Sequence[type[nn.Module]] | type[nn.Module] | None,
    parameter_names: Sequence[str] | str | None,
) -> Selection:
    """The pattern selection, with its warnings."""
    unmatched = unmatched_patterns(model, include, exclude)
    if unmatched:  # a pattern matches the whole qualified name: "fc1.weight" is not "model.fc1.weight"
        rank_zero_warn(
            f"PruningCallback: {', '.join(unmatched)} matches no parameter of the model (patterns match whole "
            "qualified names, e.g. 'model.fc1.weight': write '.*fc1\\.weight' to match a suffix)",
            category=UserWarning,
        )
    parametrized = parametrized_left_out(model, module_types, parameter_names, exclude, include)
    if parametrized:  # (said before a selection left empty by them is refused)
        rank_zero_warn(
            f"PruningCallback: {parametrized[:3]} are computed from other parameters by a parametrization, so "
            "the selection leaves them out: prune their originals by name (torch.nn.utils.parametrizations."
            "weight_norm: '...parametrizations.weight.original1', with module_types=None and "
            "parameter_names=None; the older torch.nn.utils.weight_norm: parameter_names=['weight_v']), or "
            "exclude them",
            category=UserWarning,
        )
    selection = select_parameters(
        model, include=include, exclude=exclude, module_types=module_types, parameter_names=parameter_names
    )
    for pattern, names in includes_left_out(model, selection, include).items():
        rank_zero_warn(
            f"PruningCallback: include pattern {pattern!r} matches {names}, but module_types / parameter_names / "
            "exclude leave all of it out: add its module type and attribute name to module_types and "
            "parameter_names (or pass parameters=[(module, name)]) to prune it",
            category=UserWarning,
        )
    return selection
