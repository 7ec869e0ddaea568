"""The names and values ``PruningCallback`` accepts: methods, scopes, units, schedules, rewind points."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from numbers import Real
from typing import Any, cast

from lightning.pytorch import Trainer
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torch.nn.utils import prune as torch_prune

from lightprune import choices, prune, registry, rules
from lightprune._checks import is_int
from lightprune.callback import clock
from lightprune.schedules import Constant, FromCallable, Schedule

__all__ = [
    "MASKING",
    "METHODS",
    "SCOPES",
    "UNITS",
    "check_choice",
    "check_n_m_schedule",
    "check_owl",
    "check_rewind_time",
    "check_unused_inputs",
    "is_n_m",
    "method_entry",
    "method_name",
    "raise_problems",
    "resolve_method",
    "resolve_method_options",
    "resolve_rewind",
    "resolve_schedule",
    "schedule_for_run",
    "unknown_length_hint",
]


METHODS: Mapping[str, type[prune.BasePruningMethod]] = registry.Lookup(lambda entry: entry.load())
"""Pruning methods the callback accepts by name (a view of :data:`lightprune.registry.METHODS`: a method registered
there is accepted at once); any ``BasePruningMethod`` subclass (or its import path) works too."""

SCOPES = choices.SCOPES
"""One ranking across the whole selection, one per tensor, one per row of every tensor (``l1_unstructured``), or one
per tensor with amounts allocated by ERK or OWL."""

UNITS = choices.UNITS
"""What the schedule's times count: optimizer steps or epochs."""

MASKING = choices.MASKING
"""How masks act during training: torch's reparametrization, or plain Parameters zeroed in place."""


def resolve_method(method: str | type[prune.BasePruningMethod]) -> type[prune.BasePruningMethod]:
    """A method class from a :data:`METHODS` name, an import path ``"package.module.Class"`` or the class itself.

    Example:
        >>> resolve_method("ln_structured").__name__, resolve_method("lightprune.prune.Identity").__name__
        ('LnStructured', 'Identity')
    """
    if isinstance(method, type) and issubclass(method, prune.BasePruningMethod):
        return method
    if isinstance(method, str) and method.startswith("torch.nn.utils.prune."):
        method = _torch_class(method)
    if isinstance(method, type) and issubclass(method, torch_prune.BasePruningMethod):
        return _lightprune_twin(method)
    if isinstance(method, str):
        module_name, _, class_name = method.rpartition(".")
        if method in METHODS:  # a registry entry names its class by import path too, loaded here
            cls, what = METHODS[method], f" is registered as {METHODS[method]!r}, which"
        elif module_name:
            try:
                cls = getattr(importlib.import_module(module_name), class_name)
            except (ImportError, AttributeError) as err:
                raise ValueError(f"method={method!r} could not be imported: {err}") from err
            what = ""  # (the class it names, imported)
        else:
            cls, what = None, ""
        if cls is not None:
            if isinstance(cls, type) and issubclass(cls, prune.BasePruningMethod):
                return cls
            raise ValueError(f"method={method!r}{what} is not a lightprune.prune.BasePruningMethod subclass")
    allowed = ", ".join(repr(name) for name in METHODS)
    raise ValueError(
        f"method={method!r} is not supported: use one of {allowed}, a BasePruningMethod subclass or its import path"
    )


def _torch_class(path: str) -> Any:
    """The object ``path`` names in ``torch.nn.utils.prune`` (the path itself where there is none)."""
    return getattr(torch_prune, path.rpartition(".")[2], path)


def _lightprune_twin(cls: type) -> type[prune.BasePruningMethod]:
    """lightprune's class of the same name for one of torch's built-in methods; others are refused, saying why."""
    twin = getattr(prune, cls.__name__, None)
    if cls is getattr(torch_prune, cls.__name__, None) and isinstance(twin, type):
        return cast(type[prune.BasePruningMethod], twin)
    raise ValueError(
        f"method={cls!r} derives from torch.nn.utils.prune.BasePruningMethod: the callback runs lightprune's engine, "
        "so derive it from lightprune.prune.BasePruningMethod instead (the same contract: compute_mask, "
        "PRUNING_TYPE)"
    )


def resolve_schedule(schedule: Schedule | float | Callable[[int], float]) -> Schedule:
    """A schedule from a :class:`~lightprune.schedules.Schedule`, a sparsity (one-shot at the start) or a callable.

    Example:
        >>> resolve_schedule(0.5)
        Constant(sparsity=0.5, at=0)
    """
    if isinstance(schedule, Schedule):
        return schedule
    if isinstance(schedule, Real) and not isinstance(schedule, bool):  # numpy's scalars too
        return Constant(float(schedule))
    if callable(schedule):
        return FromCallable(schedule, start=0, end=1.0, frequency=1)
    raise TypeError(
        f"schedule={schedule!r} must be a lightprune.schedules.Schedule, a sparsity in [0, 1] (one-shot at the "
        "start) or a callable time -> target sparsity"
    )


def resolve_rewind(rewind: str | int | Mapping[str, Tensor] | None, unit: str) -> tuple[int | None, dict | None]:
    """``(time to snapshot at, given snapshot)`` from the callback's ``rewind`` argument.

    Example:
        >>> resolve_rewind("init", "step"), resolve_rewind(None, "step")
        ((0, None), (None, None))
    """
    if isinstance(rewind, Mapping):
        bad = next(((k, v) for k, v in rewind.items() if not (isinstance(k, str) and isinstance(v, Tensor))), None)
        if bad is not None:
            raise ValueError(
                f"a rewind snapshot must map parameter names to tensors (see snapshot_weights); got "
                f"{bad[0]!r}: {type(bad[1]).__name__}"
            )
        return 0, {k: v.detach().to("cpu", copy=True) for k, v in rewind.items()}
    if rewind == "init":
        return 0, None
    if rewind is not None and not (is_int(rewind) and rewind >= 0):
        raise ValueError(
            f"rewind={rewind!r} must be None, 'init', an int >= 0 (a time in {unit}s) or a snapshot_weights() dict"
        )
    return rewind, None


def method_name(cls: type[prune.BasePruningMethod]) -> str | None:
    """The :data:`METHODS` name of a method class (``None`` for a user's own class).

    Example:
        >>> method_name(prune.LnStructured), method_name(prune.Identity)
        ('ln_structured', None)
    """
    return next((name for name, known in METHODS.items() if known is cls), None)


def method_entry(cls: type[prune.BasePruningMethod]) -> registry.Method | None:
    """The registry entry that says how the callback builds and applies ``cls``: its own, else (for a subclass of a
    registered class) that class's entry with its kind and defaults but none of the traits of its scores (``random``,
    ``signed``, ``obs``, ``rows``, ``sharded``: the subclass may rank otherwise); ``None`` for any other class.

    Example:
        >>> method_entry(prune.SemiStructured).kind, method_entry(prune.Identity)
        ('n:m', None)
        >>> class Mine(prune.SemiStructured): ...
        >>> entry = method_entry(Mine)
        >>> entry.name, entry.fixed_amount, entry.signed, entry.sharded
        ('semi_structured', True, False, False)
    """
    name = method_name(cls)
    if name is not None:
        return registry.METHODS[name]
    bases = {known: registry.METHODS[name] for name, known in METHODS.items()}
    base = next((bases[parent] for parent in cls.__mro__[1:] if parent in bases), None)
    if base is None:
        return None
    return dataclasses.replace(base, random=False, signed=False, obs=False, rows=False, sharded=False)


_PRUNING_TYPES = {"unstructured": ("unstructured", "global"), "structured": ("structured",), "n:m": ("global",)}
"""The ``PRUNING_TYPE`` a class of each registry kind has (an unstructured method may see the whole tensor)."""


def check_entry(method: Any, cls: type, entry: registry.Method | None) -> None:
    """Refuse a registry entry that does not describe ``cls``: a name whose class another entry names first (that
    one's traits would be read), or a kind its class's ``PRUNING_TYPE`` contradicts (the rules read the kind, the
    engine the class).

    Example:
        >>> check_entry("ln_structured", prune.LnStructured, method_entry(prune.LnStructured))
    """
    own = method_name(cls)
    if isinstance(method, str) and method in registry.METHODS and own not in (None, method):
        raise ValueError(
            f"method={method!r} names {cls.__name__}, which the entry {own!r} names first: its defaults and traits "
            "would be read; register a subclass of it instead"
        )
    pruning_type = getattr(cls, "PRUNING_TYPE", None)
    if own is not None and entry is not None and pruning_type not in _PRUNING_TYPES[entry.kind]:
        raise ValueError(
            f"the registry entry {own!r} says kind={entry.kind!r}, but {cls.__name__}.PRUNING_TYPE is "
            f"{pruning_type!r}: register it as the kind it prunes"
        )


def raise_problems(problems: list[rules.Problem]) -> None:
    """Raise one ``ValueError`` naming every broken rule (nothing when there is none).

    Example:
        >>> raise_problems(rules.method_problems("ln_structured", "structured", scope="row"))
        Traceback (most recent call last):
        ...
        ValueError: scope='row': row ranks every row's entries as l1_unstructured does, not ln_structured
    """
    if problems:
        raise ValueError("; ".join(problem.format() for problem in problems))


def check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    """Raise naming ``value`` and ``allowed`` unless ``value`` is one of them.

    Example:
        >>> check_choice("unit", "batch", UNITS)
        Traceback (most recent call last):
        ...
        ValueError: unit='batch' is not supported: allowed are ('step', 'epoch')
    """
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported: allowed are {allowed}")


def check_owl(threshold: Any, lam: Any, scope: str | None = None) -> tuple[float, float]:
    """OWL's two hyper-parameters as floats: ``threshold`` (``M``) > 0 and ``lam`` (``lambda``) in [0, 0.5], left at
    their defaults unless ``scope`` is ``"owl"`` (or not given).

    Example:
        >>> check_owl(5, 0.08)
        (5.0, 0.08)
        >>> check_owl(5, 0.8)
        Traceback (most recent call last):
        ...
        ValueError: owl_lambda=0.8: must be a float in [0, 0.5] (the layers' sparsities span 2 * lambda)
        >>> check_owl(5, 0.2, "global")
        Traceback (most recent call last):
        ...
        ValueError: owl_lambda=0.2: is used with scope='owl' only (scope='global': no OWL allocation)
    """
    problems = rules.owl_problems(threshold, lam, scope=scope)
    raise_problems(problems)
    return float(threshold), float(lam)


def is_n_m(cls: type[prune.BasePruningMethod]) -> bool:
    """Whether ``cls`` prunes a fixed N:M pattern: its entry's kind is ``"n:m"`` (:func:`method_entry`).

    Example:
        >>> is_n_m(prune.SemiStructured), is_n_m(prune.L1Unstructured), is_n_m(prune.CustomFromMask)
        (True, False, False)
    """
    entry = method_entry(cls)
    return entry is not None and entry.kind == "n:m"


def resolve_method_options(
    method: str | type[prune.BasePruningMethod], method_kwargs: Mapping[str, Any] | None, scope: str | None
) -> tuple[type[prune.BasePruningMethod], dict[str, Any], str]:
    """``(method class, its keyword arguments, scope)``, with the defaults filled in and checked together.

    Structured methods prune output channels (``dim=0``) and ``LnStructured`` the L2 norm (``n=2``) unless told
    otherwise; the scope defaults to ``"global"`` for unstructured methods, ``"layerwise"`` for structured ones. One
    instance is built, so arguments the method does not take fail here.

    Example:
        >>> method, kwargs, scope = resolve_method_options("ln_structured", None, None)
        >>> method.__name__, kwargs, scope
        ('LnStructured', {'dim': 0, 'n': 2}, 'layerwise')
    """
    if isinstance(method, str) and method in choices.UNIT_METHODS:  # masks set per unit (lightprune.structure)
        if method_kwargs:
            raise ValueError(f"method={method!r} takes no method_kwargs; got {dict(method_kwargs)!r}")
        scope = "layerwise" if scope is None else scope
        raise_problems(rules.method_problems(method, rules.kind_of(method), scope=scope))
        return prune.CustomFromMask, {}, scope
    cls = resolve_method(method)
    if method_kwargs is not None and not isinstance(method_kwargs, Mapping):
        raise TypeError(f"method_kwargs={method_kwargs!r} must be a dict of the method's arguments, or None")
    kwargs = dict(method_kwargs or {})
    if "amount" in kwargs:
        raise ValueError("method_kwargs must not contain 'amount': the callback computes it from the schedule")
    kind = getattr(cls, "PRUNING_TYPE", None)
    entry = method_entry(cls)
    check_entry(method, cls, entry)
    if kind == "structured":
        kwargs.setdefault("dim", 0)  # output channels, for a structured class of the user's too
        if not is_int(kwargs["dim"]):  # (else the first event fails, mid-training)
            raise ValueError(f"method_kwargs dim={kwargs['dim']!r} must be an int (the dim of the channels)")
    for key, value in (entry.defaults or {} if entry is not None else {}).items():
        kwargs.setdefault(key, value)
    fixed = entry is not None and entry.fixed_amount
    if entry is not None and fixed and "dim" in kwargs:
        raise ValueError(f"method_kwargs must not contain 'dim' for {entry.name}: each layer's input dim is used")
    try:
        cls(**kwargs) if fixed else cls(amount=0, **kwargs)
    except TypeError as err:
        raise ValueError(f"method_kwargs={kwargs!r} do not fit {cls.__name__}: {err}") from err
    if scope is None:
        scope = "layerwise" if kind == "structured" or fixed else "global"
    check_choice("scope", scope, SCOPES)
    raise_problems(rules.method_problems(method_name(cls) or cls.__name__, kind, scope=scope))
    return cls, kwargs, scope


def check_unused_inputs(token_mask: Any, example_inputs: Any, *, reads_inputs: bool, units: bool) -> None:
    """Refuse a ``token_mask`` set away from its default where no input statistics are taken (``reads_inputs``),
    and ``example_inputs`` without structured units: either would change nothing, silently.

    Example:
        >>> check_unused_inputs("attention_mask", None, reads_inputs=False, units=False)
        >>> check_unused_inputs("mask", None, reads_inputs=False, units=False)
        Traceback (most recent call last):
        ...
        ValueError: token_mask='mask' is used with importance='activation' or 'obs' (or a units refit) only: ...
    """
    if not reads_inputs and not (isinstance(token_mask, str) and token_mask == "attention_mask"):
        raise ValueError(
            f"token_mask={token_mask!r} is used with importance='activation' or 'obs' (or a units refit) only: "
            "no input statistics are taken here, so it would change nothing"
        )
    if not units and example_inputs is not None:
        raise ValueError(
            f"example_inputs (a {type(example_inputs).__name__}) is used with method='neurons' or 'heads' only "
            "(to trace the forward that finds the units): it would change nothing here"
        )


def check_n_m_schedule(schedule: Schedule, method: str, n: int, m: int) -> None:
    """An N:M pattern (of ``method``) is fixed: its run is one event to ``1 - n/m``; refuse any other schedule,
    naming it.

    Example:
        >>> check_n_m_schedule(Constant(0.5, at=10), "semi_structured", 2, 4)
        >>> check_n_m_schedule(Constant(0.75), "semi_structured", 2, 4)
        Traceback (most recent call last):
        ...
        ValueError: schedule=Constant(sparsity=0.75, at=0): semi_structured with n=2, m=4 prunes 1 - n/m = 0.5 ...
    """
    one_event = isinstance(schedule, Constant)
    sparsity = getattr(schedule, "sparsity", None)
    problems = rules.n_m_problems(method, n, m, one_event=one_event, sparsity=sparsity, schedule=schedule)
    raise_problems(problems)


def unknown_length_hint(trainer: Trainer, unit: str, alternative: str | None = None) -> str:
    """What fixes a run whose length in ``unit`` is unknown, for a message; ``alternative`` is offered last.

    Under manual optimization the step clock counts training batches, so ``max_steps`` (``optimizer.step()`` calls)
    cannot give it; with a loader of unknown length, ``max_epochs`` cannot give the steps.
    """
    if clock.counts_batches(trainer, unit):
        hint = (
            "under manual optimization the step clock counts training batches and max_steps counts "
            "optimizer.step() calls (any number a batch): bound the run by max_epochs (and limit_train_batches) "
            "without max_steps"
        )
    elif unit == "step" and trainer.max_epochs not in (None, -1) and trainer.num_training_batches == float("inf"):
        hint = "the training loader has no length, so max_epochs does not give the number of steps: set max_steps"
    elif unit == "epoch" and trainer.max_steps != -1:
        module = trainer.lightning_module
        if module is not None and not module.automatic_optimization:
            why = "under manual optimization max_steps counts optimizer.step() calls (any number a batch)"
        elif trainer.num_training_batches == float("inf"):
            why = "the training loader has no length"
        else:
            why = None
        hint = (
            f"max_steps={trainer.max_steps} ends the run before its first epoch completes: raise it"
            if why is None
            else f"{why}, so max_steps does not give the number of epochs: bound the run by max_epochs without "
            "max_steps"
        )
    elif unit == "epoch":
        hint = "set max_epochs"
    else:
        hint = "set max_steps or max_epochs"
    return f"{hint}, or {alternative}" if alternative else hint


def check_rewind_time(schedule: Schedule, unit: str, rewind: int | None) -> None:
    """Refuse a rewind time after the first event of a resolved ``schedule`` that prunes: the weights to rewind to
    would not exist yet (checked at construction where the schedule's times are ints, else when the run resolves
    them). A ramp's first event, at level 0, prunes nothing and does not count.

    Example:
        >>> check_rewind_time(Constant(0.5, at=4), "step", 2)
        >>> check_rewind_time(Constant(0.5, at=4), "step", 5)
        Traceback (most recent call last):
        ...
        ValueError: rewind=5 is after the first pruning event at step 4: the weights to rewind to would not exist yet
        >>> from lightprune.schedules import Linear
        >>> check_rewind_time(Linear(final=0.5, start=4, end=12, frequency=4), "step", 6)  # step 4 prunes nothing
    """
    if rewind is None or not schedule.is_resolved:
        return
    # the first event that prunes: a ramp's first event, at level 0, prunes nothing and rewinds nothing
    first = next((t for t in schedule.events() if schedule.target(t) > 0), None)
    if first is not None and first < rewind:
        raise ValueError(
            f"rewind={rewind} is after the first pruning event at {unit} {first}: the weights to rewind to would "
            "not exist yet"
        )


def checked_schedule(schedule: Schedule, unit: str, length: int | None, rewind: int | None) -> Schedule:
    """``schedule`` with fractional times fixed to a run of ``length`` (unused for integer times), validated, its
    first pruning event checked against ``rewind``: the checks of a run that need no Trainer.

    Example:
        >>> from lightprune.schedules import Cubic
        >>> checked_schedule(Cubic(final=0.8, start=0.0, end=0.5, frequency=0.1), "step", 100, None).events()[:3]
        [0, 10, 20]
    """
    if not schedule.is_resolved:
        if length is None:
            raise ValueError(f"the schedule {schedule!r} gives times as fractions of the run: give the run's length")
        schedule = schedule.resolve(length)
    validate = getattr(schedule, "validate", None)
    if callable(validate):
        validate()
    check_rewind_time(schedule, unit, rewind)
    return schedule


def schedule_for_run(
    schedule: Schedule, unit: str, trainer: Trainer, rewind: int | None, length: int | float | None = None
) -> Schedule:
    """``schedule`` with fractional times fixed to ``length`` (default: this run's length; a resumed run passes the
    length of the run that wrote its checkpoint), checked against the run.

    Raises when that length is unknown for fractional times or the rewind point comes after the first event; warns
    when the last event comes after the end of training.
    """
    total = clock.run_length(trainer, unit)
    fractions_of = total if length is None else length
    if not schedule.is_resolved:
        if fractions_of is None or fractions_of < 1 or fractions_of == float("inf"):
            raise ValueError(
                f"the schedule {schedule!r} gives times as fractions of the run, but the run length in "
                f"{clock.clock_name(trainer, unit)} is unknown: "
                f"{unknown_length_hint(trainer, unit, 'give integer times')}"
            )
        try:
            schedule = schedule.resolve(int(fractions_of))
        except ValueError as err:
            if not trainer.fast_dev_run:
                raise
            raise ValueError(
                f"{err}: Trainer(fast_dev_run={trainer.fast_dev_run!r}) makes the run {int(fractions_of)} "
                f"{clock.clock_name(trainer, unit)} long, too short for the schedule's fractions of the run; give "
                "it integer times for such a run, or fast_dev_run=N with room for them"
            ) from err
    schedule = checked_schedule(schedule, unit, None, rewind)
    # the run's last time in the clock's unit (see lightprune.callback.clock)
    end = total
    if end is not None and 0 <= end < float("inf") and schedule.last_event > end:
        rank_zero_warn(  # once, not on every rank; stacklevel 6: the frame that called the hook, as before
            f"the schedule's last event is at {unit} {schedule.last_event}, after the end of training at {unit} "
            f"{int(end)} (counting {clock.clock_name(trainer, unit)}): the final sparsity {schedule.final_sparsity} "
            "will not be reached",
            stacklevel=6,
        )
    return schedule
