"""Hydra sweeper plugin ``hydra/sweeper=lightprune_optuna``: Hydra's Optuna sweeper, able to continue a study.

It takes every option of ``hydra/sweeper=optuna`` (``hydra-optuna-sweeper``) and behaves the same on a new study.
With ``hydra.sweeper.storage`` (e.g. ``sqlite:///search.db``) and ``hydra.sweeper.study_name``, a sweep started
again after an interruption goes on with the stored study (:func:`lightprune.experiment.search.continue_study`):
finished trials are kept and not run again, ``n_trials`` counts the study's trials in all, and job numbers are the
study's trial numbers. Hydra imports this module in every app to find plugins: nothing heavy is imported here, and
without ``hydra-optuna-sweeper`` installed the plugin is absent.
"""

# no `from __future__ import annotations`: Hydra runs this module before it is in sys.modules, where dataclasses
# would look string annotations up
from dataclasses import dataclass
from typing import Any

try:
    from hydra_plugins.hydra_optuna_sweeper import config as _optuna_config
    from hydra_plugins.hydra_optuna_sweeper import optuna_sweeper as _optuna_sweeper
except ImportError:  # the `sweep` extra is not installed
    _optuna_sweeper = None  # type: ignore[assignment]

if _optuna_sweeper is not None:
    from hydra.core.config_store import ConfigStore

    class LightpruneOptunaSweeper(_optuna_sweeper.OptunaSweeper):
        """Hydra's ``OptunaSweeper`` that continues a study kept in Optuna's storage."""

        def sweep(self, arguments: list[str]) -> Any:
            from lightprune.experiment.search import continue_study

            continue_study(self.sweeper)
            return super().sweep(arguments)

    @dataclass
    class LightpruneOptunaSweeperConf(_optuna_config.OptunaSweeperConf):
        """The options of ``hydra/sweeper=optuna``, for :class:`LightpruneOptunaSweeper`."""

        _target_: str = "hydra_plugins.lightprune_optuna_sweeper.LightpruneOptunaSweeper"

    ConfigStore.instance().store(
        group="hydra/sweeper", name="lightprune_optuna", node=LightpruneOptunaSweeperConf, provider="lightprune"
    )
