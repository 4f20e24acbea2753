"""A trial's MLflow run (hpsearch.runs.TrialRun) around its tell: the best-model snapshot
taken for the top-k upload, and what becomes of it when the trial fails instead. Real
PostgreSQL, a real MLflow server."""

from __future__ import annotations

import math
import uuid
from pathlib import Path
from typing import Any

import hpsearch as hps
import optuna
import pytest
from hpsearch.runs import SNAPSHOT_PREFIX, TrackingSession, TrialRun
from hpsearch.storage import normalize_url, resolve_storage
from hpsearch.study import suggest
from hpsearch.tracking.server import LocalServer
from hpsearch.trainer import TrialResult
from mlflow.tracking import MlflowClient

pytestmark = pytest.mark.slow


def _result(value: float, best: Path) -> TrialResult:
    return TrialResult(
        history=[], best_val_acc=value, best_val_loss=1.0, final_val_acc=value, test_acc=None,
        stop_reason="finished", epochs_run=2, pruned_at_epoch=None, checkpoint_path=None,
        best_model_path=best, effective_lr=0.1, effective_batch_size=32, micro_batch_size=32,
        train_seconds=1.0, setup_seconds=0.1, confusion=None, message="", num_classes=0,
        class_names=[],
    )  # fmt: skip


def test_a_failed_trial_keeps_no_snapshot_and_claims_no_checkpoint(
    pg_url: str, tmp_path: Path, mlflow_server: LocalServer
) -> None:
    """A trial whose value is not finite is failed by its worker (worker._tell): it gets no
    checkpoint_uri, and no snapshot is taken. One whose tell fails after its snapshot was
    taken (finish_failed) gets its snapshot deleted, and nothing uploaded."""
    cfg = hps.load_config("tiny", [f"name=runs-{uuid.uuid4().hex[:8]}"])
    session = TrackingSession(cfg, resolve_storage(pg_url, tmp_path), mlflow_server.url, "w0")
    study = optuna.create_study(storage=normalize_url(pg_url), study_name=cfg.name,
                                direction="maximize")  # fmt: skip
    folder = tmp_path / "checkpoints" / cfg.name

    def started() -> tuple[TrialRun, Path]:
        trial = study.ask()
        params = suggest(trial, cfg)
        ckpt = folder / f"trial-{trial.number:05d}.pt"
        best = ckpt.with_name(f"{ckpt.stem}.best.pt")
        best.parent.mkdir(parents=True, exist_ok=True)
        best.write_bytes(b"weights")
        run = session.start_trial(trial, params, trial.number, ckpt)
        assert run is not None and run.run_id
        return run, best

    def snapshots() -> list[Path]:
        return sorted(folder.glob(f"{SNAPSHOT_PREFIX}*"))

    nan_run, best = started()
    assert nan_run.checkpoint_uri(_result(math.nan, best)) is None
    assert snapshots() == []
    # Its result's effective lr and batch size are logged (review: none on a failed run).
    nan_run.finish_failed("error", "objective [nan] is not finite", None, _result(math.nan, best))

    run, best = started()
    uri = run.checkpoint_uri(_result(0.8, best))
    assert uri == f"runs:/{run.run_id}/checkpoint/best.pt"
    assert len(snapshots()) == 1
    run.finish_failed("error", "the tell failed", None)
    assert snapshots() == []
    session.close()
    client = MlflowClient(tracking_uri=mlflow_server.url)
    for r in (nan_run, run):
        assert client.list_artifacts(r.run_id, "checkpoint") == []
        assert client.get_run(r.run_id).info.status == "FAILED"
    logged = client.get_run(nan_run.run_id).data.params
    assert (logged["effective_lr"], logged["effective_batch_size"]) == ("0.1", "32")


def test_a_worker_told_to_stop_waits_no_longer_for_the_study_run(
    pg_url: str, tmp_path: Path, mlflow_server: LocalServer
) -> None:
    """A launcher killed before it opened the study run: its workers, told to stop, waited
    out the whole wait (240 s) before their finished trials were told."""
    import threading
    import time

    cfg = hps.load_config("tiny", [f"name=await-{uuid.uuid4().hex[:8]}"])
    stop = threading.Event()
    t0 = time.monotonic()
    session = TrackingSession(cfg, resolve_storage(pg_url, tmp_path), mlflow_server.url, "w0",
                              await_study_run_s=120, background=True, stop=stop)  # fmt: skip
    time.sleep(1.0)
    assert not session.ready()  # waiting for the launcher's study run
    stop.set()
    session.wait_ready()
    assert time.monotonic() - t0 < 30 and session.parent_run_id  # opened its own
    session.close()


def test_a_run_whose_artifacts_cannot_be_staged_still_ends(
    pg_url: str, tmp_path: Path, mlflow_server: LocalServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full /tmp (the artifacts' staging folder) skipped the run's end: it stayed
    RUNNING in MLflow for good."""
    import tempfile

    cfg = hps.load_config("tiny", [f"name=runs-{uuid.uuid4().hex[:8]}"])
    session = TrackingSession(cfg, resolve_storage(pg_url, tmp_path), mlflow_server.url, "w0")
    study = optuna.create_study(storage=normalize_url(pg_url), study_name=cfg.name,
                                direction="maximize")  # fmt: skip
    trial = study.ask()
    params = suggest(trial, cfg)
    ckpt = tmp_path / "checkpoints" / f"trial-{trial.number:05d}.pt"
    run = session.start_trial(trial, params, trial.number, ckpt)
    assert run is not None

    def full(*args: object, **kwargs: object) -> str:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tempfile, "mkdtemp", full)
    run._finish(_result(0.8, tmp_path / "none.pt"), "completed", {"best_val_acc": 0.8}, None, None)
    session.close()
    done = MlflowClient(tracking_uri=mlflow_server.url).get_run(run.run_id)
    assert done.info.status == "FINISHED" and done.data.metrics["best_val_acc"] == 0.8


def test_runs_left_running_by_gone_workers_are_ended_at_the_launchs_end(
    pg_url: str, tmp_path: Path, mlflow_server: LocalServer
) -> None:
    """A worker killed while its told trial's run waited to be ended, or a trial failed by
    the orphan or stale check (which end no run), left its run RUNNING for good."""
    import os
    import socket
    import subprocess
    import sys

    from hpsearch.runs import end_dangling_runs
    from hpsearch.tracking.mlflow_logger import INCOMPLETE_TAG, ROLE_TAG, RUN_KEY_TAG
    from optuna.trial import TrialState

    cfg = hps.load_config("tiny", [f"name=runs-{uuid.uuid4().hex[:8]}"])
    session = TrackingSession(cfg, resolve_storage(pg_url, tmp_path), mlflow_server.url, "w0")
    session.wait_ready()
    study = optuna.create_study(storage=normalize_url(pg_url), study_name=cfg.name,
                                direction="maximize")  # fmt: skip
    client = MlflowClient(tracking_uri=mlflow_server.url)
    experiment = client.get_experiment_by_name(cfg.name)
    assert experiment is not None
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    runs = {}
    for name, pid, state, outcome in (
        ("told", gone.pid, TrialState.COMPLETE, "completed"),
        ("stale", gone.pid, TrialState.FAIL, None),  # the stale check sets no outcome
        ("live", os.getpid(), TrialState.COMPLETE, "completed"),  # its worker may end it
        # Its worker wrote the outcome and died before the tell; the stale check failed it.
        ("died_telling", gone.pid, TrialState.FAIL, "completed"),
    ):
        trial = study.ask()
        run = client.create_run(experiment.experiment_id, tags={ROLE_TAG: "trial"})
        attrs = {"mlflow_run_id": run.info.run_id, "host": socket.gethostname(), "pid": pid}
        if name == "told":  # its epochs and test accuracy, as its worker told them
            attrs |= {"test_acc": 0.25, "effective_lr": 0.05, "effective_batch_size": 32,
                      "history": [
                {"epoch": 1, "val_acc": 0.3, "val_loss": 3.0, "epoch_seconds": 2.0},
                {"epoch": 2, "val_acc": 0.3, "val_loss": 2.5, "epoch_seconds": 2.5}]}  # fmt: skip
        if name == "died_telling":  # a --train-fn's history of its own: still ended (review)
            attrs |= {"history": [{"epoch": None, "val_acc": "x"}, 7]}
        for key, value in {**attrs, **({"outcome": outcome} if outcome else {})}.items():
            trial.set_user_attr(key, value)
        study.tell(trial, 0.5 if state == TrialState.COMPLETE else None, state=state)
        runs[name] = run.info.run_id
    # Told with a best model in MLflow, and killed before its upload: from this host's
    # file, or (the file gone too) the run says it is incomplete.
    best = tmp_path / "t.best.pt"
    best.write_bytes(b"weights")
    for name, local in (("told_best", best), ("told_lost", tmp_path / "gone.best.pt")):
        trial = study.ask()
        rid = client.create_run(experiment.experiment_id, tags={ROLE_TAG: "trial"}).info.run_id
        for key, value in {
            "mlflow_run_id": rid,
            "host": socket.gethostname(),
            "pid": gone.pid,
            "outcome": "completed",
            "best_model": str(local),
            "checkpoint_uri": f"runs:/{rid}/checkpoint/best.pt",
        }.items():
            trial.set_user_attr(key, value)  # fmt: skip
        study.tell(trial, 0.5)
        runs[name] = rid
    # A run start whose create landed as its worker exited (or gave up waiting for it):
    # never linked, found by its key tag.
    for name, pid in (("unlinked", gone.pid), ("unlinked_live", os.getpid())):
        trial = study.ask()
        key = uuid.uuid4().hex
        rid = client.create_run(
            experiment.experiment_id, tags={ROLE_TAG: "trial", RUN_KEY_TAG: key}
        ).info.run_id
        for k, value in {"mlflow_run_key": key, "host": socket.gethostname(), "pid": pid,
                         "outcome": "pruned"}.items():  # fmt: skip
            trial.set_user_attr(k, value)
        study.tell(trial, state=TrialState.PRUNED)
        runs[name] = rid
    retry = study.ask()  # inherits the failed try's run id until it links its own
    retry.set_user_attr("mlflow_run_id", runs["stale"])
    ended = end_dangling_runs(client, experiment.experiment_id, study)
    session.close()
    assert sorted(ended) == sorted(
        [runs[k] for k in ("told", "stale", "died_telling", "told_best", "told_lost", "unlinked")]
    )
    status = {k: client.get_run(v).info.status for k, v in runs.items()}
    assert status == {
        "told": "FINISHED", "stale": "FAILED", "live": "RUNNING", "died_telling": "FAILED",
        "told_best": "FINISHED", "told_lost": "FINISHED", "unlinked": "KILLED",
        "unlinked_live": "RUNNING",
    }  # fmt: skip
    uploaded = [a.path for a in client.list_artifacts(runs["told_best"], "checkpoint")]
    assert uploaded == ["checkpoint/best.pt"]
    # A trial that trained to its end lacks the plots its worker would have sent (QA: a
    # worker killed just after its tell; its run read FINISHED, complete); one whose best
    # model is lost too says so as well.
    incomplete = {k: client.get_run(runs[k]).data.tags.get(INCOMPLETE_TAG) for k in runs}
    lacking = ("told", "told_best", "told_lost")
    assert incomplete == {k: "true" if k in lacking else None for k in runs}
    # ... but not its summary metrics: Optuna holds them (QA: sorted by best_val_acc, the
    # study's best came last). The first best epoch, as the trainer keeps it.
    summary = client.get_run(runs["told"]).data.metrics
    assert summary == {"best_val_acc": 0.3, "best_val_loss": 3.0, "train_seconds": 4.5,
                       "test_acc": 0.25}  # fmt: skip
    # ... nor the trainer's effective lr and batch size, logged at a run's end (review)
    params = client.get_run(runs["told"]).data.params
    assert (params["effective_lr"], params["effective_batch_size"]) == ("0.05", "32")


def test_a_run_kept_offline_takes_its_best_model_to_the_run_made_later(
    pg_url: str, tmp_path: Path, mlflow_server: LocalServer
) -> None:
    """A trial that ended while MLflow was down keeps its whole run in the spool folder:
    its best model (top k) goes with it to the run made when the server answers, and no
    snapshot or kept file is left behind."""
    from hpsearch.tracking.mlflow_logger import RUN_KEY_TAG

    cfg = hps.load_config("tiny", [f"name=offline-{uuid.uuid4().hex[:8]}"])
    spool = tmp_path / "spool"
    session = TrackingSession(cfg, resolve_storage(pg_url, tmp_path), mlflow_server.url, "w0",
                              spool_dir=spool)  # fmt: skip
    study = optuna.create_study(storage=normalize_url(pg_url), study_name=cfg.name,
                                direction="maximize")  # fmt: skip
    trial = study.ask()
    folder = tmp_path / "checkpoints"
    ckpt = folder / f"trial-{trial.number:05d}.pt"
    best = ckpt.with_name(f"{ckpt.stem}.best.pt")
    folder.mkdir()
    best.write_bytes(b"weights")
    key = uuid.uuid4().hex
    run = session.start_trial(trial, suggest(trial, cfg), trial.number, ckpt, run_key=key,
                              offline=True)  # fmt: skip
    assert run is not None and run.run_id is None
    result = _result(0.8, best)
    assert run.checkpoint_uri(result) is None  # no run to name yet
    assert len(list(folder.glob(f"{SNAPSHOT_PREFIX}*"))) == 1
    study.tell(trial, 0.8)
    run.finish_result(result)
    session.close()  # the runs' ends, then the spool sent: the server answers
    client = MlflowClient(tracking_uri=mlflow_server.url)
    experiment = client.get_experiment_by_name(cfg.name)
    assert experiment is not None
    made = client.search_runs([experiment.experiment_id], f"tags.`{RUN_KEY_TAG}` = '{key}'")
    assert len(made) == 1 and made[0].info.status == "FINISHED"
    assert made[0].data.metrics["best_val_acc"] == 0.8
    assert made[0].data.metrics["best_val_loss"] == 1.0  # a val_loss study's value
    uploaded = [a.path for a in client.list_artifacts(made[0].info.run_id, "checkpoint")]
    assert uploaded == ["checkpoint/best.pt"]
    assert list(folder.glob(f"{SNAPSHOT_PREFIX}*")) == [] and best.exists()
    assert list(spool.iterdir()) == []


def test_a_study_whose_experiment_was_deleted_for_good_gets_it_back(
    pg_url: str, tmp_path: Path, mlflow_server: LocalServer
) -> None:
    """`mlflow gc` of the study's experiment mid-study: its MLflow's answer to a create,
    RESOURCE_DOES_NOT_EXIST, was taken for a proxy's page (an outage), and every later
    trial ended offline under the ids the session kept. The next trial makes the
    experiment and the study run anew."""
    import os
    import subprocess
    import sys

    from hpsearch.tracking.mlflow_logger import PARENT_TAG
    from hpsearch.tracking.server import store_paths

    cfg = hps.load_config("tiny", [f"name=gc-{uuid.uuid4().hex[:8]}"])
    session = TrackingSession(cfg, resolve_storage(pg_url, tmp_path), mlflow_server.url, "w0")
    study = optuna.create_study(storage=normalize_url(pg_url), study_name=cfg.name,
                                direction="maximize")  # fmt: skip

    def start() -> TrialRun:
        trial = study.ask()
        ckpt = tmp_path / f"trial-{trial.number:05d}.pt"
        run = session.start_trial(trial, suggest(trial, cfg), trial.number, ckpt)
        assert run is not None and run.run_id
        return run

    first = start()
    first.finish_failed("error", "not this test's", None)
    client = MlflowClient(tracking_uri=mlflow_server.url)
    old = session.experiment_id
    assert old is not None
    made_at = client.get_experiment(old).creation_time
    client.delete_experiment(old)
    db = store_paths(mlflow_server.workdir)[0]
    subprocess.run(
        [sys.executable, "-m", "mlflow", "gc", "--backend-store-uri", f"sqlite:///{db}",
         "--experiment-ids", old],
        env={**os.environ, "MLFLOW_TRACKING_URI": mlflow_server.url}, check=True,
        capture_output=True, timeout=120,
    )  # fmt: skip
    second = start()
    session.close()
    assert second.run_id is not None
    made = client.get_run(second.run_id)
    experiment = client.get_experiment_by_name(cfg.name)
    assert experiment is not None and experiment.creation_time > made_at  # SQLite reuses ids
    assert made.info.experiment_id == experiment.experiment_id
    parent = made.data.tags[PARENT_TAG]
    assert client.get_run(parent).info.experiment_id == experiment.experiment_id


def test_a_server_down_as_a_gone_experiment_is_made_anew_leaves_the_run_to_a_later_try(
    pg_url: str, tmp_path: Path, mlflow_server: LocalServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The experiment deleted for good, then the server down while it is made anew: the
    start said "refused" (no run, no later try, nothing kept) for an outage."""
    from hpsearch.errors import TrackingUnreachable
    from hpsearch.tracking import mlflow_logger

    cfg = hps.load_config("tiny", [f"name=gone-{uuid.uuid4().hex[:8]}"])
    session = TrackingSession(cfg, resolve_storage(pg_url, tmp_path), mlflow_server.url, "w0")
    study = optuna.create_study(storage=normalize_url(pg_url), study_name=cfg.name,
                                direction="maximize")  # fmt: skip
    session.experiment_id, session.parent_run_id = "987654321", "gone"  # no such experiment

    def down(*args: object) -> str:
        raise TrackingUnreachable("MLflow: cannot get or create experiment: connection refused")

    monkeypatch.setattr(mlflow_logger, "ensure_experiment", down)
    trial = study.ask()
    with pytest.raises(TrackingUnreachable, match="did not answer"):
        session.start_trial(trial, suggest(trial, cfg), trial.number, tmp_path / "t.pt")
    assert session.parent_run_id is None  # made anew by the later try
    session.close()


def test_a_runs_end_time_is_when_its_trial_ended_not_when_its_uploads_were_done(
    pg_url: str, tmp_path: Path, mlflow_server: LocalServer
) -> None:
    """The finisher holds a run's end until the next trial trains (up to 30 s), then plots
    and uploads: MLflow's Duration counted all of it (a trial of 9 s showed 16 s)."""
    import time

    cfg = hps.load_config("tiny", [f"name=runs-{uuid.uuid4().hex[:8]}"])
    session = TrackingSession(cfg, resolve_storage(pg_url, tmp_path), mlflow_server.url, "w0")
    study = optuna.create_study(storage=normalize_url(pg_url), study_name=cfg.name,
                                direction="maximize")  # fmt: skip
    held: list[Any] = []
    session.finish_later = held.append  # type: ignore[method-assign]
    ended: dict[str, int] = {}
    for kind in ("result", "failed"):
        trial = study.ask()
        run = session.start_trial(trial, suggest(trial, cfg), trial.number, tmp_path / f"{kind}.pt")
        assert run is not None
        ended[run.run_id] = int(time.time() * 1000)
        if kind == "result":
            run.finish_result(_result(0.8, tmp_path / "none.pt"))
        else:
            run.finish_failed("error", "broken", None)
    time.sleep(2.0)  # held by the finisher
    for job in held:
        job()
    session.close()
    client = MlflowClient(tracking_uri=mlflow_server.url)
    for run_id, at_ms in ended.items():
        info = client.get_run(run_id).info
        assert info.status in ("FINISHED", "FAILED") and abs(info.end_time - at_ms) < 1000


def test_a_retry_after_a_kill_charts_every_epoch_its_checkpoint_holds(
    pg_url: str, tmp_path: Path, subprocess_env: dict[str, str], mlflow_server: LocalServer
) -> None:
    """A worker killed right after epoch 1's checkpoint, that epoch's metrics still queued
    for MLflow: its run never got them, and a retry copying the failed try's run would
    chart from epoch 2. The retry's run takes the epochs before its resume from the
    checkpoint it resumed from: every metric at every epoch, once."""
    import subprocess
    import sys

    from cli_util import DUMMY
    from hpsearch.runs import EPOCH_FIELDS

    name = f"tiny-kill-{uuid.uuid4().hex[:6]}"
    env = {**subprocess_env, "HPSEARCH_DUMMY_EPOCH_S": "0.2",
           "HPSEARCH_DUMMY_DIE_ONCE_UNREPORTED": str(tmp_path / "died")}  # fmt: skip
    r = subprocess.run(
        [sys.executable, "-m", "hpsearch.cli", "launch", "--study", "tiny", "--workers", "1",
         "--trials", "1", "--storage", pg_url, "--tracking-uri", mlflow_server.url,
         "--workdir", str(tmp_path / "w"), "--train-fn", DUMMY, "--set", f"name={name}",
         "--set", "budget.max_epochs=4", "--set", "pruner.name=none",
         "--set", "pruner.options={}"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "died").exists()
    trials = hps.load_study(name, storage=pg_url).get_trials()
    [dead] = [t for t in trials if t.state == optuna.trial.TrialState.FAIL]
    [retry] = [t for t in trials if t.system_attrs.get("failed_trial") == dead.number]
    assert retry.user_attrs["resumed_from_epoch"] == 2
    client = MlflowClient(tracking_uri=mlflow_server.url)
    run_id = retry.user_attrs["mlflow_run_id"]
    for key in EPOCH_FIELDS:
        steps = [m.step for m in client.get_metric_history(run_id, key)]
        assert sorted(steps) == [1, 2, 3, 4], (key, steps)
    val = {m.step: m.value for m in client.get_metric_history(run_id, "val_acc")}
    assert val == pytest.approx(retry.intermediate_values)


def test_a_trials_run_logs_no_default_its_choices_leave_unread(
    pg_url: str, tmp_path: Path, mlflow_server: LocalServer
) -> None:
    """A ce trial of a study that does not search label_smoothing logged the trainer's 0.1
    under that name, as if it had taken part (QA); a label_smoothing one logs it."""
    cfg = hps.load_config("tiny", [f"name=unread-{uuid.uuid4().hex[:8]}",
                                   "search_space={loss: {type: categorical, "
                                   "choices: [ce, label_smoothing]}}"])  # fmt: skip
    session = TrackingSession(cfg, resolve_storage(pg_url, tmp_path), mlflow_server.url, "w0")
    study = optuna.create_study(storage=normalize_url(pg_url), study_name=cfg.name,
                                direction="maximize")  # fmt: skip
    logged = {}
    for loss in ("ce", "label_smoothing"):
        study.enqueue_trial({"loss": loss})
        trial = study.ask()
        run = session.start_trial(trial, suggest(trial, cfg), trial.number, tmp_path / "c.pt")
        assert run is not None and run.run_id
        run.finish_failed("interrupted", "test", None)
        logged[loss] = run.run_id
    session.close()
    client = MlflowClient(tracking_uri=mlflow_server.url)
    ce = client.get_run(logged["ce"]).data.params
    smoothed = client.get_run(logged["label_smoothing"]).data.params
    assert "label_smoothing" not in ce and "focal_gamma" not in ce
    assert ce["momentum"] == "0.9"  # sgd's, read
    assert smoothed["label_smoothing"] == "0.1"
    # no GPU here: the run says so rather than "all" (CUDA_VISIBLE_DEVICES unset, QA)
    assert client.get_run(logged["ce"]).data.tags["hpsearch.gpu"] == "none"


def test_a_retry_that_trains_no_epoch_still_charts_its_checkpoints(
    pg_url: str, tmp_path: Path, mlflow_server: LocalServer
) -> None:
    """A retry that stops before its first epoch (its time limit already spent, a stop in
    its set-up) logged no epoch, so its run got none of the checkpoint's: it gets them as
    it ends."""
    import json

    cfg = hps.load_config("tiny", [f"name=noepoch-{uuid.uuid4().hex[:8]}"])
    session = TrackingSession(cfg, resolve_storage(pg_url, tmp_path), mlflow_server.url, "w0")
    study = optuna.create_study(storage=normalize_url(pg_url), study_name=cfg.name,
                                direction="maximize")  # fmt: skip
    history = [{"epoch": e, "train_loss": 2.0 / e, "train_acc": 0.1 * e, "val_loss": 2.5 / e,
                "val_acc": 0.1 * e, "lr": 0.1, "epoch_seconds": 1.0, "images_per_second": 9.0}
               for e in (1, 2)]  # fmt: skip
    ckpt = tmp_path / "c.pt"
    ckpt.write_text(json.dumps({"epoch": 2, "history": history}))
    trial = study.ask()
    run = session.start_trial(trial, suggest(trial, cfg), trial.number + 5, ckpt)  # a retry
    assert run is not None and run.run_id
    run.finish_failed("interrupted", "stopped before its first epoch", None)
    session.close()
    client = MlflowClient(tracking_uri=mlflow_server.url)
    val = {m.step: m.value for m in client.get_metric_history(run.run_id, "val_acc")}
    assert val == pytest.approx({1: 0.1, 2: 0.2})
    assert [m.step for m in client.get_metric_history(run.run_id, "images_per_second")] == [1, 2]
