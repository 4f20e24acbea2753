"""The worker's asks, re-queues and stale checks across database outages and concurrent
workers, on the real PostgreSQL (connections terminated or refused for real)."""

from __future__ import annotations

import math
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


def test_a_dead_workers_trial_keeps_its_retry_when_the_database_drops_after_its_failure(
    pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The launcher failed a dead worker's trial, and the connection dropped before the
    retry was queued: run again, the section found the trial finished and queued none, and
    the worker's trained epochs were lost for good."""
    from hpsearch.launcher import fail_trial

    _, spec, study, trial = _claimed(pg_url, tmp_path)
    adds = []
    real_add = study.add_trial

    def add_once_lost(frozen: Any) -> None:
        adds.append(frozen)
        if len(adds) == 1:
            raise sa.exc.OperationalError("INSERT", {}, Exception("server closed the connection"))
        real_add(frozen)

    monkeypatch.setattr(study, "add_trial", add_once_lost)
    frozen = study._storage.get_trial(trial._trial_id)
    assert with_db_retry(lambda: fail_trial(study, spec, frozen, "worker 0 died", 2)) is True
    trials = study.get_trials(deepcopy=True)
    assert [t.state for t in trials] == [TrialState.FAIL, TrialState.WAITING]
    assert trials[1].system_attrs["failed_trial"] == trial.number
    # Once queued, running it again queues no second retry; another's trial is left alone.
    assert fail_trial(study, spec, study.trials[0], "worker 0 died", 2) is True
    assert fail_trial(study, spec, study.trials[0], "another reason", 2) is False
    assert len(study.get_trials(states=(TrialState.WAITING,))) == 1
