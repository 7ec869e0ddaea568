"""Shared fixtures of the experiment app's tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightprune.experiment.cache import CACHE_ENV


@pytest.fixture(autouse=True)
def dense_cache_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets a fresh, empty dense-phase cache (also seen by the app in subprocesses), never ~/.cache."""
    path = tmp_path_factory.mktemp("dense-cache")
    monkeypatch.setenv(CACHE_ENV, str(path))
    return path
