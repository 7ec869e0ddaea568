"""What a fit resumed from a checkpoint (``trainer.fit(..., ckpt_path=...)``) must share with the fit that wrote it.

A resumed fit continues the run the checkpoint was part of: its masks, its last event and its run length. A
callback configured otherwise (another schedule, method, scope, importance, selection) would mix the two runs: the
restored masks with the new targets, a step read as an epoch. So the options that decide which weights are pruned
and when are recorded in the callback's checkpoint state and compared when a fit resumes; a difference is refused,
naming it, before any training. To prune on with another configuration, start a new fit from the checkpoint's
weights (they are plain tensors with zeros where pruned) with ``adopt_zeros=True``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["WAY_OUT", "configuration", "refuse_changed", "refuse_changed_selection", "refuse_foreign_states"]

WAY_OUT = (
    "resume with the configuration of the fit that wrote the checkpoint; to prune on with another one, start a new "
    "fit from its weights (e.g. Model.load_from_checkpoint(path), whose pruned weights are zeros) with a "
    "PruningCallback of adopt_zeros=True, which keeps them pruned"
)
"""How to go on with another configuration, for the refusals' messages."""


def _described(value: Any) -> str:
    """``repr`` without memory addresses (a function's or lambda's repr names one, which no other process shares)."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value))


def configuration(options: Mapping[str, Any]) -> dict[str, str]:
    """The options that decide which weights are pruned and when, as comparable text.

    Example:
        >>> configuration({"scope": "global", "importance": abs})
        {'scope': "'global'", 'importance': '<built-in function abs>'}
    """
    return {key: _described(value) for key, value in options.items()}


def refuse_changed(saved: Mapping[str, str], current: Mapping[str, str], title: str) -> None:
    """Refuse, naming every option whose value differs from the checkpoint's (options the checkpoint does not record,
    written by an older version, are not compared).

    Example:
        >>> refuse_changed({"scope": "'global'"}, {"scope": "'global'", "unit": "'step'"}, "PruningCallback")
        >>> refuse_changed({"scope": "'global'"}, {"scope": "'layerwise'"}, "PruningCallback")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: PruningCallback: this fit resumes a checkpoint written with other options: scope='global' there, ...
    """
    changed = [
        f"{key}={saved[key]} there, {key}={value} here"
        for key, value in current.items()
        if key in saved and saved[key] != value
    ]
    if changed:
        raise ValueError(
            f"{title}: this fit resumes a checkpoint written with other options: {'; '.join(changed)}. Its masks and "
            f"last event belong to that configuration: {WAY_OUT}"
        )


def refuse_changed_selection(saved: Iterable[str], selection: Iterable[str], title: str) -> None:
    """Refuse a resumed fit whose selection differs from the checkpoint's (tensors added or left out).

    Example:
        >>> refuse_changed_selection(["fc1.weight"], ["fc1.weight"], "PruningCallback")
        >>> refuse_changed_selection(["fc1.weight"], ["fc1.weight", "fc2.weight"], "P")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: P: ... other: it selects ['fc2.weight'], which the checkpoint's did not. ...
    """
    saved, selection = list(saved), list(selection)
    added = [name for name in selection if name not in saved]
    left_out = [name for name in saved if name not in selection]
    if not (added or left_out):
        return
    parts = []
    if added:
        parts.append(f"it selects {added}, which the checkpoint's did not")
    if left_out:
        parts.append(f"it leaves out {left_out}, which the checkpoint's selected")
    raise ValueError(
        f"{title}: this fit resumes a checkpoint whose selection was other: {'; '.join(parts)}. The checkpoint's "
        f"masks and targets belong to that selection: {WAY_OUT}"
    )


def refuse_foreign_states(checkpoint: Mapping[str, Any], keys: Iterable[str], title: str) -> None:
    """A checkpoint that holds the state of a PruningCallback none of this Trainer's has (``keys``: their state keys)
    was written with another configuration: an unnamed callback's key is built from its method, scope, unit and
    selection patterns. Refuse, naming the checkpoint's key (its pruned weights would train again silently).

    Example:
        >>> key = "PruningCallback{'name': 'a'}"
        >>> refuse_foreign_states({"callbacks": {key: {"configuration": {}}}}, [key], "PruningCallback")
    """
    mine = set(keys)
    states = checkpoint.get("callbacks", {})
    foreign = [  # (a PruningCallback's state, whatever its class is named: it records its configuration)
        key
        for key, state in states.items()
        if isinstance(state, Mapping) and "configuration" in state and key not in mine
    ]
    if foreign:
        raise ValueError(
            f"{title}: the checkpoint holds the state of {foreign[0]}, which no PruningCallback of this Trainer has "
            f"({sorted(mine)}): the method, scope, unit or selection patterns that make an unnamed callback's key "
            f"changed, and the checkpoint's masks would be lost: {WAY_OUT}"
        )
