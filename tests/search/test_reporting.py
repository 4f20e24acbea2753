"""A trial's reports on the real PostgreSQL: the training thread decides as Optuna's own
`report` + `should_prune` would, without a database round trip, and every value and rung
record is in the database once the reports are closed."""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
import sqlalchemy as sa
from hpsearch.config import load_config
from hpsearch.reporting import TrialReports
from hpsearch.storage import (
    StorageSpec,
    open_storage,
    resolve_storage,
    throttle_trial_reads,
    with_db_retry,
)
from hpsearch.study import create_or_load
from hpsearch.worker import WorkerOptions, run_worker
from pg_util import cut_off
from stack_util import create_database, drop_database

# Per-epoch values of the finished trials, then of the trial under test: the median pruner
# stops it after a few epochs, Hyperband promotes it through several rungs.
HISTORY = [
    [0.2, 0.3, 0.5, 0.6, 0.62, 0.64, 0.66, 0.68, 0.7],
    [0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5],
    [0.3, 0.4, 0.45, 0.5, 0.52, 0.55, 0.6, 0.62, 0.63],
    [0.05, 0.1, 0.12, 0.15, 0.2, 0.22, 0.25, 0.3, 0.32],
]
UNDER_TEST = [0.25, 0.35, 0.45, 0.46, 0.47, 0.48, 0.49, 0.5, 0.51]
PRUNERS = {
    "median": ["pruner.name=median", "pruner.options={n_startup_trials: 2, n_warmup_steps: 1}"],
    "hyperband": ["pruner.name=hyperband", "pruner.options={min_resource: 1, reduction_factor: 2}"],
    # needs one more complete trial than HISTORY to start pruning
    "median-late": [
        "pruner.name=median",
        f"pruner.options={{n_startup_trials: {len(HISTORY) + 1}, n_warmup_steps: 0}}",
    ],
}


@pytest.fixture
def twin_urls() -> Iterator[tuple[str, str]]:
    a, b = create_database("rpa"), create_database("rpb")
    try:
        yield a, b
    finally:
        drop_database(a)
        drop_database(b)


def _open(url: str, tmp_path: Path, pruner: str) -> optuna.Study:
    """The tiny study with `pruner`, opened as a worker opens it (its own connection)."""
    cfg = load_config("tiny", overrides=["budget.max_epochs=9", *PRUNERS[pruner]])
    return create_or_load(cfg, open_storage(resolve_storage(url, tmp_path)))


def _study_with_history(url: str, tmp_path: Path, pruner: str) -> optuna.Study:
    study = _open(url, tmp_path, pruner)
    for curve in HISTORY:
        trial = study.ask()
        for epoch, value in enumerate(curve, 1):
            trial.report(value, epoch)
            trial.should_prune()  # Hyperband records its rungs here
        study.tell(trial, curve[-1])
    return study


@contextlib.contextmanager
def _statements_on_this_thread(study: optuna.Study) -> Iterator[list[str]]:
    """The SQL statements (first word) that this thread sends to the study's database."""
    engine = study._storage._backend.engine  # type: ignore[attr-defined]
    me = threading.get_ident()
    seen: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if threading.get_ident() == me:
            seen.append(statement.split()[0])

    sa.event.listen(engine, "before_cursor_execute", count)
    try:
        yield seen
    finally:
        sa.event.remove(engine, "before_cursor_execute", count)


def _db(fn: Any, what: str) -> Any:
    return with_db_retry(fn, give_up_after_s=10, what=what)


def _stored(study: optuna.Study, trial_id: int) -> tuple[dict[int, float], dict[str, Any]]:
    frozen = study._storage.get_trial(trial_id)
    rungs = {k: v for k, v in frozen.system_attrs.items() if k.startswith("completed_rung")}
    return frozen.intermediate_values, rungs


@pytest.mark.parametrize("pruner", ["hyperband", "median"])
def test_decisions_and_stored_values_match_optunas_own(
    twin_urls: tuple[str, str], tmp_path: Path, pruner: str
) -> None:
    optunas = _study_with_history(twin_urls[0], tmp_path, pruner)
    ours = _study_with_history(twin_urls[1], tmp_path, pruner)
    throttle_trial_reads(ours)  # as a worker opens its study
    a, b = optunas.ask(), ours.ask()
    assert a.number == b.number  # the same Hyperband bracket on both sides
    expected, got = [], []
    with TrialReports(ours, b, _db) as reports:
        for epoch, value in enumerate(UNDER_TEST, 1):
            a.report(value, epoch)
            expected.append(a.should_prune())
            got.append(reports.report(epoch, value))
            if expected[-1] or got[-1]:
                break
    assert got == expected
    values, rungs = _stored(ours, b._trial_id)
    assert (values, rungs) == _stored(optunas, a._trial_id)
    assert values == dict(enumerate(UNDER_TEST[: len(expected)], 1))
    if pruner == "median":
        assert expected[-1] and len(expected) >= 3  # reported several epochs, then pruned
    else:
        assert len(rungs) >= 2  # promoted at least twice: the pruner's own writes


def test_the_training_thread_makes_no_database_round_trip(pg_url: str, tmp_path: Path) -> None:
    study = _study_with_history(pg_url, tmp_path, "hyperband")
    throttle_trial_reads(study)
    trial = study.ask()
    reports = TrialReports(study, trial, _db)  # reads the trial's attributes once, here
    try:
        with _statements_on_this_thread(study) as on_training_thread:
            for epoch, value in enumerate(UNDER_TEST, 1):
                time.sleep(0.3)  # an epoch: longer than the 0.25 s refresh throttle
                if reports.report(epoch, value):
                    break
    finally:
        reports.close()
    assert epoch >= 3  # several reports, rungs written (the pruner's own writes) included
    assert on_training_thread == []
    values, rungs = _stored(study, trial._trial_id)
    assert values == dict(enumerate(UNDER_TEST[:epoch], 1)) and rungs


def test_a_failed_write_is_raised_on_the_training_thread(pg_url: str, tmp_path: Path) -> None:
    study = _study_with_history(pg_url, tmp_path, "median")
    other = _open(pg_url, tmp_path, "median")
    trial = study.ask()
    reports = TrialReports(study, trial, _db)
    reports.report(1, 0.3)
    reports.close()  # the first value is written
    reports = TrialReports(study, trial, _db)
    other.tell(trial.number, state=optuna.trial.TrialState.FAIL)  # stale-failed elsewhere
    reports.report(2, 0.4)  # queued: the training thread does not wait for it
    with pytest.raises(optuna.exceptions.UpdateFinishedTrialError):
        reports.report(3, 0.5)  # the next report raises it on the training thread
    reports.close()  # already raised where the trainer sees it: not again
    trial = study.ask()
    reports = TrialReports(study, trial, _db)
    other.tell(trial.number, state=optuna.trial.TrialState.FAIL)
    reports.report(1, 0.3)  # the last report: the error comes with the close
    with pytest.raises(optuna.exceptions.UpdateFinishedTrialError):
        reports.close()
    reports.close()  # once


def test_a_multi_objective_trial_finishes(tmp_path: Path) -> None:
    """Optuna keeps no intermediate values for multi-objective studies (its `report`
    raises): the worker reports nothing to it and tells both values."""
    cfg = load_config(
        "tiny",
        overrides=[
            "budget.n_trials=2",
            "budget.max_epochs=2",
            "objective={metric: [val_acc, train_seconds], direction: [maximize, minimize]}",
            "pruner.name=none",
            "pruner.options={}",
        ],
    )
    spec = StorageSpec("journal", str(tmp_path / "optuna.journal"), "journal")
    opts = WorkerOptions(workdir=tmp_path, worker_id="w0", train_fn="dummy_trainer:train")
    assert run_worker(cfg, spec, opts).outcomes == {"finished": 2}
    study = optuna.load_study(study_name=cfg.name, storage=open_storage(spec))
    assert all(len(t.values) == 2 for t in study.trials)
    # The epoch each reached, where `status` reads a running trial's (no intermediate values)
    assert [t.user_attrs.get("last_epoch") for t in study.trials] == [2, 2]


def test_status_shows_a_running_multi_objective_trials_epoch(tmp_path: Path) -> None:
    """`hpsearch status` showed "last epoch -" for every running trial of a
    multi-objective study: it read only intermediate values, which Optuna keeps for none."""
    from hpsearch.query import study_status

    spec = StorageSpec("journal", str(tmp_path / "optuna.journal"), "journal")
    study = optuna.create_study(
        study_name="mo", storage=open_storage(spec), directions=["maximize", "minimize"]
    )
    trial = study.ask()
    with TrialReports(study, trial, _db) as reports:
        assert reports(1, 0.5) is False and reports(3, 0.6) is False
    [running] = study_status("mo", str(spec.url)).running
    assert running["number"] == trial.number and running["last_epoch"] == 3


def test_a_short_outage_neither_fails_the_trial_nor_loses_a_value(
    pg_url: str, tmp_path: Path
) -> None:
    """The database goes away for 2 s mid-trial. Training goes on for one epoch on the view
    it has; the next report waits for that epoch's write (training never runs more than one
    epoch ahead of the stored values), and every value is written once it is back."""
    study = _study_with_history(pg_url, tmp_path, "median")
    throttle_trial_reads(study)
    trial = study.ask()
    with TrialReports(study, trial, _db, max_age_s=0.4) as reports:
        reports.report(1, 0.3)
        outage = cut_off(pg_url, 2.0)
        time.sleep(0.6)  # an epoch, during the outage
        assert reports.report(2, 0.35) is False
        t0 = time.monotonic()
        reports.report(3, 0.4)  # a short epoch later: epoch 2's write is not done yet
        waited = time.monotonic() - t0
        outage.join()
    assert waited >= 0.5  # it waited for the database instead of failing the trial
    assert _stored(study, trial._trial_id)[0] == {1: 0.3, 2: 0.35, 3: 0.4}


def test_an_outage_over_before_the_next_report_does_not_stop_the_trial(
    pg_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The database is away for longer than the outage limit during one long epoch, with no
    write pending, and back before the next report: only the writer thread's background
    refreshes of the view failed. They are reads: the report goes on and its value is
    stored, and the failure is logged once, not once per refresh."""
    study = _study_with_history(pg_url, tmp_path, "median")
    throttle_trial_reads(study)
    trial = study.ask()

    def db(fn: Any, what: str) -> Any:  # the outage limit: 1 s
        return with_db_retry(fn, give_up_after_s=1.0, what=what)

    with warnings.catch_warnings():  # with_db_retry's "unreachable, retrying"
        warnings.simplefilter("ignore")
        with (
            caplog.at_level("WARNING", logger="hpsearch.reporting"),
            TrialReports(study, trial, db, max_age_s=0.4) as reports,
        ):
            reports.report(1, 0.3)
            time.sleep(0.3)  # epoch 1's write done: nothing pending from here on
            cut_off(pg_url, 4.0).join()  # the long epoch, the database away meanwhile
            time.sleep(0.3)
            assert reports.report(2, 0.35) is False
    assert _stored(study, trial._trial_id)[0] == {1: 0.3, 2: 0.35}
    failed = [r for r in caplog.records if "cannot refresh" in r.getMessage()]
    assert len(failed) == 1


def test_a_trial_finished_elsewhere_counts_at_the_next_report(pg_url: str, tmp_path: Path) -> None:
    """Another worker completes a trial while this one trains: the writer thread's timed
    refresh brings it into the view, and the median pruner, which needed one more complete
    trial to start, prunes at the next report without a read on the training thread."""
    study = _study_with_history(pg_url, tmp_path, "median-late")
    other = _open(pg_url, tmp_path, "median-late")
    throttle_trial_reads(study)
    backend = study._storage._backend  # type: ignore[attr-defined]
    real_read = backend._get_trials
    waiting: list[tuple[float, threading.Event]] = []

    def read_after(t: float) -> threading.Event:
        waiting.append((t, threading.Event()))
        return waiting[-1][1]

    def spying_read(*args: Any, **kwargs: Any) -> Any:
        began = time.monotonic()
        out = real_read(*args, **kwargs)
        if threading.current_thread().name == "hpsearch-reports":
            for t, done in waiting:
                if began > t:
                    done.set()
        return out

    backend._get_trials = spying_read
    late, trial = other.ask(), study.ask()
    with (
        TrialReports(study, trial, _db, max_age_s=2.0) as reports,
        _statements_on_this_thread(study) as on_training_thread,
    ):
        assert reports.report(1, 0.01) is False  # 4 complete trials: still starting up
        late.report(0.5, 1)
        other.tell(late, 0.9)
        told_at = time.monotonic()
        # An epoch longer than the writer's 1 s refresh period: wait until a read of the
        # writer thread's, begun after the tell, is done (a fixed sleep could end first on
        # a loaded machine).
        assert read_after(told_at).wait(30)
        assert reports.report(2, 0.02) is True  # 5 complete: far below their median
    assert on_training_thread == []


def test_close_restores_the_throttle_and_ends_the_writer(pg_url: str, tmp_path: Path) -> None:
    study = _study_with_history(pg_url, tmp_path, "median")
    throttle_trial_reads(study)
    interval = study._storage._hpsearch_interval  # type: ignore[attr-defined]
    before = list(interval)
    trial = study.ask()
    reports = TrialReports(study, trial, _db)
    assert interval[0] > before[0]  # relaxed while the trial trains
    reports.report(1, 0.3)
    reports.close()
    assert interval == before
    assert not reports._thread.is_alive()
    assert not [t for t in threading.enumerate() if t.name == "hpsearch-reports"]


def _retry_with(study: optuna.Study, inherited: dict[int, float]) -> optuna.Trial:
    """A retry as Optuna's RetryFailedTrialCallback queues it (its try's values inherited),
    claimed by the next ask."""
    dist = optuna.distributions.FloatDistribution(0.0, 1.0)
    study.add_trial(
        optuna.trial.create_trial(
            state=optuna.trial.TrialState.WAITING,
            params={"x": 0.5},
            distributions={"x": dist},
            intermediate_values=inherited,
        )
    )
    trial = study.ask()
    assert trial._cached_frozen_trial.intermediate_values == inherited
    return trial


@pytest.mark.parametrize("pruner", ["median", "hyperband"])
@pytest.mark.parametrize("gap", [True, False], ids=["unreported", "reported"])
def test_a_retry_reporting_its_last_restored_epoch_decides_as_optuna(
    twin_urls: tuple[str, str], tmp_path: Path, pruner: str, gap: bool
) -> None:
    """What the trainer does on resuming (trial._report_restored): the last restored epoch
    is reported again. Unreported (its try died before the write), it is written; already
    stored, it stays as it was even with another value, as Optuna ignores a repeated step.
    Either way the pruner's answer and its rung records are Optuna's own."""
    optunas = _study_with_history(twin_urls[0], tmp_path, pruner)
    ours = _study_with_history(twin_urls[1], tmp_path, pruner)
    throttle_trial_reads(ours)
    low = [0.05, 0.1, 0.1]  # below every finished curve: the median pruner stops it at 3
    inherited = dict(enumerate(low[: 2 if gap else 3], 1))
    a, b = _retry_with(optunas, inherited), _retry_with(ours, inherited)
    assert a.number == b.number  # the same Hyperband bracket on both sides
    epoch, value = 3, (low[2] if gap else 0.99)
    with TrialReports(ours, b, _db) as reports:
        got = reports.report(epoch, value)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # Optuna's "already reported"
        a.report(value, epoch)
    assert got == a.should_prune()
    values, rungs = _stored(ours, b._trial_id)
    assert values == dict(enumerate(low, 1))
    assert (values, rungs) == _stored(optunas, a._trial_id)
    if pruner == "median":
        assert got  # a stored 0.99 would have let it go on


def test_no_trial_is_pruned_at_its_last_epoch(tmp_path: Path) -> None:
    """QA: a trial pruned at budget.max_epochs had paid for every epoch and lost its value,
    its best model and its place among the completed (as plain Optuna does it). Its last
    value is recorded, never judged; an earlier epoch is judged as Optuna's pruner does."""
    spec = StorageSpec("journal", str(tmp_path / "optuna.journal"), "journal")
    pruner = optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=0)
    study = optuna.create_study(storage=open_storage(spec), direction="maximize", pruner=pruner)
    for _ in range(2):
        good = study.ask()
        for epoch in (1, 2, 3):
            good.report(0.9, epoch)
        study.tell(good, 0.9)
    poor = study.ask()
    with TrialReports(study, poor, _db, last_step=3) as reports:
        assert [reports.report(epoch, 0.1) for epoch in (2, 3)] == [True, False]
    assert study._storage.get_trial(poor._trial_id).intermediate_values == {2: 0.1, 3: 0.1}
    poor.report(0.1, 3)  # Optuna's own, on the same values: pruned there
    assert poor.should_prune()
