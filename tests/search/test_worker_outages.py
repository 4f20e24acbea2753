"""The worker's asks, re-queues and stale checks across database outages and concurrent
workers, on the real PostgreSQL (connections terminated or refused for real)."""

from __future__ import annotations

import math
import os
import re
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hpsearch.storage as S
import optuna
import pytest
import sqlalchemy as sa
from hpsearch import worker as W
from hpsearch.config import load_config
from hpsearch.rdb import FastRDBStorage
from hpsearch.storage import resolve_storage, study_lock, with_db_retry
from optuna.trial import TrialState


@pytest.fixture
def admin(pg_url: str) -> Iterator[sa.Engine]:
    """A connection to the server's `postgres` database, to end or refuse the test's ones."""
    engine = sa.create_engine(
        pg_url.rsplit("/", 1)[0] + "/postgres",
        isolation_level="AUTOCOMMIT",
        poolclass=sa.pool.NullPool,
    )
    yield engine
    engine.dispose()


def terminate(admin: sa.Engine, url: str) -> None:
    with admin.connect() as c:
        c.execute(
            sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :d"),
            {"d": url.rsplit("/", 1)[1]},
        )


def engine_of(study: optuna.Study) -> Any:
    return study._storage._backend.engine  # type: ignore[attr-defined]


def test_an_ask_the_database_interrupts_after_its_claim_goes_on_with_that_trial(
    pg_url: str, admin: sa.Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restart right after the claim's commit re-ran the whole ask, which claimed a
    second trial and left the first RUNNING (once with no heartbeat, never found stale): it
    held a place in the budget for good, and the study hung. The claim's commit holds its
    first heartbeat."""
    cfg = load_config("tiny", overrides=["budget.n_trials=2"])
    spec = resolve_storage(pg_url, tmp_path)
    opts = W.WorkerOptions(workdir=tmp_path, device="cpu", heartbeat_interval_s=1)
    study = W.connect(cfg, spec, opts)
    beaten: list[int] = []
    real = FastRDBStorage._create_new_trial

    def restart_first(self: FastRDBStorage, study_id: int, template: Any = None) -> Any:
        made = real(self, study_id, template)
        if not beaten:  # the database restarts right after the claim's commit
            beaten.append(made._trial_id)
            terminate(admin, pg_url)
        return made

    monkeypatch.setattr(FastRDBStorage, "_create_new_trial", restart_first)
    claimed: list[int] = []
    trial = with_db_retry(
        lambda: W._next_trial(
            study, cfg, spec, engine_of(study), W._Budget(study, cfg), None, claimed
        ),
        what="ask",
    )
    assert isinstance(trial, optuna.Trial)
    assert claimed == beaten == [trial._trial_id]
    with engine_of(study).connect() as c:
        rows = c.execute(
            sa.text(
                "SELECT t.number, t.state, h.heartbeat IS NOT NULL FROM trials t "
                "LEFT JOIN trial_heartbeats h USING (trial_id) ORDER BY t.number"
            )
        ).all()
    assert [tuple(r) for r in rows] == [(0, "RUNNING", True)]  # one claim, found if it dies


def test_an_interrupted_trials_retry_is_queued_under_the_study_lock(
    pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Failing an interrupted trial and queueing its retry are two commits: another
    worker's ask between them saw a free place and started a trial beyond the budget."""
    cfg = load_config("tiny", overrides=["budget.n_trials=2", "budget.max_epochs=3"])
    spec = resolve_storage(pg_url, tmp_path)
    opts = W.WorkerOptions(
        workdir=tmp_path, device="cpu", train_fn="dummy_trainer:train", heartbeat_interval_s=10
    )
    train_fn = W.load_train_fn(opts.train_fn)
    a, b = W.connect(cfg, spec, opts), W.connect(cfg, spec, opts)
    budget_b = W._Budget(b, cfg)
    ta = W._next_trial(a, cfg, spec, engine_of(a), W._Budget(a, cfg))
    tb = W._next_trial(b, cfg, spec, engine_of(b), budget_b)
    assert isinstance(ta, optuna.Trial) and isinstance(tb, optuna.Trial)
    asked: list[Any] = []
    blocked: list[bool] = []
    real = W.retry_callback

    class BAsksMeanwhile:
        def __init__(self, n: int) -> None:
            self.callback = real(n)

        def requeue(self, study: optuna.Study, frozen: Any, interrupted: bool) -> None:
            # B asks between A's FAIL and A's enqueue: it must wait for both.
            asking = threading.Thread(
                target=lambda: asked.append(W._next_trial(b, cfg, spec, engine_of(b), budget_b)),
                daemon=True,
            )
            asking.start()
            asking.join(1.0)
            blocked.append(asking.is_alive())
            self.callback.requeue(study, frozen, interrupted)
            threads.append(asking)

    threads: list[threading.Thread] = []
    monkeypatch.setattr(W, "retry_callback", BAsksMeanwhile)
    stop = threading.Event()
    stop.set()  # Ctrl-C: A's trial stops at its next epoch boundary
    outcome = W.run_trial(
        a, ta, cfg, opts, train_fn, None, None, stop, None,
        lambda: study_lock(spec, cfg.name, engine_of(a)),
    )  # fmt: skip
    assert outcome == "interrupted"
    threads[0].join(30)
    assert blocked == [True]
    (retry,) = asked
    assert isinstance(retry, optuna.Trial)  # B took A's retry, not a third place
    assert b._storage.get_trial(retry._trial_id).system_attrs["retry_history"] == [ta.number]
    monkeypatch.setattr(W, "retry_callback", real)
    for t in (tb, retry):
        W.run_trial(b, t, cfg, opts, train_fn, None, None, threading.Event())
    assert W._next_trial(b, cfg, spec, engine_of(b), budget_b) is None  # the budget is spent
    states = [t.state for t in b.get_trials(deepcopy=False)]
    assert sum(s in (TrialState.COMPLETE, TrialState.PRUNED) for s in states) == 2


def test_a_live_trial_outlives_an_outage_longer_than_the_heartbeat_grace(
    pg_url: str, admin: sa.Engine, tmp_path: Path
) -> None:
    """No worker can beat while the database is away, and stale checks come more often than
    beats: the first check after an outage longer than the grace failed every live trial."""
    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
    cfg = load_config("tiny", overrides=["budget.n_trials=3"])
    spec = resolve_storage(pg_url, tmp_path)
    interval = 2
    beat_s, grace_s, check_s = W.heartbeat_timing(interval)
    opts = W.WorkerOptions(workdir=tmp_path, device="cpu", heartbeat_interval_s=interval)
    a, b = W.connect(cfg, spec, opts), W.connect(cfg, spec, opts)
    trial = W._next_trial(a, cfg, spec, engine_of(a), W._Budget(a, cfg))
    assert isinstance(trial, optuna.Trial)
    beating = W._Heartbeat(a._storage, trial._trial_id)  # A is alive and training
    watcher = W._StaleWatcher(b, check_s, lambda: study_lock(spec, cfg.name, engine_of(b)), grace_s)
    name = pg_url.rsplit("/", 1)[1]
    try:
        time.sleep(1.0)
        with admin.connect() as c:
            c.execute(sa.text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false'))
        terminate(admin, pg_url)
        time.sleep(grace_s + 2 * beat_s)  # longer than the grace: every heartbeat is old
        with admin.connect() as c:
            c.execute(sa.text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true'))
        time.sleep(grace_s)  # the watcher's checks resume; A's beats too
    finally:
        with admin.connect() as c:
            c.execute(sa.text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true'))
        watcher.stop()
        beating.stop()
    assert math.isfinite(watcher.answering_since)  # the outage was seen, and is over
    states = {t.number: t.state for t in b.get_trials(deepcopy=False)}
    assert states == {trial.number: TrialState.RUNNING}


def _claimed(pg_url: str, tmp_path: Path) -> tuple[Any, Any, optuna.Study, optuna.Trial]:
    """A worker's study (tiny, 2 trials) and the trial it just claimed."""
    cfg = load_config("tiny", overrides=["budget.n_trials=2"])
    spec = resolve_storage(pg_url, tmp_path)
    opts = W.WorkerOptions(workdir=tmp_path, device="cpu", heartbeat_interval_s=10)
    study = W.connect(cfg, spec, opts)
    trial = W._next_trial(study, cfg, spec, engine_of(study), W._Budget(study, cfg))
    assert isinstance(trial, optuna.Trial)
    return cfg, spec, study, trial


def test_a_database_error_while_re_queueing_runs_the_locked_section_again(
    pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The study lock and the retry's enqueue failing once: the whole section runs again,
    lock included, on a fresh copy of the trial. Before, a lock that failed crashed the
    worker (the trial left RUNNING), and an enqueue run again queued a second retry or
    one whose history had the trial twice (Optuna's callback appends to the trial's list)."""
    cfg, spec, study, trial = _claimed(pg_url, tmp_path)
    calls = {"lock": 0, "add": 0}
    real_add = study.add_trial

    def lost(what: str) -> sa.exc.OperationalError:
        return sa.exc.OperationalError(what, {}, Exception("server closed the connection"))

    def add_once_lost(frozen: Any) -> None:
        calls["add"] += 1
        if calls["add"] == 1:
            raise lost("INSERT INTO trials")
        real_add(frozen)

    def lock_once_lost() -> Any:
        calls["lock"] += 1
        if calls["lock"] == 1:
            raise lost("SELECT pg_advisory_lock")
        return study_lock(spec, cfg.name, engine_of(study))

    monkeypatch.setattr(study, "add_trial", add_once_lost)
    W._fail_and_requeue(
        study, trial, lambda fn, what: with_db_retry(fn, what=what), 2, lock_once_lost
    )
    trials = study.get_trials(deepcopy=True)
    assert [t.state for t in trials] == [TrialState.FAIL, TrialState.WAITING]
    assert trials[1].system_attrs["retry_history"] == [trial.number]
    assert calls == {"lock": 3, "add": 2}


def test_a_trial_made_under_the_study_lock_has_its_heartbeat_in_the_same_commit(
    pg_url: str, tmp_path: Path
) -> None:
    """A commit whose reply is lost leaves the trial RUNNING: it must carry the heartbeat
    by which a stale check finds it, whoever records the next one."""
    cfg = load_config("tiny", overrides=["budget.n_trials=2"])
    spec = resolve_storage(pg_url, tmp_path)
    opts = W.WorkerOptions(workdir=tmp_path, device="cpu", heartbeat_interval_s=10)
    study = W.connect(cfg, spec, opts)
    with study_lock(spec, cfg.name, engine_of(study)):
        trial_id = study._storage.create_new_trial(study._study_id)
    with engine_of(study).connect() as c:
        beats = c.execute(
            sa.text("SELECT count(*) FROM trial_heartbeats WHERE trial_id = :t"), {"t": trial_id}
        ).scalar_one()
    assert beats == 1


def _lose_first_add(study: optuna.Study, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The study's first `add_trial` (a retry's queueing) fails as a dropped connection
    does; the later ones go through. The trials it was given, in order."""
    adds: list[Any] = []
    real_add = study.add_trial

    def add_once_lost(frozen: Any) -> None:
        adds.append(frozen)
        if len(adds) == 1:
            raise sa.exc.OperationalError("INSERT", {}, Exception("server closed the connection"))
        real_add(frozen)

    monkeypatch.setattr(study, "add_trial", add_once_lost)
    return adds


def test_a_dead_workers_trial_keeps_its_retry_when_the_database_drops_after_its_failure(
    pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The launcher failed a dead worker's trial, and the connection dropped before the
    retry was queued: run again, the section found the trial finished and queued none, and
    the worker's trained epochs were lost for good."""
    from hpsearch.launcher import fail_trial

    _, spec, study, trial = _claimed(pg_url, tmp_path)
    _lose_first_add(study, monkeypatch)
    frozen = study._storage.get_trial(trial._trial_id)
    assert with_db_retry(lambda: fail_trial(study, spec, frozen, "worker 0 died", 2)) is True
    trials = study.get_trials(deepcopy=True)
    assert [t.state for t in trials] == [TrialState.FAIL, TrialState.WAITING]
    assert trials[1].system_attrs["failed_trial"] == trial.number
    # Once queued, running it again queues no second retry; another's trial is left alone.
    assert fail_trial(study, spec, study.trials[0], "worker 0 died", 2) is True
    assert fail_trial(study, spec, study.trials[0], "another reason", 2) is False
    assert len(study.get_trials(states=(TrialState.WAITING,))) == 1


def _running_without_heartbeat(study: optuna.Study) -> list[int]:
    with engine_of(study).connect() as c:
        return list(
            c.execute(
                sa.text(
                    "SELECT t.number FROM trials t LEFT JOIN trial_heartbeats h "
                    "USING (trial_id) WHERE t.state = 'RUNNING' AND h.trial_id IS NULL"
                )
            ).scalars()
        )


def test_a_retrys_claim_whose_reply_is_lost_leaves_no_trial_the_stale_check_misses(
    pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Taking a queued retry (WAITING -> RUNNING, Optuna's commit) and its first heartbeat
    were two commits. With the claim's reply lost, the ask ran again and claimed another
    trial; the retry stayed RUNNING with no heartbeat, which no stale check finds, and the
    study waited for it forever. The beat now comes before the claim."""
    cfg = load_config("tiny", overrides=["budget.n_trials=2"])
    spec = resolve_storage(pg_url, tmp_path)
    opts = W.WorkerOptions(workdir=tmp_path, device="cpu", heartbeat_interval_s=10)
    study = W.connect(cfg, spec, opts)
    study.enqueue_trial({"lr": 0.01})
    real = optuna.storages.RDBStorage.set_trial_state_values
    lost: list[int] = []

    def claim_reply_lost(self: Any, trial_id: int, state: TrialState, values: Any = None) -> Any:
        done = real(self, trial_id, state, values)
        if state == TrialState.RUNNING and not lost:
            lost.append(trial_id)
            raise sa.exc.OperationalError("COMMIT", {}, Exception("server closed the connection"))
        return done

    monkeypatch.setattr(optuna.storages.RDBStorage, "set_trial_state_values", claim_reply_lost)
    with warnings.catch_warnings():  # with_db_retry's "unreachable, retrying"
        warnings.simplefilter("ignore")
        trial = with_db_retry(
            lambda: W._next_trial(study, cfg, spec, engine_of(study), W._Budget(study, cfg)),
            what="ask",
        )
    assert isinstance(trial, optuna.Trial) and lost and trial._trial_id != lost[0]
    assert _running_without_heartbeat(study) == []
    with engine_of(study).begin() as c:  # both workers long gone
        c.execute(sa.text("UPDATE trial_heartbeats SET heartbeat = heartbeat - interval '1 h'"))
    stale = study._storage._get_stale_trial_ids(study._study_id)  # type: ignore[attr-defined]
    assert lost[0] in stale


def test_a_stale_trials_retry_is_queued_when_the_database_drops_after_its_failure(
    pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Optuna's stale check fails the trial and queues its retry in two commits; an error
    between them left the trial failed with no retry, and no later check found it (it was
    no longer running): its trained epochs were lost. The next check queues the retry."""
    _, _, study, trial = _claimed(pg_url, tmp_path)
    # Its worker wrote its outcome and died before its tell: the outcome of a hand-back.
    study._storage.set_trial_user_attr(trial._trial_id, W.ATTR_OUTCOME, "interrupted")
    with engine_of(study).begin() as c:  # its worker died an hour ago
        c.execute(sa.text("UPDATE trial_heartbeats SET heartbeat = heartbeat - interval '1 h'"))
    _lose_first_add(study, monkeypatch)
    pending: dict[int, bool] = {}
    with pytest.raises(sa.exc.OperationalError):
        W.fail_stale_trials(study, pending)
    assert pending == {trial._trial_id: True}  # failed, retry not queued: kept for the next check
    assert W.fail_stale_trials(study, pending) == [trial.number]
    assert pending == {}
    assert W.fail_stale_trials(study, {trial._trial_id: True}) == []  # queued once only
    trials = study.get_trials(deepcopy=True)
    assert [t.state for t in trials] == [TrialState.FAIL, TrialState.WAITING]
    assert trials[1].system_attrs["failed_trial"] == trial.number


def test_the_stale_check_leaves_a_trial_its_worker_failed_alone(
    pg_url: str, tmp_path: Path
) -> None:
    """A trial that its worker failed itself (its outcome written: a training error) is not
    re-queued by a check that had found it stale."""
    _, _, study, trial = _claimed(pg_url, tmp_path)
    study._storage.set_trial_user_attr(trial._trial_id, W.ATTR_OUTCOME, "error")
    study._storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
    assert W.fail_stale_trials(study, {trial._trial_id: False}) == []
    assert [t.state for t in study.get_trials()] == [TrialState.FAIL]


@pytest.mark.parametrize("told", [TrialState.COMPLETE, TrialState.PRUNED])
def test_a_tell_whose_reply_is_lost_counts_as_told(
    pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, told: TrialState
) -> None:
    """The tell's commit went through and its reply was lost: run again, the tell found the
    trial finished and was taken for a trial finished elsewhere, so the study's best model
    lost its ONNX export. A trial that stands as told is this tell's."""
    from hpsearch.storage import tell

    _, _, study, trial = _claimed(pg_url, tmp_path)
    real = FastRDBStorage.set_trial_state_values
    lost: list[int] = []

    def reply_lost(self: Any, trial_id: int, state: TrialState, values: Any = None) -> Any:
        done = real(self, trial_id, state, values)
        if state.is_finished() and not lost:
            lost.append(trial_id)
            raise sa.exc.OperationalError("COMMIT", {}, Exception("server closed the connection"))
        return done

    monkeypatch.setattr(FastRDBStorage, "set_trial_state_values", reply_lost)

    def db(fn: Any, what: str) -> Any:
        return with_db_retry(fn, what=what)

    value = 0.9 if told == TrialState.COMPLETE else None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "finished elsewhere" warning either
        warnings.filterwarnings("ignore", ".*database unreachable, retrying")  # with_db_retry's own
        ok = W._safe_tell(
            db, lambda: tell(study, trial, value, state=told), W._finished_as(study, trial, told)
        )
    assert lost and ok
    # A trial another process failed meanwhile is still not this tell's.
    _, _, study2, other = _claimed(pg_url, tmp_path / "2")
    study2._storage.set_trial_state_values(other._trial_id, TrialState.FAIL)
    with pytest.warns(UserWarning, match="finished elsewhere"):
        assert not W._safe_tell(
            db, lambda: tell(study2, other, 0.5), W._finished_as(study2, other, TrialState.COMPLETE)
        )


def test_a_trial_left_pending_by_a_failed_check_is_not_failed_once_its_worker_beats_again(
    pg_url: str, tmp_path: Path
) -> None:
    """A check found a trial stale and the database failed before the trial's failure: the
    trial stays pending. Its worker, only cut off, beats again; a later check (another
    trial stale by then) must not fail it: it would run twice, and its worker's result be
    thrown away."""
    cfg, spec, study, live = _claimed(pg_url, tmp_path)
    dead = W._next_trial(study, cfg, spec, engine_of(study), W._Budget(study, cfg))
    assert isinstance(dead, optuna.Trial)
    with engine_of(study).begin() as c:  # only the dead worker's beat is old
        c.execute(
            sa.text(
                "UPDATE trial_heartbeats SET heartbeat = now() - interval '1 h' WHERE trial_id = :t"
            ),
            {"t": dead._trial_id},
        )
    assert W.fail_stale_trials(study, {live._trial_id: False}) == [dead.number]
    by_id = {t._trial_id: t.state for t in study.get_trials(deepcopy=False)}
    assert by_id[live._trial_id] == TrialState.RUNNING
    assert by_id[dead._trial_id] == TrialState.FAIL


# Runs in a network namespace of its own (unshare -n): the study's database through a local
# TCP port forwarded to the server's Unix socket, then the loopback taken down, so that the
# connection's packets go unanswered (no reset, no acknowledgement), as when the database's
# host vanishes. argv: driver, socket path, the test database's URL, work folder.
VANISHING_HOST = r"""
import os, socket, subprocess, sys, threading, time
from pathlib import Path

driver, unix_path, real_url, workdir = sys.argv[1:5]
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
listener = socket.create_server(("127.0.0.1", 0))


def pipe(src, dst):
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass


def forward():
    while True:
        client, _ = listener.accept()
        upstream = socket.socket(socket.AF_UNIX)
        upstream.connect(unix_path)
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=pipe, args=(a, b), daemon=True).start()


threading.Thread(target=forward, daemon=True).start()
import hpsearch.storage as S

S.PG_TCP_USER_TIMEOUT_MS = 2000  # the minute of its default, shortened for the test
from sqlalchemy.engine import make_url

port = listener.getsockname()[1]
url = make_url(real_url).set(drivername=f"postgresql+{driver}", host="127.0.0.1", port=port)
url = url.render_as_string(hide_password=False)
storage = S.open_storage(S.resolve_storage(url, Path(workdir)))
storage.get_all_studies()  # a pooled connection, through the forwarder
subprocess.run(["ip", "link", "set", "lo", "down"], check=True)


def hung():
    time.sleep(40)
    print("still waiting after 40s", flush=True)
    os._exit(1)


threading.Thread(target=hung, daemon=True).start()
t0 = time.monotonic()
try:
    storage.get_all_studies()
    print("answered")
except Exception as exc:
    print(f"gave up after {time.monotonic() - t0:.1f}s: {type(exc).__name__}", flush=True)
"""


@pytest.mark.parametrize("driver", ["psycopg2", "psycopg"])
def test_a_request_to_a_database_host_that_vanished_gives_up_within_the_tcp_user_timeout(
    pg_url: str, tmp_path: Path, subprocess_env: dict[str, str], driver: str
) -> None:
    """A worker whose database host vanished mid-request (power, a network cut: no reset,
    no acknowledgement) waited in the kernel's retransmissions for about 15 minutes, where
    keepalives cover idle connections only: libpq's tcp_user_timeout (a minute) now drops
    the connection, and the request fails as in any outage (with_db_retry then retries)."""
    import shutil
    import socket
    import subprocess

    url = pg_url.replace("postgresql://", f"postgresql+{driver}://", 1)
    storage = S.open_storage(resolve_storage(url, tmp_path))
    engine = storage.engine  # type: ignore[attr-defined]
    raw = engine.raw_connection()
    try:
        with socket.fromfd(raw.driver_connection.fileno(), socket.AF_INET, socket.SOCK_STREAM) as s:
            set_ms = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)
    finally:
        raw.close()
        engine.dispose()
    assert set_ms == S.PG_TCP_USER_TIMEOUT_MS == 60_000
    # The test server's Unix socket (Debian's folder), reached from the namespace by path.
    given = sa.engine.make_url(pg_url)
    unix_path = f"/var/run/postgresql/.s.PGSQL.{given.port or 5432}"
    if given.host not in ("127.0.0.1", "localhost", None):
        pytest.skip(f"the test server {given.host} is not this machine's")
    if not (shutil.which("unshare") and shutil.which("ip") and os.path.exists(unix_path)):
        pytest.skip("needs unshare, ip and PostgreSQL's socket at " + unix_path)
    if subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare -n is not permitted here (no CAP_SYS_ADMIN)")
    r = subprocess.run(
        ["unshare", "-n", sys.executable, "-c", VANISHING_HOST, driver, unix_path,
         given.render_as_string(hide_password=False), str(tmp_path)],
        env=subprocess_env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    found = re.search(r"gave up after ([\d.]+)s: (\w+)", r.stdout)
    assert found, r.stdout + r.stderr
    assert float(found[1]) < 20, r.stdout  # 2 s of timeout and libpq's own handling
