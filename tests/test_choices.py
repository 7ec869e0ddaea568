"""The names in :mod:`lightprune.choices` are the ones the library's registries and the app's checks accept."""

from __future__ import annotations

from lightprune import choices, prune
from lightprune.callback import options
from lightprune.experiment import config, data, models
from lightprune.schedules import SCHEDULES


def test_the_callback_accepts_exactly_the_named_methods_scopes_units_and_maskings() -> None:
    assert list(options.METHODS) + list(choices.UNIT_METHODS) == list(choices.METHODS)
    for name in choices.UNIT_METHODS:  # the unit methods are built from the model, not from a method class
        assert options.resolve_method_options(name, None, None)[2] == "layerwise"
    for name, cls in options.METHODS.items():
        assert issubclass(cls, prune.BasePruningMethod) and cls.__name__ == choices.METHOD_CLASSES[name]
    structured = {name for name, cls in options.METHODS.items() if cls.PRUNING_TYPE == "structured"}
    assert structured == set(choices.STRUCTURED_METHODS)
    assert (options.SCOPES, options.UNITS, options.MASKING) == (choices.SCOPES, choices.UNITS, choices.MASKING)


def test_the_app_config_allows_what_the_library_builds() -> None:
    assert (config.METHODS, config.SCOPES, config.UNITS) == (choices.METHODS, choices.SCOPES, choices.UNITS)
    assert set(config.SCHEDULES) < set(SCHEDULES) and "points" not in config.SCHEDULES
    assert config.DATASETS == data.DATASET_NAMES == choices.DATASETS
    assert config.MODELS == models.MODEL_NAMES == choices.MODELS
    assert config.OPTIMIZERS == models.OPTIMIZERS == choices.OPTIMIZERS
