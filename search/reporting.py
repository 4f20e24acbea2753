"""A trial's per-epoch report and pruning decision, kept off the training thread's clock.

Optuna's `trial.report` + `trial.should_prune` wait on the database on the calling thread
every epoch: the write of the value, then what the pruner reads. The median pruner re-reads
the study's trials. Hyperband's bracket builds a new `Study` (the study's id and
directions: two queries) and reads the trial's system attributes. That is one to four round
trips between two epochs, about 8–10 ms on the 2-core CI machine (docs/performance.md),
which is a fifth of a 50 ms epoch of small images on a fast GPU.

Here the training thread only:
- records the value in the trial's own cached copy and queues its write;
- asks the study's own pruner, on this process's view of the study: the other trials as of
  the latest refresh, and this trial's values and system attributes as this process wrote
  them (Hyperband's rung records included: they are queued like the values).

A writer thread writes the queued values in order, with the worker's retry on a lost
connection. After each write, and every `max_age_s / 2` while an epoch runs, it refreshes
the view of the other trials (at most every `TRIALS_REFRESH_S`, as before). So a decision
sees the others as of a moment before, never older than `max_age_s` (5 s) while the
database answers. When the view is older than that, the training thread reads the trials
itself, with the same retry.

At most one report's writes are in flight: a report first waits for the previous one's.
Normally they were done an epoch ago and it does not wait. While the database is away,
training runs one epoch on the view it has, then waits at the next report, as it did when
the write was made on the training thread; checkpoints never get more than one epoch ahead
of the stored values.

`close()` waits for every write. The worker tells Optuna only after it, so the database
holds every reported value before the trial is finished. A write that fails for good (the
database gone past the outage limit, or the trial finished elsewhere) is raised by the
next report, or by `close()` when no report came after it. A refresh that fails is only
logged (once per outage) and skipped: it is a read, and a decision on a view too old reads
the trials itself. An outage during a long epoch, over before the next report, costs
nothing.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

import optuna
from hpsearch.errors import StorageError
from hpsearch.storage import TRIALS_REFRESH_S, refresh_trials_now, relaxed_trial_reads
from sqlalchemy.exc import SQLAlchemyError

# The epoch a multi-objective trial reached (no intermediate values there); `status` reads it.
ATTR_LAST_EPOCH = "last_epoch"
VIEW_MAX_AGE_S = 5.0  # seconds the other trials' view may lag a pruning decision

Db = Callable[[Callable[[], Any], str], Any]  # runs a storage call with the retry policy
Job = tuple[Callable[[], Any], str]  # (storage call, what it is, for the error message)

logger = logging.getLogger(__name__)


class _PruneStorage:
    """The storage as the pruner sees it while it decides.

    The study's identity and this trial's system attributes come from this process, and
    the pruner's writes to this trial go to the writer thread; anything else is the real
    storage. Hyperband's bracket study is built on this object, so its `Study.__init__`
    asks here for the study's id and directions instead of the database.
    """

    def __init__(
        self,
        real: Any,
        study: optuna.Study,
        trial_id: int,
        attrs: dict[str, Any],
        submit: Callable[[Job], None],
    ) -> None:
        self._real = real
        self._study_name = study.study_name
        self._study_id = study._study_id
        self._directions = list(study.directions)
        self._trial_id = trial_id
        self._attrs = attrs
        self._submit = submit

    def get_study_id_from_name(self, study_name: str) -> int:
        if study_name == self._study_name:
            return self._study_id
        return int(self._real.get_study_id_from_name(study_name))

    def get_study_directions(self, study_id: int) -> list[Any]:
        if study_id == self._study_id:
            return list(self._directions)
        return list(self._real.get_study_directions(study_id))

    def get_trial_system_attrs(self, trial_id: int) -> dict[str, Any]:
        if trial_id == self._trial_id:
            return dict(self._attrs)
        return dict(self._real.get_trial_system_attrs(trial_id))

    def set_trial_system_attr(self, trial_id: int, key: str, value: Any) -> None:
        if trial_id != self._trial_id:
            self._real.set_trial_system_attr(trial_id, key, value)
            return
        self._attrs[key] = value
        real = self._real
        self._submit((lambda: real.set_trial_system_attr(trial_id, key, value), "prune"))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class TrialReports:
    """`report(epoch, value) -> should_stop` for one trial, as described in the module doc.

    Use as a context manager around the trainer's call, or call `close()`.
    `max_age_s`: how old the view of the other trials may get before the training thread
    reads them itself; the writer thread refreshes it every half of that while the trial
    trains.
    """

    def __init__(
        self, study: optuna.Study, trial: optuna.Trial, db: Db, max_age_s: float = VIEW_MAX_AGE_S,
        last_step: int | None = None,
    ) -> None:  # fmt: skip
        """`last_step`: the trial's last epoch (budget.max_epochs), whose value is recorded
        but never judged: a trial pruned there had paid for every epoch, and lost its
        value, its best model and its place among the completed (as plain Optuna does)."""
        self._last_step = last_step
        self._study = study
        self._trial = trial
        self._db = db
        self._max_age_s = max_age_s
        self._multi = len(study.directions) > 1
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._error: Exception | None = None  # the first write that failed for good
        self._raised = False
        self._refresh_failing = False  # the latest refresh failed: warned once already
        storage = study._storage
        tid = trial._trial_id
        # Read once, before training: the sampler and the worker wrote this trial's system
        # attributes since it was created. Afterwards only this process writes them.
        self._attrs = dict(db(lambda: storage.get_trial_system_attrs(tid), "get_trial"))
        view = optuna.Study.__new__(type(study))
        view.__dict__.update(study.__dict__)
        view._storage = _PruneStorage(storage, study, tid, self._attrs, self._submit)  # type: ignore[assignment]
        self._view = view
        self._thread = threading.Thread(target=self._write, name="hpsearch-reports", daemon=True)
        self._thread.start()
        self._relaxed = contextlib.ExitStack()
        self._relaxed.enter_context(relaxed_trial_reads(study, max_age_s))

    def __enter__(self) -> TrialReports:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __call__(self, epoch: int, value: float) -> bool:
        return self.report(epoch, value)

    def report(self, epoch: int, value: float) -> bool:
        """Record `value` at `epoch` and return whether the study's pruner stops the trial."""
        step, value = int(epoch), float(value)
        if step < 0:
            raise ValueError(f"report: epoch {step} must be non-negative")
        if self._multi:
            # Optuna keeps no intermediate values for multi-objective studies and prunes
            # none: the epoch reached goes in a user attribute, for `hpsearch status`.
            self._jobs.join()
            self._raise_failure(again=True)
            storage, tid = self._study._storage, self._trial._trial_id
            self._submit(
                (lambda: storage.set_trial_user_attr(tid, ATTR_LAST_EPOCH, step), "report")
            )
            return False
        # At most one report's writes in flight: while the database is away, training (and
        # its checkpoints) runs at most one epoch ahead of the stored values, then waits
        # here as it did when the write was made on this thread. Normally the previous
        # epoch's writes were done long ago and this does not wait.
        self._jobs.join()
        self._raise_failure(again=True)
        cached = self._trial._cached_frozen_trial
        if step not in cached.intermediate_values:  # Optuna ignores a repeated step
            cached.intermediate_values[step] = value
            storage, tid = self._study._storage, self._trial._trial_id
            self._submit((lambda: storage.set_trial_intermediate_value(tid, step, value), "report"))
        if self._last_step is not None and step >= self._last_step:
            return False  # trained to its end: nothing left to save

        def decide() -> bool:
            frozen = copy.copy(cached)
            frozen.system_attrs = dict(self._attrs)
            return bool(self._study.pruner.prune(self._view, frozen))

        # The pruner reads the database only when the view is older than max_age_s (the
        # writer could not refresh it: an outage); that read gets the usual retry. It
        # fails before the pruner's own writes, so running it again decides the same.
        return bool(self._db(decide, "should_prune"))

    def close(self) -> None:
        """Wait for every queued write; raise the first one that failed for good."""
        try:
            if self._thread.is_alive():
                self._jobs.put(None)
                self._thread.join()
        finally:
            self._relaxed.close()
        self._raise_failure()

    def _raise_failure(self, again: bool = False) -> None:
        if self._error is not None and (again or not self._raised):
            self._raised = True
            raise self._error

    def _submit(self, job: Job) -> None:
        self._jobs.put(job)

    def _write(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=self._max_age_s / 2)
            except queue.Empty:  # a long epoch: keep the view within max_age_s
                self._refresh()
                continue
            try:
                if job is None:
                    return
                self._run(job)
            finally:
                self._jobs.task_done()  # a waiting report waits for the write, not the refresh
            if self._jobs.empty():  # one refresh after a burst of writes
                self._refresh()

    def _run(self, job: Job) -> None:
        if self._error is not None:
            return  # after a failure nothing more is written; close() raises it
        fn, what = job
        try:
            self._db(fn, what)
        except Exception as exc:  # re-raised on the training thread
            self._error = exc

    def _refresh(self) -> None:
        """Bring the view of the other trials up to date, at most as often as any read of
        this process's (TRIALS_REFRESH_S): a trial that reports several times a second adds
        no database load.

        A refresh is a read that nothing waits on: one the database fails (past the outage
        limit too) is skipped, not kept for the next report to raise, which would end a
        trial for an outage that was over before it reported. A decision on a view older
        than max_age_s reads the trials itself, with the retry, and raises there if the
        database is still away."""
        if self._error is not None:
            return  # the trial is failing anyway: close() raises the write's error
        try:
            self._db(lambda: refresh_trials_now(self._study, TRIALS_REFRESH_S), "refresh trials")
        except (StorageError, SQLAlchemyError, optuna.exceptions.StorageInternalError) as exc:
            if not self._refresh_failing:  # once per outage, not every max_age_s / 2
                logger.warning(
                    "trial %d: cannot refresh the other trials' view, training goes on "
                    "(a pruning decision reads them itself): %s",
                    self._trial.number,
                    exc,
                )
            self._refresh_failing = True
            return
        except Exception as exc:  # not the database's: a fault, raised on the training thread
            self._error = exc
            return
        if self._refresh_failing:
            logger.info("trial %d: the other trials' view is refreshed again", self._trial.number)
        self._refresh_failing = False
