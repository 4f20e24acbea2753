"""The native stack (PostgreSQL for Optuna and MLflow, an MLflow server, two independent
workers) shared by test_stack.py and test_browser.py: built once per session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from stack_util import StackStudy, acquire_study, release_study, run_turn


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory, flowers_root: Path) -> Iterator[StackStudy]:
    with run_turn():  # its databases and workers' study, made outside any test's turn
        s = acquire_study(lambda: tmp_path_factory.mktemp("stack"), flowers_root)
    try:
        yield s
    finally:
        with run_turn():  # its databases dropped: not while PostgreSQL is stopped
            release_study()
