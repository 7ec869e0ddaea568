"""Hydra searchpath plugin: lightprune's config groups (``pruning``, ``model``, ``data``, ``trainer``, ...) are
found by any Hydra app in an environment where lightprune is installed, after the app's own configs.

A user's app then composes ``defaults: [{pruning: gmp_cubic}]`` and builds the callback with
``hydra.utils.instantiate(cfg.pruning)``. Its own config groups come first in the search path, so a group option
of the same name in the user's config directory wins. Nothing of lightprune (or torch) is imported to find the
folder: it is ``lightprune/conf`` in an installed wheel, ``conf/`` at the top of a source checkout.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


def lightprune_config_dir() -> Path | None:
    """The folder of lightprune's ``config.yaml`` and config groups, or ``None`` where lightprune is absent."""
    spec = importlib.util.find_spec("lightprune")
    if spec is None or not spec.submodule_search_locations:
        return None
    package = Path(next(iter(spec.submodule_search_locations)))
    for folder in (package / "conf", package.parents[1] / "conf"):
        if (folder / "config.yaml").is_file():
            return folder
    return None


class LightpruneSearchPathPlugin(SearchPathPlugin):
    """Appends lightprune's config folder to every Hydra app's config search path."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        folder = lightprune_config_dir()
        if folder is not None:
            search_path.append(provider="lightprune", path=f"file://{folder}")
