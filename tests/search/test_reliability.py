"""Fault injection with real processes and the real PostgreSQL: killed workers, Ctrl-C,
a database restart, and 16 concurrent workers. The trainer is the fast dummy; what is under
test is the search layer's bookkeeping."""

from __future__ import annotations

import datetime
import functools
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hpsearch as hps
import optuna
import pytest
from cli_util import DUMMY, hpsearch
from optuna.storages import BaseStorage
from optuna.trial import TrialState
from pg_util import cut_off, terminate_backends

FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)


def wait_for(
    cond: Callable[[], object], timeout: float, what: str, context: Callable[[], str] = str
) -> object:
    """`cond()`'s first true value; on a timeout, the error carries `context()`
    (the processes' output, say)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}\n{context()}")


def running_with_epochs(url: str, name: str, epochs: int) -> optuna.trial.FrozenTrial | None:
    try:
        study = optuna.load_study(study_name=name, storage=storage_for(url))
    except KeyError:
        return None
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if len(t.intermediate_values) >= epochs:
            return t
    return None


@functools.cache
def storage_for(url: str) -> BaseStorage:
    """The test's polls open the storage as hpsearch does, under its schema lock: a bare
    Optuna client polling while workers first connect to the empty database would race
    them creating Optuna's tables. One per database (each test has its own)."""
    from hpsearch.storage import open_storage, resolve_storage

    return open_storage(resolve_storage(url, Path.cwd()))


def launch_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "hpsearch.cli", "launch", *args]


@pytest.mark.parametrize("outage", ["away", "connections_ended"])
def test_the_progress_line_says_its_figures_are_old_while_the_database_is_away(
    pg_url: str, tmp_path: Path, subprocess_env: dict[str, str], outage: str
) -> None:
    """During a database outage the launcher showed its last figures as if they were read
    now; its line now says how old they are, and the next line after the outage is fresh.
    Connections ended by a restart that is over (the database answers new ones) are no
    outage: the read is made again at once. Nothing is lost: every trial finishes."""
    env = {**subprocess_env, "HPSEARCH_DUMMY_EPOCH_S": "0.5"}
    proc = subprocess.Popen(
        launch_cmd("--study", "tiny", "--workers", "1", "--trials", "2", "--storage", pg_url,
                   "--workdir", str(tmp_path / "w"), "--train-fn", DUMMY, "--no-tracking",
                   "--set", "budget.max_epochs=8", "--set", "pruner={name: none}"),
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        first = wait_for(lambda: running_with_epochs(pg_url, "tiny", 1), 120, "a trial 1 epoch in")
        if outage == "away":
            away = cut_off(pg_url, 6.0)  # progress is read every 2 s: at least two reads fail
            time.sleep(1.0)
            # QA: its worker killed meanwhile, the launcher's retries printed a line each.
            os.kill(int(first.user_attrs["pid"]), signal.SIGKILL)
            away.join()
        else:
            terminate_backends(pg_url)  # the launcher's pooled connection is dead
        out, _ = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    trials = hps.load_study("tiny", storage=pg_url).get_trials()
    states = [t.state for t in trials if t.state != TrialState.FAIL]
    assert states == [TrialState.COMPLETE] * 2, out
    lines = out.splitlines()
    if outage == "connections_ended":
        assert "unreachable" not in out, out
        return
    stale = [i for i, line in enumerate(lines) if "database unreachable: figures" in line]
    assert stale, out
    assert re.search(r"\| database unreachable: figures \d+s old$", lines[stale[0]]), out
    assert "retrying in" not in out, out  # QA: each retry's line between those (5 a time)
    # QA: the ETA climbed with each second of the outage: now that of the figures shown.
    etas = [re.search(r"eta (\d+)s", line) for line in lines[: stale[-1] + 1]]
    fresh = [int(m.group(1)) for i, m in enumerate(etas) if m and i < stale[0]]
    old = [int(m.group(1)) for i, m in enumerate(etas) if m and i in stale]
    assert not (fresh and old) or max(old) <= fresh[-1] + 1, out  # (when both show one)
    after = [line for line in lines[stale[-1] + 1 :] if re.match(r"\[\s*\d+s\] ", line)]
    assert after, out  # a fresh progress line once the database is back


def test_an_epoch_checkpointed_but_not_reported_before_a_kill_is_reported_by_the_retry(
    pg_url: str, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """The worker dies after epoch 1's checkpoint, before that epoch's report reached the
    database (as when the report's write, off the training thread, is still in flight): the
    retry resumes at epoch 2, and its curve still has epoch 1."""
    env = {**subprocess_env, "HPSEARCH_DUMMY_EPOCH_S": "0.1",
           "HPSEARCH_DUMMY_DIE_ONCE_UNREPORTED": str(tmp_path / "died")}  # fmt: skip
    r = hpsearch(["launch", "--study", "tiny", "--workers", "1", "--trials", "1",
                  "--storage", pg_url, "--workdir", str(tmp_path / "w"), "--train-fn", DUMMY,
                  "--set", "budget.max_epochs=4", "--set", "pruner.name=none",
                  "--set", "pruner.options={}", "--no-tracking"], env, timeout=240)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "died").exists()
    trials = hps.load_study("tiny", storage=pg_url).get_trials()
    [dead] = [t for t in trials if t.state == TrialState.FAIL]
    [retry] = [t for t in trials if t.system_attrs.get("failed_trial") == dead.number]
    assert not dead.intermediate_values  # epoch 1 was never reported by its try
    assert retry.user_attrs["resumed_from_epoch"] == 2
    assert sorted(retry.intermediate_values) == [1, 2, 3, 4], retry.intermediate_values
    assert retry.state == TrialState.COMPLETE and retry.value == max(
        retry.intermediate_values.values()
    )


def test_kill_9_worker_mid_trial_resumes_from_checkpoint(
    pg_url: str, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    env = {**subprocess_env, "HPSEARCH_DUMMY_EPOCH_S": "0.5"}
    proc = subprocess.Popen(
        launch_cmd("--study", "tiny", "--workers", "2", "--trials", "4", "--storage", pg_url,
                   "--workdir", str(tmp_path / "w"), "--train-fn", DUMMY,
                   "--set", "budget.max_epochs=5", "--set", "pruner.name=none",
                   "--set", "pruner.options={}"),
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        victim = wait_for(
            lambda: running_with_epochs(pg_url, "tiny", 2), 120, "a trial 2 epochs in"
        )
        assert isinstance(victim, optuna.trial.FrozenTrial)
        pid = victim.user_attrs["pid"]
        os.kill(pid, signal.SIGKILL)
        seen = len(victim.intermediate_values)  # >= 2
        out, _ = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    study = hps.load_study("tiny", storage=pg_url)
    trials = study.get_trials()
    assert len([t for t in trials if t.state in FINISHED]) == 4
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    dead = trials[victim.number]
    message = str(dead.user_attrs.get("message"))
    assert dead.state == TrialState.FAIL and "worker died (signal 9)" in message, (
        dead.state,
        dead.user_attrs,
        out[-3000:],
    )
    retry = [t for t in trials if t.system_attrs.get("failed_trial") == victim.number]
    assert len(retry) == 1 and retry[0].state in FINISHED and retry[0].params == victim.params
    resumed_from = retry[0].user_attrs["resumed_from_epoch"]
    # The retry trains from the epoch after the last checkpoint, which comes before its
    # epoch's report: nothing the victim had reported when it was seen is trained again
    # (but the last epoch, which has no checkpoint).
    assert resumed_from >= min(seen + 1, 5), (resumed_from, seen)
    # At most the epoch in flight is lost. The kill lands a poll after the victim was seen, so
    # what it had reported by then is read from the dead trial: its last checkpoint is at
    # most one epoch past its last stored report, or two when that report's write (made
    # off the training thread, at most one in flight) had not landed; the retry starts one
    # epoch later. No checkpoint is written at the last epoch (told next).
    reported = len(dead.intermediate_values)
    assert resumed_from <= min(reported + 3, 5), (resumed_from, reported)
    assert sorted(retry[0].intermediate_values) == list(range(1, 6))
    assert "worker 0 died (signal 9)" in out or "worker 1 died (signal 9)" in out
    # The dead worker's MLflow run (embedded server of the launch) is FAILED, not RUNNING.
    from hpsearch.tracking.server import start_local_server
    from mlflow.tracking import MlflowClient

    with start_local_server(tmp_path / "w") as server:
        client = MlflowClient(server.url)
        run = client.get_run(dead.user_attrs["mlflow_run_id"])
        assert run.info.status == "FAILED"
        assert "worker died (signal 9)" in run.data.tags["hpsearch.reason"]
        again = client.get_run(retry[0].user_attrs["mlflow_run_id"])
        assert again.info.status == "FINISHED" and again.info.run_id != run.info.run_id
    print(f"killed after epoch {reported}; retry resumed at epoch {resumed_from}")


def test_independent_worker_killed_is_detected_stale_and_retried(
    pg_url: str, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    heartbeat = 2  # seconds; detection must come within 2x
    env = {**subprocess_env, "HPSEARCH_DUMMY_EPOCH_S": "1.0"}
    common = ["--study", "tiny", "--storage", pg_url, "--no-tracking", "--train-fn", DUMMY,
              "--heartbeat", str(heartbeat), "--trials", "4", "--workdir", str(tmp_path / "shared"),
              "--set", "budget.max_epochs=8", "--set", "pruner.name=none",
              "--set", "pruner.options={}"]  # fmt: skip

    def worker(name: str) -> subprocess.Popen[str]:
        # Output to a file: an unread pipe could stall a worker, and a failure shows it.
        log = (tmp_path / f"{name}.log").open("w")
        return subprocess.Popen(
            [sys.executable, "-m", "hpsearch.cli", "worker", *common, "--worker-id", name],
            env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip

    storage = storage_for(pg_url)

    def running_of(name: str, epochs: int) -> optuna.trial.FrozenTrial | None:
        try:
            st = optuna.load_study(study_name="tiny", storage=storage)
        except KeyError:
            return None
        for t in st.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            if t.user_attrs.get("worker") == name and len(t.intermediate_values) >= epochs:
                return t
        return None

    def logs() -> str:
        return "\n".join(f"--- {p.name}:\n{p.read_text()}" for p in sorted(tmp_path.glob("*.log")))

    victim_p = worker("victim")
    survivor = worker("survivor")
    try:
        wait_for(lambda: running_of("survivor", 0), 120, "the survivor busy with a trial", logs)
        victim = wait_for(lambda: running_of("victim", 2), 120, "victim 2 epochs in", logs)
        assert isinstance(victim, optuna.trial.FrozenTrial)
        victim_p.send_signal(signal.SIGKILL)
        killed = datetime.datetime.now()

        def failed() -> optuna.trial.FrozenTrial | None:
            st = optuna.load_study(study_name="tiny", storage=storage)
            t = st.get_trials(deepcopy=False)[victim.number]
            return t if t.state == TrialState.FAIL else None

        dead = wait_for(failed, 60, "stale detection", logs)
        assert isinstance(dead, optuna.trial.FrozenTrial) and dead.datetime_complete is not None
        # When the survivor marked it FAIL (Optuna's timestamp), not when this test noticed.
        detected_s = (dead.datetime_complete - killed).total_seconds()
        survivor.wait(timeout=180)
        assert survivor.returncode == 0, logs()
    finally:
        victim_p.kill()
        survivor.kill()
    # Grace 1.5 beats plus a check period (0.2 beats), and 2 s for the check's own queries
    # and a loaded machine's scheduling: far from any slower path (a relaunch's).
    assert detected_s <= 2 * heartbeat + 2.0, detected_s
    study = hps.load_study("tiny", storage=pg_url)
    trials = study.get_trials()
    retry = [t for t in trials if t.system_attrs.get("failed_trial") == victim.number]
    assert len(retry) == 1 and retry[0].state in FINISHED
    assert retry[0].user_attrs["worker"] == "survivor"
    assert retry[0].user_attrs["resumed_from_epoch"] > 1
    assert len([t for t in trials if t.state in FINISHED]) == 4
    print(f"stale trial detected {detected_s:.2f}s after kill -9 (heartbeat {heartbeat}s)")


def _descendants(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-eo", "pid,ppid,pgid"], capture_output=True, text=True).stdout
    rows = [tuple(map(int, ln.split())) for ln in out.splitlines()[1:]]
    found, frontier = set(), {pid}
    while frontier:
        nxt = {p for p, pp, _ in rows if pp in frontier} - found
        found |= nxt
        frontier = nxt
    return found


def _standalone_worker(
    pg_url: str, workdir: Path, env: dict[str, str], epoch_s: float
) -> subprocess.Popen[str]:
    """`hpsearch worker` on the tiny study with the dummy trainer, `epoch_s` s an epoch."""
    return subprocess.Popen(
        [sys.executable, "-m", "hpsearch.cli", "worker", "--study", "tiny", "--storage", pg_url,
         "--workdir", str(workdir), "--no-tracking", "--train-fn", DUMMY, "--trials", "2"],
        env={**env, "HPSEARCH_DUMMY_EPOCH_S": str(epoch_s)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def test_a_second_ctrl_c_kills_a_standalone_worker_at_once(
    pg_url: str, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """It said "killing now" and trained on to the end of its epoch, then exited 0."""
    proc = _standalone_worker(pg_url, tmp_path, subprocess_env, 60)
    lines: list[str] = []
    assert proc.stdout is not None
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout or []), daemon=True)
    reader.start()
    try:
        wait_for(lambda: running_with_epochs(pg_url, "tiny", 0), 120, "a trial running")
        proc.send_signal(signal.SIGINT)
        # The second only once the first was handled: two pending SIGINTs merge into one.
        wait_for(lambda: any("stopping after" in line for line in lines), 60, "the first",
                 lambda: "".join(lines))  # fmt: skip
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=20)  # the epoch takes 60 s
        reader.join(10)
    finally:
        proc.kill()
    out = "".join(lines)
    assert proc.returncode == -signal.SIGINT, out
    assert "killing now" in out


def test_a_worker_stopped_by_sigterm_exits_143_with_its_trial_queued(
    pg_url: str, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """Not 0: a restart policy (Docker's on-failure, a Kubernetes Job) takes 0 for done and
    starts no worker again after a node's drain or a daemon's restart."""
    proc = _standalone_worker(pg_url, tmp_path, subprocess_env, 1)
    try:
        wait_for(lambda: running_with_epochs(pg_url, "tiny", 1), 120, "a trial 1 epoch in")
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, out
    states = [t.state for t in hps.load_study("tiny", storage=pg_url).get_trials()]
    assert states == [TrialState.FAIL, TrialState.WAITING], out


def test_sigint_launch_stops_cleanly_and_relaunch_resumes(
    pg_url: str, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    env = {**subprocess_env, "HPSEARCH_DUMMY_EPOCH_S": "0.5"}
    args = ["--study", "tiny", "--workers", "2", "--trials", "4", "--storage", pg_url,
            "--workdir", str(tmp_path / "w"), "--no-tracking", "--train-fn", DUMMY,
            "--set", "budget.max_epochs=6", "--set", "pruner.name=none",
            "--set", "pruner.options={}"]  # fmt: skip
    proc = subprocess.Popen(launch_cmd(*args), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        wait_for(lambda: running_with_epochs(pg_url, "tiny", 2), 120, "trials 2 epochs in")
        children = _descendants(proc.pid)
        assert len(children) >= 2
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, out
    time.sleep(0.5)
    alive = [p for p in children if Path(f"/proc/{p}").exists()]
    assert not alive, f"processes left behind: {alive}"
    study = hps.load_study("tiny", storage=pg_url)
    trials = study.get_trials()
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    # Retries (WAITING) carry the failed trial's attributes; the failed ones are the FAILs.
    interrupted = [t for t in trials if t.state == TrialState.FAIL]
    assert interrupted and all(t.user_attrs["outcome"] == "interrupted" for t in interrupted)
    waiting = [t for t in trials if t.state == TrialState.WAITING]
    assert len(waiting) == len(interrupted)

    r = hpsearch(["launch", *args], env, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    trials = hps.load_study("tiny", storage=pg_url).get_trials()
    assert len([t for t in trials if t.state in FINISHED]) == 4
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    for t in interrupted:
        retry = [x for x in trials if x.system_attrs.get("failed_trial") == t.number]
        assert len(retry) == 1 and retry[0].state in FINISHED
        last = max(t.intermediate_values)
        assert retry[0].user_attrs["resumed_from_epoch"] == last + 1


def _pg(action: str) -> None:
    version = os.listdir("/etc/postgresql")[0]
    subprocess.run(
        ["pg_ctlcluster", "--skip-systemctl-redirect", version, "main", action],
        check=True, capture_output=True,
    )  # fmt: skip


def _pg_ready() -> bool:
    return subprocess.run(["pg_isready", "-h", "127.0.0.1", "-q"]).returncode == 0


@pytest.mark.exclusive  # the other test processes' databases go down with it
def test_postgres_restart_mid_study_loses_nothing(
    pg_url: str, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    env = {**subprocess_env, "HPSEARCH_DUMMY_EPOCH_S": "0.3"}
    proc = subprocess.Popen(
        launch_cmd("--study", "tiny", "--workers", "2", "--trials", "8", "--storage", pg_url,
                   "--workdir", str(tmp_path / "w"), "--no-tracking", "--train-fn", DUMMY,
                   "--set", "budget.max_epochs=4"),
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        wait_for(lambda: running_with_epochs(pg_url, "tiny", 1), 120, "a running trial")
        _pg("stop")
        time.sleep(4)
    finally:
        if not _pg_ready():
            _pg("start")
        wait_for(_pg_ready, 30, "PostgreSQL back")
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    trials = hps.load_study("tiny", storage=pg_url).get_trials()
    numbers = [t.number for t in trials]
    assert len(numbers) == len(set(numbers))
    assert len([t for t in trials if t.state in FINISHED]) == 8
    assert not [t for t in trials if t.state == TrialState.RUNNING]


def test_sixteen_concurrent_workers(
    pg_url: str, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    n_trials = 48
    common = ["--study", "tiny", "--storage", pg_url, "--no-tracking", "--train-fn", DUMMY,
              "--workdir", str(tmp_path / "w"), "--set", "budget.max_epochs=2"]  # fmt: skip
    # Create the study once, so that 16 processes race on trials, not on table creation.
    assert (
        hpsearch(["launch", *common, "--workers", "1", "--trials", "1"], subprocess_env).returncode
        == 0
    )
    # Every worker holds its first trial until all 16 hold one: 16 trials really in flight.
    env = {**subprocess_env, "HPSEARCH_DUMMY_BARRIER": f"{tmp_path / 'barrier'}:16"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "hpsearch.cli",
                "worker",
                *common,
                "--worker-id",
                f"w{i}",
                "--trials",
                str(n_trials),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(16)
    ]
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=400)
        outs.append(out)
        assert p.returncode == 0, out
    joined = "\n".join(outs)
    for bad in ("Traceback", "too many clients", "deadlock", "Error"):
        assert bad not in joined, joined[-3000:]
    trials = hps.load_study("tiny", storage=pg_url).get_trials()
    numbers = [t.number for t in trials]
    assert sorted(numbers) == list(range(len(numbers)))
    assert len([t for t in trials if t.state in FINISHED]) == n_trials
    assert len(trials) == n_trials
    assert {f"w{i}" for i in range(16)} <= {t.user_attrs["worker"] for t in trials}


def test_a_worker_dying_while_the_embedded_server_starts_does_not_hold_up_the_launcher(
    pg_url: str, tmp_path: Path, subprocess_env: dict[str, str], monkeypatch: Any
) -> None:
    """A worker's first trial trains before the study's MLflow run exists. When the worker
    dies then, the launcher restarts it at once, and fails and re-queues the dead trial
    (with its MLflow run, under the study run) once the embedded server is up: it does not
    stop supervising until the server has started. Meanwhile it beats for the dead trial,
    which the restarted worker's stale check would otherwise fail first, without a run; and
    the budget of one trial, which the dead one still holds, does not stop the restart."""
    import hpsearch.tracking.server as server_mod
    from hpsearch.config import load_config
    from hpsearch.launcher import Launcher, LaunchOptions, Progress
    from hpsearch.storage import resolve_storage
    from mlflow.tracking import MlflowClient

    for key, value in subprocess_env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("HPSEARCH_DUMMY_EPOCH_S", "0.2")
    monkeypatch.setenv("HPSEARCH_DUMMY_DIE_ONCE", str(tmp_path / "died"))
    name = f"held-{time.time_ns()}"
    cfg = load_config("tiny", overrides=[f"name={name}", "budget.n_trials=1",
                                         "budget.max_epochs=3", "pruner={name: none}"])  # fmt: skip
    work = tmp_path / "w"
    heartbeat = 2  # s: a dead trial is stale after 3 s (1.5x), checked every 0.4 s
    opts = LaunchOptions(workers=1, workdir=work, device="cpu", train_fn=DUMMY,
                         progress_every_s=0.5, heartbeat_interval_s=heartbeat)  # fmt: skip
    events: list[tuple[float, str]] = []

    def on_progress(p: Progress) -> None:
        if p.message:
            events.append((time.monotonic(), p.message))

    launcher = Launcher(cfg, resolve_storage(pg_url, work), opts, on_progress=on_progress)
    real_start = server_mod.start_local_server
    held: dict[str, float] = {}

    def slow_start(workdir: Path, **kw: Any) -> Any:
        # The server is held up until the launcher has restarted the dead worker (at most
        # 120 s): a launcher that waited for the server here would not restart it before.
        # Then 4 stale periods more, with the restarted worker's stale check running.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any("restarting" in m for _, m in events):
            time.sleep(0.1)
        time.sleep(4 * 1.5 * heartbeat)
        held["released"] = time.monotonic()
        return real_start(workdir, **kw)

    monkeypatch.setattr(server_mod, "start_local_server", slow_start)
    summary = launcher.run()
    study = optuna.load_study(study_name=name, storage=storage_for(pg_url))

    def context() -> str:
        """What a failure here shows: the events, the trials and the workers' logs."""
        trials = [(t.number, t.state.name, t.user_attrs.get("message")) for t in study.trials]
        logs = {
            p.name: p.read_text(errors="replace")[-1500:]
            for p in sorted((work / "logs").glob("*worker-*.log"))
        }
        return f"released at {held.get('released')}; events {events}; trials {trials}; logs {logs}"

    assert (tmp_path / "died").exists()
    died = [(t, m) for t, m in events if "died (signal 9)" in m]
    assert died and "restarting it (1/3)" in died[0][1], context()
    assert "re-queued once MLflow is up" in died[0][1], context()
    assert died[0][0] < held["released"], context()  # restarted while the server was held up
    requeued = [t for t, m in events if m.endswith("re-queued to resume")]
    assert requeued and requeued[0] >= held["released"], context()
    assert summary.counts["complete"] == 1 and summary.stopped_by == "budget", context()

    dead = [t for t in study.trials if t.state == TrialState.FAIL]
    assert len(dead) == 1 and len(study.trials) == 2, context()
    message = str(dead[0].user_attrs.get("message"))
    assert message.startswith("worker died (signal 9)"), context()  # not stale
    with real_start(work) as server:
        client = MlflowClient(server.url)
        run = client.get_run(dead[0].user_attrs["mlflow_run_id"])
        assert run.info.status == "FAILED"
        assert "worker died (signal 9)" in run.data.tags["hpsearch.reason"]
        exp = client.get_experiment_by_name(name)
        assert exp is not None
        runs = client.search_runs([exp.experiment_id], "tags.`hpsearch.role` = 'trial'")
        # One run per trial: the dead trial's, and its retry's.
        assert sorted(int(r.data.tags["optuna.trial_number"]) for r in runs) == [0, 1]


def test_a_trials_failure_and_its_retrys_queueing_happen_under_the_study_lock(
    pg_url: str, tmp_path: Path, monkeypatch: Any
) -> None:
    """Failing a trial and queueing its retry are two commits. A worker asking between them
    saw a free place in the budget: a one-trial study ran two (seen in CI). The launcher's
    `fail_trial` (a dead worker's trial, an orphan) and a worker's stale check each hold the
    study lock across both, which every ask takes: the lock is not free when the retry is
    queued."""
    import hpsearch.launcher as launcher_mod
    import sqlalchemy as sa
    from hpsearch.config import load_config
    from hpsearch.launcher import Launcher, LaunchOptions
    from hpsearch.storage import _lock_key, open_storage, resolve_storage, study_lock
    from hpsearch.worker import _StaleWatcher, retry_callback

    name = f"lock-{time.time_ns()}"
    cfg = load_config("tiny", overrides=[f"name={name}", "budget.n_trials=1"])
    spec = resolve_storage(pg_url, tmp_path)
    probe = sa.create_engine(spec.url, poolclass=sa.pool.NullPool)
    lock_free_at_queueing: list[bool] = []

    class Spying:
        """retry_callback's callback, noting whether the study lock is free as it queues."""

        def __init__(self, max_retries: int) -> None:
            self.real = retry_callback(max_retries)

        def __call__(self, study: optuna.Study, trial: Any) -> None:
            self.requeue(study, trial, interrupted=False)

        def requeue(self, study: optuna.Study, trial: Any, interrupted: bool) -> None:
            with probe.connect() as conn:
                key = {"k": _lock_key(name)}
                free = bool(conn.execute(sa.text("SELECT pg_try_advisory_lock(:k)"), key).scalar())
                if free:
                    conn.execute(sa.text("SELECT pg_advisory_unlock(:k)"), key)
            lock_free_at_queueing.append(free)
            self.real.requeue(study, trial, interrupted)

    spying = Spying

    # The launcher's path.
    monkeypatch.setattr(launcher_mod, "retry_callback", spying)
    launcher = Launcher(cfg, spec, LaunchOptions(workers=1, workdir=tmp_path / "w", device="cpu"))
    launcher._open_study()
    study = launcher.study
    first = study.ask()
    dead = study._storage.get_trial(first._trial_id)
    assert launcher_mod.fail_trial(study, spec, dead, "worker died (test)", 2)
    assert lock_free_at_queueing == [False]

    # A worker's stale check: a trial whose heartbeat stopped 1 s ago.
    beating = open_storage(
        spec, heartbeat_interval=1, grace_period=1, failed_trial_callback=spying(2)
    )
    worker_study = optuna.load_study(study_name=name, storage=beating)
    stale = worker_study.ask()
    beating.record_heartbeat(stale._trial_id)  # type: ignore[attr-defined]
    time.sleep(1.5)
    watcher = _StaleWatcher(worker_study, 0.1, lambda: study_lock(spec, name))
    try:
        wait_for(
            lambda: worker_study._storage.get_trial(stale._trial_id).state == TrialState.FAIL,
            30,
            "the stale trial failed",
        )
        wait_for(lambda: len(lock_free_at_queueing) == 2, 30, "its retry queued")
    finally:
        watcher.stop()
    assert lock_free_at_queueing == [False, False]
    # The worker's ask took the first retry; that one failed stale and was queued again.
    states = [t.state for t in optuna.load_study(study_name=name, storage=beating).trials]
    assert states == [TrialState.FAIL, TrialState.FAIL, TrialState.WAITING]


def test_a_second_ctrl_c_waits_for_a_trial_being_handed_back(tmp_path: Path) -> None:
    """Killed between the hand-back's two commits, a worker left its trial FAIL with no
    retry: the kill waits for the section (worker.HANDBACK), then comes at once."""
    script = textwrap.dedent(
        """
        import os, signal, threading, time
        from hpsearch.cli import _on_signals
        from hpsearch.worker import HANDBACK

        _on_signals(threading.Event().set, "worker", die_on_second=True)
        with HANDBACK:  # a trial being handed back, on the main thread
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1.0)
            print("handed back", flush=True)
        time.sleep(30)
        print("not killed", flush=True)
        """
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == -signal.SIGINT, r.stdout + r.stderr
    assert "handed back" in r.stdout and "not killed" not in r.stdout


def test_an_embedded_server_that_dies_mid_study_is_restarted_and_nothing_is_missing(
    pg_url: str, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """The launch's own MLflow server killed mid-study (the out-of-memory killer): the UI
    stayed down for the rest of the study, and its runs reached MLflow only at a later
    launch. The launch restarts it on its port; at the end every trial has its run with
    every epoch."""
    import json

    from hpsearch.tracking.server import start_local_server, state_path
    from mlflow import MlflowClient

    env = {**subprocess_env, "HPSEARCH_DUMMY_EPOCH_S": "0.4"}
    work = tmp_path / "w"
    proc = subprocess.Popen(
        launch_cmd("--study", "tiny", "--workers", "1", "--trials", "4", "--storage", pg_url,
                   "--workdir", str(work), "--train-fn", DUMMY, "--set", "budget.max_epochs=3",
                   "--set", "pruner.name=none", "--set", "pruner.options={}"),
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:

        def tracked() -> object:  # the server up, the trial's run made: mid-study
            t = running_with_epochs(pg_url, "tiny", 1)
            return t is not None and t.user_attrs.get("mlflow_run_id")

        wait_for(tracked, 180, "a trial 1 epoch in, with its MLflow run")
        state = json.loads(state_path(work).read_text())
        os.killpg(int(state["pgid"]), signal.SIGKILL)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out
    assert "MLflow server exited (code -9): restarting it on port" in out, out
    assert "MLflow server restarted at http://127.0.0.1:" in out, out
    trials = hps.load_study("tiny", storage=pg_url).get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 4
    with start_local_server(work) as server:  # the launch stopped the one it restarted
        client = MlflowClient(server.url)
        exp = client.get_experiment_by_name("tiny")
        assert exp is not None
        runs = client.search_runs([exp.experiment_id], "tags.`hpsearch.role` = 'trial'")
        by_number = {int(r.data.tags["optuna.trial_number"]): r for r in runs}
        assert sorted(by_number) == [0, 1, 2, 3]
        for t in trials:
            run = by_number[t.number]
            assert run.info.status == "FINISHED"
            steps = [m.step for m in client.get_metric_history(run.info.run_id, "val_acc")]
            assert steps == [1, 2, 3], (t.number, steps)
