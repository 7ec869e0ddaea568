"""``PruningCallback``: scheduled pruning during ``trainer.fit`` with lightprune's engine.

One file per job: :mod:`.pruning` holds the callback (Lightning's hooks, the clock, the events), :mod:`.options` the
names it accepts, :mod:`.setup_checks` the checks made when fit starts, :mod:`.importance` what ranks the weights at an
event (with :mod:`.activations`, :mod:`.movement` and :mod:`.calibration` behind it, and :mod:`lightprune.layouts`),
:mod:`.masks` where its masks live (tied owners, checkpoints), :mod:`.neighbours` how it lives beside Lightning's
other callbacks and launchers, :mod:`.rewinding` the lottery-ticket snapshots and :mod:`.reporting` what it logs and
prints.
"""

from lightprune.callback.options import METHODS
from lightprune.callback.pruning import PruningCallback

__all__ = ["METHODS", "PruningCallback"]
