"""`hpsearch launch`: create or resume a study, run N supervised worker processes, report progress.

The launcher never trains. It places workers on GPUs, watches them, fails and re-queues the
trial of a worker that died, restarts the worker (bounded), and stops everything cleanly on
Ctrl-C: first signal = finish the current epoch and checkpoint, second = kill now.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import fcntl
import functools
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import optuna
from hpsearch.background import lower_priority
from hpsearch.config import StudyConfig, config_to_yaml
from hpsearch.errors import (
    EXIT_CONFIG,
    EXIT_DATA_ERROR,
    EXIT_DISK_FULL,
    ConfigError,
    DeviceError,
    HpsearchError,
    StorageError,
    TrackingError,
)
from hpsearch.packing import (
    GpuLedger,
    MemoryModel,
    PackingPlan,
    gpu_env,
    plan_from_probe,
    process_start,
)
from hpsearch.storage import (
    StorageSpec,
    heartbeat_storage,
    is_connection_error,
    open_storage,
    study_lock,
    with_db_retry,
)
from hpsearch.study import (
    CONFIG_ID_ATTR,
    CONFIG_OF_ATTR,
    LAUNCH_IDS_ATTR,
    best_of,
    budget_counts,
    budget_done,
    counts_once_requeued,
    create_or_load,
    enqueue_trials,
    enqueued_text,
    may_start_trial,
    other_configs,
    others_drift_note,
    pareto_front,
    study_budget,
    study_uid,
    trial_config_id,
)
from hpsearch.worker import (
    ATTR_BEST_MODEL,
    ATTR_CHECKPOINT_URI,
    ATTR_MESSAGE,
    ATTR_OUTCOME,
    ATTR_PID,
    ATTR_PID_START,
    ATTR_RUN_ID,
    ATTR_WORKER,
    dead_outcome,
    disk_stop,
    retried_trials,
    retry_callback,
    worker_alive,
)
from optuna.trial import FrozenTrial, TrialState
from sqlalchemy.exc import SQLAlchemyError

if TYPE_CHECKING:
    from hpsearch.tracking.server import StoreLock

AWAIT_STUDY_RUN_S = 240.0  # s: the embedded server's start-up limit (180 s) plus margin
SERVER_RESTARTS = 3  # restarts of a launch's embedded MLflow server that died mid-study

# --- pure decisions ---------------------------------------------------------------------


def parse_gpus(value: str | None) -> list[str] | None:
    """`--gpus 0,1` -> ["0", "1"]; None keeps CUDA_VISIBLE_DEVICES as it is."""
    if value is None:
        return None
    items = [v.strip() for v in value.split(",")]
    if any(not v for v in items):
        raise ConfigError(f"--gpus: {value!r}: expected a comma-separated list like 0,1")
    for item in items:
        if not ((item.isascii() and item.isdigit()) or item.upper().startswith(("GPU-", "MIG-"))):
            raise ConfigError(f"--gpus: {item!r}: not a GPU index (0, 1, ...) or a GPU-/MIG- UUID")
    return items


def check_gpus(gpus: list[str] | None, available: int, device: str) -> None:
    if device == "cpu" and gpus:
        raise ConfigError(f"--gpus: {','.join(gpus)!r}: cannot be combined with --device cpu")
    if device.startswith("cuda") and available == 0:
        raise DeviceError(f"--device: {device!r}: CUDA is not available on this machine")
    for g in gpus or []:
        if g.isdigit() and int(g) >= available:
            raise DeviceError(
                f"--gpus: {g!r}: no such GPU; this machine has {available} "
                f"(valid: {', '.join(map(str, range(available))) or 'none'})"
            )
    if gpus and available == 0:  # UUIDs, with no GPU at all: not quietly the CPU
        raise DeviceError(f"--gpus: {','.join(gpus)!r}: CUDA is not available on this machine")


def assign_gpus(n_workers: int, gpus: Sequence[str] | None) -> list[str | None]:
    """Round-robin: worker i gets gpus[i % len(gpus)]; several workers may share one GPU."""
    if not gpus:
        return [None] * n_workers
    return [gpus[i % len(gpus)] for i in range(n_workers)]


def _child_env(base: Mapping[str, str], gpu: str | None) -> dict[str, str]:
    """`base` placed on `gpu` for a process that loads the launch's resolved study file,
    which holds the launch's data folder (--data-dir, or HPSEARCH_DATA_DIR): the variable
    would win over it."""
    env = gpu_env(base, gpu)
    env.pop("HPSEARCH_DATA_DIR", None)
    return env


LAUNCHED_ENV = "HPSEARCH_LAUNCHED"


def worker_env(
    base: Mapping[str, str],
    storage_url: str,
    gpu: str | None,
    cpu_threads: int | None,
    tracking_uri: str | None = None,
    embedded_tracking: bool = False,
) -> dict[str, str]:
    """A worker's environment: `base` placed on `gpu` (`gpu_env`, as the probe is), the
    storage URL and the MLflow tracking URI, which may hold a password, in the environment
    rather than in argv (`ps` shows argv), and `cpu_threads` intra-op threads unless the
    user set OMP_NUM_THREADS. `embedded_tracking`: the URI is the work folder's own server
    (its runs kept while it is down go to its spool folder, whatever its port)."""
    from hpsearch.tracking.server import EMBEDDED_TRACKING_ENV, TRACKING_URI_ENV

    env = _child_env(base, gpu)
    env[LAUNCHED_ENV] = "1"  # a launch's worker, not one of its own (`WorkerOptions.joined`)
    env["HPSEARCH_STORAGE"] = storage_url
    env.pop(EMBEDDED_TRACKING_ENV, None)
    if tracking_uri:
        env[TRACKING_URI_ENV] = tracking_uri
        if embedded_tracking:
            env[EMBEDDED_TRACKING_ENV] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    if cpu_threads is not None:
        env.setdefault("OMP_NUM_THREADS", str(cpu_threads))
    return env


def auto_workers(
    study_file: Path,
    gpus: Sequence[str],
    workdir: Path,
    max_per_gpu: int = 8,
    timeout_s: float = 900.0,
) -> PackingPlan:
    """`--workers auto`: probe the study's trial shapes on the first GPU (in a child
    process, so this one holds no CUDA context), then pack each GPU by its free memory
    (the probe reads every GPU's before it trains). The plan is saved beside the study file
    (`<workdir>/run/<study>.packing.json`, `packing_path`); its workers reserve memory by
    it. Call it under the study's launch lock (`hold_launch_lock`)."""
    if not gpus:
        raise DeviceError("--workers auto: no GPU is visible; give --workers N")
    out = study_file.with_suffix(".probe.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    # The first GPU as device 0, as its workers will see it; the others after it, in order,
    # so that the probe reads their free memory too.
    env = _child_env(os.environ, ",".join(gpus))
    cmd = [sys.executable, "-m", "hpsearch.probe", "--study", str(study_file), "--out", str(out)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise DeviceError(f"--workers auto: the GPU probe took over {timeout_s:.0f} s") from exc
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        last = (
            lines[-1].removeprefix("probe: ").removeprefix("--workers auto: ")
            if lines
            else "no output"
        )
        raise DeviceError(
            f"--workers auto: the GPU probe failed (exit code {proc.returncode}): {last}"
        )
    raw = json.loads(out.read_text())
    models = [MemoryModel(**m) for m in raw["models"]]
    free = [None if b is None else int(b) for b in raw.get("free_bytes", [])]
    # Another study's workers in this work folder reserve in the same ledgers: the memory they
    # use is out of the free figure and in their reservations, which the ledgers must not
    # count twice.
    held = {g: sum(GpuLedger(workdir, g, 0).reserved().values()) for g in gpus}
    plan = plan_from_probe(
        gpus, int(raw["total_bytes"]), models, int(raw["worst_trial_bytes"]),
        float(raw["busy"]), max_per_gpu, int(raw.get("data_bytes", 0)), free, held,
    )  # fmt: skip
    packing_path(study_file).write_text(plan.to_json())
    return plan


def packing_path(study_file: Path) -> Path:
    """Where `auto_workers` saves the plan of the study whose resolved file is `study_file`
    (each study of a work folder packs by its own trials' sizes)."""
    return study_file.with_suffix(".packing.json")


def hold_launch_lock(workdir: Path, name: str) -> IO[str]:
    """One launch per study and work folder: a second one's workers would share the
    first's worker names and logs, its stop would fail the first's trials, and its study
    file and `--workers auto` probe would replace the first's. The lock on
    `run/<name>.lock` is held while the returned file is open, and until this process exits
    (the kernel drops it even after a SIGKILL)."""
    path = Path(workdir) / "run" / f"{name}.lock"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fh = open(path, "a+")  # noqa: SIM115 - kept open: the lock lives with it
    except OSError as exc:
        raise ConfigError(
            f"--workdir: {workdir}: cannot write {exc.filename or path}: {exc.strerror or exc}"
        ) from exc
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        holder = fh.read().strip() or "?"
        fh.close()
        raise ConfigError(
            f"study {name!r} is already being launched from {workdir} (pid {holder}); add "
            "workers to it with `hpsearch worker`, or use another --workdir"
        ) from None
    fh.truncate(0)
    fh.write(str(os.getpid()))
    fh.flush()
    return fh


# A worker's exit code after a graceful stop by SIGINT or SIGTERM (128 + the signal's
# number, the shell's convention): its trial was handed back to resume, none was lost.
STOPPED_EXIT_CODES = (128 + signal.SIGINT, 128 + signal.SIGTERM)


def _all_stopped_for(reasons: list[str | None]) -> str | None:
    """The reason when every worker stopped for the work folder's disk, or for its data
    (none started: None)."""
    return reasons[0] if reasons and all(reasons) else None


def should_restart(
    exit_code: int, restarts: int, max_restarts: int, budget_left: bool, disk_full: bool = False
) -> bool:
    """A worker that exited with an error is restarted while it has restarts left, unless
    it stopped for a full disk (EXIT_DISK_FULL) that is still full, for its data
    (EXIT_DATA_ERROR) or for a --train-fn that does not load (EXIT_CONFIG): the restart
    would stop the same way. (A dip while a packed
    neighbour wrote its checkpoint may be over.)"""
    if exit_code == EXIT_DISK_FULL and disk_full:
        return False
    if exit_code in (EXIT_DATA_ERROR, EXIT_CONFIG):  # the same data, the same train_fn
        return False
    return exit_code != 0 and budget_left and restarts < max_restarts


# Launch outcomes that end as the user asked: the study run is closed FINISHED with the
# study's artifacts (CSV, plots, the best model's ONNX) of the trials so far.
ENDED_AS_ASKED = ("budget", "timeout")


def launch_outcome(supervised: str, budget_spent: bool, deadline_passed: bool) -> str:
    """How a launch ended, from what supervising saw and the study's counts once every
    worker is gone: "budget" whenever the budget is spent (a Ctrl-C after the last trial
    was told still ends the study), else the stop asked for ("interrupted"), every worker
    crashed ("workers_failed"), `--timeout` ("timeout"), or "stopped": the workers ended
    with trials of the budget left, stopped from outside (a SIGTERM of their own each time,
    past `--max-restarts`)."""
    if budget_spent:
        return "budget"
    if supervised in ("interrupted", "workers_failed"):
        return supervised
    return "timeout" if deadline_passed else "stopped"


def eta_seconds(
    finished: int,
    total: int,
    elapsed_s: float,
    finished_here: int | None = None,
    running: Sequence[tuple[int, int]] = (),
    max_epochs: int = 1,
) -> float | None:
    """Seconds until `total` trials are finished, at the rate of the work done in the
    `elapsed_s` this launch has run: the trials it finished (`finished_here`; default all
    `finished`: a resumed study's earlier trials took none of this launch's time) plus the
    share of `max_epochs` its running trials trained, each given as (last epoch reported,
    the epoch it had reached before this launch ran it; 0 for a fresh start). Without them
    the ETA showed nothing until a trial ended, then climbed through each long trial. A
    trial past its last epoch still has its end (the test split's evaluation, its uploads):
    half an epoch is left of it (the ETA said 0 s through the last trial's end)."""
    here = float(finished if finished_here is None else finished_here)
    left = float(total - finished)
    for last, resumed_from in running:
        last = min(max(last, 0), max_epochs)
        here += max(last - resumed_from, 0) / max_epochs
        left -= min(last, max_epochs - 0.5) / max_epochs
    if here <= 0 or finished >= total:
        return None
    return elapsed_s / here * max(left, 0.0)


def running_epochs(trials: Sequence[FrozenTrial], seen: dict[int, int]) -> list[tuple[int, int]]:
    """For `eta_seconds`: each RUNNING trial's (last epoch reported, epoch it had reached
    before this launch ran it). A retry starts with its chain's reports, which took none of
    this launch's time: the epoch it showed when first seen, kept in `seen` (trial number
    -> epoch) across calls; a fresh trial's is 0."""
    out = []
    for t in trials:
        if t.state != TrialState.RUNNING:
            continue
        last = int(max(t.intermediate_values, default=0))
        base = last if t.system_attrs.get("retry_history") else 0
        out.append((last, seen.setdefault(t.number, base)))
    return out


# --- state -----------------------------------------------------------------------------


@dataclass(frozen=True)
class LaunchOptions:
    workers: int
    workdir: Path
    gpus: list[str] | None = None
    device: str = "auto"
    tracking_uri: str | None = None  # None: embedded server unless tracking is off
    tracking: bool = True
    timeout_s: float | None = None
    train_fn: str = ""
    max_restarts: int = 3  # per worker slot
    max_retries: int = 2  # per trial
    heartbeat_interval_s: int = 10
    grace_s: float = 120.0  # first Ctrl-C: wait this long for epoch boundaries
    progress_every_s: float = 2.0
    started_at: float | None = None  # time.monotonic() when the command began: --timeout's 0
    placement: list[str] | None = None  # GPU per worker (--workers auto); else round-robin
    packing: Path | None = None  # the auto plan: workers reserve GPU memory by it


@dataclass(frozen=True)
class WorkerView:
    slot: int
    pid: int | None
    gpu: str | None
    trial: int | None
    state: str  # running | done | crashed | stopped


@dataclass(frozen=True)
class Progress:
    counts: dict[str, int]
    input_bound: dict[int, float]  # running trial -> mean GPU utilization % when flagged
    n_trials: int
    best_value: float | None
    best_trial: int | None
    workers: list[WorkerView]
    elapsed_s: float
    eta_s: float | None
    message: str = ""  # an event: worker died, restarted, ...
    # s since the figures were read, when the database did not answer this time (None:
    # read now); a restart or network cut leaves the last figures on show, said so.
    stale_s: float | None = None
    never_read: bool = False  # ... and none were ever read: the figures are zeros
    pareto: tuple[int, ...] | None = None  # a multi-objective study's front: trial numbers


@dataclass
class LaunchSummary:
    counts: dict[str, int]
    best_value: float | None
    best_trial: int | None
    stopped_by: str
    tracking_uri: str | None
    restarts: int = 0
    messages: list[str] = field(default_factory=list)
    disk_full: str | None = None  # why, when every worker stopped for the work folder's disk
    pareto: tuple[int, ...] | None = None  # a multi-objective study's front: trial numbers
    data_error: str | None = None  # a worker's last log line, when every one's data failed


@dataclass
class _Slot:
    index: int
    gpu: str | None
    proc: subprocess.Popen[bytes] | None = None
    log: IO[bytes] | None = None
    restarts: int = 0
    state: str = "starting"
    crashes: int = 0  # exits that were neither a stop from outside nor the launch's own kill
    killed_on_stop: bool = False  # SIGKILLed by a second stop: its trials were interrupted
    group_killed: bool = False  # its process's group killed, as its exit was seen (_poll)
    disk_full: str | None = None  # why it was not restarted after EXIT_DISK_FULL
    data_error: str | None = None  # its log's last line, when it stopped with EXIT_DATA_ERROR

    @property
    def worker_id(self) -> str:
        return f"{socket.gethostname()}:w{self.index}"


def _load_libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None


# Loaded before any fork: a dlopen in the forked child could hang on a loader lock that a
# thread of this process (importing MLflow) held at the fork, and Popen with it.
_LIBC = _load_libc()


def _set_pdeathsig() -> None:
    # Workers die with the launcher even if it is SIGKILLed: no orphans.
    if _LIBC is not None:
        with contextlib.suppress(OSError, AttributeError):
            _LIBC.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def fail_trial(
    study: optuna.Study,
    spec: StorageSpec,
    trial: FrozenTrial,
    reason: str,
    max_retries: int,
    interrupted: bool = False,
) -> bool:
    """Mark a RUNNING trial FAIL with a reason and queue its params to resume. False if it
    had already finished (another process got there first). `interrupted`: its worker was
    killed by a stop asked for, which uses none of the chain's retries.

    Under the study lock: the failure and the retry's queueing are two commits, and a
    worker asking between them would see a free place in the budget (a study of one trial
    then ran two)."""
    storage = study._storage
    with study_lock(spec, study.study_name):
        try:
            # The word its MLflow run is tagged with (`runs.mark_run_failed`).
            outcome = dead_outcome(reason, interrupted)
            storage.set_trial_user_attr(trial._trial_id, ATTR_OUTCOME, outcome)
            storage.set_trial_user_attr(trial._trial_id, ATTR_MESSAGE, reason)
            failed = storage.set_trial_state_values(trial._trial_id, state=TrialState.FAIL)
        except optuna.exceptions.UpdateFinishedTrialError:
            failed = False
        frozen = storage.get_trial(trial._trial_id)
        if not failed and not failed_here_before(frozen, reason):
            return False  # finished elsewhere
        # Unless a try of this call whose reply was lost queued it already
        if failed or not retried_trials(study, [frozen.number]):
            retry_callback(max_retries).requeue(study, frozen, interrupted=interrupted)
    return True


def failed_here_before(trial: FrozenTrial, reason: str) -> bool:
    """Whether `fail_trial` failed `trial` for `reason` already: a database outage after
    that commit made `with_db_retry` run it again, which found the trial finished and
    queued no retry, and the dead worker's epochs were lost."""
    return (
        trial.state == TrialState.FAIL
        and trial.user_attrs.get(ATTR_OUTCOME) in ("failed", "interrupted")
        and trial.user_attrs.get(ATTR_MESSAGE) == reason
    )


def launched_by(attrs: Mapping[str, Any], pids: Mapping[int, int | None] | None) -> bool:
    """Whether the worker process a trial names (its `pid` and `pid_start` attributes) is
    one of `pids` ({pid: start ticks}, the processes one launch started; None: any). Two
    launches on one host name their workers alike (`host:w0`), so the name alone does not
    tell whose a trial is. A trial of a worker that recorded no pid (an older version's)
    counts as anyone's."""
    pid = attrs.get(ATTR_PID)
    if pids is None or not isinstance(pid, int):
        return True
    if pid not in pids:
        return False
    start, ours = attrs.get(ATTR_PID_START), pids[pid]
    return not isinstance(start, int) or ours is None or start == ours


def finished_by(trials: Sequence[FrozenTrial], pids: Mapping[int, int | None]) -> int:
    """How many trials one launch's workers (`pids`, as `launched_by`) completed or pruned:
    its ETA's rate. Not every trial finished since it opened the study (QA: an idle launch
    beside another of the study showed that one's rate as its own)."""
    return sum(
        t.state in (TrialState.COMPLETE, TrialState.PRUNED)
        and isinstance(t.user_attrs.get(ATTR_PID), int)
        and launched_by(t.user_attrs, pids)
        for t in trials
    )


def requeue_cut_handbacks(
    study: optuna.Study,
    spec: StorageSpec,
    worker_ids: Collection[str],
    since: datetime.datetime,
    max_retries: int,
    pids: Mapping[int, int | None] | None = None,
) -> list[int]:
    """Queue the retries of trials these workers handed back (FAIL, outcome "interrupted",
    ended `since` or later) that have none: a worker killed between the hand-back's two
    commits (a second stop, or past the grace) left its trial failed, never to resume. As
    interrupted (no crash retry), under the study lock; the trials queued. `pids`: the
    workers' processes (`launched_by`)."""
    cut = [
        t
        for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,))
        if t.user_attrs.get(ATTR_WORKER) in worker_ids
        and launched_by(t.user_attrs, pids)
        and t.user_attrs.get(ATTR_OUTCOME) == "interrupted"
        and t.datetime_complete is not None
        and t.datetime_complete >= since
    ]
    if not cut:
        return []
    queued = []
    with study_lock(spec, study.study_name):
        retried = retried_trials(study, [t.number for t in cut])
        for t in cut:
            if t.number not in retried:
                frozen = study._storage.get_trial(t._trial_id)
                retry_callback(max_retries).requeue(study, frozen, interrupted=True)
                queued.append(t.number)
    return queued


OWNERLESS_AFTER_S = 60.0  # a worker names itself on its trial within a second of claiming it


def fail_orphans_on_this_host(
    study: optuna.Study,
    spec: StorageSpec,
    max_retries: int,
    ownerless_after_s: float = OWNERLESS_AFTER_S,
) -> list[int]:
    """RUNNING trials whose worker process on this host is gone (a previous launcher was
    killed). The journal storage has no heartbeat, so the launcher does this at start.
    On it, a trial that no worker named itself on for `ownerless_after_s` seconds is failed
    too (a worker names itself on its claim, worker._next_trial): its worker died between
    the two, or was an older version's, whose sampler could raise there; a launch would
    otherwise wait for it forever. On PostgreSQL the claim's first heartbeat lets the
    stale check find such a trial."""
    now = datetime.datetime.now()  # Optuna dates trials in naive local time
    failed = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        gone = worker_alive(t.user_attrs) is False
        reason = f"worker pid {t.user_attrs.get(ATTR_PID)} is gone"
        started = t.datetime_start
        if not gone and spec.kind == "journal" and ATTR_PID not in t.user_attrs:
            age_s = (now - started).total_seconds() if started is not None else float("inf")
            gone, reason = age_s > ownerless_after_s, "no worker took it up"
        if gone and fail_trial(study, spec, t, reason, max_retries):
            failed.append(t.number)
    return failed


def _best(
    study: optuna.Study, trials: Sequence[FrozenTrial] | None = None
) -> tuple[float | None, int | None]:
    """The best trial's value and number (`best_of`) from `trials`, else the study's."""
    if len(study.directions) > 1:
        return None, None
    if trials is None:
        trials = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    best = best_of(trials, study.direction)
    return (best.value, best.number) if best is not None else (None, None)


def lost_model_note(trial: FrozenTrial) -> str:
    """A line for the study's best trial when its best-model file was not written (its last
    write found the disk full: the value stands, `not saved: ...` in its message), else ''.
    QA: the launch ended `done`, and only `load_best_model` said there was no model."""
    from hpsearch.trainer.types import unsaved_note

    attrs = trial.user_attrs
    why = unsaved_note(str(attrs.get(ATTR_MESSAGE, "")))
    if ATTR_BEST_MODEL in attrs or ATTR_CHECKPOINT_URI in attrs or why is None:
        return ""
    return (
        f"trial {trial.number}, the study's best, kept no model ({why}): with room on the "
        f"disk, `hpsearch train --trial {trial.number}` trains it again"
    )


def spent_note(name: str, counts: Mapping[str, int], budget: int) -> str:
    """A relaunch whose budget its study's trials (`counts`, as it opened the study)
    already spent (a file's n_trials below a `--trials` given before): it ran none, said
    nowhere but `/ 2` beside 3 finished."""
    finished = counts["complete"] + counts["pruned"]
    if finished < budget or counts["waiting"] or counts["running"]:
        return ""
    return (
        f"study {name} has {finished} finished trial{'' if finished == 1 else 's'}, "
        f"budget.n_trials is {budget}: none "
        f"runs; --trials N (N above {finished}) runs more"
    )


def _pareto(study: optuna.Study, trials: Sequence[FrozenTrial]) -> tuple[int, ...] | None:
    """A multi-objective study's Pareto front (trial numbers, by its first objective, best
    first); None for a single objective, whose best `_best` gives."""
    if len(study.directions) < 2:
        return None
    directions = [d.name.lower() for d in study.directions]
    return tuple(t.number for t in pareto_front(trials, directions))


def format_best(value: float | None, trial: int | None, pareto: tuple[int, ...] | None) -> str:
    """The best so far for the terminal: `0.8123 (trial 4)`; a multi-objective study's
    front, `pareto 3 (trials 4, 1, 7)` (its first 5 trials); `-` for none yet."""
    if value is not None:
        return f"{value:.4f} (trial {trial})"
    if pareto:
        shown = ", ".join(map(str, pareto[:5])) + (", ..." if len(pareto) > 5 else "")
        return f"pareto {len(pareto)} (trial{'s' if len(pareto) > 1 else ''} {shown})"
    return "-"


class Launcher:
    """Runs one launch. `stop()` once = graceful, twice = kill now."""

    def __init__(
        self,
        cfg: StudyConfig,
        spec: StorageSpec,
        opts: LaunchOptions,
        on_progress: Callable[[Progress], None] | None = None,
        launch_lock: IO[str] | None = None,
    ) -> None:
        """`launch_lock`: the caller's `hold_launch_lock` of this study, handed over."""
        if opts.workers < 1:
            raise ConfigError(f"--workers: {opts.workers}: must be at least 1")
        self.cfg = cfg
        self.spec = spec
        self.opts = opts
        self.on_progress = on_progress
        self._stop_requests = 0
        self._launch_lock = launch_lock  # run/<study>.lock, held while running
        self._lock = threading.RLock()  # reentrant: stop() may run under it (a test's spawn)
        self._slots: list[_Slot] = []
        self._pids: dict[int, int | None] = {}  # every worker process started: {pid: start}
        self._messages: list[str] = []
        self._server: Any = None
        self._started_at = datetime.datetime.now()  # of the launch (run), local like Optuna's
        self._tracking_uri: str | None = None
        self._prepared = False  # _prepare_finish ran
        self._finalizer: threading.Thread | None = None  # study artifacts, once all finished
        self._tracking_thread: threading.Thread | None = None  # server start + study run
        # The server answered before any worker started (a --tracking-uri checked, or an
        # embedded one already serving): a worker that finds it down waits for no start.
        self._server_answered = False
        self._uid: str | None = None  # the study's (study_uid): its MLflow runs carry it
        self._adopt_legacy = False  # (`open_study_run`'s)
        self._restarting: threading.Thread | None = None  # the embedded server's restart
        self._server_restarts = 0
        self._server_gone = False  # the embedded server died and was not started again
        # Set once the study opened (self._study) or never will: the study run is touched
        # only after the storage accepted this launch (a refused one changes nothing).
        self._study_settled = threading.Event()
        self._tracking_error: HpsearchError | None = None
        self._finalized: list[str] = []
        self._last_trials: list[FrozenTrial] = []
        self._last_best: tuple[float | None, int | None] = (None, None)
        self._eta_base: dict[int, int] = {}  # running trial -> epoch reached when first seen
        self._counts_at_open: dict[str, int] = {}
        # A multi-objective study's front, and the completed trials it is of (`_pareto_of`)
        self._pareto_key: tuple[int, int] | None = None
        self._pareto_seen: tuple[int, ...] | None = None
        self._opened_at = time.monotonic()  # set again once the study is open
        self._read_at: float | None = None  # when _last_trials were read
        # The study's n_trials as last read (`_budget_now`): another launch of the study,
        # or a worker given --trials, may set it while this one runs.
        self._budget = cfg.budget.n_trials
        self._configs_seen: set[str] = set()  # (`_drift_now`), filled as the study opens
        self._study: optuna.Study | None = None  # opened in run(), after the workers start
        self._early_events: list[str] = []  # progress events from before that
        # Dead workers' trials without an MLflow run, failed once the tracking set-up is over:
        # (trial, reason, interrupted by a second stop)
        self._held: list[tuple[FrozenTrial, str, bool]] = []
        self._held_ids: set[int] = set()
        self._held_beat_at = 0.0  # time.monotonic() of the launcher's last beat for them

    @property
    def study(self) -> optuna.Study:
        if self._study is None:
            raise RuntimeError("the launcher's study is opened in run()")
        return self._study

    def stop(self) -> None:
        """The first call stops the workers gracefully (SIGTERM: each hands its trial back);
        a second kills them and what they started (their process groups)."""
        with self._lock:  # a worker started meanwhile (_start_unless_stopping) is seen here
            self._stop_requests += 1
            n = self._stop_requests
            for s in self._slots:
                if s.proc is not None and self._poll(s) is None:
                    s.killed_on_stop = n > 1
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        if n == 1:
                            s.proc.send_signal(signal.SIGTERM)
                        else:
                            os.killpg(s.proc.pid, signal.SIGKILL)

    def _start_unless_stopping(self, slot: _Slot, resolved: Path, tracking_uri: str | None) -> bool:
        """Start `slot`'s worker unless a stop was asked for; under the lock `stop` takes,
        so a worker started while a stop comes is signalled by it, never missed."""
        with self._lock:
            if self._stop_requests:
                return False
            if all(s is not slot for s in self._slots):
                self._slots.append(slot)
            self._spawn(slot, resolved, tracking_uri)
            return True

    def _event(self, msg: str) -> None:
        self._messages.append(msg)
        if self.on_progress is None:
            return
        with self._lock:
            if self._study is None:  # shown once the study is open (_open_study)
                self._early_events.append(msg)
                return
        self.on_progress(self._progress(msg))

    def _open_study(self) -> None:
        storage = open_storage(self.spec, pool_size=1)
        study = with_db_retry(lambda: create_or_load(self.cfg, storage), what="create study")
        trials = with_db_retry(lambda: study.get_trials(deepcopy=False))
        done = budget_counts(trials)
        self._uid = with_db_retry(lambda: study_uid(study))
        if self._uid is None:  # its first launch by this version: it gets one
            # A study an earlier version ran (trials already) takes that version's study
            # run, which no uid tags; a new one never does: it is another study's (review).
            self._adopt_legacy = sum(done.values()) > 0
            self._uid = with_db_retry(
                lambda: study_uid(
                    study, mint=True, lock=lambda: study_lock(self.spec, self.cfg.name)
                )
            )
        self._counts_at_open = done  # (`spent_note`)
        # This launch's config and earlier launches' (the last one's drift was said as the
        # study opened); any other, a worker's own, is said once as its trials show, those
        # already there included (`_drift_now`; review: a worker trained on, unsaid).
        launches = with_db_retry(lambda: study.user_attrs.get(LAUNCH_IDS_ATTR)) or []
        self._configs_seen = {trial_config_id(self.cfg), *map(str, launches)}
        queued = with_db_retry(
            lambda: enqueue_trials(
                study, self.cfg, lambda: study_lock(self.spec, self.cfg.name), owner=True
            ),
            what="queue enqueue_trials",
        )
        with self._lock:
            self._study = study
            self._opened_at = time.monotonic()  # the database answered then
            early, self._early_events = self._early_events, []
        for msg in early:
            if self.on_progress is not None:
                self.on_progress(self._progress(msg))
        for number, why in queued.failed:
            self._event(f"trial {number} (queued, never run) failed: {why}")
        if queued.waiting or queued.left:
            n_trials = study_budget(study, self.cfg)
            src = self.cfg.source or self.cfg.name
            self._event(enqueued_text(queued.waiting, queued.left, n_trials, src))

    def run(self) -> LaunchSummary:
        """Run the launch; the launch lock (`hold_launch_lock`) is taken here unless the
        caller holds it (given to the constructor), and released at the end either way."""
        resolved = self.opts.workdir / "run" / f"{self.cfg.name}.yaml"
        if self._launch_lock is None:
            self._launch_lock = hold_launch_lock(self.opts.workdir, self.cfg.name)
        try:
            return self._run_locked(resolved)
        finally:
            if self._launch_lock is not None:
                self._launch_lock.close()  # releases the lock
                self._launch_lock = None

    def _run_locked(self, resolved: Path) -> LaunchSummary:
        cfg, opts = self.cfg, self.opts
        try:
            resolved.write_text(config_to_yaml(cfg))
        except OSError as exc:
            raise ConfigError(f"--workdir: cannot write {resolved}: {exc.strerror or exc}") from exc
        placement = opts.placement or assign_gpus(opts.workers, opts.gpus)
        if not cfg.search_space:
            # Legitimate (bench/packing.py measures fixed params so), but rarely meant.
            self._event(
                f"{cfg.source or cfg.name}: search_space is empty: every trial trains "
                "trainer.defaults"
            )
        tracking_uri = self._start_tracking()
        self._tracking_uri = tracking_uri
        self._t0 = opts.started_at if opts.started_at is not None else time.monotonic()
        self._started_at = datetime.datetime.now()
        stopped_by = "error"
        try:
            # Workers start first: their imports (torch: seconds) overlap with this
            # process's own connection and study set-up below. Optuna's create_study with
            # load_if_exists tolerates the race of whoever creates the study first.
            for i, gpu in enumerate(placement):
                slot = _Slot(i, gpu)
                if not self._start_unless_stopping(slot, resolved, tracking_uri):
                    break  # Ctrl-C while starting: start no more
            try:
                self._open_study()
                self._study_settled.set()  # (the finally below sets it when this raised)
                # Orphans are RUNNING trials of dead processes on this host: the workers
                # just started have none yet (they are still importing).
                if orphans := fail_orphans_on_this_host(self.study, self.spec, opts.max_retries):
                    self._event(f"its worker was gone: {self._requeued_text(orphans)}")
                if note := spent_note(self.cfg.name, self._counts_at_open, self._budget):
                    self._event(note)
                supervised = self._supervise(resolved, tracking_uri)
            except Exception:
                # The launch fails (its MLflow set-up, say), but the workers have trained
                # meanwhile: they stop as on a Ctrl-C, each handing its trial back, before
                # the kill below takes what is left after the grace. (Without the study
                # they hold no trial.)
                if not self._stop_requests:
                    self.stop()
                    if self._study is not None:
                        self._wait_stopping()
                raise
            stopped_by = self._outcome(supervised)
        finally:
            try:
                self._study_settled.set()
                self._kill_all()
                while self._restarting is not None and self._restarting.is_alive():
                    self._restarting.join(1.0)  # the dead workers' runs go to it
                    self._beat_held()  # seconds: theirs are not found stale meanwhile
                if self._study is not None:
                    self._cleanup_running()
                if self._tracking_thread is not None:
                    self._tracking_thread.join()
                if self._server_dead():  # its calls would wait out a server not there
                    self._event(
                        "MLflow: the study's summary is not sent (its server is gone); "
                        "the next launch sends the runs kept on disk"
                    )
                elif (  # a refused launch (the study never opened) leaves MLflow as it was
                    tracking_uri is not None
                    and self._tracking_error is None
                    and self._study is not None
                ):
                    self._finish_tracking(tracking_uri, stopped_by)
            finally:  # whatever failed above: the other users of the server keep it
                if self._server is not None and self._server.release() == "in use":
                    self._event(
                        "MLflow server left running: another search, `hpsearch ui` or "
                        "worker of this work folder uses it"
                    )
        if self._tracking_error is not None:
            # The set-up failed after the workers had spent the budget (seconds of MLflow's
            # import on a loaded machine): the trials stand, untracked; the launch says why.
            raise self._tracking_error
        trials = with_db_retry(lambda: self.study.get_trials(deepcopy=False))
        counts = budget_counts(trials)
        best_value, best_trial = _best(self.study, trials)
        best = next((t for t in trials if t.number == best_trial), None)
        if best is not None and (note := lost_model_note(best)):
            self._event(note)
        return LaunchSummary(
            counts,
            best_value,
            best_trial,
            stopped_by,
            tracking_uri,
            sum(s.restarts for s in self._slots),
            self._messages,
            _all_stopped_for([s.disk_full for s in self._slots]),
            _pareto(self.study, trials),
            _all_stopped_for([s.data_error for s in self._slots]),
        )

    def _outcome(self, supervised: str) -> str:
        """`launch_outcome` from the study as it is now (every worker is gone)."""
        try:
            counts = with_db_retry(lambda: budget_counts(self.study.get_trials(deepcopy=False)))
            spent = budget_done(counts, with_db_retry(lambda: study_budget(self.study, self.cfg)))
        except (SQLAlchemyError, optuna.exceptions.StorageInternalError, StorageError):
            spent = supervised == "budget"  # the database is gone: what supervising saw
        timeout = self.opts.timeout_s
        passed = timeout is not None and time.monotonic() - self._t0 >= timeout
        return launch_outcome(supervised, spent, passed)

    def _finish_tracking(self, uri: str, stopped_by: str) -> None:
        from hpsearch.runs import (
            SPOOL_FOLDER,
            _client,
            end_dangling_runs,
            finalize_study,
            link_late_run,
            spool_folder,
        )
        from hpsearch.tracking.mlflow_logger import close_study_run, find_study_runs, replay_spool

        logged: list[str] = []
        if self._finalizer is not None:  # started when the last trial was told
            self._finalizer.join()
            logged = self._finalized
        if stopped_by in ENDED_AS_ASKED and "trials.csv" not in logged:
            # The study's artifacts of what it has now; again where the server was down at
            # the last tell (QA: the run ended FINISHED with none, the server back by then).
            logged = finalize_study(self.cfg, self.spec, uri, self.study, self.opts.workdir)
            if "trials.csv" not in logged:
                self._messages.append(
                    "the study run's artifacts (trials.csv, plots, ONNX model) were not "
                    "logged (see the warnings above); launch again to log them"
                )
        self._messages += [f"logged {item} on the study run" for item in logged]
        try:
            client = _client(uri)
            exp = client.get_experiment_by_name(self.cfg.name)
            runs = find_study_runs(client, exp.experiment_id, self._uid) if exp else []
        except Exception:  # best effort: the study's results are in Optuna already
            exp, runs = None, []
        for run_id in runs[:1]:
            close_study_run(
                client, run_id, "FINISHED" if stopped_by in ENDED_AS_ASKED else "KILLED"
            )
        if exp is not None and (
            ended := end_dangling_runs(
                client, exp.experiment_id, self.study, self.cfg.reported_metric
            )
        ):
            self._messages.append(f"ended {len(ended)} MLflow run(s) their gone workers left")
        # After those (a kept run ended so gets its told best model uploaded), and over them:
        # a kept run's own metrics, status and end time are its worker's.
        # This server's folder, then the one folder that earlier versions kept for all.
        own = spool_folder(self.opts.workdir, uri, embedded=self.opts.tracking_uri is None)
        folders = ((own, False), (self.opts.workdir / SPOOL_FOLDER, True)) if exp else ()
        link = functools.partial(link_late_run, self.study._storage)
        if sent := sum(
            replay_spool(client, folder, mixed=mixed, on_made=link) for folder, mixed in folders
        ):
            self._messages.append(f"sent {sent} MLflow run(s) kept while the server was down")

    def _start_tracking(self) -> str | None:
        """The tracking URI, known at once. The slow part (starting the embedded server,
        importing MLflow, opening the study run: seconds each) runs on a thread while the
        workers start; their first trials train meanwhile (worker._LateRun). An explicit
        server that does not answer is refused here, before any worker starts."""
        if not self.opts.tracking:
            return None
        from hpsearch.tracking.server import (
            check_tracking_uri,
            free_port,
            join_server,
            store_lock,
        )

        port, starting = None, None
        if self.opts.tracking_uri:
            uri = self.opts.tracking_uri
            # Before any worker starts: their first trials train before the study run
            # exists (worker._LateRun), and a launch that cannot log would stop them.
            check_tracking_uri(uri)
            self._server_answered = True
        else:
            # One writer per SQLite store: the store's server when one runs (another
            # launch's, `hpsearch ui`'s, or one a killed launch left), else one started here.
            # The lock is held until it is up, so a launch starting meanwhile joins it; the
            # last of its users to leave stops it.
            starting = store_lock(self.opts.workdir).acquire()
        try:
            if starting is not None:
                self._server = join_server(self.opts.workdir)
                if self._server is not None:
                    starting.release()
                    starting, uri = None, self._server.url
                    self._server_answered = True
                else:
                    port = free_port()
                    uri = f"http://127.0.0.1:{port}"
            self._tracking_thread = threading.Thread(
                target=self._prepare_tracking,
                args=(uri, port, starting),
                daemon=True,
                name="tracking-setup",
            )
            self._tracking_thread.start()  # from here on, the thread releases the lock
        except BaseException:
            if starting is not None:
                starting.release()
            raise
        return uri

    def _prepare_tracking(self, uri: str, port: int | None, starting: StoreLock | None) -> None:
        from hpsearch.runs import open_study_run
        from hpsearch.tracking.server import last_server_error, redact_uri, start_local_server

        try:
            if starting is not None:  # under the store's lock, taken by _start_tracking
                try:
                    self._server = start_local_server(self.opts.workdir, port=port)
                finally:
                    starting.release()
            if not self.opts.tracking_uri:
                self._event(f"MLflow UI: {uri}")
            # After the server's start (it would inherit it; users browse it). Not idle:
            # workers wait for the study run, with a time limit, while they train.
            lower_priority()
            self._study_settled.wait()
            if self._study is None:
                return  # refused (its direction) or the storage failed: MLflow untouched
            # Again: the one recorded, where another first launch made one at once.
            with contextlib.suppress(SQLAlchemyError, optuna.exceptions.StorageInternalError):
                self._uid = study_uid(self.study) or self._uid
            open_study_run(self.cfg, self.spec, uri, self._uid, self._adopt_legacy)
        except HpsearchError as exc:  # raised in the supervising loop, which stops the workers
            self._tracking_error = exc
            if not self.opts.tracking_uri and (cause := last_server_error(self.opts.workdir)):
                # The work folder's server answered 5xx: why is in its log alone (QA: a full
                # disk, `database or disk is full`, showed as "too many 503 error responses").
                self._tracking_error = TrackingError(f"{exc}; its server's log says: {cause}")
        except Exception as exc:
            from mlflow.exceptions import MlflowException

            if not isinstance(exc, MlflowException | OSError):
                raise
            # MLflow refused the URI or its store (a bare path is a file store, which MLflow
            # 3 refuses): one line, and the launch stops as for a server that does not answer.
            first = str(exc).split(". ")[0].strip()
            hint = "" if uri.startswith(("http://", "https://")) else " (give http://HOST:PORT)"
            self._tracking_error = TrackingError(f"MLflow at {redact_uri(uri)}: {first}{hint}")

    def _tracking_ready(self) -> bool:
        """Whether the server and the study run are up; raises what setting them up raised."""
        if self._tracking_error is not None:
            raise self._tracking_error
        return self._tracking_thread is None or not self._tracking_thread.is_alive()

    def _spawn(self, slot: _Slot, resolved: Path, tracking_uri: str | None) -> None:
        opts = self.opts
        if slot.restarts and self._study is not None and (note := self._budget_now()):
            self._event(note)  # the budget set last, not one a tick old, goes to --trials
        cmd = [
            sys.executable, "-m", "hpsearch.cli", "worker",
            "--study", str(resolved),
            "--workdir", str(opts.workdir),
            "--device", opts.device,
            "--worker-id", slot.worker_id,
            # Each worker and each restart draws its own parameters (study.sampler_seed).
            "--sampler-stream", str(slot.index + opts.workers * slot.restarts),
            "--max-retries", str(opts.max_retries),
            "--heartbeat", str(opts.heartbeat_interval_s),
            # The launch's budget, which the worker records on the study itself: it may
            # ask before this process has opened the study (workers start first).
            "--trials", str(self._budget),  # a restart: the one set last (_budget_now)
        ]  # fmt: skip
        if tracking_uri:
            # The study run may still be in the making (_prepare_tracking): wait for it
            # rather than open a second one; as long as an embedded server may take to start.
            # A worker started once it is made (a restart) waits for none: during an
            # outage its first trial's tell waited out the limit (QA).
            # The URI itself goes in the environment (worker_env), as the storage URL does.
            made = self._tracking_error is None and (
                self._tracking_thread is not None and not self._tracking_thread.is_alive()
            )
            cmd += ["--await-study-run", "0" if made else f"{AWAIT_STUDY_RUN_S:.0f}"]
            if self._server_answered and not made:
                cmd += ["--server-answered"]
        else:
            cmd += ["--no-tracking"]
        if opts.timeout_s is not None:
            # An absolute time: the worker's own start-up (imports, connecting) counts too.
            remaining = opts.timeout_s - (time.monotonic() - self._t0)
            cmd += ["--deadline", f"{time.time() + max(remaining, 1.0):.3f}"]
        if opts.train_fn:
            cmd += ["--train-fn", opts.train_fn]
        if opts.packing is not None:
            cmd += ["--packing", str(opts.packing)]
        threads = None
        if opts.device == "cpu" or slot.gpu is None:
            # CPU trials share the cores: one thread pool per worker oversubscribes them.
            threads = max(1, (os.cpu_count() or 1) // opts.workers)
        env = worker_env(os.environ, self.spec.url, slot.gpu, threads, tracking_uri,
                         embedded_tracking=opts.tracking_uri is None)  # fmt: skip
        log_dir = opts.workdir / "logs"
        if slot.log is not None:
            slot.log.close()
        try:
            log_dir.mkdir(parents=True, exist_ok=True)
            slot.log = open(self._log_path(slot), "ab")  # noqa: SIM115
        except OSError as exc:
            raise ConfigError(
                f"--workdir: {opts.workdir}: cannot write {exc.filename or log_dir}: "
                f"{exc.strerror or exc}"
            ) from exc
        slot.proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=slot.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C reaches the launcher only; it forwards SIGTERM
            preexec_fn=_set_pdeathsig,
        )
        self._pids[slot.proc.pid] = process_start(slot.proc.pid)
        slot.group_killed = False
        slot.state = "running"

    def _supervise(self, resolved: Path, tracking_uri: str | None) -> str:
        last = 0.0
        while True:
            if self._tracking_ready():
                self._keep_server()
            restarting = self._restarting is not None and self._restarting.is_alive()
            # Their runs are recorded on the server: not while it starts again
            ready = not restarting and self._tracking_ready()
            if ready and self._held and (requeued := self._fail_held()):
                self._event(self._requeued_text(requeued))
            self._beat_held()
            alive = 0
            for slot in self._slots:
                if slot.proc is None or slot.state != "running":
                    continue
                code = self._poll(slot)
                if code is None:
                    alive += 1
                    continue
                self._on_exit(slot, code, resolved, tracking_uri)
                if slot.state == "running":
                    alive += 1
            if self._stop_requests:
                self._wait_stopping()
                return "interrupted"
            now = time.monotonic()
            # Once every trial is handed out, look more often: the study's artifacts start
            # as soon as the last trial is told, while the workers still shut down.
            every = min(self.opts.progress_every_s, 0.5) if self._prepared else None
            if now - last >= (every or self.opts.progress_every_s):
                last = now
                progress = self._progress()
                if self.on_progress is not None:
                    self.on_progress(progress)
                self._prepare_finish(progress.counts)
                self._finalize_early(progress.counts)
                if alive:
                    alive += self._restart_disk_stopped(progress.counts, resolved, tracking_uri)
            if alive == 0:
                return "budget" if not self._all_crashed() else "workers_failed"
            time.sleep(0.2)

    def _restart_disk_stopped(
        self, counts: dict[str, int], resolved: Path, tracking_uri: str | None
    ) -> int:
        """Workers stopped for the work folder's disk while others train, started again once
        it has room (a neighbour's checkpoint written, files removed), as restarts: while
        they have restarts left and the budget (`counts`: the study's) a trial to start; not
        once every trial is handed out, when the disk frees up as the study ends. Returns
        how many were started."""
        waiting = [s for s in self._slots if s.disk_full and s.state == "crashed"
                   and s.restarts < self.opts.max_restarts]  # fmt: skip
        if not waiting or not may_start_trial(counts, self._budget):
            return 0
        if disk_stop(self.opts.workdir, self.cfg.name):
            return 0
        started = 0
        for slot in waiting:
            slot.disk_full = None
            slot.restarts += 1
            if not self._start_unless_stopping(slot, resolved, tracking_uri):
                slot.state = "stopped"  # a stop came meanwhile
                break
            started += 1
            self._event(f"worker {slot.index}: the work folder's disk has room again; "
                        f"restarting it ({slot.restarts}/{self.opts.max_restarts})")  # fmt: skip
        return started

    def _keep_server(self) -> None:
        """Restart the embedded MLflow server, on its port, where it died mid-study (the
        kernel's out-of-memory killer, a stray kill): the UI comes back, and the workers,
        which keep on disk what they cannot send, send it once it answers. A server this
        launch started, or one it joined (a killed launch's, left running: its starter
        restarts none); at most SERVER_RESTARTS times. On a thread: a start takes seconds,
        and supervising goes on."""
        from hpsearch.tracking.server import LocalServer, SharedServer

        server = self._server
        if (
            not isinstance(server, LocalServer | SharedServer)
            or server.is_running()
            or (self._restarting is not None and self._restarting.is_alive())
            or self._stop_requests
        ):
            return
        code = server.proc.returncode if isinstance(server, LocalServer) else "unknown"
        if self._server_restarts >= SERVER_RESTARTS:
            if self._server_restarts == SERVER_RESTARTS:  # said once
                self._server_restarts += 1
                self._server_gone = True
                self._event(
                    f"MLflow server exited (code {code}) {SERVER_RESTARTS} times: not restarted; "
                    "runs are kept on disk and sent by the next launch"
                )
            return
        self._server_restarts += 1
        self._event(f"MLflow server exited (code {code}): restarting it on port {server.port}")
        self._restarting = threading.Thread(
            target=self._restart_server, args=(server,), daemon=True, name="mlflow-restart"
        )
        self._restarting.start()

    def _server_dead(self) -> bool:
        """The embedded server died and was not started again (or died as the launch
        stopped, when none is restarted)."""
        from hpsearch.tracking.server import LocalServer, SharedServer

        server = self._server
        return self._server_gone or (
            isinstance(server, LocalServer | SharedServer) and not server.is_running()
        )

    def _restart_server(self, dead: Any) -> None:
        from hpsearch.tracking.server import restart_server

        try:
            server = restart_server(dead, give_up=lambda: self._stop_requests > 0)
        except (TrackingError, OSError) as exc:
            self._server_restarts = SERVER_RESTARTS + 1  # not again
            self._server, self._server_gone = None, True
            self._event(
                f"MLflow server not restarted: {exc}; runs are kept on disk and sent by the "
                "next launch"
            )
            return
        if server is None:  # the launch is stopping: its runs are kept on disk
            self._server, self._server_gone = None, True
            return
        self._server = server
        self._event(f"MLflow server restarted at {server.url}")

    def _prepare_finish(self, counts: dict[str, int]) -> None:
        """Once every trial of the budget is handed out, import what the study's artifacts
        need on a background thread, while the last trials still train: the imports cost
        seconds that would otherwise come after the last trial."""
        if self._prepared or not (self._tracking_uri and self.cfg.tracking.onnx):
            return
        handed_out = counts["complete"] + counts["pruned"] + counts["running"]
        try:
            n_trials = study_budget(self.study, self.cfg)
        except (SQLAlchemyError, optuna.exceptions.StorageInternalError):
            return  # the database may be restarting; this is only a head start
        if counts["waiting"] or handed_out < n_trials:
            return
        self._prepared = True

        def warm_import() -> None:
            lower_priority()
            # What the study's artifacts need: MLflow and the plotting libraries (seconds).
            # Not torch: the best trial's worker exports its ONNX. A missing one is
            # reported by the step that needs it; this is a head start only.
            for name in ("hpsearch.tracking.artifacts", "optuna.visualization",
                         "optuna.visualization.matplotlib"):  # fmt: skip
                with contextlib.suppress(ImportError):
                    importlib.import_module(name)

        threading.Thread(target=warm_import, daemon=True, name="warm-import").start()

    def _finalize_early(self, counts: dict[str, int]) -> None:
        """Start the study's artifacts (finalize_study) on a thread once the budget is met
        with nothing running or queued: the trials are final, and the workers' own
        shut-down (their last MLflow runs, process exit) overlaps with it."""
        if self._finalizer is not None or self._stop_requests or not self._tracking_uri:
            return
        if not self._tracking_ready():
            return
        try:
            n_trials = study_budget(self.study, self.cfg)
        except (SQLAlchemyError, optuna.exceptions.StorageInternalError):
            return
        if not budget_done(counts, n_trials):
            return
        from hpsearch.runs import finalize_study

        uri = self._tracking_uri

        def run() -> None:
            lower_priority()
            self._finalized = finalize_study(
                self.cfg, self.spec, uri, self.study, self.opts.workdir
            )

        self._finalizer = threading.Thread(target=run, daemon=True, name="finalize-study")
        self._finalizer.start()

    def _all_crashed(self) -> bool:
        return all(s.state == "crashed" for s in self._slots)

    def _on_exit(self, slot: _Slot, code: int, resolved: Path, tracking_uri: str | None) -> None:
        if code == 0:
            slot.state = "done"
            return
        stopped = code in STOPPED_EXIT_CODES  # by a signal from outside: it handed back
        if not (stopped or slot.killed_on_stop):
            slot.crashes += 1
        how = f"signal {-code}" if code < 0 else f"exit code {code}"
        failed, held = self._fail_trials_of(
            slot.worker_id, f"worker died ({how})", slot.killed_on_stop
        )
        msg = f"worker {slot.index} {'was stopped' if stopped else 'died'} ({how})"
        if failed:
            msg += f"; {self._requeued_text(failed)}"
        if held:
            msg += f"; trial {', '.join(map(str, held))} re-queued once MLflow is up"
        if self._stop_requests:
            slot.state = "stopped"
            return
        trials = with_db_retry(lambda: self.study.get_trials(deepcopy=False))
        held_ids = {t._trial_id for t, *_ in self._held}
        running = [t for t in trials if t.state == TrialState.RUNNING]
        still_held = [t for t in running if t._trial_id in held_ids]  # not failed elsewhere
        counts = counts_once_requeued(budget_counts(trials), len(still_held))
        budget_left = may_start_trial(counts, self._budget)
        full = disk_stop(self.opts.workdir, self.cfg.name) if code == EXIT_DISK_FULL else None
        if should_restart(code, slot.restarts, self.opts.max_restarts, budget_left, bool(full)):
            slot.restarts += 1
            if not self._start_unless_stopping(slot, resolved, tracking_uri):
                slot.state = "stopped"  # a stop came while the study was read
                return
            self._event(f"{msg}; restarting it ({slot.restarts}/{self.opts.max_restarts})")
        else:
            # One stopped from outside each time (its trial handed back) did not crash: a
            # launch whose workers all end so is "stopped", not "every worker crashed".
            slot.state = "stopped" if stopped and not slot.crashes else "crashed"
            tail = self._log_tail(slot)
            why = "no restarts left" if budget_left else "no trial of the budget left to start"
            if full and budget_left:
                why = (
                    "its work folder's disk has no room (or is read-only): a restart would "
                    "stop the same way"
                )
                slot.disk_full = full
            if code == EXIT_DATA_ERROR:
                why = "its data failed: every trial and restart would fail the same way"
                slot.data_error = tail.removeprefix("Error: ")
            self._event(f"{msg}; not restarted ({why}). Last log line: {tail}")

    def _log_path(self, slot: _Slot) -> Path:
        # Per study: studies launched in one work folder number their workers alike.
        return self.opts.workdir / "logs" / f"{self.cfg.name}-worker-{slot.index}.log"

    def _log_tail(self, slot: _Slot) -> str:
        path = self._log_path(slot)
        try:
            lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return "(no log)"
        return lines[-1][:300] if lines else "(empty log)"

    def _fail_trials_of(
        self, worker_id: str, reason: str, interrupted: bool = False
    ) -> tuple[list[int], list[int]]:
        """Fail and re-queue the RUNNING trials of a worker that is gone: (failed, held).
        `held` died before their MLflow run was linked while the tracking set-up (the
        embedded server's start) still runs: their runs go under the study run, so they
        are failed once it is up (`_fail_held`), while this loop goes on supervising."""
        running = with_db_retry(
            lambda: self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        )
        mine = [
            t
            for t in running
            if t.user_attrs.get(ATTR_WORKER) == worker_id
            and launched_by(t.user_attrs, self._pids)
            and t._trial_id not in self._held_ids
        ]
        setting_up = self._tracking_setting_up()
        hold = {t._trial_id for t in mine if setting_up and not t.user_attrs.get(ATTR_RUN_ID)}
        self._held += [(t, reason, interrupted) for t in mine if t._trial_id in hold]
        self._held_ids |= hold
        self._beat_held(force=bool(hold))
        failed = self._fail([(t, reason) for t in mine if t._trial_id not in hold], interrupted)
        return failed, [t.number for t in mine if t._trial_id in hold]

    def _beat_held(self, force: bool = False) -> None:
        """Held trials are the launcher's until it fails them: it beats for them (every
        half heartbeat interval), or a worker's stale check would fail them first, and
        they would have no MLflow run. So a set-up that takes long (the embedded server's
        start has a time limit) holds their retries back as long; a killed launcher beats
        no more, and the stale check fails them then."""
        storage = heartbeat_storage(self.study._storage, enabled=False)
        now = time.monotonic()
        if not self._held or storage is None:
            return
        if not force and now - self._held_beat_at < self.opts.heartbeat_interval_s / 2:
            return
        self._held_beat_at = now
        for t, *_ in self._held:
            with contextlib.suppress(SQLAlchemyError, optuna.exceptions.StorageInternalError):
                storage.record_heartbeat(t._trial_id)

    def _requeued_text(self, failed: list[int]) -> str:
        """What became of failed trials: re-queued, or failed for good when their chain had
        no retries left (`--max-retries`)."""
        retried = with_db_retry(lambda: retried_trials(self.study, failed))
        again = [n for n in failed if n in retried]
        final = [n for n in failed if n not in retried]
        parts = [f"trial {', '.join(map(str, again))} re-queued to resume"] if again else []
        if final:
            parts.append(
                f"trial {', '.join(map(str, final))} failed, no retries left "
                f"(--max-retries {self.opts.max_retries})"
            )
        return "; ".join(parts)

    def _fail_held(self) -> list[int]:
        """Fail the trials `_fail_trials_of` held, once the tracking set-up is over. Each
        leaves the list once failed: what a database error interrupts is failed later."""
        failed: list[int] = []
        while self._held and not self._tracking_setting_up():
            # Its run's creation on a server just started can take seconds: beaten all the
            # while, or the restarted worker's stale check fails it first, without its run.
            trial, reason, interrupted = self._held[0]
            with self._beating_held():  # a second stop's kill uses no crash retry, held or not
                failed += self._fail([(trial, reason)], interrupted)
            self._held.pop(0)
        return failed

    @contextlib.contextmanager
    def _beating_held(self) -> Iterator[None]:
        """`_beat_held` from a thread (every half heartbeat interval) while the block runs
        (which leaves `_held` as it is)."""
        done = threading.Event()

        def beat() -> None:
            while True:
                self._beat_held(force=True)
                if done.wait(self.opts.heartbeat_interval_s / 2):
                    return

        thread = threading.Thread(target=beat, daemon=True, name="beat-held")
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()

    def _tracking_setting_up(self) -> bool:
        """The set-up, or the embedded server's restart, is running: dead workers' trials
        are held (and beaten for) until their runs can be recorded."""
        restarting = self._restarting is not None and self._restarting.is_alive()
        return restarting or (
            self._tracking_thread is not None and self._tracking_thread.is_alive()
        )

    def _fail(self, trials: list[tuple[FrozenTrial, str]], interrupted: bool = False) -> list[int]:
        """Fail and re-queue trials of dead workers; `interrupted`: killed by a second stop,
        which uses no crash retry (a kill past the grace does: a trial that hangs its
        worker would otherwise be retried without end)."""
        from hpsearch.runs import mark_run_failed_within, record_dead_trial_run_within

        failed = []
        uri = self._tracking_uri if self._tracking_error is None else None
        for t, reason in trials:
            if t._trial_id in self._held_ids:
                now = with_db_retry(lambda t=t: self.study._storage.get_trial(t._trial_id))
                if now.state != TrialState.RUNNING:  # failed elsewhere after all
                    continue
            # A trial that died before its MLflow run was linked gets its run (found by its
            # run key, or made), linked while the trial still runs: a finished trial takes
            # no attributes.
            try:
                run_id = record_dead_trial_run_within(
                    self.cfg, uri, t, reason, interrupted=interrupted, uid=self._uid
                )
            except TrackingError as exc:  # a server that hangs: not again for the others
                self._event(f"{exc}; no MLflow runs for the dead workers' other trials")
                run_id, uri = None, None
            if run_id is not None:
                with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError):
                    with_db_retry(
                        lambda t=t, r=run_id: self.study._storage.set_trial_user_attr(
                            t._trial_id, ATTR_RUN_ID, r
                        )
                    )
            if with_db_retry(
                lambda t=t, why=reason: fail_trial(
                    self.study, self.spec, t, why, self.opts.max_retries, interrupted
                )
            ):
                failed.append(t.number)
                try:
                    mark_run_failed_within(uri, t, reason, interrupted=interrupted)
                except TrackingError as exc:
                    self._event(f"{exc}; the end-of-study sweep ends that run")
                    uri = None
        return failed

    def _wait_stopping(self) -> None:
        deadline = time.monotonic() + self.opts.grace_s
        while time.monotonic() < deadline and self._stop_requests < 2:
            if all(s.proc is None or self._poll(s) is not None for s in self._slots):
                return
            self._beat_held()
            time.sleep(0.2)

    def _poll(self, slot: _Slot) -> int | None:
        """The worker's exit code once it exited, else None. As its exit is first seen (and
        the worker reaped), what it started is killed too: its process group (a
        --train-fn's subprocess, holding a GPU maybe). Only then: a group left with no
        process may give its id to another one's later."""
        if slot.proc is None:
            return None
        code = slot.proc.poll()
        if code is not None and not slot.group_killed:
            slot.group_killed = True
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(slot.proc.pid, signal.SIGKILL)
        return code

    def _kill_all(self) -> None:
        for s in self._slots:
            if s.proc is not None and self._poll(s) is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(s.proc.pid, signal.SIGKILL)
            if s.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    s.proc.wait(timeout=10)
            if s.log is not None:
                s.log.close()

    def _cleanup_running(self) -> None:
        """After all workers are gone, none of their trials may stay RUNNING, and none they
        handed back may be left without its retry."""
        failed: list[int] = []
        for s in self._slots:
            failed += self._fail_trials_of(s.worker_id, "interrupted", s.killed_on_stop)[0]
        if failed:  # said: one killed when --grace ran out may have used its last retry
            self._event(f"stopped: {self._requeued_text(failed)}")
        ids = [s.worker_id for s in self._slots]
        if queued := with_db_retry(
            lambda: requeue_cut_handbacks(
                self.study, self.spec, ids, self._started_at, self.opts.max_retries, self._pids
            )
        ):
            self._event(f"trial {', '.join(map(str, queued))}: its hand-back was cut short; "
                        "queued to resume")  # fmt: skip
        while self._tracking_thread is not None and self._tracking_thread.is_alive():
            self._tracking_thread.join(timeout=max(self.opts.heartbeat_interval_s / 2, 0.5))
            self._beat_held()
        self._fail_held()

    def _read_progress(self) -> tuple[list[FrozenTrial], tuple[float | None, int | None]]:
        """The study's trials and best; read again once on a connection a restart broke
        (the pool is renewed by then), so that only a database still away shows as one."""
        try:
            trials = self.study.get_trials(deepcopy=False)
            return trials, _best(self.study, trials)
        except (SQLAlchemyError, optuna.exceptions.StorageInternalError) as exc:
            if not is_connection_error(exc):
                raise
        trials = self.study.get_trials(deepcopy=False)
        return trials, _best(self.study, trials)

    def _budget_now(self) -> str:
        """Read the study's n_trials again (the study keeps the last one set); a line to
        show when it changed, else ''. The last value read while the database is away."""
        try:
            n = study_budget(self.study, self.cfg)
        except (SQLAlchemyError, optuna.exceptions.StorageInternalError):
            return ""
        if n == self._budget:
            return ""
        self._budget = n
        note = f"budget.n_trials of the study is now {n} (set by another launch or worker)"
        self._messages.append(note)
        return note

    def _drift_now(self, trials: Sequence[FrozenTrial]) -> str:
        """Lines for the configs first seen in `trials` since the study opened, of other
        launches or workers, whose trials train otherwise than this launch's; each said once
        (and kept for the summary), '' for none. A config read fails: tried next time."""
        seen = self._configs_seen
        # Its own workers' (a trial with no pid yet, a queued retry, may be anyone's).
        mine = (
            t.user_attrs.get(CONFIG_ID_ATTR)
            for t in trials
            if ATTR_PID in t.user_attrs and launched_by(t.user_attrs, self._pids)
        )
        seen.update(c for c in mine if isinstance(c, str))
        new = other_configs(trials, seen)
        if not new:
            return ""
        try:
            attrs = self.study.user_attrs
        except (SQLAlchemyError, optuna.exceptions.StorageInternalError):
            return ""
        notes = []
        for cid, number in new.items():
            seen.add(cid)
            text = attrs.get(CONFIG_OF_ATTR + cid)
            if isinstance(text, str) and (note := others_drift_note(self.cfg, number, text)):
                notes.append(f"study {self.cfg.name}: {note}")
        self._messages += notes
        return "; ".join(notes)

    def _progress(self, message: str = "") -> Progress:
        stale_s: float | None = None
        never_read = False
        try:
            trials, (best_value, best_trial) = self._read_progress()
            for note in (self._budget_now(), self._drift_now(trials)):
                if note:
                    message = f"{message}; {note}" if message else note
            self._read_at = time.monotonic()
        except (SQLAlchemyError, optuna.exceptions.StorageInternalError):
            # The database may be restarting: progress is cosmetic, show the last figures
            # and how old they are (none read yet: since the study was opened).
            trials, (best_value, best_trial) = self._last_trials, self._last_best
            stale_s = time.monotonic() - (self._read_at or self._opened_at)
            never_read = self._read_at is None
        self._last_trials, self._last_best = trials, (best_value, best_trial)
        counts = budget_counts(trials)
        running = {
            t.user_attrs.get(ATTR_WORKER): t.number
            for t in trials
            if t.state == TrialState.RUNNING and launched_by(t.user_attrs, self._pids)
        }
        input_bound = {
            t.number: float(t.user_attrs["input_bound_gpu_util"])
            for t in trials
            if t.state == TrialState.RUNNING and "input_bound_gpu_util" in t.user_attrs
        }
        views = [
            WorkerView(
                s.index,
                s.proc.pid if s.proc else None,
                s.gpu,
                running.get(s.worker_id),
                s.state,
            )
            for s in self._slots
        ]
        t0 = getattr(self, "_t0", time.monotonic())
        elapsed = time.monotonic() - t0
        # The ETA of the figures shown: while the database is away, as of their reading (it
        # climbed with each second of the outage, over trials that kept training).
        worked = elapsed if stale_s is None else max(0.0, elapsed - stale_s)
        finished = counts["complete"] + counts["pruned"]
        here = finished_by(trials, self._pids)
        mine = [t for t in trials if launched_by(t.user_attrs, self._pids)]
        epochs = running_epochs(mine, self._eta_base)
        return Progress(
            counts,
            input_bound,
            self._budget,
            best_value,
            best_trial,
            views,
            elapsed,
            eta_seconds(finished, self._budget, worked, here, epochs, self.cfg.budget.max_epochs),
            message,
            stale_s,
            never_read,
            self._pareto_of(trials),
        )

    def _pareto_of(self, trials: Sequence[FrozenTrial]) -> tuple[int, ...] | None:
        """`_pareto`, again only when a trial completed since (each progress tick: the front
        costs O(n^2) in the completed trials, which only ever grow)."""
        done = [t.number for t in trials if t.state == TrialState.COMPLETE]
        key = (len(done), max(done, default=-1))
        if self._pareto_key != key:
            self._pareto_key, self._pareto_seen = key, _pareto(self.study, trials)
        return self._pareto_seen


def format_progress(p: Progress) -> str:
    c = p.counts
    best = format_best(p.best_value, p.best_trial, p.pareto)
    eta = f"{p.eta_s:.0f}s" if p.eta_s is not None else "-"
    # A live worker with no trial is "idle" (starting, asking, or past the budget): its
    # state word, "running", read as a trial count beside `running 0` (QA).
    busy = " ".join(
        f"w{w.slot}:"
        + (f"t{w.trial}" if w.trial is not None else "idle" if w.state == "running" else w.state)
        for w in p.workers
    )
    slow = "".join(f" | input-bound t{n} ({u:.0f}% GPU)" for n, u in sorted(p.input_bound.items()))
    stale = (
        ""
        if p.stale_s is None
        else f" | database unreachable for {p.stale_s:.0f}s: nothing read yet"
        if p.never_read
        else f" | database unreachable: figures {p.stale_s:.0f}s old"
    )
    return (
        f"[{p.elapsed_s:6.0f}s] complete {c['complete']} pruned {c['pruned']} failed {c['fail']} "
        f"running {c['running']} / {p.n_trials} | best {best} | eta {eta} | {busy}{slow}{stale}"
    )
