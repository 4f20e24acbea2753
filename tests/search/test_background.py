"""The artifact helper process: jobs run off the worker's GIL, errors come back, and a dead
helper never loses a job."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hpsearch.background import Renderer
from hpsearch.tracking.artifacts import trial_artifacts


def _pid_and_nice() -> tuple[int, int]:
    return os.getpid(), os.nice(0)


def _fail(message: str) -> None:
    raise ValueError(message)


def _sleep_unless_in(pid: int) -> int:
    if os.getpid() != pid:
        time.sleep(60)
    return os.getpid()


def _die_unless_in(pid: int) -> int:
    if os.getpid() != pid:
        os.kill(os.getpid(), signal.SIGKILL)
    return os.getpid()


def test_jobs_run_in_a_lower_priority_helper_process(tmp_path: Path) -> None:
    renderer = Renderer()
    try:
        pid, nice = renderer.run(_pid_and_nice)
        assert pid != os.getpid() and nice > os.nice(0)
        assert renderer.run(_pid_and_nice)[0] == pid  # one helper, kept across jobs
        history = [{"epoch": 1, "train_loss": 2.0, "val_acc": 0.1}]
        files = renderer.run(trial_artifacts, history, [[3, 1], [0, 4]], ["a", "b"], 7, tmp_path)
        assert sorted(p.name for p in files) == [
            "confusion_matrix.png", "learning_curve.png", "per_class_accuracy.csv"
        ]  # fmt: skip
        assert all(p.stat().st_size > 0 for p in files)
        with pytest.raises(ValueError, match="bad plot"):
            renderer.run(_fail, "bad plot")
    finally:
        renderer.close()


def test_a_dead_helper_falls_back_to_this_process() -> None:
    renderer = Renderer()
    try:
        assert renderer.run(_die_unless_in, os.getpid()) == os.getpid()  # the job still ran
        assert renderer.run(_pid_and_nice)[0] == os.getpid()  # and later ones run here too
    finally:
        renderer.close()


def test_the_helper_ends_with_its_killed_parent(tmp_path: Path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(
        "import os, time\n"
        "from hpsearch.background import Renderer\n"
        "if __name__ == '__main__':\n"
        "    print(Renderer().run(os.getpid), flush=True)\n"
        "    time.sleep(120)\n"
    )
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        helper = int(parent.stdout.readline())
        assert helper != parent.pid and Path(f"/proc/{helper}").exists()
    finally:
        parent.kill()  # SIGKILL: the parent closes nothing
        parent.wait()
    deadline = time.monotonic() + 10.0
    while _alive(helper) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(helper), "helper outlived its parent"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"  # exited, waiting for whoever adopted it to reap it


def test_the_helper_ignores_ctrl_c_and_a_stuck_job_is_killed_and_redone_here() -> None:
    renderer = Renderer()
    try:
        helper = renderer.run(_pid_and_nice)[0]
        os.kill(helper, signal.SIGINT)  # what Ctrl-C sends to the whole process group
        time.sleep(0.5)
        assert renderer.run(_pid_and_nice)[0] == helper
        assert renderer.run(_sleep_unless_in, os.getpid(), timeout_s=2.0) == os.getpid()
        deadline = time.monotonic() + 10.0
        while _alive(helper) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(helper)  # killed, so nothing waits on its stuck job at exit
    finally:
        renderer.close()


def test_jobs_after_close_run_here() -> None:
    renderer = Renderer()
    assert renderer.run(_pid_and_nice)[0] != os.getpid()
    renderer.close()
    assert renderer.run(_pid_and_nice)[0] == os.getpid()  # no second helper is started


def test_close_waits_for_the_pools_manager_thread_and_an_exit_right_after_is_clean(
    tmp_path: Path,
) -> None:
    """Before Python 3.13, concurrent.futures' exit hook writes to the pool manager's wake-up
    pipe without the lock its closing takes: a process exiting while that thread still
    closed it failed with EBADF (a worker's exit code 1 in CI). close() returns only once
    the thread is done; a worker's fast exit right after it is clean, ten times over."""
    renderer = Renderer()
    renderer.run(_pid_and_nice)
    pool = renderer._pool
    assert pool is not None
    manager = pool._executor_manager_thread  # type: ignore[attr-defined]
    assert manager is not None and manager.is_alive()
    renderer.close()
    assert not manager.is_alive()
    script = (
        "from hpsearch.background import Renderer\n"
        "from hpsearch.cli import _exit_without_teardown\n"
        "import os\n"
        "if __name__ == '__main__':\n"
        "    r = Renderer(); r.run(os.getpid); r.close(); _exit_without_teardown()\n"
    )
    (tmp_path / "exit_now.py").write_text(script)
    for _ in range(10):
        proc = subprocess.run(
            [sys.executable, str(tmp_path / "exit_now.py")], capture_output=True, text=True,
            timeout=60,
        )  # fmt: skip
        assert (proc.returncode, proc.stderr) == (0, "")


def test_a_workers_trial_plots_leave_matplotlib_to_the_helper(tmp_path: Path) -> None:
    # The worker's own path (TrialRun._plots) in a fresh interpreter, as a worker has it:
    # the files come back from the helper, and the worker never loads matplotlib (0.3 s of
    # CPU on a thread that shares the GIL with training).
    code = f"""
import sys
from pathlib import Path
from types import SimpleNamespace as NS
from hpsearch.background import Renderer
from hpsearch.runs import TrialRun

renderer = Renderer()
run = NS(session=NS(renderer=renderer), trial=NS(number=3))
result = NS(history=[NS(epoch=1, train_loss=2.0, val_acc=0.1)], confusion=[[3, 1], [0, 4]],
            class_names=["a", "b"])
files = TrialRun._plots(run, result, Path({str(tmp_path)!r}))
renderer.close()
assert sorted(p.name for p in files) == [
    "confusion_matrix.png", "learning_curve.png", "per_class_accuracy.csv"], files
assert "matplotlib" not in sys.modules, "the worker imported matplotlib"
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_background_thread_runs_below_a_niced_worker() -> None:
    """NICE is added to the process's own nice value: a worker started under `nice -n 5`
    (as in a container's entry point) keeps its background threads below its training."""
    code = (
        "import os, threading\n"
        "from hpsearch.background import NICE, lower_priority\n"
        "out = []\n"
        "def run():\n"
        "    lower_priority(); lower_priority()  # twice: added once\n"
        "    out.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))\n"
        "t = threading.Thread(target=run); t.start(); t.join()\n"
        "print(out[0], os.getpriority(os.PRIO_PROCESS, 0), NICE)\n"
    )
    done = subprocess.run(
        ["nice", "-n", "5", sys.executable, "-c", code], capture_output=True, text=True,
        timeout=60, check=True,
    )  # fmt: skip
    thread, process, nice = (int(v) for v in done.stdout.split())
    assert process >= 5 and thread == min(19, process + nice)  # capped at 19 (CI under nice)
