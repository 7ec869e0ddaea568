"""Every key of the experiment app, given a wrong type or an out-of-range value, fails with one clear message naming
the key, before anything is trained or written (issue #6).

``KEYS`` lists every leaf of :class:`~lightprune.experiment.config.ExperimentConfig` (a test walks the dataclasses, so a
new key without an entry fails here) with a value of a wrong type and, where the key has a range or a set of choices,
values outside it. Wrong types fail when Hydra composes the config (OmegaConf checks them against the schema); values
out of range fail in ``validate_config``, which ``run_experiment`` calls first.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterator
from pathlib import Path

import lightning.pytorch as pl
import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import DictConfig

from lightprune.experiment import config as config_module
from lightprune.experiment.app import config_dir, run_experiment
from lightprune.experiment.cache import CACHE_ENV
from lightprune.experiment.config import ConfigError, ExperimentConfig, register_configs

TINY = ["experiment=smoke", "data.batch_size=256"]


class Key(typing.NamedTuple):
    wrong_type: list[str]
    """Override values of a wrong type (Hydra's syntax)."""
    out_of_range: list[str]
    """Override values outside the key's range or choices; empty where any value of the type is valid."""
    context: list[str] = []
    """Further overrides under which the range applies (e.g. a structured method for ``pruning.dim``)."""


KEYS: dict[str, Key] = {
    "data._target_": Key(["[1]"], []),  # another target makes it the user's datamodule (tests/experiment/test_targets)
    "data.name": Key(["[1,2]"], ["cifar", "''"]),
    "data.root": Key(["[1]"], [], ["data=idx"]),  # any path; a missing directory fails when the data is loaded
    "data.batch_size": Key(["abc", "1.5", "[1]"], ["0", "-1"]),
    "data.val_size": Key(["abc", "[0.1]"], ["0", "1", "-0.1", "nan"]),
    "data.test_size": Key(["abc"], ["0", "1.0", "inf"]),
    "data.limit": Key(["abc", "2.5"], ["0", "-3"]),
    "data.flatten": Key(["maybe", "[true]"], ["true"], ["model=small_cnn"]),
    "data.seed": Key(["abc", "0.5"], ["-1", str(2**32)]),
    "model._target_": Key(["[1]"], []),  # another target makes it the user's model (tests/experiment/test_targets)
    "model.name": Key(["[1]"], ["resnet"]),
    "model.hidden": Key(["abc", "[a,b]", "7"], ["[0]", "[300,-1]"]),
    "model.channels": Key(["abc", "[1.5]"], ["[]", "[0]"], ["model=small_cnn"]),
    "model.lr": Key(["abc", "[0.1]"], ["0", "-1", "inf", "nan"]),
    "model.optimizer": Key(["[1]"], ["adagrad"]),
    "model.weight_decay": Key(["abc"], ["-1", "inf", "nan"]),
    "pruning._target_": Key(["[1]"], []),  # what a user's own app instantiates; the experiment app ignores it
    "pruning.preset": Key(["[1]"], ["magic"]),
    "pruning.method": Key(["[1]"], ["l3"]),
    "pruning.scope": Key(["[1]"], ["diagonal"]),
    "pruning.schedule": Key(["[1]"], ["exponential"]),
    "pruning.initial_sparsity": Key(["abc"], ["-0.1", "1.5", "nan"]),
    "pruning.final_sparsity": Key(["abc", "[0.5]"], ["-0.1", "1.5", "nan"]),
    "pruning.start": Key(["abc"], ["-0.5", "1.5", "nan"]),
    "pruning.end": Key(["abc"], ["-0.1", "1.5", "nan"]),
    "pruning.frequency": Key(["abc"], ["0", "-1", "1.5", "nan"]),
    "pruning.unit": Key(["[1]"], ["batch"]),
    "pruning.rounds": Key(["abc", "2.5"], ["0", "-1"], ["pruning=iterative_rounds"]),
    "pruning.rewind": Key(["[1]"], ["late"]),
    "pruning.n": Key(["abc"], ["0", "-1", "nan"], ["pruning=ln_structured", "model=small_cnn"]),
    "pruning.dim": Key(["abc", "0.5"], ["2", "-3"], ["pruning=ln_structured"]),
    "pruning.prune_channel_bias": Key(["maybe"], ["true"]),  # needs a structured method on output channels
    "pruning.include": Key(["5", "abc"], ["['fc(']"]),
    "pruning.exclude": Key(["5"], ["['*']"]),
    "pruning.exclude_classifier": Key(["maybe"], []),
    "pruning.mask_dtype": Key(["[1]"], ["int8"]),
    "pruning.log_per_parameter": Key(["maybe"], []),
    "pruning.seed": Key(["abc", "0.5"], []),
    "pruning.importance": Key(["[1]"], ["gradient"]),
    "pruning.activation_window": Key(["abc", "1.5"], ["0", "-1"], ["pruning=wanda_gradual"]),
    "pruning.calibration_batches": Key(["abc"], ["-1"], ["pruning=wanda_gradual"]),
    "pruning.reconstruct": Key(["maybe"], ["true"]),  # reconstruction needs importance=obs
    "pruning.sequential": Key(["maybe"], ["true"]),  # needs importance=obs and calibration batches
    "pruning.adopt_zeros": Key(["maybe"], []),
    "pruning.max_layer_sparsity": Key(["abc", "[0.9]"], ["0", "-0.1", "1.5", "nan"]),
    "pruning.owl_threshold": Key(["abc"], ["0", "-1", "nan"], ["pruning=wanda_gradual", "pruning.scope=owl"]),
    "pruning.owl_lambda": Key(["abc"], ["-0.1", "0.6", "nan", "0.2"], ["pruning=wanda_gradual", "pruning.scope=erk"]),
    "pruning.regrow": Key(["[1]"], ["grow"]),
    "pruning.regrow_every": Key(["abc", "1.5"], ["0", "-1"], ["pruning=rigl_erk"]),
    "pruning.regrow_fraction": Key(["abc"], ["0", "1", "nan"], ["pruning=rigl_erk"]),
    "pruning.regrow_until": Key(["abc"], ["0", "1.5", "nan"], ["pruning=set_erk"]),
    "pruning.nm_n": Key(["abc"], ["0", "4"], ["pruning=nm_2_4"]),
    "pruning.nm_m": Key(["abc"], ["1"], ["pruning=nm_2_4"]),
    "trainer.dense_epochs": Key(["abc", "1.5"], ["0", "-1"]),
    "trainer.max_epochs": Key(["abc"], ["0"]),
    "trainer.accelerator": Key(["[1]"], ["abacus"]),
    "trainer.devices": Key(["abc"], ["0"]),
    "trainer.precision": Key(["[1]"], ["99-bits"]),
    "trainer.log_every_n_steps": Key(["abc"], ["0"]),
    "trainer.enable_progress_bar": Key(["maybe"], []),
    "trainer.accumulate_grad_batches": Key(["abc"], ["0"]),
    "trainer.deterministic": Key(["maybe"], []),
    "trainer.num_threads": Key(["abc", "1.5"], ["0", "-2"]),
    "name": Key(["[1]"], []),
    "seed": Key(["abc", "0.5"], ["-1", str(2**32)]),
    "save_model": Key(["maybe"], []),
    "plots": Key(["maybe"], []),
    "objective": Key([], ["accuracy", "[final_test_acc,acc]", "[]", "3"]),  # any type composes: the check names it
    "cache.dense": Key(["maybe"], []),
    "cache.dir": Key(["[1]"], []),
    "cache.retrain": Key(["maybe"], []),
    "optim.dense.optimizer": Key([], ["{_target_:torch.optim.SGD,lr:0.1}", "{_target_:nowhere.Opt,_partial_:true}"]),
    "optim.dense.scheduler": Key([], ["{_target_:torch.optim.lr_scheduler.Nope,_partial_:true}"]),
    "optim.dense.interval": Key(["[1]"], ["hour"]),
    "optim.prune.optimizer": Key([], ["{_target_:torch.optim.Adam}"]),
    "optim.prune.scheduler": Key([], ["{lr:0.1}"]),
    "optim.prune.interval": Key(["[1]"], ["batch"]),
    "optim.lr_rewind": Key(["maybe"], []),
}


def leaves(schema: type, prefix: str = "") -> list[str]:
    """Qualified names of every leaf field of a config dataclass."""
    hints = typing.get_type_hints(schema, vars(config_module))
    names = []
    for field in dataclasses.fields(schema):
        hint = hints[field.name]
        if hint is typing.Any and callable(field.default_factory):  # model / data: a schema, or a _target_ node
            hint = type(field.default_factory())
        if dataclasses.is_dataclass(hint):
            names += leaves(hint, f"{prefix}{field.name}.")
        else:
            names.append(prefix + field.name)
    return names


@pytest.fixture(scope="module", autouse=True)
def _hydra() -> Iterator[None]:
    """One Hydra initialisation for the module (composing is then a few milliseconds)."""
    register_configs()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        yield


def make_config(*overrides: str) -> DictConfig:
    return compose("config", overrides=list(overrides))


@pytest.fixture(autouse=True)
def _dense_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The app's dense-phase cache in the test's directory, never ~/.cache."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))


@pytest.fixture
def no_training(monkeypatch: pytest.MonkeyPatch) -> None:
    def fit(*args: object, **kwargs: object) -> None:
        raise AssertionError("Trainer.fit ran: the config error was not caught before training")

    monkeypatch.setattr(pl.Trainer, "fit", fit)
    monkeypatch.setattr(pl.Trainer, "__init__", fit)


def test_every_key_of_the_schema_is_listed() -> None:
    assert sorted(KEYS) == sorted(leaves(ExperimentConfig))


def test_the_listed_contexts_are_valid(no_training: None, tmp_path: Path) -> None:
    """Each key's context alone is a valid config (so the failures below come from the bad value)."""
    for context in {tuple(key.context) for key in KEYS.values()}:
        overrides = [*TINY, *context] + (["data.root=/nowhere"] if "data=idx" in context else [])
        with pytest.raises(AssertionError, match=r"Trainer\.fit ran|nowhere"):
            try:
                run_experiment(make_config(*overrides), tmp_path / "run")
            except ConfigError as err:  # data=idx got past validation of values to looking for the files
                assert "data.root='/nowhere': /nowhere is not a directory" in str(err)
                raise AssertionError(str(err)) from err


WRONG_TYPES = [(key, value) for key, spec in KEYS.items() for value in spec.wrong_type]
OUT_OF_RANGE = [(key, value) for key, spec in KEYS.items() for value in spec.out_of_range]


@pytest.mark.parametrize(("key", "value"), WRONG_TYPES, ids=[f"{k}={v}" for k, v in WRONG_TYPES])
def test_a_wrong_type_fails_at_composition_naming_the_key(key: str, value: str) -> None:
    with pytest.raises(ConfigCompositionException) as info:
        make_config(*TINY, *KEYS[key].context, f"{key}={value}")
    message = f"{info.value}\n{info.value.__cause__}"
    assert key in message, message


@pytest.mark.parametrize(("key", "value"), OUT_OF_RANGE, ids=[f"{k}={v}" for k, v in OUT_OF_RANGE])
def test_an_out_of_range_value_fails_before_training_naming_the_key(
    no_training: None, tmp_path: Path, key: str, value: str
) -> None:
    cfg = make_config(*TINY, *KEYS[key].context, f"{key}={value}")
    run_dir = tmp_path / "run"
    with pytest.raises(ValueError) as info:
        run_experiment(cfg, run_dir)
    header, *problems = str(info.value).splitlines()
    assert header == "invalid experiment config:", str(info.value)
    assert any(line.strip().startswith(f"{key}=") or line.strip().startswith(f"{key}:") for line in problems), str(
        info.value
    )
    assert not run_dir.exists()
