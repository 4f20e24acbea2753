"""Shared fixtures: the real PostgreSQL on 127.0.0.1:5432, the real Flowers-102 images."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
sys.path.insert(0, str(TESTS))  # dummy_trainer for worker subprocesses and tests


def data_root() -> Path:
    return Path(os.environ.get("HPSEARCH_DATA_DIR", REPO.parent / "shared" / "datasets"))


@pytest.fixture(scope="session")
def flowers_root() -> Path:
    root = data_root()
    if not (root / "flowers-102" / "imagelabels.mat").exists():
        pytest.fail(f"Flowers-102 not found under {root}; set HPSEARCH_DATA_DIR")
    return root


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A fresh PostgreSQL database for one test, dropped afterwards."""
    from stack_util import create_database, drop_database

    url = create_database("hps")
    try:
        yield url
    finally:
        drop_database(url)


@pytest.fixture
def subprocess_env(tmp_path: Path) -> dict[str, str]:
    """Environment for CLI subprocesses: tests/ importable (dummy trainer), no stray config."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("HPSEARCH_STORAGE", None)
    env.pop("MLFLOW_TRACKING_URI", None)
    env["HPSEARCH_DATA_DIR"] = str(data_root())
    env["PYTHONUNBUFFERED"] = "1"
    return env
