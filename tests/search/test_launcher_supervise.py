"""The launcher's supervision of its workers: whose trials it fails, stops that come while
it (re)starts workers, a failed set-up, process groups, signals. Workers here are small
Python processes standing in for `hpsearch worker`, so each test runs in seconds."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from cli_util import DUMMY
from hpsearch import launcher as launcher_mod
from hpsearch import worker as worker_mod
from hpsearch.config import load_config
from hpsearch.errors import HpsearchWarning, TrackingError
from hpsearch.launcher import Launcher, LaunchOptions, _Slot, launched_by
from hpsearch.packing import process_start
from hpsearch.storage import resolve_storage
from hpsearch.worker import ATTR_HOST, ATTR_PID, ATTR_PID_START, ATTR_WORKER
from optuna.trial import TrialState


def _launcher(work: Path, **opts: Any) -> Launcher:
    cfg = load_config("tiny", ["budget.max_epochs=1"])
    options = LaunchOptions(
        workers=1, workdir=work, device="cpu", tracking=False, train_fn=DUMMY, **opts
    )
    return Launcher(cfg, resolve_storage(None, work), options)


def _wait(cond: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    """Running: a zombie (killed, not yet reaped by whoever inherited it) is not."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z"


def test_launched_by_tells_a_launchs_workers_by_their_processes() -> None:
    mine = {100: 7, 101: None}
    assert launched_by({ATTR_PID: 100, ATTR_PID_START: 7}, mine)
    assert launched_by({ATTR_PID: 101, ATTR_PID_START: 9}, mine)  # start not read: the pid
    assert not launched_by({ATTR_PID: 100, ATTR_PID_START: 8}, mine)  # the pid reused
    assert not launched_by({ATTR_PID: 102, ATTR_PID_START: 7}, mine)  # another launch's
    assert launched_by({}, mine)  # an older worker recorded no pid: its name decides
    assert launched_by({ATTR_PID: 102}, None)


def test_a_launchs_eta_rate_counts_only_the_trials_its_workers_finished() -> None:
    """QA: an idle launch beside another launch of its study took that one's finished trials
    for its own rate (`eta 5s`, `36s`, `66s`: the time it had run)."""
    from hpsearch.launcher import finished_by
    from optuna.trial import FrozenTrial, create_trial

    def trial(state: TrialState, **attrs: int) -> FrozenTrial:
        return create_trial(state=state, value=0.5 if state == TrialState.COMPLETE else None,
                            user_attrs={**attrs})  # fmt: skip

    mine = {100: 7}
    trials = [
        trial(TrialState.COMPLETE, pid=100, pid_start=7),
        trial(TrialState.PRUNED, pid=100, pid_start=7),
        trial(TrialState.RUNNING, pid=100, pid_start=7),  # not finished yet
        trial(TrialState.COMPLETE, pid=102, pid_start=7),  # the other launch's
        trial(TrialState.COMPLETE),  # an older version's, before this launch: no pid
    ]
    assert finished_by(trials, mine) == 2


def test_a_launch_fails_only_the_trials_of_its_own_workers(tmp_path: Path) -> None:
    """Two launches of one study on one host (other work folders, one storage) both name
    their workers `host:w0`: a worker of one dying (or the launch ending) failed the other
    launch's live trial, which trained on, unable to record its result."""
    launcher = _launcher(tmp_path / "w")
    launcher._open_study()
    study = launcher.study
    worker_id = _Slot(0, None).worker_id
    host = socket.gethostname()
    launcher._pids[4_000_000] = None  # this launch's worker 0, dead now
    ours, theirs, older = study.ask(), study.ask(), study.ask()
    ours.set_user_attr(ATTR_PID, 4_000_000)
    # The other launch's worker 0: alive (this very process).
    theirs.set_user_attr(ATTR_PID, os.getpid())
    theirs.set_user_attr(ATTR_PID_START, process_start(os.getpid()))
    for trial in (ours, theirs, older):
        trial.set_user_attr(ATTR_WORKER, worker_id)
        trial.set_user_attr(ATTR_HOST, host)
    failed, held = launcher._fail_trials_of(worker_id, "worker died (test)")
    assert sorted(failed) == sorted([ours.number, older.number]) and held == []
    assert study._storage.get_trial(theirs._trial_id).state == TrialState.RUNNING
    # Nor does the launch's progress show the other launch's trial as its worker's.
    launcher._slots.append(_Slot(0, None))
    assert [w.trial for w in launcher._progress().workers] == [None]


def test_a_second_stop_before_mlflow_is_up_uses_no_crash_retry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C twice while the embedded MLflow server started: the killed worker's trial was
    held until the server was up, then failed as a crash, using up a retry (with
    --max-retries 0 it was never resumed, its checkpoint left unused)."""
    launcher = _launcher(tmp_path / "w", max_retries=0)
    launcher._open_study()
    study = launcher.study
    worker_id = _Slot(0, None).worker_id
    launcher._pids[4_000_000] = None  # this launch's worker 0, killed by the second stop
    trial = study.ask()
    trial.suggest_float("lr", 1e-3, 0.5, log=True)
    for key, value in {ATTR_PID: 4_000_000, ATTR_WORKER: worker_id,
                       ATTR_HOST: socket.gethostname()}.items():  # fmt: skip
        trial.set_user_attr(key, value)
    setting_up = [True]
    monkeypatch.setattr(launcher, "_tracking_setting_up", lambda: setting_up[0])
    failed, held = launcher._fail_trials_of(worker_id, "interrupted", interrupted=True)
    assert (failed, held) == ([], [trial.number])
    setting_up[0] = False
    assert launcher._fail_held() == [trial.number]
    waiting = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
    assert len(waiting) == 1  # re-queued to resume, --max-retries 0 notwithstanding


def test_a_stop_while_a_worker_is_restarted_restarts_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C while the launcher read the study to decide on a crashed worker's restart:
    the new worker never got the stop, trained through the grace period and was killed,
    its trial using up a retry."""
    launcher = _launcher(tmp_path / "w")
    launcher._open_study()
    slot = _Slot(0, None)
    slot.proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    slot.proc.wait()
    launcher._slots.append(slot)

    def stop_then_restart(*args: Any) -> bool:  # the Ctrl-C lands as the restart is decided
        launcher.stop()
        return True

    monkeypatch.setattr(launcher_mod, "should_restart", stop_then_restart)
    dead = slot.proc
    resolved = tmp_path / "w" / "run" / "tiny.yaml"
    try:
        launcher._on_exit(slot, 1, resolved, None)
        assert slot.proc is dead and slot.state == "stopped"
    finally:
        if slot.proc is not dead and slot.proc is not None:
            os.killpg(slot.proc.pid, signal.SIGKILL)


def test_a_failed_tracking_set_up_stops_the_workers_gracefully(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The embedded server not healthy in time (or a server refusing the study run): the
    workers, training meanwhile, were SIGKILLed, losing their epochs and a retry each."""
    launcher = _launcher(tmp_path / "w", grace_s=20)
    up, term = tmp_path / "up", tmp_path / "term"
    script = textwrap.dedent(
        f"""
        import pathlib, signal, sys, time
        def stop(*_):
            pathlib.Path({str(term)!r}).write_text("handed back")
            sys.exit(143)
        signal.signal(signal.SIGTERM, stop)
        pathlib.Path({str(up)!r}).write_text("up")
        time.sleep(60)
        """
    )

    def spawn(slot: _Slot, resolved: Path, uri: str | None) -> None:
        slot.proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
        launcher._pids[slot.proc.pid] = None
        slot.state = "running"

    def ready() -> bool:
        if up.exists():  # fails once the worker trains
            raise TrackingError("MLflow: the server was not healthy after 180 s")
        return False

    monkeypatch.setattr(launcher, "_spawn", spawn)
    monkeypatch.setattr(launcher, "_tracking_ready", ready)
    t0 = time.monotonic()
    with pytest.raises(TrackingError, match="not healthy"):
        launcher.run()
    assert term.read_text() == "handed back"
    assert time.monotonic() - t0 < 15  # not the grace: the worker stopped at once
    assert launcher._slots[0].proc is not None and launcher._slots[0].proc.returncode == 143


def test_the_launchs_kill_takes_what_a_dead_worker_started(tmp_path: Path) -> None:
    """A worker gone by the second Ctrl-C left its own children (a --train-fn's
    subprocess, holding a GPU maybe): the kill skipped the group of a worker already dead."""
    launcher = _launcher(tmp_path / "w")
    starts_child = (
        "import subprocess, sys; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        "print(p.pid, flush=True)"
    )
    slot = _Slot(0, None)
    slot.proc = subprocess.Popen(  # type: ignore[assignment]
        [sys.executable, "-c", starts_child], stdout=subprocess.PIPE, start_new_session=True
    )
    assert slot.proc is not None and slot.proc.stdout is not None
    child = int(slot.proc.stdout.readline())
    slot.proc.wait()
    launcher._slots.append(slot)
    try:
        assert _alive(child)
        launcher._kill_all()
        _wait(lambda: not _alive(child), 5, "the worker's child killed")
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


def test_a_third_ctrl_c_ends_a_launcher_stuck_in_its_stop() -> None:
    """A launcher waiting on a server's start or the database printed "killing now" at
    every further Ctrl-C and went on waiting."""
    script = textwrap.dedent(
        """
        import time
        from hpsearch.cli import _on_signals
        _on_signals(lambda: time.sleep(60), "launch")  # a stop that hangs
        print("ready", flush=True)
        time.sleep(60)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        for _ in range(3):
            proc.send_signal(signal.SIGINT)
            time.sleep(0.3)
        assert proc.wait(timeout=10) == -signal.SIGINT
    finally:
        proc.kill()


def test_a_sigterm_the_launcher_relays_is_not_a_second_stop() -> None:
    """systemd or a job scheduler signals every process of the job: each worker got the
    SIGTERM and the one its launcher relays, took the second for "kill now", and died
    without finishing its epoch."""
    script = textwrap.dedent(
        """
        import os, signal, threading, time
        from hpsearch.cli import _on_signals
        stop = threading.Event()
        received = _on_signals(stop.set, "worker", die_on_second=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)
        print(stop.is_set(), received, flush=True)
        """
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.split() == ["True", f"[{int(signal.SIGTERM)}]"]


def test_a_tracking_set_up_failing_after_the_trials_ended_fails_the_launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, subprocess_env: dict[str, str]
) -> None:
    """MLflow's import on a loaded machine outlasted a short study: the set-up's failure
    came after the workers had spent the budget, and the launch ended "done (budget)",
    untracked, with no word of it."""
    import threading

    from hpsearch.study import budget_counts

    for key, value in subprocess_env.items():  # the workers import the dummy trainer
        monkeypatch.setenv(key, value)
    launcher = _launcher(tmp_path / "w")

    def late_failure() -> None:  # once supervising is over: the worker is done
        launcher._study_settled.wait()
        _wait(lambda: [s.state for s in launcher._slots] == ["done"], 120, "the worker done")
        time.sleep(1.0)
        launcher._tracking_error = TrackingError("MLflow at notauri: refused")

    def start_tracking() -> None:
        launcher._tracking_thread = threading.Thread(target=late_failure, daemon=True)
        launcher._tracking_thread.start()

    monkeypatch.setattr(launcher, "_start_tracking", start_tracking)
    with pytest.raises(TrackingError, match="notauri"):
        launcher.run()
    assert sum(budget_counts(launcher.study.get_trials()).values()) == 4  # the trials stand


def test_a_worker_stopped_by_a_full_disk_restarts_once_the_disk_has_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each restart of a worker stopped by the disk check stopped the same way; a dip while
    a packed neighbour wrote its checkpoint may be over by the time its exit is seen, or
    later, while other workers train."""
    from hpsearch.errors import EXIT_DISK_FULL

    launcher = _launcher(tmp_path / "w")
    launcher._open_study()
    started: list[int] = []
    monkeypatch.setattr(launcher, "_start_unless_stopping",
                        lambda slot, *args: started.append(slot.index) or True)  # fmt: skip
    resolved = tmp_path / "w" / "run" / "tiny.yaml"
    full, room = _Slot(0, None), _Slot(1, None)
    launcher._slots += [full, room]
    monkeypatch.setattr(worker_mod, "free_disk_bytes", lambda folder: 10 << 20)
    launcher._on_exit(full, EXIT_DISK_FULL, resolved, None)
    assert started == [] and full.state == "crashed" and full.restarts == 0
    assert full.disk_full is not None and "10 MiB free on its disk" in full.disk_full
    assert "its work folder's disk has no room" in launcher._messages[-1]
    monkeypatch.setattr(worker_mod, "free_disk_bytes", lambda folder: 1 << 30)
    launcher._on_exit(room, EXIT_DISK_FULL, resolved, None)
    assert started == [1] and room.restarts == 1 and room.disk_full is None
    # The one still stopped starts again once the disk has room, while others train; not
    # before, not past its restarts, not once every trial is handed out.
    left, spent = {"running": 1}, {"running": 1, "complete": 3}  # of tiny's 4 trials
    assert launcher._restart_disk_stopped(spent, resolved, None) == 0 and started == [1]
    assert launcher._restart_disk_stopped(left, resolved, None) == 1 and started == [1, 0]
    assert full.restarts == 1 and full.disk_full is None
    assert "disk has room again; restarting it (1/3)" in launcher._messages[-1]
    full.state, full.disk_full = "crashed", "work folder w: 10 MiB free"
    monkeypatch.setattr(worker_mod, "free_disk_bytes", lambda folder: 10 << 20)
    assert launcher._restart_disk_stopped(left, resolved, None) == 0 and full.disk_full
    monkeypatch.setattr(worker_mod, "free_disk_bytes", lambda folder: 1 << 30)
    full.restarts = 3
    assert launcher._restart_disk_stopped(left, resolved, None) == 0 and started == [1, 0]


def test_a_stop_before_any_worker_started_ends_the_launch_interrupted(tmp_path: Path) -> None:
    """A Ctrl-C during the tracking set-up, before the first worker: the summary of no
    worker at all (every one stopped for the disk, vacuously) raised IndexError."""
    launcher = _launcher(tmp_path / "w")
    launcher.stop()
    summary = launcher.run()
    assert summary.stopped_by == "interrupted" and summary.disk_full is None


def test_a_worker_started_once_the_study_run_is_made_waits_for_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """QA: a worker restarted during an MLflow outage waited for the study run, made long
    before, for 240 s before its first trial was told. The first workers wait: the run
    is still in the making as they start."""
    launcher = _launcher(tmp_path / "w")
    commands: list[list[str]] = []

    class Proc:
        pid = os.getpid()

    def popen(cmd: list[str], **kwargs: Any) -> Proc:
        commands.append(cmd)
        return Proc()

    monkeypatch.setattr(launcher_mod.subprocess, "Popen", popen)
    making = threading.Event()
    launcher._tracking_thread = threading.Thread(target=making.wait)
    launcher._tracking_thread.start()
    resolved = tmp_path / "w" / "run" / "tiny.yaml"
    launcher._spawn(_Slot(0, None), resolved, "http://127.0.0.1:5000")
    making.set()
    launcher._tracking_thread.join()
    launcher._spawn(_Slot(0, None), resolved, "http://127.0.0.1:5000")
    waits = [cmd[cmd.index("--await-study-run") + 1] for cmd in commands]
    assert [float(w) for w in waits] == [launcher_mod.AWAIT_STUDY_RUN_S, 0.0]


def test_a_launch_says_once_when_another_launch_or_worker_trains_its_study_otherwise(
    tmp_path: Path,
) -> None:
    """QA: two launches of one study with other configs at once mixed their trials, and only
    the second launch said so (at its start). The first now says it when the other's first
    trial shows, once; a config that differs only in how it runs (its loaders) is not said,
    nor an earlier launch's (its start said that). Review: a worker's own config whose
    trials were there at the launch's start was never said, nor one a queued retry (no pid
    yet) showed first."""
    from hpsearch.storage import open_storage
    from hpsearch.study import CONFIG_ID_ATTR, create_or_load, trial_config_id

    launcher = _launcher(tmp_path / "w")
    storage = open_storage(launcher.spec)
    earlier = load_config("tiny", ["budget.max_epochs=1", "trainer.defaults.augment=none"])
    create_or_load(earlier, storage, owner=False)  # the study's first: its launch config
    before = launcher_mod.optuna.load_study(study_name="tiny", storage=storage).ask()
    before.set_user_attr(CONFIG_ID_ATTR, trial_config_id(earlier))
    own = load_config("tiny", ["budget.max_epochs=1", "trainer.defaults.augment=none",
                               "trainer.defaults.warmup_epochs=0"])  # fmt: skip
    create_or_load(own, storage, owner=False)  # a worker's own --set, running before
    waiting = launcher_mod.optuna.load_study(study_name="tiny", storage=storage).ask()
    waiting.set_user_attr(CONFIG_ID_ATTR, trial_config_id(own))  # (no pid)
    with pytest.warns(HpsearchWarning, match="augment: 'flip' \\(before: 'none'\\)"):
        launcher._open_study()  # its start says how it differs from the earlier launch
    study = launcher.study
    assert launcher._progress().message == (
        f"study tiny: trial {waiting.number}, of another launch or worker, trains otherwise "
        "than this launch's (trainer.defaults.augment: 'none' (here: 'flip'); "
        "trainer.defaults.warmup_epochs: 0.0 (here: 0.5)): their values will not compare"
    )
    assert launcher._progress().message == ""

    def other_trial(cfg: Any) -> int:
        create_or_load(cfg, storage, owner=False)  # records its config, as a worker's start
        t = study.ask()
        t.set_user_attr(CONFIG_ID_ATTR, trial_config_id(cfg))
        t.set_user_attr(ATTR_PID, os.getpid())  # not this launch's worker
        return t.number

    other_trial(load_config("tiny", ["budget.max_epochs=1", "trainer.num_workers=1"]))
    assert launcher._progress().message == ""  # runs otherwise, trains alike
    n = other_trial(
        load_config("tiny", ["budget.max_epochs=1", "trainer.defaults.schedule=cosine"])
    )
    other_trial(load_config("tiny", ["budget.max_epochs=1", "trainer.defaults.schedule=cosine"]))
    said = launcher._progress().message
    assert said == (
        f"study tiny: trial {n}, of another launch or worker, trains otherwise than this "
        "launch's (trainer.defaults.schedule: 'cosine' (here: 'onecycle')): their values will "
        "not compare"
    )
    assert launcher._progress().message == "" and said in launcher._messages


def test_a_best_trial_whose_model_found_no_room_is_said_at_the_launchs_end() -> None:
    """QA: the study's best trial's best-model write met a full disk; the value stood, and
    the launch ended `done (budget)` with nothing said: `load_best_model` found no model."""
    from hpsearch.launcher import lost_model_note
    from hpsearch.worker import ATTR_BEST_MODEL, ATTR_CHECKPOINT_URI, ATTR_MESSAGE
    from optuna.trial import create_trial

    lost = (
        "finished 2 epochs; not saved: t.best.pt (no space left on device (3 MiB free, "
        "45 MiB to write)); no best-model file is kept"
    )
    trial = create_trial(value=0.5, user_attrs={ATTR_MESSAGE: lost})
    trial.number = 1
    assert lost_model_note(trial) == (
        "trial 1, the study's best, kept no model (not saved: t.best.pt (no space left on "
        "device (3 MiB free, 45 MiB to write)); no best-model file is kept): with room on the "
        "disk, `hpsearch train --trial 1` trains it again"
    )
    for attrs in ({ATTR_MESSAGE: "finished 2 epochs"},
                  {ATTR_MESSAGE: lost, ATTR_BEST_MODEL: "/w/t.best.pt"},
                  {ATTR_MESSAGE: lost, ATTR_CHECKPOINT_URI: "runs:/x/checkpoint"}):  # fmt: skip
        assert lost_model_note(create_trial(value=0.5, user_attrs=attrs)) == ""
