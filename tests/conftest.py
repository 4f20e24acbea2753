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


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, each test process (and the CLI processes it starts) trains on its
    share of the cores: two processes of torch's default 2 intra-op threads on 2 cores spin
    against each other, and two trainings at once took 467 s where 1 thread each took 51 s
    (`OMP_NUM_THREADS`; a launch's workers take their own share of it)."""
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
    if count < 2 or "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    os.environ["OMP_NUM_THREADS"] = str(max(1, (cores or 1) // count))
    if "torch" in sys.modules:  # read at its import: set it here too
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


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


@pytest.fixture(autouse=True)
def _exclusive_or_shared(request: pytest.FixtureRequest) -> Iterator[None]:
    """Under pytest-xdist, a test marked `exclusive` (one that stops the machine's
    PostgreSQL) runs while no other test does (`stack_util.run_turn`). Set up before the
    test's other function fixtures (autouse): a test's database is made while it holds its
    share."""
    from stack_util import run_turn

    with run_turn(request.node.get_closest_marker("exclusive") is not None):
        yield


# The longest tests (a minute or more each on 2 cores), started first: under pytest-xdist a
# long test handed out last runs alone at the end while the other process idles.
LONGEST_FIRST = (
    "tests/tracking/test_study_tracking.py::",
    "tests/search/test_launch.py::test_embedded_default_several_workers",
    "tests/search/test_launch.py::test_bad_inputs_one_line_nonzero_nothing_written",
    "tests/search/test_secrets.py::test_password_never_leaks",
    "tests/search/test_launch.py::test_two_studies_of_one_work_folder_share_its_server",
    "tests/search/test_reliability.py::test_kill_9_worker_mid_trial_resumes_from_checkpoint",
    "tests/trainer/test_trainer_train.py::test_resnet18_learns_flowers102",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def first(item: pytest.Item) -> int:
        return next((i for i, p in enumerate(LONGEST_FIRST) if item.nodeid.startswith(p)),
                    len(LONGEST_FIRST))  # fmt: skip

    items.sort(key=first)  # stable: the others keep their order
