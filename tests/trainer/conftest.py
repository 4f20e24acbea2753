"""Shared fixtures: the real Flowers-102 folder and one data cache per session (decoding is
the slow part)."""

from __future__ import annotations

from pathlib import Path

import pytest
from trainer_helpers import DATA_DIR


@pytest.fixture(scope="session")
def flowers_root() -> Path:
    if not (DATA_DIR / "flowers-102" / "jpg").is_dir():
        pytest.skip(f"Flowers-102 not found under {DATA_DIR} (set HPSEARCH_DATA_DIR)")
    return DATA_DIR


@pytest.fixture(scope="session")
def cache_workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One workdir (and decoded cache) for every Flowers test of the session."""
    return tmp_path_factory.mktemp("hpsearch-work")
