"""`FastRDBStorage` makes a trial's hot-path storage calls in plain SQL; each must give
exactly what Optuna's own RDBStorage gives, on the real PostgreSQL: reads for every kind of
value a trial can hold, trial numbers under concurrent creation by both, heartbeats as
Optuna's stale-trial check reads them."""

from __future__ import annotations

import datetime
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
from hpsearch.rdb import FastRDBStorage, trials_where
from hpsearch.storage import (
    StorageSpec,
    count_trials_sql,
    normalize_url,
    open_storage,
    resolve_storage,
    study_lock,
    with_db_retry,
)
from optuna.distributions import (
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.storages import RDBStorage
from optuna.trial import FrozenTrial, TrialState
from pg_util import terminate_backends

INF = float("inf")
ONE_MINUTE = datetime.timedelta(minutes=1)


def _comparable(t: FrozenTrial) -> dict[str, Any]:
    """A trial's fields with nan made comparable (nan != nan) and param types kept."""

    def fix(v: Any) -> Any:
        return "nan" if isinstance(v, float) and math.isnan(v) else v

    d = dict(vars(t))
    d["intermediate_values"] = {k: fix(v) for k, v in t.intermediate_values.items()}
    d["_values"] = [fix(v) for v in t.values] if t.values is not None else None
    d["param_types"] = {k: type(v).__name__ for k, v in t.params.items()}
    d["param_order"] = list(t.params)
    return d


def _fill(study: optuna.Study) -> None:
    """Trials in every state, with every kind of param, value and attribute."""
    dists = {
        "lr": FloatDistribution(1e-5, 1.0, log=True),
        "drop": FloatDistribution(-1.0, 1.0),
        "stepped": FloatDistribution(0.0, 1.0, step=0.25),
        "bs": IntDistribution(8, 256, log=True),
        "layers": IntDistribution(1, 9, step=2),
        "arch": CategoricalDistribution(["resnet18", "resnet34", None, 3, 2.5, True]),
    }
    params: list[dict[str, Any]] = [
        {"lr": 0.1 + 0.2, "drop": -0.0, "stepped": 0.75, "bs": 64, "layers": 3, "arch": None},
        {"lr": 1 / 3, "drop": 1.0, "stepped": 0.0, "bs": 8, "layers": 9, "arch": 2.5},
        {"arch": True, "lr": 1e-5},  # another order, fewer params
        {},
    ]
    for i, p in enumerate(params):
        study.add_trial(
            optuna.trial.create_trial(
                params=p,
                distributions={k: dists[k] for k in p},
                value=[0.5, INF, -INF, 1e-300][i],
                intermediate_values={0: 0.25, 1: float("nan"), 2: INF, 3: -INF, 10: -1.5e12},
                user_attrs={"höst": "gpu-0", "hist": [{"epoch": 1, "acc": 0.5}], "n": i},
                system_attrs={"fixed_params": {"lr": 0.01}, "x": None},
            )
        )
    for state in (TrialState.PRUNED, TrialState.FAIL):
        t = study.ask({"lr": dists["lr"], "arch": dists["arch"]})
        t.report(0.5, 0)
        study.tell(t, state=state)
    running = study.ask({"lr": dists["lr"]})
    running.report(0.125, 4)
    running.set_user_attr("worker", "w1")
    study.enqueue_trial({"lr": 0.02})  # WAITING


@pytest.fixture(params=["psycopg2", "psycopg"])
def pg_url(pg_url: str, request: pytest.FixtureRequest) -> str:
    """Each test on both PostgreSQL drivers: psycopg2, which hpsearch installs and takes for
    a plain postgresql:// URL, and psycopg 3 (where psycopg2 is missing, or named in the URL)."""
    assert pg_url.startswith("postgresql://")
    return pg_url.replace("postgresql://", f"postgresql+{request.param}://", 1)


@pytest.fixture
def away_from_utc(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Local time 5.5 h from UTC: Optuna stores naive UTC and hands out naive local time."""
    monkeypatch.setenv("TZ", "Asia/Kolkata")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


@pytest.mark.usefixtures("away_from_utc")
def test_reads_match_optuna_for_every_kind_of_trial(pg_url: str, tmp_path: Path) -> None:
    optuna_storage = RDBStorage(normalize_url(pg_url))
    study = optuna.create_study(storage=optuna_storage, study_name="twin")
    _fill(study)
    multi = optuna.create_study(
        storage=optuna_storage, study_name="multi", directions=["minimize", "maximize"]
    )
    multi.add_trial(optuna.trial.create_trial(values=[INF, -2.5]))
    multi.add_trial(optuna.trial.create_trial(values=[0.1, -INF]))
    other = optuna.create_study(storage=optuna_storage, study_name="empty")

    fast = open_storage(resolve_storage(pg_url, tmp_path))
    assert isinstance(fast, FastRDBStorage) and fast.fast_sql()
    assert pg_url.startswith(f"postgresql+{fast.engine.dialect.driver}://")
    sid, mid = study._study_id, multi._study_id
    all_ids = [t._trial_id for t in study.get_trials()]
    first_ids = sorted(all_ids)[:3]
    filters: list[tuple[Any, set[int], int]] = [
        (None, set(), -1),
        ([TrialState.COMPLETE, TrialState.PRUNED], set(), -1),
        ((TrialState.RUNNING,), set(), -1),
        (None, {first_ids[0], first_ids[2]}, first_ids[2]),  # included ids and newer ones
        (None, {first_ids[0], 10**9}, first_ids[1]),  # an id above the bound is not included
        (None, set(), first_ids[1]),
        ([TrialState.WAITING], {first_ids[0]}, first_ids[2]),
    ]
    for states, included, greater in filters:
        want = optuna_storage._get_trials(sid, states, included, greater)
        got = fast._get_trials(sid, states, included, greater)
        assert [_comparable(t) for t in got] == [_comparable(t) for t in want], (states, greater)
        assert want, (states, included, greater)  # each filter selects something
    for study_id in (mid, other._study_id):
        want = optuna_storage._get_trials(study_id, None, set(), -1)
        assert [_comparable(t) for t in fast._get_trials(study_id, None, set(), -1)] == [
            _comparable(t) for t in want
        ]
    for trial_id in all_ids:
        assert _comparable(fast.get_trial(trial_id)) == _comparable(
            optuna_storage.get_trial(trial_id)
        )
    with pytest.raises(KeyError):
        fast._get_trials(10**6, None, set(), -1)
    with pytest.raises(KeyError):
        fast.get_trial(10**6)

    # Through Optuna's cache, as the worker reads: the same trials, and a sampler runs on them.
    cached = optuna.load_study(study_name="twin", storage=fast)
    assert [_comparable(t) for t in cached.get_trials()] == [
        _comparable(t) for t in study.get_trials()
    ]
    cached.sampler = optuna.samplers.TPESampler(seed=0)
    cached.optimize(lambda t: t.suggest_float("lr", 1e-5, 1.0, log=True), n_trials=3)
    assert len(study.get_trials(states=(TrialState.COMPLETE,))) == 7


def test_the_filter_selects_as_optunas_own() -> None:
    where, params = trials_where([TrialState.PRUNED], {5, 9, 20}, 9)
    assert (
        where == "TRUE AND t.state::text = ANY(:states) AND "
        "(t.trial_id = ANY(:included) OR t.trial_id > :greater_than)"
    )
    assert params == {"states": ["PRUNED"], "included": [5, 9], "greater_than": 9}
    assert trials_where(None, {3}, -1) == ("TRUE", {})
    assert trials_where(None, set(), 4) == (
        "TRUE AND t.trial_id > :greater_than",
        {"greater_than": 4},
    )


def test_other_databases_take_optunas_own_reads(tmp_path: Path) -> None:
    storage = FastRDBStorage(f"sqlite:///{tmp_path / 'o.db'}")
    assert not storage.fast_sql()
    study = optuna.create_study(storage=storage)
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    assert [t.state for t in storage.get_all_trials(study._study_id)] == [TrialState.COMPLETE] * 2
    assert sa.inspect(storage.engine).has_table("trials")


def _two_storages(pg_url: str, tmp_path: Path) -> tuple[RDBStorage, FastRDBStorage]:
    fast = open_storage(resolve_storage(pg_url, tmp_path))
    assert isinstance(fast, FastRDBStorage) and fast.fast_sql()
    with warnings.catch_warnings():  # Optuna calls heartbeats experimental
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return RDBStorage(normalize_url(pg_url), heartbeat_interval=60), fast


@pytest.mark.usefixtures("away_from_utc")
def test_new_trials_are_numbered_as_optunas_even_when_both_create_at_once(
    pg_url: str, tmp_path: Path
) -> None:
    plain, fast = _two_storages(pg_url, tmp_path)
    sid = plain.create_new_study([optuna.study.StudyDirection.MAXIMIZE], "numbers")
    created = fast._create_new_trial(sid)
    stored = plain.get_trial(created._trial_id)
    assert _comparable(created) == _comparable(stored)
    assert (created.number, created.state, created.params) == (0, TrialState.RUNNING, {})
    # a template trial (a retry, an enqueued trial) is Optuna's own
    template = optuna.trial.create_trial(state=TrialState.WAITING, params={}, distributions={})
    assert fast._create_new_trial(sid, template).state == TrialState.WAITING

    errors: list[BaseException] = []

    def create(storage: RDBStorage, n: int) -> None:
        try:
            for _ in range(n):
                storage.create_new_trial(sid)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=create, args=(s, 15)) for s in (plain, fast) * 3]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    trials = plain.get_all_trials(sid)
    assert len(trials) == 2 + 6 * 15
    by_id = sorted(trials, key=lambda t: t._trial_id)
    assert [t.number for t in by_id] == list(range(len(trials)))  # unique, in id order
    with pytest.raises(KeyError):
        fast._create_new_trial(10**6)


def test_heartbeats_are_read_by_optunas_stale_trial_check(pg_url: str, tmp_path: Path) -> None:
    plain, fast = _two_storages(pg_url, tmp_path)
    sid = plain.create_new_study([optuna.study.StudyDirection.MAXIMIZE], "beats")
    mine, theirs = fast.create_new_trial(sid), plain.create_new_trial(sid)
    fast.record_heartbeat(mine)
    plain.record_heartbeat(theirs)
    engine = fast.engine

    def beats() -> dict[int, Any]:
        with engine.connect() as conn:
            rows = conn.execute(sa.text("SELECT trial_id, heartbeat FROM trial_heartbeats"))
            return {int(tid): at for tid, at in rows}

    first = beats()
    assert set(first) == {mine, theirs}
    time.sleep(0.05)
    fast.record_heartbeat(mine)  # a later beat updates the one row
    fast.record_heartbeat(theirs)  # and works on a row Optuna wrote
    later = beats()
    assert later[mine] > first[mine] and later[theirs] > first[theirs]
    # both old enough for Optuna's check with a tiny grace period: both found stale
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE trial_heartbeats SET heartbeat = heartbeat - interval '1 h'"))
    assert sorted(plain._get_stale_trial_ids(sid)) == sorted([mine, theirs])
    fast.record_heartbeat(mine)
    assert plain._get_stale_trial_ids(sid) == [theirs]
    fast.record_heartbeat(10**6)  # no such trial: ignored, as Optuna ignores it


def test_a_trials_heartbeat_thread_beats_as_it_starts(pg_url: str, tmp_path: Path) -> None:
    """The claim's beat may be seconds old by the time the trial is built (the sampler reads
    every trial): the thread must not wait a period (here 30 s) before its first beat."""
    from hpsearch.worker import _Heartbeat

    plain, _ = _two_storages(pg_url, tmp_path)  # heartbeat interval 60 s
    sid = plain.create_new_study([optuna.study.StudyDirection.MAXIMIZE], "first-beat")
    tid = plain.create_new_trial(sid)
    with plain.engine.begin() as conn:  # a claim's beat from long ago
        conn.execute(
            sa.text(
                "INSERT INTO trial_heartbeats (trial_id, heartbeat) VALUES (:t, now() - interval '1 h')"
            ),
            {"t": tid},
        )
    assert plain._get_stale_trial_ids(sid) == [tid]
    beat = _Heartbeat(plain, tid)
    try:
        deadline = time.monotonic() + 10
        while plain._get_stale_trial_ids(sid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert plain._get_stale_trial_ids(sid) == []
    finally:
        beat.stop()


def test_a_finished_trial_takes_no_more_params_or_attributes(pg_url: str, tmp_path: Path) -> None:
    plain, fast = _two_storages(pg_url, tmp_path)
    sid = plain.create_new_study([optuna.study.StudyDirection.MAXIMIZE], "finished")
    tid = fast.create_new_trial(sid)
    lr = FloatDistribution(1e-3, 1.0, log=True)
    fast.write_running_trial(tid, sid, [("lr", 0.01, lr)], {"a": [1, "x"]}, {"s": None}, {})
    trial = plain.get_trial(tid)
    assert (trial.params, trial.user_attrs, trial.system_attrs) == (
        {"lr": 0.01},
        {"a": [1, "x"]},
        {"s": None},
    )
    plain.set_trial_state_values(tid, TrialState.COMPLETE, [1.0])
    with pytest.raises(optuna.exceptions.UpdateFinishedTrialError):
        fast.write_running_trial(tid, sid, [("x", 0.5, lr)], {"b": 1}, {}, {})
    assert _comparable(plain.get_trial(tid)) == _comparable(trial) | {
        "state": TrialState.COMPLETE,
        "_values": [1.0],
        "datetime_complete": plain.get_trial(tid).datetime_complete,
    }
    with pytest.raises(KeyError):
        fast.write_running_trial(10**6, sid, [], {"b": 1}, {}, {})


@pytest.mark.usefixtures("away_from_utc")
def test_finishing_trials_and_intermediate_values_match_optunas(
    pg_url: str, tmp_path: Path
) -> None:
    plain, fast = _two_storages(pg_url, tmp_path)
    sid = plain.create_new_study(
        [optuna.study.StudyDirection.MINIMIZE, optuna.study.StudyDirection.MAXIMIZE], "finish"
    )
    waiting = optuna.trial.create_trial(state=TrialState.WAITING, params={}, distributions={})
    cases: list[tuple[TrialState, list[float] | None]] = [
        (TrialState.COMPLETE, [0.5, -1e-300]),
        (TrialState.COMPLETE, [INF, -INF]),
        (TrialState.PRUNED, None),
        (TrialState.FAIL, None),
    ]
    for template in (None, waiting):  # a running trial, and a waiting one (Optuna allows it)
        for state, values in cases:
            twins = []
            for storage in (plain, fast):
                tid = plain._create_new_trial(sid, template)._trial_id
                for step, value in ((0, 0.25), (1, float("nan")), (2, INF), (3, -INF), (0, 2.0)):
                    storage.set_trial_intermediate_value(tid, step, value)
                assert storage.set_trial_state_values(tid, state, values) is True
                twins.append(plain.get_trial(tid))
            mine, theirs = (_comparable(t) for t in twins)
            # both local time, a moment apart (UTC would be 5.5 h off)
            assert abs(twins[1].datetime_complete - twins[0].datetime_complete) < ONE_MINUTE
            for key in ("_trial_id", "_number", "_datetime_start", "datetime_complete"):
                mine.pop(key), theirs.pop(key)
            assert mine == theirs, (template, state)
            assert twins[0].intermediate_values[0] == 2.0  # the later write of a step wins
    # a waiting trial made running is Optuna's own path
    tid = plain._create_new_trial(sid, waiting)._trial_id
    assert fast.set_trial_state_values(tid, TrialState.RUNNING) is True
    assert fast.set_trial_state_values(tid, TrialState.RUNNING) is False
    # a finished trial takes nothing more; no trial is a KeyError, as in Optuna
    with pytest.raises(optuna.exceptions.UpdateFinishedTrialError):
        fast.set_trial_state_values(tid - 1, TrialState.COMPLETE, [1.0, 1.0])
    with pytest.raises(optuna.exceptions.UpdateFinishedTrialError):
        fast.set_trial_intermediate_value(tid - 1, 9, 1.0)
    assert 9 not in plain.get_trial(tid - 1).intermediate_values
    with pytest.raises(KeyError):
        fast.set_trial_state_values(10**6, TrialState.FAIL)
    with pytest.raises(KeyError):
        fast.set_trial_intermediate_value(10**6, 0, 1.0)


def test_two_workers_finishing_one_trial_at_once_finish_it_once(
    pg_url: str, tmp_path: Path
) -> None:
    """Optuna's stale-trial check fails a trial only where `set_trial_state_values` says it
    did: two workers failing the same trial at once must not both succeed (each would queue
    a retry)."""
    plain, fast = _two_storages(pg_url, tmp_path)
    other = open_storage(resolve_storage(pg_url, tmp_path))
    sid = plain.create_new_study([optuna.study.StudyDirection.MAXIMIZE], "race")
    outcomes: list[str] = []
    lock = threading.Lock()

    def fail(storage: RDBStorage, tid: int, go: threading.Barrier) -> None:
        go.wait()
        try:
            done = storage.set_trial_state_values(tid, TrialState.FAIL)
            result = "failed it" if done else "not failed"
        except optuna.exceptions.UpdateFinishedTrialError:
            result = "already finished"
        with lock:
            outcomes.append(result)

    for _ in range(20):
        tid = plain.create_new_trial(sid)
        go = threading.Barrier(2)
        threads = [threading.Thread(target=fail, args=(s, tid, go)) for s in (fast, other)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    assert outcomes.count("failed it") == 20
    assert outcomes.count("already finished") == 20


def _ask_within_budget(
    study: optuna.Study, spec: StorageSpec, n_trials: int, after_count: Any
) -> int | None:
    """The worker's locked section (`worker._next_trial`): count the study's trials on the
    lock's connection and create one only while the budget has room; its trial id."""
    engine = study._storage._backend.engine  # type: ignore[attr-defined]
    with study_lock(spec, study.study_name, engine) as conn:
        assert conn is not None
        counts = count_trials_sql(conn, study)
        after_count()
        if counts["complete"] + counts["pruned"] + counts["running"] >= n_trials:
            return None
        return study._storage.create_new_trial(study._study_id)


@pytest.mark.parametrize("pooled", ["broken", "fresh"])
def test_a_restart_inside_the_budget_lock_never_overshoots_the_budget(
    pg_url: str, tmp_path: Path, pooled: str
) -> None:
    """The study lock is a session lock: a database restart right after worker A counted
    ends it, and worker B takes it, counts and creates the budget's one trial. A must not
    create a second on the count it took before the restart, whether its pool still holds
    the broken connections (an error, which must not be retried on that count) or new ones
    (the pool recycled them: an insert there would simply succeed)."""
    spec = resolve_storage(pg_url, tmp_path)
    a, b = (
        optuna.create_study(study_name="budget", storage=open_storage(spec), load_if_exists=True)
        for _ in range(2)
    )
    got_b: list[int | None] = []

    def restart_then_b_asks() -> None:
        if got_b:
            return  # A's second try, after the restart: nothing happens in between
        terminate_backends(pg_url)
        if pooled == "fresh":  # connections the pool has not handed out are new ones
            a._storage._backend.engine.pool.dispose()  # type: ignore[attr-defined]
        got_b.append(
            with_db_retry(lambda: _ask_within_budget(b, spec, 1, lambda: None), what="ask B")
        )

    with warnings.catch_warnings():  # with_db_retry's "unreachable, retrying"
        warnings.simplefilter("ignore")
        got_a = with_db_retry(
            lambda: _ask_within_budget(a, spec, 1, restart_then_b_asks), what="ask A"
        )
    trials = optuna.load_study(study_name="budget", storage=normalize_url(pg_url)).trials
    assert [(t.number, t.state) for t in trials] == [(0, TrialState.RUNNING)]
    assert (got_b, got_a) == ([trials[0]._trial_id], None)


def test_an_unknown_schema_revision_takes_optunas_own_methods(
    pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hpsearch.rdb

    monkeypatch.setattr(hpsearch.rdb, "SCHEMA_REVISIONS", ("v9.9.9",))
    storage = open_storage(resolve_storage(pg_url, tmp_path))
    assert isinstance(storage, FastRDBStorage) and not storage.fast_sql()
    study = optuna.create_study(storage=storage)
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2


_WITHOUT_INTERNALS = """
import logging, sys, types
import optuna
import optuna.storages._rdb.storage as real

# This Optuna without `_create_scoped_session`, as hpsearch.rdb imports it (a release may
# move it); Optuna's own methods keep theirs.
sys.modules[real.__name__] = types.ModuleType(real.__name__)
try:
    import hpsearch.rdb as rdb
finally:
    sys.modules[real.__name__] = real
from hpsearch.storage import heartbeat_storage, open_storage, resolve_storage, tell
from pathlib import Path

logging.basicConfig(level=logging.WARNING, format="%(message)s")
storage = open_storage(resolve_storage(sys.argv[1], Path(sys.argv[2])), heartbeat_interval=60)
assert rdb.INTERNALS_MISSING and not storage.fast_sql()
study = optuna.create_study(storage=storage, direction="maximize", study_name="moved")
for i in range(3):
    trial = study.ask()
    heartbeat_storage(storage).record_heartbeat(trial._trial_id)
    x = trial.suggest_float("x", 0, 1)
    trial.report(x, 0)
    tell(study, trial, x)
print("states", sorted({t.state.name for t in study.trials}), len(study.trials))
"""


def test_an_optuna_without_the_internals_used_takes_its_own_methods(
    pg_url: str, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """Where an Optuna release moves the internals `hpsearch.rdb` imports, hpsearch still
    imports, says so once, and every storage call is Optuna's own."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _WITHOUT_INTERNALS, pg_url, str(tmp_path)],
        capture_output=True,
        text=True,
        env=subprocess_env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "states ['COMPLETE'] 3" in out.stdout
    assert "lacks the internals hpsearch's fast storage path uses" in out.stderr
    assert "_create_scoped_session" in out.stderr


def test_an_optuna_release_the_sql_was_not_checked_against_takes_its_own_methods(
    pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The schema revision can stay while a release changes how it fills the rows (5.1
    changed its models under the same revision): a release not in `KNOWN_OPTUNA` takes
    Optuna's own methods, and says so."""
    from hpsearch.rdb import optuna_known

    assert optuna_known(optuna.__version__)  # the installed one is checked (pyproject caps it)
    assert optuna_known("5.0.0") and optuna_known("5.1.2") and not optuna_known("5.10.0")
    monkeypatch.setattr(optuna, "__version__", "5.2.0")
    storage = open_storage(resolve_storage(pg_url, tmp_path))
    assert isinstance(storage, FastRDBStorage) and not storage.fast_sql()
    assert "checked against Optuna 5.0 and 5.1, not 5.2.0" in caplog.text
    study = optuna.create_study(storage=storage)
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2
