"""The storage fast paths on the real PostgreSQL: the budget count under the study lock and
batched trial attributes must agree with what Optuna's own API reports."""

from __future__ import annotations

import contextlib
import gc
import json
import subprocess
import threading
import time
from pathlib import Path

import optuna
import pytest
import sqlalchemy as sa
from cli_util import DUMMY, hpsearch
from disk_util import remount, tmpfs
from hpsearch.config import StudyConfig, config_to_yaml, load_config
from hpsearch.errors import ConfigError, HpsearchWarning, StorageError
from hpsearch.storage import (
    StorageSpec,
    _lock_key,
    count_trials_sql,
    deferred_params,
    normalize_url,
    open_storage,
    resolve_storage,
    set_trial_attrs,
    study_lock,
    tell,
    throttle_trial_reads,
)
from hpsearch.study import budget_counts, create_or_load, retry_params, suggest
from optuna.storages import BaseStorage
from pg_util import url_up_later
from sqlalchemy.engine import make_url


def _tiny_study(
    pg_url: str, tmp_path: Path
) -> tuple[StorageSpec, BaseStorage, StudyConfig, optuna.Study]:
    """The tiny study on a fresh PostgreSQL database, opened as a worker opens it."""
    spec = resolve_storage(pg_url, tmp_path)
    storage = open_storage(spec)
    cfg = load_config("tiny")
    return spec, storage, cfg, create_or_load(cfg, storage)


def test_aggregate_count_matches_optuna_and_attrs_land_in_one_go(
    pg_url: str, tmp_path: Path
) -> None:
    spec, storage, cfg, study = _tiny_study(pg_url, tmp_path)
    states = [optuna.trial.TrialState.COMPLETE] * 3 + [optuna.trial.TrialState.PRUNED]
    for state in states:
        t = study.ask()
        study.tell(t, 0.5 if state == optuna.trial.TrialState.COMPLETE else None, state=state)
    running = study.ask()
    failed = study.ask()
    study.tell(failed, state=optuna.trial.TrialState.FAIL)
    study.enqueue_trial({"lr": 0.01})
    engine = storage.engine  # type: ignore[attr-defined]
    with study_lock(spec, cfg.name, engine) as conn:
        assert conn is not None
        counts = count_trials_sql(conn, study)
    assert counts == budget_counts(study.get_trials(deepcopy=False))
    assert (counts["complete"], counts["pruned"], counts["running"]) == (3, 1, 1)
    assert (counts["fail"], counts["waiting"]) == (1, 1)

    attrs = {"worker": "w0", "host": "h", "pid": 123, "history": [{"epoch": 1, "acc": 0.5}]}
    set_trial_attrs(running, attrs, {"memory": 1.0})
    assert running.user_attrs == attrs  # the Trial's own view, as set_user_attr keeps it
    fresh = optuna.load_study(study_name=cfg.name, storage=normalize_url(pg_url))
    assert fresh.trials[running.number].user_attrs == attrs
    # stored where Trial.set_constraint puts it, so Optuna's constrained samplers read it
    assert fresh.trials[running.number].system_attrs["constraints:memory"] == 1.0
    # a second write updates keys in place (upsert) and adds new ones
    set_trial_attrs(running, {"pid": 456, "outcome": "finished"}, {"memory": 0.0})
    fresh = optuna.load_study(study_name=cfg.name, storage=normalize_url(pg_url))
    stored = fresh.trials[running.number]
    assert stored.user_attrs == {**attrs, "pid": 456, "outcome": "finished"}
    assert stored.system_attrs["constraints:memory"] == 0.0
    # a finished trial is not written to, as with Trial.set_user_attr
    with pytest.raises(optuna.exceptions.UpdateFinishedTrialError):
        set_trial_attrs(failed, {"late": 1})
    assert (
        "late"
        not in optuna.load_study(study_name=cfg.name, storage=normalize_url(pg_url))
        .trials[failed.number]
        .user_attrs
    )


def test_study_lock_excludes_other_processes_connections(pg_url: str, tmp_path: Path) -> None:
    """The advisory lock is held on the yielded connection: a second engine waits."""
    spec = resolve_storage(pg_url, tmp_path)
    a = sa.create_engine(spec.url)
    b = sa.create_engine(spec.url)
    order: list[str] = []
    try:
        with study_lock(spec, "s", a):
            t = threading.Thread(target=lambda: _take(spec, b, order))
            t.start()
            time.sleep(0.5)
            order.append("first releases")
        t.join(10)
        assert order == ["first releases", "second holds"]
    finally:
        a.dispose()
        b.dispose()


def _take(spec: StorageSpec, engine: sa.Engine, order: list[str]) -> None:
    with study_lock(spec, "s", engine):
        order.append("second holds")


def test_study_lock_is_released_when_the_locked_section_fails_a_statement(
    pg_url: str, tmp_path: Path
) -> None:
    """A failed statement aborts the lock connection's transaction; the lock must still be
    released, not go back to the pool with it (other workers would wait on it for good)."""
    spec = resolve_storage(pg_url, tmp_path)
    a = sa.create_engine(spec.url, pool_size=1)
    b = sa.create_engine(spec.url)
    try:
        with pytest.raises(sa.exc.ProgrammingError), study_lock(spec, "s", a) as conn:
            assert conn is not None
            conn.execute(sa.text("SELECT * FROM no_such_table"))
        with b.connect() as other:
            key = {"k": _lock_key("s")}
            took = other.execute(sa.text("SELECT pg_try_advisory_lock(:k)"), key).scalar()
            assert took is True
            other.execute(sa.text("SELECT pg_advisory_unlock(:k)"), key)
        with study_lock(spec, "s", a):  # and the pool still serves the lock
            pass
    finally:
        a.dispose()
        b.dispose()


def test_trial_reads_are_throttled_but_never_older_than_the_interval(
    pg_url: str, tmp_path: Path
) -> None:
    """A worker re-reads the other workers' trials at most every interval (Optuna's cache
    would re-read every running trial on each sampler call), and sees new ones after it."""
    spec = resolve_storage(pg_url, tmp_path)
    cfg = load_config("tiny")
    mine = create_or_load(cfg, open_storage(spec))
    other = create_or_load(cfg, open_storage(spec))  # another worker's connection
    backend = mine._storage._backend  # type: ignore[attr-defined]
    reads = {"n": 0}
    real = backend._get_trials

    def counting(*args: object, **kwargs: object) -> object:
        reads["n"] += 1
        return real(*args, **kwargs)

    backend._get_trials = counting
    throttle_trial_reads(mine, 3.0)  # s; the reads, ask and tell below fit well inside
    for _ in range(20):
        mine.get_trials(deepcopy=False)
    assert reads["n"] == 1
    t = other.ask()
    other.tell(t, 0.5)
    assert len(mine.get_trials(deepcopy=False)) == 0  # within the interval: the old view
    time.sleep(3.1)
    assert [x.state for x in mine.get_trials(deepcopy=False)] == [optuna.trial.TrialState.COMPLETE]
    assert reads["n"] == 2
    own = mine.ask()  # a process's own running trial is read fresh
    mine.get_trials(deepcopy=False)  # the sampler's view, read within the interval...
    tell(mine, own, 0.7)
    assert mine._storage.get_trial(own._trial_id).value == 0.7
    # ...is not kept after this process's own tell: its next sampler call sees the result.
    assert mine.get_trials(deepcopy=False)[-1].value == 0.7


def test_a_queued_retry_is_claimed_even_within_the_refresh_interval(
    pg_url: str, tmp_path: Path
) -> None:
    """The budget count sees a retry another process just queued; the claim must take that
    trial, not create a new one past the budget."""
    from hpsearch.worker import _Budget, _next_trial

    spec = resolve_storage(pg_url, tmp_path)
    cfg = load_config("tiny", overrides=["budget.n_trials=2"])
    mine = create_or_load(cfg, open_storage(spec))
    other = create_or_load(cfg, open_storage(spec))
    throttle_trial_reads(mine, 60.0)  # nothing refreshes this view on its own here
    first = mine.ask()
    mine.tell(first, 0.5)
    mine.get_trials(deepcopy=False)  # this process's view is now "fresh"
    other.enqueue_trial({"lr": 0.01, "batch_size": 32, "loss": "ce"})
    engine = mine._storage._backend.engine  # type: ignore[attr-defined]
    claimed = _next_trial(mine, cfg, spec, engine, _Budget(mine, cfg))
    assert isinstance(claimed, optuna.Trial) and claimed.number == 1
    assert claimed.suggest_float("lr", 1e-3, 0.5, log=True) == 0.01  # the queued params
    states = [t.state for t in other.get_trials(deepcopy=False)]
    assert states == [optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.RUNNING]
    # the budget is used up: a further ask waits for the running trial instead of creating
    assert _next_trial(mine, cfg, spec, engine, _Budget(mine, cfg)) == "wait"


@pytest.mark.parametrize("where", ["before_trial", "sample_relative"])
def test_a_sampler_that_fails_on_a_claimed_trial_fails_it_and_stops_the_worker(
    pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """The trial exists before the sampler runs and has no owner yet: left RUNNING, crash
    recovery never finds it and a relaunch waits for it forever (it crashed the worker so)."""
    from hpsearch import study as study_module
    from hpsearch.errors import ConfigError
    from hpsearch.worker import ATTR_MESSAGE, ATTR_OUTCOME, WorkerOptions, run_worker

    class Broken(optuna.samplers.TPESampler):
        def before_trial(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
            if where == "before_trial":
                raise ValueError("bad population")
            super().before_trial(study, trial)

        def infer_relative_search_space(self, study: object, trial: object) -> dict[str, object]:
            raise TypeError("'<' not supported between instances of 'int' and 'str'")

    from hpsearch import worker as worker_module

    spec = resolve_storage(pg_url, tmp_path)
    cfg = load_config("tiny", overrides=["budget.n_trials=2"])  # its load rehearses the sampler
    for module in (study_module, worker_module):  # the worker's own, seeded for its stream
        monkeypatch.setattr(module, "make_sampler", lambda cfg, *stream: Broken(seed=0))
    opts = WorkerOptions(workdir=tmp_path, device="cpu", train_fn="dummy_trainer:train")
    error = "ValueError: bad population" if where == "before_trial" else "TypeError: '<' not"
    with pytest.raises(ConfigError, match=rf"tiny.yaml: sampler 'tpe' failed: {error}"):
        run_worker(cfg, spec, opts)
    (trial,) = create_or_load(cfg, open_storage(spec)).get_trials(deepcopy=False)
    assert trial.state == optuna.trial.TrialState.FAIL
    assert trial.user_attrs[ATTR_OUTCOME] == "error"
    assert error in trial.user_attrs[ATTR_MESSAGE]


def test_drawn_params_are_written_with_the_attributes_in_one_commit(
    pg_url: str, tmp_path: Path
) -> None:
    spec, storage, cfg, study = _tiny_study(pg_url, tmp_path)
    for lr in (0.01, 0.1):  # past TPE's startup trials: relative sampling and constant liar
        study.enqueue_trial({"lr": lr, "batch_size": 32, "loss": "ce"})
        done = study.ask()
        suggest(done, cfg)
        study.tell(done, lr)
    other = study.ask()  # another trial of this process: its writes are not held
    trial = study.ask()
    engine = storage.engine  # type: ignore[attr-defined]
    commits: list[int] = []
    sa.event.listen(engine, "commit", lambda conn: commits.append(1))

    def stored(t: optuna.Trial) -> optuna.trial.FrozenTrial:
        fresh = optuna.load_study(study_name=cfg.name, storage=normalize_url(pg_url))
        return fresh.trials[t.number]

    with deferred_params(trial) as drawn:
        params = suggest(trial, cfg)
        other.suggest_float("lr", 1e-3, 0.5, log=True)
        assert trial.params == params  # the sampler and the trial see them at once
    assert [p.name for p in drawn.params] == list(params)
    # TPE's constant liar shares the relative params through a system attribute
    liar = {k: v for k, v in drawn.system_attrs.items() if k.startswith("tpe:relative_params")}
    assert liar and json.loads("".join(liar.values())).keys() <= set(params)
    assert stored(trial).params == {} and stored(trial).system_attrs == {}  # held
    assert "lr" in stored(other).params
    commits.clear()
    set_trial_attrs(trial, {"worker": "w0"}, drawn=drawn)
    assert len(commits) == 1
    assert stored(trial).params == params
    assert list(stored(trial).params) == list(params)  # stored in the order drawn
    assert stored(trial).system_attrs == liar == trial._cached_frozen_trial.system_attrs
    # a retry after a commit whose reply was lost writes them again: no error, no change
    set_trial_attrs(trial, {"worker": "w0"}, drawn=drawn)
    assert stored(trial).params == params
    assert stored(trial).user_attrs == {"worker": "w0"}
    # the public path again once the block is left
    trial.suggest_int("extra", 1, 3)
    assert "extra" in stored(trial).params

    # Optuna's rule stands: a name keeps a compatible distribution across the study, checked
    # from this process's cache or, in a process that has not drawn it yet, the database
    for late_study in (study, create_or_load(cfg, open_storage(spec))):
        late = late_study.ask()
        with deferred_params(late) as drawn:
            late.suggest_categorical("loss", ["nosuch"])
        with pytest.raises(ValueError, match="does not support dynamic value space"):
            set_trial_attrs(late, {"worker": "w1"}, drawn=drawn)
        assert stored(late).params == {} and stored(late).user_attrs == {}  # rolled back


def test_drawn_params_on_the_journal_are_written_as_usual(tmp_path: Path) -> None:
    spec = resolve_storage(None, tmp_path)
    study = create_or_load(load_config("tiny"), open_storage(spec))
    trial = study.ask()
    with deferred_params(trial) as drawn:
        params = suggest(trial, load_config("tiny"))
    assert drawn.params == [] and drawn.system_attrs == {}
    set_trial_attrs(trial, {"worker": "w0"}, drawn=drawn)
    assert study.trials[trial.number].params == params


def test_the_ask_reads_the_retry_queue_only_when_the_count_shows_one(
    pg_url: str, tmp_path: Path
) -> None:
    from hpsearch.worker import _claim_trial

    study = _tiny_study(pg_url, tmp_path)[3]
    popped: list[int | None] = []
    pop = study._pop_waiting_trial_id

    def counting_pop() -> int | None:
        popped.append(pop())
        return popped[-1]

    study._pop_waiting_trial_id = counting_pop  # type: ignore[method-assign]
    trial_id = _claim_trial(study, {"waiting": 0, "running": 0}, 10)
    assert isinstance(trial_id, int) and popped == []  # no read of the queue under the lock
    study.enqueue_trial({"lr": 0.01})
    queued = _claim_trial(study, {"waiting": 1, "running": 1}, 10)
    assert popped == [queued]
    assert study._storage.get_trial(queued).system_attrs["fixed_params"] == {"lr": 0.01}


def test_a_claim_writes_the_first_heartbeat_once(pg_url: str, tmp_path: Path) -> None:
    """A trial created under the study lock gets its heartbeat in the create's own commit;
    a second commit under the lock, every trial, wrote it again. A popped retry gets one."""
    from hpsearch.worker import _claim_trial

    spec = resolve_storage(pg_url, tmp_path)
    storage = open_storage(spec, heartbeat_interval=60, grace_period=120)
    study = create_or_load(load_config("tiny"), storage)
    beats: list[int] = []
    record = storage.record_heartbeat

    def counting(trial_id: int) -> None:
        beats.append(trial_id)
        record(trial_id)

    storage.record_heartbeat = counting  # type: ignore[method-assign]
    with study_lock(spec, study.study_name, storage.engine):  # type: ignore[attr-defined]
        created = _claim_trial(study, {"waiting": 0, "running": 0}, 10)
    study.enqueue_trial({"lr": 0.01})
    with study_lock(spec, study.study_name, storage.engine):  # type: ignore[attr-defined]
        popped = _claim_trial(study, {"waiting": 1, "running": 1}, 10)
    assert isinstance(created, int) and isinstance(popped, int) and beats == [popped]
    with storage.engine.connect() as conn:  # type: ignore[attr-defined]
        rows = conn.execute(sa.text("SELECT trial_id FROM trial_heartbeats ORDER BY trial_id"))
        assert [r[0] for r in rows] == sorted([created, popped])


def test_a_launch_on_psycopg_3(pg_url: str, tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    """The whole path on the psycopg 3 driver, named in the URL: the study lock and the
    budget count, the fast storage's trial reads and writes, heartbeats, the tell."""
    url = pg_url.replace("postgresql://", "postgresql+psycopg://", 1)
    # psycopg2 cannot be imported in the launch: a step that took it would fail.
    stub = tmp_path / "no-psycopg2" / "psycopg2"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError('psycopg2 is hidden from this test')\n")
    env = {**subprocess_env, "PYTHONPATH": f"{stub.parent}:{subprocess_env['PYTHONPATH']}"}
    out = hpsearch(
        ["launch", "--study", "tiny", "--storage", url, "--workers", "2", "--trials", "4",
         "--no-tracking", "--train-fn", DUMMY, "--workdir", str(tmp_path / "w"),
         "--set", "budget.max_epochs=3"],
        env,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    study = optuna.load_study(study_name="tiny", storage=url)
    finished = [t for t in study.trials if t.state.is_finished()]
    assert len(finished) == 4 and all(t.user_attrs.get("worker") for t in finished)
    assert {t.user_attrs["worker"] for t in study.trials} <= {
        f"{t.user_attrs['host']}:w{i}" for t in study.trials for i in (0, 1)
    }


def test_heartbeat_storage_is_the_storage_where_it_can_beat_and_if_asked_where_heartbeats_are_on(
    pg_url: str, tmp_path: Path
) -> None:
    from hpsearch.storage import heartbeat_storage

    spec = resolve_storage(pg_url, tmp_path)
    on = open_storage(spec, heartbeat_interval=10)
    assert heartbeat_storage(on) is on
    off = open_storage(spec)  # the launcher's: it beats for the trials it holds
    assert heartbeat_storage(off) is None
    assert heartbeat_storage(off, enabled=False) is off
    assert heartbeat_storage(optuna.storages.InMemoryStorage(), enabled=False) is None
    study = optuna.create_study(storage=on)  # Optuna's cache in front: still beats
    assert heartbeat_storage(study._storage) is study._storage


def test_a_relaunch_fails_a_journal_trial_no_worker_took_up(tmp_path: Path) -> None:
    """A worker that died between claiming a trial and naming itself on it left it RUNNING
    with no owner; on the journal storage (no heartbeats) a launch would wait for it
    forever. One that a live worker of this host runs is left alone."""
    import os
    import socket

    from hpsearch.launcher import fail_orphans_on_this_host
    from hpsearch.worker import ATTR_HOST, ATTR_PID, ATTR_WORKER

    spec = resolve_storage(None, tmp_path)
    assert spec.kind == "journal"
    cfg = load_config("tiny", overrides=["budget.n_trials=3"])
    study = create_or_load(cfg, open_storage(spec))
    ownerless = study.ask()
    owned = study.ask()
    for key, value in (
        (ATTR_WORKER, "w0"),
        (ATTR_HOST, socket.gethostname()),
        (ATTR_PID, os.getpid()),
    ):
        owned.set_user_attr(key, value)
    assert (
        fail_orphans_on_this_host(study, spec, 2) == []
    )  # just claimed: its worker may be naming itself
    assert fail_orphans_on_this_host(study, spec, 2, ownerless_after_s=0.0) == [ownerless.number]
    states = {t.number: t.state for t in study.get_trials(deepcopy=False)}
    assert states[ownerless.number] == optuna.trial.TrialState.FAIL
    assert states[owned.number] == optuna.trial.TrialState.RUNNING
    assert optuna.trial.TrialState.WAITING in states.values()  # re-queued, like any orphan
    # A worker's claim names it before its sampler runs (which may take long): the rule
    # then never takes a live worker's trial for an orphan, however old.
    from hpsearch.worker import _Budget, _next_trial

    owner = {ATTR_WORKER: "w1", ATTR_HOST: socket.gethostname(), ATTR_PID: os.getpid()}
    claimed = _next_trial(study, cfg, spec, None, _Budget(study, cfg), owner)
    assert isinstance(claimed, optuna.Trial)
    assert {k: claimed.user_attrs[k] for k in owner} == owner
    assert fail_orphans_on_this_host(study, spec, 2, ownerless_after_s=0.0) == []
    # A killed launch's worker whose PID a live process has now (a container restarted:
    # its new workers got the old PIDs): the start time tells them apart.
    from hpsearch.packing import process_start
    from hpsearch.worker import ATTR_PID_START

    reused = study.ask()
    for key, value in (*owner.items(), (ATTR_PID_START, (process_start(os.getpid()) or 0) + 1)):
        reused.set_user_attr(key, value)
    claimed.set_user_attr(ATTR_PID_START, process_start(os.getpid()))
    assert fail_orphans_on_this_host(study, spec, 2) == [reused.number]
    # Its retry names no owner or outcome until a worker takes it up: the dead try's made
    # the retry look like that worker's (a crash of its slot failed the live retry).
    (retry,) = [t for t in study.get_trials(deepcopy=False)
                if t.system_attrs.get("failed_trial") == reused.number]  # fmt: skip
    assert not {ATTR_WORKER, ATTR_HOST, ATTR_PID, ATTR_PID_START, "outcome"} & set(retry.user_attrs)


def test_a_worker_given_the_budget_records_it_and_not_its_other_values(tmp_path: Path) -> None:
    """`hpsearch worker --trials N` (or --set budget.n_trials=N) sets the study's budget; its
    other --set values are its own, and the stored config stays what the trials ran with."""
    from hpsearch.study import CONFIG_ATTR, N_TRIALS_ATTR

    spec = resolve_storage(None, tmp_path)
    cfg = load_config("tiny", overrides=["budget.n_trials=3"])
    before = create_or_load(cfg, open_storage(spec)).user_attrs
    worker = load_config("tiny", overrides=["budget.n_trials=9", "budget.max_epochs=1"])
    after = create_or_load(worker, open_storage(spec), owner=False, budget=True).user_attrs
    assert after[N_TRIALS_ATTR] == 9 and after[CONFIG_ATTR] == before[CONFIG_ATTR]


def test_a_launch_refused_for_its_direction_leaves_the_study_as_it_was(tmp_path: Path) -> None:
    from hpsearch.errors import ConfigError
    from hpsearch.study import CONFIG_ATTR, N_TRIALS_ATTR

    spec = resolve_storage(None, tmp_path)
    cfg = load_config("tiny", overrides=["budget.n_trials=3"])
    before = create_or_load(cfg, open_storage(spec)).user_attrs
    other = load_config(
        "tiny",
        overrides=[
            "objective.direction=minimize",
            "budget.n_trials=50",
            "trainer.defaults.arch=resnet34",
        ],
    )
    with pytest.raises(ConfigError, match="already exists with directions"):
        create_or_load(other, open_storage(spec))
    after = create_or_load(cfg, open_storage(spec), owner=False).user_attrs
    assert after[N_TRIALS_ATTR] == before[N_TRIALS_ATTR] == 3
    assert after[CONFIG_ATTR] == before[CONFIG_ATTR]
    # A file with no direction now takes its metric's (val_loss minimizes); a study begun
    # when every metric maximized says how to go on with it.
    legacy = load_config("tiny", overrides=["objective={metric: val_loss, direction: maximize}",
                                            "name=legacy_loss"])  # fmt: skip
    create_or_load(legacy, open_storage(spec))
    now = load_config("tiny", overrides=["objective={metric: val_loss}", "name=legacy_loss"])
    with pytest.raises(ConfigError, match=r"the file gives none: add `direction: maximize`"):
        create_or_load(now, open_storage(spec))


@pytest.mark.parametrize("driver", ["psycopg2", "psycopg"])
def test_a_table_another_optuna_client_creates_first_does_not_fail_the_open(
    pg_url: str, tmp_path: Path, driver: str
) -> None:
    """The schema lock orders hpsearch's processes only. Another Optuna client (a notebook,
    optuna-dashboard) on the same empty database can create a table between Optuna's check
    and its CREATE: CI saw a worker fail with 'duplicate key value violates unique
    constraint "pg_type_typname_nsp_index" ... (alembic_version, 2200)'. Here that other
    client holds the table uncommitted until the open waits on it, then commits. On both
    drivers (their errors carry the SQLSTATE differently), and the failed attempt leaves no
    connection open."""
    spec = resolve_storage(pg_url.replace("postgresql://", f"postgresql+{driver}://", 1), tmp_path)
    other = sa.create_engine(spec.url, poolclass=sa.pool.NullPool)
    opened: list[object] = []
    gc.disable()  # an orphaned connection would otherwise close when a collection ran
    try:
        with other.connect() as conn:
            conn.execute(sa.text("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)"))
            t = threading.Thread(target=lambda: opened.append(_open_or_error(spec)))
            t.start()

            def waiting() -> bool:
                sql = (
                    "SELECT count(*) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND wait_event_type = 'Lock'"
                )
                with other.connect() as probe:
                    return bool(probe.execute(sa.text(sql)).scalar())

            deadline = time.monotonic() + 60
            while not waiting():
                assert time.monotonic() < deadline, "the open never reached the CREATE"
                time.sleep(0.05)
            conn.commit()
        t.join(60)
        assert len(opened) == 1 and isinstance(opened[0], BaseStorage), opened
        study = optuna.create_study(storage=opened[0], study_name="after-the-race")
        assert study.study_name == "after-the-race"
        opened[0].engine.dispose()  # type: ignore[attr-defined]
        with other.connect() as probe:
            sql = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            # This probe's alone: no orphan. A closed connection's server process ends a
            # moment after its client closed it (seen under load in CI): 10 s for that.
            deadline = time.monotonic() + 10
            while (count := probe.execute(sa.text(sql)).scalar()) != 1:
                assert time.monotonic() < deadline, f"{count} connections: an orphan"
                time.sleep(0.2)
    finally:
        gc.enable()
        other.dispose()


def _open_or_error(spec: StorageSpec) -> object:
    try:
        return open_storage(spec)
    except Exception as exc:  # the test shows what the open raised
        return exc


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        ("returns_none", "returned NoneType, not a TrialResult"),
        ("returns_nan", "is not finite"),
        # QA: COMPLETE in Optuna, FAILED in MLflow; a crashed worker, retried as such.
        ("returns_an_unknown_reason", "stop_reason: 'done': must be one of finished,"),
        ("calls_sys_exit", "the train function called sys.exit(3)"),
    ],
)
def test_a_train_function_returning_no_usable_result_fails_its_trials_and_stops(
    tmp_path: Path, fn: str, message: str
) -> None:
    """A result the study cannot take fails the trial with a message (the worker crashed on
    None, leaving the trial RUNNING; a NaN was stored FAIL by Optuna, counted toward nothing,
    and the worker made trials without end). After max_errors such trials it gives up."""
    from hpsearch.worker import ATTR_MESSAGE, WorkerOptions, run_worker

    cfg = load_config("tiny", overrides=["budget.n_trials=4", "budget.max_epochs=1"])
    spec = StorageSpec("journal", str(tmp_path / "optuna.journal"), "journal")
    opts = WorkerOptions(workdir=tmp_path, train_fn=f"dummy_trainer:{fn}", max_errors=2)
    seen: list[tuple[int, str, str]] = []
    summary = run_worker(cfg, spec, opts, on_trial=lambda *a: seen.append(a))
    assert summary.outcomes == {"error": 2}
    trials = create_or_load(cfg, open_storage(spec)).get_trials(deepcopy=False)
    assert [t.state for t in trials] == [optuna.trial.TrialState.FAIL] * 2
    assert all(message in t.user_attrs[ATTR_MESSAGE] for t in trials)
    # The worker says why (its log had "trial 0: error" alone; the cause, a full disk say,
    # was in the study only), and so does its "repeated errors" stop.
    assert [(n, o) for n, o, _ in seen] == [(0, "error"), (1, "error")]
    assert all(message in m for *_, m in seen) and message in summary.last_error


def test_a_train_functions_epochs_of_tensors_are_stored_as_numbers(tmp_path: Path) -> None:
    """QA: a custom trainer's epoch records of torch and numpy scalars (which `report`
    takes) trained every epoch, then failed its trial at the tell: "Object of type Tensor
    is not JSON serializable"; a result without an effective lr failed it likewise."""
    from hpsearch.worker import ATTR_HISTORY, WorkerOptions, run_worker

    cfg = load_config("tiny", overrides=["budget.n_trials=1", "budget.max_epochs=2"])
    spec = StorageSpec("journal", str(tmp_path / "optuna.journal"), "journal")
    opts = WorkerOptions(workdir=tmp_path, train_fn="dummy_trainer:records_tensors")
    assert run_worker(cfg, spec, opts).outcomes == {"finished": 1}
    (trial,) = create_or_load(cfg, open_storage(spec)).get_trials(deepcopy=False)
    assert trial.state == optuna.trial.TrialState.COMPLETE
    history = trial.user_attrs[ATTR_HISTORY]
    assert [type(h["val_acc"]) for h in history] == [float, float]
    assert type(history[0]["train_loss"]) is float and isinstance(history[0]["lr"], list)
    assert "effective_lr" not in trial.user_attrs and trial.user_attrs["effective_batch_size"]


def test_a_worker_on_a_full_disk_starts_no_trial(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a full disk every trial failed fast (its checkpoints, its data cache), a worker
    stopped after --max-errors of them, and its restarts failed a dozen more: it now says
    so before asking, and the study keeps no failed trial for it."""
    import hpsearch.worker as W
    from hpsearch.errors import DiskFullError

    cfg = load_config("tiny", overrides=["budget.n_trials=4", "budget.max_epochs=1"])
    spec = StorageSpec("journal", str(tmp_path / "optuna.journal"), "journal")
    opts = W.WorkerOptions(workdir=tmp_path, train_fn="dummy_trainer:train")
    monkeypatch.setattr(W, "free_disk_bytes", lambda folder: 10 << 20)
    with pytest.raises(DiskFullError, match=r"10 MiB free on its disk, under the 64 MiB"):
        W.run_worker(cfg, spec, opts)
    assert create_or_load(cfg, open_storage(spec)).get_trials(deepcopy=False) == []
    assert W.disk_full(tmp_path, None) is None and W.disk_full(tmp_path, 64 << 20) is None
    # Trials that write no checkpoint (trainer.checkpoint: false) are not held back.
    light = load_config("tiny", ["budget.n_trials=1", "budget.max_epochs=1",
                                 "trainer.checkpoint=false"])  # fmt: skip
    one = W.WorkerOptions(workdir=tmp_path, train_fn="dummy_trainer:train", max_trials=1)
    assert len(W.run_worker(light, spec, one).trials) == 1
    monkeypatch.undo()
    assert (W.free_disk_bytes(tmp_path) or 0) > 0


def test_a_worker_starts_no_trial_where_its_checkpoints_disk_is_read_only(
    tmp_path: Path,
) -> None:
    """QA: with the checkpoints' disk remounted read-only mid-launch, the worker went on
    starting trials that trained for minutes, then failed at their first save. A real
    tmpfs (mounted as root, as CI runs)."""
    import hpsearch.worker as W

    with tmpfs(tmp_path / "checkpoints", "128M", read_only=True) as folder:
        stop = W.disk_stop(tmp_path, "tiny")
        assert stop == (
            f"work folder {folder}: its disk is read-only; make it writable and launch again "
            "(queued trials resume)"
        )
        remount(folder, "rw")
        assert W.disk_stop(tmp_path, "tiny") is None  # 128 MiB free: room for a trial


def test_a_trial_whose_checkpoint_finds_no_room_is_handed_back_and_the_worker_stops(
    tmp_path: Path,
) -> None:
    """QA: a trial whose resume checkpoint met a full disk (or a read-only one) failed for
    good, its epochs lost, and the worker went on to train the next trial, which failed
    alike. It is queued to resume now (no fault of its own), and the worker stops with the
    disk's error (exit 74), which the launch restarts once the disk has room."""
    import hpsearch.worker as W
    from hpsearch.errors import DiskFullError

    cfg = load_config("tiny", overrides=["budget.n_trials=4", "budget.max_epochs=2"])
    spec = StorageSpec("journal", str(tmp_path / "optuna.journal"), "journal")
    opts = W.WorkerOptions(workdir=tmp_path, train_fn="dummy_trainer:disk_full_after_an_epoch")
    with pytest.raises(DiskFullError, match="no space left on device"):
        W.run_worker(cfg, spec, opts)
    first, retry = create_or_load(cfg, open_storage(spec)).get_trials(deepcopy=False)
    assert first.state == optuna.trial.TrialState.FAIL
    assert first.user_attrs[W.ATTR_OUTCOME] == "interrupted"
    assert "no space left on device (3 MiB free" in first.user_attrs[W.ATTR_MESSAGE]
    assert retry.state == optuna.trial.TrialState.WAITING and retry.params == first.params
    # Until the disk has room for twice what the trial could not write (a checkpoint and a
    # best model), no trial starts there (QA: restarted at 71 MiB free for 85 MiB, each
    # restart trained the trial again and failed it alike).
    assert W._disk_need_path(tmp_path, "tiny").read_text() == str(45 << 20)  # the worker's
    # A trial that ends with room clears it (review: kept for ever, one large model's need
    # held back every trial of the study).
    ok = W.WorkerOptions(workdir=tmp_path, train_fn=DUMMY, max_trials=1)
    assert W.run_worker(cfg, spec, ok).outcomes == {"finished": 1}
    assert not W._disk_need_path(tmp_path, "tiny").exists()
    free = (W.free_disk_bytes(tmp_path) or 0) >> 20
    assert free > 90 and W.disk_stop(tmp_path, "tiny") is None
    W._record_disk_need(tmp_path, "tiny", free << 20)
    assert f"under the {2 * free} MiB a trial's checkpoints need" in (
        W.disk_stop(tmp_path, "tiny") or ""
    )
    assert W.disk_stop(tmp_path, "other") is None


def test_a_trial_handed_back_from_the_gpu_memory_line_says_so_and_is_found_if_cut(
    tmp_path: Path,
) -> None:
    """A trial whose wait for GPU memory ran out is handed back: it said nothing on the
    trial (`status` showed a FAIL with no reason), and a worker killed between its failure
    and its retry left it for good (a relaunch looks for hand-backs by their outcome)."""
    from hpsearch.worker import ATTR_MESSAGE, ATTR_OUTCOME, WorkerOptions, run_worker

    cfg = load_config("tiny", overrides=["budget.n_trials=1", "budget.max_epochs=1"])
    spec = StorageSpec("journal", str(tmp_path / "optuna.journal"), "journal")
    opts = WorkerOptions(
        workdir=tmp_path, train_fn="dummy_trainer:waits_out_gpu_memory", max_trials=1
    )
    summary = run_worker(cfg, spec, opts)
    assert summary.outcomes == {"interrupted": 1}
    study = create_or_load(cfg, open_storage(spec))
    failed, retry = study.get_trials(deepcopy=False)
    assert failed.state == optuna.trial.TrialState.FAIL
    assert failed.user_attrs[ATTR_OUTCOME] == "interrupted"
    assert "waiting for GPU memory: waited 3600 s" in failed.user_attrs[ATTR_MESSAGE]
    assert retry.state == optuna.trial.TrialState.WAITING
    # What a relaunch keys on for a hand-back cut before its retry (`requeue_cut_handbacks`)
    assert failed.user_attrs["worker"] == summary.worker_id


def _failed_with_queued_retry(study: optuna.Study, cfg: StudyConfig) -> None:
    """A trial of the study failed, and its retry queued as the retry callback queues it."""
    first = study.ask()
    suggest(first, cfg)
    study.tell(first, state=optuna.trial.TrialState.FAIL)
    study.add_trial(
        optuna.trial.create_trial(
            state=optuna.trial.TrialState.WAITING,
            params=first.params,
            distributions=first.distributions,
            system_attrs={"failed_trial": first.number, "retry_history": [first.number]},
        )
    )


def test_a_retry_finished_elsewhere_before_its_end_does_not_crash_the_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A retry's own writes at its end (where it resumed, the epochs its failed try never
    reported) raised out of the worker when the trial had been failed elsewhere meanwhile:
    a traceback and a restart, where the tell says "finished elsewhere" and goes on."""
    from hpsearch.worker import ATTR_RESUMED_FROM, WorkerOptions, run_worker

    cfg = load_config("tiny", overrides=["budget.n_trials=2", "budget.max_epochs=2"])
    journal = tmp_path / "optuna.journal"
    spec = StorageSpec("journal", str(journal), "journal")
    monkeypatch.setenv("HPSEARCH_DUMMY_JOURNAL", str(journal))
    _failed_with_queued_retry(create_or_load(cfg, open_storage(spec)), cfg)
    opts = WorkerOptions(
        workdir=tmp_path, train_fn="dummy_trainer:finished_elsewhere_meanwhile", max_trials=1
    )
    with pytest.warns(UserWarning, match="finished elsewhere"):
        summary = run_worker(cfg, spec, opts)
    assert summary.trials == [1]
    retry = create_or_load(cfg, open_storage(spec)).get_trials(deepcopy=False)[1]
    assert retry.state == optuna.trial.TrialState.FAIL and ATTR_RESUMED_FROM not in retry.user_attrs


def test_a_trial_failed_by_the_stale_check_while_it_trains_is_no_error_of_its_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker stopped or cut off past the heartbeat grace: another's stale check fails its
    trial and queues the retry; its next report then found the trial finished and the trial
    counted as an error toward --max-errors (helper-108: `trial 2: error`)."""
    from hpsearch.worker import STALE, WorkerOptions, run_worker

    cfg = load_config("tiny", overrides=["budget.n_trials=2", "budget.max_epochs=2"])
    journal = tmp_path / "optuna.journal"
    spec = StorageSpec("journal", str(journal), "journal")
    monkeypatch.setenv("HPSEARCH_DUMMY_JOURNAL", str(journal))
    opts = WorkerOptions(
        workdir=tmp_path, train_fn="dummy_trainer:failed_elsewhere_then_reports", max_trials=1
    )
    with pytest.warns(UserWarning, match="finished elsewhere"):  # as a tell that finds it so
        summary = run_worker(cfg, spec, opts)
    assert summary.outcomes == {STALE: 1} and summary.last_error == ""
    (trial,) = create_or_load(cfg, open_storage(spec)).get_trials(deepcopy=False)
    assert trial.state == optuna.trial.TrialState.FAIL and "outcome" not in trial.user_attrs
    # A train_fn's own error that reads so, its trial not finished: an error, recorded
    # (it was left RUNNING, its cause never shown: helper-109).
    opts = WorkerOptions(
        workdir=tmp_path, train_fn="dummy_trainer:tells_its_own_study_twice", max_trials=1
    )
    summary = run_worker(cfg, spec, opts)
    assert summary.outcomes == {"error": 1} and "Cannot tell a" in summary.last_error
    second = create_or_load(cfg, open_storage(spec)).get_trials(deepcopy=False)[1]
    assert second.state == optuna.trial.TrialState.FAIL
    assert second.user_attrs["outcome"] == "error"


def test_trials_that_error_now_and_then_do_not_stop_the_worker(tmp_path: Path) -> None:
    """The worker gives up after max_errors errors in a row (a broken set-up fails every
    trial); it counted every error of the study, so a long study whose trials err now and
    then lost its workers one by one, and the launch ended with its budget unspent."""
    from hpsearch.worker import WorkerOptions, run_worker

    cfg = load_config("tiny", overrides=["budget.n_trials=6", "budget.max_epochs=1"])
    spec = StorageSpec("journal", str(tmp_path / "optuna.journal"), "journal")
    opts = WorkerOptions(workdir=tmp_path, train_fn="dummy_trainer:fails_every_other", max_errors=2)
    summary = run_worker(cfg, spec, opts)
    # A failed trial spends no budget: six trained, and six erred between them.
    assert summary.stopped_by == "budget", summary
    assert summary.outcomes.get("error") == 6
    assert summary.outcomes.get("finished", 0) + summary.outcomes.get("pruned", 0) == 6


@pytest.mark.parametrize(
    ("spec", "message"),
    [(":train", "expected MODULE:FUNCTION"), ("dummy_trainer:_BARRIER_PASSED", "bool is not callable"),
     ("json.decoder:nope", "cannot import: AttributeError")],
)  # fmt: skip
def test_a_train_function_that_cannot_be_used_is_one_error(spec: str, message: str) -> None:
    from hpsearch.errors import HpsearchError
    from hpsearch.worker import load_train_fn

    with pytest.raises(HpsearchError, match=message):
        load_train_fn(spec)


def test_a_failed_trial_is_said_re_queued_only_when_its_retry_was_queued(tmp_path: Path) -> None:
    """`--max-retries 0`, or a chain that used its retries up: the launcher said "re-queued to
    resume" of a trial failed for good."""
    import types

    from hpsearch.launcher import Launcher, fail_trial
    from hpsearch.worker import retried_trials

    spec = resolve_storage(None, tmp_path)
    cfg = load_config("tiny", overrides=["budget.n_trials=4"])
    study = create_or_load(cfg, open_storage(spec))
    first, second = study.ask(), study.ask()
    frozen = {t.number: t for t in study.get_trials(deepcopy=False)}
    assert fail_trial(study, spec, frozen[first.number], "worker died (test)", 1)
    assert fail_trial(study, spec, frozen[second.number], "worker died (test)", 0)
    assert retried_trials(study, [first.number, second.number]) == {first.number}
    retry = study._storage.get_trial(study.ask()._trial_id)  # the first trial's retry
    assert retry.system_attrs["retry_history"] == [first.number]
    assert fail_trial(study, spec, retry, "died again", 1)
    assert retried_trials(study, [retry.number]) == set()  # its chain used its one retry
    launcher = types.SimpleNamespace(study=study, opts=types.SimpleNamespace(max_retries=1))
    text = Launcher._requeued_text(launcher, [first.number, second.number])  # type: ignore[arg-type]
    assert text == (
        f"trial {first.number} re-queued to resume; "
        f"trial {second.number} failed, no retries left (--max-retries 1)"
    )


def test_init_storage_creates_optunas_tables_once_and_leaves_no_connection(
    pg_url: str, subprocess_env: dict[str, str]
) -> None:
    """The compose stack's one-shot schema service ran `hpsearch studies`, which as a reader
    creates nothing: the gRPC proxy and the dashboard then raced the workers."""
    from hpsearch.storage import has_optuna_tables, resolve_storage

    spec = resolve_storage(pg_url, Path("."))
    assert not has_optuna_tables(spec)
    for _ in range(2):  # again: nothing to do
        r = hpsearch(["init-storage", "--storage", pg_url], subprocess_env)
        assert r.returncode == 0 and "Optuna tables ready in" in r.stdout, r.stdout + r.stderr
    assert has_optuna_tables(spec)
    r = hpsearch(["init-storage", "--storage", pg_url + "_missing"], subprocess_env)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "does not exist" in r.stderr


def test_a_relaunch_says_which_trials_of_dead_workers_it_resumed(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """It failed and re-queued them without a line: the note went to a list nobody printed."""
    import socket
    import subprocess
    import sys

    from hpsearch.worker import ATTR_HOST, ATTR_PID, ATTR_WORKER

    spec = resolve_storage(None, tmp_path)
    study = create_or_load(load_config("tiny"), open_storage(spec))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout  # fmt: skip
    trial = study.ask()
    for key, value in ((ATTR_WORKER, "w0"), (ATTR_HOST, socket.gethostname()),
                       (ATTR_PID, int(dead))):  # fmt: skip
        trial.set_user_attr(key, value)
    r = hpsearch(["launch", "--study", "tiny", "--workers", "1", "--trials", "2",
                  "--workdir", str(tmp_path), "--train-fn", DUMMY, "--no-tracking"],
                 subprocess_env)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "its worker was gone: trial 0" in r.stdout, r.stdout


def test_heartbeats_on_postgres_print_no_experimental_notice(pg_url: str, tmp_path: Path) -> None:
    """Optuna's two-line notice was in every worker's log: hpsearch turns heartbeats on."""
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        open_storage(resolve_storage(pg_url, tmp_path), heartbeat_interval=10, grace_period=15)
    assert not [w for w in seen if issubclass(w.category, optuna.exceptions.ExperimentalWarning)]


def test_a_retry_inherits_no_result_of_the_try_it_retries(tmp_path: Path) -> None:
    """A try that wrote its test accuracy and checkpoint URI, then died before its tell: a
    retry told without them (no test pass, not uploaded) showed the failed try's."""
    from hpsearch.launcher import fail_trial

    spec = resolve_storage(None, tmp_path)
    study = create_or_load(load_config("tiny", overrides=["budget.n_trials=1"]), open_storage(spec))
    trial = study.ask()
    for key, value in {
        "test_acc": 0.4,
        "checkpoint_uri": "runs:/r/checkpoint/best.pt",
        "history": [{"epoch": 1}],
        "best_model": "/w/t.best.pt",
        "startup_s": 1.0,
        "checkpoint": "/w/t.pt",
        "mlflow_run_id": "r",
    }.items():
        trial.set_user_attr(key, value)  # fmt: skip
    assert fail_trial(study, spec, study._storage.get_trial(trial._trial_id), "died", 2)
    (retry,) = study.get_trials(states=(optuna.trial.TrialState.WAITING,))
    # The chain's checkpoint and MLflow run go on; the try's results do not.
    assert retry.user_attrs == {"checkpoint": "/w/t.pt", "mlflow_run_id": "r"}


def test_a_trial_a_launch_kills_on_a_stop_uses_no_crash_retry(tmp_path: Path) -> None:
    """A second Ctrl-C kills the workers; their trials are failed and queued by the launcher.
    Counted as crashes, repeated stops failed a chain for good (--max-retries 0: at once)."""
    from hpsearch.launcher import fail_trial
    from hpsearch.worker import ATTR_INTERRUPTED_TRIES

    spec = resolve_storage(None, tmp_path)
    study = create_or_load(load_config("tiny", overrides=["budget.n_trials=1"]), open_storage(spec))
    for stopped in (True, True, False):
        trial = study.ask()  # the chain's queued retry, after the first
        frozen = study._storage.get_trial(trial._trial_id)
        assert fail_trial(study, spec, frozen, "interrupted", 0, interrupted=stopped)
    states = [t.state for t in study.get_trials(deepcopy=False)]
    # Two stops re-queued; the crash, with no retries allowed, ended the chain.
    assert states == [optuna.trial.TrialState.FAIL] * 3
    assert study.trials[-1].system_attrs[ATTR_INTERRUPTED_TRIES] == 2
    # Its outcome is the word its MLflow run gets (QA: "failed" beside "interrupted"): a
    # stop's kill, or a kill past the grace (reason "interrupted").
    outcomes = [t.user_attrs.get("outcome") for t in study.trials]
    assert outcomes == ["interrupted"] * 3


def test_a_hand_back_cut_between_its_commits_gets_its_retry(tmp_path: Path) -> None:
    """A worker killed (a second stop, or past the grace) after its trial's FAIL and before
    its retry's queueing left the trial to no one: the launch queues it as it ends."""
    import datetime

    from hpsearch.launcher import requeue_cut_handbacks
    from hpsearch.worker import ATTR_OUTCOME, ATTR_WORKER

    spec = resolve_storage(None, tmp_path)
    study = create_or_load(load_config("tiny", overrides=["budget.n_trials=3"]), open_storage(spec))
    before = datetime.datetime.now()
    cut, other, crashed = study.ask(), study.ask(), study.ask()
    for trial, worker, outcome in ((cut, "h:w0", "interrupted"), (other, "elsewhere:w0",
                                   "interrupted"), (crashed, "h:w0", "failed")):  # fmt: skip
        trial.set_user_attr(ATTR_WORKER, worker)
        trial.set_user_attr(ATTR_OUTCOME, outcome)
        study.tell(trial, state=optuna.trial.TrialState.FAIL)  # and then killed
    assert requeue_cut_handbacks(study, spec, ["h:w0"], before, 0) == [cut.number]
    assert requeue_cut_handbacks(study, spec, ["h:w0"], before, 0) == []  # queued once
    (retry,) = study.get_trials(states=(optuna.trial.TrialState.WAITING,))
    assert retry.system_attrs["failed_trial"] == cut.number
    later = datetime.datetime.now() + datetime.timedelta(seconds=1)  # an earlier launch's
    assert requeue_cut_handbacks(study, spec, ["elsewhere:w0"], later, 0) == []


@pytest.mark.parametrize("driver", ["psycopg2", "psycopg"])
def test_sessions_run_in_utc_with_keepalives_and_keep_the_urls_options(
    pg_url: str, tmp_path: Path, driver: str
) -> None:
    """Heartbeats are CURRENT_TIMESTAMP in a column without a zone: a server zone with
    daylight saving made live trials an hour stale. A worker host that vanished holding the
    study lock stalled every asker for the kernel's two hours."""
    url = pg_url.replace("postgresql://", f"postgresql+{driver}://", 1)
    url += "?options=-c%20statement_timeout%3D60000"
    with sa.create_engine(pg_url.rsplit("/", 1)[0] + "/postgres").connect() as admin:
        database = pg_url.rsplit("/", 1)[1]
        admin.execute(sa.text(f"ALTER DATABASE {database} SET timezone = 'America/New_York'"))
        admin.commit()
    storage = open_storage(resolve_storage(url, tmp_path))
    with storage.engine.connect() as conn:  # type: ignore[attr-defined]
        show = {k: conn.execute(sa.text(f"SHOW {k}")).scalar() for k in
                ("timezone", "tcp_keepalives_idle", "statement_timeout")}  # fmt: skip
    storage.engine.dispose()  # type: ignore[attr-defined]
    assert show == {"timezone": "UTC", "tcp_keepalives_idle": "30", "statement_timeout": "1min"}


def test_pg_connect_args_keep_what_the_user_gave(monkeypatch: pytest.MonkeyPatch) -> None:
    import hpsearch.storage as S
    from hpsearch.storage import PG_SESSION_OPTIONS, pg_connect_args

    plain = pg_connect_args("postgresql://u@h/db", environ={})
    assert plain["options"] == PG_SESSION_OPTIONS and plain["keepalives_idle"] == 30
    # libpq reads PGOPTIONS only when no options are given: ours would have hidden it
    # (a search_path there, and the study's tables were made again in public).
    env = pg_connect_args("postgresql://u@h/db", environ={"PGOPTIONS": "-c search_path=hp"})
    assert env["options"] == f"-c search_path=hp {PG_SESSION_OPTIONS}"
    url = "postgresql://u@h/db?options=-c%20a%3D1&options=-c%20b%3D2&keepalives_idle=5"
    given = pg_connect_args(url, environ={"PGOPTIONS": "-c ignored=1"})
    assert given["options"] == f"-c a=1 -c b=2 {PG_SESSION_OPTIONS}"
    assert "keepalives_idle" not in given  # the URL's own (connect_args would override it)
    assert plain["tcp_user_timeout"] == 60_000  # this machine's libpq is 12 or later
    own = pg_connect_args("postgresql://u@h/db?tcp_user_timeout=7000", environ={})
    assert "tcp_user_timeout" not in own
    monkeypatch.setattr(S, "_libpq_version", lambda url: 110000)  # refuses the parameter
    assert "tcp_user_timeout" not in pg_connect_args("postgresql://u@h/db", environ={})


def test_a_sqlite_study_is_locked_like_a_journal(tmp_path: Path) -> None:
    """SQLite had no study lock: two workers counted the same free place and the study ran
    past its budget."""
    import fcntl

    spec = resolve_storage(f"sqlite:///{tmp_path / 'optuna.db'}", tmp_path)
    with (
        study_lock(spec, "tiny"),
        open(tmp_path / "optuna.db.ask-lock", "a") as other,  # another worker's try
        pytest.raises(BlockingIOError),
    ):
        fcntl.flock(other.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(tmp_path / "optuna.db.ask-lock", "a") as other:  # released
        fcntl.flock(other.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    # Shared with other users' workers: writable by them (the umask's 0644 was not).
    assert (tmp_path / "optuna.db.ask-lock").stat().st_mode & 0o777 == 0o666
    from hpsearch.storage import _ask_lock_path

    uri = resolve_storage(f"sqlite:///file:{tmp_path / 'u.db'}?mode=rwc&uri=true", tmp_path)
    assert _ask_lock_path(uri) == tmp_path / "u.db.ask-lock"
    memory = resolve_storage("sqlite:///file::memory:?cache=shared&uri=true", tmp_path)
    assert _ask_lock_path(memory) is None
    before = set(tmp_path.iterdir())
    with study_lock(memory, "tiny") as held:
        assert held is None  # in memory: one process, nothing to lock
    assert set(tmp_path.iterdir()) == before
    # A private in-memory one (`sqlite://`) no worker could share: refused (QA).
    with pytest.raises(StorageError, match="an in-memory SQLite database is one process's"):
        resolve_storage("sqlite://", tmp_path)


def test_a_database_whose_studies_table_is_not_optunas_is_one_error(
    pg_url: str, tmp_path: Path
) -> None:
    """Another program's `studies` table passed the check for Optuna's tables, and Optuna's
    missing version table then raised its internal error: a traceback, for workers and
    readers alike."""
    import hpsearch as hps

    engine = sa.create_engine(pg_url, poolclass=sa.pool.NullPool)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE studies (id int)"))
    engine.dispose()
    spec = resolve_storage(pg_url, tmp_path)
    with pytest.raises(StorageError, match="not an Optuna database") as err:
        open_storage(spec)
    assert "\n" not in str(err.value)
    with pytest.raises(StorageError, match="not an Optuna database"):
        hps.best_trials("tiny", storage=pg_url)


def test_another_applications_database_gets_no_optuna_tables(pg_url: str, tmp_path: Path) -> None:
    """MLflow's backend store (or any migrated application's) named by mistake: Optuna's
    tables were created beside its own, and every later command said "update optuna"."""
    engine = sa.create_engine(pg_url, poolclass=sa.pool.NullPool)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE alembic_version (version_num varchar(32))"))
        conn.execute(sa.text("CREATE TABLE experiments (id int)"))
    spec = resolve_storage(pg_url, tmp_path)
    with pytest.raises(StorageError, match="not an Optuna database: it holds another") as err:
        open_storage(spec)
    assert "alembic_version, experiments" in str(err.value) and "\n" not in str(err.value)
    with engine.connect() as conn:
        assert sorted(sa.inspect(conn).get_table_names()) == ["alembic_version", "experiments"]
    engine.dispose()


def test_a_search_space_optuna_would_refuse_for_the_study_is_refused_at_its_load(
    pg_url: str, tmp_path: Path
) -> None:
    """A relaunch whose file changed a categorical parameter's choices (or a parameter's
    kind or log scale) failed every trial at its first suggestion, queued retries first:
    their checkpoints were lost and each worker stopped with "sampler failed". It is now
    one error before anything runs, naming the file, the parameter and both spaces; the
    queued retry stays queued. A changed range is Optuna's to allow, and is allowed."""
    cfg = load_config("tiny")
    _failed_with_queued_retry(create_or_load(cfg, pg_url), cfg)
    wider = load_config(
        "tiny", ["search_space.lr={type: float, low: 1.0e-4, high: 1.0, log: true}"]
    )
    create_or_load(wider, pg_url)  # a new range: allowed
    for change, words in (
        ("search_space.batch_size.choices=[32, 64, 128]", "batch_size: choices [32, 64, 128]"),
        ("search_space.lr.log=false", "lr: float 0.001..0.5: study 'tiny' has trials with float"),
        ("search_space.batch_size={type: int, low: 32, high: 64}", "batch_size: int 32..64"),
    ):
        changed = load_config("tiny", [change])
        with pytest.raises(ConfigError, match="tiny") as err:
            create_or_load(changed, pg_url)
        assert words in str(err.value), str(err.value)
        assert "\n" not in str(err.value)
    states = [t.state for t in optuna.load_study(study_name="tiny", storage=pg_url).trials]
    assert states == [optuna.trial.TrialState.FAIL, optuna.trial.TrialState.WAITING]


def test_an_at_sign_is_refused_only_in_a_storage_urls_password(tmp_path: Path) -> None:
    """A raw '@' in the password sent the connection to a host named after the password's
    end, and the error showed it; one in the user name (a cloud IAM login), the query or
    a journal's file name is fine."""
    # A "/" before the raw '@' split the authority early: the host read was "ss@127.0.0.1".
    for raw in ("postgres:p@ss-word@127.0.0.1/test", "postgres:p/ss-word@ss@127.0.0.1/test"):
        with pytest.raises(StorageError, match="password holds a raw '@'") as err:
            resolve_storage(f"postgresql://{raw}", tmp_path)
        assert "ss-word" not in str(err.value)
    for fine in (
        "postgresql://sa@proj.iam:tok@host/db",
        "postgresql://u:p@host?application_name=me@box",
        "postgresql://u:p@host/my%40db",  # what the refusal tells to write
        "journal://runs@a.journal",
    ):
        resolve_storage(fine, tmp_path)


@pytest.mark.parametrize("kind", ["journal", "postgres"])
def test_a_retry_taken_by_another_work_folder_of_this_host_resumes_from_its_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest, kind: str
) -> None:
    """Two launches of one study on this host, other work folders (the refusal of a second
    launch in one folder suggests another): a trial one hands back, the other's worker
    trained again from epoch 1, as its folder held no checkpoint of it. On PostgreSQL it
    still did (helper-108): the failed try's host was read from the retry's own attributes,
    stripped at the re-queue, where the journal's claim had already written the taker's."""
    import threading

    from hpsearch.worker import ATTR_CHECKPOINT, WorkerOptions, run_worker

    monkeypatch.setenv("HPSEARCH_DUMMY_EPOCH_S", "0.2")
    cfg = load_config("tiny", overrides=["budget.n_trials=1", "budget.max_epochs=8",
                                         "pruner.name=none", "pruner.options={}"])  # fmt: skip
    if kind == "journal":
        spec = StorageSpec("journal", str(tmp_path / "optuna.journal"), "journal")
    else:
        spec = resolve_storage(request.getfixturevalue("pg_url"), tmp_path)
    stop = threading.Event()

    def stop_a_few_epochs_in() -> None:  # handed back and checkpointed (a timer from here
        # fired before a loaded machine's worker had asked on PostgreSQL)
        storage, deadline = open_storage(spec), time.monotonic() + 120
        while time.monotonic() < deadline and not stop.is_set():
            try:
                trials = storage.get_all_trials(storage.get_study_id_from_name(cfg.name))
            except KeyError:  # no study yet
                trials = []
            if any(len(t.intermediate_values) >= 2 for t in trials):
                break
            time.sleep(0.05)
        stop.set()

    threading.Thread(target=stop_a_few_epochs_in, daemon=True).start()
    monkeypatch.chdir(tmp_path)  # relative work folders, as the default `.hpsearch` is
    first = run_worker(cfg, spec, WorkerOptions(workdir=Path("a"), train_fn=DUMMY), stop)
    assert first.outcomes == {"interrupted": 1}
    study = create_or_load(cfg, open_storage(spec))
    handed_back = Path(study.get_trials(deepcopy=False)[0].user_attrs[ATTR_CHECKPOINT])
    assert handed_back.is_file() and handed_back.is_relative_to(tmp_path / "a")
    second = run_worker(cfg, spec, WorkerOptions(workdir=Path("b"), train_fn=DUMMY))
    assert second.outcomes == {"finished": 1}
    retry = create_or_load(cfg, open_storage(spec)).get_trials(deepcopy=False)[1]
    assert retry.state == optuna.trial.TrialState.COMPLETE
    assert retry.user_attrs["resumed_from_epoch"] > 1  # not trained again from epoch 1
    assert not handed_back.exists()  # taken, not left behind


def _waiting_retry(
    tmp_path: Path,
) -> tuple[StudyConfig, BaseStorage, optuna.Study, dict, optuna.trial.FrozenTrial]:
    """A `tiny` study on a journal whose trial 0 failed with a checkpoint, and its retry
    (trial 1) waiting to resume from it: (config, storage, study, params, failed try)."""
    cfg = load_config("tiny")
    storage = open_storage(StorageSpec("journal", str(tmp_path / "optuna.journal"), "journal"))
    study = create_or_load(cfg, storage)
    first = study.ask()
    params = suggest(first, cfg)
    first.set_user_attr("checkpoint", str(tmp_path / "trial-00000-ab.pt"))
    study.tell(first, state=optuna.trial.TrialState.FAIL)
    frozen = study.get_trials(deepcopy=False)[0]
    study.add_trial(
        optuna.trial.create_trial(
            state=optuna.trial.TrialState.WAITING, params=params,
            distributions=frozen.distributions, user_attrs=frozen.user_attrs,
            system_attrs={"failed_trial": 0, "retry_history": [0]},
        )
    )  # fmt: skip
    return cfg, storage, study, params, frozen


def test_a_relaunch_that_would_change_a_waiting_retrys_hyperparameters_is_refused(
    tmp_path: Path,
) -> None:
    """A relaunch with another trainer default: the retry waiting to resume was refused its
    checkpoint ("written for other hyperparameters") and failed for good, with no retry
    left and its epochs lost; the launch had taken the change without a word."""
    cfg, storage, study, params, frozen = _waiting_retry(tmp_path)
    changed = load_config("tiny", ["trainer.defaults.warmup_epochs=3"])
    with pytest.raises(ConfigError, match=r"warmup_epochs: 3.0: trial 1 waits to resume"):
        create_or_load(changed, storage)
    assert create_or_load(changed, storage, owner=False)  # a worker's --set are its own
    with pytest.warns(HpsearchWarning, match="budget.max_epochs: 9"):  # it resumes so
        create_or_load(load_config("tiny", ["budget.max_epochs=9"]), storage)
    # Its best so far was evaluated otherwise: the new epochs' would be compared with it.
    waits = "trial 1 waits to resume from a checkpoint whose best was evaluated"
    for changes, shown in (
        (["trainer.eval_flip=true"], f"trainer.eval_flip: True: {waits} with eval_flip False"),
        (["dataset.eval_limit=51"], f"dataset.eval_limit: 51: {waits} on eval_limit 510"),
        (["trainer.eval_scale=0.5"],
         rf"trainer.eval_scale: 0.5 \(evaluated at 16 px\): {waits} at 32 px"),
        (["dataset.image_size=40", "dataset.cache_size=48"],
         rf"dataset.image_size: 40 \(evaluated at 40 px\): {waits} at 32 px"),
        (["trainer.eval_scale=0.5", "trainer.eval_flip=true"],
         rf"0.5 \(evaluated at 16 px\), trainer.eval_flip: True: {waits} at 32 px and with"),
    ):  # fmt: skip
        with pytest.raises(ConfigError, match=shown):
            create_or_load(load_config("tiny", changes), storage)
    # A try run by a worker with --set values of its own is judged by the config it ran
    # with (recorded by id), not the study's.
    from hpsearch.study import CONFIG_ID_ATTR, check_retries_fit, config_id

    own = load_config("tiny", ["trainer.defaults.warmup_epochs=3"])
    create_or_load(own, storage, owner=False)  # records it, as its worker does
    theirs = [t for t in study.get_trials(deepcopy=False) if t.number == 1]
    theirs[0].user_attrs[CONFIG_ID_ATTR] = config_id(config_to_yaml(own, trial_only=True))
    attrs = study.user_attrs
    check_retries_fit(own, config_to_yaml(cfg), theirs, attrs)  # what it trained with
    # Not "relaunch without the change" (there is none): a worker with its values.
    with pytest.raises(ConfigError, match=r"warmup_epochs: 0.5: trial 1 waits to resume.*"
                       r"own trained it: finish it with one \(hpsearch worker --study tiny "
                       r"--set trainer.defaults.warmup_epochs=3.0\)"):  # fmt: skip
        check_retries_fit(cfg, config_to_yaml(cfg), theirs, attrs)
    # A try an earlier launch ran (not the study's last config, no worker's own): the plain
    # hint, "relaunch without the change".
    earlier = load_config("tiny", ["budget.max_epochs=9"])  # launched above
    theirs[0].user_attrs[CONFIG_ID_ATTR] = config_id(config_to_yaml(earlier, trial_only=True))
    with pytest.raises(ConfigError, match=r"0.5, which it would refuse: relaunch without"):
        check_retries_fit(own, config_to_yaml(cfg), theirs, attrs)
    # No checkpoint to refuse: none written (trainer.checkpoint off), or this host's try
    # died before its first save. The retry then trains from epoch 1 under the change.
    import socket

    retry = study.get_trials(deepcopy=False)[1]
    unsaved = load_config("tiny", ["trainer.checkpoint=false"])
    check_retries_fit(changed, config_to_yaml(unsaved), [retry])
    stored = config_to_yaml(cfg)
    here = optuna.trial.create_trial(
        state=optuna.trial.TrialState.WAITING, params=params,
        distributions=frozen.distributions,
        user_attrs={**frozen.user_attrs, "host": socket.gethostname()},
    )  # fmt: skip
    check_retries_fit(changed, stored, [here])  # its file was never written
    (tmp_path / "trial-00000-ab.pt").write_bytes(b"{}")
    with pytest.raises(ConfigError, match="waits to resume"):
        check_retries_fit(changed, stored, [here])
    # The same for a retry the re-queue made (it strips the try's "host": the check never
    # matched, and such a relaunch was refused for a checkpoint that does not exist).
    from hpsearch.worker import retry_callback

    failed = study.ask()
    suggest(failed, cfg)
    failed.set_user_attr("checkpoint", str(tmp_path / "trial-00002-cd.pt"))
    failed.set_user_attr("host", socket.gethostname())
    study.tell(failed, state=optuna.trial.TrialState.FAIL)
    assert retry_callback(3).requeue(study, study.get_trials()[-1], interrupted=False)
    queued = study.get_trials(deepcopy=False)[-1]
    assert queued.state == optuna.trial.TrialState.WAITING and "host" not in queued.user_attrs
    check_retries_fit(changed, stored, [queued])  # this host's try never saved
    # A retry that died before it took the trial (no host of its own) leaves the host of
    # the checkpoint it inherited to its own retry.
    from hpsearch.worker import ATTR_FAILED_HOST

    middle = study.ask()
    study.tell(middle, state=optuna.trial.TrialState.FAIL)
    frozen_middle = study.get_trials(deepcopy=False)[-1]
    frozen_middle.system_attrs.update(queued.system_attrs)  # as the retry it was
    assert retry_callback(3).requeue(study, frozen_middle, interrupted=False)
    again = study.get_trials(deepcopy=False)[-1]
    assert again.system_attrs[ATTR_FAILED_HOST] == socket.gethostname()


def test_a_relaunch_that_would_retrain_a_waiting_retry_otherwise_is_refused(
    tmp_path: Path,
) -> None:
    """QA: a relaunch that added a searched parameter had the waiting retry draw a new value,
    which its checkpoint refused (the trial failed for good, its epochs lost); one that
    changed `trainer.base_batch_size` (its peak lr) or `dataset.train_limit` went on from
    the checkpoint under the new one, mid-trial, without a word. A longer epoch budget
    (stop, then relaunch to train longer) goes on, and the launch says so."""
    cfg, storage, *_ = _waiting_retry(tmp_path)
    waits = "trial 1 waits to resume from a checkpoint trained with"
    wd = "search_space.weight_decay={type: float, low: 0.00001, high: 0.01, log: true}"
    for changes, shown in (
        ([wd], rf"search_space.weight_decay: {waits} weight_decay 0.0005; a new value"),
        (["trainer.base_batch_size=64"], rf"trainer.base_batch_size: 64: {waits} 256, and"),
        (["dataset.train_limit=50"], rf"dataset.train_limit: 50: {waits} None, and"),
        (["trainer.seed=3"], rf"trainer.seed: 3: {waits} 0, and"),
    ):
        with pytest.raises(ConfigError, match=shown):
            create_or_load(load_config("tiny", changes), storage)
    # A parameter taken out of the space is no change for it: it keeps its value
    # (`retry_params`), as Optuna's params say. A longer budget is said, not refused.
    assert retry_params({"lr": 0.03, "batch_size": 32}, {"batch_size": 32}) == {
        "lr": 0.03, "batch_size": 32}  # fmt: skip
    assert retry_params({"lr": 0.03}, {"lr": 0.05, "loss": "ce"}) == {"lr": 0.05, "loss": "ce"}
    space = {k: v for k, v in cfg.search_space.items() if k != "lr"}
    create_or_load(cfg.model_copy(update={"search_space": space}), storage)
    # The `--set` a refusal suggests takes the old value as YAML (review: `=None`)
    from hpsearch.study import set_value

    assert [set_value(v) for v in (None, 0.5, [32, 64], "ce")] == ["null", "0.5", "[32, 64]", "ce"]
    with pytest.warns(HpsearchWarning, match=r"budget.max_epochs: 9 \(before: 2\)"):
        create_or_load(load_config("tiny", ["budget.max_epochs=9"]), storage)


def test_a_retry_trains_with_a_parameter_since_taken_out_of_the_space(tmp_path: Path) -> None:
    """QA: a retry whose `lr` a relaunch took out of the search space trained at the
    trainer's default (0.1) while Optuna's params, `hpsearch best`, the sampler and
    `train --trial N` said 0.0303. It trains with the value it drew, as its try did."""
    from hpsearch.worker import WorkerOptions, run_worker

    cfg = load_config("tiny", ["budget.n_trials=2", "trainer.checkpoint=false"])
    spec = StorageSpec("journal", str(tmp_path / "optuna.journal"), "journal")
    study = create_or_load(cfg, open_storage(spec))
    study.enqueue_trial({"lr": 0.0303, "batch_size": 32, "loss": "ce"})
    first = study.ask()
    params = suggest(first, cfg)
    assert params["lr"] == 0.0303
    study.tell(first, state=optuna.trial.TrialState.FAIL)
    frozen = study.get_trials(deepcopy=False)[0]
    study.add_trial(
        optuna.trial.create_trial(
            state=optuna.trial.TrialState.WAITING, params=params,
            distributions=frozen.distributions,
            system_attrs={"failed_trial": 0, "retry_history": [0]},
        )
    )  # fmt: skip
    space = {k: v for k, v in cfg.search_space.items() if k != "lr"}
    fewer = cfg.model_copy(update={"search_space": space})
    opts = WorkerOptions(workdir=tmp_path, train_fn=DUMMY, max_trials=1)
    assert len(run_worker(fewer, spec, opts).trials) == 1
    retry = create_or_load(fewer, open_storage(spec)).get_trials(deepcopy=False)[1]
    assert retry.state == optuna.trial.TrialState.COMPLETE, retry.user_attrs
    assert retry.params["lr"] == 0.0303
    assert retry.user_attrs["effective_lr"] == 0.0303  # the dummy trains at params["lr"]


def test_a_study_keeps_its_objective_metric(tmp_path: Path) -> None:
    """QA: a relaunch with another `objective.metric` and the same direction went on, and
    train_seconds values were ranked against val_loss ones in one study."""
    storage = open_storage(StorageSpec("journal", str(tmp_path / "optuna.journal"), "journal"))
    create_or_load(load_config("tiny", ["objective.metric=val_loss"]), storage)
    other = load_config(
        "tiny", ["objective.metric=train_seconds", "pruner.name=none", "pruner.options={}"]
    )
    with pytest.raises(
        ConfigError,
        match=r"objective.metric: 'train_seconds': study 'tiny' "
        r"already exists with metric 'val_loss'.*add `metric: val_loss`",
    ):
        create_or_load(other, storage)
    with pytest.raises(ConfigError, match="already exists with metric 'val_loss'"):
        create_or_load(other, storage, owner=False)  # a worker's values would mix alike
    create_or_load(load_config("tiny", ["objective.metric=val_loss"]), storage)


def test_a_relaunch_with_other_metrics_is_told_of_the_metric_not_the_direction(
    tmp_path: Path,
) -> None:
    """QA: another metric also differs in direction (val_loss minimizes), and the direction
    was checked first: its hint (`add direction: [maximize, minimize]`) led to val_loss
    maximized, then to the metric's refusal all the same."""
    storage = open_storage(StorageSpec("journal", str(tmp_path / "optuna.journal"), "journal"))
    mo = ["pruner.name=none", "pruner.options={}", "sampler.name=nsga2", "sampler.options={}"]
    create_or_load(load_config("tiny", [*mo, "objective={metric: [val_acc, train_seconds]}"]),
                   storage)  # fmt: skip
    other = load_config("tiny", [*mo, "objective={metric: [val_loss, train_seconds]}"])
    with pytest.raises(ConfigError, match=(
        r"objective.metric: \['val_loss', 'train_seconds'\]: study 'tiny' already exists with "
        r"metric \['val_acc', 'train_seconds'\]"
    )):  # fmt: skip
        create_or_load(other, storage)


def test_a_journal_write_cut_short_leaves_the_study_readable(tmp_path: Path) -> None:
    """A full disk cut a journal record short, and the next launch's record was written onto
    it: one line that is not JSON, and every later read of the study failed (all its trials
    lost). Now a failed append is cut back, and a part-line left by a killed writer is cut
    off before the next append. The full disk here is a file size limit (RLIMIT_FSIZE) in a
    child process: its write gets 30 bytes out, then fails (EFBIG), as at ENOSPC."""
    import subprocess
    import sys

    spec = resolve_storage(str(tmp_path / "optuna.journal"), tmp_path)
    study = optuna.create_study(study_name="s", storage=open_storage(spec))
    study.tell(study.ask({"x": optuna.distributions.FloatDistribution(0, 1)}), 0.5)
    trial = study.ask({"x": optuna.distributions.FloatDistribution(0, 1)})
    path = Path(spec.url)
    whole = path.read_bytes()
    code = f"""
import resource, signal, optuna
from hpsearch.storage import open_storage, resolve_storage
from pathlib import Path
spec = resolve_storage({str(path)!r}, Path({str(tmp_path)!r}))
study = optuna.load_study(study_name="s", storage=open_storage(spec))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, ({len(whole) + 30}, resource.RLIM_INFINITY))
try:
    study.tell({trial.number}, 0.7)
except OSError as exc:
    print("failed:", exc.errno, exc.filename)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    # EFBIG, naming the file (QA: `enqueue` said "Error: No space left on device" alone)
    assert f"failed: 27 {path}" in r.stdout, r.stdout + r.stderr
    assert path.read_bytes() == whole  # cut back to whole lines (30 bytes were left)

    with path.open("ab") as fh:  # a writer killed mid-record (or an earlier version's)
        fh.write(b'{"op_code":7,"worker_id":"c8b0-14013')
    again = optuna.load_study(study_name="s", storage=open_storage(spec))
    again.tell(trial.number, 0.9)
    assert path.read_bytes().startswith(whole) and b"c8b0-14013" not in path.read_bytes()
    done = optuna.load_study(study_name="s", storage=open_storage(spec)).trials
    assert [t.value for t in done] == [0.5, 0.9]
    # An fsync that fails after whole lines (NFS reports a full disk there) keeps them:
    # another process may have read them already, and its offsets would point amiss.
    import errno
    import os

    size = path.stat().st_size

    def fsync_fails(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "fsync", fsync_fails)
        with pytest.raises(OSError, match="No space left"):
            again.set_user_attr("k", "v")
    assert path.stat().st_size > size and path.read_bytes().endswith(b"\n")
    assert optuna.load_study(study_name="s", storage=open_storage(spec)).user_attrs == {"k": "v"}


def test_a_worker_waits_for_a_database_that_is_restarting_but_not_for_a_wrong_one(
    pg_url: str, tmp_path: Path
) -> None:
    """A worker started while PostgreSQL restarted exited at once ("cannot connect: server
    closed the connection unexpectedly"), spending its restarts (helper-108); a wrong
    database name still fails at once, in one line. The restart here is real: the study's
    database behind a port where nothing listens (connection refused) until, 1.5 s later,
    a forwarder to the real server starts there."""
    import hpsearch.storage as S

    later = url_up_later(pg_url, 1.5)
    real = make_url(pg_url)
    t0 = time.monotonic()
    with pytest.warns(UserWarning, match="retrying in"):
        storage = S.open_storage_when_up(resolve_storage(later, tmp_path), 30.0)
    assert storage is not None and time.monotonic() - t0 >= 1.0
    # The messages a restart or a wrong URL can answer with, which this machine cannot make
    # its shared server give: crash recovery and a full server are waited for; a wrong name
    # is not, even beside an address that refused (libpq joins every address's error).
    for text, transient in [
        ("FATAL: the database system is in recovery mode", True),
        ("FATAL: sorry, too many clients already", True),
        ('connection to server at "::1", port 5432 failed: Connection refused ... '
         'FATAL: database "no_such" does not exist', False),
        ("FATAL: password authentication failed for user", False),
    ]:  # fmt: skip
        error = StorageError(f"storage x: cannot connect: (psycopg2.OperationalError) {text}")
        assert S.transient_connect_error(error) is transient, text
    wrong = resolve_storage(real.set(database="no_such_db_h").render_as_string(False), tmp_path)
    t0 = time.monotonic()
    with pytest.raises(StorageError, match="no_such_db_h"):
        S.open_storage_when_up(wrong, 10.0)
    assert time.monotonic() - t0 < 5  # at once


def test_enqueued_trials_run_first_once_per_study_and_within_its_budget(
    pg_url: str, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """The study file's `enqueue_trials` (Optuna's `enqueue_trial`): the study's first
    trials, whichever worker asks first; a relaunch queues a new one only, never one the
    study already ran, and none past the budget, which it says."""
    seeds = "enqueue_trials=[{lr: 0.01, loss: focal, focal_gamma: 1.5}, {batch_size: 64}]"

    def launch(trials: int, enqueue: str) -> subprocess.CompletedProcess[str]:
        out = hpsearch(
            ["launch", "--study", "tiny", "--storage", pg_url, "--workers", "2", "--trials",
             str(trials), "--no-tracking", "--train-fn", DUMMY, "--workdir", str(tmp_path / "w"),
             "--set", "budget.max_epochs=2", "--set", enqueue],
            subprocess_env,
        )  # fmt: skip
        assert out.returncode == 0, out.stdout + out.stderr
        return out

    launch(4, seeds)
    study = optuna.load_study(study_name="tiny", storage=pg_url)
    trials = study.get_trials()
    assert len(trials) == 4 and all(t.state.is_finished() for t in trials)
    assert trials[0].params == {"lr": 0.01, "batch_size": trials[0].params["batch_size"],
                                "loss": "focal", "focal_gamma": 1.5}  # fmt: skip
    assert trials[1].params["batch_size"] == 64
    assert trials[0].system_attrs["fixed_params"] == {"lr": 0.01, "loss": "focal",
                                                      "focal_gamma": 1.5}  # fmt: skip
    assert not any("fixed_params" in t.system_attrs for t in trials[2:])  # drawn

    out = launch(6, seeds[:-1] + ", {lr: 0.2}]")  # the first two ran: one more
    trials = optuna.load_study(study_name="tiny", storage=pg_url).get_trials()
    fixed = [t.system_attrs.get("fixed_params") for t in trials]
    assert len(trials) == 6 and fixed.count({"lr": 0.2}) == 1 and fixed[4] == {"lr": 0.2}
    assert fixed.count({"batch_size": 64}) == 1
    assert trials[4].params["lr"] == 0.2

    out = launch(6, seeds[:-1] + ", {lr: 0.3}]")  # the budget is spent: not queued
    assert "enqueue_trials: 1 not queued: budget.n_trials (6) has no room for them" in out.stdout
    trials = optuna.load_study(study_name="tiny", storage=pg_url).get_trials()
    assert len(trials) == 6


def test_a_relaunch_fails_a_queued_trial_its_narrowed_space_no_longer_takes(
    pg_url: str, tmp_path: Path
) -> None:
    """A trial queued by hand (or left queued by a stop) with params a relaunch's narrowed
    search space refuses: Optuna ran it as given, outside the space, with a warning in one
    worker's log. The launch (owner) fails it, never run, with why; a worker does not (its
    --set are its own), and queues only the entries of the config the study was launched
    with, not its own file's."""
    from hpsearch.study import enqueue_trials, trials_before

    spec, _storage, cfg, study = _tiny_study(pg_url, tmp_path)
    study.enqueue_trial({"lr": 0.3, "loss": "focal", "focal_gamma": 2.5})
    study.enqueue_trial({"lr": 0.005})
    assert trials_before(study.get_trials()) == 0  # a worker's seed: none drawn yet

    def lock() -> contextlib.AbstractContextManager[object]:
        return study_lock(spec, cfg.name)

    narrowed = load_config("tiny", ["search_space.lr={type: float, low: 0.001, high: 0.01, "
                                    "log: true}"])  # fmt: skip
    assert enqueue_trials(study, narrowed, lock).failed == ()  # a worker's
    done = enqueue_trials(study, narrowed, lock, owner=True)
    assert done.failed == ((0, "params: lr: 0.3: outside its range 0.001..0.01"),)
    first, second = study.get_trials()
    assert first.state == optuna.trial.TrialState.FAIL and first.user_attrs["outcome"] == "error"
    assert (
        "its queued params do not fit the search space the study was launched with: params: lr: 0.3"
        in first.user_attrs["message"]
    )
    assert second.state == optuna.trial.TrialState.WAITING  # it fits: it runs
    assert trials_before(study.get_trials()) == 0  # neither ran
    # Failed unrun, its params are no trial's: the space widened again, they queue again
    import hpsearch as hps

    again = hps.enqueue_trial("tiny", {"lr": 0.3, "loss": "focal", "focal_gamma": 2.5},
                              pg_url)  # fmt: skip
    assert (again.number, again.queued) == (2, True)

    # A worker of its own file with entries: the study's stored config has none
    own = load_config("tiny", ["enqueue_trials=[{lr: 0.02}]"])
    assert enqueue_trials(study, own, lock) == enqueue_trials(study, cfg, lock)
    assert len(study.get_trials()) == 3

    # A retry (were one made of such a trial: a claim in the gap of a lost lock) ran: the
    # mark is not inherited
    from hpsearch.study import ATTR_UNFIT
    from hpsearch.worker import retry_callback

    assert retry_callback(3).requeue(study, study.get_trials()[0], interrupted=True)
    assert ATTR_UNFIT not in study.get_trials()[-1].system_attrs


def test_the_journal_storage_a_command_prints_is_one_it_takes_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every command prints a journal storage as `journal:/path`; given back to --storage,
    that was read as a relative file name (`./journal:/path`), and a launch started a new,
    empty study there."""
    printed = resolve_storage(None, tmp_path).display
    assert printed == f"journal:{tmp_path.resolve() / 'optuna.journal'}"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert resolve_storage(printed, elsewhere) == resolve_storage(None, tmp_path)
    relative = resolve_storage("journal:runs/a.journal", elsewhere)
    assert relative.url == str(elsewhere.resolve() / "runs" / "a.journal")
    home = resolve_storage("journal:~/a.journal", elsewhere)  # no shell expands ~ there
    assert home.url == str(Path.home().resolve() / "a.journal")


def test_a_launch_takes_the_budget_another_launch_of_its_study_set(
    pg_url: str, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """Two launches of one study with other --trials: the study keeps the last one set. The
    first showed its own (`complete 6 ... / 3`, QA), and a worker it restarted set its own
    back on the study, so both launches stopped short of the other's budget."""
    import os
    import signal
    from collections.abc import Callable

    from cli_util import popen
    from hpsearch.study import N_TRIALS_ATTR

    # The first launch's first trial waits for the second's (a barrier of 2 processes): on a
    # loaded machine it had finished its 3 trials and ended before the second set 8.
    env = {**subprocess_env, "HPSEARCH_DUMMY_EPOCH_S": "0.4",
           "HPSEARCH_DUMMY_BARRIER": f"{tmp_path / 'barrier'}:2"}  # fmt: skip
    common = ["launch", "--study", "tiny", "--workers", "1", "--storage", pg_url,
              "--train-fn", DUMMY, "--no-tracking", "--set", "budget.max_epochs=3",
              "--set", "pruner={name: none}"]  # fmt: skip

    def study() -> optuna.Study:
        return optuna.load_study(study_name="tiny", storage=pg_url)

    def wait(what: str, check: Callable[[], bool], timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while not check():
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} in {timeout_s} s")
            time.sleep(0.2)

    first_log = tmp_path / "first.log"
    first = popen([*common, "--trials", "3", "--workdir", str(tmp_path / "a")], env, first_log)
    second = None
    try:
        wait("trial", lambda: any(t.state.name == "RUNNING" for t in _trials(pg_url)))
        second = popen([*common, "--trials", "8", "--workdir", str(tmp_path / "b")], env,
                       tmp_path / "second.log")  # fmt: skip
        wait("budget of 8", lambda: study().user_attrs.get(N_TRIALS_ATTR) == 8)
        wait("note", lambda: "budget.n_trials of the study is now 8" in first_log.read_text())
        # The first launch's worker dies: its restart must not set 3 back.
        children = Path(f"/proc/{first.pid}/task/{first.pid}/children").read_text().split()
        workers = [int(p) for p in children
                   if "worker" in Path(f"/proc/{p}/cmdline").read_bytes().decode()]  # fmt: skip
        assert len(workers) == 1, children
        os.kill(workers[0], signal.SIGKILL)
        assert first.wait(timeout=240) == 0, first_log.read_text()
        assert second.wait(timeout=240) == 0, (tmp_path / "second.log").read_text()
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
    out = first_log.read_text()
    progress = [line for line in out.splitlines() if line.startswith("[") and "| best" in line]
    assert " / 8 |" in progress[-1], progress
    assert study().user_attrs[N_TRIALS_ATTR] == 8
    counts = budget_counts(study().get_trials())
    assert counts["complete"] + counts["pruned"] == 8, counts


def _trials(pg_url: str) -> list[optuna.trial.FrozenTrial]:
    try:
        return optuna.load_study(study_name="tiny", storage=pg_url).get_trials()
    except KeyError:  # not created yet
        return []


def test_a_study_names_its_metrics_for_optunas_dashboard_and_plots(pg_url: str) -> None:
    """optuna-dashboard and Optuna's plots showed "objective 0", "objective 1" (QA)."""
    sets = ["objective={metric: [val_acc, train_seconds], direction: [maximize, minimize]}",
            "pruner.name=none", "pruner.options={}", "sampler.name=nsga2", "sampler.options={}"]  # fmt: skip
    study = create_or_load(load_config("tiny", sets), pg_url)
    assert study.metric_names == ["val_acc", "train_seconds"]
    assert create_or_load(load_config("tiny", sets), pg_url).metric_names == study.metric_names


@pytest.mark.parametrize("kind", ["postgres", "journal"])
def test_two_first_launches_at_once_give_their_study_one_uid(
    kind: str, pg_url: str, tmp_path: Path
) -> None:
    """Each may find the study without a uid; the second to mint waits for the first's
    under the study lock and takes it. Here B has read "none" under the lock and is about to
    write when A mints: without the lock A wrote its own, returned it, and B then wrote and
    returned another (two study runs on MLflow for one study)."""
    from hpsearch.study import STUDY_UID_ATTR, study_uid

    spec = resolve_storage(pg_url if kind == "postgres" else str(tmp_path / "j.log"), tmp_path)
    cfg = load_config("tiny")
    study_a = create_or_load(cfg, open_storage(spec))
    study_b = create_or_load(cfg, open_storage(spec), owner=False)
    read = study_b._storage.get_study_user_attrs
    calls: list[int] = []
    b_about_to_write, a_done = threading.Event(), threading.Event()

    def read_then_pause(study_id: int) -> dict[str, object]:
        attrs = read(study_id)
        calls.append(study_id)
        if len(calls) == 2:  # B's read under the lock: A comes now
            b_about_to_write.set()
            a_done.wait(1.5)  # A's whole mint, were it not kept out
        return attrs

    study_b._storage.get_study_user_attrs = read_then_pause  # type: ignore[method-assign]

    def lock() -> contextlib.AbstractContextManager[object]:
        return study_lock(spec, cfg.name)

    got_b: list[str | None] = []
    t = threading.Thread(target=lambda: got_b.append(study_uid(study_b, mint=True, lock=lock)))
    t.start()
    assert b_about_to_write.wait(10)
    got_a = study_uid(study_a, mint=True, lock=lock)
    a_done.set()
    t.join(10)
    assert got_b == [got_a] and got_a
    assert open_storage(spec).get_study_user_attrs(study_a._study_id)[STUDY_UID_ATTR] == got_a


def test_a_study_searched_with_random_then_gp_goes_on(tmp_path: Path) -> None:
    """QA: the sampler may change between launches, but a study's random-sampled trials
    carried no memory constraint and GP's did: Optuna's GP sampler then refused every ask
    ("The constraint names must be the same for all trials"), four trials failed and the
    workers crashed. Every trial carries it now, whatever the sampler; a study an earlier
    version left so is refused for GP in one line."""
    from hpsearch.study import MEMORY_CONSTRAINT
    from hpsearch.worker import WorkerOptions, run_worker

    spec = StorageSpec("journal", str(tmp_path / "optuna.journal"), "journal")
    opts = WorkerOptions(workdir=tmp_path, train_fn=DUMMY)
    base = ["budget.max_epochs=1", "pruner.name=none", "pruner.options={}"]
    random = load_config("tiny", [*base, "budget.n_trials=2", "sampler.name=random",
                                  "sampler.options={}"])  # fmt: skip
    assert run_worker(random, spec, opts).outcomes == {"finished": 2}
    gp = load_config("tiny", [*base, "budget.n_trials=5", "sampler.name=gp",
                              "sampler.options={n_startup_trials: 1}"])  # fmt: skip
    more = WorkerOptions(workdir=tmp_path, train_fn=DUMMY, set_budget=True)
    assert run_worker(gp, spec, more).outcomes == {"finished": 3}
    trials = create_or_load(gp, open_storage(spec)).get_trials(deepcopy=False)
    assert [t.constraints for t in trials] == [{MEMORY_CONSTRAINT: 0.0}] * 5

    # An earlier version's random trial, with no constraint: refused before any ask.
    study = create_or_load(random, open_storage(spec))
    bare = study.ask()
    bare.suggest_float("lr", 1e-3, 0.5, log=True)
    study.tell(bare, 0.1)
    with pytest.raises(ConfigError, match=(
        r"sampler.name: 'gp': completed trials 5 of study 'tiny' carry no 'memory' "
        r"constraint .*search this study with 'tpe'"
    )):  # fmt: skip
        create_or_load(gp, open_storage(spec))


def test_a_multi_objective_study_may_search_with_gp(tmp_path: Path) -> None:
    """QA: GP was refused for a multi-objective study, which Optuna's GP sampler searches
    (log EHVI, with the memory constraint too); CMA-ES cannot."""
    from hpsearch.worker import WorkerOptions, run_worker

    spec = StorageSpec("journal", str(tmp_path / "optuna.journal"), "journal")
    base = ["budget.max_epochs=1", "pruner.name=none", "pruner.options={}",
            "objective={metric: [val_acc, train_seconds]}"]  # fmt: skip
    gp = load_config("tiny", [*base, "budget.n_trials=3", "sampler.name=gp",
                              "sampler.options={n_startup_trials: 1}"])  # fmt: skip
    opts = WorkerOptions(workdir=tmp_path, train_fn=DUMMY)
    assert run_worker(gp, spec, opts).outcomes == {"finished": 3}
    with pytest.raises(ConfigError, match="'cmaes': does not support multi-objective"):
        load_config("tiny", [*base, "sampler.name=cmaes", "sampler.options={}"])


def test_a_worker_whose_log_disk_is_full_still_exits_74(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """QA: a launch's worker logs to the work folder's disk; full, the worker's `Error:`
    line failed, and so did the interpreter's flush at exit: exit 1 (or 120), not 74, and
    the launch said "every worker crashed" with an empty log. /dev/full here: every write
    to it fails with ENOSPC."""
    import sys

    import hpsearch.worker as W

    W._record_disk_need(tmp_path, "tiny", 1 << 50)  # no disk has room for that twice over
    launched = {**subprocess_env, "HPSEARCH_LAUNCHED": "1"}  # (LAUNCHED_ENV) its log: the disk
    with open("/dev/full", "w") as full:
        r = subprocess.run(
            [sys.executable, "-m", "hpsearch.cli", "worker", "--study", "tiny", "--workdir",
             str(tmp_path), "--train-fn", DUMMY],
            env=launched, stdout=full, stderr=full, timeout=120,
        )  # fmt: skip
    assert r.returncode == 74
    out = subprocess.run(
        [sys.executable, "-m", "hpsearch.cli", "worker", "--study", "tiny", "--workdir",
         str(tmp_path), "--train-fn", DUMMY],
        env=subprocess_env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 74 and "a trial's checkpoints need; free some" in out.stderr
