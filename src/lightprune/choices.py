"""The names lightprune accepts for its choices, in one place that imports nothing heavy.

The callback's registries (:data:`lightprune.callback.options.METHODS`, ``SCOPES``, ...), the experiment app's
bundled models and datasets and the app's config checks all read these names, so a name added here is accepted
everywhere and a name can never be allowed by the config but refused by the library it configures. The method names
are views of :data:`lightprune.registry.METHODS` (a method registered there is among them). This module imports
neither torch nor Lightning: the app checks a config with it in a fraction of a second.

Example:
    >>> from lightprune import choices
    >>> choices.METHOD_CLASSES["ln_structured"], choices.SCOPES
    ('LnStructured', ('global', 'layerwise', 'row', 'erk', 'owl'))
"""

from __future__ import annotations

from collections.abc import Mapping

from lightprune import registry

__all__ = [
    "ALLOCATION_SCOPES",
    "DATASETS",
    "IMPORTANCES",
    "MASKING",
    "METHODS",
    "METHOD_CLASSES",
    "MODELS",
    "OPTIMIZERS",
    "OWL_LAMBDA",
    "OWL_THRESHOLD",
    "REGROW",
    "REGROW_EVERY",
    "REGROW_FRACTION",
    "REGROW_UNTIL",
    "SCOPES",
    "STATISTICS_IMPORTANCES",
    "STRUCTURED_METHODS",
    "UNITS",
    "UNIT_METHODS",
    "UNIT_SCOPES",
]


METHOD_CLASSES: Mapping[str, str] = registry.Lookup(lambda entry: entry.target.rpartition(".")[2])
"""Pruning methods by the name configs and the callback give them -> their class's name (a view
of :data:`lightprune.registry.METHODS`: the classes live in :mod:`lightprune.prune`, or where an entry says)."""

UNIT_METHODS = registry.UNIT_METHODS
"""The methods that prune whole transformer units found from the model (:mod:`lightprune.structure`): MLP hidden
neurons, or attention heads (key/value groups with their query heads under grouped-query attention)."""

UNIT_SCOPES = ("layerwise", "global")
"""The scopes of the unit methods: every group to the target, or one ranking per kind across groups."""

METHODS = registry.Names(extra=UNIT_METHODS)
"""The pruning methods' names: the registry's, then the unit methods."""

STRUCTURED_METHODS = registry.Names(lambda entry: entry.kind == "structured")
"""The methods that prune whole channels (``PRUNING_TYPE == "structured"``); they need the layerwise scope."""

IMPORTANCES = ("magnitude", "activation", "movement", "obs")
"""The callback's built-in pruning criteria (a callable returning scores is accepted too)."""

STATISTICS_IMPORTANCES = ("activation", "obs")
"""The criteria that collect the selected layers' inputs in a window before each event (or calibration batches)."""

SCOPES = ("global", "layerwise", "row", "erk", "owl")
"""One ranking across the whole selection, one per tensor, one per row of every tensor (``l1_unstructured``), or one
per tensor with per-tensor amounts allocated by ERK or OWL (:mod:`lightprune.prune.allocation`)."""

ALLOCATION_SCOPES = ("erk", "owl")
"""The scopes that rank each tensor alone with its own share of the total: unstructured methods only."""

REGROW = ("rigl", "set")
"""Dynamic sparse training: how masks regrow (the largest dense gradients, or at random)."""

OWL_THRESHOLD = 5.0
"""OWL's ``M``: a score is an outlier when it exceeds ``M`` times the mean score of its block
(:func:`lightprune.prune.allocation.owl_blocks`); the paper's default, and the callback's and the app's."""

OWL_LAMBDA = 0.08
"""OWL's ``lambda``: the blocks' sparsities span ``2 * lambda`` around the target (the paper's default for LLaMA)."""

REGROW_EVERY, REGROW_FRACTION, REGROW_UNTIL = 100, 0.3, 0.75
"""RigL's published update settings: the defaults of the callback's and the app's ``regrow_every``,
``regrow_fraction`` and ``regrow_until``."""

UNITS = ("step", "epoch")
"""What a schedule's times count: optimizer steps or epochs."""

MASKING = ("reparametrize", "inplace")
"""How masks act during training: torch's reparametrization, or plain Parameters zeroed in place."""

DATASETS = ("digits", "fashion_mnist", "mnist", "idx")
"""The experiment app's bundled datasets (:func:`lightprune.experiment.data.make_datamodule`)."""

MODELS = ("lenet300100", "small_cnn")
"""The experiment app's bundled networks (:func:`lightprune.experiment.models.make_model`)."""

OPTIMIZERS = ("adam", "adamw", "sgd")
"""Optimizers the app's classifier builds by name."""
