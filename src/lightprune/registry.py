"""The pruning methods by name: one entry per method class, with the traits the callback and the app's checks read.

A method is one class (a :class:`lightprune.prune.BasePruningMethod` subclass) plus one :class:`Method` entry in
:data:`METHODS`. The entry names the class by its import path, so this module imports nothing heavy: the experiment
app checks a config against it before torch is loaded, and the class is imported only when a callback is built
(:meth:`Method.load`). The callback (``lightprune.callback.options``), the rules of :mod:`lightprune.rules`, the
names of :mod:`lightprune.choices` and the app's config read the traits from here, never from a method's name.

Example:
    >>> from lightprune import registry
    >>> entry = registry.METHODS["semi_structured"]
    >>> entry.kind, entry.fixed_amount, entry.pruning_type, dict(entry.defaults)
    ('n:m', True, 'global', {'n': 2, 'm': 4})
    >>> registry.get("my.Method") is None
    True
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Generic, TypeVar, overload

__all__ = ["KINDS", "METHODS", "UNIT_METHODS", "Lookup", "Method", "Names", "get", "register"]

UNIT_METHODS = ("neurons", "heads")
"""The methods that prune whole transformer units found from the model (:mod:`lightprune.structure`): MLP hidden
neurons, or attention heads (key/value groups with their query heads under grouped-query attention). They have no
method class (their masks are set per unit), so they have no :class:`Method` entry."""

KINDS = ("unstructured", "structured", "n:m")
"""What a method prunes: single entries, whole channels along ``dim`` (``PRUNING_TYPE == "structured"``), or ``n``
of every ``m`` entries along each layer's input dim (a fixed pattern: one event to ``1 - n/m``)."""


@dataclass(frozen=True)
class Method:
    """One pruning method: its name, its class (by import path) and what the callback and the rules need to know.

    Attributes:
        name: the name configs and ``PruningCallback(method=...)`` give it.
        target: the import path ``"package.module.Class"`` of its ``BasePruningMethod`` subclass.
        kind: one of :data:`KINDS`.
        random: it draws masks at random and ignores every importance score.
        signed: it can rank signed scores (``importance="movement"``): a norm or a random draw would lose the sign.
        obs: OBS pruning (``importance="obs"``) chooses its pattern itself (single entries, or N:M groups).
        rows: ``scope="row"`` ranks every row's entries as it does (Wanda's ranking).
        sharded: the callback prunes DTensor shards with it exactly (``lightprune.prune.distributed``).
        defaults: ``method_kwargs`` filled in when not given (``dim``, ``n``, ``m``, ...); read-only once built.

    Example:
        >>> entry = Method("keep_large", "lightprune.prune.L1Unstructured", "unstructured", signed=True)
        >>> entry.load().__name__, entry.pruning_type, entry.fixed_amount
        ('L1Unstructured', 'unstructured', False)
    """

    name: str
    target: str
    kind: str
    random: bool = False
    signed: bool = False
    obs: bool = False
    rows: bool = False
    sharded: bool = False
    defaults: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind={self.kind!r} is not supported: allowed are {KINDS}")
        if "." not in self.target:
            raise ValueError(f"target={self.target!r} must be an import path 'package.module.Class'")
        object.__setattr__(self, "defaults", MappingProxyType(dict(self.defaults or {})))

    @property
    def fixed_amount(self) -> bool:
        """The method prunes a fixed share of its own (N:M: ``1 - n/m``), in one event; it takes no ``amount``."""
        return self.kind == "n:m"

    @property
    def pruning_type(self) -> str:
        """The ``PRUNING_TYPE`` of its class: an N:M method ranks within groups of the whole tensor, as
        ``PruningContainer``'s ``"global"`` methods do."""
        return "global" if self.kind == "n:m" else self.kind

    def load(self) -> type:
        """The method class, imported from :attr:`target` (the first call imports torch).

        Raises:
            ValueError: the module or the class cannot be imported.
        """
        module_name, _, class_name = self.target.rpartition(".")
        try:
            return getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"method {self.name!r}: {self.target!r} could not be imported: {err}") from err


METHODS: dict[str, Method] = {
    entry.name: entry
    for entry in (
        Method("l1_unstructured", "lightprune.prune.L1Unstructured", "unstructured", signed=True, obs=True,
               rows=True, sharded=True),
        Method("random_unstructured", "lightprune.prune.RandomUnstructured", "unstructured", random=True,
               sharded=True),
        Method("ln_structured", "lightprune.prune.LnStructured", "structured", sharded=True,
               defaults={"dim": 0, "n": 2}),
        Method("random_structured", "lightprune.prune.RandomStructured", "structured", random=True, sharded=True,
               defaults={"dim": 0}),
        Method("semi_structured", "lightprune.prune.SemiStructured", "n:m", signed=True, obs=True, sharded=True,
               defaults={"n": 2, "m": 4}),
    )
}  # fmt: skip
"""The pruning methods by name. Adding one is one class and one entry here (or :func:`register` from user code)."""


class Names(Sequence[str]):
    """The names of the registered methods that ``keep`` accepts (all by default), then ``extra``: a read-only view
    that follows :data:`METHODS`, so a method registered later is among them. It prints and compares as a tuple.

    Example:
        >>> structured = Names(lambda entry: entry.kind == "structured")
        >>> structured, "ln_structured" in structured, len(Names(extra=UNIT_METHODS))
        (('ln_structured', 'random_structured'), True, 7)
    """

    def __init__(self, keep: Callable[[Method], bool] | None = None, extra: tuple[str, ...] = ()) -> None:
        self._keep = keep
        self._extra = extra

    def _names(self) -> tuple[str, ...]:
        return tuple(name for name, entry in METHODS.items() if self._keep is None or self._keep(entry)) + self._extra

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[str, ...]: ...
    def __getitem__(self, index: int | slice) -> str | tuple[str, ...]:
        return self._names()[index]

    def __len__(self) -> int:
        return len(self._names())

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __contains__(self, name: object) -> bool:
        return name in self._names()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and not isinstance(other, str) and self._names() == tuple(other)

    __hash__ = None  # type: ignore[assignment]  # it changes with the registry

    def __repr__(self) -> str:
        return repr(self._names())


def get(name: Any) -> Method | None:
    """The entry of a method name, or ``None`` for any other value (a user's class, its import path, ``None``).

    Example:
        >>> get("ln_structured").kind, get("lightprune.prune.LnStructured")
        ('structured', None)
    """
    return METHODS.get(name) if isinstance(name, str) else None


def register(entry: Method) -> Method:
    """Add a method to :data:`METHODS` (from user code: the callback and the app's config accept its name at once).

    Raises:
        ValueError: the name is taken, is one of the unit methods (``neurons``, ``heads``) or not a plain name (an
            import path names a class, not an entry), or the class has an entry already (the callback finds an
            entry by its class, so a second one would be read as the first: give a subclass its own).

    Example:
        >>> entry = register(Method("keep_all", "lightprune.prune.Identity", "unstructured"))
        >>> get("keep_all") is entry
        True
        >>> del METHODS["keep_all"]
    """
    if not (isinstance(entry.name, str) and entry.name.strip() and "." not in entry.name):
        raise ValueError(f"name={entry.name!r} must be a non-empty name without '.' (an import path names a class)")
    if entry.name in METHODS or entry.name in UNIT_METHODS:
        raise ValueError(f"a method named {entry.name!r} exists already: choose another name")
    same = next((known.name for known in METHODS.values() if known.target == entry.target), None)
    if same is not None:
        raise ValueError(
            f"{entry.target} is registered already, as {same!r}: the callback finds an entry by its class, so a "
            "second one would be read as the first; register a subclass of it for other defaults or traits"
        )
    METHODS[entry.name] = entry
    return entry


T = TypeVar("T")


class Lookup(Mapping[str, T], Generic[T]):
    """Method name -> ``read(entry)`` for every registered method: a read-only view that follows :data:`METHODS`,
    so a method registered later is in it at once.

    Example:
        >>> class_names = Lookup(lambda entry: entry.target.rpartition(".")[2])
        >>> class_names["l1_unstructured"], "semi_structured" in class_names
        ('L1Unstructured', True)
    """

    def __init__(self, read: Callable[[Method], T]) -> None:
        self._read = read

    def __getitem__(self, name: str) -> T:
        return self._read(METHODS[name])

    def __iter__(self) -> Iterator[str]:
        return iter(METHODS)

    def __len__(self) -> int:
        return len(METHODS)

    def __repr__(self) -> str:
        return repr(dict(self))
