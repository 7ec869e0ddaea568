"""The rules that tie the pruning choices together: one set of checks and messages for the callback and the app.

:class:`lightprune.PruningCallback` raises the first problem these functions find when it is built; the experiment
app's :func:`~lightprune.experiment.config.validate_config` lists every one of them under its ``pruning.`` keys before
anything is imported or trained. Methods are named as :mod:`lightprune.registry` names them, and their traits (kind,
random, signed, ...) are read from their entries; any other name (a user's own class, by its class name) or ``None``
is a custom method, which only its ``PRUNING_TYPE`` describes. Like :mod:`lightprune.registry`, this module imports
nothing heavy. (The engine checks its own arguments, ``max_layer_sparsity`` among them, without this module: see
:func:`lightprune.prune.collapse.check_max_layer_sparsity`.)

Example:
    >>> method_problems("ln_structured", "structured", scope="global")
    [Problem(key='scope', value='global', message='a global ranking needs an unstructured method, and ln_structured \
is structured: use scope=layerwise')]
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from lightprune import choices, registry

__all__ = [
    "Problem",
    "cap_problems",
    "importance_problems",
    "kind_of",
    "method_problems",
    "n_m_problems",
    "obs_problems",
    "owl_problems",
    "regrow_problems",
]


class Problem(NamedTuple):
    """One broken rule: the key whose value breaks it, that value, and why (with what to do instead)."""

    key: str
    value: Any
    message: str

    def format(self, prefix: str = "") -> str:
        """``"<prefix><key>=<value>: <message>"``, the form of every configuration error.

        Example:
            >>> Problem("scope", "row", "needs l1_unstructured").format("pruning.")
            "pruning.scope='row': needs l1_unstructured"
        """
        return f"{prefix}{self.key}={self.value!r}: {self.message}"


def kind_of(method: str) -> str | None:
    """The ``PRUNING_TYPE`` of a method named in :data:`lightprune.choices.METHODS` (``None`` for another name):
    its registry entry's (:attr:`~lightprune.registry.Method.pruning_type`), or ``"units"`` for the unit methods.

    Example:
        >>> kind_of("ln_structured"), kind_of("l1_unstructured"), kind_of("semi_structured"), kind_of("my.Method")
        ('structured', 'unstructured', 'global', None)
        >>> kind_of("heads")
        'units'
    """
    if method in choices.UNIT_METHODS:
        return "units"
    entry = registry.get(method)
    return None if entry is None else entry.pruning_type


def _names(trait: str) -> str:
    """``"a or b"``: the registered methods with ``trait`` (what a message offers instead)."""
    return " or ".join(name for name, entry in registry.METHODS.items() if getattr(entry, trait))


def method_problems(
    method: str | None,
    kind: str | None,
    *,
    scope: str,
    prune_channel_bias: bool = False,
    dim: int | None = None,
) -> list[Problem]:
    """The scope and channel-bias rules for ``method`` (a :mod:`~lightprune.choices` name, else ``None``) of
    ``PRUNING_TYPE`` ``kind`` (``None`` when unknown: the rules that need it are left to the built method).

    Example:
        >>> method_problems("l1_unstructured", "unstructured", scope="global")
        []
        >>> [p.key for p in method_problems("l1_unstructured", "unstructured", scope="global", prune_channel_bias=True)]
        ['prune_channel_bias']
    """
    label = method or "a custom method"
    entry = registry.get(method)
    problems: list[Problem] = []
    if method in choices.UNIT_METHODS:
        if scope not in choices.UNIT_SCOPES:
            problems.append(
                Problem(
                    "scope",
                    scope,
                    f"{method} ranks whole units per layer or across layers: use one of {choices.UNIT_SCOPES}",
                )
            )
        if prune_channel_bias:
            problems.append(
                Problem("prune_channel_bias", prune_channel_bias, f"{method} prunes the units' biases already")
            )
        return problems
    if entry is not None and entry.kind == "n:m" and scope != "layerwise":
        problems.append(
            Problem("scope", scope, f"{method} ranks its N:M groups within each layer: use scope=layerwise")
        )
    elif scope == "global" and kind is not None and kind != "unstructured":
        problems.append(
            Problem(
                "scope",
                scope,
                f"a global ranking needs an unstructured method, and {label} is {kind}: use scope=layerwise",
            )
        )
    elif scope in choices.ALLOCATION_SCOPES and kind is not None and kind != "unstructured":
        problems.append(
            Problem(
                "scope",
                scope,
                f"{scope} allocates each layer a share of the weights, which needs an unstructured method, and "
                f"{label} is {kind}: use scope=layerwise",
            )
        )
    if scope == "row" and not (entry is not None and entry.rows):
        problems.append(Problem("scope", scope, f"row ranks every row's entries as {_names('rows')} does, not {label}"))
    if prune_channel_bias and not (kind == "structured" and dim == 0):
        problems.append(
            Problem(
                "prune_channel_bias",
                prune_channel_bias,
                f"needs a structured method pruning output channels (dim=0); got {label} with dim={dim}",
            )
        )
    return problems


def importance_problems(
    importance: Any,
    method: str | None,
    *,
    calibration_batches: int = 0,
    scope: str | None = None,
    reconstruct: bool = False,
    activation_window: int = 1,
) -> list[Problem]:
    """The rules between a criterion (:data:`lightprune.choices.IMPORTANCES`, or a callable: ``"callable"``), the
    method ranking by it, the calibration batches and activation window collecting its statistics and the scope
    (``"owl"`` allocates by the outliers of activation scores; ``None``: not checked).

    Example:
        >>> print(importance_problems("movement", "ln_structured")[0].message)
        movement ranks signed scores, which ln_structured cannot (a norm or a custom method would drop their sign): use
        method l1_unstructured or semi_structured
        >>> importance_problems("activation", "l1_unstructured", calibration_batches=4)
        []
        >>> importance_problems("magnitude", "l1_unstructured", scope="owl")[0].format()
        "importance='magnitude': scope=owl allocates by the outliers of |W| * ||X|| scores: use importance=activation"
    """
    label = method or "a custom method"
    entry = registry.get(method)
    problems: list[Problem] = []
    if scope == "owl" and importance != "activation":
        problems.append(
            Problem(
                "importance",
                importance,
                "scope=owl allocates by the outliers of |W| * ||X|| scores: use importance=activation",
            )
        )
    if (
        calibration_batches
        and importance not in choices.STATISTICS_IMPORTANCES
        and not (reconstruct and method in choices.UNIT_METHODS)
    ):
        problems.append(
            Problem(
                "calibration_batches",
                calibration_batches,
                f"collects input statistics, which only importance=activation or obs uses (importance={importance})"
                + (" and reconstruct=True" if method in choices.UNIT_METHODS else ""),
            )
        )
    if (
        activation_window != 1
        and importance not in choices.STATISTICS_IMPORTANCES
        and not (reconstruct and method in choices.UNIT_METHODS)
    ):
        problems.append(
            Problem(
                "activation_window",
                activation_window,
                f"is the window of input statistics, which only importance=activation or obs collects "
                f"(importance={importance})" + (" and reconstruct=True" if method in choices.UNIT_METHODS else ""),
            )
        )
    random = entry is not None and entry.random
    if importance == "obs" and not (random or (entry is not None and entry.obs)):
        problems.append(
            Problem(
                "importance",
                importance,
                f"obs chooses single weights (or N:M groups) while it updates the others, which {label} cannot: use "
                f"method {_names('obs')}",
            )
        )
    if importance != "magnitude" and random:
        problems.append(Problem("importance", importance, f"{label} draws at random and ignores scores"))
    signed = random or method in choices.UNIT_METHODS or (entry is not None and entry.signed)
    if importance == "movement" and not signed:
        problems.append(
            Problem(
                "importance",
                importance,
                f"movement ranks signed scores, which {label} cannot (a norm or a custom method would drop their "
                f"sign): use method {_names('signed')}",
            )
        )
    return problems


def _number(value: Any) -> bool:
    """Whether ``value`` is a real number: an int or float, not a bool, not NaN."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


def _set_while_off(given: tuple[tuple[str, Any, Any], ...], why: str) -> list[Problem]:
    """A problem for each ``(key, value, default)`` of ``given`` whose value is not its default number: an option of a
    feature that is off, which the user likely meant to turn on (left alone, it would change nothing, silently)."""
    return [Problem(key, value, why) for key, value, default in given if not (_number(value) and value == default)]


def owl_problems(threshold: Any, lam: Any, *, scope: str | None = None) -> list[Problem]:
    """OWL's ``M`` (``owl_threshold``) is a number > 0 and its ``lambda`` (``owl_lambda``) one in [0, 0.5]; with a
    ``scope`` other than ``"owl"`` both keep their defaults (a forgotten ``scope="owl"`` would otherwise allocate
    nothing, silently).

    Example:
        >>> [p.key for p in owl_problems(0, 0.08)]
        ['owl_threshold']
        >>> [p.key for p in owl_problems(5.0, 0.2, scope="global")]  # an option of what is off
        ['owl_lambda']
    """
    if scope is not None and scope != "owl":
        given = (("owl_threshold", threshold, choices.OWL_THRESHOLD), ("owl_lambda", lam, choices.OWL_LAMBDA))
        return _set_while_off(given, f"is used with scope='owl' only (scope={scope!r}: no OWL allocation)")
    problems = []
    if not (_number(threshold) and threshold > 0):
        problems.append(Problem("owl_threshold", threshold, "must be a float > 0 (outliers: scores above it x mean)"))
    if not (_number(lam) and 0 <= lam <= 0.5):
        why = "must be a float in [0, 0.5] (the layers' sparsities span 2 * lambda)"
        problems.append(Problem("owl_lambda", lam, why))
    return problems


def regrow_problems(
    regrow: Any,
    every: Any,
    fraction: Any,
    until: Any,
    *,
    method: str | None = None,
    kind: str | None = None,
    scope: str | None = None,
) -> list[Problem]:
    """Dynamic sparse training: ``regrow`` is ``None`` (off) or one of :data:`lightprune.choices.REGROW`, with an int
    ``every`` >= 1, a ``fraction`` in (0, 1) and an ``until`` in (0, 1]; masks move weight by weight within each
    tensor, so it needs an unstructured method (``kind``) and a scope other than ``"row"``.

    Example:
        >>> regrow_problems("rigl", 100, 0.3, 0.75)
        []
        >>> [p.key for p in regrow_problems("rigl", 0, 1.5, 0.75, method="ln_structured", kind="structured")]
        ['regrow_every', 'regrow_fraction', 'method']
        >>> [p.key for p in regrow_problems(None, 50, 0.3, 0.75)]  # an option of what is off
        ['regrow_every']
    """
    if regrow is None:  # options of what is off: a forgotten regrow= would otherwise train static masks silently
        given = (
            ("regrow_every", every, choices.REGROW_EVERY),
            ("regrow_fraction", fraction, choices.REGROW_FRACTION),
            ("regrow_until", until, choices.REGROW_UNTIL),
        )
        return _set_while_off(given, "is used with regrow='rigl' or 'set' only (regrow=None: the masks do not move)")
    if regrow not in choices.REGROW:
        return [Problem("regrow", regrow, f"one of {choices.REGROW}, or None (no dynamic sparse training)")]
    problems = []
    if not (isinstance(every, int) and not isinstance(every, bool) and every >= 1):
        problems.append(Problem("regrow_every", every, "must be an int >= 1 (optimizer steps between mask updates)"))
    if not (_number(fraction) and 0 < fraction < 1):
        problems.append(Problem("regrow_fraction", fraction, "must be a float in (0, 1) (share of active weights)"))
    if not (_number(until) and 0 < until <= 1):
        problems.append(Problem("regrow_until", until, "must be a float in (0, 1] (a fraction of the run)"))
    label = method or "a custom method"
    if kind is not None and kind != "unstructured":
        problems.append(
            Problem("method", method, f"regrow={regrow} moves single weights, which needs an unstructured method, "
                    f"and {label} is {kind}")
        )  # fmt: skip
    if scope == "row":
        problems.append(
            Problem("scope", scope, f"regrow={regrow} moves weights within each tensor, not within each row: use "
                    "scope=erk, global or layerwise")
        )  # fmt: skip
    return problems


def n_m_problems(
    method: str, n: int, m: int, *, one_event: bool, sparsity: float | None, schedule: Any = None
) -> list[Problem]:
    """An N:M pattern (of ``method``, a registered method of kind ``"n:m"``) is fixed: its run is one event
    (``one_event``) to ``1 - n/m`` (``sparsity``); ``schedule`` is what a problem shows as the bad value (by default
    the sparsity, or that there are several events).

    Example:
        >>> n_m_problems("semi_structured", 2, 4, one_event=True, sparsity=0.5)
        []
        >>> n_m_problems("semi_structured", 2, 4, one_event=False, sparsity=0.9)[0].format()
        "schedule='a schedule of several events': semi_structured with n=2, m=4 prunes 1 - n/m = 0.5 of the weights \
in one event: give a one-shot schedule to 0.5"
    """
    fixed = 1 - n / m
    if one_event and sparsity is not None and abs(sparsity - fixed) < 1e-9:
        return []
    return [
        Problem(
            "schedule",
            schedule if schedule is not None else (sparsity if one_event else "a schedule of several events"),
            f"{method} with n={n}, m={m} prunes 1 - n/m = {fixed:g} of the weights in one event: give a "
            f"one-shot schedule to {fixed:g}"
            + (f" (this one prunes to {sparsity:g})" if one_event and sparsity else ""),
        )
    ]


def cap_problems(
    max_layer_sparsity: Any, *, scope: str | None = None, final_sparsity: float | None = None
) -> list[Problem]:
    """``max_layer_sparsity`` is a float in (0, 1] (1.0: no cap); in ``"layerwise"`` and ``"row"`` scope, where every
    tensor is pruned to the target, it may not be below the schedule's ``final_sparsity`` (``None``: not known yet).
    In ``"global"``, ``"erk"`` and ``"owl"`` scope the other tensors take what a capped one cannot give.

    Example:
        >>> cap_problems(0.9, scope="global", final_sparsity=0.95)
        []
        >>> [p.format() for p in cap_problems(1.5)]
        ['max_layer_sparsity=1.5: must be a float in (0, 1] (1.0: no cap)']
        >>> print(cap_problems(0.5, scope="layerwise", final_sparsity=0.8)[0].message)
        is below the final sparsity 0.8, and scope=layerwise prunes every tensor to the target: lower the target or \
raise the cap
    """
    value = max_layer_sparsity
    if not (_number(value) and 0 < value <= 1):
        return [Problem("max_layer_sparsity", value, "must be a float in (0, 1] (1.0: no cap)")]
    if scope in ("layerwise", "row") and final_sparsity is not None and final_sparsity > value:
        return [
            Problem(
                "max_layer_sparsity",
                value,
                f"is below the final sparsity {final_sparsity:g}, and scope={scope} prunes every tensor to the "
                "target: lower the target or raise the cap",
            )
        ]
    return []


def obs_problems(
    importance: Any,
    *,
    reconstruct: bool | None,
    sequential: bool,
    scope: str,
    calibration_batches: int,
    max_layer_sparsity: Any = 1.0,
) -> list[Problem]:
    """The rules of OBS's own options: ``reconstruct`` (``None``: the default, on for obs) and ``sequential``
    calibration belong to ``importance=obs``; sequential calibration prunes layer by layer at the start, from
    calibration batches, so it needs them and cannot compare saliencies across layers (``scope=global``).

    Example:
        >>> obs_problems("obs", reconstruct=None, sequential=True, scope="row", calibration_batches=8)
        []
        >>> [p.key for p in obs_problems("activation", reconstruct=True, sequential=False, scope="row",
        ...                              calibration_batches=0)]
        ['reconstruct']
    """
    problems: list[Problem] = []
    if reconstruct is not None and not isinstance(reconstruct, bool):
        problems.append(Problem("reconstruct", reconstruct, "must be None (the default: on for obs) or a bool"))
    elif reconstruct and importance != "obs":
        problems.append(Problem("reconstruct", reconstruct, f"updates the kept weights by OBS: needs importance=obs, "
                                f"not {importance}"))  # fmt: skip
    capped = isinstance(max_layer_sparsity, (int, float)) and max_layer_sparsity < 1
    if importance == "obs" and reconstruct is not False and scope == "global" and capped:
        problems.append(Problem("max_layer_sparsity", max_layer_sparsity, "is not applied by OBS reconstruction's "
                                "global counts yet: use scope=row or layerwise, or reconstruct=False"))  # fmt: skip
    if importance == "obs" and reconstruct is not False and scope in choices.ALLOCATION_SCOPES:
        problems.append(Problem("scope", scope, "OBS reconstruction counts per layer for global, layerwise or row "
                                "scope, not per-layer allocation yet: use reconstruct=False"))  # fmt: skip
    if not isinstance(sequential, bool):
        problems.append(Problem("sequential", sequential, "must be a bool"))
    elif sequential:
        if importance != "obs" or reconstruct is False:
            problems.append(Problem("sequential", sequential, "takes each block's statistics through the blocks "
                                    "already reconstructed: needs importance=obs with reconstruct on"))  # fmt: skip
        if not calibration_batches:
            problems.append(Problem("sequential", sequential, "runs the calibration batches once per block: set "
                                    "calibration_batches > 0"))  # fmt: skip
        if scope == "global":
            problems.append(Problem("sequential", sequential, "prunes block by block, so saliencies cannot be "
                                    "compared across layers: use scope=layerwise or row"))  # fmt: skip
    return problems
