"""One worker process: ask a trial, train it, tell the result; repeat until the budget is spent.

Workers started by `hpsearch launch` and workers started by hand (`hpsearch worker` on other
machines) run this same loop against the same storage.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.machinery
import json
import logging
import math
import os
import re
import shutil
import socket
import sys
import threading
import time
import traceback
import uuid
import warnings
import zlib
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

import optuna
from hpsearch.config import StudyConfig, find_study_file, is_shipped
from hpsearch.errors import (
    ConfigError,
    DatasetError,
    DiskFullError,
    HpsearchError,
    HpsearchWarning,
    StorageError,
    TrackingUnreachable,
)
from hpsearch.packing import AdmissionStopped, holder_alive, pid_alive, process_start
from hpsearch.reporting import TrialReports
from hpsearch.storage import (
    HeartbeatStorage,
    StorageSpec,
    _one_line,
    count_trials_sql,
    deferred_params,
    heartbeat_storage,
    open_storage_when_up,
    refresh_trials_now,
    set_trial_attrs,
    study_lock,
    tell,
    throttle_trial_reads,
    with_db_retry,
)
from hpsearch.study import (
    ATTR_FAILED_HOST,
    ATTR_UNFIT,
    CONFIG_ATTR,
    CONFIG_ID_ATTR,
    LATE_RUN_ATTR,
    MEMORY_CONSTRAINT,
    budget_counts,
    check_classes,
    config_drift,
    create_or_load,
    enqueue_trials,
    make_sampler,
    may_start_trial,
    objective_values,
    pareto_front,
    retry_params,
    study_budget,
    study_uid,
    suggest,
    trial_config_id,
    trials_before,
)
from hpsearch.trainer.types import best_model_path_for
from optuna.storages import BaseStorage, RetryHeartbeatStaleTrialCallback
from optuna.trial import FrozenTrial, TrialState
from sqlalchemy.exc import SQLAlchemyError

logger = logging.getLogger("hpsearch.tracking")

# Optuna user attributes a trial carries (read by `status`, the launcher and the query API).
ATTR_WORKER = "worker"
ATTR_HOST = "host"
ATTR_PID = "pid"
# The worker's process start (clock ticks since boot): with the PID it names the process,
# where a relaunch's new workers may get a killed launch's PIDs (a container restart).
ATTR_PID_START = "pid_start"
ATTR_OUTCOME = "outcome"
ATTR_MESSAGE = "message"
ATTR_RUN_ID = "mlflow_run_id"
ATTR_RUN_KEY = "mlflow_run_key"  # tags the try's MLflow run: found again if never linked
ATTR_CHECKPOINT = "checkpoint"
ATTR_BEST_MODEL = "best_model"
ATTR_HISTORY = "history"
ATTR_TEST_ACC = "test_acc"
ATTR_RESUMED_FROM = "resumed_from_epoch"
ATTR_STARTUP = "startup_s"
ATTR_THREADS = "torch_threads"  # torch's intra-op CPU threads the trial trained with
ATTR_CHECKPOINT_URI = "checkpoint_uri"  # the best model in MLflow


class TrainFn(Protocol):
    def __call__(
        self,
        config: StudyConfig,
        params: Mapping[str, Any],
        report: Callable[[int, float], bool],
        options: Any,
    ) -> Any: ...


@dataclass(frozen=True)
class WorkerOptions:
    workdir: Path
    worker_id: str = ""
    device: str = "auto"
    tracking_uri: str | None = None
    embedded_tracking: bool = False  # tracking_uri is the work folder's embedded server
    max_trials: int | None = None  # this worker stops after so many trials
    timeout_s: float | None = None  # stop asking after this many seconds
    deadline: float | None = None  # or at this time.time(): the launcher's, start-up included
    await_study_run_s: float = 0.0  # launched: wait so long for the launcher's MLflow study run
    server_answered: bool = False  # launched: its MLflow server answered before this worker
    heartbeat_interval_s: int = 10  # PostgreSQL only; stale after 2x
    max_retries: int = 2  # retries of a trial whose worker died or was interrupted
    max_errors: int = 3  # trials in a row failing with an exception: the worker gives up
    db_outage_limit_s: float = 120.0
    train_fn: str = ""  # "module:function"; empty = hpsearch.trainer.train
    set_budget: bool = False  # record config.budget.n_trials on the study (worker --trials)
    packing: Path | None = None  # --workers auto plan: reserve GPU memory before each trial
    sampler_stream: int | None = None  # study.sampler_seed's stream; None: one of its own
    joined: bool = False  # a worker of its own, not a launch's: told when it trains otherwise
    launched: bool = False  # a launch's worker: its launch gives the study its uid

    def resolved_id(self) -> str:
        return self.worker_id or f"{socket.gethostname()}:{os.getpid()}"

    def stream(self) -> int:
        """The launcher numbers its workers' streams; a worker started on its own takes one
        from its name and process, so neither a second worker nor a restart repeats it."""
        if self.sampler_stream is not None:
            return self.sampler_stream
        return 1 + zlib.crc32(f"{self.resolved_id()}:{os.getpid()}".encode())


@dataclass
class TrialTiming:
    """Where one trial's wall time went, as this worker saw it (milliseconds unless `_s`).

    Appended as one JSON line per trial to `<workdir>/timings/<worker>.jsonl`; the
    benchmarks read these, and `startup_s` is the per-trial start-up overhead.
    """

    trial: int
    worker: str
    ask_ms: float  # study lock + budget check + ask
    # Two studies' workers in one work folder share names (`host:w0`) and so a file (QA).
    study: str = ""
    suggest_ms: float = 0.0
    startup_s: float = 0.0  # ask start to the first training step (incl. trainer set-up)
    report_ms: list[float] = field(default_factory=list)  # per epoch: report + should_prune
    log_ms: list[float] = field(default_factory=list)  # per epoch: hand-off to MLflow thread
    admission_wait_s: float = 0.0  # waiting for GPU memory beside packed trials
    # The trainer's call, split: set-up (data, model); its epochs, each up to the end of its
    # last report or log callback (train, val, report, checkpoint hand-off, logging); and the
    # finish after the last epoch's callbacks (test pass, the best model's write). A call
    # that ends inside its first epoch (out of memory, say) is all set-up and epochs.
    setup_s: float = 0.0
    epochs_s: float = 0.0
    finish_s: float = 0.0
    tell_ms: float = 0.0  # result attributes + tell
    trial_s: float = 0.0


def append_timing(workdir: Path, timing: TrialTiming) -> None:
    """Best effort: a full disk must not fail a trial."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in timing.worker)
    try:
        path = workdir / "timings" / f"{safe}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as fh:
            fh.write(json.dumps(asdict(timing)) + "\n")
    except OSError as exc:
        warnings.warn(f"could not record trial timings: {exc}", HpsearchWarning, stacklevel=2)


@dataclass
class WorkerSummary:
    worker_id: str
    trials: list[int] = field(default_factory=list)
    outcomes: dict[str, int] = field(default_factory=dict)
    stopped_by: str = "budget"
    last_error: str = ""  # the last failed trial's message: what "repeated errors" were


MIN_FREE_BYTES = 64 << 20  # a trial writes checkpoints and a best model (45 MB: ResNet-18)


def free_disk_bytes(folder: Path) -> int | None:
    """Bytes an unprivileged process may still write on `folder`'s file system; None when
    it cannot be told (the trial's own writes will say)."""
    try:
        st = os.statvfs(folder)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _disk_need_path(workdir: Path, study: str) -> Path:
    return workdir / "run" / f"{study}.disk-need"


def _record_disk_need(workdir: Path, study: str, need: int | None) -> None:
    """Best effort: the largest file a trial of the study found no room for (bytes), which
    `disk_stop` asks room for twice over (a checkpoint and a best model) from then on."""
    if not need:
        return
    path = _disk_need_path(workdir, study)
    try:
        known = int(path.read_text() or 0)
    except (OSError, ValueError):
        known = 0
    with contextlib.suppress(OSError):  # the disk may have no room for these bytes either
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(str(max(need, known)))


def _clear_disk_need(workdir: Path, study: str) -> None:
    with contextlib.suppress(OSError):
        _disk_need_path(workdir, study).unlink(missing_ok=True)


def disk_stop(workdir: Path, study: str) -> str | None:
    """Why no trial of `study` should start with the work folder's checkpoints where they
    are, or None: their disk read-only, or with under `MIN_FREE_BYTES` free, or under twice
    the largest file a trial of the study found no room for there (QA: restarted at 71 MiB
    free for 85 MiB checkpoints, the worker trained and failed the same trial each time)."""
    try:
        need = 2 * int(_disk_need_path(workdir, study).read_text() or 0)
    except (OSError, ValueError):
        need = 0
    folder = workdir / "checkpoints"
    folder = folder if folder.is_dir() else workdir
    try:
        read_only = bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    if read_only:  # QA: trials trained for minutes each, then failed on their first save
        return (
            f"work folder {folder}: its disk is read-only; make it writable and launch again "
            "(queued trials resume)"
        )
    full = disk_full(folder, free_disk_bytes(folder), max(MIN_FREE_BYTES, need))
    if full and need > MIN_FREE_BYTES:
        full += (
            f"; twice the file a trial could not write there, as {_disk_need_path(workdir, study)}"
            " says until a trial of the study ends with room"
        )
    return full


def disk_full(folder: Path, free: int | None, min_free: int = MIN_FREE_BYTES) -> str | None:
    """Why no trial should start with `free` bytes left where `folder` is, or None."""
    if free is None or free >= min_free:
        return None
    return (
        f"work folder {folder}: {free / 2**20:.0f} MiB free on its disk, under the "
        f"{min_free >> 20} MiB a trial's checkpoints need; free some and launch again "
        "(queued trials resume)"
    )


def _error_message(study: optuna.Study, trial: optuna.Trial) -> str:
    """A failed trial's recorded message (one line), for the worker's output: its log had
    only "trial N: error", and a full disk's cause was in the study alone. Empty when the
    storage cannot say."""
    try:
        attrs = study._storage.get_trial(trial._trial_id).user_attrs
    except (optuna.exceptions.OptunaError, SQLAlchemyError, OSError, KeyError):
        return ""
    return " ".join(str(attrs.get(ATTR_MESSAGE, "")).split())[:300]


def check_train_fn(spec: str) -> None:
    """A launch's check of `--train-fn MODULE:FUNCTION` before its workers start, without
    importing anything (a package's import may be heavy, or act): its form, and that the
    module, each package of its dotted name in its parent's folders, is found where the
    workers look (`python -m` puts the current folder first; the launcher's own sys.path
    starts with its console script's folder). Each worker restarted three times on a typo;
    a misspelled function is the worker's to find (exit EXIT_CONFIG, not restarted).
    Raises HpsearchError."""
    if not spec:
        return
    module, _, name = spec.partition(":")
    if not module or not name:
        raise HpsearchError(f"--train-fn: {spec!r}: expected MODULE:FUNCTION")
    top = module.split(".")[0]
    if not top.isidentifier():
        raise HpsearchError(f"--train-fn: {spec!r}: {module!r} is not a module name")
    if top in sys.modules or top in sys.builtin_module_names:
        return
    where: list[str] | None = [os.getcwd(), *(p for p in sys.path if p)]
    parts = module.split(".")
    for i in range(len(parts)):  # each package's own folders, none of them imported
        name = ".".join(parts[: i + 1])
        try:
            found = importlib.machinery.PathFinder.find_spec(name, where)
        except Exception:  # an odd path entry: the workers' import will say
            return
        if found is None:
            raise HpsearchError(
                f"--train-fn: {spec!r}: no module named {name!r}"
                + (" on the Python path (PYTHONPATH, the current folder)" if i == 0 else "")
            )
        where = list(found.submodule_search_locations or [])


def load_train_fn(spec: str) -> TrainFn:
    if not spec:
        from hpsearch.trainer import train

        return train
    module, _, name = spec.partition(":")
    if not module or not name:
        raise HpsearchError(f"--train-fn: {spec!r}: expected MODULE:FUNCTION")
    try:
        fn = getattr(importlib.import_module(module), name)
    except Exception as exc:  # the module's own import may raise anything (SyntaxError...)
        raise HpsearchError(
            f"--train-fn: {spec!r}: cannot import: {type(exc).__name__}: {exc}"
        ) from exc
    if not callable(fn):
        raise HpsearchError(f"--train-fn: {spec!r}: {type(fn).__name__} is not callable")
    return cast(TrainFn, fn)


def check_result(result: object) -> None:
    """A train function returns a `hpsearch.trainer.TrialResult` with a known
    `stop_reason`; anything else fails its trial with this message rather than the worker
    (an unknown reason made the trial COMPLETE and its MLflow run FAILED)."""
    from typing import get_args

    from hpsearch.trainer import TrialResult
    from hpsearch.trainer.types import StopReason

    if not isinstance(result, TrialResult):
        raise HpsearchError(
            f"the train function returned {type(result).__name__}, not a TrialResult"
        )
    if result.stop_reason not in get_args(StopReason):
        raise HpsearchError(
            f"the train function's stop_reason: {result.stop_reason!r}: must be one of "
            f"{', '.join(get_args(StopReason))}"
        )


def effective_params(result: Any) -> dict[str, Any]:
    """The lr and batch size a trial's trainer used (its `TrialResult`'s), as numbers; none
    that a custom trainer's result leaves out (None) or gives as no positive number."""
    out: dict[str, Any] = {}
    for name, kind in (("effective_lr", float), ("effective_batch_size", int)):
        value = plain(getattr(result, name, None))
        if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
            out[name] = kind(value)
    return out


def plain(value: Any) -> Any:
    """`value` as JSON's kinds of Python values: a numpy or torch scalar as its number (a
    custom trainer's epoch record of tensors failed its trial at the tell, every epoch
    trained), lists and mappings element-wise, anything else as its text."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    item = getattr(value, "item", None)
    if callable(item):
        try:
            return plain(item())
        except (TypeError, ValueError, RuntimeError):  # an array of several: its text
            pass
    return str(value)


# s: a checkpoint temp file untouched this long is no live write's (a save takes seconds).
STALE_TEMP_S = 600.0
_TEMP_NAME = re.compile(r"^\..+\.(\d+)\.tmp$")  # atomic_save's `.<name>.<pid>.tmp`


def stale_temp_files(folder: Path, now: float) -> list[Path]:
    """The checkpoint and best-model temp files in `folder` that a killed writer left (a
    second Ctrl-C, SIGKILL): its process gone from this host and the file untouched for
    STALE_TEMP_S (`now`: time.time()), so that a live write of another host sharing the
    folder is left alone. Nothing removed them, and a best model's can be large."""
    found: list[Path] = []
    try:
        entries = list(folder.iterdir())
    except OSError:  # no folder yet
        return found
    for path in entries:
        m = _TEMP_NAME.match(path.name)
        # A number no process can have (os.kill would overflow) is not a writer's pid.
        if m is None or not 0 < int(m[1]) < 2**22 or int(m[1]) == os.getpid():
            continue
        if pid_alive(int(m[1])):
            continue
        try:
            if now - path.stat().st_mtime >= STALE_TEMP_S:
                found.append(path)
        except OSError:  # removed meanwhile
            continue
    return sorted(found)


def checkpoint_path(
    workdir: Path, study: str, root_trial: int, inherited: str | None = None
) -> Path:
    """A retry chain's resume checkpoint in this host's work folder. A retry takes the file
    name its chain's first try recorded (`inherited`, the failed try's `checkpoint`
    attribute, written before it trained: a chain without one has no file). Otherwise the
    try names a file of its own, `trial-<root>-<random>.pt`: `trial-<root>.pt` was every
    same-name study's, and a file another left there (another storage, or a study deleted
    and made again) was resumed from, or refused as another's."""
    folder = workdir / "checkpoints" / study
    if inherited:
        return folder / Path(inherited).name
    return folder / f"trial-{root_trial:05d}-{uuid.uuid4().hex[:8]}.pt"


def adopt_checkpoint(inherited: Path, ckpt: Path) -> bool:
    """Move a retry chain's resume checkpoint and best model from where its failed try of
    this host wrote them (`inherited`, absolute: another work folder) to `ckpt`, when
    `ckpt` has none. Whether it moved. A file that cannot be moved is left where it is (the
    retry trains from its start, as before)."""
    if not inherited.is_absolute() or ckpt.exists() or not inherited.is_file():
        return False  # a path of old, this folder's own, or a try that never saved
    try:
        ckpt.parent.mkdir(parents=True, exist_ok=True)
        best = best_model_path_for(inherited)
        if best.is_file():  # first: the checkpoint refers to it
            shutil.move(best, best_model_path_for(ckpt))
        shutil.move(inherited, ckpt)
    except OSError as exc:
        logger.warning("resume checkpoint %s not taken: %s", inherited, exc)
        return False
    logger.info("resuming from %s (its failed try's, moved here)", inherited)
    return True


def _failed_host(trial: optuna.Trial) -> str | None:
    """The host a retry's failed try ran on (None for a trial that is no retry). It was
    read from the retry's own ATTR_HOST: stripped at the re-queue, and on a journal already
    the claiming worker's, so a retry taken in another work folder of that host trained
    again from epoch 1 on PostgreSQL."""
    cached = getattr(trial, "_cached_frozen_trial", None)
    frozen = cached if cached is not None else trial.study._storage.get_trial(trial._trial_id)
    host = frozen.system_attrs.get(ATTR_FAILED_HOST)
    return str(host) if host else None


def root_trial_number(trial: optuna.Trial | optuna.trial.FrozenTrial) -> int:
    """The first trial of a retry chain (Optuna's RetryHeartbeatStaleTrialCallback records it)."""
    if isinstance(trial, optuna.Trial):
        # The frozen copy taken at ask holds the retry's system attributes; re-reading a
        # running trial would cost a round trip of several queries.
        cached = getattr(trial, "_cached_frozen_trial", None)
        trial = cached if cached is not None else trial.study._storage.get_trial(trial._trial_id)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        root = RetryHeartbeatStaleTrialCallback.retried_trial_number(trial)
    return int(root) if root is not None else trial.number


# System attr of a retry: how many tries of its chain were handed back unfinished by a stop
# asked for (Ctrl-C, SIGTERM, a stop while waiting for GPU memory), not lost to a crash.
ATTR_INTERRUPTED_TRIES = "hpsearch:interrupted_tries"
# A try's own attributes, which its retry does not inherit.
# Its results too: a retry told without them (no test pass, no upload) showed the failed
# try's test accuracy and checkpoint.


def worker_alive(attrs: Mapping[str, Any]) -> bool | None:
    """Whether the worker process a trial's attributes name (host, pid and its start) still
    runs; None where this host cannot tell: another host's trial, or one no worker named
    itself on yet."""
    pid, start = attrs.get(ATTR_PID), attrs.get(ATTR_PID_START)
    if attrs.get(ATTR_HOST) != socket.gethostname() or not isinstance(pid, int):
        return None
    return holder_alive(pid, start if isinstance(start, int) else None)


TRY_ATTRS = frozenset({ATTR_WORKER, ATTR_HOST, ATTR_PID, ATTR_PID_START, ATTR_OUTCOME,
                       ATTR_MESSAGE, ATTR_TEST_ACC, ATTR_HISTORY, ATTR_BEST_MODEL,
                       ATTR_STARTUP, ATTR_CHECKPOINT_URI, ATTR_THREADS})  # fmt: skip


class ChainRetryCallback(RetryHeartbeatStaleTrialCallback):
    """Optuna's retry of a failed trial, whose `max_retry` counts crashes only: a try handed
    back by a stop asked for is no failure of the trial's (three Ctrl-C's used up the default
    retries, and the fourth try's trained epochs were lost). The chain's interrupted tries
    are carried in `ATTR_INTERRUPTED_TRIES` and added to the limit."""

    def __call__(self, study: optuna.Study, trial: FrozenTrial) -> None:
        self.requeue(study, trial, interrupted=False)

    def requeue(self, study: optuna.Study, trial: FrozenTrial, interrupted: bool) -> bool:
        """Queue the trial's retry; False when its chain has used up its retries."""
        # The retry names no owner and no outcome until a worker takes it up: the failed
        # try's made a live retry look like the dead worker's (a crash of that worker's
        # slot failed it), and a retry failed by the stale check look handed back.
        user_attrs = {k: v for k, v in trial.user_attrs.items() if k not in TRY_ATTRS}
        attrs: dict[str, Any] = {"failed_trial": trial.number, **trial.system_attrs}
        attrs.pop(ATTR_UNFIT, None)  # a launch's mark of a trial it failed unrun: it ran
        # A new list: Optuna's appends to the failed trial's own, which a cached storage
        # hands out uncopied.
        attrs["retry_history"] = [*attrs.get("retry_history", []), trial.number]
        tries = int(attrs.get(ATTR_INTERRUPTED_TRIES, 0)) + int(interrupted)
        attrs[ATTR_INTERRUPTED_TRIES] = tries
        # A try that died before it took the trial (no host of its own) left the checkpoint
        # it inherited: that one's host stays.
        attrs[ATTR_FAILED_HOST] = trial.user_attrs.get(ATTR_HOST) or attrs.get(ATTR_FAILED_HOST)
        limit = self._max_retry
        if limit is not None and limit + tries < len(attrs["retry_history"]):
            return False
        study.add_trial(
            optuna.create_trial(
                state=TrialState.WAITING,
                params=trial.params,
                distributions=trial.distributions,
                user_attrs=user_attrs,
                system_attrs=attrs,
                intermediate_values=(
                    trial.intermediate_values if self._inherit_intermediate_values else None
                ),
            )
        )
        return True


def retry_callback(max_retries: int) -> ChainRetryCallback:
    """Re-queues a failed trial's params (after at most `max_retries` crashes per chain)
    with its intermediate values, so the resumed retry prunes exactly as the original would
    have."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return ChainRetryCallback(max_retry=max_retries, inherit_intermediate_values=True)


def retried_trials(study: optuna.Study, numbers: Sequence[int]) -> set[int]:
    """Those of trial `numbers` a retry was queued for (Optuna's RetryFailedTrialCallback
    gives a retry the `retry_history` of its chain; retries come after their trials)."""
    wanted = set(numbers)
    found: set[int] = set()
    refresh_trials_now(study)  # a retry queued a moment ago, maybe by this process's own try
    for t in study.get_trials(deepcopy=False):
        # A retry's history names every earlier trial of its chain. The callback appends to
        # the failed trial's own list, which a cached storage hands out uncopied: a trial's
        # history may hold its own number, and a retry's the numbers after it.
        history = t.system_attrs.get("retry_history") or []
        found |= {n for n in history if n in wanted and n < t.number}
    return found


# Held while a trial handed back is failed and its retry queued (two commits): a second
# Ctrl-C, which kills a worker at once (cli._on_signals), waits for it, or the trial would
# be left failed with no retry. One attempt at a time: not across a database outage.
HANDBACK = threading.Lock()


def _fail_and_requeue(
    study: optuna.Study,
    trial: optuna.Trial,
    db: Db,
    max_retries: int,
    lock: Callable[[], contextlib.AbstractContextManager[Any]],
) -> None:
    """Fail a trial handed back unfinished (interrupted, or stopped waiting for GPU memory)
    and queue its params to resume, under the study lock: the two are separate commits, and
    a worker asking between them saw a free place in the budget and started a trial beyond
    it (as launcher.fail_trial, and the stale check). A retry already queued (a commit whose
    reply was lost, run again) is not queued twice."""

    def locked() -> None:  # run again whole, lock and reads included, after a db error
        with HANDBACK, lock():
            try:
                tell(study, trial, state=TrialState.FAIL)
            except (optuna.exceptions.UpdateFinishedTrialError, ValueError) as exc:
                if not _finished_elsewhere(exc):  # else: by a try of this (its reply lost)
                    raise
            frozen = study._storage.get_trial(trial._trial_id)
            if not retried_trials(study, [frozen.number]):
                retry_callback(max_retries).requeue(study, frozen, interrupted=True)

    db(locked, "fail and re-queue")


def heartbeat_timing(interval_s: float) -> tuple[float, float, float]:
    """(beat period, grace period, stale-check period) in seconds for a heartbeat interval H.

    Beats every H/2 and a check every H/5 with a grace of 1.5 H detect a dead worker within
    1.7 H of its death (under 2 H with room for a slow database), while a live worker's
    beat may come a full H late before its trial is wrongly declared stale.
    """
    return interval_s / 2, interval_s * 1.5, interval_s / 5


class _Heartbeat:
    """Optuna records heartbeats only inside study.optimize; ask/tell needs its own."""

    def __init__(self, storage: BaseStorage, trial_id: int) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        beating = heartbeat_storage(storage)
        if beating is not None:
            period = heartbeat_timing(float(beating.get_heartbeat_interval() or 10))[0]
            self._thread = threading.Thread(
                target=self._beat, args=(beating, trial_id, period), daemon=True
            )
            self._thread.start()

    def _beat(self, storage: HeartbeatStorage, trial_id: int, period: float) -> None:
        # The claim recorded a beat under the budget lock, but building the Trial since
        # (the sampler reads every trial) can take seconds on a loaded machine: beat at once,
        # so that time never eats into the grace period of a live trial.
        while True:
            try:
                storage.record_heartbeat(trial_id)
            except Exception as exc:  # best effort: a missed beat only risks a retry
                warnings.warn(f"heartbeat failed: {_one_line(exc)}", HpsearchWarning, stacklevel=1)
            if self._stop.wait(period):
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


# Outcomes of a trial failed on purpose: its worker's error or hand-back, the launcher's
# failure of a dead worker's trial. A stale-failed trial has none, or the outcome its worker
# wrote just before a tell that never came.
FAILED_ON_PURPOSE = frozenset({"error", "interrupted", "failed"})


def dead_outcome(reason: str, interrupted: bool = False) -> str:
    """The outcome of a trial whose worker is gone, in Optuna and in MLflow alike:
    "interrupted" (KILLED) when it was stopped (a second stop's kill, or one past the
    grace, whose reason is "interrupted"), else "failed" (FAILED)."""
    return "interrupted" if interrupted or reason == "interrupted" else "failed"


# A trial's outcome in its worker (not stored: the trial stands as another worker failed it)
# when the stale check failed it while it trained.
STALE = "failed elsewhere (stale)"


def fail_stale_trials(study: optuna.Study, pending: dict[int, bool]) -> list[int]:
    """Optuna's `fail_stale_trials` (fail the trials whose heartbeat stopped, queue their
    retries), resumable: the failure and the retry are two commits, and where the database
    failed between them, Optuna's left the trial failed with no retry for good (it is no
    longer running, so no later check finds it). `pending` ({trial id: whether this
    watcher's FAIL of it may have committed}) holds the trials found stale whose retry was
    not yet seen queued; the caller keeps it across checks, each under the study lock.
    Only a trial stale now is failed. One from `pending` found failed, with no retry, gets
    its retry when this watcher's FAIL may have been the one, or when it was not failed on
    purpose (`FAILED_ON_PURPOSE`: those have their own retries). Returns the trials
    re-queued."""
    storage = study._storage
    stale_ids = getattr(storage, "_get_stale_trial_ids", None)  # Optuna's internal query
    if not callable(stale_ids):  # an Optuna without it: its own check, as it is
        optuna.storages.fail_stale_trials(study)
        return []
    callback = storage.get_heartbeat_stale_trial_callback()  # type: ignore[attr-defined]
    stale = set(stale_ids(study._study_id))
    for trial_id in stale:
        pending.setdefault(trial_id, False)
    queued = []
    for trial_id in sorted(pending):
        if trial_id in stale:
            pending[trial_id] = True  # from here its FAIL may commit (its reply lost, too)
            try:
                storage.set_trial_state_values(trial_id, state=TrialState.FAIL)
            except optuna.exceptions.UpdateFinishedTrialError:
                pending[trial_id] = False  # finished elsewhere meanwhile
        frozen = storage.get_trial(trial_id)
        if (
            callback is not None
            and frozen.state == TrialState.FAIL
            and (pending[trial_id] or frozen.user_attrs.get(ATTR_OUTCOME) not in FAILED_ON_PURPOSE)
            and not retried_trials(study, [frozen.number])
            and _requeued(callback, study, frozen)
        ):
            queued.append(frozen.number)
        del pending[trial_id]  # running again (its worker beats), finished, or queued
    return queued


def _requeued(callback: Any, study: optuna.Study, trial: FrozenTrial) -> bool:
    requeue = getattr(callback, "requeue", None)
    if requeue is not None:  # ours: says whether the chain had a retry left
        return bool(requeue(study, trial, interrupted=False))
    callback(study, trial)
    return True


class _StaleWatcher:
    """Fails and re-queues trials whose heartbeat stopped, even while this worker trains.

    After a database outage it fails nothing until the database has answered for `grace_s`
    (the heartbeat grace): during the outage no live worker could beat, and the checks come
    more often than the beats, so the first check after it would take every running trial
    for a dead one."""

    def __init__(
        self,
        study: optuna.Study,
        period_s: float,
        lock: Callable[[], contextlib.AbstractContextManager[Any]],
        grace_s: float = 0.0,
    ) -> None:
        # Once for the process, not per call: `catch_warnings` is not thread-safe, and every
        # filter change elsewhere re-arms a "default" warning, which then repeated in the
        # worker's log after each trial.
        warnings.filterwarnings(
            "ignore", r".*fail_stale_trials", optuna.exceptions.ExperimentalWarning
        )
        self._stop = threading.Event()
        self._lock = lock
        self._grace_s = grace_s
        self._pending: dict[int, bool] = {}  # found stale, retry not yet seen queued
        self.answering_since = -math.inf  # monotonic s; reset by a check the database failed
        self._thread = threading.Thread(target=self._run, args=(study, period_s), daemon=True)
        self._thread.start()

    def _run(self, study: optuna.Study, period_s: float) -> None:
        # Optuna's own stale query (internal; where it is gone, every check takes the lock).
        stale_ids = getattr(study._storage, "_get_stale_trial_ids", None)
        while not self._stop.wait(period_s):
            try:
                if not self._pending and callable(stale_ids) and not stale_ids(study._study_id):
                    self._answered()
                    continue  # nothing stale: the lock, which every ask queues on, is not taken
                if not self._answered():
                    continue  # just back from an outage: live workers beat again first
                # Under the study lock: a trial's failure and its retry's queueing are two
                # commits, and an ask between them would see a free place in the budget.
                with HANDBACK, self._lock():  # not cut by a second Ctrl-C either
                    fail_stale_trials(study, self._pending)
            except (SQLAlchemyError, optuna.exceptions.StorageInternalError, StorageError) as exc:
                self.answering_since = math.nan  # an outage: none failed until it is over
                warnings.warn(
                    f"stale-trial check failed: {_one_line(exc)}", HpsearchWarning, stacklevel=1
                )
            except Exception as exc:  # best effort: the next check or worker will retry
                warnings.warn(
                    f"stale-trial check failed: {_one_line(exc)}", HpsearchWarning, stacklevel=1
                )

    def _answered(self) -> bool:
        """The database answered a check: whether it has for the grace period."""
        now = time.monotonic()
        if math.isnan(self.answering_since):
            self.answering_since = now
        return now - self.answering_since >= self._grace_s

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def connect(cfg: StudyConfig, spec: StorageSpec, opts: WorkerOptions) -> optuna.Study:
    rdb = spec.kind == "rdb"
    _, grace, _ = heartbeat_timing(opts.heartbeat_interval_s)
    storage = open_storage_when_up(
        spec,
        opts.db_outage_limit_s,
        heartbeat_interval=opts.heartbeat_interval_s if rdb else None,
        grace_period=grace if rdb else None,
        failed_trial_callback=retry_callback(opts.max_retries),
    )
    study = with_db_retry(
        lambda: create_or_load(cfg, storage, owner=False, budget=opts.set_budget),
        what="create study",
    )
    if not opts.launched:  # maybe the study's first worker (a launch's: the launch gives it)
        with_db_retry(
            lambda: study_uid(study, mint=True, lock=lambda: study_lock(spec, cfg.name)),
            what="study uid",
        )
    launched = study.user_attrs.get(CONFIG_ATTR)
    if opts.joined and launched and (drift := config_drift(cfg, str(launched))):
        # Allowed (a quick check at other settings), but its values will not compare.
        shown = "; ".join(drift[:6]) + ("; ..." if len(drift) > 6 else "")
        hint = f"; `--study {cfg.name}` alone takes the launch's config"
        try:
            if not is_shipped(find_study_file(cfg.name)):
                hint = ""  # the user's own file of the study's name is always read first
        except ConfigError:
            pass
        warnings.warn(
            f"study {cfg.name}: this worker's trials train otherwise than its last launch's "
            f"({shown}): their values will not compare{hint}",
            HpsearchWarning,
            stacklevel=2,
        )
    before = with_db_retry(
        lambda: trials_before(study.get_trials(deepcopy=False)), what="count trials"
    )
    study.sampler = make_sampler(cfg, opts.stream(), before)
    if spec.is_postgres:  # the budget count there is SQL, not this cache
        throttle_trial_reads(study)
    return study


def run_worker(
    cfg: StudyConfig,
    spec: StorageSpec,
    opts: WorkerOptions,
    stop: threading.Event | None = None,
    on_trial: Callable[[int, str, str], None] | None = None,
) -> WorkerSummary:
    """Run trials until the study's budget is spent, `stop` is set, or limits are hit.
    `on_trial(number, outcome, message)` after each trial; the message is an error's."""
    stop = stop or threading.Event()
    wid = opts.resolved_id()
    summary = WorkerSummary(wid)
    train_fn = load_train_fn(opts.train_fn)
    study = connect(cfg, spec, opts)
    # The lock and the budget count use the storage's own pool (RDBStorage sits behind
    # Optuna's cache wrapper); a NullPool engine would connect afresh on every ask.
    lock_engine = getattr(getattr(study._storage, "_backend", study._storage), "engine", None)
    # One's own image folder's classes may change between launches, or while a worker runs
    # (the built-in datasets' do not): as the study's trials had them, at the worker's
    # start and in each trial (TrainOptions.class_names), or no trial trains.
    classes: list[str] | None = None
    if not opts.train_fn and cfg.dataset.name == "imagefolder":
        from hpsearch.trainer.data import get_source

        src = get_source(cfg, "train")
        names = list(src.class_names) if src is not None else []

        def recorded() -> list[str]:
            with study_lock(spec, cfg.name, lock_engine):
                return check_classes(study, cfg, names)

        classes = with_db_retry(recorded, what="check the classes")
    # Before this worker's first ask (the launcher queues them too, beside its workers'
    # start): the study's first trials are the file's, whoever asks first.
    with_db_retry(
        lambda: enqueue_trials(study, cfg, lambda: study_lock(spec, cfg.name, lock_engine)),
        what="queue enqueue_trials",
    )
    budget = _Budget(study, cfg)
    tracking = _open_tracking(cfg, spec, opts, stop, study)
    watcher = None
    if spec.kind == "rdb":
        _, grace_s, check_s = heartbeat_timing(opts.heartbeat_interval_s)
        watcher = _StaleWatcher(
            study, check_s, lambda: study_lock(spec, cfg.name, lock_engine), grace_s
        )
    warm = _new_warm_cache()
    deadlines = [time.time() + opts.timeout_s] if opts.timeout_s else []
    deadline = min(deadlines + ([opts.deadline] if opts.deadline else []), default=None)
    errors = 0
    owner = {ATTR_WORKER: wid, ATTR_HOST: socket.gethostname(), ATTR_PID: os.getpid(),
             ATTR_PID_START: process_start(os.getpid())}  # fmt: skip
    cfg_id = trial_config_id(cfg)  # computed once: a YAML dump per trial is milliseconds
    for path in stale_temp_files(opts.workdir / "checkpoints" / cfg.name, time.time()):
        with contextlib.suppress(OSError):  # best effort: another worker may remove it first
            size = path.stat().st_size
            path.unlink()
            logger.warning("removed %s (%.1f MiB): a killed writer's", path, size / 2**20)
    try:
        while not stop.is_set():
            if opts.max_trials is not None and len(summary.trials) >= opts.max_trials:
                summary.stopped_by = "max_trials"
                break
            if deadline is not None and time.time() > deadline:
                summary.stopped_by = "timeout"
                break
            if cfg.trainer.checkpoint and (full := disk_stop(opts.workdir, cfg.name)):
                # Before asking: on a full disk every trial failed fast (its checkpoints,
                # its data cache), and the restarted workers failed a dozen more.
                raise DiskFullError(full)
            asked_at = time.perf_counter()
            claimed: list[int] = []
            trial = with_db_retry(
                functools.partial(
                    _next_trial, study, cfg, spec, lock_engine, budget, owner, claimed
                ),
                give_up_after_s=opts.db_outage_limit_s,
                what="ask",
            )
            if trial is None:
                break
            if trial == "wait":
                # Budget fully handed out but trials still run elsewhere; one may fail and be
                # retried, so stay until they finish. Poll at half the heartbeat interval.
                stop.wait(max(1.0, opts.heartbeat_interval_s / 2))
                continue
            assert isinstance(trial, optuna.Trial)
            timing = TrialTiming(
                trial.number, wid, (time.perf_counter() - asked_at) * 1e3, study=cfg.name
            )
            outcome = run_trial(
                study, trial, cfg, opts, train_fn, tracking, warm, stop, timing,
                lambda: study_lock(spec, cfg.name, lock_engine), cfg_id, classes,
            )  # fmt: skip
            timing.trial_s = time.perf_counter() - asked_at
            append_timing(opts.workdir, timing)
            summary.trials.append(trial.number)
            summary.outcomes[outcome] = summary.outcomes.get(outcome, 0) + 1
            failed = outcome in ("error", "data_error")
            if not failed and outcome != "interrupted":  # its writes found room (review: a
                _clear_disk_need(opts.workdir, cfg.name)  # need kept for ever held all back)
            message = _error_message(study, trial) if failed else ""
            summary.last_error = message or summary.last_error
            if on_trial is not None:
                on_trial(trial.number, outcome, message)
            errors = errors + 1 if outcome == "error" else 0  # in a row: a broken set-up
            if outcome == "data_error":  # every trial would fail the same: stop now
                summary.stopped_by = "data_error"
                break
            if errors >= opts.max_errors:
                summary.stopped_by = "errors"
                break
        else:
            summary.stopped_by = "interrupted"
    finally:
        if watcher is not None:
            watcher.stop()
        if tracking is not None:
            tracking.close()  # waits for trials' MLflow runs to finish
    return summary


class _Budget:
    """The study's n_trials, re-read at most every `ttl_s` seconds: a relaunch with
    --trials changes it rarely, while every ask needs it."""

    def __init__(self, study: optuna.Study, cfg: StudyConfig, ttl_s: float = 5.0) -> None:
        self._study, self._cfg, self._ttl_s = study, cfg, ttl_s
        self._value, self._read_at = 0, -float("inf")

    def __call__(self) -> int:
        if time.monotonic() - self._read_at > self._ttl_s:
            self._value = study_budget(self._study, self._cfg)
            self._read_at = time.monotonic()
        return self._value


def _next_trial(
    study: optuna.Study,
    cfg: StudyConfig,
    spec: StorageSpec,
    engine: Any,
    budget: _Budget,
    owner: Mapping[str, Any] | None = None,
    claimed: list[int] | None = None,
) -> optuna.Trial | str | None:
    """Ask under the study lock, so concurrent workers never overshoot `n_trials`.

    The locked section is one aggregate count and the ask itself: every asking worker of
    every host queues here, so it must stay short. Stale trials are failed by each
    worker's watcher thread, not here. `claimed` (empty at the first try) keeps the trial
    this ask claimed: a try that the database interrupts after the claim's commit is run
    again (`with_db_retry`) on that trial rather than claiming a second one and leaving
    the first RUNNING, maybe without the heartbeat that would ever find it stale.
    """
    if claimed:
        trial_id: int | str | None = claimed[0]
        _first_heartbeat(study, claimed[0])  # an upsert: again is harmless
    else:
        n_trials = budget()
        with study_lock(spec, cfg.name, engine) as conn:
            if conn is not None:
                counts = count_trials_sql(conn, study)
            else:
                counts = budget_counts(study.get_trials(deepcopy=False))
            if not may_start_trial(counts, n_trials):
                return "wait" if counts.get("running", 0) > 0 else None
            trial_id = _claim_trial(study, counts, n_trials, claimed)
            if trial_id is None:  # an Optuna without the pieces: ask whole, under the lock
                asked = study.ask()
                _first_heartbeat(study, asked._trial_id)
                return asked
            if isinstance(trial_id, str):  # the queued retry went elsewhere; budget spent
                return trial_id
    assert isinstance(trial_id, int)
    # On the journal storage (no heartbeats) the claim names its worker at once: a relaunch
    # then tells a live worker's trial, its sampler still at work, from a dead one's by
    # its pid (launcher.fail_orphans_on_this_host). PostgreSQL has the claim's heartbeat.
    if owner and spec.kind == "journal":
        for key, value in owner.items():
            study._storage.set_trial_user_attr(trial_id, key, value)
    # Building the Trial (reading it back, the sampler's before_trial) needs no lock.
    study._thread_local.cached_all_trials = None
    try:
        return optuna.Trial(study, trial_id)
    except (SQLAlchemyError, optuna.exceptions.StorageInternalError):
        raise  # the database: with_db_retry's to judge
    except Exception as exc:  # the sampler's own failure (its relative sampling runs here)
        raise _sampler_failed(study, cfg, trial_id, exc) from exc


def _sampler_failed(
    study: optuna.Study, cfg: StudyConfig, trial_id: int, exc: Exception
) -> ConfigError:
    """Fail a claimed trial whose sampler raised (its before_trial, or the suggestions)
    before the trial had an owner (run_trial writes it with the params): left RUNNING,
    crash recovery would never find it (it looks for a dead worker's trials by their owner)
    and a relaunch would wait for it forever. The error stops the worker: the next ask
    would fail alike."""
    message = f"sampler {cfg.sampler.name!r} failed: {type(exc).__name__}: {exc}"
    storage = study._storage
    with contextlib.suppress(  # finished elsewhere meanwhile: its state stands
        SQLAlchemyError,
        optuna.exceptions.StorageInternalError,
        optuna.exceptions.UpdateFinishedTrialError,
    ):
        storage.set_trial_user_attr(trial_id, ATTR_OUTCOME, "error")
        storage.set_trial_user_attr(trial_id, ATTR_MESSAGE, message[:500])
        storage.set_trial_state_values(trial_id, TrialState.FAIL)
    return ConfigError(f"{cfg.source or cfg.name}: {message}")


def _claim_trial(
    study: optuna.Study, counts: dict[str, int], n_trials: int, claimed: list[int] | None = None
) -> int | str | None:
    """The part of `Study.ask` that the budget lock must cover: take a queued retry, or
    create a new RUNNING trial (its id appended to `claimed` once committed), and record its
    first heartbeat (a trial without one is never found stale, so a claim whose worker then
    fails must have it). Returns the trial id, "wait" when the retry `counts` showed was
    taken by another worker and the budget is spent, or None when Optuna lacks the helpers."""
    pop = getattr(study, "_pop_waiting_trial_id", None)
    if pop is None or not hasattr(study, "_thread_local"):
        return None
    trial_id = None
    backend = getattr(study._storage, "_backend", study._storage)  # Optuna's cache wraps it
    if counts.get("waiting", 0) > 0:  # the fresh count says whether a retry is queued:
        refresh_trials_now(study)  # it may be newer than this process's view
        trial_id = pop()
    # else no read of the queue, which would refresh every trial's view under the lock
    beats = getattr(backend, "beats_on_claim", None)  # the claim of a retry beat first
    beat = not (trial_id is not None and beats is not None and beats())
    if trial_id is None:
        used = counts.get("complete", 0) + counts.get("pruned", 0) + counts.get("running", 0)
        if used >= n_trials:
            return "wait"
        # A second commit under the lock, every trial, when the create wrote the beat too
        beats = getattr(backend, "beats_on_create", None)
        beat = not (beats is not None and beats())
        trial_id = study._storage.create_new_trial(study._study_id)
    if claimed is not None:
        claimed.append(int(trial_id))
    if beat:
        _first_heartbeat(study, trial_id)
    return int(trial_id)


def _first_heartbeat(study: optuna.Study, trial_id: int) -> None:
    beating = heartbeat_storage(study._storage)
    if beating is not None:
        beating.record_heartbeat(trial_id)


# s a trial waits for its run's create once it sees the worker told to stop (at its epoch's
# end): the launcher's grace (120 s) counts from the stop, then it kills workers untold
RUN_WAIT_AFTER_STOP_S = 10.0
# s between tries of a run's start that MLflow did not answer (each try waits up to the
# tracker's 15 s); the trial trains meanwhile and its epochs wait for the run
RUN_START_RETRY_S = (10.0, 20.0, 40.0, 80.0, 160.0)


class _LateRun:
    """A trial's MLflow run (`TrialRun`), started off the training thread while the trial
    trains: on a thread of its own once the worker's MLflow session is set up, else on the
    set-up thread (a worker's first trial: importing MLflow alone is 1.3 s of CPU on the path
    to the GPU's first step). A server that accepts connections but does not answer holds a
    create for minutes (MLFLOW_HTTP_REQUEST_TIMEOUT per try, and its retries); the trial's
    start does not wait for it. Epoch records and the latest resume checkpoint from before
    the start are handed to the run when it starts, and the run is dated from the trial's
    start; so are its GPU samples, whose sampler starts with the trial and is handed to the
    run. A start MLflow did not answer is tried again (`RUN_START_RETRY_S`) while the trial
    trains, and once more at its end if the server answers by then. `wait` returns the run
    (or None) for the tell."""

    def __init__(
        self, tracking: Any, trial: optuna.Trial, params: Mapping[str, Any], root: int,
        ckpt: Path, db: Db, run_key: str | None = None, stop: threading.Event | None = None,
        earlier_run: str | None = None,
    ) -> None:  # fmt: skip
        self.run: Any = None
        self._stop = stop  # the worker's: `wait` gives up on a start still in progress
        self._tracking = tracking
        self._lock = threading.Lock()
        self._started = False  # the start was tried: `run` is final
        self._pending: list[tuple[Any, int]] = []  # epoch records (and ms) before the start
        self._checkpoint: Path | None = None  # the latest resume checkpoint from before it
        self._error: StorageError | None = None
        self._cancelled = False
        self._ending = False  # `wait` was called: the trial is over, no try after the next
        self._tries = 0  # starts MLflow did not answer
        self._wake = threading.Event()  # ends a wait for the next try
        self._done = threading.Event()  # `_start` is over: `run` and `_error` are final
        self._args = (trial, params, root, ckpt, db, int(time.time() * 1000), run_key)
        self._earlier_run = earlier_run  # a retry's failed try's run (`start_trial`)
        # (sampler, relay) running from the trial's start, until the run takes it
        self._gpu: tuple[Any, Any] | None = tracking.early_gpu_sampler()
        # Kept for `training_began`: the run takes the sampler from `_gpu` as it starts.
        self._early_sampler: Any = self._gpu[0] if self._gpu is not None else None
        tracking.when_ready(self._start)

    def cancel(self) -> None:
        """The trial is over: a run that has not started now never starts (the worker
        stops, or MLflow's set-up failed), and a GPU sampler no run took is stopped."""
        with self._lock:
            self._cancelled = True
            gpu, self._gpu = self._gpu, None
        self._wake.set()
        _stop_sampler(gpu)

    def _start(self) -> None:  # on a thread of its own, or on the session's set-up thread
        final = True
        try:
            final = self._start_run()
        finally:
            if final:
                self._done.set()

    def _start_run(self, offline: bool = False) -> bool:
        """Start the run (`offline`: one kept in the spool folder until the server answers,
        the trial over and the server still down); False when MLflow did not answer and a
        later try is set."""
        trial, params, root, ckpt, db, start_ms, run_key = self._args
        with self._lock:
            gpu, self._gpu = self._gpu, None
            if self._cancelled:
                self._started = True
                _stop_sampler(gpu)
                return True
        run = None
        try:
            run = self._tracking.start_trial(
                trial, params, root, ckpt, start_time_ms=start_ms, early_gpu=gpu,
                run_key=run_key, offline=offline, again=self._tries > 0,
                earlier_run=self._earlier_run,
            )  # fmt: skip
            if run is not None:
                gpu = None  # the run's now: it stops the sampler when it ends
            with self._lock:
                cancelled = self._cancelled
            run_id = run.run_id if run is not None and not cancelled else None
            if run_id:
                db(lambda: trial.set_user_attr(ATTR_RUN_ID, run_id), "set_user_attr")
        except StorageError as exc:  # the database stayed down: `wait` writes the link again
            self._error = exc
        except TrackingUnreachable as exc:  # the epochs wait for a later try
            if self._try_later(gpu, exc):
                return False
            with self._lock:
                if self._ending and not self._cancelled and not offline:
                    self._gpu = gpu  # the trial is over: its run is kept whole instead
                    gpu = None
            if gpu is None:
                return self._start_run(offline=True)
            logger.warning("trial %s: no MLflow run: %s", trial.number, exc)
        except Exception as exc:  # tracking is best effort: the trial goes on untracked
            logger.warning("trial %s: no MLflow run: %s", trial.number, exc)
        _stop_sampler(gpu)  # no run took it
        # The epochs from before the start, in order, outside the lock: a run's log_epoch
        # may write to the database (an input-bound flag), and the training thread's own
        # log_epoch takes the lock. Epochs that end meanwhile join the pending list.
        # The latest checkpoint likewise, until neither is left: the writer thread's next
        # one then goes straight to the run, after it.
        while True:
            with self._lock:
                pending, self._pending = self._pending, []
                checkpoint, self._checkpoint = self._checkpoint, None
                doomed = run if self._cancelled else None  # its trial ended meanwhile
                if doomed is not None or run is None or not (pending or checkpoint):
                    self.run, self._started = (None if doomed else run), True
                    break
            for record, ms in pending:
                try:
                    run.log_epoch(record, ms)
                except Exception as exc:  # telemetry: the other epochs and the run go on
                    logger.warning("trial %s: epoch %s not logged: %s", trial.number,
                                   getattr(record, "epoch", "?"), exc)  # fmt: skip
            if checkpoint is not None:
                try:
                    run.checkpoint_written(checkpoint)
                except Exception as exc:  # telemetry, as above
                    logger.warning("trial %s: checkpoint not uploaded: %s", trial.number, exc)
        if doomed is not None:  # ended, not left RUNNING
            doomed.finish_failed("interrupted", "the worker stopped before the run started", None)
        return True

    def _try_later(self, gpu: tuple[Any, Any] | None, exc: BaseException) -> bool:
        """Set the next try of a start MLflow did not answer, the trial's GPU sampler kept
        for it; False when the trial is over (`wait`: a stopping worker's trial tries until
        its own end, which `wait` bounds). The delay grows with the starts the session saw
        fail in a row, across trials: a long outage costs each trial a few tries."""
        with self._lock:
            if self._cancelled or self._ending:
                return False
            self._gpu = gpu
            self._tries += 1
        down = self._tracking.note_unreachable()
        delay = RUN_START_RETRY_S[min(down, len(RUN_START_RETRY_S)) - 1]
        logger.log(logging.WARNING if down == 1 else logging.DEBUG,
                   "trial %s: no MLflow run yet (%s); its epochs are kept and the start "
                   "tried again in %g s", self._args[0].number, exc, delay)  # fmt: skip
        threading.Thread(
            target=self._retry, args=(delay,), daemon=True, name="mlflow-run-retry"
        ).start()
        return True

    def _retry(self, delay_s: float) -> None:
        self._wake.wait(delay_s)
        with self._lock:
            ending = self._ending and not self._cancelled
        # At the trial's end one more try if the server answers (each try waits out its
        # create), else the run is kept whole until it does.
        offline = ending and not self._answers()
        final = True
        try:
            final = self._start_run(offline=offline)
        finally:
            if final:
                self._done.set()

    def _answers(self) -> bool:
        try:
            return bool(self._tracking.answers())
        except Exception as exc:  # telemetry: taken for no answer
            logger.debug("MLflow health check failed: %s", exc)
            return False

    def training_began(self) -> None:
        """The trial's first epoch trained here is over: its GPU sampler, paused from the
        trial's start (the data set-up, a wait for GPU memory beside packed trials and
        torch.compile's first steps leave the GPU idle: they flagged trials input-bound for
        good), judges the input-bound rule from now on, after its warm-up."""
        self._gpu_rule("restart_warmup")

    def _gpu_rule(self, method: str) -> None:
        with self._lock:
            sampler = self._early_sampler or getattr(self.run, "sampler", None)
        if sampler is not None:
            try:
                getattr(sampler, method)()
            except Exception as exc:  # telemetry never stops a trial
                logger.warning("trial GPU sampler: %s", exc)

    def started_run(self) -> Any:
        """The run if its start is over (None if it made none); None while it starts.
        Never waits."""
        with self._lock:
            return self.run if self._started else None

    def log_epoch(self, record: Any) -> None:
        with self._lock:
            if not self._started:
                self._pending.append((record, int(time.time() * 1000)))
                return
            run = self.run
        if run is not None:
            run.log_epoch(record)

    def checkpoint_written(self, path: Path) -> None:
        """The trainer's hook, on its checkpoint writer thread."""
        with self._lock:
            if not self._started:
                self._checkpoint = path
                return
            run = self.run
        if run is not None:
            run.checkpoint_written(path)

    def wait(self, after_stop_s: float = RUN_WAIT_AFTER_STOP_S) -> Any:
        """The run, once started (after the session's set-up and the start, waited for
        here: a trial that ends before its run's create was answered waits for it). Once
        the worker is told to stop, it waits `after_stop_s` more at most: a trial that
        trained (an interrupted one too: its checkpoint goes to the run, with uploads, for
        another host to resume from) waits a while, but is told without its run rather than
        killed untold by the launcher's grace; one that never started waits none."""
        # The start runs once the set-up is over (on the set-up thread, or one of its own);
        # a set-up that failed runs none. A create or a set-up that waits on a server that
        # does not answer is given up when the worker stops. A try set for later runs now.
        with self._lock:
            self._ending = True
        self._wake.set()
        self._tracking.trial_ending()
        stopped_at: float | None = None
        while not self._done.is_set():
            if self._tracking.setup_failed() is not None:  # no run for any trial (the
                return None  # session warned once)
            if self._stop is not None and self._stop.is_set():
                stopped_at = time.monotonic() if stopped_at is None else stopped_at
                if time.monotonic() - stopped_at >= after_stop_s:
                    self.cancel()  # a run made after all is ended at once,
                    with self._lock:  # unless its start was over just now
                        if not self._started:
                            return None
                    self._done.wait()  # only its last steps are left: as if it were done
                    break
            self._done.wait(0.2)
        if self._error is not None:
            # The link's write outlasted the database outage limit on the start's thread,
            # while the trial trained: written again here, before the trial is told.
            error, self._error = self._error, None
            trial, db = self._args[0], self._args[4]
            run = self.run
            if run is None or not run.run_id:
                raise error
            try:
                db(lambda: trial.set_user_attr(ATTR_RUN_ID, run.run_id), "set_user_attr")
            except StorageError as again:
                self.run = None  # not linked: ended now, not left running
                run.finish_failed("failed", f"the trial's database write failed: {again}", None)
                raise
        return self.run

    def stop_input_bound(self) -> bool:
        """Whether the trial's GPU sampler asks to stop it as input-bound: the sampler runs
        from the trial's start, before its run exists."""
        with self._lock:
            sampler = self._early_sampler or getattr(self.run, "sampler", None)
        try:
            return bool(sampler is not None and sampler.should_stop())
        except Exception as exc:  # telemetry never stops a trial by failing
            logger.warning("trial GPU sampler: %s", exc)
            return False


def _stop_sampler(gpu: tuple[Any, Any] | None) -> None:
    if gpu is None:
        return
    try:
        gpu[0].stop()
    except Exception as exc:  # telemetry never fails a trial
        logger.warning("GPU sampler stop failed: %s", exc)


def run_trial(
    study: optuna.Study,
    trial: optuna.Trial,
    cfg: StudyConfig,
    opts: WorkerOptions,
    train_fn: TrainFn,
    tracking: Any,
    warm: Any,
    stop: threading.Event,
    timing: TrialTiming | None = None,
    lock: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    cfg_id: str | None = None,
    classes: list[str] | None = None,
) -> str:
    """Train one trial and tell Optuna. Returns the outcome; never raises for a trial's fault.
    `lock` is the study lock, held while an interrupted trial is failed and re-queued;
    `cfg_id` is `trial_config_id(cfg)` (computed here when not given); `classes` the
    study's (`check_classes`), which the trainer's train split must have."""
    timing = timing or TrialTiming(trial.number, opts.resolved_id(), 0.0, study=cfg.name)
    began = time.perf_counter() - timing.ask_ms / 1e3
    from hpsearch.trainer import TrainOptions

    def db(fn: Callable[[], Any], what: str = "storage") -> Any:
        return with_db_retry(fn, give_up_after_s=opts.db_outage_limit_s, what=what)

    heartbeat = _Heartbeat(study._storage, trial._trial_id)
    run = None
    late: _LateRun | None = None
    try:
        t0 = time.perf_counter()
        held = dict(trial.params)  # a retry's: its failed try's
        try:
            with deferred_params(trial) as drawn:  # written below, with the attributes
                params = retry_params(held, db(lambda: suggest(trial, cfg), "suggest"))
        except (SQLAlchemyError, optuna.exceptions.StorageInternalError, StorageError):
            raise
        except Exception as exc:  # the sampler's (TPE samples relative params lazily, here)
            raise _sampler_failed(study, cfg, trial._trial_id, exc) from exc
        timing.suggest_ms = (time.perf_counter() - t0) * 1e3
        root = root_trial_number(trial)
        inherited = trial.user_attrs.get(ATTR_CHECKPOINT) if root != trial.number else None
        ckpt = checkpoint_path(opts.workdir, cfg.name, root, str(inherited or "") or None)
        if inherited and _failed_host(trial) == socket.gethostname():
            # The failed try ran on this host, maybe from another work folder (a second
            # launch of the study): its files are taken, not trained again from epoch 1.
            adopt_checkpoint(Path(str(inherited)), ckpt)
        run_key = uuid.uuid4().hex
        attrs = {
            ATTR_WORKER: opts.resolved_id(),
            ATTR_HOST: socket.gethostname(),
            ATTR_PID: os.getpid(),
            ATTR_PID_START: process_start(os.getpid()),
            ATTR_CHECKPOINT: str(ckpt.absolute()),  # a retry in another folder finds it
            ATTR_RUN_KEY: run_key,
            CONFIG_ID_ATTR: cfg_id or trial_config_id(cfg),
        }
        if (torch := sys.modules.get("torch")) is not None:  # (the built-in trainer's)
            # Its CPU threads (the launch gives each worker its share of the cores): sums
            # of another order give other values, which `train --trial N` reproduces so.
            attrs[ATTR_THREADS] = int(torch.get_num_threads())
        previous_run = trial.user_attrs.get(ATTR_RUN_ID)  # copied from the failed trial
        if previous_run:
            # Not this try's run: cleared until its own is linked, so that the launcher
            # knows a try that dies before that has no run (record_dead_trial_run).
            attrs[ATTR_RUN_ID] = ""
        # Params and who runs them, in one transaction, before anything slow: crash recovery
        # finds a dead worker's trial by these (the launcher by worker, a relaunch by host
        # and pid) and re-queues its params.
        db(functools.partial(set_trial_attrs, trial, attrs, drawn=drawn), "set_user_attr")
        # With uploads, a file here may be an earlier try's of this host, epochs behind the
        # one the failed try uploaded from another: the later epoch is kept.
        fetch = not ckpt.exists() or cfg.tracking.upload_checkpoints
        if tracking is not None and root != trial.number and previous_run and fetch:
            tracking.fetch_checkpoint(str(previous_run), ckpt)  # the failed try ran elsewhere
        retry = tracking is not None and root != trial.number
        earlier = earlier_run(study, trial, previous_run, db) if retry else None
        late = (
            _LateRun(tracking, trial, params, root, ckpt, db, run_key, stop, earlier)
            if tracking is not None
            else None
        )
        first_epoch: list[int] = []
        epoch_done = [0.0]  # perf_counter at the end of the latest epoch callback

        def on_epoch(record: Any) -> None:
            if not first_epoch:  # the first epoch trained here is over
                first_epoch.append(int(record.epoch))
                if late is not None:  # set-up and a compiling first epoch are not input-bound
                    late.training_began()
            if late is not None:
                t0 = time.perf_counter()
                late.log_epoch(record)
                timing.log_ms.append((time.perf_counter() - t0) * 1e3)
            epoch_done[0] = time.perf_counter()

        def report(epoch: int, value: float) -> bool:
            t0 = time.perf_counter()
            try:
                stop = reports.report(epoch, value)
                # Judged from the second epoch trained here on: the trainer reports before
                # its on_epoch, and a retry reports its restored epochs during its set-up.
                if first_epoch and late is not None and late.stop_input_bound():
                    # tracking.stop_input_bound: a starved GPU is stopped like a pruned trial.
                    db(lambda: trial.set_user_attr("stopped_by", "input_bound"), "set_user_attr")
                    return True
                return stop
            finally:
                epoch_done[0] = time.perf_counter()
                timing.report_ms.append((epoch_done[0] - t0) * 1e3)

        options = TrainOptions(
            device=opts.device,
            workdir=opts.workdir,
            checkpoint_path=ckpt if cfg.trainer.checkpoint else None,
            seed=cfg.trainer.seed + root,
            on_epoch=on_epoch,
            on_checkpoint=late.checkpoint_written if late is not None else None,
            warm=warm,
            should_interrupt=stop.is_set,
            class_names=classes,
        )
        if tracking is not None:
            tracking.trial_training()
        handed_over = time.perf_counter()
        reports = TrialReports(study, trial, db, last_step=cfg.budget.max_epochs)
        try:
            # Every reported value is in the database before the trial is told, whatever
            # the outcome: the reports' close() waits for their writes.
            with reports, _gpu_reservation(cfg, params, opts, stop) as waited:
                timing.admission_wait_s = waited
                try:
                    result = train_fn(cfg, params, report, options)
                except SystemExit as exc:  # the trial's failure, not its worker's death
                    raise HpsearchError(
                        f"the train function called sys.exit({exc.code!r})"
                    ) from exc
                returned = time.perf_counter()
                check_result(result)
        except StorageError:
            raise  # the database stayed down past the limit: stop the worker, not the trial
        except AdmissionStopped as exc:  # never started: queue it again as it is
            run = late.wait(after_stop_s=0.0) if late is not None else None
            message = f"waiting for GPU memory: {exc}"
            # Said on the trial (`status`), and found by a relaunch if this worker is killed
            # between the failure and the retry (requeue_cut_handbacks looks for it).
            attrs = {ATTR_OUTCOME: "interrupted", ATTR_MESSAGE: message[:500]}
            _safe_tell(db, functools.partial(set_trial_attrs, trial, attrs))
            _fail_and_requeue(study, trial, db, opts.max_retries, lock)
            if run is not None:
                run.finish_failed("interrupted", message, None)
            return "interrupted"
        except DiskFullError as exc:
            # No room for its checkpoint (a disk full or read-only): no fault of the trial's.
            # Handed back to resume from its last checkpoint, and the worker stops (exit 74)
            # until there is room; each trial after it would fail the same way (QA: failed for
            # good, its epochs lost, and the next trial trained 100 s to fail alike).
            run = late.wait(after_stop_s=0.0) if late is not None else None
            message = str(exc)
            attrs = {ATTR_OUTCOME: "interrupted", ATTR_MESSAGE: message[:500]}
            _safe_tell(db, functools.partial(set_trial_attrs, trial, attrs))
            if run is not None:  # its last checkpoint uploaded before its retry is queued
                run.flush_uploads()  # (as `_tell`'s hand-back: another host fetches it)
            _fail_and_requeue(study, trial, db, opts.max_retries, lock)
            if run is not None:
                run.finish_failed("interrupted", message, None)
            _record_disk_need(opts.workdir, cfg.name, exc.need_bytes)
            raise
        except DatasetError as exc:  # the data's, not the trial's: the worker stops (run_worker)
            run = late.wait() if late is not None else None
            _fail(study, trial, "error", str(exc), run, traceback.format_exc(), db)
            return "data_error"
        except HpsearchError as exc:
            run = late.wait() if late is not None else None
            _fail(study, trial, "error", str(exc), run, traceback.format_exc(), db)
            return "error"
        except Exception as exc:  # a trial's bug must not kill the worker; it is recorded
            tb = traceback.format_exc()
            run = late.wait() if late is not None else None
            if _finished_elsewhere(exc) and db(
                lambda: study._storage.get_trial(trial._trial_id).state.is_finished(),
                "get_trial",
            ):
                # Its report found it failed by another worker's stale check while this one
                # was stopped or cut off: the retry queued there resumes from the checkpoint.
                # No error of the trial's (it counted toward --max-errors). Only when the
                # trial stands finished: a train_fn's own such error is its bug.
                warnings.warn(
                    f"trial was already finished elsewhere: {exc}", HpsearchWarning, stacklevel=2
                )
                if run is not None:
                    run.finish_failed("failed", f"finished elsewhere while it trained: {exc}", None)
                return STALE
            _fail(study, trial, "error", f"{type(exc).__name__}: {exc}", run, tb, db)
            return "error"
        # A trial that ended before its run started (MLflow's set-up, a slow create) waits.
        run = late.wait() if late is not None else None
        if root != trial.number:  # a retry: where it picked up
            # Finished elsewhere meanwhile (stale-failed while this worker was cut off):
            # the tell below finds it so and says so; this is no crash of the worker's.
            with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError):
                resumed = resumed_from_epoch(first_epoch, result.history)
                db(lambda: trial.set_user_attr(ATTR_RESUMED_FROM, resumed), "set_user_attr")
                if len(study.directions) == 1:
                    stored = db(lambda: study._storage.get_trial(trial._trial_id), "get_trial")
                    unreported = unreported_epochs(
                        result.history, stored.intermediate_values, cfg.reported_metric
                    )
                    for step, value in unreported:
                        db(functools.partial(trial.report, value, step), "report")
        setup_s = float(getattr(result, "setup_seconds", 0.0) or 0.0)
        timing.startup_s = handed_over - began + setup_s
        timing.setup_s = setup_s
        training_from = handed_over + timing.admission_wait_s + setup_s
        last = epoch_done[0] if epoch_done[0] > training_from else returned
        timing.epochs_s = max(0.0, last - training_from)
        timing.finish_s = max(0.0, returned - last)
        t0 = time.perf_counter()
        try:
            outcome = _tell(study, trial, cfg, opts, result, run, db, timing.startup_s, lock)
        except StorageError:
            raise
        except Exception as exc:  # a result the study cannot take: recorded, not a crash
            _fail(study, trial, "error", f"{type(exc).__name__}: {exc}", run,
                  traceback.format_exc(), db, result)  # fmt: skip
            return "error"
        timing.tell_ms = (time.perf_counter() - t0) * 1e3
        if outcome != "interrupted":
            _prune_checkpoints(study, cfg, opts.workdir)
        return outcome
    except StorageError as exc:  # from any step: the worker stops, its trial's run ends
        _end_run_on_outage(late, exc)
        raise
    finally:
        if late is not None:
            late.cancel()  # a no-op once its run started; else (the worker stops) none will
        heartbeat.stop()


Db = Callable[[Callable[[], Any], str], Any]


def _end_run_on_outage(late: _LateRun | None, exc: StorageError) -> None:
    """The worker stops on a database down past its limit; whoever sees the trial's
    heartbeat stop fails and re-queues it. Its run ends now, FAILED, with what it logged:
    left RUNNING, no one ended it where no launcher runs on this host (a standalone
    worker's). A run still starting is left to the launcher's clean-up."""
    run = late.started_run() if late is not None else None
    if run is not None and not run.ended:  # else its end is handed over already
        run.finish_failed("failed", f"its worker stopped: {exc}", None)


def _safe_tell(db: Db, fn: Callable[[], Any], landed: Callable[[], bool] | None = None) -> bool:
    """tell (or write result attributes), tolerating a trial that was already finished
    elsewhere (stale-failed while this worker was cut off): False then. `landed`: whether
    the trial now stands as this tell would leave it, read when a try found it finished:
    a tell whose commit's reply was lost is run again by `db` and finds its own result
    (no other process completes or prunes this worker's trial)."""
    try:
        db(fn, "tell")
    except (optuna.exceptions.UpdateFinishedTrialError, ValueError) as exc:
        if not _finished_elsewhere(exc):
            raise
        if landed is not None and db(landed, "read trial"):
            return True
        warnings.warn(f"trial was already finished elsewhere: {exc}", HpsearchWarning, stacklevel=2)
        return False
    return True


def _finished_as(study: optuna.Study, trial: optuna.Trial, state: TrialState) -> Callable[[], bool]:
    return lambda: study._storage.get_trial(trial._trial_id).state == state


def _finished_elsewhere(exc: Exception) -> bool:
    """Whether a write to a trial failed because the trial was already finished: Optuna's
    storages raise UpdateFinishedTrialError, its tell a ValueError "Cannot tell a FAIL
    trial." """
    if isinstance(exc, optuna.exceptions.UpdateFinishedTrialError):
        return True
    return isinstance(exc, ValueError) and "Cannot tell a" in str(exc)


def _fail(
    study: optuna.Study,
    trial: optuna.Trial,
    outcome: str,
    message: str,
    run: Any,
    tb: str | None,
    db: Db,
    result: Any = None,
) -> None:
    """Tell the trial FAIL with its outcome and message, and end its run so; `result`: the
    trainer's, where it returned one (the run logs its effective lr and batch size)."""
    attrs = {ATTR_OUTCOME: outcome, ATTR_MESSAGE: message[:500]}
    _safe_tell(db, functools.partial(set_trial_attrs, trial, attrs))
    _safe_tell(db, lambda: tell(study, trial, state=TrialState.FAIL))
    if run is not None:
        run.finish_failed(outcome, message, tb, result)


def _tell(
    study: optuna.Study,
    trial: optuna.Trial,
    cfg: StudyConfig,
    opts: WorkerOptions,
    result: Any,
    run: Any,
    db: Db,
    startup_s: float | None = None,
    lock: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
) -> str:
    reason = str(result.stop_reason)
    attrs: dict[str, Any] = {
        ATTR_OUTCOME: reason,
        ATTR_HISTORY: [record_dict(r) for r in result.history],
        **effective_params(result),
    }
    if startup_s is not None:  # ask to first training step: the per-trial overhead, seconds
        attrs[ATTR_STARTUP] = round(float(startup_s), 3)
    if result.message:
        attrs[ATTR_MESSAGE] = str(result.message)[:500]
    if result.test_acc is not None:
        attrs[ATTR_TEST_ACC] = float(result.test_acc)
    if result.best_model_path is not None:
        # Absolute: readers (load_best_model) run from any folder.
        attrs[ATTR_BEST_MODEL] = str(Path(result.best_model_path).absolute())
    uri = run.checkpoint_uri(result) if run is not None else None
    if uri is not None:
        attrs[ATTR_CHECKPOINT_URI] = uri
    if reason == "interrupted":
        _safe_tell(db, functools.partial(set_trial_attrs, trial, attrs))
        if run is not None:  # its last checkpoint uploaded before its retry is queued: a
            run.flush_uploads()  # retry on another host fetched the one before, or none
        # Checkpointed at an epoch boundary: fail now, and queue the same params to resume.
        _fail_and_requeue(study, trial, db, opts.max_retries, lock)
        if run is not None:
            run.finish_result(result)
        return reason
    infeasible = 1.0 if reason == "out_of_memory" else 0.0
    # On every trial, whatever the sampler: Optuna's GP sampler refuses a study whose
    # completed trials differ in their constraints (QA: a study searched with random, then
    # gp, lost every later ask). CMA-ES's warning that it reads none is silenced (`worker`).
    constraint = {MEMORY_CONSTRAINT: infeasible}
    _safe_tell(db, functools.partial(set_trial_attrs, trial, attrs, constraint))
    values = objective_values(cfg, result.best_val_acc, result.best_val_loss, result.train_seconds)
    unvalued = values is None  # trained to its end with no value: told PRUNED
    if reason in ("pruned", "diverged", "out_of_memory") or values is None:
        # Pruned, diverged and OOM trials teach the sampler that region is bad; a FAIL
        # would hide it. Optuna uses the last reported value for a PRUNED trial.
        ok = _safe_tell(
            db,
            lambda: tell(study, trial, state=TrialState.PRUNED),
            _finished_as(study, trial, TrialState.PRUNED),
        )
    elif not all(math.isfinite(v) for v in values):
        # Optuna would store a NaN as FAIL, which counts toward no budget: a trainer that
        # always returns one would make trials without end. An inf would be the best.
        _fail(study, trial, "error", f"objective {values} is not finite", run, None, db, result)
        return "error"
    else:
        told = values if cfg.objective.multi else values[0]
        ok = _safe_tell(
            db, lambda: tell(study, trial, told), _finished_as(study, trial, TrialState.COMPLETE)
        )
    if run is not None:
        run.finish_result(result, told=ok, pruned=unvalued)
    return reason


def unreported_epochs(
    history: list[Any], reported: Collection[int], metric: str = "val_acc"
) -> list[tuple[int, float]]:
    """(epoch, `metric`) of a retry's evaluated epochs that the study holds no value for: its
    failed try checkpointed them, but died before their reports reached the database (each
    is written off the training thread, one in flight), so the retry resumed after them.
    The built-in trainer reports its last restored epoch again as it resumes
    (`trainer.trial._report_restored`); for a `train_fn` that does not, they are reported
    at the retry's end, so nothing trained is missing from its curve."""
    return [
        (int(r.epoch), float(getattr(r, metric)))
        for r in history
        if r.val_acc is not None and getattr(r, metric) is not None and int(r.epoch) not in reported
    ]


def earlier_run(study: optuna.Study, trial: optuna.Trial, linked: Any, db: Db) -> str | None:
    """A retry's failed try's MLflow run: the one it linked (copied to the retry), else
    the one made for it after it had ended (a run kept offline, or the launcher's for a
    try that died unlinked), which only the study's attributes name."""
    if linked:
        return str(linked)
    frozen = getattr(trial, "_cached_frozen_trial", None)  # as at ask: root_trial_number
    attrs = frozen.system_attrs if frozen is not None else {}
    # The try just before: `failed_trial` is the chain's first (a retry inherits it).
    history = attrs.get("retry_history")
    failed = history[-1] if isinstance(history, list) and history else attrs.get("failed_trial")
    if not isinstance(failed, int):
        return None
    key = LATE_RUN_ATTR.format(number=failed)
    late = db(lambda: study._storage.get_study_user_attrs(study._study_id).get(key), "get_study")
    return str(late) if late else None


def resumed_from_epoch(trained: list[int], history: list[Any]) -> int:
    """The first epoch a retry trained, 1-based. A retry whose checkpoint already held every
    epoch (its try died after the last checkpoint, before the tell) trained none: it picked
    up after the last epoch of its restored history."""
    if trained:
        return trained[0]
    return max((int(r.epoch) for r in history), default=0) + 1


# s: a failed trial this process has seen with no retry queued for so long gets none (its
# failure and its retry's queueing are one locked step, done again after an outage): its
# files may go. Timed by this process's clock: the FAIL's date is another host's maybe,
# in its own zone.
FAILED_FOR_GOOD_AFTER_S = 600.0


def unretried_failures(trials: Sequence[FrozenTrial]) -> set[int]:
    """The failed trials no retry was queued for (yet): each the last try of its chain."""
    retried = {
        n
        for t in trials
        for n in (t.system_attrs.get("retry_history") or [])
        if isinstance(n, int) and n < t.number
    }
    return {t.number for t in trials if t.state == TrialState.FAIL and t.number not in retried}


def checkpoints_to_delete(
    trials: list[optuna.trial.FrozenTrial],
    keep_top_k: int,
    directions: Sequence[str],
    failed_for_good: Collection[int] = (),
) -> list[str]:
    """Files of trials whose chain of tries is over, that may go: every resume checkpoint
    (nothing resumes it any more), a failed try's best model too (it has no value to rank
    it by), and best-model files outside the top k completed trials (`directions`, one
    "maximize" or "minimize" per objective: a multi-objective study has no single ranking,
    and keeps its Pareto front's, whatever k is; none with k = 0). A chain is over once
    its last try completed or was pruned, or is one of `failed_for_good` (failed, with no
    retry queued for `FAILED_FOR_GOOD_AFTER_S`; QA: such a trial kept 135 MB for ever)."""
    last: dict[int, FrozenTrial] = {}  # a try's number -> the last try of its chain so far
    for t in sorted(trials, key=lambda t: t.number):
        for n in t.system_attrs.get("retry_history") or []:
            if isinstance(n, int) and n < t.number:
                last[n] = t

    def over(t: FrozenTrial) -> bool:
        end = last.get(t.number, t)
        return end.state in (TrialState.COMPLETE, TrialState.PRUNED) or (
            end.state == TrialState.FAIL and end.number in failed_for_good
        )

    finished = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    ended = [t for t in trials if ATTR_CHECKPOINT in t.user_attrs and t.state.is_finished()]
    out = [str(t.user_attrs[ATTR_CHECKPOINT]) for t in ended if over(t)]
    # A failed try's best model (a handed-back try names it; a crashed one does not): unless
    # a completed or pruned try of its chain (at its checkpoint path) named its own there.
    named = {
        str(t.user_attrs[ATTR_BEST_MODEL])
        for t in trials
        if ATTR_BEST_MODEL in t.user_attrs and t.state != TrialState.FAIL
    }
    for t in ended:
        if t.state == TrialState.FAIL and over(t):
            best = str(best_model_path_for(Path(str(t.user_attrs[ATTR_CHECKPOINT]))))
            if best not in named:
                out.append(best)
    if len(directions) > 1:
        # Dominated once, dominated for good: later trials only shrink the front.
        keep = {t.number for t in pareto_front(trials, directions)} if keep_top_k else set()
    else:
        maximize = directions[0] == "maximize"
        complete = [t for t in finished if t.state == TrialState.COMPLETE and t.value is not None]
        ranked = sorted(complete, key=lambda t: t.value or 0.0, reverse=maximize)
        keep = {t.number for t in ranked[:keep_top_k]}
    out += [
        str(t.user_attrs[ATTR_BEST_MODEL])
        for t in finished
        if ATTR_BEST_MODEL in t.user_attrs and t.number not in keep
    ]
    return out


# (study name, trial number) -> when this process first saw that trial failed with no retry
# (time.monotonic() s): `FAILED_FOR_GOOD_AFTER_S` is timed by it. Dropped once a retry came,
# and all of it when the study could not be read (an outage: retries come after it).
_UNRETRIED_SINCE: dict[tuple[str, int], float] = {}


def _prune_checkpoints(study: optuna.Study, cfg: StudyConfig, workdir: Path) -> None:
    """Bound disk use: only this machine's files under the work folder are touched."""
    try:
        if not any(p.is_file() for p in (workdir / "checkpoints").rglob("*")):
            return  # nothing to delete: spare the read of every trial
        try:
            trials = study.get_trials(deepcopy=False)
        except Exception:
            _UNRETRIED_SINCE.clear()
            raise
        now = time.monotonic()
        unretried = unretried_failures(trials)
        for key in [k for k in _UNRETRIED_SINCE if k[0] == cfg.name and k[1] not in unretried]:
            del _UNRETRIED_SINCE[key]
        for n in unretried:
            _UNRETRIED_SINCE.setdefault((cfg.name, n), now)
        failed_for_good = {
            n for (name, n), seen in _UNRETRIED_SINCE.items()
            if name == cfg.name and now - seen >= FAILED_FOR_GOOD_AFTER_S
        }  # fmt: skip
        directions = [d.name.lower() for d in study.directions]
        root = (workdir / "checkpoints").resolve()
        for name in checkpoints_to_delete(
            trials, cfg.tracking.keep_top_k, directions, failed_for_good
        ):
            path = Path(name).resolve()
            if root in path.parents:
                path.unlink(missing_ok=True)  # another worker of this host may prune it too
    except Exception as exc:  # housekeeping must never fail a worker
        warnings.warn(f"checkpoint clean-up failed: {exc}", HpsearchWarning, stacklevel=2)


@contextlib.contextmanager
def _gpu_reservation(
    cfg: StudyConfig, params: Mapping[str, Any], opts: WorkerOptions, stop: threading.Event
) -> Iterator[float]:
    """Admission control for packed workers: hold the trial's predicted peak memory in the
    GPU's ledger while it trains; wait while the GPU is full. Yields the seconds waited."""
    gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if opts.packing is None or not gpu or "," in gpu or opts.device == "cpu":
        yield 0.0
        return
    from hpsearch.packing import GpuLedger, PackingPlan

    plan = PackingPlan.from_json(opts.packing.read_text())
    hp = cfg.resolve_params(params)
    micro = min(hp.batch_size, cfg.trainer.max_micro_batch or hp.batch_size)
    need = plan.trial_bytes(hp.arch, micro, hp.image_size or cfg.dataset.image_size)
    if need is None:  # an arch the probe did not see: the largest it did
        context = max((m.context_bytes for m in plan.models), default=0)
        need = plan.worst_trial_bytes + context + plan.data_bytes
    ledger = GpuLedger(opts.workdir, gpu, plan.bytes_on(gpu))
    with ledger.reservation(need, stop.is_set) as waited:
        try:
            yield waited
        finally:
            _release_cached_gpu_memory()  # what the ledger frees must really be free


def _release_cached_gpu_memory() -> None:
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def record_dict(record: Any) -> dict[str, Any]:
    """An epoch record (an `EpochRecord`, or a custom trainer's dataclass or mapping) as a
    mapping of JSON-able values (`plain`)."""
    from dataclasses import asdict, is_dataclass

    if is_dataclass(record) and not isinstance(record, type):
        return {k: plain(v) for k, v in asdict(record).items()}
    fields = record if isinstance(record, Mapping) else vars(record)  # (a namespace's)
    return {str(k): plain(v) for k, v in dict(fields).items()}


def _new_warm_cache() -> Any:
    try:
        from hpsearch.trainer import WarmCache
    except ImportError:
        return None
    return WarmCache()


def _open_tracking(
    cfg: StudyConfig, spec: StorageSpec, opts: WorkerOptions, stop: threading.Event,
    study: optuna.Study,
) -> Any:  # fmt: skip
    if not opts.tracking_uri:
        return None
    from hpsearch.runs import (
        TrackingSession,
        link_late_run,
        remove_stale_snapshots,
        spool_folder,
    )

    # Best-model snapshots that a killed worker of this host left here (hard links).
    for gone in remove_stale_snapshots(opts.workdir / "checkpoints"):
        logger.info("removed %s: its worker is gone", gone)

    # The first trial trains while MLflow is imported and the study run awaited (_LateRun).
    # Not with checkpoint uploads (workers on several hosts): there the session is set up
    # first, so that the first trial's run starts at once beside its training, as every
    # later trial's does, and takes its uploads from the first checkpoint on.
    return TrackingSession(
        cfg, spec, opts.tracking_uri, opts.resolved_id(), await_study_run_s=opts.await_study_run_s,
        server_answered=opts.server_answered,
        background=not cfg.tracking.upload_checkpoints, stop=stop, device=opts.device,
        spool_dir=spool_folder(opts.workdir, opts.tracking_uri, embedded=opts.embedded_tracking),
        on_run_made=functools.partial(link_late_run, study._storage),
        study_uid=lambda: study_uid(study),
    )  # fmt: skip
