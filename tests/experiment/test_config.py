"""Tests of the experiment app's typed config: the schema, ``validate_config`` and ``register_configs``, and that
every file of the ``conf/`` tree composes under the schema and validates."""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, fields, replace
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf
from omegaconf.errors import ConfigAttributeError, ValidationError

from lightprune.experiment.app import config_dir
from lightprune.experiment.config import (
    PRUNING_APP_KEYS,
    CacheConfig,
    ConfigError,
    DataConfig,
    ExperimentConfig,
    ModelConfig,
    PruningConfig,
    TrainerConfig,
    config_warnings,
    method_kwargs,
    register_configs,
    unknown_keys,
    validate_config,
)


def config(**groups: dict) -> ExperimentConfig:
    """The default experiment config with some fields of its groups replaced, e.g. ``config(data={"seed": 1})``."""
    base = ExperimentConfig()
    return replace(base, **{group: replace(getattr(base, group), **fields) for group, fields in groups.items()})


def problems(cfg: ExperimentConfig) -> list[str]:
    """The problem lines of ``validate_config``'s error (empty when the config is valid)."""
    try:
        validate_config(cfg)
    except ValueError as err:
        header, *lines = str(err).splitlines()
        assert header == "invalid experiment config:"
        return [line.strip() for line in lines]
    return []


def test_defaults_are_valid_as_dataclass_and_as_dictconfig() -> None:
    assert problems(ExperimentConfig()) == []
    validate_config(OmegaConf.structured(ExperimentConfig))


@pytest.mark.parametrize(
    ("groups", "expected"),
    [
        ({"data": {"name": "cifar"}}, "data.name='cifar': one of"),
        ({"data": {"name": "idx"}}, "data.root=None: required for data=idx"),
        ({"data": {"batch_size": 0}}, "data.batch_size=0: must be >= 1"),
        ({"data": {"val_size": 0.0}}, "data.val_size=0.0: must be in (0, 1)"),
        ({"data": {"test_size": 0.0}}, "data.test_size=0.0: must be in (0, 1)"),
        ({"data": {"val_size": 0.5, "test_size": 0.5}}, "data.test_size=0.5: data.val_size + data.test_size"),
        ({"data": {"limit": 0}}, "data.limit=0: must be None or >= 1"),
        ({"model": {"name": "resnet"}}, "model.name='resnet': one of"),
        ({"model": {"hidden": [300, 0]}}, "model.hidden=[300, 0]: sizes must be >= 1"),
        ({"model": {"channels": []}}, "model.channels=[]: one or more sizes"),
        ({"model": {"lr": 0.0}}, "model.lr=0.0: must be > 0"),
        ({"model": {"optimizer": "adagrad"}}, "model.optimizer='adagrad': one of"),
        ({"model": {"weight_decay": -1.0}}, "model.weight_decay=-1.0: must be >= 0"),
        ({"pruning": {"preset": "magic"}}, "pruning.preset='magic': one of"),
        ({"pruning": {"method": "l3"}}, "pruning.method='l3': one of"),
        ({"pruning": {"scope": "diagonal"}}, "pruning.scope='diagonal': one of"),
        ({"pruning": {"schedule": "exponential"}}, "pruning.schedule='exponential': one of"),
        ({"pruning": {"final_sparsity": 1.5}}, "pruning.final_sparsity=1.5: must be in [0, 1]"),
        ({"pruning": {"initial_sparsity": -0.1}}, "pruning.initial_sparsity=-0.1: must be in [0, 1]"),
        ({"pruning": {"initial_sparsity": 0.95}}, "pruning.initial_sparsity=0.95: must be <= final=0.9"),
        (
            {"pruning": {"start": -0.5}},
            "pruning.start=-0.5: must be an int >= 0 (a time in the clock's unit) or a float",
        ),
        ({"pruning": {"start": 0.7}}, "pruning.start=0.7: must be < end=0.6"),
        (
            {"pruning": {"frequency": 0.0}},
            "pruning.frequency=0.0: must be an int >= 1 (clock units) or a float",
        ),
        ({"pruning": {"unit": "batch"}}, "pruning.unit='batch': one of"),
        ({"pruning": {"rounds": 0}}, "pruning.rounds=0: must be >= 1"),
        ({"pruning": {"rewind": "late"}}, "pruning.rewind='late': None or 'init'"),
        ({"pruning": {"n": 0.0}}, "pruning.n=0.0: the order of a norm"),
        ({"pruning": {"mask_dtype": "int8"}}, "pruning.mask_dtype='int8': one of"),
        ({"pruning": {"prune_channel_bias": True}}, "pruning.prune_channel_bias=True: needs a structured"),
        ({"pruning": {"include": ["fc("]}}, "pruning.include: 'fc(' is not a regular expression"),
        ({"pruning": {"exclude": ["*"]}}, "pruning.exclude: '*' is not a regular expression"),
        ({"trainer": {"dense_epochs": 0}}, "trainer.dense_epochs=0: must be >= 1"),
        ({"trainer": {"max_epochs": 0}}, "trainer.max_epochs=0: must be >= 1"),
        ({"trainer": {"devices": 0}}, "trainer.devices=0: must be >= 1"),
        ({"trainer": {"log_every_n_steps": 0}}, "trainer.log_every_n_steps=0: >= 1"),
        ({"trainer": {"accumulate_grad_batches": 0}}, "trainer.accumulate_grad_batches=0: must be >= 1"),
        ({"trainer": {"num_threads": 0}}, "trainer.num_threads=0: must be None (torch's default) or >= 1"),
    ],
)
def test_each_bad_value_is_named(groups: dict, expected: str) -> None:
    found = problems(config(**groups))
    assert len(found) == 1, found
    assert found[0].startswith(expected), found


def test_structured_methods_need_layerwise_scope() -> None:
    cfg = config(pruning={"method": "ln_structured", "scope": "global"})
    assert problems(cfg) == ["pruning.scope='global': a global ranking needs an unstructured method, and "
                             "ln_structured is structured: use scope=layerwise"]  # fmt: skip
    assert problems(config(pruning={"method": "random_structured", "scope": "layerwise"})) == []


def test_unit_methods_are_checked_by_the_callbacks_rules() -> None:
    assert (
        problems(config(pruning={"method": "neurons", "scope": "global", "importance": "movement", "start": 0.1})) == []
    )
    assert problems(config(pruning={"method": "heads", "scope": "row"})) == [
        "pruning.scope='row': heads ranks whole units per layer or across layers: use one of ('layerwise', 'global')"
    ]
    assert problems(config(pruning={"method": "heads", "reconstruct": True, "start": 0.1})) == []  # the units' refit
    assert problems(config(pruning={"method": "heads", "importance": "obs", "start": 0.1})) == [
        "pruning.importance='obs': obs chooses single weights (or N:M groups) while it updates the others, which "
        "heads cannot: use method l1_unstructured or semi_structured"
    ]
    at_start = {"method": "neurons", "reconstruct": True, "schedule": "constant", "start": 0.0}
    assert problems(config(pruning=at_start)) == [
        "pruning.start=0.0: pruning.reconstruct=true with an event at the start needs pruning.calibration_batches > 0"
    ]
    assert problems(config(pruning={**at_start, "calibration_batches": 2})) == []


def test_max_layer_sparsity_is_checked_by_the_callbacks_rule() -> None:
    assert problems(config(pruning={"max_layer_sparsity": 0.95})) == []  # global: the callback checks the counts
    layerwise = {"scope": "layerwise", "final_sparsity": 0.9, "max_layer_sparsity": 0.8}
    assert problems(config(pruning=layerwise)) == [
        "pruning.max_layer_sparsity=0.8: is below the final sparsity 0.9, and scope=layerwise prunes every tensor to "
        "the target: lower the target or raise the cap"
    ]
    assert problems(config(pruning={**layerwise, "final_sparsity": 0.8})) == []


# callback arguments the app sets itself (from other keys, or always the same) rather than from a pruning.* key
SET_BY_THE_APP = {
    "log_every_n_steps": "trainer.log_every_n_steps",
    "make_permanent": "the app's phases",
    "masking": "reparametrize",
    "method_kwargs": "pruning.n, dim, nm_n, nm_m",
    "module_types": "the default Linear/Conv",
    "example_inputs": "the first training batch",
    "name": "one callback",
    "parameter_names": "weights",
    "parameters": "pruning.include / exclude",
    "summary": "printed",
    "token_mask": "the default: a dict batch's attention_mask (the bundled image data have none)",
}


def test_the_config_mirrors_every_argument_of_the_callback() -> None:
    """A new PruningCallback argument gets a pruning.* key (or an entry above saying where the app sets it)."""
    import dataclasses
    import inspect

    from lightprune.callback import PruningCallback

    arguments = set(inspect.signature(PruningCallback).parameters) - {"schedule"}
    keys = {field.name for field in dataclasses.fields(PruningConfig)}
    assert sorted(arguments - keys) == sorted(SET_BY_THE_APP)
    assert (
        inspect.signature(PruningCallback).parameters["max_layer_sparsity"].default == PruningConfig.max_layer_sparsity
    )


def test_small_cnn_needs_images() -> None:
    assert problems(config(model={"name": "small_cnn"}, data={"flatten": True}))[0].startswith("data.flatten=True")
    assert problems(config(model={"name": "lenet300100"}, data={"flatten": True})) == []


def test_prune_channel_bias_needs_output_channels() -> None:
    structured = {"method": "ln_structured", "scope": "layerwise", "prune_channel_bias": True}
    assert problems(config(pruning=structured)) == []
    assert problems(config(pruning={**structured, "dim": 1}))[0].startswith("pruning.prune_channel_bias=True")


def test_start_and_end_only_bind_ramps() -> None:
    """``end`` and ``initial_sparsity`` belong to linear/cubic ramps: a late one-shot event is fine."""
    late = {"start": 0.8, "initial_sparsity": 0.95, "final_sparsity": 0.9}
    assert problems(config(pruning={**late, "schedule": "constant"})) == []
    assert problems(config(pruning={**late, "schedule": "geometric"})) == []
    # a ramp checks them (the schedule reports its first problem)
    assert problems(config(pruning={**late, "schedule": "linear"})) == ["pruning.start=0.8: must be < end=0.6"]
    assert problems(config(pruning={"initial_sparsity": 0.95, "schedule": "linear"}))[0].startswith(
        "pruning.initial_sparsity=0.95: must be <= final=0.9"
    )
    assert problems(config(pruning={"start": 0.8, "schedule": "linear"})) == ["pruning.start=0.8: must be < end=0.6"]


def test_an_import_path_is_accepted_as_method() -> None:
    assert problems(config(pruning={"method": "my_package.pruning.MyMethod", "scope": "layerwise"})) == []


def test_every_problem_is_listed_in_one_error() -> None:
    cfg = config(data={"batch_size": 0}, pruning={"final_sparsity": 2.0}, trainer={"max_epochs": 0})
    assert [line.split("=")[0] for line in problems(cfg)] == [
        "data.batch_size",
        "pruning.final_sparsity",
        "trainer.max_epochs",
    ]


def test_the_schema_rejects_unknown_keys_and_wrong_types() -> None:
    cfg = OmegaConf.structured(ExperimentConfig)
    with pytest.raises(ConfigAttributeError, match="final_sparsty"):
        cfg.pruning.final_sparsty = 0.9
    with pytest.raises(ValidationError, match="abc"):
        cfg.pruning.final_sparsity = "abc"
    with pytest.raises(ValidationError):
        cfg.data.batch_size = 1.5
    cfg.trainer.num_threads = None  # optional
    cfg.pruning.rewind = "init"


def test_group_dataclasses_default_to_the_shipped_defaults() -> None:
    assert (DataConfig().name, ModelConfig().name, PruningConfig().preset) == ("digits", "lenet300100", "gmp_cubic")
    assert TrainerConfig().num_threads is None


def test_register_configs_stores_the_schema_idempotently() -> None:
    register_configs()
    register_configs()
    stored = ConfigStore.instance().repo["experiment_schema.yaml"]
    assert OmegaConf.get_type(stored.node) is ExperimentConfig


# --------------------------------------------------------------------------------------------------------------------
# The conf/ tree
# --------------------------------------------------------------------------------------------------------------------


def compose_app(*overrides: str):
    register_configs()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def options(group: str) -> list[str]:
    return sorted(path.stem for path in (Path(config_dir()) / group).glob("*.yaml"))


def test_config_dir_holds_the_tree() -> None:
    assert (config_dir() / "config.yaml").is_file()
    assert options("pruning") == [
        "gmp_cubic",
        "gmp_erk",
        "iterative_rounds",
        "ln_structured",
        "movement",
        "nm_2_4",
        "none",
        "one_shot",
        "rigl_erk",
        "set_erk",
        "sparsegpt_2_4",
        "sparsegpt_oneshot",
        "wanda_gradual",
    ]


@pytest.mark.parametrize(
    ("group", "option"),
    [(group, option) for group in ("data", "model", "pruning", "trainer", "experiment") for option in options(group)],
)
def test_every_config_file_composes_and_validates(group: str, option: str) -> None:
    overrides = [f"{group}={option}"]
    if (group, option) == ("data", "idx"):
        overrides.append("data.root=/some/dir")
    if (group, option) == ("pruning", "ln_structured"):
        overrides.append("model=small_cnn")
    cfg = compose_app(*overrides)
    validate_config(cfg)
    assert OmegaConf.get_type(cfg.pruning) is PruningConfig
    if group == "pruning":
        assert cfg.pruning.preset == option


def test_default_composition_and_run_name() -> None:
    cfg = compose_app()
    assert (cfg.data.name, cfg.model.name, cfg.pruning.preset, cfg.pruning.final_sparsity) == (
        "digits",
        "lenet300100",
        "gmp_cubic",
        0.9,
    )
    assert cfg.name == "gmp_cubic-global-s0.9"
    assert compose_app("pruning=ln_structured").pruning.exclude_classifier is True


def test_the_pruning_seed_follows_the_runs_seed_unless_set() -> None:
    """A seed sweep of a random method draws a mask per seed (docs/app.md), unless pruning.seed fixes it."""
    assert compose_app("seed=3").pruning.seed == 3
    assert compose_app("seed=3", "pruning.seed=0").pruning.seed == 0


@pytest.mark.parametrize(
    ("override", "expected"),
    [("pruning.frequency=1", 1), ("pruning.frequency=0.05", 0.05), ("pruning.end=30", 30), ("pruning.end=1", 1)],
)
def test_int_times_count_the_clock_and_float_times_are_fractions(override: str, expected: float) -> None:
    """As lightprune.schedules reads them: frequency=1 is an event every step, not one period of the whole run."""
    from lightprune.experiment.config import pruning_schedule

    cfg = compose_app(override)
    key = override.split("=")[0].split(".")[1]
    assert getattr(cfg.pruning, key) == expected and type(getattr(cfg.pruning, key)) is type(expected)
    schedule = pruning_schedule(cfg.pruning).resolve(100)
    if override == "pruning.frequency=1":  # an event every step from 0 to 60
        assert schedule.events() == list(range(61))
    if override == "pruning.end=30":
        assert schedule.last_event == 30


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (
            "+pruning.final_sparsty=0.5",
            "pruning.final_sparsty: not a config key (did you mean pruning.final_sparsity?)",
        ),
        ("+trainer.epochs=3", "trainer.epochs: not a config key (did you mean trainer.max_epochs?)"),
        ("+lr=0.1", "lr: not a config key (did you mean model.lr?)"),  # the right name in the wrong group
        ("+pruning.zzz=1", "pruning.zzz: not a config key"),
    ],
)
def test_keys_added_with_plus_are_rejected_naming_the_closest_known_key(override: str, expected: str) -> None:
    cfg = compose_app(override)  # Hydra lets + add a key to the schema's config ...
    assert unknown_keys(cfg) == [expected.split(":")[0]]
    with pytest.raises(ConfigError) as info:  # ... validation does not
        validate_config(cfg)
    assert str(info.value).splitlines()[1].strip() == expected


def test_a_config_from_the_schema_has_no_unknown_keys() -> None:
    assert unknown_keys(compose_app("experiment=cnn_channels")) == []
    assert unknown_keys(OmegaConf.structured(ExperimentConfig)) == []


def test_removing_every_weight_is_valid_but_warned() -> None:
    cfg = compose_app("pruning=one_shot", "pruning.final_sparsity=1.0")
    validate_config(cfg)
    (message,) = config_warnings(cfg)
    assert message.startswith("pruning.final_sparsity=1.0 removes every selected weight")
    assert config_warnings(compose_app("pruning=one_shot", "pruning.final_sparsity=0.99")) == []
    (unused,) = config_warnings(compose_app("pruning=none", "pruning.final_sparsity=1.0"))  # nothing is pruned
    assert unused.startswith("pruning.final_sparsity=1.0 is not used with pruning=none: the model stays dense")


def test_a_sparsity_given_to_the_dense_baseline_is_warned_as_unused() -> None:
    (message,) = config_warnings(compose_app("pruning=none", "pruning.final_sparsity=0.5"))
    assert message.startswith("pruning.final_sparsity=0.5 is not used with pruning=none")
    assert config_warnings(compose_app("pruning=none")) == []


def test_adopting_zeros_keeps_a_callback_at_zero_sparsity_and_is_warned_as_unused_without_one() -> None:
    from lightprune.experiment.app import build_callback, pruning_callback

    callback = build_callback(compose_app("pruning=one_shot", "pruning.final_sparsity=0", "pruning.adopt_zeros=true"))
    assert callback is not None and callback.adopt_zeros  # fine-tuning a pruned model with its zeros kept
    assert build_callback(compose_app("pruning=one_shot", "pruning.final_sparsity=0")) is None
    (message,) = config_warnings(compose_app("pruning=none", "pruning.adopt_zeros=true"))
    assert message.startswith("pruning.adopt_zeros=true is not used with pruning=none")
    nothing = pruning_callback(preset="none", final_sparsity=0.0)  # instantiate(cfg.pruning) in a user's own app
    assert type(nothing).__module__.startswith("lightning") and type(nothing).__name__ == "Callback"


def test_a_limit_on_the_bundled_digits_is_warned_as_unused() -> None:
    (message,) = config_warnings(compose_app("data=digits", "data.limit=100"))
    assert message.startswith("data.limit=100 is not used with data=digits")
    assert config_warnings(compose_app("data=digits")) == []


def test_the_cache_group_composes_with_its_defaults() -> None:
    cfg = compose_app("cache.retrain=true")
    assert (cfg.cache.dense, cfg.cache.dir, cfg.cache.retrain) == (True, None, True)
    assert OmegaConf.get_type(cfg.cache) is CacheConfig


def test_every_pruning_key_is_an_argument_of_the_callback_or_builds_one() -> None:
    """A key added to ``PruningConfig`` is either an argument of ``PruningCallback`` (then ``build_callback`` passes
    it: the next test) or one the app builds arguments from, listed in ``PRUNING_APP_KEYS``."""
    from lightprune import PruningCallback

    arguments = set(inspect.signature(PruningCallback).parameters)
    keys = {item.name for item in fields(PruningConfig)}
    assert keys - arguments == set(PRUNING_APP_KEYS)


@dataclass
class _PruningWithMoreKeys(PruningConfig):
    """A config with keys ``PruningConfig`` does not have, named like arguments of the callback."""

    masking: str = "inplace"
    name: str | None = "encoder"


def test_build_callback_passes_every_key_named_like_a_callback_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightprune import PruningCallback
    from lightprune.experiment.app import build_callback

    received: dict = {}
    original = PruningCallback.__init__

    @functools.wraps(original)
    def spy(self: PruningCallback, *args: object, **kwargs: object) -> None:
        received.update(kwargs)
        original(self, *args, **kwargs)

    monkeypatch.setattr(PruningCallback, "__init__", spy)
    cfg = OmegaConf.structured(ExperimentConfig)
    cfg.pruning = OmegaConf.structured(
        _PruningWithMoreKeys(seed=7, scope="owl", importance="activation", owl_lambda=0.1, regrow="set", regrow_every=9)
    )
    callback = build_callback(cfg)
    arguments = set(inspect.signature(PruningCallback).parameters)
    built = {"schedule", "include", "exclude", "rewind", "mask_dtype"}  # converted from the config's values
    passed = {key for key in cfg.pruning if key in arguments} - built
    assert {"masking", "name", "seed", "regrow"} <= passed
    for key in passed:
        assert received[key] == cfg.pruning[key], key
    assert (callback.masking, callback._log_prefix) == ("inplace", "pruning/encoder/")
    assert (callback.seed, callback.owl_lambda, callback.regrow, callback.regrow_every) == (7, 0.1, "set", 9)


def test_a_bundled_model_beside_a_users_own_data_passes_the_preflight_checks() -> None:
    """A user's data node has a ``_target_`` and its own keys, no ``name``: the selection check still runs."""
    from omegaconf import open_dict

    from lightprune.experiment.checks import preflight

    cfg = compose_app("pruning=one_shot")
    with open_dict(cfg):
        cfg.data = OmegaConf.create({"_target_": "mymodule.MyDataModule", "batch_size": 64})
    preflight(cfg)
    cfg.pruning.include = ["no_such_layer"]
    with pytest.raises(ConfigError, match=r"no_such_layer"):
        preflight(cfg)


def test_the_pruning_phases_optimizer_and_scheduler_beside_lr_rewind_false_are_warned() -> None:
    cosine = "+optim.prune.scheduler={_target_: torch.optim.lr_scheduler.CosineAnnealingLR, _partial_: true}"
    sgd = "+optim.prune.optimizer={_target_: torch.optim.SGD, _partial_: true, lr: 0.05}"
    scheduler, optimizer = config_warnings(compose_app("optim.lr_rewind=false", cosine, sgd))
    assert scheduler.startswith("optim.prune.scheduler is not used with optim.lr_rewind=false")
    assert optimizer.startswith("optim.prune.optimizer keeps its kind, but not its learning rate")
    assert config_warnings(compose_app(cosine, sgd)) == []  # replayed each fit: both used


def test_no_bundled_preset_sets_a_key_its_schedule_ignores() -> None:
    for preset in options("pruning"):
        assert config_warnings(compose_app(f"pruning={preset}")) == [], preset
    for experiment in options("experiment"):
        assert config_warnings(compose_app(f"experiment={experiment}")) == [], experiment


@pytest.mark.parametrize(
    ("overrides", "unused"),
    [
        (("pruning=iterative_rounds", "pruning.schedule=cubic", "pruning.frequency=0.5"), ["schedule", "frequency"]),
        (("pruning=iterative_rounds", "pruning.start=0.5", "pruning.end=0.3"), ["start", "end"]),
        (("pruning=one_shot", "pruning.initial_sparsity=0.5", "pruning.end=0.3"), ["initial_sparsity", "end"]),
        (("pruning=one_shot", "pruning.frequency=0.1"), ["frequency"]),
        (("pruning=gmp_cubic", "pruning.rounds=5"), ["rounds"]),
    ],
)
def test_schedule_keys_the_preset_does_not_read_are_warned_about(overrides: tuple[str, ...], unused: list[str]) -> None:
    """They were accepted and changed nothing: the runs were bit-identical to the runs without them."""
    messages = config_warnings(compose_app(*overrides))
    assert [message.split("=")[0] for message in messages] == [f"pruning.{key}" for key in unused]
    assert all("is not used by" in message and "changes nothing" in message for message in messages)


class ChannelsOfMine:
    """A structured method of a user's own, by import path (only its ``PRUNING_TYPE`` is read here)."""

    PRUNING_TYPE = "structured"


@pytest.mark.parametrize("method", ["lightprune.prune.RandomStructured", f"{__name__}.ChannelsOfMine", "registered"])
def test_pruning_dim_reaches_every_structured_method(method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the keys of a registry entry's defaults were passed: a structured method given by import path, or
    registered without defaults, pruned dim 0 while the config said dim=1, silently."""
    from lightprune import registry

    if method == "registered":
        entry = registry.Method("channels_of_mine", f"{__name__}.ChannelsOfMine", "structured")
        monkeypatch.setitem(registry.METHODS, entry.name, entry)
        method = entry.name
    assert method_kwargs(OmegaConf.structured(PruningConfig(method=method, dim=1))) == {"dim": 1}
    assert method_kwargs(OmegaConf.structured(PruningConfig(method="lightprune.prune.L1Unstructured", dim=1))) == {}
