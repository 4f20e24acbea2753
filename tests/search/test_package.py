"""The `hpsearch` package: its Python API loads what it needs on first use."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path


def test_the_package_loads_the_query_api_on_first_use() -> None:
    # A worker's plot helper and `hpsearch --help` import the package; pandas and Optuna's
    # storage (about 0.5 s) wait until the query API is used.
    code = (
        "import sys, hpsearch, hpsearch.cli\n"
        "assert 'pandas' not in sys.modules and 'hpsearch.query' not in sys.modules\n"
        "from hpsearch import best_trials, load_study\n"
        "assert callable(best_trials) and hpsearch.load_study is load_study\n"
        "assert 'pandas' in sys.modules\n"
        "try:\n"
        "    hpsearch.no_such_name\n"
        "except AttributeError as exc:\n"
        "    assert 'no_such_name' in str(exc)\n"
        "else:\n"
        "    raise SystemExit('no AttributeError')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_workers_onnx_export_does_not_load_matplotlib(tmp_path: Path) -> None:
    # A worker exports each new study best right after its tell; the plots are drawn in
    # the helper process, so matplotlib (0.3 s of CPU) has no business in the worker.
    code = (
        "import sys, torch\n"
        "from hpsearch.tracking.onnx_export import export_onnx\n"
        f"export_onnx(torch.nn.Linear(4, 3), torch.randn(2, 4), {str(tmp_path)!r} + '/m.onnx')\n"
        "assert 'matplotlib' not in sys.modules, 'matplotlib imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_an_exclusive_test_waits_for_the_running_ones_and_holds_back_new_ones(
    tmp_path: Path,
) -> None:
    """The turn the test processes take (tests/conftest.py): the test that stops
    PostgreSQL starts only when no other test runs, and none starts while it waits or
    runs."""
    import threading

    from stack_util import turn_for_test

    base = tmp_path / "run"
    events: list[str] = []
    running = threading.Event()
    release = threading.Event()

    def shared(name: str, hold: threading.Event | None) -> None:
        with turn_for_test(base, exclusive=False):
            events.append(f"{name} in")
            if hold is not None:
                running.set()
                hold.wait(10)
            events.append(f"{name} out")

    def exclusive() -> None:
        with turn_for_test(base, exclusive=True):
            events.append("x in")
            time.sleep(0.2)
            events.append("x out")

    first = threading.Thread(target=shared, args=("a", release))
    first.start()
    assert running.wait(10)
    alone = threading.Thread(target=exclusive)
    alone.start()
    import fcntl

    with open(f"{base}.gate", "a") as probe:  # until the exclusive one holds the gate
        deadline = time.monotonic() + 10
        while True:
            try:
                fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                break
            fcntl.flock(probe, fcntl.LOCK_UN)
            assert time.monotonic() < deadline
            time.sleep(0.01)
    later = threading.Thread(target=shared, args=("b", None))
    later.start()
    time.sleep(0.3)
    assert events == ["a in"]  # neither the exclusive one nor a new test started
    release.set()
    for t in (first, alone, later):
        t.join(10)
    assert events == ["a in", "a out", "x in", "x out", "b in", "b out"]
