"""Shared fixtures: the real PostgreSQL on 127.0.0.1:5432, the real Flowers-102 images."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
sys.path.insert(0, str(TESTS))  # dummy_trainer for worker subprocesses and tests

PG_ADMIN = os.environ.get("HPSEARCH_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")


def data_root() -> Path:
    return Path(os.environ.get("HPSEARCH_DATA_DIR", REPO.parent / "shared" / "datasets"))


@pytest.fixture(scope="session")
def flowers_root() -> Path:
    root = data_root()
    if not (root / "flowers-102" / "imagelabels.mat").exists():
        pytest.fail(f"Flowers-102 not found under {root}; set HPSEARCH_DATA_DIR")
    return root


def _admin_engine():  # type: ignore[no-untyped-def]
    import sqlalchemy as sa
    from hpsearch.storage import normalize_url

    # NullPool: a test may restart PostgreSQL, which kills pooled connections.
    return sa.create_engine(
        normalize_url(PG_ADMIN), isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool
    )


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A fresh PostgreSQL database for one test, dropped afterwards."""
    import sqlalchemy as sa

    name = f"hps_{uuid.uuid4().hex[:12]}"
    eng = _admin_engine()
    with eng.connect() as c:
        c.execute(sa.text(f'CREATE DATABASE "{name}"'))
    base = PG_ADMIN.rsplit("/", 1)[0]
    try:
        yield f"{base}/{name}"
    finally:
        with eng.connect() as c:
            c.execute(
                sa.text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :n"
                ),
                {"n": name},
            )
            c.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}"'))
        eng.dispose()


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
