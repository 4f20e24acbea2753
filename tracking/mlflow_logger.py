"""MLflow layout of a study: one experiment per study, one parent run per study (role ``study``,
reused on relaunch), one child run per Optuna trial (``trial-<number>``).

Everything goes through an explicit :class:`mlflow.MlflowClient` and explicit run ids; the
process-global active run (``mlflow.start_run``) is never used.

:class:`TrialTracker` is the per-trial logger. ``log_epoch`` only enqueues (microseconds on the
training thread); a background thread sends exactly one ``log_batch`` request per epoch (more only
when an epoch exceeds MLflow's per-request limits), retrying with exponential backoff while the
server is unreachable, from a bounded buffer. ``finish`` flushes with a bounded wait, uploads the
artifacts and sets the terminal status. A tracking outage never raises into training: it is
logged as a warning and, when data was lost, the run is tagged ``hpsearch.tracking_incomplete``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import subprocess
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from hpsearch.errors import TrackingError, TrackingUnreachable
from hpsearch.tracking import logger
from hpsearch.tracking.server import redact_uri, scrub
from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from requests import RequestException

# MLflow's limits for one log_batch request (mlflow.utils.validation).
MAX_METRICS_PER_BATCH = 1000
MAX_PARAMS_PER_BATCH = 100
MAX_TAGS_PER_BATCH = 100
MAX_ENTITIES_PER_BATCH = 1000
MAX_PARAM_VAL_LENGTH = 6000
MAX_TAG_VAL_LENGTH = 8000

ROLE_TAG = "hpsearch.role"
KIND_TAG, KIND_TRAINING = "mlflow.experimentKind", "custom_model_development"
STUDY_TAG = "hpsearch.study"
# The Optuna study a study run (and its trial runs) belongs to (`study.study_uid`): two
# studies of one name (other storages sharing one server, or one deleted and made again)
# share an experiment, and their runs were merged under one study run (QA).
STUDY_UID_TAG = "hpsearch.study_uid"
INCOMPLETE_TAG = "hpsearch.tracking_incomplete"
OUTCOME_TAG = "hpsearch.outcome"
REASON_TAG = "hpsearch.reason"
PRUNED_AT_TAG = "hpsearch.pruned_at_epoch"
INPUT_BOUND_TAG = "hpsearch.input_bound"
PARENT_TAG = "mlflow.parentRunId"
# A trial run's idempotency key (the trial's Optuna user attr `mlflow_run_key`, written
# before the run is made): finds the run of a create that timed out after the server made
# it, or of a worker that died before it linked its run.
RUN_KEY_TAG = "hpsearch.run_key"
# On a retry's run: the run its earlier epochs were copied from (`copy_history`).
HISTORY_TAG = "hpsearch.history_from_run"

EPOCH_METRICS = (
    "train_loss",
    "train_acc",
    "val_loss",
    "val_acc",
    "lr",
    "epoch_seconds",
    "images_per_second",
)
SUMMARY_METRICS = ("best_val_acc", "best_val_loss", "test_acc")

OUTCOME_STATUS: Mapping[str, str] = {
    "completed": "FINISHED",
    "early_stopped": "FINISHED",
    "time_limit": "FINISHED",
    "pruned": "KILLED",
    "interrupted": "KILLED",
    "failed": "FAILED",
    # Told PRUNED in Optuna (the sampler learns the region is bad), so KILLED as a pruned
    # trial's run: filtering the UI by status counts what `hpsearch status` counts.
    "diverged": "KILLED",
    "out_of_memory": "KILLED",
}
# Outcomes a run says why it ended (`hpsearch.reason`), the outcome's name without a reason.
REASONED_OUTCOMES = frozenset({"failed", "diverged", "out_of_memory"})

# MLflow's HTTP client retries each request up to 7 times with a backoff factor of 2 by
# default (minutes of blocking while a server is down). The tracker does its own retrying, so
# it asks for short per-request retries; values already set in the environment win. It also
# stops MlflowClient.set_terminated from printing "View run ..." to stdout.
HTTP_POLICY: Mapping[str, str] = {
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0.5",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
}

T = TypeVar("T")

# s a GPU sample waits at most for the next epoch's request, while the server keeps up
SYSTEM_FLUSH_S = 60.0


# --------------------------------------------------------------------------- pure helpers


def apply_http_policy(env: dict[str, str] | os._Environ[str] | None = None) -> None:
    """Set short MLflow HTTP retry/timeout defaults and silence the client's stdout URL
    printing (``setdefault``: values already in the environment win)."""
    target = os.environ if env is None else env
    for key, value in HTTP_POLICY.items():
        target.setdefault(key, value)
    if env is None:
        skip_databricks_probe()


def skip_databricks_probe() -> None:
    """Outside Databricks, make MLflow's Databricks notebook probe answer "not a notebook"
    at once. MLflow runs it on every request (for its request headers) and in
    `set_terminated`; it imports IPython to look for `dbutils` in a notebook shell, which
    costs 0.35-0.4 s of CPU in each worker and in the launcher where IPython is installed
    (IPython 8.12, measured). Without IPython, or outside a notebook, the probe raises the
    same `_NoDbutilsError`. In a Databricks runtime (MLflow's own check: its environment
    variables or /databricks/DBR_VERSION) nothing changes, nor with an MLflow without this
    probe."""
    try:
        from mlflow.utils import databricks_utils
    except ImportError:
        return
    no_dbutils = getattr(databricks_utils, "_NoDbutilsError", None)
    in_runtime = getattr(databricks_utils, "is_in_databricks_runtime", None)
    if (
        no_dbutils is None
        or in_runtime is None
        or not callable(getattr(databricks_utils, "_get_dbutils", None))
        or in_runtime()
    ):
        return

    def _get_dbutils() -> Any:
        raise no_dbutils

    databricks_utils._get_dbutils = _get_dbutils


def terminal_status(outcome: str) -> str:
    """MLflow run status for a trial outcome; ValueError for an unknown outcome."""
    try:
        return OUTCOME_STATUS[outcome]
    except KeyError:
        raise ValueError(
            f"unknown trial outcome {outcome!r}; expected one of {sorted(OUTCOME_STATUS)}"
        ) from None


def terminal_tags(
    outcome: str, pruned_at_epoch: int | None = None, reason: str | None = None
) -> dict[str, str]:
    """Tags set when a trial ends: outcome always; ``hpsearch.pruned_at_epoch`` for pruned;
    ``hpsearch.reason`` for failures, divergence and out of memory (the given reason, else
    the outcome name)."""
    tags = {OUTCOME_TAG: outcome}
    status = OUTCOME_STATUS.get(outcome, "FAILED")
    if outcome == "pruned" and pruned_at_epoch is not None:
        tags[PRUNED_AT_TAG] = str(int(pruned_at_epoch))
    # A reason may quote an error holding a URL with its password (MLflow's, a database's).
    if status == "FAILED" or outcome in REASONED_OUTCOMES:
        tags[REASON_TAG] = truncate(scrub(reason or outcome), MAX_TAG_VAL_LENGTH)
    elif reason:
        tags[REASON_TAG] = truncate(scrub(reason), MAX_TAG_VAL_LENGTH)
    return tags


def truncate(value: str, limit: int) -> str:
    return value if len(value) <= limit else value[: limit - 3] + "..."


def param_value(value: Any) -> str:
    """A param value as MLflow stores it: ``repr`` for floats (full precision), ``str`` else,
    cut to MLflow's 6000-character limit."""
    text = repr(value) if isinstance(value, float) else str(value)
    return truncate(text, MAX_PARAM_VAL_LENGTH)


def trial_params(
    sampled: Mapping[str, Any],
    *,
    dataset: str | None = None,
    arch: str | None = None,
    image_size: int | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, str]:
    """The params of a trial run: every sampled param, then the derived and fixed ones
    (explicit values win over sampled ones of the same name); ``None`` values are left out."""
    out = {str(k): param_value(v) for k, v in sampled.items() if v is not None}
    derived: dict[str, Any] = {
        "dataset": dataset,
        "arch": arch,
        "image_size": image_size,
        **(extra or {}),
    }
    out.update({k: param_value(v) for k, v in derived.items() if v is not None})
    return out


def metric_entities(
    metrics: Mapping[str, Any], step: int, timestamp_ms: int
) -> tuple[list[Metric], list[str]]:
    """``Metric`` objects for the numeric values (NaN/inf kept: a diverged loss is data), and the
    names of values that were not numbers (dropped)."""
    out: list[Metric] = []
    bad: list[str] = []
    for key, value in metrics.items():
        try:
            number = float(value)
        except (TypeError, ValueError):
            bad.append(key)
            continue
        out.append(Metric(key=key, value=number, timestamp=timestamp_ms, step=int(step)))
    return out, bad


def chunk_batch(
    metrics: Sequence[Metric], params: Sequence[Param], tags: Sequence[RunTag]
) -> list[tuple[list[Metric], list[Param], list[RunTag]]]:
    """Split one logical batch into ``log_batch`` requests within MLflow's limits (1000 metrics,
    100 params, 100 tags, 1000 entities per request). One request when it fits."""
    out: list[tuple[list[Metric], list[Param], list[RunTag]]] = []
    m, p, t = list(metrics), list(params), list(tags)
    while m or p or t or not out:
        cp = p[:MAX_PARAMS_PER_BATCH]
        ct = t[:MAX_TAGS_PER_BATCH]
        room = MAX_ENTITIES_PER_BATCH - len(cp) - len(ct)
        cm = m[: min(MAX_METRICS_PER_BATCH, room)]
        out.append((cm, cp, ct))
        m, p, t = m[len(cm) :], p[len(cp) :], t[len(ct) :]
        if not (m or p or t):
            break
    return out


def is_permanent_error(exc: BaseException) -> bool:
    """True for errors that retrying cannot fix: an HTTP 4xx (bad value, a login, a
    permission, a run that `is_gone`); False for transport errors, timeouts, 5xx, 408/429
    (try later) and a 404 page that is not MLflow's (a proxy's while MLflow behind it is
    down: MLflow's client names it ENDPOINT_NOT_FOUND)."""
    code = _http_status(exc)
    if code == 404:
        return is_gone(exc)
    return code is not None and 400 <= code < 500 and code not in (408, 429)


def is_gone(exc: BaseException) -> bool:
    """MLflow's own answer that the run or experiment asked for does not exist (deleted
    for good); not a 404 page of something in front of it."""
    return isinstance(exc, MlflowException) and exc.error_code == "RESOURCE_DOES_NOT_EXIST"


def backoff_delays(initial_s: float, factor: float, max_s: float) -> Iterator[float]:
    """initial, initial*factor, ... capped at max_s (endless)."""
    delay = initial_s
    while True:
        yield min(delay, max_s)
        delay = min(delay * factor, max_s)


def git_commit(path: Path | None = None) -> tuple[str | None, bool]:
    """(HEAD commit, dirty) of the git checkout holding ``path`` (default: hpsearch's own
    sources), or (None, False) when it is not a git checkout or git is missing."""
    where = path or Path(__file__).resolve().parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=where,
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
        if head.returncode != 0:
            return None, False
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=where,
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
        return head.stdout.strip() or None, bool(status.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return None, False


def hpsearch_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hpsearch")
    except PackageNotFoundError:
        return "unknown"


def study_tags(
    sampler: str,
    pruner: str,
    storage_url: str,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Tags of the study run: sampler, pruner, redacted storage URL, git commit (when the
    sources are a git checkout), hpsearch version."""
    tags = {
        "hpsearch.sampler": sampler,
        "hpsearch.pruner": pruner,
        "hpsearch.storage": redact_uri(storage_url),
        "hpsearch.version": hpsearch_version(),
    }
    commit, dirty = git_commit()
    if commit:
        tags["hpsearch.git_commit"] = commit
        tags["mlflow.source.git.commit"] = commit
        tags["hpsearch.git_dirty"] = str(dirty).lower()
    tags.update(extra or {})
    return tags


def _safe_tag_value(value: Any) -> str:
    """A tag's value with the credentials of any URL in it masked: the whole value a URL
    (`redact_uri`), or one inside a message (`scrub`)."""
    text = str(value)
    if "://" in text:
        text = scrub(redact_uri(text))
    return truncate(text, MAX_TAG_VAL_LENGTH)


def _call(what: str, fn: Callable[[], T]) -> T:
    """Run an MLflow call at launch time, turning its errors into one-line TrackingErrors:
    TrackingUnreachable where a later try may go through (no answer, a 5xx)."""
    try:
        return fn()
    except MlflowException as exc:
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        kind = TrackingError if is_permanent_error(exc) else TrackingUnreachable
        # No cause attached: MLflow's error, printed in a traceback, holds the tracking URI
        # with its password.
        raise kind(f"MLflow: cannot {what}: {scrub(msg)}") from None
    except OSError as exc:
        raise TrackingUnreachable(f"MLflow: cannot {what}: {scrub(str(exc))}") from None


# --------------------------------------------------------------------------- study level


def ensure_experiment(client: MlflowClient, study_name: str) -> str:
    """The id of the experiment named like the study, created (or restored) when needed.
    Raises TrackingError when the server cannot be reached."""
    apply_http_policy()

    def get_or_create() -> str:
        exp = client.get_experiment_by_name(study_name)
        if exp is not None:
            if exp.lifecycle_stage == "deleted":
                client.restore_experiment(exp.experiment_id)
            if KIND_TAG not in (exp.tags or {}):  # one made before the tag (a user's kept)
                with contextlib.suppress(MlflowException):
                    client.set_experiment_tag(exp.experiment_id, KIND_TAG, KIND_TRAINING)
            return str(exp.experiment_id)
        try:
            # A training experiment: MLflow 3's UI opened one without the tag on its GenAI
            # traces view, the runs a click away (QA).
            return str(client.create_experiment(study_name, tags={KIND_TAG: KIND_TRAINING}))
        except MlflowException as exc:  # another worker created it first
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
            exp = client.get_experiment_by_name(study_name)
            if exp is None:
                raise
            return str(exp.experiment_id)

    return _call(f"get or create experiment {study_name!r}", get_or_create)


def find_study_runs(
    client: MlflowClient, experiment_id: str, uid: str | None = None, *, legacy: bool = False
) -> list[str]:
    """Run ids tagged ``hpsearch.role=study`` in the experiment, oldest first: with `uid`,
    the Optuna study's (tagged ``hpsearch.study_uid=uid``; asked of the server, as one
    experiment holds a study run per study of its name); `legacy`, those no uid tags (made
    by an earlier version)."""
    where = f"tags.`{ROLE_TAG}` = 'study'"
    if uid is not None and not legacy:  # (`legacy` asks for no uid)
        if not uid.isalnum():  # a uuid4 hex: nothing to quote in the filter
            raise ValueError(f"study uid {uid!r}: letters and digits only")
        where += f" and tags.`{STUDY_UID_TAG}` = '{uid}'"
    runs = list(
        client.search_runs(
            [experiment_id],
            filter_string=where,
            order_by=["attributes.start_time ASC"],
            max_results=1000 if legacy else 50,
        )
    )
    if legacy:
        runs = [r for r in runs if STUDY_UID_TAG not in r.data.tags]
    ids = [(r.info.start_time or 0, r.info.run_id) for r in runs]
    return [rid for _, rid in sorted(ids)]


def runs_by_key(client: MlflowClient, experiment_id: str, key: str, trial_number: int) -> list[str]:
    """The ids of trial `trial_number`'s runs in the experiment tagged ``hpsearch.run_key =
    key``, the one with the most metrics first. More than one where a create was sent twice
    and both were made: MLflow's client itself retries a POST whose reply was lost. The
    number too: a retry starts with its failed try's attributes, key included, until its
    worker writes its own. Raises what the search raises."""
    if not key.isalnum():  # a uuid4 hex: nothing to quote in the filter
        raise ValueError(f"run key {key!r}: letters and digits only")
    runs = client.search_runs(
        [experiment_id],
        filter_string=(
            f"tags.`{RUN_KEY_TAG}` = '{key}' and tags.`optuna.trial_number` = '{int(trial_number)}'"
        ),
        max_results=10,
    )
    return [str(r.info.run_id) for r in sorted(runs, key=lambda r: -len(r.data.metrics))]


def keep_one_run(client: MlflowClient, run_ids: Sequence[str], keep: str) -> None:
    """Delete the runs of `run_ids` other than `keep` (MLflow's delete: to its trash): the
    empty twins of a create sent twice. Raises what a deletion raises."""
    for run_id in run_ids:
        if run_id != keep:
            client.delete_run(run_id)


def claim_run_by_key(
    client: MlflowClient, experiment_id: str, key: str, trial_number: int
) -> str | None:
    """The run made for trial `trial_number` with this key (`runs_by_key`'s first; its
    twins deleted), or None. Raises what the search or a deletion raises."""
    ids = runs_by_key(client, experiment_id, key, trial_number)
    if not ids:
        return None
    keep_one_run(client, ids, ids[0])
    return ids[0]


def open_study_run(
    client: MlflowClient,
    experiment_id: str,
    study_name: str,
    tags: Mapping[str, str],
    resolved_study_yaml: str,
    uid: str | None = None,
    adopt_legacy: bool = False,
) -> str:
    """The study's parent run id: the existing ``hpsearch.role=study`` run of the experiment
    (relaunch; set back to RUNNING), of the Optuna study `uid` names (`find_study_runs`), or
    a new one. `adopt_legacy`: a study an earlier version launched takes the oldest run no
    uid tags, its own from then on (never a new study: that run is another's). Sets ``tags``
    (URLs redacted; git commit and hpsearch version added when missing) and uploads the
    resolved study file as ``study.yaml``.
    Concurrent first launches converge on the oldest run. Raises TrackingError when the server
    cannot be reached."""
    apply_http_policy()
    all_tags = {k: _safe_tag_value(v) for k, v in tags.items()}
    all_tags.setdefault("hpsearch.version", hpsearch_version())
    if "hpsearch.git_commit" not in all_tags:
        commit, _ = git_commit()
        if commit:
            all_tags["hpsearch.git_commit"] = commit
    all_tags[ROLE_TAG] = "study"
    all_tags[STUDY_TAG] = study_name
    if uid is not None:
        all_tags[STUDY_UID_TAG] = uid

    def open_run() -> str:
        existing = find_study_runs(client, experiment_id, uid)
        if not existing and uid is not None and adopt_legacy:
            existing = find_study_runs(client, experiment_id, legacy=True)
        if existing:
            run_id = existing[0]
            run = client.get_run(run_id)
            if run.info.status != "RUNNING":
                client.update_run(run_id, status="RUNNING")
        else:
            run = client.create_run(experiment_id, tags=all_tags, run_name=study_name)
            run_id = run.info.run_id
            existing = find_study_runs(client, experiment_id, uid)
            if existing and existing[0] != run_id:  # lost a creation race: use the oldest
                client.delete_run(run_id)
                run_id = existing[0]
        tag_list = [RunTag(k, v) for k, v in all_tags.items()]
        for _, _, chunk_tags in chunk_batch([], [], tag_list):
            client.log_batch(run_id, tags=chunk_tags)
        client.log_text(run_id, resolved_study_yaml, "study.yaml")
        return run_id

    return _call(f"open the study run of {study_name!r}", open_run)


def close_study_run(client: MlflowClient, run_id: str, status: str = "FINISHED") -> bool:
    """Mark the study run terminated (launcher exit). Best-effort: False on failure."""
    try:
        client.set_terminated(run_id, status=status)
        return True
    except Exception as exc:  # telemetry: never fail the launcher's shutdown
        logger.warning("MLflow: could not close study run %s: %s", run_id, _short(exc))
        return False


def _short(exc: BaseException) -> str:
    """The first line of an error, its URL credentials masked (MLflow's messages hold the
    tracking URI)."""
    text = scrub(str(exc)).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300]}" if text else type(exc).__name__


# --------------------------------------------------------------------------- trial level


@dataclass
class _Batch:
    metrics: list[Metric] = field(default_factory=list)
    params: list[Param] = field(default_factory=list)
    tags: list[RunTag] = field(default_factory=list)
    kind: str = "epoch"  # epoch | params | final | history
    enqueued: float = 0.0  # time.monotonic()
    sent_chunks: int = 0
    # A retry's earlier epochs from their source run, not fetched yet (`copy_history`):
    # (source run, keys, before step); `metrics` holds those known already, if any.
    history: tuple[str, tuple[str, ...], int] | None = None


@dataclass
class TrackerStats:
    requests: int = 0  # log_batch requests that succeeded
    failed_requests: int = 0
    batches_delivered: int = 0
    batches_dropped: int = 0
    metrics_dropped: int = 0
    delivery_latency_s: list[float] = field(default_factory=list)  # per delivered epoch batch
    enqueue_s: list[float] = field(default_factory=list)  # per log_epoch call (training thread)


class TrialTracker:
    """The MLflow child run of one trial.

    Creating it creates the run synchronously (``run_id`` is ready to be stored as the Optuna
    user attr ``mlflow_run_id``); if the server cannot be reached within ``start_timeout_s`` the
    tracker is disabled (``run_id is None``, every method a no-op, ``unreachable`` True when
    a later try may reach the server) and a warning is logged.
    ``start_time_ms`` (ms since the epoch) dates the run's start, when it began before the
    run could be created. With ``offline`` no run is made now: everything goes to
    ``spool_dir`` at `finish`, and `replay_spool` makes the run (a trial that ended while
    the server was down). No method raises because of tracking problems.
    """

    def __init__(
        self,
        client: MlflowClient,
        experiment_id: str,
        parent_run_id: str,
        *,
        trial_number: int | None,
        study_name: str,
        params: Mapping[str, Any],
        worker: str = "",
        run_name: str | None = None,
        host: str | None = None,
        gpu: str | None = None,
        tags: Mapping[str, str] | None = None,
        start_time_ms: int | None = None,
        run_key: str | None = None,
        max_buffer: int = 1000,
        flush_timeout_s: float = 30.0,
        start_timeout_s: float = 15.0,
        initial_backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        spool_dir: Path | None = None,
        offline: bool = False,
        find_first: bool = False,
        quiet: bool = False,
    ) -> None:
        """``spool_dir``: where `finish` keeps what MLflow, still down ``flush_timeout_s``
        after the trial, did not take (`replay_spool` sends it); None drops it.
        ``trial_number`` None: a run of no trial (`hpsearch train`'s), named ``run_name``
        (a trial's is trial-N) and kept by no spool folder.
        ``find_first``: look for the run by ``run_key`` before creating one (an earlier
        try's create may have landed). ``quiet``: a create that gives up is logged at debug
        level (its outage was reported already)."""
        apply_http_policy()
        self.client = client
        self.spool_dir = spool_dir
        self.trial_number = trial_number
        self._run_name = run_name or f"trial-{trial_number}"
        self._label = f"trial {trial_number}" if trial_number is not None else f"run {run_name}"
        self.max_buffer = max(1, max_buffer)
        self.flush_timeout_s = flush_timeout_s
        self.initial_backoff_s = initial_backoff_s
        self.max_backoff_s = max_backoff_s
        self.stats = TrackerStats()
        self.incomplete = False
        self.finished = False
        self.run_id: str | None = None
        self.unreachable = False  # no run: the server did not answer (a later try may)
        self.gone = False  # no run: its experiment does not exist (deleted for good)
        self._find_first = find_first
        self._quiet = quiet
        # The run's create, kept for `replay_spool` (offline: no run made now).
        self._offline: dict[str, Any] | None = None
        self._experiment_id = experiment_id
        self._run_key = run_key
        # ms since the epoch: a retry's earlier epoch its failed try's run lacks is dated so
        # (`copy_history`), before the retry's own, which may be dated from before now.
        self._start_ms = start_time_ms if start_time_ms else int(time.time() * 1000)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._queue: deque[_Batch] = deque()
        self._inflight: _Batch | None = None
        self._closing = False
        self._abort = threading.Event()
        self._pending_system: list[Metric] = []
        self._system_since = 0.0  # monotonic s: when the oldest pending sample came
        self._pending_tags: dict[str, str] = {}
        self._pending_params: dict[str, str] = {}  # `log_params`
        self._system_step = 0
        self._last_step = 0
        self._outage_since: float | None = None
        self._warned_bad_metrics = False
        self._warned_overflow = False
        self._thread: threading.Thread | None = None

        run_tags = {
            ROLE_TAG: "trial",
            STUDY_TAG: study_name,
            "hpsearch.worker": worker,
            "hpsearch.host": host if host is not None else socket.gethostname(),
            "hpsearch.gpu": gpu if gpu is not None else _default_gpu_label(),
        }
        if trial_number is not None:
            run_tags["optuna.trial_number"] = str(trial_number)
        run_tags.update({k: _safe_tag_value(v) for k, v in (tags or {}).items()})
        if parent_run_id:  # offline: found when the run is made (`replay_spool`)
            run_tags[PARENT_TAG] = parent_run_id
        if run_key:
            run_tags[RUN_KEY_TAG] = run_key
        if offline and spool_dir is not None and trial_number is not None:
            self._offline = {
                "experiment": study_name,
                "tags": run_tags,
                "start_ms": start_time_ms,
                "run_name": f"trial-{trial_number}",
                "trial_number": trial_number,
                "run_key": run_key,
            }
        else:
            self.run_id = self._create_run(
                experiment_id, run_tags, start_timeout_s, start_time_ms, run_key
            )
        if not self.enabled:
            return
        param_list = [Param(k, param_value(v)) for k, v in params.items()]
        if param_list:
            self._queue.append(_Batch(params=param_list, kind="params", enqueued=time.monotonic()))
        if self._offline is not None:
            return  # no sender: `finish` keeps it all
        self._thread = threading.Thread(
            target=self._sender, name=f"mlflow-trial-{trial_number}", daemon=True
        )
        self._thread.start()

    # -- public API -------------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return self.run_id is not None or self._offline is not None

    def log_epoch(
        self, step: int, metrics: Mapping[str, Any], timestamp_ms: int | None = None
    ) -> None:
        """Queue one epoch's metrics (step = epoch), timed now or at `timestamp_ms` (ms since
        the epoch); returns immediately. GPU samples and tags that arrived since the previous
        epoch ride along in the same request."""
        if not self.enabled or self.finished:
            return
        t0 = time.perf_counter()
        try:
            now_ms = int(time.time() * 1000) if timestamp_ms is None else int(timestamp_ms)
            entities, bad = metric_entities(metrics, step, now_ms)
            if bad and not self._warned_bad_metrics:
                self._warned_bad_metrics = True
                logger.warning("MLflow: dropped non-numeric metrics %s", sorted(bad))
            with self._cond:
                self._last_step = max(self._last_step, int(step))
                batch = self._take_pending_locked(entities, "epoch")
                self._push_locked(batch)
        except Exception as exc:  # telemetry never kills training
            logger.warning("MLflow: log_epoch failed: %s", _short(exc))
        finally:
            self.stats.enqueue_s.append(time.perf_counter() - t0)

    def log_system(self, metrics: Mapping[str, float], timestamp_ms: int | None = None) -> None:
        """Buffer one sample of system metrics (e.g. ``system/gpu_utilization``); they are sent
        with the next epoch's request, or on their own once the oldest has waited
        `SYSTEM_FLUSH_S` while the server keeps up (an epoch of an hour showed no GPU chart
        for an hour). Thread-safe (GPU sampler thread)."""
        if not self.enabled or self.finished:
            return
        try:
            ts = int(time.time() * 1000) if timestamp_ms is None else int(timestamp_ms)
            with self._cond:
                entities, _ = metric_entities(metrics, self._system_step, ts)
                self._system_step += 1
                if not self._pending_system:
                    self._system_since = time.monotonic()
                self._pending_system.extend(entities)
                idle = not self._queue and self._inflight is None  # not in an outage
                due = time.monotonic() - self._system_since >= SYSTEM_FLUSH_S
                if due and idle and self._thread is not None and not self._closing:
                    self._push_locked(self._take_pending_locked([], "system"))
                    return
                overflow = len(self._pending_system) - self.max_buffer * 50
                if overflow > 0:
                    del self._pending_system[:overflow]
                    self.stats.metrics_dropped += overflow
                    self.incomplete = True
        except Exception as exc:  # telemetry never kills training
            logger.warning("MLflow: log_system failed: %s", _short(exc))

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Params known only once the run is under way (the trainer's effective batch size:
        its train split may be smaller than the batch asked for), sent with the next request
        (the run's end, at the latest). MLflow refuses a param logged again with another
        value: log a name once. Thread-safe."""
        if not self.enabled or self.finished:
            return
        with self._cond:
            self._pending_params.update(
                {str(k): param_value(v) for k, v in params.items() if v is not None}
            )

    def set_tags(self, tags: Mapping[str, str]) -> None:
        """Tags sent with the next request (e.g. ``hpsearch.input_bound=true``). Thread-safe."""
        if not self.enabled or self.finished:
            return
        with self._cond:
            self._pending_tags.update({k: _safe_tag_value(v) for k, v in tags.items()})

    def copy_history(
        self,
        before_step: int,
        source_run_id: str | None,
        keys: Sequence[str],
        known: Sequence[tuple[int, Mapping[str, float]]] = (),
    ) -> None:
        """Queue a retry's earlier epochs, those at steps below `before_step` (the first
        one it trains): `known` (step, metrics) as its resume checkpoint holds them, dated
        as run `source_run_id` (its failed try's) logged them where it did, else at this
        run's start; with none known, `keys`' values from that run. Fetched and sent by
        the sender thread, ahead of the epochs queued after this call; returns at once."""
        if not self.enabled or self.finished or before_step <= 1:
            return
        metrics: list[Metric] = []  # dated at the run's start where the source lacks them
        for step, values in known:
            if step < before_step:
                metrics += metric_entities(values, step, self._start_ms)[0]
        if not metrics and not source_run_id:
            return
        source = (source_run_id, tuple(keys), int(before_step)) if source_run_id else None
        with self._cond:
            batch = _Batch(metrics=metrics, kind="history", enqueued=time.monotonic())
            batch.history = source
            self._push_locked(batch)

    def finish(
        self,
        outcome: str,
        pruned_at_epoch: int | None = None,
        summary_metrics: Mapping[str, float] | None = None,
        artifacts: Sequence[Path] = (),
        traceback: str | None = None,
        *,
        reason: str | None = None,
        timeout_s: float | None = None,
        end_time_ms: int | None = None,
    ) -> bool:
        """End the run: flush queued epochs (waiting at most ``timeout_s``, default
        ``flush_timeout_s``), send the summary metrics (``best_val_acc``, ``test_acc``, ... at the
        last epoch's step) and the terminal tags, upload ``artifacts`` (files or folders) and
        ``traceback.txt``, then set the status from :func:`terminal_status`, dated
        ``end_time_ms`` (ms since the epoch; default now): when the trial ended, not when its
        uploads were done. Returns True when everything was delivered; never raises."""
        if not self.enabled or self.finished:
            return False
        self.finished = True
        run_id = self.run_id
        status = OUTCOME_STATUS.get(outcome, "FAILED")
        now_ms = int(time.time() * 1000)
        end_ms = end_time_ms if end_time_ms is not None else now_ms
        ended = False
        try:
            try:
                status = terminal_status(outcome)
            except ValueError as exc:
                logger.warning("MLflow: %s; marking the run FAILED", scrub(str(exc)))
            tags = terminal_tags(outcome, pruned_at_epoch, reason)
            with self._cond:
                summary, _ = metric_entities(summary_metrics or {}, self._last_step, now_ms)
                self._pending_tags.update(tags)
                final = self._take_pending_locked(summary, "final")
                self._push_locked(final)
                self._closing = True
                self._cond.notify_all()
            if run_id is None:  # offline: all of it kept, the run made when it is sent
                with self._cond:
                    leftover, self._queue = list(self._queue), deque()
                if not self._spool(leftover, status, artifacts, traceback, end_ms):
                    logger.warning("MLflow: %s has no run", self._label)
                return False
            wait = self.flush_timeout_s if timeout_s is None else timeout_s
            delivered, leftover = self._join(wait, keep=self.spool_dir is not None)
            server_down = not delivered
            if server_down and self._spool(leftover, status, artifacts, traceback, end_ms):
                return False  # no set_tag or status: each would wait out the server again

            def kept(done: bool | None, rest: Sequence[Path], tb: str | None) -> bool:
                """The server failed meanwhile (`done` None): the rest, and the run's end,
                are kept for later, not lost with the run left RUNNING."""
                if done is not None:
                    return False
                if self._spool([], status, rest, tb, end_ms):
                    return True
                self.incomplete = True
                return False

            if not server_down:
                for i, path in enumerate(artifacts):
                    if kept(self._upload(run_id, Path(path)), artifacts[i:], traceback):
                        return False
                if traceback:
                    text = scrub(traceback)  # its frames' messages may hold a URL's password
                    sent = self._best_effort(
                        "upload traceback.txt",
                        lambda: self.client.log_text(run_id, text, "traceback.txt"),
                    )
                    if kept(sent, (), traceback):
                        return False
            elif artifacts or traceback:
                self.incomplete = True
            if self.incomplete:
                self._best_effort(
                    "tag the run incomplete",
                    lambda: self.client.set_tag(run_id, INCOMPLETE_TAG, "true"),
                )
            sent = self._best_effort(
                f"set status {status}",
                lambda: self.client.set_terminated(run_id, status=status, end_time=end_ms),
            )
            if kept(sent, (), None):
                return False  # its status is sent when the server answers
            ended = True
            if self._run_key and not server_down:
                self._delete_twins(run_id, self._run_key)
            if self.incomplete:
                logger.warning(
                    "MLflow: run %s (%s) is incomplete: %d batches / %d metrics not delivered",
                    run_id,
                    self._label,
                    self.stats.batches_dropped,
                    self.stats.metrics_dropped,
                )
            return not self.incomplete
        except Exception as exc:  # telemetry never kills training
            logger.warning("MLflow: finishing run %s failed: %s", run_id, _short(exc))
            return False
        except BaseException:
            # A second Ctrl-C while the run ended (`hpsearch train` raises it): what was
            # left of its end is dropped, but the run gets its status, not RUNNING for good
            # (CI: a train stopped twice stayed RUNNING). One try each; a third Ctrl-C ends
            # the process at once.
            if run_id is not None and not ended:
                self.incomplete = True
                self._best_effort(
                    "tag the run incomplete",
                    lambda: self.client.set_tag(run_id, INCOMPLETE_TAG, "true"),
                )
                self._best_effort(
                    f"set status {status}",
                    lambda: self.client.set_terminated(run_id, status=status, end_time=end_ms),
                )
            raise

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until everything queued so far is delivered (tests, bench). True if it was."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._cond:
                if not self._queue and self._inflight is None:
                    return True
            time.sleep(0.005)
        return False

    def pending(self) -> int:
        """Batches queued or in flight."""
        with self._cond:
            return len(self._queue) + (self._inflight is not None)

    def __enter__(self) -> TrialTracker:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.finished or not self.enabled:
            return
        if exc is None:
            self.finish("completed")
            return
        import traceback as tb_mod

        text = "".join(tb_mod.format_exception(exc_type, exc, tb))
        if isinstance(exc, KeyboardInterrupt):
            self.finish("interrupted", traceback=text, reason="KeyboardInterrupt")
        else:
            self.finish("failed", traceback=text, reason=f"{type(exc).__name__}: {exc}"[:500])

    # -- internals ----------------------------------------------------------------------------

    def _create_run(
        self,
        experiment_id: str,
        tags: dict[str, str],
        timeout_s: float,
        start_time_ms: int | None,
        run_key: str | None,
    ) -> str | None:
        deadline = time.monotonic() + timeout_s
        delays = backoff_delays(self.initial_backoff_s, 2.0, self.max_backoff_s)
        tried = self._find_first
        while True:
            try:
                # The failed try may have made it (its reply lost, or timed out).
                if tried and (made := self._made_after_all(experiment_id, run_key)):
                    return made
                tried = True
                run = self.client.create_run(
                    experiment_id,
                    start_time=start_time_ms,
                    tags=tags,
                    run_name=self._run_name,
                )
                return str(run.info.run_id)
            except Exception as exc:  # telemetry: a dead server must not stop the trial
                delay = next(delays)
                permanent = is_permanent_error(exc)
                if permanent or time.monotonic() + delay > deadline:
                    if not permanent and (made := self._made_after_all(experiment_id, run_key)):
                        return made
                    self.unreachable = not permanent
                    self.gone = is_gone(exc)  # the study's experiment, deleted for good
                    level = logging.DEBUG if self.unreachable and self._quiet else logging.WARNING
                    logger.log(
                        level,
                        "MLflow: could not create the run of %s%s: %s",
                        self._label,
                        " yet" if self.unreachable else ", tracking disabled for it",
                        _short(exc),
                    )
                    return None
                time.sleep(delay)

    def _delete_twins(self, run_id: str, key: str) -> None:
        """Delete an empty twin of this run, made where a create was sent twice (MLflow's
        client retries a POST whose reply was lost): one search per run, at its end."""
        if self.trial_number is None:  # keys are a trial's
            return
        try:
            twins = runs_by_key(self.client, self._experiment_id, key, self.trial_number)
            keep_one_run(self.client, twins, run_id)
        except Exception as exc:  # telemetry: the run itself is whole
            logger.warning("MLflow: could not look for twins of run %s: %s", run_id, _short(exc))

    def _made_after_all(self, experiment_id: str, run_key: str | None) -> str | None:
        """The run a create that failed made after all, found by its key; else None."""
        if not run_key or self.trial_number is None:
            return None
        try:
            return claim_run_by_key(self.client, experiment_id, run_key, self.trial_number)
        except Exception as exc:  # telemetry: the caller retries or gives up
            logger.debug("MLflow: run key lookup failed: %s", _short(exc))
            return None

    def _take_pending_locked(self, metrics: list[Metric], kind: str) -> _Batch:
        batch = _Batch(metrics=metrics, kind=kind, enqueued=time.monotonic())
        if self._pending_system:
            batch.metrics = [*metrics, *self._pending_system]
            self._pending_system = []
        if self._pending_tags:
            batch.tags = [RunTag(k, v) for k, v in self._pending_tags.items()]
            self._pending_tags = {}
        if self._pending_params:
            batch.params = [Param(k, v) for k, v in self._pending_params.items()]
            self._pending_params = {}
        return batch

    def _push_locked(self, batch: _Batch) -> None:
        self._queue.append(batch)
        while len(self._queue) > self.max_buffer:
            # The oldest epochs go; the run's params and a retry's earlier epochs stay
            # (one batch each, and no later one holds them).
            kept = ("params", "history")
            oldest = next((i for i, b in enumerate(self._queue) if b.kind not in kept), 0)
            dropped = self._queue[oldest]
            del self._queue[oldest]
            self._count_dropped(dropped)
            if not self._warned_overflow:
                self._warned_overflow = True
                logger.warning(
                    "MLflow: buffer of %d batches full (server unreachable?), dropping the "
                    "oldest epochs of %s",
                    self.max_buffer,
                    self._label,
                )
        self._cond.notify_all()

    def _count_dropped(self, batch: _Batch) -> None:
        self.stats.batches_dropped += 1
        self.stats.metrics_dropped += len(batch.metrics)
        self.incomplete = True

    def _sender(self) -> None:
        from hpsearch.background import lower_priority

        lower_priority()  # HTTP requests must not take the training threads' cores
        while not self._abort.is_set():
            with self._cond:
                while not self._queue and not self._closing and not self._abort.is_set():
                    self._cond.wait(timeout=1.0)
                if self._abort.is_set() or (not self._queue and self._closing):
                    return
                batch = self._queue.popleft()
                self._inflight = batch
            done = self._deliver(batch)
            with self._cond:
                if not done and self._inflight is batch:
                    if self._abort.is_set():  # cut short, not refused: `_join` takes it
                        self._queue.appendleft(batch)
                    else:
                        self._count_dropped(batch)
                self._inflight = None
                self._cond.notify_all()

    def _deliver(self, batch: _Batch) -> bool:
        """Send one batch, retrying transient errors with backoff until it is delivered
        (True), rejected for good, or the tracker is aborted (False)."""
        delays: Iterator[float] | None = None
        while not self._abort.is_set():
            try:
                self._send(batch)
            except Exception as exc:  # telemetry: retried, then dropped
                self.stats.failed_requests += 1
                if is_permanent_error(exc):
                    logger.warning(
                        "MLflow: a %s batch of %s was rejected, dropped: %s",
                        batch.kind,
                        self._label,
                        _short(exc),
                    )
                    return False
                if self._outage_since is None:
                    self._outage_since = time.monotonic()
                    logger.warning(
                        "MLflow: server unreachable, buffering %s's metrics and retrying: %s",
                        self._label,
                        _short(exc),
                    )
                if delays is None:
                    delays = backoff_delays(self.initial_backoff_s, 2.0, self.max_backoff_s)
                self._abort.wait(next(delays))
                continue
            if self._outage_since is not None:
                logger.warning(
                    "MLflow: server reachable again after %.1f s (%s)",
                    time.monotonic() - self._outage_since,
                    self._label,
                )
                self._outage_since = None
            self.stats.batches_delivered += 1
            if batch.kind == "epoch":
                self.stats.delivery_latency_s.append(time.monotonic() - batch.enqueued)
            return True
        return False

    def _send(self, batch: _Batch) -> None:
        assert self.run_id is not None
        if batch.history is not None:  # fetched once; a retry sends the chunks left
            batch.metrics, batch.tags = history_batch(self.client, *batch.history, batch.metrics)
            batch.history = None
        chunks = chunk_batch(batch.metrics, batch.params, batch.tags)
        for i in range(batch.sent_chunks, len(chunks)):
            metrics, params, tags = chunks[i]
            self.client.log_batch(
                self.run_id, metrics=metrics, params=params, tags=tags, synchronous=True
            )
            self.stats.requests += 1
            batch.sent_chunks = i + 1

    def _join(self, timeout_s: float, keep: bool = False) -> tuple[bool, list[_Batch]]:
        """Wait for the sender to drain; abort it after ``timeout_s``. (True, []) if all was
        delivered; else False and, with ``keep``, what was not (the batch in flight from
        its first unsent chunk), else nothing (it is counted as dropped). A sender still
        inside a request 5 s after the abort (a server that hangs) may yet land that
        chunk: it is kept too, as a copy sent twice loses nothing where one not kept
        would (MLflow's SQL stores drop a metric logged twice alike)."""
        thread = self._thread
        if thread is None:
            return True, []
        thread.join(timeout=max(0.0, timeout_s))
        if not thread.is_alive():
            return True, []
        self._abort.set()
        with self._cond:
            self._cond.notify_all()
        thread.join(timeout=5.0)
        with self._cond:
            left = [self._inflight] if self._inflight is not None else []
            left += list(self._queue)
            self._queue.clear()
            self._inflight = None
        if not keep:
            for batch in left:
                self._count_dropped(batch)
            return False, []
        kept = []
        for batch in left:  # a chunk the server took is not kept
            if batch.history is not None:  # not fetched yet: fetched when it is sent
                kept.append(batch)
                continue
            for metrics, params, tags in chunk_batch(batch.metrics, batch.params, batch.tags)[
                batch.sent_chunks :
            ]:
                if metrics or params or tags:
                    kept.append(_Batch(metrics, params, tags, batch.kind, batch.enqueued))
        return False, kept

    def _spool(
        self,
        batches: list[_Batch],
        status: str,
        artifacts: Sequence[Path],
        traceback: str | None,
        end_ms: int | None = None,
    ) -> bool:
        """Keep what MLflow did not take in ``spool_dir``, with the run's end (status, the
        traceback) and copies of its artifacts (the caller deletes its own: a top-k
        trial's best model, whose ``checkpoint_uri`` Optuna already holds). An artifact
        that cannot be copied tags the run incomplete. False when there is no spool folder
        or it cannot be written: then it is dropped."""
        if self.spool_dir is None or not self.enabled:
            return False
        # An offline run's file is named by a key of its own until the run is made.
        name = self.run_id or f"new-{uuid.uuid4().hex}"
        kept, copied = _keep_artifacts(self.spool_dir, name, artifacts)
        try:
            path = write_spool(
                self.spool_dir, name, batches, status,
                incomplete=self.incomplete or not copied,
                traceback=scrub(traceback) if traceback else None,
                artifacts=kept,
                create=self._offline,
                end_ms=end_ms,
            )  # fmt: skip
        except (OSError, ValueError) as exc:
            shutil.rmtree(_artifacts_dir(self.spool_dir, name), ignore_errors=True)
            logger.warning("MLflow: cannot keep %s's metrics: %s", self._label, exc)
            for batch in batches:
                self._count_dropped(batch)
            return False
        logger.warning(
            "MLflow: server down; what %s's run lacks (%d batch(es), %d artifact(s), its "
            "status) kept in %s, sent when it answers",
            self._label,
            len(batches),
            len(kept),
            path,
        )
        return True

    def _upload(self, run_id: str, path: Path) -> bool | None:
        """As `_best_effort`; a missing file is skipped (True)."""
        if path.is_dir():
            return self._best_effort(
                f"upload {path}",
                lambda: self.client.log_artifacts(run_id, str(path), artifact_path=path.name),
                upload=True,
            )
        if path.exists():
            return self._best_effort(
                f"upload {path}", lambda: self.client.log_artifact(run_id, str(path)), upload=True
            )
        logger.warning("MLflow: artifact %s does not exist, skipped", path)
        return True

    def _best_effort(
        self, what: str, fn: Callable[[], object], *, upload: bool = False
    ) -> bool | None:
        """`fn()`: True when done; False when refused for good (the run is incomplete);
        None when the server failed (down, 5xx, a timeout), where the spool folder keeps
        it for later if there is one (the caller's to do; else the run is incomplete)."""
        try:
            fn()
            return True
        except Exception as exc:  # telemetry never kills training
            local = isinstance(exc, OSError) and not isinstance(exc, RequestException)
            if upload:
                for_good = (
                    local
                    or _refused_upload(exc)
                    or (self.run_id is not None and _route_missing(self.client, self.run_id, exc))
                )
            else:
                for_good = is_permanent_error(exc)
            if not for_good and self.spool_dir is not None:
                logger.info("MLflow: could not %s for run %s: %s", what, self.run_id,
                            _short(exc))  # fmt: skip
                return None
            self.incomplete = True
            logger.warning("MLflow: could not %s for run %s: %s", what, self.run_id, _short(exc))
            return False if for_good else None


SPOOL_SUFFIX = ".spool.json"


def _artifacts_dir(spool_dir: Path, run_id: str) -> Path:
    """Where a kept run's artifacts wait (`_keep_artifacts`)."""
    return spool_dir / f"{run_id}.artifacts"


def _keep_artifacts(
    spool_dir: Path, run_id: str, artifacts: Sequence[Path]
) -> tuple[list[str], bool]:
    """Copies of a run's artifacts (files, or folders uploaded under their name; links
    followed: the caller's may point at files it deletes) beside its spool file: (the
    names kept, whether all were)."""
    names: list[str] = []
    folder = _artifacts_dir(spool_dir, run_id)
    complete = True
    for artifact in map(Path, artifacts):
        dest = folder / artifact.name
        try:
            folder.mkdir(parents=True, exist_ok=True)
            if artifact.is_dir():
                shutil.copytree(
                    artifact,
                    dest,
                    dirs_exist_ok=True,
                    copy_function=lambda a, b: _link_or_copy(Path(a), Path(b)),
                )
            else:
                _link_or_copy(artifact, dest)
        except OSError as exc:  # a full disk: sent without it, tagged incomplete
            logger.warning("MLflow: cannot keep artifact %s: %s", artifact, exc)
            complete = False
            continue
        names.append(artifact.name)
    return names, complete


def _link_or_copy(src: Path, dest: Path) -> None:
    try:
        os.link(src.resolve(), dest)  # a checkpoint: no second copy on the same disk
    except OSError:
        shutil.copyfile(src, dest)


def history_batch(
    client: MlflowClient,
    source_run_id: str,
    keys: Sequence[str],
    before_step: int,
    known: Sequence[Metric] = (),
) -> tuple[list[Metric], list[RunTag]]:
    """A retry's earlier epochs as one batch for its run (`TrialTracker.copy_history`):
    `known` (from its resume checkpoint) dated as run `source_run_id` logged each (key,
    step), or, with none known, `keys`' values at steps below `before_step` in that run
    (a step logged twice: its latest); with the tag naming that run when there are any.
    One request per key; MLflow answers a run it lacks with no values. Raises
    MlflowException, or a transport error, when the server is down; known epochs go
    undated by the source on any other refusal of it."""
    logged: dict[tuple[str, int], Metric] = {}
    try:
        for key in keys:
            for m in client.get_metric_history(source_run_id, key):
                step = int(m.step)
                if step < before_step:
                    held = logged.get((key, step))
                    if held is None or m.timestamp >= held.timestamp:
                        logged[(key, step)] = m
    except Exception as exc:
        if not known or not is_permanent_error(exc):
            raise
        logger.warning("MLflow: run %s's epochs not read for their dates: %s", source_run_id,
                       _short(exc))  # fmt: skip
    if known:
        metrics = [
            Metric(m.key, m.value, int(logged[(m.key, m.step)].timestamp), m.step)
            if (m.key, m.step) in logged
            else m
            for m in known
        ]
    else:
        metrics = [
            Metric(key, float(m.value), int(m.timestamp), step)
            for (key, step), m in sorted(logged.items(), key=lambda kv: (kv[0][1], kv[0][0]))
        ]
    return metrics, [RunTag(HISTORY_TAG, source_run_id)] if metrics else []


def write_spool(
    spool_dir: Path,
    run_id: str,
    batches: Sequence[_Batch],
    status: str,
    *,
    incomplete: bool,
    traceback: str | None,
    artifacts: Sequence[str] = (),
    create: Mapping[str, Any] | None = None,
    end_ms: int | None = None,
) -> Path:
    """``<spool_dir>/<run_id>.spool.json``: a run's undelivered batches and its end, written
    whole (rename into place); `artifacts`: the names of those kept beside it
    (`_keep_artifacts`); `create`: how to make the run, for one not made yet (`run_id` is
    then the file's own key). Raises OSError."""
    record = {
        "run_id": run_id,
        "create": dict(create) if create is not None else None,
        "status": status,
        # the run ended then (default now), not when it is sent
        "end_ms": end_ms if end_ms is not None else int(time.time() * 1000),
        "incomplete": incomplete,
        "traceback": traceback,
        "artifacts": list(artifacts),
        "batches": [
            {
                "metrics": [[m.key, m.value, m.timestamp, m.step] for m in b.metrics],
                "params": [[p.key, p.value] for p in b.params],
                "tags": [[t.key, t.value] for t in b.tags],
                **(
                    {"history": [b.history[0], list(b.history[1]), b.history[2]]}
                    if b.history is not None
                    else {}
                ),
            }
            for b in batches
        ],
    }
    spool_dir.mkdir(parents=True, exist_ok=True)
    path = spool_dir / f"{run_id}{SPOOL_SUFFIX}"
    tmp = spool_dir / f".{path.name}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(record))  # NaN and inf as JSON's NaN/Infinity: read back alike
    os.replace(tmp, path)
    return path


def replay_spool(
    client: MlflowClient,
    spool_dir: Path,
    *,
    mixed: bool = False,
    on_made: Callable[[Mapping[str, Any], str], object] | None = None,
) -> int:
    """Send the runs kept in ``spool_dir`` (`write_spool`), in name order: their batches,
    the incomplete tag, the traceback, then their status. A file is claimed by renaming
    it (two workers of one host share the folder) and deleted once sent; it goes back when
    the server fails again, which ends this call. A run the server lacks is set aside
    (``.failed``, its files deleted); with `mixed` (the one folder earlier versions kept
    for every server) it is left where it is, for the server it was kept for. `on_made`
    is told of each run made here for a record kept offline: (its create, the run id). The
    number of runs sent. Never raises."""
    _reclaim_abandoned(spool_dir)
    claimer = _claimer()  # now: a forked process is another claimer
    sent = 0
    for path in sorted(spool_dir.glob(f"*{SPOOL_SUFFIX}") if spool_dir.is_dir() else ()):
        claimed = path.with_name(f".{path.name}.{claimer}.sending")
        try:
            os.rename(path, claimed)
        except OSError:  # another process took it
            continue
        record: Any = None
        try:
            record = json.loads(claimed.read_text())
            run_id = _replay_run(client, record, spool_dir)
        except Exception as exc:  # telemetry: kept for the next try, or set aside
            if mixed and is_gone(exc):  # another server's, maybe: left for it
                with contextlib.suppress(OSError):
                    os.rename(claimed, path)
                continue
            unreadable = isinstance(exc, ValueError | KeyError | TypeError)
            if unreadable or is_gone(exc) or _run_deleted(client, record, exc):
                # Unreadable, no such run there, or one deleted in the UI (to its trash):
                # set aside, not put back, where it held up every later file.
                with contextlib.suppress(OSError):
                    os.rename(claimed, path.with_name(path.name + ".failed"))
                run_id = path.name.removesuffix(SPOOL_SUFFIX)  # its files would pin disk
                shutil.rmtree(_artifacts_dir(spool_dir, run_id), ignore_errors=True)
                logger.warning("MLflow: kept run %s cannot be sent: %s", path.name, _short(exc))
                continue
            with contextlib.suppress(OSError):  # the server is down again, or refuses us
                os.rename(claimed, path)
            logger.info("MLflow: kept runs not sent yet: %s", _short(exc))
            return sent
        claimed.unlink(missing_ok=True)
        shutil.rmtree(_artifacts_dir(spool_dir, str(record["run_id"])), ignore_errors=True)
        sent += 1
        if on_made is not None and record.get("create"):
            try:
                on_made(record["create"], run_id)
            except Exception as exc:  # telemetry: the run is in MLflow, found by its key
                logger.warning("MLflow: kept run %s not linked: %s", run_id, _short(exc))
    return sent


def _run_deleted(client: MlflowClient, record: Any, exc: BaseException) -> bool:
    """Whether a 4xx refusal of kept `record` is that its run was deleted (to MLflow's
    trash: its writes answer 400), asked of the server. Any other 4xx may be every
    record's (a proxy's error page, MLflow's 400 for a database error of its own): the
    record is then kept for a later try, not set aside with its files."""
    if not is_permanent_error(exc) or _http_status(exc) in (401, 403):
        return False
    if not isinstance(record, Mapping) or record.get("create") or "run_id" not in record:
        return False  # made here, and refused: not a deleted run's refusal
    try:
        run = client.get_run(str(record["run_id"]))
    except Exception as again:  # telemetry: gone for good, or no answer (kept)
        return is_gone(again)
    return getattr(getattr(run, "info", None), "lifecycle_stage", "") == "deleted"


def _claimer() -> str:
    """A claim names its process, <host>.<pid>-<start ticks>: one of this host that is gone
    is put back; its PID alone may have been reused by another process since."""
    from hpsearch.packing import process_start

    pid = os.getpid()
    return f"{socket.gethostname()}.{pid}-{process_start(pid) or 0}"


def _reclaim_abandoned(spool_dir: Path) -> None:
    """Put back the files a process of this host claimed and died sending."""
    from hpsearch.packing import holder_alive

    host = socket.gethostname()
    for claimed in spool_dir.glob(f".*{SPOOL_SUFFIX}.*.sending") if spool_dir.is_dir() else ():
        name, _, claimer = claimed.name[1:].removesuffix(".sending").partition(SPOOL_SUFFIX + ".")
        claim_host, _, process = claimer.rpartition(".")
        pid, _, start = process.partition("-")  # no start: an earlier version's claim
        if claim_host != host or not pid.isdigit():
            continue
        if holder_alive(int(pid), int(start) if start.isdigit() and int(start) else None):
            continue
        with contextlib.suppress(OSError):
            os.rename(claimed, spool_dir / (name + SPOOL_SUFFIX))


def _http_status(exc: BaseException) -> int | None:
    """The HTTP status an MLflow error stands for; None for any other error."""
    if not isinstance(exc, MlflowException):
        return None
    try:
        return int(exc.get_http_status_code())
    except (TypeError, ValueError):
        return None


def _refused_upload(exc: BaseException) -> bool:
    """An artifact upload the server refuses for good: an HTTP 4xx other than 401/403 (the
    login: every call fails alike), 408/429 (try later) and 404 (a proxy's page while
    MLflow behind it is down; a run that `is_gone` fails its other calls too). Uploads
    through the server's artifact proxy fail with requests' HTTPError, not MlflowException."""
    code = _upload_status(exc)
    return code is not None and 400 <= code < 500 and code not in (401, 403, 404, 408, 429)


def _upload_status(exc: BaseException) -> int | None:
    code = _http_status(exc)
    if code is None:
        code = getattr(getattr(exc, "response", None), "status_code", None)
    return code if isinstance(code, int) else None


def _route_missing(client: MlflowClient, run_id: str, exc: BaseException) -> bool:
    """A 404 to an upload while MLflow itself answers for the run: its artifact route is
    not served (a server restarted without --serve-artifacts), for good; not a proxy's
    page in an outage, which would hold up every later kept run."""
    if _upload_status(exc) != 404:
        return False
    try:
        client.get_run(run_id)
    except Exception:  # down behind the proxy: kept for the next try
        return False
    return True


def _made_run(client: MlflowClient, create: Mapping[str, Any]) -> str:
    """The run of a kept record made offline: the one its key finds (a send cut short
    after the create), else a new one under the study's run. Raises what MLflow raises."""
    experiment_id = ensure_experiment(client, str(create["experiment"]))
    key, number = create.get("run_key"), int(create["trial_number"])
    if key and (made := claim_run_by_key(client, experiment_id, str(key), number)):
        return made
    tags = {str(k): str(v) for k, v in dict(create["tags"]).items()}
    uid = tags.get(STUDY_UID_TAG)
    if PARENT_TAG not in tags and (parents := find_study_runs(client, experiment_id, uid)):
        tags[PARENT_TAG] = parents[0]
    start_ms = create.get("start_ms")
    run = client.create_run(
        experiment_id,
        start_time=int(start_ms) if start_ms else None,
        tags=tags,
        run_name=str(create.get("run_name") or f"trial-{number}"),
    )
    return str(run.info.run_id)


def _replay_run(client: MlflowClient, record: Mapping[str, Any], spool_dir: Path) -> str:
    """Send one kept record; the run's id. An offline run's is made first; its files stay
    under the record's own key."""
    key = str(record["run_id"])
    run_id = _made_run(client, record["create"]) if record.get("create") else key
    incomplete = bool(record.get("incomplete"))
    for b in record["batches"]:
        metrics = [Metric(k, float(v), int(ts), int(step)) for k, v, ts, step in b["metrics"]]
        params = [Param(str(k), str(v)) for k, v in b["params"]]
        tags = [RunTag(str(k), str(v)) for k, v in b["tags"]]
        if b.get("history"):  # a retry's earlier epochs, fetched now the server answers
            source, keys, before = b["history"]
            try:
                metrics, tags = history_batch(
                    client, str(source), tuple(keys), int(before), metrics
                )
            except MlflowException as exc:  # the source run is gone: the rest is sent
                if _http_status(exc) in (401, 403) or not is_permanent_error(exc):
                    raise
                logger.warning("MLflow: run %s's earlier epochs not copied: %s", run_id,
                               _short(exc))  # fmt: skip
                incomplete = True
        for m, p, t in chunk_batch(metrics, params, tags):
            try:
                client.log_batch(run_id, metrics=m, params=p, tags=t, synchronous=True)
            except MlflowException as exc:  # one refused request, as when sent live
                if _http_status(exc) in (401, 403, 404) or not is_permanent_error(exc):
                    raise
                logger.warning(
                    "MLflow: a kept batch of run %s was rejected: %s", run_id, _short(exc)
                )
                incomplete = True
    folder = _artifacts_dir(spool_dir, key)
    for name in record.get("artifacts") or ():
        path = folder / str(name)
        try:
            if path.is_dir():  # uploaded under its name, as `TrialTracker._upload` does
                client.log_artifacts(run_id, str(path), artifact_path=path.name)
            elif path.exists():
                client.log_artifact(run_id, str(path))
            else:
                incomplete = True
        except Exception as exc:  # one refused file (413 behind a proxy, unreadable): as live
            local = isinstance(exc, OSError) and not isinstance(exc, RequestException)
            if not (local or _refused_upload(exc) or _route_missing(client, run_id, exc)):
                raise  # the server is down again: kept for the next try
            logger.warning("MLflow: a kept artifact of run %s was refused: %s", run_id, _short(exc))
            incomplete = True
    if incomplete:
        client.set_tag(run_id, INCOMPLETE_TAG, "true")
    elif not record.get("create") and INCOMPLETE_TAG in client.get_run(run_id).data.tags:
        # Sent whole: a mark of what the server lacked meanwhile goes (the launch's end
        # sweeps runs left RUNNING, this one too, before it sends what was kept).
        client.delete_tag(run_id, INCOMPLETE_TAG)
    if record.get("traceback"):
        client.log_text(run_id, str(record["traceback"]), "traceback.txt")
    end_ms = record.get("end_ms")
    client.set_terminated(
        run_id, status=str(record["status"]), end_time=int(end_ms) if end_ms else None
    )
    return run_id


def _default_gpu_label() -> str:
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return "all"
    return value.strip() or "none"


__all__ = [
    "EPOCH_METRICS",
    "HTTP_POLICY",
    "INCOMPLETE_TAG",
    "INPUT_BOUND_TAG",
    "OUTCOME_STATUS",
    "PRUNED_AT_TAG",
    "REASON_TAG",
    "ROLE_TAG",
    "SUMMARY_METRICS",
    "TrackerStats",
    "TrialTracker",
    "apply_http_policy",
    "backoff_delays",
    "chunk_batch",
    "close_study_run",
    "ensure_experiment",
    "find_study_runs",
    "git_commit",
    "hpsearch_version",
    "is_gone",
    "is_permanent_error",
    "metric_entities",
    "open_study_run",
    "param_value",
    "study_tags",
    "terminal_status",
    "terminal_tags",
    "trial_params",
]
