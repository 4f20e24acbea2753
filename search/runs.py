"""Glue between the search layer and MLflow: one run per study, one child run per trial.

Everything here is best effort: a tracking outage warns and never stops a trial. The
building blocks (batched logger, GPU sampler, artifacts, server) live in hpsearch.tracking.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import queue
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import optuna
from hpsearch.background import Renderer, import_in_idle_time, lower_priority
from hpsearch.config import StudyConfig, config_to_yaml, reported_metric_of, unused_hyperparams
from hpsearch.errors import HpsearchError, TrackingError, TrackingUnreachable
from hpsearch.packing import pid_alive
from hpsearch.storage import StorageSpec
from hpsearch.study import LATE_RUN_ATTR, best_of, dominates, objective_values, study_uid
from hpsearch.tracking.server import redact_uri, scrub
from hpsearch.trainer.types import best_model_path_for
from hpsearch.worker import (
    ATTR_BEST_MODEL,
    ATTR_HISTORY,
    ATTR_HOST,
    ATTR_MESSAGE,
    ATTR_OUTCOME,
    ATTR_PID,
    ATTR_RUN_ID,
    ATTR_RUN_KEY,
    ATTR_TEST_ACC,
    ATTR_WORKER,
    dead_outcome,
    effective_params,
    record_dict,
    worker_alive,
)
from optuna.storages import BaseStorage
from optuna.trial import FrozenTrial, TrialState

logger = logging.getLogger("hpsearch.tracking")

EPOCH_FIELDS = (
    "train_loss", "train_acc", "val_loss", "val_acc", "lr", "epoch_seconds", "images_per_second",
)  # fmt: skip
CHECKPOINT_ARTIFACT = "checkpoint"  # artifact folder holding best.pt of a top-k trial

# Trainer stop reasons -> the outcomes hpsearch.tracking maps to MLflow statuses.
OUTCOMES = {"finished": "completed", "error": "failed"}
# Outcomes of a trial that trained to its end: only these get the PNG and CSV artifacts and
# a best-model checkpoint. A pruned, diverged or failed trial keeps its per-epoch metrics,
# which the MLflow UI charts; drawing its plots cost about 0.4 s of CPU per trial on the
# cores that feed training, for most of a pruned study's trials.
TRAINED_TO_END = ("completed", "early_stopped", "time_limit")


def gpu_summary(sampler: Any) -> dict[str, float]:
    """A GPU sampler stopped: its summary metrics (none without one, or when it fails)."""
    if sampler is None:
        return {}
    try:
        return dict(sampler.stop())
    except Exception as exc:  # telemetry never fails a trial
        logger.warning("GPU sampler stop failed: %s", exc)
        return {}


def summary_metrics(result: Any) -> dict[str, float]:
    """A run's metrics at its end: best_val_acc, best_val_loss (a val_loss study's value),
    test_acc, train_seconds and setup_seconds, those the result has."""
    out = {
        "train_seconds": float(result.train_seconds),
        "setup_seconds": float(result.setup_seconds),
    }
    for name in ("best_val_acc", "best_val_loss", "test_acc"):
        if (value := getattr(result, name)) is not None:
            out[name] = float(value)
    return out


def summary_from_history(
    history: Sequence[Mapping[str, Any]], metric: str, test_acc: Any = None
) -> dict[str, float]:
    """`summary_metrics` as a trial's stored epochs give them back (its `history` attribute,
    one dict per epoch, as `EpochRecord`): its best epoch by `metric` (val_loss the lowest,
    else val_acc the highest; the first on ties, as the trainer keeps it), train_seconds
    the sum of its epochs' (set-up time is not stored). For a run whose worker died before
    it sent them: sorting the runs by best_val_acc put the study's best last."""

    def finite(value: Any) -> bool:
        return isinstance(value, int | float) and math.isfinite(value)

    out: dict[str, float] = {}
    seconds = [float(e["epoch_seconds"]) for e in history if finite(e.get("epoch_seconds"))]
    if seconds:
        out["train_seconds"] = sum(seconds)
    key = "val_loss" if metric == "val_loss" else "val_acc"
    scored = [e for e in history if finite(e.get(key))]
    if scored:
        sign = 1.0 if key == "val_loss" else -1.0
        best = min(scored, key=lambda e: sign * float(e[key]))  # min keeps the first tie
        for name in ("val_acc", "val_loss"):
            if finite(best.get(name)):
                out[f"best_{name}"] = float(best[name])
    if finite(test_acc):
        out["test_acc"] = float(test_acc)
    return out


def outcome_for(stop_reason: str) -> str:
    return OUTCOMES.get(stop_reason, stop_reason)


def epoch_metrics(record: Any) -> dict[str, Any]:
    """An epoch record's metrics as given: one that is no number (a custom trainer's
    `lr=scheduler.get_last_lr()`, a list) is the tracker's to drop with a warning."""
    return {n: v for n in EPOCH_FIELDS if (v := getattr(record, n, None)) is not None}


def _client(uri: str) -> Any:
    from hpsearch.tracking.mlflow_logger import apply_http_policy
    from mlflow.tracking import MlflowClient

    apply_http_policy()
    return MlflowClient(tracking_uri=uri)


def study_run_tags(cfg: StudyConfig, spec: StorageSpec) -> dict[str, str]:
    return {
        "hpsearch.sampler": cfg.sampler.name,
        "hpsearch.pruner": cfg.pruner.name,
        "hpsearch.storage": spec.display,  # password removed
        "hpsearch.dataset": cfg.dataset.name,
    }


def open_study_run(
    cfg: StudyConfig, spec: StorageSpec, uri: str, uid: str | None = None,
    adopt_legacy: bool = False,
) -> str:  # fmt: skip
    """The parent run of the study (created, or reused on relaunch), the Optuna study `uid`
    names (`study.study_uid`); `adopt_legacy`: a study an earlier version launched takes
    the run that version made. Raises TrackingError."""
    from hpsearch.tracking.mlflow_logger import ensure_experiment
    from hpsearch.tracking.mlflow_logger import open_study_run as _open

    client = _client(uri)
    exp = ensure_experiment(client, cfg.name)
    tags, yaml_text = study_run_tags(cfg, spec), config_to_yaml(cfg)
    return str(_open(client, exp, cfg.name, tags, yaml_text, uid, adopt_legacy))


INPUT_BOUND_ATTR = "input_bound_gpu_util"  # Optuna user attr: mean GPU % when flagged
ONNX_ARTIFACT = "model/best_model.onnx"  # the best trial's model, on its run and the study's
RESUME_ARTIFACT = "resume/checkpoint.pt"  # latest resume checkpoint (upload_checkpoints)
# The best model beside it (`best_model_path_for`): a resume checkpoint leaves the best
# weights out when the trainer keeps them in that file, so a retry on another host needs both.
RESUME_BEST_ARTIFACT = "resume/checkpoint.best.pt"


def _file_key(path: Path) -> tuple[int, int, int] | None:
    """(inode, mtime ns, size) of a file, None when it is not there: tells a file that the
    trainer replaced (atomic_save: a new inode) from the one uploaded before."""
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


class _CheckpointUploader:
    """Uploads the latest resume checkpoint off the training thread, with the best-model file
    beside it when that is new since the last upload (about 45 MB for a ResNet-18: not sent
    again with every checkpoint); a newer checkpoint replaces a pending one, so a slow server
    costs freshness, never training time."""

    def __init__(self, client: Any, run_id: str) -> None:
        self.client = client
        self.run_id = run_id
        self._pending: Path | None = None
        self._best_sent: tuple[int, int, int] | None = None
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, daemon=True, name="ckpt-upload")
        self._thread.start()

    def submit(self, path: Path) -> None:
        with self._cond:
            self._pending = path
            self._cond.notify()

    def _run(self) -> None:
        lower_priority()
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                if self._pending is None:
                    return
                path, self._pending = self._pending, None
            self._upload(path)

    def _upload(self, path: Path) -> None:
        folder = RESUME_ARTIFACT.split("/")[0]
        tmp = Path(tempfile.mkdtemp(prefix="hpsearch-ckpt-"))
        try:
            # Copies first, as the trainer replaces the files at a later epoch: the
            # checkpoint's, then the best model's. The trainer writes the best model before
            # the checkpoint that refers to it, so the best copied after the checkpoint is
            # no older than it (a resume retrains the epochs between, exactly). The best
            # model is uploaded first: a fetch between the two uploads finds the same.
            ckpt = tmp / Path(RESUME_ARTIFACT).name
            shutil.copyfile(path, ckpt)
            best = best_model_path_for(path)
            key = _file_key(best)
            if key is not None and key != self._best_sent:
                snap = tmp / Path(RESUME_BEST_ARTIFACT).name
                shutil.copyfile(best, snap)
                self.client.log_artifact(self.run_id, str(snap), folder)
                self._best_sent = key
            self.client.log_artifact(self.run_id, str(ckpt), folder)
        except Exception as exc:  # best effort: the local checkpoint still exists
            logger.warning("checkpoint upload failed: %s", scrub(str(exc)))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def close(self, timeout_s: float = 60.0) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout_s)


# <workdir>/mlflow-spool: what trials' runs could not send while MLflow was down
# (tracking.mlflow_logger.write_spool); sent by a later trial, the worker's end, the launch's.
SPOOL_FOLDER = "mlflow-spool"
EMBEDDED_SPOOL = "embedded"  # the work folder's own server, whatever its port


def spool_folder(workdir: Path, uri: str, *, embedded: bool) -> Path:
    """Where runs tracked at `uri` keep what the server did not take: one folder per
    server, so that a later launch on another server neither makes their runs there nor
    sets them aside as runs it lacks. `embedded`: `uri` is the work folder's own server,
    one server across launches and ports. Any other is named by a hash of its scheme,
    host, port and path (no login: it may change, the server not; this host's loopback
    names as one)."""
    import hashlib
    from urllib.parse import urlsplit

    from hpsearch.tracking.server import LOOPBACK_HOSTS

    if embedded:
        return workdir / SPOOL_FOLDER / EMBEDDED_SPOOL
    server = uri.strip()
    try:
        parts = urlsplit(server)
        host = parts.hostname
        if host:  # else databricks, file:...: the URI as written
            host = "localhost" if host in LOOPBACK_HOSTS else host
            server = f"{parts.scheme.lower()}://{host}:{parts.port}{parts.path.rstrip('/')}"
    except ValueError:  # a port that is not a number, a bad IPv6 host: the URI as written
        pass
    return workdir / SPOOL_FOLDER / hashlib.sha256(server.encode()).hexdigest()[:16]


class _Finisher:
    """Finishes trials' MLflow runs (plots, best-model upload, status) on one background
    thread, in order, so the worker asks for its next trial at once. A job waits until the
    next trial starts training (`release`), or `hold_s`: its uploads and the helper process
    rendering its plots (`Renderer`) would otherwise compete with the ask and start-up of
    the next trial instead of overlapping with its training. `close` releases and drains
    it: nothing queued is dropped when a worker stops."""

    def __init__(self, backlog: int = 4, hold_s: float = 30.0) -> None:
        # Bounded: when uploads are slower than trials, the worker waits here rather than
        # piling up runs that a stop could then drop.
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue(maxsize=backlog)
        self._go = threading.Event()
        self._hold_s = hold_s
        self._thread = threading.Thread(target=self._run, daemon=True, name="run-finisher")
        self._thread.start()

    def submit(self, job: Callable[[], None], hold: bool = True) -> None:
        """`hold` False: a job that holds no trial's end back (the kept runs' replay); it
        does not hold back those queued before it either."""
        if hold:
            self._go.clear()
        self._queue.put(job)

    def release(self) -> None:
        """The next trial is training (or none will come): finish the queued runs now."""
        self._go.set()

    def _run(self) -> None:
        lower_priority()
        while (job := self._queue.get()) is not None:
            self._go.wait(self._hold_s)
            try:
                job()
            except Exception as exc:  # best effort: the trial's metrics are already logged
                logger.warning("finishing a trial's MLflow run failed: %s", scrub(str(exc)))

    def close(self, timeout_s: float = 600.0) -> None:
        self._go.set()
        self._queue.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("MLflow runs still finishing after %.0f s; giving up", timeout_s)


class TrialRun:
    """One trial's MLflow child run plus the GPU sampler feeding it."""

    def __init__(
        self, session: TrackingSession, tracker: Any, sampler: Any, trial: Any,
        checkpoint: Path | None = None, earlier_run: str | None = None,
        restored: list[tuple[int, dict[str, float]]] | None = None,
    ) -> None:  # fmt: skip
        self.session = session
        # A retry's: the epochs its resume checkpoint holds (`restored`) and its failed
        # try's run. Those before the first epoch trained here go to this run as that
        # epoch is logged (`TrialTracker.copy_history`): its charts start at epoch 1.
        self._earlier: tuple[str | None, list[tuple[int, dict[str, float]]]] | None = (
            (earlier_run or None, restored or []) if earlier_run or restored else None
        )
        self.tracker = tracker
        self.sampler = sampler
        self.trial = trial
        self.run_id: str | None = tracker.run_id
        self.checkpoint = checkpoint
        self.uploader: _CheckpointUploader | None = None
        self.ended = False  # its end handed to the finisher (finish_result, finish_failed)
        self._best_to_upload: Path | None = None
        self._study_best = False  # the study's best trial so far when it was told
        if checkpoint is not None and session.cfg.tracking.upload_checkpoints and self.run_id:
            self.uploader = _CheckpointUploader(session.client, self.run_id)
            if checkpoint.is_file():
                # A retry's checkpoint (its failed try's, maybe fetched from that try's run):
                # on this run at once, so that a try dying before its first save of its own
                # leaves the next one something to resume from.
                self.uploader.submit(checkpoint)

    def log_epoch(self, record: Any, timestamp_ms: int | None = None) -> None:
        try:
            self._copy_earlier(int(record.epoch))  # the epochs before this one: the resume's
            self.tracker.log_epoch(int(record.epoch), epoch_metrics(record), timestamp_ms)
        except Exception as exc:  # telemetry never kills training (a custom record)
            logger.warning("MLflow: trial %d's epoch not logged: %s", self.trial.number, exc)
        if self.sampler is not None and self.sampler.input_bound:
            self._note_input_bound()

    def _copy_earlier(self, before: int | None) -> None:
        """Queue the retry's epochs before `before` (its first trained here), once; None:
        it trained none (a time limit already spent, a stop in its set-up): all the
        checkpoint's."""
        if self._earlier is None:
            return
        (source, known), self._earlier = self._earlier, None
        if before is None:
            if not known:  # a custom trainer's checkpoint: up to which epoch is unknown
                return
            before = max(step for step, _ in known) + 1
        self.tracker.copy_history(before, source, EPOCH_FIELDS, known)

    def checkpoint_written(self, path: Path) -> None:
        """The trainer's hook (`TrainOptions.on_checkpoint`, on its writer thread): a resume
        checkpoint is on disk, so the upload (tracking.upload_checkpoints) takes that save
        and not the one before it; an interrupted trial's last save is uploaded too."""
        if self.uploader is not None:
            self.uploader.submit(path)

    def _note_input_bound(self) -> None:
        """Record it on the Optuna trial too, where `launch` progress and `status` see it."""
        if self.trial.number in self.session._input_bound:
            return
        self.session.note_input_bound(self.trial.number)
        mean = self.sampler.input_bound_mean if self.sampler is not None else None
        try:
            self.trial.set_user_attr(INPUT_BOUND_ATTR, round(float(mean or 0.0), 1))
        except Exception as exc:  # telemetry: never fail the trial over it
            logger.warning("could not record input-bound trial %s: %s", self.trial.number, exc)

    def _close_uploader(self) -> None:
        if self.uploader is not None:
            self.uploader.close()

    def flush_uploads(self, timeout_s: float = 30.0) -> None:
        """Wait (at most `timeout_s`) for the checkpoint upload in flight and the one
        queued; the run takes no more (`checkpoint_written` is over for the trial)."""
        if self.uploader is not None:
            self.uploader.close(timeout_s)

    def checkpoint_uri(self, result: Any) -> str | None:
        """Decide, before the trial is told, whether its best model goes to MLflow (top k);
        returns the artifact URI to record on the Optuna trial. A run kept offline (the
        server down at the trial's end) keeps the model with its files but has no URI
        to give yet."""
        outcome = outcome_for(str(result.stop_reason))
        if outcome not in TRAINED_TO_END or not self.tracker.enabled:
            return None
        # Snapshot now, before the tell: once told, another worker's clean-up may delete it.
        path, self._study_best = self.session.checkpoint_to_upload(self.trial, result)
        self._best_to_upload = _snapshot(path)
        if self._best_to_upload is None or not self.run_id:
            return None
        return f"runs:/{self.run_id}/{CHECKPOINT_ARTIFACT}/best.pt"

    def finish_result(self, result: Any, told: bool = True, pruned: bool = False) -> None:
        """Hand the run's ending to the session's finisher thread. What may change under it
        (the GPU sampler, the best-model file that a later trial's clean-up may delete) is
        taken here first. `told`: False when the tell found the trial finished elsewhere
        (stale-failed): the run ends FAILED, as its trial, and its model is neither
        uploaded nor held as the study's best. `pruned`: told PRUNED though it trained to
        its end (no objective value: a time limit before its first evaluation)."""
        self.ended = True
        ended_ms = int(time.time() * 1000)  # the run's end time: not when the finisher sends it
        self._copy_earlier(None)  # a retry that trained no epoch of its own
        self.tracker.log_params(effective_params(result))
        summary = {**gpu_summary(self.sampler), **summary_metrics(result)}
        outcome = outcome_for(str(result.stop_reason))
        reason = str(result.message) or None
        best = self._best_to_upload  # a snapshot (checkpoint_uri), or None
        if not told:  # its trial failed elsewhere meanwhile: the run says so too
            outcome = "failed"
            reason = "finished elsewhere before its tell (its worker was cut off from the database)"
        elif pruned and outcome in TRAINED_TO_END:  # told PRUNED: no value to tell
            outcome = "pruned"
        if best is not None and self._study_best and self.run_id and told:
            cfg = self.session.cfg
            values = objective_values(
                cfg, result.best_val_acc, result.best_val_loss, result.train_seconds
            )
            if values is not None:  # the value told: see worker._tell
                self.session.hold_for_onnx(self.trial, self.run_id, best, values[0])
        upload = told  # no checkpoint_uri was recorded on a trial told elsewhere
        self.session.finish_later(
            lambda: self._finish(result, outcome, summary, best, reason, upload, ended_ms)
        )

    def _finish(
        self,
        result: Any,
        outcome: str,
        summary: dict[str, float],
        best: Path | None,
        reason: str | None,
        upload: bool = True,
        ended_ms: int | None = None,
    ) -> None:
        artifacts: list[Path] = []
        tmp: Path | None = None
        try:
            self._close_uploader()
            plots = outcome in TRAINED_TO_END
            if plots or (best is not None and upload):  # (QA: an empty one left at each exit)
                tmp = Path(tempfile.mkdtemp(prefix="hpsearch-artifacts-"))
            if plots and tmp is not None:
                artifacts += self._plots(result, tmp)
            if best is not None and upload and tmp is not None:
                folder = tmp / CHECKPOINT_ARTIFACT
                folder.mkdir()
                (folder / "best.pt").symlink_to(best.resolve())
                artifacts.append(folder)
        except Exception as exc:  # a full /tmp: the run still ends, with what it has
            logger.warning("MLflow: artifacts of trial %d: %s", self.trial.number, exc)
            artifacts = [a for a in artifacts if a.exists()]
        try:
            self.tracker.finish(
                outcome,
                result.pruned_at_epoch,
                summary,
                artifacts,
                None,
                reason=reason,
                end_time_ms=ended_ms,
            )
        finally:
            if tmp is not None:
                _rmtree(tmp)
            if best is not None:
                _rmtree(best.parent)

    def _plots(self, result: Any, tmp: Path) -> list[Path]:
        from hpsearch.background import trial_plots

        try:
            history = [record_dict(r) for r in result.history]
            confusion = [list(row) for row in result.confusion or []]
            names = list(result.class_names) or [str(i) for i in range(len(confusion))]
            return self.session.renderer.run(
                trial_plots, history, confusion, names, self.trial.number, tmp
            )
        except Exception as exc:  # a plotting problem must not lose the run's metrics
            logger.warning("trial %s: artifacts failed: %s", self.trial.number, scrub(str(exc)))
            return []

    def finish_failed(self, outcome: str, message: str, tb: str | None, result: Any = None) -> None:
        """End the run as failed; `result`: the trainer's, where it returned one (a value
        the study could not take), whose effective lr and batch size the run logs."""
        if result is not None:
            self.tracker.log_params(effective_params(result))
        self.ended = True
        ended_ms = int(time.time() * 1000)
        self._copy_earlier(None)  # a retry that trained no epoch of its own
        summary = gpu_summary(self.sampler)
        # A snapshot `checkpoint_uri` made for a trial that then failed (its tell raised, or
        # its value was not finite) is not uploaded: its hard link goes now.
        best, self._best_to_upload = self._best_to_upload, None
        if best is not None:
            _rmtree(best.parent)

        def finish() -> None:
            self._close_uploader()
            self.tracker.finish(
                outcome_for(outcome), None, summary, [], tb, reason=message, end_time_ms=ended_ms
            )

        self.session.finish_later(finish)


class FixedRun:
    """`hpsearch train`'s MLflow run: in the study's experiment, at its top level (no
    search's child), named after the run's files (`fixed`, `trial-N`) and tagged
    `hpsearch.role=train` (`hpsearch.reproduces_trial=N` for `--trial N`): its params as a
    trial's, its epochs (one request each), GPU samples, plots and best model. The
    tracker's sender never raises: a server that went away leaves the run incomplete,
    never the training stopped. `start` raises TrackingError when no run could be made."""

    def __init__(self, tracker: Any, sampler: Any, title: str) -> None:
        self.tracker = tracker
        self.sampler = sampler
        self.title = title
        self.run_id: str = tracker.run_id

    @classmethod
    def start(
        cls, cfg: StudyConfig, uri: str, params: Mapping[str, Any], label: str,
        trial_number: int | None, device: str, uid: str | None = None,
    ) -> FixedRun:  # fmt: skip
        """`uid`: the study's whose trial it reproduces (`study_uid`), tagged as its runs."""
        from hpsearch.tracking.gpu import sampler_for_tracker, trial_gpu_index
        from hpsearch.tracking.mlflow_logger import (
            ROLE_TAG,
            STUDY_UID_TAG,
            TrialTracker,
            ensure_experiment,
        )

        client = _client(uri)
        experiment_id = ensure_experiment(client, cfg.name)  # TrackingError: one line
        tags = {ROLE_TAG: "train"}
        if trial_number is not None:
            tags["hpsearch.reproduces_trial"] = str(trial_number)
        if uid:
            tags[STUDY_UID_TAG] = uid
        cuda = False
        if device != "cpu":
            import torch

            cuda = torch.cuda.is_available()
        tracker = TrialTracker(
            # Not `trial-N`: beside the trial runs of that name, the UI told them apart by
            # nesting alone (QA).
            client, experiment_id, "", trial_number=None, run_name=f"train-{label}",
            study_name=cfg.name, params=run_params(cfg, params, sampled=False), worker="train",
            gpu=None if cuda else "none", tags=tags,
        )  # fmt: skip
        if tracker.run_id is None:
            raise TrackingError(f"MLflow at {redact_uri(uri)} made no run for {label}")
        t = cfg.tracking
        sampler: Any = sampler_for_tracker(
            tracker,
            interval_s=t.gpu_interval_s,
            window_s=t.input_bound_window_s,
            threshold_pct=t.input_bound_threshold,
            stop_when_input_bound=False,  # one run the user asked for: never cut short
            trial_device=trial_gpu_index(device, cuda),
            paused=False,
        )
        try:
            sampler.start()
        except Exception as exc:  # telemetry never fails a run
            logger.warning("GPU sampler failed to start: %s", exc)
            sampler = None
        return cls(tracker, sampler, f"train {label}")

    def log_epoch(self, record: Any) -> None:
        try:
            self.tracker.log_epoch(int(record.epoch), epoch_metrics(record))
        except Exception as exc:  # telemetry never kills training
            logger.warning("MLflow: an epoch of %s not logged: %s", self.title, exc)

    def finish(self, result: Any) -> bool:
        """End the run as its training ended, with its plots and best model; True when
        MLflow took all of it."""
        self.tracker.log_params(effective_params(result))
        summary = {**gpu_summary(self.sampler), **summary_metrics(result)}
        outcome = outcome_for(str(result.stop_reason))
        tmp = Path(tempfile.mkdtemp(prefix="hpsearch-artifacts-"))
        try:
            artifacts: list[Path] = []
            if outcome in TRAINED_TO_END:
                try:
                    artifacts += self._plots(result, tmp)
                except Exception as exc:  # a plot must not lose the run's metrics
                    logger.warning("%s: artifacts failed: %s", self.title, scrub(str(exc)))
            best = result.best_model_path
            if best is not None and Path(best).is_file():
                folder = tmp / CHECKPOINT_ARTIFACT
                folder.mkdir()
                (folder / "best.pt").symlink_to(Path(best).resolve())
                artifacts.append(folder)
            reason = str(result.message) or None
            return bool(
                self.tracker.finish(
                    outcome, result.pruned_at_epoch, summary, artifacts, None, reason=reason
                )
            )
        finally:
            _rmtree(tmp)

    def _plots(self, result: Any, tmp: Path) -> list[Path]:
        from hpsearch.tracking.artifacts import trial_artifacts

        history = [record_dict(r) for r in result.history]
        confusion = [list(row) for row in result.confusion or []]
        names = list(result.class_names) or [str(i) for i in range(len(confusion))]
        return trial_artifacts(history, confusion, names, self.title, tmp)

    def fail(self, exc: BaseException, tb: str | None) -> None:
        """End the run FAILED (KILLED for a Ctrl-C), with the error and its traceback."""
        summary = gpu_summary(self.sampler)
        interrupted = not isinstance(exc, Exception)
        outcome = "interrupted" if interrupted else "failed"
        reason = "interrupted" if interrupted else f"{type(exc).__name__}: {exc}"
        self.tracker.finish(outcome, None, summary, [], None if interrupted else tb,
                            reason=reason, timeout_s=5.0 if interrupted else None)  # fmt: skip


SNAPSHOT_PREFIX = ".upload-"
FETCH_PREFIX = ".fetch-"  # a resume checkpoint being downloaded (fetch_checkpoint)
OWNER_FILE = ".owner"  # flock-ed by the process that made the snapshot, while it lives
_owner_fds: dict[Path, int] = {}  # snapshot folder -> its owner file's descriptor
_owner_fds_lock = threading.Lock()


def _snapshot(path: Path | None, into: Path | None = None) -> Path | None:
    """A hard link to `path` in a private folder beside it (or in `into`; a copy across file
    systems), so the file outlives its deletion by checkpoint clean-up until it is used.
    The folder is this process's until `_rmtree` deletes it (`_own`)."""
    if path is None or not path.exists():
        return None
    folder: Path | None = None
    try:
        folder = Path(tempfile.mkdtemp(prefix=SNAPSHOT_PREFIX, dir=into or path.parent))
        _own(folder)
        snap = folder / path.name
        try:
            os.link(path, snap)
        except OSError:
            shutil.copyfile(path, snap)
    except OSError as exc:  # best effort: the model stays on disk, only its upload is lost
        logger.warning("could not set %s aside for upload: %s", path, exc)
        if folder is not None:
            _rmtree(folder)
        return None
    return snap


def _own(folder: Path) -> None:
    """Hold an exclusive flock on the folder's owner file (which names this host) until
    `_rmtree` deletes the folder. The kernel drops it when this process dies, however it
    dies (in any container on the machine): then `remove_stale_snapshots` on this host may
    delete the folder. Locked under a temporary name first, so the owner file is never seen
    unlocked. Where the file system has no locks, the folder stays unowned: never swept."""
    tmp = folder / f"{OWNER_FILE}.new"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.write(fd, socket.gethostname().encode())
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(tmp, folder / OWNER_FILE)
    except OSError as exc:  # ENOLCK, EOPNOTSUPP (some network file systems), ...
        os.close(fd)
        logger.info("snapshot %s left unowned (no file lock here): %s", folder, exc)
        return
    with _owner_fds_lock:
        _owner_fds[folder] = fd


def _close_owner_fds_in_child() -> None:
    """A forked child (a DataLoader worker) must not keep its parent's snapshots locked
    after the parent dies; closing its copies leaves the parent's locks alone."""
    for fd in _owner_fds.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    _owner_fds.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_owner_fds_in_child)


def snapshot_abandoned(folder: Path, host: str) -> bool:
    """Whether no live process owns the snapshot folder: its owner file names `host` (this
    one: a lock on a network file system may be local to each machine) and its lock is free.
    A folder without an owner file (an older version's, or on a file system without locks)
    is not judged: kept."""
    try:
        fd = os.open(folder / OWNER_FILE, os.O_RDWR)
    except OSError:
        return False
    try:
        if os.read(fd, 4096).decode(errors="replace") != host:
            return False
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held: its process lives (this one's own folders too)
        return False
    finally:
        os.close(fd)  # releases what this check took
    return True


def remove_stale_snapshots(checkpoints: Path) -> list[Path]:
    """Delete the abandoned snapshot folders under the work folder's `checkpoints/` (one
    folder a study): a worker killed mid-study leaves its snapshots there, hard links that
    keep a pruned best model's bytes (about 45 MB for a ResNet-18) on disk. Returns what
    went."""
    gone: list[Path] = []
    host = socket.gethostname()
    prefixes = (SNAPSHOT_PREFIX, FETCH_PREFIX)  # a killed fetch's download folder too
    for study_dir in _subdirs(checkpoints):
        for folder in _subdirs(study_dir):
            if folder.name.startswith(prefixes) and snapshot_abandoned(folder, host):
                _rmtree(folder)
                gone.append(folder)
    return gone


def _subdirs(folder: Path) -> list[Path]:
    try:
        return [p for p in folder.iterdir() if p.is_dir()]
    except OSError:  # not there (yet), or unreadable: nothing to clean
        return []


SETUP_WAIT_AFTER_STOP_S = 10.0  # s a stopping worker waits for a set-up still under way


def _run_job(job: Callable[[], None]) -> None:
    try:
        job()
    except Exception as exc:  # one trial's run must not stop the others'
        logger.warning("MLflow: a trial's run failed to start: %s", scrub(str(exc)))


class TrackingSession:
    """A worker's connection to MLflow: experiment, parent run, and a TrialRun per trial."""

    def __init__(
        self,
        cfg: StudyConfig,
        spec: StorageSpec,
        uri: str,
        worker_id: str,
        await_study_run_s: float = 0.0,
        server_answered: bool = False,
        background: bool = False,
        stop: threading.Event | None = None,
        device: str = "auto",
        spool_dir: Path | None = None,
        on_run_made: Callable[[Mapping[str, Any], str], object] | None = None,
        study_uid: Callable[[], str | None] | None = None,
    ) -> None:
        """background: set up (import MLflow, wait for the study run, connect) on a thread,
        so that a worker's first trial trains meanwhile; `when_ready` runs what needs it.
        `stop` (the worker's) ends the wait for the study run: a worker told to stop (its
        launcher killed) waited up to `await_study_run_s` to tell its finished trials.
        `server_answered`: the launcher's server answered before this worker started (not
        an embedded one still starting): found down, it is not waited for past a trial's end.
        `device`: the worker's --device; the GPU telemetry samples the GPU it trains on.
        `spool_dir`: where a trial's run keeps what MLflow, down past the trial's end, did
        not take; sent at a later trial's start and at `close` (`replay_spool`), with
        `on_run_made` told of each run made then for a trial that had ended (`link_late_run`).
        `study_uid` reads the study's uid (`study.study_uid`; its launch gives it one as it
        opens the study, maybe after this worker started): the study run is the one it tags."""
        self._stop = stop if stop is not None else threading.Event()
        self._on_run_made = on_run_made
        self.device = device
        self.spool_dir = spool_dir
        self._replay_queued = False
        self.cfg = cfg
        self.spec = spec
        self.uri = uri
        self.worker_id = worker_id
        self.client: Any = None
        self.experiment_id: str | None = None
        self.parent_run_id: str | None = None
        self._input_bound: set[int] = set()
        self._finisher = _Finisher()
        self.renderer = Renderer()  # plots, off this process's GIL
        self._ready_lock = threading.Lock()
        self._down_tries = 0  # run starts in a row that found the server down
        self._on_ready: list[Callable[[], None]] = []
        self._setup_error: BaseException | None = None
        self._setup_thread: threading.Thread | None = None
        self._setup_done = False
        # A trial's end waits for its run's start: the wait for the study run gives up
        # on a server that went down (`_await_study_run`).
        self._trial_ending = threading.Event()
        self._await_until = 0.0  # monotonic s: until then the launcher opens the study run
        self._server_answered = server_answered
        self._read_uid = study_uid
        self._study_uid: str | None = None
        self._onnx_held: _HeldBest | None = None
        if background:
            self._setup_thread = threading.Thread(
                target=self._setup, args=(await_study_run_s,), daemon=True, name="mlflow-setup"
            )
            self._setup_thread.start()
        else:
            self._setup(await_study_run_s)
            self.wait_ready()

    def _setup(self, await_study_run_s: float) -> None:
        if self._setup_thread is not None:  # beside the first trial's training
            lower_priority()
            # What _client imports (MLflow: about 1.3 s of CPU); the tell waits for it.
            import_in_idle_time("hpsearch.tracking.mlflow_logger")
        try:
            self.client = _client(self.uri)
            if await_study_run_s > 0:
                self._await_study_run(await_study_run_s)
            self._connect()
        except BaseException as exc:  # re-raised by wait_ready, on the worker's thread
            self._setup_error = exc
            if isinstance(exc, Exception) and self._setup_thread is not None:  # else raised
                logger.warning("MLflow set-up failed, trials go on untracked: %s",
                               scrub(str(exc)))  # fmt: skip
        finally:
            with self._ready_lock:
                jobs, self._on_ready = self._on_ready, []
                self._setup_done = True
            if self._setup_error is None:
                for job in jobs:
                    _run_job(job)

    def ready(self) -> bool:
        """Whether the set-up is over (its jobs may still be running)."""
        return self._setup_done

    def setup_failed(self) -> BaseException | None:
        """What the set-up raised, once it is over; None while it runs or if it succeeded."""
        return self._setup_error if self._setup_done else None

    def wait_ready(self) -> None:
        """Until the set-up and the jobs it ran are done; raises what the set-up raised."""
        thread = self._setup_thread
        if thread is not None and thread is not threading.current_thread():  # a job's call
            thread.join()
        if self._setup_error is not None:
            raise self._setup_error

    def when_ready(self, job: Callable[[], None]) -> None:
        """Run `job` on a thread of its own if the set-up is over, else on the set-up thread
        once it is; never on the caller's (a trial's run start may wait minutes on a server
        that does not answer). An exception it raises is logged, not raised."""
        with self._ready_lock:
            if not self.ready():
                self._on_ready.append(job)
                return
        if self._setup_error is None:
            threading.Thread(
                target=_run_job, args=(job,), daemon=True, name="mlflow-run-start"
            ).start()

    def _await_study_run(self, limit_s: float) -> None:
        """Wait, up to `limit_s`, until the server answers and the study run exists: the
        launcher opens it while its workers start, and a worker that got there first would
        open a second one. Past the limit, `_connect` opens or warns as usual."""
        from hpsearch.tracking.mlflow_logger import find_study_runs
        from hpsearch.tracking.server import health_ok
        from mlflow.exceptions import MlflowException

        deadline = time.monotonic() + limit_s
        # QA: a server that died in a launch's first seconds, before this worker's first
        # look (it looks in idle CPU time), was waited for as one still starting: 240 s.
        answered = self._server_answered
        while time.monotonic() < deadline and not self._stop.is_set():
            if health_ok(self.uri, timeout_s=1.0):
                answered = True
                try:
                    exp = self.client.get_experiment_by_name(self.cfg.name)
                    # (No uid yet: the launch has not opened the study, nor so its run.)
                    uid = self.uid() if exp is not None else None
                    if uid is not None and find_study_runs(self.client, exp.experiment_id, uid):
                        return
                except MlflowException as exc:  # the server is starting; ask again
                    logger.debug("study run not there yet: %s", scrub(str(exc)))
                except Exception as exc:  # the database's: ask again
                    logger.debug("study uid not read: %s", scrub(str(exc)))
            elif answered and self._trial_ending.is_set():
                # Down since it answered (not an embedded server still starting, which
                # is waited for), and a trial has ended: its tell waited out the limit,
                # 240 s of an idle GPU. Its run is kept in the spool folder until the
                # server answers; until the limit `_connect` opens no study run.
                self._await_until = deadline
                return
            self._stop.wait(0.2)

    def uid(self) -> str | None:
        """The study's uid, once read (it never changes); None while it has none. Raises
        what the database raises."""
        if self._study_uid is None and self._read_uid is not None:
            self._study_uid = self._read_uid()
        return self._study_uid

    def trial_ending(self) -> None:
        """A trial has ended and waits for its run's start (`_LateRun.wait`)."""
        self._trial_ending.set()

    def finish_later(self, job: Callable[[], None]) -> None:
        self._finisher.submit(job)

    def trial_training(self) -> None:
        """The next trial has started training: the previous trials' runs finish now."""
        self._finisher.release()

    def _connect(self) -> bool | None:
        """True once the study's experiment and run are known; False when the server did
        not answer (a later try may), None when it refused (a login, a permission)."""
        if self.parent_run_id is not None:
            return True
        from hpsearch.tracking.mlflow_logger import (
            ensure_experiment,
            find_study_runs,
            is_permanent_error,
        )
        from mlflow.exceptions import MlflowException

        try:
            try:
                uid = self.uid()
            except Exception as exc:  # the database's: a later trial's start tries again
                raise TrackingUnreachable(f"the study's uid not read: {exc}") from exc
            if uid is None and self._read_uid is not None:
                # Its launch has not opened the study yet: any study run found now may be
                # another study's of its name (review). Its runs wait in the spool.
                raise TrackingUnreachable("the study has no uid yet (its launch gives it one)")
            self.experiment_id = ensure_experiment(self.client, self.cfg.name)
            runs = find_study_runs(self.client, self.experiment_id, uid)
            if not runs and time.monotonic() < self._await_until:
                # A wait for the launcher's study run cut short (a trial ended meanwhile):
                # the launcher's is still to come, not a second one of ours.
                raise TrackingUnreachable("the launch's study run is not there yet")
            self.parent_run_id = (
                runs[0] if runs else open_study_run(self.cfg, self.spec, self.uri, uid)
            )
        except (TrackingError, HpsearchError, MlflowException, OSError) as exc:
            refused = is_permanent_error(exc) or (
                isinstance(exc, HpsearchError) and not isinstance(exc, TrackingUnreachable)
            )
            # Once per outage: every trial's start tries again while it lasts.
            level = logging.DEBUG if self._down_tries and not refused else logging.WARNING
            logger.log(level, "MLflow at %s %s, trials go on without it: %s",
                       redact_uri(self.uri), "refused" if refused else "unreachable",
                       scrub(str(exc)))  # fmt: skip
            return None if refused else False
        return True

    def note_unreachable(self) -> int:
        """A run's start found the server down: the starts that did so in a row, this
        one included (their next tries back off together; `start_trial` resets it)."""
        with self._ready_lock:
            self._down_tries += 1
            return self._down_tries

    def note_input_bound(self, number: int) -> None:
        self._input_bound.add(number)

    def start_trial(
        self,
        trial: optuna.Trial,
        params: Mapping[str, Any],
        root: int,
        ckpt: Path,
        start_time_ms: int | None = None,
        early_gpu: tuple[Any, Any] | None = None,
        run_key: str | None = None,
        offline: bool = False,
        again: bool = False,
        earlier_run: str | None = None,
    ) -> TrialRun | None:
        """The trial's MLflow run, its GPU sampler started; None without MLflow (raises
        TrackingUnreachable when the server did not answer: a later try may). The run
        starts at `start_time_ms` (ms since the epoch) when given, else now. `early_gpu`
        (`early_gpu_sampler`) is a sampler already running since the trial's start: the run
        takes it and its samples so far; it stays the caller's when no run is returned.
        `run_key` (the trial's `mlflow_run_key`) tags the run, to find it again unlinked.
        `offline`: a run kept whole in the spool folder and made when the server answers
        (a trial that ended while it was down); None without a spool folder. `again`: an
        earlier start did not answer (its create may have landed: looked for first).
        `earlier_run`: a retry's failed try's run; a retry's run gets the epochs before
        its first from its resume checkpoint `ckpt`, dated as that run logged them."""
        from hpsearch.tracking.gpu import sampler_for_tracker
        from hpsearch.tracking.mlflow_logger import TrialTracker

        self.wait_ready()
        if offline:
            if self.spool_dir is None:
                return None
        elif (connected := self._connect()) is None:
            with self._ready_lock:  # it answers: the next outage is a new one
                self._down_tries = 0
            return None  # refused: no try would do better
        elif not connected:
            raise TrackingUnreachable(f"MLflow at {redact_uri(self.uri)} did not answer")
        gpu = self._gpu_label()

        def make() -> TrialTracker:
            return TrialTracker(
                self.client,
                self.experiment_id or "",  # offline: the run is made under them later
                self.parent_run_id or "",
                trial_number=trial.number,
                study_name=self.cfg.name,
                params=run_params(self.cfg, params),
                worker=self.worker_id,
                host=socket.gethostname(),
                gpu=gpu,
                tags=trial_tags(trial, root, self._study_uid),
                start_time_ms=start_time_ms,
                run_key=run_key,
                spool_dir=self.spool_dir,
                offline=offline,
                find_first=again,
                quiet=self._down_tries > 0,
            )

        # Read before the trainer's first save of its own, which a finished trial's
        # clean-up deletes before a send kept offline goes; its later saves hold these too.
        restored = saved_history(ckpt) if root != trial.number else None
        tracker = make()
        if tracker.gone and not offline:  # its experiment was deleted for good: made anew
            with self._ready_lock:
                self.experiment_id = self.parent_run_id = None
            if (connected := self._connect()) is False:  # down meanwhile: a later try may do
                raise TrackingUnreachable(f"MLflow at {redact_uri(self.uri)} did not answer")
            if connected:
                tracker = make()
        if tracker.unreachable:
            raise TrackingUnreachable(f"MLflow at {redact_uri(self.uri)} made no run in time")
        if not tracker.enabled:
            with self._ready_lock:  # it answered (a refusal): the next outage is a new one
                self._down_tries = 0
            return None
        if not offline and self._down_tries:
            logger.warning("MLflow at %s answers again", redact_uri(self.uri))
            with self._ready_lock:
                self._down_tries = 0
        if not offline and self._spooled() and not self._replay_queued:  # it answers again
            self._replay_queued = True
            self._finisher.submit(self._replay, hold=False)
        if early_gpu is not None:
            sampler, relay = early_gpu
            relay.attach(tracker)
            return TrialRun(self, tracker, sampler, trial, ckpt, earlier_run, restored)
        sampler = sampler_for_tracker(tracker, **self._sampler_options())
        try:
            sampler.start()
        except Exception as exc:  # telemetry never fails a trial
            logger.warning("GPU sampler failed to start: %s", exc)
            sampler = None
        return TrialRun(self, tracker, sampler, trial, ckpt, earlier_run, restored)

    def early_gpu_sampler(self) -> tuple[Any, Any] | None:
        """A GPU sampler started now, for a trial whose run starts later (a worker's first
        trial trains while MLflow is set up): `(sampler, relay)` for `start_trial`, which
        hands its samples so far to the run with their times; None without a GPU."""
        from hpsearch.tracking.gpu import relayed_sampler

        sampler, relay = relayed_sampler(**self._sampler_options())
        try:
            return (sampler, relay) if sampler.start() else None
        except Exception as exc:  # telemetry never fails a trial
            logger.warning("GPU sampler failed to start: %s", exc)
            return None

    def answers(self) -> bool:
        """Whether the server answers now (within 1 s; a proxy's 503 while MLflow is down
        is no answer)."""
        from hpsearch.tracking.server import server_answers

        return server_answers(self.uri, timeout_s=1.0)

    def _spooled(self) -> bool:
        from hpsearch.tracking.mlflow_logger import SPOOL_SUFFIX

        try:
            return self.spool_dir is not None and any(self.spool_dir.glob(f"*{SPOOL_SUFFIX}"))
        except OSError:
            return False

    def _replay(self) -> None:
        """Send the runs kept while MLflow was down (on the finisher thread)."""
        from hpsearch.tracking.mlflow_logger import replay_spool
        from hpsearch.tracking.server import health_ok

        self._replay_queued = False
        # A server that accepts but does not answer would hold each call for minutes.
        if self.spool_dir is None or self.client is None or not self._spooled():
            return
        if not health_ok(self.uri, any_status=True):
            return
        if sent := replay_spool(self.client, self.spool_dir, on_made=self._on_run_made):
            logger.info("MLflow: sent %d run(s) kept while the server was down", sent)

    def _gpu_label(self) -> str | None:
        """The run's `hpsearch.gpu` tag: "none" for a worker that trains on the CPU (the
        tracker's default names CUDA_VISIBLE_DEVICES, "all" when unset); None: that."""
        if self.device == "cpu":
            return "none"
        if self.device == "auto":
            import torch

            return None if torch.cuda.is_available() else "none"
        return None

    def _sampler_options(self) -> dict[str, Any]:
        from hpsearch.tracking.gpu import trial_gpu_index

        t = self.cfg.tracking
        cuda = False
        if self.device == "auto":
            import torch

            cuda = torch.cuda.is_available()
        return {
            "interval_s": t.gpu_interval_s,
            "window_s": t.input_bound_window_s,
            "threshold_pct": t.input_bound_threshold,
            "stop_when_input_bound": t.stop_input_bound,
            "trial_device": trial_gpu_index(self.device, cuda),
            # Judged from the first epoch's end on (worker._LateRun.training_began): the
            # set-up, a wait for GPU memory and a compiling first epoch leave the GPU idle.
            "paused": True,
        }

    def checkpoint_to_upload(self, trial: Any, result: Any) -> tuple[Path | None, bool]:
        """The best-model file of a finished trial if it ranks in the study's top k by its
        objective (in a multi-objective study: if no complete trial dominates it), and
        whether it is the study's best so far (never, in a multi-objective study)."""
        path = result.best_model_path
        if path is None or not Path(path).exists() or self.cfg.tracking.keep_top_k == 0:
            return None, False
        values = objective_values(
            self.cfg, result.best_val_acc, result.best_val_loss, result.train_seconds
        )
        if values is None or not all(math.isfinite(v) for v in values):
            return None, False  # the worker fails such a trial (see worker._tell)
        study = trial.study
        try:
            done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        except Exception as exc:  # storage hiccup: skip the upload rather than fail the trial
            logger.warning(
                "could not rank trial %s for checkpoint upload: %s", trial.number, scrub(str(exc))
            )
            return None, False
        directions = self.cfg.objective.directions
        if self.cfg.objective.multi:
            on_front = not any(t.values and dominates(t.values, values, directions) for t in done)
            return (Path(path) if on_front else None), False
        value, maximize = values[0], directions[0] == "maximize"
        better = [
            t
            for t in done
            if t.value is not None and (t.value > value if maximize else t.value < value)
        ]
        top_k = len(better) < self.cfg.tracking.keep_top_k
        return (Path(path) if top_k else None), not better

    def fetch_checkpoint(self, previous_run_id: str, dest: Path) -> bool:
        """Download a failed trial's last resume checkpoint (uploaded by another host) to
        `dest`, and its best-model file, when the run holds one, to `best_model_path_for(dest)`
        (a stale one there is deleted when it holds none), unless a file at `dest` is as far
        along (an earlier try of this host's). Both are downloaded into a folder
        beside `dest` and renamed into place, the checkpoint last: a download cut short
        leaves no half file that the next retry would trust, nor a checkpoint without its
        best model."""
        tmp: Path | None = None
        try:
            self.wait_ready()
            dest.parent.mkdir(parents=True, exist_ok=True)
            # Owned like a snapshot folder: `remove_stale_snapshots` deletes it once this
            # process is gone, killed mid-download.
            tmp = Path(tempfile.mkdtemp(prefix=FETCH_PREFIX, dir=dest.parent))
            _own(tmp)
            folder = RESUME_ARTIFACT.split("/")[0]
            local = Path(self.client.download_artifacts(previous_run_id, folder, str(tmp)))
            checkpoint = local / Path(RESUME_ARTIFACT).name
            if not checkpoint.is_file():
                raise FileNotFoundError(f"{RESUME_ARTIFACT} is not in run {previous_run_id}")
            here, there = saved_epoch(dest), saved_epoch(checkpoint)
            if there is None and not _loadable(checkpoint):
                return False  # cut short, damaged: starting over beats failing at its load
            if here is not None and (there is None or there <= here):
                return False  # this host's own file is as far along (an earlier try of it)
            best = local / Path(RESUME_BEST_ARTIFACT).name
            if best.is_file():
                os.replace(best, best_model_path_for(dest))
            else:
                best_model_path_for(dest).unlink(missing_ok=True)
            os.replace(checkpoint, dest)
            return True
        except Exception as exc:  # nothing to resume from: the retry starts over
            # Said where one was to be there: a study that uploads none has none to find
            # (QA: "Failed to download artifacts" read as an error in every such retry).
            if self.cfg.tracking.upload_checkpoints:
                logger.warning(
                    "no resume checkpoint in run %s: %s", previous_run_id, scrub(str(exc))
                )
            else:
                logger.info(
                    "no resume checkpoint uploaded (tracking.upload_checkpoints: false): "
                    "the retry starts from epoch 1 unless this host has one"
                )
            return False
        finally:
            if tmp is not None:
                _rmtree(tmp)

    def hold_for_onnx(self, trial: Any, run_id: str, weights: Path, value: float) -> None:
        """Keep the model of the trial this worker just told as the study's best so far
        (`weights`: its best-model snapshot; `value`: its objective value), in place of the
        one held before unless that one is as good (a tie keeps the earlier trial): `close`
        exports it to ONNX if its value is still the study's best.

        Not at once: the export takes the worker's main thread for 1.0 to 1.3 s (a ResNet-18
        on 2 CPU cores, the first one importing onnx), between trials, while the GPU idles,
        and most new bests of a study are overtaken. In the helper process it would need
        torch imported there (seconds, and its memory beside every packed worker); on a
        thread it would hold the GIL against training."""
        cfg = self.cfg
        if not cfg.tracking.onnx or cfg.objective.multi:
            return
        held = self._onnx_held
        if held is not None and not _better(value, held.value, cfg.objective.directions[0]):
            return
        # Beside the snapshot's folder, which the run's finisher deletes after its upload.
        snap = _snapshot(weights, into=weights.parent.parent)
        if snap is None:
            return
        self._onnx_held = _HeldBest(
            trial.study, trial.number, dict(trial.params), run_id, snap, float(value)
        )
        if held is not None:
            _rmtree(held.weights.parent)

    def _export_held_onnx(self) -> None:
        """The held model in ONNX on its trial's run (`model/best_model.onnx`), if its value
        is still the study's best (another worker's trial may tie it: both export, and the
        launcher takes either): the launcher copies it to the study run from there. A
        better trial of another worker is that worker's to export."""
        held, self._onnx_held = self._onnx_held, None
        if held is None:
            return
        tmp = Path(tempfile.mkdtemp(prefix="hpsearch-onnx-"))
        try:
            try:
                best = float(held.study.best_value)
            except ValueError:  # no complete trial: not ours either
                return
            if best != held.value or self.client is None:  # values come back exactly
                return
            onnx = export_model_onnx(self.cfg, held.params, held.weights, tmp / "best_model.onnx")
            self.client.log_artifact(held.run_id, str(onnx), ONNX_ARTIFACT.split("/")[0])
        except Exception as exc:  # best effort, like the plots: the trials are all recorded
            logger.warning("trial %s: ONNX export failed: %s", held.number, scrub(str(exc)))
        finally:
            _rmtree(tmp)
            _rmtree(held.weights.parent)

    def close(self) -> None:
        """Wait for the trials' runs to finish (a stopping worker loses none of them), and
        export the held study best to ONNX meanwhile (the launcher waits for it)."""
        thread, stopped_at = self._setup_thread, None
        while thread is not None and thread.is_alive():  # its jobs start runs the finisher
            thread.join(0.5)  # then closes; a set-up stuck on a server that does not
            if not self._stop.is_set():  # answer is left behind once the worker stops
                continue
            stopped_at = time.monotonic() if stopped_at is None else stopped_at
            if time.monotonic() - stopped_at > SETUP_WAIT_AFTER_STOP_S:
                logger.warning("MLflow set-up still waits for the server; stopping without it")
                break
        self._finisher.release()  # its uploads overlap with the export
        try:
            self._export_held_onnx()
        finally:
            if self._setup_done:  # after the runs queued before it, which may keep theirs
                self._finisher.submit(self._replay, hold=False)
            self._finisher.close()
            self.renderer.close()


def _better(value: float, than: float, direction: str) -> bool:
    return value > than if direction == "maximize" else value < than


class _HeldBest(NamedTuple):
    """The study's best trial as its worker last told it, and its model (`hold_for_onnx`)."""

    study: optuna.Study
    number: int
    params: dict[str, Any]
    run_id: str
    weights: Path
    value: float


def run_params(cfg: StudyConfig, params: Mapping[str, Any], sampled: bool = True) -> dict[str, str]:
    """A run's MLflow params: `params` (a trial's sampled, a train run's given), the derived
    values (effective lr and batch size, arch, image sizes in px) and the trainer's defaults
    the run read. `sampled` False (a train run's): a searched parameter not given trained
    at its default, which is logged too."""
    from hpsearch.tracking.mlflow_logger import trial_params

    hp = cfg.resolve_params(params)
    trained, evaluated = cfg.trial_sizes(hp)  # px
    derived_names = ("arch", "image_size")  # logged below with their resolved values
    # The trainer's defaults, but not a searched parameter this trial did not sample
    # (its `when` did not hold: focal_gamma under loss ce), nor one its choices leave
    # unread (label_smoothing under loss ce): it took no part, and a default logged
    # under its name mixed in with sampled values in the UI's plots.
    unused = unused_hyperparams(hp)
    fixed = {
        k: v
        for k, v in hp.model_dump().items()
        if k not in params
        and k not in derived_names
        and (k not in cfg.search_space or not sampled)
        and k not in unused
        and v is not None
    }
    # Not the effective lr and batch size: the trainer's, logged at the run's end
    # (`effective_params`); a train split smaller than the batch trains on the split.
    # A train run's given value its choices leave unread (`--params` focal_gamma under loss
    # ce, warned of as not read) is not logged either, as a trial's is never drawn.
    given = {k: v for k, v in params.items() if sampled or k not in unused}
    return trial_params(
        given,
        dataset=cfg.dataset.name,
        arch=hp.arch,
        image_size=trained,
        # how its val_acc and test_acc were taken (trainer.eval_*)
        extra={**fixed, "eval_image_size": evaluated, "eval_flip": cfg.trainer.eval_flip},
    )


def trial_tags(trial: optuna.Trial, root: int, uid: str | None = None) -> dict[str, str] | None:
    """A trial run's own tags: the first try of a retried trial (`hpsearch.root_trial`),
    `hpsearch.enqueued` (the names given) for a trial whose params were queued
    (`enqueue_trials`, Optuna's `enqueue_trial`) rather than all drawn, and its study's
    uid (`hpsearch.study_uid`: a run kept offline is made under that study's run)."""
    from hpsearch.tracking.mlflow_logger import STUDY_UID_TAG

    tags: dict[str, str] = {STUDY_UID_TAG: uid} if uid else {}
    if root != trial.number:
        tags["hpsearch.root_trial"] = str(root)
    frozen = getattr(trial, "_cached_frozen_trial", None)  # Optuna's view as the trial began
    fixed = frozen.system_attrs.get("fixed_params") if frozen is not None else None
    if isinstance(fixed, dict) and fixed:
        tags["hpsearch.enqueued"] = ",".join(sorted(fixed))
    return tags or None


# Seconds the launcher's supervising loop waits for one dead trial's MLflow calls. A server
# that answers /health but hangs on its API holds each call for up to 30 s x 3 tries.
DEAD_RUN_WAIT_S = 20.0


def _bounded(fn: Callable[[threading.Event], Any], timeout_s: float, what: str) -> Any:
    """`fn(abandoned)` on a daemon thread, waited for at most `timeout_s`. Raises
    TrackingError when it did not finish (then `abandoned` is set: `fn` makes nothing more
    it cannot hand back), so that the caller stops calling that server for now."""
    box: list[Any] = []
    abandoned = threading.Event()
    thread = threading.Thread(target=lambda: box.append(fn(abandoned)), daemon=True, name=what)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        abandoned.set()
        raise TrackingError(f"{what}: the MLflow server did not answer within {timeout_s:.0f} s")
    return box[0] if box else None


def record_dead_trial_run_within(
    cfg: StudyConfig, uri: str | None, trial: FrozenTrial, reason: str,
    timeout_s: float = DEAD_RUN_WAIT_S, *, interrupted: bool = False, uid: str | None = None,
) -> str | None:  # fmt: skip
    """`record_dead_trial_run`, given up after `timeout_s` (the launcher's loop waits on
    it) with TrackingError; an abandoned call makes no run, which could no longer be linked
    to the trial."""
    if not uri or trial.user_attrs.get(ATTR_RUN_ID):
        return None
    return _bounded(
        lambda abandoned: record_dead_trial_run(
            cfg, uri, trial, reason, abandoned, interrupted, uid
        ),
        timeout_s,
        f"trial {trial.number}: recording its MLflow run",
    )


def mark_run_failed_within(
    uri: str | None, trial: FrozenTrial, reason: str, timeout_s: float = DEAD_RUN_WAIT_S,
    *, interrupted: bool = False,
) -> None:  # fmt: skip
    """`mark_run_failed`, given up after `timeout_s` with TrackingError (the run stays
    RUNNING; the launcher's end-of-study sweep ends dangling runs)."""
    if not uri or not trial.user_attrs.get(ATTR_RUN_ID):
        return
    _bounded(
        lambda _: mark_run_failed(uri, trial, reason, interrupted),
        timeout_s,
        f"trial {trial.number}: ending its MLflow run",
    )


def record_dead_trial_run(
    cfg: StudyConfig,
    uri: str | None,
    trial: FrozenTrial,
    reason: str,
    abandoned: threading.Event | None = None,
    interrupted: bool = False,
    uid: str | None = None,
) -> str | None:
    """The MLflow run of a trial whose worker died before it linked the run (Optuna's
    `mlflow_run_id`), ended FAILED (KILLED when stopped: `dead_outcome`); the caller links
    it. The run the worker made is found by the trial's `mlflow_run_key` when it got that
    far; else one is made now from what Optuna holds: params, worker, host, start time and
    reported values (a worker's first trial trains while its MLflow session is set up:
    worker._LateRun).
    None when the trial had a linked run, or without MLflow."""
    if not uri or trial.user_attrs.get(ATTR_RUN_ID):
        return None
    from hpsearch.tracking.mlflow_logger import (
        STUDY_UID_TAG,
        TrialTracker,
        claim_run_by_key,
        ensure_experiment,
        find_study_runs,
        trial_params,
    )
    from hpsearch.tracking.server import health_ok

    # On the launcher's supervising loop: a server that does not answer would hold each
    # call for up to 90 s (three tries), and the dead workers' trials wait on it.
    if not health_ok(uri, any_status=True):
        logger.warning("trial %s: no MLflow run recorded: the server does not answer", trial.number)
        return None
    outcome = dead_outcome(reason, interrupted)
    try:
        client = _client(uri)
        experiment_id = ensure_experiment(client, cfg.name)
        key = trial.user_attrs.get(ATTR_RUN_KEY)
        made = claim_run_by_key(client, experiment_id, str(key), trial.number) if key else None
        if made is not None:  # died after making its run, before linking it
            _end_run(client, made, outcome, reason)
            return made
        runs = find_study_runs(client, experiment_id, uid)  # `uid`: its study's (study_uid)
        if not runs or (abandoned is not None and abandoned.is_set()):
            return None  # no study run; or the caller went on: a run made now stays unlinked
        started = trial.datetime_start
        host = trial.user_attrs.get(ATTR_HOST)
        tracker = TrialTracker(
            client,
            experiment_id,
            runs[0],
            trial_number=trial.number,
            study_name=cfg.name,
            params=trial_params(trial.params),
            worker=str(trial.user_attrs.get(ATTR_WORKER, "")),
            host=str(host) if host else None,
            start_time_ms=int(started.timestamp() * 1000) if started is not None else None,
            run_key=str(key) if key else None,
            start_timeout_s=5.0,  # on the launcher's supervising loop
            tags={STUDY_UID_TAG: uid} if uid else None,
        )
        if not tracker.enabled:
            return None
        try:
            for step, value in sorted(trial.intermediate_values.items()):
                tracker.log_epoch(step, {cfg.reported_metric: value})  # what was reported
        finally:
            tracker.finish(outcome, None, {}, [], None, reason=reason, timeout_s=10.0)
        return tracker.run_id
    except Exception as exc:  # best effort: the Optuna state is what counts
        logger.warning(
            "could not record the MLflow run of trial %s: %s", trial.number, scrub(str(exc))
        )
        return None


def mark_run_failed(
    uri: str | None, trial: FrozenTrial, reason: str, interrupted: bool = False
) -> None:
    """The MLflow run of a trial whose worker died (FAILED) or was stopped (KILLED)."""
    run_id = trial.user_attrs.get(ATTR_RUN_ID)
    if not uri or not run_id:
        return
    try:
        _end_run(_client(uri), str(run_id), dead_outcome(reason, interrupted), reason)
    except Exception as exc:  # best effort: the Optuna state is what counts
        logger.warning("could not mark MLflow run %s: %s", run_id, scrub(str(exc)))


def _load_checkpoint(path: Path) -> Any:
    """A resume checkpoint: the trainer's torch file, or a JSON one of a stand-in trainer.
    Raises what the load raises."""
    with open(path, "rb") as fh:
        is_json = fh.read(1) == b"{"
    if is_json:
        return json.loads(path.read_bytes())
    import torch

    # mmap: the weights and optimizer state are not read into memory
    return torch.load(path, map_location="cpu", weights_only=False, mmap=True)


def saved_epoch(path: Path) -> int | None:
    """The last epoch a resume checkpoint holds; None when there is no readable file."""
    try:
        return int(_load_checkpoint(path)["epoch"])
    except Exception:  # missing, damaged, or not a checkpoint: the other one is used
        return None


def saved_history(path: Path) -> list[tuple[int, dict[str, float]]] | None:
    """The epochs a resume checkpoint holds, (epoch, EPOCH_FIELDS' values) each; None when
    there is no readable file, or it holds no history (a custom trainer's)."""
    try:
        history = _load_checkpoint(path).get("history")
        if not isinstance(history, list):
            return None
        return [
            (int(r["epoch"]), {k: float(r[k]) for k in EPOCH_FIELDS if r.get(k) is not None})
            for r in history
        ]
    except Exception:  # missing, damaged, or another shape: the failed try's run is used
        return None


def _loadable(path: Path) -> bool:
    """Whether a checkpoint loads at all, with an epoch or not: a custom trainer's file may
    hold none."""
    try:
        _load_checkpoint(path)
        return True
    except Exception:
        return False


def link_late_run(storage: BaseStorage, create: Mapping[str, Any], run_id: str) -> bool:
    """Link the run made for a trial that ended while MLflow was down (a kept record's
    create, `replay_spool`): a study attribute (`LATE_RUN_ATTR`), as Optuna takes none on a
    finished trial, written only where the study of that name in this storage has that
    trial with the record's run key (another storage's study of the same name has none).
    Whether it was written. Raises what the storage raises."""
    key, number = create.get("run_key"), int(create["trial_number"])
    try:
        study_id = storage.get_study_id_from_name(str(create["experiment"]))
        trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, number)
    except KeyError:  # no such study or trial here
        return False
    if not key or storage.get_trial(trial_id).user_attrs.get(ATTR_RUN_KEY) != key:
        return False
    storage.set_study_user_attr(study_id, LATE_RUN_ATTR.format(number=number), run_id)
    return True


def end_dangling_runs(
    client: Any, experiment_id: str, study: optuna.Study, metric: str | None = None
) -> list[str]:
    """End the trial runs still RUNNING in MLflow whose trials are finished in Optuna and
    whose workers, of this host and gone, can no longer end them: a worker killed
    while its told trial's run waited to be ended, or a trial failed by the orphan or stale
    check, which end no run. Status from the trial's outcome, as its worker would have set
    it. A run is the trial's by its link (`mlflow_run_id`), else by its key tag (the
    trial's `mlflow_run_key`): a create that landed as its worker gave up waiting for it,
    or exited, was never linked. A trial that trained to its end lacks the plots its
    worker sends with the end: its run is tagged incomplete, and given the summary metrics
    its trial's record holds, its best epoch by `metric` (the study's `reported_metric`;
    None: told by the study's metric names). One search in the study's experiment; the
    runs ended. Best effort."""
    from hpsearch.tracking.mlflow_logger import INCOMPLETE_TAG, ROLE_TAG, RUN_KEY_TAG

    try:
        running = client.search_runs(
            [experiment_id],
            filter_string=f"tags.`{ROLE_TAG}` = 'trial' and attributes.status = 'RUNNING'",
            max_results=1000,
        )
        if not running:
            return []
        owners: dict[str, FrozenTrial] = {}
        keys: dict[str, FrozenTrial] = {}
        for trial in study.get_trials(deepcopy=False):  # in number order: a retry inherits
            if trial.user_attrs.get(ATTR_RUN_ID):  # the failed try's run id (and key) until
                owners.setdefault(str(trial.user_attrs[ATTR_RUN_ID]), trial)  # it sets its own
            if trial.user_attrs.get(ATTR_RUN_KEY):
                keys.setdefault(str(trial.user_attrs[ATTR_RUN_KEY]), trial)
    except Exception as exc:  # best effort: the Optuna state is what counts
        logger.warning("could not end the runs of gone workers: %s", scrub(str(exc)))
        return []
    ended = []
    if metric is None:
        metric = reported_metric_of(study.metric_names)
    for run in running:
        t = owners.get(run.info.run_id) or keys.get(run.data.tags.get(RUN_KEY_TAG) or "")
        if t is None or not t.state.is_finished() or worker_alive(t.user_attrs) is not False:
            continue  # its worker may still end it (or another host's)
        outcome = dangling_outcome(t)
        reason = str(t.user_attrs.get(ATTR_MESSAGE) or "its worker was gone")
        try:
            _upload_told_best(client, run.info.run_id, t)
        except Exception as exc:  # the run is still ended
            logger.warning("could not upload trial %s's best model: %s", t.number, scrub(str(exc)))
        try:  # ... and its summary metrics, which Optuna holds (not to hold up its end)
            _log_told_summary(client, run, t, metric)
        except Exception as exc:
            logger.warning("could not log trial %s's summary: %s", t.number, scrub(str(exc)))
        try:
            if outcome in TRAINED_TO_END:  # its worker died before sending its plots
                client.set_tag(run.info.run_id, INCOMPLETE_TAG, "true")
            _end_run(client, run.info.run_id, outcome, reason)
            ended.append(run.info.run_id)
        except Exception as exc:  # the others are still ended
            logger.warning("could not end MLflow run %s: %s", run.info.run_id, scrub(str(exc)))
    return ended


def _log_told_summary(client: Any, run: Any, trial: FrozenTrial, metric: str) -> None:
    """A trial run's summary metrics from its trial's record (`summary_from_history`), those
    it lacks, at its last epoch's step as a worker logs them; and the effective lr and
    batch size its tell recorded, which its worker logs at the run's end."""
    from hpsearch.tracking.mlflow_logger import param_value
    from mlflow.entities import Metric, Param

    params = [
        Param(k, param_value(trial.user_attrs[k]))
        for k in ("effective_lr", "effective_batch_size")  # as `effective_params` wrote them
        if k in trial.user_attrs and k not in run.data.params
    ]
    if params:
        client.log_batch(run.info.run_id, params=params)
    history = trial.user_attrs.get(ATTR_HISTORY)
    if not isinstance(history, list):
        return
    epochs = [e for e in history if isinstance(e, dict)]
    summary = summary_from_history(epochs, metric, trial.user_attrs.get(ATTR_TEST_ACC))
    summary = {k: v for k, v in summary.items() if k not in run.data.metrics}
    if not summary:
        return
    steps = [e["epoch"] for e in epochs if isinstance(e.get("epoch"), int)]
    now_ms = int(time.time() * 1000)
    entities = [Metric(k, float(v), now_ms, max(steps, default=0)) for k, v in summary.items()]
    client.log_batch(run.info.run_id, metrics=entities)


def _upload_told_best(client: Any, run_id: str, trial: FrozenTrial) -> None:
    """The best model a trial was told with (its `checkpoint_uri` names this run), when its
    worker died before the upload: from this host's file, else the run is tagged
    incomplete (readers of `checkpoint_uri` would find nothing)."""
    from hpsearch.tracking.mlflow_logger import INCOMPLETE_TAG

    if trial.user_attrs.get("checkpoint_uri") != f"runs:/{run_id}/{CHECKPOINT_ARTIFACT}/best.pt":
        return
    if any(a.path.endswith("best.pt") for a in client.list_artifacts(run_id, CHECKPOINT_ARTIFACT)):
        return
    local = Path(str(trial.user_attrs.get(ATTR_BEST_MODEL) or ""))
    if not local.is_file():
        client.set_tag(run_id, INCOMPLETE_TAG, "true")
        return
    with tempfile.TemporaryDirectory(prefix="hpsearch-best-") as tmp:
        snap = Path(tmp) / "best.pt"
        shutil.copyfile(local, snap)
        client.log_artifact(run_id, str(snap), CHECKPOINT_ARTIFACT)


def dangling_outcome(trial: FrozenTrial) -> str:
    """The outcome a gone worker's finished trial ends its run with: its own where that
    agrees with the trial's state (a worker may write it and die before the tell, and the
    stale check then fails the trial), else by the state."""
    from hpsearch.tracking.mlflow_logger import terminal_status

    outcome = str(trial.user_attrs.get(ATTR_OUTCOME) or "")
    by_state = {"COMPLETE": "completed", "PRUNED": "pruned"}.get(trial.state.name, "failed")
    try:
        status = terminal_status(outcome)
    except ValueError:  # no outcome of hpsearch's (a check failed it)
        return by_state
    if trial.state == TrialState.FAIL and status != "FAILED" and outcome != "interrupted":
        return "failed"
    return outcome


def _end_run(client: Any, run_id: str, outcome: str, reason: str) -> None:
    """End a run its worker left RUNNING, with the outcome's status and tags."""
    from hpsearch.tracking.mlflow_logger import terminal_status, terminal_tags

    run = client.get_run(run_id)
    if run.info.status != "RUNNING":
        return
    for k, v in terminal_tags(outcome, None, reason).items():
        client.set_tag(run_id, k, v)
    client.set_terminated(run_id, status=terminal_status(outcome))


def finalize_study(
    cfg: StudyConfig,
    spec: StorageSpec,
    uri: str,
    study: optuna.Study,
    workdir: Path,
) -> list[str]:
    """Study-level artifacts on the parent run: plots, a trials CSV, the best model in ONNX
    (the one its worker exported, else exported here). Returns what was logged; problems
    are warned about, never raised."""
    from hpsearch.tracking import artifacts as art
    from hpsearch.tracking.mlflow_logger import ensure_experiment, find_study_runs

    logged: list[str] = []
    try:
        client = _client(uri)
        runs = find_study_runs(client, ensure_experiment(client, cfg.name), study_uid(study))
        out = Path(tempfile.mkdtemp(prefix="hpsearch-study-"))
    except Exception as exc:  # best effort at the end of a launch
        logger.warning("study artifacts failed: %s", scrub(str(exc)))
        return logged
    if not runs:
        _rmtree(out)
        return logged
    parent = runs[0]

    def trials() -> None:
        art.trials_csv(study, out / "trials.csv")
        client.log_artifact(parent, str(out / "trials.csv"))
        logged.append("trials.csv")

    def plots() -> None:
        folder = out / "plots"
        art.study_plots(study, folder)
        if folder.exists() and any(folder.iterdir()):
            client.log_artifacts(parent, str(folder), "plots")
            logged.append("plots")

    def onnx() -> None:
        found = _best_trial_onnx(client, study, out)
        found = found or _export_best_onnx(cfg, study, out, client)
        if found is not None:
            path, number = found
            client.log_artifact(parent, str(path), "model")
            client.set_tag(parent, "hpsearch.best_trial", str(number))
            logged.append(ONNX_ARTIFACT)

    steps: list[tuple[str, Callable[[], None]]] = [("trials CSV", trials), ("plots", plots)]
    if cfg.tracking.onnx and not cfg.objective.multi:
        steps.append(("best model ONNX", onnx))
    try:
        for what, step in steps:
            # Each on its own: a failed upload, a plot file that cannot be written or a
            # storage error costs that artifact only.
            try:
                step()
            except Exception as exc:  # best effort at the end of a launch
                logger.warning("study artifacts: %s failed: %s", what, scrub(str(exc)))
    finally:
        _rmtree(out)
    return logged


def export_model_onnx(cfg: StudyConfig, params: Mapping[str, Any], weights: Path,
                      out: Path, size: int | None = None) -> Path:  # fmt: skip
    """A trained model's weights file (`best_model`) as verified ONNX at `out`, taking
    `size` px images (default: the size `cfg` evaluates the trial at)."""
    import torch
    from hpsearch.tracking.onnx_export import export_onnx
    from hpsearch.trainer import load_trained_model

    model = load_trained_model(cfg, dict(params), weights, device="cpu")
    if size is None:
        size = cfg.trial_sizes(cfg.resolve_params(dict(params)))[1]  # its accuracy's size
    return Path(
        export_onnx(model, torch.randn(2, 3, size, size), out, metadata=onnx_metadata(model, size))
    )


def onnx_metadata(model: Any, size: int) -> dict[str, str]:
    """What a model's ONNX file says of itself (QA: nothing, so its logits could be named
    only through `load_best_model`): its outputs' class names and its input, as
    `EvalTransform` makes it. JSON or plain text values, as ONNX's metadata_props hold."""
    from hpsearch.trainer.augment import MEAN, STD

    stored = getattr(getattr(model, "transform", None), "stored_px", size)
    return {
        "hpsearch.class_names": json.dumps(list(getattr(model, "class_names", []))),
        "hpsearch.input": (
            f"float32 NCHW RGB, {size} x {size} px: the shorter side resized to {stored} px, "
            f"a center square crop, resized to {size} px, scaled to 0..1, then (x - mean) / std"
        ),
        "hpsearch.mean": json.dumps(list(MEAN)),
        "hpsearch.std": json.dumps(list(STD)),
    }


def _run_eval_size(client: Any, run_id: str) -> int | None:
    """The px a trial's run says its accuracies were taken at (`eval_image_size`), which an
    earlier launch's trainer.eval_scale or dataset.image_size may have made other than
    today's config gives; None when the run does not say."""
    try:
        return int(client.get_run(run_id).data.params["eval_image_size"])
    except Exception as exc:  # MlflowException, HTTPError, KeyError (an older run), ValueError
        logger.info("no eval_image_size on run %s: %s", run_id, scrub(str(exc)))
        return None


def may_still_export(attrs: Mapping[str, Any], host: str, alive: Callable[[int], bool]) -> bool:
    """Whether the worker that told a trial (its user attributes) may still log the trial's
    ONNX, which it does as it stops: only a trial with a best-model checkpoint
    (`checkpoint_uri`; none with `tracking.keep_top_k: 0`) has a model held; a worker of
    this `host` only while its process is `alive`; another host's may, for all this machine
    can tell (the wait's time limit bounds it)."""
    if not attrs.get("checkpoint_uri"):
        return False
    if attrs.get(ATTR_HOST) != host:
        return True
    pid = attrs.get(ATTR_PID)
    return isinstance(pid, int) and alive(pid)


def _best_trial_onnx(
    client: Any,
    study: optuna.Study,
    out: Path,
    wait_s: float = 60.0,
    may_export: Callable[[FrozenTrial], bool] | None = None,
) -> tuple[Path, int] | None:
    """The ONNX file a worker logged on the run of a trial at the study's best value (the
    storage's best trial first; a tie may have been exported by either worker), downloaded
    into `out`, and that trial's number; None when none has one. A worker exports its held
    study best as it stops (`TrackingSession.hold_for_onnx`), after that trial's run ended:
    it is waited for, up to `wait_s`, while `may_export(trial)` (`may_still_export`) for
    one of them. An error looking at a run is warned about, and that run looked at again
    while the wait lasts."""
    if may_export is None:
        here = socket.gethostname()

        def may_export(t: FrozenTrial) -> bool:
            return may_still_export(t.user_attrs, here, pid_alive)

    try:
        complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    except Exception as exc:  # the storage failing
        logger.warning("no best trial to take the ONNX of: %s", scrub(str(exc)))
        return None
    best = best_of(complete, study.direction)
    if best is None:
        logger.warning("no best trial to take the ONNX of: no trial completed")
        return None
    # Tied trials in number order: the first with an export, as `hpsearch best` ranks them.
    tied = [t for t in complete if t.value == best.value and t.user_attrs.get(ATTR_RUN_ID)]
    tied.sort(key=lambda t: t.number)
    deadline = time.monotonic() + wait_s
    folder = ONNX_ARTIFACT.split("/")[0]
    while tied:
        waiting = any(may_export(t) for t in tied)  # before the look: see its export
        for t in tied:
            run_id = str(t.user_attrs[ATTR_RUN_ID])
            try:
                if ONNX_ARTIFACT in {a.path for a in client.list_artifacts(run_id, folder)}:
                    path = client.download_artifacts(run_id, ONNX_ARTIFACT, str(out))
                    return Path(path), t.number
            except Exception as exc:  # MlflowException, requests' HTTPError (an OSError), ...
                logger.warning("could not look for trial %s's ONNX in run %s: %s",
                               t.number, run_id, scrub(str(exc)))  # fmt: skip
        if not waiting or time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    return None


def _export_best_onnx(
    cfg: StudyConfig, study: optuna.Study, out: Path, client: Any
) -> tuple[Path, int] | None:
    """The best trial's model in ONNX, exported here, and the trial's number: from its
    best-model file in the work folder when it ran on this machine, else from the top-k
    checkpoint its MLflow run holds (none with `tracking.keep_top_k: 0`). For a worker that
    died before it could export its own."""
    best = best_of(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)), study.direction)
    if best is None:
        return None
    path = best.user_attrs.get(ATTR_BEST_MODEL)
    here = best.user_attrs.get(ATTR_HOST) in (None, socket.gethostname())
    weights = Path(str(path)) if path and here else None
    run_id = best.user_attrs.get(ATTR_RUN_ID)
    if (weights is None or not weights.exists()) and run_id:
        try:
            artifact = f"{CHECKPOINT_ARTIFACT}/best.pt"
            weights = Path(client.download_artifacts(str(run_id), artifact, str(out)))
        except Exception as exc:  # MlflowException, or HTTPError: no such artifact
            logger.info(
                "no checkpoint of trial %s in run %s: %s", best.number, run_id, scrub(str(exc))
            )
            return None
    if weights is None or not weights.exists():
        return None
    size = _run_eval_size(client, str(run_id)) if run_id else None
    onnx = export_model_onnx(cfg, best.params, weights, out / "best_model.onnx", size)
    return onnx, best.number


def download_best_model(
    trial: FrozenTrial, tracking_uri: str | None, workdir: Path, dest: Path
) -> Path:
    """The best-model checkpoint of a trial from its MLflow run: downloaded into `dest` (a
    folder of the caller's), or, with no tracking URI given, read from the work folder's
    own MLflow store, whose artifacts are files under `<workdir>/mlflow/artifacts/`."""
    from hpsearch.tracking.server import resolve_tracking_uri, store_paths

    uri = resolve_tracking_uri(tracking_uri)
    run_id = str(trial.user_attrs.get(ATTR_RUN_ID) or "")
    if not trial.user_attrs.get("checkpoint_uri"):
        # Not uploaded (outside the top k at its tell, or tracking.keep_top_k: 0), and its
        # file is gone (outside the top k since) or on another host.
        raise HpsearchError(
            f"trial {trial.number}: no model of it was kept: its file is not on this machine "
            "(kept for the top tracking.keep_top_k trials, on the host that ran it) and "
            "none was logged to MLflow"
        )
    if not run_id.isalnum():  # the link is written before the upload: not seen, but named
        raise HpsearchError(f"trial {trial.number}: its model's MLflow run is not linked")
    if not uri:
        _, artifacts, _ = store_paths(workdir)
        stored = sorted(artifacts.glob(f"*/{run_id}/artifacts/{CHECKPOINT_ARTIFACT}/best.pt"))
        if stored:
            return stored[0]
        if list(artifacts.glob(f"*/{run_id}")):  # the run is there, its file is not
            raise HpsearchError(
                f"trial {trial.number}: MLflow run {run_id} in the store of {workdir} has no "
                f"{CHECKPOINT_ARTIFACT}/best.pt any more (deleted from its artifacts?)"
            )
        where = "holds no MLflow store" if not artifacts.is_dir() else "has no run of it"
        raise HpsearchError(
            f"trial {trial.number}: its model is in MLflow run {run_id}, not on this machine, "
            f"and no tracking URI was given (tracking_uri=, MLFLOW_TRACKING_URI); the work "
            f"folder {workdir} {where} (workdir= names the one the study ran in)"
        )
    try:
        with _http_policy():
            local = _client(uri).download_artifacts(
                run_id, f"{CHECKPOINT_ARTIFACT}/best.pt", str(dest)
            )
    except Exception as exc:  # MlflowException, or an HTTP error: no run, no such artifact
        shown = redact_uri(uri)  # a password in the URI is never printed
        # No cause attached: MLflow's own error, printed in a traceback, holds the URI.
        raise TrackingError(
            f"trial {trial.number}: cannot download its checkpoint from {shown}: "
            f"{type(exc).__name__}: {scrub(str(exc).replace(uri, shown))}"
        ) from None
    return Path(local)


@contextlib.contextmanager
def _http_policy() -> Iterator[None]:
    """hpsearch's short MLflow HTTP retries and timeouts (`_client` sets them for good, in
    hpsearch's own processes) for a reader's call only: the caller's notebook keeps its own."""
    from hpsearch.tracking.mlflow_logger import HTTP_POLICY

    saved = {key: os.environ.get(key) for key in HTTP_POLICY}
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _rmtree(path: Path) -> None:
    with _owner_fds_lock:
        fd = _owner_fds.pop(path, None)
    if fd is not None:  # a snapshot folder of this process's: its lock goes first (an open
        os.close(fd)  # file deleted on NFS would stay as .nfsXXXX, and the folder with it)
    shutil.rmtree(path, ignore_errors=True)
