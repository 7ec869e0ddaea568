"""``lightprune.structure``: structured pruning units of transformers and MLPs (neurons, attention heads).

* :func:`find_units` - the groups of weights that go together, read from one traced forward.
"""

from lightprune.structure.units import Slice, UnitError, UnitGroup, find_units

__all__ = ["Slice", "UnitError", "UnitGroup", "find_units"]
